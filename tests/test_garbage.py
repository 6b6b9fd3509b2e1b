"""Memory an op does not read never reaches its result; empty inputs give empty (or 0 / -inf) results.

Kernel authors hand the oracle the buffers their kernels read: KV caches and padded tensors whose
unused rows hold anything. For every functional op and for `DSAttention`, garbage (NaN, +-Inf,
1e30) in memory the op does not read must give *exactly* the result of the same call with that
memory zeroed -- outputs, LSE, losses and every gradient -- and the gradient of an unread row is
exactly 0. Compared with ``torch.equal`` (bitwise, NaN never equal), not with a tolerance.
"""

from __future__ import annotations

import pytest
import torch

import dsa_ref as d
from dsa_ref.indexer import index_scores_at
from dsa_ref.sparse_attention import attention_head_sum

GARBAGE = [float("nan"), float("inf"), float("-inf"), 1e30]
ids = ["nan", "inf", "-inf", "1e30"]


def _same(a, b):
    """Bitwise equal, both None, or both empty of one shape."""
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and torch.equal(a, b)


def _leaf(x):
    return x.detach().clone().requires_grad_(True)


def _run(fn, *inputs, weights=None):
    """Call ``fn`` on fresh leaves; backward of a fixed random weighting of its finite-safe outputs."""
    leaves = [_leaf(x) for x in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    total = 0
    for i, o in enumerate(outs):
        if o.is_floating_point() and o.requires_grad:
            w = weights[i] if weights is not None else torch.ones_like(o)
            total = total + torch.where(torch.isinf(o), torch.zeros_like(o), o * w).sum()  # -inf lse of empty rows
    if torch.is_tensor(total) and total.requires_grad:
        total.backward()
    return [o.detach() for o in outs], [x.grad for x in leaves]


def _check_equal(clean, dirty):
    (outs_c, grads_c), (outs_d, grads_d) = clean, dirty
    for a, b in zip(outs_c, outs_d):
        assert _same(a, b), "an output changed with garbage in unread memory"
    for a, b in zip(grads_c, grads_d):
        assert _same(a, b), "a gradient changed with garbage in unread memory"


def _inputs(T=7, S=9, H=3, D=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g, dtype=torch.float64)
    kv = torch.randn(S, D, generator=g, dtype=torch.float64)
    return q, kv


@pytest.mark.parametrize("junk", GARBAGE, ids=ids)
def test_sparse_mla_ignores_unselected_rows_and_the_placeholder_row(junk):
    q, kv = _inputs()
    idx = torch.tensor([[3, 5, -1], [5, 5, 3], [-1, -1, -1], [3, -1, 7], [7, 3, 5], [5, -1, -1], [3, 7, -1]])
    clean = kv.clone()
    clean[[0, 1, 2, 4, 6, 8]] = 0.0  # every row no slot selects, row 0 (the -1 placeholder) among them
    dirty = kv.clone()
    dirty[[0, 1, 2, 4, 6, 8]] = junk
    fn = lambda q_, kv_: d.sparse_mla(q_, kv_, idx, sm_scale=0.4, d_v=4)  # noqa: E731
    a, b = _run(fn, q, clean), _run(fn, q, dirty)
    _check_equal(a, b)
    assert torch.equal(b[1][1][[0, 1, 2, 4, 6, 8]], torch.zeros(6, 6, dtype=torch.float64))  # unread rows: grad 0


@pytest.mark.parametrize("junk", GARBAGE, ids=ids)
def test_dense_attention_other_documents_never_mix(junk):
    """Two packed documents: garbage in the second never reaches the first, forward or backward."""
    q, kv = _inputs(T=9, S=9)
    cu = torch.tensor([0, 4, 9])
    starts, ends = d.key_windows(cu)
    fn = lambda q_, kv_: d.dense_mla_attention(q_, kv_, sm_scale=0.4, d_v=4, starts=starts, ends=ends)  # noqa: E731
    dirty = kv.clone()
    dirty[6] = junk  # a key of document 2, read by its queries 6, 7, 8 only
    w_out = torch.randn(9, 3, 4, dtype=torch.float64)
    w_out[4:] = 0.0  # the loss reads document 1 only
    (oa, la), (gqa, gka) = _run(fn, q, kv, weights=[w_out, torch.zeros(9, 3)])
    (ob, lb), (gqb, gkb) = _run(fn, q, dirty, weights=[w_out, torch.zeros(9, 3)])
    assert torch.equal(oa[:6], ob[:6]) and torch.equal(la[:6], lb[:6])  # rows 4, 5 come before the key
    assert torch.equal(gqa[:4], gqb[:4]) and torch.equal(gka[:4], gkb[:4])


@pytest.mark.parametrize("junk", GARBAGE, ids=ids)
def test_dense_attention_and_indexer_ignore_keys_outside_every_window(junk):
    q, kv = _inputs(T=6, S=10)
    starts = torch.tensor([1, 1, 2, 6, 6, 3])
    ends = torch.tensor([3, 4, 5, 9, 7, 6])  # keys 0 and 9 are in no window
    clean, dirty = kv.clone(), kv.clone()
    clean[[0, 9]] = 0.0
    dirty[[0, 9]] = junk
    attn = lambda q_, kv_: d.dense_mla_attention(q_, kv_, sm_scale=0.4, d_v=4, starts=starts, ends=ends)  # noqa: E731
    _check_equal(_run(attn, q, clean), _run(attn, q, dirty))

    w = torch.randn(6, 3, dtype=torch.float64)
    index = lambda q_, k_, w_: d.lightning_indexer(q_, k_, w_, starts=starts, ends=ends)  # noqa: E731
    a, b = _run(index, q, clean, w), _run(index, q, dirty, w)
    _check_equal(a, b)
    assert torch.equal(b[1][1][[0, 9]], torch.zeros(2, 6, dtype=torch.float64))


@pytest.mark.parametrize("junk", GARBAGE, ids=ids)
def test_indexer_rows_never_read_keys_outside_their_window(junk):
    """Per query: a garbage key outside *its* window (but inside others') leaves its scores as they are."""
    q, k = _inputs(T=6, S=6)
    w = torch.randn(6, 3, dtype=torch.float64)
    starts, ends = d.key_windows(torch.tensor([0, 6]))  # causal
    dirty = k.clone()
    dirty[4] = junk
    a = d.lightning_indexer(q, k, w, starts=starts, ends=ends)
    b = d.lightning_indexer(q, dirty, w, starts=starts, ends=ends)
    assert torch.equal(a[:4], b[:4])
    oa, _ = d.dense_mla_attention(q, k, sm_scale=0.3, d_v=4, starts=starts, ends=ends)
    ob, _ = d.dense_mla_attention(q, dirty, sm_scale=0.3, d_v=4, starts=starts, ends=ends)
    assert torch.equal(oa[:4], ob[:4])


@pytest.mark.parametrize("junk", GARBAGE, ids=ids)
def test_slot_ops_ignore_unselected_rows(junk):
    q, kv = _inputs()
    w = torch.randn(7, 3, dtype=torch.float64)
    idx = torch.tensor([[3, 5, -1], [5, 3, -1], [-1, -1, -1], [3, -1, 7], [7, 3, 5], [5, -1, -1], [3, 7, -1]])
    clean, dirty = kv.clone(), kv.clone()
    clean[[0, 1, 2, 4, 6, 8]] = 0.0
    dirty[[0, 1, 2, 4, 6, 8]] = junk
    at = lambda q_, k_, w_: index_scores_at(q_, k_, w_, idx)  # noqa: E731
    _check_equal(_run(at, q, clean, w), _run(at, q, dirty, w))
    _, lse = d.sparse_mla(q, clean, idx, sm_scale=0.4, d_v=4)
    mass_a = attention_head_sum(q, clean, idx, lse, sm_scale=0.4)
    mass_b = attention_head_sum(q, dirty, idx, lse, sm_scale=0.4)
    assert torch.equal(mass_a, mass_b)


@pytest.mark.parametrize("junk", GARBAGE, ids=ids)
@pytest.mark.parametrize("stage", ["dense_warmup", "sparse"])
def test_indexer_loss_ignores_scores_and_keys_it_does_not_train_on(junk, stage):
    q, kv = _inputs(T=6, S=8)
    cu = torch.tensor([0, 3, 8])  # keys 3..7 hold the second document; queries 0..5 are keys 0..5
    starts, ends = d.key_windows(cu, torch.arange(6))
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(6, 8, generator=g, dtype=torch.float64)
    topk = torch.tensor([[0, -1], [1, 0], [1, 2], [3, -1], [4, 3], [5, 3]]) if stage == "sparse" else None
    trained = d.window_mask(starts, ends, 8)
    if topk is not None:
        picked = torch.zeros_like(trained)
        for t in range(6):
            picked[t, topk[t][topk[t] >= 0]] = True
        trained &= picked
    clean_s = torch.where(trained, scores, torch.zeros_like(scores))
    dirty_s = torch.where(trained, scores, torch.full_like(scores, junk))
    clean_k, dirty_k = kv.clone(), kv.clone()
    clean_k[[6, 7]] = 0.0  # keys no window (or selection) holds
    dirty_k[[6, 7]] = junk
    loss = lambda s_: d.indexer_loss(s_, q, clean_k, sm_scale=0.4, starts=starts, ends=ends,  # noqa: E731
                                     topk_indices=topk)
    loss_dirty = lambda s_: d.indexer_loss(s_, q, dirty_k, sm_scale=0.4, starts=starts,  # noqa: E731
                                           ends=ends, topk_indices=topk)
    a, b = _run(loss, clean_s), _run(loss_dirty, dirty_s)
    _check_equal(a, b)
    assert torch.equal(b[1][0][~trained], torch.zeros(int((~trained).sum()), dtype=torch.float64))


@pytest.mark.parametrize("junk", [1e30, -1e30], ids=["1e30", "-1e30"])
@pytest.mark.parametrize("stage", ["dense_warmup", "sparse"])
def test_dsattention_documents_never_mix(junk, stage):
    """Garbage tokens in one packed document: the other's outputs, input gradients and loss stay exact.

    (A NaN token makes its own index scores NaN, which `topk_indices` refuses with a ValueError: a
    layer input is never unread memory.)"""
    cfg = d.tiny()
    torch.manual_seed(0)
    layer = d.DSAttention(cfg, stage=stage, dtype=torch.float64)
    cu = torch.tensor([0, 12, 20])
    x = torch.randn(20, cfg.mla.dim, dtype=torch.float64)
    dirty = x.clone()
    dirty[14] = junk
    row_mask = torch.arange(20) < 12  # the loss leaves the second document out

    def run(inp):
        leaf = _leaf(inp)
        out = layer(leaf, cu, loss_row_mask=row_mask)
        out.output[:12].sum().backward()
        return out.output.detach(), out.indexer_loss.detach(), out.topk_indices, leaf.grad

    oa, la, ta, ga = run(x)
    ob, lb, tb, gb = run(dirty)
    assert torch.equal(oa[:12], ob[:12]) and torch.equal(ta[:12], tb[:12])
    assert torch.equal(la, lb)
    # the garbage tokens are read by their own document's queries, which take the selecting path of
    # dense_mla_attention: autograd then sums the first document's input gradient in another order
    torch.testing.assert_close(gb[:12], ga[:12], rtol=0, atol=1e-14)


# --- empty inputs ---------------------------------------------------------------------------------


def _no_nan(*xs):
    return all(not torch.isnan(x).any() for x in xs if torch.is_tensor(x))


@pytest.mark.parametrize("T,S", [(0, 5), (4, 0), (0, 0)])
def test_empty_inputs_every_functional_op(T, S):
    g = torch.Generator().manual_seed(0)
    H, D = 2, 5
    q = torch.randn(T, H, D, generator=g, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(S, D, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(T, H, generator=g, dtype=torch.float64, requires_grad=True)
    idx = torch.full((T, 3), -1)
    starts = torch.zeros(T, dtype=torch.long)
    ends = torch.full((T,), S, dtype=torch.long)

    out, lse = d.sparse_mla(q, kv, idx, sm_scale=0.5, d_v=3)
    assert out.shape == (T, H, 3) and lse.shape == (T, H)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == float("-inf")).all())
    out_d, lse_d = d.dense_mla_attention(q, kv, sm_scale=0.5, d_v=3, starts=starts, ends=ends)
    assert out_d.shape == (T, H, 3) and lse_d.shape == (T, H)
    scores = d.lightning_indexer(q, kv, w, starts=starts, ends=ends)
    assert scores.shape == (T, S)
    top = d.topk_indices(scores.detach(), 3)
    assert top.shape == (T, 3) and bool((top == -1).all()) == (S == 0 or T == 0)
    at = index_scores_at(q, kv, w, idx)
    mass = attention_head_sum(q, kv, idx, lse, sm_scale=0.5)
    assert at.shape == mass.shape == (T, 3)
    dense = d.indexer_loss(scores, q, kv, sm_scale=0.5, starts=starts, ends=ends)
    sparse = d.indexer_loss(scores, q, kv, sm_scale=0.5, starts=starts, ends=ends, topk_indices=top)
    assert dense.item() == 0.0 if S == 0 or T == 0 else True
    total = (out.sum() + out_d.sum() + torch.where(torch.isinf(scores), 0.0, scores).sum() + dense + sparse
             + torch.where(torch.isinf(at), 0.0, at).sum())
    total.backward()
    assert _no_nan(out, out_d, dense, sparse, mass, q.grad, kv.grad, w.grad)
    assert q.grad.shape == q.shape and kv.grad.shape == kv.shape


def test_every_slot_unused_and_every_window_empty():
    q, kv = _inputs(T=4, S=6)
    q.requires_grad_(True)
    kv.requires_grad_(True)
    out, lse = d.sparse_mla(q, kv, torch.full((4, 2), -1), sm_scale=0.5, d_v=4)
    empty = torch.full((4,), 3, dtype=torch.long)
    out_d, lse_d = d.dense_mla_attention(q, kv, sm_scale=0.5, d_v=4, starts=empty, ends=empty)
    for o, lse_ in ((out, lse), (out_d, lse_d)):
        assert torch.equal(o, torch.zeros_like(o)) and bool((lse_ == float("-inf")).all())
    (out.sum() + out_d.sum()).backward()
    assert torch.equal(q.grad, torch.zeros_like(q)) and torch.equal(kv.grad, torch.zeros_like(kv))
    scores = d.lightning_indexer(q, kv, torch.ones(4, 3, dtype=torch.float64), starts=empty, ends=empty)
    assert bool((scores == float("-inf")).all())
    for topk in (None, torch.full((4, 2), -1)):
        loss = d.indexer_loss(torch.zeros(4, 6, dtype=torch.float64, requires_grad=True), q, kv, sm_scale=0.5,
                              starts=empty, ends=empty, topk_indices=topk)
        assert loss.item() == 0.0


@pytest.mark.parametrize("stage", ["dense_warmup", "sparse"])
def test_dsattention_with_no_tokens(stage):
    cfg = d.tiny()
    layer = d.DSAttention(cfg, stage=stage, dtype=torch.float64)
    x = torch.zeros(0, cfg.mla.dim, dtype=torch.float64, requires_grad=True)
    out = layer(x)
    assert out.output.shape == (0, cfg.mla.dim) and out.topk_indices.shape == (0, cfg.indexer.topk)
    assert out.indexer_loss.item() == 0.0
    (out.output.sum() + out.indexer_loss).backward()
    assert x.grad.shape == x.shape


# --- the indexer on its own, and window_mask's checks ---------------------------------------------


def test_lightning_indexer_module_forward_equals_its_parts():
    cfg = d.tiny()
    torch.manual_seed(0)
    indexer = d.LightningIndexer(cfg, dtype=torch.float64)
    x = torch.randn(10, cfg.mla.dim, dtype=torch.float64)
    qr = torch.randn(10, cfg.mla.q_lora_rank, dtype=torch.float64)
    cu = torch.tensor([0, 4, 10])
    q, k, w = indexer.project(x, qr, d.positions(cu))
    starts, ends = d.key_windows(cu)
    expected = d.lightning_indexer(q, k, w, starts=starts, ends=ends, relu=cfg.indexer.use_relu)
    assert torch.equal(indexer(x, qr, cu), expected)
    assert indexer(x, qr).shape == (10, 10)  # default: one sequence
    with pytest.raises(ValueError, match="qr"):
        indexer(x, qr[:9], cu)


@pytest.mark.parametrize("num_keys,error", [(3.5, TypeError), (-1, ValueError), (True, TypeError)])
def test_window_mask_checks_num_keys(num_keys, error):
    with pytest.raises(error, match="num_keys"):
        d.window_mask(torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.long), num_keys)
