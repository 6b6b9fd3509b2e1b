"""`dsa_ref.train`: the phases freeze and detach what they must (on gradients), training lowers the
loss, resuming is exact (bitwise on the CPU), and `dsa-ref train` rejects bad arguments by name."""

from __future__ import annotations

import json

import pytest
import torch

from dsa_ref import cli
from dsa_ref.train import (RUNS, TrainConfig, build_model, compute_gradients, make_optimizer, phases, task_batch,
                           train, train_step)

TINY = dict(context=32, num_pairs=4, vocab_size=24, dim=32, n_heads=2, q_lora_rank=16, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, index_n_heads=2, index_head_dim=8, topk=4,
            mlp_hidden=48, batch_size=4, eval_batch_size=4, seeds=1, eval_every=2, checkpoint_every=3,
            short_context_steps=0)


def tiny(**kw) -> TrainConfig:
    return TrainConfig(**{**TINY, **kw})


def phase(cfg, name):
    return next(p for p in phases(cfg) if p.name == name)


def test_warmup_trains_only_the_indexers():
    cfg = tiny()
    model = build_model(cfg, 0)
    make_optimizer(model, cfg, phase(cfg, "b_warmup"))
    compute_gradients(model, task_batch(cfg, 1, 4), "dense_warmup", cfg)
    assert all(p.grad is None and not p.requires_grad for p in model.main_parameters())
    grads = [p.grad for p in model.indexer_parameters()]
    assert all(g is not None for g in grads) and sum(float(g.abs().sum()) for g in grads) > 0


def test_sparse_stage_indexer_learns_from_the_kl_alone():
    cfg = tiny(attn_dtype="float64")
    model = build_model(cfg, 0).double()
    make_optimizer(model, cfg, phase(cfg, "c_sparse"))
    from dsa_ref.train import pack

    tokens, targets, _, cu = pack(task_batch(cfg, 1, 4), "cpu")
    out = model(tokens, cu, mode="sparse", seqs_per_call=cfg.seqs_per_call)
    answer = targets != -100
    lm_loss = torch.nn.functional.cross_entropy(out.logits[answer], targets[answer])
    kl = torch.stack(out.indexer_losses).sum()
    index, main = model.indexer_parameters(), model.main_parameters()
    kl_index = torch.autograd.grad(kl, index, retain_graph=True)
    # the KL reaches no main parameter: the indexer's inputs and the KL target are detached
    assert all(g is None for g in torch.autograd.grad(kl, main, retain_graph=True, allow_unused=True))
    # through the auto-scaler the LM loss's backward hands the indexers the KL gradient, and nothing
    # of its own: scaling the LM loss leaves the indexers' gradient unchanged (top-k has no gradient)
    for g, g_kl in zip(torch.autograd.grad(7.0 * lm_loss, index, retain_graph=True), kl_index):
        torch.testing.assert_close(g, g_kl, rtol=1e-10, atol=1e-12)
    lm_main = torch.autograd.grad(lm_loss, main, retain_graph=True)
    lm_loss.backward()  # one backward: the auto-scaler adds the KL gradient for the indexers
    for p, g in zip(index, kl_index):
        torch.testing.assert_close(p.grad, g, rtol=1e-10, atol=1e-12)
    for p, g in zip(main, lm_main):
        torch.testing.assert_close(p.grad, g, rtol=1e-10, atol=1e-12)


def test_a_few_steps_lower_the_loss():
    cfg = tiny(lr=1e-2)
    model = build_model(cfg, 0)
    p = phase(cfg, "a_dense")._replace(steps=15)
    opt, sched, groups = make_optimizer(model, cfg, p)
    batch = task_batch(cfg, 5, 8)
    losses = [train_step(model, opt, sched, groups, batch, "dense", cfg)["train_lm_loss"] for _ in range(15)]
    assert losses[-1] < 0.5 * losses[0]


def _final_weights(out, cfg):
    return {p.name: torch.load(out / "checkpoints" / "seed0" / f"{p.name}.pt", weights_only=False)["model"]
            for p in phases(cfg)}


def _without_timings(rows):
    return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows]


