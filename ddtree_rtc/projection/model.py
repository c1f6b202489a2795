"""Per-rank time of one forward (AR step: 1 row per request; DDTree verify: 1 + budget rows) and of one
DDTree round, term by term, from the measured inputs (inputs.py) carried to a device.

How a measured time carries: a linear layer is `latency + max(weights / (bw * eta_mem), rows * flops /
(rate * eta_mm))` with eta_mem and latency from the slice's measured stage and eta_mm from the M=1024
GEMM row; the MoE layer comes from its (experts, rows per expert) table with separate stream and compute
parts; MLA's core keeps its table latency and scales the rest by its roofline bound; tree-step kernels
keep their time and add their bytes' read-time difference.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import numpy as np

from ..model.config import preset_config
from .data import ProjectionError
from .inputs import (
    Device,
    ceiling,
    decode_stage_rows,
    drafter_rows,
    interp,
    mla_bytes_flops,
    mla_table,
    moe_table,
    reference,
    row,
    rows,
    tree_rows,
)

LAYOUTS = ("tp8", "ep8", "tp_attn_ep_moe")
TERMS = ("embed", "attention latency", "attention weights", "MLA core", "dense layer", "MoE fixed",
         "MoE weight stream", "MoE compute", "shared expert", "lm_head + choose", "collectives",
         "drafter", "tree step")


@dataclass(frozen=True)
class Dims:
    name: str
    hidden: int
    layers: int
    dense_layers: int
    heads: int
    q_lora: int
    kv_lora: int
    nope: int
    rope: int
    v: int
    inter: int
    moe_inter: int
    experts: int
    top_k: int
    shared: int
    vocab: int
    attn_bytes_per_param: float = 2.0   # bf16
    source: str = ""

    def attn_params(self, tp):
        h = self.hidden
        repl = h * self.q_lora + h * (self.kv_lora + self.rope)
        split = (self.q_lora * self.heads * (self.nope + self.rope) + self.kv_lora * self.heads * (self.nope + self.v)
                 + self.heads * self.v * h)
        return repl + split / tp

    def dense_params(self, tp):
        return 3 * self.hidden * self.inter / tp

    def shared_params(self, tp):
        return 3 * self.hidden * self.moe_inter * self.shared / tp


def k26_dims() -> Dims:
    c = preset_config("k2.6")
    return Dims("Kimi K2.6", c.hidden_size, c.num_hidden_layers, c.first_k_dense_replace, c.num_attention_heads,
                c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
                c.intermediate_size, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok,
                c.n_shared_experts, c.vocab_size, source="preset k2.6 (ddtree_rtc/model/config.py)")


# DeepSeek-R1 (deepseek-ai/DeepSeek-R1 config.json); attention in FP8 as in NVIDIA's R1-FP4 checkpoint,
# whose routed experts are NVFP4 (4.5 bits a weight, the same bytes as INT4 with a bf16 scale per 32).
R1_DIMS = Dims("DeepSeek-R1", 7168, 61, 3, 128, 1536, 512, 128, 64, 128, 18432, 2048, 256, 8, 1, 129280,
               attn_bytes_per_param=1.0, source="deepseek-ai/DeepSeek-R1 config.json; attention FP8 (unsure)")

DRAFTER = dict(layers=6, hidden=7168, q_heads=64, kv_heads=8, head_dim=128, inter=18432, block=8)


@dataclass(frozen=True)
class Options:
    layout: str = "tp8"
    tp: int = 8
    collective: str = "nccl_graph"
    fused: bool = False            # latency parts at one graph launch each (the fused-layer / small-M path)
    moe_stream_eta: float | None = None   # MoE weight stream at this fraction of read instead of the table's
    expert_precision: str = "bf16"  # MMA the expert GEMM runs at: bf16 (W4A16, today), fp4 (NVFP4), int8 (W4A8)

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ProjectionError(f"layout {self.layout!r}: known {LAYOUTS}")


def split_latency(t_us, nbytes, read_gbs, eta):
    """(latency, eta_mem) of a measured weight-streaming stage: the time beyond streaming its bytes at eta
    of the read ceiling is latency; a stage faster than that streams at its own achieved rate instead."""
    stream = nbytes / (read_gbs * 1e3 * eta)
    if t_us >= stream:
        return t_us - stream, eta
    return 0.0, nbytes / (read_gbs * 1e3 * t_us)


@dataclass(frozen=True)
class Linear:
    latency_us: float
    eta_mem: float
    source: str

    def us(self, wbytes, flops_per_row, m, dev: Device, fused=False):
        ref = reference()
        mem = wbytes / (dev.bw_gbs * 1e3 * self.eta_mem)
        cmp = m * flops_per_row / (dev.rate("bf16") * 1e6 * ref.eta_mm)
        lat = ref.launch_us if fused else self.latency_us
        return lat, max(mem, cmp)


@cache
def stage_fits():
    """Latency / stream efficiency of each linear stage, from the slice's measured stages (decode_h200)."""
    ref, dims = reference(), k26_dims()
    st = decode_stage_rows()
    read = ceiling("decode_h200.json")
    mla = mla_table(dims.heads)
    lat = []
    for (b, ctx, s), rs in st.items():
        if s == "attention":
            for r in rs:
                core = mla.ref_us(ctx, b, 1)
                lat.append(r["us"] - core - dims.attn_params(1) * 2 / (read * 1e3 * ref.eta_lin))
    attn = Linear(sum(lat) / len(lat), ref.eta_lin,
                  f"decode_h200.json attention stages ({len(lat)} rows) less the MLA core (attention_h200.json) "
                  f"and the weights at the M=1 GEMM's {ref.eta_lin:.0%} of read")

    def one(stage, nbytes, pick=lambda b: True):
        ts = [r["us"] for (b, _c, s), rs in st.items() if s == stage and pick(b) for r in rs]
        if not ts:
            raise ProjectionError(f"decode_h200.json: no {stage!r} stage rows")
        t = sum(ts) / len(ts)
        lt, eta = split_latency(t, nbytes, read, ref.eta_lin)
        return Linear(lt, eta, f"decode_h200.json {stage} stages ({len(ts)} rows, {t:.0f} us mean)")

    dense = one("dense", dims.dense_params(1) * 2)
    head = one("head", dims.vocab * dims.hidden * 2, lambda b: b == 1)
    embed = one("embed", 0.0)
    full = moe_table("K2.6")
    sh = []
    for (b, _ctx, s), rs in st.items():
        if s == "moe" and b == 1:
            for r in rs:
                E = r["extra"]["experts_touched"]
                sh.append(r["us"] - (full.fixed_us + E * full.stream_us))
    t = sum(sh) / len(sh)
    lt, eta = split_latency(t, dims.shared_params(1) * 2, read, ref.eta_lin)
    shared = Linear(lt, eta, f"decode_h200.json b1 moe stages less the MoE table's M=1 time ({len(sh)} rows)")
    return {"attention": attn, "dense": dense, "head": head, "embed": embed, "shared": shared}


