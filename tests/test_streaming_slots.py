"""The chunked slot operations of chapter 7 (`dsa_ref.streaming_slots`) against the chapter-3 definitions.

* `chunked_sparse_mla` == `sparse_mla`: output, LSE and the gradients of ``q`` and ``kv`` (through the
  output and the LSE), float64, chunks of 1 row to all rows; ``-1`` slots, empty rows, duplicate
  slots, a slot list longer than the keys, no keys, no queries;
* `chunked_attention_head_sum` == `attention_head_sum`; `chunked_index_scores_at` == `index_scores_at`
  with its gradients, with and without ReLU;
* garbage (NaN, Inf, 1e30) in rows no slot reads leaves every result and gradient bitwise as with
  those rows zeroed, and their gradient is exactly 0;
* the sparse stage on `LONG_CONTEXT_OPS` == on `REFERENCE_OPS` (loss, output, gradients) for packed
  and CP windows, with a streamed selection over many query chunks and key tiles.
"""

from __future__ import annotations

import pytest
import torch

from dsa_ref import streaming_slots
from dsa_ref.indexer import index_scores_at, lightning_indexer, topk_indices
from dsa_ref.layout import cp_shard_index, key_windows
from dsa_ref.slot_path import REFERENCE_OPS, attention_and_loss_on_slots
from dsa_ref.sparse_attention import attention_head_sum, sparse_mla
from dsa_ref.streaming import streamed_topk_indices
from dsa_ref.streaming_slots import (LONG_CONTEXT_OPS, chunked_attention_head_sum, chunked_index_scores_at,
                                     chunked_sparse_mla)

F64 = torch.float64
CHUNKS = [None, 1, 3, 100]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _indices(T, S, K, seed=0):
    """Slots with ``-1``s, one empty row, one row repeating a key and one full of distinct keys."""
    g = _gen(seed)
    idx = torch.randint(-1, max(S, 1), (T, K), generator=g) if S else torch.full((T, K), -1)
    if T > 3 and S > 1:
        idx[1] = -1  # an empty row
        idx[2, :3] = 1  # a key in three slots: three softmax terms
        idx[3, : min(K, S)] = torch.arange(min(K, S))  # K distinct keys
    return idx


def _close(got, want):
    for a, b in zip(got, want):
        if a is None or b is None:
            assert a is None and b is None
        else:
            torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("T,S,K", [(13, 20, 7), (9, 4, 6), (5, 0, 3), (0, 6, 2)])
def test_chunked_sparse_mla_equals_sparse_mla(chunk, T, S, K):
    g = _gen(1)
    q = torch.randn(T, 3, 10, generator=g, dtype=F64, requires_grad=True)
    kv = torch.randn(S, 10, generator=g, dtype=F64, requires_grad=True)
    idx = _indices(T, S, K)
    d_out, d_lse = torch.randn(T, 3, 6, generator=g, dtype=F64), torch.randn(T, 3, generator=g, dtype=F64)
    want = sparse_mla(q, kv, idx, sm_scale=0.3, d_v=6)
    got = chunked_sparse_mla(q, kv, idx, sm_scale=0.3, d_v=6, chunk_size=chunk)
    finite = torch.isfinite(want[1])  # empty rows: lse = -inf in both, and no gradient through it
    assert torch.equal(finite, torch.isfinite(got[1]))
    d_lse = torch.where(finite, d_lse, torch.zeros_like(d_lse))
    _close(got, want)
    _close(torch.autograd.grad(got, (q, kv), (d_out, d_lse)), torch.autograd.grad(want, (q, kv), (d_out, d_lse)))
    mass = chunked_attention_head_sum(q, kv, idx, want[1], sm_scale=0.3, chunk_size=chunk)
    _close([mass], [attention_head_sum(q, kv, idx, want[1], sm_scale=0.3)])


def test_chunked_sparse_mla_dtypes_and_bad_inputs():
    g = _gen(2)
    q = torch.randn(6, 2, 8, generator=g, dtype=torch.bfloat16, requires_grad=True)
    kv = torch.randn(9, 8, generator=g, dtype=torch.bfloat16, requires_grad=True)
    idx = _indices(6, 9, 4)
    out, lse = chunked_sparse_mla(q, kv, idx, sm_scale=0.5, d_v=4, chunk_size=2)
    want_out, want_lse = sparse_mla(q, kv, idx, sm_scale=0.5, d_v=4)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    out.float().sum().backward()
    assert q.grad.dtype == kv.grad.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="indices"):
        chunked_sparse_mla(q, kv, torch.full((6, 4), 9), sm_scale=0.5, d_v=4)
    with pytest.raises(ValueError, match="d_v"):
        chunked_sparse_mla(q, kv, idx, sm_scale=0.5, d_v=9)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_sparse_mla(q, kv, idx, sm_scale=0.5, d_v=4, chunk_size=0)


