"""The lightning indexer and the canonical top-k.

* `hadamard_matrix` / `rotate_activation`: orthonormal, symmetric, power-of-two only, dot products kept;
* `LightningIndexer`: Hadamard on == off in float64 (same weights), the projections against a
  hand-rolled formula (half-split RoPE on the first rope dims only, pe first, nope untouched,
  LayerNorm on k, folded head-weight scale), ``weights_proj`` kept in float32 under a bf16 module;
* `lightning_indexer` against an explicit loop over queries, heads and keys (with and without ReLU,
  with key windows: ``-inf`` outside), chunking invariance;
* `topk_indices` against a brute-force sort with key ``(-score, index)`` on inputs full of exact
  ties, ``-inf`` never selected, ``-1`` padding, ``k_eff = min(topk, window)``, sequence lengths
  around ``topk`` (pitfall P2), NaN rejected, chunking invariance;
* input validation: every error names the argument.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from dsa_ref.config import DSAConfig, tiny
from dsa_ref.indexer import (
    LightningIndexer,
    hadamard_matrix,
    lightning_indexer,
    rotate_activation,
    topk_indices,
)
from dsa_ref.layout import key_windows, positions
from dsa_ref.rope import rope_inv_freq


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _cfg(**indexer_changes) -> DSAConfig:
    cfg = tiny()
    return replace(cfg, indexer=replace(cfg.indexer, **indexer_changes)) if indexer_changes else cfg


def _randomise(module: torch.nn.Module, seed: int) -> None:
    """Give every parameter (LayerNorm's weight and bias included) a non-trivial random value."""
    g = _gen(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * 0.5 + 0.1)


def _inputs(cfg: DSAConfig, T: int, seed: int, dtype=torch.float64):
    g = _gen(seed)
    x = torch.randn(T, cfg.mla.dim, generator=g, dtype=torch.float64).to(dtype)
    qr = torch.randn(T, cfg.mla.q_lora_rank, generator=g, dtype=torch.float64).to(dtype)
    return x, qr


# ---------------------------------------------------------------------------------------------
# Hadamard
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16, 128])
def test_hadamard_orthonormal_and_symmetric(n):
    h = hadamard_matrix(n, dtype=torch.float64)
    assert h.shape == (n, n)
    torch.testing.assert_close(h, h.T, rtol=0, atol=0)
    torch.testing.assert_close(h @ h.T, torch.eye(n, dtype=torch.float64), rtol=0, atol=1e-14)
    # every entry is +-1/sqrt(n) (a real Hadamard matrix, not just any orthonormal one)
    torch.testing.assert_close(h.abs(), torch.full((n, n), n ** -0.5, dtype=torch.float64), rtol=0, atol=1e-15)
    # Sylvester's first row is all positive
    assert bool((h[0] > 0).all())


@pytest.mark.parametrize("n", [0, 3, 6, 12, 100, -4, 2.0, True])
def test_hadamard_rejects_non_power_of_two(n):
    with pytest.raises(ValueError, match="power of two"):
        hadamard_matrix(n)


