"""The answer: per-token splits per platform, the levers (each a re-run with one input changed) and the
calibration against published figures."""
from __future__ import annotations

from dataclasses import replace
from functools import cache

from . import tau as taus
from .data import ProjectionError
from .inputs import reference
from .model import (
    R1_DIMS,
    Linear,
    Options,
    collective_us,
    commit_us,
    device_for,
    forward,
    k26_dims,
    measured_device,
    measured_union,
    round_terms,
    stage_fits,
)
from .node import pick_point
from .platforms import ANSWER_PLATFORMS, load_platforms, pick

BUDGETS = (4, 8, 16, 24, 32, 48, 64, 96, 128)
FIXED_BUDGET = 64   # pipelines/k2_6_tp8.yaml's budget: the cost-aware lever's baseline
CONCURRENCY = (1, 10)
ENGINE = Options(layout="tp8", collective="nccl_graph")


def experts_for(batch, budget):
    """Measured distinct experts per layer where a verify (or AR step) of this shape was measured."""
    v = measured_union().get((batch, budget))
    if v is None:
        return None, "uniform formula 384(1-(1-8/384)^M) (fallback: no measured verify of this shape)"
    src = "round_h100.json" if budget else "decode_h200.json"
    return v, f"measured in {src} (random-weight slice, bench routing): {v:.0f} per layer"


@cache
def node_scale(pf, opt: Options, batch: int, budget: int, ctx: int):
    """(measured / modelled per-rank time, its source) at the `bench node` point node.pick_point chooses
    for this platform, or (1, None) without one; a layout that was not measured takes the TP8 point's
    ratio (so a lever changing the layout compares like with like). The modelled collectives are left
    out: the measurement has none of their latency (its collectives are stand-ins, one device copy of
    each message, whose copy time stays in the measured time), and the projection adds its own per
    platform. The model of the point runs on the file's GPU (its read ceiling, its datasheet rates) with
    the engine's W4A16 experts, the case's own expert counts and `opt.fused`: where only the other
    small-M setting was measured, its time stands for this one's (a measured engine, not the ratio to
    the idealised fused model carried over). A round without a measured drafter leaves the drafter out."""
    want = "on" if opt.fused else "off"
    p = pick_point(pf.key, opt.layout, budget == 0, want, batch, budget, ctx) or \
        pick_point(pf.key, ENGINE.layout, budget == 0, want, batch, budget, ctx)
    if p is None:
        return 1.0, None
    pfs = load_platforms()
    mpf = pfs[p.platform]
    dev = measured_device(p.device, p.read_gbs, mpf, pfs["h200"])
    mopt = replace(ENGINE, layout=p.layout, fused=opt.fused)
    if p.budget == 0:
        t = forward(k26_dims(), mpf, dev, p.batch, 1, p.ctx, mopt, p.experts)
    else:
        t = round_terms(k26_dims(), mpf, dev, p.batch, p.budget, p.ctx, mopt, p.experts)
        if not p.drafter:
            t.pop("drafter")
    model = sum(v for k, v in t.items() if k != "collectives")
    s = p.rank_us / model
    carried = "" if p.small_m == want else f" (standing for small-M {want}: not measured)"
    carried += "" if p.layout == opt.layout else f" (carried to {opt.layout}: no point of that layout)"
    return s, f"{p.label()}: measured {p.rank_us:.0f} us / model {model:.0f} us = {s:.2f}{carried}"


def _scaled(t, s):
    return {k: (v if k == "collectives" else v * s) for k, v in t.items()}


def ar_point(pf, dev, batch, ctx, opt, dims=None):
    dims = dims or k26_dims()
    E, esrc = experts_for(batch, 0) if dims is not None and dims.experts == 384 else (None, "uniform formula")
    t = forward(dims, pf, dev, batch, 1, ctx, opt, E)
    s, nsrc = node_scale(pf, opt, batch, 0, ctx) if dims.name == "Kimi K2.6" else (1.0, None)
    t = _scaled(t, s)
    us = sum(t.values())
    return {"us": us, "tok_s_user": 1e6 / us, "split_us_per_token": t, "experts": esrc, "node": nsrc}


