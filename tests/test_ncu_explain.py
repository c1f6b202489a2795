"""tools/ncu_explain.py (issue 45's ncu explanation of the missed stage targets): the raw-page CSV parser,
the cut into stages at the marker kernels, the per-kernel diagnosis and the stage report, on a CSV
written by hand; the driver's stage boundaries on the numpy backend; the marker kernels on a GPU.

The fixture follows the layout of ``ncu --import R.ncu-rep --csv --page raw --print-units base`` (Nsight
Compute's raw page, as parsers of it in public repositories show it): the fixed columns "ID", "Process
ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream", "Block Size", "Grid Size",
"Device", "CC", then one column per metric name; a second row of units with empty fixed columns; one
row per kernel, numbers with thousands separators, "n/a" where a metric has no value; ncu's own
'==PROF==' lines around it. The metric names are those the SpeedOfLight, Occupancy, LaunchStats and
WarpStateStats sections collect on sm_90, and the tool's explicit ones. The values are invented."""

import json

import pytest


@pytest.fixture(scope="module")
def tool(load_tool):
    return load_tool("ncu_explain")


FIXED = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream", "Block Size",
         "Grid Size", "Device", "CC"]
METRICS = [  # (name, unit), in the raw page's (alphabetical) order
    ("device__attribute_multiprocessor_count", ""),
    ("dram__bytes_read.sum", "byte"),
    ("dram__bytes_write.sum", "byte"),
    ("dram__throughput.avg.pct_of_peak_sustained_elapsed", "%"),
    ("gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed", "%"),
    ("gpu__time_duration.sum", "nsecond"),
    ("launch__block_size", ""),
    ("launch__grid_size", ""),
    ("launch__occupancy_limit_registers", "block"),
    ("launch__occupancy_limit_shared_mem", "block"),
    ("launch__registers_per_thread", "register/thread"),
    ("launch__waves_per_multiprocessor", ""),
    ("lts__t_sector_hit_rate.pct", "%"),
    ("sm__cycles_elapsed.avg.per_second", "hz"),
    ("sm__maximum_warps_per_active_cycle_pct", "%"),
    ("sm__throughput.avg.pct_of_peak_sustained_elapsed", "%"),
    ("sm__warps_active.avg.pct_of_peak_sustained_active", "%"),
    ("smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio", "ratio"),
    ("smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio", "ratio"),
    ("smsp__average_warps_issue_stalled_selected_per_issue_active.ratio", "ratio"),
    ("smsp__average_warps_issue_stalled_wait_per_issue_active.ratio", "ratio"),
]
MARK = {"sms": "132", "rd": "0", "wr": "0", "dram": "0.1", "mem": "0.5", "ns": "1,024", "blk": "32", "grid": "1",
        "lreg": "32", "lsm": "32", "reg": "16", "waves": "0.00", "l2": "0", "hz": "1,755,000,000", "theo": "100",
        "sm": "0.1", "occ": "3.1", "bar": "0", "lsb": "0", "sel": "1", "wait": "0.5"}


def _row(i, name, block_dims, grid_dims, **v):
    v = {**MARK, **v}
    vals = [v[k] for k in ("sms", "rd", "wr", "dram", "mem", "ns", "blk", "grid", "lreg", "lsm", "reg", "waves", "l2",
                           "hz", "theo", "sm", "occ", "bar", "lsb", "sel", "wait")]
    fixed = [str(i), "4242", "python3", "127.0.0.1", name, "1", "7", block_dims, grid_dims, "0", "9.0"]
    return ",".join(f'"{c}"' for c in fixed + vals)


def _csv(rows):
    head = ",".join(f'"{c}"' for c in FIXED + [m for m, _ in METRICS])
    units = ",".join(f'"{c}"' for c in [""] * len(FIXED) + [u for _, u in METRICS])
    return "\n".join(["==PROF== Connected to process 4242 (/usr/bin/python3.12)",
                      "==PROF== Disconnected from process 4242", head, units, *rows]) + "\n"


