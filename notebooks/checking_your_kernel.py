# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Checking a kernel against the oracle
#
# A DSA kernel is correct when it computes what `dsa_ref` computes -- in *its own* conventions.
# Public kernels disagree on the layout (`[T, H, D]`, `[B, S, H, D]`, `[S, B, H, D]`), on how an
# unused top-k slot is marked (`-1`, anything $\ge S_{kv}$, anything after the query's position),
# on the base of the log-sum-exp ($e$ or 2) and on the default softmax scale ($576^{-1/2}$ where
# DeepSeek-V3.2 needs $192^{-1/2} m^2$). `dsa_ref.oracle` names each convention and checks a
# kernel in it.
#
# This notebook:
#
# 1. checks a stand-in for TileLang's `deepseek_v32` kernel, then the same kernel with the wrong scale;
# 2. reads a comparison report, and shows why one number is never enough;
# 3. compares top-k selections when scores tie, and scores an approximate top-k by attention mass;
# 4. simulates DeepSeek's fp8 indexer, with and without the Hadamard rotation, on outlier-heavy inputs;
# 5. lists the adversarial input generators and the bugs they hunt.
#
# Everything runs on a CPU in a few seconds. The page "Checking your kernel" of this site has a
# worked example for every convention.

# %%
import math
from dataclasses import replace

import matplotlib.pyplot as plt
import torch

import dsa_ref
from dsa_ref import adversarial, key_windows, lightning_indexer, sparse_mla, topk_indices
from dsa_ref.compare import attention_mass_recall, compare, compare_topk
from dsa_ref.fp8 import fp8_indexer_scores
from dsa_ref.oracle import TILELANG_DEEPSEEK_V32, check_sparse_mla, kernel_inputs

torch.set_num_threads(1)  # the tensors are small: more threads only add synchronisation
SCALE = dsa_ref.deepseek_v32().mla.softmax_scale  # 192 ** -0.5 * mscale ** 2
print(f"DeepSeek-V3.2 softmax scale {SCALE:.5f}, the kernels' default 576 ** -0.5 = {576 ** -0.5:.5f}")

# %% [markdown]
# ## 1. A kernel in another convention
#
# The problem: two causal sequences of 24 tokens, 16 heads of DeepSeek-V3.2's absorbed width
# (576 for queries and latent rows, 512 for the values), top-8 keys per query from random index
# scores, in bfloat16. `dsa_ref` holds it packed: `q [48, 16, 576]`, `kv [48, 576]`, global indices
# `[48, 8]` with `-1` for unused slots. `kernel_inputs` converts it into TileLang's layout:
# `[B, S, H, 576]`, `kv [B, S, 1, 576]`, `indices [B, S, 1, 8]` int32 counted within each batch entry
# and padded with $S_{kv}$.

# %%
B, S, H, K = 2, 24, 16, 8
g = torch.Generator().manual_seed(0)
q = (0.5 * torch.randn(B * S, H, 576, generator=g)).bfloat16()
kv = torch.randn(B * S, 576, generator=g).bfloat16()
starts, ends = key_windows(torch.tensor([0, S, 2 * S]))
inside = (torch.arange(B * S) >= starts[:, None]) & (torch.arange(B * S) < ends[:, None])
index_scores = torch.randn(B * S, B * S, generator=g).masked_fill(~inside, -math.inf)
indices = topk_indices(index_scores, K)

q_t, kv_t, idx_t = kernel_inputs(q, kv, indices, TILELANG_DEEPSEEK_V32, batch=B)
print("TileLang inputs:", tuple(q_t.shape), tuple(kv_t.shape), tuple(idx_t.shape), idx_t.dtype)
print("row 2 of batch 1:", idx_t[1, 2, 0].tolist(), "(unused slots hold S_kv =", S, ")")
print()
print(TILELANG_DEEPSEEK_V32.describe())


# %% [markdown]
# The stand-in kernel follows TileLang's definition: a slot counts only if its index is at most
# the query's position (the kernel's own causal mask, which is why `S_kv` works as padding), and
# the LSE is $\log_2 \sum_j 2^{\tau s_j \log_2 e}$, the natural one divided by $\ln 2$. `scale=None`
# mimics the kernel's default.

# %%
def tilelang_like(q, kv, indices, sm_scale=None, d_v=512):
    """[B, S, H, D], [B, S_kv, 1, D], [B, S, 1, K] -> out [B, S, H, d_v] (bf16), lse [B, S, H] (base 2)."""
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale   # the kernel's default: 576 ** -0.5
    outs, lses = [], []
    for b in range(q.shape[0]):
        idx = indices[b, :, 0].long()
        idx = torch.where(idx <= torch.arange(q.shape[1])[:, None], idx, -1)
        o, l = sparse_mla(q[b], kv[b, :, 0], idx, sm_scale=sm_scale, d_v=d_v)
        outs.append(o)
        lses.append(l / math.log(2))
    return torch.stack(outs), torch.stack(lses)

