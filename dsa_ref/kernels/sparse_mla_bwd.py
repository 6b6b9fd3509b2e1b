"""TileLang kernel: sparse MLA backward.

With ``P = softmax(sigma * Q K_sel^T)`` recomputed from the saved natural-log ``lse`` and
``Delta[t, h] = sum_d O[t, h, d] * dO[t, h, d]`` (computed by the wrapper):

    dP  = dO @ V_sel^T                     [H_blk, 32]
    dS  = P * (dP - Delta) * sigma          (softmax backward)
    dQ += dS @ K_sel                        [H_blk, 576]
    dKV[idx] += dS^T @ Q + P^T @ dO          [32, 576]  (the value half gets both terms)

One block of threads owns one query and up to 64 of its heads and walks its selected rows 32 at a
time. Different queries select the same keys, so ``dKV`` is accumulated with fp32 atomic additions
into a buffer the wrapper zeroes (``-1`` slots add nothing). By default each finished ``[32, 576]``
block goes through shared memory 8 rows at a time, in two alternating buffers, and every row is
added to ``dKV`` by one asynchronous bulk reduction of the copy engine (``cp.reduce.async.bulk``,
element-wise atomic), so the threads go on while the additions happen; the independent warpgroup
MMAs of a step are issued together and waited for once (``batch_waits``). Atomics make ``dKV``
reproducible only up to float rounding order.

The block is register-bound: the ``dQ`` accumulator alone holds 144 fp32 registers per thread (of
255), so schedule changes that keep more values alive spill and lose (see docs/benchmarks.md).
"""

import functools

import tilelang
import tilelang.language as T

from ._target import compile_target
from .sparse_mla_fwd import LOG2E, head_blocking, zero_row_or

BLOCK_S = 32  # selected rows per step
SPLIT = 4  # the [32, 576] fp32 dKV tile is staged through shared memory in quarters (two buffers)

def _pass_configs(fast_math: bool, bounds_checks: bool) -> dict:
    return {
        tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
        tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: fast_math,
        # With a runtime K TileLang cannot prove ``blk * 32 + i < K`` and guards every load of
        # Indices; the wrapper guarantees it (K is padded to a multiple of 32, and every index is
        # checked to lie in [-1, S) before the launch), so the guards are only cost.
        tilelang.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS: not bounds_checks,
    }


