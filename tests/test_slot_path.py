"""The slot path (`dsa_ref.slot_path`): the layer's steps 4-5 on ``[T, K]`` slot tensors.

The kernel path of `DSAttention` computes the attention and the indexer loss from per-slot
quantities (`index_scores_at`, `attention_head_sum`, `indexer_loss_on_slots`). Here, with the
reference implementations of those steps, it must equal the readable layer exactly (float64, to
rounding) in both stages: outputs, loss, and the gradients of the input and of every parameter;
on packed sequences, with a padding mask and with a global loss divisor (context parallelism).
"""

from __future__ import annotations

import pytest
import torch

from dsa_ref import dispatch
from dsa_ref.config import tiny
from dsa_ref.dsa import DSAttention
from dsa_ref.indexer import index_scores_at, lightning_indexer, topk_indices
from dsa_ref.indexer_loss import indexer_loss, indexer_loss_on_slots, indexer_target
from dsa_ref.layout import key_windows
from dsa_ref.slot_path import REFERENCE_OPS, attention_and_loss_on_slots, window_indices
from dsa_ref.sparse_attention import attention_head_sum, sparse_mla

STAGES = ("dense_warmup", "sparse")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _run_layer(layer, x, cu, *, slot_path: bool, monkeypatch, **kw):
    monkeypatch.setattr(dispatch, "slot_ops", lambda backend, **_: REFERENCE_OPS if slot_path else None)
    for p in layer.parameters():
        p.grad = None
    x = x.clone().requires_grad_(True)
    res = layer(x, cu, **kw)
    weight = torch.randn(res.output.shape, generator=_gen(5), dtype=res.output.dtype)
    ((res.output * weight).sum() + 3.0 * res.indexer_loss).backward()
    grads = {name: p.grad.clone() for name, p in layer.named_parameters() if p.grad is not None}
    return res, x.grad, grads


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("topk", [5, 64])  # 5: a real selection; 64: every key of every window
def test_slot_path_equals_readable_layer(stage, topk, monkeypatch):
    torch.manual_seed(0)
    layer = DSAttention(tiny().with_topk(topk), stage=stage, dtype=torch.float64)
    cu = torch.tensor([0, 1, 9, 30, 40])  # a length-1 sequence, and others of several lengths
    x = torch.randn(40, tiny().mla.dim, generator=_gen(1), dtype=torch.float64)
    mask = torch.ones(40, dtype=torch.bool)
    mask[35:] = False  # padding rows leave the loss
    ref, ref_dx, ref_grads = _run_layer(layer, x, cu, slot_path=False, monkeypatch=monkeypatch, loss_row_mask=mask)
    got, got_dx, got_grads = _run_layer(layer, x, cu, slot_path=True, monkeypatch=monkeypatch, loss_row_mask=mask)
    assert torch.equal(got.topk_indices, ref.topk_indices)
    torch.testing.assert_close(got.output, ref.output, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got.indexer_loss, ref.indexer_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got_dx, ref_dx, rtol=1e-9, atol=1e-11)
    assert got_grads.keys() == ref_grads.keys()
    assert any(name.startswith("indexer") for name in got_grads), "the indexer must receive gradient"
    for name in ref_grads:
        torch.testing.assert_close(got_grads[name], ref_grads[name], rtol=1e-9, atol=1e-11, msg=name)


def _pieces(T=12, S=20, H=3, D=8, HI=2, DI=4, K=6, seed=0):
    g = _gen(seed)
    q = torch.randn(T, H, D, generator=g, dtype=torch.float64)
    kv = torch.randn(S, D, generator=g, dtype=torch.float64)
    qi = torch.randn(T, HI, DI, generator=g, dtype=torch.float64)
    ki = torch.randn(S, DI, generator=g, dtype=torch.float64)
    wi = torch.randn(T, HI, generator=g, dtype=torch.float64)
    cu = torch.tensor([0, 7, S])
    query_index = torch.arange(S - T, S)  # the last T tokens, as a CP rank would hold them
    starts, ends = key_windows(cu, query_index)
    return q, kv, qi, ki, wi, starts, ends, K


def test_index_scores_at_equals_gathered_lightning_indexer():
    q, kv, qi, ki, wi, starts, ends, K = _pieces()
    full = lightning_indexer(qi, ki, wi)  # [T, S]
    idx = torch.randint(-1, ki.shape[0], (qi.shape[0], K), generator=_gen(3))
    idx[:, 1] = idx[:, 0]  # duplicates
    got = index_scores_at(qi, ki, wi, idx, chunk_size=5)
    want = full.gather(1, idx.clamp_min(0)).masked_fill(idx < 0, float("-inf"))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # gradients: those of the gather (duplicates add up)
    a = [t.clone().requires_grad_(True) for t in (qi, ki, wi)]
    b = [t.clone().requires_grad_(True) for t in (qi, ki, wi)]
    up = torch.randn(idx.shape, generator=_gen(4), dtype=torch.float64).masked_fill(idx < 0, 0)
    (index_scores_at(*a, idx, chunk_size=5).nan_to_num(neginf=0) * up).sum().backward()
    (lightning_indexer(*b).gather(1, idx.clamp_min(0)) * up).sum().backward()
    for x, y in zip(a, b):
        torch.testing.assert_close(x.grad, y.grad, rtol=1e-12, atol=1e-12)


