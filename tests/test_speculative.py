"""The DDTree / chain round in the engine on the numpy backend: lossless at T=0 and T>0 against the
engine's own autoregressive decode, the verify forward against causal forwards, bad input, the
oracle drafter's tau. The round on the CUDA backend: tests/test_round_gpu.py."""

import numpy as np
import pytest

from ddtree_rtc.backend import Backend
from ddtree_rtc.engine.engine import Engine
from ddtree_rtc.engine.kv_cache import PagedKVCache
from ddtree_rtc.engine.request import Request, RequestError
from ddtree_rtc.model.make_model import make_model
from ddtree_rtc.model.target import ForwardBatch, TargetModel
from ddtree_rtc.reference.mla_attention import tree_mask_from_parents
from ddtree_rtc.speculative.drafters import OracleDrafter, RandomDrafter
from ddtree_rtc.testing import random_prompts as prompts

DEPTH = 7


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
    if (profile.get("accept_p") or 0) >= 0.8:  # some request stopped inside a round's accepted tokens
        assert any(sum(e for r, e in st.trace if r == i) > len(o) - 1 for i, o in enumerate(got))


def test_lossless_with_the_random_drafter_and_mixed_budgets(tiny):
    ps = prompts(3, (5, 8, 11, 3, 7))
    _, want = run(tiny, ps, 8)
    eng, got = run(tiny, ps, 8, RandomDrafter(tiny.backend, tiny.cfg.vocab_size, DEPTH, seed=2), "ddtree", 16,
                   budget=[16, 0, 3, None, 7])
    assert got == want and eng.round.stats.tau < 1.5


@pytest.mark.parametrize("mode,budget,budgets", [("ddtree", 16, None), ("ddtree", 16, [16, 3, 0, 9]),
                                                 ("chain", 0, None)])
def test_the_round_enqueues_its_draft_and_build_before_the_plan(tiny, cont, mode, budget, budgets):
    """Every round's stages in order on the engine's clock: the device's work that needs no plan
    (draft, top-k, build) first, then the verify's host plan (which overlaps it on the GPU), then the
    verify and the rest; the plan is made once per round, after the drafter ran. Per-request budgets
    (a row bucket) and chain mode alike; the ids stay autoregressive decoding's."""
    ps = prompts(budget + 5, (4, 9, 17, 6))
    _, want = run(tiny, ps, 10)
    eng = Engine(tiny, max_batch=4, page_size=16, max_context=128, mode=mode, drafter=oracle(tiny, cont,
                 accept_p=0.8), budget=budget)
    order, timed, drafted = [], eng.clock.time, eng.round.drafter.draft
    eng.clock.time = lambda stage, fn, *a, **k: order.append(stage) or timed(stage, fn, *a, **k)
    eng.round.drafter.draft = lambda *a: order.append("drafter") or drafted(*a)
    eng.round.run, go = (lambda reqs, eos: order.append("round") or go(reqs, eos)), eng.round.run
    extra = {} if budgets is None else {"budget": budgets}
    got = [r.output for r in eng.run([Request(i, p, 10, **{k: v[i] for k, v in extra.items()})
                                      for i, p in enumerate(ps)])]
    assert got == want
    rounds = [r.split() for r in " ".join(order).split("round")[1:]]
    assert len(rounds) >= 3
    for stages in rounds:
        assert stages[:9] == ["draft", "drafter", "top-k", "build", "plan", "verify", "choose", "accept",
                              "commit"], stages


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


# ---- T > 0 ---------------------------------------------------------------------------------------
# Every draw is keyed by (engine seed, request stream, position) and a tree node uses the key of the
# autoregressive step it stands for, so with batch-invariant logits a speculative run samples exactly
# the autoregressive run's tokens: lossless by construction, checked token for token.

@pytest.mark.parametrize("mode,budget,kind", [("ddtree", 16, "oracle"), ("ddtree", 7, "random"),
                                              ("chain", 0, "oracle")])
