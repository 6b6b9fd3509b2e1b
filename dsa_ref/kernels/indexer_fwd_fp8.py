r"""TileLang kernel: lightning-indexer scores from fp8 (e4m3) queries and keys, DeepSeek's way.

DeepSeek-V3.2 scores its indexer in fp8. `dsa_ref.fp8.act_quant_block128` quantises every query
head vector and every key (128 channels = one block) to e4m3 values ``y`` with one power-of-two
float32 scale ``s`` each, and the scores are those of the dequantised values ``y * s``
(`dsa_ref.fp8.fp8_indexer_scores`, the simulation, is this kernel's oracle). Since every scale
is positive, it comes out of the ReLU:

$$
I_{t,s} = \sum_j w_{t,j}\,\mathrm{ReLU}\big((y^q_{t,j} s^q_{t,j}) \cdot (y^k_s s^k_s)\big)
        = s^k_s \sum_j \big(w_{t,j}\, s^q_{t,j}\big)\, \mathrm{ReLU}\big(y^q_{t,j} \cdot y^k_s\big),
$$

so the tensor cores multiply the e4m3 values themselves (fp8 warpgroup MMAs, twice the bf16
rate on Hopper, fp32 accumulation), the query scales are folded into the head weights once per
query, and the key scale multiplies each key's head sum. Power-of-two scales make both folds
exact in fp32: the kernel and the simulation differ only in the order (and, on Hopper, the
internal precision) of the accumulation.

The schedule is the bf16 kernel's one-warpgroup schedule (`indexer_fwd.indexer_kernel` with
``consumers=0``, the same knobs): one block of 128 threads owns ``block_q`` consecutive queries,
keeps their ``[H_I, D_I]`` e4m3 queries in shared memory (half the bytes of bf16), walks the
``[64, D_I]`` e4m3 key tiles any of them can see (the tile's 64 key scales loaded beside it), and
runs one GEMM per pair of queries with keys on rows,
``logits [64 keys, 2 H_I] = K_tile @ [q[t]; q[t+1]]^T``. Both operands are K-major (rows of
``D_I`` contiguous channels), as fp8 warpgroup MMAs require. The weights (times the query
scales) and the block's windows stay in registers; blocks go last queries first; the compiler is
asked for ``MIN_BLOCKS = 4`` blocks per SM (128 registers a thread, no spills), which wins here and
not in bf16. Every entry of ``[T, S]`` is written: the score inside the query's window, ``-inf``
outside. ``consumers`` > 0 selects the warp-specialised schedule (`indexer_fwd_ws`), slower in fp8.

Forward only. The scores are a selection criterion (the top-k), as in DeepSeek's inference and
training code; they carry no gradient (see `dsa_ref.config.IndexerConfig.fp8` for the layer).
"""

import functools

import tilelang
import tilelang.language as T
import torch

from ..fp8 import act_quant_pow2
from ._target import compile_target
from .indexer_fwd_persistent import indexer_persistent_kernel
from .indexer_fwd_ws import check_indexer_sizes, indexer_ws_kernel
from .shapes import INDEXER_FP8_DEFAULT

_PASS = {tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}

BLOCK_N = 64  # keys per tile
BLOCK_Q = 2  # queries per block (benchmarks/bench_indexer_fp8.py times others)
MIN_BLOCKS = 4  # blocks per SM asked of the compiler: it keeps to 128 registers a thread
FP8_BLOCK = 128  # channels per scale: one indexer head vector (DeepSeek: D_I = 128)
FP8_DTYPE = "float8_e4m3fn"  # torch.float8_e4m3fn: no infinities, max 448


