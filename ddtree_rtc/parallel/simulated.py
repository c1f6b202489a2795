"""A simulated rank (``runtime.simulate_rank``): rank R of N run alone on one device, for time and
bytes only.

Every collective is replaced by a stand-in that moves the bytes the real one hands over, as one
device copy of the message (all_reduce / broadcast: the message into a scratch buffer; all_gather:
the message into each of the N slots of the result), and, with ``hold_us``, then holds the stream
that long (a spin kernel: the latency a real collective adds, and CUDA-graph capturable). Calls and
bytes are counted as every communicator counts them (comm.CommStats), so a simulated rank's figures
are the real rank R's.

Its numerics are NOT the model's: partial sums are left unreduced (each sublayer's output is this
rank's share alone) and gathered slices are copies of this rank's. Only the control flow, the
shapes, the weights read and the collectives' sizes are the real rank's.
"""

from __future__ import annotations

import numpy as np

from .comm import Communicator

NOT_THE_MODEL = ("simulated rank: numerics are NOT the model's (partial sums unreduced, gathers filled with "
                 "this rank's slice); only time, bytes and collective counts are rank {rank} of {world}'s")


class SimulatedRank(Communicator):
    """Rank ``rank`` of ``world_size`` alone; ``xp`` the backend's array module (numpy or CuPy);
    ``hold_us`` the time each collective holds the stream after its copy (CuPy only; numpy sleeps)."""

    name = "simulated"

    def __init__(self, rank: int, world_size: int, xp=np, hold_us: float = 0.0):
        super().__init__(rank, world_size)
        if world_size < 2:
            raise ValueError(f"a simulated rank needs world size >= 2 (got {world_size}): one rank has no "
                             f"collectives to stand in for")
        if hold_us < 0:
            raise ValueError(f"hold_us must be >= 0, got {hold_us}")
        self.xp, self.hold_us = xp, float(hold_us)
        self._scratch = None
        self._hold = _hold_kernel() if hold_us and xp is not np else None

    def note(self) -> str:
        return NOT_THE_MODEL.format(rank=self.rank, world=self.world_size)

    def _sink(self, nbytes: int):
        """A scratch buffer of at least ``nbytes`` (kept: a captured graph keeps its address)."""
        if self._scratch is None or self._scratch.nbytes < nbytes:
            self._scratch = self.xp.empty(max(nbytes, 1 << 20), dtype=np.uint8)
        return self._scratch[:nbytes]

    def _wait(self) -> None:
        if not self.hold_us:
            return
        if self._hold is None:
            import time

            time.sleep(self.hold_us * 1e-6)
            return
        self._hold((1,), (1,), (np.int64(round(self.hold_us * 1000)),))

    def _copy(self, x) -> None:
        flat = self.xp.ascontiguousarray(x).reshape(-1).view(np.uint8)
        self._sink(flat.size)[...] = flat

    def _all_reduce(self, x):
        self._copy(x)
        self._wait()
        return x

    def _all_gather(self, x):
        out = self.xp.empty((self.world_size,) + tuple(x.shape), dtype=x.dtype)
        out[...] = x[None]
        self._wait()
        return out.reshape((self.world_size * x.shape[0],) + tuple(x.shape[1:]))

    def _broadcast(self, x, root: int):
        self._copy(x)
        self._wait()
        return x

    def _barrier(self):
        pass


def _hold_kernel():
    """A one-thread kernel spinning on %globaltimer for the given nanoseconds."""
    import cupy

    k = cupy.RawKernel(r"""
extern "C" __global__ void simulated_collective_hold(long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while ((long long)(t - t0) < ns);
}""", "simulated_collective_hold")
    k.compile()  # now, not at a first launch inside a graph capture
    return k
