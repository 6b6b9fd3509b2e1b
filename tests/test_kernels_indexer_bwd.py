"""Index scores at selected keys and their backward on TileLang, against a float64 reference.

The CPU tests (no marker) prove the math the kernels implement: the closed-form backward of
``score[t, i] = sum_j w[t, j] relu(q[t, j] . k[idx[t, i]])`` written out in the module docstring of
`dsa_ref.kernels.indexer_bwd` equals autograd of the gather + einsum reference, in float64, with
``-1`` slots, duplicate indices and an empty row. The GPU tests (``gpu`` marker, skipped without
CUDA + tilelang) compare the kernels with the float64 reference on the same bf16 inputs.

Tolerances, and why:

* **scores** -- ``MAX_SCORE = 1e-5`` of the largest |score| (max abs error). Products of bf16
  values are exact in fp32; a logit is an fp32 sum of 128 of them (relative error ~1e-6 of the
  magnitudes summed) and a score an fp32 sum of 64 weighted logits, so the expected error is about
  1e-6 of max |score|. ``-inf`` must sit exactly at the ``-1`` slots.
* **dw** -- ``REL_DW = 1e-4`` relative L2: fp32 sums of ``d_score * relu(logit)`` with fp32
  logits, nothing rounded to bf16 (expected ~1e-6; a ReLU flipping at a logit within 1e-6 of 0
  changes ``dw`` by a term that is itself ~0).
* **dq, dk** -- ``REL_DQ_DK = 1e-2`` relative L2: the GEMM operand ``g = d_score * w * relu'``
  is rounded once to bf16 (unit roundoff 2^-8: relative RMS error ~1.6e-3 per term, independent
  across terms) and the results are returned in bf16 (another ~1.6e-3), ~2.3e-3 together (a CPU
  emulation of the kernels' rounding measures 2.3e-3 to 2.6e-3): a 4x margin.
"""

import pytest
import torch

from dsa_ref import cp_shard_index, lightning_indexer
from gpu_helpers import causal_packed_indices, max_abs, messy_indices, rel_l2, requires_kernels

MAX_SCORE = 1e-5
REL_DW = 1e-4
REL_DQ_DK = 1e-2


def gpu(fn):
    """Mark a test as needing the TileLang kernels (skipped cleanly otherwise)."""
    return requires_kernels(pytest.mark.gpu(fn))


# ----------------------------------------------------------------------------- float64 reference


def _reference_scores_at(q, k, w, idx, relu=True):
    """``scores [T, K]`` at the selected keys by gather + einsum, in q's dtype; ``-inf`` at -1 slots.

    Differentiable in ``q``, ``k``, ``w`` (autograd gives the reference gradients; the masked
    ``-1`` slots pass none back).
    """
    valid = idx >= 0  # [T, K]
    k_sel = k[idx.clamp_min(0)]  # [T, K, D]
    logits = torch.einsum("thd,tkd->thk", q, k_sel)  # [T, H, K]
    if relu:
        logits = logits.relu()
    scores = torch.einsum("thk,th->tk", logits, w)  # [T, K]
    return scores.masked_fill(~valid, float("-inf"))


def _reference_grads(q, k, w, idx, d_scores, relu=True):
    """``(scores, dq, dk, dw)`` of `_reference_scores_at` in float64 (from float64 copies of the inputs)."""
    q64, k64, w64 = (t.detach().double().requires_grad_(True) for t in (q, k, w))
    scores = _reference_scores_at(q64, k64, w64, idx, relu)
    scores.backward(d_scores.double())
    return scores.detach(), q64.grad, k64.grad, w64.grad


def _closed_form_backward(q, k, w, idx, d_scores, relu=True):
    """``(dq, dk, dw)`` by the formulas the backward kernel implements (float64 in, float64 out)."""
    T, H, D = q.shape
    valid = idx >= 0  # [T, K]
    ds = torch.where(valid, d_scores, torch.zeros_like(d_scores))  # -1 slots carry no gradient
    k_sel = k[idx.clamp_min(0)]  # [T, K, D]
    logits = torch.einsum("thd,tkd->thk", q, k_sel)  # [T, H, K]
    act = logits.relu() if relu else logits
    slope = (logits > 0).to(q.dtype) if relu else torch.ones_like(logits)
    g = ds[:, None, :] * w[:, :, None] * slope  # [T, H, K]
    dw = torch.einsum("tk,thk->th", ds, act)  # [T, H]
    dq = torch.einsum("thk,tkd->thd", g, k_sel)  # [T, H, D]
    dk_sel = torch.einsum("thk,thd->tkd", g, q) * valid[..., None]  # [T, K, D]
    dk = torch.zeros_like(k).index_add_(0, idx.clamp_min(0).flatten(), dk_sel.flatten(0, 1))  # [S, D]
    return dq, dk, dw


