"""Vocabulary top-k reference: fp32 log-softmax and the K most likely tokens per row.

Rules shared with cuda_src/topk.cu:
  * Non-finite logits: NaN and +inf are treated as -inf (the token is never proposed ahead of a
    finite one); -0.0 counts as +0.0.
  * Order: by logit descending, ties by the smaller token id. Log-softmax is monotone, so the
    log-probs come out non-increasing; ids are exact, log-probs agree to fp32 rounding (the sum of
    exponentials is order dependent).
  * lse = max + log(sum(exp(x - max))); a row without a finite logit has lse = 0.
  * Log-probs are clamped to >= -FLT_MAX, so -inf logits give -FLT_MAX: tree scores (float64 sums)
    then never meet inf - inf.
"""

from __future__ import annotations

import numpy as np
from ml_dtypes import bfloat16

FLT_MAX = float(np.finfo(np.float32).max)
MAX_K = 512


def sanitize_logits(logits) -> np.ndarray:
    """fp32 copy with NaN/+inf -> -inf and -0.0 -> +0.0."""
    x = np.asarray(logits)
    if x.dtype not in (np.dtype(np.float32), np.dtype(bfloat16)):
        raise TypeError(f"logits: expected dtype float32 or bfloat16, got {x.dtype}")
    x = x.astype(np.float32)
    x = np.where(x <= FLT_MAX, x, np.float32(-np.inf)).astype(np.float32)
    return x + np.float32(0.0)


def check_k(k: int, vocab: int) -> int:
    k = int(k)
    if vocab < 1:
        raise ValueError(f"logits: vocabulary size must be >= 1, got {vocab}")
    if not 1 <= k <= MAX_K:
        raise ValueError(f"k={k} is out of range: need 1 <= k <= {MAX_K}")
    if k > vocab:
        raise ValueError(f"k={k} is larger than the vocabulary ({vocab}); use k = min(budget, vocab)")
    return k


def log_sum_exp(x: np.ndarray) -> np.ndarray:
    """Per-row lse in float64 of sanitized fp32 logits ``[rows, V]``; 0 where no logit is finite."""
    m = x.max(axis=-1).astype(np.float64)
    finite = m > -np.inf
    safe_m = np.where(finite, m, 0.0)
    s = np.exp(x.astype(np.float64) - safe_m[:, None]).sum(axis=-1)
    return np.where(finite, safe_m + np.log(np.where(finite, s, 1.0)), 0.0)


def _topk_ids(row: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest values, ordered by value descending then id ascending."""
    if k == row.size:
        return np.argsort(-row, kind="stable")
    kth = -np.partition(-row, k - 1)[k - 1]
    above = np.flatnonzero(row > kth)
    ties = np.flatnonzero(row == kth)[: k - above.size]
    ids = np.concatenate([above, ties])
    return ids[np.lexsort((ids, -row[ids]))]


def topk_workspace(shape, k: int, variant: str | None = None, vectors: int | None = None, chunk: int | None = None):
    """No scratch is needed on the CPU (the CUDA twin picks its variant and split here and
    preallocates the per-block scratch)."""
    check_k(k, int(shape[-1]))


def topk_logprobs(logits, k: int, out_logq=None, out_ids=None, workspace=None):
    """logits ``[..., V]`` (fp32 or bf16) -> (logq ``[..., k]`` fp32, ids ``[..., k]`` int32)."""
    x = sanitize_logits(logits)
    vocab = x.shape[-1]
    k = check_k(k, vocab)
    lead = x.shape[:-1]
    rows = x.reshape(-1, vocab)
    lse = log_sum_exp(rows)
    ids = np.empty((rows.shape[0], k), dtype=np.int32)
    for r in range(rows.shape[0]):
        ids[r] = _topk_ids(rows[r], k)
    vals = np.take_along_axis(rows, ids.astype(np.int64), axis=-1).astype(np.float64)
    logq = np.maximum(vals - lse[:, None], -FLT_MAX).astype(np.float32)
    logq, ids = logq.reshape(*lead, k), ids.reshape(*lead, k)
    if out_logq is not None:
        out_logq[...] = logq
        logq = out_logq
    if out_ids is not None:
        out_ids[...] = ids
        ids = out_ids
    return logq, ids
