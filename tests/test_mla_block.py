"""The fused MLA attention block (cuda_src/mla_block.cu: the small-M path's attention block in one
launch). CPU: its numpy twin is the composition of the separate small-M references (bitwise, on the
tiny and the TP8 shard dims), the model's forward is the same with and without it, bad shapes are
named, and the kernel launches per decoder layer are counted from the ops each stage runs. GPU: the
kernel against its twin (poisoned cache, NaN-prefilled outputs and scratch, odd M, TP8 dims), against
the separate small-M kernels bit for bit, and the whole decode's rows invariant over M."""

import os

import numpy as np
import pytest
from ml_dtypes import bfloat16

from ddtree_rtc.backend import Backend
from ddtree_rtc.engine.kv_cache import PagedKVCache
from ddtree_rtc.model.mla import MLADims, MLAWeights, mla_forward
from ddtree_rtc.model.target import ForwardBatch, TargetModel
from ddtree_rtc.reference.mla_block import mla_block_small
from ddtree_rtc.reference.rmsnorm import NormPrologue
from ddtree_rtc.reference.rope import rope_inv_freq
from ddtree_rtc.testing import OpRecorder, assert_close, random_bf16, stage_launches

# (heads, q_nope, v_head, q_lora, hidden): one TP8 / EP8 rank of K2.6 (attention heads are split the
# same way under both), and the tiny preset
DIMS = {"tp8": (8, 128, 128, 1536, 7168), "tiny": (4, 32, 32, 96, 256)}
PAGE = 64
EPS, SCALE = 1e-6, 192 ** -0.5


