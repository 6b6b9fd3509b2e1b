r"""TileLang kernels: the sparse MLA backward in two passes (``backward="two_pass"``).

The one-pass kernel (`dsa_ref.kernels.sparse_mla_bwd.backward_kernel`) keeps a ``dQ`` tile
(144 fp32 registers per thread) and a ``dKV`` tile (72) alive in one block, so it is register-bound,
and each 64-head half of a query scatter-adds its own ``[32, 576]`` ``dKV`` block: at 4096 x 8192
with top-2048 that is 38.6 GB of fp32 reductions. Split in two:

* **pass A** (`dq_kernel`), per (query, 64 heads), walks the selected rows 32 at a time like the
  one-pass kernel but keeps only ``dQ``::

      S  = Q K_sel^T;  P = exp2(sigma log2(e) S - lse2)      [H_blk, 32]
      dP = dO V_sel^T;  dS = P (dP - Delta) sigma             [H_blk, 32]
      dQ += dS K_sel                                          [H_blk, 576]

  and writes ``P`` and ``dS`` (bf16, the very values the one-pass kernel feeds its ``dKV``
  products) to ``[T, H, K]`` buffers. No ``dKV`` tile, so the gathers are double-buffered.
* **pass B** (`dkv_kernel`), per (query, third of the 576 channels), one GEMM over **all** heads::

      dKV_blk = dS[:, blk]^T Q + P[:, blk]^T dO_pad           [64 slots, 192]

  (``dO_pad``: ``dO`` with zeros past the 512 value channels), then the 64 finished rows are
  staged in shared memory at once and each is added to ``dKV[idx]`` by one asynchronous bulk
  reduction: one reduction per query and slot instead of one per 64-head half, half the atomic
  traffic.

`two_pass_backward` runs both passes over chunks of queries so the ``P`` / ``dS`` buffers stay
within a memory budget. The two passes compute exactly the one-pass kernel's products: ``dQ`` is
bitwise equal to its ``dQ``, ``dKV`` equal up to the order of the fp32 additions.
"""

import functools

import torch
import tilelang
import tilelang.language as T

from ._target import compile_target
from .sparse_mla_bwd import _BULK_REDUCE_ADD
from .sparse_mla_fwd import LOG2E, head_blocking, zero_row_or

BLOCK_S = 32  # pass A: selected rows per step
BLOCK_B = 64  # pass B: slots per step (the GEMM's M)
BUFFER_BYTES = 1 << 30  # default budget for the P and dS buffers of one chunk of queries

_PASS = {
    tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
    tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True,
    # the wrapper pads K to a multiple of 64 and the indices are in [-1, S): no guards needed
    tilelang.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS: True,
}


