"""Simulated oracle rounds that drive the real cost-aware budget (engine/decode/budget.py,
``AutoBudget``) on a ``CostModel``, without a model: tests/test_budget.py checks the policy with it
and ``bench node`` gives its auto row with it (the policy on the case's measured costs).

What it models: per request, the oracle drafter's tree of ranks (``OracleDrafter``'s template: the
same every round, built best-first at ``max_budget``) and per round which of its nodes the walk
reaches (the true token's rank at each depth drawn from the oracle's law: rank 0 with the depth's
p, else rank r with (1 - p) 2^-r; a node is reached when the drawn ranks follow its path). A round
then emits 1 + the reached nodes among those verified (the cut: a fixed budget's first nodes, the
chain's top-1 path, or the counts auto chose), and costs the cost model's round (fixed + draft +
verify of its rows; auto: the ``Choice``'s seconds, priced on its row buckets). ``exact``: the
expected tokens of the cuts made under the oracle's law (no sampling noise), as
``OracleDrafter.expected_tau`` gives a fixed budget's.

Its limits: the costs are the model's alone (no host time, no launch gaps; an AR round of auto costs
its fixed work and a verify of the roots); the walk is the oracle's law, not a target's; no request
joins or leaves; the lagged choice follows the engine's order (``Learner``) but nothing runs
concurrently.
"""

from __future__ import annotations

import copy

import numpy as np

from ..engine.decode.budget import OFF_CLASSES, AutoBudget, CostModel, node_values, tree_paths
from ..reference.topk import topk_logprobs
from ..reference.tree_build import tree_build
from ..speculative.drafters import OracleDrafter

DEPTH, VOCAB, MAX = 7, 97, 64

# One H100, K2.6 slice pipeline, concurrency 1 (benchmarks/budget_h100.json at 077bc7e): the engine step's
# microseconds by verify rows: AR (1 row), chain (root + 7 nodes), budgets 8, 16, 32 (the small-M path) and 64
# (65 rows: the general kernels, cheaper than the small-M path's 33 rows). The small-M path's 48 and 64 rows
# (buckets auto may use under the row cap, timed by its warm-up but not written to that JSON) continue its
# slope from 17 to 33 rows.
H100_C1_US = {1: 2936.0, 8: 5916.0, 9: 5868.0, 17: 6853.0, 33: 8729.0, 65: 6415.0}
SMALL_M_SLOPE_US = (H100_C1_US[33] - H100_C1_US[17]) / 16


def h100_c1_cost(small_m_buckets: bool = True, **kw) -> CostModel:
    """The H100 steps as a cost table (the whole step as the verify: the settings' ratios are the
    measured ones); without ``small_m_buckets`` only the measured points, so 34..64 rows interpolate
    from the small-M path's 33 to the general kernels' 65. ``kw``: CostModel's other fields."""
    us = dict(H100_C1_US)
    if small_m_buckets:
        us.update({t: H100_C1_US[33] + SMALL_M_SLOPE_US * (t - 33) for t in (48, 64)})
    return CostModel(verify=tuple((t, u * 1e-6) for t, u in us.items()), **kw)


def build(logits, budget: int = MAX, depth: int = DEPTH):
    """The best-first trees of ``logits`` ``[B, depth, V]`` at ``budget`` nodes (reference build)."""
    b = logits.shape[0]
    logq, ids = topk_logprobs(logits, max(1, min(budget, logits.shape[-1])))
    one = np.ones(b, np.int32)
    return tree_build(logq, ids, 0 * one, budget * one, depth * one, 0 * one, budget)


