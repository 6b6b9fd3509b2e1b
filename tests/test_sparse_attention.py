"""Sparse absorbed-MLA attention (`sparse_mla`) and its dense per-head form (`sparse_attention`).

* against a per-token, per-head, per-slot python loop (float64): ``-1`` slots, duplicate slots
  (a key in two slots is two softmax terms), rows with no valid slot (out 0, lse -inf, finite
  gradients), ``[S, 1, D]`` kv and ``[T, 1, K]`` indices;
* every window key selected (topk >= window) == `dense_mla_attention` with causal packed windows:
  outputs, lse and gradients (pitfall P2);
* absorption stays exact under sparsity: `sparse_attention` on MLA's dense q/k/v == `sparse_mla` on
  the absorbed q/kv followed by ``W_UV``, outputs and parameter gradients;
* gradcheck with -1 and duplicate slots; an attention-sink pattern (many queries selecting the same
  early keys, pitfall P16) against a dense masked autograd reference;
* bf16 against float64 within stated tolerances; chunking invariance; input validation.
"""

from __future__ import annotations

import pytest
import torch

from dsa_ref.absorbed_mla import AbsorbedMLA, apply_w_uv
from dsa_ref.attention import dense_mla_attention, windowed_attention
from dsa_ref.config import tiny
from dsa_ref.indexer import topk_indices
from dsa_ref.layout import key_windows, positions
from dsa_ref.mla import MLA
from dsa_ref.sparse_attention import check_indices, sparse_attention, sparse_mla


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def naive_sparse_mla(q, kv, indices, sm_scale, d_v):
    """One query, one head, one slot at a time. Each valid slot is one softmax term."""
    T, H, _ = q.shape
    outs, lses = [], []
    for t in range(T):
        slots = [int(i) for i in indices[t] if int(i) >= 0]
        row_o, row_l = [], []
        for h in range(H):
            if not slots:
                row_o.append(torch.zeros(d_v, dtype=q.dtype))
                row_l.append(torch.tensor(float("-inf"), dtype=q.dtype))
                continue
            s = torch.stack([sm_scale * (q[t, h] @ kv[j]) for j in slots])  # [n]
            p = torch.softmax(s, 0)
            row_o.append(sum(p[n] * kv[j, :d_v] for n, j in enumerate(slots)))
            row_l.append(torch.logsumexp(s, 0))
        outs.append(torch.stack(row_o))
        lses.append(torch.stack(row_l))
    return torch.stack(outs), torch.stack(lses)


def random_indices(T, S, K, g, *, empty_rows=(0,), dup_rows=(1, 2)):
    """Random slots in [-1, S): some -1, forced duplicates in ``dup_rows``, all -1 in ``empty_rows``."""
    idx = torch.randint(-1, S, (T, K), generator=g)
    for r in dup_rows:
        if r < T and K >= 3:
            idx[r, 1] = idx[r, 0] = torch.randint(0, S, (1,), generator=g)
            idx[r, 2] = idx[r, 0]  # three copies
    for r in empty_rows:
        if r < T:
            idx[r] = -1
    return idx


