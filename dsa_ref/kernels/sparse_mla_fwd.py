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

Two schedules of the same math:

* `simple_kernel` -- every thread does everything in turn (gather, QK, softmax, PV), pipelined by
  the compiler. Easy to read.
* `warp_specialized_kernel` -- three warpgroups: a *producer* gathers the next blocks of rows with
  asynchronous copies while *consumer 0* computes QK, the softmax and the left half of PV and
  *consumer 1* the right half of PV, synchronised by barriers (the schedule FlashMLA uses).

Conventions at this boundary: indices int32, ``-1`` = unused slot, natural-log LSE, rows with no
valid slot give ``out = 0`` and ``lse = -inf``. ``KV`` holds one extra row of zeros at its end
(the wrapper appends it, `dsa_ref.kernels.autograd.with_zero_row`): a ``-1`` slot reads that row,
so whatever the other rows hold, an unused slot adds exact zeros to every product (a masked
probability times a NaN row would be NaN). No gather reads outside ``KV`` for an index out of
range (the wrapper raises for it after the launch): the simple kernel clamps the row into
``[0, S]``, the warp-specialised one's copies are guarded by TileLang. ``K`` must be
a multiple of 64 (the wrapper pads with ``-1``). ``K`` is not a compile-time constant: one
compiled kernel serves every top-k. Each row visits only its blocks up to the last valid slot (``NumBlocks``), so the
``-1`` padding of short windows (early queries of a causal sequence) costs nothing.
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

