"""The speculative round on the CUDA backend: against the numpy round, replayed from CUDA graphs,
and against CUDA autoregressive decoding. The GPU tests skip without a GPU; the margin machinery
they rely on is checked on numpy here too.

Why "up to near-ties": the bf16 CUDA kernels round differently from the numpy references, and a
17-row verify differently from a 1-row decode (cuBLAS and the attention pick other tiles and
splits), so logits agree only to a fraction of a percent. Where the top two candidates of a choice
(the logits at T = 0; logit / T + the keyed Gumbel noise at T > 0) lie closer than NEAR_TIE of the
row's scale, either token is the target's, and the runs may part there. So each request is
compared up to its first such position, margins taken from the reference run's own logits. A
random tiny model has many near-ties (about 18% of its greedy positions at 2%), so the requests are
picked from a pool by the length of their clear prefix in the reference run, and the test asserts
that most of their generated positions are compared.

The id comparisons use the tiny preset with every layer dense: on the GPU a near-tied MoE routing
choice can flip as well, and a flipped expert moves the logits by far more than rounding does, so
a routing near-tie would have to end the comparison too (at about 14% of tokens below 0.005 on the
tiny model, that leaves too little to compare). The graph-replay test needs no tolerance (same
kernels and plans with and without graphs: bit-identical), so it runs the MoE tiny model."""

import time

import numpy as np
import pytest
from ml_dtypes import bfloat16

from ddtree_rtc.backend import Backend
from ddtree_rtc.engine.engine import Engine
from ddtree_rtc.engine.request import Request
from ddtree_rtc.model.config import PRESETS, config_from_dict
from ddtree_rtc.model.make_model import make_model
from ddtree_rtc.model.target import TargetModel
from ddtree_rtc.reference.sampling import gumbel
from ddtree_rtc.speculative.drafters import OracleDrafter

NEAR_TIE = 0.02  # top-1 minus top-2 score over the row's max |logit| (/ T when sampling)
DEPTH = 7
NEW = 12  # tokens per request
POOL = 96  # candidate requests; the PICK with the longest clear prefix in the reference run are compared
PICK = 8
MIN_COMPARED = 0.6  # of the picked requests' generated positions


def dense_tiny_config():
    """The tiny preset with every layer dense (first_k_dense_replace = all layers)."""
    raw = PRESETS["tiny"]
    return config_from_dict({**raw, "first_k_dense_replace": raw["num_hidden_layers"]}, "<tiny, dense>")


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_dense")
    make_model(dense_tiny_config(), d, seed=5)
    return d


def pool_requests(temperature: float, seed: int = 1) -> list[Request]:
    rng = np.random.default_rng(seed)
    return [Request(i, rng.integers(3, 1000, int(rng.integers(3, 20))).tolist(), NEW, temperature=temperature)
            for i in range(POOL)]


def copies(reqs: list[Request]) -> list[Request]:
    """Fresh requests with the same ids (the sampling streams), prompts and settings."""
    return [Request(r.rid, list(r.prompt), r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, seed=r.seed)
            for r in reqs]


def run_engine(model, reqs, drafter=None, mode="autoregressive", budget=16, graphs=False, record=None):
    """Run ``reqs``; with ``record`` (a dict), every choice the engine makes is stored as
    record[(rid, position)] = (logits row fp32, temperature, sampling key or None)."""
    eng = Engine(model, max_batch=4, page_size=16, max_context=128, mode=mode, drafter=drafter, budget=budget,
                 cuda_graphs=graphs)
    if record is not None:
        choose = eng.sampler.choose

        def recording_choose(logits, rows, positions):
            host = eng.backend.to_host(logits).astype(np.float32)
            keys = eng.sampler.sample_keys(rows, positions)
            for row, r, p, k in zip(host, rows, np.asarray(positions).tolist(), keys):
                record[(r.rid, int(p))] = (row, r.temperature, k)
            return choose(logits, rows, positions)

        eng.sampler.choose = recording_choose
    out = eng.run(reqs)
    assert eng.pages.num_free_pages == eng.pages.num_pages and eng.pages.num_promised_pages == 0
    return eng, {r.rid: r.output for r in out}


def choice_margin(row: np.ndarray, temperature: float, key) -> tuple[int, float]:
    """The token a choice over ``row`` makes (argmax at T = 0; at T > 0 the Gumbel-max the sampling
    kernel computes at top_p = 1) and its top-1 minus top-2 score over the row's scale."""
    scale = float(np.abs(row).max())
    if temperature == 0:
        s = row
    else:
        inv = np.float32(1.0) / np.float32(temperature)
        s = row * inv + gumbel(np.uint64(key), np.arange(row.shape[0]))
        scale *= float(inv)
    top = np.sort(s)[-2:]
    return int(np.argmax(s)), float(top[1] - top[0]) / scale


