"""``dsa-ref verify``: run every chapter's identities, and optionally the TileLang kernels, and report.

    dsa-ref verify              # the CPU identities on the tiny config (~10 s on 2 cores)
    dsa-ref verify --gpu        # also the TileLang kernels against the reference at DeepSeek-V3.2 shapes
    dsa-ref verify --json       # one JSON object on stdout instead of the table
    dsa-ref verify --only loss  # the checks whose name contains "loss"
    python -m dsa_ref verify    # the same without the console script
    dsa-ref inspect PATH --layer 0   # one attention layer of a local DeepSeek-V3.2 / GLM-5 checkpoint

A progress bar goes to stderr, the table (check, shapes, dtype, max error, tolerance, result, time)
to stdout. The exit code is 0 when every check passes, 1 when one fails, 2 for a usage error (for
example ``--gpu`` without CUDA or tilelang; the reason is printed).

Each check compares two computations that must agree -- e.g. dense and absorbed MLA, sparse attention
over every window key and dense attention -- with a tolerance from `dsa_ref.compare.TOLERANCES`, and
reports the largest absolute error together with the bound that applied at that element.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = ["main", "CheckResult", "cpu_checks", "gpu_checks", "run_checks", "format_table"]


@dataclass
class CheckResult:
    """One row of the verify table.

    Attributes:
        name: the check.
        shapes: the main shapes involved.
        dtype: the dtype compared.
        max_error: largest absolute error (for index checks: number of wrong rows).
        tolerance: the bound that applied at that element (index checks: 0).
        passed: whether the check passed.
        seconds: wall time.
        detail: a one-line explanation (the failing criteria when it fails).
        skipped: the check did not run (``detail`` says why).
    """

    name: str
    shapes: str
    dtype: str
    max_error: float
    tolerance: float
    passed: bool
    seconds: float = 0.0
    detail: str = ""
    skipped: bool = False

    def as_dict(self) -> dict:
        """Plain values for ``--json`` (non-finite numbers become strings)."""
        def num(x):
            return x if math.isfinite(x) else str(x)
        return {"name": self.name, "shapes": self.shapes, "dtype": self.dtype, "max_error": num(self.max_error),
                "tolerance": num(self.tolerance), "passed": self.passed, "seconds": round(self.seconds, 4),
                "detail": self.detail, "skipped": self.skipped}


@dataclass
class _Outcome:
    shapes: str
    comparisons: list = field(default_factory=list)  # dsa_ref.compare.Comparison
    dtype: str | None = None
    # for checks that are not tensor comparisons:
    max_error: float | None = None
    tolerance: float | None = None
    passed: bool | None = None
    detail: str = ""


def _from_comparisons(o: _Outcome) -> tuple[str, float, float, bool, str]:
    comps = o.comparisons
    worst = max(comps, key=lambda c: (not c.ok, c.worst_ratio if math.isfinite(c.worst_ratio) else math.inf))
    passed = all(c.ok for c in comps)
    failing = [f"{c.name}: {'; '.join(c.failures)}" for c in comps if not c.ok]
    detail = " | ".join(failing) if failing else ", ".join(f"{c.name} rel_l2 {c.rel_l2:.1e}" for c in comps)
    dtype = o.dtype or str(worst.dtype).replace("torch.", "")
    return dtype, worst.max_abs, worst.allowed_at_max, passed, detail


# ------------------------------------------------------------------------------ the CPU checks
# Every check builds its own seeded inputs on the tiny config and returns an _Outcome.

F64 = torch.float64


def _tiny():
    from .config import tiny

    return tiny()


def check_dense_vs_absorbed() -> _Outcome:
    """Chapter 2: absorbed MLA equals dense MLA (outputs and gradients), float64, packed sequences."""
    from .absorbed_mla import AbsorbedMLA
    from .compare import compare
    from .mla import MLA

    torch.manual_seed(0)
    cfg = _tiny().mla
    mla = MLA(cfg, dtype=F64)
    absorbed = AbsorbedMLA(mla)
    cu = torch.tensor([0, 1, 9, 24])
    x = torch.randn(24, cfg.dim, dtype=F64, requires_grad=True)
    w = torch.randn(24, cfg.dim, dtype=F64)
    dense = mla(x, cu)
    (gd,) = torch.autograd.grad((dense * w).sum(), x)
    absb = absorbed(x, cu)
    (ga,) = torch.autograd.grad((absb * w).sum(), x)
    return _Outcome(f"x [24, {cfg.dim}], H={cfg.n_heads}", [compare(absb, dense, name="out"),
                                                             compare(ga, gd, name="dx")])


def check_sparse_window_equals_dense() -> _Outcome:
    """Chapter 3.2: sparse_mla over every key of the window equals dense_mla_attention."""
    from .attention import dense_mla_attention
    from .compare import compare
    from .layout import key_windows
    from .sparse_attention import sparse_mla

    g = torch.Generator().manual_seed(1)
    cfg = _tiny().mla
    T, H, D, dv = 20, cfg.n_heads, cfg.latent_dim, cfg.kv_lora_rank
    cu = torch.tensor([0, 1, 8, 20])
    starts, ends = key_windows(cu)
    q = torch.randn(T, H, D, generator=g, dtype=F64)
    kv = torch.randn(T, D, generator=g, dtype=F64)
    # every window key, in a scrambled order, padded with -1
    idx = torch.full((T, T), -1, dtype=torch.int64)
    for t in range(T):
        keys = torch.arange(int(starts[t]), int(ends[t]))
        idx[t, : len(keys)] = keys[torch.randperm(len(keys), generator=g)]
    out_s, lse_s = sparse_mla(q, kv, idx, sm_scale=cfg.softmax_scale, d_v=dv)
    out_d, lse_d = dense_mla_attention(q, kv, sm_scale=cfg.softmax_scale, d_v=dv, starts=starts, ends=ends)
    return _Outcome(f"q [{T}, {H}, {D}], K={T}", [compare(out_s, out_d, name="out"),
                                                  compare(lse_s, lse_d, name="lse", head_dim=1)])


def check_sparse_slots() -> _Outcome:
    """Chapter 3.2: duplicates count once per slot, -1 slots count nothing, empty rows give 0 / -inf with finite grads."""
    from .compare import compare
    from .sparse_attention import sparse_mla

    g = torch.Generator().manual_seed(2)
    T, H, D, dv, S = 6, 3, 12, 8, 10
    q = torch.randn(T, H, D, generator=g, dtype=F64, requires_grad=True)
    kv = torch.randn(S, D, generator=g, dtype=F64, requires_grad=True)
    idx = torch.tensor([[3, 3, 5, -1], [0, 1, 2, 9], [-1, -1, -1, -1], [7, -1, 7, 7], [4, 4, 4, 4], [9, 8, -1, 0]])
    out, lse = sparse_mla(q, kv, idx, sm_scale=0.3, d_v=dv)
    exp_out = torch.zeros(T, H, dv, dtype=F64)
    exp_lse = torch.full((T, H), -math.inf, dtype=F64)
    for t in range(T):
        keys = [int(i) for i in idx[t] if i >= 0]  # one term per slot
        if keys:
            s = 0.3 * torch.einsum("hd,kd->hk", q[t].detach(), kv.detach()[keys])
            exp_lse[t] = torch.logsumexp(s, dim=-1)
            exp_out[t] = torch.softmax(s, dim=-1) @ kv.detach()[keys, :dv]
    (out.sum() + lse.masked_fill(torch.isinf(lse), 0).sum()).backward()
    finite = bool(torch.isfinite(q.grad).all() and torch.isfinite(kv.grad).all() and not q.grad[2].any())
    comps = [compare(out.detach(), exp_out, name="out"), compare(lse.detach(), exp_lse, name="lse", head_dim=1)]
    if not finite:
        comps[0].failures.append("gradients are not finite, or the empty row got a gradient")
    return _Outcome(f"q [{T}, {H}, {D}], K=4", comps)


def check_topk_ties() -> _Outcome:
    """Chapter 3.1: topk_indices follows the canonical rule on exactly tied scores (lower index first)."""
    from .adversarial import exactly_tied_scores, valid_count_rows
    from .indexer import topk_indices

    wrong, rows = 0, 0
    for case in (exactly_tied_scores(rows=8, num_keys=40, k=8, seed=3), valid_count_rows(k=8, num_keys=40, seed=3)):
        scores, k = case["scores"], case.meta["k"]
        got = topk_indices(scores, k)
        for t in range(scores.shape[0]):
            row = scores[t].tolist()
            order = sorted((i for i in range(len(row)) if row[i] > -math.inf), key=lambda i: (-row[i], i))[:k]
            expected = order + [-1] * (k - len(order))
            wrong += got[t].tolist() != expected
            rows += 1
    return _Outcome(f"scores [{rows} rows, 40], k=8", dtype="int64", max_error=float(wrong), tolerance=0.0,
                    passed=wrong == 0, detail=f"{wrong} of {rows} rows differ from sorted(-score, index)")


def check_topk_compare() -> _Outcome:
    """The oracle: compare_topk accepts another tie-breaking rule and rejects a wrong selection."""
    from .adversarial import exactly_tied_scores
    from .compare import compare_topk
    from .indexer import topk_indices

    case = exactly_tied_scores(rows=8, num_keys=40, k=8, seed=4)
    scores, k = case["scores"], case.meta["k"]
    # ties broken towards the *higher* index: flip the key order, select, map back
    flipped = topk_indices(scores.flip(1), k)
    high_first = torch.where(flipped >= 0, scores.shape[1] - 1 - flipped, flipped)
    ok = compare_topk(high_first, None, scores, k)
    broken = high_first.clone()
    broken[:, 0] = broken[:, 1]  # a kernel that writes one key twice and drops another
    bad = compare_topk(broken, None, scores, k)
    passed = ok.ok and ok.rows_tie_equivalent > 0 and bad.rows_wrong == scores.shape[0]
    return _Outcome(f"scores [{scores.shape[0]}, 40], k={k}", dtype="int64", max_error=float(ok.rows_wrong),
                    tolerance=0.0, passed=passed,
                    detail=f"other tie order: {ok.rows_tie_equivalent} tie-equivalent rows; "
                           f"planted wrong key caught in {bad.rows_wrong} of {scores.shape[0]} rows")


def check_hadamard_invariance() -> _Outcome:
    """Chapter 3.1: the Hadamard rotation of q and k leaves the index scores unchanged (float64)."""
    from .compare import compare
    from .indexer import lightning_indexer, rotate_activation
    from .layout import key_windows

    g = torch.Generator().manual_seed(5)
    ic = _tiny().indexer
    T = 24
    q = torch.randn(T, ic.n_heads, ic.head_dim, generator=g, dtype=F64)
    k = torch.randn(T, ic.head_dim, generator=g, dtype=F64)
    w = torch.randn(T, ic.n_heads, generator=g, dtype=F64)
    starts, ends = key_windows(torch.tensor([0, 10, 24]))
    plain = lightning_indexer(q, k, w, starts=starts, ends=ends)
    rotated = lightning_indexer(rotate_activation(q), rotate_activation(k), w, starts=starts, ends=ends)
    return _Outcome(f"q [{T}, {ic.n_heads}, {ic.head_dim}]", [compare(rotated, plain, name="scores", head_dim=None)])


def _loss_inputs(seed: int):
    from .indexer import topk_indices
    from .layout import key_windows

    g = torch.Generator().manual_seed(seed)
    cfg = _tiny().mla
    T, H, D = 18, cfg.n_heads, cfg.latent_dim
    q = torch.randn(T, H, D, generator=g, dtype=F64)
    kv = torch.randn(T, D, generator=g, dtype=F64)
    starts, ends = key_windows(torch.tensor([0, 1, 7, 18]))
    scores = torch.randn(T, T, generator=g, dtype=F64)
    inside = (torch.arange(T)[None] >= starts[:, None]) & (torch.arange(T)[None] < ends[:, None])
    scores = scores.masked_fill(~inside, -math.inf)
    return cfg.softmax_scale, q, kv, starts, ends, scores, topk_indices(scores, 4)


def check_loss_chunked() -> _Outcome:
    """Chapter 3.2: indexer_loss chunked over queries equals the plain one-go form (both stages)."""
    from .compare import compare
    from .indexer_loss import indexer_loss, indexer_loss_plain

    scale, q, kv, st, en, scores, topk = _loss_inputs(6)
    comps = []
    for stage, sel in (("dense", None), ("sparse", topk)):
        chunked = indexer_loss(scores, q, kv, sm_scale=scale, starts=st, ends=en, topk_indices=sel, chunk_size=5)
        plain = indexer_loss_plain(scores, q, kv, sm_scale=scale, starts=st, ends=en, topk_indices=sel)
        comps.append(compare(chunked.reshape(1), plain.reshape(1), name=f"loss ({stage})", head_dim=None))
    return _Outcome(f"scores [{scores.shape[0]}, {scores.shape[1]}], chunk 5", comps)


def check_loss_grad() -> _Outcome:
    """Chapter 3.2: the closed-form gradient softmax(I) - p equals autograd of indexer_loss (both stages)."""
    from .compare import compare
    from .indexer_loss import indexer_logit_grad, indexer_loss

    scale, q, kv, st, en, scores, topk = _loss_inputs(7)
    comps = []
    for stage, sel in (("dense", None), ("sparse", topk)):
        s = scores.clone().requires_grad_(True)
        (auto,) = torch.autograd.grad(indexer_loss(s, q, kv, sm_scale=scale, starts=st, ends=en, topk_indices=sel), s)
        closed = indexer_logit_grad(scores, q, kv, sm_scale=scale, starts=st, ends=en, topk_indices=sel)
        comps.append(compare(closed, auto, name=f"dI ({stage})", head_dim=None))
    return _Outcome(f"scores [{scores.shape[0]}, {scores.shape[1]}]", comps)


def check_packed_equals_per_sequence() -> _Outcome:
    """Chapters 3.2 and 4.1: the DSA layer on packed sequences equals one call per sequence (float64)."""
    from .compare import compare
    from .dsa import DSAttention

    torch.manual_seed(8)
    cfg = _tiny()
    layer = DSAttention(cfg, stage="sparse", loss_reduction="sum", dtype=F64)
    lengths = [1, 12, 1, 9]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x = torch.randn(int(cu[-1]), cfg.mla.dim, dtype=F64)
    with torch.no_grad():
        packed = layer(x, cu)
        outs, idxs, loss = [], [], 0.0
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            one = layer(x[a:b])
            outs.append(one.output)
            idxs.append(torch.where(one.topk_indices >= 0, one.topk_indices + a, one.topk_indices))
            loss = loss + one.indexer_loss
    wrong = int((torch.cat(idxs) != packed.topk_indices).any(dim=1).sum())
    comps = [compare(packed.output, torch.cat(outs), name="out", head_dim=None),
             compare(packed.indexer_loss.reshape(1), loss.reshape(1), name="loss", head_dim=None)]
    if wrong:
        comps[0].failures.append(f"{wrong} rows select different keys")
    return _Outcome(f"x [{int(cu[-1])}, {cfg.mla.dim}], lengths {lengths}", comps)


def check_gradient_boundaries() -> _Outcome:
    """Chapter 3.2: the KL loss reaches only the indexer; with its loss scale 0 the output gradient never does."""
    from .dsa import DSAttention, set_indexer_loss_scale

    torch.manual_seed(16)
    cfg = _tiny()
    layer = DSAttention(cfg, stage="sparse", dtype=F64)
    x = torch.randn(20, cfg.mla.dim, dtype=F64)
    named = list(layer.named_parameters())
    leaks = []
    for stage in ("dense_warmup", "sparse"):
        res = layer(x, stage=stage)
        grads = torch.autograd.grad(res.indexer_loss, [p for _, p in named], allow_unused=True)
        leaks += [float(g.abs().max()) for (n, _), g in zip(named, grads)
                  if g is not None and not n.startswith("indexer.")]
        reached = [g is not None and bool(g.any()) for (n, _), g in zip(named, grads) if n.startswith("indexer.")]
        if not any(reached):
            leaks.append(math.inf)  # the indexer must learn from its loss
    set_indexer_loss_scale(layer, 0.0)
    res = layer(x, stage="sparse")
    grads = torch.autograd.grad(res.output.square().sum(), [p for _, p in named], allow_unused=True)
    leaks += [float(g.abs().max()) for (n, _), g in zip(named, grads) if g is not None and n.startswith("indexer.")]
    worst = max(leaks, default=0.0)
    return _Outcome(f"x [20, {cfg.mla.dim}], both stages", dtype="float64", max_error=worst, tolerance=0.0,
                    passed=worst == 0.0, detail="largest gradient that crossed a stage boundary")


def _cp_worker(rank: int, world: int, init_file: str, queue) -> None:  # pragma: no cover - runs in a child
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        from .context_parallel import cp_dsa_forward, reduce_loss_for_logging, shard_tokens
        from .dsa import DSAttention
        from .layout import cp_shard_index

        torch.manual_seed(9)
        cfg = _tiny()
        layer = DSAttention(cfg, stage="sparse", dtype=F64)
        cu = torch.tensor([0, 8, 32, 48])
        x = torch.randn(48, cfg.mla.dim, dtype=F64)
        with torch.no_grad():
            ref = layer(x, cu)
            res = cp_dsa_forward(layer, shard_tokens(x, cu, world, rank), cu, cp_size=world)
            loss = reduce_loss_for_logging(res.indexer_loss)
        idx = cp_shard_index(cu, world, rank)
        err_out = float((res.output - ref.output[idx]).abs().max())
        err_loss = float((loss - ref.indexer_loss).abs())
        same_idx = bool(torch.equal(res.topk_indices, ref.topk_indices[idx]))
        queue.put((rank, err_out, err_loss, same_idx, float(ref.output.abs().max()), ""))
        dist.destroy_process_group()
    except Exception as err:  # report instead of hanging the parent
        queue.put((rank, math.inf, math.inf, False, 1.0, f"{type(err).__name__}: {err}"))


def check_context_parallel() -> _Outcome:
    """Chapter 4.2: allgather CP on 2 gloo processes equals the single-process layer (float64)."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available():
        return _Outcome("2 ranks", passed=None, detail="skipped: this PyTorch has no torch.distributed")
    if "fork" not in mp.get_all_start_methods():
        return _Outcome("2 ranks", passed=None, detail="skipped: needs the fork start method")
    ctx = mp.get_context("fork")
    world = 2
    with tempfile.TemporaryDirectory() as d:
        queue = ctx.Queue()
        procs = [ctx.Process(target=_cp_worker, args=(r, world, os.path.join(d, "init"), queue)) for r in range(world)]
        for p in procs:
            p.start()
        results = []
        try:
            for _ in range(world):
                results.append(queue.get(timeout=120))
        except Exception:  # noqa: BLE001 - a timeout is reported as a failure
            results.append((-1, math.inf, math.inf, False, 1.0, "timed out waiting for the CP ranks"))
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():  # pragma: no cover
                p.terminate()
    err = max(r[1] for r in results)
    err_loss = max(r[2] for r in results)
    problems = [r[5] for r in results if r[5]] + [f"rank {r[0]} selects different keys" for r in results if not r[3]]
    tol = 1e-10 * max(r[4] for r in results)
    passed = not problems and err <= tol and err_loss <= 1e-10
    detail = "; ".join(problems) if problems else f"outputs {err:.1e}, loss {err_loss:.1e}, same top-k"
    return _Outcome("x [48, 64], cu [0, 8, 32, 48], cp=2", dtype="float64", max_error=max(err, err_loss),
                    tolerance=tol, passed=passed, detail=detail)


