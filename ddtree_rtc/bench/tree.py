"""DDTree tree step: vocabulary top-k, tree build and acceptance walk on the GPU, against the
Python path that SGLang's DDTree runs on the host per request (numpy log-softmax + top-k, then the
``heapq`` best-first loop with the mask / position / link outputs, and the acceptance walk: our
numpy references). The bare heap loop and walk (no outputs) are reported too, in each row's extra.

Batch {1, 8, 32, 64} x budget {16 .. 512}, depth 7, V = 163840, Zipf-shaped drafter logits (bf16,
token ranks shuffled per row). Rows: top-k (bytes = the logits, against the read ceiling), build,
accept, build + accept, and for batch 1 the three together; each with the host peer and the speedup.
Those are single launches between CUDA events (each pays the launch and the event round trip, ~4 µs
for an empty kernel here); the "[graph x20, per round]" rows give the GPU time per round when
build + accept run back to back from a CUDA graph, as a decode loop runs them, and the "floor" rows
the same for two launches of the same grids that compute nothing (one dependent load each): the
part of a round that is launch and memory latency, measured in the same run.

``--variants``: the tree_build kernel at batch {1, 32, 64} x budget {16, 64, 128, 512}, checked
bit for bit against the heapq reference (``exact`` in extra), timed between events and per round
from a CUDA graph; the accept kernel, build + accept (events and graph), and the latency floor of
one and of two back-to-back kernels of the same grid (launch plus one dependent memory trip each)
and of the graph floor row's two launches.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from ..reference.topk import sanitize_logits
from ..reference.tree_accept import tree_accept as ref_tree_accept
from ..reference.tree_accept import walk
from ..reference.tree_build import build_one, sanitize_logq
from ..reference.tree_build import tree_build as ref_tree_build
from .harness import Row, graphed, latency_floor_launch, latency_floor_us, report, time_gpu

BATCHES = (1, 8, 32, 64)
BUDGETS = (16, 32, 64, 128, 256, 512)
QUICK_BATCHES = (1, 32)
QUICK_BUDGETS = (16, 64)
DEPTH = 7
VOCAB = 163_840
ZIPF_S = 1.1
ACCEPT_RATE = 0.7  # chance that the target's choice at a node is one of its children
ROUNDS = 20  # calls per CUDA graph in the back-to-back rows


def zipf_logits(batch: int, depth: int, vocab: int, seed: int):
    """bf16 bits ``[batch, depth, vocab]``: -s * log(rank) + small noise, ranks shuffled per row."""
    import cupy

    rng = cupy.random.default_rng(seed)
    rows = batch * depth
    ranks = cupy.argsort(rng.random((rows, vocab), dtype=cupy.float32), axis=1).astype(cupy.float32) + 1
    x = -ZIPF_S * cupy.log(ranks) + 0.1 * rng.standard_normal((rows, vocab), dtype=cupy.float32)
    bits = x.astype(cupy.float32).view(cupy.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(cupy.uint16).reshape(batch, depth, vocab)


def target_choices(tree, rng) -> np.ndarray:
    """Per node: with ACCEPT_RATE one of its children's tokens (the target agrees), else a token
    no child has."""
    tokens, parents, num = tree.tokens.get(), tree.parents.get(), tree.num_nodes.get()
    choices = np.full(tokens.shape, -7, dtype=np.int32)
    for i in range(tokens.shape[0]):
        for j in range(1, int(num[i])):
            p = int(parents[i, j])
            if choices[i, p] == -7 and rng.random() < ACCEPT_RATE:
                choices[i, p] = tokens[i, j]
    return choices


def host_topk(logits: np.ndarray, k: int):
    """The host peer: fp32 log-softmax and top-k with numpy, as a host implementation does it."""
    x = logits.reshape(-1, logits.shape[-1])
    m = x.max(-1, keepdims=True)
    lse = m + np.log(np.exp(x - m).sum(-1, keepdims=True))
    idx = np.argpartition(-x, k - 1, axis=-1)[:, :k]
    vals = np.take_along_axis(x, idx, -1)
    order = np.argsort(-vals, axis=-1, kind="stable")
    return np.take_along_axis(vals - lse, order, -1), np.take_along_axis(idx, order, -1)


def host_build(logq: np.ndarray, budget: int):
    """The host peer: per request, the heapq loop of docs/architecture.md section 4 on Python floats."""
    lq = sanitize_logq(logq).astype(np.float64)
    return [build_one(lq[i, :, : min(budget, lq.shape[2])].tolist(), budget, lq.shape[1])
            for i in range(lq.shape[0])]


def host_accept(tokens: np.ndarray, parents: np.ndarray, num_nodes: np.ndarray, choices: np.ndarray):
    """The host peer: per request, the Python walk over the tree's parent / token lists."""
    tok, par, ch = tokens.tolist(), parents.tolist(), choices.tolist()
    return [walk(tok[i], par[i], int(num_nodes[i]), ch[i]) for i in range(len(tok))]


