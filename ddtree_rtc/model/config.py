"""Target-model config: DeepseekV3 / Kimi K2 / K2.5 / K2.6 ``config.json`` -> a frozen dataclass.

K2.5/K2.6 nest the language model under ``text_config``; rope scaling arrives as ``rope_scaling``
(legacy) or ``rope_parameters`` (newer transformers). Invariants are checked at construction and
every error names the file and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "kimi_k2")


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    kind: str = "default"  # default | yarn
    factor: float = 1.0
    original_max_position: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    def scaling(self) -> dict | None:
        """The HF-style rope_scaling dict that ``reference.rope.rope_inv_freq`` and
        ``model.mla.softmax_scale`` / ``rope_scale`` take (None for plain RoPE)."""
        if self.kind != "yarn":
            return None
        return {"type": "yarn", "factor": self.factor,
                "original_max_position_embeddings": self.original_max_position,
                "beta_fast": self.beta_fast, "beta_slow": self.beta_slow,
                "mscale": self.mscale, "mscale_all_dim": self.mscale_all_dim}


@dataclass(frozen=True)
class ModelConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    first_k_dense_replace: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    scoring_func: str
    topk_method: str
    vocab_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    tie_word_embeddings: bool = False
    quantization: dict | None = field(default=None, compare=False)
    source: str = field(default="<dict>", compare=False)

    def __post_init__(self):
        def bad(what):
            raise ConfigError(f"{self.source}: {what}")

        for f in ("hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                  "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "vocab_size",
                  "moe_intermediate_size", "num_experts_per_tok"):
            if int(getattr(self, f)) <= 0:
                bad(f"{f} must be positive, got {getattr(self, f)}")
        # The latent cache row [c | k_pe] is 576 wide in every DeepSeek-V3 / K2 model, and the MLA kernels
        # and the attention path are built for exactly that row: refuse other widths here, not in a forward.
        for f, want in (("kv_lora_rank", 512), ("qk_rope_head_dim", 64)):
            if int(getattr(self, f)) != want:
                bad(f"{f} {getattr(self, f)} is not supported: the MLA path needs {f} = {want} "
                    f"(every DeepSeek-V3 / Kimi K2 model)")
        if self.n_routed_experts and self.num_experts_per_tok > self.n_routed_experts:
            bad(f"num_experts_per_tok {self.num_experts_per_tok} > n_routed_experts {self.n_routed_experts}")
        if self.n_routed_experts % max(self.n_group, 1):
            bad(f"n_routed_experts {self.n_routed_experts} not divisible by n_group {self.n_group}")
        if not 1 <= self.topk_group <= max(self.n_group, 1):
            bad(f"topk_group must be in [1, n_group={self.n_group}], got {self.topk_group}")
        if self.scoring_func != "sigmoid":
            bad(f"scoring_func {self.scoring_func!r} is not supported (only 'sigmoid', DeepSeek-V3 noaux_tc)")
        if self.topk_method not in ("noaux_tc",):
            bad(f"topk_method {self.topk_method!r} is not supported (only 'noaux_tc')")
        if self.first_k_dense_replace > self.num_hidden_layers:
            bad(f"first_k_dense_replace {self.first_k_dense_replace} > num_hidden_layers")

    # -- derived -------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """One latent cache row per token: [c (kv_lora_rank) | k_pe (qk_rope_head_dim)]."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5 · mscale² with mscale from YaRN's mscale_all_dim (0.14467963 for K2.6)."""
        from .mla import softmax_scale

        return softmax_scale(self.qk_head_dim, self.rope.scaling())

    def is_moe_layer(self, i: int) -> bool:
        return self.n_routed_experts > 0 and i >= self.first_k_dense_replace

    def with_layers(self, n: int) -> ModelConfig:
        if not 1 <= n <= self.num_hidden_layers:
            raise ConfigError(f"{self.source}: cannot keep {n} of {self.num_hidden_layers} layers")
        return replace(self, num_hidden_layers=n, first_k_dense_replace=min(self.first_k_dense_replace, n))

    def to_hf_dict(self) -> dict:
        """A DeepseekV3 config.json dict (what ``make-model`` writes)."""
        rope_scaling = None
        if self.rope.kind == "yarn":
            rope_scaling = {"type": "yarn", "rope_type": "yarn", "factor": self.rope.factor,
                            "original_max_position_embeddings": self.rope.original_max_position,
                            "beta_fast": self.rope.beta_fast, "beta_slow": self.rope.beta_slow,
                            "mscale": self.rope.mscale, "mscale_all_dim": self.rope.mscale_all_dim}
        d = {f.name: getattr(self, f.name) for f in fields(self)
             if f.name not in ("rope", "quantization", "source")}
        d.update(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
                 rope_theta=self.rope.theta, rope_scaling=rope_scaling, moe_layer_freq=1,
                 hidden_act="silu", attention_bias=False,
                 attention_dropout=0.0, initializer_range=0.02, torch_dtype="bfloat16", use_cache=True,
                 ep_size=1, num_key_value_heads=self.num_attention_heads)
        if self.quantization is not None:
            d["quantization_config"] = self.quantization
        return d


_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
             "qk_rope_head_dim", "v_head_dim", "vocab_size")