def clear_prefix(rid, prompt_len: int, output: list[int], record: dict) -> int:
    """Positions of ``output`` before the first near-tie of the reference run that made it (whose
    choices are checked against the recomputed ones where the margin is clear)."""
    for j, token in enumerate(output):
        row, temperature, key = record[(rid, prompt_len + j)]
        pick, margin = choice_margin(row, temperature, key)
        if margin < NEAR_TIE:
            return j
        assert pick == token, f"request {rid}, token {j}: the run chose {token}, its scores say {pick}"
    return len(output)


def pick_clear(reqs: list[Request], outputs: dict, record: dict) -> tuple[list[Request], dict]:
    """The PICK requests with the longest clear prefixes (ties by id), and each one's prefix."""
    clear = {r.rid: clear_prefix(r.rid, len(r.prompt), outputs[r.rid], record) for r in reqs}
    chosen = sorted(reqs, key=lambda r: (-clear[r.rid], r.rid))[:PICK]
    return chosen, {r.rid: clear[r.rid] for r in chosen}


def oracle_of(model, outputs: dict, p: float = 0.8) -> OracleDrafter:
    """The oracle over the reference run's tokens (greedy at T = 0, the target's own samples at T > 0):
    trees that hold the path the target takes, at a tau set by ``p``."""
    return OracleDrafter(model.backend, model.cfg.vocab_size, DEPTH, lambda rid, prompt: outputs[rid], accept_p=p)


def assert_agree(got: dict, want: dict, clear: dict, what: str) -> None:
    compared = 0
    for rid, n in clear.items():
        assert got[rid][:n] == want[rid][:n], (
            f"{what}: request {rid} differs within its {n} clear positions:\n{got[rid]}\n{want[rid]}")
        compared += n
    total = sum(len(want[rid]) for rid in clear)
    assert compared >= MIN_COMPARED * total, f"{what}: only {compared} of {total} positions are clear of near-ties"


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_choice_margins_reproduce_the_numpy_choices(dense_dir, temperature):
    """The margin machinery on numpy: every recorded choice of an autoregressive run is the token
    choice_margin recomputes (near-ties included: numpy is the kernel's own reference), and the
    picked requests leave most positions to compare."""
    model = TargetModel.load(dense_dir, Backend("numpy"))
    reqs, record = pool_requests(temperature)[:24], {}
    _, out = run_engine(model, copies(reqs), record=record)
    for r in reqs:
        for j, token in enumerate(out[r.rid]):
            assert choice_margin(*record[(r.rid, len(r.prompt) + j)])[0] == token, (r.rid, j)
    chosen, clear = pick_clear(reqs, out, record)
    assert sum(clear.values()) >= MIN_COMPARED * sum(len(out[r.rid]) for r in chosen)
    margins = [choice_margin(*v)[1] for v in record.values()]
    assert 0.02 < np.mean(np.array(margins) < NEAR_TIE) < 0.5, "a random model has near-ties, not mostly"


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_cuda_round_equals_the_numpy_round_up_to_near_ties(dense_dir, temperature):
    """Same prompts, same oracle drafter (over the numpy run's tokens): the CUDA DDTree round emits
    the numpy round's ids (T = 0) / samples (T > 0: keyed by seed, request and position) up to the
    first near-tie of the numpy target's choices."""
    host = TargetModel.load(dense_dir, Backend("numpy"))
    cuda = TargetModel.load(dense_dir, Backend("cuda"))
    pool, record = pool_requests(temperature), {}
    _, ref = run_engine(host, copies(pool), record=record)
    chosen, clear = pick_clear(pool, ref, record)
    np_eng, want = run_engine(host, copies(chosen), oracle_of(host, ref), "ddtree", 16)
    assert want == {r.rid: ref[r.rid] for r in chosen}, "the numpy round equals numpy autoregressive decoding"
    cu_eng, got = run_engine(cuda, copies(chosen), oracle_of(cuda, ref), "ddtree", 16)
    assert_agree(got, want, clear, f"CUDA vs numpy DDTree at T={temperature}")
    assert np_eng.round.stats.tau > 2 and cu_eng.round.stats.tau > 2, "the trees hold the target's path"


