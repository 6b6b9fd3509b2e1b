"""Run notebooks as plain scripts, one process each (for machines without Jupyter).

    python tools/run_notebooks_as_scripts.py notebooks/*.py [--timeout 120]

Every notebook is a jupytext pair, and its percent-format .py is a Python script whose markdown
cells are comments. The GPU machine has no Jupyter; this checks there that every notebook's GPU
branch runs. Each script runs with the notebook's folder as working directory (as mkdocs-jupyter
and nbmake do) and a non-interactive matplotlib backend. Exit code 1 if any notebook fails.
"""

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+")
    parser.add_argument("--timeout", type=int, default=120)
    args = parser.parse_args()
    env = dict(os.environ, MPLBACKEND="Agg")
    failed = 0
    for name in args.notebooks:
        path = Path(name).resolve().with_suffix(".py")  # notebooks/NN_name.ipynb names its pair too
        t0 = time.time()
        try:
            run = subprocess.run([sys.executable, str(path)], cwd=path.parent, env=env, capture_output=True,
                                 text=True, timeout=args.timeout)
            ok, tail = run.returncode == 0, (run.stdout + run.stderr)[-1500:]
        except subprocess.TimeoutExpired:
            ok, tail = False, f"timed out after {args.timeout} s"
        failed += not ok
        print(f"{'ok    ' if ok else 'FAILED'} {path.name}  {time.time() - t0:.1f} s", flush=True)
        if not ok:
            print(tail, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