def ddtree_point(pf, dev, batch, ctx, opt, tau, budgets=BUDGETS):
    best = None
    for b in tau.budgets(budgets):
        E, esrc = experts_for(batch, b)
        t = round_terms(k26_dims(), pf, dev, batch, b, ctx, opt, E)
        s, nsrc = node_scale(pf, opt, batch, b, ctx)
        t = _scaled(t, s)
        us = sum(t.values())
        lo, hi = tau.band(b)
        mid = (lo + hi) / 2
        rec = {"budget": b, "us": us, "tau": mid, "tau_band": [lo, hi], "tok_s_user": mid * 1e6 / us,
               "tok_s_user_band": [lo * 1e6 / us, hi * 1e6 / us],
               "split_us_per_token": {k: v / mid for k, v in t.items()}, "experts": esrc, "node": nsrc}
        if best is None or rec["tok_s_user"] > best["tok_s_user"]:
            best = rec
    return best


def project(platform_keys=None, tau=None, ctx=4096, opt=ENGINE):
    pfs = load_platforms()
    ref_pf = pfs["h200"]
    tau = tau or taus.published()
    out = {}
    for pf in pick(pfs, platform_keys or ANSWER_PLATFORMS):
        dev = device_for(pf, ref_pf)
        rec = {"name": pf.name, "bw_gbs_effective": dev.bw_gbs, "unsure": list(pf.unsure)}
        for c in CONCURRENCY:
            ar = ar_point(pf, dev, c, ctx, opt)
            dd = ddtree_point(pf, dev, c, ctx, opt, tau)
            rec[f"c{c}"] = {"ar": ar, "ddtree": dd, "speedup": dd["tok_s_user"] / ar["tok_s_user"]}
        out[pf.key] = rec
    return out


def levers(platform_keys=None, tau=None, ctx=4096):
    """Each lever re-runs the DDTree point (budget re-chosen) with one input changed; gain = tok/s ratio."""
    pfs = load_platforms()
    ref_pf = pfs["h200"]
    tau = tau or taus.published()
    changes = [
        ("fused layer (small-M path): every per-kernel latency at one graph launch", dict(fused=True)),
        ("one-shot all-reduce instead of NCCL in graphs", dict(collective="oneshot")),
        ("NVLS all-reduce (NVLink SHARP)", dict(collective="nvls")),
        ("MoE weight stream at 85% of read (design target) instead of the measured table", dict(moe_stream_eta=0.85)),
        ("TP attention + EP8 experts instead of TP8 experts", dict(layout="tp_attn_ep_moe")),
        ("EP8 with data-parallel attention instead of TP8", dict(layout="ep8")),
        ("FP4 experts (NVFP4 MMA) instead of W4A16 bf16 MMA", dict(expert_precision="fp4")),
        ("W4A8 int8-MMA experts instead of W4A16 bf16 MMA", dict(expert_precision="int8")),
    ]
    chosen = pick(pfs, platform_keys or ANSWER_PLATFORMS)
    devs = {pf.key: device_for(pf, ref_pf) for pf in chosen}
    base = {(pf.key, c): ddtree_point(pf, devs[pf.key], c, ctx, ENGINE, tau)["tok_s_user"]
            for pf in chosen for c in CONCURRENCY}
    rows = []
    for label, kw in changes:
        r = {"lever": label, "change": {k: v for k, v in kw.items()}, "gain": {}}
        for pf in chosen:
            dev = devs[pf.key]
            for c in CONCURRENCY:
                try:
                    new = ddtree_point(pf, dev, c, ctx, replace(ENGINE, **kw), tau)["tok_s_user"]
                    r["gain"][f"{pf.key} c{c}"] = new / base[(pf.key, c)]
                except ProjectionError as e:
                    r["gain"][f"{pf.key} c{c}"] = None
                    r.setdefault("not_applicable", {})[pf.key] = str(e)
        rows.append(r)
    r = {"lever": f"cost-aware budget: the best budget instead of a fixed {FIXED_BUDGET} (pipelines/k2_6_tp8.yaml)",
         "change": {"budget": "best"}, "gain": {}}
    for pf in chosen:
        for c in CONCURRENCY:
            fixed = ddtree_point(pf, devs[pf.key], c, ctx, ENGINE, tau, budgets=(FIXED_BUDGET,)) \
                if tau.budget is None else None
            r["gain"][f"{pf.key} c{c}"] = base[(pf.key, c)] / fixed["tok_s_user"] if fixed else None
    rows.append(r)
    key = "b300 c1" if "b300 c1" in rows[0]["gain"] else next(iter(rows[0]["gain"]))
    rows.sort(key=lambda r: -(r["gain"].get(key) or 0))
    return {"ranked_by": key, "rows": rows}


