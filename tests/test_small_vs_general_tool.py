"""tools/small_vs_general.py (the GPU diagnostic of the small-M path against the general kernels) on
the numpy backend, where both paths share their references: every stage equal, model.forward equal
to the stage replay; and a broken small-path op (RoPE positions off by one in mla_query_small) is
named as the first stage beyond tolerance with the general path's input."""

import types

import numpy as np
import pytest


@pytest.fixture(scope="module")
def tool(load_tool):
    return load_tool("small_vs_general")


def _model(tool):
    args = types.SimpleNamespace(backend="numpy", preset="tiny", layers=None, seed=0, moe_layers=1)
    return tool.build_model(args)


def test_numpy_paths_agree_stage_by_stage(tool, capsys):
    table, rep = tool.replay(_model(tool), 3, 7, 200, True)
    assert tool.print_report(table, rep)
    assert any(r["stage"] == "L1 q_att" for r in rep["stages"]) and any("MoE out" in r["stage"] for r in rep["stages"])
    for r in table.rows:
        for which in ("forced", "free"):
            assert r[which] is None or not r[which].any(), (r["stage"], which)
    assert rep["forward"]["rel"] == 0 and all(rep["forward"]["equals_replay"].values())
    assert all(rep["forward"]["deterministic"].values()) and not rep["topk_flips"]
    assert not any(v for s in rep["stray_cache_rows"].values() for v in s.values())
    assert "FIRST STAGE BEYOND" not in capsys.readouterr().out


def test_a_broken_small_op_is_the_first_stage_named(tool, capsys):
    from ddtree_rtc.reference.mla_small import mla_query_small

    model = _model(tool)

    def shifted(q, w_uk, positions, inv_freq, rope_scale=1.0, out=None):
        return mla_query_small(q, w_uk, positions + np.int32(1), inv_freq, rope_scale, out)

    model.backend._ops["mla_query_small"] = shifted
    table, rep = tool.replay(model, 3, 7, 200, True)
    assert not tool.print_report(table, rep)
    assert table.first_beyond("forced")["stage"] == "L0 q_att"
    later = [r for r in table.rows if r["stage"] in ("L0 kv_a", "L0 cache rows", "L0 attn o_lat")]
    assert all(not r["forced"].any() for r in later)  # fed the general input, the stages after it agree
    assert "FIRST STAGE BEYOND TOLERANCE: L0 q_att" in capsys.readouterr().out
