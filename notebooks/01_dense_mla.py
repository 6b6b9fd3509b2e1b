# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 1 — Dense multi-head latent attention
#
# Multi-head latent attention (MLA) is the attention of DeepSeek-V2, V3 and V3.2. It is ordinary
# causal multi-head softmax attention whose keys and values are *generated* from a small per-token
# latent instead of being projected straight from the hidden state. This notebook runs the dense
# form — the one used for training and prefill — on packed sequences and checks it against a plain
# re-implementation of softmax attention.
#
# What you will see:
#
# 1. the hyper-parameters and the shape of every intermediate tensor, traced from the code;
# 2. one forward pass over a packed batch of three sequences, with its key windows;
# 3. the causal, block-diagonal attention pattern of that batch;
# 4. why a packed batch equals the sequences run one by one, and why the layer is causal;
# 5. what a KV cache has to keep per token.
#
# On a CPU everything runs at the `tiny()` config in a few seconds; on a GPU the same cells use
# DeepSeek-V3.2's real attention shapes.

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




# %% [markdown]
# ## 1. The hyper-parameters
#
# One MLA layer is described by `dsa_ref.MLAConfig`. Queries go through a low-rank bottleneck of
# width $d_q$ (`q_lora_rank`); keys and values go through a latent $c^{KV}$ of width $r$
# (`kv_lora_rank`). Each of the $H$ heads has $d_n$ position-free dims and $d_r$ rotary dims for
# queries and keys, and $d_v$ dims for values. The `tiny()` preset keeps DeepSeek-V3.2's ratios
# ($r = 4 d_n$, $d_r = d_n / 2$) at a size a laptop runs instantly.

# %%
rows = [("dim", "model width"), ("n_heads", "H"), ("q_lora_rank", "d_q"), ("kv_lora_rank", "r"),
        ("qk_nope_head_dim", "d_n"), ("qk_rope_head_dim", "d_r"), ("v_head_dim", "d_v"),
        ("qk_head_dim", "d_n + d_r"), ("latent_dim", "r + d_r"), ("mscale", "YaRN m"),
        ("softmax_scale", "m^2 / sqrt(d_n + d_r)")]
v32, small = deepseek_v32().mla, tiny().mla
print(f"{'field':<18}{'symbol':<24}{'deepseek_v32':>14}{'tiny':>10}")
for field, symbol in rows:
    a, b = getattr(v32, field), getattr(small, field)
    fmt = (lambda z: f"{z:.5f}") if isinstance(a, float) else str
    print(f"{field:<18}{symbol:<24}{fmt(a):>14}{fmt(b):>10}")


# %% [markdown]
# ## 2. Every shape, traced from the code
#
# `shape_formulas` writes the shape of every intermediate as a formula in the config's fields;
# `traced_shapes` runs a few tokens through the real module and records what it produced. The
# two must agree at the config this notebook runs, so we may evaluate the formulas at
# DeepSeek-V3.2 (187 M parameters per layer, which we never need to allocate) and draw the
# figure from them.
#
# Two things stand out. The key/value path squeezes each token through $r + d_r = 576$ numbers
# ($c^{KV}$ and the shared rotary key $k^{pe}$) and then expands them again into 128 heads of keys
# and values. And the rotary part of the key is *one* vector per token, copied to every head;
# only the query has a rotary part per head.

# %%
def shape_formulas(c):
    # the per-token shape of every intermediate, as a formula in the config's fields
    H = c.n_heads
    return {"x": (c.dim,), "qr": (c.q_lora_rank,), "q_nope": (H, c.qk_nope_head_dim),
            "q_pe": (H, c.qk_rope_head_dim), "c_kv": (c.kv_lora_rank,), "k_pe": (c.qk_rope_head_dim,),
            "k_nope": (H, c.qk_nope_head_dim), "v": (H, c.v_head_dim), "q": (H, c.qk_head_dim),
            "k": (H, c.qk_head_dim), "o": (H, c.v_head_dim), "out": (c.dim,)}


def traced_shapes(m, num_tokens=3):
    # run a few tokens through the real module and record what it produced (without the token dim)
    x = torch.randn(num_tokens, m.config.dim, device=device, dtype=dtype)
    cu = torch.tensor([0, num_tokens], device=device)
    p = m.project(x, positions(cu))
    q, k, v = m.dense_qkv(p)
    o, _ = dsa_ref.attention.windowed_attention(q, k, v, sm_scale=m.softmax_scale, starts=None, ends=None)
    tensors = dict(x=x, qr=p.qr, q_nope=p.q_nope, q_pe=p.q_pe, c_kv=p.c_kv, k_pe=p.k_pe,
                   k_nope=k[..., : m.config.qk_nope_head_dim], v=v, q=q, k=k, o=o, out=m.output(o))
    return {name: tuple(t.shape[1:]) for name, t in tensors.items()}


