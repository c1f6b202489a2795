"""Drafters behind one interface: each round, logits ``[B, depth, V]`` for the positions after every
request's bonus token; after the target's verify, the accepted nodes' target hidden states.

- ``OracleDrafter`` measures the engine's mechanics on random weights: whoever builds it gives it
  each request's target greedy continuation (the pipeline runner decodes it with a plain
  autoregressive engine: pipeline.runner.greedy_continuation) and it emits logits whose rank of
  the true token at each depth follows a configured profile
  (geometric: rank 0 with probability p, else rank r >= 1 with probability (1 - p) 2^-r; or an
  explicit per-depth table of rank-0 probabilities), over a Zipf-shaped tail. So tau is chosen by
  configuration, and the tree still has to find the path through the real top-k, build and accept.
- ``RandomDrafter``: seeded random logits (tau ~ 1, the worst case).
- The DFlash drafter (ddtree_rtc.speculative.dflash) uses the target's hidden states.

Every random draw is keyed by (seed, request, position), never by batch slot or round, so a
request's drafts do not depend on what else is in the batch.
"""

from __future__ import annotations

import numpy as np

from ..reference.sampling import GAMMA, mix64


class Drafter:
    """The interface the round calls (docs/architecture.md, "The DDTree round")."""

    name = "drafter"
    depth: int  # positions drafted per round (block_size - 1), the tree's depth limit
    vocab_size: int
    target_layer_ids: tuple[int, ...] = ()  # target layers whose output hidden states it consumes

    def check_target(self, cfg) -> None:
        if cfg.vocab_size != self.vocab_size:
            raise ValueError(f"drafter {self.name!r}: vocabulary {self.vocab_size} != the target's {cfg.vocab_size}")
        bad = [i for i in self.target_layer_ids if not 0 <= i < cfg.num_hidden_layers]
        if bad:
            raise ValueError(f"drafter {self.name!r}: target_layer_ids {bad} are not layers of the target "
                             f"(it has {cfg.num_hidden_layers})")

    def attach(self, allocator) -> None:
        """Engine.__init__ hands over its PageAllocator (a drafter with a paged cache shares it)."""

    def admit(self, rid, prompt: list[int], hidden: dict) -> None:
        """After the target's prefill of ``prompt``: its rows become the request's context."""

    def draft(self, rids: list, roots: np.ndarray, prefix_lens: np.ndarray):
        """Backend logits ``[B, depth, V]`` for positions prefix+1 .. prefix+depth; root b (the
        bonus token, no hidden state yet) sits at position prefix_lens[b]. On several ranks a drafter
        may return this rank's vocabulary slice ``[B, depth, V / N]`` instead (DFlash does)."""
        raise NotImplementedError

    def extend_context(self, rids: list, hidden: dict, counts: np.ndarray) -> None:
        """After accept: request b's accepted nodes (root first, counts[b] rows) join its context."""

    def release(self, rid) -> None:
        """The request finished: forget it."""


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([int(k) % 2**63 for k in key])


class RandomDrafter(Drafter):
    name = "random"

    def __init__(self, backend, vocab_size: int, depth: int, seed: int = 0):
        self.backend, self.vocab_size, self.depth, self.seed = backend, vocab_size, depth, seed

    def draft(self, rids, roots, prefix_lens):
        out = np.stack([_rng(self.seed, 1, r, p).standard_normal((self.depth, self.vocab_size), np.float32)
                        for r, p in zip(rids, prefix_lens)]) if len(rids) else \
            np.zeros((0, self.depth, self.vocab_size), np.float32)
        return self.backend.asarray(out)