def check_bf16_sparse() -> _Outcome:
    """Precision: sparse_mla on bf16 inputs is within the bf16 tolerance of float64 on the same values."""
    from .adversarial import duplicate_indices
    from .compare import compare
    from .sparse_attention import sparse_mla

    case = duplicate_indices(tokens=24, num_keys=64, k=16, heads=16, seed=10)
    q, kv, idx = case["q"], case["kv"], case["indices"]
    out, lse = sparse_mla(q, kv, idx, sm_scale=case.meta["sm_scale"], d_v=case.meta["d_v"])
    out64, lse64 = sparse_mla(q.double(), kv.double(), idx, sm_scale=case.meta["sm_scale"], d_v=case.meta["d_v"])
    return _Outcome(f"q {list(q.shape)}, K=16", [compare(out, out64, name="out"),
                                                  compare(lse, lse64, name="lse", head_dim=1)])


def check_bf16_indexer() -> _Outcome:
    """Precision: lightning_indexer on bf16 inputs (float32 scores) is within the float32 tolerance of float64."""
    from .compare import compare
    from .indexer import lightning_indexer

    g = torch.Generator().manual_seed(11)
    q = torch.randn(32, 16, 64, generator=g).bfloat16()
    k = torch.randn(48, 64, generator=g).bfloat16()
    w = torch.randn(32, 16, generator=g) * 16 ** -0.5 * 64 ** -0.5
    got = lightning_indexer(q, k, w)
    exact = lightning_indexer(q.double(), k.double(), w.double())
    return _Outcome("q [32, 16, 64], k [48, 64]", [compare(got, exact, name="scores", head_dim=None)])


