"""Where one DSAttention training step spends its time: a per-op table from torch.profiler.

    python benchmarks/profile_layer_step.py --out "$OUT"                          # H200: V3.2, 4K/8K/16K tokens
    python benchmarks/profile_layer_step.py --device cpu --backend reference --tiny --out build/profile  # CPU smoke

The step is bench_kernels.py's and bench_long_context.py's: DeepSeek-V3.2's layer (``deepseek_v32()``:
hidden 7168, 128 heads, indexer 64 x 128, top-k 2048) in bf16 on one causal sequence, forward and
``output.float().square().mean().backward()``, every parameter and the input training, in both
stages (``dense_warmup``, ``sparse``). ``--tiny`` uses ``tiny()`` in float32 instead.

For each (tokens, stage): one warm-up step (kernels compile and load), then ``--steps`` steps under
torch.profiler (CPU and CUDA activities on the GPU, CPU only on the CPU). Its ``key_averages()``
gives, per op name (aten ops, autograd functions such as ``SparseMLAFunction`` and their backward
nodes, and the GPU kernels themselves): calls, total time (inclusive: an op's time includes the
kernels it launched), self time (the kernels' own time) and the **% of step** = self time / the
step's summed self time, so the rows' percentages add up to 100 %. Device times on the GPU, CPU
times on the CPU; all per step. The step's wall time comes from CUDA events (or the clock) around
an unprofiled step.

``DSA_REF_CODE=DIR`` in the environment imports ``dsa_ref`` from ``DIR`` (another tree) instead of
this checkout; the JSON's meta records which.

Output in ``--out``: ``profile_layer_step.json`` (meta and every row of every table) and
``profile_layer_step.md`` (the ``--top`` rows of each table, by self time).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
# DSA_REF_CODE=DIR profiles the dsa_ref package in DIR instead (another tree, e.g. `git archive <commit>
# dsa_ref | tar -x -C DIR`), so that two trees' steps can be compared table by table
sys.path.insert(0, os.environ.get("DSA_REF_CODE", ROOT))

import torch  # noqa: E402

from dsa_ref import DSAttention, deepseek_v32, tiny  # noqa: E402
from dsa_ref.layout import one_sequence  # noqa: E402


def _us(event, name: str, cpu: bool) -> float:
    """An averaged event's time in microseconds: ``name`` is ``total`` or ``self``; device or CPU time."""
    if cpu:
        return float(getattr(event, f"{'self_' if name == 'self' else ''}cpu_time_total"))
    for attr in (f"{'self_' if name == 'self' else ''}device_time_total",
                 f"{'self_' if name == 'self' else ''}cuda_time_total"):  # older torch
        if hasattr(event, attr):
            return float(getattr(event, attr))
    raise AttributeError(f"profiler event has no {name} device time")


def op_table(prof, steps: int, cpu: bool) -> list[dict]:
    """``prof.key_averages()`` as rows ``{op, calls, total_ms, self_ms, pct_of_step}`` per step, by self time."""
    rows = []
    for e in prof.key_averages():
        total, self_ = _us(e, "total", cpu), _us(e, "self", cpu)
        if total <= 0 and self_ <= 0:
            continue
        rows.append({"op": e.key, "calls": e.count / steps, "total_ms": total / 1e3 / steps,
                     "self_ms": self_ / 1e3 / steps})
    step_self = sum(r["self_ms"] for r in rows)
    for r in rows:
        r["pct_of_step"] = 100.0 * r["self_ms"] / step_self if step_self > 0 else 0.0
    return sorted(rows, key=lambda r: (-r["self_ms"], -r["total_ms"]))


def kernel_table(prof, steps: int) -> list[dict]:
    """GPU kernels per step by the innermost PyTorch op that launched them (``main_kernel`` of
    ``SparseMLAFunction`` vs of ``SelectedIndexScoresBackward``: TileLang names every kernel after
    its ``main``): rows ``{kernel, launched_by, calls, ms, pct_of_kernels}``, by time."""
    acc: dict[tuple, list] = {}
    for event in prof.events():
        for k in getattr(event, "kernels", []) or []:
            entry = acc.setdefault((k.name, event.name), [0, 0.0])
            entry[0] += 1
            entry[1] += k.duration
    total = sum(us for _, us in acc.values())
    rows = [{"kernel": name, "launched_by": op, "calls": n / steps, "ms": us / 1e3 / steps,
             "pct_of_kernels": 100.0 * us / total if total > 0 else 0.0} for (name, op), (n, us) in acc.items()]
    return sorted(rows, key=lambda r: -r["ms"])


def _timed_s(fn, device: torch.device) -> float:
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


def profile_point(layer: DSAttention, tokens: int, stage: str, device: torch.device, steps: int) -> dict:
    """One (tokens, stage): warm-up, an unprofiled timed step, then ``steps`` profiled steps."""
    dtype = next(layer.mla.parameters()).dtype
    x = torch.randn(tokens, layer.config.mla.dim, device=device, dtype=dtype, requires_grad=True)
    cu = one_sequence(tokens, device=device)

    def step():
        res = layer(x, cu, stage=stage)
        res.output.float().square().mean().backward()
        layer.zero_grad(set_to_none=True)
        x.grad = None

    step()  # warm-up: compiles or loads the kernels
    wall = _timed_s(step, device)
    cpu = device.type != "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if not cpu:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if not cpu:
            torch.cuda.synchronize()
    rows = op_table(prof, steps, cpu)
    point = {"tokens": tokens, "stage": stage, "backend": layer.backend, "step_ms": wall * 1e3,
             "profiled_self_ms": sum(r["self_ms"] for r in rows), "time": "CPU" if cpu else "CUDA", "ops": rows}
    if not cpu:
        point["kernels"] = kernel_table(prof, steps)
    return point


