"""Where the small-M path and the general kernels part (issue 45): one decode batch (M = 1 and 17 by
default) through both, layer by layer, every stage's output compared row by row.

Two comparisons per stage:
  forced  the small path's stage is fed the general path's input for that stage, so a stage beyond
          the bf16 tolerance here is a bug in that stage's kernel or in how the model calls it
          (dtype, view, stride, positions, slots, plan), not noise carried in from upstream;
  free    each path runs on its own outputs, as model.forward does: where the two drift apart and
          how far (a routing near-tie flips a token's experts and moves its logits by ~10%).
Then the top-k ids of every MoE layer per row (free and forced, with the general router's margin at
the k-th expert), the cache rows each path wrote (and any row it wrote outside the batch's slots),
and model.forward's logits both ways (each run twice: the same bits, or a race) against this replay.

    python tools/small_vs_general.py                       # CUDA: the TP8 random slice of the GPU test
    python tools/small_vs_general.py --backend numpy --preset small --ctx-max 300   # a CPU check of the tool
    python tools/small_vs_general.py --pdl on,off          # also with every PDL launch made plain

Prints one table per (M, PDL) and exits 1 when `problems` finds one: a forced stage beyond tolerance,
a stage beyond the numpy reference's tolerance, a path writing outside its slots, a forward that is not
deterministic, or a row of the forward logits beyond 2e-2 that no near-tie routing flip in that row
explains (tests/test_small_m_gpu.py asserts the same). Only a model on one rank (world 1) is taken.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree_rtc.backend import Backend  # noqa: E402
from ddtree_rtc.engine.kv_cache import PagedKVCache  # noqa: E402
from ddtree_rtc.model.mla import fused_rows, mla_kv_rows, mla_output, mla_query  # noqa: E402
from ddtree_rtc.model.moe import MoELayerWeights, moe  # noqa: E402
from ddtree_rtc.model.target import LATENT_NORM_EPS, DenseMLP, ForwardBatch, TargetModel  # noqa: E402

PAGE = 64
TOL = {"bf16": 1e-2, "fp32": 1e-4, "logits": 2e-2}  # per-row relative error; logits: the GPU test's bound
# A free run's routing flip is a near-tie when the general router's margin at the k-th expert is below
# this: by the MoE layer the two paths' hidden states differ by ~0.5-1% (bf16 roundings in different sum
# orders, compounded over the layers), which moves sigmoid router scores by up to ~1e-3. Measured flips on
# the TP8 slice (H100): margins 3.9e-4 and 4.7e-4. A row whose logits part beyond TOL["logits"] is
# explained only by such a flip in that row; any other parting is a defect.
NEAR_TIE = 2e-3


def row_errors(be, got, want) -> np.ndarray:
    """Per row (leading dim) ||got - want|| / ||want||, float64; inf where the non-finite entries differ."""
    a = _host(be, got).reshape(got.shape[0], -1)
    b = _host(be, want).reshape(want.shape[0], -1)
    bad = ~np.isfinite(a) | ~np.isfinite(b)
    same_bad = np.all(np.isfinite(a) == np.isfinite(b), axis=1)
    a, b = np.where(bad, 0, a), np.where(bad, 0, b)
    den = np.linalg.norm(b, axis=1)
    err = np.linalg.norm(a - b, axis=1) / np.where(den > 0, den, 1)
    return np.where(same_bad, err, np.inf)


def _host(be, a) -> np.ndarray:
    """A backend array (or a host one) as float64 on the host."""
    return (a if isinstance(a, np.ndarray) else be.to_host(a)).astype(np.float64)


class Table:
    def __init__(self, be, with_ref: bool = True):
        self.be, self.rows, self.refs = be, [], []
        self.with_ref = with_ref

    def add_ref(self, name: str, kind: str, small, general, ref):
        """A third opinion on one stage: the numpy reference on the general path's input, against the
        small path's forced output and the general path's (which of the two is off)."""
        ref = np.asarray(ref)
        self.refs.append({"stage": name, "kind": kind, "small": row_errors(self.be, small, ref),
                          "general": row_errors(self.be, general, ref)})

    def add(self, name: str, kind: str, forced=None, free=None, want_forced=None, want_free=None):
        """One stage: the small path's output fed the general input (forced) and on its own (free),
        each against the general path's output."""
        f = None if forced is None else row_errors(self.be, forced, want_forced)
        g = None if free is None else row_errors(self.be, free, want_free)
        self.rows.append({"stage": name, "kind": kind, "forced": f, "free": g})

    def first_beyond(self, which: str):
        for r in self.rows:
            e = r[which]
            if e is not None and (e > TOL[r["kind"]]).any():
                return r
        return None

    def print_refs(self):
        if not self.refs:
            return
        print("against the numpy reference on the general path's input (max row err, rows > tol):")
        for r in self.refs:
            tol = TOL[r["kind"]]
            cells = [f"{w} {np.max(r[w]):.2e} ({int((r[w] > tol).sum())})" for w in ("small", "general")]
            print(f"  {r['stage']:<22} {r['kind']:<6} {cells[0]:<26} {cells[1]}")

    def print(self):
        print(f"{'stage':<22} {'kind':<6} {'forced: max row err':>20} {'rows>tol':>8}   {'free: max row err':>18} "
              f"{'rows>tol':>8}")
        for r in self.rows:
            cells = []
            for which in ("forced", "free"):
                e = r[which]
                if e is None:
                    cells.append(f"{'-':>20} {'':>8}" if which == "forced" else f"{'-':>18} {'':>8}")
                    continue
                i = int(np.argmax(e))
                n = int((e > TOL[r["kind"]]).sum())
                w = 20 if which == "forced" else 18
                cells.append(f"{f'{e[i]:.2e} (row {i})':>{w}} {n:>8}")
            print(f"{r['stage']:<22} {r['kind']:<6} {cells[0]}   {cells[1]}")