_PASS_SIMPLE = {
    tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True,
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
            T.copy(Q[t, h0:h0 + hb, :dim_v], q_s[:, :dim_v])
            T.copy(Q[t, h0:h0 + hb, dim_v:], q_s[:, dim_v:])

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


# --8<-- [start:gather_pairs]
@T.macro
def gather_pairs(p, t, n_pairs, Indices, KV, kv_s, valid_s, rows, kv_free, kv_ready, num_kv, topk, prefetch_rows):
    """The producer warpgroup's loop (thread ``p`` of 128): gather each 64-slot block into its stage.

    Per stage, 16 rows at a time, 8 threads per row, each copying 8 channels (16 bytes) of every
    64-channel chunk with ``cp.async``; the stage's ``kv_ready`` barrier fires when the copies land.
    A ``-1`` slot copies the zero row and is marked invalid in ``valid_s``. With ``prefetch_rows``
    the thread's 4 row indices of a stage are loaded one pair ahead, right after the stage's copies
    are issued, so the copies of the next pair never wait for an index load; without it each
    index is loaded just before its copies (4 dependent loads per stage).
    """
    if prefetch_rows:
        for stage in T.unroll(2):  # the first pair's rows (a row holds at least 128 slots)
            for r in T.unroll(BLOCK_I // 16):
                rows[stage, r] = Indices[t, stage * BLOCK_I + r * 16 + p // 8]
    for it in T.serial(n_pairs):
        for stage in T.unroll(2):
            T.barrier_wait(kv_free[stage], (it & 1) ^ 1)
            for r in T.unroll(BLOCK_I // 16):
                slot = r * 16 + p // 8
                if not prefetch_rows:
                    rows[stage, r] = Indices[t, (it * 2 + stage) * BLOCK_I + slot]
                valid_s[stage, slot] = rows[stage, r] >= 0
                # a -1 slot copies the zero row (and is masked); TileLang guards the copy with
                # 0 <= row < S, so an out-of-range index (reported by the wrapper) reads zeros
                for u in T.serial(KV.shape[1] // 64):
                    T.ptx_cp_async(
                        T.access_ptr(kv_s[stage, slot, 64 * u + (p % 8) * 8], "w", 8),
                        T.access_ptr(KV[zero_row_or(rows[stage, r], num_kv), 64 * u + (p % 8) * 8], "r", 8),
                        8,  # elements: 8 bf16 = one 16-byte cp.async
                    )
            T.cp_async_barrier_noinc(kv_ready[stage])
            if prefetch_rows:
                if it + 1 < n_pairs:  # the next pair's rows of this stage, while the copies run
                    for r in T.unroll(BLOCK_I // 16):
                        rows[stage, r] = Indices[t, ((it + 1) * 2 + stage) * BLOCK_I + r * 16 + p // 8]
# --8<-- [end:gather_pairs]


# --8<-- [start:warp_specialized_kernel]
_PASS_WS = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}


@functools.lru_cache(maxsize=None)
def warp_specialized_kernel(heads: int, dim: int, dim_v: int, sm_scale: float, prefetch_rows: bool = True):
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
            rows = T.alloc_local((2, BLOCK_I // 16), "int32")  # the producer's rows of both stages

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
                gather_pairs(tx - 256, t, n_pairs, Indices, KV, kv_s, valid_s, rows, kv_free, kv_ready, num_kv, topk,
                             prefetch_rows)

    return tilelang.compile(main, out_idx=[4, 5], pass_configs=_PASS_WS, target=compile_target())
# --8<-- [end:warp_specialized_kernel]


# --8<-- [start:seesaw_kernel]
@functools.lru_cache(maxsize=None)
def seesaw_kernel(heads: int, dim: int, dim_v: int, sm_scale: float, prefetch_rows: bool = True):
    """Compile the "seesaw" sparse MLA forward: two consumers that each own every other block.

    Arguments as for `warp_specialized_kernel` (``K`` a multiple of 128, ``NumBlocks`` counts
    pairs of 64-slot blocks). In `warp_specialized_kernel` consumer 0 does all of ``S = Q K^T``
    and the softmax while consumer 1 waits for ``P``: per block, 576 + 256 channels of
    tensor-core work on one side, 256 on the other. Here the work is split evenly (FlashMLA's
    SM90 sparse prefill splits it this way too):

    * **consumer 0** (threads 0-127) computes ``S0`` of the *even* block (stage 0), **consumer 1**
      (threads 128-255) ``S1`` of the *odd* block (stage 1), at the same time;
    * they swap their row maxima through shared memory, so both rescale with the same running
      maximum ``m``; each exponentiates its own block (``P0``, ``P1``) and adds its row sums;
    * each writes its ``P`` into the rope columns of its own stage (``kv_s[stage, :, 512:]``, no
      longer needed once its ``S`` is done: ``64 x 64`` bf16, the size of ``P``), and then
    * consumer 0 accumulates the **left** half of the output, ``O_L += P0 V0_L + P1 V1_L``, and
      consumer 1 the **right** half, ``O_R += P1 V1_R + P0 V0_R``, each reading the other's ``P``;
    * at the end the two row sums are added; the **producer** (threads 256-383) gathers rows as in
      `warp_specialized_kernel`.

    Barriers: ``kv_ready`` / ``kv_free`` per stage (producer <-> both consumers), ``max_ready[c]`` and
    ``p_ready[c]`` (consumer ``c`` -> the other: its row maxima, its ``P``). A stage is refilled only
    after both consumers released it, which is also when the other's maxima and ``P`` of that
    stage have been read, so no buffer is overwritten early.
    """
    hb, per_query = head_blocking(heads)
    if hb != 64:
        raise ValueError(f"the seesaw kernel needs 64-head blocks, got heads={heads}")
    if dim - dim_v != BLOCK_I or dim_v % 2:
        raise ValueError(f"the seesaw kernel stores P [64, 64] in the rope columns: dim - dim_v must be "
                         f"{BLOCK_I}, got {dim} - {dim_v}")
    half = dim_v // 2
    scale2 = sm_scale * LOG2E
    num_q, num_kv, topk = T.dynamic("num_q"), T.dynamic("num_kv"), T.dynamic("topk")
    bf16, f32 = "bfloat16", "float32"

    @T.macro
    def consumer(c, t, h0, n_pairs, q_s, kv_s, valid_s, max_s, sum_s, acc_s, acc_o, m, m_prev, m_peer, l, l_blk,
                 q_ready, kv_ready, kv_free, max_ready, p_ready, Out, Lse):
        """One consumer (``c`` = 0: even blocks and the left half of O; 1: odd blocks, right half)."""
        o_s = q_s  # Q is dead after the last S: the output is staged in its place
        cols = slice(c * half, (c + 1) * half)  # this consumer's half of the value channels
        T.set_max_nreg(216, 1)
        T.fill(l, 0)
        T.fill(m, -(2.0**30))  # finite: masked -inf scores give exp2(-inf) = 0, never NaN
        T.fill(acc_o, 0)
        T.barrier_wait(q_ready, 0)
        for it in T.serial(n_pairs):
            # S = Q K^T of this consumer's block, over all 576 channels; -1 slots start at -inf
            T.barrier_wait(kv_ready[c], it & 1)
            for h, i in T.Parallel(hb, BLOCK_I):
                acc_s[h, i] = T.if_then_else(valid_s[c, i], 0, -T.infinity(f32))
            T.wgmma_gemm(q_s[:, :half], kv_s[c, :, :half], acc_s, transpose_B=True)
            T.wgmma_gemm(q_s[:, half:dim_v], kv_s[c, :, half:dim_v], acc_s, transpose_B=True)
            T.wgmma_gemm(q_s[:, dim_v:], kv_s[c, :, dim_v:], acc_s, transpose_B=True)
            T.copy(m, m_prev)
            T.wait_wgmma(0)
            # the running maximum over both blocks: swap row maxima with the other consumer
            T.reduce_max(acc_s, m, dim=1, clear=False)
            T.copy(m, max_s[c, :])
            T.barrier_arrive(max_ready[c])
            T.barrier_wait(max_ready[1 - c], it & 1)
            T.copy(max_s[1 - c, :], m_peer)
            for h in T.Parallel(hb):
                m[h] = T.max(m[h], m_peer[h])
            for h, d in T.Parallel(hb, half):
                acc_o[h, d] = acc_o[h, d] * T.exp2((m_prev[h] - m[h]) * scale2)
            for h, i in T.Parallel(hb, BLOCK_I):
                acc_s[h, i] = T.exp2(acc_s[h, i] * scale2 - m[h] * scale2)
            T.reduce_sum(acc_s, l_blk, dim=1)
            for h in T.Parallel(hb):
                l[h] = l[h] * T.exp2((m_prev[h] - m[h]) * scale2) + l_blk[h]
            # P into this stage's rope columns; O_half += P_own V_own,half + P_other V_other,half
            T.copy(acc_s, kv_s[c, :, dim_v:])
            T.barrier_arrive(p_ready[c])
            T.wgmma_gemm(kv_s[c, :, dim_v:], kv_s[c, :, cols], acc_o)
            T.barrier_wait(p_ready[1 - c], it & 1)
            T.wgmma_gemm(kv_s[1 - c, :, dim_v:], kv_s[1 - c, :, cols], acc_o)
            T.wait_wgmma(1)
            T.barrier_arrive(kv_free[c])
            T.wait_wgmma(0)
            T.barrier_arrive(kv_free[1 - c])
        # the row sums of both blocks' probabilities (the other consumer's through sum_s)
        T.copy(l, sum_s[c, :])
        T.barrier_arrive(max_ready[c])
        T.barrier_wait(max_ready[1 - c], n_pairs & 1)
        for h in T.Parallel(hb):
            l[h] = l[h] + sum_s[1 - c, h]
        for h, d in T.Parallel(hb, half):
            acc_o[h, d] = T.if_then_else(l[h] > 0, acc_o[h, d] / l[h], 0)
        T.copy(acc_o, o_s[:, cols])
        T.copy(o_s[:, cols], Out[t, h0:h0 + hb, cols])
        if c == 0:
            for h in T.Parallel(hb):
                l[h] = T.if_then_else(l[h] > 0, (T.log2(l[h]) + m[h] * scale2) * LN2, -T.infinity(f32))
            T.copy(l, Lse[t, h0:h0 + hb])

    @T.prim_func
    def main(Q: T.Tensor((num_q, heads, dim), bf16), KV: T.Tensor((num_kv, dim), bf16),
             Indices: T.Tensor((num_q, topk), "int32"), NumBlocks: T.Tensor((num_q,), "int32"),
             Out: T.Tensor((num_q, heads, dim_v), bf16), Lse: T.Tensor((num_q, heads), f32)):
        with T.Kernel(num_q * per_query, threads=384) as bx:
            t = bx // per_query
            h0 = (bx % per_query) * hb
            n_pairs = NumBlocks[t]
            q_s = T.alloc_shared((hb, dim), bf16)
            kv_s = T.alloc_shared((2, BLOCK_I, dim), bf16)  # stage 0: even blocks, stage 1: odd blocks
            valid_s = T.alloc_shared((2, BLOCK_I), "bool", scope="shared")
            max_s = T.alloc_shared((2, hb), f32, scope="shared")  # each consumer's row maxima
            sum_s = T.alloc_shared((2, hb), f32, scope="shared")  # each consumer's row sums (at the end)
            # each consumer's registers: S then P [heads, slots], its half of O, row statistics
            acc_s_0, acc_s_1 = T.alloc_fragment((hb, BLOCK_I), f32), T.alloc_fragment((hb, BLOCK_I), f32)
            acc_o_0, acc_o_1 = T.alloc_fragment((hb, half), f32), T.alloc_fragment((hb, half), f32)
            m_0, m_1 = T.alloc_fragment((hb,), f32), T.alloc_fragment((hb,), f32)
            m_prev_0, m_prev_1 = T.alloc_fragment((hb,), f32), T.alloc_fragment((hb,), f32)
            m_peer_0, m_peer_1 = T.alloc_fragment((hb,), f32), T.alloc_fragment((hb,), f32)
            l_0, l_1 = T.alloc_fragment((hb,), f32), T.alloc_fragment((hb,), f32)
            l_blk_0, l_blk_1 = T.alloc_fragment((hb,), f32), T.alloc_fragment((hb,), f32)
            rows = T.alloc_local((2, BLOCK_I // 16), "int32")  # the producer's rows of both stages

            q_ready = T.alloc_barrier(arrive_count=384)
            kv_ready = T.alloc_barrier(arrive_count=[128, 128])
            kv_free = T.alloc_barrier(arrive_count=[256, 256])
            max_ready = T.alloc_barrier(arrive_count=[128, 128])  # consumer c's maxima (and at the end its sums)
            p_ready = T.alloc_barrier(arrive_count=[128, 128])  # consumer c's P

            tx = T.get_thread_binding()
            T.tma_copy(Q[t, h0:h0 + hb, :], q_s, barrier=q_ready)
            T.barrier_arrive(q_ready)

            if tx < 128:
                consumer(0, t, h0, n_pairs, q_s, kv_s, valid_s, max_s, sum_s, acc_s_0, acc_o_0, m_0, m_prev_0,
                         m_peer_0, l_0, l_blk_0, q_ready, kv_ready, kv_free, max_ready, p_ready, Out, Lse)
            elif tx < 256:
                consumer(1, t, h0, n_pairs, q_s, kv_s, valid_s, max_s, sum_s, acc_s_1, acc_o_1, m_1, m_prev_1,
                         m_peer_1, l_1, l_blk_1, q_ready, kv_ready, kv_free, max_ready, p_ready, Out, Lse)
            else:  # producer: gather selected rows into the free stage (as in warp_specialized_kernel)
                T.set_max_nreg(72, 0)
                gather_pairs(tx - 256, t, n_pairs, Indices, KV, kv_s, valid_s, rows, kv_free, kv_ready, num_kv, topk,
                             prefetch_rows)

    return tilelang.compile(main, out_idx=[4, 5], pass_configs=_PASS_WS, target=compile_target())
# --8<-- [end:seesaw_kernel]
