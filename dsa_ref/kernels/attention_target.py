r"""TileLang kernel: the indexer loss's target, main attention summed over heads at the selected slots.

In the sparse stage the indexer learns where the main attention looks among the keys each query
selected: the main attention probabilities summed over heads and L1-normalised over the slots
(`dsa_ref.indexer_loss`). The sparse MLA forward already returns the natural-log LSE of exactly
that attention, so every probability is a single exponential and no second softmax pass is needed:

$$
\text{probs\_sum}[t, i] = \sum_h \exp\big(\sigma\, q_{t,h} \cdot kv_{\text{idx}[t, i]} - \text{lse}_{t,h}\big)
$$

for the valid slots ``i`` of query ``t``. A ``-1`` slot gives exactly 0, and so does every slot of
a row whose LSE is ``-inf`` (a row with no valid slot). The caller L1-normalises each row into the
KL target. No gradient is needed: the target is detached.

**Tiling.** One block of 128 threads (one warpgroup) owns one query and up to 64 of its heads,
whose absorbed queries ``[H_blk, 576]`` stay in shared memory. It walks the query's slots 64 at a
time: it gathers the 64 selected latent rows by index into shared memory (two stages, so that the
gather of the next block overlaps the tensor-core work on this one) and puts *keys on rows and
heads on columns*:

    S [64 keys, H_blk heads] = KV_blk [64, 576] @ Q^T [576, H_blk]     (tensor cores, fp32 accumulate)
    P = exp2(S * sigma * log2(e) - lse2[h])                            (lse2 = lse * log2(e))
    out[t, slots] = rowsum(P)                                          (the sum over the heads)

The sum over heads is then a reduction along each row of the accumulator, whose entries sit in the
registers of one group of four threads: a few register additions and two shuffles, no shared
memory. The wrapper passes the LSE in base 2, and ``+inf`` for a row without valid slots, which
makes every ``P`` of that row ``exp2(-inf) = 0``. A ``-1`` slot (or a slot past the end of the
row) gathers row 0 instead, which is finite; its sum is discarded when the block stores.

**More than 64 heads** (DeepSeek-V3.2 has 128). A block holds at most 64 heads: 64 heads of
queries (72 KiB) and two stages of gathered rows (2 x 72 KiB) already fill the 227 KiB of shared
memory a Hopper block may use. So each query gets ``H / 64`` blocks, and each block *adds* its
partial sum into the output with an fp32 atomic add (the wrapper zeroes the output first). With
two blocks per query (``H = 128``) the result is still bitwise reproducible, because
``(0 + a) + b`` and ``(0 + b) + a`` round identically; with more blocks the order of the additions,
and so the last bit, may vary from run to run. The alternative, one block looping over both
halves, would need 144 KiB for the 128 heads of queries and leave room for one stage of gathered
rows only, so the gather could no longer overlap the tensor cores. The price of two blocks is that
each selected row is gathered twice (from L2: a sequence's latent rows are small).

**Sizes.** ``H`` is 16, 32, 64 or a multiple of 64; ``D`` a multiple of 64 (576 for DeepSeek).
The numbers of queries ``T``, keys ``S`` and slots ``K`` are dynamic, so one compiled kernel per
``(H, D, sm_scale)`` serves every call; a last partial block of slots is masked inside the kernel,
so the indices need no padding. Each row visits only its blocks up to its last valid slot (the
wrapper counts them), so the trailing ``-1`` slots of short windows -- early queries of a causal
sequence, or the dense warm-up's window slots -- cost nothing.
"""

import functools

import tilelang
import tilelang.language as T
import torch

from ..sparse_attention import check_head_sum_inputs
from ._target import compile_target
from .autograd import _block_counts, with_zero_row
from .sparse_mla_fwd import LOG2E, head_blocking, zero_row_or

BLOCK_KEYS = 64  # slots per step: the M of one warpgroup's tensor-core instruction
THREADS = 128  # one warpgroup: a row of the [keys, heads] accumulator lives in 4 of its threads

_PASS = {
    tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
    tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True,
}

