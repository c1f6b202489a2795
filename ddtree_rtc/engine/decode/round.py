"""One DDTree round for a batch of running requests, top to bottom as the algorithm
(docs/architecture.md, "The DDTree round"):

    draft   -> the drafter's logits [B, depth, V] after each request's bonus token (the root)
    build   -> per-depth top-k log-probs and the best-first tree of each request's budget
    verify  -> ONE target forward over [root, nodes] of every tree, packed one request after
               another (engine.runner): node i at RoPE position prefix + depth_i, written to cache
               position prefix + i, seeing the committed prefix and its own ancestors only; hidden
               states at the drafter's target layers
    choose  -> the target's token at every node: argmax at T = 0; at T > 0 one sample per node
               from the target's (temperature, top-p) distribution, keyed by (request, position)
               like the autoregressive step that node stands for
    accept  -> walk from the root along children that match the target's choice; the first
               unmatched choice is the bonus token (so every emitted token is the target's own
               choice given the tokens before it: the output equals autoregressive decoding's)
    commit  -> the accepted nodes' KV rows move to prefix, prefix + 1, ...; their hidden states
               (root first) join the drafter's context; the emitted tokens go to the requests

Chain mode (DFlash's linear drafting) is the same round with k = 1 and budget = depth. The device's
work is enqueued first (draft, top-k, build: none needs the verify's plan), then the host plans the
verify (cache slots, attention plan, row map: ``runner.plan_tree``) while the device drafts; the
plan's host-to-device copies come from page-locked staging (``Backend.copy_in``), so the host queues
them behind the build without waiting for it, and the verify follows them on the same stream. The
tree's tokens, positions and mask reach the verify forward on the device (engine.runner). From the
top-k to the KV commit (``SpeculativeRound.device_half``) nothing waits for the host, so at T = 0 the
bench (``bench round``) captures that half as one CUDA graph. The host then reads the accepted
lengths and tokens, once per round.

Stages are timed by name on the engine's StageClock (engine.clock): draft, top-k, build, plan, then
the rest of DEVICE_STAGES; the host half of the commit adds to "commit".

A fixed budget's verify has the rows of the requests' budgets (1 + budget each; per-request budgets
differ), rounded up to a row bucket (engine/decode/budget.row_buckets) when they are not all the
round's. With ``decode.budget: auto`` (``auto``: engine/decode/budget.AutoBudget) the tree is built at
the maximum budget, each request's is cut to the node count the cost-aware policy chooses, and the
verify packs the cut trees into the cheapest row bucket that holds them (engine/decode/auto.py).
Lagged (``decode.budget_choice: lagged``, the default), the round is a fixed budget's in its order:
its counts were chosen during the last round's verify, from the requests' past trees (the host had
nothing else to do there but wait for the sync), the plan and the cut's copy follow the build's
launch as a fixed budget's plan does, the cut is a device minimum after the build and nothing is
read from the device before the round's sync; then the host reads the built tree and keeps it to
learn during the next round's verify (``_pending``), with the next round's counts (``_next``, used
when its batch is the same and none of it starts a probe). Choosing from the round's own tree
(``tree``; a lagged engine's first round and its measuring ones), the host reads the build's scores,
depths and node counts once before the verify and values the nodes there (stage "budget"), and the
plan needs the choice: from that sync to the verify's launch the device idles, so the host plans the
last round's cut while the device drafts and builds, and keeps that plan when the choice repeats it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..request import RequestError
from .budget import class_accepted, tree_paths
from .tree import TreeBuffers, TreeShape

DEVICE_STAGES = ("top-k", "build", "verify", "choose", "accept", "commit")


@dataclass
class RoundStats:
    rounds: int = 0  # request-rounds
    tokens: int = 0  # emitted (bonus included)
    accept_hist: dict = field(default_factory=dict)  # tokens per request-round -> count
    depth_hits: list = field(default_factory=list)  # [d]: request-rounds whose walk reached depth d+1
    trace: list = field(default_factory=list)  # (rid, emitted) per request-round, in order

    def add(self, emitted: int, rid=None) -> None:
        self.trace.append((rid, emitted))
        self.rounds += 1
        self.tokens += emitted
        self.accept_hist[emitted] = self.accept_hist.get(emitted, 0) + 1
        while len(self.depth_hits) < emitted - 1:
            self.depth_hits.append(0)
        for d in range(emitted - 1):
            self.depth_hits[d] += 1

    @property
    def tau(self) -> float | None:
        """Mean tokens per round, the bonus token included."""
        return self.tokens / self.rounds if self.rounds else None

    def acceptance_by_depth(self) -> list[float]:
        """Fraction of request-rounds whose accepted path reached depth d + 1."""
        return [h / self.rounds for h in self.depth_hits] if self.rounds else []


class SpeculativeRound:
    """The round's buffers and its ``run(requests)``; ``mode`` 'ddtree' or 'chain'."""

    def __init__(self, model, cache, pages, runner, drafter, mode: str, budget: int, sampler, clock, auto=None):
        """``cache``: the target's PagedKVCache, ``pages``: its PageAllocator; ``runner``: the
        engine's ModelRunner (plans the verify forward, replays its graphs); ``sampler``: the
        engine's token choice (engine.sampler); ``clock``: the StageClock the stages are timed on;
        ``auto``: an AutoBudget (decode.budget auto; ``budget`` is then its max_budget) or None."""
        if mode not in ("ddtree", "chain"):
            raise ValueError(f"speculative mode must be 'ddtree' or 'chain', got {mode!r}")
        self.model, self.cache, self.pages, self.runner, self.drafter = model, cache, pages, runner, drafter
        self.mode, self.sampler, self.clock = mode, sampler, clock
        self.budget = drafter.depth if mode == "chain" else budget
        TreeShape(batch=1, budget=self.budget, depth=drafter.depth, vocab=model.cfg.vocab_size)  # checks ranges
        self.hidden_layers = tuple(drafter.target_layer_ids)
        self.stats = RoundStats()
        self._buffers: dict[int, TreeBuffers] = {}
        self.auto = auto
        if auto is not None:
            from .auto import AutoRound

            if mode != "ddtree" or auto.max_budget != self.budget:
                raise ValueError(f"budget auto needs mode 'ddtree' and max_budget {auto.max_budget} == the round's "
                                 f"budget {self.budget}")
            self._auto_round = AutoRound(auto, model.backend, runner)
            self._last_cut = None  # (rids, counts, rows) of the last drafted auto round
            self._next = None  # lagged: (rids, caps, choice) made for the next round during this one's verify
            self._pending = None  # lagged: the last round's observe arguments, learned during this round's verify

    @property
    def width(self) -> int:
        """Verify rows one request may take: its root and every node slot of the tree buffers."""
        return 1 + self.budget

    @property
    def min_rows(self) -> int:
        """Verify rows one request takes at least (the engine's row-invariant grouping packs by it):
        with a fixed budget all of ``width``; with the auto budget its root, the nodes being shared
        within the round's rows (``AutoBudget.max_rows``)."""
        return 1 if self.auto is not None else self.width

    def tail(self, req) -> int:
        """Cache rows a round writes past the committed prefix: the root and every node slot."""
        return 1 + self.budget

    def shapes(self, batch: int) -> list[tuple]:
        """The runner shapes (engine.runner) a round of ``batch`` requests may verify in: with the
        auto budget every row bucket the policy may choose (``AutoBudget.buckets``, the roots alone
        among them); with a fixed budget every request at the round's budget (per-request budgets
        below it verify in a row bucket, captured at its first use)."""
        if self.auto is not None:
            return [(batch, t, self.width) for t in self.auto.buckets(batch)]
        return [(batch, batch * self.width, self.width)]

    def budget_of(self, req) -> int:
        b = self.budget if req.budget is None or self.mode == "chain" else req.budget
        if not 0 <= b <= self.budget:
            raise RequestError(f"request {req.rid}: budget {b} outside 0..{self.budget} (decode.budget)")
        return b

    def buffers_for(self, batch: int) -> TreeBuffers:
        """The tree buffers of a batch size (made at its first round, then reused)."""
        bufs = self._buffers.get(batch)
        if bufs is None:
            shape = TreeShape(batch=batch, budget=self.budget, depth=self.drafter.depth,
                              vocab=self.model.cfg.vocab_size, chain=self.mode == "chain")
            bufs = self._buffers[batch] = TreeBuffers(self.model.backend, shape)
        return bufs

    def release(self, rid) -> None:
        """The request finished or was cancelled: the auto budget forgets it (after learning the last
        round, which may hold it)."""
        if self.auto is not None:
            self._learn_pending()
            self.auto.release(rid)

    def _learn_pending(self) -> None:
        """Learn the last round (``_pending``; a lagged engine does it during this round's verify): a
        tree read after its round (``parents`` given) gets its depths and path classes here, and
        every round its accepted nodes per class, host work kept off the round trip."""
        if self._pending is not None:
            rids, raw, depth, choice, accept_len, drafted, classes, accepted, parents = self._pending
            self._pending = None
            if parents is not None:
                depth, classes = tree_paths(parents)
            off_acc = None if classes is None else class_accepted(classes, accepted, accept_len)
            self.auto.learn(rids, raw, depth, choice, accept_len, drafted, classes, off_acc)

    def _split_topk(self):
        """On several ranks, the top-k over vocabulary slices (ddtree_rtc.parallel.vocab.topk): a drafter
        whose logits are already this rank's slice (DFlash's head) hands them on, one whose logits are
        whole and replicated (oracle, random) has its slice cut out first; on one rank None (the
        backend's top-k)."""
        model = self.model
        if model.shard.world == 1:
            return None
        from ...parallel import vocab

        vocab_size, lo = model.cfg.vocab_size, model.vocab_offset
        part = vocab_size // model.shard.world

        def topk(logits, k):
            if logits.shape[-1] == vocab_size:
                logits = model.backend.xp.ascontiguousarray(logits[..., lo:lo + part])
            elif logits.shape[-1] != part:
                raise ValueError(f"drafter logits of width {logits.shape[-1]}: expected the vocabulary "
                                 f"({vocab_size}) or this rank's slice of it ({part})")
            return vocab.topk(model, logits, k)

        return topk

    def run(self, reqs, eos_id) -> None:
        if self.auto is not None:
            return self._run_auto(reqs, eos_id)
        be, pages, clock, runner = self.model.backend, self.pages, self.clock, self.runner
        rids = [r.rid for r in reqs]
        prefix = np.array([r.length - 1 for r in reqs], np.int32)  # the root (last token) has no KV yet
        roots = np.array([r.output[-1] for r in reqs], np.int32)
        bufs = self.buffers_for(len(reqs))
        budgets = np.array([self.budget_of(r) for r in reqs], np.int64)
        bufs.set_limits(budgets=budgets)
        for r, p in zip(reqs, prefix):
            pages.reserve(r.rid, int(p) + self.width)
        # the small arrays the build and the verify read (cupy.asarray stages them in page-locked
        # memory: no wait), then the device's work first: the draft, top-k and build need nothing of
        # the verify's plan, so the plan's host time overlaps them (its copies come from page-locked
        # staging too, queued behind the build, not waited for)
        roots_dev, prefix_dev = be.asarray(roots), be.asarray(prefix)
        page_table = be.asarray(pages.page_table(rids))
        logits = clock.time("draft", self.drafter.draft, rids, roots, prefix)
        tree = self.build_tree(bufs, logits, roots_dev, prefix_dev, clock)
        rows = 1 + budgets
        total = int(rows.sum())
        if total != len(reqs) * self.width:  # per-request budgets: a bucket (a few graphs, not one per sum)
            from .budget import row_buckets

            total = next(t for t in row_buckets(len(reqs), self.width) if t >= total)
        step = clock.time("plan", runner.plan_tree, rids, prefix, rows, self.width, total)
        out, _, acc = self.verify_tree(bufs, step, tree, page_table, self.row_reqs(reqs, step), clock)
        self._commit(reqs, prefix, step, out, acc, eos_id)

    @staticmethod
    def row_reqs(reqs, step) -> list:
        """The request of each verify row (its node's token at position + 1 is chosen by it)."""
        return [reqs[i] for i in step.row_req]

    def _commit(self, reqs, prefix, step, out, acc, eos_id) -> tuple[np.ndarray, np.ndarray | None]:
        """The round's host sync (accept lengths and emitted tokens), then the host commit, timed as
        "commit": the accepted rows' hidden states to the drafter's context, the tokens to each request,
        each request's pages trimmed to its committed prefix (the bonus token gets its row next round).
        ``prefix``: each request's KV length before the round; verify row ``step.q_start[b] + j`` is
        node ``j`` of tree ``b``. Returns the accept lengths [B] int64 and the walk's node indices
        ``[B, >= max accept length]`` (root first; copied when the drafter's context or the auto budget
        reads them, else None)."""
        be, pages = self.model.backend, self.pages
        rids = [r.rid for r in reqs]
        accept_len = be.to_host(acc.accept_len).astype(np.int64)  # the round's host sync
        emitted = be.to_host(acc.emitted)

        def commit():
            # the walk's nodes: the drafter's context (hidden layers) and the auto budget's off-path
            # evidence (after the round's sync: a copy, no wait)
            need = self.hidden_layers or self.auto is not None
            accepted = be.to_host(acc.accepted) if need else None
            if self.hidden_layers:
                rows = np.concatenate([step.q_start[b] + accepted[b, :n].astype(np.int64)
                                       for b, n in enumerate(accept_len)])
                idx = be.asarray(rows)
                self.drafter.extend_context(rids, {i: out.hidden[i][idx] for i in self.hidden_layers}, accept_len)
            for r, p, n, toks in zip(reqs, prefix, accept_len, emitted):
                self.stats.add(int(n), r.rid)
                r.extend(toks[:n].tolist(), eos_id)
                pages.trim(r.rid, int(p) + int(n))
            return accepted

        return accept_len, self.clock.time("commit", commit)

    def device_half(self, bufs: TreeBuffers, step, page_table, draft_logits, roots, row_reqs, clock):
        """Top-k -> build -> verify -> choose -> accept -> KV commit for the verify ``step``
        (``runner.plan_tree``), each stage timed on ``clock`` under its DEVICE_STAGES name: the
        round's ``build_tree`` then ``verify_tree``. ``page_table`` and ``roots`` are on the device;
        ``row_reqs``: the request of each verify row (its node's token is chosen by the request's
        temperature, top-p and sampling stream). Returns (verify output, choices [B, 1 + max_budget]
        int32, accept arrays)."""
        tree = self.build_tree(bufs, draft_logits, roots, step.prefix_dev, clock)
        return self.verify_tree(bufs, step, tree, page_table, row_reqs, clock)

    def build_tree(self, bufs: TreeBuffers, draft_logits, roots, prefix_dev, clock):
        """Top-k -> build on the device (no host data: the round enqueues it before the verify's plan)."""
        clock.time("top-k", bufs.topk, draft_logits, self._split_topk())
        return clock.time("build", bufs.grow, roots, prefix_dev)

    def verify_tree(self, bufs: TreeBuffers, step, tree, page_table, row_reqs, clock):
        """Verify -> choose -> accept -> KV commit of ``tree`` (``build_tree``'s, cut or not) for the
        planned ``step``; see ``device_half``."""
        output = self.sampler.output_for(row_reqs)
        out = clock.time("verify", self._verify, step, tree, output)
        choices = clock.time("choose", self._choose, out, output, row_reqs, step)
        acc = clock.time("accept", bufs.accept, choices)
        clock.time("commit", self.cache.commit, page_table, step.prefix_dev, acc.accepted, acc.accept_len)
        return out, choices, acc

    def _verify(self, step, tree, output: str):
        self.runner.fill_tree(step, tree)
        return self.runner.verify(step, output)

    def _choose(self, out, output: str, row_reqs, step):
        """The target's token at every verify row, laid out per request and slot ``[B, width]``
        (-1 past a request's rows: the walk stops within its ``num_nodes``)."""
        be = self.model.backend
        tokens = out.tokens if output == "argmax" else self.sampler.choose(out.logits, row_reqs,
                                                                           step.inputs.positions + 1)
        return self.runner.per_slot(step, tokens.astype(be.xp.int32, copy=False))

    def _run_auto(self, reqs, eos_id) -> None:
        """The round with the cost-aware budget: draft and build at the maximum budget (or, when
        every request holds off drafting, the root alone), cut to the chosen counts (lagged: chosen
        before, planned while the device drafts; else chosen from the build, then planned) and verify
        the cut trees packed into the chosen row bucket (engine/decode/auto.py)."""
        be, pages, clock, runner, auto, ar = (self.model.backend, self.pages, self.clock, self.runner, self.auto,
                                              self._auto_round)
        t0 = time.perf_counter()
        rids, b = [r.rid for r in reqs], len(reqs)
        prefix = np.array([r.length - 1 for r in reqs], np.int32)
        roots = np.array([r.output[-1] for r in reqs], np.int32)
        # no request gets more nodes than the largest bucket leaves past the roots (under a row cap,
        # fewer than max_budget), so none is built
        caps = np.minimum([self.budget_of(r) for r in reqs], auto.top_rows(b) - b).astype(np.int64)
        bufs = self.buffers_for(b)
        bufs.set_limits(budgets=caps)
        for r, p in zip(reqs, prefix):
            pages.reserve(r.rid, int(p) + self.width)
        drafted = auto.should_draft(rids)
        measuring = drafted and ar.needs_measure(b)
        # the small arrays first (as in ``run``), then the device's work: the
        # draft, top-k and build need neither the choice nor the verify's plan, so the host work up
        # to the verify overlaps them (the plan's copies are queued behind the build, not waited for)
        roots_dev, prefix_dev, ctx = be.asarray(roots), be.asarray(prefix), float(prefix.mean())
        page_table = be.asarray(pages.page_table(rids))
        logits = clock.time("draft", self.drafter.draft, rids, roots, prefix) if drafted else None
        tree = self.build_tree(bufs, logits, roots_dev, prefix_dev, clock) if drafted else bufs.tree
        raw = depth = off = parents = draft_s = lag = None
        nxt, self._next = self._next, None
        if drafted and not measuring and auto.lagged and ar.draft_known(b):
            # the lagged choice (from the past rounds), made during the last round's verify when the
            # batch is the same and none of it starts a probe (a probe values optimistically)
            if self._pending is not None and not auto.history.ready():
                self._learn_pending()  # the first lagged round: nothing was learned during a verify yet
            if (nxt is not None and nxt[0] == rids and np.array_equal(nxt[1], caps)
                    and not any(auto.probing(r) for r in rids)):
                lag = nxt[2]
            else:
                lag = clock.time("budget", auto.choose_lagged, rids, caps, ctx)
        if lag is not None:
            # its plan and the cut's copy while the device drafts and builds; the cut on the device
            # right after the build, then the verify: no sync between them
            choice, guess = lag, None
            step = clock.time("plan", runner.plan_tree, rids, prefix, 1 + choice.counts, self.width, choice.rows)
            cut = clock.time("budget", ar.stage_cut, b, choice.counts)
            clock.time("budget", ar.apply_cut, tree, cut)
            self._last_cut = (rids, choice.counts, choice.rows)
        elif drafted:
            # the choice from the round's own tree (a sync). While the device drafts and builds, the
            # host plans the verify of the last round's cut (the policy's counts are stable round to
            # round): used if the choice is the same
            last, guess = self._last_cut, None
            if not measuring and last is not None and last[0] == rids:
                guess = clock.time("plan", runner.plan_tree, rids, prefix, 1 + last[1], self.width, last[2])
            values, raw, depth, off, weights = clock.time("budget", ar.estimate, tree, rids)  # a host sync
            draft_s = time.perf_counter() - t0
            if measuring:
                output = self.sampler.output_for(reqs)
                clock.time("budget", ar.measure, rids, prefix, tree, be.to_host(tree.num_nodes).astype(np.int64),
                           output)
            choice = auto.choose(values, caps, ctx, weights)
            ar.cut(tree, choice.counts)
            if guess is not None and (choice.rows != last[2] or not np.array_equal(choice.counts, last[1])):
                guess = None
            self._last_cut = (rids, choice.counts, choice.rows)
        else:
            auto.skipped(rids)
            guess = None
            ar.root_only(tree, roots_dev, prefix_dev)
            choice = auto.ar_choice(b, ctx)
        if lag is None:
            step = guess if guess is not None else clock.time("plan", runner.plan_tree, rids, prefix,
                                                              1 + choice.counts, self.width, choice.rows)
        out, _, acc = self.verify_tree(bufs, step, tree, page_table, self.row_reqs(reqs, step), clock)
        if auto.lagged:
            # while the device verifies: learn the last round, choose the next one's counts
            clock.time("budget", self._learn_pending)
            if drafted and auto.history.ready():
                self._next = (rids, caps, clock.time("budget", auto.choose_lagged, rids, caps, ctx))
        accept_len, accepted = self._commit(reqs, prefix, step, out, acc, eos_id)
        if lag is not None:  # the round's built tree, for the next rounds' choices (after the round's sync)
            raw, parents = clock.time("budget", ar.read_tree, tree)
        if auto.lagged:
            auto.hold(rids, choice, drafted)  # the next round's should_draft reads it
            self._pending = (rids, raw, depth, choice, accept_len, drafted, off, accepted, parents)
        else:
            off_acc = None if off is None else class_accepted(off, accepted, accept_len)
            auto.observe(rids, raw, depth, choice, accept_len, drafted, off, off_acc)
        if not measuring:  # the measuring round's wall time holds the measurement
            ar.observe_times(b, draft_s, time.perf_counter() - t0, choice, lagged=lag is not None)
