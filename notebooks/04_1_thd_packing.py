# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 4.1 — Packed sequences (THD)
#
# Training data comes as documents of very different lengths. Padding each to the longest wastes
# compute, so the tokens of several documents are **packed** end to end into one token dimension
# (the "THD" layout: tokens, heads, dim) and a vector `cu_seqlens` records where each document
# starts. A pack of $N$ sequences of lengths $L_0, \dots, L_{N-1}$ has
#
# $$
# \mathrm{cu}_0 = 0, \qquad \mathrm{cu}_{i+1} = \mathrm{cu}_i + L_i, \qquad T = \mathrm{cu}_N .
# $$
#
# Packing is only correct if no token can see another document. In `dsa_ref` every mask is a
# **key window**: query $t$ may use key $s$ iff $s \in W_t = [\mathrm{start}(t),\, t + 1)$, where
# $\mathrm{start}(t)$ is the first token of $t$'s sequence. This notebook
#
# 1. builds the windows and RoPE positions of a pack;
# 2. draws the windows as a block-diagonal picture, beside the plain causal mask;
# 3. shows what leaks through a plain causal mask in a DSA layer, and that the windows stop it;
# 4. checks that the other documents do not change by a single bit when one document changes;
# 5. separates two things often confused: restarting RoPE positions and isolating documents;
# 6. treats a padded batch as a pack, and looks at the loss reduction and the top-k slots;
#
# and ends with assertions. It runs on the `tiny()` config on a CPU in a few seconds.

# %%
import matplotlib.pyplot as plt
import numpy as np
import torch

from dsa_ref import DSAttention, dense_mla_attention, key_windows, positions, tiny, window_mask
from dsa_ref.layout import one_sequence, sequence_ids

torch.set_num_threads(1)  # tiny tensors: more threads only add synchronisation
dtype = torch.float64     # float64, so "equal" can mean 1e-12 (or bit for bit)
cfg = tiny()
TOPK = cfg.indexer.topk   # 8

# one pack: shorter than, equal to and longer than top-k, a single token, and an empty sequence
lengths = [5, 8, 1, 12, 0, 6]
cu_seqlens = torch.tensor([0] + lengths).cumsum(0)
T = int(cu_seqlens[-1])
seqs = [(a, b) for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()) if b > a]
# sequence colours: tab10 without its red (red marks leaks below) and grey
SEQ_COLORS = np.array(plt.get_cmap("tab10").colors)[[0, 1, 2, 4, 5, 6, 8, 9]]
print(f"lengths {lengths}, cu_seqlens {cu_seqlens.tolist()}, T = {T}, top-k = {TOPK}")

# %% [markdown]
# ## 1. Windows and positions of a pack

# %% [markdown]
# `key_windows(cu_seqlens)` gives two int64 vectors, `starts` and `ends`, with
# $W_t = [\mathrm{starts}_t, \mathrm{ends}_t)$; `positions(cu_seqlens)` gives each token's RoPE
# position inside its own sequence, $t - \mathrm{start}(t)$. Writing $\sigma(t)$ for the sequence
# of token $t$ (the last $i$ with $\mathrm{cu}_i \le t$):
#
# $$
# \mathrm{start}(t) = \mathrm{cu}_{\sigma(t)}, \qquad \mathrm{end}(t) = t + 1, \qquad
# \mathrm{pos}(t) = t - \mathrm{cu}_{\sigma(t)} .
# $$
#
# The empty sequence (length 0) owns no token; it shows up only as a repeated value in
# `cu_seqlens`.

# %%
seq = sequence_ids(cu_seqlens)
pos = positions(cu_seqlens)
starts, ends = key_windows(cu_seqlens)
for name, v in (("sequence", seq), ("position", pos), ("starts", starts), ("ends", ends)):
    print(f"{name:<9}", " ".join(f"{int(i):2d}" for i in v))

# %% [markdown]
# ## 2. The windows as a picture

# %% [markdown]
# Drawn as a matrix (query $t$ down, key $s$ across), the windows of a pack are lower triangles on
# the diagonal, one per sequence: a **block-diagonal** causal mask. A plain causal mask over the
# whole pack, $s \le t$, is the full lower triangle. The difference, in red on the right, is every
# pair in which a query would look into an earlier document.

# %%
inside = window_mask(starts, ends, T)                           # [T, T] bool: the windows
causal = window_mask(*key_windows(one_sequence(T)), T)          # plain causal over the pack
leak = causal & ~inside

