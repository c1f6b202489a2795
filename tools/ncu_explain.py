"""Why a decode stage misses its target (issue 45): ncu on ONE eager decode step of `bench decode`'s
random K2.6 slice (TP8 shard by default), only the kernels of one decoder layer, every kernel with a
one-line diagnosis, and per stage the sum of its kernels against the stage's measured time.

    python tools/ncu_explain.py run --out DIR [--budget 240]   # on the GPU machine: all of the below
    python tools/ncu_explain.py profile --out DIR ...          # the driver, run under ncu (run starts it)
    python tools/ncu_explain.py report --csv RAW.csv --cases CASES.json [--measured DECODE.json] --out DIR

``run`` (i) runs ``ddtree-rtc bench decode`` on the same cases (``--moe-layers 1``, under
``--measure-s``) for each stage's measured time (queued, from events, L2 flushed: the numbers the
issue's targets are read from); on a fresh machine it also compiles the kernels the driver needs;
(ii) runs ``profile`` under ``ncu --clock-control none --profile-from-start off``: per case
(``--cases general:1,small-m:1,small-m:33,general:33``, ctx 4k), two warm-up steps, then one eager step
in which only the kernels of layer ``--layer`` (the first MoE layer) lie between cudaProfilerStart and
cudaProfilerStop; a tiny marker kernel (``ddtree_ncu_mark_c<case>_<stage>``) is launched at each stage
boundary, so the CSV can be cut into stages; (iii) exports ncu's raw page as CSV (``--print-units
base``); (iv) ``report``: ncu_explain.json and ncu_explain.md in DIR. ncu's wall time is bounded: the driver
skips the cases it has no time left for, ncu stops after ``--max-kernels`` profiled kernels, and each
subprocess has a timeout.

A stage runs from the previous stage's end to its own (bench decode's ``mark``): the attention block is
the layer's MLA launches plus the residual norm; the MoE stage is router, experts, shared expert and
combine plus the next layer's input norm. Per stage: ``gap`` = measured - the sum of ncu's kernel
durations, i.e. the time between kernels (the GPU's switch from one to the next, waits), plus whatever
separates ncu's isolated runs from the step's (negative where PDL overlaps kernels in the step); the
DRAM bytes its kernels read against the stage's floor bytes; the target (issue 45: 15 µs at b1; at b33
the MoE layer at 75% of its touched experts' bytes). Per kernel: launch-bound (under 4 µs and 2 MB),
DRAM-bound (>= 60% of peak), compute-bound, L1/L2-bound, else latency-bound, with its DRAM share,
occupancy (and what caps it), CTAs against SMs and the top warp stall. ncu's durations are each kernel
alone from a flushed L2 (``--cache-control all``), at the clocks the card runs at (``--clock-control
none``; the report gives the SM clock ncu saw). Pass ``--measured`` a bench decode JSON of the same cases
to skip step (i); the device call returns ncu_explain.md / .json, ncu_raw.csv, ncu_cases.json,
ncu_log.txt and decode_measured.json (the .ncu-rep only with ``--keep-rep``)."""

from __future__ import annotations

import argparse
import csv
import glob
import io
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MARK_PREFIX = "ddtree_ncu_mark_"
MARK_RE = re.compile(MARK_PREFIX + r"c(\d+)_([a-z]+)")
DEFAULT_CASES = "general:1,small-m:1,small-m:33,general:33"  # in priority order: the last are skipped first
PATHS = ("general", "small-m")
# what the diagnosis reads (MemoryWorkloadAnalysis and the rest would only add replay passes)
SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats")
# metrics beside the sections' (bytes by direction; the L2 hit rate even where a section lacks it)
EXTRA_METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "lts__t_sector_hit_rate.pct")
# the fallback when the sections are refused: explicit sm_90 metric names only
FALLBACK_METRICS = EXTRA_METRICS + (
    "gpu__time_duration.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__warps_active.avg.pct_of_peak_sustained_active", "sm__maximum_warps_per_active_cycle_pct",
    "launch__registers_per_thread", "launch__block_size", "launch__grid_size", "launch__waves_per_multiprocessor",
    "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_membar_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio")
# issue 45's targets (µs) for the stages at M = 1; at M = 33 the MoE layer must reach 75% of the
# touched experts' bytes, i.e. its time <= floor / 0.75
TARGET_US = {"attention": 15.0, "moe": 15.0}
MOE_BYTE_SHARE_AT_33 = 0.75


# ----------------------------------------------------------------------------------------- driver