# The pipelined loop's trip count is a runtime value, so TileLang emits its epilogue (the last
# blocks, after the loop) as a loop whose cp.async waits have non-constant counts, which it cannot
# generate code for. This annotation, inherited by that epilogue loop, makes the compiler unroll it.
_UNROLL_EPILOGUE = {"pragma_unroll_explicit": True}


# --8<-- [start:head_sum_probs_kernel]
@functools.lru_cache(maxsize=None)
def head_sum_probs_kernel(heads: int, dim: int, sm_scale: float, num_stages: int = 2):
    """Compile the head-summed attention probabilities for these sizes (any ``T``, ``S`` and ``K``).

    Kernel arguments: ``Q [T, H, D]`` bf16, ``KV [S, D]`` bf16, ``Indices [T, K]`` int32 (``-1`` =
    unused slot; any ``K``), ``NumBlocks [T]`` int32 (how many 64-slot blocks of each row to visit,
    at most ``ceil(K / 64)``: the blocks after the last valid slot hold only ``-1`` and are
    skipped), ``Lse2 [T, H]`` fp32 (the LSE in base 2; ``+inf`` for rows with no valid slot),
    ``Out [T, K]`` fp32, zeroed by the caller: the kernel stores the visited slots when ``H <= 64``
    and *adds* into them with atomics when ``H > 64``; the skipped slots keep their 0.
    """
    hb, per_query = head_blocking(heads)
    if dim % 64:
        raise ValueError(f"dim must be a multiple of 64, got {dim}")
    scale2 = sm_scale * LOG2E  # exp(s * sm_scale - lse) == exp2(s * scale2 - lse * log2(e))
    num_q, num_kv, topk = T.dynamic("num_q"), T.dynamic("num_kv"), T.dynamic("topk")
    accumulate = per_query > 1  # several head blocks add into one output row
    bf16, f32 = "bfloat16", "float32"

    @T.prim_func
    def main(Q: T.Tensor((num_q, heads, dim), bf16), KV: T.Tensor((num_kv, dim), bf16),
             Indices: T.Tensor((num_q, topk), "int32"), NumBlocks: T.Tensor((num_q,), "int32"),
             Lse2: T.Tensor((num_q, heads), f32), Out: T.Tensor((num_q, topk), f32)):
        with T.Kernel(num_q * per_query, threads=THREADS) as bx:
            t = bx // per_query
            h0 = (bx % per_query) * hb
            q_s = T.alloc_shared((hb, dim), bf16)  # this block's heads of query t
            kv_s = T.alloc_shared((BLOCK_KEYS, dim), bf16)  # the rows of one block of slots (per stage)
            lse_s = T.alloc_shared((hb,), f32, scope="shared")
            acc = T.alloc_fragment((BLOCK_KEYS, hb), f32)  # [keys, heads]
            row_sum = T.alloc_fragment((BLOCK_KEYS,), f32)  # [keys]

            T.copy(Q[t, h0:h0 + hb, :], q_s, disable_tma=True)
            for h in T.Parallel(hb):
                lse_s[h] = Lse2[t, h0 + h]

            for blk in T.Pipelined(NumBlocks[t], num_stages=num_stages, annotations=_UNROLL_EPILOGUE):
                # gather; a -1 slot reads the zero row at the end, a slot past the end of the row
                # re-reads slot K - 1; both are dropped below
                for i, d in T.Parallel(BLOCK_KEYS, dim):
                    kv_s[i, d] = KV[zero_row_or(Indices[t, T.min(blk * BLOCK_KEYS + i, topk - 1)], num_kv), d]
                T.gemm(kv_s, q_s, acc, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                for i, h in T.Parallel(BLOCK_KEYS, hb):
                    acc[i, h] = T.exp2(acc[i, h] * scale2 - lse_s[h])
                T.reduce_sum(acc, row_sum, dim=1)  # the sum over this block's heads
                for i in T.Parallel(BLOCK_KEYS):
                    slot = blk * BLOCK_KEYS + i
                    if slot < topk:
                        if accumulate:
                            if Indices[t, slot] >= 0:
                                T.atomic_add(Out[t, slot], row_sum[i])
                        else:
                            Out[t, slot] = T.if_then_else(Indices[t, slot] >= 0, row_sum[i], 0)

    return tilelang.compile(main, pass_configs=_PASS, target=compile_target())
# --8<-- [end:head_sum_probs_kernel]


# --8<-- [start:attention_head_sum_supported]
def attention_head_sum_supported(q, kv, indices, lse) -> str | None:
    """Why the kernel cannot take this call, or ``None`` if it can (shapes are checked by the wrapper)."""
    if not all(x.is_cuda for x in (q, kv, indices, lse)):
        return "inputs are not on CUDA"
    if q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16:
        return f"the kernel takes bfloat16 q and kv, got {q.dtype} and {kv.dtype}"
    if q.dim() != 3:
        return f"q must be [T, H, D], got {tuple(q.shape)}"
    _, H, D = q.shape
    if H not in (16, 32, 64) and (H < 64 or H % 64):
        return f"H must be 16, 32, 64 or a multiple of 64, got {H}"
    if D % 64:
        return f"the head dim D must be a multiple of 64, got {D}"
    return None
# --8<-- [end:attention_head_sum_supported]


# --8<-- [start:attention_head_sum_tilelang]
def attention_head_sum_tilelang(q, kv, indices, lse, *, sm_scale, validate=True) -> torch.Tensor:
    """The main attention's probabilities at the selected slots, summed over heads, on TileLang.

    ``out[t, i] = sum_h exp(sm_scale * q[t, h] . kv[indices[t, i]] - lse[t, h])`` for valid slots;
    exactly 0 at ``-1`` slots and in rows whose ``lse`` is ``-inf``. L1-normalised over each row,
    it is the sparse-stage target of `dsa_ref.indexer_loss` (when the indices hold no duplicates,
    as `dsa_ref.topk_indices` guarantees). Nothing is differentiated.

    Args:
        q: ``[T, H, D]`` bf16 CUDA absorbed queries (``D = 576``; ``H`` 16, 32, 64 or a multiple of 64).
        kv: ``[S, D]`` (or ``[S, 1, D]``) bf16 latent rows.
        indices: int ``[T, K]`` (``[T, 1, K]`` accepted), ``-1`` = unused slot; any ``K >= 1``.
        lse: float ``[T, H]`` natural-log LSE of this very attention, as `dsa_ref.sparse_mla`
            returns it (``-inf`` for rows with no valid slot).
        sm_scale: the attention's softmax scale.
        validate: check that every index is ``-1`` or in ``[0, S)`` (one device sync); ``False``
            skips it for slots in range by construction (out-of-range values are then undefined
            behaviour), as `sparse_mla_tilelang`'s ``validate``.

    Returns:
        ``[T, K]`` float32.
    """
    kv, indices, sm_scale = check_head_sum_inputs(q, kv, indices, lse, sm_scale, check_values=validate)
    reason = attention_head_sum_supported(q, kv, indices, lse)
    if reason is not None:
        raise ValueError(f"attention_head_sum_tilelang: {reason}")
    num_q, H, D = q.shape
    K = indices.shape[1]
    # zeroed: the slots after a row's last valid one are never visited, and with H > 64 the blocks
    # of the head groups add into it
    out = torch.zeros((num_q, K), dtype=torch.float32, device=q.device)
    if num_q == 0:
        return out
    # base-2 LSE, computed in float64 and rounded once; +inf for empty rows makes all their P 0
    lse64 = lse.double()
    lse2 = torch.where(torch.isneginf(lse64), torch.full_like(lse64, float("inf")), lse64 * LOG2E)
    lse2 = lse2.to(torch.float32).contiguous()  # [T, H]
    kernel = head_sum_probs_kernel(H, D, sm_scale)
    idx = indices.to(torch.int32).contiguous()  # [T, K]
    kernel(q.contiguous(), with_zero_row(kv), idx, _block_counts(idx, BLOCK_KEYS), lse2, out)  # -1: zero row
    return out
# --8<-- [end:attention_head_sum_tilelang]
