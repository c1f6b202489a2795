"""The projection (ddtree_rtc/projection/): its self-check against the measured slice, tau's bound, the MoE
table, the calibration, the levers and the page. CPU only, reads the committed benchmarks/*.json."""
import json
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from ddtree_rtc.cli import main
from ddtree_rtc.projection import ProjectionError, data, load_platforms, platforms, report
from ddtree_rtc.projection import tau as taus
from ddtree_rtc.projection.answer import (
    BUDGETS,
    ENGINE,
    calibration,
    ddtree_point,
    levers,
)
from ddtree_rtc.projection.inputs import SMALL_R, moe_table, rows
from ddtree_rtc.projection.model import Device, Options, device_for, moe_terms
from ddtree_rtc.projection.selfcheck import TOLERANCE, end_to_end, selfcheck


@pytest.fixture(scope="module")
def built():
    return report.build()


def test_selfcheck_reproduces_every_measured_step_and_round():
    res = selfcheck()
    files = {r["file"] for r in res}
    want = {p.name for p in data.benchmark_dir().glob("round_*.json")} | \
        {p.name for p in data.benchmark_dir().glob("decode_*.json")
         if "quick" not in p.name and (data.load_benchmark(p.name).get("notes") or {}).get("shard", "none") == "none"}
    assert want <= files
    kinds = {r["kind"].split(",")[0] for r in res}
    assert kinds == {"AR step", "DDTree round"}
    bad = [f"{r['file']} {r['case']}: {r['ratio']:.2f}" for r in res if abs(r["ratio"] - 1) > TOLERANCE]
    assert not bad, bad
    assert len(res) >= 24


def test_end_to_end_runs_are_read():
    res = end_to_end()
    assert {r["run"].split()[0] for r in res} == {p.name for p in data.benchmark_dir().glob("k2_6_slice_*.json")}
    for r in res:
        assert r["host_ms"] == pytest.approx(r["measured_ms"] - r["model_gpu_ms"]) and r["model_gpu_ms"] > 0
    ar1 = next(r for r in res if r["run"].endswith("c1_ar"))
    assert ar1["batch"] == 1 and ar1["layers"] == 2 and ar1["budget"] == 0


@pytest.mark.parametrize("make", [lambda: taus.published(), lambda: taus.published("mt-bench"), taus.oracle])
def test_tau_within_its_bound_at_every_budget(make):
    t = make()
    for b in (0, 1, 2, 3, 7) + BUDGETS:
        lo, hi = t.band(b)
        assert 1.0 <= lo <= hi <= min(b + 1, 8) + 1e-9, (b, lo, hi)
    if t.kind == "published":
        assert t.band(64)[1] <= t.chain * 1.35 + 1e-9 and t.band(64)[0] == pytest.approx(t.chain)


def test_bad_tau_is_a_named_error():
    with pytest.raises(ProjectionError, match=r"min\(budget \+ 1, depth \+ 1\) = 3"):
        taus.fixed(7.0, 2)
    with pytest.raises(ProjectionError, match="= 8"):
        taus.fixed(8.5, 64)
    r = CliRunner().invoke(main, ["projection", "--tau", "7", "--budget", "2"])
    assert r.exit_code != 0 and "min(budget + 1, depth + 1) = 3" in r.output
    r = CliRunner().invoke(main, ["projection", "--tau", "5"])
    assert r.exit_code != 0 and "--budget" in r.output
    r = CliRunner().invoke(main, ["projection", "--budget", "600"])
    assert r.exit_code != 0 and "0..512" in r.output


