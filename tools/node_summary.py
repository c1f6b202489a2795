"""The README's node table from a `ddtree-rtc bench node` JSON (benchmarks/node_<device>.json): per case
(layout, batch, context, small-M path), the rank's AR time per token at 61 layers against its byte floor,
the per-layer split (attention block, MoE layer, head, collectives), the best DDTree round's tok/s per
user and the auto row's (decode.budget auto simulated on the case's measured costs), on the device named
in the file. Markdown on stdout; no GPU needed:

    python tools/node_summary.py benchmarks/node_h100.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

FULL_LAYERS = 61
LAYOUT_NAMES = {"tp": "TP8", "ep": "TP-attn + EP8-MoE"}


def ar_floor_61(ar: dict, layers: int) -> float:
    """The AR step's byte floor at 61 layers: ``floor_us_61``, or in files written before that key the
    made layers' stage floors, embed and head, + the mean MoE layer's (attention + MoE) per missing layer."""
    if "floor_us_61" in ar:
        return float(ar["floor_us_61"])
    per = ar["per_layer"].values()
    made = sum(s["floor_us"] for v in per for s in v.values())
    moe = [v["attention"]["floor_us"] + v["moe"]["floor_us"] for v in per if "moe" in v]
    ends = sum(ar["mean_stage_floor_us"].get(k, 0.0) for k in ("embed", "head"))
    return made + ends + (FULL_LAYERS - layers) * (sum(moe) / len(moe) if moe else 0.0)


def _rank_us(case: dict) -> float:
    ar = case["ar"]
    return float(ar["rank_us"]) if "rank_us" in ar else float(case["projection"][0]["ar"]["rank_us"])


def _f(v, nd=0) -> str:
    return "-" if v is None else f"{v:,.{nd}f}"


def auto_cell(case: dict) -> str:
    """The auto row's figures at each collective latency (bench/node_auto.py: decode.budget auto
    simulated on the case's measured costs, not an engine run), or "-" (files before it, or none)."""
    auto = case.get("auto")
    cells = [f"{p['collective_us']:g} µs: {_f(p['auto']['tok_s_per_user'])} ({p['auto_over_best']:.2f}× {p['best']} / "
             f"{p['auto_over_worst']:.2f}× {p['worst']})" for p in (auto or {}).get("projection", []) if "best" in p]
    return "; ".join(cells) or "-"


def table(doc: dict, name: str = "") -> str:
    """The markdown: one heading line naming the device, the commit and the date, then one row per case."""
    try:
        summ = doc["summary"]
        layouts = summ["layouts"]
    except (KeyError, TypeError):
        raise SystemExit(f"{name or 'the file'}: no summary.layouts: not a `bench node` JSON") from None
    lats = list(summ.get("collective_us") or [])
    device = doc.get("device", "an unnamed device")
    gpu = doc.get("backend", "cuda") == "cuda"
    made = sorted({lay["layers"] for lay in layouts})
    presets = sorted({lay.get("preset", "k2.6") for lay in layouts}) or ["k2.6"]
    model = "K2.6" if presets == ["k2.6"] else "preset " + ", ".join(presets)
    out = [f"{model} at {FULL_LAYERS} layers as one simulated rank of {layouts[0]['world'] if layouts else '?'}, "
           f"measured on **{device}**" + ("" if gpu else " (the numpy backend: not a GPU measurement)")
           + f" by `ddtree-rtc bench node` (commit {doc.get('commit', '?')}, {doc.get('date', '?')}"
           + (f"; {name}" if name else "") + "). "
           + (f"Layers made: {', '.join(map(str, made))} of {FULL_LAYERS}, the rest scaled by the graph per layer. "
              if made != [FULL_LAYERS] else "")
           + "Per-rank times (CUDA graph) exclude collective latency; the collectives column is the calls per "
             "token times each assumed latency (" + " / ".join(f"{v:g} µs" for v in lats)
           + f"; {summ.get('collective_source', 'source not given')}). tau: the oracle profile's expected tau.", ""]
    heads = ["layout", "batch", "ctx", "small-M", "AR µs/token (rank, 61 layers)", "byte floor µs", "x floor",
             "attention µs/layer (floor)", "MoE µs/layer (floor)", "head µs", "collectives per token",
             f"best DDTree round at {lats[0]:g} µs collectives: budget, tau, µs/token" if lats else
             "best DDTree round", "tok/s per user AR → DDTree",
             "auto (simulated on the case's costs): tok/s per user, × best / × worst fixed"]
    out += ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for lay in layouts:
        for c in lay["cases"]:
            ar = c["ar"]
            rank = _rank_us(c)
            floor = ar_floor_61(ar, c["layers"])
            st, fl = ar.get("mean_stage_us", {}), ar.get("mean_stage_floor_us", {})
            proj = c.get("projection") or []
            calls = proj[0]["ar"]["collective_calls"] if proj else None
            coll = "-" if calls is None else f"{calls} x " + " / ".join(
                f"{p['collective_us']:g} = {_f(p['ar']['collective_total_us'])}" for p in proj) + " µs"
            best = [max(p["rounds"], key=lambda r: r["tok_s_per_user_oracle"], default=None) for p in proj]
            b0 = best[0] if best else None
            btxt = "-" if b0 is None else (f"{'chain' if b0['chain'] else b0['budget']}, {b0['tau_oracle']:.2f}, "
                                           f"{_f(b0['per_token_us_oracle'])}")
            tok = "; ".join(f"{p['collective_us']:g} µs: {_f(p['ar']['tok_s_per_user'])} → "
                            + ("-" if b is None else _f(b["tok_s_per_user_oracle"]))
                            for p, b in zip(proj, best)) or "-"
            out.append("| " + " | ".join([
                LAYOUT_NAMES.get(lay["layout"], lay["layout"]), str(c["batch"]), f"{c['ctx'] // 1024}k"
                if c["ctx"] >= 1024 else str(c["ctx"]), c["small_m"], _f(rank), _f(floor),
                f"{rank / floor:.1f}" if floor else "-",
                f"{_f(st.get('attention'), 1)} ({_f(fl.get('attention'), 1)})",
                f"{_f(st.get('moe'), 1)} ({_f(fl.get('moe'), 1)})", _f(ar.get("head_us"), 1), coll, btxt, tok,
                auto_cell(c)]) + " |")
    return "\n".join(out) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", help="a `ddtree-rtc bench node --json` file (benchmarks/node_<device>.json)")
    args = ap.parse_args(argv)
    p = Path(args.json)
    try:
        doc = json.loads(p.read_text())
    except OSError as e:
        raise SystemExit(f"{p}: cannot read: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise SystemExit(f"{p}: not JSON: {e}") from None
    sys.stdout.write(table(doc, str(p)))


if __name__ == "__main__":
    main()
