"""Row-invariant scheduling (engine/engine.py, docs/architecture.md "The small-M path"): with the
model's batch_invariant on, what a forward holds never depends on the load. Each prompt is
prefilled alone, in one forward of its own length, at any concurrency, and the KV rows it writes
are the same bits wherever its pages are; decode and verify forwards hold only decode / verify rows,
at most 64 of them. With batch_invariant off the old batching stays. The structure is read from
the forwards the engine really makes (``FormRecorder``); the GPU check of the ids is
tools/k2_6_lossless.py."""

import numpy as np
import pytest

from ddtree_rtc.engine.engine import Engine
from ddtree_rtc.engine.request import Request
from ddtree_rtc.model.target import SMALL_M_MAX_TOKENS, TargetModel
from ddtree_rtc.speculative.drafters import RandomDrafter
from ddtree_rtc.testing import random_prompts

LENGTHS = (5, 12, 3, 9, 17, 4, 8, 11, 6, 7)  # ten prompts (none of one token: a prefill is then not a decode)


class FormRecorder(TargetModel):
    """``model`` (same weights and backend) recording every forward it runs: ``forms``, one
    (kind, ((seq_id, ctx_len, num_new), ...)) per forward, kind 'prefill' (every request at
    context 0), 'decode' (one new token each, after a context) or 'verify' (a tree mask); and
    ``kv[seq_id]``, the host KV rows [layers, prompt, row] its prefill wrote."""

    def __init__(self, model: TargetModel, batch_invariant: bool = True):
        self.__dict__.update(model.__dict__)
        self.batch_invariant = batch_invariant
        self.forms, self.kv = [], {}

    def run(self, inputs, cache, output="argmax", hidden_layers=(), moe_plan=None, mark=None):
        out = super().run(inputs, cache, output, hidden_layers, moe_plan, mark)
        b = inputs.batch
        reqs = tuple((s, int(c), int(n)) for s, c, n in zip(b.seq_ids, b.ctx_lens, b.num_new))
        if b.tree_mask is not None:
            kind = "verify"
        elif (b.ctx_lens == 0).all():
            kind = "prefill"
            slots = self.backend.to_host(inputs.slots).astype(np.int64)
            flat = cache.data.reshape(self.num_layers, -1, cache.row)
            rows = self.backend.to_host(flat[:, self.backend.asarray(slots)], bf16=False)
            start = 0
            for s, _, n in reqs:
                self.kv[s] = rows[:, start:start + n]
                start += n
        else:
            assert (b.num_new == 1).all(), f"a causal forward mixing prefill and decode rows: {reqs}"
            kind = "decode"
        self.forms.append((kind, reqs))
        return out


def run(model, prompts, new, max_batch, page_size=16, max_context=128, **kw):
    eng = Engine(model, max_batch=max_batch, page_size=page_size, max_context=max_context, **kw)
    out = eng.run([Request(i, p, new) for i, p in enumerate(prompts)])
    return eng, [r.output for r in out]


def of_kind(rec, kind):
    return [reqs for k, reqs in rec.forms if k == kind]


def test_each_prompt_is_prefilled_alone_at_any_concurrency(tiny):
    prompts = random_prompts(4, LENGTHS)
    runs = {}
    for c in (1, 10):
        rec = FormRecorder(tiny)
        eng, out = run(rec, prompts, 3, c)
        assert eng.invariant
        runs[c] = rec, out
        prefills = of_kind(rec, "prefill")
        assert prefills == [((i, 0, n),) for i, n in enumerate(LENGTHS)], "one whole prompt per forward"
        decodes = of_kind(rec, "decode")
        assert decodes and all(len(d) <= min(c, SMALL_M_MAX_TOKENS) for d in decodes)
        assert max(len(d) for d in decodes) == c, "the running requests still decode together"
    (r1, out1), (r10, out10) = runs[1], runs[10]
    # the prefill forward is the same at both concurrencies, so the bits it makes are too: the KV rows
    # (in other pages) and the first token
    for i in range(len(LENGTHS)):
        assert np.array_equal(r1.kv[i].view(np.uint16), r10.kv[i].view(np.uint16)), f"request {i}'s KV rows"
    assert [o[0] for o in out1] == [o[0] for o in out10]


