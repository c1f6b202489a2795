"""End-to-end proof that the model is DeepSeek-V3 / Kimi K2: a small random HF transformers
DeepseekV3ForCausalLM (fp32, eager attention, MoE layers with a non-zero correction bias), its routed
experts quantised to compressed-tensors INT4 in the test and the dequantised weights loaded back into
the HF model so both sides hold the same function, saved in the real checkpoint format, loaded with
our loader, then teacher-forced logits and greedy continuations compared. Skipped where torch or
transformers are absent (they are test oracles only, never package dependencies)."""

import json

import numpy as np
import pytest
from ml_dtypes import bfloat16

from ddtree_rtc.backend import Backend
from ddtree_rtc.engine.engine import Engine
from ddtree_rtc.engine.kv_cache import PagedKVCache
from ddtree_rtc.engine.request import Request
from ddtree_rtc.model.make_model import QUANTIZATION_CONFIG, pack_int4
from ddtree_rtc.model.safetensors_io import write_file
from ddtree_rtc.model.target import ForwardBatch, TargetModel
from ddtree_rtc.testing import last_logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SEQ = 192
CASES = {
    "groups+q_lora": dict(n_group=4, topk_group=2, q_lora_rank=96),
    "no_groups+no_q_lora": dict(n_group=1, topk_group=1, q_lora_rank=None),
}


def _hf_model(seed: int, **kw):
    cfg = transformers.DeepseekV3Config(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=16,
        num_experts_per_tok=4, routed_scaling_factor=2.5, kv_lora_rank=512, qk_rope_head_dim=64,
        qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=1, norm_topk_prob=True, rms_norm_eps=1e-5,
        max_position_embeddings=1024, rope_interleave=True, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2, pad_token_id=0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 256, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
        **kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(cfg).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
            p.copy_(torch.from_numpy(p.numpy().astype(bfloat16).astype(np.float32)))  # bf16 values
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.05 * torch.randn(16, generator=gen))
    return model


def _quantize(w: np.ndarray):
    """fp32 [N, K] -> (packed int32 [N, K/8], scales bf16 [N, K/32], dequantised fp32 [N, K])."""
    n, k = w.shape
    g = w.reshape(n, k // 32, 32)
    s = (np.abs(g).max(-1) / 7.0).astype(bfloat16)
    s32 = s.astype(np.float32)[..., None]
    q = np.clip(np.rint(g / s32), -8, 7).astype(np.int64)
    q[0, 0, 0] = -8  # the format's extra value must survive too
    return pack_int4(q.reshape(n, k)), s, (q * s32).reshape(n, k).astype(np.float32)


def _save(model, directory) -> None:
    """Quantise the routed experts (writing the dequantised values back into the HF model) and
    write our checkpoint format: HF DeepseekV3 names, per-expert compressed-tensors INT4."""
    tensors = {}
    with torch.no_grad():
        for name, p in model.state_dict().items():
            a = p.numpy()
            if ".mlp.experts." in name:
                prefix = name.rsplit(".", 1)[0]
                if name.endswith("gate_up_proj"):
                    inter = a.shape[1] // 2
                    parts = (("gate_proj", slice(0, inter)), ("up_proj", slice(inter, 2 * inter)))
                else:
                    parts = (("down_proj", slice(None)),)
                for e in range(a.shape[0]):
                    for proj, rows in parts:
                        packed, scale, deq = _quantize(a[e, rows])
                        a[e, rows] = deq
                        base = f"{prefix}.{e}.{proj}"
                        tensors[f"{base}.weight_packed"] = packed
                        tensors[f"{base}.weight_scale"] = scale
                        tensors[f"{base}.weight_shape"] = np.array(deq.shape, dtype=np.int32)
                p.copy_(torch.from_numpy(a))
            elif name.endswith("e_score_correction_bias"):
                tensors[name] = a.astype(np.float32)
            else:
                tensors[name] = a.astype(bfloat16)
    write_file(directory / "model.safetensors", tensors)
    cfg = model.config.to_dict()
    cfg["quantization_config"] = QUANTIZATION_CONFIG
    (directory / "config.json").write_text(json.dumps(cfg))


def _backends():
    out = [pytest.param("numpy", id="numpy")]
    out.append(pytest.param("cuda", id="cuda", marks=pytest.mark.gpu))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_hf_transformers(tmp_path, backend, case):
    hf = _hf_model(7, **CASES[case])
    _save(hf, tmp_path)
    be = Backend(backend)
    ours = TargetModel.load(tmp_path, be)
    assert ours.cfg.n_group == CASES[case]["n_group"] and ours.cfg.q_lora_rank == CASES[case]["q_lora_rank"]
    rng = np.random.default_rng(3)
    ids = rng.integers(3, 512, SEQ).tolist()

    # teacher-forced logits over SEQ positions
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy().astype(np.float64)
    cache = PagedKVCache(be, ours.num_layers, 16, 16)
    cache.allocator.reserve(0, SEQ)
    got = be.to_host(ours.forward(ForwardBatch.causal([0], [0], [ids], last_only=False), cache,
                                  output="logits").logits).astype(np.float64)
    # bf16 activations against fp32: ~1% per position. A few positions jump further when a near-tied
    # router score picks a different expert (seen: 5-9 of 192 after the first MoE layer); a real bug
    # (rope layout, scale, norm eps, routing rule) moves every position.
    per_pos = np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)
    assert np.median(per_pos) < 2e-2, f"teacher-forced logits: median relative error {np.median(per_pos):.3e}"
    consistent = per_pos < 5e-2
    # The CUDA MoE tile for many pairs per expert (nt4) rounds q*s to bf16 before the mma, so more
    # router near-ties flip than on numpy (H200: 88.5% of positions within 5%, median still < 2%).
    floor = 0.9 if backend == "numpy" else 0.8
    assert consistent.mean() >= floor, f"only {consistent.mean():.0%} of positions within 5%"
    top2 = np.sort(ref, axis=1)[:, -2:]
    clear = ((top2[:, 1] - top2[:, 0]) > 0.05 * np.abs(ref).max(axis=1)) & consistent
    assert clear.mean() > 0.5
    assert np.array_equal(got.argmax(1)[clear], ref.argmax(1)[clear]), "argmax differs where the margin is clear"

    # greedy continuation (the decode path): identical up to the first step where the two may
    # legitimately part, judged as in the teacher-forced check above: HF's top-2 margin is not clear,
    # or our logits at that prefix moved by more than 5% (a router near-tie picked another expert)
    prompt, new = ids[:24], 24
    ours_out = Engine(ours, max_batch=1, page_size=16, max_context=64).run([Request(0, prompt, new)])[0].output
    seq = list(prompt)
    with torch.no_grad():
        for k in range(new):
            logits = hf(torch.tensor([seq])).logits[0, -1].numpy().astype(np.float64)
            if ours_out[k] != int(logits.argmax()):
                top = np.sort(logits)[-2:]
                margin = (top[1] - top[0]) / np.abs(logits).max()
                mine = last_logits(ours, seq)
                moved = np.linalg.norm(mine - logits) / np.linalg.norm(logits)
                assert margin < 0.05 or moved >= 5e-2, (
                    f"greedy token {k} differs at a clear margin ({margin:.3f} of max|logit|) where our "
                    f"logits are within {moved:.2%} of HF's")
                break
            seq.append(int(logits.argmax()))
