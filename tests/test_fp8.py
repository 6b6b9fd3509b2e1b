"""dsa_ref.fp8: DeepSeek's block-128 e4m3 quantisation, and what the Hadamard rotation does under it."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsa_ref import lightning_indexer, topk_indices
from dsa_ref.adversarial import outlier_channels
from dsa_ref.compare import attention_mass_recall, compare_topk
from dsa_ref.fp8 import (
    E4M3_MAX,
    HAS_TORCH_FP8,
    act_quant_block128,
    act_quant_pow2,
    e4m3_round,
    fp8_dequant,
    fp8_indexer_scores,
    fp8_roundtrip,
)

needs_torch_fp8 = pytest.mark.skipif(not HAS_TORCH_FP8, reason="this PyTorch has no float8_e4m3fn")


@needs_torch_fp8
def test_emulation_equals_torch_on_every_value_and_midpoint():
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = values[torch.isfinite(values)].unique()
    assert values.numel() == 253 and float(values.max()) == E4M3_MAX  # 254 finite codes, +0 and -0 merge
    mids = (values[1:] + values[:-1]) / 2  # exact ties: round half to even
    g = torch.Generator().manual_seed(0)
    x = torch.cat([values, mids, torch.randn(50000, generator=g) * 30, torch.rand(5000, generator=g) * 2 ** -6])
    x = x.clamp(-E4M3_MAX, E4M3_MAX)
    assert torch.equal(e4m3_round(x), x.to(torch.float8_e4m3fn).float())


def test_emulation_known_values():
    x = torch.tensor([1.0625, 1.1875, 2 ** -9, 2 ** -10, 3 * 2 ** -10, 447.0, 448.0, -0.3, 0.0, 240.0, 232.0])
    expected = torch.tensor([1.0, 1.25, 2 ** -9, 0.0, 2 ** -8, 448.0, 448.0, -0.3125, 0.0, 240.0, 224.0])
    # 1.0625 is halfway between 1 and 1.125: ties to even (1.0); 2^-10 is half the smallest subnormal
    assert torch.equal(e4m3_round(x), expected)


def _same_quantisation(x, block_size=128):
    """act_quant_pow2 gives act_quant_block128's bytes and scales (NaN where it has NaN)."""
    y_fast, s_fast = act_quant_pow2(x, block_size=block_size)
    y_ref, s_ref = act_quant_block128(x, block_size=block_size, emulate=False)
    assert y_fast.dtype == torch.float8_e4m3fn and y_fast.shape == y_ref.shape and s_fast.shape == s_ref.shape
    nan = torch.isnan(y_ref.float())
    assert torch.equal(torch.isnan(y_fast.float()), nan)
    assert torch.equal(y_fast.view(torch.uint8)[~nan], y_ref.view(torch.uint8)[~nan]), "the same e4m3 bytes"
    assert torch.equal(s_fast.nan_to_num(-1.0), s_ref.nan_to_num(-1.0))


@needs_torch_fp8
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_act_quant_pow2_equals_act_quant_block128(dtype):
    g = torch.Generator().manual_seed(7)
    mags = torch.logspace(-6, 4, 40)[:, None] if dtype != torch.float16 else torch.logspace(-4, 4, 40)[:, None]
    x = (torch.randn(40, 256, generator=g) * mags).to(dtype)
    _same_quantisation(x)
    # block maxima exactly at and next to powers of two times 448, the 1e-4 floor, zeros, -0
    edge = torch.zeros(8, 128)
    edge[0, 0] = 448.0
    edge[1, 0] = 448.0 * 2 ** -3
    edge[2, 0] = torch.nextafter(torch.tensor(448.0 * 2), torch.tensor(1e9))
    edge[3, 0] = torch.nextafter(torch.tensor(448.0 / 4), torch.tensor(0.0))
    edge[4, :] = 5e-5  # below the floor: the scale comes from 1e-4
    edge[5, :] = -0.0
    edge[6, :] = torch.linspace(-3, 3, 128)
    edge[7, 0] = -448.0 * 2 ** 5
    _same_quantisation(edge.to(dtype))
    # garbage: NaN and Inf spoil their block, in both
    bad = torch.randn(4, 256, generator=g)
    bad[0, 3], bad[1, 200], bad[2, 0] = float("nan"), float("inf"), float("-inf")
    _same_quantisation(bad.to(dtype))
    # any leading shape, another block size, nothing at all
    _same_quantisation(torch.randn(3, 5, 64, generator=g).to(dtype), block_size=32)
    _same_quantisation(torch.zeros(0, 4, 128, dtype=dtype))


@needs_torch_fp8
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), log_mag=st.floats(-20, 20), rows=st.integers(1, 9))
def test_act_quant_pow2_property(seed, log_mag, rows):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 256, generator=g) * torch.exp2(torch.randn(rows, 1, generator=g) * 4 + log_mag)
    for dtype in (torch.bfloat16, torch.float32):
        _same_quantisation(x.to(dtype))


