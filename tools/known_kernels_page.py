"""Write docs/known_kernels.md ("Known kernels") from a benchmarks/bench_peers.py results JSON.

    python tools/known_kernels_page.py benchmarks/results/DATE_h200_peers.json > docs/known_kernels.md
    python tools/known_kernels_page.py > docs/known_kernels.md      # before any GPU run: no measured tables
    python tools/known_kernels_page.py FULL.json KL.json > docs/known_kernels.md  # KL.json re-measured some ops
    python tools/known_kernels_page.py FULL.json --recheck LATER.json > ...  # LATER.json re-checked some cells

The page states the peers, the calls the benchmark makes (`bench_peers.IMPLS`), their conventions
(the presets of `dsa_ref.oracle`, which hold the facts measured on the H200) and, from the JSON, the
conformance table (what each peer returned on the benchmark's inputs, checked by the oracle) and
the speed tables. Nothing here is measured: every number is the JSON's. The figure
(``docs/assets/bench_peers.png``, from tools/plots/bench_peers_plot.py) is shown when it exists.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_peers  # noqa: E402

FIGURE = ROOT / "docs" / "assets" / "bench_peers.png"
COMMAND = "bash tools/gpu_session.sh peers"
BENCH_COMMAND = "python3 benchmarks/bench_peers.py --peers .gpu/peers --out benchmarks/results/DATE_h200_peers.json"

PEERS = [
    ("FlashMLA", "flashmla/", "deepseek-ai/FlashMLA `9241ae3` (CUTLASS `147f567`), MIT / BSD-3",
     "SM90a sparse prefill forward (`flash_mla_sparse_fwd`), compiled by the folder's `build.py` "
     "(`MAX_JOBS=16 FLASHMLA_BUILD_DIR=/tmp/flashmla_build`, about 45 s; a prebuilt `.so` for torch 2.11 + "
     "Python 3.12 is the fallback)"),
    ("Megatron-LM", "megatron/", "NVIDIA/Megatron-LM `d98e8a6`",
     "the TileLang DSA ops of `core/transformer/experimental_attention_variant/ops/`: sparse MLA forward and "
     "backward, bf16 indexer forward (+ `clean_logits`) and backward, the attention target and the fused KL loss "
     "(a three-line `megatron.core.utils` stub stands in for the rest of Megatron)"),
    ("TileLang", "tilelang_examples/", "tile-ai/tilelang `a35008a`",
     "`examples/deepseek_v32`: sparse MLA forward (`sparse_mla_fwd.py`, simple; `sparse_mla_fwd_pipelined.py`, "
     "warp-specialised), `sparse_mla_bwd.py`, the fp8 indexer `fp8_lighting_indexer.py` (`utils.py` is a shim: "
     "upstream's imports triton at load time)"),
]

#: the presets the peers use, in the order of the conventions table
PRESETS = ["dsa_ref", "flashmla_sparse_prefill", "megatron_tilelang_ops", "tilelang_deepseek_v32"]

#: facts read from the peers' code (and, for the empty rows, measured on the H200 on 2026-12-03)
FACTS = [
    "**Unused slots.** FlashMLA ignores any index outside `[0, S)`. Megatron's ops mask exactly `-1`: a `-2` "
    "is read as row 0 and counted. TileLang's examples mask any index after the query's position, so `-1` "
    "reads `KV[-1]`; their tests pad with `S`.",
    "**Causal rule inside the kernel.** FlashMLA and Megatron's ops have none (the indices decide). TileLang's "
    "simple forward and its backward place query `t` at position `t`, which is right only for queries that "
    "start at position 0; the pipelined forward takes `q_start_index_s`.",
    "**LSE.** FlashMLA returns the natural log (and `max_logits`), Megatron's ops and TileLang's examples "
    "base 2.",
    "**Rows with no valid slot.** FlashMLA: output 0, LSE `+inf`. Megatron: output 0, LSE 0. TileLang: "
    "output NaN, LSE `-inf`. dsa_ref: output 0, LSE `-inf`.",
    "**Softmax scale.** Megatron's and TileLang's kernels default to `576 ** -0.5`; DeepSeek-V3.2 needs "
    "`192 ** -0.5 * mscale ** 2`. The benchmark always passes it.",
    "**A key in two slots** counts once per slot in all of them, as in dsa_ref.",
    "**Backward.** FlashMLA has none. Megatron's `sparse_mla_bwd` works in blocks of 32 heads; its autograd "
    "function re-runs the forward in the backward. TileLang's example takes the forward's output and LSE.",
]


def _fmt_ms(ms) -> str:
    return "" if ms is None else (f"{ms:.3f}" if ms < 10 else f"{ms:.2f}" if ms < 100 else f"{ms:.1f}")


def _num(v) -> float | None:
    """A JSON number, or None (non-finite values are stored as strings)."""
    if isinstance(v, (int, float)):
        return float(v)
    if v in ("inf", "-inf", "nan"):
        return float(v)
    return None


def _cell_text(s: str) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def _shape_names(results: dict) -> list[str]:
    return [s["name"] for s in results["shapes"]]


def _impl_order(results: dict, op: str) -> list[str]:
    """The implementations of ``op`` that have a result, in the order of the run's impl table."""
    measured = [r["impl"] for r in results["results"] if r["op"] == op]
    names = [n for n in results.get("impls", {}).get(op, {}) if n in measured]
    for n in measured:
        if n not in names:
            names.append(n)
    return names


