"""NVRTC through cuda-python: CUDA C++ source -> CUBIN + PTX for one exact arch.

Needs no GPU: NVRTC and the CUDA headers come from the NVIDIA pip wheels.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass


class CompileError(RuntimeError):
    pass


@functools.lru_cache(maxsize=1)
def _nvrtc():
    try:
        from cuda.bindings import nvrtc  # cuda-python >= 12.6
    except ImportError:  # pragma: no cover - older cuda-python layout
        try:
            from cuda import nvrtc
        except ImportError as e:
            raise CompileError(
                "cuda-python is not installed: pip install -e '.[cuda12]' (or '.[cuda13]')"
            ) from e
    return nvrtc


def _check(result, what: str):
    err = result[0]
    if int(err) != 0:
        _, msg = _nvrtc().nvrtcGetErrorString(err)
        raise CompileError(f"{what} failed: {msg.decode() if isinstance(msg, bytes) else msg}")
    return result[1:] if len(result) > 2 else (result[1] if len(result) == 2 else None)


@functools.lru_cache(maxsize=1)
def nvrtc_version() -> tuple[int, int]:
    major, minor = _check(_nvrtc().nvrtcVersion(), "nvrtcVersion")
    return int(major), int(minor)


@functools.lru_cache(maxsize=1)
def supported_targets() -> tuple[str, ...]:
    nv = _nvrtc()
    n = _check(nv.nvrtcGetNumSupportedArchs(), "nvrtcGetNumSupportedArchs")
    archs = _check(nv.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs")
    del n
    return tuple(f"sm_{a}" for a in archs)


@functools.lru_cache(maxsize=1)
def cuda_include_dirs() -> tuple[str, ...]:
    """CUDA's own headers (cuda_bf16.h, cuda_fp16.h, ...) from the pip wheels."""
    try:
        import cuda.pathfinder as pf
    except ImportError as e:
        raise CompileError("cuda-pathfinder is missing (it comes with cuda-python)") from e
    found = pf.find_nvidia_header_directory("cudart")
    if not found:
        raise CompileError(
            "CUDA runtime headers not found: install nvidia-cuda-runtime-cu12 (or nvidia-cuda-runtime "
            "for CUDA 13), e.g. pip install -e '.[cuda12]'"
        )
    return (str(found),)


@dataclass(frozen=True)
class CompileResult:
    cubin: bytes
    ptx: str
    log: str


def _read(getsize, getter, prog) -> bytes:
    size = _check(getsize(prog), getter.__name__ + "Size")
    # A mutable buffer: NVRTC writes into it. (`b" " * size` is, for size 1 (an empty log: just its
    # NUL), CPython's shared one-byte b" " object, and writing into it turned every later b" " in
    # the process into b"\x00", e.g. the space padding of safetensors headers written afterwards.)
    buf = bytearray(size)
    _check(getter(prog, buf), getter.__name__)
    return bytes(buf)


def compile_cuda(source: str, filename: str, headers: dict[str, str], options: list[str],
                 target: str) -> CompileResult:
    """Compile ``source`` for ``target`` (e.g. ``sm_90a``). ``headers`` are handed to NVRTC in
    memory by include name. Raises CompileError carrying NVRTC's log (file:line: error...)."""
    nv = _nvrtc()
    sm = target.removeprefix("sm_")
    # NVRTC lists family arches only; an arch-specific target (sm_90a) is accepted where its family is
    if target.removesuffix("a") not in supported_targets():
        raise CompileError(
            f"NVRTC {'.'.join(map(str, nvrtc_version()))} cannot target {target}; it supports "
            f"{', '.join(supported_targets())}. Install a newer NVRTC wheel."
        )
    names = sorted(headers)
    prog = _check(
        nv.nvrtcCreateProgram(source.encode(), filename.encode(), len(names),
                              [headers[n].encode() for n in names], [n.encode() for n in names]),
        "nvrtcCreateProgram",
    )
    try:
        opts = [f"--gpu-architecture=sm_{sm}", *options, *(f"-I{d}" for d in cuda_include_dirs())]
        err = nv.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])[0]
        log = _read(nv.nvrtcGetProgramLogSize, nv.nvrtcGetProgramLog, prog).rstrip(b"\0 ").decode(
            errors="replace")
        if int(err) != 0:
            raise CompileError(f"NVRTC failed to compile {filename} for {target}:\n{log}")
        cubin = _read(nv.nvrtcGetCUBINSize, nv.nvrtcGetCUBIN, prog)
        ptx = _read(nv.nvrtcGetPTXSize, nv.nvrtcGetPTX, prog).rstrip(b"\0").decode()
        return CompileResult(cubin=cubin, ptx=ptx, log=log)
    finally:
        nv.nvrtcDestroyProgram(prog)


_PTXAS_FN = re.compile(r"Compiling entry function '(\w+)' for")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas_log(log: str) -> dict[str, dict[str, int]]:
    """Per entry point: registers, stack frame and spill bytes from an ``-Xptxas=-v`` log
    (empty from some NVRTC releases, e.g. 13.0; callers fall back to the cubin's ELF)."""
    out: dict[str, dict[str, int]] = {}
    fn = None
    for line in log.splitlines():
        if m := _PTXAS_FN.search(line):
            fn = m.group(1)
            out[fn] = {}
        elif fn and (m := _PTXAS_SPILL.search(line)):
            out[fn].update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                           spill_loads=int(m.group(3)))
        elif fn and (m := _PTXAS_REGS.search(line)):
            out[fn]["registers"] = int(m.group(1))
            smem = _PTXAS_SMEM.search(line)
            out[fn]["shared"] = int(smem.group(1)) if smem else 0
    return out
