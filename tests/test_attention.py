"""Windowed softmax attention (MHA/MQA) and dense absorbed-MLA attention against a naive per-query
loop, the empty-row convention (out 0, lse -inf, no NaN), chunking invariance, bf16 error bounds,
input validation and gradcheck."""

from __future__ import annotations

import math

import pytest
import torch

from dsa_ref.attention import (
    auto_chunk_size,
    dense_mla_attention,
    masked_softmax_with_lse,
    window_span,
    windowed_attention,
)
from dsa_ref.layout import key_windows


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def naive_attention(q, k, v, sm_scale, starts=None, ends=None):
    """One query, one head at a time: softmax over the window's keys, written out plainly."""
    T, H, _ = q.shape
    S = k.shape[0]
    d_v = v.shape[-1]
    outs, lses = [], []
    for t in range(T):
        row_o, row_l = [], []
        lo, hi = (0, S) if starts is None else (int(starts[t]), int(ends[t]))
        for h in range(H):
            if hi <= lo:
                row_o.append(torch.zeros(d_v, dtype=q.dtype))
                row_l.append(torch.tensor(float("-inf"), dtype=q.dtype))
                continue
            kk = k[lo:hi] if k.dim() == 2 else k[lo:hi, h]  # [n, D]
            vv = v[lo:hi] if v.dim() == 2 else v[lo:hi, h]  # [n, D_v]
            s = sm_scale * (kk @ q[t, h])  # [n]
            row_l.append(torch.logsumexp(s, 0))
            row_o.append(torch.softmax(s, 0) @ vv)
        outs.append(torch.stack(row_o))
        lses.append(torch.stack(row_l))
    return torch.stack(outs), torch.stack(lses)


def random_windows(T, S, g, *, n_empty=2):
    """Random windows in [0, S]; the first n_empty rows (and any row where ends <= starts) are empty."""
    a = torch.randint(0, S + 1, (T,), generator=g)
    b = torch.randint(0, S + 1, (T,), generator=g)
    starts, ends = torch.minimum(a, b), torch.maximum(a, b)
    ends[:n_empty] = starts[:n_empty]  # empty windows
    if n_empty < T:
        starts[n_empty], ends[n_empty] = 0, S  # one full window
    return starts, ends


def make_qkv(T, S, H, D, Dv, *, mqa, seed, dtype=torch.float64, grad=True):
    g = _gen(seed)
    q = torch.randn(T, H, D, generator=g, dtype=torch.float64)
    kshape = (S, D) if mqa else (S, H, D)
    vshape = (S, Dv) if mqa else (S, H, Dv)
    k = torch.randn(*kshape, generator=g, dtype=torch.float64)
    v = torch.randn(*vshape, generator=g, dtype=torch.float64)
    out = [x.to(dtype).requires_grad_(grad) for x in (q, k, v)]
    return out


def grads_of(fn, inputs, g_out, g_lse):
    for x in inputs:
        x.grad = None
    out, lse = fn(*inputs)
    # backprop through both outputs; upstream gradient is nonzero on every row, including lse=-inf rows
    torch.autograd.backward([out, lse], [g_out, g_lse])
    return out.detach(), lse.detach(), [x.grad.clone() for x in inputs]


