"""The DFlash drafter (z-lab's block-diffusion drafter): config, checkpoint and forward.

docs/architecture.md, "The DFlash drafter". One forward over the block ``[bonus, MASK x (B-1)]``
at positions ``start .. start+B-1`` gives logits for block rows 1..B-1 at once. Context rows are
``ctx = hidden_norm(fc(concat_j h_j))`` of the target's hidden states (output of each layer in
``target_layer_ids``); each layer projects ctx to K/V (k_norm, rotate-half RoPE at the row's own
position) and caches them, paged. A layer: q = q_norm(q_proj(x)) on block rows, K/V of the block
rows appended to the cached context K/V, NON-causal attention, o_proj, residual, post-attention
norm, SwiGLU MLP, residual; final norm; the target's lm_head. No embedding or lm_head of its own.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..reference.gqa_attention import HEAD_DIMS, MAX_BLOCK
from ..reference.rope import rope_inv_freq, yarn_mscale
from ..reference.tree_build import MAX_DEPTH
from .checkpoint import CheckpointError, CheckpointReader, TensorSpec
from .config import ConfigError, RopeConfig, _rope


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope: RopeConfig
    attention_factor: float  # YaRN's factor on cos / sin (1 without YaRN)
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None = None
    sliding_window: int | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    source: str = "<dict>"

    @property
    def depth(self) -> int:
        return self.block_size - 1


def _attention_factor(raw: dict, rope: RopeConfig) -> float:
    """HF's YaRN attention factor: explicit ``attention_factor``, else mscale(f, mscale) /
    mscale(f, mscale_all_dim) when both are set, else 0.1 ln(f) + 1."""
    if rope.kind != "yarn":
        return 1.0
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all:
        return yarn_mscale(rope.factor, float(m)) / yarn_mscale(rope.factor, float(m_all))
    return yarn_mscale(rope.factor)


def dflash_config_from_dict(raw: dict, source: str = "<dict>") -> DFlashConfig:
    dc = raw.get("dflash_config")
    if not isinstance(dc, dict):
        raise ConfigError(f"{source}: no dflash_config (a DFlash drafter's config.json has "
                          f"dflash_config{{mask_token_id, target_layer_ids}})")

    def val(name, default=None):
        return dc.get(name, raw.get(name, default))

    try:
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        cfg = dict(hidden_size=hidden, num_hidden_layers=int(raw["num_hidden_layers"]), num_attention_heads=heads,
                   num_key_value_heads=int(raw.get("num_key_value_heads", heads)),
                   head_dim=int(raw.get("head_dim") or hidden // heads),
                   intermediate_size=int(raw["intermediate_size"]), vocab_size=int(raw["vocab_size"]),
                   rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)))
    except KeyError as e:
        raise ConfigError(f"{source}: missing {e.args[0]!r}") from None
    if val("mask_token_id") is None:
        raise ConfigError(f"{source}: dflash_config has no mask_token_id")
    if val("target_layer_ids") is None:
        raise ConfigError(f"{source}: dflash_config has no target_layer_ids")
    if raw.get("attention_bias"):
        raise ConfigError(f"{source}: attention_bias true is not supported (z-lab's drafters have none)")
    types = raw.get("layer_types") or []
    if any(t != "full_attention" for t in types) or raw.get("is_causal"):
        raise ConfigError(f"{source}: layer_types {sorted(set(types))} / is_causal: only non-causal "
                          f"full_attention layers are supported")
    rope = _rope(raw, source)
    softcap = val("final_logit_softcapping")
    out = DFlashConfig(**cfg, rope=rope, attention_factor=_attention_factor(raw, rope),
                       block_size=int(val("block_size", 16)), mask_token_id=int(val("mask_token_id")),
                       target_layer_ids=tuple(int(i) for i in val("target_layer_ids")),
                       num_target_layers=raw.get("num_target_layers"), sliding_window=raw.get("sliding_window"),
                       input_embedding_scale=float(val("input_embedding_scale", 1.0)),
                       output_multiplier=float(val("output_multiplier", 1.0)),
                       final_logit_softcapping=float(softcap) if softcap else None, source=source)
    if not 0 <= out.mask_token_id < out.vocab_size:
        raise ConfigError(f"{source}: mask_token_id {out.mask_token_id} is outside the vocabulary ({out.vocab_size})")
    top = min(MAX_DEPTH + 1, MAX_BLOCK)
    if not 2 <= out.block_size <= top:
        raise ConfigError(f"{source}: block_size {out.block_size} outside 2..{top} (the tree builder's depth limit "
                          f"{MAX_DEPTH}, the attention kernel's {MAX_BLOCK} block rows)")
    if out.head_dim not in HEAD_DIMS:
        raise ConfigError(f"{source}: head_dim {out.head_dim}: the attention kernel is built for {HEAD_DIMS}")
    if out.num_attention_heads % out.num_key_value_heads:
        raise ConfigError(f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads")
    if not out.target_layer_ids:
        raise ConfigError(f"{source}: target_layer_ids is empty")
    return out


def load_dflash_config(path: str | Path) -> DFlashConfig:
    p = Path(path)
    p = p / "config.json" if p.is_dir() else p
    try:
        raw = json.loads(p.read_text())
    except OSError as e:
        raise ConfigError(f"{p}: cannot read ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: not valid JSON: {e}") from None
    return dflash_config_from_dict(raw, str(p))


def expected_tensors(c: DFlashConfig) -> list[TensorSpec]:
    h, d, i = c.hidden_size, c.head_dim, c.intermediate_size
    out = [TensorSpec("fc.weight", (h, len(c.target_layer_ids) * h), "BF16|F32"),
           TensorSpec("hidden_norm.weight", (h,), "BF16|F32"), TensorSpec("norm.weight", (h,), "BF16|F32")]
    for n in range(c.num_hidden_layers):
        p = f"layers.{n}."
        out += [TensorSpec(p + "input_layernorm.weight", (h,), "BF16|F32"),
                TensorSpec(p + "post_attention_layernorm.weight", (h,), "BF16|F32"),
                TensorSpec(p + "self_attn.q_proj.weight", (c.num_attention_heads * d, h), "BF16|F32"),
                TensorSpec(p + "self_attn.k_proj.weight", (c.num_key_value_heads * d, h), "BF16|F32"),
                TensorSpec(p + "self_attn.v_proj.weight", (c.num_key_value_heads * d, h), "BF16|F32"),
                TensorSpec(p + "self_attn.o_proj.weight", (h, c.num_attention_heads * d), "BF16|F32"),
                TensorSpec(p + "self_attn.q_norm.weight", (d,), "BF16|F32"),
                TensorSpec(p + "self_attn.k_norm.weight", (d,), "BF16|F32"),
                TensorSpec(p + "mlp.gate_proj.weight", (i, h), "BF16|F32"),
                TensorSpec(p + "mlp.up_proj.weight", (i, h), "BF16|F32"),
                TensorSpec(p + "mlp.down_proj.weight", (h, i), "BF16|F32")]
    return out


def check_pairing(c: DFlashConfig, target_cfg) -> None:
    """The drafter against its target, every mismatch named."""
    if c.hidden_size != target_cfg.hidden_size:
        raise ConfigError(f"{c.source}: hidden_size {c.hidden_size} != the target's {target_cfg.hidden_size}")
    if c.vocab_size != target_cfg.vocab_size:
        raise ConfigError(f"{c.source}: vocab_size {c.vocab_size} != the target's {target_cfg.vocab_size}")
    bad = [i for i in c.target_layer_ids if not 0 <= i < target_cfg.num_hidden_layers]
    if bad:
        raise ConfigError(f"{c.source}: target_layer_ids {bad} are not layers of the target (it has "
                          f"{target_cfg.num_hidden_layers}; a --layers slice keeps only the first ones)")


@dataclass
class DFlashLayer:
    input_norm: object
    post_norm: object
    wq: object
    wk: object
    wv: object
    wo: object
    q_norm: object
    k_norm: object
    w_gate_up: object  # [2I, H] = [gate; up]
    w_down: object


class DFlashModel:
    """Weights on the backend plus the target's embedding and lm_head. On a tensor-parallel target
    the drafter is split the same way (the target's shard and communicator): each rank holds its
    share of the q and kv heads (q / k / v rows, o_proj columns) and of the MLP intermediate, and
    all-reduces the fp32 partials of o_proj and down_proj; fc and the norms are whole."""

    def __init__(self, cfg: DFlashConfig, target, fc, hidden_norm, norm, layers: list[DFlashLayer]):
        self.cfg, self.target, self.backend = cfg, target, target.backend
        self.fc, self.hidden_norm, self.norm, self.layers = fc, hidden_norm, norm, layers
        n = target.shard.world
        self.q_heads, self.kv_heads = cfg.num_attention_heads // n, cfg.num_key_value_heads // n
        self.inv_freq = self.backend.asarray(rope_inv_freq(cfg.head_dim, cfg.rope.theta, cfg.rope.scaling()))
        self.scale = cfg.head_dim ** -0.5

    @classmethod
    def load(cls, directory: str | Path, target) -> DFlashModel:
        cfg = load_dflash_config(directory)
        check_pairing(cfg, target.cfg)
        reader = CheckpointReader(Path(directory) / "model.safetensors"
                                  if (Path(directory) / "model.safetensors").exists() else directory)
        try:
            reader.check(expected_tensors(cfg))
        except CheckpointError as e:
            raise CheckpointError(f"DFlash drafter {e}") from None
        from ml_dtypes import bfloat16

        be, shard = target.backend, target.shard
        try:
            q0, q1 = shard.part(cfg.num_attention_heads, "DFlash attention heads")
            k0, k1 = shard.part(cfg.num_key_value_heads, "DFlash key/value heads")
            i0, i1 = shard.part(cfg.intermediate_size, "DFlash intermediate_size")
        except ValueError as e:
            raise ConfigError(f"{cfg.source}: {e}") from None
        d = cfg.head_dim

        def host(name, axis=0, lo=None, hi=None):
            """Tensor ``name`` (this rank's [lo, hi) along ``axis``, when given) as host bf16."""
            a = reader.get(name) if lo is None or shard.world == 1 else reader.get_part(name, axis, lo, hi)
            return np.ascontiguousarray(np.asarray(a).astype(bfloat16))

        def get(name, axis=0, lo=None, hi=None):
            return be.asarray(host(name, axis, lo, hi))

        layers = []
        for n in range(cfg.num_hidden_layers):
            p = f"layers.{n}."
            a = p + "self_attn."
            gu = np.concatenate([host(p + f"mlp.{g}_proj.weight", 0, i0, i1) for g in ("gate", "up")])
            layers.append(DFlashLayer(get(p + "input_layernorm.weight"), get(p + "post_attention_layernorm.weight"),
                                      get(a + "q_proj.weight", 0, q0 * d, q1 * d),
                                      get(a + "k_proj.weight", 0, k0 * d, k1 * d),
                                      get(a + "v_proj.weight", 0, k0 * d, k1 * d),
                                      get(a + "o_proj.weight", 1, q0 * d, q1 * d),
                                      get(a + "q_norm.weight"), get(a + "k_norm.weight"),
                                      be.asarray(gu), get(p + "mlp.down_proj.weight", 1, i0, i1)))
        return cls(cfg, target, get("fc.weight"), get("hidden_norm.weight"), get("norm.weight"), layers)

    def _row_parallel(self, x, w):
        """x @ w^T where w is row-parallel: one rank's bf16 output, or on several ranks this rank's
        fp32 partial in the communicator's buffer (the target's ``add_norm`` reduces it)."""
        return self.backend.linear(x, w, out=self.target.partial_out((x.shape[0], w.shape[0])))

    # -- pieces -----------------------------------------------------------------------------------
    def _heads(self, x, w, norm, positions, heads: int):
        be, c = self.backend, self.cfg
        y = be.linear(x, w).reshape(x.shape[0] * heads, c.head_dim)
        y = be.rmsnorm(y, norm, c.rms_norm_eps).reshape(x.shape[0], heads, c.head_dim)
        return be.rope(be.xp.ascontiguousarray(y), positions, self.inv_freq, 0, c.head_dim, "half",
                       c.attention_factor)

    def context_kv(self, hidden: dict, positions):
        """Target hidden states {layer: [T, H]} of context rows at ``positions`` (backend int32 [T])
        -> per drafter layer (K [T, Hkv*D], V [T, Hkv*D]) bf16, k_norm'ed and RoPE'd."""
        be, c = self.backend, self.cfg
        missing = [i for i in c.target_layer_ids if i not in hidden]
        if missing:
            raise ValueError(f"DFlash context: hidden states of target layers {missing} were not given")
        feats = be.xp.ascontiguousarray(be.xp.concatenate([hidden[i] for i in c.target_layer_ids], axis=1))
        ctx = be.rmsnorm(be.linear(feats, self.fc), self.hidden_norm, c.rms_norm_eps)
        t, kv = ctx.shape[0], self.kv_heads
        return [(self._heads(ctx, layer.wk, layer.k_norm, positions, kv).reshape(t, kv * c.head_dim),
                 be.linear(ctx, layer.wv)) for layer in self.layers]

    def block_forward(self, tokens, positions, k_caches, v_caches, page_table, context_lens, context_starts,
                      whole: bool = True):
        """Block rows (backend int32 tokens / positions [B*Bs]) over the paged context K/V
        (per layer ``[pages, page_size, Hkv*D]``) -> logits [B, Bs-1, V] and final hidden [B*Bs, H].
        ``whole=False``: on several ranks, this rank's vocabulary slice of the logits [B, Bs-1, V/N]
        (the round's top-k then exchanges only (value, id) pairs)."""
        be, c = self.backend, self.cfg
        bs, hq, kv, d = c.block_size, self.q_heads, self.kv_heads, c.head_dim
        n = int(tokens.shape[0])
        b = n // bs
        h = be.embedding(tokens, self.target.embed)
        if c.input_embedding_scale != 1.0:
            h = (h.astype(be.xp.float32) * np.float32(c.input_embedding_scale)).astype(h.dtype)
        x = be.rmsnorm(h, self.layers[0].input_norm, c.rms_norm_eps)
        for i, layer in enumerate(self.layers):
            q = self._heads(x, layer.wq, layer.q_norm, positions, hq)
            k = self._heads(x, layer.wk, layer.k_norm, positions, kv)
            v = be.linear(x, layer.wv)
            kc, vc = k_caches[i], v_caches[i]
            a = be.gqa_attention(q.reshape(b, bs, hq, d), kc.reshape(kc.shape[0], kc.shape[1], kv, d),
                                 vc.reshape(vc.shape[0], vc.shape[1], kv, d), page_table, context_lens,
                                 k.reshape(b, bs, kv, d), v.reshape(b, bs, kv, d), self.scale, context_starts)
            o = self._row_parallel(a.reshape(n, hq * d), layer.wo)
            x, h = self.target.add_norm(o, layer.post_norm, h, c.rms_norm_eps)
            m = self._row_parallel(be.silu_mul(be.linear(x, layer.w_gate_up)), layer.w_down)
            nxt = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            x, h = self.target.add_norm(m, nxt, h, c.rms_norm_eps)
        rows = be.xp.ascontiguousarray(x.reshape(b, bs, -1)[:, 1:]).reshape(b * (bs - 1), -1)
        logits = self.target.head_logits(rows) if whole else self.target.head_shard(rows)
        if c.output_multiplier != 1.0 or c.final_logit_softcapping:
            z = logits.astype(be.xp.float32) * np.float32(c.output_multiplier)
            if c.final_logit_softcapping:
                cap = np.float32(c.final_logit_softcapping)
                z = be.xp.tanh(z / cap) * cap
            logits = z.astype(logits.dtype)
        return logits.reshape(b, bs - 1, -1), x


def _bf16():
    from ml_dtypes import bfloat16

    return bfloat16


def random_dflash_dict(target_cfg_name: str) -> dict:
    """config.json of the ``dflash-tiny`` / ``dflash-k2.6`` presets (paired with the tiny / k2.6 targets)."""
    if target_cfg_name == "dflash-k2.6":
        return dict(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=7168, num_hidden_layers=6,
                    num_attention_heads=64, num_key_value_heads=8, head_dim=128, intermediate_size=18432,
                    vocab_size=163840, rms_norm_eps=1e-5, rope_theta=50000.0, max_position_embeddings=262144,
                    rope_scaling={"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096},
                    attention_bias=False, block_size=8, num_target_layers=61,
                    dflash_config={"mask_token_id": 163838, "target_layer_ids": [1, 12, 24, 35, 47, 58]})
    if target_cfg_name == "dflash-tiny":
        return dict(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=256, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512,
                    vocab_size=1024, rms_norm_eps=1e-5, rope_theta=50000.0, max_position_embeddings=4096,
                    rope_scaling=None, attention_bias=False, block_size=8, num_target_layers=3,
                    dflash_config={"mask_token_id": 1023, "target_layer_ids": [0, 2]})
    raise ConfigError(f"unknown drafter preset {target_cfg_name!r} (dflash-tiny, dflash-k2.6)")


def make_dflash(preset: str, out: str | Path, seed: int = 0) -> Path:
    """A seeded random drafter in z-lab's format: config.json + one model.safetensors, bf16."""
    from ml_dtypes import bfloat16

    from .safetensors_io import write_file

    raw = random_dflash_dict(preset)
    cfg = dflash_config_from_dict(raw, f"<preset {preset}>")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {}
    for s in expected_tensors(cfg):
        if len(s.shape) == 1:
            t = 1.0 + 0.1 * rng.standard_normal(s.shape)
        else:
            t = rng.standard_normal(s.shape) * (s.shape[1] ** -0.5)
            if s.name.endswith(("o_proj.weight", "down_proj.weight")):
                t /= math.sqrt(2 * cfg.num_hidden_layers)
        tensors[s.name] = t.astype(np.float32).astype(bfloat16)
    write_file(out / "model.safetensors", tensors, {"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw, indent=1))
    return out
