"""The measured inputs of the projection, each read from a committed benchmark and named by its source.

Reference device: the H200 of benchmarks/*_h200.json (its measured read and matmul ceilings). A time
measured there carries to another device term by term: latency parts unchanged, memory parts by the
read-bandwidth ratio, compute parts by the tensor-rate ratio (model.py says which part is which).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import cache

from .data import ProjectionError, load_benchmark

SMALL_R = 1.3  # rows per expert at or below which an MoE row is a pure weight stream (M = 1..8 rows)


@dataclass(frozen=True)
class Device:
    """What a term needs of a device: effective read bandwidth and dense tensor rates (TFLOP/s)."""
    name: str
    bw_gbs: float
    rates: dict

    def rate(self, precision: str) -> float:
        r = self.rates.get(precision, 0.0)
        if r <= 0:
            raise ProjectionError(f"{self.name} has no {precision} tensor cores")
        return r


def rows(name: str) -> list[dict]:
    return load_benchmark(name)["rows"]


def ceiling(name: str, key: str = "read_gbs") -> float:
    d = load_benchmark(name)
    try:
        return float(d["ceilings"][key])
    except (KeyError, TypeError):
        raise ProjectionError(f"{name}: no ceilings.{key}") from None


def row(name: str, case: str) -> dict:
    for r in rows(name):
        if r["case"] == case:
            return r
    raise ProjectionError(f"{name}: no row {case!r}")


def interp(xs, ys, x):
    """Piecewise-linear through (xs, ys) (xs ascending), extended linearly past both ends."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class Reference:
    """The H200 the tables were measured on."""
    read_gbs: float
    matmul_tflops: float
    eta_lin: float      # skinny bf16 GEMM (M=1, 7168x7168): achieved / read ceiling
    eta_mm: float       # bf16 GEMM at M=1024: achieved / matmul ceiling
    launch_us: float    # one kernel launch replayed from a CUDA graph (tree_h200 floor row: 2 launches)
    source: str


@cache
def reference() -> Reference:
    b = "blocks_h200.json"
    read, mm = ceiling(b), ceiling(b, "matmul_tflops")
    m1, m1024 = row(b, "linear M=1 [7168x7168]"), row(b, "linear M=1024 [7168x7168]")
    fl = [r for r in rows("tree_h200.json") if r["case"].startswith("floor b=1 budget=16")]
    if not fl:
        raise ProjectionError("tree_h200.json: no 'floor b=1 budget=16' row")
    return Reference(read, mm, m1["bytes"] / (m1["us"] * 1e3) / read,
                     m1024["flops"] / (m1024["us"] * 1e6) / mm, fl[0]["us"] / 2,
                     f"{b} (linear M=1 / M=1024 rows, read {read:.0f} GB/s, matmul {mm:.0f} TFLOP/s); "
                     "tree_h200.json floor row (graph launch)")


# -- MoE: a table over (experts touched, rows per expert) ---------------------------------------------

@dataclass(frozen=True)
class MoETable:
    """One `bench moe` config (full K2.6 / TP8 shard / EP8 shard) on the reference:
    t(E, r) = fixed + E * (stream per expert + compute per expert at r rows).

    fixed and stream come from the pure-stream rows (r <= SMALL_R: M = 1..8), by least squares of t on E
    within that regime only; the compute per expert at r is each larger row's excess over the stream,
    interpolated over r (linearly past the last row). Nothing is fitted across regimes."""
    config: str
    fixed_us: float
    stream_us: float       # per expert, at the reference's read ceiling
    expert_bytes: float
    rs: tuple
    compute_us: tuple      # per expert at rows-per-expert rs, on the reference's bf16 rate
    read_gbs: float
    source: str

    def compute_at(self, r: float) -> float:
        if r <= SMALL_R:
            return 0.0
        return max(0.0, interp(self.rs, self.compute_us, r))


