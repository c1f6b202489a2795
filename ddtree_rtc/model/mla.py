"""The MLA layer pieces the target model assembles (docs/architecture.md §2), as functions over ``backend`` ops.

  query:   c_q = RMSNorm(x W_qa^T); q = c_q W_qb^T viewed [T, H, 192] = [q_nope | q_pe];
           q_att = [q_nope · W_UK[h] (512) | RoPE(q_pe) (64)]             -> [T, H, 576]
  kv row:  kv = x W_kva^T = [c | k_pe]; [RMSNorm(c) | RoPE(k_pe)]          -> [T, 576] (cache row)
  attend:  o_lat = softmax(scale · q_att · rows) rows[:, :512]             (mla_attention)
  output:  o[h] = o_lat[h] · W_UV[h]^T (128); out = concat_h(o) W_o^T
with ``kv_b_proj`` [H·(128+128), 512] viewed [H, 256, 512]: W_UK = [:, :128], W_UV = [:, 128:]. RoPE
rotates interleaved pairs (GPT-J style). Softmax scale = qk_head_dim^-0.5 · mscale², mscale from
YaRN's mscale_all_dim (0.14467963 for K2.6).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..reference.rope import yarn_mscale


@dataclass(frozen=True)
class MLADims:
    num_heads: int
    qk_nope: int = 128
    qk_rope: int = 64
    v_head: int = 128
    kv_lora: int = 512

    def __post_init__(self):
        if min(self.num_heads, self.qk_nope, self.qk_rope, self.v_head, self.kv_lora) < 1 or self.qk_rope % 2:
            raise ValueError(f"bad MLA dims {self}")

    @property
    def qk_head(self) -> int:
        return self.qk_nope + self.qk_rope

    @property
    def row(self) -> int:
        """Latent cache row width [c | k_pe] (576 for DeepSeek-V3 / K2.6, what the kernel takes)."""
        return self.kv_lora + self.qk_rope

    @classmethod
    def from_config(cls, cfg, num_heads: int | None = None) -> MLADims:
        """From a ModelConfig; ``num_heads`` overrides for a tensor-parallel rank's share."""
        return cls(num_heads or cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                   cfg.v_head_dim, cfg.kv_lora_rank)


@dataclass(frozen=True)
class MLAWeights:
    """One layer's attention weights as backend arrays (HF names in comments)."""

    q_b: Any  # q_b_proj [H*qk_head, q_lora] (or q_proj [H*qk_head, hidden] when q_a is None)
    kv_a: Any  # kv_a_proj_with_mqa [kv_lora + qk_rope, hidden]
    kv_a_norm: Any  # kv_a_layernorm [kv_lora]
    kv_b: Any  # kv_b_proj [H*(qk_nope + v_head), kv_lora]
    o: Any  # o_proj [hidden, H*v_head]
    q_a: Any = None  # q_a_proj [q_lora, hidden]
    q_a_norm: Any = None  # q_a_layernorm [q_lora]

    def w_uk(self, dims: MLADims):
        """[H, qk_nope, kv_lora] view of kv_b: q_lat[h] = q_nope[h] @ W_UK[h]."""
        return self.kv_b.reshape(dims.num_heads, dims.qk_nope + dims.v_head, dims.kv_lora)[:, :dims.qk_nope]

    def w_uv(self, dims: MLADims):
        """[H, v_head, kv_lora] view of kv_b: o[h] = o_lat[h] @ W_UV[h]^T."""
        return self.kv_b.reshape(dims.num_heads, dims.qk_nope + dims.v_head, dims.kv_lora)[:, dims.qk_nope:]


def fused_rows(dims: MLADims) -> bool:
    """Whether the small-M path's one-launch query and cache-row kernels (kernels/mla_small.py) take
    these dims: the 512 + 64 latent row, q_nope a multiple of 4."""
    return dims.kv_lora == 512 and dims.qk_rope == 64 and dims.qk_nope % 4 == 0


def softmax_scale(qk_head_dim: int, rope_scaling: dict | None = None) -> float:
    """qk_head_dim^-0.5 · mscale², mscale = yarn_mscale(factor, mscale_all_dim) when YaRN gives one."""
    scale = qk_head_dim ** -0.5
    if rope_scaling and rope_scaling.get("mscale_all_dim"):
        m = yarn_mscale(float(rope_scaling["factor"]), float(rope_scaling["mscale_all_dim"]))
        scale *= m * m
    return scale


def rope_scale(rope_scaling: dict | None = None) -> float:
    """DeepSeek-V3 YaRN's factor on cos/sin: mscale(factor, mscale) / mscale(factor, mscale_all_dim)
    (1 for K2.6, where both are 1)."""
    if not rope_scaling or rope_scaling.get("type", rope_scaling.get("rope_type")) != "yarn":
        return 1.0
    factor = float(rope_scaling["factor"])
    return yarn_mscale(factor, float(rope_scaling.get("mscale", 1) or 1)) / yarn_mscale(
        factor, float(rope_scaling.get("mscale_all_dim", 0) or 0))