def test_tau_from_run(tmp_path):
    f = data.benchmark_path("k2_6_slice_ddtree_h100.json")
    run = json.loads(f.read_text())["runs"]["c1_p0.93"]["metrics"]["speculative"]
    hist = {int(k): v for k, v in run["tokens_per_round_hist"].items()}
    t = taus.from_run(f"{f}:c1_p0.93")
    assert t.point == pytest.approx(sum(k * v for k, v in hist.items()) / sum(hist.values()))
    assert t.budget == 32 and t.band(32) == (t.point, t.point)
    with pytest.raises(ProjectionError, match="runs: c1_ar"):
        taus.from_run(str(f))
    bad = tmp_path / "run.json"
    bad.write_text(json.dumps({"decode": {"budget": 2}, "metrics": {"speculative": {
        "tokens_per_round_hist": {"1": 3, "5": 1}, "budget": 2}}}))
    with pytest.raises(ProjectionError, match="rounds of 5 tokens"):
        taus.from_run(str(bad))
    bad.write_text(json.dumps({"metrics": {"speculative": None}}))
    with pytest.raises(ProjectionError, match="tokens_per_round_hist"):
        taus.from_run(str(bad))


@pytest.mark.parametrize("config", ["K2.6", "TP8 shard", "EP8 shard"])
def test_moe_table_reproduces_its_rows_and_splits_memory_from_compute(config):
    tab = moe_table(config)
    ref = Device("ref", tab.read_gbs, {"bf16": 795.7419074599565})
    pts = [(r["extra"], r["us"]) for r in rows("moe_h200.json") if r["extra"]["config"] == config]
    for ex, us in pts:
        E, r = ex["experts_touched"], ex["M"] * ex["top_k"] / ex["experts_touched"]
        t = tab.fixed_us + E * (tab.stream_us + tab.compute_at(r))
        exact = r > SMALL_R and tab.compute_at(r) > 0   # a row faster than its stream keeps compute 0
        assert t == pytest.approx(us, rel=1e-6 if exact else 0.10), (ex["M"], t, us)
    # the stream halves with twice the bandwidth, the compute with twice the rate; the fixed part stays
    opt = Options(tp=1) if config == "K2.6" else Options(layout="tp8" if config == "TP8 shard" else "tp_attn_ep_moe")
    from ddtree_rtc.projection import model
    a = moe_terms(model.k26_dims(), ref, 1024, opt, experts=None if config != "K2.6" else 243)
    b = moe_terms(model.k26_dims(), replace(ref, bw_gbs=2 * ref.bw_gbs), 1024, opt,
                  experts=None if config != "K2.6" else 243)
    c = moe_terms(model.k26_dims(), replace(ref, rates={"bf16": 2 * 795.7419074599565}), 1024, opt,
                  experts=None if config != "K2.6" else 243)
    assert b[0] == a[0] and b[1] == pytest.approx(a[1] / 2) and b[2] == pytest.approx(a[2])
    assert c[2] == pytest.approx(a[2] / 2) and c[1] == pytest.approx(a[1]) and a[2] > 0


def test_splits_sum_and_carry_sources(built):
    p = built["platforms"]
    assert list(p) == ["rtx_pro_6000", "h200", "b200", "b300"]
    for rec in p.values():
        for c in ("c1", "c10"):
            ar, dd = rec[c]["ar"], rec[c]["ddtree"]
            assert sum(ar["split_us_per_token"].values()) == pytest.approx(1e6 / ar["tok_s_user"])
            assert sum(dd["split_us_per_token"].values()) == pytest.approx(1e6 / dd["tok_s_user"])
            lo, hi = dd["tau_band"]
            assert 1 <= lo <= hi <= min(dd["budget"] + 1, 8)
            assert dd["experts"]
    assert all(v for v in built["inputs"].values())
    assert "z-lab" in built["tau_source"]


def test_calibration_within_35pct_or_names_the_inputs(built):
    cal = built["calibration"]
    assert len(cal) == 8
    for r in cal:
        lo, hi = r["published"]
        assert r["ratio"] == pytest.approx(r["predicted"] / ((lo + hi) / 2))
        assert r["within_35pct"] or r["inputs_unsure"], r["figure"]
    assert cal == calibration()


