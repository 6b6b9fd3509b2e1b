# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 3.1 — The lightning indexer and top-k selection
#
# DeepSeek Sparse Attention lets each query attend to only $k$ keys (2048 in DeepSeek-V3.2). A
# second, much cheaper scorer decides which: the **lightning indexer**. For query $t$ and key $s$
#
# $$
# I_{t,s} = \sum_{j=1}^{H_I} w_{t,j}\,\operatorname{ReLU}\!\left(q_{t,j}\cdot k_s\right),
# $$
#
# with $H_I$ indexer heads of width $D_I$ (64 and 128 in DeepSeek-V3.2), one key $k_s$ per token
# shared by every indexer head, and one weight $w_{t,j}$ per query and head. Each query then keeps
# the $k$ keys of its window with the highest $I_{t,s}$.
#
# This notebook looks at:
#
# 1. the score matrix $I$ over a causal sequence, beside the main attention it should predict;
# 2. what the ReLU and the signed head weights do to the scores;
# 3. the top-k selection drawn as a matrix;
# 4. how much of the main attention a top-k set covers, as $k$ grows;
# 5. the tie rule, on a row small enough to read.
#
# It ends with checks against `dsa_ref`. Everything runs on the `tiny()` config in a few seconds.

# %%
import copy
import time
from dataclasses import replace

import matplotlib.pyplot as plt
import torch
from matplotlib.colors import ListedColormap

import dsa_ref
from dsa_ref import (DSAttention, LightningIndexer, dense_mla_attention, indexer_loss, key_windows,
                     lightning_indexer, positions, set_indexer_loss_scale, sparse_mla, tiny, topk_indices,
                     window_mask)
from dsa_ref.indexer_loss import indexer_logit_grad, indexer_target
from dsa_ref.notebook_helpers import indexer_scores, look_inside, mass_covered, sharpened_layer, toy_tokens

ON_GPU = torch.cuda.is_available()
device = torch.device("cuda" if ON_GPU else "cpu")
if not ON_GPU:
    torch.set_num_threads(1)  # the tensors are tiny: more threads only add synchronisation
cfg = tiny()  # the tiny layer on both; a GPU only gets longer sequences and more training
print(f"device={device}")
print(cfg.indexer)

# %% [markdown]
# The indexer reads MLA's normalised query latent `qr`, so it lives inside a whole DSA layer. We
# build one with two changes that give the indexer something worth predicting. A freshly
# initialised MLA spreads its attention almost evenly over the window, which a trained model does
# not do, so the query and key up-projections are scaled by 3. And the hidden states are
# embeddings of tokens from a toy vocabulary of 32, so that patterns repeat.

# %%
SHARPEN = 3.0  # a fresh MLA attends almost uniformly; a trained one does not
VOCAB = 32     # inputs are embeddings of a toy vocabulary, so patterns repeat and can be learned
vocab = torch.randn(VOCAB, cfg.mla.dim, generator=torch.Generator().manual_seed(123)).to(device)


def make_layer(seed=0):
    """A tiny DSA layer with its main attention sharpened (query and key up-projections x SHARPEN)."""
    return sharpened_layer(cfg, seed=seed, sharpen=SHARPEN, device=device)


def tokens(n, generator):
    """n hidden states: embeddings of random tokens of the toy vocabulary, [n, dim]."""
    return toy_tokens(vocab, n, generator)


layer = make_layer(seed=0)
gen = torch.Generator().manual_seed(1)
T = 48
cu = torch.tensor([0, T], device=device)  # one causal sequence
v = look_inside(layer, tokens(T, gen), cu)
for name in ("qr", "q_i", "k_i", "w_i", "target"):
    print(f"{name:<7}{str(list(v[name].shape)):<14}{v[name].dtype}")

# %% [markdown]
# ## 1. The score matrix

# %% [markdown]
# `lightning_indexer(q, k, weights, starts=..., ends=...)` returns $I$ as a float32 `[T, S]`
# matrix, with $-\infty$ outside each query's key window $[\mathrm{starts}_t, \mathrm{ends}_t)$. For
# one causal sequence the window of query $t$ is keys $0..t$, so the finite scores form the lower
# triangle. Beside it is the target the indexer is trained towards (chapter 3.2): the main
# attention's probabilities summed over heads and normalised over the window, $p_{t,s}$.

