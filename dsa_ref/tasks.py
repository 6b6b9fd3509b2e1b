r"""Chapter 6, part 2: synthetic long-context tasks where the selection decides the answer.

Every example is generated from a seed (nothing is downloaded) and comes with its answers and,
for each answer, the position of the one earlier token the answer must be read from -- the
**gold key**. A sparse attention that drops the gold key cannot answer; the indexer's *gold-key
recall* (how often the gold key is among a query's top-k) measures whether it learned where to look.

The vocabulary is split into three disjoint ranges: keys ``[0, V/3)``, values ``[V/3, 2V/3)`` and
noise ``[2V/3, V)`` (``V = vocab_size``).

* ``"mqar"`` -- multi-query associative recall (Zoology, Arora et al. 2023). ``num_pairs``
  key-value pairs ``k v`` lie at random places in the first part of the context, among noise;
  the last ``2 * num_pairs`` tokens ask every key once, in random order, each followed by its
  value. The model must predict each asked value from its key: the gold key of that answer is the
  position of the value after the earlier occurrence of the key.

      noise k1 v1 noise noise k2 v2 noise ... noise | k2 v2 k1 v1 ...
                    ^ gold of the answer v1                   ^ answer

* ``"copy"`` -- induction copying. A segment of ``num_pairs`` distinct key tokens lies at a random
  place in the first half of the context, among noise; the context ends with the same segment
  again. From the second token of the copy on, every token is an answer; its gold key is the
  position of the same token in the first occurrence.

Targets follow next-token prediction: ``targets[b, t]`` is the answer expected from position ``t``
(the token at ``t + 1``), ``-100`` where nothing is asked (cross-entropy's ignore index), and
``gold[b, t]`` is the gold key's position inside the sequence, ``-1`` where nothing is asked.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["TASKS", "TaskBatch", "make_batch", "check_task", "IGNORE"]

TASKS = ("mqar", "copy")
IGNORE = -100  # targets without an answer (torch.nn.functional.cross_entropy's ignore_index)


class TaskBatch(NamedTuple):
    """A batch of ``B`` sequences of ``context`` tokens.

    Attributes:
        tokens: int64 ``[B, context]``.
        targets: int64 ``[B, context]``: the answer expected from each position, ``-100`` where none.
        gold: int64 ``[B, context]``: the gold key position (inside the sequence) for each answer, ``-1`` where none.
    """

    tokens: torch.Tensor
    targets: torch.Tensor
    gold: torch.Tensor


def check_task(task: str, *, context: int, num_pairs: int, vocab_size: int) -> None:
    """Raise ValueError naming the argument unless the task can build examples of this size."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    for name, value in (("context", context), ("num_pairs", num_pairs), ("vocab_size", vocab_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if vocab_size < 6:
        raise ValueError(f"vocab_size must be >= 6 (three ranges: keys, values, noise), got {vocab_size}")
    num_keys = vocab_size // 3
    if num_pairs > num_keys:
        raise ValueError(f"num_pairs={num_pairs} needs as many distinct keys, but vocab_size={vocab_size} "
                         f"has only {num_keys} (vocab_size // 3)")
    if task == "mqar":
        need = 4 * num_pairs + 1  # the pairs, the questions, and at least one noise token between them
        if context < need:
            raise ValueError(f"context={context} cannot hold task 'mqar' with num_pairs={num_pairs}: "
                             f"it needs at least 4 * num_pairs + 1 = {need} tokens")
    else:
        if num_pairs < 2:
            raise ValueError(f"num_pairs must be >= 2 for task 'copy' (the copied segment's length), got {num_pairs}")
        need = 4 * num_pairs  # the segment fits in the first half, its copy at the end
        if context < need:
            raise ValueError(f"context={context} cannot hold task 'copy' with num_pairs={num_pairs}: "
                             f"it needs at least 4 * num_pairs = {need} tokens")


# --8<-- [start:make_batch]
def make_batch(task: str, *, batch_size: int, context: int, num_pairs: int, vocab_size: int,
               seed: int) -> TaskBatch:
    """``batch_size`` examples of ``task``, the same for the same arguments and seed.

    Args:
        task: ``"mqar"`` or ``"copy"``.
        batch_size: number of sequences B.
        context: tokens per sequence.
        num_pairs: key-value pairs (``"mqar"``) or the copied segment's length (``"copy"``).
        vocab_size: number of token ids (split into keys, values, noise).
        seed: the examples' seed (any int; a `torch.Generator` is seeded with it).

    Returns:
        `TaskBatch` of ``[B, context]`` tensors (int64, on the CPU).
    """
    check_task(task, context=context, num_pairs=num_pairs, vocab_size=vocab_size)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    gen = torch.Generator().manual_seed(int(seed))
    make = _mqar if task == "mqar" else _copy
    rows = [make(gen, context, num_pairs, vocab_size) for _ in range(batch_size)]
    return TaskBatch(*(torch.stack(parts) for parts in zip(*rows)))
# --8<-- [end:make_batch]


def _ranges(vocab_size: int) -> tuple[int, int]:
    third = vocab_size // 3
    return third, 2 * third  # keys [0, third), values [third, 2 * third), noise [2 * third, V)


def _blank(gen: torch.Generator, context: int, vocab_size: int):
    _, noise_lo = _ranges(vocab_size)
    tokens = torch.randint(noise_lo, vocab_size, (context,), generator=gen)  # [L] noise
    targets = torch.full((context,), IGNORE, dtype=torch.int64)  # [L]
    gold = torch.full((context,), -1, dtype=torch.int64)  # [L]
    return tokens, targets, gold


def _mqar(gen: torch.Generator, context: int, num_pairs: int, vocab_size: int):
    third, _ = _ranges(vocab_size)
    tokens, targets, gold = _blank(gen, context, vocab_size)
    keys = torch.randperm(third, generator=gen)[:num_pairs]  # [N] distinct keys
    values = third + torch.randint(0, third, (num_pairs,), generator=gen)  # [N]
    # pairs at random, non-overlapping even-aligned places of the first part: 2-token slots
    first_part = context - 2 * num_pairs  # the questions take the last 2N tokens
    slots = torch.randperm(first_part // 2, generator=gen)[:num_pairs]  # [N]
    key_pos = 2 * slots  # [N]
    tokens[key_pos] = keys
    tokens[key_pos + 1] = values
    # the questions: every key once, in random order, each followed by its value
    order = torch.randperm(num_pairs, generator=gen)  # [N]
    q_pos = first_part + 2 * torch.arange(num_pairs)  # [N] where each asked key sits
    tokens[q_pos] = keys[order]
    tokens[q_pos + 1] = values[order]
    targets[q_pos] = values[order]  # from the asked key, predict its value
    gold[q_pos] = key_pos[order] + 1  # the value after the key's first occurrence
    return tokens, targets, gold


def _copy(gen: torch.Generator, context: int, num_pairs: int, vocab_size: int):
    third, _ = _ranges(vocab_size)
    tokens, targets, gold = _blank(gen, context, vocab_size)
    segment = torch.randperm(third, generator=gen)[:num_pairs]  # [N] distinct keys
    first = int(torch.randint(0, context // 2 - num_pairs + 1, (1,), generator=gen))
    copy = context - num_pairs
    tokens[first: first + num_pairs] = segment
    tokens[copy:] = segment
    # from copy position j (j < N - 1) predict segment[j + 1]; it was read at first + j + 1
    j = torch.arange(num_pairs - 1)  # [N - 1]
    targets[copy + j] = segment[j + 1]
    gold[copy + j] = first + j + 1
    return tokens, targets, gold
