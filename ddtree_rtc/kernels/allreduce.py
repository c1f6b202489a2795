"""One-shot all-reduce fused with the residual RMSNorm on the GPU. See cuda_src/allreduce.cu.

``PeerBuffers``: N ranks' buffers as this process sees them (its own, and its peers' opened from their
CUDA IPC handles: parallel/oneshot.py; or, for one process's simulated ranks, N plain buffers of one
device: ``PeerBuffers.local``)."""

from __future__ import annotations

import warnings

import numpy as np

from ..reference.allreduce import CTA, buffer_bytes, check_shape, slot_offset
from ._args import BF16, check, out_array
from ._launch import launch, pdl_supported
from .registry import module

_THREADS = 256
_PDL_REFUSED: list[str] = []


class PeerBuffers:
    """``bases[q]``: rank q's buffer (``reference.allreduce.buffer_bytes(d)`` bytes) as a device pointer
    of this process; ``owned``: what keeps the local ones alive (arrays), freed with this object."""

    def __init__(self, bases, d: int, owned=(), timeout_s: float = 300.0):
        import cupy

        self.nranks, self.d, self.timeout_s = len(bases), int(d), float(timeout_s)
        self.bases = cupy.asarray(np.asarray([int(b) for b in bases], dtype=np.uint64))
        self._ptrs = [int(b) for b in bases]
        self._owned = list(owned)

    @classmethod
    def local(cls, nranks: int, d: int, timeout_s: float = 300.0) -> PeerBuffers:
        """``nranks`` simulated ranks on the current device: plain buffers, flags and epochs zeroed."""
        import cupy

        bufs = [cupy.zeros(buffer_bytes(d), dtype=cupy.uint8) for _ in range(nranks)]
        return cls([b.data.ptr for b in bufs], d, bufs, timeout_s)

    def partial(self, rank: int, slot: int, shape):
        """Rank ``rank``'s partial of ``shape`` (fp32) in ``slot``; only for a rank whose buffer this
        process allocated or opened."""
        import cupy

        check_shape(shape, self.nranks, self.d)
        n = int(np.prod(shape))
        mem = cupy.cuda.UnownedMemory(self._ptrs[rank] + slot_offset(slot, self.d), 4 * n, self)
        return cupy.ndarray(tuple(shape), dtype=cupy.float32, memptr=cupy.cuda.MemoryPointer(mem, 0))


def allreduce_rmsnorm(peers: PeerBuffers, slot: int, shape, weight, eps: float, residual, rank: int | None = None,
                      out=None, residual_out=None, timeout_s: float | None = None):
    """Every rank's partial of ``shape`` ([rows, d] or [2, rows, d] fp32) in ``slot`` of ``peers``,
    summed in rank order, rounded as ``Backend.to_bf16`` and RMS-normed with ``residual`` (bf16).
    ``rank``: this rank alone (residual [rows, d]); None: every rank of ``peers`` in one launch (N
    simulated ranks of one device; residual [N, rows, d]). Returns (y, new residual); ``out`` /
    ``residual_out`` may alias ``residual``. ``timeout_s``: how long a CTA waits for its peers before it
    traps (default ``peers.timeout_s``)."""
    check_shape(shape, peers.nranks, peers.d)
    rows, d = int(shape[-2]), int(shape[-1])
    lead = () if rank is not None else (peers.nranks,)
    if rank is not None and not 0 <= rank < peers.nranks:
        raise ValueError(f"allreduce_rmsnorm: rank {rank} outside 0..{peers.nranks - 1}")
    check("residual", residual, BF16, shape=lead + (rows, d))
    check("weight", weight, BF16, shape=(d,))
    y = out_array("out", out, lead + (rows, d), BF16)
    h = out_array("residual_out", residual_out, lead + (rows, d), BF16)
    timeout = peers.timeout_s if timeout_s is None else float(timeout_s)
    if timeout <= 0:
        raise ValueError(f"allreduce_rmsnorm: timeout_s must be > 0, got {timeout}")
    grid = (CTA, 1 if rank is not None else peers.nranks, rows)
    args = (peers.bases, np.int64(slot_offset(slot, d)), np.int32(peers.nranks), np.int32(rank or 0), residual, y, h,
            np.int64(rows * d), weight, np.int32(rows), np.int32(d), np.int32(len(shape) - 1), np.float32(eps),
            np.int64(round(timeout * 1e9)))
    fn = module("allreduce").fn("allreduce_rmsnorm_kernel")
    if pdl_supported() and not _PDL_REFUSED:
        try:
            launch(fn, grid, (_THREADS,), args, pdl=True)
            return y, h
        except RuntimeError as e:  # a driver that refuses PDL with a cluster kernel: plain launches from now on
            _PDL_REFUSED.append(str(e))
            warnings.warn(f"allreduce_rmsnorm: PDL launch refused ({e}); launching plainly", stacklevel=2)
    launch(fn, grid, (_THREADS,), args)
    return y, h
