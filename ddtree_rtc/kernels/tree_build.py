"""DDTree best-first tree build on the GPU, one block per request. See cuda_src/tree_build.cu; the
algorithm and every output rule are in ddtree_rtc/reference/tree_build.py, which the kernel matches
bit for bit (nodes, order, scores, masks). One graph-capturable launch for the whole batch.

Variants: ``"prune"`` (the default) builds depth by depth in parallel, cutting candidates below a
histogram lower bound on the budget-th score, and falls back per request to the sequential heap loop
where its exactness conditions fail; ``"heap"`` runs the heap loop alone, so tests check the fallback
on every input and ``ddtree-rtc bench tree --variants`` times it beside the default (measurements:
benchmarks/README.md); ``"warp"`` runs the heap loop with the heap in registers, one warp per request
and up to four requests per block (exact on every input, no fallback; it needs
``L * bit_length(ks - 1) <= 64`` for its rank-tuple codes, ks = max(1, min(K, max_budget)): any depth
<= 16 up to ks = 16, depth <= 7 up to ks = 512; ``warp_supports``)."""

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
VARIANTS = ("heap", "prune", "warp")
_WARP_J = (1, 2, 3, 4, 8, 16)  # warp variant: heap slots per lane, 32 * J >= max_budget
_WARP_REQS = 4  # warp variant: requests (warps) per block at most (WARP_REQS in the kernel)
_WARP_SMEM = 48 * 1024  # warp variant: shared memory per block it aims under


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


def warp_field_bits(ks: int) -> int:
    """Warp variant: bits per rank in its rank-tuple codes (ranks < ks)."""
    return (max(1, ks) - 1).bit_length()


def warp_supports(depth: int, k: int, max_budget: int) -> bool:
    """Whether the warp variant takes logq ``[*, depth, k]`` at this max_budget: ``depth`` rank fields
    of ``warp_field_bits(ks)`` bits fit its 64-bit codes (ks = max(1, min(k, max_budget)))."""
    return depth * warp_field_bits(max(1, min(k, max_budget))) <= 64


def warp_stride(max_budget: int, depth: int, ks: int) -> int:
    """Warp variant: shared-memory bytes per request (node score, parent, info, first child, next
    sibling; the staged [depth, ks] log-probs and ids), a multiple of 16."""
    return ((max_budget + 1) * 24 + depth * ks * 8 + 15) // 16 * 16


def default_variant(max_budget: int) -> str:
    """The variant ``tree_build`` runs for this max_budget: prune at every budget up to MAX_BUDGET
    (it falls back per request to the heap loop where its exactness conditions fail; both variants
    give the heap loop's tree, see the module docstring)."""
    return "prune"


def tree_build(logq, ids, root_tokens, budgets, depths, prefix_lens, max_budget: int, out=None):
    """logq ``[B, L, K]`` fp32 and ids ``[B, L, K]`` int32 from top-k; root_tokens, budgets, depths,
    prefix_lens ``[B]`` int32 (budgets clamped to [0, max_budget], depths to [0, L]).
    Returns TreeArrays with ``1 + max_budget`` node slots per request. Runs ``default_variant``."""
    return tree_build_variant(default_variant(max_budget), logq, ids, root_tokens, budgets, depths, prefix_lens,
                              max_budget, out)


def tree_build_variant(variant: str, logq, ids, root_tokens, budgets, depths, prefix_lens, max_budget: int,
                       out=None):
    """``tree_build`` with the kernel variant named (one of VARIANTS), for tests and timing."""
    import cupy

    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r}: expected one of {VARIANTS}")

    b, l, k = check_build_args(logq, ids, root_tokens, budgets, depths, prefix_lens, max_budget)
    check("logq", logq, np.float32)
    check("ids", ids, np.int32)
    for name, a in (("root_tokens", root_tokens), ("budgets", budgets), ("depths", depths),
                    ("prefix_lens", prefix_lens)):
        check(name, a, np.int32)
    max_budget = int(max_budget)
    ks = max(1, min(k, max_budget))
    if variant == "warp" and not warp_supports(l, k, max_budget):
        raise ValueError(f"variant='warp': depth {l} x {warp_field_bits(ks)} bits per rank (k={k}, "
                         f"max_budget={max_budget}) overflow its 64-bit rank-tuple codes; it needs "
                         f"depth * bit_length(min(k, max_budget) - 1) <= 64 (depth <= 7 up to 512 ranks)")
    out = alloc_tree(cupy, b, max_budget, l) if out is None else _check_out(out, b, max_budget, l)
    if b == 0:
        return out
    if variant == "warp":
        _launch_warp(logq, ids, root_tokens, budgets, depths, prefix_lens, max_budget, out, b, l, k, ks)
        return out
    smem = (max_budget + 1) * _SMEM_PER_SLOT + l * ks * 8  # + the staged [L, ks] log-probs and ids
    cap = pool_capacity(max_budget)
    if variant == "prune":  # + 8: the pool's doubles are 8-byte aligned
        smem += cap * _SMEM_PER_PRUNE_ENTRY + 8 + (max_budget + 1 + _PRUNE_LIST_EXTRA) * 3 * 8
    name = "tree_build" if variant == "heap" else f"tree_build_{variant}"
    fn = module("tree_build").fn(f"{name}_j{_variant(max_budget)}")
    allow_dynamic_smem(fn, smem)  # also under 48 KB: static shared memory counts against that default
    fn((b,), (block_threads(),),
       (logq, ids, np.int32(l), np.int32(k), root_tokens, budgets, depths, prefix_lens, np.int32(max_budget),
        np.int32(ks), np.int32(mask_words(max_budget)), np.int32(cap), out.tokens, out.parents, out.node_depth,
        out.positions, out.num_nodes, out.mask, out.first_child, out.next_sibling, out.scores),
       shared_mem=smem)
    return out


def _launch_warp(logq, ids, root_tokens, budgets, depths, prefix_lens, max_budget: int, out, b: int, l: int,
                 k: int, ks: int) -> None:
    """One warp per request, ``reqs`` requests per block (fewer where their shared memory passes
    _WARP_SMEM); the caller checked ``warp_supports``."""
    fb = warp_field_bits(ks)
    j = next(j for j in _WARP_J if 32 * j >= max_budget)
    stride = warp_stride(max_budget, l, ks)
    reqs = max(1, min(_WARP_REQS, _WARP_SMEM // stride, b))
    fn = module("tree_build").fn(f"tree_build_warp_j{j}")
    allow_dynamic_smem(fn, reqs * stride)
    fn(((b + reqs - 1) // reqs,), (32 * reqs,),
       (logq, ids, np.int32(l), np.int32(k), root_tokens, budgets, depths, prefix_lens, np.int32(b),
        np.int32(max_budget), np.int32(ks), np.int32(mask_words(max_budget)), np.int32(fb), np.int32(stride),
        out.tokens, out.parents, out.node_depth, out.positions, out.num_nodes, out.mask, out.first_child,
        out.next_sibling, out.scores),
       shared_mem=reqs * stride)