class OracleSim:
    """One request's oracle rounds: its tree (the template's) and, per round, which nodes the walk
    reaches (a reached node's ancestors are reached; at most one node per depth). ``true_p``: the
    walk follows another rank-0 probability than the drafter's (a miscalibrated drafter).
    ``calibrated``: the walk's true rank is drawn from the drafter's own probabilities (its softmax
    over the ranks), so the drafter is right on and off its top-1 path; by default the oracle's law
    (rank r >= 1 with (1 - p) 2^-r), which the drafter's Zipf tail understates at the first ranks
    (at vocabulary 97 and p 0.77 it gives rank 1 0.039 where the law gives 0.115)."""

    def __init__(self, p=None, table=None, seed=0, true_p=None, vocab: int = VOCAB, depth: int = DEPTH,
                 max_budget: int = MAX, calibrated: bool = False):
        self.seed, self.depth_max = seed, depth
        self.od = OracleDrafter(None, vocab, depth, None, accept_p=p, table=table, seed=seed)
        self.tree = build(self.od._template[None], max_budget, depth)
        self.law = None  # [depth, vocab]: P(true rank r) when calibrated
        if calibrated:
            x = np.sort(self.od._template.astype(np.float64), axis=1)[:, ::-1]
            e = np.exp(x - x[:, :1])
            self.law = e / e.sum(axis=1, keepdims=True)
        if true_p is not None:  # the same ranks (seed), another law
            self.od = OracleDrafter(None, vocab, depth, None, accept_p=true_p, seed=seed)
        rank = np.empty_like(self.od._order)
        for d in range(depth):
            rank[d, self.od._order[d]] = np.arange(vocab)
        n = int(self.tree.num_nodes[0])
        self.depth = self.tree.node_depth[0, :n].astype(np.int64)
        self.parent = self.tree.parents[0, :n].astype(np.int64)
        self.rank = np.array([-1] + [rank[self.depth[j] - 1, self.tree.tokens[0, j]] for j in range(1, n)])
        self.rng = np.random.default_rng(seed + 1)
        self.ptrue = np.ones(n)  # the oracle law's probability that the walk reaches node j
        for j in range(1, n):
            d, r = self.depth[j] - 1, self.rank[j]
            self.ptrue[j] = self.ptrue[self.parent[j]] * (self.od.rank_probability(d, r) if self.law is None
                                                          else self.law[d, r])
        self.classes = tree_paths(self.parent[None])[1][0]  # [n]: each node's path class (off the top-1 path)
        self.etrue = 1 + np.concatenate([[0.0], np.cumsum(self.ptrue[1:])])  # [n]: exact tau of a cut at n

    def fresh(self) -> OracleSim:
        """The same request with its draws from the start (arrays shared): every run of a
        comparison sees the same rounds, without making the tree again."""
        c = copy.copy(self)
        c.rng = np.random.default_rng(self.seed + 1)
        return c

    def reached(self, rounds: int) -> np.ndarray:
        """[rounds, N] bool: node j reached in that round (the oracle's rank law)."""
        probs = self.od.probs
        u = self.rng.random((rounds, self.depth_max))
        tail = self.rng.geometric(0.5, (rounds, self.depth_max))
        true = np.where(u < probs[None], 0, tail)
        if self.law is not None:  # the drafter's own law (the same uniforms, so runs stay comparable)
            cdf = np.cumsum(self.law, axis=1)
            true = np.stack([np.searchsorted(cdf[d], u[:, d], side="right") for d in range(self.depth_max)], axis=1)
        acc = np.zeros((rounds, len(self.depth)), bool)
        acc[:, 0] = True
        for j in range(1, len(self.depth)):
            acc[:, j] = acc[:, self.parent[j]] & (true[:, self.depth[j] - 1] == self.rank[j])
        return acc

    def at(self, r: int):
        """The sim whose tree round r has (one tree: itself)."""
        return self


