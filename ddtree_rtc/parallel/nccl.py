"""The ``nccl`` communicator: ``cupy.cuda.nccl`` on the rank's GPU (LOCAL_RANK), every collective on
CuPy's current stream (so a CUDA graph captures it). Rank 0 makes the NCCL unique id and hands it to
the others through a tiny TCP store at MASTER_ADDR, port MASTER_PORT + 1 (launch.py); every connect
and accept has a deadline. CuPy is imported here only, so CPU machines never need NCCL."""

from __future__ import annotations

import socket
import time

import numpy as np

from .comm import Communicator, DistError, timeout_s

_ID_BYTES = 128  # ncclUniqueId


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionError("peer closed the connection")
        buf += part
    return buf


def exchange_unique_id(rank: int, world_size: int, addr: str, port: int, make_id, timeout: float) -> bytes:
    """Rank 0: ``make_id()`` (128 bytes), served to world_size - 1 peers; others: fetch it."""
    deadline = time.monotonic() + timeout
    if rank == 0:
        uid = make_id()
        with socket.create_server((addr, port), reuse_port=False) as srv:
            srv.settimeout(timeout)
            served = 0
            while served < world_size - 1:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DistError(f"rank 0: only {served} of {world_size - 1} peers connected to "
                                    f"{addr}:{port} within {timeout:g} s")
                srv.settimeout(left)
                try:
                    conn, _ = srv.accept()
                except TimeoutError:
                    continue
                with conn:
                    conn.sendall(uid)
                served += 1
        return uid
    while True:
        try:
            with socket.create_connection((addr, port), timeout=max(0.1, deadline - time.monotonic())) as s:
                s.settimeout(max(0.1, deadline - time.monotonic()))
                return _recv_exact(s, _ID_BYTES)
        except (ConnectionError, OSError) as e:
            if time.monotonic() > deadline:
                raise DistError(f"rank {rank}: no NCCL id from rank 0 at {addr}:{port} within {timeout:g} s "
                                f"({e})") from None
            time.sleep(0.05)


class NcclCommunicator(Communicator):
    name = "nccl"

    def __init__(self, rank: int, world_size: int, local_rank: int, addr: str, port: int,
                 timeout: float | None = None):
        super().__init__(rank, world_size)
        import cupy
        from cupy.cuda import nccl

        self._cp, self._nccl = cupy, nccl
        self.device = cupy.cuda.Device(local_rank)
        self.device.use()
        timeout = timeout_s() if timeout is None else timeout

        def make_id() -> bytes:
            uid = nccl.get_unique_id()  # bytes from CuPy 14 on, a tuple of signed chars before
            if isinstance(uid, (bytes, bytearray)):
                return bytes(uid)
            return bytes(np.asarray(uid, np.int8).view(np.uint8))

        uid = exchange_unique_id(rank, world_size, addr, port, make_id, timeout)
        try:
            self._comm = nccl.NcclCommunicator(world_size, uid, rank)  # CuPy >= 14 takes the bytes
        except TypeError:  # older CuPy: its typed ``tuple commId`` refuses bytes
            self._comm = nccl.NcclCommunicator(world_size, tuple(np.frombuffer(uid, np.int8).tolist()), rank)
        self._types = {np.dtype(np.float32): nccl.NCCL_FLOAT32, np.dtype(np.uint16): nccl.NCCL_BFLOAT16,
                       np.dtype(np.float16): nccl.NCCL_FLOAT16, np.dtype(np.int32): nccl.NCCL_INT32,
                       np.dtype(np.int64): nccl.NCCL_INT64, np.dtype(np.uint8): nccl.NCCL_UINT8}

    def _type(self, x):
        # uint16 arrays are the CUDA backend's bf16 bits; NCCL sums them as bf16
        t = self._types.get(np.dtype(x.dtype))
        if t is None:
            raise TypeError(f"nccl communicator: dtype {x.dtype} is not supported")
        if not x.flags.c_contiguous:
            raise ValueError("nccl communicator: arrays must be C-contiguous")
        return t

    def _stream(self) -> int:
        return self._cp.cuda.get_current_stream().ptr

    def _all_reduce(self, x):
        self._comm.allReduce(x.data.ptr, x.data.ptr, x.size, self._type(x), self._nccl.NCCL_SUM, self._stream())
        return x

    def _all_gather(self, x):
        out = self._cp.empty((self.world_size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype)
        x = self._cp.ascontiguousarray(x)
        self._comm.allGather(x.data.ptr, out.data.ptr, x.size, self._type(x), self._stream())
        return out

    def _broadcast(self, x, root: int):
        self._comm.broadcast(x.data.ptr, x.data.ptr, x.size, self._type(x), root, self._stream())
        return x

    def _barrier(self):
        flag = self._cp.zeros(1, np.int32)
        self._all_reduce(flag)
        self._cp.cuda.get_current_stream().synchronize()

    def close(self) -> None:
        if self.oneshot is not None:
            self.oneshot.close()
            self.oneshot = None
        if getattr(self, "_comm", None) is not None:
            self._comm.destroy()
            self._comm = None
