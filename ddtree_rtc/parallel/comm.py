"""The communicator interface every rank's model calls, and the one-rank no-op.

Collectives act on the backend's arrays: ``all_reduce`` sums in place (bf16 is summed in fp32 and
rounded once), ``all_gather`` concatenates every rank's array along axis 0 (rank order),
``broadcast`` copies rank ``root``'s array into everyone's. Every call is counted (``stats``) so the
engine can report collectives and bytes per round.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field

# seconds a rank waits for its peers (set-up and, on the local transport, every collective)
DEFAULT_TIMEOUT_S = 300.0


def timeout_s() -> float:
    """``DDTREE_RTC_DIST_TIMEOUT`` (seconds), else DEFAULT_TIMEOUT_S."""
    raw = os.environ.get("DDTREE_RTC_DIST_TIMEOUT")
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        v = float(raw)
    except ValueError:
        raise ValueError(f"DDTREE_RTC_DIST_TIMEOUT={raw!r}: expected seconds") from None
    if v <= 0:
        raise ValueError(f"DDTREE_RTC_DIST_TIMEOUT={raw!r}: must be > 0")
    return v


class DistError(RuntimeError):
    """A peer failed, never joined, or a collective was called inconsistently."""


@dataclass
class CommStats:
    """Calls and payload bytes per collective kind (the bytes one rank hands to the call)."""

    calls: dict = field(default_factory=lambda: defaultdict(int))
    bytes: dict = field(default_factory=lambda: defaultdict(int))

    def add(self, kind: str, nbytes: int) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += int(nbytes)

    def add_counts(self, other: CommStats) -> None:
        """Add ``other``'s calls and bytes (a CUDA graph replay repeats its captured collectives)."""
        for k, v in other.calls.items():
            self.calls[k] += v
        for k, v in other.bytes.items():
            self.bytes[k] += v

    def total(self) -> tuple[int, int]:
        return sum(self.calls.values()), sum(self.bytes.values())

    def snapshot(self) -> dict:
        return {"calls": dict(self.calls), "bytes": dict(self.bytes)}


class Communicator:
    """``rank`` of ``world_size``; subclasses implement the ``_`` methods on their arrays.

    ``oneshot``: the fused all-reduce + RMSNorm path (parallel/oneshot.py ``attach``), or None: then
    ``all_reduce_norm`` is today's all-reduce and ``rmsnorm`` of the fp32 sum."""

    name = "base"
    oneshot = None

    def __init__(self, rank: int, world_size: int):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} of world size {world_size}: need 0 <= rank < world_size")
        self.rank, self.world_size = rank, world_size
        self.stats = CommStats()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size})"

    def all_reduce(self, x):
        """Sum ``x`` over ranks, in place; returns ``x``."""
        self.stats.add("all_reduce", x.nbytes)
        self._all_reduce(x)
        return x

    def all_gather(self, x):
        """[world * n, ...]: every rank's ``x`` [n, ...] in rank order (a new array)."""
        self.stats.add("all_gather", x.nbytes)
        return self._all_gather(x)

    def broadcast(self, x, root: int = 0):
        """Rank ``root``'s ``x`` into every rank's ``x`` (same shape and dtype), in place."""
        if not 0 <= root < self.world_size:
            raise ValueError(f"broadcast root {root} outside 0..{self.world_size - 1}")
        self.stats.add("broadcast", x.nbytes)
        self._broadcast(x, root)
        return x

    def barrier(self) -> None:
        self._barrier()

    def partial_buffer(self, shape, backend):
        """Where a sublayer writes its fp32 partial ``shape`` ([rows, d], or [2, rows, d]: the MoE's
        routed and shared parts) for ``all_reduce_norm``: the one-shot path's registered slot where it
        takes the shape, else a new array."""
        if self.oneshot is not None and self.oneshot.fits(shape):
            return self.oneshot.buffer(shape)
        return backend.empty(tuple(shape), "fp32")

    def all_reduce_norm(self, partial, weight, eps: float, residual, backend):
        """The sublayer's end: every rank's fp32 ``partial`` summed, rounded to bf16 once (two parts:
        routed + bf16(shared), as the MoE combine), added to ``residual`` and RMS-normed with ``weight``.
        Returns (normed, new residual). The one-shot kernel for a partial from ``partial_buffer`` that
        it took (counted as an all_reduce of the same bytes), else all_reduce + the norm of the fp32 sum
        (``rmsnorm``'s fp32 x: it rounds as ``to_bf16`` does, no launch of its own); both sum in rank
        order only where the transport does (NCCL need not)."""
        if self.oneshot is not None and self.oneshot.owns(partial):
            self.stats.add("all_reduce", partial.nbytes)
            return self.oneshot.all_reduce_norm(partial, weight, eps, residual)
        self.all_reduce(partial)
        if partial.ndim == 3:
            return backend.rmsnorm(partial[0], weight, eps, residual=residual, plus=partial[1])
        return backend.rmsnorm(partial, weight, eps, residual=residual)

    def close(self) -> None:
        """Release the transport (idempotent)."""

    def _all_reduce(self, x):
        raise NotImplementedError

    def _all_gather(self, x):
        raise NotImplementedError

    def _broadcast(self, x, root: int):
        raise NotImplementedError

    def _barrier(self):
        raise NotImplementedError


class SingleRank(Communicator):
    """World size 1 without a transport: every collective is the identity (still counted)."""

    name = "single"

    def __init__(self):
        super().__init__(0, 1)

    def _all_reduce(self, x):
        return x

    def _all_gather(self, x):
        return x.copy()

    def _broadcast(self, x, root: int):
        return x

    def _barrier(self):
        pass