def test_batch_invariant_off_keeps_the_batched_prefill(tiny):
    prompts = random_prompts(4, LENGTHS)
    rec = FormRecorder(tiny, batch_invariant=False)
    eng, _ = run(rec, prompts, 3, 10, max_prefill_tokens=40)
    assert not eng.invariant
    sizes = [sum(n for _, _, n in f) for f in of_kind(rec, "prefill")]
    assert [len(f) for f in of_kind(rec, "prefill")] == [4, 4, 2] and max(sizes) <= 40
    assert max(len(d) for d in of_kind(rec, "decode")) == 10


@pytest.mark.parametrize("mode,budget,n,groups", [("chain", 0, 10, [8, 2]), ("ddtree", 32, 3, [1, 1, 1]),
                                                  ("ddtree", 8, 10, [7, 3])])
def test_rounds_verify_at_most_64_rows(tiny, mode, budget, n, groups):
    """A round per group of requests whose verify rows (1 + budget each) fit 64; off, one round."""
    prompts = random_prompts(5, LENGTHS[:n])
    width = 1 + (7 if mode == "chain" else budget)
    for invariant in (True, False):
        rec = FormRecorder(tiny, batch_invariant=invariant)
        drafter = RandomDrafter(tiny.backend, tiny.cfg.vocab_size, 7, seed=3)
        run(rec, prompts, 4, n, mode=mode, drafter=drafter, budget=budget)
        assert of_kind(rec, "prefill") == ([((i, 0, m),) for i, m in enumerate(LENGTHS[:n])] if invariant
                                           else [tuple((i, 0, m) for i, m in enumerate(LENGTHS[:n]))])
        verifies = of_kind(rec, "verify")
        assert all(m == width for f in verifies for _, _, m in f)
        if invariant:  # the first step: every request runs a round, in groups
            assert [len(f) for f in verifies[:len(groups)]] == groups
            assert all(len(f) * width <= SMALL_M_MAX_TOKENS or len(f) == 1 for f in verifies)
        else:
            assert len(verifies[0]) == n
        assert not of_kind(rec, "decode")


