"""The pipeline schema: frozen dataclasses parsed from YAML with unknown keys and wrong types
rejected by file, line and key. Invariants live in each class's ``__post_init__``."""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from .yamlio import LinedDict, PipelineError, Where, load_yaml


@dataclass(frozen=True)
class ModelSpec:
    """What to load: a preset (built-in random weights) or a checkpoint directory; a ``path`` overrides
    a ``preset`` (so ``--set model.path=DIR`` runs a pipeline written for a preset on a make-model
    output). ``head``: a preset's lm_head, ``random`` or ``decisive`` (greedy choices far from ties;
    see ddtree_rtc.model.random_weights.decisive_rows)."""

    preset: str | None = None
    path: str | None = None
    layers: int | None = None  # keep only the first n decoder layers
    seed: int = 0
    head: Literal["random", "decisive"] = "random"
    # checkpoint: a preset's random checkpoint is written once (cached) and read; dummy: made directly
    # in the backend's memory, this rank's shard only, nothing written (ddtree_rtc.model.dummy)
    load: Literal["checkpoint", "dummy"] = "checkpoint"

    def __post_init__(self):
        if self.load == "dummy" and self.path is not None:
            raise ValueError("load: dummy makes a preset's random weights in memory; it takes no checkpoint "
                             f"'path' ({self.path}): give 'preset' instead")
        if self.preset is None and self.path is None:
            raise ValueError("give 'preset' (built-in random weights) or 'path' (a checkpoint directory)")
        if self.path is not None and self.head != "random":
            raise ValueError("head applies to a preset's random weights, not to a checkpoint 'path'")
        if self.layers is not None and self.layers < 1:
            raise ValueError(f"layers must be >= 1, got {self.layers}")


