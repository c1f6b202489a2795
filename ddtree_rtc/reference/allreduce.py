"""One-shot all-reduce fused with the residual RMSNorm (cuda_src/allreduce.cu), in numpy: the
composition of today's steps, every rank's fp32 partial summed in rank order 0..N-1, rounded as
``Backend.to_bf16`` (the MoE: routed + bf16(shared)), then ``rmsnorm`` with the residual.

The buffer layout is shared with the CUDA wrapper (kernels/allreduce.py): per rank a header (peer
flags, epochs) and two slots of [parts, rows, d] fp32 partials. ``HostPeers`` is the numpy twin of
``kernels.allreduce.PeerBuffers``: the N ranks of one process (threads), a barrier standing in for
the kernel's flags."""

from __future__ import annotations

import threading

import numpy as np

from .rmsnorm import rmsnorm, rounded_sum

MAX_RANKS = 8
MAX_ROWS = 16
CTA = 8  # CTAs per row (the kernel's cluster)
MAX_D = 8192  # rmsnorm_block_kernel's register path (256 threads x 8 x 4)
HEADER_BYTES = 8192  # flags u32 [MAX_ROWS * CTA][MAX_RANKS] + epochs u32 [MAX_ROWS * CTA], rounded up


def unsupported(shape, world: int) -> str | None:
    """Why a partial of ``shape`` ([rows, d], or [2, rows, d] for the MoE's routed and shared parts)
    over ``world`` ranks cannot take the fused path, or None."""
    shape = tuple(int(s) for s in shape)
    if len(shape) not in (2, 3) or (len(shape) == 3 and shape[0] != 2):
        return f"partial shape {shape}: expected [rows, d] or [2, rows, d]"
    rows, d = shape[-2:]
    if not 2 <= world <= MAX_RANKS:
        return f"world size {world}: the kernel takes 2..{MAX_RANKS} ranks"
    if not 1 <= rows <= MAX_ROWS:
        return f"{rows} rows: the one-shot path takes 1..{MAX_ROWS}"
    if not (1024 < d <= MAX_D and d % 64 == 0):
        return f"hidden size {d}: the kernel takes 1024 < d <= {MAX_D}, a multiple of 64 (rmsnorm's block path)"
    return None


def check_shape(shape, world: int, d: int) -> None:
    why = unsupported(shape, world)
    if why is None and int(shape[-1]) != d:
        why = f"partial shape {tuple(shape)}: the peer buffers were made for hidden size {d}"
    if why:
        raise ValueError(f"allreduce_rmsnorm: {why}")


def slot_bytes(d: int) -> int:
    return 2 * MAX_ROWS * d * 4


def buffer_bytes(d: int) -> int:
    """One rank's buffer: the header and two slots."""
    return HEADER_BYTES + 2 * slot_bytes(d)


def slot_offset(slot: int, d: int) -> int:
    if slot not in (0, 1):
        raise ValueError(f"slot {slot}: expected 0 or 1 (the double buffer)")
    return HEADER_BYTES + slot * slot_bytes(d)


def reduce_norm(partials, weight, eps: float, residual):
    """The composition: ``partials`` [N, rows, d] or [N, 2, rows, d] fp32 (rank-major) summed over
    ranks 0..N-1 in fp32, rounded to bf16 (routed + bf16(shared) with two parts), then RMSNorm with
    ``residual`` [rows, d] bf16. Returns (y, new residual)."""
    p = np.asarray(partials, dtype=np.float32)
    acc = p[0].copy()
    for q in range(1, p.shape[0]):  # rank order: every rank the same bits
        acc += p[q]
    a = rounded_sum(acc[0], acc[1]) if acc.ndim == 3 else rounded_sum(acc)
    return rmsnorm(a, weight, eps, residual=residual)


class HostPeers:
    """``nranks`` ranks' buffers of hidden size ``d`` in one process (numpy); ``wait(rank)`` is the
    barrier a rank's all-reduce passes before it reads its peers (the kernel's flags)."""

    def __init__(self, nranks: int, d: int, timeout_s: float = 300.0):
        if not 2 <= nranks <= MAX_RANKS:
            raise ValueError(f"HostPeers: {nranks} ranks, expected 2..{MAX_RANKS}")
        self.nranks, self.d, self.timeout_s = nranks, d, timeout_s
        self.buffers = [np.zeros(buffer_bytes(d), np.uint8) for _ in range(nranks)]
        self._barrier = threading.Barrier(nranks)

    def partial(self, rank: int, slot: int, shape):
        """Rank ``rank``'s partial of ``shape`` in ``slot``: where its sublayer writes it."""
        check_shape(shape, self.nranks, self.d)
        n = int(np.prod(shape))
        off = slot_offset(slot, self.d)
        return self.buffers[rank][off:off + 4 * n].view(np.float32).reshape(shape)

    def wait(self, rank: int) -> None:
        try:
            self._barrier.wait(self.timeout_s)
        except threading.BrokenBarrierError:  # parallel.oneshot names it a DistError
            raise TimeoutError(f"rank {rank}: one-shot all-reduce: the peers did not all arrive within "
                               f"{self.timeout_s:g} s") from None


def allreduce_rmsnorm(peers, slot: int, shape, weight, eps: float, residual, rank: int | None = None,
                      out=None, residual_out=None, timeout_s: float | None = None):
    """Every rank's partial of ``shape`` in ``slot`` of ``peers`` reduced, rounded and normed with
    ``residual``. ``rank``: this rank ([rows, d] residual; waits for its peers first), or None: every
    rank of the group at once (residual [N, rows, d]; the single launch of simulated ranks).
    Returns (y, new residual). ``timeout_s``: the CUDA kernel's bound (the host barrier has its own)."""
    check_shape(shape, peers.nranks, peers.d)
    if rank is not None:
        peers.wait(rank)
    parts = np.stack([peers.partial(q, slot, shape) for q in range(peers.nranks)])
    if rank is not None:
        y, h = reduce_norm(parts, weight, eps, residual)
    else:
        pairs = [reduce_norm(parts, weight, eps, residual[r]) for r in range(peers.nranks)]
        y, h = np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])
    if out is not None:
        out[...] = y
        y = out
    if residual_out is not None:
        residual_out[...] = h
        h = residual_out
    return y, h
