"""Argument checks shared by the CUDA wrappers: every failure names the tensor and the problem."""

from __future__ import annotations

import numpy as np

BF16 = np.dtype(np.uint16)  # bf16 lives as uint16 bits on the GPU (CuPy has no bfloat16)
_NAMES = {np.dtype(np.uint16): "bf16 (uint16 bits)"}


def dtype_name(dt) -> str:
    dt = np.dtype(dt)
    return _NAMES.get(dt, dt.name)


def check(name: str, a, dtype=None, ndim: int | None = None, shape: tuple | None = None,
          contiguous: bool = True):
    """Validate a device array; ``shape`` entries of None match any size."""
    import cupy

    if not isinstance(a, cupy.ndarray):
        raise TypeError(f"{name}: expected a cupy array on the GPU, got {type(a).__name__}")
    if dtype is not None and a.dtype != np.dtype(dtype):
        raise TypeError(f"{name}: expected dtype {dtype_name(dtype)}, got {dtype_name(a.dtype)}")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(a.shape)}")
    if shape is not None:
        if a.ndim != len(shape) or any(s is not None and s != d for s, d in zip(shape, a.shape)):
            want = tuple("*" if s is None else s for s in shape)
            raise ValueError(f"{name}: expected shape {want}, got {tuple(a.shape)}")
    if contiguous and not a.flags.c_contiguous:
        raise ValueError(f"{name}: must be C-contiguous (got strides {a.strides}); "
                         "use cupy.ascontiguousarray")
    return a


def out_array(name: str, out, shape: tuple, dtype):
    """``out`` checked against the expected shape/dtype, or a new array."""
    import cupy

    if out is None:
        return cupy.empty(shape, dtype=dtype)
    return check(name, out, dtype=dtype, shape=shape)


def grid_1d(n: int, per_block: int) -> tuple[int]:
    return (max(1, (n + per_block - 1) // per_block),)


def allow_dynamic_smem(fn, nbytes: int) -> None:
    """Raise a function's dynamic shared-memory limit above the default 48 KB (CuPy's Function has
    no setter for it, so this goes through the driver)."""
    from cupy_backends.cuda.api import driver

    attr = driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    if driver.funcGetAttribute(attr, fn.ptr) < nbytes:
        driver.funcSetAttribute(fn.ptr, attr, nbytes)

