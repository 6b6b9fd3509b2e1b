# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 2 — Absorbed MLA
#
# Chapter 1 computed attention with per-head keys and values, up-projected from each token's
# latent $c_s$ by the matrix `wkv_b`. This notebook rewrites the same layer so that nothing is
# ever up-projected per key: the key half of `wkv_b` ($W^{UK}$) is folded into each query, the
# value half ($W^{UV}$) is applied after attention, and attention itself runs over the
# 576-wide latent rows, one key/value head shared by all query heads (multi-query attention).
#
# The rewrite rests on two exact identities, for one head $h$: a matrix in a dot product can
# move to the other side,
#
# $$
# q^{n}_{t,h} \cdot \big(W^{UK}_h c_s\big) = \big(W^{UK\top}_h q^{n}_{t,h}\big) \cdot c_s,
# $$
#
# and a weighted average commutes with a linear map,
#
# $$
# \sum_s p_{t,h,s}\, W^{UV}_h c_s = W^{UV}_h \Big(\sum_s p_{t,h,s}\, c_s\Big).
# $$
#
# We check both numerically, compare the attention probabilities of the two forms side by side,
# and then count what each form costs at DeepSeek-V3.2's shapes.

# %%
import math

import matplotlib.pyplot as plt
import torch

import dsa_ref
from dsa_ref import MLA, deepseek_v32, key_windows, positions, tiny, window_mask
from dsa_ref.notebook_helpers import check_close

torch.manual_seed(0)
ON_GPU = torch.cuda.is_available()
device = torch.device("cuda" if ON_GPU else "cpu")
# float64 everywhere, so that the checks can ask for agreement to 1e-12
dtype = torch.float64

# CPU: the tiny config and a few dozen tokens (runs in seconds).
# GPU: the real DeepSeek-V3.2 attention shapes and a few hundred tokens.
cfg = (deepseek_v32() if ON_GPU else tiny()).mla
lengths = [96, 160, 256] if ON_GPU else [6, 10, 14]
cu_seqlens = torch.tensor([0] + lengths, device=device).cumsum(0)
T = int(cu_seqlens[-1])
print(f"device={device}, config={'deepseek_v32' if ON_GPU else 'tiny'}, lengths={lengths}, T={T}")



from dsa_ref import AbsorbedMLA, dense_mla_attention
from dsa_ref.absorbed_mla import absorb_query, apply_w_uv, latent_kv
from dsa_ref.attention import windowed_attention
from matplotlib.ticker import NullLocator

# %% [markdown]
# ## 1. Split `wkv_b` into its two halves
#
# `wkv_b` maps the latent $c_s \in \mathbb{R}^{r}$ to $H (d_n + d_v)$ numbers. Viewed per head its
# weight is `[H, d_n + d_v, r]`: the first $d_n$ rows of each head are $W^{UK}_h$ (they make
# `k_nope`), the last $d_v$ rows are $W^{UV}_h$ (they make `v`). `MLA.kv_up_weights()` returns
# both as views of the same parameter, so the absorbed form shares the dense form's weights
# rather than copying them.

# %%
mla = MLA(cfg, device=device, dtype=dtype)
absorbed = AbsorbedMLA(mla)  # no new parameters: it reads mla's
w_uk, w_uv = mla.kv_up_weights()
print("wkv_b.weight", tuple(mla.wkv_b.weight.shape),
      "-> W_UK", tuple(w_uk.shape), " W_UV", tuple(w_uv.shape))
print("parameters of the absorbed module that are not the dense module's:",
      sum(1 for _ in absorbed.parameters()) - sum(1 for _ in mla.parameters()))

