"""Streamed selection and streamed dense-stage loss (chapter 7) against the ``[T, S]`` functions.

* `merge_topk` over any tiling of a score matrix == `topk_indices` of the whole matrix, exactly
  (ties across tile boundaries, -inf tiles, -0.0 against +0.0, rows with fewer keys than k);
* `streamed_topk_indices` == ``topk_indices(lightning_indexer(...))`` exactly, for packed and CP
  windows, any query chunk and key tile, with the readable selector and with a per-chunk selector
  shaped like the kernels';
* `streamed_indexer_loss` == ``indexer_loss(lightning_indexer(...), ...)`` (dense stage) in value and
  gradients, float64, readable blocks and slot blocks, many block shapes;
* `windowed_attention_on_slots` == `dense_mla_attention`, forward and backward;
* `DSAttention` == the previous ``[T, S]`` layer composed by hand from the functional ops, both
  stages, with small tiles so that every stream has many blocks.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsa_ref import dispatch, streaming, streaming_loss, streaming_slots
from dsa_ref.attention import dense_mla_attention
from dsa_ref.config import tiny
from dsa_ref.dsa import DSAttention, IndexerLossAutoScaler
from dsa_ref.indexer import lightning_indexer, topk_indices
from dsa_ref.indexer_loss import indexer_loss, indexer_loss_on_slots
from dsa_ref.layout import cp_shard_index, key_windows, positions
from dsa_ref.slot_path import REFERENCE_OPS
from dsa_ref.sparse_attention import sparse_mla
from dsa_ref.streaming import merge_topk, streamed_topk_indices
from dsa_ref.streaming_loss import block_plan, streamed_indexer_loss, tile_slots, windowed_attention_on_slots

F64 = torch.float64


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _windows(kind: str):
    """``(starts, ends, S)``: packed causal windows, or the windows of CP rank 1 of 2 over all keys."""
    cu = torch.tensor([0, 1, 19, 48, 64])  # a one-token sequence and three others
    if kind == "packed":
        return *key_windows(cu), 64
    cu = torch.tensor([0, 24, 64])  # lengths divisible by 2 * cp_size
    return *key_windows(cu, cp_shard_index(cu, 2, 1)), 64


def _indexer_inputs(T, S, *, H=3, D=8, seed=0, integer=False):
    g = _gen(seed)
    if integer:  # small integers: every score is exact, so equal scores really tie
        return (torch.randint(-1, 2, (T, H, D), generator=g).to(F64), torch.randint(-1, 2, (S, D), generator=g).to(F64),
                torch.randint(-1, 2, (T, H), generator=g).to(F64))
    return (torch.randn(T, H, D, generator=g, dtype=F64), torch.randn(S, D, generator=g, dtype=F64),
            torch.randn(T, H, generator=g, dtype=F64))


def _untiled_select(q, k, w, topk, *, starts, ends, relu):
    """A chunk selector shaped like the kernels' (all scores of the chunk, then top-k)."""
    return topk_indices(lightning_indexer(q, k, w, starts=starts, ends=ends, relu=relu), topk)


# ------------------------------------------------------------------------------------ selection


def _merge_all(scores, topk, tile):
    """`merge_topk` over the tiles of a score matrix, then -1 for -inf: the streaming rule alone."""
    C = scores.shape[0]
    values = torch.full((C, topk), float("-inf"), dtype=scores.dtype)
    idx = torch.full((C, topk), -1, dtype=torch.int64)
    for lo in range(0, scores.shape[1], tile):
        values, idx = merge_topk(values, idx, scores[:, lo: lo + tile], lo)
    return torch.where(values > float("-inf"), idx, torch.full_like(idx, -1))


@pytest.mark.parametrize("tile", [1, 2, 3, 7, 16, 50])
@pytest.mark.parametrize("topk", [1, 4, 9, 60])
def test_merge_topk_equals_topk_of_the_whole_row(tile, topk):
    g = _gen(1)
    scores = torch.randint(-3, 4, (12, 41), generator=g).to(F64)  # many exact ties
    scores[scores == 3] = float("-inf")
    scores[0] = float("-inf")  # no selectable key
    scores[1, 5:] = float("-inf")  # fewer selectable keys than k
    scores[2, :16] = float("-inf")  # whole tiles of -inf
    scores[3, ::2] = -0.0  # -0.0 and +0.0 tie: the lower index first
    scores[3, 1::2] = 0.0
    assert torch.equal(_merge_all(scores, topk, tile), topk_indices(scores, topk))


