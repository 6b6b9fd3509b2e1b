# The README's two commands: `make docs` and `make test`. Both create .venv on first use.
#
#   make venv        create .venv: torch first (see tools/install_torch.sh), then the package
#   make test        every test: pytest over tests/ (which includes the strict site build,
#                    in tests/test_site.py) and every notebook through nbmake
#   make docs        build the site, notebooks executed, and serve it on http://127.0.0.1:8000
#   make docs-fast   the same without executing the notebooks (prose previews in seconds)
#   make docs-build  the strict site build alone, into site/
#   make clean       remove the venv and every build output
#
# Overrides: TORCH_SPEC="torch==2.13.0", TORCH_PIP_ARGS="--index-url ...", PYTHON=python3.12,
# PYTEST_ARGS="-k layout" (extra pytest arguments), PYTEST_WORKERS=2.

PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_WORKERS ?= 2
PYTEST_ARGS ?=
export TORCH_SPEC TORCH_PIP_ARGS
# one BLAS thread per pytest worker: two workers on two cores, no oversubscription
export OMP_NUM_THREADS ?= 1
export JUPYTER_PLATFORM_DIRS := 1
export PYDEVD_DISABLE_FILE_VALIDATION := 1

.PHONY: venv test docs docs-fast docs-build clean

venv: $(STAMP)

$(STAMP): pyproject.toml tools/install_torch.sh
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	tools/install_torch.sh $(VPY)
	$(VPY) -m pip install -e ".[test,docs,notebooks]"
	touch $@

test: $(STAMP)
	mkdir -p build
	$(VPY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup --nbmake --nbmake-timeout=900 \
		--junitxml=build/junit.xml tests notebooks $(PYTEST_ARGS)

docs: $(STAMP)
	$(VPY) -m mkdocs serve -a 127.0.0.1:8000

docs-fast: $(STAMP)
	DSA_REF_EXECUTE_NOTEBOOKS=false $(VPY) -m mkdocs serve -a 127.0.0.1:8000

docs-build: $(STAMP)
	$(VPY) -m mkdocs build --strict

clean:
	rm -rf $(VENV) site build .cache .pytest_cache *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
