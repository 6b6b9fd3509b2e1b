# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 3.2 — Sparse attention, the indexer loss and the two training stages
#
# Chapter 3.1 produced, for every query $t$, a set $S_t$ of at most $k$ keys. This notebook puts the
# rest of DeepSeek Sparse Attention around it:
#
# 1. **sparse attention**: softmax attention over $S_t$ only; with every window key selected it is
#    dense attention, and with a small $k$ its error is governed by the attention mass it misses;
# 2. **the indexer loss**: a KL divergence that pulls the indexer's distribution towards the main
#    attention's;
# 3. **the two training stages** of `DSAttention`, and exactly which tensors are detached;
# 4. a **dense warm-up** run: about 150 Adam steps on the indexer alone, with the loss falling and
#    the top-k recall rising;
# 5. a few steps of the **sparse stage**, where every parameter trains and each loss reaches only
#    its own parameters.
#
# It ends with checks against `dsa_ref`. On a CPU everything runs on the `tiny()` config in seconds.

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
# The same toy layer as in chapter 3.1: MLA's query and key up-projections are scaled by 3 so the
# main attention is not nearly uniform, and the inputs are embeddings from a vocabulary of 32
# tokens.

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
sm_scale, d_v = layer.mla.softmax_scale, cfg.mla.kv_lora_rank
cu = torch.tensor([0, 24, 64], device=device)  # two packed causal sequences, 24 and 40 tokens
T = int(cu[-1])
v = look_inside(layer, tokens(T, gen), cu)
q, kv, starts, ends = v["q"], v["kv"], v["starts"], v["ends"]
print(f"absorbed q {list(q.shape)}, latent kv {list(kv.shape)}, sm_scale = {sm_scale:.4f}, d_v = {d_v}")


# %% [markdown]
# ## 1. Sparse attention with every key is dense attention

# %% [markdown]
# `sparse_mla(q, kv, indices, sm_scale=..., d_v=...)` is multi-query attention over the latent rows
# that `indices` names: for every head $h$ of query $t$,
#
# $$
# o_{t,h} = \sum_{i\,:\,\mathrm{idx}_{t,i} \ne -1}
# \frac{\exp(\tau\, q_{t,h}\cdot c_{\mathrm{idx}_{t,i}})}{\sum_{i'} \exp(\tau\, q_{t,h}\cdot c_{\mathrm{idx}_{t,i'}})}
# \; c_{\mathrm{idx}_{t,i}}^{[:d_v]} .
# $$
#
# If the indices of query $t$ list every key of its window, the sum runs over exactly the keys
# `dense_mla_attention` uses, so the two must agree — outputs and log-sum-exps — whatever the order
# of the slots.

# %%
def window_indices(starts, ends):
    """Every key of each window as an index row, padded with -1: [T, max window]."""
    width = int((ends - starts).max())
    idx = starts[:, None] + torch.arange(width, device=starts.device)[None, :]
    return torch.where(idx < ends[:, None], idx, torch.full_like(idx, -1))

all_keys = window_indices(starts, ends)
out_s, lse_s = sparse_mla(q, kv, all_keys, sm_scale=sm_scale, d_v=d_v)
out_d, lse_d = dense_mla_attention(q, kv, sm_scale=sm_scale, d_v=d_v, starts=starts, ends=ends)
shuffled = all_keys[:, torch.randperm(all_keys.shape[1], generator=gen).to(device)]
out_p, lse_p = sparse_mla(q, kv, shuffled, sm_scale=sm_scale, d_v=d_v)
print("indices", list(all_keys.shape), "(-1 pads the short windows)")
print(f"max |out_sparse - out_dense| = {(out_s - out_d).abs().max().item():.2e}, "
      f"max |lse_sparse - lse_dense| = {(lse_s - lse_d).abs().max().item():.2e}")
print(f"slots shuffled:  max |out| diff = {(out_p - out_d).abs().max().item():.2e}")


# %% [markdown]
# ## 2. What a small k changes

