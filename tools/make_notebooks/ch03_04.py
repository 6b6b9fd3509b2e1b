"""Generate the notebooks of the DSA chapters: the lightning indexer, sparse attention and the loss.

    python tools/make_notebooks/ch03_04.py            # writes notebooks/03_lightning_indexer.ipynb,
                                                      #        notebooks/04_sparse_attention_and_loss.ipynb
    python tools/make_notebooks/ch03_04.py --check    # exit 1 if the stored notebooks differ from this script

The notebooks are written without outputs and with stable cell ids, so regenerating them gives no
diff unless this script changed. The site build and the tests execute them fresh.
"""

from __future__ import annotations

import sys

from nbgen import code, heading, main, md, notebook


# ---------------------------------------------------------------------------------------------
# Shared code cells

SETUP = r'''
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

ON_GPU = torch.cuda.is_available()
device = torch.device("cuda" if ON_GPU else "cpu")
if not ON_GPU:
    torch.set_num_threads(1)  # the tensors are tiny: more threads only add synchronisation
cfg = tiny()  # the tiny layer on both; a GPU only gets longer sequences and more training
print(f"device={device}")
print(cfg.indexer)
'''

# A layer whose main attention has something to imitate, and inputs with some structure.
TOY_LAYER = r'''
SHARPEN = 3.0  # a fresh MLA attends almost uniformly; a trained one does not
VOCAB = 32     # inputs are embeddings of a toy vocabulary, so patterns repeat and can be learned
vocab = torch.randn(VOCAB, cfg.mla.dim, generator=torch.Generator().manual_seed(123)).to(device)


def make_layer(seed=0):
    """A tiny DSA layer with its main attention sharpened (query and key up-projections x SHARPEN)."""
    torch.manual_seed(seed)
    layer = DSAttention(cfg, stage="dense_warmup").to(device)
    with torch.no_grad():
        layer.mla.wq_b.weight.mul_(SHARPEN)
        layer.mla.wkv_b.weight.mul_(SHARPEN)
    return layer


def tokens(n, generator):
    """n hidden states: embeddings of random tokens of the toy vocabulary, [n, dim]."""
    return vocab[torch.randint(0, VOCAB, (n,), generator=generator).to(device)]


def look_inside(layer, x, cu_seqlens):
    """What the layer computes before attention: main q/kv, the indexer's q/k/w, windows, target p."""
    pos = positions(cu_seqlens)
    starts, ends = key_windows(cu_seqlens)
    with torch.no_grad():
        p = layer.mla.project(x, pos)
        q, kv = layer.absorbed.absorbed_qkv(p)                # [T, H, r + d_r], [T, r + d_r]
        q_i, k_i, w_i = layer.indexer.project(x, p.qr, pos)  # [T, H_I, D_I], [T, D_I], [T, H_I]
        target = indexer_target(q, kv, sm_scale=layer.mla.softmax_scale, starts=starts, ends=ends)
    return dict(x=x, pos=pos, qr=p.qr, q=q, kv=kv, q_i=q_i, k_i=k_i, w_i=w_i, starts=starts, ends=ends,
                target=target)


def indexer_scores(indexer, view):
    """An indexer's current scores [T, S] for a batch seen by look_inside (no gradient)."""
    with torch.no_grad():
        q_i, k_i, w_i = indexer.project(view["x"], view["qr"], view["pos"])
        return lightning_indexer(q_i, k_i, w_i, starts=view["starts"], ends=view["ends"])


def mass_covered(p, idx):
    """Per query: the part of the target p that the selected keys cover (-1 slots cover nothing)."""
    return (p.gather(1, idx.clamp_min(0)) * (idx >= 0)).sum(dim=1)
'''


# ---------------------------------------------------------------------------------------------
# Chapter 3.1: the lightning indexer and top-k