class SwitchSim:
    """A request whose drafter moves between acceptance profiles (text it is sure of, text it is
    not): each round the profile stays with probability ``stay`` or else moves to another, drawn
    uniformly. The tree of a round is that profile's, so a choice made from the round's own tree
    sees the move at once, and a lagged one (from the past rounds) a round late."""

    def __init__(self, sims, rounds: int, stay: float, seed: int = 0):
        rng = np.random.default_rng(seed + 77)
        self.sims, state = sims, [0]
        for _ in range(rounds - 1):
            s = state[-1]
            state.append(s if rng.random() < stay else int(rng.choice([i for i in range(len(sims)) if i != s])))
        self.state = state
        self.depth = sims[0].depth
        self.depth_max = sims[0].depth_max

    def at(self, r: int):
        return self.sims[self.state[r]]

    def reached(self, rounds: int) -> np.ndarray:
        each = [s.reached(rounds) for s in self.sims]
        return np.stack([each[self.state[r]][r] for r in range(rounds)])


class Learner:
    """A round's observe in the engine's order (engine/decode/round.py): the AR hold at once; what
    it teaches (calibration, value history, stats) at once, or lagged: the counts of round r are
    chosen during round r-1's verify, after learning round r-2 (round r-1 is learned during round
    r's; the first lagged choice learns all first)."""

    def __init__(self, auto, lagged: bool):
        self.auto, self.lagged, self.pend = auto, lagged, []

    def before_choice(self) -> None:
        while len(self.pend) > 1 or (self.pend and not self.auto.history.ready()):
            self.auto.learn(*self.pend.pop(0))

    def after_round(self, *args) -> None:  # AutoBudget.observe's arguments (classes, off_accepted included)
        if not self.lagged:
            return self.auto.observe(*args)
        self.auto.hold(args[0], args[3], args[5])
        self.pend.append(args)

    def flush(self) -> None:
        while self.pend:
            self.auto.learn(*self.pend.pop(0))


def round_tree(sims):
    """The round's raw path probabilities, depths and path classes ``[B, N]`` of the sims' trees
    (as the engine reads them: 0, -1 and 0 past the built nodes)."""
    n_max = max(len(s.depth) for s in sims)
    raw = np.zeros((len(sims), n_max))
    depth = np.full((len(sims), n_max), -1, np.int64)
    off = np.zeros((len(sims), n_max), np.int64)
    for i, s in enumerate(sims):
        n = len(s.depth)
        raw[i, 1:n] = np.exp(s.tree.scores[0, 1:n])
        depth[i, :n] = s.depth
        off[i, :n] = s.classes
    return raw, depth, off


def chain_nodes(sim) -> list[int]:
    """The sim's top-1 path: node j of the chain is the rank-0 node at depth j."""
    if "_chain" in vars(sim):
        return sim._chain
    out, u = [], 0
    for _ in range(sim.depth_max):
        kids = [j for j in range(1, len(sim.depth)) if sim.parent[j] == u and sim.rank[j] == 0]
        if not kids:
            break
        u = kids[0]
        out.append(u)
    sim._chain = out
    return out


def true_seconds(cost, batch: int, rows: int, nodes: int, drafted: bool = True) -> float:
    """A round's seconds on ``cost``: its fixed work, the draft (when drafted) and the verify of
    ``rows`` rows holding ``nodes`` distinct nodes (run_oracle's ``true_cost``)."""
    return (cost.fixed_s(batch) + (cost.draft_s(batch) if drafted else 0.0)
            + float(cost.verify_s(rows, nodes, batch)))


