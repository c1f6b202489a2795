"""Vocabulary top-k with fp32 log-softmax on the GPU. See cuda_src/topk.cu; the rules (NaN/inf,
ties, clamping) are in ddtree_rtc/reference/topk.py. Ids match the reference exactly, log-probs to
fp32 rounding.

Two variants, same results; ``topk_workspace`` picks one per shape (the measurements behind the
rule: benchmarks/README.md, topk):
  * ``radix`` for at most RADIX_MAX_ROWS rows and for every k > STREAM_MAX_K: two launches. Many
    small blocks per row stream the logits once (max / sum of exponentials, a 4096-bin histogram of
    each 16-byte vector's largest key, the largest bin per 128-byte group); then one block per row
    finds the bin holding the k-th vector key and re-reads only the groups that reach it.
  * ``stream`` elsewhere (more rows, k <= 256): every row is cut into chunks (multiples of 8 K
    tokens), one 256-thread block each, reading its chunk once from HBM and keeping only the
    16-byte vectors that reach a threshold rising as it goes; the last block of a row merges.

Plan/run: ``topk_workspace`` (host, once per shape) picks the variant and the split and allocates
its scratch; ``topk_logprobs`` with a workspace and outputs given is graph-capturable (radix: two
launches, stream: one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..reference.topk import check_k
from ._args import BF16, allow_dynamic_smem, check, dtype_name, out_array
from ._launch import sm_count
from .registry import module, spec

VARIANTS = ("stream", "radix")
# Rows up to which radix is the default at every k: the drafter's batch 8 x depth 7, the largest
# batch where it won (stream wins from batch 32 on at k <= 256; between them it is not measured).
RADIX_MAX_ROWS = 56
_MAX_ROWS = 65535  # rows are the grid's y
_STREAM_THREADS = 256  # ST in the kernel
STREAM_MAX_K = 256  # STREAM_MAX_K
_STREAM_STEP = 8192  # chunk granularity in tokens: one block step of bf16 vectors (two of fp32)
_STREAM_BUFFER = 2048 * 24  # bytes of dynamic shared memory: the vector buffer (keys and bytes)
_STREAM_MERGE_KEYS = _STREAM_BUFFER // 8  # chunks x k keys the merging block holds in that area
_STREAM_MAX_CHUNKS = 5  # more chunks per row cost more in per-block selects than they gain
_RADIX_THREADS = 256  # RT in the kernel
_RADIX_BINS = 4096  # RBINS
_RADIX_WINDOW = 4096  # RWIN: groups the select block lists at once
_RADIX_STEP = 256  # radix chunks are multiples of this many 16-byte vectors (one per thread)
_RADIX_MIN_VECS = 1024  # default chunks at least this long: a block's histogram work is fixed
_RADIX_BLOCKS_PER_SM = 8  # default split: about this many hist blocks per SM (two waves at 4 resident)


def _cand_keys() -> int:
    """The radix select block's candidate buffer, in keys (the module's TOPK_CAP)."""
    return spec("topk").params["TOPK_CAP"]


@dataclass
class TopkWorkspace:
    """Per-shape scratch: each row is split over ``chunks`` blocks (stream: of ``tokens`` tokens,
    the last one to finish merges; radix: of ``vectors`` 16-byte vectors, a second launch selects)."""

    rows: int
    vocab: int
    k: int
    chunks: int  # stream: blocks per row; radix: chunks per row of fp32 logits (the most)
    keys: object  # stream: [rows, chunks, k] uint64 per-block candidates (None for one block)
    ms: object  # [rows, chunks, 2] fp32 per-block (max, sum of exp)
    count: object  # stream: [rows] uint32 arrival counters, zero between launches
    variant: str
    vectors: int = 0  # radix: 16-byte vectors per chunk
    tokens: int = 0  # stream: tokens per chunk
    hist: object = None  # radix: [rows, 4096] uint32 row histograms, zero between launches
    gmax: object = None  # radix: [rows, groups of 8 fp32 vectors, rounded up to 8] uint16 largest bin per group


def _plan_stream(rows: int, vocab: int, k: int) -> int:
    """Tokens per stream chunk: enough chunks per row to give every SM a block (at most 5), in
    steps of 8 K tokens, large enough that the chunks x k keys fit the merge."""
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


def default_variant(rows: int, k: int) -> str:
    """The variant ``topk_workspace`` picks for ``rows`` rows and this k."""
    return "radix" if rows <= RADIX_MAX_ROWS or k > STREAM_MAX_K else "stream"


def _stream(rows: int, vocab: int, k: int, chunk: int) -> TopkWorkspace:
    import cupy

    chunks = -(-vocab // chunk)
    if chunks == 1:
        return TopkWorkspace(rows, vocab, k, 1, None, None, None, "stream", tokens=chunk)
    return TopkWorkspace(rows, vocab, k, chunks, cupy.empty((rows, chunks, k), dtype=np.uint64),
                         cupy.empty((rows, chunks, 2), dtype=np.float32), cupy.zeros((rows,), dtype=np.uint32),
                         "stream", tokens=chunk)


def _radix(rows: int, vocab: int, k: int, vectors: int) -> TopkWorkspace:
    """A radix workspace; its per-chunk and per-group scratch is sized for fp32 rows (the most vectors)."""
    import cupy

    nvec = -(-vocab // 4)
    chunks = -(-nvec // vectors)
    return TopkWorkspace(rows, vocab, k, chunks, None, cupy.empty((rows, chunks, 2), dtype=np.float32), None,
                         "radix", vectors=vectors, hist=cupy.zeros((rows, _RADIX_BINS), dtype=np.uint32),
                         gmax=cupy.empty((rows, -(-nvec // 64) * 8), dtype=np.uint16))


def topk_workspace(shape, k: int, variant: str | None = None, vectors: int | None = None, chunk: int | None = None):
    """Scratch for logits of ``shape`` (``[..., V]``). ``variant`` None: ``default_variant``.
    Stream: ``chunk`` tokens per chunk (a multiple of 8192; default: the fewest chunks that give a
    full wave of blocks). Radix: ``vectors`` 16-byte vectors per chunk, a multiple of 256 (default:
    about 8 blocks per SM, chunks of at least 1024 vectors)."""
    vocab = int(shape[-1])
    rows = math.prod(int(s) for s in shape[:-1])
    k = check_k(k, vocab)
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"variant={variant!r}: expected one of {VARIANTS}")
    variant = variant or default_variant(rows, k)
    if rows > _MAX_ROWS:
        raise ValueError(f"logits: {rows} rows; the top-k kernels take at most {_MAX_ROWS} (the grid's y)")
    if variant == "stream":
        if vectors is not None:
            raise ValueError("vectors belongs to the radix variant")
        if k > STREAM_MAX_K:
            raise ValueError(f"variant='stream' takes k <= {STREAM_MAX_K} (got k={k})")
        if chunk is None:
            chunk = _plan_stream(rows, vocab, k)
        elif int(chunk) <= 0 or int(chunk) % _STREAM_STEP:
            raise ValueError(f"chunk={chunk} is out of range: a positive multiple of {_STREAM_STEP}")
        chunk = int(chunk)
        if -(-vocab // chunk) * k > _STREAM_MERGE_KEYS:
            raise ValueError(f"chunk={chunk}: {-(-vocab // chunk)} chunks x k={k} exceed the merge buffer "
                             f"({_STREAM_MERGE_KEYS})")
        return _stream(rows, vocab, k, chunk)
    if chunk is not None:
        raise ValueError("chunk belongs to the stream variant")
    if vectors is None:
        vectors = _plan_radix(rows, vocab)
    elif int(vectors) <= 0 or int(vectors) % _RADIX_STEP:
        raise ValueError(f"vectors={vectors} is out of range: a positive multiple of {_RADIX_STEP} for 'radix'")
    return _radix(rows, vocab, k, int(vectors))


def topk_logprobs(logits, k: int, out_logq=None, out_ids=None, workspace=None):
    """logits ``[..., V]`` (bf16 bits or fp32) -> (logq ``[..., k]`` fp32, ids ``[..., k]`` int32),
    sorted by log-prob descending, ties by the smaller id. ``workspace`` from ``topk_workspace``
    (it also picks the variant)."""
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
    ws = topk_workspace(logits.shape, k) if workspace is None else workspace
    if (ws.rows, ws.vocab, ws.k) != (rows, vocab, k):
        raise ValueError(f"workspace: made for rows={ws.rows}, vocab={ws.vocab}, k={ws.k}, "
                         f"called with rows={rows}, vocab={vocab}, k={k}")
    if rows == 0:
        return logq, ids
    per16 = 16 // logits.dtype.itemsize
    vec = int(vocab % per16 == 0 and logits.data.ptr % 16 == 0)
    if ws.variant == "radix":
        nvec = -(-vocab // per16)
        chunks = -(-nvec // ws.vectors)
        name = "bf16" if logits.dtype == BF16 else "f32"
        hist_fn = module("topk").fn(f"topk_radix_hist_{name}_kernel")
        select_fn = module("topk").fn(f"topk_radix_select_{name}_kernel")
        smem = (_cand_keys() + 512) * 8 + _RADIX_WINDOW * 4
        allow_dynamic_smem(select_fn, smem)
        ms_stride, g_stride = np.int32(ws.ms.shape[1]), np.int32(ws.gmax.shape[1])
        hist_fn((chunks, rows), (_RADIX_THREADS,),
                (logits, np.int32(vocab), np.int32(k), np.int32(ws.vectors), np.int32(vec), ws.ms, ms_stride,
                 ws.hist, ws.gmax, g_stride))
        select_fn((rows,), (_RADIX_THREADS,),
                  (logits, np.int32(vocab), np.int32(k), np.int32(chunks), np.int32(vec), ws.ms, ms_stride, ws.hist,
                   ws.gmax, g_stride, logq, ids), shared_mem=smem)
        return logq, ids
    split = ws.chunks > 1
    fn = module("topk").fn("topk_stream_bf16_kernel" if logits.dtype == BF16 else "topk_stream_f32_kernel")
    smem = _STREAM_BUFFER  # the merge's chunks x k keys fit in the buffer
    allow_dynamic_smem(fn, smem)
    null = np.uint64(0)
    fn((ws.chunks, rows), (_STREAM_THREADS,),
       (logits, np.int32(vocab), np.int32(k), np.int32(ws.chunks), np.int32(ws.tokens), np.int32(vec), logq, ids,
        ws.keys if split else null, ws.ms if split else null, ws.count if split else null),
       shared_mem=smem)
    return logq, ids
