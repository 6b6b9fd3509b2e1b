"""The worked examples of docs/checking_your_kernel.md run, in order, and do what the page says.

Every fenced ```python block of the page is executed in one namespace, top to bottom, like a
notebook; each block's own asserts are the page's claims. ```py blocks are sketches (they use
names such as ``your_kernel``) and are not run.
"""

from __future__ import annotations

import re
import traceback
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[1] / "docs" / "checking_your_kernel.md"
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(text: str) -> list[str]:
    return [m.group(1) for m in FENCE.finditer(text)]


def test_page_has_a_worked_example_for_every_adapter():
    text = PAGE.read_text(encoding="utf-8")
    code = "\n".join(python_blocks(text))
    for name in ("FLASHMLA_SPARSE_PREFILL", "TILELANG_DEEPSEEK_V32", "TILELANG_SPARSE_FINETUNE", "MEGATRON_SBHD",
                 "check_sparse_mla_backward", "check_indexer", "compare_topk", "check_topk",
                 "attention_mass_recall", "fp8_indexer_scores"):
        assert name in code, f"no runnable example uses {name}"
    from dsa_ref import adversarial

    for name in adversarial.GENERATORS:  # the generators table lists every generator
        assert f"| `{name}` |" in text, f"the adversarial table misses {name}"


def test_every_python_block_runs(capsys):
    blocks = python_blocks(PAGE.read_text(encoding="utf-8"))
    assert len(blocks) >= 12
    namespace: dict = {"__name__": "checking_your_kernel"}
    for number, block in enumerate(blocks, start=1):
        try:
            exec(compile(block, f"{PAGE.name}, python block {number}", "exec"), namespace)
        except Exception:  # noqa: BLE001 - report which block broke, with its source
            head = "\n".join(block.splitlines()[:6])
            pytest.fail(f"python block {number} of {PAGE.name} failed:\n{head}\n...\n{traceback.format_exc()}",
                        pytrace=False)
    out = capsys.readouterr().out
    assert "sparse_mla: ok" in out and "sparse_mla: FAIL" in out
