"""Absorbed MLA attention over a paged latent cache, in numpy (float64 math), plus the host-side batch
validation that the CUDA plan shares.

A batch holds B requests. Request b has ``ctx_lens[b]`` committed cache rows (positions 0..ctx-1) and
``num_new[b]`` new tokens whose rows were written at positions ctx .. ctx+n-1 before attention; its
queries are rows ``q_start[b] .. q_start[b]+n-1`` of ``q [T, H, 576]`` (requests back to back).
Token i sees every committed row, and new row j when ``tree_mask[q_start+i]`` has bit j set (tree
verify; word j // 64, bit j % 64) or, without a mask, when j <= i (causal: prefill, decode with n=1).

Per (token, head): ``s_j = scale * q·row_j``, ``o_lat = softmax(s) @ c`` (c = row[:512]) rounded to
bf16, ``lse = ln Σ_j exp(s_j)`` in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from ml_dtypes import bfloat16

ROW = 576  # cache / query row: [c (512) | k_pe (64)]
DV = 512  # latent value width
MAX_TREE_NODES = 256
MAX_MASK_WORDS = MAX_TREE_NODES // 64


@dataclass(frozen=True)
class MLABatch:
    """A validated batch description (host arrays). ``tree_mask`` is None for causal batches, and
    also when the CUDA plan was given an unchecked device mask (then ``mask_words`` > 0)."""

    ctx_lens: np.ndarray  # int64 [B]
    num_new: np.ndarray  # int64 [B]
    q_start: np.ndarray  # int64 [B]
    page_table: np.ndarray  # int32 [B, max_pages]
    num_heads: int
    page_size: int
    num_pages: int
    tree_mask: np.ndarray | None  # uint64 [T, mask_words]
    mask_words: int  # 0: causal

    @property
    def batch(self) -> int:
        return len(self.ctx_lens)

    @property
    def total_tokens(self) -> int:
        return int(self.num_new.sum())

    @property
    def kv_lens(self) -> np.ndarray:
        return self.ctx_lens + self.num_new


def _int_vector(name: str, a, batch: int | None = None) -> np.ndarray:
    a = np.asarray(a)
    if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{name}: expected a 1-D integer array, got shape {a.shape} dtype {a.dtype}")
    if batch is not None and len(a) != batch:
        raise ValueError(f"{name}: expected {batch} entries (one per request), got {len(a)}")
    return a.astype(np.int64)


def mask_bits(tree_mask: np.ndarray, n: int) -> np.ndarray:
    """uint64 mask rows [k, words] -> bool [k, n] (bit j of word j // 64)."""
    bits = np.unpackbits(np.ascontiguousarray(tree_mask).view(np.uint8), axis=1, bitorder="little")
    return bits[:, :n].astype(bool)


def pack_mask(visible: np.ndarray, words: int) -> np.ndarray:
    """bool [k, n] -> uint64 mask rows [k, words]."""
    k, n = visible.shape
    if n > 64 * words:
        raise ValueError(f"{n} nodes do not fit {words} mask words")
    padded = np.zeros((k, 64 * words), dtype=np.uint8)
    padded[:, :n] = visible
    return np.packbits(padded, axis=1, bitorder="little").view(np.uint64).reshape(k, words)


def tree_mask_from_parents(parents, words: int | None = None) -> np.ndarray:
    """Ancestor-only mask of one tree (docs/architecture.md §4): node i sees itself and its ancestors.
    ``parents[i] < i`` for i > 0 (parents precede children); ``parents[0]`` is ignored (the root)."""
    parents = np.asarray(parents)
    n = len(parents)
    vis = np.zeros((n, n), dtype=bool)
    for i in range(n):
        if i > 0:
            if not 0 <= parents[i] < i:
                raise ValueError(f"parents[{i}] = {parents[i]}: a parent must precede its child")
            vis[i] = vis[parents[i]]
        vis[i, i] = True
    return pack_mask(vis, words or max(1, -(-n // 64)))


def check_tree_mask(vis: np.ndarray, request: int) -> None:
    """``vis`` [n, n] bool of one request must be a forest's ancestor-only mask: node i sees itself,
    no later node, and exactly its parent's set plus itself (parent = its latest visible node)."""
    n = len(vis)
    idx = np.arange(n)
    if not vis[idx, idx].all():
        i = int(np.flatnonzero(~vis[idx, idx])[0])
        raise ValueError(f"tree_mask: request {request}, node {i} does not see itself (diagonal bit unset)")
    later = np.triu(vis, 1)
    if later.any():
        i, j = (int(v) for v in np.argwhere(later)[0])
        raise ValueError(f"tree_mask: request {request}, node {i} sees later node {j} "
                         "(parents must precede children)")
    strict = np.tril(vis, -1)
    has_parent = strict.any(axis=1)
    parent = np.where(has_parent, n - 1 - np.argmax(strict[:, ::-1], axis=1), -1)
    expect = np.where(has_parent[:, None], vis[np.maximum(parent, 0)], False)
    expect[idx, idx] = True
    bad = np.flatnonzero((expect != vis).any(axis=1))
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"tree_mask: request {request}, node {i} is not ancestor-closed: it sees node "
                         f"{int(parent[i])} but not exactly that node's ancestors")


def check_mask_shape(shape, dtype, num_new: np.ndarray) -> int:
    """Shape/dtype checks of a tree mask; returns its word count."""
    total, n_max = int(num_new.sum()), int(num_new.max())
    if np.dtype(dtype) != np.uint64:
        raise TypeError(f"tree_mask: expected dtype uint64, got {np.dtype(dtype)}")
    if len(shape) != 2 or shape[0] != total:
        raise ValueError(f"tree_mask: expected shape ({total}, words) (one row per new token), got {tuple(shape)}")
    words = shape[1]
    if not 1 <= words <= MAX_MASK_WORDS:
        raise ValueError(f"tree_mask: {words} words per row; 1..{MAX_MASK_WORDS} supported")
    if n_max > MAX_TREE_NODES:
        raise ValueError(f"too many tree nodes: a request has {n_max}, at most {MAX_TREE_NODES} are supported")
    if n_max > 64 * words:
        raise ValueError(f"too many tree nodes for the mask: a request has {n_max} nodes, "
                         f"{words} words hold {64 * words}")
    return words


def validate_batch(ctx_lens, num_new, page_table, num_heads: int, page_size: int, num_pages: int,
                   tree_mask=None, check_mask: bool = True, mask_shape=None) -> MLABatch:
    """Every check of the plan, with errors that name the request. ``tree_mask`` is a host array or
    None; ``mask_shape`` = (shape, dtype) of a device mask whose contents are not checked."""
    ctx = _int_vector("ctx_lens", ctx_lens)
    b = len(ctx)
    if b == 0:
        raise ValueError("empty batch: ctx_lens has no entries")
    n = _int_vector("num_new", num_new, b)
    if (ctx < 0).any():
        raise ValueError(f"ctx_lens: request {int(np.argmax(ctx < 0))} has a negative length")
    if (n < 1).any():
        raise ValueError(f"num_new: request {int(np.argmax(n < 1))} has no new tokens (need >= 1)")
    if num_heads < 1 or page_size < 1 or num_pages < 1:
        raise ValueError(f"num_heads, page_size, num_pages must be >= 1, got {num_heads}, {page_size}, {num_pages}")
    if int(n.sum()) * num_heads >= 2**31 or int((ctx + n).max()) >= 2**31:
        raise ValueError("batch too large: query rows and positions must fit int32")
    pt = np.asarray(page_table)
    if pt.ndim != 2 or pt.shape[0] != b or not np.issubdtype(pt.dtype, np.integer):
        raise ValueError(f"page_table: expected an integer array of shape ({b}, max_pages), got "
                         f"{pt.shape} {pt.dtype}")
    need = -(-(ctx + n) // page_size)
    short = np.flatnonzero(need > pt.shape[1])
    if len(short):
        r = int(short[0])
        raise ValueError(f"cache too small: request {r} needs {int(ctx[r] + n[r])} rows = {int(need[r])} pages "
                         f"of {page_size}, its page table holds {pt.shape[1]}")
    used = np.arange(pt.shape[1])[None, :] < need[:, None]
    bad = used & ((pt < 0) | (pt >= num_pages))
    if bad.any():
        r, k = (int(v) for v in np.argwhere(bad)[0])
        raise ValueError(f"page_table: request {r}, entry {k} = {int(pt[r, k])} is out of range "
                         f"[0, {num_pages})")
    q_start = np.concatenate([[0], np.cumsum(n)[:-1]]).astype(np.int64)
    words = 0
    if tree_mask is not None:
        tree_mask = np.asarray(tree_mask)
        words = check_mask_shape(tree_mask.shape, tree_mask.dtype, n)
        if check_mask:
            for r in range(b):
                rows = tree_mask[q_start[r]:q_start[r] + n[r]]
                if n[r] < 64 * words:
                    beyond = np.unpackbits(rows.view(np.uint8), axis=1, bitorder="little")[:, n[r]:]
                    if beyond.any():
                        raise ValueError(f"tree_mask: request {r} has bits set beyond its {int(n[r])} nodes")
                check_tree_mask(mask_bits(rows, int(n[r])), r)
    elif mask_shape is not None:
        words = check_mask_shape(*mask_shape, n)
    return MLABatch(ctx, n, q_start, pt.astype(np.int32), int(num_heads), int(page_size), int(num_pages),
                    tree_mask, words)


def mla_attention_plan(ctx_lens, num_new, page_table, num_heads: int, page_size: int, num_pages: int,
                       tree_mask=None, check_mask: bool = True, num_sms: int | None = None, into=None,
                       replay: bool = False):
    """Validate the batch (see module doc); the numpy plan is the validated batch itself.
    ``num_sms``, ``into`` and ``replay`` only shape the CUDA work split."""
    return validate_batch(ctx_lens, num_new, page_table, num_heads, page_size, num_pages, tree_mask, check_mask)


def visibility(batch: MLABatch, r: int) -> np.ndarray:
    """bool [n, ctx + n]: which cache positions each new token of request r sees."""
    ctx, n = int(batch.ctx_lens[r]), int(batch.num_new[r])
    vis = np.ones((n, ctx + n), dtype=bool)
    if batch.tree_mask is not None:
        s = int(batch.q_start[r])
        vis[:, ctx:] = mask_bits(batch.tree_mask[s:s + n], n)
    else:
        vis[:, ctx:] = np.tril(np.ones((n, n), dtype=bool))
    return vis


def gather_rows(batch: MLABatch, cache: np.ndarray, r: int) -> np.ndarray:
    """The cache rows of request r's positions 0 .. ctx+n-1, in position order."""
    pos = np.arange(int(batch.kv_lens[r]))
    slots = batch.page_table[r, pos // batch.page_size].astype(np.int64) * batch.page_size + pos % batch.page_size
    return cache.reshape(-1, cache.shape[-1])[slots]


def attend_f32(plan: MLABatch, q, cache, softmax_scale: float) -> tuple[np.ndarray, np.ndarray]:
    """fp32 o_lat [T, H, 512] (not rounded) and lse [T, H]."""
    if plan.tree_mask is None and plan.mask_words:
        raise ValueError("this plan holds no host copy of its tree mask")
    h = plan.num_heads
    if q.shape != (plan.total_tokens, h, ROW):
        raise ValueError(f"q: expected shape ({plan.total_tokens}, {h}, {ROW}), got {q.shape}")
    if cache.shape != (plan.num_pages, plan.page_size, ROW):
        raise ValueError(f"cache: expected shape ({plan.num_pages}, {plan.page_size}, {ROW}), got {cache.shape}")
    out = np.empty((plan.total_tokens, h, DV), dtype=np.float32)
    lse = np.empty((plan.total_tokens, h), dtype=np.float32)
    for r in range(plan.batch):
        s, n = int(plan.q_start[r]), int(plan.num_new[r])
        # float64 throughout: the result of a row must not depend on how many rows (or masked
        # columns) share its call, so a tree node gets exactly its causal twin's output
        rows = gather_rows(plan, cache, r).astype(np.float64)
        qr = q[s:s + n].astype(np.float64)
        scores = np.einsum("thd,jd->thj", qr, rows) * np.float64(np.float32(softmax_scale))
        scores = np.where(visibility(plan, r)[:, None, :], scores, -np.inf)
        m = scores.max(axis=-1, keepdims=True)
        p = np.exp(scores - m)
        denom = p.sum(axis=-1, keepdims=True)
        out[s:s + n] = np.einsum("thj,jd->thd", p, rows[:, :DV]) / denom
        lse[s:s + n] = (m + np.log(denom))[..., 0]
    return out, lse


def mla_attention(plan: MLABatch, q, cache, softmax_scale: float, out=None, lse=None):
    """q [T, H, 576] bf16, cache [num_pages, page_size, 576] bf16 -> (o_lat [T, H, 512] bf16, lse [T, H] f32)."""
    o, l = attend_f32(plan, q, cache, softmax_scale)
    o = o.astype(bfloat16)
    if out is not None:
        out[...] = o
        o = out
    if lse is not None:
        lse[...] = l
        l = lse
    return o, l


def mla_head_gemm(x, w, trans_w: bool, out=None):
    """Per head h: ``out[:, h] = x[:, h] @ (w[h].T if trans_w else w[h])``, bf16 in/out, float64 math.
    x [T, H, K]; w [H, N, K] (trans_w) or [H, K, N]; out [T, H, N]. Used for the W_UK absorption
    (x = q_nope, w = W_UK [H, 128, 512]) and the W_UV expansion (x = o_lat, w = W_UV [H, 128, 512],
    trans_w=True). Strided views are fine (last dim contiguous)."""
    wf = w.astype(np.float64)
    y = np.einsum("thk,hnk->thn" if trans_w else "thk,hkn->thn", x.astype(np.float64), wf)
    y = y.astype(np.float32).astype(bfloat16)
    if out is not None:
        out[...] = y
        return out
    return y
