# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 6 — DSA at work: training
#
# The chapters so far built every piece of DeepSeek Sparse Attention. This notebook trains a small
# language model through DeepSeek-V3.2's recipe and watches the pieces work together:
#
# 1. a small decoder whose attention is `DSAttention`, in three modes (dense, dense warm-up, sparse);
# 2. a task where one far token decides each answer: multi-query associative recall (MQAR);
# 3. the recipe -- (a) dense training, (b) the dense warm-up of the indexers, (c) sparse training --
#    and two controls on the same step budget: dense training continued, and sparse training from
#    an untrained indexer;
# 4. the curves: answer accuracy, how often the indexer selects the gold key, and how much of the
#    dense attention the top-k set covers.
#
# On a CPU this is a **small run** (context 256, one seed, about three minutes) so that the notebook
# stays quick; the chapter page shows the measured results of the full CPU run (context 512, three
# seeds) and of an H200 run. On a GPU the notebook trains at context 4096 with the TileLang kernels
# when they can run.

# %%
import json
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import torch

from dsa_ref.model import DSALanguageModel, count_parameters
from dsa_ref.tasks import make_batch
from dsa_ref.train import RUNS, TrainConfig, phases, plot_curves, train

torch.set_num_threads(min(2, torch.get_num_threads()))
GPU = torch.cuda.is_available()
print("device:", "cuda" if GPU else "cpu")

# %% [markdown]
# ## 1. The task: multi-query associative recall
#
# Key-value pairs `k v` lie at random places among noise tokens; the last tokens ask every key
# again, and the model must answer with its value. Each answer comes with its **gold key**: the
# position of the value it must read. Keys, values and noise use disjoint token ranges.

# %%
ex = make_batch("mqar", batch_size=1, context=40, num_pairs=4, vocab_size=24, seed=0)
tokens, targets, gold = ex.tokens[0], ex.targets[0], ex.gold[0]
print("tokens :", tokens.tolist())
asked = (targets != -100).nonzero().squeeze(1)
for t in asked.tolist():
    print(f"position {t}: key {int(tokens[t])} -> answer {int(targets[t])}, read at position {int(gold[t])} "
          f"(token there: {int(tokens[gold[t]])}, after key {int(tokens[gold[t] - 1])})")

# %% [markdown]
# ## 2. The model and its three modes
#
# `DSALanguageModel` is nanoGPT's decoder (pre-norm blocks, RMSNorm, SwiGLU) with `DSAttention`
# in every block. Its embedding adds the previous token's embedding (a *token shift*), so one
# attention hop answers a question; that makes the small model learn the task in hundreds of steps.

# %%
if GPU:
    # the H200 run's model and learning rate (1e-3: this width did not learn the task with 3e-3)
    cfg = TrainConfig(context=4096, topk=256, num_pairs=8, vocab_size=24, batch_size=4, seeds=1, lr=1e-3,
                      dim=512, n_heads=16, q_lora_rank=256, kv_lora_rank=512, qk_nope_head_dim=64,
                      qk_rope_head_dim=64, v_head_dim=128, index_n_heads=16, index_head_dim=128, mlp_hidden=1024,
                      short_context=128, short_context_steps=120, steps_dense=200, steps_warmup=40,
                      steps_sparse=60, eval_every=20, eval_batch_size=8, device="cuda", backend="auto",
                      attn_dtype="bfloat16", checkpoint_every=1000)
else:  # a small CPU run: about three minutes on one core
    cfg = TrainConfig(context=256, topk=16, num_pairs=8, vocab_size=24, batch_size=8, seeds=1,
                      short_context=64, short_context_steps=120, steps_dense=160, steps_warmup=30,
                      steps_sparse=40, eval_every=20, eval_batch_size=32, checkpoint_every=1000)
model = DSALanguageModel(cfg.model_config())
print(f"parameters: {count_parameters(model):,} (indexers: {sum(p.numel() for p in model.indexer_parameters()):,})")
x = make_batch(cfg.task, batch_size=2, context=64, num_pairs=cfg.num_pairs, vocab_size=cfg.vocab_size, seed=1)
cu = torch.tensor([0, 64, 128])
for mode in ("dense", "dense_warmup", "sparse"):
    out = model(x.tokens.reshape(-1), cu, mode=mode)
    kl = [round(float(loss), 3) for loss in out.indexer_losses]
    print(f"{mode:13s} logits {tuple(out.logits.shape)}  indexer KL per layer {kl}")

# %% [markdown]
# ## 3. The recipe and the controls
#
# Every phase starts from a checkpoint of its parent: phase (a) is trained once per seed and the
# four runs branch from it.

# %%
for p in phases(cfg):
    print(f"{p.name:18s} run {p.run:16s} from {str(p.parent):10s} mode {p.mode:13s} {p.steps} steps")
print({run: " -> ".join(chain) for run, chain in RUNS.items()})

# %%
out_dir = Path(tempfile.mkdtemp()) / "run"
summary = train(cfg, out_dir, progress=False)
for run, r in summary["runs"].items():
    recall = "-" if r["gold_key_recall"] is None else f"{r['gold_key_recall']:.3f}"
    print(f"{run:16s} accuracy {r['accuracy']:.3f}  answer loss {r['lm_loss']:.3f}  gold-key recall {recall}  "
          f"{r['steps']:.0f} steps  {r['seconds']:.1f} s")

# %% [markdown]
# ## 4. The curves
#
# The first vertical line ends phase (a), the second the warm-up. During the warm-up the model is
# frozen (its accuracy stays where it was) while the indexer learns where the dense attention
# looks: its gold-key recall rises. Sparse training then starts from an indexer that already finds
# the gold keys; the control without warm-up starts from one that does not.

# %%
rows = [json.loads(line) for line in (out_dir / "log.jsonl").read_text().splitlines()]
plot_curves(rows, out_dir / "curves.png", cfg)
plt.figure(figsize=(14, 4))
plt.imshow(plt.imread(out_dir / "curves.png"))
plt.axis("off")
plt.show()

# %%
warmup = [r for r in rows if r["phase"] == "b_warmup"]
print("warm-up gold-key recall by step:", [(r["step"], round(r["gold_key_recall"], 3)) for r in warmup])
no_warm = [r for r in rows if r["phase"] == "no_warmup_sparse"]
print("untrained indexer's recall at the start of sparse training:", round(no_warm[0]["gold_key_recall"], 3))

# %% [markdown]
# ## Checks

# %%
assert set(summary["runs"]) == {"dense", "dsa", "dsa_no_warmup", "dense_continued"}
assert summary["runs"]["dsa"]["steps"] == summary["runs"]["dense_continued"]["steps"]
assert warmup[-1]["gold_key_recall"] > warmup[0]["gold_key_recall"], "the warm-up teaches the indexer"
assert warmup[-1]["accuracy"] == warmup[0]["accuracy"], "the warm-up leaves the main model alone"
print("all checks passed")
