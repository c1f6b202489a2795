"""Autoregressive decode on a K2.6-dims slice (dense layer 0 + MoE layers with 384 INT4 experts,
64-head MLA, vocab 163840), random weights made on the GPU: one decode step for batch {1, 8, 32} at
context {1k, 8k}.

Per step it reports
  * each stage's GPU time (embedding, every layer's attention block and MLP block — dense for
    layer 0, MoE + shared expert after — and the lm_head) against its byte floor: the weights the
    stage reads (only the routed experts the step's tokens touch) plus the KV rows attention
    reads, over the read ceiling measured in the same run;
  * the step's time three ways: eager launches; the same step queued behind a gate kernel so that
    no kernel waits for the host (every launch enqueued before the first runs: the kernels back to
    back, our measure of "the sum of its kernels"; it still holds the GPU's own ~1 µs switch
    between kernels); and one CUDA-graph replay (engine.runner). ``launch gap`` = 1 - queued /
    step time.
Stage times come from events recorded between the stages in the queued run (enqueued QUEUED_WINDOW
stages per gate, so that a deep model never fills the launch queue). The L2 is flushed before
every timed run.

Started as several ranks (torchrun / srun / mpirun, one GPU each) it also times the NCCL all-reduce
at the message sizes a tensor-parallel step sends (14 KB-1 MB, fp32 as the model reduces) in the
same run; every rank benchmarks its own slice, rank 0 prints and writes the JSON."""

from __future__ import annotations

import argparse
import statistics

import numpy as np
from ml_dtypes import bfloat16

from .harness import (
    Row,
    bf16_to_f32,
    f32_to_bf16_bits,
    fill_random_bf16,
    flush_l2,
    random_bf16_device,
    read_ceiling_gbs,
    report,
    time_gpu,
)

PAGE = 64
BATCHES = (1, 8, 32)
CONTEXTS = (1024, 8192)
STAGE_KINDS = ("attention", "dense", "moe", "head", "embed")


SHARDS = ("none", "tp8", "ep8")


