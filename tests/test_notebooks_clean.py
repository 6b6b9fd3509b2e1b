"""Notebooks are jupytext pairs, and the .ipynb side is stored without outputs.

Every notebook is two files: ``notebooks/NN_name.py`` in jupytext's percent format, the source a
reader reviews and edits, and ``notebooks/NN_name.ipynb``, what Jupyter, nbmake and the site open.
``notebooks/jupytext.toml`` pairs them; ``jupytext --sync notebooks/NN_name.py`` brings the
.ipynb up to date after an edit of the .py (and the other way round).

The .ipynb is stored without outputs: the site build and the tests execute it fresh. Stored
outputs would go stale as the code changes, bloat diffs, and could hide a notebook that no longer
runs.
"""

from __future__ import annotations

import copy
from pathlib import Path

import jupytext
import nbformat
import pytest

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
SCRIPTS = sorted(NOTEBOOK_DIR.glob("*.py"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_stored_clean(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    dirty = []
    for number, cell in enumerate(nb.cells, start=1):
        if cell.cell_type != "code":
            continue
        if cell.get("outputs"):
            dirty.append(f"cell {number} has {len(cell.outputs)} output(s)")
        if cell.get("execution_count") is not None:
            dirty.append(f"cell {number} has execution_count {cell.execution_count}")
    assert not dirty, f"{path.name} is stored with outputs; clear them before committing: " + "; ".join(dirty)


def test_every_notebook_is_a_pair():
    """Each .ipynb has its .py beside it and each .py its .ipynb."""
    lonely = [p.name for p in NOTEBOOKS if not p.with_suffix(".py").is_file()]
    lonely += [p.name for p in SCRIPTS if not p.with_suffix(".ipynb").is_file()]
    assert not lonely, f"unpaired notebook files (create the other side with jupytext --sync): {lonely}"


def pair_differences(ipynb: nbformat.NotebookNode, script: nbformat.NotebookNode) -> list[str]:
    """How two notebooks differ in their cells: type and source, cell by cell (empty when in sync).

    Args:
        ipynb: the stored .ipynb, as read by ``nbformat.read``.
        script: the .py side, as read by ``jupytext.read``.

    Returns:
        One line per difference, naming the cell (1-based) and what differs; ``[]`` when the two
        have the same cells in the same order.
    """
    problems = []
    if len(ipynb.cells) != len(script.cells):
        problems.append(f"{len(ipynb.cells)} cells in the .ipynb, {len(script.cells)} in the .py")
    for number, (a, b) in enumerate(zip(ipynb.cells, script.cells), start=1):
        if a.cell_type != b.cell_type:
            problems.append(f"cell {number}: {a.cell_type} in the .ipynb, {b.cell_type} in the .py")
        elif a.source != b.source:
            first = next(i for i, (x, y) in enumerate(zip(a.source + "\0", b.source + "\1")) if x != y)
            line = a.source[:first].count("\n") + 1
            problems.append(f"cell {number} ({a.cell_type}): sources differ from line {line} on")
    return problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_pair_is_in_sync(path):
    script = path.with_suffix(".py")
    if not script.is_file():
        pytest.skip(f"no {script.name} (test_every_notebook_is_a_pair reports it)")
    problems = pair_differences(nbformat.read(path, as_version=4), jupytext.read(script))
    assert not problems, (
        f"{path.name} and {script.name} differ; run `jupytext --sync notebooks/{script.name}` "
        f"(after editing the .py) or `jupytext --sync notebooks/{path.name}` (after editing in Jupyter):\n"
        + "\n".join(problems)
    )


def test_pair_differences_sees_a_changed_cell():
    """The check above can fail: a changed cell, a changed type and a missing cell are all reported."""
    ipynb = nbformat.read(NOTEBOOKS[0], as_version=4)
    script = jupytext.reads(jupytext.writes(ipynb, fmt="py:percent"), fmt="py:percent")  # a faithful .py
    assert pair_differences(ipynb, script) == []

    edited = copy.deepcopy(script)
    code = next(i for i, c in enumerate(edited.cells) if c.cell_type == "code")
    edited.cells[code].source += "\nprint('edited')"
    assert pair_differences(ipynb, edited) == [f"cell {code + 1} (code): sources differ from line "
                                               f"{ipynb.cells[code].source.count(chr(10)) + 1} on"]

    retyped = copy.deepcopy(script)
    retyped.cells[code] = nbformat.v4.new_markdown_cell(script.cells[code].source)
    assert pair_differences(ipynb, retyped) == [f"cell {code + 1}: code in the .ipynb, markdown in the .py"]

    shorter = copy.deepcopy(script)
    del shorter.cells[-1]
    assert pair_differences(ipynb, shorter)[0].endswith(f"{len(script.cells) - 1} in the .py")
