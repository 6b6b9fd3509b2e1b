# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 7 — Long context
#
# At 128K tokens, anything a layer holds per (query, key) pair is huge: the lightning indexer's
# scores alone, `[T, S]` float32, are 64 GiB. `DSAttention` never builds such a tensor. This
# notebook takes the two streams that make it so apart, on small CPU shapes in float64:
#
# 1. what `[T, S]` costs at DeepSeek-V3.2's sizes, and what the streams hold instead;
# 2. the running top-k merged tile by tile (`merge_topk`), by hand, ties across tiles included;
# 3. the streamed selection against the whole-matrix one, index for index, on packed windows;
# 4. a probe that records the largest tensor an operation creates: whole matrix against stream;
# 5. the dense warm-up's indexer loss over key tiles (`block_plan`, `streamed_indexer_loss`): the
#    blocks drawn over the causal windows, and the loss and its gradients against the whole-matrix loss;
# 6. the whole layer step (`DSAttention`, both stages, forward and backward): its largest tensor
#    stops growing at the stream's budget;
# 7. on a GPU, the kernels' whole-matrix and streamed selections side by side (skipped elsewhere);
#
# and ends with assertions. It runs on a CPU in well under a minute.

# %%
import math

import matplotlib.pyplot as plt
import matplotlib.patches as patches
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dsa_ref import DSAttention, indexer_loss, key_windows, lightning_indexer, tiny, topk_indices
from dsa_ref.attention import dense_mla_attention
from dsa_ref.layout import one_sequence
from dsa_ref.streaming import merge_topk, streamed_topk_indices
from dsa_ref.streaming_loss import block_plan, streamed_indexer_loss

torch.set_num_threads(min(2, torch.get_num_threads()))
dtype = torch.float64
GiB = 2**30

# %% [markdown]
# ## 1. What `[T, S]` costs
#
# DeepSeek-V3.2: 128 attention heads, top-k $k = 2048$, an indexer of 64 heads. For one whole
# sequence of $T$ tokens ($S = T$ keys), the tensors a naive layer would hold, against what the
# streams hold: the selection `[T, k]` (int64), and one chunk of the stream at a time (a chunk of
# $C$ queries against a tile of keys; the kernels use chunks of up to $2^{28}$ scores).

# %%
K, H, H_I = 2048, 128, 64
print(f"{'T':>7} | {'scores [T,S] fp32':>18} | {'probs [T,H,S] bf16':>18} | {'selection [T,k] int64':>21}")
for T in (8192, 32768, 65536, 131072):
    print(f"{T:>7} | {T * T * 4 / GiB:>14.1f} GiB | {T * H * T * 2 / GiB:>14.0f} GiB | {T * K * 8 / GiB:>17.2f} GiB")

# %% [markdown]
# Quadratic against linear: at 128K the scores are 64 GiB and the selection 2 GiB. The streams
# keep the linear column (plus one chunk).

# %% [markdown]
# ## 2. The running top-k, one tile at a time
#
# Each row keeps its best $k$ so far, highest first and equal scores in ascending key order. A new
# tile of keys is appended *behind* them and the $k + n$ candidates are sorted again, **stably**,
# highest first (`merge_topk`). Every running key is lower than every key of the tile (tiles come
# in key order), so a stable sort puts equal scores in ascending key order overall: ties go to the
# lower key index across tile boundaries, exactly as `topk_indices` decides them on the whole row.
# `-inf` (outside the window) sorts last and becomes `-1`.
#
# One row of 10 keys, $k = 2$, tiles of 4 keys; the highest score, 5, appears at keys 2, 5 and 7,
# and the row's window ends before key 8:

# %%
scores = torch.tensor([[1.0, 3.0, 5.0, 0.0, 2.0, 5.0, 4.0, 5.0, -math.inf, -math.inf]], dtype=dtype)
k, tile = 2, 4
best_v = torch.full((1, k), -math.inf, dtype=dtype)
best_i = torch.full((1, k), -1, dtype=torch.int64)
for lo in range(0, scores.shape[1], tile):
    best_v, best_i = merge_topk(best_v, best_i, scores[:, lo:lo + tile], lo)
    print(f"after keys {lo}..{min(lo + tile, scores.shape[1]) - 1}: values {best_v[0].tolist()}, keys {best_i[0].tolist()}")
merged = torch.where(best_v > -math.inf, best_i, torch.full_like(best_i, -1))
row_whole = topk_indices(scores, k)
print("merged:", merged[0].tolist(), "  whole row:", row_whole[0].tolist())