# ---------------------------------------------------------------------------------------------
# against the naive loop
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mqa", [False, True], ids=["mha", "mqa"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_windowed_attention_matches_naive(mqa, seed):
    T, S, H, D, Dv = 9, 11, 3, 5, 4
    q, k, v = make_qkv(T, S, H, D, Dv, mqa=mqa, seed=seed)
    starts, ends = random_windows(T, S, _gen(100 + seed))
    scale = 0.37
    g = _gen(200 + seed)
    g_out = torch.randn(T, H, Dv, generator=g, dtype=torch.float64)
    g_lse = torch.randn(T, H, generator=g, dtype=torch.float64)

    out, lse, grads = grads_of(
        lambda q, k, v: windowed_attention(q, k, v, sm_scale=scale, starts=starts, ends=ends), (q, k, v),
        g_out, g_lse)
    # the naive loop cannot backprop through -inf lse rows: they are constants there, so zero their seed
    empty = (ends <= starts)[:, None].expand(T, H)
    ref_out, ref_lse, ref_grads = grads_of(
        lambda q, k, v: naive_attention(q, k, v, scale, starts, ends), (q, k, v),
        g_out, g_lse.masked_fill(empty, 0.0))

    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    assert out.shape == (T, H, Dv) and lse.shape == (T, H)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)
    for name, a, b in zip("qkv", grads, ref_grads):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12, msg=f"grad {name}")


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("kv_rank3", [False, True])
def test_dense_mla_attention_matches_naive(seed, kv_rank3):
    T, S, H, D, d_v = 8, 10, 4, 12, 8
    g = _gen(seed)
    q = torch.randn(T, H, D, generator=g, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(S, D, generator=g, dtype=torch.float64, requires_grad=True)
    starts, ends = random_windows(T, S, g)
    g_out = torch.randn(T, H, d_v, generator=g, dtype=torch.float64)
    g_lse = torch.randn(T, H, generator=g, dtype=torch.float64)
    scale = D ** -0.5

    def fn(q, kv):
        return dense_mla_attention(q, kv[:, None] if kv_rank3 else kv, sm_scale=scale, d_v=d_v,
                                   starts=starts, ends=ends)

    out, lse, (gq, gkv) = grads_of(fn, (q, kv), g_out, g_lse)
    empty = (ends <= starts)[:, None].expand(T, H)
    ref_out, ref_lse, (rq, rkv) = grads_of(
        lambda q, kv: naive_attention(q, kv, kv[:, :d_v], scale, starts, ends), (q, kv),
        g_out, g_lse.masked_fill(empty, 0.0))
    assert out.shape == (T, H, d_v)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gq, rq, rtol=1e-11, atol=1e-12)
    torch.testing.assert_close(gkv, rkv, rtol=1e-11, atol=1e-12)  # key and value parts of kv


def test_no_mask_equals_full_windows():
    T, S, H, D = 5, 7, 2, 4
    q, k, v = make_qkv(T, S, H, D, D, mqa=True, seed=3, grad=False)
    full = (torch.zeros(T, dtype=torch.int64), torch.full((T,), S))
    a = windowed_attention(q, k, v, sm_scale=0.5)
    b = windowed_attention(q, k, v, sm_scale=0.5, starts=full[0], ends=full[1])
    c = naive_attention(q, k, v, 0.5)
    for x, y, z in zip(a, b, c):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
        torch.testing.assert_close(x, z, rtol=1e-12, atol=1e-12)


