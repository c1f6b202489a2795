"""The backend: one object carrying the array module and dispatching every kernel op either to
its CUDA wrapper (``ddtree_rtc.kernels.<family>``) or its numpy reference
(``ddtree_rtc.reference.<family>``) — same names, same signatures. Model, drafter and engine code
call ``backend.<op>(...)`` and never branch on which one runs.

The op table is ``OPS`` (op name -> family). Each entry is a real class attribute of ``Backend``
(an ``Op``), so ``Backend.moe_experts`` names the family and both implementations, and
``backend.moe_experts`` is the one the backend runs; there is no lookup by attribute name."""

from __future__ import annotations

import importlib
import sys

import numpy as np
from ml_dtypes import bfloat16

from .kernels._host_copy import copy_in as staged_copy_in

# op name -> kernel family (module stem under kernels/ and reference/)
OPS: dict[str, str] = {
    "rmsnorm": "rmsnorm",
    "allreduce_rmsnorm": "allreduce",
    "rope": "rope",
    "embedding": "embedding",
    "silu_mul": "silu_mul",
    "argmax": "sampling",
    "sample": "sampling",
    "linear": "linear",
    "norm_linear": "linear",
    # -- DDTree (issue: tree build) --
    "topk_workspace": "topk",
    "topk_logprobs": "topk",
    "tree_build": "tree_build",
    "tree_accept": "tree_accept",
    # -- INT4 MoE (issue: MoE) --
    "router_logits": "moe_routing",
    "moe_route": "moe_routing",
    "moe_align": "moe_routing",
    "moe_plan": "moe_gemm",
    "moe_experts": "moe_gemm",
    # -- the small-M path (issue: small-M decoder layer) --
    "moe_small_plan": "moe_small",
    "moe_small_experts": "moe_small",
    "moe_small_dense": "moe_small",
    "moe_small_route_shared": "moe_small",
    "mla_query_small": "mla_small",
    "mla_qkv_a_small": "mla_small",
    # -- MLA attention and the paged latent KV cache (issue: MLA) --
    "kv_cache_write": "kv_cache",
    "kv_cache_commit": "kv_cache",
    "mla_attention_plan": "mla_attention",
    "mla_attention": "mla_attention",
    "mla_head_gemm": "mla_attention",
    # -- the DFlash drafter's attention --
    "gqa_attention": "gqa_attention",
}

_DTYPES = {"bf16": None, "fp32": np.float32, "fp64": np.float64, "int32": np.int32,
           "int64": np.int64, "uint8": np.uint8, "uint32": np.uint32, "uint64": np.uint64, "bool": np.bool_}


def cuda_available() -> bool:
    try:
        import cupy

        return bool(cupy.is_available())
    except Exception:  # noqa: BLE001 - any import/driver failure means "no GPU"
        return False


_ROUND_BF16 = ("unsigned int b = __float_as_uint(v);"
               "y = (b & 0x7fffffffu) > 0x7f800000u ? (unsigned short)((b >> 16) | 0x40u)"
               " : (unsigned short)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);")  # NaN stays NaN; else RNE
_ELEMENTWISE = {
    "to_bf16": ("float32 x", "const float v = x;"),
    "sum_to_bf16": ("float32 x, float32 s",
                    "unsigned int t = __float_as_uint(s);"
                    "t = (t & 0x7fffffffu) > 0x7f800000u ? (t | 0x400000u) : ((t + 0x7fffu + ((t >> 16) & 1u)) "
                    "& 0xffff0000u);"
                    "const float v = x + __uint_as_float(t);"),
}
_KERNELS: dict = {}


def _elementwise(name: str):
    k = _KERNELS.get(name)
    if k is None:
        import cupy

        args, body = _ELEMENTWISE[name]
        k = _KERNELS[name] = cupy.ElementwiseKernel(args, "uint16 y", body + _ROUND_BF16, f"ddtree_{name}")
    return k


class BackendUnavailableError(RuntimeError):
    """The CUDA backend was asked for where CuPy finds no usable GPU."""