# %% [markdown]
# With fewer keys, each head's softmax is renormalised over $S_t$. Write $m_{t,h}$ for the
# probability mass that head $h$'s *dense* attention puts on $S_t$, $o^{S}$ for sparse attention
# over $S_t$ and $o^{\bar S}$ for attention over the rest of the window. The dense output is the
# mixture $o = m\, o^{S} + (1-m)\, o^{\bar S}$, hence
#
# $$
# o^{S}_{t,h} - o_{t,h} = (1 - m_{t,h})\,\big(o^{S}_{t,h} - o^{\bar S}_{t,h}\big),
# \qquad m_{t,h} = e^{\,\mathrm{lse}^{S}_{t,h} - \mathrm{lse}_{t,h}} .
# $$
#
# The error is proportional to the **missed mass** $1 - m$, which is why the indexer is trained to
# put its top-k where the attention mass is. The log-sum-exps that `sparse_mla` returns give $m$
# directly. We check the identity on the oracle top-8 set (the 8 largest $p_{t,s}$):

# %%
def complement(idx, starts, ends):
    """The window keys that idx does not select, as an index row padded with -1."""
    keep = window_mask(starts, ends, kv.shape[0])
    keep[torch.arange(idx.shape[0], device=device)[:, None].expand_as(idx)[idx >= 0], idx[idx >= 0]] = False
    rest = torch.where(keep, torch.arange(kv.shape[0], device=device), torch.full_like(keep, -1, dtype=torch.long))
    return rest.sort(dim=1, descending=True).values  # valid indices first, -1 at the end

inf = torch.tensor(float("-inf"), device=device)
oracle8 = topk_indices(torch.where(window_mask(starts, ends, T), v["target"], inf), 8)
q64, kv64 = q.double(), kv.double()  # float64, so the identity holds to ~1e-15
o_all, lse_all = dense_mla_attention(q64, kv64, sm_scale=sm_scale, d_v=d_v, starts=starts, ends=ends)
o_S, lse_S = sparse_mla(q64, kv64, oracle8, sm_scale=sm_scale, d_v=d_v)
o_rest, _ = sparse_mla(q64, kv64, complement(oracle8, starts, ends), sm_scale=sm_scale, d_v=d_v)
m = torch.exp(lse_S - lse_all)  # [T, H] dense mass on the selected set
lhs, rhs = o_S - o_all, (1 - m)[..., None] * (o_S - o_rest)
print(f"max |(o_S - o) - (1 - m)(o_S - o_rest)| = {(lhs - rhs).abs().max().item():.2e}")
print(f"mean dense mass on the oracle top-8: {m[(ends - starts) > 8].mean().item():.3f}")


# %% [markdown]
# The relative output error against $k$, on a longer sequence, for three ways of choosing the
# keys: the oracle top-$k$ of $p$, the (still untrained) indexer, and random keys.

# %%
def sparse_error(view, select, ks):
    """Mean relative error of sparse vs dense output over queries whose window exceeds max(ks)."""
    o_dense, _ = dense_mla_attention(view["q"], view["kv"], sm_scale=sm_scale, d_v=d_v,
                                     starts=view["starts"], ends=view["ends"])
    rows = (view["ends"] - view["starts"]) > max(ks)
    errs = []
    for k in ks:
        o_k, _ = sparse_mla(view["q"], view["kv"], topk_indices(select, k), sm_scale=sm_scale, d_v=d_v)
        errs.append(((o_k - o_dense).norm(dim=(1, 2)) / o_dense.norm(dim=(1, 2)))[rows].mean().item())
    return errs

T_long = 1024 if ON_GPU else 256
cu_long = torch.tensor([0, T_long], device=device)
vl = look_inside(layer, tokens(T_long, gen), cu_long)
inside_long = window_mask(vl["starts"], vl["ends"], T_long)
ks = [1, 2, 4, 8, 16, 32, 64, 128]
select = {
    "oracle top-k of p": torch.where(inside_long, vl["target"], inf),
    "untrained indexer": lightning_indexer(vl["q_i"], vl["k_i"], vl["w_i"], starts=vl["starts"], ends=vl["ends"]),
    "random keys": torch.where(inside_long, torch.rand(T_long, T_long, generator=gen).to(device), inf),
}
errors = {name: sparse_error(vl, s, ks) for name, s in select.items()}
fig, ax = plt.subplots(figsize=(7.5, 4))
for name, e in errors.items():
    ax.plot(ks, e, marker="o", label=name)