def dense_ref(be, x, w) -> np.ndarray:
    """x w^T in float64 (bf16 x; bf16 or fp32 w) on the backend's device, as fp32 on the host."""
    xp = be.xp
    f = (lambda a: a) if w.dtype == np.float32 else be.from_bf16
    y = be.from_bf16(x).astype(xp.float64) @ f(w).astype(xp.float64).T
    return np.asarray(be.to_host(y.astype(xp.float32)))


def routed_ref(be, x, ids, w, experts):
    """The routed experts' sum (no shared expert) by the reference: reference/moe_gemm.py on numpy,
    bench.moe.mma_reference (its float64 twin on the 'mma' blobs) on CUDA."""
    if not be.is_cuda:
        from ddtree_rtc.reference.moe_gemm import moe_experts

        return moe_experts(x, ids, w, experts, check_ids=False)
    import cupy

    from ddtree_rtc.bench.moe import mma_reference

    return be.to_host(mma_reference(x, ids, w, experts, xp=cupy))


def build_model(a) -> TargetModel:
    if a.backend == "cuda" and a.preset is None:
        from ddtree_rtc.bench.decode import random_slice

        return random_slice(a.moe_layers, seed=a.seed, shard="tp8")  # the GPU test's model (seed 3)
    from ddtree_rtc.model.config import preset_config

    cfg = preset_config(a.preset or "small")
    if a.layers:
        cfg = cfg.with_layers(a.layers)
    return TargetModel.dummy(cfg, Backend(a.backend), seed=a.seed, head="random")