def test_rotate_activation_preserves_dot_products():
    g = _gen(0)
    a = torch.randn(5, 3, 16, generator=g, dtype=torch.float64)
    b = torch.randn(7, 16, generator=g, dtype=torch.float64)
    ra, rb = rotate_activation(a), rotate_activation(b)
    assert ra.shape == a.shape and ra.dtype == a.dtype
    # it really rotates (not the identity) ...
    assert (ra - a).abs().max() > 0.1
    # ... but keeps every dot product and norm
    torch.testing.assert_close(torch.einsum("thd,sd->ths", ra, rb), torch.einsum("thd,sd->ths", a, b),
                               rtol=0, atol=1e-12)
    torch.testing.assert_close(ra.norm(dim=-1), a.norm(dim=-1), rtol=1e-13, atol=0)
    # it is its own inverse (symmetric orthonormal)
    torch.testing.assert_close(rotate_activation(ra), a, rtol=0, atol=1e-13)
    # bf16 keeps its dtype and is rounded from the same rotation
    rbf = rotate_activation(a.to(torch.bfloat16))
    assert rbf.dtype == torch.bfloat16
    torch.testing.assert_close(rbf.double(), rotate_activation(a.to(torch.bfloat16).double()),
                               rtol=2 ** -8, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# LightningIndexer
# ---------------------------------------------------------------------------------------------


def _scores(indexer: LightningIndexer, x, qr, cu, relu=True):
    pos = positions(cu)
    q, k, w = indexer.project(x, qr, pos)
    starts, ends = key_windows(cu)
    return lightning_indexer(q, k, w, starts=starts, ends=ends, relu=relu), (q, k, w)


@pytest.mark.parametrize("relu", [True, False])
def test_hadamard_on_off_equal_scores_float64(relu):
    cfg_h, cfg_n = _cfg(use_hadamard=True), _cfg(use_hadamard=False)
    ih = LightningIndexer(cfg_h, dtype=torch.float64)
    _randomise(ih, 1)
    inn = LightningIndexer(cfg_n, dtype=torch.float64)
    inn.load_state_dict(ih.state_dict())
    cu = torch.tensor([0, 7, 20, 33])
    x, qr = _inputs(cfg_h, 33, seed=2)
    s_h, (qh, kh, wh) = _scores(ih, x, qr, cu, relu)
    s_n, (qn, kn, wn) = _scores(inn, x, qr, cu, relu)
    # the rotation is really applied, to q and k alike (a one-sided rotation would change the scores)
    h = hadamard_matrix(cfg_h.indexer.head_dim, dtype=torch.float64)
    torch.testing.assert_close(qh, qn @ h, rtol=0, atol=1e-12)
    torch.testing.assert_close(kh, kn @ h, rtol=0, atol=1e-12)
    assert (qh - qn).abs().max() > 1e-3
    torch.testing.assert_close(wh, wn, rtol=0, atol=0)
    finite = torch.isfinite(s_n)
    assert torch.equal(finite, torch.isfinite(s_h))
    assert s_n[finite].abs().max() > 1e-3  # not trivially zero
    torch.testing.assert_close(s_h[finite], s_n[finite], rtol=0, atol=1e-12)


def test_hadamard_on_off_bf16_within_tolerance():
    """In bf16 the rotation only changes rounding: the scores agree to bf16 accuracy (pitfall P3a)."""
    cfg_h, cfg_n = _cfg(use_hadamard=True), _cfg(use_hadamard=False)
    ih = LightningIndexer(cfg_h, dtype=torch.float64)
    _randomise(ih, 3)
    inn = LightningIndexer(cfg_n, dtype=torch.float64)
    inn.load_state_dict(ih.state_dict())
    ih, inn = ih.to(torch.bfloat16), inn.to(torch.bfloat16)
    cu = torch.tensor([0, 24])
    x, qr = _inputs(cfg_h, 24, seed=4, dtype=torch.bfloat16)
    s_h, _ = _scores(ih, x, qr, cu)
    s_n, _ = _scores(inn, x, qr, cu)
    finite = torch.isfinite(s_n)
    scale = s_n[finite].detach().abs().max()
    # q and k are rounded to bf16 (2^-8 relative) after different rotations; a few ulps of the
    # largest score is the honest bound
    torch.testing.assert_close(s_h[finite], s_n[finite], rtol=0, atol=float(scale) * 2 ** -5)


def _hand_rope_half_split(x, pos, inv_freq, rope_dim, interleaved=False):
    """Rotate channels [0:rope_dim] of x [T, ..., D] element by element; the rest is copied."""
    out = x.clone()
    half = rope_dim // 2
    for t in range(x.shape[0]):
        for i in range(half):
            ang = float(pos[t]) * float(inv_freq[i])
            c, s = math.cos(ang), math.sin(ang)
            a_idx, b_idx = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
            a, b = x[t, ..., a_idx], x[t, ..., b_idx]
            out[t, ..., a_idx] = a * c - b * s
            out[t, ..., b_idx] = a * s + b * c
    return out


@pytest.mark.parametrize("interleaved", [False, True])
def test_project_against_hand_rolled_formula(interleaved):
    """q = rope(wq_b(qr)), k = rope(LayerNorm(wk(x))), w = weights_proj(x) * H^-1/2 * D^-1/2,
    RoPE only on the first rope dims (pe first), the nope part untouched (use_hadamard=False)."""
    cfg = _cfg(use_hadamard=False, rope_interleaved=interleaved)
    ic = cfg.indexer
    idx = LightningIndexer(cfg, dtype=torch.float64)
    _randomise(idx, 5)
    cu = torch.tensor([0, 5, 17])  # two sequences: positions restart at 0
    x, qr = _inputs(cfg, 17, seed=6)
    pos = positions(cu)
    q, k, w = idx.project(x, qr, pos)
    assert q.shape == (17, ic.n_heads, ic.head_dim) and k.shape == (17, ic.head_dim)
    assert w.shape == (17, ic.n_heads)

    q_raw = (qr @ idx.wq_b.weight.T).view(17, ic.n_heads, ic.head_dim)
    k_lin = x @ idx.wk.weight.T
    mu = k_lin.mean(-1, keepdim=True)
    var = ((k_lin - mu) ** 2).mean(-1, keepdim=True)
    k_raw = (k_lin - mu) / torch.sqrt(var + ic.k_norm_eps) * idx.k_norm.weight + idx.k_norm.bias
    inv_freq = rope_inv_freq(cfg.indexer.rope_head_dim, cfg.mla.rope)
    r = ic.rope_head_dim
    torch.testing.assert_close(q, _hand_rope_half_split(q_raw, pos, inv_freq, r, interleaved), rtol=0, atol=1e-12)
    torch.testing.assert_close(k, _hand_rope_half_split(k_raw, pos, inv_freq, r, interleaved), rtol=0, atol=1e-12)
    # the nope part is exactly the unrotated projection
    torch.testing.assert_close(q[..., r:], q_raw[..., r:], rtol=0, atol=1e-13)
    torch.testing.assert_close(k[..., r:], k_raw[..., r:], rtol=0, atol=1e-13)
    # the first token of each sequence (position 0) is not rotated at all
    for t0 in (0, 5):
        torch.testing.assert_close(q[t0], q_raw[t0], rtol=0, atol=1e-13)
    # ... and the other tokens really are
    assert (q[3, :, :r] - q_raw[3, :, :r]).abs().max() > 1e-3
    torch.testing.assert_close(w, (x @ idx.weights_proj.weight.T) * ic.n_heads ** -0.5 * ic.head_dim ** -0.5,
                               rtol=0, atol=1e-13)
    assert idx.weight_scale == pytest.approx(ic.n_heads ** -0.5 * ic.head_dim ** -0.5)


def test_half_split_and_interleaved_differ():
    """The layout flag matters: the same weights give different q under the two layouts."""
    a = LightningIndexer(_cfg(use_hadamard=False, rope_interleaved=False), dtype=torch.float64)
    _randomise(a, 7)
    b = LightningIndexer(_cfg(use_hadamard=False, rope_interleaved=True), dtype=torch.float64)
    b.load_state_dict(a.state_dict())
    x, qr = _inputs(a.config, 9, seed=8)
    pos = torch.arange(9)
    qa, ka, _ = a.project(x, qr, pos)
    qb, kb, _ = b.project(x, qr, pos)
    assert (qa - qb).abs().max() > 1e-3 and (ka - kb).abs().max() > 1e-3


def test_weights_proj_stays_float32_under_bf16_module():
    cfg = tiny()
    idx = LightningIndexer(cfg, dtype=torch.bfloat16)
    assert idx.weights_proj.weight.dtype == torch.float32
    assert idx.wq_b.weight.dtype == torch.bfloat16 and idx.wk.weight.dtype == torch.bfloat16
    assert idx.k_norm.weight.dtype == torch.bfloat16
    x, qr = _inputs(cfg, 12, seed=9, dtype=torch.bfloat16)
    q, k, w = idx.project(x, qr, torch.arange(12))
    assert q.dtype == torch.bfloat16 and k.dtype == torch.bfloat16
    assert w.dtype == torch.float32
    ref = (x.float() @ idx.weights_proj.weight.T) * idx.weight_scale
    torch.testing.assert_close(w, ref, rtol=1e-6, atol=1e-7)
    # the scores of a bf16 module come out in float32
    s = lightning_indexer(q, k, w)
    assert s.dtype == torch.float32
    # a float64 module keeps everything in float64
    assert LightningIndexer(cfg, dtype=torch.float64).weights_proj.weight.dtype == torch.float64


def test_project_validates_inputs():
    cfg = tiny()
    idx = LightningIndexer(cfg, dtype=torch.float64)
    x, qr = _inputs(cfg, 6, seed=10)
    with pytest.raises(ValueError, match="^x "):
        idx.project(x[:, :10], qr, torch.arange(6))
    with pytest.raises(ValueError, match="^qr "):
        idx.project(x, qr[:5], torch.arange(6))
    with pytest.raises(ValueError, match="^pos "):
        idx.project(x, qr, torch.arange(5))
    with pytest.raises(TypeError, match="^pos "):
        idx.project(x, qr, torch.arange(6).float())
    with pytest.raises(TypeError, match="config"):
        LightningIndexer(cfg.indexer)


# ---------------------------------------------------------------------------------------------
# lightning_indexer vs an explicit loop
# ---------------------------------------------------------------------------------------------


def naive_indexer(q, k, w, starts=None, ends=None, relu=True):
    T, H, _ = q.shape
    S = k.shape[0]
    out = torch.full((T, S), float("-inf"), dtype=torch.float64)
    for t in range(T):
        lo, hi = (0, S) if starts is None else (int(starts[t]), int(ends[t]))
        for s in range(lo, hi):
            total = 0.0
            for j in range(H):
                dot = float(q[t, j].double() @ k[s].double())
                total += float(w[t, j]) * (max(dot, 0.0) if relu else dot)
            out[t, s] = total
    return out


@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("windowed", [False, True])
def test_lightning_indexer_vs_loop(relu, windowed):
    g = _gen(11)
    T, S, H, D = 9, 11, 3, 5
    q = torch.randn(T, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(S, D, generator=g, dtype=torch.float64)
    w = torch.randn(T, H, generator=g, dtype=torch.float64)  # negative weights too
    starts = ends = None
    if windowed:
        starts = torch.tensor([0, 0, 2, 5, 3, 0, 10, 4, 7])
        ends = torch.tensor([1, 11, 6, 5, 9, 3, 11, 4, 11])  # rows 3 and 7 empty
    got = lightning_indexer(q, k, w, starts=starts, ends=ends, relu=relu)
    ref = naive_indexer(q, k, w, starts, ends, relu)
    assert got.dtype == torch.float64 and got.shape == (T, S)
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    assert bool((got[torch.isinf(got)] < 0).all())  # -inf, never +inf
    fin = torch.isfinite(ref)
    torch.testing.assert_close(got[fin], ref[fin], rtol=0, atol=1e-12)
    if windowed:
        assert bool(torch.isinf(got[3]).all()) and bool(torch.isinf(got[7]).all())
        assert int(torch.isfinite(got[0]).sum()) == 1
    # relu matters on these inputs: the two variants differ
    other = lightning_indexer(q, k, w, starts=starts, ends=ends, relu=not relu)
    assert (other[fin] - got[fin]).abs().max() > 1e-3


def test_lightning_indexer_dtypes_and_chunking():
    g = _gen(12)
    T, S, H, D = 13, 10, 4, 8
    q = torch.randn(T, H, D, generator=g)
    k = torch.randn(S, D, generator=g)
    w = torch.randn(T, H, generator=g)
    starts, ends = key_windows(torch.tensor([0, 4, 10]), torch.arange(T) % 10)
    full = lightning_indexer(q, k, w, starts=starts, ends=ends)
    assert full.dtype == torch.float32
    for c in (1, 3, 100):
        torch.testing.assert_close(lightning_indexer(q, k, w, starts=starts, ends=ends, chunk_size=c), full,
                                   rtol=1e-6, atol=1e-6)
    # bf16 q/k with float32 weights (a bf16 module) -> float32 scores close to the float64 truth
    s_bf = lightning_indexer(q.bfloat16(), k.bfloat16(), w)
    assert s_bf.dtype == torch.float32
    ref = naive_indexer(q.bfloat16(), k.bfloat16(), w)
    torch.testing.assert_close(s_bf.double(), ref, rtol=1e-5, atol=1e-5)
    # float64 anywhere -> float64 scores
    assert lightning_indexer(q, k, w.double()).dtype == torch.float64


def test_lightning_indexer_gradients_flow_to_q_k_weights():
    g = _gen(13)
    q = torch.randn(4, 2, 3, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 2, generator=g, dtype=torch.float64, requires_grad=True)
    starts, ends = torch.tensor([0, 0, 1, 2]), torch.tensor([1, 3, 5, 4])

    def f(q, k, w):
        s = lightning_indexer(q, k, w, starts=starts, ends=ends, relu=False)
        return torch.where(torch.isfinite(s), s, torch.zeros_like(s))

    assert torch.autograd.gradcheck(f, (q, k, w))


def test_lightning_indexer_validates_inputs():
    g = _gen(14)
    q = torch.randn(4, 2, 8, generator=g)
    k = torch.randn(6, 8, generator=g)
    w = torch.randn(4, 2, generator=g)
    with pytest.raises(ValueError, match=r"^q must have shape"):
        lightning_indexer(q[:, 0], k, w)
    with pytest.raises(ValueError, match=r"^k must have shape"):
        lightning_indexer(q, k[None], w)
    with pytest.raises(ValueError, match=r"^weights must have shape"):
        lightning_indexer(q, k, w[0])
    with pytest.raises(ValueError, match=r"^k has size 7 in dim 1"):
        lightning_indexer(q, torch.randn(6, 7), w)
    with pytest.raises(ValueError, match=r"^weights has size 3 in dim 0"):
        lightning_indexer(q, k, w[:3])
    with pytest.raises(ValueError, match=r"^weights has size 3 in dim 1"):
        lightning_indexer(q, k, torch.randn(4, 3))
    with pytest.raises(TypeError, match=r"^q must be a floating-point"):
        lightning_indexer(q.long(), k, w)
    with pytest.raises(TypeError, match=r"^weights must be a floating-point"):
        lightning_indexer(q, k, w.int())
    with pytest.raises(ValueError, match="starts and ends"):
        lightning_indexer(q, k, w, starts=torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"^ends must be <= num_keys=6"):
        lightning_indexer(q, k, w, starts=torch.zeros(4, dtype=torch.long), ends=torch.full((4,), 7))
    with pytest.raises(TypeError, match=r"^starts must be an integer"):
        lightning_indexer(q, k, w, starts=torch.zeros(4), ends=torch.full((4,), 6))
    with pytest.raises(ValueError, match=r"^starts has size 3"):
        lightning_indexer(q, k, w, starts=torch.zeros(3, dtype=torch.long), ends=torch.full((3,), 6))


# ---------------------------------------------------------------------------------------------
# topk_indices vs a brute-force sort
# ---------------------------------------------------------------------------------------------


def brute_topk(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Sort every row's selectable keys by (-score, index) in python; pad with -1."""
    out = []
    for row in scores.tolist():
        cand = sorted((-v, s) for s, v in enumerate(row) if v != float("-inf"))
        picked = [s for _, s in cand[:topk]]
        out.append(picked + [-1] * (topk - len(picked)))
    return torch.tensor(out, dtype=torch.int64).view(len(out), topk)


def tie_heavy_scores(T: int, S: int, seed: int, *, windows: bool = True) -> torch.Tensor:
    """Scores with many exact ties: relu zeros, values from a tiny alphabet, and -inf outside windows."""
    g = _gen(seed)
    raw = torch.randn(T, S, generator=g, dtype=torch.float64)
    scores = torch.relu(torch.round(raw * 2) / 2)  # values in {0, 0.5, 1, ...}; about half exactly 0
    if windows:
        # causal windows of one packed pair of sequences, plus one empty row
        split = max(1, T // 3)
        cu = torch.tensor([0, split, T])
        starts, ends = key_windows(cu)
        keys = torch.arange(S)
        inside = (keys[None] >= starts[:, None]) & (keys[None] < ends[:, None])
        inside[T // 2] = False
        scores = scores.masked_fill(~inside, float("-inf"))
    return scores


@pytest.mark.parametrize("topk", [1, 3, 8])
@pytest.mark.parametrize("rel", ["k-1", "k", "k+1", "4k"])
def test_topk_matches_brute_force_with_ties(topk, rel):
    S = {"k-1": topk - 1, "k": topk, "k+1": topk + 1, "4k": 4 * topk}[rel]
    S = max(S, 1)
    T = S  # causal: one query per key
    scores = tie_heavy_scores(T, S, seed=100 + topk * 7 + S)
    got = topk_indices(scores, topk)
    assert got.dtype == torch.int64 and got.shape == (T, topk)
    assert torch.equal(got, brute_topk(scores, topk))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_topk_ties_go_to_lower_index(dtype):
    # all keys tie (relu zeros): the first k keys win, in index order
    z = torch.zeros(2, 10, dtype=dtype)
    assert torch.equal(topk_indices(z, 4), torch.arange(4).expand(2, 4))
    # repeated values: within each tied group the lower index comes first
    row = torch.tensor([[1.0, 3.0, 1.0, 3.0, 2.0, 3.0, 0.0, 2.0]], dtype=dtype)
    assert topk_indices(row, 6).tolist() == [[1, 3, 5, 4, 7, 0]]
    # random rows with many ties in the given dtype
    s = tie_heavy_scores(20, 20, seed=3).to(dtype)
    assert torch.equal(topk_indices(s, 5), brute_topk(s.double(), 5))


def test_topk_never_selects_minus_inf_and_pads():
    inf = float("-inf")
    scores = torch.tensor([
        [inf, 2.0, inf, 0.0, inf],   # 2 selectable keys
        [inf, inf, inf, inf, inf],   # none
        [0.0, 0.0, 0.0, 0.0, 0.0],   # all, tied
        [-5.0, inf, -1e30, inf, 7.0],  # very negative finite scores are selectable
    ], dtype=torch.float64)
    got = topk_indices(scores, 4)
    assert got.tolist() == [[1, 3, -1, -1], [-1, -1, -1, -1], [0, 1, 2, 3], [4, 0, 2, -1]]
    # k_eff = min(topk, window size) valid slots, and the padding is only at the end
    for t in range(4):
        n_sel = int(torch.isfinite(scores[t]).sum())
        row = got[t]
        assert int((row >= 0).sum()) == min(4, n_sel)
        assert bool((row[min(4, n_sel):] == -1).all())
        for s in row[row >= 0].tolist():
            assert math.isfinite(float(scores[t, s]))


@pytest.mark.parametrize("topk", [1, 6, 50])
def test_topk_larger_than_S_and_topk_one(topk):
    g = _gen(21)
    scores = torch.randn(7, 6, generator=g, dtype=torch.float64)
    scores[2, 3] = float("-inf")
    got = topk_indices(scores, topk)
    assert got.shape == (7, topk)
    assert torch.equal(got, brute_topk(scores, topk))
    if topk == 1:
        assert torch.equal(got[:, 0], scores.argmax(dim=1))  # no ties in randn rows
    if topk >= 6:
        # every selectable key appears once; the rest is -1
        for t in range(7):
            sel = got[t][got[t] >= 0]
            assert sorted(sel.tolist()) == [s for s in range(6) if math.isfinite(float(scores[t, s]))]
            assert len(set(sel.tolist())) == len(sel)


def test_topk_chunk_size_invariance():
    scores = tie_heavy_scores(37, 37, seed=5)
    full = topk_indices(scores, 8)
    for c in (1, 2, 5, 36, 37, 1000):
        assert torch.equal(topk_indices(scores, 8, chunk_size=c), full)


def test_topk_does_not_track_gradients():
    s = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    out = topk_indices(s, 3)
    assert not out.requires_grad and out.dtype == torch.int64


def test_topk_nan_and_bad_inputs():
    s = torch.zeros(3, 5)
    s[1, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        topk_indices(s, 2)
    with pytest.raises(TypeError, match=r"^scores must be a floating-point"):
        topk_indices(torch.zeros(3, 5, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match=r"^scores must have shape \[T, S\]"):
        topk_indices(torch.zeros(3, 5, 2), 2)
    with pytest.raises(ValueError, match=r"^scores must have shape \[T, S\]"):
        topk_indices(torch.zeros(5), 2)
    with pytest.raises(ValueError, match=r"^topk must be >= 1"):
        topk_indices(torch.zeros(3, 5), 0)
    with pytest.raises(ValueError, match=r"^topk must be >= 1"):
        topk_indices(torch.zeros(3, 5), -2)
    for bad in (2.0, True, "2", None):
        with pytest.raises(TypeError, match=r"^topk must be an int"):
            topk_indices(torch.zeros(3, 5), bad)
    with pytest.raises(TypeError, match=r"^scores must be a torch.Tensor"):
        topk_indices([[1.0, 2.0]], 1)
    with pytest.raises(ValueError, match="chunk_size"):
        topk_indices(torch.zeros(3, 5), 2, chunk_size=0)


def test_indexer_pipeline_sparse_selection_is_causal():
    """Scores from a real indexer over packed sequences select only keys of the query's own
    sequence, at or before the query; short rows are padded with -1 (topk above and below the
    window sizes)."""
    cfg = tiny()
    idx = LightningIndexer(cfg, dtype=torch.float64)
    _randomise(idx, 30)
    cu = torch.tensor([0, 1, 8, 9, 41])  # lengths 1, 7, 1, 32 with topk 8
    x, qr = _inputs(cfg, 41, seed=31)
    scores, _ = _scores(idx, x, qr, cu)
    sel = topk_indices(scores, cfg.indexer.topk)
    starts, ends = key_windows(cu)
    assert torch.equal(sel, brute_topk(scores, cfg.indexer.topk))
    for t in range(41):
        row = sel[t]
        valid = row[row >= 0]
        assert len(valid) == min(cfg.indexer.topk, int(ends[t] - starts[t]))
        assert bool(((valid >= starts[t]) & (valid < ends[t])).all())
        assert len(set(valid.tolist())) == len(valid)


def test_indexer_chunk_bounds_the_ragged_gather():
    from dsa_ref.indexer import indexer_chunk_size

    # the [C, H_I, S] logits: 1000 // (4 * 50) = 5 rows
    assert indexer_chunk_size(100, 4, 50, 16, None, windowed=False, budget=1000) == 5
    # with windows the ragged keys [C, C, D_I] must fit too: sqrt(10**6 / 16) = 250 rows
    assert indexer_chunk_size(4096, 1, 10, 16, None, windowed=True, budget=10**6) == 250
    assert indexer_chunk_size(4096, 1, 10, 16, None, windowed=False, budget=10**6) == 4096
    assert indexer_chunk_size(4096, 1, 10, 16, 7, windowed=True, budget=10**6) == 7  # an explicit size wins
    assert indexer_chunk_size(0, 4, 0, 16, None, windowed=True, budget=10) == 1


def test_indexer_rows_that_read_a_huge_key_get_it_exactly():
    """A key that is not an ordinary number (here 1e25 times a normal row) is zeroed for the masked
    product; the rows whose windows hold it are scored again from the key as it is: values and
    gradients equal a per-row, per-key loop."""
    g = torch.Generator().manual_seed(3)
    T, S, H, D = 7, 9, 3, 5
    q = torch.randn(T, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(S, D, generator=g, dtype=torch.float64)
    k[4] *= 1e25
    w = torch.randn(T, H, generator=g, dtype=torch.float64)
    starts = torch.tensor([0, 0, 2, 3, 5, 0, 6])
    ends = torch.tensor([3, 5, 6, 4, 9, 9, 6])  # rows 1, 2 and 5 read key 4; row 6 reads nothing

    def naive(q, k, w):
        rows = []
        for t in range(T):
            row = [torch.tensor(float("-inf"), dtype=torch.float64)] * S
            for s in range(int(starts[t]), int(ends[t])):
                row[s] = (w[t] * (q[t] @ k[s]).relu()).sum()
            rows.append(torch.stack(row))
        return torch.stack(rows)

    results = []
    for fn in (naive, lambda q_, k_, w_: lightning_indexer(q_, k_, w_, starts=starts, ends=ends, chunk_size=2)):
        leaves = [t.clone().requires_grad_() for t in (q, k, w)]
        scores = fn(*leaves)
        finite = torch.isfinite(scores)
        torch.where(finite, scores, torch.zeros_like(scores)).sum().backward()
        results.append((scores.detach(), *(t.grad for t in leaves)))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=1e-13, atol=0)