def run_oracle(sims, rounds, budget="auto", cost=None, bucketed=False, lagged=False, choices=None,
               max_budget: int = MAX, true_cost=None, **auto_kw):
    """Tokens, modelled seconds, and per-round (predicted, measured) tokens over ``rounds``
    rounds of the batch ``sims`` (one OracleSim or SwitchSim per request), at a fixed budget, the
    chain or auto, on ``cost`` (a ``CostModel``); ``.exact`` on the returned auto (or the 6th
    value): the exact expected tokens of the cuts made (the oracle law, no sampling noise).
    ``lagged``: auto chooses before the round's tree is known (``AutoBudget.choose_lagged``), else
    from it (``choose``); ``choices``: a list that gets every drafted round's (lagged counts or
    None, the counts from the round's own tree). ``true_cost``: what the rounds really take (a
    ``CostModel``; default ``cost``): every round is timed on it, and where ``cost`` is ``measured``
    auto learns each round's true seconds as the engine does (``CostModel.learn_round``), so a table
    that misprices the rows can be found out. ``auto_kw``: AutoBudget's other arguments
    (``max_rows``, ...)."""
    if cost is None:
        raise ValueError("run_oracle: give the cost model (a CostModel) the rounds are priced on")
    b = len(sims)
    depth_max = sims[0].depth_max
    reached = [s.reached(rounds) for s in sims]
    auto = AutoBudget(max_budget, depth_max, cost, bucketed=bucketed, lagged=lagged, **auto_kw) \
        if budget == "auto" else None
    learner = Learner(auto, lagged)
    tokens = seconds = exact = 0.0
    made = []  # (choice, tokens) of the drafted rounds
    rids = list(range(b))
    for r in range(rounds):
        now = [s.at(r) for s in sims]
        raw, depth, off = round_tree(now)
        if auto is None:
            k = depth_max if budget == "chain" else budget
            counts, drafted = np.full(b, k), True
            sec = true_seconds(true_cost or cost, b, b * (k + 1), b * (k + 1))
        elif auto.should_draft(rids):
            learner.before_choice()
            choice = auto.choose_lagged(rids, np.full(b, max_budget), 0)
            own = None
            if choice is None or choices is not None:
                # the weights of the round's own choice: the lagged choice's, so that only the tree differs
                w = auto.round_weights(rids) if choice is None else (choice.valued, choice.weights)
                vals = node_values(np, np.log(np.maximum(raw, 1e-300)), depth, np.array([len(s.depth) for s in now]),
                                   w[0], off)
                own = auto.choose(vals[:, 1:], np.full(b, max_budget), 0, w)
            if choices is not None:
                choices.append((None if choice is None else choice.counts, own.counts))
            choice = choice or own
            counts, drafted, sec = choice.counts, True, choice.seconds
        else:
            choice, drafted = auto.ar_choice(b, 0), False
            counts, sec = choice.counts, choice.seconds
            auto.skipped(rids)
        if budget == "chain":  # the top-1 path: node j of the chain is the rank-0 node at depth j
            acc = [np.cumprod([reached[i][r, j] for j in chain_nodes(s)]).sum() + 1 for i, s in enumerate(now)]
            exact += sum(1 + s.ptrue[chain_nodes(s)].sum() for s in now)
        else:
            acc = [reached[i][r, : int(counts[i]) + 1].sum() for i in range(b)]
            exact += sum(s.etrue[min(int(n), len(s.etrue) - 1)] for s, n in zip(now, counts))
        if auto is not None and true_cost is not None:
            sec = true_seconds(true_cost, b, choice.rows, b + int(np.sum(counts)), drafted)
            if cost.measured:
                cost.learn_round(b, true_cost.draft_s(b) if drafted else None, sec, choice.verify_model_s)
        if auto is not None:
            # the accepted nodes per path class (the engine: class_accepted of the walk's nodes)
            cut = [min(int(counts[i]) + 1, reached[i].shape[1]) for i in range(b)]
            off_acc = np.zeros((b, OFF_CLASSES), np.int64)
            for i, c in enumerate(cut):
                got = off[i, 1:c][reached[i][r, 1:c]]
                off_acc[i] = np.bincount(got, minlength=OFF_CLASSES)
            learner.after_round(rids, raw, depth, choice, np.array(acc), drafted, off, off_acc)
            if drafted:
                made.append((choice, sum(acc)))
        tokens += sum(acc)
        seconds += sec
    if auto is not None:
        learner.flush()  # a lagged choice's predicted tokens are remade when its round is learned
    pred = np.array([c.expected.sum() for c, _ in made])
    meas = np.array([m for _, m in made])
    return tokens, seconds, pred, meas, auto, exact