def mla_query(backend, x, w: MLAWeights, dims: MLADims, positions, inv_freq, eps: float, rope_scale: float = 1.0,
              impl: str = "auto"):
    """x [T, hidden] bf16 -> absorbed query [T, H, kv_lora + qk_rope] bf16. ``impl``: the linears'
    kernel choice (``backend.linear``; 'invariant' on the small-M path)."""
    t, h = x.shape[0], dims.num_heads
    cq = x if w.q_a is None else backend.rmsnorm(backend.linear(x, w.q_a, impl=impl), w.q_a_norm, eps)
    q = backend.linear(cq, w.q_b, impl=impl).reshape(t, h, dims.qk_head)
    return absorb_query(backend, q, w.w_uk(dims), dims, positions, inv_freq, rope_scale, impl)


def absorb_query(backend, q, w_uk, dims: MLADims, positions, inv_freq, rope_scale: float = 1.0, impl: str = "auto",
                 out=None):
    """The general path's absorbed query from q [T, H, qk_nope + qk_rope]: [q_nope · W_UK[h] | RoPE(q_pe)]
    [T, H, kv_lora + qk_rope] bf16 in three launches (the head GEMM, the q_pe copy, the RoPE); the
    small-M path does the same in one (``mla_query_small``)."""
    t, h = q.shape[0], dims.num_heads
    q_att = backend.empty((t, h, dims.row), "bf16") if out is None else out
    backend.mla_head_gemm(q[:, :, :dims.qk_nope], w_uk, False, out=q_att[:, :, :dims.kv_lora], impl=impl)
    q_att[:, :, dims.kv_lora:] = q[:, :, dims.qk_nope:]
    return backend.rope(q_att, positions, inv_freq, dims.kv_lora, dims.qk_rope, "interleaved", rope_scale)


def mla_kv_rows(backend, x, w: MLAWeights, dims: MLADims, positions, inv_freq, eps: float,
                rope_scale: float = 1.0, impl: str = "auto"):
    """x [T, hidden] bf16 -> cache rows [T, kv_lora + qk_rope] = [RMSNorm(c) | RoPE(k_pe)] bf16."""
    kv = backend.linear(x, w.kv_a, impl=impl)
    c = backend.xp.ascontiguousarray(kv[:, :dims.kv_lora])
    kv[:, :dims.kv_lora] = backend.rmsnorm(c, w.kv_a_norm, eps)
    return backend.rope(kv, positions, inv_freq, dims.kv_lora, dims.qk_rope, "interleaved", rope_scale)


def _small_query_and_rows(backend, x, w: MLAWeights, dims: MLADims, positions, inv_freq, eps: float, cache, slots,
                          rope_scale: float):
    """The small-M path's query and cache rows in three launches instead of ten: q_a and kv_a in one,
    the q_a norm with q_b in one, the absorbed query with its RoPE and the cache rows (norm, RoPE,
    write) in one. Same numbers as ``mla_query`` + ``mla_kv_rows`` on numpy (the twins compose them)."""
    t, h = x.shape[0], dims.num_heads
    qa, kv = backend.mla_qkv_a_small(x, w.q_a, w.kv_a)
    q = backend.norm_linear(qa, w.q_a_norm, eps, w.q_b).reshape(t, h, dims.qk_head)
    return backend.mla_query_small(q, w.w_uk(dims), positions, inv_freq, rope_scale,
                                   rows=(kv, w.kv_a_norm, eps, cache, slots))


def mla_output(backend, o_lat, w: MLAWeights, dims: MLADims, out=None, impl: str = "auto"):
    """o_lat [T, H, kv_lora] bf16 -> attention output [T, hidden] bf16 (W_UV expansion, then o_proj);
    into ``out`` when given (fp32: a tensor-parallel rank's unrounded partial)."""
    t = o_lat.shape[0]
    o = backend.mla_head_gemm(o_lat, w.w_uv(dims), True, impl=impl)
    return backend.linear(o.reshape(t, dims.num_heads * dims.v_head), w.o, out=out, impl=impl)


def mla_forward(backend, x, w: MLAWeights, dims: MLADims, positions, inv_freq, eps: float, cache, slots, plan,
                scale: float, rope_scale: float = 1.0, out=None, impl: str = "auto"):
    """One MLA attention block for the new tokens ``x`` of a planned batch: their cache rows are
    written at ``slots`` of ``cache`` (one layer) first, then every token attends as ``plan`` says.
    ``impl``: the linears' kernel choice ('invariant' on the small-M path)."""
    if impl == "invariant" and fused_rows(dims) and w.q_a is not None:
        q_att = _small_query_and_rows(backend, x, w, dims, positions, inv_freq, eps, cache, slots, rope_scale)
    else:
        q_att = mla_query(backend, x, w, dims, positions, inv_freq, eps, rope_scale, impl)
        backend.kv_cache_write(cache, mla_kv_rows(backend, x, w, dims, positions, inv_freq, eps, rope_scale, impl),
                               slots)
    o_lat, _ = backend.mla_attention(plan, q_att, cache, scale)
    return mla_output(backend, o_lat, w, dims, out, impl)
