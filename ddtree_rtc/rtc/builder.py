"""Build a kernel family: source + headers -> cached CUBIN/PTX -> loaded CuPy module.

Compiling needs no GPU (CI builds every family for every arch); loading needs one.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from .. import __version__
from . import arch as _arch
from .cache import ModuleCache
from .cubin import resource_usage
from .nvrtc import compile_cuda, nvrtc_version, parse_ptxas_log

SRC_ENV = "DDTREE_RTC_CUDA_SRC"
LATE_COMPILE_ENV = "DDTREE_RTC_NO_LATE_COMPILE"
BASE_OPTIONS = ("-std=c++17", "-lineinfo", "-Xptxas=-v", "-default-device")


class LateCompileError(RuntimeError):
    pass


def source_dir() -> Path:
    """``$DDTREE_RTC_CUDA_SRC`` when set, else ``cuda_src/`` inside the installed package: the sources
    ship in the wheel as package data, so a build works outside the repository checkout."""
    env = os.environ.get(SRC_ENV)
    return Path(env) if env else Path(str(resources.files("ddtree_rtc") / "cuda_src"))


def read_headers(src: Path | None = None) -> dict[str, str]:
    """Every shared header, by include name; all of them go into every cache key."""
    inc = (src or source_dir()) / "include"
    return {p.name: p.read_text() for p in sorted(inc.glob("*.cuh"))}


@dataclass(frozen=True)
class KernelSpec:
    """One kernel family, declared once: ``ddtree_rtc/cuda_src/<name>.cu`` with ``extern "C"`` entries."""

    name: str
    entries: tuple[str, ...]
    description: str
    params: dict[str, int] = field(default_factory=dict)  # compile-time -D defaults
    arch_specific: bool = False  # needs sm_XXa features (wgmma, setmaxnreg, ...)
    allow_spills: str | None = None  # reason, when spills are accepted

    def options(self, **overrides) -> list[str]:
        unknown = set(overrides) - set(self.params)
        if unknown:
            raise KeyError(f"kernel {self.name!r} has no compile-time parameter(s) {sorted(unknown)}; "
                           f"it takes {sorted(self.params)}")
        merged = {**self.params, **overrides}
        return [*BASE_OPTIONS, *(f"-D{k}={int(v)}" for k, v in sorted(merged.items()))]


@dataclass(frozen=True)
class BuiltModule:
    spec: KernelSpec
    target: str
    cubin: bytes
    ptx: str
    resources: dict[str, dict[str, int]]  # entry -> registers, stack, shared, spill_* (None if unknown)
    log: str
    compile_seconds: float
    cached: bool

    def spills(self) -> dict[str, int]:
        return {e: (r.get("spill_stores") or 0) + (r.get("spill_loads") or 0)
                for e, r in self.resources.items()}


def _resources(cubin: bytes, log: str, entries) -> dict[str, dict]:
    elf = resource_usage(cubin)
    ptxas = parse_ptxas_log(log)
    out = {}
    for e in entries:
        r = {"registers": None, "stack": None, "shared": None, "spill_stores": None, "spill_loads": None}
        r.update(elf.get(e, {}))
        r.update(ptxas.get(e, {}))
        out[e] = r
    return out


_frozen = False


def freeze() -> None:
    """Mark warm-up done: later builds warn, or fail when $DDTREE_RTC_NO_LATE_COMPILE=1."""
    global _frozen
    _frozen = True


def unfreeze() -> None:
    global _frozen
    _frozen = False


def _late(what: str) -> None:
    if not _frozen:
        return
    msg = f"{what} after warm-up: build every kernel before the decode loop"
    if os.environ.get(LATE_COMPILE_ENV, "") not in ("", "0"):
        raise LateCompileError(msg + f" (${LATE_COMPILE_ENV} is set)")
    warnings.warn(msg, stacklevel=3)


def build(spec: KernelSpec, arch: str, cache: ModuleCache | None = None, **params) -> BuiltModule:
    """Compile ``spec`` for ``arch`` (one of SUPPORTED_ARCHS), through the on-disk cache."""
    target = _arch.compile_target(arch, spec.arch_specific)
    src_dir = source_dir()
    path = src_dir / f"{spec.name}.cu"
    try:
        source = path.read_text()
    except OSError as e:
        raise FileNotFoundError(f"kernel {spec.name!r}: cannot read its source {path}: {e}") from e
    headers = read_headers(src_dir)
    options = spec.options(**params)
    cache = cache or ModuleCache()
    from .cache import cache_key

    key = cache_key(source, headers, options, target, nvrtc_version(), __version__)
    stem = cache.stem(spec.name, target, key)
    entry = cache.load(stem, key)
    if entry is None:
        with cache.lock(stem):
            entry = cache.load(stem, key)  # another process may have built it meanwhile
            if entry is None:
                _late(f"compiling kernel {spec.name!r} for {target}")
                t0 = time.perf_counter()
                res = compile_cuda(source, str(path), headers, options, target)
                seconds = time.perf_counter() - t0
                resources = _resources(res.cubin, res.log, spec.entries)
                missing = [e for e in spec.entries if e not in resource_usage(res.cubin)]
                if missing:
                    raise RuntimeError(f"kernel {spec.name!r}: entry point(s) {missing} not found in "
                                       f"{path.name}; are they extern \"C\" __global__?")
                meta = {"name": spec.name, "target": target, "options": options, "log": res.log,
                        "resources": resources, "compile_seconds": seconds,
                        "nvrtc": list(nvrtc_version())}
                cache.store(stem, key, res.cubin, res.ptx, meta)
                return BuiltModule(spec, target, res.cubin, res.ptx, resources, res.log, seconds, False)
    m = entry.meta
    log = m.get("log", "")
    # resources are re-read from the cubin, so a parser fix never leaves stale numbers in the cache
    return BuiltModule(spec, target, entry.cubin, entry.ptx, _resources(entry.cubin, log, spec.entries), log,
                       m.get("compile_seconds", 0.0), True)


class LoadedModule:
    """A built module loaded on the current device; ``fn(entry)`` gives a launchable function."""

    def __init__(self, built: BuiltModule):
        import cupy

        self.built = built
        self._module = cupy.cuda.function.Module()
        self._module.load(built.cubin)
        self._fns = {}

    def fn(self, entry: str):
        f = self._fns.get(entry)
        if f is None:
            if entry not in self.built.spec.entries:
                raise KeyError(f"kernel {self.built.spec.name!r} has no entry {entry!r}; "
                               f"it has {list(self.built.spec.entries)}")
            f = self._fns[entry] = self._module.get_function(entry)
        return f


_loaded: dict[tuple, LoadedModule] = {}


def load(spec: KernelSpec, arch: str | None = None, **params) -> LoadedModule:
    """Build (or fetch from cache) and load ``spec`` for the current GPU; memoised per process."""
    arch = _arch.detect_arch(arch)
    key = (spec.name, arch, tuple(sorted(params.items())))
    mod = _loaded.get(key)
    if mod is None:
        _late(f"loading kernel module {spec.name!r}")
        mod = _loaded[key] = LoadedModule(build(spec, arch, **params))
    return mod