x = torch.randn(T, cfg.dim, device=device, dtype=dtype)
pos = positions(cu_seqlens)
starts, ends = key_windows(cu_seqlens)
p = mla.project(x, pos)                       # the same projections for both forms
q_d, k_d, v_d = mla.dense_qkv(p)              # dense: [T, H, 192], [T, H, 192], [T, H, 128]
q_a, kv = absorbed.absorbed_qkv(p)            # absorbed: [T, H, 576], [T, 576]
print("dense   q", tuple(q_d.shape), "k", tuple(k_d.shape), "v", tuple(v_d.shape))
print("absorbed q", tuple(q_a.shape), "kv", tuple(kv.shape), " <- one row per token, no head dim")

# %% [markdown]
# ## 2. Fold W_UK into the query
#
# `absorb_query` maps each head's position-free query into the latent space and appends the
# rotated rotary part; `latent_kv` appends the rotated shared rotary key to the latent:
#
# $$
# \tilde q_{t,h} = \big[\, W^{UK\top}_h q^{n}_{t,h} \;;\; q^{pe}_{t,h} \,\big] \in \mathbb{R}^{r + d_r},
# \qquad
# \tilde k_s = \big[\, c_s \;;\; k^{pe}_s \,\big] \in \mathbb{R}^{r + d_r}.
# $$
#
# The score of the dense form splits the same way, $q_{t,h}\cdot k_{s,h} = q^{n}_{t,h}\cdot
# W^{UK}_h c_s + q^{pe}_{t,h}\cdot k^{pe}_s$, so $\tilde q_{t,h} \cdot \tilde k_s$ is the same number.
# It is multiplied by the **same** softmax scale $m^2/\sqrt{d_n + d_r}$ — the dot product got wider,
# but it did not gain any new terms.

# %%
import inspect

print(inspect.getsource(absorb_query))  # the code of this step, straight from dsa_ref

# %%
mask = window_mask(starts, ends, T)
tau = mla.softmax_scale
scores_dense = torch.einsum("thd,shd->hts", q_d, k_d) * tau     # [H, T, T]: per-head keys
scores_abs = torch.einsum("thd,sd->hts", q_a, kv) * tau         # [H, T, T]: one shared key row
probs_dense = scores_dense.masked_fill(~mask, float("-inf")).softmax(-1)
probs_abs = scores_abs.masked_fill(~mask, float("-inf")).softmax(-1)
print("max |scores_dense - scores_abs| over the windows:", (scores_dense - scores_abs)[:, mask].abs().max().item())
print("max |probs_dense - probs_abs|:", (probs_dense - probs_abs).abs().max().item())

# %% [markdown]
# The two forms side by side, for one head of the packed batch, and their difference. The
# difference is float64 rounding: around $10^{-16}$, the last bit of a double.

# %%
from matplotlib.colors import LogNorm

h = 0
Pd, Pa = probs_dense[h].detach().cpu(), probs_abs[h].detach().cpu()
diff = (Pd - Pa).abs()
prob_cmap = plt.get_cmap("viridis").copy()
prob_cmap.set_bad("white")  # probability exactly 0 (outside the windows): white
fig, axes = plt.subplots(1, 3, figsize=(11, 3.8))
for ax, img, title in [(axes[0], Pd, f"dense form, head {h}"), (axes[1], Pa, f"absorbed form, head {h}")]:
    im = ax.imshow(img.masked_fill(img == 0, float("nan")), cmap=prob_cmap,
                   norm=LogNorm(vmin=1e-3, vmax=1.0, clip=True), interpolation="nearest")
    fig.colorbar(im, ax=ax, fraction=0.046)
    ax.set_title(title + " (log colours)", fontsize=10)
im = axes[2].imshow(diff, cmap="magma", interpolation="nearest")
fig.colorbar(im, ax=axes[2], fraction=0.046, format="%.1e")
axes[2].set_title(f"|dense - absorbed|  (max {diff.max().item():.1e})", fontsize=10)
for ax in axes:
    for b in cu_seqlens[1:-1].tolist():
        ax.axhline(b - 0.5, color="#e65100", lw=0.8)
        ax.axvline(b - 0.5, color="#e65100", lw=0.8)
    ax.set_xlabel("key s")
    ax.set_ylabel("query t")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 3. Apply W_UV after attention
