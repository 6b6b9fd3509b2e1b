# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 4.2 — Context parallelism
#
# At 128K tokens one GPU cannot hold a layer's activations, so the tokens are spread over
# `cp_size` ranks. A rank keeps its **queries** local but needs every **key** its queries may
# see. DSA makes the keys small: one latent row (576 numbers) and one indexer key (128 numbers)
# per token. So `dsa_ref.context_parallel` simply **all-gathers** them, instead of passing 128
# heads of K and V around a ring. This notebook
#
# 1. draws the zigzag split, rank by rank, and checks the ownership formula;
# 2. shows each rank's key windows: local queries, global keys;
# 3. measures the causal work per rank, contiguous vs zigzag, and why zigzag balances it exactly;
# 4. emulates the all-gather and the reorder in one process;
# 5. runs the layer on **two real gloo processes** and compares with the single-process run;
# 6. works out the loss scale and the bytes per token at DeepSeek-V3.2 scale;
#
# and ends with assertions.

# %%
import matplotlib.pyplot as plt
import numpy as np
import torch

from dsa_ref import DSAttention, cp_shard_index, deepseek_v32, key_windows, positions, tiny, window_mask
from dsa_ref.context_parallel import global_order
from dsa_ref.notebook_helpers import run_gloo_demo

torch.set_num_threads(1)
dtype = torch.float64
cfg = tiny()
RANK_COLORS = np.array(plt.get_cmap("tab10").colors)


def pack(lengths):
    """cu_seqlens of a pack."""
    return torch.tensor([0] + list(lengths)).cumsum(0)


def contiguous_shard_index(cu_seqlens, cp_size, cp_rank):
    """The naive split, for comparison: every sequence cut into cp_size equal pieces, rank r takes piece r."""
    pieces = []
    for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        n = (b - a) // cp_size
        pieces.append(torch.arange(a + cp_rank * n, a + (cp_rank + 1) * n))
    return torch.cat(pieces)


def owners(shard_fn, cu_seqlens, cp_size):
    """Which rank owns each token: int [T]."""
    own = torch.full((int(cu_seqlens[-1]),), -1)
    for r in range(cp_size):
        own[shard_fn(cu_seqlens, cp_size, r)] = r
    return own


# %% [markdown]
# ## 1. The zigzag split

# %% [markdown]
# Causal attention is lopsided: the last query of a sequence sees every key, the first sees one.
# Cutting a sequence into `cp_size` contiguous pieces gives the last rank almost all the work.
# The zigzag split cuts every sequence of length $L$ into $2\,\mathrm{cp}$ chunks of
# $c = L / (2\,\mathrm{cp})$ tokens and gives rank $r$ chunks $r$ and $2\,\mathrm{cp} - 1 - r$: one
# cheap chunk from the front and one expensive chunk from the back. A token at position $p$ of its
# sequence lies in chunk $j = \lfloor p / c \rfloor$ and belongs to
#
# $$
# \mathrm{owner}(j) = \min\big(j,\; 2\,\mathrm{cp} - 1 - j\big), \qquad j = 0, \dots, 2\,\mathrm{cp} - 1 .
# $$
#
# Every sequence is split on its own, so every sequence length must divide by $2\,\mathrm{cp}$
# (pad it otherwise; `cp_shard_index` raises a `ValueError` naming the sequences that do not).

# %%
CP = 4
lengths = [16, 32]
cu = pack(lengths)
T = int(cu[-1])
own_zig = owners(cp_shard_index, cu, CP)
own_con = owners(contiguous_shard_index, cu, CP)

# the ownership formula, token by token
pos = positions(cu)
L_of = torch.tensor(lengths).repeat_interleave(torch.tensor(lengths))
chunk = pos // (L_of // (2 * CP))
formula = torch.where(chunk < CP, chunk, 2 * CP - 1 - chunk)
print("formula == cp_shard_index ownership:", torch.equal(formula, own_zig))
for r in range(CP):
    print(f"rank {r} owns (local order)", cp_shard_index(cu, CP, r).tolist())

