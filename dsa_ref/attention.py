r"""Softmax attention over key windows, with its log-sum-exp, chunked over queries.

This is the attention core every chapter shares. For query ``t`` and head ``h``:

$$
\mathrm{lse}_{t,h} = \log \sum_{s \in W_t} e^{\,\sigma\, q_{t,h} \cdot k_s}, \qquad
o_{t,h} = \sum_{s \in W_t} e^{\,\sigma\, q_{t,h} \cdot k_s - \mathrm{lse}_{t,h}}\; v_s
$$

where ``W_t = [starts[t], ends[t])`` is t's key window and ``sigma`` the softmax scale. A row with an
empty window has ``o = 0`` and ``lse = -inf``, and produces no NaN in forward or backward.

Memory: the scores of all heads for all queries, ``[T, H, S]``, are never held at once. Queries are
processed in chunks, and each chunk runs under activation checkpointing, so autograd keeps only
the chunk's inputs and recomputes its ``[chunk, H, S]`` scores in backward.

**Unread memory never reaches a result.** A key outside a query's window may hold anything (NaN,
Inf, the rest of a KV cache): the query's output, its LSE and every gradient are exactly what they
are with that key zeroed, and the key's own gradient is exactly 0. Masking the *scores* is not
enough for that: a probability of 0 times a NaN value is NaN, in forward and in backward. So keys
that are not ordinary numbers (`ordinary_rows`: NaN, Inf, huge) are first zeroed by *selection*
(``torch.where``); then a masked probability is exactly 0 and so is its product with any key left,
and one masked product per chunk is exact for every query that does not read garbage. The queries
whose windows do hold garbage get it through a path that gathers each query's keys with
``torch.where`` (`split_window_keys`, `select_rows`), so their arithmetic never touches a key
outside their own window either.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch.utils.checkpoint import checkpoint

from ._checks import (
    accumulation_dtype,
    check_dim,
    check_float,
    check_int,
    check_rank,
    check_same_device,
    check_scale,
    check_windows,
)

def check_latent_operands(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """The input checks every absorbed-MLA attention shares; returns ``kv`` as ``[S, D]``.

    ``q`` must be a float ``[T, H, D]`` and ``kv`` a float ``[S, D]`` (``[S, 1, D]``, one latent KV
    head, is accepted) of the same width ``D``.
    """
    check_float("q", q)
    check_float("kv", kv)
    check_rank("q", q, 3, "[T, H, D]")
    if kv.dim() == 3:
        check_dim("kv", kv, 1, 1, "one latent KV head; [S, 1, D] is accepted")
        kv = kv[:, 0]  # [S, D]
    check_rank("kv", kv, 2, "[S, D] or [S, 1, D]")
    check_dim("kv", kv, 1, q.shape[-1], "q's head dim")
    return kv


def check_value_width(d_v, kv: torch.Tensor) -> int:
    """``d_v``, the value width taken from the front of each latent row: an int in ``[1, D]``."""
    if isinstance(d_v, bool) or not isinstance(d_v, int) or not 1 <= d_v <= kv.shape[-1]:
        raise ValueError(f"d_v must be an int in [1, D={kv.shape[-1]}], got {d_v!r}")
    return d_v


#: Elements of the largest intermediate (e.g. a ``[chunk, H, S]`` score block) a chunk may hold.
DEFAULT_CHUNK_ELEMENTS = 2**26


def auto_chunk_size(num_rows: int, elements_per_row: int, chunk_size: int | None = None,
                    budget: int = DEFAULT_CHUNK_ELEMENTS) -> int:
    """Rows per chunk: ``chunk_size`` if given, else as many rows as fit in ``budget`` elements."""
    if chunk_size is not None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be an int >= 1 or None, got {chunk_size!r}")
        return chunk_size
    return max(1, min(max(num_rows, 1), budget // max(elements_per_row, 1)))


def chunk_bounds(num_rows: int, chunk: int, breaks: Sequence[int] = ()) -> list[tuple[int, int]]:
    """Consecutive ``(lo, hi)`` row ranges of at most ``chunk`` rows; a new range also starts at every break.

    ``num_rows = 0`` gives one empty range, so functions still return correctly shaped empty results.
    """
    cuts = sorted({0, num_rows, *(b for b in breaks if 0 < b < num_rows)})
    bounds = []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        bounds += [(a, min(a + chunk, hi)) for a in range(lo, hi, chunk)]
    return bounds or [(0, 0)]


def run_chunked(fn: Callable[..., tuple[torch.Tensor, ...]], num_rows: int, chunk: int,
                row_args: tuple[torch.Tensor | None, ...], shared_args: tuple[torch.Tensor, ...],
                breaks: Sequence[int] = ()) -> tuple[torch.Tensor, ...]:
    """Apply ``fn(*row_chunk, *shared)`` to consecutive row chunks and concatenate the results.

    ``row_args`` are sliced along dim 0 (``None`` stays ``None``); ``shared_args`` are passed whole.
    Chunks hold at most ``chunk`` rows and also begin at every row in ``breaks`` (`chunk_bounds`).
    When autograd is recording, each chunk runs under non-reentrant activation checkpointing, so its
    intermediates are recomputed in backward instead of being kept for all chunks at once.
    """
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (*row_args, *shared_args)
    )
    bounds = chunk_bounds(num_rows, chunk, breaks)
    outs = []
    for lo, hi in bounds:
        args = tuple(None if t is None else t[lo:hi] for t in row_args) + tuple(shared_args)
        if needs_grad and len(bounds) > 1:
            outs.append(checkpoint(fn, *args, use_reentrant=False))
        else:
            outs.append(fn(*args))
    return tuple(torch.cat(parts, dim=0) for parts in zip(*outs))


# --8<-- [start:select_rows]
def select_rows(x: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``x[idx]`` where ``valid``, exact zeros elsewhere: ``[S, *F]`` by ``[R, K]`` -> ``[R, K, *F]``.

    The one way the reference reads rows by index. An invalid slot (a ``-1``, a key outside the
    window) reads row 0 as a placeholder and then gets zeros by *selection*, so whatever row 0 or
    any unselected row holds (NaN, Inf) never reaches a result, and the gradient of an unselected
    row is exactly 0. ``S = 0`` is allowed (every slot must then be invalid).

    Args:
        x: ``[S, *F]`` rows (keys, latent rows, values).
        idx: int ``[R, K]`` row numbers; only the ``valid`` ones need to lie in ``[0, S)``.
        valid: bool ``[R, K]``.
    """
    if x.shape[0] == 0:  # no rows at all: read one zero row instead, so the graph still reaches x
        x = torch.cat([x, x.new_zeros((1, *x.shape[1:]))])  # [1, *F]
    picked = x[torch.where(valid, idx, torch.zeros_like(idx))]  # [R, K, *F]; invalid slots read row 0 ...
    keep = valid.view(*valid.shape, *([1] * (x.dim() - 1)))  # [R, K, 1, ...]
    return torch.where(keep, picked, torch.zeros((), dtype=x.dtype, device=x.device))  # ... and get zeros