def _by_key(results: dict) -> dict:
    return {(r["op"], r["shape"], r["impl"]): r for r in results["results"]}


#: the reasons bench_peers.py gives a family process that ended early; the log tail after them stays in the JSON
_PROCESS_REASON = re.compile(r"^(the (?:\w+ )?process (?:died while this ran \(exit code -?\d+\)|was stopped at the time "
                             r"budget(?: while this ran)?|ended \(exit code -?\d+\) before this ran|wrote nothing \(exit code -?\d+\))): ")


def short_reason(reason: str) -> str:
    """A failed record's reason without the process's log tail that bench_peers.py appends."""
    m = _PROCESS_REASON.match(reason or "")
    return m.group(1) if m else (reason or "")


def check_summary(rec: dict | None) -> str:
    """One table cell: the run's status and the oracle's verdict."""
    if rec is None:
        return "not run"
    if rec["status"] != "ok":
        reason = _cell_text(short_reason(rec.get("reason", "")))
        return f"{rec['status']}: {reason[:160]}" if reason else rec["status"]
    chk = rec.get("check")
    if not chk:
        return "ran (not checked)"
    if chk["status"] == "ok":
        return "ok"
    if chk["status"] == "failed":
        return f"check failed: {_cell_text(chk.get('reason', ''))[:160]}"
    worst = []
    for name, t in chk.get("tensors", {}).items():
        if not t.get("ok", True):
            bits = [f"max \\|err\\| {_num(t['max_abs']):.3g}", f"rel. L2 {_num(t['rel_l2']):.3g}"]
            if t.get("nonfinite_mismatch"):
                bits.append(f"{t['nonfinite_mismatch']} non-finite where the reference is finite or vice versa")
            worst.append(f"{name}: " + ", ".join(bits))
    return "**mismatch** (" + "; ".join(worst) + ")"


def facts_summary(recs: list[dict]) -> str:
    """What a peer did on the planted rows and slots, from the first checked record that says."""
    for r in recs:
        facts = (r.get("check") or {}).get("facts")
        if not facts:
            continue
        bits = []
        empty = facts.get("empty_rows")
        if empty:
            bits.append(f"empty rows: out {empty.get('out')}, LSE {empty.get('lse')}")
        if "empty_rows_dq" in facts:
            bits.append(f"empty rows: dq {facts['empty_rows_dq']}")
        return "; ".join(bits)
    return ""


def dropped_summary(recs: list[dict]) -> str:
    """Slots dsa_ref counts that the peer's own rules leave out, per shape where any."""
    bits = []
    for r in recs:
        facts = (r.get("check") or {}).get("facts") or {}
        if facts.get("slots_dropped"):
            bits.append(f"{r['shape']}: {facts['slots_dropped']} of {facts['slots_valid_in_dsa_ref']}")
        if facts.get("slots_added"):
            bits.append(f"{r['shape']}: {facts['slots_added']} unused slots read")
    return "; ".join(bits) if bits else "none"


#: the sparse MLA backward's target in TFLOP/s (the issue's; dsa_ref's kernels in chapter 5)
BWD_TARGET_TFLOPS = 300


def _range(values: list[float], fmt: str) -> str:
    lo, hi = min(values), max(values)
    return format(lo, fmt) if format(lo, fmt) == format(hi, fmt) else f"{format(lo, fmt)}–{format(hi, fmt)}"


def _ok_recs(results: dict, op: str, impl: str) -> list[dict]:
    """The op's timed results of ``impl`` in the op's own (latest) run: never rows kept from an earlier one."""
    return [r for r in results["results"] if r["op"] == op and r["impl"] == impl and r["status"] == "ok"
            and r.get("ms_per_call") is not None and "earlier_run" not in r]


def _run_info(meta: dict, source: str | None) -> dict:
    """``{source, date, gpu, command, timing}`` of one run, from its ``meta``."""
    return {"source": source, "date": meta.get("date"), "gpu": meta.get("gpu", meta.get("device")),
            "command": meta.get("command", ""), "timing": meta.get("timing")}


