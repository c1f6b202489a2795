"""decode.budget auto in the engine on the numpy backend (a given cost table): lossless against the
engine's own autoregressive decode (T = 0 and T > 0; oracle, random and DFlash drafters; mixed
batches), the extremes of the cost table, and the errors. The policy itself: tests/test_budget.py."""

import contextlib
import types

import numpy as np
import pytest

from ddtree_rtc.backend import Backend
from ddtree_rtc.engine.decode.budget import BudgetError, CostModel
from ddtree_rtc.engine.engine import Engine
from ddtree_rtc.engine.request import Request
from ddtree_rtc.engine.runner import ModelRunner
from ddtree_rtc.model.target import TargetModel
from ddtree_rtc.speculative.drafters import OracleDrafter, RandomDrafter
from ddtree_rtc.testing import random_prompts as prompts

DEPTH, MAX = 7, 16
MOE = CostModel.fanout(base_s=4e-3, row_s=2e-6, expert_s=60 * 7.5e-6, draft_s=2e-3, fixed_s=1e-3)
FREE = CostModel(verify=((1, 1e-3), (10**6, 1e-3)))
DEAR = CostModel(verify=((1, 1e-3), (2, 2e-3)), fixed=((1, 1e-3),), draft=((1, 1e-4),))


def run(tiny, ps, new, drafter=None, cost=MOE, max_batch=4, mode_budget="auto", plans=None, **req):
    """``plans``: a list that gets (rows per request, verify rows) of every verify planned."""
    mode = "autoregressive" if drafter is None else "ddtree"
    cost = None if cost is None else CostModel.from_dict(cost.to_json())  # a fresh copy per engine
    eng = Engine(tiny, max_batch=max_batch, page_size=16, max_context=128, mode=mode, drafter=drafter,
                 budget=mode_budget if drafter is not None else 64, max_budget=MAX, cost=cost)
    if plans is not None:
        plan = eng.runner.plan_tree

        def record(*a, **kw):
            step = plan(*a, **kw)
            plans.append((step.rows.tolist(), step.total))
            return step

        eng.runner.plan_tree = record
    reqs = [Request(i, p, new[i] if isinstance(new, list) else new, **{k: v[i] for k, v in req.items()})
            for i, p in enumerate(ps)]
    out = eng.run(reqs)
    assert eng.pages.num_free_pages == eng.pages.num_pages and eng.pages.num_promised_pages == 0
    return eng, [r.output for r in out]


def oracle(tiny, cont, **kw):
    return OracleDrafter(tiny.backend, tiny.cfg.vocab_size, DEPTH, cont, **kw)


@pytest.mark.parametrize("profile", [{"accept_p": 0.9}, {"accept_p": None, "table": (1, 1, 0.9, 0.5, 0.2, 0.1, 0.0)}])
def test_auto_is_lossless_at_t0_with_the_oracle_on_a_mixed_batch(tiny, cont, profile):
    """Prompts of several lengths, max_new_tokens ending inside rounds, per-request caps (0: never a
    tree), requests joining as others finish (three slots for five requests)."""
    ps = prompts(31, (4, 9, 17, 6, 11))
    new = [10, 5, 9, 3, 8]
    _, want = run(tiny, ps, new, max_batch=3)
    plans = []
    eng, got = run(tiny, ps, new, oracle(tiny, cont, **profile), max_batch=3, budget=[None, 0, 3, None, 16],
                   plans=plans)
    assert got == want
    # the verify packs unequal trees, a root alone (autoregressive) among them, with no padding (eager)
    assert all(total == sum(rows) for rows, total in plans)
    assert any(1 in rows and max(rows) > 1 and len(set(rows)) >= 2 for rows, _ in plans)
    st = eng.round.auto.stats
    assert st.drafted_rounds + st.skipped_drafts > 0
    assert max(st.counts_hist) <= MAX
    if profile.get("accept_p") == 0.9:
        assert len(st.counts_hist) > 1  # the capped requests get other counts than the rest


def test_auto_is_lossless_with_the_random_drafter(tiny):
    ps = prompts(3, (5, 8, 11, 3))
    _, want = run(tiny, ps, 8)
    eng, got = run(tiny, ps, 8, RandomDrafter(tiny.backend, tiny.cfg.vocab_size, DEPTH, seed=2))
    assert got == want
    st = eng.round.auto.stats
    assert set(st.counts_hist) == {0} and st.skipped_drafts > 0  # nothing pays: autoregressive, with probes


