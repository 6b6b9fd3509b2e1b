"""Where the KL-over-slots autograd call's time goes at 4096 x 8192 (bench_peers' inputs): host time
of each piece (GPU drained before each call), GPU time, and a profiler table of one call, for
dsa_ref's autograd call, its kernel alone, and Megatron-LM's autograd bridge (``--peers``).
Prints one JSON object; run on the GPU machine."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_peers as bp  # noqa: E402
sys.path.insert(0, str(ROOT / "tools" / "probes"))
from launch_overhead import host_us  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peers", default=str(ROOT / ".gpu" / "peers"))
    parser.add_argument("--shape", default="4096x8192")
    args = parser.parse_args()
    from dsa_ref.kernels import indexer_loss_slots as kl

    (shape,) = bp.parse_shapes(args.shape)
    x = bp.Inputs(shape, device="cuda")
    logits = x.kl_logits.detach().requires_grad_(True)
    target, valid = x.kl_target, x.kl_valid

    def ours():
        loss = kl.indexer_loss_on_slots_tilelang(logits, target, valid, reduction="sum")
        return torch.autograd.grad(loss, logits)

    def ours_forward():
        return kl.indexer_loss_on_slots_tilelang(logits, target, valid, reduction="sum")

    def ours_apply():
        return torch.autograd.grad(kl.SlotKL.apply(logits, target, valid), logits)

    def kernel_only():
        with torch.no_grad():
            return kl._slot_kl(x.kl_logits, target, valid)

    pieces = {"dsa_ref_autograd": ours, "dsa_ref_forward_only": ours_forward, "dsa_ref_slotkl_apply_grad": ours_apply,
              "dsa_ref__slot_kl": kernel_only}
    try:
        fam = bp.load_family("megatron", Path(args.peers), torch.device("cuda"))
        mod = fam.module("tilelang_indexer_loss")

        def megatron():
            loss = mod.SparseIndexerKLLoss.apply(target, logits, valid)
            return torch.autograd.grad(loss, logits)

        def megatron_kernel():
            with torch.no_grad():
                return mod.sparse_indexer_kl_interface(target, x.kl_logits, valid)

        pieces.update(megatron_autograd=megatron, megatron_kernel=megatron_kernel)
    except Exception as exc:  # noqa: BLE001 - a missing peer is reported, not fatal
        print(f"megatron not loaded: {exc!r}")
    result = {name: {"host_us": host_us(fn), "gpu_ms_b2b": bp.back_to_back_ms(fn, reps=50, warmup=5)} for name, fn in pieces.items()}
    tables = {}
    for name in ("dsa_ref_autograd", "megatron_autograd"):
        if name not in pieces:
            continue
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                pieces[name]()
            torch.cuda.synchronize()
        tables[name] = prof.key_averages().table(sort_by="cpu_time_total", row_limit=18)
    print(json.dumps(result, indent=1))
    for name, table in tables.items():
        print(f"== {name}\n{table}")


if __name__ == "__main__":
    main()
