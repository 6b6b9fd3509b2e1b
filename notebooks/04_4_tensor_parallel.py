# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 4.4 — Tensor parallelism
#
# Tensor parallelism (TP) splits one layer's **attention heads** over the ranks of a process
# group. Every rank holds every token, computes its share of the heads, and a few collectives make
# the result equal to the single-process layer. This notebook
#
# 1. lists which weights are split by head and which are replicated, on the tiny config and at
#    DeepSeek-V3.2's shapes;
# 2. shows the row-parallel sum behind the output all-reduce ($g$) in one process;
# 3. shows why the KL target's head sum must be all-reduced *before* its normalisation;
# 4. runs the layer on **two real gloo processes**, in both training stages, and compares with the
#    single-process run;
# 5. counts the bytes of every TP collective at DeepSeek-V3.2 scale;
#
# and ends with assertions. Everything runs on the CPU in a few seconds: TP here is about which
# numbers are summed where, not about speed.

# %%
import matplotlib.pyplot as plt
import numpy as np
import torch

import dsa_ref
from dsa_ref import DSAttention, deepseek_v32, tiny
from dsa_ref.tensor_parallel import SPLIT_DIMS, parameter_kind, tp_collective_bytes
from dsa_ref.notebook_helpers import run_gloo_demo

torch.set_num_threads(1)
dtype = torch.float64
cfg = tiny()
TP = 2
KIND_COLORS = {"split": "#3949ab", "latent": "#e65100", "indexer": "#2e7d32"}

# %% [markdown]
# ## 1. What is split and what is replicated
#
# `dsa_ref.tensor_parallel.SPLIT_DIMS` names the three weights that are split by head and the
# dimension they are split along: the rows of `wq_b` and `wkv_b` (per-head blocks of the query
# up-projection and of $W^{UK}$, $W^{UV}$) and the columns of `wo`. Everything else belongs to a
# token, not a head, and every rank holds all of it: the latent projections (`wq_a`, `wkv_a` and
# their norms) and the whole lightning indexer.

# %%
layer = DSAttention(cfg, stage="sparse", dtype=dtype)
print(f"tiny config: {cfg.mla.n_heads} heads, tp = {TP} -> {cfg.mla.n_heads // TP} heads per rank\n")
print(f"{'parameter':<28}{'kind':<9}{'full shape':<16}per rank")
for name, p in layer.named_parameters():
    kind = parameter_kind(name)
    local = list(p.shape)
    if name in SPLIT_DIMS:
        local[SPLIT_DIMS[name]] //= TP
    print(f"{name:<28}{kind:<9}{str(list(p.shape)):<16}{local}")

# the same split at DeepSeek-V3.2's shapes, without allocating the weights (meta device)
big = DSAttention(deepseek_v32(), device="meta")
counts = {"split": 0, "latent": 0, "indexer": 0}
for name, p in big.named_parameters():
    counts[parameter_kind(name)] += p.numel()
total = sum(counts.values())
tps = [1, 2, 4, 8, 16]
per_rank = {k: [v / (t if k == "split" else 1) / 1e6 for t in tps] for k, v in counts.items()}
print(f"\nDeepSeek-V3.2 layer: {total:,} weights; split by head {counts['split']:,}, "
      f"replicated {counts['latent']:,} (MLA latents) + {counts['indexer']:,} (indexer)")

fig, ax = plt.subplots(figsize=(8, 3.6))
bottom = np.zeros(len(tps))
for kind, label in (("split", "split by head"), ("latent", "MLA latents (replicated)"),
                    ("indexer", "indexer (replicated)")):
    ax.bar([str(t) for t in tps], per_rank[kind], bottom=bottom, color=KIND_COLORS[kind], label=label)
    bottom += np.array(per_rank[kind])
ax.set_xlabel("tp")
ax.set_ylabel("weights per rank, millions")
ax.set_title("one DSA layer at DeepSeek-V3.2 shapes: what each TP rank stores", fontsize=10)
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 2. The output projection is a sum over ranks
#
# Rank $r$ owns the heads $\mathcal H_r$ and their columns of $W^O$. The output of the layer is
#
# $$
# y_t = W^{O}\,\big[o_{t,1} ; \dots ; o_{t,H}\big]
#     = \sum_{r} W^{O}_{[:,\,\mathcal H_r]}\; o_{t,\mathcal H_r},
# $$
#
# so each rank computes a *partial* $y_t$ from its own heads, and an all-reduce (the operator $g$,
# `reduce_from_tp`) adds them up. Here the two ranks are emulated in one process: the per-head
# outputs of one forward are split into the two ranks' halves and pushed through their halves of
# $W^O$.

