"""The DeepSeek-V3 / Kimi K2 MoE layer: router, noaux_tc routing, INT4 routed experts and the bf16
shared expert, on either backend:

    y = sum_i w_i * E_i(x) + shared(x),   E(x) = down(silu(gate(x)) * up(x))
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..reference.moe_routing import check_route_args
from ..reference.moe_small import ROUTE_SHARED_MAX_EXPERTS
from .checkpoint import BIAS_DTYPES, ROUTER_DTYPES, CheckpointError, CheckpointReader
from .int4_repack import GROUP, TILE_K, Int4Experts, prepare_experts
from .quant import INT4_GROUP32, Int4Scheme, expert_prefix, load_moe_experts
from .shard import Shard


@dataclass(frozen=True)
class RoutingConfig:
    num_experts: int
    top_k: int
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0

    def __post_init__(self):
        check_route_args(self.num_experts, self.top_k, self.n_group, self.topk_group)
        if not np.isfinite(self.routed_scaling_factor):
            raise ValueError(f"routed_scaling_factor must be finite, got {self.routed_scaling_factor}")

    @classmethod
    def from_config(cls, config: dict, source: str = "config.json") -> RoutingConfig:
        """From a DeepSeek-V3 / Kimi K2 config (the text model's fields, or a whole config with
        ``text_config``). Only sigmoid scoring with noaux_tc top-k is supported."""
        c = config.get("text_config", config)
        for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
            got = c.get(key, want)
            if got != want:
                raise ValueError(f"{source}: {key}={got!r} is not supported (only {want!r})")
        try:
            return cls(int(c["n_routed_experts"]), int(c["num_experts_per_tok"]), int(c.get("n_group") or 1),
                       int(c.get("topk_group") or 1), bool(c.get("norm_topk_prob", True)),
                       float(c.get("routed_scaling_factor", 1.0)))
        except KeyError as e:
            raise ValueError(f"{source}: missing MoE field {e.args[0]!r}") from None


@dataclass
class MoELayerWeights:
    """One MoE layer's weights, already in the form the backend wants (see ``prepare_experts``).
    gate_weight bf16 or fp32 [E, H]; e_score_correction_bias fp32 [E] or None; shared_w13 bf16 [2*Is, H] =
    [gate; up] and shared_w2 bf16 [H, Is], or both None. An expert-parallel shard holds experts
    [expert_offset, expert_offset + experts.num_experts) of the router's E."""

    gate_weight: object
    e_score_correction_bias: object
    experts: Int4Experts
    shared_w13: object = None
    shared_w2: object = None
    expert_offset: int = 0

    @property
    def num_experts(self) -> int:
        """Routed experts of the whole layer (the router's rows), not only this shard's."""
        return int(self.gate_weight.shape[0])

    @property
    def is_expert_shard(self) -> bool:
        return self.experts.num_experts != self.num_experts

    def __post_init__(self):
        e, h, local = self.num_experts, self.experts.hidden, self.experts.num_experts
        if self.gate_weight.ndim != 2 or self.gate_weight.shape[1] != h or e < local:
            raise ValueError(f"gate_weight: expected [{local}, {h}] (or [E, {h}] of a router over more "
                             f"experts on an expert-parallel shard), got {tuple(self.gate_weight.shape)}")
        if not 0 <= self.expert_offset <= e - local:
            raise ValueError(f"experts {self.expert_offset}..{self.expert_offset + self.experts.num_experts - 1} "
                             f"are not experts of a router over {e}")
        bias = self.e_score_correction_bias
        if bias is not None and (tuple(bias.shape) != (e,) or bias.dtype != np.float32):
            raise ValueError(f"e_score_correction_bias: expected fp32 [{e}], got {bias.dtype} {tuple(bias.shape)}")
        if (self.shared_w13 is None) != (self.shared_w2 is None):
            raise ValueError("shared expert: give both shared_w13 and shared_w2, or neither")
        if self.shared_w13 is not None:
            i2 = self.shared_w13.shape[0]
            if i2 % 2 or tuple(self.shared_w13.shape) != (i2, h) or tuple(self.shared_w2.shape) != (h, i2 // 2):
                raise ValueError(f"shared expert: expected w13 [2*Is, {h}] and w2 [{h}, Is], got "
                                 f"{tuple(self.shared_w13.shape)} and {tuple(self.shared_w2.shape)}")


def moe(x, layer_weights: MoELayerWeights, routing_config: RoutingConfig, backend, plan=None, out=None,
        shared_out=None, small: bool = False, invariant: bool = True):
    """x [M, H] bf16 -> y [M, H] bf16. ``plan``/``out`` (CUDA) make the call allocation-free for graph capture; see
    ``ddtree_rtc.kernels.moe_gemm.moe_plan``. ``small`` (M <= 64, the small-M path): the experts run
    ``moe_small_experts`` (``plan`` from ``moe_small_plan``), and with ``invariant`` the router (when bf16) and the
    shared expert run the row-invariant linear, so each token's output is the same bits whatever M is (the router
    with the shared gate_up in ``moe_small_dense``, the routing with the shared down in ``moe_small_route_shared``,
    up to 384 experts). On a tensor- or expert-parallel shard y is this rank's partial sum (its experts' or
    intermediate slice's share plus its share of the shared expert), unrounded fp32 when ``out`` is fp32; the caller
    all-reduces it. With ``shared_out`` (fp32 [M, H]) the shared expert's partial goes there instead of into y, so
    the caller can round its sum to bf16 before adding it, as one rank's combine does."""
    lw, rc = layer_weights, routing_config
    if x.ndim != 2 or x.shape[0] == 0:
        raise ValueError(f"x: expected [M >= 1, H] tokens, got shape {tuple(x.shape)}")
    if rc.num_experts != lw.num_experts:
        raise ValueError(f"routing config has {rc.num_experts} experts, the layer weights {lw.num_experts}")
    impl = "invariant" if small and invariant else "auto"
    hs = None  # the shared expert's SiLU(gate) * up, when the dense launch made it
    if impl == "invariant" and lw.gate_weight.dtype != np.float32 and lw.shared_w13 is not None and \
            lw.num_experts % 8 == 0 and lw.shared_w13.shape[0] % 8 == 0:
        logits, hs = backend.moe_small_dense(x, lw.gate_weight, lw.shared_w13)
    elif impl == "invariant" and lw.gate_weight.dtype != np.float32:
        logits = backend.linear(x, lw.gate_weight, out=backend.empty((x.shape[0], lw.num_experts), "fp32"),
                                impl=impl)
    else:
        logits = backend.router_logits(x, lw.gate_weight)
    bias, route = lw.e_score_correction_bias, (rc.top_k, rc.n_group, rc.topk_group, rc.norm_topk_prob,
                                               rc.routed_scaling_factor)
    shared = None
    if hs is not None and lw.num_experts <= ROUTE_SHARED_MAX_EXPERTS:
        # the routing and the shared expert's down projection, independent, in one launch
        ids, w, shared = backend.moe_small_route_shared(logits, bias, hs, lw.shared_w2, *route, out=shared_out)
    else:
        ids, w = backend.moe_route(logits, bias, *route)
        if lw.shared_w13 is not None:
            if hs is None:
                hs = backend.silu_mul(backend.linear(x, lw.shared_w13, impl=impl))
            shared = backend.linear(hs, lw.shared_w2, out=shared_out, impl=impl)
        elif shared_out is not None:
            shared_out[...] = 0
    if lw.is_expert_shard and not small:  # ids of other ranks' experts fall outside [0, local E): nothing
        ids = ids - backend.xp.int32(lw.expert_offset)
    if small:
        return backend.moe_small_experts(x, ids, w, lw.experts, shared=None if shared_out is not None else shared,
                                         out=out, plan=plan, check_ids=False, id_offset=lw.expert_offset)
    return backend.moe_experts(x, ids, w, lw.experts, shared=None if shared_out is not None else shared, out=out,
                               plan=plan, check_ids=False)


def to_backend(backend, a):
    """A host array onto the backend (backend.asarray); an array already on the device (a dummy
    load makes its tensors there) as it is."""
    return backend.asarray(a) if isinstance(a, np.ndarray) else a


def load_moe_layer(ckpt: CheckpointReader, layer: int, routing: RoutingConfig, hidden: int,
                   intermediate: int, backend, scheme: Int4Scheme = INT4_GROUP32,
                   shard: Shard | None = None) -> MoELayerWeights:
    """Router, correction bias, INT4 routed experts and the bf16 shared expert of one layer (of
    ``shard``'s part: its experts or intermediate slice, its slice of the shared expert)."""
    shard = shard or Shard()
    stem = expert_prefix(ckpt, layer)[: -len("experts.")]  # "[language_model.]model.layers.N.mlp."

    def check(name: str, shape: tuple, dtypes: str) -> None:
        got_dt, got_shape = ckpt.info(name)
        if got_dt not in dtypes.split("|") or got_shape != shape:
            want = " or ".join(dtypes.split("|"))
            raise CheckpointError(f"{name} in {ckpt.file_of(name).name}: {got_dt} {list(got_shape)}, "
                                  f"expected {want} {list(shape)}")

    def dense(name: str, shape: tuple, dtypes: str) -> np.ndarray:
        check(name, shape, dtypes)
        return ckpt.get(name)

    e = routing.num_experts

    def dev(a):
        return to_backend(backend, a)

    # the router may be stored bf16 or fp32 (kept as stored: its logits are fp32 either way); the bias
    # fp32 or bf16 (widened to fp32, exactly, for the routing kernel)
    gate = dev(dense(stem + "gate.weight", (e, hidden), ROUTER_DTYPES))
    bias_name = stem + "gate.e_score_correction_bias"
    bias = dense(bias_name, (e,), BIAS_DTYPES) if bias_name in ckpt else None
    if bias is not None:
        bias = backend.from_bf16(dev(bias)) if bias.dtype != np.float32 else dev(bias)
    mine = shard.experts(e)
    inter_part = shard.expert_intermediate(intermediate, TILE_K if backend.is_cuda else GROUP)
    if hasattr(ckpt, "moe_experts"):  # a DummySource makes a layer's experts at once
        experts = ckpt.moe_experts(layer, mine, inter_part)
    else:
        experts = load_moe_experts(ckpt, layer, e, hidden, intermediate, scheme, experts=mine, inter_part=inter_part)
    w13 = w2 = None
    if stem + "shared_experts.down_proj.weight" in ckpt:
        _, (_, inter_s) = ckpt.info(stem + "shared_experts.down_proj.weight")
        for proj, shape in (("gate_proj", (inter_s, hidden)), ("up_proj", (inter_s, hidden)),
                            ("down_proj", (hidden, inter_s))):
            check(stem + f"shared_experts.{proj}.weight", shape, "BF16")
        lo, hi = shard.part(inter_s, "shared expert intermediate")
        g, u = (dev(ckpt.get_part(stem + f"shared_experts.{p}.weight", 0, lo, hi)) for p in ("gate_proj", "up_proj"))
        w13 = backend.xp.concatenate([g, u])
        w2 = dev(ckpt.get_part(stem + "shared_experts.down_proj.weight", 1, lo, hi))
    return MoELayerWeights(gate, bias, prepare_experts(experts, backend), w13, w2, mine.start)
