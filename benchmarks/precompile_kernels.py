"""Compile every TileLang kernel the GPU tests and benchmarks use, in parallel processes.

    python benchmarks/precompile_kernels.py [--jobs N]

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
    from dsa_ref.kernels.shapes import build

    t0 = time.time()
    build(*job)
    return job, time.time() - t0


def main() -> int:
    from dsa_ref.kernels.shapes import kernel_set

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1))
    args = parser.parse_args()
    jobs = kernel_set()
    t0 = time.time()
    failed = 0
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(_build, job): job for job in jobs}
        for fut in as_completed(futures):
            job = futures[fut]
            try:
                _, seconds = fut.result()
                print(f"compiled {job[0]:18s} {job[1]}  {seconds:6.1f} s", flush=True)
            except Exception as err:  # report every failure, then fail
                failed += 1
                print(f"FAILED   {job[0]:18s} {job[1]}: {type(err).__name__}: {str(err)[-2000:]}", flush=True)
    print(f"{len(jobs) - failed}/{len(jobs)} kernels in {time.time() - t0:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
