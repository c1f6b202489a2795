"""Sampling and the drafter's top-k over a vocabulary split across ranks (docs/architecture.md,
"Parallelism"): each rank works on its own slice of the logits and only (value, id) pairs and
per-row scalars cross ranks, never the logits. The sampled tokens and the top-k ids are exactly one
rank's over the whole row; the top-k log-probs are too on the numpy backend (conditions below).

- ``sample_steps``: ddtree_rtc.reference.sampling.sample's rules, split. The Gumbel noise of token
  t is keyed by (row key, t) with t the global id, so each rank draws its slice's noise exactly as
  one rank would. Exchanged: per row the raw (max, id) and the max of z = l / T; with top_p < 1 the
  integer nucleus mass S and, to find the nucleus threshold key*, 8 rounds of 16 prefix masses (a
  radix search, 4 key bits per round; the masses are integers, so the sums are exact); then each
  rank's best (z + g, id) in the nucleus. The winner is the largest score, ties to the smaller id.
- ``topk_steps``: ddtree_rtc.reference.topk.topk_logprobs split. Each rank takes its slice's top-k
  with the public top-k op (``backend.topk_logprobs``, for the ids), sends the k (logit, id) pairs
  and its max, then its sum of exp(x - max) with the global max; the merge sorts the N k candidates
  (value descending, then id), and the per-rank sums are added in the order numpy's pairwise
  summation adds a whole row (it halves a part, rounded down to a multiple of 8, while the part is
  longer than 128). Where every shard boundary is one of those split points (power-of-two rank
  counts over K2.6's 163840 or the tiny preset's 1024 tokens) the lse, and so the log-probs, are
  one numpy rank's bit for bit; elsewhere, and against the CUDA top-k kernel (which sums in fp32),
  they agree to rounding.

Each is a generator: it yields the array this rank contributes to an all-gather and receives every
rank's ([world, ...]), so ``run`` drives it on a communicator and ``simulate`` drives N of them in
one process (the GPU tests, and the byte counts). Every branch depends only on gathered or replicated
values, so all ranks make the same calls.
"""

from __future__ import annotations

import math

import numpy as np

from ..reference.sampling import fixed_exp_neg, gumbel
from ..reference.topk import FLT_MAX

RADIX_BITS = 4  # key bits the nucleus search settles per exchange
_NAN_KEY = 0xFFFFFFFF
_PW_BLOCK = 128  # numpy's pairwise-summation block (PW_BLOCKSIZE)


def run(comm, steps):
    """Drive a step generator on ``comm``: each yielded [n, ...] array is all-gathered into [world, n, ...]."""
    try:
        part = next(steps)
        while True:
            got = comm.all_gather(part)
            part = steps.send(got.reshape((comm.world_size,) + tuple(part.shape)))
    except StopIteration as done:
        return done.value


def simulate(steps: list, xp=np):
    """Drive one step generator per rank in one process (rank order), gathering by stacking; returns
    their results and the bytes each rank handed to the gathers."""
    parts = [next(s) for s in steps]
    sent = 0
    results = [None] * len(steps)
    while True:
        sent += int(parts[0].nbytes)
        got = xp.stack(parts)
        nxt = []
        for r, s in enumerate(steps):
            try:
                nxt.append(s.send(got))
            except StopIteration as done:
                results[r] = done.value
        if len(nxt) == 0:
            return results, sent
        if len(nxt) != len(steps):
            raise RuntimeError("ranks of a simulated exchange took different numbers of steps")
        parts = nxt


def _fp32(xp, logits):
    """fp32 copy of bf16 (numpy bfloat16, or the CUDA backend's uint16 bits) or fp32 logits."""
    if logits.dtype == np.uint16:
        return (logits.astype(xp.uint32) << 16).view(xp.float32)
    return logits.astype(xp.float32)


def _local_argmax(xp, l):
    """(value, local id) of each row's largest non-NaN entry, the smallest id on ties; (-inf, -1)
    where a row has none (``argmax``'s rule)."""
    valid = ~xp.isnan(l)
    m = xp.where(valid, l, -xp.inf).max(axis=1)
    hit = valid & (l == m[:, None])
    idx = xp.where(hit.any(axis=1), hit.astype(xp.int8).argmax(axis=1), -1)
    return m.astype(xp.float32), idx


def _merge_pairs(xp, pairs):
    """[world, R, 2] (value, global id or -1) per rank -> int64 ids [R]: the largest value, the first
    rank on ties (its slice holds the smaller ids); where the best is -inf, the first rank with an id
    (-1 where none has one), as ``argmax`` over the whole row picks."""
    vals, ids = pairs[..., 0], pairs[..., 1]
    best = xp.argmax(vals, axis=0)
    first_valid = xp.argmax((ids >= 0).astype(xp.int8), axis=0)
    pick = xp.where(vals.max(axis=0) == -xp.inf, first_valid, best)
    return xp.take_along_axis(ids, pick[None], 0)[0].astype(xp.int64)


