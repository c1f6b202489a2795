"""tools/sass_steps.py: the step paths of a loop in SASS text (a hand-made listing), and moe_small_gate_up_t2's
sm_90a step against issue 45's instruction budget (NVRTC and nvdisasm, no GPU)."""

import pytest

LISTING = """
//--------------------- .text.k --------------------------
k:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   DEPBAR.LE SB0, 0x3 ;
        /*0020*/                   LDS.128 R4, [R2] ;
        /*0030*/              @P1 BRA `(.L_x_2) ;
        /*0040*/                   @!PT LDS RZ, [RZ] ;
        /*0050*/                   LDGSTS.E.128 [R2], desc[UR4][R8.64] ;
        /*0060*/                   IADD3 R8, P2, R8, 0x2400, RZ ;
.L_x_2:
        /*0070*/                   LDG.E.128.CONSTANT R12, desc[UR4][R10.64] ;
        /*0080*/                   LOP3.LUT R16, R4, 0xf000f, R17, 0xea, !PT ;
        /*0090*/                   HMMA.16816.F32.BF16 R20, R16, R12, R20 ;
        /*00a0*/              @!P3 BRA `(.L_x_3) ;
        /*00b0*/                   LDG.E.128.CONSTANT R12, desc[UR4][R14.64] ;
        /*00c0*/                   HMMA.16816.F32.BF16 R24, R16, R12, R24 ;
.L_x_3:
        /*00d0*/                   ISETP.GE.AND P0, PT, R3, R5, PT ;
        /*00e0*/              @!P0 BRA `(.L_x_1) ;
        /*00f0*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0100*/                   EXIT ;
"""


def test_paths_by_loads_and_copies(load_tool):
    tool = load_tool("sass_steps")
    ins, labels = tool.parse(LISTING, "k")
    (paths,) = tool.step_paths(ins, labels, "DEPBAR.LE SB0, 0x3")
    spans, _ = tool.blocks(ins, labels)
    size = {key: sum(spans[k][1] - spans[k][0] for k in p) for key, p in paths.items()}
    # wait 3 + copies 3 + compute 4 + second column 2 + loop 2
    assert size == {(1, 0): 9, (1, 1): 12, (2, 0): 11, (2, 1): 14}
    text = tool.report(LISTING, "k", "DEPBAR.LE SB0, 0x3")
    assert "14 instructions per step with 2 LDG, 1 LDGSTS" in text and "LDS never executed 1" in text
    with pytest.raises(ValueError, match="'nope' not in the SASS"):
        tool.parse(LISTING, "nope")


def test_gate_up_t2_step_budget(load_tool):
    """Issue 45: the one-column-tile step (every expert at 33..64 rows) at most 256 instructions with its
    refill copies (348 before), and the two-column-tile step unpacking each chunk once (64 LOP3)."""
    from ddtree_rtc.kernels.registry import spec
    from ddtree_rtc.rtc import build
    from ddtree_rtc.rtc.disasm import find_tool, sass

    if find_tool("nvdisasm") is None and find_tool("cuobjdump") is None:
        pytest.skip("no disassembler (pip install nvidia-cuda-nvdisasm)")
    tool = load_tool("sass_steps")
    text = sass(build(spec("moe_small"), "sm_90a").cubin)
    ins, labels = tool.parse(text, "moe_small_gate_up_t2")
    spans, _ = tool.blocks(ins, labels)
    found = {}
    for paths in tool.step_paths(ins, labels, "DEPBAR.LE SB0, 0x3"):
        for key, p in paths.items():
            found[key] = [ins[i] for k in p for i in range(*spans[k])]
    assert len(found[(4, 6)]) <= 256, len(found[(4, 6)])
    assert sum(tool.klass(i) == "LOP3 unpack" for i in found[(8, 6)]) == 64
