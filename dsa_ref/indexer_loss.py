r"""Chapter 3.2, part 2: the indexer's KL loss, for both training stages.

The indexer is trained to predict where the main attention looks. For query ``t``, the **target**
is the main attention's probabilities summed over heads and L1-normalised over keys,

$$
p_{t,s} = \frac{\sum_h P_{t,h,s}}{\sum_{s'} \sum_h P_{t,h,s'}}, \qquad
P_{t,h,:} = \operatorname{softmax}_{s \in V_t}\big(\sigma\, q_{t,h}\cdot k_s\big),
$$

computed from *detached* main queries and keys, and the **prediction** is
``log_softmax(I[t, :])`` over the same valid keys ``V_t``. The loss is the KL divergence

$$
\mathcal{L}_t = \sum_{s \in V_t} p_{t,s}\,\big(\log p_{t,s} - \log \operatorname{softmax}_{V_t}(I_{t,:})_s\big) \;\ge 0,
$$

reduced over the valid query rows (``"mean"`` or ``"sum"``) and multiplied by ``coeff``.

* **dense warm-up**: ``V_t`` is the key window (every causal key);
* **sparse stage**: ``V_t`` is the selected top-k *set* (intersected with the window when given);
  both distributions are renormalised on it. Here a key selected twice counts once.

Its gradient with respect to the index scores has the closed form ``coeff / n * (softmax(I) - p)``
on valid keys (`indexer_logit_grad`). The prediction uses ``log_softmax``, never
``log(softmax + eps)``: the eps version underestimates the loss and suppresses gradients whenever a
predicted probability falls below eps.

Memory: `indexer_loss` works through the queries in chunks, so it holds ``[chunk, H, S]`` main
scores at a time instead of ``[T, H, S]``. `indexer_loss_plain` is the same math written in one go,
for reading and for testing the chunked version.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._checks import check_dim, check_float, check_rank, check_same_device, check_scale, check_windows
from .attention import auto_chunk_size, masked_softmax_with_lse, select_rows
from .layout import window_mask
from .sparse_attention import check_indices, first_occurrence

__all__ = ["indexer_loss", "indexer_loss_on_slots", "indexer_loss_plain", "indexer_target", "indexer_logit_grad", "masked_log_softmax",
           "valid_keys"]

_REDUCTIONS = ("mean", "sum")


def masked_log_softmax(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``log_softmax`` over the valid entries of the last dim; 0 at invalid entries and on empty rows.

    Args:
        scores: float ``[..., S]``.
        valid: bool ``[..., S]``.
    """
    has_valid = valid.any(dim=-1, keepdim=True)  # [..., 1]
    # empty rows are zeroed before the logsumexp so that neither forward nor backward sees -inf - -inf
    masked = torch.where(valid, scores, torch.full_like(scores, float("-inf")))
    masked = torch.where(has_valid, masked, torch.zeros_like(masked))
    log_z = torch.logsumexp(masked, dim=-1, keepdim=True)  # [..., 1]
    return torch.where(valid, masked - log_z, torch.zeros_like(masked))


