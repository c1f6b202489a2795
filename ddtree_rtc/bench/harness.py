"""Timing and ceilings shared by every benchmark.

Times with CUDA events after warm-up, median of many runs, the L2 flushed between timed runs
(outside the timed region: the flush buffer written, then read, so the timed run starts with an L2
of clean lines that are no use to it; see ``flush_l2``). Ceilings are measured in the same run:
streaming read and device copy through our own 16-byte-access kernels, bf16 matmul through cuBLAS
on random data.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import platform
import statistics
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..kernels._launch import sm_count


@dataclass(frozen=True)
class Timing:
    median_us: float
    min_us: float
    p90_us: float


@functools.cache
def flush_buffer():
    """The buffer time_gpu fills between timed runs to evict the L2 (4x its size, >= 256 MB)."""
    import cupy

    l2 = cupy.cuda.Device().attributes.get("L2CacheSize", 64 << 20)
    return cupy.empty(max(4 * l2, 256 << 20), dtype=cupy.uint8)


def flush_l2(i: int = 0, clean: bool = True) -> None:
    """Evict the L2 on the current stream: write the flush buffer (several L2 sizes), then, with
    ``clean``, read all of it back. The write alone leaves the L2 full of the buffer's dirty lines,
    and the next kernel pays for writing them back (up to 50 MB on the H200, ~12 µs of HBM time
    that no decode step spends: its L2 holds the previous kernels' few MB of outputs); the read
    pass writes them back here, outside the timed region. ``clean=False`` is the write alone (the
    harness before 2026-12-04; results committed before then were timed that way)."""
    from ..kernels.registry import module

    buf = flush_buffer()
    buf.fill(i & 0xFF)
    if clean:
        n16 = buf.nbytes // 16
        module("bench_ceiling").fn("l2_clean_kernel")((sm_count() * 4,), (512,), (buf, np.int64(n16), _sink()))


@functools.cache
def _sink():
    import cupy

    return cupy.zeros(1, dtype=cupy.uint32)


_flush = flush_l2


def time_gpu(fn, warmup: int = 5, iters: int = 50, flush_l2: bool | str = True) -> Timing:
    """Median/min/p90 of ``fn()`` (which enqueues GPU work on the current stream), in µs.
    ``flush_l2``: True (clean flush before each timed run), "dirty" (the buffer written only, the
    older way), False (none: the L2 as the previous run left it)."""
    import cupy

    for _ in range(warmup):
        fn()
    stream = cupy.cuda.get_current_stream()
    stream.synchronize()
    if flush_l2 not in (True, False, "dirty"):
        raise ValueError(f"flush_l2={flush_l2!r}: expected True, False or 'dirty'")
    starts = [cupy.cuda.Event() for _ in range(iters)]
    ends = [cupy.cuda.Event() for _ in range(iters)]
    for i in range(iters):
        if flush_l2:
            _flush(i, clean=flush_l2 is True)
        starts[i].record(stream)
        fn()
        ends[i].record(stream)
    ends[-1].synchronize()
    us = sorted(cupy.cuda.get_elapsed_time(s, e) * 1e3 for s, e in zip(starts, ends))
    return Timing(statistics.median(us), us[0], us[min(len(us) - 1, int(0.9 * len(us)))])


def capture_graph(fn, pool=None):
    """``fn()`` run once eagerly on a private stream, then captured there as a CUDA graph; with
    ``pool`` (a cupy MemoryPool, kept alive by the caller) its allocations come from that pool, so a
    buffer freed during the capture is reused only by the graph. Returns the graph."""
    import contextlib

    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.get_current_stream().synchronize()
    with stream, cupy.cuda.using_allocator(pool.malloc) if pool is not None else contextlib.nullcontext():
        fn()
        stream.synchronize()
        stream.begin_capture()
        try:
            fn()
        finally:
            graph = stream.end_capture()
        stream.synchronize()
    return graph


def graphed(fn):
    """``fn`` captured once as a CUDA graph; returns a launcher (on the current stream)."""
    return capture_graph(fn).launch


def bf16_to_f32(bits):
    """bf16 bits (uint16, numpy or CuPy) -> fp32, exactly."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def rel_diff(got, ref) -> float:
    """max |got - ref| / max |ref| (inf when ``got`` is not finite): how far a variant's output is
    from the reference variant's, on the host."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if not np.isfinite(got).all():
        return float("inf")
    return float(np.abs(got - ref).max() / max(float(np.abs(ref).max()), 1e-30))


@functools.cache
def read_ceiling_gbs(nbytes: int = 2 << 30) -> float:
    """Streaming read bandwidth (GB/s) over a buffer far beyond the L2."""
    import cupy

    from ..kernels.registry import module

    src = cupy.random.default_rng(1).integers(0, 2**31, nbytes // 4, dtype=cupy.int32)
    sink = cupy.zeros(1, dtype=cupy.uint32)
    fn = module("bench_ceiling").fn("read_stream_kernel")
    n16 = np.int64(nbytes // 16)
    t = time_gpu(lambda: fn((sm_count() * 4,), (512,), (src, n16, sink)), warmup=3, iters=20)
    return nbytes / t.median_us / 1e3


@functools.cache
def copy_ceiling_gbs(nbytes: int = 1 << 30) -> float:
    """Device copy bandwidth (GB/s), counting bytes read plus bytes written."""
    import cupy

    from ..kernels.registry import module

    src = cupy.random.default_rng(2).integers(0, 2**31, nbytes // 4, dtype=cupy.int32)
    dst = cupy.empty_like(src)
    fn = module("bench_ceiling").fn("copy_stream_kernel")
    n16 = np.int64(nbytes // 16)
    t = time_gpu(lambda: fn((sm_count() * 4,), (512,), (src, dst, n16)), warmup=3, iters=20)
    return 2 * nbytes / t.median_us / 1e3


@functools.cache
def _floor_chain():
    """latency_floor_kernel's source array: a fixed permutation of 2**22 indices (dependent trips
    land far apart)."""
    import cupy

    n = 1 << 22
    return cupy.asarray(((np.arange(n, dtype=np.int64) * 7919 + 1_048_573) % n).astype(np.int32))


def latency_floor_launch(grids, trips: int = 1):
    """A callable that launches latency_floor_kernel once per entry of ``grids`` (blocks of 128
    threads), each block making ``trips`` dependent global loads and one store: a latency-bound
    per-request kernel's launch + memory round trips with nothing computed."""
    import cupy

    from ..kernels.registry import module

    src = _floor_chain()
    dst = cupy.zeros(max(max(grids), 1), dtype=np.int32)
    fn = module("bench_ceiling").fn("latency_floor_kernel")

    def run():
        for g in grids:
            fn((g,), (128,), (src, np.int32(trips), dst))

    return run