ax.set_xscale("log", base=2)
ax.set_xticks(ks, [str(k) for k in ks])
ax.set_xlabel("k")
ax.set_ylabel("relative error of the attention output")
ax.set_title(f"sparse vs dense, queries t >= {max(ks)} of {T_long}", fontsize=10)
ax.grid(alpha=0.3)
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# Error falls as $k$ grows and vanishes once $S_t$ is the whole window. The oracle set is far
# better than random keys at every $k$. The untrained indexer is *worse* than random: it is not
# noise but a fixed, arbitrary preference for certain keys, so the part of the window it leaves out
# is systematically different from the part it keeps, and $o^{S} - o^{\bar S}$ in the identity
# above stays large. Training is what turns that preference into the right one.

# %% [markdown]
# ## 3. The indexer loss

# %% [markdown]
# The indexer is trained to predict where the main attention looks. The **target** for query $t$
# is the main attention's probabilities summed over the $H$ heads and normalised over the valid
# keys $V_t$, computed from detached main queries and keys:
#
# $$
# p_{t,s} = \frac{\sum_h P_{t,h,s}}{\sum_{s' \in V_t}\sum_h P_{t,h,s'}}, \qquad
# P_{t,h,:} = \operatorname{softmax}_{s \in V_t}\!\left(\tau\, q_{t,h}\cdot c_s\right).
# $$
#
# The **prediction** is $\log\operatorname{softmax}_{V_t}(I_{t,:})$, and the loss is the KL
# divergence, reduced over the valid query rows ($n$ of them for `reduction="mean"`) and scaled
# by `coeff`:
#
# $$
# \mathcal{L} = \frac{\mathrm{coeff}}{n}\sum_t \sum_{s \in V_t} p_{t,s}
# \left(\log p_{t,s} - \log\operatorname{softmax}_{V_t}(I_{t,:})_s\right).
# $$
#
# In the dense warm-up $V_t$ is the key window; in the sparse stage it is the selected set
# $S_t$, and both distributions are renormalised on it. The gradient with respect to the scores
# is simply $\frac{\mathrm{coeff}}{n}\big(\operatorname{softmax}_{V_t}(I_{t,:}) - p_{t,:}\big)$ on
# valid keys. All of that, computed by hand and compared with `indexer_loss`:

# %%
scores = lightning_indexer(v["q_i"], v["k_i"], v["w_i"], starts=starts, ends=ends).requires_grad_(True)
sel = topk_indices(scores.detach(), cfg.indexer.topk)

def kl_by_hand(scores, valid):
    P = torch.softmax((sm_scale * torch.einsum("thd,sd->ths", q.double(), kv.double()))
                      .masked_fill(~valid[:, None, :], float("-inf")), dim=-1)  # [T, H, S]
    p_t = P.sum(1) / P.sum(1).sum(-1, keepdim=True)                              # [T, S]
    log_q = torch.log_softmax(scores.double().masked_fill(~valid, float("-inf")), dim=-1)
    kl = torch.where(valid, p_t * (p_t.clamp_min(1e-300).log() - log_q), torch.zeros_like(p_t)).sum(-1)
    return kl.mean()

win = window_mask(starts, ends, T)
chosen = torch.zeros_like(win)
chosen[torch.arange(T, device=device)[:, None].expand_as(sel)[sel >= 0], sel[sel >= 0]] = True
dense_loss = indexer_loss(scores, q, kv, sm_scale=sm_scale, starts=starts, ends=ends)
sparse_loss = indexer_loss(scores, q, kv, sm_scale=sm_scale, starts=starts, ends=ends, topk_indices=sel)
print(f"dense warm-up loss:  indexer_loss {dense_loss.item():.6f}   by hand {kl_by_hand(scores, win).item():.6f}")
print(f"sparse-stage loss:   indexer_loss {sparse_loss.item():.6f}   by hand {kl_by_hand(scores, win & chosen).item():.6f}")
(grad,) = torch.autograd.grad(dense_loss, scores)
closed = indexer_logit_grad(scores, q, kv, sm_scale=sm_scale, starts=starts, ends=ends)
print(f"max |autograd - (softmax(I) - p) / n| = {(grad - closed).abs().max().item():.2e}")

