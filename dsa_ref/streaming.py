r"""Chapter 7: streamed top-k selection -- the indexer's top-k without ever holding ``[T, S]`` scores.

`topk_indices(lightning_indexer(q, k, w))` first writes every index score, ``[T, S]`` floats, and
then keeps ``k`` of each row. At 128K tokens that matrix is 64 GiB. The selection needs none of it
at once: each row's top-k can be *merged* tile by tile.

**Query chunks.** Rows are independent, so the queries are taken ``C`` at a time; a chunk only
needs the keys its windows cover, ``[min start, max end)`` (for causal attention, the keys up to
its last query), so its scores are ``[C, <= S]``.

**Key tiles and the running top-k.** Inside a chunk the keys are scored one tile
``[lo, hi)`` at a time. Each row keeps its best ``k`` so far, ``(values, indices)`` ``[C, k]``,
highest first and equal values in ascending key order. A new tile is appended behind them and the
``k + tile`` candidates are sorted again with a *stable* descending sort:

* every key of the running set has a lower index than every key of the tile (tiles come in key
  order), and inside each part equal values are already in ascending index order, so the stable
  sort puts equal values in ascending index order overall -- **ties go to the lower key index
  across tiles**, exactly as `topk_indices` decides them on the whole row;
* ``-inf`` (outside the window) sorts last and is turned into ``-1`` at the end, so ``-inf`` keys
  are never selected and a row with fewer than ``k`` selectable keys is padded with ``-1``.

A tile is scored by `lightning_indexer` on *all* its keys (one product, no windows) and then masked
to each row's window with ``torch.where`` (``-inf`` outside). A score involves one key only, so a
key outside a row's window -- garbage included -- stays in its own masked column. The result
equals ``topk_indices(lightning_indexer(...))`` index for index: the same scores, the same rule.
Memory: ``O(T k + C (k + tile) + C H_I tile)``.

**The fast path** (`dsa_ref.kernels.chunk_selector`) shares the query chunking and the key range
of each chunk and replaces the per-chunk work with two kernels: the TileLang indexer writes the
chunk's ``[C, hi - lo]`` scores and the radix-select kernel reduces them to ``[C, k]``. The driver
below is the same for both (`streamed_topk_indices` with ``chunk_selector``); the tests run it on the
CPU with the readable functions in the kernels' place.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._checks import check_positive_int, check_same_device, check_windows
from .attention import DEFAULT_CHUNK_ELEMENTS
from .indexer import _check_indexer_operands, lightning_indexer

__all__ = ["merge_topk", "tiled_select", "streamed_topk_indices", "row_chunks", "chunk_key_ranges", "shift_windows",
           "DEFAULT_KEY_TILE", "KERNEL_SCORE_ELEMENTS"]

#: Keys per tile of the readable selection (and of the readable streamed loss).
DEFAULT_KEY_TILE = 4096
#: Elements of one chunk's ``[C, S]`` fp32 scores on the kernel path (1 GiB): 16K x 16K is one chunk.
KERNEL_SCORE_ELEMENTS = 2**28


def row_chunks(num_rows: int, chunk: int) -> list[tuple[int, int]]:
    """``[(lo, hi), ...]``: consecutive row ranges of at most ``chunk`` rows covering ``num_rows``."""
    return [(lo, min(lo + chunk, num_rows)) for lo in range(0, num_rows, chunk)]


def shift_windows(starts: torch.Tensor, ends: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The windows inside keys ``[lo, hi)``, in that range's own index space (``0 .. hi - lo``).

    ``[starts - lo, ends - lo)`` clipped to ``[0, hi - lo)``; a window that misses the range is empty.
    """
    range_starts = (starts - lo).clamp(0, hi - lo)  # [C]
    range_ends = torch.maximum((ends - lo).clamp(0, hi - lo), range_starts)  # [C]
    return range_starts, range_ends


