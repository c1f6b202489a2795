"""The one-shot all-reduce fused with the residual RMSNorm (cuda_src/allreduce.cu, parallel/oneshot.py).

CPU: the numpy twin is the composition of today's steps (rank-order fp32 sum, to_bf16, rmsnorm);
runtime.allreduce is validated by name; the communicator wiring on the numpy backend (ranks as threads
joined by the local transport, their partials in one process's HostPeers) gives the same bits as the
all_reduce + rmsnorm (of the fp32 sum) path and saves one launch per sublayer. GPU: N simulated ranks on one
device (one launch for all, or one launch per rank on its own stream), NaN-prefilled outputs, bits equal
to the rank-order sum + to_bf16 + rmsnorm kernels; a CUDA graph replayed twice; the bounded wait trapping
in a child process; two real ranks (NCCL + CUDA IPC) where the machine has two GPUs.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from ml_dtypes import bfloat16

from ddtree_rtc.backend import Backend
from ddtree_rtc.parallel.comm import DistError
from ddtree_rtc.parallel.oneshot import OneShot, attach, simulated_group
from ddtree_rtc.reference.allreduce import HostPeers, allreduce_rmsnorm, reduce_norm, unsupported
from ddtree_rtc.reference.rmsnorm import rmsnorm, rounded_sum
from ddtree_rtc.testing import random_bf16

ROOT = Path(__file__).resolve().parents[1]
D = 7168  # K2.6 hidden
EPS = 1e-6


def _partials(rng, n: int, shape) -> np.ndarray:
    """[n, *shape] fp32 partials, random and non-zero, of mixed magnitude so the order of the sum shows."""
    p = rng.standard_normal((n, *shape)).astype(np.float32) * rng.choice([1e-3, 1.0, 30.0], (n, *shape))
    p[p == 0] = 1.0
    return p.astype(np.float32)


# -- CPU: the reference ------------------------------------------------------------------------------------

@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("n,rows,d", [(2, 1, 1088), (8, 3, D), (4, 16, 2048)])
def test_reference_is_the_composition(rng, n, rows, d, parts):
    shape = (rows, d) if parts == 1 else (2, rows, d)
    p = _partials(rng, n, shape)
    w, res = random_bf16(rng, (d,)), random_bf16(rng, (rows, d), 4.0)
    acc = p[0].copy()
    for q in range(1, n):
        acc = acc + p[q]
    a = rounded_sum(acc) if parts == 1 else rounded_sum(acc[0], acc[1])
    y_want, h_want = rmsnorm(a, w, EPS, residual=res)
    y, h = reduce_norm(p, w, EPS, res)
    assert y.dtype == bfloat16 and h.dtype == bfloat16
    assert np.array_equal(y.view(np.uint16), y_want.view(np.uint16))
    assert np.array_equal(h.view(np.uint16), h_want.view(np.uint16))


def test_reference_group_all_ranks_and_threads(rng):
    """HostPeers: every rank at once (rank=None) and each rank in its own thread give the composition."""
    n, rows = 4, 3
    peers = HostPeers(n, D, timeout_s=30)
    p = _partials(rng, n, (2, rows, D))
    for q in range(n):
        peers.partial(q, 1, (2, rows, D))[...] = p[q]
    w, res = random_bf16(rng, (D,)), random_bf16(rng, (n, rows, D))
    y_all, h_all = allreduce_rmsnorm(peers, 1, (2, rows, D), w, EPS, res)
    got = [None] * n

    def rank(q):
        got[q] = allreduce_rmsnorm(peers, 1, (2, rows, D), w, EPS, res[q], rank=q)

    threads = [threading.Thread(target=rank, args=(q,)) for q in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for q in range(n):
        y_want, h_want = reduce_norm(p, w, EPS, res[q])
        for a, b in ((y_all[q], y_want), (h_all[q], h_want), (got[q][0], y_want), (got[q][1], h_want)):
            assert np.array_equal(np.asarray(a).view(np.uint16), b.view(np.uint16))


def test_unsupported_shapes_are_named():
    assert unsupported((16, D), 8) is None and unsupported((2, 1, D), 2) is None
    assert "17 rows" in unsupported((17, D), 8)
    assert "world size 9" in unsupported((1, D), 9)
    assert "hidden size 256" in unsupported((1, 256), 2)
    assert "hidden size 7200" in unsupported((1, 7200), 2)  # not a multiple of 64
    assert "[2, rows, d]" in unsupported((3, 1, D), 2)
    peers = HostPeers(2, D)
    with pytest.raises(ValueError, match="made for hidden size 7168"):
        peers.partial(0, 0, (1, 2048))
    with pytest.raises(ValueError, match="slot 2"):
        peers.partial(0, 2, (1, D))


def test_host_barrier_times_out_with_a_named_error():
    peers = HostPeers(2, 2048, timeout_s=0.2)
    w, res = np.ones(2048, bfloat16), np.ones((1, 2048), bfloat16)
    with pytest.raises(TimeoutError, match="rank 0: one-shot all-reduce"):
        allreduce_rmsnorm(peers, 0, (1, 2048), w, EPS, res, rank=0)
    side = OneShot(peers, 1, Backend("numpy", quiet=True))
    with pytest.raises(DistError, match="rank 1: one-shot all-reduce: the peers did not all arrive"):
        side.all_reduce_norm(side.buffer((1, 2048)), w, EPS, res)


# -- CPU: configuration ------------------------------------------------------------------------------------

PIPE = """\
model:
  preset: tiny
