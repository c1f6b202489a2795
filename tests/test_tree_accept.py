"""DDTree acceptance: the reference walk against a brute-force search over the tree, losslessness
(T=0: the output is the target's greedy decode; T>0: a chi-square test of the emitted tokens'
distribution, with a broken walk as a control that must fail it), then the kernel against the
reference."""

import numpy as np
import pytest

from ddtree_rtc.reference.tree_accept import AcceptArrays, tree_accept
from ddtree_rtc.reference.tree_build import tree_build


def random_trees(rng, batch, depth, k, max_budget, vocab=50):
    vocab = max(vocab, k)  # distinct ids per depth
    logq = -np.sort(rng.exponential(1.0, (batch, depth, k)), axis=-1).astype(np.float32)
    ids = np.stack([rng.permutation(vocab)[:k] for _ in range(batch * depth)]).reshape(batch, depth, k)
    return tree_build(logq, ids.astype(np.int32), rng.integers(0, vocab, batch).astype(np.int32),
                      rng.integers(0, max_budget + 1, batch).astype(np.int32),
                      rng.integers(0, depth + 1, batch).astype(np.int32), np.zeros(batch, np.int32), max_budget)


def matching_choices(rng, tree, vocab=50, p_match=0.8):
    """Per node: the token of one of its children with probability p_match, else a random token."""
    b, n = tree.tokens.shape
    choices = rng.integers(0, vocab, (b, n)).astype(np.int32)
    for i in range(b):
        kids = {}
        for j in range(1, int(tree.num_nodes[i])):
            u = int(tree.parents[i, j])
            if 0 <= u < j:  # junk parents (hand-made trees) name no node to choose at
                kids.setdefault(u, []).append(int(tree.tokens[i, j]))
        for u, toks in kids.items():
            if rng.random() < p_match:
                choices[i, u] = toks[rng.integers(len(toks))]
    return choices


def brute_force(tokens, parents, n, choices):
    """The deepest node whose every edge u -> v on the root path has tokens[v] == choices[u]."""
    best = [0]
    for v in range(1, n):
        path = [v]
        while path[-1] != 0:
            path.append(int(parents[path[-1]]))
        path.reverse()
        if all(tokens[w] == choices[u] for u, w in zip(path, path[1:])) and len(path) > len(best):
            best = path
    return best


def test_reference_against_brute_force(rng):
    lens = []
    for _ in range(20):
        t = random_trees(rng, 8, int(rng.integers(1, 9)), int(rng.integers(1, 6)), int(rng.integers(0, 40)))
        choices = matching_choices(rng, t)
        acc = tree_accept(t, choices)
        for i in range(8):
            path = brute_force(t.tokens[i], t.parents[i], int(t.num_nodes[i]), choices[i])
            n = len(path)
            assert acc.accept_len[i] == n and acc.accepted[i, :n].tolist() == path
            assert (acc.accepted[i, n:] == -1).all() and (acc.emitted[i, n:] == -1).all()
            assert acc.bonus[i] == choices[i, path[-1]]
            assert acc.emitted[i, :n].tolist() == [int(t.tokens[i, v]) for v in path[1:]] + [int(acc.bonus[i])]
            lens.append(n)
    assert max(lens) >= 4, "the cases must reach deep nodes"


def test_rejects_mismatched_choices(rng):
    t = random_trees(rng, 3, 4, 3, 10)
    with pytest.raises(ValueError, match="choices: expected shape"):
        tree_accept(t, np.zeros((3, 10), np.int32))


# A toy target and drafter over a small vocabulary: first-order Markov chains.
V_TOY = 5


def toy_chains(rng):
    target = rng.dirichlet(np.full(V_TOY, 0.7), V_TOY)
    draft = 0.6 * target + 0.4 * rng.dirichlet(np.ones(V_TOY), V_TOY)
    return target, draft


def tree_inputs(draft, root: int, budget: int, depth: int, k: int = 3):
    """DFlash-like drafting: one distribution per depth (here: the chain rolled forward from the
    root), as one request's tree_build inputs."""
    dist, rows = np.eye(V_TOY)[root], []
    for _ in range(depth):
        dist = dist @ draft
        rows.append(dist)
    p = np.array(rows)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    logq = np.log(np.take_along_axis(p, ids, -1)).astype(np.float32)
    return logq, ids.astype(np.int32), root, budget, depth, 0


def draft_trees(draft, roots, budget: int, depth: int):
    per = [tree_inputs(draft, int(r), budget, depth) for r in roots]
    cols = list(zip(*per))
    return tree_build(np.stack(cols[0]), np.stack(cols[1]),
                      *(np.array(c, np.int32) for c in cols[2:]), budget)


def sample_choices(rng, target, tree):
    """One sample of the target per node slot, given the node's token (inverse CDF, vectorised)."""
    tok = np.maximum(tree.tokens, 0)
    u = rng.random(tok.shape)[..., None]
    return np.minimum((u > np.cumsum(target[tok], axis=-1)).sum(-1), V_TOY - 1).astype(np.int32)


def first_two_tokens(rng, target, draft, root, trials, accept):
    """Emitted token pairs of ``trials`` independent requests from ``root``; those that emitted one
    token in the first round get a second round from their bonus token (T > 0 choices)."""
    t = draft_trees(draft, [root] * trials, budget=6, depth=3)
    acc = accept(t, sample_choices(rng, target, t))
    lens, emitted = np.asarray(acc.accept_len), np.asarray(acc.emitted)
    second = emitted[:, 1].copy()
    again = np.flatnonzero(lens == 1)
    if again.size:
        t2 = draft_trees(draft, emitted[again, 0], budget=6, depth=3)
        second[again] = np.asarray(accept(t2, sample_choices(rng, target, t2)).emitted)[:, 0]
    return np.stack([emitted[:, 0], second], axis=1)


