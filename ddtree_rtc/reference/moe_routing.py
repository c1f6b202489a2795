"""MoE routing reference: router logits, DeepSeek-V3 noaux_tc top-k, and the token->expert
"align" step that groups (token, slot) pairs by expert, each expert's run padded to the block size.

Rules the CUDA kernels follow bit for bit:
- sigmoid is evaluated in float64 and rounded once to fp32 (so both sides get the correctly
  rounded fp32 sigmoid); the bias is added in fp32 and used for selection only;
- NaN selection scores count as -inf; ties (equal scores) go to the lower expert / group index;
- group score = (largest + second largest) biased score of the group; experts outside the kept
  groups score -inf (they can still be picked, lowest index first, if top_k exceeds what is left);
- weights are the unbiased sigmoid scores of the picks, in pick order (descending score), summed
  left to right in fp32, divided by (sum + 1e-20) when normalising, then times the scaling factor.
- align: pair p = token * top_k + slot; within an expert's run pairs ascend; the run is padded with
  the sentinel ``num_pairs`` up to a multiple of ``block``; out-of-range ids are left out and flagged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_EXPERTS = 1024
MAX_GROUPS = 32
MAX_TOP_K = 32


def router_logits(x, weight, out=None):
    """x [M, H] bf16, weight [E, H] bf16 -> fp32 logits [M, E] (fp32 products and sums)."""
    if x.ndim != 2 or weight.ndim != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"router_logits: expected x [M, H] and weight [E, H], got {x.shape} and {weight.shape}")
    y = x.astype(np.float32) @ weight.astype(np.float32).T
    if out is not None:
        out[...] = y
        return out
    return y


def check_route_args(num_experts: int, top_k: int, n_group: int, topk_group: int) -> None:
    """The routing shape rules, shared by the reference and the kernel wrapper."""
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts must be in [1, {MAX_EXPERTS}], got {num_experts}")
    if not 1 <= n_group <= MAX_GROUPS or num_experts % n_group:
        raise ValueError(f"n_group must divide num_experts ({num_experts}) and be in [1, {MAX_GROUPS}], "
                         f"got {n_group}")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group must be in [1, n_group={n_group}], got {topk_group}")
    if top_k > MAX_TOP_K:
        raise ValueError(f"top_k must be at most {MAX_TOP_K}, got {top_k}")
    if not 1 <= top_k <= topk_group * (num_experts // n_group):
        raise ValueError(f"top_k must be in [1, topk_group * experts per group = "
                         f"{topk_group * (num_experts // n_group)}], got {top_k}")


def sigmoid_f32(logits) -> np.ndarray:
    """fp32 sigmoid, correctly rounded: float64 evaluation, one rounding."""
    with np.errstate(over="ignore"):
        return (1.0 / (1.0 + np.exp(-np.asarray(logits, dtype=np.float64)))).astype(np.float32)


def moe_route(logits, bias, top_k: int, n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
              routed_scaling_factor: float = 1.0, out_ids=None, out_weights=None):
    """logits fp32 [M, E], bias fp32 [E] or None -> (ids int32 [M, top_k], weights fp32 [M, top_k])."""
    logits = np.asarray(logits)
    if logits.ndim != 2 or logits.dtype != np.float32:
        raise ValueError(f"logits: expected fp32 [M, E], got {logits.dtype} {logits.shape}")
    m, e = logits.shape
    check_route_args(e, top_k, n_group, topk_group)
    s = sigmoid_f32(logits)
    b = s if bias is None else s + np.asarray(bias, dtype=np.float32)[None, :]
    b = np.where(np.isnan(b), np.float32(-np.inf), b).astype(np.float32)
    if n_group > 1:
        gs = e // n_group
        top2 = -np.sort(-b.reshape(m, n_group, gs), axis=-1, kind="stable")[..., :2]
        gscore = (top2[..., 0] + top2[..., 1]) if gs > 1 else top2[..., 0] + np.float32(-np.inf)
        gorder = np.argsort(-gscore, axis=-1, kind="stable")  # stable: ties -> lower group index
        keep = np.zeros((m, n_group), dtype=bool)
        np.put_along_axis(keep, gorder[:, :topk_group], True, axis=-1)
        b = np.where(np.repeat(keep, gs, axis=1), b, np.float32(-np.inf))
    ids = np.argsort(-b, axis=-1, kind="stable")[:, :top_k].astype(np.int32)
    w = np.take_along_axis(s, ids, axis=-1)
    if norm_topk_prob:
        total = w[:, 0].copy()
        for i in range(1, top_k):
            total = total + w[:, i]
        w = w / (total[:, None] + np.float32(1e-20))
    w = (w * np.float32(routed_scaling_factor)).astype(np.float32)
    if out_ids is not None:
        out_ids[...] = ids
        ids = out_ids
    if out_weights is not None:
        out_weights[...] = w
        w = out_weights
    return ids, w


@dataclass
class MoEAlignment:
    """Pairs grouped by expert. ``sorted_pairs[offsets[e]:offsets[e+1]]`` are expert e's pairs
    (ascending), padded with ``num_pairs``; block ``u`` (``block`` slots) belongs to expert
    ``block_expert[u]``; only the first ``num_blocks[0]`` blocks are valid. ``error[0]`` is 1 when
    some id was out of range (those pairs are left out)."""

    counts: object  # int32 [E]
    offsets: object  # int32 [E + 1]
    sorted_pairs: object  # int32 [capacity]
    block_expert: object  # int32 [capacity // block]
    num_blocks: object  # int32 [1]
    error: object  # int32 [1]
    block: int
    num_pairs: int


def align_capacity(num_pairs: int, num_experts: int, block: int) -> int:
    """Slots enough for any routing: every non-empty expert (at most min(E, P)) pads < block."""
    bound = (num_pairs + min(num_experts, num_pairs) * (block - 1)) // block
    return max(bound, 1) * block


def moe_align(topk_ids, num_experts: int, block: int, out: MoEAlignment | None = None,
              check_ids: bool = True) -> MoEAlignment:
    """topk_ids int32 [M, top_k] -> MoEAlignment (see the class)."""
    ids = np.asarray(topk_ids)
    if ids.ndim != 2 or ids.dtype != np.int32 or ids.size == 0:
        raise ValueError(f"topk_ids: expected non-empty int32 [M, top_k], got {ids.dtype} {ids.shape}")
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    flat = ids.reshape(-1)
    p = flat.size
    bad = (flat < 0) | (flat >= num_experts)
    if check_ids and bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"topk_ids: expert id {int(flat[i])} at pair {i} (token {i // ids.shape[1]}) "
                         f"is out of range [0, {num_experts})")
    cap = align_capacity(p, num_experts, block)
    counts = np.bincount(flat[~bad], minlength=num_experts).astype(np.int32)
    padded = (counts + block - 1) // block * block
    offsets = np.concatenate([[0], np.cumsum(padded)]).astype(np.int32)
    sorted_pairs = np.full(cap, p, dtype=np.int32)
    block_expert = np.zeros(cap // block, dtype=np.int32)
    order = np.argsort(np.where(bad, num_experts, flat), kind="stable")
    start = 0
    for e in range(num_experts):
        c = int(counts[e])
        sorted_pairs[offsets[e]:offsets[e] + c] = order[start:start + c]
        block_expert[offsets[e] // block:offsets[e + 1] // block] = e
        start += c
    res = MoEAlignment(counts, offsets, sorted_pairs, block_expert,
                       np.array([offsets[-1] // block], dtype=np.int32),
                       np.array([int(bad.any())], dtype=np.int32), block, p)
    if out is not None:
        for name in ("counts", "offsets", "num_blocks", "error"):
            getattr(out, name)[...] = getattr(res, name)
        out.sorted_pairs[:cap] = sorted_pairs
        out.block_expert[:cap // block] = block_expert
        return out
    return res
