"""Long context on one GPU: peak memory and step time of DSAttention, forward + backward.

    python benchmarks/bench_long_context.py --precompile --budget-s 330 --out "$OUT"    # H200
    python benchmarks/bench_long_context.py --device cpu --scale tiny --target-backend reference  # CPU smoke test
    python benchmarks/bench_long_context.py --plot long_context.json --png docs/assets/long_context.png
    python benchmarks/bench_long_context.py --points reference:sparse:65536,reference:sparse:131072 \
        --point-timeout-s 240 --budget-s 560 --out "$OUT"                     # the reference at 64K and 128K

DeepSeek-V3.2's layer (128 heads, top-k 2048, indexer 64 x 128) in bf16; every parameter and the
input train (``output.float().square().mean().backward()``, as benchmarks/bench_kernels.py's layer
step). Peak memory is ``torch.cuda.max_memory_allocated`` over the measured steps (weights and
input included); step time is the median of CUDA-event timings after one warm-up step.

The points, most important first, within ``--budget-s`` seconds (a point whose predicted time
exceeds what is left, or ``--point-limit-s``, is skipped and recorded as skipped):

1. ``targets``: a CP rank's slice of one 131072-token sequence at cp = 8 -- its 16384 zigzag queries
   (`cp_shard_index`) against all 131072 keys, as `cp_dsa_forward` runs them, emulated in one
   process: ``gather`` puts the rank's rows at their global places and fills the other ranks'
   rows with copies of the rank's own (detached) -- both stages; one whole 65536-token
   sequence, dense warm-up; one whole 131072-token sequence, sparse stage. TileLang backend.
2. ``step``: 4096, 8192 and 16384 tokens, both stages, TileLang and reference (the layer-step
   comparison of bench_kernels.py: the same step, the same timing).
3. ``curve``: 8K ... 128K tokens, both stages, TileLang first, then the reference while it fits.

``--backends``, ``--stages`` and ``--tokens`` keep only the points they name; ``--points`` names
whole-sequence points one by one, measured in that order (``reference:sparse:131072,...``). ``--point-timeout-s``
measures every point in a child process of its own and stops it after that many seconds (or when the
budget runs out), recording ``"error": "timed out ..."``: a slow point cannot eat the whole run, and
a point's memory is gone when its process ends. With it, a point is skipped only when the budget is
spent, not by the quadratic prediction. ``--profile-tokens N`` adds, for each reference point of at
most ``N`` tokens, one more step under ``torch.profiler`` and writes its busiest operations to
``profile_<stage>_<tokens>.txt``.

Output in ``--out``: ``long_context.json`` (meta + one record per point) and ``long_context.png``
(memory and time against context length). ``--precompile`` first compiles the kernels this
benchmark uses, in parallel processes (TileLang's disk cache keeps them).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from dsa_ref import DSAttention, deepseek_v32, tiny  # noqa: E402
from dsa_ref.layout import cp_shard_index, one_sequence  # noqa: E402

GiB = 2**30
_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


# ------------------------------------------------------------------------------------ the points


def point_list(scale: str, target_backend: str = "tilelang") -> list[dict]:
    """Every point, in the order they are measured: targets, the 4K-16K step comparison, the curve."""
    unit = 1024 if scale == "full" else 8  # tiny: the same structure at 1/128 of the tokens
    big = 128 * unit
    tb = target_backend
    points = [
        dict(group="targets", kind="cp_slice", tokens=big, cp=8, stage="sparse", backend=tb),
        dict(group="targets", kind="cp_slice", tokens=big, cp=8, stage="dense_warmup", backend=tb),
        dict(group="targets", kind="whole", tokens=64 * unit, stage="dense_warmup", backend=tb),
        dict(group="targets", kind="whole", tokens=big, stage="sparse", backend=tb),
    ]
    for n in (4, 8, 16):
        for stage in ("dense_warmup", "sparse"):
            for backend in ("tilelang", "reference"):
                points.append(dict(group="step", kind="whole", tokens=n * unit, stage=stage, backend=backend))
    for backend in ("tilelang", "reference"):
        for n in (8, 16, 32, 64, 128):
            for stage in ("dense_warmup", "sparse"):
                points.append(dict(group="curve", kind="whole", tokens=n * unit, stage=stage, backend=backend))
    return points


def _key(p: dict) -> tuple:
    return (p["kind"], p["tokens"], p.get("cp"), p["stage"], p["backend"])


def predicted_seconds(point: dict, done: list[dict]) -> float | None:
    """Time of the point from a measured smaller one of the same stage and backend (quadratic growth)."""
    best = None
    for r in done:
        if (r["kind"], r["stage"], r["backend"]) == (point["kind"], point["stage"], point["backend"]) \
                and r.get("point_s") and r["tokens"] < point["tokens"]:
            if best is None or r["tokens"] > best["tokens"]:
                best = r
    if best is None:
        return None
    return best["point_s"] * (point["tokens"] / best["tokens"]) ** 2


# ------------------------------------------------------------------------------------ one point


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device) -> float:
    """Seconds of one call (CUDA events on the GPU, perf_counter on the CPU)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def make_step(layer: DSAttention, point: dict, device: torch.device):
    """The training step of a point and the bytes of its input."""
    dim = layer.config.mla.dim
    tokens = point["tokens"]
    cu = one_sequence(tokens, device=device)
    stage = point["stage"]
    if point["kind"] == "whole":
        x = torch.randn(tokens, dim, device=device, dtype=layer_dtype(layer), requires_grad=True)

        def step():
            res = layer(x, cu, stage=stage)
            res.output.float().square().mean().backward()
            return res

        return step, x
    # a CP rank's queries against every key, in one process: what cp_dsa_forward hands to attend
    cp = point["cp"]
    query_index = cp_shard_index(cu.cpu(), cp, cp - 1).to(device)  # [tokens / cp]: the last rank
    x = torch.randn(query_index.numel(), dim, device=device, dtype=layer_dtype(layer), requires_grad=True)

    def gather(t):  # [tokens / cp, ...] -> [tokens, ...]: this rank's rows in place, the others copies
        others = t.detach().repeat(cp, *([1] * (t.dim() - 1)))  # [tokens, ...]
        return others.index_put((query_index,), t)  # differentiable in t (the all-gather's backward)

    def step():
        res = layer.attend(x, cu, query_index, gather=gather, stage=stage)
        res.output.float().square().mean().backward()
        return res

    return step, x


