"""DDTree tree build: the heapq reference against an independent brute force and its properties
(CPU), then the GPU builder against the reference, bit for bit, on thousands of random requests."""

import itertools

import numpy as np
import pytest

from ddtree_rtc.reference.tree_build import FLT_MAX, alloc_tree, build_one, mask_words, sanitize_logq, tree_build

KINDS = ("sorted", "ties", "unsorted", "tiny", "equal", "weird")


def make_logq(rng, shape, kind: str) -> np.ndarray:
    """Log-prob tables that stress the exact order: continuous, heavy ties (dyadic steps, so equal
    path sums are exactly equal), unsorted rows, magnitudes that make float64 sums round, all equal,
    and NaN / inf / signed zeros."""
    if kind == "sorted":
        x = -np.sort(rng.exponential(2.0, shape), axis=-1)
    elif kind == "ties":
        x = -np.sort(np.round(rng.exponential(1.0, shape) * 2) / 2, axis=-1)
    elif kind == "unsorted":
        x = -rng.exponential(2.0, shape)
    elif kind == "tiny":
        x = -np.sort(np.abs(rng.standard_normal(shape)) * 10.0 ** rng.integers(-9, 2, shape), axis=-1)
    elif kind == "equal":
        x = np.full(shape, -1.0)
    elif kind == "weird":
        x = -rng.exponential(2.0, shape)
        for val, p in ((np.nan, 0.1), (-np.inf, 0.05), (np.inf, 0.02), (0.0, 0.05), (-0.0, 0.05)):
            x[rng.random(shape) < p] = val
    else:
        raise ValueError(kind)
    return x.astype(np.float32)


def make_case(rng, batch, depth, k, max_budget, kind, vocab=100_000):
    logq = make_logq(rng, (batch, depth, k), kind)
    # distinct ids per row without a permutation of the vocabulary per row (that cost ~1 s per case):
    # an arithmetic progression mod vocab with a stride coprime to it
    n = batch * depth
    stride = rng.choice(np.array([1, 3, 7, 11, 13, 9973, 31337, 77777]), (n, 1))
    assert all(np.gcd(int(s), vocab) == 1 for s in stride[:, 0])
    ids = ((rng.integers(0, vocab, (n, 1)) + np.arange(k) * stride) % vocab).reshape(batch, depth, k)
    root = rng.integers(0, vocab, batch)
    budgets = rng.integers(-2, max_budget + 3, batch)
    depths = rng.integers(0, depth + 2, batch)
    prefix = rng.integers(0, 10_000, batch)
    return (logq, ids.astype(np.int32), root.astype(np.int32), budgets.astype(np.int32),
            depths.astype(np.int32), prefix.astype(np.int32))


def reachable(k: int, depth: int) -> int:
    return sum(k**d for d in range(1, depth + 1))


def brute_force(logq, budget, depth):
    """Every node of the full tree scored by summing along its path, sorted by (score desc, rank
    tuple asc), first `budget`. Equals the heap order whenever sums are exact (dyadic log-probs)
    and log-probs are sorted (children and later siblings never score higher)."""
    k = logq.shape[1]
    nodes = []
    for d in range(1, depth + 1):
        for ranks in itertools.product(range(k), repeat=d):
            nodes.append((-sum(float(logq[j, r]) for j, r in enumerate(ranks)), ranks))
    nodes.sort()
    return [ranks for _, ranks in nodes[:budget]]


def rank_tuples(t, i):
    """Rank tuple of every node of request i, recovered from first_child / next_sibling."""
    tuples = {0: ()}
    for u in range(int(t.num_nodes[i])):
        v, r = t.first_child[i, u], 0
        while v >= 0:
            tuples[int(v)] = tuples[u] + (r,)
            v, r = t.next_sibling[i, v], r + 1
    return [tuples[j] for j in range(1, int(t.num_nodes[i]))]


