r"""TileLang kernels: lightning-indexer scores at selected keys, and their backward.

The sparse stage of DSA trains the indexer with a KL loss whose support is each query's *selected*
keys, so it needs the index scores only at the ``K`` slots of ``indices [T, K]`` -- not the full
``[T, S]`` matrix -- and their gradients with respect to the indexer's ``q``, ``k`` and ``w``.

**Math.** With ``idx = indices[t, i]`` (``-1`` marks an unused slot):

    logit[t, j, i] = q[t, j] . k[idx]                                  (j over the H_I heads)
    score[t, i]    = sum_j w[t, j] * relu(logit[t, j, i])              (-inf at -1 slots)

Given ``d_score [T, K]`` (taken as 0 at ``-1`` slots, which carry no gradient), with
``g[t, j, i] = d_score[t, i] * w[t, j] * (logit[t, j, i] > 0)``:

    dw[t, j] = sum_i d_score[t, i] * relu(logit[t, j, i])
    dq[t, j] = sum_i g[t, j, i] * k[idx]
    dk[s]    = sum over (t, j, i) with indices[t, i] = s of g[t, j, i] * q[t, j]

``dk`` is the adjoint of a gather, so a key selected twice in a row gets both contributions.
Without the ReLU (``relu=False``), ``relu(x)`` reads ``x`` and ``g = d_score * w``.

**Tiling.** One block of 128 threads (256 for 64 heads) owns one query. It keeps ``q[t]``
(``[H_I, D]`` bf16) in shared memory and walks the query's slots 64 at a time. For each step it
gathers the selected key rows by index into a ``[64, D]`` shared tile with asynchronous 16-byte
copies (issued one step ahead, so the next gather overlaps this step's epilogue; a ``-1`` slot
reads row 0 and is masked), keeps the step's 64 indices in shared memory for the masking, and
runs one tensor-core GEMM with *slots on rows and heads on columns*,
``logits [64, H_I] = K_sel @ q[t]^T`` (fp32 accumulate).

* Forward: ReLU, times ``w[t]``, summed over the ``H_I`` columns -> 64 scores.
* Backward: recompute the logits; ``g [64, H_I]`` (fp32, rounded to bf16 in shared memory for the
  next two GEMMs) and ``d_score[i] * relu(logit)`` accumulated elementwise into a ``[64, H_I]``
  fp32 register tile (summed over the rows once at the end: ``dw`` never goes through bf16);
  ``dq [H_I, D] += g^T @ K_sel`` stays in registers across steps; ``dk_sel [64, D] = g @ q[t]``
  goes through shared memory to fp32 atomic adds, four channels per atomic, into a ``[S, D]``
  buffer the wrapper zeroes (``-1`` slots add nothing). The backward asks the compiler for two
  blocks per SM (128 registers a thread at 64 heads), so one query's gathers and atomics overlap
  another's GEMMs.

``K`` is a runtime size (one compiled kernel serves every top-k, ``K`` need not be a multiple of
64: the last step masks slots past ``K``), and ``NumBlocks [T]`` says how many 64-slot steps each
row needs -- up to its last valid slot, so the ``-1`` tail of short causal windows costs nothing
(the forward writes ``-inf`` there without gathering).

**Precision.** Products of bf16 values are exact in fp32, so the forward scores and the logits are
fp32 sums of exact products (relative error ~1e-6 of the magnitudes summed); ``dw`` is an fp32 sum
of products of those fp32 values. ``dq`` and ``dk`` go through one bf16 rounding of ``g``
(unit roundoff 2^-8, relative RMS error ~1.6e-3 per term, independent across terms) and are
returned in bf16 (another ~1.6e-3), so their relative L2 error is ~2.3e-3. ``dk`` is accumulated
with atomics: reproducible only up to the order of fp32 additions.
"""

import functools

import tilelang
import tilelang.language as T
import torch

from .._checks import check_same_device
from ..indexer import _check_indexer_operands
from ..sparse_attention import check_index_shape, check_indices
from ._target import compile_target
from .autograd import _block_counts, with_zero_row
from .sparse_mla_fwd import zero_row_or