def check_oracle_conventions() -> _Outcome:
    """The oracle: a correct kernel passes in every convention, and the 576^-0.5 scale bug fails in every one."""
    from .adversarial import packed_sequences
    from .oracle import CONVENTIONS, check_sparse_mla, kernel_inputs, reference_kernel

    case = packed_sequences(lengths=(8, 8, 8, 8), k=4, heads=4, seed=12)
    q, kv, idx, cu = case["q"], case["kv"], case["indices"], case["cu_seqlens"]
    scale, d_v = case.meta["sm_scale"], case.meta["d_v"]
    comps, caught = [], 0
    for conv in CONVENTIONS.values():
        kw = {"cu_seqlens": cu} if conv.index_space == "per_sequence" else {}
        batch = 1 if conv.layout == "THD" else 4
        qk, kvk, ik = kernel_inputs(q, kv, idx, conv, batch=batch, **kw)
        good = reference_kernel(qk, kvk, ik, convention=conv, sm_scale=scale, d_v=d_v,
                                compute_dtype=torch.float32, **kw)
        rep = check_sparse_mla(*good, qk, kvk, ik, convention=conv, sm_scale=scale, d_v=d_v, **kw)
        for c in rep.comparisons:
            c.name = f"{conv.layout}/{c.name}"
        comps.extend(rep.comparisons)
        bad = reference_kernel(qk, kvk, ik, convention=conv, sm_scale=576 ** -0.5, d_v=d_v, **kw)
        caught += not check_sparse_mla(*bad, qk, kvk, ik, convention=conv, sm_scale=scale, d_v=d_v, **kw).ok
    if caught != len(CONVENTIONS):
        comps[0].failures.append(f"the 576^-0.5 scale bug passed in {len(CONVENTIONS) - caught} conventions")
    return _Outcome(f"q [32, 4, 576], {len(CONVENTIONS)} conventions", comps)


