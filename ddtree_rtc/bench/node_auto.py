"""``bench node``'s auto row: ``decode.budget: auto`` (the engine's default choice, lagged) simulated
on one case's own measured costs, beside the fixed budgets and the chain the case measured.

This is a simulation of the policy, not an engine run: the real ``AutoBudget`` chooses each
round's node counts over ``budget_sim``'s oracle rounds (the bench's oracle profile, --accept-p),
and each round is priced on a ``CostModel`` made from the case's projected figures at one
collective latency (``case_cost``): a fixed setting's verify point is its projected round
(``round_total_us``: rank time at 61 layers, drafter, collective latency x calls) less the
round's other work and the draft; the AR step's projected time is the verify of the roots alone
(0 nodes). Row counts between the measured points are priced by the cost model's linear
interpolation (not measured). The engine's row rules are kept: CUDA graphs (``bucketed``: the
verify rows come in row buckets) and, with batch_invariant on the small-M path, at most
SMALL_M_MAX_TOKENS verify rows a round (``max_rows``), as engine/engine.py builds its AutoBudget;
auto is then also simulated without that cap (``auto_uncapped``), since the bench's fixed budgets
verify a batch's rows in one round whatever their count (the engine, row-invariant, would split a
batch whose fixed-budget rows pass the cap into groups, which the bench does not time).

Every fixed setting is simulated on the same rounds and the same cost model, so auto is compared
like with like: a fixed setting's simulated round is its projected round exactly, and its exact
tau (the oracle law's expected tokens of its cut, no sampling noise) is the bench's ``tau_oracle``;
auto's exact tau is the same expectation over the cuts it made. The ratios use those (exact); the
sampled figures (the simulated walk's tokens) are given beside them."""

from __future__ import annotations

import statistics
import time

from ..engine.decode.budget import CostModel
from ..model.target import SMALL_M_MAX_TOKENS
from .budget_sim import MAX, OracleSim, run_oracle

ROUNDS = 300  # simulated rounds per setting (seconds of CPU per case)


def setting_name(rd: dict) -> str:
    return "chain" if rd["chain"] else f"b{rd['budget']}"


def setting_nodes(rd: dict, depth: int) -> int:
    return depth if rd["chain"] else int(rd["budget"])


def case_cost(case: dict, entry: dict, depth: int) -> CostModel:
    """The cost model of one case at one projection entry (one collective latency), from the case's
    own figures through ``CostModel.from_dict``'s flat rows: the round's other work (the round graph
    less its verify stage, the mean over the case's rounds, at least 0), the draft (the drafter's
    forward and its collectives' latency), and a verify point per measured setting (rows = batch x
    (1 + nodes)) and for the AR step (rows = batch) such that fixed + draft + verify is the setting's
    projected round, and fixed + verify the AR step's projected time. How the round splits into
    other work and verify moves no simulated figure (the other work is one constant per case); the
    floor at 0 is there because a queued verify stage that overflowed the launch queue (host-bound)
    reads longer than the whole round's graph."""
    b, ctx = case["batch"], case["ctx"]
    fixed_us = statistics.mean(max(0.0, rd["round_us"] - rd["stage_us"]["verify"]) for rd in case["rounds"])
    drafter_calls = case.get("drafter_collectives", {}).get("calls", 0)
    draft_us = case.get("drafter_us", 0.0) + entry["collective_us"] * drafter_calls
    rows = [{"batch": b, "budget": 0, "verify_us": max(0.0, entry["ar"]["per_token_us"] - fixed_us), "ctx": ctx,
             "fixed_us": fixed_us}]
    for rd in entry["rounds"]:
        rows.append({"batch": b, "budget": setting_nodes(rd, depth), "verify_us":
                     max(0.0, rd["round_total_us"] - fixed_us - draft_us), "fixed_us": fixed_us, "ctx": ctx})
    cost = CostModel.from_dict({"rows": rows}, source=f"bench node {case['layout']} sm-{case['small_m']} b{b} "
                                                       f"ctx{ctx}, {entry['collective_us']:g} µs collectives")
    cost.set_overheads(b, draft_s=draft_us * 1e-6)
    return cost