@pytest.mark.parametrize("kind", ["packed", "cp"])
@pytest.mark.parametrize("query_chunk,key_tile", [(None, None), (1, 1), (5, 7), (16, 13), (100, 64)])
def test_streamed_selection_equals_topk_of_the_indexer(kind, query_chunk, key_tile):
    starts, ends, S = _windows(kind)
    q, k, w = _indexer_inputs(starts.numel(), S)
    want = topk_indices(lightning_indexer(q, k, w, starts=starts, ends=ends), 6)
    got = streamed_topk_indices(q, k, w, 6, starts=starts, ends=ends, query_chunk=query_chunk, key_tile=key_tile)
    assert torch.equal(got, want)
    # the kernels' structure (one chunk's scores at once, keys limited to the chunk's range)
    got = streamed_topk_indices(q, k, w, 6, starts=starts, ends=ends, query_chunk=query_chunk,
                                chunk_selector=_untiled_select)
    assert torch.equal(got, want)


@pytest.mark.parametrize("key_tile", [1, 2, 3, 5])
@pytest.mark.parametrize("relu", [True, False])
def test_streamed_selection_ties_across_tiles(key_tile, relu):
    starts, ends, S = _windows("packed")
    q, k, w = _indexer_inputs(starts.numel(), S, integer=True)
    scores = lightning_indexer(q, k, w, starts=starts, ends=ends, relu=relu)
    assert (scores[:, None, :] == scores[:, :, None]).sum() > 10 * scores.numel()  # ties everywhere
    want = topk_indices(scores, 12)
    got = streamed_topk_indices(q, k, w, 12, starts=starts, ends=ends, relu=relu, query_chunk=4, key_tile=key_tile)
    assert torch.equal(got, want)


def test_streamed_selection_without_windows_empty_windows_and_large_k():
    q, k, w = _indexer_inputs(9, 11)
    assert torch.equal(streamed_topk_indices(q, k, w, 4, key_tile=3), topk_indices(lightning_indexer(q, k, w), 4))
    assert torch.equal(streamed_topk_indices(q, k, w, 20, key_tile=3), topk_indices(lightning_indexer(q, k, w), 20))
    starts = torch.tensor([0, 3, 5, 5, 0, 10, 2, 7, 1])
    ends = torch.tensor([0, 3, 6, 11, 11, 11, 9, 7, 4])  # empty windows in rows 0, 1 and 7
    got = streamed_topk_indices(q, k, w, 5, starts=starts, ends=ends, query_chunk=2, key_tile=4)
    assert torch.equal(got, topk_indices(lightning_indexer(q, k, w, starts=starts, ends=ends), 5))
    assert (got[[0, 1, 7]] == -1).all()


@pytest.mark.parametrize("junk", [float("nan"), float("inf"), float("-inf"), 1e30], ids=["nan", "inf", "-inf", "1e30"])
def test_streamed_selection_ignores_keys_outside_every_window(junk):
    """A tile is scored on all its keys, then masked: garbage in keys no window holds (a CP rank's
    windows leave keys 18-23 and 54-63 out) changes nothing and raises nothing."""
    starts, ends, S = _windows("cp")
    q, k, w = _indexer_inputs(starts.numel(), S, seed=2)
    key = torch.arange(S)
    unread = ~((key[None, :] >= starts[:, None]) & (key[None, :] < ends[:, None])).any(dim=0)  # [S]
    assert unread.sum() == 16
    clean, dirty = k.clone(), k.clone()
    clean[unread], dirty[unread] = 0.0, junk
    want = topk_indices(lightning_indexer(q, clean, w, starts=starts, ends=ends), 6)
    for chunk, tile in ((None, None), (4, 3), (16, 13), (100, 8)):
        got = streamed_topk_indices(q, dirty, w, 6, starts=starts, ends=ends, query_chunk=chunk, key_tile=tile)
        assert torch.equal(got, want)


def test_streamed_selection_rows_never_see_keys_outside_their_window():
    """Key 20 is huge: the rows whose windows end before it (or lie in other documents) keep their selection."""
    starts, ends, S = _windows("packed")
    q, k, w = _indexer_inputs(starts.numel(), S, seed=3)
    dirty = k.clone()
    dirty[20] = 1e30
    rows = (ends <= 20) | (starts > 20)
    want = topk_indices(lightning_indexer(q, k, w, starts=starts, ends=ends), 6)
    for chunk, tile in ((None, None), (4, 3), (16, 13)):
        got = streamed_topk_indices(q, dirty, w, 6, starts=starts, ends=ends, query_chunk=chunk, key_tile=tile)
        assert torch.equal(got[rows], want[rows]) and not torch.equal(got, want)


