"""The auto budget's host work made faster (issue 39) chooses exactly as before: every round's counts,
rows, modelled seconds, predicted tokens and the values and weights they came from, bit for bit,
against tests/_budget_reference.py (main's engine/decode/budget.py before the change, kept verbatim as
this test's oracle), in the simulator (batches and profiles, lagged and not, a measured cost model)
and in the engine on the numpy backend."""

import sys
from pathlib import Path

import numpy as np
import pytest

from ddtree_rtc.bench import budget_sim
from ddtree_rtc.bench.budget_sim import OracleSim, SwitchSim
from ddtree_rtc.engine.decode import budget

sys.path.insert(0, str(Path(__file__).parent))
import _budget_reference as reference  # noqa: E402

PROFILES = {"p0.9": dict(p=0.9), "p0.7": dict(p=0.7), "p0.4": dict(p=0.4),
            "falling": dict(table=(0.95, 0.9, 0.8, 0.6, 0.4, 0.3, 0.2)), "under": dict(p=0.77, vocab=163840)}


FAST = budget.AutoBudget


def recording(module, log):
    """``module``'s AutoBudget that logs every choice (its values and weights) and every learned round."""

    class Recorded(FAST if module is budget else module.AutoBudget):
        def choose(self, values, caps, ctx, weights=None):
            c = super().choose(values, caps, ctx, weights)
            log.append(("choose", np.array(values), None if weights is None else np.array(weights[0]),
                        None if weights is None else np.array(weights[1]), c.counts.copy(), c.rows,
                        np.array(c.expected), c.seconds, c.verify_s, c.verify_model_s))
            return c

        def learn(self, rids, raw, node_depth, choice, accept_len, drafted, classes=None, off_accepted=None):
            super().learn(rids, raw, node_depth, choice, accept_len, drafted, classes, off_accepted)
            log.append(("learn", list(rids), np.array(choice.counts), choice.rows, np.array(choice.expected)))

    return Recorded


def same(got, want):
    assert len(got) == len(want) and len(want) > 10
    for i, (g, w) in enumerate(zip(got, want)):
        assert g[0] == w[0], i
        for a, b in zip(g[1:], w[1:]):
            if isinstance(b, np.ndarray) or isinstance(a, np.ndarray):
                assert np.array_equal(a, b), (i, g[0], a, b)  # bit-equal floats, not close
            else:
                assert a == b, (i, g[0], a, b)


def sim_log(module, monkeypatch, sims, rounds, cost, **kw):
    log, choices = [], []
    monkeypatch.setattr(budget_sim, "AutoBudget", recording(module, log))
    cost = module.CostModel.from_dict(cost.to_json())
    if cost.verify and kw.pop("measured", False):
        cost.measured = True
    out = budget_sim.run_oracle(sims, rounds, cost=cost, choices=choices, **kw)
    return log, choices, out[:2]


def moe(module=budget):
    return module.CostModel.fanout(base_s=4e-3, row_s=2e-6, expert_s=60 * 7.5e-6, draft_s=2e-3, fixed_s=1e-3)


CASES = {
    "b1": lambda: [OracleSim(**PROFILES["under"], seed=3)],
    "b4-mixed": lambda: [OracleSim(**PROFILES[n], seed=20 + i)
                         for i, n in enumerate(["p0.9", "p0.7", "p0.4", "falling"])],
    "b10": lambda: [OracleSim(**PROFILES[n], seed=30 + i) for i, n in enumerate(sorted(PROFILES) * 2)],
    "b3-switch": lambda: [SwitchSim([OracleSim(p=0.9, seed=30 + i), OracleSim(p=0.4, seed=40 + i)], 120, 0.9, seed=i)
                          for i in range(3)],
}


@pytest.mark.parametrize("lagged", [True, False])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_simulators_rounds_choose_as_the_reference(monkeypatch, case, lagged):
    kw = dict(lagged=lagged, bucketed=case != "b4-mixed", max_rows=64 if case == "b10" else None)
    got = sim_log(budget, monkeypatch, CASES[case](), 120, moe(), **kw)
    want = sim_log(reference, monkeypatch, CASES[case](), 120, moe(), **kw)
    same(got[0], want[0])
    assert all(np.array_equal(a, b) for x, y in zip(got[1], want[1]) for a, b in zip(x, y) if b is not None)
    assert got[2] == want[2]  # tokens and modelled seconds


