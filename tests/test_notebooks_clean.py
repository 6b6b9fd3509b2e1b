"""Notebooks are stored without outputs: the site build and the tests execute them fresh.

Stored outputs would go stale as the code changes, bloat diffs, and could hide a notebook that no
longer runs. Clear them with "Clear All Outputs" in Jupyter before committing.
"""

from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
# With no notebooks yet, pytest reports the test below as skipped (empty parameter set).


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
