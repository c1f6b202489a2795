"""The device half of ``decode.budget: auto`` in a DDTree round (the policy, calibration and cost
model are in engine/decode/budget.py; docs/architecture.md, "Cost-aware budget").

A round with the auto budget builds every tree at ``max_budget``. Choosing from the round's own tree
(``decode.budget_choice: tree``, and a lagged engine's first and measuring rounds):

    estimate -> the host reads the build's scores, parents and node counts (the round's first sync)
                and values the nodes: path probability x calibration (by depth and off-path
                edges, both from the parents), beside the raw ones
    choose   -> per request the node count (AutoBudget.choose) and the bucket of verify rows that
                holds them all
    cut      -> ``num_nodes = 1 + count``: the first ``count`` pops are the best tree of that size
                (the build is best-first), and no kernel after the build looks past ``num_nodes``
    verify   -> the runner's packed verify: each request's root and nodes after one another, the
                bucket's other rows padding (its graph, captured per bucket)

Lagged (``decode.budget_choice: lagged``, the default): the counts were chosen during the last
round's verify (AutoBudget.choose_lagged); while the device drafts and builds the host plans the
verify and copies ``1 + count`` to the device (``stage_cut``, queued behind the build), after the
build the device takes the minimum with the built ``num_nodes`` (``apply_cut``) and the verify
follows with no sync between; after the round's
sync the host reads the built tree (``read_tree``: the values of nodes past the cut too, which say
whether more nodes would pay), learned during the next round's verify.

A batch whose requests all hold off drafting (their last drafted round got no node) skips the draft
and the build: the tree is the root alone, one row per request, i.e. an autoregressive step that
still hands the drafter its context. On CUDA without a cost table the verify of every bucket of that
batch size and of every smaller one is timed at the first drafted round (``measure``: a few replays
of the tree cut to fill the bucket and of the roots alone, which give the MoE fan-out slope); the
draft and the round's other work are timed every drafted round."""

from __future__ import annotations

import time

import numpy as np

from ...reference.tree_build import TreeArrays
from .budget import AutoBudget, Choice, experts_touched, fit_expert_s, node_values, node_weights, tree_paths

MEASURE_REPS = 3


def fill_counts(room: np.ndarray, total: int) -> np.ndarray:
    """Node counts of ``total`` nodes spread evenly over the requests, request b at most ``room[b]``."""
    room = np.asarray(room, np.int64)
    counts = np.zeros_like(room)
    left = int(total)
    while left > 0 and (counts < room).any():
        more = np.flatnonzero(counts < room)[:left]
        counts[more] += 1
        left -= len(more)
    return counts


