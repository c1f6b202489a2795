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
  the sentinel ``num_pairs`` up to a multiple of its list's block (``block``, or ``large_block`` for
  experts with more than ``large_above`` pairs); each list holds its runs in expert order;
  out-of-range ids are left out and flagged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_EXPERTS = 1024
MAX_GROUPS = 32
MAX_TOP_K = 32


def router_logits(x, weight, out=None):
    """x [M, H] bf16, weight [E, H] bf16 or fp32 -> fp32 logits [M, E] (float64 products and sums: batch-invariant)."""
    if x.ndim != 2 or weight.ndim != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"router_logits: expected x [M, H] and weight [E, H], got {x.shape} and {weight.shape}")
    y = (x.astype(np.float64) @ weight.astype(np.float64).T).astype(np.float32)
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


def selection_scores(logits, bias) -> tuple[np.ndarray, np.ndarray]:
    """fp32 logits [M, E], bias fp32 [E] or None -> (s, b): the sigmoid scores s (what the weights
    are made of) and the selection scores b = s + bias (fp32, NaN -> -inf) that pick groups and experts."""
    s = sigmoid_f32(logits)
    b = s if bias is None else s + np.asarray(bias, dtype=np.float32)[None, :]
    return s, np.where(np.isnan(b), np.float32(-np.inf), b).astype(np.float32)


def descending(scores) -> np.ndarray:
    """Indices by descending score along the last axis; equal scores keep the lower index first."""
    return np.argsort(-scores, axis=-1, kind="stable")


def group_scores(b, n_group: int) -> np.ndarray:
    """Selection scores b [M, E] -> group scores [M, n_group]: the sum of each group's two largest
    (-inf for every group when groups hold one expert)."""
    m, e = b.shape
    gs = e // n_group
    top2 = -np.sort(-b.reshape(m, n_group, gs), axis=-1, kind="stable")[..., :2]
    return (top2[..., 0] + top2[..., 1]) if gs > 1 else top2[..., 0] + np.float32(-np.inf)


