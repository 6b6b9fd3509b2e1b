"""TileLang kernel: lightning indexer scores, one warpgroup doing everything in turn.

``scores[t, s] = sum_j w[t, j] * relu(q[t, j] . k[s])`` for ``starts[t] <= s < ends[t]``.

(`indexer_kernel`'s default is the warp-specialised schedule of `indexer_fwd_ws`, faster in bf16;
``consumers=0`` is the schedule below, which the fp8 kernel uses.) One block of threads owns
``BLOCK_Q`` consecutive queries and keeps their ``[H_I, D_I]`` queries in
shared memory, one query's heads after the other: ``[BLOCK_Q * H_I, D_I]``. It walks the key tiles
that any of its queries can see (``[min start, max end)``), loading each ``[64, D_I]`` key tile
once (asynchronously, two stages) for all its queries. Per tile, one tensor-core GEMM for a pair
of queries puts *keys on rows and (query, head) on columns*,
``logits [64 keys, 2 H_I] = K_tile @ [q[t]; q[t+1]]^T``; then ReLU, the head weights and, for each
query, the sum over its ``H_I`` columns -- a reduction inside groups of 4 threads rather than
across warps. Scores outside a query's window are ``-inf``: the kernel writes every entry, the
tiles outside the block's key range included, so the output needs no separate pre-fill pass.
The keys are small (``S x 256`` bytes) and stay in L2.
"""

import functools

import tilelang
import tilelang.language as T

from ._target import compile_target
from .indexer_fwd_persistent import indexer_persistent_kernel
from .indexer_fwd_ws import check_indexer_sizes, indexer_ws_kernel

_PASS = {tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}

BLOCK_N = 64  # keys per tile
BLOCK_Q = 2  # queries per block: small blocks, so that several fit on an SM (benchmarks/tune_kernels.py)
CONSUMERS = 1  # the default schedule: the warp-specialised kernel (indexer_fwd_ws) with one consumer
STAGES = 2  # its key tiles in flight


