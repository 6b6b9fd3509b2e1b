"""The loops of a compiled kernel, read from its SASS: the length, the MMA instructions and the
instruction mix of each, to count what a kernel issues per tile without a GPU.

    python tools/probes/sass_loops.py indexer_fp8 [--kw '{"consumers": 3, "stages": 4}']
    python tools/probes/sass_loops.py forward [--tails]   # --tails: each role's epilogue too
    python tools/probes/sass_loops.py --binary flashmla_sparse_sm90.so [--function 0]   # any cubin or .so
    python tools/probes/sass_loops.py --sass listing.sass                               # a cuobjdump -sass listing
    python tools/probes/sass_loops.py --binary pass_a.cubin --mma                        # + each loop's MMA shapes

Kernels: ``indexer`` and ``indexer_fp8`` (the persistent schedule the wrappers run, 64 heads,
``--kw`` for other knobs), ``forward`` (the staggered sparse MLA forward, 128 heads, int64
indices). The kernel is compiled on the CPU: TileLang writes its CUDA source for sm_90a, ``nvcc
-cubin`` compiles it (``-Xptxas -v`` prints registers and spills) and ``cuobjdump -sass``
disassembles it. Needs TileLang, the CUDA toolkit's ``nvcc``, and ``cuobjdump`` (the toolkit's, or
``pip install nvidia-cuda-cuobjdump``; ``--cuobjdump`` names it).

A loop is a backward branch inside a function's code; the stubs after its last ``EXIT`` (the
retry loops of barrier waits) are left out. Its length is static: every instruction between the
branch target and the branch, on all paths through the body (a branch that skips part of the body
on most passes, as the branches of a pair boundary do, counts it anyway).
Nested loops are listed each on its own, so an outer loop's length includes its inner ones. Counts
are per warp and per pass: a warp-specialised kernel's roles are separate loops (find them by their
instruction mix).

``--mma`` adds, per loop, its warpgroup MMA shapes, where their ``A`` operand comes from (shared
memory, ``SS``, or registers, ``RS``; ``B`` is always in shared memory), the bytes each reads from
shared memory per multiply-add, and what that allows: a model in which shared memory delivers
`SMEM_BYTES_PER_CLOCK` bytes a clock to an SM whose tensor cores do `MAC_PER_CLOCK` multiply-adds
a clock (Hopper, dense). A ``64x16x16`` bf16 product with both operands in shared memory reads
2.5 KB for 16 K multiply-adds, 2.5 times what it may: at most 40 % of the tensor cores' rate.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_LINE = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH_TARGET = re.compile(r"\bBRA\s+(?:`\()?(?:\S+,\s*)?(0x[0-9a-f]+)")


@dataclass
class Function:
    name: str
    code: list[tuple[int, str]] = field(default_factory=list)  # (address, instruction) in order

    @functools.cached_property
    def index(self) -> dict[int, int]:
        """Address -> position in ``code`` (read once the listing is parsed)."""
        return {address: i for i, (address, _) in enumerate(self.code)}


@dataclass
class Loop:
    start: int  # address of the branch target (the loop's first instruction)
    end: int  # address of the backward branch
    length: int  # instructions from start to end, both included
    mma: int  # warpgroup MMA instructions (HGMMA, QGMMA, ...) among them
    mix: dict[str, int]  # opcode -> count, most common first


def parse_sass(text: str) -> list[Function]:
    """The functions of a ``cuobjdump -sass`` listing, each with its ``(address, instruction)`` lines."""
    functions: list[Function] = []
    for line in text.splitlines():
        if "Function :" in line:
            functions.append(Function(line.split("Function :", 1)[1].strip()))
            continue
        m = _LINE.match(line)
        if m and functions:
            functions[-1].code.append((int(m.group(1), 16), m.group(2).strip()))
    return functions


def opcode(instruction: str) -> str:
    """``FFMA.FTZ`` of ``@!P0 FFMA.FTZ R1, R2, R3, R4``: the opcode, without its predicate."""
    words = instruction.split()
    return words[1] if words[0].startswith("@") and len(words) > 1 else words[0]


def loops(function: Function, min_length: int = 1) -> list[Loop]:
    """Every backward branch before the function's last ``EXIT``, as a `Loop`, by start address."""
    code, index = function.code, function.index
    exits = [i for i, (_, ins) in enumerate(code) if opcode(ins) == "EXIT"]
    last = exits[-1] if exits else len(code)
    found = []
    for i, (address, ins) in enumerate(code[:last]):
        if opcode(ins) != "BRA":
            continue
        m = _BRANCH_TARGET.search(ins)
        target = int(m.group(1), 16) if m else None
        if target is None or target >= address or target not in index:
            continue
        body = code[index[target]:i + 1]
        if len(body) < min_length:
            continue
        mix = collections.Counter(opcode(b) for _, b in body)
        found.append(Loop(target, address, len(body), sum(n for op, n in mix.items() if "GMMA" in op),
                          dict(mix.most_common())))
    return sorted(found, key=lambda loop: (loop.start, loop.end))