def layer_dtype(layer: DSAttention) -> torch.dtype:
    return next(layer.mla.parameters()).dtype


def run_point(layer: DSAttention, point: dict, device: torch.device, reps: int, profile_dir: str | None = None) -> dict:
    """Measure one point: ``point_s`` (wall time of the whole point), ``step_s`` (median), peak memory.

    ``profile_dir``: also profile one more step there (`profile_step`)."""
    row = dict(point)
    layer.backend = point["backend"]
    t0 = time.perf_counter()
    step = x = None
    try:
        step, x = make_step(layer, point, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            row["before_gib"] = torch.cuda.memory_allocated() / GiB
        first = _timed(step, device)  # warm-up (and the first measurement of a slow point)
        layer.zero_grad(set_to_none=True)
        x.grad = None
        times = [first] if first > 5.0 else []
        while len(times) < (1 if first > 5.0 else reps):
            times.append(_timed(step, device))
            layer.zero_grad(set_to_none=True)
            x.grad = None
        row["step_s"] = statistics.median(times)
        row["reps"] = len(times)
        if device.type == "cuda":
            row["peak_gib"] = torch.cuda.max_memory_allocated() / GiB
        if profile_dir is not None:
            row["profile"] = profile_step(step, layer, x, point, device, profile_dir)
    except _OOM as err:
        row["error"] = "out of memory: " + str(err).split("\n")[0][:200]
    except RuntimeError as err:  # e.g. a kernel that declines, or CUDA OOM raised as RuntimeError
        row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
    finally:
        layer.zero_grad(set_to_none=True)
        del step, x
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    row["point_s"] = time.perf_counter() - t0
    return row


def profile_step(step, layer: DSAttention, x: torch.Tensor, point: dict, device: torch.device, out_dir: str) -> str:
    """One more step under ``torch.profiler``; its 40 busiest operations go to a text file, whose name is returned."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        _sync(device)
    layer.zero_grad(set_to_none=True)
    x.grad = None
    name = f"profile_{point['stage']}_{point['tokens']}.txt"
    sort = "device_time_total" if device.type == "cuda" else "cpu_time_total"
    with open(os.path.join(out_dir, name), "w") as f:
        f.write(json.dumps(point) + "\n")
        f.write(prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=70))
    return name


def make_layer(scale: str, device: torch.device) -> DSAttention:
    """The layer every point measures (the same weights in every process: seed 0)."""
    torch.manual_seed(0)
    if scale == "full":
        return DSAttention(deepseek_v32(), device=device, dtype=torch.bfloat16)
    return DSAttention(tiny(), device=device, dtype=torch.float32)


def run_point_in_child(point: dict, args, timeout_s: float, profile: bool) -> dict:
    """`run_point` in a fresh process of this script (``--child``), stopped after ``timeout_s`` seconds."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(point), "--device", args.device,
           "--scale", args.scale, "--reps", str(args.reps), "--out", args.out] + (["--child-profile"] if profile else [])
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return dict(point, error=f"timed out after {timeout_s:g} s (stopped)", point_s=time.perf_counter() - t0)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return dict(point, error=f"child exited with {done.returncode}: {' | '.join(tail)[:300]}",
                    point_s=time.perf_counter() - t0)
    row = json.loads(lines[-1])
    row["process_s"] = time.perf_counter() - t0  # the point plus the child's start (imports, CUDA, weights)
    return row


