"""Kernel launches with programmatic dependent launch (PDL, sm_90 and later).

CuPy's ``Function.__call__`` has no launch attributes, so a PDL launch goes through the driver's
``cuLaunchKernelEx`` with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION: the kernel may start
while the previous kernel on its stream is still running (once every CTA of that one has executed
``griddepcontrol.launch_dependents`` or exited), and its ``griddepcontrol.wait`` (``pdl_wait`` in
cuda_src/include/common.cuh) returns when that kernel has completed and its writes are visible.
Stream capture records the launch as a programmatic edge of the CUDA graph.

The rule every kernel launched this way keeps (and that makes early reads safe): it triggers its
dependents only after its own wait, so when kernel n starts, kernel n - 2 has completed. Kernel n may
therefore read what n - 2 and earlier wrote before its wait, but what n - 1 wrote only after it, and
it writes nothing before it. A CTA that exits counts as triggering, and the next kernel's wait covers
only this one: a kernel all of whose CTAs could exit before their wait would complete before the
kernel it depends on, so a CTA with nothing to do still waits before it exits.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

_SCALARS = {
    np.dtype(np.int32): ctypes.c_int32,
    np.dtype(np.uint32): ctypes.c_uint32,
    np.dtype(np.int64): ctypes.c_int64,
    np.dtype(np.uint64): ctypes.c_uint64,
    np.dtype(np.float32): ctypes.c_float,
    np.dtype(np.float64): ctypes.c_double,
}


def _params(args):
    """(values, ctypes types) for cuLaunchKernelEx: device arrays as pointers, numpy scalars as
    their C type (the kernels' argument types, as CuPy would pass them)."""
    import cupy

    vals, types = [], []
    for i, a in enumerate(args):
        if isinstance(a, cupy.ndarray):
            vals.append(a.data.ptr)
            types.append(ctypes.c_void_p)
        elif isinstance(a, np.generic) and a.dtype in _SCALARS:
            vals.append(a.item())
            types.append(_SCALARS[a.dtype])
        else:
            raise TypeError(f"kernel argument {i}: expected a cupy array or a numpy scalar of "
                            f"{sorted(str(d) for d in _SCALARS)}, got {type(a).__name__}")
    return tuple(vals), tuple(types)


def launch(fn, grid, block, args, shared_mem: int = 0, stream=None, pdl: bool = False) -> None:
    """``fn(grid, block, args, shared_mem=..., stream=...)``; with ``pdl`` through cuLaunchKernelEx
    with programmatic stream serialization (see the module docstring for what the kernel must do)."""
    import cupy

    if not pdl:
        if stream is None:
            fn(grid, block, args, shared_mem=shared_mem)
        else:
            fn(grid, block, args, shared_mem=shared_mem, stream=stream)
        return
    from cuda.bindings import driver

    stream = cupy.cuda.get_current_stream() if stream is None else stream
    grid, block = tuple(grid) + (1,) * (3 - len(grid)), tuple(block) + (1,) * (3 - len(block))
    cfg = driver.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = (int(v) for v in grid)
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = (int(v) for v in block)
    cfg.sharedMemBytes = int(shared_mem)
    cfg.hStream = driver.CUstream(stream.ptr)
    attr = driver.CUlaunchAttribute()
    attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    cfg.attrs = [attr]
    cfg.numAttrs = 1
    err, = driver.cuLaunchKernelEx(cfg, driver.CUfunction(fn.ptr), _params(args), 0)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuLaunchKernelEx (PDL) failed: {err.name}")


def pdl_supported() -> bool:
    """Whether the current GPU runs programmatic dependent launches (compute capability >= 9.0)."""
    import cupy

    return int(cupy.cuda.Device().compute_capability) >= 90


def sm_count(device_id: int | None = None) -> int:
    """Streaming multiprocessors of a device (the current one by default): the grid-sizing input."""
    import cupy

    return _sm_count(cupy.cuda.Device().id if device_id is None else int(device_id))


@functools.cache
def _sm_count(device_id: int) -> int:
    import cupy

    return int(cupy.cuda.Device(device_id).attributes["MultiProcessorCount"])


def ctas_per_sm(fn, threads: int, dynamic_smem: int = 0) -> int:
    """CTAs of kernel ``fn`` (a CuPy Function, on the current device) one SM holds at once at
    ``threads`` threads and ``dynamic_smem`` bytes of dynamic shared memory: the driver's occupancy
    (registers, shared memory and its per-CTA reserve)."""
    from cupy_backends.cuda.api import driver

    return int(driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.ptr, threads, dynamic_smem))