out, lse = tilelang_like(q_t, kv_t, idx_t, sm_scale=SCALE)
good = check_sparse_mla(out, lse, q_t, kv_t, idx_t, convention=TILELANG_DEEPSEEK_V32, sm_scale=SCALE, d_v=512)
print(good)

# %% [markdown]
# The output matches to about $2\cdot 10^{-3}$ in relative L2: the rounding of a bfloat16 output,
# well inside the bfloat16 tolerance of $10^{-2}$. The LSE, converted from base 2, matches to
# float32 precision.
#
# Now the bug the page on conventions warns about: the caller forgets `sm_scale`, and the kernel
# uses $576^{-1/2}$.

# %%
out_bad, lse_bad = tilelang_like(q_t, kv_t, idx_t)          # default scale
bad = check_sparse_mla(out_bad, lse_bad, q_t, kv_t, idx_t, convention=TILELANG_DEEPSEEK_V32,
                       sm_scale=SCALE, d_v=512)
print(bad)

fig, ax = plt.subplots(figsize=(7, 3))
for report, label in ((good, "sm_scale passed"), (bad, "default 576^-0.5")):
    rows = sorted(report["out"].worst_rows, key=lambda w: w.head)
    ax.semilogy([w.head for w in rows], [w.max_abs for w in rows], "o-", label=label)
ax.axhline(good["out"].allowed_at_max, color="grey", ls="--", lw=1, label="bf16 bound (at the worst element)")
ax.set_xlabel("head")
ax.set_ylabel("max |error| of its worst row")
ax.set_title("worst row per head", fontsize=10)
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# Every head is off by two orders of magnitude more than rounding explains, and the cosine
# similarity has dropped far below $1 - \tfrac12 \mathrm{rel\_l2}^2$: a *systematic* error. The
# scale is wrong by $\sqrt{576/192}\,m^2 \approx 3.2$, so every softmax is flatter than the model
# was trained with.
#
# ## 2. One number is never enough
#
# `compare` reports the relative L2 error, the largest absolute error and where it is, the cosine,
# the non-finite values and the worst row of every head. Each catches something the others miss:
# a bug confined to one (token, head) row barely moves the relative L2, and a wrong LSE base (a pure
# rescaling) leaves the cosine at exactly 1.

# %%
expected, expected_lse = sparse_mla(q.double(), kv.double(), indices, sm_scale=SCALE, d_v=512)
one_row = expected.bfloat16()
one_row[30, 5] *= 1.1                                   # one broken (token, head) row
c = compare(one_row, expected, name="out, one row off by 10%")
print(c)
print()
wrong_base = compare((expected_lse / math.log(2)).float(), expected_lse, name="lse in base 2", head_dim=1)
print(wrong_base.summary())
print(f"cosine {wrong_base.cosine:.12f}: a scaled copy points the same way")

# %% [markdown]
# ## 3. Top-k: selections, not indices
#
# The ReLU in the index score makes exact ties common (many keys score exactly 0), and
# `torch.topk` leaves the order of equal values unspecified. `dsa_ref.topk_indices` breaks ties
# towards the lower key index; a kernel may break them the other way and still be right.
# `compare_topk` accepts two selections as equal when they differ only among keys whose scores tie
# at the $k$-th boundary. Index recall would call half of these rows wrong:

# %%
case = adversarial.exactly_tied_scores(rows=8, num_keys=40, k=8, seed=0)
tied, k = case["scores"], case.meta["k"]
flipped = topk_indices(tied.flip(1), k)                 # a kernel that prefers the higher index on ties
other = torch.where(flipped >= 0, tied.shape[1] - 1 - flipped, flipped)
for row, kind in enumerate(case.meta["rows"][:4]):
    print(f"row {row} ({kind}):\n  reference {sorted(topk_indices(tied, k)[row].tolist())}\n"
          f"  kernel    {sorted(other[row].tolist())}")
result = compare_topk(other, None, tied, k)
print(result)
broken = other.clone()
broken[:, 0] = broken[:, 1]                              # a key written twice, another lost
print(compare_topk(broken, None, tied, k))

# %% [markdown]
# An *approximate* top-k kernel (or an fp8 indexer) is not wrong when it swaps a key for one of
# nearly the same weight. The right measure is how much of the attention mass the selection covers,
# relative to the exact top-k: `attention_mass_recall(indices, p, relative_to=exact)`. Here the
# "kernel" selects from index scores with growing noise; index recall falls faster than the mass
# it still covers, because the keys it swaps in carry nearly the weight of the ones it drops.

# %%
p = torch.softmax(2.0 * index_scores, dim=-1)           # a peaked stand-in for the attention mass
exact = topk_indices(index_scores, K)
noise_levels = [0.0, 0.1, 0.2, 0.4, 0.8, 1.6]
index_recall, mass_recall = [], []
for sigma in noise_levels:
    noisy = index_scores + sigma * torch.randn(index_scores.shape, generator=torch.Generator().manual_seed(1))
    approx = topk_indices(noisy, K)
    index_recall.append(compare_topk(approx, exact, index_scores, K).mean_recall)
    mass_recall.append(float(attention_mass_recall(approx, p, relative_to=exact).mean()))