def test_a_budget_over_the_invariant_rows_is_named(tiny):
    """A fixed budget whose one verify is over 64 rows cannot stay on the row-invariant path: the
    engine says so when it is made (and not when batch_invariant is off)."""
    import warnings

    drafter = RandomDrafter(tiny.backend, tiny.cfg.vocab_size, 7, seed=3)
    with pytest.warns(UserWarning, match="decode.budget 64: one request's verify \\(65 rows\\)"):
        Engine(FormRecorder(tiny), max_batch=2, page_size=16, max_context=256, mode="ddtree", drafter=drafter,
               budget=64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Engine(FormRecorder(tiny), max_batch=2, page_size=16, max_context=256, mode="ddtree", drafter=drafter,
               budget=63)
        Engine(FormRecorder(tiny, batch_invariant=False), max_batch=2, page_size=16, max_context=256,
               mode="ddtree", drafter=drafter, budget=64)


def steps_of(eng, rec, reqs):
    """Run ``reqs`` step by step: per step the requests that decode in it (running before it) and
    the verify forms it made."""
    for r in reqs:
        eng.submit(r)
    out = []
    while eng.has_work():
        live = sorted(r.rid for r in eng.running_requests() if r.finish is None)
        n = len(rec.forms)
        eng.step()
        out.append((live, [f for k, f in rec.forms[n:] if k == "verify"]))
    return [r.output for r in sorted(eng.scheduler.finished, key=lambda r: r.rid)], out


SAMPLED = dict(temperature=[0.0, 0.8, 1.0, 1.3, 0.0, 0.7, 1.0, 0.9, 1.2, 0.6],
               top_p=[1.0, 0.9, 1.0, 0.8, 1.0, 1.0, 0.95, 0.9, 1.0, 0.85], seed=[None, 3, 4, 5, None, 6, 7, 8, 9, 10])


@pytest.mark.parametrize("sampled", [False, True])
def test_auto_shares_one_round_of_64_rows_at_concurrency_10(tiny, cont, sampled):
    """decode.budget auto at concurrency 10 (max_budget 16: 17 rows a request at most): one round per
    step over every running request, its policy sharing at most 64 verify rows (nodes free in the
    cost table, so it fills them), the ids the engine's AR ids (T = 0, and T > 0 beside T = 0).
    With batch_invariant off, the old uncapped round (every request at max_budget: 170 rows)."""
    from ddtree_rtc.engine.decode.budget import CostModel
    from ddtree_rtc.speculative.drafters import OracleDrafter

    prompts = random_prompts(8, LENGTHS)
    new = [9, 12, 6, 10, 11, 7, 12, 8, 10, 9]
    kw = SAMPLED if sampled else {}

    def reqs():
        return [Request(i, p, new[i], **{k: v[i] for k, v in kw.items()}) for i, p in enumerate(prompts)]

    want = [r.output for r in Engine(tiny, max_batch=10, page_size=16, max_context=128).run(reqs())]
    for invariant in (True, False):
        rec = FormRecorder(tiny, batch_invariant=invariant)
        eng = Engine(rec, max_batch=10, page_size=16, max_context=128, mode="ddtree",
                     drafter=OracleDrafter(tiny.backend, tiny.cfg.vocab_size, 7, cont, accept_p=0.9),
                     budget="auto", max_budget=16, cost=CostModel(verify=((1, 1e-3), (10**6, 1e-3))))
        assert eng.invariant == invariant and eng.round.auto.max_rows == (SMALL_M_MAX_TOKENS if invariant else None)
        got, steps = steps_of(eng, rec, reqs())
        assert got == want, f"invariant={invariant}: ids differ from AR"
        for live, verifies in steps:  # one round per step, over every running request
            assert [[s for s, _, _ in f] for f in verifies] == ([live] if live else [])
        verifies = [f for _, v in steps for f in v]
        assert verifies and all(m <= 17 for f in verifies for _, _, m in f)
        rows = [sum(m for _, _, m in f) for f in verifies]
        st = eng.round.auto.stats
        if invariant:
            assert max(rows) == SMALL_M_MAX_TOKENS and all(t <= SMALL_M_MAX_TOKENS for t in rows)
            assert set(st.rows_hist) <= set(range(1, SMALL_M_MAX_TOKENS + 1))
        else:
            assert max(rows) == 10 * 17
        assert sum(st.counts_hist.values()) == eng.stats.decode_rounds


# prompts on both sides of 64 rows (a prefill alone of at most 64 takes the small-M path), 1122 in all
GPU_LENGTHS = (5, 40, 64, 65, 100, 150, 33, 200, 12, 90)


@pytest.mark.gpu
def test_gpu_ids_and_prefill_rows_do_not_depend_on_concurrency():
    """On the GPU, through CUDA graphs, on one TP8 rank of the K2.6 slice with the random head (greedy
    choices near bf16 ties): AR at concurrency 10 and chain at 10 (verify groups of 8 + 2 requests, 64
    rows) give AR at concurrency 1's ids, and every prompt's prefill writes the same KV bits. Before
    row-invariant scheduling the ten prompts were prefilled in one forward of 1122 rows."""
    from ddtree_rtc.bench.decode import random_slice

    model = random_slice(1, seed=3, shard="tp8")
    prompts = random_prompts(6, GPU_LENGTHS)
    runs = {}
    for name, c, mode in (("ar1", 1, "autoregressive"), ("ar10", 10, "autoregressive"), ("chain10", 10, "chain")):
        rec = FormRecorder(model)
        drafter = None if mode == "autoregressive" else RandomDrafter(model.backend, model.cfg.vocab_size, 7, seed=3)
        eng, out = run(rec, prompts, 24, c, page_size=64, max_context=512, cuda_graphs=True, mode=mode,
                       drafter=drafter)
        assert eng.invariant and eng.graphs is not None and eng.runner.replays > 0
        assert of_kind(rec, "prefill") == [((i, 0, n),) for i, n in enumerate(GPU_LENGTHS)]
        runs[name] = rec, out
    rec1, want = runs["ar1"]
    for name in ("ar10", "chain10"):
        rec, got = runs[name]
        bad = [i for i in range(len(prompts)) if got[i] != want[i]]
        assert not bad, f"{name}: requests {bad} differ from ar1, first at tokens " + str(
            [next((j for j, (a, b) in enumerate(zip(got[i], want[i])) if a != b), "end") for i in bad])
        for i in range(len(prompts)):
            assert np.array_equal(rec.kv[i].view(np.uint16), rec1.kv[i].view(np.uint16)), f"{name}: prompt {i}'s KV"
