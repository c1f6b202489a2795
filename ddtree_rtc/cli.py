"""``ddtree-rtc``: the command line. Every command works on a CPU-only machine except where it says
it needs a GPU."""

from __future__ import annotations

import contextlib
import importlib
import json
import sys
import time
from pathlib import Path

import click

from . import __version__
from .rtc.arch import SUPPORTED_ARCHS

# name -> one line for `bench --help`; the module ddtree_rtc.bench.<name> has main(argv) -> report dict
BENCHMARKS = {
    "ceiling": "read / copy bandwidth, latency floor, mma.sync peak, cuBLAS matmul: what the others are held to",
    "blocks": "building-block kernels: RMSNorm, RoPE, embedding, SiLU·mul, argmax/sampling, cuBLAS linear",
    "linear": "skinny-M bf16 linear vs cuBLAS on the K2.6 decode shapes",
    "topk": "vocabulary top-k on drafter logits (--variants: stream / radix side by side)",
    "tree": "DDTree top-k, tree build and accept vs the Python heapq reference (--variants: checked, floors)",
    "moe": "INT4 W4A16 MoE layer vs the read ceiling and a bf16 cuBLAS peer (--variants: tiles; --sweep: plans)",
    "attention": "MLA decode / tree-verify / prefill attention vs read and matmul ceilings (--variants: tiles)",
    "decode": "AR decode step on a K2.6-dims slice: stage times vs byte floors, eager / queued / CUDA graph",
    "round": "DDTree round on a K2.6-dims slice: stages, kernels vs CUDA graph, tok/s at the oracle's tau vs AR",
    "drafter": "DFlash drafter forward / context extend at K2.6 dims and its GQA attention vs byte floors",
    "node": "K2.6 at 61 layers as one simulated rank of 8 (TP8 / TP-attn + EP-MoE): step, rounds, splits, projection",
    "allreduce": "sublayer all-reduce + residual norm: one-shot kernel vs NCCL, to_bf16, rmsnorm (--nproc: ranks)",
    "budget": "decode.budget auto vs fixed budgets, chain and AR on a pipeline per concurrency (tok/s per user)",
}


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ddtree-rtc")
def main():
    """ddtree-rtc: DDTree speculative decoding for Kimi K2.6-class MoE models, with raw CUDA kernels
    compiled at load time by NVRTC and driven through CuPy."""


def _versions() -> dict:
    info: dict = {"ddtree_rtc": __version__, "python": sys.version.split()[0]}
    try:
        from .rtc import nvrtc_version

        info["nvrtc"] = ".".join(map(str, nvrtc_version()))
    except Exception as e:  # noqa: BLE001 - report, don't fail
        info["nvrtc"] = f"unavailable ({e})"
    try:
        import cupy

        info["cupy"] = cupy.__version__
    except Exception as e:  # noqa: BLE001
        info["cupy"] = f"unavailable ({type(e).__name__})"
    return info


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the information as JSON.")
def info(as_json):
    """Show the GPU, the arch kernels are built for, and driver / runtime / NVRTC / CuPy / NCCL
    versions (or say that no GPU is present and the numpy backend is used)."""
    from .backend import cuda_available
    from .rtc import ArchError, detect_arch

    data = _versions()
    if cuda_available():
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        data.update(gpu=name, compute_capability=f"{props['major']}.{props['minor']}",
                    sms=props["multiProcessorCount"], memory_gib=round(props["totalGlobalMem"] / 2**30, 1),
                    driver=_cuda_version(cupy.cuda.runtime.driverGetVersion()),
                    runtime=_cuda_version(cupy.cuda.runtime.runtimeGetVersion()), backend="cuda")
        try:
            data["arch"] = detect_arch()
        except ArchError as e:
            data["arch"] = f"unsupported ({e})"
        try:
            from cupy.cuda import nccl

            v = nccl.get_version()
            data["nccl"] = f"{v // 10000}.{v // 100 % 100}.{v % 100}"
        except Exception as e:  # noqa: BLE001
            data["nccl"] = f"unavailable ({type(e).__name__})"
    else:
        data.update(gpu=None, backend="numpy", note="no GPU: numpy backend")
    if as_json:
        click.echo(json.dumps(data, indent=1))
        return
    width = max(map(len, data))
    for k, v in data.items():
        click.echo(f"{k.ljust(width)}  {v if v is not None else '-'}")


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