# --8<-- [start:dq_kernel]
@functools.lru_cache(maxsize=None)
def dq_kernel(heads: int, dim: int, dim_v: int, sm_scale: float, *, policy: str = "Square",
              batch_waits: bool | None = None):
    """Compile pass A: ``dQ``, ``P`` and ``dS`` (any number of queries, keys and slots).

    Kernel arguments: ``Q [T, H, D]``, ``KV [S + 1, D]`` (zero row last), ``dO [T, H, dim_v]`` bf16,
    ``Indices [T, K]`` int32 (``K`` a multiple of 64), ``NumBlocks [T]`` int32 (32-slot blocks to
    visit), ``Lse2 [T, H]`` fp32 (base 2, ``+inf`` for empty rows), ``Delta [T, H]`` fp32,
    ``P [T, H, K]``, ``dS [T, H, K]`` bf16 (written for every visited block, the rest untouched),
    ``dQ [T, H, D]`` bf16 (written).

    ``batch_waits`` (64-head blocks; ``None``, the default, turns it on there): issue ``S`` (both
    parts) with ``dP`` and wait once, then issue the two ``dQ`` products and store ``P`` / ``dS``
    while they run (the one-pass kernel's ``batch_waits``); ``False``: every product waits for
    itself. Both write the same bits; batched is 2.4 % faster at 128 heads (H100,
    ``2026-12-07_h100_ab_two_pass_pass_a_batch_waits.json``)."""
    hb, per_query = head_blocking(heads)
    if batch_waits is None:
        batch_waits = hb >= 64
    if batch_waits and hb < 64:
        raise ValueError(f"batch_waits needs 64-head blocks (warpgroup MMAs), got heads={heads}")
    mm = T.wgmma_gemm if batch_waits else T.gemm
    dim_tail = dim - dim_v
    scale2 = sm_scale * LOG2E
    threads = 256 if hb >= 64 else 128
    num_q, num_kv, topk = T.dynamic("num_q"), T.dynamic("num_kv"), T.dynamic("topk")
    warp_policy = getattr(T.GemmWarpPolicy, policy)
    bf16, f32 = "bfloat16", "float32"
    v_chunks, tail_chunks = BLOCK_S * dim_v // 8 // threads, BLOCK_S * dim_tail // 8 // threads

    @T.macro
    def gather_async(KV, Indices, v_s, tail_s, st, t, blk, tx):
        """Start copying rows ``Indices[t, 32 blk : 32 blk + 32]`` into buffer ``st``."""
        for j in T.unroll(v_chunks):  # 8 bf16 of one row per copy, consecutive threads along the row
            c = tx + threads * j
            i, u = c // (dim_v // 8), c % (dim_v // 8)
            row = zero_row_or(Indices[t, blk * BLOCK_S + i], num_kv)  # -1: the zero row at the end
            T.ptx_cp_async(T.access_ptr(v_s[st, i, u * 8], "w", 8), T.access_ptr(KV[row, u * 8], "r", 8), 8)
        for j in T.unroll(tail_chunks):
            c = tx + threads * j
            i, u = c // (dim_tail // 8), c % (dim_tail // 8)
            row = zero_row_or(Indices[t, blk * BLOCK_S + i], num_kv)
            T.ptx_cp_async(T.access_ptr(tail_s[st, i, u * 8], "w", 8),
                           T.access_ptr(KV[row, dim_v + u * 8], "r", 8), 8)
        T.ptx_commit_group()

    @T.prim_func
    def main(Q: T.Tensor((num_q, heads, dim), bf16), KV: T.Tensor((num_kv, dim), bf16),
             dO: T.Tensor((num_q, heads, dim_v), bf16), Indices: T.Tensor((num_q, topk), "int32"),
             NumBlocks: T.Tensor((num_q,), "int32"), Lse2: T.Tensor((num_q, heads), f32),
             Delta: T.Tensor((num_q, heads), f32), P: T.Tensor((num_q, heads, topk), bf16),
             dS: T.Tensor((num_q, heads, topk), bf16), dQ: T.Tensor((num_q, heads, dim), bf16)):
        with T.Kernel(num_q * per_query, threads=threads) as bx:
            t = bx // per_query
            h0 = (bx % per_query) * hb
            tx = T.get_thread_binding()
            q_s = T.alloc_shared((hb, dim), bf16)
            do_s = T.alloc_shared((hb, dim_v), bf16)
            v_s = T.alloc_shared((2, BLOCK_S, dim_v), bf16)  # two buffers of gathered rows
            tail_s = T.alloc_shared((2, BLOCK_S, dim_tail), bf16)
            p_s = T.alloc_shared((hb, BLOCK_S), bf16)
            ds_s = T.alloc_shared((hb, BLOCK_S), bf16)
            valid = T.alloc_fragment((BLOCK_S,), "bool")
            acc_p = T.alloc_fragment((hb, BLOCK_S), f32)
            acc_dp = T.alloc_fragment((hb, BLOCK_S), f32)
            acc_dq = T.alloc_fragment((hb, dim_v), f32)
            acc_dq_tail = T.alloc_fragment((hb, dim_tail), f32)

            T.copy(Q[t, h0:h0 + hb, :dim_v], q_s[:, :dim_v], disable_tma=True)
            T.copy(Q[t, h0:h0 + hb, dim_v:], q_s[:, dim_v:], disable_tma=True)
            T.copy(dO[t, h0:h0 + hb, :], do_s, disable_tma=True)
            T.clear(acc_dq)
            T.clear(acc_dq_tail)
            n = NumBlocks[t]
            if n > 0:
                gather_async(KV, Indices, v_s, tail_s, 0, t, 0, tx)
            for blk in T.serial(n):
                st = blk % 2
                for i in T.Parallel(BLOCK_S):
                    valid[i] = Indices[t, blk * BLOCK_S + i] >= 0
                if blk + 1 < n:  # the next block's rows into the other buffer (last read two steps ago)
                    gather_async(KV, Indices, v_s, tail_s, 1 - st, t, blk + 1, tx)
                    T.ptx_wait_group(1)
                else:
                    T.ptx_wait_group(0)
                T.sync_threads()
                # P from the saved LSE (a -1 slot starts at -inf, so its P is 0)
                for h, i in T.Parallel(hb, BLOCK_S):
                    acc_p[h, i] = T.if_then_else(valid[i], 0, -T.infinity(f32))
                mm(q_s[:, :dim_v], v_s[st, :, :], acc_p, transpose_B=True, policy=warp_policy)
                mm(q_s[:, dim_v:], tail_s[st, :, :], acc_p, transpose_B=True, policy=warp_policy)
                if batch_waits:  # dP = dO V^T does not need P: issue it now, wait for all three
                    mm(do_s, v_s[st, :, :], acc_dp, transpose_B=True, policy=warp_policy, clear_accum=True)
                    T.wait_wgmma(0)
                for h, i in T.Parallel(hb, BLOCK_S):
                    acc_p[h, i] = T.exp2(acc_p[h, i] * scale2 - Lse2[t, h0 + h])
                T.copy(acc_p, p_s)
                # dS = P * (dO V^T - Delta) * sigma
                if not batch_waits:
                    T.gemm(do_s, v_s[st, :, :], acc_dp, transpose_B=True, policy=warp_policy, clear_accum=True)
                for h, i in T.Parallel(hb, BLOCK_S):
                    acc_dp[h, i] = acc_p[h, i] * (acc_dp[h, i] - Delta[t, h0 + h]) * sm_scale
                T.copy(acc_dp, ds_s)
                # dQ += dS K
                mm(ds_s, v_s[st, :, :], acc_dq, policy=warp_policy)
                mm(ds_s, tail_s[st, :, :], acc_dq_tail, policy=warp_policy)
                # P and dS out while dQ's MMAs run
                T.copy(p_s, P[t, h0:h0 + hb, blk * BLOCK_S:(blk + 1) * BLOCK_S], disable_tma=True)
                T.copy(ds_s, dS[t, h0:h0 + hb, blk * BLOCK_S:(blk + 1) * BLOCK_S], disable_tma=True)
                if batch_waits:  # ds_s and this buffer are read by the dQ products until here
                    T.wait_wgmma(0)
                T.sync_threads()  # this buffer is refilled at the top of the step after next
            T.copy(acc_dq, dQ[t, h0:h0 + hb, :dim_v])
            T.copy(acc_dq_tail, dQ[t, h0:h0 + hb, dim_v:])

    return tilelang.compile(main, pass_configs=_PASS, target=compile_target())
