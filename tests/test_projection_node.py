"""`ddtree-rtc projection` reads what `ddtree-rtc bench node` writes (issue 44's node file; issue 42's reader).

The node JSON here comes from bench node's own code path on the numpy backend (run_layout with the
`small` preset at 8 ranks, document, write_json). Only the GPU timers (bench decode / round case runners,
time_gpu, the ceilings) are replaced by fixed figures that differ per case, so the test can tell which
case the projection took. A GPU run of bench node differs from this file in its figures and in two
identity fields: device (a GPU) and preset (k2.6). The test sets those two fields by hand to stand for
such a run; the unchanged numpy file must be left out."""

import json
import shutil
from dataclasses import replace

import pytest

from ddtree_rtc.backend import Backend
from ddtree_rtc.bench import harness, node
from ddtree_rtc.bench.harness import Row, Timing
from ddtree_rtc.projection import ProjectionError, data, load_platforms, report
from ddtree_rtc.projection import tau as taus
from ddtree_rtc.projection.answer import ENGINE, ar_point, ddtree_point, node_scale, project
from ddtree_rtc.projection.model import device_for
from ddtree_rtc.projection.node import node_points
from ddtree_rtc.projection.platforms import platform_of

LAYERS = 2  # dense layer 0 and one MoE layer made; bench node scales to 61


def _decode_case(model, batch, ctx, iters, gate, weight_bytes):
    off = 0.0 if model.small_m_path else 500.0
    rows = []
    for i in range(model.num_layers):
        moe = model.cfg.is_moe_layer(i)
        rows.append(Row(f"L{i} attention", 40.0 + batch, extra={"stage": "attention", "layer": i, "floor_us": 8.0}))
        rows.append(Row(f"L{i} mlp", (60.0 + 2 * batch if moe else 30.0) + off / 100,
                        extra={"stage": "moe" if moe else "dense", "layer": i, "floor_us": 12.0 if moe else 6.0,
                               "experts_touched": 8 * batch}))
    rows.append(Row("head", 25.0, extra={"stage": "head", "layer": -1, "floor_us": 5.0}))
    rows.append(Row("embed", 2.0, extra={"stage": "embed", "layer": -1, "floor_us": 0.5}))
    graph = 1000.0 + 100.0 * batch + off
    common = {"graph_us": graph, "queued_us": graph - 50, "eager_us": graph + 300,
              "mean_stage_us": {"attention": 40.0 + batch, "moe": 60.0 + 2 * batch + off / 100, "head": 25.0},
              "mean_stage_floor_us": {"attention": 8.0, "moe": 12.0, "head": 5.0, "embed": 0.5}}
    return rows + [Row("step (CUDA graph)", graph, extra=common)]


def _round_case(model, batch, budget, args, gate, weight_bytes, tau_stats, chain=False):
    g = 2000.0 + 10.0 * budget + 100.0 * batch
    summ = {"graph_us": g, "queued_us": g - 50, "eager_us": g + 500, "verify_floor_us": 300.0,
            "stage_us": {"verify": 1200.0 + 10.0 * budget}, "ar_step_us": 1000.0,
            "experts_touched": {1: 8 * batch * (budget + 1)}, "tau": tau_stats.tau}
    return [Row("round (CUDA graph)", g, extra=summ)]


