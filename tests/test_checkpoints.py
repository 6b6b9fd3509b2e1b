"""dsa_ref.checkpoints on a synthetic sharded DeepSeek-V3.2 checkpoint (fp8 weights, 128 x 128 block
scales, edge blocks), bad inputs, and the state-dict round trip of DSAttention."""

import json
import os
import shutil

import pytest
import torch

from checkpoint_helpers import SMALL_V32, block_dequantize, write_deepseek_v32_fp8
from dsa_ref import DSAttention, tiny
from dsa_ref.checkpoints import (
    HF_TO_DSA_REF,
    Checkpoint,
    config_from_hf,
    dequantize_fp8_block,
    embed_tokens,
    indexer_layers,
    load_attention_layer,
    load_input_norm,
    topk_source_layer,
)


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("v32_fp8")
    meant = write_deepseek_v32_fp8(str(path))
    return str(path), meant


def test_dequantisation_matches_independent_block_quantiser(fp8_dir):
    """Every fp8 weight equals the test's own loop-over-blocks dequantisation, in float32 exactly."""
    path, meant = fp8_dir
    for L in range(2):
        layer = load_attention_layer(path, L, dtype=torch.float32)
        state = layer.state_dict()
        for hf, ours in HF_TO_DSA_REF.items():
            key = f"model.layers.{L}.self_attn.{hf}"
            assert torch.equal(state[ours], meant[key]), key
    # the default dtype is bf16: DeepSeek's weight_dequant rounds the float32 product to bf16
    layer = load_attention_layer(path, 0)
    assert layer.mla.wq_a.weight.dtype == torch.bfloat16
    assert layer.indexer.weights_proj.weight.dtype == torch.float32
    assert torch.equal(layer.mla.wq_a.weight, meant["model.layers.0.self_attn.q_a_proj.weight"].bfloat16())


def test_edge_blocks_have_their_own_scale():
    """A 130 x 260 weight has a 2 x 3 grid; the 2 x 4 edge tile uses scale[1, 2] (not a neighbour's)."""
    q = torch.ones(130, 260).to(torch.float8_e4m3fn)
    scale = torch.arange(1, 7, dtype=torch.float32).reshape(2, 3)
    w = dequantize_fp8_block(q, scale)
    assert torch.equal(w, block_dequantize(q, scale))
    assert w[129, 259] == 6.0 and w[127, 255] == 2.0 and w[128, 0] == 4.0
    with pytest.raises(ValueError, match=r"needs 2 x 3 scales"):
        dequantize_fp8_block(q, scale[:, :2], name="x.weight")


def test_layer_runs_and_equals_a_layer_built_from_the_meant_weights(fp8_dir):
    path, meant = fp8_dir
    layer = load_attention_layer(path, 1, dtype=torch.float64)
    ref = DSAttention(config_from_hf(path), dtype=torch.float64)
    ref.load_state_dict({ours: meant[f"model.layers.1.self_attn.{hf}"].double() for hf, ours in HF_TO_DSA_REF.items()})
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3])
    x = load_input_norm(path, 1, dtype=torch.float64)(embed_tokens(path, ids, dtype=torch.float64))
    a, b = layer(x), ref(x)
    assert torch.equal(a.topk_indices, b.topk_indices)
    torch.testing.assert_close(a.output, b.output, rtol=0, atol=0)


def test_embedding_and_input_norm(fp8_dir):
    path, meant = fp8_dir
    ids = torch.tensor([7, 0, 7, 49])
    e = embed_tokens(path, ids)
    assert e.dtype == torch.bfloat16 and torch.equal(e.float(), meant["model.embed_tokens.weight"][ids])
    norm = load_input_norm(path, 0)
    assert norm.eps == SMALL_V32["rms_norm_eps"]
    assert torch.equal(norm.weight.float(), meant["model.layers.0.input_layernorm.weight"])
    with pytest.raises(ValueError, match=r"row ids must lie in \[0, 50\)"):
        embed_tokens(path, torch.tensor([50]))