# --8<-- [start:indexer_kernel]
@functools.lru_cache(maxsize=None)
def indexer_kernel(heads: int, dim: int, relu: bool = True, *, block_q: int = BLOCK_Q, pingpong: bool = False,
                   block_n: int = BLOCK_N, merge: int = 2, min_blocks: int = 0,
                   consumers: int = CONSUMERS, stages: int = STAGES, persistent: bool = False):
    """Compile the indexer-score kernel for ``H_I = heads`` (16, 32 or 64) and ``D_I = dim``.

    Kernel arguments: ``Q [T, H_I, D_I]`` bf16, ``K [S, D_I]`` bf16, ``W [T, H_I]`` fp32,
    ``Starts [T]``, ``Ends [T]`` int32, ``Scores [T, S]`` fp32 (written in place, every entry: ``-inf``
    outside the query's window).

    Tuning knobs (``benchmarks/tune_kernels.py``; the defaults won there):

    * ``merge``: queries per GEMM. With ``merge=2`` the GEMM is ``[block_n, 2 H_I]`` wide (N = 128
      for 64 heads), so the tensor cores read each key tile from shared memory once for two
      queries (at N = 64 they are bound by shared-memory bandwidth); the epilogue then takes the
      GEMM's columns one query at a time.
    * ``pingpong``: two accumulators take turns, the GEMM of query group ``g + 1`` is issued
      (asynchronously, ``T.wgmma_gemm``) before the ReLU, weighting and head sum of group ``g``
      run on the CUDA cores; needs an even number of groups.
    * ``block_q`` (even) queries share each key tile of ``block_n`` keys (loaded one tile ahead):
      more queries per block read the keys fewer times, fewer let more blocks share an SM.
    * ``min_blocks``: blocks per SM asked of the compiler (it then keeps to fewer registers).
    * ``consumers`` > 0 (the default, 1) selects the warp-specialised kernel instead,
      `indexer_fwd_ws.indexer_ws_kernel`, with that many consumer warpgroups and ``stages`` key
      tiles in flight; the knobs above are those of ``consumers=0``, one warpgroup doing
      everything in turn.
    * ``persistent``: `indexer_fwd_persistent.indexer_persistent_kernel`, one resident block per SM
      with ``consumers`` (2-4) consumer warpgroups and ``stages`` key tiles in flight.

    The wrapper (`autograd.lightning_indexer_tilelang`) runs `shapes.INDEXER_DEFAULT`, the persistent
    schedule with two consumers and pingpong, the fastest measured.
    """
    if persistent:  # one resident block per SM, DeepGEMM's scheme
        return indexer_persistent_kernel(heads, dim, relu, fp8=False, consumers=consumers, stages=stages,
                                         pingpong=pingpong)
    if consumers:  # the warp-specialised schedule
        return indexer_ws_kernel(heads, dim, relu, fp8=False, consumers=consumers, stages=stages)
    check_indexer_sizes(heads, dim, fp8=False)
    if merge not in (1, 2) or block_q % merge:
        raise ValueError(f"merge must be 1 or 2 and divide block_q, got merge={merge}, block_q={block_q}")
    groups = block_q // merge  # GEMMs per key tile
    if pingpong and groups % 2:
        raise ValueError(f"pingpong needs an even number of query groups, got block_q={block_q}, merge={merge}")
    num_q, num_kv = T.dynamic("num_q"), T.dynamic("num_kv")
    bf16, f32 = "bfloat16", "float32"

    @T.macro
    def issue(k_s, q_s, g, logits, asynchronous):
        """``logits [keys, merge * heads] = K_tile @ q[group g]^T`` on the tensor cores."""
        # B = the group's queries, rows g*merge*H_I ... of q_s: [merge * H_I, D_I]
        if asynchronous:
            T.wgmma_gemm(k_s, q_s[g * merge * heads:(g + 1) * merge * heads, :], logits, transpose_B=True,
                         clear_accum=True)
        else:
            T.gemm(k_s, q_s[g * merge * heads:(g + 1) * merge * heads, :], logits, transpose_B=True,
                   clear_accum=True)

    @T.macro
    def store(row, qi, t0, s0, win_lo, win_hi, Scores):
        """``Scores[t0 + qi, s0 + n] = row[n]`` inside the query's window ``[win_lo[qi], win_hi[qi])``
        (the block's windows, in registers), ``-inf`` outside it."""
        t = T.min(t0 + qi, num_q - 1)
        for n in T.Parallel(block_n):
            if t0 + qi < num_q and s0 + n < num_kv:
                Scores[t, s0 + n] = T.if_then_else(s0 + n >= win_lo[qi] and s0 + n < win_hi[qi], row[n],
                                                   -T.infinity(f32))

    @T.macro
    def epilogue(logits, part, row, w_s, g, t0, s0, win_lo, win_hi, Scores):
        """``Scores[t0 + qi, s0 + n] = sum_h w[qi, h] * relu(logits[n, (qi - g*merge) * heads + h])``
        for the queries ``qi`` of group ``g``."""
        if merge == 1:  # in place
            for n, h in T.Parallel(block_n, heads):
                if relu:
                    logits[n, h] = T.max(logits[n, h], 0) * w_s[g, h]
                else:
                    logits[n, h] = logits[n, h] * w_s[g, h]
            T.reduce_sum(logits, row, dim=1)  # [block_n]: the sum over heads
            store(row, g, t0, s0, win_lo, win_hi, Scores)
        else:
            for j in T.unroll(merge):  # query g*merge + j owns the columns j*heads .. (j+1)*heads-1
                for n, h in T.Parallel(block_n, heads):
                    if relu:
                        part[n, h] = T.max(logits[n, j * heads + h], 0) * w_s[g * merge + j, h]
                    else:
                        part[n, h] = logits[n, j * heads + h] * w_s[g * merge + j, h]
                T.reduce_sum(part, row, dim=1)  # [block_n]
                store(row, g * merge + j, t0, s0, win_lo, win_hi, Scores)

    @T.macro
    def tile_scores(k_a, q_s, w_s, logits, logits_b, part, row, t0, s0, win_lo, win_hi, Scores):
        """The scores of every query of the block against one key tile ``k_a`` (keys ``s0 ...``)."""
        if pingpong:
            # groups 2p and 2p+1 take turns: one accumulator's GEMM runs while the other's
            # epilogue does; wait_wgmma(1) = "all but the newest GEMM are done"
            issue(k_a, q_s, 0, logits, True)
            for pair in T.unroll(groups // 2):
                issue(k_a, q_s, 2 * pair + 1, logits_b, True)
                T.wait_wgmma(1)
                epilogue(logits, part, row, w_s, 2 * pair, t0, s0, win_lo, win_hi, Scores)
                if pair + 1 < groups // 2:
                    issue(k_a, q_s, 2 * pair + 2, logits, True)
                    T.wait_wgmma(1)
                else:
                    T.wait_wgmma(0)
                epilogue(logits_b, part, row, w_s, 2 * pair + 1, t0, s0, win_lo, win_hi, Scores)
        else:
            for g in T.unroll(groups):
                issue(k_a, q_s, g, logits, False)
                epilogue(logits, part, row, w_s, g, t0, s0, win_lo, win_hi, Scores)

    @T.prim_func
    def main(Q: T.Tensor((num_q, heads, dim), bf16), K: T.Tensor((num_kv, dim), bf16),
             W: T.Tensor((num_q, heads), f32), Starts: T.Tensor((num_q,), "int32"),
             Ends: T.Tensor((num_q,), "int32"), Scores: T.Tensor((num_q, num_kv), f32)):
        with T.Kernel(T.ceildiv(num_q, block_q), threads=128) as bx:
            if min_blocks:
                T.annotate_min_blocks_per_sm(min_blocks)
            q_s = T.alloc_shared((block_q * heads, dim), bf16)  # query qi's heads on rows qi*H_I ...
            k_s = T.alloc_shared((block_n, dim), bf16)
            win_lo = T.alloc_local((block_q,), "int32")  # the block's query windows, in registers
            win_hi = T.alloc_local((block_q,), "int32")
            if merge == 2:  # the weights of the columns each thread holds, in registers
                w_s = T.alloc_fragment((block_q, heads), f32)
            else:  # (TileLang cannot lay out a register copy for the in-place epilogue of merge=1)
                w_s = T.alloc_shared((block_q, heads), f32, scope="shared")
            logits = T.alloc_fragment((block_n, merge * heads), f32)  # [keys, (query, head)]
            logits_b = T.alloc_fragment((block_n, merge * heads), f32)  # the second accumulator (pingpong)
            part = T.alloc_fragment((block_n, heads), f32) if merge > 1 else None  # one query's columns
            row = T.alloc_fragment((block_n,), f32)
            lo = T.alloc_var("int32")
            hi = T.alloc_var("int32")
            # the last queries first: in a causal sequence they see the most keys, and the longest
            # blocks are best started early (the short ones fill the last wave)
            t0 = (T.ceildiv(num_q, block_q) - 1 - bx) * block_q

            # the key range any query of this block can see
            lo = num_kv
            hi = 0
            for qi in T.serial(block_q):
                if t0 + qi < num_q:
                    lo = T.min(lo, Starts[t0 + qi])
                    hi = T.max(hi, Ends[t0 + qi])
                win_lo[qi] = Starts[T.min(t0 + qi, num_q - 1)]
                win_hi[qi] = Ends[T.min(t0 + qi, num_q - 1)]
            for qi, h, d in T.Parallel(block_q, heads, dim):
                q_s[qi * heads + h, d] = T.if_then_else(t0 + qi < num_q, Q[T.min(t0 + qi, num_q - 1), h, d], 0)
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
                tile_scores(k_s, q_s, w_s, logits, logits_b, part, row, t0, s0, win_lo, win_hi, Scores)

    return tilelang.compile(main, pass_configs=_PASS, target=compile_target())
# --8<-- [end:indexer_kernel]