def check_fp8_emulation() -> _Outcome:
    """fp8: the e4m3 rounding emulation equals torch.float8_e4m3fn on every value and midpoint."""
    from .fp8 import HAS_TORCH_FP8, e4m3_round

    if not HAS_TORCH_FP8:
        return _Outcome("e4m3", passed=None, detail="skipped: this PyTorch has no float8_e4m3fn")
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = values[torch.isfinite(values)].unique()
    mids = (values[1:] + values[:-1]) / 2
    g = torch.Generator().manual_seed(13)
    x = torch.cat([values, mids, (torch.randn(20000, generator=g) * 40).clamp(-448, 448)])
    wrong = int((e4m3_round(x) != x.to(torch.float8_e4m3fn).float()).sum())
    return _Outcome(f"{x.numel()} values", dtype="float8_e4m3fn", max_error=float(wrong), tolerance=0.0,
                    passed=wrong == 0, detail=f"{wrong} values round differently")


def check_fp8_hadamard() -> _Outcome:
    """fp8: on outlier-heavy inputs the rotated fp8 scores are closer to exact than the unrotated ones."""
    from .adversarial import outlier_channels
    from .fp8 import fp8_indexer_scores
    from .indexer import lightning_indexer

    case = outlier_channels(tokens=32, num_keys=128, heads=8, seed=14)
    q, k, w = case["q"], case["k"], case["weights"]
    exact = lightning_indexer(q, k, w)
    errs = {}
    for rot in (True, False):
        s = fp8_indexer_scores(q, k, w, hadamard=rot).double()
        errs[rot] = float((s - exact).norm() / exact.norm())
    return _Outcome("q [32, 8, 128], k [128, 128]", dtype="float8_e4m3fn", max_error=errs[True],
                    tolerance=errs[False], passed=errs[True] < 0.5 * errs[False],
                    detail=f"rel. L2 with Hadamard {errs[True]:.2e}, without {errs[False]:.2e} (must halve)")


