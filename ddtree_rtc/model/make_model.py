"""Seeded random-weight checkpoints in the real format: HF DeepseekV3 tensor names, compressed-tensors
pack-quantized INT4 routed experts (packed here straight from the format spec, independent of the
kernels' repack code), bf16 elsewhere, a non-zero fp32 router bias, and a complete config.json.

Weights are scaled so activations keep a sane range through many layers: projections ~ N(0, 1/fan_in)
(times a small factor on the residual branches), norms ~ 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from ml_dtypes import bfloat16

from .checkpoint import TensorSpec, expected_tensors
from .config import ModelConfig
from .safetensors_io import write_file

QUANT_GROUP = 32

QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                    "group_size": QUANT_GROUP, "dynamic": False, "actorder": None, "observer": "minmax"},
        "input_activations": None, "output_activations": None}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*",
               "re:.*mlp\\.gate$"],
    "kv_cache_scheme": None,
}


def pack_int4(q: np.ndarray) -> np.ndarray:
    """int values in [-8, 7], shape [N, K] -> int32 [N, K/8]: value k in word k>>3, bits 4*(k&7), as q+8."""
    n, k = q.shape
    u = (q.astype(np.int64) + 8).astype(np.uint32).reshape(n, k // 8, 8)
    words = np.zeros((n, k // 8), dtype=np.uint32)
    for j in range(8):
        words |= u[:, :, j] << np.uint32(4 * j)
    return words.view(np.int32)


# The stored dtypes of the tensors real checkpoints write either way (the loader accepts each).
WEIGHT_SHAPE_DTYPES = {"int32": np.int32, "int64": np.int64}
ROUTER_DTYPES = {"bf16": bfloat16, "fp32": np.float32}
# lm_head forms: "random" (N(0, 1/H), the next token an arbitrary function of the context, top-1 and
# top-2 logits mostly within bf16 noise of each other); "decisive" (decisive_head below).
HEADS = ("random", "decisive")


def decisive_head(embed: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """lm_head rows = the embedding rows of a fixed random permutation, over sqrt(H): the residual
    stream of a random model stays close to its input token's embedding (every branch's output
    projection is scaled down), so the greedy next token is perm^-1(token) with a top-1/top-2 margin
    of most of the logit range (random dot products are ~sqrt(2 ln V / H) of it), far beyond bf16
    noise. Benchmarks that set tau by an oracle need that: with the random head, any change of batch
    shape flips near-tied choices and the target leaves the oracle's precomputed path."""
    e = embed.astype(np.float32)
    return (e[rng.permutation(e.shape[0])] * e.shape[1] ** -0.5).astype(bfloat16)


