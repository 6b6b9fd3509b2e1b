"""Peak memory and time of the *reference* DSA layer, forward + backward, chunked and unchunked.

The readable reference bounds its memory in two ways (see the chapter on sparse attention and the
loss): every function that would build a ``[T, H, S]`` block works through the queries in chunks,
and each chunk runs under activation checkpointing. This script measures what that buys.

    python benchmarks/bench_reference_memory.py --device cpu --quick   # < 1 min on a laptop CPU
    python benchmarks/bench_reference_memory.py --device cpu           # more lengths, 3 repeats
    python benchmarks/bench_reference_memory.py --device cuda          # DeepSeek-V3.2 shapes, bf16

What is measured, per setting, each in a fresh child process:

* ``layer``: one training step of `DSAttention` (forward, then ``output.backward(dout)``) in either
  stage. ``dense_warmup`` trains the indexer only (the rest of the layer is frozen and ``x`` needs no
  gradient, as in DeepSeek-V3.2's warm-up); ``sparse`` trains every parameter and ``x``. Modes:

  - ``layer``: `DSAttention.forward` itself, whose functions pick their own chunk sizes;
  - ``chunk<C>``: the same computation with every function given ``chunk_size=C``;
  - ``unchunked``: every function given ``chunk_size=T``: one chunk, hence no checkpointing.

  `DSAttention` does not take a ``chunk_size``, so the last two run `dsa_step` below: the layer's
  ``attend`` written out with an explicit ``chunk_size``. The script checks first that
  ``dsa_step(chunk_size=None)`` gives exactly what `DSAttention` gives (output, loss, gradients).
* ``loss``: the indexer KL loss alone, forward + backward with respect to the index scores:
  `indexer_loss` with ``chunk_size=C`` (and with its default) against `indexer_loss_plain`, which
  holds ``[H, T, S]`` at once.

Memory: on CUDA the peak of ``torch.cuda.max_memory_allocated`` during the timed steps minus what
was allocated before them (weights, inputs), and the absolute peak. On CPU the peak resident set
(``VmHWM``, reset through ``/proc/self/clear_refs``) minus the resident set before the timed steps;
glibc's mmap threshold is fixed low before the children are forked, so freed blocks go back to the
system and the resident set follows the live tensors. Time: CUDA events on the GPU, ``perf_counter`` on the CPU;
the median of the timed steps after the warm-up steps.

Output: a JSON file with one record per setting and a markdown table (``--out``, default
``build/bench/reference_memory_<device>.{json,md}``), written again after every setting.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a checkout without installing the package

import torch  # noqa: E402

from dsa_ref import DSAConfig, DSAttention, IndexerConfig, MLAConfig, deepseek_v32, tiny  # noqa: E402
from dsa_ref.attention import DEFAULT_CHUNK_ELEMENTS, auto_chunk_size, dense_mla_attention  # noqa: E402
from dsa_ref.dsa import DSAOutput, IndexerLossAutoScaler  # noqa: E402
from dsa_ref.indexer import lightning_indexer, topk_indices  # noqa: E402
from dsa_ref.indexer_loss import indexer_loss, indexer_loss_plain  # noqa: E402
from dsa_ref.layout import key_windows, one_sequence, positions  # noqa: E402
from dsa_ref.sparse_attention import sparse_mla  # noqa: E402

GiB = 2**30
_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


# ---------------------------------------------------------------------------------------------
# Configurations


def mid() -> DSAConfig:
    """A CPU-sized layer between tiny() and DeepSeek-V3.2, with V3.2's ratios.

    16 heads, latent 128 = 4 x nope 32, rope 16 = nope / 2, indexer 8 heads x 32, top-k 128,
    V3.2's RoPE/YaRN settings.
    """
    rope = deepseek_v32().mla.rope
    mla = MLAConfig(dim=512, n_heads=16, q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=32,
                    qk_rope_head_dim=16, v_head_dim=32, rope=rope)
    return DSAConfig(mla=mla, indexer=IndexerConfig(n_heads=8, head_dim=32, topk=128, rope_head_dim=16))


def make_config(name: str, dim: int | None = None) -> DSAConfig:
    cfg = {"tiny": tiny, "mid": mid, "deepseek_v32": deepseek_v32}[name]()
    if dim is not None:  # a smaller hidden size keeps the weights small; attention shapes are unchanged
        cfg = replace(cfg, mla=replace(cfg.mla, dim=dim))
    return cfg


# ---------------------------------------------------------------------------------------------
# The layer with an explicit chunk size


def dsa_step(layer: DSAttention, x: torch.Tensor, cu_seqlens: torch.Tensor, *, stage: str,
             chunk_size: int | None) -> DSAOutput:
    """`DSAttention.attend` (single process, no CP) with ``chunk_size`` passed to every chunked function.

    ``chunk_size=None`` lets each function choose, exactly as `DSAttention` does; ``chunk_size=T``
    runs every function as one chunk (no checkpointing). `self_check` compares this with the layer.
    """
    cfg = layer.config
    sm_scale, d_v = layer.mla.softmax_scale, cfg.mla.kv_lora_rank
    query_index = torch.arange(x.shape[0], device=x.device)
    pos = positions(cu_seqlens, query_index)
    starts, ends = key_windows(cu_seqlens, query_index)
    p = layer.mla.project(x, pos)
    q, kv = layer.absorbed.absorbed_qkv(p)
    q_i, k_i, w_i = layer.indexer.project(x.detach(), p.qr.detach(), pos)
    scores = lightning_indexer(q_i, k_i, w_i, starts=starts, ends=ends, chunk_size=chunk_size)
    topk = topk_indices(scores.detach(), cfg.indexer.topk, chunk_size=chunk_size)
    if stage == "dense_warmup":
        o_latent, _ = dense_mla_attention(q, kv, sm_scale=sm_scale, d_v=d_v, starts=starts, ends=ends,
                                          chunk_size=chunk_size)
    else:
        o_latent, _ = sparse_mla(q, kv, topk, sm_scale=sm_scale, d_v=d_v, chunk_size=chunk_size)
    loss = indexer_loss(scores, q.detach(), kv.detach(), sm_scale=sm_scale, starts=starts, ends=ends,
                        topk_indices=None if stage == "dense_warmup" else topk,
                        reduction=layer.loss_reduction, coeff=layer.loss_coeff, chunk_size=chunk_size)
    out = layer.absorbed.output(o_latent)
    if torch.is_grad_enabled() and loss.requires_grad:
        out = IndexerLossAutoScaler.apply(out, loss, layer.loss_scale)
    return DSAOutput(out, loss, topk)


def self_check(device: str = "cpu") -> None:
    """`dsa_step(chunk_size=None)` must equal `DSAttention` exactly; small chunks must agree closely."""
    torch.manual_seed(0)
    cfg = tiny()
    T = 40
    cu = torch.tensor([0, 16, T], device=device)
    for stage in ("dense_warmup", "sparse"):
        results = []
        for runner in ("layer", None, 7):
            torch.manual_seed(0)
            layer = DSAttention(cfg, stage=stage).to(device)
            x = torch.randn(T, cfg.mla.dim, device=device, requires_grad=True)
            res = layer(x, cu) if runner == "layer" else dsa_step(layer, x, cu, stage=stage, chunk_size=runner)
            res.output.backward(torch.ones_like(res.output))
            grads = [x.grad] + [prm.grad for prm in layer.parameters()]
            results.append((res.output.detach(), res.indexer_loss.detach(), res.topk_indices, grads))
        (o0, l0, t0, g0), (o1, l1, t1, g1), (o2, l2, t2, g2) = results
        assert torch.equal(o0, o1) and torch.equal(l0, l1) and torch.equal(t0, t1), stage
        assert all(torch.equal(a, b) for a, b in zip(g0, g1)), stage
        torch.testing.assert_close(o2, o0, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(l2, l0, rtol=1e-4, atol=1e-6)
        assert torch.equal(t2, t0), stage
        for a, b in zip(g2, g0):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Memory probes


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


class CpuMemory:
    """Peak resident set above a baseline, via VmHWM reset by /proc/self/clear_refs (Linux >= 4.0)."""

    def start(self) -> None:
        import gc

        gc.collect()
        self.base = _status_kib("VmRSS") * 1024
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the high-water mark to the current resident set
            self.exact = True
        except OSError:  # pragma: no cover - not Linux or not allowed: the peak may include earlier ones
            self.exact = False

    def stop(self) -> dict:
        peak = _status_kib("VmHWM") * 1024
        return {"peak_bytes": peak, "peak_delta_bytes": max(0, peak - self.base), "base_bytes": self.base,
                "peak_exact": self.exact}


class CudaMemory:
    def start(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self.base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()

    def stop(self) -> dict:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        return {"peak_bytes": peak, "peak_delta_bytes": peak - self.base, "base_bytes": self.base,
                "peak_exact": True, "reserved_peak_bytes": torch.cuda.max_memory_reserved()}


class Timer:
    def __init__(self, device: str):
        self.cuda = device == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms(self, a, b) -> float:
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b)
        return (b - a) * 1e3


# ---------------------------------------------------------------------------------------------
# One setting, in a child process


def run_setting(setting: dict) -> dict:
    """Build the inputs of one setting, run warm-up + timed steps, return times and memory."""
    device = setting["device"]
    dtype = getattr(torch, setting["dtype"])
    if device == "cpu":
        torch.set_num_threads(setting["threads"])
    if setting.get("tf32"):
        torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(0)
    cfg = make_config(setting["config"], setting.get("dim"))
    T = setting["T"]
    timer = Timer(device)
    memory = CudaMemory() if device == "cuda" else CpuMemory()
    info: dict = {}

    if setting["kind"] == "layer":
        stage, mode = setting["stage"], setting["mode"]
        layer = DSAttention(cfg, stage=stage, device=device, dtype=dtype)
        train_all = stage == "sparse"
        for prm in layer.parameters():
            prm.requires_grad_(train_all)
        for prm in layer.trainable_parameters(stage):
            prm.requires_grad_(True)
        x = torch.randn(T, cfg.mla.dim, device=device, dtype=dtype).requires_grad_(train_all)
        cu = one_sequence(T, device=device)
        dout = torch.randn(T, cfg.mla.dim, device=device, dtype=dtype)
        chunk = {"layer": None, "unchunked": T}.get(mode) or (int(mode[5:]) if mode.startswith("chunk") else None)
        H = cfg.mla.n_heads
        info["auto_chunk_rows"] = auto_chunk_size(T, H * T)  # what the layer's attention/loss choose by itself

        def clear():
            layer.zero_grad(set_to_none=True)
            x.grad = None

        def step():
            clear()
            t0 = timer.mark()
            res = layer(x, cu) if mode == "layer" else dsa_step(layer, x, cu, stage=stage, chunk_size=chunk)
            t1 = timer.mark()
            res.output.backward(dout)
            t2 = timer.mark()
            return t0, t1, t2, res.indexer_loss.detach()

    elif setting["kind"] == "loss":
        mode, stage = setting["mode"], setting["stage"]
        H, D = cfg.mla.n_heads, cfg.mla.latent_dim
        q = torch.randn(T, H, D, device=device, dtype=dtype)
        kv = torch.randn(T, D, device=device, dtype=dtype)
        index_scores = torch.randn(T, T, device=device, dtype=torch.float32, requires_grad=True)
        starts, ends = key_windows(one_sequence(T, device=device))
        sel = topk_indices(index_scores.detach().masked_fill(
            torch.arange(T, device=device)[None, :] >= ends[:, None], float("-inf")), cfg.indexer.topk)
        sel = sel if stage == "sparse" else None
        sm_scale = cfg.mla.softmax_scale
        info["auto_chunk_rows"] = auto_chunk_size(T, H * T)

        def clear():
            index_scores.grad = None

        def step():
            clear()
            t0 = timer.mark()
            if mode == "plain":
                loss = indexer_loss_plain(index_scores, q, kv, sm_scale=sm_scale, starts=starts, ends=ends,
                                          topk_indices=sel)
            else:
                chunk = None if mode == "chunked-auto" else int(mode[5:])
                loss = indexer_loss(index_scores, q, kv, sm_scale=sm_scale, starts=starts, ends=ends,
                                    topk_indices=sel, chunk_size=chunk)
            t1 = timer.mark()
            loss.backward()
            t2 = timer.mark()
            return t0, t1, t2, loss.detach()
    else:
        raise ValueError(f"unknown kind {setting['kind']!r}")

    if device == "cuda":
        info["device_name"] = torch.cuda.get_device_name()
    for _ in range(setting["warmup"]):
        step()
    clear()  # gradients of the warm-up step are not part of the baseline
    memory.start()
    fwd, bwd, losses = [], [], []
    for _ in range(setting["repeats"]):
        t0, t1, t2, loss = step()
        fwd.append(timer.ms(t0, t1))
        bwd.append(timer.ms(t1, t2))
        losses.append(float(loss))
    mem = memory.stop()
    total = [a + b for a, b in zip(fwd, bwd)]
    return {"status": "ok", "fwd_ms": statistics.median(fwd), "bwd_ms": statistics.median(bwd),
            "step_ms": statistics.median(total), "loss": losses[-1], **mem, **info}


def _child(setting: dict, queue) -> None:
    try:
        queue.put(run_setting(setting))
    except _OOM as err:
        queue.put({"status": "oom", "error": str(err).splitlines()[0][:300]})
    except Exception as err:  # report, do not hang the parent
        queue.put({"status": "error", "error": f"{type(err).__name__}: {err}"[:500]})


def measure(setting: dict, timeout: float) -> dict:
    """Run one setting in a fresh process: fork on CPU (no second torch import), spawn on CUDA."""
    method = "spawn" if setting["device"] == "cuda" else "fork"
    ctx = mp.get_context(method)
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(setting, queue))
    start = time.perf_counter()
    proc.start()
    result = None
    deadline = start + timeout
    while result is None and time.perf_counter() < deadline:
        try:
            result = queue.get(timeout=min(1.0, max(0.01, deadline - time.perf_counter())))
        except Exception:  # queue.Empty
            if not proc.is_alive() and queue.empty():
                break
    if result is None:
        if proc.is_alive():
            proc.terminate()
            result = {"status": "timeout", "error": f"no result after {timeout:.0f} s"}
        else:
            code = proc.exitcode
            why = "killed (out of host memory?)" if code in (-9, 137) else f"exit code {code}"
            result = {"status": "died", "error": why}
    proc.join(timeout=30)
    result["wall_s"] = round(time.perf_counter() - start, 2)
    return result


# ---------------------------------------------------------------------------------------------
# Plans


def plan(args) -> list[dict]:
    cpu = args.device == "cpu"
    base = dict(device=args.device, dtype=args.dtype, warmup=args.warmup, repeats=args.repeats,
                threads=args.threads, tf32=args.tf32, config=args.config, dim=args.dim)
    settings = []
    if args.modes:
        layer_modes = args.modes
    elif cpu:  # at CPU sizes the layer's own chunk choice is one chunk: force a small one as well
        layer_modes = [f"chunk{args.chunk}", "unchunked"] + ([] if args.quick else ["layer"])
    else:
        layer_modes = ["layer", "unchunked"]
    loss_modes = [f"chunk{args.chunk}", "chunked-auto", "plain"]
    for T in args.seqlens:
        for stage in args.stages:
            if "layer" in args.kinds:
                for mode in layer_modes:
                    settings.append(dict(base, kind="layer", T=T, stage=stage, mode=mode))
    for T in args.loss_seqlens:
        for stage in args.loss_stages:
            if "loss" in args.kinds:
                for mode in loss_modes:
                    settings.append(dict(base, kind="loss", T=T, stage=stage, mode=mode))
    return settings


def _fmt_bytes(b: int) -> str:
    return f"{b / GiB:.2f} GiB" if b >= 0.1 * GiB else f"{b / 2**20:.1f} MiB"


def markdown(records: list[dict], header: dict) -> str:
    lines = [f"# Reference DSA memory and time ({header['device_name']})", "",
             f"config `{header['config']}` ({header['config_note']}), dtype {header['dtype']}, "
             f"torch {header['torch']}, {header['threads_note']}; time = median of {header['repeats']} step(s) "
             f"after {header['warmup']} warm-up step(s); peak = {header['peak_note']}.", ""]
    for kind, title in (("layer", "DSAttention forward + backward"),
                        ("loss", "indexer loss alone, forward + backward w.r.t. the index scores")):
        rows = [r for r in records if r["kind"] == kind]
        if not rows:
            continue
        lines += [f"## {title}", "",
                  "| T | stage | mode | status | peak above baseline | absolute peak | fwd ms | bwd ms | step ms |",
                  "|---:|---|---|---|---:|---:|---:|---:|---:|"]
        for r in rows:
            cells = [str(r["T"]), r["stage"], r["mode"], r["status"]]
            if r.get("status") == "ok":
                cells += [_fmt_bytes(r["peak_delta_bytes"]), _fmt_bytes(r["peak_bytes"]),
                          f"{r['fwd_ms']:.1f}", f"{r['bwd_ms']:.1f}", f"{r['step_ms']:.1f}"]
            else:
                cells += ["—"] * 5
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--quick", action="store_true", help="fewer lengths and repeats (CPU: < 1 minute)")
    parser.add_argument("--config", choices=("tiny", "mid", "deepseek_v32"), default=None,
                        help="default: mid on CPU, deepseek_v32 on CUDA")
    parser.add_argument("--dim", type=int, default=None,
                        help="override the hidden size (smaller weights; attention shapes unchanged)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--seqlens", type=int, nargs="+", default=None, help="layer sequence lengths")
    parser.add_argument("--loss-seqlens", type=int, nargs="+", default=None, help="loss-only sequence lengths")
    parser.add_argument("--stages", nargs="+", choices=("dense_warmup", "sparse"), default=["dense_warmup", "sparse"])
    parser.add_argument("--loss-stages", nargs="+", choices=("dense_warmup", "sparse"), default=None,
                        help="stages of the loss-only runs (default: --stages; --quick: dense_warmup)")
    parser.add_argument("--kinds", nargs="+", choices=("layer", "loss"), default=["layer", "loss"])
    parser.add_argument("--modes", nargs="+", default=None,
                        help="layer modes: layer, unchunked, chunk<C> (default: CPU chunk<C> unchunked [layer]; "
                             "CUDA layer unchunked)")
    parser.add_argument("--chunk", type=int, default=64, help="C of the chunk<C> modes")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per child (default 1)")
    parser.add_argument("--tf32", action="store_true", help="allow TF32 for float32 matmuls on CUDA")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per setting")
    parser.add_argument("--keep-going-after-oom", action="store_true",
                        help="unchunked/plain: also try longer T after an out-of-memory")
    parser.add_argument("--out", type=Path, default=None, help="output stem (.json and .md are added)")
    parser.add_argument("--no-self-check", action="store_true")
    args = parser.parse_args(argv)

    cpu = args.device == "cpu"
    if not cpu and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    args.config = args.config or ("mid" if cpu else "deepseek_v32")
    args.dtype = args.dtype or ("float32" if cpu else "bfloat16")
    if args.seqlens is None:
        args.seqlens = ([256, 512] if args.quick else [512, 1024, 2048]) if cpu else \
            ([4096, 8192] if args.quick else [4096, 8192, 16384, 32768])
    if args.loss_seqlens is None:
        args.loss_seqlens = ([256, 512, 1024] if args.quick else [512, 1024, 2048, 4096]) if cpu else \
            ([4096] if args.quick else [4096, 8192])
    if args.loss_stages is None:
        args.loss_stages = ["dense_warmup"] if args.quick else args.stages
    args.warmup = args.warmup if args.warmup is not None else 1
    args.repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    args.timeout = args.timeout or (120.0 if cpu else 900.0)
    out = args.out or ROOT / "build" / "bench" / f"reference_memory_{args.device}"
    out.parent.mkdir(parents=True, exist_ok=True)

    cfg = make_config(args.config, args.dim)
    header = {
        "device": args.device,
        "device_name": "CUDA" if not cpu else f"CPU {platform.machine()}, {os.cpu_count()} cores",
        "config": args.config, "config_detail": {k: v for k, v in asdict(cfg).items()},
        "config_note": (f"H={cfg.mla.n_heads}, latent {cfg.mla.latent_dim}, d_v {cfg.mla.kv_lora_rank}, "
                        f"indexer {cfg.indexer.n_heads}x{cfg.indexer.head_dim}, topk {cfg.indexer.topk}, "
                        f"dim {cfg.mla.dim}" + ("" if args.dim is None else " (reduced hidden size)")),
        "dtype": args.dtype, "torch": torch.__version__, "python": platform.python_version(),
        "warmup": args.warmup, "repeats": args.repeats, "tf32": args.tf32,
        "threads_note": f"{args.threads} CPU thread(s)" if cpu else ("TF32 allowed" if args.tf32 else "TF32 off"),
        "peak_note": ("torch.cuda.max_memory_allocated" if not cpu else
                      "VmHWM of the child, reset before the timed steps, minus its VmRSS then"),
        "default_chunk_elements": DEFAULT_CHUNK_ELEMENTS,
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
    }
    settings = plan(args)
    if cpu:  # before the first fork, so that every child inherits it
        _glibc_mmap_threshold(2**20)
    # The parent never touches CUDA (children are spawned) and runs CPU work on one thread only, so
    # that forked CPU children inherit no OpenMP thread pool; its CPU work also warms up the lazy
    # initialisation of torch's operators, which forked children then need not repeat.
    torch.set_num_threads(1)
    if not args.no_self_check:
        self_check("cpu")
        print("self-check: dsa_step(chunk_size=None) == DSAttention exactly (output, loss, top-k, gradients), "
              "both stages; chunk_size=7 agrees to rounding")
    records: list[dict] = []
    failed: set[tuple] = set()
    print(f"{len(settings)} settings -> {out}.json / .md")
    for setting in settings:
        key = (setting["kind"], setting["stage"], setting["mode"])
        if key in failed and setting["mode"] in ("unchunked", "plain") and not args.keep_going_after_oom:
            result = {"status": "skipped", "error": "out of memory at a shorter T"}
        else:
            result = measure(setting, args.timeout)
            if result["status"] in ("oom", "died"):
                failed.add(key)
        record = {**{k: setting[k] for k in ("kind", "T", "stage", "mode")}, **result}
        records.append(record)
        if result["status"] == "ok":
            print(f"{record['kind']:<5} T={record['T']:<6} {record['stage']:<12} {record['mode']:<12} "
                  f"peak +{result['peak_delta_bytes'] / GiB:8.3f} GiB  step {result['step_ms']:9.1f} ms"
                  f"  ({result['wall_s']} s)", flush=True)
        else:
            print(f"{record['kind']:<5} T={record['T']:<6} {record['stage']:<12} {record['mode']:<12} "
                  f"{result['status']}: {result.get('error', '')}", flush=True)
        if "device_name" in result:
            header["device_name"] = result["device_name"]
        Path(f"{out}.json").write_text(json.dumps({"header": header, "records": records}, indent=1))
        Path(f"{out}.md").write_text(markdown(records, header))
    print()
    print(markdown(records, header))
    return 0


def _glibc_mmap_threshold(nbytes: int) -> None:
    """Serve every allocation above ``nbytes`` with mmap, so that free() returns it to the system.

    Without this, glibc raises its mmap threshold dynamically and keeps freed blocks in the heap,
    and the resident set stops following the live tensors. Applies to this process (and so to the
    forked children); a no-op where glibc's mallopt is not available.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        M_MMAP_THRESHOLD, M_TRIM_THRESHOLD = -3, -1
        libc.mallopt(M_MMAP_THRESHOLD, nbytes)
        libc.mallopt(M_TRIM_THRESHOLD, nbytes)
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        pass


if __name__ == "__main__":
    sys.exit(main())
