r"""Chapter 6, part 3: DSA's training recipe, as phases, with two controls.

DeepSeek-V3.2 turns a dense model into a sparse one in two stages (section 2.1 of its report).
Here the same recipe runs on a small `dsa_ref.model.DSALanguageModel` and a task of
`dsa_ref.tasks`, as **phases** that branch from checkpoints:

| phase | model mode | what learns |
|---|---|---|
| (a) dense | ``"dense"`` | every parameter except the indexers, from the LM loss |
| (b) warm-up | ``"dense_warmup"`` | only the indexers, from the dense KL loss; the rest is frozen |
| (c) sparse | ``"sparse"`` | the model from the LM loss; the indexers from the sparse KL (their inputs detached), in one backward |

The four **runs** of a seed share phase (a), trained once:

* ``dense`` -- the model after (a);
* ``dsa`` -- (a), then (b), then (c): the recipe;
* ``dsa_no_warmup`` -- (a), then sparse training for the steps of (b) + (c), from an untrained indexer;
* ``dense_continued`` -- (a), then dense training for the steps of (b) + (c).

The two controls spend the same number of steps after (a) as the recipe does.

Every phase uses AdamW with a linear warm-up and a cosine decay to 10 % of its peak learning rate,
and clips the gradient norm of the main model and of the indexers separately. Batches are
generated from ``(seed, phase, step)``, so a phase restarted from a checkpoint sees the batches an
uninterrupted one sees: resuming is exact (bitwise on the CPU).

Outputs in ``out``: ``config.json``, ``log.jsonl`` (one JSON object per evaluation: ``run``,
``seed``, ``phase``, ``step`` and the metrics), ``summary.json`` (final metrics of the four runs per
seed, their mean and spread), ``curves.png`` and ``checkpoints/seed<N>/<phase>.pt``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .config import DSAConfig, IndexerConfig, MLAConfig, RopeConfig
from .dispatch import check_backend
from .indexer_loss import indexer_target
from .layout import key_windows, positions
from .model import DSALanguageModel, ModelConfig, count_parameters, sequence_groups
from .tasks import IGNORE, check_task, make_batch

__all__ = ["TrainConfig", "Phase", "RUNS", "phases", "build_model", "train", "evaluate", "train_step", "compute_gradients",
           "make_optimizer", "summarise", "plot_curves"]


# --8<-- [start:train_config]
@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run depends on (written to ``config.json``; ``--resume`` reads it back).

    Task: ``task``, ``context`` (tokens per sequence), ``num_pairs``, ``vocab_size``.
    Model: ``n_layers``, ``dim``, ``n_heads``, ``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``,
    ``qk_rope_head_dim``, ``v_head_dim``, ``index_n_heads``, ``index_head_dim``, ``topk``, ``mlp_hidden``,
    ``token_shift`` (see `dsa_ref.model.ModelConfig`).
    Curriculum: the first ``short_context_steps`` steps of phase (a) train on sequences of
    ``short_context`` tokens, with as many tokens per batch as the long steps (``batch_size *
    context // short_context`` sequences): a sequence-length warm-up. A small model finds the
    recall mechanism much sooner on short sequences, and the mechanism carries over to long ones.
    Recipe: steps of the phases (``steps_dense``, ``steps_warmup``, ``steps_sparse``), peak learning
    rates (``lr`` for the model in (a) and the dense control, ``lr_sparse`` for the model in (c),
    ``lr_indexer`` for the indexers in (b) and (c)), ``warmup_fraction`` of each phase's steps for the
    linear warm-up, ``weight_decay`` (matrices only), ``grad_clip``, ``indexer_loss_coeff``, ``batch_size``.
    Measurement: ``eval_every`` steps on ``eval_batch_size`` held-out examples; ``checkpoint_every`` steps.
    Execution: ``seeds`` (how many, from ``first_seed``), ``device``, ``backend``, ``attn_dtype``
    (``"bfloat16"`` for the TileLang kernels), ``seqs_per_call`` (full-length sequences per attention
    call; ``None``: the whole packed batch in one call).
    """

    task: str = "mqar"
    context: int = 512
    num_pairs: int = 8
    vocab_size: int = 24
    n_layers: int = 2
    dim: int = 128
    n_heads: int = 4
    q_lora_rank: int = 64
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    index_n_heads: int = 4
    index_head_dim: int = 32
    topk: int = 32
    mlp_hidden: int = 256
    token_shift: bool = True
    short_context: int = 64
    short_context_steps: int = 200
    steps_dense: int = 260
    steps_warmup: int = 40
    steps_sparse: int = 60
    batch_size: int = 4
    lr: float = 3e-3
    lr_sparse: float = 1e-3
    lr_indexer: float = 1e-2
    warmup_fraction: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    indexer_loss_coeff: float = 1.0
    eval_every: int = 20
    eval_batch_size: int = 32
    checkpoint_every: int = 100
    seeds: int = 3
    first_seed: int = 0
    device: str = "cpu"
    backend: str = "reference"
    attn_dtype: str = "float32"
    seqs_per_call: int | None = 1