def draw(ax, mask, title, red=None):
    img = np.ones((T, T, 3))
    img[mask.numpy()] = SEQ_COLORS[seq.numpy() % len(SEQ_COLORS)][:, None, :].repeat(T, 1)[mask.numpy()]
    if red is not None:
        img[red.numpy()] = (0.85, 0.1, 0.1)
    ax.imshow(img, interpolation="nearest")
    for c in cu_seqlens.unique().tolist():
        ax.axhline(c - 0.5, color="0.4", lw=0.6)
        ax.axvline(c - 0.5, color="0.4", lw=0.6)
    ax.set_xlabel("key s")
    ax.set_ylabel("query t")
    ax.set_title(title, fontsize=10)

fig, axes = plt.subplots(1, 2, figsize=(11, 5.2))
draw(axes[0], inside, "key windows of the pack: block-diagonal causal")
draw(axes[1], causal, f"plain causal mask: {int(leak.sum())} cross-document pairs (red)", red=leak)
plt.tight_layout()
plt.show()
print(f"pairs inside the windows: {int(inside.sum())}, plain causal pairs: {int(causal.sum())}")

# %% [markdown]
# ## 3. What leaks through a plain causal mask

# %% [markdown]
# A DSA layer has **two** places where a document can see another: the indexer scores every key
# of the window and the top-k picks among them, and the main attention then reads the picked keys.
# With a plain causal mask both leak. We build a small layer whose MLA weights are scaled by 3
# (a fresh layer spreads its attention almost evenly; a trained one does not) and run it three
# ways: packed with `cu_seqlens`, packed *without* it (one causal sequence of $T$ tokens), and each
# sequence on its own.

# %%
torch.manual_seed(0)
layer = DSAttention(cfg, stage="sparse", dtype=dtype)
with torch.no_grad():
    for p in layer.mla.parameters():
        if p.dim() == 2:
            p.mul_(3.0)
x = torch.randn(T, cfg.mla.dim, dtype=dtype, generator=torch.Generator().manual_seed(1))

with torch.no_grad():
    packed = layer(x, cu_seqlens)       # windows of the pack
    leaky = layer(x)                    # no cu_seqlens: one causal sequence
    alone = [layer(x[a:b]) for a, b in seqs]

err_packed = [(packed.output[a:b] - r.output).abs().max().item() for (a, b), r in zip(seqs, alone)]
err_leaky = [(leaky.output[a:b] - r.output).abs().max().item() for (a, b), r in zip(seqs, alone)]
picked_outside = [int(((leaky.topk_indices[a:b] >= 0) & (leaky.topk_indices[a:b] < a)).sum()) for a, b in seqs]
for (a, b), e1, e2, n in zip(seqs, err_packed, err_leaky, picked_outside):
    print(f"sequence [{a:2d}, {b:2d}): max |packed - alone| {e1:.1e}   max |plain causal - alone| {e2:.1e}"
          f"   keys picked from earlier documents {n}")

# %% [markdown]
# How much of the main attention lands in other documents under the plain mask? For every query we
# add up the softmax probability (averaged over heads) that falls on keys of an earlier document.
# The first sequence has nothing before it; every later one spends part of its attention on
# strangers.

# %%
with torch.no_grad():
    p_all = layer.mla.project(x, positions(one_sequence(T)))   # what the leaky run computes
    q, kv = layer.absorbed.absorbed_qkv(p_all)                 # [T, H, 72], [T, 72]
    logits = torch.einsum("thd,sd->ths", q, kv) * layer.mla.softmax_scale
    probs = logits.masked_fill(~causal[:, None, :], float("-inf")).softmax(-1).mean(1)  # [T, S]
leaked_mass = (probs * leak).sum(-1)                           # [T]

def selection_picture(ax, idx, mask, title, red=None):
    draw(ax, mask, title, red=red)
    rows = torch.arange(T)[:, None].expand_as(idx)
    used = idx >= 0
    ax.scatter(idx[used], rows[used], s=9, c="black", marker="s")

fig, axes = plt.subplots(1, 3, figsize=(16, 5))
selection_picture(axes[0], packed.topk_indices, inside, "packed run: selected keys (black) stay in the blocks")
selection_picture(axes[1], leaky.topk_indices, causal, "plain causal mask: selected keys (black) in red = leaks", red=leak)
axes[2].bar(range(T), leaked_mass, color=SEQ_COLORS[seq.numpy() % len(SEQ_COLORS)])
axes[2].set_xlabel("query t (colour = its sequence)")
axes[2].set_ylabel("attention probability on other documents")
axes[2].set_title("plain causal mask: attention spent on earlier documents", fontsize=10)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 4. Isolation is exact

