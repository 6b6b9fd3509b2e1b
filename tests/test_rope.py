"""RoPE and YaRN: both pair layouts against hand-rolled rotations, the properties RoPE exists for,
and the YaRN frequencies against an independent port of DeepSeek's ``precompute_freqs_cis``."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from dsa_ref.config import RopeConfig, deepseek_v32, tiny
from dsa_ref.rope import apply_rope, rope_cos_sin, rope_dtype_for, rope_inv_freq

PLAIN = RopeConfig(theta=10000.0, factor=1.0)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _pairs(d: int, interleaved: bool) -> list[tuple[int, int]]:
    """Channel indices of each rotated pair, pair i first."""
    if interleaved:
        return [(2 * i, 2 * i + 1) for i in range(d // 2)]
    return [(i, i + d // 2) for i in range(d // 2)]


def _rotate_by_matrix(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, interleaved: bool
                      ) -> torch.Tensor:
    """Loop reference: multiply each pair (x_a, x_b) by [[cos, -sin], [sin, cos]]."""
    T, d = x.shape[0], x.shape[-1]
    out = torch.empty_like(x)
    for t in range(T):
        for i, (a, b) in enumerate(_pairs(d, interleaved)):
            ang = float(pos[t]) * float(inv_freq[i])
            rot = torch.tensor([[math.cos(ang), -math.sin(ang)], [math.sin(ang), math.cos(ang)]], dtype=x.dtype)
            pair = torch.stack([x[t, ..., a], x[t, ..., b]], dim=-1)  # [..., 2]
            new = pair @ rot.T  # [..., 2]
            out[t, ..., a] = new[..., 0]
            out[t, ..., b] = new[..., 1]
    return out


def _rope(x, pos, rope=PLAIN, *, interleaved, dtype=torch.float64):
    inv = rope_inv_freq(x.shape[-1], rope)
    cos, sin = rope_cos_sin(pos, inv, dtype=dtype)
    return apply_rope(x, cos, sin, interleaved=interleaved)


# ---------------------------------------------------------------------------------------------
# apply_rope against hand-rolled rotations
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("shape", [(5, 8), (4, 3, 8), (3, 2, 2, 6)])
@pytest.mark.parametrize("rope", [PLAIN, tiny().mla.rope], ids=["plain", "yarn"])
def test_apply_rope_matches_rotation_matrix(interleaved, shape, rope):
    x = torch.randn(*shape, dtype=torch.float64, generator=_gen(0))
    pos = torch.tensor([0, 1, 7, 100, 12345][: shape[0]])
    inv = rope_inv_freq(shape[-1], rope)
    got = _rope(x, pos, rope, interleaved=interleaved)
    want = _rotate_by_matrix(x, pos, inv, interleaved)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_interleaved_matches_deepseek_complex_multiply():
    """DeepSeek's MLA ``apply_rotary_emb``: view channels as complex (2i, 2i+1), multiply by e^{i angle}."""
    x = torch.randn(6, 3, 8, dtype=torch.float64, generator=_gen(1))
    pos = torch.arange(6) * 5
    inv = rope_inv_freq(8, PLAIN)
    freqs_cis = torch.polar(torch.ones(6, 4, dtype=torch.float64), torch.outer(pos.double(), inv))  # [T, 4]
    xc = torch.view_as_complex(x.reshape(6, 3, 4, 2))
    want = torch.view_as_real(xc * freqs_cis[:, None, :]).flatten(-2)
    torch.testing.assert_close(_rope(x, pos, interleaved=True), want, rtol=1e-13, atol=1e-13)


def test_half_split_matches_neox_rotate_half():
    """The half-split layout is the NeoX / HF ``x * cos + rotate_half(x) * sin`` form."""
    x = torch.randn(6, 2, 8, dtype=torch.float64, generator=_gen(2))
    pos = torch.arange(6) * 3 + 1
    inv = rope_inv_freq(8, PLAIN)
    ang = torch.outer(pos.double(), inv)  # [T, 4]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None, :]
    rotate_half = torch.cat([-x[..., 4:], x[..., :4]], -1)
    want = x * cos + rotate_half * sin
    torch.testing.assert_close(_rope(x, pos, interleaved=False), want, rtol=1e-13, atol=1e-13)