# %% [markdown]
# The prediction is a `log_softmax`, never `log(softmax + eps)`: the eps version reports a smaller
# loss than the truth and silences the gradient of every key whose predicted probability is
# below eps — exactly the keys a badly trained indexer gets wrong.

# %% [markdown]
# ## 4. The two training stages

# %% [markdown]
# `DSAttention` runs one of two stages (DeepSeek-V3.2, section 2.1):
#
# | | main attention | what trains | loss of the indexer |
# |---|---|---|---|
# | `"dense_warmup"` | dense over the window | the indexer only (`trainable_parameters("dense_warmup")`) | KL over the window |
# | `"sparse"` | sparse over the top-k set | everything (`trainable_parameters("sparse")`) | KL over the top-k set |
#
# In both stages the same three cuts in the graph keep the two learning problems apart:
#
# * the indexer reads `x.detach()` and `qr.detach()`, so its loss cannot reach MLA's weights
#   or earlier layers through its inputs;
# * the KL target is built from `q.detach()` and `kv.detach()`, so the loss cannot change the main
#   attention to make it easier to predict;
# * the top-k indices are integers and carry no gradient, so the language-model loss never
#   reaches the indexer through the selection.
#
# The layer returns the loss for logging but does not ask the training loop to add it. Its output
# passes through `IndexerLossAutoScaler`, an identity in forward whose backward also hands the loss
# the gradient `loss_scale`, as if `loss_scale * indexer_loss` had been added to the final loss. So
# one `backward()` of the language-model loss trains both. Below: the KL loss reaches exactly the
# indexer's parameters, and a backward through the output alone (zero output gradient) gives the
# indexer `loss_scale` times that gradient. The scale is captured when forward runs, so set it
# (with `set_indexer_loss_scale`) before the forward pass, not between forward and backward.

# %%
x = tokens(T, gen)
set_indexer_loss_scale(layer, 0.25)  # e.g. 1 / number of micro-batches; read when forward runs
res = layer(x, cu, stage="dense_warmup")
print("DSAOutput fields:", res._fields, "| loss", round(res.indexer_loss.item(), 4),
      "| topk", list(res.topk_indices.shape))
named = dict(layer.named_parameters())
grads = dict(zip(named, torch.autograd.grad(res.indexer_loss, list(named.values()),
                                            retain_graph=True, allow_unused=True)))
reached = sorted(n for n, g in grads.items() if g is not None)
print("the KL loss reaches:", reached)

layer.zero_grad(set_to_none=True)
res.output.backward(torch.zeros_like(res.output))  # no language-model gradient at all
via_output = {n: p.grad for n, p in named.items() if n.startswith("indexer.")}
scaled_ok = all(torch.allclose(via_output[n], 0.25 * grads[n]) for n in via_output)
print("output.backward(0) gives the indexer 0.25 x its KL gradient:", scaled_ok)
set_indexer_loss_scale(layer, 1.0)
layer.zero_grad()

# %% [markdown]
# ## 5. A dense warm-up run

# %% [markdown]
# The warm-up of DeepSeek-V3.2 trains only the indexer, for 1000 steps of 16 sequences of 128K
# tokens at learning rate $10^{-3}$, with the rest of the model frozen. Here: a fresh toy layer,
# its MLA frozen, Adam on `trainable_parameters("dense_warmup")`, a new batch of two packed
# 64-token sequences every step. There is no language model around this layer, so the output
# gradient is zero and the whole gradient is the one the auto-scaler injects. Every 10 steps we
# measure, on a fixed held-out sequence, the recall of attention mass of the top-8 set (chapter 3.1).

# %%
warm = make_layer(seed=0)
for prm in warm.mla.parameters():
    prm.requires_grad_(False)          # frozen: the warm-up trains the indexer only