# %%
scores = lightning_indexer(v["q_i"], v["k_i"], v["w_i"], starts=v["starts"], ends=v["ends"])
inside = window_mask(v["starts"], v["ends"], T)
print("scores", list(scores.shape), scores.dtype, "| finite exactly inside the windows:",
      bool((torch.isfinite(scores) == inside).all()))

def show(ax, matrix, title, cmap, symmetric):
    img = matrix.detach().double().cpu().clone()
    img[~inside.cpu()] = float("nan")  # outside the window: drawn in grey
    cm = plt.get_cmap(cmap).copy()
    cm.set_bad("#eeeeee")
    if symmetric:
        lim = float(img.nan_to_num(0).abs().max())
        im = ax.imshow(img, cmap=cm, vmin=-lim, vmax=lim, interpolation="nearest")
    else:
        im = ax.imshow(img, cmap=cm, interpolation="nearest")
    ax.set_xlabel("key s")
    ax.set_ylabel("query t")
    ax.set_title(title, fontsize=10)
    plt.colorbar(im, ax=ax, fraction=0.046)

fig, axes = plt.subplots(1, 2, figsize=(11, 4.6))
show(axes[0], scores, "indexer scores $I_{t,s}$ (untrained)", "RdBu_r", True)
show(axes[1], v["target"].clamp_min(1e-6).log10(), "main attention target $\\log_{10} p_{t,s}$",
     "viridis", False)
plt.tight_layout()
plt.show()

def row_correlation(a, b, keep):
    """Mean over queries with at least 8 keys of the Pearson correlation of a and b on the window."""
    out = []
    for t in range(a.shape[0]):
        if keep[t].sum() >= 8:
            out.append(torch.corrcoef(torch.stack([a[t][keep[t]], b[t][keep[t]]]).double())[0, 1])
    return torch.stack(out).mean().item()

print(f"mean correlation of I and log p per query: {row_correlation(scores, v['target'].clamp_min(1e-30).log(), inside):+.3f}")


# %% [markdown]
# The untrained indexer's scores have nothing to do with where the main attention looks. Its
# picture is made of horizontal bands: the head weights $w_{t,j}$ of query $t$ scale (and may flip)
# its whole row. The correlation between $I_{t,:}$ and $\log p_{t,:}$ over each window, averaged
# over the queries, is close to zero; the dense warm-up of chapter 3.2 is what changes that.
#
# The function is short enough to check by hand: one einsum for all heads' dot products, the ReLU,
# a weighted sum over heads, and the window mask.

# %%
def indexer_by_hand(q, k, w, starts, ends):
    logits = torch.einsum("tjd,sd->tjs", q.double(), k.double())         # [T, H_I, S]
    scores = torch.einsum("tjs,tj->ts", logits.relu(), w.double())      # [T, S]
    keep = window_mask(starts, ends, k.shape[0])
    return scores.masked_fill(~keep, float("-inf"))

by_hand = indexer_by_hand(v["q_i"], v["k_i"], v["w_i"], v["starts"], v["ends"])
err = (scores.double() - by_hand)[inside].abs().max().item()
print(f"max |lightning_indexer - by hand| inside the windows: {err:.2e}")

# %% [markdown]
# Two details of the inputs, both from DeepSeek-V3.2's code, are easy to miss:
#
# * the head weights $w_{t,j}$ are an unactivated linear map of $x_t$, computed in float32, with the
#   constant $H_I^{-1/2} D_I^{-1/2}$ folded in; nothing keeps them positive;
# * $q$ and $k$ go through RoPE (half-split layout, on the first $d_r$ dims) and then, optionally,
#   through the same orthonormal Hadamard matrix $\mathcal{H}$. Because
#   $(\mathcal{H} q)\cdot(\mathcal{H} k) = q\cdot k$ the rotation changes no score in exact
#   arithmetic; it exists to spread outliers before fp8 quantisation. Turning it off changes the
#   scores only by float rounding:

# %%
cfg_plain = replace(cfg, indexer=replace(cfg.indexer, use_hadamard=False))
plain = LightningIndexer(cfg_plain).to(device)
plain.load_state_dict(layer.indexer.state_dict())  # the same weights, no rotation
scores_plain = indexer_scores(plain, v)
print(f"max |scores without Hadamard - scores with it| = {(scores_plain - scores)[inside].abs().max().item():.2e}"
      f"  (scores themselves reach {scores[inside].abs().max().item():.2f})")

# %% [markdown]
# ## 2. The ReLU and the signed head weights