def _small_indices(T, S, K, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, S, (T, K), generator=g)
    idx[torch.rand(T, K, generator=g) < 0.3] = -1
    idx[0, 1] = idx[0, 0] = 3  # a duplicate
    idx[1, 2:5] = idx[1, 1]  # several
    idx[2] = -1  # an empty row
    idx[3, K // 2:] = -1  # a short row: -1 tail
    return idx


@pytest.mark.parametrize("relu", [True, False])
def test_closed_form_backward_equals_autograd(relu):
    """CPU, float64: the backward formulas of the kernel equal autograd of the reference."""
    T, S, H, D, K = 9, 13, 4, 8, 10
    g = torch.Generator().manual_seed(7)
    q = torch.randn(T, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(S, D, generator=g, dtype=torch.float64)
    w = torch.randn(T, H, generator=g, dtype=torch.float64)
    idx = _small_indices(T, S, K, seed=8)
    d_scores = torch.randn(T, K, generator=g, dtype=torch.float64)
    d_scores[idx < 0] = float("nan")  # whatever sits at -1 slots must not leak
    scores, dq_ref, dk_ref, dw_ref = _reference_grads(q, k, w, idx, d_scores, relu)
    dq, dk, dw = _closed_form_backward(q, k, w, idx, d_scores, relu)
    assert torch.equal(torch.isneginf(scores), idx < 0)
    for got, ref in ((dq, dq_ref), (dk, dk_ref), (dw, dw_ref)):
        assert torch.isfinite(ref).all()
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    assert (dq[2] == 0).all() and (dw[2] == 0).all(), "a row with no valid slot gets no gradient"
    unused = torch.ones(S, dtype=torch.bool)
    unused[idx[idx >= 0]] = False
    assert (dk[unused] == 0).all(), "keys nobody selected get no gradient"


@pytest.mark.parametrize("relu", [True, False])
def test_reference_equals_lightning_indexer_gathered(relu):
    """CPU, float64: the gather reference is `lightning_indexer` read at the selected keys."""
    T, S, H, D, K = 9, 13, 4, 8, 10
    g = torch.Generator().manual_seed(9)
    q = torch.randn(T, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(S, D, generator=g, dtype=torch.float64)
    w = torch.randn(T, H, generator=g, dtype=torch.float64)
    idx = _small_indices(T, S, K, seed=10)
    full = lightning_indexer(q, k, w, relu=relu)  # [T, S]
    gathered = full.gather(1, idx.clamp_min(0)).masked_fill(idx < 0, float("-inf"))
    torch.testing.assert_close(_reference_scores_at(q, k, w, idx, relu), gathered, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- GPU


def _inputs(T, S, H, seed, D=128):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(T, H, D, generator=g).to("cuda", torch.bfloat16)
    k = torch.randn(S, D, generator=g).to("cuda", torch.bfloat16)
    w = (torch.randn(T, H, generator=g) * H**-0.5 * D**-0.5).to("cuda")
    return q, k, w


def _kernel_grads(q, k, w, idx, d_scores, relu=True):
    from dsa_ref.kernels.indexer_bwd import index_scores_at_tilelang

    qq, kk, ww = (t.detach().clone().requires_grad_(True) for t in (q, k, w))
    scores = index_scores_at_tilelang(qq, kk, ww, idx, relu=relu)
    scores.backward(d_scores)
    return scores.detach(), qq.grad, kk.grad, ww.grad


def _check_scores(got, ref, idx):
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert torch.equal(torch.isneginf(got), (idx < 0).to(got.device)), "-inf exactly at the -1 slots"
    finite = torch.isfinite(ref)
    if finite.any():
        err, scale = max_abs(got[finite], ref[finite]), float(ref[finite].abs().max())
        assert err < MAX_SCORE * scale, f"scores: max abs error {err:.3e} vs max |score| {scale:.3e}"


def _check_all(q, k, w, idx, d_scores, relu=True):
    """Forward and backward of the kernels against the float64 reference; returns the kernel grads."""
    got, dq, dk, dw = _kernel_grads(q, k, w, idx, d_scores, relu)
    ref, dq_ref, dk_ref, dw_ref = _reference_grads(q, k, w, idx, d_scores, relu)
    _check_scores(got, ref, idx)
    assert dq.dtype == q.dtype and dk.dtype == k.dtype and dw.dtype == w.dtype
    assert dq.shape == q.shape and dk.shape == k.shape and dw.shape == w.shape
    for name, a, b, bound in (("dq", dq, dq_ref, REL_DQ_DK), ("dk", dk, dk_ref, REL_DQ_DK), ("dw", dw, dw_ref, REL_DW)):
        assert torch.isfinite(a).all(), f"{name} has non-finite entries"
        err = rel_l2(a, b)
        assert err < bound, f"{name}: relative L2 error {err:.3e} >= {bound:.0e}"
    empty = (idx < 0).all(dim=1)
    assert (dq[empty] == 0).all() and (dw[empty] == 0).all(), "rows with no valid slot get no gradient"
    unused = torch.ones(k.shape[0], dtype=torch.bool, device=k.device)
    unused[idx[idx >= 0]] = False
    assert (dk[unused] == 0).all(), "keys nobody selected get no gradient"
    return dq, dk, dw


@gpu
@pytest.mark.parametrize("H", [16, 32, 64])
def test_messy_indices_forward_and_backward(H):
    """-1 slots anywhere, duplicates, empty rows, K = 100 (not a multiple of the 64-slot step)."""
    T, S, K = 301, 700, 100
    q, k, w = _inputs(T, S, H, seed=H)
    idx = messy_indices(T, S, K, seed=H)
    g = torch.Generator(device="cpu").manual_seed(100 + H)
    d_scores = torch.randn(T, K, generator=g).cuda()
    d_scores[idx < 0] = float("nan")  # -1 slots carry no gradient, whatever the upstream holds there
    _check_all(q, k, w, idx, d_scores)


@gpu
def test_head_dim_64():
    T, S, K, H = 150, 400, 90, 16
    q, k, w = _inputs(T, S, H, seed=51, D=64)
    idx = messy_indices(T, S, K, seed=52)
    d_scores = torch.randn(T, K, generator=torch.Generator().manual_seed(53)).cuda()
    _check_all(q, k, w, idx, d_scores)


@gpu
@pytest.mark.parametrize("relu", [False, True])
def test_relu_flag(relu):
    T, S, K, H = 200, 500, 130, 64
    q, k, w = _inputs(T, S, H, seed=11)
    idx = messy_indices(T, S, K, seed=12)
    d_scores = torch.randn(T, K, generator=torch.Generator().manual_seed(13)).cuda()
    _check_all(q, k, w, idx, d_scores, relu=relu)


@gpu
def test_causal_topk_2048_long_sequence():
    """A CP rank's 512 queries of one 8192-token causal sequence, top-2048 (early rows end in -1)."""
    cu = torch.tensor([0, 8192])
    query_index = cp_shard_index(cu, 16, 3)  # chunks 3 and 28 of 32: short and full windows
    idx = causal_packed_indices(cu, 2048, query_index=query_index, seed=5)  # [512, 2048]
    assert idx.shape == (512, 2048) and bool((idx < 0).any()) and bool((idx >= 0).all(dim=1).any())
    q, k, w = _inputs(512, 8192, 64, seed=6)
    d_scores = torch.randn(512, 2048, generator=torch.Generator().manual_seed(7)).cuda()
    _check_all(q, k, w, idx, d_scores)


@gpu
@pytest.mark.parametrize("K", [1, 7, 63, 64, 65, 128, 200])
def test_any_number_of_slots(K):
    """One compiled kernel for every K; slots past K are never read or written."""
    T, S, H = 67, 300, 32
    q, k, w = _inputs(T, S, H, seed=K)
    if K == 1:  # messy_indices needs two slots for its duplicates
        idx = torch.randint(-1, S, (T, K), generator=torch.Generator().manual_seed(K)).cuda()
    else:
        idx = messy_indices(T, S, K, seed=K)
    d_scores = torch.randn(T, K, generator=torch.Generator().manual_seed(K)).cuda()
    _check_all(q, k, w, idx, d_scores)


@gpu
def test_int64_and_3d_indices_and_float64_weights():
    """The wrapper's conversions: int64 ``[T, 1, K]`` indices, float64 weights (grad in float64)."""
    T, S, K, H = 50, 90, 70, 16
    q, k, w = _inputs(T, S, H, seed=21)
    idx = messy_indices(T, S, K, seed=22)
    d_scores = torch.randn(T, K, generator=torch.Generator().manual_seed(23)).cuda()
    got, dq, dk, dw = _kernel_grads(q, k, w.double(), idx[:, None, :].long(), d_scores)
    ref, dq_ref, dk_ref, dw_ref = _reference_grads(q, k, w, idx, d_scores)
    _check_scores(got, ref, idx)
    assert dw.dtype == torch.float64 and rel_l2(dw, dw_ref) < REL_DW
    assert rel_l2(dq, dq_ref) < REL_DQ_DK and rel_l2(dk, dk_ref) < REL_DQ_DK


@gpu
def test_equals_lightning_indexer_gathered():
    """Scores and gradients equal those of `lightning_indexer` (fp32 reference) read at the indices."""
    from dsa_ref.kernels.indexer_bwd import index_scores_at_tilelang

    T, S, K, H = 256, 1024, 192, 64
    q, k, w = _inputs(T, S, H, seed=31)
    idx = messy_indices(T, S, K, seed=32)
    upstream = torch.randn(T, K, generator=torch.Generator().manual_seed(33)).cuda()
    results = []
    for which in ("kernel", "lightning_indexer"):
        qq, kk, ww = (t.detach().clone().requires_grad_(True) for t in (q, k, w))
        if which == "kernel":
            scores = index_scores_at_tilelang(qq, kk, ww, idx)
        else:
            full = lightning_indexer(qq, kk, ww)  # [T, S] fp32
            scores = full.gather(1, idx.clamp_min(0)).masked_fill(idx < 0, float("-inf"))
        (torch.where(idx >= 0, scores, 0) * upstream).sum().backward()
        results.append((scores.detach(), qq.grad, kk.grad, ww.grad))
    (s, dq, dk, dw), (s_ref, dq_ref, dk_ref, dw_ref) = results
    _check_scores(s, s_ref, idx)
    assert rel_l2(dw, dw_ref) < REL_DW
    assert rel_l2(dq, dq_ref) < REL_DQ_DK and rel_l2(dk, dk_ref) < REL_DQ_DK


@gpu
def test_no_queries_and_validation():
    from dsa_ref.kernels.indexer_bwd import index_scores_at_supported, index_scores_at_tilelang

    q, k, w = _inputs(0, 10, 16, seed=41)
    idx = torch.zeros(0, 5, dtype=torch.int32, device="cuda")
    assert index_scores_at_tilelang(q, k, w, idx).shape == (0, 5)

    q, k, w = _inputs(4, 10, 16, seed=42)
    idx = torch.zeros(4, 5, dtype=torch.int32, device="cuda")
    assert index_scores_at_supported(q, k, w, idx) is None
    assert "CUDA" in index_scores_at_supported(q.cpu(), k.cpu(), w.cpu(), idx.cpu())
    assert "bfloat16" in index_scores_at_supported(q.float(), k, w, idx)
    assert "H_I" in index_scores_at_supported(q[:, :8], k, w[:, :8], idx)
    with pytest.raises(ValueError, match="k has size 64 in dim 1"):
        index_scores_at_tilelang(q, k[:, :64], w, idx)
    with pytest.raises(ValueError, match="weights has size 3 in dim 0"):
        index_scores_at_tilelang(q, k, w[:3], idx)
    with pytest.raises(ValueError, match=r"indices values must be -1"):
        index_scores_at_tilelang(q, k, w, idx + 10)
    with pytest.raises(ValueError, match="one row per query"):
        index_scores_at_tilelang(q, k, w, idx[:3])


@gpu
def test_validate_false_skips_the_range_check_only():
    """``validate=False`` (the layer's own slots) gives bit-identical scores and the same gradients on
    valid indices; the default raises ValueError for an index out of range."""
    from dsa_ref.kernels.indexer_bwd import index_scores_at_tilelang

    q, k, w = _inputs(97, 300, 64, seed=6)
    idx = messy_indices(97, 300, 128, seed=6)
    results = []
    for validate in (True, False):
        qq, kk, ww = (t.detach().clone().requires_grad_(True) for t in (q, k, w))
        scores = index_scores_at_tilelang(qq, kk, ww, idx, validate=validate)
        torch.where(torch.isfinite(scores), scores, 0).sum().backward()
        results.append((scores, qq.grad, kk.grad, ww.grad))
    assert torch.equal(results[0][0], results[1][0])
    for a, b in zip(results[0][1:], results[1][1:]):  # the key gradient adds atomically: order may differ
        assert rel_l2(a, b) < 1e-3
    bad = idx.clone()
    bad[4, 0] = 300
    with pytest.raises(ValueError, match=r"values must be -1 \(unused slot\) or in \[0, num_keys=300\)"):
        index_scores_at_tilelang(q, k, w, bad)
