"""The ``local`` communicator: ranks as separate processes of one machine exchanging numpy arrays
through one POSIX shared-memory segment (used by the numpy backend and CI).

Segment layout: a header (magic, world size, slot bytes, per-rank generation counter, and per rank
the payload size and op code of the last two generations: a rank may publish generation g + 1
while a slower one still checks g), then one fixed-size slot per rank. A collective is a sequence
of steps over chunks of at most one slot: each rank writes its chunk into its slot and publishes the
next generation; once every rank has published it, each reads what it needs and publishes once
more, so no slot is overwritten before everyone has read it. Sums run over ranks 0..N-1 in that
order on every rank (bf16 in fp32, rounded once), so every rank gets bit-identical results. Every
wait has a deadline and names the ranks that did not arrive.
"""

from __future__ import annotations

import os
import time
from multiprocessing import resource_tracker, shared_memory

import numpy as np
from ml_dtypes import bfloat16

from .comm import Communicator, DistError, timeout_s

MAGIC = 0x44445452_4C4F4341  # "DDTRLOCA"
SLOT_BYTES = 4 << 20
_OPS = {"all_reduce": 1, "all_gather": 2, "broadcast": 3, "barrier": 4}
_OP_NAMES = {v: k for k, v in _OPS.items()}
# header int64 words: magic, world, slot bytes, then [world] generations, [2, world] sizes, [2, world] ops
_FIXED = 3
_PER_RANK = 5


def segment_name(job: str) -> str:
    """The shared-memory name of a job (POSIX names are short: keep it under 30 characters)."""
    safe = "".join(c if c.isalnum() else "_" for c in job)[-20:]
    return f"ddtree_{safe}"


