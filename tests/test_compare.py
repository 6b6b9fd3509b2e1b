"""dsa_ref.compare: the metrics are right, the presets are neither too loose nor too tight, the
tie-aware top-k comparison accepts exactly the selections that differ only among boundary ties."""

from __future__ import annotations

import math

import pytest
import torch

from dsa_ref import topk_indices
from dsa_ref.compare import (
    LSE_TOLERANCE,
    TOLERANCES,
    Tolerance,
    attention_mass_recall,
    compare,
    compare_topk,
    tolerance_for,
)

def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_identical_tensors_pass_with_zero_error():
    x = _randn(5, 3, 8)
    c = compare(x, x.clone(), name="x")
    assert c.ok and c.rel_l2 == 0 and c.max_abs == 0 and c.cosine == pytest.approx(1.0)
    assert c.violations == 0 and c.nonfinite_actual == 0 and not c.failures
    assert "x [5, 3, 8] float64: ok" in str(c)


def test_metrics_match_hand_computation():
    e = _randn(4, 6, seed=1)
    a = e + 0.01 * _randn(4, 6, seed=2)
    c = compare(a, e, tol=Tolerance(rel_l2=1.0, atol=1.0, rtol=1.0, min_cosine=0.0))
    assert c.rel_l2 == pytest.approx(float((a - e).norm() / e.norm()), rel=1e-12)
    assert c.max_abs == pytest.approx(float((a - e).abs().max()), rel=1e-12)
    assert c.cosine == pytest.approx(float((a * e).sum() / (a.norm() * e.norm())), rel=1e-12)
    flat = int((a - e).abs().argmax())
    assert c.max_abs_index == (flat // 6, flat % 6)
    assert c.max_abs_actual == pytest.approx(float(a.flatten()[flat]))


def test_a_planted_error_is_located_and_its_head_stands_out():
    e = _randn(10, 4, 16, seed=3)
    a = e.clone()
    a[7, 2, 5] += 0.5
    c = compare(a, e)
    assert not c.ok
    assert c.max_abs_index == (7, 2, 5)
    assert c.max_abs == pytest.approx(0.5)
    worst = max(c.worst_rows, key=lambda w: w.max_abs)
    assert (worst.head, worst.row) == (2, (7,))
    assert [w.head for w in c.worst_rows] == [0, 1, 2, 3]
    assert all(w.max_abs == 0 for w in c.worst_rows if w.head != 2)
    assert "worst row per head: h2 row (7,)" in str(c)


def test_head_dim_of_an_lse_and_of_a_bshd_tensor():
    e = _randn(6, 3, seed=4)  # [T, H]
    a = e.clone()
    a[4, 1] += 1
    c = compare(a, e, head_dim=1)
    assert max(c.worst_rows, key=lambda w: w.max_abs).row == (4,)
    e4 = _randn(2, 5, 3, 8, seed=5)  # [B, S, H, D]
    a4 = e4.clone()
    a4[1, 3, 2, 0] -= 1
    c4 = compare(a4, e4)
    worst = max(c4.worst_rows, key=lambda w: w.max_abs)
    assert (worst.head, worst.row) == (2, (1, 3))
    assert compare(a4, e4, head_dim=None).worst_rows == []


def test_nonfinite_values_are_counted_and_fail():
    e = _randn(8, 4, seed=6)
    a = e.clone()
    a[3, 1] = float("nan")
    c = compare(a, e)
    assert not c.ok and c.nonfinite_actual == 1 and c.nonfinite_mismatch == 1
    assert any("NaN/inf" in f for f in c.failures)
    assert math.isinf(c.max_abs) and c.max_abs_index == (3, 1)


def test_equal_infinities_match_and_opposite_ones_do_not():
    e = _randn(5, 2, seed=7)
    e[2] = -math.inf  # an empty row's lse
    assert compare(e.clone(), e, head_dim=1).ok
    a = e.clone()
    a[2] = math.inf  # FlashMLA-style +inf, not converted
    c = compare(a, e, head_dim=1)
    assert not c.ok and c.nonfinite_mismatch == 2
    b = e.clone()
    b[2] = 0.0  # a finite value where the reference is empty
    assert not compare(b, e, head_dim=1).ok


# the drift each preset must reject: 8 ulps for 16-bit dtypes; for float32, TF32's unit roundoff
# (2^-11), i.e. a float32 kernel that silently runs its GEMMs in TF32
DRIFT = {torch.bfloat16: 8 * 2.0 ** -8, torch.float16: 8 * 2.0 ** -11, torch.float32: 2.0 ** -11}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_preset_accepts_rounding_and_rejects_systematic_drift(dtype):
    e = _randn(64, 8, 32, seed=8)
    assert compare(e.to(dtype), e).ok, "rounding once to the dtype must pass its preset"
    drifted = (e * (1 + DRIFT[dtype])).to(dtype)  # a systematic error: a wrong scale or a lost term
    c = compare(drifted, e)
    assert not c.ok, f"a relative drift of {DRIFT[dtype]:.1e} must fail the {dtype} preset"


def test_float64_preset_rejects_float32_rounding():
    e = _randn(32, 32, seed=9)
    assert compare(e.clone(), e).ok
    assert not compare(e.float().double(), e, tol=TOLERANCES[torch.float64]).ok


def test_cosine_bound_catches_what_relative_l2_alone_allows():
    e = _randn(100, seed=10)
    a = e + 0.5 * _randn(100, seed=11)
    loose = Tolerance(rel_l2=10.0, atol=10.0, rtol=10.0, min_cosine=0.99)
    c = compare(a, e, tol=loose)
    assert not c.ok and any("cosine" in f for f in c.failures)


def test_lse_tolerance_is_absolute_and_catches_a_wrong_base():
    lse = 5.0 + _randn(16, 4, seed=12)
    assert compare((lse + 5e-5).float(), lse, tol=LSE_TOLERANCE, head_dim=1).ok
    assert not compare((lse * math.log2(math.e)).float(), lse, tol=LSE_TOLERANCE, head_dim=1).ok
    assert not compare((lse + 3e-4).float(), lse, tol=LSE_TOLERANCE, head_dim=1).ok


def test_assert_ok_raises_with_the_report():
    e = _randn(4, 4, seed=13)
    with pytest.raises(AssertionError, match="FAIL"):
        compare(e + 1, e, name="out").assert_ok()
    assert compare(e, e).assert_ok().ok
    d = compare(e + 1, e).as_dict()
    assert d["ok"] is False and d["failures"] and d["tolerance"]["rel_l2"] == TOLERANCES[torch.float64].rel_l2


def test_input_validation_names_the_argument():
    x = _randn(3, 4)
    with pytest.raises(ValueError, match="actual has shape \\(3, 4\\) but expected has shape \\(4, 3\\)"):
        compare(x, x.T.contiguous())
    with pytest.raises(TypeError, match="actual must be a floating-point tensor"):
        compare(torch.ones(3, dtype=torch.int64), torch.ones(3))
    with pytest.raises(TypeError, match="tol must be"):
        compare(x, x, tol=1e-3)
    with pytest.raises(ValueError, match="head_dim"):
        compare(x, x, head_dim=5)
    with pytest.raises(KeyError, match="no tolerance preset"):
        tolerance_for(torch.int32)
    with pytest.raises(ValueError, match="rel_l2"):
        Tolerance(rel_l2=-1, atol=0, rtol=0, min_cosine=0)
    assert tolerance_for(torch.float8_e4m3fn) is TOLERANCES["float8_e4m3"]


def test_scaled_tolerance():
    t = TOLERANCES[torch.bfloat16].scaled(2)
    assert t.rel_l2 == 2 * TOLERANCES[torch.bfloat16].rel_l2
    assert 1 - t.min_cosine == pytest.approx(4 * (1 - TOLERANCES[torch.bfloat16].min_cosine))


# ---------------------------------------------------------------------------------- top-k


def _tied_scores():
    # row 0: keys 2..6 tie at 1.0 around the k=4 boundary; row 1: no ties
    s = torch.tensor([[5.0, 4.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0],
                      [8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0]])
    return s


def test_compare_topk_accepts_another_tie_order_but_not_another_key():
    s = _tied_scores()
    ref = topk_indices(s, 4)
    assert ref[0].tolist() == [0, 1, 2, 3]
    other_ties = torch.tensor([[1, 0, 6, 5], [3, 2, 1, 0]])  # other tie choice, other slot order
    r = compare_topk(other_ties, ref, s, 4)
    assert r.ok and r.rows_exact == 1 and r.rows_tie_equivalent == 1 and r.rows_wrong == 0
    assert r.min_recall == 0.5  # index recall alone would call row 0 half wrong
    wrong = torch.tensor([[0, 2, 3, 4], [0, 1, 2, 3]])  # key 1 (score 4) dropped for a tied key
    r = compare_topk(wrong, ref, s, 4)
    assert not r.ok and r.rows_wrong == 1 and r.wrong[0]["row"] == 0
    assert r.wrong[0]["missing"] == [(1, 4.0)]
    assert "keys above the boundary missing" in "; ".join(r.wrong[0]["reasons"])
    with pytest.raises(AssertionError, match="row 0"):
        r.assert_ok()


def test_compare_topk_rejects_duplicates_masked_keys_and_wrong_counts():
    s = torch.tensor([[3.0, 2.0, 1.0, -math.inf, -math.inf]])
    assert compare_topk(torch.tensor([[0, 1, 2, -1]]), None, s, 4).ok  # 3 valid keys: one -1 slot
    cases = {
        "twice": torch.tensor([[0, 1, 1, 2]]),
        "below the boundary or masked": torch.tensor([[0, 1, 2, 3]]),
        "valid slots, expected": torch.tensor([[0, 1, -1, -1]]),
        "out of range": torch.tensor([[0, 1, 2, 5]]),
    }
    for reason, idx in cases.items():
        r = compare_topk(idx, None, s, 4)
        assert not r.ok, reason
        assert reason in "; ".join(r.wrong[0]["reasons"]), (reason, r.wrong[0]["reasons"])


def test_compare_topk_tie_tolerance():
    s = torch.tensor([[3.0, 2.0, 1.0, 1.0 - 1e-6, 0.0]])
    near = torch.tensor([[0, 1, 3]])  # picks the near-tied key instead of key 2
    assert not compare_topk(near, None, s, 3).ok
    assert compare_topk(near, None, s, 3, tie_tol=1e-5).ok
    assert not compare_topk(torch.tensor([[0, 2, 3]]), None, s, 3, tie_tol=1e-5).ok  # key 1 is no tie


def test_compare_topk_empty_rows_and_validation():
    s = torch.full((2, 4), -math.inf)
    s[1, 2] = 0.0
    assert compare_topk(torch.tensor([[-1, -1], [2, -1]]), None, s, 2).ok
    assert not compare_topk(torch.tensor([[0, -1], [2, -1]]), None, s, 2).ok
    with pytest.raises(ValueError, match="NaN"):
        compare_topk(torch.zeros(1, 1, dtype=torch.int64), None, torch.tensor([[float("nan")]]))
    with pytest.raises(ValueError, match="rows"):
        compare_topk(torch.zeros(3, 1, dtype=torch.int64), None, s)
    with pytest.raises(TypeError, match="actual_idx must be an integer tensor"):
        compare_topk(torch.zeros(2, 1), None, s)


def test_attention_mass_recall():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    idx = torch.tensor([[0, 2, -1], [1, -1, -1]])
    r = attention_mass_recall(idx, p)
    assert r.tolist() == [pytest.approx(0.7), 1.0]  # an all-zero row has nothing to recall
    dup = torch.tensor([[0, 0, 0], [1, 1, 1]])
    assert attention_mass_recall(dup, p)[0] == pytest.approx(0.5), "a key selected twice counts once"
    best = torch.tensor([[0, 1, -1], [0, 1, -1]])
    rel = attention_mass_recall(idx, p, relative_to=best)
    assert rel[0] == pytest.approx(0.7 / 0.8)
    with pytest.raises(ValueError, match="non-negative"):
        attention_mass_recall(idx, -p)
    with pytest.raises(ValueError, match="indices values"):
        attention_mass_recall(torch.tensor([[9, -1, -1], [0, -1, -1]]), p)


def test_a_violation_names_the_element_furthest_over_its_bound():
    """The element with the largest |err| may be well inside its bound (a large magnitude) while a
    smaller error elsewhere is over its own: the failure names the latter, and its numbers hold."""
    e = torch.ones(4, 8, dtype=torch.float64)
    a = e.clone()
    a[0, 0] += 0.5  # the largest error, inside rtol * magnitude there
    a[2, 5] += 0.05  # a smaller error, over its bound
    magnitude = torch.ones_like(e)
    magnitude[0, 0] = 100.0
    tol = Tolerance(rel_l2=1.0, atol=0.0, rtol=0.01, min_cosine=0.0, atol_scaled=False)
    c = compare(a, e, name="g", tol=tol, magnitude=magnitude)
    assert c.violations == 1 and c.max_abs_index == (0, 0)
    (failure,) = c.failures
    assert "furthest over at (2, 5): |err| 5.000e-02 > 1.000e-02" in failure, failure
    assert "actual 1.05, expected 1" in failure, failure