@main.group()
def kernels():
    """List, build, and dump the registered CUDA kernel families."""


@kernels.command("list")
def kernels_list():
    """List every kernel family with its entry points and description."""
    from .kernels.registry import SPECS

    width = max(map(len, SPECS))
    for name, spec in sorted(SPECS.items()):
        flag = " [arch-specific]" if spec.arch_specific else ""
        click.echo(f"{name.ljust(width)}  {spec.description}{flag}")
        click.echo(f"{''.ljust(width)}  entries: {', '.join(spec.entries)}")


def _arch_list(arch: str) -> list[str]:
    from .rtc import check_arch, detect_arch

    if arch == "all":
        return list(SUPPORTED_ARCHS)
    if arch == "auto":
        return [detect_arch()]
    return [check_arch(arch)]


ARCH_CHOICE = click.Choice([*SUPPORTED_ARCHS, "all", "auto"])


@kernels.command("build")
@click.option("--arch", default="all", type=ARCH_CHOICE, show_default=True,
              help="Target arch; 'auto' = the current GPU's, 'all' = every supported arch.")
@click.option("--only", multiple=True, help="Build only these families (repeatable).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the table as JSON.")
def kernels_build(arch, only, json_path):
    """Compile kernel families through NVRTC (into the on-disk cache) and print a table of entry
    points with registers / shared memory / stack / spills. Needs no GPU."""
    from .kernels.registry import SPECS, spec
    from .rtc import CompileError, build

    try:
        names = [spec(n).name for n in only] if only else sorted(SPECS)
    except KeyError as e:
        raise click.BadParameter(str(e.args[0]), param_hint="--only") from None
    archs = _arch_list(arch)
    rows, spill_problems, per_arch = [], [], {}
    jobs = [(a, n) for a in archs for n in names]
    with click.progressbar(jobs, label="building", file=sys.stderr,
                           item_show_func=lambda j: f"{j[1]} {j[0]}" if j else "") as bar:
        for a, n in bar:
            t0 = time.perf_counter()
            try:
                built = build(SPECS[n], a)
            except (CompileError, OSError) as e:
                raise click.ClickException(str(e)) from None
            per_arch[a] = per_arch.get(a, 0.0) + (time.perf_counter() - t0)
            for entry in SPECS[n].entries:
                r = built.resources[entry]
                rows.append({"arch": a, "target": built.target, "family": n, "entry": entry, **r,
                             "compile_s": round(built.compile_seconds, 3), "cached": built.cached})
                if (r.get("spill_stores") or 0) + (r.get("spill_loads") or 0) and not SPECS[n].allow_spills:
                    spill_problems.append(f"{n}:{entry} on {a}")
    cols = ("arch", "family", "entry", "registers", "shared", "stack", "spill_stores", "spill_loads",
            "compile_s")
    heads = ("arch", "family", "entry", "regs", "smem B", "stack B", "spill st", "spill ld", "compile s")
    table = [[("?" if r[c] is None else str(r[c])) for c in cols] for r in rows]
    widths = [max(len(h), *(len(t[i]) for t in table)) for i, h in enumerate(heads)]
    click.echo(" | ".join(h.ljust(w) for h, w in zip(heads, widths)))
    click.echo("-|-".join("-" * w for w in widths))
    for t in table:
        click.echo(" | ".join(c.ljust(w) for c, w in zip(t, widths)))
    click.echo("wall time per arch (s): " + ", ".join(f"{a} {s:.2f}" for a, s in per_arch.items()))
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(rows, indent=1))
    if spill_problems:
        raise click.ClickException("register spills in: " + ", ".join(spill_problems))


