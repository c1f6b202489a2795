"""Vocabulary top-k with fp32 log-softmax on the GPU. See cuda_src/topk.cu; the rules (NaN/inf,
ties, clamping) are in ddtree_rtc/reference/topk.py. Ids match the reference exactly, log-probs to
fp32 rounding.

Four variants, same results:
  * ``stream`` (default for k <= 256): every row is cut into chunks (multiples of 8 K tokens), one
    256-thread block each, reading its chunk once from HBM and keeping only the 16-byte vectors
    that reach a threshold rising as it goes; the last block of a row merges.
  * ``chunked`` (default for k = 512): chunks of up to 16 K bf16 / 8 K fp32 tokens, each copied
    once into shared memory and selected there; the last block of a row merges.
  * ``slices``: the older kernel, one 512-thread block per row slice (at most 8 per row), which
    re-reads its slice (mostly from L2). Used for k = 257..511 and where no merge buffer would fit.
  * ``radix`` (never the default yet; only by name): two launches. Many small blocks per row
    stream the logits once (max / sum of exponentials, a 4096-bin histogram of each 16-byte
    vector's largest key, the largest bin per 128-byte group); then one block per row finds the
    bin holding the k-th vector key and re-reads only the groups that reach it.

Plan/run: ``topk_workspace`` (host, once per shape) picks the split and allocates its scratch;
``topk_logprobs`` with a workspace and outputs given is one graph-capturable launch (radix: two).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..reference.topk import check_k
from ._args import BF16, allow_dynamic_smem, check, dtype_name, out_array
from ._launch import sm_count
from .registry import module, spec

VARIANTS = ("stream", "chunked", "slices", "radix")
_THREADS = 512  # fixed by the slices kernel
_CHUNK_THREADS = 256  # fixed by the chunked kernel (CT)
_MAX_VECS = 2048  # 16-byte vectors per chunk at most (MAX_VECS)
_MIN_VECS = 256  # one vector per thread
_MERGE_KEYS = 10240  # chunks x k keys the merging block holds (80 KB of shared memory: sm_120 has 99 KB)
_MAX_ROWS = 65535  # rows are the grid's y
# H200 (V=163840, bf16): chunked is 1.3-2.3x faster at k=512 and 0.7-1.0x below (the slices kernel
# selects small k from L2-resident slices cheaply); the default takes it from here
CHUNKED_MIN_K = 512
_MAX_SLICES = 8
_STREAM_THREADS = 256  # ST in the kernel
STREAM_MAX_K = 256  # STREAM_MAX_K
_STREAM_STEP = 8192  # chunk granularity in tokens: one block step of bf16 vectors (two of fp32)
_STREAM_BUFFER = 2048 * 24  # bytes of dynamic shared memory: the vector buffer (keys and bytes)
_STREAM_MERGE_KEYS = _STREAM_BUFFER // 8  # chunks x k keys the merging block holds in that area
_STREAM_MAX_CHUNKS = 5  # H200: more chunks per row cost more in per-block selects than they gain
_MIN_SLICE = 16384  # below this a slice's selection and the merge cost more than the split saves
_RADIX_THREADS = 256  # RT in the kernel
_RADIX_BINS = 4096  # RBINS
_RADIX_WINDOW = 4096  # RWIN: groups the select block lists at once
_RADIX_STEP = 256  # radix chunks are multiples of this many 16-byte vectors (one per thread)
_RADIX_MIN_VECS = 1024  # default chunks at least this long: a block's histogram work is fixed
_RADIX_BLOCKS_PER_SM = 8  # default split: about this many hist blocks per SM (two waves at 4 resident)


def default_cap() -> int:
    return spec("topk").params["TOPK_CAP"]


@dataclass
class TopkWorkspace:
    """Per-shape scratch: each row is split over several blocks (``slices`` of them, or chunks of
    ``vectors`` 16-byte vectors); the last one to finish merges (radix: a second launch selects)."""

    rows: int
    vocab: int
    k: int
    slices: int  # slices variant: blocks per row; chunked and radix: chunks per row of fp32 logits (the most)
    keys: object  # [rows, slices, k] uint64 per-block candidates (None for one block)
    ms: object  # [rows, slices, 2] fp32 per-block (max, sum of exp)
    count: object  # [rows] uint32 arrival counters, zero between launches
    variant: str = "slices"
    vectors: int = 0  # chunked and radix: 16-byte vectors per chunk
    tokens: int = 0  # stream: tokens per chunk
    hist: object = None  # radix: [rows, 4096] uint32 row histograms, zero between launches
    gmax: object = None  # radix: [rows, groups of 8 fp32 vectors, rounded up to 8] uint16 largest bin per group

    def chunk(self, itemsize: int) -> int:
        """Chunk length in tokens for logits of this element size (chunked, stream and radix variants)."""
        return self.tokens if self.variant == "stream" else self.vectors * (16 // itemsize)


def _chunks(vocab: int, vectors: int, itemsize: int) -> int:
    return -(-vocab // (vectors * (16 // itemsize)))


def _chunk_smem(k: int, chunks: int, itemsize: int) -> int:
    """Dynamic shared memory of the chunked kernel (the layout in cuda_src/topk.cu)."""
    return 8 * max(2 * _MAX_VECS + max(_MAX_VECS, (16 // itemsize) * k), chunks * k)


def _plan_vectors(rows: int, vocab: int, k: int) -> int | None:
    """Vectors per chunk: the full 2048 unless that leaves fewer than two blocks per SM, then
    halved while the merge still fits; None when even full chunks give too many keys to merge."""
    if rows > _MAX_ROWS or _chunks(vocab, _MAX_VECS, 4) * k > _MERGE_KEYS:
        return None
    vectors, want = _MAX_VECS, 2 * sm_count()
    while (vectors > _MIN_VECS and rows * _chunks(vocab, vectors, 2) < want
           and _chunks(vocab, vectors // 2, 4) * k <= _MERGE_KEYS):
        vectors //= 2
    return vectors


def _plan_stream(rows: int, vocab: int, k: int) -> int | None:
    """Tokens per stream chunk: enough chunks per row to give every SM a block (at most 5), in
    steps of 8 K tokens; None when k is too large for the variant."""
    if k > STREAM_MAX_K or rows > _MAX_ROWS:
        return None
    want = min(_STREAM_MAX_CHUNKS, -(-sm_count() // max(rows, 1)))
    chunk = -(-vocab // max(want, 1))
    chunk = -(-chunk // _STREAM_STEP) * _STREAM_STEP
    while -(-vocab // chunk) * k > _STREAM_MERGE_KEYS:
        chunk += _STREAM_STEP
    return chunk




def _plan_radix(rows: int, vocab: int) -> int:
    """16-byte vectors per radix chunk: enough chunks (of bf16 rows) for about
    _RADIX_BLOCKS_PER_SM blocks per SM, each at least _RADIX_MIN_VECS long, in steps of 256."""
    nvec = -(-vocab // 8)
    want = -(-(_RADIX_BLOCKS_PER_SM * sm_count()) // max(rows, 1))
    want = max(1, min(want, -(-nvec // _RADIX_MIN_VECS)))
    vectors = -(-nvec // want)
    return -(-vectors // _RADIX_STEP) * _RADIX_STEP


def _radix(rows: int, vocab: int, k: int, vectors: int) -> TopkWorkspace:
    """A radix workspace; its per-chunk and per-group scratch is sized for fp32 rows (the most vectors)."""
    import cupy

    nvec = -(-vocab // 4)
    chunks = -(-nvec // vectors)
    return TopkWorkspace(rows, vocab, k, chunks, None, cupy.empty((rows, chunks, 2), dtype=np.float32), None,
                         "radix", vectors=vectors, hist=cupy.zeros((rows, _RADIX_BINS), dtype=np.uint32),
                         gmax=cupy.empty((rows, -(-nvec // 64) * 8), dtype=np.uint16))


def _split(rows: int, vocab: int, k: int, chunks: int, variant: str, **fields) -> TopkWorkspace:
    """A workspace with ``chunks`` blocks per row (their scratch only when there are several)."""
    import cupy

    if chunks == 1:
        return TopkWorkspace(rows, vocab, k, 1, None, None, None, variant, **fields)
    return TopkWorkspace(rows, vocab, k, chunks, cupy.empty((rows, chunks, k), dtype=np.uint64),
                         cupy.empty((rows, chunks, 2), dtype=np.float32), cupy.zeros((rows,), dtype=np.uint32),
                         variant, **fields)


def topk_workspace(shape, k: int, slices: int | None = None, cap: int | None = None,
                   variant: str | None = None, vectors: int | None = None, chunk: int | None = None):
    """Scratch for logits of ``shape`` (``[..., V]``). ``variant`` None: stream for k <= 256,
    chunked for larger k where its merge fits, else slices. Stream: ``chunk`` tokens per chunk (a
    multiple of 8192; default: the fewest chunks that give a full wave of blocks). Chunked:
    ``vectors`` 16-byte vectors per chunk (256..2048, default: full chunks, smaller while the grid is
    under two blocks per SM). Radix (only when named): ``vectors`` 16-byte vectors per chunk, a
    multiple of 256 (default: about 8 blocks per SM, chunks of at least 1024 vectors). Slices:
    ``slices`` blocks per row (default: enough rows x slices to give every SM one block, at most 8,
    at least 16 K tokens per slice), ``cap`` the candidate buffer."""
    import cupy

    vocab = int(shape[-1])
    rows = math.prod(int(s) for s in shape[:-1])
    k = check_k(k, vocab)
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"variant={variant!r}: expected one of {VARIANTS}")
    if variant is None and slices is None and cap is None and vectors is None:
        if chunk is not None or _plan_stream(rows, vocab, k):
            variant = "stream"
        elif k >= CHUNKED_MIN_K and _plan_vectors(rows, vocab, k):
            variant = "chunked"
    variant = variant or "slices"
    if chunk is not None and variant != "stream":
        raise ValueError("chunk belongs to the stream variant")
    if variant == "stream":
        if slices is not None or cap is not None or vectors is not None:
            raise ValueError("slices, cap and vectors belong to the slices and chunked variants")
        if k > STREAM_MAX_K or rows > _MAX_ROWS:
            raise ValueError(f"variant='stream' takes k <= {STREAM_MAX_K} and at most {_MAX_ROWS} rows "
                             f"(got k={k}, {rows} rows)")
        if chunk is None:
            chunk = _plan_stream(rows, vocab, k)
        elif int(chunk) <= 0 or int(chunk) % _STREAM_STEP:
            raise ValueError(f"chunk={chunk} is out of range: a positive multiple of {_STREAM_STEP}")
        chunk = int(chunk)
        chunks = -(-vocab // chunk)
        if chunks * k > _STREAM_MERGE_KEYS:
            raise ValueError(f"chunk={chunk}: {chunks} chunks x k={k} exceed the merge buffer ({_STREAM_MERGE_KEYS})")
        return _split(rows, vocab, k, chunks, "stream", tokens=chunk)
    if variant == "radix":
        if slices is not None or cap is not None:
            raise ValueError("slices and cap belong to the slices variant")
        if rows > _MAX_ROWS:
            raise ValueError(f"variant='radix' takes at most {_MAX_ROWS} rows (got {rows})")
        if vectors is None:
            vectors = _plan_radix(rows, vocab)
        elif int(vectors) <= 0 or int(vectors) % _RADIX_STEP:
            raise ValueError(f"vectors={vectors} is out of range: a positive multiple of {_RADIX_STEP} for 'radix'")
        return _radix(rows, vocab, k, int(vectors))
    if variant == "chunked":
        if slices is not None or cap is not None:
            raise ValueError("slices and cap belong to the slices variant")
        if vectors is None:
            vectors = _plan_vectors(rows, vocab, k)
            if vectors is None:
                raise ValueError(f"variant='chunked' does not fit {rows} rows x vocab {vocab} x k={k} "
                                 f"(at most {_MAX_ROWS} rows and chunks * k <= {_MERGE_KEYS}); use 'slices'")
        elif not (_MIN_VECS <= int(vectors) <= _MAX_VECS and int(vectors) % _MIN_VECS == 0) or rows > _MAX_ROWS:
            raise ValueError(f"vectors={vectors} is out of range: a multiple of {_MIN_VECS} up to {_MAX_VECS}"
                             f" (and at most {_MAX_ROWS} rows)")
        vectors = int(vectors)
        chunks = _chunks(vocab, vectors, 4)
        if chunks * k > _MERGE_KEYS:
            raise ValueError(f"vectors={vectors}: {chunks} chunks x k={k} exceed the merge buffer ({_MERGE_KEYS})")
        return _split(rows, vocab, k, chunks, "chunked", vectors=vectors)
    if vectors is not None:
        raise ValueError("vectors belongs to the chunked and radix variants")
    cap = default_cap() if cap is None else int(cap)
    most = max(1, min(_MAX_SLICES, cap // k))
    if slices is None:
        slices = max(1, min(most, sm_count() // max(rows, 1), vocab // _MIN_SLICE))
    elif not 1 <= int(slices) <= most:
        raise ValueError(f"slices={slices} is out of range 1..{most} (at most {_MAX_SLICES}, and "
                         f"slices * k <= {cap})")
    slices = int(slices)
    if slices == 1:
        return TopkWorkspace(rows, vocab, k, 1, None, None, None)
    return TopkWorkspace(rows, vocab, k, slices, cupy.empty((rows, slices, k), dtype=np.uint64),
                         cupy.empty((rows, slices, 2), dtype=np.float32),
                         cupy.zeros((rows,), dtype=np.uint32))


def topk_logprobs(logits, k: int, out_logq=None, out_ids=None, workspace=None):
    """logits ``[..., V]`` (bf16 bits or fp32) -> (logq ``[..., k]`` fp32, ids ``[..., k]`` int32),
    sorted by log-prob descending, ties by the smaller id. ``workspace`` from ``topk_workspace``
    (it also picks the variant)."""
    return launch(logits, k, out_logq, out_ids, workspace)


def launch(logits, k: int, out_logq=None, out_ids=None, workspace=None, cap: int | None = None):
    """``topk_logprobs`` with an explicit candidate-buffer size for the slices variant (tests use a
    small one); without a workspace, ``cap`` given means the slices variant."""
    import cupy

    if not isinstance(logits, cupy.ndarray):
        raise TypeError(f"logits: expected a cupy array on the GPU, got {type(logits).__name__}")
    if logits.dtype not in (BF16, np.float32):
        raise TypeError(f"logits: expected dtype bf16 (uint16 bits) or float32, got {dtype_name(logits.dtype)}")
    if logits.ndim < 1:
        raise ValueError("logits: expected shape [..., vocab]")
    check("logits", logits)
    vocab = logits.shape[-1]
    if vocab >= 2**31:
        raise ValueError(f"logits: vocabulary of {vocab} does not fit int32 ids")
    k = check_k(k, vocab)
    lead = logits.shape[:-1]
    rows = math.prod(lead)
    logq = out_array("out_logq", out_logq, (*lead, k), np.float32)
    ids = out_array("out_ids", out_ids, (*lead, k), np.int32)
    ws = topk_workspace(logits.shape, k, cap=cap) if workspace is None else workspace
    if (ws.rows, ws.vocab, ws.k) != (rows, vocab, k):
        raise ValueError(f"workspace: made for rows={ws.rows}, vocab={ws.vocab}, k={ws.k}, "
                         f"called with rows={rows}, vocab={vocab}, k={k}")
    if rows == 0:
        return logq, ids
    per16 = 16 // logits.dtype.itemsize
    vec = int(vocab % per16 == 0 and logits.data.ptr % 16 == 0)
    null = np.uint64(0)
    if ws.variant == "radix":
        if cap is not None:
            raise ValueError("cap belongs to the slices variant; the workspace is radix")
        nvec = -(-vocab // per16)
        chunks = -(-nvec // ws.vectors)
        name = "bf16" if logits.dtype == BF16 else "f32"
        hist_fn = module("topk").fn(f"topk_radix_hist_{name}_kernel")
        select_fn = module("topk").fn(f"topk_radix_select_{name}_kernel")
        smem = (default_cap() + 512) * 8 + _RADIX_WINDOW * 4
        allow_dynamic_smem(select_fn, smem)
        ms_stride, g_stride = np.int32(ws.ms.shape[1]), np.int32(ws.gmax.shape[1])
        hist_fn((chunks, rows), (_RADIX_THREADS,),
                (logits, np.int32(vocab), np.int32(k), np.int32(ws.vectors), np.int32(vec), ws.ms, ms_stride,
                 ws.hist, ws.gmax, g_stride))
        select_fn((rows,), (_RADIX_THREADS,),
                  (logits, np.int32(vocab), np.int32(k), np.int32(chunks), np.int32(vec), ws.ms, ms_stride, ws.hist,
                   ws.gmax, g_stride, logq, ids), shared_mem=smem)
        return logq, ids
    if ws.variant == "stream":
        if cap is not None:
            raise ValueError("cap belongs to the slices variant; the workspace is stream")
        chunks = ws.slices
        split = chunks > 1
        fn = module("topk").fn("topk_stream_bf16_kernel" if logits.dtype == BF16 else "topk_stream_f32_kernel")
        smem = _STREAM_BUFFER  # the merge's chunks x k keys fit in the buffer
        allow_dynamic_smem(fn, smem)
        fn((chunks, rows), (_STREAM_THREADS,),
           (logits, np.int32(vocab), np.int32(k), np.int32(chunks), np.int32(ws.tokens), np.int32(vec), logq, ids,
            ws.keys if split else null, ws.ms if split else null, ws.count if split else null),
           shared_mem=smem)
        return logq, ids
    if ws.variant == "chunked":
        if cap is not None:
            raise ValueError("cap belongs to the slices variant; the workspace is chunked")
        chunk = ws.chunk(logits.dtype.itemsize)
        chunks = -(-vocab // chunk)
        split = chunks > 1
        fn = module("topk").fn("topk_chunk_bf16_kernel" if logits.dtype == BF16 else "topk_chunk_f32_kernel")
        smem = _chunk_smem(k, chunks, logits.dtype.itemsize)
        allow_dynamic_smem(fn, smem)  # also at <= 48 KB: the kernel's static shared memory counts too
        fn((chunks, rows), (_CHUNK_THREADS,),
           (logits, np.int32(vocab), np.int32(k), np.int32(chunks), np.int32(chunk), np.int32(vec), logq, ids,
            ws.keys if split else null, ws.ms if split else null, ws.count if split else null),
           shared_mem=smem)
        return logq, ids
    cap = default_cap() if cap is None else int(cap)
    if ws.slices * k > cap:
        raise ValueError(f"workspace: {ws.slices} slices x k={k} exceed the candidate buffer ({cap})")
    mod = module("topk") if cap == default_cap() else module("topk", TOPK_CAP=cap)
    fn = mod.fn("topk_bf16_kernel" if logits.dtype == BF16 else "topk_f32_kernel")
    smem = (cap + 512) * 8
    allow_dynamic_smem(fn, smem)  # a no-op when the limit already allows it
    split = ws.slices > 1
    fn((rows * ws.slices,), (_THREADS,),
       (logits, np.int32(vocab), np.int32(k), np.int32(ws.slices), np.int32(vec), logq, ids,
        ws.keys if split else null, ws.ms if split else null, ws.count if split else null),
       shared_mem=smem)
    return logq, ids