def test_auto_is_lossless_at_t_positive(tiny, cont):
    ps = prompts(41, (5, 9, 4, 12))
    kw = dict(temperature=[0.0, 0.7, 1.0, 1.4], top_p=[1.0, 0.9, 1.0, 0.8], seed=[None, 3, None, 11])
    new = [9, 6, 10, 7]
    _, want = run(tiny, ps, new, **kw)
    _, got = run(tiny, ps, new, oracle(tiny, cont, accept_p=0.9), **kw)
    assert got == want


def test_auto_is_lossless_with_the_dflash_drafter(tmp_path_factory):
    from ddtree_rtc.model.config import preset_config
    from ddtree_rtc.model.dflash import make_dflash
    from ddtree_rtc.model.make_model import make_model
    from ddtree_rtc.speculative.dflash import DFlashDrafter

    t, d = tmp_path_factory.mktemp("target"), tmp_path_factory.mktemp("drafter")
    make_model(preset_config("tiny"), t, seed=0)
    make_dflash("dflash-tiny", d, seed=1)
    model = TargetModel.load(t, Backend("numpy"))
    ps = [list(range(3, 15)), list(range(40, 49)), list(range(100, 105))]
    kw = dict(temperature=[0.0, 0.9, 0.0], top_p=[1.0, 0.9, 1.0], seed=[None, 5, None])  # T = 0 beside T > 0
    _, want = run(model, ps, 8, **kw)
    eng, got = run(model, ps, 8, DFlashDrafter.load(d, model, window=6), cost=FREE, **kw)
    assert got == want and eng.round.auto.stats.drafted_rounds > 0


def test_free_nodes_give_max_budget_dear_nodes_a_chain_or_autoregressive(tiny, cont):
    ps = prompts(7, (6, 9))
    _, want = run(tiny, ps, 12)
    eng, got = run(tiny, ps, 12, oracle(tiny, cont, accept_p=0.9), cost=FREE)
    assert got == want and set(eng.round.auto.stats.counts_hist) == {MAX}
    eng, got = run(tiny, ps, 12, oracle(tiny, cont, accept_p=1.0), cost=DEAR)
    assert got == want
    hist = eng.round.auto.stats.counts_hist
    assert max(hist) <= DEPTH and sum(v for k, v in hist.items() if k > 0) > 0  # chains (a certain drafter)
    eng, got = run(tiny, ps, 12, RandomDrafter(tiny.backend, tiny.cfg.vocab_size, DEPTH, seed=9), cost=DEAR)
    assert got == want and set(eng.round.auto.stats.counts_hist) == {0}  # autoregressive


def plan_trace(tiny, cont, ps, new, alter: bool):
    """Per auto round (free nodes): [rids, plans before its estimate, plans after it, its choice];
    ``alter``: every third round's cut one node fewer per request (any cut is lossless)."""
    rounds = []
    eng = Engine(tiny, max_batch=len(ps), page_size=16, max_context=128, mode="ddtree", budget="auto",
                 drafter=oracle(tiny, cont, accept_p=0.6), max_budget=MAX, cost=CostModel.from_dict(FREE.to_json()))
    rnd, auto = eng.round, eng.round.auto
    auto.lagged = False  # the choice from the round's own tree (the lagged one: the test after)
    plan, go, choose = eng.runner.plan_tree, rnd.run, auto.choose

    def on_plan(*a, **k):
        rounds[-1][1 if rounds[-1][3] is None else 2].append(tuple(a[2]))
        return plan(*a, **k)

    def on_choose(*a, **k):
        c = choose(*a, **k)
        if alter and len(rounds) % 3 == 0:
            c.counts = np.maximum(c.counts - 1, 0)
            c.rows = len(c.counts) + int(c.counts.sum())
        rounds[-1][3] = (tuple(c.counts.tolist()), c.rows)
        return c

    eng.runner.plan_tree, auto.choose = on_plan, on_choose
    rnd.run = lambda reqs, eos: rounds.append([[r.rid for r in reqs], [], [], None]) or go(reqs, eos)
    return rounds, [r.output for r in eng.run([Request(i, p, new) for i, p in enumerate(ps)])]