def auto_row(case: dict, args, vocab: int, invariant: bool, depth: int, rounds: int = ROUNDS) -> dict:
    """The case's auto row (see the module doc): per projection entry, auto and every measured
    setting simulated over ``rounds`` rounds of ``batch`` oracle requests at ``args.accept_p``."""
    t0 = time.perf_counter()
    b = case["batch"]
    nodes = [setting_nodes(rd, depth) for rd in case["rounds"]]
    max_budget = min(MAX, max(nodes))  # the engine's default max_budget, no further than a measured point
    max_rows = SMALL_M_MAX_TOKENS if invariant else None
    # the tree at 64 nodes at least, so that it holds the top-1 path (the chain) whole
    tree_nodes = max(MAX, *nodes)
    proto = [OracleSim(p=args.accept_p, seed=i, vocab=vocab, depth=depth, max_budget=tree_nodes) for i in range(b)]
    out = {"rounds": rounds, "requests": b, "accept_p": args.accept_p, "max_budget": max_budget,
           "max_rows": max_rows, "bucketed": True, "choice": "lagged",
           "note": "simulated: the AutoBudget policy over oracle rounds priced on this case's projected costs "
                   "(bench/node_auto.py), not an engine run; tau and tok/s exact (the oracle law's expectation "
                   "of the cuts made), *_sampled from the simulated walk",
           "projection": []}
    for entry in case["projection"]:
        cost = case_cost(case, entry, depth)
        tok, sec, _, _, auto, exact = run_oracle([s.fresh() for s in proto], rounds, cost=cost, bucketed=True,
                                                 lagged=True, max_budget=max_budget, max_rows=max_rows)
        tok, sec, exact = float(tok), float(sec), float(exact)
        st = auto.stats.summary()
        row = {"collective_us": entry["collective_us"], "cost_model": cost.to_json(),
               "auto": {"tau": exact / (b * rounds), "tau_sampled": tok / (b * rounds),
                        "tokens_per_round": exact / rounds,
                        "us_per_round": 1e6 * sec / rounds, "tok_s_per_user": exact / b / sec,
                        "tok_s_per_user_sampled": tok / b / sec, "nodes_hist": st["nodes_hist"],
                        "rows_hist": st["rows_hist"], "drafted_rounds": st["drafted_rounds"],
                        "skipped_drafts": st["skipped_drafts"], "tau_predicted": st["tau_predicted"],
                        "tau_measured": st["tau_measured"]},
               "settings": []}
        for rd in entry["rounds"]:
            k = "chain" if rd["chain"] else int(rd["budget"])
            tok_k, sec_k, *_, exact_k = run_oracle([s.fresh() for s in proto], rounds, budget=k, cost=cost)
            tok_k, sec_k, exact_k = float(tok_k), float(sec_k), float(exact_k)
            row["settings"].append({
                "setting": setting_name(rd), "budget": rd["budget"], "chain": rd["chain"],
                "tau": exact_k / (b * rounds), "tau_sampled": tok_k / (b * rounds), "tau_oracle": rd["tau_oracle"],
                "us_per_round": 1e6 * sec_k / rounds, "round_total_us": rd["round_total_us"],
                "tok_s_per_user": exact_k / b / sec_k, "tok_s_per_user_sampled": tok_k / b / sec_k,
                "tok_s_per_user_oracle": rd["tok_s_per_user_oracle"]})
        if row["settings"]:
            a = row["auto"]
            best = max(row["settings"], key=lambda s: s["tok_s_per_user"])
            worst = min(row["settings"], key=lambda s: s["tok_s_per_user"])
            chain = next((s for s in row["settings"] if s["chain"]), None)
            row.update(best=best["setting"], worst=worst["setting"],
                       auto_over_best=a["tok_s_per_user"] / best["tok_s_per_user"],
                       auto_over_worst=a["tok_s_per_user"] / worst["tok_s_per_user"],
                       auto_over_chain=None if chain is None else a["tok_s_per_user"] / chain["tok_s_per_user"],
                       auto_over_best_sampled=a["tok_s_per_user_sampled"] / max(
                           s["tok_s_per_user_sampled"] for s in row["settings"]))
            if max_rows is not None:  # what the row cap costs auto here: the same rounds without it
                _, sec_u, _, _, auto_u, exact_u = run_oracle([s.fresh() for s in proto], rounds, cost=cost,
                                                             bucketed=True, lagged=True, max_budget=max_budget)
                sec_u, exact_u = float(sec_u), float(exact_u)
                row["auto_uncapped"] = {"tau": exact_u / (b * rounds), "us_per_round": 1e6 * sec_u / rounds,
                                        "tok_s_per_user": exact_u / b / sec_u,
                                        "auto_over_best": exact_u / b / sec_u / best["tok_s_per_user"],
                                        "nodes_hist": auto_u.stats.summary()["nodes_hist"]}
        out["projection"].append(row)
    out["sim_s"] = time.perf_counter() - t0
    return out


def summary_line(auto: dict) -> str:
    """One printed line: auto at the first collective latency, its ratios at every one."""
    if not auto or not auto["projection"]:
        return "auto: -"
    p = auto["projection"][0]
    a = p["auto"]
    hist = ", ".join(f"{k}: {v}" for k, v in a["nodes_hist"].items())
    ratios = "; ".join(f"{q['collective_us']:g} µs {q['auto']['tok_s_per_user']:.0f} tok/s per user, "
                       f"{q['auto_over_best']:.3f}x best ({q['best']}), {q['auto_over_worst']:.3f}x worst "
                       f"({q['worst']})" + ("" if q["auto_over_chain"] is None else
                                            f", {q['auto_over_chain']:.3f}x chain")
                       + ("" if "auto_uncapped" not in q else
                          f" (no row cap: {q['auto_uncapped']['auto_over_best']:.3f}x best)")
                       for q in auto["projection"] if "best" in q)
    return (f"auto (simulated on this case's costs, {auto['rounds']} rounds, max_budget {auto['max_budget']}"
            + (f", <= {auto['max_rows']} rows" if auto["max_rows"] else "") + f"; {p['collective_us']:g} µs): "
            f"tau {a['tau']:.2f}, {a['us_per_round']:.0f} µs/round, nodes per request-round {{{hist}}} | {ratios}")

