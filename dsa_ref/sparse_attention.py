r"""Chapter 3.2, part 1: sparse attention over the selected keys.

Once every query ``t`` has its selected keys ``S_t`` (a row of ``topk`` indices, ``-1`` for an unused
slot), attention is ordinary softmax attention restricted to them:

$$
o_{t,h} = \sum_{j\,:\,\mathrm{idx}_{t,j} \ne -1} \frac{e^{\sigma\, q_{t,h}\cdot kv_{\mathrm{idx}_{t,j}}}}
{\sum_{j'} e^{\sigma\, q_{t,h}\cdot kv_{\mathrm{idx}_{t,j'}}}}\; v_{\mathrm{idx}_{t,j}}
$$

Each *slot* is one softmax term: a key index that appears in two slots counts twice, exactly as
the kernels do (they never deduplicate). A row with no valid slot has ``o = 0`` and ``lse = -inf``.

Two forms, the same math:

* `sparse_mla` -- the absorbed form (chapter 2): MQA over the 576-wide latent rows, the one the
  kernels implement. All 128 heads of a query share its selection, so one gathered latent row
  serves every head.
* `sparse_attention` -- the dense (per-head) form of chapter 1, for readers and for checking.
"""

from __future__ import annotations

import torch

from ._checks import accumulation_dtype, check_dim, check_float, check_int, check_rank, check_same_device, check_scale
from .attention import (auto_chunk_size, check_latent_operands, check_value_width, masked_softmax_with_lse,
                        run_chunked, select_rows)

__all__ = ["sparse_mla", "sparse_attention", "attention_head_sum", "check_indices", "first_occurrence"]


def check_indices(indices: torch.Tensor, num_queries: int, num_keys: int, name: str = "indices") -> torch.Tensor:
    """Validate top-k indices: int ``[T, K]`` (``[T, 1, K]`` accepted), values in ``[-1, num_keys)``.

    Checking the values reads them back to the host: one device sync.

    Returns:
        the indices as ``[T, K]`` (same dtype).
    """
    indices = check_index_shape(indices, num_queries, name)
    if indices.numel():
        check_index_range(index_bounds(indices), num_keys, name)
    return indices


def check_index_shape(indices: torch.Tensor, num_queries: int, name: str = "indices") -> torch.Tensor:
    """The shape and dtype half of `check_indices` (no device sync); returns the indices as ``[T, K]``."""
    check_int(name, indices)
    if indices.dim() == 3:
        check_dim(name, indices, 1, 1, "one index set per query shared by all heads; [T, 1, K] is accepted")
        indices = indices[:, 0]
    check_rank(name, indices, 2, "[T, K] or [T, 1, K]")
    check_dim(name, indices, 0, num_queries, "one row per query")
    if indices.shape[1] < 1:
        raise ValueError(f"{name} must have at least one slot per row, got shape {tuple(indices.shape)}")
    return indices


def index_bounds(indices: torch.Tensor) -> torch.Tensor:
    """``[2]`` tensor ``(min, max)`` of non-empty indices, on their device: queued, not read back."""
    return torch.stack(torch.aminmax(indices))  # one pass over the indices


def check_index_range(bounds: torch.Tensor, num_keys: int, name: str = "indices") -> None:
    """The value half of `check_indices`: raise unless ``bounds = (min, max)`` lies in ``[-1, num_keys)``.

    Reading ``bounds`` is the device sync; a caller may queue its kernels first and check after.
    """
    lo, hi = bounds.tolist()
    if lo < -1 or hi >= num_keys:
        raise ValueError(
            f"{name} values must be -1 (unused slot) or in [0, num_keys={num_keys}), got range [{lo}, {hi}]"
            " (convert other sentinels, e.g. >= S_kv, to -1 first: see dsa_ref.oracle)"
        )


def first_occurrence(idx: torch.Tensor) -> torch.Tensor:
    """Bool ``[R, K]``: True at the first slot holding each index of a row (later duplicates False)."""
    sorted_idx, order = torch.sort(idx, dim=-1, stable=True)  # equal indices stay in slot order
    repeat = torch.zeros_like(idx, dtype=torch.bool)
    repeat[:, 1:] = sorted_idx[:, 1:] == sorted_idx[:, :-1]  # [R, K] in sorted order
    return ~torch.zeros_like(repeat).scatter(1, order, repeat)  # back to slot order