def shape_str(shape):
    return "[T, " + ", ".join(str(n) for n in shape) + "]"

from matplotlib.patches import FancyBboxPatch


def draw_flow(nodes, edges, title):
    """Boxes at (x, y) with a name and a shape, and labelled arrows between them."""
    colours = {"tensor": ("#e8eefc", "#3949ab"), "cache": ("#fff3e0", "#e65100"),
               "absorbed": ("#f3e5f5", "#6a1b9a"), "attn": ("#e8f5e9", "#2e7d32")}
    fig, ax = plt.subplots(figsize=(11.5, 5.0))
    ax.set_xlim(-0.2, 11.2)
    ax.set_ylim(-0.1, 6.3)
    ax.axis("off")
    patches = {}
    for name, (x, y, label, kind, w, h) in nodes.items():
        face, edge = colours[kind]
        box = FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.02,rounding_size=0.08",
                             facecolor=face, edgecolor=edge, linewidth=1.4)
        ax.add_patch(box)
        patches[name] = box
        ax.text(x, y, label, ha="center", va="center", fontsize=9.5, family="monospace")
    for src, dst, label, where in edges:
        ax.annotate("", xy=nodes[dst][:2], xytext=nodes[src][:2],
                    arrowprops=dict(arrowstyle="-|>", color="#455a64", lw=1.2,
                                    patchA=patches[src], patchB=patches[dst], shrinkA=2, shrinkB=2))
        if label:
            (x0, y0), (x1, y1) = nodes[src][:2], nodes[dst][:2]
            ax.text(x0 + where * (x1 - x0), y0 + where * (y1 - y0), label, ha="center", va="center", fontsize=8.5,
                    style="italic", color="#bf360c", bbox=dict(facecolor="white", edgecolor="none", pad=0.5))
    ax.set_title(title, fontsize=11)
    return fig, ax

mla = MLA(cfg, device=device, dtype=dtype)  # the layer this notebook studies
assert traced_shapes(mla) == shape_formulas(cfg)  # the formulas describe the code...
s = shape_formulas(deepseek_v32().mla)            # ...so we may evaluate them at DeepSeek-V3.2
print("traced shapes match the formulas at", "deepseek_v32" if ON_GPU else "tiny")
B, C, A = "tensor", "cache", "attn"
nodes = {  # name: (x, y, label, colour, width, height)
    "x": (0.7, 3.2, "x\n" + shape_str(s["x"]), B, 1.3, 0.75),
    "qr": (2.7, 5.3, "qr (normed)\n" + shape_str(s["qr"]), B, 1.5, 0.75),
    "q_nope": (5.0, 5.9, "q_nope\n" + shape_str(s["q_nope"]), B, 1.8, 0.7),
    "q_pe": (5.0, 4.8, "q_pe\n" + shape_str(s["q_pe"]), B, 1.8, 0.7),
    "c_kv": (2.7, 2.6, "c_kv (normed)\n" + shape_str(s["c_kv"]), C, 1.5, 0.75),
    "k_pe": (2.7, 0.8, "k_pe\n" + shape_str(s["k_pe"]), C, 1.4, 0.75),
    "k_nope": (5.0, 3.5, "k_nope\n" + shape_str(s["k_nope"]), B, 1.8, 0.7),
    "v": (5.0, 2.4, "v\n" + shape_str(s["v"]), B, 1.8, 0.7),
    "k_rot": (5.0, 0.95, "RoPE(k_pe)\n" + shape_str(s["k_pe"]), B, 1.8, 0.7),
    "q": (7.45, 5.0, "q = [q_nope; q_pe]\n" + shape_str(s["q"]), B, 2.1, 0.75),
    "k": (7.45, 3.65, "k = [k_nope; k_pe]\n" + shape_str(s["k"]), B, 2.1, 0.75),
    "attn": (9.95, 3.7, "softmax attention\nover key windows\n\nscale m²/√192", A, 2.0, 2.4),
    "o": (9.95, 0.9, "o\n" + shape_str(s["o"]), B, 1.8, 0.75),
    "out": (7.45, 0.9, "out\n" + shape_str(s["out"]), B, 1.8, 0.75),
}
edges = [  # (from, to, label, where along the arrow the label sits)
    ("x", "qr", "wq_a", 0.45), ("x", "c_kv", "wkv_a", 0.5), ("x", "k_pe", "wkv_a", 0.45),
    ("qr", "q_nope", "wq_b", 0.5), ("qr", "q_pe", "", 0.5), ("q_nope", "q", "", 0.5),
    ("q_pe", "q", "RoPE", 0.5), ("c_kv", "k_nope", "wkv_b", 0.5), ("c_kv", "v", "", 0.5),
    ("k_pe", "k_rot", "RoPE", 0.5), ("k_nope", "k", "", 0.5), ("k_rot", "k", "copy to\nall heads", 0.55),
    ("q", "attn", "", 0.5), ("k", "attn", "", 0.5), ("v", "attn", "", 0.5),
    ("attn", "o", "", 0.5), ("o", "out", "wo", 0.5)]
