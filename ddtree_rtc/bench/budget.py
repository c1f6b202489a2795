"""The cost-aware budget (``decode.budget: auto``) against fixed budgets, chain and autoregressive
decoding, on a pipeline's model and workload, at several concurrencies.

The model is loaded once (and the oracle's continuations decoded once); per (concurrency, setting) a
fresh engine (its CUDA graphs captured when it starts: ``graphs_at_start``) runs the workload twice: a
warm-up pass of ``--warmup-tokens`` per request (auto without ``decode.cost_table`` times its verify
buckets here) and the timed pass. Reported per row: tok/s per user (each request's tokens after the
first over the time they took, averaged), total tok/s, tau, and for auto the nodes it chose, its
predicted vs measured tau and tokens per modelled verify second; and the host's microseconds per engine
step in each stage of the engine's StageClock (where a setting's round time goes on the host), with the
CUDA graphs captured in the timed pass (0: the start captured every shape the setting can reach). Per
concurrency: auto over the best and the worst fixed budget (chain included), the issue's targets being
>= 1.0x and >= 1.15x. ``auto`` is ``decode.budget_choice: lagged`` (each round's counts from the past
rounds: no sync between the build and the verify); ``auto-tree`` chooses from the round's own tree
(a host round trip there), for comparison (``auto_over_auto_tree``); ``auto-any`` is ``auto`` with
``decode.auto_rows: any``: under row-invariant scheduling its verify may leave the 64 rows of the
small-M path for the general kernels, as a fixed budget over 63 does (``auto_any_over_best``). Each auto
row keeps the cost table it chose by (``cost_model``: the warm-up's measured buckets) and its row cap."""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

from ..engine.engine import Engine
from ..engine.request import Request
from .harness import stamp

SETTINGS = ("autoregressive", "chain", "8", "16", "32", "64", "auto", "auto-any")
AUTO = {"auto": "lagged", "auto-tree": "tree", "auto-any": "lagged"}  # setting -> decode.budget_choice
AUTO_ROWS = {"auto-any": "any"}  # setting -> decode.auto_rows (else the pipeline's)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="ddtree-rtc bench budget", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pipeline", default="pipelines/k2_6_slice_ddtree_h200.yaml",
                    help="a ddtree pipeline (model, drafter, workload)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="pipeline overrides, as `run --set` (repeatable)")
    ap.add_argument("--concurrency", default="1,4,10", help="requests decoded at once (comma-separated)")
    ap.add_argument("--settings", default=",".join(SETTINGS),
                    help="autoregressive, chain, a fixed budget, auto or auto-tree (comma-separated)")
    ap.add_argument("--max-budget", type=int, default=None, help="auto's max_budget (default: decode.max_budget)")
    ap.add_argument("--warmup-tokens", type=int, default=16, help="tokens per request in the untimed pass")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    try:
        args.concurrency = tuple(int(c) for c in args.concurrency.split(","))
    except ValueError:
        ap.error(f"--concurrency: expected comma-separated integers, got {args.concurrency!r}")
    args.settings = tuple(s.strip() for s in args.settings.split(","))
    bad = [s for s in args.settings if s not in ("autoregressive", "chain", *AUTO) and not s.isdigit()]
    if bad or any(c < 1 for c in args.concurrency) or args.warmup_tokens < 2:
        ap.error(f"--settings: unknown {bad}" if bad else "--concurrency must be >= 1, --warmup-tokens >= 2")
    return args


def engine_for(pipe, model, drafter, setting: str, concurrency: int, max_budget: int, cost) -> Engine:
    d, rt = pipe.decode, pipe.runtime
    mode = setting if setting in ("autoregressive", "chain") else "ddtree"
    budget = "auto" if setting in AUTO else (int(setting) if setting.isdigit() else d.drafter.depth)
    return Engine(model, max_batch=concurrency, page_size=rt.page_size, max_context=rt.max_context,
                  seed=d.seed, cuda_graphs=rt.cuda_graphs, mode=mode,
                  drafter=None if mode == "autoregressive" else drafter, budget=budget, max_budget=max_budget,
                  cost=cost if setting in AUTO else None, budget_choice=AUTO.get(setting, "lagged"),
                  auto_rows=AUTO_ROWS.get(setting, d.auto_rows) if setting in AUTO else "invariant")


