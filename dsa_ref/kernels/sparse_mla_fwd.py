"""TileLang kernels: sparse MLA forward.

Problem (per query ``t``): ``H`` heads of an absorbed query ``q[t] [H, 576]`` attend to the ``K``
latent rows ``kv[indices[t, j]] [576]`` the query selected; the first 512 channels of a row are its
value. All heads of a query share its selection, so one block of threads owns one query (and up to
64 of its heads): it gathers the selected rows by index into shared memory, 64 at a time, and runs
FlashAttention's online softmax over them:

    for each block of 64 selected rows:
        S = Q @ KV_blk^T                  [H_blk, 64]   (tensor cores, fp32 accumulate)
        m_new = max(m, rowmax(S));  P = exp(S - m_new);  l = l * exp(m - m_new) + rowsum(P)
        O = O * exp(m - m_new) + P @ V_blk  [H_blk, 512]
    out = O / l;  lse = m + log(l)

Three schedules of the same math:

* `simple_kernel` -- every thread does everything in turn (gather, QK, softmax, PV), pipelined by
  the compiler. Easy to read.
* `warp_specialized_kernel` -- three warpgroups: a *producer* gathers the next blocks of rows with
  asynchronous copies while *consumer 0* computes QK, the softmax and the left half of PV and
  *consumer 1* the right half of PV, synchronised by barriers.
* `staggered_kernel` -- FlashMLA's SM90 scheme: the two consumers each own a 64-row block of a pair
  and half of the value columns, exchange their maxima and probabilities through shared memory, and
  overlap one block's exponentials with the other's matrix products. The default
  (``schedule="auto"``) wherever it applies: on an H100, the public call runs at 0.97-0.98x
  FlashMLA's speed at 4096 x 8192 and 1.00-1.02x at 16384 x 16384, in the same process (docs,
  chapter 5).

Conventions at this boundary: indices int32 (int64 too for the staggered kernel), ``-1`` = unused
slot, natural-log LSE, rows with no valid slot give ``out = 0`` and ``lse = -inf``. An unused slot
gathers a row of zeros, so whatever the other rows hold, it adds exact zeros to every product (a
masked probability times a NaN row would be NaN): the simple and warp-specialised kernels read one
extra row of zeros at the end of ``KV`` (the wrapper appends it,
`dsa_ref.kernels.autograd.with_zero_row`); the staggered kernel's copies write zeros for it without
reading ``KV``. No gather reads outside ``KV`` for an index out of range (the wrapper raises for it
after the launch): the simple and staggered kernels clamp the row into ``KV``, the
warp-specialised one's copies are guarded by TileLang. ``K`` must be a multiple of 64 (the wrapper
pads with ``-1``). ``K`` is not a compile-time constant: one compiled kernel serves every top-k.
Each row visits only its blocks up to the last valid slot (``NumBlocks``, which the staggered kernel
counts itself), so the ``-1`` padding of short windows (early queries of a causal sequence) costs
nothing.
"""


import functools

import tilelang

from ._target import compile_target
import tilelang.language as T


def zero_row_or(row, num_rows):
    """The row a slot gathers: ``row`` (clamped into the buffer) for a valid slot, and for a ``-1``
    slot the last row, which the wrapper fills with zeros (`dsa_ref.kernels.autograd.with_zero_row`)."""
    return T.if_then_else(row >= 0, T.min(row, num_rows - 1), num_rows - 1)

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
BLOCK_I = 64  # selected rows per step
COUNT_CHUNK = 256 * 8  # the staggered kernel's count: 8 slots per consumer thread at a time
P_READY = 8  # the staggered kernel's named barriers 8 and 9 (TileLang's own syncs use lower ids)
OWN_SYNC = 3  # and 3 + c: consumer c's 128 threads (the staggered kernel writes its syncs out)

# One 16-byte ``cp.async`` that copies ``gmem`` when ``used`` and otherwise writes 16 zero bytes
# without reading anything (PTX ISA: cp.async with a source size, here 16 or 0 bytes).
_CP_ASYNC_ZFILL = r"""
__device__ __forceinline__ void dsa_cp_async_zfill_16(void* smem, const void* gmem, bool used) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(s), "l"(gmem), "r"(used ? 16 : 0) : "memory");
}
"""

_PASS_SIMPLE = {
    tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
    tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True,
    # K is a runtime size, so TileLang would guard every load of Indices with ``slot < K``; the
    # wrapper pads K to a multiple of 64, and the gathers clamp every index into [0, S)
    tilelang.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS: True,
}


def head_blocking(heads: int) -> tuple[int, int]:
    """``(heads per block, blocks per query)``: 64-head blocks above 64 heads, else one block."""
    if heads > 64:
        if heads % 64:
            raise ValueError(f"heads > 64 must be a multiple of 64, got {heads}")
        return 64, heads // 64
    if heads not in (16, 32, 64):
        raise ValueError(f"heads <= 64 must be 16, 32 or 64, got {heads}")
    return heads, 1


