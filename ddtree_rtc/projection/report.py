"""Everything `ddtree-rtc projection` prints, writes as JSON and renders into docs/hardware.md."""
from __future__ import annotations

from . import tau as taus
from .answer import BUDGETS, ENGINE, calibration, large_m, levers, project
from .inputs import moe_table, reference
from .model import TERMS, drafter_fits, stage_fits
from .node import node_points
from .platforms import ANSWER_PLATFORMS, load_platforms
from .selfcheck import TOLERANCE, end_to_end, selfcheck

PUBLISHED_POINTS = {  # (platform, concurrency, mode) -> (label, tok/s per user) marked on the plot
    ("rtx_pro_6000", 1, "ddtree"): ("SGLang DDTree 138.7", 138.7),
    ("rtx_pro_6000", 10, "ddtree"): ("SGLang DDTree 517/10", 51.7),
    ("rtx_pro_6000", 1, "ar"): ("vLLM AR 88.5-98.5", 93.5),
    ("h200", 1, "ar"): ("SGLang K2.5 AR 106.1", 106.1),
    ("b200", 1, "ar"): ("SGLang K2-Thinking 143", 143.0),
}


def sources() -> dict:
    ref = reference()
    s = {"reference device": ref.source}
    for name, fit in stage_fits().items():
        s[f"{name} stage"] = f"latency {fit.latency_us:.1f} us, stream at {fit.eta_mem:.0%} of read: {fit.source}"
    for cfg in ("K2.6", "TP8 shard", "EP8 shard"):
        s[f"MoE table {cfg}"] = moe_table(cfg).source
    s["MLA core"] = "attention_h200.json (8 and 64 heads; ctx 1k-64k, batch 1-32, nodes 1-64, interpolated)"
    s["tree step"] = "tree_h200.json top-k and build+accept (graph) rows; commit from round_h100.json"
    df = drafter_fits()
    s["drafter"] = f"{df['forward'].source} (stream at {df['forward'].eta_mem:.0%} of read); {df['extend'].source}"
    nf = node_points()
    s["node"] = (f"{', '.join(nf.used)}: {len(nf.points)} measured points (bench node, per-rank time at 61 layers)"
                 if nf.used else "no benchmarks/node_<device>.json from a GPU yet: per-rank times built from the "
                                 "slice's stages (decode/round JSON)")
    s["node"] += "".join(f"; left out {f}: {why}" for f, why in nf.left_out)
    return s


def build(platform_keys=None, tau=None, ctx=4096) -> dict:
    tau = tau or taus.published()
    return {"tau_source": tau.source, "context": ctx, "engine": vars(ENGINE), "budgets_tried": list(BUDGETS),
            "inputs": sources(), "selfcheck": selfcheck(), "end_to_end": end_to_end(),
            "platforms": project(platform_keys, tau, ctx), "levers": levers(platform_keys, tau, ctx),
            "large_m": large_m(platform_keys, tau, ctx),
            "calibration": calibration(tau, ctx)}