@kernels.command("dump")
@click.argument("name")
@click.option("--arch", default="sm_90a", type=ARCH_CHOICE, show_default=True,
              help="Target arch ('auto' = the current GPU's).")
@click.option("--ptx", "what", flag_value="ptx", help="Dump the PTX.")
@click.option("--sass", "what", flag_value="sass", help="Dump the SASS (needs nvdisasm or cuobjdump).")
@click.option("--resources", "what", flag_value="resources", default=True,
              help="Print registers / shared / stack / spills per entry (default).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write to this file instead of stdout.")
def kernels_dump(name, arch, what, output):
    """Dump one kernel family's PTX, SASS or resource usage for an arch. Needs no GPU."""
    from .kernels.registry import spec
    from .rtc import CompileError, build
    from .rtc.disasm import sass

    if arch == "all":
        raise click.BadParameter("dump takes one arch", param_hint="--arch")
    try:
        s = spec(name)
    except KeyError as e:
        raise click.BadParameter(str(e.args[0]), param_hint="NAME") from None
    try:
        built = build(s, _arch_list(arch)[0])
    except (CompileError, OSError) as e:
        raise click.ClickException(str(e)) from None
    if what == "ptx":
        text = built.ptx
    elif what == "sass":
        text = sass(built.cubin)
    else:
        text = json.dumps(built.resources, indent=1) + "\n"
    if output:
        Path(output).write_text(text)
        click.echo(f"wrote {output} ({len(text)} chars)", err=True)
    else:
        click.echo(text, nl=False)


@kernels.command("clear-cache")
def kernels_clear_cache():
    """Delete every compiled module from the on-disk cache ($DDTREE_RTC_CACHE_DIR)."""
    from .rtc import ModuleCache

    cache = ModuleCache()
    click.echo(f"removed {cache.clear()} files from {cache.root}")


