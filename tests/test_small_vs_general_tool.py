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
    assert "PROBLEM" not in capsys.readouterr().out and tool.problems(table, rep) == []


def test_a_broken_small_op_is_the_first_stage_named(tool, capsys):
    from ddtree_rtc.reference.mla_small import mla_kv_rows_small, mla_query_small

    model = _model(tool)

    def shifted(q, w_uk, positions, inv_freq, rope_scale=1.0, out=None, rows=None):
        """The query's RoPE a position off; the cache rows of the same launch right."""
        if rows is not None:
            kv, norm_w, eps, cache, slots = rows
            mla_kv_rows_small(kv, norm_w, eps, positions, inv_freq, rope_scale, cache, slots)
        return mla_query_small(q, w_uk, positions + np.int32(1), inv_freq, rope_scale, out)

    model.backend._ops["mla_query_small"] = shifted
    table, rep = tool.replay(model, 3, 7, 200, True)
    assert not tool.print_report(table, rep)
    assert table.first_beyond("forced")["stage"] == "L0 q_att"
    later = [r for r in table.rows if r["stage"] in ("L0 kv_a", "L0 cache rows", "L0 attn o_lat")]
    assert all(not r["forced"].any() for r in later)  # fed the general input, the stages after it agree
    assert "PROBLEM: forced: first stage beyond tolerance L0 q_att" in capsys.readouterr().out


def test_a_parted_forward_row_is_excused_only_by_a_near_tie_flip_in_it(tool):
    """problems(): a row of the forward logits beyond the bound is a defect unless the free run flipped
    that row's experts at a margin under NEAR_TIE; a flip in another row, or at a wide margin, or
    with no margin known (NaN) excuses nothing."""
    import copy

    table, rep = tool.replay(_model(tool), 3, 7, 200, True)
    assert tool.problems(table, rep) == []
    parted = copy.deepcopy(rep)
    parted["forward"]["per_row"][1] = 0.2

    def flip(row, margin, run="free"):
        return {"run": run, "layer": 1, "row": row, "small_only": [3], "general_only": [5], "margin": margin,
                "group_margin": float("nan")}

    for flips, excused in (([], False), ([flip(1, tool.NEAR_TIE / 4)], True), ([flip(0, tool.NEAR_TIE / 4)], False),
                           ([flip(1, tool.NEAR_TIE * 4)], False), ([flip(1, float("nan"))], False),
                           ([flip(1, tool.NEAR_TIE / 4, run="forced")], False)):
        parted["topk_flips"] = flips
        found = tool.problems(table, parted)
        assert (found == []) is excused, (flips, found)
        assert excused or any("forward logits row 1 " in f for f in found)