@dataclass
class Tail:
    start: int  # address of the first instruction after an outermost loop
    length: int  # instructions from there up to the next ``EXIT``, not included
    mix: dict[str, int]  # opcode -> count, most common first


def tails(function: Function, min_length: int = 1) -> list[Tail]:
    """The code after each outermost loop of at least ``min_length`` instructions up to the next
    ``EXIT``: a role's epilogue, run once per block, whose cost shows in a kernel of one block per
    SM as the gap before the next block starts (the loops' counts leave it out). Only a role's last
    loop before an ``EXIT`` has a tail: not a loop inside another one, not one that another loop
    follows, not one followed directly by ``EXIT``; shorter loops (a barrier's wait) are not counted
    as loops here."""
    code, index = function.code, function.index
    found = loops(function, min_length)
    outermost = [lp for lp in found if not any(o.start <= lp.start and lp.end <= o.end and o != lp for o in found)]
    result = []
    for loop in outermost:
        after = code[index[loop.end] + 1:]
        stop = next((i for i, (_, ins) in enumerate(after) if opcode(ins) == "EXIT"), len(after))
        if stop == 0 or any(after[0][0] <= o.start < after[stop - 1][0] for o in outermost):
            continue  # no tail, or another loop follows before the EXIT (the tail is that one's)
        mix = collections.Counter(opcode(ins) for _, ins in after[:stop])
        result.append(Tail(after[0][0], stop, dict(mix.most_common())))
    return result


SMEM_BYTES_PER_CLOCK = 128  # shared memory per SM per clock (H100 / H200: about 31 TB/s over 132 SMs)
MAC_PER_CLOCK = {"HGMMA": 2048, "QGMMA": 4096, "IGMMA": 4096}  # dense, per SM per clock: bf16/fp16, fp8, int8
ELEMENT_BYTES = {"BF16": 2, "F16": 2, "TF32": 4, "E4M3": 1, "E5M2": 1, "S8": 1, "U8": 1}
_MMA = re.compile(r"^([HQI]GMMA)\.(\d+)x(\d+)x(\d+)\.[A-Z0-9]+\.([A-Z0-9]+)(?:\.([A-Z0-9]+))?")


@dataclass(frozen=True)
class MmaShape:
    kind: str  # HGMMA (bf16 / fp16 / tf32), QGMMA (fp8), IGMMA (int8)
    m: int
    n: int
    k: int
    a_in_registers: bool  # RS (A from registers) or SS (both from shared memory)
    a_bytes: int  # bytes of one A element
    b_bytes: int

    @property
    def macs(self) -> int:
        return self.m * self.n * self.k

    @property
    def smem_bytes(self) -> int:
        """Bytes read from shared memory per instruction: ``B`` (``k x n``), and ``A`` (``m x k``) for SS."""
        return self.k * self.n * self.b_bytes + (0 if self.a_in_registers else self.m * self.k * self.a_bytes)

    @property
    def ceiling(self) -> float:
        """The largest share of the tensor cores' rate shared memory allows this shape (the model)."""
        return min(1.0, SMEM_BYTES_PER_CLOCK * self.macs / (MAC_PER_CLOCK[self.kind] * self.smem_bytes))

    def __str__(self) -> str:
        return f"{self.kind}.{self.m}x{self.n}x{self.k} {'RS' if self.a_in_registers else 'SS'}"