def chi_square_limit(dof: int, z: float = 4.75) -> float:
    """Wilson-Hilferty upper quantile of chi-square(dof); z = 4.75 is a one-sided p of about 1e-6."""
    c = 2.0 / (9.0 * dof)
    return dof * (1.0 - c + z * np.sqrt(c)) ** 3


def chi_square(pairs, expected):
    counts = np.zeros_like(expected)
    np.add.at(counts, (pairs[:, 0], pairs[:, 1]), 1)
    exp = expected * len(pairs)
    keep = exp > 5
    return float(((counts - exp) ** 2 / np.where(keep, exp, 1))[keep].sum()), int(keep.sum()) - 1


def first_child_accept(tree, choices):
    """Broken on purpose: always walks to the first child, whatever the target chose (lossy)."""
    forced = np.array(choices, copy=True)
    for i in range(tree.tokens.shape[0]):
        for u in range(int(tree.num_nodes[i])):
            if tree.first_child[i, u] >= 0:
                forced[i, u] = tree.tokens[i, tree.first_child[i, u]]
    return tree_accept(tree, forced)


def test_sampled_choices_are_lossless_chi_square(rng):
    target, draft = toy_chains(rng)
    root, trials = 0, 20_000
    expected = target[root][:, None] * target
    stat, dof = chi_square(first_two_tokens(rng, target, draft, root, trials, tree_accept), expected)
    assert stat < chi_square_limit(dof), f"chi-square {stat:.1f} over {dof} dof"
    broken, dof_b = chi_square(first_two_tokens(rng, target, draft, root, trials, first_child_accept), expected)
    assert broken > chi_square_limit(dof_b), "the control (a lossy walk) must fail the same test"


def test_greedy_choices_reproduce_greedy_decoding(rng):
    target, draft = toy_chains(rng)
    greedy = np.argmax(target, axis=-1)
    want, tok = [], 2
    for _ in range(40):
        tok = int(greedy[tok])
        want.append(tok)
    got, root = [], 2
    while len(got) < 40:
        t = draft_trees(draft, [root], budget=int(rng.integers(0, 12)), depth=4)
        choices = greedy[np.maximum(t.tokens, 0)].astype(np.int32)  # the target's argmax per node
        acc = tree_accept(t, choices)
        got += acc.emitted[0, : acc.accept_len[0]].tolist()
        root = got[-1]
    assert got[:40] == want


# ---------------------------------------------------------------- GPU


def run_gpu(tree, choices):
    import cupy

    from ddtree_rtc.kernels.tree_accept import tree_accept as kernel_accept
    from ddtree_rtc.reference.tree_accept import alloc_accept
    from ddtree_rtc.reference.tree_build import TreeArrays

    dev = TreeArrays(*(cupy.asarray(getattr(tree, f)) for f in (
        "tokens", "parents", "node_depth", "positions", "num_nodes", "mask", "first_child", "next_sibling",
        "scores")), tree.max_budget, tree.max_depth)
    out = alloc_accept(cupy, tree.tokens.shape[0], tree.max_depth)
    for a in (out.accepted, out.accept_len, out.emitted, out.bonus):
        a.fill(0x5A5A5A5A)
    got = kernel_accept(dev, cupy.asarray(choices), out=out)
    assert got is out
    return got


def on_host(acc):
    return AcceptArrays(*(getattr(acc, f).get() for f in ("accepted", "accept_len", "emitted", "bonus")))


def assert_accept_equal(got, ref):
    for name in ("accepted", "accept_len", "emitted", "bonus"):
        g, r = getattr(got, name).get(), getattr(ref, name)
        if not np.array_equal(g, r):
            raise AssertionError(f"{name} differs at {np.argwhere(g != r)[:3].tolist()}")


@pytest.mark.gpu
@pytest.mark.parametrize("max_budget", [0, 3, 64, 300, 512])
def test_kernel_matches_reference(rng, max_budget):
    depth = int(rng.integers(1, 17))
    t = random_trees(rng, 333, depth, int(rng.choice([1, 2, 8, 512])), max_budget)
    for p_match in (0.0, 0.9, 1.0):
        choices = matching_choices(rng, t, p_match=p_match)
        assert_accept_equal(run_gpu(t, choices), tree_accept(t, choices))


@pytest.mark.gpu
def test_kernel_hand_made_trees(rng):
    """Duplicate child tokens (the lowest index wins), parents out of range or after the child, and
    garbage past num_nodes: the kernel follows the reference's rules."""
    t = random_trees(rng, 200, 6, 3, 40, vocab=3)  # 3 ids, so every node's children share tokens
    n = t.tokens.shape[1]
    junk = rng.random(t.parents.shape) < 0.1
    t.parents[junk] = rng.integers(-3, n + 3, int(junk.sum()))
    t.tokens[:, :] = np.where(np.arange(n) < t.num_nodes[:, None], t.tokens, rng.integers(0, 3, t.tokens.shape))
    for p_match in (0.5, 1.0):
        choices = matching_choices(rng, t, vocab=3, p_match=p_match)
        assert_accept_equal(run_gpu(t, choices), tree_accept(t, choices))


@pytest.mark.gpu
def test_kernel_lossless_chi_square(rng):
    """20 000 independent requests per launch, each with fresh samples of the target's choices."""
    target, draft = toy_chains(rng)
    root = 1
    pairs = first_two_tokens(rng, target, draft, root, 20_000, lambda t, c: on_host(run_gpu(t, c)))
    stat, dof = chi_square(pairs, target[root][:, None] * target)
    assert stat < chi_square_limit(dof), f"chi-square {stat:.1f} over {dof} dof"