# %% [markdown]
# Three keys tie at 5 for two places: keys 2 (first tile) and 5 (second tile) win over key 7 (second
# tile, the highest index); the last tile (keys 8 and 9, outside the window) never enters. The
# merged selection is the whole row's.

# %% [markdown]
# ## 3. The streamed selection, index for index
#
# `streamed_topk_indices` takes the queries a chunk at a time; a chunk only scores the keys its
# windows cover (for causal windows: up to its last query), one tile at a time, and merges. On a
# pack of four sequences (one shorter than $k$, so its rows end in `-1`), for several chunk and
# tile sizes, and on small-integer inputs where ties are everywhere:

# %%
cfg = tiny()
H_I, D_I, TOPK = cfg.indexer.n_heads, cfg.indexer.head_dim, 16
cu = torch.tensor([0, 40, 49, 130, 200])  # lengths 40, 9 (< top-k), 81, 70
T = int(cu[-1])
starts, ends = key_windows(cu)
g = torch.Generator().manual_seed(0)
q_i = torch.randn(T, H_I, D_I, generator=g, dtype=dtype)
k_i = torch.randn(T, D_I, generator=g, dtype=dtype)
w_i = torch.randn(T, H_I, generator=g, dtype=dtype)
whole = topk_indices(lightning_indexer(q_i, k_i, w_i, starts=starts, ends=ends), TOPK)  # [T, S] scores first
for chunk, tile in ((1, 1), (7, 5), (64, 16), (T, T)):
    streamed = streamed_topk_indices(q_i, k_i, w_i, TOPK, starts=starts, ends=ends, query_chunk=chunk, key_tile=tile)
    print(f"chunks of {chunk:3d} queries, tiles of {tile:3d} keys: identical = {torch.equal(streamed, whole)}")
# ties everywhere: small integers make many equal scores
qz, kz, wz = (torch.randint(-2, 3, t.shape, generator=g).to(dtype) for t in (q_i, k_i, w_i))
ties_whole = topk_indices(lightning_indexer(qz, kz, wz, starts=starts, ends=ends), TOPK)
ties_streamed = streamed_topk_indices(qz, kz, wz, TOPK, starts=starts, ends=ends, query_chunk=13, key_tile=3)
print("small-integer inputs, tiles of 3 keys: identical =", torch.equal(ties_streamed, ties_whole))
print("a row of the 9-token sequence (query 48, 9 keys):", whole[48].tolist())

# %% [markdown]
# ## 4. The largest tensor, measured
#
# A `TorchDispatchMode` sees every operation PyTorch runs, forward and backward. This probe
# records the largest tensor any of them creates (views of an existing tensor create nothing and
# are skipped), and which operation created it.

# %%
class LargestTensor(TorchDispatchMode):
    """Records the largest tensor storage (bytes) created by any operation run under it."""

    def __init__(self):
        super().__init__()
        self.bytes, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):  # a view shares its input's storage: it creates nothing
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                if t.untyped_storage().nbytes() > self.bytes:
                    self.bytes, self.op = t.untyped_storage().nbytes(), str(func)
        return out


def largest(fn):
    with LargestTensor() as probe:
        fn()
    return probe.bytes, probe.op


rows = []
for n in (256, 512, 1024, 2048):
    s_, e_ = key_windows(one_sequence(n))
    qn = torch.randn(n, H_I, D_I, generator=g, dtype=torch.float32)
    kn = torch.randn(n, D_I, generator=g, dtype=torch.float32)
    wn = torch.randn(n, H_I, generator=g, dtype=torch.float32)
    b_whole, op_whole = largest(lambda: topk_indices(lightning_indexer(qn, kn, wn, starts=s_, ends=e_), TOPK))
    b_stream, op_stream = largest(lambda: streamed_topk_indices(qn, kn, wn, TOPK, starts=s_, ends=e_,
                                                                query_chunk=64, key_tile=128))
    rows.append((n, b_whole, b_stream))
    print(f"T = {n:5d}: whole matrix {b_whole / 2**20:7.2f} MiB ({op_whole}), stream {b_stream / 2**20:5.2f} MiB ({op_stream})")

# %% [markdown]
# The whole-matrix selection's largest tensor is the indexer's per-head logits `[T, H_I, S]` and
# grows with $T^2$; the stream's is one chunk's tile logits `[C, H_I, tile]` (here $C = 64$
# queries, tiles of 128 keys) until the selection itself, `[T, k]` int64, grows past it: linear.