@pytest.mark.gpu
@pytest.mark.parametrize("mode,budget", [("ddtree", 16), ("ddtree", 64), ("ddtree", 3), ("chain", 0)])
def test_cuda_round_equals_cuda_autoregressive_up_to_near_ties(dense_dir, mode, budget):
    """CUDA DDTree / chain ids equal CUDA autoregressive ids up to the first near-tie of the
    autoregressive run's own logits."""
    cuda = TargetModel.load(dense_dir, Backend("cuda"))
    pool, record = pool_requests(0.0, seed=2), {}
    _, ref = run_engine(cuda, copies(pool), record=record)
    chosen, clear = pick_clear(pool, ref, record)
    eng, got = run_engine(cuda, copies(chosen), oracle_of(cuda, ref), mode, budget)
    assert_agree(got, {r.rid: ref[r.rid] for r in chosen}, clear, f"CUDA {mode} budget {budget} vs CUDA AR")
    assert eng.round.stats.tau > 1.5


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_cuda_round_graph_replay_equals_eager(tiny_dir, temperature):
    """The round with its verify forward replayed from CUDA graphs gives the eager round's ids bit
    for bit (same kernels, same attention and MoE plans), at T = 0 and T > 0; the runner captured
    one graph per (batch, 1 + budget) shape a round can meet at the engine's start (none later)
    and replayed one per round."""
    cuda = TargetModel.load(tiny_dir, Backend("cuda"))
    reqs = pool_requests(temperature, seed=3)[:7]  # 7 requests, 4 slots: round batches of several sizes
    _, ref = run_engine(cuda, copies(reqs))
    outs = []
    for graphs in (False, True):
        eng = Engine(cuda, max_batch=4, page_size=16, max_context=128, mode="ddtree",
                     drafter=oracle_of(cuda, ref), budget=16, cuda_graphs=graphs)
        sizes, run_round = [], eng.round.run

        def counted(live, eos, sizes=sizes, run_round=run_round):
            sizes.append(len(live))
            return run_round(live, eos)

        eng.round.run = counted
        started = eng.runner.captures
        outs.append([r.output for r in eng.run(copies(reqs))])
        if graphs:
            shapes = eng.graph_shapes()  # row-invariant: groups of 3 (64 // 17 rows) requests at most
            assert shapes == [(b, 17 * b, 17) for b in range(1, 4 if eng.invariant else 5)]
            assert set(sizes) <= {b for b, _, _ in shapes} and len(set(sizes)) >= 2
            assert eng.runner.captures == started == len(eng.runner) == len(shapes), (eng.runner.captures, sizes)
            assert eng.runner.replays == len(sizes), (eng.runner.replays, len(sizes))
        else:
            assert eng.runner.captures == eng.runner.replays == 0
        assert eng.round.stats.tau > 1.5
    assert outs[0] == outs[1]


@pytest.mark.gpu
def test_cuda_device_round_matches_numpy_with_moe(tiny_dir):
    """The device round the round bench times (bench.round.DeviceRound: top-k, build, fill_tree,
    verify, argmax, accept, commit) on the MoE tiny model, CUDA against numpy from the same draft
    logits and cache contents: the same trees (top-k ids and the build are exact), verify logits
    within bf16 rounding (a near-tied routing choice may move a few rows further, as in
    tests/test_oracle_hf.py), the same choices wherever the numpy margin is clear."""
    from ddtree_rtc.bench.round import DeviceRound
    from ddtree_rtc.testing import random_bf16

    # Zipf-shaped draft logits with noise: the oracle's rows repeat the same values at every depth,
    # so paths with the same ranks in another order tie exactly, and a last-bit difference in the
    # top-k's log-softmax would order them differently on the two backends
    rng = np.random.default_rng(0)
    ranks = np.stack([rng.permutation(1024) for _ in range(3 * DEPTH)]) + 1.0
    drafts = (-1.2 * np.log(ranks) + 0.2 * rng.standard_normal(ranks.shape)).reshape(3, DEPTH, 1024).astype(bfloat16)
    rows = None
    rounds = {}
    for kind in ("numpy", "cuda"):
        model = TargetModel.load(tiny_dir, Backend(kind))
        rd = DeviceRound(model, batch=3, budget=16, ctx=40, accept_p=0.8, seed=4)
        rows = random_bf16(np.random.default_rng(1), rd.cache.data.shape, 0.5) if rows is None else rows
        rd.cache.data[...] = model.backend.asarray(rows)
        rd.logits = model.backend.asarray(drafts)
        out, choices, _ = rd.run()
        be = model.backend
        tree = {k: be.to_host(getattr(rd.bufs.tree, k)) for k in ("tokens", "parents", "num_nodes", "mask")}
        rounds[kind] = tree, be.to_host(out.logits).astype(np.float64), be.to_host(choices)
    (t_np, l_np, c_np), (t_cu, l_cu, c_cu) = rounds["numpy"], rounds["cuda"]
    for k in t_np:
        assert np.array_equal(t_np[k], t_cu[k]), f"tree {k}"
    rel = np.linalg.norm(l_cu - l_np, axis=1) / np.linalg.norm(l_np, axis=1)
    assert np.median(rel) < 2e-2 and (rel < 5e-2).mean() >= 0.8, (np.median(rel), (rel < 5e-2).mean())
    top2 = np.sort(l_np, axis=1)[:, -2:]
    clear = ((top2[:, 1] - top2[:, 0]) >= NEAR_TIE * np.abs(l_np).max(axis=1)) & (rel < 5e-2)
    assert clear.mean() > 0.5
    assert np.array_equal(c_cu.reshape(-1)[clear], c_np.reshape(-1)[clear])


