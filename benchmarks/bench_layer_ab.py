"""The layer step of two code trees, alternating on one GPU: is this tree slower than that one?

    git archive <commit> dsa_ref | tar -x -C /tmp/before                  # the other tree
    python benchmarks/bench_layer_ab.py --other /tmp/before --tokens 4096,8192,16384 --out ab.json
    python benchmarks/bench_layer_ab.py --other /tmp/before --device cpu --scale tiny --tokens 256   # smoke test

One step is what `bench_long_context.py` measures: `DSAttention` forward and
``output.float().square().mean().backward()``, every parameter and the input training, one whole
causal sequence, DeepSeek-V3.2's layer (128 heads, top-k 2048, indexer 64 x 128) in bf16 with
``--backend`` (default ``tilelang``; ``--scale tiny``: `tiny()` in float32). Each measurement is
one child process that imports ``dsa_ref`` from one tree, builds the layer with seed 0, takes
``--warmup`` steps and then times ``--reps`` steps with CUDA events (the median is kept). The
rounds alternate the trees (this, other; then other, this; ...), so a drift of the GPU's clocks or
temperature over the run falls on both. The result per point is the median over rounds of each
tree's median, and their ratio.

``--count-syncs`` (GPU) also runs one more step under ``torch.cuda.set_sync_debug_mode("warn")``
and records how many operations made the host wait for the GPU, and where (file and line of
the caller, as the warnings report it): a synchronisation lets the GPU run dry while the host
queues the next kernels, which shows at small sizes.

Output: ``--out`` (JSON: meta, one record per child, and a summary per point).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--other", help="the other tree: a folder holding its dsa_ref/ package")
    parser.add_argument("--this", default=ROOT, help="this tree (default: the checkout the script is in)")
    parser.add_argument("--tokens", default="4096,8192,16384")
    parser.add_argument("--stages", default="dense_warmup,sparse")
    parser.add_argument("--backend", default="tilelang")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--scale", choices=("full", "tiny"), default="full")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--count-syncs", action="store_true")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per child process")
    parser.add_argument("--out", default="bench_layer_ab.json")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is None and not args.other:
        parser.error("--other is required")
    return args


# ------------------------------------------------------------------------------------ the child


def child(spec: dict) -> dict:
    """Import dsa_ref from ``spec["code"]``, build the layer, time its step; a JSON-able record."""
    sys.path.insert(0, spec["code"])
    import torch

    import dsa_ref
    from dsa_ref import DSAttention, deepseek_v32, tiny
    from dsa_ref.layout import one_sequence

    if not os.path.abspath(dsa_ref.__file__).startswith(os.path.abspath(spec["code"])):
        raise RuntimeError(f"imported dsa_ref from {dsa_ref.__file__}, not from {spec['code']}")
    device = torch.device(spec["device"])
    torch.manual_seed(0)
    if spec["scale"] == "full":
        layer = DSAttention(deepseek_v32(), device=device, dtype=torch.bfloat16)
        dtype = torch.bfloat16
    else:
        layer = DSAttention(tiny(), device=device, dtype=torch.float32)
        dtype = torch.float32
    layer.backend = spec["backend"]
    tokens, stage = spec["tokens"], spec["stage"]
    cu = one_sequence(tokens, device=device)
    x = torch.randn(tokens, layer.config.mla.dim, device=device, dtype=dtype, requires_grad=True)

    def step():
        layer(x, cu, stage=stage).output.float().square().mean().backward()
        layer.zero_grad(set_to_none=True)
        x.grad = None

    def timed() -> float:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        step()
        return (time.perf_counter() - t0) * 1e3

    for _ in range(spec["warmup"]):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = [timed() for _ in range(spec["reps"])]
    row = dict(spec, ms=times, median_ms=statistics.median(times))
    if device.type == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if spec.get("count_syncs") and device.type == "cuda":
        row.update(count_syncs(step))
    return row


def count_syncs(step) -> dict:
    """How many operations of one step synchronised the host with the GPU, and where they were called."""
    import warnings

    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    where: dict[str, int] = {}
    for w in syncs:
        key = f"{os.path.relpath(w.filename, ROOT) if w.filename.startswith(ROOT) else w.filename}:{w.lineno}"
        where[key] = where.get(key, 0) + 1
    return {"syncs": len(syncs), "sync_sites": dict(sorted(where.items(), key=lambda kv: -kv[1]))}


# ------------------------------------------------------------------------------------ the parent


def run_child(spec: dict, timeout_s: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return dict(spec, error=f"timed out after {timeout_s:g} s")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return dict(spec, error=f"child exited with {done.returncode}: {' | '.join(tail)[:400]}")
    row = json.loads(lines[-1])
    row["process_s"] = time.perf_counter() - t0
    return row


def summarise(records: list[dict]) -> list[dict]:
    """Per (tokens, stage): each tree's median over rounds of its per-child medians, and this / other."""
    points: dict[tuple, dict] = {}
    for r in records:
        p = points.setdefault((r["tokens"], r["stage"]), {"tokens": r["tokens"], "stage": r["stage"]})
        if "median_ms" in r:
            p.setdefault(r["tree"] + "_runs_ms", []).append(r["median_ms"])
        if "syncs" in r:
            p[r["tree"] + "_syncs"] = r["syncs"]
    for p in points.values():
        for tree in ("this", "other"):
            runs = p.get(tree + "_runs_ms")
            if runs:
                p[tree + "_ms"] = statistics.median(runs)
        if "this_ms" in p and "other_ms" in p:
            p["this_over_other"] = p["this_ms"] / p["other_ms"]
    return list(points.values())


