"""The one-shot all-reduce + RMSNorm path of a rank (``runtime.allreduce``; kernel: cuda_src/allreduce.cu).

``attach(comm, mode, backend, hidden)`` decides once, the same way on every rank, whether the
communicator's ``all_reduce_norm`` runs the fused kernel: ``nccl`` (the default) never; ``oneshot``
always, or a named error saying why it cannot; ``auto`` where it can: the CUDA backend on NCCL ranks,
2..8 of them, all on one node and every pair of GPUs able to reach the other's memory, and a hidden
size the kernel takes. Each rank then allocates one buffer (cudaMalloc, not the memory pool: an IPC
handle names a whole allocation), exchanges its IPC handle through the communicator and opens its
peers'. Per call, partials of at most 16 rows take the fused path; larger ones NCCL + to_bf16 + norm.

Slots alternate per call (``OneShot.buffer``): every captured forward holds an even number of calls
(two per decoder layer), so a CUDA graph always replays the same alternation it captured, and
consecutive calls never share a slot (the kernel's only guard against a peer overwriting a slot
still being read).
"""

from __future__ import annotations

import socket
import zlib

import numpy as np

from ..reference.allreduce import unsupported
from .comm import Communicator, DistError, timeout_s

MODES = ("auto", "nccl", "oneshot")


class OneShot:
    """Rank ``rank``'s side of ``peers`` (kernels.allreduce.PeerBuffers or reference.allreduce.HostPeers)."""

    def __init__(self, peers, rank: int, backend, close=None):
        self.peers, self.rank, self.backend = peers, rank, backend
        self.calls = 0  # fused all-reduces so far: the slot of the next is calls % 2
        self._close = close
        self._views: dict = {}  # (slot, shape) -> the partial's array (made once: eager calls stay cheap)

    def fits(self, shape) -> bool:
        return unsupported(shape, self.peers.nranks) is None and int(shape[-1]) == self.peers.d

    def buffer(self, shape):
        """Where this rank's sublayer writes its fp32 partial for the next fused call."""
        key = (self.calls % 2, tuple(int(s) for s in shape))
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = self.peers.partial(self.rank, *key)
        return view

    def owns(self, partial) -> bool:
        """Whether ``partial`` is the buffer of the next fused call (from ``buffer``)."""
        if not self.fits(partial.shape):
            return False
        mine = self.buffer(partial.shape)
        if self.backend.is_cuda:
            return partial.data.ptr == mine.data.ptr
        return partial.__array_interface__["data"][0] == mine.__array_interface__["data"][0]

    def all_reduce_norm(self, partial, weight, eps: float, residual):
        slot = self.calls % 2
        self.calls += 1
        try:
            return self.backend.allreduce_rmsnorm(self.peers, slot, tuple(partial.shape), weight, eps, residual,
                                                  rank=self.rank)
        except TimeoutError as e:  # the numpy group's barrier (the kernel traps instead)
            raise DistError(str(e)) from None

    def close(self) -> None:
        if self._close is not None:
            self._close()
            self._close = None


def attach(comm: Communicator, mode: str, backend, hidden: int) -> str:
    """Set up ``comm``'s one-shot path per ``mode`` (every rank calls this at the same point: it may
    run collectives); returns the transport of the sublayer all-reduces, 'oneshot' or 'nccl'."""
    if mode not in MODES:
        raise ValueError(f"runtime.allreduce: {mode!r} is not one of {', '.join(MODES)}")
    if mode == "nccl" or comm.world_size == 1:
        return "nccl"
    why = _local_reason(comm, backend, hidden)
    if why is None:  # the same answer on every rank: only collectives from here
        why = _peer_reason(comm)
    if why is not None:
        if mode == "oneshot":
            raise DistError(f"runtime.allreduce: oneshot: {why}; use 'auto' or 'nccl'")
        return "nccl"
    peers, rank, close = _ipc_peers(comm, hidden)
    comm.oneshot = OneShot(peers, rank, backend, close)
    return "oneshot"