def _run_of(results: dict, rec: dict) -> dict:
    """`_run_info` of the run a result comes from (``source`` None: the first file)."""
    if "earlier_run" in rec:
        return rec["earlier_run"]
    m = results["meta"]
    return m.get("op_runs", {}).get(rec["op"]) or _run_info(m, None)


def _exceeding(t: dict) -> int:
    """Elements a tensor check counted outside the tolerance."""
    n = 0
    for f in t.get("failures", []):
        m = re.match(r"(\d+) elements exceed", f)
        n += int(m.group(1)) if m else 0
    return n


def _recheck_sentence(results: dict, cells: list[tuple[str, str, str]]) -> str:
    """What the re-check runs (``results["rechecks"]``, `main`'s ``--recheck``) found for these ``(op, shape,
    tensor)`` cells: each run's date, file, and the implementations it checked at those shapes, passed or not."""
    text = ""
    keys = {(op, shape) for op, shape, _ in cells}
    for run in results.get("rechecks", []):
        recs = [r for r in run["results"] if (r["op"], r["shape"]) in keys and r["status"] == "ok"]
        if not recs:
            continue
        ok = [r["impl"] for r in recs if (r.get("check") or {}).get("status") == "ok"]
        bad = [r["impl"] for r in recs if (r.get("check") or {}).get("status") != "ok"]
        where = ", ".join(sorted({f"`{r['op']}` at {r['shape'].split()[0]}" for r in recs}))
        text += (f" A later run checked them with the current oracle ({run['meta'].get('date')}, "
                 f"{run['meta'].get('gpu', run['meta'].get('device'))}, `{run['source']}`, {where}): "
                 + (f"{', '.join(ok)} passed" if ok else "")
                 + ("; " if ok and bad else "") + (f"{', '.join(bad)} failed" if bad else "") + ".")
    return text


