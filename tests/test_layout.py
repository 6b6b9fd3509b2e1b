"""Token layout: causal key windows and RoPE positions of packed sequences, zigzag CP shards, masks,
and the validation of cu_seqlens / query_index."""

from __future__ import annotations

import pytest
import torch

from dsa_ref.layout import (
    check_cu_seqlens,
    checked_layout,
    cp_shard_index,
    key_windows,
    one_sequence,
    positions,
    positions_and_windows,
    sequence_ids,
    window_mask,
)


def cu(*lengths: int, dtype=torch.int64) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=dtype)


def loop_windows(lengths: list[int]) -> tuple[list[int], list[int], list[int], list[int]]:
    """Per-token (start, end, position, sequence id) by walking the sequences."""
    starts, ends, pos, seq = [], [], [], []
    offset = 0
    for i, n in enumerate(lengths):
        for j in range(n):
            starts.append(offset)
            ends.append(offset + j + 1)
            pos.append(j)
            seq.append(i)
        offset += n
    return starts, ends, pos, seq


def test_single_sequence():
    s, e = key_windows(one_sequence(5))
    assert s.dtype == e.dtype == torch.int64
    assert s.tolist() == [0] * 5
    assert e.tolist() == [1, 2, 3, 4, 5]  # the diagonal is included
    assert positions(one_sequence(5)).tolist() == [0, 1, 2, 3, 4]


def test_one_sequence():
    c = one_sequence(7)
    assert c.dtype == torch.int64 and c.tolist() == [0, 7]


def test_packed_with_empty_and_length_one_sequences():
    c = cu(3, 0, 1, 4, 0)
    s, e = key_windows(c)
    assert s.tolist() == [0, 0, 0, 3, 4, 4, 4, 4]
    assert e.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert positions(c).tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    assert sequence_ids(c).tolist() == [0, 0, 0, 2, 3, 3, 3, 3]


def test_leading_empty_sequences():
    c = cu(0, 0, 2, 1)
    s, e = key_windows(c)
    assert s.tolist() == [0, 0, 2]
    assert e.tolist() == [1, 2, 3]
    assert positions(c).tolist() == [0, 1, 0]
    assert sequence_ids(c).tolist() == [2, 2, 3]


def test_no_tokens():
    for c in (cu(0), cu(0, 0)):
        s, e = key_windows(c)
        assert s.shape == e.shape == (0,) and s.dtype == torch.int64
        assert positions(c).shape == (0,)
        assert cp_shard_index(c, 2, 1).shape == (0,)