@main.command("run")
@click.argument("pipeline", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a pipeline field, e.g. --set decode.temperature=0.7 (repeatable).")
@click.option("--quiet", is_flag=True, help="No summary table (the JSON output is still written).")
@click.option("--nproc", type=click.IntRange(min=1), default=None,
              help="Spawn this many local ranks (one per GPU; runtime.tensor_parallel must match).")
def run_cmd(pipeline, overrides, quiet, nproc):
    """Run a pipeline YAML: compile every kernel, load the model with a progress bar, run the workload,
    print a summary table (tokens, tok/s, latency, per-stage time) and write the JSON it names.
    On several ranks (--nproc N, or N processes started by torchrun / mpirun / srun) rank 0 prints
    and writes the JSON; the first rank to fail ends the job with its error.

    \b
    ddtree-rtc run pipelines/tiny.yaml
    ddtree-rtc run pipelines/k2_6_slice_h200.yaml --set workload.concurrency=8
    ddtree-rtc run pipelines/tiny.yaml --nproc 2 --set runtime.tensor_parallel=2
    """
    from .backend import BackendUnavailableError
    from .engine.request import RequestError
    from .model.checkpoint import CheckpointError
    from .model.config import ConfigError
    from .parallel.comm import DistError
    from .pipeline.runner import ranks_for, run_pipeline
    from .pipeline.schema import PipelineError, load_pipeline, parse_set_options

    try:
        pipe = load_pipeline(pipeline, parse_set_options(overrides))
        if nproc is not None:
            _spawn_ranks(pipe, pipeline, overrides, quiet, nproc)
            return
        ranks = ranks_for(pipe)
        if ranks.comm.world_size > 1:  # a launcher's SIGTERM still runs the finally below (frees the transport)
            import signal

            signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        try:
            run_pipeline(pipe, quiet=quiet, ranks=ranks)
            ranks.comm.barrier()  # nobody tears the transport down under a peer
        finally:
            ranks.comm.close()
    except (PipelineError, ConfigError, CheckpointError, RequestError, BackendUnavailableError, DistError) as e:
        raise click.ClickException(str(e)) from None


def _check_nproc(pipe, nproc: int) -> None:
    """``--nproc N`` spawns the ranks itself: refuse it inside a launcher's rank, or when the pipeline's
    tensor_parallel is not N."""
    import os

    from .parallel.launch import LAUNCHERS
    from .pipeline.schema import PipelineError

    inside = [r for _, r, _, _ in LAUNCHERS if r in os.environ]
    if inside:
        raise PipelineError(f"--nproc {nproc}: this process is already a rank ({inside[0]} is set); "
                            f"let the launcher start the ranks, or drop --nproc")
    if pipe.runtime.tensor_parallel != nproc:
        raise PipelineError(f"--nproc {nproc} but {pipe.source} has runtime.tensor_parallel "
                            f"{pipe.runtime.tensor_parallel}: add --set runtime.tensor_parallel={nproc}")


def _spawn_ranks(pipe, pipeline: str, overrides, quiet: bool, nproc: int) -> None:
    """``run --nproc N``: N copies of this run command as ranks 0..N-1 of one local job."""
    from .parallel.launch import rank_command, spawn

    _check_nproc(pipe, nproc)
    args = ["run", pipeline, *[a for o in overrides for a in ("--set", o)], *(["--quiet"] if quiet else [])]
    spawn(rank_command(args), nproc)


@main.command("serve")
@click.argument("pipeline", type=click.Path(dir_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--max-queue", default=256, show_default=True, type=int,
              help="Requests held (waiting + running) before new ones get 429.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a pipeline field.")
@click.option("--nproc", type=click.IntRange(min=1), default=None,
              help="Spawn this many local ranks (runtime.tensor_parallel must match); rank 0 serves HTTP.")
@click.option("--rank-timeout", type=click.FloatRange(min=0.1), default=5.0, show_default=True,
              help="Several ranks: seconds within which a dead or hung rank is noticed (then in-flight "
                   "requests get a 503 naming it and the server exits non-zero).")
def serve_cmd(pipeline, host, port, max_queue, overrides, nproc, rank_timeout):
    """Serve a pipeline's engine behind the OpenAI API (needs `pip install .[serve]`). On several ranks
    (--nproc N, or N processes started by torchrun / mpirun / srun) rank 0 serves and every rank runs
    the engine loop in lockstep.

    \b
    ddtree-rtc serve pipelines/tiny.yaml --port 8000
    ddtree-rtc serve pipelines/tiny.yaml --nproc 2 --set runtime.tensor_parallel=2
    """
    from .parallel.comm import DistError
    from .pipeline.schema import PipelineError, load_pipeline, parse_set_options

    try:
        from .serve.ranks import serve_ranks
        from .serve.server import serve
    except ImportError as e:
        raise click.ClickException(f"serve needs its extra: pip install '.[serve]' ({e})") from None
    from .backend import BackendUnavailableError
    from .model.checkpoint import CheckpointError
    from .model.config import ConfigError

    try:
        pipe = load_pipeline(pipeline, parse_set_options(overrides))
        if nproc is not None:
            args = ["serve", pipeline, "--host", host, "--port", str(port), "--max-queue", str(max_queue),
                    "--rank-timeout", str(rank_timeout), *[a for o in overrides for a in ("--set", o)]]
            sys.exit(_supervise_ranks(pipe, args, nproc, rank_timeout))
        if pipe.runtime.tensor_parallel > 1:  # this process is one of the ranks (a launcher started it)
            code = serve_ranks(pipe, host, port, max_queue, rank_timeout)
        else:
            serve(pipe, host, port, max_queue)
            code = 0
    except (PipelineError, ConfigError, CheckpointError, BackendUnavailableError, DistError) as e:
        raise click.ClickException(str(e)) from None
    if code:
        sys.exit(code)


def _supervise_ranks(pipe, args: list[str], nproc: int, rank_timeout: float) -> int:
    """``serve --nproc N``: N copies of this serve command as ranks 0..N-1 (parallel/lockstep.supervise)."""
    from .parallel.launch import rank_command
    from .parallel.lockstep import supervise

    _check_nproc(pipe, nproc)
    return supervise(rank_command(args), nproc, grace_s=2 * rank_timeout + 10)


@main.command("make-model")
@click.option("--preset", type=click.Choice(["tiny", "small", "k2.6", "dflash-tiny", "dflash-k2.6"]), required=True,
              help="tiny: runs on the numpy backend in seconds; small: a few hundred MB; k2.6: K2.6's exact dims; "
                   "dflash-tiny / dflash-k2.6: a random DFlash drafter (z-lab's format) for the tiny / k2.6 target.")
@click.option("--layers", type=int, help="Number of decoder layers (k2.6 with 4 layers is about 40 GB).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random weights.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), required=True,
              help="Output directory (made whole or not at all; an existing non-empty one needs --force).")
@click.option("--force", is_flag=True, help="Replace a non-empty --out directory.")
@click.option("--weight-shape-dtype", type=click.Choice(["int32", "int64"]), default="int32", show_default=True,
              help="Stored dtype of the experts' weight_shape (Kimi: int32; compressed-tensors 0.20: int64).")
@click.option("--router-dtype", type=click.Choice(["bf16", "fp32"]), default="bf16", show_default=True,
              help="Stored dtype of mlp.gate.weight (fp32 when saved from an fp32 model).")
@click.option("--bias-dtype", type=click.Choice(["fp32", "bf16"]), default="fp32", show_default=True,
              help="Stored dtype of mlp.gate.e_score_correction_bias.")
@click.option("--head", type=click.Choice(["random", "decisive"]), default="random", show_default=True,
              help="lm_head form: decisive makes every greedy choice far from a tie (for oracle-drafter benchmarks).")
def make_model_cmd(preset, layers, seed, out_dir, weight_shape_dtype, router_dtype, bias_dtype, head, force):
    """Write a seeded random-weight checkpoint in the real format: HF DeepseekV3 names, compressed-tensors
    INT4 routed experts, bf16 elsewhere, non-zero router bias, complete config.json. The files are
    written to a temporary directory beside --out and renamed into place at the end, so an
    interrupted run leaves nothing half-made, and old shards are never mixed with new ones."""
    from .model.config import ConfigError, preset_config
    from .model.make_model import make_model

    cfg = None
    if not preset.startswith("dflash-"):
        try:
            cfg = preset_config(preset)
            if layers is not None:
                cfg = cfg.with_layers(layers)
        except ConfigError as e:
            raise click.BadParameter(str(e), param_hint="--layers") from None
    out = Path(out_dir).absolute()  # "--out ." has a name to rename to
    if out.exists() and any(out.iterdir()) and not force:
        raise click.ClickException(f"--out {out} is not empty ({sum(1 for _ in out.iterdir())} entries); "
                                   f"give an empty or new directory, or --force to replace it")
    with _made_whole(out) as tmp:
        if cfg is None:
            from .model.dflash import make_dflash

            make_dflash(preset, tmp, seed=seed)
        else:
            with click.progressbar(length=cfg.num_hidden_layers + 1, label=f"writing {preset}",
                                   file=sys.stderr) as bar:
                make_model(cfg, tmp, seed=seed, progress=lambda _key: bar.update(1),
                           weight_shape_dtype=weight_shape_dtype, router_dtype=router_dtype, bias_dtype=bias_dtype,
                           head=head)
    total = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    what = f"{preset} drafter" if cfg is None else f"{cfg.num_hidden_layers} layers"
    click.echo(f"wrote {out_dir}: {what}, {total / 2**20:.1f} MiB")


@contextlib.contextmanager
def _made_whole(out: Path):
    """A fresh temporary directory beside ``out``, renamed to ``out`` (replacing it) when the block
    ends normally and removed when it does not."""
    import os
    import shutil

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():
            old = out.with_name(f".{out.name}.old{os.getpid()}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                "help_option_names": []})
@click.argument("name", required=False)
@click.pass_context
def bench(ctx, name):
    """Run a benchmark on the GPU (extra arguments go to it: `bench NAME --help` lists them)."""
    if name is None or name in ("-h", "--help"):
        click.echo(ctx.get_help())
        return
    if name not in BENCHMARKS:
        raise click.BadParameter(f"{name!r} is not one of {', '.join(sorted(BENCHMARKS))}", param_hint="NAME")
    try:
        mod = importlib.import_module(f"ddtree_rtc.bench.{name}")
    except ModuleNotFoundError as e:
        raise click.ClickException(f"benchmark {name!r} is not available in this build: {e}") from None
    if not {"-h", "--help"} & set(ctx.args):
        from .backend import cuda_available

        if not cuda_available():
            raise click.ClickException(f"bench {name} times kernels on a CUDA GPU, and none is usable here "
                                       f"(`ddtree-rtc info` says why); `bench {name} --help` works anywhere")
    mod.main(list(ctx.args))


@main.command("projection")
@click.option("--platforms", default=None, help="Comma-separated platform keys (default: rtx_pro_6000,h200,b200,b300).")
@click.option("--budget", type=int, default=None, help="Fix the tree budget (default: the one maximising tok/s).")
@click.option("--tau", type=float, default=None,
              help="Fixed tokens per round at --budget; must be <= min(budget + 1, depth + 1).")
@click.option("--tau-from", "tau_from", default=None, metavar="FILE[:RUN]",
              help="tau from a run JSON's tokens-per-round histogram (FILE:RUN picks one of several 'runs').")
@click.option("--tau-source", type=click.Choice(["published", "oracle"]), default="published", show_default=True,
              help="published: z-lab K2.5-DFlash chain acceptance with the DDTree band; oracle: the oracle profile.")
@click.option("--dataset", default="mean", show_default=True,
              help="Published chain acceptance to use: mean, gsm8k, math500, humaneval, mbpp, mt-bench.")
@click.option("--context", type=int, default=4096, show_default=True, help="Context length of every request.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write splits, levers, calibration as JSON.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Per-token stacked bars (needs matplotlib).")
@click.option("--markdown", "md_path", type=click.Path(dir_okay=False),
              help="Write the page (docs/hardware.md is this file for the default arguments).")
def projection_cmd(platforms, budget, tau, tau_from, tau_source, dataset, context, json_path, plot_path, md_path):
    """Project K2.6 AR and DDTree decoding onto 8-GPU platforms from this repository's measurements."""
    from .projection import ProjectionError, report
    from .projection import tau as taus
    from .reference.tree_build import MAX_BUDGET
    try:
        if budget is not None and not 0 <= budget <= MAX_BUDGET:
            raise ProjectionError(f"--budget {budget} is outside the tree builder's range 0..{MAX_BUDGET}")
        if context <= 0:
            raise ProjectionError(f"--context {context} must be positive")
        if sum(x is not None for x in (tau, tau_from)) > 1:
            raise ProjectionError("give at most one of --tau and --tau-from")
        if tau is not None:
            if budget is None:
                raise ProjectionError("--tau holds at one budget: give --budget too")
            t = taus.fixed(tau, budget)
        elif tau_from:
            t = taus.from_run(tau_from)
            if budget is not None and budget != t.budget:
                raise ProjectionError(f"--budget {budget} differs from the run's budget {t.budget} (--tau-from)")
        else:
            t = taus.published(dataset) if tau_source == "published" else taus.oracle()
            if budget is not None:
                t = taus.at_budget(t, budget)
        d = report.build(platforms.split(",") if platforms else None, t, context)
    except ProjectionError as e:
        raise click.ClickException(str(e)) from None
    text = report.markdown(d)
    click.echo(text)
    for path, body in ((json_path, lambda: json.dumps(d, indent=1)), (md_path, lambda: report.page(d))):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(body())
    if plot_path:
        Path(plot_path).parent.mkdir(parents=True, exist_ok=True)
        report.plot(d, plot_path)


bench.help = bench.help + "\n\n\b\n" + "\n".join(f"{k:<10} {v}" for k, v in BENCHMARKS.items())

if __name__ == "__main__":
    main()
