"""``model.load: dummy`` (vLLM's ``--load-format dummy``): a preset's random weights made directly in
the backend's memory (CuPy arrays on cuda, numpy on numpy), only the parts this rank holds, no file
written. ``DummySource`` hands tensors out as ``CheckpointReader`` does, so ``TargetModel`` loads
either through the same shard slicing; the values are ``random_weights``', so with one seed a dummy
load equals ``make-model`` + load bit for bit at every rank's shard.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from ml_dtypes import bfloat16

from . import random_weights as rw
from .checkpoint import CheckpointError, TensorSpec, expected_tensors
from .config import ModelConfig
from .int4_repack import Int4Experts
from .shard import Shard


class DummySource:
    """The tensors of ``make_model(cfg, seed=seed, head=head)`` (default stored dtypes: bf16 router,
    fp32 correction bias) as ``xp`` arrays, made on request: ``get`` (whole), ``get_part`` (a slice),
    ``moe_experts`` (one layer's routed experts, or a shard's). bf16 comes as ml_dtypes bfloat16 on
    numpy and as uint16 bits on CuPy (the backend's forms)."""

    prefix = ""

    def __init__(self, cfg: ModelConfig, seed: int = 0, head: str = "random", xp=np):
        if head not in rw.HEADS:
            raise ValueError(f"head {head!r}: expected one of {', '.join(rw.HEADS)}")
        self.cfg, self.seed, self.head, self.xp = cfg, seed, head, xp
        self.specs: dict[str, TensorSpec] = {s.name: s for s in expected_tensors(cfg)}
        self.root = self.dir = Path(f"<dummy seed {seed}>")
        self.bytes_read: dict[str, int] = {}
        self._perm = None

    # -- the CheckpointReader surface the loader uses ----------------------------------------------
    def names(self) -> list[str]:
        return sorted(self.specs)

    def full_name(self, name: str) -> str:
        return name

    def __contains__(self, name: str) -> bool:
        return name in self.specs

    def file_of(self, name: str) -> Path:
        return self.root

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        s = self._spec(name)
        return s.dtypes[0], s.shape

    def check(self, specs: list[TensorSpec]) -> None:
        missing = [s.name for s in specs if s.name not in self.specs]
        if missing:
            raise CheckpointError(f"{self.root}: the preset has no tensor(s) {missing[:10]}")

    def get(self, name: str, shape: tuple | None = None, dtype: str | None = None):
        s = self._spec(name)
        if shape is not None and tuple(shape) != s.shape:
            raise CheckpointError(f"{self.root}: tensor {name} has shape {s.shape}, expected {tuple(shape)}")
        return self._make(s, 0, 0, s.shape[0])

    def get_part(self, name: str, axis: int, start: int, stop: int):
        s = self._spec(name)
        if not 0 <= axis < len(s.shape) or not 0 <= start < stop <= s.shape[axis]:
            raise CheckpointError(f"{self.root}: tensor {name} {list(s.shape)}: no part [{start}, {stop}) "
                                  f"on axis {axis}")
        return self._make(s, axis, start, stop)

    # -- making ------------------------------------------------------------------------------------
    def _spec(self, name: str) -> TensorSpec:
        try:
            return self.specs[name]
        except KeyError:
            raise CheckpointError(f"{self.root}: missing tensor {name}") from None

    def _out(self, a, name: str):
        """Backend form; counted in bytes_read as a reader counts what it hands out."""
        a = self._form(a)
        self._count(name, a.nbytes)
        return a

    def _form(self, a):
        """The backend's form of a made array: bf16 bits as bfloat16 on numpy."""
        return a.view(bfloat16) if self.xp is np and a.dtype == np.uint16 else a

    def _count(self, name: str, nbytes: int) -> None:
        self.bytes_read[name] = self.bytes_read.get(name, 0) + int(nbytes)

    def _make(self, s: TensorSpec, axis: int, lo: int, hi: int):
        xp, cfg = self.xp, self.cfg
        if rw.kind_of(s.name) == "int4_shape":
            packed = self._spec(s.name[: -len("weight_shape")] + "weight_packed").shape
            return self._out(xp.asarray(rw.int4_shape(packed[0], packed[1] * 8)), s.name)
        rows = (lo, hi) if axis == 0 else None
        cols = (lo, hi) if axis == 1 else None
        if s.name == "lm_head.weight" and self.head == "decisive":
            if axis != 0:
                raise CheckpointError(f"{self.root}: the decisive lm_head is split by rows only")
            if self._perm is None:
                self._perm = rw.head_permutation(self.seed, cfg.vocab_size)
            emb = self.specs["model.embed_tokens.weight"]
            e = rw.values(self.seed, emb.name, emb.shape, cfg.num_hidden_layers, xp, rows=xp.asarray(self._perm[lo:hi]))
            return self._out(rw.decisive_rows(e, cfg.hidden_size, xp), s.name)
        return self._out(rw.values(self.seed, s.name, s.shape, cfg.num_hidden_layers, xp, rows=rows, cols=cols),
                         s.name)

    def moe_experts(self, layer: int, experts: range, inter_part: tuple[int, int] | None = None) -> Int4Experts:
        """Layer ``layer``'s routed experts ``experts`` (an EP shard's range, or all) as
        'compressed-tensors' Int4Experts (what quant.load_moe_experts returns for a checkpoint);
        ``inter_part`` [start, stop) of the intermediate (a TP shard). Made a group of experts at a
        time, one hash key per expert."""
        xp, cfg = self.xp, self.cfg
        h, inter = cfg.hidden_size, cfg.moe_intermediate_size
        lo, hi = (0, inter) if inter_part is None else inter_part
        g = rw.QUANT_GROUP
        base = f"model.layers.{layer}.mlp.experts."
        # (proj, leaf) -> (whole shape, rows, cols) of this shard
        plan = {("gate_proj", "weight_packed"): ((inter, h // 8), (lo, hi), None),
                ("up_proj", "weight_packed"): ((inter, h // 8), (lo, hi), None),
                ("down_proj", "weight_packed"): ((h, inter // 8), None, (lo // 8, hi // 8)),
                ("gate_proj", "weight_scale"): ((inter, h // g), (lo, hi), None),
                ("up_proj", "weight_scale"): ((inter, h // g), (lo, hi), None),
                ("down_proj", "weight_scale"): ((h, inter // g), None, (lo // g, hi // g))}
        n_exp, part = len(experts), hi - lo
        # gate and up are made straight into their halves of the fused [E, 2 I, .] arrays and each
        # generation group straight into its experts' rows: no parts list, no concatenation, so a
        # layer's make holds its compressed experts once (what plan_memory in bench/node counts)
        w13 = xp.empty((n_exp, 2 * part, h // 8), dtype=np.int32)
        s13 = xp.empty((n_exp, 2 * part, h // g), dtype=np.uint16)
        w2 = xp.empty((n_exp, h, part // 8), dtype=np.int32)
        s2 = xp.empty((n_exp, h, part // g), dtype=np.uint16)
        dest = {("gate_proj", "weight_packed"): w13[:, :part], ("up_proj", "weight_packed"): w13[:, part:],
                ("down_proj", "weight_packed"): w2, ("gate_proj", "weight_scale"): s13[:, :part],
                ("up_proj", "weight_scale"): s13[:, part:], ("down_proj", "weight_scale"): s2}
        for (proj, leaf), (shape, rows, cols) in plan.items():
            dst = dest[proj, leaf]
            per = max(1, rw.chunk_for(xp) // (dst.shape[1] * dst.shape[2]))  # experts per generation group
            for e0 in range(0, n_exp, per):
                ids = experts[e0:e0 + per]
                keys = xp.asarray(np.array([rw.tensor_key(self.seed, f"{base}{e}.{proj}.{leaf}") for e in ids],
                                           dtype=np.uint64).reshape(-1, 1, 1))
                dst[e0:e0 + len(ids)] = rw.values(self.seed, f"{base}{ids[0]}.{proj}.{leaf}", shape,
                                                  cfg.num_hidden_layers, xp, rows=rows, cols=cols, keys=keys)
            self._count(f"{base}*.{proj}.{leaf}", dst.nbytes)
        return Int4Experts("compressed-tensors", n_exp, h, part, w13, self._form(s13), w2, self._form(s2))


def shard_nbytes(cfg: ModelConfig, shard: Shard) -> int:
    """Bytes of weights ``shard``'s rank holds once loaded (what a dummy load allocates, temporaries
    aside): attention heads, dense / shared intermediate and lm_head rows split over the ranks, the
    routed experts by rank (EP) or by intermediate (TP), the rest whole; INT4 experts at 4.5 bits a
    value (nibbles plus one bf16 scale per 32), the correction bias fp32."""
    n = shard.world
    total = 0
    for s in expected_tensors(cfg):
        name, size = s.name, int(np.prod(s.shape))
        item = {"BF16": 2, "F32": 4, "I32": 4, "I64": 8}[s.dtypes[0]]
        if name.endswith(".e_score_correction_bias"):
            item = 4
        if ".mlp.experts." in name:
            if name.endswith("weight_shape"):
                continue
            size //= n  # EP: 1/n of the experts whole; TP: 1/n of every expert's intermediate
        elif name.endswith(("q_b_proj.weight", "q_proj.weight", "kv_b_proj.weight", "o_proj.weight",
                            "gate_proj.weight", "up_proj.weight", "down_proj.weight", "lm_head.weight")):
            size //= n
        total += size * item
    if cfg.tie_word_embeddings and n > 1:
        total += cfg.vocab_size // n * cfg.hidden_size * 2
    return total