def test_layouts_differ_on_the_same_input():
    x = torch.randn(4, 2, 8, dtype=torch.float64, generator=_gen(3))
    pos = torch.arange(1, 5)
    a = _rope(x, pos, interleaved=True)
    b = _rope(x, pos, interleaved=False)
    assert (a - b).abs().max() > 1e-2
    # but both are rotations of the same vectors: equal norms
    torch.testing.assert_close(a.norm(dim=-1), b.norm(dim=-1), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# properties
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("rope", [PLAIN, tiny().mla.rope, deepseek_v32().mla.rope], ids=["plain", "tiny", "v32"])
def test_relative_position_property(interleaved, rope):
    d = 8 if rope is not deepseek_v32().mla.rope else 64
    g = _gen(4)
    q = torch.randn(d, dtype=torch.float64, generator=g)
    k = torch.randn(d, dtype=torch.float64, generator=g)
    # pairs (m, n) grouped by m - n
    groups = {3: [(3, 0), (10, 7), (1003, 1000)], 0: [(0, 0), (5, 5), (77, 77)], -4: [(0, 4), (20, 24)]}
    dots = {}
    for diff, mns in groups.items():
        vals = []
        for m, n in mns:
            qm = _rope(q[None], torch.tensor([m]), rope, interleaved=interleaved)[0]
            kn = _rope(k[None], torch.tensor([n]), rope, interleaved=interleaved)[0]
            vals.append(float(qm @ kn))
        assert max(vals) - min(vals) < 1e-10, (diff, vals)
        dots[diff] = vals[0]
    assert dots[0] == pytest.approx(float(q @ k), abs=1e-12)  # same position: plain dot product
    assert abs(dots[3] - dots[-4]) > 1e-6  # and it really depends on the offset


@pytest.mark.parametrize("interleaved", [True, False])
def test_norm_preserved(interleaved):
    x = torch.randn(16, 4, 8, dtype=torch.float64, generator=_gen(5))
    pos = torch.randint(0, 10**6, (16,), generator=_gen(6))
    y = _rope(x, pos, tiny().mla.rope, interleaved=interleaved)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-12, atol=1e-12)
    # pairwise norms too: each 2x2 block is a rotation
    for a, b in _pairs(8, interleaved):
        torch.testing.assert_close(y[..., a] ** 2 + y[..., b] ** 2, x[..., a] ** 2 + x[..., b] ** 2)


@pytest.mark.parametrize("interleaved", [True, False])
def test_position_zero_is_identity(interleaved):
    x = torch.randn(3, 2, 8, dtype=torch.float64, generator=_gen(7))
    y = _rope(x, torch.zeros(3, dtype=torch.int64), tiny().mla.rope, interleaved=interleaved)
    assert torch.equal(y, x)


