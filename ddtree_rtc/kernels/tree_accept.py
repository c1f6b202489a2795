"""DDTree acceptance walk on the GPU, one warp per request. See cuda_src/tree_accept.cu; the rules
are in ddtree_rtc/reference/tree_accept.py, which the kernel matches exactly. The target's choices
come in as tokens, so one kernel serves T=0 (argmax per node) and T>0 (one sample per node): one
trip to memory, then a shared next-node table (timings: benchmarks/README.md)."""

from __future__ import annotations

import numpy as np

from ..reference.tree_accept import AcceptArrays, alloc_accept, check_accept_args
from ..reference.tree_build import MAX_BUDGET, MAX_DEPTH
from ._args import check
from .registry import module

_THREADS = 128  # four requests per block, fixed by the kernel
_PER_BLOCK = _THREADS // 32


def tree_accept(tree, choices, out=None) -> AcceptArrays:
    """tree: TreeArrays from tree_build; choices ``[B, 1 + max_budget]`` int32 (the target's token
    at every node slot). Returns AcceptArrays with ``1 + max_depth`` columns."""
    import cupy

    b, n = check_accept_args(tree, choices)
    if n > MAX_BUDGET + 1 or tree.max_depth > MAX_DEPTH:
        raise ValueError(f"tree: {n} node slots / depth {tree.max_depth} exceed the kernel's "
                         f"{MAX_BUDGET + 1} / {MAX_DEPTH}")
    check("choices", choices, np.int32)
    check("tree.tokens", tree.tokens, np.int32, shape=(b, n))
    check("tree.parents", tree.parents, np.int32, shape=(b, n))
    check("tree.num_nodes", tree.num_nodes, np.int32, shape=(b,))
    width = tree.max_depth + 1
    if out is None:
        out = alloc_accept(cupy, b, tree.max_depth)
    else:
        for name, shape in (("accepted", (b, width)), ("accept_len", (b,)), ("emitted", (b, width)),
                            ("bonus", (b,))):
            check(f"out.{name}", getattr(out, name), np.int32, shape=shape)
    if b == 0:
        return out
    module("tree_accept").fn("tree_accept_table_kernel")(
        ((b + _PER_BLOCK - 1) // _PER_BLOCK,), (_THREADS,),
        (tree.tokens, tree.parents, tree.num_nodes, choices, np.int32(b), np.int32(n), np.int32(width),
         out.accepted, out.accept_len, out.emitted, out.bonus))
    return out