class LocalCommunicator(Communicator):
    """Rank ``rank`` of ``world_size`` on the segment named after ``job`` (rank 0 creates it, the
    others attach, all within ``timeout`` seconds)."""

    name = "local"

    def __init__(self, rank: int, world_size: int, job: str, timeout: float | None = None,
                 slot_bytes: int = SLOT_BYTES):
        super().__init__(rank, world_size)
        self.timeout = timeout_s() if timeout is None else timeout
        self.slot_bytes = slot_bytes
        self.seg_name = segment_name(job)
        header = 8 * (_FIXED + _PER_RANK * world_size)
        self._header_bytes = -(-header // 64) * 64
        size = self._header_bytes + world_size * slot_bytes
        self._shm = self._create(size) if rank == 0 else self._attach(size)
        buf = self._shm.buf
        self._head = np.ndarray(_FIXED + _PER_RANK * world_size, np.int64, buf)
        self._gen_of = self._head[_FIXED:_FIXED + world_size]
        self._size_of = self._head[_FIXED + world_size:_FIXED + 3 * world_size].reshape(2, world_size)
        self._op_of = self._head[_FIXED + 3 * world_size:].reshape(2, world_size)
        self._slots = np.ndarray((world_size, slot_bytes), np.uint8, buf, offset=self._header_bytes)
        self._gen = 0
        self._closed = False
        # a callable that returns a reason (str) once waiting is pointless, e.g. a peer known dead;
        # checked while a collective waits, so the wait ends then instead of at the deadline
        self.abort = None
        try:
            self._sync("joining", _OPS["barrier"], 0)  # everyone attached before any collective
        except DistError:
            self.close()
            raise

    # -- set-up ------------------------------------------------------------------------------------
    def _create(self, size: int) -> shared_memory.SharedMemory:
        try:
            shm = shared_memory.SharedMemory(self.seg_name, create=True, size=size)
        except FileExistsError:  # left behind by a killed job of the same name
            stale = shared_memory.SharedMemory(self.seg_name)
            stale.close()
            stale.unlink()
            shm = shared_memory.SharedMemory(self.seg_name, create=True, size=size)
        head = np.ndarray(_FIXED + _PER_RANK * self.world_size, np.int64, shm.buf)
        head[1:] = 0
        head[1], head[2] = self.world_size, self.slot_bytes
        head[0] = MAGIC  # last: attachers wait for it
        return shm

    def _attach(self, size: int) -> shared_memory.SharedMemory:
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                shm = shared_memory.SharedMemory(self.seg_name)
            except (FileNotFoundError, ValueError):  # ValueError: created, not yet sized (empty)
                shm = None
            if shm is not None:
                # attaching registers the segment with this process's resource tracker, which would
                # unlink it when this rank exits; rank 0 owns it
                resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001
                if shm.size >= size:
                    head = np.ndarray(3, np.int64, shm.buf)
                    if head[0] == MAGIC:
                        if (head[1], head[2]) != (self.world_size, self.slot_bytes):
                            got = (int(head[1]), int(head[2]))
                            del head
                            shm.close()
                            raise DistError(f"rank {self.rank}: segment {self.seg_name} was made for world size "
                                            f"{got[0]} with {got[1]}-byte slots, this rank has world size "
                                            f"{self.world_size} and {self.slot_bytes}-byte slots")
                        del head
                        return shm
                    del head
                shm.close()
            if time.monotonic() > deadline:
                raise DistError(f"rank {self.rank}: rank 0 never created the shared segment {self.seg_name} "
                                f"within {self.timeout:g} s (did rank 0 start? same MASTER_PORT / job id?)")
            time.sleep(0.01)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        del self._head, self._gen_of, self._size_of, self._op_of, self._slots
        self._shm.close()
        if self.rank == 0:
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass

    def __del__(self):
        if not getattr(self, "_closed", True):
            self.close()

    # -- one step ----------------------------------------------------------------------------------
    def _sync(self, what: str, op: int, size: int) -> None:
        """Publish the next generation (with this rank's op and payload size) and wait for all."""
        self._gen += 1
        half = self._gen % 2
        self._size_of[half, self.rank] = size
        self._op_of[half, self.rank] = op
        self._gen_of[self.rank] = self._gen
        deadline = time.monotonic() + self.timeout
        spins = 0
        while True:
            behind = np.flatnonzero(self._gen_of < self._gen)
            if behind.size == 0:
                break
            if time.monotonic() > deadline:
                raise DistError(f"rank {self.rank}: timed out after {self.timeout:g} s {what}: rank(s) "
                                f"{behind.tolist()} never arrived (failed, stuck or never started)")
            reason = self.abort() if self.abort is not None and spins % 64 == 63 else None
            if reason:
                raise DistError(f"rank {self.rank}: gave up waiting {what} for rank(s) {behind.tolist()}: {reason}")
            spins += 1
            time.sleep(0 if spins < 100 else 2e-4)
        ops, sizes = self._op_of[half].copy(), self._size_of[half].copy()
        if (ops != op).any() or (sizes != size).any():
            calls = ", ".join(f"rank {r}: {_OP_NAMES.get(int(o), o)} of {int(s)} B"
                              for r, (o, s) in enumerate(zip(ops, sizes)))
            raise DistError(f"rank {self.rank}: ranks called different collectives at step {self._gen} ({calls})")

    def _steps(self, kind: str, data: np.ndarray, read):
        """Exchange ``data`` (uint8) chunk by chunk: ``read(lo, hi, slots)`` sees every rank's chunk."""
        op = _OPS[kind]
        total = data.size
        lo = 0
        while True:
            hi = min(total, lo + self.slot_bytes)
            self._slots[self.rank, :hi - lo] = data[lo:hi]
            self._sync(f"in {kind} (after writing bytes {lo}..{hi} of {total})", op, hi - lo)
            read(lo, hi, self._slots[:, :hi - lo])
            self._sync(f"in {kind} (after reading bytes {lo}..{hi} of {total})", op, hi - lo)
            lo = hi
            if lo >= total:
                return

    # -- collectives -------------------------------------------------------------------------------
    def _all_reduce(self, x):
        if not isinstance(x, np.ndarray):
            raise TypeError(f"local communicator: all_reduce takes numpy arrays, got {type(x).__name__}")
        flat = x.reshape(-1)
        if not flat.flags.c_contiguous or not np.shares_memory(flat, x):
            raise ValueError("all_reduce: x must be C-contiguous (it is summed in place)")
        data = flat.view(np.uint8)
        item = x.dtype.itemsize
        wide = np.float32 if x.dtype in (np.dtype(bfloat16), np.dtype(np.float16)) else x.dtype
        out = np.empty_like(flat)

        def read(lo, hi, slots):
            parts = slots.view(x.dtype)  # [world, chunk elements]
            acc = parts[0].astype(wide)
            for r in range(1, self.world_size):  # rank order: the same bits on every rank
                acc += parts[r].astype(wide)
            out[lo // item:hi // item] = acc.astype(x.dtype)

        if self.slot_bytes % item:
            raise ValueError(f"slot bytes {self.slot_bytes} not a multiple of {x.dtype}'s size")
        self._steps("all_reduce", data, read)
        flat[...] = out
        return x

    def _all_gather(self, x):
        src = np.ascontiguousarray(x)
        data = src.reshape(-1).view(np.uint8)
        out = np.empty((self.world_size, data.size), np.uint8)

        def read(lo, hi, slots):
            out[:, lo:hi] = slots

        self._steps("all_gather", data, read)
        return out.view(x.dtype).reshape((self.world_size * x.shape[0],) + tuple(x.shape[1:]))

    def _broadcast(self, x, root: int):
        flat = x.reshape(-1)
        data = flat.view(np.uint8)
        out = np.empty_like(data)

        def read(lo, hi, slots):
            out[lo:hi] = slots[root]

        self._steps("broadcast", data, read)
        flat.view(np.uint8)[...] = out
        return x

    def _barrier(self):
        self._sync("in barrier", _OPS["barrier"], 0)


def job_id(environ=None) -> str:
    """The job's name for the segment: DDTREE_RTC_JOB (set by ``--nproc``), else the launcher's run id,
    plus MASTER_PORT so two jobs of one machine do not meet (of ``environ``, default this process's)."""
    env = os.environ if environ is None else environ
    job = env.get("DDTREE_RTC_JOB") or env.get("TORCHELASTIC_RUN_ID") or env.get("SLURM_JOB_ID") or "job"
    return f"{job}_{env.get('MASTER_PORT', '0')}"