def make_caches(model, m: int, rng, ctx_max: int):
    """The general path's cache (random rows at scale 1, the GPU test's) and the small path's copy,
    one allocator; each sequence's context drawn from [min(100, ctx_max / 2), ctx_max)."""
    from ddtree_rtc.bench.harness import fill_random_bf16

    be = model.backend
    ctx = rng.integers(min(100, ctx_max // 2), ctx_max, m)
    per = -(-(ctx_max + 20) // PAGE)
    gen = PagedKVCache(be, model.num_layers, m * per, PAGE, model.dims.row)
    fill_random_bf16(gen.data, 1.0, seed=int(rng.integers(1 << 30)))
    for s in range(m):
        gen.allocator.reserve(s, int(ctx[s]) + 20)
    small = PagedKVCache(be, model.num_layers, m * per, PAGE, model.dims.row, allocator=gen.allocator)
    small.data[...] = gen.data
    return gen, small, ctx


def flat_rows(layer_view):
    return layer_view.reshape(-1, layer_view.shape[-1])


def stray_rows(be, layer_view, before, slots) -> int:
    """Rows of one cache layer that differ from ``before`` outside ``slots`` (a write where none belongs)."""
    xp = be.xp
    a, b = flat_rows(layer_view), flat_rows(before)
    diff = xp.any(a.view(np.uint16) != b.view(np.uint16), axis=1)
    diff[slots] = False
    return int(diff.sum())


@contextlib.contextmanager
def pdl_off(on: bool):
    """Every launch plain (no programmatic dependent launch) while active, where ``on`` is False: the
    module-level switches of the kernel wrappers that launch under PDL."""
    if on:
        yield
        return
    import importlib

    saved = []
    for name in ("linear", "mla_small", "moe_small", "moe_gemm", "moe_routing", "mla_block", "moe_block"):
        try:
            mod = importlib.import_module(f"ddtree_rtc.kernels.{name}")
        except ImportError:
            continue
        for attr, off in (("_pdl", lambda *a: False), ("pdl_supported", lambda *a: False)):
            if hasattr(mod, attr):
                saved.append((mod, attr, getattr(mod, attr)))
                setattr(mod, attr, off)
    try:
        yield
    finally:
        for mod, attr, v in saved:
            setattr(mod, attr, v)


def attention(model, table, i, x_s, x_g, cur_s, cur_g, caches, snapshot):
    """Layer i's attention block both ways; returns (small free output, general output)."""
    be, layer, d = model.backend, model.layers[i], model.dims
    w, eps, rs = layer.attn, LATENT_NORM_EPS, model.rope_scale
    cache_g, cache_s = caches
    inv = model.inv_freq
    impl_s = "invariant" if model.batch_invariant else "auto"
    pos, slots = cur_g.positions, cur_g.slots
    t = x_g.shape[0]
    # general: model/mla.py's mla_query + mla_kv_rows + kv_cache_write + attention + mla_output
    qa_g = None if w.q_a is None else be.linear(x_g, w.q_a)
    kv_g = be.linear(x_g, w.kv_a)
    q_g = be.linear(x_g if w.q_a is None else be.rmsnorm(qa_g, w.q_a_norm, eps), w.q_b)
    q_g = q_g.reshape(t, d.num_heads, d.qk_head)
    q_att_g = mla_query(be, x_g, w, d, pos, inv, eps, rs)
    rows_g = mla_kv_rows(be, x_g, w, d, pos, inv, eps, rs)
    be.kv_cache_write(cache_g.layer(i), rows_g, slots)
    o_lat_g, _ = be.mla_attention(cur_g.plan, q_att_g, cache_g.layer(i), model.cfg.softmax_scale)
    o_g = be.mla_head_gemm(o_lat_g, w.w_uv(d), True)
    out_g = mla_output(be, o_lat_g, w, d)
    small_rows = impl_s == "invariant" and fused_rows(d) and w.q_a is not None

    def small(x, forced: bool, cache_layer):
        """The small path's chain (model/mla.py _small_query_and_rows, attention, mla_output); forced:
        each step on the general path's input for it."""
        if small_rows:
            qa, kv = be.mla_qkv_a_small(x, w.q_a, w.kv_a)
            q = be.norm_linear(qa_g if forced else qa, w.q_a_norm, eps, w.q_b)
            q = q.reshape(t, d.num_heads, d.qk_head)
            q_att = be.mla_query_small(q_g if forced else q, w.w_uk(d), pos, inv, rs,
                                       rows=(kv_g if forced else kv, w.kv_a_norm, eps, cache_layer, slots))
        else:  # dims the fused query / row kernels do not take: the general ops with the small path's linears
            qa = None if w.q_a is None else be.linear(x, w.q_a, impl=impl_s)
            kv = be.linear(x, w.kv_a, impl=impl_s)
            q = None
            q_att = mla_query(be, x, w, d, pos, inv, eps, rs, impl_s)
            be.kv_cache_write(cache_layer, mla_kv_rows(be, x, w, d, pos, inv, eps, rs, impl_s), slots)
        att_cache = cache_g.layer(i) if forced else cache_layer
        o_lat, _ = be.mla_attention(cur_s.plan, q_att_g if forced else q_att, att_cache, model.cfg.softmax_scale)
        o = be.mla_head_gemm(o_lat_g if forced else o_lat, w.w_uv(d), True, impl=impl_s)
        out = be.linear((o_g if forced else o).reshape(t, d.num_heads * d.v_head), w.o, impl=impl_s)
        return dict(qa=qa, kv=kv, q=q, q_att=q_att, rows=flat_rows(cache_layer)[slots], o_lat=o_lat, o=o, out=out)

    scratch = snapshot.copy()
    fo = small(x_g, True, scratch)
    fr = small(x_s, False, cache_s.layer(i))
    p = f"L{i} "
    if w.q_a is not None:
        table.add(p + "q_a", "bf16", fo["qa"], fr["qa"], qa_g, qa_g)
    table.add(p + "kv_a", "bf16", fo["kv"], fr["kv"], kv_g, kv_g)
    if fo["q"] is not None:
        table.add(p + "q_b", "bf16", fo["q"], fr["q"], q_g, q_g)
    table.add(p + "q_att", "bf16", fo["q_att"], fr["q_att"], q_att_g, q_att_g)
    want_rows = flat_rows(cache_g.layer(i))[slots]
    table.add(p + "cache rows", "bf16", fo["rows"], fr["rows"], want_rows, want_rows)
    table.add(p + "attn o_lat", "bf16", fo["o_lat"], fr["o_lat"], o_lat_g, o_lat_g)
    if table.with_ref:
        from ddtree_rtc.reference.mla_attention import mla_attention as ref_attention
        from ddtree_rtc.reference.mla_attention import mla_attention_plan as ref_plan

        b = cur_g.batch
        plan_r = ref_plan(b.ctx_lens, b.num_new, cache_g.allocator.page_table(b.seq_ids), d.num_heads, PAGE,
                          cache_g.num_pages)
        o_r, _ = ref_attention(plan_r, be.to_host(q_att_g), be.to_host(cache_g.layer(i)), model.cfg.softmax_scale)
        table.add_ref(p + "attn o_lat", "bf16", fo["o_lat"], o_lat_g, o_r)
    table.add(p + "attn W_UV", "bf16", fo["o"], fr["o"], o_g, o_g)
    table.add(p + "attn o_proj", "bf16", fo["out"], fr["out"], out_g, out_g)
    strays = {"general": stray_rows(be, cache_g.layer(i), snapshot, slots),
              "small": stray_rows(be, cache_s.layer(i), snapshot, slots),
              "small forced": stray_rows(be, scratch, snapshot, slots)}
    return fr["out"], out_g, strays


def route_report(model, i, x, ids_a, ids_b) -> list[dict]:
    """Rows whose top-k sets differ, with the general router's margin at the k-th expert (for x)."""
    from ddtree_rtc.testing import route_picks

    be = model.backend
    a, b = np.sort(be.to_host(ids_a), axis=1), np.sort(be.to_host(ids_b), axis=1)
    rows = np.flatnonzero((a != b).any(axis=1))
    margins = {}
    if len(rows):
        try:
            picks = route_picks(model, i, x)
            margins = {int(r): (picks[r].expert_margin, picks[r].group_margin) for r in rows}
        except AssertionError as e:  # the reference's choice and the backend's part at a tie
            print(f"(layer {i}: no margins: {e})")
    return [{"layer": i, "row": int(r), "small_only": [int(v) for v in sorted(set(a[r]) - set(b[r]))],
             "general_only": [int(v) for v in sorted(set(b[r]) - set(a[r]))],
             "margin": margins.get(int(r), (np.nan, np.nan))[0],
             "group_margin": margins.get(int(r), (np.nan, np.nan))[1]} for r in rows]


def mlp(model, table, i, x_s, x_g, plans, flips):
    be, layer = model.backend, model.layers[i]
    impl_s = "invariant" if model.batch_invariant else "auto"
    p = f"L{i} "
    if isinstance(layer.mlp, DenseMLP):
        g13 = be.linear(x_g, layer.mlp.w13)
        hs = be.silu_mul(g13)
        out = be.linear(hs, layer.mlp.w2)

        def small(x, forced):
            s13 = be.linear(x, layer.mlp.w13, impl=impl_s)
            shs = be.silu_mul(g13 if forced else s13)
            return s13, shs, be.linear(hs if forced else shs, layer.mlp.w2, impl=impl_s)

        fo, fr = small(x_g, True), small(x_s, False)
        for name, j, want in (("dense w13", 0, g13), ("dense silu*up", 1, hs), ("dense w2", 2, out)):
            table.add(p + name, "bf16", fo[j], fr[j], want, want)
        return fr[2], out
    lw, rc = layer.mlp, model.routing
    plan_g, plan_s = plans
    offset = lw.expert_offset

    def route(logits):
        return be.moe_route(logits, lw.e_score_correction_bias, rc.top_k, rc.n_group, rc.topk_group,
                            rc.norm_topk_prob, rc.routed_scaling_factor)

    logits_g = be.router_logits(x_g, lw.gate_weight)
    hs_g = None if lw.shared_w13 is None else be.silu_mul(be.linear(x_g, lw.shared_w13))
    shared_g = None if hs_g is None else be.linear(hs_g, lw.shared_w2)
    ids_g, w_g = route(logits_g)
    routed_g = be.moe_experts(x_g, ids_g - be.xp.int32(offset) if lw.is_expert_shard else ids_g, w_g, lw.experts,
                              plan=plan_g, check_ids=False)
    out_g = moe(x_g, lw, rc, be, plan=plan_g, small=False, invariant=model.batch_invariant)
    dense = (impl_s == "invariant" and lw.gate_weight.dtype != np.float32 and lw.shared_w13 is not None
             and lw.num_experts % 8 == 0 and lw.shared_w13.shape[0] % 8 == 0)

    def small(x, forced):
        """model/moe.py's small branch, step by step; forced: each step on the general path's input."""
        hs = None
        if dense:
            logits, hs = be.moe_small_dense(x, lw.gate_weight, lw.shared_w13)
        elif impl_s == "invariant" and lw.gate_weight.dtype != np.float32:
            logits = be.linear(x, lw.gate_weight, out=be.empty((x.shape[0], lw.num_experts), "fp32"), impl=impl_s)
        else:
            logits = be.router_logits(x, lw.gate_weight)
        ids, w = route(logits)
        if lw.shared_w13 is not None and hs is None:
            hs = be.silu_mul(be.linear(x, lw.shared_w13, impl=impl_s))
        shared = None if hs is None else be.linear(hs_g if forced else hs, lw.shared_w2, impl=impl_s)
        routed = be.moe_small_experts(x, ids_g if forced else ids, w_g if forced else w, lw.experts, plan=plan_s,
                                      check_ids=False, id_offset=offset)
        out = moe(x, lw, rc, be, plan=plan_s, small=True, invariant=model.batch_invariant)
        return dict(logits=logits, ids=ids, w=w, hs=hs, shared=shared, routed=routed, out=out)

    fo, fr = small(x_g, True), small(x_s, False)
    table.add(p + "router logits", "fp32", fo["logits"], fr["logits"], logits_g, logits_g)
    if table.with_ref:
        table.add_ref(p + "router logits", "fp32", fo["logits"], logits_g, dense_ref(be, x_g, lw.gate_weight))
    same_f = np.array_equal(be.to_host(fo["ids"]), be.to_host(ids_g))  # the weights in the same slot order
    table.add(p + "top-k weights", "fp32", fo["w"] if same_f else None, None, w_g, w_g)
    if hs_g is not None:
        table.add(p + "shared silu*up", "bf16", fo["hs"], fr["hs"], hs_g, hs_g)
        table.add(p + "shared out", "bf16", fo["shared"], fr["shared"], shared_g, shared_g)
    table.add(p + "routed sum", "bf16", fo["routed"], None, routed_g, None)
    if table.with_ref:
        ids_r = ids_g - be.xp.int32(offset) if lw.is_expert_shard else ids_g
        table.add_ref(p + "routed sum", "bf16", fo["routed"], routed_g, routed_ref(be, x_g, ids_r, w_g, lw.experts))
    table.add(p + "MoE out", "bf16", fo["out"], fr["out"], out_g, out_g)
    for which, ids_s, x in (("forced", fo["ids"], x_g), ("free", fr["ids"], x_s)):
        for f in route_report(model, i, x, ids_s, ids_g):
            flips.append({"run": which, **f})
    return fr["out"], out_g


def replay(model, m: int, seed: int, ctx_max: int, pdl: bool, reference: bool = True):
    """Both paths over one decode batch; returns (table, report dict). ``reference``: also the numpy
    reference of the attention, router, routed experts and head on the general path's input."""
    be, cfg = model.backend, model.cfg
    table = Table(be, reference)
    rng = np.random.default_rng(seed)
    cache_g, cache_s, ctx = make_caches(model, m, rng, ctx_max)
    tokens = np.random.default_rng(seed + 1).integers(0, cfg.vocab_size, m)
    batch = ForwardBatch.causal(list(range(m)), ctx, [[int(t)] for t in tokens])
    model.small_m_path = False
    cur_g = model.prepare(batch, cache_g)
    model.small_m_path = True
    cur_s = model.prepare(batch, cache_s)
    if not model.small_m(m):
        raise SystemExit(f"M = {m}: the model does not take the small-M path at this size")
    plans = (be.moe_plan(m, *_moe_dims(model)), be.moe_small_plan(m, *_moe_dims(model))) \
        if any(isinstance(ly.mlp, MoELayerWeights) for ly in model.layers) else (None, None)
    initial = cache_g.data.copy()
    flips, strays = [], {}
    h = be.embedding(cur_g.tokens, model.embed)
    x = be.rmsnorm(h, model.layers[0].input_norm, cfg.rms_norm_eps)
    (x_s, h_s), (x_g, h_g) = (x, h), (x, h)
    eps = cfg.rms_norm_eps
    for i, layer in enumerate(model.layers):
        a_s, a_g, strays[i] = attention(model, table, i, x_s, x_g, cur_s, cur_g, (cache_g, cache_s), initial[i])
        x_s, h_s = be.rmsnorm(a_s, layer.post_norm, eps, residual=h_s)
        x_g, h_g = be.rmsnorm(a_g, layer.post_norm, eps, residual=h_g)
        table.add(f"L{i} post-attn norm", "bf16", None, x_s, None, x_g)
        m_s, m_g = mlp(model, table, i, x_s, x_g, plans, flips)
        nxt = model.layers[i + 1].input_norm if i + 1 < len(model.layers) else model.final_norm
        x_s, h_s = be.rmsnorm(m_s, nxt, eps, residual=h_s)
        x_g, h_g = be.rmsnorm(m_g, nxt, eps, residual=h_g)
        table.add(f"L{i} residual", "bf16", None, h_s, None, h_g)
        table.add(f"L{i} {'final norm' if i + 1 == len(model.layers) else 'next norm'}", "bf16", None, x_s, None, x_g)
    impl_s = "invariant" if model.batch_invariant else "auto"
    logits_g = be.linear(x_g, model.lm_head)
    table.add("head logits", "logits", be.linear(x_g, model.lm_head, impl=impl_s), be.linear(x_s, model.lm_head,
                                                                                            impl=impl_s),
              logits_g, logits_g)
    if reference:
        table.add_ref("head logits", "logits", be.linear(x_g, model.lm_head, impl=impl_s), logits_g,
                      dense_ref(be, x_g, model.lm_head))
    # model.forward both ways, each twice, on fresh copies of the initial cache
    fwd = {}
    for name, small in (("small", True), ("general", False)):
        outs = []
        for _ in range(2):
            c = PagedKVCache(be, model.num_layers, cache_g.num_pages, PAGE, model.dims.row, allocator=cache_g.allocator)
            c.data[...] = initial
            model.small_m_path = small
            try:
                outs.append(be.to_host(model.forward(batch, c, output="logits").logits).astype(np.float64))
            finally:
                model.small_m_path = True
        fwd[name] = outs
    rep_s = be.to_host(be.linear(x_s, model.lm_head, impl=impl_s)).astype(np.float64)
    rep_g = be.to_host(logits_g).astype(np.float64)
    fs, fg = fwd["small"][0], fwd["general"][0]
    per_row = np.linalg.norm(fs - fg, axis=1) / np.linalg.norm(fg, axis=1)
    rel = float(np.linalg.norm(fs - fg) / np.linalg.norm(fg))
    report = {
        "m": m, "pdl": pdl, "ctx": ctx.tolist(), "tokens": tokens.tolist(),
        "stages": [{"stage": r["stage"], "kind": r["kind"],
                    "forced": None if r["forced"] is None else r["forced"].tolist(),
                    "free": None if r["free"] is None else r["free"].tolist()} for r in table.rows],
        "reference": [{"stage": r["stage"], "kind": r["kind"], "small": r["small"].tolist(),
                       "general": r["general"].tolist()} for r in table.refs],
        "topk_flips": flips, "stray_cache_rows": strays,
        "forward": {"rel": rel, "per_row": per_row.tolist(),
                    "deterministic": {k: bool(np.array_equal(v[0], v[1])) for k, v in fwd.items()},
                    "equals_replay": {"small": bool(np.array_equal(fwd["small"][0], rep_s)),
                                      "general": bool(np.array_equal(fwd["general"][0], rep_g))}},
    }
    return table, report


def _moe_dims(model):
    lw = next(ly.mlp for ly in model.layers if isinstance(ly.mlp, MoELayerWeights))
    ex = lw.experts
    return ex.num_experts, model.cfg.num_experts_per_tok, model.cfg.hidden_size, ex.intermediate


def problems(table: Table, rep: dict) -> list[str]:
    """What is wrong in one replay (empty: the two paths agree as well as two sum orders can):
    a forced stage beyond tolerance; either path's stage beyond tolerance of the numpy reference; a
    path writing cache rows outside its slots; a forward that is not deterministic; a row of the free
    forward's logits beyond TOL["logits"] that no near-tie routing flip in that row explains."""
    out = []
    first = table.first_beyond("forced")
    if first is not None:
        e = first["forced"]
        bad = np.flatnonzero(e > TOL[first["kind"]])
        out.append(f"forced: first stage beyond tolerance {first['stage']} ({first['kind']}): rows "
                   f"{bad[:12].tolist()} rel errors {[f'{v:.2e}' for v in e[bad[:12]]]}")
    for r in table.refs:
        for which in ("small", "general"):
            if (r[which] > TOL[r["kind"]]).any():
                out.append(f"reference: the {which} path's {r['stage']} is beyond tolerance of the numpy reference")
    for layer, s in rep["stray_cache_rows"].items():
        if any(s.values()):
            out.append(f"cache layer {layer}: rows written outside the batch's slots: {s}")
    f = rep["forward"]
    if not all(f["deterministic"].values()):
        out.append(f"forward not deterministic: {f['deterministic']}")
    per_row = np.array(f["per_row"])
    tie_rows = {x["row"] for x in rep["topk_flips"] if x["run"] == "free" and x["margin"] < NEAR_TIE}
    for r in np.flatnonzero(per_row > TOL["logits"]):
        if int(r) not in tie_rows:
            out.append(f"forward logits row {int(r)} (ctx {rep['ctx'][int(r)]}) parts by {per_row[r]:.2e} "
                       f"> {TOL['logits']:.0e} with no near-tie routing flip (margin < {NEAR_TIE:.0e}) in that row")
    return out


def print_report(table: Table, rep: dict) -> bool:
    """The table and its verdicts; True when ``problems`` finds nothing."""
    print(f"\n== M = {rep['m']}, PDL {'on' if rep['pdl'] else 'off'}, contexts {rep['ctx'][:8]}"
          f"{' ...' if len(rep['ctx']) > 8 else ''}")
    table.print()
    table.print_refs()
    if table.first_beyond("forced") is None:
        print("forced: every stage within tolerance given the general path's input "
              f"(bf16 {TOL['bf16']:.0e}, fp32 {TOL['fp32']:.0e}, logits {TOL['logits']:.0e} per row)")
    free = table.first_beyond("free")
    print("free: " + ("no stage beyond tolerance" if free is None else
                      f"first stage beyond tolerance: {free['stage']} (max row err {np.max(free['free']):.2e})"))
    for f in rep["topk_flips"]:
        print(f"top-k ids differ ({f['run']}): layer {f['layer']} row {f['row']}: small-only {f['small_only']} "
              f"general-only {f['general_only']}, general margin {f['margin']:.2e}"
              + ("" if not np.isfinite(f["group_margin"]) else f", group margin {f['group_margin']:.2e}")
              + (" (a near-tie)" if f["margin"] < NEAR_TIE else ""))
    if not rep["topk_flips"]:
        print("top-k ids: the same sets in every row (forced and free)")
    f = rep["forward"]
    per_row = np.array(f["per_row"])
    flipped = sorted({x["row"] for x in rep["topk_flips"] if x["run"] == "free"})
    big = np.flatnonzero(per_row > TOL["logits"])
    print(f"model.forward logits small vs general: rel {f['rel']:.3e}; rows > {TOL['logits']:.0e}: "
          f"{big[:16].tolist()} of {len(per_row)}; rows with a free top-k flip: {flipped[:16]}")
    print(f"  per row: {' '.join(f'{v:.1e}' for v in per_row[:32])}{' ...' if len(per_row) > 32 else ''}")
    print(f"  deterministic (two runs, same bits): {f['deterministic']}; forward == this replay: {f['equals_replay']}")
    found = problems(table, rep)
    for p in found:
        print("PROBLEM: " + p)
    return not found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("cuda", "numpy"), default="cuda")
    ap.add_argument("--preset", default=None, help="a preset with dummy weights instead of the TP8 random slice "
                    "(numpy: default small)")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers of --preset (default 2: dense + MoE)")
    ap.add_argument("--moe-layers", type=int, default=1, help="MoE layers of the TP8 random slice")
    ap.add_argument("--seed", type=int, default=None, help="weights seed (default 3: the GPU test's; 0 for presets)")
    ap.add_argument("--batch-seed", type=int, default=7, help="contexts, cache contents and tokens")
    ap.add_argument("--m", default="1,17", help="decode batch sizes (<= 64)")
    ap.add_argument("--ctx-max", type=int, default=4096, help="contexts drawn below this (the GPU test: 4096)")
    ap.add_argument("--pdl", default="on", help="on, off or on,off: off makes every PDL launch plain")
    ap.add_argument("--no-reference", action="store_true", help="skip the numpy reference's third opinion")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    if a.seed is None:
        a.seed = 3 if a.backend == "cuda" and a.preset is None else 0
    t0 = time.time()
    model = build_model(a)
    if model.shard.world != 1:
        raise SystemExit("small_vs_general: a model on one rank only")
    print(f"{model.backend}, {model.num_layers} layers, {model.dims.num_heads} heads, hidden {model.cfg.hidden_size}, "
          f"vocab rows {model.lm_head.shape[0]} ({time.time() - t0:.1f} s to build)")
    ok, reports = True, []
    for pdl in [v == "on" for v in a.pdl.split(",")]:
        with pdl_off(pdl):
            for m in (int(v) for v in a.m.split(",")):
                t1 = time.time()
                table, rep = replay(model, m, a.batch_seed, a.ctx_max, pdl, not a.no_reference)
                ok &= print_report(table, rep)
                print(f"  ({time.time() - t1:.1f} s)")
                reports.append(rep)
    if a.json:
        a.json.write_text(json.dumps(reports, indent=1, default=float))
    print(f"\nsmall_vs_general: {'within tolerance' if ok else 'DIFFERENCES ABOVE'} ({time.time() - t0:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