def wanted(point: dict, args) -> bool:
    """Whether the point passes ``--groups``, ``--backends``, ``--stages`` and ``--tokens`` (or is named in ``--points``)."""
    if args.points:
        return point["kind"] == "whole" and f"{point['backend']}:{point['stage']}:{point['tokens']}" in args.points.split(",")
    checks = ((args.groups, point["group"]), (args.backends, point["backend"]), (args.stages, point["stage"]),
              (args.tokens, str(point["tokens"])))
    return all(not allowed or value in allowed.split(",") for allowed, value in checks)


# ------------------------------------------------------------------------------------ precompile


def precompile(jobs: int) -> None:
    """Compile the kernels of the layer at DeepSeek-V3.2's shapes (disk cache), in parallel."""
    from precompile_kernels import _build

    from dsa_ref.kernels.shapes import DIM, DIM_V, INDEXER_DIM, SM_SCALE

    wanted = [("warp_specialized", (128, DIM, DIM_V, SM_SCALE)), ("simple", (128, DIM, DIM_V, SM_SCALE)),
              ("backward", (128, DIM, DIM_V, SM_SCALE)), ("delta", (128, DIM_V)),
              ("indexer", (64, INDEXER_DIM, True)), ("scores_at", (64, INDEXER_DIM, True)),
              ("scores_at_backward", (64, INDEXER_DIM, True)), ("topk", ()), ("head_sum", (128, DIM, SM_SCALE))]
    t0 = time.time()
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for job, seconds, error in pool.map(_build, wanted):
            print(f"{'compiled' if error is None else 'FAILED  '} {job[0]:18s} {seconds:6.1f} s {error or ''}", flush=True)
    print(f"precompile: {time.time() - t0:.1f} s", flush=True)


# ------------------------------------------------------------------------------------ output