def per_round(fn, iters: int) -> float:
    """µs per call of ``fn`` when ROUNDS calls run back to back from one CUDA graph (as a decode
    loop's graph runs them: no host launch and no event in between; the L2 is flushed before each
    replay, so the first call starts cold and the later ones find their inputs where the previous
    kernels left them, as after the top-k and the target's sampling in a real round)."""
    launch = graphed(lambda: [fn() for _ in range(ROUNDS)])
    return time_gpu(launch, iters=iters).median_us / ROUNDS


def time_host(fn, reps: int) -> float:
    best = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best.append(time.perf_counter() - t0)
    return float(np.median(best)) * 1e6


def bench_case(batch: int, budget: int, reps: int, iters: int, rng) -> list[Row]:
    import cupy

    from ..backend import Backend
    from ..engine.decode.tree import TreeBuffers, TreeShape

    be = Backend("cuda")
    bufs = TreeBuffers(be, TreeShape(batch=batch, budget=budget, depth=DEPTH, vocab=VOCAB))
    logits = zipf_logits(batch, DEPTH, VOCAB, seed=batch * 1000 + budget)
    roots = cupy.asarray(rng.integers(0, VOCAB, batch).astype(np.int32))
    prefix = cupy.asarray(rng.integers(100, 4000, batch).astype(np.int32))
    k = bufs.shape.k
    bufs.build(logits, roots, prefix)
    choices = cupy.asarray(target_choices(bufs.tree, rng))
    bufs.accept(choices)
    tau = float(bufs.result.accept_len.get().mean())

    def topk():
        be.topk_logprobs(logits, k, out_logq=bufs.logq, out_ids=bufs.ids, workspace=bufs.workspace)

    def build():
        be.tree_build(bufs.logq, bufs.ids, roots, bufs.budgets, bufs.depths, prefix, budget, out=bufs.tree)

    def accept():
        bufs.accept(choices)

    t_topk = time_gpu(topk, iters=iters).median_us
    t_build = time_gpu(build, iters=iters).median_us
    t_accept = time_gpu(accept, iters=iters).median_us
    t_both = time_gpu(lambda: (build(), accept()), iters=iters).median_us
    g_build, g_accept, g_both = (per_round(fn, iters) for fn in (build, accept, lambda: (build(), accept())))
    # two launches shaped like the build's (a block per request) and the accept's (four requests per
    # block), one dependent load each: what build + accept cost per round with nothing computed
    g_floor = per_round(latency_floor_launch((batch, -(-batch // 4))), iters)

    host_logits = sanitize_logits(be.to_host(logits))
    host_logq, host_ids, host_choices = bufs.logq.get(), bufs.ids.get(), choices.get()
    inputs = (host_logq, host_ids, roots.get(), bufs.budgets.get(), bufs.depths.get(), prefix.get(), budget)
    host_tree = ref_tree_build(*inputs)
    tree = [a.get() for a in (bufs.tree.tokens, bufs.tree.parents, bufs.tree.num_nodes)]
    p_topk = time_host(lambda: host_topk(host_logits, k), reps)
    p_build = time_host(lambda: ref_tree_build(*inputs), reps)
    p_accept = time_host(lambda: ref_tree_accept(host_tree, host_choices), reps)
    p_heap = time_host(lambda: host_build(host_logq, budget), reps)
    p_walk = time_host(lambda: host_accept(*tree, host_choices), reps)

    case = f"b={batch} budget={budget}"
    extra = {"batch": batch, "budget": budget, "k": k, "depth": DEPTH, "vocab": VOCAB, "mean_accept_len": tau,
             "heap_loop_only_us": p_heap, "walk_only_us": p_walk}
    rows = [
        Row(f"topk {case}", t_topk, bytes=batch * DEPTH * VOCAB * 2, peer="numpy", peer_us=p_topk,
            extra={**extra, "speedup": p_topk / t_topk}),
        Row(f"build {case}", t_build, peer="heapq", peer_us=p_build,
            extra={**extra, "speedup": p_build / t_build}),
        Row(f"accept {case}", t_accept, peer="python walk", peer_us=p_accept,
            extra={**extra, "speedup": p_accept / t_accept}),
        Row(f"build+accept {case}", t_both, peer="heapq+walk", peer_us=p_build + p_accept,
            extra={**extra, "speedup": (p_build + p_accept) / t_both}),
        Row(f"build+accept {case} [graph x{ROUNDS}, per round]", g_both, peer="heapq+walk",
            peer_us=p_build + p_accept,
            extra={**extra, "speedup": (p_build + p_accept) / g_both, "build_us": g_build, "accept_us": g_accept,
                   "floor_us": g_floor}),
        Row(f"floor {case} [graph x{ROUNDS}, per round]: 2 launches, 1 load each", g_floor,
            extra={**extra, "what": "the build's and the accept's grids as latency_floor_kernel launches"}),
    ]
    if batch == 1 and budget <= 64:
        t_round = time_gpu(lambda: (topk(), build(), accept()), iters=iters).median_us
        rows.append(Row(f"round (topk+build+accept) {case}", t_round, peer="host path",
                        peer_us=p_topk + p_build + p_accept,
                        extra={**extra, "speedup": (p_topk + p_build + p_accept) / t_round}))
    return rows


VARIANT_BATCHES = (1, 32, 64)
VARIANT_BUDGETS = (16, 64, 128, 512)
VARIANT_ITERS = 30  # events and graph replays per variant row (--variants runs in well under 2 minutes)
TREE_FIELDS = ("tokens", "parents", "node_depth", "positions", "num_nodes", "mask", "first_child",
               "next_sibling", "scores")


def same_tree(got, ref) -> bool:
    """Device TreeArrays equal to the reference's, scores bit for bit."""
    for name in TREE_FIELDS:
        g, r = getattr(got, name).get(), getattr(ref, name)
        if name == "scores":
            g, r = g.view(np.int64), r.view(np.int64)
        if not np.array_equal(g, r):
            return False
    return True


def variant_rows(batch: int, budget: int, rng) -> list[Row]:
    """The build kernel, the accept kernel and the latency floors for one (batch, budget)."""
    import cupy

    from ..backend import Backend
    from ..engine.decode.tree import TreeBuffers, TreeShape
    from ..kernels.tree_accept import tree_accept
    from ..kernels.tree_build import tree_build

    be = Backend("cuda")
    bufs = TreeBuffers(be, TreeShape(batch=batch, budget=budget, depth=DEPTH, vocab=VOCAB))
    logits = zipf_logits(batch, DEPTH, VOCAB, seed=batch * 1000 + budget)
    roots = cupy.asarray(rng.integers(0, VOCAB, batch).astype(np.int32))
    prefix = cupy.asarray(rng.integers(100, 4000, batch).astype(np.int32))
    bufs.build(logits, roots, prefix)
    inputs = (bufs.logq, bufs.ids, roots, bufs.budgets, bufs.depths, prefix, budget)
    host = [a.get() for a in inputs[:6]] + [budget]
    t0 = time.perf_counter()
    ref = ref_tree_build(*host)
    heapq_us = (time.perf_counter() - t0) * 1e6
    case = f"b={batch} budget={budget}"
    extra = {"batch": batch, "budget": budget, "depth": DEPTH, "vocab": VOCAB}
    rows = []
    it = VARIANT_ITERS
    build = lambda: tree_build(*inputs, out=bufs.tree)  # noqa: E731
    us = time_gpu(build, iters=it).median_us
    graph_us = per_round(build, it)
    bufs.tree.num_nodes.fill(-1)  # the check sees this build's outputs, not the setup's
    build()
    exact = same_tree(bufs.tree, ref)
    rows.append(Row(f"build {case}", us, peer="heapq", peer_us=heapq_us,
                    extra={**extra, "exact": exact, "graph_us": graph_us}))
    rows.append(Row(f"build {case} [graph x{ROUNDS}, per round]", graph_us, peer="heapq",
                    peer_us=heapq_us, extra={**extra, "exact": exact}))
    choices = cupy.asarray(target_choices(bufs.tree, rng))
    accept = lambda: tree_accept(bufs.tree, choices, out=bufs.result)  # noqa: E731
    rows.append(Row(f"accept {case}", time_gpu(accept, iters=it).median_us,
                    extra={**extra, "graph_us": per_round(accept, it)}))
    both = lambda: (build(), accept())  # noqa: E731
    us, graph_us = time_gpu(both, iters=it).median_us, per_round(both, it)
    rows.append(Row(f"build+accept {case}", us, peer="heapq", peer_us=heapq_us,
                    extra={**extra, "speedup": heapq_us / us, "graph_us": graph_us}))
    rows.append(Row(f"build+accept {case} [graph x{ROUNDS}, per round]", graph_us, peer="heapq",
                    peer_us=heapq_us, extra={**extra, "speedup": heapq_us / graph_us}))
    for kernels in (1, 2):
        rows.append(Row(f"floor {case}: {kernels} launch(es) of {batch} blocks, 1 load each",
                        latency_floor_us(batch, kernels=kernels), extra={**extra, "kernels": kernels}))
    rows.append(Row(f"floor {case} [graph x{ROUNDS}, per round]: 2 launches, 1 load each",
                    per_round(latency_floor_launch((batch, -(-batch // 4))), it),
                    extra={**extra, "what": "the prune build's and the accept's grids as latency_floor_kernel "
                                            "launches"}))
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="ddtree-rtc bench tree", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"batches {QUICK_BATCHES}, budgets {QUICK_BUDGETS}")
    ap.add_argument("--variants", action="store_true",
                    help="the build checked bit for bit against heapq, accept, build + accept, latency floors")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    if args.variants:
        rng = np.random.default_rng(0)
        rows = [r for b in VARIANT_BATCHES for n in VARIANT_BUDGETS for r in variant_rows(b, n, rng)]
        return report("DDTree tree build (checked) and accept, with latency floors", rows, args.json,
                      notes={"peer": "reference tree_build (heapq + outputs) on the host",
                             "exact": "the build's outputs equal the reference's bit for bit"})
    batches, budgets = (QUICK_BATCHES, QUICK_BUDGETS) if args.quick else (BATCHES, BUDGETS)
    reps, iters = (3, 20) if args.quick else (3, 50)  # host times: median of 3 (one run varied 2x)
    rng = np.random.default_rng(0)
    rows = []
    for batch in batches:
        for budget in budgets:
            rows += bench_case(batch, budget, reps, iters, rng)
    notes = {"logits": f"bf16 Zipf s={ZIPF_S} (+0.1 noise), ranks shuffled per row",
             "choices": f"each node's choice is a child's token with p={ACCEPT_RATE}",
             "peer": "host numpy top-k; reference tree_build (heapq + outputs) and tree_accept per "
                     "request (SGLang's host path); speedup = peer_us / us, in each row's extra"}
    return report("DDTree tree step (top-k, build, accept)", rows, args.json, notes=notes)