@functools.cache
def latency_floor_us(blocks: int, kernels: int = 1, trips: int = 1) -> float:
    """Median µs (timed as time_gpu times, L2 flushed) of ``kernels`` latency_floor_launch launches
    of ``blocks`` blocks back to back: the floor of a latency-bound per-request kernel."""
    return time_gpu(latency_floor_launch((blocks,) * kernels, trips), warmup=3, iters=30).median_us


@functools.cache
def mma_peak_tflops(blocks_per_sm: int = 8, iters: int = 4096) -> float:
    """mma.sync m16n8k16 bf16 (fp32 accumulate) rate with nothing else issued (bench_ceiling.cu's
    mma_peak_kernel: 4-warp blocks, ``blocks_per_sm`` per SM, 8 accumulator chains per warp), in
    TFLOP/s: the compute ceiling of kernels built on mma.sync, such as the INT4 MoE GEMMs."""
    import cupy

    from ..kernels.registry import module

    fn = module("bench_ceiling").fn("mma_peak_kernel")
    out = cupy.zeros(1, cupy.float32)
    blocks = sm_count() * blocks_per_sm
    t = time_gpu(lambda: fn((blocks,), (128,), (np.int32(iters), out)), warmup=2, iters=5, flush_l2=False)
    flops = blocks * 4 * iters * 8 * 2 * 16 * 8 * 16  # warps x iterations x chains x (2 m n k)
    return flops / t.median_us / 1e6


def random_bf16_device(shape, scale: float = 1.0, seed: int = 0):
    """Random bf16 (uint16 bits) made on the GPU: round-to-nearest of normal fp32 samples."""
    import cupy

    return f32_to_bf16_bits(cupy.random.default_rng(seed).standard_normal(shape, dtype=cupy.float32)
                            * np.float32(scale))


def fill_random_bf16(a, scale: float = 1.0, seed: int = 0) -> None:
    """Fill the bf16 device array ``a`` with random values one leading slice at a time (a KV cache
    layer by layer): the fp32 temporaries stay one slice big, not the size of ``a``. A numpy
    (bfloat16) array is filled on the host."""
    if isinstance(a, np.ndarray):
        rng = np.random.default_rng(seed)
        for i in range(a.shape[0]):
            a[i] = (rng.standard_normal(a.shape[1:], dtype=np.float32) * np.float32(scale)).astype(a.dtype)
        return
    for i in range(a.shape[0]):
        a[i] = random_bf16_device(a.shape[1:], scale=scale, seed=seed * 1_000_003 + i)


def f32_to_bf16_bits(x):
    """fp32 (finite, numpy or CuPy) -> bf16 bits (uint16), round to nearest even."""
    bits = x.view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