def check_injected_failure() -> _Outcome:
    """A planted bug (for testing the verifier): a kernel using 576^-0.5 instead of DeepSeek's scale."""
    from .adversarial import DEEPSEEK_SM_SCALE, duplicate_indices
    from .oracle import DSA_REF, check_sparse_mla, reference_kernel

    case = duplicate_indices(tokens=8, num_keys=32, k=8, heads=4, seed=15)
    q, kv, idx = case["q"], case["kv"], case["indices"]
    out, lse = reference_kernel(q, kv, idx, convention=DSA_REF, sm_scale=576 ** -0.5, d_v=case.meta["d_v"])
    rep = check_sparse_mla(out, lse, q, kv, idx, convention=DSA_REF, sm_scale=DEEPSEEK_SM_SCALE, d_v=case.meta["d_v"])
    return _Outcome(f"q {list(q.shape)}", rep.comparisons)


#: (name, function) of the CPU checks, in chapter order.
CPU_CHECKS: list[tuple[str, Callable[[], _Outcome]]] = [
    ("mla: dense == absorbed (out, dx)", check_dense_vs_absorbed),
    ("sparse_mla: all window keys == dense", check_sparse_window_equals_dense),
    ("sparse_mla: per-slot duplicates, -1, empty rows", check_sparse_slots),
    ("topk: canonical rule on ties", check_topk_ties),
    ("topk: tie-aware compare", check_topk_compare),
    ("indexer: Hadamard invariance", check_hadamard_invariance),
    ("indexer_loss: chunked == plain", check_loss_chunked),
    ("indexer_loss: closed-form grad == autograd", check_loss_grad),
    ("dsa: packed == per-sequence", check_packed_equals_per_sequence),
    ("dsa: gradient boundaries of both stages", check_gradient_boundaries),
    ("cp: 2 gloo ranks == 1 process", check_context_parallel),
    ("bf16: sparse_mla vs float64", check_bf16_sparse),
    ("bf16: lightning_indexer vs float64", check_bf16_indexer),
    ("oracle: every convention", check_oracle_conventions),
    ("fp8: e4m3 emulation == torch", check_fp8_emulation),
    ("fp8: Hadamard helps on outliers", check_fp8_hadamard),
]