def test_streamed_selection_bad_inputs():
    q, k, w = _indexer_inputs(4, 6)
    with pytest.raises(ValueError, match="topk"):
        streamed_topk_indices(q, k, w, 0)
    with pytest.raises(ValueError, match="key_tile"):
        streamed_topk_indices(q, k, w, 2, key_tile=0)
    with pytest.raises(ValueError, match="weights"):
        streamed_topk_indices(q, k, w[:3], 2)
    with pytest.raises(ValueError, match="ends"):
        streamed_topk_indices(q, k, w, 2, starts=torch.zeros(4, dtype=torch.long), ends=torch.full((4,), 7))
    bad = k.clone()
    bad[2, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        streamed_topk_indices(q, bad, w, 2, key_tile=4)


# ------------------------------------------------------------------------------------ loss


def _loss_inputs(kind, seed=0, H=4, D=16, HI=3, DI=8):
    starts, ends, S = _windows(kind)
    T = starts.numel()
    g = _gen(seed)
    q = torch.randn(T, H, D, generator=g, dtype=F64)
    kv = torch.randn(S, D, generator=g, dtype=F64)
    q_i, k_i, w_i = (torch.randn(*shape, generator=g, dtype=F64).requires_grad_(True)
                     for shape in ((T, HI, DI), (S, DI), (T, HI)))
    _, lse = dense_mla_attention(q, kv, sm_scale=0.3, d_v=8, starts=starts, ends=ends)
    return dict(q_i=q_i, k_i=k_i, w_i=w_i, q=q, kv=kv, lse=lse, starts=starts, ends=ends)


def _reference_loss(x, **kw):
    scores = lightning_indexer(x["q_i"], x["k_i"], x["w_i"], starts=x["starts"], ends=x["ends"])
    return indexer_loss(scores, x["q"], x["kv"], sm_scale=0.3, starts=x["starts"], ends=x["ends"], **kw)


@pytest.mark.parametrize("kind", ["packed", "cp"])
@pytest.mark.parametrize("ops", [None, REFERENCE_OPS], ids=["readable", "slots"])
@pytest.mark.parametrize("query_chunk,key_tile", [(None, None), (1, 1), (5, 7), (64, 13), (3, 100)])
def test_streamed_loss_equals_indexer_loss(kind, ops, query_chunk, key_tile):
    x = _loss_inputs(kind)
    leaves = (x["q_i"], x["k_i"], x["w_i"])
    want = _reference_loss(x)
    want_grads = torch.autograd.grad(want, leaves)
    got = streamed_indexer_loss(*leaves, x["q"], x["kv"], x["lse"], sm_scale=0.3, starts=x["starts"],
                                ends=x["ends"], query_chunk=query_chunk, key_tile=key_tile, ops=ops)
    got_grads = torch.autograd.grad(got, leaves)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("ops", [None, REFERENCE_OPS], ids=["readable", "slots"])
def test_streamed_loss_options(ops):
    """Padding rows, "sum", coeff, a global divisor and a head-sum reduction, as `indexer_loss` takes them."""
    x = _loss_inputs("packed", seed=3)
    leaves = (x["q_i"], x["k_i"], x["w_i"])
    row_mask = torch.rand(x["q"].shape[0], generator=_gen(4)) > 0.3
    for kw in (dict(row_mask=row_mask), dict(reduction="sum", coeff=0.7), dict(num_rows=torch.tensor(100)),
               dict(head_sum_reduce=lambda m: 2 * m, coeff=0.0)):
        want = _reference_loss(x, **kw)
        want_grads = torch.autograd.grad(want, leaves)
        got = streamed_indexer_loss(*leaves, x["q"], x["kv"], x["lse"], sm_scale=0.3, starts=x["starts"],
                                    ends=x["ends"], query_chunk=6, key_tile=5, ops=ops, **kw)
        got_grads = torch.autograd.grad(got, leaves)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        for a, b in zip(got_grads, want_grads):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_streamed_loss_in_one_block_uses_the_ops_kl():
    """One block holds every key: the loss is the ops' own KL over the slots (the fused kernel on the
    kernels' ops), called once with the layer's reduction; several blocks stream without it."""
    x = _loss_inputs("packed", seed=5)
    leaves = (x["q_i"], x["k_i"], x["w_i"])
    calls = []

    def counting_kl(*args, **kw):
        calls.append(kw)
        return indexer_loss_on_slots(*args, **kw)

    ops = dataclasses.replace(REFERENCE_OPS, indexer_loss_on_slots=counting_kl)
    want = _reference_loss(x, reduction="sum", coeff=0.5)
    got = streamed_indexer_loss(*leaves, x["q"], x["kv"], x["lse"], sm_scale=0.3, starts=x["starts"],
                                ends=x["ends"], reduction="sum", coeff=0.5, ops=ops)
    assert len(calls) == 1 and calls[0]["reduction"] == "sum" and calls[0]["coeff"] == 0.5
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    streamed_indexer_loss(*leaves, x["q"], x["kv"], x["lse"], sm_scale=0.3, starts=x["starts"],
                          ends=x["ends"], key_tile=4, ops=ops)
    assert len(calls) == 1


def test_streamed_loss_no_valid_rows_gives_zero_with_zero_gradients():
    x = _loss_inputs("packed")
    empty = torch.zeros_like(x["starts"])
    loss = streamed_indexer_loss(x["q_i"], x["k_i"], x["w_i"], x["q"], x["kv"], x["lse"], sm_scale=0.3,
                                 starts=empty, ends=empty, key_tile=4)
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert all(float(t.grad.abs().max()) == 0.0 for t in (x["q_i"], x["k_i"], x["w_i"]))


def test_block_plan_and_tile_slots():
    starts, ends = torch.tensor([0, 0, 0, 5, 5]), torch.tensor([1, 2, 3, 6, 9])
    assert block_plan(starts, ends, query_chunk=5, key_tile=2) == [(0, 3, 0, 2), (2, 3, 2, 4), (3, 5, 4, 6),
                                                                    (4, 5, 6, 8), (4, 5, 8, 9)]
    assert block_plan(starts, ends, query_chunk=2, key_tile=100) == [(0, 2, 0, 2), (2, 4, 0, 6), (4, 5, 5, 9)]
    slots = tile_slots(starts, ends, 1, 7)
    assert slots.tolist() == [[-1] * 6, [1, -1, -1, -1, -1, -1], [1, 2, -1, -1, -1, -1],
                              [5, -1, -1, -1, -1, -1], [5, 6, -1, -1, -1, -1]]


def test_streamed_loss_bad_inputs():
    x = _loss_inputs("packed")
    args = (x["q_i"], x["k_i"], x["w_i"], x["q"], x["kv"], x["lse"])
    with pytest.raises(ValueError, match="lse"):
        streamed_indexer_loss(*args[:5], x["lse"][:3], sm_scale=0.3)
    with pytest.raises(ValueError, match="reduction"):
        streamed_indexer_loss(*args, sm_scale=0.3, reduction="avg")
    with pytest.raises(ValueError, match="row_mask"):
        streamed_indexer_loss(*args, sm_scale=0.3, row_mask=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_tile"):
        streamed_indexer_loss(*args, sm_scale=0.3, key_tile=-1)


@pytest.mark.parametrize("kind", ["packed", "cp"])
def test_windowed_attention_on_slots_equals_dense_attention(kind):
    starts, ends, S = _windows(kind)
    T = starts.numel()
    g = _gen(2)
    q = torch.randn(T, 4, 16, generator=g, dtype=F64, requires_grad=True)
    kv = torch.randn(S, 16, generator=g, dtype=F64, requires_grad=True)
    d_out, d_lse = torch.randn(T, 4, 8, generator=g, dtype=F64), torch.randn(T, 4, generator=g, dtype=F64)
    want = dense_mla_attention(q, kv, sm_scale=0.3, d_v=8, starts=starts, ends=ends)
    want_grads = torch.autograd.grad(want, (q, kv), (d_out, d_lse))
    for chunk in (None, 1, 7):
        got = windowed_attention_on_slots(q, kv, sm_scale=0.3, d_v=8, starts=starts, ends=ends, ops=REFERENCE_OPS,
                                          query_chunk=chunk)
        got_grads = torch.autograd.grad(got, (q, kv), (d_out, d_lse))
        for a, b in zip((*got, *got_grads), (*want, *want_grads)):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------------ the layer


def _layer_as_before(layer: DSAttention, x, cu, stage, row_mask):
    """The layer as it was: [T, S] index scores, `topk_indices`, `indexer_loss` on them."""
    cfg = layer.config
    query_index = torch.arange(x.shape[0])
    pos = positions(cu, query_index)
    starts, ends = key_windows(cu, query_index)
    p = layer.mla.project(x, pos)
    q, kv = layer.absorbed.absorbed_qkv(p)
    q_i, k_i, w_i = layer.indexer.project(x.detach(), p.qr.detach(), pos)
    scores = lightning_indexer(q_i, k_i, w_i, starts=starts, ends=ends, relu=cfg.indexer.use_relu)  # [T, S]
    topk = topk_indices(scores.detach(), cfg.indexer.topk)
    sm = layer.mla.softmax_scale
    if stage == "dense_warmup":
        o_latent, _ = dense_mla_attention(q, kv, sm_scale=sm, d_v=cfg.mla.kv_lora_rank, starts=starts, ends=ends)
    else:
        o_latent, _ = sparse_mla(q, kv, topk, sm_scale=sm, d_v=cfg.mla.kv_lora_rank)
    loss = indexer_loss(scores, q.detach(), kv.detach(), sm_scale=sm, starts=starts, ends=ends,
                        topk_indices=None if stage == "dense_warmup" else topk, reduction=layer.loss_reduction,
                        coeff=layer.loss_coeff, row_mask=row_mask)
    out = IndexerLossAutoScaler.apply(layer.absorbed.output(o_latent), loss, layer.loss_scale)
    return out, loss, topk


def _step(fn, layer, x):
    for p in layer.parameters():
        p.grad = None
    x = x.clone().requires_grad_(True)
    out, loss, topk = fn(x)
    weight = torch.randn(out.shape, generator=_gen(5), dtype=out.dtype)
    (out * weight).sum().backward()
    return out, loss, topk, x.grad, {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("stage", ["dense_warmup", "sparse"])
@pytest.mark.parametrize("path", ["readable", "slots"])
def test_layer_equals_the_layer_with_index_scores(stage, path, monkeypatch):
    # small tiles and chunks: every stream of the layer runs over many blocks
    monkeypatch.setattr(streaming, "DEFAULT_KEY_TILE", 5)
    monkeypatch.setattr(streaming_loss, "DEFAULT_KEY_TILE", 5)
    monkeypatch.setattr(streaming, "DEFAULT_CHUNK_ELEMENTS", 4 * 5 * 4)
    monkeypatch.setattr(streaming_loss, "DEFAULT_CHUNK_ELEMENTS", 4 * 5 * 4)
    monkeypatch.setattr(streaming_slots, "DEFAULT_CHUNK_ELEMENTS", 3000)  # the sparse stage: about 3 rows a chunk
    monkeypatch.setattr(streaming, "KERNEL_SCORE_ELEMENTS", 64)
    monkeypatch.setattr(streaming_loss, "KERNEL_SCORE_ELEMENTS", 64)
    if path == "slots":  # the kernel path's structure, on the readable ops
        monkeypatch.setattr(dispatch, "slot_ops", lambda backend, **_: REFERENCE_OPS)
        monkeypatch.setattr(dispatch, "chunk_selector", lambda backend, **_: _untiled_select)
    torch.manual_seed(0)
    layer = DSAttention(tiny().with_topk(6), stage=stage, dtype=F64)
    cu = torch.tensor([0, 1, 9, 30, 40])
    x = torch.randn(40, tiny().mla.dim, generator=_gen(1), dtype=F64)
    mask = torch.ones(40, dtype=torch.bool)
    mask[35:] = False
    want = _step(lambda xx: _layer_as_before(layer, xx, cu, stage, mask), layer, x)
    streamed = []
    real_apply = streaming_loss.StreamedKL.apply
    monkeypatch.setattr(streaming_loss.StreamedKL, "apply", lambda *a: streamed.append(len(a[8])) or real_apply(*a))
    got = _step(lambda xx: layer(xx, cu, loss_row_mask=mask), layer, x)
    assert streamed == ([] if stage == "sparse" else [streamed[0]]) and (stage == "sparse" or streamed[0] > 10)
    assert torch.equal(got[2], want[2])
    for a, b in zip(got[:2] + got[3:4], want[:2] + want[3:4]):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    assert got[4].keys() == want[4].keys()
    assert any(name.startswith("indexer") for name in got[4])
    for name in want[4]:
        torch.testing.assert_close(got[4][name], want[4][name], rtol=1e-9, atol=1e-11, msg=name)