def test_a_repeated_choice_is_planned_before_the_estimate_and_once(tiny, cont):
    """The host plans the verify of the last round's cut while the device drafts and builds (the
    device idles from the estimate's sync to the verify's launch): a round of the same requests
    whose choice repeats the last one plans once, before the estimate; one whose choice differs
    plans again after it. The ids stay autoregressive decoding's either way."""
    ps = prompts(21, (6, 9))
    _, want = run(tiny, ps, 24)
    for alter in (False, True):
        rounds, got = plan_trace(tiny, cont, ps, 24, alter)
        assert got == want
        hits = misses = 0
        for last, (rids, before, after, choice) in zip(rounds, rounds[1:]):
            assert choice is not None  # free nodes: every round drafts
            if rids != last[0]:  # other requests: nothing to guess from
                assert before == [] and len(after) == 1
            elif choice == last[3]:
                hits += 1
                assert before == [tuple(1 + np.array(choice[0]))] and after == []
            else:
                misses += 1
                assert len(before) == 1 and after == [tuple(1 + np.array(choice[0]))]
        assert hits >= 2 and (misses >= 2 if alter else misses == 0)


def event_trace(tiny, cont, ps, new, lagged: bool, drafter=None, cost=FREE):
    """Per auto round: its events in order ('lag': a lagged choice, 'own': the values of the round's
    own tree read for its choice, 'draft', 'plan', 'build', 'sync': a device-to-host read, 'verify'),
    the outputs, the AutoBudget and each round's request ids."""
    rounds = []
    eng = Engine(tiny, max_batch=len(ps), page_size=16, max_context=128, mode="ddtree", budget="auto",
                 drafter=drafter or oracle(tiny, cont, accept_p=0.6), max_budget=MAX,
                 cost=CostModel.from_dict(cost.to_json()))
    rnd, auto, be = eng.round, eng.round.auto, eng.backend
    auto.lagged = lagged

    def spy(obj, name, event):
        fn = getattr(obj, name)

        def call(*a, **k):
            out = fn(*a, **k)
            if rounds and (event != "lag" or out is not None):  # syncs of the prefill before: none
                rounds[-1].append(event)
            return out

        setattr(obj, name, call)

    for obj, name, event in ((auto, "choose_lagged", "lag"), (rnd._auto_round, "estimate", "own"),
                             (eng.runner, "plan_tree", "plan"), (rnd.drafter, "draft", "draft"),
                             (be, "to_host", "sync"), (rnd, "_verify", "verify")):
        spy(obj, name, event)
    go, buffers = rnd.run, rnd.buffers_for

    def bufs(b):
        t = buffers(b)
        if not getattr(t, "_spied", False):
            spy(t, "grow", "build")
            t._spied = True
        return t

    rnd.buffers_for = bufs
    rnd.run = lambda reqs, eos: rounds.append([tuple(r.rid for r in reqs)]) or go(reqs, eos)
    out = [r.output for r in eng.run([Request(i, p, new) for i, p in enumerate(ps)])]
    return [ev[1:] for ev in rounds], out, auto, [ev[0] for ev in rounds]


def test_the_lagged_choice_puts_no_sync_between_the_build_and_the_verify(tiny, cont):
    """decode.budget auto (lagged, the default): the first round chooses from its own tree (nothing
    is known yet: a sync between the build and the verify). Every later round enqueues its draft and
    build first, then chooses (unless chosen already) and plans once while the device drafts, and
    reads nothing from the device between its build and its verify; the counts of the next round are
    chosen after the verify is enqueued and before the round's sync (while the device verifies), so
    from the third round on a round's first host step after the build is its plan. The built tree is
    read after the round's sync. The ids stay autoregressive decoding's, as they do when the lagged
    choice is switched off (then every round syncs between its build and its verify)."""
    ps = prompts(21, (6, 9, 5))
    _, want = run(tiny, ps, 24)
    rounds, got, auto, rids = event_trace(tiny, cont, ps, 24, lagged=True)
    assert got == want
    assert "lag" not in rounds[0] and len(rounds) >= 4
    assert rounds[0].index("build") < rounds[0].index("own") < rounds[0].index("verify")
    assert rounds[0][:2] == ["draft", "build"] and rounds[1][:4] == ["draft", "build", "lag", "plan"]
    for ev in rounds[1:]:
        assert "own" not in ev and ev.count("plan") == 1, ev
        assert ev.index("draft") < ev.index("build") < ev.index("plan") < ev.index("verify"), ev
        v = ev.index("verify")
        assert "sync" not in ev[ev.index("build"):v], ev
        assert "lag" in ev[v:] and ev.index("lag", v) < ev.index("sync", v), ev  # the next round's, before the sync
    same = [i for i in range(2, len(rounds)) if rids[i] == rids[i - 1]]
    assert len(same) >= 3 and all(rounds[i][:3] == ["draft", "build", "plan"] for i in same)  # chosen before
    assert auto.stats.drafted_rounds == len(rounds)  # every round learned (the last one at its release)
    rounds, got, *_ = event_trace(tiny, cont, ps, 24, lagged=False)
    assert got == want and all("lag" not in ev and "own" in ev for ev in rounds)
    assert all("sync" in ev[ev.index("build"):ev.index("verify")] for ev in rounds)