def make(T, S, H, D, seed, dtype=torch.float64, grad=True):
    g = _gen(seed)
    q = torch.randn(T, H, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_(grad)
    kv = torch.randn(S, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_(grad)
    return q, kv, g


# ---------------------------------------------------------------------------------------------
# against the loop
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("K", [1, 4, 9, 20])
def test_sparse_mla_matches_loop(K):
    T, S, H, D, d_v = 7, 9, 3, 10, 6
    q, kv, g = make(T, S, H, D, seed=K)
    idx = random_indices(T, S, K, g)
    scale = 0.37
    out, lse = sparse_mla(q, kv, idx, sm_scale=scale, d_v=d_v)
    ref_o, ref_l = naive_sparse_mla(q, kv, idx, scale, d_v)
    assert out.shape == (T, H, d_v) and lse.shape == (T, H)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    torch.testing.assert_close(out, ref_o, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, ref_l, rtol=0, atol=1e-12)
    # gradients, with a random upstream gradient on out and on every finite lse
    g_o = torch.randn(out.shape, generator=g, dtype=torch.float64)
    g_l = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    fin = torch.isfinite(ref_l)
    got = torch.autograd.grad((out * g_o).sum() + (lse[fin] * g_l[fin]).sum(), (q, kv))
    want = torch.autograd.grad((ref_o * g_o).sum() + (ref_l[fin] * g_l[fin]).sum(), (q, kv))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


def test_duplicate_slots_count_twice():
    """[a, a, b] puts two softmax terms on a: equals the loop, and differs from the set {a, b}."""
    T, S, H, D = 2, 6, 2, 4
    q, kv, _ = make(T, S, H, D, seed=3, grad=False)
    idx = torch.tensor([[4, 4, 1], [2, 5, 2]])
    out, lse = sparse_mla(q, kv, idx, sm_scale=0.5, d_v=3)
    ref_o, ref_l = naive_sparse_mla(q, kv, idx, 0.5, 3)
    torch.testing.assert_close(out, ref_o, rtol=0, atol=1e-13)
    torch.testing.assert_close(lse, ref_l, rtol=0, atol=1e-13)
    dedup = torch.tensor([[4, 1, -1], [2, 5, -1]])
    out_d, lse_d = sparse_mla(q, kv, dedup, sm_scale=0.5, d_v=3)
    assert (out - out_d).abs().max() > 1e-3
    # by hand: lse with the duplicate = logsumexp(s_a, s_a, s_b) = logsumexp(s_a + log 2, s_b)
    s = 0.5 * torch.einsum("hd,kd->hk", q[0], kv[[4, 1]])
    torch.testing.assert_close(lse[0], torch.logsumexp(torch.stack([s[:, 0] + torch.log(torch.tensor(2.0, dtype=s.dtype)),
                                                                     s[:, 1]], -1), -1), rtol=0, atol=1e-13)
    # slot order does not matter
    out_p, lse_p = sparse_mla(q, kv, torch.tensor([[1, 4, 4], [2, 2, 5]]), sm_scale=0.5, d_v=3)
    torch.testing.assert_close(out_p, out, rtol=0, atol=1e-14)
    torch.testing.assert_close(lse_p, lse, rtol=0, atol=1e-14)


def test_minus_one_slots_are_ignored_wherever_they_are():
    T, S, H, D = 3, 8, 2, 5
    q, kv, _ = make(T, S, H, D, seed=4, grad=False)
    base = torch.tensor([[3, 0, 7], [1, 2, 6], [5, 4, 0]])
    ref = sparse_mla(q, kv, base, sm_scale=0.3, d_v=4)
    padded = torch.tensor([[-1, 3, -1, 0, 7, -1], [1, -1, 2, 6, -1, -1], [-1, -1, -1, 5, 4, 0]])
    got = sparse_mla(q, kv, padded, sm_scale=0.3, d_v=4)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-14)
    # a -1 slot does not secretly read row 0 (the gather placeholder): changing row 0 changes
    # nothing for rows that do not select key 0
    kv2 = kv.clone()
    kv2[0] += 100.0
    o1, _ = sparse_mla(q, kv, torch.tensor([[-1, 3], [1, -1], [-1, -1]]), sm_scale=0.3, d_v=4)
    o2, _ = sparse_mla(q, kv2, torch.tensor([[-1, 3], [1, -1], [-1, -1]]), sm_scale=0.3, d_v=4)
    torch.testing.assert_close(o1, o2, rtol=0, atol=0)


@pytest.mark.parametrize("chunk_size", [None, 1, 2])
def test_empty_rows_out_zero_lse_minus_inf_finite_grads(chunk_size):
    T, S, H, D = 5, 6, 3, 8
    q, kv, g = make(T, S, H, D, seed=5)
    idx = torch.tensor([[-1, -1, -1], [0, 2, -1], [-1, -1, -1], [5, 5, 1], [-1, -1, -1]])
    out, lse = sparse_mla(q, kv, idx, sm_scale=0.25, d_v=5, chunk_size=chunk_size)
    empty = torch.tensor([True, False, True, False, True])
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert bool(torch.isneginf(lse[empty]).all())
    assert bool(torch.isfinite(lse[~empty]).all()) and bool(torch.isfinite(out).all())
    # backward through out and lse (upstream gradient nonzero on every row, the -inf rows included)
    torch.autograd.backward([out, lse], [torch.randn(out.shape, generator=g, dtype=out.dtype),
                                         torch.randn(lse.shape, generator=g, dtype=lse.dtype)])
    assert bool(torch.isfinite(q.grad).all()) and bool(torch.isfinite(kv.grad).all())
    assert torch.equal(q.grad[empty], torch.zeros_like(q.grad[empty]))
    # keys nobody selects get no gradient
    assert torch.equal(kv.grad[[3, 4]], torch.zeros_like(kv.grad[[3, 4]]))
    assert kv.grad[[0, 1, 2, 5]].abs().sum(-1).min() > 0


def test_a_nan_read_from_a_selected_row_reaches_out_and_lse():
    """A NaN in a *selected* row of ``kv`` makes ``out`` and ``lse`` NaN for every query that
    selects it (such a row is not empty: its LSE is not ``-inf``), sparse and dense alike; queries
    that do not select it, and empty rows, are as without it."""
    T, S, H, D = 6, 7, 2, 8
    q, kv, _ = make(T, S, H, D, seed=9)
    idx = torch.tensor([[0, 3, -1], [1, 2, 4], [3, 3, -1], [-1, -1, -1], [5, 6, 0], [2, -1, 1]])
    clean_out, clean_lse = sparse_mla(q, kv, idx, sm_scale=0.3, d_v=6)
    kv = kv.detach().clone()
    kv[3, 2] = float("nan")
    reads = (idx == 3).any(dim=1)  # queries 0 and 2
    for chunk_size in (None, 2):
        out, lse = sparse_mla(q, kv, idx, sm_scale=0.3, d_v=6, chunk_size=chunk_size)
        assert bool(torch.isnan(out[reads]).all()) and bool(torch.isnan(lse[reads]).all())
        assert torch.equal(out[~reads], clean_out[~reads]) and torch.equal(lse[~reads], clean_lse[~reads])
        assert bool(torch.isneginf(lse[3]).all())  # the empty row stays empty
    # the dense form (every query's window is every key, so every query reads row 3)
    out_d, lse_d = windowed_attention(q, kv, kv[:, :6], sm_scale=0.3)  # MQA: one key row for all heads
    assert bool(torch.isnan(out_d).all()) and bool(torch.isnan(lse_d).all())


def test_all_rows_empty_and_bf16_empty_rows():
    q, kv, _ = make(3, 4, 2, 6, seed=6)
    idx = torch.full((3, 2), -1)
    out, lse = sparse_mla(q, kv, idx, sm_scale=0.5, d_v=6)
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q)) and torch.equal(kv.grad, torch.zeros_like(kv))
    # bf16: same convention; lse in float32
    qb, kvb = q.detach().bfloat16().requires_grad_(), kv.detach().bfloat16().requires_grad_()
    ob, lb = sparse_mla(qb, kvb, torch.tensor([[-1, -1], [0, 1], [-1, 3]]), sm_scale=0.5, d_v=6)
    assert ob.dtype == torch.bfloat16 and lb.dtype == torch.float32
    assert torch.equal(ob[0], torch.zeros_like(ob[0])) and bool(torch.isneginf(lb[0]).all())
    ob.float().sum().backward()
    assert bool(torch.isfinite(qb.grad.float()).all()) and bool(torch.isfinite(kvb.grad.float()).all())


