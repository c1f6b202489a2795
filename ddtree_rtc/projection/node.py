"""The reader of `ddtree-rtc bench node`'s JSON (benchmarks/node_<device>.json; its format is
bench/node.py's ``summary_doc``): per case, the per-rank AR step and DDTree round of K2.6 at 61 layers,
measured on one GPU as one simulated rank of 8.

A file is used only where it was measured on a GPU of platforms.yaml (its ``device``), of the k2.6
preset, as a rank of 8, at 61 layers (measured or scaled). Any other layout entry (the numpy backend's,
a test preset's, another world size) is left out, and the reason is listed beside the used files. A
file whose structure is wrong stops the projection with the file and key named."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from .data import ProjectionError, load_benchmark, node_files
from .platforms import load_platforms, platform_of

LAYOUTS = {"tp": "tp8", "ep": "tp_attn_ep_moe"}  # bench node --layouts -> the projection's layouts
WORLD = 8
FULL_LAYERS = 61


@dataclass(frozen=True)
class NodePoint:
    """One measured AR step (budget 0) or DDTree round of one rank."""

    file: str
    device: str
    platform: str              # platforms.yaml key of the GPU
    read_gbs: float            # the file's measured read ceiling
    layout: str                # the projection's name (model.LAYOUTS)
    small_m: str               # runtime.small_m_path: on / off
    batch: int
    ctx: int
    budget: int                # 0: the AR step
    rank_us: float             # per-rank time at 61 layers; collective latency and stand-in holds excluded
    drafter: bool              # a round's rank_us includes the DFlash drafter's forward (measured)
    collective_calls: int      # per step / round at 61 layers (a round's: the drafter's included if measured)
    experts: float | None      # distinct experts per MoE layer (all ranks), mean over the measured layers

    def label(self) -> str:
        what = "AR" if self.budget == 0 else f"budget {self.budget}"
        return f"{self.file} ({self.device}) {self.layout} small-M {self.small_m} b{self.batch} ctx{self.ctx} {what}"


@dataclass(frozen=True)
class NodeFiles:
    points: tuple
    used: tuple                # file names with at least one point
    left_out: tuple            # (file, reason)


def _key(d: dict, key: str, where: str):
    if not isinstance(d, dict) or key not in d:
        raise ProjectionError(f"{where}: missing key {key!r} (bench node's summary_doc format expected)")
    return d[key]


def _num(d: dict, key: str, where: str) -> float:
    v = _key(d, key, where)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
        raise ProjectionError(f"{where}.{key}: expected a number >= 0, got {v!r}")
    return float(v)


def _mean_experts(by_layer) -> float | None:
    v = [x for x in (by_layer or {}).values() if isinstance(x, (int, float))]
    return sum(v) / len(v) if v else None


def gpu_of(name: str, d: dict):
    """(platform, None) for a file measured on a GPU of platforms.yaml, else (None, the reason)."""
    device = str(d.get("device", ""))
    if d.get("backend", "cuda") != "cuda":
        return None, f"device {device!r}, backend {d['backend']}: not a GPU measurement"
    pf = platform_of(device, load_platforms())
    if pf is None:
        return None, f"device {device!r} is not a GPU of platforms.yaml"
    return pf, None


def read_file(name: str) -> tuple[list[NodePoint], list[str]]:
    """The points of one node file and the reasons any of its layouts were left out."""
    d = load_benchmark(name)
    pf, why = gpu_of(name, d)
    if pf is None:
        return [], [why]
    read = _num(_key(d, "ceilings", name), "read_gbs", f"{name}: ceilings")
    summ = _key(d, "summary", name)
    full = _key(summ, "full_layers", f"{name}: summary")
    layouts = _key(summ, "layouts", f"{name}: summary")
    if not isinstance(layouts, list):
        raise ProjectionError(f"{name}: summary.layouts: expected a list, got {type(layouts).__name__}")
    points, left = [], []
    for i, lay in enumerate(layouts):
        where = f"{name}: summary.layouts[{i}]"
        kind = _key(lay, "layout", where)
        # files written before the "preset" key came from main(), which runs k2.6 only
        preset, world = lay.get("preset", "k2.6"), _key(lay, "world", where)
        if kind not in LAYOUTS:
            raise ProjectionError(f"{where}.layout: {kind!r}, expected one of {sorted(LAYOUTS)}")
        if preset != "k2.6" or world != WORLD or full != FULL_LAYERS:
            left.append(f"layout {kind}: preset {preset}, rank of {world}, {full} layers (the projection needs "
                        f"k2.6 as a rank of {WORLD} at {FULL_LAYERS} layers)")
            continue
        hold = float(lay.get("collective_stand_in_hold_us", 0.0))
        for j, c in enumerate(_key(lay, "cases", where)):
            cw = f"{where}.cases[{j}]"
            made = int(_num(c, "layers", cw))
            missing = FULL_LAYERS - made
            common = dict(file=name, device=str(d["device"]), platform=pf.key, read_gbs=read, layout=LAYOUTS[kind],
                          small_m=str(_key(c, "small_m", cw)), batch=int(_num(c, "batch", cw)),
                          ctx=int(_num(c, "ctx", cw)))
            if common["batch"] < 1 or common["ctx"] < 1 or not 1 <= made <= FULL_LAYERS:
                raise ProjectionError(f"{cw}: batch {common['batch']}, ctx {common['ctx']}, layers {made}: expected "
                                      f"batch and ctx >= 1 and 1 <= layers <= {FULL_LAYERS}")
            ar = _key(c, "ar", cw)
            calls = int(_num(_key(ar, "collectives", f"{cw}.ar"), "calls", f"{cw}.ar.collectives")) + 2 * missing
            rank = _rank_us(ar, c, cw)
            points.append(NodePoint(**common, budget=0, rank_us=rank - hold * calls, drafter=False,
                                    collective_calls=calls, experts=_mean_experts(ar.get("experts_touched_per_layer"))))
            drafter = c.get("drafter_us")
            d_calls = int((c.get("drafter_collectives") or {}).get("calls", 0)) if drafter is not None else 0
            for k, rd in enumerate(_key(c, "rounds", cw)):
                rw = f"{cw}.rounds[{k}]"
                if _key(rd, "chain", rw):
                    continue  # the depth-7 chain: the projection's DDTree points are trees
                calls = int(_num(_key(rd, "collectives", rw), "calls", f"{rw}.collectives")) + 2 * missing + d_calls
                us = _num(rd, "rank_us", rw) + (drafter or 0.0)
                points.append(NodePoint(**common, budget=int(_num(rd, "budget", rw)), rank_us=us - hold * calls,
                                        drafter=drafter is not None, collective_calls=calls,
                                        experts=_mean_experts(rd.get("experts_touched"))))
    return points, left


def _rank_us(ar: dict, case: dict, where: str) -> float:
    """The AR step's per-rank time at 61 layers: ``ar.rank_us``, or in files written before that key
    the latency-independent ``rank_us`` of the case's first projection entry."""
    if "rank_us" in ar:
        return _num(ar, "rank_us", f"{where}.ar")
    proj = case.get("projection") or []
    if not proj:
        raise ProjectionError(f"{where}.ar: missing key 'rank_us' (and no projection entry to read it from)")
    return _num(_key(proj[0], "ar", f"{where}.projection[0]"), "rank_us", f"{where}.projection[0].ar")


@cache
def node_points() -> NodeFiles:
    """Every usable point of benchmarks/node_*.json, the files used and those (or their layouts) left out."""
    points, used, left = [], [], []
    for name in node_files():
        p, why = read_file(name)
        points += p
        if p:
            used.append(name)
        left += [(name, w) for w in why]
    return NodeFiles(tuple(points), tuple(used), tuple(left))


def pick_point(platform: str, layout: str, ar: bool, small_m: str, batch: int, budget: int, ctx: int):
    """The measured point to scale a platform's modelled per-rank time by, or None. The file of the
    platform's own GPU first, else the reference H200's, else any GPU's; then the small-M setting asked
    for where measured; then the nearest batch, budget and context (in that order)."""
    import math

    pts = [p for p in node_points().points if p.layout == layout and (p.budget == 0) == ar]
    pts = [p for p in pts if p.platform == platform] or [p for p in pts if p.platform == "h200"] or pts
    pts = [p for p in pts if p.small_m == small_m] or pts
    if not pts:
        return None
    return min(pts, key=lambda p: (abs(p.batch - batch), abs(p.budget - budget), abs(math.log(p.ctx / ctx)),
                                   p.file, p.small_m))
