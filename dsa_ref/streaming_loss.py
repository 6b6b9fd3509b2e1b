r"""Chapter 7: the dense warm-up's indexer loss, streamed over key tiles (nothing ``[T, S]`` is kept).

In the dense warm-up the indexer's KL loss runs over each query's whole key window ``W_t``:

$$
\mathcal{L}_t = \sum_{s \in W_t} p_{t,s}\,\big(\log p_{t,s} - I_{t,s} + Z_t\big), \qquad
p_{t,s} = \frac{m_{t,s}}{M_t},\quad m_{t,s} = \sum_h e^{\sigma q_{t,h}\cdot kv_s - \mathrm{lse}_{t,h}},
\quad M_t = \sum_{s \in W_t} m_{t,s},\quad Z_t = \log \sum_{s\in W_t} e^{I_{t,s}}
$$

with ``m`` the main attention's probabilities summed over heads (one exponential each, from the
attention's own LSE), ``I`` the index scores and ``Z`` their log-sum-exp over the window. Written
out, the loss of a row needs only four sums over its keys:

$$
\mathcal{L}_t = \frac{A_t - B_t}{M_t} - \log M_t + Z_t, \qquad
A_t = \sum_s m_{t,s} \log m_{t,s}, \quad B_t = \sum_s m_{t,s}\, I_{t,s},
$$

and ``Z`` is accumulated with online normalisation, ``Z <- logaddexp(Z, logsumexp(I_tile))``. So:

* **pass 1 (forward)**: for each block of (query rows) x (key tile), compute ``I`` and ``m`` on the
  block, add to ``M, A, B`` and merge into ``Z``; keep only these four ``[T]`` vectors;
* **pass 2 (backward)**: the gradient with respect to the index scores is
  ``dL/dI_{t,s} = c (softmax(I)_{t,s} - p_{t,s}) = c (exp(I_{t,s} - Z_t) - m_{t,s} / M_t)``
  (``c`` from the reduction), so each block is computed again, its ``dI`` formed from the saved
  ``Z`` and ``M``, and sent through the block's index scores into ``q_i, k_i, w_i`` -- the
  flash-attention pattern: recompute in backward instead of storing ``[T, S]``.

Two ways to compute a block, with one driver (`streamed_indexer_loss`):

* readable (``ops=None``): a key tile ``[lo, hi)`` is a slice of the keys; the scores come from
  `lightning_indexer` on the tile and the mass from one einsum, masked by the windows;
* slots (``ops`` a `dsa_ref.slot_path.SlotOps`): each row's keys in the tile become a slot list
  (its keys in ``[lo, hi)`` inside its window, left-aligned, ``-1`` after), and the block is
  `attention_head_sum` + `index_scores_at` on those slots -- with the kernels' ops, the TileLang path.
  The tests run it with the readable ops.

A row whose mass is all zero, or with no key, contributes 0 (as in `indexer_loss`). Memory: ``O(T)``
between forward and backward, one block ``[rows, tile]`` (and the readable mass's
``[rows, H, tile]``) at a time. When a single block covers everything, the loss is computed in one
go with autograd (``ops.indexer_loss_on_slots``: the fused KL kernel on the kernels' ops, else
`indexer_loss_on_slots`): the same numbers, no second pass.

`windowed_attention_on_slots` is the main attention of the warm-up on the slot kernels, over the
window slots of one query chunk at a time, also recomputed in backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._checks import check_positive_int, check_same_device, check_scale
from .attention import DEFAULT_CHUNK_ELEMENTS
from .indexer import _check_indexer_operands, lightning_indexer
from .indexer_loss import _REDUCTIONS, _reduce, indexer_loss_on_slots
from .slot_path import SlotOps, check_row_mask, window_indices
from .streaming import (DEFAULT_KEY_TILE, KERNEL_SCORE_ELEMENTS, checked_windows, chunk_key_ranges, row_chunks,
                        shift_windows)

__all__ = ["streamed_indexer_loss", "block_plan", "readable_block", "slot_block", "tile_slots",
           "windowed_attention_on_slots"]


# --8<-- [start:block_plan]
def block_plan(starts: torch.Tensor, ends: torch.Tensor, *, query_chunk: int, key_tile: int
               ) -> list[tuple[int, int, int, int]]:
    """The blocks ``(r0, r1, lo, hi)`` of the stream: rows ``[r0, r1)`` x keys ``[lo, hi)``.

    Rows are cut into chunks of ``query_chunk``, each chunk's key range (`chunk_key_ranges`) into
    tiles of ``key_tile``, and each block keeps only the rows from the first to the last one whose
    window meets the tile (a causal chunk's early rows skip its late tiles). Blocks with no such
    row are left out. Computed on the host from one copy of the windows.
    """
    chunks = row_chunks(starts.numel(), query_chunk)
    st, en = torch.stack([starts, ends]).cpu()  # one read back: [T] each
    plan = []
    for (a, b), (lo, hi) in zip(chunks, chunk_key_ranges(st, en, chunks)):
        for t0 in range(lo, hi, key_tile):
            t1 = min(t0 + key_tile, hi)
            meets = ((st[a:b] < t1) & (en[a:b] > t0) & (en[a:b] > st[a:b])).nonzero().flatten()  # [rows]
            if meets.numel():
                plan.append((a + int(meets[0]), a + int(meets[-1]) + 1, t0, t1))
    return plan
# --8<-- [end:block_plan]


# --8<-- [start:readable_block]
def readable_block(q_i, k_i, w_i, q, kv, lse, starts, ends, lo, hi, *, sm_scale, relu):
    """One block, readable: index scores, attention mass and validity of rows x keys ``[lo, hi)``.

    Args: the block's rows of ``q_i [R, H_I, D_I]``, ``w_i [R, H_I]``, ``q [R, H, D]``,
    ``lse [R, H]``, ``starts, ends [R]``; all keys ``k_i [S, D_I]``, ``kv [S, D]``.

    Returns:
        ``(scores [R, n], mass [R, n], valid [R, n])`` with ``n = hi - lo``; ``scores`` is
        differentiable in ``q_i``, ``k_i``, ``w_i`` and ``-inf`` outside the windows, ``mass`` is 0 there.
    """
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    tile_starts, tile_ends = shift_windows(starts, ends, lo, hi)  # [R] each
    scores = lightning_indexer(q_i, k_i[lo:hi], w_i, starts=tile_starts, ends=tile_ends, relu=relu)  # [R, n]
    key = torch.arange(hi - lo, device=q.device)  # [n]
    valid = (key[None, :] >= tile_starts[:, None]) & (key[None, :] < tile_ends[:, None])  # [R, n]
    with torch.no_grad():
        logits = torch.einsum("thd,sd->ths", q.to(acc), kv[lo:hi].to(acc)) * sm_scale  # [R, H, n]
        lse_safe = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse).to(acc)  # empty: p = 0
        mass = torch.exp(logits - lse_safe[:, :, None]).sum(dim=1)  # [R, n]
        mass = torch.where(valid, mass, torch.zeros_like(mass))
    return scores, mass, valid
# --8<-- [end:readable_block]


# --8<-- [start:slot_block]
def tile_slots(starts: torch.Tensor, ends: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """int64 ``[R, hi - lo]``: each row's keys of ``[lo, hi)`` inside its window, left-aligned, then ``-1``.

    With ``[lo, hi)`` covering every window this is `window_indices`.
    """
    first = starts.clamp(lo, hi)  # [R]
    count = (ends.clamp(lo, hi) - first).clamp_min(0)  # [R]
    offset = torch.arange(hi - lo, device=starts.device)  # [n]
    slots = first[:, None] + offset[None, :]  # [R, n]
    return torch.where(offset[None, :] < count[:, None], slots, torch.full_like(slots, -1))


def slot_block(ops: SlotOps):
    """A block function like `readable_block` computed on slots with ``ops`` (readable or kernels)."""

    def block(q_i, k_i, w_i, q, kv, lse, starts, ends, lo, hi, *, sm_scale, relu):
        slots = tile_slots(starts, ends, lo, hi)  # [R, n]
        valid = slots >= 0  # [R, n]
        with torch.no_grad():
            mass = ops.attention_head_sum(q, kv, slots, lse, sm_scale=sm_scale)  # [R, n]
            mass = torch.where(valid, mass, torch.zeros_like(mass))
        scores = ops.index_scores_at(q_i, k_i, w_i, slots, relu=relu)  # [R, n], -inf at -1 slots
        return scores, mass, valid

    return block
# --8<-- [end:slot_block]


# --8<-- [start:streamed_kl]
class StreamedKL(torch.autograd.Function):
    """The sum over rows of the dense-stage KL, streamed; differentiable in ``q_i``, ``k_i``, ``w_i``.

    ``apply(q_i, k_i, w_i, q, kv, lse, starts, ends, plan, block, head_sum_reduce)``: see
    `streamed_indexer_loss`; ``plan`` from `block_plan`, ``block`` like `readable_block`.
    """

    @staticmethod
    def forward(ctx, q_i, k_i, w_i, q, kv, lse, starts, ends, plan, block, head_sum_reduce):
        T = q_i.shape[0]
        acc = torch.float64 if torch.float64 in (q_i.dtype, q.dtype) else torch.float32
        Z = torch.full((T,), float("-inf"), dtype=acc, device=q_i.device)  # log-sum-exp of I over the window
        M = torch.zeros(T, dtype=acc, device=q_i.device)  # sum of m
        A = torch.zeros(T, dtype=acc, device=q_i.device)  # sum of m log m
        B = torch.zeros(T, dtype=acc, device=q_i.device)  # sum of m I
        for r0, r1, lo, hi in plan:
            scores, mass, valid = _run_block(block, (q_i, k_i, w_i, q, kv, lse, starts, ends), r0, r1, lo, hi,
                                             head_sum_reduce, acc)  # [R, n] each
            Z[r0:r1] = torch.logaddexp(Z[r0:r1], torch.logsumexp(scores, dim=-1))  # online normalisation
            M[r0:r1] += mass.sum(dim=-1)
            A[r0:r1] += torch.xlogy(mass, mass).sum(dim=-1)
            B[r0:r1] += torch.where(valid, mass * scores, torch.zeros_like(mass)).sum(dim=-1)
        has_mass = M > 0
        M_safe = torch.where(has_mass, M, torch.ones_like(M))
        Z_safe = torch.where(torch.isfinite(Z), Z, torch.zeros_like(Z))
        kl = torch.where(has_mass, (A - B) / M_safe - torch.log(M_safe) + Z_safe, torch.zeros_like(M))  # [T]
        ctx.save_for_backward(q_i, k_i, w_i, q, kv, lse, starts, ends, Z, M)
        ctx.plan, ctx.block, ctx.head_sum_reduce, ctx.acc = plan, block, head_sum_reduce, acc
        return kl.sum()

    @staticmethod
    def backward(ctx, grad_total):
        q_i, k_i, w_i, q, kv, lse, starts, ends, Z, M = ctx.saved_tensors
        acc = ctx.acc
        need = ctx.needs_input_grad[:3]
        grads = [torch.zeros(t.shape, dtype=acc, device=t.device) if n else None for t, n in zip((q_i, k_i, w_i), need)]
        if not any(need):
            return (None,) * 11
        has_mass = M > 0
        M_safe = torch.where(has_mass, M, torch.ones_like(M))
        c = grad_total.to(acc)
        k_leaf = k_i.detach().requires_grad_(need[1])
        for r0, r1, lo, hi in ctx.plan:
            q_leaf = q_i[r0:r1].detach().requires_grad_(need[0])
            w_leaf = w_i[r0:r1].detach().requires_grad_(need[2])
            with torch.enable_grad():
                scores_graph, mass, valid = ctx.block(q_leaf, k_leaf, w_leaf, q[r0:r1], kv, lse[r0:r1],
                                                      starts[r0:r1], ends[r0:r1], lo, hi)
            mass = torch.where(valid, mass.to(acc), torch.zeros((), dtype=acc, device=mass.device))
            if ctx.head_sum_reduce is not None:
                mass = ctx.head_sum_reduce(mass)
            scores = torch.where(valid, scores_graph.detach().to(acc), torch.full_like(mass, float("-inf")))
            # dL/dI = c (softmax(I) * sum(p) - p): sum(p) is 1 on rows with mass, 0 on the others
            softmax = torch.exp(scores - torch.where(torch.isfinite(Z[r0:r1]), Z[r0:r1], 0)[:, None])  # [R, n]
            softmax = torch.where(has_mass[r0:r1, None], softmax, torch.zeros_like(softmax))
            d_scores = c * (softmax - mass / M_safe[r0:r1, None])  # [R, n]
            d_scores = torch.where(valid, d_scores, torch.zeros_like(d_scores))
            leaves = [x for x, n in zip((q_leaf, k_leaf, w_leaf), need) if n]
            got = iter(torch.autograd.grad(scores_graph, leaves, d_scores.to(scores_graph.dtype)))
            for i, (rows, n) in enumerate(zip((slice(r0, r1), slice(None), slice(r0, r1)), need)):
                if n:
                    grads[i][rows] += next(got).to(acc)
        out = [None if g is None else g.to(t.dtype) for g, t in zip(grads, (q_i, k_i, w_i))]
        return (*out,) + (None,) * 8


def _run_block(block, tensors, r0, r1, lo, hi, head_sum_reduce, acc):
    """One block of the forward pass, without gradients: ``(scores, mass, valid)`` in ``acc``."""
    q_i, k_i, w_i, q, kv, lse, starts, ends = tensors
    with torch.no_grad():
        scores, mass, valid = block(q_i[r0:r1], k_i, w_i[r0:r1], q[r0:r1], kv, lse[r0:r1], starts[r0:r1],
                                    ends[r0:r1], lo, hi)
        mass = torch.where(valid, mass.to(acc), torch.zeros((), dtype=acc, device=mass.device))
        if head_sum_reduce is not None:
            mass = head_sum_reduce(mass)  # e.g. the sum over every TP rank's heads
        scores = torch.where(valid, scores.to(acc), torch.full_like(mass, float("-inf")))
    return scores, mass, valid
# --8<-- [end:streamed_kl]


# --8<-- [start:streamed_indexer_loss]
def streamed_indexer_loss(q_i: torch.Tensor, k_i: torch.Tensor, w_i: torch.Tensor, q: torch.Tensor,
                          kv: torch.Tensor, lse: torch.Tensor, *, sm_scale: float, relu: bool = True,
                          starts: torch.Tensor | None = None, ends: torch.Tensor | None = None,
                          reduction: str = "mean", coeff: float = 1.0, num_rows: int | torch.Tensor | None = None,
                          row_mask: torch.Tensor | None = None,
                          head_sum_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                          query_chunk: int | None = None, key_tile: int | None = None,
                          ops: SlotOps | None = None) -> torch.Tensor:
    """The dense warm-up's indexer loss from the indexer's inputs, never holding ``[T, S]``.

    Equals ``indexer_loss(lightning_indexer(q_i, k_i, w_i, starts=, ends=, relu=), q, kv,
    sm_scale=, starts=, ends=, ...)`` (dense stage) in value and in its gradients with respect to
    ``q_i``, ``k_i`` and ``w_i``, up to float rounding.

    Args:
        q_i, k_i, w_i: the indexer's ``[T, H_I, D_I]`` queries, ``[S, D_I]`` keys, ``[T, H_I]`` weights
            (differentiable).
        q: ``[T, H, D]`` main (absorbed) queries; kv: ``[S, D]`` latent rows; both detached here.
        lse: ``[T, H]`` the main attention's log-sum-exp over each window (`dense_mla_attention`'s,
            or the slot attention's); detached.
        sm_scale: the main attention's softmax scale. relu: the indexer's ReLU.
        starts, ends: int ``[T]`` key windows; both ``None`` = every key.
        reduction, coeff, num_rows, row_mask, head_sum_reduce: as in `indexer_loss` (``head_sum_reduce``
            is called on every block's ``[rows, tile]`` mass, in forward and again in backward).
        query_chunk, key_tile: the block size; defaults: readable blocks of ``DEFAULT_KEY_TILE`` keys and
            ``2**26`` elements of mass logits; with ``ops``, all rows and as many keys as fit
            ``KERNEL_SCORE_ELEMENTS``.
        ops: ``None``: readable blocks (`readable_block`); a `SlotOps`: blocks on slots (`slot_block`).

    Returns:
        A scalar in the accumulation dtype (float32, float64 for float64 inputs).
    """
    T, _ = _check_indexer_operands(q_i, k_i, w_i)
    check_same_device(q_i=q_i, k_i=k_i, w_i=w_i, q=q, kv=kv, lse=lse, starts=starts, ends=ends, row_mask=row_mask)
    sm_scale = check_scale("sm_scale", sm_scale)
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if q.dim() != 3 or q.shape[0] != T or kv.dim() != 2 or kv.shape[0] != k_i.shape[0] or lse.shape != q.shape[:2]:
        raise ValueError(f"expected q [T={T}, H, D], kv [S={k_i.shape[0]}, D] and lse [T, H], got "
                         f"{tuple(q.shape)}, {tuple(kv.shape)}, {tuple(lse.shape)}")
    S = k_i.shape[0]
    starts, ends = checked_windows(starts, ends, T, S, q_i.device)
    check_row_mask(row_mask, T)
    if row_mask is not None:
        ends = torch.where(row_mask, ends, starts)  # a masked row has an empty window: no key, no loss
    if ops is None:
        block = readable_block
        key_tile = key_tile or DEFAULT_KEY_TILE
        query_chunk = query_chunk or max(1, DEFAULT_CHUNK_ELEMENTS // (max(q.shape[1], q_i.shape[1]) * key_tile))
    else:
        block = slot_block(ops)
        query_chunk = query_chunk or max(T, 1)
        key_tile = key_tile or max(1, KERNEL_SCORE_ELEMENTS // max(T, 1))
        key_tile = key_tile // 64 * 64 if key_tile >= 64 else key_tile  # whole 64-slot blocks of the kernels
    query_chunk = check_positive_int("query_chunk", query_chunk)
    key_tile = check_positive_int("key_tile", key_tile)

    def run(*args, **kw):
        return block(*args, **kw, sm_scale=sm_scale, relu=relu)

    q, kv, lse = q.detach(), kv.detach(), lse.detach()
    plan = block_plan(starts, ends, query_chunk=query_chunk, key_tile=key_tile)
    rows = (ends > starts).sum()
    if len(plan) == 1:  # one block holds everything: one go, autograd keeps the block
        r0, r1, lo, hi = plan[0]
        scores, mass, valid = run(q_i[r0:r1], k_i, w_i[r0:r1], q[r0:r1], kv, lse[r0:r1], starts[r0:r1],
                                  ends[r0:r1], lo, hi)
        kl_on_slots = indexer_loss_on_slots if ops is None else ops.indexer_loss_on_slots  # the KL kernel on GPU
        return kl_on_slots(scores, mass, valid, reduction=reduction, coeff=coeff, num_rows=num_rows,
                           head_sum_reduce=head_sum_reduce)
    total = StreamedKL.apply(q_i, k_i, w_i, q, kv, lse, starts, ends, plan, run, head_sum_reduce)
    return _reduce(total, rows, reduction, num_rows, coeff)
# --8<-- [end:streamed_indexer_loss]


# --8<-- [start:windowed_attention_on_slots]
class _ChunkedSlotAttention(torch.autograd.Function):
    """Attention of every query over its window, one query chunk of window slots at a time."""

    @staticmethod
    def forward(ctx, q, kv, starts, ends, chunks, attend):
        out = lse = None
        with torch.no_grad():
            for a, b in chunks:
                out_c, lse_c = attend(q[a:b], kv, window_indices(starts[a:b], ends[a:b], multiple=128))
                if out is None:  # [T, H, d_v] and [T, H], filled chunk by chunk
                    out = out_c.new_empty((q.shape[0], *out_c.shape[1:]))
                    lse = lse_c.new_empty((q.shape[0], *lse_c.shape[1:]))
                out[a:b], lse[a:b] = out_c, lse_c
        ctx.save_for_backward(q, kv, starts, ends)
        ctx.chunks, ctx.attend = chunks, attend
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, kv, starts, ends = ctx.saved_tensors
        need_q, need_kv = ctx.needs_input_grad[:2]
        dq = torch.zeros_like(q) if need_q else None
        dkv = torch.zeros(kv.shape, dtype=torch.float32 if kv.dtype != torch.float64 else kv.dtype,
                          device=kv.device) if need_kv else None
        kv_leaf = kv.detach().requires_grad_(need_kv)
        for a, b in ctx.chunks:
            q_leaf = q[a:b].detach().requires_grad_(need_q)
            with torch.enable_grad():  # recompute this chunk's attention, then differentiate it
                out, lse = ctx.attend(q_leaf, kv_leaf, window_indices(starts[a:b], ends[a:b], multiple=128))
            outputs, grads = [out], [d_out[a:b] if d_out is not None else torch.zeros_like(out)]
            if d_lse is not None:
                outputs.append(lse)
                grads.append(d_lse[a:b])
            leaves = [x for x, n in ((q_leaf, need_q), (kv_leaf, need_kv)) if n]
            got = iter(torch.autograd.grad(outputs, leaves, grads, allow_unused=True))
            if need_q:
                g = next(got)
                if g is not None:
                    dq[a:b] = g
            if need_kv:
                g = next(got)
                if g is not None:
                    dkv += g
        return dq, None if dkv is None else dkv.to(kv.dtype), None, None, None, None


def windowed_attention_on_slots(q: torch.Tensor, kv: torch.Tensor, *, sm_scale: float, d_v: int,
                                starts: torch.Tensor, ends: torch.Tensor, ops: SlotOps,
                                query_chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention over each window as sparse attention over its window slots, in query chunks.

    ``ops.sparse_mla`` over `window_indices` (``[C, W]`` slots) for ``C`` queries at a time, so the
    slots of all queries, ``[T, W]``, never exist at once; with more than one chunk, the backward
    recomputes each chunk's forward before differentiating it (only ``q, kv`` are kept).

    Args:
        q: ``[T, H, D]``; kv: ``[S, D]``; sm_scale, d_v: as in `dsa_ref.sparse_mla`.
        starts, ends: int ``[T]`` key windows.
        ops: the `SlotOps` whose ``sparse_mla`` runs each chunk.
        query_chunk: rows per chunk; default: ``C * W`` at most ``KERNEL_SCORE_ELEMENTS``.

    Returns:
        ``(out [T, H, d_v], lse [T, H])`` as `dense_mla_attention` returns them.
    """
    T = q.shape[0]
    width = int((ends - starts).clamp_min(0).max()) if T else 0
    chunk = check_positive_int("query_chunk", query_chunk or max(1, KERNEL_SCORE_ELEMENTS // max(width, 1)))

    def attend(q_c, kv_, slots):
        return ops.sparse_mla(q_c, kv_, slots, sm_scale=sm_scale, d_v=d_v)

    if chunk >= T:  # one chunk: autograd keeps its slots, no recomputation
        return attend(q, kv, window_indices(starts, ends, multiple=128))
    return _ChunkedSlotAttention.apply(q, kv, starts, ends, row_chunks(T, chunk), attend)
# --8<-- [end:windowed_attention_on_slots]