def sample_steps(xp, logits, offset: int, temperature, top_p, keys):
    """Generator: this rank's share of ``sample(full_logits, temperature, top_p, keys=keys)`` for its
    slice ``logits`` [B, Vs] (bf16 or fp32) of global ids offset .. offset + Vs - 1; returns int32 [B]
    (the same on every rank). temperature / top_p: host fp32 [B]; keys: uint64 [B] (xp)."""
    l = _fp32(xp, logits)
    rows, vs = l.shape
    if offset + vs >= 2**24:
        raise ValueError(f"vocabulary ids up to {offset + vs} do not fit the fp32 id of a (value, id) pair")
    temp = np.asarray(temperature, np.float32).reshape(rows)
    p = np.asarray(top_p, np.float32).reshape(rows)
    ids = xp.arange(vs, dtype=xp.int64) + offset
    raw_val, raw_idx = _local_argmax(xp, l)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        inv_t = xp.asarray(np.float32(1.0) / temp)
        z = l * inv_t[:, None]
    zmax = xp.where(xp.isnan(z), -xp.inf, z).max(axis=1).astype(xp.float32)
    got = yield xp.stack([raw_val, xp.where(raw_idx >= 0, raw_idx + offset, -1).astype(xp.float32), zmax], 1)
    result = _merge_pairs(xp, got[..., :2])
    m = got[..., 2].max(axis=0)  # the row's max of z, as one rank has it
    live_h = (temp > 0) & np.isfinite(_host(xp, m))
    if not live_h.any():
        return result.astype(xp.int32)
    live = xp.asarray(live_h)
    with np.errstate(invalid="ignore"):
        x = (m[:, None] - z).astype(xp.float32)
    in_nucleus = ~xp.isnan(z)
    filt_h = live_h & (p < 1)
    if filt_h.any():
        key = xp.where(xp.isnan(x), xp.uint32(_NAN_KEY), x.view(xp.uint32))
        mass = fixed_exp_neg(x).astype(xp.int64)  # <= 2^32 each: sums are exact in int64
        total = (yield mass.sum(axis=1)[:, None]).sum(axis=0)[:, 0]
        want = np.array([max(1, math.ceil(float(q) * float(s))) if f else 0
                         for q, s, f in zip(p, _host(xp, total), filt_h)], np.int64)
        want_d = xp.asarray(want)
        prefix = xp.zeros(rows, xp.uint32)
        digits = xp.arange(1 << RADIX_BITS, dtype=xp.uint32)
        for shift in range(32 - RADIX_BITS, -1, -RADIX_BITS):
            # the upper end of each of the 16 buckets below the settled prefix
            ends = prefix[:, None] | (digits[None] << xp.uint32(shift)) | xp.uint32((1 << shift) - 1)
            below = xp.stack([xp.where(key <= ends[:, d:d + 1], mass, 0).sum(axis=1)
                              for d in range(1 << RADIX_BITS)], 1)  # [B, 16] prefix masses
            cum = (yield below).sum(axis=0)
            digit = xp.argmax((cum >= want_d[:, None]).astype(xp.int8), axis=1).astype(xp.uint32)  # first to reach
            prefix = prefix | (digit << xp.uint32(shift))
        cut = xp.asarray(filt_h)[:, None] & (key > prefix[:, None])
        in_nucleus &= ~cut
    g = gumbel(keys[:, None], ids[None, :])
    score = xp.where(in_nucleus & live[:, None], z + g, -xp.inf).astype(xp.float32)
    best = xp.argmax(score, axis=1)
    val = xp.take_along_axis(score, best[:, None], 1)[:, 0]
    got = yield xp.stack([val, xp.where(val > -xp.inf, best + offset, -1).astype(xp.float32)], 1)
    return xp.where(live, _merge_pairs(xp, got), result).astype(xp.int32)


def _host(xp, a) -> np.ndarray:
    return a.get() if xp is not np else np.asarray(a)


def _sanitize(xp, logits):
    """reference.topk.sanitize_logits on xp: fp32, NaN / +inf -> -inf, -0.0 -> +0.0."""
    x = _fp32(xp, logits)
    return xp.where(x <= np.float32(FLT_MAX), x, -xp.inf).astype(xp.float32) + xp.float32(0.0)


