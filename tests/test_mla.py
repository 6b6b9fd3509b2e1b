"""Dense MLA: shapes, causality, packed == per-sequence (outputs and gradients), RoPE positions that
restart per sequence, the softmax scale against a hand-written dense attention, RMSNorm, and
input validation."""

from __future__ import annotations

import math

import pytest
import torch

from dsa_ref.config import RopeConfig, tiny
from dsa_ref.layout import one_sequence, positions
from dsa_ref.mla import MLA, MLAProjections, RMSNorm
from dsa_ref.rope import rope_inv_freq

CFG = tiny().mla


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_mla(seed: int = 0, cfg=CFG, dtype=torch.float64) -> MLA:
    """An MLA with random weights large enough that attention is far from uniform, and RMSNorm
    weights away from 1 so that they matter."""
    torch.manual_seed(seed)
    m = MLA(cfg, dtype=dtype)
    g = _gen(seed)
    with torch.no_grad():
        for lin in (m.wq_a, m.wq_b, m.wkv_a, m.wkv_b, m.wo):
            fan_in = lin.weight.shape[1]
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=g, dtype=torch.float64) * 1.5 / math.sqrt(fan_in))
        for norm in (m.q_norm, m.kv_norm):
            norm.weight.copy_(1 + 0.3 * torch.randn(norm.weight.shape, generator=g, dtype=torch.float64))
    return m


def cu(*lengths: int) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)


def rand_x(T: int, seed: int, dtype=torch.float64, grad=False) -> torch.Tensor:
    return torch.randn(T, CFG.dim, generator=_gen(seed), dtype=torch.float64).to(dtype).requires_grad_(grad)