def test_reads_only_the_layer(fp8_dir, monkeypatch):
    """load_attention_layer opens the shard of its layer only and reads that layer's tensors only."""
    path, _ = fp8_dir
    read = []
    original = Checkpoint.read

    def spy(self, names, **kw):
        names = list(names)
        read.extend(names)
        return original(self, names, **kw)

    monkeypatch.setattr(Checkpoint, "read", spy)
    load_attention_layer(path, 1)
    assert read and all(n.startswith("model.layers.1.self_attn.") for n in read)


def test_config_from_hf_carries_every_field():
    cfg = config_from_hf(SMALL_V32)
    m, i = cfg.mla, cfg.indexer
    assert (m.dim, m.n_heads, m.q_lora_rank, m.kv_lora_rank) == (160, 2, 144, 200)
    assert (m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.norm_eps) == (32, 16, 24, 1e-6)
    assert (m.rope.theta, m.rope.factor, m.rope.original_max_position, m.rope.mscale) == (1e4, 40.0, 64, 1.0)
    assert (i.n_heads, i.head_dim, i.topk, i.rope_head_dim) == (4, 32, 8, 16)
    assert not i.rope_interleaved and i.use_hadamard and i.use_relu and i.k_norm_eps == 1e-6
    legacy = dict(SMALL_V32, rope_parameters=None, rope_theta=5e4,
                  rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                "mscale": 0.707, "mscale_all_dim": 0.707})
    c = config_from_hf(legacy).mla.rope
    assert (c.theta, c.factor, c.mscale) == (5e4, 4.0, 0.707)


