"""TileLang kernel: lightning indexer scores.

``scores[t, s] = sum_j w[t, j] * relu(q[t, j] . k[s])`` for ``starts[t] <= s < ends[t]``.

One block of threads owns ``BLOCK_Q`` consecutive queries and keeps their ``[H_I, D_I]`` queries in
shared memory. It walks the key tiles that any of its queries can see (``[min start, max end)``),
loading each ``[128, D_I]`` key tile once (asynchronously, two stages) for all its queries. Per query
and tile, one tensor-core GEMM puts *keys on rows and heads on columns*,
``logits [128 keys, H_I] = K_tile @ q[t]^T``; then ReLU, the head weights and the sum over the
``H_I`` columns -- a reduction inside groups of 4 threads rather than across warps. Scores outside
a query's window are ``-inf``: the kernel writes every entry, the tiles outside the block's key
range included, so the output needs no separate pre-fill pass. The keys are small (``S x 256`` bytes) and stay in L2.
"""

import functools

import tilelang
import tilelang.language as T

from ._target import compile_target

_PASS = {tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}

BLOCK_N = 64  # keys per tile
BLOCK_Q = 2  # queries per block: small blocks, so that two fit on an SM (benchmarks/tune_kernels.py)


# --8<-- [start:indexer_kernel]
@functools.lru_cache(maxsize=None)
def indexer_kernel(heads: int, dim: int, relu: bool = True, *, block_q: int = BLOCK_Q, pingpong: bool = True,
                   block_n: int = BLOCK_N):
    """Compile the indexer-score kernel for ``H_I = heads`` (16, 32 or 64) and ``D_I = dim``.

    Kernel arguments: ``Q [T, H_I, D_I]`` bf16, ``K [S, D_I]`` bf16, ``W [T, H_I]`` fp32,
    ``Starts [T]``, ``Ends [T]`` int32, ``Scores [T, S]`` fp32 (written in place, every entry: ``-inf``
    outside the query's window).

    ``pingpong=True`` overlaps the tensor cores with the epilogue: two accumulators take turns,
    the GEMM of query ``i + 1`` is issued (asynchronously, ``T.wgmma_gemm``) before the ReLU,
    weighting and head sum of query ``i`` run on the CUDA cores. ``block_q`` queries (even) share
    each key tile of ``block_n`` keys (loaded one tile ahead). These are tuning knobs
    (``benchmarks/tune_kernels.py``): more queries per block read the keys fewer times, fewer let
    two blocks share an SM.
    """
    if heads not in (16, 32, 64):
        raise ValueError(f"indexer heads must be 16, 32 or 64, got {heads}")
    if dim % 16:
        raise ValueError(f"indexer head dim must be a multiple of 16, got {dim}")
    if block_q % 2:
        raise ValueError(f"block_q must be even, got {block_q}")
    num_q, num_kv = T.dynamic("num_q"), T.dynamic("num_kv")
    bf16, f32 = "bfloat16", "float32"

    @T.macro
    def issue(k_s, q_s, qi, logits, asynchronous):
        """``logits [keys, heads] = K_tile @ q[qi]^T`` on the tensor cores."""
        if asynchronous:
            T.wgmma_gemm(k_s, q_s[qi, :, :], logits, transpose_B=True, clear_accum=True)
        else:
            T.gemm(k_s, q_s[qi, :, :], logits, transpose_B=True, clear_accum=True)

    @T.macro
    def epilogue(logits, row, w_s, qi, t0, s0, Starts, Ends, Scores):
        """``Scores[t0 + qi, s0 + n] = sum_h w[h] * relu(logits[n, h])`` inside the window."""
        for n, h in T.Parallel(block_n, heads):
            if relu:
                logits[n, h] = T.max(logits[n, h], 0) * w_s[qi, h]
            else:
                logits[n, h] = logits[n, h] * w_s[qi, h]
        T.reduce_sum(logits, row, dim=1)  # [block_n]: the sum over heads
        t = T.min(t0 + qi, num_q - 1)
        for n in T.Parallel(block_n):
            if t0 + qi < num_q and s0 + n < num_kv:
                Scores[t, s0 + n] = T.if_then_else(s0 + n >= Starts[t] and s0 + n < Ends[t], row[n],
                                                   -T.infinity(f32))

    @T.macro
    def tile_scores(k_a, q_s, w_s, logits, logits_b, row, t0, s0, Starts, Ends, Scores):
        """The scores of every query of the block against one key tile ``k_a`` (keys ``s0 ...``)."""
        if pingpong:
            # queries 2p and 2p+1 take turns: one accumulator's GEMM runs while the other's
            # epilogue does; wait_wgmma(1) = "all but the newest GEMM are done"
            issue(k_a, q_s, 0, logits, True)
            for pair in T.unroll(block_q // 2):
                issue(k_a, q_s, 2 * pair + 1, logits_b, True)
                T.wait_wgmma(1)
                epilogue(logits, row, w_s, 2 * pair, t0, s0, Starts, Ends, Scores)
                if pair + 1 < block_q // 2:
                    issue(k_a, q_s, 2 * pair + 2, logits, True)
                    T.wait_wgmma(1)
                else:
                    T.wait_wgmma(0)
                epilogue(logits_b, row, w_s, 2 * pair + 1, t0, s0, Starts, Ends, Scores)
        else:
            for qi in T.unroll(block_q):
                issue(k_a, q_s, qi, logits, False)
                epilogue(logits, row, w_s, qi, t0, s0, Starts, Ends, Scores)

    @T.prim_func
    def main(Q: T.Tensor((num_q, heads, dim), bf16), K: T.Tensor((num_kv, dim), bf16),
             W: T.Tensor((num_q, heads), f32), Starts: T.Tensor((num_q,), "int32"),
             Ends: T.Tensor((num_q,), "int32"), Scores: T.Tensor((num_q, num_kv), f32)):
        with T.Kernel(T.ceildiv(num_q, block_q), threads=128) as bx:
            q_s = T.alloc_shared((block_q, heads, dim), bf16)
            k_s = T.alloc_shared((block_n, dim), bf16)
            w_s = T.alloc_shared((block_q, heads), f32, scope="shared")
            logits = T.alloc_fragment((block_n, heads), f32)  # [keys, heads]
            logits_b = T.alloc_fragment((block_n, heads), f32)  # the second accumulator (pingpong)
            row = T.alloc_fragment((block_n,), f32)
            lo = T.alloc_var("int32")
            hi = T.alloc_var("int32")
            t0 = bx * block_q

            # the key range any query of this block can see
            lo = num_kv
            hi = 0
            for qi in T.serial(block_q):
                if t0 + qi < num_q:
                    lo = T.min(lo, Starts[t0 + qi])
                    hi = T.max(hi, Ends[t0 + qi])
            for qi, h, d in T.Parallel(block_q, heads, dim):
                q_s[qi, h, d] = T.if_then_else(t0 + qi < num_q, Q[T.min(t0 + qi, num_q - 1), h, d], 0)
            for qi, h in T.Parallel(block_q, heads):
                w_s[qi, h] = T.if_then_else(t0 + qi < num_q, W[T.min(t0 + qi, num_q - 1), h], 0)

            first_tile = lo // block_n
            end_tile = T.max(T.ceildiv(hi, block_n), first_tile)
            # the tiles no query of the block can see are -inf in every row of the block
            for kt in T.serial(T.ceildiv(num_kv, block_n)):
                if kt < first_tile or kt >= end_tile:
                    for qi, n in T.Parallel(block_q, block_n):
                        if t0 + qi < num_q and kt * block_n + n < num_kv:
                            Scores[t0 + qi, kt * block_n + n] = -T.infinity(f32)
            n_tiles = end_tile - first_tile
            for kt in T.Pipelined(n_tiles, num_stages=2):
                s0 = (first_tile + kt) * block_n
                T.copy(K[s0:s0 + block_n, :], k_s)  # rows past the end are never stored below
                tile_scores(k_s, q_s, w_s, logits, logits_b, row, t0, s0, Starts, Ends, Scores)

    return tilelang.compile(main, pass_configs=_PASS, target=compile_target())
# --8<-- [end:indexer_kernel]
