r"""Chapter 5: the layer's attention and indexer loss, computed on *slots* (what the kernels need).

`DSAttention.attend` (chapter 3) computes the indexer loss from the full ``[T, S]`` index scores
and re-derives the main attention's probabilities inside `indexer_loss`. The kernel path computes
exactly the same numbers from per-slot tensors of shape ``[T, K]``:

1. the **slots** of each query: its top-k selection in the sparse stage, its whole key window in
   the dense warm-up (`window_indices`; then the attention over the slots *is* the dense attention);
2. the main attention over the slots, `sparse_mla`, which also returns the LSE ``[T, H]``;
3. the attention **mass** of every slot, summed over heads, from that LSE (`attention_head_sum`):
   no second softmax;
4. the index scores **at the slots** only (`index_scores_at`), the one place gradients reach
   the indexer;
5. the KL divergence on the slots (`indexer_loss_on_slots`).

Every step is one function with a readable reference and (optionally) a TileLang kernel; a
`SlotOps` names the four that have kernels. With `REFERENCE_OPS` this module runs anywhere, and
the tests check that it equals the readable layer in float64 for both stages (packed sequences,
padding masks, context parallelism's loss divisor). With the kernels (`dsa_ref.kernels.slot_ops`)
it is the fast path `DSAttention` takes for ``backend="tilelang"`` / ``"auto"``.

The top-k selection has no duplicates and lies inside the windows, so the slots are a *set* and
the LSE of step 2 normalises the same distribution as the target's softmax over that set.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .indexer import index_scores_at
from .indexer_loss import indexer_loss_on_slots
from .sparse_attention import attention_head_sum, sparse_mla

__all__ = ["SlotOps", "REFERENCE_OPS", "window_indices", "attention_and_loss_on_slots"]


@dataclass(frozen=True)
class SlotOps:
    """The per-slot operations, with the signatures of their reference functions.

    * ``sparse_mla(q, kv, indices, *, sm_scale, d_v) -> (out, lse)``
    * ``attention_head_sum(q, kv, indices, lse, *, sm_scale) -> mass [T, K]``
    * ``index_scores_at(q, k, weights, indices, *, relu) -> scores [T, K]``
    * ``indexer_loss_on_slots(slot_scores, mass, valid, *, reduction, coeff, num_rows, head_sum_reduce)
      -> loss []`` (default: the reference, `dsa_ref.indexer_loss.indexer_loss_on_slots`)
    """

    sparse_mla: Callable
    attention_head_sum: Callable
    index_scores_at: Callable
    indexer_loss_on_slots: Callable = indexer_loss_on_slots


REFERENCE_OPS = SlotOps(sparse_mla=sparse_mla, attention_head_sum=attention_head_sum,
                        index_scores_at=index_scores_at)


# --8<-- [start:window_indices]
def window_indices(starts: torch.Tensor, ends: torch.Tensor, *, multiple: int = 1) -> torch.Tensor:
    """Every key of each query's window as a slot list: ``[T, W]`` int64, ``-1`` after the window.

    Row ``t`` holds ``starts[t], starts[t] + 1, ..., ends[t] - 1`` and then ``-1``; ``W`` is the
    longest window rounded up to ``multiple``. With these slots, sparse attention is dense attention.
    """
    length = (ends - starts).clamp_min(0)  # [T]
    width = int(length.max()) if length.numel() else 0
    width = max(multiple, -(-width // multiple) * multiple)
    offset = torch.arange(width, device=starts.device)  # [W]
    slots = starts[:, None] + offset[None, :]  # [T, W]
    return torch.where(offset[None, :] < length[:, None], slots, torch.full_like(slots, -1))
# --8<-- [end:window_indices]


def check_row_mask(row_mask: torch.Tensor | None, num_rows: int) -> None:
    """Raise ValueError unless ``row_mask`` is ``None`` or a bool tensor of shape ``[num_rows]``."""
    if row_mask is not None and (not isinstance(row_mask, torch.Tensor) or row_mask.dtype != torch.bool
                                 or row_mask.shape != (num_rows,)):
        raise ValueError(f"row_mask must be a bool tensor of shape [{num_rows}], got "
                         f"{getattr(row_mask, 'dtype', type(row_mask))} {tuple(getattr(row_mask, 'shape', ()))}")


# --8<-- [start:attention_and_loss_on_slots]
def attention_and_loss_on_slots(q: torch.Tensor, kv: torch.Tensor, q_i: torch.Tensor, k_i: torch.Tensor,
                                w_i: torch.Tensor, topk: torch.Tensor, *, stage: str, sm_scale: float, d_v: int,
                                relu: bool, starts: torch.Tensor, ends: torch.Tensor, reduction: str = "mean",
                                coeff: float = 1.0, num_rows=None, head_sum_reduce=None,
                                row_mask: torch.Tensor | None = None, ops: SlotOps = REFERENCE_OPS
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 4-5 of `DSAttention.attend` on slots: ``(o_latent [T, H, d_v], indexer loss [])``.

    Args:
        q: ``[T, H, 576]`` absorbed queries; kv: ``[S, 576]`` latent rows (all keys).
        q_i, k_i, w_i: the indexer's ``[T, H_I, D_I]`` queries, ``[S, D_I]`` keys, ``[T, H_I]`` weights.
        topk: int ``[T, K]`` the selection (`topk_indices` of the index scores).
        stage: ``"sparse"`` (slots = the selection) or ``"dense_warmup"`` (slots = the window).
        sm_scale, d_v: the main attention's softmax scale and value width.
        relu: the indexer's ReLU.
        starts, ends: int ``[T]`` key windows.
        reduction, coeff, num_rows, head_sum_reduce, row_mask: as in `indexer_loss`.
        ops: which implementation runs each per-slot step (`REFERENCE_OPS` or the kernels').
    """
    check_row_mask(row_mask, q.shape[0])
    slots = topk if stage == "sparse" else window_indices(starts, ends, multiple=128)  # [T, K]
    o_latent, lse = ops.sparse_mla(q, kv, slots, sm_scale=sm_scale, d_v=d_v)  # [T, H, d_v], [T, H]

    valid = (slots >= 0) & (slots >= starts[:, None]) & (slots < ends[:, None])  # [T, K]
    if row_mask is not None:
        valid = valid & row_mask[:, None]
    mass = ops.attention_head_sum(q.detach(), kv.detach(), slots, lse.detach(), sm_scale=sm_scale)  # [T, K]
    slot_scores = ops.index_scores_at(q_i, k_i, w_i, slots, relu=relu)  # [T, K], gradients to the indexer
    loss = ops.indexer_loss_on_slots(slot_scores, mass, valid, reduction=reduction, coeff=coeff,
                                     num_rows=num_rows, head_sum_reduce=head_sum_reduce)
    return o_latent, loss
# --8<-- [end:attention_and_loss_on_slots]
