"""The CUDA source TileLang writes for every kernel the tests and benchmarks compile, to compare two trees.

    python tools/probes/kernel_sources.py dump OUTDIR            # in each tree (git worktree or archive)
    python tools/probes/kernel_sources.py compare BEFORE AFTER    # which kernels' sources differ
    python tools/probes/kernel_sources.py ptxas OUTDIR            # registers, spills, ptxas advisories

A change that leaves every kernel's generated source as it was (a renamed pass config, a moved helper)
is proven neutral without a GPU. ``dump`` compiles `dsa_ref.kernels.shapes.kernel_set()` for sm_90a on
the CPU (TileLang and ``nvcc``; ``DSA_REF_TILELANG_ARCH=sm_90a``, two processes), writes ``<n>.cu``
per kernel and ``manifest.json`` (index, build job, SHA-1 of the source). ``compare`` lists the jobs
whose sources differ; read those diffs: TileLang may give two equal-sized shared-memory buffers each
other's names from one process to the next, which changes the text and not the kernel.

``ptxas`` compiles every source of a dump with ``nvcc -cubin -Xptxas -v`` (sm_90a) and prints each
kernel's registers, spill bytes and ptxas's performance advisories. One kind is silent in every
other way: ptxas serialising all of a function's ``wgmma`` (``(C7515)``: a non-``wgmma`` instruction
may write an accumulator inside a pipeline stage, as a branch around an in-place rescale of the
accumulator does; ``(C7512)``: too few registers). The kernel stays correct and loses its MMA
overlap, so ``ptxas`` marks those kernels and exits with 1 when there is one.
"""
import argparse
import hashlib
import json
import os
import re
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERIALIZED = "wgmma.mma_async instructions are serialized"  # ptxas's words, whatever the cause (C7512, C7515, ...)


def parse_ptxas(info: str) -> dict:
    """Registers, spill bytes and advisories from ``nvcc -Xptxas -v`` output (one kernel).

    ``{"registers": int | None, "spill_stores": int, "spill_loads": int, "advisories": [codes],
    "serialized": bool}``; advisories are the ``(C7xxx)`` codes ptxas prints, each once, in order;
    ``serialized``: ptxas says it serialised the kernel's ``wgmma``."""
    registers = re.search(r"Used (\d+) registers", info)
    stores = re.search(r"(\d+) bytes spill stores", info)
    loads = re.search(r"(\d+) bytes spill loads", info)
    codes = list(dict.fromkeys(re.findall(r"\((C\d{4})\)", info)))
    return {"registers": int(registers.group(1)) if registers else None,
            "spill_stores": int(stores.group(1)) if stores else 0,
            "spill_loads": int(loads.group(1)) if loads else 0, "advisories": codes,
            "serialized": SERIALIZED in info}


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


def _ptxas_one(path: str) -> dict:
    sys.path.insert(0, str(ROOT / "tools" / "probes"))
    from sass_loops import compile_cubin

    source = Path(path).read_text()
    if source.startswith("ERROR"):
        return {"error": source[:200]}
    with tempfile.TemporaryDirectory() as work:
        try:
            _, info = compile_cubin(source, Path(work))
        except RuntimeError as err:
            return {"error": str(err)[-300:]}
    return parse_ptxas(info)


def ptxas(dump_dir: Path, jobs_n: int) -> int:
    manifest = json.loads((dump_dir / "manifest.json").read_text())
    with ProcessPoolExecutor(jobs_n) as pool:
        reports = list(pool.map(_ptxas_one, [str(dump_dir / f"{i}.cu") for i, _, _ in manifest]))
    serialized = 0
    for (i, job, _), rep in zip(manifest, reports):
        if "error" in rep:
            print(f"{i:3d} {job}: {rep['error']}")
            continue
        serialized += rep["serialized"]
        print(f"{i:3d} {rep['registers']:3d} registers, spills {rep['spill_stores']}/{rep['spill_loads']} B"
              f"{', ' + ' '.join(rep['advisories']) if rep['advisories'] else ''}"
              f"{' WGMMA SERIALISED' if rep['serialized'] else ''}  {job}")
    print(f"{len(manifest)} kernels, {serialized} with their wgmma serialised by ptxas")
    return 1 if serialized else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("out", type=Path)
    d.add_argument("--jobs", type=int, default=2)
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    x = sub.add_parser("ptxas")
    x.add_argument("dump_dir", type=Path)
    x.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    if args.cmd == "dump":
        dump(args.out, args.jobs)
        return 0
    if args.cmd == "ptxas":
        return ptxas(args.dump_dir, args.jobs)
    return compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