# --8<-- [start:indexer_fp8_kernel]
@functools.lru_cache(maxsize=None)
def indexer_fp8_kernel(heads: int, dim: int, relu: bool = True, *, block_q: int = BLOCK_Q, pingpong: bool = False,
                       block_n: int = BLOCK_N, merge: int = 2, min_blocks: int = MIN_BLOCKS,
                       consumers: int = 0, stages: int = 2, persistent: bool = False):
    """Compile the fp8 indexer-score kernel for ``H_I = heads`` (16, 32 or 64) and ``D_I = dim``.

    Kernel arguments: ``Q [T, H_I, D_I]`` e4m3, ``QS [T, H_I]`` fp32 (one scale per query head),
    ``K [S, D_I]`` e4m3, ``KS [S]`` fp32 (one scale per key), ``W [T, H_I]`` fp32, ``Starts [T]``,
    ``Ends [T]`` int32, ``Scores [T, S]`` fp32 (written in place, every entry: ``-inf`` outside the
    query's window). The knobs are those of `dsa_ref.kernels.indexer_fwd.indexer_kernel`; here
    ``consumers`` defaults to 0 (one warpgroup) and ``min_blocks`` to ``MIN_BLOCKS``; ``persistent``
    selects `indexer_fwd_persistent.indexer_persistent_kernel` with ``consumers`` (2-4) and ``stages``.
    The wrappers run `shapes.INDEXER_FP8_DEFAULT`, the persistent schedule with two consumers in pingpong.
    """
    if persistent:  # one resident block per SM, DeepGEMM's scheme
        return indexer_persistent_kernel(heads, dim, relu, fp8=True, consumers=consumers, stages=stages,
                                         pingpong=pingpong)
    if consumers:  # the warp-specialised schedule
        return indexer_ws_kernel(heads, dim, relu, fp8=True, consumers=consumers, stages=stages)
    check_indexer_sizes(heads, dim, fp8=True)
    if merge not in (1, 2) or block_q % merge:
        raise ValueError(f"merge must be 1 or 2 and divide block_q, got merge={merge}, block_q={block_q}")
    groups = block_q // merge  # GEMMs per key tile
    if pingpong and groups % 2:
        raise ValueError(f"pingpong needs an even number of query groups, got block_q={block_q}, merge={merge}")
    num_q, num_kv = T.dynamic("num_q"), T.dynamic("num_kv")
    f32 = "float32"

    @T.macro
    def issue(k_s, q_s, g, logits, asynchronous):
        """``logits [keys, merge * heads] = K_tile @ q[group g]^T``: e4m3 x e4m3 -> fp32 on the tensor cores."""
        if asynchronous:
            T.wgmma_gemm(k_s, q_s[g * merge * heads:(g + 1) * merge * heads, :], logits, transpose_B=True,
                         clear_accum=True)
        else:
            T.gemm(k_s, q_s[g * merge * heads:(g + 1) * merge * heads, :], logits, transpose_B=True,
                   clear_accum=True)

    @T.macro
    def store(row, qi, t0, s0, ks_tile, win_lo, win_hi, Scores):
        """``Scores[t0 + qi, s0 + n] = ks_tile[n] * row[n]`` inside the query's window ``[win_lo[qi],
        win_hi[qi])``, ``-inf`` outside (the tile's key scales in shared memory, the block's windows in
        registers)."""
        t = T.min(t0 + qi, num_q - 1)
        for n in T.Parallel(block_n):
            if t0 + qi < num_q and s0 + n < num_kv:
                Scores[t, s0 + n] = T.if_then_else(s0 + n >= win_lo[qi] and s0 + n < win_hi[qi],
                                                   row[n] * ks_tile[n], -T.infinity(f32))

    @T.macro
    def epilogue(logits, part, row, w_s, g, t0, s0, ks_tile, win_lo, win_hi, Scores):
        """``row[n] = sum_h (w * q_scale)[qi, h] * relu(logits[n, (qi - g*merge) * heads + h])`` for the
        queries ``qi`` of group ``g``, then `store`."""
        if merge == 1:  # in place
            for n, h in T.Parallel(block_n, heads):
                if relu:
                    logits[n, h] = T.max(logits[n, h], 0) * w_s[g, h]
                else:
                    logits[n, h] = logits[n, h] * w_s[g, h]
            T.reduce_sum(logits, row, dim=1)  # [block_n]: the sum over heads
            store(row, g, t0, s0, ks_tile, win_lo, win_hi, Scores)
        else:
            for j in T.unroll(merge):  # query g*merge + j owns the columns j*heads .. (j+1)*heads-1
                for n, h in T.Parallel(block_n, heads):
                    if relu:
                        part[n, h] = T.max(logits[n, j * heads + h], 0) * w_s[g * merge + j, h]
                    else:
                        part[n, h] = logits[n, j * heads + h] * w_s[g * merge + j, h]
                T.reduce_sum(part, row, dim=1)  # [block_n]
                store(row, g * merge + j, t0, s0, ks_tile, win_lo, win_hi, Scores)

    @T.macro
    def tile_scores(k_a, q_s, w_s, logits, logits_b, part, row, t0, s0, ks_tile, win_lo, win_hi, Scores):
        """The scores of every query of the block against one key tile ``k_a`` (keys ``s0 ...``)."""
        if pingpong:
            # groups 2p and 2p+1 take turns: one accumulator's GEMM runs while the other's
            # epilogue does; wait_wgmma(1) = "all but the newest GEMM are done"
            issue(k_a, q_s, 0, logits, True)
            for pair in T.unroll(groups // 2):
                issue(k_a, q_s, 2 * pair + 1, logits_b, True)
                T.wait_wgmma(1)
                epilogue(logits, part, row, w_s, 2 * pair, t0, s0, ks_tile, win_lo, win_hi, Scores)
                if pair + 1 < groups // 2:
                    issue(k_a, q_s, 2 * pair + 2, logits, True)
                    T.wait_wgmma(1)
                else:
                    T.wait_wgmma(0)
                epilogue(logits_b, part, row, w_s, 2 * pair + 1, t0, s0, ks_tile, win_lo, win_hi, Scores)
        else:
            for g in T.unroll(groups):
                issue(k_a, q_s, g, logits, False)
                epilogue(logits, part, row, w_s, g, t0, s0, ks_tile, win_lo, win_hi, Scores)

    @T.prim_func
    def main(Q: T.Tensor((num_q, heads, dim), FP8_DTYPE), QS: T.Tensor((num_q, heads), f32),
             K: T.Tensor((num_kv, dim), FP8_DTYPE), KS: T.Tensor((num_kv,), f32),
             W: T.Tensor((num_q, heads), f32), Starts: T.Tensor((num_q,), "int32"),
             Ends: T.Tensor((num_q,), "int32"), Scores: T.Tensor((num_q, num_kv), f32)):
        with T.Kernel(T.ceildiv(num_q, block_q), threads=128) as bx:
            if min_blocks:
                T.annotate_min_blocks_per_sm(min_blocks)
            q_s = T.alloc_shared((block_q * heads, dim), FP8_DTYPE)  # query qi's heads on rows qi*H_I ...
            k_s = T.alloc_shared((block_n, dim), FP8_DTYPE)
            ks_s = T.alloc_shared((block_n,), f32)  # the key tile's scales, loaded with the tile
            win_lo = T.alloc_local((block_q,), "int32")  # the block's query windows, in registers
            win_hi = T.alloc_local((block_q,), "int32")
            if merge == 2:  # w * q_scale of the columns each thread holds, in registers
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
            # the queries past the last one (a partial last block) repeat it: their columns of the
            # product are computed and never stored (a column is one query head's, so nothing mixes)
            for qi, h, d in T.Parallel(block_q, heads, dim):
                q_s[qi * heads + h, d] = Q[T.min(t0 + qi, num_q - 1), h, d]
            for qi, h in T.Parallel(block_q, heads):
                w_s[qi, h] = T.if_then_else(t0 + qi < num_q, W[T.min(t0 + qi, num_q - 1), h] *
                                            QS[T.min(t0 + qi, num_q - 1), h], 0)

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
                T.copy(KS[s0:s0 + block_n], ks_s)
                tile_scores(k_s, q_s, w_s, logits, logits_b, part, row, t0, s0, ks_s, win_lo, win_hi, Scores)

    return tilelang.compile(main, pass_configs=_PASS, target=compile_target())
# --8<-- [end:indexer_fp8_kernel]


# --8<-- [start:indexer_fp8_supported]
def indexer_fp8_supported(q, k, weights) -> str | None:
    """Why the fp8 indexer kernel cannot take this call (unquantised ``q``, ``k``), or ``None`` if it can."""
    if not hasattr(torch, "float8_e4m3fn"):
        return "this PyTorch has no float8_e4m3fn"
    if not (q.is_cuda and k.is_cuda and weights.is_cuda):
        return "inputs are not on CUDA"
    if not (q.is_floating_point() and k.is_floating_point() and weights.is_floating_point()):
        return f"q, k and weights must be floating point, got {q.dtype}, {k.dtype} and {weights.dtype}"
    if q.dtype == torch.float8_e4m3fn or k.dtype == torch.float8_e4m3fn:
        return "q and k are quantised here: pass them unquantised, or call fp8_indexer_scores_tilelang with their scales"
    if q.dim() != 3 or q.shape[1] not in (16, 32, 64) or q.shape[2] != FP8_BLOCK:
        return f"q must be [T, H_I in (16, 32, 64), D_I = {FP8_BLOCK}] (one fp8 scale per head), got {tuple(q.shape)}"
    if k.dim() != 2 or k.shape[1] != q.shape[2]:
        return f"k must be [S, {q.shape[2]}], got {tuple(k.shape)}"
    if weights.shape != q.shape[:2]:
        return f"weights must be [T, H_I] = {tuple(q.shape[:2])}, got {tuple(weights.shape)}"
    return None
# --8<-- [end:indexer_fp8_supported]


def _windows(T_: int, S: int, starts, ends, device) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 ``[T]`` starts and ends; ``[0, S)`` for every query when none are given."""
    if starts is None:
        return (torch.zeros(T_, dtype=torch.int32, device=device),
                torch.full((T_,), S, dtype=torch.int32, device=device))
    return starts.to(torch.int32).contiguous(), ends.to(torch.int32).contiguous()


# --8<-- [start:fp8_indexer_scores_tilelang]
@torch.no_grad()
def fp8_indexer_scores_tilelang(q8, q_scale, k8, k_scale, weights, *, starts=None, ends=None, relu=True,
                                **schedule):
    """Index scores from already quantised operands (DeepSeek quantises in the projections' epilogue).

    Args:
        q8: ``[T, H_I, 128]`` ``torch.float8_e4m3fn``; q_scale: ``[T, H_I]`` fp32 (``[T, H_I, 1]`` accepted).
        k8: ``[S, 128]`` e4m3; k_scale: ``[S]`` fp32 (``[S, 1]`` accepted; copied if its address is not
            16-byte aligned).
        weights: ``[T, H_I]`` head weights. starts, ends: int ``[T]`` key windows, or ``None`` (all keys).
        relu: the indexer's ReLU. schedule: knobs of `indexer_fp8_kernel` (tuning and tests); none
            given: `dsa_ref.kernels.shapes.INDEXER_FP8_DEFAULT`, the persistent kernel.

    Returns:
        ``[T, S]`` float32, ``-inf`` outside each window; no gradient.
    """
    T_, H, D = q8.shape
    S = k8.shape[0]
    if q8.dtype != torch.float8_e4m3fn or k8.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_indexer_scores_tilelang: q8 and k8 must be float8_e4m3fn, got {q8.dtype} and {k8.dtype}")
    q_scale = q_scale.reshape(T_, H).float().contiguous()
    k_scale = k_scale.reshape(S).float().contiguous()
    if k_scale.data_ptr() % 16:  # the persistent kernel loads the scales by bulk-tensor copy: 16-byte aligned
        k_scale = k_scale.clone()
    scores = torch.empty((T_, S), dtype=torch.float32, device=q8.device)  # the kernel writes every entry
    if T_ == 0 or S == 0:
        return scores
    starts_i, ends_i = _windows(T_, S, starts, ends, q8.device)
    kernel = indexer_fp8_kernel(H, D, bool(relu), **(schedule or INDEXER_FP8_DEFAULT))
    kernel(q8.contiguous(), q_scale, k8.contiguous(), k_scale, weights.float().contiguous(), starts_i, ends_i, scores)
    return scores
# --8<-- [end:fp8_indexer_scores_tilelang]


# --8<-- [start:lightning_indexer_fp8_tilelang]
def quantize_indexer_operands(q, k):
    """``(q8, q_scale [T, H_I], k8, k_scale [S])``: `dsa_ref.fp8.act_quant_block128` of ``q`` and ``k``,
    one power-of-two scale per 128-channel head vector, as DeepSeek-V3.2's ``act_quant``; computed
    by `dsa_ref.fp8.act_quant_pow2` (the same bytes, three passes over each operand)."""
    q8, q_scale = act_quant_pow2(q, block_size=FP8_BLOCK)  # [T, H_I, 128], [T, H_I, 1]
    k8, k_scale = act_quant_pow2(k, block_size=FP8_BLOCK)  # [S, 128], [S, 1]
    return q8, q_scale[..., 0], k8, k_scale[..., 0]


def lightning_indexer_fp8_tilelang(q, k, weights, *, starts=None, ends=None, relu=True):
    """`dsa_ref.fp8.fp8_indexer_scores` (``hadamard=False``: rotate first if the model does) on the kernel.

    Quantises ``q [T, H_I, 128]`` and ``k [S, 128]`` (any float dtype, already rotated) with
    `quantize_indexer_operands`, then scores with `fp8_indexer_scores_tilelang`. Returns ``[T, S]``
    float32 with ``-inf`` outside the windows, and no gradient: the fp8 scores select, they do
    not train (the indexer's loss uses the unquantised scores).
    """
    reason = indexer_fp8_supported(q, k, weights)
    if reason is not None:
        raise ValueError(f"lightning_indexer_fp8_tilelang: {reason}")
    q8, q_scale, k8, k_scale = quantize_indexer_operands(q, k)
    return fp8_indexer_scores_tilelang(q8, q_scale, k8, k_scale, weights, starts=starts, ends=ends, relu=relu)
# --8<-- [end:lightning_indexer_fp8_tilelang]