def main(argv=None) -> int:
    args = _args(argv)
    if args.child is not None:
        print(json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    trees = {"this": os.path.abspath(args.this), "other": os.path.abspath(args.other)}
    for name, path in trees.items():
        if not os.path.isfile(os.path.join(path, "dsa_ref", "__init__.py")):
            raise SystemExit(f"--{name} {path!r} holds no dsa_ref/__init__.py")
    records = []
    for rnd in range(args.rounds):
        order = ("this", "other") if rnd % 2 == 0 else ("other", "this")
        for tokens in [int(t) for t in args.tokens.split(",")]:
            for stage in args.stages.split(","):
                for tree in order:
                    spec = dict(tree=tree, code=trees[tree], round=rnd, tokens=tokens, stage=stage,
                                backend=args.backend, device=args.device, scale=args.scale, warmup=args.warmup,
                                reps=args.reps, count_syncs=args.count_syncs and rnd == 0)
                    row = run_child(spec, args.timeout_s)
                    records.append(row)
                    shown = f"{row['median_ms']:9.2f} ms" if "median_ms" in row else row["error"]
                    syncs = f"  syncs {row['syncs']}" if "syncs" in row else ""
                    print(f"round {rnd} {tree:5s} {tokens:6d} {stage:12s} {shown}{syncs}", flush=True)
    summary = summarise(records)
    meta = {"date": time.strftime("%Y-%m-%d"), "trees": trees, "backend": args.backend, "device": args.device,
            "scale": args.scale, "rounds": args.rounds, "warmup": args.warmup, "reps": args.reps,
            "command": " ".join(sys.argv)}
    try:
        import torch

        meta["torch"] = torch.__version__
        if args.device == "cuda" and torch.cuda.is_available():
            meta.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda)
    except Exception:  # pragma: no cover
        pass
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "records": records, "summary": summary}, f, indent=1)
    for p in summary:
        ratio = f"{p['this_over_other']:.3f}" if "this_over_other" in p else "-"
        print(f"{p['tokens']:6d} {p['stage']:12s} this {p.get('this_ms', float('nan')):9.2f} ms  "
              f"other {p.get('other_ms', float('nan')):9.2f} ms  this/other {ratio}")
    return 0 if all("error" not in r for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