def test_rope_cos_sin_values_and_large_positions():
    inv = rope_inv_freq(8, PLAIN)
    pos = torch.tensor([0, 1, 5, 163839])
    cos, sin = rope_cos_sin(pos, inv)  # float32 results, float64 angles
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (4, 4)
    ang = [[p * float(f) for f in inv] for p in pos.tolist()]
    want_cos = torch.tensor([[math.cos(a) for a in row] for row in ang], dtype=torch.float32)
    want_sin = torch.tensor([[math.sin(a) for a in row] for row in ang], dtype=torch.float32)
    # exact up to one float32 rounding (angles of 163839 would be ~0.01 rad off in float32)
    torch.testing.assert_close(cos, want_cos, rtol=0, atol=1e-7)
    torch.testing.assert_close(sin, want_sin, rtol=0, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# frequencies and YaRN
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [2, 8, 64, 128])
@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_inv_freq_without_yarn(d, theta):
    inv = rope_inv_freq(d, RopeConfig(theta=theta, factor=1.0))
    want = torch.tensor([theta ** (-2 * i / d) for i in range(d // 2)], dtype=torch.float64)
    assert inv.dtype == torch.float64 and inv.shape == (d // 2,)
    torch.testing.assert_close(inv, want, rtol=1e-14, atol=0)
    assert rope_inv_freq(d, RopeConfig(theta=theta), dtype=torch.float32).dtype == torch.float32


def _deepseek_yarn_inv_freq(dim: int, base: float, factor: float, original_seq_len: int,
                            beta_fast: float, beta_slow: float, dtype=torch.float64) -> torch.Tensor:
    """An independent port of DeepSeek-V3's ``precompute_freqs_cis`` frequency part.

    DeepSeek interpolates only when ``max_seq_len > original_seq_len``, which holds for the released
    checkpoints (163840 > 4096); the reference applies YaRN whenever ``factor > 1``.
    """

    def find_correction_dim(num_rotations, dim, base, max_seq_len):
        return dim * math.log(max_seq_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    def find_correction_range(low_rot, high_rot, dim, base, max_seq_len):
        low = math.floor(find_correction_dim(low_rot, dim, base, max_seq_len))
        high = math.ceil(find_correction_dim(high_rot, dim, base, max_seq_len))
        return max(low, 0), min(high, dim - 1)

    def linear_ramp_factor(min_, max_, dim):
        if min_ == max_:
            max_ += 0.001
        linear_func = (torch.arange(dim, dtype=dtype) - min_) / (max_ - min_)
        return torch.clamp(linear_func, 0, 1)

    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=dtype) / dim))
    low, high = find_correction_range(beta_fast, beta_slow, dim, base, original_seq_len)
    smooth = 1 - linear_ramp_factor(low, high, dim // 2)
    return freqs / factor * (1 - smooth) + freqs * smooth


_YARN_CASES = {
    "v32": (deepseek_v32().mla.qk_rope_head_dim, deepseek_v32().mla.rope),
    "tiny": (tiny().mla.qk_rope_head_dim, tiny().mla.rope),
    "v32_indexer_dim": (deepseek_v32().indexer.rope_head_dim, deepseek_v32().mla.rope),
    "tiny_wide": (32, tiny().mla.rope),
}


@pytest.mark.parametrize("case", list(_YARN_CASES))
def test_yarn_inv_freq_matches_deepseek_precompute(case):
    d, r = _YARN_CASES[case]
    want = _deepseek_yarn_inv_freq(d, r.theta, r.factor, r.original_max_position, r.beta_fast, r.beta_slow)
    got = rope_inv_freq(d, r)
    torch.testing.assert_close(got, want, rtol=1e-14, atol=0)
    # DeepSeek itself computes in float32: agreement to float32 rounding
    want32 = _deepseek_yarn_inv_freq(d, r.theta, r.factor, r.original_max_position, r.beta_fast, r.beta_slow,
                                     dtype=torch.float32)
    torch.testing.assert_close(rope_inv_freq(d, r, dtype=torch.float32), want32, rtol=1e-5, atol=0)


@pytest.mark.parametrize("case", list(_YARN_CASES))
def test_yarn_blend(case):
    d, r = _YARN_CASES[case]
    plain = rope_inv_freq(d, dataclasses.replace(r, factor=1.0))
    ratio = rope_inv_freq(d, r) / plain  # 1 = kept, 1/factor = fully interpolated
    assert ratio[0] == pytest.approx(1.0, rel=1e-14)  # highest frequency unchanged
    assert ratio[-1] == pytest.approx(1.0 / r.factor, rel=1e-14)  # lowest divided by factor
    assert bool((ratio <= 1.0 + 1e-14).all()) and bool((ratio >= 1.0 / r.factor - 1e-14).all())
    assert bool((ratio[1:] <= ratio[:-1] + 1e-14).all()), ratio  # monotone blend
    yarn = rope_inv_freq(d, r)
    assert bool((yarn[1:] < yarn[:-1]).all())  # frequencies still strictly decreasing


def test_yarn_v32_correction_range():
    """DeepSeek-V3.2 (d=64, 4096 positions, beta 32/1): pairs 0..10 keep, 23..31 are divided by 40."""
    r = deepseek_v32().mla.rope
    ratio = rope_inv_freq(64, r) / rope_inv_freq(64, PLAIN)
    torch.testing.assert_close(ratio[:11], torch.ones(11, dtype=torch.float64), rtol=1e-14, atol=0)
    torch.testing.assert_close(ratio[23:], torch.full((9,), 1 / 40, dtype=torch.float64), rtol=1e-14, atol=0)
    mid = ratio[11:23]
    assert bool(((mid < 1) & (mid > 1 / 40)).all())


# ---------------------------------------------------------------------------------------------
# dtypes and errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_in_same_dtype_out(interleaved, dtype):
    x = torch.randn(5, 3, 8, generator=_gen(8)).to(dtype)
    pos = torch.arange(5) * 11
    inv = rope_inv_freq(8, tiny().mla.rope)
    cos, sin = rope_cos_sin(pos, inv, dtype=rope_dtype_for(x))
    assert cos.dtype == torch.float32
    y = apply_rope(x, cos, sin, interleaved=interleaved)
    assert y.dtype == dtype and y.shape == x.shape
    # computed in float32 and rounded once
    want = apply_rope(x.float(), cos, sin, interleaved=interleaved).to(dtype)
    assert torch.equal(y, want)
    ref = _rope(x.double(), pos, tiny().mla.rope, interleaved=interleaved)
    tol = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-6}[dtype]
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol * 4)


def test_rope_dtype_for():
    assert rope_dtype_for(torch.zeros(1, dtype=torch.float64)) == torch.float64
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        assert rope_dtype_for(torch.zeros(1, dtype=dt)) == torch.float32


def test_gradient_is_inverse_rotation():
    """RoPE is linear and orthogonal: the gradient of <R x, g> w.r.t. x is R^T g."""
    x = torch.randn(4, 2, 8, dtype=torch.float64, generator=_gen(9), requires_grad=True)
    g = torch.randn(4, 2, 8, dtype=torch.float64, generator=_gen(10))
    pos = torch.tensor([0, 3, 9, 27])
    for interleaved in (True, False):
        x.grad = None
        y = _rope(x, pos, interleaved=interleaved)
        (y * g).sum().backward()
        back = _rope(g, -pos, interleaved=interleaved)  # rotate by the negative angle
        torch.testing.assert_close(x.grad, back, rtol=1e-12, atol=1e-12)


def _cs(T, half, dtype=torch.float32):
    return torch.ones(T, half, dtype=dtype), torch.zeros(T, half, dtype=dtype)


@pytest.mark.parametrize("x_shape, cos_shape, sin_shape", [
    ((4, 7), (4, 3), (4, 3)),        # odd channel count
    ((4, 8), (4, 3), (4, 3)),        # cos too narrow
    ((4, 8), (5, 4), (5, 4)),        # cos for another token count
    ((4, 2, 8), (4, 4), (4, 3)),     # sin mismatched
    ((4, 8), (4, 1, 4), (4, 1, 4)),  # cos not [T, d/2]
])
def test_apply_rope_bad_shapes(x_shape, cos_shape, sin_shape):
    x = torch.zeros(*x_shape)
    with pytest.raises(ValueError, match="apply_rope"):
        apply_rope(x, torch.ones(*cos_shape), torch.zeros(*sin_shape), interleaved=True)


def test_apply_rope_rejects_int_x():
    cos, sin = _cs(4, 4)
    with pytest.raises(TypeError, match="x"):
        apply_rope(torch.zeros(4, 8, dtype=torch.int64), cos, sin, interleaved=False)


def test_rope_cos_sin_bad_positions():
    inv = rope_inv_freq(8, PLAIN)
    with pytest.raises(TypeError, match="positions"):
        rope_cos_sin(torch.zeros(4), inv)
    with pytest.raises(ValueError, match="positions"):
        rope_cos_sin(torch.zeros(2, 4, dtype=torch.int64), inv)


@pytest.mark.parametrize("d", [0, 1, 7, -2])
def test_rope_inv_freq_bad_dim(d):
    with pytest.raises(ValueError, match="rope_dim"):
        rope_inv_freq(d, PLAIN)


def test_inv_freq_on_a_device_is_made_once_and_equals_the_cpu_one():
    """With ``device=``, the frequencies are copied to the device once and shared (no copy per step)."""
    cfg = deepseek_v32().mla
    first = rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope, device="meta")
    again = rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope, device=torch.device("meta"))
    assert first is again and first.device.type == "meta" and first.shape == (cfg.qk_rope_head_dim // 2,)
    cpu = rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope, device="cpu")
    assert torch.equal(cpu, rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope)) and cpu.dtype == torch.float64
    with pytest.raises(ValueError, match="rope_dim must be an even number"):
        rope_inv_freq(3, cfg.rope, device="meta")
