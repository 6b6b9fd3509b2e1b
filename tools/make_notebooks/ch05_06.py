"""Generate the notebooks of chapters 4.1 and 4.2: packed THD sequences and context parallelism.

    python tools/make_notebooks/ch05_06.py            # writes notebooks/05_thd_packing.ipynb,
                                                      #        notebooks/06_context_parallel.ipynb
    python tools/make_notebooks/ch05_06.py --check    # exit 1 if the stored notebooks differ from this script

The notebooks are written without outputs and with stable cell ids, so regenerating them gives no
diff unless this script changed. The site build and the tests execute them fresh. Notebook 06
starts two gloo ranks through tools/cp_gloo_demo.py.
"""

from __future__ import annotations

import sys

from nbgen import code, heading, main, md, notebook


# ---------------------------------------------------------------------------------------------
# Chapter 4.1: packed THD sequences

SETUP_05 = r'''
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
'''

CH5 = [
    md(r'''
    # Chapter 4.1 — Packed sequences (THD)

    Training data comes as documents of very different lengths. Padding each to the longest wastes
    compute, so the tokens of several documents are **packed** end to end into one token dimension
    (the "THD" layout: tokens, heads, dim) and a vector `cu_seqlens` records where each document
    starts. A pack of $N$ sequences of lengths $L_0, \dots, L_{N-1}$ has

    $$
    \mathrm{cu}_0 = 0, \qquad \mathrm{cu}_{i+1} = \mathrm{cu}_i + L_i, \qquad T = \mathrm{cu}_N .
    $$

    Packing is only correct if no token can see another document. In `dsa_ref` every mask is a
    **key window**: query $t$ may use key $s$ iff $s \in W_t = [\mathrm{start}(t),\, t + 1)$, where
    $\mathrm{start}(t)$ is the first token of $t$'s sequence. This notebook

    1. builds the windows and RoPE positions of a pack;
    2. draws the windows as a block-diagonal picture, beside the plain causal mask;
    3. shows what leaks through a plain causal mask in a DSA layer, and that the windows stop it;
    4. checks that the other documents do not change by a single bit when one document changes;
    5. separates two things often confused: restarting RoPE positions and isolating documents;
    6. treats a padded batch as a pack, and looks at the loss reduction and the top-k slots;

    and ends with assertions. It runs on the `tiny()` config on a CPU in a few seconds.
    '''),
    code(SETUP_05),
    heading("1. Windows and positions of a pack"),
    md(r'''
    `key_windows(cu_seqlens)` gives two int64 vectors, `starts` and `ends`, with
    $W_t = [\mathrm{starts}_t, \mathrm{ends}_t)$; `positions(cu_seqlens)` gives each token's RoPE
    position inside its own sequence, $t - \mathrm{start}(t)$. Writing $\sigma(t)$ for the sequence
    of token $t$ (the last $i$ with $\mathrm{cu}_i \le t$):

    $$
    \mathrm{start}(t) = \mathrm{cu}_{\sigma(t)}, \qquad \mathrm{end}(t) = t + 1, \qquad
    \mathrm{pos}(t) = t - \mathrm{cu}_{\sigma(t)} .
    $$

    The empty sequence (length 0) owns no token; it shows up only as a repeated value in
    `cu_seqlens`.
    '''),
    code(r'''
    seq = sequence_ids(cu_seqlens)
    pos = positions(cu_seqlens)
    starts, ends = key_windows(cu_seqlens)
    for name, v in (("sequence", seq), ("position", pos), ("starts", starts), ("ends", ends)):
        print(f"{name:<9}", " ".join(f"{int(i):2d}" for i in v))
    '''),
    heading("2. The windows as a picture"),
    md(r'''
    Drawn as a matrix (query $t$ down, key $s$ across), the windows of a pack are lower triangles on
    the diagonal, one per sequence: a **block-diagonal** causal mask. A plain causal mask over the
    whole pack, $s \le t$, is the full lower triangle. The difference, in red on the right, is every
    pair in which a query would look into an earlier document.
    '''),
    code(r'''
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
    '''),
    heading("3. What leaks through a plain causal mask"),
    md(r'''
    A DSA layer has **two** places where a document can see another: the indexer scores every key
    of the window and the top-k picks among them, and the main attention then reads the picked keys.
    With a plain causal mask both leak. We build a small layer whose MLA weights are scaled by 3
    (a fresh layer spreads its attention almost evenly; a trained one does not) and run it three
    ways: packed with `cu_seqlens`, packed *without* it (one causal sequence of $T$ tokens), and each
    sequence on its own.
    '''),
    code(r'''
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
    '''),
    md(r'''
    How much of the main attention lands in other documents under the plain mask? For every query we
    add up the softmax probability (averaged over heads) that falls on keys of an earlier document.
    The first sequence has nothing before it; every later one spends part of its attention on
    strangers.
    '''),
    code(r'''
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
    '''),
    heading("4. Isolation is exact"),
    md(r'''
    With the windows, a document's output is a function of its own tokens only. In floating point
    this holds **bit for bit**: a key outside a window gets score $-\infty$, weight exactly 0, and
    adds exactly 0 to every sum; the matrix shapes do not change, so neither does the order of the
    remaining additions. Replacing every token of one sequence must leave the other sequences'
    outputs and selections `torch.equal` to before.
    '''),
    code(r'''
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
    '''),
    heading("5. Restarting positions is not isolation"),
    md(r'''
    Packed training restarts RoPE positions in every document, so a document sees the positions it
    would see alone. It is tempting to think that this is what separates documents. It is not:
    RoPE rotates $q_t$ by $\mathrm{pos}(t)$ and $k_s$ by $\mathrm{pos}(s)$, and a dot product of two
    rotated vectors depends only on the difference,

    $$
    (R_{\mathrm{pos}(t)}\, q) \cdot (R_{\mathrm{pos}(s)}\, k) = q \cdot R_{\mathrm{pos}(s) - \mathrm{pos}(t)}\, k ,
    $$

    and inside one document $\mathrm{pos}(s) - \mathrm{pos}(t) = s - t$ whether positions restart or
    not. So (in exact arithmetic) global positions with the right windows give the same outputs as
    restarted ones, and restarted positions with a plain causal mask still leak. Only the windows
    isolate. (Restarting still matters in practice: in low precision the cosines of large angles
    lose digits, and a KV cache or a per-document run expects positions from 0.)
    '''),
    code(r'''
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
    '''),
    heading("6. A padded batch is a pack; the loss; the top-k slots"),
    md(r'''
    A padded batch `[B, S, dim]` is the pack of $B$ sequences of length $S$:
    $\mathrm{cu} = [0, S, 2S, \dots, BS]$ and `x.reshape(B * S, dim)`. Nothing else is needed.
    '''),
    code(r'''
    B, S = 3, 8
    xb = torch.randn(B, S, cfg.mla.dim, dtype=dtype, generator=torch.Generator().manual_seed(3))
    cu_batch = torch.arange(B + 1) * S
    with torch.no_grad():
        out_batch = layer(xb.reshape(B * S, -1), cu_batch).output.reshape(B, S, -1)
        out_loop = torch.stack([layer(xb[i]).output for i in range(B)])
    batch_err = (out_batch - out_loop).abs().max().item()
    print(f"cu_seqlens {cu_batch.tolist()}: max |packed batch - loop over the batch| = {batch_err:.1e}")
    '''),
    md(r'''
    **The loss of a pack.** With `loss_reduction="mean"` the indexer KL is averaged over all valid
    query rows *of the pack* (every token is a valid row: its window holds at least itself). So the
    packed loss is not the plain average of the per-sequence losses but the row-weighted one,

    $$
    \mathcal{L}_{\text{pack}} = \frac{1}{T}\sum_{t} \mathrm{KL}_t = \sum_i \frac{L_i}{T}\,\mathcal{L}_i ,
    $$

    the same convention as a per-token language-model loss. With `"sum"` it is the sum over the
    sequences of their summed losses, $\sum_i L_i\,\mathcal{L}_i$ in terms of their means.
    '''),
    code(r'''
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
    '''),
    md(r'''
    **Short sequences and top-k.** A query keeps $\min(k, \lvert W_t\rvert)$ valid slots and pads the rest with
    `-1`. In a pack the window is the query's own prefix, so the count restarts at every document:
    the length-1 sequence selects only itself, and a sequence shorter than $k$ never fills a row.
    '''),
    code(r'''
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
    '''),
    heading("Checks"),
    code(r'''
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
    '''),
]


