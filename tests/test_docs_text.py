"""The site's Markdown sources and the notebooks' text hold no control characters.

A tab or a form feed in a page is almost always an escape gone wrong: a page or a snippet written
from a Python string where ``"\\text"`` became a tab and ``"ext"``, or ``"\\top"`` a tab and ``"op"``.
KaTeX then renders the letters without complaint, so the site build and the browser check cannot
see it; this test reads the sources.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*(ROOT / "docs").rglob("*.md"), *(ROOT / "notebooks").glob("*.py")])
CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f]")  # everything below space but the newline


def control_characters(text: str) -> list[tuple[int, str]]:
    """``(line number, the line)`` of each line with a control character other than the newline."""
    return [(n, line) for n, line in enumerate(text.splitlines(), 1) if CONTROL.search(line)]


def test_the_check_sees_an_escape_gone_wrong():
    assert control_characters("fine\n$dS^\top Q$\n") == [(2, "$dS^\top Q$")]
    assert control_characters("$\\text{blk}$ and $dS^\\top$\n") == []


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_control_characters(path):
    bad = control_characters(path.read_text(encoding="utf-8"))
    assert not bad, f"{path.relative_to(ROOT)}: control characters on lines {[n for n, _ in bad]}: {bad[:3]}"
