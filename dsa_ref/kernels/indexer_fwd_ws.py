r"""TileLang kernel: lightning-indexer scores with warp-specialised roles (bf16 or fp8 operands).

The same scores as `indexer_fwd.indexer_kernel` (bf16) and `indexer_fwd_fp8.indexer_fp8_kernel`
(e4m3 with DeepSeek's scales), with the work of a block split by role instead of done in turn by
one warpgroup:

* **consumers** (``consumers`` warpgroups): consumer ``c`` takes keys ``64 c ... 64 c + 63`` of
  every stage, runs one tensor-core GEMM ``logits [64 keys, 2 H_I] = K_sub @ [q[t]; q[t+1]]^T``
  for the block's two queries, then the ReLU, the head weights (kept in registers) and the sum
  over heads, and leaves the ``[2, 64]`` head sums in shared memory. It never waits on a global
  load and never writes global memory.
* **the streaming warpgroup** (the last 128 threads): one thread issues the bulk-tensor (TMA)
  loads of the ``[64 consumers, D_I]`` key tiles, ``stages`` tiles ahead; all 128 write the
  scores of each finished stage, coalesced (the key scale applied for fp8, ``-inf`` outside each
  query's window), and the ``-inf`` of the tiles no query of the block can see.

Consumer ``c``'s tensor cores run while another consumer's CUDA cores do their epilogue, and the
global traffic (key loads, score stores) overlaps both. Blocks are taken last queries first: in
a causal sequence those see the most keys, and the longest blocks are best started early.
Barriers, per stage: ``k_ready`` (the tile landed), ``k_free`` (every consumer's GEMM read it),
``row_ready`` (the head sums are in shared memory), ``row_free`` (they are written out).
"""

import functools

import tilelang
import tilelang.language as T

from ._target import compile_target

_PASS = {tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}  # the roles and bulk copies are written out here

BLOCK_Q = 2  # queries per block: the GEMM's N = 2 H_I
SUB = 64  # keys per consumer per stage: one warpgroup MMA's M


def score_prim_func(body, heads: int, dim: int, fp8: bool, num_q, num_kv):
    """The kernel signature the index-score kernels share, around their ``body`` macro:
    ``(Q, K, W, Starts, Ends, Scores)`` in bf16, ``(Q, QS, K, KS, W, Starts, Ends, Scores)`` in fp8
    (e4m3 operands with fp32 scales); ``num_q``, ``num_kv`` are the kernel's dynamic sizes."""
    dtype, f32 = ("float8_e4m3fn" if fp8 else "bfloat16"), "float32"
    if fp8:
        @T.prim_func
        def main(Q: T.Tensor((num_q, heads, dim), dtype), QS: T.Tensor((num_q, heads), f32),
                 K: T.Tensor((num_kv, dim), dtype), KS: T.Tensor((num_kv,), f32),
                 W: T.Tensor((num_q, heads), f32), Starts: T.Tensor((num_q,), "int32"),
                 Ends: T.Tensor((num_q,), "int32"), Scores: T.Tensor((num_q, num_kv), f32)):
            body(Q, QS, K, KS, W, Starts, Ends, Scores)
    else:
        @T.prim_func
        def main(Q: T.Tensor((num_q, heads, dim), dtype), K: T.Tensor((num_kv, dim), dtype),
                 W: T.Tensor((num_q, heads), f32), Starts: T.Tensor((num_q,), "int32"),
                 Ends: T.Tensor((num_q,), "int32"), Scores: T.Tensor((num_q, num_kv), f32)):
            body(Q, None, K, None, W, Starts, Ends, Scores)
    return main


def check_indexer_sizes(heads: int, dim: int, fp8: bool) -> None:
    """The sizes the warpgroup-MMA indexer kernels take: ``H_I`` 16, 32 or 64, and ``D_I`` a multiple of
    one MMA step (16 channels in bf16, 32 in fp8); ValueError otherwise."""
    if heads not in (16, 32, 64):
        raise ValueError(f"indexer heads must be 16, 32 or 64, got {heads}")
    step = 32 if fp8 else 16  # channels per warpgroup MMA step
    if dim % step:
        raise ValueError(f"indexer head dim must be a multiple of {step} (one {'fp8' if fp8 else 'bf16'} MMA step), "
                         f"got {dim}")