class Backend:
    """``Backend('auto' | 'cuda' | 'numpy')``."""

    def __init__(self, kind: str = "auto", arch: str | None = None, quiet: bool = False):
        if kind not in ("auto", "cuda", "numpy"):
            raise ValueError(f"backend must be 'auto', 'cuda' or 'numpy', got {kind!r}")
        if kind == "auto":
            kind = "cuda" if cuda_available() else "numpy"
            if kind == "numpy" and not quiet:
                print("ddtree-rtc: no usable CUDA GPU found, using the numpy backend", file=sys.stderr)
        elif kind == "cuda" and not cuda_available():
            raise BackendUnavailableError("backend 'cuda' asked for, but CuPy finds no usable CUDA GPU "
                               "(install the cuda12/cuda13 extra and check the driver), or use 'numpy'")
        self.name = kind
        self.arch = None
        if kind == "cuda":
            import cupy

            from .rtc import detect_arch

            self.xp = cupy
            self.arch = detect_arch(arch)
            self.bf16 = np.dtype(np.uint16)
        else:
            self.xp = np
            self.bf16 = np.dtype(bfloat16)
        self._ops: dict[str, object] = {}

    def __repr__(self) -> str:
        return f"Backend({self.name!r}{', ' + self.arch if self.arch else ''})"

    @property
    def is_cuda(self) -> bool:
        return self.name == "cuda"

    def dtype(self, name: str):
        if name == "bf16":
            return self.bf16
        try:
            return np.dtype(_DTYPES[name])
        except KeyError:
            raise ValueError(f"unknown dtype {name!r}; known: {', '.join(_DTYPES)}") from None

    def asarray(self, a):
        """Host array -> backend array (host bf16 becomes uint16 bits on the GPU)."""
        a = np.ascontiguousarray(a)
        if self.is_cuda:
            if a.dtype == bfloat16:
                a = a.view(np.uint16)
            return self.xp.asarray(a)
        return a

    def to_host(self, a, bf16: bool | None = None) -> np.ndarray:
        """Backend array -> numpy; GPU uint16 comes back as bfloat16 unless ``bf16=False``."""
        if self.is_cuda:
            a = a.get()
            if a.dtype == np.uint16 and bf16 is not False:
                a = a.view(bfloat16)
        return a

    def copy_in(self, dst, host) -> None:
        """Copy a host array into the existing backend array ``dst`` (same shape; its dtype wins),
        in place, so arrays a CUDA graph reads keep their addresses. On CUDA the copy is enqueued on
        the current stream from page-locked staging (kernels/_host_copy.py): the host does not wait
        for the kernels queued before it."""
        host = np.asarray(host)
        if self.is_cuda:  # staged_copy_in checks the shape
            staged_copy_in(dst, host.view(np.uint16) if host.dtype == bfloat16 else host)
            return
        if host.shape != dst.shape:
            raise ValueError(f"copy_in: shape {host.shape} != destination {tuple(dst.shape)}")
        dst[...] = host

    def empty(self, shape, dtype: str):
        return self.xp.empty(shape, dtype=self.dtype(dtype))

    def zeros(self, shape, dtype: str):
        return self.xp.zeros(shape, dtype=self.dtype(dtype))

    def to_bf16(self, x, plus_rounded=None):
        """fp32 ``x`` -> bf16, round to nearest even (NaN stays NaN): the one rounding of an
        all-reduced tensor-parallel partial sum. ``plus_rounded`` (fp32, same shape) is first rounded
        to bf16 and added in fp32, as the MoE combine adds the bf16 shared expert. The CUDA twin is
        one CuPy elementwise kernel."""
        if self.is_cuda:
            if plus_rounded is None:
                return _elementwise("to_bf16")(x)
            return _elementwise("sum_to_bf16")(x, plus_rounded)
        from .reference.rmsnorm import rounded_sum

        return rounded_sum(x, plus_rounded)

    def from_bf16(self, x):
        """bf16 -> fp32 (exact)."""
        if self.is_cuda:
            return (x.astype(self.xp.uint32) << 16).view(self.xp.float32)
        return np.asarray(x).astype(np.float32)

    def synchronize(self) -> None:
        if self.is_cuda:
            self.xp.cuda.get_current_stream().synchronize()

    def op(self, name: str):
        """The implementation of op ``name`` this backend runs (imported on first use)."""
        fn = self._ops.get(name)
        if fn is None:
            try:
                family = OPS[name]
            except KeyError:
                raise KeyError(f"backend has no op {name!r}; ops: {', '.join(sorted(OPS))}") from None
            pkg = "kernels" if self.is_cuda else "reference"
            fn = self._ops[name] = getattr(importlib.import_module(f"ddtree_rtc.{pkg}.{family}"), name)
        return fn


class Op:
    """One row of the op table, a class attribute of Backend: on an instance it gives
    ``ddtree_rtc.kernels.<family>.<name>`` (CUDA) or ``ddtree_rtc.reference.<family>.<name>`` (numpy)."""

    def __init__(self, name: str, family: str):
        self.name, self.family = name, family
        self.cuda = f"ddtree_rtc.kernels.{family}.{name}"
        self.reference = f"ddtree_rtc.reference.{family}.{name}"

    def __get__(self, backend: Backend | None, owner=None):
        return self if backend is None else backend.op(self.name)

    def __repr__(self) -> str:
        return f"Op({self.cuda} | {self.reference})"


for _name, _family in OPS.items():
    if hasattr(Backend, _name):
        raise RuntimeError(f"op {_name!r} would hide Backend.{_name}; rename the op")
    setattr(Backend, _name, Op(_name, _family))