@dataclass(frozen=True)
class RuntimeSpec:
    """``tensor_parallel``: ranks (one GPU each) the model is split over: attention heads, dense and
    shared-expert intermediate, lm_head vocabulary; the routed experts split their intermediate too,
    or, with ``expert_parallel``, each rank holds 1/tensor_parallel of the experts whole.
    ``small_m_path``: forwards of at most 64 rows (an AR batch or a whole tree verify) run the small-M
    kernels (docs/architecture.md, "The small-M path"); false keeps the general kernels for comparison.
    ``batch_invariant``: on that path every linear also sums each row the same way whatever the batch,
    so a verify row equals its autoregressive twin bit for bit; false lets them take the faster
    non-invariant kernels (cuBLAS) where those win.
    ``allreduce``: how each sublayer's partials are reduced before the residual RMSNorm on several
    ranks: ``nccl`` (the default) an NCCL all-reduce, then to_bf16 and the norm; ``oneshot`` the fused
    one-shot kernel over CUDA IPC peer memory for partials of <= 16 rows (rank-order sums: its bits
    equal NCCL's only where NCCL's order matches), an error where it cannot run; ``auto`` oneshot
    where every rank is a peer GPU of one node, else NCCL (ddtree_rtc.parallel.oneshot)."""

    backend: Literal["auto", "cuda", "numpy"] = "auto"
    arch: str | None = None
    tensor_parallel: int = 1
    expert_parallel: bool = False
    cuda_graphs: bool = True
    max_batch: int = 8
    page_size: int = 64
    max_context: int = 4096
    # run rank R of tensor_parallel alone on one device, collectives as stand-ins moving the same
    # bytes (ddtree_rtc.parallel.simulated): time and bytes of that rank, numerics not the model's
    simulate_rank: int | None = None
    simulate_collective_us: float = 0.0  # each stand-in also holds this long
    small_m_path: bool = True
    batch_invariant: bool = True
    allreduce: Literal["auto", "nccl", "oneshot"] = "nccl"

    def __post_init__(self):
        if self.allreduce not in ("auto", "nccl", "oneshot"):
            raise ValueError(f"allreduce must be 'auto', 'nccl' or 'oneshot', got {self.allreduce!r}")
        if self.allreduce == "oneshot":
            if self.backend == "numpy":
                raise ValueError("allreduce: oneshot runs on the CUDA backend (peer GPU memory), not numpy; "
                                 "use 'auto' or 'nccl'")
            if self.simulate_rank is not None:
                raise ValueError("allreduce: oneshot needs every rank running (it reads their memory); a "
                                 "simulate_rank stands in for the collectives: use 'auto' or 'nccl'")
        for name in ("tensor_parallel", "max_batch", "page_size", "max_context"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.simulate_rank is not None:
            if self.tensor_parallel == 1:
                raise ValueError(f"simulate_rank {self.simulate_rank} needs tensor_parallel >= 2 (one rank has "
                                 f"nothing to simulate)")
            if not 0 <= self.simulate_rank < self.tensor_parallel:
                raise ValueError(f"simulate_rank {self.simulate_rank} is outside [0, {self.tensor_parallel}) "
                                 f"(tensor_parallel {self.tensor_parallel})")
        if self.simulate_collective_us < 0:
            raise ValueError(f"simulate_collective_us must be >= 0, got {self.simulate_collective_us}")
        if self.simulate_collective_us and self.simulate_rank is None:
            raise ValueError("simulate_collective_us applies to a simulated rank: set simulate_rank too")
        if self.arch is not None:
            from ..rtc.arch import check_arch

            check_arch(self.arch)


@dataclass(frozen=True)
class AcceptanceSpec:
    """The oracle drafter's profile: ``p`` (rank 0 at every depth with probability p, else a
    geometric rank) or ``table`` (one rank-0 probability per depth)."""

    p: float | None = None
    table: tuple[float, ...] | None = None

    def __post_init__(self):
        if (self.p is None) == (self.table is None):
            raise ValueError("acceptance: give exactly one of 'p' or 'table'")
        for v in (self.p,) if self.table is None else self.table:
            if not 0 <= v <= 1:
                raise ValueError(f"acceptance: probabilities must be in [0, 1], got {v}")


@dataclass(frozen=True)
class DrafterSpec:
    kind: Literal["oracle", "random", "dflash"] = "oracle"
    path: str | None = None  # dflash: the drafter checkpoint directory
    depth: int = 7  # positions drafted per round (block_size - 1); dflash reads its block size
    acceptance: AcceptanceSpec = field(default_factory=lambda: AcceptanceSpec(p=0.8))
    seed: int = 0
    window: int | None = None  # dflash: attend only the last `window` context rows

    def __post_init__(self):
        from ..reference.tree_build import MAX_DEPTH

        if not 1 <= self.depth <= MAX_DEPTH:
            raise ValueError(f"depth {self.depth} is outside 1..{MAX_DEPTH} (the tree builder's depth limit)")
        if (self.kind == "dflash") != (self.path is not None):
            raise ValueError("a dflash drafter needs 'path' (its checkpoint directory); oracle and random take none")
        if self.window is not None and self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")


@dataclass(frozen=True)
class DecodeSpec:
    mode: Literal["autoregressive", "ddtree", "chain"] = "autoregressive"
    temperature: float = 0.0
    top_p: float = 1.0
    budget: int | Literal["auto"] = 64  # tree nodes per round (ddtree), the root excluded; auto: chosen per round
    drafter: DrafterSpec | None = None  # needed by ddtree and chain; autoregressive ignores it
    seed: int = 0
    max_budget: int = 64  # budget auto: the most nodes a request's tree may have (the tree is built at this)
    cost_table: str | None = None  # budget auto: a verify cost table (JSON); else measured at warm-up (CUDA)
    # budget auto: each round's counts from the past rounds (lagged: no sync between build and verify)
    # or from the round's own tree (tree: a host round trip there)
    budget_choice: Literal["lagged", "tree"] = "lagged"
    # budget auto under row-invariant scheduling: the verify within the small-M path's 64 rows (invariant: AR's
    # ids by construction) or any row bucket, the general kernels past 64 rows included, where the costs say it
    # pays (any: ids may part from AR at near-ties, as a fixed budget over 63's do)
    auto_rows: Literal["invariant", "any"] = "invariant"

    def __post_init__(self):
        from ..reference.tree_build import MAX_BUDGET

        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.budget != "auto" and not 0 <= self.budget <= MAX_BUDGET:
            raise ValueError(f"budget {self.budget} is outside 0..{MAX_BUDGET} (the tree buffers' maximum)")
        if not 1 <= self.max_budget <= MAX_BUDGET:
            raise ValueError(f"max_budget {self.max_budget} is outside 1..{MAX_BUDGET} (the tree buffers' maximum)")
        if self.budget == "auto" and self.mode != "ddtree":
            raise ValueError(f"budget 'auto' needs mode 'ddtree' (chain is one of the trees it chooses from), "
                             f"got mode {self.mode!r}")
        if self.cost_table is not None and self.budget != "auto":
            raise ValueError("cost_table is read only with budget 'auto'")
        if self.budget_choice not in ("lagged", "tree"):
            raise ValueError(f"budget_choice must be 'lagged' or 'tree', got {self.budget_choice!r}")
        if self.auto_rows not in ("invariant", "any"):
            raise ValueError(f"auto_rows must be 'invariant' or 'any', got {self.auto_rows!r}")
        if self.auto_rows != "invariant" and self.budget != "auto":
            raise ValueError("auto_rows is read only with budget 'auto'")
        if self.mode != "autoregressive" and self.drafter is None:
            raise ValueError(f"mode {self.mode!r} needs a drafter (decode.drafter: {{kind: oracle | random | dflash}})")


@dataclass(frozen=True)
class SyntheticWorkload:
    count: int = 4
    prompt_len: int = 16
    output_len: int = 16
    seed: int = 0

    def __post_init__(self):
        for name in ("count", "prompt_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class WorkloadSpec:
    prompts: str | None = None  # JSONL: {"ids": [...]} or {"text": "..."} per line
    synthetic: SyntheticWorkload | None = None
    concurrency: int = 4
    max_new_tokens: int = 32

    def __post_init__(self):
        if (self.prompts is None) == (self.synthetic is None):
            raise ValueError("give exactly one of 'prompts' or 'synthetic'")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")


@dataclass(frozen=True)
class OutputSpec:
    json: str | None = None


@dataclass(frozen=True)
class Pipeline:
    model: ModelSpec
    runtime: RuntimeSpec = field(default_factory=RuntimeSpec)
    decode: DecodeSpec = field(default_factory=DecodeSpec)
    workload: WorkloadSpec = field(default_factory=lambda: WorkloadSpec(synthetic=SyntheticWorkload()))
    output: OutputSpec = field(default_factory=OutputSpec)
    source: str = field(default="<pipeline>", compare=False)


# Top-level keys that pipelines no longer take, and why: an old file that still has one is told so
# instead of reading "unknown key".
REMOVED_KEYS = {
    "stages": "was removed: it never chose what ran (the engine launches its own kernels, the MoE plan "
              "and the tree sizes pick their variants, and stage timings carry the engine's names); "
              "delete it",
}


def _type_name(t) -> str:
    return getattr(t, "__name__", str(t)).replace("NoneType", "null")


def _convert(value, tp, where: str, key: str):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(value, a, where, key)
            except PipelineError as e:
                errors.append(str(e))
        raise PipelineError(errors[0] if len(errors) == 1 else
                            f"{where}: key {key!r}: expected {' or '.join(map(_type_name, args))}, "
                            f"got {value!r}")
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise PipelineError(f"{where}: key {key!r}: must be one of "
                                f"{', '.join(map(repr, typing.get_args(tp)))}, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, list):
            raise PipelineError(f"{where}: key {key!r}: expected a list, got {type(value).__name__}")
        inner = typing.get_args(tp)[0]
        return tuple(_convert(v, inner, _where_of(v, where), f"{key}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise PipelineError(f"{where}: key {key!r}: expected a mapping, got {type(value).__name__}")
        return from_mapping(tp, value, key)
    if tp is dict:
        if not isinstance(value, dict):
            raise PipelineError(f"{where}: key {key!r}: expected a mapping, got {type(value).__name__}")
        return dict(value)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool) and (type(value) is not tp):
        raise PipelineError(f"{where}: key {key!r}: expected {tp.__name__}, got {type(value).__name__} "
                            f"{value!r}")
    return value


def _where_of(value, default: str) -> str:
    return str(value.where()) if isinstance(value, LinedDict) else default


def from_mapping(cls, d: dict, path: str = ""):
    """Build dataclass ``cls`` from mapping ``d``; errors carry file:line and the dotted key."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.name != "source"}
    lined = isinstance(d, LinedDict)
    for key in d:
        if key not in names:
            where = d.where(key) if lined else path
            prefix = f"{path}." if path else ""
            raise PipelineError(f"{where}: unknown key '{prefix}{key}'; "
                                f"allowed here: {', '.join(sorted(names))}")
    kwargs = {}
    for key, value in d.items():
        where = str(d.where(key)) if lined else path
        kwargs[key] = _convert(value, hints[key], where, f"{path}.{key}" if path else key)
    try:
        return cls(**kwargs)
    except (ValueError, TypeError, KeyError) as e:
        msg = str(e.args[0] if e.args else e)
        key = _key_named(msg, d) if lined else None
        where = str(d.where(key)) if lined else path
        raise PipelineError(f"{where}: {path or cls.__name__}: {msg}") from None


def _key_named(msg: str, d: LinedDict):
    """The key of ``d`` an invariant's message names first (its line is where the error is), or None
    (the mapping's own line)."""
    import re

    hits = [(m.start(), k) for k in d if isinstance(k, str)
            for m in [re.search(rf"(?<![\w.]){re.escape(k)}(?!\w)", msg)] if m]
    return min(hits)[1] if hits else None


# keys whose relative paths are read from the pipeline file's directory; given with --set, from the
# current directory instead (where the user typed them), as every other path is
_PATHS_FROM_YAML_DIR = ("workload.prompts",)


def parse_pipeline(text: str, file: str = "<pipeline>", overrides: dict | None = None) -> Pipeline:
    data = load_yaml(text, file)
    for dotted, value in (overrides or {}).items():
        if dotted in _PATHS_FROM_YAML_DIR and isinstance(value, str) and not Path(value).is_absolute():
            value = str(Path(value).absolute())
        _apply_override(data, dotted, value)
    for key, why in REMOVED_KEYS.items():
        if key in data:
            raise PipelineError(f"{data.where(key)}: key {key!r} {why}")
    if "model" not in data:
        raise PipelineError(f"{file}: missing required key 'model'")
    pipe = from_mapping(Pipeline, data)
    return dataclasses.replace(pipe, source=file)


def load_pipeline(path: str | Path, overrides: dict | None = None) -> Pipeline:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise PipelineError(f"{p}: cannot read pipeline file: {e.strerror}") from None
    return parse_pipeline(text, str(p), overrides)


def _apply_override(data: LinedDict, dotted: str, value) -> None:
    """``--set decode.budget=32``: the value is parsed as YAML (so 32 is an int, true a bool)."""
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        nxt = node.get(part)
        if nxt is None:
            nxt = LinedDict()
            nxt.file, nxt.line, nxt.key_lines = f"--set {dotted}", 0, {}
            node[part] = nxt
            if isinstance(node, LinedDict):
                node.key_lines[part] = Where(f"--set {dotted}", 0)
        if not isinstance(nxt, dict):
            raise PipelineError(f"--set {dotted}: {part!r} is not a mapping")
        node = nxt
    node[parts[-1]] = value
    if isinstance(node, LinedDict):
        node.key_lines[parts[-1]] = Where(f"--set {dotted}", 0)


def parse_set_options(items: tuple[str, ...]) -> dict:
    import yaml

    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise PipelineError(f"--set {item!r}: expected key=value, e.g. decode.budget=32")
        out[key.strip()] = yaml.safe_load(raw)
    return out
