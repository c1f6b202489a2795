"""The DeepSeek-V3 / Kimi K2.x target model on a backend: weights, and one forward over a batch of
requests, each with any number of new tokens, per-token RoPE positions and an optional per-token
ancestor bitmask (tree verify). Returns logits (or only their argmax) for the rows asked for, and
the hidden states after the layers asked for (the drafter's context features).

Forward, per layer, with the residual add fused into the following RMSNorm:
    a = MLA(norm_in(h)); h += a; m = MLP(norm_post(h)); h += m       (MLP = dense or MoE + shared)

On a tensor-parallel rank (``shard``, docs/architecture.md "Parallelism") ``a`` and ``m`` are this
rank's fp32 partial sums, all-reduced once each (one collective per sublayer) and then rounded to
bf16 once; the lm_head holds a slice of the vocabulary and the logits are all-gathered, so every
rank sees the full logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..parallel.comm import Communicator, SingleRank
from ..reference.moe_small import check_small_shape
from ..reference.rope import rope_inv_freq
from .checkpoint import CheckpointReader, expected_tensors
from .config import ModelConfig, load_config
from .int4_repack import GROUP, TILE_K
from .mla import MLADims, MLAWeights, mla_forward, rope_scale
from .moe import MoELayerWeights, RoutingConfig, load_moe_layer, moe, to_backend
from .shard import Shard

SMALL_M_MAX_TOKENS = 64  # the small-M path's rows (an AR batch or a whole tree verify)

# HF DeepseekV3 (and DeepSeek's own code) build the q_a / kv_a norms with the default eps, not the config's.
LATENT_NORM_EPS = 1e-6


def _routing(cfg: ModelConfig) -> RoutingConfig | None:
    if not cfg.n_routed_experts:
        return None
    return RoutingConfig(cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
                         cfg.norm_topk_prob, cfg.routed_scaling_factor)


@dataclass
class DenseMLP:
    w13: Any  # [2*I, H] = [gate; up]
    w2: Any  # [H, I]


@dataclass
class Layer:
    input_norm: Any
    post_norm: Any
    attn: MLAWeights
    mlp: DenseMLP | MoELayerWeights


@dataclass
class ForwardBatch:
    """New tokens of a batch of requests, grouped by request in order.

    ``ctx_lens[r]``: tokens of request r already in the cache; its new token j is written at cache
    position ctx_lens[r] + j. ``positions``: RoPE positions (ctx + j for prompts and decode, prefix +
    depth for tree nodes). ``tree_mask``: uint64 [T, words] ancestor bitmask rows over each request's
    new tokens, or None for causal. ``logit_rows``: the token rows that need logits (None: all).
    A tree verify planned by the model runner has ``tokens`` and ``positions`` None and a device
    ``tree_mask``: all three are filled on the device from the tree (engine.runner)."""

    seq_ids: list
    ctx_lens: np.ndarray
    num_new: np.ndarray
    tokens: np.ndarray | None
    positions: np.ndarray | None
    tree_mask: Any = None
    logit_rows: np.ndarray | None = None

    def __post_init__(self):
        self.ctx_lens = np.asarray(self.ctx_lens, dtype=np.int64)
        self.num_new = np.asarray(self.num_new, dtype=np.int64)
        t = int(self.num_new.sum())
        if len(self.seq_ids) != len(self.ctx_lens) or len(self.num_new) != len(self.ctx_lens):
            raise ValueError("seq_ids, ctx_lens and num_new must have one entry per request")
        if self.tokens is None and self.positions is None:
            return  # filled on the device
        self.tokens = np.asarray(self.tokens, dtype=np.int32)
        self.positions = np.asarray(self.positions, dtype=np.int32)
        if self.tokens.shape != (t,) or self.positions.shape != (t,):
            raise ValueError(f"tokens and positions must be [{t}] (sum of num_new), got "
                             f"{self.tokens.shape} and {self.positions.shape}")

    @classmethod
    def causal(cls, seq_ids, ctx_lens, new_tokens: list[list[int]], last_only: bool = True) -> ForwardBatch:
        """Prompts / decode steps: positions continue each request's context; logits for each
        request's last new token (or every token)."""
        num_new = np.array([len(t) for t in new_tokens], dtype=np.int64)
        pos = np.concatenate([np.arange(c, c + n) for c, n in zip(ctx_lens, num_new)]).astype(np.int32)
        rows = np.cumsum(num_new) - 1 if last_only else None
        return cls(list(seq_ids), np.asarray(ctx_lens), num_new, np.concatenate(new_tokens), pos, None, rows)


