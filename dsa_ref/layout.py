"""The token layout every mask in dsa_ref comes from.

All tensors are packed ("THD"): the tokens of several sequences are concatenated along one token
dim, and ``cu_seqlens = [0, L0, L0+L1, ...]`` marks where each sequence starts. A padded batch
``[B, S, ...]`` is the special case ``cu_seqlens = [0, S, 2S, ..., BS]``.

Every mask -- causal, packed, context parallel, both at once -- is one rule: query ``t`` may attend
to key ``s`` iff ``starts[t] <= s < ends[t]``, its **key window**, in the index space of the keys
given. For causal packed sequences with keys in global packed order, ``starts[t]`` is the first
token of t's sequence and ``ends[t]`` is t's own global index + 1 (the diagonal is included).

A context-parallel rank holds only some queries but attends over all keys, so it passes the global
packed index of each of its queries (``query_index``) and gets the same windows as the full run.
"""

from __future__ import annotations

import torch

from ._checks import check_int, check_nonnegative_int, check_rank, check_tensor


def check_cu_seqlens(cu_seqlens: torch.Tensor, name: str = "cu_seqlens") -> torch.Tensor:
    """Validate ``cu_seqlens`` and return it as int64.

    It must be a 1-D integer tensor with at least two entries, starting at 0 and non-decreasing
    (zero-length sequences are allowed). One read back to the host (a device sync on the GPU).
    """
    cu, _, _ = _read_layout(cu_seqlens, None, name)
    return cu


def checked_layout(cu_seqlens: torch.Tensor, query_index: torch.Tensor | None = None, *,
                   name: str = "cu_seqlens") -> tuple[torch.Tensor, torch.Tensor, int]:
    """`check_cu_seqlens` and the check of ``query_index`` with **one** read back to the host.

    A layer step reads its layout once: every check of ``cu_seqlens`` and of the queries' indices is
    one small tensor brought back together, so the GPU is not left idle once per check.

    Args:
        cu_seqlens: int ``[num_seqs + 1]``.
        query_index: optional int ``[T_q]`` global packed indices; default all ``T`` tokens in order.

    Returns:
        ``(cu, idx, T)``: ``cu_seqlens`` as int64, ``query_index`` as int64 on ``cu``'s device
        (``arange(T)`` by default), and the total token count ``T = cu[-1]`` as a Python int.
    """
    cu, query_index, total = _read_layout(cu_seqlens, query_index, name)
    if query_index is None:
        query_index = torch.arange(total, dtype=torch.int64, device=cu.device)  # [T]
    return cu, query_index, total