runtime:
  backend: {backend}
  tensor_parallel: 2
  allreduce: {mode}
workload:
  synthetic: {{count: 1, prompt_len: 4, output_len: 2}}
"""


def test_runtime_allreduce_is_validated():
    from ddtree_rtc.pipeline.schema import PipelineError, RuntimeSpec, parse_pipeline

    assert RuntimeSpec().allreduce == "nccl"  # the default stays NCCL + norm
    for mode in ("auto", "nccl", "oneshot"):
        assert parse_pipeline(PIPE.format(backend="cuda", mode=mode), "p.yaml").runtime.allreduce == mode
    named = r"p.yaml:6: key 'runtime.allreduce': must be one of 'auto', 'nccl', 'oneshot', got 'ring'"
    with pytest.raises(PipelineError, match=named):
        parse_pipeline(PIPE.format(backend="cuda", mode="ring"), "p.yaml")
    with pytest.raises(PipelineError, match="allreduce: oneshot runs on the CUDA backend"):
        parse_pipeline(PIPE.format(backend="numpy", mode="oneshot"), "p.yaml")
    with pytest.raises(ValueError, match="allreduce must be"):
        RuntimeSpec(allreduce="ring")
    with pytest.raises(ValueError, match="allreduce: oneshot needs every rank"):
        RuntimeSpec(tensor_parallel=2, simulate_rank=0, allreduce="oneshot")
    assert parse_pipeline(PIPE.format(backend="numpy", mode="auto"), "p.yaml").runtime.allreduce == "auto"


def test_attach_decides_by_mode():
    from ddtree_rtc.parallel.comm import SingleRank
    from ddtree_rtc.parallel.simulated import SimulatedRank

    be = Backend("numpy", quiet=True)
    comm = SimulatedRank(0, 2)
    assert attach(comm, "nccl", be, D) == "nccl" and comm.oneshot is None
    assert attach(comm, "auto", be, D) == "nccl" and comm.oneshot is None
    with pytest.raises(DistError, match="oneshot: it needs the CUDA backend"):
        attach(comm, "oneshot", be, D)
    with pytest.raises(ValueError, match="runtime.allreduce: 'ring' is not one of auto, nccl, oneshot"):
        attach(comm, "ring", be, D)
    assert attach(SingleRank(), "oneshot", be, D) == "nccl"  # one rank reduces nothing


# -- CPU: the communicator's wiring, ranks as threads on the numpy backend ----------------------------------

def _model_cfg():
    """The tiny preset at hidden 1088, the smallest the kernel takes (1024 < d, a multiple of 64)."""
    from ddtree_rtc.model.config import preset_config

    return dataclasses.replace(preset_config("tiny"), hidden_size=1088)


class _ThreadRanks:
    """Ranks as threads of this process: each rank's all_reduce sums every rank's array in rank order
    (as the local transport does), after a barrier; nothing else is needed by a forward without logits."""

    def __init__(self, world: int):
        self.world, self.arrays, self.barrier = world, [None] * world, threading.Barrier(world)

    def comm(self, rank: int):
        from ddtree_rtc.parallel.comm import Communicator

        group = self

        class ThreadComm(Communicator):
            name = "threads"

            def _all_reduce(self, x):
                group.arrays[self.rank] = x.copy()
                group.barrier.wait(60)
                acc = group.arrays[0].copy()
                for q in range(1, group.world):
                    acc += group.arrays[q]
                group.barrier.wait(60)
                x[...] = acc
                return x

        return ThreadComm(rank, self.world)


def _rank_forward(comm, oneshot, tokens):
    """One forward of rank ``comm.rank`` of 2 (experts split by count) with or without the one-shot
    path: its hidden states after every layer (bf16 bits), its all-reduce count and its launches per
    stage (an OpRecorder's)."""
    from ddtree_rtc.engine.kv_cache import PagedKVCache
    from ddtree_rtc.model.shard import Shard
    from ddtree_rtc.model.target import ForwardBatch, TargetModel
    from ddtree_rtc.testing import OpRecorder, stage_launches

    be = OpRecorder()
    if oneshot is not None:
        comm.oneshot = OneShot(oneshot.peers, comm.rank, be)
    model = TargetModel.dummy(_model_cfg(), be, seed=3, shard=Shard(comm.rank, 2, True), comm=comm)

    def cache():
        c = PagedKVCache(be, model.num_layers, 8, 16)
        c.allocator.reserve("a", len(tokens))
        return c

    batch = ForwardBatch.causal(["a"], [0], [tokens], last_only=False)
    stages = stage_launches(model, batch, cache())
    comm.stats.calls.clear()
    out = model.forward(batch, cache(), output="none", hidden_layers=range(model.num_layers))
    hidden = [np.asarray(out.hidden[i]).view(np.uint16).copy() for i in range(model.num_layers)]
    return hidden, comm.stats.calls["all_reduce"], stages, comm.oneshot.calls if comm.oneshot else 0


def _threads(fn, world: int = 2):
    """``fn(comm)`` for ranks 0..world-1 as threads of this process."""
    group, got, errors = _ThreadRanks(world), [None] * world, []

    def body(rank):
        try:
            got[rank] = fn(group.comm(rank))
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append((rank, e))
            group.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    if errors:
        raise AssertionError(f"rank {errors[0][0]} failed: {errors[0][1]!r}") from errors[0][1]
    return got


def test_numpy_ranks_take_the_fused_path_with_the_same_bits(rng):
    """Two ranks (threads) of the tiny model at hidden 1088: the one-shot path's hidden states equal
    the all_reduce + rmsnorm (of the fp32 sum) path's bit for bit (both sum in rank order here), with the
    same all-reduce count, and every sublayer's end is one launch instead of two."""
    tokens = rng.integers(0, 1024, 5).tolist()
    group = simulated_group(2, 1088, Backend("numpy", quiet=True), timeout=60)
    fused = _threads(lambda comm: _rank_forward(comm, group[comm.rank], tokens))
    plain = _threads(lambda comm: _rank_forward(comm, None, tokens))
    layers = len(fused[0][0])
    for rank in range(2):
        for i in range(layers):
            assert np.array_equal(fused[rank][0][i], plain[rank][0][i]), f"rank {rank} layer {i}: hidden differs"
        assert not np.isnan(fused[rank][0][-1].view(bfloat16).astype(np.float32)).any()
        assert fused[rank][1] == plain[rank][1] == 2 * layers
        for (stage, layer, n_fused), (_, _, n_plain) in zip(fused[rank][2], plain[rank][2], strict=True):
            assert n_fused == n_plain - (1 if stage in ("attention", "mlp") else 0), (stage, layer)
    assert np.array_equal(fused[0][0][-1], fused[1][0][-1]), "ranks disagree"
    assert fused[0][3] == fused[1][3] == 2 * (2 * layers)  # stage_launches' forward and the compared one
    assert plain[0][3] == 0


# -- GPU: N simulated ranks on one device --------------------------------------------------------------------

def _composition(be, parts_dev, w, rank_res):
    """What the kernel must equal: the rank-order fp32 sum on the device, to_bf16 (+ plus_rounded),
    the rmsnorm kernel with the residual."""
    acc = parts_dev[0].copy()
    for q in range(1, parts_dev.shape[0]):
        acc += parts_dev[q]
    a = be.to_bf16(acc[0], plus_rounded=acc[1]) if acc.ndim == 3 else be.to_bf16(acc)
    return be.rmsnorm(a, w, EPS, residual=rank_res)


def _fill(peers, slot, shape, rng):
    import cupy

    host = _partials(rng, peers.nranks, shape)
    for q in range(peers.nranks):
        peers.partial(q, slot, shape)[...] = cupy.asarray(host[q])
    return cupy.asarray(host)


def _bits_equal(got, want, name):
    import cupy

    assert cupy.array_equal(got, want), f"{name}: {int((got != want).sum())} elements differ"


@pytest.mark.gpu
@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_simulated_ranks_one_launch(rng, n, rows, parts):
    import cupy

    from ddtree_rtc.kernels.allreduce import PeerBuffers
    from ddtree_rtc.kernels.allreduce import allreduce_rmsnorm as kernel
    from ddtree_rtc.testing import nan_bf16_bits, to_device_bf16

    be = Backend("cuda")
    peers = PeerBuffers.local(n, D, timeout_s=20)
    shape = (rows, D) if parts == 1 else (2, rows, D)
    w, res = to_device_bf16(random_bf16(rng, (D,))), to_device_bf16(random_bf16(rng, (n, rows, D), 4.0))
    for slot in (0, 1, 0):  # epochs advance per call; both slots
        parts_dev = _fill(peers, slot, shape, rng)
        y, h = nan_bf16_bits((n, rows, D)), nan_bf16_bits((n, rows, D))
        kernel(peers, slot, shape, w, EPS, res, out=y, residual_out=h)
        cupy.cuda.get_current_stream().synchronize()
        for r in range(n):
            y_want, h_want = _composition(be, parts_dev, w, res[r])
            _bits_equal(y[r], y_want, f"rank {r} y")
            _bits_equal(h[r], h_want, f"rank {r} residual")


@pytest.mark.gpu
def test_simulated_ranks_on_their_own_streams(rng):
    """One launch per rank, each on its own stream (the kernels wait on each other's flags)."""
    import cupy

    from ddtree_rtc.kernels.allreduce import allreduce_rmsnorm as kernel
    from ddtree_rtc.testing import nan_bf16_bits, to_device_bf16

    be, n, rows = Backend("cuda"), 4, 5
    group = simulated_group(n, D, be, timeout=20)
    peers = group[0].peers
    w, res = to_device_bf16(random_bf16(rng, (D,))), to_device_bf16(random_bf16(rng, (n, rows, D)))
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(n)]
    for slot in (0, 1):
        parts_dev = _fill(peers, slot, (2, rows, D), rng)
        cupy.cuda.get_current_stream().synchronize()
        outs = []
        for r in reversed(range(n)):  # the last rank first: rank 0's kernel starts waiting last
            with streams[r]:
                outs.append((r, *kernel(peers, slot, (2, rows, D), w, EPS, res[r], rank=r,
                                        out=nan_bf16_bits((rows, D)), residual_out=nan_bf16_bits((rows, D)))))
        for s in streams:
            s.synchronize()
        for r, y, h in outs:
            y_want, h_want = _composition(be, parts_dev, w, res[r])
            _bits_equal(y, y_want, f"rank {r} y")
            _bits_equal(h, h_want, f"rank {r} residual")