# --8<-- [start:delta_kernel]
@functools.lru_cache(maxsize=None)
def delta_kernel(heads: int, dim_v: int, chunk: int = 64):
    """Compile ``Delta[t, h] = sum_d O[t, h, d] * dO[t, h, d]`` (fp32 products and sums).

    Kernel arguments: ``O [T, H, dim_v]``, ``dO [T, H, dim_v]`` bf16; returns ``Delta [T, H]`` fp32.
    One block per query reads its ``[H, dim_v]`` rows ``chunk`` channels at a time: one pass over
    ``O`` and ``dO`` where ``(out.float() * d_out.float()).sum(-1)`` would write three fp32 copies.
    """
    if dim_v % chunk:
        raise ValueError(f"dim_v must be a multiple of {chunk}, got {dim_v}")
    num_q = T.dynamic("num_q")
    bf16, f32 = "bfloat16", "float32"

    @T.prim_func
    def main(O: T.Tensor((num_q, heads, dim_v), bf16), dO: T.Tensor((num_q, heads, dim_v), bf16),
             Delta: T.Tensor((num_q, heads), f32)):
        with T.Kernel(num_q, threads=128) as t:
            o = T.alloc_fragment((heads, chunk), bf16)
            do = T.alloc_fragment((heads, chunk), bf16)
            acc = T.alloc_fragment((heads, chunk), f32)
            row = T.alloc_fragment((heads,), f32)
            T.clear(acc)
            for c in T.serial(dim_v // chunk):
                T.copy(O[t, :, c * chunk:(c + 1) * chunk], o)
                T.copy(dO[t, :, c * chunk:(c + 1) * chunk], do)
                for h, j in T.Parallel(heads, chunk):
                    acc[h, j] += T.Cast(f32, o[h, j]) * T.Cast(f32, do[h, j])
            T.reduce_sum(acc, row, dim=1)  # [H]
            T.copy(row, Delta[t, :])

    return tilelang.compile(main, out_idx=[2], target=compile_target())
# --8<-- [end:delta_kernel]


# One asynchronous bulk reduction ``gmem[0:n] += smem[0:n]`` (fp32, n*4 bytes, 16-byte aligned),
# issued by one thread and completed by the copy engine (PTX ISA: cp.reduce.async.bulk, sm_90+).
_BULK_REDUCE_ADD = r"""
__device__ __forceinline__ void dsa_bulk_reduce_add_f32(const float* smem, float* gmem, int bytes) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
               :: "l"(gmem), "r"(s), "r"(bytes) : "memory");
}
"""


# --8<-- [start:backward_kernel]
@functools.lru_cache(maxsize=None)
def backward_kernel(heads: int, dim: int, dim_v: int, sm_scale: float, *, fast_math: bool = True,
                    policy: str = "Square", bounds_checks: bool = False, dkv_layout: str = "channels",
                    tma_reduce: bool = True, prefetch: bool = True, dkv_policy: str = "FullRow",
                    batch_waits: bool | None = None, split: int = SPLIT, buffers: int = 2):
    """Compile the sparse MLA backward for these sizes (any number of queries, keys and slots).

    Kernel arguments: ``Q [T, H, D]``, ``KV [S, D]``, ``dO [T, H, dim_v]`` bf16, ``Indices [T, K]``
    int32 (``K`` a multiple of 32), ``NumBlocks [T]`` int32 (32-slot blocks to visit per row, up to
    its last valid slot), ``Lse2 [T, H]`` fp32 (the LSE in base 2, ``+inf`` for empty rows so that
    every ``P`` of the row is 0), ``Delta [T, H]`` fp32, ``dKV [S, D]`` fp32 (zeroed; accumulated in
    place); returns ``dQ [T, H, D]`` bf16.

    Tuning knobs (``benchmarks/tune_kernels.py``), all computing the same sums:

    * ``fast_math``; ``policy``: how the GEMMs split over warps; ``bounds_checks``: TileLang's
      guards on every global load.
    * ``dkv_layout``: ``"rows"`` accumulates the ``dKV`` block as ``[32 rows, D]`` (M = 32: warp
      MMAs), ``"channels"`` as its transpose ``[D, 32]`` = ``Q^T dS`` (M = 512: warpgroup MMAs,
      each operand read from shared memory once).
    * ``tma_reduce``: scatter-add each staged ``dKV`` row with one asynchronous bulk reduction
      (``cp.reduce.async.bulk ... add.f32``, 2304 bytes) issued by one thread, instead of
      every thread issuing 4-float atomics.
    * ``prefetch``: as soon as the ``dQ`` GEMMs have read the gathered rows, start gathering the
      next block's rows into the same buffers with ``cp.async`` (16 bytes per copy, no registers),
      so the loads run while the ``dKV`` GEMMs and the scatter-add do.
    * ``dkv_policy``: how the ``[512, 32]`` value part of the ``"channels"`` dKV GEMMs is split
      over the two warpgroups: ``"Square"`` gives each 16 of the 32 slots (both read all of
      ``Q`` and ``dO``), ``"FullRow"`` gives each 256 of the channels.
    * ``batch_waits`` (``"channels"`` only): issue the independent warpgroup MMAs of a step
      together and wait once: ``S`` (both parts) with ``dP``; ``dQ`` (both parts); the three ``dKV``
      products. Three waits per block instead of eight. Needs 64-head blocks (a warpgroup MMA's
      M = 64); ``None`` (the default) turns it on exactly then.
    * ``split``, ``buffers``: the ``[32, D]`` dKV block is staged ``32 / split`` rows at a time in
      ``buffers`` alternating buffers of shared memory. With one buffer a part waits until the
      copy engine has read the previous one; with two (``split=4, buffers=2``: the same bytes as
      one half block) it waits only for the part before that (``tma_reduce`` only).
    """
    if split not in (1, 2, 4, 8) or buffers not in (1, 2) or (buffers == 2 and (split < 2 or not tma_reduce)):
        raise ValueError(f"split must be 1, 2, 4 or 8 and buffers 1 or 2 (2 needs split >= 2 and tma_reduce), "
                         f"got split={split}, buffers={buffers}, tma_reduce={tma_reduce}")
    hb, per_query = head_blocking(heads)
    if batch_waits is None:
        batch_waits = hb >= 64 and dkv_layout == "channels"
    if dkv_layout not in ("rows", "channels"):
        raise ValueError(f"dkv_layout must be 'rows' or 'channels', got {dkv_layout!r}")
    if batch_waits and dkv_layout != "channels":
        raise ValueError("batch_waits needs dkv_layout='channels' (the 'rows' layout's M = 32 is not a warpgroup MMA)")
    mm = T.wgmma_gemm if batch_waits else T.gemm  # without batch_waits every product waits for itself
    dim_tail = dim - dim_v
    scale2 = sm_scale * LOG2E
    threads = 256 if hb >= 64 else 128
    num_q, num_kv, topk = T.dynamic("num_q"), T.dynamic("num_kv"), T.dynamic("topk")
    warp_policy = getattr(T.GemmWarpPolicy, policy)
    rows_half = BLOCK_S // split  # rows per staged part
    bf16, f32 = "bfloat16", "float32"
    channels = dkv_layout == "channels"
    v_chunks, tail_chunks = BLOCK_S * dim_v // 8 // threads, BLOCK_S * dim_tail // 8 // threads
    dkv_value_policy = getattr(T.GemmWarpPolicy, dkv_policy)

    @T.macro
    def gather_async(KV, Indices, v_s, tail_s, t, blk, tx):
        """Start copying the rows ``Indices[t, blk*32 : blk*32+32]`` into ``v_s`` / ``tail_s``."""
        for j in T.unroll(v_chunks):  # 8 bf16 of one row per copy, consecutive threads along the row
            c = tx + threads * j
            i, u = c // (dim_v // 8), c % (dim_v // 8)
            row = zero_row_or(Indices[t, blk * BLOCK_S + i], num_kv)  # -1: the zero row at the end
            T.ptx_cp_async(T.access_ptr(v_s[i, u * 8], "w", 8), T.access_ptr(KV[row, u * 8], "r", 8), 8)
        for j in T.unroll(tail_chunks):
            c = tx + threads * j
            i, u = c // (dim_tail // 8), c % (dim_tail // 8)
            row = zero_row_or(Indices[t, blk * BLOCK_S + i], num_kv)  # -1: the zero row at the end
            T.ptx_cp_async(T.access_ptr(tail_s[i, u * 8], "w", 8),
                           T.access_ptr(KV[row, dim_v + u * 8], "r", 8), 8)
        T.ptx_commit_group()

    @T.macro
    def scatter(acc_dkv, acc_dkv_tail, dkv_stage, dKV, Indices, t, blk, tx):
        """Scatter-add the dKV block of slots ``blk*32 .. blk*32+31`` into ``dKV``: ``32 / split``
        whole rows at a time through shared memory."""
        for part in T.serial(split):
            buf = part % buffers
            if tma_reduce:  # the bulk reductions that last read this buffer must be done reading it
                if tx < rows_half:
                    T.tma_store_wait(buffers - 1)  # at most the other buffer's group still reading
                T.sync_threads()
            if channels:
                for d, i in T.Parallel(dim_v, BLOCK_S):
                    if i // rows_half == part:
                        dkv_stage[buf, i % rows_half, d] = acc_dkv[d, i]
                for d, i in T.Parallel(dim_tail, BLOCK_S):
                    if i // rows_half == part:
                        dkv_stage[buf, i % rows_half, dim_v + d] = acc_dkv_tail[d, i]
            else:
                for i, d in T.Parallel(BLOCK_S, dim_v):
                    if i // rows_half == part:
                        dkv_stage[buf, i % rows_half, d] = acc_dkv[i, d]
                for i, d in T.Parallel(BLOCK_S, dim_tail):
                    if i // rows_half == part:
                        dkv_stage[buf, i % rows_half, dim_v + d] = acc_dkv_tail[i, d]
            if tma_reduce:
                # make the staged rows visible to the bulk-copy engine, then one thread per row
                T.fence_proxy_async()
                T.sync_threads()
                if tx < rows_half:
                    slot = blk * BLOCK_S + part * rows_half + tx
                    if Indices[t, slot] >= 0:
                        T.call_extern("handle", "dsa_bulk_reduce_add_f32",
                                      T.access_ptr(dkv_stage[buf, tx, 0], "r"),
                                      T.access_ptr(dKV[Indices[t, slot], 0], "w"), dim * 4)
                    T.tma_store_arrive()
            else:  # 4 floats per atomic
                for i, d4 in T.Parallel(rows_half, dim // 4):
                    slot = blk * BLOCK_S + part * rows_half + i
                    if Indices[t, slot] >= 0:
                        T.atomic_addx4(dKV[Indices[t, slot], d4 * 4], dkv_stage[buf, i, d4 * 4])

    @T.prim_func
    def main(Q: T.Tensor((num_q, heads, dim), bf16), KV: T.Tensor((num_kv, dim), bf16),
             dO: T.Tensor((num_q, heads, dim_v), bf16), Indices: T.Tensor((num_q, topk), "int32"),
             NumBlocks: T.Tensor((num_q,), "int32"), Lse2: T.Tensor((num_q, heads), f32),
             Delta: T.Tensor((num_q, heads), f32),
             dKV: T.Tensor((num_kv, dim), f32), dQ: T.Tensor((num_q, heads, dim), bf16)):
        with T.Kernel(num_q * per_query, threads=threads) as bx:
            t = bx // per_query
            h0 = (bx % per_query) * hb
            tx = T.get_thread_binding()
            if tma_reduce:
                T.import_source(_BULK_REDUCE_ADD)
            q_s = T.alloc_shared((hb, dim), bf16)
            do_s = T.alloc_shared((hb, dim_v), bf16)
            v_s = T.alloc_shared((BLOCK_S, dim_v), bf16)
            tail_s = T.alloc_shared((BLOCK_S, dim_tail), bf16)
            p_s = T.alloc_shared((hb, BLOCK_S), bf16)
            ds_s = T.alloc_shared((hb, BLOCK_S), bf16)
            # 32 / split rows of a dKV block per buffer; 4 floats of padding per row spread the transposed
            # writes of the "channels" layout over all 32 banks (rows stay 16-byte aligned)
            dkv_stage = T.alloc_shared((buffers, rows_half, dim + 4), f32)
            valid = T.alloc_fragment((BLOCK_S,), "bool")

            acc_p = T.alloc_fragment((hb, BLOCK_S), f32)
            acc_dp = T.alloc_fragment((hb, BLOCK_S), f32)
            acc_dq = T.alloc_fragment((hb, dim_v), f32)
            acc_dq_tail = T.alloc_fragment((hb, dim_tail), f32)
            if channels:
                acc_dkv = T.alloc_fragment((dim_v, BLOCK_S), f32)  # [D_v, 32]: dKV^T
                acc_dkv_tail = T.alloc_fragment((dim_tail, BLOCK_S), f32)
            else:
                acc_dkv = T.alloc_fragment((BLOCK_S, dim_v), f32)  # [32, D_v]
                acc_dkv_tail = T.alloc_fragment((BLOCK_S, dim_tail), f32)

            T.copy(Q[t, h0:h0 + hb, :dim_v], q_s[:, :dim_v], disable_tma=True)
            T.copy(Q[t, h0:h0 + hb, dim_v:], q_s[:, dim_v:], disable_tma=True)
            T.copy(dO[t, h0:h0 + hb, :], do_s, disable_tma=True)
            T.clear(acc_dq)
            T.clear(acc_dq_tail)
            if prefetch:
                if NumBlocks[t] > 0:
                    gather_async(KV, Indices, v_s, tail_s, t, 0, tx)

            for blk in T.Pipelined(NumBlocks[t], num_stages=0):
                for i in T.Parallel(BLOCK_S):
                    valid[i] = Indices[t, blk * BLOCK_S + i] >= 0
                if prefetch:  # this block's rows were requested during the previous block
                    T.ptx_wait_group(0)
                    T.sync_threads()
                else:
                    for i, d in T.Parallel(BLOCK_S, dim_v):
                        v_s[i, d] = KV[zero_row_or(Indices[t, blk * BLOCK_S + i], num_kv), d]
                    for i, d in T.Parallel(BLOCK_S, dim_tail):
                        tail_s[i, d] = KV[zero_row_or(Indices[t, blk * BLOCK_S + i], num_kv), dim_v + d]
                # recompute P from the saved LSE
                for h, i in T.Parallel(hb, BLOCK_S):
                    acc_p[h, i] = T.if_then_else(valid[i], 0, -T.infinity(f32))
                mm(q_s[:, :dim_v], v_s, acc_p, transpose_B=True, policy=warp_policy)
                mm(q_s[:, dim_v:], tail_s, acc_p, transpose_B=True, policy=warp_policy)
                if batch_waits:  # dP = dO V^T does not need P: issue it now, wait for all three
                    mm(do_s, v_s, acc_dp, transpose_B=True, policy=warp_policy, clear_accum=True)
                    T.wait_wgmma(0)
                for h, i in T.Parallel(hb, BLOCK_S):
                    acc_p[h, i] = T.exp2(acc_p[h, i] * scale2 - Lse2[t, h0 + h])
                T.copy(acc_p, p_s)
                # dS = P * (dO V^T - Delta) * sigma
                if not batch_waits:
                    T.gemm(do_s, v_s, acc_dp, transpose_B=True, policy=warp_policy, clear_accum=True)
                for h, i in T.Parallel(hb, BLOCK_S):
                    acc_dp[h, i] = acc_p[h, i] * (acc_dp[h, i] - Delta[t, h0 + h]) * sm_scale
                T.copy(acc_dp, ds_s)
                # dQ += dS K
                mm(ds_s, v_s, acc_dq, policy=warp_policy)
                mm(ds_s, tail_s, acc_dq_tail, policy=warp_policy)
                if batch_waits:
                    T.wait_wgmma(0)
                if prefetch:  # the rows are read for the last time: fetch the next block's
                    T.sync_threads()
                    if blk + 1 < NumBlocks[t]:
                        gather_async(KV, Indices, v_s, tail_s, t, blk + 1, tx)
                # dKV_blk = dS^T Q + P^T dO   (the value channels get both terms)
                if channels:  # its transpose: Q^T dS + dO^T P  [D, 32]
                    mm(q_s[:, :dim_v], ds_s, acc_dkv, transpose_A=True, policy=dkv_value_policy, clear_accum=True)
                    mm(do_s, p_s, acc_dkv, transpose_A=True, policy=dkv_value_policy)
                    mm(q_s[:, dim_v:], ds_s, acc_dkv_tail, transpose_A=True, clear_accum=True)
                    if batch_waits:
                        T.wait_wgmma(0)
                else:
                    T.gemm(ds_s, q_s[:, :dim_v], acc_dkv, transpose_A=True, policy=warp_policy,
                           clear_accum=True)
                    T.gemm(p_s, do_s, acc_dkv, transpose_A=True, policy=warp_policy)
                    T.gemm(ds_s, q_s[:, dim_v:], acc_dkv_tail, transpose_A=True, policy=warp_policy,
                           clear_accum=True)
                scatter(acc_dkv, acc_dkv_tail, dkv_stage, dKV, Indices, t, blk, tx)
            if tma_reduce:
                if tx < rows_half:
                    T.tma_store_wait(0)

            T.copy(acc_dq, dQ[t, h0:h0 + hb, :dim_v])
            T.copy(acc_dq_tail, dQ[t, h0:h0 + hb, dim_v:])

    return tilelang.compile(main, out_idx=[8], pass_configs=_pass_configs(fast_math, bounds_checks), target=compile_target())
# --8<-- [end:backward_kernel]
