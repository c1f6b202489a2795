"""Run a pipeline: backend -> compile every kernel -> load the model (progress bar) -> run the
workload (progress bar) -> summary table and JSON (written atomically: nothing half-written).

On several ranks (``runtime.tensor_parallel``; rank and world size from the launcher's variables,
ddtree_rtc/parallel/launch.py) every rank runs this same code on its shard of the model and makes the
same scheduling decisions; rank 0 alone prints, shows progress and writes the JSON."""

from __future__ import annotations

import io
import json
import os
import statistics
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np

from ..backend import Backend
from ..engine.engine import Engine
from ..engine.request import Request
from ..model.config import preset_config
from ..model.make_model import make_model
from ..model.shard import Shard, ShardError
from ..model.target import TargetModel
from ..model.tokenizer import ByteTokenizer, TokenizerError, kimi_tokenizer
from ..parallel.comm import CommStats, Communicator, DistError
from ..parallel.launch import RankEnv, make_communicator, rank_env
from .schema import Pipeline, PipelineError


@dataclass
class Ranks:
    """This process's rank, its communicator, and where its messages go (rank 0: stderr; the
    others: nowhere, their errors still reach the launcher as exceptions)."""

    env: RankEnv
    backend: Backend
    comm: Communicator
    log: object
    simulated: bool = False  # runtime.simulate_rank: this process alone plays rank env.rank

    @property
    def is_main(self) -> bool:
        return self.env.is_main or self.simulated

    def echo(self, msg: str) -> None:
        click.echo(msg, file=self.log)


def ranks_for(pipe: Pipeline, env: RankEnv | None = None) -> Ranks:
    """The backend and communicator of this rank of ``pipe``'s job; refuses a world size that is
    not ``runtime.tensor_parallel``."""
    env = env or rank_env()
    tp = pipe.runtime.tensor_parallel
    if pipe.runtime.simulate_rank is not None:
        return _simulated_ranks(pipe, env)
    if env.world_size != tp:
        how = (f"this process is rank {env.rank} of {env.world_size} ({env.launcher})" if env.world_size > 1
               else "this is a single process")
        raise PipelineError(f"{pipe.source}: runtime.tensor_parallel {tp} needs {tp} ranks, but {how}: run "
                            f"`ddtree-rtc run PIPELINE --nproc {tp}` or start {tp} ranks with torchrun / mpirun / srun")
    log = sys.stderr if env.is_main else io.StringIO()
    quiet = not env.is_main
    if env.world_size > 1 and pipe.runtime.backend != "numpy":
        from ..backend import cuda_available

        if cuda_available():  # this rank's GPU, before anything touches the device
            import cupy

            cupy.cuda.Device(env.local_rank).use()
    backend = Backend(pipe.runtime.backend, arch=pipe.runtime.arch, quiet=quiet)
    try:
        comm = make_communicator(env, backend.is_cuda)
    except DistError as e:
        raise PipelineError(f"{pipe.source}: {e}") from None
    return Ranks(env, backend, comm, log)


def _simulated_ranks(pipe: Pipeline, env: RankEnv) -> Ranks:
    """``runtime.simulate_rank``: this single process runs that rank's share alone, every collective a
    stand-in (parallel/simulated.py); it says plainly that its numerics are not the model's."""
    from ..parallel.simulated import SimulatedRank

    rt = pipe.runtime
    if env.world_size > 1:
        raise PipelineError(f"{pipe.source}: runtime.simulate_rank runs one process alone, but this is rank "
                            f"{env.rank} of {env.world_size} ({env.launcher}): run it without --nproc / a launcher")
    backend = Backend(rt.backend, arch=rt.arch)
    comm = SimulatedRank(rt.simulate_rank, rt.tensor_parallel, backend.xp, rt.simulate_collective_us)
    ranks = Ranks(RankEnv(rt.simulate_rank, rt.tensor_parallel), backend, comm, sys.stderr, simulated=True)
    ranks.echo(f"WARNING: {comm.note()}")
    return ranks


