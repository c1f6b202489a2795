"""Host time of ``decode.budget: auto``'s per-round work (the StageClock's "budget" stage) on the CPU.

Drives the real policy objects (engine/decode/budget.py ``AutoBudget``, engine/decode/auto.py
``AutoRound`` on the numpy backend) through many lagged rounds in the order of
``SpeculativeRound._run_auto`` (engine/decode/round.py): the next round's ``choose_lagged`` and the
last round's learning (``tree_paths``, ``class_accepted``, ``AutoBudget.learn``) while the device
would verify, ``read_tree`` after the round's sync, ``stage_cut`` / ``apply_cut`` around the build,
``choose_lagged`` at the round's start only when the precomputed choice does not apply. The trees
are the oracle drafter's at K2.6's vocabulary (p 0.77, depth 7, max_budget 64: raw path
probabilities as the pipeline's), one per request, the walk drawn from the oracle's law; the cost
table is the H100's c1 step shape, measured (``observe_times`` updates the draft and other seconds
every round, as the warm-up's table does on CUDA); verify rows capped at 64 (row-invariant).

Prints µs per round of each function at each batch size (median over ``--reps`` runs of the mean
per round) and, with ``--json``, writes the same rows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree_rtc.backend import Backend  # noqa: E402
from ddtree_rtc.bench.budget_sim import OracleSim, h100_c1_cost  # noqa: E402
from ddtree_rtc.engine.decode.auto import AutoRound  # noqa: E402
from ddtree_rtc.engine.decode.budget import AutoBudget, CostModel, class_accepted, tree_paths  # noqa: E402


def h100_cost() -> CostModel:
    """budget_sim's H100 c1 step table, measured as a warm-up's is (draft and other work learned)."""
    return h100_c1_cost(draft=((1, 1.2e-3),), fixed=((1, 0.4e-3),), measured=True, source="warm-up")


class Timer:
    def __init__(self):
        self.us: dict = {}

    def __call__(self, name, fn, *a):
        t0 = time.perf_counter()
        out = fn(*a)
        self.us[name] = self.us.get(name, 0.0) + (time.perf_counter() - t0) * 1e6
        return out


def run(batch: int, rounds: int, p: float, vocab: int, max_budget: int, depth: int, seed: int):
    """µs per round by function, and the choices made (counts, rows) per round."""
    sims = [OracleSim(p=p, vocab=vocab, depth=depth, max_budget=max_budget, seed=seed + i) for i in range(batch)]
    reached = [s.reached(rounds) for s in sims]
    n = max_budget + 1
    scores = np.full((batch, n), np.nan, np.float32)
    parents = np.full((batch, n), -1, np.int32)
    for i, s in enumerate(sims):
        k = len(s.depth)
        scores[i, :k] = s.tree.scores[0, :k]
        parents[i, :k] = s.parent
    be = Backend("numpy", quiet=True)
    auto = AutoBudget(max_budget, depth, h100_cost(), bucketed=True, max_rows=64, lagged=True)
    ar = AutoRound(auto, be, None)
    rids = list(range(batch))
    caps = np.minimum(np.full(batch, max_budget), auto.top_rows(batch) - batch).astype(np.int64)
    t = Timer()
    made, pending, nxt, start_choices = [], None, None, 0
    for r in range(rounds):
        tree = types.SimpleNamespace(scores=scores.copy(), parents=parents.copy(),
                                     num_nodes=np.array([len(s.depth) for s in sims], np.int32))
        ctx = 1000.0 + r * 4
        drafted = auto.should_draft(rids)
        lag = own = None
        if drafted:
            if pending is not None and not auto.history.ready():
                learn(t, auto, pending)
                pending = None
            if nxt is not None and not any(auto.probing(x) for x in rids):
                lag = nxt
            else:
                lag = t("choose_lagged (start)", auto.choose_lagged, rids, caps, ctx)
                start_choices += 1
        nxt = None
        if lag is not None:
            choice = lag
            cut = t("stage_cut", ar.stage_cut, batch, choice.counts)
            t("apply_cut", ar.apply_cut, tree, cut)
        elif drafted:
            values, raw, dep, off, weights = t("estimate", ar.estimate, tree, rids)
            choice = auto.choose(values, caps, ctx, weights)
            own = (raw, dep, off)
        else:
            auto.skipped(rids)
            choice = auto.ar_choice(batch, ctx)
        made.append((choice.counts.tolist(), choice.rows))
        # the verify: learn the last round, choose the next
        if pending is not None:
            learn(t, auto, pending)
            pending = None
        if drafted and auto.history.ready():
            nxt = t("choose_lagged (overlap)", auto.choose_lagged, rids, caps, ctx)
        acc = np.array([int(reached[i][r, : int(choice.counts[i]) + 1].sum()) for i in range(batch)], np.int64)
        accepted = np.zeros((batch, depth + 1), np.int64)
        for i in range(batch):
            got = np.flatnonzero(reached[i][r, : int(choice.counts[i]) + 1])
            accepted[i, : len(got)] = got
        raw = par = None
        if lag is not None:
            raw, par = t("read_tree", ar.read_tree, tree)
            dep = off = None
        elif own is not None:
            raw, dep, off = own
        auto.hold(rids, choice, drafted)
        pending = (rids, raw, None if lag is not None else dep, choice, acc, drafted,
                   None if lag is not None else off, accepted, par)
        t("observe_times", ar.observe_times, batch, None, 7e-3, choice, lag is not None)
    if pending is not None:
        learn(t, auto, pending)
    return {k: v / rounds for k, v in t.us.items()}, made, start_choices


def learn(t, auto, pending) -> None:
    """round.py ``_learn_pending``, its parts timed apart."""
    rids, raw, depth, choice, accept_len, drafted, classes, accepted, parents = pending
    if parents is not None:
        depth, classes = t("learn: tree_paths", tree_paths, parents)
    off_acc = None if classes is None else t("learn: class_accepted", class_accepted, classes, accepted, accept_len)
    t("learn: AutoBudget.learn", auto.learn, rids, raw, depth, choice, accept_len, drafted, classes, off_acc)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,4,10", help="batch sizes (comma-separated; default 1,4,10)")
    ap.add_argument("--rounds", type=int, default=300, help="rounds per run (default 300)")
    ap.add_argument("--reps", type=int, default=3, help="runs per batch size; the median is reported (default 3)")
    ap.add_argument("--p", type=float, default=0.77, help="the oracle's top-1 acceptance (default 0.77)")
    ap.add_argument("--vocab", type=int, default=163840, help="the drafter's vocabulary (default K2.6's)")
    ap.add_argument("--max-budget", type=int, default=64)
    ap.add_argument("--depth", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the rows here as JSON")
    a = ap.parse_args(argv)
    rows = []
    for b in (int(x) for x in a.batches.split(",")):
        runs = [run(b, a.rounds, a.p, a.vocab, a.max_budget, a.depth, a.seed) for _ in range(a.reps)]
        names = sorted({k for r in runs for k in r[0]})
        per = {k: float(np.median([r[0].get(k, 0.0) for r in runs])) for k in names}
        stage = sum(v for k, v in per.items() if k != "observe_times")
        counts = runs[0][1]
        print(f"batch {b}: budget stage {stage:.1f} µs/round ({a.rounds} rounds, start-of-round choices "
              f"{runs[0][2]}, mean nodes {np.mean([sum(c) for c, _ in counts]):.1f}, "
              f"rows {sorted({r for _, r in counts})})")
        for k in names:
            print(f"  {k:28s} {per[k]:8.1f}")
        rows.append({"batch": b, "rounds": a.rounds, "stage_us": stage, "us": per, "start_choices": runs[0][2]})
    if a.json:
        a.json.write_text(json.dumps({"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