fig, axes = plt.subplots(2, 1, figsize=(12, 2.9))
for ax, own, name in ((axes[0], own_con, "contiguous"), (axes[1], own_zig, "zigzag")):
    ax.imshow(RANK_COLORS[own.numpy()][None], aspect="auto", interpolation="nearest")
    for c in cu.tolist():
        ax.axvline(c - 0.5, color="black", lw=2.5)
    for t in range(T):
        ax.text(t, 0, str(int(own[t])), ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks([])
    ax.set_ylabel(name, rotation=0, ha="right", va="center")
axes[1].set_xlabel("packed token index (thick lines: sequence boundaries; digit: owning rank)")
axes[0].set_title(f"who owns which token, cp = {CP}, sequences of {lengths} tokens", fontsize=10)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 2. Local queries, global keys

# %% [markdown]
# A rank holds the tokens `query_index = cp_shard_index(cu, cp, r)`, in that order. Their windows
# are the windows of the full run, in the index space of the **global** packed keys:
#
# $$
# W_i = [\mathrm{start}(q_i),\, q_i + 1),
# $$
#
# where $q_i$ is `query_index[i]`, the global index of local query $i$: that is
# `key_windows(cu, query_index)`. The picture shows each rank's rows: a rank's queries
# reach back over every earlier key of their sequence, whoever owns it. That is why each rank
# needs the keys of all ranks.

# %%
fig, axes = plt.subplots(1, CP, figsize=(15, 3.6))
for r, ax in enumerate(axes):
    qi = cp_shard_index(cu, CP, r)
    s, e = key_windows(cu, qi)
    m = window_mask(s, e, T)                           # [T / cp, T]
    img = np.ones((*m.shape, 3))
    img[m.numpy()] = RANK_COLORS[r]
    img[~m.numpy() & (own_zig[None, :] == r).expand_as(m).numpy()] = 0.9   # keys this rank owns
    ax.imshow(img, aspect="auto", interpolation="nearest")
    ax.set_title(f"rank {r}: {qi.numel()} queries, {int((e - s).sum())} pairs", fontsize=10)
    ax.set_xlabel("global key index")
    ax.set_yticks(range(qi.numel()))
    ax.set_yticklabels(qi.tolist(), fontsize=6)
axes[0].set_ylabel("local query (global index)")
plt.tight_layout()
plt.show()


# %% [markdown]
# ## 3. Causal work per rank

# %% [markdown]
# The work of a query is the size of its window (the indexer scores every key of it; dense
# attention reads every key of it). Chunk $j$ of a sequence holds queries $jc, \dots, jc + c - 1$, so
# its work is
#
# $$
# w_j = \sum_{i=0}^{c-1} (jc + i + 1) = j c^2 + \tfrac{c(c+1)}{2} .
# $$
#
# Zigzag gives rank $r$ the chunks $r$ and $2\,\mathrm{cp} - 1 - r$, whose indices always add up to
# $2\,\mathrm{cp} - 1$:
#
# $$
# w_r + w_{2\mathrm{cp}-1-r} = (2\,\mathrm{cp} - 1)\,c^2 + c(c+1) \quad \text{for every } r ,
# $$
#
# exactly balanced. The contiguous split gives rank $r$ chunks $2r$ and $2r + 1$, i.e.
# $(4r + 1)c^2 + c(c+1)$, which grows with $r$; the last rank does $(2\,\mathrm{cp} - 1)/\mathrm{cp}$
# times the mean for long sequences, close to 2. (The sparse attention itself reads
# $\min(\lvert W_t\rvert, k)$ keys per query, nearly the same for every query once $t \ge k$; the indexer is
# where the causal imbalance lives. Its small imbalance in the plot is rank 0 holding the first
# $k$ tokens, whose windows are shorter than $k$, in either layout; it shrinks as $L / k$ grows.)

# %%
def work_per_rank(shard_fn, cu_seqlens, cp_size, topk=None):
    """Per rank: the sum over its queries of |W_t| (or of min(|W_t|, topk): sparse-attention slots)."""
    out = []
    for r in range(cp_size):
        s, e = key_windows(cu_seqlens, shard_fn(cu_seqlens, cp_size, r))
        w = e - s
        out.append(int((w if topk is None else w.clamp(max=topk)).sum()))
    return np.array(out)

L = 32768
one = pack([L])
zig, con = work_per_rank(cp_shard_index, one, CP), work_per_rank(contiguous_shard_index, one, CP)
c = L // (2 * CP)
predicted_zig = (2 * CP - 1) * c * c + c * (c + 1)
predicted_con = np.array([(4 * r + 1) * c * c + c * (c + 1) for r in range(CP)])
print(f"one sequence of {L} tokens, cp = {CP}, chunk c = {c}")
print("  zigzag     pairs per rank:", zig.tolist(), "| formula:", predicted_zig)
print("  contiguous pairs per rank:", con.tolist(), "| formula:", predicted_con.tolist())

cps = [1, 2, 4, 8, 16]
imbalance = {name: [] for name in ("contiguous", "zigzag", "contiguous, top-k slots", "zigzag, top-k slots")}
for p in cps:
    for name, fn in (("contiguous", contiguous_shard_index), ("zigzag", cp_shard_index)):
        w = work_per_rank(fn, one, p)
        imbalance[name].append(w.max() / w.mean())
        w = work_per_rank(fn, one, p, topk=2048)
        imbalance[name + ", top-k slots"].append(w.max() / w.mean())

fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
xs = np.arange(CP)
axes[0].bar(xs - 0.2, con / 1e6, 0.4, label="contiguous", color="#9e9e9e")
axes[0].bar(xs + 0.2, zig / 1e6, 0.4, label="zigzag", color=RANK_COLORS[:CP])
axes[0].axhline(zig.mean() / 1e6, color="black", ls="--", lw=1, label="mean")
axes[0].set_xticks(xs, [f"rank {r}" for r in range(CP)])
axes[0].set_ylabel("causal (query, key) pairs, millions")
axes[0].set_title(f"causal work per rank, one sequence of {L}, cp = {CP}", fontsize=10)
axes[0].legend(fontsize=8)
for name, style in (("contiguous", "o-"), ("zigzag", "s-"), ("contiguous, top-k slots", "o:"),
                    ("zigzag, top-k slots", "s:")):
    axes[1].plot(cps, imbalance[name], style, label=name)
axes[1].set_xscale("log", base=2)
axes[1].set_xticks(cps, [str(p) for p in cps])
axes[1].set_xlabel("cp")
axes[1].set_ylabel("busiest rank / mean")
axes[1].set_title(f"imbalance vs cp (L = {L}; top-k slots with k = 2048)", fontsize=10)
axes[1].legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 4. The all-gather and the reorder, emulated

# %% [markdown]
# Each rank computes the latent KV rows and indexer keys of its own tokens, with the RoPE positions
# of their place in their sequence (`positions(cu, query_index)`). `all_gather` concatenates the
# ranks' rows **in rank order**; row $j$ of the result is token `global_order(cu, cp)[j]`, so
# indexing with the inverse permutation (`argsort`) puts token $i$ at row $i$. Here the ranks are
# emulated in one process, to see that the result is the full run's KV.

# %%
torch.manual_seed(0)
layer = DSAttention(cfg, stage="sparse", dtype=dtype)
x = torch.randn(T, cfg.mla.dim, dtype=dtype, generator=torch.Generator().manual_seed(1))

def latent_rows(tokens):
    """The latent KV rows [n, 72] of the given global tokens, computed from those tokens only."""
    with torch.no_grad():
        p = layer.mla.project(x[tokens], positions(cu, tokens))
        return layer.absorbed.absorbed_qkv(p)[1]

gathered = torch.cat([latent_rows(cp_shard_index(cu, CP, r)) for r in range(CP)])  # rank order
order = global_order(cu, CP)
print("gathered row -> token:", order.tolist())
kv_global = gathered[torch.argsort(order)]
kv_full = latent_rows(torch.arange(T))
reorder_err = (kv_global - kv_full).abs().max().item()
print(f"max |reordered gather - full run| = {reorder_err:.1e}")

# %% [markdown]
# ## 5. Two real ranks over gloo

# %% [markdown]
# `tools/cp_gloo_demo.py` forks two processes that form a gloo process group (the same code runs on
# NCCL). Every rank builds the same float64 layer and pack from a seed, runs its zigzag shard through
# `cp_dsa_forward`, back-propagates a fixed linear "LM loss", all-reduces the parameter gradients
# (the weights are replicated) and compares with the single-process run. Started here with
# `--save`, it also writes its results in global token order, and the notebook repeats the
# comparison on its own. From a shell:
# `python -m torch.distributed.run --nproc-per-node 2 tools/cp_gloo_demo.py` does the same with one
# process per rank.

# %%
saved = run_gloo_demo("cp_gloo_demo.py", "--cp", "2", "--lengths", "12,4,0,32")

# %%
run = torch.load(saved, weights_only=True)
ref_layer = DSAttention(tiny(), stage=run["stage"], loss_reduction=run["reduction"], dtype=dtype)
ref_layer.load_state_dict(run["state_dict"])
cu_run = run["cu_seqlens"]
xr = run["x"].clone().requires_grad_(True)
ref = ref_layer(xr, cu_run)
(ref.output * run["w_out"]).sum().backward()

nb_errors = {
    "output": (run["output"] - ref.output.detach()).abs().max().item(),
    "x gradient": (run["x_grad"] - xr.grad).abs().max().item(),
    "parameter gradients": max((run["param_grads"][n] - p.grad).abs().max().item()
                               for n, p in ref_layer.named_parameters()),
    "indexer loss": abs(run["indexer_loss"].item() - ref.indexer_loss.item()),
}
same_topk = torch.equal(run["topk_indices"], ref.topk_indices)
for name, e in nb_errors.items():
    print(f"max |CP (2 gloo ranks) - single process| {name:<20} {e:.1e}")
print("top-k indices identical:", same_topk)

own_run = owners(cp_shard_index, cu_run, run["cp"])
fig, axes = plt.subplots(1, 2, figsize=(13, 2.8), gridspec_kw=dict(width_ratios=[3, 1]))
axes[0].imshow(RANK_COLORS[own_run.numpy()][None], aspect="auto", interpolation="nearest")
for c_ in cu_run.unique().tolist():
    axes[0].axvline(c_ - 0.5, color="black", lw=2.5)
axes[0].set_yticks([])
axes[0].set_xlabel("packed token index")
axes[0].set_title(f"the demo's pack {run['lengths']} over {run['cp']} ranks (colour = rank)", fontsize=10)
shares = run["loss_shares"].numpy()
bottom = 0.0
for r, v in enumerate(shares):
    axes[1].bar(0, v, bottom=bottom, color=RANK_COLORS[r], label=f"rank {r} share")
    bottom += v
axes[1].bar(1, ref.indexer_loss.item(), color="#616161", label="single process")
axes[1].set_xticks([0, 1], ["CP shares", "single"])
axes[1].set_title("indexer loss", fontsize=10)
axes[1].legend(fontsize=7, loc="lower right")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 6. The loss scale, and the bytes at DeepSeek-V3.2 scale

# %% [markdown]
# **Why the per-rank loss divides by the global row count.** The single-process mean loss is
# $\mathcal{L} = \frac{1}{N}\sum_{t} \mathrm{KL}_t$ over the $N$ valid rows of the whole pack. Rank
# $r$ holds rows $R_r$ and computes $\mathcal{L}_r = \frac{1}{N}\sum_{t \in R_r} \mathrm{KL}_t$
# ($N$ comes from one all-reduce of a count), so $\sum_r \mathcal{L}_r = \mathcal{L}$: the shares in
# the bar chart add up to the single-process loss, and the gradients of the replicated weights,
# **summed** over ranks, are the single-process gradients. Dividing by the local row count instead
# would weigh every rank equally, right only when all ranks hold the same number of valid rows.
#
# **Megatron's convention.** Megatron *averages* gradients over the DP $\times$ CP group. An average
# over the cp ranks of one sequence divides the sum by cp, so both losses must be multiplied by cp
# to compensate: the LM loss, and the indexer loss through its scale
# (`set_indexer_loss_scale(model, cp_size / num_microbatches)`, what Megatron's schedule sets).

# %%
cp_run = run["cp"]
g_sum = run["param_grads"]["indexer.wk.weight"]          # the sum over ranks (what dsa_ref's test checks)
g_avg = g_sum / cp_run                                    # what an average over the CP group gives
g_single = dict(ref_layer.named_parameters())["indexer.wk.weight"].grad
print(f"sum over ranks / single process:          {(g_sum / g_single).nanmean().item():.6f}")
print(f"average over ranks / single process:      {(g_avg / g_single).nanmean().item():.6f}")
print(f"cp x average over ranks / single process: {(cp_run * g_avg / g_single).nanmean().item():.6f}")

big = deepseek_v32()
allgather_values = big.mla.latent_dim + big.indexer.head_dim                # 576 + 128
ring_values = big.mla.n_heads * (big.mla.qk_head_dim + big.mla.v_head_dim)  # 128 * (192 + 128)
print(f"\nper token, bf16: all-gather {allgather_values} values = {2 * allgather_values} B;"
      f" ring attention K+V {ring_values} values = {2 * ring_values} B;"
      f" ratio {ring_values / allgather_values:.1f}x")
N = 128 * 1024
for p in (2, 4, 8, 16):
    ag = (p - 1) / p * N * 2 * allgather_values
    ring = (p - 1) / p * N * 2 * ring_values
    print(f"cp = {p:2d}: received per rank per layer (forward): all-gather {ag / 2**20:7.1f} MiB,"
          f" ring {ring / 2**30:6.3f} GiB")

# %% [markdown]
# The documentation page "Context parallelism at scale" (`docs/chapters/04_3_cp_at_scale.md`) works
# these numbers out for cp = 1 to 16: communication, memory, FLOPs and the balance of causal work,
# against ring attention.

# %% [markdown]
# ## Checks

# %%
# zigzag ownership: the formula, equal token counts, exact balance; contiguous is lopsided
assert torch.equal(formula, own_zig) and (own_zig >= 0).all() and (own_con >= 0).all()
assert all((own_zig == r).sum() == T // CP for r in range(CP))
assert (zig == predicted_zig).all() and (con == predicted_con).all()
assert imbalance["zigzag"] == [1.0] * len(cps)
assert abs(imbalance["contiguous"][cps.index(4)] - 7 / 4) < 1e-3
assert all(i > 1.0 for i in imbalance["contiguous"][1:])
# the all-gather in rank order + argsort is the global KV
assert sorted(order.tolist()) == list(range(T)) and reorder_err < 1e-12
# two real gloo ranks equal the single process
assert all(e < 1e-10 for e in nb_errors.values()), nb_errors
assert same_topk
assert abs(shares.sum() - ref.indexer_loss.item()) < 1e-12
# loss scale: summed gradients are the single-process ones; an average needs a factor cp
torch.testing.assert_close(g_sum, g_single, rtol=1e-9, atol=1e-12)
torch.testing.assert_close(cp_run * g_avg, g_single, rtol=1e-9, atol=1e-12)
# bytes per token at DeepSeek-V3.2 shapes
assert (allgather_values, ring_values) == (704, 40960)
print("all checks passed")