CSV = _csv([
    # a kernel before the first marker: not part of any stage
    _row(0, "cupy_copy__float32_float32", "(128, 1, 1)", "(4, 1, 1)", ns="3,000", grid="4"),
    _row(1, "ddtree_ncu_mark_c0_attention", "(32, 1, 1)", "(1, 1, 1)"),
    # launch-bound: 2.2 µs, a few KB
    _row(2, "rmsnorm_kernel(const unsigned short *, int)", "(256, 1, 1)", "(1, 1, 1)", rd="16,384", wr="14,336",
         ns="2,208", blk="256", grid="1", dram="0.5", occ="6.2", theo="100", lsb="1.2", wait="3.1"),
    # latency-bound GEMV: 20 µs at 24% of DRAM, 66 CTAs, long scoreboard
    _row(3, "void linear_gemv_kernel<8, 256>(const __nv_bfloat16 *, float *)", "(256, 1, 1)", "(66, 1, 1)",
         rd="15,728,640", wr="28,672", ns="20,480", blk="256", grid="66", dram="24.1", mem="26.0", waves="0.06",
         occ="11.8", theo="50", lreg="4", lsm="8", reg="96", sm="4.0", l2="3.2", bar="0.8", lsb="14.2", wait="1.5"),
    _row(4, "ddtree_ncu_mark_c0_moe", "(32, 1, 1)", "(1, 1, 1)"),
    # DRAM-bound expert GEMM
    _row(5, "moe_small_gate_up_kernel", "(128, 1, 1)", "(264, 1, 1)", rd="31,457,280", wr="4,096", ns="12,800",
         blk="128", grid="264", dram="79.3", mem="80.1", waves="0.5", occ="40", theo="62.5", reg="72", sm="20",
         l2="1.0", lsb="9", wait="2"),
    # a kernel ncu could not read every metric of
    _row(6, "moe_combine_kernel", "(64, 1, 1)", "(1, 1, 1)", rd="n/a", wr="n/a", dram="n/a", ns="1,536", blk="64",
         grid="1", occ="n/a", lsb="n/a", wait="n/a", bar="n/a", sel="n/a"),
    _row(7, "ddtree_ncu_mark_c0_end", "(32, 1, 1)", "(1, 1, 1)"),
    # after the end marker: ignored
    _row(8, "argmax_kernel", "(1024, 1, 1)", "(1, 1, 1)", ns="5,000"),
])

CASES = {"shard": "tp8", "layer": 1, "ctx": 4096, "device": {"device": "NVIDIA H100 80GB HBM3"},
         "cases": [{"index": 0, "path": "general", "actual_path": "general", "batch": 1, "ctx": 4096, "layer": 1},
                   {"index": 1, "path": "small-m", "batch": 33, "ctx": 4096, "layer": 1,
                    "skipped": "no time left under the ncu budget"}]}


def _measured(tmp_path):
    """bench decode's JSON layout (rows with extra.stage / layer / floor_us; ceilings.read_gbs)."""
    rows = [{"case": "general b1 ctx4k L1 attention", "us": 84.0, "bytes": 56_511_616,
             "extra": {"batch": 1, "ctx": 4096, "path": "general", "stage": "attention", "layer": 1, "floor_us": 18.2}},
            {"case": "general b1 ctx4k L0 attention", "us": 88.0, "bytes": 56_511_616,
             "extra": {"batch": 1, "ctx": 4096, "path": "general", "stage": "attention", "layer": 0, "floor_us": 18.2}},
            {"case": "general b1 ctx4k L1 moe", "us": 63.0, "bytes": 40_000_000,
             "extra": {"batch": 1, "ctx": 4096, "path": "general", "stage": "moe", "layer": 1, "floor_us": 12.9,
                       "experts_touched": 8}},
            {"case": "general b1 ctx4k step (CUDA graph)", "us": 466.0, "bytes": 1,
             "extra": {"batch": 1, "ctx": 4096, "path": "general"}}]
    p = tmp_path / "decode.json"
    p.write_text(json.dumps({"ceilings": {"read_gbs": 3102.4}, "rows": rows}))
    return p