def test_causal_windows_mqa_equals_masked_dense():
    T, H, D = 6, 2, 4
    q, k, v = make_qkv(T, T, H, D, 3, mqa=True, seed=4, grad=False)
    s, e = key_windows(torch.tensor([0, 2, 6]))
    out, _ = windowed_attention(q, k, v, sm_scale=1.0, starts=s, ends=e)
    scores = torch.einsum("thd,sd->ths", q, k)
    mask = torch.tensor([[1, 1, 0, 0, 0, 0]] * 0 + [
        [1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0], [0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    p = scores.masked_fill(~mask[:, None, :], float("-inf")).softmax(-1)
    torch.testing.assert_close(out, torch.einsum("ths,sv->thv", p, v), rtol=1e-12, atol=1e-12)


def test_lse_is_logsumexp_of_scaled_valid_scores():
    T, S, H, D = 10, 12, 3, 6
    q, k, v = make_qkv(T, S, H, D, 2, mqa=False, seed=5, grad=False)
    starts, ends = random_windows(T, S, _gen(6))
    scale = 0.123
    _, lse = windowed_attention(q, k, v, sm_scale=scale, starts=starts, ends=ends)
    scores = scale * torch.einsum("thd,shd->ths", q, k)
    keys = torch.arange(S)
    valid = (keys >= starts[:, None]) & (keys < ends[:, None])
    want = torch.logsumexp(scores.masked_fill(~valid[:, None, :], float("-inf")), dim=-1)
    assert torch.equal(torch.isinf(lse), torch.isinf(want))
    torch.testing.assert_close(lse, want, rtol=1e-13, atol=1e-13)


def test_large_scores_do_not_overflow():
    T, S, H, D = 4, 6, 2, 8
    q, k, v = make_qkv(T, S, H, D, D, mqa=True, seed=7, grad=False)
    q32, k32, v32 = (x.float() for x in (q, k, v))
    out, lse = windowed_attention(q32 * 300, k32, v32, sm_scale=1.0)  # scores in the thousands
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    ref_out, ref_lse = naive_attention(q * 300, k, v, 1.0)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-3)


def test_extreme_negative_scores_in_a_window_are_not_empty():
    """A valid key with a hugely negative score still makes the row non-empty."""
    scores = torch.tensor([[-1e30, float("-inf")]], dtype=torch.float64)
    p, lse = masked_softmax_with_lse(scores, torch.tensor([[True, False]]))
    assert p.tolist() == [[1.0, 0.0]] and lse.item() == -1e30


# ---------------------------------------------------------------------------------------------
# empty rows
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mqa", [False, True], ids=["mha", "mqa"])
def test_empty_rows(dtype, mqa):
    T, S, H, D, Dv = 6, 5, 2, 4, 3
    q, k, v = make_qkv(T, S, H, D, Dv, mqa=mqa, seed=8, dtype=dtype)
    starts = torch.tensor([0, 3, 0, 5, 2, 4])
    ends = torch.tensor([0, 3, 5, 5, 1, 5])  # rows 0, 1, 3, 4 empty (incl. starts > ends)
    empty = torch.tensor([True, True, False, True, True, False])
    out, lse = windowed_attention(q, k, v, sm_scale=0.5, starts=starts, ends=ends, chunk_size=2)
    assert out.dtype == dtype
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert bool((lse[empty] == float("-inf")).all())
    assert torch.isfinite(lse[~empty]).all() and torch.isfinite(out).all()
    g = _gen(9)
    torch.autograd.backward([out, lse], [torch.randn(out.shape, generator=g).to(dtype),
                                         torch.randn(lse.shape, generator=g).to(lse.dtype)])
    for name, x in zip("qkv", (q, k, v)):
        assert x.grad is not None and torch.isfinite(x.grad).all(), name
    assert torch.equal(q.grad[empty], torch.zeros_like(q.grad[empty]))  # empty rows see nothing


def test_all_rows_empty():
    q, k, v = make_qkv(3, 4, 2, 4, 4, mqa=True, seed=10)
    z = torch.zeros(3, dtype=torch.int64)
    out, lse = dense_mla_attention(q, k, sm_scale=1.0, d_v=2, starts=z, ends=z)
    assert torch.equal(out, torch.zeros(3, 2, 2, dtype=torch.float64))
    assert bool(torch.isneginf(lse).all())
    torch.autograd.backward([out, lse], [torch.ones_like(out), torch.ones_like(lse)])
    assert torch.equal(q.grad, torch.zeros_like(q)) and torch.equal(k.grad, torch.zeros_like(k))


def test_no_keys_at_all():
    q = torch.randn(3, 2, 4, dtype=torch.float64, generator=_gen(11))
    kv = torch.zeros(0, 4, dtype=torch.float64)
    z = torch.zeros(3, dtype=torch.int64)
    out, lse = dense_mla_attention(q, kv, sm_scale=1.0, d_v=4, starts=z, ends=z)
    assert torch.equal(out, torch.zeros(3, 2, 4, dtype=torch.float64)) and bool(torch.isneginf(lse).all())


def test_no_queries():
    q = torch.zeros(0, 2, 4)
    kv = torch.randn(5, 4, generator=_gen(12))
    z = torch.zeros(0, dtype=torch.int64)
    out, lse = dense_mla_attention(q, kv, sm_scale=1.0, d_v=3, starts=z, ends=z)
    assert out.shape == (0, 2, 3) and lse.shape == (0, 2)


# ---------------------------------------------------------------------------------------------
# chunking
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mqa", [False, True], ids=["mha", "mqa"])
def test_chunk_size_invariance(mqa):
    T, S, H, D, Dv = 10, 10, 2, 4, 3
    q, k, v = make_qkv(T, S, H, D, Dv, mqa=mqa, seed=13)
    starts, ends = random_windows(T, S, _gen(14), n_empty=3)
    g = _gen(15)
    g_out = torch.randn(T, H, Dv, generator=g, dtype=torch.float64)
    g_lse = torch.randn(T, H, generator=g, dtype=torch.float64)
    results = {}
    for chunk in (1, 3, None, 64):
        results[chunk] = grads_of(
            lambda q, k, v: windowed_attention(q, k, v, sm_scale=0.4, starts=starts, ends=ends, chunk_size=chunk),
            (q, k, v), g_out, g_lse)
    base_out, base_lse, base_grads = results[None]
    for chunk, (out, lse, grads) in results.items():
        torch.testing.assert_close(out, base_out, rtol=1e-14, atol=1e-14, msg=f"chunk {chunk}")
        torch.testing.assert_close(lse, base_lse, rtol=1e-14, atol=1e-14, msg=f"chunk {chunk}")
        for a, b in zip(grads, base_grads):
            torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13, msg=f"chunk {chunk}")


def test_dense_mla_chunk_size_invariance():
    T, S, H, D = 7, 7, 3, 6
    g = _gen(16)
    q = torch.randn(T, H, D, generator=g, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(S, D, generator=g, dtype=torch.float64, requires_grad=True)
    s, e = key_windows(torch.tensor([0, 3, 7]))
    ref = None
    for chunk in (1, 3, None):
        q.grad = kv.grad = None
        out, lse = dense_mla_attention(q, kv, sm_scale=0.3, d_v=4, starts=s, ends=e, chunk_size=chunk)
        (out.square().sum() + lse.sum()).backward()
        res = (out.detach(), lse.detach(), q.grad.clone(), kv.grad.clone())
        if ref is None:
            ref = res
        for a, b in zip(res, ref):
            torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)


def test_window_span():
    assert window_span(torch.tensor([3, 0, 5]), torch.tensor([4, 0, 9])) == (3, 9)  # the empty row is ignored
    assert window_span(torch.tensor([2, 7]), torch.tensor([2, 1])) == (0, 0)  # every window empty
    assert window_span(torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64)) == (0, 0)
    with pytest.raises(TypeError, match="starts"):
        window_span(torch.tensor([0.0]), torch.tensor([1]))
    with pytest.raises(ValueError, match="ends"):
        window_span(torch.tensor([0, 1]), torch.tensor([1]))