def headline(d: dict) -> str:
    p = d["platforms"]
    if not {"rtx_pro_6000", "b300"} <= set(p):
        return ""
    pro, b3 = p["rtx_pro_6000"], p["b300"]
    b2 = p.get("b200")
    lv = d["levers"]["rows"]
    top = [r for r in lv if (r["gain"].get("b300 c1") or 0) > 1.01][:3]
    dd = lambda r, c: r[f"c{c}"]["ddtree"]  # noqa: E731
    ar = lambda r, c: r[f"c{c}"]["ar"]["tok_s_user"]  # noqa: E731
    same = b2 is not None and abs(dd(b2, 1)["tok_s_user"] / dd(b3, 1)["tok_s_user"] - 1) < 0.02
    txt = (f"**The B300 answer.** 8x PRO 6000 has 1.79 TB/s per GPU (14.3 TB/s in all); 8x B300 has 8 TB/s "
           f"per GPU (64 TB/s), 4.5x the bandwidth. With this repository's measured kernels, K2.6 on 8x B300 "
           f"decodes AR at {ar(b3, 1):.0f} tok/s per user at concurrency 1 (PRO 6000: {ar(pro, 1):.0f}) and DDTree at "
           f"{dd(b3, 1)['tok_s_user']:.0f} ({dd(b3, 1)['tok_s_user_band'][0]:.0f}-"
           f"{dd(b3, 1)['tok_s_user_band'][1]:.0f}, "
           f"budget {dd(b3, 1)['budget']}; PRO 6000: {dd(pro, 1)['tok_s_user']:.0f}), "
           f"{dd(b3, 1)['tok_s_user'] / dd(pro, 1)['tok_s_user']:.1f}x; at concurrency 10, "
           f"{dd(b3, 10)['tok_s_user']:.0f} against {dd(pro, 10)['tok_s_user']:.0f} tok/s per user "
           f"({dd(b3, 10)['tok_s_user'] / dd(pro, 10)['tok_s_user']:.1f}x). Bandwidth alone buys less than 4.5x "
           f"because the per-kernel latencies and the all-reduces do not shrink with HBM")
    txt += (". B300 projects the same as B200 today (same 8 TB/s HBM, bf16 MMA in the INT4 expert GEMM); "
            if same else ". ")
    if top:
        txt += "the next phases that pay on B300, each re-run through the model: " + "; ".join(
            f"{r['lever']} x{r['gain']['b300 c1']:.2f} at c=1 / x{(r['gain'].get('b300 c10') or 0):.2f} at c=10"
            for r in top) + "."
    return txt


METHOD = """## How the model works

`ddtree-rtc projection` (code: `ddtree_rtc/projection/`; platform facts with a source per number:
`ddtree_rtc/projection/platforms.yaml`) builds one rank of K2.6 at TP8 term by term from this repository's
committed measurements (`benchmarks/*.json`, read through `projection/data.py: benchmark_path`):

- **Linear stages** (attention projections, dense layer 0, shared expert, lm_head, drafter): a latency plus
  `max(weights / (bandwidth * eta_mem), rows * flops / (rate * eta_mm))`. The latency and eta_mem come from
  the slice's measured stage (`decode_h200.json`), eta_mm from the M=1024 GEMM (`blocks_h200.json`).
- **MoE**: a table over (experts touched, rows per expert) from `moe_h200.json` (full, TP8-shard and EP8-shard
  configs). It has a fixed part and a per-expert weight stream, both from the M=1..8 rows, plus a per-expert
  compute part at r rows per expert, read off the larger rows. The stream scales with bandwidth, the compute
  with the tensor rate of the MMA the expert GEMM uses (bf16 today; fp4 or int8 as levers). Nothing is fitted
  across regimes.
- **Experts touched**: measured verifies where present (`round_h100.json`, `decode_h200.json`), else the
  uniform formula `384(1-(1-8/384)^M)`; the slowest EP rank by seeded draws.
- **MLA core**: `attention_h200.json`, interpolated. Its smallest time is latency; the rest scales by the
  roofline bound.
- **Tree step**: `tree_h200.json` top-k and build+accept (CUDA graph) rows. Commit comes from `round_h100.json`.
- **Collectives**: per platform alpha/beta (NCCL eager, NCCL in graphs, one-shot, NVLS). There are two
  all-reduces per layer at TP8; EP8 with data-parallel attention uses all-to-all.
- **tau**: the published chain acceptance of z-lab's Kimi-K2.5-DFlash, or the oracle profile, or `--tau-from`
  a run JSON. It is bounded by `min(budget + 1, depth + 1)`. The DDTree band runs from the chain (no gain) to
  the oracle tree at the chain's acceptance, capped at +35%.
- **Per-rank time from `bench node`** (`projection/node.py` reads its JSON): where
  `benchmarks/node_<device>.json` was measured on a GPU of `platforms.yaml` (its `device` field; the numpy
  backend's files are left out), the measured per-rank AR step or round at 61 layers (collective latency
  excluded, the drafter's forward included) over the model of the same case on that GPU gives a ratio. Every
  modelled term but the collectives is multiplied by it. The case is taken from the platform's own GPU's file,
  else the H200's, else any GPU's; at the nearest batch, budget and context; with the small-M path off for the
  engine as modelled and on for the fused-layer lever (where only one was measured, it stands for both).

A time measured on the reference H200 carries to another GPU as follows. Latencies stay unchanged, memory parts
scale by read bandwidth, and compute parts by tensor rate, each taken as the datasheet figure times the fraction
the H200 reached here.

The self-check below applies the same code to the measured 3-layer slice on its own device: one dense layer, two
MoE layers, the unsharded head and 64 heads on one GPU. `tests/test_projection.py` fails if any AR step or round
is off by more than 15%. The stage rows of `decode_h200.json` are themselves inputs, so its step rows only check
how the stages compose. From `round_h100.json`, a different GPU, the model takes only each round's own expert
counts and the commit stage's time; its steps and rounds are predictions.
"""