# --8<-- [end:dq_kernel]


# --8<-- [start:dkv_kernel]
@functools.lru_cache(maxsize=None)
def dkv_kernel(heads: int, dim: int, dim_v: int, *, parts: int = 3, rows: int = 64, policy: str = "FullCol",
               overlap: bool = False):
    """Compile pass B: ``dKV[idx] += dS^T Q + P^T dO`` over all heads of each query.

    Kernel arguments: ``Q [T, H, D]``, ``dO [T, H, dim_v]``, ``P [T, H, K]``, ``dS [T, H, K]`` bf16,
    ``Indices [T, K]`` int32 (``K`` a multiple of 64), ``NumBlocks [T]`` int32 (64-slot blocks to
    visit), ``dKV [S + 1, D]`` fp32 (accumulated in place; ``-1`` slots add nothing). One block per
    (query, ``D / parts`` channels); the finished ``[64, D / parts]`` tile is staged ``rows`` rows
    at a time. Columns of ``P`` / ``dS`` past a row's visited 32-slot blocks hold whatever the
    buffer held: they belong to ``-1`` slots, whose rows of the tile are never added.

    ``overlap``: two accumulators; the warpgroup MMAs of the next 64 slots are issued before this
    block's rows are staged and scattered, so the tensor cores and the scatter run at once.
    """
    if dim % parts or (dim // parts) % 8:
        raise ValueError(f"dim {dim} must split into {parts} parts of a multiple of 8")
    if BLOCK_B % rows:
        raise ValueError(f"rows must divide {BLOCK_B}, got {rows}")
    width = dim // parts  # channels per block
    num_q, num_kv, topk = T.dynamic("num_q"), T.dynamic("num_kv"), T.dynamic("topk")
    bf16, f32 = "bfloat16", "float32"
    threads = 256
    split = BLOCK_B // rows
    copies = heads * BLOCK_B // 8  # 16-byte copies per operand block
    warp_policy = getattr(T.GemmWarpPolicy, policy)

    @T.macro
    def load_scores(P, dS, p_s, ds_s, st, t, blk, tx):
        """Start copying ``P`` and ``dS`` of slots ``64 blk .. 64 blk + 63`` into buffer ``st``."""
        for j in T.unroll((copies + threads - 1) // threads):
            c = tx + threads * j
            h, u = c // (BLOCK_B // 8), c % (BLOCK_B // 8)
            if copies % threads == 0 or c < copies:  # 16 heads: half the threads copy
                T.ptx_cp_async(T.access_ptr(ds_s[st, h, u * 8], "w", 8),
                               T.access_ptr(dS[t, h, blk * BLOCK_B + u * 8], "r", 8), 8)
                T.ptx_cp_async(T.access_ptr(p_s[st, h, u * 8], "w", 8),
                               T.access_ptr(P[t, h, blk * BLOCK_B + u * 8], "r", 8), 8)
        T.ptx_commit_group()

    @T.macro
    def products(p_s, ds_s, q_s, do_s, st, acc, mm):
        """``acc [64 slots, width] = dS^T Q + P^T dO`` of buffer ``st``, summed over all heads."""
        mm(ds_s[st, :, :], q_s, acc, transpose_A=True, policy=warp_policy, clear_accum=True)
        mm(p_s[st, :, :], do_s, acc, transpose_A=True, policy=warp_policy)

    @T.macro
    def scatter(acc, stage, dKV, Indices, t, blk, c0, tx, refill, P, dS, p_s, ds_s, st, n):
        """Add the tile's rows to ``dKV[Indices[t, 64 blk + i], c0 : c0 + width]``, ``rows`` at a time.
        ``refill``: after the first barrier (every warpgroup's MMAs on buffer ``st`` are done), start
        loading block ``blk + 2`` into it."""
        for part in T.serial(split):
            if tx < rows:
                T.tma_store_wait(0)  # the copy engine has read the previous part
            T.sync_threads()
            if refill:
                if part == 0 and blk + 2 < n:
                    load_scores(P, dS, p_s, ds_s, st, t, blk + 2, tx)
            for i, j in T.Parallel(BLOCK_B, width):
                if i // rows == part:
                    stage[i % rows, j] = acc[i, j]
            T.fence_proxy_async()  # the staged rows, visible to the bulk-copy engine
            T.sync_threads()
            if tx < rows:
                slot = blk * BLOCK_B + part * rows + tx
                if Indices[t, slot] >= 0:
                    T.call_extern("handle", "dsa_bulk_reduce_add_f32", T.access_ptr(stage[tx, 0], "r"),
                                  T.access_ptr(dKV[Indices[t, slot], c0], "w"), width * 4)
                T.tma_store_arrive()

    @T.macro
    def step(cur, nxt, st, blk, n, stage, dKV, Indices, t, c0, tx, P, dS, p_s, ds_s, q_s, do_s):
        """``overlap``: block ``blk`` (products in ``cur``, scores in buffer ``st``) has a successor:
        issue the successor's products into ``nxt``, wait for ``cur``'s only, scatter ``cur``."""
        T.ptx_wait_group(0)  # block blk + 1's scores have landed (requested one step ago)
        T.sync_threads()
        products(p_s, ds_s, q_s, do_s, 1 - st, nxt, T.wgmma_gemm)
        T.wait_wgmma(2)  # blk's two products are done; blk + 1's run on during the scatter
        scatter(cur, stage, dKV, Indices, t, blk, c0, tx, True, P, dS, p_s, ds_s, st, n)

    @T.prim_func
    def main(Q: T.Tensor((num_q, heads, dim), bf16), dO: T.Tensor((num_q, heads, dim_v), bf16),
             P: T.Tensor((num_q, heads, topk), bf16), dS: T.Tensor((num_q, heads, topk), bf16),
             Indices: T.Tensor((num_q, topk), "int32"), NumBlocks: T.Tensor((num_q,), "int32"),
             dKV: T.Tensor((num_kv, dim), f32)):
        with T.Kernel(num_q * parts, threads=threads) as bx:
            t = bx // parts
            c0 = (bx % parts) * width  # first channel of this block
            tx = T.get_thread_binding()
            T.import_source(_BULK_REDUCE_ADD)
            q_s = T.alloc_shared((heads, width), bf16)
            do_s = T.alloc_shared((heads, width), bf16)  # dO, zero past the value channels
            p_s = T.alloc_shared((2, heads, BLOCK_B), bf16)
            ds_s = T.alloc_shared((2, heads, BLOCK_B), bf16)
            stage = T.alloc_shared((rows, width + 4), f32)  # 4 floats of padding spread the banks
            acc = T.alloc_fragment((BLOCK_B, width), f32)  # [64 slots, width]
            if overlap:
                acc_next = T.alloc_fragment((BLOCK_B, width), f32)  # [64 slots, width]: the other block

            for h, j in T.Parallel(heads, width):
                q_s[h, j] = Q[t, h, c0 + j]
                do_s[h, j] = T.if_then_else(c0 + j < dim_v, dO[t, h, T.min(c0 + j, dim_v - 1)], T.Cast(bf16, 0))
            n = NumBlocks[t]
            if n > 0:
                load_scores(P, dS, p_s, ds_s, 0, t, 0, tx)
            if not overlap:
                for blk in T.serial(n):
                    st = blk % 2
                    if blk + 1 < n:
                        load_scores(P, dS, p_s, ds_s, 1 - st, t, blk + 1, tx)
                        T.ptx_wait_group(1)
                    else:
                        T.ptx_wait_group(0)
                    T.sync_threads()
                    products(p_s, ds_s, q_s, do_s, st, acc, T.gemm)
                    scatter(acc, stage, dKV, Indices, t, blk, c0, tx, False, P, dS, p_s, ds_s, st, n)
            else:
                # the loop is unrolled by two so that, at its top, the pending MMAs always write
                # acc (an even block): ptxas can then see that acc_next's products are the only
                # ones in flight while acc is read, and the reverse, and injects no wait
                if n > 0:
                    if n > 1:
                        load_scores(P, dS, p_s, ds_s, 1, t, 1, tx)
                        T.ptx_wait_group(1)
                    else:
                        T.ptx_wait_group(0)
                    T.sync_threads()
                    products(p_s, ds_s, q_s, do_s, 0, acc, T.wgmma_gemm)
                    for pair in T.serial((n - 1) // 2):
                        step(acc, acc_next, 0, 2 * pair, n, stage, dKV, Indices, t, c0, tx, P, dS, p_s, ds_s, q_s,
                             do_s)
                        step(acc_next, acc, 1, 2 * pair + 1, n, stage, dKV, Indices, t, c0, tx, P, dS, p_s, ds_s,
                             q_s, do_s)
                    if (n - 1) % 2 == 1:  # blocks n - 2 (in acc) and n - 1
                        step(acc, acc_next, 0, n - 2, n, stage, dKV, Indices, t, c0, tx, P, dS, p_s, ds_s, q_s,
                             do_s)
                        T.wait_wgmma(0)
                        scatter(acc_next, stage, dKV, Indices, t, n - 1, c0, tx, False, P, dS, p_s, ds_s, 1, n)
                    else:  # block n - 1, in acc
                        T.wait_wgmma(0)
                        scatter(acc, stage, dKV, Indices, t, n - 1, c0, tx, False, P, dS, p_s, ds_s, 0, n)
            if tx < rows:
                T.tma_store_wait(0)

    return tilelang.compile(main, pass_configs=_PASS, target=compile_target())
# --8<-- [end:dkv_kernel]


def chunk_queries(num_q: int, heads: int, topk: int, buffer_bytes: int = BUFFER_BYTES) -> int:
    """Queries per chunk so that ``P`` and ``dS`` (bf16 ``[chunk, H, K]`` each) fit ``buffer_bytes``
    (at least one query)."""
    per_query = 2 * heads * topk * 2  # bytes of P and dS for one query
    return max(1, min(num_q, buffer_bytes // max(per_query, 1)))


# --8<-- [start:two_pass_backward]
def two_pass_backward(q, kv_rows, d_out, idx, lse2, delta, *, sm_scale: float, d_v: int,
                      buffer_bytes: int = BUFFER_BYTES):
    """``(dq, dkv)`` of sparse MLA in two passes.

    Args:
        q: ``[T, H, D]`` bf16; kv_rows: ``[S + 1, D]`` bf16 with the zero row last; d_out:
            ``[T, H, d_v]`` bf16; idx: ``[T, K]`` int32, ``K`` a multiple of 64, ``-1`` unused;
            lse2: ``[T, H]`` fp32 base-2 LSE (``+inf`` on empty rows); delta: ``[T, H]`` fp32.
        buffer_bytes: memory for the ``P`` / ``dS`` buffers; queries go in chunks that fit.

    Returns:
        ``dq [T, H, D]`` bf16 and ``dkv [S + 1, D]`` fp32 (the zero row's entry is meaningless).
    """
    from .autograd import _block_counts

    T_, H, D = q.shape
    K = idx.shape[1]
    if K % BLOCK_B:
        raise ValueError(f"idx must have a multiple of {BLOCK_B} slots, got {K}")
    pass_a = dq_kernel(H, D, d_v, float(sm_scale))
    pass_b = dkv_kernel(H, D, d_v)
    counts_a = _block_counts(idx, BLOCK_S)  # [T]
    counts_b = _block_counts(idx, BLOCK_B)  # [T]
    chunk = chunk_queries(T_, H, K, buffer_bytes)
    P = torch.empty(chunk, H, K, dtype=torch.bfloat16, device=q.device)  # [C, H, K]
    dS = torch.empty_like(P)  # [C, H, K]
    dq = torch.empty_like(q)  # [T, H, D]
    dkv = torch.zeros(kv_rows.shape, dtype=torch.float32, device=q.device)  # [S + 1, D]
    for t0 in range(0, T_, chunk):
        t1 = min(T_, t0 + chunk)
        c = t1 - t0
        pass_a(q[t0:t1], kv_rows, d_out[t0:t1], idx[t0:t1], counts_a[t0:t1], lse2[t0:t1], delta[t0:t1],
               P[:c], dS[:c], dq[t0:t1])
        pass_b(q[t0:t1], d_out[t0:t1], P[:c], dS[:c], idx[t0:t1], counts_b[t0:t1], dkv)
    return dq, dkv
# --8<-- [end:two_pass_backward]