def random_int4_weight(rng: np.random.Generator, n: int, k: int, std: float):
    """(packed int32 [N, K/8], scales bf16 [N, K/32], shape int32 [2]) with W ~ std in magnitude.
    Uniform random words are uniform nibbles, i.e. q uniform on [-8, 7] packed per the spec (q + 8 in
    bits 4*(k&7) of word k>>3) — 8x fewer draws than packing drawn ints; the first word holds -8 and 7
    so every matrix has both extremes."""
    words = rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32)
    words[0, 0] = 0x0F0F0F0F  # nibbles 15, 0, 15, 0, ...: q = 7, -8, 7, -8, ...
    # uniform ints on [-8, 7] have std ~4.6; scale groups to the target std with +-25% jitter
    s = (std / 4.6 * rng.uniform(0.75, 1.25, size=(n, k // QUANT_GROUP))).astype(bfloat16)
    return words.view(np.int32), s, np.array([n, k], dtype=np.int32)


def _tensor(rng: np.random.Generator, spec: TensorSpec, cfg: ModelConfig, n_layers: int) -> np.ndarray:
    name, shape = spec.name, spec.shape
    if name.endswith(".e_score_correction_bias"):  # non-zero, the size of typical score gaps
        return rng.uniform(-0.05, 0.05, size=shape).astype(np.float32)
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(bfloat16)
    fan_in = shape[1]
    std = fan_in ** -0.5
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        std /= np.sqrt(2 * max(n_layers, 1))  # residual branches: keep the stream's growth bounded
    if name == "model.embed_tokens.weight":
        std = 1.0
    return (std * rng.standard_normal(shape, dtype=np.float32)).astype(bfloat16)


def make_model(cfg: ModelConfig, out: str | Path, seed: int = 0, progress=None, weight_shape_dtype: str = "int32",
               router_dtype: str = "bf16", bias_dtype: str = "fp32", head: str = "random") -> Path:
    """Write config.json and sharded safetensors (one shard per layer) to ``out``. ``weight_shape_dtype``
    (int32 as Kimi's files, int64 as compressed-tensors 0.20), ``router_dtype`` (of mlp.gate.weight) and
    ``bias_dtype`` (of e_score_correction_bias; bf16 or fp32 each) pick the stored forms; the values
    drawn are the same for every choice but the rounding of the router and bias to bf16. ``head``:
    the lm_head's form, one of HEADS (``decisive``: see decisive_head; every other tensor is the
    same as with ``random``)."""
    for what, v, choices in (("weight_shape_dtype", weight_shape_dtype, WEIGHT_SHAPE_DTYPES),
                             ("router_dtype", router_dtype, ROUTER_DTYPES), ("bias_dtype", bias_dtype, ROUTER_DTYPES),
                             ("head", head, HEADS)):
        if v not in choices:
            raise ValueError(f"{what} {v!r}: expected one of {', '.join(choices)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    n = cfg.num_hidden_layers
    groups: dict[str, list[TensorSpec]] = {"globals": []}
    for s in expected_tensors(cfg):
        key = s.name.split(".")[2] if s.name.startswith("model.layers.") else "globals"
        groups.setdefault(key, []).append(s)
    order = [k for k in groups if k != "globals"] + ["globals"]
    shards = [f"model-{i + 1:05d}-of-{len(order):05d}.safetensors" for i in range(len(order))]
    weight_map = {}
    for key, shard in zip(order, shards):
        tensors = {}
        expert_done = set()
        for s in groups[key]:
            if ".mlp.experts." in s.name:
                base = s.name.rsplit(".", 1)[0]
                if base in expert_done:
                    continue
                expert_done.add(base)
                n_out, k_in = s.shape[0], s.shape[1] * 8
                std = k_in ** -0.5 / (np.sqrt(2 * n) if base.endswith("down_proj") else 1.0)
                packed, scale, shape = random_int4_weight(rng, n_out, k_in, std)
                tensors.update({f"{base}.weight_packed": packed, f"{base}.weight_scale": scale,
                                f"{base}.weight_shape": shape.astype(WEIGHT_SHAPE_DTYPES[weight_shape_dtype])})
            else:
                t = _tensor(rng, s, cfg, n)
                if s.name.endswith(".mlp.gate.weight"):
                    t = t.astype(ROUTER_DTYPES[router_dtype])
                elif s.name.endswith(".e_score_correction_bias"):
                    t = t.astype(ROUTER_DTYPES[bias_dtype])
                tensors[s.name] = t
        if key == "globals" and head == "decisive":
            tensors["lm_head.weight"] = decisive_head(tensors["model.embed_tokens.weight"], rng)
        write_file(out / shard, tensors, {"format": "pt"})
        weight_map.update({name: shard for name in tensors})
        if progress is not None:
            progress(key)
    index = {"metadata": {"total_size": sum((out / s).stat().st_size for s in shards)}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    hf = cfg.to_hf_dict()
    if cfg.n_routed_experts:
        hf["quantization_config"] = QUANTIZATION_CONFIG
    (out / "config.json").write_text(json.dumps(hf, indent=1))
    return out