@pytest.fixture(scope="module")
def node_doc():
    """bench node's JSON document of TP8 and TP-attn + EP8 ranks of the `small` preset on numpy."""
    from ddtree_rtc.bench import decode
    from ddtree_rtc.bench import round as round_bench

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decode, "bench_case", _decode_case)
        mp.setattr(round_bench, "bench_case", _round_case)
        mp.setattr(node, "time_gpu", lambda fn, warmup=0, iters=1: (fn(), Timing(3.0, 3.0, 3.0))[1])
        for mod in (node, harness):
            mp.setattr(mod, "read_ceiling_gbs", lambda: 3000.0)
        mp.setattr(harness, "copy_ceiling_gbs", lambda: 2500.0)
        # the scaling probe (the graphs at fewer layers): the fakes' MoE layer (attention + MoE) per layer
        # below LAYERS for the step, the verify's mean per layer for a round
        mp.setattr(node, "graph_step_us", lambda m, b, ctx, iters: 1000.0 + 100.0 * b
                   + (0.0 if m.small_m_path else 500.0)
                   - (LAYERS - m.num_layers) * (40.0 + b + 60.0 + 2 * b + (0.0 if m.small_m_path else 5.0)))
        mp.setattr(node, "graph_round_us", lambda m, b, budget, ctx, p, chain, iters: 2000.0 + 10.0 * budget
                   + 100.0 * b - (LAYERS - m.num_layers) * (1200.0 + 10.0 * budget) / LAYERS)
        be = Backend("numpy")
        rows, layouts = [], []
        for layout, extra in (("tp", ["--small-m", "on,off", "--batches", "1,2", "--budgets", "2,4"]),
                              ("ep", ["--batches", "1", "--budgets", "4", "--no-components"])):
            args = node.parse_args(["--layouts", layout, "--contexts", "64", "--layers", str(LAYERS), "--iters", "1",
                                    "--no-drafter", "--no-chain", *extra])
            r, lay = node.run_layout(layout, args, None, lambda msg: None, be=be, preset="small")
            rows += r
            layouts.append(lay)
        doc = node.document(rows, layouts, args, be=be)
    return json.loads(json.dumps(doc, default=node._json_default))  # as read back from the file


@pytest.fixture
def bench_dir(tmp_path, monkeypatch):
    d = tmp_path / "benchmarks"
    d.mkdir()
    for f in data.benchmark_dir().glob("*.json"):
        if not f.name.startswith("node_"):  # the committed node files stay out: each test writes its own
            shutil.copy(f, d / f.name)
    monkeypatch.setattr(data, "benchmark_dir", lambda: d)
    node_points.cache_clear()
    node_scale.cache_clear()
    yield d
    node_points.cache_clear()
    node_scale.cache_clear()


def as_gpu_run(doc, device):
    """``doc`` as a GPU run of the k2.6 preset would label it (its figures unchanged)."""
    d = json.loads(json.dumps(doc))
    d["device"] = device
    d.pop("backend")
    for lay in d["summary"]["layouts"]:
        lay["preset"] = "k2.6"
    return d


def _write(doc, path):
    node.write_json(doc, path)
    node_points.cache_clear()
    node_scale.cache_clear()


def test_numpy_file_is_never_a_gpu_measurement(node_doc, bench_dir):
    assert node_doc["backend"] == "numpy" and "not a GPU" in node_doc["device"]
    assert {lay["preset"] for lay in node_doc["summary"]["layouts"]} == {"small"}
    plain = project(["h200"], ctx=64)
    _write(node_doc, bench_dir / "node_numpy.json")
    nf = node_points()
    assert nf.points == () and nf.used == ()
    assert nf.left_out == (("node_numpy.json", f"device {node_doc['device']!r}, backend numpy: not a GPU measurement"),)
    assert project(["h200"], ctx=64) == plain
    src = report.sources()["node"]
    assert "no benchmarks/node_<device>.json from a GPU" in src and "left out node_numpy.json" in src
    # named as a GPU but of the test preset: left out too, layout by layout
    d = json.loads(json.dumps(node_doc))
    d["device"], d["backend"] = "NVIDIA H100 80GB HBM3", "cuda"
    _write(d, bench_dir / "node_h100.json")
    nf = node_points()
    named = [w for f, w in nf.left_out if f == "node_h100.json"]
    assert nf.points == () and [w.split(":")[0] for w in named] == ["layout tp", "layout ep"]
    assert all("preset small, rank of 8, 61 layers" in w for w in named)