def _local_reason(comm: Communicator, backend, hidden: int) -> str | None:
    """Why the fused path is out, from what every rank knows alike (no collective), or None."""
    if not backend.is_cuda:
        return f"it needs the CUDA backend (this is {backend.name})"
    if comm.name != "nccl":
        return f"it needs NCCL ranks (this communicator is {comm.name!r})"
    return unsupported((1, hidden), comm.world_size)


def _peer_reason(comm: Communicator) -> str | None:
    """Every rank's node and GPU gathered: None if all are one node's and each pair can reach the
    other's memory, else why not (the same on every rank)."""
    import cupy

    dev = cupy.cuda.Device().id
    node = zlib.crc32(socket.gethostname().encode())
    mine = np.array([node, dev], dtype=np.int64)
    got = cupy.asnumpy(comm.all_gather(cupy.asarray(mine))).reshape(comm.world_size, 2)
    if len(set(got[:, 0].tolist())) > 1:
        return "the ranks are on more than one node"
    reach = np.array([all(int(d) == dev or cupy.cuda.runtime.deviceCanAccessPeer(dev, int(d))
                          for d in got[:, 1])], dtype=np.int64)
    ok = cupy.asnumpy(comm.all_gather(cupy.asarray(reach)))
    if not ok.all():
        return f"rank(s) {np.flatnonzero(ok == 0).tolist()} cannot reach every peer GPU's memory"
    return None


def _ipc_peers(comm: Communicator, hidden: int):
    """(PeerBuffers, rank, close): this rank's buffer (zeroed) and its peers' opened from their IPC
    handles, gathered through ``comm``."""
    import cupy

    from ..kernels.allreduce import PeerBuffers
    from ..reference.allreduce import buffer_bytes

    rt = cupy.cuda.runtime
    size = buffer_bytes(hidden)
    own = rt.malloc(size)
    opened = []
    try:
        rt.memset(own, 0, size)
        handle = np.frombuffer(bytes(rt.ipcGetMemHandle(own)), dtype=np.uint8)
        handles = cupy.asnumpy(comm.all_gather(cupy.asarray(handle))).reshape(comm.world_size, -1)
        bases = []
        for q in range(comm.world_size):
            if q == comm.rank:
                bases.append(own)
                continue
            ptr = rt.ipcOpenMemHandle(bytes(handles[q]), rt.cudaIpcMemLazyEnablePeerAccess)
            opened.append(ptr)
            bases.append(ptr)
        rt.deviceSynchronize()
        comm.barrier()  # every buffer zeroed before any peer raises a flag in it
    except Exception:
        for ptr in opened:
            rt.ipcCloseMemHandle(ptr)
        rt.free(own)
        raise

    def close():
        rt.deviceSynchronize()
        for ptr in opened:
            rt.ipcCloseMemHandle(ptr)
        rt.free(own)

    return PeerBuffers(bases, hidden, timeout_s=timeout_s()), comm.rank, close


def simulated_group(nranks: int, hidden: int, backend, timeout: float | None = None) -> list[OneShot]:
    """``nranks`` ranks' one-shot sides sharing one process's buffers (one device on CUDA, host
    memory on numpy): for tests and ``bench allreduce``. On numpy each rank runs in its own thread
    (``reference.allreduce.HostPeers`` waits on a barrier); on CUDA each rank's launch must run on its
    own stream (the kernels wait on each other), or all ranks as one launch (``rank=None``)."""
    t = timeout_s() if timeout is None else timeout
    if backend.is_cuda:
        from ..kernels.allreduce import PeerBuffers

        peers = PeerBuffers.local(nranks, hidden, timeout_s=t)
    else:
        from ..reference.allreduce import HostPeers

        peers = HostPeers(nranks, hidden, timeout_s=t)
    return [OneShot(peers, r, backend) for r in range(nranks)]