def findings_section(results: dict | None) -> list[str]:
    """What the run says, in sentences; every number read from the JSON."""
    if results is None:
        return []
    m = results["meta"]
    lines = ["## Findings of this run", "",
             f"From `{m.get('date')}` on the {m.get('gpu', m.get('device'))}"
             + ("; " + ", ".join(f"`{op}`" for op in m["op_runs"]) + " from later runs of their own (see Speed)"
                if m.get("op_runs") else "") + "; the tables below hold every number.", ""]
    fwd = {r["shape"]: r for r in _ok_recs(results, "sparse_fwd", "dsa_ref")}
    fm = [r for r in _ok_recs(results, "sparse_fwd", "flashmla") if r.get("ratio_to_dsa_ref") and r["shape"] in fwd]
    if fm:
        ratios = [r["ratio_to_dsa_ref"] for r in fm]
        pairs = ", ".join(f"{r['tflops']:.0f} vs {fwd[r['shape']]['tflops']:.0f} at {r['shape'].split()[0]}"
                          for r in fm if r.get("tflops") and fwd[r["shape"]].get("tflops"))
        who = "slower than" if min(ratios) > 1 else "faster than" if max(ratios) < 1 else "beside"
        lines.append(f"- **Sparse MLA forward:** dsa_ref's kernel is {who} FlashMLA's: FlashMLA runs at "
                     f"x{_range(ratios, '.2f')} dsa_ref's speed per call (TFLOP/s, FlashMLA vs dsa_ref: {pairs}).")
    bwd = _ok_recs(results, "sparse_bwd", "dsa_ref")
    if bwd and all(r.get("tflops") for r in bwd):
        tf = [r["tflops"] for r in bwd]
        met = "met" if min(tf) >= BWD_TARGET_TFLOPS else "not met"
        text = (f"- **Sparse MLA backward:** dsa_ref {_range(tf, '.0f')} TFLOP/s; the target of "
                f"{BWD_TARGET_TFLOPS} TFLOP/s is {met}.")
        meg = [r["ratio_to_dsa_ref"] for r in _ok_recs(results, "sparse_bwd", "megatron") if r.get("ratio_to_dsa_ref")]
        if meg:
            text += f" dsa_ref is {_range([1 / x for x in meg], '.1f')}x faster than Megatron's kernel."
        one = {r["shape"]: r for r in _ok_recs(results, "sparse_bwd", "dsa_ref_one_pass")}
        if one and all(r.get("tflops") for r in one.values()):
            mine = {r["shape"]: r for r in bwd}
            ratio = [one[s]["ms_per_call"] / mine[s]["ms_per_call"] for s in one if s in mine]
            text += (f" The one-pass kernel (`backward=\"one_pass\"`) runs at "
                     f"{_range([r['tflops'] for r in one.values()], '.0f')} TFLOP/s; dsa_ref's call as this run "
                     f"made it (see Interfaces) at x{_range(ratio, '.2f')} its speed.")
        lines.append(text)
    idx = {r["impl"]: [] for r in results["results"] if r["op"] == "indexer_fwd"}
    for impl in idx:
        idx[impl] = [r["ratio_to_dsa_ref"] for r in _ok_recs(results, "indexer_fwd", impl) if r.get("ratio_to_dsa_ref")]
    peers = [(impl, ratios) for impl, ratios in idx.items() if impl != "dsa_ref" and ratios]
    if peers:
        bits = [f"{impl} runs at x{_range(ratios, '.2f')} dsa_ref's speed" for impl, ratios in peers]
        lines.append("- **Lightning indexer (dsa_ref in bf16):** " + "; ".join(bits) + ".")
    kl = [r["ratio_to_dsa_ref"] for r in _ok_recs(results, "kl_loss", "megatron") if r.get("ratio_to_dsa_ref")]
    if kl:
        own = _ok_recs(results, "kl_loss", "dsa_ref")
        pytorch = any(r.get("note") == "PyTorch" or "no kernel" in (r.get("note") or "") for r in own)
        mine = {r["shape"]: r["ms_per_call"] for r in _ok_recs(results, "kl_loss", "dsa_ref_kernel")}
        theirs = {r["shape"]: r["ms_per_call"] for r in _ok_recs(results, "kl_loss", "megatron")}
        both = [s for s in mine if s in theirs]
        text = "- **KL loss over the slots:** "
        if both:  # kernel against kernel: dsa_ref's call without autograd, as Megatron's interface
            ratio = [theirs[s] / mine[s] for s in both]  # > 1: dsa_ref's kernel is faster
            who = "faster than" if min(ratio) > 1 else "slower than" if max(ratio) < 1 else "beside"
            text += (f"kernel against kernel (`slot_kl_tilelang`, loss and gradient without autograd, as "
                     f"Megatron's interface returns them), dsa_ref's is {who} Megatron's: x{_range(ratio, '.2f')} "
                     "Megatron's speed. ")
        what = ("PyTorch (`indexer_loss_on_slots` and its autograd)" if pytorch
                else "forward and backward of `indexer_loss_on_slots_tilelang`")
        bridge = {r["shape"]: r["ms_per_call"] for r in _ok_recs(results, "kl_loss", "megatron_autograd")}
        own_ms = {r["shape"]: r["ms_per_call"] for r in own}
        paired = [s for s in own_ms if s in bridge]
        if paired:  # autograd against autograd: both backwards scale the saved gradient
            ratio = [bridge[s] / own_ms[s] for s in paired]  # > 1: dsa_ref's call is faster
            who = "faster than" if min(ratio) > 1 else "slower than" if max(ratio) < 1 else "beside"
            text += (f"Autograd call against autograd call ({what} against Megatron's `SparseIndexerKLLoss`, "
                     f"whose backward scales the saved gradient as dsa_ref's does), dsa_ref's is {who} "
                     f"Megatron's: x{_range(ratio, '.2f')} its speed. ")
        text += (f"dsa_ref's autograd call{'' if paired else f' ({what})'} runs at "
                 f"x{_range([1 / x for x in kl], '.2f')} the speed of "
                 "Megatron's raw call; its backward scales the gradient by the upstream one, a pass over "
                 "`[T, K]` that a raw call leaves to its caller.")
        lines.append(text)
    failed = [r for r in results["results"] if r["status"] == "failed"]
    if failed:
        groups: dict[str, list[str]] = {}
        for r in failed:
            groups.setdefault(short_reason(r.get("reason", "")), []).append(f"{r['impl']} {r['op']} at "
                                                                            f"{r['shape'].split()[0]}")
        bits = [f"{reason} ({len(items)}: {', '.join(items)})" for reason, items in groups.items()]
        text = f"- **Failed runs:** {len(failed)}, with the reasons the JSON records: " + "; ".join(bits) + "."
        if any("time budget" in g or "exit code -9" in g for g in groups):
            commands = sorted({_run_of(results, r)["command"] for r in failed})
            text += (f" Exit code -9 is the benchmark's own kill of a family process that outlives the time "
                     f"budget (`--budget-s`; {'this run' if len(commands) == 1 else 'these runs'}: "
                     + ", ".join(f"`{_cell_text(c)}`" for c in commands) + "): these points were "
                     "cut off by the budget, not by a fault in the kernels; the full log tail of each is in the JSON.")
        lines.append(text)
    mism: dict[tuple, dict] = {}
    before_delta: set[tuple] = set()  # (op, shape, impl) checked before the oracle allowed for delta's error
    strict: set[tuple] = set()  # indexer backward checked with rtol * |e|, before the magnitude bound
    for r in results["results"]:
        chk = r.get("check") or {}
        if r["status"] == "ok" and chk.get("status") == "mismatch":
            for name, t in chk.get("tensors", {}).items():
                if not t.get("ok", True) and not t.get("nonfinite_mismatch"):
                    mism[(r["op"], r["shape"], r["impl"], name)] = t
            if r["op"] == "sparse_bwd" and not any("delta" in n for n in chk.get("notes", [])):
                before_delta.add((r["op"], r["shape"], r["impl"]))
            if r["op"] == "indexer_bwd" and not any("magnitude" in n for n in chk.get("notes", [])):
                strict.add((r["op"], r["shape"], r["impl"]))
    if mism:
        same = sorted({(op, shape, name) for (op, shape, impl, name) in mism if impl == "dsa_ref"
                       and (op, shape, "megatron", name) in mism
                       and _num(mism[(op, shape, "megatron", name)]["max_abs"]) == _num(mism[(op, shape, impl, name)]["max_abs"])},
                      key=lambda k: (k[0], _shape_names(results).index(k[1])))
        own = sorted({(op, shape, name) for (op, shape, impl, name) in mism if impl == "dsa_ref"} - set(same),
                     key=lambda k: (k[0], _shape_names(results).index(k[1])))
        explained = [k for k in same if (k[0], k[1], "dsa_ref") in before_delta and (k[0], k[1], "megatron") in before_delta]
        same = [k for k in same if k not in explained]
        if explained:
            lines.append(_agreeing_errors("- **Backward gradients outside the bound of the check these runs used.** ",
                                          explained, mism)
                         + "That check did not yet allow for the error of a kernel's delta = rowsum(O * dO), taken "
                         "from its rounded output, which does not shrink where a row's score gradients cancel. "
                         "Worked through in [Checking your kernel](checking_your_kernel.md), that is the element "
                         "over the bound at 4096x32768, and the check now allows for it; these cells stay as "
                         "their run measured them." + _recheck_sentence(results, explained))
        if same or own:
            text = "- **Open finding: gradients outside the oracle's bf16 tolerance.** "
            if same:
                text = _agreeing_errors(text, same, mism)
            if own:
                rels = [_num(mism[(op, s, 'dsa_ref', n)]['rel_l2']) for op, s, n in own]
                text += ("Likewise dsa_ref's " if same else "dsa_ref's ") + ", ".join(
                    sorted({f"`{op}` `{n}`" for op, _, n in own})) + " at " + \
                    f"{', '.join(s.split()[0] for _, s, _ in own)} (rel. L2 {_range(rels, '.2g')}). "
            text += ("These are key rows read by most queries: their gradient is a long float32 sum, rounded once "
                     "to bf16, whose terms cancel. ")
            if own and all((op, sh, "dsa_ref") in strict for op, sh, _ in own):
                text += ("Their run checked each element against rtol * |e|; the check now bounds it by rtol times "
                         "the sum of its terms' absolute values (`dsa_ref.oracle.indexer_backward_magnitudes`), as "
                         "for the sparse backward; the next run checks them so. Until then these cells are not "
                         "passes.")
            else:
                text += ("The oracle's tolerance for such heavily reused rows is not yet settled against a real "
                         "error. Until it is, these cells are not passes.")
            lines.append(text)
    conv = sorted({f"{r['impl']} {r['op']}" for r in results["results"] if r["status"] == "ok"
                   and (r.get("check") or {}).get("status") == "mismatch"
                   and any(t.get("nonfinite_mismatch") for t in r["check"].get("tensors", {}).values())})
    if conv:
        lines.append("- **Non-finite values on the rows with no valid slot:** " + ", ".join(conv) + " (the "
                     "conventions below: TileLang's examples return NaN or a finite LSE there).")
    return lines + [""]