def limit_to_groups(b, n_group: int, topk_group: int) -> np.ndarray:
    """Selection scores b [M, E] with the experts outside each row's ``topk_group`` best groups
    (by ``group_scores``) set to -inf."""
    m, e = b.shape
    keep = np.zeros((m, n_group), dtype=bool)
    np.put_along_axis(keep, descending(group_scores(b, n_group))[:, :topk_group], True, axis=-1)
    return np.where(np.repeat(keep, e // n_group, axis=1), b, np.float32(-np.inf))


def moe_route(logits, bias, top_k: int, n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
              routed_scaling_factor: float = 1.0, out_ids=None, out_weights=None):
    """logits fp32 [M, E], bias fp32 [E] or None -> (ids int32 [M, top_k], weights fp32 [M, top_k])."""
    logits = np.asarray(logits)
    if logits.ndim != 2 or logits.dtype != np.float32:
        raise ValueError(f"logits: expected fp32 [M, E], got {logits.dtype} {logits.shape}")
    check_route_args(logits.shape[1], top_k, n_group, topk_group)
    s, b = selection_scores(logits, bias)
    if n_group > 1:
        b = limit_to_groups(b, n_group, topk_group)
    ids = descending(b)[:, :top_k].astype(np.int32)
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
    """Pairs grouped by expert into two block lists. An expert with at most ``large_above`` pairs has
    its run in the small list (``sorted_pairs[:small_capacity]``, blocks of ``block`` slots), one with
    more in the large list (``sorted_pairs[small_capacity:]``, blocks of ``large_block`` slots).
    ``sorted_pairs[offsets[e]:offsets[e] + counts[e]]`` are expert e's pairs (ascending), its run
    padded with ``num_pairs`` to a multiple of its block. Small block ``u`` belongs to expert
    ``block_expert[u]``, large block ``u`` to ``block_expert[small_capacity // block + u]``; only the
    first ``num_blocks[0]`` small and ``num_blocks[1]`` large blocks are valid. ``error[0]`` is 1
    when some id was out of range (those pairs are left out)."""

    counts: object  # int32 [E]
    offsets: object  # int32 [E]: start of each expert's run in sorted_pairs
    sorted_pairs: object  # int32 [small_capacity + large_capacity]
    block_expert: object  # int32 [small_capacity // block + large_capacity // large_block]
    num_blocks: object  # int32 [2]: valid blocks of the small list, of the large list
    error: object  # int32 [1]
    block: int
    num_pairs: int
    large_block: int
    large_above: int  # >= num_pairs: no large list
    small_capacity: int
    large_capacity: int

    @property
    def small_blocks(self) -> int:
        """Blocks the small list can hold (a launch bound)."""
        return self.small_capacity // self.block

    @property
    def large_blocks(self) -> int:
        return self.large_capacity // self.large_block


def align_capacities(num_pairs: int, num_experts: int, block: int, large_block: int,
                     large_above: int) -> tuple[int, int]:
    """Slots of the small and the large list enough for any routing: the n experts of a list pad
    fewer than ``block`` slots each, so it needs at most (P + n (block - 1)) // block blocks, with
    n <= min(E, P) small experts of at most ``large_above`` pairs and n <= P // (large_above + 1)
    large ones."""
    n = min(num_experts, num_pairs)
    small = (num_pairs + n * (block - 1)) // block
    if large_above >= num_pairs:
        return small * block, 0
    small = min(small, n * -(-large_above // block))
    n_large = min(num_experts, num_pairs // (large_above + 1))
    return small * block, (num_pairs + n_large * (large_block - 1)) // large_block * large_block


def align_args(num_pairs: int, block: int, large_block: int | None, large_above: int | None) -> tuple[int, int]:
    """(large_block, large_above) with the defaults filled in: no large list."""
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    if large_block is None:
        return block, num_pairs
    if large_block < 1 or large_above is None or large_above < 0:
        raise ValueError(f"large_block {large_block} needs large_block >= 1 and large_above >= 0, "
                         f"got large_above {large_above}")
    return large_block, min(large_above, num_pairs)


def moe_align(topk_ids, num_experts: int, block: int, out: MoEAlignment | None = None,
              check_ids: bool = True, large_block: int | None = None,
              large_above: int | None = None) -> MoEAlignment:
    """topk_ids int32 [M, top_k] -> MoEAlignment (see the class). Without ``large_block`` every
    expert is in the small list."""
    ids = np.asarray(topk_ids)
    if ids.ndim != 2 or ids.dtype != np.int32 or ids.size == 0:
        raise ValueError(f"topk_ids: expected non-empty int32 [M, top_k], got {ids.dtype} {ids.shape}")
    flat = ids.reshape(-1)
    p = flat.size
    large_block, large_above = align_args(p, block, large_block, large_above)
    bad = (flat < 0) | (flat >= num_experts)
    if check_ids and bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"topk_ids: expert id {int(flat[i])} at pair {i} (token {i // ids.shape[1]}) "
                         f"is out of range [0, {num_experts})")
    cap_s, cap_l = align_capacities(p, num_experts, block, large_block, large_above)
    counts = np.bincount(flat[~bad], minlength=num_experts).astype(np.int32)
    large = counts > large_above
    bsz = np.where(large, large_block, block)
    padded = (counts + bsz - 1) // bsz * bsz
    offsets = np.zeros(num_experts, dtype=np.int32)
    ends = [0, cap_s]
    for e in range(num_experts):  # each list in expert order
        offsets[e] = ends[int(large[e])]
        ends[int(large[e])] += int(padded[e])
    sorted_pairs = np.full(cap_s + cap_l, p, dtype=np.int32)
    block_expert = np.zeros(cap_s // block + cap_l // large_block, dtype=np.int32)
    order = np.argsort(np.where(bad, num_experts, flat), kind="stable")
    start = 0
    for e in range(num_experts):
        c = int(counts[e])
        sorted_pairs[offsets[e]:offsets[e] + c] = order[start:start + c]
        b0 = cap_s // block + (offsets[e] - cap_s) // large_block if large[e] else offsets[e] // block
        block_expert[b0:b0 + padded[e] // bsz[e]] = e
        start += c
    num_blocks = np.array([ends[0] // block, (ends[1] - cap_s) // large_block], dtype=np.int32)
    res = MoEAlignment(counts, offsets, sorted_pairs, block_expert, num_blocks,
                       np.array([int(bad.any())], dtype=np.int32), block, p, large_block, large_above,
                       cap_s, cap_l)
    if out is not None:
        for name in ("counts", "offsets", "num_blocks", "error", "sorted_pairs", "block_expert"):
            getattr(out, name)[...] = getattr(res, name)
        return out
    return res