def test_the_lagged_choice_is_lossless_when_the_trees_differ_every_round(tiny, cont):
    """Lagged choices over a batch whose trees differ every round (the random drafter's): AR's ids
    (the other lossless tests above run the lagged choice too: it is the default)."""
    ps = prompts(5, (6, 9, 4))
    _, want = run(tiny, ps, 16)
    rounds, got, *_ = event_trace(tiny, cont, ps, 16, lagged=True, cost=MOE,
                                 drafter=RandomDrafter(tiny.backend, tiny.cfg.vocab_size, DEPTH, seed=3))
    assert got == want and sum("lag" in ev for ev in rounds) >= 1


@pytest.mark.parametrize("lagged", [False, True])
def test_the_walks_teach_the_path_classes(tiny, cont, lagged):
    """The round hands the calibration its trees' path classes (from the parents it reads) and the
    accepted nodes of each class (from the walk's node indices, read after the round's sync): with
    free nodes every round verifies max_budget nodes, most off the drafter's top-1 path, and the
    oracle (a Zipf tail under its top-1 token) takes its rank-1 token more often than it says, so
    that class's accepted nodes outnumber its predicted ones. The ids stay autoregressive decoding's."""
    ps = prompts(41, (5, 8, 6))
    _, want = run(tiny, ps, 40)
    eng = Engine(tiny, max_batch=3, page_size=16, max_context=128, mode="ddtree", budget="auto",
                 drafter=oracle(tiny, cont, accept_p=0.6), max_budget=MAX, cost=CostModel.from_dict(FREE.to_json()))
    eng.round.auto.lagged = lagged
    got = [r.output for r in eng.run([Request(i, p, 40) for i, p in enumerate(ps)])]
    cal = eng.round.auto.calibration
    assert got == want
    assert cal.off_pred[1] > 0.5 and cal.off_meas[1] > 1.5 * cal.off_pred[1], (cal.off_pred, cal.off_meas)


def test_predicted_and_measured_tau_are_reported(tiny, cont):
    ps = prompts(12, (5, 7, 9))
    eng, _ = run(tiny, ps, 24, oracle(tiny, cont, accept_p=0.8))
    s = eng.round.auto.stats.summary()
    assert s["tau_predicted"] > 1 and s["tau_measured"] > 1 and s["tokens_per_verify_s"] > 0
    assert abs(s["tau_predicted"] - s["tau_measured"]) / s["tau_measured"] < 0.3  # few rounds: loose


def test_warm_up_measures_the_costs_it_chooses_by(tiny, cont):
    """The CUDA warm-up path, run on numpy (a cost model marked measured and empty): at the first
    drafted round every row bucket's verify is timed (the trees cut to fill it and the roots alone)
    and the draft and the rest of the round are timed afterwards (row-invariant, as here by default,
    a smaller batch's missing buckets at its own first drafted round); the ids stay autoregressive
    decoding's."""
    from ddtree_rtc.engine.decode.budget import row_buckets

    ps = prompts(7, (6, 9))  # the prompts of the free / dear test (their continuations are cached)
    _, want = run(tiny, ps, 10)
    cost = CostModel(draft=(), fixed=(), measured=True, source="warm-up")
    eng = Engine(tiny, max_batch=2, page_size=16, max_context=128, mode="ddtree", drafter=oracle(tiny, cont),
                 budget="auto", max_budget=4, cost=cost)
    got = [r.output for r in eng.run([Request(i, p, 10) for i, p in enumerate(ps)])]
    assert got == want
    auto = eng.round.auto
    batches = eng.round._auto_round.measured_batches  # 2, and 1 if the last request drafted alone
    assert auto.cost is cost and 2 in batches and batches <= {1, 2}
    assert [x for x, _ in cost.verify] == sorted(map(float, set().union(*map(auto.graph_buckets, batches))))
    assert set(row_buckets(2, 5)) <= {x for x, _ in cost.verify}
    assert all(t > 0 for _, t in cost.verify) and cost.draft_s(2) > 0 and cost.expert_s >= 0
    assert auto.stats.drafted_rounds > 0