def test_lossless_at_t_positive_equals_autoregressive(tiny, cont, mode, budget, kind):
    ps = prompts(21 + budget, (5, 9, 4, 12))
    kw = dict(temperature=[0.0, 0.7, 1.0, 1.4], top_p=[1.0, 0.9, 1.0, 0.8], seed=[None, 3, None, 11])
    _, want = run(tiny, ps, [11, 6, 13, 9], **kw)
    drafter = (oracle(tiny, cont, accept_p=0.9) if kind == "oracle"
               else RandomDrafter(tiny.backend, tiny.cfg.vocab_size, DEPTH, seed=4))
    eng, got = run(tiny, ps, [11, 6, 13, 9], drafter, mode, budget, **kw)
    assert got == want
    _, greedy = run(tiny, ps, [11, 6, 13, 9])
    assert got[0] == greedy[0] and got[1:] != greedy[1:], "T > 0 rows sample, the T = 0 row is greedy"


def test_samples_do_not_depend_on_the_batch(tiny, cont):
    """A request's T > 0 output is the same alone, beside others, in another slot, in any mode."""
    ps = prompts(8, (6, 10, 7))
    kw = dict(temperature=[1.0] * 3, top_p=[0.95] * 3, seed=[5, 6, 7])
    _, together = run(tiny, ps, 10, oracle(tiny, cont), "ddtree", 16, **kw)
    _, alone = run(tiny, ps[2:], 10, oracle(tiny, cont), "ddtree", 16, temperature=[1.0], top_p=[0.95], seed=[7])
    _, reordered = run(tiny, ps[::-1], 10, **{k: v[::-1] for k, v in kw.items()})
    assert together[2] == alone[0] == reordered[0]
    _, other_seed = run(tiny, ps[2:], 10, temperature=[1.0], top_p=[0.95], seed=[8])
    assert other_seed[0] != alone[0]


def _wilson_hilferty(df: int, z: float = 3.719) -> float:
    """The chi-square quantile at the normal quantile z (3.719: p = 1e-4), Wilson-Hilferty."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def _chi_square(counts: dict, probs: dict, n: int) -> tuple[float, int]:
    """Pearson's statistic over cells with expected count >= 5 (the rest pooled) and its df."""
    big = {c for c, p in probs.items() if p * n >= 5}
    obs = [counts.get(c, 0) for c in big] + [n - sum(counts.get(c, 0) for c in big)]
    exp = [probs[c] * n for c in big] + [n * (1 - sum(probs[c] for c in big))]
    if exp[-1] < 5:  # nothing worth a pooled cell
        obs[-2] += obs.pop()
        exp[-2] += exp.pop()
    return sum((o - e) ** 2 / e for o, e in zip(obs, exp)), len(exp) - 1