# %%
fig, ax = plt.subplots(figsize=(5.5, 3.4))
ns = [r[0] for r in rows]
ax.loglog(ns, [r[1] / 2**20 for r in rows], "o-", label="whole matrix")
ax.loglog(ns, [r[2] / 2**20 for r in rows], "s-", label="streamed (chunks of 64, tiles of 128)")
ax.set_xlabel("tokens T")
ax.set_ylabel("largest tensor (MiB)")
ax.set_title("Top-k selection: the largest tensor")
ax.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 5. The dense warm-up's loss over key tiles
#
# In the dense warm-up the indexer learns to imitate the main attention summed over heads over the
# whole window. The loss needs, per row, four sums over the window (the mass $M$, $A = \sum m\log m$,
# $B = \sum m I$ and the log-normaliser $Z$ of the index scores, the last one with online
# normalisation), and they accumulate block by block: a block is a chunk of rows times a tile of
# keys, `block_plan` lists them, and each block keeps only the rows from the first to the last one
# whose window meets its tile. The backward visits the same blocks again and recomputes them. The
# blocks over the pack of section 3, chunks of 32 rows, tiles of 24 keys:

# %%
plan = block_plan(starts, ends, query_chunk=32, key_tile=24)
fig, ax = plt.subplots(figsize=(5, 5))
inside = (torch.arange(T)[None, :] >= starts[:, None]) & (torch.arange(T)[None, :] < ends[:, None])
ax.imshow(inside.numpy(), cmap="Greys", alpha=0.35, interpolation="nearest")
for r0, r1, lo, hi in plan:
    ax.add_patch(patches.Rectangle((lo - 0.5, r0 - 0.5), hi - lo, r1 - r0, fill=False, lw=1.2, ec="tab:blue"))
ax.set_xlabel("key")
ax.set_ylabel("query")
ax.set_title(f"{len(plan)} blocks over the windows (grey)")
plt.tight_layout()
plt.show()
print(f"{len(plan)} blocks; the largest holds {max((r1 - r0) * (hi - lo) for r0, r1, lo, hi in plan)} "
      f"(row, key) pairs of the {T * T} in [T, S]")

# %% [markdown]
# The streamed loss against the whole-matrix loss (`indexer_loss` over the `[T, S]` index scores,
# the main attention's probabilities recomputed from its LSE), value and gradients of the
# indexer's three inputs, in float64:

# %%
Hq, D = 4, 24
q = torch.randn(T, Hq, D, generator=g, dtype=dtype)
kv = torch.randn(T, D, generator=g, dtype=dtype)
_, lse = dense_mla_attention(q, kv, sm_scale=0.3, d_v=16, starts=starts, ends=ends)
leaves = [t.clone().requires_grad_() for t in (q_i, k_i, w_i)]
loss_whole = indexer_loss(lightning_indexer(*leaves, starts=starts, ends=ends), q, kv, sm_scale=0.3,
                          starts=starts, ends=ends)
grads_whole = torch.autograd.grad(loss_whole, leaves)
streamed_leaves = [t.clone().requires_grad_() for t in (q_i, k_i, w_i)]
loss_streamed = streamed_indexer_loss(*streamed_leaves, q, kv, lse, sm_scale=0.3, starts=starts, ends=ends,
                                      query_chunk=32, key_tile=24)
grads_streamed = torch.autograd.grad(loss_streamed, streamed_leaves)
print(f"loss: whole {loss_whole.item():.12f}, streamed {loss_streamed.item():.12f}")
for name, a, b in zip(("q_i", "k_i", "w_i"), grads_whole, grads_streamed):
    print(f"grad {name}: max |difference| {float((a - b).abs().max()):.1e} (largest entry {float(a.abs().max()):.2f})")

# %% [markdown]
# ## 6. The whole layer step
#
# `DSAttention` (the `tiny()` configuration, float32) for one causal sequence, forward and backward
# of every parameter, under the probe. The layer's streams are sized for a GPU: a chunk may hold
# `DEFAULT_CHUNK_ELEMENTS` $= 2^{26}$ elements (256 MiB in float32), tiles are 4096 keys. With
# `tiny()`'s 4 heads, a whole `[T, H, S]` block fits that budget up to 4096 tokens, so short
# sequences run in one chunk; from there on the chunks split and the largest tensor stays at the
# budget, while `[T, H, S]` keeps growing with $T^2$.

# %%
from dsa_ref.attention import DEFAULT_CHUNK_ELEMENTS