BLOCK = 64  # selected slots per step

_PASS = {
    tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
}


def _check_sizes(heads: int, dim: int) -> None:
    if heads not in (16, 32, 64):
        raise ValueError(f"indexer heads must be 16, 32 or 64, got {heads}")
    if dim % 16 or dim <= 0:
        raise ValueError(f"indexer head dim must be a positive multiple of 16, got {dim}")


def _threads(heads: int) -> int:
    return 256 if heads == 64 else 128


# --8<-- [start:selected_scores_kernel]
@functools.lru_cache(maxsize=None)
def selected_scores_kernel(heads: int, dim: int, relu: bool = True):
    """Compile the forward: index scores at the selected keys, for ``H_I = heads`` and ``D = dim``.

    Kernel arguments: ``Q [T, H_I, D]`` bf16, ``K [S, D]`` bf16, ``W [T, H_I]`` fp32,
    ``Indices [T, K]`` int32 (``-1`` = unused slot), ``NumBlocks [T]`` int32 (64-slot steps to
    compute per row; later slots are taken as ``-1``); returns ``Scores [T, K]`` fp32 (``-inf`` at
    unused slots). ``T``, ``S`` and ``K`` are runtime sizes.
    """
    _check_sizes(heads, dim)
    num_q, num_kv, topk = T.dynamic("num_q"), T.dynamic("num_kv"), T.dynamic("topk")
    bf16, f32 = "bfloat16", "float32"

    @T.prim_func
    def main(Q: T.Tensor((num_q, heads, dim), bf16), K: T.Tensor((num_kv, dim), bf16),
             W: T.Tensor((num_q, heads), f32), Indices: T.Tensor((num_q, topk), "int32"),
             NumBlocks: T.Tensor((num_q,), "int32"), Scores: T.Tensor((num_q, topk), f32)):
        with T.Kernel(num_q, threads=_threads(heads)) as t:
            q_s = T.alloc_shared((heads, dim), bf16)
            k_s = T.alloc_shared((BLOCK, dim), bf16)  # the gathered key rows of one step
            idx_s = T.alloc_shared((BLOCK,), "int32", scope="shared")
            w_s = T.alloc_shared((heads,), f32, scope="shared")
            logits = T.alloc_fragment((BLOCK, heads), f32)  # [slots, heads]
            row = T.alloc_fragment((BLOCK,), f32)

            T.copy(Q[t, :, :], q_s, disable_tma=True)
            T.copy(W[t, :], w_s, disable_tma=True)
            n_steps = T.ceildiv(topk, BLOCK)
            n_blocks = T.min(NumBlocks[t], n_steps)

            for blk in T.Pipelined(n_blocks, num_stages=1):
                s0 = blk * BLOCK
                for i in T.Parallel(BLOCK):
                    # slots past K read as -1 (the min keeps the load in bounds)
                    idx_s[i] = T.if_then_else(s0 + i < topk, Indices[t, T.min(s0 + i, topk - 1)], -1)
                for i, d in T.Parallel(BLOCK, dim):
                    # a -1 slot reads the zero row at the end and a slot past K re-reads slot K - 1;
                    # both are masked below
                    k_s[i, d] = K[zero_row_or(Indices[t, T.min(s0 + i, topk - 1)], num_kv), d]
                T.gemm(k_s, q_s, logits, transpose_B=True, clear_accum=True)  # [slots, heads]
                for i, h in T.Parallel(BLOCK, heads):
                    if relu:
                        logits[i, h] = T.max(logits[i, h], 0) * w_s[h]
                    else:
                        logits[i, h] = logits[i, h] * w_s[h]
                T.reduce_sum(logits, row, dim=1)  # [slots]
                for i in T.Parallel(BLOCK):
                    if s0 + i < topk:
                        Scores[t, s0 + i] = T.if_then_else(idx_s[i] >= 0, row[i], -T.infinity(f32))

            # the steps after the row's last valid slot hold only -1
            for blk in T.serial(n_steps - n_blocks):
                for i in T.Parallel(BLOCK):
                    if (n_blocks + blk) * BLOCK + i < topk:
                        Scores[t, (n_blocks + blk) * BLOCK + i] = -T.infinity(f32)

    return tilelang.compile(main, out_idx=[5], pass_configs=_PASS, target=compile_target())
