r"""Chapter 7: the sparse stage's slot operations for long contexts, in query chunks with a written-out backward.

The sparse stage computes everything on ``[T, K]`` slots (chapter 5's `attention_and_loss_on_slots`):
attention over the selection, the head-summed attention mass of each slot, and the index scores at
the slots. The chapter-3 functions (`sparse_mla`, `attention_head_sum`, `index_scores_at`) define
those numbers; they gather with ``x[idx]`` and let autograd differentiate query chunk after query
chunk under activation checkpointing. That is right and short, but at 128K tokens it is slow:
every chunk's backward materialises a gradient the size of all of ``q`` for its slice (``T / C``
times), the gather's gradient is a scatter autograd plans per chunk, and the recomputed forward
does work the backward does not need.

The functions here compute the same numbers the way the kernels do, in plain PyTorch:

* **one gather per chunk**: the rows are converted to the accumulation dtype once, with one extra
  zero row at the end, and each ``-1`` slot reads that zero row (`slot_rows`) -- a masked slot is
  zero by *selection*, and no placeholder row is read;
* **the backward is written out** (flash-attention style): each chunk recomputes its probabilities
  ``P`` from the gathered rows, then

  $$
  dP = dO\,V^\top,\quad dS = \sigma\,P \odot \big(dP - \textstyle\sum_k P\,dP + d\mathrm{lse}\big),\quad
  dq = dS\,KV,\quad dKV_\text{slots} = dS^\top q + [P^\top dO ;\, 0]
  $$

  and the slot gradients are added into one ``[S + 1, D]`` accumulator with ``index_add_``
  (deterministic on the CPU; on CUDA it adds with atomics, in any order, unless
  ``torch.use_deterministic_algorithms(True)`` asks for the sorted, ordered sum, which at 64K
  tokens takes most of the step); ``dq`` is written in place, chunk by chunk;
* chunks are sized from `DEFAULT_CHUNK_ELEMENTS` by what a chunk really holds (``[C, K, D]`` gathered
  rows and ``[C, H, K]`` probabilities), not by the scores alone.

Memory: ``O(T K)`` for the slots plus ``O(C K (D + H))`` for one chunk; nothing ``[T, S]``.
`LONG_CONTEXT_OPS` bundles them as a `SlotOps`; `DSAttention`'s reference backend uses it in the
sparse stage. The tests check them against the chapter-3 functions in float64 (values and
gradients, ``-1`` slots, empty rows, duplicate slots, garbage in unread rows, chunks of 1 row to all).
"""

from __future__ import annotations

import torch

from ._checks import accumulation_dtype, check_int, check_same_device, check_scale
from .attention import (DEFAULT_CHUNK_ELEMENTS, auto_chunk_size, check_latent_operands, check_value_width,
                        masked_softmax_with_lse)
from .indexer import _check_indexer_operands
from .slot_path import SlotOps
from .sparse_attention import check_head_sum_inputs, check_indices
from .streaming import row_chunks

__all__ = ["chunked_sparse_mla", "chunked_attention_head_sum", "chunked_index_scores_at", "LONG_CONTEXT_OPS",
           "padded_rows", "slot_rows", "slot_chunk"]


# --8<-- [start:gather]
def padded_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[S + 1, *F]``: the rows of ``x`` in ``dtype`` and one row of zeros at index ``S`` (what ``-1`` slots read)."""
    return torch.cat([x.to(dtype), x.new_zeros((1, *x.shape[1:]), dtype=dtype)])


def slot_rows(indices: torch.Tensor, num_rows: int) -> torch.Tensor:
    """int64 ``[C, K]``: the row each slot reads in `padded_rows` -- its index, or ``num_rows`` (zeros) for ``-1``."""
    indices = indices.long()
    return torch.where(indices >= 0, indices, torch.full_like(indices, num_rows))


def gather(rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``rows[slots]`` as ``[C, K, *F]``, read with one ``index_select`` of the flattened slots."""
    return rows.index_select(0, slots.flatten()).view(*slots.shape, *rows.shape[1:])