@functools.cache
def matmul_ceiling_tflops(n: int = 8192) -> float:
    """bf16 dense matmul rate (TFLOP/s) through cuBLAS, fp32 accumulate, random data."""
    import cupy

    from ..kernels.linear import linear

    a, b = random_bf16_device((n, n), seed=3), random_bf16_device((n, n), seed=4)
    out = cupy.empty((n, n), dtype=cupy.uint16)
    t = time_gpu(lambda: linear(a, b, out=out), warmup=3, iters=10, flush_l2=False)
    return 2 * n**3 / t.median_us / 1e6


@dataclass
class Row:
    case: str
    us: float
    bytes: int | None = None
    flops: int | None = None
    ceiling: str = "read"  # read | copy | matmul
    peer: str | None = None
    peer_us: float | None = None
    extra: dict = field(default_factory=dict)

    @property
    def gbs(self) -> float | None:
        return self.bytes / self.us / 1e3 if self.bytes else None

    @property
    def tflops(self) -> float | None:
        return self.flops / self.us / 1e6 if self.flops else None

    def fraction(self) -> float | None:
        if self.ceiling == "matmul":
            return self.tflops / matmul_ceiling_tflops() if self.flops else None
        if self.ceiling == "copy":
            return self.gbs / copy_ceiling_gbs() if self.bytes else None
        return self.gbs / read_ceiling_gbs() if self.bytes else None


def device_info() -> dict:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return {
        "device": name,
        "sms": props["multiProcessorCount"],
        "l2_bytes": props["l2CacheSize"],
        "compute_capability": f"{props['major']}.{props['minor']}",
        "driver": cupy.cuda.runtime.driverGetVersion(),
        "runtime": cupy.cuda.runtime.runtimeGetVersion(),
        "cupy": cupy.__version__,
    }


def host_device() -> dict:
    """The JSON's device fields for a run on the numpy backend: named as the host CPU, never a GPU, so
    that ``projection`` (which reads ``device``) cannot take its figures for a GPU's."""
    return {"device": f"numpy backend on the host CPU ({platform.machine() or 'unknown'}), not a GPU",
            "backend": "numpy"}


def stamp(device: dict | None = None) -> dict:
    """When, at which commit and on what a result was measured: the fields every benchmark JSON
    carries (``device``: what ran it, when not this process's GPU; without a GPU, ``host_device``)."""
    if device is None:
        try:
            device = device_info()
        except Exception:  # no CUDA here (cupy missing or no device): a numpy-backend run
            device = host_device()
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(), "host": platform.node(), **device}


def git_commit() -> str:
    """The commit benchmarked: $DDTREE_RTC_COMMIT when set (copies of the tree without .git, as on
    the lent GPU machine), else git's HEAD with -dirty for uncommitted tracked changes."""
    env = os.environ.get("DDTREE_RTC_COMMIT")
    if env:
        return env
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                             cwd=root, timeout=10)
        if out.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=root, timeout=10).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def report(title: str, rows: list[Row], json_path: str | None = None, notes: dict | None = None,
           device: dict | None = None) -> dict:
    """Print ``case | µs | GB/s | TFLOP/s | % of ceiling | peer`` and write the same rows as JSON.
    ``device``: what ran them, when not this process's GPU (``device_info``)."""
    ceilings = {"read_gbs": read_ceiling_gbs()}
    if any(r.ceiling == "matmul" for r in rows):
        ceilings["matmul_tflops"] = matmul_ceiling_tflops()
    if any(r.ceiling == "copy" for r in rows):
        ceilings["copy_gbs"] = copy_ceiling_gbs()
    header = ("case", "µs", "GB/s", "TFLOP/s", "% of ceiling", "peer")
    table = []
    for r in rows:
        frac = r.fraction()
        peer = f"{r.peer} {r.peer_us:.1f} µs" if r.peer and r.peer_us is not None else (r.peer or "-")
        table.append((r.case, f"{r.us:.2f}", _fmt(r.gbs, ".0f"), _fmt(r.tflops, ".1f"),
                      "-" if frac is None else f"{100 * frac:.1f}% {r.ceiling}", peer))
    widths = [max(len(h), *(len(t[i]) for t in table)) if table else len(h) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("ceilings: " + ", ".join(f"{k} {v:.1f}" for k, v in ceilings.items()))
    print(" | ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("-|-".join("-" * w for w in widths))
    for t in table:
        print(" | ".join(c.ljust(w) for c, w in zip(t, widths)))
    doc = {
        "title": title,
        **stamp(device),
        "ceilings": ceilings,
        "notes": notes or {},
        "rows": [dict(asdict(r), gbs=r.gbs, tflops=r.tflops, fraction_of_ceiling=r.fraction()) for r in rows],
    }
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(doc, indent=1))
        print(f"wrote {json_path}")
    return doc
