"""Packed THD: a pack of sequences behaves exactly like each sequence run on its own (pitfall P8).

One pack is used throughout. Its sequences are shorter than, equal to and longer than ``topk``
(tiny: 8), one has a single token, and there are zero-length sequences at the front, in the middle
and at the end of ``cu_seqlens``. The MLA weights are scaled by 3 so that the main attention is
peaky and the top-k selection really changes the sparse output.

* `DSAttention`, both stages, both loss reductions: packed == each sequence alone for outputs,
  x gradients, every parameter gradient, the indexer loss and the top-k indices (offset by the
  sequence start). For ``"mean"`` the packed loss is the mean over all valid rows of the pack, i.e.
  the row-count-weighted average of the per-sequence losses; for ``"sum"`` it is their sum. The
  per-sequence runs therefore use ``loss_scale = n_i / N`` so that their summed parameter gradients
  are those of the pack.
* perturbing one sequence's tokens leaves the other sequences' outputs, indices and x gradients
  bit-identical (``torch.equal``), and does change its own;
* no selected index of a query lies outside its own causal window; a row keeps
  ``min(topk, window)`` valid slots, then ``-1``; rows with a window of at most ``topk`` keys get
  the dense output in the sparse stage, longer rows do not;
* the RoPE positions the layer uses restart at 0 in every sequence;
* the indexer scores are ``-inf`` exactly outside the window;
* the functional chain `lightning_indexer` -> `topk_indices` -> `indexer_loss` (both stages,
  both reductions, chunk sizes that cut across sequence boundaries) on packed windows equals the
  per-sequence calls, and so does the gradient of the loss with respect to the scores;
* negative control: a plain causal mask over the whole pack (no ``cu_seqlens``) does leak, and
  the comparison used above detects it.
"""

from __future__ import annotations

import pytest
import torch

from dsa_ref import DSAttention, set_indexer_loss_scale, tiny
from dsa_ref.indexer import lightning_indexer, topk_indices
from dsa_ref.indexer_loss import indexer_loss
from dsa_ref.layout import key_windows, one_sequence, positions, window_mask