class BusyOracle(OracleDrafter):
    """The oracle with fp32 matmuls queued before its logits each draft (testing.busy_device): the
    round's plan then runs while the device still has the draft's work ahead of it."""

    def draft(self, rids, roots, prefix_lens):
        from ddtree_rtc.testing import busy_device

        busy_device()
        return super().draft(rids, roots, prefix_lens)


@pytest.mark.gpu
@pytest.mark.parametrize("mode,budget", [("ddtree", 16), ("chain", 0), ("ddtree", "auto")])
def test_cuda_round_plans_while_the_device_drafts(dense_dir, mode, budget):
    """The round enqueues its draft and build before the verify's plan: with device work queued in
    every draft, the plan starts while the device is still busy with it, and each plan (and the
    lagged cut's copy) takes the host a fraction of that work (its copies are queued behind the build
    from page-locked staging, not waited for); the verify, replayed from a CUDA graph that reads the
    buffers those copies fill, still gives CUDA autoregressive ids up to near-ties. Fixed budget,
    chain, and auto (lagged, a given cost table: its first round plans after reading its own tree)."""
    import cupy

    from ddtree_rtc.engine.decode.budget import CostModel
    from ddtree_rtc.testing import busy_device

    cuda = TargetModel.load(dense_dir, Backend("cuda"))
    pool, record = pool_requests(0.0, seed=2), {}
    _, ref = run_engine(cuda, copies(pool), record=record)
    chosen, clear = pick_clear(pool, ref, record)
    busy_device()
    cuda.backend.synchronize()
    t0 = time.perf_counter()
    busy_device()
    cuda.backend.synchronize()
    busy_s = time.perf_counter() - t0
    auto = budget == "auto"
    cost = CostModel(verify=((1, 1e-3), (10**6, 1e-3)))  # nodes are free: every round drafts
    eng = Engine(cuda, max_batch=4, page_size=16, max_context=128, mode=mode, budget=budget, cuda_graphs=True,
                 drafter=BusyOracle(cuda.backend, cuda.cfg.vocab_size, DEPTH, lambda rid, prompt: ref[rid],
                                    accept_p=0.8), **({"max_budget": 16, "cost": cost} if auto else {}))
    host_s, busy_at_plan = [], []

    def timed(fn):
        def call(*a, **k):
            if fn.__name__ == "plan_tree":
                busy_at_plan.append(not cupy.cuda.get_current_stream().done)
            t = time.perf_counter()
            out = fn(*a, **k)
            host_s.append(time.perf_counter() - t)
            return out
        return call

    eng.runner.plan_tree = timed(eng.runner.plan_tree)
    if auto:
        eng.round._auto_round.stage_cut = timed(eng.round._auto_round.stage_cut)
    captured = eng.runner.captures
    got = {r.rid: r.output for r in eng.run(copies(chosen))}
    assert_agree(got, {r.rid: ref[r.rid] for r in chosen}, clear, f"CUDA {mode} budget {budget}, plan after draft")
    assert eng.runner.captures == captured and eng.runner.replays > 0, "every verify replayed a graph"
    assert len(host_s) >= 4 and np.median(host_s) < busy_s / 4, (np.median(host_s), busy_s)
    if auto:
        assert eng.round.auto.stats.drafted_rounds > 0 and sum(busy_at_plan) >= len(busy_at_plan) / 2, busy_at_plan
    else:
        assert all(busy_at_plan) and eng.round.stats.tau > 1.5, busy_at_plan
