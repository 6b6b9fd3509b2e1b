"""dsa_ref's kernels beside the public peer kernels: the same inputs, the same timing, every output checked.

    python benchmarks/bench_peers.py --peers .gpu/peers --out bench_peers.json     # H200: all ops, four shapes
    python benchmarks/bench_peers.py --quick --ops sparse_fwd                       # one shape, 5 calls each

The peers are loaded at run time from ``--peers DIR`` (nothing of theirs is copied into dsa_ref):

* ``DIR/flashmla/``: FlashMLA's SM90a sparse prefill forward, compiled by its ``build.py``
  (``MAX_JOBS`` and ``FLASHMLA_BUILD_DIR`` are honoured; defaults 16 and ``/tmp/flashmla_build``);
* ``DIR/megatron/``: Megatron-LM's TileLang DSA ops (``megatron.core.transformer.
  experimental_attention_variant.ops``): sparse MLA forward and backward, the bf16 indexer forward
  and backward, the attention target and the fused KL loss;
* ``DIR/tilelang_examples/``: TileLang's ``examples/deepseek_v32``: sparse MLA forward (simple and
  pipelined), its backward, the fp8 indexer.

A peer that is missing, fails to import or raises is recorded (``"skipped"`` / ``"failed"`` with the
reason) and the run goes on. `IMPLS` lists every implementation with the exact call made.

**Inputs.** One set per shape ``T x S`` (``T`` queries, the last ``T`` positions of one sequence of
``S`` keys, so ``q_start = S - T``), DeepSeek-V3.2's sizes (128 heads, width 576, values 512, top-k
2048; indexer 64 heads x 128), random bf16. Indices: ``causal`` = top-k of random scores inside each
query's causal window (``-1`` where a window has fewer than 2048 keys), ``uniform`` = 2048 distinct
keys drawn uniformly from all ``S``. Planted in every set: three rows with no valid slot
(`Inputs.empty_rows`) and rows with a quarter of their slots set to ``-1`` (`Inputs.sparse_rows`),
so that the checks show what each peer does there. Every part is drawn from its own seeded
generator, so every process gets bit-identical inputs (the JSON records their checksums).

**Timing.** Per call: `bench_kernels.cuda_time_ms` (CUDA events around one call on an idle GPU,
median of ``--repeat`` calls after warm-up) with a 256 MiB write before each call, which evicts
the 50 MB L2. Back to back: ``--repeat`` calls queued without a pause, CUDA events around them all,
divided by ``--repeat``. Python's garbage collector is paused while timing (as `timeit` does).
Conversions into each peer's layout and index convention are done once, outside the timed call.

**Checks.** Each output is compared with the exact float64 reference (`dsa_ref.oracle`), on three
blocks of rows (first, middle, last; the planted rows lie in them). Sparse MLA goes through
`check_sparse_mla` / `check_sparse_mla_backward` with the peer's `Convention` preset, which also
names where it differs from dsa_ref (LSE base, the empty-row markers, the sentinel, a causal rule).
Recorded per peer and shape: ``ok`` / ``mismatch`` (with the largest errors), and facts: what it
returned on the rows with no valid slot, and how many of dsa_ref's valid slots its own rules leave
out. Backward checks run the peer once more per block with the output gradient zero outside that
block, so the key gradient holds that block's contributions only. Gradients are judged elementwise
against the sum of their terms' absolute values (`sparse_mla_backward_magnitudes`,
`indexer_backward_magnitudes`), where a key row read by many queries cancels.

**Isolation.** A CUDA fault (an illegal address) kills the process's CUDA context, so each family
(dsa_ref, flashmla, megatron, tilelang) runs in a process of its own, which writes its results as
it goes; when one dies, what it finished is kept, the implementation it was running is recorded as
``failed`` (with the end of its log), and the family is resumed in a fresh process for what is
left. Before timing, a compile phase runs every peer kernel once in parallel processes (TileLang
keeps compiled kernels in its disk cache; FlashMLA is built then). ``--in-process`` runs everything
in this process instead (for debugging, and for the CPU tests).

**Output.** ``--out`` (JSON, schema ``dsa_ref.bench_peers/1``): ``meta`` (date, GPU, versions,
command), ``formulas`` (how TFLOP/s is counted per op), ``impls`` (the call made), ``conventions``,
``shapes`` (with the input checksums per family), ``families`` (load status), ``precompile`` and
``results``: one record per (op, shape, impl) with ``status``, ``ms_per_call``, ``ms_back_to_back``,
``tflops``, ``ratio_to_dsa_ref`` (dsa_ref's ms per call / this one's: > 1 is faster than dsa_ref)
and ``check``. A ratio table is printed at the end; ``tools/known_kernels_page.py`` turns the JSON
into ``docs/known_kernels.md`` and ``tools/plots/bench_peers_plot.py`` into a figure.
"""

from __future__ import annotations

import argparse
import functools
import contextlib
import gc
import importlib
import importlib.util
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from dsa_ref import attention_head_sum, index_scores_at, sparse_mla  # noqa: E402
from dsa_ref.compare import Comparison, Tolerance, compare, tolerance_for  # noqa: E402
from dsa_ref.indexer_loss import indexer_loss_on_slots  # noqa: E402
from dsa_ref.kernels.shapes import SM_SCALE  # noqa: E402
from dsa_ref.oracle import (  # noqa: E402
    CONVENTIONS,
    Report,
    check_indexer,
    accumulation_rtol,
    check_sparse_mla,
    check_sparse_mla_backward,
    from_reference_indices,
    indexer_backward_magnitudes,
    to_reference_indices,
)

SCHEMA = "dsa_ref.bench_peers/1"
DEFAULT_SHAPES = "4096x8192,8192x8192,16384x16384,4096x32768:uniform"
DEFAULT_PEERS = ROOT / ".gpu" / "peers"
FAMILIES = ("dsa_ref", "flashmla", "megatron", "tilelang")
L2_FLUSH_BYTES = 256 * 2**20  # the H200's L2 is 50 MB
MEGATRON_OPS = "megatron.core.transformer.experimental_attention_variant.ops"
EXIT_CUDA_ERROR = 3  # a family process stops after a CUDA error; the parent resumes it in a fresh one


# ------------------------------------------------------------------------------------------ sizes


@dataclass(frozen=True)
class Dims:
    """Head counts and widths: DeepSeek-V3.2's (`V32`), or `TINY` for CPU smoke tests."""

    heads: int = 128
    dim: int = 576  # absorbed q / latent kv width (512 latent + 64 rope)
    dim_v: int = 512
    topk: int = 2048
    index_heads: int = 64
    index_dim: int = 128


V32 = Dims()
TINY = Dims(heads=16, dim=80, dim_v=64, topk=16, index_heads=4, index_dim=16)


@dataclass(frozen=True)
class Shape:
    """``num_q`` queries (the last positions of one sequence of ``num_kv`` keys) and how indices are drawn."""

    num_q: int
    num_kv: int
    indices: str = "causal"  # "causal" | "uniform"

    def __post_init__(self) -> None:
        if self.indices not in ("causal", "uniform"):
            raise ValueError(f"indices must be 'causal' or 'uniform', got {self.indices!r}")
        if not 0 < self.num_q <= self.num_kv:
            raise ValueError(f"need 0 < queries <= keys, got {self.num_q} x {self.num_kv}")

    @property
    def name(self) -> str:
        return f"{self.num_q}x{self.num_kv} {self.indices}"

    @property
    def q_start(self) -> int:
        """Position of the first query (the queries are the sequence's last ``num_q`` tokens)."""
        return self.num_kv - self.num_q


def parse_shapes(text: str) -> list[Shape]:
    """``"4096x8192,4096x32768:uniform"`` -> shapes (``:causal`` is the default)."""
    shapes = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        size, _, kind = item.partition(":")
        try:
            num_q, num_kv = (int(v) for v in size.lower().split("x"))
        except ValueError:
            raise ValueError(f"a shape is QUERIESxKEYS[:causal|:uniform], got {item!r}") from None
        shapes.append(Shape(num_q, num_kv, kind or "causal"))
    if not shapes:
        raise ValueError("no shapes given")
    return shapes


# ------------------------------------------------------------------------------------------ inputs

_PARTS = ("latent", "indices", "d_out", "indexer", "d_scores", "kl")


