"""DDTree best-first tree build, the reference of docs/architecture.md section 4 in Python ``heapq``.

Per request: ``logq [L, K]`` fp32, ``ids [L, K]``, a budget and a depth limit. Heap entries are
``(-score, rank_tuple, parent, depth, rank)``; scores are Python floats (float64) accumulated in
exactly the order of docs/architecture.md, so the GPU builder (cuda_src/tree_build.cu) must reproduce them bit
for bit. Rules shared with the kernel:
  * log-probs are sanitized first: NaN -> -FLT_MAX, values clamped to [-FLT_MAX, FLT_MAX], so every
    score is finite (top-k output is already finite: this only guards hand-made inputs);
  * the budget is clamped to [0, max_budget] and the depth limit to [0, L]; 0 gives the root only;
  * only the first min(K, budget) ranks per depth can ever be popped, so K beyond the budget
    changes nothing.
Node 0 is the root (the previous bonus token, depth 0, parent -1, score 0). Unused slots up to
``max_budget`` hold -1 (tokens, parents, depths, positions, links), NaN (scores) and zero mask rows.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

MAX_DEPTH = 16
MAX_BUDGET = 512
FLT_MAX = float(np.finfo(np.float32).max)


@dataclass
class TreeArrays:
    """One tree per request, ``N = 1 + max_budget`` node slots, ``W = ceil(N / 64)`` mask words."""

    tokens: object  # [B, N] int32; node 0 = root token
    parents: object  # [B, N] int32; -1 for the root
    node_depth: object  # [B, N] int32; 0 for the root
    positions: object  # [B, N] int32; prefix_len + depth
    num_nodes: object  # [B] int32; 1 + popped nodes
    mask: object  # [B, N, W] uint64; bit j of row i: node j is i or an ancestor of i
    first_child: object  # [B, N] int32; lowest-rank child or -1
    next_sibling: object  # [B, N] int32; the next-rank sibling or -1
    scores: object  # [B, N] float64; path log-prob (root 0)
    max_budget: int
    max_depth: int

    @property
    def batch(self) -> int:
        return self.tokens.shape[0]


def mask_words(max_budget: int) -> int:
    return (max_budget + 1 + 63) // 64


def alloc_tree(xp, batch: int, max_budget: int, max_depth: int) -> TreeArrays:
    """Uninitialised output arrays (numpy or cupy) for ``tree_build(..., out=...)``."""
    n = max_budget + 1
    i32 = lambda: xp.empty((batch, n), dtype=np.int32)  # noqa: E731
    return TreeArrays(i32(), i32(), i32(), i32(), xp.empty((batch,), dtype=np.int32),
                      xp.empty((batch, n, mask_words(max_budget)), dtype=np.uint64), i32(), i32(),
                      xp.empty((batch, n), dtype=np.float64), max_budget, max_depth)


def sanitize_logq(logq) -> np.ndarray:
    x = np.asarray(logq, dtype=np.float32)
    return np.where(np.isnan(x), np.float32(-FLT_MAX), np.clip(x, -FLT_MAX, FLT_MAX)).astype(np.float32)


def check_build_args(logq, ids, root_tokens, budgets, depths, prefix_lens, max_budget: int):
    """Shape checks shared by the reference and the CUDA wrapper; returns (B, L, K)."""
    if logq.ndim != 3:
        raise ValueError(f"logq: expected shape [batch, depth, k], got {tuple(logq.shape)}")
    b, l, k = logq.shape
    if tuple(ids.shape) != (b, l, k):
        raise ValueError(f"ids: expected shape {(b, l, k)} like logq, got {tuple(ids.shape)}")
    for name, a in (("root_tokens", root_tokens), ("budgets", budgets), ("depths", depths),
                    ("prefix_lens", prefix_lens)):
        if tuple(a.shape) != (b,):
            raise ValueError(f"{name}: expected shape ({b},) (one per request), got {tuple(a.shape)}")
    if not 1 <= l <= MAX_DEPTH:
        raise ValueError(f"logq: depth {l} is out of range 1..{MAX_DEPTH}")
    if k < 1:
        raise ValueError("logq: k must be >= 1")
    if not 0 <= int(max_budget) <= MAX_BUDGET:
        raise ValueError(f"max_budget={max_budget} is out of range 0..{MAX_BUDGET}")
    return b, l, k


def build_one(lq: list, budget: int, depth: int):
    """The heap loop of docs/architecture.md section 4 for one request.

    ``lq``: per-depth lists of Python floats. Returns a list of (parent, depth, rank, score) for
    nodes 1..n in pop order."""
    k = len(lq[0])
    nodes = []
    if budget <= 0 or depth <= 0:
        return nodes
    heap = [(-lq[0][0], (0,), 0, 1, 0)]
    n = 0
    while heap and n < budget:
        key, ranks, p, d, r = heapq.heappop(heap)
        score = -key
        nodes.append((p, d, r, score))
        n += 1
        if r + 1 < k:
            heapq.heappush(heap, (-(score - lq[d - 1][r] + lq[d - 1][r + 1]), ranks[:-1] + (r + 1,), p, d, r + 1))
        if d < depth:
            heapq.heappush(heap, (-(score + lq[d][0]), ranks + (0,), n, d + 1, 0))
    return nodes


def tree_build(logq, ids, root_tokens, budgets, depths, prefix_lens, max_budget: int, out=None):
    """logq ``[B, L, K]`` fp32 (sorted descending per depth, as top-k gives), ids ``[B, L, K]``
    int32; root_tokens, budgets, depths (each <= L), prefix_lens: ``[B]`` int32."""
    b, l, k = check_build_args(logq, ids, root_tokens, budgets, depths, prefix_lens, max_budget)
    max_budget = int(max_budget)
    t = alloc_tree(np, b, max_budget, l) if out is None else out
    n_slots = max_budget + 1
    lq_all = sanitize_logq(logq).astype(np.float64)
    ids = np.asarray(ids)
    for a in (t.tokens, t.parents, t.node_depth, t.positions, t.first_child, t.next_sibling):
        a[...] = -1
    t.scores[...] = np.nan
    t.mask[...] = 0
    for i in range(b):
        budget = min(max(int(budgets[i]), 0), max_budget)
        depth = min(max(int(depths[i]), 0), l)
        kc = min(k, max(budget, 1))  # ranks >= budget are never popped
        nodes = build_one(lq_all[i, :, :kc].tolist(), budget, depth)
        prefix = int(prefix_lens[i])
        t.tokens[i, 0] = root_tokens[i]
        t.node_depth[i, 0] = 0
        t.positions[i, 0] = prefix
        t.scores[i, 0] = 0.0
        t.mask[i, 0, 0] = 1
        last_child = [-1] * n_slots
        for j, (p, d, r, score) in enumerate(nodes, start=1):
            t.tokens[i, j] = ids[i, d - 1, r]
            t.parents[i, j] = p
            t.node_depth[i, j] = d
            t.positions[i, j] = prefix + d
            t.scores[i, j] = score
            t.mask[i, j] = t.mask[i, p]
            t.mask[i, j, j >> 6] |= np.uint64(1) << np.uint64(j & 63)
            if r == 0:
                t.first_child[i, p] = j
            else:
                t.next_sibling[i, last_child[p]] = j
            last_child[p] = j
        t.num_nodes[i] = 1 + len(nodes)
    return t
