"""One comparison helper and the tolerances, named per dtype, used by every kernel test (and a few
input / model helpers the tests share).

First NaN/inf positions must match exactly (a poisoned read shows up as NaN), then the relative
error ||a - b|| / ||b|| must be under the dtype's tolerance and every element within atol+rtol|b|.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from ml_dtypes import bfloat16

from .backend import Backend
from .engine.kv_cache import PageAllocator, PagedKVCache
from .kernels.moe_small import experts_launches
from .model.moe import MoELayerWeights
from .model.target import ForwardBatch, TargetModel
from .reference.moe_routing import descending, group_scores, limit_to_groups, selection_scores

# (relative-norm tolerance, elementwise rtol, elementwise atol)
TOLERANCES = {
    "fp64": (1e-12, 1e-10, 1e-12),
    "fp32": (1e-5, 1e-4, 1e-5),
    "bf16": (8e-3, 2e-2, 2e-2),  # one bf16 rounding is 2^-8 relative; allow a few
    "bf16_accum": (1e-2, 5e-2, 5e-2),  # long bf16-input dot products, fp32 accumulate
    # fp32 outputs of long dot products of unit-scale inputs (values ~ sqrt(K)): the accumulation
    # error scales with the terms (~sqrt(K) * 2^-24 * sqrt(K)), not with a result that cancels
    "fp32_accum": (1e-5, 1e-4, 1e-3),
}


def to_host(a) -> np.ndarray:
    """A device or host array as numpy; GPU bf16 (uint16 bits) is NOT reinterpreted here."""
    return a.get() if hasattr(a, "get") else np.asarray(a)


def as_f64(a, bf16_bits: bool = False) -> np.ndarray:
    a = to_host(a)
    if bf16_bits or a.dtype == np.uint16:
        a = a.view(bfloat16) if a.dtype == np.uint16 else a
    return a.astype(np.float64)


def assert_close(actual, expected, kind: str, name: str = "output") -> None:
    """Compare ``actual`` (device or host; uint16 means bf16 bits) with ``expected`` (host)."""
    tol_norm, rtol, atol = TOLERANCES[kind]
    a, b = as_f64(actual), as_f64(expected)
    if a.shape != b.shape:
        raise AssertionError(f"{name}: shape {a.shape} != expected {b.shape}")
    bad_a, bad_b = ~np.isfinite(a), ~np.isfinite(b)
    if not np.array_equal(bad_a, bad_b):
        idx = np.argwhere(bad_a != bad_b)[:5].tolist()
        raise AssertionError(f"{name}: non-finite positions differ (e.g. at {idx}); "
                             f"{int(bad_a.sum())} in actual, {int(bad_b.sum())} expected")
    if not np.array_equal(a[bad_a], b[bad_b], equal_nan=True):
        raise AssertionError(f"{name}: non-finite values differ (NaN vs inf)")
    a, b = np.where(bad_a, 0, a), np.where(bad_b, 0, b)
    denom = np.linalg.norm(b)
    rel = np.linalg.norm(a - b) / denom if denom > 0 else np.linalg.norm(a - b)
    if rel > tol_norm:
        raise AssertionError(f"{name}: relative error {rel:.3e} > {tol_norm:.1e} ({kind})")
    over = np.abs(a - b) > atol + rtol * np.abs(b)
    if over.any():
        i = tuple(np.argwhere(over)[0])
        raise AssertionError(f"{name}: {int(over.sum())} elements off beyond {kind} tolerance, "
                             f"first at {i}: {a[i]!r} vs {b[i]!r}")


def random_bf16(rng: np.random.Generator, shape, scale: float = 1.0) -> np.ndarray:
    """Random non-zero bf16 values (normal, no exact zeros)."""
    x = rng.standard_normal(shape).astype(np.float32) * scale
    x[x == 0] = scale
    return x.astype(bfloat16)


def nan_bf16_bits(shape):
    """A device array of bf16 NaNs (as uint16 bits) to pre-fill outputs."""
    import cupy

    return cupy.full(shape, 0x7FC0, dtype=cupy.uint16)


def to_device_bf16(a: np.ndarray):
    import cupy

    return cupy.asarray(np.ascontiguousarray(a).astype(bfloat16).view(np.uint16))


def busy_device(matmuls: int = 8, size: int = 4096):
    """Queue ``matmuls`` fp32 matmuls of ``size`` x ``size`` on the current stream (a few ms each on
    an H100) and return at once: device work that host code meant not to wait for the stream is
    timed against. Returns the last product (all ones)."""
    import cupy

    a = cupy.ones((size, size), cupy.float32)
    for _ in range(matmuls):
        a = (a @ a) * np.float32(1.0 / size)
    return a


def check_rows_invariant(run, reference, x: np.ndarray, rng: np.random.Generator, t: int, kinds) -> None:
    """A small-M kernel on ``t`` random rows of ``x`` (a batch of ``len(x)`` tokens) against its
    reference, and each of those rows the same bits as in the whole batch. ``run(idx)``: the kernel
    on rows ``idx`` into NaN-prefilled outputs, returning them on the host; ``reference(rows)``: the
    same outputs from numpy; ``kinds``: (tolerance kind, name) of each output."""
    idx = rng.permutation(len(x))[:t]
    got = run(idx)
    for g, w, (kind, name) in zip(got, reference(x[idx]), kinds, strict=True):
        assert_close(g, w, kind, name)
    for g, f, (_, name) in zip(got, run(np.arange(len(x))), kinds, strict=True):
        if not np.array_equal(g, f[idx]):
            raise AssertionError(f"{name}: {t} rows differ from the same rows in a batch of {len(x)}")


def last_logits(model, tokens, page_size: int = 16) -> np.ndarray:
    """A TargetModel's logits (float64, host) at the last of ``tokens``: one causal prefill on a
    fresh paged cache, the reference point tests use to judge a greedy divergence."""
    tokens = list(tokens)
    cache = PagedKVCache(model.backend, model.num_layers, -(-len(tokens) // page_size), page_size)
    cache.allocator.reserve(0, len(tokens))
    out = model.forward(ForwardBatch.causal([0], [0], [tokens]), cache, output="logits").logits
    return model.backend.to_host(out).astype(np.float64).reshape(-1, model.cfg.vocab_size)[-1]


def dflash_forward_once(dm, ctx_hidden: dict, block_tokens, start: int):
    """A DFlashModel's block forward for one request without an engine: context rows (the target's
    hidden states ``ctx_hidden``) at positions start-T .. start-1, the block at start ..
    start+Bs-1 -> host fp32 (final hidden [Bs, H], logits [Bs-1, V])."""
    be, c = dm.backend, dm.cfg
    if len(block_tokens) != c.block_size:
        raise ValueError(f"block_tokens: expected {c.block_size} ids, got {len(block_tokens)}")
    hidden = {i: be.asarray(np.asarray(h).astype(np.float32).astype(bfloat16)) for i, h in ctx_hidden.items()}
    t = int(next(iter(hidden.values())).shape[0])
    if start < t:
        raise ValueError(f"start {start} < {t} context rows")
    page = 16
    alloc = PageAllocator(max(1, -(-start // page)), page)
    kc, vc = (PagedKVCache(be, len(dm.layers), alloc.num_pages, page, dm.kv_heads * c.head_dim, alloc)
              for _ in range(2))
    alloc.reserve(0, max(start, 1))
    pos = np.arange(start - t, start, dtype=np.int32)
    slots = be.asarray(alloc.slots(0, pos).astype(np.int32))
    for i, (k, v) in enumerate(dm.context_kv(hidden, be.asarray(pos))):
        kc.write(i, k, slots)
        vc.write(i, v, slots)
    layers = range(len(dm.layers))
    logits, x = dm.block_forward(be.asarray(np.asarray(block_tokens, np.int32)),
                                 be.asarray(np.arange(start, start + c.block_size, dtype=np.int32)),
                                 [kc.layer(i) for i in layers], [vc.layer(i) for i in layers],
                                 be.asarray(alloc.page_table([0])), be.asarray(np.array([start], np.int32)),
                                 be.asarray(np.array([start - t], np.int32)))
    return be.to_host(x).astype(np.float32), be.to_host(logits)[0].astype(np.float32)


@dataclass(frozen=True)
class RoutePick:
    """One token's routing decision in one MoE layer: the kept groups (all of them when the routing
    is not group-limited) and the picked experts, ascending, and how close each choice was: the
    selection-score gap between the last kept group / picked expert and the best one left out
    (inf where none is left out); ``scores``: the selection scores (fp32 [E], before the group limit)."""

    groups: tuple
    experts: tuple
    group_margin: float
    expert_margin: float
    scores: np.ndarray = field(repr=False, compare=False)

    def flip_margin(self, other: RoutePick) -> float | None:
        """None when ``other`` made the same choice; else how clear the differing choice was in the
        clearer of the two: the group margin if the groups differ, else the expert margin."""
        if self.groups != other.groups:
            return max(self.group_margin, other.group_margin)
        if self.experts != other.experts:
            return max(self.expert_margin, other.expert_margin)
        return None


def _gaps(scores: np.ndarray, order: np.ndarray, k: int) -> np.ndarray:
    """scores[order[k-1]] - scores[order[k]] per row, float64; inf where nothing finite is left out."""
    if k >= scores.shape[1]:
        return np.full(len(scores), np.inf)
    pick = np.take_along_axis(scores, order[:, k - 1:k + 1], axis=-1).astype(np.float64)
    gap = pick[:, 0] - pick[:, 1]
    return np.where(np.isnan(gap), np.inf, gap)


def route_picks(model: TargetModel, layer: int, x) -> list[RoutePick]:
    """The routing decision of MoE layer ``layer`` for each row of its MLP input ``x`` [T, H]:
    the backend's router logits over all of ``x`` (as the layer computes them: a row's sums can
    depend on the rows beside it), then the reference routing's selection and group scores."""
    be, rc, mlp = model.backend, model.routing, model.layers[layer].mlp
    logits_dev = be.router_logits(x, mlp.gate_weight)
    bias_dev = mlp.e_score_correction_bias
    logits = be.to_host(logits_dev)
    bias = None if bias_dev is None else be.to_host(bias_dev)
    _, scores = selection_scores(logits, bias)
    b = scores
    groups = np.broadcast_to(np.arange(rc.n_group), (len(b), rc.n_group))
    group_margin = np.full(len(b), np.inf)
    if rc.n_group > 1:
        gscore = group_scores(b, rc.n_group)
        gorder = descending(gscore)
        groups, group_margin = np.sort(gorder[:, :rc.topk_group], axis=-1), _gaps(gscore, gorder, rc.topk_group)
        b = limit_to_groups(b, rc.n_group, rc.topk_group)
    order = descending(b)
    experts, expert_margin = np.sort(order[:, :rc.top_k], axis=-1), _gaps(b, order, rc.top_k)
    ids, _ = be.moe_route(logits_dev, bias_dev, rc.top_k, rc.n_group, rc.topk_group)
    if not np.array_equal(np.sort(be.to_host(ids), axis=-1), experts):
        raise AssertionError(f"layer {layer}: route_picks disagrees with the backend's moe_route")
    return [RoutePick(tuple(g.tolist()), tuple(e.tolist()), float(gm), float(em), sc)
            for g, e, gm, em, sc in zip(groups, experts, group_margin, expert_margin, scores)]


