"""The DDTree / chain round in the engine on the numpy backend: lossless at T=0 against the
engine's own autoregressive decode, the verify forward against causal forwards, bad input."""

import numpy as np
import pytest

from ddtree_rtc.backend import Backend
from ddtree_rtc.engine.engine import Engine
from ddtree_rtc.engine.kv_cache import PagedKVCache
from ddtree_rtc.engine.request import Request, RequestError
from ddtree_rtc.model.config import preset_config
from ddtree_rtc.model.make_model import make_model
from ddtree_rtc.model.target import ForwardBatch, TargetModel
from ddtree_rtc.reference.mla_attention import tree_mask_from_parents
from ddtree_rtc.speculative.drafters import OracleDrafter, RandomDrafter, greedy_continuation

DEPTH = 7


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    make_model(preset_config("tiny"), d, seed=5)
    return TargetModel.load(d, Backend("numpy"))


@pytest.fixture(scope="module")
def cont(tiny):
    return greedy_continuation(tiny, 40, 16)


def prompts(seed, lengths):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 1000, n).tolist() for n in lengths]


def run(tiny, ps, new, drafter=None, mode="autoregressive", max_budget=16, max_batch=3, num_pages=None, **req):
    eng = Engine(tiny, max_batch=max_batch, page_size=16, max_context=128, num_pages=num_pages, mode=mode,
                 drafter=drafter, budget=max_budget)
    reqs = [Request(i, p, new[i] if isinstance(new, list) else new, **{k: v[i] for k, v in req.items()})
            for i, p in enumerate(ps)]
    out = eng.run(reqs)
    assert eng.pages.num_free_pages == eng.pages.num_pages and eng.pages.num_promised_pages == 0
    return eng, [r.output for r in out]


def oracle(tiny, cont, **kw):
    return OracleDrafter(tiny.backend, tiny.cfg.vocab_size, DEPTH, cont, **kw)


@pytest.mark.parametrize("mode,budget,profile", [
    ("ddtree", 16, {"accept_p": 0.8}), ("ddtree", 64, {"accept_p": 0.95}), ("ddtree", 2, {"accept_p": 0.5}),
    ("ddtree", 7, {"accept_p": None, "table": (1, 1, 0.9, 0.5, 0.2, 0.1, 0.0)}), ("ddtree", 1, {"accept_p": 1.0}),
    ("chain", 0, {"accept_p": 0.8})])
def test_lossless_at_t0_with_the_oracle(tiny, cont, mode, budget, profile):
    ps = prompts(budget + 11, (4, 9, 17, 6))
    new = [12, 5, 9, 14]  # max_new_tokens ending inside rounds
    _, want = run(tiny, ps, new)
    eng, got = run(tiny, ps, new, oracle(tiny, cont, **profile), mode, budget)
    assert got == want
    st = eng.round.stats
    assert st.tokens >= sum(len(o) for o in got) - len(ps)  # every decoded token came from a round
    assert 1 <= st.tau <= DEPTH + 1
    if profile.get("accept_p") == 1.0:
        assert st.tau > 1.5, "a certain drafter gets more than the bonus token accepted"


def test_lossless_with_the_random_drafter_and_mixed_budgets(tiny):
    ps = prompts(3, (5, 8, 11, 3, 7))
    _, want = run(tiny, ps, 8)
    eng, got = run(tiny, ps, 8, RandomDrafter(tiny.backend, tiny.cfg.vocab_size, DEPTH, seed=2), "ddtree", 16,
                   budget=[16, 0, 3, None, 7])
    assert got == want and eng.round.stats.tau < 1.5


def test_stop_ids_inside_an_accepted_path(tiny, cont):
    ps = prompts(4, (6, 10))
    _, free = run(tiny, ps, 16)
    stops = [(free[0][5],), (free[1][3],)]
    _, want = run(tiny, ps, 16, stop_ids=stops)
    _, got = run(tiny, ps, 16, oracle(tiny, cont, accept_p=1.0), "ddtree", 32, stop_ids=stops)
    assert got == want and all(len(o) < 16 for o in got)


def test_admission_mid_decode_and_a_small_cache(tiny, cont):
    """Six requests, two slots, pages for about two at a time: requests join while others decode."""
    ps = prompts(5, (4, 13, 7, 9, 5, 11))
    _, want = run(tiny, ps, 10, max_batch=2)
    eng, got = run(tiny, ps, 10, oracle(tiny, cont, accept_p=0.8), "ddtree", 16, max_batch=2, num_pages=5)
    assert got == want


def test_tree_verify_rows_equal_causal_forwards(tiny, rng):
    """A verify forward with a tree mask gives each node the logits of a causal forward along its
    root-to-node path, bit for bit (the numpy references are batch-invariant)."""
    be, prompt = tiny.backend, rng.integers(3, 1000, 9).tolist()
    parents = [-1, 0, 0, 1, 1, 2, 3, 5]
    tokens = rng.integers(3, 1000, len(parents)).tolist()
    depth = [0]
    for p in parents[1:]:
        depth.append(depth[p] + 1)
    cache = PagedKVCache(be, tiny.num_layers, 16, 16)
    cache.reserve("t", len(prompt) + len(parents))
    tiny.forward(ForwardBatch.causal(["t"], [0], [prompt]), cache, output="none")
    tree = ForwardBatch(["t"], [len(prompt)], [len(parents)], tokens, [len(prompt) + d for d in depth],
                        tree_mask_from_parents(np.array(parents)), None)
    got = be.to_host(tiny.forward(tree, cache, output="logits").logits)
    for i in range(len(parents)):
        path, u = [], i
        while u >= 0:
            path.append(tokens[u])
            u = parents[u]
        c2 = PagedKVCache(be, tiny.num_layers, 16, 16)
        c2.reserve(0, len(prompt) + len(path))
        want = be.to_host(tiny.forward(ForwardBatch.causal([0], [0], [prompt + path[::-1]]), c2,
                                       output="logits").logits)
        assert np.array_equal(got[i], want[0]), f"node {i}"


def test_bad_input_is_refused_before_any_work(tiny, cont):
    with pytest.raises(ValueError, match="budget=600"):
        Engine(tiny, 2, 16, 128, mode="ddtree", drafter=oracle(tiny, cont), budget=600)
    with pytest.raises(ValueError, match="needs a drafter"):
        Engine(tiny, 2, 16, 128, mode="ddtree")
    with pytest.raises(ValueError, match="vocabulary 77"):
        Engine(tiny, 2, 16, 128, mode="ddtree", drafter=RandomDrafter(tiny.backend, 77, DEPTH))
    deep = RandomDrafter(tiny.backend, tiny.cfg.vocab_size, 17)
    with pytest.raises(ValueError, match="depth=17"):
        Engine(tiny, 2, 16, 128, mode="chain", drafter=deep)
    eng = Engine(tiny, 2, 16, 64, mode="ddtree", drafter=oracle(tiny, cont), budget=16)
    with pytest.raises(RequestError, match="verify tail"):
        eng.submit(Request(0, list(range(3, 40)), 12))
    with pytest.raises(RequestError, match="budget 17 outside"):
        eng.submit(Request(1, [3, 4], 2, budget=17))
    with pytest.raises(RequestError, match="temperature > 0"):
        eng.submit(Request(2, [3, 4], 2, temperature=0.5))