def large_m(platform_keys=None, tau=None, ctx=4096, batch=10, budget=64):
    """The compute-bound corner: a DDTree round at concurrency 10, budget 64 (650 verify rows), with the
    expert GEMM on bf16 MMA (W4A16, today), NVFP4 MMA and int8 MMA (W4A8)."""
    pfs = load_platforms()
    ref_pf = pfs["h200"]
    tau = tau or taus.published()
    lo, hi = tau.band(budget) if tau.budget in (None, budget) else (None, None)
    out = {}
    for pf in pick(pfs, platform_keys or ANSWER_PLATFORMS):
        dev = device_for(pf, ref_pf)
        rec = {}
        for prec in ("bf16", "fp4", "int8"):
            try:
                t = round_terms(k26_dims(), pf, dev, batch, budget, ctx, replace(ENGINE, expert_precision=prec))
            except ProjectionError:
                rec[prec] = None
                continue
            us = sum(t.values())
            rec[prec] = {"round_us": us, "moe_compute_us": t["MoE compute"], "moe_stream_us": t["MoE weight stream"],
                         "tok_s_user": None if lo is None else (lo + hi) / 2 * 1e6 / us}
        out[pf.key] = rec
    return {"batch": batch, "budget": budget, "rows": batch * (budget + 1), "platforms": out}


# -- calibration --------------------------------------------------------------------------------------

EAGLE3 = dict(params=1.8e9, steps=3, tau=2.62,
              source="nvidia/Kimi-K2.6-Eagle3 model card: 1.8e9 parameters, draft length 3, acceptance length "
                     "2.62 (MT-Bench)")
MTP3 = dict(steps=3, tau=2.82, source="NVIDIA TensorRT-LLM DeepSeek-R1 B200 min-latency blog: MTP 3, "
                                      "acceptance 2.82, 253 tok/s/user (AR 111)")


def chain_point(dims, pf, dev, ctx, opt, tau, steps, drafter_us):
    t = forward(dims, pf, dev, 1, steps + 1, ctx, opt)
    t["drafter"] = drafter_us
    t["tree step"] = commit_us() + reference().launch_us * 2
    us = sum(t.values())
    return tau * 1e6 / us, t


def eagle3_drafter_us(pf, dev, opt):
    fit = stage_fits()["attention"]
    w = EAGLE3["params"] * 2 / opt.tp
    step = sum(Linear(fit.latency_us, fit.eta_mem, fit.source).us(w, 2 * EAGLE3["params"] / opt.tp, 1, dev, opt.fused))
    return EAGLE3["steps"] * (step + 2 * collective_us(pf, opt, 7168 * 2))


def mtp_drafter_us(pf, dev, ctx, opt):
    one = replace(R1_DIMS, layers=1, dense_layers=0)
    return MTP3["steps"] * sum(forward(one, pf, dev, 1, 1, ctx, replace(opt, expert_precision="fp4")).values())