@dataclass
class ForwardOutput:
    logits: Any = None  # backend bf16 [R, V] (when asked for)
    tokens: Any = None  # backend int32 [R] argmax (when asked for)
    hidden: dict | None = None  # layer index -> backend bf16 [T, H] residual stream after that layer


@dataclass
class StepInputs:
    """A prepared batch on the device: what ``TargetModel.run`` reads (see ``prepare``)."""

    batch: ForwardBatch
    tokens: Any  # int32 [T]
    positions: Any  # int32 [T]
    slots: Any  # int32 [T] cache slots of the new tokens
    plan: Any  # the attention plan
    logit_rows: Any = None  # int64 [R] token rows that get logits, or None (all)


class TargetModel:
    def __init__(self, cfg: ModelConfig, backend, embed, layers: list[Layer], final_norm, lm_head,
                 shard: Shard | None = None, comm: Communicator | None = None, small_m_path: bool = True,
                 batch_invariant: bool = True):
        """``shard``: the part of the model these weights are (whole by default); ``comm``: the
        communicator of its ranks (``shard.world`` of them). ``small_m_path`` / ``batch_invariant``:
        see ``small_m`` (the pipeline keys runtime.small_m_path / runtime.batch_invariant)."""
        self.cfg, self.backend = cfg, backend
        self.small_m_path, self.batch_invariant = bool(small_m_path), bool(batch_invariant)
        self._small_fits: dict[int, bool] = {}
        self.embed, self.layers, self.final_norm, self.lm_head = embed, layers, final_norm, lm_head
        self.shard, self.comm = shard or Shard(), comm or SingleRank()
        if self.comm.world_size != self.shard.world or self.comm.rank != self.shard.rank:
            raise ValueError(f"shard rank {self.shard.rank} of {self.shard.world} but communicator rank "
                             f"{self.comm.rank} of {self.comm.world_size}")
        self.dims = MLADims.from_config(cfg, cfg.num_attention_heads // self.shard.world)
        self.inv_freq = backend.asarray(rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope.theta, cfg.rope.scaling()))
        self.rope_scale = rope_scale(cfg.rope.scaling())
        self.routing = _routing(cfg)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def weight_nbytes(self) -> int:
        """Bytes of the weights this rank holds, each array counted once (a tied lm_head is the
        embedding): what a shard's load puts on the device."""
        import dataclasses

        arrays = {}

        def add(*xs):
            for a in xs:
                if a is not None:
                    arrays[id(a)] = int(a.nbytes)

        add(self.embed, self.lm_head, self.final_norm)
        for layer in self.layers:
            add(layer.input_norm, layer.post_norm)
            add(*(getattr(layer.attn, f.name) for f in dataclasses.fields(layer.attn)))
            m = layer.mlp
            if isinstance(m, DenseMLP):
                add(m.w13, m.w2)
            else:
                add(m.gate_weight, m.e_score_correction_bias, m.shared_w13, m.shared_w2, m.experts.w13,
                    m.experts.w13_scale, m.experts.w2, m.experts.w2_scale)
        return sum(arrays.values())

    def small_m(self, num_tokens: int) -> bool:
        """Whether a forward of ``num_tokens`` rows takes the small-M path (docs/architecture.md, "The
        small-M path"): ``small_m_path`` on and M <= 64 (and the MoE shape within the small kernels'
        limits). Its MoE experts run ``moe_small_experts``; with ``batch_invariant`` every linear runs
        the row-invariant plan too, so a row's logits do not depend on the batch it is in."""
        if not self.small_m_path or not 1 <= num_tokens <= SMALL_M_MAX_TOKENS:
            return False
        fits = self._small_fits.get(num_tokens)  # asked per linear: the layer scan once per size
        if fits is None:
            moe = next((ly.mlp for ly in self.layers if isinstance(ly.mlp, MoELayerWeights)), None)
            fits = True
            if moe is not None:
                ex = moe.experts
                try:
                    check_small_shape(num_tokens, ex.num_experts, self.cfg.num_experts_per_tok, ex.hidden,
                                      ex.intermediate)
                except ValueError:
                    fits = False
            self._small_fits[num_tokens] = fits
        return fits

    def linear_impl(self, num_tokens: int) -> str:
        """``backend.linear``'s (and the MLA head GEMMs') kernel choice for a forward of ``num_tokens`` rows."""
        return "invariant" if self.batch_invariant and self.small_m(num_tokens) else "auto"

    def attention_split(self, num_tokens: int) -> str | None:
        """The attention plan's schedule for a forward of ``num_tokens`` rows: "shape" (each row's
        context pieces fixed by its own length) where the forward is row-invariant, else the default."""
        return "shape" if self.linear_impl(num_tokens) == "invariant" else None

    # -- loading ---------------------------------------------------------------------------------
    @classmethod
    def load(cls, directory: str | Path, backend, layers: int | None = None, progress=None,
             shard: Shard | None = None, comm: Communicator | None = None, reader: CheckpointReader | None = None,
             small_m_path: bool = True, batch_invariant: bool = True) -> TargetModel:
        """Load a checkpoint directory (optionally only its first ``layers`` decoder layers);
        ``progress(n)`` is called after each layer. Every missing or mis-shaped tensor is named.
        ``shard``: load only that rank's slices (see model/shard.py); ``reader``: an open reader
        (its ``bytes_read`` then tells what this rank read)."""
        cfg = load_config(directory)
        if layers is not None:
            cfg = cfg.with_layers(layers)
        shard = shard or Shard()
        shard.check(cfg, TILE_K if backend.is_cuda else GROUP)
        return cls.from_source(cfg, reader or CheckpointReader(directory), backend, progress, shard, comm,
                               small_m_path=small_m_path, batch_invariant=batch_invariant)

    @classmethod
    def dummy(cls, cfg: ModelConfig, backend, seed: int = 0, head: str = "random", progress=None,
              shard: Shard | None = None, comm: Communicator | None = None, small_m_path: bool = True,
              batch_invariant: bool = True) -> TargetModel:
        """``model.load: dummy``: ``make_model(cfg, seed=seed, head=head)``'s weights made directly in
        the backend's memory, only ``shard``'s part, no file written (model/dummy.py); bit for bit
        what ``load`` reads from that checkpoint."""
        from .dummy import DummySource

        shard = shard or Shard()
        shard.check(cfg, TILE_K if backend.is_cuda else GROUP)
        return cls.from_source(cfg, DummySource(cfg, seed, head, backend.xp), backend, progress, shard, comm,
                               small_m_path=small_m_path, batch_invariant=batch_invariant)

    @classmethod
    def from_source(cls, cfg: ModelConfig, reader, backend, progress=None, shard: Shard | None = None,
                    comm: Communicator | None = None, small_m_path: bool = True,
                    batch_invariant: bool = True) -> TargetModel:
        """The model of ``cfg`` from ``reader`` (a CheckpointReader, or a DummySource making the
        tensors), ``shard``'s slices only; ``small_m_path`` / ``batch_invariant``: see ``small_m``."""
        shard = shard or Shard()
        reader.check(expected_tensors(cfg))

        def dev(a):
            return to_backend(backend, a)

        def get(name):
            return reader.get(name)

        def part(name, axis, lo, hi):
            """This rank's [lo, hi) of ``name`` along ``axis`` (the whole tensor on one rank)."""
            return get(name) if shard.world == 1 else reader.get_part(name, axis, lo, hi)

        h0, h1 = shard.part(cfg.num_attention_heads, "attention heads")
        qk, kvb, v = cfg.qk_head_dim, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.v_head_dim
        v0, v1 = shard.part(cfg.vocab_size, "vocab_size (lm_head)")
        embed = dev(get("model.embed_tokens.weight"))
        if shard.world == 1 and cfg.tie_word_embeddings:
            lm = embed
        else:
            lm = dev(part("model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight", 0, v0, v1))
        routing = _routing(cfg)
        out = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            q_a = None if cfg.q_lora_rank is None else dev(get(a + "q_a_proj.weight"))
            q_b = a + ("q_proj.weight" if cfg.q_lora_rank is None else "q_b_proj.weight")
            attn = MLAWeights(
                q_b=dev(part(q_b, 0, h0 * qk, h1 * qk)),
                kv_a=dev(get(a + "kv_a_proj_with_mqa.weight")), kv_a_norm=dev(get(a + "kv_a_layernorm.weight")),
                kv_b=dev(part(a + "kv_b_proj.weight", 0, h0 * kvb, h1 * kvb)),
                o=dev(part(a + "o_proj.weight", 1, h0 * v, h1 * v)), q_a=q_a,
                q_a_norm=None if q_a is None else dev(get(a + "q_a_layernorm.weight")))
            if cfg.is_moe_layer(i):
                mlp = load_moe_layer(reader, i, routing, cfg.hidden_size, cfg.moe_intermediate_size, backend,
                                     shard=shard)
            else:
                i0, i1 = shard.part(cfg.intermediate_size, "intermediate_size (dense MLP)")
                w13 = backend.xp.concatenate([dev(part(p + "mlp.gate_proj.weight", 0, i0, i1)),
                                              dev(part(p + "mlp.up_proj.weight", 0, i0, i1))])
                mlp = DenseMLP(dev(w13), dev(part(p + "mlp.down_proj.weight", 1, i0, i1)))
            out.append(Layer(dev(get(p + "input_layernorm.weight")), dev(get(p + "post_attention_layernorm.weight")),
                             attn, mlp))
            if progress is not None:
                progress(i + 1)
        return cls(cfg, backend, embed, out, dev(get("model.norm.weight")), lm, shard, comm, small_m_path,
                   batch_invariant)

    # -- forward ---------------------------------------------------------------------------------
    def _mlp(self, layer: Layer, x, moe_plan=None):
        """The MLP sublayer's output: one rank's bf16, or on several ranks this rank's fp32 partial in
        the communicator's buffer ([2, T, H] for a MoE layer: routed and shared), which ``add_norm``
        all-reduces, rounds once and norms."""
        be, t = self.backend, int(x.shape[0])
        impl, small = self.linear_impl(t), self.small_m(t)
        if isinstance(layer.mlp, DenseMLP):
            return be.linear(be.silu_mul(be.linear(x, layer.mlp.w13, impl=impl)), layer.mlp.w2,
                             out=self.partial_out(x.shape), impl=impl)
        if self.shard.world == 1:
            return moe(x, layer.mlp, self.routing, be, plan=moe_plan, small=small, invariant=self.batch_invariant)
        # routed and shared partials side by side, one all-reduce; then, as one rank's combine does,
        # routed sum + bf16(shared sum), rounded once (Communicator.all_reduce_norm)
        parts = self.comm.partial_buffer((2,) + tuple(x.shape), be)
        moe(x, layer.mlp, self.routing, be, plan=moe_plan, out=parts[0], shared_out=parts[1], small=small,
            invariant=self.batch_invariant)
        return parts

    def partial_out(self, shape):
        """Where a sublayer writes its output of ``shape``: on several ranks an fp32 buffer (the
        communicator's, so the one-shot path reads it where it lies), so the partial sums are reduced
        unrounded and the result is rounded to bf16 once, as one rank's output is; None on one rank."""
        return self.comm.partial_buffer(tuple(shape), self.backend) if self.shard.world > 1 else None

    def add_norm(self, out, weight, residual, eps: float | None = None):
        """A sublayer's end: its output (on several ranks this rank's fp32 partial from ``partial_out``,
        all-reduced and rounded once) added to the residual stream and RMS-normed with ``eps`` (default
        the target's; the DFlash drafter's layers end here with theirs). Returns (normed, residual)."""
        be = self.backend
        eps = self.cfg.rms_norm_eps if eps is None else eps
        if self.shard.world == 1:
            return be.rmsnorm(out, weight, eps, residual=residual)
        return self.comm.all_reduce_norm(out, weight, eps, residual, be)

    def head_logits(self, rows):
        """bf16 [R, V] logits of final-normed rows [R, H]: this rank's vocabulary slice, all-gathered
        in rank order (exact: each logit is one rank's dot product)."""
        be, n = self.backend, self.shard.world
        local = be.linear(rows, self.lm_head, impl=self._head_impl(rows))
        if n == 1:
            return local
        r = rows.shape[0]
        full = self.comm.all_gather(local).reshape(n, r, -1)
        return be.xp.ascontiguousarray(full.transpose(1, 0, 2)).reshape(r, -1)

    def _head_impl(self, rows) -> str:
        return self.linear_impl(int(rows.shape[0]))

    def head_shard(self, rows):
        """bf16 [R, V / N]: this rank's vocabulary slice of the logits (ids ``vocab_offset`` on), for
        the samplers that exchange only (value, id) pairs (ddtree_rtc.parallel.vocab)."""
        return self.backend.linear(rows, self.lm_head, impl=self._head_impl(rows))

    @property
    def vocab_offset(self) -> int:
        """The global id of this rank's first lm_head row."""
        return self.shard.part(self.cfg.vocab_size, "vocab_size (lm_head)")[0]

    def head_argmax(self, rows):
        """int32 [R]: the argmax of the full logits (``backend.argmax``'s rule: ties to the smallest
        id, NaN ignored, -1 where a row has no number) without gathering them: each rank's best
        (value, global id) of its vocabulary slice, all-gathered ([N, R, 2] fp32, ids exact below
        2^24) and merged; the first rank wins a tie, and its slice holds the smaller ids."""
        be, n = self.backend, self.shard.world
        local = be.linear(rows, self.lm_head, impl=self._head_impl(rows))
        if n == 1:
            return be.argmax(local)
        xp, r = be.xp, rows.shape[0]
        idx = be.argmax(local)
        valid = idx >= 0
        val = be.from_bf16(xp.take_along_axis(local, xp.maximum(idx, 0)[:, None].astype(xp.int64), 1)[:, 0])
        offset = self.shard.part(self.cfg.vocab_size, "vocab_size (lm_head)")[0]
        pair = xp.stack([xp.where(valid, val, -xp.inf), xp.where(valid, idx + offset, -1).astype(xp.float32)], 1)
        g = self.comm.all_gather(xp.ascontiguousarray(pair.astype(xp.float32))).reshape(n, r, 2)
        vals, ids = g[..., 0], g[..., 1]
        best = xp.argmax(vals, axis=0)  # the first maximum: the lowest rank
        first_valid = xp.argmax(ids >= 0, axis=0)  # rows whose best is -inf: the first rank with a number
        top = xp.max(vals, axis=0)
        pick = xp.where(top == -xp.inf, first_valid, best)
        return xp.take_along_axis(ids, pick[None], 0)[0].astype(xp.int32)

    def prepare(self, batch: ForwardBatch, cache, into: StepInputs | None = None,
                page_width: int | None = None) -> StepInputs:
        """The host half of a forward: validate ``batch``, compute its cache slots, plan the
        attention and put the per-token inputs on the device. ``into``: an earlier StepInputs of the
        same shape whose device buffers (and attention plan) are overwritten in place, so a CUDA
        graph captured with it replays this batch. ``page_width``: page-table width (default: the
        widest sequence's pages; a graph needs a fixed one)."""
        be, cfg = self.backend, self.cfg
        if batch.tokens.size and (batch.tokens.min() < 0 or batch.tokens.max() >= cfg.vocab_size):
            raise ValueError(f"token ids must be in [0, {cfg.vocab_size}), "
                             f"got {batch.tokens.min()}..{batch.tokens.max()}")
        slots = np.concatenate([cache.allocator.slots(s, np.arange(c, c + n))
                                for s, c, n in zip(batch.seq_ids, batch.ctx_lens, batch.num_new)])
        rows = None if batch.logit_rows is None else np.asarray(batch.logit_rows, dtype=np.int64)
        table = cache.allocator.page_table(batch.seq_ids, page_width)
        plan = be.mla_attention_plan(batch.ctx_lens, batch.num_new, table, self.dims.num_heads, cache.page_size,
                                     cache.num_pages, batch.tree_mask, into=None if into is None else into.plan,
                                     split=None if into is not None else self.attention_split(len(slots)))
        if into is None:
            return StepInputs(batch, be.asarray(batch.tokens), be.asarray(batch.positions), be.asarray(slots),
                              plan, None if rows is None else be.asarray(rows))
        if (rows is None) != (into.logit_rows is None) or into.tokens.shape != batch.tokens.shape or (
                rows is not None and rows.shape != into.logit_rows.shape):
            raise ValueError("into: the StepInputs were made for another batch shape")
        for dst, src in ((into.tokens, batch.tokens), (into.positions, batch.positions), (into.slots, slots),
                         (into.logit_rows, rows)):
            if dst is not None:
                be.copy_in(dst, src)
        return StepInputs(batch, into.tokens, into.positions, into.slots, plan, into.logit_rows)

    def forward(self, batch: ForwardBatch, cache, output: str = "argmax", hidden_layers=()) -> ForwardOutput:
        """Run the new tokens of ``batch`` through every layer, writing their KV rows into ``cache``
        (a PagedKVCache with room reserved for them). ``output``: 'argmax', 'logits', 'shard' (this
        rank's vocabulary slice of the logits) or 'none'."""
        return self.run(self.prepare(batch, cache), cache, output, hidden_layers)

    def moe_plan(self, num_tokens: int):
        """The MoE launch plan (buffers) for ``num_tokens`` tokens, shared by every MoE layer of a
        forward; None where the model has no MoE layer (or on the numpy backend)."""
        c = self.cfg
        moe_layers = [ly.mlp for ly in self.layers if isinstance(ly.mlp, MoELayerWeights)]
        if not moe_layers:
            return None
        ex = moe_layers[0].experts  # this rank's experts (an EP / TP shard's count and intermediate)
        if self.small_m(num_tokens):
            return self.backend.moe_small_plan(num_tokens, ex.num_experts, c.num_experts_per_tok, c.hidden_size,
                                               ex.intermediate)
        return self.backend.moe_plan(num_tokens, ex.num_experts, c.num_experts_per_tok, c.hidden_size,
                                     ex.intermediate)

    def run(self, inputs: StepInputs, cache, output: str = "argmax", hidden_layers=(), moe_plan=None,
            mark=None) -> ForwardOutput:
        """The device half of a forward (no host sync, no host-to-device copy: it can be captured
        in a CUDA graph and replayed after ``prepare(..., into=inputs)``). ``moe_plan``: from
        ``self.moe_plan(T)``, made here when not given (a graph keeps its own). ``mark(stage,
        layer, x)``, when given, is called after each stage is enqueued ('embed', 'attention',
        'mlp', 'head'; x = the stage's input activations) — the decode benchmark times stages with
        it."""
        mark = mark or (lambda stage, layer, x: None)
        if output not in ("argmax", "logits", "shard", "none"):
            raise ValueError(f"output must be 'argmax', 'logits', 'shard' or 'none', got {output!r}")
        be, cfg = self.backend, self.cfg
        if moe_plan is None:
            moe_plan = self.moe_plan(int(inputs.tokens.shape[0]))
        h = be.embedding(inputs.tokens, self.embed)
        x = be.rmsnorm(h, self.layers[0].input_norm, cfg.rms_norm_eps)
        mark("embed", -1, inputs.tokens)
        hidden = {}
        for i, layer in enumerate(self.layers):
            a = self._attention(layer, i, x, inputs.positions, inputs.slots, inputs.plan, cache)
            x_attn = x
            x, h = self.add_norm(a, layer.post_norm, h)
            mark("attention", i, x_attn)
            m = self._mlp(layer, x, moe_plan)
            x_mlp = x
            nxt = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.final_norm
            x, h = self.add_norm(m, nxt, h)
            if i in hidden_layers:
                hidden[i] = h.copy()
            mark("mlp", i, x_mlp)
        out = ForwardOutput(hidden=hidden)
        if output == "none":
            return out
        rows = x if inputs.logit_rows is None else be.xp.ascontiguousarray(x[inputs.logit_rows])
        if output == "logits":
            out.logits = self.head_logits(rows)
        elif output == "shard":
            out.logits = self.head_shard(rows)
        else:
            out.tokens = self.head_argmax(rows)
        mark("head", -1, rows)
        return out

    def _attention(self, layer: Layer, i: int, x, positions, slots, plan, cache):
        """The attention sublayer's output: bf16 on one rank, this rank's fp32 partial on several
        (``add_norm`` reduces it), as ``_mlp``'s."""
        # q_a / kv_a norms use LATENT_NORM_EPS; mla_forward takes one eps for both
        return mla_forward(self.backend, x, layer.attn, self.dims, positions, self.inv_freq, LATENT_NORM_EPS,
                           cache.layer(i), slots, plan, self.cfg.softmax_scale, self.rope_scale,
                           out=self.partial_out(x.shape), impl=self.linear_impl(int(x.shape[0])))