draw_flow(nodes, edges, "Dense MLA at DeepSeek-V3.2 shapes; orange = what a latent KV cache keeps")
plt.show()

# %% [markdown]
# The same trace, as numbers per token along the two paths. The query path never gets narrower
# than 1536; the key/value path narrows to 576 — that bottleneck is the whole point of MLA — and then
# widens to $128 \times (192 + 128) = 40{,}960$ numbers of per-head keys and values.

# %%
per_token = {name: math.prod(shape) for name, shape in s.items()}
stages = [("x", per_token["x"]), ("qr", per_token["qr"]), ("q (all heads)", per_token["q"]),
          ("c_kv + k_pe", per_token["c_kv"] + per_token["k_pe"]),
          ("k (all heads)", per_token["k"]), ("v (all heads)", per_token["v"]),
          ("o (all heads)", per_token["o"]), ("out", per_token["out"])]
fig, ax = plt.subplots(figsize=(8.5, 3.4))
names, widths = zip(*stages)
colours = ["#e65100" if n == "c_kv + k_pe" else "#3949ab" for n in names]
ax.barh(range(len(stages)), widths, color=colours)
for i, w in enumerate(widths):
    ax.text(w + 300, i, f"{w:,}", va="center", fontsize=9)
ax.set_yticks(range(len(stages)), names)
ax.invert_yaxis()
ax.set_xlabel("numbers per token (DeepSeek-V3.2)")
ax.set_xlim(0, max(widths) * 1.15)
ax.set_title("Width of each intermediate, per token")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 3. One forward pass over a packed batch
#
# `dsa_ref` works on **packed** tokens: the sequences of a batch are concatenated into one tensor
# `[T, dim]` and `cu_seqlens` marks where each one starts. Two small functions from
# `dsa_ref.layout` derive everything position-dependent from `cu_seqlens`:
#
# * `positions(cu_seqlens)` — each token's RoPE position *inside its own sequence*;
# * `key_windows(cu_seqlens)` — for query $t$, the keys it may see: $[\mathrm{starts}_t, \mathrm{ends}_t)$,
#   from the start of its sequence up to and including itself.
#
# That window rule is the only mask in the whole project.

# %%
pos = positions(cu_seqlens)
starts, ends = key_windows(cu_seqlens)
if not ON_GPU:
    print("cu_seqlens:", cu_seqlens.tolist())
    print("positions: ", pos.tolist())
    print("starts:    ", starts.tolist())
    print("ends:      ", ends.tolist())

x = torch.randn(T, cfg.dim, device=device, dtype=dtype)
out = mla(x, cu_seqlens)
print("x", tuple(x.shape), "-> out", tuple(out.shape))

# %% [markdown]
# Inside `forward`, `project` computes the per-token pieces, `dense_qkv` builds the per-head keys
# and values of the dense form, and `windowed_attention` applies the softmax over each query's
# window:
#
# $$
# o_{t,h} = \sum_{s=\mathrm{starts}_t}^{\mathrm{ends}_t - 1}
#   \frac{\exp\!\big(\tau\, q_{t,h}\cdot k_{s,h}\big)}{\sum_{s'} \exp\!\big(\tau\, q_{t,h}\cdot k_{s',h}\big)}\, v_{s,h},
# \qquad
# \tau = \frac{m^2}{\sqrt{d_n + d_r}} .
# $$
#
# Let us rebuild this from the pieces, with an explicit `[T, T]` mask, and compare.

