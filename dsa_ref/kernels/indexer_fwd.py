"""TileLang kernel: lightning indexer scores.

``scores[t, s] = sum_j w[t, j] * relu(q[t, j] . k[s])`` for ``starts[t] <= s < ends[t]``.

One block of threads owns ``BLOCK_Q`` consecutive queries and keeps their ``[H_I, D_I]`` queries in
shared memory. It walks the key tiles that any of its queries can see (``[min start, max end)``),
loading each ``[128, D_I]`` key tile once (asynchronously, two stages) for all its queries. Per query
and tile, one tensor-core GEMM puts *keys on rows and heads on columns*,
``logits [128 keys, H_I] = K_tile @ q[t]^T``; then ReLU, the head weights and the sum over the
``H_I`` columns -- a reduction inside groups of 4 threads rather than across warps. Scores outside
a query's window are ``-inf``: the wrapper pre-fills the output with ``-inf`` and the kernel writes
only inside the windows. The keys are small (``S x 256`` bytes) and stay in L2.
"""

import functools

import tilelang
import tilelang.language as T

from ._target import compile_target

BLOCK_N = 128  # keys per tile
BLOCK_Q = 8  # queries per block

_PASS = {
    tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
}


# --8<-- [start:indexer_kernel]
@functools.lru_cache(maxsize=None)
def indexer_kernel(heads: int, dim: int, relu: bool = True):
    """Compile the indexer-score kernel for ``H_I = heads`` (16, 32 or 64) and ``D_I = dim``.

    Kernel arguments: ``Q [T, H_I, D_I]`` bf16, ``K [S, D_I]`` bf16, ``W [T, H_I]`` fp32,
    ``Starts [T]``, ``Ends [T]`` int32, ``Scores [T, S]`` fp32 (pre-filled with -inf, written in place).
    """
    if heads not in (16, 32, 64):
        raise ValueError(f"indexer heads must be 16, 32 or 64, got {heads}")
    if dim % 16:
        raise ValueError(f"indexer head dim must be a multiple of 16, got {dim}")
    num_q, num_kv = T.dynamic("num_q"), T.dynamic("num_kv")
    bf16, f32 = "bfloat16", "float32"

    @T.prim_func
    def main(Q: T.Tensor((num_q, heads, dim), bf16), K: T.Tensor((num_kv, dim), bf16),
             W: T.Tensor((num_q, heads), f32), Starts: T.Tensor((num_q,), "int32"),
             Ends: T.Tensor((num_q,), "int32"), Scores: T.Tensor((num_q, num_kv), f32)):
        with T.Kernel(T.ceildiv(num_q, BLOCK_Q), threads=128) as bx:
            q_s = T.alloc_shared((BLOCK_Q, heads, dim), bf16)
            k_s = T.alloc_shared((BLOCK_N, dim), bf16)
            w_s = T.alloc_shared((BLOCK_Q, heads), f32, scope="shared")
            logits = T.alloc_fragment((BLOCK_N, heads), f32)
            row = T.alloc_fragment((BLOCK_N,), f32)
            lo = T.alloc_var("int32")
            hi = T.alloc_var("int32")
            t0 = bx * BLOCK_Q

            # the key range any query of this block can see
            lo = num_kv
            hi = 0
            for qi in T.serial(BLOCK_Q):
                if t0 + qi < num_q:
                    lo = T.min(lo, Starts[t0 + qi])
                    hi = T.max(hi, Ends[t0 + qi])
            for qi, h, d in T.Parallel(BLOCK_Q, heads, dim):
                q_s[qi, h, d] = T.if_then_else(t0 + qi < num_q, Q[T.min(t0 + qi, num_q - 1), h, d], 0)
            for qi, h in T.Parallel(BLOCK_Q, heads):
                w_s[qi, h] = T.if_then_else(t0 + qi < num_q, W[T.min(t0 + qi, num_q - 1), h], 0)

            first_tile = lo // BLOCK_N
            for kt in T.Pipelined(T.max(T.ceildiv(hi, BLOCK_N) - first_tile, 0), num_stages=2):
                s0 = (first_tile + kt) * BLOCK_N
                T.copy(K[s0:s0 + BLOCK_N, :], k_s)  # rows past the end are never stored below
                for qi in T.unroll(BLOCK_Q):
                    T.gemm(k_s, q_s[qi, :, :], logits, transpose_B=True, clear_accum=True)  # [keys, heads]
                    for n, h in T.Parallel(BLOCK_N, heads):
                        if relu:
                            logits[n, h] = T.max(logits[n, h], 0) * w_s[qi, h]
                        else:
                            logits[n, h] = logits[n, h] * w_s[qi, h]
                    T.reduce_sum(logits, row, dim=1)
                    t = t0 + qi
                    for n in T.Parallel(BLOCK_N):
                        if t < num_q and s0 + n < num_kv:
                            if s0 + n >= Starts[T.min(t, num_q - 1)] and s0 + n < Ends[T.min(t, num_q - 1)]:
                                Scores[t, s0 + n] = row[n]

    return tilelang.compile(main, pass_configs=_PASS, target=compile_target())
# --8<-- [end:indexer_kernel]
