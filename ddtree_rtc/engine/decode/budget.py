"""The cost-aware tree budget (``decode.budget: auto``; docs/architecture.md, "Cost-aware budget").

Each round the tree is built at ``max_budget`` and then cut, per request, to the node count that
maximises the batch's expected tokens per second of round time:

- **Expected acceptance from the tree.** The best-first build pops nodes in non-increasing path
  probability, so the first n nodes of every request's tree are the best n-node tree, and under the
  drafter's marginals its expected tokens are ``1 + sum_{i <= n} P(path_i)`` (``node_values`` /
  ``expected_tokens``: one elementwise pass and a cumsum over the build's scores; numpy or cupy
  arrays, the round runs it on the host copy: engine/decode/auto.py).
- **Calibration** (``Calibration``). The product of marginals is biased, so every node's P is scaled
  by a per-depth factor (measured reach of depth d over predicted reach, the predicted reach of a
  depth being the sum of P over its nodes, which are exclusive events; compounding with depth) and
  a per-request factor (measured over predicted accepted nodes), and by a factor per path class
  (the rank of the node's one edge off the drafter's top-1 tokens, or several: a drafter is
  miscalibrated differently off its top-1 path, ``tree_paths``), all online and decayed; the
  policy uses them once they are past noise, and probes optimistically where nothing is measured.
- **The cost of a round** (``CostModel``): fixed and draft seconds per batch size and the verify
  as a function of the batch's verified rows in all, the distinct nodes among them (the MoE
  fan-out: N distinct tokens touch ``384 (1 - (1 - 8/384)^N)`` experts per layer) and the context.
  Given as a table (JSON, or ``CostModel.fanout`` for CI), or measured on the device at warm-up.
- **The lagged choice** (``ValueHistory``, ``AutoBudget.choose_lagged``; ``decode.budget_choice:
  lagged``, the default). Reading the build's values before the verify puts a host round trip
  between the two (the device idles from the build's end to the verify's launch). So the engine
  chooses round r's counts during round r-1's verify, from what the host knows then: each request's
  node values by pop index predicted from its past trees (up to round r-2's: round r-1's is read
  after its sync), and learns round r-1 (calibration, values, stats) during round r's verify. The
  expected tokens of a request's first n nodes in the coming round are ``1 + sum_{i <= n}
  E[value_i]``, so choosing by the predicted values is choosing the count with the most expected
  tokens per second given the past: exactly the tree's own choice when rounds are alike (the
  oracle's tree is the same every round); where the drafter's confidence moves from round to round
  the lag costs what the tree would have shown (tests/test_budget.py, a switching drafter).
- **The policy** (``choose``). The batch's nodes are taken greedily in order of value (the global
  best-first order over all requests); every prefix of that order is priced at the verify of the
  cheapest row bucket (``row_buckets``: the verify graphs) that holds its rows, the roots included
  (not always the smallest: past the small-M path's 64 rows the general kernels run, and on the
  H100 they verify 65 rows in less time than the small-M path verifies 33), and the prefix with
  the most expected tokens per second wins. The verify packs each request's
  chosen nodes after one another (engine.runner), so nothing is paid for nodes not verified. Zero
  nodes for every request is autoregressive decoding; a confident drafter's first pops are its
  top-1 path, so a deep narrow tree (the chain) is a point of the same space. Output stays
  lossless: the cut only decides which nodes are verified.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

EXPERTS, EXPERTS_PER_TOKEN = 384, 8  # Kimi K2.6's routed experts (docs/architecture.md section 2)


class BudgetError(ValueError):
    """A bad ``decode.budget: auto`` setting or a cost model that cannot price a round."""


def experts_touched(nodes, experts: int = EXPERTS, per_token: int = EXPERTS_PER_TOKEN):
    """Expected distinct experts per MoE layer that ``nodes`` tokens route to (uniform routing)."""
    return experts * (1.0 - (1.0 - per_token / experts) ** np.asarray(nodes, np.float64))


# -- expected acceptance from the tree (device or host) ------------------------------------------


def _clip(xp, x, lo, hi):
    """``xp.clip`` of an index array as two ufuncs (the same values; numpy's clip costs several
    microseconds of dispatch per call on the tiny arrays of a round)."""
    return xp.minimum(xp.maximum(x, lo), hi)


def node_weights(xp, weights, node_depth, classes=None):
    """``[B, N]`` float64: each node's calibration weight. ``weights``: ``[B, depth + 1]`` (per
    depth) or ``[B, depth + 1, OFF_CLASSES]`` (per depth and path class, ``AutoBudget.round_weights``:
    index ``[b, depth_j, class_j]``, the class from ``classes`` ``[B, N]``, ``tree_paths``;
    without it 0, the chain's)."""
    w = xp.asarray(weights, dtype=xp.float64)
    d = _clip(xp, node_depth, 0, w.shape[1] - 1).astype(xp.int64)
    if w.ndim == 2:
        return xp.take_along_axis(w, d, axis=1)
    k = xp.zeros_like(d) if classes is None else _clip(xp, classes, 0, w.shape[2] - 1).astype(xp.int64)
    return w[xp.arange(w.shape[0])[:, None], d, k]


def node_values(xp, scores, node_depth, num_nodes, weights, classes=None):
    """``[B, N]`` float64: node j's path probability ``exp(scores[b, j])`` times its weight
    (``node_weights``: the calibration), 0 for the root and for slots past ``num_nodes``. ``xp``:
    numpy or cupy (the arrays' module); ``weights``: ``[B, depth + 1]`` or ``[B, depth + 1,
    OFF_CLASSES]`` with ``classes`` (``tree_paths``)."""
    n = scores.shape[1]
    j = xp.arange(n, dtype=xp.int32)[None, :]
    used = (j >= 1) & (j < num_nodes[:, None])
    w = node_weights(xp, weights, node_depth, classes)
    return xp.where(used, xp.exp(xp.where(used, scores, 0.0)) * w, 0.0)


def expected_tokens(xp, scores, node_depth, num_nodes, weights, classes=None):
    """``[B, N]``: column n is the expected tokens of the tree's first n nodes (bonus included),
    ``1 + sum_{1 <= i <= n} value_i``; column 0 (the root alone) is 1."""
    return 1.0 + xp.cumsum(node_values(xp, scores, node_depth, num_nodes, weights, classes), axis=1)


OFF_RANKS = 3  # off-path classes by the rank of the one off-path edge: 1, 2, 3 or more
OFF_CLASSES = OFF_RANKS + 2  # and the chain (0) and two or more off-path edges (the last)


def tree_paths(parents) -> tuple[np.ndarray, np.ndarray]:
    """Host ``(depth [B, N], path class [B, N])`` int64 of built trees from their ``parents``
    ``[B, N]`` (pop order, root at 0 with parent -1; -1 past the built nodes): each node's depth
    (root 0, unbuilt -1) and the class of its path off the drafter's top-1 tokens: 0 when every
    edge is the top-1 token of its depth (the chain), r in 1..OFF_RANKS when one edge is not and
    that token is the drafter's rank-r one (``OFF_RANKS`` for that rank and past it), and
    ``OFF_CLASSES - 1`` when two edges or more are not. The drafter gives one distribution per
    depth, so a child's rank is its rank among its siblings, and the best-first build pops a
    parent's children in rank order (rank r + 1 is pushed when rank r is popped): an edge's rank is
    the number of siblings popped before it. A sort of the slots by parent and log2(depth)
    pointer-jumping passes up the ancestors (numpy; no device work)."""
    p = np.asarray(parents).astype(np.int64)
    b, n = p.shape
    child = p >= 0
    child[:, 0] = False
    # siblings together, in pop order: a stable sort of the slots by (request, parent)
    key = (np.arange(b)[:, None] * (n + 1) + np.where(child, p + 1, 0)).ravel()
    order = key.argsort(kind="stable")
    key = key[order]
    at = np.arange(b * n)
    new = np.ones(b * n, bool)
    new[1:] = key[1:] != key[:-1]
    rank = np.empty(b * n, np.int64)  # each node's edge: its rank among its siblings
    rank[order] = at - np.maximum.accumulate(np.where(new, at, 0))
    rank = np.where(child, rank.reshape(b, n), 0)
    # sums and maxima over each node's path by pointer jumping (log2(depth) flat gathers; the root
    # and unbuilt slots point at themselves and hold 0, so adding their sums adds nothing)
    own = np.arange(b * n)
    jump = np.where(child, p + np.arange(b)[:, None] * n, own.reshape(b, n)).ravel()
    depth = child.ravel().astype(np.int64)
    k = (rank >= 1).ravel().astype(np.int64)  # off-path edges on the path
    top = rank.ravel().copy()  # the largest edge rank on the path
    while True:
        nxt = jump[jump]
        depth += depth[jump]
        k += k[jump]
        np.maximum(top, top[jump], out=top)
        if (nxt == jump).all():
            break
        jump = nxt
    depth = np.where(child, depth.reshape(b, n), -1)
    depth[:, 0] = 0
    k, top = k.reshape(b, n), top.reshape(b, n)
    return depth, np.where(k == 0, 0, np.where(k == 1, np.minimum(top, OFF_RANKS), OFF_CLASSES - 1))


def class_accepted(classes, accepted, accept_len) -> np.ndarray:
    """``[B, OFF_CLASSES]``: the accepted nodes of each path class (``tree_paths``) per request,
    from the walk's node indices ``accepted`` ``[B, >= max accept_len]`` (root first) and its
    length (root included)."""
    classes, accepted = np.asarray(classes), np.asarray(accepted).astype(np.int64)
    a = np.asarray(accept_len, np.int64)
    j = np.arange(accepted.shape[1])[None, :]
    used = (j >= 1) & (j < a[:, None])
    c = np.take_along_axis(classes, _clip(np, accepted, 0, classes.shape[1] - 1), axis=1).astype(np.int64)
    used &= (c >= 0) & (c < OFF_CLASSES)
    cells = (np.arange(len(c))[:, None] * OFF_CLASSES + c)[used]  # one count over (request, class)
    return np.bincount(cells, minlength=len(c) * OFF_CLASSES).reshape(len(c), OFF_CLASSES)


# -- calibration ---------------------------------------------------------------------------------


OFF_PRIOR = 0.25  # predicted nodes of a path class's prior (at 1); small: its evidence comes a few nodes at a time


class Calibration:
    """Online per-depth and per-request correction of the drafter's path probabilities.

    ``observe`` takes, per request-round, the raw P of the verified nodes (with their depths) and
    the accepted length; depth d's factor is (decayed measured reach + prior) / (decayed predicted
    reach + prior), the request's factor the same over depth-calibrated accepted nodes.

    The factors the policy uses (``weights``) follow these estimates only past noise: they move to
    the current estimates when, at a depth with evidence (or for a request), the estimate is more
    than ``gate`` standard errors from the factor in use, the error being that of the count of
    accepted nodes expected there (``1 / sqrt(count + 1)`` on the log factor). So a drafter whose
    probabilities are right is taken at its word, and the node counts do not wander with the luck of
    the last rounds (each wander costs: the best count's neighbours give fewer tokens per second);
    a bias that the evidence shows moves them within a few rounds (at 2x, about 20 accepted nodes).

    **Off the top-1 path.** A drafter is miscalibrated differently on its top-1 path and off it (the
    oracle drafter at K2.6's vocabulary gives its rank-1 token 0.024 where the walk takes it 0.115 of
    the time), and a depth's factor cannot tell the two apart (it scales every node of the depth).
    So a node's weight also carries the factor of its path's class (``tree_paths``): 0 on the chain
    (factor 1), else by the rank of its one off-path edge (1, 2, 3 or more) or two edges or more.
    Each class's factor is learned as the others are, from the verified nodes of the class (their
    predicted reach under the depth and request factors in use against the accepted nodes among
    them), with a prior of 1 (the drafter's word) and the same gate (``off_factors_used``). By class
    and not one factor per off-path edge (``f ** k``, k the off-path edges): the bias is by rank,
    not by edge count. The oracle's understatement is 2.9x, 2.3x, 1.7x, 1.1x at ranks 1 to 4 (at
    vocabulary 97), one factor learned mostly from the rank-1 nodes overvalues the rank-3 and
    deeper ones, and in the simulator that made auto verify trees too bushy where nodes cost
    something (0.96-0.97x the best fixed budget against 0.99-1.00x by class; docs/architecture.md
    section 8); and a 64-node oracle tree has no node with two off-path edges at all."""

    def __init__(self, depth: int, decay: float = 0.998, prior: float = 4.0, request_decay: float = 0.995,
                 request_prior: float = 512.0, gate: float = 4.0, off_path: bool = True):
        if not 0 < decay <= 1 or not 0 < request_decay <= 1:
            raise BudgetError(f"calibration decay must be in (0, 1], got {decay}, {request_decay}")
        if gate < 0:
            raise BudgetError(f"calibration gate must be >= 0 standard errors, got {gate}")
        self.depth, self.decay, self.prior, self.gate = depth, decay, prior, gate
        self.depth_prior = 16.0  # predicted nodes of the line's weight at one depth
        self.request_decay, self.request_prior = request_decay, request_prior
        self.pred = np.zeros(depth + 1)
        self._d = np.arange(1, depth + 1, dtype=np.float64)  # the depths as floats (depth_factors)
        self.meas = np.zeros(depth + 1)
        self._req: dict = {}  # rid -> [predicted, measured] accepted nodes, depth-calibrated
        self._depth_used = np.concatenate([[0.0], np.ones(depth)])  # the factors in use (the drafter's P at first)
        self._req_used: dict = {}  # rid -> the request factor in use
        self.off_pred = np.zeros(OFF_CLASSES)  # verified nodes per path class: predicted reach, and accepted
        self.off_meas = np.zeros(OFF_CLASSES)
        self._off_used = np.ones(OFF_CLASSES)  # the path classes' factors in use (the drafter's P at first)
        self.off_path = bool(off_path)  # False: the off-path factor stays 1 (the per-depth model alone)
        # the gates of the depth and path-class factors in use ran since the last observe: a second run
        # changes nothing (a factor just moved equals its estimate), so it is skipped (host time per round)
        self._depth_gated = self._off_gated = False

    def depth_factors(self) -> np.ndarray:
        """``[depth + 1]``: the factor of each depth (index 0, the root, unused). The bias of a
        product of marginals compounds with depth (each level's marginal is off by about the same
        ratio), and the root's factor is 1 (it is always accepted), so the shape is ``exp(b d)``:
        ``b`` from a least-squares line through the origin and log(measured / predicted reach),
        weighted by the evidence at each depth. One parameter from all depths at once: a depth not
        yet (or no longer) verified follows the measured ones (after one measured depth the next is
        priced at the same ratio again). A depth with evidence of its own is measured over predicted
        reach with that line as a prior of ``depth_prior`` predicted nodes, so a well-measured depth
        keeps its own factor where the bias is not log-linear."""
        d = self._d
        pred, meas = self.pred[1:], self.meas[1:]
        wd = (pred + 1e-12) * d
        y = np.log((meas + self.prior * 0.5) / (pred + self.prior * 0.5))
        slope = float(min(max((wd * y).sum() / (wd * d).sum(), -2.0), 2.0))
        fit = np.exp(slope * d)
        own = (meas + self.depth_prior * fit) / (pred + self.depth_prior)  # a depth's own evidence first
        out = np.empty(self.depth + 1)
        out[0] = 0.0
        np.minimum(np.maximum(own, 1e-3), 1e3, out=out[1:])
        return out

    def request_factor(self, rid) -> float:
        p, m = self._req.get(rid, (0.0, 0.0))
        return (m + self.request_prior) / (p + self.request_prior)

    def _beyond_noise(self, estimate, used, expected) -> bool:
        """Whether ``estimate`` (factors) is more than ``gate`` standard errors from ``used``
        anywhere, ``expected`` being the accepted nodes the factors in use predict there."""
        z, gate = self._z, self.gate
        return any(z(e, u, x) > gate for e, u, x in zip(estimate.tolist(), used.tolist(), expected.tolist()))

    @staticmethod
    def _z(estimate: float, used: float, expected: float) -> float:
        """Standard errors between one factor's estimate and the one in use (log scale; the error
        falls as 1 / sqrt(expected accepted nodes)). Scalars: per request and round on the host."""
        return abs(math.log(max(estimate, 1e-12)) - math.log(max(used, 1e-12))) * math.sqrt(expected + 1.0)

    def depth_factors_used(self) -> np.ndarray:
        """``[depth + 1]``: the depth factors in use (see the class doc)."""
        if not self._depth_gated:
            live = self.depth_factors()
            if self._beyond_noise(live[1:], self._depth_used[1:], self._depth_used[1:] * self.pred[1:]):
                self._depth_used = live
            self._depth_gated = True
        return self._depth_used

    def request_factor_used(self, rid) -> float:
        live, used = self.request_factor(rid), self._req_used.get(rid, 1.0)
        p, _ = self._req.get(rid, (0.0, 0.0))
        if self._z(live, used, used * p) > self.gate:
            self._req_used[rid] = used = live
        return used

    def off_factors(self) -> np.ndarray:
        """``[OFF_CLASSES]``: each path class's factor, (decayed accepted nodes + prior) / (decayed
        predicted ones + prior), the prior at 1 (class 0, the chain: 1, the depth factors' part)."""
        f = (self.off_meas + OFF_PRIOR) / (self.off_pred + OFF_PRIOR)
        f[0] = 1.0
        return f

    def off_factors_used(self) -> np.ndarray:
        """The path classes' factors in use: each moves to its estimate past the gate, the error
        being that of the count of accepted nodes measured in the class (not of the count the factor
        in use predicts, as for the depths: off-path nodes are verified rarely and in small numbers,
        so an understated class must not wait for the evidence its understatement keeps away, and a
        few verified nodes none of which was accepted do not mark a class down)."""
        if self.off_path and not self._off_gated:
            self._off_gated = True
            live, used = self.off_factors(), self._off_used
            for c in range(1, OFF_CLASSES):
                if self._z(live[c], used[c], self.off_meas[c]) > self.gate:
                    used[c] = live[c]
        return self._off_used

    def off_evidence(self) -> np.ndarray:
        """``[OFF_CLASSES]``: the accepted nodes each class's factor in use stands for (the width of
        the exploration's bound)."""
        return self._off_used * self.off_pred

    def weights(self, rids) -> np.ndarray:
        """``[B, depth + 1, OFF_CLASSES]`` float64: depth factor times request factor times the path
        class's factor (the last axis, ``tree_paths``), as in use."""
        f = self.depth_factors_used()
        r = np.array([self.request_factor_used(r) for r in rids], np.float64).reshape(-1, 1, 1)
        return r * f[None, :, None] * self.off_factors_used()[None, None, :]

    def observe(self, rids, raw, node_depth, counts, accept_len, classes=None, off_accepted=None) -> None:
        """``raw``/``node_depth`` ``[B, N]`` host arrays of the built tree (pop order, root at 0),
        ``counts`` ``[B]`` the verified nodes (the cut), ``accept_len`` ``[B]`` the walk's length
        (root included); ``classes`` ``[B, N]`` each node's path class and ``off_accepted`` ``[B,
        OFF_CLASSES]`` the accepted nodes of each (``tree_paths``, ``class_accepted``; without them
        every node counts as on the top-1 path). Predicted reach per depth is under the classes'
        factors in use; the request factor is measured over predicted under the depth factors in use."""
        f, d1, fo = self._depth_used, self.depth + 1, self._off_used
        self._depth_gated = self._off_gated = False
        counts, accept_len = np.asarray(counts, np.int64), np.asarray(accept_len, np.int64)
        top = int(counts.max()) if len(counts) else 0
        pred = np.zeros(d1)
        meas = np.zeros(d1)
        self.off_pred *= self.decay
        self.off_meas *= self.decay
        if top > 0:
            # every request's predicted reach per depth in one bincount over (request, depth) (a loop
            # of one per request was most of this host time that grows with the batch); a request
            # with no verified node gives no evidence (its row stays 0 and is skipped)
            b = len(counts)
            depth = node_depth[:, 1:top + 1].astype(np.int64)
            used = (np.arange(top)[None, :] < counts[:, None]) & (depth < d1)
            idx = np.arange(b)[:, None] * d1 + depth
            r = raw[:, 1:top + 1]
            live = np.flatnonzero(counts > 0)
            if classes is not None:
                c = _clip(np, np.asarray(classes)[:, 1:top + 1].astype(np.int64), 0, OFF_CLASSES - 1)
                if off_accepted is not None:
                    rf = np.array([self._req_used.get(x, 1.0) for x in rids], np.float64)[:, None]
                    pc = r * rf * f[_clip(np, depth, 0, d1 - 1)]  # predicted reach before the class factor
                    self.off_pred += np.bincount(c[used], weights=pc[used], minlength=OFF_CLASSES)
                    self.off_meas += np.asarray(off_accepted)[live].sum(axis=0)
                r = r * fo[c]
            per_depth = np.bincount(idx[used], weights=r[used], minlength=b * d1).reshape(b, d1)
            pred = per_depth[live].sum(axis=0)
            meas[1:] = (accept_len[live, None] > np.arange(1, d1)[None, :]).sum(axis=0)  # reached depth d
            rd = self.request_decay
            for i, pd_f in zip(live.tolist(), (per_depth[live] * f).sum(axis=1).tolist()):
                rid, a = rids[i], int(accept_len[i])
                p, m = self._req.get(rid, (0.0, 0.0))
                self._req[rid] = (rd * p + pd_f, rd * m + (a - 1))
        self.pred = self.decay * self.pred + pred
        self.meas = self.decay * self.meas + meas

    def release(self, rid) -> None:
        self._req.pop(rid, None)
        self._req_used.pop(rid, None)


# -- the lagged values ----------------------------------------------------------------------------


HISTORY_DECAY = 0.95  # weight of a request's older rounds in its mean node values
PERSIST_DECAY = 0.99  # weight of older request-rounds in the persistence's (pooled) moments
PERSIST_PRIOR = 8.0  # request-rounds of evidence for no persistence (rho shrunk towards 0)


class ValueHistory:
    """What the coming round's node values will be, from the past rounds (the lagged choice).

    Per request: decayed sums of its built nodes' raw path probabilities by pop index, depth and
    path class (``tree_paths``), and of the rounds each pop index was built in (their ratio is the
    mean value; kept per depth and class so the calibration's weights of the round apply), and the
    last round's nodes (raw, depth, class). The prediction
    is ``mean + rho (last - mean)``: ``rho`` is the persistence of a request's tree mass (the sum of
    its built nodes' P) from one round to the next, the lag-1 autocorrelation of its deviations
    from the request's mean, pooled over requests, decayed, shrunk towards 0 and clipped to [0, 1].
    Where the drafter's confidence moves in long spells the last round says much about the next
    (rho near 1); where rounds are alike or independent the long mean is the best guess (rho near
    0). A request with no round yet takes the pool of every request's rounds (the same sums over
    all of them), so a new request in a batch does not force a round trip; before any round there
    are no values (``ready``)."""

    def __init__(self, max_budget: int, depth: int, decay: float = HISTORY_DECAY):
        if not 0 <= decay < 1:
            raise BudgetError(f"value history decay must be in [0, 1), got {decay}")
        self.m, self.d1, self.decay = int(max_budget), depth + 1, decay
        # per request a slot of preallocated arrays (one gather per round, not a stack of per-request
        # arrays): the sums [m, d1, OFF_CLASSES], the rounds [m], the last round's nodes (raw, depth,
        # class, built) [m]; and its mass mean and last mass (host floats)
        self._slot: dict = {}  # rid -> slot
        self._free: list = []
        self._mass: dict = {}  # rid -> [mass mean, last mass]
        self._grow(8)
        self._pool = None  # [sum, rounds] over every request's rounds
        self._c0 = self._c1 = self._cn = 0.0  # decayed lag-0 / lag-1 moments of the mass deviations, their count

    def _grow(self, cap: int) -> None:
        old = getattr(self, "_sum", None)
        n = 0 if old is None else len(old)
        m, d1 = self.m, self.d1
        arrays = (("_sum", (m, d1, OFF_CLASSES), np.float64), ("_rounds", (m,), np.float64),
                  ("_last", (m,), np.float64), ("_last_d", (m,), np.int64), ("_last_k", (m,), np.int64),
                  ("_built", (m,), bool))
        for name, shape, dtype in arrays:
            a = np.zeros((cap,) + shape, dtype)
            if n:
                a[:n] = getattr(self, name)
            setattr(self, name, a)
        self._free.extend(range(cap - 1, n - 1, -1))

    def ready(self) -> bool:
        return self._pool is not None

    @property
    def rho(self) -> float:
        """The persistence of a request's tree mass from round to round (see the class doc)."""
        if self._c0 <= 0:
            return 0.0
        return float(min(max(self._c1 / self._c0, 0.0), 1.0)) * self._cn / (self._cn + PERSIST_PRIOR)

    def _weights(self, weights) -> np.ndarray:
        """``[B, d1, OFF_CLASSES]``: the round's weights by depth and path class (per depth only: the
        same for every class)."""
        w = np.asarray(weights, np.float64)
        if w.ndim == 2:
            w = np.repeat(w[:, : self.d1, None], OFF_CLASSES, axis=2)
        return w[:, : self.d1]

    def values(self, rids, weights, ahead: int = 1) -> np.ndarray:
        """``[B, max_budget]``: each request's predicted calibrated value of pop indices
        1..max_budget (0 where none was built) ``ahead`` rounds past the last one learned (the
        persistence over them: ``rho ** ahead``), ``weights`` ``[B, depth + 1]`` or ``[B, depth +
        1, OFF_CLASSES]`` (``Calibration.weights``: by depth and path class)."""
        if self._pool is None:
            raise BudgetError("value history: no round observed yet")
        pool, rho = self._pool, self.rho ** max(int(ahead), 1)
        slots = [self._slot.get(r, -1) for r in rids]
        new = [i for i, x in enumerate(slots) if x < 0]
        s, n = self._sum[slots], self._rounds[slots]
        if new:
            s[new], n[new] = pool[0], pool[1]
        w = self._weights(weights)
        mean = np.where(n > 0, np.einsum("bmdk,bdk->bm", s, w) / np.maximum(n, 1e-300), 0.0)
        if rho <= 0:
            return mean
        last, ld, lk, built = self._last[slots], self._last_d[slots], self._last_k[slots], self._built[slots]
        if new:
            last[new], ld[new], lk[new], built[new] = 0.0, 0, 0, False
        last = np.where(built, last * w[np.arange(len(slots))[:, None], ld, lk], mean)
        return mean + rho * (last - mean)

    def update(self, rids, raw, node_depth, classes=None) -> None:
        """``raw`` / ``node_depth`` ``[B, N]`` host arrays of the round's built trees (pop order,
        root at 0; ``raw`` 0 and depth -1 past the built nodes, as the build leaves them);
        ``classes`` ``[B, N]`` their path classes (``tree_paths``; None: 0 for all)."""
        m = min(self.m, raw.shape[1] - 1)
        b = len(rids)
        d = node_depth[:, 1:m + 1].astype(np.int64)
        kk = np.zeros_like(d) if classes is None else _clip(np, np.asarray(classes)[:, 1:m + 1], 0, OFF_CLASSES - 1)
        ok = (d >= 1) & (d < self.d1)
        rv = np.where(ok, raw[:, 1:m + 1], 0.0).astype(np.float64, copy=False)
        dv, kv = np.where(ok, d, 0), np.where(ok, kk, 0).astype(np.int64)
        if m < self.m:  # a tree smaller than max_budget: its pop indices past it unbuilt
            pad = ((0, 0), (0, self.m - m))
            ok, rv, dv, kv = np.pad(ok, pad), np.pad(rv, pad), np.pad(dv, pad), np.pad(kv, pad)
        built = ok
        mass = rv.sum(axis=1).tolist()
        k, kp = self.decay, PERSIST_DECAY
        c0 = c1 = cn = 0.0
        slots, new = [], []
        for i, r in enumerate(rids):
            x = self._mass.get(r)
            if x is None:
                if not self._free:
                    self._grow(2 * len(self._sum))
                self._slot[r] = sl = self._free.pop()
                new.append(sl)
                self._mass[r] = [mass[i], mass[i]]
            else:
                sl = self._slot[r]
                mu, prev = x
                c0 += (prev - mu) ** 2
                c1 += (mass[i] - mu) * (prev - mu)
                cn += 1
                x[0], x[1] = k * mu + (1 - k) * mass[i], mass[i]
            slots.append(sl)
        if new:  # a new request's sums start at 0 (decaying them then changes nothing)
            self._sum[new], self._rounds[new] = 0.0, 0.0
        lo = slots[0]
        sl = slice(lo, lo + b) if slots == list(range(lo, lo + b)) else np.asarray(slots, np.int64)
        # the usual batch has its slots in a row: views, updated in place; else copies, written back
        ii = np.arange(self.m)
        s, n = self._sum[sl], self._rounds[sl]
        s *= k
        n *= k
        s[np.arange(b)[:, None], ii[None, :], dv, kv] += rv  # one cell per pop index (unbuilt: 0 at depth 0)
        n += built
        if not isinstance(sl, slice):
            self._sum[sl], self._rounds[sl] = s, n
        self._last[sl], self._last_d[sl], self._last_k[sl], self._built[sl] = rv, dv, kv, built
        if cn:
            self._c0, self._c1, self._cn = kp * self._c0 + c0, kp * self._c1 + c1, kp * self._cn + cn
        if self._pool is None:
            self._pool = [np.zeros((self.m, self.d1, OFF_CLASSES)), np.zeros(self.m)]
        else:
            self._pool[0] *= k
            self._pool[1] *= k
        cells = (ii[None, :] * self.d1 + dv) * OFF_CLASSES + kv
        self._pool[0] += np.bincount(cells.ravel(), weights=rv.ravel(),
                                     minlength=self._pool[0].size).reshape(self._pool[0].shape)
        self._pool[1] += built.sum(axis=0)

    def release(self, rid) -> None:
        sl = self._slot.pop(rid, None)
        if sl is not None:
            self._free.append(sl)
        self._mass.pop(rid, None)


# -- the cost of a round -------------------------------------------------------------------------


def _interp(points: tuple, x):
    """Piecewise-linear through ``points`` ((x, y), ... sorted by x), linear extrapolation past
    the last two points (never falling: a table that falls between its last two points, as the
    H100's from the small-M path's 33 rows to the general kernels' 65, says nothing of cheaper rows
    past them, and the policy takes the cheapest bucket) and flat below the first."""
    xs, ys = _arrays(points)
    x = np.asarray(x, np.float64)
    y = np.interp(x, xs, ys)
    if len(xs) >= 2:
        slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
        y = np.where(x > xs[-1], ys[-1] + slope * (x - xs[-1]), y)
    return y


@functools.lru_cache(maxsize=256)
def _interp_at(points: tuple, x: float) -> float:
    """``_interp`` at one size, as a float (the draft and fixed seconds: read every round, their
    tables replaced only when a round is learned)."""
    return float(_interp(points, x))


@functools.lru_cache(maxsize=64)
def _arrays(points: tuple):
    return np.array([p[0] for p in points], np.float64), np.array([p[1] for p in points], np.float64)


BUCKET_MARGIN = 0.05  # a verify takes a larger row bucket than it needs only where that costs 5% less (verify_curve)
OVERHEAD_DECAY = 0.9  # weight of the running mean of the measured draft / other seconds per round
# the verify scale's fit (CostModel.verify_scale): its decay per round, its ridge towards 1 (in units of the
# squared mean modelled verify: a spread of the chosen verifies' seconds past ~5% of their mean moves it),
# and its range
SCALE_DECAY, SCALE_PRIOR, SCALE_MIN, SCALE_MAX = 0.99, 0.05, 0.5, 4.0
NO_VERIFY_COSTS = ("decode.budget auto: the cost model has no verify costs yet (give decode.cost_table, or on CUDA "
                   "let the warm-up measure them)")


@dataclass
class CostModel:
    """Seconds of one round. ``verify``: (rows, seconds) points of a verify whose every row is a
    distinct drafted node (full MoE fan-out), at context ``ctx_ref``; ``expert_s``: seconds per
    expert touched per layer (the fan-out term: a verify of ``rows`` rows holding ``nodes``
    distinct nodes saves ``expert_s (E(rows) - E(nodes))``, E = ``experts_touched``); ``ctx_s``:
    seconds per request per context token past ``ctx_ref``; ``draft`` and ``fixed``: (batch,
    seconds) points of the drafter's forward and of the round's other work. ``measured``: costs
    may be measured and added on the device (warm-up); a given table is kept as it is."""

    verify: tuple = ()
    expert_s: float = 0.0
    ctx_ref: int = 0
    ctx_s: float = 0.0
    draft: tuple = ((1, 0.0),)
    fixed: tuple = ((1, 0.0),)
    measured: bool = False
    source: str = "given"
    _verify_points: dict = field(default_factory=dict, repr=False)
    _curves: dict = field(default_factory=dict, repr=False, compare=False)  # (batch, buckets) -> verify_curve
    _scale: dict = field(default_factory=dict, repr=False, compare=False)  # batch -> decayed moments (verify_scale)

    def __post_init__(self):
        for name in ("verify", "draft", "fixed"):
            pts = tuple(sorted((float(x), float(y)) for x, y in getattr(self, name)))
            if any(x <= 0 or y < 0 for x, y in pts) or len({x for x, _ in pts}) != len(pts):
                raise BudgetError(f"cost model {name!r}: points must have distinct positive sizes and "
                                  f"non-negative seconds, got {list(getattr(self, name))}")
            setattr(self, name, pts)
        self._verify_points = dict(self.verify)
        if self.expert_s < 0 or self.ctx_s < 0 or self.ctx_ref < 0:
            raise BudgetError("cost model: expert_s, ctx_s and ctx_ref must be >= 0")

    def ready(self) -> bool:
        return bool(self.verify)

    def verify_s(self, rows, nodes, batch: int = 1, ctx: float = 0.0):
        """Seconds of a verify of ``rows`` rows in all (array-like) holding ``nodes`` distinct nodes
        (array-like; the rest repeat the roots), for ``batch`` requests at mean context ``ctx``."""
        return self.with_ctx(self._verify_base(rows, nodes), batch, ctx)

    def with_ctx(self, base, batch: int, ctx: float):
        """``verify_s`` from its value at ``ctx_ref`` (``base``, array-like): the context term of
        ``batch`` requests at mean context ``ctx`` added, clamped at 0."""
        return np.maximum(base + self.ctx_s * batch * (float(ctx) - self.ctx_ref), 0.0)

    def verify_curve(self, batch: int, buckets: tuple) -> tuple[np.ndarray, np.ndarray]:
        """``(rows, seconds)`` of a verify holding ``batch + i`` distinct nodes, i = 0 .. the last
        bucket less ``batch``: the smallest of ``buckets`` (sorted, the first >= batch) that holds
        them, or the cheapest that does where it costs ``BUCKET_MARGIN`` less (the smallest of equal
        cost), and ``verify_s`` of it at ``ctx_ref`` before the context term and the clamp at 0
        (``with_ctx`` adds both). The cheapest, not always the smallest: a table need not rise with
        rows (on a GPU the rows past the small-M path run the general kernels, measured cheaper than
        the small-M path's largest buckets; benchmarks/budget_h100.json), and padding rows repeat
        the roots, so a verify padded into a larger, cheaper bucket gives the same tokens. The margin
        keeps the warm-up's timing noise (a few replays per bucket) from padding verifies into
        larger graphs; a kernel switch saves far more. A verify of T rows holding N nodes costs
        ``g(T) + expert_s E(N)``, ``g(T)`` the table at T less ``expert_s E(T)``, so the cheapest
        bucket for N is the suffix minimum of g over the buckets from N. Made once per batch,
        buckets and table (the policy prices every candidate of every round on it); made again when
        the table changes (the warm-up's points, ``expert_s``)."""
        hit = self._curves.get((batch, buckets))
        # the table is a tuple, replaced (never changed) when a point is added: the same object is the same table
        if hit is None or hit[0] is not self.verify or hit[1] != self.expert_s:
            if len(self._curves) >= 64:
                self._curves.clear()
            b = np.asarray(buckets, np.int64)
            b = b[b >= batch]
            if not self.verify:
                raise BudgetError(NO_VERIFY_COSTS)
            g = _interp(self.verify, b) - self.expert_s * experts_touched(b)
            # suffix minimum of g and its bucket, ties to the smaller bucket (fewer rows, same price)
            best = np.empty(len(b), np.int64)
            best[-1] = len(b) - 1
            for i in range(len(b) - 2, -1, -1):
                best[i] = i if g[i] <= g[best[i + 1]] else best[i + 1]
            nodes = np.arange(batch, int(b[-1]) + 1)
            small = np.searchsorted(b, nodes)
            fan = self.expert_s * experts_touched(nodes)
            cheaper = g[best[small]] + fan < (1.0 - BUCKET_MARGIN) * (g[small] + fan)
            rows = b[np.where(cheaper, best[small], small)]
            base = self._verify_base(rows, nodes)
            rows.flags.writeable = base.flags.writeable = False
            hit = self._curves[(batch, buckets)] = (self.verify, self.expert_s, rows, base)
        return hit[2], hit[3]

    def _verify_base(self, rows, nodes):
        """``verify_s`` before its context term: the table at ``rows`` less the fan-out saving."""
        if not self.verify:
            raise BudgetError(NO_VERIFY_COSTS)
        rows = np.asarray(rows, np.float64)
        nodes = np.minimum(np.asarray(nodes, np.float64), rows)
        return _interp(self.verify, rows) - self.expert_s * (experts_touched(rows) - experts_touched(nodes))

    def draft_s(self, batch: int) -> float:
        """Seconds of the draft at this batch size (0 until one is given or measured)."""
        return _interp_at(self.draft, float(batch)) if self.draft else 0.0

    def fixed_s(self, batch: int) -> float:
        """Seconds of the round's other work at this batch size (0 until given or measured)."""
        return _interp_at(self.fixed, float(batch)) if self.fixed else 0.0

    def add_verify(self, rows: int, seconds: float) -> None:
        """A measured point (the warm-up's): the mean with an earlier point of the same rows."""
        old = self._verify_points.get(float(rows))
        self._verify_points[float(rows)] = seconds if old is None else 0.5 * (old + seconds)
        self.verify = tuple(sorted(self._verify_points.items()))

    def verify_scale(self, batch: int) -> float:
        """How many seconds of round a modelled verify second costs at this batch size, as measured
        (``learn_round``); 1 until rounds of different modelled verifies say otherwise.

        The table prices a verify as the warm-up timed it (its graph replayed alone), and the round's
        other work goes to the fixed term, a mean per batch size. Work that grows with the rows but is
        not in the table (host work that the verify's rows lengthen, a verify slower inside the round
        than alone) then lands in the fixed term, where every choice pays the same share of it: more
        nodes look cheaper than they are. So the round's measured seconds less the draft, y, are
        fitted as ``f + s x`` over the rounds, x the modelled verify seconds, by decayed least squares
        with a ridge towards s = 1 of ``SCALE_PRIOR x_mean^2`` (rounds of one bucket leave s at 1:
        the fit moves only as far as the spread of the verifies chosen shows), clipped to
        [``SCALE_MIN``, ``SCALE_MAX``]."""
        m = self._scale.get(int(batch))
        if m is None or m[0] <= 0:
            return 1.0
        w, sx, sy, sxx, sxy = m
        xm, ym = sx / w, sy / w
        lam = SCALE_PRIOR * xm * xm
        cxx, cxy = max(sxx - w * xm * xm, 0.0), sxy - w * xm * ym
        return min(max((cxy + lam) / (cxx + lam), SCALE_MIN), SCALE_MAX) if lam > 0 else 1.0

    def verify_scales(self) -> dict:
        """``{batch: verify_scale}`` of every batch size a round was learned at (for reports)."""
        return {b: self.verify_scale(b) for b in sorted(self._scale)}

    def learn_round(self, batch: int, draft_s: float | None, round_s: float, verify_model_s: float) -> None:
        """A measured round (the engine's ``AutoRound.observe_times``, the simulator's true costs):
        its draft seconds (None: not measured apart) and its whole seconds, and the modelled verify
        of its choice before the scale (``Choice.verify_model_s``). Updates the verify scale's fit
        (``verify_scale``), then the running means of the draft and of the rest of the round past
        the scaled verify (``OVERHEAD_DECAY``)."""
        b = int(batch)
        x, y = float(verify_model_s), float(round_s) - (draft_s or 0.0)
        m = self._scale.setdefault(b, [0.0, 0.0, 0.0, 0.0, 0.0])
        for i, v in enumerate((1.0, x, y, x * x, x * y)):
            m[i] = SCALE_DECAY * m[i] + v
        other = max(y - self.verify_scale(b) * x, 0.0)
        old_d, old_f = dict(self.draft).get(float(b)), dict(self.fixed).get(float(b))
        mix = lambda old, new: new if old is None else OVERHEAD_DECAY * old + (1 - OVERHEAD_DECAY) * new  # noqa: E731
        self.set_overheads(b, draft_s=None if draft_s is None else mix(old_d, draft_s), fixed_s=mix(old_f, other))

    def set_overheads(self, batch: int, draft_s: float | None = None, fixed_s: float | None = None) -> None:
        for name, v in (("draft", draft_s), ("fixed", fixed_s)):
            if v is not None:
                pts = dict(getattr(self, name))
                pts[float(batch)] = max(float(v), 0.0)
                setattr(self, name, tuple(sorted(pts.items())))

    @classmethod
    def fanout(cls, base_s: float, row_s: float, expert_s: float, draft_s: float = 0.0, fixed_s: float = 0.0,
               max_rows: int = 1 << 15, ctx_s: float = 0.0, ctx_ref: int = 0) -> CostModel:
        """The MoE shape as a table: a verify of T distinct rows costs ``base_s + row_s T + expert_s
        E(T)`` (E = experts touched per layer; ``expert_s``: seconds per touched expert summed over
        the MoE layers), sampled at every T up to 256 and geometrically past it."""
        rows = sorted(set(range(1, 257)) | {int(x) for x in np.geomspace(256, max_rows, 64)})
        pts = [(r, base_s + row_s * r + expert_s * float(experts_touched(r))) for r in rows]
        return cls(verify=pts, expert_s=expert_s, draft=((1, draft_s),), fixed=((1, fixed_s),),
                   ctx_s=ctx_s, ctx_ref=ctx_ref, source="fanout")

    @classmethod
    def load(cls, path) -> CostModel:
        """A cost table from JSON. Either this module's own format (``to_json``): ``{"verify":
        [[rows, s], ...], "expert_s", "ctx_ref", "ctx_s", "draft": [[batch, s], ...], "fixed": [...]}``,
        or ``{"rows": [...]}``: the JSON of ``ddtree-rtc bench round`` / ``bench node`` (the verify
        stage's row per case: ``us`` with ``extra`` ``batch``, ``budget``, ``chain``, ``ctx``,
        ``stage: "verify"``; the round summary's ``graph_us`` minus its verify gives the other work),
        or flat rows ``{batch, budget ("chain": depth nodes), verify_us, fixed_us?, ctx?}``. A verify
        of ``budget`` at ``batch`` is the point rows = batch x (1 + budget). Their drafts are not
        timed (the oracle's host swaps), so the draft costs 0 unless the own format gives it."""
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise BudgetError(f"decode.cost_table {p}: cannot read it as JSON ({e})") from None
        try:
            return cls.from_dict(data, source=str(p))
        except (KeyError, TypeError, ValueError) as e:
            raise BudgetError(f"decode.cost_table {p}: {e}") from None

    @classmethod
    def from_dict(cls, data: dict, source: str = "given") -> CostModel:
        if "verify" in data:
            known = {"verify", "expert_s", "ctx_ref", "ctx_s", "draft", "fixed"}
            unknown = set(data) - known - {"source", "device", "date", "commit"}
            if unknown:
                raise BudgetError(f"unknown key(s) {sorted(unknown)}; known: {sorted(known)}")
            return cls(**{k: data[k] for k in known if k in data}, source=source)
        rows = data.get("rows")
        if not isinstance(rows, list):
            raise BudgetError("expected 'verify' (a cost table) or 'rows' (bench round / bench node JSON)")
        verify, fixed, ctxs, groups = {}, {}, set(), set()
        for r in rows:
            e = r.get("extra", r) if isinstance(r, dict) else {}
            if "batch" not in e or "budget" not in e:
                continue
            nodes = int(e.get("depth", 7)) if e.get("chain") or e["budget"] == "chain" else int(e["budget"])
            rows_n = int(e["batch"]) * (1 + nodes)
            if "verify_us" in r:  # the flat form: one row per (batch, budget)
                us, other = float(r["verify_us"]), r.get("fixed_us")
            elif e.get("stage") == "verify" and "us" in r:  # bench round / bench node: the verify stage's row
                us, other = float(r["us"]), None
            elif "graph_us" in e and "stage_us" in e:  # their round summary: the rest of the device round
                fixed.setdefault(int(e["batch"]), []).append((e["graph_us"] - e["stage_us"]["verify"]) * 1e-6)
                continue
            else:
                continue
            verify.setdefault(rows_n, []).append(us * 1e-6)
            if other is not None:
                fixed.setdefault(int(e["batch"]), []).append(float(other) * 1e-6)
            ctxs.add(int(e.get("ctx", 0)))
            groups.add((e.get("layout"), e.get("small_m")))
        if not verify:
            raise BudgetError("no verify row (a row with batch and budget, and verify_us or stage 'verify')")
        if len(ctxs) > 1 or len(groups) > 1:
            raise BudgetError(f"rows at several contexts {sorted(ctxs)} or layouts / small_m "
                              f"{sorted(map(str, groups))}: keep one of each per cost table")
        mean = lambda d: tuple((k, float(np.mean(v))) for k, v in d.items())  # noqa: E731
        return cls(verify=mean(verify), draft=(), fixed=mean(fixed), ctx_ref=ctxs.pop(), source=source)

    def to_json(self) -> dict:
        return {"verify": [list(p) for p in self.verify], "expert_s": self.expert_s, "ctx_ref": self.ctx_ref,
                "ctx_s": self.ctx_s, "draft": [list(p) for p in self.draft],
                "fixed": [list(p) for p in self.fixed], "source": self.source}


def fit_expert_s(batch: int, rows: int, full_s: float, lean_s: float) -> float | None:
    """The fan-out slope from a full verify of ``rows`` rows (every row a distinct node) and a lean
    one (the roots and their copies: one distinct node per request) of the same shape."""
    span = float(experts_touched(rows) - experts_touched(batch))
    return None if span <= 1e-9 else max(full_s - lean_s, 0.0) / span


# -- the policy ----------------------------------------------------------------------------------


@dataclass
class Choice:
    counts: np.ndarray  # [B] nodes verified per request (the cut)
    rows: int  # the verify's rows in all (its bucket: the roots, the nodes and padding)
    expected: np.ndarray  # [B] predicted tokens (bonus included)
    seconds: float  # the modelled round (fixed + draft + verify)
    verify_s: float  # the modelled verify, scaled (CostModel.verify_scale)
    verify_model_s: float = 0.0  # the same before the scale (what the scale's fit regresses on)
    weights: np.ndarray | None = None  # the calibration's weights of its round (expected is remade under them)
    valued: np.ndarray | None = None  # the weights it chose by (the calibration's and the optimism)


@functools.lru_cache(maxsize=256)
def _holding(buckets: tuple, batch: int) -> tuple:
    """The distinct buckets of at least ``batch`` rows, sorted."""
    return tuple(sorted({int(x) for x in buckets if int(x) >= batch}))


ROW_BUCKETS_SMALL = 8  # verify rows: every multiple of this up to 32, then two buckets per octave


def row_buckets(batch: int, width: int) -> tuple[int, ...]:
    """Verify row counts (graphs captured per bucket) for ``batch`` requests of at most ``width``
    rows each: the roots alone (``batch``), the multiples of 8 to 32, then 48, 64, 96, 128, 192, ...
    (padding below a third of the rows), and all of them (``batch * width``)."""
    most = batch * width
    out, t = {batch, most}, ROW_BUCKETS_SMALL
    while t < most:
        if t > batch:
            out.add(t)
        if t < 32:
            t += ROW_BUCKETS_SMALL
        else:
            p = 1 << (t.bit_length() - 1)  # t is 2^k or 1.5 x 2^k
            t = p + p // 2 if t == p else 2 * p
    return tuple(sorted(out))


def choose(values: np.ndarray, caps, cost: CostModel, buckets, ctx: float = 0.0, drafted: bool = True) -> Choice:
    """The batch's node counts. ``values`` ``[B, M]``: calibrated P of nodes 1..M of each request's
    tree in pop order (0 past its nodes); ``caps`` ``[B]``: the most nodes each request may have;
    ``buckets``: the verify row counts there are shapes for (``row_buckets``; the largest bounds the
    rows). The candidates are taken in decreasing value (a request's values are first made
    non-increasing, so it always keeps a prefix of its pop order); every prefix of that order is
    priced at the cheapest bucket that holds its rows (B roots + its nodes; ``verify_curve``) and
    the best (tokens per second, ties to more tokens) wins."""
    values = np.asarray(values, np.float64)
    b, m = values.shape
    caps = np.minimum(np.asarray(caps, np.int64), m)
    given = tuple(buckets)
    buckets = _holding(given, b)
    if not buckets:
        raise BudgetError(f"no verify row bucket holds the {b} roots of the batch (buckets {list(given)})")
    over = cost.fixed_s(b) + (cost.draft_s(b) if drafted else 0.0)
    v = np.where(np.arange(m)[None, :] < caps[:, None], values, -np.inf)
    mono = (np.minimum.accumulate(v, axis=1) if m else v).ravel()
    order = (-mono).argsort(kind="stable")
    sorted_mono = mono[order]
    order = order[np.isfinite(sorted_mono) & (sorted_mono > 0)][: buckets[-1] - b]
    o_req, o_val = order // max(m, 1), values.ravel()[order]
    gain = np.empty(len(order) + 1)
    gain[0] = 0.0
    o_val.cumsum(out=gain[1:])
    # prefix i holds b + i distinct nodes (the roots and its nodes), priced at the bucket holding them
    rows, base = cost.verify_curve(b, buckets)
    rows = rows[: len(order) + 1]
    model = cost.with_ctx(base[: len(order) + 1], b, ctx)
    ver = model * cost.verify_scale(b)
    rate = (b + gain) / (over + ver)
    i = int(np.flatnonzero(rate >= rate.max() * (1 - 1e-12))[-1])
    counts = np.bincount(o_req[:i], minlength=b).astype(np.int64)
    cum = np.zeros((b, m + 1))
    values.cumsum(axis=1, out=cum[:, 1:])
    return Choice(counts, int(rows[i]), 1.0 + cum[np.arange(b), counts], over + float(ver[i]), float(ver[i]),
                  float(model[i]))


# -- metrics -------------------------------------------------------------------------------------


@dataclass
class BudgetStats:
    """What the budget did: per request-round the nodes verified and the predicted tokens (auto
    only), per round the modelled verify and round seconds (any mode, with a cost model)."""

    counts_hist: dict = field(default_factory=dict)  # nodes verified per request-round -> count
    rows_hist: dict = field(default_factory=dict)  # verify rows per round (the bucket) -> count
    predicted: float = 0.0  # sum of predicted tokens over the request-rounds that had a prediction
    measured: float = 0.0  # sum of emitted tokens over the same request-rounds
    predicted_rounds: int = 0
    tokens: int = 0  # every request-round's tokens (for tokens per cost)
    verify_s: float = 0.0  # modelled verify seconds, summed over rounds
    round_s: float = 0.0  # modelled round seconds
    drafted_rounds: int = 0
    skipped_drafts: int = 0
    last_counts: tuple = ()  # the last round's nodes per request (for /metrics' histogram)

    def add_round(self, counts, rows: int, tokens, expected=None, verify_s: float | None = None,
                  round_s: float | None = None, drafted: bool = True) -> None:
        self.last_counts = tuple(int(n) for n in np.asarray(counts).tolist())
        for n in self.last_counts:
            self.counts_hist[n] = self.counts_hist.get(n, 0) + 1
        self.rows_hist[int(rows)] = self.rows_hist.get(int(rows), 0) + 1
        tokens = np.asarray(tokens)
        self.tokens += int(tokens.sum())
        if expected is not None:
            self.predicted += float(np.sum(expected))
            self.measured += float(tokens.sum())
            self.predicted_rounds += len(tokens)
        self.verify_s += verify_s or 0.0
        self.round_s += round_s or 0.0
        self.drafted_rounds += bool(drafted)
        self.skipped_drafts += not drafted

    @property
    def tau_predicted(self) -> float | None:
        return self.predicted / self.predicted_rounds if self.predicted_rounds else None

    @property
    def tau_measured(self) -> float | None:
        return self.measured / self.predicted_rounds if self.predicted_rounds else None

    @property
    def tokens_per_verify_s(self) -> float | None:
        return self.tokens / self.verify_s if self.verify_s else None

    @property
    def tokens_per_round_s(self) -> float | None:
        return self.tokens / self.round_s if self.round_s else None

    def summary(self) -> dict:
        return {"nodes_hist": {str(k): v for k, v in sorted(self.counts_hist.items())},
                "rows_hist": {str(k): v for k, v in sorted(self.rows_hist.items())},
                "tau_predicted": self.tau_predicted, "tau_measured": self.tau_measured,
                "tokens_per_verify_s": self.tokens_per_verify_s, "tokens_per_round_s": self.tokens_per_round_s,
                "drafted_rounds": self.drafted_rounds, "skipped_drafts": self.skipped_drafts}


# -- the per-round driver ------------------------------------------------------------------------


PROBE_Z, PROBE_MAX = 2.0, 2.0  # a probe's optimism: z of the upper bound, and its largest factor
OFF_EXPLORE = slice(1, 2)  # the path classes the start-up raises: one rank-1 edge
OFF_EVIDENCE = 8.0  # accepted nodes' worth of their evidence that ends the start-up
# the start-up's largest optimism (nothing measured off the top-1 path yet): past the oracle's 4.8x understatement
# of its rank-1 token at K2.6's vocabulary (at 4x a deep tree that pays only by it was never verified)
OFF_PROBE_MAX = 8.0
LAG = 2  # lagged: rounds from the last tree learned to the round chosen (chosen during the verify before it)


class AutoBudget:
    """``decode.budget: auto`` for one engine: calibration, cost model, verify row buckets and the
    choice of whether to draft at all (``off_path``: the calibration's off-path factor, ``Calibration``;
    False keeps the per-depth model alone, for comparisons). A request whose last drafted round got no nodes is held: it
    decodes autoregressively (no draft, unless others of the batch draft) and every
    ``probe_every``-th round probes, i.e. drafts and values its nodes optimistically (``weights``),
    so a drafter better than its probabilities is found out (verified nodes are the calibration's
    only evidence). ``bucketed``: the verify rows come in ``row_buckets`` (CUDA graphs: one per
    bucket), else any row count is a shape (eager forwards). ``max_rows``: the most verify rows of
    a round (the engine's row-invariant scheduling: SMALL_M_MAX_TOKENS, so the verify stays on the
    small-M path), or None (``batch * width``): the batch's nodes are then shared within it.
    ``lagged``: the round's counts are chosen before its build from the requests' past values
    (``choose_lagged``), so no host round trip lies between the build and the verify; else from
    the round's own tree (``choose``, after a sync)."""

    def __init__(self, max_budget: int, depth: int, cost: CostModel | None, bucketed: bool = False,
                 probe_every: int = 8, explore_every: int = 32, max_rows: int | None = None,
                 lagged: bool = True, history_decay: float = HISTORY_DECAY, off_path: bool = True):
        from ...reference.tree_build import MAX_BUDGET

        if not 1 <= int(max_budget) <= MAX_BUDGET:
            raise BudgetError(f"decode.max_budget {max_budget} is outside 1..{MAX_BUDGET} (the tree buffers' maximum)")
        if probe_every < 1:
            raise BudgetError(f"probe_every must be >= 1, got {probe_every}")
        if max_rows is not None and int(max_rows) < 1:
            raise BudgetError(f"max_rows must be >= 1 (verify rows of a round), got {max_rows}")
        self.max_rows = None if max_rows is None else int(max_rows)
        self.max_budget, self.depth = int(max_budget), depth
        self.cost = cost if cost is not None else CostModel(draft=(), fixed=(), measured=True, source="warm-up")
        self.bucketed = bool(bucketed)
        self._buckets: dict = {}  # batch -> its buckets (fixed by the settings above)
        self.calibration = Calibration(depth, off_path=off_path)
        self.lagged = bool(lagged)
        self.history = ValueHistory(self.max_budget, depth, history_decay)
        self.probe_every, self.explore_every = probe_every, explore_every
        self.stats = BudgetStats()
        self._drafted = 0
        self._ar_rounds: dict = {}  # rid -> rounds left before a held request probes
        self._held: set = set()  # requests whose last drafted round got no node
        self._off_started = False  # the off-path evidence has once reached OFF_EVIDENCE

    def should_draft(self, rids) -> bool:
        """Whether the round drafts: some request is not held (or probes), and the rows hold more
        than the roots (at ``max_rows`` roots no node fits, so a draft would be wasted)."""
        room = self.top_rows(len(rids)) > len(rids)
        return room and any(self._ar_rounds.get(r, 0) <= 0 for r in rids)

    def skipped(self, rids) -> None:
        for r in rids:
            self._ar_rounds[r] = self._ar_rounds.get(r, 0) - 1

    def probing(self, rid) -> bool:
        """Whether a held request probes this round."""
        return rid in self._held and self._ar_rounds.get(rid, 0) <= 0

    def round_weights(self, rids) -> tuple[np.ndarray, np.ndarray]:
        """``(valued, honest)``, each ``[B, depth + 1, OFF_CLASSES]``: the node-value weights for this
        round (by depth and path class, ``Calibration.weights``): the calibration's, raised by an
        upper confidence bound
        ``exp(PROBE_Z / sqrt(n + 1))`` (at most ``PROBE_MAX``), n the accepted nodes the
        calibration's evidence at that depth stands for (wide where nothing has been measured
        lately, narrow where much has): on a held request's probe, so a drafter better than its
        probabilities is found out; and every ``explore_every``-th drafted round for every request,
        there only up to the drafter's own probability (factor 1), so depths and path classes the
        calibration marked down long ago are verified and measured again. Off the top-1 path:
        while the tree is the chain nothing off it is measured, and a drafter that understates its
        other ranks would never be found out (the exploring rounds alone give too little evidence
        at batch 1 to pass the gate in a few hundred rounds). So until the rank-1 class
        (``OFF_EXPLORE``) has once stood for ``OFF_EVIDENCE`` accepted nodes (``off_evidence``),
        every round raises that class by the same bound on its evidence (at most
        ``OFF_PROBE_MAX``): the branches off the chain at its rank-1 tokens, the off-path nodes
        of most value, and a start-up cost only (a calibrated drafter in the simulator: 0.998x of its
        choice without it over 300 rounds where nodes are cheap, 1.000x on the MoE fan-out
        table). The weights without the optimism (``honest``) value the round's predicted tokens
        (``learn``); ``choose`` takes the pair."""
        cal = self.calibration
        w = honest = cal.weights(rids)
        self._drafted += 1
        explore = self._drafted % self.explore_every == 0
        held = self._held
        probe = [i for i, r in enumerate(rids) if r in held and self.probing(r)]
        if explore or probe:  # the bound is made only where it raises something
            bound = np.minimum(np.exp(PROBE_Z / np.sqrt(cal.depth_factors_used() * cal.pred + 1.0)), PROBE_MAX)
            bound = bound[None, :, None]
        w = np.minimum(w * bound, np.maximum(w, 1.0)) if explore else w.copy()
        if not self._off_started:
            ev = cal.off_evidence()[OFF_EXPLORE]
            self._off_started = bool((ev >= OFF_EVIDENCE).all())
            if cal.off_path and not self._off_started:
                w[:, :, OFF_EXPLORE] *= np.minimum(np.exp(PROBE_Z / np.sqrt(ev + 1.0)),
                                                   OFF_PROBE_MAX)
        if probe:
            w[probe] *= bound
        return w, honest

    @property
    def width(self) -> int:
        """The most verify rows of one request: its root and max_budget nodes."""
        return 1 + self.max_budget

    def buckets(self, batch: int) -> tuple[int, ...]:
        """The verify row counts of a batch: ``graph_buckets``, or (eagerly) every count from the
        roots alone to every request at max_budget; none over ``max_rows``."""
        hit = self._buckets.get(batch)
        if hit is None:
            hit = self._buckets[batch] = (self.graph_buckets(batch) if self.bucketed
                                          else tuple(range(batch, self.top_rows(batch) + 1)))
        return hit

    def graph_buckets(self, batch: int) -> tuple[int, ...]:
        """``row_buckets`` of a batch under ``max_rows``: those up to it, the roots alone always, and
        the cap itself where the batch's rows could pass it (the verify graphs; the warm-up times
        these)."""
        top = self.top_rows(batch)
        return tuple(sorted({t for t in row_buckets(batch, self.width) if t <= top} | {top}))

    def top_rows(self, batch: int) -> int:
        """The most verify rows of a batch: every request at max_budget, at most ``max_rows`` (the
        roots always fit: a group never holds more requests than rows)."""
        most = batch * self.width
        return most if self.max_rows is None else max(batch, min(self.max_rows, most))

    def choose(self, values, caps, ctx: float, weights=None) -> Choice:
        """The batch's counts for ``values`` (``choose``); ``weights``: the ``(valued, honest)`` pair
        of ``round_weights`` they were valued by, kept on the choice (``learn`` remakes its predicted
        tokens under ``honest``)."""
        c = choose(values, caps, self.cost, self.buckets(len(values)), ctx, drafted=True)
        if weights is not None:
            c.valued, c.weights = weights
        return c

    def choose_lagged(self, rids, caps, ctx: float) -> Choice | None:
        """A round's counts before its build (``lagged``): the requests' node values predicted by
        ``ValueHistory`` ``LAG`` rounds ahead (the engine chooses a round's counts during the
        verify of the round before it, whose tree is not read yet), under this round's weights;
        None when not lagged or before any drafted round has been learned (the round then
        chooses from its own tree)."""
        if not self.lagged or not self.history.ready():
            return None
        w = self.round_weights(rids)
        return self.choose(self.history.values(rids, w[0], LAG), caps, ctx, w)

    def ar_choice(self, batch: int, ctx: float) -> Choice:
        return choose(np.zeros((batch, 0)), np.zeros(batch, np.int64), self.cost, (batch,), ctx, drafted=False)

    def observe(self, rids, raw, node_depth, choice: Choice, accept_len, drafted: bool, classes=None,
                off_accepted=None) -> None:
        """After the accept: ``hold`` then ``learn``."""
        self.hold(rids, choice, drafted)
        self.learn(rids, raw, node_depth, choice, accept_len, drafted, classes, off_accepted)

    def hold(self, rids, choice: Choice, drafted: bool) -> None:
        """Right after the accept (the next round's ``should_draft`` reads it): the AR hold of the
        requests that got no nodes."""
        if not drafted:
            return
        for r, n in zip(rids, choice.counts):
            if n > 0:
                self._held.discard(r)
                self._ar_rounds[r] = 0
            elif r not in self._held or self._ar_rounds.get(r, 0) <= 0:  # held now, or probed
                self._held.add(r)
                self._ar_rounds[r] = self.probe_every - 1
            else:  # held, drafted beside others: counts down to its probe as a skipped round does
                self._ar_rounds[r] -= 1

    def learn(self, rids, raw, node_depth, choice: Choice, accept_len, drafted: bool, classes=None,
              off_accepted=None) -> None:
        """What a round teaches: calibration, value history, the stats (a lagged engine round learns
        while the device runs the next round's verify). ``raw`` / ``node_depth``: the round's built
        trees (``ValueHistory.update``); ``classes`` their path classes and ``off_accepted`` the
        accepted nodes of each (``tree_paths``, ``class_accepted``; None: all on the top-1 path).
        The predicted tokens are remade from the round's own tree, under the calibration's weights
        of the round (``honest``: a probe's and an exploring round's optimism left out; the same
        estimator as a choice from the tree: its verified nodes' calibrated P)."""
        if drafted:
            self.calibration.observe(rids, raw, node_depth, choice.counts, accept_len, classes, off_accepted)
            self.history.update(rids, raw, node_depth, classes)
            if choice.weights is not None:
                vals = raw * node_weights(np, choice.weights, node_depth, classes)
                cum = np.cumsum(vals[:, 1:], axis=1)
                n = np.asarray(choice.counts, np.int64)
                choice.expected = 1.0 + np.where(n > 0, cum[np.arange(len(n)), np.maximum(n - 1, 0)], 0.0)
        self.stats.add_round(choice.counts, choice.rows, accept_len,
                             expected=choice.expected if drafted else None,
                             verify_s=choice.verify_s, round_s=choice.seconds, drafted=drafted)

    def release(self, rid) -> None:
        self.calibration.release(rid)
        self.history.release(rid)
        self._ar_rounds.pop(rid, None)
        self._held.discard(rid)
