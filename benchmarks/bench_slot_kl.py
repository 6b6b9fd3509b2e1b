"""The fused KL kernel over the slots: its schedules against each other and against PyTorch.

    python benchmarks/bench_slot_kl.py [--rows 4096,16384] [--topk 2048] [--out bench_slot_kl.json]

Times `indexer_loss_on_slots_tilelang` (loss and gradient: the kernel runs in the forward, the
backward scales the saved gradient) with every schedule of `dsa_ref.kernels.shapes.SLOT_KL_SCHEDULES`
and the reference `indexer_loss_on_slots` under autograd, on the same inputs: causal-like rows
(row ``t`` has ``min(t + 1, K)`` valid slots), random scores, random mass. CUDA events around each
call after an L2 flush, median of ``--repeat``, per call and in GPU time (the GPU spins first so
the host's Python and launches are hidden); the memory the kernel must move (two passes over
``[T, K]`` fp32 scores, mass and bool validity, one fp32 write) over the GPU time gives the
bandwidth. The wrapper's time is also split into the kernel alone, the autograd Function's
forward and the wrapper's forward. Megatron's fused kernel is compared in
`bench_peers.py`.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from dsa_ref.indexer_loss import indexer_loss_on_slots  # noqa: E402
from dsa_ref.kernels import indexer_loss_slots as kl  # noqa: E402
from dsa_ref.kernels.shapes import SLOT_KL_SCHEDULES  # noqa: E402
from bench_kernels import cuda_time_ms  # noqa: E402


def inputs(T: int, K: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.randn(T, K, device="cuda", generator=g) * 3  # [T, K]
    mass = torch.rand(T, K, device="cuda", generator=g)  # [T, K]
    valid = torch.arange(K, device="cuda")[None, :] <= torch.arange(T, device="cuda")[:, None]  # [T, K]
    return scores, mass, valid


def time_ms(fn, repeat: int, *, queue_ahead: bool = False) -> float:
    """`bench_kernels.cuda_time_ms` after an L2 flush before every call (per call, or GPU time alone)."""
    flush = torch.empty(256 * 2 ** 20, dtype=torch.int8, device="cuda")
    return cuda_time_ms(fn, reps=repeat, before_each=flush.zero_, queue_ahead=queue_ahead)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="4096,16384")
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--out", default="bench_slot_kl.json")
    args = parser.parse_args()
    rows = []
    for T in (int(x) for x in args.rows.split(",")):
        scores, mass, valid = inputs(T, args.topk)
        s = scores.clone().requires_grad_(True)
        gbytes = T * args.topk * (2 * 4 + 2 * 4 + 2 * 1 + 4) / 1e9  # two passes over scores, mass, valid; one write

        def run(loss_fn):
            loss = loss_fn(s, mass, valid, reduction="sum")
            return torch.autograd.grad(loss, s)[0]

        ref = run(indexer_loss_on_slots)
        for sched in [dict(block=kl.BLOCK, threads=kl.THREADS)] + SLOT_KL_SCHEDULES:
            kernel = kl.slot_kl_kernel(**sched)
            original = kl.slot_kl_kernel
            kl.slot_kl_kernel = lambda kernel=kernel: kernel  # the wrapper compiles with no arguments
            try:
                got = run(kl.indexer_loss_on_slots_tilelang)
                err = float((got - ref).norm() / ref.norm())
                ms = time_ms(lambda: run(kl.indexer_loss_on_slots_tilelang), args.repeat)
                gpu_ms = time_ms(lambda: run(kl.indexer_loss_on_slots_tilelang), args.repeat, queue_ahead=True)
            finally:
                kl.slot_kl_kernel = original
            rows.append(dict(rows=T, topk=args.topk, impl="kernel", schedule=sched, ms=ms, gpu_ms=gpu_ms,
                             gb_per_s=gbytes / gpu_ms * 1e3, rel_l2_grad=err))
            print(rows[-1], flush=True)
        # where the wrapper's time goes: the kernel alone (outputs allocated once), the autograd
        # Function's forward, the wrapper's forward (checks, reduction), then with the gradient
        kernel = kl.slot_kl_kernel()
        d_buf, kl_buf = torch.empty_like(scores), torch.zeros(T, device="cuda")
        parts = dict(kernel_only=lambda: kernel(scores, mass, valid, d_buf, kl_buf),
                     function_forward=lambda: kl.SlotKL.apply(scores, mass, valid),
                     wrapper_forward=lambda: kl.indexer_loss_on_slots_tilelang(scores, mass, valid, reduction="sum"))
        for name, fn in parts.items():
            with torch.no_grad():
                rows.append(dict(rows=T, topk=args.topk, impl=name, ms=time_ms(fn, args.repeat),
                                 gpu_ms=time_ms(fn, args.repeat, queue_ahead=True)))
            print(rows[-1], flush=True)
        ms = time_ms(lambda: run(indexer_loss_on_slots), args.repeat)
        gpu_ms = time_ms(lambda: run(indexer_loss_on_slots), args.repeat, queue_ahead=True)
        rows.append(dict(rows=T, topk=args.topk, impl="pytorch", ms=ms, gpu_ms=gpu_ms))
        print(rows[-1], flush=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda)
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, results=rows), f, indent=1)


if __name__ == "__main__":
    main()
