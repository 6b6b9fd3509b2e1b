"""tools/probes/sass_loops.py on a hand-written SASS listing: loops found, counted and left out as documented."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools" / "probes"))

import sass_loops  # noqa: E402

LISTING = """
        code for sm_90a
                Function : main_kernel
        .headerflags    @"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   MOV R1, c[0x0][0x28] ;                       /* 0x00000a0000017a02 */
        /*0010*/                   S2R R0, SR_TID.X ;                           /* 0x0000000000007919 */
        /*0020*/                   WARPGROUP.ARRIVE ;                           /* 0x0000000000007919 */
        /*0030*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR8], RZ, !UPT ; /* 0x0 */
        /*0040*/                   FMNMX.FTZ R2, R24, RZ, !PT ;                 /* 0x0 */
        /*0050*/                   FFMA.FTZ R3, R2, R4, R3 ;                    /* 0x0 */
        /*0060*/               @P0 FFMA.FTZ R5, R2, R4, R5 ;                    /* 0x0 */
        /*0070*/              @!P1 BRA 0x40 ;                                   /* 0x0 */
        /*0080*/                   ISETP.NE.AND P0, PT, R0, RZ, PT ;            /* 0x0 */
        /*0090*/              @!P0 BRA 0x20 ;                                   /* 0x0 */
        /*00a0*/               @P2 BRA 0xc0 ;                                   /* 0x0 */
        /*00b0*/                   EXIT ;                                       /* 0x0 */
        /*00c0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R0 ; /* 0x0 */
        /*00d0*/              @!P0 BRA 0xc0 ;                                   /* 0x0 */
        /*00e0*/                   BRA 0x80 ;                                   /* 0x0 */
                ..........
                Function : other_kernel
        /*0000*/                   EXIT ;                                       /* 0x0 */
"""


def test_parse_finds_every_function_and_instruction():
    functions = sass_loops.parse_sass(LISTING)
    assert [f.name for f in functions] == ["main_kernel", "other_kernel"]
    assert len(functions[0].code) == 15 and functions[0].code[3] == (0x30, "QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR8], RZ, !UPT")
    assert sass_loops.opcode("@P0 FFMA.FTZ R5, R2, R4, R5") == "FFMA.FTZ"


def test_loops_are_backward_branches_before_the_last_exit():
    main = sass_loops.parse_sass(LISTING)[0]
    found = sass_loops.loops(main)
    # 0x70 -> 0x40 (inner) and 0x90 -> 0x20 (outer); the retry stub at 0xc0-0xd0 and the jump back
    # from 0xe0 sit after the EXIT; the forward branch at 0xa0 is no loop
    assert [(lp.start, lp.end, lp.length) for lp in found] == [(0x20, 0x90, 8), (0x40, 0x70, 4)]
    outer, inner = found
    assert outer.mma == 1 and inner.mma == 0
    assert inner.mix == {"FFMA.FTZ": 2, "FMNMX.FTZ": 1, "BRA": 1}, "predicated instructions count by opcode"
    assert [lp.start for lp in sass_loops.loops(main, min_length=5)] == [0x20]


def test_report_lists_each_loop_with_its_mix():
    text = sass_loops.report(sass_loops.parse_sass(LISTING)[0], min_length=1, top=2)
    assert text.splitlines()[0] == "main_kernel: 15 instructions"
    assert "loop 0x0020-0x0090: 8 instructions, 1 MMA | FFMA.FTZ 2, BRA 2" in text  # the inner loop is inside


def test_tails_are_the_code_after_outermost_loops_up_to_exit():
    main = sass_loops.parse_sass(LISTING)[0]
    # the outer loop ends at 0x90; 0xa0 (a forward branch) runs before the EXIT at 0xb0; the inner
    # loop (0x40-0x70) lies inside the outer one and has no tail of its own
    assert [(t.start, t.length, t.mix) for t in sass_loops.tails(main)] == [(0xa0, 1, {"BRA": 1})]
    assert sass_loops.tails(main, min_length=9) == [], "no loop of 9 instructions"
    assert [t.start for t in sass_loops.tails(main, min_length=8)] == [0xa0]
    text = sass_loops.report(main, min_length=1, top=2, with_tails=True)
    assert text.splitlines()[-1] == "  tail 0x00a0: 1 instructions to EXIT | BRA 1"
    assert "tail" not in sass_loops.report(main, min_length=1, top=2)


def test_mma_shapes_operand_sources_and_shared_memory_ceilings():
    ss = sass_loops.mma_shape("HGMMA.64x16x16.F32.BF16 R24, gdesc[UR8], R24, gsb0")
    assert (ss.kind, ss.m, ss.n, ss.k, ss.a_in_registers) == ("HGMMA", 64, 16, 16, False)
    assert ss.smem_bytes == (64 * 16 + 16 * 16) * 2 and ss.macs == 16384
    assert abs(ss.ceiling - 0.4) < 1e-12  # 128 B a clock / (2560 B per 16384 MAC at 2048 MAC a clock)
    wide = sass_loops.mma_shape("HGMMA.64x32x16.F32.BF16 R24, gdesc[UR8], R24")
    assert abs(wide.ceiling - 2 / 3) < 1e-12
    rs = sass_loops.mma_shape("@P0 HGMMA.64x256x16.F32.BF16 R24, R152, gdesc[UR8].tnspB, R24")
    assert rs.a_in_registers and rs.smem_bytes == 16 * 256 * 2 and rs.ceiling == 1.0
    fp8 = sass_loops.mma_shape("QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR8], RZ, !UPT")
    assert (fp8.kind, fp8.a_bytes, fp8.b_bytes, fp8.smem_bytes) == ("QGMMA", 1, 1, 64 * 32 + 128 * 32)
    assert fp8.ceiling == 1.0 and str(fp8) == "QGMMA.64x128x32 SS"
    assert sass_loops.mma_shape("FFMA.FTZ R3, R2, R4, R3") is None


def test_report_with_mma_gives_each_loops_shapes_and_ceiling():
    main = sass_loops.parse_sass(LISTING)[0]
    outer, inner = sass_loops.loops(main)
    assert [(str(s), n) for s, n in sass_loops.mma_mix(main, outer)] == [("QGMMA.64x128x32 SS", 1)]
    assert sass_loops.mma_mix(main, inner) == []
    slow, fast = sass_loops.mma_shape("HGMMA.64x16x16.F32.BF16 R24, gdesc[UR8], R24"), \
        sass_loops.mma_shape("HGMMA.64x256x16.F32.BF16 R24, gdesc[UR8], R24")
    # 68 slow products of 16 K MAC at 40 % and 2 of 256 K at 100 %: time at full rate / time capped
    full, capped = 68 * 16384 + 2 * 262144, 68 * 16384 / 0.4 + 2 * 262144
    assert abs(sass_loops.mma_ceiling([(slow, 68), (fast, 2)]) - full / capped) < 1e-12
    text = sass_loops.report(main, min_length=1, top=2, with_mma=True)
    assert "    QGMMA.64x128x32 SS x1: 6144 B of shared memory per 262144 multiply-adds, at most 100% of" in text
    assert "    the loop's MMAs: at most 100% of the tensor cores' rate" in text
    assert "shared memory" not in sass_loops.report(main, min_length=1, top=2)