def test_three_dim_kv_and_indices_accepted():
    T, S, H, D = 4, 7, 2, 6
    q, kv, g = make(T, S, H, D, seed=7, grad=False)
    idx = random_indices(T, S, 5, g)
    ref = sparse_mla(q, kv, idx, sm_scale=0.4, d_v=4)
    for kv_, idx_ in ((kv[:, None], idx), (kv, idx[:, None]), (kv[:, None], idx[:, None])):
        got = sparse_mla(q, kv_, idx_, sm_scale=0.4, d_v=4)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    # int32 indices are accepted and mean the same
    got = sparse_mla(q, kv, idx.int(), sm_scale=0.4, d_v=4)
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# every window key selected == dense attention (pitfall P2)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cu_list", [[0, 13], [0, 5, 6, 13, 21], [0, 1, 9, 9, 16]])
@pytest.mark.parametrize("extra", [0, 3])
def test_all_window_keys_equals_dense(cu_list, extra):
    cu = torch.tensor(cu_list)
    T = int(cu[-1])
    H, D, d_v = 3, 12, 8
    q, kv, g = make(T, T, H, D, seed=len(cu_list) * 10 + extra)
    starts, ends = key_windows(cu)
    max_window = int((ends - starts).max())
    topk = max_window + extra  # topk == the longest window, or above it
    # random scores inside the window: the selection order is random, the SET is the whole window
    keys = torch.arange(T)
    inside = (keys[None] >= starts[:, None]) & (keys[None] < ends[:, None])
    scores = torch.randn(T, T, generator=g, dtype=torch.float64).masked_fill(~inside, float("-inf"))
    idx = topk_indices(scores, topk)
    assert int((idx >= 0).sum()) == int(inside.sum())  # all window keys are selected
    scale = 0.29
    out_s, lse_s = sparse_mla(q, kv, idx, sm_scale=scale, d_v=d_v)
    out_d, lse_d = dense_mla_attention(q, kv, sm_scale=scale, d_v=d_v, starts=starts, ends=ends)
    torch.testing.assert_close(out_s, out_d, rtol=0, atol=1e-13)
    torch.testing.assert_close(lse_s, lse_d, rtol=0, atol=1e-13)
    g_o = torch.randn(out_s.shape, generator=g, dtype=torch.float64)
    g_l = torch.randn(lse_s.shape, generator=g, dtype=torch.float64)
    gs = torch.autograd.grad((out_s * g_o).sum() + (lse_s * g_l).sum(), (q, kv))
    gd = torch.autograd.grad((out_d * g_o).sum() + (lse_d * g_l).sum(), (q, kv))
    for a, b in zip(gs, gd):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_topk_below_window_differs_from_dense():
    """The converse: with topk below the window sizes the selection really drops keys."""
    T, H, D = 16, 2, 6
    q, kv, g = make(T, T, H, D, seed=8, grad=False)
    starts, ends = key_windows(torch.tensor([0, T]))
    keys = torch.arange(T)
    inside = (keys[None] >= starts[:, None]) & (keys[None] < ends[:, None])
    scores = torch.randn(T, T, generator=g, dtype=torch.float64).masked_fill(~inside, float("-inf"))
    topk = 4
    idx = topk_indices(scores, topk)
    out_s, _ = sparse_mla(q, kv, idx, sm_scale=0.4, d_v=D)
    out_d, _ = dense_mla_attention(q, kv, sm_scale=0.4, d_v=D, starts=starts, ends=ends)
    # rows whose window fits in topk agree, longer rows do not
    torch.testing.assert_close(out_s[:topk], out_d[:topk], rtol=0, atol=1e-13)
    assert (out_s[topk:] - out_d[topk:]).abs().amax(dim=(1, 2)).min() > 1e-6