# --8<-- [end:gather]


def slot_chunk(num_rows: int, per_row: int, chunk_size: int | None = None) -> int:
    """Query rows per chunk: ``chunk_size``, or as many as keep ``per_row`` elements each within the budget."""
    return auto_chunk_size(num_rows, per_row, chunk_size, DEFAULT_CHUNK_ELEMENTS)


def _probabilities(q_c: torch.Tensor, kv_sel: torch.Tensor, valid: torch.Tensor, sm_scale: float):
    """``(probs [C, H, K], lse [C, H])`` of a chunk's queries ``[C, H, D]`` over its gathered rows ``[C, K, D]``."""
    scores = torch.bmm(q_c, kv_sel.transpose(1, 2)) * sm_scale  # [C, H, K]
    return masked_softmax_with_lse(scores, valid[:, None, :])


# --8<-- [start:chunked_sparse_mla]
class ChunkedSparseMLA(torch.autograd.Function):
    """`sparse_mla` over query chunks, with the backward written out (see the module docs).

    ``apply(q, kv, indices, sm_scale, d_v, chunks)`` -> ``(out [T, H, d_v], lse [T, H])``.
    """

    @staticmethod
    def forward(ctx, q, kv, indices, sm_scale, d_v, chunks):
        T, H, _ = q.shape
        acc = accumulation_dtype(q)
        S = kv.shape[0]
        rows = padded_rows(kv, acc)  # [S + 1, D]
        out = q.new_empty((T, H, d_v))
        lse = torch.empty((T, H), dtype=acc, device=q.device)
        for a, b in chunks:
            slots = slot_rows(indices[a:b], S)  # [C, K]
            kv_sel = gather(rows, slots)  # [C, K, D]; -1 slots read zeros
            probs, lse_c = _probabilities(q[a:b].to(acc), kv_sel, slots < S, sm_scale)  # [C, H, K], [C, H]
            out[a:b], lse[a:b] = torch.bmm(probs, kv_sel[..., :d_v]).to(q.dtype), lse_c  # [C, H, d_v], [C, H]
        ctx.save_for_backward(q, kv, indices)
        ctx.sm_scale, ctx.d_v, ctx.chunks = sm_scale, d_v, chunks
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, kv, indices = ctx.saved_tensors
        sm_scale, d_v = ctx.sm_scale, ctx.d_v
        need_q, need_kv = ctx.needs_input_grad[:2]
        acc = accumulation_dtype(q)
        S = kv.shape[0]
        rows = padded_rows(kv.detach(), acc)  # [S + 1, D]
        dq = torch.zeros_like(q) if need_q else None
        d_rows = torch.zeros_like(rows) if need_kv else None  # [S + 1, D]; row S collects the -1 slots
        for a, b in ctx.chunks:
            slots = slot_rows(indices[a:b], S)  # [C, K]
            kv_sel = gather(rows, slots)  # [C, K, D]
            q_c = q[a:b].detach().to(acc)  # [C, H, D]
            probs, _ = _probabilities(q_c, kv_sel, slots < S, sm_scale)  # [C, H, K]
            d_out_c = d_out[a:b].to(acc)  # [C, H, d_v]
            d_probs = torch.bmm(d_out_c, kv_sel[..., :d_v].transpose(1, 2))  # [C, H, K]
            delta = (probs * d_probs).sum(dim=-1, keepdim=True)  # [C, H, 1]
            d_scores = probs * (d_probs - delta + d_lse[a:b, :, None].to(acc)) * sm_scale  # [C, H, K]
            if need_q:
                dq[a:b] = torch.bmm(d_scores, kv_sel).to(q.dtype)  # [C, H, D]
            if need_kv:
                d_sel = torch.bmm(d_scores.transpose(1, 2), q_c)  # [C, K, D]
                d_sel[..., :d_v] += torch.bmm(probs.transpose(1, 2), d_out_c)  # the value part
                d_rows.index_add_(0, slots.flatten(), d_sel.flatten(0, 1))  # [S + 1, D] += [C*K, D]
        dkv = None if d_rows is None else d_rows[:S].to(kv.dtype)
        return dq, dkv, None, None, None, None
