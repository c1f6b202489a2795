"""DDTree acceptance walk reference.

Given the target's choice at every tree node (its argmax at T=0, or one token sampled per node from
its softmax at T>0), walk from the root: while the current node has a child whose token equals the
choice there, move to it. The walk is lossless because each emitted token IS the target's choice
given the tokens before it; the first unmatched choice is the bonus token.

Shared rule with cuda_src/tree_accept.cu: if several children carried the chosen token (top-k ids
are distinct, so trees built from top-k never have that), the lowest node index wins.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class AcceptArrays:
    accepted: object  # [B, L+1] int32 accepted node indices, root first, then -1
    accept_len: object  # [B] int32 accepted nodes incl. the root = tokens emitted this round
    emitted: object  # [B, L+1] int32 tokens of accepted nodes 1.. then the bonus, then -1
    bonus: object  # [B] int32 the target's choice at the last accepted node


def alloc_accept(xp, batch: int, max_depth: int) -> AcceptArrays:
    w = max_depth + 1
    return AcceptArrays(xp.empty((batch, w), dtype=np.int32), xp.empty((batch,), dtype=np.int32),
                        xp.empty((batch, w), dtype=np.int32), xp.empty((batch,), dtype=np.int32))


def check_accept_args(tree, choices):
    b, n = tree.tokens.shape
    if tuple(choices.shape) != (b, n):
        raise ValueError(f"choices: expected shape {(b, n)} (one token per tree node slot), "
                         f"got {tuple(choices.shape)}")
    return b, n


def walk(tokens, parents, num_nodes: int, choices) -> list[int]:
    """Accepted node indices of one tree, root first."""
    path = [0]
    u = 0
    while True:
        c = choices[u]
        nxt = next((v for v in range(u + 1, num_nodes) if parents[v] == u and tokens[v] == c), None)
        if nxt is None:
            return path
        path.append(nxt)
        u = nxt


def tree_accept(tree, choices, out=None) -> AcceptArrays:
    """tree: TreeArrays from tree_build; choices ``[B, 1 + max_budget]`` int32."""
    b, n = check_accept_args(tree, choices)
    w = tree.max_depth + 1
    o = alloc_accept(np, b, tree.max_depth) if out is None else out
    o.accepted[...] = -1
    o.emitted[...] = -1
    tokens, parents = np.asarray(tree.tokens), np.asarray(tree.parents)
    choices = np.asarray(choices)
    for i in range(b):
        nn = min(max(int(tree.num_nodes[i]), 1), n)
        path = walk(tokens[i], parents[i], nn, choices[i])[:w]
        bonus = int(choices[i, path[-1]])
        o.accepted[i, : len(path)] = path
        o.accept_len[i] = len(path)
        o.emitted[i, : len(path) - 1] = tokens[i, path[1:]]
        o.emitted[i, len(path) - 1] = bonus
        o.bonus[i] = bonus
    return o