def experts_touched(tokens: float, n_experts: int = 384, k: int = 8) -> float:
    """Expected distinct experts per layer for `tokens` tokens of k picks each, uniform routing."""
    if tokens <= 0:
        return 0.0
    return n_experts * (1.0 - (1.0 - k / n_experts) ** tokens)


@cache
def measured_union() -> dict:
    """(batch, budget) -> mean distinct experts per MoE layer in measured forwards (budget 0: AR step)."""
    out = {}
    for r in rows("round_h100.json"):
        ex = r.get("extra") or {}
        if isinstance(ex.get("experts_touched"), dict):
            v = list(ex["experts_touched"].values())
            out[(ex["batch"], ex["budget"])] = sum(v) / len(v)
    acc = {}
    for (b, _c, s), rs in decode_stage_rows().items():
        if s == "moe":
            acc.setdefault(b, []).extend(r["extra"]["experts_touched"] for r in rs)
    for b, v in acc.items():
        out[(b, 0)] = sum(v) / len(v)
    return out


@cache
def ep_slowest_rank(tokens: int, n_experts: int, k: int, ranks: int = 8, draws: int = 32):
    """(distinct experts, pairs) on the most loaded of `ranks` expert shards, uniform routing (seeded draws;
    a token's k picks drawn with replacement, which at k = 8 of 384 moves the counts by well under 1%)."""
    g = np.random.default_rng(tokens)
    per = n_experts // ranks
    worst_e, worst_p = [], []
    for _ in range(draws):
        picks = g.integers(0, n_experts, (tokens, k))
        hit = np.zeros(n_experts, np.int64)
        np.add.at(hit, picks.ravel(), 1)
        pairs = hit.reshape(ranks, per).sum(1)
        q = int(np.argmax(pairs))
        worst_p.append(pairs[q])
        worst_e.append(int((hit.reshape(ranks, per)[q] > 0).sum()))
    return float(np.mean(worst_e)), float(np.mean(worst_p))