opt = torch.optim.Adam(warm.trainable_parameters("dense_warmup"), lr=1e-2)
steps, seq_len, n_seq = (300, 256, 4) if ON_GPU else (150, 64, 2)
cu_train = torch.arange(n_seq + 1, device=device) * seq_len
k_top = cfg.indexer.topk
held_out = look_inside(warm, tokens(T_long, torch.Generator().manual_seed(7)), cu_long)
ks_eval = [1, 2, 4, 8, 16, 32, 64]

def recall_at(scores, view, k):
    rows = (view["ends"] - view["starts"]) > max(ks_eval)
    return mass_covered(view["target"], topk_indices(scores, k))[rows].mean().item()

oracle_scores = torch.where(window_mask(held_out["starts"], held_out["ends"], T_long), held_out["target"], inf)
oracle_curve = [recall_at(oracle_scores, held_out, k) for k in ks_eval]
before_scores = indexer_scores(warm.indexer, held_out)
before_curve = [recall_at(before_scores, held_out, k) for k in ks_eval]

history = dict(loss=[], eval_step=[], recall=[])
start = time.perf_counter()
for step in range(steps + 1):
    if step % 10 == 0:
        history["eval_step"].append(step)
        history["recall"].append(recall_at(indexer_scores(warm.indexer, held_out), held_out, k_top))
    if step == steps:
        break
    res = warm(tokens(n_seq * seq_len, gen), cu_train)
    opt.zero_grad(set_to_none=True)
    res.output.backward(torch.zeros_like(res.output))  # the auto-scaler supplies the KL gradient
    opt.step()
    history["loss"].append(res.indexer_loss.item())
elapsed = time.perf_counter() - start
after_curve = [recall_at(indexer_scores(warm.indexer, held_out), held_out, k) for k in ks_eval]
print(f"{steps} steps in {elapsed:.1f} s; KL {history['loss'][0]:.3f} -> {history['loss'][-1]:.3f}; "
      f"recall at k = {k_top}: {history['recall'][0]:.3f} -> {history['recall'][-1]:.3f} "
      f"(oracle {oracle_curve[ks_eval.index(k_top)]:.3f})")

# %%
loss = torch.tensor(history["loss"])
smooth = torch.nn.functional.avg_pool1d(loss[None, None], 10, stride=1).flatten()
fig, axes = plt.subplots(1, 3, figsize=(14.5, 3.9))
axes[0].plot(loss, color="#9fa8da", lw=1, label="per step")
axes[0].plot(range(9, len(loss)), smooth, color="#1a237e", lw=2, label="mean of 10 steps")
axes[0].set_xlabel("step")
axes[0].set_ylabel("indexer KL loss (mean over queries)")
axes[0].set_title("dense warm-up: the loss", fontsize=10)
axes[0].legend(fontsize=8)
axes[1].plot(history["eval_step"], history["recall"], marker="o", ms=3, label="trained indexer")
axes[1].axhline(oracle_curve[ks_eval.index(k_top)], color="#2e7d32", ls="--", label="oracle")
axes[1].axhline(history["recall"][0], color="grey", ls=":", label="before training")
axes[1].set_xlabel("step")
axes[1].set_ylabel(f"recall of attention mass at k = {k_top}")
axes[1].set_ylim(0, 1)
axes[1].set_title("held-out sequence: top-k recall", fontsize=10)
axes[1].legend(fontsize=8)
for curve, name, style in ((oracle_curve, "oracle", "--"), (after_curve, "after warm-up", "-"),
                           (before_curve, "before warm-up", ":")):
    axes[2].plot(ks_eval, curve, style, marker="o", ms=3, label=name)
axes[2].set_xscale("log", base=2)
axes[2].set_xticks(ks_eval, [str(k) for k in ks_eval])
axes[2].set_ylim(0, 1.02)
axes[2].set_xlabel("k")
axes[2].set_title("recall against k", fontsize=10)
axes[2].legend(fontsize=8)
for ax in axes:
    ax.grid(alpha=0.3)
plt.tight_layout()
plt.show()

# %% [markdown]
# The same output-error measure as in section 2, on the held-out sequence, now with the trained
# indexer:

# %%
held_inside = window_mask(held_out["starts"], held_out["ends"], T_long)
ks_err = [2, 4, 8, 16, 32, 64]
final = {
    "oracle top-k of p": sparse_error(held_out, oracle_scores, ks_err),
    "indexer after warm-up": sparse_error(held_out, indexer_scores(warm.indexer, held_out), ks_err),
    "indexer before warm-up": sparse_error(held_out, before_scores, ks_err),
    "random keys": sparse_error(held_out, torch.where(held_inside, torch.rand(T_long, T_long, generator=gen)
                                                        .to(device), inf), ks_err),
}
fig, ax = plt.subplots(figsize=(7.5, 3.8))
for name, e in final.items():
    ax.plot(ks_err, e, marker="o", label=name)
ax.set_xscale("log", base=2)
ax.set_xticks(ks_err, [str(k) for k in ks_err])
ax.set_xlabel("k")
ax.set_ylabel("relative error of the attention output")
ax.grid(alpha=0.3)
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()
print("relative error at k = 8:", {name: round(e[ks_err.index(8)], 3) for name, e in final.items()})

# %% [markdown]
# The loss falls fast and the top-8 set of the trained indexer covers a large part of what the
# main attention looks at, most of the way to the oracle. The KL does not go to zero: the indexer
# has 4 heads of width 16 and a ReLU, the main attention 4 heads over a 72-wide latent, and it can
# only approximate it. Nor does it need to: top-k only asks for the right *order* near the top
# of each row.

# %% [markdown]
# ## 6. A few steps of the sparse stage

# %% [markdown]
# Now the main attention runs over the selected keys and every parameter trains. A real model
# would add its language-model loss; this stand-alone layer gets a stand-in: the squared distance
# of its output from a frozen copy of itself running dense attention (so it is asked to make sparse
# attention behave like the dense one). The indexer keeps learning from the KL loss, now over the
# selected set only.
#
# Before training, one batch shows the separation of the two losses exactly. Three backward
# passes over the same forward pass: the stand-in loss with the KL injected (the normal case), the
# KL loss alone, and the stand-in loss with `loss_scale = 0`.

# %%
teacher = copy.deepcopy(warm)
for prm in warm.parameters():
    prm.requires_grad_(True)           # the sparse stage trains everything
warm.stage = "sparse"

def lm_stand_in(out, y):
    return (out - y).pow(2).mean() / y.pow(2).mean()

x = tokens(n_seq * seq_len, gen)
with torch.no_grad():
    y = teacher(x, cu_train, stage="dense_warmup").output

def grads_after(backward, loss_scale=1.0):
    set_indexer_loss_scale(warm, loss_scale)
    warm.zero_grad(set_to_none=True)
    backward(warm(x, cu_train))
    set_indexer_loss_scale(warm, 1.0)
    return {n: None if prm.grad is None else prm.grad.clone() for n, prm in warm.named_parameters()}

g_both = grads_after(lambda r: lm_stand_in(r.output, y).backward())
g_kl = grads_after(lambda r: r.indexer_loss.backward())
g_lm = grads_after(lambda r: lm_stand_in(r.output, y).backward(), loss_scale=0.0)
is_indexer = {n: n.startswith("indexer.") for n in g_both}
print("KL alone reaches the main attention:", any(g_kl[n] is not None for n in g_kl if not is_indexer[n]))
print("stand-in loss alone reaches the indexer:",
      any(g_lm[n].abs().max() > 0 for n in g_lm if is_indexer[n] and g_lm[n] is not None))
print("indexer gradient with both = KL alone:",
      all(torch.equal(g_both[n], g_kl[n]) for n in g_both if is_indexer[n]))
print("main gradient with both = stand-in alone:",
      all(torch.equal(g_both[n], g_lm[n]) for n in g_both if not is_indexer[n]))

# %%
x_held = held_out["x"]
cu_held = cu_long

def held_out_stand_in():
    with torch.no_grad():
        return lm_stand_in(warm(x_held, cu_held).output, teacher(x_held, cu_held, stage="dense_warmup").output).item()