def compile_kernels(backend: Backend) -> float:
    """Build every kernel family an engine may launch before the loop; then any later build warns,
    or fails under DDTREE_RTC_NO_LATE_COMPILE=1. The benchmark-only families
    (registry.BENCHMARK_ONLY) are not built here."""
    from ..kernels.registry import engine_specs
    from ..rtc import builder

    if not backend.is_cuda:
        return 0.0
    t0 = time.perf_counter()
    for spec in engine_specs():
        builder.load(spec, backend.arch)
    return time.perf_counter() - t0


def model_dir(pipe: Pipeline, ranks: Ranks | None = None) -> Path | None:
    """The checkpoint directory: the given path, or a preset's random checkpoint (made once, cached;
    on several ranks rank 0 makes it while the others wait); None for ``model.load: dummy`` (no
    checkpoint: the weights are made in memory)."""
    m = pipe.model
    if m.load == "dummy":
        return None
    if m.path is not None:
        return Path(m.path)
    cfg = preset_config(m.preset)
    if m.layers is not None:
        cfg = cfg.with_layers(m.layers)
    from ..rtc.cache import cache_dir

    head = "" if m.head == "random" else f"-{m.head}"
    # "-g2": random_weights' generator (a cache made by the earlier generator holds other values)
    out = cache_dir() / "models" / f"{m.preset}-L{cfg.num_hidden_layers}-seed{m.seed}{head}-g2"
    if ranks is not None and not ranks.is_main:
        ranks.comm.barrier()  # rank 0 has made it
        return out
    if not (out / "model.safetensors.index.json").exists():
        click.echo(f"making the random {m.preset} checkpoint in {out}", err=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        make_model(cfg, tmp, seed=m.seed, head=m.head)
        try:
            tmp.rename(out)
        except OSError:  # another process made it meanwhile
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    if ranks is not None:
        ranks.comm.barrier()
    return out


def model_config(pipe: Pipeline, directory: Path | None):
    """The target's config: the checkpoint's, or (``load: dummy``) the preset's, cut to ``layers``."""
    from ..model.config import load_config

    if directory is not None:
        return load_config(directory)
    cfg = preset_config(pipe.model.preset)
    return cfg if pipe.model.layers is None else cfg.with_layers(pipe.model.layers)


def free_memory(backend: Backend) -> int:
    """Bytes free where the backend's arrays live: the GPU's free memory, or the host's available."""
    if backend.is_cuda:
        import cupy

        return int(cupy.cuda.runtime.memGetInfo()[0])
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_dummy_fits(pipe: Pipeline, cfg, shard: Shard, backend: Backend) -> int:
    """``load: dummy``: refuse, before any allocation, a shard whose weights exceed the free memory
    (naming the bytes needed and free); returns the bytes it will hold."""
    from ..model.dummy import shard_nbytes

    need, free = shard_nbytes(cfg, shard), free_memory(backend)
    if need > free:
        where = f"rank {shard.rank} of {shard.world}" if shard.world > 1 else "the model"
        raise PipelineError(f"{pipe.source}: model.load: dummy: {pipe.model.preset} with {cfg.num_hidden_layers} "
                            f"layers needs {need} bytes ({need / 1e9:.2f} GB) of weights for {where}, but the "
                            f"{backend.name} device has {free} bytes ({free / 1e9:.2f} GB) free: use fewer "
                            f"model.layers or more tensor_parallel ranks")
    return need


def load_prompts(pipe: Pipeline, vocab: int, directory: Path | None,
                 origins: list[str] | None = None) -> list[list[int]]:
    """The workload's prompts: synthetic, or one JSON object per line of ``workload.prompts``:
    ``{"ids": [int, ...]}`` or ``{"text": "..."}`` (through the model's tokenizer: Kimi's tiktoken
    when the directory has one, else for a preset model the byte tokenizer ``serve`` uses). Every
    error names the file and line. ``origins``, when given, gets each prompt's ``file:line``."""
    w = pipe.workload
    if w.synthetic is not None:
        s = w.synthetic
        rng = np.random.default_rng(s.seed)
        if origins is not None:
            origins += [f"{pipe.source}: workload.synthetic prompt {i}" for i in range(s.count)]
        return [rng.integers(0, vocab, s.prompt_len).tolist() for _ in range(s.count)]
    path = Path(w.prompts)
    if not path.is_absolute():
        path = Path(pipe.source).parent / path
    prompts = []
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise PipelineError(f"{pipe.source}: workload.prompts: cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise PipelineError(f"{pipe.source}: workload.prompts: {path} is not UTF-8 text ({e.reason})") from None
    encoder = None
    form = 'each line must be one JSON object, {"ids": [int, ...]} or {"text": "..."}'
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise PipelineError(f"{where}: not valid JSON: {e}") from None
        if not isinstance(item, dict) or len(item) != 1 or next(iter(item)) not in ("ids", "text"):
            keys = sorted(item) if isinstance(item, dict) else None
            raise PipelineError(f"{where}: {form}" + (f"; got keys {keys}" if keys is not None else ""))
        if "ids" in item:
            ids = item["ids"]
            if not isinstance(ids, list) or not all(type(t) is int for t in ids):
                raise PipelineError(f"{where}: \"ids\" must be a list of integer token ids, got {json.dumps(ids)[:80]}")
            prompt = ids
        else:
            if not isinstance(item["text"], str):
                raise PipelineError(f"{where}: \"text\" must be a string, got {json.dumps(item['text'])[:80]}")
            encoder = encoder or _text_encoder(pipe, directory, where)
            prompt = encoder(item["text"])
        if not prompt:
            raise PipelineError(f"{where}: empty prompt")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise PipelineError(f"{where}: token id(s) {bad[:5]} outside the model's vocabulary [0, {vocab})")
        prompts.append(prompt)
        if origins is not None:
            origins.append(where)
    if not prompts:
        raise PipelineError(f"{path}: no prompts")
    return prompts


def _text_encoder(pipe: Pipeline, directory: Path | None, where: str):
    """Text prompts' tokenizer: Kimi's tiktoken in ``directory``, else a preset's byte tokenizer (the
    one ``serve`` uses for presets)."""
    if pipe.model.path is None and (directory is None or not (directory / "tiktoken.model").exists()):
        return ByteTokenizer().encode
    try:
        return _tokenizer(directory)
    except PipelineError as e:
        raise PipelineError(f"{where}: {e}") from None


def check_output(pipe: Pipeline) -> None:
    """Fail before any work when ``output.json`` cannot be written: a directory, a path under a
    file, or a directory without write permission (a probe file is made and removed)."""
    if not pipe.output.json:
        return
    out = Path(pipe.output.json)
    what = f"{pipe.source}: output.json {out}"
    if out.is_dir():
        raise PipelineError(f"{what} is a directory; give a file path")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise PipelineError(f"{what}: a parent of it is a file, not a directory") from None
    except OSError as e:
        raise PipelineError(f"{what}: cannot make its directory: {e.strerror}") from None
    probe = out.with_name(f".{out.name}.probe{os.getpid()}")
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise PipelineError(f"{what}: cannot write in {out.parent}: {e.strerror}") from None


def _tokenizer(directory: Path | None):
    if directory is None:
        raise PipelineError("text prompts need the checkpoint's tokenizer, and model.load: dummy has no checkpoint: "
                            "give {\"ids\": [...]} prompts or a synthetic workload")
    try:
        return kimi_tokenizer(directory).encode
    except TokenizerError as e:
        raise PipelineError(str(e)) from None


def greedy_continuation(model, horizon: int, page_size: int = 64, max_cached: int | None = None):
    """``continuation(rid, prompt)`` for the oracle drafter: the target's own greedy decode of
    ``horizon`` tokens after ``prompt`` (a plain autoregressive engine, one request at a time in a
    private cache), cached per prompt; ``max_cached``: keep only that many most recently used
    prompts' continuations (None: all, for a run whose prompts are known up front)."""
    known: OrderedDict[tuple, list[int]] = OrderedDict()

    def continuation(rid, prompt):
        key = tuple(prompt)
        if key in known:
            known.move_to_end(key)
        else:
            eng = Engine(model, max_batch=1, page_size=page_size, max_context=len(prompt) + horizon)
            known[key] = eng.run([Request(0, list(prompt), horizon)])[0].output
            if max_cached is not None and len(known) > max_cached:
                known.popitem(last=False)
        return known[key]

    continuation.cached = known  # for tests and metrics: the continuations held now
    return continuation


# prompts whose oracle continuations a server keeps (its prompts are not known up front)
ORACLE_SERVE_CACHE = 256


def make_drafter(pipe: Pipeline, model: TargetModel, max_new: int, prompts: list[list[int]], log=None):
    """The pipeline's drafter for ddtree / chain decoding (None for autoregressive). The oracle's
    greedy continuations are decoded here, before the timed run (every rank decodes them alike);
    without prompts (a server) each new prompt is decoded when it arrives, and only the
    ORACLE_SERVE_CACHE most recent are kept."""
    from ..speculative.drafters import OracleDrafter, RandomDrafter

    d = pipe.decode
    if d.mode == "autoregressive":
        return None
    spec, vocab = d.drafter, model.cfg.vocab_size
    if spec.kind == "random":
        return RandomDrafter(model.backend, vocab, spec.depth, seed=spec.seed)
    if spec.kind == "dflash":
        from ..speculative.dflash import DFlashDrafter

        try:
            return DFlashDrafter.load(spec.path, model, window=spec.window)
        except ValueError as e:
            raise PipelineError(f"{pipe.source}: decode.drafter.path {spec.path}: {e}") from None
    cont = greedy_continuation(model, max_new + spec.depth, pipe.runtime.page_size,
                               max_cached=None if prompts else ORACLE_SERVE_CACHE)
    with click.progressbar(prompts, label="oracle: target greedy decode", file=log or sys.stderr) as bar:
        for i, p in enumerate(bar):
            cont(i, p)
    return OracleDrafter(model.backend, vocab, spec.depth, cont, accept_p=spec.acceptance.p,
                         table=spec.acceptance.table, seed=spec.seed)


def _table(rows: list[tuple[str, str]]) -> str:
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(w)}  {v}" for k, v in rows)


def build_engine(pipe: Pipeline, max_batch: int, profile: bool = False,
                 prompts: list[list[int]] | None = None, ranks: Ranks | None = None) -> tuple[Engine, dict]:
    """The pipeline's engine (and its drafter): backend, kernels compiled, weights loaded (this
    rank's shard); also the load figures. ``prompts``: known up front (an oracle drafter decodes
    their continuations here). ``ranks``: from ``ranks_for`` (made here when not given)."""
    ranks = ranks or ranks_for(pipe)
    backend, log = ranks.backend, ranks.log
    ranks.echo(f"backend: {backend}" + (f", {ranks.comm.world_size} ranks ({ranks.comm.name})"
                                        if ranks.comm.world_size > 1 else ""))
    compile_s = compile_kernels(backend)
    directory = model_dir(pipe, ranks)
    cfg = model_config(pipe, directory)
    n_layers = pipe.model.layers or cfg.num_hidden_layers
    if ranks.comm.world_size > 1 and not ranks.simulated:
        from ..parallel.oneshot import attach

        try:
            how = attach(ranks.comm, pipe.runtime.allreduce, backend, cfg.hidden_size)
        except DistError as e:
            raise PipelineError(f"{pipe.source}: {e}") from None
        ranks.echo(f"sublayer all-reduce: {how} (runtime.allreduce {pipe.runtime.allreduce})")
    shard = Shard(ranks.env.rank, ranks.env.world_size, pipe.runtime.expert_parallel)
    if directory is None:  # before any weight is made
        check_dummy_fits(pipe, cfg.with_layers(n_layers), shard, backend)
    t0 = time.perf_counter()
    label = "making dummy weights" if directory is None else "loading weights"
    with click.progressbar(length=n_layers, label=label, file=log) as bar:
        last = [0]

        def progress(n):
            bar.update(n - last[0])
            last[0] = n

        try:
            sm = {"small_m_path": pipe.runtime.small_m_path, "batch_invariant": pipe.runtime.batch_invariant}
            if directory is None:
                m = pipe.model
                model = TargetModel.dummy(cfg, backend, seed=m.seed, head=m.head, progress=progress, shard=shard,
                                          comm=ranks.comm, **sm)
            else:
                model = TargetModel.load(directory, backend, layers=pipe.model.layers, progress=progress,
                                         shard=shard, comm=ranks.comm, **sm)
        except ShardError as e:
            raise PipelineError(f"{pipe.source}: runtime.tensor_parallel {shard.world}"
                                f"{' with expert_parallel' if shard.expert_parallel else ''}: {e}") from None
    load_s = time.perf_counter() - t0
    if backend.is_cuda:
        from ..rtc import freeze

        freeze()
    w, d = pipe.workload, pipe.decode
    new = w.synthetic.output_len if w.synthetic is not None else w.max_new_tokens
    drafter = make_drafter(pipe, model, new, prompts or [], log)
    try:
        from ..engine.decode.budget import CostModel

        cost = CostModel.load(d.cost_table) if d.cost_table is not None else None
        engine = Engine(model, max_batch=max_batch, page_size=pipe.runtime.page_size,
                        max_context=pipe.runtime.max_context, seed=d.seed, profile=profile,
                        cuda_graphs=pipe.runtime.cuda_graphs, mode=d.mode, drafter=drafter, budget=d.budget,
                        max_budget=d.max_budget, cost=cost, budget_choice=d.budget_choice, auto_rows=d.auto_rows)
    except ValueError as e:
        raise PipelineError(f"{pipe.source}: {e}") from None
    return engine, {"dir": directory, "compile_s": compile_s, "load_s": load_s}


def budget_rows(auto) -> tuple:
    """Summary rows of decode.budget auto: the nodes it chose, predicted vs measured tau, tokens
    per modelled verify second."""
    st = auto.stats.summary()
    top = sorted(st["nodes_hist"].items(), key=lambda kv: -kv[1])[:6]
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    return (("budget auto: nodes chosen", ", ".join(f"{k}: {v}" for k, v in top) + f" (of {auto.max_budget})"),
            ("budget auto: tau predicted / measured", f"{fmt(st['tau_predicted'], '.2f')} / "
                                                      f"{fmt(st['tau_measured'], '.2f')} over drafted rounds"),
            ("budget auto: tokens per verify s", f"{fmt(st['tokens_per_verify_s'], '.1f')} (modelled, "
                                                 f"{auto.cost.source}); {st['skipped_drafts']} rounds without a draft"))


def parallel_metrics(engine: Engine) -> dict | None:
    """Collectives this rank made (None on one rank): calls and bytes per kind, the layout's
    all-reduces per layer, and bytes per engine step (one decode step or round of every request)."""
    model = engine.model
    comm, shard = model.comm, model.shard
    if shard.world == 1:
        return None
    calls, nbytes = comm.stats.total()
    return {"tensor_parallel": shard.world, "expert_parallel": shard.expert_parallel, "transport": comm.name,
            "sublayer_allreduce": "oneshot" if comm.oneshot is not None else comm.name,
            "all_reduce_per_layer": 2, "all_gather_per_forward": 1, "collectives": comm.stats.snapshot(),
            "collective_calls": calls, "collective_bytes": nbytes,
            "collective_bytes_per_step": nbytes / engine.stats.steps if engine.stats.steps else None}


class ProgressLines:
    """Progress for a log that is not a terminal (a file, a pipe, a CI job), where a progress bar
    shows nothing until the end: one line at each tenth of the requests and at least every
    ``every_s`` seconds, with requests done, tokens generated and tok/s so far."""

    def __init__(self, log, requests: list[Request], every_s: float = 30.0):
        self.log, self.requests, self.total, self.every_s = log, requests, len(requests), every_s
        self.done, self.t0 = 0, time.perf_counter()
        self.last_t, self.last_tenth = self.t0, 0

    def update(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        tenth = 10 * self.done // self.total
        if tenth > self.last_tenth or now - self.last_t >= self.every_s or self.done == self.total:
            self.last_t, self.last_tenth = now, tenth
            gen = sum(len(r.output) for r in self.requests)
            wall = now - self.t0
            click.echo(f"progress: {self.done}/{self.total} requests, {gen} tokens, {wall:.1f} s, "
                       f"{gen / wall if wall else 0:.1f} tok/s", file=self.log)


def run_pipeline(pipe: Pipeline, quiet: bool = False, ranks: Ranks | None = None) -> dict:
    w = pipe.workload
    ranks = ranks or ranks_for(pipe)
    quiet = quiet or not ranks.is_main
    if ranks.is_main:
        check_output(pipe)
    directory = model_dir(pipe, ranks)
    origins: list[str] = []
    prompts = load_prompts(pipe, model_config(pipe, directory).vocab_size, directory, origins)
    engine, info = build_engine(pipe, max_batch=min(w.concurrency, pipe.runtime.max_batch), profile=True,
                                prompts=prompts, ranks=ranks)
    model, backend, drafter = engine.model, engine.backend, engine.drafter
    compile_s, load_s = info["compile_s"], info["load_s"]
    d = pipe.decode
    new = w.synthetic.output_len if w.synthetic is not None else w.max_new_tokens
    reqs = [Request(i, p, new, temperature=d.temperature, top_p=d.top_p) for i, p in enumerate(prompts)]
    for r in reqs:
        try:
            engine.submit(r)
        except ValueError as e:  # name the prompt's line, not the engine's request number
            msg = str(e).removeprefix(f"request {r.rid}: ")
            raise PipelineError(f"{origins[r.rid]}: {msg} (workload.max_new_tokens / output_len {new}, "
                                f"runtime.max_context {pipe.runtime.max_context})") from None
    ranks.comm.stats = CommStats()  # count the timed run's collectives only
    t0 = time.perf_counter()
    if ranks.is_main and not ranks.log.isatty():
        done = engine.run([], progress=ProgressLines(ranks.log, reqs).update)
    else:
        with click.progressbar(length=len(reqs), label="running workload", file=ranks.log) as bar:
            done = engine.run([], progress=bar.update)
    wall = time.perf_counter() - t0
    st = engine.stats
    lat = [r.t_done - r.t_arrive for r in done]
    ttft = [r.t_first - r.t_arrive for r in done]
    gen = sum(len(r.output) for r in done)
    # a user's decode rate: tokens after the first (which the prefill gives) over the time they took
    per_user = [(len(r.output) - 1) / (r.t_done - r.t_first) for r in done
                if len(r.output) > 1 and r.t_done > r.t_first]
    metrics = {
        "requests": len(done), "prompt_tokens": sum(len(r.prompt) for r in done), "generated_tokens": gen,
        "wall_s": wall, "tok_per_s": gen / wall if wall else None,
        "tok_per_s_per_user": statistics.mean(per_user) if per_user else None, "steps": st.steps,
        "latency_s": {"mean": statistics.mean(lat), "p50": statistics.median(lat), "max": max(lat)},
        "ttft_s": {"mean": statistics.mean(ttft), "max": max(ttft)},
        "stage_s": dict(st.stage_seconds), "compile_s": compile_s, "load_s": load_s,
        "decode_rounds": st.decode_rounds,
        "speculative": None if engine.round is None else {
            "tau": engine.round.stats.tau, "rounds": engine.round.stats.rounds,
            "tokens_per_round_hist": {str(k): v for k, v in sorted(engine.round.stats.accept_hist.items())},
            "acceptance_by_depth": engine.round.stats.acceptance_by_depth(),
            "budget": "auto" if engine.round.auto is not None else engine.round.budget,
            "auto": None if engine.round.auto is None else {
                **engine.round.auto.stats.summary(), "max_budget": engine.round.auto.max_budget,
                "row_buckets": "graphs" if engine.round.auto.bucketed else "every count",
                "max_rows": engine.round.auto.max_rows,
                "cost_model": engine.round.auto.cost.to_json()}},
        "cuda_graphs": None if engine.graphs is None else {"captured": engine.graphs.captures,
                                                           "replays": engine.graphs.replays},
        "parallel": parallel_metrics(engine),
        "weight_bytes": model.weight_nbytes(),
    }
    result = {
        "pipeline": pipe.source, "backend": backend.name, "arch": backend.arch,
        "model": {"dir": str(directory) if directory is not None else f"dummy ({pipe.model.preset})",
                  "load": pipe.model.load, "layers": model.num_layers, "hidden": model.cfg.hidden_size},
        "decode": {"mode": d.mode, "temperature": d.temperature, "top_p": d.top_p,
                   "budget": d.budget if d.mode == "ddtree" else None,
                   "max_budget": d.max_budget if d.budget == "auto" else None,
                   "drafter": None if drafter is None else drafter.name},
        "metrics": metrics,
        "requests": [{"id": r.rid, "prompt": r.prompt, "output": r.output, "finish": r.finish.value}
                     for r in done],
    }
    if ranks.simulated:
        c = ranks.comm
        result["simulated_rank"] = {"rank": c.rank, "world": c.world_size, "note": c.note(),
                                    "collective_hold_us": pipe.runtime.simulate_collective_us}
    if not quiet:
        rows = [("requests", str(len(done))), ("prompt tokens", str(metrics["prompt_tokens"])),
                ("generated tokens", str(gen)), ("wall time", f"{wall:.2f} s"),
                ("throughput", f"{metrics['tok_per_s']:.1f} tok/s"),
                ("tok/s per user (decode)", "-" if not per_user else f"{metrics['tok_per_s_per_user']:.1f}"),
                ("latency mean / p50 / max",
                 " / ".join(f"{metrics['latency_s'][k]:.3f}" for k in ("mean", "p50", "max")) + " s"),
                ("time to first token mean", f"{metrics['ttft_s']['mean']:.3f} s"),
                *(() if engine.round is None else (
                    ("decode", f"{d.mode}, {drafter.name} drafter, budget "
                               f"{'auto' if engine.round.auto is not None else engine.round.budget}"),
                    ("tau (tokens per round)", f"{engine.round.stats.tau:.2f} over {engine.round.stats.rounds} "
                                               f"request-rounds"),
                    ("acceptance by depth", " ".join(f"{a:.2f}" for a in engine.round.stats.acceptance_by_depth())),
                )),
                *(() if engine.round is None or engine.round.auto is None else budget_rows(engine.round.auto)),
                *((f"stage {k}", f"{v:.3f} s ({100 * v / wall:.0f}%)") for k, v in st.stage_seconds.items()),
                ("kernel compile / weight load", f"{compile_s:.1f} s / {load_s:.1f} s")]
        if engine.graphs is not None:
            rows.append(("CUDA graphs", f"{engine.graphs.captures} captured, {engine.graphs.replays} replayed"))
        par = metrics["parallel"]
        if par is not None:
            rows.append(("parallel", f"{par['tensor_parallel']} ranks ({par['transport']}), "
                                     f"{'expert' if par['expert_parallel'] else 'tensor'}-parallel experts"))
            rows.append((f"collectives (rank {model.shard.rank})", f"{par['collective_calls']} calls, "
                                                 f"{par['collective_bytes'] / 2**20:.2f} MiB, "
                                                 f"{par['collective_bytes_per_step'] / 2**10:.1f} KiB per step"))
        if ranks.simulated:
            rows.append(("simulated rank", ranks.comm.note()))
        click.echo(_table(rows))
    if pipe.output.json and ranks.is_main:
        out = Path(pipe.output.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        try:
            tmp.write_text(json.dumps(result, indent=1))
            tmp.replace(out)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise PipelineError(f"{pipe.source}: output.json {out}: cannot write: {e.strerror}") from None
        if not quiet:
            click.echo(f"wrote {out}")
    return result
