"""Where the reference backend's sparse stage spends its time: one training step of `DSAttention`, timed in parts.

    python benchmarks/bench_reference_speed.py --label after --tokens 4096 8192 --out results.json
    python benchmarks/bench_reference_speed.py --label before --code /tmp/old --tokens 4096 --out results.json

A scaled DeepSeek-V3.2 layer on the CPU: the attention's per-slot shapes stay (128 heads, a 576-wide
latent row of which 512 are values, an indexer of 64 heads x 128), the rest shrinks (hidden size
256, query latent 128, top-k 256 by default), float32. One step is the forward and
``output.square().mean().backward()``, every parameter and the input training, as in
`bench_long_context.py`. The parts, by wrapping the layer's calls (wall time, so on a GPU each part
ends with a synchronisation): ``select_s`` (the streamed top-k selection), ``slots_fwd_s`` (attention,
head-summed mass, index scores at the slots and the loss, forward), ``fwd_s`` and ``bwd_s`` (all of it).

``--code DIR`` imports ``dsa_ref`` from ``DIR`` instead (an older checkout, e.g. ``git archive <commit>
dsa_ref | tar -x -C DIR``), so that one script times both sides. Records are appended to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096])
    parser.add_argument("--topk", type=int, default=256)
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--indexer-heads", type=int, default=64)
    parser.add_argument("--stage", default="sparse", choices=("sparse", "dense_warmup"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--label", default="current")
    parser.add_argument("--code", default=None, help="import dsa_ref from this folder (default: this checkout)")
    parser.add_argument("--out", default=None, help="JSON file; records are appended")
    return parser.parse_args()


def main() -> int:
    args = _args()
    code = os.path.abspath(args.code or ROOT)
    sys.path.insert(0, code)
    import torch

    import dsa_ref.dsa as dsa_module
    from dsa_ref import DSAttention
    from dsa_ref.config import DSAConfig, IndexerConfig, MLAConfig, RopeConfig
    from dsa_ref.layout import one_sequence

    assert os.path.abspath(dsa_module.__file__).startswith(code), dsa_module.__file__
    device = torch.device(args.device)
    parts: dict[str, float] = {}

    def timed(name: str, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            if device.type == "cuda":
                torch.cuda.synchronize()
            parts[name] = parts.get(name, 0.0) + time.perf_counter() - t0
            return out
        return wrapper

    dsa_module.streamed_topk_indices = timed("select_s", dsa_module.streamed_topk_indices)
    dsa_module.attention_and_loss_on_slots = timed("slots_fwd_s", dsa_module.attention_and_loss_on_slots)

    rope = RopeConfig(theta=10000.0, factor=40.0, original_max_position=4096, beta_fast=32.0, beta_slow=1.0)
    mla = MLAConfig(dim=256, n_heads=args.heads, q_lora_rank=128, kv_lora_rank=512, qk_nope_head_dim=128,
                    qk_rope_head_dim=64, v_head_dim=128, rope=rope)
    config = DSAConfig(mla=mla, indexer=IndexerConfig(n_heads=args.indexer_heads, head_dim=128, topk=args.topk,
                                                      rope_head_dim=64))
    torch.manual_seed(0)
    layer = DSAttention(config, device=device, dtype=torch.float32)
    try:
        commit = subprocess.run(["git", "-C", code, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    records = []
    for tokens in args.tokens:
        x = torch.randn(tokens, mla.dim, device=device, requires_grad=True)
        cu = one_sequence(tokens, device=device)
        parts.clear()
        t0 = time.perf_counter()
        res = layer(x, cu, stage=args.stage)
        t1 = time.perf_counter()
        res.output.float().square().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        layer.zero_grad(set_to_none=True)
        row = dict(label=args.label, code=code, commit=commit, tokens=tokens, stage=args.stage, topk=args.topk,
                   heads=args.heads, indexer_heads=args.indexer_heads, step_s=t2 - t0, fwd_s=t1 - t0, bwd_s=t2 - t1,
                   **parts)
        print(json.dumps(row), flush=True)
        records.append(row)
        del res, x
    if args.out:
        data = {"meta": {}, "records": []}
        if os.path.exists(args.out):
            with open(args.out) as f:
                data = json.load(f)
        data["meta"].update(script="benchmarks/bench_reference_speed.py", device=str(device), torch=torch.__version__,
                            machine=platform.machine(), cpu_threads=torch.get_num_threads(),
                            config=f"MLA {args.heads} heads, latent 512 + rope 64 (576), d_v 512, indexer "
                                   f"{args.indexer_heads} x 128, top-k {args.topk}, hidden 256, q latent 128, float32",
                            step="forward + output.float().square().mean().backward(), every parameter and x train")
        data["records"].extend(records)
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
