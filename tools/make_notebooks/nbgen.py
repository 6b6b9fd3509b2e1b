"""What every notebook generator in this folder shares: cell builders and the write/--check main.

Notebooks are written without outputs and with stable cell ids, so regenerating them gives no
diff unless a generator changed. The site build and the tests execute them fresh.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"


def md(text: str) -> nbformat.NotebookNode:
    """A markdown cell (dedented)."""
    return nbformat.v4.new_markdown_cell(textwrap.dedent(text).strip("\n"))


def code(*parts: str) -> nbformat.NotebookNode:
    """A code cell made of one or more pieces of source, each dedented on its own."""
    return nbformat.v4.new_code_cell("\n\n".join(textwrap.dedent(part).strip("\n") for part in parts))


def heading(title: str) -> nbformat.NotebookNode:
    """A section heading cell."""
    return md(f"## {title}")


def notebook(prefix: str, cells: list[nbformat.NotebookNode]) -> nbformat.NotebookNode:
    """A validated notebook of ``cells``, without outputs, with ids ``<prefix>-01``, ``-02``, ..."""
    nb = nbformat.v4.new_notebook()
    nb.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    }
    for number, cell in enumerate(cells, start=1):
        cell.id = f"{prefix}-{number:02d}"  # stable ids: regenerating gives no diff
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    nb.cells = cells
    nbformat.validate(nb)
    return nb


def main(outputs: dict[str, nbformat.NotebookNode], *, doc: str, script: str) -> int:
    """Write ``outputs`` (file name -> notebook) into notebooks/, or with ``--check`` compare only."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare with the stored notebooks, write nothing")
    args = parser.parse_args()
    stale = []
    for name, nb in outputs.items():
        path = NOTEBOOKS / name
        text = nbformat.writes(nb) + "\n"
        if args.check:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                stale.append(name)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(ROOT)}")
    if stale:
        print(f"stale (run tools/make_notebooks/{script}):", ", ".join(stale), file=sys.stderr)
        return 1
    return 0