def test_chunk_scores_only_the_keys_its_windows_cover(monkeypatch):
    """Causal windows, chunks of 4 queries: each chunk's score block spans its own keys (up to its
    last query), not all S keys, and the result equals the one-chunk computation."""
    T, H, D = 16, 2, 6
    g = _gen(31)
    q = torch.randn(T, H, D, generator=g, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(T, D, generator=g, dtype=torch.float64, requires_grad=True)
    starts, ends = key_windows(torch.tensor([0, 5, T]))  # two packed sequences
    seen: list[tuple[int, ...]] = []
    real_einsum = torch.einsum

    def recording_einsum(eq, *ops):
        out = real_einsum(eq, *ops)
        if eq == "thd,sd->ths":
            seen.append(tuple(out.shape))
        return out

    results = []
    for chunk in (4, T):
        q.grad = kv.grad = None
        monkeypatch.setattr(torch, "einsum", recording_einsum)
        out, lse = dense_mla_attention(q, kv, sm_scale=0.3, d_v=4, starts=starts, ends=ends, chunk_size=chunk)
        monkeypatch.setattr(torch, "einsum", real_einsum)
        (out.square().sum() + lse.sum()).backward()
        results.append((out.detach(), lse.detach(), q.grad.clone(), kv.grad.clone()))
    # chunk rows [0, 4): keys [0, 4); [4, 8): keys [0, 8) (row 4 is in sequence one); [8, 12): [5, 12); [12, 16): [5, 16)
    assert seen[:4] == [(4, H, 4), (4, H, 8), (4, H, 7), (4, H, 11)]
    assert seen[4] == (T, H, T)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)


def test_auto_chunk_size():
    assert auto_chunk_size(100, 10, 7) == 7
    assert auto_chunk_size(100, 10, budget=250) == 25
    assert auto_chunk_size(100, 10**9, budget=250) == 1  # at least one row
    assert auto_chunk_size(5, 1, budget=10**6) == 5  # never more rows than exist
    assert auto_chunk_size(0, 4) == 1
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="chunk_size"):
            auto_chunk_size(10, 10, bad)


# ---------------------------------------------------------------------------------------------
# bf16
# ---------------------------------------------------------------------------------------------