def test_attention_head_sum_normalised_is_the_sparse_target():
    q, kv, *_, starts, ends, K = _pieces()
    scores = torch.randn(q.shape[0], kv.shape[0], generator=_gen(7), dtype=torch.float64)
    scores = scores.masked_fill(~((torch.arange(kv.shape[0]) >= starts[:, None]) &
                                  (torch.arange(kv.shape[0]) < ends[:, None])), float("-inf"))
    idx = topk_indices(scores, K)
    sm = 0.3
    _, lse = sparse_mla(q, kv, idx, sm_scale=sm, d_v=5)
    mass = attention_head_sum(q, kv, idx, lse, sm_scale=sm, chunk_size=4)  # [T, K]
    assert (mass[idx < 0] == 0).all()
    # each head's probabilities sum to 1 over the slots, so the head sum sums to H on live rows
    live = (idx >= 0).any(1)
    torch.testing.assert_close(mass[live].sum(1), torch.full((int(live.sum()),), float(q.shape[1]),
                                                              dtype=torch.float64))
    target = indexer_target(q, kv, sm_scale=sm, starts=starts, ends=ends, topk_indices=idx)  # [T, S]
    normalised = mass / mass.sum(1, keepdim=True).clamp_min(1e-300)
    torch.testing.assert_close(normalised, target.gather(1, idx.clamp_min(0)) * (idx >= 0), rtol=1e-12, atol=1e-14)


def test_indexer_loss_on_slots_equals_indexer_loss_with_a_divisor():
    q, kv, qi, ki, wi, starts, ends, K = _pieces(seed=2)
    scores = lightning_indexer(qi, ki, wi, starts=starts, ends=ends)
    idx = topk_indices(scores, K)
    _, lse = sparse_mla(q, kv, idx, sm_scale=0.2, d_v=5)
    mass = attention_head_sum(q, kv, idx, lse, sm_scale=0.2)
    valid = idx >= 0
    for reduction, num_rows in (("mean", None), ("mean", 40), ("sum", None)):
        want = indexer_loss(scores, q, kv, sm_scale=0.2, starts=starts, ends=ends, topk_indices=idx,
                            reduction=reduction, coeff=0.7, num_rows=num_rows)
        got = indexer_loss_on_slots(index_scores_at(qi, ki, wi, idx), mass, valid, reduction=reduction,
                                    coeff=0.7, num_rows=num_rows)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_dense_stage_on_window_slots_equals_dense_loss():
    q, kv, qi, ki, wi, starts, ends, _ = _pieces(seed=4)
    scores = lightning_indexer(qi, ki, wi, starts=starts, ends=ends)
    topk = topk_indices(scores, 3)
    want = indexer_loss(scores, q, kv, sm_scale=0.25, starts=starts, ends=ends)
    _, got = attention_and_loss_on_slots(q, kv, qi, ki, wi, topk, stage="dense_warmup", sm_scale=0.25, d_v=5,
                                         relu=True, starts=starts, ends=ends)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_window_indices():
    starts, ends = torch.tensor([0, 0, 3, 5]), torch.tensor([1, 2, 6, 5])
    got = window_indices(starts, ends, multiple=4)
    assert got.tolist() == [[0, -1, -1, -1], [0, 1, -1, -1], [3, 4, 5, -1], [-1, -1, -1, -1]]
    assert window_indices(starts, ends).shape == (4, 3)


def test_slot_path_bad_inputs():
    s = torch.zeros(3, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="share one"):
        indexer_loss_on_slots(s, torch.zeros(3, 5), torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool"):
        indexer_loss_on_slots(s, s, torch.ones(3, 4))
    with pytest.raises(ValueError, match="reduction"):
        indexer_loss_on_slots(s, s, torch.ones(3, 4, dtype=torch.bool), reduction="max")
    q, kv, qi, ki, wi, *_ = _pieces()
    with pytest.raises(ValueError, match="lse"):
        attention_head_sum(q, kv, torch.zeros(12, 2, dtype=torch.long), torch.zeros(12, 5), sm_scale=0.1)
    with pytest.raises(ValueError, match="indices"):
        index_scores_at(qi, ki, wi, torch.full((12, 2), 99))
    with pytest.raises(ValueError, match="weights"):
        index_scores_at(qi, ki, wi[:, :1], torch.zeros(12, 2, dtype=torch.long))