def _seeded(name):
    seed = int(os.environ.get("DDTREE_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
    print(f"{name} seed={seed}")
    return np.random.default_rng(seed)


class Case:
    """Random weights of one attention block, and a paged cache holding ``ctx[r]`` committed rows per
    request, each request feeding ``new[r]`` tokens (causal). Cache rows no request may read (past
    each request's new rows, and a spare page no table points to) are NaN."""

    def __init__(self, rng, dims, ctx, new):
        h, nope, v, q_lora, hid = dims
        self.dims = MLADims(h, nope, 64, v, 512)
        sd = lambda k: k ** -0.5  # noqa: E731 - 1/sqrt(fan-in): activations O(1)
        self.w = MLAWeights(q_b=random_bf16(rng, (h * (nope + 64), q_lora), sd(q_lora)),
                            kv_a=random_bf16(rng, (576, hid), sd(hid)), kv_a_norm=random_bf16(rng, (512,), 1.0),
                            kv_b=random_bf16(rng, (h * (nope + v), 512), sd(512)),
                            o=random_bf16(rng, (hid, h * v), sd(h * v)), q_a=random_bf16(rng, (q_lora, hid), sd(hid)),
                            q_a_norm=random_bf16(rng, (q_lora,), 1.0))
        self.ctx, self.new = np.asarray(ctx, np.int64), np.asarray(new, np.int64)
        m = int(self.new.sum())
        self.x = random_bf16(rng, (m, hid))
        pages = [-(-int(c + n) // PAGE) for c, n in zip(self.ctx, self.new)]
        self.num_pages = sum(pages) + 1  # + a spare page no request points to
        perm = rng.permutation(self.num_pages)
        width = max(pages)
        self.page_table = np.zeros((len(pages), width), np.int32)
        start = 0
        for r, n in enumerate(pages):
            self.page_table[r, :n] = perm[start:start + n]
            start += n
        self.cache = random_bf16(rng, (self.num_pages, PAGE, 576))
        flat = self.cache.reshape(-1, 576)
        flat[perm[start:start + 1] * PAGE + np.arange(PAGE)] = np.nan  # the spare page
        pos, slots = [], []
        for r, (c, n) in enumerate(zip(self.ctx, self.new)):
            tail = np.arange(int(c), pages[r] * PAGE)  # the new rows (written by the block) and past them
            flat[self.page_table[r, tail // PAGE] * PAGE + tail % PAGE] = np.nan
            pos += list(range(int(c), int(c + n)))
            slots += [int(self.page_table[r, p // PAGE]) * PAGE + p % PAGE for p in range(int(c), int(c + n))]
        self.positions, self.slots = np.asarray(pos, np.int32), np.asarray(slots, np.int32)
        self.inv_freq = np.asarray(rope_inv_freq(64, 50000.0, None), dtype=np.float32)

    def args(self, be, cache, att_plan):
        """mla_block_small's positional arguments on backend ``be`` (weights moved there)."""
        w = self.w
        d = be.asarray
        return (d(self.x), d(w.q_a), d(w.kv_a), d(w.q_a_norm), d(w.kv_a_norm), EPS, d(w.q_b), d(w.kv_b), d(w.o),
                d(self.positions), d(self.inv_freq), 1.0, cache, d(self.slots), att_plan, SCALE)

    def att_plan(self, be):
        return be.mla_attention_plan(self.ctx, self.new, self.page_table, self.dims.num_heads, PAGE, self.num_pages,
                                     split="shape")


@pytest.mark.parametrize("dims", sorted(DIMS))
@pytest.mark.parametrize("f32", [False, True])
def test_twin_is_the_separate_small_path(dims, f32):
    """The numpy twin equals the model's separate small-M steps (mla_forward, impl="invariant") bit
    for bit: output (bf16, or the fp32 partial) and the cache rows written."""
    rng = _seeded(f"twin {dims}")
    be = Backend("numpy")
    case = Case(rng, DIMS[dims], [5, 70], [2, 1])
    m, hid = case.x.shape
    plan = case.att_plan(be)
    c1, c2 = case.cache.copy(), case.cache.copy()
    out1 = np.full((m, hid), np.nan, np.float32) if f32 else None
    out2 = np.full((m, hid), np.nan, np.float32) if f32 else None
    got = mla_block_small(*case.args(be, c1, plan), out=out1)
    want = mla_forward(be, case.x, case.w, case.dims, case.positions, case.inv_freq, EPS, c2, case.slots, plan, SCALE,
                       1.0, out=out2, impl="invariant")
    assert got.dtype == want.dtype == (np.float32 if f32 else bfloat16)
    assert np.array_equal(np.asarray(got).view(np.uint32 if f32 else np.uint16),
                          np.asarray(want).view(np.uint32 if f32 else np.uint16))
    assert np.array_equal(c1.view(np.uint16), c2.view(np.uint16))
    assert np.isfinite(np.asarray(got, np.float32)).all()


def _prologue(rng, be, m, hid, plus: bool, eps=1e-5):
    """A tensor-parallel rank's pending norm on backend ``be``: an all-reduced fp32 sum (and a shared
    part), a bf16 residual and norm weight."""
    d = be.asarray
    s = rng.standard_normal((m, hid)).astype(np.float32)
    p = rng.standard_normal((m, hid)).astype(np.float32) if plus else None
    return NormPrologue(d(s), None if p is None else d(p), d(random_bf16(rng, (m, hid))),
                        d(random_bf16(rng, (hid,), 1.0)), eps)


def _separate_prologue(be, p):
    """The prologue as the unfused tensor-parallel path runs it: to_bf16, then rmsnorm with the residual."""
    return be.rmsnorm(be.to_bf16(p.sum, plus_rounded=p.plus), p.weight, p.eps, residual=p.residual)


@pytest.mark.parametrize("dims", sorted(DIMS))
@pytest.mark.parametrize("plus", [False, True])
def test_prologue_twin_is_to_bf16_rmsnorm_then_the_block(dims, plus):
    """With a prologue (a tensor-parallel rank) the twin equals the unfused path's to_bf16 + rmsnorm and
    then the separate small-M steps into an fp32 partial, bit for bit: the block's output, its input x,
    the new residual and the cache rows."""
    rng = _seeded(f"prologue twin {dims}")
    be = Backend("numpy")
    case = Case(rng, DIMS[dims], [5, 70], [2, 1])
    m, hid = case.x.shape
    pro = _prologue(rng, be, m, hid, plus)
    plan = case.att_plan(be)
    c1, c2 = case.cache.copy(), case.cache.copy()
    got, x, h = mla_block_small(None, *case.args(be, c1, plan)[1:], out=np.full((m, hid), np.nan, np.float32),
                                prologue=pro)
    x_sep, h_sep = _separate_prologue(be, pro)
    want = mla_forward(be, x_sep, case.w, case.dims, case.positions, case.inv_freq, EPS, c2, case.slots, plan, SCALE,
                       1.0, out=np.full((m, hid), np.nan, np.float32), impl="invariant")
    for name, a, b in (("out", got, want), ("x", x, x_sep), ("residual", h, h_sep)):
        bits = np.uint32 if a.dtype == np.float32 else np.uint16
        assert np.array_equal(np.asarray(a).view(bits), np.asarray(b).view(bits)), name
    assert np.array_equal(c1.view(np.uint16), c2.view(np.uint16))
    assert np.isfinite(got).all()
    with pytest.raises(ValueError, match="prologue"):
        mla_block_small(*case.args(be, case.cache.copy(), plan), prologue=pro)


def test_bad_shapes_are_named():
    rng = _seeded("bad shapes")
    be = Backend("numpy")
    case = Case(rng, DIMS["tiny"], [3], [1])
    args = list(case.args(be, case.cache.copy(), case.att_plan(be)))
    for i, shape, name in ((7, (4 * 64, 511), "kv_b"), (6, (4 * 96 + 2, 96), "w_qb"), (8, (256, 100), "w_o")):
        bad = list(args)
        bad[i] = np.zeros(shape, bfloat16)
        with pytest.raises(ValueError, match=name):
            mla_block_small(*bad)


@pytest.fixture(scope="module")
def tiny_models(tiny_dir):
    """The tiny model on a recording numpy backend, with the fused block and without."""
    return {fused: TargetModel.load(tiny_dir, OpRecorder(), fused_blocks=fused) for fused in (False, True)}


def _cache(model, tokens):
    cache = PagedKVCache(model.backend, model.num_layers, 8, 16)
    cache.allocator.reserve("a", len(tokens))
    return cache


def test_model_forward_is_the_same_with_the_fused_blocks(tiny_models, rng):
    """runtime.fused_blocks: each attention block and MoE layer of a small forward is one op (one
    launch on the GPU), and the logits are the same bits."""
    tokens = rng.integers(0, 1024, 9).tolist()
    outs = {}
    for fused, model in tiny_models.items():
        assert model.fused_block(9) == fused and not model.fused_block(65)
        assert model.fused_moe(9) == fused and not model.fused_moe(65)
        model.backend.ops.clear()
        out = model.forward(ForwardBatch.causal(["a"], [0], [tokens], last_only=False), _cache(model, tokens),
                            output="logits")
        outs[fused] = np.asarray(out.logits).view(np.uint16)
        ops = model.backend.ops
        assert ops.count("mla_block_small") == (model.num_layers if fused else 0)
        assert ops.count("mla_qkv_a_small") == (0 if fused else model.num_layers)
        moe_layers = sum(1 for ly in model.layers if hasattr(ly.mlp, "experts"))
        assert ops.count("moe_block_small") == (moe_layers if fused else 0)
        assert ops.count("moe_small_experts") == (0 if fused else moe_layers)
    assert np.array_equal(outs[False], outs[True])
    off = tiny_models[True]
    off.small_m_path = False
    try:
        assert not off.fused_block(9) and not off.fused_moe(9)
    finally:
        off.small_m_path = True


# launches per stage on the small-M path at one rank (tiny preset: MoE layers with a shared expert)
ATTENTION_SEPARATE = 10  # q_a+kv_a, q_a norm, q_b, query, cache rows, attention + merge, W_UV, o_proj, norm
ATTENTION_FUSED = 1  # the fused block, ending with the residual norm (one rank)
MOE_SEPARATE = 6  # router + shared gate_up, routing, shared down, experts (2), the residual norm
MOE_FUSED = 1  # the fused layer, ending with the residual norm (one rank)


def test_launches_per_decoder_layer(tiny_models, rng):
    """Kernel launches per stage of a 7-row forward, counted from the ops it runs (testing.stage_launches):
    with runtime.fused_blocks a MoE decoder layer at one rank is 2 launches (the attention block and the
    MoE layer, each ending with the residual norm that follows it); 16 on the separate small-M kernels.
    (On a tensor-parallel rank each sublayer adds its all-reduce, the rounding and the norm.)"""
    tokens = rng.integers(0, 1024, 7).tolist()
    for fused, model in tiny_models.items():
        stages = stage_launches(model, ForwardBatch.causal(["a"], [0], [tokens], last_only=False),
                                _cache(model, tokens))
        moe = {i for i, ly in enumerate(model.layers) if hasattr(ly.mlp, "experts")}
        assert moe, "the tiny preset has MoE layers"
        for stage, layer, n in stages:
            if stage == "attention":
                assert n == (ATTENTION_FUSED if fused else ATTENTION_SEPARATE), (fused, layer)
            elif stage == "mlp" and layer in moe:
                assert n == (MOE_FUSED if fused else MOE_SEPARATE), (fused, layer)
        per_layer = {i: sum(n for s, ly, n in stages if ly == i) for i in moe}
        assert set(per_layer.values()) == {ATTENTION_FUSED + MOE_FUSED if fused else ATTENTION_SEPARATE + MOE_SEPARATE}


# launches per stage on a tensor-parallel rank (2 ranks of the tiny preset, simulated): each sublayer's
# all-reduce is one launch; the unfused path then rounds (to_bf16) and norms (rmsnorm) it
TP_ATTENTION_SEPARATE = ATTENTION_SEPARATE - 1 + 3  # the block's kernels, all-reduce, to_bf16, rmsnorm
TP_MOE_SEPARATE = MOE_SEPARATE - 1 + 3
TP_FUSED = 2  # the fused kernel (opening with the previous sublayer's to_bf16 + rmsnorm) and its all-reduce


@pytest.fixture(scope="module")
def tp_models(tiny_dir):
    """Rank 0 of 2 of the tiny preset (attention heads split, experts split by count: the tiny experts'
    intermediate split in two is below the small-M kernels' 128; a SimulatedRank, whose collectives
    leave this rank's partials as they are) on a recording numpy backend, with the fused kernels and
    without."""
    from ddtree_rtc.model.shard import Shard
    from ddtree_rtc.parallel.simulated import SimulatedRank

    return {fused: TargetModel.load(tiny_dir, OpRecorder(), shard=Shard(0, 2, True), comm=SimulatedRank(0, 2),
                                    fused_blocks=fused) for fused in (False, True)}


def test_tp_rank_launches_per_decoder_layer(tp_models, rng):
    """On a tensor-parallel rank with runtime.fused_blocks a MoE decoder layer is 4 launches: the
    attention block (opening with the previous MoE layer's residual norm), its all-reduce, the MoE layer
    (opening with the attention's residual norm), its all-reduce; 20 on the separate small-M kernels."""
    tokens = rng.integers(0, 1024, 7).tolist()
    for fused, model in tp_models.items():
        stages = stage_launches(model, ForwardBatch.causal(["a"], [0], [tokens], last_only=False),
                                _cache(model, tokens))
        moe = {i for i, ly in enumerate(model.layers) if hasattr(ly.mlp, "experts")}
        assert moe and 0 not in moe, "the tiny preset: a dense layer 0, then MoE layers"
        for stage, layer, n in stages:
            if stage == "attention":
                assert n == (TP_FUSED if fused else TP_ATTENTION_SEPARATE), (fused, layer)
            elif stage == "mlp" and layer in moe:
                assert n == (TP_FUSED if fused else TP_MOE_SEPARATE), (fused, layer)
        per_layer = {i: sum(n for s, ly, n in stages if ly == i) for i in moe}
        assert set(per_layer.values()) == {4 if fused else TP_ATTENTION_SEPARATE + TP_MOE_SEPARATE}
        assert model.comm.stats.calls["all_reduce"] >= 2 * model.num_layers


def test_tp_rank_fused_forward_is_the_unfused(tp_models, rng):
    """On a tensor-parallel rank the fused kernels with their prologues give the unfused path's bits:
    logits, and the residual stream at every layer the drafter asks for (hidden_layers)."""
    tokens = rng.integers(0, 1024, 9).tolist()
    outs = {}
    for fused, model in tp_models.items():
        assert model.fused_block(9) == model.fused_moe(9) == fused
        model.backend.ops.clear()
        out = model.forward(ForwardBatch.causal(["a"], [0], [tokens], last_only=False), _cache(model, tokens),
                            output="logits", hidden_layers=range(model.num_layers))
        outs[fused] = out
        assert sorted(out.hidden) == list(range(model.num_layers))
        ops = model.backend.ops
        assert ops.count("mla_block_small") == (model.num_layers if fused else 0)
    assert np.array_equal(np.asarray(outs[False].logits).view(np.uint16), np.asarray(outs[True].logits).view(np.uint16))
    for i, h in outs[False].hidden.items():
        assert np.array_equal(np.asarray(h).view(np.uint16), np.asarray(outs[True].hidden[i]).view(np.uint16)), i


# M -> new tokens per request: decode batches, a chain verify (one request, 3 tokens), 4 x 16
LAYOUTS = {1: [1], 3: [3], 17: [1] * 17, 33: [1] * 33, 64: [16] * 4}


def _nan_fill(a):
    a.fill(np.nan if a.dtype == np.float32 else 0x7FC0)
    return a


@pytest.mark.gpu
@pytest.mark.parametrize("dims", sorted(DIMS))
@pytest.mark.parametrize("m", sorted(LAYOUTS))
@pytest.mark.parametrize("f32", [False, True])
def test_fused_block_vs_twin_and_separate_kernels(dims, m, f32):
    """The fused block against its numpy twin (outputs, scratch and the new cache rows NaN before it
    runs; rows nobody may read and an unreferenced page NaN, and they must stay so), and against the
    separate small-M kernels on the same inputs: the same bits, output and cache."""
    import cupy

    rng = _seeded(f"fused block {dims} M={m}")
    case = Case(rng, DIMS[dims], rng.integers(1, 4000, len(LAYOUTS[m])), LAYOUTS[m])
    h, nope, v, q_lora, hid = DIMS[dims]
    be, ref_be = Backend("cuda"), Backend("numpy")
    att = case.att_plan(be)
    cache = cupy.asarray(case.cache.view(np.uint16))
    cache_sep = cache.copy()
    plan = be.mla_block_plan(m, hid, q_lora, h, nope, v, f32)
    for buf in (plan.qa, plan.cq, plan.kv, plan.q, plan.q_att, plan.o_lat, plan.lse, plan.o):
        _nan_fill(buf)

    def out_buf():
        return _nan_fill(cupy.empty((m, hid), cupy.float32 if f32 else cupy.uint16))

    got = be.mla_block_small(*case.args(be, cache, att), out=out_buf(), plan=plan)
    ref_cache = case.cache.copy()
    want = mla_block_small(*case.args(ref_be, ref_cache, case.att_plan(ref_be)),
                           out=np.empty((m, hid), np.float32) if f32 else None)
    got_h, cache_h = be.to_host(got), be.to_host(cache)
    assert_close(got_h, want, "fp32_accum" if f32 else "bf16_accum", "out")
    assert_close(cache_h, ref_cache, "bf16", "cache")  # NaN where it was: nothing written outside the slots

    w = MLAWeights(**{k: be.asarray(getattr(case.w, k)) for k in MLAWeights.__dataclass_fields__})
    sep = mla_forward(be, be.asarray(case.x), w, case.dims, be.asarray(case.positions), be.asarray(case.inv_freq),
                      EPS, cache_sep, be.asarray(case.slots), att, SCALE, 1.0, out=out_buf(), impl="invariant")
    bits = np.uint32 if f32 else np.uint16
    assert np.array_equal(be.to_host(sep, bf16=False).view(bits), be.to_host(got, bf16=False).view(bits)), \
        "the fused block's output differs from the separate small-M kernels'"
    assert np.array_equal(cache_sep.get(), cache.get()), "the cache rows differ from the separate kernels'"
    if not f32:  # one rank: the block ending with the post-attention residual norm, against rmsnorm after it
        resid, norm_w = be.asarray(random_bf16(rng, (m, hid))), be.asarray(random_bf16(rng, (hid,), 1.0))
        y, h = be.mla_block_small(*case.args(be, cache_sep.copy(), att), out=out_buf(), plan=plan, residual=resid,
                                  norm_weight=norm_w, norm_eps=1e-5)
        y_sep, h_sep = be.rmsnorm(sep, norm_w, 1e-5, residual=resid)
        assert np.array_equal(y.get(), y_sep.get()) and np.array_equal(h.get(), h_sep.get()), \
            "the fused residual norm differs from rmsnorm's"


@pytest.mark.gpu
@pytest.mark.parametrize("m", sorted(LAYOUTS))
@pytest.mark.parametrize("plus", [False, True])
def test_prologue_is_bitwise_to_bf16_and_rmsnorm(m, plus):
    """The prologue phase (a tensor-parallel rank's TP8 dims) against the separate to_bf16 + rmsnorm
    kernels on the same all-reduced sum: x and the new residual the same bits (written into NaN-prefilled
    buffers), and the block's fp32 partial and cache rows the same bits as the block run on that x."""
    import cupy

    rng = _seeded(f"prologue M={m}")
    h, nope, v, q_lora, hid = DIMS["tp8"]
    case = Case(rng, DIMS["tp8"], rng.integers(1, 4000, len(LAYOUTS[m])), LAYOUTS[m])
    be = Backend("cuda")
    att = case.att_plan(be)
    cache = cupy.asarray(case.cache.view(np.uint16))
    cache_sep = cache.copy()
    plan = be.mla_block_plan(m, hid, q_lora, h, nope, v, True)
    pro = _prologue(rng, be, m, hid, plus)
    pro = NormPrologue(pro.sum, pro.plus, pro.residual, pro.weight, pro.eps,
                       _nan_fill(cupy.empty((m, hid), cupy.uint16)), _nan_fill(cupy.empty((m, hid), cupy.uint16)))
    y, x, r = be.mla_block_small(None, *case.args(be, cache, att)[1:],
                                 out=_nan_fill(cupy.empty((m, hid), cupy.float32)), plan=plan, prologue=pro)
    assert x is pro.x_out and r is pro.residual_out
    x_sep, r_sep = _separate_prologue(be, pro)
    assert np.array_equal(x.get(), x_sep.get()), "x differs from to_bf16 + rmsnorm's"
    assert np.array_equal(r.get(), r_sep.get()), "the new residual differs from to_bf16 + rmsnorm's"
    y_sep = be.mla_block_small(x_sep, *case.args(be, cache_sep, att)[1:],
                               out=_nan_fill(cupy.empty((m, hid), cupy.float32)), plan=plan)
    assert np.isfinite(y.get()).all()
    assert np.array_equal(y.get().view(np.uint32), y_sep.get().view(np.uint32)), "the block's partial differs"
    assert np.array_equal(cache.get(), cache_sep.get()), "the cache rows differ"


@pytest.fixture(scope="module")
def tp8():
    from test_small_m_gpu import tp8_model

    return tp8_model()


@pytest.mark.gpu
def test_decode_rows_invariant_with_the_fused_block(tp8):
    """The whole decode forward at the TP8 shard with the fused kernels (each attention block and MoE
    layer one launch, ending with its residual norm): request r's logits the same bits in a batch of 1,
    7, 33 or 64 requests (eagerly and through the engine's CUDA graphs), and the same bits as on the
    separate small-M kernels."""
    from test_small_m_gpu import MS, _decode_cache, _decode_step

    from ddtree_rtc.engine.runner import ModelRunner

    model = tp8
    rng = _seeded("fused decode invariance")
    cache, ctx = _decode_cache(model, 64, rng)
    tokens = rng.integers(0, 20480, 64)

    def step(idx, runner=None):
        return _decode_step(model, cache, ctx, tokens, idx, runner)

    try:
        model.fused_blocks = False
        separate = step(np.arange(64))
        model.fused_blocks = True
        assert model.fused_block(64) and model.fused_block(1) and model.fused_moe(64) and model.fused_moe(1)
        full = step(np.arange(64))
        assert np.array_equal(full, separate), "the fused kernels change the logits"
        runner = ModelRunner(model, cache, 4200, graphs=True)
        for m in MS:
            idx = np.sort(rng.permutation(64)[:m]) if m < 64 else np.arange(64)
            for how, got in (("eager", step(idx)), ("graph", step(idx, runner))):
                bad = [int(i) for r, i in enumerate(idx) if not np.array_equal(got[r], full[i])]
                assert not bad, f"{how} M={m}: requests {bad[:6]} get other logits than at M=64"
    finally:
        model.fused_blocks = False


@pytest.mark.gpu
def test_simulated_tp_rank_decode_fused_is_the_unfused(tp8):
    """Rank 0 of a simulated TP8 decode (runtime.simulate_rank's SimulatedRank: the collectives copy, the
    numbers are this rank's partials): with the fused kernels and their prologues (4 launches per MoE
    layer) the logits and the drafter's hidden layers are the same bits as the unfused TP path's (the
    separate small-M kernels, all-reduce, to_bf16, rmsnorm), for M = 1, 7, 33, 64, eagerly and through
    the engine's CUDA graphs."""
    import cupy
    from test_small_m_gpu import MS, _decode_cache

    from ddtree_rtc.engine.runner import ModelRunner
    from ddtree_rtc.model.shard import Shard
    from ddtree_rtc.parallel.simulated import SimulatedRank

    model = tp8
    rng = _seeded("simulated tp8 decode")
    cache, ctx = _decode_cache(model, 64, rng)
    tokens = rng.integers(0, 20480, 64)
    shard, comm = model.shard, model.comm
    layers = tuple(range(model.num_layers))

    def step(idx, fused):
        model.fused_blocks = fused
        b = ForwardBatch.causal([int(i) for i in idx], ctx[idx], [[int(tokens[i])] for i in idx])
        out = model.forward(b, cache, output="logits", hidden_layers=layers)
        return model.backend.to_host(out.logits, bf16=False), {i: h.get() for i, h in out.hidden.items()}

    try:
        model.shard, model.comm = Shard(0, 8), SimulatedRank(0, 8, cupy)
        runner = ModelRunner(model, cache, 4200, graphs=True)
        for m in MS:
            idx = np.sort(rng.permutation(64)[:m]) if m < 64 else np.arange(64)
            (sep, sep_h), (got, got_h) = step(idx, False), step(idx, True)
            assert model.fused_block(m) and model.fused_moe(m)
            assert np.array_equal(got, sep), f"M={m}: the fused TP rank's logits differ from the unfused path's"
            for i in layers:
                assert np.array_equal(got_h[i], sep_h[i]), f"M={m}: hidden layer {i} differs"
            model.fused_blocks = True
            b = ForwardBatch.causal([int(i) for i in idx], ctx[idx], [[int(tokens[i])] for i in idx])
            graph = model.backend.to_host(runner.decode(b), bf16=False)
            assert np.array_equal(graph, sep), f"M={m}: the graph replay's logits differ"
    finally:
        model.shard, model.comm, model.fused_blocks = shard, comm, False


def test_runtime_key(tiny_dir, monkeypatch):
    """runtime.fused_blocks (default on) reaches the model; small_m_path=false turns every small-M kernel
    off, the fused ones included."""
    from pathlib import Path

    from ddtree_rtc.pipeline import runner
    from ddtree_rtc.pipeline.schema import parse_pipeline, parse_set_options

    pipe_text = ("model:\n  preset: tiny\nruntime:\n  backend: numpy\ndecode:\n  mode: autoregressive\n"
                 "workload:\n  synthetic: {count: 1, prompt_len: 4, output_len: 2}\n")
    monkeypatch.setattr(runner, "model_dir", lambda pipe, ranks: Path(tiny_dir))
    for sets, fused, small in (((), True, True), (("runtime.fused_blocks=false",), False, True),
                               (("runtime.small_m_path=false",), True, False)):
        engine, _ = runner.build_engine(parse_pipeline(pipe_text, "p.yaml", parse_set_options(sets)), max_batch=1)
        model = engine.model
        assert model.fused_blocks == fused and model.small_m_path == small, sets
        assert model.fused_block(3) == model.fused_moe(3) == (fused and small), sets