def run_once(engine: Engine, prompts, new: int, pipe) -> dict:
    d = pipe.decode
    reqs = [Request(i, p, new, temperature=d.temperature, top_p=d.top_p) for i, p in enumerate(prompts)]
    stages, steps, captures = dict(engine.stats.stage_seconds), engine.stats.steps, engine.runner.captures
    t0 = time.perf_counter()
    done = engine.run(reqs)
    wall = time.perf_counter() - t0
    steps = max(engine.stats.steps - steps, 1)
    per_user = [(len(r.output) - 1) / (r.t_done - r.t_first) for r in done
                if len(r.output) > 1 and r.t_done > r.t_first]
    gen = sum(len(r.output) for r in done)
    out = {"tok_s": gen / wall, "tok_s_per_user": statistics.mean(per_user) if per_user else None,
           "wall_s": wall, "outputs": [r.output for r in done],
           # host seconds per engine step (one round per group) in each stage, no device sync but the
           # stages' own: 'budget' holds auto-tree's wait for the build, 'commit' the round's last sync
           "stage_us_per_step": {k: (v - stages.get(k, 0.0)) / steps * 1e6
                                 for k, v in engine.stats.stage_seconds.items()},
           "wall_us_per_step": wall / steps * 1e6,
           "graph_captures": engine.runner.captures - captures}  # in this pass (the warm-up's are not timed)
    rnd = engine.round
    if rnd is not None:
        out["tau"] = rnd.stats.tau
        if rnd.auto is not None:
            out["budget"] = {**rnd.auto.stats.summary(), "max_rows": rnd.auto.max_rows,
                             "cost_model": rnd.auto.cost.to_json(),
                             "verify_scale": {str(b): v for b, v in rnd.auto.cost.verify_scales().items()}}
    return out


def main(argv=None) -> dict:
    from ..engine.decode.budget import CostModel
    from ..pipeline.runner import build_engine, load_prompts, model_config, model_dir, ranks_for
    from ..pipeline.schema import load_pipeline, parse_set_options

    args = parse_args(argv)
    pipe = load_pipeline(args.pipeline, parse_set_options(tuple(args.overrides)))
    if pipe.decode.mode == "autoregressive":
        raise SystemExit(f"{args.pipeline}: needs decode.mode ddtree or chain and its decode.drafter")
    ranks = ranks_for(pipe)
    directory = model_dir(pipe, ranks)
    prompts = load_prompts(pipe, model_config(pipe, directory).vocab_size, directory)
    w = pipe.workload
    new = w.synthetic.output_len if w.synthetic is not None else w.max_new_tokens
    base, _ = build_engine(pipe, max_batch=1, prompts=prompts, ranks=ranks)  # the model and the drafter
    model, drafter = base.model, base.drafter
    del base
    max_budget = args.max_budget or pipe.decode.max_budget
    given = CostModel.load(pipe.decode.cost_table) if pipe.decode.cost_table else None
    rows = []
    for c in args.concurrency:
        for s in args.settings:
            cost = None if given is None else CostModel.from_dict(given.to_json(), source=given.source)
            eng = engine_for(pipe, model, drafter, s, c, max_budget, cost)
            run_once(eng, prompts, min(args.warmup_tokens, new), pipe)
            eng.scheduler.finished.clear()
            r = run_once(eng, prompts, new, pipe)
            r.update(concurrency=c, setting=s, graphs_at_start=eng.warm_up, min_rows=eng.decoder.min_rows,
                     invariant=eng.verify_invariant)
            rows.append(r)
            print(f"c{c} {s}: {r['tok_s_per_user'] or 0:.1f} tok/s per user, {r['tok_s']:.1f} tok/s"
                  + (f", tau {r['tau']:.2f}" if r.get("tau") else ""), flush=True)
            del eng
            gc.collect()  # the last engine's graph pools and cache go before the next one measures free memory
    summary = summarize(rows)
    print_table(rows, summary)
    doc = {**stamp(), "pipeline": args.pipeline, "overrides": args.overrides, "max_budget": max_budget,
           "rows": [{k: v for k, v in r.items() if k != "outputs"} for r in rows], "summary": summary,
           "same_ids_as_autoregressive": same_ids(rows)}
    if args.json:
        from pathlib import Path

        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return doc


