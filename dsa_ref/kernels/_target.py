"""Which CUDA target TileLang compiles for.

On a GPU machine TileLang detects the device ("auto"). Without a GPU (a CPU machine with nvcc, as
in development) ``DSA_REF_TILELANG_ARCH=sm_90a`` compiles for Hopper anyway, which checks that a
kernel lowers and builds without running it.
"""

from __future__ import annotations

import os


def compile_target():
    arch = os.environ.get("DSA_REF_TILELANG_ARCH")
    if arch:
        return {"kind": "cuda", "arch": arch}
    return "auto"
