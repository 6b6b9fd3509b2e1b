"""Property-based tests: every functional op against a brute-force float64 restatement written here.

`hypothesis` draws small shapes, windows (arbitrary and packed-causal), ``-1`` patterns, duplicate
slots, tied scores and dtypes; each op must match the loop-by-loop definition below, which shares
no code with the package. A second property injects garbage (NaN, +-Inf, 1e30) into memory the op
does not read and asks for the bitwise-same result. Examples are derandomised and bounded so the
file runs in well under a minute on two cores.
"""

from __future__ import annotations

import math

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import dsa_ref as d  # noqa: E402
from dsa_ref.indexer import index_scores_at  # noqa: E402
from dsa_ref.sparse_attention import attention_head_sum  # noqa: E402

SETTINGS = settings(max_examples=50, derandomize=True, deadline=None, database=None)
TOL = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=2e-5, atol=2e-6)}


# --- drawing inputs -------------------------------------------------------------------------------


@st.composite
def problems(draw, *, packed=None):
    """A random small problem: sizes, dtype, windows, selections with -1 and duplicates, tied scores."""
    T = draw(st.integers(0, 6))
    H = draw(st.integers(1, 3))
    D = draw(st.integers(1, 5))
    K = draw(st.integers(1, 5))
    dtype = draw(st.sampled_from([torch.float64, torch.float32]))
    seed = draw(st.integers(0, 2**31 - 1))
    use_packed = draw(st.booleans()) if packed is None else packed
    if use_packed:  # packed causal sequences; queries are all tokens
        lengths = draw(st.lists(st.integers(0, 4), min_size=1, max_size=3))
        total = sum(lengths)
        T = total
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        starts, ends = d.key_windows(cu)
        S = total
    else:
        S = draw(st.integers(0, 7))
        a = [draw(st.integers(0, S)) for _ in range(T)]
        b = [draw(st.integers(0, S)) for _ in range(T)]  # b < a gives an empty window
        starts, ends = torch.tensor(a, dtype=torch.long), torch.tensor(b, dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(-1, max(S, 1), (T, K), generator=g) if S else torch.full((T, K), -1)
    tie_scores = draw(st.booleans())  # integer-valued scores: many exact ties
    return dict(T=T, S=S, H=H, D=D, K=K, dtype=dtype, g=g, starts=starts, ends=ends, idx=idx, ties=tie_scores)


def _tensors(p):
    g, dt = p["g"], p["dtype"]
    q = torch.randn(p["T"], p["H"], p["D"], generator=g, dtype=torch.float64).to(dt)
    kv = torch.randn(p["S"], p["D"], generator=g, dtype=torch.float64).to(dt)
    w = torch.randn(p["T"], p["H"], generator=g, dtype=torch.float64).to(dt)
    return q, kv, w


# --- the definitions, one loop at a time ----------------------------------------------------------


def brute_attention(q, kv, keys_of_row, sm_scale, d_v):
    """out[t, h] = sum_j softmax_j(s * q[t, h].kv[key_j]) * kv[key_j, :d_v] over the row's key list."""
    T, H, _ = q.shape
    out = torch.zeros(T, H, d_v, dtype=torch.float64)
    lse = torch.full((T, H), -math.inf, dtype=torch.float64)
    for t in range(T):
        keys = keys_of_row(t)
        for h in range(H):
            if not keys:
                continue
            logits = torch.stack([sm_scale * (q[t, h].double() @ kv[s].double()) for s in keys])
            lse[t, h] = torch.logsumexp(logits, 0)
            probs = torch.exp(logits - lse[t, h])
            out[t, h] = sum(probs[j] * kv[s, :d_v].double() for j, s in enumerate(keys))
    return out, lse


def brute_index_score(q, k, w, t, s, relu=True):
    dots = [(q[t, j].double() @ k[s].double()) for j in range(q.shape[1])]
    return sum(w[t, j].double() * (max(x, 0.0) if relu else x) for j, x in enumerate(dots))


def brute_topk(scores, topk):
    rows = []
    for row in scores.tolist():
        order = sorted((i for i, v in enumerate(row) if v != -math.inf), key=lambda i: (-row[i], i))[:topk]
        rows.append(order + [-1] * (topk - len(order)))
    return torch.tensor(rows, dtype=torch.long).view(len(rows), topk)


def brute_kl(scores, q, kv, valid_of_row, sm_scale):
    """mean over rows with a valid key of KL(p || softmax(I)) on the row's valid key set."""
    total, n = 0.0, 0
    for t in range(q.shape[0]):
        keys = valid_of_row(t)
        if not keys:
            continue
        n += 1
        mass = torch.zeros(len(keys), dtype=torch.float64)
        for h in range(q.shape[1]):
            logits = torch.stack([sm_scale * (q[t, h].double() @ kv[s].double()) for s in keys])
            mass += torch.softmax(logits, 0)
        p = mass / mass.sum()
        log_pred = torch.log_softmax(torch.stack([scores[t, s].double() for s in keys]), 0)
        total += float((torch.xlogy(p, p) - p * log_pred).sum())
    return total / max(n, 1)


def window_keys(p):
    return lambda t: list(range(int(p["starts"][t]), int(p["ends"][t])))


def slot_keys(p):
    return lambda t: [int(s) for s in p["idx"][t] if s >= 0]


# --- each op against its definition ---------------------------------------------------------------


@SETTINGS
@given(problems())
def test_sparse_mla_matches_definition(p):
    q, kv, _ = _tensors(p)
    d_v = max(1, p["D"] - 1)
    out, lse = d.sparse_mla(q, kv, p["idx"], sm_scale=0.7, d_v=d_v)
    want_out, want_lse = brute_attention(q, kv, slot_keys(p), 0.7, d_v)  # duplicates: one term per slot
    torch.testing.assert_close(out.double(), want_out, **TOL[p["dtype"]])
    torch.testing.assert_close(lse.double(), want_lse, **TOL[p["dtype"]])


@SETTINGS
@given(problems())
def test_dense_mla_attention_matches_definition(p):
    q, kv, _ = _tensors(p)
    out, lse = d.dense_mla_attention(q, kv, sm_scale=0.7, d_v=p["D"], starts=p["starts"], ends=p["ends"])
    want_out, want_lse = brute_attention(q, kv, window_keys(p), 0.7, p["D"])
    torch.testing.assert_close(out.double(), want_out, **TOL[p["dtype"]])
    torch.testing.assert_close(lse.double(), want_lse, **TOL[p["dtype"]])


@SETTINGS
@given(problems(), st.booleans())
def test_lightning_indexer_and_scores_at_match_definition(p, relu):
    q, k, w = _tensors(p)
    scores = d.lightning_indexer(q, k, w, starts=p["starts"], ends=p["ends"], relu=relu)
    want = torch.full((p["T"], p["S"]), -math.inf, dtype=torch.float64)
    for t in range(p["T"]):
        for s in window_keys(p)(t):
            want[t, s] = brute_index_score(q, k, w, t, s, relu)
    torch.testing.assert_close(scores.double(), want, **TOL[p["dtype"]])
    at = index_scores_at(q, k, w, p["idx"], relu=relu)
    want_at = torch.tensor([[brute_index_score(q, k, w, t, int(s), relu) if s >= 0 else -math.inf
                             for s in p["idx"][t]] for t in range(p["T"])], dtype=torch.float64)
    torch.testing.assert_close(at.double(), want_at.view(p["T"], p["K"]), **TOL[p["dtype"]])


@SETTINGS
@given(problems(), st.integers(1, 9))
def test_topk_indices_matches_definition(p, topk):
    q, k, w = _tensors(p)
    scores = d.lightning_indexer(q, k, w, starts=p["starts"], ends=p["ends"])
    if p["ties"]:  # few distinct values: ties must go to the lower key index
        scores = torch.where(torch.isinf(scores), scores, scores.round())
    assert torch.equal(d.topk_indices(scores, topk), brute_topk(scores, topk))


@SETTINGS
@given(problems(), st.sampled_from(["dense_warmup", "sparse"]))
def test_indexer_loss_matches_definition(p, stage):
    q, kv, w = _tensors(p)
    scores = torch.randn(p["T"], p["S"], generator=p["g"], dtype=torch.float64).to(p["dtype"])
    topk = p["idx"] if stage == "sparse" else None
    loss = d.indexer_loss(scores, q, kv, sm_scale=0.7, starts=p["starts"], ends=p["ends"], topk_indices=topk)
    inside = window_keys(p)
    if topk is None:
        valid_of_row = inside
    else:
        valid_of_row = lambda t: sorted(set(slot_keys(p)(t)) & set(inside(t)))  # noqa: E731 the selected *set*
    want = brute_kl(scores, q, kv, valid_of_row, 0.7)
    assert math.isclose(float(loss), want, rel_tol=1e-9 if p["dtype"] == torch.float64 else 1e-4, abs_tol=1e-6)


@SETTINGS
@given(problems())
def test_attention_head_sum_matches_definition(p):
    q, kv, _ = _tensors(p)
    _, lse = d.sparse_mla(q, kv, p["idx"], sm_scale=0.7, d_v=p["D"])
    mass = attention_head_sum(q, kv, p["idx"], lse, sm_scale=0.7)
    want = torch.zeros(p["T"], p["K"], dtype=torch.float64)
    for t in range(p["T"]):
        for j, s in enumerate(p["idx"][t].tolist()):
            if s >= 0:
                want[t, j] = sum(math.exp(0.7 * float(q[t, h].double() @ kv[s].double()) - float(lse[t, h]))
                                 for h in range(p["H"]))
    torch.testing.assert_close(mass.double(), want, **TOL[p["dtype"]])


# --- garbage in unread memory changes nothing -----------------------------------------------------


@SETTINGS
@given(problems(), st.sampled_from([math.nan, math.inf, -math.inf, 1e30]))
def test_unread_memory_never_reaches_a_result(p, junk):
    """Rows no slot selects and keys no window holds: garbage there gives the bitwise-same result."""
    q, kv, w = _tensors(p)
    S = p["S"]
    read_by_slots = torch.zeros(S, dtype=torch.bool)
    read_by_windows = torch.zeros(S, dtype=torch.bool)
    for t in range(p["T"]):
        read_by_slots[slot_keys(p)(t)] = True
        read_by_windows[window_keys(p)(t)] = True

    def with_junk(x, read):
        clean, dirty = x.clone(), x.clone()
        clean[~read] = 0.0
        dirty[~read] = junk
        return clean, dirty

    def run(fn, *inputs):
        leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
        outs = fn(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        total = sum(torch.where(torch.isinf(o), torch.zeros_like(o), o).sum() for o in outs)
        if torch.is_tensor(total) and total.requires_grad:
            total.backward()
        return [o.detach() for o in outs] + [x.grad for x in leaves]

    def same(a, b):
        return all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b))

    clean, dirty = with_junk(kv, read_by_slots)
    sparse = lambda q_, kv_: d.sparse_mla(q_, kv_, p["idx"], sm_scale=0.7, d_v=p["D"])  # noqa: E731
    assert same(run(sparse, q, clean), run(sparse, q, dirty))
    at = lambda q_, k_, w_: index_scores_at(q_, k_, w_, p["idx"])  # noqa: E731
    assert same(run(at, q, clean, w), run(at, q, dirty, w))

    clean, dirty = with_junk(kv, read_by_windows)
    win = dict(starts=p["starts"], ends=p["ends"])
    dense = lambda q_, kv_: d.dense_mla_attention(q_, kv_, sm_scale=0.7, d_v=p["D"], **win)  # noqa: E731
    assert same(run(dense, q, clean), run(dense, q, dirty))
    index = lambda q_, k_, w_: d.lightning_indexer(q_, k_, w_, **win)  # noqa: E731
    assert same(run(index, q, clean, w), run(index, q, dirty, w))