fig, ax = plt.subplots(figsize=(5, 3))
ax.plot(noise_levels, index_recall, "o-", label="index recall")
ax.plot(noise_levels, mass_recall, "s-", label="attention-mass recall")
ax.set_xlabel("noise added to the index scores")
ax.set_ylim(0, 1.05)
ax.legend(fontsize=8)
ax.set_title("approximate top-k", fontsize=10)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 4. The fp8 indexer, with and without the Hadamard rotation
#
# DeepSeek-V3.2 scores keys in fp8. `act_quant` gives each 128-channel block (one indexer head
# vector) one scale, $s = \max_i |x_i| / 448$ rounded up to a power of two, and stores $x/s$ in e4m3,
# with 3 mantissa bits: every element carries a relative error up to $2^{-4}$. A dot product's
# error is dominated by its largest terms, so a few outlier channels swamp the signal of the rest.
# The Hadamard rotation $x \mapsto xH/\sqrt{d}$, applied to queries and keys alike, changes nothing
# exactly -- $(qH)\cdot(kH) = q\cdot k$ -- but spreads every outlier over all 128 channels, whose
# rounding errors then partly cancel.
#
# `dsa_ref.fp8.fp8_indexer_scores(q, k, weights, hadamard=...)` computes the scores the way the fp8
# kernel does (bit-for-bit the same quantisation as `torch.float8_e4m3fn`). Below, queries and keys
# have 4 outlier channels whose magnitude grows from 1 (no outliers) to 100.

# %%
magnitudes = [1, 3, 10, 30, 100]
err = {True: [], False: []}
recall = {True: [], False: []}
for m in magnitudes:
    case = adversarial.outlier_channels(tokens=64, num_keys=256, heads=8, magnitude=float(m), seed=0)
    oq, ok_, ow = case["q"], case["k"], case["weights"]
    exact_scores = lightning_indexer(oq, ok_, ow)
    exact_top = topk_indices(exact_scores, 16)
    for rotate in (True, False):
        s = fp8_indexer_scores(oq, ok_, ow, hadamard=rotate).double()
        err[rotate].append(float((s - exact_scores).norm() / exact_scores.norm()))
        recall[rotate].append(compare_topk(topk_indices(s, 16), exact_top, exact_scores, 16).mean_recall)
    print(f"outliers x{m:<4}  rel. error  no rotation {err[False][-1]:.2e}  Hadamard {err[True][-1]:.2e}"
          f"   top-16 recall  {recall[False][-1]:.3f} / {recall[True][-1]:.3f}")

exact_rot = fp8_indexer_scores(oq, ok_, ow, hadamard=True, quantize=False)
print("without quantisation the rotation changes the scores by at most",
      f"{float((exact_rot - exact_scores).abs().max()):.1e}")

fig, axes = plt.subplots(1, 2, figsize=(9, 3))
for rotate, label in ((False, "no rotation"), (True, "Hadamard")):
    axes[0].loglog(magnitudes, err[rotate], "o-", label=label)
    axes[1].semilogx(magnitudes, recall[rotate], "o-", label=label)
axes[0].set_ylabel("relative L2 error of the scores")
axes[1].set_ylabel("top-16 recall vs exact")
for ax in axes:
    ax.set_xlabel("outlier magnitude")
    ax.legend(fontsize=8)
fig.suptitle("fp8 (e4m3, block 128, power-of-two scales) indexer scores", fontsize=10)
plt.tight_layout()
plt.show()

# %% [markdown]
# Without outliers the rotation neither helps nor hurts: every element is rounded to the same
# relative precision either way. With them, the unrotated error stays at the level of one e4m3
# rounding of the *largest* terms, while the rotated error falls about four-fold once the outliers
# dominate the scores, and the top-k recall follows.
#
# ## 5. Adversarial inputs
#
# Random inputs avoid the cases kernels get wrong. `dsa_ref.adversarial` builds them, one generator
# per bug class, each seeded and returning named tensors plus metadata:

# %%
for name, make in adversarial.GENERATORS.items():
    bug = make.__doc__.split("Bug class:")[1].split("--")[0].strip()
    print(f"{name:<21} {bug}")

# %% [markdown]
# ## Checks
#
# What this notebook showed, as assertions (they run in the test suite with every notebook).

# %%
assert good.ok and not bad.ok
assert all(w.max_abs > 10 * good["out"].allowed_at_max for w in bad["out"].worst_rows)
assert c.rel_l2 < c.tol.rel_l2 and not c.ok            # the elementwise bound caught the broken row
assert c.max_abs_index[:2] == (30, 5)
assert abs(wrong_base.cosine - 1) < 1e-12 and not wrong_base.ok
assert result.ok and result.rows_tie_equivalent > 0
assert all(m >= i - 1e-12 for m, i in zip(mass_recall, index_recall))
assert err[True][-1] < 0.5 * err[False][-1] and recall[True][-1] > recall[False][-1]
assert 0.7 < err[True][0] / err[False][0] < 1.4
assert float((exact_rot - exact_scores).abs().max()) < 1e-10
print("all checks passed")
