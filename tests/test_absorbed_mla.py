"""Absorbed MLA: exact parity with the dense form (outputs and every gradient), the absorption
identities, the 192-based softmax scale (regression guard for the 576 bug), bf16 error, and
parameter sharing with the dense module."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from dsa_ref.absorbed_mla import AbsorbedMLA, absorb_query, apply_w_uv, latent_kv
from dsa_ref.attention import dense_mla_attention
from dsa_ref.config import RopeConfig, tiny
from dsa_ref.layout import key_windows, positions
from dsa_ref.mla import MLA

CFG = tiny().mla
CFG_NO_YARN = dataclasses.replace(CFG, rope=RopeConfig(factor=1.0))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_mla(seed: int = 0, cfg=CFG, dtype=torch.float64) -> MLA:
    """Random weights large enough that attention is far from uniform; RMSNorm weights away from 1."""
    torch.manual_seed(seed)
    m = MLA(cfg, dtype=dtype)
    g = _gen(seed)
    with torch.no_grad():
        for lin in (m.wq_a, m.wq_b, m.wkv_a, m.wkv_b, m.wo):
            w = torch.randn(lin.weight.shape, generator=g, dtype=torch.float64) * 1.5 / math.sqrt(lin.weight.shape[1])
            lin.weight.copy_(w)
        for norm in (m.q_norm, m.kv_norm):
            norm.weight.copy_(1 + 0.3 * torch.randn(norm.weight.shape, generator=g, dtype=torch.float64))
    return m


def cu(*lengths: int) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)


def rand_x(T: int, seed: int, grad=False) -> torch.Tensor:
    return torch.randn(T, CFG.dim, generator=_gen(seed), dtype=torch.float64).requires_grad_(grad)


def run(module, mla: MLA, x, cu_seqlens, g):
    mla.zero_grad(set_to_none=True)
    x.grad = None
    out = module(x, cu_seqlens)
    (out * g).sum().backward()
    return out.detach(), x.grad.clone(), {n: p.grad.clone() for n, p in mla.named_parameters()}


# ---------------------------------------------------------------------------------------------
# parity with the dense form
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [CFG, CFG_NO_YARN], ids=["yarn", "no_yarn"])
@pytest.mark.parametrize("lengths", [(9,), (5, 1, 0, 4, 7)])
def test_absorbed_equals_dense_outputs_and_gradients(cfg, lengths):
    mla = make_mla(1, cfg)
    absorbed = AbsorbedMLA(mla)
    T = sum(lengths)
    c = cu(*lengths)
    x = rand_x(T, 2, grad=True)
    g = torch.randn(T, cfg.dim, generator=_gen(3), dtype=torch.float64)

    d_out, d_gx, d_gp = run(mla, mla, x, c, g)
    a_out, a_gx, a_gp = run(absorbed, mla, x, c, g)

    scale = d_out.abs().max()
    assert scale > 0.1  # a non-trivial output
    torch.testing.assert_close(a_out, d_out, rtol=1e-12, atol=1e-12 * scale)
    torch.testing.assert_close(a_gx, d_gx, rtol=1e-11, atol=1e-12 * d_gx.abs().max())
    assert set(a_gp) == set(d_gp) == {n for n, _ in mla.named_parameters()}
    for n in d_gp:
        assert d_gp[n].abs().max() > 0, n  # every parameter really gets a gradient
        torch.testing.assert_close(a_gp[n], d_gp[n], rtol=1e-11, atol=1e-12 * d_gp[n].abs().max(), msg=n)


def test_absorbed_chunking_is_invisible():
    mla = make_mla(4)
    absorbed = AbsorbedMLA(mla)
    x = rand_x(8, 5)
    c = cu(3, 5)
    base = absorbed(x, c)
    for chunk in (1, 3):
        torch.testing.assert_close(absorbed(x, c, chunk_size=chunk), base, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(absorbed(x), absorbed(x, cu(8)), rtol=0, atol=0)


def test_absorbed_validates_inputs_like_dense():
    absorbed = AbsorbedMLA(MLA(CFG))
    with pytest.raises(ValueError, match=r"x must have shape \[T, dim\]"):
        absorbed(torch.zeros(2, 3, CFG.dim))
    with pytest.raises(ValueError, match=r"x has size 7 in dim 1"):
        absorbed(torch.zeros(4, 7))
    with pytest.raises(ValueError, match=r"cu_seqlens must end at T=4"):
        absorbed(torch.zeros(4, CFG.dim), torch.tensor([0, 2]))
    with pytest.raises(TypeError, match=r"x must be a floating-point tensor"):
        absorbed(torch.zeros(4, CFG.dim, dtype=torch.int32))


# ---------------------------------------------------------------------------------------------
# the absorption identities
# ---------------------------------------------------------------------------------------------


def test_absorb_query_identity_per_head():
    """q_nope . (W_UK c) == (W_UK^T q_nope) . c for every head, and the rope part rides along."""
    mla = make_mla(6)
    c = CFG
    x = rand_x(6, 7)
    p = mla.project(x, positions(cu(6)))
    w_uk, _ = mla.kv_up_weights()
    q_abs = absorb_query(p.q_nope, p.q_pe, w_uk)
    kv = latent_kv(p.c_kv, p.k_pe)
    assert q_abs.shape == (6, c.n_heads, c.latent_dim) and kv.shape == (6, c.latent_dim)
    assert torch.equal(q_abs[..., c.kv_lora_rank:], p.q_pe)
    assert torch.equal(kv, torch.cat([p.c_kv, p.k_pe], -1))
    for h in range(c.n_heads):
        k_nope_h = p.c_kv @ w_uk[h].T  # [S, nope] = W_UK[h] c_s
        dense = p.q_nope[:, h] @ k_nope_h.T  # [T, S]
        absorbed = q_abs[:, h, : c.kv_lora_rank] @ p.c_kv.T  # [T, S]
        torch.testing.assert_close(absorbed, dense, rtol=1e-12, atol=1e-12)
        full_dense = dense + p.q_pe[:, h] @ p.k_pe.T
        torch.testing.assert_close(q_abs[:, h] @ kv.T, full_dense, rtol=1e-12, atol=1e-12)
    # and the dense keys built by MLA are exactly these
    _, k, _ = mla.dense_qkv(p)
    for h in range(c.n_heads):
        torch.testing.assert_close(k[:, h, : c.qk_nope_head_dim], p.c_kv @ w_uk[h].T, rtol=1e-13, atol=1e-13)


def test_apply_w_uv_identity():
    """sum_s p_s (W_UV c_s) == W_UV (sum_s p_s c_s) per head."""
    mla = make_mla(8)
    c = CFG
    T, S = 4, 6
    g = _gen(9)
    c_kv = torch.randn(S, c.kv_lora_rank, generator=g, dtype=torch.float64)
    probs = torch.rand(T, c.n_heads, S, generator=g, dtype=torch.float64).softmax(-1)
    _, w_uv = mla.kv_up_weights()
    v = torch.einsum("hvr,sr->shv", w_uv, c_kv)  # dense per-head values
    dense = torch.einsum("ths,shv->thv", probs, v)
    o_latent = torch.einsum("ths,sr->thr", probs, c_kv)
    torch.testing.assert_close(apply_w_uv(o_latent, w_uv), dense, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("q_nope, w_uk, match", [
    (torch.zeros(3, 4, 16), torch.zeros(5, 16, 64), r"w_uk has size 5 in dim 0 .*q_nope's heads"),
    (torch.zeros(3, 4, 16), torch.zeros(4, 15, 64), r"w_uk has size 15 in dim 1 .*q_nope's head dim"),
    (torch.zeros(3, 16), torch.zeros(4, 16, 64), r"q_nope must have shape \[T, H, nope\]"),
    (torch.zeros(3, 4, 16), torch.zeros(64, 64), r"w_uk must have shape \[H, nope, r\]"),
])
def test_absorb_query_bad_shapes(q_nope, w_uk, match):
    with pytest.raises(ValueError, match=match):
        absorb_query(q_nope, torch.zeros(3, 4, 8), w_uk)


# ---------------------------------------------------------------------------------------------
# the softmax scale: 192-based, not 576-based
# ---------------------------------------------------------------------------------------------


def _absorbed_by_hand(absorbed: AbsorbedMLA, x, c, sm_scale):
    p = absorbed.mla.project(x, positions(c))
    q, kv = absorbed.absorbed_qkv(p)
    s, e = key_windows(c)
    o, _ = dense_mla_attention(q, kv, sm_scale=sm_scale, d_v=CFG.kv_lora_rank, starts=s, ends=e)
    return absorbed.output(o)


@pytest.mark.parametrize("cfg", [CFG, CFG_NO_YARN], ids=["yarn", "no_yarn"])
@torch.no_grad()
def test_absorbed_scale_is_qk_head_dim_based(cfg):
    mla = make_mla(10, cfg)
    absorbed = AbsorbedMLA(mla)
    x = rand_x(10, 11)
    c = cu(6, 4)
    out = absorbed(x, c)
    right = cfg.qk_head_dim ** -0.5 * cfg.mscale ** 2  # 192 ** -0.5 * mscale**2 in V3.2
    wrong = cfg.latent_dim ** -0.5 * cfg.mscale ** 2  # the bug: the absorbed width 576
    assert mla.softmax_scale == pytest.approx(right, rel=1e-15)
    torch.testing.assert_close(_absorbed_by_hand(absorbed, x, c, right), out, rtol=1e-13, atol=1e-13)
    bad = _absorbed_by_hand(absorbed, x, c, wrong)
    # the wrong scale changes the output far beyond any rounding (and beyond the bf16 tolerance below)
    rel = float((bad - out).norm() / out.norm())
    assert rel > 0.05, rel
    # and it breaks parity with the dense module, which is what the parity test would catch
    assert (bad - mla(x, c)).abs().max() > 1e-3


def test_v32_scales_differ():
    from dsa_ref.config import deepseek_v32

    m = deepseek_v32().mla
    assert m.softmax_scale == pytest.approx(0.135234, abs=1e-6)
    assert m.latent_dim ** -0.5 * m.mscale ** 2 == pytest.approx(0.07808, abs=1e-4)  # what the bug uses


# ---------------------------------------------------------------------------------------------
# bf16
# ---------------------------------------------------------------------------------------------

# Tolerance for the bf16 absorbed module against the float64 dense module *on the same bf16
# weights and inputs* (so only the arithmetic differs). bf16 rounds to 8 significant bits, unit
# roundoff u = 2**-8. On CPU each bf16 matmul accumulates in float32 and rounds its result once, and
# RMSNorm, RoPE and the softmax run in float32 and round once. From x to the output there are about
# n = 10 such roundings on the longest path (wq_a, q_norm, wq_b, rope, absorb, wkv_a, kv_norm,
# attention, W_UV, wo); each adds a relative error <= u to its activation, and the linear maps
# between them are well conditioned at this init, so the errors add up to ~sqrt(n) u ~ 3u in the
# typical (random-sign) case and <= n u = 10u in the worst case. Softmax turns a relative score error
# d into a probability error of at most 2 d |score| (scores here are O(1)), doubling that part. We
# assert the relative Frobenius error below 10u ~ 0.04 (worst case for the additive part, still
# well below the 576-scale bug's > 5% change above) and each element within 2 x 10u = 20u of
# max|out| (the softmax doubling). Measured at this seed: ~1.3u and ~1.6u.
U_BF16 = 2.0 ** -8


@torch.no_grad()
def test_bf16_absorbed_vs_float64_dense():
    mla64 = make_mla(12)
    mla16 = make_mla(12).to(torch.bfloat16)
    with torch.no_grad():  # the float64 model carries exactly the bf16 weights
        for p64, p16 in zip(mla64.parameters(), mla16.parameters()):
            p64.copy_(p16.double())
    c = cu(7, 1, 8)
    x16 = rand_x(16, 13).bfloat16()
    out16 = AbsorbedMLA(mla16)(x16, c)
    assert out16.dtype == torch.bfloat16
    ref = mla64(x16.double(), c)
    err = out16.double() - ref
    rel = float(err.norm() / ref.norm())
    assert rel < 10 * U_BF16, rel
    assert float(err.abs().max()) < 20 * U_BF16 * float(ref.abs().max())
    # the comparison is meaningful: bf16 really differs from float64 (not silently upcast)
    assert rel > 1e-4


# ---------------------------------------------------------------------------------------------
# parameter sharing
# ---------------------------------------------------------------------------------------------


def test_shares_parameters_without_copies():
    mla = make_mla(14)
    absorbed = AbsorbedMLA(mla)
    assert absorbed.mla is mla and absorbed.config is mla.config
    a_params = list(absorbed.parameters())
    m_params = list(mla.parameters())
    assert len(a_params) == len(m_params)
    assert all(a is b for a, b in zip(a_params, m_params))
    assert {n for n, _ in absorbed.named_parameters()} == {f"mla.{n}" for n, _ in mla.named_parameters()}
    assert sum(p.numel() for p in absorbed.parameters()) == sum(p.numel() for p in mla.parameters())


def test_parameter_update_changes_both_equally():
    mla = make_mla(15)
    absorbed = AbsorbedMLA(mla)
    x = rand_x(9, 16)
    c = cu(4, 5)
    before = mla(x, c).detach()
    # one SGD step through the absorbed module updates the dense module's weights
    opt = torch.optim.SGD(absorbed.parameters(), lr=0.1)
    absorbed(x, c).square().sum().backward()
    assert all(p.grad is not None for p in mla.parameters())
    opt.step()
    after_dense = mla(x, c).detach()
    after_absorbed = absorbed(x, c).detach()
    assert (after_dense - before).abs().max() > 1e-3  # the step changed the dense module
    torch.testing.assert_close(after_absorbed, after_dense, rtol=1e-12, atol=1e-12)
    # an in-place edit of one weight shows up in both
    with torch.no_grad():
        mla.wkv_b.weight.mul_(1.5)
    torch.testing.assert_close(absorbed(x, c), mla(x, c), rtol=1e-12, atol=1e-12)
    assert (mla(x, c) - after_dense).abs().max() > 1e-3


@pytest.mark.parametrize("bad", [nn.Linear(4, 4), CFG, None, "MLA"])
def test_type_error_for_non_mla(bad):
    with pytest.raises(TypeError, match=r"mla must be a dsa_ref.mla.MLA"):
        AbsorbedMLA(bad)