# %%
p = mla.project(x, pos)
q, k, v = mla.dense_qkv(p)  # [T, H, 192], [T, H, 192], [T, H, 128] at DeepSeek-V3.2 shapes
print("q", tuple(q.shape), " k", tuple(k.shape), " v", tuple(v.shape))

mask = window_mask(starts, ends, T)  # [T, T] bool
scores = torch.einsum("thd,shd->hts", q, k) * mla.softmax_scale  # [H, T, T]
probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)  # [H, T, T]
o_manual = torch.einsum("hts,shv->thv", probs, v)  # [T, H, v]
out_manual = mla.output(o_manual)
print("max |out - out_manual| =", (out - out_manual).abs().max().item())

# %% [markdown]
# ## 4. The attention pattern of a packed batch
#
# The mask is lower-triangular *within* each sequence and zero *across* sequences, so the
# `[T, T]` pattern is block-diagonal: one causal triangle per sequence. On the left is the window
# mask, in the middle the probabilities of one head, on the right their mean over heads. The
# first query of every sequence sees only itself (probability 1); later queries spread their
# attention over more keys.

# %%
from matplotlib.colors import LogNorm

P = probs.detach().cpu()
prob_cmap = plt.get_cmap("viridis").copy()
prob_cmap.set_bad("white")  # probability exactly 0 (outside the windows): white
log_norm = LogNorm(vmin=1e-3, vmax=1.0, clip=True)
fig, axes = plt.subplots(1, 3, figsize=(11, 3.8))
panels = [(mask.cpu().double(), "key windows: starts ≤ s < ends"),
          (P[0], "probabilities, head 0"),
          (P.mean(0), f"probabilities, mean over {P.shape[0]} heads")]
for i, (ax, (img, title)) in enumerate(zip(axes, panels)):
    if i == 0:
        ax.imshow(img, cmap="Greys", interpolation="nearest", vmin=0, vmax=1)
    else:
        im = ax.imshow(img.masked_fill(img == 0, float("nan")), cmap=prob_cmap, norm=log_norm,
                       interpolation="nearest")
        fig.colorbar(im, ax=ax, fraction=0.046)
    for b in cu_seqlens[1:-1].tolist():  # sequence boundaries
        ax.axhline(b - 0.5, color="#e65100", lw=0.8)
        ax.axvline(b - 0.5, color="#e65100", lw=0.8)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("key s")
    ax.set_ylabel("query t")
fig.suptitle(f"Causal attention over packed sequences of lengths {lengths} (log colour scale)",
             fontsize=11)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 5. Packed equals separate, and the layer is causal
#
# Because the windows never cross a sequence boundary and positions restart at 0 in every
# sequence, running the packed batch must give exactly what running each sequence on its own
# gives. And because a query's window ends at itself, changing token $t$ may only change outputs
# at $t$ and later, and only in $t$'s own sequence. Below, one token in the middle sequence is
# changed and we plot how much each output row moves.

# %%
bounds = cu_seqlens.tolist()
separate = torch.cat([mla(x[a:b]) for a, b in zip(bounds[:-1], bounds[1:])])  # one sequence at a time
print("packed vs separate, max |diff| =", (out - separate).abs().max().item())

t0 = int(cu_seqlens[1]) + lengths[1] // 2  # a token in the middle of the second sequence
x2 = x.clone()
x2[t0] += 1.0
moved = (mla(x2, cu_seqlens) - out).abs().amax(dim=-1).detach().cpu()  # [T]

fig, ax = plt.subplots(figsize=(9, 2.6))
ax.bar(range(T), moved, color=["#e65100" if t >= t0 else "#3949ab" for t in range(T)], width=0.9)
for b in cu_seqlens[1:-1].tolist():
    ax.axvline(b - 0.5, color="grey", lw=0.8, ls="--")
ax.axvline(t0, color="#e65100", lw=0.8)
ax.text(0.01, 0.9, "elsewhere exactly 0", transform=ax.transAxes, fontsize=9, va="top")
ax.set_xlabel("token")
ax.set_ylabel("max |Δ out|")
last = int(cu_seqlens[2]) - 1
ax.set_title(f"Perturbing token {t0} moves only tokens {t0}..{last}: its own sequence, from itself on",
             fontsize=10)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 6. Where position enters
#
# Only the rotary dims carry position. RoPE rotates each pair of rotary channels by an angle
# proportional to the token's position, so the rotary part of a score depends only on the
# distance between query and key:
#
# $$
# \big(R_{m}\, a\big) \cdot \big(R_{n}\, b\big) = a \cdot \big(R_{n-m}\, b\big).
# $$
#
# MLA rotates *interleaved* pairs $(2i, 2i+1)$ (the indexer of later chapters uses the half-split
# layout; both are config flags). Shifting both positions by the same amount leaves the dot
# product unchanged:

# %%
from dsa_ref.rope import apply_rope, rope_cos_sin, rope_inv_freq

inv_freq = rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope)  # YaRN frequencies from the config
a = torch.randn(1, cfg.qk_rope_head_dim, dtype=dtype, device=device)
b = torch.randn(1, cfg.qk_rope_head_dim, dtype=dtype, device=device)

def rotary_score(m, n):
    cos_m, sin_m = rope_cos_sin(torch.tensor([m], device=device), inv_freq, dtype=dtype)
    cos_n, sin_n = rope_cos_sin(torch.tensor([n], device=device), inv_freq, dtype=dtype)
    ra = apply_rope(a, cos_m, sin_m, interleaved=cfg.rope_interleaved)
    rb = apply_rope(b, cos_n, sin_n, interleaved=cfg.rope_interleaved)
    return (ra * rb).sum().item()

for shift in (0, 7, 1000):
    m, n = 5 + shift, 2 + shift
    print(f"positions ({m:>4}, {n:>4}): rotary score = {rotary_score(m, n):+.15f}")

# %% [markdown]
# ## 7. What a KV cache has to keep
#
# At generation time the keys and values of all earlier tokens are needed again at every step.
# The dense form would cache per-head keys and values; MLA only needs the latent and the shared
# rotary key, from which everything else can be recomputed:
#
# | cached per token and layer | numbers | DeepSeek-V3.2 |
# |---|---|---|
# | per-head keys and values | $H (d_n + d_r) + H d_v$ | $128 \cdot 192 + 128 \cdot 128 = 40{,}960$ |
# | latent and rotary key | $r + d_r$ | $512 + 64 = 576$ |
#
# But recomputing 128 heads of keys and values from the cache at every step is expensive.
# Chapter 2 shows how to avoid recomputing them at all: fold the up-projection into the query.

# %%
c32 = deepseek_v32().mla
dense_cache = c32.n_heads * c32.qk_head_dim + c32.n_heads * c32.v_head_dim
latent_cache = c32.latent_dim
print(f"dense per-head K+V: {dense_cache:,} numbers/token; latent: {latent_cache} numbers/token; "
      f"ratio {dense_cache / latent_cache:.1f}x")

# %% [markdown]
# ## 8. Checks
#
# The notebook ends with assertions, so the site build fails if any of the claims above stops
# being true.

# %%
H = cfg.n_heads
# shapes
assert out.shape == (T, cfg.dim)
assert q.shape == k.shape == (T, H, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
assert v.shape == (T, H, cfg.v_head_dim)
assert p.c_kv.shape == (T, cfg.kv_lora_rank) and p.k_pe.shape == (T, cfg.qk_rope_head_dim)
assert s == {"x": (7168,), "qr": (1536,), "q_nope": (128, 128), "q_pe": (128, 64), "c_kv": (512,),
             "k_pe": (64,), "k_nope": (128, 128), "v": (128, 128), "q": (128, 192), "k": (128, 192),
             "o": (128, 128), "out": (7168,)}
# the rotary key is one vector per token, shared by every head
k_rope = k[..., cfg.qk_nope_head_dim:]  # [T, H, rope]
assert torch.equal(k_rope, p.k_pe[:, None, :].expand_as(k_rope))
# the module equals plain masked softmax attention
check_close(out, out_manual)
# block-diagonal and causal: no probability outside the windows, rows sum to one
assert torch.all(probs[:, ~mask] == 0)
check_close(probs.sum(-1), torch.ones(H, T, dtype=dtype, device=device))
# packed = separate; a perturbation moves nothing before it and nothing in other sequences
check_close(out, separate)
seq_end = int(cu_seqlens[2])
assert torch.all(moved[:t0] == 0) and torch.all(moved[seq_end:] == 0)
assert torch.all(moved[t0:seq_end] > 0)
# RoPE scores depend on the distance only
assert abs(rotary_score(5, 2) - rotary_score(1005, 1002)) < 1e-12
# the softmax scale: 192^-1/2 * mscale^2 at DeepSeek-V3.2
assert abs(c32.softmax_scale - 192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2) < 1e-15
assert round(c32.softmax_scale, 5) == 0.13523
assert (dense_cache, latent_cache) == (40960, 576)
print("all checks passed")