def valid_keys(num_keys: int, rows: slice, *, starts: torch.Tensor | None, ends: torch.Tensor | None,
               topk_indices: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Bool ``[R, S]``: the keys each of the given query rows is trained on.

    The window (all keys when ``starts``/``ends`` are ``None``), intersected with the selected set
    when ``topk_indices`` is given (sparse stage). ``-1`` slots select nothing.
    """
    if starts is not None:
        valid = window_mask(starts[rows], ends[rows], num_keys)  # [R, S]
    else:
        valid = torch.ones(rows.stop - rows.start, num_keys, dtype=torch.bool, device=device)  # [R, S]
    if topk_indices is not None:
        idx = topk_indices[rows]  # [R, K]
        selected = torch.zeros(idx.shape[0], num_keys + 1, dtype=torch.bool, device=device)  # [R, S + 1]
        # -1 slots are sent to an extra column S, which is dropped: they select nothing
        selected.scatter_(1, torch.where(idx >= 0, idx, torch.full_like(idx, num_keys)), True)
        valid = valid & selected[:, :num_keys]  # [R, S]
    return valid


def _main_probs_summed(q: torch.Tensor, k: torch.Tensor, valid: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """``sum_h softmax_valid(sm_scale * q[t, h] . k[s])``: ``[R, H, D] x [S, (H,) D] -> [R, S]``."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    if k.dim() == 2:
        scores = torch.einsum("thd,sd->ths", q.to(acc), k.to(acc)) * sm_scale  # [R, H, S]
    else:
        scores = torch.einsum("thd,shd->ths", q.to(acc), k.to(acc)) * sm_scale  # [R, H, S]
    probs, _ = masked_softmax_with_lse(scores, valid[:, None, :])  # [R, H, S]
    return probs.sum(dim=1)  # [R, S]


def _l1_normalise(p: torch.Tensor) -> torch.Tensor:
    total = p.sum(dim=-1, keepdim=True)  # [R, 1]
    return p / torch.where(total > 0, total, torch.ones_like(total))  # rows of zeros stay zeros


def indexer_target(q: torch.Tensor, k: torch.Tensor, *, sm_scale: float, starts: torch.Tensor | None = None,
                   ends: torch.Tensor | None = None, topk_indices: torch.Tensor | None = None,
                   head_sum_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """The KL target ``p [T, S]``: main attention summed over heads, L1-normalised over the valid keys.

    Args:
        q: ``[T, H, D]`` main queries (absorbed: ``[T, H, 576]``); detached here.
        k: ``[S, D]`` (MQA / absorbed latent rows) or ``[S, H, D]`` main keys; detached here.
        sm_scale: the main attention's softmax scale.
        starts, ends: int ``[T]`` key windows; both ``None`` = all keys.
        topk_indices: int ``[T, K]`` for the sparse stage, ``None`` for the dense warm-up.
        head_sum_reduce: applied to the sum over heads before the L1 normalisation (see `indexer_loss`).

    Returns:
        ``[T, S]`` float32 (float64 for float64), rows sum to 1 (0 for rows with no valid key).
    """
    T, S = _check_main_qk(q, k)
    windows = check_windows(starts, ends, T, S)
    starts, ends = windows if windows is not None else (None, None)
    if topk_indices is not None:
        topk_indices = check_indices(topk_indices, T, S, name="topk_indices")
    with torch.no_grad():
        valid = valid_keys(S, slice(0, T), starts=starts, ends=ends, topk_indices=topk_indices, device=q.device)
        summed = _main_probs_summed(q.detach(), k.detach(), valid, sm_scale)  # [T, S]
        if head_sum_reduce is not None:
            summed = head_sum_reduce(summed)
        return _l1_normalise(summed)


# --8<-- [start:indexer_loss]
def indexer_loss(index_scores: torch.Tensor, q: torch.Tensor, k: torch.Tensor, *, sm_scale: float,
                 starts: torch.Tensor | None = None, ends: torch.Tensor | None = None,
                 topk_indices: torch.Tensor | None = None, reduction: str = "mean", coeff: float = 1.0,
                 chunk_size: int | None = None, row_mask: torch.Tensor | None = None,
                 num_rows: int | torch.Tensor | None = None,
                 head_sum_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """KL(target || softmax(index_scores)) over valid keys, reduced over valid query rows, times ``coeff``.

    Args:
        index_scores: ``[T, S]`` indexer logits (`lightning_indexer`); must be finite on valid keys.
            Gradients flow into it; nothing flows into ``q`` or ``k``.
        q: ``[T, H, D]`` main queries (absorbed: ``[T, H, 576]``).
        k: ``[S, D]`` (MQA / absorbed latent rows) or ``[S, H, D]`` main keys.
        sm_scale: the main attention's softmax scale.
        starts, ends: int ``[T]`` key windows; both ``None`` = all keys.
        topk_indices: int ``[T, K]``: sparse stage (valid keys = selected set within the window);
            ``None``: dense warm-up (valid keys = the window).
        reduction: ``"mean"`` (sum over valid rows / number of valid rows) or ``"sum"``.
        coeff: loss coefficient (0 gives a zero loss with zero, not missing, gradients).
        chunk_size: query rows per chunk; bounds memory to ``[chunk, H, S]``, never changes the result
            beyond float rounding.
        row_mask: optional bool ``[T]``; ``False`` rows (e.g. padding tokens) are left out entirely.
        num_rows: divisor for ``"mean"`` instead of this call's valid-row count; context parallelism
            passes the global count so that the per-rank losses add up to the single-process loss.
        head_sum_reduce: optional function applied to the per-row sum over heads (``[R, S]`` in the
            dense stage, ``[R, K]`` over the selected slots in the sparse stage; no gradient)
            *before* the L1 normalisation. Tensor parallelism passes an all-reduce over
            the TP group, so that every rank's target covers all heads, not only its own. It is
            called once per chunk of rows, so all ranks must see the same ``T``, ``S``, head count
            and ``chunk_size``.

    Returns:
        A scalar in the accumulation dtype (float32, float64 for float64 inputs).
    """
    T, S = _check_main_qk(q, k)
    check_float("index_scores", index_scores)
    check_rank("index_scores", index_scores, 2, "[T, S]")
    check_dim("index_scores", index_scores, 0, T, "q's queries")
    check_dim("index_scores", index_scores, 1, S, "k's keys")
    check_same_device(index_scores=index_scores, q=q, k=k, starts=starts, ends=ends, topk_indices=topk_indices)
    sm_scale = check_scale("sm_scale", sm_scale)
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    windows = check_windows(starts, ends, T, S)
    starts, ends = windows if windows is not None else (None, None)
    if topk_indices is not None:
        topk_indices = check_indices(topk_indices, T, S, name="topk_indices")
    if row_mask is not None:
        if not isinstance(row_mask, torch.Tensor) or row_mask.dtype != torch.bool or row_mask.shape != (T,):
            raise ValueError(f"row_mask must be a bool tensor of shape [{T}], got "
                             f"{getattr(row_mask, 'dtype', type(row_mask))} {tuple(getattr(row_mask, 'shape', ()))}")

    acc = torch.float64 if torch.float64 in (index_scores.dtype, q.dtype) else torch.float32
    q, k = q.detach(), k.detach()  # the target never sends gradient into the main attention
    if topk_indices is None:  # dense warm-up: every key of the window, [chunk, H, S] at a time
        chunk = auto_chunk_size(T, q.shape[1] * S, chunk_size)
    else:  # sparse stage: only the selected keys are gathered, [chunk, K, D] at a time
        K = topk_indices.shape[1]
        chunk = auto_chunk_size(T, K * max(q.shape[1], k[0].numel() if S else 1), chunk_size)
    total = index_scores.new_zeros((), dtype=acc)
    rows_counted = 0
    for lo in range(0, T, chunk):
        rows = slice(lo, min(lo + chunk, T))
        if topk_indices is None:
            target, log_pred, valid = _dense_rows(index_scores, q, k, rows, starts, ends, row_mask, sm_scale,
                                                  head_sum_reduce, acc)  # [R, S] each
        else:
            target, log_pred, valid = _selected_rows(index_scores, q, k, topk_indices, rows, starts, ends,
                                                     row_mask, sm_scale, head_sum_reduce, acc)  # [R, K] each
        total = total + _kl_rows(target, log_pred).sum()
        rows_counted += int(valid.any(dim=-1).sum())
    return _reduce(total, rows_counted, reduction, num_rows, coeff)
# --8<-- [end:indexer_loss]


def _kl_rows(target: torch.Tensor, log_pred: torch.Tensor) -> torch.Tensor:
    """``sum_s p log p - p log q`` per row; xlogy gives ``0 * log 0 = 0`` where the target is 0."""
    return (torch.xlogy(target, target) - target * log_pred).sum(dim=-1)  # [R]


def _reduce(total: torch.Tensor, rows_counted, reduction: str, num_rows, coeff: float) -> torch.Tensor:
    """``coeff * total`` (``"sum"``) or ``coeff * total / rows`` (``"mean"``; ``num_rows`` overrides)."""
    if reduction == "mean":
        denominator = rows_counted if num_rows is None else num_rows
        total = total / torch.as_tensor(denominator, dtype=total.dtype, device=total.device).clamp_min(1)
    if isinstance(coeff, (int, float)) and coeff == 1:
        return total  # no multiply (one kernel launch) for the common coefficient
    return total * coeff


def check_slot_loss_inputs(slot_scores, attention_mass, valid, reduction: str) -> None:
    """Raise ValueError/TypeError unless the arguments of `indexer_loss_on_slots` fit together."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    for name, x in (("slot_scores", slot_scores), ("attention_mass", attention_mass), ("valid", valid)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
    if slot_scores.shape != attention_mass.shape or valid.shape != slot_scores.shape or slot_scores.dim() != 2:
        raise ValueError(f"slot_scores, attention_mass and valid must share one [T, K] shape, got "
                         f"{tuple(slot_scores.shape)}, {tuple(attention_mass.shape)}, {tuple(valid.shape)}")
    if valid.dtype != torch.bool:
        raise TypeError(f"valid must be a bool tensor, got {valid.dtype}")
    for name, x in (("slot_scores", slot_scores), ("attention_mass", attention_mass)):
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a float tensor, got {x.dtype}")


# --8<-- [start:indexer_loss_on_slots]
def indexer_loss_on_slots(slot_scores: torch.Tensor, attention_mass: torch.Tensor, valid: torch.Tensor, *,
                          reduction: str = "mean", coeff: float = 1.0, num_rows: int | torch.Tensor | None = None,
                          head_sum_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """The indexer KL loss from per-slot quantities: what the kernel path computes.

    `indexer_loss` scores every valid key itself; this takes the pieces already gathered on the
    ``K`` slots of each query's valid set (the selection in the sparse stage, the whole window in
    the dense warm-up):

    Args:
        slot_scores: ``[T, K]`` index scores at the slots (`index_scores_at`); gradients flow into it.
        attention_mass: ``[T, K]`` main attention probabilities summed over this module's heads
            (`attention_head_sum`); detached, not yet normalised.
        valid: bool ``[T, K]``: the slots of the valid set, each key at most once.
        reduction, coeff, num_rows, head_sum_reduce: as in `indexer_loss` (``head_sum_reduce``
            is applied once, to the whole ``[T, K]`` mass).

    Returns:
        A scalar in the accumulation dtype. Equal to `indexer_loss` on the same valid sets.
    """
    check_slot_loss_inputs(slot_scores, attention_mass, valid, reduction)
    acc = torch.float64 if slot_scores.dtype == torch.float64 else torch.float32
    with torch.no_grad():
        mass = attention_mass.detach().to(acc).masked_fill(~valid, 0.0)  # [T, K]
        if head_sum_reduce is not None:
            mass = head_sum_reduce(mass)  # e.g. the sum over the heads of every TP rank
        target = _l1_normalise(mass)  # [T, K]
    log_pred = masked_log_softmax(slot_scores.to(acc), valid)  # [T, K]
    total = _kl_rows(target, log_pred).sum()
    return _reduce(total, valid.any(dim=-1).sum(), reduction, num_rows, coeff)
# --8<-- [end:indexer_loss_on_slots]


def _dense_rows(index_scores, q, k, rows, starts, ends, row_mask, sm_scale, head_sum_reduce, acc):
    """Dense warm-up, some query rows: target, log-prediction and validity over all keys, ``[R, S]``."""
    S = k.shape[0]
    valid = valid_keys(S, rows, starts=starts, ends=ends, topk_indices=None, device=q.device)  # [R, S]
    if row_mask is not None:
        valid = valid & row_mask[rows, None]
    with torch.no_grad():
        summed = _main_probs_summed(q[rows], k, valid, sm_scale)  # [R, S]
        if head_sum_reduce is not None:
            summed = head_sum_reduce(summed)  # e.g. the sum over the heads of every TP rank
        target = _l1_normalise(summed).to(acc)  # [R, S]
    log_pred = masked_log_softmax(index_scores[rows].to(acc), valid)  # [R, S]
    return target, log_pred, valid


def _selected_rows(index_scores, q, k, topk_indices, rows, starts, ends, row_mask, sm_scale, head_sum_reduce, acc):
    """Sparse stage, some query rows: the same quantities on the selected keys only, ``[R, K]``.

    The valid slots are the selected *set*: ``-1`` slots, keys outside the window and repeated
    indices (after their first slot) are left out, so this equals the dense formula restricted to
    the set -- without scoring the keys that were not selected.
    """
    idx = topk_indices[rows]  # [R, K]
    valid = (idx >= 0) & first_occurrence(idx)  # [R, K]
    if starts is not None:
        valid = valid & (idx >= starts[rows, None]) & (idx < ends[rows, None])
    if row_mask is not None:
        valid = valid & row_mask[rows, None]
    safe = torch.where(valid, idx, torch.zeros_like(idx))  # [R, K]; invalid slots read column 0 ...
    with torch.no_grad():
        k_sel = select_rows(k, idx, valid).to(acc)  # [R, K, D] or [R, K, H, D]; invalid slots: zeros
        if k.dim() == 2:
            scores = torch.einsum("thd,tkd->thk", q[rows].to(acc), k_sel) * sm_scale  # [R, H, K]
        else:
            scores = torch.einsum("thd,tkhd->thk", q[rows].to(acc), k_sel) * sm_scale  # [R, H, K]
        probs, _ = masked_softmax_with_lse(scores, valid[:, None, :])  # [R, H, K]
        summed = probs.sum(dim=1)  # [R, K]
        if head_sum_reduce is not None:
            summed = head_sum_reduce(summed)
        target = _l1_normalise(summed).to(acc)  # [R, K]
    scores = index_scores[rows].to(acc)  # [R, S]
    if scores.shape[1] == 0:  # no keys: every slot is invalid; read a zero column instead
        scores = scores.new_zeros(scores.shape[0], 1)  # [R, 1]
    log_pred = masked_log_softmax(scores.gather(1, safe), valid)  # [R, K]; ... and are masked here
    return target, log_pred, valid


def indexer_loss_plain(index_scores: torch.Tensor, q: torch.Tensor, k: torch.Tensor, *, sm_scale: float,
                       starts: torch.Tensor | None = None, ends: torch.Tensor | None = None,
                       topk_indices: torch.Tensor | None = None, reduction: str = "mean",
                       coeff: float = 1.0) -> torch.Tensor:
    """`indexer_loss` written in one go over ``[H, T, S]``: for reading and for small inputs only."""
    T, S = _check_main_qk(q, k)
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if starts is not None or ends is not None:
        starts, ends = check_windows(starts, ends, T, S)
    if topk_indices is not None:
        topk_indices = check_indices(topk_indices, T, S, name="topk_indices")
    valid = torch.ones(T, S, dtype=torch.bool, device=q.device) if starts is None else window_mask(starts, ends, S)
    if topk_indices is not None:
        selected = torch.zeros(T, S, dtype=torch.bool, device=q.device)
        for t in range(T):
            picked = topk_indices[t][topk_indices[t] >= 0]
            selected[t, picked] = True
        valid = valid & selected  # [T, S]
    acc = torch.float64 if torch.float64 in (index_scores.dtype, q.dtype) else torch.float32
    qd, kd = q.detach().to(acc), k.detach().to(acc)
    k_heads = kd[:, None, :].expand(S, q.shape[1], q.shape[2]) if kd.dim() == 2 else kd  # [S, H, D]
    logits = torch.einsum("thd,shd->hts", qd, k_heads) * sm_scale  # [H, T, S]
    logits = logits.masked_fill(~valid, float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # [H, T, S]; empty rows -> 0
    summed = probs.sum(dim=0)  # [T, S]
    target = summed / summed.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(acc).tiny)  # [T, S]
    log_pred = masked_log_softmax(index_scores.to(acc), valid)  # [T, S]
    kl = (torch.xlogy(target, target) - target * log_pred).sum(dim=-1)  # [T]
    n = int(valid.any(dim=-1).sum())
    loss = kl.sum() / max(n, 1) if reduction == "mean" else kl.sum()
    return loss * coeff


def indexer_logit_grad(index_scores: torch.Tensor, q: torch.Tensor, k: torch.Tensor, *, sm_scale: float,
                       starts: torch.Tensor | None = None, ends: torch.Tensor | None = None,
                       topk_indices: torch.Tensor | None = None, reduction: str = "mean",
                       coeff: float = 1.0) -> torch.Tensor:
    """Closed-form gradient of `indexer_loss` with respect to ``index_scores``.

    ``dL/dI[t, s] = c * (softmax_valid(I[t])[s] - p[t, s])`` on valid keys, 0 elsewhere, with
    ``c = coeff / n_valid_rows`` for ``"mean"`` and ``c = coeff`` for ``"sum"``. It holds because the
    target sums to 1 on every valid row.

    Returns:
        ``[T, S]`` in the accumulation dtype.
    """
    T, S = _check_main_qk(q, k)
    target = indexer_target(q, k, sm_scale=sm_scale, starts=starts, ends=ends, topk_indices=topk_indices)
    windows = check_windows(starts, ends, T, S)
    st, en = windows if windows is not None else (None, None)
    valid = valid_keys(S, slice(0, T), starts=st, ends=en, topk_indices=topk_indices, device=q.device)
    log_pred = masked_log_softmax(index_scores.detach().to(target.dtype), valid)  # [T, S]
    pred = torch.where(valid, log_pred.exp(), torch.zeros_like(log_pred))  # [T, S]
    n = int(valid.any(dim=-1).sum())
    c = coeff / max(n, 1) if reduction == "mean" else coeff
    return c * (pred - target)


def _check_main_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int]:
    check_float("q", q)
    check_float("k", k)
    check_rank("q", q, 3, "[T, H, D]")
    check_rank("k", k, (2, 3), "[S, D] or [S, H, D]")
    check_dim("k", k, -1, q.shape[-1], "q's head dim")
    if k.dim() == 3:
        check_dim("k", k, 1, q.shape[1], "q's heads")
    return q.shape[0], k.shape[0]