class RouteRecorder(TargetModel):
    """``model`` (the same weights and backend) recording the routing of every token it runs:
    ``picks[(seq_id, i)]`` = {MoE layer: RoutePick} for token i of sequence seq_id (cache position
    ctx + j; a token run again keeps its latest). Hand it to an Engine to see the experts each token
    really went to in that run, batch neighbours' rounding included."""

    def __init__(self, model: TargetModel):
        self.__dict__.update(model.__dict__)
        self.picks: dict = {}

    def run(self, inputs, cache, output="argmax", hidden_layers=(), moe_plan=None, mark=None):
        b = inputs.batch
        keys = [(s, int(c) + j) for s, c, n in zip(b.seq_ids, b.ctx_lens, b.num_new) for j in range(int(n))]
        rows = [{} for _ in keys]

        def record(stage, layer, x):
            if mark is not None:
                mark(stage, layer, x)
            if stage == "mlp" and isinstance(self.layers[layer].mlp, MoELayerWeights):
                for row, pick in zip(rows, route_picks(self, layer, x)):
                    row[layer] = pick

        out = super().run(inputs, cache, output, hidden_layers, moe_plan, record)
        self.picks.update(zip(keys, rows))
        return out


def random_prompts(seed: int, lengths) -> list[list[int]]:
    """Prompts of the given lengths, token ids drawn from [3, 1000) with ``seed``."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 1000, n).tolist() for n in lengths]


# Kernel launches of a backend op on the CUDA backend where it is more than one, as a count (at most:
# mla_attention launches its merge only when the plan cuts a tile) or from the op's arguments
# (moe_small_experts: by its token count, kernels/moe_small.experts_launches); every other op of the
# small-M path is one launch. The general path also launches copies outside the op table (contiguous
# views, slice assignments), which are not counted.
# allreduce_rmsnorm: its one launch is the communicator's all_reduce, which stage_launches counts
OP_LAUNCHES = {"mla_attention": 2, "moe_small_experts": lambda x, *a, **kw: experts_launches(x.shape[0]),
               "allreduce_rmsnorm": 0}


class OpRecorder(Backend):
    """The numpy backend, recording every op called, in order, with its CUDA launches (OP_LAUNCHES;
    the launch count's input)."""

    def __init__(self):
        super().__init__("numpy")
        self.ops: list[tuple[str, int]] = []

    def op(self, name):
        fn = super().op(name)
        launches = OP_LAUNCHES.get(name, 1)

        def rec(*a, **kw):
            self.ops.append((name, launches(*a, **kw) if callable(launches) else launches))
            return fn(*a, **kw)

        return rec

    def to_bf16(self, x, plus_rounded=None):
        self.ops.append(("to_bf16", 1))  # one elementwise launch on the GPU (a method, not an op of the table)
        return super().to_bf16(x, plus_rounded)


def stage_launches(model: TargetModel, batch: ForwardBatch, cache) -> list[tuple[str, int, int]]:
    """(stage, layer, CUDA kernel launches) of each stage of one forward of ``model`` (built on an
    OpRecorder): 'embed' (with the first norm), then per layer 'attention' and 'mlp' (at one rank each
    sublayer with the residual norm after it; on a tensor-parallel rank, e.g. a SimulatedRank's, see
    TargetModel.run), counted from the ops each stage ran (their recorded launches) and, on a
    tensor-parallel rank, its collectives (one launch each, from the communicator's counts). The CUDA
    path takes the same ops as numpy."""
    rec = model.backend
    if not isinstance(rec, OpRecorder):
        raise TypeError(f"stage_launches: the model's backend must be an OpRecorder, got {rec!r}")
    rec.ops.clear()
    out, seen = [], [0, model.comm.stats.total()[0]]

    def mark(stage, layer, x):
        ops = rec.ops[seen[0]:]
        calls = model.comm.stats.total()[0]
        seen[0] = len(rec.ops)
        out.append((stage, layer, sum(n for _, n in ops) + calls - seen[1]))
        seen[1] = calls

    model.run(model.prepare(batch, cache), cache, output="none", mark=mark)
    return out


# -- the command line in a child process -----------------------------------------------------------------

def start_cli_run(root, out, *args: str, backend: str = "numpy"):
    """``ddtree-rtc run *args`` started in a child process from the checkout ``root`` (its package
    first on the path), writing its JSON to ``out``; finish it with ``finish_process``."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-m", "ddtree_rtc.cli", "run", *args, "--quiet",
                             "--set", f"output.json={out}", "--set", f"runtime.backend={backend}"],
                            cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_process(p, timeout: float = 300):
    """Its output once ``p`` ends (a CompletedProcess); killed, and the timeout raised, past ``timeout`` s."""
    import subprocess

    try:
        stdout, stderr = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        raise
    return subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
