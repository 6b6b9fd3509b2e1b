"""dsa_ref.adversarial: every generator is documented, seeded, and really contains the case it claims."""

from __future__ import annotations

import math

import pytest
import torch

from dsa_ref import key_windows, sparse_mla, topk_indices
from dsa_ref import adversarial as adv
from dsa_ref.compare import compare_topk
from dsa_ref.oracle import DSA_REF, FLASHMLA_SPARSE_PREFILL, check_sparse_mla, reference_kernel

SMALL = dict(heads=4, dim=80, d_v=64)  # attention generators at small widths, for speed
FAST = {
    "long_rows": dict(rows=1, num_keys=1 << 15, k=256),
    "near_tied_scores": dict(rows=2, num_keys=2048, k=32),
    "all_masked_rows": SMALL, "duplicate_indices": SMALL, "future_indices": SMALL, "stale_topk_tail": SMALL,
    "packed_sequences": SMALL,
}


def _make(name, seed=0):
    return adv.GENERATORS[name](seed=seed, **FAST.get(name, {}))


@pytest.mark.parametrize("name", sorted(adv.GENERATORS))
def test_generator_is_documented_seeded_and_deterministic(name):
    fn = adv.GENERATORS[name]
    assert "Bug class:" in (fn.__doc__ or ""), f"{name} must name the bug class it hunts"
    a, b = _make(name, seed=1), _make(name, seed=1)
    assert a.name == name and len(a.bug_class) > 30
    assert a.tensors.keys() == b.tensors.keys()
    assert all(torch.equal(a[k], b[k]) for k in a.tensors), "the same seed must give the same case"
    if name != "cp_shards":  # the CP layout is deterministic by design
        c = _make(name, seed=2)
        assert any(not torch.equal(a[k], c[k]) for k in a.tensors if a[k].is_floating_point()), \
            "another seed must give another case"
    with pytest.raises(TypeError, match="seed"):
        fn(seed="0", **FAST.get(name, {}))


def test_exactly_tied_scores_tie_across_the_boundary():
    case = adv.exactly_tied_scores(rows=8, num_keys=40, k=8)
    s, k = case["scores"], case.meta["k"]
    for t in range(s.shape[0]):
        kth = s[t].sort(descending=True).values[k - 1]
        tied = int((s[t] == kth).sum())
        selected_among_tied = k - int((s[t] > kth).sum())
        assert tied > selected_among_tied, f"row {t} ({case.meta['rows'][t]}) has no tie at the boundary"
    # the canonical rule takes the lowest tied indices; reversing the key order breaks ties the other way
    flipped = topk_indices(s.flip(1), k)
    other = torch.where(flipped >= 0, s.shape[1] - 1 - flipped, flipped)
    assert not torch.equal(other.sort(1).values, topk_indices(s, k).sort(1).values)
    r = compare_topk(other, None, s, k)
    assert r.ok and r.rows_tie_equivalent == s.shape[0]


def test_near_tied_scores_are_distinct_only_in_float32():
    case = adv.near_tied_scores(rows=2, num_keys=2048, k=32)
    s = case["scores"]
    for row in s:
        assert row.unique().numel() == row.numel(), "all distinct in float32"
        assert row.bfloat16().unique().numel() == 1, "all equal in bfloat16"
    # a kernel that selects on bfloat16-rounded scores picks arbitrary keys
    rounded = topk_indices(s.bfloat16().float(), 32)
    assert not compare_topk(rounded, None, s, 32).ok


def test_valid_count_rows():
    case = adv.valid_count_rows(k=8, num_keys=40)
    s, k = case["scores"], case.meta["k"]
    counts = torch.isfinite(s).sum(1).tolist()
    assert counts == case.meta["valid"]
    assert {0, 1, k - 1, k, k + 1, 40} <= set(counts)
    assert ((case["ends"] - case["starts"]).tolist()) == counts
    idx = topk_indices(s, k)
    assert ((idx >= 0).sum(1) == torch.tensor(counts).clamp(max=k)).all()


def test_long_rows_low_contrast():
    case = adv.long_rows(rows=1, num_keys=1 << 15, k=256)
    s = case["scores"]
    assert s.shape == (1, 1 << 15)
    kth = s[0].sort(descending=True).values[255]
    # thousands of keys within 0.1% of the boundary: any coarse bin holds far more than k
    assert int(((s[0] - kth).abs() < 1e-3).sum()) > 4 * 256


def test_all_masked_rows_give_zero_and_minus_inf_with_finite_grads():
    case = adv.all_masked_rows(**SMALL)
    q, kv, idx = case["q"].float().requires_grad_(True), case["kv"].float().requires_grad_(True), case["indices"]
    out, lse = sparse_mla(q, kv, idx, sm_scale=case.meta["sm_scale"], d_v=case.meta["d_v"])
    empty = case.meta["empty_rows"]
    assert empty and (idx[empty] == -1).all()
    assert (out[empty] == 0).all() and torch.isneginf(lse[empty]).all()
    (out.sum() + lse[torch.isfinite(lse)].sum()).backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(kv.grad).all()
    assert not q.grad[empty].any()