def mma_shape(instruction: str) -> MmaShape | None:
    """The `MmaShape` of a warpgroup MMA instruction (``HGMMA.64x32x16.F32.BF16 R24, gdesc[UR8], R24``),
    ``None`` for any other instruction."""
    m = _MMA.match(opcode(instruction))
    if not m:
        return None
    kind, mm, n, k, a_type, b_type = m.groups()
    operands = instruction.split(m.group(0), 1)[1].split(",")  # the accumulator, then A
    a_in_registers = len(operands) > 1 and not operands[1].strip().startswith("gdesc")
    return MmaShape(kind, int(mm), int(n), int(k), a_in_registers, ELEMENT_BYTES[a_type],
                    ELEMENT_BYTES[b_type or a_type])


def mma_mix(function: Function, loop: Loop) -> list[tuple[MmaShape, int]]:
    """The warpgroup MMA shapes of a loop and how many of each, most multiply-adds first."""
    body = function.code[function.index[loop.start]:function.index[loop.end] + 1]
    found = collections.Counter(filter(None, (mma_shape(ins) for _, ins in body)))
    return sorted(found.items(), key=lambda item: -item[0].macs * item[1])


def mma_ceiling(mix: list[tuple[MmaShape, int]]) -> float:
    """The loop's MMAs together: their time at the full rate over their time at each shape's ceiling."""
    full = sum(shape.macs * n / MAC_PER_CLOCK[shape.kind] for shape, n in mix)
    capped = sum(shape.macs * n / (MAC_PER_CLOCK[shape.kind] * shape.ceiling) for shape, n in mix)
    return full / capped if capped else 1.0


def report(function: Function, min_length: int, top: int, with_tails: bool = False, with_mma: bool = False) -> str:
    """One line per loop: addresses, length, MMA count, the ``top`` most common opcodes; with
    ``with_tails``, one line per outermost loop's tail too (`tails`); with ``with_mma``, a line per
    MMA shape of each loop (`mma_mix`) and the loop's shared-memory ceiling (`mma_ceiling`)."""
    lines = [f"{function.name[:100]}: {len(function.code)} instructions"]
    for loop in loops(function, min_length):
        mix = ", ".join(f"{op} {n}" for op, n in list(loop.mix.items())[:top])
        lines.append(f"  loop {loop.start:#06x}-{loop.end:#06x}: {loop.length} instructions, {loop.mma} MMA | {mix}")
        shapes = mma_mix(function, loop) if with_mma else []
        for shape, n in shapes:
            lines.append(f"    {shape} x{n}: {shape.smem_bytes} B of shared memory per {shape.macs} multiply-adds, "
                         f"at most {shape.ceiling:.0%} of the tensor cores' rate")
        if shapes:
            lines.append(f"    the loop's MMAs: at most {mma_ceiling(shapes):.0%} of the tensor cores' rate")
    if with_tails:
        for tail in tails(function, min_length):
            mix = ", ".join(f"{op} {n}" for op, n in list(tail.mix.items())[:top])
            lines.append(f"  tail {tail.start:#06x}: {tail.length} instructions to EXIT | {mix}")
    return "\n".join(lines)


def kernel_source(name: str, kw: dict) -> str:
    """The CUDA source TileLang writes for one of dsa_ref's kernels (compiled for sm_90a, on the CPU)."""
    os.environ.setdefault("DSA_REF_TILELANG_ARCH", "sm_90a")
    sys.path.insert(0, str(ROOT))
    if name in ("indexer", "indexer_fp8"):
        from dsa_ref.kernels.shapes import INDEXER_DEFAULT, INDEXER_FP8_DEFAULT, INDEXER_DIM

        if name == "indexer":
            from dsa_ref.kernels.indexer_fwd import indexer_kernel as build
        else:
            from dsa_ref.kernels.indexer_fwd_fp8 import indexer_fp8_kernel as build
        kernel = build(64, INDEXER_DIM, True, **(kw or (INDEXER_DEFAULT if name == "indexer" else INDEXER_FP8_DEFAULT)))
    elif name == "forward":
        from dsa_ref.kernels.shapes import DIM, DIM_V, SM_SCALE
        from dsa_ref.kernels.sparse_mla_fwd import staggered_kernel

        kernel = staggered_kernel(128, DIM, DIM_V, SM_SCALE, kw.get("index_dtype", "int64"))
    else:
        raise ValueError(f"unknown kernel {name!r}: indexer, indexer_fp8 or forward")
    return kernel.get_kernel_source()


