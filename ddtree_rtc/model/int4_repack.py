"""INT4 expert weights: the container, and the host repack (once, at load) into the layout that
``cuda_src/moe_gemm.cu`` streams.

Layout "mma" of one [N, K] matrix (the weights sit on the 16-row A side of mma.m16n8k16): blocks
of (16 rows = one m16 tile) x (128 k), tile-major then k, each 1152 bytes:

  bytes [0, 1024): two k64 halves h of 32 lanes x 16 B. Lane L = 4*g + t holds four int32 words
      j = 2*b + a: the original word P[16*T + g + 8*a, 16*c + 8*h + 4*b + t] (eight k values,
      k = 8*(that column) + i), its nibbles reordered so value i sits at nibble [0, 2, 4, 6, 1, 3,
      5, 7].index(i): then (word >> 4*s) & 0x000F000F yields the bf16x2 pair (k0+2s, k0+2s+1),
      which is one A-fragment register after the magic-number dequant.
  bytes [1024, 1152): 8 entries of 16 B, entry g = scales [S[16T+g, 4c..4c+3], S[16T+g+8, 4c..4c+3]].

The mma's B side (tokens) then reads x[token, kbase + 8*t .. +8] as one 16-byte load per k32 chunk,
which is exactly the k order the A words carry. gate and up are fused along N with m16 tile b =
[gate rows 8b..8b+7; up rows 8b..8b+7], so one lane holds gate and up of the same output for
SiLU(gate) * up in registers.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from ml_dtypes import bfloat16

TILE_N = 16
TILE_K = 128
BLOCK_BYTES = 1152
GROUP = 32
# nibble position of value i within a repacked word, and its inverse
_NIBBLE_POS = np.array([0, 4, 1, 5, 2, 6, 3, 7], dtype=np.uint32)
LAYOUTS = ("compressed-tensors", "mma")


@dataclass
class Int4Experts:
    """One MoE layer's routed experts, symmetric INT4 with bf16 group-32 scales.

    layout 'compressed-tensors' (numpy backend, host arrays as in the checkpoint, gate and up
    stacked along N): w13 int32 [E, 2I, H/8], w13_scale bf16 [E, 2I, H/32], w2 int32 [E, H, I/8],
    w2_scale bf16 [E, H, I/32].
    layout 'mma' (CUDA backend, device arrays; scales live inside the blocks, *_scale are None):
    w13 uint8 [E, 2I/16, H/128, 1152] with gate/up fused, w2 uint8 [E, H/16, I/128, 1152]."""

    layout: str
    num_experts: int
    hidden: int
    intermediate: int
    w13: object
    w13_scale: object
    w2: object
    w2_scale: object

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"Int4Experts: unknown layout {self.layout!r}; known: {', '.join(LAYOUTS)}")
        check_dims(self.hidden, self.intermediate, TILE_K if self.layout == "mma" else GROUP)

    def nbytes(self) -> int:
        """Bytes of packed weights plus scales for all experts."""
        return sum(int(a.nbytes) for a in (self.w13, self.w13_scale, self.w2, self.w2_scale) if a is not None)

    def expert_nbytes(self) -> int:
        """Bytes one expert streams (packed weights + scales of gate, up and down)."""
        return 3 * self.hidden * self.intermediate * 9 // 16


def check_dims(hidden: int, intermediate: int, multiple: int = TILE_K) -> None:
    """Both sizes are a k dim (hidden for gate/up, intermediate for down): the scale group (32)
    must divide them, and for the GPU layout the 128-wide k block (which also makes whole 32-row
    warp tiles along N), so a bad shape is refused before any kernel runs."""
    for name, v in (("hidden", hidden), ("intermediate", intermediate)):
        if v <= 0 or v % multiple:
            raise ValueError(f"{name} size {v} must be a positive multiple of {multiple} "
                             f"({'the INT4 MoE GPU k block' if multiple == TILE_K else 'the scale group'})")


def _check_matrix(packed: np.ndarray, scale: np.ndarray, name: str) -> tuple[int, int]:
    if packed.ndim != 2 or packed.dtype not in (np.int32, np.uint32):
        raise ValueError(f"{name}: expected int32 packed [N, K/8], got {packed.dtype} {packed.shape}")
    n, k = packed.shape[0], packed.shape[1] * 8
    if n % TILE_N or k % TILE_K:
        raise ValueError(f"{name}: N={n} must be a multiple of {TILE_N} and K={k} of {TILE_K}")
    if scale.shape != (n, k // GROUP):
        raise ValueError(f"{name}: scale shape {scale.shape} != [{n}, {k // GROUP}]")
    return n, k


def _xp(a):
    """numpy, or CuPy for a CuPy array (the repack runs on the device for weights made there)."""
    return np if isinstance(a, np.ndarray) else __import__("cupy")


def permute_nibbles(words: np.ndarray) -> np.ndarray:
    """Move value i (nibble i) of each word to nibble _NIBBLE_POS[i]."""
    w = words.view(np.uint32)
    out = _xp(w).zeros_like(w)
    for i in range(8):
        out |= ((w >> np.uint32(4 * i)) & np.uint32(0xF)) << (np.uint32(4) * _NIBBLE_POS[i])
    return out


def unpermute_nibbles(words: np.ndarray) -> np.ndarray:
    w = words.view(np.uint32)
    out = np.zeros_like(w)
    for i in range(8):
        out |= ((w >> (np.uint32(4) * _NIBBLE_POS[i])) & np.uint32(0xF)) << np.uint32(4 * i)
    return out


def repack_matrix(packed: np.ndarray, scale: np.ndarray, name: str = "weight") -> np.ndarray:
    """One [N, K] compressed-tensors matrix -> uint8 [N/16, K/128, 1152] (layout in the module doc);
    numpy, or CuPy arrays (scales as bf16 bits) repacked on the device."""
    n, k = _check_matrix(packed, scale, name)
    xp = _xp(packed)
    tn, kc = n // TILE_N, k // TILE_K
    p = permute_nibbles(xp.ascontiguousarray(packed))
    # row = 16T + 8a + g, column = 16c + 8h + 4b + t  ->  [T, c, h, g, t, b, a]
    words = p.reshape(tn, 2, 8, kc, 2, 2, 4).transpose(0, 3, 4, 2, 6, 5, 1)
    words = xp.ascontiguousarray(words).reshape(tn, kc, 1024 // 4)
    # scale [16T + 8a + g, 4c + q] -> [T, c, g, a, q]
    s = xp.ascontiguousarray(scale)
    s = s.view(np.uint16) if s.dtype == np.uint16 else s.astype(bfloat16).view(np.uint16)
    s = xp.ascontiguousarray(s.reshape(tn, 2, 8, kc, 4).transpose(0, 3, 2, 1, 4)).reshape(tn, kc, 64)
    out = xp.empty((tn, kc, BLOCK_BYTES), dtype=np.uint8)
    out[:, :, :1024] = words.astype("<u4").view(np.uint8).reshape(tn, kc, 1024)
    out[:, :, 1024:] = s.astype("<u2").view(np.uint8).reshape(tn, kc, 128)
    return out


def unrepack_matrix(blob: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of ``repack_matrix``: uint8 blocks -> (packed int32 [N, K/8], scale bf16 [N, K/32])."""
    tn, kc = n // TILE_N, k // TILE_K
    b = np.ascontiguousarray(blob).reshape(tn, kc, BLOCK_BYTES)
    words = b[:, :, :1024].copy().view("<u4").reshape(tn, kc, 2, 8, 4, 2, 2)  # T, c, h, g, t, b, a
    p = words.transpose(0, 6, 3, 1, 2, 5, 4).reshape(n, k // 8)
    packed = unpermute_nibbles(np.ascontiguousarray(p).astype(np.uint32)).view(np.int32)
    s = b[:, :, 1024:].copy().view("<u2").reshape(tn, kc, 8, 2, 4)  # T, c, g, a, q
    scale = np.ascontiguousarray(s.transpose(0, 3, 2, 1, 4)).reshape(n, k // GROUP).view(bfloat16)
    return packed, scale


def fuse_gate_up_rows(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """Rows of [gate; up] ([I, ...] each) reordered into fused m16 tiles [gate 8b..8b+7; up 8b..8b+7]."""
    if gate.shape != up.shape or gate.shape[0] % 8:
        raise ValueError(f"gate/up: shapes {gate.shape} and {up.shape} must match with rows a multiple of 8")
    i = gate.shape[0]
    both = np.stack([gate, up])  # [2, I, ...]
    return np.ascontiguousarray(both.reshape(2, i // 8, 8, *gate.shape[1:]).swapaxes(0, 1)).reshape(
        2 * i, *gate.shape[1:])


def repack_experts(experts: Int4Experts) -> Int4Experts:
    """'compressed-tensors' host experts -> 'mma' host blobs (numpy; upload with ``to_device``)."""
    if experts.layout != "compressed-tensors":
        raise ValueError(f"repack_experts: expected layout 'compressed-tensors', got {experts.layout!r}")
    e, h, inter = experts.num_experts, experts.hidden, experts.intermediate
    if _xp(experts.w13) is not np:
        return repack_experts_stacked(experts)
    w13 = np.empty((e, 2 * inter // TILE_N, h // TILE_K, BLOCK_BYTES), dtype=np.uint8)
    w2 = np.empty((e, h // TILE_N, inter // TILE_K, BLOCK_BYTES), dtype=np.uint8)

    def one(x: int) -> None:
        gp, up = experts.w13[x][:inter], experts.w13[x][inter:]
        gs, us = experts.w13_scale[x][:inter], experts.w13_scale[x][inter:]
        w13[x] = repack_matrix(fuse_gate_up_rows(gp, up), fuse_gate_up_rows(gs, us), f"expert {x} gate_up")
        w2[x] = repack_matrix(experts.w2[x], experts.w2_scale[x], f"expert {x} down")

    # numpy drops the GIL in the repack's array work: experts in parallel threads (384 per K2.6 layer)
    with ThreadPoolExecutor(max_workers=min(e, os.cpu_count() or 1)) as pool:
        list(pool.map(one, range(e)))
    return Int4Experts("mma", e, h, inter, w13, None, w2, None)


def repack_experts_stacked(experts: Int4Experts, group_bytes: int = 256 << 20) -> Int4Experts:
    """``repack_experts`` in the experts' own array module (CuPy experts: on the device), a group of
    experts per step: the rows of E stacked [N, K] matrices are one [E N, K] matrix whose m16 tiles
    are each expert's in turn, so one repack of the stack is the stack of the repacks."""
    xp = _xp(experts.w13)
    e, h, inter = experts.num_experts, experts.hidden, experts.intermediate
    w13 = xp.empty((e, 2 * inter // TILE_N, h // TILE_K, BLOCK_BYTES), dtype=np.uint8)
    w2 = xp.empty((e, h // TILE_N, inter // TILE_K, BLOCK_BYTES), dtype=np.uint8)
    per = max(1, group_bytes // max(1, int(experts.w13[0].nbytes)))
    for a in range(0, e, per):
        b = min(e, a + per)
        gp, up = experts.w13[a:b, :inter], experts.w13[a:b, inter:]
        gs, us = experts.w13_scale[a:b, :inter], experts.w13_scale[a:b, inter:]
        fp, fs = _fuse_stacked(gp, up), _fuse_stacked(gs, us)
        w13[a:b] = repack_matrix(fp.reshape(-1, fp.shape[2]), fs.reshape(-1, fs.shape[2]),
                                 f"experts {a}..{b - 1} gate_up").reshape(w13[a:b].shape)
        w2[a:b] = repack_matrix(experts.w2[a:b].reshape(-1, experts.w2.shape[2]),
                                experts.w2_scale[a:b].reshape(-1, experts.w2_scale.shape[2]),
                                f"experts {a}..{b - 1} down").reshape(w2[a:b].shape)
    return Int4Experts("mma", e, h, inter, w13, None, w2, None)


def _fuse_stacked(gate, up):
    """fuse_gate_up_rows of each expert of stacked [E, I, c] gate / up (either array module)."""
    xp = _xp(gate)
    e, i = gate.shape[:2]
    both = xp.stack([gate, up], axis=1)  # [E, 2, I, c]
    return xp.ascontiguousarray(both.reshape(e, 2, i // 8, 8, -1).swapaxes(1, 2)).reshape(e, 2 * i, -1)


def prepare_experts(experts: Int4Experts, backend) -> Int4Experts:
    """The form ``backend.moe_experts`` takes: compressed-tensors on numpy, repacked 'mma' on the GPU."""
    if not backend.is_cuda:
        if experts.layout != "compressed-tensors":
            raise ValueError("the numpy backend needs the original compressed-tensors experts, not the repack")
        return experts
    if experts.layout == "compressed-tensors":
        experts = repack_experts(experts)
    xp = backend.xp
    return Int4Experts("mma", experts.num_experts, experts.hidden, experts.intermediate,
                       xp.asarray(experts.w13), None, xp.asarray(experts.w2), None)


def random_compressed_experts(rng: np.random.Generator, num_experts: int, hidden: int, intermediate: int,
                              scale: float = 1.0) -> Int4Experts:
    """Random 'compressed-tensors' experts (every nibble value, -8 and 7 included in each matrix);
    scales ~ scale / sqrt(21.5 K) so a unit-normal input gives roughly unit-variance outputs."""
    def matrix(n: int, k: int):
        p = rng.integers(0, 2**32, size=(num_experts, n, k // 8), dtype=np.uint32)
        p[:, 0, 0] = 0x0F0F0F0F  # values -8 and 7 alternate
        s = rng.uniform(0.5, 1.5, size=(num_experts, n, k // GROUP)) * scale / np.sqrt(21.5 * k)
        return p.view(np.int32), s.astype(bfloat16)

    w13, s13 = matrix(2 * intermediate, hidden)
    w2, s2 = matrix(hidden, intermediate)
    return Int4Experts("compressed-tensors", num_experts, hidden, intermediate, w13, s13, w2, s2)
