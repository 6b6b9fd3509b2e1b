"""`dsa_ref.tasks`: seeded generators, answers correct by construction, gold keys right, clear errors."""

from __future__ import annotations

import pytest
import torch

from dsa_ref.tasks import IGNORE, TASKS, make_batch

SIZES = [(64, 4, 30), (128, 16, 96), (33, 8, 24), (17, 4, 12)]


@pytest.mark.parametrize("task", TASKS)
def test_same_seed_same_batch_other_seed_other_batch(task):
    a = make_batch(task, batch_size=3, context=64, num_pairs=4, vocab_size=30, seed=7)
    b = make_batch(task, batch_size=3, context=64, num_pairs=4, vocab_size=30, seed=7)
    c = make_batch(task, batch_size=3, context=64, num_pairs=4, vocab_size=30, seed=8)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a.tokens, c.tokens)
    assert a.tokens.shape == a.targets.shape == a.gold.shape == (3, 64)
    assert a.tokens.dtype == a.targets.dtype == a.gold.dtype == torch.int64


@pytest.mark.parametrize("context,num_pairs,vocab", SIZES)
def test_mqar_answers_and_gold_keys(context, num_pairs, vocab):
    if context < 4 * num_pairs + 1:
        pytest.skip("too small for mqar")
    batch = make_batch("mqar", batch_size=8, context=context, num_pairs=num_pairs, vocab_size=vocab, seed=3)
    third = vocab // 3
    for tokens, targets, gold in zip(*batch):
        asked = (targets != IGNORE).nonzero().squeeze(1)  # [N] the positions of the asked keys
        assert asked.numel() == num_pairs
        assert torch.equal(gold != -1, targets != IGNORE)
        first_part = context - 2 * num_pairs
        keys_seen = tokens[:first_part][tokens[:first_part] < third]
        assert keys_seen.unique().numel() == keys_seen.numel() == num_pairs  # each key once before the questions
        for t in asked.tolist():
            key, answer, g = tokens[t], targets[t], int(gold[t])
            assert t >= first_part and tokens[t + 1] == answer  # the answer is the next token
            assert key < third and third <= answer < 2 * third
            assert g < first_part and tokens[g] == answer and tokens[g - 1] == key  # the gold value, after its key
        assert bool((tokens[:first_part][tokens[:first_part] >= 2 * third] < vocab).all())


@pytest.mark.parametrize("context,num_pairs,vocab", SIZES)
def test_copy_answers_and_gold_keys(context, num_pairs, vocab):
    batch = make_batch("copy", batch_size=8, context=context, num_pairs=num_pairs, vocab_size=vocab, seed=4)
    for tokens, targets, gold in zip(*batch):
        asked = (targets != IGNORE).nonzero().squeeze(1)
        assert asked.numel() == num_pairs - 1
        for t in asked.tolist():
            g = int(gold[t])
            assert tokens[t + 1] == targets[t] == tokens[g]  # the answer is the token after the earlier occurrence
            assert tokens[g - 1] == tokens[t] and g < context // 2
            assert int((tokens[: context - num_pairs] == tokens[t]).sum()) == 1  # one earlier occurrence


def test_bad_arguments_name_the_argument():
    kw = dict(batch_size=2, context=64, num_pairs=4, vocab_size=30, seed=0)
    with pytest.raises(ValueError, match="task"):
        make_batch("needle", **kw)
    with pytest.raises(ValueError, match="context=16 cannot hold task 'mqar'"):
        make_batch("mqar", **{**kw, "context": 16})
    with pytest.raises(ValueError, match="context=12 cannot hold task 'copy'"):
        make_batch("copy", **{**kw, "context": 12})
    with pytest.raises(ValueError, match="num_pairs=11"):
        make_batch("mqar", **{**kw, "num_pairs": 11})
    with pytest.raises(ValueError, match="vocab_size"):
        make_batch("mqar", **{**kw, "vocab_size": 5})
    with pytest.raises(ValueError, match="batch_size"):
        make_batch("mqar", **{**kw, "batch_size": 0})
    with pytest.raises(ValueError, match="context"):
        make_batch("mqar", **{**kw, "context": 64.0})