def test_duplicate_indices_count_per_slot():
    case = adv.duplicate_indices(**SMALL)
    q, kv, idx = case["q"].double(), case["kv"].double(), case["indices"]
    rows = case.meta["rows_with_repeats"]
    assert rows and all(len(set(idx[t].tolist())) < idx.shape[1] for t in rows)
    assert (idx[:, :3] == torch.tensor([0, 1, 2])).all(), "every query selects the sink keys"
    scale, d_v = case.meta["sm_scale"], case.meta["d_v"]
    out, _ = sparse_mla(q, kv, idx, sm_scale=scale, d_v=d_v)
    t = rows[0]
    keys = idx[t].tolist()
    p = torch.softmax(scale * q[t] @ kv[keys].T, dim=-1)  # one term per slot
    torch.testing.assert_close(out[t], p @ kv[keys, :d_v])
    unique = sorted(set(keys))
    p1 = torch.softmax(scale * q[t] @ kv[unique].T, dim=-1)
    assert (out[t] - p1 @ kv[unique, :d_v]).abs().max() > 1e-3, "deduplicating must give another answer"


def test_future_indices_separate_causal_and_non_causal_kernels():
    case = adv.future_indices(**SMALL)
    q, kv, idx = case["q"], case["kv"], case["indices"]
    assert case.meta["future_slots"] > 0
    assert (idx > torch.arange(idx.shape[0])[:, None]).any(1).sum() == case.meta["future_slots"]
    assert (idx[:, 0] == torch.arange(idx.shape[0])).all(), "the diagonal is in slot 0"
    kw = dict(sm_scale=case.meta["sm_scale"], d_v=case.meta["d_v"])
    non_causal = reference_kernel(q, kv, idx, convention=DSA_REF, **kw)
    assert check_sparse_mla(*non_causal, q, kv, idx, convention=DSA_REF, **kw).ok
    # the same indices under a causal convention (the future slots are masked) give other outputs
    from dataclasses import replace

    causal = replace(DSA_REF, causal=True)
    assert not check_sparse_mla(*non_causal, q, kv, idx, convention=causal, **kw).ok


def test_stale_topk_tail():
    case = adv.stale_topk_tail(**SMALL)
    q, kv, idx, length = case["q"], case["kv"], case["indices"], case["topk_length"]
    assert (idx >= 0).all() and int(length[0]) == 0 and (length < idx.shape[1]).any()
    kw = dict(sm_scale=case.meta["sm_scale"], d_v=case.meta["d_v"])
    good = sparse_mla(q, kv, case["reference_indices"], **kw)
    from dsa_ref.oracle import lse_from_natural

    good = (good[0], lse_from_natural(good[1], FLASHMLA_SPARSE_PREFILL))
    assert check_sparse_mla(*good, q, kv, idx, convention=FLASHMLA_SPARSE_PREFILL, topk_length=length, **kw).ok
    assert not check_sparse_mla(*good, q, kv, idx, convention=FLASHMLA_SPARSE_PREFILL, **kw).ok


def test_packed_sequences():
    case = adv.packed_sequences(lengths=(1, 4, 0, 1, 6), k=3, **SMALL)
    cu, st, en, idx = case["cu_seqlens"], case["starts"], case["ends"], case["indices"]
    assert cu.tolist() == [0, 1, 5, 5, 6, 12]
    assert torch.equal(case["positions"], torch.tensor([0, 0, 1, 2, 3, 0, 0, 1, 2, 3, 4, 5]))
    valid = idx >= 0
    assert ((idx >= st[:, None]) | ~valid).all() and ((idx < en[:, None]) | ~valid).all(), "no leak across sequences"
    for t in (0, 5):  # length-1 sequences: the token sees only itself
        assert idx[t].tolist() == [t, -1, -1]


def test_cp_shards_cover_every_token_once_with_global_windows():
    case = adv.cp_shards(lengths=(8, 24, 16), cp_size=2)
    cu = case["cu_seqlens"]
    owned = torch.cat([case[f"query_index_{r}"] for r in range(2)])
    assert torch.equal(owned.sort().values, torch.arange(48))
    starts, ends = key_windows(cu)
    for r in range(2):
        q = case[f"query_index_{r}"]
        assert torch.equal(case[f"starts_{r}"], starts[q]) and torch.equal(case[f"ends_{r}"], ends[q])
    with pytest.raises(ValueError, match="divisible"):
        adv.cp_shards(lengths=(6, 8), cp_size=2)


def test_outlier_channels():
    case = adv.outlier_channels(magnitude=30.0)
    q, k = case["q"], case["k"]
    ch = case.meta["outlier_channels"]
    rest = [c for c in range(q.shape[-1]) if c not in ch]
    assert q[..., ch].abs().mean() > 10 * q[..., rest].abs().mean()
    assert k[:, ch].abs().mean() > 10 * k[:, rest].abs().mean()


def test_argument_validation():
    with pytest.raises(ValueError, match="k must be"):
        adv.exactly_tied_scores(k=0)
    with pytest.raises(ValueError, match="num_keys must be >= 2k"):
        adv.exactly_tied_scores(num_keys=10, k=8)
    with pytest.raises(ValueError, match="num_keys must be <="):
        adv.near_tied_scores(num_keys=1 << 16)
    with pytest.raises(ValueError, match="k must be >= 6"):
        adv.duplicate_indices(k=4)
    with pytest.raises(ValueError, match="lengths"):
        adv.packed_sequences(lengths=(3, -1))
    assert math.isclose(adv.DEEPSEEK_SM_SCALE, 0.13524, rel_tol=1e-4)