class Inputs:
    """One shape's inputs, drawn lazily part by part, each part from its own seeded generator.

    A process that needs only some parts gets the same values for them as one that draws all,
    so every family sees bit-identical inputs. Reference layout (dsa_ref's conventions):

    * ``q [T, H, D]`` bf16, ``kv [S, D]`` bf16 (absorbed MLA), ``d_out [T, H, d_v]`` bf16;
    * ``idx [T, K]`` int64, ``-1`` = unused slot; ``empty_rows`` have no valid slot;
    * ``iq [T, H_I, D_I]`` bf16, ``ik [S, D_I]`` bf16, ``iw [T, H_I]`` fp32 (scales folded in),
      causal windows ``starts``/``ends`` int64 ``[T]``; ``d_scores [T, K]`` fp32 (0 at ``-1`` slots);
    * ``kl_target [T, K]`` fp32 >= 0, ``kl_logits [T, K]`` fp32 (``-inf`` at ``-1`` slots), ``kl_valid``.
    """

    def __init__(self, shape: Shape, dims: Dims = V32, *, device: str | torch.device = "cuda", seed: int = 0,
                 check_rows: int = 64, sm_scale: float = SM_SCALE) -> None:
        if dims.topk > shape.num_kv:
            raise ValueError(f"top-k {dims.topk} exceeds the {shape.num_kv} keys of {shape.name}")
        self.shape, self.dims, self.device, self.seed = shape, dims, torch.device(device), seed
        self.sm_scale = float(sm_scale)
        T = shape.num_q
        block = max(1, min(check_rows, T // 4))
        starts = sorted({0, T // 2, T - block})
        #: the row blocks ``[lo, hi)`` the checks compare (first, middle, last)
        self.check_blocks = [(lo, min(lo + block, T)) for lo in starts]
        #: rows whose every slot is -1 (one in each check block)
        self.empty_rows = sorted({min(1, T - 1), min(T // 2 + 1, T - 1), max(T - 2, 0)})
        #: rows with a quarter of their slots set to -1 (the first two check blocks)
        self.sparse_rows = sorted({r for lo in (2, T // 2 + 2) for r in range(lo, min(lo + 8, T))}
                                  - set(self.empty_rows))
        self._memo: dict = {}

    def _generator(self, part: str) -> torch.Generator:
        g = torch.Generator(device=self.device)
        g.manual_seed(self.seed * 1000 + _PARTS.index(part))
        return g

    def memo(self, key: str, build: Callable):
        """``build()`` once per key: peers share converted inputs (TileLang's forward and backward)."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    # causal windows: query t (position q_start + t) sees keys [0, q_start + t + 1)
    @cached_property
    def starts(self) -> torch.Tensor:
        return torch.zeros(self.shape.num_q, dtype=torch.int64, device=self.device)

    @cached_property
    def ends(self) -> torch.Tensor:
        return self.shape.q_start + 1 + torch.arange(self.shape.num_q, device=self.device)

    @cached_property
    def _latent(self) -> tuple[torch.Tensor, torch.Tensor]:
        g, d = self._generator("latent"), self.dims
        kw = dict(generator=g, device=self.device, dtype=torch.bfloat16)
        return torch.randn(self.shape.num_q, d.heads, d.dim, **kw), torch.randn(self.shape.num_kv, d.dim, **kw)

    @property
    def q(self) -> torch.Tensor:
        return self._latent[0]

    @property
    def kv(self) -> torch.Tensor:
        return self._latent[1]

    @cached_property
    def idx(self) -> torch.Tensor:
        g = self._generator("indices")
        T, S, K = self.shape.num_q, self.shape.num_kv, self.dims.topk
        scores = torch.rand(T, S, generator=g, device=self.device)  # [T, S]
        if self.shape.indices == "causal":
            keys = torch.arange(S, device=self.device)
            scores.masked_fill_(keys[None, :] >= self.ends[:, None], float("-inf"))
        vals, idx = torch.topk(scores, K, dim=1)  # [T, K]
        del scores
        idx = torch.where(torch.isfinite(vals), idx, torch.full_like(idx, -1))
        idx[torch.tensor(self.empty_rows, device=self.device)] = -1
        if self.sparse_rows:
            rows = torch.tensor(self.sparse_rows, device=self.device)
            drop = torch.rand(len(self.sparse_rows), K, generator=g, device=self.device) < 0.25
            idx[rows] = torch.where(drop, torch.full_like(idx[rows], -1), idx[rows])
        return idx.contiguous()

    @cached_property
    def d_out(self) -> torch.Tensor:
        d = self.dims
        return torch.randn(self.shape.num_q, d.heads, d.dim_v, generator=self._generator("d_out"),
                           device=self.device, dtype=torch.bfloat16)

    @cached_property
    def _indexer(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g, d, T, S = self._generator("indexer"), self.dims, self.shape.num_q, self.shape.num_kv
        kw = dict(generator=g, device=self.device)
        iq = torch.randn(T, d.index_heads, d.index_dim, dtype=torch.bfloat16, **kw)
        ik = torch.randn(S, d.index_dim, dtype=torch.bfloat16, **kw)
        iw = torch.randn(T, d.index_heads, **kw) * d.index_heads**-0.5 * d.index_dim**-0.5
        return iq, ik, iw

    @property
    def iq(self) -> torch.Tensor:
        return self._indexer[0]

    @property
    def ik(self) -> torch.Tensor:
        return self._indexer[1]

    @property
    def iw(self) -> torch.Tensor:
        return self._indexer[2]

    @cached_property
    def d_scores(self) -> torch.Tensor:
        d = torch.randn(self.idx.shape, generator=self._generator("d_scores"), device=self.device)
        return d.masked_fill(self.idx < 0, 0.0)

    @cached_property
    def _kl(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = self._generator("kl")
        valid = self.idx >= 0
        target = torch.rand(self.idx.shape, generator=g, device=self.device).masked_fill(~valid, 0.0)
        logits = (2 * torch.randn(self.idx.shape, generator=g, device=self.device)).masked_fill(~valid, float("-inf"))
        return target, logits

    @property
    def kl_target(self) -> torch.Tensor:
        return self._kl[0]

    @property
    def kl_logits(self) -> torch.Tensor:
        return self._kl[1]

    @cached_property
    def kl_valid(self) -> torch.Tensor:
        return self.idx >= 0  # made once: the timed calls hold the op alone, not this comparison

    def only_rows(self, t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """``t`` (``[T, ...]``) with every row outside ``[lo, hi)`` zeroed: an output gradient for one block."""
        keep = torch.zeros(t.shape[0], dtype=torch.bool, device=t.device)
        keep[lo:hi] = True
        return torch.where(keep.view(-1, *([1] * (t.dim() - 1))), t, torch.zeros((), dtype=t.dtype, device=t.device))

    def fingerprint(self) -> dict:
        """Checksums of the parts drawn so far (equal in every process that drew them)."""
        fp = {}
        if "_latent" in self.__dict__:
            fp.update(q=float(self.q.double().sum()), kv=float(self.kv.double().sum()))
        if "idx" in self.__dict__:
            fp["idx"] = int(self.idx.sum())
        if "d_out" in self.__dict__:
            fp["d_out"] = float(self.d_out.double().sum())
        if "_indexer" in self.__dict__:
            fp.update(iq=float(self.iq.double().sum()), ik=float(self.ik.double().sum()),
                      iw=float(self.iw.double().sum()))
        if "d_scores" in self.__dict__:
            fp["d_scores"] = float(self.d_scores.double().sum())
        if "_kl" in self.__dict__:
            fp["kl_target"] = float(self.kl_target.double().sum())
        return fp

    def describe(self) -> dict:
        return {"name": self.shape.name, "num_q": self.shape.num_q, "num_kv": self.shape.num_kv,
                "indices": self.shape.indices, "q_start": self.shape.q_start, "empty_rows": self.empty_rows,
                "sparse_rows": self.sparse_rows, "check_blocks": [list(b) for b in self.check_blocks]}


def thd_peer_inputs(x: Inputs, convention: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashMLA's and Megatron's layout: ``q [T, H, D]``, ``kv [S, 1, D]``, ``indices [T, 1, K]`` int32
    in the convention's sentinel (both take ``-1``), converted by the oracle's `from_reference_indices`."""
    def build():
        idx = from_reference_indices(x.idx, CONVENTIONS[convention], num_keys=x.shape.num_kv)
        return x.q.contiguous(), x.kv[:, None, :].contiguous(), idx.contiguous()
    return x.memo(f"thd:{convention}", build)


def bshd_peer_inputs(x: Inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TileLang's examples' layout: ``q [1, T, H, D]``, ``kv [1, S + 1, 1, D]``, ``indices [1, T, 1, K]`` int32.

    The examples mark an unused slot by an index after the query's position (their tests pad with
    ``S``; ``-1`` would read ``KV[-1]``), so unused slots get ``S``. Their simple forward and their
    backward read (and the backward adds into) row ``index`` even for masked slots, so ``kv`` gets a
    zero row ``S``: every access stays inside the tensors. The checks see ``kv[:, :S]``.
    (`from_reference_indices` cannot write these: it places queries at positions ``0..T-1``.)
    """
    def build():
        S = x.shape.num_kv
        kv = torch.cat([x.kv, x.kv.new_zeros(1, x.kv.shape[1])])  # [S + 1, D]
        idx = torch.where(x.idx >= 0, x.idx, torch.full_like(x.idx, S)).to(torch.int32)
        return x.q[None].contiguous(), kv[None, :, None, :].contiguous(), idx[None, :, None, :].contiguous()
    return x.memo("bshd", build)


# ------------------------------------------------------------------------------------------ checks

#: the attention target's tolerance (tests/test_kernels_attention_target.py gives the error budget:
#: ~1e-5 relative per probability; an entry is at most H)
def target_tolerance(heads: int) -> Tolerance:
    return Tolerance(rel_l2=1e-4, atol=2e-4 * heads, rtol=0.0, min_cosine=1 - 1e-8, atol_scaled=False,
                     reason="head sums of fp32 probabilities from bf16 scores: ~1e-5 relative per entry, 10x margin")


#: an fp8 kernel's scores against its dequantised inputs: the products are exact, but Hopper's fp8
#: tensor cores accumulate with about 14 mantissa bits (DeepSeek-V3's report), ~1e-4 .. 1e-3 relative
FP8_SCORES_TOLERANCE = Tolerance(rel_l2=2e-3, atol=1e-2, rtol=1e-2, min_cosine=1 - 1e-5,
                                 reason="fp8 e4m3 products accumulated on Hopper's fp8 tensor cores (~14 bits), "
                                        "against the dequantised inputs")

#: the indexer backward's gradients (they feed a bf16 step): the bf16 preset, its elementwise rtol times
#: the magnitude (a kernel rounds each g = d * w * relu' to bf16 before its GEMMs and accumulates in
#: float32: `accumulation_rtol`)
INDEXER_GRAD_TOLERANCE = replace(tolerance_for(torch.bfloat16),
                                 rtol=max(tolerance_for(torch.bfloat16).rtol, accumulation_rtol(torch.bfloat16)))


def _rows(t: torch.Tensor, lo: int, hi: int, layout: str) -> torch.Tensor:
    """Rows ``[lo, hi)`` of a per-token tensor: ``t[lo:hi]`` in THD, ``t[:, lo:hi]`` in BSHD (B = 1)."""
    return t[:, lo:hi] if layout == "BSHD" else t[lo:hi]


def _classify(t: torch.Tensor) -> str:
    """What a tensor holds, in one word: ``0``, ``NaN``, ``+inf``, ``-inf``, ``finite`` or ``mixed``."""
    t = t.float()
    if t.numel() == 0:
        return "n/a"
    if bool(torch.isnan(t).all()):
        return "NaN"
    if bool((t == 0).all()):
        return "0"
    if bool(torch.isposinf(t).all()):
        return "+inf"
    if bool(torch.isneginf(t).all()):
        return "-inf"
    return "finite" if bool(torch.isfinite(t).all()) else "mixed"


def empty_row_facts(out: torch.Tensor, lse: torch.Tensor | None, rows: list[int], layout: str) -> dict:
    """What a forward returned on the rows with no valid slot: ``{"out": ..., "lse": ...}`` (see `_classify`)."""
    if not rows:
        return {}
    sel = torch.tensor(rows, device=out.device)
    pick = (lambda t: t[0].index_select(0, sel)) if layout == "BSHD" else (lambda t: t.index_select(0, sel))
    return {"out": _classify(pick(out)), "lse": "none returned" if lse is None else _classify(pick(lse))}


def slot_facts(indices: torch.Tensor, x: Inputs, convention: str, q_start: int) -> dict:
    """How the peer's own rules read the slots, against dsa_ref's reading of the same inputs.

    ``slots_dropped``: slots dsa_ref counts that the peer's sentinel or causal rule leaves out (a
    causal kernel that places its queries at the wrong positions drops keys); ``slots_added``: the
    reverse (a sentinel read as a real row).
    """
    conv = CONVENTIONS[convention]
    peer = to_reference_indices(indices, conv, num_keys=x.shape.num_kv, q_start=q_start).to(x.idx.device)
    ours = x.idx
    facts = {"slots_valid_in_dsa_ref": int((ours >= 0).sum()),
             "slots_dropped": int(((ours >= 0) & (peer < 0)).sum()),
             "slots_added": int(((ours < 0) & (peer >= 0)).sum())}
    if conv.causal:
        facts["position_rule"] = (f"query t at q_start + t with q_start = {q_start}"
                                  + (" (the kernel ignores the real q_start)" if q_start != x.shape.q_start else ""))
    return facts


def summarise(comparisons: list[Comparison], notes: list[str] | None = None) -> dict:
    """Many comparisons (blocks x tensors) -> one check record: status, and per tensor the worst numbers."""
    tensors: dict[str, dict] = {}
    for c in comparisons:
        t = tensors.setdefault(c.name, {"ok": True, "rel_l2": 0.0, "max_abs": 0.0, "nonfinite": 0,
                                        "nonfinite_mismatch": 0, "failures": []})
        t["ok"] = t["ok"] and c.ok
        t["rel_l2"] = max(t["rel_l2"], c.rel_l2)
        t["max_abs"] = max(t["max_abs"], c.max_abs)
        t["nonfinite"] += c.nonfinite_actual
        t["nonfinite_mismatch"] += c.nonfinite_mismatch
        t["failures"].extend(f for f in c.failures if len(t["failures"]) < 3)
    ok = all(t["ok"] for t in tensors.values())
    return {"status": "ok" if ok else "mismatch",
            "max_abs": max((t["max_abs"] for t in tensors.values()), default=0.0),
            "rel_l2": max((t["rel_l2"] for t in tensors.values()), default=0.0),
            "tensors": tensors, "notes": list(notes or [])}


def _report_comparisons(reports: list[Report]) -> tuple[list[Comparison], list[str]]:
    comparisons, notes = [], []
    for r in reports:
        comparisons.extend(r.comparisons)
        notes.extend(n for n in r.notes if n not in notes)
    return comparisons, notes


def check_sparse_forward(out, lse, q, kv, indices, x: Inputs, *, convention: str, q_start: int) -> dict:
    """Check a sparse-MLA forward through `check_sparse_mla` with the peer's convention preset.

    Args:
        out, lse: the peer's outputs in its layout (``lse`` may be ``None``).
        q, kv, indices: exactly what the peer was given (its layout, index space and sentinel).
        x: the shape's inputs (check blocks, empty rows, dsa_ref's indices).
        convention: a key of `dsa_ref.oracle.CONVENTIONS`.
        q_start: the position the peer gives its first query (TileLang's simple kernel: 0).
    """
    conv = CONVENTIONS[convention]
    reports = [check_sparse_mla(_rows(out, lo, hi, conv.layout), None if lse is None else _rows(lse, lo, hi, conv.layout),
                                _rows(q, lo, hi, conv.layout), kv, _rows(indices, lo, hi, conv.layout),
                                convention=conv, sm_scale=x.sm_scale, d_v=x.dims.dim_v, q_start=q_start + lo)
               for lo, hi in x.check_blocks]
    record = summarise(*_report_comparisons(reports))
    record.update(convention=convention, q_start=q_start,
                  facts={"empty_rows": empty_row_facts(out, lse, x.empty_rows, conv.layout),
                         **slot_facts(indices, x, convention, q_start)})
    return record


def check_sparse_backward(call: Callable, q, kv, indices, x: Inputs, *, convention: str, q_start: int) -> dict:
    """Check a sparse-MLA backward block by block through `check_sparse_mla_backward`.

    ``call(d_out) -> (dq, dkv)`` runs the peer's backward for a reference-layout ``d_out [T, H, d_v]``
    and returns its gradients shaped like ``q`` and ``kv`` (as the check sees them). For each check
    block it gets a ``d_out`` that is zero outside the block, so ``dkv`` holds that block's share only.
    """
    conv = CONVENTIONS[convention]
    reports = []
    for lo, hi in x.check_blocks:
        d = x.only_rows(x.d_out, lo, hi)  # [T, H, d_v]
        d_peer = d[None].contiguous() if conv.layout == "BSHD" else d
        with torch.no_grad():
            dq, dkv = call(d_peer)
        reports.append(check_sparse_mla_backward(_rows(dq, lo, hi, conv.layout), dkv, _rows(d_peer, lo, hi, conv.layout),
                                                 _rows(q, lo, hi, conv.layout), kv, _rows(indices, lo, hi, conv.layout),
                                                 convention=conv, sm_scale=x.sm_scale, d_v=x.dims.dim_v,
                                                 q_start=q_start + lo))
        del dq, dkv
    record = summarise(*_report_comparisons(reports))
    record.update(convention=convention, q_start=q_start,
                  facts={"empty_rows_dq": _empty_rows_dq(call, q, x, conv.layout), **slot_facts(indices, x, convention, q_start)})
    return record


def _empty_rows_dq(call: Callable, q, x: Inputs, layout: str) -> str:
    """What the backward gives the queries of the rows with no valid slot (dsa_ref: 0)."""
    d = x.d_out[None].contiguous() if layout == "BSHD" else x.d_out
    with torch.no_grad():
        dq, _ = call(d)
    sel = torch.tensor(x.empty_rows, device=dq.device)
    return _classify((dq[0] if layout == "BSHD" else dq).index_select(0, sel))


def check_indexer_scores(scores, q, k, weights, x: Inputs, tol: Tolerance | None = None) -> dict:
    """Index scores ``[T, S]`` against the float64 reference, through `check_indexer`, on the check blocks.

    ``q``, ``k``, ``weights`` are what the kernel computed with (for fp8 kernels: the dequantised
    values); ``tol`` defaults to `check_indexer`'s (the float32 preset).
    """
    reports = [check_indexer(scores[lo:hi], q[lo:hi], k, weights[lo:hi], starts=x.starts[lo:hi], ends=x.ends[lo:hi],
                             tol=tol) for lo, hi in x.check_blocks]
    record = summarise(*_report_comparisons(reports))
    if tol is not None:
        record["notes"].append(f"tolerance: {tol.reason}")
    return record


def check_indexer_backward(call: Callable, x: Inputs) -> dict:
    """``call(d_scores) -> (dq, dk, dw)`` against autograd of `dsa_ref.index_scores_at` in float64, per block."""
    comparisons = []
    k64 = x.ik.detach().double()
    for lo, hi in x.check_blocks:
        d = x.only_rows(x.d_scores, lo, hi)
        with torch.no_grad():
            dq, dk, dw = call(d)
        q64 = x.iq[lo:hi].detach().double().requires_grad_(True)
        kk = k64.clone().requires_grad_(True)
        w64 = x.iw[lo:hi].detach().double().requires_grad_(True)
        with torch.enable_grad():
            s = index_scores_at(q64, kk, w64, x.idx[lo:hi])  # [R, K], -inf at -1 slots
            g = torch.where(torch.isfinite(s), d[lo:hi].double(), torch.zeros_like(s))
            rq, rk, rw = torch.autograd.grad(s, (q64, kk, w64), g)
        m_dq, m_dk, m_dw = indexer_backward_magnitudes(x.iq[lo:hi], x.ik, x.iw[lo:hi], x.idx[lo:hi], d[lo:hi])
        comparisons += [compare(dq[lo:hi], rq, name="dq", tol=INDEXER_GRAD_TOLERANCE, magnitude=m_dq),
                        compare(dk, rk, name="dk", tol=INDEXER_GRAD_TOLERANCE, head_dim=None, magnitude=m_dk),
                        compare(dw[lo:hi], rw, name="dw", tol=INDEXER_GRAD_TOLERANCE, head_dim=None, magnitude=m_dw)]
    return summarise(comparisons, ["gradients compared with the bf16 preset (dw too: it feeds a bf16 step), "
                                   "elementwise relative to the magnitude m = sum of |contributions| "
                                   "(dsa_ref.oracle.indexer_backward_magnitudes)"])


def check_attention_target(mass: torch.Tensor, x: Inputs) -> dict:
    """Head-summed probabilities at the slots ``[T, K]`` against `dsa_ref.attention_head_sum` in float64."""
    kv64 = x.kv.double()
    comparisons = []
    for lo, hi in x.check_blocks:
        q64, idx = x.q[lo:hi].double(), x.idx[lo:hi]
        _, lse = sparse_mla(q64, kv64, idx, sm_scale=x.sm_scale, d_v=x.dims.dim_v)
        ref = attention_head_sum(q64, kv64, idx, lse, sm_scale=x.sm_scale)
        comparisons.append(compare(mass[lo:hi], ref, name="target", tol=target_tolerance(x.dims.heads), head_dim=None))
    return summarise(comparisons)


def check_kl(loss: torch.Tensor, grad: torch.Tensor, x: Inputs) -> dict:
    """The KL sum over all rows and its gradient against `indexer_loss_on_slots` in float64."""
    logits = x.kl_logits.double().requires_grad_(True)
    with torch.enable_grad():
        ref = indexer_loss_on_slots(logits, x.kl_target.double(), x.kl_valid, reduction="sum")
        (ref_grad,) = torch.autograd.grad(ref, logits)
    f32 = tolerance_for(torch.float32)
    return summarise([compare(loss.detach().reshape(1).float(), ref.detach().reshape(1), name="loss", tol=f32, head_dim=None),
                      compare(grad.float(), ref_grad, name="d_scores", tol=f32, head_dim=None)])


# ------------------------------------------------------------------------------------------ families


class Unavailable(Exception):
    """A family cannot run here (missing folder, no CUDA, no tilelang): its results are ``skipped``."""


class Family:
    """A loaded peer family: its modules, imported on first use so one broken file fails only its ops."""

    def __init__(self, name: str, info: dict | None = None, loader: Callable[[str], object] | None = None):
        self.name, self.info, self._loader, self._modules = name, dict(info or {}), loader, {}

    def module(self, name: str):
        if name not in self._modules:
            if self._loader is None:
                raise RuntimeError(f"family {self.name} has no module {name}")
            self._modules[name] = self._loader(name)
        return self._modules[name]


def _upstream(path: Path) -> str | None:
    f = path / "UPSTREAM_COMMIT"
    return f.read_text().strip() if f.is_file() else None


def _need_cuda(device: torch.device) -> None:
    if device.type != "cuda" or not torch.cuda.is_available():
        raise Unavailable("needs a CUDA GPU")


def load_family(name: str, peers_dir: Path, device: torch.device) -> Family:
    """Load one family or raise `Unavailable` (-> skipped); any other exception means failed."""
    peers_dir = Path(peers_dir)
    if name == "dsa_ref":
        _need_cuda(device)
        from dsa_ref.kernels import available

        ok, why = available()
        if not ok:
            raise Unavailable(f"dsa_ref's TileLang kernels are unavailable: {why}")
        return Family(name)
    if name == "flashmla":
        folder = peers_dir / "flashmla"
        if not (folder / "build.py").is_file():
            raise Unavailable(f"no {folder}/build.py")
        _need_cuda(device)
        os.environ.setdefault("MAX_JOBS", "16")
        os.environ.setdefault("FLASHMLA_BUILD_DIR", "/tmp/flashmla_build")
        spec = importlib.util.spec_from_file_location("flashmla_peer_build", folder / "build.py")
        build = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(build)
        t0 = time.perf_counter()
        mod = build.load_module(verbose=False)
        info = {"build": dict(getattr(build, "USED", {})), "load_s": time.perf_counter() - t0}
        return Family(name, info, loader=lambda _: mod)
    if name == "megatron":
        folder = peers_dir / "megatron"
        if not (folder / "core").is_dir():
            raise Unavailable(f"no {folder}/core")
        _need_cuda(device)
        if str(peers_dir) not in sys.path:
            sys.path.insert(0, str(peers_dir))
        import megatron

        where = Path(megatron.__file__).resolve().parent
        if where != folder.resolve():
            raise RuntimeError(f"`import megatron` found {where}, not {folder} (another Megatron is installed)")

        def load(module: str):
            mod = importlib.import_module(f"{MEGATRON_OPS}.{module}")
            if not getattr(mod, "HAVE_TILELANG", True):
                raise RuntimeError("Megatron's ops found no tilelang (HAVE_TILELANG is False)")
            return mod

        return Family(name, {"upstream": _upstream(folder)}, loader=load)
    if name == "tilelang":
        folder = peers_dir / "tilelang_examples"
        if not folder.is_dir():
            raise Unavailable(f"no {folder}")
        _need_cuda(device)
        try:
            import tilelang
        except Exception as err:  # noqa: BLE001 - ImportError, or a broken install
            raise Unavailable(f"tilelang cannot be imported: {err}") from err
        return Family(name, {"upstream": _upstream(folder), "tilelang": tilelang.__version__},
                      loader=lambda stem: _load_example(folder, stem))
    raise ValueError(f"unknown family {name!r}; known: {FAMILIES}")


def _load_example(folder: Path, stem: str):
    """Import ``folder/stem.py`` as ``tilelang_example_<stem>`` with ``folder`` first on ``sys.path``,
    so its ``from utils import ...`` finds the examples' ``utils.py`` (a ``utils`` imported before is
    put back afterwards)."""
    saved = sys.modules.pop("utils", None)
    sys.path.insert(0, str(folder))
    try:
        spec = importlib.util.spec_from_file_location(f"tilelang_example_{stem}", folder / f"{stem}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("utils", None)
        if saved is not None:
            sys.modules["utils"] = saved


# ------------------------------------------------------------------------------------------ implementations


@dataclass
class Bench:
    """A prepared implementation: ``run()`` is the timed call, ``check()`` returns its check record."""

    run: Callable[[], object]
    check: Callable[[], dict]
    note: str | None = None


def _no_grad(fn: Callable) -> Callable:
    def run():
        with torch.no_grad():
            return fn()
    return run


def _dsa_ref_sparse_fwd(x: Inputs, lib: Family, schedule: str = "auto") -> Bench:
    from dsa_ref.kernels.autograd import sparse_mla_tilelang

    run = _no_grad(lambda: sparse_mla_tilelang(x.q, x.kv, x.idx, sm_scale=x.sm_scale, d_v=x.dims.dim_v,
                                               schedule=schedule, validate=False))

    def check():
        out, lse = run()
        return check_sparse_forward(out, lse, x.q, x.kv, x.idx, x, convention="dsa_ref", q_start=0)

    return Bench(run, check)


def _flashmla_sparse_fwd(x: Inputs, lib: Family) -> Bench:
    mod = lib.module("flashmla")
    q, kv, idx = thd_peer_inputs(x, "flashmla_sparse_prefill")

    def run():
        out, _max_logits, lse = mod.sparse_prefill_fwd(q, kv, idx, x.sm_scale, x.dims.dim_v, None, None)
        return out, lse

    def check():
        out, lse = run()
        return check_sparse_forward(out, lse, q, kv, idx, x, convention="flashmla_sparse_prefill", q_start=0)

    return Bench(_no_grad(run), check)


def _megatron_sparse_fwd(x: Inputs, lib: Family) -> Bench:
    fwd = lib.module("tilelang_sparse_mla_fwd")
    q, kv, idx = thd_peer_inputs(x, "megatron_tilelang_ops")
    run = _no_grad(lambda: fwd.sparse_mla_fwd_interface(q, kv, idx, sm_scale=x.sm_scale, d_v=x.dims.dim_v))

    def check():
        out, lse = run()
        return check_sparse_forward(out, lse, q, kv, idx, x, convention="megatron_tilelang_ops", q_start=0)

    return Bench(run, check)


def _tilelang_simple_fwd(x: Inputs, lib: Family) -> Bench:
    mod = lib.module("sparse_mla_fwd")
    q, kv, idx = bshd_peer_inputs(x)
    run = _no_grad(lambda: mod.sparse_mla_fwd_interface(q, kv, idx, sm_scale=x.sm_scale, d_v=x.dims.dim_v))

    def check():  # the simple kernel places query t at position t, whatever q_start is
        out, lse = run()
        return check_sparse_forward(out, lse, q, kv[:, :x.shape.num_kv], idx, x, convention="tilelang_deepseek_v32",
                                    q_start=0)

    return Bench(run, check, note="causal rule: query t at position t (no q_start argument)")


def _tilelang_pipelined_fwd(x: Inputs, lib: Family) -> Bench:
    mod = lib.module("sparse_mla_fwd_pipelined")
    q, kv, idx = bshd_peer_inputs(x)
    q_start = x.shape.q_start
    note = "the compiled kernel (return_kernel=True), called with q_start_index_s as an int32 tensor"
    try:  # as the example's own benchmark does: compile once, then call the kernel
        with torch.no_grad():
            kernel = mod.sparse_mla_fwd_interface(q, kv, idx, q_start, 1, sm_scale=x.sm_scale, return_kernel=True)
        q_start_t = torch.tensor([q_start], dtype=torch.int32, device=q.device)
        run = _no_grad(lambda: kernel(q, kv, idx, q_start_t))
        run()
    except Exception as err:  # noqa: BLE001 - fall back to the interface, and say so
        note = f"sparse_mla_fwd_interface per call (return_kernel=True failed: {_reason(err)[:200]})"
        run = _no_grad(lambda: mod.sparse_mla_fwd_interface(q, kv, idx, q_start, 1, sm_scale=x.sm_scale))

    def check():
        out, lse = run()
        return check_sparse_forward(out, lse, q, kv[:, :x.shape.num_kv], idx, x, convention="tilelang_deepseek_v32",
                                    q_start=q_start)

    return Bench(run, check, note=note)


def _dsa_ref_sparse_bwd(x: Inputs, lib: Family, backward: str = "auto") -> Bench:
    from dsa_ref.kernels.autograd import sparse_mla_tilelang

    q, kv = x.q.detach().requires_grad_(True), x.kv.detach().requires_grad_(True)
    out, _ = sparse_mla_tilelang(q, kv, x.idx, sm_scale=x.sm_scale, d_v=x.dims.dim_v, validate=False,
                                 backward=backward)

    def call(d_out):
        return torch.autograd.grad(out, (q, kv), d_out, retain_graph=True)

    def check():
        return check_sparse_backward(call, x.q, x.kv, x.idx, x, convention="dsa_ref", q_start=0)

    return Bench(lambda: call(x.d_out), check, note="the backward alone (the forward graph is kept)")


def _megatron_sparse_bwd(x: Inputs, lib: Family) -> Bench:
    fwd, bwd = lib.module("tilelang_sparse_mla_fwd"), lib.module("tilelang_sparse_mla_bwd")
    q, kv, idx = thd_peer_inputs(x, "megatron_tilelang_ops")
    with torch.no_grad():
        out, lse = fwd.sparse_mla_fwd_interface(q, kv, idx, sm_scale=x.sm_scale, d_v=x.dims.dim_v)

    def call(d_out):
        return bwd.sparse_mla_bwd(q, kv, out, d_out.contiguous(), idx, lse, sm_scale=x.sm_scale)

    def check():
        return check_sparse_backward(call, q, kv, idx, x, convention="megatron_tilelang_ops", q_start=0)

    return Bench(_no_grad(lambda: call(x.d_out)), check,
                 note="sparse_mla_bwd on its forward's out and lse (Delta from out); Megatron's autograd "
                      "function would also re-run the forward")


def _tilelang_sparse_bwd(x: Inputs, lib: Family) -> Bench:
    fwd, bwd = lib.module("sparse_mla_fwd"), lib.module("sparse_mla_bwd")
    q, kv, idx = bshd_peer_inputs(x)
    S = x.shape.num_kv
    with torch.no_grad():
        out, lse = fwd.sparse_mla_fwd_interface(q, kv, idx, sm_scale=x.sm_scale, d_v=x.dims.dim_v)
    d_full = x.d_out[None].contiguous()  # [1, T, H, d_v]

    def call(d_out):  # d_out [1, T, H, d_v]; the check sees dkv without the zero row
        dq, dkv = bwd.sparse_mla_bwd(q, kv, out, d_out, idx, lse, sm_scale=x.sm_scale)
        return dq, dkv[:, :S]

    def check():  # the backward places query t at position t, as the simple forward does
        return check_sparse_backward(call, q, kv[:, :S], idx, x, convention="tilelang_deepseek_v32", q_start=0)

    return Bench(_no_grad(lambda: bwd.sparse_mla_bwd(q, kv, out, d_full, idx, lse, sm_scale=x.sm_scale)), check,
                 note="on the simple forward's out and lse; causal rule: query t at position t")


def _dsa_ref_indexer_fwd(x: Inputs, lib: Family) -> Bench:
    from dsa_ref.kernels.autograd import lightning_indexer_tilelang

    run = _no_grad(lambda: lightning_indexer_tilelang(x.iq, x.ik, x.iw, starts=x.starts, ends=x.ends))
    return Bench(run, lambda: check_indexer_scores(run(), x.iq, x.ik, x.iw, x))


def _megatron_indexer_fwd(x: Inputs, lib: Family) -> Bench:
    mod = lib.module("tilelang_indexer_fwd")
    starts, ends = x.starts.to(torch.int32), x.ends.to(torch.int32)
    run = _no_grad(lambda: mod.indexer_fwd_interface(x.iq, x.ik, x.iw, starts, ends, clean_logits=True, use_relu=True))
    return Bench(run, lambda: check_indexer_scores(run(), x.iq, x.ik, x.iw, x))


def _tilelang_fp8_indexer_fwd(x: Inputs, lib: Family) -> Bench:
    mod, utils = lib.module("fp8_lighting_indexer"), lib.module("utils")
    starts, ends = x.starts.to(torch.int32), x.ends.to(torch.int32)
    q8 = x.iq.to(torch.float8_e4m3fn)  # as the example: q cast, k scaled per row
    k8, k_scale = utils.per_custom_dims_cast_to_fp8(x.ik, (0,), False)
    k_scale = k_scale.reshape(-1).float().contiguous()  # [S]
    run = _no_grad(lambda: mod.mqa_attn_return_logits_interface(q8, k8, k_scale, x.iw, starts, ends, clean_logits=True))

    def check():  # against the dequantised inputs: the kernel's own arithmetic, not the quantisation
        return check_indexer_scores(run(), q8.float(), k8.float() * k_scale[:, None], x.iw, x, tol=FP8_SCORES_TOLERANCE)

    return Bench(run, check, note="q cast to fp8 e4m3, k scaled per row to fp8 (per_custom_dims_cast_to_fp8); "
                                  "checked against the dequantised q and k")


def _dsa_ref_indexer_bwd(x: Inputs, lib: Family) -> Bench:
    from dsa_ref.kernels.indexer_bwd import index_scores_at_tilelang

    q, k, w = (t.detach().requires_grad_(True) for t in (x.iq, x.ik, x.iw))
    scores = index_scores_at_tilelang(q, k, w, x.idx)  # [T, K]

    def call(d):  # -> (dq, dk, dw)
        return torch.autograd.grad(scores, (q, k, w), d, retain_graph=True)

    return Bench(lambda: call(x.d_scores), lambda: check_indexer_backward(call, x),
                 note="the backward alone (the forward graph is kept)")


def _megatron_indexer_bwd(x: Inputs, lib: Family) -> Bench:
    mod = lib.module("tilelang_indexer_bwd")
    idx = x.idx.to(torch.int32).contiguous()

    def call(d):  # indexer_bwd_interface returns (dq, dw, dk)
        dq, dw, dk = mod.indexer_bwd_interface(x.iq, x.iw, x.ik, idx, d, use_relu=True)
        return dq, dk, dw

    return Bench(_no_grad(lambda: call(x.d_scores)), lambda: check_indexer_backward(call, x))


def _dsa_ref_attention_target(x: Inputs, lib: Family) -> Bench:
    from dsa_ref.kernels.attention_target import attention_head_sum_tilelang
    from dsa_ref.kernels.autograd import sparse_mla_tilelang

    with torch.no_grad():
        _, lse = sparse_mla_tilelang(x.q, x.kv, x.idx, sm_scale=x.sm_scale, d_v=x.dims.dim_v, validate=False)
    run = _no_grad(lambda: attention_head_sum_tilelang(x.q, x.kv, x.idx, lse, sm_scale=x.sm_scale))
    return Bench(run, lambda: check_attention_target(run(), x), note="from the forward's LSE (not timed)")


def _megatron_attention_target(x: Inputs, lib: Family) -> Bench:
    mod = lib.module("tilelang_indexer_loss")
    idx = x.idx.to(torch.int32).contiguous()
    run = _no_grad(lambda: mod.sparse_indexer_target_interface(x.q, x.kv, idx, x.sm_scale))
    return Bench(run, lambda: check_attention_target(run(), x), note="recomputes the softmax (two passes over the slots)")


def _dsa_ref_kl(x: Inputs, lib: Family, *, kernel: bool = True) -> Bench:
    from dsa_ref.kernels.indexer_loss_slots import indexer_loss_on_slots_tilelang

    logits = x.kl_logits.detach().requires_grad_(True)
    loss_fn = indexer_loss_on_slots_tilelang if kernel else indexer_loss_on_slots

    def run():
        loss = loss_fn(logits, x.kl_target, x.kl_valid, reduction="sum")
        (grad,) = torch.autograd.grad(loss, logits)
        return loss, grad

    return Bench(run, lambda: check_kl(*run(), x), note=None if kernel else "PyTorch")


def _dsa_ref_kl_kernel(x: Inputs, lib: Family) -> Bench:
    from dsa_ref.kernels.indexer_loss_slots import slot_kl_tilelang

    run = _no_grad(lambda: slot_kl_tilelang(x.kl_logits, x.kl_target, x.kl_valid))
    return Bench(run, lambda: check_kl(*run(), x))


def _megatron_kl(x: Inputs, lib: Family) -> Bench:
    mod = lib.module("tilelang_indexer_loss")
    run = _no_grad(lambda: mod.sparse_indexer_kl_interface(x.kl_target, x.kl_logits, x.kl_valid))
    return Bench(run, lambda: check_kl(*run(), x))


def _megatron_kl_autograd(x: Inputs, lib: Family) -> Bench:
    mod = lib.module("tilelang_indexer_loss")
    logits = x.kl_logits.detach().requires_grad_(True)

    def run():
        loss = mod.SparseIndexerKLLoss.apply(x.kl_target, logits, x.kl_valid)
        (grad,) = torch.autograd.grad(loss, logits)
        return loss, grad

    return Bench(run, lambda: check_kl(*run(), x))


@dataclass(frozen=True)
class Op:
    """One operation: what it is, how its TFLOP/s are counted (``flop(x)`` -> FLOPs, or ``None``)."""

    title: str
    formula: str | None
    flop: Callable[[Inputs], float] | None


def _fwd_flop(x):
    d = x.dims
    return 2 * x.shape.num_q * d.heads * d.topk * (d.dim + d.dim_v)


def _bwd_flop(x):
    d = x.dims
    return 2 * x.shape.num_q * d.heads * d.topk * (3 * d.dim + 2 * d.dim_v)


def _indexer_flop(x):
    pairs = int((x.ends - x.starts).sum())
    return 2 * pairs * x.dims.index_heads * x.dims.index_dim


def _indexer_bwd_flop(x):
    return 3 * 2 * x.shape.num_q * x.dims.topk * x.dims.index_heads * x.dims.index_dim


def _target_flop(x):
    return 2 * x.shape.num_q * x.dims.heads * x.dims.topk * x.dims.dim


OPS: dict[str, Op] = {
    "sparse_fwd": Op("sparse MLA forward", "2·T·H·K·(D + d_v) = 2·T·128·2048·(576 + 512); every slot counted", _fwd_flop),
    "sparse_bwd": Op("sparse MLA backward", "2·T·H·K·(3·D + 2·d_v) = 2·T·128·2048·(3·576 + 2·512)", _bwd_flop),
    "indexer_fwd": Op("lightning indexer scores (bf16; TileLang's example in fp8)",
                      "2·P·H_I·D_I = 2·P·64·128, P = Σ_t (ends[t] − starts[t]): the (query, key) pairs in the windows",
                      _indexer_flop),
    "indexer_bwd": Op("indexer backward of the scores at the slots (dq, dk, dw)", "3 · 2·T·K·H_I·D_I = 3 · 2·T·2048·64·128",
                      _indexer_bwd_flop),
    "attention_target": Op("attention target: softmax probabilities at the slots, summed over heads",
                           "2·T·H·K·D = 2·T·128·2048·576 (one score per slot and head; a kernel that computes the "
                           "scores twice is counted once)", _target_flop),
    "kl_loss": Op("KL loss over the slots, value and gradient", None, None),
}


@dataclass(frozen=True)
class Impl:
    """One implementation of one op: who provides it, the call made, its sparse-MLA convention preset."""

    name: str
    family: str
    op: str
    call: str
    setup: Callable[[Inputs, Family], Bench]
    convention: str | None = None  # a key of dsa_ref.oracle.CONVENTIONS (sparse MLA ops)
    compile_per_shape: bool = False  # its kernels are specialised on the sequence lengths


_FWD_THD = "q [T,H,576] bf16, kv [S,1,576] bf16, indices [T,1,K] int32 (-1 unused)"
_BSHD = "q [1,T,H,576], kv [1,S+1,1,576] (zero row S), indices [1,T,1,K] int32 (S unused)"
IMPLS: list[Impl] = [
    Impl("dsa_ref", "dsa_ref", "sparse_fwd", "dsa_ref.kernels.autograd.sparse_mla_tilelang(q [T,H,576], kv [S,576], "
         "indices [T,K] int64 (-1 unused), sm_scale=, d_v=512, validate=False)", _dsa_ref_sparse_fwd, "dsa_ref"),
    Impl("dsa_ref_staggered", "dsa_ref", "sparse_fwd", "the same call with schedule='staggered' (FlashMLA's scheme)",
         functools.partial(_dsa_ref_sparse_fwd, schedule="staggered"), "dsa_ref"),
    Impl("flashmla", "flashmla", "sparse_fwd", f"mod.sparse_prefill_fwd({_FWD_THD}, sm_scale, 512, None, None) "
         "-> out, max_logits, lse", _flashmla_sparse_fwd, "flashmla_sparse_prefill"),
    Impl("megatron", "megatron", "sparse_fwd", f"ops.tilelang_sparse_mla_fwd.sparse_mla_fwd_interface({_FWD_THD}, "
         "sm_scale=, d_v=512) -> out, lse", _megatron_sparse_fwd, "megatron_tilelang_ops"),
    Impl("tilelang_simple", "tilelang", "sparse_fwd", f"sparse_mla_fwd.sparse_mla_fwd_interface({_BSHD}, sm_scale=, "
         "d_v=512) -> out, lse", _tilelang_simple_fwd, "tilelang_deepseek_v32"),
    Impl("tilelang_pipelined", "tilelang", "sparse_fwd", f"sparse_mla_fwd_pipelined.sparse_mla_fwd_interface({_BSHD}, "
         "q_start, kv_stride=1, sm_scale=, return_kernel=True), then kernel(q, kv, indices, q_start int32 [1])",
         _tilelang_pipelined_fwd, "tilelang_deepseek_v32"),
    Impl("dsa_ref", "dsa_ref", "sparse_bwd", "torch.autograd.grad(out, (q, kv), d_out) through sparse_mla_tilelang "
         "(backward='auto': two passes at 128 heads up to 16384 keys)", _dsa_ref_sparse_bwd, "dsa_ref"),
    Impl("dsa_ref_one_pass", "dsa_ref", "sparse_bwd", "the same with sparse_mla_tilelang(..., backward='one_pass')",
         functools.partial(_dsa_ref_sparse_bwd, backward="one_pass"), "dsa_ref"),
    Impl("megatron", "megatron", "sparse_bwd", "ops.tilelang_sparse_mla_bwd.sparse_mla_bwd(q, kv, out, d_out, indices, "
         "lse, sm_scale=) -> dq, dkv (out, lse from its forward)", _megatron_sparse_bwd, "megatron_tilelang_ops"),
    Impl("tilelang", "tilelang", "sparse_bwd", "sparse_mla_bwd.sparse_mla_bwd(q, kv, out, d_out, indices, lse, "
         "sm_scale=) -> dq, dkv (out, lse from the simple forward)", _tilelang_sparse_bwd, "tilelang_deepseek_v32",
         compile_per_shape=True),
    Impl("dsa_ref", "dsa_ref", "indexer_fwd", "dsa_ref.kernels.autograd.lightning_indexer_tilelang(q [T,64,128] bf16, "
         "k [S,128] bf16, weights [T,64] fp32, starts=, ends=) -> [T,S] fp32", _dsa_ref_indexer_fwd),
    Impl("megatron", "megatron", "indexer_fwd", "ops.tilelang_indexer_fwd.indexer_fwd_interface(q, k, weights, "
         "starts int32, ends int32, clean_logits=True, use_relu=True)", _megatron_indexer_fwd),
    Impl("tilelang_fp8", "tilelang", "indexer_fwd", "fp8_lighting_indexer.mqa_attn_return_logits_interface(q fp8, "
         "k fp8, k_scale [S] fp32, weights, starts int32, ends int32, clean_logits=True)", _tilelang_fp8_indexer_fwd),
    Impl("dsa_ref", "dsa_ref", "indexer_bwd", "torch.autograd.grad(dsa_ref.kernels.indexer_bwd.index_scores_at_tilelang("
         "q, k, weights, indices), (q, k, weights), d_scores)", _dsa_ref_indexer_bwd),
    Impl("megatron", "megatron", "indexer_bwd", "ops.tilelang_indexer_bwd.indexer_bwd_interface(q, weights, k, "
         "indices int32 [T,K], d_scores [T,K] fp32, use_relu=True) -> dq, dw, dk", _megatron_indexer_bwd),
    Impl("dsa_ref", "dsa_ref", "attention_target", "dsa_ref.kernels.attention_target.attention_head_sum_tilelang(q, kv, "
         "indices, lse, sm_scale=) (lse from its forward)", _dsa_ref_attention_target),
    Impl("megatron", "megatron", "attention_target", "ops.tilelang_indexer_loss.sparse_indexer_target_interface(q, "
         "kv [S,576], indices int32 [T,K], sm_scale)", _megatron_attention_target),
    Impl("dsa_ref", "dsa_ref", "kl_loss", "dsa_ref.kernels.indexer_loss_slots.indexer_loss_on_slots_tilelang(scores, "
         "target, valid, reduction='sum') + torch.autograd.grad", _dsa_ref_kl),
    Impl("dsa_ref_kernel", "dsa_ref", "kl_loss", "dsa_ref.kernels.indexer_loss_slots.slot_kl_tilelang(scores, target, "
         "valid) -> kl_sum, d_scores (the kernel without autograd, as Megatron's interface)", _dsa_ref_kl_kernel),
    Impl("dsa_ref_torch", "dsa_ref", "kl_loss", "dsa_ref.indexer_loss.indexer_loss_on_slots(scores, target, valid, "
         "reduction='sum') + torch.autograd.grad (PyTorch)", functools.partial(_dsa_ref_kl, kernel=False)),
    Impl("megatron", "megatron", "kl_loss", "ops.tilelang_indexer_loss.sparse_indexer_kl_interface(target, scores, "
         "valid) -> kl_sum, d_scores", _megatron_kl),
    Impl("megatron_autograd", "megatron", "kl_loss", "ops.tilelang_indexer_loss.SparseIndexerKLLoss.apply(target, "
         "scores, valid) + torch.autograd.grad (Megatron's autograd bridge: the backward scales the saved "
         "gradient, as dsa_ref's)", _megatron_kl_autograd),
]


def select_impls(impls: list[Impl], ops: list[str], names: list[str] | None) -> list[Impl]:
    """The implementations of ``ops``, restricted to ``names`` (impl or family names) when given."""
    unknown = [o for o in ops if o not in OPS]
    if unknown:
        raise ValueError(f"unknown ops {unknown}; known: {list(OPS)}")
    chosen = [i for i in impls if i.op in ops and (not names or i.name in names or i.family in names)]
    return sorted(chosen, key=lambda i: list(OPS).index(i.op))


def impl_table(impls: list[Impl] = IMPLS) -> dict:
    """``{op: {impl: {family, call, convention}}}`` for the JSON and the docs page."""
    table: dict = {}
    for i in impls:
        table.setdefault(i.op, {})[i.name] = {"family": i.family, "call": i.call, "convention": i.convention}
    return table


def convention_table() -> dict:
    """Every `Convention` preset as plain values (for the JSON and the docs page)."""
    out = {}
    for key, c in CONVENTIONS.items():
        out[key] = {"name": c.name, "layout": c.layout, "indices": c.indices_layout, "index_space": c.index_space,
                    "sentinel": c.sentinel, "lse_base": c.lse_base, "empty_row_lse": _clean(c.empty_row_lse),
                    "empty_row_out": _clean(c.empty_row_out), "causal": c.causal, "duplicates": c.duplicates,
                    "index_dtype": str(c.index_dtype).replace("torch.", ""), "default_sm_scale": c.default_sm_scale,
                    "source": c.source}
    return out


# ------------------------------------------------------------------------------------------ timing


def back_to_back_ms(fn: Callable, *, reps: int, warmup: int = 1) -> float:
    """Mean ms of ``reps`` calls queued one after another (CUDA events around all of them)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


@contextlib.contextmanager
def _gc_paused():
    """Python's garbage collector collected, then off while timing (as `timeit` does): a collection
    that lands inside a host-bound call would otherwise be counted as that call's time."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def time_call(fn: Callable, *, repeat: int, device: torch.device, flush: torch.Tensor | None) -> dict:
    """``{"ms_per_call", "ms_back_to_back"}``: CUDA events on the GPU (see the module docs), wall clock on the
    CPU; Python's garbage collector paused throughout (`_gc_paused`)."""
    with _gc_paused():
        return _time_call(fn, repeat=repeat, device=device, flush=flush)


def _time_call(fn: Callable, *, repeat: int, device: torch.device, flush: torch.Tensor | None) -> dict:
    if device.type == "cuda":
        from bench_kernels import cuda_time_ms

        per_call = cuda_time_ms(fn, warmup=2, reps=repeat, before_each=None if flush is None else flush.zero_,
                                queue_ahead=False)
        return {"ms_per_call": per_call, "ms_back_to_back": back_to_back_ms(fn, reps=repeat)}
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return {"ms_per_call": statistics.median(times), "ms_back_to_back": sum(times) / len(times)}


# ------------------------------------------------------------------------------------------ one family


def _reason(err: BaseException) -> str:
    """``Type: message`` (first lines) and where it was raised."""
    text = f"{type(err).__name__}: {str(err).strip()}"
    lines = text.splitlines()
    text = " | ".join(lines[:4]) + (" ..." if len(lines) > 4 else "")
    tb = traceback.extract_tb(err.__traceback__)
    if tb:
        text += f" (at {Path(tb[-1].filename).name}:{tb[-1].lineno})"
    return text[:800]


def _is_cuda_error(err: BaseException) -> bool:
    """A CUDA error leaves the context unusable: the family's process stops and is resumed afresh."""
    accel = getattr(torch, "AcceleratorError", None)
    if accel is not None and isinstance(err, accel):
        return True
    text = str(err)
    return any(s in text for s in ("CUDA error", "illegal memory access", "misaligned address",
                                   "unspecified launch failure", "device-side assert"))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(impl: Impl, x: Inputs, lib: Family, *, repeat: int, device: torch.device, flush: torch.Tensor | None,
            check: bool = True, compile_only: bool = False) -> dict:
    """Prepare, time and check one implementation at one shape; exceptions become ``status: failed``."""
    rec = {"op": impl.op, "shape": x.shape.name, "impl": impl.name, "family": impl.family}
    t0 = time.perf_counter()
    bench = None
    try:
        bench = impl.setup(x, lib)
        if bench.note:
            rec["note"] = bench.note
        if compile_only:
            bench.run()
            _sync(device)
        else:
            rec.update(time_call(bench.run, repeat=repeat, device=device, flush=flush))
            flop = OPS[impl.op].flop
            if flop is not None:
                n = flop(x)
                rec["tflops"] = n / rec["ms_per_call"] / 1e9
                rec["tflops_back_to_back"] = n / rec["ms_back_to_back"] / 1e9
        rec["status"] = "ok"
    except Exception as err:  # noqa: BLE001 - any failure of a peer is a result, not a crash
        rec.update(status="failed", reason=_reason(err), cuda_error=_is_cuda_error(err))
    if rec["status"] == "ok" and check and not compile_only:
        try:
            rec["check"] = bench.check()
            _sync(device)
        except Exception as err:  # noqa: BLE001
            rec["check"] = {"status": "failed", "reason": _reason(err)}
            rec["cuda_error"] = _is_cuda_error(err)
    rec["seconds"] = time.perf_counter() - t0
    del bench
    if device.type == "cuda" and not rec.get("cuda_error"):
        torch.cuda.empty_cache()
    return rec


def _key(rec: dict) -> tuple:
    return rec["op"], rec["shape"], rec["impl"]


def _write_json(path: Path, data: dict) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(_clean(data), indent=1))
    os.replace(tmp, path)


def _clean(obj):
    """JSON-safe: non-finite floats become the strings ``"inf"``, ``"-inf"``, ``"nan"``."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def run_family(family: str, impls: list[Impl], shapes: list[Shape], *, peers_dir: Path, device: torch.device,
               dims: Dims = V32, repeat: int = 20, check: bool = True, state_path: Path | None = None,
               deadline: float | None = None, compile_only: bool = False, seed: int = 0,
               loader: Callable[[str, Path, torch.device], Family] = load_family, log: Callable = print) -> dict:
    """Every (shape, impl) of one family, shape by shape; the state is written after each result.

    With ``state_path`` holding an earlier state (a process that died), finished results are kept
    and only the rest runs. Returns the state: ``{"family", "status", "reason", "info", "results",
    "fingerprints", "running", "cuda_error"}``. ``compile_only`` runs each implementation once (at
    the first shape, or at every shape for ``compile_per_shape`` ones), without timing or checks.
    """
    impls = [i for i in impls if i.family == family]
    state = {"family": family, "status": None, "results": [], "fingerprints": {}, "running": None}
    if state_path is not None and Path(state_path).is_file():
        state.update(json.loads(Path(state_path).read_text()))
    done = {_key(r) for r in state["results"]}

    def save():
        if state_path is not None:
            _write_json(Path(state_path), state)

    def wanted(shape_i, impl):
        return not compile_only or shape_i == 0 or impl.compile_per_shape

    todo = [(s, i) for n, s in enumerate(shapes) for i in impls if wanted(n, i) and (i.op, s.name, i.name) not in done]
    if not todo:
        state["running"] = None
        save()
        return state
    try:
        lib = loader(family, Path(peers_dir), device)
        state.update(status="ok", info=lib.info)
    except Unavailable as err:
        state.update(status="skipped", reason=str(err))
    except Exception as err:  # noqa: BLE001
        state.update(status="failed", reason=_reason(err), cuda_error=_is_cuda_error(err))
    if state["status"] != "ok":
        for shape, impl in todo:
            state["results"].append({"op": impl.op, "shape": shape.name, "impl": impl.name, "family": family,
                                     "status": state["status"], "reason": f"{family}: {state['reason']}"})
        save()
        log(f"[{family}] {state['status']}: {state['reason']}")
        return state
    flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device) if device.type == "cuda" else None
    for shape in shapes:
        mine = [i for s, i in todo if s == shape]
        if not mine:
            continue
        x = Inputs(shape, dims, device=device, seed=seed)
        for impl in mine:
            if deadline is not None and time.time() > deadline:
                rec = {"op": impl.op, "shape": shape.name, "impl": impl.name, "family": family,
                       "status": "skipped", "reason": "out of time (--budget-s)"}
            else:
                state["running"] = [impl.op, shape.name, impl.name]
                save()
                rec = measure(impl, x, lib, repeat=repeat, device=device, flush=flush, check=check,
                              compile_only=compile_only)
            state["running"] = None
            state["results"].append(rec)
            save()
            log(_one_line(rec))
            if rec.get("cuda_error"):
                state["cuda_error"] = True
                save()
                return state
        state["fingerprints"][shape.name] = x.fingerprint()
        save()
        del x
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return state


def _one_line(rec: dict) -> str:
    head = f"[{rec['family']}] {rec['op']:16s} {rec['shape']:20s} {rec['impl']:18s} {rec['status']:7s}"
    if rec["status"] != "ok":
        return f"{head} {rec.get('reason', '')}"
    if "ms_per_call" not in rec:
        return f"{head} ran once in {rec['seconds']:.1f} s"
    tf = f" {rec['tflops']:6.1f} TFLOP/s" if rec.get("tflops") else ""
    chk = rec.get("check", {})
    verdict = chk.get("status", "unchecked")
    if verdict == "mismatch":
        verdict += f" (max |err| {chk.get('max_abs'):.3g})"
    return f"{head} {rec['ms_per_call']:8.3f} ms / {rec['ms_back_to_back']:8.3f} b2b{tf}  check {verdict}"


# ------------------------------------------------------------------------------------------ the whole run


def finish(results: dict) -> dict:
    """Ratios to dsa_ref, and whether every family saw the same inputs."""
    base = {(r["op"], r["shape"]): r for r in results["results"] if r["impl"] == "dsa_ref" and r.get("ms_per_call")}
    for r in results["results"]:
        ref = base.get((r["op"], r["shape"]))
        if ref is not None and r.get("ms_per_call"):
            r["ratio_to_dsa_ref"] = ref["ms_per_call"] / r["ms_per_call"]
            r["ratio_to_dsa_ref_back_to_back"] = ref["ms_back_to_back"] / r["ms_back_to_back"]
    for shape in results["shapes"]:
        prints = shape.get("fingerprints", {})
        common = {}
        consistent = True
        for fp in prints.values():
            for k, v in fp.items():
                if k in common and common[k] != v:
                    consistent = False
                common.setdefault(k, v)
        shape["inputs_identical"] = consistent if prints else None
    return results


def _new_results(args, shapes: list[Shape], impls: list[Impl], dims: Dims, device: torch.device) -> dict:
    meta = {"date": time.strftime("%Y-%m-%d"), "device": str(device), "torch": torch.__version__}
    if device.type == "cuda":
        from bench_kernels import run_meta

        meta.update(run_meta())
    meta.update(command="python benchmarks/bench_peers.py " + " ".join(shlex.quote(a) for a in args.argv),
                peers_dir=str(args.peers), repeat=args.repeat, dims=dims.__dict__,
                sm_scale=SM_SCALE, isolation="in-process" if args.in_process else "one process per family",
                timing=("per call: CUDA events around one call after a 256 MiB write (L2 flushed), median of "
                        f"{args.repeat}; back to back: {args.repeat} calls queued, CUDA events around all, mean; "
                        "Python's garbage collector paused"))
    peers = Path(args.peers)
    meta["peers"] = {name: _upstream(peers / folder) for name, folder in
                     (("megatron", "megatron"), ("tilelang", "tilelang_examples"))}
    return {"schema": SCHEMA, "meta": meta,
            "formulas": {op: OPS[op].formula for op in OPS},
            "ratio_to_dsa_ref": "dsa_ref's ms per call / this implementation's (> 1: faster than dsa_ref)",
            "impls": impl_table(impls), "conventions": convention_table(),
            "shapes": [dict(Inputs(s, dims, device="cpu").describe(), fingerprints={}) for s in shapes],
            "families": {}, "precompile": [], "results": []}


def _merge_family(results: dict, state: dict, expected: list[tuple], fallback_reason: str | None) -> None:
    """Add one family's state; any expected (op, shape, impl) it did not finish is recorded as failed."""
    results["families"][state["family"]] = {k: state.get(k) for k in ("status", "reason", "info")}
    got = {_key(r): r for r in state["results"]}
    for key in expected:
        if key in got:
            results["results"].append(got[key])
        else:
            op, shape, impl = key
            results["results"].append({"op": op, "shape": shape, "impl": impl, "family": state["family"],
                                       "status": "failed", "reason": fallback_reason or "not run"})
    for s in results["shapes"]:
        if s["name"] in state.get("fingerprints", {}):
            s["fingerprints"][state["family"]] = state["fingerprints"][s["name"]]


def record_crash(state: dict, rc: int, log_tail: str) -> bool:
    """After a family's process ended badly: the implementation it was running becomes a failed result.

    Returns whether anything was recorded (a crash with no implementation running made no progress).
    """
    running = state.get("running")
    if not running:
        return False
    op, shape, impl = running
    # -9 is this benchmark's own kill of a process that outlives --budget-s (see main)
    what = "was stopped at the time budget while this ran" if rc == -9 else f"died while this ran (exit code {rc})"
    state["results"].append({"op": op, "shape": shape, "impl": impl, "family": state["family"], "status": "failed",
                             "reason": f"the {state['family']} process {what}: {log_tail}",
                             "crashed_process": rc != -9})
    state["running"] = None
    return True


def _child_command(args, family: str, state: Path, *, ops: list[str], shapes: list[Shape], deadline: float,
                   compile_only: bool = False, impls: str | None = None) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", family, "--state", str(state),
           "--peers", str(args.peers), "--ops", ",".join(ops),
           "--shapes", ",".join(f"{s.num_q}x{s.num_kv}:{s.indices}" for s in shapes),
           "--repeat", str(args.repeat), "--device", args.device, "--seed", str(args.seed), "--deadline", str(deadline)]
    if impls or args.impls:
        cmd += ["--impls", impls or args.impls]
    if args.tiny:
        cmd.append("--tiny")
    if args.no_check:
        cmd.append("--no-check")
    if compile_only:
        cmd.append("--compile-only")
    return cmd


def _run_logged(cmd: list[str], log_path: Path, timeout: float) -> int:
    """Run ``cmd`` in its own process group, output to ``log_path``; on timeout kill that group only."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
        try:
            return proc.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            proc.wait()
            return -9


def _tail(path: Path, n: int = 6) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])[-1200:]


def precompile(args, shapes: list[Shape], impls: list[Impl], work: Path, deadline: float) -> list[dict]:
    """Run every implementation once, in parallel processes (TileLang caches kernels on disk; FlashMLA builds).

    One process per (family, op) at the first shape (dsa_ref's kernels: one process), and per shape
    for the kernels specialised on sequence lengths (TileLang's backward). Two waves: everything but
    the backwards, then the backwards, which reuse their family's forward kernel, so that two
    processes rarely compile the same kernel at once.
    """
    jobs: dict[tuple, dict] = {}
    for i in impls:
        group = "all" if i.family == "dsa_ref" else i.op
        for s in (shapes if i.compile_per_shape else shapes[:1]):
            key = (i.family, group, s.name if i.compile_per_shape else None)
            job = jobs.setdefault(key, {"ops": set(), "shapes": [s] if i.compile_per_shape else shapes,
                                        "impls": set()})
            job["ops"].add(i.op)
            job["impls"].add(i.name)
    waves = [[k for k in jobs if k[1] != "sparse_bwd"], [k for k in jobs if k[1] == "sparse_bwd"]]
    records = []

    def one(key):
        family, group, shape = key
        job = jobs[key]
        tag = f"{family}_{group}" + (f"_{shape.replace(' ', '_')}" if shape else "")
        state, log = work / f"compile_{tag}.json", work / f"compile_{tag}.log"
        t0 = time.time()
        cmd = _child_command(args, family, state, ops=sorted(job["ops"]), shapes=job["shapes"], deadline=deadline,
                             compile_only=True, impls=",".join(sorted(job["impls"])))
        rc = _run_logged(cmd, log, deadline - time.time())
        rec = {"family": family, "ops": group, "shape": shape, "rc": rc, "seconds": time.time() - t0}
        if state.is_file():
            st = json.loads(state.read_text())
            rec["failed"] = [f"{r['op']} {r['shape']} {r['impl']}: {r.get('reason', '')}"[:400]
                             for r in st["results"] if r["status"] == "failed"]
            rec["status"] = st.get("status")
        if rc != 0:
            rec["log_tail"] = _tail(log)
        print(f"[compile] {tag}: exit code {rc} in {rec['seconds']:.0f} s"
              + (f"; failed: {rec['failed']}" if rec.get("failed") else ""), flush=True)
        return rec

    for wave in waves:
        if not wave or time.time() > deadline:
            continue
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            records += list(pool.map(one, wave))
    return records


def orchestrate(args, shapes: list[Shape], impls: list[Impl], dims: Dims) -> dict:
    """The parent: compile phase, then one process per family (resumed after a crash), then merge."""
    device = torch.device(args.device)
    results = _new_results(args, shapes, impls, dims, device)
    t_start = time.time()
    deadline = t_start + args.budget_s
    families = [f for f in FAMILIES if any(i.family == f for i in impls)]
    with tempfile.TemporaryDirectory(prefix="bench_peers_") as tmp:
        work = Path(tmp)
        if not args.in_process and not args.no_precompile:
            compile_deadline = t_start + args.compile_budget_s
            results["precompile"] = precompile(args, shapes, impls, work, min(deadline, compile_deadline))
        for family in families:
            expected = [(i.op, s.name, i.name) for s in shapes for i in impls if i.family == family]
            ops = sorted({i.op for i in impls if i.family == family}, key=list(OPS).index)
            if args.in_process:
                state = run_family(family, impls, shapes, peers_dir=args.peers, device=device, dims=dims,
                                   repeat=args.repeat, check=not args.no_check, deadline=deadline, seed=args.seed)
                _merge_family(results, state, expected, "not run")
                continue
            state_path, log_path = work / f"{family}.json", work / f"{family}.log"
            reason = None
            for attempt in range(1, args.attempts + 1):
                rc = _run_logged(_child_command(args, family, state_path, ops=ops, shapes=shapes, deadline=deadline),
                                 log_path, deadline + 30 - time.time())
                print(log_path.read_text(errors="replace"), end="", flush=True)
                if not state_path.is_file():
                    reason = f"the {family} process wrote nothing (exit code {rc}): {_tail(log_path)}"
                    break
                state = json.loads(state_path.read_text())
                if rc == 0 and not state.get("running"):
                    break
                progressed = record_crash(state, rc, _tail(log_path))
                state["cuda_error"] = False
                _write_json(state_path, state)
                reason = f"the {family} process ended (exit code {rc}) before this ran: {_tail(log_path)}"
                if rc == -9:
                    reason = f"the {family} process was stopped at the time budget: {_tail(log_path)}"
                    break
                if not progressed and rc != EXIT_CUDA_ERROR:
                    break
                print(f"[{family}] resuming in a fresh process (attempt {attempt + 1})", flush=True)
            state = json.loads(state_path.read_text()) if state_path.is_file() else \
                {"family": family, "status": "failed", "reason": reason, "results": []}
            _merge_family(results, state, expected, reason)
            _write_json(Path(args.out), finish(results))  # partial results survive a later kill
    results["meta"]["seconds"] = time.time() - t_start
    return finish(results)


def ratio_table(results: dict) -> str:
    """Markdown: per op and shape, each implementation's ms per call (TFLOP/s) and ratio to dsa_ref."""
    names = []
    for r in results["results"]:
        if r["impl"] not in names:
            names.append(r["impl"])
    cells: dict = {}
    for r in results["results"]:
        if r["status"] == "ok" and r.get("ms_per_call"):
            tf = f", {r['tflops']:.0f} TFLOP/s" if r.get("tflops") else ""
            ratio = f", x{r['ratio_to_dsa_ref']:.2f}" if r.get("ratio_to_dsa_ref") and r["impl"] != "dsa_ref" else ""
            mark = "" if r.get("check", {}).get("status", "ok") == "ok" else f" [{r['check']['status']}]"
            cells[(r["op"], r["shape"], r["impl"])] = f"{r['ms_per_call']:.3f} ms{tf}{ratio}{mark}"
        else:
            cells[(r["op"], r["shape"], r["impl"])] = r["status"]
    rows = sorted({(r["op"], r["shape"]) for r in results["results"]},
                  key=lambda k: (list(OPS).index(k[0]), [s["name"] for s in results["shapes"]].index(k[1])))
    lines = ["| op | shape | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for op, shape in rows:
        lines.append(f"| {op} | {shape} | " + " | ".join(cells.get((op, shape, n), "") for n in names) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=Path, default=DEFAULT_PEERS, help="folder with flashmla/, megatron/, "
                        "tilelang_examples/ (default .gpu/peers)")
    parser.add_argument("--shapes", default=None, help=f"QUERIESxKEYS[:causal|:uniform],... (default {DEFAULT_SHAPES})")
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma list of {list(OPS)}")
    parser.add_argument("--impls", default="", help="only these implementations or families (comma list)")
    parser.add_argument("--repeat", type=int, default=None, help="timed calls per measurement (default 20)")
    parser.add_argument("--out", default="bench_peers.json")
    parser.add_argument("--quick", action="store_true", help="the first shape only, 5 calls per measurement")
    parser.add_argument("--in-process", action="store_true", help="no subprocesses (a CUDA fault ends the run)")
    parser.add_argument("--no-precompile", action="store_true", help="skip the parallel compile phase")
    parser.add_argument("--no-check", action="store_true", help="time only")
    parser.add_argument("--budget-s", type=float, default=540.0, help="stop starting new measurements after this")
    parser.add_argument("--compile-budget-s", type=float, default=300.0, help="time limit of the compile phase")
    parser.add_argument("--jobs", type=int, default=12, help="parallel processes in the compile phase")
    parser.add_argument("--attempts", type=int, default=6, help="processes per family (resumed after a crash)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny head counts and widths (CPU smoke tests)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--state", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.repeat is None:
        args.repeat = 5 if args.quick else 20
    if args.shapes is None:
        args.shapes = DEFAULT_SHAPES.split(",")[0] if args.quick else DEFAULT_SHAPES
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shapes = parse_shapes(args.shapes)
    dims = TINY if args.tiny else V32
    impls = select_impls(IMPLS, [o.strip() for o in args.ops.split(",") if o.strip()],
                         [n.strip() for n in args.impls.split(",") if n.strip()])
    if args.child:  # one family, in this process, for the parent
        state = run_family(args.child, impls, shapes, peers_dir=args.peers, device=torch.device(args.device), dims=dims,
                           repeat=args.repeat, check=not args.no_check, state_path=args.state, deadline=args.deadline,
                           compile_only=args.compile_only, seed=args.seed, log=lambda s: print(s, flush=True))
        return EXIT_CUDA_ERROR if state.get("cuda_error") else 0
    results = orchestrate(args, shapes, impls, dims)
    _write_json(Path(args.out), results)
    print(ratio_table(results))
    print(f"wrote {args.out} ({results['meta']['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