# ---------------------------------------------------------------------------------------------
# absorption stays exact under sparsity
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("topk", [3, 8, 40])
def test_dense_form_equals_absorbed_form_under_sparsity(topk):
    cfg = tiny().mla
    torch.manual_seed(9)
    mla = MLA(cfg, dtype=torch.float64)
    absorbed = AbsorbedMLA(mla)
    cu = torch.tensor([0, 11, 12, 32])
    T = 32
    g = _gen(10)
    x = torch.randn(T, cfg.dim, generator=g, dtype=torch.float64, requires_grad=True)
    starts, ends = key_windows(cu)
    keys = torch.arange(T)
    inside = (keys[None] >= starts[:, None]) & (keys[None] < ends[:, None])
    scores = torch.randn(T, T, generator=g, dtype=torch.float64).masked_fill(~inside, float("-inf"))
    idx = topk_indices(scores, topk)
    idx[5, -1] = idx[5, 0]  # a duplicate slot too: both forms count it twice
    p = mla.project(x, positions(cu))

    q, k, v = mla.dense_qkv(p)  # [T, H, 24], [T, H, 24], [T, H, 16]
    o_dense, lse_dense = sparse_attention(q, k, v, idx, sm_scale=mla.softmax_scale)
    qa, kva = absorbed.absorbed_qkv(p)  # [T, H, 72], [T, 72]
    o_lat, lse_abs = sparse_mla(qa, kva, idx, sm_scale=mla.softmax_scale, d_v=cfg.kv_lora_rank)
    _, w_uv = mla.kv_up_weights()
    o_abs = apply_w_uv(o_lat, w_uv)
    assert o_dense.shape == o_abs.shape == (T, cfg.n_heads, cfg.v_head_dim)
    torch.testing.assert_close(o_abs, o_dense, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse_abs, lse_dense, rtol=0, atol=1e-12)
    # gradients into x and every MLA weight agree too
    g_o = torch.randn(o_dense.shape, generator=g, dtype=torch.float64)
    params = [x] + list(mla.parameters())
    gd = torch.autograd.grad((o_dense * g_o).sum(), params, retain_graph=True, allow_unused=True)
    ga = torch.autograd.grad((o_abs * g_o).sum(), params, allow_unused=True)
    for (name, _), a, b in zip([("x", x)] + list(mla.named_parameters()), ga, gd):
        if b is None:
            assert a is None or a.abs().max() == 0, name
            continue
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11, msg=name)


