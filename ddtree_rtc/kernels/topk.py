"""Vocabulary top-k with fp32 log-softmax on the GPU. See cuda_src/topk.cu; the rules (NaN/inf,
ties, clamping) are in ddtree_rtc/reference/topk.py. Ids match the reference exactly, log-probs to
fp32 rounding.

Plan/run: ``topk_workspace`` (host, once per shape) picks how many blocks share a row and allocates
their scratch; ``topk_logprobs`` with a workspace and outputs given is one graph-capturable launch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..reference.topk import check_k
from ._args import BF16, allow_dynamic_smem, check, dtype_name, out_array
from .registry import module, spec

_THREADS = 512  # fixed by the kernel
_MAX_SLICES = 8
_MIN_SLICE = 16384  # below this a slice's selection and the merge cost more than the split saves
_SMALL_SMEM = 48 * 1024


def default_cap() -> int:
    return spec("topk").params["TOPK_CAP"]


@dataclass
class TopkWorkspace:
    """Per-shape scratch: each row is split over ``slices`` blocks; the last one merges."""

    rows: int
    vocab: int
    k: int
    slices: int
    keys: object  # [rows, slices, k] uint64 per-slice candidates (None for one slice)
    ms: object  # [rows, slices, 2] fp32 per-slice (max, sum of exp)
    count: object  # [rows] uint32 arrival counters, zero between launches


def _sm_count() -> int:
    import cupy

    return cupy.cuda.Device().attributes["MultiProcessorCount"]


def topk_workspace(shape, k: int, slices: int | None = None, cap: int | None = None):
    """Scratch for logits of ``shape`` (``[..., V]``); ``slices`` blocks per row (default: enough
    rows x slices to give every SM one block, at most 8, at least 16 K tokens per slice)."""
    import cupy

    vocab = int(shape[-1])
    rows = math.prod(int(s) for s in shape[:-1])
    k = check_k(k, vocab)
    cap = default_cap() if cap is None else int(cap)
    most = max(1, min(_MAX_SLICES, cap // k))
    if slices is None:
        slices = max(1, min(most, _sm_count() // max(rows, 1), vocab // _MIN_SLICE))
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
    sorted by log-prob descending, ties by the smaller id. ``workspace`` from ``topk_workspace``."""
    return launch(logits, k, out_logq, out_ids, workspace)


def launch(logits, k: int, out_logq=None, out_ids=None, workspace=None, cap: int | None = None):
    """``topk_logprobs`` with an explicit candidate-buffer size (tests use a small one)."""
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
    cap = default_cap() if cap is None else int(cap)
    ws = topk_workspace(logits.shape, k, cap=cap) if workspace is None else workspace
    if (ws.rows, ws.vocab, ws.k) != (rows, vocab, k):
        raise ValueError(f"workspace: made for rows={ws.rows}, vocab={ws.vocab}, k={ws.k}, "
                         f"called with rows={rows}, vocab={vocab}, k={k}")
    if ws.slices * k > cap:
        raise ValueError(f"workspace: {ws.slices} slices x k={k} exceed the candidate buffer ({cap})")
    if rows == 0:
        return logq, ids
    per16 = 16 // logits.dtype.itemsize
    vec = int(vocab % per16 == 0 and logits.data.ptr % 16 == 0)
    mod = module("topk") if cap == default_cap() else module("topk", TOPK_CAP=cap)
    fn = mod.fn("topk_bf16_kernel" if logits.dtype == BF16 else "topk_f32_kernel")
    smem = (cap + 512) * 8
    if smem > _SMALL_SMEM:
        allow_dynamic_smem(fn, smem)
    null = np.uint64(0)
    split = ws.slices > 1
    fn((rows * ws.slices,), (_THREADS,),
       (logits, np.int32(vocab), np.int32(k), np.int32(ws.slices), np.int32(vec), logq, ids,
        ws.keys if split else null, ws.ms if split else null, ws.count if split else null),
       shared_mem=smem)
    return logq, ids