# %%
torch.manual_seed(0)
cu = torch.tensor([0, 12, 32])
T = int(cu[-1])
x = torch.randn(T, cfg.mla.dim, dtype=dtype)
heads_out = {}
hook = layer.mla.wo.register_forward_hook(lambda m, inp, out: heads_out.update(o=inp[0].detach()))
with torch.no_grad():
    full = layer(x, cu).output                                    # [T, dim]
hook.remove()
o = heads_out["o"]                                                # [T, H * v_head_dim]
W = layer.mla.wo.weight                                           # [dim, H * v_head_dim]
o_parts, W_parts = o.chunk(TP, dim=1), W.chunk(TP, dim=1)         # heads are contiguous blocks
partials = [op @ Wp.T for op, Wp in zip(o_parts, W_parts)]        # TP x [T, dim]
g_err = (sum(partials) - full).abs().max().item()
print(f"o {list(o.shape)} -> {TP} ranks x {list(o_parts[0].shape)}; partial outputs {list(partials[0].shape)}")
print(f"max |sum of the partial outputs - the layer's output| = {g_err:.1e}")

# %% [markdown]
# ## 3. The KL target: sum over all heads first, then normalise
#
# The indexer is trained towards the main attention's probabilities summed over **all** heads and
# L1-normalised over each query's keys. A rank sees only its own heads, so `TensorParallelDSA`
# all-reduces each rank's head sum *before* the normalisation. The order matters: normalising each
# rank's sum first and adding the results gives a target whose rows sum to tp, not 1.

# %%
from dsa_ref.indexer_loss import indexer_target  # noqa: E402

with torch.no_grad():
    p = layer.mla.project(x, dsa_ref.positions(cu))
    q, kv = layer.absorbed.absorbed_qkv(p)                       # [T, H, r + d_r], [T, r + d_r]
    starts, ends = dsa_ref.key_windows(cu)
    target = indexer_target(q, kv, sm_scale=layer.mla.softmax_scale, starts=starts, ends=ends)  # [T, S]
    mask = dsa_ref.window_mask(starts, ends, T)[:, None, :]      # [T, 1, S]
    head_sums = []
    for qh in q.chunk(TP, dim=1):                                 # each rank's heads, [T, H / tp, r + d_r]
        scores = torch.einsum("thd,sd->ths", qh, kv) * layer.mla.softmax_scale  # [T, H / tp, S]
        probs = torch.where(mask, scores, float("-inf")).softmax(dim=-1)
        head_sums.append(probs.sum(dim=1))                        # [T, S]: this rank's inner sum
right = sum(head_sums) / sum(head_sums).sum(dim=-1, keepdim=True)
wrong = sum(h / h.sum(dim=-1, keepdim=True) for h in head_sums)
target_err = (right - target).abs().max().item()
print(f"all-reduce, then normalise: max |difference to the single-process target| = {target_err:.1e}")
print(f"normalise, then all-reduce: row sums {wrong.sum(-1).min().item():.3f} .. {wrong.sum(-1).max().item():.3f}")

# %% [markdown]
# ## 4. Two real ranks over gloo
#
# `tools/tp_gloo_demo.py` forks two processes that form a gloo process group (the same code runs on
# NCCL). Every rank builds the same float64 layer and pack from a seed, takes its heads with
# `TensorParallelDSA.from_dense`, runs forward and backward of a fixed linear "LM loss", calls
# `sync_tensor_parallel_grads`, gathers the split gradients (`full_tensors(grads=True)`), and
# compares with the single-process run, in the dense warm-up and in the sparse stage. Started here
# with `--save`, it also writes its results, and the notebook repeats the comparison on its own.
# From a shell, `python -m torch.distributed.run --nproc-per-node 2 tools/tp_gloo_demo.py` does
# the same with one process per rank.

# %%
saved = run_gloo_demo("tp_gloo_demo.py", "--tp", str(TP), "--lengths", "12,20")