def test_raw_page_is_parsed_in_base_units(tool):
    ks = tool.read_raw_csv(CSV)
    assert [k["id"] for k in ks] == list(range(9))
    gemv = ks[3]
    assert gemv["duration_us"] == pytest.approx(20.48)
    assert gemv["dram_read"] == 15_728_640 and gemv["grid"] == 66 and gemv["block"] == 256
    assert gemv["occ_theoretical_pct"] == 50 and gemv["regs"] == 96 and gemv["sms"] == 132
    assert gemv["sm_mhz"] == pytest.approx(1755)
    assert gemv["stalls"]["long_scoreboard"] == pytest.approx(14.2)
    assert ks[6]["dram_read"] is None and ks[6]["duration_us"] == pytest.approx(1.536)
    assert tool.short_name(gemv["name"]) == "linear_gemv_kernel<8, 256>"


def test_units_are_applied(tool):
    csv = CSV.replace('"nsecond"', '"usecond"', 1).replace('"byte"', '"Mbyte"', 1)
    gemv = tool.read_raw_csv(csv)[3]
    assert gemv["duration_us"] == pytest.approx(20480) and gemv["dram_read"] == pytest.approx(15_728_640e6)


def test_details_page_and_empty_output_are_refused(tool):
    details = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
               '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"\n')
    with pytest.raises(ValueError, match="--page raw"):
        tool.read_raw_csv(details)
    with pytest.raises(ValueError, match="no header"):
        tool.read_raw_csv("==PROF== Connected to process 1\n==ERROR== the profiler failed\n")


def test_markers_cut_the_step_into_stages(tool):
    stages = tool.split_stages(tool.read_raw_csv(CSV))
    assert list(stages) == [0]
    assert [k["id"] for k in stages[0]["attention"]] == [2, 3]
    assert [k["id"] for k in stages[0]["moe"]] == [5, 6]


def test_each_kernel_gets_its_diagnosis(tool):
    ks = {k["id"]: k for k in tool.read_raw_csv(CSV)}
    assert tool.diagnose(ks[2]).startswith("launch-bound: 2.2 µs")
    gemv = tool.diagnose(ks[3])
    assert gemv.startswith("latency-bound")
    assert "DRAM 24% of peak" in gemv and "66 CTAs, 0.06 waves: 66 of 132 SMs idle" in gemv
    assert "occupancy 12% (theor. 50%, registers)" in gemv
    assert "stalled on long scoreboard 86%" in gemv and "too few loads in flight" in gemv
    assert tool.diagnose(ks[5]).startswith("DRAM-bound")
    assert tool.top_stalls(ks[6]) == [] and tool.diagnose(ks[6]).startswith("launch-bound")


def test_report_puts_kernels_against_the_measured_stage(tool, tmp_path):
    meas = tool.load_measured(_measured(tmp_path), layer=1)
    assert meas[("general", 1, 4096, "attention")]["us"] == 84.0  # the profiled layer's own row
    rep = tool.build_report(tool.read_raw_csv(CSV), CASES, meas)
    att, moe = rep["cases"][0]["stages"]
    assert att["stage"] == "attention" and att["n_kernels"] == 2
    assert att["sum_kernel_us"] == pytest.approx(2.208 + 20.48)
    assert att["gap_us"] == pytest.approx(84.0 - 2.208 - 20.48)
    assert att["target_us"] == 15.0 and att["missed"]
    assert "between them 61.3" in att["verdict"] and "MISSED (5.6x)" in att["verdict"]
    assert "largest linear_gemv_kernel<8, 256> 20.5 µs: latency-bound" in att["verdict"]
    assert moe["dram_read_bytes"] == 31_457_280 and moe["missed"]
    assert rep["cases"][1]["skipped"] and rep["read_gbs"] == 3102.4
    md = tool.markdown(rep)
    assert "SM clock during the kernels 1755-1755 MHz" in md
    assert "## general b1 ctx4k" in md and "| 1 | `linear_gemv_kernel<8, 256>` | 20.48 |" in md
    assert "not profiled: no time left" in md