def test_t_positive_samples_follow_the_target_distribution(tmp_path):
    """On a 12-token model, the first two emitted tokens of 3000 seeded DDTree requests (random
    drafter: trees that contain the sample and trees that do not) follow the target's own
    distribution softmax(l / T) at each position; the same test fails on a planted 10% bias."""
    from ddtree_rtc.model.config import PRESETS, config_from_dict

    cfg = config_from_dict({**PRESETS["tiny"], "vocab_size": 12, "eos_token_id": None, "bos_token_id": None,
                            "pad_token_id": None}, "<tiny, 12 tokens>")
    make_model(cfg, tmp_path, seed=9)
    model = TargetModel.load(tmp_path, Backend("numpy"))
    be, temp, n, prompt = model.backend, 1.3, 3000, [3, 7, 1, 4]

    def target_probs(ctx):
        cache = PagedKVCache(be, model.num_layers, 4, 16)
        cache.allocator.reserve(0, len(ctx))
        lg = be.to_host(model.forward(ForwardBatch.causal([0], [0], [ctx]), cache, output="logits").logits)
        z = lg[0].astype(np.float32) * np.float32(1 / temp)
        e = np.exp(z.astype(np.float64) - z.max())
        return e / e.sum()

    p1 = target_probs(prompt)
    joint = {(a, b): p1[a] * q for a in range(12) for b, q in enumerate(target_probs(prompt + [a]))}
    eng = Engine(model, max_batch=64, page_size=16, max_context=32, seed=1, mode="ddtree", budget=8,
                 drafter=RandomDrafter(be, 12, DEPTH, seed=3))
    out = eng.run([Request(i, prompt, 2, temperature=temp, seed=i) for i in range(n)])
    pairs = [tuple(r.output) for r in out]
    assert 1.2 < eng.round.stats.tau < 3, "some samples are found in the tree, some are not"

    p2 = {b: sum(joint[(a, b)] for a in range(12)) for b in range(12)}

    def stat(pairs):  # first-token marginal, second-token marginal, joint
        c1, c2, c12 = {}, {}, {}
        for a, b in pairs:
            c1[a] = c1.get(a, 0) + 1
            c2[b] = c2.get(b, 0) + 1
            c12[(a, b)] = c12.get((a, b), 0) + 1
        return [_chi_square(c1, dict(enumerate(p1)), n), _chi_square(c2, p2, n), _chi_square(c12, joint, n)]

    for x, df in stat(pairs):
        assert x < _wilson_hilferty(df), f"chi-square {x:.1f} over {df} df"
    # the planted bias: 10% of second tokens replaced by the target's most likely one
    mode2 = {a: max(range(12), key=lambda b: joint[(a, b)]) for a in range(12)}
    biased = [(a, mode2[a]) if i % 10 == 0 else (a, b) for i, (a, b) in enumerate(pairs)]
    x, df = stat(biased)[1]
    assert x > _wilson_hilferty(df), f"a 10% bias goes unnoticed: chi-square {x:.1f} over {df} df"


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
    cache.allocator.reserve("t", len(prompt) + len(parents))
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
        c2.allocator.reserve(0, len(prompt) + len(path))
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


@pytest.mark.parametrize("p,budget,chain", [(0.7, 16, False), (0.9, 5, False), (0.5, 64, False), (0.8, 0, True)])
def test_oracle_expected_tau_matches_simulated_rounds(p, budget, chain):
    """OracleDrafter.expected_tau against 2000 simulated rounds through the drafter's own logits,
    the reference top-k, tree build and acceptance walk (the target's choice at every node: the
    continuation's next token): within 4 standard errors."""
    from ddtree_rtc.reference.topk import topk_logprobs
    from ddtree_rtc.reference.tree_accept import tree_accept
    from ddtree_rtc.reference.tree_build import tree_build

    vocab, rounds, be = 1024, 2000, Backend("numpy")
    cont = np.random.default_rng(1).integers(0, vocab, (DEPTH + 1) * rounds + 1).tolist()
    drafter = OracleDrafter(be, vocab, DEPTH, lambda rid, prompt: cont, accept_p=p, seed=4)
    drafter.admit(0, [], {})  # the continuation starts at position 0
    n = DEPTH if chain else budget
    k = 1 if chain else min(budget, vocab)
    one = np.ones(1, np.int32)
    lens = []
    for i in range(rounds):
        pos = (DEPTH + 1) * i  # rounds on disjoint positions: independent ranks
        logits = drafter.draft([0], np.array([cont[pos]], np.int32), np.array([pos]))
        logq, ids = topk_logprobs(logits, k)
        tree = tree_build(logq, ids, cont[pos] * one, n * one, DEPTH * one, pos * one, n)
        choices = np.array([[cont[pos + int(d) + 1] if d >= 0 else 0 for d in tree.node_depth[0]]], np.int32)
        lens.append(int(tree_accept(tree, choices).accept_len[0]))
    lens = np.array(lens, np.float64)
    want = drafter.expected_tau(budget, chain=chain)
    assert abs(lens.mean() - want) < 4 * lens.std() / np.sqrt(rounds) + 1e-9, (lens.mean(), want)
    assert 1 < want < DEPTH + 1