# %% [markdown]
# Each head $j$ casts a vote $w_{t,j}\operatorname{ReLU}(q_{t,j}\cdot k_s)$ for key $s$. The ReLU
# makes every vote one-sided: a head either fires on a key (positive dot product) or says nothing;
# it can never argue *against* a key because the key points away from its query. The sign of the
# vote comes from the weight alone, so a head with $w_{t,j} < 0$ is a head whose matches this query
# wants to avoid.
#
# A consequence: a key on which no head with a non-zero weight fires scores **exactly** 0. With
# only a few heads that happens often, which is one reason the tie rule of section 5 matters.

# %%
logits = torch.einsum("tjd,sd->tjs", v["q_i"].double(), v["k_i"].double())  # [T, H_I, S]
in3 = inside[:, None, :].expand_as(logits)
print(f"q.k <= 0, so ReLU gives exactly 0:  {(logits[in3] <= 0).double().mean():.1%} of (t, j, s) in the windows")
print(f"negative head weights w[t, j]:      {(v['w_i'] < 0).double().mean():.1%}")
print(f"scores I[t, s] exactly 0:           {(scores[inside] == 0).double().mean():.1%} of window entries")

t0 = T - 1
votes = (v["w_i"][t0, :, None].double() * logits[t0].relu()).cpu()  # [H_I, S]: head j's vote for key s
fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
keys = torch.arange(T)
for j in range(votes.shape[0]):
    axes[0].plot(keys, votes[j], lw=1, marker=".", ms=3,
                 label=f"head {j}, w = {v['w_i'][t0, j].item():+.3f}")
axes[0].plot(keys, scores[t0].cpu(), color="black", lw=2, label="$I_{t,s}$ = sum of the votes")
axes[0].axhline(0, color="grey", lw=0.5)
axes[0].set_xlabel("key s")
axes[0].set_title(f"the votes of each indexer head, query t = {t0}", fontsize=10)
axes[0].legend(fontsize=7.5, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.16))
finite = scores[inside].cpu()
axes[1].hist(finite[finite != 0], bins=60, color="#3949ab", label="non-zero scores")
axes[1].axvline(0, color="#e65100", lw=2, label=f"exactly 0: {(finite == 0).sum().item()} entries")
axes[1].set_xlabel("$I_{t,s}$ inside the windows")
axes[1].set_title("distribution of the scores", fontsize=10)
axes[1].legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 3. Top-k over a causal sequence

# %% [markdown]
# `topk_indices(scores, k)` keeps, per query, the $k$ best keys of its window: highest score first,
# ties to the lower key index, never a $-\infty$ key, and `-1` in the slots a short window cannot
# fill. The picture shows every query's selection for $k = 8$ (the `tiny()` value). All heads of
# a query share one selection.

# %%
k_top = cfg.indexer.topk
idx = topk_indices(scores, k_top)  # [T, k], int64
print("first rows:\n", idx[:10].cpu())
pic = inside.long().cpu().clone()        # 0 = outside the window, 1 = in the window
rows = torch.arange(T)[:, None].expand(T, k_top)
used = (idx >= 0).cpu()
pic[rows[used], idx.cpu()[used]] = 2     # 2 = selected
fig, axes = plt.subplots(1, 2, figsize=(11.5, 4.6), gridspec_kw=dict(width_ratios=[1.25, 1]))
axes[0].imshow(pic, cmap=ListedColormap(["#ffffff", "#dde3f0", "#3949ab"]), interpolation="nearest")
axes[0].plot(range(T), range(T), color="#e65100", lw=0.8, label="diagonal s = t")
axes[0].set_xlabel("key s")
axes[0].set_ylabel("query t")
axes[0].set_title(f"selected keys (dark) within the causal window (light), k = {k_top}", fontsize=10)
axes[0].legend(fontsize=8, loc="upper right")
valid_slots = (idx >= 0).sum(dim=1).cpu()
axes[1].plot(valid_slots, label="valid slots per row")
axes[1].plot((v["ends"] - v["starts"]).cpu(), "--", label="window size t + 1")
axes[1].set_ylim(0, 2 * k_top)
axes[1].set_xlabel("query t")
axes[1].legend(fontsize=8)
axes[1].set_title("the first k rows select their whole window", fontsize=10)
plt.tight_layout()
plt.show()
print(f"rows that select their own token (the diagonal): {(idx == torch.arange(T, device=device)[:, None]).any(1).sum().item()} of {T}")

