"""TileLang kernel: sparse MLA backward.

With ``P = softmax(sigma * Q K_sel^T)`` recomputed from the saved natural-log ``lse`` and
``Delta[t, h] = sum_d O[t, h, d] * dO[t, h, d]`` (computed by the wrapper):

    dP  = dO @ V_sel^T                     [H_blk, 32]
    dS  = P * (dP - Delta) * sigma          (softmax backward)
    dQ += dS @ K_sel                        [H_blk, 576]
    dKV[idx] += dS^T @ Q + P^T @ dO          [32, 576]  (the value half gets both terms)

One block of threads owns one query and up to 64 of its heads and walks its selected rows 32 at a
time. Different queries select the same keys, so ``dKV`` is accumulated with fp32 atomic adds into
a buffer the wrapper zeroes (``-1`` slots add nothing). Atomics make ``dKV`` reproducible only up
to float rounding order.
"""

import functools

import tilelang
import tilelang.language as T

from ._target import compile_target
from .sparse_mla_fwd import LOG2E, head_blocking

BLOCK_S = 32  # selected rows per step
SPLIT = 2  # the [32, 576] fp32 dKV tile is staged through shared memory in halves

def _pass_configs(fast_math: bool, bounds_checks: bool) -> dict:
    return {
        tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
        tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True,
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


# --8<-- [start:backward_kernel]
@functools.lru_cache(maxsize=None)
def backward_kernel(heads: int, dim: int, dim_v: int, sm_scale: float, *, fast_math: bool = True,
                    policy: str = "Square", bounds_checks: bool = False):
    """Compile the sparse MLA backward for these sizes (any number of queries, keys and slots).

    Kernel arguments: ``Q [T, H, D]``, ``KV [S, D]``, ``dO [T, H, dim_v]`` bf16, ``Indices [T, K]``
    int32 (``K`` a multiple of 32), ``NumBlocks [T]`` int32 (32-slot blocks to visit per row, up to
    its last valid slot), ``Lse2 [T, H]`` fp32 (the LSE in base 2, ``+inf`` for empty rows so that
    every ``P`` of the row is 0), ``Delta [T, H]`` fp32, ``dKV [S, D]`` fp32 (zeroed; accumulated in
    place); returns ``dQ [T, H, D]`` bf16. ``fast_math``, ``policy`` (how the GEMMs split over
    warps) and ``bounds_checks`` (TileLang's guards on every global load) are tuning knobs, see
    ``benchmarks/tune_kernels.py``.
    """
    hb, per_query = head_blocking(heads)
    dim_tail = dim - dim_v
    scale2 = sm_scale * LOG2E
    threads = 256 if hb >= 64 else 128
    num_q, num_kv, topk = T.dynamic("num_q"), T.dynamic("num_kv"), T.dynamic("topk")
    warp_policy = getattr(T.GemmWarpPolicy, policy)
    rows_half = BLOCK_S // SPLIT
    bf16, f32 = "bfloat16", "float32"

    @T.prim_func
    def main(Q: T.Tensor((num_q, heads, dim), bf16), KV: T.Tensor((num_kv, dim), bf16),
             dO: T.Tensor((num_q, heads, dim_v), bf16), Indices: T.Tensor((num_q, topk), "int32"),
             NumBlocks: T.Tensor((num_q,), "int32"), Lse2: T.Tensor((num_q, heads), f32),
             Delta: T.Tensor((num_q, heads), f32),
             dKV: T.Tensor((num_kv, dim), f32), dQ: T.Tensor((num_q, heads, dim), bf16)):
        with T.Kernel(num_q * per_query, threads=threads) as bx:
            t = bx // per_query
            h0 = (bx % per_query) * hb
            q_s = T.alloc_shared((hb, dim), bf16)
            do_s = T.alloc_shared((hb, dim_v), bf16)
            v_s = T.alloc_shared((BLOCK_S, dim_v), bf16)
            tail_s = T.alloc_shared((BLOCK_S, dim_tail), bf16)
            p_s = T.alloc_shared((hb, BLOCK_S), bf16)
            ds_s = T.alloc_shared((hb, BLOCK_S), bf16)
            dkv_stage = T.alloc_shared((rows_half, dim_v), f32)
            dtail_stage = T.alloc_shared((rows_half, dim_tail), f32)
            valid = T.alloc_fragment((BLOCK_S,), "bool")

            acc_p = T.alloc_fragment((hb, BLOCK_S), f32)
            acc_dp = T.alloc_fragment((hb, BLOCK_S), f32)
            acc_dq = T.alloc_fragment((hb, dim_v), f32)
            acc_dq_tail = T.alloc_fragment((hb, dim_tail), f32)
            acc_dkv = T.alloc_fragment((BLOCK_S, dim_v), f32)
            acc_dkv_tail = T.alloc_fragment((BLOCK_S, dim_tail), f32)

            T.copy(Q[t, h0:h0 + hb, :dim_v], q_s[:, :dim_v])
            T.copy(Q[t, h0:h0 + hb, dim_v:], q_s[:, dim_v:])
            T.copy(dO[t, h0:h0 + hb, :], do_s)
            T.clear(acc_dq)
            T.clear(acc_dq_tail)

            for blk in T.Pipelined(NumBlocks[t], num_stages=0):
                for i in T.Parallel(BLOCK_S):
                    valid[i] = Indices[t, blk * BLOCK_S + i] >= 0
                for i, d in T.Parallel(BLOCK_S, dim_v):
                    v_s[i, d] = KV[T.max(Indices[t, blk * BLOCK_S + i], 0), d]
                for i, d in T.Parallel(BLOCK_S, dim_tail):
                    tail_s[i, d] = KV[T.max(Indices[t, blk * BLOCK_S + i], 0), dim_v + d]
                # recompute P from the saved LSE
                for h, i in T.Parallel(hb, BLOCK_S):
                    acc_p[h, i] = T.if_then_else(valid[i], 0, -T.infinity(f32))
                T.gemm(q_s[:, :dim_v], v_s, acc_p, transpose_B=True, policy=warp_policy)
                T.gemm(q_s[:, dim_v:], tail_s, acc_p, transpose_B=True, policy=warp_policy)
                for h, i in T.Parallel(hb, BLOCK_S):
                    acc_p[h, i] = T.exp2(acc_p[h, i] * scale2 - Lse2[t, h0 + h])
                T.copy(acc_p, p_s)
                # dS = P * (dO V^T - Delta) * sigma
                T.gemm(do_s, v_s, acc_dp, transpose_B=True, policy=warp_policy, clear_accum=True)
                for h, i in T.Parallel(hb, BLOCK_S):
                    acc_dp[h, i] = acc_p[h, i] * (acc_dp[h, i] - Delta[t, h0 + h]) * sm_scale
                T.copy(acc_dp, ds_s)
                # dQ += dS K
                T.gemm(ds_s, v_s, acc_dq, policy=warp_policy)
                T.gemm(ds_s, tail_s, acc_dq_tail, policy=warp_policy)
                # dKV_blk = dS^T Q + P^T dO
                T.gemm(ds_s, q_s[:, :dim_v], acc_dkv, transpose_A=True, policy=warp_policy,
                       clear_accum=True)
                T.gemm(p_s, do_s, acc_dkv, transpose_A=True, policy=warp_policy)
                T.gemm(ds_s, q_s[:, dim_v:], acc_dkv_tail, transpose_A=True, policy=warp_policy,
                       clear_accum=True)
                # scatter-add into dKV, half a tile at a time through shared memory, 4 floats per atomic
                for part in T.serial(SPLIT):
                    for i, d in T.Parallel(BLOCK_S, dim_v):
                        if i // rows_half == part:
                            dkv_stage[i % rows_half, d] = acc_dkv[i, d]
                    for i, d in T.Parallel(BLOCK_S, dim_tail):
                        if i // rows_half == part:
                            dtail_stage[i % rows_half, d] = acc_dkv_tail[i, d]
                    for i, d4 in T.Parallel(rows_half, dim_v // 4):
                        slot = blk * BLOCK_S + part * rows_half + i
                        if Indices[t, slot] >= 0:
                            T.atomic_addx4(dKV[Indices[t, slot], d4 * 4], dkv_stage[i, d4 * 4])
                    for i, d4 in T.Parallel(rows_half, dim_tail // 4):
                        slot = blk * BLOCK_S + part * rows_half + i
                        if Indices[t, slot] >= 0:
                            T.atomic_addx4(dKV[Indices[t, slot], dim_v + d4 * 4], dtail_stage[i, d4 * 4])

            T.copy(acc_dq, dQ[t, h0:h0 + hb, :dim_v])
            T.copy(acc_dq_tail, dQ[t, h0:h0 + hb, dim_v:])

    return tilelang.compile(main, out_idx=[8], pass_configs=_pass_configs(fast_math, bounds_checks), target=compile_target())
# --8<-- [end:backward_kernel]