#
# With the latent rows as keys, their first $r$ channels serve as values: attention averages
# latents, $\bar c_{t,h} = \sum_s p_{t,h,s}\, c_s$, and each head's $W^{UV}_h$ then maps its
# average to $d_v$ dims. `dense_mla_attention` is exactly this multi-query attention over the
# latent rows (values = `kv[:, :d_v]`); `apply_w_uv` finishes the job.

# %%
o_latent, lse_abs = dense_mla_attention(q_a, kv, sm_scale=tau, d_v=cfg.kv_lora_rank, starts=starts, ends=ends)
o_abs = apply_w_uv(o_latent, w_uv)                              # [T, H, d_v]
o_dense, lse_dense = windowed_attention(q_d, k_d, v_d, sm_scale=tau, starts=starts, ends=ends)
print("o_latent", tuple(o_latent.shape), "-> o", tuple(o_abs.shape))
print("max |o_dense - o_abs| =", (o_dense - o_abs).abs().max().item())
print("max |lse_dense - lse_abs| =", (lse_dense - lse_abs).abs().max().item())

# %% [markdown]
# ## 4. The whole layer, forward and backward
#
# `AbsorbedMLA(mla)` runs the complete layer in the absorbed form. It must give the dense
# layer's output, and — because it uses the very same parameters — the same gradients, so a
# model can be trained in one form and served in the other.

# %%
out_dense = mla(x, cu_seqlens)
out_abs = absorbed(x, cu_seqlens)
print("max |out_dense - out_abs| =", (out_dense - out_abs).abs().max().item())

g = torch.randn_like(out_dense)
grads_dense = torch.autograd.grad((out_dense * g).sum(), list(mla.parameters()))
grads_abs = torch.autograd.grad((out_abs * g).sum(), list(mla.parameters()))
worst = max((a - b).abs().max().item() for a, b in zip(grads_dense, grads_abs))
print("max |grad_dense - grad_abs| over all parameters =", worst)

# %% [markdown]
# ## 5. The scale is not 1/√576
#
# It is tempting to scale the 576-wide dot product by $576^{-1/2}$, and some kernels default to
# that. It is wrong: the absorbed score is the *same number* as the dense one, so it needs the
# same temperature $m^2/\sqrt{192}$. With $576^{-1/2}$ every score shrinks by the factor below and
# the attention comes out flatter than the model was trained with.

# %%
wrong = cfg.latent_dim ** -0.5  # 576 ** -0.5 at DeepSeek-V3.2
o_wrong, _ = dense_mla_attention(q_a, kv, sm_scale=wrong, d_v=cfg.kv_lora_rank, starts=starts, ends=ends)
print(f"right scale {tau:.5f}, wrong scale {wrong:.5f}: scores multiplied by {wrong / tau:.3f}")
print("max |o_latent(right) - o_latent(wrong)| =", (o_latent - o_wrong).abs().max().item())

# %% [markdown]
# ## 6. What each form costs at DeepSeek-V3.2 shapes
#
# Everything below is computed by formula from `deepseek_v32()`; the chapter page explains each
# number. Per token and layer, in bf16 (2 bytes per number):
#
# * **KV cache.** Dense: per-head keys and values, $H(d_n + d_r) + H d_v = 40{,}960$ numbers.
#   Absorbed: one latent row of $r + d_r = 576$ numbers.
# * **Attention FLOPs per (query, key) pair**, all heads: dense $2H\,(192 + 128)$, absorbed
#   $2H\,(576 + 512)$ — the absorbed core does 3.4 times more arithmetic per pair.
# * **One-off FLOPs per token.** Dense: up-project each *key* token's latent with `wkv_b`,
#   $2 r H (d_n + d_v)$. Absorbed: $W^{UK}$ into each *query* and $W^{UV}$ on each output,
#   $2 H d_n r + 2 H r d_v$ — the same total, paid per query instead of per key.