STAGES = ("dense_warmup", "sparse")
REDUCTIONS = ("mean", "sum")
TOPK = tiny().indexer.topk  # 8
# zero-length at the front, middle and end; 5 < topk, 8 == topk, 1, 19 > topk, 3 < topk, 12 > topk
LENGTHS = [0, 5, 8, 0, 1, 19, 3, 12, 0]
ATOL = 1e-11  # float64; packed and per-sequence runs only differ in matrix shapes


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: more threads only add synchronisation (and slow down badly on a loaded machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def cu_of(lengths) -> torch.Tensor:
    return torch.tensor([0] + list(lengths)).cumsum(0)


CU = cu_of(LENGTHS)
T = int(CU[-1])
SEQS = [(a, b) for a, b in zip(CU[:-1].tolist(), CU[1:].tolist()) if b > a]  # non-empty sequences


def test_the_pack_covers_every_case():
    sizes = [b - a for a, b in SEQS]
    assert 1 in sizes and TOPK in sizes
    assert any(n < TOPK for n in sizes if n > 1) and any(n > TOPK for n in sizes)
    assert sum(1 for n in LENGTHS if n == 0) == 3 and LENGTHS[0] == 0 and LENGTHS[-1] == 0


def make_layer(stage="sparse", reduction="mean", seed=0) -> DSAttention:
    torch.manual_seed(seed)
    layer = DSAttention(tiny(), stage=stage, loss_reduction=reduction, loss_coeff=0.7, dtype=torch.float64)
    with torch.no_grad():  # peaky main attention: the selection matters
        for p in layer.mla.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    return layer


def inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    dim = tiny().mla.dim
    x = torch.randn(T, dim, generator=g, dtype=torch.float64)
    w_out = torch.randn(T, dim, generator=g, dtype=torch.float64)  # a fixed "LM loss" direction
    return x, w_out


def run(layer, x, w_out, cu=None, stage=None):
    """Forward + backward of ``sum(output * w_out)``; returns (result, x.grad, {name: param grad})."""
    x = x.clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    res = layer(x, cu, stage=stage)
    (res.output * w_out).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return res, x.grad.clone(), grads


def offset(idx: torch.Tensor, start: int) -> torch.Tensor:
    return torch.where(idx >= 0, idx + start, idx)


# ---------------------------------------------------------------------------------------------
# DSAttention: packed == each sequence alone
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("stage", STAGES)
def test_layer_packed_equals_each_sequence_alone(stage, reduction):
    layer = make_layer(stage, reduction)
    x, w_out = inputs()
    packed, dx, grads = run(layer, x, w_out, CU)

    alone_grads: dict[str, torch.Tensor] = {}
    weighted_loss = torch.zeros((), dtype=torch.float64)
    for a, b in SEQS:
        n = b - a  # every token sees at least itself: every row of the sequence is a valid loss row
        # the pack's mean divides by all T rows: a sequence alone must weigh its loss by n / T
        set_indexer_loss_scale(layer, n / T if reduction == "mean" else 1.0)
        alone, dx_alone, g_alone = run(layer, x[a:b], w_out[a:b])
        where = f"sequence [{a}, {b}), {stage}, {reduction}"
        torch.testing.assert_close(packed.output[a:b], alone.output, rtol=0, atol=ATOL, msg=where)
        torch.testing.assert_close(dx[a:b], dx_alone, rtol=0, atol=ATOL, msg=where)
        assert torch.equal(packed.topk_indices[a:b], offset(alone.topk_indices, a)), where
        for name, g in g_alone.items():
            alone_grads[name] = alone_grads.get(name, 0) + g
        weighted_loss = weighted_loss + (n / T if reduction == "mean" else 1.0) * alone.indexer_loss.detach()

    torch.testing.assert_close(packed.indexer_loss.detach(), weighted_loss, rtol=1e-12, atol=1e-14)
    assert set(grads) == set(alone_grads) == {n for n, _ in layer.named_parameters()}
    for name in grads:
        scale = grads[name].abs().max().item()
        assert scale > 0, f"{name} got no gradient: the comparison would be vacuous"
        torch.testing.assert_close(grads[name], alone_grads[name], rtol=1e-10, atol=ATOL * max(1.0, scale),
                                   msg=f"grad {name}, {stage}, {reduction}")


def test_mean_loss_is_not_the_plain_average_of_sequences():
    """The pack's "mean" weighs sequences by their rows; the unweighted average is a different number."""
    layer = make_layer("sparse", "mean")
    x, _ = inputs()
    with torch.no_grad():
        packed = layer(x, CU).indexer_loss
        per_seq = torch.stack([layer(x[a:b]).indexer_loss for a, b in SEQS])
    sizes = torch.tensor([b - a for a, b in SEQS], dtype=torch.float64)
    torch.testing.assert_close(packed, (sizes * per_seq).sum() / T, rtol=1e-12, atol=1e-14)
    assert abs(packed.item() - per_seq.mean().item()) > 1e-3 * packed.item()


@pytest.mark.parametrize("stage", STAGES)
def test_perturbing_one_sequence_leaves_the_others_bit_identical(stage):
    layer = make_layer(stage)
    x, w_out = inputs()
    base, dx_base, _ = run(layer, x, w_out, CU)
    g = torch.Generator().manual_seed(99)
    for a, b in SEQS:
        x2 = x.clone()
        x2[a:b] = torch.randn(b - a, x.shape[1], generator=g, dtype=torch.float64)
        res, dx, _ = run(layer, x2, w_out, CU)
        others = torch.ones(T, dtype=torch.bool)
        others[a:b] = False
        where = f"perturbed [{a}, {b}), {stage}"
        assert torch.equal(res.output[others], base.output[others]), where
        assert torch.equal(res.topk_indices[others], base.topk_indices[others]), where
        assert torch.equal(dx[others], dx_base[others]), where
        # ... and the perturbation did reach its own sequence
        assert (res.output[a:b] - base.output[a:b]).abs().max() > 1e-3, where


def test_plain_causal_mask_over_the_pack_leaks():
    """Negative control: without cu_seqlens the pack is one long sequence, and later sequences
    attend into earlier ones; the per-sequence comparison above catches it."""
    layer = make_layer("sparse")
    x, _ = inputs()
    with torch.no_grad():
        leaky = layer(x)  # one causal sequence of T tokens
        a, b = SEQS[-1]
        alone = layer(x[a:b])
    assert (leaky.output[a:b] - alone.output).abs().max() > 1e-3
    # the leak is visible in the selection: keys before the sequence start get picked
    assert bool((leaky.topk_indices[a:b] >= 0).logical_and(leaky.topk_indices[a:b] < a).any())


@pytest.mark.parametrize("stage", STAGES)
def test_selection_stays_inside_each_window(stage):
    layer = make_layer(stage)
    x, _ = inputs()
    with torch.no_grad():
        res = layer(x, CU)
        dense = layer(x, CU, stage="dense_warmup")
    starts, ends = key_windows(CU)
    idx = res.topk_indices
    valid = idx >= 0
    # every selected key lies in the query's own sequence, at or before the query
    assert bool(((idx >= starts[:, None]) & (idx < ends[:, None]) | ~valid).all())
    # min(topk, window) valid slots, then -1 padding; no key twice
    k_eff = torch.clamp(ends - starts, max=TOPK)
    assert torch.equal(valid.sum(1), k_eff)
    assert torch.equal(valid, torch.arange(TOPK)[None, :] < k_eff[:, None])
    for t in range(T):
        sel = idx[t][valid[t]]
        assert sel.unique().numel() == sel.numel()
    # a window of at most topk keys is selected whole, so the sparse output is the dense one;
    # longer windows drop keys and (peaky attention) the output changes
    short = (ends - starts) <= TOPK
    torch.testing.assert_close(res.output[short], dense.output[short], rtol=0, atol=ATOL)
    if stage == "sparse":
        diff = (res.output[~short] - dense.output[~short]).abs().amax(dim=1)
        assert bool((diff > 1e-6).all()), "top-k dropped keys but the output did not change"


def test_rope_positions_restart_in_every_sequence(monkeypatch):
    """RoPE scores depend only on t - s, so wrong positions hardly show in outputs: check them directly."""
    layer = make_layer("sparse")
    x, _ = inputs()
    seen = {}
    for name, module in (("mla", layer.mla), ("indexer", layer.indexer)):
        original = module.project

        def spy(*args, _name=name, _original=original):
            seen[_name] = args[-1].clone()  # both project(...) methods take pos last
            return _original(*args)

        monkeypatch.setattr(module, "project", spy)
    with torch.no_grad():
        layer(x, CU)
    expected = torch.cat([torch.arange(n) for n in LENGTHS])
    assert torch.equal(positions(CU), expected)
    assert torch.equal(seen["mla"], expected) and torch.equal(seen["indexer"], expected)


def test_indexer_scores_are_minus_inf_exactly_outside_the_window():
    layer = make_layer("sparse")
    x, _ = inputs()
    pos = positions(CU)
    starts, ends = key_windows(CU)
    with torch.no_grad():
        p = layer.mla.project(x, pos)
        q_i, k_i, w_i = layer.indexer.project(x, p.qr, pos)
        scores = lightning_indexer(q_i, k_i, w_i, starts=starts, ends=ends)
        res = layer(x, CU)
    inside = window_mask(starts, ends, T)
    assert bool((scores[~inside] == float("-inf")).all())
    assert bool(torch.isfinite(scores[inside]).all())
    # block-diagonal: no finite score pairs tokens of two sequences
    seq = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
    assert not bool((torch.isfinite(scores) & (seq[:, None] != seq[None, :])).any())
    # these are the scores the layer selected from
    assert torch.equal(topk_indices(scores, TOPK), res.topk_indices)


# ---------------------------------------------------------------------------------------------
# the functional chain on packed windows
# ---------------------------------------------------------------------------------------------


def functional_inputs(seed=5):
    g = torch.Generator().manual_seed(seed)
    cfg = tiny()
    H_I, D_I = cfg.indexer.n_heads, cfg.indexer.head_dim
    H, D = cfg.mla.n_heads, cfg.mla.latent_dim
    f64 = dict(generator=g, dtype=torch.float64)
    q_i = torch.randn(T, H_I, D_I, **f64)
    k_i = torch.randn(T, D_I, **f64)
    w_i = torch.randn(T, H_I, **f64) * (H_I * D_I) ** -0.5  # signed head weights, as the real ones are
    q = torch.randn(T, H, D, **f64) * 2.0
    kv = torch.randn(T, D, **f64)
    return q_i, k_i, w_i, q, kv


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("stage", STAGES)
def test_functional_chain_packed_equals_each_sequence(stage, reduction):
    q_i, k_i, w_i, q, kv = functional_inputs()
    sm_scale = tiny().mla.softmax_scale
    starts, ends = key_windows(CU)
    # chunk sizes that do not line up with sequence boundaries
    scores = lightning_indexer(q_i, k_i, w_i, starts=starts, ends=ends, chunk_size=5)
    scores = scores.detach().requires_grad_(True)
    idx = topk_indices(scores, TOPK, chunk_size=7)
    loss = indexer_loss(scores, q, kv, sm_scale=sm_scale, starts=starts, ends=ends,
                        topk_indices=idx if stage == "sparse" else None, reduction=reduction, chunk_size=3)
    loss.backward()

    expected_loss = torch.zeros((), dtype=torch.float64)
    outside = torch.ones(T, T, dtype=torch.bool)
    for a, b in SEQS:
        n = b - a
        s1, e1 = key_windows(one_sequence(n))
        sc = lightning_indexer(q_i[a:b], k_i[a:b], w_i[a:b], starts=s1, ends=e1)
        torch.testing.assert_close(scores.detach()[a:b, a:b], sc, rtol=0, atol=1e-12)
        id1 = topk_indices(sc, TOPK)
        assert torch.equal(idx[a:b], offset(id1, a))
        sc = sc.requires_grad_(True)
        l1 = indexer_loss(sc, q[a:b], kv[a:b], sm_scale=sm_scale, starts=s1, ends=e1,
                          topk_indices=id1 if stage == "sparse" else None, reduction=reduction)
        l1.backward()
        weight = n / T if reduction == "mean" else 1.0
        expected_loss = expected_loss + weight * l1.detach()
        torch.testing.assert_close(scores.grad[a:b, a:b], weight * sc.grad, rtol=1e-10, atol=1e-14)
        outside[a:b, a:b] = False
    torch.testing.assert_close(loss.detach(), expected_loss, rtol=1e-12, atol=1e-14)
    # nothing of a query's loss lands on another sequence's keys
    assert bool((scores.grad[outside] == 0).all())
    assert bool((scores.detach()[outside] == float("-inf")).all())


def test_loss_row_mask_leaves_padding_out_of_the_loss():
    """Padding packed as its own sequence, masked out of the loss: the loss and the indexer
    gradients equal those of the real tokens alone, and padding rows get no KL gradient."""
    import torch as _torch

    from dsa_ref import DSAttention, tiny

    _torch.manual_seed(3)
    cfg = tiny()
    layer = DSAttention(cfg, dtype=_torch.float64)
    x = _torch.randn(24, cfg.mla.dim, dtype=_torch.float64)
    real = layer(x[:18], _torch.tensor([0, 10, 18]))
    mask = _torch.arange(24) < 18
    padded = layer(x, _torch.tensor([0, 10, 18, 24]), loss_row_mask=mask)
    _torch.testing.assert_close(padded.indexer_loss, real.indexer_loss, atol=1e-12, rtol=0)
    g_real = _torch.autograd.grad(real.indexer_loss, list(layer.indexer.parameters()))
    g_pad = _torch.autograd.grad(padded.indexer_loss, list(layer.indexer.parameters()))
    for a, b in zip(g_real, g_pad):
        _torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    bad = _torch.ones(23, dtype=_torch.bool)
    with pytest.raises(ValueError, match="row_mask"):
        layer(x, _torch.tensor([0, 10, 18, 24]), loss_row_mask=bad)
