"""The fast path's layer step, timed the same way for two source trees (an A/B of a change).

    python benchmarks/bench_layer_ab.py --tree OLD_TREE --tokens 4096,8192 --rounds 3 --out ab.json

Each round times one `DSAttention` training step (forward + backward, DeepSeek-V3.2's layer:
``deepseek_v32()``, bf16, one causal sequence, ``backend="tilelang"``), both stages, first with
this checkout's ``dsa_ref`` and then with the one in ``--tree`` (a ``git archive`` of an older
commit, say), each in its own process so that the two never share imported code; the rounds
alternate the trees, so a drift of the GPU's clocks hits both alike. CUDA events around each
step, median of ``--reps`` steps after one warm-up step. Set ``TILELANG_CACHE_DIR`` per tree
with ``--old-cache`` when the two trees' kernels differ (TileLang caches by source).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(tokens: list[int], reps: int) -> list[dict]:
    import torch

    from dsa_ref import DSAttention, deepseek_v32

    cfg = deepseek_v32()
    torch.manual_seed(0)
    layer = DSAttention(cfg, backend="tilelang", device="cuda", dtype=torch.bfloat16)
    rows = []
    for n in tokens:
        x = torch.randn(n, cfg.mla.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for stage in ("dense_warmup", "sparse"):
            def step():
                layer(x, stage=stage).output.float().square().mean().backward()

            step()
            times = []
            for _ in range(reps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                step()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            rows.append(dict(tokens=n, stage=stage, ms=statistics.median(times), all_ms=times))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", required=True, help="the other source tree (holds dsa_ref/)")
    parser.add_argument("--old-cache", default=None, help="TILELANG_CACHE_DIR for --tree")
    parser.add_argument("--tokens", default="4096,8192")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default="bench_layer_ab.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.child:
        print(json.dumps(child(tokens, args.reps)))
        return
    trees = {"this": ROOT, "other": os.path.abspath(args.tree)}
    results = []
    for r in range(args.rounds):
        for name, tree in trees.items():
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree] + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
            if name == "other" and args.old_cache:
                env["TILELANG_CACHE_DIR"] = args.old_cache
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--tree", tree, "--tokens", args.tokens,
                   "--reps", str(args.reps)]
            out = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, timeout=600)
            if out.returncode:
                print(f"{name} round {r}: failed\n{out.stderr[-2000:]}", flush=True)
                continue
            for row in json.loads(out.stdout.strip().splitlines()[-1]):
                results.append(dict(row, tree=name, round=r))
                print(f"round {r} {name:5s} {row['tokens']:6d} {row['stage']:12s} {row['ms']:8.2f} ms", flush=True)
    summary = {}
    for row in results:
        summary.setdefault((row["tokens"], row["stage"], row["tree"]), []).append(row["ms"])
    lines = []
    for (n, stage, tree), ms in sorted(summary.items()):
        lines.append(dict(tokens=n, stage=stage, tree=tree, median_ms=statistics.median(ms), rounds_ms=ms))
        print(f"{n:6d} {stage:12s} {tree:5s} median over rounds {statistics.median(ms):8.2f} ms  {ms}")
    import torch

    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
                other_tree=args.tree, command=" ".join(sys.argv))
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, summary=lines, steps=results), f, indent=1)


if __name__ == "__main__":
    main()