def moe_terms(dims: Dims, dev: Device, m: int, opt: Options, experts=None):
    """(fixed, stream, compute) of one MoE layer at m rows on one rank; experts = measured union or None."""
    ref = reference()
    k = dims.top_k
    if opt.layout == "tp8" or opt.tp == 1:
        tab = moe_table("K2.6" if opt.tp == 1 else "TP8 shard")
        E = experts if experts is not None else experts_touched(m, dims.experts, k)
        pairs = m * k
    else:
        tab = moe_table("EP8 shard")
        E, pairs = ep_slowest_rank(int(m), dims.experts, k)
    E = max(E, 1e-9)
    r = pairs / E
    fixed = ref.launch_us if opt.fused else tab.fixed_us
    if opt.moe_stream_eta:
        stream = E * tab.expert_bytes / (dev.bw_gbs * 1e3 * opt.moe_stream_eta)
    else:
        stream = E * tab.stream_us * tab.read_gbs / dev.bw_gbs
    compute = E * tab.compute_at(r) * ref.matmul_tflops / dev.rate(opt.expert_precision)
    return fixed, stream, compute


def device_for(pf, ref_pf) -> Device:
    """A platform's effective read bandwidth and tensor rates: its datasheet figures times the fraction of
    them the reference H200 reached in this repository's ceiling measurements."""
    ref = reference()
    f_bw, f_mm = ref.read_gbs / (ref_pf.mem_tbs * 1e3), ref.matmul_tflops / ref_pf.bf16_tflops
    return Device(pf.name, pf.mem_tbs * 1e3 * f_bw,
                  {p: pf.rate(p) * f_mm for p in ("bf16", "fp8", "int8", "fp4")})


def measured_device(name: str, read_gbs: float, pf, ref_pf) -> Device:
    """A device measured in a benchmark file: its own read ceiling, datasheet rates at the reference's fraction."""
    f_mm = reference().matmul_tflops / ref_pf.bf16_tflops
    return Device(name, read_gbs, {p: pf.rate(p) * f_mm for p in ("bf16", "fp8", "int8", "fp4")})


def _add(t, key, v):
    t[key] = t.get(key, 0.0) + v


def _moved(t_ref_us, nbytes, ref_gbs, dev: Device):
    """A latency-bound kernel measured on the reference: its time plus the change in its bytes' read time."""
    return max(0.0, t_ref_us + nbytes / (dev.bw_gbs * 1e3) - nbytes / (ref_gbs * 1e3))


def mla_us(heads_rank: float, ctx, b, n, dev: Device, fused=False):
    """MLA core at `heads_rank` heads on one rank (table rows at 8 and 64 heads, linear in between)."""
    ref = reference()

    def at(h):
        tab = mla_table(h)
        t = tab.ref_us(ctx, b, n)
        by, fl = mla_bytes_flops(h, ctx, b, n)
        bound_ref = max(by / (tab.read_gbs * 1e3), fl / (tab.matmul_tflops * 1e6))
        bound_dev = max(by / (dev.bw_gbs * 1e3), fl / (dev.rate("bf16") * 1e6))
        lat = ref.launch_us if fused else tab.latency_us
        return lat + max(0.0, t - tab.latency_us) * bound_dev / bound_ref
    if heads_rank <= 8:
        return at(8) * heads_rank / 8 if heads_rank < 8 else at(8)
    return interp([8, 64], [at(8), at(64)], heads_rank)