# --8<-- [start:sparse_mla]
def sparse_mla(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, *, sm_scale: float,
               d_v: int = 512, chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse absorbed-MLA attention: each query attends to the latent rows its indices select.

    Args:
        q: ``[T, H, D]`` absorbed queries (DeepSeek-V3.2: ``D = 576``).
        kv: ``[S, D]`` latent rows ``[c_kv ; k_pe]`` (``[S, 1, D]`` accepted).
        indices: int ``[T, K]`` (``[T, 1, K]`` accepted); ``-1`` marks an unused slot, every other
            value must lie in ``[0, S)``. Duplicates count once per slot.
        sm_scale: softmax scale (DeepSeek-V3.2: ``192 ** -0.5 * mscale ** 2``).
        d_v: value width, the first ``d_v`` channels of each latent row (DeepSeek-V3.2: 512).
        chunk_size: queries per chunk (memory only).

    Returns:
        ``(out [T, H, d_v]`` in q's dtype, ``lse [T, H]`` natural log, float32 or float64``)``.
        Differentiable in ``q`` and ``kv``.
    """
    kv = check_latent_operands(q, kv)  # [S, D]
    check_int("indices", indices)
    check_same_device(q=q, kv=kv, indices=indices)
    check_value_width(d_v, kv)
    sm_scale = check_scale("sm_scale", sm_scale)
    indices = check_indices(indices, q.shape[0], kv.shape[0])
    T, H, D = q.shape
    K = indices.shape[1]
    acc = accumulation_dtype(q)

    def attend(q_c, idx_c, kv_):
        valid = idx_c >= 0  # [C, K]
        kv_sel = select_rows(kv_, idx_c, valid).to(acc)  # [C, K, D]; -1 slots: zeros, by selection
        scores = torch.einsum("thd,tkd->thk", q_c.to(acc), kv_sel) * sm_scale  # [C, H, K]
        probs, lse = masked_softmax_with_lse(scores, valid[:, None, :])  # [C, H, K], [C, H]
        out = torch.einsum("thk,tkv->thv", probs, kv_sel[..., :d_v])  # [C, H, d_v]
        return out.to(q.dtype), lse

    chunk = auto_chunk_size(T, max(H * K, K * D), chunk_size)
    return run_chunked(attend, T, chunk, (q, indices), (kv,))
# --8<-- [end:sparse_mla]


def check_head_sum_inputs(q, kv, indices, lse, sm_scale, *, check_values: bool = True):
    """Validate `attention_head_sum`'s inputs; returns ``(kv [S, D], indices [T, K], sm_scale)``.

    ``check_values=False`` checks the indices' shape only, not that their values lie in ``[-1, S)``
    (that check reads them back: one device sync)."""
    kv = check_latent_operands(q, kv)  # [S, D]
    check_float("lse", lse)
    check_rank("lse", lse, 2, "[T, H]")
    check_same_device(q=q, kv=kv, indices=indices, lse=lse)
    T, H, D = q.shape
    check_dim("lse", lse, 0, T, "one row per query")
    check_dim("lse", lse, 1, H, "one LSE per head")
    indices = check_indices(indices, T, kv.shape[0]) if check_values else check_index_shape(indices, T)
    return kv, indices, check_scale("sm_scale", sm_scale)


# --8<-- [start:attention_head_sum]
def attention_head_sum(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, lse: torch.Tensor, *,
                       sm_scale: float, chunk_size: int | None = None) -> torch.Tensor:
    """The attention probabilities of each selected slot, summed over heads (no gradient).

    ``out[t, j] = sum_h exp(sm_scale * q[t, h] . kv[indices[t, j]] - lse[t, h])``, with ``lse``
    the log-sum-exp that `sparse_mla` returned for the same ``indices``: each head's probabilities
    over the slots, summed over heads. L1-normalised over the valid slots this is the indexer
    loss's target in the sparse stage (and, with the whole window as the selection, in the dense
    warm-up); the TileLang path computes it with a kernel instead of re-running the softmax.

    Args:
        q: ``[T, H, D]`` absorbed queries; kv: ``[S, D]`` latent rows (``[S, 1, D]`` accepted).
        indices: int ``[T, K]``, ``-1`` = unused slot.
        lse: ``[T, H]`` natural-log LSE of this attention (``-inf`` for rows with no valid slot).
        sm_scale: the attention's softmax scale.
        chunk_size: queries per chunk (memory only).

    Returns:
        ``[T, K]`` float32 (float64 for float64 inputs): 0 at ``-1`` slots and in empty rows.
    """
    kv, indices, sm_scale = check_head_sum_inputs(q, kv, indices, lse, sm_scale)
    T, H, D = q.shape
    acc = torch.float64 if torch.float64 in (q.dtype, kv.dtype) else torch.float32

    def mass(q_c, idx_c, lse_c, kv_):
        valid = idx_c >= 0  # [C, K]
        kv_sel = select_rows(kv_, idx_c, valid).to(acc)  # [C, K, D]; -1 slots: zeros, by selection
        logits = torch.einsum("thd,tkd->thk", q_c.to(acc), kv_sel) * sm_scale  # [C, H, K]
        lse_safe = torch.where(torch.isinf(lse_c), torch.full_like(lse_c, float("inf")), lse_c)  # empty: p = 0
        probs = torch.exp(logits - lse_safe.to(acc)[:, :, None])  # [C, H, K]
        return (torch.where(valid, probs.sum(dim=1), torch.zeros((), dtype=acc, device=q_c.device)),)  # [C, K]

    with torch.no_grad():
        chunk = auto_chunk_size(T, max(indices.shape[1], 1) * max(H, D), chunk_size)  # [C, K, D] rows, [C, H, K] logits
        (out,) = run_chunked(mass, T, chunk, (q.detach(), indices, lse.detach()), (kv.detach(),))
    return out
# --8<-- [end:attention_head_sum]


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, *,
                     sm_scale: float, chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention in the dense (per-head key and value) form of chapter 1.

    Args:
        q: ``[T, H, D]`` queries ``[q_nope ; q_pe]`` (DeepSeek-V3.2: ``D = 192``).
        k: ``[S, H, D]`` per-head keys ``[k_nope ; k_pe]``.
        v: ``[S, H, D_v]`` per-head values (DeepSeek-V3.2: ``D_v = 128``).
        indices: int ``[T, K]``, ``-1`` = unused slot; every head of a query uses the same keys.
        sm_scale: softmax scale.
        chunk_size: queries per chunk (memory only).

    Returns:
        ``(out [T, H, D_v]`` in q's dtype, ``lse [T, H]``)``.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_float(name, x)
        check_rank(name, x, 3, "[T, H, D]" if name == "q" else "[S, H, D]")
    check_dim("k", k, 1, q.shape[1], "q's heads")
    check_dim("k", k, 2, q.shape[2], "q's head dim")
    check_dim("v", v, 0, k.shape[0], "one value per key")
    check_dim("v", v, 1, q.shape[1], "q's heads")
    sm_scale = check_scale("sm_scale", sm_scale)
    indices = check_indices(indices, q.shape[0], k.shape[0])
    T, H, D = q.shape
    K = indices.shape[1]
    acc = accumulation_dtype(q)

    def attend(q_c, idx_c, k_, v_):
        valid = idx_c >= 0  # [C, K]
        k_sel = select_rows(k_, idx_c, valid).to(acc)  # [C, K, H, D]; -1 slots: zeros, by selection
        v_sel = select_rows(v_, idx_c, valid).to(acc)  # [C, K, H, D_v]
        scores = torch.einsum("thd,tkhd->thk", q_c.to(acc), k_sel) * sm_scale  # [C, H, K]
        probs, lse = masked_softmax_with_lse(scores, valid[:, None, :])  # [C, H, K], [C, H]
        out = torch.einsum("thk,tkhv->thv", probs, v_sel)  # [C, H, D_v]
        return out.to(q.dtype), lse

    chunk = auto_chunk_size(T, K * H * max(D, v.shape[-1]), chunk_size)
    return run_chunked(attend, T, chunk, (q, indices), (k, v))