def meta(device: torch.device, args) -> dict:
    m = {"date": time.strftime("%Y-%m-%d"), "device": str(device), "torch": torch.__version__,
         "scale": args.scale, "budget_s": args.budget_s, "point_limit_s": args.point_limit_s,
         "config": "deepseek_v32 (128 heads, top-k 2048, indexer 64 x 128), bf16" if args.scale == "full"
         else "tiny(), float32",
         "step": "forward + output.float().square().mean().backward(), every parameter and x train",
         "command": " ".join(sys.argv)}
    if device.type == "cuda":
        m.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda,
                 total_gib=torch.cuda.get_device_properties(device).total_memory / GiB)
        try:
            import tilelang

            m["tilelang"] = tilelang.__version__
        except Exception:  # pragma: no cover
            m["tilelang"] = "unavailable"
    return m


def plot(results: dict, png: str) -> None:
    """Peak memory and step time against context length, one line per (stage, backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["points"] if r["kind"] == "whole" and "step_s" in r]
    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {"tilelang": "-", "reference": "--"}
    colours = {"dense_warmup": "tab:blue", "sparse": "tab:orange"}
    for stage in ("dense_warmup", "sparse"):
        for backend in ("tilelang", "reference"):
            pts = sorted({r["tokens"]: r for r in rows if (r["stage"], r["backend"]) == (stage, backend)}.values(),
                         key=lambda r: r["tokens"])
            if not pts:
                continue
            label = f"{stage}, {backend}"
            kw = dict(linestyle=styles[backend], color=colours[stage], marker="o", label=label)
            if all("peak_gib" in r for r in pts):
                ax_mem.plot([r["tokens"] for r in pts], [r["peak_gib"] for r in pts], **kw)
            ax_time.plot([r["tokens"] for r in pts], [r["step_s"] for r in pts], **kw)
    for r in results["points"]:
        if r["kind"] == "cp_slice" and "peak_gib" in r:
            ax_mem.scatter([r["tokens"]], [r["peak_gib"]], marker="*", s=120, color=colours[r["stage"]], zorder=5,
                           label=f"CP rank slice (cp={r['cp']}), {r['stage']}")
    for ax, name in ((ax_mem, "peak memory (GiB)"), (ax_time, "step time (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens in the sequence")
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
    ax_time.set_yscale("log")
    (ax_mem if ax_mem.get_legend_handles_labels()[0] else ax_time).legend(fontsize=7)
    m = results["meta"]
    fig.suptitle(f"DSAttention forward + backward, {m.get('gpu', m['device'])}, {m['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


def speedups(results: dict) -> dict:
    """Reference step time over TileLang step time, per ``"<tokens> <stage>"`` of the step group."""
    rows = {(r["tokens"], r["stage"], r["backend"]): r for r in results["points"]
            if r["group"] == "step" and "step_s" in r}
    return {f"{n} {stage}": rows[(n, stage, "reference")]["step_s"] / rows[(n, stage, "tilelang")]["step_s"]
            for (n, stage, backend) in rows if backend == "tilelang" and (n, stage, "reference") in rows}


def summary(results: dict) -> str:
    lines = ["| group | what | tokens | stage | backend | step s | peak GiB | note |", "|---|---|---|---|---|---|---|---|"]
    for r in results["points"]:
        what = f"CP rank slice, cp={r['cp']}" if r["kind"] == "cp_slice" else "whole sequence"
        step = f"{r['step_s']:.3f}" if "step_s" in r else ""
        peak = f"{r['peak_gib']:.1f}" if "peak_gib" in r else ""
        lines.append(f"| {r['group']} | {what} | {r['tokens']} | {r['stage']} | {r['backend']} | {step} | {peak} | "
                     f"{r.get('error', r.get('skipped', ''))} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--scale", choices=("full", "tiny"), default="full")
    parser.add_argument("--budget-s", type=float, default=330.0, help="seconds for all points together")
    parser.add_argument("--point-limit-s", type=float, default=60.0, help="skip a point predicted to take longer")
    parser.add_argument("--groups", default="targets,step,curve")
    parser.add_argument("--backends", default="", help="comma-separated: only these backends (default all)")
    parser.add_argument("--stages", default="", help="comma-separated: only these stages (default both)")
    parser.add_argument("--tokens", default="", help="comma-separated: only these token counts (default all)")
    parser.add_argument("--points", default="", help="comma-separated backend:stage:tokens (whole sequences), "
                        "measured in this order; replaces the four filters above")
    parser.add_argument("--point-timeout-s", type=float, default=0.0,
                        help="measure each point in a child process, stopped after this many seconds (0: in process)")
    parser.add_argument("--profile-tokens", type=int, default=0,
                        help="profile one more step of each reference point up to this many tokens")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-profile", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--target-backend", default="tilelang", help="backend of the targets (reference: a CPU smoke test)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=os.environ.get("OUT", "build/bench"))
    parser.add_argument("--precompile", action="store_true")
    parser.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1))
    parser.add_argument("--plot", metavar="JSON", help="only plot an earlier result to --png")
    parser.add_argument("--png", default=None)
    args = parser.parse_args()
    if args.plot:
        with open(args.plot) as f:
            plot(json.load(f), args.png or "long_context.png")
        return 0
    t_start = time.perf_counter()
    device = torch.device(args.device)
    os.makedirs(args.out, exist_ok=True)
    if args.child:  # one point, in this process, for a parent that runs it with --point-timeout-s
        row = run_point(make_layer(args.scale, device), json.loads(args.child), device, args.reps,
                        args.out if args.child_profile else None)
        print(json.dumps(row), flush=True)
        return 0
    if args.precompile:
        precompile(args.jobs)
    deadline = time.perf_counter() + args.budget_s
    isolated = args.point_timeout_s > 0
    layer = None if isolated else make_layer(args.scale, device)
    from dsa_ref.dispatch import kernels_available

    kernels_ok, why = kernels_available() if device.type == "cuda" else (False, f"device {device}")
    results = {"meta": meta(device, args), "points": []}
    done: dict[tuple, dict] = {}
    points = [p for p in point_list(args.scale, args.target_backend) if wanted(p, args)]
    if args.points:  # in the order named
        order = args.points.split(",")
        points.sort(key=lambda p: order.index(f"{p['backend']}:{p['stage']}:{p['tokens']}"))
    for point in points:
        left = deadline - time.perf_counter()
        if _key(point) in done and args.points:
            continue  # named once, measured once
        if _key(point) in done:  # measured already (a target, or the step comparison)
            row = dict(done[_key(point)], group=point["group"], reused=True)
        elif point["backend"] == "tilelang" and not kernels_ok:
            row = dict(point, skipped=f"kernels unavailable: {why}")
        else:
            guess = None if isolated else predicted_seconds(point, list(done.values()))
            profile = point["backend"] == "reference" and point["tokens"] <= args.profile_tokens
            if left <= (30 if isolated else 0) or (guess is not None and guess > min(left, args.point_limit_s)):
                row = dict(point, skipped=f"predicted {guess or 0:.0f} s, {max(left, 0):.0f} s left")
            elif isolated:
                row = run_point_in_child(point, args, min(args.point_timeout_s, left), profile)
                done[_key(point)] = row
            else:
                row = run_point(layer, point, device, args.reps, args.out if profile else None)
                done[_key(point)] = row
        results["points"].append(row)
        print(json.dumps(row), flush=True)
        with open(os.path.join(args.out, "long_context.json"), "w") as f:
            json.dump(results, f, indent=1)
    results["meta"]["wall_s"] = time.perf_counter() - t_start
    results["step_speedup"] = speedups(results)
    with open(os.path.join(args.out, "long_context.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(summary(results))
    plot(results, os.path.join(args.out, "long_context.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
