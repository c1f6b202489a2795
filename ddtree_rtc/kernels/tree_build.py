"""DDTree best-first tree build on the GPU, one block per request. See cuda_src/tree_build.cu; the
algorithm and every output rule are in ddtree_rtc/reference/tree_build.py, which the kernel matches
bit for bit (nodes, order, scores, masks). One graph-capturable launch for the whole batch.

The kernel builds depth by depth in parallel, cutting candidates below a histogram lower bound on the
budget-th score, and falls back per request to the sequential heap loop where its exactness
conditions fail (variants tried and dropped: benchmarks/README.md, tree_build)."""

from __future__ import annotations

import numpy as np

from ..reference.tree_build import TreeArrays, alloc_tree, check_build_args, mask_words
from ._args import allow_dynamic_smem, check
from .registry import module

# per node slot: score, 3-word tuple code; heap slot key, score, rank, last child; parent, rank, depth,
# first child, next sibling
_SMEM_PER_SLOT = 8 + 3 * 8 + 8 + 8 + 4 + 4 + 5 * 4
_SMEM_PER_PRUNE_ENTRY = 2 * 8 + 5 * 4  # prune variant: score, list score; parent, rank, depth, node, list
_PRUNE_LIST_EXTRA = 63  # prune variant: tuple codes (3 words) for 1 + max_budget + this listed entries


def block_threads() -> int:
    """Threads per block the module is built with (its TREE_THREADS parameter)."""
    from .registry import spec

    return int(spec("tree_build").params["TREE_THREADS"])


def pool_capacity(max_budget: int) -> int:
    """Prune variant: candidates held per request; more falls back to the heap loop."""
    return 4 * max_budget + 64


def _variant(max_budget: int) -> int:
    """Heap slots per lane: 32 * J >= 1 + max_budget."""
    return 3 if max_budget <= 95 else 9 if max_budget <= 287 else 17


def _check_out(out: TreeArrays, batch: int, max_budget: int, max_depth: int) -> TreeArrays:
    if (out.max_budget, out.max_depth) != (max_budget, max_depth):
        raise ValueError(f"out: made for max_budget={out.max_budget}, max_depth={out.max_depth}; "
                         f"called with max_budget={max_budget}, depth={max_depth}")
    n = max_budget + 1
    for name, dt, shape in (("tokens", np.int32, (batch, n)), ("parents", np.int32, (batch, n)),
                            ("node_depth", np.int32, (batch, n)), ("positions", np.int32, (batch, n)),
                            ("num_nodes", np.int32, (batch,)),
                            ("mask", np.uint64, (batch, n, mask_words(max_budget))),
                            ("first_child", np.int32, (batch, n)), ("next_sibling", np.int32, (batch, n)),
                            ("scores", np.float64, (batch, n))):
        check(f"out.{name}", getattr(out, name), dt, shape=shape)
    return out


def tree_build(logq, ids, root_tokens, budgets, depths, prefix_lens, max_budget: int, out=None):
    """logq ``[B, L, K]`` fp32 and ids ``[B, L, K]`` int32 from top-k; root_tokens, budgets, depths,
    prefix_lens ``[B]`` int32 (budgets clamped to [0, max_budget], depths to [0, L]).
    Returns TreeArrays with ``1 + max_budget`` node slots per request."""
    import cupy

    b, l, k = check_build_args(logq, ids, root_tokens, budgets, depths, prefix_lens, max_budget)
    check("logq", logq, np.float32)
    check("ids", ids, np.int32)
    for name, a in (("root_tokens", root_tokens), ("budgets", budgets), ("depths", depths),
                    ("prefix_lens", prefix_lens)):
        check(name, a, np.int32)
    max_budget = int(max_budget)
    ks = max(1, min(k, max_budget))
    out = alloc_tree(cupy, b, max_budget, l) if out is None else _check_out(out, b, max_budget, l)
    if b == 0:
        return out
    smem = (max_budget + 1) * _SMEM_PER_SLOT + l * ks * 8  # + the staged [L, ks] log-probs and ids
    cap = pool_capacity(max_budget)
    smem += cap * _SMEM_PER_PRUNE_ENTRY + 8 + (max_budget + 1 + _PRUNE_LIST_EXTRA) * 3 * 8  # + 8: doubles aligned
    fn = module("tree_build").fn(f"tree_build_prune_j{_variant(max_budget)}")
    allow_dynamic_smem(fn, smem)  # also under 48 KB: static shared memory counts against that default
    fn((b,), (block_threads(),),
       (logq, ids, np.int32(l), np.int32(k), root_tokens, budgets, depths, prefix_lens, np.int32(max_budget),
        np.int32(ks), np.int32(mask_words(max_budget)), np.int32(cap), out.tokens, out.parents, out.node_depth,
        out.positions, out.num_nodes, out.mask, out.first_child, out.next_sibling, out.scores),
       shared_mem=smem)
    return out