def test_kernels_longer_than_the_stage_are_called_overlapped(tool):
    ks = tool.split_stages(tool.read_raw_csv(CSV))[0]["attention"]
    s = tool.stage_summary("attention", 1, ks, {"us": 20.0, "floor_us": 18.2, "bytes": 56e6}, 3100.0)
    assert s["gap_us"] < 0 and "measured 20.0 µs < kernels alone 22.7 (2 launches: they overlap" in s["verdict"]


def test_moe_target_at_33_is_three_quarters_of_the_touched_bytes(tool):
    assert tool.target_us("moe", 33, 30.0) == pytest.approx(40.0)
    assert tool.target_us("attention", 33, 30.0) is None and tool.target_us("attention", 1, 18.0) == 15.0


def test_report_command_writes_json_and_markdown(tool, tmp_path, capsys):
    (tmp_path / "raw.csv").write_text(CSV)
    (tmp_path / "cases.json").write_text(json.dumps(CASES))
    assert tool.main(["report", "--csv", str(tmp_path / "raw.csv"), "--cases", str(tmp_path / "cases.json"),
                      "--measured", str(_measured(tmp_path)), "--out", str(tmp_path / "o")]) == 0
    doc = json.loads((tmp_path / "o" / "ncu_explain.json").read_text())
    assert doc["cases"][0]["stages"][0]["kernels"][1]["diagnosis"].startswith("latency-bound")
    assert (tmp_path / "o" / "ncu_explain.md").read_text().startswith("# ncu per kernel")
    row = "general b1 | attention | 2 | 22.7 | 84.0 | 61.3 | 15.0 MISSED | 0.28 | 696 | " \
        "linear_gemv_kernel<8, 256>: 20.5"
    assert row + ", latency-bound" in capsys.readouterr().out


def test_ncu_command_profiles_only_the_marked_range(tool, tmp_path):
    cmd = tool.ncu_command("ncu", tmp_path / "r.ncu-rep", ["python3", "drv"], 600)
    s = " ".join(cmd)
    assert "--clock-control none" in s and "--profile-from-start off" in s and "--launch-count 600" in s
    assert "--section WarpStateStats" in s and "dram__bytes_read.sum" in s and cmd[-2:] == ["python3", "drv"]
    fb = " ".join(tool.ncu_command("ncu", tmp_path / "r.ncu-rep", ["d"], 10, sections=False))
    assert "--section" not in fb and "smsp__average_warps_issue_stalled_long_scoreboard" in fb


def test_cases_are_checked(tool):
    assert tool.parse_cases("general:1, small-m:33") == [("general", 1), ("small-m", 33)]
    for bad in ("fused:1", "general", "small-m:0", ""):
        with pytest.raises(ValueError):
            tool.parse_cases(bad)


@pytest.fixture(scope="module")
def tiny_model(tool):
    return tool.build_model("numpy", "tp8", 0)


def test_driver_marks_one_layers_stages_on_numpy(tool, tiny_model):
    tags = []
    recs = tool.drive(tiny_model, [("general", 1), ("small-m", 3)], 200, 1, lambda c, t: tags.append((c, t)),
                      deadline=float("inf"), warmup=0, log=lambda *_: None)
    assert [r["tags"] for r in recs] == [["attention", "moe", "end"]] * 2
    assert tags == [(0, "attention"), (0, "moe"), (0, "end"), (1, "attention"), (1, "moe"), (1, "end")]
    assert recs[1]["actual_path"] == "small-m" and recs[0]["actual_path"] == "general"
    recs = tool.drive(tiny_model, [("general", 1)], 200, 0, None, deadline=float("inf"), warmup=0,
                      log=lambda *_: None)
    assert recs[0]["tags"] == ["attention", "dense", "end"]  # layer 0 of the tiny preset is dense
    with pytest.raises(ValueError, match="--layer 7"):
        tool.boundaries(tiny_model, 7)


def test_driver_skips_cases_past_its_deadline(tool, tiny_model):
    recs = tool.drive(tiny_model, [("general", 1)], 200, 1, None, deadline=0.0, log=lambda *_: None)
    assert recs[0]["skipped"] and "tags" not in recs[0]