torch.manual_seed(0)
layer = DSAttention(tiny(), dtype=torch.float32)
n_heads = layer.config.mla.n_heads
step_rows = []
for n, stages in ((1024, ("dense_warmup", "sparse")), (4096, ("dense_warmup", "sparse")), (8192, ("sparse",))):
    x = torch.randn(n, layer.config.mla.dim, requires_grad=True)
    cu_n = one_sequence(n)
    for stage in stages:
        def step():
            layer(x, cu_n, stage=stage).output.square().mean().backward()
        b, op = largest(step)
        layer.zero_grad(set_to_none=True)
        step_rows.append((n, stage, b, op))
        print(f"T = {n:5d} {stage:12s}: largest tensor {b / 2**20:6.0f} MiB ({op}); "
              f"[T, S] {n * n * 4 / 2**20:5.0f} MiB, [T, H, S] {n * n * 4 * n_heads / 2**20:5.0f} MiB")

# %% [markdown]
# At 8192 tokens the largest tensor is one chunk's (256 MiB, the budget) where `[T, H, S]` would be
# 1 GiB: in the sparse stage a chunk of the selection's tile logits `[C, H_I, tile]` and of the slot
# operations' gathered rows; in the dense warm-up the main attention's `[C, H, S']` score block and
# the loss's blocks. The budget is what a reader lowers to fit a smaller machine; the test suite
# runs the same layer with budgets of a few elements. At DeepSeek-V3.2's sizes on the GPU the
# same streams run at 128K tokens (chapter page: the measurements).

# %% [markdown]
# ## 7. On a GPU, with the kernels
#
# Where CUDA and TileLang are available, the same comparison at DeepSeek-V3.2's indexer shapes
# (64 heads x 128, top-k 2048, bf16, 16384 tokens): the kernels' whole-matrix selection (the
# indexer kernel's `[T, S]` scores, then the radix select) against the streamed one with the
# kernels' chunk selector, chunks of 2048 queries. Peak memory from `torch.cuda.max_memory_allocated`.
# Elsewhere this section only says why it is skipped.

# %%
from dsa_ref import dispatch
from dsa_ref.dispatch import kernels_available

ok, why = kernels_available()
if ok:
    n, topk_gpu = 16384, 2048
    gg = torch.Generator(device="cuda").manual_seed(0)
    qg = torch.randn(n, 64, 128, device="cuda", generator=gg).bfloat16()
    kg = torch.randn(n, 128, device="cuda", generator=gg).bfloat16()
    wg = torch.randn(n, 64, device="cuda", generator=gg) / 8
    sg, eg = key_windows(one_sequence(n, device="cuda"))
    select_gpu = dispatch.chunk_selector("tilelang", q_i=qg, k_i=kg, w_i=wg)
    runs = {
        "whole matrix": lambda: dispatch.topk_indices(
            dispatch.lightning_indexer(qg, kg, wg, starts=sg, ends=eg, backend="tilelang"), topk_gpu, backend="tilelang"),
        "streamed": lambda: streamed_topk_indices(qg, kg, wg, topk_gpu, starts=sg, ends=eg, query_chunk=2048,
                                                  chunk_selector=select_gpu),
    }
    picked = {}
    for name, fn in runs.items():
        fn()  # compile / warm up
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        picked[name] = fn()
        torch.cuda.synchronize()
        print(f"{name:13s}: peak {(torch.cuda.max_memory_allocated() - base) / GiB:.2f} GiB above the inputs")
    gpu_identical = torch.equal(picked["whole matrix"], picked["streamed"])
    print("identical selections:", gpu_identical)
    assert gpu_identical
else:
    print("skipped:", why)

# %% [markdown]
# ## Checks

# %%
assert torch.equal(merged, row_whole) and merged[0].tolist() == [2, 5]
for chunk, tile in ((1, 1), (7, 5), (64, 16)):
    assert torch.equal(streamed_topk_indices(q_i, k_i, w_i, TOPK, starts=starts, ends=ends, query_chunk=chunk,
                                             key_tile=tile), whole)
assert torch.equal(ties_streamed, ties_whole)
assert (whole[48, 9:] == -1).all() and (whole[48, :9] >= 40).all(), "9 keys for top-16: the rest is -1"
# the stream's largest tensor does not grow with T; the whole matrix's grows like T^2
assert rows[-1][2] <= 8 * rows[0][2] and rows[-1][1] >= 32 * rows[0][1]  # 8x the tokens: linear vs quadratic
torch.testing.assert_close(loss_streamed, loss_whole, rtol=1e-10, atol=1e-12)
for a, b in zip(grads_whole, grads_streamed):
    torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-11)
for n, stage, b, op in step_rows:
    assert b <= DEFAULT_CHUNK_ELEMENTS * 4, f"{stage} at {n} tokens: {b} bytes ({op}) exceed one chunk's budget"
assert step_rows[-1][2] < step_rows[-1][0] ** 2 * 4 * n_heads, "at 8192 tokens no tensor of [T, H, S] size"
print("all checks passed")
