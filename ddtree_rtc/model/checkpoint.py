"""Checkpoint layout of a DeepSeek-V3 / Kimi K2.x target: the tensor table a config implies, and a
reader over sharded or single-file safetensors with or without the ``language_model.`` prefix.

Every missing or mis-shaped tensor is reported by name, file and shape.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .config import ModelConfig
from .safetensors_io import SafetensorsError, open_tensor, read_header


class CheckpointError(ValueError):
    pass


# The router is bf16 in Kimi's files and fp32 in checkpoints saved from an fp32 model; the correction bias
# the other way round. Both load; routing math is fp32 either way.
ROUTER_DTYPES = "BF16|F32"
BIAS_DTYPES = "F32|BF16"
WEIGHT_SHAPE_DTYPES = "I32|I64"  # Kimi's files: int32; compressed-tensors 0.20: int64 (torch.tensor(shape))


@dataclass(frozen=True)
class TensorSpec:
    name: str  # without the language_model. prefix
    shape: tuple[int, ...]
    dtype: str  # BF16 | F32 | I32, or alternatives joined by '|' (the first is what make-model writes)

    @property
    def dtypes(self) -> tuple[str, ...]:
        return tuple(self.dtype.split("|"))


def _experts(cfg: ModelConfig, prefix: str) -> list[TensorSpec]:
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    out = []
    for e in range(cfg.n_routed_experts):
        for proj, (n, k) in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            base = f"{prefix}.mlp.experts.{e}.{proj}"
            out += [TensorSpec(f"{base}.weight_packed", (n, k // 8), "I32"),
                    TensorSpec(f"{base}.weight_scale", (n, k // 32), "BF16"),
                    TensorSpec(f"{base}.weight_shape", (2,), WEIGHT_SHAPE_DTYPES)]
    return out


def layer_tensors(cfg: ModelConfig, i: int) -> list[TensorSpec]:
    """Every tensor of decoder layer ``i`` (HF DeepseekV3 names, compressed-tensors INT4 experts)."""
    h, nh = cfg.hidden_size, cfg.num_attention_heads
    p = f"model.layers.{i}"
    t = [TensorSpec(f"{p}.input_layernorm.weight", (h,), "BF16"),
         TensorSpec(f"{p}.post_attention_layernorm.weight", (h,), "BF16")]
    a = f"{p}.self_attn"
    if cfg.q_lora_rank is None:
        t.append(TensorSpec(f"{a}.q_proj.weight", (nh * cfg.qk_head_dim, h), "BF16"))
    else:
        t += [TensorSpec(f"{a}.q_a_proj.weight", (cfg.q_lora_rank, h), "BF16"),
              TensorSpec(f"{a}.q_a_layernorm.weight", (cfg.q_lora_rank,), "BF16"),
              TensorSpec(f"{a}.q_b_proj.weight", (nh * cfg.qk_head_dim, cfg.q_lora_rank), "BF16")]
    t += [TensorSpec(f"{a}.kv_a_proj_with_mqa.weight", (cfg.kv_cache_dim, h), "BF16"),
          TensorSpec(f"{a}.kv_a_layernorm.weight", (cfg.kv_lora_rank,), "BF16"),
          TensorSpec(f"{a}.kv_b_proj.weight", (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
                     "BF16"),
          TensorSpec(f"{a}.o_proj.weight", (h, nh * cfg.v_head_dim), "BF16")]
    if cfg.is_moe_layer(i):
        si = cfg.moe_intermediate_size * cfg.n_shared_experts
        t += [TensorSpec(f"{p}.mlp.gate.weight", (cfg.n_routed_experts, h), ROUTER_DTYPES),
              TensorSpec(f"{p}.mlp.gate.e_score_correction_bias", (cfg.n_routed_experts,), BIAS_DTYPES)]
        if si:
            t += [TensorSpec(f"{p}.mlp.shared_experts.gate_proj.weight", (si, h), "BF16"),
                  TensorSpec(f"{p}.mlp.shared_experts.up_proj.weight", (si, h), "BF16"),
                  TensorSpec(f"{p}.mlp.shared_experts.down_proj.weight", (h, si), "BF16")]
        t += _experts(cfg, p)
    else:
        di = cfg.intermediate_size
        t += [TensorSpec(f"{p}.mlp.gate_proj.weight", (di, h), "BF16"),
              TensorSpec(f"{p}.mlp.up_proj.weight", (di, h), "BF16"),
              TensorSpec(f"{p}.mlp.down_proj.weight", (h, di), "BF16")]
    return t


def global_tensors(cfg: ModelConfig) -> list[TensorSpec]:
    t = [TensorSpec("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size), "BF16"),
         TensorSpec("model.norm.weight", (cfg.hidden_size,), "BF16")]
    if not cfg.tie_word_embeddings:
        t.append(TensorSpec("lm_head.weight", (cfg.vocab_size, cfg.hidden_size), "BF16"))
    return t


def expected_tensors(cfg: ModelConfig, layers: int | None = None) -> list[TensorSpec]:
    n = cfg.num_hidden_layers if layers is None else layers
    out = global_tensors(cfg)
    for i in range(n):
        out += layer_tensors(cfg, i)
    return out


class CheckpointReader:
    """Tensors of a model directory by canonical name (``model.layers.3....``), memory-mapped."""

    PREFIXES = ("", "language_model.")

    def __init__(self, path: str | Path):
        path = Path(path)
        single = path.is_file()
        self.dir = path.parent if single else path
        self.root = self.dir
        if not self.dir.is_dir():
            raise CheckpointError(f"{self.dir}: model directory not found")
        index = self.dir / "model.safetensors.index.json"
        if single:
            files = [path.name]
        elif index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.dir.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.dir}: no model.safetensors.index.json and no *.safetensors files")
        self._where: dict[str, tuple[Path, dict, int]] = {}
        for f in files:
            path = self.dir / f
            if not path.exists():
                raise CheckpointError(f"{index}: names shard {f} which does not exist")
            try:
                table, start = read_header(path)
            except SafetensorsError as e:
                raise CheckpointError(str(e)) from None
            for name, entry in table.items():
                self._where[name] = (path, entry, start)
        self.prefix = "language_model." if any(k.startswith("language_model.") for k in self._where) else ""
        # canonical name -> bytes handed out by get / get_part (the loader copies each once): how a
        # test proves that a tensor-parallel rank reads only its slices
        self.bytes_read: dict[str, int] = {}

    def names(self) -> list[str]:
        n = len(self.prefix)
        return sorted(k[n:] for k in self._where if k.startswith(self.prefix))

    def full_name(self, name: str) -> str:
        """The name as stored: canonical names get the checkpoint's prefix; stored names pass."""
        return name if self.prefix and name.startswith(self.prefix) else self.prefix + name

    def __contains__(self, name: str) -> bool:
        return self.full_name(name) in self._where

    def _entry(self, name: str) -> tuple[Path, dict, int]:
        try:
            return self._where[self.full_name(name)]
        except KeyError:
            raise CheckpointError(f"{self.dir}: missing tensor {self.full_name(name)}") from None

    def file_of(self, name: str) -> Path:
        return self._entry(name)[0]

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype such as 'BF16', shape) without reading the data."""
        entry = self._entry(name)[1]
        return entry["dtype"], tuple(entry["shape"])

    def get(self, name: str, shape: tuple | None = None, dtype: str | None = None) -> np.ndarray:
        path, entry, start = self._entry(name)
        name = self.full_name(name)
        if shape is not None and tuple(entry["shape"]) != tuple(shape):
            raise CheckpointError(f"{path.name}: tensor {name} has shape {tuple(entry['shape'])}, "
                                  f"expected {tuple(shape)} from config.json")
        if dtype is not None and entry["dtype"] != dtype:
            raise CheckpointError(f"{path.name}: tensor {name} has dtype {entry['dtype']}, "
                                  f"expected {dtype}")
        mm = open_tensor(path, name, entry, start)
        self._count(name, mm.nbytes)
        return mm

    def _count(self, full: str, nbytes: int) -> None:
        key = full[len(self.prefix):] if self.prefix and full.startswith(self.prefix) else full
        self.bytes_read[key] = self.bytes_read.get(key, 0) + int(nbytes)

    def get_part(self, name: str, axis: int, start: int, stop: int) -> np.ndarray:
        """A copy of ``[start, stop)`` of tensor ``name`` along ``axis``: only those bytes are read
        from the memory map (rows: one contiguous range; columns: one range per row)."""
        path, entry, begin = self._entry(name)
        full = self.full_name(name)
        shape = tuple(entry["shape"])
        if not 0 <= axis < len(shape) or not 0 <= start < stop <= shape[axis]:
            raise CheckpointError(f"{path.name}: tensor {full} {list(shape)}: no part [{start}, {stop}) "
                                  f"on axis {axis}")
        mm = open_tensor(path, full, entry, begin)
        index = [slice(None)] * len(shape)
        index[axis] = slice(start, stop)
        part = np.ascontiguousarray(mm[tuple(index)])
        self._count(full, part.nbytes)
        return part

    def check(self, specs: list[TensorSpec]) -> None:
        """Every expected tensor present with the right shape and dtype; all problems in one error."""
        problems = []
        for s in specs:
            full = self.prefix + s.name
            if full not in self._where:
                problems.append(f"missing {full}")
                continue
            _, entry, _ = self._where[full]
            if tuple(entry["shape"]) != s.shape or entry["dtype"] not in s.dtypes:
                want = " or ".join(s.dtypes)
                problems.append(f"{full}: {entry['dtype']}{tuple(entry['shape'])}, expected {want}{s.shape}")
        if problems:
            more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
            raise CheckpointError(f"{self.dir}: checkpoint does not match config.json: "
                                  + "; ".join(problems[:10]) + more)