def test_gpu_node_file_scales_the_projection(node_doc, bench_dir):
    pfs = load_platforms()
    plain = {k: project([k], ctx=64)[k] for k in ("h100", "b300")}
    doc = as_gpu_run(node_doc, "NVIDIA H100 80GB HBM3")
    _write(doc, bench_dir / "node_h100.json")
    nf = node_points()
    assert nf.used == ("node_h100.json",) and nf.left_out == ()
    # 2 small-M settings x 2 batches (TP8): an AR point and two rounds each; 1 case (EP): AR and one round
    assert len(nf.points) == 4 * 3 + 2
    assert {p.layout for p in nf.points} == {"tp8", "tp_attn_ep_moe"} and {p.platform for p in nf.points} == {"h100"}
    tp = doc["summary"]["layouts"][0]
    case = next(c for c in tp["cases"] if c["batch"] == 1 and c["small_m"] == "off")
    # bench node's own figures: the made step + 59 x the graph's MoE layer (the probe's fakes: attention + MoE)
    assert case["ar"]["rank_us"] == pytest.approx(1000 + 100 + 500 + (61 - LAYERS) * (41 + 62 + 5))
    pt = next(p for p in nf.points if p.layout == "tp8" and p.batch == 1 and p.small_m == "off" and p.budget == 0)
    assert pt.rank_us == case["ar"]["rank_us"] and pt.read_gbs == 3000.0 and pt.ctx == 64
    assert pt.collective_calls == case["ar"]["collectives"]["calls"] + 2 * (61 - LAYERS) == 2 * 61 + 1
    rd = next(r for r in case["rounds"] if r["budget"] == 4)
    pr = next(p for p in nf.points if p.layout == "tp8" and p.batch == 1 and p.small_m == "off" and p.budget == 4)
    assert pr.rank_us == rd["rank_us"] == pytest.approx(2000 + 40 + 100 + (61 - LAYERS) * 1240 / LAYERS)

    for key in ("h100", "b300"):  # the measured ratio scales every term but the collectives, on every platform
        got = project([key], ctx=64)[key]
        for c, batch in ((1, 1), (10, 2)):
            ar, ar0 = got[f"c{c}"]["ar"], plain[key][f"c{c}"]["ar"]
            s, src = node_scale(pfs[key], ENGINE, c, 0, 64)
            assert ar["node"] == src and f"node_h100.json (NVIDIA H100 80GB HBM3) tp8 small-M off b{batch} " in src
            assert s != pytest.approx(1.0)
            for term, v in ar["split_us_per_token"].items():
                want = ar0["split_us_per_token"][term] * (1 if term == "collectives" else s)
                assert v == pytest.approx(want), (key, c, term)
            dd = got[f"c{c}"]["ddtree"]
            assert dd["node"].startswith("node_h100.json") and "budget 4" in dd["node"]  # the nearest to 4..128
    # on the measured GPU, at the measured case, the scaled model gives the measured per-rank time back
    h100 = pfs["h100"]
    s, src = node_scale(h100, ENGINE, 1, 0, 64)
    assert f"measured {pt.rank_us:.0f} us" in src
    # the fused-layer lever takes the small-M path's measured cases; a layout not measured carries TP8's ratio
    dev = device_for(h100, pfs["h200"])
    assert "small-M on b1" in ar_point(h100, dev, 1, 64, replace(ENGINE, fused=True))["node"]
    ep = ar_point(h100, dev, 1, 64, replace(ENGINE, layout="tp_attn_ep_moe"))["node"]
    assert "tp_attn_ep_moe small-M on b1" in ep and "(standing for small-M off: not measured)" in ep
    assert "carried to ep8" in ddtree_point(h100, dev, 1, 64, replace(ENGINE, layout="ep8"), taus.published())["node"]
    inputs = report.sources()["node"]
    assert inputs.startswith("node_h100.json: 14 measured points")


def test_the_platforms_own_gpu_file_first(node_doc, bench_dir):
    pfs = load_platforms()
    _write(as_gpu_run(node_doc, "NVIDIA H100 80GB HBM3"), bench_dir / "node_h100.json")
    _write(as_gpu_run(node_doc, "NVIDIA H200"), bench_dir / "node_h200.json")
    _write(node_doc, bench_dir / "node_numpy.json")
    assert node_points().used == ("node_h100.json", "node_h200.json")
    assert node_scale(pfs["h100"], ENGINE, 1, 0, 64)[1].startswith("node_h100.json")
    for key in ("h200", "b300", "rtx_pro_6000"):  # no file of their own: the reference H200's
        assert node_scale(pfs[key], ENGINE, 1, 0, 64)[1].startswith("node_h200.json (NVIDIA H200)")


def test_a_broken_gpu_node_file_is_named(node_doc, bench_dir):
    d = as_gpu_run(node_doc, "NVIDIA H200")
    del d["summary"]["layouts"][0]["cases"][1]["ar"]["collectives"]
    _write(d, bench_dir / "node_h200.json")
    with pytest.raises(ProjectionError, match=r"node_h200.json: summary.layouts\[0\].cases\[1\].ar: missing key "
                                              r"'collectives'"):
        node_points()