# --8<-- [start:indexer_ws_kernel]
@functools.lru_cache(maxsize=None)
def indexer_ws_kernel(heads: int, dim: int, relu: bool = True, *, fp8: bool = False, consumers: int = 2,
                      stages: int = 2):
    """Compile the warp-specialised indexer-score kernel for ``H_I = heads`` (16, 32, 64), ``D_I = dim``.

    ``fp8=False``: the arguments of `indexer_fwd.indexer_kernel` (``Q [T, H_I, D_I]``, ``K [S, D_I]``
    bf16, ``W``, ``Starts``, ``Ends``, ``Scores``). ``fp8=True``: those of
    `indexer_fwd_fp8.indexer_fp8_kernel` (e4m3 ``Q``, ``K`` with ``QS [T, H_I]`` and ``KS [S]``
    fp32 scales). ``Scores [T, S]`` fp32 is written in place, every entry. ``consumers`` (1-3)
    consumer warpgroups, ``stages`` (2-4) key tiles of ``64 consumers`` keys in flight.
    """
    check_indexer_sizes(heads, dim, fp8)
    if consumers not in (1, 2, 3) or stages not in (2, 3, 4):
        raise ValueError(f"consumers must be 1, 2 or 3 and stages 2, 3 or 4, got {consumers} and {stages}")
    block_n = SUB * consumers  # keys per stage
    num_q, num_kv = T.dynamic("num_q"), T.dynamic("num_kv")
    dtype = "float8_e4m3fn" if fp8 else "bfloat16"
    f32 = "float32"

    @T.macro
    def consume(c, q_s, k_s, w_s, row_s, logits, part, row, w_f, n_tiles, k_ready, k_free, row_ready, row_free):
        """Consumer ``c`` (a Python int): the head sums of keys ``64 c ...`` of every stage."""
        for qi, h in T.Parallel(BLOCK_Q, heads):
            w_f[qi, h] = w_s[qi, h]
        for kt in T.serial(n_tiles):
            stage = kt % stages
            phase = (kt // stages) & 1
            T.barrier_wait(k_ready[stage], phase)
            T.gemm(k_s[stage, c * SUB:(c + 1) * SUB, :], q_s, logits, transpose_B=True, clear_accum=True)
            T.barrier_arrive(k_free[stage])  # the GEMM has read the tile
            T.barrier_wait(row_free[stage], phase ^ 1)  # this stage's previous sums are written out
            for j in T.unroll(BLOCK_Q):  # query j owns the columns j*H_I .. (j+1)*H_I-1
                for n, h in T.Parallel(SUB, heads):
                    if relu:
                        part[n, h] = T.max(logits[n, j * heads + h], 0) * w_f[j, h]
                    else:
                        part[n, h] = logits[n, j * heads + h] * w_f[j, h]
                T.reduce_sum(part, row, dim=1)  # [64]: the sum over heads
                for n in T.Parallel(SUB):
                    row_s[stage, j, c * SUB + n] = row[n]
            T.barrier_arrive(row_ready[stage])

    @T.macro
    def stream(t0, first_tile, n_tiles, K, KS, Starts, Ends, Scores, k_s, row_s, k_ready, k_free, row_ready,
               row_free):
        """The streaming warpgroup: key tiles in, ``stages`` ahead; scores out."""
        for kt in T.serial(T.ceildiv(num_kv, block_n)):  # the tiles no query of the block can see
            if kt < first_tile or kt >= first_tile + n_tiles:
                for qi, n in T.Parallel(BLOCK_Q, block_n):
                    if t0 + qi < num_q and kt * block_n + n < num_kv:
                        Scores[t0 + qi, kt * block_n + n] = -T.infinity(f32)
        for kt in T.serial(T.min(stages, n_tiles)):  # fill the pipeline (rows past S load as zeros)
            T.tma_copy(K[(first_tile + kt) * block_n:(first_tile + kt + 1) * block_n, :], k_s[kt, :, :],
                       barrier=k_ready[kt])
            T.barrier_arrive(k_ready[kt])
        for kt in T.serial(n_tiles):
            stage = kt % stages
            phase = (kt // stages) & 1
            s0 = (first_tile + kt) * block_n
            T.barrier_wait(row_ready[stage], phase)
            for qi, n in T.Parallel(BLOCK_Q, block_n):
                if t0 + qi < num_q and s0 + n < num_kv:
                    inside = s0 + n >= Starts[t0 + qi] and s0 + n < Ends[t0 + qi]
                    if fp8:
                        Scores[t0 + qi, s0 + n] = T.if_then_else(inside, row_s[stage, qi, n] * KS[s0 + n],
                                                                 -T.infinity(f32))
                    else:
                        Scores[t0 + qi, s0 + n] = T.if_then_else(inside, row_s[stage, qi, n], -T.infinity(f32))
            T.barrier_arrive(row_free[stage])
            if kt + stages < n_tiles:  # every consumer's GEMM of this stage is done by now
                T.barrier_wait(k_free[stage], phase)
                T.tma_copy(K[s0 + stages * block_n:s0 + (stages + 1) * block_n, :], k_s[stage, :, :],
                           barrier=k_ready[stage])
                T.barrier_arrive(k_ready[stage])

    @T.macro
    def body(Q, QS, K, KS, W, Starts, Ends, Scores):
        with T.Kernel(T.ceildiv(num_q, BLOCK_Q), threads=128 * (consumers + 1)) as bx:
            q_s = T.alloc_shared((BLOCK_Q * heads, dim), dtype)  # query qi's heads on rows qi*H_I ...
            k_s = T.alloc_shared((stages, block_n, dim), dtype)
            w_s = T.alloc_shared((BLOCK_Q, heads), f32, scope="shared")  # w (times the query scale for fp8)
            row_s = T.alloc_shared((stages, BLOCK_Q, block_n), f32, scope="shared")  # head sums per stage
            logits = [T.alloc_fragment((SUB, BLOCK_Q * heads), f32) for _ in range(consumers)]  # [keys, (q, h)]
            part = [T.alloc_fragment((SUB, heads), f32) for _ in range(consumers)]  # one query's columns
            row = [T.alloc_fragment((SUB,), f32) for _ in range(consumers)]
            w_f = [T.alloc_fragment((BLOCK_Q, heads), f32) for _ in range(consumers)]
            k_ready = T.alloc_barrier(arrive_count=[128] * stages)
            k_free = T.alloc_barrier(arrive_count=[128 * consumers] * stages)
            row_ready = T.alloc_barrier(arrive_count=[128 * consumers] * stages)
            row_free = T.alloc_barrier(arrive_count=[128] * stages)
            lo = T.alloc_var("int32")
            hi = T.alloc_var("int32")
            tx = T.get_thread_binding()
            t0 = (T.ceildiv(num_q, BLOCK_Q) - 1 - bx) * BLOCK_Q  # the last queries first

            lo = num_kv  # the key range any query of the block can see
            hi = 0
            for qi in T.serial(BLOCK_Q):
                if t0 + qi < num_q:
                    lo = T.min(lo, Starts[t0 + qi])
                    hi = T.max(hi, Ends[t0 + qi])
            first_tile = lo // block_n
            n_tiles = T.max(T.ceildiv(hi, block_n), first_tile) - first_tile
            # all threads load the queries and weights; a partial last block repeats its last
            # query (its columns are computed and never stored: a column is one query head's)
            for qi, h, d in T.Parallel(BLOCK_Q, heads, dim):
                q_s[qi * heads + h, d] = Q[T.min(t0 + qi, num_q - 1), h, d]
            for qi, h in T.Parallel(BLOCK_Q, heads):
                t = T.min(t0 + qi, num_q - 1)
                if fp8:
                    w_s[qi, h] = T.if_then_else(t0 + qi < num_q, W[t, h] * QS[t, h], 0)
                else:
                    w_s[qi, h] = T.if_then_else(t0 + qi < num_q, W[t, h], 0)
            T.fence_proxy_async()  # q_s is read by the tensor cores (the async proxy)
            T.sync_threads()

            a = (q_s, k_s, w_s, row_s)
            bars = (k_ready, k_free, row_ready, row_free)
            io = (K, KS, Starts, Ends, Scores, k_s, row_s)
            if consumers == 1:
                if tx < 128:
                    consume(0, *a, logits[0], part[0], row[0], w_f[0], n_tiles, *bars)
                else:
                    stream(t0, first_tile, n_tiles, *io, *bars)
            elif consumers == 2:
                if tx < 128:
                    consume(0, *a, logits[0], part[0], row[0], w_f[0], n_tiles, *bars)
                elif tx < 256:
                    consume(1, *a, logits[1], part[1], row[1], w_f[1], n_tiles, *bars)
                else:
                    stream(t0, first_tile, n_tiles, *io, *bars)
            else:
                if tx < 128:
                    consume(0, *a, logits[0], part[0], row[0], w_f[0], n_tiles, *bars)
                elif tx < 256:
                    consume(1, *a, logits[1], part[1], row[1], w_f[1], n_tiles, *bars)
                elif tx < 384:
                    consume(2, *a, logits[2], part[2], row[2], w_f[2], n_tiles, *bars)
                else:
                    stream(t0, first_tile, n_tiles, *io, *bars)

    return tilelang.compile(score_prim_func(body, heads, dim, fp8, num_q, num_kv), pass_configs=_PASS,
                            target=compile_target())
# --8<-- [end:indexer_ws_kernel]