CH3 = [
    md(r'''
    # Chapter 3.1 — The lightning indexer and top-k selection

    DeepSeek Sparse Attention lets each query attend to only $k$ keys (2048 in DeepSeek-V3.2). A
    second, much cheaper scorer decides which: the **lightning indexer**. For query $t$ and key $s$

    $$
    I_{t,s} = \sum_{j=1}^{H_I} w_{t,j}\,\operatorname{ReLU}\!\left(q_{t,j}\cdot k_s\right),
    $$

    with $H_I$ indexer heads of width $D_I$ (64 and 128 in DeepSeek-V3.2), one key $k_s$ per token
    shared by every indexer head, and one weight $w_{t,j}$ per query and head. Each query then keeps
    the $k$ keys of its window with the highest $I_{t,s}$.

    This notebook looks at:

    1. the score matrix $I$ over a causal sequence, beside the main attention it should predict;
    2. what the ReLU and the signed head weights do to the scores;
    3. the top-k selection drawn as a matrix;
    4. how much of the main attention a top-k set covers, as $k$ grows;
    5. the tie rule, on a row small enough to read.

    It ends with checks against `dsa_ref`. Everything runs on the `tiny()` config in a few seconds.
    '''),
    code(SETUP),
    md(r'''
    The indexer reads MLA's normalised query latent `qr`, so it lives inside a whole DSA layer. We
    build one with two changes that give the indexer something worth predicting. A freshly
    initialised MLA spreads its attention almost evenly over the window, which a trained model does
    not do, so the query and key up-projections are scaled by 3. And the hidden states are
    embeddings of tokens from a toy vocabulary of 32, so that patterns repeat.
    '''),
    code(TOY_LAYER, r'''
    layer = make_layer(seed=0)
    gen = torch.Generator().manual_seed(1)
    T = 48
    cu = torch.tensor([0, T], device=device)  # one causal sequence
    v = look_inside(layer, tokens(T, gen), cu)
    for name in ("qr", "q_i", "k_i", "w_i", "target"):
        print(f"{name:<7}{str(list(v[name].shape)):<14}{v[name].dtype}")
    '''),
    heading("1. The score matrix"),
    md(r'''
    `lightning_indexer(q, k, weights, starts=..., ends=...)` returns $I$ as a float32 `[T, S]`
    matrix, with $-\infty$ outside each query's key window $[\mathrm{starts}_t, \mathrm{ends}_t)$. For
    one causal sequence the window of query $t$ is keys $0..t$, so the finite scores form the lower
    triangle. Beside it is the target the indexer is trained towards (chapter 3.2): the main
    attention's probabilities summed over heads and normalised over the window, $p_{t,s}$.
    '''),
    code(r'''
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
    '''),
    md(r'''
    The untrained indexer's scores have nothing to do with where the main attention looks. Its
    picture is made of horizontal bands: the head weights $w_{t,j}$ of query $t$ scale (and may flip)
    its whole row. The correlation between $I_{t,:}$ and $\log p_{t,:}$ over each window, averaged
    over the queries, is close to zero; the dense warm-up of chapter 3.2 is what changes that.

    The function is short enough to check by hand: one einsum for all heads' dot products, the ReLU,
    a weighted sum over heads, and the window mask.
    '''),
    code(r'''
    def indexer_by_hand(q, k, w, starts, ends):
        logits = torch.einsum("tjd,sd->tjs", q.double(), k.double())         # [T, H_I, S]
        scores = torch.einsum("tjs,tj->ts", logits.relu(), w.double())      # [T, S]
        keep = window_mask(starts, ends, k.shape[0])
        return scores.masked_fill(~keep, float("-inf"))

    by_hand = indexer_by_hand(v["q_i"], v["k_i"], v["w_i"], v["starts"], v["ends"])
    err = (scores.double() - by_hand)[inside].abs().max().item()
    print(f"max |lightning_indexer - by hand| inside the windows: {err:.2e}")
    '''),
    md(r'''
    Two details of the inputs, both from DeepSeek-V3.2's code, are easy to miss:

    * the head weights $w_{t,j}$ are an unactivated linear map of $x_t$, computed in float32, with the
      constant $H_I^{-1/2} D_I^{-1/2}$ folded in; nothing keeps them positive;
    * $q$ and $k$ go through RoPE (half-split layout, on the first $d_r$ dims) and then, optionally,
      through the same orthonormal Hadamard matrix $\mathcal{H}$. Because
      $(\mathcal{H} q)\cdot(\mathcal{H} k) = q\cdot k$ the rotation changes no score in exact
      arithmetic; it exists to spread outliers before fp8 quantisation. Turning it off changes the
      scores only by float rounding:
    '''),
    code(r'''
    cfg_plain = replace(cfg, indexer=replace(cfg.indexer, use_hadamard=False))
    plain = LightningIndexer(cfg_plain).to(device)
    plain.load_state_dict(layer.indexer.state_dict())  # the same weights, no rotation
    scores_plain = indexer_scores(plain, v)
    print(f"max |scores without Hadamard - scores with it| = {(scores_plain - scores)[inside].abs().max().item():.2e}"
          f"  (scores themselves reach {scores[inside].abs().max().item():.2f})")
    '''),
    heading("2. The ReLU and the signed head weights"),
    md(r'''
    Each head $j$ casts a vote $w_{t,j}\operatorname{ReLU}(q_{t,j}\cdot k_s)$ for key $s$. The ReLU
    makes every vote one-sided: a head either fires on a key (positive dot product) or says nothing;
    it can never argue *against* a key because the key points away from its query. The sign of the
    vote comes from the weight alone, so a head with $w_{t,j} < 0$ is a head whose matches this query
    wants to avoid.

    A consequence: a key on which no head with a non-zero weight fires scores **exactly** 0. With
    only a few heads that happens often, which is one reason the tie rule of section 5 matters.
    '''),
    code(r'''
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
    '''),
    heading("3. Top-k over a causal sequence"),
    md(r'''
    `topk_indices(scores, k)` keeps, per query, the $k$ best keys of its window: highest score first,
    ties to the lower key index, never a $-\infty$ key, and `-1` in the slots a short window cannot
    fill. The picture shows every query's selection for $k = 8$ (the `tiny()` value). All heads of
    a query share one selection.
    '''),
    code(r'''
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
    '''),
    md(r'''
    Three things to notice. The first $k$ queries have at most $k$ keys in their window, so they keep
    all of them and pad with `-1`: for them sparse attention *is* dense attention. Nothing forces a
    query to select itself or its neighbours; DeepSeek-V3.2's indexer has no local window, and
    whether the diagonal is selected depends only on the scores. And the selection of an untrained
    indexer is scattered: it has not yet learned where the main attention looks.
    '''),
    heading("4. How much attention a top-k set covers"),
    md(r'''
    Sparse attention can only be as good as the keys it is given. A useful measure is the **recall
    of attention mass**: the part of the target $p_{t,:}$ (the head-summed, normalised main attention)
    that falls on the selected set $S_t$,

    $$
    \operatorname{recall}_t(k) = \sum_{s \in S_t} p_{t,s}, \qquad |S_t| = k .
    $$

    It is 1 when the set covers everything the main attention looks at. The best possible set is
    the $k$ largest entries of $p_{t,:}$ itself (the "oracle"); a scorer that is only correlated with
    $p$ does worse. Below: the oracle, two noisy copies of it ($\log p + \sigma\varepsilon$ with
    Gaussian $\varepsilon$), the untrained indexer, and keys chosen at random, averaged over queries
    whose window holds more keys than the largest $k$ shown.
    '''),
    code(r'''
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
    '''),
    md(r'''
    The oracle curve is the ceiling for any indexer at this main attention: its head-summed
    attention is concentrated, so a few keys already cover much of it. Random selection covers on
    average $k$ divided by the window size. The untrained indexer is hardly better than random;
    training it (chapter 3.2) moves it up towards the oracle. A noisy copy of $\log p$
    shows how much room there is between: what matters for top-k is only the *order* of the scores
    near the top of each row.
    '''),
    heading("5. The tie rule"),
    md(r'''
    `torch.topk` does not say in which order it returns equal values, and on many rows (the exact
    zeros of section 2, a row of $-\infty$ keys) several orders are equally "correct". A reference
    that other people compare against cannot leave that open, so `dsa_ref` fixes it:

    * highest score first; **equal scores go to the lower key index first**;
    * $-\infty$ keys are never selected;
    * a row with fewer than $k$ selectable keys is padded with `-1` at the end.

    A row small enough to read: keys 1 and 3 tie at 2, keys 0, 2 and 6 tie at 0, keys 4 and 7 are
    outside the window.
    '''),
    code(r'''
    inf = float("inf")
    row = torch.tensor([[0.0, 2.0, 0.0, 2.0, -inf, 1.0, 0.0, -inf]])
    for k in (4, 8):
        print(f"k = {k}: dsa_ref.topk_indices -> {topk_indices(row, k).tolist()[0]}")
        print(f"       torch.topk            -> {torch.topk(row, k).indices.tolist()[0]}   (may include -inf keys)")
    zeros = torch.zeros(1, 64)
    print("64 equal scores, k = 8:")
    print("  dsa_ref.topk_indices ->", topk_indices(zeros, 8).tolist()[0])
    print("  torch.topk           ->", torch.topk(zeros, 8).indices.tolist()[0], "(unspecified order)")
    '''),
    md(r'''
    The rule is implemented with one stable descending sort: a stable sort never reorders equal
    values, so among equal scores the lower index comes first. A fast kernel may break ties
    differently and still be right; compare it with the oracle through the multiset of selected
    *scores* per row, which is the same for every valid tie-break, rather than through the raw
    indices.
    '''),
    code(r'''
    mine = topk_indices(row, 4)
    other = torch.tensor([[3, 1, 5, 6]])  # a different but valid tie-break: key 6 instead of key 0
    same_scores = torch.equal(row.gather(1, mine).sort(dim=1).values, row.gather(1, other).sort(dim=1).values)
    print("selected indices differ:", mine.tolist()[0], "vs", other.tolist()[0], "| same selected scores:", same_scores)
    '''),
    heading("6. Checks"),
    code(r'''
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
    '''),
]