def cpu_checks() -> list[tuple[str, Callable[[], _Outcome]]]:
    """The CPU identity checks, as ``(name, function)`` pairs."""
    return list(CPU_CHECKS)


# ------------------------------------------------------------------------------ the GPU checks


def gpu_available() -> tuple[bool, str]:
    """Whether ``--gpu`` can run here, and why not."""
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    try:
        from . import kernels
    except Exception as err:  # noqa: BLE001
        return False, f"dsa_ref.kernels cannot be imported: {err}"
    return kernels.available()


def _gpu_case(T: int, S: int, H: int, K: int, *, seed: int, adversarial: bool = False):
    """bf16 CUDA inputs at DeepSeek-V3.2 widths (576 / 512) with causal top-K indices."""
    from .adversarial import DEEPSEEK_SM_SCALE

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    q = (torch.randn(T, H, 576, generator=g, device=dev) * 0.5).bfloat16()
    kv = torch.randn(S, 576, generator=g, device=dev)
    kv = (kv / kv.square().mean(-1, keepdim=True).sqrt()).bfloat16()
    # causal selection: query t (the last T of S tokens) picks K random keys <= its position
    pos = torch.arange(S - T, S, device=dev)
    r = torch.rand(T, S, generator=g, device=dev).masked_fill(torch.arange(S, device=dev)[None] > pos[:, None], -1)
    vals, idx = r.topk(K, dim=1)
    idx = torch.where(vals >= 0, idx, torch.full_like(idx, -1))
    if adversarial:
        idx[::7] = -1  # empty rows
        idx[1::5, 1] = idx[1::5, 0]  # duplicates
        idx[:, 2] = torch.where(idx[:, 2] >= 0, torch.zeros_like(idx[:, 2]), idx[:, 2])  # a sink key
    return q, kv, idx, DEEPSEEK_SM_SCALE


def _gpu_sparse_fwd(T, S, H, K, adversarial=False):
    def run() -> _Outcome:
        from .kernels.autograd import sparse_mla_tilelang
        from .oracle import DSA_REF, check_sparse_mla

        q, kv, idx, scale = _gpu_case(T, S, H, K, seed=20 + H + K, adversarial=adversarial)
        out, lse = sparse_mla_tilelang(q, kv, idx, sm_scale=scale, d_v=512)
        torch.cuda.synchronize()
        rep = check_sparse_mla(out, lse, q, kv, idx, convention=DSA_REF, sm_scale=scale, d_v=512)
        return _Outcome(f"q [{T}, {H}, 576], kv [{S}, 576], K={K}", rep.comparisons)
    return run


def _gpu_sparse_bwd(T, S, H, K, adversarial=False):
    def run() -> _Outcome:
        from .kernels.autograd import sparse_mla_tilelang
        from .oracle import DSA_REF, check_sparse_mla_backward

        q, kv, idx, scale = _gpu_case(T, S, H, K, seed=40 + H + K, adversarial=adversarial)
        q.requires_grad_(True)
        kv.requires_grad_(True)
        out, _ = sparse_mla_tilelang(q, kv, idx, sm_scale=scale, d_v=512)
        d_out = torch.randn_like(out)
        dq, dkv = torch.autograd.grad(out, (q, kv), d_out)
        rep = check_sparse_mla_backward(dq, dkv, d_out, q.detach(), kv.detach(), idx, convention=DSA_REF,
                                        sm_scale=scale, d_v=512)
        return _Outcome(f"q [{T}, {H}, 576], kv [{S}, 576], K={K}", rep.comparisons)
    return run