opt = torch.optim.Adam(warm.trainable_parameters("sparse"), lr=3e-3)
sparse_steps = 80 if ON_GPU else 40
sparse_hist = dict(lm=[], kl=[], held_out=[held_out_stand_in()])
for step in range(sparse_steps):
    x = tokens(n_seq * seq_len, gen)
    with torch.no_grad():
        y = teacher(x, cu_train, stage="dense_warmup").output
    res = warm(x, cu_train)
    lm = lm_stand_in(res.output, y)
    opt.zero_grad(set_to_none=True)
    lm.backward()                      # one backward: the KL rides along through the auto-scaler
    opt.step()
    sparse_hist["lm"].append(lm.item())
    sparse_hist["kl"].append(res.indexer_loss.item())
sparse_hist["held_out"].append(held_out_stand_in())
fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
axes[0].plot(sparse_hist["lm"], marker=".")
axes[0].set_title("stand-in loss: distance of sparse output from dense", fontsize=10)
axes[1].plot(sparse_hist["kl"], marker=".", color="#e65100")
axes[1].set_title("indexer KL over the selected set (sparse stage)", fontsize=10)
for ax in axes:
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
plt.tight_layout()
plt.show()
print(f"stand-in loss on the held-out sequence: {sparse_hist['held_out'][0]:.4f} before, "
      f"{sparse_hist['held_out'][1]:.4f} after {sparse_steps} sparse steps")

# %% [markdown]
# The sparse KL is measured on a different set than the warm-up KL — only the $k$ selected keys,
# with both distributions renormalised there — so its values are not comparable with the curve of
# section 5. It keeps the indexer's ranking *inside* the selected set consistent with the main
# attention while the main model adapts to seeing only those keys.

# %% [markdown]
# ## 7. Checks

# %%
# sparse attention over every window key is dense attention, in any slot order
# (float32: the two forms add the same terms in different orders, so a few float32 ulps apart)
torch.testing.assert_close(out_s, out_d, rtol=1e-4, atol=1e-5)
torch.testing.assert_close(lse_s, lse_d, rtol=1e-5, atol=1e-6)
torch.testing.assert_close(out_p, out_d, rtol=1e-4, atol=1e-5)
# the missed-mass identity
torch.testing.assert_close(lhs, rhs, rtol=0, atol=1e-12)
# fewer keys, more error; the oracle set beats random keys; the whole window has none
for name, e in errors.items():
    assert e[-1] < e[0], name
assert all(o < r for o, r in zip(errors["oracle top-k of p"][1:], errors["random keys"][1:]))
# the loss is the KL written out, in both stages, and its gradient is (softmax(I) - p) / n
torch.testing.assert_close(dense_loss.double(), kl_by_hand(scores, win), rtol=1e-5, atol=1e-7)
torch.testing.assert_close(sparse_loss.double(), kl_by_hand(scores, win & chosen), rtol=1e-5, atol=1e-7)
torch.testing.assert_close(grad, closed, rtol=1e-4, atol=1e-7)
# dense warm-up: the KL reaches the indexer only, and the output carries loss_scale times it
assert reached == sorted(n for n in named if n.startswith("indexer.")) and scaled_ok
# the warm-up learned: the KL fell and the top-k recall rose, without passing the oracle
assert sum(history["loss"][-20:]) / 20 < 0.6 * sum(history["loss"][:10]) / 10
assert history["recall"][-1] > history["recall"][0] + 0.15
assert all(a <= o + 1e-6 for a, o in zip(after_curve, oracle_curve))
# sparse stage: each loss reaches only its own parameters
assert all(g_kl[n] is None for n in g_kl if not is_indexer[n])
assert all(g_lm[n] is None or not g_lm[n].any() for n in g_lm if is_indexer[n])
assert all(torch.equal(g_both[n], g_kl[n]) for n in g_both if is_indexer[n])
assert all(torch.equal(g_both[n], g_lm[n]) for n in g_both if not is_indexer[n])
assert torch.isfinite(torch.tensor(sparse_hist["lm"] + sparse_hist["kl"])).all()
# the trained indexer's sparse output beats random keys and its own untrained self
assert final["indexer after warm-up"][ks_err.index(8)] < final["random keys"][ks_err.index(8)]
assert final["indexer after warm-up"][ks_err.index(8)] < final["indexer before warm-up"][ks_err.index(8)]
print("all checks passed")
