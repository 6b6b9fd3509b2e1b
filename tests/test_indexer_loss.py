"""The indexer KL loss of both training stages.

* chunked `indexer_loss` == `indexer_loss_plain` (chunk sizes 1, 3, None; dense and sparse stage;
  mean and sum; coeff), and both == an explicit per-row formula;
* KL >= 0, and == 0 when the index scores are the log of the target (`indexer_target`);
* the closed-form gradient ``softmax(I) - p`` (`indexer_logit_grad`) == autograd, also for very
  peaked and very flat distributions (pitfall P12);
* sparse stage: the selected SET counts (duplicates change nothing), -1 slots are ignored;
* rows with no valid key: excluded from the mean, no NaN in forward or backward (pitfall P7);
  ``row_mask``; ``num_rows`` overrides the divisor; ``coeff=0`` gives zero (not missing) gradients;
* nothing flows into the main q or k (pitfall P13); the target rows sum to 1;
* memory: with a small chunk no ``[H, T, S]`` (or ``[T, H, S]``) block is ever built (pitfall P14);
* input validation.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from dsa_ref.indexer import topk_indices
from dsa_ref.indexer_loss import (
    indexer_logit_grad,
    indexer_loss,
    indexer_loss_plain,
    indexer_target,
    masked_log_softmax,
)
from dsa_ref.layout import key_windows

# the package exports the *function* `indexer_loss` under the module's name, so
# `import dsa_ref.indexer_loss as il` would give the function: fetch the module itself
il = importlib.import_module("dsa_ref.indexer_loss")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def problem(T=13, H=3, D=8, *, seed=0, mha=False, cu=None, topk=None, q_scale=1.0, i_scale=1.0,
            dtype=torch.float64):
    """Random main q/k, causal packed windows, index scores (-inf outside the window), and optionally
    a top-k selection from them."""
    g = _gen(seed)
    q = torch.randn(T, H, D, generator=g, dtype=torch.float64) * q_scale
    k = torch.randn(*((T, H, D) if mha else (T, D)), generator=g, dtype=torch.float64)
    cu = torch.tensor([0, T]) if cu is None else torch.tensor(cu)
    starts, ends = key_windows(cu)
    keys = torch.arange(T)
    inside = (keys[None] >= starts[:, None]) & (keys[None] < ends[:, None])
    scores = (torch.randn(T, T, generator=g, dtype=torch.float64) * i_scale).masked_fill(~inside, float("-inf"))
    idx = topk_indices(scores, topk) if topk is not None else None
    cast = lambda x: x.to(dtype)  # noqa: E731
    return cast(scores).requires_grad_(), cast(q), cast(k), starts, ends, idx


def naive_loss(scores, q, k, sm_scale, starts, ends, idx, reduction="mean", coeff=1.0):
    """Row by row, straight from the definition."""
    T, H, _ = q.shape
    S = k.shape[0]
    total, n = 0.0, 0
    for t in range(T):
        lo, hi = (0, S) if starts is None else (int(starts[t]), int(ends[t]))
        keys = set(range(lo, hi))
        if idx is not None:
            keys &= {int(j) for j in idx[t] if j >= 0}
        keys = sorted(keys)
        if not keys:
            continue
        n += 1
        p = torch.zeros(len(keys), dtype=torch.float64)
        for h in range(H):
            kk = k[keys] if k.dim() == 2 else k[keys, h]
            p += torch.softmax(sm_scale * (kk.double() @ q[t, h].double()), 0)
        p = p / p.sum()
        logq = torch.log_softmax(scores[t, keys].double(), 0)
        total += float((p * (p.log() - logq)).sum())
    if reduction == "mean":
        total /= max(n, 1)
    return total * coeff


STAGE_CASES = [
    dict(cu=[0, 13], topk=None),
    dict(cu=[0, 5, 6, 13], topk=None),
    dict(cu=[0, 5, 6, 13], topk=3),
    dict(cu=[0, 13], topk=4),
    dict(cu=[0, 13], topk=20),  # topk above every window
]


@pytest.mark.parametrize("case", STAGE_CASES)
@pytest.mark.parametrize("mha", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_chunked_equals_plain_equals_naive(case, mha, reduction):
    scores, q, k, starts, ends, idx = problem(seed=1, mha=mha, **case)
    kw = dict(sm_scale=0.4, starts=starts, ends=ends, topk_indices=idx, reduction=reduction, coeff=0.7)
    plain = indexer_loss_plain(scores, q, k, **kw)
    g_plain, = torch.autograd.grad(plain, scores)
    ref = naive_loss(scores.detach(), q, k, 0.4, starts, ends, idx, reduction, 0.7)
    assert plain.item() == pytest.approx(ref, rel=1e-12, abs=1e-14)
    for c in (1, 3, None):
        loss = indexer_loss(scores, q, k, chunk_size=c, **kw)
        assert loss.dtype == torch.float64 and loss.dim() == 0
        torch.testing.assert_close(loss, plain, rtol=1e-13, atol=1e-15)
        g, = torch.autograd.grad(loss, scores)
        torch.testing.assert_close(g, g_plain, rtol=0, atol=1e-14)


def test_no_windows_means_all_keys():
    scores, q, k, _, _, _ = problem(T=6, seed=2)
    scores = torch.randn(6, 6, generator=_gen(3), dtype=torch.float64, requires_grad=True)
    a = indexer_loss(scores, q, k, sm_scale=0.5)
    b = indexer_loss(scores, q, k, sm_scale=0.5, starts=torch.zeros(6, dtype=torch.long),
                     ends=torch.full((6,), 6))
    torch.testing.assert_close(a, b, rtol=0, atol=1e-15)
    assert a.item() == pytest.approx(naive_loss(scores.detach(), q, k, 0.5, None, None, None), rel=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_kl_nonnegative(seed):
    topk = [None, 2, 5][seed % 3]
    scores, q, k, starts, ends, idx = problem(T=17, seed=seed, cu=[0, 4, 17], topk=topk,
                                              q_scale=[0.1, 1.0, 5.0][seed % 3], i_scale=[10.0, 0.01, 1.0][seed % 3])
    loss = indexer_loss(scores, q, k, sm_scale=0.4, starts=starts, ends=ends, topk_indices=idx, chunk_size=4)
    assert loss.item() >= 0.0
    # per row too (sum reduction with a one-row mask)
    for t in range(17):
        m = torch.zeros(17, dtype=torch.bool)
        m[t] = True
        lt = indexer_loss(scores, q, k, sm_scale=0.4, starts=starts, ends=ends, topk_indices=idx,
                          reduction="sum", row_mask=m)
        assert lt.item() >= -1e-15


@pytest.mark.parametrize("topk", [None, 3])
@pytest.mark.parametrize("mha", [False, True])
def test_kl_zero_when_indexer_matches_target(topk, mha):
    _, q, k, starts, ends, idx = problem(T=15, seed=4, cu=[0, 6, 15], topk=topk, mha=mha)
    p = indexer_target(q, k, sm_scale=0.4, starts=starts, ends=ends, topk_indices=idx)
    # I = log p on the valid keys (p > 0 there); -inf elsewhere (never valid)
    scores = torch.where(p > 0, p.log(), torch.full_like(p, float("-inf"))).requires_grad_()
    loss = indexer_loss(scores, q, k, sm_scale=0.4, starts=starts, ends=ends, topk_indices=idx, chunk_size=4)
    assert abs(loss.item()) < 1e-14
    g, = torch.autograd.grad(loss, scores)
    assert g.abs().max() < 1e-14
    # adding a per-row constant changes nothing (softmax is shift invariant) ...
    shifted = scores.detach() + torch.arange(15, dtype=torch.float64)[:, None]
    assert abs(indexer_loss(shifted, q, k, sm_scale=0.4, starts=starts, ends=ends, topk_indices=idx).item()) < 1e-13
    # ... but any other perturbation makes it strictly positive
    bumped = scores.detach().clone()
    j = int(torch.nonzero(p[10] > 0)[0])  # a valid key of row 10
    bumped[10, j] += 0.5
    assert indexer_loss(bumped, q, k, sm_scale=0.4, starts=starts, ends=ends, topk_indices=idx).item() > 1e-4


def test_target_rows_sum_to_one():
    _, q, k, starts, ends, idx = problem(T=14, seed=5, cu=[0, 3, 3, 14], topk=4)
    starts = starts.clone()
    starts[8] = ends[8]  # one empty window
    for sel in (None, idx):
        p = indexer_target(q, k, sm_scale=0.4, starts=starts, ends=ends, topk_indices=sel)
        assert p.shape == (14, 14) and p.dtype == torch.float64
        assert bool((p >= 0).all())
        sums = p.sum(-1)
        torch.testing.assert_close(sums[torch.arange(14) != 8], torch.ones(13, dtype=torch.float64), rtol=0, atol=1e-14)
        assert sums[8] == 0
        # zero outside the window, and outside the selection in the sparse stage
        keys = torch.arange(14)
        outside = (keys[None] < starts[:, None]) | (keys[None] >= ends[:, None])
        assert bool((p[outside] == 0).all())
        if sel is not None:
            picked = torch.zeros(14, 14, dtype=torch.bool)
            for t in range(14):
                picked[t, sel[t][sel[t] >= 0]] = True
            assert bool((p[~picked] == 0).all())
    # the target is main attention summed over heads: with H = 1 it is exactly the softmax
    g = _gen(6)
    q1 = torch.randn(5, 1, 4, generator=g, dtype=torch.float64)
    k1 = torch.randn(5, 4, generator=g, dtype=torch.float64)
    p1 = indexer_target(q1, k1, sm_scale=0.3)
    torch.testing.assert_close(p1, torch.softmax(0.3 * q1[:, 0] @ k1.T, -1), rtol=0, atol=1e-15)


@pytest.mark.parametrize("regime", ["normal", "peaked_target", "flat_target", "peaked_pred", "flat_pred"])
@pytest.mark.parametrize("topk", [None, 4])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_closed_form_grad_equals_autograd(regime, topk, reduction):
    q_scale = {"peaked_target": 30.0, "flat_target": 1e-4}.get(regime, 1.0)
    i_scale = {"peaked_pred": 200.0, "flat_pred": 1e-6}.get(regime, 1.0)
    scores, q, k, starts, ends, idx = problem(T=16, seed=7, cu=[0, 7, 16], topk=topk, q_scale=q_scale,
                                              i_scale=i_scale)
    kw = dict(sm_scale=0.4, starts=starts, ends=ends, topk_indices=idx, reduction=reduction, coeff=1.3)
    loss = indexer_loss(scores, q, k, chunk_size=5, **kw)
    assert torch.isfinite(loss)
    g_auto, = torch.autograd.grad(loss, scores)
    g_closed = indexer_logit_grad(scores, q, k, **kw)
    assert bool(torch.isfinite(g_auto).all())
    torch.testing.assert_close(g_auto, g_closed, rtol=0, atol=1e-13)
    # the closed form, by hand: c * (softmax_valid(I) - p)
    p = indexer_target(q, k, sm_scale=0.4, starts=starts, ends=ends, topk_indices=idx)
    valid = p > 0 if regime != "peaked_target" else None
    if valid is not None:
        pred = masked_log_softmax(scores.detach(), valid).exp() * valid
        c = 1.3 / 16 if reduction == "mean" else 1.3
        torch.testing.assert_close(g_auto, c * (pred - p), rtol=0, atol=1e-13)
    # a log(softmax + eps) formulation would get the peaked-prediction case wrong; ours does not:
    # each row's gradient sums to zero over the valid keys
    torch.testing.assert_close(g_auto.sum(-1), torch.zeros(16, dtype=torch.float64), rtol=0, atol=1e-13)


def test_sparse_stage_uses_selected_set():
    scores, q, k, starts, ends, idx = problem(T=12, seed=8, cu=[0, 12], topk=4)
    kw = dict(sm_scale=0.4, starts=starts, ends=ends)
    base = indexer_loss(scores, q, k, topk_indices=idx, **kw)
    # duplicate a selected key into the -1 or last slot: the set, hence the loss, is unchanged
    dup = torch.cat([idx, idx[:, :2]], dim=1)
    torch.testing.assert_close(indexer_loss(scores, q, k, topk_indices=dup, **kw), base, rtol=0, atol=1e-15)
    # permuting slots and adding -1 slots anywhere changes nothing either
    perm = torch.cat([torch.full((12, 2), -1), idx.flip(1), torch.full((12, 1), -1)], dim=1)
    torch.testing.assert_close(indexer_loss(scores, q, k, topk_indices=perm, **kw), base, rtol=0, atol=1e-15)
    torch.testing.assert_close(indexer_loss_plain(scores, q, k, topk_indices=dup, **kw), base, rtol=1e-13, atol=0)
    # the sparse loss really is restricted: it differs from the dense loss once windows exceed topk
    dense = indexer_loss(scores, q, k, **kw)
    assert abs(dense.item() - base.item()) > 1e-4
    # and a selected index outside the window is not trained on (valid keys = selection AND window)
    out_win = idx.clone()
    out_win[0, 1] = 11  # row 0's window is [0, 1)
    torch.testing.assert_close(indexer_loss(scores, q, k, topk_indices=out_win, **kw), base, rtol=0, atol=1e-15)


def test_sparse_stage_with_topk_at_least_window_equals_dense():
    for topk in (13, 30):
        scores, q, k, starts, ends, idx = problem(T=13, seed=9, cu=[0, 6, 13], topk=topk)
        kw = dict(sm_scale=0.4, starts=starts, ends=ends)
        torch.testing.assert_close(indexer_loss(scores, q, k, topk_indices=idx, **kw),
                                   indexer_loss(scores, q, k, **kw), rtol=1e-14, atol=0)


@pytest.mark.parametrize("topk", [None, 3])
@pytest.mark.parametrize("chunk_size", [1, 4, None])
def test_empty_rows_excluded_and_no_nan(topk, chunk_size):
    scores, q, k, starts, ends, idx = problem(T=10, seed=10, cu=[0, 10], topk=topk)
    starts = starts.clone()
    empty = torch.tensor([2, 5, 6])
    starts[empty] = ends[empty]  # empty windows
    scores = scores.detach().masked_fill(
        (torch.arange(10)[None] < starts[:, None]) | (torch.arange(10)[None] >= ends[:, None]), float("-inf")
    ).requires_grad_()
    if idx is not None:
        idx = topk_indices(scores.detach(), 3)
        assert bool((idx[empty] == -1).all())
    kw = dict(sm_scale=0.4, starts=starts, ends=ends, topk_indices=idx)
    loss = indexer_loss(scores, q, k, chunk_size=chunk_size, **kw)
    assert torch.isfinite(loss)
    loss.backward()
    assert bool(torch.isfinite(scores.grad).all())
    assert torch.equal(scores.grad[empty], torch.zeros_like(scores.grad[empty]))
    # the mean divides by the 7 non-empty rows, not by 10
    s = indexer_loss(scores, q, k, reduction="sum", **kw)
    torch.testing.assert_close(loss, s / 7, rtol=1e-14, atol=0)
    assert loss.item() == pytest.approx(naive_loss(scores.detach(), q, k, 0.4, starts, ends, idx), rel=1e-12)
    # sparse stage: a row whose slots are all -1 is empty too
    if idx is not None:
        idx2 = idx.clone()
        idx2[7] = -1
        l2 = indexer_loss(scores, q, k, sm_scale=0.4, starts=starts, ends=ends, topk_indices=idx2, reduction="sum")
        m = torch.ones(10, dtype=torch.bool)
        m[7] = False
        l3 = indexer_loss(scores, q, k, sm_scale=0.4, starts=starts, ends=ends, topk_indices=idx, reduction="sum",
                          row_mask=m)
        torch.testing.assert_close(l2, l3, rtol=1e-14, atol=0)


def test_all_rows_empty_gives_zero_not_nan():
    scores, q, k, _, _, _ = problem(T=4, seed=11)
    starts = ends = torch.zeros(4, dtype=torch.long)
    loss = indexer_loss(scores, q, k, sm_scale=0.4, starts=starts, ends=ends)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(scores.grad, torch.zeros_like(scores))
    loss = indexer_loss(scores, q, k, sm_scale=0.4, topk_indices=torch.full((4, 2), -1))
    assert loss.item() == 0.0


def test_row_mask_and_num_rows():
    scores, q, k, starts, ends, idx = problem(T=12, seed=12, cu=[0, 5, 12], topk=3)
    for sel in (None, idx):
        kw = dict(sm_scale=0.4, starts=starts, ends=ends, topk_indices=sel)
        mask = torch.tensor([True, False, True, True, False, True, True, True, False, True, True, True])
        per_row = torch.stack([
            indexer_loss(scores, q, k, reduction="sum", row_mask=torch.arange(12) == t, **kw) for t in range(12)
        ])
        masked_sum = indexer_loss(scores, q, k, reduction="sum", row_mask=mask, **kw)
        torch.testing.assert_close(masked_sum, per_row[mask].sum(), rtol=1e-14, atol=0)
        masked_mean = indexer_loss(scores, q, k, row_mask=mask, **kw)
        torch.testing.assert_close(masked_mean, per_row[mask].sum() / int(mask.sum()), rtol=1e-14, atol=0)
        # masked rows get no gradient
        g, = torch.autograd.grad(masked_mean, scores)
        assert torch.equal(g[~mask], torch.zeros_like(g[~mask]))
        # num_rows replaces the valid-row count as the divisor (CP passes the global count)
        for n in (1, 5, 40, torch.tensor(40)):
            ln = indexer_loss(scores, q, k, row_mask=mask, num_rows=n, **kw)
            torch.testing.assert_close(ln, masked_sum / int(n), rtol=1e-14, atol=0)
        # ... and is ignored by "sum"
        torch.testing.assert_close(indexer_loss(scores, q, k, reduction="sum", num_rows=40, **kw),
                                   per_row.sum(), rtol=1e-14, atol=0)
        # two "CP halves" with the global count add up to the whole
        first = torch.arange(12) < 6
        whole = indexer_loss(scores, q, k, **kw)
        halves = sum(indexer_loss(scores, q, k, row_mask=m, num_rows=12, **kw) for m in (first, ~first))
        torch.testing.assert_close(halves, whole, rtol=1e-14, atol=0)


def test_coeff_scales_and_zero_coeff_gives_zero_grad():
    scores, q, k, starts, ends, idx = problem(T=9, seed=13, topk=3)
    kw = dict(sm_scale=0.4, starts=starts, ends=ends, topk_indices=idx)
    l1 = indexer_loss(scores, q, k, **kw)
    g1, = torch.autograd.grad(l1, scores)
    l3 = indexer_loss(scores, q, k, coeff=3.0, **kw)
    g3, = torch.autograd.grad(l3, scores)
    torch.testing.assert_close(l3, 3 * l1, rtol=1e-15, atol=0)
    torch.testing.assert_close(g3, 3 * g1, rtol=1e-14, atol=0)
    l0 = indexer_loss(scores, q, k, coeff=0.0, **kw)
    assert l0.item() == 0.0 and l0.requires_grad
    l0.backward()
    assert scores.grad is not None and torch.equal(scores.grad, torch.zeros_like(scores))


@pytest.mark.parametrize("topk", [None, 3])
def test_no_gradient_into_main_q_k(topk):
    scores, q, k, starts, ends, idx = problem(T=9, seed=14, topk=topk)
    q.requires_grad_()
    k.requires_grad_()
    loss = indexer_loss(scores, q, k, sm_scale=0.4, starts=starts, ends=ends, topk_indices=idx)
    loss.backward()
    assert q.grad is None and k.grad is None
    assert scores.grad is not None and scores.grad.abs().max() > 0
    # the plain version and the target detach too
    scores.grad = None
    indexer_loss_plain(scores, q, k, sm_scale=0.4, starts=starts, ends=ends, topk_indices=idx).backward()
    assert q.grad is None and k.grad is None
    assert not indexer_target(q, k, sm_scale=0.4, starts=starts, ends=ends).requires_grad


def test_dtypes():
    scores, q, k, starts, ends, _ = problem(T=10, seed=15, dtype=torch.float32)
    loss = indexer_loss(scores, q, k, sm_scale=0.4, starts=starts, ends=ends)
    assert loss.dtype == torch.float32
    ref = indexer_loss(scores.double(), q.double(), k.double(), sm_scale=0.4, starts=starts, ends=ends)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
    # bf16 main q/k (a bf16 model) with float32 index scores: float32 loss close to the float64 one
    lb = indexer_loss(scores, q.bfloat16(), k.bfloat16(), sm_scale=0.4, starts=starts, ends=ends)
    assert lb.dtype == torch.float32
    rb = indexer_loss(scores.double(), q.bfloat16().double(), k.bfloat16().double(), sm_scale=0.4,
                      starts=starts, ends=ends)
    torch.testing.assert_close(lb.double(), rb, rtol=1e-5, atol=1e-6)


def test_chunked_never_builds_full_score_block(monkeypatch):
    """With chunk_size=2 every einsum output (the main-score block) has at most 2 * H * S elements,
    while the plain version builds the full H * T * S block (which proves the probe works)."""
    T, H = 32, 4
    scores, q, k, starts, ends, idx = problem(T=T, H=H, seed=16, cu=[0, 10, 32], topk=5)
    S = T
    seen: list[int] = []
    real_einsum = torch.einsum

    def recording_einsum(*args, **kwargs):
        out = real_einsum(*args, **kwargs)
        seen.append(out.numel())
        return out

    monkeypatch.setattr(torch, "einsum", recording_einsum)
    for sel in (None, idx):
        seen.clear()
        loss = indexer_loss(scores, q, k, sm_scale=0.4, starts=starts, ends=ends, topk_indices=sel, chunk_size=2)
        assert seen, "the probe saw no einsum"
        assert max(seen) <= 2 * H * S
        seen.clear()
        plain = indexer_loss_plain(scores, q, k, sm_scale=0.4, starts=starts, ends=ends, topk_indices=sel)
        assert max(seen) == H * T * S
        torch.testing.assert_close(loss, plain, rtol=1e-13, atol=0)
    # the automatic chunk keeps to the element budget: shrink it and check the blocks shrink
    monkeypatch.setattr(il, "auto_chunk_size", lambda n, per_row, c=None: 3 if c is None else c)
    seen.clear()
    indexer_loss(scores, q, k, sm_scale=0.4, starts=starts, ends=ends)
    assert max(seen) <= 3 * H * S


def test_masked_log_softmax():
    s = torch.tensor([[1.0, 2.0, float("-inf"), 3.0], [5.0, 1.0, 0.0, 0.0]], dtype=torch.float64,
                     requires_grad=True)
    valid = torch.tensor([[True, True, False, True], [False, False, False, False]])
    out = masked_log_softmax(s, valid)
    torch.testing.assert_close(out[0, [0, 1, 3]], torch.log_softmax(s[0, [0, 1, 3]], 0), rtol=0, atol=1e-15)
    assert out[0, 2] == 0 and torch.equal(out[1], torch.zeros(4, dtype=torch.float64))
    out.sum().backward()
    assert bool(torch.isfinite(s.grad).all()) and torch.equal(s.grad[1], torch.zeros(4, dtype=torch.float64))
    assert s.grad[0, 2] == 0


def test_bad_inputs_raise():
    scores, q, k, starts, ends, idx = problem(T=6, seed=17, topk=2)
    kw = dict(sm_scale=0.4, starts=starts, ends=ends)
    with pytest.raises(ValueError, match="reduction"):
        indexer_loss(scores, q, k, reduction="avg", **kw)
    with pytest.raises(ValueError, match="reduction"):
        indexer_loss_plain(scores, q, k, reduction="avg", **kw)
    with pytest.raises(ValueError, match=r"^index_scores has size 5 in dim 1"):
        indexer_loss(scores[:, :5], q, k, **kw)
    with pytest.raises(ValueError, match=r"^index_scores has size 5 in dim 0"):
        indexer_loss(scores[:5], q, k, **kw)
    with pytest.raises(ValueError, match=r"^index_scores must have shape \[T, S\]"):
        indexer_loss(scores[None], q, k, **kw)
    with pytest.raises(TypeError, match=r"^index_scores must be a floating-point"):
        indexer_loss(scores.detach().long(), q, k, **kw)
    with pytest.raises(ValueError, match=r"^k has size 7 in dim -1|^k has size 7 in dim 1"):
        indexer_loss(scores, q, torch.randn(6, 7, dtype=torch.float64), **kw)
    with pytest.raises(ValueError, match=r"^k has size 2 in dim 1"):
        indexer_loss(scores, q, torch.randn(6, 2, 8, dtype=torch.float64), **kw)
    with pytest.raises(ValueError, match=r"^q must have shape"):
        indexer_loss(scores, q[:, 0], k, **kw)
    with pytest.raises(ValueError, match=r"^topk_indices values"):
        indexer_loss(scores, q, k, topk_indices=torch.full((6, 2), 6), **kw)
    with pytest.raises(ValueError, match=r"^topk_indices has size 5 in dim 0"):
        indexer_loss(scores, q, k, topk_indices=idx[:5], **kw)
    with pytest.raises(TypeError, match=r"^topk_indices must be an integer"):
        indexer_loss(scores, q, k, topk_indices=idx.float(), **kw)
    with pytest.raises(ValueError, match="row_mask"):
        indexer_loss(scores, q, k, row_mask=torch.ones(5, dtype=torch.bool), **kw)
    with pytest.raises(ValueError, match="row_mask"):
        indexer_loss(scores, q, k, row_mask=torch.ones(6), **kw)
    with pytest.raises(ValueError, match="sm_scale"):
        indexer_loss(scores, q, k, sm_scale=0.0, starts=starts, ends=ends)
    with pytest.raises(ValueError, match="starts and ends"):
        indexer_loss(scores, q, k, sm_scale=0.4, starts=starts)
    with pytest.raises(ValueError, match="chunk_size"):
        indexer_loss(scores, q, k, chunk_size=0, **kw)