def manual_mla(m: MLA, x: torch.Tensor, lengths: list[int], scale: float) -> torch.Tensor:
    """Dense MLA written out from the module's weights, one sequence at a time, without dsa_ref's
    attention, layout or rope code (RoPE as DeepSeek writes it: complex multiply of (2i, 2i+1) pairs)."""
    c = m.config
    H, nope, rope, r, dv = c.n_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank, c.v_head_dim

    def rms(v, w):
        return v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + c.norm_eps) * w

    def rotate(v, pos):  # v [L, ..., rope]
        inv = rope_inv_freq(rope, c.rope)
        freqs = torch.polar(torch.ones(len(pos), rope // 2, dtype=torch.float64), torch.outer(pos.double(), inv))
        vc = torch.view_as_complex(v.reshape(*v.shape[:-1], rope // 2, 2).contiguous())
        f = freqs.view(len(pos), *([1] * (v.dim() - 2)), rope // 2)
        return torch.view_as_real(vc * f).flatten(-2)

    outs = []
    start = 0
    for L in lengths:
        xs = x[start:start + L]
        start += L
        pos = torch.arange(L)
        qr = rms(xs @ m.wq_a.weight.T, m.q_norm.weight)
        q = (qr @ m.wq_b.weight.T).view(L, H, nope + rope)
        q_nope, q_pe = q[..., :nope], rotate(q[..., nope:], pos)
        kva = xs @ m.wkv_a.weight.T
        c_kv, k_pe = rms(kva[:, :r], m.kv_norm.weight), rotate(kva[:, r:], pos)
        kvb = (c_kv @ m.wkv_b.weight.T).view(L, H, nope + dv)
        k_nope, v = kvb[..., :nope], kvb[..., nope:]
        scores = scale * (torch.einsum("ihd,jhd->hij", q_nope, k_nope) + torch.einsum("ihd,jd->hij", q_pe, k_pe))
        causal = torch.ones(L, L, dtype=torch.bool).tril()
        p = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        o = torch.einsum("hij,jhd->ihd", p, v)  # [L, H, dv]
        outs.append(o.reshape(L, H * dv) @ m.wo.weight.T)
    return torch.cat(outs) if outs else x.new_zeros(0, c.dim)


def grads(m: MLA, x: torch.Tensor, fn, g: torch.Tensor):
    m.zero_grad(set_to_none=True)
    x.grad = None
    out = fn(x)
    (out * g).sum().backward()
    return out.detach(), x.grad.clone(), {n: p.grad.clone() for n, p in m.named_parameters()}


# ---------------------------------------------------------------------------------------------
# structure and shapes
# ---------------------------------------------------------------------------------------------


def test_parameter_names_and_shapes():
    m = MLA(CFG)
    c = CFG
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert shapes == {
        "wq_a.weight": (c.q_lora_rank, c.dim),
        "q_norm.weight": (c.q_lora_rank,),
        "wq_b.weight": (c.n_heads * c.qk_head_dim, c.q_lora_rank),
        "wkv_a.weight": (c.kv_lora_rank + c.qk_rope_head_dim, c.dim),
        "kv_norm.weight": (c.kv_lora_rank,),
        "wkv_b.weight": (c.n_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
        "wo.weight": (c.dim, c.n_heads * c.v_head_dim),
    }
    assert "inv_freq" not in m.state_dict()  # derived from the config, not a weight


def test_forward_and_projection_shapes():
    m = make_mla()
    c = CFG
    T = 7
    x = rand_x(T, 1)
    out = m(x)
    assert out.shape == (T, c.dim) and out.dtype == torch.float64
    p = m.project(x, positions(one_sequence(T)))
    assert isinstance(p, MLAProjections)
    assert p.qr.shape == (T, c.q_lora_rank)
    assert p.q_nope.shape == (T, c.n_heads, c.qk_nope_head_dim)
    assert p.q_pe.shape == (T, c.n_heads, c.qk_rope_head_dim)
    assert p.c_kv.shape == (T, c.kv_lora_rank)
    assert p.k_pe.shape == (T, c.qk_rope_head_dim)
    q, k, v = m.dense_qkv(p)
    assert q.shape == k.shape == (T, c.n_heads, c.qk_head_dim)
    assert v.shape == (T, c.n_heads, c.v_head_dim)
    # k_pe is one head shared by all query heads
    for h in range(c.n_heads):
        assert torch.equal(k[:, h, c.qk_nope_head_dim:], p.k_pe)


def test_kv_up_weights_are_views_of_wkv_b():
    m = make_mla()
    c = CFG
    w_uk, w_uv = m.kv_up_weights()
    assert w_uk.shape == (c.n_heads, c.qk_nope_head_dim, c.kv_lora_rank)
    assert w_uv.shape == (c.n_heads, c.v_head_dim, c.kv_lora_rank)
    assert w_uk.untyped_storage().data_ptr() == m.wkv_b.weight.untyped_storage().data_ptr()
    w = m.wkv_b.weight.view(c.n_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
    assert torch.equal(w_uk, w[:, : c.qk_nope_head_dim]) and torch.equal(w_uv, w[:, c.qk_nope_head_dim:])


def test_default_cu_seqlens_is_one_sequence_and_chunking_is_invisible():
    m = make_mla()
    x = rand_x(9, 2)
    a = m(x)
    torch.testing.assert_close(m(x, one_sequence(9)), a, rtol=0, atol=0)
    for chunk in (1, 4):
        torch.testing.assert_close(m(x, chunk_size=chunk), a, rtol=1e-13, atol=1e-13)


def test_bf16_and_float32_modules_run():
    for dtype in (torch.float32, torch.bfloat16):
        m = make_mla(dtype=dtype)
        out = m(rand_x(6, 3, dtype=dtype), cu(4, 2))
        assert out.dtype == dtype and torch.isfinite(out).all()


def test_empty_input():
    m = make_mla()
    out = m(rand_x(0, 0), cu(0))
    assert out.shape == (0, CFG.dim)


# ---------------------------------------------------------------------------------------------
# the math: hand-written reference, scale, causality, packing
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lengths", [(6,), (4, 1, 5)])
def test_matches_hand_written_dense_attention_with_config_scale(lengths):
    m = make_mla(3)
    x = rand_x(sum(lengths), 4)
    out = m(x, cu(*lengths))
    assert m.softmax_scale == CFG.softmax_scale
    want = manual_mla(m, x, list(lengths), CFG.softmax_scale)
    torch.testing.assert_close(out, want, rtol=1e-11, atol=1e-12)
    # sensitivity: any other scale (no YaRN mscale, or the absorbed 576 width) is visibly different
    for wrong in (CFG.qk_head_dim ** -0.5, CFG.latent_dim ** -0.5 * CFG.mscale ** 2):
        other = manual_mla(m, x, list(lengths), wrong)
        assert (other - want).abs().max() > 1e-3 * want.abs().max()


def test_scale_without_yarn():
    cfg = CFG.__class__(**{**CFG.__dict__, "rope": RopeConfig(factor=1.0)})
    m = make_mla(5, cfg=cfg)
    assert m.softmax_scale == pytest.approx(cfg.qk_head_dim ** -0.5, rel=1e-15)
    x = rand_x(5, 6)
    torch.testing.assert_close(m(x), manual_mla(m, x, [5], cfg.qk_head_dim ** -0.5), rtol=1e-11, atol=1e-12)


def test_causal_within_a_sequence():
    m = make_mla(7)
    T = 8
    x = rand_x(T, 8)
    base = m(x)
    for j in (0, 3, T - 1):
        x2 = x.clone()
        x2[j] += torch.randn(CFG.dim, generator=_gen(j), dtype=torch.float64)
        out = m(x2)
        assert torch.equal(out[:j], base[:j]), j  # earlier tokens cannot see token j
        assert (out[j:] - base[j:]).abs().amax(dim=-1).min() > 1e-8, j  # token j and later ones do


def test_no_leak_between_packed_sequences():
    m = make_mla(9)
    lengths = (4, 3, 5)
    c = cu(*lengths)
    x = rand_x(sum(lengths), 10)
    base = m(x, c)
    # perturb the first token of the middle sequence: only that sequence changes
    x2 = x.clone()
    x2[4] += 1.0
    out = m(x2, c)
    assert torch.equal(out[:4], base[:4])
    assert torch.equal(out[7:], base[7:])  # later sequence: no leak across the boundary
    assert (out[4:7] - base[4:7]).abs().amax(dim=-1).min() > 1e-8


def test_packed_equals_each_sequence_alone_outputs_and_gradients():
    m = make_mla(11)
    lengths = [5, 1, 0, 3, 7]
    T = sum(lengths)
    x = rand_x(T, 12, grad=True)
    g = torch.randn(T, CFG.dim, generator=_gen(13), dtype=torch.float64)

    out, gx, gp = grads(m, x, lambda x: m(x, cu(*lengths)), g)

    offsets = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    ref_out = torch.zeros_like(out)
    ref_gx = torch.zeros_like(gx)
    ref_gp = {n: torch.zeros_like(p) for n, p in m.named_parameters()}
    for i, L in enumerate(lengths):
        if L == 0:
            continue
        a, b = offsets[i], offsets[i + 1]
        xs = x.detach()[a:b].clone().requires_grad_(True)
        o, gxs, gps = grads(m, xs, lambda xs: m(xs), g[a:b])
        ref_out[a:b] = o
        ref_gx[a:b] = gxs
        for n in ref_gp:
            ref_gp[n] += gps[n]
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gx, ref_gx, rtol=1e-11, atol=1e-12)
    for n in ref_gp:
        assert torch.isfinite(gp[n]).all() and gp[n].abs().max() > 0, n
        torch.testing.assert_close(gp[n], ref_gp[n], rtol=1e-11, atol=1e-11, msg=n)


def test_rope_positions_restart_per_sequence():
    m = make_mla(14)
    a = rand_x(5, 15)
    b = rand_x(3, 16)
    alone = m(a)
    first = m(torch.cat([a, b]), cu(5, 3))[:5]
    second = m(torch.cat([b, a]), cu(3, 5))[3:]  # the same sequence placed after another one
    torch.testing.assert_close(first, alone, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(second, alone, rtol=1e-12, atol=1e-12)
    # positions inside the projections restart: the first token of the second sequence is at 0,
    # so its rope parts are unrotated
    xb = torch.cat([b, a])
    p = m.project(xb, positions(cu(3, 5)))
    raw = m.project(xb, torch.zeros(8, dtype=torch.int64))
    torch.testing.assert_close(p.q_pe[3], raw.q_pe[3], rtol=0, atol=0)
    torch.testing.assert_close(p.k_pe[3], raw.k_pe[3], rtol=0, atol=0)
    # sensitivity: global positions (the wrong policy) would change the second sequence's output
    p_global = m.project(xb, torch.arange(8))
    assert (p_global.k_pe[3:] - p.k_pe[3:]).abs().max() > 1e-3


# ---------------------------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_rmsnorm_matches_formula(dtype):
    n = RMSNorm(16, eps=1e-5, dtype=dtype)
    g = _gen(17)
    with torch.no_grad():
        n.weight.copy_(torch.randn(16, generator=g).to(dtype))
    x = (torch.randn(5, 3, 16, generator=g) * 7).to(dtype)
    got = n(x)
    assert got.dtype == dtype and got.shape == x.shape
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    xf = x.to(acc)
    want = (xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * n.weight.to(acc)).to(dtype)
    tol = {torch.float64: 1e-14, torch.float32: 1e-6, torch.bfloat16: 0.0}[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)  # bf16: computed in fp32, rounded once
    # the math: unit RMS before the weight
    x64 = x.double()
    normed = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert torch.allclose(normed.pow(2).mean(-1), torch.ones(5, 3, dtype=torch.float64), atol=1e-5)


def test_rmsnorm_eps_matters_for_small_inputs():
    n = RMSNorm(4, eps=1.0, dtype=torch.float64)
    x = torch.full((1, 4), 1e-3, dtype=torch.float64)
    torch.testing.assert_close(n(x), x / math.sqrt(1e-6 + 1.0))


def test_mla_uses_config_eps():
    cfg = CFG.__class__(**{**CFG.__dict__, "norm_eps": 0.5})
    m = MLA(cfg)
    assert m.q_norm.eps == 0.5 and m.kv_norm.eps == 0.5


# ---------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("x, cu_seqlens, exc, match", [
    (torch.zeros(CFG.dim), None, ValueError, r"x must have shape \[T, dim\]"),
    (torch.zeros(2, 3, CFG.dim), None, ValueError, r"x must have shape \[T, dim\].*\(2, 3, 64\)"),
    (torch.zeros(4, CFG.dim + 1), None, ValueError, r"x has size 65 in dim 1 .*expected 64 \(the config's dim\)"),
    (torch.zeros(4, CFG.dim, dtype=torch.int64), None, TypeError, r"x must be a floating-point tensor"),
    (torch.zeros(4, CFG.dim), torch.tensor([0, 3]), ValueError, r"cu_seqlens must end at T=4"),
    (torch.zeros(4, CFG.dim), torch.tensor([0, 2, 5]), ValueError, r"cu_seqlens must end at T=4"),
    (torch.zeros(4, CFG.dim), torch.tensor([0.0, 4.0]), TypeError, r"cu_seqlens must be an integer tensor"),
    (torch.zeros(4, CFG.dim), torch.tensor([0, 3, 2, 4]), ValueError, r"cu_seqlens must be non-decreasing"),
    ([[0.0] * CFG.dim], None, TypeError, r"x must be a torch.Tensor"),
])
def test_bad_inputs(x, cu_seqlens, exc, match):
    m = MLA(CFG)
    with pytest.raises(exc, match=match):
        m(x, cu_seqlens)


def test_project_bad_positions():
    m = MLA(CFG)
    x = torch.zeros(4, CFG.dim)
    with pytest.raises(TypeError, match="pos"):
        m.project(x, torch.zeros(4))
    with pytest.raises(ValueError, match=r"pos has size 3 .*one position per token"):
        m.project(x, torch.zeros(3, dtype=torch.int64))


def test_config_type_checked():
    with pytest.raises(TypeError, match="MLAConfig"):
        MLA(tiny())  # the DSAConfig, not its .mla
