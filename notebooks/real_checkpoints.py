# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Using a real checkpoint
#
# This notebook loads **layer 0** of a DeepSeek-V3.2 or GLM-5 checkpoint with
# `dsa_ref.checkpoints`, runs text through embedding → input norm → layer 0, and looks at what the
# lightning indexer selects and how much of the attention mass its top-k keeps.
#
# Set `DSA_REF_CHECKPOINT` to a local download (the directory with `config.json`,
# `model.safetensors.index.json` and the shards; only layer 0's tensors and the embedding rows of
# the text are read). Without it -- as in CI -- the notebook writes a small synthetic checkpoint in
# DeepSeek-V3.2's key layout with random weights, so the numbers below then show the mechanics,
# not a trained model's behaviour.

# %%
import json
import os
import tempfile

import matplotlib.pyplot as plt
import torch
from safetensors.torch import save_file

from dsa_ref import DSAConfig, DSAttention, IndexerConfig, MLAConfig, RopeConfig, key_windows, positions
from dsa_ref.attention import dense_mla_attention
from dsa_ref.checkpoints import HF_TO_DSA_REF, config_from_hf, embed_tokens, load_attention_layer, load_input_norm
from dsa_ref.compare import attention_mass_recall

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)

# %% [markdown]
# ## The checkpoint
#
# The synthetic stand-in is a `deepseek_v32` config with small widths. Its weights are written
# under the real names (`model.layers.0.self_attn.q_a_proj.weight`, ...; see
# `dsa_ref.checkpoints.HF_TO_DSA_REF`) in bf16; the released DeepSeek-V3.2 stores the linear
# weights in fp8 with 128 × 128 block scales, which `load_attention_layer` dequantises the same way.

# %%
def write_synthetic_checkpoint(directory: str) -> str:
    rope = RopeConfig(theta=10000.0, factor=40.0, original_max_position=64)
    cfg = DSAConfig(MLAConfig(dim=256, n_heads=8, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32,
                              qk_rope_head_dim=16, v_head_dim=32, rope=rope),
                    IndexerConfig(n_heads=8, head_dim=64, topk=16, rope_head_dim=16))
    layer = DSAttention(cfg)
    with torch.no_grad():
        for p in layer.parameters():
            if p.dim() == 2:
                p.mul_(3.0)  # peakier attention than PyTorch's default init
    ours = layer.state_dict()
    tensors = {f"model.layers.0.self_attn.{hf}": ours[name].to(torch.bfloat16) for hf, name in HF_TO_DSA_REF.items()}
    tensors["model.layers.0.input_layernorm.weight"] = torch.ones(cfg.mla.dim, dtype=torch.bfloat16)
    tensors["model.embed_tokens.weight"] = torch.randn(256, cfg.mla.dim).to(torch.bfloat16)
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    m, i = cfg.mla, cfg.indexer
    config = dict(model_type="deepseek_v32", vocab_size=256, hidden_size=m.dim, num_hidden_layers=1,
                  num_attention_heads=m.n_heads, num_key_value_heads=m.n_heads, q_lora_rank=m.q_lora_rank,
                  kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
                  qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim, index_n_heads=i.n_heads,
                  index_head_dim=i.head_dim, index_topk=i.topk, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                   "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
                                   "mscale": 1.0, "mscale_all_dim": 1.0})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return directory


path = os.environ.get("DSA_REF_CHECKPOINT")
real = path is not None
if not real:
    path = write_synthetic_checkpoint(tempfile.mkdtemp())
cfg = config_from_hf(path)
print("checkpoint:", path, "(real)" if real else "(synthetic)")
print(cfg.mla)
print(cfg.indexer)

# %% [markdown]
# ## Text through embedding → norm → layer 0
#
# No tokenizer is available offline, so the text is mapped to token ids **character by
# character** (`ord(c) % vocab_size`). For a real checkpoint these ids are not the model's tokens:
# the embeddings are real rows of the embedding matrix, but the "text" the layer sees is a
# sequence of arbitrary tokens with the repetitions of the characters. Tokenise with the model's
# own tokenizer (`transformers.AutoTokenizer`) where you have it, and pass its ids instead.
#
# The selection needs more tokens than top-k to drop anything: on CPU the text is repeated to
# a few times `index_topk` tokens of the synthetic layer; with CUDA, and a real checkpoint (top-k
# 2048), it is repeated to 4096 tokens.

# %%
text = "The quick brown fox jumps over the lazy dog. Sparse attention keeps the keys that matter. "
vocab = json.load(open(os.path.join(path, "config.json")))["vocab_size"]
n_tokens = 4096 if (real and device == "cuda") else (256 if device == "cuda" else 4 * cfg.indexer.topk + 7)
chars = (text * (n_tokens // len(text) + 1))[:n_tokens]
ids = torch.tensor([ord(c) % vocab for c in chars])

dtype = torch.bfloat16
layer = load_attention_layer(path, 0, device=device, dtype=dtype, progress=True)
norm = load_input_norm(path, 0, device=device, dtype=dtype)
x = norm(embed_tokens(path, ids, device=device, dtype=dtype))  # [T, dim]
with torch.no_grad():
    out = layer(x)
print("output", tuple(out.output.shape), "indexer loss", float(out.indexer_loss))

# %% [markdown]
# ## What the indexer selects
#
# For the last query, the `index_topk` keys with the highest index scores, shown as the
# characters at those positions (the query always sees itself: the window is causal).

# %%
last = out.topk_indices[-1]
picked = sorted(i for i in last.tolist() if i >= 0)
print(f"query {len(chars) - 1} ({chars[-1]!r}) selects {len(picked)} of {len(chars)} keys")
print("".join(chars[i] if i in set(picked) else "·" for i in range(len(chars)))[-200:])

# %% [markdown]
# ## How much attention mass the top-k keeps
#
# The dense attention of the same layer (every key of the causal window), its probabilities
# summed over heads and normalised per query, is the indexer's training target; the share of it
# that falls on the selected keys is what sparse attention keeps. A value of 1 means the top-k
# holds all of the query's attention; queries with no more than `index_topk` keys keep 1 by
# construction.

# %%
with torch.no_grad():
    cu = torch.tensor([0, len(chars)], device=device)
    p = layer.mla.project(x, positions(cu))
    q, kv = layer.absorbed.absorbed_qkv(p)  # [T, H, 576-like], [T, 576-like]
    starts, ends = key_windows(cu)
    T, H = q.shape[:2]
    mass = torch.zeros(T, T, dtype=torch.float32, device=device)  # [T, T]: head-summed probabilities
    for h in range(H):  # one head at a time keeps memory at [T, T]
        logits = torch.einsum("td,sd->ts", q[:, h].float(), kv.float()) * layer.mla.softmax_scale  # [T, T]
        keys = torch.arange(T, device=device)
        inside = (keys[None, :] >= starts[:, None]) & (keys[None, :] < ends[:, None])
        mass += torch.where(inside, logits, float("-inf")).softmax(-1)
    kept = attention_mass_recall(out.topk_indices, mass)  # [T]

plt.figure(figsize=(7, 3))
plt.plot(kept.cpu())
plt.axvline(cfg.indexer.topk - 1, color="gray", ls=":", label="query sees topk keys")
plt.xlabel("query position")
plt.ylabel("attention mass kept")
plt.ylim(0, 1.05)
plt.legend()
plt.tight_layout()
plt.show()
tail = kept[cfg.indexer.topk:]
print(f"queries beyond top-k: mean mass kept {tail.mean():.3f}, min {tail.min():.3f}")