def test_warm_up_under_the_row_cap_measures_every_bucket_it_uses(tiny, cont):
    """Row-invariant scheduling (the default) caps a round at 64 verify rows: five requests of 17
    rows at most (85) verify within the graph buckets under 64 (CUDA graphs' buckets, simulated on
    numpy). The first drafted round measures those and the buckets of every smaller batch (its first
    requests), so as the batch shrinks (requests of other lengths finish) nothing is measured mid
    decoding."""
    ps = prompts(19, (6, 9, 4, 12, 7))
    new = [30, 4, 9, 6, 11]  # request 1 is done in 3 rounds at most, request 0 takes 4 at least
    _, want = run(tiny, ps, new, max_batch=5)
    cost = CostModel(draft=(), fixed=(), measured=True, source="warm-up")
    eng = Engine(tiny, max_batch=5, page_size=16, max_context=128, mode="ddtree",
                 drafter=oracle(tiny, cont, accept_p=0.9), budget="auto", max_budget=MAX, cost=cost)
    auto = eng.round.auto
    assert eng.invariant and auto.max_rows == 64
    auto.bucketed = True  # the CUDA graphs' buckets (numpy runs any shape eagerly)
    auto.probe_every = 1  # every round drafts (the measured timings would decide the holds)
    ar, sizes = eng.round._auto_round, []
    measure = ar.measure
    ar.measure = lambda rids, *a: sizes.append(len(rids)) or measure(rids, *a)
    got = [r.output for r in eng.run([Request(i, p, n) for i, (p, n) in enumerate(zip(ps, new))])]
    assert got == want
    measured = {int(x) for x, _ in cost.verify}
    batches = ar.measured_batches
    assert sizes == [5] and batches == {1, 2, 3, 4, 5} and max(measured) == 64
    assert all(set(auto.graph_buckets(b)) <= measured for b in batches)
    assert set(auto.stats.rows_hist) <= measured  # every verify used is a measured bucket


def test_auto_rows_any_lifts_the_row_cap(tiny, cont):
    """Row-invariant scheduling caps auto's verify at 64 rows, the small-M path (AR's ids by
    construction on a GPU), which leaves out the general kernels' buckets past it (on the H100 65
    rows cost less than the small-M path's 33: tests/test_budget.py, the H100 shape).
    ``auto_rows='any'`` lifts the cap, with a warning as a fixed budget over 63 gives: five requests
    of up to 17 rows may verify in one round of 85 rows where nodes are free, and the ids stay
    autoregressive decoding's (numpy: every path is the reference)."""
    ps = prompts(19, (6, 9, 4, 12, 7))
    new = [12, 4, 9, 6, 11]
    _, want = run(tiny, ps, new, max_batch=5)
    kw = dict(max_batch=5, page_size=16, max_context=128, mode="ddtree", budget="auto", max_budget=MAX)
    capped = Engine(tiny, drafter=oracle(tiny, cont, accept_p=0.9), cost=CostModel.from_dict(FREE.to_json()), **kw)
    assert capped.invariant and capped.verify_invariant and capped.round.auto.max_rows == 64
    with pytest.warns(UserWarning, match="auto_rows 'any': a verify over the 64 rows"):
        eng = Engine(tiny, drafter=oracle(tiny, cont, accept_p=0.9), cost=CostModel.from_dict(FREE.to_json()),
                     auto_rows="any", **kw)
    auto = eng.round.auto
    assert eng.invariant and not eng.verify_invariant and auto.max_rows is None
    assert auto.top_rows(5) == 5 * (MAX + 1) and auto.graph_buckets(5)[-1] == 85
    got = [r.output for r in eng.run([Request(i, p, n) for i, (p, n) in enumerate(zip(ps, new))])]
    assert got == want and max(auto.stats.rows_hist) > 64
    with pytest.raises(BudgetError, match="decode.auto_rows must be 'invariant' or 'any', got 'all'"):
        Engine(tiny, drafter=oracle(tiny, cont), cost=MOE, auto_rows="all", **kw)