def test_sparse_attention_dense_form_matches_loop():
    g = _gen(11)
    T, S, H, D, Dv = 4, 6, 2, 5, 3
    q = torch.randn(T, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(S, H, D, generator=g, dtype=torch.float64)
    v = torch.randn(S, H, Dv, generator=g, dtype=torch.float64)
    idx = random_indices(T, S, 4, g)
    out, lse = sparse_attention(q, k, v, idx, sm_scale=0.6)
    for t in range(T):
        slots = [int(j) for j in idx[t] if j >= 0]
        for h in range(H):
            if not slots:
                assert torch.equal(out[t, h], torch.zeros(Dv, dtype=torch.float64))
                assert lse[t, h] == float("-inf")
                continue
            s = torch.stack([0.6 * q[t, h] @ k[j, h] for j in slots])
            torch.testing.assert_close(out[t, h], torch.softmax(s, 0) @ v[slots, h], rtol=0, atol=1e-13)
            torch.testing.assert_close(lse[t, h], torch.logsumexp(s, 0), rtol=0, atol=1e-13)


# ---------------------------------------------------------------------------------------------
# gradcheck and the attention-sink pattern
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [None, 1])
def test_gradcheck_with_minus_one_and_duplicates(chunk_size):
    q, kv, _ = make(4, 5, 2, 4, seed=12)
    idx = torch.tensor([[0, 0, -1], [3, -1, 1], [4, 4, 4], [2, 1, 0]])

    def f(q, kv):
        return sparse_mla(q, kv, idx, sm_scale=0.7, d_v=3, chunk_size=chunk_size)

    assert torch.autograd.gradcheck(f, (q, kv))
    if chunk_size is None:  # second order through checkpointed chunks is slow and adds nothing
        assert torch.autograd.gradgradcheck(f, (q, kv))

    # with an empty row: gradcheck the output (the lse of that row is -inf, not differentiable)
    idx_e = torch.tensor([[-1, -1, -1], [3, -1, 1], [4, 4, 2], [2, 1, 0]])
    assert torch.autograd.gradcheck(
        lambda q, kv: sparse_mla(q, kv, idx_e, sm_scale=0.7, d_v=3, chunk_size=chunk_size)[0], (q, kv))