# ---------------------------------------------------------------------------------------------
# Chapter 4.2: context parallelism

SETUP_06 = r'''
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch

import dsa_ref
from dsa_ref import DSAttention, cp_shard_index, deepseek_v32, key_windows, positions, tiny, window_mask
from dsa_ref.context_parallel import global_order

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
'''

CH6 = [
    md(r'''
    # Chapter 4.2 — Context parallelism

    At 128K tokens one GPU cannot hold a layer's activations, so the tokens are spread over
    `cp_size` ranks. A rank keeps its **queries** local but needs every **key** its queries may
    see. DSA makes the keys small: one latent row (576 numbers) and one indexer key (128 numbers)
    per token. So `dsa_ref.context_parallel` simply **all-gathers** them, instead of passing 128
    heads of K and V around a ring. This notebook

    1. draws the zigzag split, rank by rank, and checks the ownership formula;
    2. shows each rank's key windows: local queries, global keys;
    3. measures the causal work per rank, contiguous vs zigzag, and why zigzag balances it exactly;
    4. emulates the all-gather and the reorder in one process;
    5. runs the layer on **two real gloo processes** and compares with the single-process run;
    6. works out the loss scale and the bytes per token at DeepSeek-V3.2 scale;

    and ends with assertions.
    '''),
    code(SETUP_06),
    heading("1. The zigzag split"),
    md(r'''
    Causal attention is lopsided: the last query of a sequence sees every key, the first sees one.
    Cutting a sequence into `cp_size` contiguous pieces gives the last rank almost all the work.
    The zigzag split cuts every sequence of length $L$ into $2\,\mathrm{cp}$ chunks of
    $c = L / (2\,\mathrm{cp})$ tokens and gives rank $r$ chunks $r$ and $2\,\mathrm{cp} - 1 - r$: one
    cheap chunk from the front and one expensive chunk from the back. A token at position $p$ of its
    sequence lies in chunk $j = \lfloor p / c \rfloor$ and belongs to

    $$
    \mathrm{owner}(j) = \min\big(j,\; 2\,\mathrm{cp} - 1 - j\big), \qquad j = 0, \dots, 2\,\mathrm{cp} - 1 .
    $$

    Every sequence is split on its own, so every sequence length must divide by $2\,\mathrm{cp}$
    (pad it otherwise; `cp_shard_index` raises a `ValueError` naming the sequences that do not).
    '''),
    code(r'''
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
    '''),
    heading("2. Local queries, global keys"),
    md(r'''
    A rank holds the tokens `query_index = cp_shard_index(cu, cp, r)`, in that order. Their windows
    are the windows of the full run, in the index space of the **global** packed keys:

    $$
    W_i = [\mathrm{start}(q_i),\, q_i + 1),
    $$

    where $q_i$ is `query_index[i]`, the global index of local query $i$: that is
    `key_windows(cu, query_index)`. The picture shows each rank's rows: a rank's queries
    reach back over every earlier key of their sequence, whoever owns it. That is why each rank
    needs the keys of all ranks.
    '''),
    code(r'''
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
    '''),
    heading("3. Causal work per rank"),
    md(r'''
    The work of a query is the size of its window (the indexer scores every key of it; dense
    attention reads every key of it). Chunk $j$ of a sequence holds queries $jc, \dots, jc + c - 1$, so
    its work is

    $$
    w_j = \sum_{i=0}^{c-1} (jc + i + 1) = j c^2 + \tfrac{c(c+1)}{2} .
    $$

    Zigzag gives rank $r$ the chunks $r$ and $2\,\mathrm{cp} - 1 - r$, whose indices always add up to
    $2\,\mathrm{cp} - 1$:

    $$
    w_r + w_{2\mathrm{cp}-1-r} = (2\,\mathrm{cp} - 1)\,c^2 + c(c+1) \quad \text{for every } r ,
    $$

    exactly balanced. The contiguous split gives rank $r$ chunks $2r$ and $2r + 1$, i.e.
    $(4r + 1)c^2 + c(c+1)$, which grows with $r$; the last rank does $(2\,\mathrm{cp} - 1)/\mathrm{cp}$
    times the mean for long sequences, close to 2. (The sparse attention itself reads
    $\min(\lvert W_t\rvert, k)$ keys per query, nearly the same for every query once $t \ge k$; the indexer is
    where the causal imbalance lives. Its small imbalance in the plot is rank 0 holding the first
    $k$ tokens, whose windows are shorter than $k$, in either layout; it shrinks as $L / k$ grows.)
    '''),
    code(r'''
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
    '''),
    heading("4. The all-gather and the reorder, emulated"),
    md(r'''
    Each rank computes the latent KV rows and indexer keys of its own tokens, with the RoPE positions
    of their place in their sequence (`positions(cu, query_index)`). `all_gather` concatenates the
    ranks' rows **in rank order**; row $j$ of the result is token `global_order(cu, cp)[j]`, so
    indexing with the inverse permutation (`argsort`) puts token $i$ at row $i$. Here the ranks are
    emulated in one process, to see that the result is the full run's KV.
    '''),
    code(r'''
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
    '''),
    heading("5. Two real ranks over gloo"),
    md(r'''
    `tools/cp_gloo_demo.py` forks two processes that form a gloo process group (the same code runs on
    NCCL). Every rank builds the same float64 layer and pack from a seed, runs its zigzag shard through
    `cp_dsa_forward`, back-propagates a fixed linear "LM loss", all-reduces the parameter gradients
    (the weights are replicated) and compares with the single-process run. Started here with
    `--save`, it also writes its results in global token order, and the notebook repeats the
    comparison on its own. From a shell:
    `python -m torch.distributed.run --nproc-per-node 2 tools/cp_gloo_demo.py` does the same with one
    process per rank.
    '''),
    code(r'''
    root = Path(dsa_ref.__file__).resolve().parents[1]
    script = root / "tools" / "cp_gloo_demo.py"
    assert script.is_file(), f"{script} not found: run this notebook from a source checkout of dsa_ref"
    saved = Path(tempfile.mkdtemp()) / "cp_run.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p))
    cmd = [sys.executable, str(script), "--cp", "2", "--lengths", "12,4,0,32", "--save", str(saved)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    print(proc.stdout)
    if proc.returncode != 0:
        print(proc.stderr[-3000:])
    print(f"exit status {proc.returncode}, {time.perf_counter() - t0:.1f} s including process start-up")
    '''),
    code(r'''
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
    '''),
    heading("6. The loss scale, and the bytes at DeepSeek-V3.2 scale"),
    md(r'''
    **Why the per-rank loss divides by the global row count.** The single-process mean loss is
    $\mathcal{L} = \frac{1}{N}\sum_{t} \mathrm{KL}_t$ over the $N$ valid rows of the whole pack. Rank
    $r$ holds rows $R_r$ and computes $\mathcal{L}_r = \frac{1}{N}\sum_{t \in R_r} \mathrm{KL}_t$
    ($N$ comes from one all-reduce of a count), so $\sum_r \mathcal{L}_r = \mathcal{L}$: the shares in
    the bar chart add up to the single-process loss, and the gradients of the replicated weights,
    **summed** over ranks, are the single-process gradients. Dividing by the local row count instead
    would weigh every rank equally, right only when all ranks hold the same number of valid rows.

    **Megatron's convention.** Megatron *averages* gradients over the DP $\times$ CP group. An average
    over the cp ranks of one sequence divides the sum by cp, so both losses must be multiplied by cp
    to compensate: the LM loss, and the indexer loss through its scale
    (`set_indexer_loss_scale(model, cp_size / num_microbatches)`, what Megatron's schedule sets).
    '''),
    code(r'''
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
    '''),
    md(r'''
    The documentation page "Context parallelism at scale" (`docs/chapters/06b_cp_at_scale.md`) works
    these numbers out for cp = 1 to 16: communication, memory, FLOPs and the balance of causal work,
    against ring attention.
    '''),
    heading("Checks"),
    code(r'''
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
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert all(e < 1e-10 for e in nb_errors.values()), nb_errors
    assert same_topk
    assert abs(shares.sum() - ref.indexer_loss.item()) < 1e-12
    # loss scale: summed gradients are the single-process ones; an average needs a factor cp
    torch.testing.assert_close(g_sum, g_single, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(cp_run * g_avg, g_single, rtol=1e-9, atol=1e-12)
    # bytes per token at DeepSeek-V3.2 shapes
    assert (allgather_values, ring_values) == (704, 40960)
    print("all checks passed")
    '''),
]


if __name__ == "__main__":
    sys.exit(main({"05_thd_packing.ipynb": notebook("ch05", CH5), "06_context_parallel.ipynb": notebook("ch06", CH6)}, doc=__doc__, script="ch05_06.py"))