# %% [markdown]
# With the windows, a document's output is a function of its own tokens only. In floating point
# this holds **bit for bit**: a key outside a window gets score $-\infty$, weight exactly 0, and
# adds exactly 0 to every sum; the matrix shapes do not change, so neither does the order of the
# remaining additions. Replacing every token of one sequence must leave the other sequences'
# outputs and selections `torch.equal` to before.

# %%
k = 3                                   # the sequence of 12 tokens
a, b = seqs[k]
x2 = x.clone()
x2[a:b] = torch.randn(b - a, cfg.mla.dim, dtype=dtype, generator=torch.Generator().manual_seed(7))
with torch.no_grad():
    changed = layer(x2, cu_seqlens)
others = torch.ones(T, dtype=torch.bool)
others[a:b] = False
same_out = torch.equal(changed.output[others], packed.output[others])
same_idx = torch.equal(changed.topk_indices[others], packed.topk_indices[others])
diff = (changed.output - packed.output).abs().amax(1)
print(f"replaced the tokens of sequence [{a}, {b})")
print(f"other sequences: outputs bit-identical {same_out}, selections identical {same_idx}")
print(f"max change inside the replaced sequence: {diff[a:b].max().item():.3f}")
fig, ax = plt.subplots(figsize=(9, 2.8))
ax.bar(range(T), diff, color=SEQ_COLORS[seq.numpy() % len(SEQ_COLORS)])
ax.set_xlabel("token t")
ax.set_ylabel("max |change| of the output")
ax.set_title("only the perturbed sequence moves", fontsize=10)
plt.tight_layout()
plt.show()


# %% [markdown]
# ## 5. Restarting positions is not isolation

# %% [markdown]
# Packed training restarts RoPE positions in every document, so a document sees the positions it
# would see alone. It is tempting to think that this is what separates documents. It is not:
# RoPE rotates $q_t$ by $\mathrm{pos}(t)$ and $k_s$ by $\mathrm{pos}(s)$, and a dot product of two
# rotated vectors depends only on the difference,
#
# $$
# (R_{\mathrm{pos}(t)}\, q) \cdot (R_{\mathrm{pos}(s)}\, k) = q \cdot R_{\mathrm{pos}(s) - \mathrm{pos}(t)}\, k ,
# $$
#
# and inside one document $\mathrm{pos}(s) - \mathrm{pos}(t) = s - t$ whether positions restart or
# not. So (in exact arithmetic) global positions with the right windows give the same outputs as
# restarted ones, and restarted positions with a plain causal mask still leak. Only the windows
# isolate. (Restarting still matters in practice: in low precision the cosines of large angles
# lose digits, and a KV cache or a per-document run expects positions from 0.)

# %%
def dense_output(pos, starts, ends):
    """The layer's dense (warm-up) output with explicit RoPE positions and key windows."""
    with torch.no_grad():
        p = layer.mla.project(x, pos)
        q, kv = layer.absorbed.absorbed_qkv(p)
        o, _ = dense_mla_attention(q, kv, sm_scale=layer.mla.softmax_scale, d_v=cfg.mla.kv_lora_rank,
                                   starts=starts, ends=ends)
        return layer.absorbed.output(o)

with torch.no_grad():
    reference = torch.cat([layer(x[a:b], stage="dense_warmup").output for a, b in seqs])
plain_windows = key_windows(one_sequence(T))
variants = {
    "restarted positions + windows": dense_output(pos, starts, ends),
    "global positions    + windows": dense_output(torch.arange(T), starts, ends),
    "restarted positions + plain causal": dense_output(pos, *plain_windows),
}
pos_errors = {name: (out - reference).abs().max().item() for name, out in variants.items()}
for name, e in pos_errors.items():
    print(f"{name:<36} max |out - each sequence alone| = {e:.1e}")

# %% [markdown]
# ## 6. A padded batch is a pack; the loss; the top-k slots

# %% [markdown]
# A padded batch `[B, S, dim]` is the pack of $B$ sequences of length $S$:
# $\mathrm{cu} = [0, S, 2S, \dots, BS]$ and `x.reshape(B * S, dim)`. Nothing else is needed.

# %%
B, S = 3, 8
xb = torch.randn(B, S, cfg.mla.dim, dtype=dtype, generator=torch.Generator().manual_seed(3))
cu_batch = torch.arange(B + 1) * S
with torch.no_grad():
    out_batch = layer(xb.reshape(B * S, -1), cu_batch).output.reshape(B, S, -1)
    out_loop = torch.stack([layer(xb[i]).output for i in range(B)])
