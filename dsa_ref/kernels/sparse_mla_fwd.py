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


# --8<-- [start:warp_specialized_kernel]
_PASS_WS = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}


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