@cache
def moe_table(config: str) -> MoETable:
    name = "moe_h200.json"
    read = ceiling(name)
    pts = []
    for r in rows(name):
        ex = r.get("extra") or {}
        if ex.get("config") == config and ex.get("routing") == "bench":
            E, M, k = ex["experts_touched"], ex["M"], ex["top_k"]
            pts.append((M * k / E, E, r["us"], 3 * ex["hidden"] * ex["intermediate"] * (0.5 + 2 / 32)))
    small = [p for p in pts if p[0] <= SMALL_R]
    if len(small) < 2:
        raise ProjectionError(f"{name}: config {config!r} has fewer than 2 rows at <= {SMALL_R} rows per expert")
    n = len(small)
    mx, my = sum(p[1] for p in small) / n, sum(p[2] for p in small) / n
    slope = sum((p[1] - mx) * (p[2] - my) for p in small) / sum((p[1] - mx) ** 2 for p in small)
    fixed = my - slope * mx
    big = sorted((p[0], (p[2] - fixed) / p[1] - slope) for p in pts if p[0] > SMALL_R)
    rs = (SMALL_R,) + tuple(p[0] for p in big)
    cs = (0.0,) + tuple(max(0.0, p[1]) for p in big)
    return MoETable(config, fixed, slope, small[0][3], rs, cs, read,
                    f"{name} '{config}' rows: fixed {fixed:.1f} us + {slope:.2f} us/expert stream "
                    f"({small[0][3] / (slope * 1e3) / read:.0%} of read) from M=1..8; compute per expert over "
                    f"r = {', '.join(f'{r:.1f}' for r in rs[1:])} rows/expert")


# -- MLA core: the attention_h200 table ---------------------------------------------------------------

@dataclass(frozen=True)
class MLATable:
    heads: int
    grid: dict            # (ctx, batch, nodes) -> us
    latency_us: float     # the table's smallest time (h, ctx 1k, b1, N1): launch/latency, carried unchanged
    read_gbs: float
    matmul_tflops: float

    def axes(self):
        g = self.grid
        return (sorted({k[0] for k in g}), sorted({k[1] for k in g}), sorted({k[2] for k in g}))

    def ref_us(self, ctx, b, n):
        cs, bs, ns = self.axes()

        def along(vals, x, f):
            if x in vals:
                return f(x)
            i = min(max(bisect.bisect_left(vals, x), 1), len(vals) - 1)
            return interp([vals[i - 1], vals[i]], [f(vals[i - 1]), f(vals[i])], x)
        return along(cs, ctx, lambda c: along(bs, b, lambda bb: along(ns, n, lambda nn: self.grid[(c, bb, nn)])))


def mla_bytes_flops(heads, ctx, b, n):
    return b * (ctx + n) * 1152, 2 * heads * 1088 * b * n * (ctx + n)


@cache
def mla_table(heads: int) -> MLATable:
    name = "attention_h200.json"
    d = load_benchmark(name)
    grid = {}
    for r in d["rows"]:
        h, c, b, n = r["case"].split()
        if int(h[1:]) == heads:
            grid[(int(c[3:-1]) * 1024, int(b[1:]), int(n[1:]))] = r["us"]
    if not grid:
        raise ProjectionError(f"{name}: no rows for {heads} heads")
    return MLATable(heads, grid, min(grid.values()), d["ceilings"]["read_gbs"], d["ceilings"]["matmul_tflops"])


# -- the slice's stages (decode_h200) -----------------------------------------------------------------

def decode_stage_rows():
    out = {}
    for r in rows("decode_h200.json"):
        ex = r.get("extra") or {}
        if "stage" in ex:
            out.setdefault((ex["batch"], ex["ctx"], ex["stage"]), []).append(r)
    return out


@cache
def tree_rows():
    """(kind, batch, budget) -> us from tree_h200.json: 'topk' and 'build+accept' (CUDA graph)."""
    out = {}
    for r in rows("tree_h200.json"):
        c, ex = r["case"], r.get("extra") or {}
        if c.startswith("topk "):
            out[("topk", ex["batch"], ex["budget"])] = r["us"]
        elif c.startswith("build+accept ") and "[graph" in c:
            out[("build+accept", ex["batch"], ex["budget"])] = r["us"]
    return out


def drafter_rows():
    return {r["case"]: r for r in rows("drafter_h100.json")}
