"""The warp-specialised kernels' barrier protocols, run as CPU models (`tools/probes/barrier_models.py`).

The staggered forward with 0 to 6 pairs, under random interleavings of its three warpgroups,
finishes without a deadlock or a buffer hazard; and each of three broken protocols (a stage's
validity flags read after its first half is handed back, ``P_0`` read without its named barrier,
stage 1's first half handed back before consumer 0's product from it is waited for) is caught.
The fp8 indexer's ping-pong protocol likewise holds.
"""

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "tools" / "probes" / "barrier_models.py"
_spec = importlib.util.spec_from_file_location("barrier_models", _PATH)
models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(models)


@pytest.mark.parametrize("pairs", range(7))
def test_staggered_forward_protocol_holds(pairs):
    for seed in range(100):
        assert models.run(pairs, seed)


@pytest.mark.parametrize("mutation", ["count_early", "flags_late", "no_p_sync", "free_early"])
def test_staggered_forward_model_catches_broken_protocols(mutation):
    caught = 0
    for seed in range(50):
        try:
            models.run(3, seed, mutation)
        except models.Hazard:
            caught += 1
    assert caught > 0


def test_fp8_indexer_pingpong_protocol_holds():
    for n_tiles in range(8):
        for seed in range(40):
            models.run_fp8(n_tiles, seed)