# bf16 keeps 8 significant bits (7 stored + the implicit one): rounding to nearest bf16 has
# relative error at most u = 2**-8.
U_BF16 = 2.0 ** -8


@pytest.mark.parametrize("mqa", [False, True], ids=["mha", "mqa"])
def test_bf16_vs_float64(mqa):
    T, S, H, D, Dv = 16, 16, 4, 32, 16
    q64, k64, v64 = make_qkv(T, S, H, D, Dv, mqa=mqa, seed=17, grad=False)
    starts, ends = key_windows(torch.tensor([0, 5, 16]))
    scale = D ** -0.5
    q, k, v = (x.bfloat16() for x in (q64, k64, v64))
    out, lse = windowed_attention(q, k, v, sm_scale=scale, starts=starts, ends=ends)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32

    # (a) Against float64 on the *same* bf16 values, the only errors are float32 accumulation
    # (~1e-6 relative here) and the final rounding of out to bf16 (u * |out|). lse is float32 and
    # never rounded to bf16, so it matches to float32 accuracy.
    ref_out, ref_lse = naive_attention(q.double(), k.double(), v.double(), scale, starts, ends)
    err = (out.double() - ref_out).abs()
    assert bool((err <= U_BF16 * ref_out.abs() + 1e-5).all()), float(err.max())
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=1e-5)

    # (b) Against float64 on the original inputs, input rounding moves each score by at most
    # eps = scale * |q_t| |k_s| * (2u + u^2): |q' . k' - q . k| <= |dq||k| + |q||dk| + |dq||dk|.
    # lse moves by at most eps, each probability by a factor within exp(+-2 eps), so the weighted
    # average of values moves by at most (exp(2 eps) - 1) max|v|; add v's own rounding (u max|v|)
    # and out's final rounding (u |out|).
    ref_out, ref_lse = naive_attention(q64, k64, v64, scale, starts, ends)
    qn = q64.norm(dim=-1).max()
    kn = k64.norm(dim=-1).max()
    eps = float(scale * qn * kn * (2 * U_BF16 + U_BF16 ** 2))
    vmax = float(v64.abs().max())
    out_bound = (math.exp(2 * eps) - 1) * vmax + U_BF16 * vmax + U_BF16 * ref_out.abs() + 1e-5
    err = (out.double() - ref_out).abs()
    assert bool((err <= out_bound).all()), (float(err.max()), eps)
    assert float((lse.double() - ref_lse).abs().max()) <= eps + 1e-5
    # the bound is not vacuous: the error is a real fraction of it, and the bound is small
    assert eps < 0.2 and float(err.max()) > 0


def test_float32_vs_float64():
    q64, k64, v64 = make_qkv(8, 8, 2, 16, 8, mqa=True, seed=18, grad=False)
    out, lse = windowed_attention(q64.float(), k64.float(), v64.float(), sm_scale=0.25)
    ref_out, ref_lse = naive_attention(q64.float().double(), k64.float().double(), v64.float().double(), 0.25)
    assert out.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# kv layouts
# ---------------------------------------------------------------------------------------------