def _agreeing_errors(text: str, keys: list[tuple], mism: dict) -> str:
    """``text`` plus: dsa_ref's and Megatron's gradient errors at ``keys`` (op, shape, tensor), which are equal."""
    maxes = " / ".join(f"{_num(mism[(op, s, 'dsa_ref', n)]['max_abs']):.3g}" for op, s, n in keys)
    rels = [_num(mism[(op, s, 'dsa_ref', n)]['rel_l2']) for op, s, n in keys]
    counts = [_exceeding(mism[(op, s, 'dsa_ref', n)]) for op, s, n in keys]
    return text + (f"`{keys[0][0]}` `{keys[0][2]}` of dsa_ref and of Megatron at "
                   f"{', '.join(s.split()[0] for _, s, _ in keys)}: the two kernels give the same errors "
                   f"(max |err| {maxes}, rel. L2 {_range(rels, '.2g')}), so they agree with each other; "
                   f"{_range(counts, 'd')} {'element' if max(counts) == 1 else 'elements'} per shape, of "
                   "millions, exceed the tolerance. ")


def peers_section() -> list[str]:
    lines = ["## The peers", "",
             "| peer | folder | upstream | what the benchmark uses |", "|---|---|---|---|"]
    lines += [f"| {name} | `{folder}` | {up} | {what} |" for name, folder, up, what in PEERS]
    lines += ["", "Each folder keeps its upstream license and commit. dsa_ref copies none of their code: the "
              "benchmark imports it at run time from `--peers DIR` (default `.gpu/peers`), builds FlashMLA there, "
              "and records a peer that is missing, fails to import or raises as `skipped` or `failed`, with the "
              "reason, without stopping.", ""]
    return lines