# ---------------------------------------------------------------------------------------------
# Chapter 3.2: sparse attention, the indexer loss and the training stages

CH4 = [
    md(r'''
    # Chapter 3.2 — Sparse attention, the indexer loss and the two training stages

    Chapter 3.1 produced, for every query $t$, a set $S_t$ of at most $k$ keys. This notebook puts the
    rest of DeepSeek Sparse Attention around it:

    1. **sparse attention**: softmax attention over $S_t$ only; with every window key selected it is
       dense attention, and with a small $k$ its error is governed by the attention mass it misses;
    2. **the indexer loss**: a KL divergence that pulls the indexer's distribution towards the main
       attention's;
    3. **the two training stages** of `DSAttention`, and exactly which tensors are detached;
    4. a **dense warm-up** run: about 150 Adam steps on the indexer alone, with the loss falling and
       the top-k recall rising;
    5. a few steps of the **sparse stage**, where every parameter trains and each loss reaches only
       its own parameters.

    It ends with checks against `dsa_ref`. On a CPU everything runs on the `tiny()` config in seconds.
    '''),
    code(SETUP),
    md(r'''
    The same toy layer as in chapter 3.1: MLA's query and key up-projections are scaled by 3 so the
    main attention is not nearly uniform, and the inputs are embeddings from a vocabulary of 32
    tokens.
    '''),
    code(TOY_LAYER, r'''
    layer = make_layer(seed=0)
    gen = torch.Generator().manual_seed(1)
    sm_scale, d_v = layer.mla.softmax_scale, cfg.mla.kv_lora_rank
    cu = torch.tensor([0, 24, 64], device=device)  # two packed causal sequences, 24 and 40 tokens
    T = int(cu[-1])
    v = look_inside(layer, tokens(T, gen), cu)
    q, kv, starts, ends = v["q"], v["kv"], v["starts"], v["ends"]
    print(f"absorbed q {list(q.shape)}, latent kv {list(kv.shape)}, sm_scale = {sm_scale:.4f}, d_v = {d_v}")
    '''),
    heading("1. Sparse attention with every key is dense attention"),
    md(r'''
    `sparse_mla(q, kv, indices, sm_scale=..., d_v=...)` is multi-query attention over the latent rows
    that `indices` names: for every head $h$ of query $t$,

    $$
    o_{t,h} = \sum_{i\,:\,\mathrm{idx}_{t,i} \ne -1}
    \frac{\exp(\tau\, q_{t,h}\cdot c_{\mathrm{idx}_{t,i}})}{\sum_{i'} \exp(\tau\, q_{t,h}\cdot c_{\mathrm{idx}_{t,i'}})}
    \; c_{\mathrm{idx}_{t,i}}^{[:d_v]} .
    $$

    If the indices of query $t$ list every key of its window, the sum runs over exactly the keys
    `dense_mla_attention` uses, so the two must agree — outputs and log-sum-exps — whatever the order
    of the slots.
    '''),
    code(r'''
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
    '''),
    heading("2. What a small k changes"),
    md(r'''
    With fewer keys, each head's softmax is renormalised over $S_t$. Write $m_{t,h}$ for the
    probability mass that head $h$'s *dense* attention puts on $S_t$, $o^{S}$ for sparse attention
    over $S_t$ and $o^{\bar S}$ for attention over the rest of the window. The dense output is the
    mixture $o = m\, o^{S} + (1-m)\, o^{\bar S}$, hence

    $$
    o^{S}_{t,h} - o_{t,h} = (1 - m_{t,h})\,\big(o^{S}_{t,h} - o^{\bar S}_{t,h}\big),
    \qquad m_{t,h} = e^{\,\mathrm{lse}^{S}_{t,h} - \mathrm{lse}_{t,h}} .
    $$

    The error is proportional to the **missed mass** $1 - m$, which is why the indexer is trained to
    put its top-k where the attention mass is. The log-sum-exps that `sparse_mla` returns give $m$
    directly. We check the identity on the oracle top-8 set (the 8 largest $p_{t,s}$):
    '''),
    code(r'''
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
    '''),
    md(r'''
    The relative output error against $k$, on a longer sequence, for three ways of choosing the
    keys: the oracle top-$k$ of $p$, the (still untrained) indexer, and random keys.
    '''),
    code(r'''
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
    '''),
    md(r'''
    Error falls as $k$ grows and vanishes once $S_t$ is the whole window. The oracle set is far
    better than random keys at every $k$. The untrained indexer is *worse* than random: it is not
    noise but a fixed, arbitrary preference for certain keys, so the part of the window it leaves out
    is systematically different from the part it keeps, and $o^{S} - o^{\bar S}$ in the identity
    above stays large. Training is what turns that preference into the right one.
    '''),
    heading("3. The indexer loss"),
    md(r'''
    The indexer is trained to predict where the main attention looks. The **target** for query $t$
    is the main attention's probabilities summed over the $H$ heads and normalised over the valid
    keys $V_t$, computed from detached main queries and keys:

    $$
    p_{t,s} = \frac{\sum_h P_{t,h,s}}{\sum_{s' \in V_t}\sum_h P_{t,h,s'}}, \qquad
    P_{t,h,:} = \operatorname{softmax}_{s \in V_t}\!\left(\tau\, q_{t,h}\cdot c_s\right).
    $$

    The **prediction** is $\log\operatorname{softmax}_{V_t}(I_{t,:})$, and the loss is the KL
    divergence, reduced over the valid query rows ($n$ of them for `reduction="mean"`) and scaled
    by `coeff`:

    $$
    \mathcal{L} = \frac{\mathrm{coeff}}{n}\sum_t \sum_{s \in V_t} p_{t,s}
    \left(\log p_{t,s} - \log\operatorname{softmax}_{V_t}(I_{t,:})_s\right).
    $$

    In the dense warm-up $V_t$ is the key window; in the sparse stage it is the selected set
    $S_t$, and both distributions are renormalised on it. The gradient with respect to the scores
    is simply $\frac{\mathrm{coeff}}{n}\big(\operatorname{softmax}_{V_t}(I_{t,:}) - p_{t,:}\big)$ on
    valid keys. All of that, computed by hand and compared with `indexer_loss`:
    '''),
    code(r'''
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
    '''),
    md(r'''
    The prediction is a `log_softmax`, never `log(softmax + eps)`: the eps version reports a smaller
    loss than the truth and silences the gradient of every key whose predicted probability is
    below eps — exactly the keys a badly trained indexer gets wrong.
    '''),
    heading("4. The two training stages"),
    md(r'''
    `DSAttention` runs one of two stages (DeepSeek-V3.2, section 2.1):

    | | main attention | what trains | loss of the indexer |
    |---|---|---|---|
    | `"dense_warmup"` | dense over the window | the indexer only (`trainable_parameters("dense_warmup")`) | KL over the window |
    | `"sparse"` | sparse over the top-k set | everything (`trainable_parameters("sparse")`) | KL over the top-k set |

    In both stages the same three cuts in the graph keep the two learning problems apart:

    * the indexer reads `x.detach()` and `qr.detach()`, so its loss cannot reach MLA's weights
      or earlier layers through its inputs;
    * the KL target is built from `q.detach()` and `kv.detach()`, so the loss cannot change the main
      attention to make it easier to predict;
    * the top-k indices are integers and carry no gradient, so the language-model loss never
      reaches the indexer through the selection.

    The layer returns the loss for logging but does not ask the training loop to add it. Its output
    passes through `IndexerLossAutoScaler`, an identity in forward whose backward also hands the loss
    the gradient `loss_scale`, as if `loss_scale * indexer_loss` had been added to the final loss. So
    one `backward()` of the language-model loss trains both. Below: the KL loss reaches exactly the
    indexer's parameters, and a backward through the output alone (zero output gradient) gives the
    indexer `loss_scale` times that gradient. The scale is captured when forward runs, so set it
    (with `set_indexer_loss_scale`) before the forward pass, not between forward and backward.
    '''),
    code(r'''
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
    '''),
    heading("5. A dense warm-up run"),
    md(r'''
    The warm-up of DeepSeek-V3.2 trains only the indexer, for 1000 steps of 16 sequences of 128K
    tokens at learning rate $10^{-3}$, with the rest of the model frozen. Here: a fresh toy layer,
    its MLA frozen, Adam on `trainable_parameters("dense_warmup")`, a new batch of two packed
    64-token sequences every step. There is no language model around this layer, so the output
    gradient is zero and the whole gradient is the one the auto-scaler injects. Every 10 steps we
    measure, on a fixed held-out sequence, the recall of attention mass of the top-8 set (chapter 3.1).
    '''),
    code(r'''
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
    '''),
    code(r'''
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
    '''),
    md(r'''
    The same output-error measure as in section 2, on the held-out sequence, now with the trained
    indexer:
    '''),
    code(r'''
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
    '''),
    md(r'''
    The loss falls fast and the top-8 set of the trained indexer covers a large part of what the
    main attention looks at, most of the way to the oracle. The KL does not go to zero: the indexer
    has 4 heads of width 16 and a ReLU, the main attention 4 heads over a 72-wide latent, and it can
    only approximate it. Nor does it need to: top-k only asks for the right *order* near the top
    of each row.
    '''),
    heading("6. A few steps of the sparse stage"),
    md(r'''
    Now the main attention runs over the selected keys and every parameter trains. A real model
    would add its language-model loss; this stand-alone layer gets a stand-in: the squared distance
    of its output from a frozen copy of itself running dense attention (so it is asked to make sparse
    attention behave like the dense one). The indexer keeps learning from the KL loss, now over the
    selected set only.

    Before training, one batch shows the separation of the two losses exactly. Three backward
    passes over the same forward pass: the stand-in loss with the KL injected (the normal case), the
    KL loss alone, and the stand-in loss with `loss_scale = 0`.
    '''),
    code(r'''
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
    '''),
    code(r'''
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
    '''),
    md(r'''
    The sparse KL is measured on a different set than the warm-up KL — only the $k$ selected keys,
    with both distributions renormalised there — so its values are not comparable with the curve of
    section 5. It keeps the indexer's ranking *inside* the selected set consistent with the main
    attention while the main model adapts to seeing only those keys.
    '''),
    heading("7. Checks"),
    code(r'''
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
    '''),
]


if __name__ == "__main__":
    sys.exit(main({"03_lightning_indexer.ipynb": notebook("ch03", CH3),
                 "04_sparse_attention_and_loss.ipynb": notebook("ch04", CH4)}, doc=__doc__, script="ch03_04.py"))