def random_slice(moe_layers: int, seed: int = 0, head: str = "random", shard: str = "none"):
    """TargetModel with K2.6 dims: layer 0 dense, then ``moe_layers`` MoE layers; weights random
    with 1/sqrt(fan-in) scales (activations stay O(1)), norms 1, correction bias small. ``head``
    "decisive": the embedding at 8x scale, so the residual stream stays near its token's embedding
    past every branch, and the lm_head its permuted rows (model.random_weights.decisive_rows): every greedy
    choice far from a tie, as an oracle drafter needs to hold tau on the GPU. ``shard``: one rank's
    share, collectives left out: "tp8" (8 heads, expert / shared / dense intermediate / 8, vocab / 8
    of the lm_head) or "ep8" (the same, but 48 whole experts of the router's 384: rank 0's)."""
    import dataclasses

    import cupy

    from ..backend import Backend
    from ..model.config import preset_config
    from ..model.mla import MLAWeights
    from ..model.moe import MoELayerWeights
    from ..model.target import DenseMLP, Layer, TargetModel
    from .moe import int4_experts_device

    if shard not in SHARDS:
        raise ValueError(f"shard {shard!r}: expected one of {SHARDS}")
    cfg = preset_config("k2.6").with_layers(1 + moe_layers)
    ranks = 1 if shard == "none" else 8
    local_experts = cfg.n_routed_experts // ranks if shard == "ep8" else cfg.n_routed_experts
    expert_inter = cfg.moe_intermediate_size // (ranks if shard == "tp8" else 1)
    shared_inter = cfg.n_shared_experts * cfg.moe_intermediate_size // ranks
    cfg = dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // ranks,
                              intermediate_size=cfg.intermediate_size // ranks)
    be = Backend("cuda")
    hid, heads = cfg.hidden_size, cfg.num_attention_heads
    qk, vh, lat, rope = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank, \
        cfg.qk_rope_head_dim
    counter = iter(range(seed * 1000, seed * 1000 + 1000))

    def w(n, k):
        return random_bf16_device((n, k), scale=k ** -0.5, seed=next(counter))

    def ones(n):
        return be.asarray(np.ones(n, dtype=bfloat16))

    layers = []
    for i in range(cfg.num_hidden_layers):
        attn = MLAWeights(q_b=w(heads * qk, cfg.q_lora_rank), kv_a=w(lat + rope, hid), kv_a_norm=ones(lat),
                          kv_b=w(heads * (cfg.qk_nope_head_dim + vh), lat), o=w(hid, heads * vh),
                          q_a=w(cfg.q_lora_rank, hid), q_a_norm=ones(cfg.q_lora_rank))
        if cfg.is_moe_layer(i):
            e = cfg.n_routed_experts
            bias = (cupy.random.default_rng(next(counter)).standard_normal(e, dtype=cupy.float32) * 0.01)
            mlp = MoELayerWeights(w(e, hid), bias.astype(cupy.float32),
                                  int4_experts_device(local_experts, hid, expert_inter, next(counter)),
                                  w(2 * shared_inter, hid), w(hid, shared_inter))
        else:
            mlp = DenseMLP(w(2 * cfg.intermediate_size, hid), w(hid, cfg.intermediate_size))
        layers.append(Layer(ones(hid), ones(hid), attn, mlp))
    if head not in ("random", "decisive"):
        raise ValueError(f"head {head!r}: expected random or decisive")
    embed_scale = 8.0 if head == "decisive" else 1.0
    embed = random_bf16_device((cfg.vocab_size, hid), scale=embed_scale, seed=next(counter))
    if head == "decisive":
        perm = cupy.asarray(np.random.default_rng(next(counter)).permutation(cfg.vocab_size))
        lm_head = f32_to_bf16_bits(bf16_to_f32(embed[perm]) * np.float32(hid ** -0.5 / embed_scale))
    else:
        lm_head = w(cfg.vocab_size // ranks, hid)
    return TargetModel(cfg, be, embed, layers, ones(hid), lm_head)


def _nbytes(*arrays) -> int:
    return sum(int(a.nbytes) for a in arrays if a is not None)


def layer_weight_bytes(model) -> list[dict]:
    """Per layer: bytes of the attention weights, and of the MLP's dense part (dense MLP, or the MoE
    router + shared expert; the routed experts are counted per step from the routing)."""
    from ..model.target import DenseMLP

    out = []
    for layer in model.layers:
        a = layer.attn
        attn = _nbytes(a.q_a, a.q_a_norm, a.q_b, a.kv_a, a.kv_a_norm, a.kv_b, a.o, layer.input_norm)
        m = layer.mlp
        if isinstance(m, DenseMLP):
            mlp = _nbytes(m.w13, m.w2, layer.post_norm)
        else:
            mlp = _nbytes(m.gate_weight, m.e_score_correction_bias, m.shared_w13, m.shared_w2, layer.post_norm)
        out.append({"attention": attn, "mlp": mlp})
    return out


class Gate:
    """A pinned host flag and the kernel that waits on it (see cuda_src/bench_ceiling.cu)."""

    def __init__(self):
        import cupy

        from ..kernels.registry import module

        self.mem = cupy.cuda.alloc_pinned_memory(4)
        self.flag = np.frombuffer(self.mem, dtype=np.int32, count=1)
        self.fn = module("bench_ceiling").fn("gate_wait_kernel")

    def close(self) -> None:
        self.flag[0] = 0
        self.fn((1,), (32,), (np.uint64(self.mem.ptr), np.int64(4_000_000_000)))

    def open(self) -> None:
        self.flag[0] = 1


# Stages enqueued behind one gate. A stream holds about a thousand pending launches; past that the
# host blocks in a launch while the gate holds the GPU, the gate times out (~2 s) and the later
# stages run at the host's launch rate (40 layers at b1: every stage after layer 33 read ~5x its
# time). A window of stages stays well inside (a small-M or general layer is ~10-30 launches).
QUEUED_WINDOW = 16


class QueueOverflow(RuntimeError):
    """The gate opened before the host had enqueued its window: the stage times are the host's."""


def queued_stage_times(model, inputs, cache, moe_plan, gate: Gate, reps: int, window: int = QUEUED_WINDOW):
    """Median GPU time of the whole step and of each stage, enqueued behind the gate ``window``
    stages at a time: each window is enqueued whole before its gate opens, then the next is held
    by a new gate (the hidden state stays on the stream). A stage's time runs from the previous
    stage's end event, or from the event after its window's gate. A window whose gate was found
    already open (timed out: the launch queue was full) is rerun with half the window."""
    import cupy

    stream = cupy.cuda.get_current_stream()
    totals, per_stage, labels = [], [], []
    while len(totals) < reps:
        flush_l2()
        gate.close()
        start = cupy.cuda.Event()
        start.record(stream)
        held, prev, spans = [start], [start], []

        def mark(stage, layer, x, held=held, prev=prev, spans=spans, window=window):
            ev = cupy.cuda.Event()
            ev.record(stream)
            spans.append((stage, layer, prev[0], ev))
            prev[0] = ev
            if len(spans) % window == 0:
                release(held[0], ev)
                gate.close()
                nxt = cupy.cuda.Event()
                nxt.record(stream)
                held[0] = prev[0] = nxt

        def release(gate_event, last):
            overflowed = gate_event.done  # the gate already passed: it did not hold the whole window
            gate.open()
            last.synchronize()
            if overflowed:
                raise QueueOverflow

        try:
            model.run(inputs, cache, output="logits", moe_plan=moe_plan, mark=mark)
            release(held[0], prev[0])
        except QueueOverflow:
            gate.open()
            stream.synchronize()
            if window == 1:
                raise RuntimeError("queued stage times: one stage overflows the launch queue behind the gate") \
                    from None
            window //= 2
            continue
        times = [cupy.cuda.get_elapsed_time(a, b) * 1e3 for _, _, a, b in spans]
        totals.append(sum(times))
        per_stage.append(times)
        labels = [(st, layer) for st, layer, _, _ in spans]
    med = [statistics.median(col) for col in zip(*per_stage)]
    return statistics.median(totals), list(zip(labels, med))


def touched_experts(model, inputs, cache, moe_plan) -> dict[int, int]:
    """Distinct routed experts each MoE layer's tokens pick in this step (a separate, untimed run)."""
    from ..model.moe import MoELayerWeights

    be, rc, seen = model.backend, model.routing, {}

    def mark(stage, layer, x):
        mlp = model.layers[layer].mlp if layer >= 0 else None
        if stage == "mlp" and isinstance(mlp, MoELayerWeights):
            ids, _ = be.moe_route(be.router_logits(x, mlp.gate_weight), mlp.e_score_correction_bias, rc.top_k,
                                  rc.n_group, rc.topk_group, rc.norm_topk_prob, rc.routed_scaling_factor)
            mine = be.to_host(ids) - mlp.expert_offset  # an expert shard's own experts only
            seen[layer] = len(np.unique(mine[(mine >= 0) & (mine < mlp.experts.num_experts)]))

    model.run(inputs, cache, output="none", moe_plan=moe_plan, mark=mark)
    return seen


def decode_case(model, batch: int, ctx: int):
    """One decode step's setting: ``batch`` sequences at context ``ctx`` in a cache of random rows
    (scale 1), one random token each. Returns (cache, the ForwardBatch, its prepared inputs, MoE plan)."""
    from ..engine.kv_cache import PagedKVCache
    from ..model.target import ForwardBatch

    per_seq = -(-(ctx + 1) // PAGE)
    cache = PagedKVCache(model.backend, model.num_layers, batch * per_seq, PAGE, model.dims.row)
    fill_random_bf16(cache.data, scale=1.0, seed=batch + ctx)
    for s in range(batch):
        cache.allocator.reserve(s, ctx + 1)
    rng = np.random.default_rng(batch * 7 + ctx)
    tokens = [[int(t)] for t in rng.integers(0, model.cfg.vocab_size, batch)]
    step = ForwardBatch.causal(list(range(batch)), [ctx] * batch, tokens)
    return cache, step, model.prepare(step, cache), model.moe_plan(batch)


def bench_case(model, batch: int, ctx: int, iters: int, gate: Gate, weight_bytes) -> list[Row]:
    from ..engine.runner import ModelRunner
    row_bytes = model.dims.row * 2
    cache, step, inputs, moe_plan = decode_case(model, batch, ctx)
    touched = touched_experts(model, inputs, cache, moe_plan)

    def eager():
        model.run(inputs, cache, output="logits", moe_plan=moe_plan)

    t_eager = time_gpu(eager, warmup=2, iters=iters).median_us
    t_queued, stages = queued_stage_times(model, inputs, cache, moe_plan, gate, iters)
    graphs = ModelRunner(model, cache, ctx + 1, graphs=True)
    graphs.decode(step)  # capture
    launch = graphs.graph_of(batch).launch
    t_graph = time_gpu(launch, warmup=2, iters=iters).median_us

    expert_bytes = model.layers[-1].mlp.experts.expert_nbytes() if touched else 0
    kv_bytes = batch * (ctx + 1) * row_bytes
    head_bytes = int(model.lm_head.nbytes + model.final_norm.nbytes)
    path = "small-m" if model.small_m(batch) else "general"
    case = f"{path} b{batch} ctx{ctx // 1024}k"
    rows, sums = [], {}
    for (stage, layer), us in stages:
        if stage == "attention":
            kind, nbytes = "attention", weight_bytes[layer]["attention"] + kv_bytes
        elif stage == "mlp":
            moe = layer in touched
            kind = "moe" if moe else "dense"
            nbytes = weight_bytes[layer]["mlp"] + (touched[layer] * expert_bytes if moe else 0)
        elif stage == "head":
            kind, nbytes = "head", head_bytes
        else:
            kind, nbytes = "embed", batch * model.cfg.hidden_size * 2
        sums.setdefault(kind, []).append((us, nbytes))
        extra = {"batch": batch, "ctx": ctx, "path": path, "stage": kind, "layer": layer,
                 "floor_us": nbytes / read_ceiling_gbs() / 1e3}
        if stage == "mlp" and layer in touched:
            extra["experts_touched"] = touched[layer]
        rows.append(Row(f"{case} L{layer} {kind}" if layer >= 0 else f"{case} {kind}", us, bytes=int(nbytes),
                        extra=extra))
    layer_floor = {k: sum(b for _, b in v) / len(v) / read_ceiling_gbs() / 1e3 for k, v in sums.items()}
    layer_us = {k: sum(u for u, _ in v) / len(v) for k, v in sums.items()}
    step_bytes = sum(r.bytes for r in rows)
    common = {"batch": batch, "ctx": ctx, "path": path, "eager_us": t_eager, "queued_us": t_queued, "graph_us": t_graph,
              "launch_gap_eager": 1 - t_queued / t_eager, "launch_gap_graph": 1 - t_queued / t_graph,
              "graph_over_queued": t_graph / t_queued, "eager_over_queued": t_eager / t_queued,
              "mean_stage_us": layer_us, "mean_stage_floor_us": layer_floor,
              "mean_stage_over_floor": {k: layer_us[k] / layer_floor[k] for k in layer_us}}
    rows.append(Row(f"{case} step (CUDA graph)", t_graph, bytes=step_bytes, extra=common))
    rows.append(Row(f"{case} step (eager)", t_eager, bytes=step_bytes, extra={"batch": batch, "ctx": ctx,
                                                                              "path": path}))
    rows.append(Row(f"{case} step (queued: sum of kernels)", t_queued, bytes=step_bytes,
                    extra={"batch": batch, "ctx": ctx, "path": path}))
    return rows


# one token's hidden row in bf16 at K2.6 (7168 x 2 B) up to 1 MB: fp32 partials of 1-36 tokens
ALLREDUCE_BYTES = (14336, 28672, 57344, 131072, 262144, 524288, 1048576)


def allreduce_rows(comm, iters: int) -> list[Row]:
    """Median latency of one fp32 all-reduce per message size on ``comm`` (no L2 flush: NCCL's
    small messages are latency-bound); ``bus_gbs`` is NCCL's bus bandwidth, 2 (n - 1) / n x bytes / t."""
    import cupy

    n, rows = comm.world_size, []
    for nbytes in ALLREDUCE_BYTES:
        x = cupy.zeros(nbytes // 4, cupy.float32)
        t = time_gpu(lambda x=x: comm.all_reduce(x), warmup=3, iters=iters, flush_l2=False).median_us
        rows.append(Row(f"all-reduce {nbytes / 1024:g} KB fp32, {n} ranks", t,
                        extra={"message_bytes": nbytes, "ranks": n, "bus_gbs": 2 * (n - 1) / n * nbytes / t / 1e3}))
    return rows


def print_summary(rows: list[Row]) -> None:
    print("\npath | batch | ctx | attention µs (x floor) | dense µs (x floor) | MoE µs (x floor) | head µs | "
          "step eager / queued / graph µs | gap eager / graph")
    for r in rows:
        e = r.extra
        if "graph_us" not in e:
            continue
        us, fl = e["mean_stage_us"], e["mean_stage_over_floor"]

        def cell(k, us=us, fl=fl):
            return f"{us[k]:.1f} ({fl[k]:.2f}x)" if k in us else "-"

        print(f"{e.get('path', '-')} | {e['batch']} | {e['ctx']} | {cell('attention')} | {cell('dense')} | "
              f"{cell('moe')} | "
              f"{us.get('head', 0):.1f} | {e['eager_us']:.0f} / {e['queued_us']:.0f} / {e['graph_us']:.0f} | "
              f"{100 * e['launch_gap_eager']:.0f}% / {100 * e['launch_gap_graph']:.0f}%")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="ddtree-rtc bench decode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--moe-layers", type=int, default=2, help="MoE layers after the dense layer 0 (9.5 GB each)")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON here")
    ap.add_argument("--shard", choices=SHARDS, default="none",
                    help="one rank's share of K2.6 (tp8: 8 heads, intermediates and vocab / 8; ep8: 48 whole "
                         "experts), collectives left out")
    ap.add_argument("--small-m", choices=("on", "off", "both"), default="on",
                    help="the small-M path (runtime.small_m_path) for batches <= 64: on, off, or both (rows of "
                         "each: the general kernels, then the small-M ones)")
    args = ap.parse_args(argv)

    if args.moe_layers < 0:
        ap.error("--moe-layers must be >= 0")
    from ..parallel.launch import make_communicator, rank_env

    env = rank_env()
    comm = make_communicator(env, cuda=True) if env.world_size > 1 else None  # selects LOCAL_RANK's GPU
    if not env.is_main:
        import contextlib
        import io

        with contextlib.redirect_stdout(io.StringIO()):
            return _run(args, comm, None)
    return _run(args, comm, args.json)


def _run(args, comm, json_path) -> dict:
    import cupy

    model = random_slice(args.moe_layers, shard=args.shard)
    weight_bytes = layer_weight_bytes(model)
    gate = Gate()
    rows = []
    paths = {"on": (True,), "off": (False,), "both": (False, True)}[args.small_m]
    for b in (int(v) for v in args.batches.split(",")):
        for c in (int(v) for v in args.contexts.split(",")):
            for small in paths:
                model.small_m_path = small
                rows += bench_case(model, b, c, args.iters, gate, weight_bytes)
                cupy.get_default_memory_pool().free_all_blocks()  # the case's cache and graphs
                print(f"  {rows[-3].extra['path']} b{b} ctx{c}: graph {rows[-3].us:.0f} µs", flush=True)
    if comm is not None:
        rows += allreduce_rows(comm, args.iters)
        comm.close()
    notes = {"model": f"K2.6 dims, layer 0 dense + {args.moe_layers} MoE layers, random weights"
                      + ("" if args.shard == "none" else f", one rank's {args.shard} share (collectives left out)"),
             "shard": args.shard,  # projection.selfcheck models the whole slice only (shard "none")
             "floor": "weights read (routed experts: only those the step's tokens touch) + KV rows read, "
                      "over the read ceiling", "page_size": PAGE,
             "queued": "the step enqueued behind a host-released gate kernel: kernels back to back, no host "
                       "waits (includes the GPU's own kernel-to-kernel switch)",
             "timing": "median, L2 flushed before each run; stage times from events between stages in the "
                       "queued run"}
    doc = report("AR decode step on a K2.6-dims slice", rows, json_path, notes=notes)
    print_summary(rows)
    return doc


if __name__ == "__main__":
    main()