def test_act_quant_pow2_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of block_size"):
        act_quant_pow2(torch.zeros(2, 100))
    with pytest.raises(TypeError):
        act_quant_pow2(torch.zeros(2, 128, dtype=torch.int32))


@pytest.mark.parametrize("emulate", [True, None])
def test_act_quant_scales_and_error_bound(emulate):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 256, generator=g) * torch.logspace(-3, 3, 6)[:, None]  # magnitudes 1e-3 .. 1e3
    y, s = act_quant_block128(x, emulate=emulate)
    assert s.shape == (6, 2) and y.shape == x.shape
    assert torch.equal(torch.exp2(torch.log2(s).round()), s), "ue8m0: scales are powers of two"
    amax = y.float().reshape(6, 2, 128).abs().amax(-1)
    assert ((amax >= 224) & (amax <= 448)).all(), "a power-of-two scale puts the block max into [224, 448]"
    back = fp8_dequant(y, s)
    normal = (x.abs() / s.repeat_interleave(128, dim=1)) >= 2 ** -6
    rel = ((back - x).abs() / x.abs())[normal]
    assert float(rel.max()) <= 2 ** -4 + 1e-7, "3 mantissa bits: at most half an ulp, 2^-4 relative"
    assert torch.equal(back, fp8_roundtrip(x, emulate=emulate))


def test_act_quant_without_pow2_hits_448_and_emulation_matches():
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2)) * 5
    y, s = act_quant_block128(x, pow2_scale=False, emulate=True)
    assert torch.allclose(y.abs().amax(-1), torch.full((3,), E4M3_MAX))
    if HAS_TORCH_FP8:
        y2, s2 = act_quant_block128(x, pow2_scale=False, emulate=False)
        assert y2.dtype == torch.float8_e4m3fn and torch.equal(y2.float(), y) and torch.equal(s2, s)


def test_act_quant_validation():
    with pytest.raises(ValueError, match="multiple of block_size=128"):
        act_quant_block128(torch.randn(4, 100))
    assert act_quant_block128(torch.randn(4, 100), block_size=100)[1].shape == (4, 1)
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        act_quant_block128(torch.ones(4, 128, dtype=torch.int32))
    y, s = act_quant_block128(torch.zeros(1, 128))  # an all-zero block: amax clamped at 1e-4
    assert (y.float() == 0).all() and float(s[0, 0]) > 0


def test_rotation_changes_nothing_in_exact_arithmetic():
    case = outlier_channels(tokens=16, num_keys=64, heads=4, seed=3)
    q, k, w = case["q"], case["k"], case["weights"]
    plain = fp8_indexer_scores(q, k, w, hadamard=False, quantize=False)
    rotated = fp8_indexer_scores(q, k, w, hadamard=True, quantize=False)
    assert plain.dtype == torch.float64
    torch.testing.assert_close(rotated, plain, atol=1e-11, rtol=1e-12)
    torch.testing.assert_close(plain, lightning_indexer(q, k, w), atol=0, rtol=0)


def _errors(case, k=16):
    q, k_, w = case["q"], case["k"], case["weights"]
    exact = lightning_indexer(q, k_, w)
    ref_idx = topk_indices(exact, k)
    p = torch.softmax(exact, dim=-1)  # a stand-in attention mass peaked where the scores are high
    out = {}
    for rot in (True, False):
        s = fp8_indexer_scores(q, k_, w, hadamard=rot).double()
        idx = topk_indices(s, k)
        out[rot] = dict(rel=float((s - exact).norm() / exact.norm()),
                        recall=compare_topk(idx, ref_idx, exact, k).mean_recall,
                        mass=float(attention_mass_recall(idx, p, relative_to=ref_idx).mean()))
    return out


@pytest.mark.parametrize("seed", [4, 5])
def test_fp8_with_rotation_is_closer_to_exact_on_outlier_heavy_inputs(seed):
    e = _errors(outlier_channels(tokens=48, num_keys=256, heads=8, magnitude=30.0, seed=seed))
    assert e[True]["rel"] < 0.5 * e[False]["rel"], e
    assert e[True]["recall"] > e[False]["recall"], e
    assert e[True]["mass"] >= e[False]["mass"], e
    assert e[False]["rel"] > 0.02, "without the rotation fp8 is visibly off on outliers"


def test_rotation_neither_helps_nor_hurts_much_without_outliers():
    e = _errors(outlier_channels(tokens=48, num_keys=256, heads=8, magnitude=1.0, seed=6))
    assert 0.7 < e[True]["rel"] / e[False]["rel"] < 1.4, e


def test_fp8_scores_keep_windows_and_dtype():
    case = outlier_channels(tokens=8, num_keys=8, heads=2, seed=7)
    starts = torch.zeros(8, dtype=torch.int64)
    ends = torch.arange(1, 9)
    s = fp8_indexer_scores(case["q"], case["k"], case["weights"], hadamard=True, starts=starts, ends=ends)
    assert s.dtype == torch.float32
    assert torch.equal(torch.isfinite(s), torch.arange(8)[None] < ends[:, None])
    assert math.isinf(float(s[0, 1]))


