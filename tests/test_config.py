"""Config dataclasses: the DeepSeek-V3.2 preset carries the published numbers, tiny() is a valid small
copy of its structure, and every invalid field is rejected by name."""

from __future__ import annotations

import dataclasses
import math

import pytest

from dsa_ref.config import (
    DSAConfig,
    IndexerConfig,
    MLAConfig,
    RopeConfig,
    deepseek_v32,
    tiny,
    yarn_mscale,
)


# ---------------------------------------------------------------------------------------------
# presets
# ---------------------------------------------------------------------------------------------


def test_deepseek_v32_mla_numbers():
    m = deepseek_v32().mla
    assert (m.dim, m.n_heads, m.q_lora_rank, m.kv_lora_rank) == (7168, 128, 1536, 512)
    assert (m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (128, 64, 128)
    assert m.qk_head_dim == 192
    assert m.latent_dim == 576
    assert m.rope_interleaved is True  # MLA: DeepSeek's interleaved pairs
    assert m.norm_eps == pytest.approx(1e-6)


def test_deepseek_v32_rope_numbers():
    r = deepseek_v32().mla.rope
    assert r.theta == 10000.0
    assert r.factor == 40.0
    assert r.original_max_position == 4096
    assert (r.beta_fast, r.beta_slow) == (32.0, 1.0)
    assert r.mscale == 1.0
    assert r.yarn


def test_deepseek_v32_indexer_numbers():
    ix = deepseek_v32().indexer
    assert (ix.n_heads, ix.head_dim, ix.topk) == (64, 128, 2048)
    assert ix.rope_head_dim == 64
    assert ix.rope_interleaved is False  # indexer: half-split (the V3.2 fix, pitfall P1)
    assert ix.use_relu is True


def test_deepseek_v32_softmax_scale():
    m = deepseek_v32().mla
    mscale = 0.1 * math.log(40.0) + 1.0
    assert m.mscale == pytest.approx(mscale, rel=1e-15)
    expected = 192 ** -0.5 * mscale ** 2
    assert m.softmax_scale == pytest.approx(expected, rel=1e-15)
    assert m.softmax_scale == pytest.approx(0.135234, abs=1e-6)  # ~0.13524
    # the well-known absorbed-MLA bug uses the 576 latent width: must not be what the config says
    assert abs(m.softmax_scale - 576 ** -0.5 * mscale ** 2) > 1e-2


def test_softmax_scale_without_yarn_is_plain():
    m = dataclasses.replace(deepseek_v32().mla, rope=RopeConfig(factor=1.0))
    assert m.mscale == 1.0
    assert m.softmax_scale == pytest.approx(192 ** -0.5, rel=1e-15)


@pytest.mark.parametrize("factor, mscale, expected", [
    (1.0, 1.0, 1.0),
    (0.5, 1.0, 1.0),
    (40.0, 1.0, 0.1 * math.log(40.0) + 1.0),
    (4.0, 0.707, 0.1 * 0.707 * math.log(4.0) + 1.0),
])
def test_yarn_mscale(factor, mscale, expected):
    assert yarn_mscale(factor, mscale) == pytest.approx(expected, rel=1e-15)


def test_tiny_is_valid_and_small():
    cfg = tiny()
    assert isinstance(cfg, DSAConfig)
    m, ix = cfg.mla, cfg.indexer
    # re-validating through the constructors raises nothing
    DSAConfig(mla=MLAConfig(**{f.name: getattr(m, f.name) for f in dataclasses.fields(m)}),
              indexer=IndexerConfig(**{f.name: getattr(ix, f.name) for f in dataclasses.fields(ix)}))
    assert m.dim <= 128 and m.n_heads <= 8 and m.kv_lora_rank <= 128 and m.q_lora_rank <= 128
    assert m.qk_head_dim <= 32 and ix.head_dim <= 32 and ix.n_heads <= 8
    assert 1 <= ix.topk <= 16
    assert ix.rope_head_dim == m.qk_rope_head_dim
    # keeps the structure of V3.2: layouts, YaRN on, latent wider than a head
    assert m.rope_interleaved and not ix.rope_interleaved
    assert m.rope.yarn and m.mscale > 1.0
    assert m.latent_dim == m.kv_lora_rank + m.qk_rope_head_dim
    assert m.kv_lora_rank > m.qk_nope_head_dim
    assert m.softmax_scale == pytest.approx(m.qk_head_dim ** -0.5 * m.mscale ** 2)


def test_presets_are_fresh_and_equal():
    assert deepseek_v32() == deepseek_v32()
    assert tiny() == tiny()
    assert tiny() != deepseek_v32()


def test_with_topk():
    cfg = tiny()
    other = cfg.with_topk(3)
    assert other.indexer.topk == 3
    assert cfg.indexer.topk == tiny().indexer.topk  # the original is unchanged
    assert other.mla == cfg.mla
    with pytest.raises(ValueError, match="topk"):
        cfg.with_topk(0)


# ---------------------------------------------------------------------------------------------
# frozen
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("obj, field", [
    (tiny(), "mla"),
    (tiny().mla, "n_heads"),
    (tiny().mla.rope, "factor"),
    (tiny().indexer, "topk"),
])
def test_configs_are_frozen(obj, field):
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(obj, field, getattr(obj, field))


def test_configs_are_hashable():
    # frozen dataclasses of hashable fields hash, so configs can key caches
    assert hash(tiny()) == hash(tiny())


# ---------------------------------------------------------------------------------------------
# validation: every bad field raises ValueError naming it
# ---------------------------------------------------------------------------------------------

_ROPE_BAD = [
    ("theta", 1.0), ("theta", 0.0), ("theta", -5.0),
    ("factor", 0.5), ("factor", 0.0),
    ("original_max_position", 0), ("original_max_position", -1),
    ("beta_fast", 1.0), ("beta_fast", 0.5),   # must exceed beta_slow=1
    ("beta_slow", 0.0), ("beta_slow", 40.0),  # > 0 and below beta_fast=32
    ("mscale", 0.0), ("mscale", -1.0),
]


@pytest.mark.parametrize("field, value", _ROPE_BAD)
def test_rope_config_rejects(field, value):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(RopeConfig(), **{field: value})


_MLA_BAD = [
    ("dim", 0), ("dim", -3),
    ("n_heads", 0),
    ("q_lora_rank", 0),
    ("kv_lora_rank", 0),
    ("qk_nope_head_dim", 0),
    ("v_head_dim", 0),
    ("qk_rope_head_dim", 0), ("qk_rope_head_dim", 7), ("qk_rope_head_dim", -2),
    ("norm_eps", 0.0), ("norm_eps", -1e-6),
]


@pytest.mark.parametrize("field, value", _MLA_BAD)
def test_mla_config_rejects(field, value):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(tiny().mla, **{field: value})


_INDEXER_BAD = [
    ("n_heads", 0),
    ("head_dim", 0),
    ("head_dim", 24),        # not a power of two with use_hadamard=True
    ("topk", 0), ("topk", -1),
    ("rope_head_dim", 0), ("rope_head_dim", 3), ("rope_head_dim", 32),  # odd / > head_dim=16
    ("k_norm_eps", 0.0),
]


@pytest.mark.parametrize("field, value", _INDEXER_BAD)
def test_indexer_config_rejects(field, value):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(tiny().indexer, **{field: value})


def test_indexer_head_dim_need_not_be_power_of_two_without_hadamard():
    ix = dataclasses.replace(tiny().indexer, head_dim=24, use_hadamard=False)
    assert ix.head_dim == 24


def test_dsa_config_rejects_mismatched_rope_dims():
    cfg = tiny()
    ix = dataclasses.replace(cfg.indexer, rope_head_dim=cfg.mla.qk_rope_head_dim + 2)
    with pytest.raises(ValueError, match="rope_head_dim"):
        DSAConfig(mla=cfg.mla, indexer=ix)


def test_error_message_shows_value_seen():
    with pytest.raises(ValueError, match=r"n_heads=0"):
        dataclasses.replace(tiny().mla, n_heads=0)
