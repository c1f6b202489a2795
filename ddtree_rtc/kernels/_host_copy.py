"""Host-to-device copies into existing device arrays that do not wait for the stream.

A cudaMemcpyAsync from pageable host memory may hold the host until the stream reaches the copy
(the driver stages pageable memory itself), so a copy enqueued behind queued kernels (a round's
verify plan behind its draft) would cost the host that whole queue. ``copy_in`` stages the host
array in page-locked memory kept per destination and enqueues the copy on the current stream; the
host returns at once. An event recorded after each copy guards its staging buffer: the host waits on
it only before writing that buffer again, and by then the copy has long run (a round reads its
results on the host before the next round plans).

Not under stream capture: a captured copy would read the staging buffer when the graph is replayed,
after later copies had overwritten it, so ``copy_in`` refuses a capturing stream.
"""

from __future__ import annotations

import numpy as np

MAX_STAGED = 4096  # destinations with a staging buffer; past it, all are waited for and dropped
CHUNK_BYTES = 1 << 20  # page-locked memory is allocated this much at a time (cudaHostAlloc is slow)
ALIGN = 64


class _Staging:
    """The page-locked host twin of one destination (device address, shape, dtype) and the event
    after its last copy (None: no copy yet)."""

    __slots__ = ("host", "event")

    def __init__(self, host: np.ndarray):
        self.host = host
        self.event = None

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


_staged: dict[tuple, _Staging] = {}
_chunk = [None, 0]  # the page-locked chunk staging buffers are cut from, and the bytes cut so far


def _pinned(dst) -> np.ndarray:
    """A page-locked host array of ``dst``'s shape and dtype, cut from the current chunk (a new chunk
    when it is full; the buffers cut from a chunk keep it alive)."""
    import cupy

    nbytes = dst.nbytes
    chunk, used = _chunk
    if chunk is None or used + nbytes > chunk.size():
        chunk, used = cupy.cuda.alloc_pinned_memory(max(CHUNK_BYTES, nbytes)), 0
    _chunk[:] = chunk, used + -(-nbytes // ALIGN) * ALIGN
    return np.frombuffer(chunk, np.uint8, nbytes, used).view(dst.dtype).reshape(dst.shape)


def copy_in(dst, host: np.ndarray) -> None:
    """Copy ``host`` (the shape of ``dst``; cast to its dtype as ``astype`` would) into the
    C-contiguous device array ``dst``, in place and in stream order on the current stream; returns
    without waiting for the stream."""
    import cupy

    if host.shape != dst.shape:
        raise ValueError(f"copy_in: shape {host.shape} != destination {tuple(dst.shape)}")
    if not dst.flags.c_contiguous:
        raise ValueError(f"copy_in: the destination {tuple(dst.shape)} {dst.dtype} is not C-contiguous")
    if dst.size == 0:
        return
    stream = cupy.cuda.get_current_stream()
    if stream.ptr and stream.is_capturing():  # the legacy default stream is never captured
        raise RuntimeError("copy_in: the current stream is capturing a CUDA graph; a captured copy would read "
                           "its staging buffer at replay, after later copies overwrote it")
    key = (dst.data.ptr, dst.shape, dst.dtype.str)
    st = _staged.get(key)
    if st is None:
        if len(_staged) >= MAX_STAGED:
            release()
        st = _staged[key] = _Staging(_pinned(dst))
    st.wait()  # its last copy has read the buffer (long since, as a rule)
    np.copyto(st.host, host, casting="unsafe")
    dst.data.copy_from_host_async(st.host.ctypes.data, dst.nbytes, stream)
    if st.event is None:
        st.event = cupy.cuda.Event(block=False, disable_timing=True)
    st.event.record(stream)


def release() -> None:
    """Wait for every staged copy and drop the staging buffers (their chunks go back to CuPy's pinned
    pool, which may hand them to other copies: hence the wait)."""
    for st in _staged.values():
        st.wait()
    _staged.clear()
    _chunk[:] = None, 0