# %%
c = deepseek_v32().mla
H, dn, dr, dv, r = c.n_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
BF16 = 2
cost = {
    "kv_bytes": {"dense": (H * (dn + dr) + H * dv) * BF16, "absorbed": (r + dr) * BF16},
    "pair_flops": {"dense": 2 * H * (dn + dr) + 2 * H * dv, "absorbed": 2 * H * (r + dr) + 2 * H * r},
    "once_flops": {"dense": 2 * r * H * (dn + dv), "absorbed": 2 * H * dn * r + 2 * H * r * dv},
}
for key, both in cost.items():
    print(f"{key:<11} dense {both['dense']:>12,}   absorbed {both['absorbed']:>12,}   "
          f"absorbed/dense {both['absorbed'] / both['dense']:.4g}")

fig, axes = plt.subplots(1, 3, figsize=(11, 3.6))
labels = ["dense\n(per-head K, V)", "absorbed\n(latent MQA)"]
titles = {"kv_bytes": "KV cache, bf16 bytes\nper token and layer",
          "pair_flops": "attention FLOPs\nper (query, key) pair",
          "once_flops": "one-off FLOPs per token\n(wkv_b, or W_UK + W_UV)"}
for ax, (key, both) in zip(axes, cost.items()):
    vals = [both["dense"], both["absorbed"]]
    bars = ax.bar(labels, vals, color=["#3949ab", "#6a1b9a"], width=0.55)
    ax.bar_label(bars, labels=[f"{v:,}" for v in vals], fontsize=9)
    ax.set_title(titles[key], fontsize=10)
    ax.set_ylim(0, max(vals) * 1.18)
    ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 3))
plt.tight_layout()
plt.show()

# %% [markdown]
# So the absorbed form stores 71 times less and computes 3.4 times more per pair. Which one wins
# depends on how often each key is reused:
#
# * **Prefill and training** process many queries against keys that were just computed. The
#   one-off costs are equal, the dense core is 3.4 times cheaper, and the per-head keys never need
#   to be stored for long: the dense (MHA) form is cheaper.
# * **Decoding** processes one new query per sequence against a long cache. The dense form must
#   either read 80 KiB of cached keys and values per past token or recompute them (33.6 MFLOP per
#   past token); the absorbed form reads 1,152 bytes per past token and pays its one-off cost once
#   per step.
# * **DSA** attends each query to 2048 keys of its own choosing. Every selected latent row serves
#   all 128 heads, which is what makes sparse attention efficient — see the chapter page.
#
# The plots show the attention work of one decode step against the context length — bytes of
# KV cache read, FLOPs, and the time an H200 would need at best (the larger of FLOPs over peak
# compute and bytes over bandwidth) — for the dense form with a per-head cache, the absorbed
# form, and the absorbed form restricted to DSA's top-2048 keys.

# %%
N = 2.0 ** torch.linspace(math.log2(100), 17, 200, dtype=torch.float64)  # context lengths 100 .. 128K
k_sel = torch.clamp(N, max=2048)
PEAK_FLOPS, PEAK_BYTES = 790e12, 4.3e12  # H200, bf16 matmul and copy bandwidth (measured, see notes)
decode = {  # per decoded token and layer: (KV-cache bytes read, attention FLOPs incl. one-off cost)
    "dense, per-head K/V cache": (cost["kv_bytes"]["dense"] * N,
                                  cost["pair_flops"]["dense"] * N + cost["once_flops"]["dense"]),
    "absorbed, all keys": (cost["kv_bytes"]["absorbed"] * N,
                           cost["pair_flops"]["absorbed"] * N + cost["once_flops"]["absorbed"]),
    "absorbed, DSA top-2048": (cost["kv_bytes"]["absorbed"] * k_sel,
                               cost["pair_flops"]["absorbed"] * k_sel + cost["once_flops"]["absorbed"]),
}
fig, axes = plt.subplots(1, 3, figsize=(11, 3.7))
for (name, (nbytes, flops)), colour in zip(decode.items(), ["#3949ab", "#6a1b9a", "#2e7d32"]):
    roofline = torch.maximum(flops / PEAK_FLOPS, nbytes / PEAK_BYTES)  # seconds
    axes[0].loglog(N, nbytes, label=name, color=colour)
    axes[1].loglog(N, flops, label=name, color=colour)
    axes[2].loglog(N, roofline * 1e6, label=name, color=colour)