def test_kv_with_singleton_head_dim_accepted():
    q, kv, _ = make_qkv(5, 6, 3, 8, 8, mqa=True, seed=19, grad=False)
    a = dense_mla_attention(q, kv, sm_scale=0.3, d_v=5)
    b = dense_mla_attention(q, kv[:, None, :], sm_scale=0.3, d_v=5)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_dense_mla_equals_windowed_mqa_with_value_slice():
    q, kv, _ = make_qkv(5, 6, 3, 8, 8, mqa=True, seed=20, grad=False)
    s, e = random_windows(5, 6, _gen(21))
    a = dense_mla_attention(q, kv, sm_scale=0.3, d_v=5, starts=s, ends=e)
    b = windowed_attention(q, kv, kv[:, :5], sm_scale=0.3, starts=s, ends=e)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_mqa_equals_mha_with_repeated_keys():
    T, S, H, D = 4, 5, 3, 4
    q, k, v = make_qkv(T, S, H, D, 2, mqa=True, seed=22, grad=False)
    s, e = random_windows(T, S, _gen(23))
    a = windowed_attention(q, k, v, sm_scale=0.7, starts=s, ends=e)
    b = windowed_attention(q, k[:, None].expand(S, H, D), v[:, None].expand(S, H, 2), sm_scale=0.7,
                           starts=s, ends=e)
    torch.testing.assert_close(a[0], b[0], rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(a[1], b[1], rtol=1e-14, atol=1e-14)


def test_int32_windows_accepted():
    q, k, v = make_qkv(4, 5, 2, 4, 4, mqa=True, seed=24, grad=False)
    s, e = random_windows(4, 5, _gen(25))
    a = windowed_attention(q, k, v, sm_scale=1.0, starts=s, ends=e)
    b = windowed_attention(q, k, v, sm_scale=1.0, starts=s.int(), ends=e.int())
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ---------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------

T0, S0, H0, D0 = 3, 4, 2, 5


def _q():
    return torch.zeros(T0, H0, D0)


def _w(lo=0, hi=S0, n=T0):
    return torch.full((n,), lo, dtype=torch.int64), torch.full((n,), hi, dtype=torch.int64)


_WINDOWED_BAD = [
    # (q, k, v, kwargs, exception, message pattern)
    (torch.zeros(T0, D0), torch.zeros(S0, D0), torch.zeros(S0, D0), {}, ValueError, r"q must have shape \[T, H, D\]"),
    (_q(), torch.zeros(S0, 1, 1, D0), torch.zeros(S0, 1, 1, D0), {}, ValueError, r"k must have shape"),
    (_q(), torch.zeros(S0, D0), torch.zeros(S0, H0, D0), {}, ValueError, r"v must have shape \[S, D_v\]"),
    (_q(), torch.zeros(S0, D0 + 1), torch.zeros(S0, D0), {}, ValueError, r"k has size 6 .*expected 5 \(q's head dim\)"),
    (_q(), torch.zeros(S0, D0), torch.zeros(S0 + 1, D0), {}, ValueError, r"v has size 5 .*one value per key"),
    (_q(), torch.zeros(S0, H0 + 1, D0), torch.zeros(S0, H0 + 1, D0), {}, ValueError, r"k has size 3 .*q's heads"),
    (_q(), torch.zeros(S0, H0, D0), torch.zeros(S0, 1, D0), {}, ValueError, r"v has size 1 .*q's heads"),
    (_q().long(), torch.zeros(S0, D0), torch.zeros(S0, D0), {}, TypeError, r"q must be a floating-point tensor"),
    (_q(), torch.zeros(S0, D0, dtype=torch.int32), torch.zeros(S0, D0), {}, TypeError, r"k must be a floating"),
    (_q(), torch.zeros(S0, D0), [[0.0]], {}, TypeError, r"v must be a torch.Tensor"),
    (_q(), torch.zeros(S0, D0), torch.zeros(S0, D0), {"starts": _w()[0]}, ValueError, r"starts and ends must be given together"),
    (_q(), torch.zeros(S0, D0), torch.zeros(S0, D0), {"ends": _w()[1]}, ValueError, r"starts and ends must be given together"),
    (_q(), torch.zeros(S0, D0), torch.zeros(S0, D0), {"starts": _w()[0].float(), "ends": _w()[1]}, TypeError, r"starts must be an integer tensor"),
    (_q(), torch.zeros(S0, D0), torch.zeros(S0, D0), {"starts": _w()[0], "ends": _w()[1].double()}, TypeError, r"ends must be an integer tensor"),
    (_q(), torch.zeros(S0, D0), torch.zeros(S0, D0), {"starts": _w(-1)[0], "ends": _w()[1]}, ValueError, r"starts must be >= 0, got min -1"),
    (_q(), torch.zeros(S0, D0), torch.zeros(S0, D0), {"starts": _w()[0], "ends": _w(0, S0 + 1)[1]}, ValueError, r"ends must be <= num_keys=4, got max 5"),
    (_q(), torch.zeros(S0, D0), torch.zeros(S0, D0), dict(zip(("starts", "ends"), _w(n=T0 + 1))), ValueError, r"starts has size 4 .*one window per query"),
    (_q(), torch.zeros(S0, D0), torch.zeros(S0, D0), {"starts": _w()[0][None], "ends": _w()[1][None]}, ValueError, r"starts must have shape \[T\]"),
    (_q(), torch.zeros(S0, D0), torch.zeros(S0, D0), {"chunk_size": 0}, ValueError, r"chunk_size must be an int >= 1"),
]


@pytest.mark.parametrize("q, k, v, kwargs, exc, match", _WINDOWED_BAD)
def test_windowed_attention_bad_inputs(q, k, v, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        windowed_attention(q, k, v, sm_scale=1.0, **kwargs)


@pytest.mark.parametrize("scale, exc", [
    (0.0, ValueError), (-0.1, ValueError), (float("inf"), ValueError), (float("nan"), ValueError),
    ("0.1", TypeError), (True, TypeError), (None, TypeError), (torch.tensor(0.1), TypeError),
])
def test_bad_sm_scale(scale, exc):
    kv = torch.zeros(S0, D0)
    with pytest.raises(exc, match="sm_scale"):
        dense_mla_attention(_q(), kv, sm_scale=scale, d_v=2)
    with pytest.raises(exc, match="sm_scale"):
        windowed_attention(_q(), kv, kv, sm_scale=scale)


def test_sm_scale_is_keyword_only():
    kv = torch.zeros(S0, D0)
    with pytest.raises(TypeError):
        dense_mla_attention(_q(), kv, 0.1)  # noqa


@pytest.mark.parametrize("d_v", [0, -1, D0 + 1, True, 2.0, None])
def test_dense_mla_bad_d_v(d_v):
    with pytest.raises(ValueError, match=r"d_v must be an int in \[1, D=5\]"):
        dense_mla_attention(_q(), torch.zeros(S0, D0), sm_scale=1.0, d_v=d_v)


def test_dense_mla_d_v_full_width_ok():
    out, _ = dense_mla_attention(_q(), torch.zeros(S0, D0), sm_scale=1.0, d_v=D0)
    assert out.shape == (T0, H0, D0)


@pytest.mark.parametrize("q, kv, exc, match", [
    (_q(), torch.zeros(S0, 2, D0), ValueError, r"kv has size 2 .*one latent KV head"),
    (_q(), torch.zeros(S0), ValueError, r"kv must have shape \[S, D\] or \[S, 1, D\]"),
    (_q(), torch.zeros(S0, D0 - 1), ValueError, r"kv has size 4 .*q's head dim"),
    (torch.zeros(T0, D0), torch.zeros(S0, D0), ValueError, r"q must have shape \[T, H, D\]"),
    (_q(), torch.zeros(S0, D0, dtype=torch.int64), TypeError, r"kv must be a floating-point tensor"),
])
def test_dense_mla_bad_inputs(q, kv, exc, match):
    with pytest.raises(exc, match=match):
        dense_mla_attention(q, kv, sm_scale=1.0, d_v=2)


# ---------------------------------------------------------------------------------------------
# gradcheck
# ---------------------------------------------------------------------------------------------


def _finite_lse(fn):
    # finite differences of -inf are NaN; the empty rows' lse is a constant, so compare it as 0
    def wrapped(*args):
        out, lse = fn(*args)
        return out, torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return wrapped


@pytest.mark.parametrize("mqa", [False, True], ids=["mha", "mqa"])
@pytest.mark.parametrize("chunk", [None, 2])
def test_gradcheck_windowed(mqa, chunk):
    q, k, v = make_qkv(4, 5, 2, 3, 2, mqa=mqa, seed=26)
    starts = torch.tensor([0, 1, 2, 0])
    ends = torch.tensor([0, 3, 5, 1])  # an empty row, partial windows, a single key
    fn = _finite_lse(lambda q, k, v: windowed_attention(q, k, v, sm_scale=0.8, starts=starts, ends=ends,
                                                        chunk_size=chunk))
    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_gradcheck_dense_mla():
    g = _gen(27)
    q = torch.randn(4, 2, 5, generator=g, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    starts = torch.tensor([2, 0, 3, 1])
    ends = torch.tensor([2, 6, 4, 5])
    fn = _finite_lse(lambda q, kv: dense_mla_attention(q, kv, sm_scale=0.6, d_v=3, starts=starts, ends=ends))
    assert torch.autograd.gradcheck(fn, (q, kv), eps=1e-6, atol=1e-8, rtol=1e-6)