@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("chunk", CHUNKS)
def test_chunked_index_scores_at_equals_index_scores_at(relu, chunk):
    g = _gen(3)
    T, S, K = 11, 15, 6
    q = torch.randn(T, 4, 5, generator=g, dtype=F64, requires_grad=True)
    k = torch.randn(S, 5, generator=g, dtype=F64, requires_grad=True)
    w = torch.randn(T, 4, generator=g, dtype=F64, requires_grad=True)
    idx = _indices(T, S, K, seed=4)
    want = index_scores_at(q, k, w, idx, relu=relu)
    got = chunked_index_scores_at(q, k, w, idx, relu=relu, chunk_size=chunk)
    assert torch.equal(torch.isinf(got), idx < 0)
    _close([got], [want])
    d = torch.where(idx >= 0, torch.randn(T, K, generator=g, dtype=F64), torch.zeros((), dtype=F64))
    used = idx >= 0
    _close(torch.autograd.grad(got[used], (q, k, w), d[used]), torch.autograd.grad(want[used], (q, k, w), d[used]))


@pytest.mark.parametrize("junk", [float("nan"), float("inf"), float("-inf"), 1e30], ids=["nan", "inf", "-inf", "1e30"])
def test_chunked_ops_never_read_unselected_rows(junk):
    g = _gen(5)
    q = torch.randn(7, 3, 6, generator=g, dtype=F64)
    kv = torch.randn(9, 6, generator=g, dtype=F64)
    w = torch.randn(7, 3, generator=g, dtype=F64)
    idx = torch.tensor([[3, 5, -1], [5, 5, 3], [-1, -1, -1], [3, -1, 7], [7, 3, 5], [5, -1, -1], [3, 7, -1]])
    unread = [0, 1, 2, 4, 6, 8]  # row 0 among them: no placeholder row is read
    clean, dirty = kv.clone(), kv.clone()
    clean[unread], dirty[unread] = 0.0, junk

    def run(rows):
        q_, kv_, w_ = (x.clone().requires_grad_(True) for x in (q, rows, w))
        out, lse = chunked_sparse_mla(q_, kv_, idx, sm_scale=0.4, d_v=4, chunk_size=2)
        at = chunked_index_scores_at(q_, kv_, w_, idx, chunk_size=3)
        mass = chunked_attention_head_sum(q_, kv_, idx, lse, sm_scale=0.4, chunk_size=2)
        total = out.sum() + torch.where(torch.isinf(lse), 0.0, lse).sum() + torch.where(idx >= 0, at, 0.0).sum()
        total.backward()
        return out, lse, at, mass, q_.grad, kv_.grad, w_.grad

    a, b = run(clean), run(dirty)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert torch.equal(b[5][unread], torch.zeros(len(unread), 6, dtype=F64))


def _windows(kind):
    if kind == "packed":
        cu = torch.tensor([0, 1, 19, 48, 64])
        return *key_windows(cu), 64
    cu = torch.tensor([0, 24, 64])
    return *key_windows(cu, cp_shard_index(cu, 2, 1)), 64


@pytest.mark.parametrize("kind", ["packed", "cp"])
@pytest.mark.parametrize("topk", [5, 40])
def test_sparse_stage_on_long_context_ops_equals_reference_ops(kind, topk, monkeypatch):
    """Selection streamed over many chunks and tiles, then the sparse stage on both slot-op sets."""
    monkeypatch.setattr(streaming_slots, "DEFAULT_CHUNK_ELEMENTS", 200)  # a few rows per chunk
    starts, ends, S = _windows(kind)
    T = starts.numel()
    g = _gen(6)
    q = torch.randn(T, 4, 12, generator=g, dtype=F64, requires_grad=True)
    kv = torch.randn(S, 12, generator=g, dtype=F64, requires_grad=True)
    q_i = torch.randn(T, 3, 8, generator=g, dtype=F64, requires_grad=True)
    k_i = torch.randn(S, 8, generator=g, dtype=F64, requires_grad=True)
    w_i = torch.randn(T, 3, generator=g, dtype=F64, requires_grad=True)
    sel = streamed_topk_indices(q_i.detach(), k_i.detach(), w_i.detach(), topk, starts=starts, ends=ends,
                                query_chunk=5, key_tile=7)
    assert torch.equal(sel, topk_indices(lightning_indexer(q_i, k_i, w_i, starts=starts, ends=ends).detach(), topk))
    assert bool((sel == -1).any()) == (kind == "packed" or topk == 40)  # rows with fewer selectable keys than k
    weight = torch.randn(T, 4, 8, generator=g, dtype=F64)
    leaves = (q, kv, q_i, k_i, w_i)
    results = []
    for ops in (REFERENCE_OPS, LONG_CONTEXT_OPS):
        out, loss = attention_and_loss_on_slots(q, kv, q_i, k_i, w_i, sel, stage="sparse", sm_scale=0.3, d_v=8,
                                                relu=True, starts=starts, ends=ends, ops=ops)
        results.append((out, loss, *torch.autograd.grad((out * weight).sum() + loss, leaves)))
    _close(results[1], results[0])