def pairwise_combine(sums: list, bounds: list[int]) -> tuple:
    """Sum per-shard float64 sums (shard r covers [bounds[r], bounds[r+1])) the way numpy's pairwise
    summation adds the whole row: split at n/2 rounded down to a multiple of 8 while n > 128. Returns
    (total, exact): exact is False where a split falls inside a shard (the shards are then added in
    rank order)."""
    where = {(bounds[r], bounds[r + 1]): r for r in range(len(bounds) - 1)}

    def add(lo, hi):
        if (lo, hi) in where:
            return sums[where[(lo, hi)]]
        n = hi - lo
        if n <= _PW_BLOCK:
            return None
        n2 = n // 2
        n2 -= n2 % 8
        a, b = add(lo, lo + n2), add(lo + n2, hi)
        return None if a is None or b is None else a + b

    total = add(bounds[0], bounds[-1])
    if total is not None:
        return total, True
    acc = sums[0]
    for s in sums[1:]:
        acc = acc + s
    return acc, False


def topk_steps(backend, logits, offset: int, vocab: int, k: int):
    """Generator: this rank's share of ``topk_logprobs(full_logits, k)`` for its slice ``logits``
    [..., Vs] of global ids offset .. offset + Vs - 1 (``vocab`` in all, split evenly); returns
    (logq [..., k] fp32, ids [..., k] int32), the same on every rank."""
    xp = backend.xp
    lead, vs = tuple(logits.shape[:-1]), int(logits.shape[-1])
    if not 1 <= k <= vocab:
        raise ValueError(f"k={k}: need 1 <= k <= the vocabulary ({vocab})")
    if vocab >= 2**24:
        raise ValueError(f"vocabulary {vocab} does not fit the fp32 id of a (value, id) pair")
    x = _sanitize(xp, logits).reshape(-1, vs)
    rows, ks = x.shape[0], min(k, vs)
    _, local = backend.topk_logprobs(xp.ascontiguousarray(logits.reshape(rows, vs)), ks)  # the public op's ids
    local = local.astype(xp.int64)
    vals = xp.take_along_axis(x, local, 1)
    mine = xp.concatenate([x.max(axis=1)[:, None],
                           xp.stack([vals, (local + offset).astype(xp.float32)], 2).reshape(rows, 2 * ks)], 1)
    got = yield xp.ascontiguousarray(mine)  # [world, rows, 1 + 2 ks]
    world = got.shape[0]
    m = got[..., 0].max(axis=0).astype(xp.float64)
    finite = m > -np.inf
    safe_m = xp.where(finite, m, 0.0)
    s = xp.exp(x.astype(xp.float64) - safe_m[:, None]).sum(axis=-1)
    sums = (yield xp.ascontiguousarray(s[:, None]).view(xp.int64))[..., 0].view(xp.float64)  # [world, rows]
    # (sent as int64 bits: NCCL's types here have no float64)
    bounds = [r * (vocab // world) for r in range(world + 1)]
    total, _ = pairwise_combine([sums[r] for r in range(world)], bounds)
    lse = xp.where(finite, safe_m + xp.log(xp.where(finite, total, 1.0)), 0.0)
    cand = got[..., 1:].reshape(world, rows, ks, 2).transpose(1, 0, 2, 3).reshape(rows, world * ks, 2)
    cv, ci = cand[..., 0], cand[..., 1]
    order = xp.argsort(_order_keys(xp, cv, ci), axis=1)[:, :k]
    top_v = xp.take_along_axis(cv, order, 1).astype(xp.float64)
    ids = xp.take_along_axis(ci, order, 1).astype(xp.int32)
    logq = xp.maximum(top_v - lse[:, None], -FLT_MAX).astype(xp.float32)
    return logq.reshape(lead + (k,)), ids.reshape(lead + (k,))


def _order_keys(xp, vals, ids):
    """uint64 keys whose ascending order is value descending (fp32, no NaN), then id ascending."""
    bits = vals.astype(xp.float32).view(xp.uint32)
    up = xp.where(bits >> 31 != 0, ~bits, bits | xp.uint32(0x80000000))  # ascending as uint32
    return ((~up).astype(xp.uint64) << xp.uint64(32)) | ids.astype(xp.int64).astype(xp.uint64)


def sample(model, logits, temperature, top_p, keys):
    """int32 [B] tokens (backend array) from this rank's slice ``logits`` [B, V / N] of a tensor-parallel
    ``model`` (its communicator, its vocabulary offset): the tokens one rank's ``backend.sample``
    draws from the whole row. temperature / top_p: host fp32 [B]; keys: backend uint64 [B]."""
    be = model.backend
    return run(model.comm, sample_steps(be.xp, logits, model.vocab_offset, temperature, top_p, keys))


def topk(model, logits, k: int):
    """(logq, ids) [..., k] from this rank's slice ``logits`` [..., V / N]: one rank's
    ``backend.topk_logprobs`` over the whole row (see the module docstring for the log-probs' bits)."""
    return run(model.comm, topk_steps(model.backend, logits, model.vocab_offset, model.cfg.vocab_size, k))