# ---------------------------------------------------------------------------------------------
# the layer's switch: IndexerConfig.fp8 selects by the simulated fp8 scores
# ---------------------------------------------------------------------------------------------


def _fp8_layer(seed, fp8, stage="sparse"):
    from dataclasses import replace

    from dsa_ref import DSAttention, tiny

    cfg = tiny()
    cfg = replace(cfg, indexer=replace(cfg.indexer, fp8=fp8))
    torch.manual_seed(seed)
    return DSAttention(cfg, stage=stage, dtype=torch.float64)


def test_config_fp8_switch_validates():
    from dataclasses import replace

    from dsa_ref import IndexerConfig, tiny

    ic = tiny().indexer
    assert ic.fp8 is False, "off by default"
    assert replace(ic, fp8=True).fp8 is True
    for bad in (1, 0, "yes", None, 1.0):
        with pytest.raises(ValueError, match="fp8"):
            IndexerConfig(n_heads=4, head_dim=16, topk=8, rope_head_dim=8, fp8=bad)


@needs_torch_fp8
@pytest.mark.parametrize("stage", ["sparse", "dense_warmup"])
def test_fp8_switch_selects_by_the_simulation_and_keeps_the_loss_unquantised(stage):
    from dsa_ref import key_windows, positions
    from dsa_ref.fp8 import selection_block_size
    from dsa_ref.indexer_loss import indexer_loss

    off, on = _fp8_layer(31, False, stage), _fp8_layer(31, True, stage)
    on.load_state_dict(off.state_dict())
    cu = torch.tensor([0, 7, 48, 96])
    x = torch.randn(96, on.config.mla.dim, generator=torch.Generator().manual_seed(32), dtype=torch.float64)
    a, b = off(x, cu), on(x, cu)
    pos, (starts, ends) = positions(cu), key_windows(cu)
    p = on.mla.project(x, pos)
    q, kv = on.absorbed.absorbed_qkv(p)
    qi, ki, wi = on.indexer.project(x, p.qr, pos)  # rotated already (use_hadamard)
    topk = on.config.indexer.topk
    sim = fp8_indexer_scores(qi, ki, wi, hadamard=False, starts=starts, ends=ends,
                             block_size=selection_block_size(qi.shape[-1]))
    assert torch.equal(b.topk_indices, topk_indices(sim, topk)), "the selection is the simulation's top-k"
    exact = lightning_indexer(qi, ki, wi, starts=starts, ends=ends)
    assert torch.equal(a.topk_indices, topk_indices(exact, topk))
    assert not torch.equal(a.topk_indices, b.topk_indices), "fp8 moves some selections at this size"
    if stage == "sparse":  # the loss: the KL on the fp8 selection, with the unquantised scores
        ref = indexer_loss(exact, q, kv, sm_scale=on.mla.softmax_scale, starts=starts, ends=ends,
                           topk_indices=b.topk_indices)
        torch.testing.assert_close(b.indexer_loss, ref, rtol=1e-13, atol=0)
    else:  # the warm-up's loss and output do not depend on the selection at all
        torch.testing.assert_close(b.indexer_loss, a.indexer_loss, rtol=1e-13, atol=0)
        torch.testing.assert_close(b.output, a.output, rtol=0, atol=0)
    b.output.sum().backward()  # the indexer trains through the unquantised scores
    assert all(p_.grad is not None and bool(torch.isfinite(p_.grad).all()) for p_ in on.indexer.parameters())


@needs_torch_fp8
def test_fp8_selection_operands_are_the_simulation():
    from dsa_ref.fp8 import fp8_selection_operands, selection_block_size

    g = torch.Generator().manual_seed(33)
    q, k, w = torch.randn(5, 4, 256, generator=g), torch.randn(9, 256, generator=g), torch.randn(5, 4, generator=g)
    assert selection_block_size(256) == 128 and selection_block_size(128) == 128 and selection_block_size(16) == 16
    qf, kf, wf = fp8_selection_operands(q, k, w)
    assert torch.equal(lightning_indexer(qf, kf, wf), fp8_indexer_scores(q, k, w, hadamard=False))


@needs_torch_fp8
def test_dispatch_fp8_scores_reference_is_the_simulation():
    from dsa_ref import dispatch

    g = torch.Generator().manual_seed(34)
    q, k, w = torch.randn(6, 4, 16, generator=g), torch.randn(10, 16, generator=g), torch.randn(6, 4, generator=g)
    starts, ends = torch.zeros(6, dtype=torch.int64), torch.arange(5, 11)
    for backend in ("reference", "auto"):  # on the CPU "auto" is the reference
        got = dispatch.lightning_indexer_fp8(q, k, w, starts=starts, ends=ends, backend=backend)
        assert torch.equal(got, fp8_indexer_scores(q, k, w, hadamard=False, starts=starts, ends=ends, block_size=16))
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="tilelang"):
            dispatch.lightning_indexer_fp8(q, k, w, backend="tilelang")