def collective_us(pf, opt: Options, nbytes):
    kind = opt.collective
    if kind not in pf.collectives:
        raise ProjectionError(f"{pf.key}: no {kind!r} collective figure in platforms.yaml")
    return pf.collectives[kind].us(nbytes, opt.tp)


def forward(dims: Dims, pf, dev: Device, batch: int, nodes: int, ctx: int, opt: Options,
            experts=None) -> dict:
    """µs per term of one target forward on one rank: `nodes` rows per request (1 = AR step)."""
    fits, ref = stage_fits(), reference()
    tp = opt.tp
    m = batch * nodes
    t: dict = {}
    dp_attn = opt.layout == "ep8"
    a_tp = 1 if dp_attn else tp
    m_attn = (math.ceil(batch / tp) if dp_attn else batch) * nodes
    b_attn = math.ceil(batch / tp) if dp_attn else batch
    wa = dims.attn_params(a_tp) * dims.attn_bytes_per_param
    fa = 2 * dims.attn_params(a_tp)
    lat, work = fits["attention"].us(wa, fa, m_attn, dev, opt.fused)
    _add(t, "embed", ref.launch_us if opt.fused else fits["embed"].latency_us)
    _add(t, "attention latency", dims.layers * lat)
    _add(t, "attention weights", dims.layers * work)
    _add(t, "MLA core", dims.layers * mla_us(dims.heads / a_tp, ctx, b_attn, nodes, dev, opt.fused))
    lat, work = fits["dense"].us(dims.dense_params(tp) * 2, 2 * dims.dense_params(tp), m, dev, opt.fused)
    _add(t, "dense layer", dims.dense_layers * (lat + work))
    moe_layers = dims.layers - dims.dense_layers
    fixed, stream, compute = moe_terms(dims, dev, m, opt, experts)
    _add(t, "MoE fixed", moe_layers * fixed)
    _add(t, "MoE weight stream", moe_layers * stream)
    _add(t, "MoE compute", moe_layers * compute)
    lat, work = fits["shared"].us(dims.shared_params(tp) * 2, 2 * dims.shared_params(tp), m, dev, opt.fused)
    _add(t, "shared expert", moe_layers * (lat + work))
    hw = dims.vocab * dims.hidden / tp
    lat, work = fits["head"].us(hw * 2, 2 * hw, m, dev, opt.fused)
    _add(t, "lm_head + choose", lat + work + choose_us(m, dims.vocab / tp, dev))
    if tp > 1:
        msg = m * dims.hidden * 2
        n_ar = 2 * dims.layers + 2
        if dp_attn:  # all-to-all dispatch + combine per MoE layer, one all-reduce per dense layer, head gather
            n_ar = 2 * moe_layers + dims.dense_layers + 2
        _add(t, "collectives", n_ar * collective_us(pf, opt, msg))
    return t


def choose_us(m, vocab_rank, dev: Device):
    """argmax over m logit rows (bf16): blocks_h200's argmax [1, 163840] row carried by its bytes."""
    r = row("blocks_h200.json", "argmax bf16 [1, 163840]")
    return _moved(r["us"], m * vocab_rank * 2, ceiling("blocks_h200.json"), dev) if m * vocab_rank * 2 > r["bytes"] \
        else r["us"]


def tree_step_us(batch: int, budget: int, dev: Device) -> float:
    """top-k over the drafter's logits + tree build + accept (one CUDA graph) + commit, from tree_h200.json
    (batch and budget interpolated), each carried by its bytes; commit from round_h100.json's stage rows."""
    tr = tree_rows()
    read = ceiling("tree_h200.json")
    out = 0.0
    for kind in ("topk", "build+accept"):
        bs = sorted({b for k, b, _n in tr if k == kind})

        def at_b(b, kind=kind):
            ns = sorted(n for k, bb, n in tr if k == kind and bb == b)
            return interp(ns, [tr[(kind, b, n)] for n in ns], max(budget, 1))
        t = interp(bs, [at_b(b) for b in bs], batch)
        nbytes = batch * 7 * 163840 * 2 if kind == "topk" else 0.0
        out += _moved(t, nbytes, read, dev)
    return out + commit_us()


