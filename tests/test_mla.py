"""The MLA layer pieces (model/mla.py: absorbed, over backend ops and the paged cache) against the
float64 non-absorbed layer (reference/mla.py), for prefill, decode and tree verify on top of a
cached prefix; the K2.6 scales; the CUDA backend against the numpy one."""

import numpy as np
import pytest
from ml_dtypes import bfloat16

from ddtree_rtc.backend import Backend
from ddtree_rtc.engine.kv_cache import PagedKVCache
from ddtree_rtc.model.config import preset_config
from ddtree_rtc.model.mla import MLADims, MLAWeights, mla_forward, rope_scale, softmax_scale
from ddtree_rtc.reference.mla import mla_layer_f64
from ddtree_rtc.reference.mla_attention import tree_mask_from_parents
from ddtree_rtc.reference.rope import rope_inv_freq
from ddtree_rtc.testing import assert_close, random_bf16

K26_SCALING = {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
               "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
DIMS = MLADims(num_heads=3, qk_nope=16, qk_rope=64, v_head=24, kv_lora=512)
HIDDEN, Q_LORA, EPS = 96, 48, 1e-5


def test_k26_scales():
    assert softmax_scale(192, K26_SCALING) == pytest.approx(0.14467963, abs=1e-8)
    assert softmax_scale(192, K26_SCALING) == pytest.approx(preset_config("k2.6").softmax_scale, rel=1e-12)
    assert softmax_scale(192, None) == pytest.approx(192 ** -0.5)
    assert rope_scale(K26_SCALING) == 1.0
    assert rope_scale({**K26_SCALING, "mscale_all_dim": 0}) == pytest.approx(0.1 * np.log(64) + 1)
    dims = MLADims.from_config(preset_config("k2.6"))
    assert (dims.num_heads, dims.qk_head, dims.v_head, dims.row) == (64, 192, 128, 576)
    assert MLADims.from_config(preset_config("k2.6"), num_heads=8).num_heads == 8


def random_weights(rng, with_q_lora=True):
    def w(shape):
        return random_bf16(rng, shape, 1.0 / np.sqrt(shape[-1]))

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(bfloat16)

    h = DIMS.num_heads
    host = {"q_b": w((h * DIMS.qk_head, Q_LORA if with_q_lora else HIDDEN)), "kv_a": w((DIMS.row, HIDDEN)),
            "kv_a_norm": norm(DIMS.kv_lora), "kv_b": w((h * (DIMS.qk_nope + DIMS.v_head), DIMS.kv_lora)),
            "o": w((HIDDEN, h * DIMS.v_head)),
            "q_a": w((Q_LORA, HIDDEN)) if with_q_lora else None, "q_a_norm": norm(Q_LORA) if with_q_lora else None}
    return host


def run_model(be, host_w, seqs, page_size=8):
    """seqs: list of (x_prefix [P, hidden], x_new [N, hidden], parents or None). Prefill every prefix
    (one causal batch), then one batch of the new tokens (tree or causal). Returns each sequence's
    new-token outputs, as host float32."""
    w = MLAWeights(**{k: (None if v is None else be.asarray(v)) for k, v in host_w.items()})
    inv_freq = rope_inv_freq(DIMS.qk_rope, 50000.0, K26_SCALING)
    scale = softmax_scale(DIMS.qk_head, K26_SCALING)
    cache = PagedKVCache(be, num_layers=1, num_pages=64, page_size=page_size, row=DIMS.row)
    for i, (xp, xn, _) in enumerate(seqs):
        cache.allocator.reserve(i, len(xp) + len(xn))
    width = max(len(cache.allocator.pages(i)) for i in range(len(seqs)))

    def step(ids, ctx, xs, positions, slots, mask):
        plan = be.mla_attention_plan(np.array(ctx), np.array([len(x) for x in xs]),
                                     cache.allocator.page_table(ids, width), DIMS.num_heads, page_size,
                                     cache.num_pages, mask)
        x = be.asarray(np.concatenate(xs))
        return mla_forward(be, x, w, DIMS, be.asarray(np.concatenate(positions).astype(np.int32)),
                           be.asarray(inv_freq), EPS, cache.layer(0), be.asarray(np.concatenate(slots)), plan, scale)

    pre = [i for i, s in enumerate(seqs) if len(s[0])]
    if pre:
        step(pre, [0] * len(pre), [seqs[i][0] for i in pre], [np.arange(len(seqs[i][0])) for i in pre],
             [cache.allocator.slots(i, np.arange(len(seqs[i][0]))) for i in pre], None)
    trees = seqs[0][2] is not None
    positions = []
    for xp, xn, parents in seqs:
        positions.append(len(xp) + (depths(parents) if trees else np.arange(len(xn))))
    mask = None
    if trees:
        words = max(1, -(-max(len(s[1]) for s in seqs) // 64))
        mask = np.concatenate([tree_mask_from_parents(s[2], words) for s in seqs])
    out = step(range(len(seqs)), [len(s[0]) for s in seqs], [s[1] for s in seqs], positions,
               [cache.allocator.slots(i, len(s[0]) + np.arange(len(s[1]))) for i, s in enumerate(seqs)], mask)
    out = be.to_host(out).astype(np.float32)
    bounds = np.cumsum([0] + [len(s[1]) for s in seqs])
    return [out[a:b] for a, b in zip(bounds, bounds[1:])]


def depths(parents):
    d = np.zeros(len(parents), dtype=np.int64)
    for i in range(1, len(parents)):
        d[i] = d[parents[i]] + 1
    return d


def f64_outputs(host_w, seqs):
    inv_freq = rope_inv_freq(DIMS.qk_rope, 50000.0, K26_SCALING)
    scale = softmax_scale(DIMS.qk_head, K26_SCALING)
    outs = []
    for xp, xn, parents in seqs:
        p, n = len(xp), len(xn)
        vis = np.tri(p + n, dtype=bool)
        if parents is not None:
            anc = tree_mask_from_parents(parents)
            vis[p:, p:] = np.unpackbits(anc.view(np.uint8), axis=1, bitorder="little")[:, :n].astype(bool)
        pos = np.concatenate([np.arange(p), p + (depths(parents) if parents is not None else np.arange(n))])
        dims = (DIMS.qk_nope, DIMS.qk_rope, DIMS.v_head, DIMS.kv_lora)
        y = mla_layer_f64(np.concatenate([xp, xn]), host_w, DIMS.num_heads, dims, pos, inv_freq, EPS, vis, scale)
        outs.append(y[p:])
    return outs


def scenarios(rng):
    def x(n):
        return random_bf16(rng, (n, HIDDEN))

    tree = [0, 0, 1, 1, 0, 2, 5, 6, 3, 8, 9]
    return {
        "prefill": [(x(0), x(13), None)],
        "decode": [(x(21), x(1), None), (x(5), x(1), None), (x(0), x(1), None)],
        "verify": [(x(17), x(len(tree)), np.array(tree)), (x(9), x(4), np.array([0, 0, 1, 2]))],
        "chunk": [(x(11), x(6), None), (x(30), x(2), None)],
    }


@pytest.mark.parametrize("name", ["prefill", "decode", "verify", "chunk"])
@pytest.mark.parametrize("with_q_lora", [True, False])
def test_absorbed_layer_matches_float64(rng, name, with_q_lora):
    host_w = random_weights(rng, with_q_lora)
    seqs = scenarios(rng)[name]
    got = run_model(Backend("numpy", quiet=True), host_w, seqs)
    # all sequences together: a single decode token's 96 values make a noisy relative norm
    assert_close(np.concatenate(got), np.concatenate(f64_outputs(host_w, seqs)), "bf16_accum", name)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["prefill", "decode", "verify", "chunk"])
def test_cuda_backend_matches_numpy(rng, name):
    host_w = random_weights(rng)
    seqs = scenarios(rng)[name]
    want = np.concatenate(run_model(Backend("numpy", quiet=True), host_w, seqs))
    got = np.concatenate(run_model(Backend("cuda"), host_w, seqs))
    assert_close(got, want, "bf16_accum", f"{name} (cuda vs numpy)")
    assert_close(got, np.concatenate(f64_outputs(host_w, seqs)), "bf16_accum", f"{name} (cuda vs float64)")