def page(d: dict) -> str:
    """docs/hardware.md: the question, its answer in numbers, the method, then the tables of `markdown`."""
    return ("# Hardware projection: K2.6 on 8x RTX PRO 6000, H200, B200, B300\n\n"
            "> \"We have 1900 GB/s per GPU, times 8 ... Anything / next phases for HBM/NVLink B300?\"\n\n"
            + markdown(d) .replace("## Inputs and their sources", METHOD + "\n## Inputs and their sources", 1)
            + "\nGenerated by `ddtree-rtc projection --markdown docs/hardware.md` (add `--json F`, `--plot F.png`; "
              "`pip install 'ddtree-rtc[plot]'` for the plot).\n")


def _fmt(v, nd=0):
    return "n/a" if v is None else f"{v:.{nd}f}"


def markdown(d: dict) -> str:
    out = []
    h = headline(d)
    if h:
        out += [h, ""]
    out += ["## Inputs and their sources", "", "| input | value and source |", "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in d["inputs"].items()]
    out += [f"| tau | {d['tau_source']} |", f"| context | {d['context']} tokens |",
            f"| engine | {d['engine']['layout']}, collectives {d['engine']['collective']}, W4A16 experts (bf16 MMA) |",
            "", f"## Self-check: the measured slice, predicted from the tables (tolerance {TOLERANCE:.0%})", "",
            "| file | case | measured us | predicted us | ratio |", "|---|---|---|---|---|"]
    out += [f"| {r['file']} | {r['case']} | {r['measured_us']:.0f} | {r['predicted_us']:.0f} | {r['ratio']:.2f}"
            f"{'' if r['within'] else ' (outside)'} |" for r in d["selfcheck"]]
    out += ["", "## End to end: the engine's host share, which the projection leaves out", "",
            "The engine's measured step or round (k2_6_slice_*.json: wall time of the decode stages per step, host "
            "work included; DDTree runs use the oracle drafter, which drafts on the host) beside the modelled GPU "
            "time of the same forward. The projection below is GPU time, as replayed from CUDA graphs.", "",
            "| run | layers | batch | budget | measured ms | model GPU ms | host ms |", "|---|---|---|---|---|---|---|"]
    out += [f"| {r['run']} | {r['layers']} | {r['batch']} | {r['budget'] or 'AR'} | {r['measured_ms']:.2f} | "
            f"{r['model_gpu_ms']:.2f} | {r['host_ms']:.2f} |" for r in d["end_to_end"]]
    p = d["platforms"]
    for c in (1, 10):
        out += ["", f"## Per-token time split, concurrency {c} (us per token per user)", ""]
        cols = [(k, m) for k in p for m in ("ar", "ddtree")]
        heads = [f"{k} {'AR' if m == 'ar' else 'DDTree b' + str(p[k][f'c{c}']['ddtree']['budget'])}" for k, m in cols]
        out.append("| term | " + " | ".join(heads) + " |")
        out.append("|---" * (len(cols) + 1) + "|")
        for term in TERMS:
            out.append(f"| {term} | " + " | ".join(
                _fmt(p[k][f"c{c}"][m]["split_us_per_token"].get(term, 0.0)) for k, m in cols) + " |")
        out.append("| **total** | " + " | ".join(
            _fmt(sum(p[k][f"c{c}"][m]["split_us_per_token"].values())) for k, m in cols) + " |")
        out.append("| tok/s per user | " + " | ".join(
            _fmt(p[k][f"c{c}"][m]["tok_s_user"], 1) for k, m in cols) + " |")
        out.append("| tau (band) | " + " | ".join(
            "1" if m == "ar" else "{:.2f} ({:.2f}-{:.2f})".format(p[k][f"c{c}"]["ddtree"]["tau"],
                                                                 *p[k][f"c{c}"]["ddtree"]["tau_band"])
            for k, m in cols) + " |")
        out.append("| DDTree tok/s band | " + " | ".join(
            "" if m == "ar" else "{:.0f}-{:.0f}".format(*p[k][f"c{c}"]["ddtree"]["tok_s_user_band"])
            for k, m in cols) + " |")
    lm = d["large_m"]
    out += ["", f"## Large M: one DDTree round at concurrency {lm['batch']}, budget {lm['budget']} "
                f"({lm['rows']} verify rows)", "",
            "MoE stream and compute per round (us) and the round, with the expert GEMM on bf16 MMA (W4A16, "
            "today), NVFP4 MMA and int8 MMA (W4A8).", "",
            "| platform | MoE stream | MoE compute bf16 / fp4 / int8 | round ms bf16 / fp4 / int8 |",
            "|---|---|---|---|"]
    for k, rec in lm["platforms"].items():
        cells = [rec[x] for x in ("bf16", "fp4", "int8")]
        out.append(f"| {k} | {rec['bf16']['moe_stream_us']:.0f} | "
                   + " / ".join("n/a" if c is None else f"{c['moe_compute_us']:.0f}" for c in cells) + " | "
                   + " / ".join("n/a" if c is None else f"{c['round_us'] / 1e3:.1f}" for c in cells) + " |")
    lv = d["levers"]
    keys = list(lv["rows"][0]["gain"])
    out += ["", f"## Levers (DDTree tok/s per user with one input changed / without; ranked by {lv['ranked_by']})",
            "", "| lever | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for r in lv["rows"]:
        out.append(f"| {r['lever']} | " + " | ".join(
            "n/a" if r["gain"][k] is None else f"x{r['gain'][k]:.2f}" for k in keys) + " |")
    out += ["", "## Calibration: predicted / published", "",
            "| published figure | predicted | published | ratio | within 35% | inputs missing or unsure |",
            "|---|---|---|---|---|---|"]
    for r in d["calibration"]:
        pub = r["published"]
        pubs = f"{pub[0]:g}" if pub[0] == pub[1] else f"{pub[0]:g}-{pub[1]:g}"
        band = "" if not r["predicted_band"] else " ({:.0f}-{:.0f})".format(*r["predicted_band"])
        out.append(f"| {r['figure']} | {r['predicted']:.1f}{band} | {pubs} | {r['ratio']:.2f} | "
                   f"{'yes' if r['within_35pct'] else 'NO'} | {'; '.join(r['inputs_unsure'])} |")
    return "\n".join(out) + "\n"


def plot(d: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'ddtree-rtc[plot]'") from None
    p = d["platforms"]
    fig, axes = plt.subplots(1, 2, figsize=(14, 6))
    colors = plt.get_cmap("tab20").colors
    for ax, c in zip(axes, (1, 10)):
        labels, bars, marks = [], [], []
        for k in [k for k in ANSWER_PLATFORMS if k in p] or list(p):
            for m in ("ar", "ddtree"):
                rec = p[k][f"c{c}"][m]
                labels.append(f"{k}\n{'AR' if m == 'ar' else 'DDTree b' + str(rec['budget'])}")
                bars.append(rec["split_us_per_token"])
                pt = PUBLISHED_POINTS.get((k, c, m))
                marks.append(None if pt is None else (pt[0], 1e6 / pt[1]))
        bottom = [0.0] * len(bars)
        for i, term in enumerate(TERMS):
            vals = [b.get(term, 0.0) / 1e3 for b in bars]
            ax.bar(range(len(bars)), vals, bottom=bottom, label=term, color=colors[i % len(colors)])
            bottom = [x + v for x, v in zip(bottom, vals)]
        for i, mk in enumerate(marks):
            if mk:
                ax.plot(i, mk[1] / 1e3, "k*", markersize=12)
                ax.annotate(mk[0], (i, mk[1] / 1e3), fontsize=7, xytext=(4, 4), textcoords="offset points")
        ax.set_xticks(range(len(bars)), labels, fontsize=7)
        ax.set_ylabel("ms per token per user")
        ax.set_title(f"K2.6, 8 GPUs, concurrency {c} (stars: published)")
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def platforms_listing() -> str:
    return ", ".join(load_platforms())