# --8<-- [end:selected_scores_kernel]


# --8<-- [start:indexer_backward_kernel]
@functools.lru_cache(maxsize=None)
def indexer_backward_kernel(heads: int, dim: int, relu: bool = True):
    """Compile the backward of `selected_scores_kernel` for ``H_I = heads`` and ``D = dim``.

    Kernel arguments: ``Q [T, H_I, D]`` bf16, ``K [S, D]`` bf16, ``W [T, H_I]`` fp32,
    ``Indices [T, K]`` int32, ``NumBlocks [T]`` int32 (as in the forward), ``dScores [T, K]`` fp32
    (ignored at ``-1`` slots), ``dK [S, D]`` fp32 (zeroed by the caller; accumulated in place with
    atomics); returns ``dQ [T, H_I, D]`` bf16 and ``dW [T, H_I]`` fp32.
    """
    _check_sizes(heads, dim)
    num_q, num_kv, topk = T.dynamic("num_q"), T.dynamic("num_kv"), T.dynamic("topk")
    bf16, f32 = "bfloat16", "float32"

    @T.prim_func
    def main(Q: T.Tensor((num_q, heads, dim), bf16), K: T.Tensor((num_kv, dim), bf16),
             W: T.Tensor((num_q, heads), f32), Indices: T.Tensor((num_q, topk), "int32"),
             NumBlocks: T.Tensor((num_q,), "int32"), dScores: T.Tensor((num_q, topk), f32),
             dK: T.Tensor((num_kv, dim), f32), dQ: T.Tensor((num_q, heads, dim), bf16),
             dW: T.Tensor((num_q, heads), f32)):
        with T.Kernel(num_q, threads=_threads(heads)) as t:
            T.annotate_min_blocks_per_sm(2)  # two queries per SM hide each other's gathers and atomics
            q_s = T.alloc_shared((heads, dim), bf16)
            k_s = T.alloc_shared((BLOCK, dim), bf16)  # gathered key rows of one step
            g_s = T.alloc_shared((BLOCK, heads), bf16)  # g for the dq and dk GEMMs
            dk_s = T.alloc_shared((BLOCK, dim), f32)  # dk of the step's slots, staged for the atomics
            dw_s = T.alloc_shared((BLOCK, heads), f32)  # the dw partial sums, for the final row sum
            idx_s = T.alloc_shared((BLOCK,), "int32", scope="shared")
            ds_s = T.alloc_shared((BLOCK,), f32, scope="shared")  # d_score, 0 at -1 slots
            w_s = T.alloc_shared((heads,), f32, scope="shared")

            logits = T.alloc_fragment((BLOCK, heads), f32)  # [slots, heads]
            acc_dw = T.alloc_fragment((BLOCK, heads), f32)  # sum over steps of d_score * relu(logit)
            acc_dq = T.alloc_fragment((heads, dim), f32)
            acc_dk = T.alloc_fragment((BLOCK, dim), f32)
            dw = T.alloc_fragment((heads,), f32)

            T.copy(Q[t, :, :], q_s, disable_tma=True)
            T.copy(W[t, :], w_s, disable_tma=True)
            T.clear(acc_dq)
            T.clear(acc_dw)
            n_blocks = T.min(NumBlocks[t], T.ceildiv(topk, BLOCK))

            for blk in T.Pipelined(n_blocks, num_stages=1):
                s0 = blk * BLOCK
                for i in T.Parallel(BLOCK):
                    idx_s[i] = T.if_then_else(s0 + i < topk, Indices[t, T.min(s0 + i, topk - 1)], -1)
                for i in T.Parallel(BLOCK):
                    ds_s[i] = T.if_then_else(idx_s[i] >= 0, dScores[t, T.min(s0 + i, topk - 1)], 0)
                for i, d in T.Parallel(BLOCK, dim):
                    # a -1 slot reads the zero row at the end and a slot past K re-reads slot K - 1;
                    # their d_score is 0
                    k_s[i, d] = K[zero_row_or(Indices[t, T.min(s0 + i, topk - 1)], num_kv), d]
                T.gemm(k_s, q_s, logits, transpose_B=True, clear_accum=True)  # [slots, heads]
                for i, h in T.Parallel(BLOCK, heads):
                    if relu:
                        acc_dw[i, h] += ds_s[i] * T.max(logits[i, h], 0)
                        g_s[i, h] = T.if_then_else(logits[i, h] > 0, ds_s[i] * w_s[h], 0)
                    else:
                        acc_dw[i, h] += ds_s[i] * logits[i, h]
                        g_s[i, h] = ds_s[i] * w_s[h]
                T.gemm(g_s, q_s, acc_dk, clear_accum=True)  # [slots, D] = g @ q[t]
                T.gemm(g_s, k_s, acc_dq, transpose_A=True)  # [heads, D] += g^T @ K_sel
                T.copy(acc_dk, dk_s)
                for i, d4 in T.Parallel(BLOCK, dim // 4):
                    if idx_s[i] >= 0:
                        T.atomic_addx4(dK[idx_s[i], d4 * 4], dk_s[i, d4 * 4])

            T.copy(acc_dq, dQ[t, :, :])
            # dw: sum the [slots, heads] partial sums over the slots, in fp32
            T.copy(acc_dw, dw_s)
            T.clear(dw)
            for i in T.serial(BLOCK):
                for h in T.Parallel(heads):
                    dw[h] += dw_s[i, h]
            T.copy(dw, dW[t, :])

    return tilelang.compile(main, out_idx=[7, 8], pass_configs=_PASS, target=compile_target())
# --8<-- [end:indexer_backward_kernel]


# ----------------------------------------------------------------------------- autograd


# --8<-- [start:index_scores_at_supported]
def index_scores_at_supported(q, k, weights, indices) -> str | None:
    """Why the selected-score kernels cannot take this call, or ``None`` if they can.

    Mirrors `dsa_ref.kernels.autograd.indexer_supported`, plus the indices: the kernels take CUDA
    tensors, bf16 ``q [T, H_I, D]`` with ``H_I`` in (16, 32, 64) and ``D % 16 == 0``, bf16 ``k``, a
    floating-point ``weights`` (computed in fp32) and integer ``indices``.
    """
    tensors = {"q": q, "k": k, "weights": weights, "indices": indices}
    for name, x in tensors.items():
        if not isinstance(x, torch.Tensor):
            return f"{name} is not a tensor"
    if not all(x.is_cuda for x in tensors.values()):
        return "inputs are not on CUDA"
    if q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16:
        return f"the kernels take bfloat16 q and k, got {q.dtype} and {k.dtype}"
    if not weights.is_floating_point():
        return f"weights must be floating point, got {weights.dtype}"
    if indices.is_floating_point() or indices.dtype == torch.bool:
        return f"indices must be an integer tensor, got {indices.dtype}"
    if q.dim() != 3 or q.shape[1] not in (16, 32, 64) or q.shape[2] % 16:
        return f"q must be [T, H_I in (16, 32, 64), D_I % 16 == 0], got {tuple(q.shape)}"
    return None
# --8<-- [end:index_scores_at_supported]


# --8<-- [start:selected_index_scores]
class SelectedIndexScores(torch.autograd.Function):
    """``scores [T, K] = index scores of q, k, weights at indices`` on TileLang, with a fused backward.

    ``forward(q, k, weights, indices, relu)``: ``q [T, H_I, D]`` bf16, ``k [S, D]`` bf16,
    ``weights [T, H_I]`` float, ``indices [T, K]`` integer (validated by the caller). The backward
    returns ``dq`` and ``dk`` in bf16 and ``dweights`` in ``weights``' dtype.
    """

    @staticmethod
    def forward(ctx, q, k, weights, indices, relu):
        T, H, D = q.shape
        S = k.shape[0]
        q, k = q.contiguous(), k.contiguous()
        w32 = weights.to(torch.float32).contiguous()  # [T, H_I]
        idx = indices.to(torch.int32).contiguous()  # [T, K]
        n_blocks = _block_counts(idx, BLOCK)  # [T]: BLOCK-slot steps up to the last valid slot
        if T == 0 or S == 0:  # nothing to launch: every slot is -1 (check_indices) or there is no row
            scores = torch.full(idx.shape, float("-inf"), dtype=torch.float32, device=q.device)
        else:
            k = with_zero_row(k)  # [S + 1, D]: -1 slots read the zero row
            scores = selected_scores_kernel(H, D, bool(relu))(q, k, w32, idx, n_blocks)  # [T, K] fp32
        ctx.save_for_backward(q, k, w32, idx, n_blocks)
        ctx.num_keys = S
        ctx.relu = bool(relu)
        ctx.w_dtype = weights.dtype
        return scores

    @staticmethod
    def backward(ctx, d_scores):
        q, k, w32, idx, n_blocks = ctx.saved_tensors
        T, H, D = q.shape
        S = ctx.num_keys
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)  # atomics accumulate into it
        if T == 0 or S == 0:
            dq, dw = torch.zeros_like(q), torch.zeros_like(w32)
        else:
            # -1 slots are ignored inside the kernel, whatever d_scores holds there (0 * inf never appears)
            kernel = indexer_backward_kernel(H, D, ctx.relu)
            dq, dw = kernel(q, k, w32, idx, n_blocks, d_scores.to(torch.float32).contiguous(), dk)
        return dq, dk[:S].to(k.dtype), dw.to(ctx.w_dtype), None, None  # the zero row's dk is dropped