def test_attention_sink_pattern_dkv_matches_dense_masked_reference():
    """Every query selects keys 0, 1, 2 plus a few others (the causal sink pattern that broke
    cuDNN's sparse backward): dkv and dq against a dense masked softmax under autograd."""
    T, S, H, D, d_v = 24, 24, 4, 16, 12
    q, kv, g = make(T, S, H, D, seed=13)
    K = 6
    idx = torch.full((T, K), -1)
    for t in range(T):
        window = torch.arange(t + 1)
        extra = window[3:][torch.randperm(max(t - 2, 0), generator=g)[: K - 3]]
        row = torch.cat([torch.tensor([0, 1, 2])[: t + 1], extra])
        idx[t, : len(row)] = row[torch.randperm(len(row), generator=g)]  # slots in random order
    scale = 0.3
    out, lse = sparse_mla(q, kv, idx, sm_scale=scale, d_v=d_v)

    mask = torch.zeros(T, S, dtype=torch.bool)
    for t in range(T):
        mask[t, idx[t][idx[t] >= 0]] = True
    q2, kv2 = q.detach().clone().requires_grad_(), kv.detach().clone().requires_grad_()
    s = torch.einsum("thd,sd->ths", q2, kv2) * scale
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    ref_o = torch.einsum("ths,sv->thv", torch.softmax(s, -1), kv2[:, :d_v])
    ref_l = torch.logsumexp(s, -1)
    torch.testing.assert_close(out, ref_o, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, ref_l, rtol=0, atol=1e-12)
    g_o = torch.randn(out.shape, generator=g, dtype=torch.float64)
    g_l = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    torch.autograd.backward([out, lse], [g_o, g_l])
    torch.autograd.backward([ref_o, ref_l], [g_o, g_l])
    torch.testing.assert_close(kv.grad, kv2.grad, rtol=0, atol=1e-11)
    torch.testing.assert_close(q.grad, q2.grad, rtol=0, atol=1e-11)
    # the sink keys collect gradient from every query: far larger than a typical key's
    assert kv.grad[:3].norm(dim=-1).min() > kv.grad[12:].norm(dim=-1).median()


# ---------------------------------------------------------------------------------------------
# bf16 and chunking
# ---------------------------------------------------------------------------------------------