def _gpu_indexer(T, H, D, packed):
    def run() -> _Outcome:
        from .kernels.autograd import lightning_indexer_tilelang
        from .layout import key_windows
        from .oracle import check_indexer

        dev = torch.device("cuda")
        g = torch.Generator(device=dev).manual_seed(60 + T)
        q = torch.randn(T, H, D, generator=g, device=dev).bfloat16()
        k = torch.randn(T, D, generator=g, device=dev).bfloat16()
        w = torch.randn(T, H, generator=g, device=dev) * H ** -0.5 * D ** -0.5
        cu = torch.tensor([0, 1, T // 3, T // 3 + 1, T], device=dev) if packed else torch.tensor([0, T], device=dev)
        starts, ends = key_windows(cu)
        scores = lightning_indexer_tilelang(q, k, w, starts=starts, ends=ends)
        torch.cuda.synchronize()
        rep = check_indexer(scores, q, k, w, starts=starts, ends=ends)
        return _Outcome(f"q [{T}, {H}, {D}], k [{T}, {D}]" + (", packed" if packed else ""), rep.comparisons)
    return run


def gpu_checks() -> list[tuple[str, Callable[[], _Outcome]]]:
    """TileLang kernels against the reference at DeepSeek-V3.2 shapes (576 / 512, H=128, top-2048)."""
    return [
        ("tilelang: sparse_mla fwd, V3.2 shape", _gpu_sparse_fwd(4096, 4096, 128, 2048)),
        ("tilelang: sparse_mla bwd, V3.2 shape", _gpu_sparse_bwd(2048, 4096, 128, 2048)),
        ("tilelang: sparse_mla fwd, H=16, K=100, empty/dup", _gpu_sparse_fwd(512, 1024, 16, 100, adversarial=True)),
        ("tilelang: sparse_mla bwd, H=16, K=100, empty/dup", _gpu_sparse_bwd(512, 1024, 16, 100, adversarial=True)),
        ("tilelang: indexer fwd, 64 x 128 heads, causal", _gpu_indexer(4096, 64, 128, packed=False)),
        ("tilelang: indexer fwd, packed windows", _gpu_indexer(2048, 64, 128, packed=True)),
    ]


# ---------------------------------------------------------------------------------- running


def run_checks(checks: list[tuple[str, Callable[[], _Outcome]]], *, progress: bool | None = None) -> list[CheckResult]:
    """Run checks, each guarded (an exception is a failed check), with a tqdm bar on stderr."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency; degrade to no bar
        def tqdm(it, **_):
            return it
    results = []
    # disable=None: tqdm draws the bar only when stderr is a terminal
    bar = checks if progress is False else tqdm(checks, desc="dsa-ref verify", unit="check", file=sys.stderr,
                                                disable=None if progress is None else not progress, leave=False)
    for name, fn in bar:
        if hasattr(bar, "set_postfix_str"):
            bar.set_postfix_str(name[:40])
        t0 = time.perf_counter()
        try:
            o = fn()
            seconds = time.perf_counter() - t0
            if o.comparisons:
                dtype, err, tol, passed, detail = _from_comparisons(o)
                results.append(CheckResult(name, o.shapes, dtype, err, tol, passed, seconds, detail))
            elif o.passed is None:
                results.append(CheckResult(name, o.shapes, o.dtype or "-", math.nan, math.nan, True, seconds,
                                           o.detail, skipped=True))
            else:
                results.append(CheckResult(name, o.shapes, o.dtype or "-", o.max_error, o.tolerance, o.passed,
                                           seconds, o.detail))
        except Exception as err:  # noqa: BLE001 - every error is a failed check, reported in the table
            results.append(CheckResult(name, "-", "-", math.inf, math.nan, False, time.perf_counter() - t0,
                                       f"raised {type(err).__name__}: {err}"))
    return results


def format_table(results: list[CheckResult]) -> str:
    """The results as a fixed-width text table, then one line per failing check's details."""
    def fmt(x: float) -> str:
        if math.isnan(x):
            return "-"
        if not math.isfinite(x):
            return str(x)
        return f"{int(x)}" if x == int(x) and abs(x) < 1e6 else f"{x:.2e}"

    header = ("check", "shapes", "dtype", "max error", "tolerance", "result", "time")
    rows = [(r.name, r.shapes, r.dtype, fmt(r.max_error), fmt(r.tolerance),
             "skip" if r.skipped else ("PASS" if r.passed else "FAIL"), f"{r.seconds:.2f}s") for r in results]
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    right = {3, 4, 6}

    def line(row):
        cells = (str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
        return "  ".join(cells)

    out = [line(header), "  ".join("-" * w for w in widths), *(line(r) for r in rows)]
    n_fail = sum(not r.passed for r in results)
    n_skip = sum(r.skipped for r in results)
    total = sum(r.seconds for r in results)
    out.append("")
    out.append(f"{len(results) - n_fail - n_skip} passed, {n_fail} failed, {n_skip} skipped in {total:.1f} s")
    for r in results:
        if not r.passed or r.skipped:
            out.append(f"  {'FAIL' if not r.passed else 'skip'} {r.name}: {r.detail}")
    return "\n".join(out)


def _verify(args: argparse.Namespace) -> int:
    if args.gpu:
        ok, reason = gpu_available()
        if not ok:
            print(f"dsa-ref verify --gpu: cannot run the TileLang checks: {reason}", file=sys.stderr)
            return 2
    checks = cpu_checks() + (gpu_checks() if args.gpu else [])
    if args.inject_failure:
        checks.append(("injected: 576^-0.5 scale bug", check_injected_failure))
    if args.only:
        checks = [c for c in checks if args.only.lower() in c[0].lower()]
        if not checks:
            print(f"dsa-ref verify: no check matches --only {args.only!r}", file=sys.stderr)
            return 2
    if args.list:
        for name, fn in checks:
            print(f"{name}: {(fn.__doc__ or '').strip().splitlines()[0] if fn.__doc__ else ''}")
        return 0
    t0 = time.perf_counter()
    results = run_checks(checks, progress=False if args.no_progress else None)
    elapsed = time.perf_counter() - t0
    failed = any(not r.passed for r in results)
    if args.json:
        from . import __version__

        print(json.dumps({"ok": not failed, "seconds": round(elapsed, 3), "dsa_ref": __version__,
                          "torch": torch.__version__, "python": platform.python_version(), "gpu": bool(args.gpu),
                          "checks": [r.as_dict() for r in results]}, indent=2))
    else:
        print(format_table(results))
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    """The ``dsa-ref`` argument parser."""
    parser = argparse.ArgumentParser(prog="dsa-ref", description="dsa_ref: DeepSeek Sparse Attention reference")
    sub = parser.add_subparsers(dest="command", required=True)
    v = sub.add_parser("verify", help="run every chapter's identities (and, with --gpu, the TileLang kernels)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    v.add_argument("--gpu", action="store_true", help="also check the TileLang kernels on CUDA at real shapes")
    v.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    v.add_argument("--only", metavar="TEXT", help="run only the checks whose name contains TEXT")
    v.add_argument("--list", action="store_true", help="list the checks and exit")
    v.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    v.add_argument("--inject-failure", action="store_true", help=argparse.SUPPRESS)  # for tests of the exit code
    v.set_defaults(func=_verify)
    i = sub.add_parser("inspect", help="what a local DeepSeek-V3.2 / GLM-5 checkpoint holds for one attention "
                                       "layer, and a forward of that layer on a few tokens")
    i.add_argument("path", help="checkpoint directory (config.json, model.safetensors.index.json and shards)")
    i.add_argument("--layer", type=int, default=0, help="layer index (default 0)")
    i.add_argument("--tokens", type=int, default=8, help="token ids 0..N-1 for the forward (default 8)")
    i.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                   help="compute dtype (default: the checkpoint's, bfloat16 for fp8 weights)")
    i.add_argument("--no-forward", action="store_true", help="only list the tensors and the derived config")
    i.set_defaults(func=_inspect)
    t = sub.add_parser("train", help="train a small DSA language model through both stages, with two controls (chapter 6)",
                       description=_TRAIN_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_train_arguments(t)
    t.set_defaults(func=_train)
    return parser


_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


def _inspect(args: argparse.Namespace) -> int:
    """``dsa-ref inspect PATH [--layer N]``: print `dsa_ref.checkpoints.inspect_layer`'s report."""
    from .checkpoints import inspect_layer

    try:
        report = inspect_layer(args.path, args.layer, tokens=args.tokens, dtype=_DTYPES.get(args.dtype),
                               forward=not args.no_forward)
    except (ValueError, TypeError, FileNotFoundError) as err:
        print(f"dsa-ref inspect: {err}", file=sys.stderr)
        return 2
    print(report)
    return 0


_TRAIN_DOC = """``dsa-ref train``: the recipe of chapter 6 (dense, dense warm-up of the indexers, sparse) and two controls.

    dsa-ref train --task mqar --context 512 --topk 32 --seeds 3 --device cpu --out runs/mqar
    dsa-ref train --resume runs/mqar                 # continue an interrupted run exactly
    dsa-ref train ... --device cuda --backend tilelang   # the TileLang kernels (bfloat16 attention)

Writes config.json, log.jsonl, summary.json (runs dense, dsa, dsa_no_warmup, dense_continued),
curves.png and checkpoints/ into --out. Every field of `dsa_ref.train.TrainConfig` is an option.
Exit code 0 when done, 2 for a bad argument (the message names it).
"""

_TRAIN_HELP = {
    "task": "the task (dsa_ref.tasks.TASKS)", "context": "tokens per sequence", "topk": "keys each query selects",
    "seeds": "number of seeds (from --first-seed)", "device": "torch device, e.g. cpu or cuda",
    "backend": "attention backend: reference, tilelang or auto", "num_pairs": "key-value pairs (mqar) or copied tokens (copy)",
    "attn_dtype": "dtype of the attention weights (bfloat16 for --backend tilelang, its default there)",
    "seqs_per_call": "sequences per attention call (0: the whole packed batch in one call)",
}


def _add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """One option per field of `dsa_ref.train.TrainConfig`, plus --out, --resume, --stop-after, --no-progress."""
    import dataclasses

    from .train import TrainConfig

    parser.add_argument("--out", metavar="DIR", help="output directory (must not hold a run yet)")
    parser.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its checkpoints, with its config.json")
    parser.add_argument("--stop-after", type=int, metavar="N", help="stop (with a checkpoint) after N steps of this call")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        kind = {"seqs_per_call": int}.get(f.name, type(default))
        help_text = _TRAIN_HELP.get(f.name, f.name.replace("_", " ")) + f" (default: {default})"
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(flag, type=kind, default=argparse.SUPPRESS, metavar=f.name.upper(), help=help_text)


def _train(args: argparse.Namespace) -> int:
    import dataclasses

    from .train import TrainConfig, train

    names = {f.name for f in dataclasses.fields(TrainConfig)}
    given = {k: v for k, v in vars(args).items() if k in names}
    if given.get("seqs_per_call") == 0:
        given["seqs_per_call"] = None
    try:
        if args.resume:
            if args.out is not None or given:
                extra = ", ".join(["--out"] * (args.out is not None) + ["--" + k.replace("_", "-") for k in given])
                raise ValueError(f"--resume continues the run with its own config.json; drop {extra}")
            out = args.resume
            cfg = TrainConfig(**json.loads((Path(out) / "config.json").read_text()))
        else:
            if args.out is None:
                raise ValueError("--out DIR is required (or --resume DIR)")
            out = args.out
            if given.get("backend") == "tilelang" and "attn_dtype" not in given:
                given["attn_dtype"] = "bfloat16"
            cfg = TrainConfig(**given)
        command = "dsa-ref train " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["train"] else None
        summary = train(cfg, out, resume=bool(args.resume), stop_after=args.stop_after,
                        progress=not args.no_progress, command=command)
    except (ValueError, TypeError) as err:
        print(f"dsa-ref train: error: {err}", file=sys.stderr)
        return 2
    if summary is None:
        print(f"dsa-ref train: stopped after --stop-after {args.stop_after} steps; continue with --resume {out}")
        return 0
    for run, r in summary["runs"].items():
        recall = "-" if r["gold_key_recall"] is None else f"{r['gold_key_recall']:.3f}"
        print(f"{run:16s} accuracy {r['accuracy']:.3f} ± {r['std']['accuracy']:.3f}  lm_loss {r['lm_loss']:.3f}  "
              f"gold-key recall {recall}  steps {r['steps']:.0f}  {r['seconds']:.1f} s")
    print(f"wrote {out}/summary.json, log.jsonl, curves.png")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``dsa-ref`` console script and of ``python -m dsa_ref``."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