def _rope(d: dict, source: str) -> RopeConfig:
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    if params and not scaling and params.get("rope_type", params.get("type", "default")) != "default":
        scaling = params
    theta = d.get("rope_theta", params.get("rope_theta"))
    if theta is None:
        raise ConfigError(f"{source}: missing rope_theta (top level or in rope_parameters)")
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind not in ("default", "yarn"):
        raise ConfigError(f"{source}: rope scaling type {kind!r} is not supported (default or yarn)")
    if kind == "default":
        return RopeConfig(theta=float(theta))
    try:
        return RopeConfig(theta=float(theta), kind="yarn", factor=float(scaling["factor"]),
                          original_max_position=int(scaling.get("original_max_position_embeddings", 4096)),
                          beta_fast=float(scaling.get("beta_fast", 32)),
                          beta_slow=float(scaling.get("beta_slow", 1)),
                          mscale=float(scaling.get("mscale", 1) or 1),
                          mscale_all_dim=float(scaling.get("mscale_all_dim", 0) or 0))
    except KeyError as e:
        raise ConfigError(f"{source}: yarn rope scaling lacks {e.args[0]!r}") from None


def _first_id(v):
    return v[0] if isinstance(v, list) and v else v


_NUMERIC_FIELDS = {**{k: int for k in (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "intermediate_size", "moe_intermediate_size", "n_routed_experts",
    "num_experts_per_tok", "n_shared_experts", "first_k_dense_replace", "n_group", "topk_group", "vocab_size",
    "max_position_embeddings")}, "routed_scaling_factor": (int, float), "rms_norm_eps": (int, float)}


def config_from_dict(raw: dict, source: str = "<dict>") -> ModelConfig:
    d = raw.get("text_config") or raw
    mt = d.get("model_type", raw.get("model_type"))
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"{source}: model_type {mt!r} is not supported; expected one of "
                          f"{', '.join(SUPPORTED_MODEL_TYPES)} (DeepSeek-V3 architecture)")
    missing = [k for k in _REQUIRED if k not in d]
    if missing:
        raise ConfigError(f"{source}: missing field(s) {', '.join(missing)}")
    for k, v in d.items():  # name the key a wrong-typed value sits at (int("abc") names none)
        kind = _NUMERIC_FIELDS.get(k)
        if kind is not None and v is not None and (isinstance(v, bool) or not isinstance(v, kind)):
            want = "an integer" if kind is int else "a number"
            raise ConfigError(f"{source}: {k} must be {want}, got {v!r}")
    n_routed = int(d.get("n_routed_experts") or 0)
    try:
        return ModelConfig(
            hidden_size=int(d["hidden_size"]), num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=int(d["num_attention_heads"]),
            q_lora_rank=None if d.get("q_lora_rank") is None else int(d["q_lora_rank"]),
            kv_lora_rank=int(d["kv_lora_rank"]), qk_nope_head_dim=int(d["qk_nope_head_dim"]),
            qk_rope_head_dim=int(d["qk_rope_head_dim"]), v_head_dim=int(d["v_head_dim"]),
            intermediate_size=int(d.get("intermediate_size", 0)),
            moe_intermediate_size=int(d.get("moe_intermediate_size", 0) or 0) or 1,
            n_routed_experts=n_routed, num_experts_per_tok=int(d.get("num_experts_per_tok") or 1),
            n_shared_experts=int(d.get("n_shared_experts") or 0),
            first_k_dense_replace=int(d.get("first_k_dense_replace", 0)),
            n_group=int(d.get("n_group") or 1), topk_group=int(d.get("topk_group") or 1),
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
            scoring_func=d.get("scoring_func", "sigmoid"), topk_method=d.get("topk_method", "noaux_tc"),
            vocab_size=int(d["vocab_size"]), rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope=_rope(d, source), max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            bos_token_id=_first_id(d.get("bos_token_id", raw.get("bos_token_id"))),
            eos_token_id=_first_id(d.get("eos_token_id", raw.get("eos_token_id"))),
            pad_token_id=_first_id(d.get("pad_token_id", raw.get("pad_token_id"))),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            quantization=d.get("quantization_config", raw.get("quantization_config")), source=source)
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{source}: {e}") from None


def load_config(path: str | Path) -> ModelConfig:
    """Read ``config.json`` (or the model directory holding it)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        raw = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such file (expected a model directory with config.json)") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: not valid JSON: {e}") from None
    return config_from_dict(raw, str(p))


def _preset(**kw) -> dict:
    base = dict(model_type="deepseek_v3", hidden_size=7168, num_hidden_layers=61, num_attention_heads=64,
                q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                v_head_dim=128, intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=384,
                num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.827, scoring_func="sigmoid",
                topk_method="noaux_tc", vocab_size=163840, rms_norm_eps=1e-5, rope_theta=50000.0,
                rope_scaling={"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                              "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
                max_position_embeddings=262144, bos_token_id=163584, eos_token_id=163585,
                pad_token_id=163839, tie_word_embeddings=False)
    base.update(kw)
    return base


# Presets for make-model and tests: K2.6's exact dims, and small shapes that keep its structure.
PRESETS = {
    "k2.6": _preset(),
    "small": _preset(hidden_size=1024, num_hidden_layers=4, num_attention_heads=16, q_lora_rank=384,
                     kv_lora_rank=512, intermediate_size=2048, moe_intermediate_size=256,
                     n_routed_experts=64, num_experts_per_tok=8, vocab_size=32768, bos_token_id=1,
                     eos_token_id=2, pad_token_id=0, max_position_embeddings=16384),
    # tiny keeps the latent row at 512 + 64 and MoE dims at multiples of 128 so the CUDA kernels run it too
    "tiny": _preset(hidden_size=256, num_hidden_layers=3, num_attention_heads=4, q_lora_rank=96,
                    kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
                    intermediate_size=512, moe_intermediate_size=128, n_routed_experts=16,
                    num_experts_per_tok=4, n_group=4, topk_group=2, vocab_size=1024, bos_token_id=1,
                    eos_token_id=2, pad_token_id=0, max_position_embeddings=4096),
}


def preset_config(name: str) -> ModelConfig:
    try:
        return config_from_dict(PRESETS[name], f"<preset {name}>")
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}") from None