# %% [markdown]
# Three things to notice. The first $k$ queries have at most $k$ keys in their window, so they keep
# all of them and pad with `-1`: for them sparse attention *is* dense attention. Nothing forces a
# query to select itself or its neighbours; DeepSeek-V3.2's indexer has no local window, and
# whether the diagonal is selected depends only on the scores. And the selection of an untrained
# indexer is scattered: it has not yet learned where the main attention looks.

# %% [markdown]
# ## 4. How much attention a top-k set covers

# %% [markdown]
# Sparse attention can only be as good as the keys it is given. A useful measure is the **recall
# of attention mass**: the part of the target $p_{t,:}$ (the head-summed, normalised main attention)
# that falls on the selected set $S_t$,
#
# $$
# \operatorname{recall}_t(k) = \sum_{s \in S_t} p_{t,s}, \qquad |S_t| = k .
# $$
#
# It is 1 when the set covers everything the main attention looks at. The best possible set is
# the $k$ largest entries of $p_{t,:}$ itself (the "oracle"); a scorer that is only correlated with
# $p$ does worse. Below: the oracle, two noisy copies of it ($\log p + \sigma\varepsilon$ with
# Gaussian $\varepsilon$), the untrained indexer, and keys chosen at random, averaged over queries
# whose window holds more keys than the largest $k$ shown.

# %%
T_long = 1024 if ON_GPU else 256
cu_long = torch.tensor([0, T_long], device=device)
vl = look_inside(layer, tokens(T_long, gen), cu_long)
p = vl["target"]
inside_long = window_mask(vl["starts"], vl["ends"], T_long)
ks = [1, 2, 4, 8, 16, 32, 64, 128]
rows_long = (vl["ends"] - vl["starts"]) > max(ks)   # queries with more than 128 keys
noise = torch.randn(p.shape, generator=torch.Generator().manual_seed(2)).to(device)
log_p = torch.where(inside_long, p.clamp_min(1e-30).log(), torch.tensor(float("-inf"), device=device))
untrained = lightning_indexer(vl["q_i"], vl["k_i"], vl["w_i"], starts=vl["starts"], ends=vl["ends"])
scorers = {
    "oracle: top-k of p": log_p,
    "log p + noise, sigma = 1": log_p + noise,
    "log p + noise, sigma = 3": log_p + 3 * noise,
    "untrained indexer": untrained,
    "random keys": torch.where(inside_long, noise, torch.tensor(float("-inf"), device=device)),
}
recall = {name: [mass_covered(p, topk_indices(s, k))[rows_long].mean().item() for k in ks]
          for name, s in scorers.items()}
fig, ax = plt.subplots(figsize=(7.5, 4.2))
for name, values in recall.items():
    ax.plot(ks, values, marker="o", label=name)
ax.set_xscale("log", base=2)
ax.set_xticks(ks, [str(k) for k in ks])
ax.set_ylim(0, 1.02)
ax.set_xlabel("k (keys selected per query)")
ax.set_ylabel("mean recall of attention mass")
ax.set_title(f"queries t >= {max(ks)} of a {T_long}-token sequence", fontsize=10)
ax.grid(alpha=0.3)
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()
for name, values in recall.items():
    print(f"{name:<28} recall at k = {k_top}: {values[ks.index(k_top)]:.3f}")

# %% [markdown]
# The oracle curve is the ceiling for any indexer at this main attention: its head-summed
# attention is concentrated, so a few keys already cover much of it. Random selection covers on
# average $k$ divided by the window size. The untrained indexer is hardly better than random;
# training it (chapter 3.2) moves it up towards the oracle. A noisy copy of $\log p$
# shows how much room there is between: what matters for top-k is only the *order* of the scores
# near the top of each row.

# %% [markdown]
# ## 5. The tie rule

# %% [markdown]
# `torch.topk` does not say in which order it returns equal values, and on many rows (the exact
# zeros of section 2, a row of $-\infty$ keys) several orders are equally "correct". A reference
# that other people compare against cannot leave that open, so `dsa_ref` fixes it:
#
# * highest score first; **equal scores go to the lower key index first**;
# * $-\infty$ keys are never selected;
# * a row with fewer than $k$ selectable keys is padded with `-1` at the end.
#
# A row small enough to read: keys 1 and 3 tie at 2, keys 0, 2 and 6 tie at 0, keys 4 and 7 are
# outside the window.

