"""The DSA layer (`DSAttention`) and its two training stages.

* output shapes in both stages, packed input with length-1 sequences;
* gradient boundaries (pitfall P13): the indexer learns only from the KL (backward of the output
  with ``loss_scale=0`` leaves its gradients zero; the KL alone leaves the main MLA without
  gradient), the main MLA learns from the output;
* `IndexerLossAutoScaler`: ``loss_scale=2`` doubles the indexer gradients and equals autograd of
  ``2 * loss``; `set_indexer_loss_scale` reaches every layer;
* the dense warm-up really is dense: it equals `AbsorbedMLA` (and `MLA`) with the same weights;
  the sparse stage with ``topk >=`` every sequence length equals the warm-up (pitfall P2);
* `trainable_parameters` per stage; bad stage/backend strings; the config's ``use_relu`` reaches
  the indexer scores;
* a tiny warm-up training loop: Adam on the indexer only lowers the KL clearly and raises the top-k
  recall of the true attention mass.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dsa_ref.absorbed_mla import AbsorbedMLA
from dsa_ref.config import tiny
from dsa_ref.dsa import DSAOutput, DSAttention, IndexerLossAutoScaler, set_indexer_loss_scale
from dsa_ref.indexer import lightning_indexer, topk_indices
from dsa_ref.indexer_loss import indexer_loss, indexer_target
from dsa_ref.layout import key_windows, positions
from dsa_ref.sparse_attention import sparse_mla

STAGES = ("dense_warmup", "sparse")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_layer(seed=0, *, topk=None, dtype=torch.float64, stage="sparse", cfg=None, **kw) -> DSAttention:
    cfg = cfg or tiny()
    if topk is not None:
        cfg = cfg.with_topk(topk)
    torch.manual_seed(seed)
    return DSAttention(cfg, stage=stage, dtype=dtype, **kw)


def make_x(T, seed=1, dtype=torch.float64, dim=None):
    dim = dim or tiny().mla.dim
    return torch.randn(T, dim, generator=_gen(seed), dtype=torch.float64).to(dtype)


def indexer_params(m):
    return dict(m.indexer.named_parameters())


def main_params(m):
    return dict(m.mla.named_parameters())


def grads(params: dict) -> dict:
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in params.items()}


def zero_or_none(g) -> bool:
    return g is None or bool((g == 0).all())


# ---------------------------------------------------------------------------------------------
# shapes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("cu_list", [None, [0, 1, 13, 14, 30]])
def test_output_shapes(stage, cu_list):
    m = make_layer(stage=stage)
    cfg = m.config
    T = 30
    x = make_x(T)
    cu = None if cu_list is None else torch.tensor(cu_list)
    out = m(x, cu)
    assert isinstance(out, DSAOutput)
    assert out.output.shape == (T, cfg.mla.dim) and out.output.dtype == torch.float64
    assert out.indexer_loss.dim() == 0 and out.indexer_loss.dtype == torch.float64
    assert out.topk_indices.shape == (T, cfg.indexer.topk) and out.topk_indices.dtype == torch.int64
    assert bool(torch.isfinite(out.output).all()) and torch.isfinite(out.indexer_loss)
    assert out.indexer_loss.item() >= 0
    # the selection is causal and per sequence; short windows are padded with -1
    starts, ends = key_windows(cu if cu is not None else torch.tensor([0, T]))
    for t in range(T):
        row = out.topk_indices[t]
        sel = row[row >= 0]
        assert len(sel) == min(cfg.indexer.topk, int(ends[t] - starts[t]))
        assert bool(((sel >= starts[t]) & (sel < ends[t])).all())


def test_packed_equals_per_sequence_loop():
    """Packed THD with a length-1 sequence == each sequence on its own (outputs and selections)."""
    m = make_layer(3)
    cu = torch.tensor([0, 1, 12, 13, 29])
    x = make_x(29, seed=4)
    for stage in STAGES:
        packed = m(x, cu, stage=stage)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            alone = m(x[a:b], stage=stage)
            torch.testing.assert_close(packed.output[a:b], alone.output, rtol=0, atol=1e-12)
            sel = packed.topk_indices[a:b]
            assert torch.equal(torch.where(sel >= 0, sel - a, sel), alone.topk_indices)
    # a lone length-1 sequence attends to itself only
    one = m(x[:1], stage="sparse")
    assert one.topk_indices.tolist() == [[0] + [-1] * (m.config.indexer.topk - 1)]
    assert bool(torch.isfinite(one.output).all())


# ---------------------------------------------------------------------------------------------
# gradient boundaries
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", STAGES)
def test_indexer_learns_only_from_the_kl(stage):
    m = make_layer(5, stage=stage)
    cu = torch.tensor([0, 9, 24])
    x = make_x(24, seed=6).requires_grad_()
    set_indexer_loss_scale(m, 0.0)
    out = m(x, cu)
    out.output.sum().backward()
    ig = grads(indexer_params(m))
    # the indexer params take part in the graph (zero gradients, not missing ones) ...
    assert all(g is not None for g in ig.values()), [n for n, g in ig.items() if g is None]
    # ... but the output gradient never reaches them
    assert all(bool((g == 0).all()) for g in ig.values()), {n: g.abs().max().item() for n, g in ig.items()}
    # the main MLA does learn from the output, every one of its weights
    mg = grads(main_params(m))
    assert all(g is not None and g.abs().max() > 0 for g in mg.values()), \
        {n: None if g is None else g.abs().max().item() for n, g in mg.items()}


@pytest.mark.parametrize("stage", STAGES)
def test_kl_alone_reaches_only_the_indexer(stage):
    m = make_layer(7, stage=stage)
    x = make_x(20, seed=8).requires_grad_()
    out = m(x, torch.tensor([0, 3, 20]))
    out.indexer_loss.backward()
    for n, g in grads(main_params(m)).items():
        assert zero_or_none(g), n
    assert x.grad is None  # the indexer reads detached inputs
    ig = grads(indexer_params(m))
    # every indexer weight gets a nonzero gradient from the KL
    assert all(g is not None and g.abs().max() > 0 for g in ig.values()), \
        {n: None if g is None else g.abs().max().item() for n, g in ig.items()}


@pytest.mark.parametrize("stage", STAGES)
def test_one_backward_trains_both(stage):
    """out.output.sum().backward() with loss_scale=1 gives the indexer exactly the KL gradient and
    the main MLA exactly the output gradient."""
    m = make_layer(9, stage=stage)
    x = make_x(18, seed=10)
    cu = torch.tensor([0, 18])
    out = m(x, cu)
    out.output.sum().backward()
    both_i, both_m = grads(indexer_params(m)), grads(main_params(m))
    m.zero_grad(set_to_none=True)
    out = m(x, cu)
    kl_i = torch.autograd.grad(out.indexer_loss, list(indexer_params(m).values()))
    m.zero_grad(set_to_none=True)
    set_indexer_loss_scale(m, 0.0)
    out = m(x, cu)
    out_m = torch.autograd.grad(out.output.sum(), list(main_params(m).values()))
    for (n, g), ref in zip(both_i.items(), kl_i):
        torch.testing.assert_close(g, ref, rtol=1e-12, atol=1e-14, msg=n)
    for (n, g), ref in zip(both_m.items(), out_m):
        torch.testing.assert_close(g, ref, rtol=1e-12, atol=1e-14, msg=n)


@pytest.mark.parametrize("stage", STAGES)
def test_loss_scale(stage):
    m = make_layer(11, stage=stage)
    x = make_x(16, seed=12)
    cu = torch.tensor([0, 5, 16])

    def indexer_grads(scale):
        m.zero_grad(set_to_none=True)
        set_indexer_loss_scale(m, scale)
        out = m(x, cu)
        out.output.sum().backward()
        return [p.grad.clone() for p in m.indexer.parameters()], out

    g1, _ = indexer_grads(1.0)
    g2, out2 = indexer_grads(2.0)
    gt, _ = indexer_grads(torch.tensor(2.0, dtype=torch.float64))  # a tensor scale works too
    m.zero_grad(set_to_none=True)
    out = m(x, cu)
    direct = torch.autograd.grad(2 * out.indexer_loss, list(m.indexer.parameters()))
    assert any(g.abs().max() > 0 for g in g1)
    for a, b, c, d in zip(g1, g2, gt, direct):
        torch.testing.assert_close(b, 2 * a, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(b, d, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(c, b, rtol=0, atol=0)
    # the loss value and the output are unaffected by the scale
    torch.testing.assert_close(out2.indexer_loss, out.indexer_loss, rtol=0, atol=0)
    torch.testing.assert_close(out2.output, out.output, rtol=0, atol=0)


@pytest.mark.parametrize("scale", [3.0, 3, torch.tensor(3.0), torch.tensor(3.0, dtype=torch.float64)])
def test_auto_scaler_function(scale):
    out = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, dtype=torch.float64, requires_grad=True)
    loss = (w ** 2).sum()
    y = IndexerLossAutoScaler.apply(out, loss, scale)
    torch.testing.assert_close(y, out, rtol=0, atol=0)
    g = torch.randn(3, 4, dtype=torch.float64)
    y.backward(g)
    torch.testing.assert_close(out.grad, g, rtol=0, atol=0)  # the output gradient passes through
    torch.testing.assert_close(w.grad, 3.0 * 2 * w.detach(), rtol=0, atol=1e-15)  # d(3 * loss)/dw


def test_set_indexer_loss_scale_sets_all_layers():
    layers = torch.nn.ModuleList([make_layer(i) for i in range(3)])
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ModuleDict({"a": layers}))
    set_indexer_loss_scale(model, 0.25)
    assert [m.loss_scale for m in layers] == [0.25] * 3
    set_indexer_loss_scale(layers[1], 4)
    assert [m.loss_scale for m in layers] == [0.25, 4, 0.25]
    with pytest.raises(TypeError, match="scale"):
        set_indexer_loss_scale(model, "1")
    with pytest.raises(TypeError, match="scale"):
        set_indexer_loss_scale(model, True)
    with pytest.raises(ValueError, match="scale"):
        set_indexer_loss_scale(model, torch.ones(2))


# ---------------------------------------------------------------------------------------------
# the stages against dense attention
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cu_list", [[0, 24], [0, 1, 9, 24]])
def test_dense_warmup_equals_absorbed_mla(cu_list):
    m = make_layer(13, stage="dense_warmup")
    cu = torch.tensor(cu_list)
    x = make_x(24, seed=14)
    out = m(x, cu)
    ref_abs = AbsorbedMLA(m.mla)(x, cu)
    ref_dense = m.mla(x, cu)
    torch.testing.assert_close(out.output, ref_abs, rtol=0, atol=1e-13)
    torch.testing.assert_close(out.output, ref_dense, rtol=0, atol=1e-12)
    # and really dense: sparse attention over the layer's own top-8 gives something else
    sparse = m(x, cu, stage="sparse")
    assert (sparse.output - out.output).abs().max() > 1e-6


def test_sparse_with_topk_at_least_seq_len_equals_dense_warmup():
    cu = torch.tensor([0, 1, 7, 19, 20])  # longest sequence 12
    x = make_x(20, seed=15).requires_grad_()
    for topk in (12, 13, 40):
        m = make_layer(16, topk=topk)
        sparse = m(x, cu, stage="sparse")
        dense = m(x, cu, stage="dense_warmup")
        torch.testing.assert_close(sparse.output, dense.output, rtol=0, atol=1e-13)
        torch.testing.assert_close(sparse.indexer_loss, dense.indexer_loss, rtol=1e-13, atol=0)
        assert torch.equal(sparse.topk_indices, dense.topk_indices)
        # gradients of everything agree as well
        params = [x] + list(m.parameters())
        gs = torch.autograd.grad(sparse.output.sum(), params)
        gd = torch.autograd.grad(dense.output.sum(), params)
        for a, b in zip(gs, gd):
            torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-13)


def test_sparse_stage_is_sparse_mla_over_the_selection():
    m = make_layer(17)
    cu = torch.tensor([0, 10, 30])
    x = make_x(30, seed=18)
    out = m(x, cu)
    pos = positions(cu)
    p = m.mla.project(x, pos)
    q, kv = m.absorbed.absorbed_qkv(p)
    o_lat, _ = sparse_mla(q, kv, out.topk_indices, sm_scale=m.mla.softmax_scale, d_v=m.config.mla.kv_lora_rank)
    torch.testing.assert_close(out.output, m.absorbed.output(o_lat), rtol=0, atol=1e-13)
    # the selection is the canonical top-k of the indexer scores; the loss is the sparse KL
    starts, ends = key_windows(cu)
    qi, ki, wi = m.indexer.project(x, p.qr, pos)
    scores = lightning_indexer(qi, ki, wi, starts=starts, ends=ends)
    assert torch.equal(out.topk_indices, topk_indices(scores, m.config.indexer.topk))
    ref = indexer_loss(scores, q, kv, sm_scale=m.mla.softmax_scale, starts=starts, ends=ends,
                       topk_indices=out.topk_indices)
    torch.testing.assert_close(out.indexer_loss, ref, rtol=1e-13, atol=0)


@pytest.mark.parametrize("use_relu", [True, False])
def test_config_use_relu_reaches_the_scores(use_relu):
    cfg = tiny()
    cfg = replace(cfg, indexer=replace(cfg.indexer, use_relu=use_relu))
    m = make_layer(19, cfg=cfg, stage="dense_warmup")
    cu = torch.tensor([0, 20])
    x = make_x(20, seed=20)
    out = m(x, cu)
    pos = positions(cu)
    starts, ends = key_windows(cu)
    p = m.mla.project(x, pos)
    q, kv = m.absorbed.absorbed_qkv(p)
    qi, ki, wi = m.indexer.project(x, p.qr, pos)
    losses = {}
    for relu in (True, False):
        s = lightning_indexer(qi, ki, wi, starts=starts, ends=ends, relu=relu)
        losses[relu] = indexer_loss(s, q, kv, sm_scale=m.mla.softmax_scale, starts=starts, ends=ends)
    assert abs(losses[True].item() - losses[False].item()) > 1e-6  # the flag matters here
    torch.testing.assert_close(out.indexer_loss, losses[use_relu], rtol=1e-13, atol=0)


def test_bf16_layer_runs_close_to_float64():
    """A bf16 layer (weights_proj in float32) against the float64 layer with the same weights.
    Weights and activations are rounded to bf16 (2^-9 relative) through ~6 matmuls, so outputs
    agree to a few percent of their scale; the KL (a float32 computation on bf16 inputs) to ~5%."""
    m64 = make_layer(21)
    m16 = make_layer(21, dtype=torch.bfloat16)
    m16.load_state_dict(m64.state_dict())
    assert m16.indexer.weights_proj.weight.dtype == torch.float32
    x = make_x(24, seed=22)
    cu = torch.tensor([0, 24])
    for stage in STAGES:
        o64 = m64(x, cu, stage=stage)
        o16 = m16(x.bfloat16(), cu, stage=stage)
        assert o16.output.dtype == torch.bfloat16 and o16.indexer_loss.dtype == torch.float32
        if stage == "sparse":  # the bf16 indexer may pick other keys on near-ties: compare the dense part
            continue
        scale = o64.output.abs().max().item()
        torch.testing.assert_close(o16.output.double(), o64.output, rtol=0, atol=0.05 * scale)
        assert o16.indexer_loss.item() == pytest.approx(o64.indexer_loss.item(), rel=0.05)
    o16.output.float().sum().backward()
    assert all(p.grad is not None and bool(torch.isfinite(p.grad.float()).all()) for p in m16.indexer.parameters())


# ---------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------


def test_trainable_parameters_per_stage():
    m = make_layer(23, stage="dense_warmup")
    warm = m.trainable_parameters()
    assert {id(p) for p in warm} == {id(p) for p in m.indexer.parameters()}
    assert {id(p) for p in m.trainable_parameters("sparse")} == {id(p) for p in m.parameters()}
    assert len(m.trainable_parameters("sparse")) == len(list(m.mla.parameters())) + len(warm)
    m.stage = "sparse"
    assert {id(p) for p in m.trainable_parameters()} == {id(p) for p in m.parameters()}
    assert {id(p) for p in m.trainable_parameters("dense_warmup")} == {id(p) for p in m.indexer.parameters()}
    with pytest.raises(ValueError, match="stage"):
        m.trainable_parameters("warmup")


def test_bad_stage_and_backend_raise():
    cfg = tiny()
    for bad in ("dense", "Sparse", "", None):
        with pytest.raises(ValueError, match="stage"):
            DSAttention(cfg, stage=bad)
    with pytest.raises(ValueError, match="backend"):
        DSAttention(cfg, backend="cuda")
    with pytest.raises(ValueError, match="backend"):
        DSAttention(cfg, backend="Reference")
    with pytest.raises(TypeError, match="config"):
        DSAttention(cfg.mla)
    m = DSAttention(cfg, dtype=torch.float64)
    x = make_x(6)
    with pytest.raises(ValueError, match="stage"):
        m(x, stage="train")
    with pytest.raises(ValueError, match="^x "):
        m(x[:, :5])
    with pytest.raises(ValueError, match="cu_seqlens"):
        m(x, torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        m(x, torch.tensor([0, 4, 3, 6]))


def test_auto_backend_on_cpu_equals_reference():
    ref = make_layer(24)
    auto = make_layer(24, backend="auto")
    x = make_x(14, seed=25)
    a, b = ref(x), auto(x)
    torch.testing.assert_close(a.output, b.output, rtol=0, atol=0)
    assert torch.equal(a.topk_indices, b.topk_indices)
    tl = make_layer(24, backend="tilelang")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="tilelang"):
            tl(x)


def test_no_grad_forward():
    m = make_layer(26)
    with torch.no_grad():
        out = m(make_x(10))
    assert not out.output.requires_grad and not out.indexer_loss.requires_grad


# ---------------------------------------------------------------------------------------------
# a tiny dense warm-up
# ---------------------------------------------------------------------------------------------


def test_dense_warmup_training_lowers_kl_and_raises_recall():
    """Adam on the indexer only, dense warm-up, fixed inputs (T=64, topk=8): the KL falls to a small
    fraction of its start and the top-k selection catches most of the true attention mass.

    The main MLA's up-projections are scaled by 3 so the target attention is peaked (a freshly
    initialised MLA attends almost uniformly, and recall of a uniform target says little).
    """
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: one thread is fastest and immune to a busy machine
    try:
        m = make_layer(0, stage="dense_warmup", dtype=torch.float32)
        with torch.no_grad():
            m.mla.wq_b.weight.mul_(3.0)
            m.mla.wkv_b.weight.mul_(3.0)
        T, topk = 64, m.config.indexer.topk
        assert topk == 8
        x = make_x(T, seed=1, dtype=torch.float32)
        cu = torch.tensor([0, T])
        starts, ends = key_windows(cu)
        with torch.no_grad():
            q, kv = m.absorbed.absorbed_qkv(m.mla.project(x, positions(cu)))
            target = indexer_target(q, kv, sm_scale=m.mla.softmax_scale, starts=starts, ends=ends)  # [T, T]
        rows = slice(topk, T)  # rows whose window is longer than topk (shorter ones have recall 1)
        best = target.topk(topk, dim=-1).values.sum(-1)[rows].mean().item()

        def recall(sel):
            got = torch.where(sel >= 0, target.gather(1, sel.clamp_min(0)), torch.zeros(()))
            return got.sum(-1)[rows].mean().item()

        main_before = {n: p.detach().clone() for n, p in m.mla.named_parameters()}
        opt = torch.optim.Adam(m.trainable_parameters(), lr=3e-2)
        losses, recalls = [], []
        for _ in range(60):
            out = m(x, cu)
            losses.append(out.indexer_loss.item())
            recalls.append(recall(out.topk_indices))
            opt.zero_grad(set_to_none=True)
            out.output.sum().backward()  # one backward: the auto-scaler carries the KL gradient
            opt.step()
        out = m(x, cu)
        losses.append(out.indexer_loss.item())
        recalls.append(recall(out.topk_indices))
    finally:
        torch.set_num_threads(prev_threads)

    assert losses[-1] < 0.5 * losses[0], losses[::10]
    assert losses[-1] < 0.2 * losses[0], losses[::10]
    assert recalls[-1] > recalls[0] + 0.3, recalls[::10]
    assert recalls[-1] > 0.9 * best, (recalls[-1], best)
    # the main attention did not move (only the indexer was optimised, and the KL never reaches it)
    for n, p in m.mla.named_parameters():
        assert torch.equal(p.detach(), main_before[n]), n