@pytest.mark.parametrize("seed", range(8))
def test_random_packs_match_loop(seed):
    g = torch.Generator().manual_seed(seed)
    n_seq = int(torch.randint(1, 7, (1,), generator=g))
    lengths = torch.randint(0, 6, (n_seq,), generator=g).tolist()
    c = cu(*lengths, dtype=torch.int32 if seed % 2 else torch.int64)  # int32 is accepted
    starts, ends, pos, seq = loop_windows(lengths)
    s, e = key_windows(c)
    assert s.dtype == e.dtype == torch.int64
    assert s.tolist() == starts and e.tolist() == ends
    assert positions(c).tolist() == pos
    assert sequence_ids(c).tolist() == seq
    # with query_index: an arbitrary subset in arbitrary order gives the corresponding rows
    T = sum(lengths)
    if T:
        qi = torch.randperm(T, generator=g)[: max(1, T // 2)]
        s_q, e_q = key_windows(c, qi)
        assert s_q.tolist() == [starts[i] for i in qi.tolist()]
        assert e_q.tolist() == [ends[i] for i in qi.tolist()]
        assert positions(c, qi).tolist() == [pos[i] for i in qi.tolist()]
        assert sequence_ids(c, qi.int()).tolist() == [seq[i] for i in qi.tolist()]


def test_query_index_repeats_and_int32():
    c = cu(2, 3)
    qi = torch.tensor([4, 4, 0, 2], dtype=torch.int32)
    s, e = key_windows(c, qi)
    assert s.tolist() == [2, 2, 0, 2] and e.tolist() == [5, 5, 1, 3]
    assert positions(c, qi).tolist() == [2, 2, 0, 0]
    assert key_windows(c, torch.zeros(0, dtype=torch.int64))[0].shape == (0,)


# ---------------------------------------------------------------------------------------------
# context-parallel shards
# ---------------------------------------------------------------------------------------------


def test_cp_shard_explicit():
    c = cu(8)
    assert cp_shard_index(c, 1, 0).tolist() == list(range(8))
    assert cp_shard_index(c, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_shard_index(c, 2, 1).tolist() == [2, 3, 4, 5]
    assert cp_shard_index(c, 4, 0).tolist() == [0, 7]
    assert cp_shard_index(c, 4, 1).tolist() == [1, 6]
    assert cp_shard_index(c, 4, 3).tolist() == [3, 4]
    # packed: sequence by sequence, the early chunk first
    c2 = cu(8, 4)
    assert cp_shard_index(c2, 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert cp_shard_index(c2, 2, 1).tolist() == [2, 3, 4, 5, 9, 10]


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("lengths", [(16,), (8, 0, 24, 16), (0, 8), (32, 8, 8)])
def test_cp_shards_zigzag_and_windows(cp, lengths):
    c = cu(*lengths)
    T = sum(lengths)
    full_s, full_e = key_windows(c)
    full_pos = positions(c)
    owner = torch.full((T,), -1)
    shards = []
    for r in range(cp):
        idx = cp_shard_index(c, cp, r)
        assert idx.dtype == torch.int64
        assert idx.numel() == T // cp  # balanced
        shards.append(idx)
        owner[idx] = r
        # zigzag ownership: within each sequence, chunk c belongs to rank min(c, 2cp-1-c)
        offset = 0
        for n in lengths:
            chunk = n // (2 * cp)
            mine = idx[(idx >= offset) & (idx < offset + n)] - offset
            want = list(range(r * chunk, (r + 1) * chunk)) + \
                list(range((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk))
            assert mine.tolist() == want
            offset += n
        # the windows and positions of the local queries are the rows of the full ones
        s, e = key_windows(c, idx)
        assert torch.equal(s, full_s[idx]) and torch.equal(e, full_e[idx])
        assert torch.equal(positions(c, idx), full_pos[idx])
    union = torch.cat(shards)
    assert torch.equal(union.sort().values, torch.arange(T))  # a permutation of arange(T)
    assert bool((owner >= 0).all())


def test_cp_shard_balances_causal_work():
    """Zigzag: every rank gets the same number of (query, key) pairs in a causal sequence."""
    c = cu(32)
    s, e = key_windows(c)
    work = [int((e - s)[cp_shard_index(c, 4, r)].sum()) for r in range(4)]
    assert len(set(work)) == 1, work


@pytest.mark.parametrize("lengths, cp, bad", [((6,), 2, "(0, 6)"), ((8, 5), 2, "(1, 5)"), ((4, 4), 4, "(0, 4)")])
def test_cp_shard_divisibility_error(lengths, cp, bad):
    with pytest.raises(ValueError, match=rf"divisible by 2 \* cp_size = {2 * cp}") as info:
        cp_shard_index(cu(*lengths), cp, 0)
    assert bad in str(info.value)  # names the offending (sequence, length)


@pytest.mark.parametrize("cp_size, cp_rank, name", [
    (0, 0, "cp_size"), (-1, 0, "cp_size"), (2.0, 0, "cp_size"), (True, 0, "cp_size"),
    (2, 2, "cp_rank"), (2, -1, "cp_rank"), (2, 1.0, "cp_rank"),
])
def test_cp_shard_bad_size_or_rank(cp_size, cp_rank, name):
    with pytest.raises(ValueError, match=name):
        cp_shard_index(cu(8), cp_size, cp_rank)


# ---------------------------------------------------------------------------------------------
# window_mask
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_window_mask_matches_loop(seed):
    g = torch.Generator().manual_seed(seed)
    T, S = 7, 9
    starts = torch.randint(0, S + 1, (T,), generator=g)
    ends = torch.randint(0, S + 1, (T,), generator=g)  # some empty (ends <= starts)
    m = window_mask(starts, ends, S)
    assert m.dtype == torch.bool and m.shape == (T, S)
    want = torch.tensor([[bool(starts[t] <= s < ends[t]) for s in range(S)] for t in range(T)])
    assert torch.equal(m, want)


def test_window_mask_of_causal_pack_is_block_diagonal_lower():
    c = cu(3, 2)
    m = window_mask(*key_windows(c), 5)
    want = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(m, want)


def test_window_mask_errors():
    s = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(TypeError, match="starts"):
        window_mask(s.float(), s, 4)
    with pytest.raises(TypeError, match="ends"):
        window_mask(s, [0, 0, 0], 4)
    with pytest.raises(ValueError, match="starts"):
        window_mask(s[None], s[None], 4)
    with pytest.raises(ValueError, match="same shape"):
        window_mask(s, s[:2], 4)


# ---------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------

_ALL = [key_windows, positions, sequence_ids, check_cu_seqlens, lambda c: cp_shard_index(c, 1, 0)]


@pytest.mark.parametrize("fn", _ALL)
@pytest.mark.parametrize("bad, exc, match", [
    (torch.tensor([[0, 2, 4]]), ValueError, r"cu_seqlens must have shape \[num_seqs \+ 1\].*\(1, 3\)"),
    (torch.tensor([0.0, 2.0]), TypeError, r"cu_seqlens must be an integer tensor.*float32"),
    (torch.tensor([1, 3]), ValueError, r"cu_seqlens must start at 0.*\[1, 3\]"),
    (torch.tensor([0, 4, 2]), ValueError, r"cu_seqlens must be non-decreasing.*\[0, 4, 2\]"),
    (torch.tensor([0]), ValueError, r"cu_seqlens must have at least 2 entries"),
    (torch.tensor([], dtype=torch.int64), ValueError, r"cu_seqlens must have at least 2 entries"),
    (torch.tensor([True, True]), TypeError, r"cu_seqlens must be an integer tensor"),
    ([0, 3], TypeError, r"cu_seqlens must be a torch.Tensor, got list"),
])
def test_cu_seqlens_validation(fn, bad, exc, match):
    with pytest.raises(exc, match=match):
        fn(bad)


def test_check_cu_seqlens_returns_int64():
    out = check_cu_seqlens(torch.tensor([0, 2, 2, 5], dtype=torch.int32))
    assert out.dtype == torch.int64 and out.tolist() == [0, 2, 2, 5]


@pytest.mark.parametrize("fn", [key_windows, positions, sequence_ids, positions_and_windows, checked_layout])
@pytest.mark.parametrize("qi", [[-1], [5], [0, 7], [2, 100]])
def test_query_index_out_of_range(fn, qi):
    with pytest.raises(ValueError, match=r"query_index values must lie in \[0, T=5\)"):
        fn(cu(2, 3), torch.tensor(qi))


@pytest.mark.parametrize("fn", [key_windows, positions])
def test_query_index_bad_type_or_rank(fn):
    with pytest.raises(TypeError, match="query_index"):
        fn(cu(2, 3), torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="query_index"):
        fn(cu(2, 3), torch.tensor([[0, 1]]))


@pytest.mark.parametrize("query_index", [None, [4, 0, 2], [], [6, 6]])
def test_positions_and_windows_is_both_functions(query_index):
    """One check of the layout gives what `positions` and `key_windows` give separately."""
    c = cu(3, 0, 4)
    qi = None if query_index is None else torch.tensor(query_index, dtype=torch.int64)
    pos, starts, ends = positions_and_windows(c, qi)
    want_starts, want_ends = key_windows(c, qi)
    assert torch.equal(pos, positions(c, qi)) and torch.equal(starts, want_starts) and torch.equal(ends, want_ends)
    cu64, idx, total = checked_layout(c.to(torch.int32), qi)
    assert cu64.dtype == torch.int64 and total == 7 and idx.dtype == torch.int64
    assert idx.tolist() == (list(range(7)) if qi is None else query_index)


def test_checked_layout_reads_back_once(monkeypatch):
    """The checks of cu_seqlens and query_index are one read back to the host (a sync on a GPU)."""
    reads = []
    original = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(self.shape) or original(self))
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("item() on the layout path"))
    monkeypatch.setattr(torch.Tensor, "__int__", lambda self: pytest.fail("int() on the layout path"))
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda self: pytest.fail("bool() on the layout path"))
    positions_and_windows(cu(3, 4), torch.tensor([1, 6]))
    assert len(reads) == 1