@pytest.mark.parametrize("k,depth", [(1, 5), (2, 4), (3, 4), (4, 3), (6, 2)])
def test_reference_equals_brute_force_on_exact_sums(rng, k, depth):
    for _ in range(4):
        logq = -np.sort(rng.integers(0, 9, (1, depth, k)) / 4.0, axis=-1).astype(np.float32)  # many ties
        ids = np.arange(depth * k, dtype=np.int32).reshape(1, depth, k)
        total = reachable(k, depth)
        for budget in sorted({0, 1, 2, 5, total // 2, total - 1, total, total + 3}):
            if budget < 0:
                continue
            t = tree_build(logq, ids, np.array([7], np.int32), np.array([budget], np.int32),
                           np.array([depth], np.int32), np.array([0], np.int32), max(budget, 0))
            assert rank_tuples(t, 0) == brute_force(logq[0], budget, depth), (logq[0], budget)


def check_properties(t, args, max_budget):
    logq, ids, root, budgets, depths, prefix = args
    b, l, k = logq.shape
    for i in range(b):
        budget = min(max(int(budgets[i]), 0), max_budget)
        depth = min(max(int(depths[i]), 0), l)
        n = int(t.num_nodes[i])
        assert n == 1 + min(budget, reachable(min(k, max(budget, 1)), depth))
        assert t.tokens[i, 0] == root[i] and t.parents[i, 0] == -1 and t.node_depth[i, 0] == 0
        assert t.positions[i, 0] == prefix[i] and t.scores[i, 0] == 0.0
        tuples = rank_tuples(t, i)
        assert len(tuples) == n - 1, "every node is reachable through first_child / next_sibling"
        for j in range(1, n):
            p, d = int(t.parents[i, j]), int(t.node_depth[i, j])
            assert 0 <= p < j, "parents precede children"
            assert d == t.node_depth[i, p] + 1 and 1 <= d <= depth
            assert t.positions[i, j] == prefix[i] + d
            ranks = tuples[j - 1]
            assert len(ranks) == d and t.tokens[i, j] == ids[i, d - 1, ranks[-1]]
            expect = t.mask[i, p].copy()
            expect[j >> 6] |= np.uint64(1) << np.uint64(j & 63)
            assert np.array_equal(t.mask[i, j], expect)
        assert set(tuples) == {r[:m] for r in tuples for m in range(1, len(r) + 1)}, "prefix-closed"
        assert len(set(tuples)) == len(tuples)
        pad = slice(n, max_budget + 1)
        for a in (t.tokens, t.parents, t.node_depth, t.positions, t.first_child, t.next_sibling):
            assert (a[i, pad] == -1).all()
        assert np.isnan(t.scores[i, pad]).all() and (t.mask[i, pad] == 0).all()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("max_budget", [0, 1, 7, 40, 130])
def test_reference_properties(rng, kind, max_budget):
    args = make_case(rng, 6, int(rng.integers(1, 9)), int(rng.choice([1, 2, 3, 17, 200])), max_budget, kind)
    check_properties(tree_build(*args, max_budget), args, max_budget)


def test_scores_non_increasing_in_pop_order(rng):
    args = make_case(rng, 8, 7, 64, 256, "sorted")
    t = tree_build(*args, 256)
    for i in range(8):
        s = t.scores[i, 1:t.num_nodes[i]]
        assert (np.diff(s) <= 1e-12).all()


def test_budget_edges_and_chain():
    logq = np.log(np.array([[[0.5, 0.3, 0.2]] * 4], np.float32))
    ids = np.array([[[10, 11, 12], [20, 21, 22], [30, 31, 32], [40, 41, 42]]], np.int32)
    one = lambda v: np.array([v], np.int32)  # noqa: E731
    t = tree_build(logq, ids, one(5), one(0), one(4), one(100), 8)
    assert t.num_nodes[0] == 1 and t.tokens[0, 0] == 5 and (t.tokens[0, 1:] == -1).all()
    t = tree_build(logq, ids, one(5), one(-3), one(4), one(100), 8)
    assert t.num_nodes[0] == 1
    t = tree_build(logq[:, :, :1], ids[:, :, :1], one(5), one(4), one(4), one(100), 4)  # chain mode
    assert t.tokens[0].tolist() == [5, 10, 20, 30, 40] and t.parents[0].tolist() == [-1, 0, 1, 2, 3]
    assert t.positions[0].tolist() == [100, 101, 102, 103, 104]
    t = tree_build(logq[:, :2, :2], ids[:, :2, :2], one(5), one(50), one(2), one(0), 50)  # > reachable
    assert t.num_nodes[0] == 1 + 2 + 4
    t = tree_build(logq, ids, one(5), one(99), one(9), one(0), 3)  # clamped to max_budget, depth to L
    assert t.num_nodes[0] == 4


def test_nan_and_inf_are_sanitized_not_propagated():
    logq = np.array([[[np.nan, -1.0], [-np.inf, np.inf]]], np.float32)
    ids = np.array([[[1, 2], [3, 4]]], np.int32)
    one = lambda v: np.array([v], np.int32)  # noqa: E731
    t = tree_build(logq, ids, one(0), one(6), one(2), one(0), 6)
    assert np.isfinite(t.scores[0, :t.num_nodes[0]]).all()
    # NaN -> -FLT_MAX (the first pop is forced), -inf -> -FLT_MAX, +inf -> FLT_MAX; sums stay finite
    assert t.tokens[0, 1:7].tolist() == [1, 2, 3, 4, 3, 4]
    assert t.scores[0, 1] == -FLT_MAX and t.scores[0, 2] == -1.0 and t.scores[0, 4] == FLT_MAX


def test_bad_shapes_are_rejected():
    z = lambda *s: np.zeros(s, np.float32)  # noqa: E731
    i = lambda *s: np.zeros(s, np.int32)  # noqa: E731
    with pytest.raises(ValueError, match="ids: expected shape"):
        tree_build(z(2, 3, 4), i(2, 3, 5), i(2), i(2), i(2), i(2), 4)
    with pytest.raises(ValueError, match=r"budgets: expected shape \(2,\)"):
        tree_build(z(2, 3, 4), i(2, 3, 4), i(2), i(3), i(2), i(2), 4)
    with pytest.raises(ValueError, match="depth 17 is out of range"):
        tree_build(z(1, 17, 4), i(1, 17, 4), i(1), i(1), i(1), i(1), 4)
    with pytest.raises(ValueError, match="max_budget=513"):
        tree_build(z(1, 3, 4), i(1, 3, 4), i(1), i(1), i(1), i(1), 513)


# ---------------------------------------------------------------- the prune kernel's procedure (CPU)


def entry_tuple_less(pool, a, b, depth: int, rank: int) -> bool:
    """Rank-tuple order of two distinct pool entries (tuples with the parent entry at index 1 and
    the depth and rank at the given indices), as the kernel's entry_tuple_less."""
    da, db = pool[a][depth], pool[b][depth]
    shorter = da < db
    for _ in range(da - db):
        a = pool[a][1]
    for _ in range(db - da):
        b = pool[b][1]
    if a == b:
        return shorter
    while pool[a][1] != pool[b][1]:
        a, b = pool[a][1], pool[b][1]
    return pool[a][rank] < pool[b][rank]


def procedure_cases(rng, n: int = 600):
    """(kind, L, K, budget, log-probs as float64 lists, depth) for the CPU models of the kernel's
    parallel procedures: every kind of log-probs, tiny to mid budgets, a third of them depth 7."""
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        l, k, budget = int(rng.integers(1, 17)), int(rng.choice([1, 2, 3, 9, 64])), int(rng.choice([0, 1, 5, 12, 40]))
        if i % 3 == 0:
            l, k = 7, max(1, budget)
        lq = sanitize_logq(make_logq(rng, (l, k), kind)).astype(np.float64)[:, :min(k, max(budget, 1))].tolist()
        yield kind, l, k, budget, lq, int(rng.integers(0, l + 1))


def assert_heap_nodes(got, lq, budget: int, depth: int, case) -> None:
    """A model's nodes equal the heap loop's: (token slot, parent, depth) and the scores' bits."""
    want = build_one(lq, budget, depth)
    assert [g[:3] for g in got] == [w[:3] for w in want], case
    assert np.array([g[3] for g in got]).tobytes() == np.array([w[3] for w in want]).tobytes(), case


def ord64(x: float) -> int:
    """The kernel's monotone double -> u64 order key (+0 and -0 alike)."""
    b = 0 if x == 0.0 else int(np.array(x, np.float64).view(np.int64))
    return (~b) & (2**64 - 1) if b < 0 else b | 2**63


def hist_round(keys, lo: int, shift: int, need: int, nb: int = 256):
    """One histogram round of the prune variant: (bound, entries reaching it)."""
    hist = [0] * nb
    for k in keys:
        if k >= lo:
            hist[min(nb - 1, (k - lo) >> shift)] += 1
    run = 0
    for j in range(nb - 1, -1, -1):
        run += hist[j]
        if run >= need:
            return lo + (j << shift), run
    raise AssertionError("fewer than `need` keys reach lo")


def span_shift(lo: int, hi: int) -> int:
    return max(0, (hi - lo).bit_length() - 8) if hi > lo else 0


def prune_build_model(lq, budget, depth, cap, slack=16):
    """The procedure of ddtree_rtc/cuda_src/tree_build.cu's prune variant, step for step: grow a pool depth by
    depth (each depth-(d-1) entry walks its child chain, stored contiguously, while the score stays
    >= tau, a histogram lower bound that >= `budget` entries reach), stop on a non-monotone step or a
    full pool (None: the kernel falls back to the heap loop); then rounds narrowing the bound to
    <= budget + slack entries and a ranking of those only by (score desc, rank tuple asc)."""
    k = len(lq[0])
    if budget <= 0 or depth <= 0:
        return [], 0
    pool = []  # (score, parent entry, depth, rank)
    row = lq[0]
    for r in range(k):
        sc = row[0] if r == 0 else 0.0 + row[r]
        if r > 0 and sc > pool[-1][0]:
            return None, 0
        pool.append((sc, -1, 1, r))
    tau = ord64(pool[budget - 1][0]) if k >= budget else 0
    hi = ord64(pool[0][0])
    begin, end, shift, m = 0, k, -1, 0
    for d in range(2, depth + 1):
        row = lq[d - 1]
        new = []
        for p in range(begin, end):
            ps = pool[p][0]
            sc = ps + row[0]
            if sc > ps:
                return None, 0
            if ord64(sc) < tau:
                continue
            r = 0
            while True:
                new.append((sc, p, d, r))
                if r + 1 >= k:
                    break
                s2 = (sc - row[r]) + row[r + 1]
                if s2 > sc:
                    return None, 0
                if ord64(s2) < tau:
                    break
                sc, r = s2, r + 1
        if len(pool) + len(new) > cap:
            return None, 0
        pool += new
        if len(pool) == end:
            break
        begin, end = end, len(pool)
        if end >= budget:
            keys = [ord64(e[0]) for e in pool]
            lo = tau if tau else min(keys)
            shift = span_shift(lo, hi)
            tau, m = hist_round(keys, lo, shift, budget)
    count, n = len(pool), min(budget, len(pool))
    if count > budget:
        keys = [ord64(e[0]) for e in pool]
        assert shift >= 0
        while m > budget + slack and shift > 0:
            shift = max(0, shift - 8)
            tau, m = hist_round(keys, tau, shift, budget)
    else:
        tau = 0
    listed = [e for e in range(count) if ord64(pool[e][0]) >= tau]

    def tuple_less(a, b):
        return entry_tuple_less(pool, a, b, depth=2, rank=3)

    node = {}
    for e in listed:
        se = pool[e][0]
        before = sum(pool[x][0] > se or (pool[x][0] == se and x != e and tuple_less(x, e)) for x in listed)
        node[e] = before + 1 if before < n else -1
    out = [None] * n
    for e in listed:
        if node[e] > 0:
            s, p, d, r = pool[e]
            if r > 0:  # contiguous chains: e - 1 is the previous sibling, kept before e
                assert pool[e - 1][1] == p and pool[e - 1][3] == r - 1 and 0 < node[e - 1] < node[e]
            out[node[e] - 1] = (0 if p < 0 else node[p], d, r, s)
    return out, len(listed)


def test_prune_procedure_equals_the_heap_loop(rng):
    """The prune variant's procedure gives the heap loop's nodes bit for bit wherever it does not
    fall back; it never falls back on equal log-probs, rarely on sorted ones (a full pool only:
    with room for every entry it succeeds), and lists few entries beyond the budget on continuous
    log-probs."""
    listed_over, fell_back = [], {kind: 0 for kind in KINDS}
    for kind, l, k, budget, lq, depth in procedure_cases(rng):
        got, listed = prune_build_model(lq, budget, depth, 4 * budget + 64)
        if got is None:
            fell_back[kind] += 1
            if kind in ("sorted", "equal"):
                assert prune_build_model(lq, budget, depth, 10**9)[0] is not None, (kind, l, k, budget, depth)
            continue
        assert_heap_nodes(got, lq, budget, depth, (kind, l, k, budget, depth))
        if kind == "sorted" and budget >= 12:
            listed_over.append(listed - min(budget, listed))
    assert fell_back["equal"] == 0 and fell_back["sorted"] < 40, fell_back
    assert listed_over and max(listed_over) <= 16 + 12, listed_over


# ---------------------------------------------------------------- GPU


def assert_trees_equal(got, ref, what=""):
    for name in ("tokens", "parents", "node_depth", "positions", "num_nodes", "mask", "first_child",
                 "next_sibling", "scores"):
        g, r = getattr(got, name), getattr(ref, name)
        g = g.get() if hasattr(g, "get") else g
        if name == "scores":  # bit for bit, signed zeros and NaN padding included
            g, r = g.view(np.int64), r.view(np.int64)
        if not np.array_equal(g, r):
            bad = np.argwhere(g != r)[:3].tolist()
            raise AssertionError(f"{what} {name} differs at {bad}")


def run_gpu(args, max_budget, poison=True):
    import cupy

    from ddtree_rtc.kernels.tree_build import tree_build as gpu_build

    dev = [cupy.asarray(a) for a in args]
    out = alloc_tree(cupy, args[0].shape[0], max_budget, args[0].shape[1])
    if poison:  # every slot must be written: garbage where padding belongs shows up
        for a in (out.tokens, out.parents, out.node_depth, out.positions, out.num_nodes, out.first_child,
                  out.next_sibling):
            a.fill(0x5A5A5A5A)
        out.mask.fill(0xA5A5A5A5A5A5A5A5)
        out.scores.fill(np.nan)
    got = gpu_build(*dev, max_budget, out=out)
    assert got is out
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("max_budget", [0, 1, 5, 64, 95, 96, 200, 287, 288, 512])
def test_kernel_matches_reference(rng, kind, max_budget):
    for depth, k in ((7, max(1, min(max_budget, 163840))), (int(rng.integers(1, 17)), int(rng.choice([1, 2, 9, 600])))):
        args = make_case(rng, 96, depth, k, max_budget, kind)
        assert_trees_equal(run_gpu(args, max_budget), tree_build(*args, max_budget),
                           f"{kind} depth={depth} k={k} max_budget={max_budget}:")


@pytest.mark.gpu
def test_kernel_thousands_of_small_trees_with_heavy_ties(rng):
    for _ in range(4):
        args = make_case(rng, 1024, int(rng.integers(1, 9)), int(rng.integers(1, 6)), 12, "ties")
        assert_trees_equal(run_gpu(args, 12), tree_build(*args, 12), "tiny budgets, heavy ties:")


@pytest.mark.gpu
@pytest.mark.parametrize("max_budget", [16, 64, 256, 512])
def test_prune_kernel_on_drafter_like_log_probs(rng, max_budget):
    """Sorted non-positive log-probs, Zipf-like and peaked (the prune path's own case, and where a
    full pool sends it to the heap loop), against the reference."""
    b, depth = 64, 7
    ranks = np.arange(1, max_budget + 1, dtype=np.float64)
    zipf = -1.1 * np.log(ranks) - 2.3 + 0.1 * rng.standard_normal((b, depth, max_budget))
    peaked = -np.sort(rng.exponential(1.5, (b, depth, max_budget)), axis=-1)
    peaked[..., 0] = -0.1 * rng.random((b, depth))
    for logq in (zipf, peaked):
        logq = -np.sort(-logq, axis=-1).astype(np.float32)
        args = (logq, make_case(rng, b, depth, max_budget, max_budget, "sorted")[1],
                rng.integers(0, 1000, b).astype(np.int32), np.full(b, max_budget, np.int32),
                np.full(b, depth, np.int32), rng.integers(0, 1000, b).astype(np.int32))
        assert_trees_equal(run_gpu(args, max_budget), tree_build(*args, max_budget), "drafter-like:")


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 5, 32])
@pytest.mark.parametrize("max_budget", [1, 2, 3, 16, 63, 64, 65, 128, 512])
def test_kernel_matches_reference_at_every_depth(rng, batch, max_budget):
    """Bit for bit against heapq: every depth 1..7, per-request budgets and depth limits around the
    maximum (make_case), heavy ties (quantized log-probs) and the other kinds, outputs poisoned first."""
    for depth in range(1, 8):
        for kind in ("ties", "equal", "sorted", "weird") if depth in (1, 7) else ("ties",):
            args = make_case(rng, batch, depth, max_budget, max_budget, kind)
            assert_trees_equal(run_gpu(args, max_budget), tree_build(*args, max_budget),
                               f"b={batch} depth={depth} {kind} max_budget={max_budget}:")
    # quantized drafter-like rows at the full budget and depth: many exactly equal path sums
    logq = -np.sort(rng.integers(0, 8, (batch, 7, max_budget)) / 4.0, axis=-1).astype(np.float32)
    args = (logq, make_case(rng, batch, 7, max_budget, max_budget, "sorted")[1],
            rng.integers(0, 1000, batch).astype(np.int32), np.full(batch, max_budget, np.int32),
            np.full(batch, 7, np.int32), rng.integers(0, 1000, batch).astype(np.int32))
    assert_trees_equal(run_gpu(args, max_budget), tree_build(*args, max_budget), "quantized:")


@pytest.mark.gpu
def test_kernel_rejects_bad_input():
    import cupy

    from ddtree_rtc.kernels.tree_build import tree_build as gpu_build

    z, i = cupy.zeros((2, 3, 4), cupy.float32), cupy.zeros((2, 3, 4), cupy.int32)
    v = cupy.zeros((2,), cupy.int32)
    with pytest.raises(TypeError, match="ids: expected dtype int32"):
        gpu_build(z, i.astype(cupy.int64), v, v, v, v, 4)
    with pytest.raises(ValueError, match="budgets: expected shape"):
        gpu_build(z, i, v, cupy.zeros((3,), cupy.int32), v, v, 4)
    with pytest.raises(ValueError, match="C-contiguous"):
        gpu_build(cupy.zeros((2, 4, 3), cupy.float32).transpose(0, 2, 1), i, v, v, v, v, 4)
    out = alloc_tree(cupy, 2, 8, 3)
    with pytest.raises(ValueError, match="out: made for max_budget=8"):
        gpu_build(z, i, v, v, v, v, 4, out=out)
    assert mask_words(512) == 9
