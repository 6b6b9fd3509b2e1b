"""The warp-specialised kernels' barrier protocols, run as CPU models (`tools/probes/barrier_models.py`).

The persistent staggered forward: random sequences of tiles with 0 to 4 pairs each, under random
interleavings of its three warpgroups, finish without a deadlock or a buffer hazard; and each of
three broken protocols (the next ``Q`` loaded before the other consumer has stored its output,
a stage half freed before its validity flags are read, phases counted per tile instead of per
block) is caught. The fp8 indexer's ping-pong protocol likewise.
"""

import importlib.util
import random
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "tools" / "probes" / "barrier_models.py"
_spec = importlib.util.spec_from_file_location("barrier_models", _PATH)
models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(models)


def test_staggered_forward_protocol_holds_over_tiles():
    rnd = random.Random(1)
    for case in range(60):
        tiles = [rnd.choice([0, 1, 2, 3, 4]) for _ in range(rnd.randint(0, 5))]
        for seed in range(10):
            assert models.run(tiles, seed)


@pytest.mark.parametrize("mutation", ["no_q_free", "mask_late_free", "one_phase"])
def test_staggered_forward_model_catches_broken_protocols(mutation):
    caught = 0
    for seed in range(50):
        try:
            models.run([3, 1, 2, 4], seed, mutation)
        except models.Hazard:
            caught += 1
    assert caught > 0


def test_fp8_indexer_pingpong_protocol_holds():
    for n_tiles in range(8):
        for seed in range(40):
            models.run_fp8(n_tiles, seed)
