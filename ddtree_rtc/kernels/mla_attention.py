"""Absorbed MLA attention on the GPU (cuda_src/mla_attention.cu) and the per-head GEMMs around it.

``mla_attention_plan`` (host, once per batch shape) validates the batch, picks the tile variant,
splits the work so the GPU fills even at batch 1 (split-K over cache positions, merged afterwards)
and uploads the metadata. ``mla_attention`` (device only, no sync, no allocation when ``out``/``lse``
are given) launches the attention kernel and, when a split exists, the merge kernel; it can be
captured in a CUDA graph. A later plan written with ``into=`` reuses the same device buffers and
grid, so a captured graph replays it.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np

from ..reference.mla_attention import DV, ROW, MLABatch, validate_batch
from ..rtc.arch import WGMMA_ARCH, wgmma_build
from . import _cublas
from ._args import BF16, allow_dynamic_smem, check, out_array
from ._host_copy import copy_in
from ._launch import ctas_per_sm, launch, pdl_supported, sm_count
from .mla_small import mla_head_gemm_small
from .registry import module

MIN_SPLIT = 256  # fewest cache rows per CTA: below that the partial write and merge dominate


@dataclass(frozen=True)
class Variant:
    """A tile variant of cuda_src/mla_attention.cu (mirrors its Cfg<...> / SplitCfg<...>).
    ``split_k``: the warps split the 576 of Q·K^T and share P through registers (SplitCfg);
    otherwise they split the query rows and columns of S (Cfg)."""

    bm: int  # query rows per work item
    bn: int  # cache rows per pipeline stage
    warps: int
    om: int = 1  # O row groups (Cfg)
    stages: int = 2  # cp.async ring depth
    split_k: bool = False
    min_split: int = MIN_SPLIT  # fewest cache rows per CTA
    wgmma: bool = False  # sm_90a only (namespace w64 of the .cu): two warpgroups, operands via descriptors
    ctas_per_sm: int = 1  # resident CTAs per SM it is built for (its __launch_bounds__); the grid is
    # this many per SM where the driver's occupancy allows it (resident_ctas)


_VARIANTS = {
    "m64": Variant(64, 64, 8, om=2),
    "m16": Variant(16, 64, 8),
    "small": Variant(32, 16, 4),
    # decode: short stages, lookups one stage ahead, cheap enough to split finer; a 2-deep ring (98 KB)
    # so two CTAs share an SM, each one's item ramp and partial write overlapping the other's reads
    "d16": Variant(16, 32, 4, stages=2, split_k=True, min_split=64, ctas_per_sm=2),
    # sm_90a: m64's tiles on wgmma (S by m64n32k16 per warpgroup, O by m64n128k16), P through smem
    "w64": Variant(64, 64, 8, wgmma=True),
}
_WORK_INTS, _REQ_INTS, _MERGE_INTS = 8, 4, 4
MERGE_CTAS_PER_SM = 8  # the merge kernel's fixed grid: one wave of 128-thread CTAs


def _cdiv(a, b):
    return -(-a // b)


def _smem_bytes(variant: str) -> int:
    v = _VARIANTS[variant]
    if v.wgmma:  # 1024 alignment slack, Q + 2 stages of 9 swizzled 64 x 64 blocks, P, red [2][64]
        return 1024 + 3 * v.bm * ROW * 2 + v.bm * v.bn * 2 + 2 * v.bm * 4
    if v.split_k:
        return (v.bm * ROW + v.stages * v.bn * ROW) * 2 + v.warps * (v.bn // 8) * 32 * 16
    sn = v.warps // (v.bm // 16)
    return (v.bm * ROW + 2 * v.bn * ROW + v.bm * v.bn) * 2 + (sn * v.bm + 2 * v.bm) * 4


D16_MAX_TILES = 16  # decode with > 16 rows per request: d16 while batch x 16-row tiles <= this
W64_OVER_D16_CTX = 8192  # sm_90a, 64-head decode: w64 beats d16 from this context on


def _pick_variant(max_rows: int, decode: bool, smem_limit: int, batch: int = 1, wgmma: bool = False,
                  max_ctx: int = 0) -> str:
    # d16 (16-row tiles) while few tiles re-read the cache rows; m64 for wide decode batches (their
    # tiles would re-read the rows); w64 on sm_90a at long contexts (H200 timings: benchmarks/README.md).
    wide_d16 = batch * -(-max_rows // 16) <= D16_MAX_TILES and not (wgmma and max_ctx >= W64_OVER_D16_CTX)
    if decode and (max_rows <= 16 or wide_d16):
        prefer = ("d16", "m16", "small") if max_rows <= 16 else ("d16", "m64", "small")
    elif decode:
        prefer = ("m64", "small")
    else:
        prefer = ("m16", "m64", "small") if max_rows <= 16 else ("m64", "small")
    if wgmma:  # sm_90a: the wgmma tile wherever the mma.sync m64 tile would run
        prefer = tuple("w64" if v == "m64" else v for v in prefer)
    for v in prefer:
        if _smem_bytes(v) <= smem_limit:
            return v
    raise RuntimeError(f"MLA attention needs {_smem_bytes('small')} bytes of shared memory per block; "
                       f"this GPU allows {smem_limit}")


def split_work(batch: MLABatch, bm: int, bn: int, num_ctas: int, min_split: int = MIN_SPLIT):
    """The schedule. A query tile is BM consecutive query rows of one request; it needs the cache
    positions up to its last token, ``units`` = ceil(that / BN) tiles of BN rows. All tiles' units
    laid end to end are cut into ``num_ctas`` equal runs (at least ``min_split`` rows each); CTA c
    takes run c, as one work item per query tile the run touches. Returns
      work [k, 8] int32: req, m0, m_count, kv_begin, kv_end, partial (-1: final), its merge item
        (-1: final), 0 — by CTA;
      cta_work [num_ctas + 1] int32: CTA c runs items cta_work[c] .. cta_work[c+1]-1;
      merge [j, 4] int32: first partial, partials, first flattened query row, rows — per cut tile;
      the number of partials."""
    h = batch.num_heads
    rows = batch.num_new * h
    per_req = _cdiv(rows, bm)
    req = np.repeat(np.arange(batch.batch), per_req)
    first = np.cumsum(per_req) - per_req
    m0 = (np.arange(len(req)) - first[req]) * bm
    m_count = np.minimum(bm, rows[req] - m0)
    kv_len = batch.ctx_lens[req] + (m0 + m_count - 1) // h + 1
    units = _cdiv(kv_len, bn)
    u0 = np.cumsum(units) - units
    per_cta = max(_cdiv(int(units.sum()), num_ctas), _cdiv(min_split, bn))
    c_first = u0 // per_cta
    pieces = (u0 + units - 1) // per_cta - c_first + 1
    tile = np.repeat(np.arange(len(req)), pieces)
    k = np.arange(len(tile)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    cta = c_first[tile] + k
    kv_begin = (np.maximum(cta * per_cta, u0[tile]) - u0[tile]) * bn
    kv_end = np.minimum((np.minimum((cta + 1) * per_cta, u0[tile] + units[tile]) - u0[tile]) * bn, kv_len[tile])
    cut = pieces > 1
    p_first = np.cumsum(np.where(cut, pieces, 0)) - np.where(cut, pieces, 0)
    work = np.zeros((len(tile), _WORK_INTS), dtype=np.int32)
    work[:, 0], work[:, 1], work[:, 2] = req[tile], m0[tile], m_count[tile]
    work[:, 3], work[:, 4], work[:, 5] = kv_begin, kv_end, np.where(cut[tile], p_first[tile] + k, -1)
    work[:, 6] = np.where(cut[tile], (np.cumsum(cut) - 1)[tile], -1)
    cta_work = np.searchsorted(cta, np.arange(num_ctas + 1)).astype(np.int32)  # cta is non-decreasing
    t = np.flatnonzero(cut)
    merge = np.stack([p_first[t], pieces[t], batch.q_start[req[t]] * h + m0[t], m_count[t]], axis=1)
    return work, cta_work, merge.astype(np.int32).reshape(-1, _MERGE_INTS), int(pieces[cut].sum())


# split="shape" (the small-M path's row-invariant schedule): a token's context is cut into about this
# many pieces over all its head tiles together, the piece size set by that token's own context
SHAPE_SPLIT_PIECES = 32
SPLITS = ("ctas", "shape")


def shape_split_variant(smem_limit: int) -> str:
    """The one tile variant of split="shape" on this GPU (never chosen by the batch): d16 (98 KB: it
    fits sm_120's 99 KB too), or where its shared memory does not fit, small."""
    for v in ("d16", "small"):
        if _smem_bytes(v) <= smem_limit:
            return v
    raise RuntimeError(f"MLA attention needs {_smem_bytes('small')} bytes of shared memory per block; "
                       f"this GPU allows {smem_limit}")


def shape_pieces(num_heads: int, bm: int) -> int:
    """The most pieces one tile's positions are cut into under split="shape"."""
    return max(1, SHAPE_SPLIT_PIECES // _cdiv(num_heads, bm))


def shape_piece_rows(kv_len, bn: int, per_min: int, pieces_max: int):
    """split="shape"'s piece size in rows for keys of length ``kv_len`` (array): a multiple of BN, at
    least ``per_min`` BN-units, at most ``pieces_max`` pieces (mirrored by path_item in
    cuda_src/include/mla_split.cuh)."""
    units = _cdiv(kv_len, bn)
    return np.maximum(per_min, _cdiv(units, pieces_max)) * bn


def path_code(bn: int, per_min: int, pieces_max: int, prow=0):
    """Work word 7 of a tree row under split="shape" (path_item in cuda_src/include/mla_split.cuh):
    the kernel reads the row's keys along its tree path and cuts them with these constants; ``prow``:
    the first row of the item's partial slot it writes (its token's rows in a shared tile's merge),
    an int (-> an int) or an integer array (-> an int64 array, one word per item)."""
    rows = np.asarray(prow, dtype=np.int64)
    if not (0 < bn < 256 and 0 < per_min < 256 and 0 < pieces_max < 256) or (
            rows.size and not (0 <= rows.min() and rows.max() < 64)):
        raise ValueError(f"path_code: BN {bn}, per_min {per_min}, pieces {pieces_max} must each be in 1..255, "
                         f"partial row {prow} in 0..63")
    code = 1 | bn << 1 | per_min << 9 | pieces_max << 17 | rows << 25
    return int(code) if code.ndim == 0 else code


def partial_row(item) -> int:
    """The first row of its partial slot that work item ``item`` writes (path_item's it.prow)."""
    code = int(item[7])
    return (code >> 25) & 0x3F if code else 0


def split_work_by_shape(batch: MLABatch, bm: int, bn: int, num_ctas: int, min_split: int = MIN_SPLIT):
    """The row-invariant schedule, in split_work's format. A query tile holds one token's heads (up
    to BM of them); its positions [0, ctx + j + 1) are cut into pieces of a size fixed by that length
    alone (a multiple of BN, at least ``min_split`` rows, at most ``shape_pieces`` pieces), and the
    pieces are dealt to the CTAs in order (evenly, the remainder to the first CTAs). So every row is
    computed from the same pieces in the same order, merged the same way, whatever the batch around
    it and whatever the grid.

    A tree verify (``batch.mask_words`` > 0) reads each row along its tree path instead (work word 7,
    ``path_code``; path_item in cuda_src/include/mla_split.cuh): token j at depth d reduces the keys
    of its autoregressive twin, [0, ctx) then its ancestors by depth then itself, ctx + d + 1 of them,
    cut as that length is. The depth is known only on the device (the mask need not visit the host),
    so word 3 is the piece index and the tile gets the most pieces any depth 0..j needs (its extra
    pieces come out empty: weight 0 in the merge); the kernel sets each piece's range.

    Where a tile has room for several tokens' heads (BM // heads >= 2: d16 at 8 heads), the tokens
    of a tree are grouped that many at a time (``_tree_groups``): a group whose every possible length
    ctx + d + 1 (d <= its last token's index) has one piece size ``per`` reads each whole piece below
    ctx, [k per, (k+1) per) for k < ctx // per, ONCE for all its tokens (an ordinary item: those keys
    and that cut are every member's and every member's twin's), then each token's remaining pieces
    along its path; one merge per group, piece order as each twin's."""
    h = batch.num_heads
    tpt = _cdiv(h, bm)
    tokens = batch.total_tokens
    tok_req = np.repeat(np.arange(batch.batch), batch.num_new)
    tok_idx = np.arange(tokens) - np.repeat(batch.q_start, batch.num_new)
    req, j, i = np.repeat(tok_req, tpt), np.repeat(tok_idx, tpt), np.arange(tokens * tpt) % tpt
    m0 = j * h + i * bm
    m_count = np.minimum(bm, h - i * bm)
    per_min, pieces_max = _cdiv(min_split, bn), shape_pieces(h, bm)
    tree = batch.mask_words > 0
    if tree:  # the most pieces over the depths 0..j the row may have: a running maximum per request
        d = np.arange(int(batch.num_new.max()))
        lens = batch.ctx_lens[:, None] + d[None, :] + 1
        most = np.maximum.accumulate(_cdiv(lens, shape_piece_rows(lens, bn, per_min, pieces_max)), axis=1)
        pieces = np.repeat(most[tok_req, tok_idx], tpt)
    else:
        kv_len = batch.ctx_lens[req] + j + 1
        per = shape_piece_rows(kv_len, bn, per_min, pieces_max)
        pieces = _cdiv(kv_len, per)
    # Merge units (a tile, or a tree group sharing pieces), `pieces` partials each; items: unit `tile`,
    # partial `k` of it, rows it_m0 .. + it_mc, words 3, 4, 7.
    tile = np.repeat(np.arange(len(req)), pieces)
    k = np.arange(len(tile)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    it_m0, it_mc = m0[tile], m_count[tile]
    w7 = np.zeros(len(tile), np.int64)
    if tree:
        kv_b, kv_e = k, np.zeros_like(k)
        w7[:] = path_code(bn, per_min, pieces_max)
        if tpt == 1 and bm // h >= 2 and len(req):
            req, m0, m_count, pieces, tile, k, it_m0, it_mc, kv_b, kv_e, w7 = _tree_groups(
                batch, bm // h, bn, per_min, pieces_max, req, j, m0, pieces)
    else:
        kv_b = k * per[tile]
        kv_e = np.minimum((k + 1) * per[tile], kv_len[tile])
    cut = pieces > 1
    cut_pieces = np.where(cut, pieces, 0)
    p_first = np.cumsum(cut_pieces) - cut_pieces
    item_cut = cut[tile]
    work = np.empty((len(tile), _WORK_INTS), dtype=np.int32)
    work[:, 0], work[:, 1], work[:, 2] = req[tile], it_m0, it_mc
    work[:, 3], work[:, 4], work[:, 5] = kv_b, kv_e, np.where(item_cut, p_first[tile] + k, -1)
    work[:, 6] = np.where(item_cut, (np.cumsum(cut) - 1)[tile], -1)
    work[:, 7] = w7
    # an even deal, the remainder to the first CTAs: with fewer items than CTAs they run on CTAs
    # 0, 1, ..., one per SM, not beside each other in the SMs' second slots (resident_ctas > 1);
    # CTA c starts at c * each + min(c, extra)
    each, extra = divmod(len(tile), num_ctas)
    c = np.arange(num_ctas + 1)
    cta_work = (c * each + np.minimum(c, extra)).astype(np.int32)
    t = np.flatnonzero(cut)
    merge = np.empty((len(t), _MERGE_INTS), np.int32)
    merge[:, 0], merge[:, 1] = p_first[t], pieces[t]
    merge[:, 2], merge[:, 3] = batch.q_start[req[t]] * h + m0[t], m_count[t]
    return work, cta_work, merge, int(pieces[cut].sum())


def _tree_groups(batch: MLABatch, g: int, bn: int, per_min: int, pieces_max: int, req, j, m0, pieces):
    """split_work_by_shape's tree tiles (one token's h <= BM / g heads each: req, j, m0, pieces)
    regrouped: tokens g at a time (j // g) of a request share the pieces that lie wholly below ctx
    where every length ctx + d + 1 a member may have (d <= the group's last j) has the same piece
    size ``per`` and ctx >= per; the others stay one tile each. Returns the units (req, m0, rows,
    partials) and their items (unit, partial, m0, rows, words 3, 4, 7): a group's shared pieces
    first (rows of all members, keys [k per, (k+1) per), word 7 = 0), then per member its path
    pieces S + e (word 3; its rows written at row t * h of the group's partial slots: path_code's
    prow)."""
    h = batch.num_heads
    ctx = batch.ctx_lens[req]
    j0 = j // g * g
    last = np.minimum(j0 + g, batch.num_new[req]) - 1
    per = shape_piece_rows(ctx + 1, bn, per_min, pieces_max)
    share = (per == shape_piece_rows(ctx + last + 1, bn, per_min, pieces_max)) & (ctx >= per)
    lead = ~share | (j == j0)  # one unit per group that shares, one per token otherwise
    u_req, u_m0, u_per, u_ctx = req[lead], m0[lead], per[lead], ctx[lead]
    members = np.where(share, last - j0 + 1, 1)[lead]
    shared = np.where(share[lead], u_ctx // u_per, 0)
    extra = np.where(share[lead], _cdiv(u_ctx + last[lead] + 1, u_per) - shared, pieces[lead])
    counts = shared + members * extra
    unit = np.repeat(np.arange(len(u_req)), counts)
    r = np.arange(len(unit)) - np.repeat(np.cumsum(counts) - counts, counts)
    sh = r < shared[unit]
    t, e = np.divmod(np.where(sh, 0, r - shared[unit]), extra[unit])
    k = np.where(sh, r, shared[unit] + e)
    it_m0 = u_m0[unit] + t * h
    it_mc = np.where(sh, members[unit] * h, h)
    kv_b = np.where(sh, r * u_per[unit], k)
    kv_e = np.where(sh, (r + 1) * u_per[unit], 0)
    w7 = np.where(sh, 0, path_code(bn, per_min, pieces_max, t * h))
    return (u_req, u_m0, members * h, shared + extra, unit, k, it_m0, it_mc, kv_b, kv_e, w7)


def item_keys(batch: MLABatch, item) -> tuple[int, int, np.ndarray]:
    """What the kernel makes of work item ``item`` (a row of the plan's work): its key range
    [kv_begin, kv_end) and the cache positions of those keys, in order. Host mirror of load_item /
    path_item / key_position (cuda_src/include/mla_split.cuh); a tree row needs the host mask."""
    req, m0, kb, ke, code = int(item[0]), int(item[1]), int(item[3]), int(item[4]), int(item[7])
    ctx = int(batch.ctx_lens[req])
    if not code:
        return kb, ke, np.arange(kb, ke)
    if batch.tree_mask is None:
        raise ValueError("item_keys: a tree-path item needs the batch's host tree_mask")
    bn, per_min, pieces_max = (code >> 1) & 0xFF, (code >> 9) & 0xFF, (code >> 17) & 0xFF
    row = batch.q_start[req] + m0 // batch.num_heads
    nodes = np.flatnonzero(np.unpackbits(batch.tree_mask[row:row + 1].view(np.uint8), bitorder="little"))
    length = ctx + len(nodes)  # ctx + depth + 1: the row's own node is its last visible one
    per = int(shape_piece_rows(np.int64(length), bn, per_min, pieces_max))
    begin, end = min(kb * per, length), min((kb + 1) * per, length)
    return begin, end, np.concatenate([np.arange(0, ctx), ctx + nodes])[begin:end]


@dataclass
class MLAPlan:
    batch: MLABatch
    variant: str
    bm: int
    threads: int
    smem: int
    grid: int  # CTAs of the attention kernel (resident_ctas per SM)
    merge_grid: int  # CTAs of the merge kernel; 0: the plan cuts no tile, no merge launch
    num_work: int
    num_merge: int
    work: object  # cupy int32 [capacity, 8]
    cta_work: object  # cupy int32 [grid + 1]
    merge: object  # cupy int32 [grid, 4] (a plan cuts fewer than `grid` tiles)
    merge_count: object  # cupy int32 [1]
    req_info: object  # cupy int32 [B, 4]: ctx, n, q_start, 0
    page_table: object  # cupy int32 [B, max_pages]
    mask: object  # cupy uint64 [T, words] or None (causal)
    owns_mask: bool  # False: the caller's device array, used in place
    o_part: object  # cupy f32 [2 * grid, BM, 512] (cut tiles have fewer than 2 * grid pieces)
    lse_part: object  # cupy f32 [2 * grid, BM]
    split: str = "ctas"  # "shape": split_work_by_shape (row-invariant), else split_work


def _host(name, a, dtype):
    import cupy

    if isinstance(a, cupy.ndarray):
        return a.get()
    a = np.asarray(a)
    if not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name}: expected integers, got {a.dtype}")
    return a.astype(dtype)


def _device_props() -> tuple[int, int, bool]:
    """SM count, opt-in shared memory per block, whether the kernels are built for sm_90a (wgmma).
    Looked up once per device (and arch override): every plan, and every graph re-plan, asks."""
    import cupy

    from ..rtc.arch import ARCH_ENV

    return _props_of(cupy.cuda.Device().id, os.environ.get(ARCH_ENV))


@functools.cache
def _props_of(device_id: int, arch_override: str | None) -> tuple[int, int, bool]:
    import cupy

    smem = cupy.cuda.Device(device_id).attributes["MaxSharedMemoryPerBlockOptin"]
    return sm_count(device_id), smem, wgmma_build(arch_override)


def resident_ctas(variant: str) -> int:
    """CTAs of ``variant`` that one SM of this GPU holds at once, up to its Variant.ctas_per_sm (the
    driver's occupancy: registers, shared memory and its per-CTA reserve); the grid is this many per
    SM. Needs the kernel's dynamic shared-memory limit raised (build_plan does)."""
    import cupy

    from ..rtc.arch import ARCH_ENV

    return _resident_of(cupy.cuda.Device().id, os.environ.get(ARCH_ENV), variant)


@functools.cache
def _resident_of(device_id: int, arch_override: str | None, variant: str) -> int:
    v = _VARIANTS[variant]
    if v.ctas_per_sm == 1:
        return 1
    fit = ctas_per_sm(module("mla_attention").fn(_kernel_name(variant)), 32 * v.warps, _smem_bytes(variant))
    return max(1, min(v.ctas_per_sm, fit))


def mla_attention_plan(ctx_lens, num_new, page_table, num_heads: int, page_size: int, num_pages: int,
                       tree_mask=None, check_mask: bool = True, num_sms: int | None = None, into=None,
                       replay: bool = False, split: str | None = None):
    """Validate the batch and lay out the work (see the module doc of ddtree_rtc.reference.mla_attention).
    ``page_table``, ``ctx_lens``, ``num_new``: host or device integer arrays (copied). ``tree_mask``:
    None (causal), a host uint64 array (checked, copied) or a device one (used in place; its contents
    are checked only with ``check_mask``, which costs a device->host copy). ``num_sms``: how many
    SMs to aim the split-K at (default: the GPU's SM count; the grid is that times resident_ctas).
    ``into``: an earlier plan whose device buffers, grid and tile variant are reused (for CUDA-graph
    replay). ``replay``: this plan is a template that later plans are written ``into`` (it always
    launches the merge kernel, which reads how many tiles were cut from device memory). ``split``:
    "ctas" (default: the positions of all tiles spread evenly over the CTAs) or "shape"
    (split_work_by_shape: each row's pieces fixed by its own context, so its bits do not depend on
    the batch, nor on the grid)."""
    import cupy

    dev_mask = tree_mask if isinstance(tree_mask, cupy.ndarray) else None
    host_mask = None
    if dev_mask is not None:
        check("tree_mask", dev_mask, np.uint64, ndim=2)
        if check_mask:
            host_mask = dev_mask.get()
    elif tree_mask is not None:
        host_mask = np.ascontiguousarray(tree_mask)
    batch = validate_batch(_host("ctx_lens", ctx_lens, np.int64), _host("num_new", num_new, np.int64),
                           _host("page_table", page_table, np.int32), num_heads, page_size, num_pages,
                           host_mask, check_mask,
                           mask_shape=None if dev_mask is None else (dev_mask.shape, dev_mask.dtype))
    return build_plan(batch, dev_mask, num_sms=num_sms, into=into, replay=replay, split=split)


def build_plan(batch: MLABatch, dev_mask=None, num_sms: int | None = None, variant: str | None = None,
               into: MLAPlan | None = None, replay: bool = False, split: str | None = None) -> MLAPlan:
    """Lay out a validated batch. ``dev_mask``: the caller's device mask, used in place (otherwise
    ``batch.tree_mask`` is uploaded). ``variant``: force a tile variant (every variant computes the
    same result; the default picks the fastest that fits the GPU). Split tiles are merged by a
    second launch (variants tried and dropped: benchmarks/README.md, mla_attention)."""
    import cupy

    split = _split_mode(split, into)
    sms, smem_limit, wgmma = _device_props()
    if into is not None:
        variant = into.variant
    elif variant is None and split == "shape":
        variant = shape_split_variant(smem_limit)
    elif variant is None:
        variant = _pick_variant(int(batch.num_new.max()) * batch.num_heads, bool((batch.num_new == 1).all()),
                                smem_limit, batch.batch, wgmma, int(batch.ctx_lens.max()))
    if variant not in _VARIANTS:
        raise ValueError(f"unknown MLA attention tile variant {variant!r}; there are {sorted(_VARIANTS)}")
    if _VARIANTS[variant].wgmma and not wgmma:
        raise RuntimeError(f"tile variant {variant} needs {WGMMA_ARCH} (wgmma); the kernels are built for another arch")
    if _smem_bytes(variant) > smem_limit:
        raise RuntimeError(f"tile variant {variant} needs {_smem_bytes(variant)} bytes of shared memory; "
                           f"this GPU allows {smem_limit}")
    v = _VARIANTS[variant]
    if split == "shape" and batch.mask_words and v.wgmma:
        raise ValueError(f"tile variant {variant} does not read tree rows along their paths (split='shape' with a "
                         "tree mask): use d16 or small")
    bm, bn, nw = v.bm, v.bn, v.warps
    allow_dynamic_smem(module("mla_attention").fn(_kernel_name(variant)), _smem_bytes(variant))
    sm_n = num_sms or sms
    grid = into.grid if into is not None else resident_ctas(variant) * sm_n
    if split == "shape":
        work, cta_work, merge, partials = split_work_by_shape(batch, bm, bn, grid, v.min_split)
        tiles = batch.total_tokens * _cdiv(batch.num_heads, bm)
        merge_cap, part_cap = tiles, tiles * shape_pieces(batch.num_heads, bm)
    else:
        work, cta_work, merge, partials = split_work(batch, bm, bn, grid, v.min_split)
        merge_cap, part_cap = grid, 2 * grid
    req_info = np.zeros((batch.batch, _REQ_INTS), dtype=np.int32)
    req_info[:, 0], req_info[:, 1], req_info[:, 2] = batch.ctx_lens, batch.num_new, batch.q_start
    if into is not None:
        merge_cap = into.merge.shape[0]
        if partials > into.o_part.shape[0] or len(merge) > merge_cap:
            raise ValueError(f"plan does not fit into the given plan: {partials} partials / {len(merge)} cut tiles > "
                             f"its {into.o_part.shape[0]} / {merge_cap}")
    merges = np.zeros((merge_cap, _MERGE_INTS), np.int32)
    merges[:len(merge)] = merge
    host_mask = batch.tree_mask
    if into is not None:
        return _write_into(into, batch, work, cta_work, merges, len(merge), req_info, host_mask, dev_mask)
    owns_mask = dev_mask is None and host_mask is not None
    if owns_mask:
        dev_mask = cupy.asarray(host_mask)
    # Room for any plan of this batch shape: one item per query tile plus one per CTA boundary that
    # cuts a tile (a shorter context can cut more tiles than this plan does); split="shape": at most
    # shape_pieces items per tile. A replay template holds any spread of its query tokens over its
    # requests (a packed tree verify): at most one partial tile per request more than the whole.
    q_tiles = (_cdiv(batch.total_tokens * batch.num_heads, bm) + batch.batch if replay
               else int(_cdiv(batch.num_new * batch.num_heads, bm).sum()))
    capacity = part_cap if split == "shape" else q_tiles + grid
    work_buf = np.zeros((capacity, _WORK_INTS), np.int32)
    work_buf[:len(work)] = work
    return MLAPlan(
        batch=batch, variant=variant, bm=bm, threads=32 * nw, smem=_smem_bytes(variant), grid=grid,
        merge_grid=MERGE_CTAS_PER_SM * sm_n if (len(merge) or replay) else 0, num_work=len(work),
        num_merge=len(merge), work=cupy.asarray(work_buf), cta_work=cupy.asarray(cta_work), merge=cupy.asarray(merges),
        merge_count=cupy.asarray(np.array([len(merge)], np.int32)), req_info=cupy.asarray(req_info),
        page_table=cupy.asarray(batch.page_table), mask=dev_mask, owns_mask=owns_mask,
        o_part=cupy.empty((part_cap, bm, DV), dtype=cupy.float32),
        lse_part=cupy.empty((part_cap, bm), dtype=cupy.float32), split=split)


def _split_mode(split: str | None, into: MLAPlan | None) -> str:
    """The plan's schedule: ``split`` (default "ctas"), or with ``into`` that plan's."""
    if split is not None and split not in SPLITS:
        raise ValueError(f"split={split!r}: expected one of {SPLITS} (or None)")
    if into is not None:
        if split is not None and split != into.split:
            raise ValueError(f"split={split!r} differs from the plan given as into= (split={into.split!r})")
        return into.split
    return split or "ctas"


def _kernel_name(variant: str) -> str:
    return f"mla_attention_{variant}_kernel"


def _write_into(old: MLAPlan, batch, work, cta_work, merges, num_merge, req_info, host_mask, dev_mask):
    """Write a new plan into ``old``'s buffers: the kernel arguments stay the same, so a graph
    captured with ``old`` replays the new plan."""

    def need(ok: bool, what: str):
        if not ok:
            raise ValueError(f"plan does not fit into the given plan: {what}")

    ob = old.batch
    need(batch.num_heads == ob.num_heads and batch.page_size == ob.page_size and batch.num_pages == ob.num_pages,
         "num_heads / page_size / num_pages differ")
    need(batch.page_table.shape == ob.page_table.shape, f"page table shape {batch.page_table.shape} != "
         f"{ob.page_table.shape}")
    need(batch.total_tokens == ob.total_tokens, f"{batch.total_tokens} query tokens != {ob.total_tokens}")
    need(batch.mask_words == ob.mask_words, "causal vs tree mask, or mask words, differ")
    need(len(work) <= old.work.shape[0], f"{len(work)} work items > capacity {old.work.shape[0]}")
    need(num_merge == 0 or old.merge_grid > 0,
         "it cuts tiles (split-K) but the given plan launches no merge")
    if dev_mask is not None:
        need(dev_mask.data.ptr == old.mask.data.ptr and dev_mask.shape == old.mask.shape,
             "a device tree_mask must be the same array as before")
    elif host_mask is not None:
        need(old.owns_mask and host_mask.shape == old.mask.shape,
             "a host tree_mask needs a plan that was given a host mask of the same shape")
        copy_in(old.mask, host_mask)
    # from page-locked staging: the host does not wait for the kernels queued before the copies
    w = np.zeros(old.work.shape, np.int32)
    w[:len(work)] = work
    copy_in(old.work, w)
    copy_in(old.cta_work, cta_work)
    copy_in(old.merge, merges)
    copy_in(old.merge_count, np.array([num_merge], np.int32))
    copy_in(old.req_info, req_info)
    copy_in(old.page_table, batch.page_table)
    return MLAPlan(**{**old.__dict__, "batch": batch, "num_work": len(work), "num_merge": num_merge})


def mla_attention(plan: MLAPlan, q, cache, softmax_scale: float, out=None, lse=None):
    """q [T, H, 576] bf16; cache [num_pages, page_size, 576] bf16 (one layer) ->
    (o_lat [T, H, 512] bf16, lse [T, H] f32, natural log)."""
    import cupy

    b = plan.batch
    t, h = b.total_tokens, b.num_heads
    check("q", q, BF16, shape=(t, h, ROW))
    check("cache", cache, BF16, shape=(b.num_pages, b.page_size, ROW))
    out = out_array("out", out, (t, h, DV), BF16)
    lse = out_array("lse", lse, (t, h), cupy.float32)
    mod = module("mla_attention")
    fn = mod.fn(_kernel_name(plan.variant))  # its shared-memory limit was raised by the plan
    mask = plan.mask if plan.mask is not None else np.uint64(0)
    args = (q, cache, plan.page_table, np.int32(plan.page_table.shape[1]), np.int32(b.page_size), np.int32(h),
            plan.work, plan.cta_work, plan.req_info, mask, np.int32(b.mask_words), out, lse, plan.o_part,
            plan.lse_part, np.float32(softmax_scale * np.log2(np.e)))
    # under PDL where the GPU has it: both kernels wait before they read (cuda_src/mla_attention.cu)
    pdl = pdl_supported()
    launch(fn, (plan.grid,), (plan.threads,), args, shared_mem=plan.smem, pdl=pdl)
    if plan.merge_grid:
        launch(mod.fn("mla_attention_merge_kernel"), (plan.merge_grid,), (DV // 4,),
               (plan.merge, plan.merge_count, plan.o_part, plan.lse_part, np.int32(plan.bm), out, lse), pdl=pdl)
    return out, lse


def _strides_elems(name: str, a) -> tuple[int, ...]:
    if any(s % a.itemsize for s in a.strides):
        raise ValueError(f"{name}: strides {a.strides} are not whole elements")
    st = tuple(s // a.itemsize for s in a.strides)
    if st[-1] != 1 and a.shape[-1] > 1:
        raise ValueError(f"{name}: the last dim must be contiguous (strides {a.strides})")
    if any(s < 0 for s in st):
        raise ValueError(f"{name}: negative strides {a.strides}")
    return st


def mla_head_gemm(x, w, trans_w: bool, out=None, impl: str = "auto"):
    """Per head h: ``out[:, h] = x[:, h] @ (w[h].T if trans_w else w[h])`` through one strided-batched
    cuBLAS GEMM (bf16 in/out, fp32 accumulate), or with ``impl="invariant"`` (T <= 64, the small-M
    path) the row-invariant kernel of kernels/mla_small.py. x [T, H, K]; w [H, N, K] (trans_w) or [H, K, N];
    out [T, H, N]. Any of them may be a view with a contiguous last dim (e.g. q[:, :, :128],
    kv_b.reshape(H, 256, 512)[:, :128], q_att[:, :, :512])."""
    import cupy

    check("x", x, BF16, ndim=3, contiguous=False)
    check("w", w, BF16, ndim=3, contiguous=False)
    t, h, k = x.shape
    if w.shape[0] != h:
        raise ValueError(f"w: expected {h} heads (x has {h}), got shape {tuple(w.shape)}")
    n = w.shape[1] if trans_w else w.shape[2]
    if (w.shape[2] if trans_w else w.shape[1]) != k:
        raise ValueError(f"w: shape {tuple(w.shape)} does not match K = {k} of x (trans_w={trans_w})")
    if out is None:
        out = cupy.empty((t, h, n), dtype=cupy.uint16)
    check("out", out, BF16, shape=(t, h, n), contiguous=False)
    if t == 0 or h == 0 or n == 0:
        return out
    if impl not in ("auto", "invariant"):
        raise ValueError(f"impl={impl!r}: expected 'auto' or 'invariant'")
    if impl == "invariant":
        return mla_head_gemm_small(x, w, trans_w, out)
    xs, ws, ys = _strides_elems("x", x), _strides_elems("w", w), _strides_elems("out", out)
    if not ((ys[1] >= n and ys[0] >= h * ys[1]) or (ys[0] >= n and ys[1] >= t * ys[0])):
        raise ValueError(f"out: strides {out.strides} make heads or tokens overlap")
    w_rows, w_cols = w.shape[1], w.shape[2]
    if t > 1 and xs[0] < k:
        raise ValueError(f"x: token stride {xs[0]} < K = {k}")
    if w_rows > 1 and ws[1] < w_cols:
        raise ValueError(f"w: row stride {ws[1]} < row length {w_cols}")
    if k == 0:
        out.fill(0)
        return out
    # Column-major view: out_h^T [N x T] = op(A) [N x K] . x_h^T [K x T]; w_h row-major [N, K] is
    # col-major [K x N] (op T); w_h row-major [K, N] is col-major [N x K] (op N).
    ldx, ldw, ldy = max(xs[0], k), max(ws[1], w_cols), max(ys[0], n)  # max(): unused when that dim is 1
    alpha, beta = np.array(1.0, np.float32), np.array(0.0, np.float32)
    _cublas.gemm_strided_batched_ex(
        _cublas.OP_T if trans_w else _cublas.OP_N, _cublas.OP_N, n, t, k,
        alpha.ctypes.data, w.data.ptr, _cublas.R_16BF, ldw, ws[0],
        x.data.ptr, _cublas.R_16BF, ldx, xs[1],
        beta.ctypes.data, out.data.ptr, _cublas.R_16BF, ldy, ys[1],
        h, _cublas.COMPUTE_32F, _cublas.GEMM_DEFAULT)
    return out