def test_bf16_within_stated_tolerances():
    """bf16 inputs, float32 accumulation, bf16 output.

    Tolerances, against float64 run on the *same bf16-rounded inputs* (so only the computation
    differs): the output is a convex combination of value rows, rounded once to bf16 at the end,
    so its error is about half a bf16 ulp of |out| (2^-9 relative) plus float32 accumulation
    error (~1e-6): ``atol = 2^-8 * max|v|``. The lse stays in float32 and is only a float32
    logsumexp of float32 scores: ``atol = 1e-5`` for O(10) scores. Gradients are returned in bf16:
    each one is rounded once, so ``2^-7`` relative to the largest entry covers them.
    Against float64 on the unrounded inputs the input rounding (2^-9 per element, random signs)
    adds ~sqrt(D) * 2^-9 * |q||kv| * scale to each score; we check the looser bound there.
    """
    T, S, H, D, d_v = 16, 20, 4, 32, 24
    q64, kv64, g = make(T, S, H, D, seed=14, grad=False)
    idx = random_indices(T, S, 8, g, empty_rows=(3,))
    scale = D ** -0.5
    qb = q64.bfloat16().requires_grad_()
    kvb = kv64.bfloat16().requires_grad_()
    out_b, lse_b = sparse_mla(qb, kvb, idx, sm_scale=scale, d_v=d_v)
    assert out_b.dtype == torch.bfloat16 and lse_b.dtype == torch.float32

    qr, kvr = qb.detach().double().requires_grad_(), kvb.detach().double().requires_grad_()
    out_r, lse_r = sparse_mla(qr, kvr, idx, sm_scale=scale, d_v=d_v)
    vmax = float(kvr.detach()[:, :d_v].abs().max())
    torch.testing.assert_close(out_b.double(), out_r, rtol=0, atol=2 ** -8 * vmax)
    fin = torch.isfinite(lse_r)
    assert torch.equal(fin, torch.isfinite(lse_b))
    torch.testing.assert_close(lse_b.double()[fin], lse_r[fin], rtol=0, atol=1e-5)

    g_o = torch.randn(out_r.shape, generator=g, dtype=torch.float64)
    (out_b.double() * g_o).sum().backward()
    (out_r * g_o).sum().backward()
    for a, b in ((qb.grad, qr.grad), (kvb.grad, kvr.grad)):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=2 ** -7 * float(b.abs().max()))

    # the unrounded float64 truth: input rounding dominates; a loose but meaningful bound
    out_t, lse_t = sparse_mla(q64, kv64, idx, sm_scale=scale, d_v=d_v)
    torch.testing.assert_close(out_b.double(), out_t, rtol=0, atol=2 ** -5 * vmax)
    torch.testing.assert_close(lse_b.double()[fin], lse_t[fin], rtol=0, atol=2 ** -4)


def test_chunk_size_invariance():
    T, S, H, D = 11, 13, 3, 8
    q, kv, g = make(T, S, H, D, seed=15)
    idx = random_indices(T, S, 5, g, empty_rows=(0, 7))
    g_o = torch.randn(T, H, 6, generator=g, dtype=torch.float64)
    results = []
    for c in (None, 1, 3, 11, 50):
        q.grad = kv.grad = None
        out, lse = sparse_mla(q, kv, idx, sm_scale=0.5, d_v=6, chunk_size=c)
        (out * g_o).sum().backward()
        results.append((out.detach(), lse.detach(), q.grad.clone(), kv.grad.clone()))
    for r in results[1:]:
        for a, b in zip(r, results[0]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-14)


# ---------------------------------------------------------------------------------------------
# input validation
# ---------------------------------------------------------------------------------------------