def test_a_failing_case_is_recorded_and_the_next_runs(tool, tiny_model, monkeypatch):
    real, saved = tool.setup_case, []

    def setup(model, batch, ctx):
        if batch == 2:
            raise MemoryError("out of memory allocating the cache")
        return real(model, batch, ctx)

    monkeypatch.setattr(tool, "setup_case", setup)
    recs = tool.drive(tiny_model, [("general", 2), ("general", 1)], 200, 1, None, deadline=float("inf"), warmup=0,
                      log=lambda *_: None, save=lambda r: saved.append(len(r)))
    assert recs[0]["error"] == "MemoryError: out of memory allocating the cache" and "tags" not in recs[0]
    assert recs[1]["tags"] == ["attention", "moe", "end"] and saved == [1, 2]
    rep = tool.build_report([], {"cases": recs, "layer": 1}, None)
    assert "not profiled: MemoryError" in tool.markdown(rep)


@pytest.mark.gpu
def test_marker_kernels_run_on_the_gpu(tool):
    import cupy

    from ddtree_rtc.backend import Backend
    from ddtree_rtc.model.config import preset_config
    from ddtree_rtc.model.target import TargetModel

    model = TargetModel.dummy(preset_config("tiny"), Backend("cuda"), seed=1, head="random")
    marks = tool.CudaMarks(2)
    recs = tool.drive(model, [("general", 1), ("small-m", 3)], 300, 1, marks, deadline=float("inf"),
                      log=lambda *_: None)
    cupy.cuda.get_current_stream().synchronize()
    assert [r["tags"] for r in recs] == [["attention", "moe", "end"]] * 2 and not marks.on


FAKE_NCU = '''#!{python}
"""A stand-in for ncu: runs the program it is given (everything from the driver's python on), writes
the --export file, and prints the test's CSV for --import. {refuse}: refuses --section at once."""
import pathlib, subprocess, sys
args = sys.argv[1:]
if "--import" in args:
    assert args[args.index("--page") + 1] == "raw" and "--csv" in args
    print(pathlib.Path({csv!r}).read_text())
    sys.exit(0)
if {refuse} and "--section" in args:
    print("==ERROR== Could not find section 'WarpStateStats'")
    sys.exit(1)
start = next(i for i, a in enumerate(args) if a.endswith("ncu_explain.py")) - 1
rc = subprocess.call(args[start:])
pathlib.Path(args[args.index("--export") + 1]).write_text("report")
sys.exit(rc)
'''


@pytest.mark.parametrize("refuse", [False, True])
def test_run_drives_ncu_then_reports(tool, tmp_path, refuse, capsys):
    import sys

    (tmp_path / "raw.csv").write_text(CSV)
    ncu = tmp_path / "ncu"
    ncu.write_text(FAKE_NCU.format(python=sys.executable, csv=str(tmp_path / "raw.csv"), refuse=refuse))
    ncu.chmod(0o755)
    out = tmp_path / "out"
    assert tool.main(["run", "--out", str(out), "--ncu", str(ncu), "--backend", "numpy", "--budget", "200",
                      "--measure-s", "10", "--ctx", "200", "--cases", "general:1"]) == 0
    log = (out / "ncu_log.txt").read_text()
    assert log.count("--clock-control none") == (2 if refuse else 1)
    cases = json.loads((out / "ncu_cases.json").read_text())
    assert cases["cases"][0]["tags"] == ["attention", "moe", "end"]
    rep = json.loads((out / "ncu_explain.json").read_text())
    assert [s["stage"] for s in rep["cases"][0]["stages"]] == ["attention", "moe"]
    printed = capsys.readouterr().out
    assert ("explicit metrics" in printed) == refuse and "9 kernels profiled" in printed
    assert sorted(p.name for p in out.iterdir()) == ["ncu_cases.json", "ncu_explain.json", "ncu_explain.md",
                                                     "ncu_log.txt", "ncu_raw.csv"]