batch_err = (out_batch - out_loop).abs().max().item()
print(f"cu_seqlens {cu_batch.tolist()}: max |packed batch - loop over the batch| = {batch_err:.1e}")

# %% [markdown]
# **The loss of a pack.** With `loss_reduction="mean"` the indexer KL is averaged over all valid
# query rows *of the pack* (every token is a valid row: its window holds at least itself). So the
# packed loss is not the plain average of the per-sequence losses but the row-weighted one,
#
# $$
# \mathcal{L}_{\text{pack}} = \frac{1}{T}\sum_{t} \mathrm{KL}_t = \sum_i \frac{L_i}{T}\,\mathcal{L}_i ,
# $$
#
# the same convention as a per-token language-model loss. With `"sum"` it is the sum over the
# sequences of their summed losses, $\sum_i L_i\,\mathcal{L}_i$ in terms of their means.

# %%
sizes = torch.tensor([b - a for a, b in seqs], dtype=dtype)
per_seq = torch.stack([r.indexer_loss for r in alone])
weighted = (sizes * per_seq).sum() / T
print("per-sequence losses:", [round(v, 4) for v in per_seq.tolist()], "rows:", sizes.long().tolist())
print(f"packed loss {packed.indexer_loss.item():.6f} | row-weighted mean {weighted.item():.6f}"
      f" | plain mean {per_seq.mean().item():.6f}")
layer.loss_reduction = "sum"
with torch.no_grad():
    packed_sum = layer(x, cu_seqlens).indexer_loss
layer.loss_reduction = "mean"
print(f"reduction='sum': packed {packed_sum.item():.6f} | sum of L_i x per-sequence mean {per_seq.mul(sizes).sum().item():.6f}")

# %% [markdown]
# **Short sequences and top-k.** A query keeps $\min(k, \lvert W_t\rvert)$ valid slots and pads the rest with
# `-1`. In a pack the window is the query's own prefix, so the count restarts at every document:
# the length-1 sequence selects only itself, and a sequence shorter than $k$ never fills a row.

# %%
valid_slots = (packed.topk_indices >= 0).sum(1)
window_size = ends - starts
fig, ax = plt.subplots(figsize=(10, 3.2))
ax.bar(range(T), window_size, color=SEQ_COLORS[seq.numpy() % len(SEQ_COLORS)], alpha=0.35, label="window size |W_t|")
ax.step(range(T), valid_slots, where="mid", color="black", label="valid top-k slots")
ax.axhline(TOPK, color="#e65100", ls="--", lw=1, label=f"k = {TOPK}")
ax.set_xlabel("token t")
ax.legend(fontsize=8)
ax.set_title("valid slots = min(k, window): the count restarts in every sequence", fontsize=10)
plt.tight_layout()
plt.show()
lone = seqs[2][0]
print(f"the length-1 sequence (token {lone}) selects {packed.topk_indices[lone].tolist()}")

# %% [markdown]
# ## Checks

# %%
# the layout: block-diagonal causal windows, positions restart
assert torch.equal(pos, torch.cat([torch.arange(n) for n in lengths]))
assert not bool((inside & (seq[:, None] != seq[None, :])).any())
assert torch.equal(inside, causal & (seq[:, None] == seq[None, :]))
# packed == alone; a plain causal mask leaks into every later sequence, in the selection too
assert max(err_packed) < 1e-12
assert err_leaky[0] < 1e-12 and min(err_leaky[1:]) > 1e-3
assert sum(picked_outside) > 0 and leaked_mass[seqs[1][0]:].min() > 0
for (a_, b_), r in zip(seqs, alone):
    assert torch.equal(packed.topk_indices[a_:b_], torch.where(r.topk_indices >= 0, r.topk_indices + a_, -1))
# bit-identical isolation, and the perturbation did reach its own sequence
assert same_out and same_idx and diff[a:b].min() > 0
# positions: RoPE is relative, windows are what isolates
assert pos_errors["restarted positions + windows"] < 1e-12
assert pos_errors["global positions    + windows"] < 1e-10
assert pos_errors["restarted positions + plain causal"] > 1e-3
# padded batch, loss reductions, top-k slots
assert batch_err < 1e-12
assert abs(packed.indexer_loss - weighted) < 1e-12 and abs(packed.indexer_loss - per_seq.mean()) > 1e-4
assert abs(packed_sum - per_seq.mul(sizes).sum()) < 1e-10
assert torch.equal(valid_slots, window_size.clamp(max=TOPK))
assert packed.topk_indices[lone].tolist() == [lone] + [-1] * (TOPK - 1)
print("all checks passed")
