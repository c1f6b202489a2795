"""Seeded random-weight checkpoints in the real format: HF DeepseekV3 tensor names, compressed-tensors
pack-quantized INT4 routed experts (packed here straight from the format spec, independent of the
kernels' repack code), bf16 elsewhere, a non-zero fp32 router bias, and a complete config.json.

The values are ddtree_rtc.model.random_weights' (one generator per tensor, keyed by seed and name),
the same that ``model.load: dummy`` makes in device memory for one rank's shard.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from ml_dtypes import bfloat16

from . import random_weights as rw
from .checkpoint import TensorSpec, expected_tensors
from .config import ModelConfig
from .safetensors_io import write_file

QUANT_GROUP = rw.QUANT_GROUP

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
# top-2 logits mostly within bf16 noise of each other); "decisive" (random_weights.decisive_rows).
HEADS = rw.HEADS


def _host(seed: int, spec: TensorSpec, n_layers: int) -> np.ndarray:
    """The whole tensor ``spec`` (random_weights' values), host, bf16 as ml_dtypes bfloat16."""
    a = rw.values(seed, spec.name, spec.shape, n_layers, np)
    return a.view(bfloat16) if a.dtype == np.uint16 else a


def make_model(cfg: ModelConfig, out: str | Path, seed: int = 0, progress=None, weight_shape_dtype: str = "int32",
               router_dtype: str = "bf16", bias_dtype: str = "fp32", head: str = "random") -> Path:
    """Write config.json and sharded safetensors (one shard per layer) to ``out``. ``weight_shape_dtype``
    (int32 as Kimi's files, int64 as compressed-tensors 0.20), ``router_dtype`` (of mlp.gate.weight) and
    ``bias_dtype`` (of e_score_correction_bias; bf16 or fp32 each) pick the stored forms; the values
    drawn are the same for every choice but the rounding of the router and bias to bf16. ``head``:
    the lm_head's form, one of HEADS (``decisive``: see random_weights.decisive_rows; every other tensor is the
    same as with ``random``)."""
    for what, v, choices in (("weight_shape_dtype", weight_shape_dtype, WEIGHT_SHAPE_DTYPES),
                             ("router_dtype", router_dtype, ROUTER_DTYPES), ("bias_dtype", bias_dtype, ROUTER_DTYPES),
                             ("head", head, HEADS)):
        if v not in choices:
            raise ValueError(f"{what} {v!r}: expected one of {', '.join(choices)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
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
        shapes = {s.name: s.shape for s in groups[key]}
        for s in groups[key]:
            if s.name.endswith(".weight_shape"):
                n_out, k_in8 = shapes[s.name[: -len("weight_shape")] + "weight_packed"]
                t = rw.int4_shape(n_out, k_in8 * 8, WEIGHT_SHAPE_DTYPES[weight_shape_dtype])
            elif s.name == "lm_head.weight" and head == "decisive":
                embed = tensors["model.embed_tokens.weight"].view(np.uint16)
                perm = rw.head_permutation(seed, cfg.vocab_size)
                t = rw.decisive_rows(embed[perm], cfg.hidden_size, np).view(bfloat16)
            else:
                t = _host(seed, s, n)
            if s.name.endswith(".mlp.gate.weight"):
                t = t.astype(ROUTER_DTYPES[router_dtype])
            elif s.name.endswith(".e_score_correction_bias"):
                t = t.astype(ROUTER_DTYPES[bias_dtype])
            tensors[s.name] = t
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