@cache
def commit_us() -> float:
    v = [r["us"] for r in rows("round_h100.json") if (r.get("extra") or {}).get("stage") == "commit"]
    if not v:
        raise ProjectionError("round_h100.json: no commit stage rows")
    return sum(v) / len(v)


@cache
def drafter_fits():
    """The DFlash drafter's forward and context extend, measured unsharded on the H100 (drafter_h100.json)."""
    d = drafter_rows()
    read = ceiling("drafter_h100.json")
    ref = reference()
    f = d["forward b1 ctx1024 (CUDA graph)"]
    head = k26_dims().vocab * DRAFTER["hidden"] * 2
    lat, eta = split_latency(f["us"], f["bytes"], read, ref.eta_lin)
    e = d["extend b1 rows5 (CUDA graph)"]
    elat, eeta = split_latency(e["us"], e["bytes"], read, ref.eta_lin)
    return {"forward": Linear(lat, eta, "drafter_h100.json forward b1 ctx1024"), "head_bytes": head,
            "extend": Linear(elat, eeta, "drafter_h100.json extend b1 rows5"), "extend_bytes": e["bytes"]}


def dflash_us(dims: Dims, pf, dev: Device, batch: int, opt: Options) -> float:
    """DFlash drafter per round on one rank at TP `opt.tp`: 6 layers over the block (batch x 8 rows) plus the
    context extend of the accepted rows; each layer pays the target attention block's measured latency
    (unsure: the drafter layer's own latency at TP8 is not measured yet); the target's lm_head for 7 rows.
    Its collectives are `dflash_collectives_us` (in the round's "collectives" term)."""
    fits, df, ref = stage_fits(), drafter_fits(), reference()
    tp, d = opt.tp, DRAFTER
    h, q, kv = d["hidden"], d["q_heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
    layer = (h * q + 2 * h * kv + q * h + 3 * h * d["inter"]) / tp
    rows_ = batch * d["block"]
    lat = ref.launch_us if opt.fused else fits["attention"].latency_us
    _l, work = df["forward"].us(d["layers"] * layer * 2, 2 * d["layers"] * layer, rows_, dev)
    t = d["layers"] * lat + work
    _l, ework = df["extend"].us(df["extend_bytes"] / tp, 0.0, 0, dev)
    t += (ref.launch_us if opt.fused else df["extend"].latency_us) + ework
    hw = dims.vocab * dims.hidden / tp
    hl, hwork = fits["head"].us(hw * 2, 2 * hw, batch * (d["block"] - 1), dev, opt.fused)
    return t + hl + hwork


def dflash_collectives_us(pf, batch: int, opt: Options) -> float:
    """The drafter's all-reduces per round at TP `opt.tp` (two per layer, the fc and the head's gather)."""
    if opt.tp == 1:
        return 0.0
    return (2 * DRAFTER["layers"] + 2) * collective_us(pf, opt, batch * DRAFTER["block"] * DRAFTER["hidden"] * 2)


def round_terms(dims: Dims, pf, dev: Device, batch: int, budget: int, ctx: int, opt: Options,
                experts=None) -> dict:
    """One DDTree round on one rank: drafter + tree step + the verify forward of 1 + budget rows per request."""
    t = forward(dims, pf, dev, batch, 1 + budget, ctx, opt, experts)
    t["drafter"] = dflash_us(dims, pf, dev, batch, opt)
    if opt.tp > 1:
        t["collectives"] = t.get("collectives", 0.0) + dflash_collectives_us(pf, batch, opt)
    t["tree step"] = tree_step_us(batch, budget, dev)
    return t