def _short(name: str, width: int = 90) -> str:
    name = name.replace("|", "\\|")
    return name if len(name) <= width else name[:width - 3] + "..."


def markdown(results: dict, top: int) -> str:
    m = results["meta"]
    lines = [f"# DSAttention step profile, {m.get('gpu', m['device'])}, {m['date']}", "",
             f"{m['config']}; backend {m['backend']}; torch {m['torch']}; `{m['command']}`.", "",
             "Per step. *total*: inclusive (an op with the kernels it launched); *self*: the op's own time; "
             "*% of step*: self time / the step's summed self time (the rows of a table add up to 100 %). On the GPU "
             "a second table gives each kernel with the op that launched it.", ""]
    for p in results["points"]:
        if "error" in p:
            lines += [f"## {p['tokens']} tokens, {p['stage']}", "", f"failed: {p['error']}", ""]
            continue
        unit = p["time"]
        lines += [f"## {p['tokens']} tokens, {p['stage']}", "",
                  f"Step {p['step_ms']:.2f} ms (unprofiled); {unit} self time under the profiler "
                  f"{p['profiled_self_ms']:.2f} ms.", "",
                  f"| op | calls | {unit} total ms | {unit} self ms | % of step |", "|---|---|---|---|---|"]
        for r in p["ops"][:top]:
            lines.append(f"| `{_short(r['op'])}` | {r['calls']:g} | {r['total_ms']:.3f} | {r['self_ms']:.3f} | "
                         f"{r['pct_of_step']:.1f} |")
        lines.append("")
        if p.get("kernels"):
            lines += ["GPU kernels by the PyTorch op that launched them:", "",
                      "| kernel | launched by | calls | ms | % of kernel time |", "|---|---|---|---|---|"]
            for r in p["kernels"][:top]:
                lines.append(f"| `{_short(r['kernel'])}` | `{_short(r['launched_by'])}` | {r['calls']:g} | "
                             f"{r['ms']:.3f} | {r['pct_of_kernels']:.1f} |")
            lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", default="tilelang", choices=("tilelang", "reference", "auto"))
    parser.add_argument("--tiny", action="store_true", help="tiny() in float32 (CPU smoke test)")
    parser.add_argument("--tokens", default=None, help="comma list (default 4096,8192,16384; --tiny: 32,64)")
    parser.add_argument("--stages", default="dense_warmup,sparse")
    parser.add_argument("--steps", type=int, default=1, help="profiled steps per point")
    parser.add_argument("--top", type=int, default=25, help="rows per table in the markdown")
    parser.add_argument("--out", default=os.environ.get("OUT", "build/profile"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    tokens = [int(t) for t in (args.tokens or ("32,64" if args.tiny else "4096,8192,16384")).split(",")]
    stages = [s for s in args.stages.split(",") if s]
    if args.backend == "tilelang":
        from dsa_ref.dispatch import kernels_available

        ok, why = kernels_available()
        if not ok:
            print(f"the tilelang backend is unavailable here ({why}); use --backend reference")
            return 1
    torch.manual_seed(0)
    cfg, dtype = (tiny(), torch.float32) if args.tiny else (deepseek_v32(), torch.bfloat16)
    layer = DSAttention(cfg, backend=args.backend, device=device, dtype=dtype)
    meta = {"date": time.strftime("%Y-%m-%d"), "device": str(device), "torch": torch.__version__,
            "backend": args.backend, "steps": args.steps,
            "config": "tiny(), float32" if args.tiny else "deepseek_v32() (128 heads, top-k 2048, indexer 64 x 128), bf16",
            "step": "forward + output.float().square().mean().backward(), every parameter and x train",
            "command": "python benchmarks/profile_layer_step.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    if device.type == "cuda":
        meta.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda)
    if "DSA_REF_CODE" in os.environ:
        import dsa_ref

        meta["code"] = os.path.dirname(os.path.dirname(os.path.abspath(dsa_ref.__file__)))
    results = {"meta": meta, "points": []}
    os.makedirs(args.out, exist_ok=True)
    for n in tokens:
        for stage in stages:
            try:
                point = profile_point(layer, n, stage, device, args.steps)
            except (RuntimeError, ValueError) as err:  # out of memory, a declined shape: say so, go on
                point = {"tokens": n, "stage": stage, "backend": args.backend,
                         "error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}
            results["points"].append(point)
            head = ", ".join(f"{r['op'][:40]} {r['pct_of_step']:.0f}%" for r in point.get("ops", [])[:3])
            print(f"{n} tokens {stage}: {point.get('step_ms', float('nan')):.2f} ms; {head or point.get('error')}",
                  flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    with open(os.path.join(args.out, "profile_layer_step.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(args.out, "profile_layer_step.md"), "w") as f:
        f.write(markdown(results, args.top))
    print(f"wrote {args.out}/profile_layer_step.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