def parse_cases(text: str) -> list[tuple[str, int]]:
    """"general:1,small-m:33" -> [("general", 1), ("small-m", 33)]."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        path, _, b = item.partition(":")
        if path not in PATHS or not b.isdigit() or int(b) < 1:
            raise ValueError(f"case {item!r}: expected PATH:BATCH with PATH one of {PATHS} and BATCH >= 1")
        out.append((path, int(b)))
    if not out:
        raise ValueError("no cases given")
    return out


def stage_name(model, layer: int) -> str:
    from ddtree_rtc.model.target import DenseMLP

    return "dense" if isinstance(model.layers[layer].mlp, DenseMLP) else "moe"


def boundaries(model, layer: int) -> dict:
    """bench decode's marks -> the marker tag launched right after each: the kernels of ``layer``'s
    attention block follow the mark before it, its MLP follows mark("attention", layer)."""
    if not 0 <= layer < model.num_layers:
        raise ValueError(f"--layer {layer}: the model has layers 0..{model.num_layers - 1}")
    start = ("embed", -1) if layer == 0 else ("mlp", layer - 1)
    return {start: "attention", ("attention", layer): stage_name(model, layer), ("mlp", layer): "end"}


def setup_case(model, batch: int, ctx: int):
    """bench decode's case (decode.decode_case): ``batch`` sequences at context ``ctx``, random cache."""
    from ddtree_rtc.bench.decode import decode_case

    cache, _step, inputs, moe_plan = decode_case(model, batch, ctx)
    return cache, inputs, moe_plan


def profiled_step(model, inputs, cache, moe_plan, layer: int, on_boundary) -> list[str]:
    """One eager decode step; ``on_boundary(tag)`` at each of ``layer``'s stage boundaries
    ('attention', 'moe' or 'dense', 'end'). Returns the tags in the order they were called."""
    where, seen = boundaries(model, layer), []

    def mark(stage, i, x):
        tag = where.get((stage, i))
        if tag is not None:
            seen.append(tag)
            on_boundary(tag)

    model.run(inputs, cache, output="logits", moe_plan=moe_plan, mark=mark)
    return seen


class CudaMarks:
    """Marker kernels (one empty kernel per case and stage, named for them) and the profiler range:
    cudaProfilerStart before the first marker of a case, cudaProfilerStop after its 'end'."""

    def __init__(self, n_cases: int, tags=("attention", "moe", "dense", "end")):
        import cupy

        names = [f"{MARK_PREFIX}c{c}_{t}" for c in range(n_cases) for t in tags]
        src = "\n".join(f'extern "C" __global__ void {n}() {{}}' for n in names)
        self.mod = cupy.RawModule(code=src)
        self.fns = {n: self.mod.get_function(n) for n in names}
        self.on = False

    def __call__(self, case: int, tag: str) -> None:
        import cupy

        if not self.on:
            cupy.cuda.runtime.profilerStart()
            self.on = True
        self.fns[f"{MARK_PREFIX}c{case}_{tag}"]((1,), (32,), ())
        if tag == "end":
            self.stop()

    def stop(self) -> None:
        import cupy

        cupy.cuda.runtime.profilerStop()
        self.on = False


def build_model(backend: str, shard: str, seed: int):
    """The model the driver profiles: bench decode's random K2.6 slice (dense layer 0 + one MoE layer)
    at ``shard`` on CUDA; the tiny preset on numpy (a CPU check of the driver's plumbing)."""
    if backend == "cuda":
        from ddtree_rtc.bench.decode import random_slice

        return random_slice(1, seed=seed, shard=shard)
    from ddtree_rtc.backend import Backend
    from ddtree_rtc.model.config import preset_config
    from ddtree_rtc.model.target import TargetModel

    return TargetModel.dummy(preset_config("tiny"), Backend(backend), seed=seed, head="random")


def drive(model, cases, ctx: int, layer: int, marks, deadline: float, warmup: int = 2, est_case_s: float = 0.0,
          log=print, save=None) -> list[dict]:
    """Per case: its path switched on the model, ``warmup`` plain steps, then the profiled one, with
    ``marks(case_index, tag)`` at the profiled layer's stage boundaries (CudaMarks on the GPU).
    A case that would start after ``deadline - est_case_s`` (wall clock) is skipped and recorded so;
    a case that raises is recorded with its error and the next one runs. ``save(records)`` after
    each case (the driver writes them as it goes)."""
    out = []
    for idx, (path, batch) in enumerate(cases):
        rec = {"index": idx, "path": path, "batch": batch, "ctx": ctx, "layer": layer}
        out.append(rec)
        if time.time() > deadline - est_case_s:
            rec["skipped"] = "no time left under the ncu budget"
            log(f"case {idx} {path} b{batch}: skipped (time)")
        else:
            try:
                _one_case(model, rec, marks, warmup)
            except Exception as e:  # one broken case must not cost the others their profiles
                rec["error"] = f"{type(e).__name__}: {e}"[:500]
                if getattr(marks, "on", False):
                    marks.stop()
                log(f"case {idx} {path} b{batch}: {rec['error']}")
            else:
                # the next case's cost: its profiled step (ncu's replays) and a margin for its set-up;
                # a case's warm-up may hold its kernels' first compilation, which the next may not need
                est_case_s = max(est_case_s, 1.3 * rec["profiled_s"] + 5)
                log(f"case {idx} {rec['actual_path']} b{batch}: {rec['seconds']:.1f} s, "
                    f"{rec['profiled_s']:.1f} s profiled")
        if save is not None:
            save(out)
    return out