@pytest.mark.gpu
def test_rows_do_not_depend_on_m(rng):
    """A row's bits are the same at 3 rows as at 16 (each row is its own cluster)."""
    import cupy

    from ddtree_rtc.kernels.allreduce import PeerBuffers
    from ddtree_rtc.kernels.allreduce import allreduce_rmsnorm as kernel
    from ddtree_rtc.testing import to_device_bf16

    n = 8
    peers = PeerBuffers.local(n, D, timeout_s=20)
    w, res = to_device_bf16(random_bf16(rng, (D,))), to_device_bf16(random_bf16(rng, (n, 16, D)))
    full = _fill(peers, 0, (16, D), rng)
    y16, h16 = kernel(peers, 0, (16, D), w, EPS, res)
    for q in range(n):
        peers.partial(q, 1, (3, D))[...] = full[q, :3]
    y3, h3 = kernel(peers, 1, (3, D), w, EPS, cupy.ascontiguousarray(res[:, :3]))
    _bits_equal(y3, y16[:, :3], "y")
    _bits_equal(h3, h16[:, :3], "residual")


@pytest.mark.gpu
def test_graph_replays_twice(rng):
    """Two calls (both slots) captured in a CUDA graph and replayed twice on fresh partials: the
    epochs live on the device, so each replay waits for that replay's flags."""
    import cupy

    from ddtree_rtc.bench.harness import capture_graph
    from ddtree_rtc.kernels.allreduce import PeerBuffers
    from ddtree_rtc.kernels.allreduce import allreduce_rmsnorm as kernel
    from ddtree_rtc.testing import to_device_bf16

    be, n, rows = Backend("cuda"), 8, 3
    peers = PeerBuffers.local(n, D, timeout_s=20)
    w, res = to_device_bf16(random_bf16(rng, (D,))), to_device_bf16(random_bf16(rng, (n, rows, D)))
    y0, h0 = cupy.empty((n, rows, D), cupy.uint16), cupy.empty((n, rows, D), cupy.uint16)
    y1, h1 = cupy.empty_like(y0), cupy.empty_like(h0)

    def step():
        kernel(peers, 0, (rows, D), w, EPS, res, out=y0, residual_out=h0)
        kernel(peers, 1, (2, rows, D), w, EPS, h0, out=y1, residual_out=h1)

    step()  # compiled and warm outside the capture
    graph = capture_graph(step)
    for _ in range(2):
        p0, p1 = _fill(peers, 0, (rows, D), rng), _fill(peers, 1, (2, rows, D), rng)
        y0.fill(0x7FC0), h0.fill(0x7FC0), y1.fill(0x7FC0), h1.fill(0x7FC0)
        graph.launch()
        cupy.cuda.get_current_stream().synchronize()
        for r in range(n):
            y_want, h_want = _composition(be, p0, w, res[r])
            _bits_equal(y0[r], y_want, f"rank {r} first y")
            _bits_equal(h0[r], h_want, f"rank {r} first residual")
            y_want, h_want = _composition(be, p1, w, h_want)
            _bits_equal(y1[r], y_want, f"rank {r} second y")
            _bits_equal(h1[r], h_want, f"rank {r} second residual")


