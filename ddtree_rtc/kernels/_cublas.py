"""The few cuBLAS calls we make, straight into the libcublas CuPy has loaded (ctypes), on CuPy's
handle bound to the current stream.

Why not CuPy's wrappers: each of them re-binds the handle's stream through a check that refuses to
run while a stream is capturing ("calling cuBLAS API during stream capture is currently
unsupported"), although cuBLAS itself captures GEMMs fine once the handle has a fixed workspace.
So every call here sets the stream, host pointer mode and a persistent per-handle workspace
(no allocation inside a capture), then issues the GEMM.

The workspace is bound again after every ``cublasSetStream``: that call resets the handle to
cuBLAS's default workspace pool (cuBLAS docs, cublasSetStream / cublasSetWorkspace). A GEMM on the
default pool allocates its own workspace: inside a capture, as allocation nodes of the graph
(cudaMallocAsync, CUDA 12.2 on; the device's graph memory pool keeps that memory after the graph
is destroyed, until trimmed), before 12.2 a new workspace per captured graph. Every capture here
runs on a new stream, so that memory would grow with every captured forward. One workspace serves
every stream: the forwards that call cuBLAS never run on two streams at once (captures are made
one at a time, replays and eager runs go on the caller's stream). It is a raw device allocation,
outside CuPy's pools: the pool current at the first call may be a graph's private one, freed
with its runner, and a pooled block would pin the rest of its allocation.
"""

from __future__ import annotations

import ctypes
import functools

# cuBLAS / CUDA enums of the calls below (cublas_api.h, library_types.h)
OP_N, OP_T = 0, 1
R_32F, R_16BF = 0, 14
COMPUTE_32F = 68
GEMM_DEFAULT = -1

_WORKSPACE_BYTES = 32 << 20
_POINTER_MODE_HOST = 0
_workspaces: dict[int, object] = {}  # handle -> raw device allocation (cupy.cuda.memory.Memory), kept with the handle

_i, _p, _ll = ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong


def _loaded_path(stem: str) -> str | None:
    """Path of an already loaded shared library whose file name starts with ``stem``."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(" ", 1)[-1].strip()
                if path.rsplit("/", 1)[-1].startswith(stem):
                    return path
    except OSError:
        return None
    return None


@functools.cache
def _lib():
    from cupy_backends.cuda.libs import cublas  # noqa: F401 - loads the libcublas CuPy was built for

    path = _loaded_path("libcublas.so")
    if path is None:
        raise RuntimeError("cannot find the libcublas that CuPy loaded (looked in /proc/self/maps)")
    lib = ctypes.CDLL(path)
    sigs = {
        "cublasSetStream_v2": (_p, _p),
        "cublasSetPointerMode_v2": (_p, _i),
        "cublasSetWorkspace_v2": (_p, _p, ctypes.c_size_t),
        "cublasGemmEx": (_p, _i, _i, _i, _i, _i, _p, _p, _i, _i, _p, _i, _i, _p, _p, _i, _i, _i, _i),
        "cublasGemmStridedBatchedEx": (_p, _i, _i, _i, _i, _i, _p, _p, _i, _i, _ll, _p, _i, _i, _ll, _p, _p, _i,
                                       _i, _ll, _i, _i, _i),
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, _i
    return lib


def _ok(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLAS {what} failed with status {status}")


def handle() -> int:
    """CuPy's cuBLAS handle of the current device, bound to the current stream, host pointer mode,
    with its persistent workspace."""
    import cupy

    lib = _lib()
    h = cupy.cuda.device.get_cublas_handle()
    _ok(lib.cublasSetStream_v2(h, cupy.cuda.get_current_stream().ptr), "SetStream")
    _ok(lib.cublasSetPointerMode_v2(h, _POINTER_MODE_HOST), "SetPointerMode")
    ws = _workspaces.get(h)
    if ws is None:
        ws = _workspaces[h] = cupy.cuda.memory.Memory(_WORKSPACE_BYTES)
    _ok(lib.cublasSetWorkspace_v2(h, ws.ptr, _WORKSPACE_BYTES), "SetWorkspace")  # SetStream unbound it
    return h


def gemm_ex(transa, transb, m, n, k, alpha, a, a_type, lda, b, b_type, ldb, beta, c, c_type, ldc, compute, algo):
    """cublasGemmEx (column-major); alpha/beta are host pointers, a/b/c device pointers."""
    _ok(_lib().cublasGemmEx(handle(), transa, transb, m, n, k, alpha, a, a_type, lda, b, b_type, ldb, beta,
                            c, c_type, ldc, compute, algo), "GemmEx")


def gemm_strided_batched_ex(transa, transb, m, n, k, alpha, a, a_type, lda, stride_a, b, b_type, ldb, stride_b,
                            beta, c, c_type, ldc, stride_c, batch, compute, algo):
    """cublasGemmStridedBatchedEx (column-major); alpha/beta host pointers."""
    _ok(_lib().cublasGemmStridedBatchedEx(handle(), transa, transb, m, n, k, alpha, a, a_type, lda, stride_a, b,
                                          b_type, ldb, stride_b, beta, c, c_type, ldc, stride_c, batch, compute,
                                          algo), "GemmStridedBatchedEx")
