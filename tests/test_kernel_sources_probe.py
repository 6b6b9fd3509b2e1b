"""tools/probes/kernel_sources.py without a GPU or TileLang: ptxas's report read, two dumps compared."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools" / "probes"))

import kernel_sources  # noqa: E402

# what nvcc -Xptxas -v printed for a staggered forward whose O rescale sat behind a branch
SERIALIZED_INFO = """\
ptxas info    : 2 bytes gmem
ptxas info    : Compiling entry function 'main_kernel' for 'sm_90a'
ptxas info    : (C7517) warpgroup.wait is injected in around line 9458 by compiler to allow use of registers defined by GMMA in function 'main_kernel'
ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized due to non wgmma instructions defining accumulator registers of a wgmma between start and end of the pipeline stage in the function 'main_kernel'
ptxas info    : Function properties for main_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 10 barriers, 2048 bytes smem"""

# an fp8 indexer schedule with too few registers for its MMA pipeline
REGISTER_BOUND_INFO = """\
ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to insufficient register resources for the function 'main_kernel'
    560 bytes stack frame, 560 bytes spill stores, 564 bytes spill loads
ptxas info    : Used 128 registers, used 3 barriers"""

SPILLING_INFO = """\
ptxas info    : Function properties for main_kernel
    192 bytes stack frame, 192 bytes spill stores, 236 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers"""


def test_parse_ptxas_reads_registers_spills_and_advisories():
    rep = kernel_sources.parse_ptxas(SERIALIZED_INFO)
    assert rep == {"registers": 168, "spill_stores": 0, "spill_loads": 0, "advisories": ["C7517", "C7515"],
                   "serialized": True}
    rep = kernel_sources.parse_ptxas(SPILLING_INFO)
    assert rep == {"registers": 255, "spill_stores": 192, "spill_loads": 236, "advisories": [],
                   "serialized": False}
    rep = kernel_sources.parse_ptxas(REGISTER_BOUND_INFO)
    assert rep["advisories"] == ["C7512"] and rep["serialized"]
    assert kernel_sources.parse_ptxas("")["registers"] is None


def _dump(folder: Path, sources: dict) -> Path:
    folder.mkdir()
    manifest = []
    for i, (job, text) in enumerate(sources.items()):
        (folder / f"{i}.cu").write_text(text)
        manifest.append([i, job, kernel_sources.hashlib.sha1(text.encode()).hexdigest()])
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def test_compare_names_the_kernels_whose_source_changed(tmp_path, capsys):
    before = _dump(tmp_path / "a", {"('simple', 64)": "A", "('staggered', 128)": "B"})
    same = _dump(tmp_path / "b", {"('simple', 64)": "A", "('staggered', 128)": "B"})
    changed = _dump(tmp_path / "c", {"('simple', 64)": "A", "('staggered', 128)": "B2"})
    other = _dump(tmp_path / "d", {"('simple', 64)": "A"})
    assert kernel_sources.compare(before, same) == 0
    assert kernel_sources.compare(before, changed) == 1
    assert "1.cu differs: ('staggered', 128)" in capsys.readouterr().out
    assert kernel_sources.compare(before, other) == 2