_DEAD_PEER = textwrap.dedent("""
    import os, sys, time, cupy
    from ddtree_rtc.kernels.allreduce import PeerBuffers, allreduce_rmsnorm
    peers = PeerBuffers.local(2, 7168, timeout_s=0.05)
    w = cupy.zeros(7168, cupy.uint16); res = cupy.zeros((1, 7168), cupy.uint16)
    allreduce_rmsnorm(peers, 0, (1, 7168), w, 1e-6, res, rank=0)  # rank 1 never comes
    t0 = time.monotonic()
    try:
        cupy.cuda.get_current_stream().synchronize()
    except Exception as e:
        print("ERROR", type(e).__name__, e, "after", round(time.monotonic() - t0, 2), "s", flush=True)
        sys.stderr.flush()
        os._exit(3)  # the context is gone: no teardown
    print("NO ERROR", flush=True)
""")


@pytest.mark.gpu
def test_dead_peer_traps_after_the_timeout():
    """A rank whose peer never arrives traps after its timeout instead of hanging: in a child process,
    since a trap ends the CUDA context (the tests' own context lives on)."""
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-c", _DEAD_PEER], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 3, (res.stdout, res.stderr)
    assert "ERROR" in res.stdout and time.monotonic() - t0 < 60
    assert re.search(r"allreduce_rmsnorm: rank 0 CTA \d+ waited 50000000 ns for rank 1", res.stdout + res.stderr), (
        res.stdout, res.stderr)


