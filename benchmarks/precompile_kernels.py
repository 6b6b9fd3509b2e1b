"""Compile every TileLang kernel the GPU tests and benchmarks use, in parallel processes.

    python benchmarks/precompile_kernels.py [--jobs N] [--tune] [--only indexer,indexer_fp8]

TileLang keeps compiled kernels in its disk cache (``~/.tilelang/cache``), so later processes
load them in milliseconds. Set ``DSA_REF_TILELANG_ARCH=sm_90a`` to compile for Hopper on a machine
without a GPU (nvcc is enough).
"""

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def _build(job):
    """Compile one job in a worker; a compiler error comes back as text (TileLang's errors do not
    pickle, and an exception that cannot cross the process boundary would break the whole pool)."""
    from dsa_ref.kernels.shapes import build

    t0 = time.time()
    try:
        build(*job)
    except Exception as err:  # noqa: BLE001 - reported and counted by the caller
        return job, time.time() - t0, f"{type(err).__name__}: {str(err)[-2000:]}"
    return job, time.time() - t0, None


def main() -> int:
    from dsa_ref.kernels.shapes import kernel_set

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1))
    parser.add_argument("--tune", action="store_true", help="also the variants of benchmarks/tune_kernels.py")
    parser.add_argument("--only", default="", help="comma list of builder names (e.g. indexer,indexer_fp8): only those")
    args = parser.parse_args()
    jobs = kernel_set()
    if args.tune:
        sys.path.insert(0, os.path.dirname(__file__))
        from tune_kernels import variant_builds

        jobs += variant_builds()
    if args.only:
        jobs = [job for job in jobs if job[0] in args.only.split(",")]
    # one process per kernel: a schedule listed twice (a default that is also a tested schedule, a
    # tuning variant that is also in the test set) would be compiled twice, at the same time
    jobs = list({repr(job): job for job in jobs}.values())
    t0 = time.time()
    failed = 0
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(_build, job): job for job in jobs}
        for fut in as_completed(futures):
            job = futures[fut]
            try:
                _, seconds, error = fut.result()
            except Exception as err:  # the worker itself died
                seconds, error = 0.0, f"{type(err).__name__}: {err}"
            if error is None:
                print(f"compiled {job[0]:18s} {job[1:]}  {seconds:6.1f} s", flush=True)
            else:  # report every failure, then fail
                failed += 1
                print(f"FAILED   {job[0]:18s} {job[1:]}: {error}", flush=True)
    print(f"{len(jobs) - failed}/{len(jobs)} kernels in {time.time() - t0:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
