"""The tree half of a DDTree round: drafter logits -> top-k -> tree -> (target verify, elsewhere)
-> acceptance walk, into buffers preallocated per (batch, budget, depth, vocab).

``TreeBuffers.build`` and ``TreeBuffers.accept`` are one launch per kernel for the whole batch, with
no host sync and no allocation, so a round can be captured in a CUDA graph. Per-request budgets and
depth limits change only at admission (``set_limits``, a host-to-device copy).

Chain mode (DFlash-style linear drafting, and a baseline for comparisons) runs through the same
kernels with k = 1 and budget = depth: the tree is the path of top-1 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...reference.tree_accept import AcceptArrays, alloc_accept
from ...reference.tree_build import MAX_BUDGET, MAX_DEPTH, TreeArrays, alloc_tree


@dataclass(frozen=True)
class TreeShape:
    batch: int
    budget: int  # nodes drafted per request, the root excluded (tree mode)
    depth: int  # drafter block positions (block_size - 1)
    vocab: int
    chain: bool = False

    def __post_init__(self):
        if self.batch < 0:
            raise ValueError(f"batch={self.batch} must be >= 0")
        if not 1 <= self.depth <= MAX_DEPTH:
            raise ValueError(f"depth={self.depth} is out of range 1..{MAX_DEPTH}")
        if not 0 <= self.budget <= MAX_BUDGET:
            raise ValueError(f"budget={self.budget} is out of range 0..{MAX_BUDGET}")
        if self.vocab < 1:
            raise ValueError(f"vocab={self.vocab} must be >= 1")

    @property
    def k(self) -> int:
        """Top-k width per depth: one in chain mode, else min(budget, vocab) (docs/architecture.md section 1)."""
        return 1 if self.chain else max(1, min(self.budget, self.vocab))

    @property
    def max_budget(self) -> int:
        return self.depth if self.chain else self.budget


class TreeBuffers:
    """Everything the tree step writes, allocated once on ``backend`` (numpy or CUDA)."""

    def __init__(self, backend, shape: TreeShape):
        self.backend, self.shape = backend, shape
        b, l, k = shape.batch, shape.depth, shape.k
        self.logq = backend.empty((b, l, k), "fp32")
        self.ids = backend.empty((b, l, k), "int32")
        self.workspace = backend.topk_workspace((b, l, shape.vocab), k)
        self.budgets = backend.empty((b,), "int32")
        self.depths = backend.empty((b,), "int32")
        self.tree: TreeArrays = alloc_tree(backend.xp, b, shape.max_budget, l)
        self.result: AcceptArrays = alloc_accept(backend.xp, b, l)
        self._host_limits = None  # the (budgets, depths) on the device, as last copied there
        self.set_limits()

    def set_limits(self, budgets=None, depths=None) -> None:
        """Per-request budget (<= the shape's) and depth limit (<= its depth); None = the maximum.
        Copied to the device only when they change (a round sets them every time, mostly the same)."""
        s = self.shape
        new = (self._limits("budgets", budgets, s.max_budget, "the buffers' budget"),
               self._limits("depths", depths, s.depth, "the drafter depth"))
        old = self._host_limits
        if old is not None and all(np.array_equal(a, b) for a, b in zip(new, old)):
            return
        self.budgets[...] = self.backend.asarray(new[0])
        self.depths[...] = self.backend.asarray(new[1])
        self._host_limits = new

    def _limits(self, name: str, values, most: int, what: str) -> np.ndarray:
        if values is None:
            return np.full((self.shape.batch,), most, dtype=np.int32)
        v = np.asarray(values)
        if v.shape != (self.shape.batch,) or not np.issubdtype(v.dtype, np.integer):
            raise ValueError(f"{name}: expected {self.shape.batch} integers, got {v.dtype} {v.shape}")
        if v.size and (v.min() < 0 or v.max() > most):
            raise ValueError(f"{name}: values must be in 0..{most} ({what}), got {v.min()}..{v.max()}")
        return v.astype(np.int32)

    def build(self, logits, root_tokens, prefix_lens) -> TreeArrays:
        """logits ``[B, depth, V]`` from the drafter (bf16 or fp32); root_tokens (the previous bonus
        tokens) and prefix_lens (committed tokens) ``[B]`` int32: ``topk`` then ``grow``."""
        self.topk(logits)
        return self.grow(root_tokens, prefix_lens)

    def topk(self, logits, split=None) -> None:
        """The per-depth top-k log-probs and ids of the drafter's logits, into ``logq`` / ``ids``.
        ``split(logits, k) -> (logq, ids)`` replaces the backend's top-k (on several ranks:
        ddtree_rtc.parallel.vocab.topk over this rank's vocabulary slice of ``logits``)."""
        if split is not None:
            self.logq[...], self.ids[...] = split(logits, self.shape.k)
            return
        self.backend.topk_logprobs(logits, self.shape.k, out_logq=self.logq, out_ids=self.ids,
                                   workspace=self.workspace)

    def grow(self, root_tokens, prefix_lens) -> TreeArrays:
        """The best-first tree of each request's budget over ``logq`` / ``ids`` (after ``topk``)."""
        s = self.shape
        return self.backend.tree_build(self.logq, self.ids, root_tokens, self.budgets, self.depths, prefix_lens,
                                       s.max_budget, out=self.tree)

    def accept(self, choices) -> AcceptArrays:
        """choices ``[B, 1 + max_budget]`` int32: the target's token at every node (argmax at T=0,
        one sample per node at T>0)."""
        return self.backend.tree_accept(self.tree, choices, out=self.result)