# --8<-- [start:simple_kernel]
@functools.lru_cache(maxsize=None)
def simple_kernel(heads: int, dim: int, dim_v: int, sm_scale: float,
                  num_stages: int = 2, threads: int = 256):
    """Compile the simple sparse MLA forward for these sizes (any number of queries, keys, slots).

    Kernel arguments: ``Q [T, H, D]``, ``KV [S, D]`` bf16, ``Indices [T, K]`` int32 (``K`` a
    multiple of 64), ``NumBlocks [T]`` int32 (how many 64-slot blocks of each row to visit: the
    blocks after the last valid slot hold only ``-1`` and are skipped); returns ``Out [T, H, dim_v]``
    bf16 and ``Lse [T, H]`` fp32. The loop's trip count is a runtime value, so TileLang 0.1.15 needs
    its epilogue unrolled explicitly (``pragma_unroll_explicit``) to pipeline it.
    """
    hb, per_query = head_blocking(heads)
    dim_tail = dim - dim_v
    scale2 = sm_scale * LOG2E  # exp(x * sm_scale) == exp2(x * scale2)
    num_q, num_kv, topk = T.dynamic("num_q"), T.dynamic("num_kv"), T.dynamic("topk")
    bf16, f32 = "bfloat16", "float32"

    @T.prim_func
    def main(Q: T.Tensor((num_q, heads, dim), bf16), KV: T.Tensor((num_kv, dim), bf16),
             Indices: T.Tensor((num_q, topk), "int32"), NumBlocks: T.Tensor((num_q,), "int32"),
             Out: T.Tensor((num_q, heads, dim_v), bf16), Lse: T.Tensor((num_q, heads), f32)):
        with T.Kernel(num_q * per_query, threads=threads) as bx:
            t = bx // per_query
            h0 = (bx % per_query) * hb
            q_s = T.alloc_shared((hb, dim), bf16)
            v_s = T.alloc_shared((BLOCK_I, dim_v), bf16)  # the value part of the gathered rows
            tail_s = T.alloc_shared((BLOCK_I, dim_tail), bf16)  # their rope part
            p_s = T.alloc_shared((hb, BLOCK_I), bf16)
            valid = T.alloc_fragment((BLOCK_I,), "bool")
            acc_s = T.alloc_fragment((hb, BLOCK_I), f32)
            acc_o = T.alloc_fragment((hb, dim_v), f32)
            m = T.alloc_fragment((hb,), f32)
            m_prev = T.alloc_fragment((hb,), f32)
            l = T.alloc_fragment((hb,), f32)
            l_blk = T.alloc_fragment((hb,), f32)
            alpha = T.alloc_fragment((hb,), f32)

            T.fill(acc_o, 0)
            T.fill(l, 0)
            T.fill(m, -(2.0**30))  # finite: masked -inf scores then give exp2(-inf) = 0, never NaN
            T.copy(Q[t, h0:h0 + hb, :dim_v], q_s[:, :dim_v], disable_tma=True)
            T.copy(Q[t, h0:h0 + hb, dim_v:], q_s[:, dim_v:], disable_tma=True)

            for blk in T.Pipelined(NumBlocks[t], num_stages=num_stages,
                                   annotations={"pragma_unroll_explicit": True}):
                for i in T.Parallel(BLOCK_I):
                    valid[i] = Indices[t, blk * BLOCK_I + i] >= 0
                # gather the selected rows; a -1 slot reads the zero row at the end, and the clamp
                # keeps an out-of-range index (which the wrapper then reports) inside kv
                for i, d in T.Parallel(BLOCK_I, dim_v):
                    v_s[i, d] = KV[zero_row_or(Indices[t, blk * BLOCK_I + i], num_kv), d]
                for i, d in T.Parallel(BLOCK_I, dim_tail):
                    tail_s[i, d] = KV[zero_row_or(Indices[t, blk * BLOCK_I + i], num_kv), dim_v + d]
                for h, i in T.Parallel(hb, BLOCK_I):
                    acc_s[h, i] = T.if_then_else(valid[i], 0, -T.infinity(f32))
                T.gemm(q_s[:, :dim_v], v_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                T.gemm(q_s[:, dim_v:], tail_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                # online softmax
                T.copy(m, m_prev)
                T.reduce_max(acc_s, m, dim=1, clear=False)
                for h in T.Parallel(hb):
                    m[h] = T.max(m[h], m_prev[h])
                    alpha[h] = T.exp2((m_prev[h] - m[h]) * scale2)
                for h, i in T.Parallel(hb, BLOCK_I):
                    acc_s[h, i] = T.exp2(acc_s[h, i] * scale2 - m[h] * scale2)
                T.reduce_sum(acc_s, l_blk, dim=1)
                for h in T.Parallel(hb):
                    l[h] = l[h] * alpha[h] + l_blk[h]
                for h, d in T.Parallel(hb, dim_v):
                    acc_o[h, d] = acc_o[h, d] * alpha[h]
                T.copy(acc_s, p_s)
                T.gemm(p_s, v_s, acc_o, policy=T.GemmWarpPolicy.FullRow)

            for h, d in T.Parallel(hb, dim_v):
                acc_o[h, d] = T.if_then_else(l[h] > 0, acc_o[h, d] / l[h], 0)
            for h in T.Parallel(hb):
                l[h] = T.if_then_else(l[h] > 0, (T.log2(l[h]) + m[h] * scale2) * LN2, -T.infinity(f32))
            T.copy(acc_o, Out[t, h0:h0 + hb, :])
            T.copy(l, Lse[t, h0:h0 + hb])

    return tilelang.compile(main, out_idx=[4, 5], pass_configs=_PASS_SIMPLE, target=compile_target())
# --8<-- [end:simple_kernel]


# --8<-- [start:warp_specialized_kernel]
_PASS_WS = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}
# The staggered kernel reads Indices only below its pairs' end (K is a multiple of 128) and clamps
# every gathered row into [0, S] (`zero_row_or`), so TileLang's guards on those loads are only cost.
# Its syncs are written out (TileLang's thread-sync pass off): the pass would put a sync of the
# producer's 128 threads after every store of a slot's valid flag (16 a pair), which nothing needs,
# since the flags reach the consumers through the ``kv_ready`` barriers.
_PASS_STAGGERED = {**_PASS_WS, tilelang.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS: True,
                   tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True}


@functools.lru_cache(maxsize=None)
def warp_specialized_kernel(heads: int, dim: int, dim_v: int, sm_scale: float):
    """Compile the warp-specialised sparse MLA forward (64 heads per block, two KV stages).

    Arguments as for `simple_kernel`, except that ``K`` is a multiple of 128 and ``NumBlocks``
    counts *pairs* of 64-slot blocks (one per stage).

    Warpgroups (128 threads each):

    * **consumer 0** (threads 0-127): ``S = Q K^T`` over all 576 channels, the online softmax,
      the left half of ``O += P V`` (value channels 0-255); writes ``P`` and the rescale factors
      to shared memory for consumer 1;
    * **consumer 1** (threads 128-255): the right half of ``O += P V`` (channels 256-511);
    * **producer** (threads 256-383): gathers the next block of 64 selected rows into the free
      stage with ``cp.async``, 16 bytes (8 bf16) per copy.

    Barriers: ``kv_ready[stage]`` (producer -> consumers), ``kv_free[stage]`` (consumers ->
    producer), ``p_ready`` / ``p_free`` (consumer 0 <-> consumer 1 around the shared ``P``), and
    ``l_ready`` so consumer 1 reads the final row sums only after consumer 0 wrote them.
    """
    hb, per_query = head_blocking(heads)
    if hb != 64:
        raise ValueError(f"the warp-specialised kernel needs 64-head blocks, got heads={heads}")
    if dim % 64 or dim_v % 2:
        raise ValueError(f"dim must be a multiple of 64 and dim_v even, got {dim}, {dim_v}")
    half = dim_v // 2
    scale2 = sm_scale * LOG2E
    num_q, num_kv, topk = T.dynamic("num_q"), T.dynamic("num_kv"), T.dynamic("topk")
    bf16, f32 = "bfloat16", "float32"
    chunks_per_row = dim // 64  # each producer thread copies 8 channels of every 64-channel chunk

    @T.prim_func
    def main(Q: T.Tensor((num_q, heads, dim), bf16), KV: T.Tensor((num_kv, dim), bf16),
             Indices: T.Tensor((num_q, topk), "int32"), NumBlocks: T.Tensor((num_q,), "int32"),
             Out: T.Tensor((num_q, heads, dim_v), bf16), Lse: T.Tensor((num_q, heads), f32)):
        with T.Kernel(num_q * per_query, threads=384) as bx:
            t = bx // per_query
            h0 = (bx % per_query) * hb
            n_pairs = NumBlocks[t]  # the loop steps over pairs of blocks, one per stage
            q_s = T.alloc_shared((hb, dim), bf16)
            o_s = q_s  # Q is dead once the last QK is issued: reuse its space to stage the output
            kv_s = T.alloc_shared((2, BLOCK_I, dim), bf16)
            p_s = T.alloc_shared((hb, BLOCK_I), bf16)
            valid_s = T.alloc_shared((2, BLOCK_I), "bool", scope="shared")
            alpha_s = T.alloc_shared((hb,), f32, scope="shared")
            l_s = T.alloc_shared((hb,), f32, scope="shared")

            acc_s = T.alloc_fragment((hb, BLOCK_I), f32)
            acc_o_left = T.alloc_fragment((hb, half), f32)
            acc_o_right = T.alloc_fragment((hb, half), f32)
            m = T.alloc_fragment((hb,), f32)
            m_prev = T.alloc_fragment((hb,), f32)
            l = T.alloc_fragment((hb,), f32)
            l_blk = T.alloc_fragment((hb,), f32)
            alpha = T.alloc_fragment((hb,), f32)
            row = T.alloc_var("int32")

            q_ready = T.alloc_barrier(arrive_count=384)
            kv_ready = T.alloc_barrier(arrive_count=[128, 128])
            kv_free = T.alloc_barrier(arrive_count=[256, 256])
            p_ready = T.alloc_barrier(arrive_count=256)
            p_free = T.alloc_barrier(arrive_count=256)
            l_ready = T.alloc_barrier(arrive_count=256)

            tx = T.get_thread_binding()
            T.tma_copy(Q[t, h0:h0 + hb, :], q_s, barrier=q_ready)
            T.barrier_arrive(q_ready)

            if tx < 128:  # consumer 0: QK, softmax, left half of PV
                T.set_max_nreg(240, 1)
                T.fill(l, 0)
                T.fill(m, -(2.0**30))
                T.fill(acc_o_left, 0)
                T.barrier_wait(q_ready, 0)
                for it in T.serial(n_pairs):
                    for stage in T.unroll(2):
                        T.barrier_wait(kv_ready[stage], it & 1)
                        for h, i in T.Parallel(hb, BLOCK_I):
                            acc_s[h, i] = T.if_then_else(valid_s[stage, i], 0, -T.infinity(f32))
                        T.wgmma_gemm(q_s[:, :half], kv_s[stage, :, :half], acc_s, transpose_B=True)
                        T.wgmma_gemm(q_s[:, half:dim_v], kv_s[stage, :, half:dim_v], acc_s, transpose_B=True)
                        T.wgmma_gemm(q_s[:, dim_v:], kv_s[stage, :, dim_v:], acc_s, transpose_B=True)
                        T.wait_wgmma(0)
                        if it != 0 or stage != 0:  # consumer 1 must be done with the previous P
                            T.barrier_arrive(p_free)
                            T.barrier_wait(p_free, ((it * 2 + stage) & 1) ^ 1)
                        T.copy(m, m_prev)
                        T.reduce_max(acc_s, m, dim=1, clear=False)
                        for h in T.Parallel(hb):
                            m[h] = T.max(m[h], m_prev[h])
                        for h in T.Parallel(hb):
                            alpha[h] = T.exp2((m_prev[h] - m[h]) * scale2)
                        for h, i in T.Parallel(hb, BLOCK_I):
                            acc_s[h, i] = T.exp2(acc_s[h, i] * scale2 - m[h] * scale2)
                        T.reduce_sum(acc_s, l_blk, dim=1)
                        for h in T.Parallel(hb):
                            l[h] = l[h] * alpha[h] + l_blk[h]
                        for h, d in T.Parallel(hb, half):
                            acc_o_left[h, d] = acc_o_left[h, d] * alpha[h]
                        T.copy(alpha, alpha_s)
                        T.copy(acc_s, p_s)
                        T.gemm(p_s, kv_s[stage, :, :half], acc_o_left)
                        T.barrier_arrive(p_ready)
                        T.barrier_arrive(kv_free[stage])
                T.copy(l, l_s)
                T.barrier_arrive(l_ready)
                for h, d in T.Parallel(hb, half):
                    acc_o_left[h, d] = T.if_then_else(l[h] > 0, acc_o_left[h, d] / l[h], 0)
                for h in T.Parallel(hb):
                    l[h] = T.if_then_else(l[h] > 0, (T.log2(l[h]) + m[h] * scale2) * LN2, -T.infinity(f32))
                T.copy(acc_o_left, o_s[:, :half])
                T.copy(o_s[:, :half], Out[t, h0:h0 + hb, :half])
                T.copy(l, Lse[t, h0:h0 + hb])
            elif tx < 256:  # consumer 1: right half of PV
                T.set_max_nreg(168, 1)
                T.fill(acc_o_right, 0)
                for it in T.serial(n_pairs):
                    for stage in T.unroll(2):
                        T.barrier_arrive(p_ready)
                        T.barrier_wait(p_ready, (it * 2 + stage) & 1)
                        for h, d in T.Parallel(hb, half):
                            acc_o_right[h, d] = acc_o_right[h, d] * alpha_s[h]
                        T.gemm(p_s, kv_s[stage, :, half:dim_v], acc_o_right)
                        T.barrier_arrive(kv_free[stage])
                        if it != n_pairs - 1 or stage != 1:
                            T.barrier_arrive(p_free)
                T.barrier_arrive(l_ready)
                T.barrier_wait(l_ready, 0)
                for h, d in T.Parallel(hb, half):
                    acc_o_right[h, d] = T.if_then_else(l_s[h] > 0, acc_o_right[h, d] / l_s[h], 0)
                T.copy(acc_o_right, o_s[:, half:dim_v])
                T.copy(o_s[:, half:dim_v], Out[t, h0:h0 + hb, half:dim_v])
            else:  # producer: gather selected rows into the free stage
                T.set_max_nreg(80, 0)
                p = tx - 256  # 0..127: 16 rows at a time, 8 threads per row
                for it in T.serial(n_pairs):
                    for stage in T.unroll(2):
                        T.barrier_wait(kv_free[stage], (it & 1) ^ 1)
                        for r in T.serial(BLOCK_I // 16):
                            slot = r * 16 + p // 8
                            row = Indices[t, (it * 2 + stage) * BLOCK_I + slot]
                            valid_s[stage, slot] = row >= 0
                            row = zero_row_or(row, num_kv)  # a -1 slot copies the zero row and is masked
                            # (TileLang guards this copy with 0 <= row < S: an out-of-range index,
                            # which the wrapper reports after the launch, reads zeros, not past kv)
                            for u in T.serial(chunks_per_row):
                                T.ptx_cp_async(
                                    T.access_ptr(kv_s[stage, slot, 64 * u + (p % 8) * 8], "w", 8),
                                    T.access_ptr(KV[row, 64 * u + (p % 8) * 8], "r", 8),
                                    8,  # elements: 8 bf16 = one 16-byte cp.async
                                )
                        T.cp_async_barrier_noinc(kv_ready[stage])

    return tilelang.compile(main, out_idx=[4, 5], pass_configs=_PASS_WS, target=compile_target())
# --8<-- [end:warp_specialized_kernel]


# --8<-- [start:staggered_kernel]
@T.macro
def copy_half(p, it, stage, right, KV, kv_s, rope_s, valid_s, rows, kv_free, kv_ready, num_kv, half):
    """One half of one stage (Python ints ``stage``, ``right``): channels ``[0, half)`` (L) or
    ``[half, D)`` (R; its rope channels go to the stage's ``rope_s``) of the stage's 64 rows, behind
    its own ``kv_free`` / ``kv_ready`` barrier (index ``2 * stage + right``). The L half of stage 0
    and the R half of stage 1 come first, so they also carry the stage's validity flags.

    A ``-1`` slot's row is zero-filled by its copies (``cp.async`` with a source size of 0 bytes:
    nothing is read), so ``KV`` needs no zero row."""
    dim_v = kv_s.shape[2]
    lo, hi = (half, dim_v) if right else (0, half)
    T.barrier_wait(kv_free[2 * stage + right], (it & 1) ^ 1)
    if right == stage:  # (0, L) and (1, R): the stage's first half; the flags before the copies, so that
        for r in T.unroll(BLOCK_I // 16):  # ptxas orders them against the copies once, not once a row
            valid_s[stage, r * 16 + p // 8] = rows[stage, r] >= 0
    for r in T.unroll(BLOCK_I // 16):
        slot = r * 16 + p // 8
        used = T.And(rows[stage, r] >= 0, num_kv > 0)  # else 16 bytes of zeros per copy
        row = T.max(T.min(rows[stage, r], num_kv - 1), 0)  # one row per thread, clamped into KV
        for u in T.unroll((hi - lo) // 64):
            col = lo + 64 * u + (p % 8) * 8
            T.call_extern("handle", "dsa_cp_async_zfill_16", T.access_ptr(kv_s[stage, slot, col], "w", 8),
                          T.access_ptr(KV[row, col], "r", 8), used)
        if right:  # the rope channels, into their own buffer
            T.call_extern("handle", "dsa_cp_async_zfill_16",
                          T.access_ptr(rope_s[stage][slot, (p % 8) * 8], "w", 8),
                          T.access_ptr(KV[row, dim_v + (p % 8) * 8], "r", 8), used)
    T.cp_async_barrier_noinc(kv_ready[2 * stage + right])


@T.macro
def gather_halves(p, t, n_pairs, Indices, KV, kv_s, rope_s, valid_s, rows, kv_free, kv_ready, num_kv, half):
    """The producer of `staggered_kernel` (thread ``p`` of 128): each pair's two blocks, in halves.

    Every stage is copied in two halves with their own barriers, in the order the consumers need
    them: stage 0 L, stage 1 R, stage 0 R, stage 1 L. A pair's 8 row indices per thread are loaded
    before its first copy. 16 rows at a time, 8 threads per row, 8 channels (16 bytes) per
    ``cp.async``; a ``-1`` slot is zero-filled and marked invalid in ``valid_s``.
    """
    for it in T.serial(n_pairs):
        for stage in T.unroll(2):
            for r in T.unroll(BLOCK_I // 16):
                index = Indices[t, (it * 2 + stage) * BLOCK_I + r * 16 + p // 8]
                if Indices.dtype == "int64":  # clamped before the narrowing cast: no value wraps into [0, S)
                    index = T.Cast("int32", T.min(index, T.Cast("int64", num_kv)))
                rows[stage, r] = index
        copy_half(p, it, 0, 0, KV, kv_s, rope_s, valid_s, rows, kv_free, kv_ready, num_kv, half)
        copy_half(p, it, 1, 1, KV, kv_s, rope_s, valid_s, rows, kv_free, kv_ready, num_kv, half)
        copy_half(p, it, 0, 1, KV, kv_s, rope_s, valid_s, rows, kv_free, kv_ready, num_kv, half)
        copy_half(p, it, 1, 0, KV, kv_s, rope_s, valid_s, rows, kv_free, kv_ready, num_kv, half)


@T.macro
def count_pairs(c, t, Indices, count_s, count_ready, last, largest):
    """Consumer thread ``c`` of 256 at the start of `staggered_kernel`: how many pairs of 64-slot
    blocks reach the last valid slot of query ``t``, so that the trailing ``-1`` pairs of a short
    causal window are never gathered or computed (the other kernels take this count from the wrapper,
    `dsa_ref.kernels.autograd._block_counts`, a pass of its own over ``Indices``).

    Each thread reads 8 consecutive slots of every 2048 (one pair is 128 slots: 16 threads), notes
    the highest pair that holds a valid one, and the warp's maximum goes to ``count_s``; the
    producer and both consumers read the 8 warps' values after ``count_ready``. The loads overlap
    the wait for ``Q``, and they bring the row into the L1 cache for the producer's own reads."""
    topk = Indices.shape[1]
    last[0] = 0
    for chunk in T.serial(T.ceildiv(topk, COUNT_CHUNK)):
        slot = chunk * COUNT_CHUNK + c * 8  # topk is a multiple of 128: all 8 slots are in or out
        if slot < topk:
            largest[0] = Indices[t, slot]
            for e in T.unroll(1, 8):
                largest[0] = T.max(largest[0], Indices[t, slot + e])
            if largest[0] >= 0:
                last[0] = slot // (2 * BLOCK_I) + 1
    last[0] = T.warp_reduce_max(last[0])
    if c % 32 == 0:
        count_s[c // 32] = last[0]
    T.barrier_arrive(count_ready)


@T.macro
def read_count(count_s, count_ready, n_pairs):
    """``n_pairs[0]``: the largest of the consumers' 8 warp maxima (see `count_pairs`)."""
    T.barrier_wait(count_ready, 0)
    n_pairs[0] = count_s[0]
    for w in T.unroll(1, 8):
        n_pairs[0] = T.max(n_pairs[0], count_s[w])


@functools.lru_cache(maxsize=None)
def staggered_kernel(heads: int, dim: int, dim_v: int, sm_scale: float, index_dtype: str = "int32"):
    """Compile the staggered sparse MLA forward (64 heads per block; FlashMLA's SM90 scheme).

    Arguments as for `warp_specialized_kernel` (``K`` a multiple of 128), except that there is no
    ``NumBlocks``: the consumers count each row's pairs of 64-slot blocks themselves while ``Q``
    loads (`count_pairs`), which saves the wrapper's pass over the indices; and ``Indices`` may also
    be int64 (``index_dtype``), as `dsa_ref.topk_indices` returns them: the wrapper then passes them
    without an int32 copy.

    Each pair's blocks sit in two stages; consumer ``c`` computes ``S_c = Q K_c^T`` of stage ``c``
    and one half of the output, ``O_L`` (consumer 0) or ``O_R`` (consumer 1), from *both* blocks:

    * **consumer 0** exponentiates ``S_0`` with its own maximum ``m_0 = max(m, rowmax S_0)``
      and starts ``O_L += P_0 V_0,L`` from registers at once; consumer 1 takes ``m_0``, forms the
      pair's maximum ``m' = max(m_0, rowmax S_1)``, exponentiates ``S_1`` with it and starts
      ``O_R += P_1 V_1,R``; consumer 0 then rescales ``P_0`` by ``exp(m_0 - m')`` (and ``O_L`` and its
      row sum), so both halves refer to ``m'``. The two consumers' softmax steps follow each other
      instead of running at the same time, and each one's tensor cores have work queued meanwhile.
    * The blocks are then swapped through shared memory: ``P_0`` goes into stage 0's rope buffer
      (its ``S`` is done), ``P_1`` into a buffer of its own, and ``O_L += P_1 V_1,L``,
      ``O_R += P_0 V_0,R``. Consumer 0 issues the next pair's ``S_0`` while its last product runs.
    * The **producer** copies every stage in two halves (channels ``[0, 256)`` and ``[256, 576)``)
      with their own barriers, so a half is refilled as soon as its last reader is done. A stage's
      rope channels sit in a ``[64, 64]`` buffer of their own (``rope_s``), the shape TileLang writes
      with ``stmatrix`` when ``P_0`` takes their place.

    Barriers: ``kv_ready`` / ``kv_free`` per half-stage (producer <-> its consumers), ``max_ready[c]``
    (consumer ``c``'s maximum in ``max_s[c]``), the named barrier ``P_READY + c`` (its ``P`` in shared memory),
    ``l_ready`` (the row sums at the end), ``count_ready`` (the pair count in ``count_s``, at the
    start). Conventions, garbage and ``-1`` handling as in `warp_specialized_kernel`; the output is
    divided by the row sum as one reciprocal per row and a product per element.
    """
    hb, per_query = head_blocking(heads)
    if hb != 64:
        raise ValueError(f"the staggered kernel needs 64-head blocks, got heads={heads}")
    if index_dtype not in ("int32", "int64"):
        raise ValueError(f"index_dtype must be 'int32' or 'int64', got {index_dtype!r}")
    if dim - dim_v != BLOCK_I or dim_v % 128:
        raise ValueError(f"the staggered kernel keeps P [64, 64] in the rope buffer: dim - dim_v must be "
                         f"{BLOCK_I} and dim_v a multiple of 128, got {dim}, {dim_v}")
    half = dim_v // 2  # 256: the L half of a row is [0, 256), the R half [256, 576) with the rope part
    scale2 = sm_scale * LOG2E
    num_q, num_kv, topk = T.dynamic("num_q"), T.dynamic("num_kv"), T.dynamic("topk")
    bf16, f32 = "bfloat16", "float32"
    NEG = -(2.0**30)  # finite start for the maxima: masked -inf scores give exp2(-inf) = 0, never NaN

    @T.macro
    def init_scores(s, valid_s, stage):
        for h, i in T.Parallel(hb, BLOCK_I):
            s[h, i] = T.if_then_else(valid_s[stage, i], 0, -T.infinity(f32))  # -1 slots start at -inf

    @T.prim_func
    def main(Q: T.Tensor((num_q, heads, dim), bf16), KV: T.Tensor((num_kv, dim), bf16),
             Indices: T.Tensor((num_q, topk), index_dtype),
             Out: T.Tensor((num_q, heads, dim_v), bf16), Lse: T.Tensor((num_q, heads), f32)):
        with T.Kernel(num_q * per_query, threads=384) as bx:
            t = bx // per_query
            h0 = (bx % per_query) * hb
            q_s = T.alloc_shared((hb, dim), bf16)
            o_s = q_s  # Q is dead after the last S: the output is staged in its place
            kv_s = T.alloc_shared((2, BLOCK_I, dim_v), bf16)  # stage 0: even blocks, stage 1: odd blocks
            rope_s = [T.alloc_shared((BLOCK_I, dim - dim_v), bf16) for _ in range(2)]  # their rope channels
            p1_s = T.alloc_shared((hb, BLOCK_I), bf16)  # P_1 (P_0 lives in stage 0's rope buffer)
            valid_s = T.alloc_shared((2, BLOCK_I), "bool", scope="shared")
            max_s = T.alloc_shared((2, hb), f32, scope="shared")
            l_s = T.alloc_shared((2, hb), f32, scope="shared")
            # consumer 0's registers
            s0 = T.alloc_fragment((hb, BLOCK_I), f32)  # S_0, then P_0
            p0 = T.alloc_fragment((hb, BLOCK_I), bf16)  # P_0 as the A operand of its product
            o0 = T.alloc_fragment((hb, half), f32)  # O_L
            m0, m0_prev, m0_pair = (T.alloc_fragment((hb,), f32) for _ in range(3))
            l0, l0_blk, alpha0, f0, inv0 = (T.alloc_fragment((hb,), f32) for _ in range(5))
            # consumer 1's registers
            s1 = T.alloc_fragment((hb, BLOCK_I), f32)  # S_1, then P_1
            p1 = T.alloc_fragment((hb, BLOCK_I), bf16)
            o1 = T.alloc_fragment((hb, half), f32)  # O_R
            m1, m1_prev, m1_peer = (T.alloc_fragment((hb,), f32) for _ in range(3))
            l1, l1_blk, alpha1, inv1 = (T.alloc_fragment((hb,), f32) for _ in range(4))
            rows = T.alloc_local((2, BLOCK_I // 16), "int32")  # the producer's rows of a pair
            count_s = T.alloc_shared((8,), "int32", scope="shared")  # each consumer warp's pair count
            last = T.alloc_local((1,), "int32")  # a thread's count, then its warp's
            largest = T.alloc_local((1,), index_dtype)  # the largest index of 8 slots
            n_pairs = T.alloc_local((1,), "int32")  # the pairs this query visits

            q_ready = T.alloc_barrier(arrive_count=384)
            kv_ready = T.alloc_barrier(arrive_count=[128, 128, 128, 128])  # stage 0 L, 0 R, 1 L, 1 R
            kv_free = T.alloc_barrier(arrive_count=[128, 128, 128, 128])
            max_ready = T.alloc_barrier(arrive_count=[128, 128])
            # P_c in shared memory: named barriers P_READY + c (one consumer arrives, the other syncs;
            # neither can arrive twice before the other has synced, see the ``max_ready`` exchange)
            l_ready = T.alloc_barrier(arrive_count=256)
            count_ready = T.alloc_barrier(arrive_count=256)  # count_s is written

            tx = T.get_thread_binding()
            T.import_source(_CP_ASYNC_ZFILL)
            T.tma_copy(Q[t, h0:h0 + hb, :], q_s, barrier=q_ready)
            T.barrier_arrive(q_ready)

            if tx < 128:  # consumer 0: S_0, P_0, O_L
                T.set_max_nreg(216, 1)
                count_pairs(tx, t, Indices, count_s, count_ready, last, largest)
                T.fill(l0, 0)
                T.fill(m0, NEG)
                T.fill(o0, 0)
                read_count(count_s, count_ready, n_pairs)
                T.barrier_wait(q_ready, 0)
                if n_pairs[0] > 0:  # the first pair's S_0; the later ones are issued at the end of a pair
                    T.barrier_wait(kv_ready[0], 0)
                    init_scores(s0, valid_s, 0)
                    T.wgmma_gemm(q_s[:, :half], kv_s[0, :, :half], s0, transpose_B=True)
                    T.barrier_wait(kv_ready[1], 0)
                    T.wgmma_gemm(q_s[:, half:dim_v], kv_s[0, :, half:], s0, transpose_B=True)
                    T.wgmma_gemm(q_s[:, dim_v:], rope_s[0], s0, transpose_B=True)
                for it in T.serial(n_pairs[0]):
                    T.wait_wgmma(0)  # S_0 of this pair
                    # P_0 with consumer 0's own maximum; the maximum goes to consumer 1
                    T.copy(m0, m0_prev)
                    T.reduce_max(s0, m0, dim=1, clear=False)
                    T.copy(m0, max_s[0, :])
                    T.barrier_arrive(max_ready[0])
                    for h in T.Parallel(hb):
                        alpha0[h] = T.exp2((m0_prev[h] - m0[h]) * scale2)
                    for h, d in T.Parallel(hb, half):
                        o0[h, d] = o0[h, d] * alpha0[h]
                    for h, i in T.Parallel(hb, BLOCK_I):
                        s0[h, i] = T.exp2(s0[h, i] * scale2 - m0[h] * scale2)
                    T.reduce_sum(s0, l0_blk, dim=1)
                    for h in T.Parallel(hb):
                        l0[h] = l0[h] * alpha0[h] + l0_blk[h]
                    T.copy(s0, p0)
                    T.wgmma_gemm(p0, kv_s[0, :, :half], o0)  # O_L += P_0 V_0,L from registers
                    T.wait_wgmma(0)
                    T.barrier_arrive(kv_free[0])  # stage 0 L is read for the last time
                    # the pair's maximum from consumer 1: P_0, O_L and the row sum refer to it
                    T.barrier_wait(max_ready[1], it & 1)
                    T.copy(max_s[1, :], m0_pair)
                    for h in T.Parallel(hb):
                        f0[h] = T.exp2((m0[h] - m0_pair[h]) * scale2)
                    for h, i in T.Parallel(hb, BLOCK_I):
                        s0[h, i] = s0[h, i] * f0[h]
                    T.sync_threads(OWN_SYNC, 128)  # every warp's S_0 has read the rope buffer
                    T.copy(s0, rope_s[0])  # P_0 into stage 0's rope buffer, for consumer 1
                    T.fence_proxy_async()
                    T.named_barrier_arrive(P_READY, 256)
                    for h, d in T.Parallel(hb, half):
                        o0[h, d] = o0[h, d] * f0[h]
                    for h in T.Parallel(hb):
                        l0[h] = l0[h] * f0[h]
                    T.copy(m0_pair, m0)
                    T.sync_threads(P_READY + 1, 256)  # P_1 is in shared memory
                    T.wgmma_gemm(p1_s, kv_s[1, :, :half], o0)  # O_L += P_1 V_1,L
                    if it + 1 < n_pairs[0]:  # the next S_0 while that product runs
                        T.barrier_wait(kv_ready[0], (it + 1) & 1)
                        init_scores(s0, valid_s, 0)
                        T.wgmma_gemm(q_s[:, :half], kv_s[0, :, :half], s0, transpose_B=True)
                        T.wait_wgmma(1)
                        T.barrier_arrive(kv_free[2])  # stage 1 L is read for the last time
                        T.barrier_wait(kv_ready[1], (it + 1) & 1)
                        T.wgmma_gemm(q_s[:, half:dim_v], kv_s[0, :, half:], s0, transpose_B=True)
                        T.wgmma_gemm(q_s[:, dim_v:], rope_s[0], s0, transpose_B=True)
                    else:
                        T.wait_wgmma(0)
                        T.barrier_arrive(kv_free[2])
                T.copy(l0, l_s[0, :])
                T.barrier_arrive(l_ready)
                T.barrier_wait(l_ready, 0)
                for h in T.Parallel(hb):
                    l0[h] = l0[h] + l_s[1, h]
                    inv0[h] = 1 / l0[h]  # one reciprocal per row, not one per element
                for h, d in T.Parallel(hb, half):
                    o0[h, d] = T.if_then_else(l0[h] > 0, o0[h, d] * inv0[h], 0)
                T.copy(o0, o_s[:, :half])
                T.sync_threads(OWN_SYNC, 128)  # O_L in shared memory before its bulk store
                T.copy(o_s[:, :half], Out[t, h0:h0 + hb, :half])
                for h in T.Parallel(hb):
                    l0[h] = T.if_then_else(l0[h] > 0, (T.log2(l0[h]) + m0[h] * scale2) * LN2, -T.infinity(f32))
                T.copy(l0, Lse[t, h0:h0 + hb])
            elif tx < 256:  # consumer 1: S_1, P_1, O_R
                T.set_max_nreg(216, 1)
                count_pairs(tx, t, Indices, count_s, count_ready, last, largest)
                T.fill(l1, 0)
                T.fill(m1, NEG)
                T.fill(o1, 0)
                read_count(count_s, count_ready, n_pairs)
                T.barrier_wait(q_ready, 0)
                for it in T.serial(n_pairs[0]):
                    T.barrier_wait(kv_ready[3], it & 1)  # stage 1 R first, as the producer fills it
                    init_scores(s1, valid_s, 1)
                    T.wgmma_gemm(q_s[:, half:dim_v], kv_s[1, :, half:], s1, transpose_B=True)
                    T.wgmma_gemm(q_s[:, dim_v:], rope_s[1], s1, transpose_B=True)
                    T.barrier_wait(kv_ready[2], it & 1)
                    T.wgmma_gemm(q_s[:, :half], kv_s[1, :, :half], s1, transpose_B=True)
                    T.wait_wgmma(0)
                    # the pair's maximum: consumer 0's and this block's
                    T.copy(m1, m1_prev)
                    T.reduce_max(s1, m1, dim=1, clear=False)
                    T.barrier_wait(max_ready[0], it & 1)
                    T.copy(max_s[0, :], m1_peer)
                    for h in T.Parallel(hb):
                        m1[h] = T.max(m1[h], m1_peer[h])
                    T.copy(m1, max_s[1, :])
                    T.barrier_arrive(max_ready[1])
                    for h in T.Parallel(hb):
                        alpha1[h] = T.exp2((m1_prev[h] - m1[h]) * scale2)
                    for h, d in T.Parallel(hb, half):
                        o1[h, d] = o1[h, d] * alpha1[h]
                    for h, i in T.Parallel(hb, BLOCK_I):
                        s1[h, i] = T.exp2(s1[h, i] * scale2 - m1[h] * scale2)
                    T.reduce_sum(s1, l1_blk, dim=1)
                    for h in T.Parallel(hb):
                        l1[h] = l1[h] * alpha1[h] + l1_blk[h]
                    T.copy(s1, p1)
                    T.wgmma_gemm(p1, kv_s[1, :, half:dim_v], o1)  # O_R += P_1 V_1,R from registers
                    T.copy(p1, p1_s)  # P_1 for consumer 0
                    T.sync_threads(P_READY, 256)  # P_0 is in shared memory
                    T.wgmma_gemm(rope_s[0], kv_s[0, :, half:], o1)  # O_R += P_0 V_0,R
                    T.fence_proxy_async()
                    T.named_barrier_arrive(P_READY + 1, 256)
                    T.wait_wgmma(1)
                    T.barrier_arrive(kv_free[3])  # stage 1 R is read for the last time
                    T.wait_wgmma(0)
                    T.barrier_arrive(kv_free[1])  # stage 0 R (and P_0) too
                T.copy(l1, l_s[1, :])
                T.barrier_arrive(l_ready)
                T.barrier_wait(l_ready, 0)
                for h in T.Parallel(hb):
                    l1[h] = l1[h] + l_s[0, h]
                    inv1[h] = 1 / l1[h]  # one reciprocal per row, not one per element
                for h, d in T.Parallel(hb, half):
                    o1[h, d] = T.if_then_else(l1[h] > 0, o1[h, d] * inv1[h], 0)
                T.copy(o1, o_s[:, half:dim_v])
                T.sync_threads(OWN_SYNC + 1, 128)  # O_R in shared memory before its bulk store
                T.copy(o_s[:, half:dim_v], Out[t, h0:h0 + hb, half:dim_v])
            else:  # producer
                T.set_max_nreg(72, 0)
                read_count(count_s, count_ready, n_pairs)
                gather_halves(tx - 256, t, n_pairs[0], Indices, KV, kv_s, rope_s, valid_s, rows, kv_free, kv_ready,
                              num_kv, half)

    return tilelang.compile(main, out_idx=[3, 4], pass_configs=_PASS_STAGGERED, target=compile_target())
# --8<-- [end:staggered_kernel]