class AutoRound:
    """What a round does for the auto budget, on the round's backend and runner."""

    def __init__(self, auto: AutoBudget, backend, runner):
        self.auto, self.backend, self.runner = auto, backend, runner
        self.measured_batches: set = set()
        self._cuts: dict = {}  # batch -> [B] int32 device buffer of the lagged cut
        self._slopes: list = []  # every fan-out slope measured (the model's is their median)

    def estimate(self, tree: TreeArrays, rids) -> tuple:
        """Host ``(values [B, M], raw [B, N], depth [B, N], classes [B, N], weights)``: calibrated
        node values of nodes 1..M, raw path probabilities, depths and path classes of every slot,
        and the ``(valued, honest)`` weights of the round (``AutoBudget.round_weights``, for its
        ``choose``). The host
        reads the build's scores, parents and node counts (the round's first sync; the calibration's
        weights are made before it, while the device still drafts and builds), takes depths and
        path classes from the parents (``tree_paths``) and values the nodes in numpy: at these
        sizes (B <= 64 requests of <= 65 slots) that is microseconds, where the same pass on the
        device is ~30 array launches of host time, all of it between the build and the verify (the
        device idles there: the verify waits for the choice)."""
        be = self.backend
        w = self.auto.round_weights(rids)
        scores = be.to_host(tree.scores)  # waits for the build
        depth, off = tree_paths(be.to_host(tree.parents))
        num_nodes = be.to_host(tree.num_nodes)
        raw = node_values(np, scores, depth, num_nodes, np.ones((len(rids), 1)))
        vals = raw * node_weights(np, w[0], depth, off)
        return vals[:, 1:], raw, depth, off, w

    def read_tree(self, tree: TreeArrays) -> tuple[np.ndarray, np.ndarray]:
        """Host ``(raw [B, N], parents [B, N])`` of the built tree after the round (the lagged
        choice: the cut changed ``num_nodes`` only; the build leaves NaN scores and parent -1 past
        its nodes). Its depths and path classes (``tree_paths``) are worked out when the round is
        learned, during the next round's verify."""
        be = self.backend
        scores = be.to_host(tree.scores)
        parents = be.to_host(tree.parents)
        built = parents >= 0  # the root's -1 too: its value is 0
        return np.where(built, np.exp(np.where(built, scores, 0.0)), 0.0), parents

    def draft_known(self, batch: int) -> bool:
        """Whether a lagged round may run at this batch size: a given table, or a measured one that
        has timed the draft there (a round choosing from its own tree times its draft and build
        apart, up to the sync; a lagged round has no sync there and times the round whole)."""
        cost = self.auto.cost
        return not cost.measured or any(x == float(batch) for x, _ in cost.draft)

    def stage_cut(self, batch: int, counts: np.ndarray):
        """The lagged cut's ``1 + counts`` on the device (from page-locked staging: queued behind the
        draft and build, not waited for)."""
        buf = self._cuts.get(batch)
        if buf is None:
            buf = self._cuts[batch] = self.backend.empty((batch,), "int32")
        self.backend.copy_in(buf, (1 + np.asarray(counts)).astype(np.int32))
        return buf

    def apply_cut(self, tree: TreeArrays, cut) -> None:
        """``num_nodes = min(num_nodes, 1 + counts)`` on the device after the build (no host data: a
        lagged count past the nodes the build made leaves them all)."""
        self.backend.xp.minimum(tree.num_nodes, cut, out=tree.num_nodes)

    def cut(self, tree: TreeArrays, counts: np.ndarray) -> None:
        self.backend.copy_in(tree.num_nodes, (1 + np.asarray(counts)).astype(np.int32))

    def root_only(self, tree: TreeArrays, roots, prefix_dev) -> None:
        """The tree of the root alone (no draft this round): slot 0 of every request."""
        tree.tokens[:, 0] = roots
        tree.parents[:, 0] = -1
        tree.node_depth[:, 0] = 0
        tree.positions[:, 0] = prefix_dev
        tree.mask[:, 0, :] = 0
        tree.mask[:, 0, 0] = 1
        tree.num_nodes[...] = 1

    def caps(self, budgets) -> np.ndarray:
        return np.asarray(budgets, np.int64)

    def measure(self, rids, prefix, tree: TreeArrays, num_nodes: np.ndarray, output: str) -> None:
        """Time the verify of every row bucket not in the table yet (``missing``; eagerly the table
        interpolates between them) of this batch and of every smaller one (its first requests: a
        batch shrinks as requests finish, and a bucket first met then would be timed, a stall, mid
        decoding): the tree cut to fill the bucket (every row a distinct node, as far as the trees
        have nodes) and the roots alone (one distinct node per request); the second gives the
        fan-out slope, which also prices the nodes the trees lacked."""
        be, runner, cost = self.backend, self.runner, self.auto.cost
        width, full = self.auto.width, len(rids)
        points, slopes, timed = [], self._slopes, set()
        for b in range(full, 0, -1):
            for total in self.missing(b):
                if total in timed:
                    continue
                timed.add(total)
                counts = fill_counts(num_nodes[:b] - 1, total - b)
                secs = {}
                for kind, cut in (("full", counts), ("lean", np.zeros(b, np.int64))):
                    self.cut(tree, np.concatenate([cut, np.zeros(full - b, np.int64)]))
                    step = runner.plan_tree(rids[:b], prefix[:b], 1 + cut, width, total)
                    runner.fill_tree(step, tree)
                    runner.verify(step, output)  # captures the bucket's graph if the start did not
                    be.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(MEASURE_REPS):
                        runner.verify(step, output)
                    be.synchronize()
                    secs[kind] = (time.perf_counter() - t0) / MEASURE_REPS
                nodes = b + int(counts.sum())
                points.append((total, nodes, secs["full"]))
                s = fit_expert_s(b, nodes, secs["full"], secs["lean"])
                if s is not None:
                    slopes.append(s)
            self.measured_batches.add(b)
        if slopes:
            cost.expert_s = float(np.median(slopes))
        for total, nodes, secs in points:  # every row a distinct node: the trees' missing nodes priced
            cost.add_verify(total, secs + cost.expert_s * float(experts_touched(total) - experts_touched(nodes)))
        self.cut(tree, num_nodes - 1)

    def missing(self, batch: int) -> list:
        """The batch's verify row buckets (``AutoBudget.graph_buckets``) the table has no point at."""
        known = {x for x, _ in self.auto.cost.verify}
        return [t for t in self.auto.graph_buckets(batch) if float(t) not in known]

    def needs_measure(self, batch: int) -> bool:
        """Measure at the first drafted round (that batch's buckets and every smaller batch's): the
        table is over verified rows, so later batch sizes read it between (or past) the rows
        measured. Under a row cap (``AutoBudget.max_rows``) the rows never pass it, and a later,
        larger batch's roots bucket is measured at its first drafted round."""
        auto = self.auto
        if not auto.cost.measured:
            return False
        if not self.measured_batches:
            return True
        return auto.max_rows is not None and batch not in self.measured_batches and bool(self.missing(batch))

    def observe_times(self, batch: int, draft_s: float | None, round_s: float, choice: Choice,
                      lagged: bool = False) -> None:
        """The measured round, learned by the cost model (``CostModel.learn_round``: the verify
        scale's fit, the running means of the draft (draft + top-k + build + estimate) and of the
        rest of the round past the scaled verify, per batch size; cost tables given are kept as they
        are). A lagged round is timed whole (no sync splits it): its draft keeps the seconds
        measured at this batch size (``draft_known``) and the rest goes to the other work."""
        cost = self.auto.cost
        if not cost.measured:
            return
        if lagged:
            draft_s = cost.draft_s(batch)
        cost.learn_round(batch, draft_s, round_s, choice.verify_model_s)