# --8<-- [end:select_rows]


class WindowKeys(NamedTuple):
    """How a chunk of queries reads the keys of its windows (`split_window_keys`).

    Attributes:
        common: the keys inside *every* query's window of the chunk, read as they are.
        ragged: int64 ``[R]``, the other keys inside *some* query's window of the chunk.
        ragged_valid: bool ``[C, R]``, which query's window holds each ragged key.
    """

    common: slice
    ragged: torch.Tensor
    ragged_valid: torch.Tensor

    def select(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` (``[S, *F]``, one row per key) as ``(x[common] [L, *F], ragged rows [C, R, *F])``;
        a ragged row outside a query's window is exact zeros for that query (`select_rows`)."""
        idx = self.ragged[None, :].expand(self.ragged_valid.shape[0], -1)  # [C, R]
        return x[self.common], select_rows(x, idx, self.ragged_valid)

    @property
    def keys(self) -> torch.Tensor:
        """int64 ``[L + R]``: the key each column of ``cat([common, ragged])`` stands for."""
        common = torch.arange(self.common.start, self.common.stop, device=self.ragged.device)  # [L]
        return torch.cat([common, self.ragged])

    @property
    def valid(self) -> torch.Tensor:
        """bool ``[C, L + R]``: whether each column is inside each query's window."""
        C, L = self.ragged_valid.shape[0], self.common.stop - self.common.start
        every = torch.ones(C, L, dtype=torch.bool, device=self.ragged_valid.device)  # [C, L]
        return torch.cat([every, self.ragged_valid], dim=1)


# --8<-- [start:split_window_keys]
def split_window_keys(starts: torch.Tensor, ends: torch.Tensor) -> WindowKeys:
    """Split the keys a chunk of queries reads into those all of them see and the ragged rest.

    Keys in ``[max(starts), min(ends))`` are in every window of the chunk: a plain matrix product
    reads them. The other keys of ``[min(starts), max(ends))`` are in some windows only; they are
    gathered per query and zeroed by selection where a window does not hold them. For causal
    queries of one sequence, the ragged keys are the chunk's own diagonal block (fewer than
    ``C``); keys outside ``[min(starts), max(ends))`` are never touched.

    Args:
        starts, ends: int64 ``[C]`` the chunk's key windows.
    """
    if starts.numel() == 0:  # an empty chunk reads nothing
        nothing = torch.zeros(0, dtype=torch.int64, device=starts.device)
        return WindowKeys(slice(0, 0), nothing, torch.zeros(0, 0, dtype=torch.bool, device=starts.device))
    lo, hi, all_from, all_to = torch.stack([starts.min(), ends.max(), starts.max(), ends.min()]).tolist()
    if all_from >= all_to:  # no key is in every window
        all_from = all_to = lo
    device = starts.device
    ragged = torch.cat([torch.arange(lo, all_from, device=device),
                        torch.arange(all_to, max(hi, all_to), device=device)])  # [R]
    ragged_valid = (ragged[None, :] >= starts[:, None]) & (ragged[None, :] < ends[:, None])  # [C, R]
    return WindowKeys(slice(all_from, all_to), ragged, ragged_valid)
# --8<-- [end:split_window_keys]


def window_breaks(starts: torch.Tensor | None) -> list[int]:
    """Rows where the window start changes (new packed sequences): chunks begin there, so that a
    chunk's ragged keys stay few (`split_window_keys`). One read of ``starts`` to the host."""
    if starts is None or starts.numel() < 2:
        return []
    return (torch.nonzero(starts[1:] != starts[:-1]).flatten() + 1).tolist()


def masked_softmax_with_lse(scores: torch.Tensor, valid: torch.Tensor | None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the last dim restricted to ``valid`` entries, and its log-sum-exp.

    Args:
        scores: float ``[..., K]`` (already scaled).
        valid: bool, broadcastable to ``scores``; ``None`` means every entry is valid.

    Returns:
        ``(probs [..., K], lse [...])``. Invalid entries get probability 0; a row with no valid entry
        gets all-zero probabilities and ``lse = -inf``; gradients stay finite (no ``0 * inf``). A NaN
        score at a valid entry makes its row's probabilities and ``lse`` NaN (it is not taken for an
        empty row); NaN at invalid entries changes nothing.
    """
    if valid is not None:
        scores = scores.masked_fill(~valid, float("-inf"))
    # subtracting the row max (a constant, hence detached) changes nothing but avoids overflow
    if scores.shape[-1] == 0:  # no keys at all: every row is empty (amax of nothing is undefined)
        row_max = scores.new_zeros(scores.shape[:-1] + (1,))
    else:
        row_max = scores.amax(dim=-1, keepdim=True).detach()  # [..., 1]
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    unnormalised = torch.exp(scores - row_max)  # [..., K], exactly 0 where invalid
    total = unnormalised.sum(dim=-1, keepdim=True)  # [..., 1]
    empty = total == 0  # no valid entry; a NaN score among the valid ones is no emptiness: it stays NaN
    safe_total = torch.where(empty, torch.ones_like(total), total)  # log/divide only where defined
    probs = unnormalised / safe_total  # [..., K]
    lse = torch.where(empty, torch.full_like(total, float("-inf")), row_max + torch.log(safe_total))
    return probs, lse.squeeze(-1)


def windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sm_scale: float,
                       starts: torch.Tensor | None = None, ends: torch.Tensor | None = None,
                       chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of every query over the keys of its window (MHA or MQA).

    Args:
        q: ``[T, H, D]`` queries.
        k: ``[S, H, D]`` (one key per head, MHA) or ``[S, D]`` (one key shared by all heads, MQA).
        v: ``[S, H, D_v]`` or ``[S, D_v]``, matching ``k``.
        sm_scale: softmax scale (always explicit; see `dsa_ref.config.MLAConfig.softmax_scale`).
        starts, ends: int ``[T]`` key windows in the keys' index space; both ``None`` = no mask.
        chunk_size: queries per chunk; ``None`` picks one that bounds the score block.

    Returns:
        ``(out, lse)``: ``out [T, H, D_v]`` in q's dtype (accumulated in float32, float64 for
        float64 inputs) and ``lse [T, H]`` (natural log) in the accumulation dtype.
    """
    check_float("q", q)
    check_float("k", k)
    check_float("v", v)
    check_rank("q", q, 3, "[T, H, D]")
    check_rank("k", k, (2, 3), "[S, D] or [S, H, D]")
    check_rank("v", v, k.dim(), "[S, D_v]" if k.dim() == 2 else "[S, H, D_v]")
    check_same_device(q=q, k=k, v=v, starts=starts, ends=ends)
    T, H, D = q.shape
    check_dim("k", k, -1, D, "q's head dim")
    check_dim("v", v, 0, k.shape[0], "one value per key")
    if k.dim() == 3:
        check_dim("k", k, 1, H, "q's heads")
        check_dim("v", v, 1, H, "q's heads")
    sm_scale = check_scale("sm_scale", sm_scale)
    windows = check_windows(starts, ends, T, k.shape[0])
    starts, ends = windows if windows is not None else (None, None)

    acc = accumulation_dtype(q)
    S = k.shape[0]
    mha = k.dim() == 3
    chunk = auto_chunk_size(T, H * S, chunk_size)
    plain = _plain_attend(acc, sm_scale, mha, q.dtype)
    if starts is None:  # no mask: every query reads every key
        return run_chunked(plain, T, chunk, (q, None, None), (k, v))
    # Keys that are not ordinary numbers (NaN, Inf, huge: garbage) are zeroed by selection first, so
    # one masked product per chunk is exact for every query that does not read them: a masked
    # probability is exactly 0 and so is its product with an ordinary key (no 0 * NaN).
    bad = ~(ordinary_rows(k) & ordinary_rows(v))  # [S]
    if not bool(bad.any()):
        return run_chunked(plain, T, chunk, (q, starts, ends), (k, v))
    keep = ~bad.view(-1, *([1] * (k.dim() - 1)))  # [S, 1(, 1)]
    zero = torch.zeros((), dtype=k.dtype, device=k.device)
    out, lse = run_chunked(plain, T, chunk, (q, starts, ends), (torch.where(keep, k, zero), torch.where(keep, v, zero)))
    # The queries that read a garbage key get it, exactly: their windows' keys are gathered per query.
    readers = _reads_any(bad, starts, ends).nonzero().flatten()  # [R]
    if readers.numel():
        per_key = (H if mha else 1) * (k.shape[-1] + v.shape[-1])
        chunk_r = chunk if chunk_size is not None else min(
            chunk, max(64, 4 * H * S // per_key), max(1, int((DEFAULT_CHUNK_ELEMENTS / per_key) ** 0.5)))
        r_starts, r_ends = starts[readers], ends[readers]
        out_r, lse_r = run_chunked(_selecting_attend(acc, sm_scale, mha, q.dtype), readers.numel(), chunk_r,
                                   (q[readers], r_starts, r_ends), (k, v), breaks=window_breaks(r_starts))
        out, lse = out.index_put((readers,), out_r), lse.index_put((readers,), lse_r)
    return out, lse


def ordinary_rows(x: torch.Tensor) -> torch.Tensor:
    """Bool ``[S]``: rows of ``x [S, ...]`` whose entries are all finite and at most `ORDINARY_MAX` in magnitude.

    For such keys and values a masked probability (exactly 0) times the key or value is exactly 0,
    in forward and in backward, so a masked matrix product equals the product with the masked keys
    zeroed, bit for bit. Garbage (NaN, Inf, 1e30) is not ordinary.
    """
    flat = x.flatten(1) if x.dim() > 1 else x[:, None]  # [S, F]
    if flat.shape[0] == 0 or flat.shape[1] == 0:
        return torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
    return torch.isfinite(flat).all(dim=1) & (flat.abs().amax(dim=1) <= ORDINARY_MAX)


def _reads_any(rows: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Bool ``[T]``: whether window ``[starts[t], ends[t])`` holds any of the marked ``rows [S]``."""
    count = torch.cat([rows.new_zeros(1, dtype=torch.int64), rows.long().cumsum(0)])  # [S + 1]
    lo, hi = starts.clamp(0, rows.numel()), ends.clamp(0, rows.numel())
    return count[torch.maximum(hi, lo)] - count[lo] > 0  # an empty window (hi <= lo) reads nothing


def _selecting_attend(acc: torch.dtype, sm_scale: float, mha: bool, out_dtype: torch.dtype):
    """A chunk of windowed attention that selects each query's keys with ``where`` (any key values)."""

    def attend(q_c, starts_c, ends_c, k_, v_):
        q_c, k_, v_ = q_c.to(acc), k_.to(acc), v_.to(acc)
        keys = split_window_keys(starts_c, ends_c)
        k_common, k_ragged = keys.select(k_)  # [L, (H,) D], [C, R, (H,) D]
        v_common, v_ragged = keys.select(v_)  # [L, (H,) D_v], [C, R, (H,) D_v]
        scores = torch.cat([
            torch.einsum("thd,shd->ths" if mha else "thd,sd->ths", q_c, k_common),  # [C, H, L]
            torch.einsum("thd,trhd->thr" if mha else "thd,trd->thr", q_c, k_ragged),  # [C, H, R]
        ], dim=-1) * sm_scale  # [C, H, L + R]
        probs, lse = masked_softmax_with_lse(scores, keys.valid[:, None, :])  # [C, H, L + R], [C, H]
        p_common, p_ragged = probs.split([k_common.shape[0], k_ragged.shape[1]], dim=-1)
        out = (torch.einsum("ths,shv->thv" if mha else "ths,sv->thv", p_common, v_common)
               + torch.einsum("thr,trhv->thv" if mha else "thr,trv->thv", p_ragged, v_ragged))  # [C, H, D_v]
        return out.to(out_dtype), lse

    return attend


#: Largest magnitude `ordinary_rows` accepts: products of such values with the other operands of an
#: attention (and their gradients) stay far from float32's overflow at 3.4e38.
ORDINARY_MAX = 2.0**64


def window_span(starts: torch.Tensor, ends: torch.Tensor) -> tuple[int, int]:
    """``(lo, hi)``: the keys that int ``[C]`` windows cover, min start to max end over the non-empty ones.

    ``(0, 0)`` when every window is empty. One read back to the host.
    """
    for name, w in (("starts", starts), ("ends", ends)):
        check_int(name, w)
        check_rank(name, w, 1, "[C]")
    check_dim("ends", ends, 0, starts.shape[0], "one window end per start")
    nonempty = ends > starts  # [C]
    if not bool(nonempty.any()):
        return 0, 0
    return int(starts[nonempty].min()), int(ends[nonempty].max())


def _plain_attend(acc: torch.dtype, sm_scale: float, mha: bool, out_dtype: torch.dtype):
    """A chunk of windowed attention as one masked product over the keys its windows cover (ordinary
    keys only): the keys outside every window of the chunk would get probability 0, so they are left out."""

    def attend(q_c, starts_c, ends_c, k_, v_):
        if starts_c is not None:  # only the keys the chunk's windows cover (causal: up to its last query)
            lo, hi = window_span(starts_c, ends_c)
            k_, v_ = k_[lo:hi], v_[lo:hi]  # [S', (H,) D], [S', (H,) D_v]
            starts_c, ends_c = starts_c - lo, ends_c - lo  # an empty window stays empty
        q_c, k_, v_ = q_c.to(acc), k_.to(acc), v_.to(acc)
        scores = torch.einsum("thd,shd->ths" if mha else "thd,sd->ths", q_c, k_) * sm_scale  # [C, H, S']
        valid = None
        if starts_c is not None:
            key = torch.arange(k_.shape[0], device=q_c.device)  # [S']
            valid = ((key[None, :] >= starts_c[:, None]) & (key[None, :] < ends_c[:, None]))[:, None, :]  # [C, 1, S']
        probs, lse = masked_softmax_with_lse(scores, valid)  # [C, H, S'], [C, H]
        out = torch.einsum("ths,shv->thv" if mha else "ths,sv->thv", probs, v_)  # [C, H, D_v]
        return out.to(out_dtype), lse

    return attend


def dense_mla_attention(q: torch.Tensor, kv: torch.Tensor, *, sm_scale: float, d_v: int = 512,
                        starts: torch.Tensor | None = None, ends: torch.Tensor | None = None,
                        chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed-MLA attention over every key in the window: MQA over one latent KV head.

    The keys are the latent rows ``kv`` (``[c_kv ; k_pe]``, 576 wide in DeepSeek-V3.2) and the
    values are their first ``d_v`` channels (the latent ``c_kv``). `dsa_ref.sparse_mla` with every
    window key selected must equal this.

    Args:
        q: ``[T, H, D]`` absorbed queries ``[q_nope @ W_UK ; q_pe]``.
        kv: ``[S, D]`` latent rows (``[S, 1, D]`` accepted).
        sm_scale: softmax scale; DeepSeek-V3.2 keeps ``192 ** -0.5 * mscale ** 2`` here, not ``576 ** -0.5``.
        d_v: value width, the first ``d_v`` channels of ``kv`` (DeepSeek-V3.2: 512).
        starts, ends: int ``[T]`` key windows; both ``None`` = every key visible (nothing is causal by default).
        chunk_size: queries per chunk (memory bound only; the result does not depend on it).

    Returns:
        ``(out [T, H, d_v]`` in q's dtype, ``lse [T, H]`` float32, float64 for float64 inputs``)``.
    """
    kv = check_latent_operands(q, kv)  # [S, D]
    check_value_width(d_v, kv)
    return windowed_attention(q, kv, kv[:, :d_v], sm_scale=sm_scale, starts=starts, ends=ends,
                              chunk_size=chunk_size)