# --8<-- [end:chunked_sparse_mla]


def chunked_sparse_mla(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, *, sm_scale: float,
                       d_v: int = 512, chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`dsa_ref.sparse_mla`, computed in query chunks with a written-out backward (same arguments, same results).

    Returns ``(out [T, H, d_v]`` in q's dtype, ``lse [T, H]``)``, differentiable in ``q`` and ``kv`` (and
    through ``lse``). Equal to `sparse_mla` up to float rounding.
    """
    kv = check_latent_operands(q, kv)  # [S, D]
    check_int("indices", indices)
    check_same_device(q=q, kv=kv, indices=indices)
    check_value_width(d_v, kv)
    sm_scale = check_scale("sm_scale", sm_scale)
    indices = check_indices(indices, q.shape[0], kv.shape[0])
    T, H, D = q.shape
    K = indices.shape[1]
    chunk = slot_chunk(T, K * (2 * D + 4 * H), chunk_size)  # gathered rows, their gradient, [C, H, K] x 4
    return ChunkedSparseMLA.apply(q, kv, indices, sm_scale, d_v, row_chunks(T, chunk) or [(0, 0)])


# --8<-- [start:chunked_attention_head_sum]
@torch.no_grad()
def chunked_attention_head_sum(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, lse: torch.Tensor, *,
                               sm_scale: float, chunk_size: int | None = None) -> torch.Tensor:
    """`dsa_ref.attention_head_sum` in query chunks, with one gather per chunk (same arguments, same results).

    ``out[t, j] = sum_h exp(sm_scale * q[t, h] . kv[indices[t, j]] - lse[t, h])``, 0 at ``-1`` slots
    and in rows with ``lse = -inf``. No gradient.
    """
    kv, indices, sm_scale = check_head_sum_inputs(q, kv, indices, lse, sm_scale)
    T, H, D = q.shape
    K = indices.shape[1]
    acc = torch.float64 if torch.float64 in (q.dtype, kv.dtype) else torch.float32
    S = kv.shape[0]
    rows = padded_rows(kv, acc)  # [S + 1, D]
    out = torch.zeros((T, K), dtype=acc, device=q.device)
    for a, b in row_chunks(T, slot_chunk(T, K * (D + 2 * H), chunk_size)):
        slots = slot_rows(indices[a:b], S)  # [C, K]
        logits = torch.bmm(q[a:b].to(acc), gather(rows, slots).transpose(1, 2)) * sm_scale  # [C, H, K]
        lse_c = lse[a:b].to(acc)
        lse_safe = torch.where(torch.isinf(lse_c), torch.full_like(lse_c, float("inf")), lse_c)  # empty: p = 0
        mass = torch.exp(logits - lse_safe[:, :, None]).sum(dim=1)  # [C, K]
        out[a:b] = torch.where(slots < S, mass, torch.zeros((), dtype=acc, device=q.device))
    return out
# --8<-- [end:chunked_attention_head_sum]


# --8<-- [start:chunked_index_scores_at]
class ChunkedIndexScoresAt(torch.autograd.Function):
    """`index_scores_at` over query chunks with the backward written out.

    ``apply(q, k, weights, indices, relu, chunks)`` -> ``scores [T, K]`` (``-inf`` at ``-1`` slots).
    With ``u = q_h . k_j`` and ``r = relu(u)``: ``dw_h = sum_j dI_j r_hj``, ``du = dI_j w_h [u > 0]``,
    ``dq_h = sum_j du_hj k_j``, ``dk_j = sum_h du_hj q_h``.
    """

    @staticmethod
    def forward(ctx, q, k, weights, indices, relu, chunks):
        acc = torch.float64 if torch.float64 in (q.dtype, k.dtype, weights.dtype) else torch.float32
        S = k.shape[0]
        rows = padded_rows(k, acc)  # [S + 1, D_I]
        out = torch.empty(indices.shape, dtype=acc, device=q.device)  # [T, K]
        for a, b in chunks:
            slots = slot_rows(indices[a:b], S)  # [C, K]
            logits = torch.bmm(q[a:b].to(acc), gather(rows, slots).transpose(1, 2))  # [C, H_I, K]
            scores = torch.bmm(weights[a:b].to(acc)[:, None, :], logits.relu() if relu else logits)[:, 0]  # [C, K]
            out[a:b] = torch.where(slots < S, scores, torch.full((), float("-inf"), dtype=acc, device=q.device))
        ctx.save_for_backward(q, k, weights, indices)
        ctx.relu, ctx.chunks, ctx.acc = relu, chunks, acc
        return out

    @staticmethod
    def backward(ctx, d_scores):
        q, k, weights, indices = ctx.saved_tensors
        need_q, need_k, need_w = ctx.needs_input_grad[:3]
        acc, S = ctx.acc, k.shape[0]
        rows = padded_rows(k.detach(), acc)  # [S + 1, D_I]
        dq = torch.zeros_like(q) if need_q else None
        dw = torch.zeros_like(weights) if need_w else None
        d_rows = torch.zeros_like(rows) if need_k else None  # row S collects the -1 slots
        for a, b in ctx.chunks:
            slots = slot_rows(indices[a:b], S)  # [C, K]
            k_sel = gather(rows, slots)  # [C, K, D_I]
            q_c, w_c = q[a:b].detach().to(acc), weights[a:b].detach().to(acc)  # [C, H_I, D_I], [C, H_I]
            logits = torch.bmm(q_c, k_sel.transpose(1, 2))  # [C, H_I, K]
            d_c = torch.where(slots < S, d_scores[a:b].to(acc), torch.zeros((), dtype=acc, device=q.device))  # [C, K]
            if need_w:
                dw[a:b] = torch.bmm(logits.relu() if ctx.relu else logits, d_c[:, :, None])[..., 0].to(dw.dtype)
            d_logits = w_c[:, :, None] * d_c[:, None, :]  # [C, H_I, K]
            if ctx.relu:
                d_logits = torch.where(logits > 0, d_logits, torch.zeros((), dtype=acc, device=q.device))
            if need_q:
                dq[a:b] = torch.bmm(d_logits, k_sel).to(q.dtype)  # [C, H_I, D_I]
            if need_k:
                d_sel = torch.bmm(d_logits.transpose(1, 2), q_c)  # [C, K, D_I]
                d_rows.index_add_(0, slots.flatten(), d_sel.flatten(0, 1))  # [S + 1, D] += [C*K, D]
        dk = None if d_rows is None else d_rows[:S].to(k.dtype)
        return dq, dk, dw, None, None, None
# --8<-- [end:chunked_index_scores_at]


def chunked_index_scores_at(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, *,
                            relu: bool = True, chunk_size: int | None = None) -> torch.Tensor:
    """`dsa_ref.index_scores_at` in query chunks with a written-out backward (same arguments, same results).

    Returns ``[T, K]`` float32 (float64 for float64 inputs), ``-inf`` at ``-1`` slots; differentiable
    in ``q``, ``k`` and ``weights``.
    """
    T, H = _check_indexer_operands(q, k, weights)
    check_same_device(q=q, k=k, weights=weights, indices=indices)
    indices = check_indices(indices, T, k.shape[0])
    K = indices.shape[1]
    chunk = slot_chunk(T, K * (2 * q.shape[2] + 3 * H), chunk_size)  # gathered keys, their gradient, [C, H_I, K] x 3
    return ChunkedIndexScoresAt.apply(q, k, weights, indices, relu, row_chunks(T, chunk) or [(0, 0)])


#: The slot operations of the reference backend's sparse stage (see `dsa_ref.slot_path.SlotOps`).
LONG_CONTEXT_OPS = SlotOps(sparse_mla=chunked_sparse_mla, attention_head_sum=chunked_attention_head_sum,
                           index_scores_at=chunked_index_scores_at)
