"""compressed-tensors ``pack-quantized`` INT4 experts: check the config's quantization_config, then
load and validate each expert's ``weight_packed`` / ``weight_scale`` / ``weight_shape`` from the
safetensors checkpoint (with or without the ``language_model.`` prefix). Anything but symmetric
INT4, group 32, bf16 scales, weight-only, is refused by name rather than misread.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from ml_dtypes import bfloat16

from .checkpoint import CheckpointError, CheckpointReader
from .int4_repack import Int4Experts

PREFIXES = ("language_model.", "")
PROJS = ("gate_proj", "up_proj", "down_proj")


class QuantConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Int4Scheme:
    """The one scheme the INT4 MoE kernels read."""

    num_bits: int = 4
    group_size: int = 32
    symmetric: bool = True
    format: str = "pack-quantized"


INT4_GROUP32 = Int4Scheme()


def parse_quantization_config(config: dict, source: str = "config.json") -> Int4Scheme:
    """``config``: a whole config.json (quantization_config at the top or in text_config) or the
    quantization_config itself. Returns the scheme or raises QuantConfigError naming the problem."""
    q = config
    if "quant_method" not in q:
        q = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not q:
        raise QuantConfigError(f"{source}: no quantization_config; the routed experts must be INT4 "
                               f"compressed-tensors pack-quantized")
    where = f"{source}: quantization_config"
    method = q.get("quant_method")
    if method != "compressed-tensors":
        raise QuantConfigError(f"{where}: quant_method {method!r} is not supported (only 'compressed-tensors')")
    status = q.get("quantization_status", "compressed")
    if status != "compressed":
        raise QuantConfigError(f"{where}: quantization_status {status!r}: only 'compressed' checkpoints load")
    groups = q.get("config_groups") or {}
    if not groups:
        raise QuantConfigError(f"{where}: config_groups is empty")
    top_format = q.get("format")
    for gname, g in groups.items():
        gw = f"{where}.config_groups.{gname}"
        fmt = g.get("format") or top_format
        if fmt != "pack-quantized":
            raise QuantConfigError(f"{gw}: format {fmt!r} is not supported (only 'pack-quantized' INT4)")
        for act in ("input_activations", "output_activations"):
            if g.get(act):
                raise QuantConfigError(f"{gw}: {act} are quantized ({g[act]}); only weight-only W4A16 is supported")
        w = g.get("weights")
        if not w:
            raise QuantConfigError(f"{gw}: no 'weights' scheme")
        checks = (("num_bits", 4, "bit width"), ("type", "int", "type"), ("symmetric", True, "symmetry"),
                  ("strategy", "group", "strategy"), ("group_size", 32, "group size"))
        for key, want, what in checks:
            got = w.get(key)
            if got != want:
                extra = " (asymmetric schemes carry zero points, which the kernels do not read)" \
                    if key == "symmetric" else ""
                raise QuantConfigError(f"{gw}.weights: {what} {key}={got!r} is not supported; need {want!r}{extra}")
        if w.get("dynamic"):
            raise QuantConfigError(f"{gw}.weights: dynamic={w['dynamic']!r} is not supported")
        if w.get("actorder") not in (None, "static"):
            raise QuantConfigError(f"{gw}.weights: actorder={w['actorder']!r} (needs g_idx) is not supported")
    return INT4_GROUP32


def expert_prefix(ckpt: CheckpointReader, layer: int) -> str:
    """``[language_model.]model.layers.{layer}.mlp.experts.`` as the checkpoint spells it."""
    for p in PREFIXES:
        stem = f"{p}model.layers.{layer}.mlp.experts."
        if f"{stem}0.down_proj.weight_packed" in ckpt or f"{stem}0.down_proj.weight" in ckpt:
            return stem
    raise CheckpointError(f"{ckpt.root}: layer {layer} has no routed experts (looked for "
                          f"'[language_model.]model.layers.{layer}.mlp.experts.0.down_proj.weight_packed')")


def load_int4_linear(ckpt: CheckpointReader, base: str, n: int, k: int,
                     scheme: Int4Scheme = INT4_GROUP32,
                     part: tuple[int, int, int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``base``.{weight_packed, weight_scale, weight_shape} of an [n, k] linear -> (packed int32
    [n, k/8], scale bf16 [n, k/32]), every dtype and shape checked against the scheme. ``part``
    (axis, start, stop) of the [n, k] weight reads only that slice (a k slice keeps groups whole)."""
    g = scheme.group_size
    if part is not None and part[0] == 1 and (part[1] % g or part[2] % g):
        raise CheckpointError(f"{base}: k slice [{part[1]}, {part[2]}) cuts an INT4 group of {g}")
    if k % g:
        raise CheckpointError(f"{base}: in-features {k} is not a multiple of the group size {g}")
    for bad, why in (("weight_zero_point", "a zero point (asymmetric scheme)"),
                     ("weight_g_idx", "a g_idx (activation reordering)")):
        if base + bad in ckpt:
            raise CheckpointError(f"{base}{bad} in {ckpt.file_of(base + bad).name}: the tensor has {why}, "
                                  f"which the INT4 kernels do not support")
    if base + "weight_packed" not in ckpt:
        what = "is bf16, not quantized" if base + "weight" in ckpt else "is missing"
        raise CheckpointError(f"{ckpt.root}: {base}weight_packed {what}")
    if base + "weight_scale" not in ckpt:
        raise CheckpointError(f"{ckpt.root}: missing scale tensor {base}weight_scale")
    want = {"weight_packed": ("I32", (n, k // 8)), "weight_scale": ("BF16", (n, k // g))}
    out = []
    for leaf, (dt, shape) in want.items():
        name = base + leaf
        got_dt, got_shape = ckpt.info(name)
        f = ckpt.file_of(name).name
        if got_dt != dt:
            raise CheckpointError(f"{name} in {f}: dtype {got_dt}, expected {dt}")
        if got_shape != shape:
            raise CheckpointError(f"{name} in {f}: shape {list(got_shape)}, expected {list(shape)} "
                                  f"(an [{n}, {k}] weight, {scheme.num_bits}-bit, group {g})")
        if part is None:
            out.append(ckpt.get(name))
        else:
            axis, lo, hi = part
            div = 1 if axis == 0 else (8 if leaf == "weight_packed" else g)
            out.append(ckpt.get_part(name, axis, lo // div, hi // div))
    if base + "weight_shape" in ckpt:
        name = base + "weight_shape"
        f = ckpt.file_of(name).name
        got_dt, _ = ckpt.info(name)
        if got_dt not in ("I32", "I64"):  # Kimi's files: int32; compressed-tensors 0.20: int64
            raise CheckpointError(f"{name} in {f}: dtype {got_dt}, expected I32 or I64")
        ws = np.asarray(ckpt.get(name)).reshape(-1)
        packed_shape, scale_shape = ckpt.info(base + "weight_packed")[1], ckpt.info(base + "weight_scale")[1]
        if ws.size != 2 or (int(ws[0]), int(ws[1])) != (n, k):
            raise CheckpointError(f"{name} in {f} says {ws.tolist()}, but {base}weight_packed is "
                                  f"{list(packed_shape)} and {base}weight_scale {list(scale_shape)} "
                                  f"(an [{n}, {k}] weight, group {g})")
    return np.ascontiguousarray(out[0]).view(np.int32), np.ascontiguousarray(out[1])


def load_moe_experts(ckpt: CheckpointReader, layer: int, num_experts: int, hidden: int,
                     intermediate: int, scheme: Int4Scheme = INT4_GROUP32,
                     experts: range | None = None, inter_part: tuple[int, int] | None = None) -> Int4Experts:
    """The routed experts of one layer (all, or the ``experts`` range of an EP shard) as host
    'compressed-tensors' Int4Experts, gate and up stacked along N. ``inter_part`` [start, stop) of
    the intermediate (a TP shard): gate / up rows and down columns of that range only."""
    prefix = expert_prefix(ckpt, layer)
    ids = range(num_experts) if experts is None else experts
    if ids.start < 0 or ids.stop > num_experts or len(ids) == 0:
        raise ValueError(f"experts {ids} must be a non-empty sub-range of [0, {num_experts})")
    e = len(ids)
    full_inter = intermediate
    lo, hi = (0, intermediate) if inter_part is None else inter_part
    intermediate = hi - lo
    rows = None if inter_part is None else (0, lo, hi)
    cols = None if inter_part is None else (1, lo, hi)
    w13 = np.empty((e, 2 * intermediate, hidden // 8), dtype=np.int32)
    s13 = np.empty((e, 2 * intermediate, hidden // scheme.group_size), dtype=bfloat16)
    w2 = np.empty((e, hidden, intermediate // 8), dtype=np.int32)
    s2 = np.empty((e, hidden, intermediate // scheme.group_size), dtype=bfloat16)
    for i, x in enumerate(ids):
        base = f"{prefix}{x}."
        w13[i, :intermediate], s13[i, :intermediate] = load_int4_linear(
            ckpt, base + "gate_proj.", full_inter, hidden, scheme, rows)
        w13[i, intermediate:], s13[i, intermediate:] = load_int4_linear(
            ckpt, base + "up_proj.", full_inter, hidden, scheme, rows)
        w2[i], s2[i] = load_int4_linear(ckpt, base + "down_proj.", hidden, full_inter, scheme, cols)
    return Int4Experts("compressed-tensors", e, hidden, intermediate, w13, s13, w2, s2)