def calibration(tau=None, ctx=4096):
    pfs = load_platforms()
    ref_pf = pfs["h200"]
    tau = tau or taus.published()
    pro, h200, b200 = pfs["rtx_pro_6000"], pfs["h200"], pfs["b200"]
    dpro, dh, db = (device_for(p, ref_pf) for p in (pro, h200, b200))
    pcie = Options(collective="nccl_graph")       # custom all-reduce needs NVLink: NCCL on PCIe
    nvl = Options(collective="oneshot")            # SGLang / vLLM / TRT-LLM use a one-shot all-reduce on NVLink
    out = []

    def add(figure, predicted, published, unsure, band=None):
        lo, hi = (published, published) if not isinstance(published, tuple) else published
        mid = (lo + hi) / 2
        ratio = predicted / mid
        within = abs(ratio - 1) <= 0.35 or (band is not None and band[0] <= hi * 1.35 and band[1] >= lo / 1.35)
        out.append({"figure": figure, "predicted": predicted, "predicted_band": band, "published": [lo, hi],
                    "ratio": ratio, "within_35pct": within, "inputs_unsure": unsure})

    def plat_unsure(pf, opt):
        """The platform's unsure figures this point uses: bandwidth, the bf16 and expert-MMA rates, its collective."""
        used = {"mem_tbs", "bf16_tflops", {"bf16": "bf16_tflops", "fp4": "fp4_tflops", "fp8": "fp8_tflops",
                                           "int8": "int8_tops"}[opt.expert_precision], f"collectives.{opt.collective}"}
        return [f"{pf.key}.{k}" for k in pf.unsure if k in used]

    dd1 = ddtree_point(pro, dpro, 1, ctx, pcie, tau)
    dd10 = ddtree_point(pro, dpro, 10, ctx, pcie, tau)
    tau_unsure = [f"tau: the SGLang run's dataset is not published; {tau.kind} tau used"]
    add("PRO 6000 SGLang DDTree c=1 (tok/s/user)", dd1["tok_s_user"], 138.7,
        plat_unsure(pro, pcie) + tau_unsure + ["SGLang's kernels (modelled with this repository's)"],
        dd1["tok_s_user_band"])
    add("PRO 6000 SGLang DDTree c=10 (tok/s total)", 10 * dd10["tok_s_user"], 517.0,
        plat_unsure(pro, pcie) + tau_unsure + ["SGLang's kernels (modelled with this repository's)"],
        [10 * x for x in dd10["tok_s_user_band"]])
    ar = ar_point(pro, dpro, 1, ctx, pcie)
    add("PRO 6000 vLLM K2.6 AR c=1 (tok/s)", ar["tok_s_user"], (88.5, 98.5),
        plat_unsure(pro, pcie) + ["vLLM's kernels (modelled with this repository's)"])
    e3, _ = chain_point(k26_dims(), pro, dpro, ctx, pcie, EAGLE3["tau"], EAGLE3["steps"],
                        eagle3_drafter_us(pro, dpro, pcie))
    add("PRO 6000 vLLM K2.6 EAGLE-3 k=3 c=1 (tok/s)", e3, (114.0, 144.0),
        plat_unsure(pro, pcie) + [f"EAGLE-3 acceptance {EAGLE3['tau']} ({EAGLE3['source']}); the published "
                                  "run's own acceptance is not given", "EAGLE-3 drafter latency per step "
                                  "(the attention block's measured latency assumed)"])
    ar = ar_point(h200, dh, 1, ctx, nvl)
    add("H200 SGLang K2.5 AR c=1 (tok/s)", ar["tok_s_user"], 106.1, plat_unsure(h200, nvl))
    ar = ar_point(b200, db, 1, ctx, nvl)
    add("B200 SGLang K2-Thinking INT4 AR bs1 (tok/s)", ar["tok_s_user"], 143.0,
        plat_unsure(b200, nvl) + ["B200 kernel latencies (the H200's measured latencies carried unchanged)"])
    r1 = replace(nvl, expert_precision="fp4")
    ar = ar_point(b200, db, 1, ctx, r1, R1_DIMS)
    add("B200 TRT-LLM DeepSeek-R1 FP4 AR c=1 (tok/s)", ar["tok_s_user"], 111.0,
        plat_unsure(b200, r1) + [R1_DIMS.source, "TRT-LLM's fused kernels (modelled with this repository's)"])
    mtp, _ = chain_point(R1_DIMS, b200, db, ctx, r1, MTP3["tau"], MTP3["steps"], mtp_drafter_us(b200, db, ctx, r1))
    add("B200 TRT-LLM DeepSeek-R1 FP4 MTP3 c=1 (tok/s)", mtp, 253.0,
        plat_unsure(b200, r1) + [R1_DIMS.source, MTP3["source"]])
    return out