def summarize(rows) -> dict:
    """Per concurrency: auto's tok/s per user over the best and the worst fixed budget or chain, and
    over the best of those whose verify stays on the row-invariant path (``invariant``: ids equal to
    AR's by construction on a GPU; a budget over 63 leaves it, as the engine warns)."""
    out = {}
    for c in sorted({r["concurrency"] for r in rows}):
        fixed = {r["setting"]: r["tok_s_per_user"] for r in rows
                 if r["concurrency"] == c and r["setting"] not in (*AUTO, "autoregressive") and r["tok_s_per_user"]}
        inv = {r["setting"]: r["tok_s_per_user"] for r in rows
               if r["concurrency"] == c and r["setting"] in fixed and r.get("invariant")}
        auto = next((r["tok_s_per_user"] for r in rows if r["concurrency"] == c and r["setting"] == "auto"), None)
        tree = next((r["tok_s_per_user"] for r in rows if r["concurrency"] == c and r["setting"] == "auto-tree"), None)
        free = next((r["tok_s_per_user"] for r in rows if r["concurrency"] == c and r["setting"] == "auto-any"), None)
        ar = next((r["tok_s_per_user"] for r in rows if r["concurrency"] == c and r["setting"] == "autoregressive"),
                  None)
        if not fixed or auto is None:
            continue
        best, worst = max(fixed, key=fixed.get), min(fixed, key=fixed.get)
        out[str(c)] = {"auto": auto, "best_fixed": best, "best": fixed[best], "worst_fixed": worst,
                       "worst": fixed[worst], "auto_over_best": auto / fixed[best],
                       "auto_over_worst": auto / fixed[worst], "auto_over_ar": auto / ar if ar else None,
                       "auto_over_auto_tree": auto / tree if tree else None,
                       "auto_any": free, "auto_any_over_best": free / fixed[best] if free else None,
                       "auto_any_over_worst": free / fixed[worst] if free else None}
        if inv:
            bi = max(inv, key=inv.get)
            out[str(c)].update(best_invariant_fixed=bi, best_invariant=inv[bi], auto_over_best_invariant=auto / inv[bi])
    return out


def same_ids(rows) -> dict:
    """Per concurrency: whether every setting's outputs equal autoregressive decoding's (T = 0)."""
    out = {}
    for c in sorted({r["concurrency"] for r in rows}):
        ar = next((r["outputs"] for r in rows if r["concurrency"] == c and r["setting"] == "autoregressive"), None)
        if ar is not None:
            out[str(c)] = {r["setting"]: r["outputs"] == ar for r in rows if r["concurrency"] == c}
    return out


def print_table(rows, summary) -> None:
    print("\nhost µs per engine step by stage (no syncs but the stages' own: auto-tree's 'budget' waits for the build, "
          "'commit' for the round)")
    for r in rows:
        st = r.get("stage_us_per_step") or {}
        print(f"c{r['concurrency']} {r['setting']}: step {r.get('wall_us_per_step', 0):.0f}, "
              f"{r.get('graph_captures', 0)} graphs captured ({(r.get('graphs_at_start') or {}).get('graphs', 0)} "
              f"at the start) | "
              + ", ".join(f"{k} {v:.0f}" for k, v in sorted(st.items(), key=lambda kv: -kv[1]) if v >= 1))
    print("\nconcurrency | setting | tok/s per user | total tok/s | tau | auto: nodes (most chosen), tau pred / meas, "
          "verify scale")
    for r in rows:
        b = r.get("budget")
        extra = ""
        if b:
            top = sorted(b["nodes_hist"].items(), key=lambda kv: -kv[1])[:3]
            scale = (b.get("verify_scale") or {}).get(str(r["concurrency"]))
            extra = (f"{', '.join(f'{k}x{v}' for k, v in top)}; {b['tau_predicted'] or 0:.2f} / "
                     f"{b['tau_measured'] or 0:.2f}" + (f"; {scale:.2f}" if scale is not None else ""))
        tau = f"{r['tau']:.2f}" if r.get("tau") else "-"
        print(f"{r['concurrency']} | {r['setting']} | {r['tok_s_per_user'] or 0:.1f} | {r['tok_s']:.1f} | "
              f"{tau} | {extra}")
    for c, s in summary.items():
        print(f"c{c}: auto {s['auto']:.1f} tok/s per user = {s['auto_over_best']:.3f}x best fixed ({s['best_fixed']}, "
              f"{s['best']:.1f}), {s['auto_over_worst']:.3f}x worst ({s['worst_fixed']}, {s['worst']:.1f})"
              + (f", {s['auto_over_ar']:.3f}x AR" if s["auto_over_ar"] else "")
              + (f", {s['auto_over_auto_tree']:.3f}x auto-tree" if s.get("auto_over_auto_tree") else "")
              + (f"; auto-any {s['auto_any']:.1f} = {s['auto_any_over_best']:.3f}x best, "
                 f"{s['auto_any_over_worst']:.3f}x worst" if s.get("auto_any") else "")
              + (f"; {s['auto_over_best_invariant']:.3f}x the best on the row-invariant path "
                 f"({s['best_invariant_fixed']}, {s['best_invariant']:.1f})"
                 if s.get("best_invariant_fixed") and s["best_invariant_fixed"] != s["best_fixed"] else ""))