# --8<-- [end:selected_index_scores]


# --8<-- [start:index_scores_at_tilelang]
def index_scores_at_tilelang(q, k, weights, indices, *, relu=True, validate=True):
    """Index scores at the selected keys on TileLang, differentiable in ``q``, ``k`` and ``weights``.

    ``scores[t, i] = sum_j weights[t, j] * relu(q[t, j] . k[indices[t, i]])``, ``-inf`` at ``-1``
    slots -- `dsa_ref.lightning_indexer` gathered at ``indices`` (duplicates allowed).

    Args:
        q: ``[T, H_I, D]`` bf16 CUDA indexer queries, ``H_I`` in (16, 32, 64), ``D % 16 == 0``.
        k: ``[S, D]`` bf16 indexer keys.
        weights: ``[T, H_I]`` head weights (float32; other float dtypes are computed in float32).
        indices: int ``[T, K]`` (``[T, 1, K]`` accepted), values in ``[-1, S)``, ``-1`` = unused slot;
            any ``K >= 1``.
        relu: apply the ReLU (DeepSeek-V3.2: yes).
        validate: check that every index is ``-1`` or in ``[0, S)`` (one device sync); ``False``
            skips it for slots in range by construction (out-of-range values are then undefined
            behaviour), as `sparse_mla_tilelang`'s ``validate``.

    Returns:
        ``scores [T, K]`` float32. Gradients: ``q`` and ``k`` in bf16, ``weights`` in its dtype;
        ``-1`` slots carry none.
    """
    reason = index_scores_at_supported(q, k, weights, indices)
    if reason is not None:
        raise ValueError(f"index_scores_at_tilelang: {reason}")
    T, _ = _check_indexer_operands(q, k, weights)  # the reference's checks
    check_same_device(q=q, k=k, weights=weights, indices=indices)
    indices = check_indices(indices, T, k.shape[0]) if validate else check_index_shape(indices, T)
    if not isinstance(relu, bool):
        raise TypeError(f"relu must be a bool, got {type(relu).__name__}")
    return SelectedIndexScores.apply(q, k, weights, indices, relu)
# --8<-- [end:index_scores_at_tilelang]