def test_node_summary_tool_prints_the_readme_table(node_doc, capsys, tmp_path, load_tool):
    tool = load_tool("node_summary")
    doc = as_gpu_run(node_doc, "NVIDIA H100 80GB HBM3")
    path = tmp_path / "node_h100.json"
    node.write_json(doc, path)
    tool.main([str(path)])
    out = capsys.readouterr().out
    assert "measured on **NVIDIA H100 80GB HBM3**" in out and f"commit {doc['commit']}" in out
    lines = [ln for ln in out.splitlines() if ln.startswith("| TP")]
    assert len(lines) == 5
    case = next(c for c in doc["summary"]["layouts"][0]["cases"] if c["batch"] == 2 and c["small_m"] == "on")
    cells = next(ln for ln in lines if ln.startswith("| TP8 | 2 | 64 | on |")).split(" | ")
    ar = case["ar"]
    floor = 0.5 + 8 + 6 + 8 + 12 + 5 + (61 - LAYERS) * 20  # embed, L0, L1, head, 59 x the MoE layer's floors
    assert ar["floor_us_61"] == pytest.approx(floor)
    assert cells[4] == f"{ar['rank_us']:,.0f}" and cells[5] == f"{floor:,.0f}"
    assert cells[6] == f"{ar['rank_us'] / floor:.1f}" and cells[7] == "42.0 (8.0)" and cells[8] == "64.0 (12.0)"
    assert cells[10].startswith("123 x 20 = 2,460 / 8 = 984")
    p20 = case["projection"][0]
    best = max(p20["rounds"], key=lambda r: r["tok_s_per_user_oracle"])
    assert f"20 µs: {p20['ar']['tok_s_per_user']:,.0f} → {best['tok_s_per_user_oracle']:,.0f}" in cells[12]
    a20 = case["auto"]["projection"][0]  # the auto row (simulated on the case's costs)
    assert cells[13].startswith(f"20 µs: {a20['auto']['tok_s_per_user']:,.0f} ({a20['auto_over_best']:.2f}× "
                                f"{a20['best']} / {a20['auto_over_worst']:.2f}× {a20['worst']}); 8 µs: ")
    # a file of the old layout (before rank_us / floor_us_61) gives the same table
    for lay in doc["summary"]["layouts"]:
        for c in lay["cases"]:
            for k in ("rank_us", "floor_us_61", "floor_us", "collective_calls_61"):
                c["ar"].pop(k)
    assert tool.table(doc, str(path)) == out
    numpy_txt = tool.table(node_doc)
    assert "(the numpy backend: not a GPU measurement)" in numpy_txt


def test_device_names_to_platforms():
    pfs = load_platforms()
    got = {d: getattr(platform_of(d, pfs), "key", None) for d in (
        "NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3 (lent for kind nvidia-h200)", "NVIDIA H200",
        "NVIDIA RTX PRO 6000 Blackwell Server Edition", "NVIDIA A100-SXM4-80GB", node.host_device()["device"])}
    assert list(got.values()) == ["h100", "h100", "h200", "rtx_pro_6000", None, None]


def test_a_file_written_before_the_new_keys_reads_the_same(node_doc, bench_dir):
    """bench node's JSON before ar.rank_us / collective_calls_61 / floor keys and the layout's preset
    (main() ran k2.6 only): the projection reads the same points from it."""
    new = as_gpu_run(node_doc, "NVIDIA H200")
    _write(new, bench_dir / "node_h200.json")
    want = node_points().points
    old = json.loads(json.dumps(new))
    for lay in old["summary"]["layouts"]:
        lay.pop("preset")
        for c in lay["cases"]:
            for k in ("rank_us", "collective_calls_61", "floor_us", "floor_us_61"):
                c["ar"].pop(k)
            for rd in c["rounds"]:
                rd.pop("collective_calls_61")
    _write(old, bench_dir / "node_h200_old.json")
    got = [p for p in node_points().points if p.file == "node_h200_old.json"]
    assert [p.__class__(**{**vars(p), "file": "node_h200.json"}) for p in got] == list(want)