# --8<-- [end:train_config]

    def __post_init__(self) -> None:
        check_task(self.task, context=self.context, num_pairs=self.num_pairs, vocab_size=self.vocab_size)
        for name in ("topk", "n_layers", "dim", "n_heads", "batch_size", "eval_every", "eval_batch_size",
                     "checkpoint_every", "seeds", "mlp_hidden"):
            _require_int(name, getattr(self, name), 1)
        for name in ("steps_dense", "steps_warmup", "steps_sparse", "first_seed"):
            _require_int(name, getattr(self, name), 0)
        if self.short_context_steps:
            _require_int("short_context_steps", self.short_context_steps, 0)
            if self.short_context_steps > self.steps_dense:
                raise ValueError(f"short_context_steps={self.short_context_steps} must not exceed "
                                 f"steps_dense={self.steps_dense}")
            if self.short_context > self.context:
                raise ValueError(f"short_context={self.short_context} must not exceed context={self.context}")
            try:
                check_task(self.task, context=self.short_context, num_pairs=self.num_pairs, vocab_size=self.vocab_size)
            except ValueError as err:
                raise ValueError(f"short_context={self.short_context} is too short: {err}") from None
        if self.topk >= self.context:
            raise ValueError(f"topk={self.topk} must be smaller than context={self.context}: "
                             "with topk >= context every key is selected and sparse attention is dense")
        for name in ("lr", "lr_sparse", "lr_indexer", "grad_clip"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not 0 <= self.warmup_fraction < 1:
            raise ValueError(f"warmup_fraction must be in [0, 1), got {self.warmup_fraction!r}")
        check_backend(self.backend)
        if self.attn_dtype not in ("float32", "bfloat16", "float64"):
            raise ValueError(f"attn_dtype must be 'float32', 'bfloat16' or 'float64', got {self.attn_dtype!r}")
        if self.seqs_per_call is not None:
            _require_int("seqs_per_call", self.seqs_per_call, 1)

    def model_config(self) -> ModelConfig:
        """The `ModelConfig` these fields describe (plain RoPE, no YaRN: the contexts are trained on)."""
        rope = RopeConfig(theta=10000.0, factor=1.0)
        mla = MLAConfig(dim=self.dim, n_heads=self.n_heads, q_lora_rank=self.q_lora_rank,
                        kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
                        qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim, rope=rope)
        indexer = IndexerConfig(n_heads=self.index_n_heads, head_dim=self.index_head_dim, topk=self.topk,
                                rope_head_dim=self.qk_rope_head_dim)
        return ModelConfig(vocab_size=self.vocab_size, n_layers=self.n_layers,
                           attention=DSAConfig(mla=mla, indexer=indexer), mlp_hidden=self.mlp_hidden,
                           token_shift=self.token_shift)


# --8<-- [start:phases]
class Phase(NamedTuple):
    """One phase of training: starts from ``parent``'s final checkpoint (``None``: a fresh model)."""

    name: str
    run: str  # the run it belongs to (phase (a) is logged under "dense")
    parent: str | None
    mode: str  # the model mode (`dsa_ref.model.MODES`)
    steps: int


def phases(cfg: TrainConfig) -> list[Phase]:
    """The phases of one seed, parents first."""
    after = cfg.steps_warmup + cfg.steps_sparse  # the controls' budget after (a)
    return [
        Phase("a_dense", "dense", None, "dense", cfg.steps_dense),
        Phase("b_warmup", "dsa", "a_dense", "dense_warmup", cfg.steps_warmup),
        Phase("c_sparse", "dsa", "b_warmup", "sparse", cfg.steps_sparse),
        Phase("no_warmup_sparse", "dsa_no_warmup", "a_dense", "sparse", after),
        Phase("continued_dense", "dense_continued", "a_dense", "dense", after),
    ]


#: The phases behind each run's final model, in order.
RUNS = {
    "dense": ("a_dense",),
    "dsa": ("a_dense", "b_warmup", "c_sparse"),
    "dsa_no_warmup": ("a_dense", "no_warmup_sparse"),
    "dense_continued": ("a_dense", "continued_dense"),
}
# --8<-- [end:phases]


def build_model(cfg: TrainConfig, seed: int) -> DSALanguageModel:
    """A freshly initialised model for ``seed`` on ``cfg.device``."""
    torch.manual_seed(seed)
    attn_dtype = getattr(torch, cfg.attn_dtype)
    model = DSALanguageModel(cfg.model_config(), backend=cfg.backend, attn_dtype=attn_dtype)
    return model.to(cfg.device)


# --8<-- [start:optimizer]
def make_optimizer(model: DSALanguageModel, cfg: TrainConfig, phase: Phase):
    """AdamW over what ``phase`` trains (the rest is frozen), and its warm-up + cosine schedule.

    Returns ``(optimizer, scheduler, groups)``; ``groups`` are the parameter lists whose gradient
    norms are clipped separately (the main model, the indexers).
    """
    main, index = model.main_parameters(), model.indexer_parameters()
    if phase.mode == "dense":
        groups = [(main, cfg.lr)]
    elif phase.mode == "dense_warmup":
        groups = [(index, cfg.lr_indexer)]
    else:
        groups = [(main, cfg.lr_sparse), (index, cfg.lr_indexer)]
    trained = {id(p) for params, _ in groups for p in params}
    for p in model.parameters():
        p.requires_grad_(id(p) in trained)  # frozen parameters get no gradient at all
    param_groups = []
    for params, lr in groups:
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        param_groups.append(dict(params=decay, lr=lr, weight_decay=cfg.weight_decay))
        param_groups.append(dict(params=no_decay, lr=lr, weight_decay=0.0))
    opt = torch.optim.AdamW(param_groups, betas=(0.9, 0.95), eps=1e-8)
    warm = max(1, int(cfg.warmup_fraction * phase.steps))

    def lr_factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = min(1.0, (step - warm) / max(1, phase.steps - warm))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    return opt, sched, [params for params, _ in groups]
# --8<-- [end:optimizer]


def pack(batch, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[B, L]`` task tensors -> packed ``tokens [T]``, ``targets [T]``, ``gold [T]`` (packed index) and ``cu_seqlens``."""
    B, L = batch.tokens.shape
    offsets = (torch.arange(B) * L)[:, None]  # [B, 1]
    gold = torch.where(batch.gold >= 0, batch.gold + offsets, batch.gold)  # [B, L] in packed index space
    cu = torch.arange(0, B * L + 1, L, dtype=torch.int64)  # [B + 1]
    return (batch.tokens.reshape(-1).to(device), batch.targets.reshape(-1).to(device),
            gold.reshape(-1).to(device), cu.to(device))


def task_batch(cfg: TrainConfig, seed: int, batch_size: int, context: int | None = None):
    """The task's examples for a data seed (``context`` tokens each; default ``cfg.context``)."""
    return make_batch(cfg.task, batch_size=batch_size, context=cfg.context if context is None else context,
                      num_pairs=cfg.num_pairs, vocab_size=cfg.vocab_size, seed=seed)


def seqs_per_call(cfg: TrainConfig, length: int) -> int | None:
    """Sequences per attention call for sequences of ``length`` tokens: ``cfg.seqs_per_call`` at the
    full context, proportionally more for the curriculum's short sequences (the same tokens per call)."""
    if cfg.seqs_per_call is None:
        return None
    return cfg.seqs_per_call * max(1, cfg.context // length)


def batch_seed(seed: int, phase_index: int, step: int) -> int:
    """The data seed of a training step: a function of (seed, phase, step) only, so resuming is exact."""
    return (seed * 1_000_003 + (phase_index + 1) * 7_919) * 1_000_003 + step


def eval_seed(seed: int) -> int:
    """The seed of the held-out evaluation examples (never a training batch's seed: those are >= 10**6)."""
    return seed % 1000


# --8<-- [start:train_step]
def compute_gradients(model: DSALanguageModel, batch, mode: str, cfg: TrainConfig):
    """Forward and backward of one batch in ``mode``; returns ``(lm_loss, indexer_losses)``, detached.

    * ``"dense"``: the LM loss on the answer tokens trains the model;
    * ``"dense_warmup"``: only the KL losses are backpropagated (the main model is frozen, and the
      indexers' inputs are detached, so nothing but the indexers receives a gradient);
    * ``"sparse"``: the LM loss; each layer output carries its indexer's KL gradient
      (`dsa_ref.dsa.IndexerLossAutoScaler`), which reaches only the indexer.
    """
    tokens, targets, _, cu = pack(batch, cfg.device)
    out = model(tokens, cu, mode=mode, seqs_per_call=seqs_per_call(cfg, batch.tokens.shape[1]))
    answer = targets != IGNORE  # [T] the positions that have an answer
    lm_loss = F.cross_entropy(out.logits[answer], targets[answer])
    if mode == "dense_warmup":
        torch.stack(out.indexer_losses).sum().backward()
    else:
        lm_loss.backward()
    return lm_loss.detach(), [loss.detach() for loss in out.indexer_losses]


def train_step(model: DSALanguageModel, opt, sched, groups, batch, mode: str, cfg: TrainConfig) -> dict:
    """One optimiser step of a phase; returns its LM loss and (if any) the mean indexer KL."""
    lm_loss, kl = compute_gradients(model, batch, mode, cfg)
    for params in groups:  # the main model and the indexers are clipped separately
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return {"train_lm_loss": float(lm_loss), "train_indexer_kl": float(torch.stack(kl).mean()) if kl else None}
# --8<-- [end:train_step]


# --8<-- [start:evaluate]
@torch.no_grad()
def evaluate(model: DSALanguageModel, batch, mode: str, cfg: TrainConfig) -> dict:
    """Metrics on held-out examples, in ``mode``.

    * ``lm_loss``, ``accuracy``: cross-entropy and argmax accuracy on the answer tokens;
    * ``indexer_kl``: the layers' mean indexer KL (of the stage: dense or sparse);
    * ``gold_key_recall``: fraction of answers whose gold key is among the top-k of the
      **recall layer** -- the layer whose dense attention puts the most probability on the gold
      keys (``gold_mass_layers``); per layer in ``gold_key_recall_layers``;
    * ``topk_mass``: share of the *dense* attention's probability (averaged over heads) that falls
      on the top-k set, at the answer rows of the recall layer; per layer in ``topk_mass_layers``.

    The dense attention is that of the same weights, whatever the mode. The indexer metrics are
    ``None`` in mode ``"dense"`` (no indexer selects).
    """
    model.eval()
    tokens, targets, gold, cu = pack(batch, cfg.device)
    out = model(tokens, cu, mode=mode, seqs_per_call=seqs_per_call(cfg, batch.tokens.shape[1]),
                return_hidden=mode != "dense")
    answer = targets != IGNORE  # [T]
    logits = out.logits[answer]  # [A, V]
    metrics = {"lm_loss": float(F.cross_entropy(logits, targets[answer])),
               "accuracy": float((logits.argmax(-1) == targets[answer]).float().mean()),
               "indexer_kl": None, "gold_key_recall": None, "topk_mass": None, "recall_layer": None,
               "gold_key_recall_layers": None, "topk_mass_layers": None, "gold_mass_layers": None}
    if mode != "dense":
        rows = answer.nonzero().squeeze(1)  # [A] packed positions of the answers
        recall = [float((topk[rows] == gold[rows, None]).any(-1).float().mean()) for topk in out.topk_indices]
        masses = [dense_attention_mass(block, h, cu, rows, topk[rows], gold[rows])
                  for block, h, topk in zip(model.blocks, out.hidden, out.topk_indices)]
        topk_masses, gold_masses = [m[0] for m in masses], [m[1] for m in masses]
        layer = max(range(len(gold_masses)), key=gold_masses.__getitem__)  # the recall layer
        metrics.update(indexer_kl=float(torch.stack(out.indexer_losses).mean()), gold_key_recall=recall[layer],
                       topk_mass=topk_masses[layer], recall_layer=layer, gold_key_recall_layers=recall,
                       topk_mass_layers=topk_masses, gold_mass_layers=gold_masses)
    model.train()
    return metrics
# --8<-- [end:evaluate]


def dense_attention_mass(block, h: torch.Tensor, cu: torch.Tensor, rows: torch.Tensor, topk: torch.Tensor,
                         gold: torch.Tensor) -> tuple[float, float]:
    """Where a block's *dense* attention (summed over heads, normalised) puts its probability, at query ``rows``.

    Args:
        block: a `dsa_ref.model.Block`.
        h: ``[T, dim]`` the block's attention input (packed).
        cu: ``cu_seqlens`` of the packed sequences.
        rows: int ``[R]`` the query rows measured.
        topk: int ``[R, K]`` their selections in packed index space (``-1`` = unused).
        gold: int ``[R]`` their gold keys in packed index space.

    Returns:
        ``(topk_mass, gold_mass)``: the mean share of the probability on the selected set, and on the gold key.
    """
    attn = block.attn
    topk_total, gold_total, count = 0.0, 0.0, 0
    for lo, hi, cu_g in sequence_groups(cu, 1):  # one sequence at a time: [R_g, H, L] scores at most
        in_group = (rows >= lo) & (rows < hi)  # [R]
        if not bool(in_group.any()):
            continue
        local = rows[in_group] - lo  # [R_g]
        x = h[lo:hi].to(next(attn.parameters()).dtype)  # [L, dim]
        p = attn.mla.project(x, positions(cu_g))
        q, kv = attn.absorbed.absorbed_qkv(p)  # [L, H, D], [L, D]
        starts, ends = key_windows(cu_g)  # [L] each
        target = indexer_target(q[local], kv, sm_scale=attn.mla.softmax_scale,
                                starts=starts[local], ends=ends[local])  # [R_g, L] head-summed, normalised
        sel = topk[in_group] - lo  # [R_g, K]; -1 slots become negative
        L = target.shape[1]
        covered = torch.zeros(target.shape[0], L + 1, dtype=torch.bool, device=target.device)  # [R_g, L + 1]
        covered.scatter_(1, torch.where(sel >= 0, sel, torch.full_like(sel, L)), True)  # -1 slots go to column L
        covered = covered[:, :L]  # [R_g, L]: the selected set (a key selected twice counts once)
        topk_total += float(torch.where(covered, target, torch.zeros_like(target)).sum())
        gold_total += float(target.gather(1, (gold[in_group] - lo)[:, None]).sum())
        count += int(local.numel())
    return topk_total / max(count, 1), gold_total / max(count, 1)


# ----------------------------------------------------------------------------- running the phases


@dataclass
class _PhaseState:
    step: int = 0
    seconds: float = 0.0
    tokens: int = 0
    done: bool = False
    final: dict | None = None
    log: list = field(default_factory=list)


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _save(path: Path, model, opt, sched, state: _PhaseState) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                "step": state.step, "seconds": state.seconds, "tokens": state.tokens, "done": state.done,
                "final": state.final, "log": state.log, "rng": _rng_state()}, tmp)
    tmp.replace(path)  # never a half-written checkpoint


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, leave=False, disable=not enabled, file=sys.stderr, dynamic_ncols=True)