class OracleDrafter(Drafter):
    """``continuation(rid, prompt) -> list[int]``: the target's greedy tokens after ``prompt``
    (output[0] onwards); ``accept_p`` (geometric) or ``table`` (per-depth rank-0 probability)."""

    name = "oracle"

    def __init__(self, backend, vocab_size: int, depth: int, continuation, accept_p: float | None = 0.8,
                 table: tuple[float, ...] | None = None, zipf: float = 1.2, seed: int = 0):
        if (accept_p is None) == (table is None):
            raise ValueError("oracle drafter: give exactly one of acceptance p or a per-depth table")
        probs = np.full(depth, accept_p) if table is None else np.asarray(table, dtype=np.float64)
        if probs.shape != (depth,) or not ((probs >= 0) & (probs <= 1)).all():
            raise ValueError(f"oracle drafter: acceptance must be {depth} probabilities in [0, 1] "
                             f"(one per depth), got {probs.tolist()}")
        self.backend, self.vocab_size, self.depth, self.seed = backend, vocab_size, depth, seed
        self.probs, self.continuation = probs, continuation
        # per depth, a fixed Zipf-shaped row over a random order of the vocabulary: rank j >= 1 gets
        # -zipf*ln(j+1), rank 0 the logit that makes its softmax probability the depth's acceptance
        # probability (a calibrated drafter), so the tree spends its budget where a real one would
        g = _rng(seed, 2)
        self._order = np.stack([g.permutation(vocab_size) for _ in range(depth)]).astype(np.int64)
        self._template = np.empty((depth, vocab_size), np.float32)
        tail = -zipf * np.log(np.arange(2, vocab_size + 1, dtype=np.float64))
        tail_mass = np.log(np.exp(tail).sum())
        for d in range(depth):
            q = min(max(float(probs[d]), 1e-6), 1 - 1e-6)
            top = np.log(q / (1 - q)) + tail_mass
            self._template[d, self._order[d]] = np.concatenate([[top], tail]).astype(np.float32)
        self._known: dict = {}  # rid -> (prompt length, continuation)
        self._template_dev = None  # the template on the backend, made at the first draft

    def admit(self, rid, prompt, hidden):
        self._known[rid] = (len(prompt), list(self.continuation(rid, prompt)))

    def release(self, rid):
        self._known.pop(rid, None)

    def ranks(self, rids, positions, depths) -> np.ndarray:
        """The rank of the true token for each (request, position, depth d): 0 with probability
        p[d], else r >= 1 with probability 2^-r (capped at V - 1). Each draw comes from a hash of
        (seed, request, position, depth) alone, so it does not depend on the batch or the round."""
        with np.errstate(over="ignore"):
            h = mix64(np.uint64(self.seed % 2**64) * np.uint64(GAMMA) + np.uint64(3))
            for part in (rids, positions, depths):
                h = mix64(h ^ np.asarray(part, np.int64).astype(np.uint64))
            u = (h >> np.uint64(11)).astype(np.float64) * 2.0**-53
            g = mix64(h + np.uint64(GAMMA))
            low = g & (~g + np.uint64(1))  # the lowest set bit: 2^k with probability 2^-(k+1)
        tail = np.where(g == 0, 64, np.log2(np.maximum(low, 1).astype(np.float64)).astype(np.int64) + 1)
        rank = np.where(u < self.probs[np.asarray(depths, np.int64)], 0, tail)
        return np.minimum(rank, self.vocab_size - 1)

    def rank_probability(self, d: int, rank: int) -> float:
        """P(the true token sits at ``rank`` at depth d): the law of ``ranks`` (its cap at V - 1 aside)."""
        p = float(self.probs[d])
        return p if rank == 0 else (1 - p) * 0.5**rank

    def expected_tau(self, budget: int, chain: bool = False) -> float:
        """Mean tokens per round (bonus included) of a tree of ``budget`` nodes (chain: the top-1
        path) in steady state, i.e. while the continuation reaches past the round. The true token
        only swaps places with the token at its rank, so every round's sorted log-probs, and so its
        tree of ranks, are the template's; the walk reaches a node exactly when the true tokens
        follow its path, so tau = 1 + the sum over the tree's nodes of that path's probability."""
        from ..reference.topk import topk_logprobs
        from ..reference.tree_build import tree_build

        budget = self.depth if chain else budget
        k = 1 if chain else max(1, min(budget, self.vocab_size))
        logq, ids = topk_logprobs(self._template[None], k)
        one = np.ones(1, np.int32)
        tree = tree_build(logq, ids, 0 * one, budget * one, self.depth * one, 0 * one, budget)
        rank = np.empty_like(self._order)
        for d in range(self.depth):
            rank[d, self._order[d]] = np.arange(self.vocab_size)
        reach = np.zeros(int(tree.num_nodes[0]))
        reach[0] = 1.0
        for j in range(1, len(reach)):  # parents precede children
            d = int(tree.node_depth[0, j]) - 1
            reach[j] = reach[tree.parents[0, j]] * self.rank_probability(d, int(rank[d, tree.tokens[0, j]]))
        return float(reach.sum())

    def draft(self, rids, roots, prefix_lens):
        """The template at every depth with the true token swapped to its drawn rank, made on the
        backend: the host sends only the swaps, so drafting costs a round little."""
        be = self.backend
        if self._template_dev is None:
            self._template_dev = be.asarray(self._template)
        b_i, d_i, true, pos = [], [], [], []
        for b, (rid, prefix) in enumerate(zip(rids, prefix_lens)):
            n_prompt, cont = self._known[rid]
            for d in range(self.depth):
                k = int(prefix) + 1 + d - n_prompt  # index in the continuation of position prefix+1+d
                if 0 <= k < len(cont):
                    b_i.append(b)
                    d_i.append(d)
                    true.append(cont[k])
                    pos.append(int(prefix) + 1 + d)
        out = be.xp.empty((len(rids), self.depth, self.vocab_size), np.float32)
        out[...] = self._template_dev[None]
        if b_i:
            b_i, d_i, true = (np.array(a, np.int64) for a in (b_i, d_i, true))
            other = self._order[d_i, self.ranks([int(rids[b]) for b in b_i], pos, d_i)]  # the token at that rank
            t_val, o_val = self._template[d_i, true], self._template[d_i, other]
            at = (be.asarray(b_i), be.asarray(d_i))
            out[at + (be.asarray(true),)] = be.asarray(o_val)  # the swap (nothing moves where true is other)
            out[at + (be.asarray(other),)] = be.asarray(t_val)
        return out