class FakeGraphRunner(ModelRunner):
    """CUDA graphs simulated on numpy: a capture records its (shape, output) and makes a 'graph'
    whose launch runs the shape's current inputs eagerly (what a replay of the real one computes)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.captured = []  # (shape key, output) in capture order
        self.launched = set()  # shape keys replayed

    @staticmethod
    def supports_graphs(backend) -> bool:
        return True

    def _pool(self):
        return None, contextlib.nullcontext()

    def _capture(self, s, hidden_layers, output):
        from ddtree_rtc.parallel.comm import CommStats

        key = next(k for k, v in self._shapes.items() if v is s)
        self.captured.append((key, output))

        def launch():
            self.launched.add(key)
            s.outs[output] = self.model.run(s.inputs, self.cache, output=output, hidden_layers=hidden_layers,
                                            moe_plan=s.moe_plan)

        s.graphs[output], s.collectives[output] = types.SimpleNamespace(launch=launch), CommStats()


@pytest.mark.parametrize("setting", ["auto", "chain", "4"])
def test_the_start_captures_every_verify_shape_and_no_other(tiny, cont, monkeypatch, setting):
    """With CUDA graphs (simulated) the engine captures at its start every verify shape its decoding
    can reach and no other: auto, each row bucket of each batch size up to max_batch under the 64
    verify rows (the buckets it may choose); a fixed budget or chain, each batch size of a group at
    that budget. A run whose requests finish at different times (batch sizes 5 .. 1) and whose auto
    choices span several buckets then replays those graphs and captures none; the ids stay
    autoregressive decoding's."""
    from ddtree_rtc.engine import engine as engine_mod

    monkeypatch.setattr(engine_mod, "ModelRunner", FakeGraphRunner)
    ps = prompts(19, (6, 9, 4, 12, 7))
    new = [30, 4, 9, 6, 11]
    _, want = run(tiny, ps, new, max_batch=5)
    auto = setting == "auto"
    eng = Engine(tiny, max_batch=5, page_size=16, max_context=128, mode="chain" if setting == "chain" else "ddtree",
                 drafter=oracle(tiny, cont, accept_p=0.7), budget="auto" if auto else int(setting) if
                 setting.isdigit() else 64, max_budget=MAX, cost=CostModel.from_dict(MOE.to_json()),
                 cuda_graphs=True)
    runner, width = eng.runner, eng.round.width
    assert eng.invariant and eng.warm_up["graphs"] == runner.captures > 0 and eng.warm_up["left"] == 0
    if auto:
        eng.round.auto.probe_every = 1  # held requests probe every round: more of the buckets are met
        reach = {(b, t, width) for b in range(1, 6) for t in eng.round.auto.graph_buckets(b)}
        assert max(t for _, t, _ in reach) == 64 and min(t for _, t, _ in reach) == 1
    else:
        reach = {(b, b * width, width) for b in range(1, min(5, 64 // width) + 1)}
    assert sorted(runner.captured) == sorted((k, "logits") for k in reach)
    captures = runner.captures
    got = [r.output for r in eng.run([Request(i, p, n) for i, (p, n) in enumerate(zip(ps, new))])]
    assert got == want
    assert runner.captures == captures and len(runner.captured) == captures  # nothing captured while decoding
    assert runner.launched <= reach and len({b for b, _, _ in runner.launched}) >= 3
    if auto:
        assert len(eng.round.auto.stats.rows_hist) >= 3  # the choices span several buckets


def test_bad_input_is_named(tiny, cont):
    with pytest.raises(BudgetError, match="numpy backend needs decode.cost_table"):
        run(tiny, prompts(1, (4,)), 4, oracle(tiny, cont), cost=None)
    with pytest.raises(BudgetError, match="budget_choice must be 'lagged' or 'tree', got 'late'"):
        Engine(tiny, max_batch=1, page_size=16, max_context=128, mode="ddtree", drafter=oracle(tiny, cont),
               budget="auto", max_budget=MAX, cost=MOE, budget_choice="late")
    for bad in (0, 513):
        with pytest.raises(BudgetError, match=f"decode.max_budget {bad} is outside 1..512"):
            Engine(tiny, 2, 16, 128, mode="ddtree", drafter=oracle(tiny, cont), budget="auto", max_budget=bad,
                   cost=MOE)
    with pytest.raises(BudgetError, match="needs mode 'ddtree'"):
        Engine(tiny, 2, 16, 128, mode="chain", drafter=oracle(tiny, cont), budget="auto", cost=MOE)
    with pytest.raises(ValueError, match="a node count or 'auto'"):
        Engine(tiny, 2, 16, 128, mode="ddtree", drafter=oracle(tiny, cont), budget="autoo")


def test_bench_budget_compares_settings_on_the_tiny_pipeline(tmp_path):
    """`ddtree-rtc bench budget` end to end on the numpy backend: every setting's ids equal
    autoregressive decoding's, and auto is compared with the best and worst fixed budgets (auto-any,
    auto without the row cap, too); each auto row keeps its cost table and row cap."""
    import json

    from ddtree_rtc.bench.budget import main

    table = tmp_path / "cost.json"
    table.write_text(json.dumps(MOE.to_json()))
    doc = main(["--pipeline", "pipelines/tiny_ddtree.yaml", "--set", "decode.budget=auto",
                "--set", f"decode.cost_table={table}", "--set", "decode.max_budget=8",
                "--set", "workload.synthetic.count=2", "--set", "workload.synthetic.output_len=6",
                "--concurrency", "2", "--settings", "autoregressive,chain,4,auto-tree,auto,auto-any", "--warmup-tokens",
                "2", "--json", str(tmp_path / "b.json")])
    assert doc["same_ids_as_autoregressive"] == {"2": {"autoregressive": True, "chain": True, "4": True,
                                                       "auto-tree": True, "auto": True, "auto-any": True}}
    s = doc["summary"]["2"]
    assert {s["best_fixed"], s["worst_fixed"]} <= {"chain", "4"} and s["auto_over_best"] > 0
    assert s["auto_over_auto_tree"] > 0 and s["auto_any_over_best"] > 0 and s["auto_any"] > 0
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert rows[-1]["budget"]["nodes_hist"] and rows[-2]["budget"]["nodes_hist"]
    assert rows[-2]["budget"]["max_rows"] == 64 and rows[-1]["budget"]["max_rows"] is None
    assert rows[-1]["budget"]["cost_model"]["verify"] == [list(p) for p in MOE.verify]  # the table given
    assert rows[-1]["invariant"] is False and rows[-2]["invariant"] is True
    assert {r["setting"]: r["min_rows"] for r in rows}["4"] == 5 and all("invariant" in r for r in rows)
    # the host's time per step by stage: every setting verifies or decodes, auto alone values its trees
    assert all(r["wall_us_per_step"] > 0 and r["graph_captures"] == 0 for r in rows)  # numpy: no graphs
    assert rows[-2]["stage_us_per_step"]["budget"] > 0 and rows[-2]["stage_us_per_step"]["verify"] > 0
    assert "budget" not in rows[2]["stage_us_per_step"] and rows[2]["stage_us_per_step"]["verify"] > 0


def test_bench_budget_summary_names_the_best_setting_on_the_row_invariant_path():
    """A fixed budget whose verify leaves the row-invariant path (over 64 rows) may be the fastest;
    the summary then also gives auto over the best setting that keeps to it (AR's ids by construction)."""
    from ddtree_rtc.bench.budget import summarize

    def row(setting, tps, rows, invariant=True):
        return {"concurrency": 1, "setting": setting, "tok_s_per_user": tps, "min_rows": rows, "invariant": invariant}

    rows = [row("autoregressive", 350.0, 1), row("chain", 720.0, 8), row("8", 740.0, 9), row("32", 580.0, 33),
            row("64", 900.0, 65, invariant=False), row("auto", 750.0, 1), row("auto-any", 905.0, 1, invariant=False)]
    s = summarize(rows)["1"]
    assert (s["best_fixed"], s["worst_fixed"]) == ("64", "32")
    assert s["best_invariant_fixed"] == "8" and s["auto_over_best_invariant"] == pytest.approx(750 / 740)
    assert s["auto_over_best"] == pytest.approx(750 / 900)
    assert s["auto_any_over_best"] == pytest.approx(905 / 900) and s["auto_any_over_worst"] == pytest.approx(905 / 580)
    assert "best_invariant_fixed" not in summarize([{**r, "invariant": False} for r in rows])["1"]


@pytest.mark.gpu
@pytest.mark.parametrize("graphs,table", [(False, None), (True, None), (True, MOE)])
def test_cuda_auto_equals_cuda_autoregressive_up_to_near_ties(tmp_path_factory, graphs, table):
    """budget auto on the CUDA backend (eager or CUDA graphs; the verify costs measured at the first
    drafted round, or a given table) gives CUDA autoregressive ids up to the first near-tie of the
    autoregressive run's own logits (tests/test_round_gpu.py explains the comparison); with graphs,
    every verify shape captured is a row bucket's, each captured when the engine starts."""
    from test_round_gpu import assert_agree, copies, dense_tiny_config, oracle_of, pick_clear, pool_requests, run_engine

    from ddtree_rtc.model.make_model import make_model

    d = tmp_path_factory.mktemp("tiny_dense_auto")
    make_model(dense_tiny_config(), d, seed=5)
    cuda = TargetModel.load(d, Backend("cuda"))
    pool, record = pool_requests(0.0, seed=2), {}
    _, ref = run_engine(cuda, copies(pool), record=record)
    chosen, clear = pick_clear(pool, ref, record)
    eng = Engine(cuda, max_batch=4, page_size=16, max_context=128, mode="ddtree", drafter=oracle_of(cuda, ref),
                 budget="auto", max_budget=MAX, cost=None if table is None else CostModel.from_dict(table.to_json()),
                 cuda_graphs=graphs)
    got = {r.rid: r.output for r in eng.run(copies(chosen))}
    assert_agree(got, {r.rid: ref[r.rid] for r in chosen}, clear, f"CUDA auto (graphs={graphs}) vs CUDA AR")
    auto = eng.round.auto
    assert auto.stats.drafted_rounds > 0 and auto.cost.verify
    assert (auto.cost.source == "warm-up") == (table is None)
    if table is None:  # every bucket measured, the fan-out slope and the draft's seconds too
        measured = {x for x, _ in auto.cost.verify}
        assert any(measured >= set(map(float, auto.graph_buckets(b))) for b in range(1, 5))
        assert auto.cost.draft_s(4) > 0
    if graphs:  # the row-invariant default: none over 64 rows; all captured at the start, none later
        assert eng.warm_up["left"] == 0 and eng.runner.captures == eng.warm_up["graphs"] == len(eng.graph_shapes())
        assert all(key[1] in auto.graph_buckets(key[0]) for key in eng.runner._shapes if key[2])
        assert max(key[1] for key in eng.runner._shapes if key[2]) <= 64


@pytest.mark.gpu
@pytest.mark.parametrize("rows", ["invariant", "any"])
def test_cuda_warm_up_measures_every_bucket_auto_may_choose(tmp_path_factory, rows):
    """On CUDA without a cost table the warm-up times every row bucket auto may choose, each by
    replays of its own verify graph (so a bucket past the small-M path is timed on the general
    kernels it runs): max_budget 64 at batch 2 and 1, row-invariant (buckets up to 64 rows) and with
    ``auto_rows='any'``, whose buckets include 65 (root + 64 nodes: at batch 1 the only bucket that
    holds budget 64's tree, which on the H100 ran the general kernels faster than the small-M path
    ran 33 rows, benchmarks/budget_h100.json) and 130. Every bucket of every batch size measured
    has a point of its own (none interpolated across the kernel switch), and every verify the run
    used is one of them."""
    import warnings

    from test_round_gpu import copies, dense_tiny_config, oracle_of, pool_requests, run_engine

    from ddtree_rtc.model.make_model import make_model

    d = tmp_path_factory.mktemp("tiny_dense_buckets")
    make_model(dense_tiny_config(), d, seed=5)
    cuda = TargetModel.load(d, Backend("cuda"))
    pool = pool_requests(0.0, seed=2)[:2]
    _, ref = run_engine(cuda, copies(pool))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # auto_rows 'any' warns that its ids may part from AR's at near-ties
        eng = Engine(cuda, max_batch=2, page_size=16, max_context=128, mode="ddtree", drafter=oracle_of(cuda, ref),
                     budget="auto", max_budget=64, cost=None, cuda_graphs=True, auto_rows=rows)
    eng.run(copies(pool))
    auto, batches = eng.round.auto, eng.round._auto_round.measured_batches
    measured = {int(x) for x, _ in auto.cost.verify}
    assert 2 in batches and batches <= {1, 2} and auto.stats.drafted_rounds > 0
    assert all(set(auto.graph_buckets(b)) <= measured for b in batches)
    assert set(auto.stats.rows_hist) <= measured
    assert cuda.small_m(64) and not cuda.small_m(65)  # the kernels switch between the last two buckets of batch 1
    if rows == "invariant":
        assert auto.max_rows == 64 and max(measured) == 64
    else:
        assert auto.max_rows is None and {65, 130} <= measured and auto.graph_buckets(1)[-2:] == (64, 65)
    assert all(t > 0 for _, t in auto.cost.verify)
