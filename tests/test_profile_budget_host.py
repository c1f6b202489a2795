"""tools/profile_budget_host.py: the auto budget's per-round host work on the CPU, timed by function."""

import json


def test_the_profile_times_every_budget_function_and_writes_json(load_tool, tmp_path):
    tool = load_tool("profile_budget_host")
    out = tmp_path / "prof.json"
    assert tool.main(["--batches", "1,3", "--rounds", "12", "--reps", "1", "--vocab", "1000", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 3] and all(r["rounds"] == 12 for r in rows)
    for r in rows:
        assert r["stage_us"] > 0 and {"read_tree", "stage_cut", "apply_cut", "learn: AutoBudget.learn"} <= set(r["us"])
        assert all(v >= 0 for v in r["us"].values())