# %%
run = torch.load(saved, weights_only=True)
nb_errors = {}
for stage, r in run["stages"].items():
    ref_layer = DSAttention(tiny(), stage=stage, dtype=dtype)
    ref_layer.load_state_dict(r["state_dict"])
    xr = r["x"].clone().requires_grad_(True)
    ref = ref_layer(xr, r["cu_seqlens"])
    (ref.output * r["w_out"]).sum().backward()
    nb_errors[stage] = {
        "output": (r["output"] - ref.output.detach()).abs().max().item(),
        "x gradient": (r["x_grad"] - xr.grad).abs().max().item(),
        "split weights' gradients": max((r["param_grads"][n] - p.grad).abs().max().item()
                                        for n, p in ref_layer.named_parameters() if n in SPLIT_DIMS),
        "replicated gradients": max((r["param_grads"][n] - p.grad).abs().max().item()
                                    for n, p in ref_layer.named_parameters() if n not in SPLIT_DIMS),
        "indexer loss": abs(r["indexer_loss"].item() - ref.indexer_loss.item()),
    }
    nb_errors[stage]["top-k identical"] = torch.equal(r["topk_indices"], ref.topk_indices)
    print(f"{stage}: local wq_b {list(r['local_shapes']['mla.wq_b.weight'])}, "
          f"local wo {list(r['local_shapes']['mla.wo.weight'])}")
    for name, e in nb_errors[stage].items():
        print(f"  max |TP (2 gloo ranks) - single process| {name:<26} {e:.1e}" if name != "top-k identical"
              else f"  top-k indices identical: {e}")

fig, ax = plt.subplots(figsize=(9, 3.4))
names = [n for n in nb_errors["sparse"] if n != "top-k identical"]
xs = np.arange(len(names))
for i, (stage, errs) in enumerate(nb_errors.items()):
    vals = [max(errs[n], 1e-18) for n in names]                  # exact zeros drawn at 1e-18
    ax.bar(xs + (i - 0.5) * 0.38, vals, 0.38, label=stage.replace("_", " "))
ax.axhline(1e-10, color="black", ls="--", lw=1, label="tolerance 1e-10")
ax.set_yscale("log")
ax.set_xticks(xs, names, fontsize=8)
ax.set_ylabel("max |TP - single process|")
ax.set_title("two TP ranks over gloo against one process, float64", fontsize=10)
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 5. Bytes per layer at DeepSeek-V3.2 scale
#
# `tp_collective_bytes` gives the payload of each TP collective of one layer (what one rank puts
# into the sum), for $T$ tokens per rank. A ring all-reduce over tp ranks sends and receives
# $2(\mathrm{tp}-1)/\mathrm{tp}$ times its payload on every rank. The dense warm-up's KL target is
# `[T, S]` fp32, by far the largest; in the sparse stage it shrinks to the `[T, 2048]` selected
# slots.

# %%
tokens = 4096
b = tp_collective_bytes(deepseek_v32(), tokens)
print(f"DeepSeek-V3.2, T = {tokens} tokens per rank, payload per collective (MiB):")
for name, v in b.items():
    print(f"  {name:<22}{v / 2**20:10.2f}")
for t in (2, 4, 8):
    ring = 2 * (t - 1) / t
    fwd = ring * (b["output"] + b["target_sparse"])
    bwd = ring * b["latent_grads"]
    print(f"tp = {t}: sparse stage, per rank and layer: forward {fwd / 2**20:6.1f} MiB, backward {bwd / 2**20:6.1f} MiB")

# %% [markdown]
# Chapter 4.4 on the site works these numbers out for tp = 8 and puts TP beside context
# parallelism (a `tp x cp` grid, `make_tp_cp_groups`).

# %% [markdown]
# ## Checks

# %%
# which weights are split, and the per-rank storage at V3.2 shapes
assert set(SPLIT_DIMS) == {"mla.wq_b.weight", "mla.wkv_b.weight", "mla.wo.weight"}
assert total == 201_066_752 and counts["split"] == 171_966_464
assert counts["latent"] + counts["indexer"] == 29_100_288
# the output is the sum of the ranks' partial outputs
assert g_err < 1e-12, g_err
# the target: all-reduce before the normalisation; the other order sums to tp
assert target_err < 1e-12, target_err
torch.testing.assert_close(wrong.sum(-1), torch.full((T,), float(TP), dtype=dtype))
# two real gloo ranks equal the single process, in both stages
for stage, errs in nb_errors.items():
    assert errs.pop("top-k identical"), stage
    assert all(e < 1e-10 for e in errs.values()), (stage, errs)
print("all checks passed")
