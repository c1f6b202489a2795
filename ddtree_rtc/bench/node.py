"""Kimi K2.6 at full depth (61 layers) as ONE rank of an 8-GPU node, on one GPU: the per-rank AR
decode step and DDTree round, their split against byte floors, the DFlash drafter at its TP8
shard, and the projected tok/s per user of the node.

The rank's weights are made in device memory (``model.load: dummy``, model/dummy.py: the rank's
shard only, nothing written) and every collective is a stand-in moving the same bytes (one device
copy of the message, parallel/simulated.py): the numerics are NOT the model's (partial sums unreduced),
the time and the bytes are rank R's. Layouts (``--layouts``):
  * ``tp``: TP8, attention heads, dense / shared intermediate, lm_head rows and every routed
    expert's intermediate split 8 ways;
  * ``ep``: TP-attention + EP-MoE, attention as in ``tp``, each rank holding 48 of the 384 routed
    experts whole; routing still chooses among all 384 and the rank runs only the tokens routed to
    its own. The node's MoE time is the slowest rank's: one MoE layer's expert shard of every rank
    is made in turn and timed on the same routed tokens (per-rank expert load reported).
    (DP-attention + EP-MoE, attention replicated and the batch split, is not a layout the engine
    has.)

Per layout, context and batch (--batches, --contexts):
  * the AR step (bench/decode.bench_case): every layer's attention block and MLP block (each with
    its all-reduce stand-in), the embedding and the head (with its all-gather stand-in) against their
    byte floors, eager / queued / one CUDA graph;
  * components of one MoE layer, timed alone, each against its floor: router (logits + noaux_tc
    top-k), routed experts (only the touched experts' bytes), shared expert, the all-reduce stand-in
    at the layer's message size;
  * the DDTree round (bench/round.bench_case) at each budget (--budgets) and the depth-7 chain:
    top-k / build / verify / choose / accept / commit, replayed as one CUDA graph; tau is the
    oracle profile's expected tau at --accept-p (OracleDrafter.expected_tau: a simulated rank's
    numerics cannot measure one);
  * the K2.6 DFlash drafter's block forward at its TP8 shard (8 of 64 q heads, 1 of 8 kv heads,
    intermediate 2304; the rank's lm_head slice + all-gather stand-in), one CUDA graph;
  * collective calls and bytes per step and per round (counted by the communicator);
  * per-token time: AR step; DDTree (round + drafter) / tau at the oracle's tau and, for the chain,
    at the published acceptance of z-lab's Kimi-K2.5-DFlash (PUBLISHED_TAU);
  * projected tok/s per user on 8 GPUs = 1 / (measured per-rank time + collective latency x
    collective count), both parts printed, for each latency of --collective-us (cited figures by
    default, COLLECTIVE_US_CITED; or pass a measured one);
  * the auto row (``--auto-rounds``, bench/node_auto.py): ``decode.budget: auto`` SIMULATED over
    oracle rounds on a cost model made from this case's own projected figures (not an engine run),
    with every measured setting simulated the same way: auto's tau, µs per round, tok/s per user,
    chosen node counts, and auto over the best and the worst fixed setting (chain included).

If the rank does not fit the GPU (a TP8 rank of K2.6 is ~78 GB of weights), ``--layers auto`` (the
default) keeps, per layout, the most layers that fit the free memory at both peaks (making the
weights; running the largest case: drafter, KV, graphs and buffers; see plan_memory) and says so.
Each case's caches and graphs, then each layout's model, are given back before the next (free_blocks;
the JSON's memory figures show the plan beside what was held); every
per-step figure is then also given scaled to 61 layers: + (61 - L) x the graph's time per MoE layer,
measured by replaying the same step / round graph on the first P = L // 2 layers (the same weights,
``depth_view``; dense layer 0, embedding and head in both): (T(L) - T(P)) / (L - P). The queued
per-stage times are not used for this: they split the step by stage, and the graph runs a layer
faster than their sum (no events between stages).

The JSON (``--json``, written atomically) carries device, date and commit (bench/harness.report)
and a ``summary`` (see ``summary_doc``) that ``projection`` reads.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import json
import statistics
import time
import typing
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..reference.tree_build import MAX_BUDGET
from .harness import Row, host_device, read_ceiling_gbs, report, time_gpu

FULL_LAYERS = 61
WORLD = 8
BATCHES = (1, 4, 10)
CONTEXTS = (1024, 8192)
BUDGETS = (4, 8, 16, 32, 64)
ACCEPT_P = 0.77  # bench round's default: the oracle's expected tau ~ 5 at budget 32
QUICK = {"batches": (1, 10), "contexts": (1024,), "budgets": (8, 32), "iters": 5}
# z-lab's Kimi-K2.5-DFlash (block size 8): mean acceptance length (tokens per round) by benchmark
PUBLISHED_TAU = {"GSM8K": 5.3, "Math500": 5.5, "HumanEval": 5.3, "MBPP": 4.5, "MT-Bench": 3.7}
PUBLISHED_SOURCE = ("z-lab, Kimi-K2.5-DFlash model card (huggingface.co/z-lab/Kimi-K2.5-DFlash): acceptance "
                    "length at block size 8, GSM8K 5.3, Math500 5.5, HumanEval 5.3, MBPP 4.5, MT-Bench 3.7")
# small-message all-reduce latency on 8 H100/H200 over NVLink, not measured here
COLLECTIVE_US_CITED = (20.0, 8.0)
COLLECTIVE_SOURCE = ("cited, not measured here: NCCL all-reduce of a few-KB message on 8 GPUs ~20 µs; a one-shot "
                     "custom all-reduce (TensorRT-LLM / vLLM style) ~7-9 µs (8 used); pass --collective-us with a "
                     "measured figure (e.g. bench decode's all-reduce rows under torchrun) to replace them")
LAYOUTS = {"tp": False, "ep": True}  # layout -> expert_parallel
# --small-m value -> how the bench applies it to a loaded model. Both are explicit: a model is made
# with small_m_path on (the engine default), so "off" must turn it off. A value is offered only where
# the pipeline schema accepts it too (small_m_choices).
SMALL_M_APPLY: dict[str, typing.Callable] = {
    "on": lambda model: setattr(model, "small_m_path", True),
    "off": lambda model: setattr(model, "small_m_path", False),
}
PAGE = 64
# The memory plan (plan_memory). What one case's run holds beyond the weights and its KV cache
# (graphs' pools, activations, logits, component / EP inputs), per decoder layer: measured on the
# H100 at d62ed90, where `--quick --layers 40 --small-m off` left 62.8 GB held after its tp layout
# (nothing released then) against 51.8 GB of weights and the 1.4 GB drafter: 9.6 GB for 2 cases of
# 4 graphs each, over 40 layers. Each case's are released now before the next, so this bounds one case.
RUN_BYTES_PER_LAYER = int(9.6e9 / 40)
RUN_ROWS_MEASURED = 10 * 33  # that run's largest verify: batch 10 x (budget 32 + 1) rows
LOGIT_ROW_BYTES = 12  # per vocabulary entry of a logits row: the bf16 gather, its transpose, fp32 copies
DRAFTER_BYTES = 1536 << 20  # the K2.6 DFlash drafter's TP8 shard: 6 layers + fc, 1.41 GB
# a layer's make beyond the layer itself: the repack's groups (stack, contiguous copy, nibble
# permutation, words, blocks of a 256 MB group) and the generator's uint64 hash steps (128 MB each)
REPACK_TRANSIENT_BYTES = 5 * (256 << 20) + 3 * (128 << 20)
RELEASE_SLACK_BYTES = 256 << 20  # a layout's release may keep this much (kernel modules loaded on first use)
MARGIN_BYTES = 1 << 30  # the CUDA context's growth (kernel modules loaded while running), allocator rounding


def small_m_choices() -> tuple[str, ...]:
    """The ``--small-m`` values: those ``runtime.small_m_path`` accepts (a bool key: on / off; only
    'off' without the key) that this bench knows how to apply (SMALL_M_APPLY)."""
    from ..pipeline.schema import RuntimeSpec

    hints = typing.get_type_hints(RuntimeSpec)
    hint = hints.get("small_m_path")
    if hint is None:
        allowed = ("off",)
    elif hint is bool:
        allowed = ("on", "off")
    else:
        allowed = typing.get_args(hint)
    return tuple(v for v in SMALL_M_APPLY if v in allowed)


def make_parser() -> argparse.ArgumentParser:
    from .node_auto import ROUNDS as AUTO_ROUNDS

    ap = argparse.ArgumentParser(
        prog="ddtree-rtc bench node", description=__doc__.split("\n\n")[0],
        epilog="The JSON's 'summary' is documented in ddtree_rtc/bench/node.py (summary_doc).")
    ap.add_argument("--layouts", default="tp,ep",
                    help="comma-separated: tp (TP8 everywhere), ep (TP-attention + EP-MoE: 48 experts per rank)")
    ap.add_argument("--rank", type=int, default=0, help="the rank simulated (0..world-1)")
    ap.add_argument("--world", type=int, default=WORLD, help="ranks of the node")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)), help="requests per step / round")
    ap.add_argument("--contexts", default=",".join(map(str, CONTEXTS)), help="committed tokens per request")
    ap.add_argument("--budgets", default=",".join(map(str, BUDGETS)),
                    help=f"DDTree tree budgets (nodes per request, <= {MAX_BUDGET}); '' for none")
    ap.add_argument("--no-chain", dest="chain", action="store_false", help="skip the depth-7 chain round")
    ap.add_argument("--layers", default="auto",
                    help=f"decoder layers to make (1..{FULL_LAYERS}); auto: per layout, all {FULL_LAYERS} if they "
                         f"fit the GPU's free memory (making the weights, and running the largest case), else the "
                         f"most that do; with fewer, every step and round is also timed at half the layers and "
                         f"scaled to {FULL_LAYERS} by the graph's time per layer")
    ap.add_argument("--iters", type=int, default=10, help="timed runs per measurement (median reported)")
    ap.add_argument("--accept-p", type=float, default=ACCEPT_P,
                    help="the oracle's rank-0 probability per depth; tau is its expected tau per budget")
    ap.add_argument("--collective-us", default=",".join(f"{v:g}" for v in COLLECTIVE_US_CITED),
                    help="collective latencies (µs) the 8-GPU projection adds per collective call "
                         "(default: cited NCCL ~20 and one-shot ~8)")
    ap.add_argument("--hold-us", type=float, default=0.0,
                    help="runtime.simulate_collective_us: each stand-in also holds the stream this long "
                         "(then the measured step already includes the latency: use --collective-us 0)")
    ap.add_argument("--small-m", default="on",
                    help="comma-separated runtime.small_m_path values to run (each case once per value; "
                         "default on, the engine's; 'on,off' compares the small-M path with the general "
                         "kernels); accepted: " + ", ".join(small_m_choices()))
    ap.add_argument("--no-drafter", dest="drafter", action="store_false", help="skip the DFlash drafter forward")
    ap.add_argument("--no-components", dest="components", action="store_false",
                    help="skip the MoE layer's component timings (router / experts / shared / all-reduce)")
    ap.add_argument("--quick", action="store_true",
                    help="a subset for one short device call: batches 1,10, context 1k, budgets 8,32 + chain, "
                         "5 iterations (explicit flags still win)")
    ap.add_argument("--auto-rounds", type=int, default=AUTO_ROUNDS,
                    help="simulated rounds of the auto row per case (decode.budget auto on the case's measured "
                         f"costs, bench/node_auto.py; default {AUTO_ROUNDS}; 0 skips it)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the dummy weights")
    ap.add_argument("--json", metavar="FILE", help="write the rows and the summary as JSON here "
                                                   "(e.g. benchmarks/node_h100.json)")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    from .round import int_list

    ap = make_parser()
    args = ap.parse_args(argv)
    given = {a.split("=")[0] for a in (argv or []) if a.startswith("--")}
    if args.quick:
        for k, v in QUICK.items():
            if f"--{k}" not in given:
                setattr(args, k, ",".join(map(str, v)) if isinstance(v, tuple) else v)
    try:
        args.batches = int_list(args.batches, "--batches", 1, 512)
        args.contexts = int_list(args.contexts, "--contexts", 1, 1 << 20)
        args.budgets = int_list(args.budgets, "--budgets", 1, MAX_BUDGET) if args.budgets.strip() else ()
        args.collective_us = tuple(float(v) for v in str(args.collective_us).split(",") if v.strip())
    except ValueError as e:
        ap.error(str(e))
    args.layouts = tuple(v.strip() for v in args.layouts.split(",") if v.strip())
    bad = [v for v in args.layouts if v not in LAYOUTS]
    if bad or not args.layouts:
        ap.error(f"--layouts: {bad or 'none'}; choose from {', '.join(LAYOUTS)}")
    args.small_m = tuple(v.strip() for v in args.small_m.split(",") if v.strip())
    choices = small_m_choices()
    bad = [v for v in args.small_m if v not in choices]
    if bad or not args.small_m:
        ap.error(f"--small-m: {bad or 'none'}; runtime.small_m_path accepts {', '.join(choices)} here")
    if args.world < 2 or not 0 <= args.rank < args.world:
        ap.error(f"--rank {args.rank} of --world {args.world}: need world >= 2 and 0 <= rank < world")
    if args.layers != "auto":
        try:
            args.layers = int(args.layers)
        except ValueError:
            ap.error(f"--layers: expected auto or an integer, got {args.layers!r}")
        if not 1 <= args.layers <= FULL_LAYERS:
            ap.error(f"--layers {args.layers}: outside 1..{FULL_LAYERS}")
    if args.auto_rounds < 0:
        ap.error(f"--auto-rounds {args.auto_rounds}: must be >= 0")
    if args.iters < 1 or not 0 < args.accept_p <= 1 or args.hold_us < 0 or any(v < 0 for v in args.collective_us):
        ap.error("--iters >= 1, --accept-p in (0, 1], --hold-us >= 0 and --collective-us >= 0")
    return args


# -- memory -----------------------------------------------------------------------------------------
def kv_bytes(layers: int, batch: int, rows: int, row: int) -> int:
    """A paged bf16 KV cache of ``batch`` requests x ``rows`` rows over ``layers`` layers."""
    return layers * batch * -(-rows // PAGE) * PAGE * row * 2


def plan_memory(cfg, shard, args, free: int) -> tuple[int, dict]:
    """(layers, figures): the most layers <= 61 (or --layers) that fit ``free`` bytes at both peaks,
    plus MARGIN_BYTES; raises SystemExit naming the bytes when even the asked number (or one layer)
    does not fit.
      * making the weights: the layers made so far + one MoE layer's compressed experts and its
        repack's temporaries (the weights are made outside CuPy's pool, see ``unpooled``: a freed
        temporary goes back to the driver at once and no weight pins a cached block);
      * running a case: the weights, the drafter, the largest case's KV cache and what a case holds
        besides (RUN_BYTES_PER_LAYER per layer, + logits rows beyond the measured largest verify);
        under EP also one other rank's MoE layer and its make (ep_rank_rows)."""
    from ..model.dummy import shard_nbytes

    most_nodes = 1 + max((*args.budgets, 7 if args.chain else 0))
    rows = max(args.contexts) + most_nodes
    row = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    drafter = DRAFTER_BYTES if args.drafter else 0
    logit_rows = max(args.batches) * (most_nodes if args.budgets or args.chain else 1)

    w1 = shard_nbytes(cfg.with_layers(1), shard)
    per_layer = shard_nbytes(cfg.with_layers(2), shard) - w1  # every layer after the dense first one is MoE
    load_transient = per_layer + REPACK_TRANSIENT_BYTES
    ep_extra = per_layer + load_transient if shard.expert_parallel else 0

    def weights(n: int) -> int:
        return w1 + (n - 1) * per_layer

    def kv(n: int) -> int:
        return kv_bytes(n, max(args.batches), rows, row)

    def run(n: int) -> int:
        return n * RUN_BYTES_PER_LAYER + max(0, logit_rows - RUN_ROWS_MEASURED) * cfg.vocab_size * LOGIT_ROW_BYTES

    def need(n: int) -> int:
        return max(weights(n) + load_transient, weights(n) + drafter + kv(n) + run(n) + ep_extra) + MARGIN_BYTES

    want = FULL_LAYERS if args.layers == "auto" else args.layers
    n = want
    if args.layers == "auto":
        while n > 1 and need(n) > free:
            n -= 1
    figures = {"free_bytes": free, "weights_bytes": weights(n), "kv_bytes_largest_case": kv(n),
               "load_transient_bytes": load_transient, "run_bytes": run(n), "drafter_bytes": drafter,
               "ep_other_rank_bytes": ep_extra, "margin_bytes": MARGIN_BYTES, "needed_bytes": need(n),
               "full_depth_weights_bytes": weights(FULL_LAYERS)}
    if need(n) > free:
        kind = "EP" if shard.expert_parallel else "TP"
        raise SystemExit(
            f"bench node: {n} layers of a {kind}{shard.world} rank need {need(n) / 1e9:.1f} GB (weights "
            f"{figures['weights_bytes'] / 1e9:.1f}, then making a layer {load_transient / 1e9:.1f} or running a case: "
            f"drafter {drafter / 1e9:.1f}, KV of the largest case {kv(n) / 1e9:.1f}, its graphs and buffers "
            f"{run(n) / 1e9:.1f}" + (f", another EP rank's layer {ep_extra / 1e9:.1f}" if ep_extra else "")
            + f"; margin {MARGIN_BYTES / 1e9:.1f}) but the GPU has {free / 1e9:.1f} GB free: pass fewer --layers, "
            f"smaller --batches / --contexts")
    return n, figures