_TWO_RANKS = textwrap.dedent("""
    import cupy, numpy as np
    from ml_dtypes import bfloat16
    from ddtree_rtc.backend import Backend
    from ddtree_rtc.parallel.launch import make_communicator, rank_env
    from ddtree_rtc.parallel.oneshot import attach
    env = rank_env()
    be = Backend("cuda")
    comm = make_communicator(env, cuda=True)
    assert attach(comm, "oneshot", be, 7168) == "oneshot"
    rng = np.random.default_rng(7)
    host = rng.standard_normal((env.world_size, 2, 4, 7168)).astype(np.float32)
    w = cupy.asarray(rng.standard_normal(7168).astype(bfloat16).view(np.uint16))
    res = cupy.asarray(rng.standard_normal((4, 7168)).astype(bfloat16).view(np.uint16))
    for shape in ((4, 7168), (2, 4, 7168), (4, 7168)):
        p = comm.partial_buffer(shape, be)
        p[...] = cupy.asarray(host[env.rank].reshape(-1)[:p.size].reshape(shape))
        y, h = comm.all_reduce_norm(p, w, 1e-6, res, be)
        acc = cupy.asarray(host[0].reshape(-1)[:p.size].reshape(shape)).copy()
        for q in range(1, env.world_size):
            acc += cupy.asarray(host[q].reshape(-1)[:p.size].reshape(shape))
        a = be.to_bf16(acc[0], plus_rounded=acc[1]) if len(shape) == 3 else be.to_bf16(acc)
        y_want, h_want = be.rmsnorm(a, w, 1e-6, residual=res)
        assert cupy.array_equal(y, y_want) and cupy.array_equal(h, h_want), shape
    assert comm.oneshot.calls == 3 and comm.stats.calls["all_reduce"] == 3
    comm.close()
""")


@pytest.mark.gpu
def test_two_real_ranks_over_ipc():
    from ddtree_rtc.parallel.launch import spawn

    try:
        import cupy

        gpus = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001
        gpus = 0
    if gpus < 2:
        pytest.skip("needs 2 GPUs of one node")
    spawn([sys.executable, "-c", _TWO_RANKS], 2)
