"""Synthetic checkpoints in the real key layouts, written by the tests (no download).

`write_deepseek_v32_fp8` writes a sharded DeepSeek-V3.2-style checkpoint: ``config.json`` with its
``quantization_config``, ``model.safetensors.index.json`` and two shards, the linear weights of the
attention as ``float8_e4m3fn`` with one float32 ``weight_scale_inv`` per 128 x 128 block, quantised
by `block_quantize` below -- an implementation independent of `dsa_ref.checkpoints` (explicit loops
over the blocks).
"""

from __future__ import annotations

import json
import math
import os

import torch
from safetensors.torch import save_file

E4M3_MAX = 448.0
BLOCK = 128


def block_quantize(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a 2-D weight to e4m3 with one scale per ``block x block`` tile (edge tiles included)."""
    M, N = w.shape
    q = torch.empty(M, N, dtype=torch.float8_e4m3fn)
    scale = torch.empty(math.ceil(M / block), math.ceil(N / block), dtype=torch.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block].to(torch.float32)
            s = tile.abs().max().clamp_min(1e-12) / E4M3_MAX
            scale[i, j] = s
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (tile / s).to(torch.float8_e4m3fn)
    return q, scale


def block_dequantize(q: torch.Tensor, scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """The float32 values a block-quantised weight stands for (loop over the tiles)."""
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = q[i * block:(i + 1) * block, j * block:(j + 1) * block].to(torch.float32)
            out[i * block:(i + 1) * block, j * block:(j + 1) * block] = tile * scale[i, j]
    return out


#: A DeepSeek-V3.2-shaped config small enough for CPU tests, with widths that are not multiples of
#: 128 (160, 144, 200), so the fp8 block grid has partial blocks at the edges.
SMALL_V32 = dict(
    model_type="deepseek_v32", architectures=["DeepseekV32ForCausalLM"], vocab_size=50, hidden_size=160,
    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=144, kv_lora_rank=200,
    qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24, index_n_heads=4, index_head_dim=32, index_topk=8,
    rms_norm_eps=1e-6, max_position_embeddings=4096, attention_bias=False,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 64,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                         "weight_block_size": [128, 128]},
)

#: The attention weights DeepSeek-V3.2 stores in fp8 (norms, k_norm and weights_proj stay bf16/fp32).
FP8_KEYS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "indexer.wq_b", "indexer.wk")


def write_deepseek_v32_fp8(directory: str, seed: int = 0, config: dict | None = None) -> dict:
    """Write the synthetic sharded fp8 checkpoint; return ``{key: float tensor}`` of what was meant
    (unquantised) and ``{key: (fp8, scale)}`` under ``"_quantised"``."""
    cfg = dict(SMALL_V32 if config is None else config)
    g = torch.Generator().manual_seed(seed)
    d, H = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    ql, kvl, HI, DI = cfg["q_lora_rank"], cfg["kv_lora_rank"], cfg["index_n_heads"], cfg["index_head_dim"]

    def w(rows, cols):
        return torch.randn(rows, cols, generator=g) * cols ** -0.5

    shapes = {"q_a_proj": (ql, d), "q_b_proj": (H * (nope + rope), ql), "kv_a_proj_with_mqa": (kvl + rope, d),
              "kv_b_proj": (H * (nope + v), kvl), "o_proj": (d, H * v), "indexer.wq_b": (HI * DI, ql),
              "indexer.wk": (DI, d), "indexer.weights_proj": (HI, d)}
    shards: list[dict] = [{}, {}]
    meant, quantised = {}, {}
    for layer in range(cfg["num_hidden_layers"]):
        base = f"model.layers.{layer}."
        shard = shards[layer % 2]
        for name, (r, c) in shapes.items():
            key = base + "self_attn." + name + ".weight"
            if name in FP8_KEYS:
                q, s = block_quantize(w(r, c))
                shard[key], shard[key + "_scale_inv"] = q, s
                quantised[key] = (q, s)
                meant[key] = block_dequantize(q, s)
            else:
                shard[key] = w(r, c).to(torch.bfloat16)
                meant[key] = shard[key].float()
        for name, n in (("q_a_layernorm", ql), ("kv_a_layernorm", kvl)):
            key = base + "self_attn." + name + ".weight"
            shard[key] = (1 + 0.1 * torch.randn(n, generator=g)).to(torch.bfloat16)
            meant[key] = shard[key].float()
        for name in ("weight", "bias"):
            key = base + "self_attn.indexer.k_norm." + name
            shard[key] = (float(name == "weight") + 0.1 * torch.randn(DI, generator=g)).to(torch.bfloat16)
            meant[key] = shard[key].float()
        key = base + "input_layernorm.weight"
        shard[key] = (1 + 0.1 * torch.randn(d, generator=g)).to(torch.bfloat16)
        meant[key] = shard[key].float()
    shards[0]["model.embed_tokens.weight"] = torch.randn(cfg["vocab_size"], d, generator=g).to(torch.bfloat16)
    meant["model.embed_tokens.weight"] = shards[0]["model.embed_tokens.weight"].float()

    os.makedirs(directory, exist_ok=True)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, shard in zip(names, shards):
        save_file({k: t.contiguous() for k, t in shard.items()}, os.path.join(directory, file))
        weight_map.update({k: file for k in shard})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)
    meant["_quantised"] = quantised
    return meant