# -- pieces -----------------------------------------------------------------------------------------
@dataclass
class ProfileTau:
    """The oracle profile's expected tau for a round (round.bench_case's ``tau_stats``): a simulated
    rank's numerics are not the model's, so no tau is measured."""

    tau: float
    rounds: int = 0

    def acceptance_by_depth(self) -> list[float]:
        return []


def count_collectives(model, batch: int, nodes: int, last_only: bool) -> dict:
    """Collective calls and bytes of one forward of ``batch`` requests x ``nodes`` new tokens with
    logits (every row, or each request's last: an AR step), counted by the communicator."""
    from ..engine.kv_cache import PagedKVCache
    from ..model.target import ForwardBatch
    from ..parallel.comm import CommStats

    be = model.backend
    cache = PagedKVCache(be, model.num_layers, batch * -(-nodes // PAGE), PAGE, model.dims.row)
    for s in range(batch):
        cache.allocator.reserve(s, nodes)
    fb = ForwardBatch.causal(list(range(batch)), [0] * batch, [[1] * nodes for _ in range(batch)], last_only=last_only)
    saved, model.comm.stats = model.comm.stats, CommStats()
    model.forward(fb, cache, output="logits")
    be.synchronize()
    stats, model.comm.stats = model.comm.stats, saved
    calls, nbytes = stats.total()
    return {"calls": calls, "bytes": nbytes, "by_kind": stats.snapshot()}


def count_drafter_collectives(drafter, batch: int) -> dict:
    """Collective calls and bytes of one DFlash block forward of ``batch`` requests (its o / down
    all-reduces per layer and the head's all-gather), counted on a one-page context."""
    from ..parallel.comm import CommStats
    from .drafter import Context

    comm = drafter.target.comm
    cx = Context(drafter, batch, PAGE, seed=batch)
    saved, comm.stats = comm.stats, CommStats()
    cx.forward(drafter)
    drafter.backend.synchronize()
    stats, comm.stats = comm.stats, saved
    calls, nbytes = stats.total()
    return {"calls": calls, "bytes": nbytes, "by_kind": stats.snapshot()}


def moe_layer_input(model, inputs, cache, moe_plan, layer: int):
    """The MLP input rows of decoder layer ``layer`` in this step (copied from a forward's mark)."""
    got = {}

    def mark(stage, i, x):
        if stage == "mlp" and i == layer:
            got["x"] = x.copy()

    model.run(inputs, cache, output="none", moe_plan=moe_plan, mark=mark)
    return got["x"]


def step_inputs(model, batch: int, ctx: int, nodes: int):
    """A prepared forward of ``batch`` requests x ``nodes`` new tokens at context ``ctx`` (random KV)."""
    from ..engine.kv_cache import PagedKVCache
    from ..model.target import ForwardBatch
    from .harness import fill_random_bf16

    cache = PagedKVCache(model.backend, model.num_layers, batch * -(-(ctx + nodes) // PAGE), PAGE, model.dims.row)
    fill_random_bf16(cache.data, seed=batch + ctx + nodes)
    for s in range(batch):
        cache.allocator.reserve(s, ctx + nodes)
    rng = np.random.default_rng(batch * 31 + nodes)
    toks = [rng.integers(0, model.cfg.vocab_size, nodes).tolist() for _ in range(batch)]
    fb = ForwardBatch.causal(list(range(batch)), [ctx] * batch, toks)
    return model.prepare(fb, cache), cache


def component_rows(model, batch: int, ctx: int, nodes: int, iters: int, layer: int, tag: str) -> list[Row]:
    """One MoE layer's pieces timed alone (L2 flushed) on the step's real layer input: router,
    routed experts, shared expert, the all-reduce stand-in of its fp32 [2, T, H] message. Each piece
    runs the kernels of the model's path for T rows (model/moe.py ``moe``): on the small-M path with
    batch_invariant, "router" is moe_small_dense (the router logits and the shared expert's gate_up
    in one launch) and "shared expert" its down linear, with the routing in the same launch
    (moe_small_route_shared) up to 384 experts."""
    from ..model.moe import MoELayerWeights
    from ..reference.moe_small import ROUTE_SHARED_MAX_EXPERTS

    be, rc = model.backend, model.routing
    lw = model.layers[layer].mlp
    if not isinstance(lw, MoELayerWeights):
        return []
    inputs, cache = step_inputs(model, batch, ctx, nodes)
    t = batch * nodes
    plan = model.moe_plan(t)
    x = moe_layer_input(model, inputs, cache, plan, layer)
    logits = be.router_logits(x, lw.gate_weight)
    ids, w = be.moe_route(logits, lw.e_score_correction_bias, rc.top_k, rc.n_group, rc.topk_group,
                          rc.norm_topk_prob, rc.routed_scaling_factor)
    global_ids = be.to_host(ids)
    touched_all = len(np.unique(global_ids))
    local = ids - be.xp.int32(lw.expert_offset) if lw.is_expert_shard else ids
    mine = global_ids - lw.expert_offset
    mine = mine[(mine >= 0) & (mine < lw.experts.num_experts)]
    touched_mine = len(np.unique(mine))
    h = model.cfg.hidden_size
    out = be.empty((t, h), "fp32")
    shared_out = be.empty((t, h), "fp32")
    parts = be.empty((2, t, h), "fp32")
    small, impl = model.small_m(t), model.linear_impl(t)
    bf16_router = impl == "invariant" and lw.gate_weight.dtype != np.float32
    dense_pair = bf16_router and lw.num_experts % 8 == 0 and lw.shared_w13.shape[0] % 8 == 0  # as model/moe.py
    fused = dense_pair and lw.num_experts <= ROUTE_SHARED_MAX_EXPERTS  # routing + shared down: as model/moe.py
    lg_dense, hs = be.moe_small_dense(x, lw.gate_weight, lw.shared_w13) if dense_pair else (None, None)
    route = (rc.top_k, rc.n_group, rc.topk_group, rc.norm_topk_prob, rc.routed_scaling_factor)

    def router():
        if dense_pair:
            lg, _ = be.moe_small_dense(x, lw.gate_weight, lw.shared_w13)
        elif bf16_router:
            lg = be.linear(x, lw.gate_weight, out=be.empty((t, lw.num_experts), "fp32"), impl=impl)
        else:
            lg = be.router_logits(x, lw.gate_weight)
        if not fused:
            be.moe_route(lg, lw.e_score_correction_bias, *route)

    def experts():
        if small:
            be.moe_small_experts(x, ids, w, lw.experts, out=out, plan=plan, check_ids=False,
                                 id_offset=lw.expert_offset)
        else:
            be.moe_experts(x, local, w, lw.experts, out=out, plan=plan, check_ids=False)

    def shared():
        if fused:
            be.moe_small_route_shared(lg_dense, lw.e_score_correction_bias, hs, lw.shared_w2, *route, out=shared_out)
        elif dense_pair:
            be.linear(hs, lw.shared_w2, out=shared_out, impl=impl)
        else:
            be.linear(be.silu_mul(be.linear(x, lw.shared_w13, impl=impl)), lw.shared_w2, out=shared_out, impl=impl)

    def collective():
        model.comm.all_reduce(parts)

    router_bytes = int(lw.gate_weight.nbytes + lw.e_score_correction_bias.nbytes + x.nbytes)
    expert_bytes = touched_mine * lw.experts.expert_nbytes() + int(x.nbytes)
    shared_bytes = int(lw.shared_w13.nbytes + lw.shared_w2.nbytes + x.nbytes)
    if dense_pair:  # the shared gate_up's bytes move to the router's launch
        router_bytes += int(lw.shared_w13.nbytes)
        shared_bytes = int(lw.shared_w2.nbytes + hs.nbytes)
    if fused:  # and the routing's reads (logits, bias) to the shared down's launch
        router_bytes -= int(lw.e_score_correction_bias.nbytes)
        shared_bytes += int(lg_dense.nbytes + lw.e_score_correction_bias.nbytes)
    case = f"{tag} L{layer}"
    common = {"batch": batch, "ctx": ctx, "tokens": t, "layer": layer, "path": "small-m" if small else "general"}
    rows = []
    saved = model.comm.stats
    for name, fn, nbytes, ceiling, extra in (
            ("router", router, router_bytes, "read", {}),
            ("routed experts", experts, expert_bytes, "read",
             {"experts_touched_global": touched_all, "experts_touched_this_rank": touched_mine}),
            ("shared expert", shared, shared_bytes, "read", {}),
            ("all-reduce stand-in (device copy)", collective, 2 * int(parts.nbytes), "copy",
             {"message_bytes": int(parts.nbytes)})):
        us = time_gpu(fn, warmup=2, iters=iters).median_us
        rows.append(Row(f"{case} {name}", us, bytes=nbytes, ceiling=ceiling,
                        extra={**common, "component": name, "floor_us": nbytes / read_ceiling_gbs() / 1e3, **extra}))
    model.comm.stats = saved
    return rows


def ep_rank_rows(model, batch: int, ctx: int, node_counts: list[int], iters: int, layer: int, seed: int,
                 tag: str) -> list[Row]:
    """EP: one MoE layer's routed experts of EVERY rank, each made once and timed on the step's
    routed tokens for every entry of ``node_counts`` (tokens per request: 1 for an AR step, 1 +
    budget for a verify); rank r runs only the tokens routed to its experts. Per rank: µs, (token,
    expert) pairs and distinct experts; the node waits for the slowest."""
    from ..model.dummy import DummySource
    from ..model.moe import MoELayerWeights, load_moe_layer
    from ..model.shard import Shard

    be, rc, cfg = model.backend, model.routing, model.cfg
    lw0 = model.layers[layer].mlp
    if not isinstance(lw0, MoELayerWeights):
        return []
    routed = {}
    for nodes in node_counts:  # the layer's real input for each shape, then the caches go
        inputs, cache = step_inputs(model, batch, ctx, nodes)
        x = moe_layer_input(model, inputs, cache, model.moe_plan(batch * nodes), layer)
        ids, w = be.moe_route(be.router_logits(x, lw0.gate_weight), lw0.e_score_correction_bias, rc.top_k,
                              rc.n_group, rc.topk_group, rc.norm_topk_prob, rc.routed_scaling_factor)
        routed[nodes] = (x, ids, w, be.to_host(ids), be.empty((batch * nodes, cfg.hidden_size), "fp32"))
        del inputs, cache
        free_blocks(be)
    src = DummySource(cfg, seed, "random", be.xp)
    rows, world = [], model.shard.world
    for r in range(world):
        if r == model.shard.rank:
            lw = lw0
        else:
            with unpooled(be):
                lw = load_moe_layer(src, layer, rc, cfg.hidden_size, cfg.moe_intermediate_size, be,
                                    shard=Shard(r, world, True))
        for nodes, (x, ids, w, host_ids, out) in routed.items():
            t = batch * nodes
            small = model.small_m(t)  # the model's path for T rows (model/moe.py)
            shape = (t, lw.experts.num_experts, rc.top_k, cfg.hidden_size, lw.experts.intermediate)
            if small:
                plan = be.moe_small_plan(*shape)

                def run(lw=lw, plan=plan, x=x, ids=ids, w=w, out=out):
                    be.moe_small_experts(x, ids, w, lw.experts, out=out, plan=plan, check_ids=False,
                                         id_offset=lw.expert_offset)
            else:
                plan = be.moe_plan(*shape)
                local_ids = ids - be.xp.int32(lw.expert_offset)

                def run(lw=lw, plan=plan, x=x, local_ids=local_ids, w=w, out=out):
                    be.moe_experts(x, local_ids, w, lw.experts, out=out, plan=plan, check_ids=False)
            mine = host_ids - lw.expert_offset
            mine = mine[(mine >= 0) & (mine < lw.experts.num_experts)]
            us = time_gpu(run, warmup=2, iters=iters).median_us
            touched = int(len(np.unique(mine)))
            nbytes = touched * lw.experts.expert_nbytes() + int(x.nbytes)
            rows.append(Row(f"{tag} L{layer} T{t} EP rank {r} routed experts", us, bytes=nbytes,
                            extra={"batch": batch, "ctx": ctx, "tokens": t, "nodes": nodes, "layer": layer,
                                   "ep_rank": r, "pairs": int(mine.size), "experts_touched": touched,
                                   "path": "small-m" if small else "general",
                                   "floor_us": nbytes / read_ceiling_gbs() / 1e3}))
            del plan
        del lw
        free_blocks(be)
    return rows


# -- the run ----------------------------------------------------------------------------------------
def free_blocks(be) -> None:
    """Give back what a case or a layout made: reference cycles collected first (a model, its runners,
    graphs and caches refer to each other, so dropping the last name frees nothing until the
    collector runs), then CuPy's cached device blocks and pinned host blocks, then the device's own
    caches (device_caches): the CUDA graph memory pool keeps what graph allocation nodes took after
    their graphs are destroyed, the default stream-ordered pool what cudaMallocAsync freed, until
    trimmed."""
    gc.collect()
    if be.is_cuda:
        be.xp.get_default_memory_pool().free_all_blocks()
        be.xp.get_default_pinned_memory_pool().free_all_blocks()
        rt = be.xp.cuda.runtime
        rt.deviceSynchronize()  # frees still queued on a stream are not yet in the pools
        dev = be.xp.cuda.Device().id
        driver, cu_dev = _cu_device(dev)
        _driver_ok(driver.cuDeviceGraphMemTrim(cu_dev)[0], "cuDeviceGraphMemTrim")
        if rt.deviceGetAttribute(rt.cudaDevAttrMemoryPoolsSupported, dev):
            rt.memPoolTrimTo(rt.deviceGetDefaultMemPool(dev), 0)


def device_caches(be) -> dict:
    """Bytes held now beyond the live arrays, by cache: CuPy's device pool (in use or cached:
    ``cupy_pool_bytes``), the CUDA graph memory pool (``graph_pool_bytes``: graph allocation nodes,
    kept after their graph until trimmed) and the device's default stream-ordered pool
    (``async_pool_bytes``: cudaMallocAsync). All 0 on numpy."""
    held = {"cupy_pool_bytes": pool_bytes(be), "graph_pool_bytes": 0, "async_pool_bytes": 0}
    if not be.is_cuda:
        return held
    rt = be.xp.cuda.runtime
    dev = be.xp.cuda.Device().id
    driver, cu_dev = _cu_device(dev)
    err, graph = driver.cuDeviceGetGraphMemAttribute(
        cu_dev, driver.CUgraphMem_attribute.CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT)
    _driver_ok(err, "cuDeviceGetGraphMemAttribute")
    held["graph_pool_bytes"] = int(graph)
    if rt.deviceGetAttribute(rt.cudaDevAttrMemoryPoolsSupported, dev):
        held["async_pool_bytes"] = int(rt.memPoolGetAttribute(rt.deviceGetDefaultMemPool(dev),
                                                              rt.cudaMemPoolAttrReservedMemCurrent))
    return held


def memory_phase(be, phase: str) -> dict:
    """One row of a layout's memory story (the JSON's memory.phases): what the device caches held
    at the end of ``phase`` (device_caches, before they are given back), then the device's free
    bytes once they are (free_bytes)."""
    held = device_caches(be)
    return {"phase": phase, "free_bytes": free_bytes(be), "held_before_release": held}


def _driver():
    from cuda.bindings import driver

    return driver


def _cu_device(dev: int):
    """(the driver module, CUdevice of CUDA device ``dev``)."""
    driver = _driver()
    err, cu_dev = driver.cuDeviceGet(dev)
    _driver_ok(err, "cuDeviceGet")
    return driver, cu_dev


def _driver_ok(err, what: str) -> None:
    if err != _driver().CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {getattr(err, 'name', err)}")


def free_bytes(be) -> int:
    """Device memory free now, after free_blocks (numpy: the host's available memory)."""
    free_blocks(be)
    if be.is_cuda:
        return int(be.xp.cuda.runtime.memGetInfo()[0])
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def pool_bytes(be) -> int:
    """Bytes CuPy's device pool holds now, in use or cached (0 on numpy)."""
    return int(be.xp.get_default_memory_pool().total_bytes()) if be.is_cuda else 0


@contextlib.contextmanager
def unpooled(be):
    """Allocations inside go straight to cudaMalloc / cudaFree, past CuPy's pool (numpy: nothing to
    do). For making weights: a temporary freed goes back to the driver at once, and a weight never
    takes part of a cached temporary's block (which would pin the rest of it: the pool cannot give
    back a block that is partly in use). The weights then stay outside the pool until dropped."""
    if not be.is_cuda:
        yield
        return
    cuda = be.xp.cuda
    pooled = cuda.get_allocator()
    cuda.set_allocator(None)  # CuPy's raw allocator
    try:
        yield
    finally:
        cuda.set_allocator(pooled)


def probe_layers(n_layers: int) -> int | None:
    """The depth of the scaling probe when ``n_layers`` < 61 were made: half of them (the dense layer
    0 at least); None when there is nothing to scale, or no MoE layer to scale by (one layer made)."""
    if n_layers >= FULL_LAYERS or n_layers < 2:
        return None
    return n_layers // 2


def depth_view(model, n: int):
    """The model's first ``n`` decoder layers, weights shared (nothing copied): the scaling probe."""
    view = copy.copy(model)
    view.cfg, view.layers = model.cfg.with_layers(n), model.layers[:n]
    # the model's own small-M decision (and its cache): the view's would scan only its layers, and
    # with no MoE layer among them (one layer) it could take another path than the model's layer 0
    view.small_m = model.small_m
    return view


def graph_step_us(model, batch: int, ctx: int, iters: int) -> float:
    """One AR step of ``batch`` requests at context ``ctx`` (bench decode's case, decode.decode_case)
    replayed as a CUDA graph (engine.runner): bench decode's graph figure alone, for the scaling probe."""
    from ..engine.runner import ModelRunner
    from .decode import decode_case

    cache, step, _, _ = decode_case(model, batch, ctx)
    runner = ModelRunner(model, cache, ctx + 1, graphs=True)
    runner.decode(step)  # captures
    return time_gpu(runner.graph_of(batch).launch, warmup=2, iters=iters).median_us


def graph_round_us(model, batch: int, budget: int, ctx: int, accept_p: float, chain: bool, iters: int) -> float:
    """One DDTree round (bench round's DeviceRound, its inputs as bench round makes them) replayed as
    one CUDA graph: bench round's graph figure alone, for the scaling probe."""
    from . import round as round_bench
    from .harness import fill_random_bf16

    rd = round_bench.DeviceRound(model, batch, budget, ctx, accept_p, seed=batch * 7 + budget, chain=chain)
    fill_random_bf16(rd.cache.data, scale=1.0, seed=batch * 1000 + rd.nodes - 1)
    graph, _pool = round_bench.capture(rd.run)
    return time_gpu(graph.launch, warmup=2, iters=iters).median_us


def per_layer_slope(us: float, probe_us: float, n_layers: int, probe: int) -> float:
    """µs per MoE layer from one graph at two depths (both hold the dense layer 0, the embedding and
    the head, so the difference is ``n_layers - probe`` MoE layers)."""
    return (us - probe_us) / (n_layers - probe)


def run_layout(layout: str, args, gate, log, be=None, preset: str = "k2.6") -> tuple[list[Row], dict]:
    """One layout's rows and summary: the rank's dummy weights made, every case run, freed again.
    ``be`` / ``preset``: the CUDA backend and K2.6 unless given (tests run the glue on numpy)."""
    import click

    from ..backend import Backend
    from ..model.config import preset_config
    from ..model.shard import Shard
    from ..model.target import TargetModel
    from ..parallel.simulated import SimulatedRank
    from ..speculative.drafters import OracleDrafter
    from . import decode, node_auto
    from . import round as round_bench
    from .drafter import bench_forward, random_drafter
    from .round import DEPTH

    be = be or Backend("cuda")
    full = preset_config(preset)
    shard = Shard(args.rank, args.world, LAYOUTS[layout])
    phases = [memory_phase(be, "start")]
    free = phases[0]["free_bytes"]
    n_layers, memory = plan_memory(full, shard, args, free)
    memory["phases"] = phases
    cfg = full.with_layers(n_layers)
    scaled = n_layers < FULL_LAYERS
    log(f"[{layout}] rank {args.rank} of {args.world}, {n_layers} of {FULL_LAYERS} layers: weights "
        f"{memory['weights_bytes'] / 1e9:.1f} GB (full depth {memory['full_depth_weights_bytes'] / 1e9:.1f} GB), "
        f"GPU free {free / 1e9:.1f} GB" + (f"; fewer layers than {FULL_LAYERS}: step figures are also given scaled "
                                           f"to {FULL_LAYERS} layers" if scaled else ""))
    comm = SimulatedRank(args.rank, args.world, be.xp, args.hold_us)
    log(comm.note())
    t0 = time.perf_counter()
    with click.progressbar(length=n_layers, label=f"making the dummy weights ({layout})", file=None) as bar:
        last = [0]

        def progress(n):
            bar.update(n - last[0])
            last[0] = n

        with unpooled(be):
            model = TargetModel.dummy(cfg, be, seed=args.seed, head="random", progress=progress, shard=shard,
                                      comm=comm)
    be.synchronize()
    make_s = time.perf_counter() - t0
    with unpooled(be):
        drafter = random_drafter(seed=args.seed, target=model) if args.drafter else None
    phases.append(memory_phase(be, "weights made"))
    memory["free_after_weights_bytes"] = phases[-1]["free_bytes"]
    log(f"[{layout}] made {model.weight_nbytes() / 1e9:.1f} GB of weights in {make_s:.0f} s; GPU free "
        f"{memory['free_after_weights_bytes'] / 1e9:.1f} GB with the drafter")
    weight_bytes = decode.layer_weight_bytes(model)
    case_pool = [0]

    def case_done(phase: str):
        """After each timed piece: the pool's high-water mark noted (the plan's run_bytes, measured),
        then the piece's caches and graphs given back (a memory phase)."""
        case_pool[0] = max(case_pool[0], pool_bytes(be))
        phases.append(memory_phase(be, phase))

    oracle = OracleDrafter(be, cfg.vocab_size, DEPTH, lambda rid, prompt: [0] * (DEPTH + 1), accept_p=args.accept_p)
    ns = argparse.Namespace(context=0, accept_p=args.accept_p, iters=args.iters)
    rep_layer = 1 if n_layers > 1 else 0  # the first MoE layer stands for every MoE layer's pieces
    probe = probe_layers(n_layers)  # the step and each round also timed at this depth: the 61-layer scaling
    view = None
    rows, cases = [], []
    for small_m in args.small_m:
        SMALL_M_APPLY[small_m](model)
        view = depth_view(model, probe) if probe is not None else None  # a copy: made after the switch
        for ctx in args.contexts:
            ns.context = ctx
            for b in args.batches:
                tag = f"{layout} sm-{small_m} b{b} ctx{ctx // 1024}k"
                case_rows = []
                ar = decode.bench_case(model, b, ctx, args.iters, gate, weight_bytes)
                case_done(f"{tag} AR step")
                case_rows += [dataclasses.replace(r, case=f"{layout} sm-{small_m} AR {r.case}",
                                                  extra={**r.extra, "layout": layout, "small_m": small_m})
                              for r in ar]
                case = {"layout": layout, "small_m": small_m, "batch": b, "ctx": ctx, "layers": n_layers,
                        "ar": ar_summary(ar, model, b, n_layers), "rounds": []}
                if probe is not None:
                    probe_us = graph_step_us(view, b, ctx, args.iters)
                    case_done(f"{tag} AR step probe")
                    slope = per_layer_slope(case["ar"]["step_us"], probe_us, n_layers, probe)
                    case["ar"].update(probe={"layers": probe, "step_us": probe_us}, per_moe_layer_graph_us=slope,
                                      step_us_61=case["ar"]["step_us"] + (FULL_LAYERS - n_layers) * slope)
                if args.components:
                    comp = component_rows(model, b, ctx, 1, args.iters, rep_layer, f"{tag} AR")
                    case_rows += comp
                    case["ar"]["components"] = {r.extra["component"]: {"us": r.us, "floor_us": r.extra["floor_us"]}
                                                for r in comp}
                    case_done(f"{tag} components")
                shapes = [(bg, False) for bg in args.budgets] + ([(DEPTH, True)] if args.chain else [])
                ep_by_nodes = {}
                if layout == "ep":
                    counts = sorted({1} | {bg + 1 for bg, _ in shapes})
                    ep = ep_rank_rows(model, b, ctx, counts, args.iters, rep_layer, args.seed, tag)
                    case_rows += ep
                    ep_by_nodes = {n: ep_summary([r for r in ep if r.extra["nodes"] == n], args.rank) for n in counts}
                    case["ar"]["ep_ranks"] = ep_by_nodes[1]
                    case_done(f"{tag} EP ranks")
                case["ar"]["collectives"] = count_collectives(model, b, 1, last_only=True)
                if drafter is not None:
                    d = [drafter_shard_row(r, drafter, b, ctx, args.world)
                         for r in bench_forward(drafter, b, ctx, args.iters)]
                    case_rows += [dataclasses.replace(r, case=f"{tag} drafter TP{args.world} shard {r.case}",
                                                      extra={**r.extra, "layout": layout}) for r in d]
                    case["drafter_us"] = d[0].us
                    case["drafter_floor_us"] = d[0].extra["floor_us"]
                    case["drafter_collectives"] = count_drafter_collectives(drafter, b)
                    case_done(f"{tag} drafter")
                for budget, chain in shapes:
                    tau = oracle.expected_tau(budget, chain=chain)
                    rr = round_bench.bench_case(model, b, budget, ns, gate, weight_bytes, ProfileTau(tau), chain=chain)
                    shape = "chain" if chain else f"budget {budget}"
                    case_done(f"{tag} {shape}")
                    case_rows += [dataclasses.replace(r, case=f"{layout} sm-{small_m} {r.case}",
                                                      extra={**r.extra, "layout": layout, "small_m": small_m})
                                  for r in rr]
                    summ = next(r.extra for r in rr if "graph_us" in r.extra)
                    probe_round = None
                    if probe is not None:
                        probe_us = graph_round_us(view, b, budget, ctx, args.accept_p, chain, args.iters)
                        case_done(f"{tag} {shape} probe")
                        probe_round = {"layers": probe, "round_us": probe_us,
                                       "per_moe_layer_graph_us": per_layer_slope(summ["graph_us"], probe_us,
                                                                                 n_layers, probe)}
                    case["rounds"].append({
                        "budget": budget, "chain": chain, "round_us": summ["graph_us"], "queued_us": summ["queued_us"],
                        "eager_us": summ["eager_us"], "stage_us": summ["stage_us"],
                        "queued_within_launch_queue": summ.get("queued_within_launch_queue", True),
                        "verify_floor_us": summ["verify_floor_us"], "ar_step_us": summ["ar_step_us"],
                        "tau_oracle": tau, "experts_touched": summ["experts_touched"],
                        "ep_ranks": ep_by_nodes.get(budget + 1),
                        "collectives": count_collectives(model, b, budget + 1, last_only=False),
                        "probe": probe_round})
                    log(f"  {tag} {'chain' if chain else f'budget {budget}'}: round {summ['graph_us']:.0f} µs, "
                        f"tau {tau:.2f}" + ("" if summ.get("queued_within_launch_queue", True) else
                                            "; its queued stage times overflowed the launch queue (host-bound)"))
                cases.append(project_case(case, args, n_layers))
                if args.auto_rounds and case["rounds"]:
                    case["auto"] = node_auto.auto_row(case, args, cfg.vocab_size, model.batch_invariant
                                                      and model.small_m_path, DEPTH, args.auto_rounds)
                    log(f"  {tag}: {node_auto.summary_line(case['auto'])} ({case['auto']['sim_s']:.1f} s of CPU)")
                rows += case_rows
                log(f"  {tag}: AR step {case['ar']['step_us']:.0f} µs ({case['ar']['collectives']['calls']} "
                    f"collectives); {time.perf_counter() - t0:.0f} s into this layout")
    memory["case_pool_peak_bytes"] = case_pool[0]
    numerics = comm.note()
    del drafter, model, view, oracle, weight_bytes, comm
    phases.append(memory_phase(be, "released"))
    memory["free_after_release_bytes"] = phases[-1]["free_bytes"]
    kept = free - memory["free_after_release_bytes"]
    held = ", ".join(f"{k.removesuffix('_bytes').replace('_', ' ')} {v / 1e6:.0f} MB"
                     for k, v in phases[-1]["held_before_release"].items())
    log(f"[{layout}] released: GPU free {memory['free_after_release_bytes'] / 1e9:.1f} GB (was {free / 1e9:.1f}); "
        f"the largest case held {case_pool[0] / 1e9:.1f} GB in CuPy's pool (planned "
        f"{memory['run_bytes'] / 1e9:.1f} GB + KV {memory['kv_bytes_largest_case'] / 1e9:.1f})"
        + (f"; {kept / 1e9:.1f} GB NOT given back (held before the release: {held})"
           if be.is_cuda and kept > RELEASE_SLACK_BYTES else ""))
    return rows, {"layout": layout, "expert_parallel": LAYOUTS[layout], "rank": args.rank, "world": args.world,
                  "preset": preset, "layers": n_layers, "scaled_to_full_depth": scaled, "memory": memory,
                  "cases": cases, "numerics": numerics, "collective_stand_in_hold_us": args.hold_us,
                  "make_weights_s": make_s,
                  "layout_s": time.perf_counter() - t0}


def ar_summary(rows: list[Row], model, batch: int, n_layers: int) -> dict:
    """The AR step's figures from decode.bench_case's rows. ``step_us_61`` here is + the queued mean
    MoE layer per missing layer, which run_layout replaces by the probe's slope (kept only where no
    probe ran: all 61 layers made, so nothing is added, or one layer, so no MoE layer to scale by)."""
    step = next(r for r in rows if "graph_us" in r.extra)
    e = step.extra
    per_layer = {}
    for r in rows:
        x = r.extra
        if x.get("layer", -1) >= 0 and "stage" in x:
            per_layer.setdefault(x["layer"], {})[x["stage"]] = {"us": r.us, "floor_us": x["floor_us"],
                                                              "experts_touched": x.get("experts_touched")}
    moe_layers = [v for k, v in per_layer.items() if "moe" in v]
    moe_us = statistics.mean(v["attention"]["us"] + v["moe"]["us"] for v in moe_layers) if moe_layers else 0.0
    moe_floor = statistics.mean(v["attention"]["floor_us"] + v["moe"]["floor_us"] for v in moe_layers) \
        if moe_layers else 0.0
    floor = sum(r.extra["floor_us"] for r in rows if "stage" in r.extra and "floor_us" in r.extra)
    head = next((r.us for r in rows if r.extra.get("stage") == "head"), None)
    return {"step_us": e["graph_us"], "queued_us": e["queued_us"], "eager_us": e["eager_us"],
            "mean_stage_us": e["mean_stage_us"], "mean_stage_floor_us": e["mean_stage_floor_us"],
            "head_us": head, "mean_moe_layer_us": moe_us, "floor_us": floor,
            "floor_us_61": floor + (FULL_LAYERS - n_layers) * moe_floor,
            "step_us_61": e["graph_us"] + (FULL_LAYERS - n_layers) * moe_us,
            "experts_touched_per_layer": {k: v["moe"]["experts_touched"] for k, v in per_layer.items() if "moe" in v},
            "per_layer": per_layer}


def ep_summary(rows: list[Row], rank: int) -> dict:
    us = [r.us for r in rows]
    return {"us_per_rank": us, "pairs_per_rank": [r.extra["pairs"] for r in rows],
            "experts_per_rank": [r.extra["experts_touched"] for r in rows], "slowest_us": max(us),
            "this_rank_us": us[rank], "slowest_minus_this_us": max(us) - us[rank]}


def project_case(case: dict, args, n_layers: int) -> dict:
    """Per-token times and the 8-GPU tok/s per user of one (layout, batch, ctx) case: the measured
    per-rank time, scaled to 61 layers when fewer were made (+ the graph's time per MoE layer, from
    the same graph timed at the probe's depth, per missing layer; with one layer made, no probe: the
    queued per-layer figures), under EP
    plus the slowest rank's extra routed-expert time per MoE layer (measured on one layer), plus
    collective latency x calls (2 all-reduces per missing layer added; a round's calls include the
    drafter forward's), for each --collective-us. A round's time includes the drafter's forward."""
    missing = FULL_LAYERS - n_layers
    moe_layers = FULL_LAYERS - 1
    ar = case["ar"]
    ar_rank = ar["step_us_61"] + moe_layers * ar.get("ep_ranks", {}).get("slowest_minus_this_us", 0.0)
    ar_calls = ar["collectives"]["calls"] + 2 * missing
    ar["rank_us"], ar["collective_calls_61"] = ar_rank, ar_calls
    drafter = case.get("drafter_us", 0.0)
    drafter_calls = case.get("drafter_collectives", {}).get("calls", 0)
    for rd in case["rounds"]:
        ep = (rd.get("ep_ranks") or {}).get("slowest_minus_this_us", 0.0)
        probe = rd.get("probe")
        per_layer = probe["per_moe_layer_graph_us"] if probe else rd["stage_us"]["verify"] / n_layers
        rd["round_us_61"] = rd["round_us"] + missing * per_layer
        rd["rank_us"] = rd["round_us_61"] + moe_layers * ep
        rd["collective_calls_61"] = rd["collectives"]["calls"] + 2 * missing  # the drafter's not included
    proj = []
    for lat in args.collective_us:
        ar_us = ar_rank + lat * ar_calls
        entry = {"collective_us": lat, "ar": {"rank_us": ar_rank, "collective_calls": ar_calls,
                                              "collective_total_us": lat * ar_calls, "per_token_us": ar_us,
                                              "tok_s_per_user": 1e6 / ar_us}, "rounds": []}
        for rd in case["rounds"]:
            calls = rd["collective_calls_61"] + drafter_calls
            total = rd["rank_us"] + drafter + lat * calls
            r = {"budget": rd["budget"], "chain": rd["chain"], "rank_us": rd["rank_us"], "drafter_us": drafter,
                 "collective_calls": calls, "collective_total_us": lat * calls, "round_total_us": total,
                 "tau_oracle": rd["tau_oracle"], "per_token_us_oracle": total / rd["tau_oracle"],
                 "tok_s_per_user_oracle": 1e6 * rd["tau_oracle"] / total}
            if rd["chain"]:
                r["published"] = {k: {"tau": t, "per_token_us": total / t, "tok_s_per_user": 1e6 * t / total}
                                  for k, t in PUBLISHED_TAU.items()}
            entry["rounds"].append(r)
        proj.append(entry)
    case["projection"] = proj
    return case


def drafter_shard_row(row: Row, drafter, batch: int, ctx: int, world: int) -> Row:
    """bench/drafter's forward row with the floor of this rank's shard (its q / kv heads,
    intermediate and lm_head rows; the gathered logits written whole)."""
    from .drafter import forward_bytes

    c = drafter.cfg
    part = dataclasses.replace(c, num_attention_heads=drafter.q_heads, num_key_value_heads=drafter.kv_heads,
                               intermediate_size=c.intermediate_size // world, vocab_size=c.vocab_size // world)
    logits_gathered = 2 * batch * (c.block_size - 1) * (c.vocab_size - c.vocab_size // world)
    nbytes = forward_bytes(part, batch, ctx) + logits_gathered
    floor = nbytes / read_ceiling_gbs() / 1e3
    return dataclasses.replace(row, bytes=nbytes, extra={**row.extra, "floor_us": floor, "over_floor": row.us / floor,
                                                          "shard": f"TP{world}"})


def print_summary(layouts: list[dict], log) -> None:
    log("\nper rank, CUDA graph | AR step µs (61-layer) | best DDTree round: budget, µs, tau, per-token µs | "
        "projected tok/s per user on 8 GPUs (AR / best DDTree) at each collective latency")
    for lay in layouts:
        for c in lay["cases"]:
            ar = c["ar"]
            cells = []
            for p in c["projection"]:
                best = max(p["rounds"], key=lambda r: r["tok_s_per_user_oracle"], default=None)
                cells.append(f"{p['collective_us']:g} µs x {p['ar']['collective_calls']}: "
                             f"{p['ar']['tok_s_per_user']:.0f} / "
                             + ("-" if best is None else f"{best['tok_s_per_user_oracle']:.0f} "
                                f"({'chain' if best['chain'] else 'b' + str(best['budget'])})"))
            rounds = [r for r in c["rounds"] if not r["chain"]]
            best_r = min(rounds, key=lambda r: r["round_us"] / r["tau_oracle"], default=None)
            rtxt = "-" if best_r is None else (
                f"{best_r['budget']}, {best_r['round_us']:.0f}, {best_r['tau_oracle']:.2f}, "
                f"{best_r['round_us'] / best_r['tau_oracle']:.0f}")
            log(f"{lay['layout']} sm-{c['small_m']} b{c['batch']} ctx{c['ctx']} | {ar['step_us']:.0f} "
                f"({ar['step_us_61']:.0f}) | {rtxt} | " + "; ".join(cells))
            if c.get("auto"):
                from .node_auto import summary_line

                log(f"    {summary_line(c['auto'])}")
            chain = next((p for p in c["projection"][0]["rounds"] if p["chain"]), None) if c["projection"] else None
            if chain is not None:
                pub = ", ".join(f"{k} {v['tok_s_per_user']:.0f}" for k, v in chain["published"].items())
                log(f"    chain + drafter at z-lab's published acceptance ({c['projection'][0]['collective_us']:g} µs "
                    f"collectives): tok/s per user {pub}")


def summary_doc(layouts: list[dict], args) -> dict:
    """The JSON's ``summary`` (what ``projection`` reads):
      layouts: one per --layouts entry:
        layout, expert_parallel, rank, world, preset (k2.6; tests run smaller ones), layers (made),
        scaled_to_full_depth, numerics (the simulated-rank note), collective_stand_in_hold_us,
        memory {free_bytes, weights_bytes, kv_bytes_largest_case, load_transient_bytes, run_bytes,
                drafter_bytes, ep_other_rank_bytes, margin_bytes, needed_bytes, full_depth_weights_bytes
                (plan_memory's plan), free_after_weights_bytes (the weights and drafter made),
                case_pool_peak_bytes (the most CuPy's pool held after one timed piece: run_bytes + KV,
                measured), free_after_release_bytes (the layout given back),
                phases [{phase (start, weights made, "<case> <piece>" after each timed piece, released),
                         free_bytes (once given back), held_before_release {cupy_pool_bytes,
                         graph_pool_bytes, async_pool_bytes} (device_caches)}]},
        cases: one per (small_m, ctx, batch):
          layout, small_m, batch, ctx, layers,
          ar: step_us (CUDA graph, this rank, ``layers`` layers), step_us_61 (+ per_moe_layer_graph_us per
              missing layer), probe {layers, step_us} (the graph at the probe's depth; absent at 61
              layers), per_moe_layer_graph_us, rank_us (step_us_61 +
              under EP the slowest rank's extra routed-expert time per MoE layer: the node's per-rank
              AR step, collective latency excluded), collective_calls_61, floor_us (the made
              layers' stage floors, embed and head included), floor_us_61, queued_us, eager_us,
              mean_stage_us / mean_stage_floor_us {attention, dense, moe, head, embed}, head_us,
              mean_moe_layer_us, per_layer {layer: {stage: {us, floor_us, experts_touched}}},
              experts_touched_per_layer {layer: distinct experts of all ranks},
              components {router | routed experts | shared expert | all-reduce stand-in: {us, floor_us}},
              ep_ranks (ep) {us_per_rank, pairs_per_rank, experts_per_rank, slowest_us, this_rank_us,
                             slowest_minus_this_us},
              collectives {calls, bytes, by_kind {calls, bytes}},
          drafter_us, drafter_floor_us, drafter_collectives {calls, bytes, by_kind},
          rounds: [{budget, chain, round_us (CUDA graph, drafter excluded), round_us_61, rank_us (as the
                    AR's), collective_calls_61 (drafter's excluded), queued_us, eager_us,
                    stage_us {top-k, build, verify, choose, accept, commit} (queued; host-bound where
                    queued_within_launch_queue is false), queued_within_launch_queue, verify_floor_us,
                    ar_step_us,
                    tau_oracle, experts_touched, ep_ranks (ep, at 1 + budget tokens per request),
                    collectives, probe {layers, round_us, per_moe_layer_graph_us} or None}],
          projection: one per collective_us:
            {collective_us, ar {rank_us, collective_calls, collective_total_us, per_token_us,
             tok_s_per_user}, rounds [{budget, chain, rank_us, drafter_us, collective_calls,
             collective_total_us, round_total_us, tau_oracle, per_token_us_oracle,
             tok_s_per_user_oracle, published (chain only) {benchmark: {tau, per_token_us,
             tok_s_per_user}}}]}
          auto (absent with --auto-rounds 0 or no round): decode.budget auto SIMULATED on this case's
            costs (bench/node_auto.py; not an engine run): rounds, requests, accept_p, max_budget,
            max_rows, bucketed, choice, note, sim_s,
            projection: one per collective_us: {collective_us, cost_model (CostModel.to_json),
              auto {tau (per request-round), tau_sampled, tokens_per_round (the batch's), us_per_round,
                    tok_s_per_user, tok_s_per_user_sampled, nodes_hist (per request-round), rows_hist
                    (per round), drafted_rounds, skipped_drafts, tau_predicted, tau_measured},
              settings [{setting, budget, chain, tau, tau_sampled, tau_oracle, us_per_round,
                         round_total_us, tok_s_per_user, tok_s_per_user_sampled, tok_s_per_user_oracle}],
              best, worst, auto_over_best, auto_over_worst, auto_over_chain, auto_over_best_sampled,
              auto_uncapped (max_rows set only) {tau, us_per_round, tok_s_per_user, auto_over_best, nodes_hist}}
      published_acceptance, published_source, collective_us, collective_source, accept_p, full_layers."""
    return {"layouts": layouts, "published_acceptance": PUBLISHED_TAU, "published_source": PUBLISHED_SOURCE,
            "collective_us": list(args.collective_us), "collective_source": COLLECTIVE_SOURCE,
            "accept_p": args.accept_p, "full_layers": FULL_LAYERS}


def document(rows: list[Row], layouts: list[dict], args, be=None) -> dict:
    """The JSON written by ``--json``: bench/harness.report's rows with device, date and commit, the
    notes and the ``summary``. ``be``: the backend the layouts ran on (None: this process's GPU; on
    numpy the device is named by ``host_device``)."""
    preset = layouts[0]["preset"] if layouts else "k2.6"
    notes = {"model": f"{'Kimi K2.6' if preset == 'k2.6' else 'preset ' + preset} dims, one simulated rank of "
                      f"{args.world} (dummy weights, collectives as device copies of the message)",
             "tau": f"the oracle profile's expected tau at p={args.accept_p} (OracleDrafter.expected_tau); "
                    f"published: {PUBLISHED_SOURCE}",
             "collectives": COLLECTIVE_SOURCE,
             "floor": "bench decode / round floors (weights read, routed experts: touched ones, KV rows, logits) "
                      "over the read ceiling",
             "ep_floor": "the AR / round floors count the experts touched over all 384; an EP rank reads only its "
                         "own touched ones (the per-rank rows give those)",
             "timing": "median, L2 flushed before each run; steps and rounds replayed as one CUDA graph"}
    doc = report("K2.6 node: one simulated rank on one GPU", rows, None, notes=notes,
                 device=None if be is None or be.is_cuda else host_device())
    doc["summary"] = summary_doc(layouts, args)
    return doc


def write_json(doc: dict, path) -> None:
    """``doc`` to ``path``, atomically (a temporary file beside it, then renamed)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=_json_default))
    tmp.replace(out)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import click
    import cupy

    from .decode import Gate
    from .harness import copy_ceiling_gbs

    def log(msg):
        click.echo(msg)

    read_ceiling_gbs()
    copy_ceiling_gbs()  # both before the weights: their buffers go back to the pool
    cupy.get_default_memory_pool().free_all_blocks()
    gate = Gate()
    rows, layouts = [], []
    for layout in args.layouts:
        r, lay = run_layout(layout, args, gate, log)
        rows += r
        layouts.append(lay)
    doc = document(rows, layouts, args)
    print_summary(layouts, log)
    if args.json:
        write_json(doc, args.json)
        log(f"wrote {args.json}")
    return doc


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


if __name__ == "__main__":
    main()
