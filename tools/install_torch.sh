#!/usr/bin/env bash
# Install PyTorch into a virtual environment BEFORE the project itself.
#
# Why: the project asks for "torch>=2.4". On a machine without torch, pip would
# satisfy that with the default (multi-GB, CUDA) wheel. Installing the right
# build first makes pip leave torch alone afterwards.
#
# Usage: tools/install_torch.sh PYTHON
#   TORCH_SPEC      e.g. "torch==2.13.0": install exactly this (pip keeps an
#                   installed torch that already satisfies it)
#   TORCH_PIP_ARGS  extra pip arguments, e.g. "--index-url https://download.pytorch.org/whl/cu124"
# Without TORCH_SPEC: keep an importable torch >= 2.4; else on a machine with
# nvidia-smi install the default build; else install from the PyTorch CPU index
# if it quietly answers that it has a build for this Python, and otherwise
# torch==2.13.0 from the default index.
set -euo pipefail

PY=${1:?usage: install_torch.sh PYTHON}
CPU_INDEX=https://download.pytorch.org/whl/cpu
FALLBACK_SPEC=torch==2.13.0

pip_install() { "$PY" -m pip install "$@"; }

if [[ -n "${TORCH_SPEC:-}" ]]; then
    echo "install_torch: TORCH_SPEC=$TORCH_SPEC ${TORCH_PIP_ARGS:-}"
    # shellcheck disable=SC2086  # TORCH_PIP_ARGS is a list of words on purpose
    pip_install "$TORCH_SPEC" ${TORCH_PIP_ARGS:-}
    exit 0
fi

if "$PY" -W ignore -c '
import sys, torch
major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 4) else 1)
' 2>/dev/null; then
    echo "install_torch: keeping torch $("$PY" -c 'import torch; print(torch.__version__)')"
    exit 0
fi

if command -v nvidia-smi >/dev/null 2>&1; then
    echo "install_torch: nvidia-smi found, installing the default (CUDA) build"
    # shellcheck disable=SC2086
    pip_install "torch>=2.4" ${TORCH_PIP_ARGS:-}
    exit 0
fi

# Only the CPU index: without the machine's pip config, so that no local find-links or extra index
# can hand us a CUDA wheel instead. First ask it quietly whether it has a build for this Python
# (`pip index versions` downloads nothing; short timeout, no retries): where the index is
# unreachable or has no matching wheel, pip would otherwise print a red "Could not find a version"
# error before the fallback below succeeds.
cpu_pip() { env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL PIP_CONFIG_FILE=/dev/null "$PY" -m pip "$@"; }
cpu_torch=$(cpu_pip index versions torch --index-url "$CPU_INDEX" --timeout 10 --retries 0 2>/dev/null \
            | sed -n 's/^torch (\([^)]*\)).*/\1/p' || true)
if [[ -n "$cpu_torch" ]]; then
    echo "install_torch: no GPU; installing the CPU build from the PyTorch CPU index (newest: $cpu_torch)"
    if cpu_pip install --index-url "$CPU_INDEX" --timeout 10 --retries 0 "torch>=2.4"; then
        exit 0
    fi
fi

echo "install_torch: no GPU and no CPU build reachable on the PyTorch CPU index; installing $FALLBACK_SPEC from the default index"
pip_install "$FALLBACK_SPEC"