def _one_case(model, rec: dict, marks, warmup: int) -> None:
    be = model.backend
    t0 = time.time()
    model.small_m_path = rec["path"] == "small-m"
    rec["actual_path"] = "small-m" if model.small_m(rec["batch"]) else "general"
    cache, inputs, moe_plan = setup_case(model, rec["batch"], rec["ctx"])
    for _ in range(warmup):
        model.run(inputs, cache, output="logits", moe_plan=moe_plan)
    if be.is_cuda:
        from ddtree_rtc.bench.harness import flush_l2

        flush_l2()
        be.synchronize()
    idx = rec["index"]
    on = (lambda tag: marks(idx, tag)) if marks is not None else (lambda tag: None)
    t1 = time.time()
    rec["tags"] = profiled_step(model, inputs, cache, moe_plan, rec["layer"], on)
    if be.is_cuda:
        import cupy

        be.synchronize()
        del cache, inputs, moe_plan
        cupy.get_default_memory_pool().free_all_blocks()
    rec["seconds"], rec["profiled_s"] = time.time() - t0, time.time() - t1


def cmd_profile(a) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cases = parse_cases(a.cases)
    t0 = time.time()
    model = build_model(a.backend, a.shard, a.seed)
    marks = CudaMarks(len(cases)) if a.backend == "cuda" else None
    print(f"model built in {time.time() - t0:.1f} s", flush=True)
    from ddtree_rtc.bench.harness import git_commit

    doc = {"shard": a.shard, "backend": a.backend, "layer": a.layer, "ctx": a.ctx, "commit": git_commit(),
           "date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()), "cases": []}
    if a.backend == "cuda":
        from ddtree_rtc.bench.harness import device_info

        doc["device"] = device_info()

    def save(recs):
        doc["cases"] = recs
        (out / "ncu_cases.json").write_text(json.dumps(doc, indent=1))

    drive(model, cases, a.ctx, a.layer, marks, deadline=a.deadline or math.inf, save=save)
    return 0


# ----------------------------------------------------------------------------------------- parser

_UNIT_SCALE = {  # to µs for times, bytes for sizes, as ncu's raw page writes them (SI prefixes)
    "nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6, "s": 1e6,
    "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9,
    "hz": 1e-6, "Khz": 1e-3, "Mhz": 1.0, "Ghz": 1e3, "cycle/second": 1e-6, "cycle/usecond": 1.0,  # clocks in MHz
    "cycle/nsecond": 1e3,
}
FIELDS = {  # our name -> ncu raw-page column
    "duration_us": "gpu__time_duration.sum",
    "dram_read": "dram__bytes_read.sum",
    "dram_write": "dram__bytes_write.sum",
    "dram_pct": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "mem_pct": "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
    "sm_pct": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "l2_hit_pct": "lts__t_sector_hit_rate.pct",
    "occ_achieved_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "occ_theoretical_pct": "sm__maximum_warps_per_active_cycle_pct",
    "regs": "launch__registers_per_thread",
    "block": "launch__block_size",
    "grid": "launch__grid_size",
    "waves": "launch__waves_per_multiprocessor",
    "smem_static": "launch__shared_mem_per_block_static",
    "smem_dynamic": "launch__shared_mem_per_block_dynamic",
    "limit_registers": "launch__occupancy_limit_registers",
    "limit_shared_mem": "launch__occupancy_limit_shared_mem",
    "limit_warps": "launch__occupancy_limit_warps",
    "limit_blocks": "launch__occupancy_limit_blocks",
    "sms": "device__attribute_multiprocessor_count",
    "sm_mhz": "sm__cycles_elapsed.avg.per_second",
    "dram_mhz": "dram__cycles_elapsed.avg.per_second",
}
STALL_RES = (  # WarpStateStats' per-issue ratios first; other spellings of the same breakdown after
    re.compile(r"^smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$"),
    re.compile(r"^smsp__average_warp_latency_issue_stalled_(\w+?)(?:\.ratio|\.sum)?$"),
    re.compile(r"^smsp__warp_issue_stalled_(\w+?)_per_warp_active\.pct$"),
    re.compile(r"^smsp__pcsamp_warps_issue_stalled_(\w+?)(?:_not_issued)?$"),
)
STALL_WHY = {
    "long_scoreboard": "waiting on global/local loads: too few loads in flight per warp",
    "barrier": "waiting at a CTA barrier: warps idle until the slowest arrives",
    "membar": "waiting on memory fences",
    "short_scoreboard": "waiting on shared memory / special-function results",
    "mio_throttle": "shared-memory instruction queue full",
    "lg_throttle": "global load/store queue full: many narrow accesses",
    "wait": "fixed-latency dependencies (few independent instructions)",
    "math_pipe_throttle": "a math pipe is saturated",
    "drain": "draining stores at exit",
    "no_instruction": "instruction fetch misses",
    "branch_resolving": "branch resolution",
    "dispatch_stall": "dispatch stalls",
    "imc_miss": "constant-cache misses",
    "tex_throttle": "texture/L1 queue full",
    "sleeping": "warps sleeping (nanosleep / spin-waits)",
    "not_selected": "eligible but not selected (enough warps)",
    "selected": "issuing",
    "misc": "miscellaneous",
}


def _number(text: str):
    t = (text or "").strip().replace(",", "")
    if t in ("", "n/a", "N/A", "nan"):
        return None
    try:
        return float(t)
    except ValueError:
        return None


def _dims(text: str) -> int | None:
    nums = [int(n) for n in re.findall(r"\d+", text or "")]
    return math.prod(nums) if nums else None


def read_raw_csv(text: str) -> list[dict]:
    """ncu's raw page as CSV (``ncu -i R.ncu-rep --csv --page raw --print-units base``): a header of
    fixed columns ("ID", "Kernel Name", "Block Size", "Grid Size", ...) then one column per metric
    name; a units row (empty ID); one row per profiled kernel. Lines ncu or the program print
    around it ('==PROF==', '==WARNING==', ...) are skipped. Returns, in launch order, one dict per
    kernel: id, name, the FIELDS that were collected (times in µs, sizes in bytes) and 'stalls'
    (reason -> value)."""
    lines = [ln for ln in text.splitlines() if not ln.startswith("==")]
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        raise ValueError("ncu CSV: no header row starting with \"ID\" (did ncu profile any kernel?)")
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    head = rows[0]
    if "Metric Name" in head:
        raise ValueError("ncu CSV: this is the details page (a 'Metric Name' column); export with --page raw")
    for col in ("ID", "Kernel Name"):
        if col not in head:
            raise ValueError(f"ncu CSV: header lacks the {col!r} column")
    units = rows[1] if len(rows) > 1 and rows[1] and rows[1][0] == "" else [""] * len(head)
    body = rows[2:] if units is rows[1] else rows[1:]
    col = {name: i for i, name in enumerate(head)}
    kernels = []
    for r in body:
        if len(r) != len(head):
            continue
        k = {"id": int(_number(r[col["ID"]]) or 0), "name": r[col["Kernel Name"]]}
        for ours, metric in FIELDS.items():
            if metric in col:
                v = _number(r[col[metric]])
                if v is not None:
                    v *= _UNIT_SCALE.get(units[col[metric]], 1.0)
                k[ours] = v
        if k.get("block") is None and "Block Size" in col:
            k["block"] = _dims(r[col["Block Size"]])
        if k.get("grid") is None and "Grid Size" in col:
            k["grid"] = _dims(r[col["Grid Size"]])
        stalls = {}
        for pat in STALL_RES:
            for name, i in col.items():
                m = pat.match(name)
                if m and m.group(1) not in stalls:
                    v = _number(r[i])
                    if v is not None:
                        stalls[m.group(1)] = v
            if stalls:
                break
        k["stalls"] = stalls
        kernels.append(k)
    kernels.sort(key=lambda k: k["id"])
    return kernels


def split_stages(kernels: list[dict]) -> dict:
    """Kernels after marker c<i>_<stage> (until the next marker) -> {i: {stage: [kernels]}}; the
    markers themselves are dropped; kernels before the first marker or after an 'end' are ignored."""
    out, cur = {}, None
    for k in kernels:
        m = MARK_RE.search(k["name"])
        if m:
            case, tag = int(m.group(1)), m.group(2)
            cur = None if tag == "end" else (case, tag)
            if cur:
                out.setdefault(case, {}).setdefault(tag, [])
            continue
        if cur:
            out[cur[0]][cur[1]].append(k)
    return out


def short_name(name: str, width: int = 48) -> str:
    base = name.split("(")[0].strip()
    base = re.sub(r"^void\s+", "", base)
    return base if len(base) <= width else base[:width - 1] + "…"


def top_stalls(k: dict, n: int = 3) -> list[tuple[str, float]]:
    """The ``n`` largest stall reasons as shares of all stall (issuing, 'selected', left out)."""
    s = {r: v for r, v in k.get("stalls", {}).items() if r != "selected" and v and v > 0}
    tot = sum(s.values())
    return [(r, v / tot) for r, v in sorted(s.items(), key=lambda kv: -kv[1])[:n]] if tot > 0 else []


def _limiter(k: dict) -> str | None:
    """Which resource caps the CTAs per SM (ncu's occupancy limits: the smallest one)."""
    lims = {name: k.get(f"limit_{key}") for key, name in
            (("registers", "registers"), ("shared_mem", "shared memory"), ("warps", "block size"),
             ("blocks", "CTA slots"))}
    lims = {n: v for n, v in lims.items() if v is not None}
    return min(lims, key=lims.get) if lims else None


def diagnose(k: dict, sms: int = 132) -> str:
    """One line: the kernel's class, then the figures that put it there."""
    dur = k.get("duration_us")
    if dur is None:
        return "no duration collected"
    nbytes = (k.get("dram_read") or 0) + (k.get("dram_write") or 0)
    gbs = nbytes / dur / 1e3 if dur > 0 else 0.0
    dram, sm, mem = k.get("dram_pct"), k.get("sm_pct"), k.get("mem_pct")
    grid, waves = (int(k["grid"]) if k.get("grid") is not None else None), k.get("waves")
    sms = int(k.get("sms") or sms)
    if dur < 4.0 and nbytes < 2e6:
        kind = f"launch-bound: {dur:.1f} µs body"
    elif dram is not None and dram >= 60:
        kind = "DRAM-bound (near the floor for its bytes: only fewer bytes help)"
    elif sm is not None and sm >= 60 and (dram is None or sm > dram):
        kind = f"compute-bound (SM {sm:.0f}%)"
    elif mem is not None and mem >= 60 and (dram is None or dram < mem / 2):
        kind = f"L1/L2-bound (memory pipes {mem:.0f}%, DRAM little)"
    else:
        kind = "latency-bound"
    parts = [kind]
    if dram is not None:
        parts.append(f"DRAM {dram:.0f}% of peak ({nbytes / 1e6:.2f} MB, {gbs:.0f} GB/s)")
    occ, theo = k.get("occ_achieved_pct"), k.get("occ_theoretical_pct")
    if occ is not None:
        lim = _limiter(k) if theo is not None and theo < 75 else None
        parts.append(f"occupancy {occ:.0f}%" + (f" (theor. {theo:.0f}%" + (f", {lim}" if lim else "") + ")"
                                               if theo is not None else ""))
    if grid is not None:
        w = f", {waves:.2f} waves" if waves is not None else ""
        parts.append(f"{grid} CTAs{w}" + (f": {sms - grid} of {sms} SMs idle" if grid < sms else ""))
    st = top_stalls(k, 1)
    if st:
        r, share = st[0]
        parts.append(f"stalled on {r.replace('_', ' ')} {100 * share:.0f}%: {STALL_WHY.get(r, r)}")
    return ", ".join(parts)


# ----------------------------------------------------------------------------------------- report

def load_measured(path, layer: int) -> dict:
    """`bench decode --json`'s rows -> {(path, batch, ctx, stage): {"us", "floor_us", "bytes", "layers"}}:
    the row of ``layer`` where bench decode timed it, else the mean over the layers with that stage."""
    doc = json.loads(Path(path).read_text())
    acc = {}
    for r in doc.get("rows", []):
        e = r.get("extra", {})
        if "stage" not in e or e.get("layer", -1) < 0 or "floor_us" not in e:
            continue
        key = (e["path"], int(e["batch"]), int(e["ctx"]), e["stage"])
        acc.setdefault(key, []).append(r)
    out = {}
    for key, rs in acc.items():
        own = [r for r in rs if r["extra"]["layer"] == layer]
        rs = own or rs
        n = len(rs)
        out[key] = {"us": sum(r["us"] for r in rs) / n, "floor_us": sum(r["extra"]["floor_us"] for r in rs) / n,
                    "bytes": sum(r.get("bytes") or 0 for r in rs) / n, "layers": [r["extra"]["layer"] for r in rs]}
    out["_read_gbs"] = doc.get("ceilings", {}).get("read_gbs")
    return out


def target_us(stage: str, batch: int, floor_us: float | None) -> float | None:
    if stage == "moe" and batch > 1:
        return floor_us / MOE_BYTE_SHARE_AT_33 if floor_us else None
    return TARGET_US.get(stage) if batch == 1 else None


def stage_summary(stage: str, batch: int, kernels: list[dict], meas: dict | None, read_gbs: float | None) -> dict:
    durs = [k["duration_us"] for k in kernels if k.get("duration_us") is not None]
    s = {"stage": stage, "n_kernels": len(kernels), "sum_kernel_us": sum(durs),
         "dram_read_bytes": sum(k.get("dram_read") or 0 for k in kernels),
         "dram_write_bytes": sum(k.get("dram_write") or 0 for k in kernels)}
    busy = s["sum_kernel_us"]
    s["kernel_gbs"] = (s["dram_read_bytes"] + s["dram_write_bytes"]) / busy / 1e3 if busy > 0 else None
    if meas:
        s.update(measured_us=meas["us"], floor_us=meas["floor_us"], floor_bytes=meas["bytes"],
                 gap_us=meas["us"] - busy)
        s["target_us"] = target_us(stage, batch, meas["floor_us"])
        s["missed"] = s["target_us"] is not None and meas["us"] > s["target_us"]
    ranked = sorted(kernels, key=lambda k: -(k.get("duration_us") or 0))
    s["top"] = [short_name(k["name"], 40) for k in ranked[:3]]
    s["verdict"] = verdict(s, ranked, read_gbs)
    return s


def verdict(s: dict, ranked: list[dict], read_gbs: float | None) -> str:
    """The stage's explanation in one line: where its time goes (kernels vs between them), how far its
    kernels are from streaming, what the largest kernel is bound by."""
    n, busy = s["n_kernels"], s["sum_kernel_us"]
    parts = []
    if "measured_us" in s:
        gap = s["gap_us"]
        if gap >= 0:
            parts.append(f"measured {s['measured_us']:.1f} µs = kernels {busy:.1f} + between them {gap:.1f} "
                         f"({gap / n if n else 0:.1f} µs per launch, {n} launches)")
        else:  # in the step the kernels overlap (PDL) or run from a warmer L2 than ncu's flushed one
            parts.append(f"measured {s['measured_us']:.1f} µs < kernels alone {busy:.1f} ({n} launches: they "
                         f"overlap or share the L2 in the step)")
        if s.get("floor_bytes"):
            over = s["dram_read_bytes"] / s["floor_bytes"]
            parts.append(f"DRAM read {s['dram_read_bytes'] / 1e6:.2f} MB = {over:.2f}x the floor's bytes")
        if s.get("target_us"):
            parts.append(f"target {s['target_us']:.1f} µs: " + ("MISSED" if s["missed"] else "met")
                         + f" ({s['measured_us'] / s['target_us']:.1f}x)")
    else:
        parts.append(f"kernels {busy:.1f} µs in {n} launches (no measured stage time)")
    if s["kernel_gbs"] is not None and read_gbs:
        parts.append(f"while busy {s['kernel_gbs']:.0f} GB/s = {100 * s['kernel_gbs'] / read_gbs:.0f}% of the read "
                     f"ceiling")
    small = [k for k in ranked if (k.get("duration_us") or 0) < 4.0]
    if small:
        parts.append(f"{len(small)} kernels under 4 µs ({sum(k['duration_us'] for k in small):.1f} µs)")
    if ranked and ranked[0].get("duration_us"):
        k = ranked[0]
        parts.append(f"largest {short_name(k['name'], 40)} {k['duration_us']:.1f} µs: {diagnose(k).split(',')[0]}")
    return "; ".join(parts)


def build_report(kernels: list[dict], cases_doc: dict, measured: dict | None) -> dict:
    stages = split_stages(kernels)
    read_gbs = (measured or {}).get("_read_gbs")
    out = {"device": cases_doc.get("device"), "date": cases_doc.get("date"), "commit": cases_doc.get("commit"),
           "shard": cases_doc.get("shard"), "layer": cases_doc.get("layer"), "read_gbs": read_gbs, "cases": []}
    for rec in cases_doc["cases"]:
        c = dict(rec)
        c["stages"] = []
        if rec.get("skipped") or rec.get("error"):
            out["cases"].append(c)
            continue
        path = rec.get("actual_path", rec["path"])
        for stage, ks in stages.get(rec["index"], {}).items():
            meas = (measured or {}).get((path, rec["batch"], rec["ctx"], stage))
            s = stage_summary(stage, rec["batch"], ks, meas, read_gbs)
            s["kernels"] = [dict(k, short=short_name(k["name"]), diagnosis=diagnose(k),
                                 top_stalls=top_stalls(k)) for k in ks]
            c["stages"].append(s)
        if not c["stages"]:
            c["missing"] = "no kernels of this case in the CSV (ncu stopped early or the markers were not profiled)"
        out["cases"].append(c)
    return out


def _f(v, spec=".1f", none="-"):
    return none if v is None else format(v, spec)


def markdown(rep: dict) -> str:
    dev = (rep.get("device") or {}).get("device", "?")
    mhz = sorted(k["sm_mhz"] for c in rep["cases"] for s in c.get("stages", []) for k in s["kernels"]
                 if k.get("sm_mhz"))
    clocks = f"SM clock during the kernels {mhz[0]:.0f}-{mhz[-1]:.0f} MHz (median {mhz[len(mhz) // 2]:.0f}). " \
        if mhz else ""
    lines = [f"# ncu per kernel: one decode step, layer {rep.get('layer')} of the {rep.get('shard')} shard ({dev})",
             "", "Kernel times are ncu's (each kernel alone, L2 flushed, clocks as found); measured = bench "
             f"decode's stage time (queued step, events). gap = measured - sum of kernels. {clocks}", ""]
    for c in rep["cases"]:
        title = f"## {c.get('actual_path', c['path'])} b{c['batch']} ctx{c['ctx'] // 1024}k"
        why = c.get("skipped") or c.get("error") or c.get("missing")
        if why:
            lines += [title, "", f"not profiled: {why}", ""]
            continue
        lines += [title, ""]
        for s in c["stages"]:
            lines += [f"**{s['stage']}**: {s['verdict']}", "",
                      "| # | kernel | µs | DRAM MB r/w | DRAM % | L2 hit % | occ % ach/theor | regs | CTAs×thr "
                      "(waves) | top stalls | diagnosis |",
                      "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
            for i, k in enumerate(s["kernels"]):
                stalls = " ".join(f"{r} {100 * v:.0f}%" for r, v in k["top_stalls"])
                mb = f"{(k.get('dram_read') or 0) / 1e6:.2f}/{(k.get('dram_write') or 0) / 1e6:.2f}"
                lines.append(
                    f"| {i} | `{k['short']}` | {_f(k.get('duration_us'), '.2f')} | {mb} | "
                    f"{_f(k.get('dram_pct'), '.0f')} | {_f(k.get('l2_hit_pct'), '.0f')} | "
                    f"{_f(k.get('occ_achieved_pct'), '.0f')}/"
                    f"{_f(k.get('occ_theoretical_pct'), '.0f')} | {_f(k.get('regs'), '.0f')} | "
                    f"{_f(k.get('grid'), '.0f')}×{_f(k.get('block'), '.0f')} ({_f(k.get('waves'), '.2f')}) | "
                    f"{stalls} | {k['diagnosis']} |")
            lines.append("")
    return "\n".join(lines)


def short_table(rep: dict) -> str:
    """The few lines a device call prints last."""
    rows = ["case | stage | launches | kernels µs | measured µs | gap µs | target µs | DRAM read / floor bytes | "
            "busy GB/s | largest kernel: µs, diagnosis"]
    for c in rep["cases"]:
        for s in c.get("stages", []):
            big = max(s["kernels"], key=lambda k: k.get("duration_us") or 0) if s.get("kernels") else None
            over = s["dram_read_bytes"] / s["floor_bytes"] if s.get("floor_bytes") else None
            largest = f"{big['short'][:36]}: {_f(big.get('duration_us'))}, {big['diagnosis'][:110]}" if big else "-"
            rows.append(f"{c.get('actual_path', c['path'])} b{c['batch']} | {s['stage']} | {s['n_kernels']} | "
                        f"{s['sum_kernel_us']:.1f} | {_f(s.get('measured_us'))} | {_f(s.get('gap_us'))} | "
                        f"{_f(s.get('target_us'))}{' MISSED' if s.get('missed') else ''} | {_f(over, '.2f')} | "
                        f"{_f(s.get('kernel_gbs'), '.0f')} | {largest}")
        if not c.get("stages"):
            why = c.get("skipped") or c.get("error") or c.get("missing")
            rows.append(f"{c['path']} b{c['batch']} | - | not profiled: {why}")
    return "\n".join(rows)


def cmd_report(a) -> int:
    kernels = read_raw_csv(Path(a.csv).read_text(errors="replace"))
    cases_doc = json.loads(Path(a.cases).read_text())
    measured = load_measured(a.measured, cases_doc.get("layer", 1)) if a.measured and Path(a.measured).is_file() \
        else None
    rep = build_report(kernels, cases_doc, measured)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ncu_explain.json").write_text(json.dumps(rep, indent=1))
    (out / "ncu_explain.md").write_text(markdown(rep))
    print(short_table(rep))
    return 0


# ----------------------------------------------------------------------------------------- run

def find_ncu() -> str | None:
    found = shutil.which("ncu")
    if found:
        return found
    for pat in ("/usr/local/cuda/bin/ncu", "/opt/nvidia/nsight-compute/*/ncu", "/usr/local/cuda-*/bin/ncu"):
        hits = sorted(glob.glob(pat))
        if hits:
            return hits[-1]
    return None


def ncu_command(ncu: str, report: Path, driver: list[str], max_kernels: int, sections: bool = True) -> list[str]:
    cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--cache-control", "all",
           "--replay-mode", "kernel", "--launch-count", str(max_kernels), "--force-overwrite",
           "--export", str(report)]
    if sections:
        for s in SECTIONS:
            cmd += ["--section", s]
        cmd += ["--metrics", ",".join(EXTRA_METRICS)]
    else:
        cmd += ["--metrics", ",".join(FALLBACK_METRICS)]
    return cmd + driver


def export_csv(ncu: str, rep_file: Path, csv_file: Path, log) -> int:
    """ncu's raw page of ``rep_file`` as CSV into ``csv_file`` (base units; ncu's own units if it
    refuses --print-units); returns the number of kernels in it."""
    for units in (["--print-units", "base"], []):
        with open(csv_file, "w") as f:
            try:
                subprocess.run([ncu, "--import", str(rep_file), "--csv", "--page", "raw", *units],
                               stdout=f, stderr=log, timeout=120)
            except subprocess.TimeoutExpired:
                log.write("export timed out\n")
        try:
            return len(read_raw_csv(csv_file.read_text(errors="replace")))
        except ValueError as e:
            log.write(f"export {' '.join(units)}: {e}\n")
    return 0


def _run(cmd, timeout: float, log) -> int:
    log.write(f"\n$ {' '.join(cmd)}  (timeout {timeout:.0f} s)\n")
    log.flush()
    # its own process group, so that a timeout ends ncu and the program it started, not ncu alone
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    try:
        return proc.wait(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        log.write(f"timed out after {timeout:.0f} s\n")
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return 124


def cmd_run(a) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    left = lambda: a.budget - (time.time() - t0)  # noqa: E731
    ncu = a.ncu or find_ncu()
    if not ncu:
        print("ncu_explain: no ncu on PATH, in /usr/local/cuda/bin or /opt/nvidia/nsight-compute/*/", file=sys.stderr)
        return 2
    parse_cases(a.cases)
    # the .ncu-rep stays on the device machine unless asked for (a device call returns 8 files at most)
    rep_file = (out if a.keep_rep else Path(os.environ.get("TMPDIR", "/tmp"))) / "ncu_step.ncu-rep"
    csv_file = out / "ncu_raw.csv"
    measured = out / "decode_measured.json"
    env_py = sys.executable
    with open(out / "ncu_log.txt", "w") as log:
        if not a.measured and a.backend == "cuda":
            # first: the stage times, and the kernels' first compilation on a fresh machine (NVRTC's disk
            # cache), which the driver under ncu then skips
            cases = parse_cases(a.cases)
            paths = sorted({p for p, _ in cases})
            small = {("general",): "off", ("small-m",): "on"}.get(tuple(paths), "both")
            batches = ",".join(sorted({str(b) for _, b in cases}, key=int))
            t1 = time.time()
            rc = _run([env_py, "-m", "ddtree_rtc.cli", "bench", "decode", "--shard", a.shard, "--moe-layers", "1",
                       "--batches", batches, "--contexts", str(a.ctx), "--small-m", small, "--iters", "5",
                       "--json", str(measured)], min(a.measure_s, left() - 100), log)
            print(f"== bench decode rc={rc} {time.time() - t1:.0f} s (124: stopped at its time limit)", flush=True)
        n_kernels, rc = 0, 124
        for sections in (True, False):
            share = left() - 15  # the rest: the export and the report
            if share < 30:
                break
            rep_file.unlink(missing_ok=True)
            driver = [env_py, str(Path(__file__).resolve()), "profile", "--out", str(out), "--cases", a.cases,
                      "--ctx", str(a.ctx), "--layer", str(a.layer), "--shard", a.shard, "--backend", a.backend,
                      "--deadline", str(time.time() + share - 30)]
            t1 = time.time()
            rc = _run(ncu_command(ncu, rep_file, driver, a.max_kernels, sections), share, log)
            n_kernels = export_csv(ncu, rep_file, csv_file, log) if rep_file.exists() else 0
            print(f"== ncu ({'sections' if sections else 'explicit metrics'}) rc={rc} {time.time() - t1:.0f} s, "
                  f"{n_kernels} kernels profiled", flush=True)
            if n_kernels:
                break  # else: a refused section or metric; once more with explicit sm_90 metrics only
        if not n_kernels:
            log.flush()
            print(f"ncu profiled no kernel (rc {rc}); the end of {out / 'ncu_log.txt'}:")
            print((out / "ncu_log.txt").read_text()[-2500:])
            return 1
    ns = argparse.Namespace(csv=csv_file, cases=out / "ncu_cases.json", measured=a.measured or measured, out=out)
    if not ns.cases.exists():
        print(f"the driver wrote no {ns.cases}: see {out / 'ncu_log.txt'}")
        return 1
    return cmd_report(ns)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tools/ncu_explain.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", default=os.environ.get("OUT", "ncu_out"))
    common.add_argument("--cases", default=DEFAULT_CASES, help="PATH:BATCH,... (PATH general or small-m)")
    common.add_argument("--ctx", type=int, default=4096)
    common.add_argument("--layer", type=int, default=1, help="the layer profiled (1: the first MoE layer)")
    common.add_argument("--shard", choices=("none", "tp8", "ep8"), default="tp8")
    common.add_argument("--backend", choices=("cuda", "numpy"), default="cuda",
                        help="numpy: the tiny preset, no kernels (a CPU check of the plumbing)")
    p = sub.add_parser("run", parents=[common], help="ncu + driver, bench decode, report (GPU machine)")
    p.add_argument("--budget", type=float, default=240, help="seconds for all of it")
    p.add_argument("--measure-s", type=float, default=80,
                   help="at most this many seconds for bench decode (run first; ncu gets at least 100)")
    p.add_argument("--max-kernels", type=int, default=600, help="ncu --launch-count: a cap on profiled kernels")
    p.add_argument("--measured", help="a bench decode JSON to take stage times from instead of running it")
    p.add_argument("--ncu", help="the ncu binary (default: found on PATH or under /opt/nvidia)")
    p.add_argument("--keep-rep", action="store_true", help="write ncu_step.ncu-rep into --out too")
    p = sub.add_parser("profile", parents=[common], help="the driver (under ncu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deadline", type=float, default=0, help="wall clock (epoch s) after which cases are skipped")
    p = sub.add_parser("report", help="CSV + cases -> ncu_explain.json / .md")
    p.add_argument("--csv", required=True)
    p.add_argument("--cases", required=True, help="ncu_cases.json written by profile")
    p.add_argument("--measured", help="bench decode's JSON on the same cases (stage times)")
    p.add_argument("--out", default=os.environ.get("OUT", "ncu_out"))
    a = ap.parse_args(argv)
    return {"run": cmd_run, "profile": cmd_profile, "report": cmd_report}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