axes[0].legend(fontsize=8)
axes[0].set_ylabel("KV-cache bytes read")
axes[1].set_ylabel("attention FLOPs")
axes[2].set_ylabel("H200 roofline time (µs)")
for ax in axes:
    ax.xaxis.set_minor_locator(NullLocator())  # fewer ticks: drawing log axes is slow otherwise
    ax.yaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("context length N")
    ax.grid(True, which="major", alpha=0.3)
fig.suptitle("One decode step, one DeepSeek-V3.2 attention layer, one sequence", fontsize=11)
plt.tight_layout()
plt.show()

for name, (nbytes, flops) in decode.items():
    i = -1  # N = 128K
    t = max(flops[i].item() / PEAK_FLOPS, nbytes[i].item() / PEAK_BYTES)
    print(f"N=131072  {name:<27} {nbytes[i].item():>14,.0f} B  {flops[i].item():>16,.0f} FLOP  {t * 1e6:8.2f} µs")
intensity = cost["pair_flops"]["absorbed"] / cost["kv_bytes"]["absorbed"]
print(f"arithmetic intensity per cached key: dense {cost['pair_flops']['dense'] / cost['kv_bytes']['dense']:.1f} "
      f"FLOP/B, absorbed {intensity:.1f} FLOP/B (H200 ridge point: {PEAK_FLOPS / PEAK_BYTES:.0f} FLOP/B)")

# %% [markdown]
# ## 7. Checks

# %%
Hc, r_c, dr_c = cfg.n_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
# shapes of the absorbed form
assert q_a.shape == (T, Hc, r_c + dr_c) and kv.shape == (T, r_c + dr_c)
assert o_latent.shape == (T, Hc, r_c) and o_abs.shape == (T, Hc, cfg.v_head_dim)
assert out_abs.shape == out_dense.shape == (T, cfg.dim)
assert w_uk.shape == (Hc, cfg.qk_nope_head_dim, r_c) and w_uv.shape == (Hc, cfg.v_head_dim, r_c)
# the absorbed form shares the dense form's weights (views, no copies)
assert w_uk.data_ptr() == mla.wkv_b.weight.data_ptr()
assert [id(t) for t in absorbed.parameters()] == [id(t) for t in mla.parameters()]
# absorbed == dense in float64: scores, probabilities, attention output, lse, layer output, gradients
check_close(scores_abs[:, mask], scores_dense[:, mask])
check_close(probs_abs, probs_dense)
check_close(o_abs, o_dense)
check_close(lse_abs, lse_dense)
check_close(out_abs, out_dense)
for a, b in zip(grads_abs, grads_dense):
    check_close(a, b)
# causality of the absorbed form: nothing outside the windows
assert torch.all(probs_abs[:, ~mask] == 0)
# the wrong scale really changes the result
assert (o_latent - o_wrong).abs().max() > 1e-3
# the cost numbers of the chapter page
assert cost["kv_bytes"] == {"dense": 81920, "absorbed": 1152}
assert cost["pair_flops"] == {"dense": 81920, "absorbed": 278528}
assert cost["once_flops"] == {"dense": 33554432, "absorbed": 33554432}
assert cost["pair_flops"]["absorbed"] * 5 == cost["pair_flops"]["dense"] * 17  # ratio 3.4
print("all checks passed")