def compile_cubin(source: str, workdir: Path) -> tuple[Path, str]:
    """``(cubin, ptxas_info)`` of a TileLang CUDA source: ``nvcc -cubin -Xptxas -v`` for sm_90a; the info
    is ptxas's lines (registers, spills, and its advisories such as ``(C7515)``)."""
    import tilelang

    package = Path(tilelang.__file__).parent
    cu, cubin = workdir / "kernel.cu", workdir / "kernel.cubin"
    cu.write_text(source)
    nvcc = subprocess.run(["nvcc", "-arch=sm_90a", "-std=c++17", "-O3", "--use_fast_math", "-cubin", "-Xptxas", "-v",
                           f"-I{package / 'src'}", f"-I{package / '3rdparty' / 'cutlass' / 'include'}",
                           "-o", str(cubin), str(cu)], capture_output=True, text=True)
    if nvcc.returncode:
        raise RuntimeError(f"nvcc failed:\n{nvcc.stderr[-4000:]}")
    info = "\n".join(line.strip() for line in nvcc.stderr.splitlines() if "ptxas info" in line or "spill" in line)
    return cubin, info


def compile_to_sass(source: str, cuobjdump: str, workdir: Path) -> tuple[str, str]:
    """``(sass, ptxas_info)`` of a TileLang CUDA source: `compile_cubin`, then ``cuobjdump -sass``."""
    cubin, info = compile_cubin(source, workdir)
    return disassemble(cubin, cuobjdump), info


def disassemble(binary: Path, cuobjdump: str) -> str:
    """``cuobjdump -sass`` of a cubin or of the device code in a shared object."""
    out = subprocess.run([cuobjdump, "-sass", str(binary)], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"cuobjdump failed: {out.stderr[-2000:]}")
    return out.stdout


def find_cuobjdump(given: str | None) -> str:
    """``--cuobjdump``, else the one on PATH, else the one of the ``nvidia-cuda-cuobjdump`` wheel."""
    if given:
        return given
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import nvidia

        for base in nvidia.__path__:
            for candidate in Path(base).glob("*/bin/cuobjdump"):
                return str(candidate)
    except ImportError:
        pass
    raise SystemExit("no cuobjdump: install the CUDA toolkit or `pip install nvidia-cuda-cuobjdump`, or pass --cuobjdump")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel", nargs="?", choices=["indexer", "indexer_fp8", "forward"])
    parser.add_argument("--kw", default="{}", help="the kernel builder's knobs, as JSON")
    parser.add_argument("--sass", type=Path, help="read this cuobjdump -sass listing instead of compiling")
    parser.add_argument("--binary", type=Path, help="disassemble this cubin or shared object instead of compiling")
    parser.add_argument("--function", type=int, default=None, help="only this function of the listing (index)")
    parser.add_argument("--min-length", type=int, default=40, help="leave out shorter loops (default 40)")
    parser.add_argument("--top", type=int, default=10, help="opcodes shown per loop")
    parser.add_argument("--tails", action="store_true", help="also the code after each outermost loop, up to EXIT")
    parser.add_argument("--mma", action="store_true", help="also each loop's MMA shapes and their shared-memory ceiling")
    parser.add_argument("--cuobjdump", default=None)
    args = parser.parse_args(argv)
    if args.sass:
        text = args.sass.read_text()
    elif args.binary:
        text = disassemble(args.binary, find_cuobjdump(args.cuobjdump))
    elif args.kernel:
        with tempfile.TemporaryDirectory() as tmp:
            text, info = compile_to_sass(kernel_source(args.kernel, json.loads(args.kw)),
                                         find_cuobjdump(args.cuobjdump), Path(tmp))
        print(info)
    else:
        parser.error("name a kernel, or give --sass or --binary")
    functions = parse_sass(text)
    chosen = functions if args.function is None else [functions[args.function]]
    print("\n".join(report(f, args.min_length, args.top, args.tails, args.mma) for f in chosen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