def test_levers_are_reruns_with_one_input_changed(built):
    pf = load_platforms()
    dev = device_for(pf["b300"], pf["h200"])
    t = taus.published()
    base = ddtree_point(pf["b300"], dev, 1, 4096, ENGINE, t)["tok_s_user"]
    one = ddtree_point(pf["b300"], dev, 1, 4096, replace(ENGINE, collective="oneshot"), t)["tok_s_user"]
    row = next(r for r in built["levers"]["rows"] if r["change"] == {"collective": "oneshot"})
    assert row["gain"]["b300 c1"] == pytest.approx(one / base)
    fp4 = next(r for r in built["levers"]["rows"] if r["change"] == {"expert_precision": "fp4"})
    assert fp4["gain"]["h200 c1"] is None and fp4["not_applicable"]["h200"]
    int8 = next(r for r in built["levers"]["rows"] if r["change"] == {"expert_precision": "int8"})
    assert int8["gain"]["b300 c10"] < int8["gain"]["b200 c10"]   # B300's int8 rate is 1/30 of B200's
    gains = [r["gain"][built["levers"]["ranked_by"]] or 0 for r in built["levers"]["rows"]]
    assert gains == sorted(gains, reverse=True)
    assert levers(["h200"])["ranked_by"] == "h200 c1"


def test_large_m_compute_follows_the_mma_rate(built):
    lm = built["large_m"]["platforms"]
    assert built["large_m"]["rows"] == 650 and lm["h200"]["fp4"] is None
    b2, b3 = lm["b200"], lm["b300"]
    assert b3["int8"]["moe_compute_us"] == pytest.approx(30 * b2["int8"]["moe_compute_us"], rel=1e-6)
    assert b3["fp4"]["moe_compute_us"] == pytest.approx(b2["fp4"]["moe_compute_us"] * 9000 / 15000, rel=1e-6)
    assert b3["bf16"]["moe_stream_us"] == b3["fp4"]["moe_stream_us"] > 0   # NVFP4 bytes = INT4 g32 bytes


def test_platform_file_errors(tmp_path):
    good = load_platforms()
    assert all(pf.sources[k] for pf in good.values() for k in pf.sources)
    bad = tmp_path / "p.yaml"
    bad.write_text("h200: {name: x, mem_tbs: {value: 4.8, source: s}}\n")
    with pytest.raises(ProjectionError, match="missing keys"):
        load_platforms(bad)
    bad.write_text("h200: [1, 2\n")
    with pytest.raises(ProjectionError, match="cannot read"):
        load_platforms(bad)
    base = (platforms.HERE / "platforms.yaml").read_text()
    bad.write_text(base.replace('mem_tbs: {value: 4.8, source: "NVIDIA H200 datasheet',
                                'mem_tbs: {value: 4.8, sauce: "x", source: "NVIDIA H200 datasheet'))
    with pytest.raises(ProjectionError, match="mem_tbs must be"):
        load_platforms(bad)
    r = CliRunner().invoke(main, ["projection", "--platforms", "h100x"])
    assert r.exit_code != 0 and "unknown platform" in r.output


def test_cli_json_and_page(tmp_path):
    js, md = tmp_path / "p.json", tmp_path / "sub" / "hardware.md"
    r = CliRunner().invoke(main, ["projection", "--json", str(js), "--markdown", str(md)])
    assert r.exit_code == 0, r.output
    d = json.loads(js.read_text())
    assert {"platforms", "levers", "calibration", "selfcheck", "inputs"} <= set(d)
    first = md.read_text().split("\n\n")[2]
    assert first.startswith("**The B300 answer.**") and "tok/s" in first
    assert "## Calibration" in r.output and "## Levers" in r.output


def test_docs_page_is_current(built):
    page = (Path(__file__).resolve().parents[1] / "docs" / "hardware.md").read_text()
    assert page == report.page(built), "regenerate: ddtree-rtc projection --markdown docs/hardware.md"


def test_plot(tmp_path, built):
    pytest.importorskip("matplotlib")
    out = tmp_path / "p.png"
    report.plot(built, str(out))
    assert out.stat().st_size > 1000
