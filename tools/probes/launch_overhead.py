"""Where the forward call's time goes at 4096 queries x 8192 keys: host time of each step, and GPU
time of the index-range reductions. Prints one JSON object; run on the GPU machine."""

import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

from bench_kernels import H, cuda_time_ms, shape_inputs  # noqa: E402
from dsa_ref.kernels import sparse_mla_fwd  # noqa: E402
from dsa_ref.kernels.autograd import _block_counts, _pad_indices, sparse_mla_tilelang  # noqa: E402
from dsa_ref.kernels.shapes import DIM, DIM_V, SM_SCALE  # noqa: E402


def host_us(fn, reps=50):
    """Median host time of one call in microseconds, the GPU drained before each."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def main():
    x = shape_inputs(4096, 8192)
    q, kv, idx = x["q"], x["kv"], x["idx"]
    idx32 = idx.to(torch.int32)
    kernel = sparse_mla_fwd.warp_specialized_kernel(H, DIM, DIM_V, SM_SCALE)
    idx_ws = _pad_indices(idx, 128)
    pairs = _block_counts(idx_ws, 128)
    res = {"idx_dtype": str(idx.dtype)}
    with torch.no_grad():
        steps = {
            "kernel": lambda: kernel(q, kv, idx_ws, pairs),
            "call_validate": lambda: sparse_mla_tilelang(q, kv, idx, sm_scale=SM_SCALE, d_v=DIM_V),
            "call_unchecked": lambda: sparse_mla_tilelang(q, kv, idx, sm_scale=SM_SCALE, d_v=DIM_V, validate=False),
            "call_unchecked_int32": lambda: sparse_mla_tilelang(q, kv, idx32, sm_scale=SM_SCALE, d_v=DIM_V,
                                                                validate=False),
            "pad_indices": lambda: _pad_indices(idx, 128),
            "block_counts": lambda: _block_counts(idx_ws, 128),
            "aminmax": lambda: torch.stack(torch.aminmax(idx)),
            "min_max": lambda: torch.stack([idx.min(), idx.max()]),
            "empty_like": lambda: torch.empty(4096, 128, 512, device="cuda", dtype=torch.bfloat16),
        }
        for name, fn in steps.items():
            res["host_us_" + name] = host_us(fn)
        for name in ("kernel", "call_validate", "call_unchecked", "call_unchecked_int32"):
            res["per_call_ms_" + name] = cuda_time_ms(steps[name], reps=30, queue_ahead=False)
            res["gpu_ms_" + name] = cuda_time_ms(steps[name], reps=30, queue_ahead=True)
        for name in ("pad_indices", "block_counts", "aminmax", "min_max"):
            res["gpu_ms_" + name] = cuda_time_ms(steps[name], reps=30, queue_ahead=True)
        res["gpu_ms_aminmax_int32"] = cuda_time_ms(lambda: torch.stack(torch.aminmax(idx32)), reps=30, queue_ahead=True)
        res["gpu_ms_min_max_int32"] = cuda_time_ms(lambda: torch.stack([idx32.min(), idx32.max()]), reps=30,
                                                   queue_ahead=True)
        # the kernel twice back to back: does the second launch pay the same?
        twice = lambda: (kernel(q, kv, idx_ws, pairs), kernel(q, kv, idx_ws, pairs))  # noqa: E731
        res["per_call_ms_kernel_x2"] = cuda_time_ms(twice, reps=30, queue_ahead=False)
        # ten launches back to back between one pair of events: the sustained rate, no host gap
        ten = lambda: [kernel(q, kv, idx_ws, pairs) for _ in range(10)]  # noqa: E731
        res["sustained_ms_kernel"] = cuda_time_ms(ten, reps=10, queue_ahead=False) / 10
        res["sustained_ms_call_unchecked"] = cuda_time_ms(
            lambda: [steps["call_unchecked"]() for _ in range(10)], reps=10, queue_ahead=False) / 10
        res["sustained_ms_call_validate"] = cuda_time_ms(
            lambda: [steps["call_validate"]() for _ in range(10)], reps=10, queue_ahead=False) / 10
    prof_rows = []
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                             torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            torch.cuda.synchronize()
            sparse_mla_tilelang(q, kv, idx, sm_scale=SM_SCALE, d_v=DIM_V)
        torch.cuda.synchronize()
    for evt in prof.key_averages():
        gpu_us = getattr(evt, "device_time_total", 0)
        prof_rows.append((evt.key, round(evt.cpu_time_total / 5, 1), round(gpu_us / 5, 1)))  # per call
    prof_rows.sort(key=lambda r: -r[1])
    res["profile_per_call_cpu_us_gpu_us"] = prof_rows[:25]
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