@pytest.mark.parametrize("change, match", [
    (dict(model_type="deepseek_v3"), r"model_type='deepseek_v3' is not supported"),
    (dict(q_lora_rank=None), r"q_lora_rank=None"),
    (dict(num_key_value_heads=1), r"num_key_value_heads=1"),
    (dict(attention_bias=True), r"attention_bias=True"),
    (dict(index_topk=None), r"field 'index_topk' is missing"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0}), r"rope type 'linear'"),
    (dict(rope_parameters=dict(SMALL_V32["rope_parameters"], mscale=0.5)), r"attention_factor=.*mscale=0.5"),
    (dict(rope_parameters=dict(SMALL_V32["rope_parameters"], truncate=False)), r"truncate=False"),
    (dict(index_head_dim=48), r"head_dim=48.*power of two"),
])
def test_config_errors(change, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf(dict(SMALL_V32, **change))


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def _edit_config(path, **change):
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(change)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


def test_bad_checkpoints(fp8_dir, tmp_path):
    path, _ = fp8_dir
    with pytest.raises(ValueError, match=r"layer=2 is out of range: .*config.json has num_hidden_layers=2"):
        load_attention_layer(path, 2)
    with pytest.raises(FileNotFoundError, match=r"does not exist"):
        load_attention_layer(str(tmp_path / "nowhere"), 0)
    # a missing shard: named, with the tensor the index says it holds
    p = _copy(path, tmp_path / "no_shard")
    os.remove(os.path.join(p, "model-00002-of-00002.safetensors"))
    load_attention_layer(p, 0)  # layer 0 lives in the first shard
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00002.safetensors \(which holds 'model.layers.1"):
        load_attention_layer(p, 1)
    # a missing tensor
    p = _copy(path, tmp_path / "no_tensor")
    index = os.path.join(p, "model.safetensors.index.json")
    with open(index) as f:
        idx = json.load(f)
    del idx["weight_map"]["model.layers.0.self_attn.indexer.wk.weight"]
    with open(index, "w") as f:
        json.dump(idx, f)
    with pytest.raises(ValueError, match=r"has no tensor 'model.layers.0.self_attn.indexer.wk.weight'"):
        load_attention_layer(p, 0)
    # a shape that does not match the config
    p = _copy(path, tmp_path / "bad_shape")
    _edit_config(p, kv_lora_rank=192)
    with pytest.raises(ValueError, match=r"kv_a_proj_with_mqa.weight has shape \(216, 160\), but .* implies "
                                         r"\(208, 160\) .*kv_lora_rank=192"):
        load_attention_layer(p, 0)
    # another model type
    p = _copy(path, tmp_path / "other")
    _edit_config(p, model_type="llama")
    with pytest.raises(ValueError, match=r"config.json: model_type='llama' is not supported"):
        load_attention_layer(p, 0)
    # no index and no single file
    p = _copy(path, tmp_path / "no_index")
    os.remove(os.path.join(p, "model.safetensors.index.json"))
    with pytest.raises(FileNotFoundError, match=r"neither model.safetensors.index.json nor model.safetensors"):
        load_attention_layer(p, 0)


def test_glm_layer_pattern():
    base = dict(model_type="glm_moe_dsa", num_hidden_layers=6)
    assert indexer_layers(dict(base, indexer_types=["full", "shared", "shared", "full", "shared", "full"])) == \
        [True, False, False, True, False, True]
    assert indexer_layers(dict(base, index_topk_pattern="FSFSSF")) == [True, False, True, False, False, True]
    # transformers' schedule: full when max(i - offset + 1, 0) % freq == 0
    assert indexer_layers(dict(base, index_topk_freq=2, index_skip_topk_offset=2)) == \
        [True, True, False, True, False, True]
    assert indexer_layers(base) == [True] * 6
    assert topk_source_layer(dict(base, index_topk_pattern="FSSFSF"), 2) == 0
    assert topk_source_layer(dict(base, index_topk_pattern="FSSFSF"), 3) == 3
    with pytest.raises(ValueError, match="layer 0 is 'shared'"):
        indexer_layers(dict(base, index_topk_pattern="SFFFFF"))
    with pytest.raises(ValueError, match="indexer_types must list"):
        indexer_layers(dict(base, indexer_types=["full"] * 5))


def test_state_dict_holds_each_weight_once_and_round_trips():
    torch.manual_seed(0)
    a = DSAttention(tiny(), dtype=torch.float64)
    keys = list(a.state_dict())
    assert not any(k.startswith("absorbed.") for k in keys)
    assert len(keys) == len({id(p) for p in a.parameters()}) == len(list(a.parameters()))
    b = DSAttention(tiny(), dtype=torch.float64)
    b.load_state_dict(a.state_dict(), strict=True)
    x = torch.randn(12, tiny().mla.dim, dtype=torch.float64)
    assert torch.equal(a(x).output, b(x).output)
    # a state dict saved with the older duplicate absorbed.mla.* keys still loads strictly
    old = dict(a.state_dict())
    old.update({f"absorbed.{k}": v for k, v in a.state_dict().items() if k.startswith("mla.")})
    c = DSAttention(tiny(), dtype=torch.float64)
    c.load_state_dict(old, strict=True)
    assert torch.equal(c(x).output, a(x).output)
    # the absorbed view follows the module (dtype casts, copies)
    d = a.to(torch.float32)
    assert d.absorbed.mla is d.mla and d.absorbed.mla.wq_a.weight.dtype == torch.float32
    shared = DSAttention(tiny(), has_indexer=False)
    assert not any(k.startswith("indexer.") for k in shared.state_dict())


def test_cli_inspect(fp8_dir, capsys):
    from dsa_ref.cli import main

    path, _ = fp8_dir
    assert main(["inspect", path, "--layer", "1", "--tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.1.self_attn.kv_b_proj.weight" in out and "F8_E4M3" in out and "mla.wkv_b.weight" in out
    assert "derived DSAConfig" in out and "output [6, 160]" in out and "finite True" in out
    assert main(["inspect", path, "--layer", "7", "--no-forward"]) == 2
    assert "num_hidden_layers=2" in capsys.readouterr().err