def test_a_measured_cost_model_learns_and_chooses_as_the_reference(monkeypatch):
    """Rounds whose true costs differ from the table (the verify scale and running overheads move)."""
    true = moe().fanout(base_s=6e-3, row_s=4e-6, expert_s=60 * 7.5e-6, draft_s=3e-3, fixed_s=2e-3)
    kw = dict(lagged=True, bucketed=True, measured=True, true_cost=true)
    got = sim_log(budget, monkeypatch, CASES["b4-mixed"](), 150, moe(), **kw)
    want = sim_log(reference, monkeypatch, CASES["b4-mixed"](), 150, moe(), **kw)
    same(got[0], want[0])


def test_released_requests_free_their_history_slots_and_new_ones_take_the_pool():
    """Requests come and go (more than the first slots hold): values as the reference's dict of arrays."""
    rng = np.random.default_rng(7)
    fast, ref = budget.ValueHistory(16, 4), reference.ValueHistory(16, 4)
    live = []
    for r in range(60):
        if len(live) > 3 and rng.random() < 0.3:
            gone = live.pop(int(rng.integers(len(live))))
            fast.release(gone)
            ref.release(gone)
        live.append(100 + r)
        rids = live[-int(rng.integers(1, min(len(live), 12) + 1)):]
        n = 20
        raw = np.where(rng.random((len(rids), n)) < 0.8, rng.random((len(rids), n)), 0.0)
        depth = rng.integers(-1, 6, (len(rids), n))
        classes = rng.integers(0, budget.OFF_CLASSES, (len(rids), n))
        if fast.ready():
            w = rng.random((len(rids) + 1, 5, budget.OFF_CLASSES))
            ask = rids + [999]  # one never seen: the pool's values
            for ahead in (1, 2):
                assert np.array_equal(fast.values(ask, w, ahead), ref.values(ask, w, ahead))
        fast.update(rids, raw, depth, classes)
        ref.update(rids, raw, depth, classes)
        assert fast.rho == ref.rho
    assert len(fast._slot) == len(live) and len(fast._sum) >= 12


def test_class_accepted_and_tree_paths_are_the_references(rng):
    total = 0
    for b, n, a in ((1, 65, 8), (4, 17, 5), (10, 65, 8), (3, 9, 1)):
        parents = np.full((b, n), -1, np.int64)
        for i in range(b):
            built = int(rng.integers(1, n + 1))
            parents[i, 1:built] = [int(rng.integers(0, j)) for j in range(1, built)]
        got, want = budget.tree_paths(parents), reference.tree_paths(parents)
        assert all(np.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(got, want))
        classes = got[1]
        accepted = rng.integers(-1, n + 2, (b, a))
        accept_len = rng.integers(0, a + 1, b)
        got, want = budget.class_accepted(classes, accepted, accept_len), reference.class_accepted(classes, accepted,
                                                                                                    accept_len)
        assert np.array_equal(got, want) and got.dtype == want.dtype
        total += int(want.sum())
    assert total > 0


def test_the_engines_rounds_choose_as_the_reference(monkeypatch, tiny, cont):
    """The engine on the numpy backend (the oracle drafter, a batch with requests joining as others
    finish, lagged): the same choices and the same output."""
    from ddtree_rtc.engine.decode import round as round_mod
    from ddtree_rtc.engine.engine import Engine
    from ddtree_rtc.engine.request import Request
    from ddtree_rtc.speculative.drafters import OracleDrafter
    from ddtree_rtc.testing import random_prompts as prompts

    def go(module):
        log = []
        monkeypatch.setattr(budget, "AutoBudget", recording(module, log))
        for name in ("tree_paths", "class_accepted"):  # the round's host work on the learned trees too
            monkeypatch.setattr(round_mod, name, getattr(module, name))
        dr = OracleDrafter(tiny.backend, tiny.cfg.vocab_size, 7, cont, accept_p=0.77)
        eng = Engine(tiny, max_batch=3, page_size=16, max_context=128, mode="ddtree", drafter=dr, budget="auto",
                     max_budget=16, cost=module.CostModel.from_dict(moe().to_json()))
        ps = prompts(31, (4, 9, 17, 6, 11))
        out = eng.run([Request(i, p, n) for i, (p, n) in enumerate(zip(ps, [12, 5, 9, 14, 8]))])
        return log, [r.output for r in out]

    want = go(reference)
    got = go(budget)
    same(got[0], want[0])
    assert got[1] == want[1]
