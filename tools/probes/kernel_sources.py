"""The CUDA source TileLang writes for every kernel the tests and benchmarks compile, to compare two trees.

    python tools/probes/kernel_sources.py dump OUTDIR            # in each tree (git worktree or archive)
    python tools/probes/kernel_sources.py compare BEFORE AFTER    # which kernels' sources differ

A change that leaves every kernel's generated source as it was (a renamed pass config, a moved helper)
is proven neutral without a GPU. ``dump`` compiles `dsa_ref.kernels.shapes.kernel_set()` for sm_90a on
the CPU (TileLang and ``nvcc``; ``DSA_REF_TILELANG_ARCH=sm_90a``, two processes), writes ``<n>.cu``
per kernel and ``manifest.json`` (index, build job, SHA-1 of the source). ``compare`` lists the jobs
whose sources differ; read those diffs: TileLang may give two equal-sized shared-memory buffers each
other's names from one process to the next, which changes the text and not the kernel.
"""
import argparse
import hashlib
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _one(args):
    i, job, out = args
    sys.path.insert(0, str(ROOT))
    from dsa_ref.kernels.shapes import build

    try:
        src = build(*job).get_kernel_source()
    except Exception as err:  # noqa: BLE001 - recorded in place of the source
        src = f"ERROR {type(err).__name__}: {str(err)[-500:]}"
    (Path(out) / f"{i}.cu").write_text(src)
    return i, repr(job), hashlib.sha1(src.encode()).hexdigest()


def dump(out: Path, jobs_n: int) -> None:
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DSA_REF_TILELANG_ARCH", "sm_90a")
    from dsa_ref.kernels.shapes import kernel_set

    out.mkdir(parents=True, exist_ok=True)
    jobs = list({repr(job): job for job in kernel_set()}.values())
    with ProcessPoolExecutor(jobs_n) as pool:
        manifest = list(pool.map(_one, [(i, job, str(out)) for i, job in enumerate(jobs)]))
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(f"{len(manifest)} kernels in {out}")


def compare(before: Path, after: Path) -> int:
    a = json.loads((before / "manifest.json").read_text())
    b = json.loads((after / "manifest.json").read_text())
    if [job for _, job, _ in a] != [job for _, job, _ in b]:
        print("the two dumps hold different kernel sets")
        return 2
    differ = [(i, job) for (i, job, ha), (_, _, hb) in zip(a, b) if ha != hb]
    for i, job in differ:
        print(f"{i}.cu differs: {job}")
    print(f"{len(a)} kernels, {len(differ)} with a different source")
    return 1 if differ else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("out", type=Path)
    d.add_argument("--jobs", type=int, default=2)
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    args = parser.parse_args()
    if args.cmd == "dump":
        dump(args.out, args.jobs)
        return 0
    return compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