# %%
inf = float("inf")
row = torch.tensor([[0.0, 2.0, 0.0, 2.0, -inf, 1.0, 0.0, -inf]])
for k in (4, 8):
    print(f"k = {k}: dsa_ref.topk_indices -> {topk_indices(row, k).tolist()[0]}")
    print(f"       torch.topk            -> {torch.topk(row, k).indices.tolist()[0]}   (may include -inf keys)")
zeros = torch.zeros(1, 64)
print("64 equal scores, k = 8:")
print("  dsa_ref.topk_indices ->", topk_indices(zeros, 8).tolist()[0])
print("  torch.topk           ->", torch.topk(zeros, 8).indices.tolist()[0], "(unspecified order)")

# %% [markdown]
# The rule is implemented with one stable descending sort: a stable sort never reorders equal
# values, so among equal scores the lower index comes first. A fast kernel may break ties
# differently and still be right; compare it with the oracle through the multiset of selected
# *scores* per row, which is the same for every valid tie-break, rather than through the raw
# indices.

# %%
mine = topk_indices(row, 4)
other = torch.tensor([[3, 1, 5, 6]])  # a different but valid tie-break: key 6 instead of key 0
same_scores = torch.equal(row.gather(1, mine).sort(dim=1).values, row.gather(1, other).sort(dim=1).values)
print("selected indices differ:", mine.tolist()[0], "vs", other.tolist()[0], "| same selected scores:", same_scores)


# %% [markdown]
# ## 6. Checks

# %%
def topk_by_hand(scores, k):
    """The tie rule written out: sort keys by (-score, index), drop -inf keys, pad with -1."""
    out = []
    for r in scores.tolist():
        order = sorted((s for s in range(len(r)) if r[s] != float("-inf")), key=lambda s: (-r[s], s))[:k]
        out.append(order + [-1] * (k - len(order)))
    return torch.tensor(out, dtype=torch.int64)

# lightning_indexer is the formula, -inf exactly outside the windows
torch.testing.assert_close(scores.double()[inside], by_hand[inside], rtol=1e-5, atol=1e-6)
assert scores.dtype == torch.float32
assert torch.all(torch.isneginf(scores[~inside])) and torch.all(torch.isfinite(scores[inside]))
# the Hadamard rotation changes no score beyond rounding
torch.testing.assert_close(scores_plain, scores, rtol=1e-4, atol=1e-5)
# ReLU: exact zeros exist, and a score is a sum of non-negative terms times signed weights
assert (scores[inside] == 0).any() and (v["w_i"] < 0).any() and (v["w_i"] > 0).any()
# top-k follows the tie rule, on the real scores and on the hand-made rows
assert torch.equal(idx.cpu(), topk_by_hand(scores.cpu(), k_top))
untrained_idx = topk_indices(untrained, k_top)
assert torch.equal(untrained_idx.cpu(), topk_by_hand(untrained.cpu(), k_top))
assert topk_indices(row, 4).tolist() == [[1, 3, 5, 0]]
assert topk_indices(row, 8).tolist() == [[1, 3, 5, 0, 2, 6, -1, -1]]
assert topk_indices(zeros, 8).tolist() == [list(range(8))]
assert topk_indices(torch.full((1, 5), -inf), 3).tolist() == [[-1, -1, -1]]
# short windows: min(window, k) valid slots, all -1 after them, never a key outside the window
window = vl["ends"] - vl["starts"]
assert torch.equal((untrained_idx >= 0).sum(1), window.clamp(max=k_top))
in_window = (untrained_idx >= vl["starts"][:, None]) & (untrained_idx < vl["ends"][:, None])
assert torch.all((untrained_idx == -1) | in_window)
assert torch.all(untrained_idx[:, 1:][untrained_idx[:, :-1] == -1] == -1)  # -1 only at the end
# recall: grows with k, the oracle is the best possible, and the whole window covers everything
for name, values in recall.items():
    assert all(a <= b + 1e-6 for a, b in zip(values, values[1:])), name
    assert all(o >= r - 1e-6 for o, r in zip(recall["oracle: top-k of p"], values)), name
full = mass_covered(p, topk_indices(untrained, T_long))
torch.testing.assert_close(full, torch.ones_like(full))
assert recall["oracle: top-k of p"][ks.index(k_top)] > 2 * recall["random keys"][ks.index(k_top)]
print("all checks passed")