class _Budget:
    """Stops training after ``limit`` steps of this call (``None``: never) -- for tests and split runs."""

    def __init__(self, limit: int | None) -> None:
        self.left = limit

    def exhausted(self) -> bool:
        return self.left is not None and self.left <= 0

    def spend(self) -> None:
        if self.left is not None:
            self.left -= 1


# --8<-- [start:run_phase]
def run_phase(cfg: TrainConfig, seed: int, index: int, phase: Phase, ckpt_dir: Path, log_dir: Path,
              budget: _Budget, progress: bool) -> _PhaseState | None:
    """Train one phase of one seed, from its own checkpoint if there is one, else from its parent's.

    Returns the phase's state, or ``None`` when the step budget ran out first (a checkpoint is saved).
    """
    path = ckpt_dir / f"{phase.name}.pt"
    log_path = log_dir / f"seed{seed}_{phase.name}.jsonl"
    offset = sum(p.steps for p in phases(cfg)[:index] if p.name in RUNS[phase.run])  # run-global step of step 0
    model = build_model(cfg, seed)
    opt, sched, groups = make_optimizer(model, cfg, phase)
    state = _PhaseState()
    if path.exists():  # resume this phase
        ckpt = _load(path)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        _set_rng_state(ckpt["rng"])
        state = _PhaseState(ckpt["step"], ckpt["seconds"], ckpt["tokens"], ckpt["done"], ckpt["final"], ckpt["log"])
        if state.done:
            return state
    elif phase.parent is not None:  # branch from the parent's final weights
        model.load_state_dict(_load(ckpt_dir / f"{phase.parent}.pt")["model"])
    log_path.write_text("".join(json.dumps(r) + "\n" for r in state.log))  # the log as of the checkpoint
    eval_batch = task_batch(cfg, eval_seed(seed), cfg.eval_batch_size)

    def record(extra: dict | None = None) -> dict:
        row = {"run": phase.run, "seed": seed, "phase": phase.name, "step": offset + state.step,
               "mode": phase.mode, **evaluate(model, eval_batch, phase.mode, cfg), **(extra or {})}
        state.log.append(row)
        with log_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        return row

    if state.step == 0 and not state.log:
        record()
    bar = _progress(phase.steps, f"seed {seed} {phase.name}", progress)
    bar.update(state.step)
    while state.step < phase.steps:
        if budget.exhausted():
            _save(path, model, opt, sched, state)
            bar.close()
            return None
        short = phase.name == "a_dense" and state.step < cfg.short_context_steps  # the curriculum
        if short:
            batch = task_batch(cfg, batch_seed(seed, index, state.step),
                               cfg.batch_size * cfg.context // cfg.short_context, cfg.short_context)
        else:
            batch = task_batch(cfg, batch_seed(seed, index, state.step), cfg.batch_size)
        t0 = time.perf_counter()
        train_metrics = train_step(model, opt, sched, groups, batch, phase.mode, cfg)
        if cfg.device.startswith("cuda"):
            torch.cuda.synchronize()
        state.seconds += time.perf_counter() - t0
        state.tokens += batch.tokens.numel()
        state.step += 1
        budget.spend()
        bar.update(1)
        if state.step % cfg.eval_every == 0 or state.step == phase.steps:
            row = record({**train_metrics, "tokens_per_s": state.tokens / max(state.seconds, 1e-9)})
            bar.set_postfix(acc=f"{row['accuracy']:.3f}", loss=f"{row['lm_loss']:.3f}")
        if state.step % cfg.checkpoint_every == 0 and state.step < phase.steps:
            _save(path, model, opt, sched, state)
    bar.close()
    state.done = True
    state.final = state.log[-1]
    _save(path, model, opt, sched, state)  # the phase's end: what its children start from
    return state
# --8<-- [end:run_phase]


def train(cfg: TrainConfig, out: str | Path, *, resume: bool = False, stop_after: int | None = None,
          progress: bool = True, command: str | None = None) -> dict | None:
    """Run every phase of every seed and write the outputs (see the module docs).

    Args:
        cfg: the configuration.
        out: output directory (created). Without ``resume`` it must not hold a previous run.
        resume: continue the run in ``out`` from its checkpoints (``cfg`` must equal its ``config.json``).
        stop_after: train at most this many steps in this call, then save and return ``None``.
        progress: show tqdm bars on stderr.
        command: the command line, recorded in ``summary.json``.

    Returns:
        the summary (also written to ``summary.json``), or ``None`` if ``stop_after`` stopped the run.
    """
    out = Path(out)
    config_path = out / "config.json"
    if resume:
        if not config_path.exists():
            raise ValueError(f"resume: {out} holds no config.json (not a training output directory)")
    elif config_path.exists():
        raise ValueError(f"out={str(out)!r} already holds a training run; pass --resume to continue it")
    out.mkdir(parents=True, exist_ok=True)
    if not resume:
        config_path.write_text(json.dumps(dataclasses.asdict(cfg), indent=2) + "\n")
    (out / "logs").mkdir(exist_ok=True)
    if stop_after is not None:
        _require_int("stop_after", stop_after, 0)
    budget = _Budget(stop_after)
    results: dict[int, dict[str, _PhaseState]] = {}
    seeds = list(range(cfg.first_seed, cfg.first_seed + cfg.seeds))
    for seed in seeds:
        ckpt_dir = out / "checkpoints" / f"seed{seed}"
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        results[seed] = {}
        for index, phase in enumerate(phases(cfg)):
            state = run_phase(cfg, seed, index, phase, ckpt_dir, out / "logs", budget, progress)
            if state is None:
                return None
            results[seed][phase.name] = state
    with (out / "log.jsonl").open("w") as f:
        for seed in seeds:
            for phase in phases(cfg):
                for row in results[seed][phase.name].log:
                    f.write(json.dumps(row) + "\n")
    summary = summarise(cfg, results, command=command)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    try:
        plot_curves([row for seed in seeds for p in phases(cfg) for row in results[seed][p.name].log],
                    out / "curves.png", cfg)
    except ImportError:  # matplotlib is in the notebooks extra
        print("dsa-ref train: matplotlib is not installed, no figure written", file=sys.stderr)
    return summary


METRICS = ("accuracy", "lm_loss", "gold_key_recall", "topk_mass", "indexer_kl", "switch_accuracy", "steps", "seconds")


# --8<-- [start:summarise]
def summarise(cfg: TrainConfig, results: dict, *, command: str | None = None) -> dict:
    """The final metrics of the four runs: per seed, mean and spread (sample standard deviation).

    Besides the final metrics, ``switch_accuracy`` is the accuracy at step 0 of the run's last
    phase: right after the attention mode changed (``None`` for ``dense``, which has one phase).
    """
    runs = {}
    for run, chain in RUNS.items():
        per_seed = []
        for seed, states in results.items():
            final = states[chain[-1]].final
            switch = states[chain[-1]].log[0] if len(chain) > 1 else None  # right after the mode switch
            per_seed.append({"seed": seed, "accuracy": final["accuracy"], "lm_loss": final["lm_loss"],
                             "switch_accuracy": None if switch is None else switch["accuracy"],
                             "gold_key_recall": final["gold_key_recall"], "topk_mass": final["topk_mass"],
                             "indexer_kl": final["indexer_kl"],
                             "steps": sum(states[p].step for p in chain),
                             "seconds": sum(states[p].seconds for p in chain),
                             "tokens_per_s": states[chain[-1]].tokens / max(states[chain[-1]].seconds, 1e-9)})
        entry = {}
        spread = {}
        for key in METRICS:
            values = [row[key] for row in per_seed]
            if any(v is None for v in values):
                entry[key], spread[key] = None, None
                continue
            entry[key] = statistics.fmean(values)
            spread[key] = statistics.stdev(values) if len(values) > 1 else 0.0
        entry.update(std=spread, min_accuracy=min(r["accuracy"] for r in per_seed),
                     max_accuracy=max(r["accuracy"] for r in per_seed), per_seed=per_seed)
        runs[run] = entry
    model = DSALanguageModel(cfg.model_config())
    return {"task": cfg.task, "context": cfg.context, "topk": cfg.topk, "num_pairs": cfg.num_pairs,
            "seeds": list(results), "device": cfg.device, "backend": cfg.backend,
            "torch": torch.__version__, "command": command,
            "parameters": count_parameters(model), "indexer_parameters": sum(p.numel() for p in model.indexer_parameters()),
            "config": dataclasses.asdict(cfg), "runs": runs,
            "phases": {p.name: {"run": p.run, "parent": p.parent, "mode": p.mode, "steps": p.steps} for p in phases(cfg)}}
# --8<-- [end:summarise]


RUN_STYLE = {"dense": ("black", "-"), "dsa": ("tab:blue", "-"), "dsa_no_warmup": ("tab:red", "--"),
             "dense_continued": ("tab:gray", ":")}


def _curve(rows: list[dict], run: str, key: str) -> tuple[list[int], list[float]]:
    """Mean over seeds of ``key`` at each step of a run (phase (a)'s rows belong to every run).

    Where two phases of the run share a step (a phase's end and the next one's step 0), the later
    phase's value is used: the metric right after the switch.
    """
    chain = RUNS[run]
    latest: dict[tuple[int, int], float] = {}
    for phase in chain:
        for r in rows:
            if r["phase"] == phase and r.get(key) is not None:
                latest[(r["seed"], r["step"])] = r[key]
    by_step: dict[int, list[float]] = {}
    for (_, step), value in latest.items():
        by_step.setdefault(step, []).append(value)
    steps = sorted(by_step)
    return steps, [statistics.fmean(by_step[s]) for s in steps]


def plot_curves(rows: list[dict], path: str | Path, cfg: TrainConfig) -> None:
    """Three panels (answer accuracy, gold-key recall, top-k mass) against the run's step, mean over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for ax, key, title in zip(axes, ("accuracy", "gold_key_recall", "topk_mass"),
                              ("answer accuracy", "gold-key recall (recall layer)", "dense attention mass on the top-k")):
        for run in RUNS:
            steps, values = _curve(rows, run, key)
            if steps:
                color, style = RUN_STYLE[run]
                ax.plot(steps, values, style, color=color, label=run, marker="." if len(steps) < 30 else None)
        for boundary in (cfg.steps_dense, cfg.steps_dense + cfg.steps_warmup):
            ax.axvline(boundary, color="0.8", lw=0.8)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle(f"{cfg.task}, context {cfg.context}, top-k {cfg.topk}, {cfg.seeds} seed(s); "
                 f"phases: dense {cfg.steps_dense}, warm-up {cfg.steps_warmup}, sparse {cfg.steps_sparse}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _require_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