# --8<-- [start:chunk_key_ranges]
def chunk_key_ranges(starts: torch.Tensor, ends: torch.Tensor, chunks: list[tuple[int, int]]
                     ) -> list[tuple[int, int]]:
    """The keys each row chunk can see: ``(min start, max end)`` over its rows with a non-empty window.

    ``(0, 0)`` for a chunk whose windows are all empty. One read back to the host for all chunks.
    """
    if not chunks:
        return []
    nonempty = ends > starts  # [T]
    big = torch.iinfo(torch.int64).max
    lo = torch.where(nonempty, starts, torch.full_like(starts, big))  # [T]
    hi = torch.where(nonempty, ends, torch.zeros_like(ends))  # [T]
    bounds = torch.stack([torch.stack([lo[a:b].min(), hi[a:b].max()]) for a, b in chunks]).tolist()  # [chunks, 2]
    return [(0, 0) if h == 0 else (int(lo_), int(h)) for lo_, h in bounds]
# --8<-- [end:chunk_key_ranges]


# --8<-- [start:merge_topk]
def merge_topk(best_values: torch.Tensor, best_indices: torch.Tensor, tile_scores: torch.Tensor,
               offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge one key tile into each row's running top-k.

    Args:
        best_values: ``[C, k]`` the running top-k scores, highest first, equal scores in ascending
            key order (``-inf`` for slots not filled yet).
        best_indices: int64 ``[C, k]`` their key indices, all lower than ``offset``.
        tile_scores: ``[C, n]`` the scores of keys ``offset ... offset + n - 1`` (``-inf`` = not selectable).
        offset: the key index of the tile's first column.

    Returns:
        the new ``(best_values, best_indices)``, ``[C, k]`` each, in the same order.
    """
    k = best_values.shape[1]
    tile_keys = torch.arange(offset, offset + tile_scores.shape[1], device=tile_scores.device)  # [n]
    values = torch.cat([best_values, tile_scores.to(best_values.dtype)], dim=1)  # [C, k + n]
    keys = torch.cat([best_indices, tile_keys.expand(tile_scores.shape[0], -1)], dim=1)  # [C, k + n]
    # stable: equal scores keep their order, running set (lower keys) first, then the tile in key order
    values, order = torch.sort(values, dim=1, descending=True, stable=True)  # [C, k + n]
    return values[:, :k], keys.gather(1, order[:, :k])
# --8<-- [end:merge_topk]


# --8<-- [start:tiled_select]
def tiled_select(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int, *,
                 starts: torch.Tensor, ends: torch.Tensor, relu: bool = True,
                 key_tile: int = DEFAULT_KEY_TILE) -> torch.Tensor:
    """The top-k of some query rows, scoring their keys one tile at a time (the readable selector).

    Args:
        q: ``[C, H_I, D_I]``, k: ``[n, D_I]``, weights: ``[C, H_I]`` as in `lightning_indexer`.
        topk: slots per row.
        starts, ends: int ``[C]`` windows in ``k``'s index space.
        relu: the indexer's ReLU.
        key_tile: keys per tile.

    Returns:
        int64 ``[C, topk]``: `topk_indices` of `lightning_indexer` of the same inputs.
    """
    C, n = q.shape[0], k.shape[0]
    acc = torch.float64 if torch.float64 in (q.dtype, k.dtype, weights.dtype) else torch.float32
    best_values = torch.full((C, topk), float("-inf"), dtype=acc, device=q.device)  # [C, topk]
    best_indices = torch.full((C, topk), -1, dtype=torch.int64, device=q.device)  # [C, topk]
    any_nan = torch.zeros((), dtype=torch.bool, device=q.device)
    for lo in range(0, n, key_tile):
        hi = min(lo + key_tile, n)
        scores = lightning_indexer(q, k[lo:hi], weights, relu=relu)  # [C, hi - lo], every key of the tile
        key = torch.arange(lo, hi, device=q.device)  # [hi - lo]
        inside = (key[None, :] >= starts[:, None]) & (key[None, :] < ends[:, None])  # [C, hi - lo]
        scores = torch.where(inside, scores, torch.full((), float("-inf"), dtype=scores.dtype, device=q.device))
        any_nan = any_nan | torch.isnan(scores).any()
        best_values, best_indices = merge_topk(best_values, best_indices, scores, lo)
    if bool(any_nan):
        raise ValueError("index scores contain NaN; the indexer's inputs hold NaN or Inf")
    return torch.where(best_values > float("-inf"), best_indices, torch.full_like(best_indices, -1))
# --8<-- [end:tiled_select]


def checked_windows(starts: torch.Tensor | None, ends: torch.Tensor | None, num_queries: int, num_keys: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`check_windows`, with ``None`` (no mask) spelled out as every key: int64 ``[T]`` starts and ends."""
    windows = check_windows(starts, ends, num_queries, num_keys)
    if windows is not None:
        return windows
    return (torch.zeros(num_queries, dtype=torch.int64, device=device),
            torch.full((num_queries,), num_keys, dtype=torch.int64, device=device))


# --8<-- [start:streamed_topk_indices]
@torch.no_grad()
def streamed_topk_indices(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int, *,
                          starts: torch.Tensor | None = None, ends: torch.Tensor | None = None,
                          relu: bool = True, query_chunk: int | None = None, key_tile: int | None = None,
                          chunk_selector: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """``topk_indices(lightning_indexer(q, k, weights, ...), topk)`` without the ``[T, S]`` scores.

    Args:
        q: ``[T, H_I, D_I]`` indexer queries; k: ``[S, D_I]`` indexer keys; weights: ``[T, H_I]``.
        topk: slots per row (>= 1; may exceed ``S``).
        starts, ends: int ``[T]`` key windows; both ``None`` = every key.
        relu: the indexer's ReLU.
        query_chunk: rows per chunk; default: as many as keep the chunk's work at about
            ``2**26`` elements (readable selector) or its ``[C, S]`` scores at `KERNEL_SCORE_ELEMENTS`
            (a given ``chunk_selector``).
        key_tile: keys per tile of the readable selector (default `DEFAULT_KEY_TILE`).
        chunk_selector: ``chunk_selector(q_c, k_range, w_c, topk, starts=, ends=, relu=) -> [C, topk]``, the
            top-k of a chunk of rows over a range of keys (indices in the range's own index space);
            default the readable `tiled_select`. `dsa_ref.kernels.chunk_selector` gives the kernels'.

    Returns:
        int64 ``[T, topk]``: highest score first, ties to the lower key index, ``-1`` padding at the end.
        No gradient.
    """
    T, H = _check_indexer_operands(q, k, weights)
    check_same_device(q=q, k=k, weights=weights, starts=starts, ends=ends)
    topk = check_positive_int("topk", topk)
    S = k.shape[0]
    starts, ends = checked_windows(starts, ends, T, S, q.device)
    if chunk_selector is None:
        key_tile = DEFAULT_KEY_TILE if key_tile is None else check_positive_int("key_tile", key_tile)
        chunk_selector = lambda *a, **kw: tiled_select(*a, **kw, key_tile=key_tile)  # noqa: E731
        per_row = H * min(key_tile, max(S, 1))  # the [C, H_I, tile] logits of one tile
        chunk = query_chunk or max(1, DEFAULT_CHUNK_ELEMENTS // per_row)
    else:
        chunk = query_chunk or max(1, KERNEL_SCORE_ELEMENTS // max(S, 1))
    chunk = check_positive_int("query_chunk", chunk)

    out = torch.full((T, topk), -1, dtype=torch.int64, device=q.device)  # [T, topk]
    chunks = row_chunks(T, chunk)
    for (a, b), (lo, hi) in zip(chunks, chunk_key_ranges(starts, ends, chunks)):
        if hi <= lo:
            continue  # every window of the chunk is empty: all -1
        # only keys [lo, hi) can be selected; index them from lo, then shift back
        range_starts, range_ends = shift_windows(starts[a:b], ends[a:b], lo, hi)  # [C] each
        local = chunk_selector(q[a:b], k[lo:hi], weights[a:b], topk, starts=range_starts, ends=range_ends,
                            relu=relu)  # [C, topk]
        out[a:b] = torch.where(local >= 0, local + lo, local)
    return out
# --8<-- [end:streamed_topk_indices]
