"""Step time of chapter 6's model in each attention mode at one context, and of the attention alone.

    python benchmarks/bench_train_step.py --context 8192 --topk 512 --device cuda --backend tilelang \
        --json build/step_time.json

One training step (forward, backward, AdamW) of `dsa_ref.model.DSALanguageModel` on ``--batch-size``
sequences of ``--context`` tokens, in the modes ``dense`` (the readable chunked dense MLA),
``dense_warmup`` and ``sparse``; then the attention operation alone, forward + backward, for one
layer's shapes: dense causal attention through ``torch.nn.functional.scaled_dot_product_attention``
(FlashAttention on the GPU: the fair dense baseline) against `dsa_ref.sparse_mla` over ``topk``
selected keys through the chosen backend. Median of ``--repeat`` timed runs after ``--warmup``
untimed ones; CUDA is synchronised around each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from dsa_ref import dispatch
from dsa_ref.train import TrainConfig, build_model, make_optimizer, phases, task_batch, train_step


def timed(fn, device: str, warmup: int, repeat: int) -> float:
    """Median seconds of ``fn()`` over ``repeat`` runs after ``warmup`` untimed runs."""
    times = []
    for i in range(warmup + repeat):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def model_steps(cfg: TrainConfig, warmup: int, repeat: int) -> dict:
    """Seconds per training step in each mode (same model, same batch)."""
    out = {}
    batch = task_batch(cfg, 1, cfg.batch_size)
    for phase in phases(cfg)[:3]:  # a_dense, b_warmup, c_sparse: one of each mode
        model = build_model(cfg, 0)
        opt, sched, groups = make_optimizer(model, cfg, phase._replace(steps=10**6))
        seconds = timed(lambda: train_step(model, opt, sched, groups, batch, phase.mode, cfg), cfg.device, warmup, repeat)
        out[phase.mode] = {"seconds_per_step": seconds, "tokens_per_s": batch.tokens.numel() / seconds}
        del model, opt
    return out


def attention_only(cfg: TrainConfig, warmup: int, repeat: int) -> dict:
    """Forward + backward of one layer's attention: SDPA dense causal vs sparse_mla over top-k."""
    mc = cfg.model_config().attention.mla
    dtype = getattr(torch, cfg.attn_dtype)
    L, H, dev = cfg.context, mc.n_heads, cfg.device
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dev, dtype).requires_grad_()

    q, k, v = rnd(1, H, L, mc.qk_head_dim), rnd(1, H, L, mc.qk_head_dim), rnd(1, H, L, mc.v_head_dim)

    def dense():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=mc.softmax_scale)  # [1, H, L, v]
        o.sum().backward()

    q_lat, kv = rnd(L, H, mc.latent_dim), rnd(L, mc.latent_dim)
    # a causal selection: query t takes the topk keys before it (all of them when t < topk)
    t = torch.arange(L, device=dev)[:, None]
    j = torch.arange(cfg.topk, device=dev)[None, :]
    idx = torch.where(j <= t, t - j, torch.full_like(t - j, -1))  # [L, topk]

    def sparse():
        o, _ = dispatch.sparse_mla(q_lat, kv, idx, sm_scale=mc.softmax_scale, d_v=mc.kv_lora_rank,
                                   backend=cfg.backend)  # [L, H, r]
        o.float().sum().backward()

    return {"dense_sdpa_seconds": timed(dense, dev, warmup, repeat),
            "sparse_mla_seconds": timed(sparse, dev, warmup, repeat)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", metavar="JSON", help="a config.json of dsa-ref train (its model and task)")
    parser.add_argument("--context", type=int)
    parser.add_argument("--topk", type=int)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--device")
    parser.add_argument("--backend")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", metavar="PATH", help="also write the result here")
    args = parser.parse_args(argv)
    fields = json.load(open(args.config)) if args.config else {}
    for name in ("context", "topk", "batch_size", "device", "backend"):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    if fields.get("backend") == "tilelang":
        fields.setdefault("attn_dtype", "bfloat16")
    cfg = TrainConfig(**fields)
    result = {"context": cfg.context, "topk": cfg.topk, "batch_size": cfg.batch_size, "device": cfg.device,
              "backend": cfg.backend, "attn_dtype": cfg.attn_dtype, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if cfg.device.startswith("cuda") else None,
              "train_step": model_steps(cfg, args.warmup, args.repeat),
              "attention_fwd_bwd": attention_only(cfg, args.warmup, args.repeat)}
    steps = result["train_step"]
    result["sparse_over_dense_step"] = steps["sparse"]["seconds_per_step"] / steps["dense"]["seconds_per_step"]
    att = result["attention_fwd_bwd"]
    result["sparse_over_sdpa_attention"] = att["sparse_mla_seconds"] / att["dense_sdpa_seconds"]
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