def test_bad_inputs_raise_clear_errors():
    q, kv, _ = make(3, 5, 2, 6, seed=16, grad=False)
    idx = torch.tensor([[0, 1], [2, -1], [4, 3]])
    kw = dict(sm_scale=0.5, d_v=4)
    with pytest.raises(TypeError, match=r"^indices must be an integer tensor"):
        sparse_mla(q, kv, idx.float(), **kw)
    with pytest.raises(ValueError, match=r"^indices values must be -1 .* got range \[0, 5\]"):
        sparse_mla(q, kv, torch.tensor([[0, 5], [1, 2], [3, 4]]), **kw)
    with pytest.raises(ValueError, match=r"^indices values must be -1 .* got range \[-2, 4\]"):
        sparse_mla(q, kv, torch.tensor([[0, -2], [1, 2], [3, 4]]), **kw)
    with pytest.raises(ValueError, match=r"^indices has size 2 in dim 0"):
        sparse_mla(q, kv, idx[:2], **kw)
    with pytest.raises(ValueError, match=r"^indices must have shape \[T, K\]"):
        sparse_mla(q, kv, idx[:, 0], **kw)
    with pytest.raises(ValueError, match=r"^indices has size 2 in dim 1"):
        sparse_mla(q, kv, torch.stack([idx, idx], 1), **kw)
    with pytest.raises(ValueError, match=r"^indices must have at least one slot"):
        sparse_mla(q, kv, idx[:, :0], **kw)
    with pytest.raises(ValueError, match=r"^q must have shape \[T, H, D\]"):
        sparse_mla(q[:, 0], kv, idx, **kw)
    with pytest.raises(ValueError, match=r"^kv must have shape"):
        sparse_mla(q, kv[0], idx, **kw)
    with pytest.raises(ValueError, match=r"^kv has size 2 in dim 1"):
        sparse_mla(q, torch.stack([kv, kv], 1), idx, **kw)
    with pytest.raises(ValueError, match=r"^kv has size 5 in dim 1 .* expected 6"):
        sparse_mla(q, kv[:, :5], idx, **kw)
    with pytest.raises(TypeError, match=r"^kv must be a floating-point"):
        sparse_mla(q, kv.long(), idx, **kw)
    with pytest.raises(TypeError, match=r"^q must be a floating-point"):
        sparse_mla(q.int(), kv, idx, **kw)
    for d_v in (0, 7, -1, 2.0, True):
        with pytest.raises(ValueError, match=r"^d_v must be an int in \[1, D=6\]"):
            sparse_mla(q, kv, idx, sm_scale=0.5, d_v=d_v)
    for s in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=r"^sm_scale"):
            sparse_mla(q, kv, idx, sm_scale=s, d_v=4)
    with pytest.raises(TypeError, match=r"^sm_scale"):
        sparse_mla(q, kv, idx, sm_scale=None, d_v=4)
    with pytest.raises(TypeError, match="sm_scale"):
        sparse_mla(q, kv, idx)  # sm_scale is required (keyword-only, no default)
    with pytest.raises(ValueError, match="chunk_size"):
        sparse_mla(q, kv, idx, chunk_size=0, **kw)
    # the dense form validates the same way
    k = torch.randn(5, 2, 6, dtype=torch.float64)
    v = torch.randn(5, 2, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"^indices values"):
        sparse_attention(q, k, v, torch.tensor([[0, 9], [1, 2], [3, 4]]), sm_scale=0.5)
    with pytest.raises(ValueError, match=r"^k has size 3 in dim 1"):
        sparse_attention(q, torch.randn(5, 3, 6, dtype=torch.float64), v, idx, sm_scale=0.5)
    with pytest.raises(ValueError, match=r"^v has size 4 in dim 0"):
        sparse_attention(q, k, v[:4], idx, sm_scale=0.5)
    # check_indices names the argument it is given
    with pytest.raises(ValueError, match=r"^topk_indices values"):
        check_indices(torch.tensor([[7]]), 1, 5, name="topk_indices")


def test_check_indices_halves_split_shape_from_range():
    """`check_indices` = `check_index_shape` (no device sync) + `check_index_range` of `index_bounds`,
    the split the kernel wrapper uses to read the range back only after its launch."""
    from dsa_ref.sparse_attention import check_index_range, check_index_shape, index_bounds

    idx = torch.tensor([[[3, -1, 0]], [[4, 4, -1]]])  # [T=2, 1, K=3]
    flat = check_index_shape(idx, 2)
    assert flat.shape == (2, 3) and torch.equal(flat, idx[:, 0])
    assert index_bounds(flat).tolist() == [-1, 4]
    check_index_range(index_bounds(flat), 5)  # in range: no error
    with pytest.raises(ValueError, match=r"^indices values .*num_keys=4\), got range \[-1, 4\]"):
        check_index_range(index_bounds(flat), 4)
    with pytest.raises(ValueError, match=r"^idx values .*got range \[-3, 4\]"):
        check_index_range(index_bounds(torch.tensor([[-3, 4]])), 9, name="idx")
    # the shape half never looks at values, and still names what it expected
    check_index_shape(torch.tensor([[99]]), 1)
    with pytest.raises(ValueError, match="one row per query"):
        check_index_shape(flat, 3)
    with pytest.raises(TypeError):
        check_index_shape(flat.float(), 2)
    with pytest.raises(ValueError, match="at least one slot"):
        check_index_shape(torch.zeros(2, 0, dtype=torch.long), 2)