def test_resume_is_exact(tmp_path):
    cfg = tiny(steps_dense=4, steps_warmup=1, steps_sparse=1)  # 4 + 1 + 1 + 2 + 2 = 10 steps
    assert sum(p.steps for p in phases(cfg)) == 10
    whole = train(cfg, tmp_path / "whole", progress=False)
    assert train(cfg, tmp_path / "split", stop_after=5, progress=False) is None
    assert not (tmp_path / "split" / "summary.json").exists()
    with pytest.raises(ValueError, match="resume"):
        train(cfg, tmp_path / "split", progress=False)  # a second start in the same directory
    split = train(cfg, tmp_path / "split", resume=True, progress=False)
    a, b = _final_weights(tmp_path / "whole", cfg), _final_weights(tmp_path / "split", cfg)
    for name in a:
        for key in a[name]:
            assert torch.equal(a[name][key], b[name][key]), (name, key)
    rows = [_without_timings(json.loads(line) for line in (d / "log.jsonl").read_text().splitlines())
            for d in (tmp_path / "whole", tmp_path / "split")]
    assert rows[0] == rows[1]
    for run in RUNS:
        for key in ("accuracy", "lm_loss", "gold_key_recall", "switch_accuracy", "steps"):
            assert whole["runs"][run][key] == split["runs"][run][key]
    assert set(whole["runs"]) == {"dense", "dsa", "dsa_no_warmup", "dense_continued"}
    assert whole["runs"]["dense"]["gold_key_recall"] is None
    assert whole["runs"]["dsa"]["steps"] == whole["runs"]["dense_continued"]["steps"] == 6
    assert (tmp_path / "whole" / "curves.png").exists()
    first = json.loads((tmp_path / "whole" / "log.jsonl").read_text().splitlines()[0])
    assert {"run", "seed", "phase", "step", "accuracy", "lm_loss", "gold_key_recall"} <= set(first)


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="topk=32 must be smaller than context=32"):
        tiny(topk=32)
    with pytest.raises(ValueError, match="task"):
        tiny(task="needle")
    with pytest.raises(ValueError, match="context=16 cannot hold"):
        tiny(context=16, num_pairs=4)
    with pytest.raises(ValueError, match="backend"):
        tiny(backend="cuda")
    with pytest.raises(ValueError, match="short_context_steps=5 must not exceed steps_dense=4"):
        tiny(short_context_steps=5, steps_dense=4)
    with pytest.raises(ValueError, match="short_context=16 is too short"):
        tiny(short_context=16, short_context_steps=2, steps_dense=4)


def test_curriculum_trains_on_short_sequences_first(tmp_path):
    cfg = tiny(short_context=17, short_context_steps=2, steps_dense=3, steps_warmup=0, steps_sparse=0, seeds=1)
    summary = train(cfg, tmp_path / "c", progress=False)
    assert summary["runs"]["dense"]["steps"] == 3
    ckpt = torch.load(tmp_path / "c" / "checkpoints" / "seed0" / "a_dense.pt", weights_only=False)
    # 2 short steps of 4 * 32 // 17 = 7 sequences of 17 tokens, then 1 step of 4 sequences of 32
    assert ckpt["tokens"] == 2 * 7 * 17 + 4 * 32


@pytest.mark.parametrize("args,names", [
    (["--topk", "512", "--context", "512"], "topk=512"),
    (["--task", "needle"], "task"),
    (["--context", "20", "--num-pairs", "8"], "context=20"),
    (["--seeds", "0"], "seeds"),
])
def test_cli_bad_arguments(tmp_path, capsys, args, names):
    assert cli.main(["train", "--out", str(tmp_path / "o"), "--no-progress", *args]) == 2
    assert names in capsys.readouterr().err


def test_cli_runs_and_resumes(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--out", str(out), "--no-progress", "--steps-dense", "2", "--steps-warmup", "1",
            "--steps-sparse", "1", *[f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]]
    assert cli.main([*argv, "--stop-after", "3"]) == 0
    assert "--resume" in capsys.readouterr().out
    assert cli.main(["train", "--resume", str(out), "--context", "64"]) == 2
    assert "drop --context" in capsys.readouterr().err
    assert cli.main(["train", "--resume", str(out), "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["runs"]) == set(RUNS) and summary["context"] == 32