def _read_layout(cu_seqlens: torch.Tensor, query_index: torch.Tensor | None, name: str
                 ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """The checks of `checked_layout` in one read back; ``query_index`` stays ``None`` if not given."""
    check_int(name, cu_seqlens)
    check_rank(name, cu_seqlens, 1, "[num_seqs + 1]")
    if cu_seqlens.numel() < 2:
        raise ValueError(f"{name} must have at least 2 entries [0, ..., T], got {cu_seqlens.tolist()}")
    cu = cu_seqlens.long()
    parts = [cu[0], cu[-1], (cu[1:] < cu[:-1]).any().long()]
    if query_index is not None:
        check_int("query_index", query_index)
        check_rank("query_index", query_index, 1, "[T_q]")
        query_index = query_index.long().to(cu.device)
        if query_index.numel():
            parts += [query_index.min(), query_index.max()]
    values = torch.stack(parts).tolist()  # the one read back
    first, total, decreasing = values[:3]
    if first != 0:
        raise ValueError(f"{name} must start at 0, got {cu.tolist()[:8]}")
    if decreasing:
        raise ValueError(f"{name} must be non-decreasing, got {cu.tolist()[:16]}")
    if len(values) > 3 and (values[3] < 0 or values[4] >= total):
        raise ValueError(f"query_index values must lie in [0, T={total}), got range [{values[3]}, {values[4]}]")
    return cu, query_index, total


def one_sequence(num_tokens: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``cu_seqlens`` of a single sequence of ``num_tokens`` tokens: ``[0, num_tokens]``."""
    return torch.tensor([0, num_tokens], dtype=torch.int64, device=device)


def sequence_ids(cu_seqlens: torch.Tensor, query_index: torch.Tensor | None = None) -> torch.Tensor:
    """Which sequence each token belongs to.

    Args:
        cu_seqlens: int ``[num_seqs + 1]``.
        query_index: optional int ``[T_q]`` global packed indices; default all tokens in order.

    Returns:
        int64 ``[T_q]``: the sequence number of each token.
    """
    cu, idx, _ = checked_layout(cu_seqlens, query_index)
    # a token at global index i belongs to the last sequence whose start is <= i;
    # right=True skips zero-length sequences that start at the same place
    return torch.searchsorted(cu[1:], idx, right=True)  # [T_q]


# --8<-- [start:key_windows]
def key_windows(cu_seqlens: torch.Tensor, query_index: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal key windows of packed sequences, with keys in global packed order.

    Args:
        cu_seqlens: int ``[num_seqs + 1]``.
        query_index: optional int ``[T_q]``, the global packed index of each query (what a CP rank
            holds); default ``arange(T)``.

    Returns:
        ``(starts, ends)``, int64 ``[T_q]`` each: query ``t`` sees keys ``starts[t] <= s < ends[t]``,
        i.e. from the start of its own sequence up to and including itself.
    """
    cu, idx, _ = checked_layout(cu_seqlens, query_index)
    return _windows(cu, idx)


def _windows(cu: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    seq = torch.searchsorted(cu[1:], idx, right=True)  # [T_q]: the last sequence starting at or before idx
    starts = cu[seq]  # [T_q]
    ends = idx + 1  # [T_q]
    return starts, ends
# --8<-- [end:key_windows]


def positions(cu_seqlens: torch.Tensor, query_index: torch.Tensor | None = None) -> torch.Tensor:
    """RoPE position of each token inside its own sequence (restarts at 0 in every sequence).

    Args:
        cu_seqlens: int ``[num_seqs + 1]``.
        query_index: optional int ``[T_q]`` global packed indices; default all tokens in order.

    Returns:
        int64 ``[T_q]``.
    """
    pos, _, _ = positions_and_windows(cu_seqlens, query_index)
    return pos


def positions_and_windows(cu_seqlens: torch.Tensor, query_index: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`positions` and `key_windows` together, checking the layout once (one read back to the host).

    Returns:
        ``(positions, starts, ends)``, int64 ``[T_q]`` each.
    """
    cu, idx, _ = checked_layout(cu_seqlens, query_index)
    starts, ends = _windows(cu, idx)  # [T_q] each
    return idx - starts, starts, ends


# --8<-- [start:cp_shard_index]
def cp_shard_index(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global packed indices of the tokens a context-parallel rank owns, in its local order.

    Each sequence is cut into ``2 * cp_size`` equal chunks and rank ``r`` owns chunks ``r`` and
    ``2 * cp_size - 1 - r`` ("zigzag"): an early, cheap chunk and a late, expensive one, so causal
    attention work is balanced. The local order is sequence by sequence, the early chunk first.

    Args:
        cu_seqlens: int ``[num_seqs + 1]``; every sequence length must be divisible by ``2 * cp_size``.
        cp_size: number of CP ranks (>= 1).
        cp_rank: this rank, ``0 <= cp_rank < cp_size``.

    Returns:
        int64 ``[T // cp_size]``.
    """
    cu = check_cu_seqlens(cu_seqlens)
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be an int >= 1, got {cp_size!r}")
    if isinstance(cp_rank, bool) or not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be an int in [0, cp_size={cp_size}), got {cp_rank!r}")
    lengths = (cu[1:] - cu[:-1]).tolist()
    bad = [(i, n) for i, n in enumerate(lengths) if n % (2 * cp_size)]
    if bad:
        raise ValueError(
            f"every sequence length must be divisible by 2 * cp_size = {2 * cp_size}; "
            f"(sequence, length) pairs that are not: {bad[:8]}; pad the sequences first"
        )
    pieces = []
    for start, length in zip(cu[:-1].tolist(), lengths):
        chunk = length // (2 * cp_size)
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
            pieces.append(torch.arange(start + c * chunk, start + (c + 1) * chunk, dtype=torch.int64))
    return torch.cat(pieces).to(cu.device) if pieces else torch.zeros(0, dtype=torch.int64, device=cu.device)
# --8<-- [end:cp_shard_index]


def window_mask(starts: torch.Tensor, ends: torch.Tensor, num_keys: int) -> torch.Tensor:
    """The dense boolean mask of a set of key windows; for small inputs and for teaching.

    Real paths never build this for all queries at once: they slice ``starts``/``ends`` per chunk.

    Args:
        starts, ends: int ``[T]``.
        num_keys: number of keys ``S``.

    Returns:
        bool ``[T, S]``, True where ``starts[t] <= s < ends[t]``.
    """
    check_tensor("starts", starts)
    check_tensor("ends", ends)
    check_int("starts", starts)
    check_int("ends", ends)
    check_rank("starts", starts, 1, "[T]")
    check_rank("ends", ends, 1, "[T]")
    if starts.shape != ends.shape:
        raise ValueError(f"starts {tuple(starts.shape)} and ends {tuple(ends.shape)} must have the same shape")
    check_nonnegative_int("num_keys", num_keys)
    s = torch.arange(num_keys, device=starts.device)  # [S]
    return (s[None, :] >= starts[:, None]) & (s[None, :] < ends[:, None])  # [T, S]