def interfaces_section(impls: dict) -> list[str]:
    lines = ["## Interfaces", "",
             "The calls the benchmark makes, per operation. Conversions into each layout and index convention "
             "are done once, outside the timed call.", ""]
    for op, entries in impls.items():
        title = bench_peers.OPS[op].title if op in bench_peers.OPS else op
        lines += [f"**{title}** (`{op}`)", "", "| implementation | call | convention preset |", "|---|---|---|"]
        for name, e in entries.items():
            conv = f"`{e['convention']}`" if e.get("convention") else "none: the float64 reference"
            lines.append(f"| {name} | `{_cell_text(e['call'])}` | {conv} |")
        lines.append("")
    return lines


def conventions_section(conventions: dict) -> list[str]:
    cols = [c for c in PRESETS if c in conventions]
    lines = ["## Conventions", "",
             "The `dsa_ref.oracle` presets of the sparse-MLA kernels (see [Checking your kernel]"
             "(checking_your_kernel.md)); `check_sparse_mla` converts a peer's inputs and outputs with its "
             "preset and compares with the exact reference.", "",
             "| | " + " | ".join(f"`{c}`" for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    rows = [("layout", "layout"), ("indices", "indices"), ("index dtype", "index_dtype"),
            ("unused slot", "sentinel"), ("LSE base", "lse_base"), ("empty row: LSE", "empty_row_lse"),
            ("empty row: output", "empty_row_out"), ("causal mask inside", "causal"),
            ("repeated key", "duplicates"), ("default softmax scale", "default_sm_scale")]
    for label, key in rows:
        cells = []
        for c in cols:
            v = conventions[c].get(key)
            if key == "sentinel":
                v = {"minus_one": "`-1`", "out_of_range": "`< 0` or `>= S`", "after_position": "`> position`",
                     "minus_one_or_after_position": "`-1` or `> position`"}.get(v, v)
            elif key == "lse_base":
                v = {"e": "natural", "2": "**2**", None: "none"}.get(v, v)
            elif key == "duplicates":
                v = {"per_slot": "once per slot", "once": "once"}.get(v, v)
            elif key == "causal":
                v = "yes: index > query position" if v else "no"
            elif key in ("empty_row_lse", "empty_row_out"):
                v = {"nan": "NaN", 0.0: "0", "inf": "+inf", "-inf": "-inf"}.get(v, v)
            cells.append(_cell_text(v))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", *[f"- {f}" for f in FACTS], ""]
    return lines


def conformance_section(results: dict | None) -> list[str]:
    lines = ["## Conformance on the benchmark's inputs", ""]
    if results is None:
        return lines + [
            "Not measured yet: the table comes from the first GPU run of the benchmark (see "
            "[How to run it](#how-to-run-it)). The conventions above were read from the peers' code, and their "
            "empty-row behaviour measured on an H200 on 2026-12-03.", ""]
    shapes = _shape_names(results)
    lines += [
        "Every output checked against the exact float64 reference by `dsa_ref.oracle`, with the peer's "
        "convention preset for sparse MLA, on three blocks of rows per shape. The inputs hold three rows "
        "without a valid slot and rows with a quarter of their slots `-1`. *ok*: within the tolerance of "
        "its output dtype. *Dropped slots*: slots dsa_ref counts that the peer's own rules leave out on these "
        "inputs (for TileLang's simple kernels, queries after position 0).", "",
        "| op | implementation | " + " | ".join(shapes) + " | on rows with no valid slot | dropped slots |",
        "|---|---|" + "---|" * len(shapes) + "---|---|"]
    by = _by_key(results)
    for op in [o for o in bench_peers.OPS if any(r["op"] == o for r in results["results"])]:
        for name in _impl_order(results, op):
            recs = [by[(op, s, name)] for s in shapes if (op, s, name) in by]
            if not recs:
                continue
            cells = [check_summary(by.get((op, s, name))) for s in shapes]
            lines.append(f"| {op} | {name} | " + " | ".join(cells) + f" | {facts_summary(recs)} | "
                         f"{dropped_summary(recs)} |")
    lines.append("")
    identical = [s["name"] for s in results["shapes"] if s.get("inputs_identical") is False]
    if identical:
        lines += [f"**Warning:** the families' input checksums differ at {', '.join(identical)}.", ""]
    return lines


def speed_section(results: dict | None, figure: Path | None) -> list[str]:
    lines = ["## Speed", ""]
    if results is None:
        return lines + ["Not measured yet. The tables will give, per operation and shape, each implementation's "
                        "time per call after an L2 flush and back to back, its TFLOP/s and its speed relative to "
                        "dsa_ref, from `benchmarks/results/<date>_h200_peers.json`.", ""]
    m = results["meta"]
    lines += [f"{m.get('date')}, {m.get('gpu', m.get('device'))}, torch {m.get('torch')}, CUDA {m.get('cuda')}, "
              f"tilelang {m.get('tilelang')}; `{_cell_text(m.get('command', ''))}`.", "",
              f"Timing: {m.get('timing', '')}. Cells: ms per call / back to back (TFLOP/s per call; "
              "x speed relative to dsa_ref per call, > 1 is faster). A cell in brackets did not pass its check.", ""]
    if figure is not None:
        lines += [f"![TFLOP/s of every implementation, per operation and shape](assets/{figure.name})", ""]
    current = dict(results, results=[r for r in results["results"] if "earlier_run" not in r])
    by = _by_key(current)
    shapes = _shape_names(results)
    for op in [o for o in bench_peers.OPS if any(r["op"] == o for r in results["results"])]:
        names = _impl_order(current, op)
        formula = results.get("formulas", {}).get(op)
        lines += [f"**{bench_peers.OPS[op].title}**" + (f": TFLOP/s = {formula} / time." if formula else
                                                         ": no FLOP count (ms only)."), ""]
        other = m.get("op_runs", {}).get(op)
        if other:
            timing = other.get("timing")
            lines += [f"Measured in a run of its own: {other['date']}, {other['gpu']}, "
                      f"`{_cell_text(other['command'])}` (`{other['source']}`)"
                      + (f"; timing: {timing}" if timing and timing != m.get("timing") else "") + ".", ""]
        lines += _speed_table(by, op, names, shapes)
        kept = [r for r in results["results"] if r["op"] == op and "earlier_run" in r]
        if kept:
            run = kept[0]["earlier_run"]
            earlier = dict(results, results=[r for r in results.get("earlier_dsa_ref", []) if r["op"] == op] + kept)
            lines += [f"Not measured in that run, so from the earlier one ({run['date']}, {run['gpu']}, "
                      f"`{run['source']}`), beside that run's dsa_ref; ratios as that run measured them:", ""]
            lines += _speed_table(_by_key(earlier), op, _impl_order(earlier, op), shapes)
    return lines


def _speed_table(by: dict, op: str, names: list[str], shapes: list[str]) -> list[str]:
    """One op's speed table: a row per shape, a column per implementation."""
    lines = ["| shape | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for s in shapes:
        cells = []
        for n in names:
            r = by.get((op, s, n))
            if r is None:
                cells.append("")
            elif r["status"] != "ok" or r.get("ms_per_call") is None:
                cells.append(r["status"])
            else:
                text = f"{_fmt_ms(r['ms_per_call'])} / {_fmt_ms(r.get('ms_back_to_back'))}"
                extra = []
                if r.get("tflops") is not None:
                    extra.append(f"{r['tflops']:.0f}")
                if n != "dsa_ref" and r.get("ratio_to_dsa_ref") is not None:
                    extra.append(f"x{r['ratio_to_dsa_ref']:.2f}")
                if extra:
                    text += f" ({', '.join(extra)})"
                if (r.get("check") or {}).get("status", "ok") != "ok":
                    text = f"[{text}]"
                cells.append(text)
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def run_section() -> list[str]:
    return ["## How to run it", "",
            "On the GPU machine, with the peers' folders in `.gpu/peers` (git-ignored) and TileLang set up as "
            "`tools/gpu_session.sh` does:", "",
            f"    {COMMAND}                       # writes $OUT/bench_peers.json, .log and .png", f"    {BENCH_COMMAND}",
            "", "then, here:", "",
            "    python tools/plots/bench_peers_plot.py --json benchmarks/results/DATE_h200_peers.json",
            "    python tools/known_kernels_page.py benchmarks/results/DATE_h200_peers.json > docs/known_kernels.md",
            "", "The benchmark and its method are described in `benchmarks/bench_peers.py`; the inputs are "
            "DeepSeek-V3.2's shapes (128 heads, width 576, values 512, top-k 2048; indexer 64 heads x 128) at "
            "4096 x 8192, 8192 x 8192 and 16384 x 16384 with causal top-k indices and 4096 x 32768 with "
            "uniform ones. Each peer family runs in a process of its own, so a kernel that faults takes only "
            "itself out of the table.", ""]


def merge_runs(runs: list[dict], names: list[str]) -> dict:
    """One results dict from several runs: an operation measured in a later run takes its rows from
    that run, so ratios never mix runs; ``meta["op_runs"]`` records which run each such operation
    comes from. A family the later run did not measure for that operation keeps its rows from the
    earlier run, marked ``"earlier_run"``, and the earlier run's dsa_ref rows of the operation go to
    ``results["earlier_dsa_ref"]``: the page shows them in a table of their own, ratios as that run
    measured them."""
    merged = json.loads(json.dumps(runs[0]))
    for run, name in zip(runs[1:], names[1:]):
        ops = [o for o in bench_peers.OPS if any(r["op"] == o for r in run["results"])]  # in a fixed order
        kept, reference = [], []
        for op in ops:
            families = {r["family"] for r in run["results"] if r["op"] == op}
            before = [r for r in merged["results"] if r["op"] == op]
            stay = [r for r in before if r["family"] not in families]
            if stay:
                origin = merged["meta"].get("op_runs", {}).get(op) or _run_info(merged["meta"], names[0])
                kept += [dict(r, earlier_run=r.get("earlier_run", origin)) for r in stay]
                if any("earlier_run" not in r for r in stay):  # rows of the run just superseded stay
                    reference += [dict(r, earlier_run=origin) for r in before if r["family"] == "dsa_ref"
                                  and "earlier_run" not in r]
        impls = merged.setdefault("impls", {})
        for op in ops:  # the interfaces as the later run called them, and those of the rows kept
            kept_names = {r["impl"] for r in kept if r["op"] == op}
            impls[op] = {**run.get("impls", {}).get(op, {}),
                         **{n: v for n, v in impls.get(op, {}).items() if n in kept_names}}
        merged["results"] = [r for r in merged["results"] if r["op"] not in ops] + kept + run["results"]
        still = {(r["op"], r["earlier_run"]["source"]) for r in kept}  # earlier references kept rows still need
        merged["earlier_dsa_ref"] = [r for r in merged.get("earlier_dsa_ref", [])
                                     if r["op"] not in ops or (r["op"], r["earlier_run"]["source"]) in still] + reference
        for op in ops:
            merged["meta"].setdefault("op_runs", {})[op] = _run_info(run["meta"], name)
    return merged


def render(results: dict | None, *, source: str | None = None, figure: Path | None = None) -> str:
    """The whole page; ``results`` is a bench_peers JSON (``None``: the page before any GPU run)."""
    if results is not None and results.get("schema") != bench_peers.SCHEMA:
        raise ValueError(f"not a bench_peers results file (schema {results.get('schema')!r}, "
                         f"expected {bench_peers.SCHEMA!r})")
    origin = f"from {source}" if source else "with no results yet"
    impls = (results or {}).get("impls") or bench_peers.impl_table()
    conventions = (results or {}).get("conventions") or bench_peers.convention_table()
    lines = [f"<!-- Generated by tools/known_kernels_page.py {origin}; edit the generator, not this page. -->", "",
             "# Known kernels", "",
             "Other public implementations of DeepSeek Sparse Attention's kernels: what they take and return, "
             "where they agree with dsa_ref and where they differ, and how fast they are beside dsa_ref's own "
             "kernels ([chapter 5](chapters/05_tilelang_fast_path.md)) on the same inputs, timed the same way. "
             "`benchmarks/bench_peers.py` measures all of it; this page is generated from its output.", ""]
    lines += findings_section(results) + peers_section() + interfaces_section(impls) + conventions_section(conventions)
    lines += conformance_section(results) + speed_section(results, figure) + run_section()
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", nargs="*", type=Path,
                        help="bench_peers.py results files (none: no measured tables); an operation measured in a "
                             "later file replaces that operation's rows of the earlier ones")
    parser.add_argument("--recheck", action="append", type=Path, default=[],
                        help="a later bench_peers.py run that re-checked some cells with the current oracle: the "
                             "findings say what it found for the cells the earlier check failed (repeatable)")
    parser.add_argument("--figure", type=Path, default=FIGURE, help="shown on the page when it exists")
    args = parser.parse_args(argv)

    def name(path: Path) -> str:
        try:
            return str(path.resolve().relative_to(ROOT))
        except ValueError:
            return path.name

    names = [name(p) for p in args.json]
    results = merge_runs([json.loads(p.read_text()) for p in args.json], names) if args.json else None
    if results is not None and args.recheck:
        results["rechecks"] = [{**json.loads(p.read_text()), "source": name(p)} for p in args.recheck]
    source = " and ".join(names) if names else None
    if source and args.recheck:
        source += " (re-checked by " + " and ".join(name(p) for p in args.recheck) + ")"
    figure = args.figure if results is not None and args.figure.is_file() else None
    sys.stdout.write(render(results, source=source, figure=figure))
    return 0


if __name__ == "__main__":
    sys.exit(main())
