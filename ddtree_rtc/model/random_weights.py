"""The random weights of a preset, one generator per tensor, shared by ``make-model`` (host, whole
tensors, written to disk) and ``model.load: dummy`` (made in the backend's memory, only this rank's
shard, nothing written).

Every value is a function of (seed, tensor name, flat index in the whole tensor) only: a splitmix64
hash of the index, keyed by blake2b(seed, name). A shard's values are therefore the whole tensor's
values at the shard's indices, whichever slice is asked for, and any part can be made without
making the rest (a K2.6 expert tensor never exists whole on the host for a dummy load). The hash
and the maps to values use only integer operations and single fp32 multiplies / adds, each its own
array operation, so numpy and CuPy give the same bits (no fused multiply-add, no transcendental).

Value forms (scaled so activations keep a sane range through many layers):
  * normal-like N(0, std): the Irwin-Hall sum of the hash's four 16-bit words, centred (a bounded
    bell, |x| <= 3.46 std, variance exact): projections std = 1/sqrt(fan_in) (over sqrt(2 L) on the
    residual branches o_proj / down_proj), the embedding std 1;
  * norms 1 + 0.1 n; the router's correction bias uniform on [-0.05, 0.05) (fp32);
  * INT4 experts: packed words uniform (uniform nibbles, q uniform on [-8, 7]), the first word of
    every matrix 0x0F0F0F0F (q = 7, -8, ...: both extremes); group scales std / 4.6 x U[0.75, 1.25)
    in bf16;
  * lm_head ``random``: normal 1/sqrt(H); ``decisive`` (decisive_rows): the embedding rows of a
    fixed permutation over sqrt(H).
"""

from __future__ import annotations

import hashlib

import numpy as np

HEADS = ("random", "decisive")
QUANT_GROUP = 32
FIRST_WORD = 0x0F0F0F0F  # nibbles 15, 0, 15, 0, ...: q = 7, -8, 7, -8, ...
# elements per generation step: bounds the uint64 temporaries (device: 128 MB each, few launches;
# host: 2 MB each, which stay in cache and run several times faster than large steps)
CHUNK = 1 << 24
HOST_CHUNK = 1 << 18


def chunk_for(xp) -> int:
    return HOST_CHUNK if xp is np else CHUNK

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_M16 = np.uint64(0xFFFF)
# Irwin-Hall of four uniform 16-bit words: mean 2 * 65535, standard deviation 2 * 65536 / sqrt(12)
_IH_MEAN = 2 * 65535
_IH_STD = 2 * 65536 / np.sqrt(12.0)


def tensor_key(seed: int, name: str) -> int:
    """The 64-bit key of tensor ``name`` under ``seed``."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest(), "little")


def hash64(keys, index, xp):
    """splitmix64 of (key + (index + 1) * golden): uint64, ``keys`` broadcast against ``index``."""
    z = keys + (index + np.uint64(1)) * _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def to_bf16_bits(x, xp):
    """fp32 (finite) -> bf16 bits, uint16, round to nearest even (ml_dtypes' rounding)."""
    bits = x.view(xp.uint32)
    return ((bits + xp.uint32(0x7FFF) + ((bits >> xp.uint32(16)) & xp.uint32(1))) >> xp.uint32(16)).astype(xp.uint16)


def normal(z, std: float, xp):
    """fp32 N(0, std)-like values of hashes ``z`` (one fp32 multiply of an exact integer)."""
    s = (z & _M16) + ((z >> np.uint64(16)) & _M16) + ((z >> np.uint64(32)) & _M16) + (z >> np.uint64(48))
    return (s.astype(xp.int64) - _IH_MEAN).astype(xp.float32) * np.float32(std / _IH_STD)


def uniform(z, low: float, high: float, xp):
    """fp32 U[low, high) of hashes ``z`` on a 2^22 grid: (u + low / w) * w with w = (high - low) / 2^22;
    the integer u + low / w is exact in fp32 (|low / w| + 2^22 < 2^24)."""
    w = (high - low) / 2**22
    off = round(low / w)
    if abs(off - low / w) > 1e-6 or abs(off) + 2**22 >= 2**24:
        raise ValueError(f"uniform [{low}, {high}): the offset {low / w} is not an exact fp32 integer")
    u = (z >> np.uint64(42)).astype(xp.int64) + off
    return u.astype(xp.float32) * np.float32(w)


def kind_of(name: str) -> str:
    """The value form of a target tensor (see the module doc)."""
    if name.endswith(".e_score_correction_bias"):
        return "bias"
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return "norm"
    if name.endswith(".weight_packed"):
        return "int4_words"
    if name.endswith(".weight_scale"):
        return "int4_scale"
    if name.endswith(".weight_shape"):
        return "int4_shape"
    if name == "model.embed_tokens.weight":
        return "embed"
    return "linear"


def linear_std(name: str, fan_in: int, n_layers: int) -> float:
    std = fan_in ** -0.5
    if name.endswith(("o_proj.weight", "down_proj.weight", "o_proj.weight_packed", "down_proj.weight_packed",
                      "o_proj.weight_scale", "down_proj.weight_scale")):
        std /= np.sqrt(2 * max(n_layers, 1))  # residual branches: keep the stream's growth bounded
    return float(std)


def _index(shape: tuple, rows, cols: tuple | None, xp):
    """Flat indices in the whole tensor of ``shape`` of rows (a range [r0, r1) or an array of row
    ids) x columns [c0, c1)."""
    r = xp.arange(rows[0], rows[1], dtype=xp.uint64) if isinstance(rows, tuple) else rows.astype(xp.uint64)
    if len(shape) == 1:
        return r
    c0, c1 = cols
    return r[:, None] * np.uint64(shape[1]) + xp.arange(c0, c1, dtype=xp.uint64)[None, :]


def values(seed: int, name: str, shape: tuple, n_layers: int, xp, rows=None, cols: tuple | None = None,
           keys=None):
    """Tensor ``name`` of whole ``shape`` (a target checkpoint's table) at rows [r0, r1) (or the
    row ids of an ``xp`` int array) and columns [c0, c1) (default: all), as ``xp`` arrays: bf16 as
    uint16 bits, fp32, int32. ``keys`` (uint64 [E, 1, 1] on ``xp``): E tensors of one shape at once,
    one key each (the routed experts of a layer); the result is then [E, rows, cols]. Never the
    lm_head's decisive form (decisive_rows)."""
    kind = kind_of(name)
    shape = tuple(shape)
    rows = (0, shape[0]) if rows is None else rows
    if len(shape) == 2:
        cols = cols or (0, shape[1])
    elif cols is not None:
        raise ValueError(f"{name}: a 1-d tensor has no columns")
    if kind == "int4_shape":  # [n, k] of the unpacked matrix: the name's siblings tell k
        raise ValueError(f"{name}: weight_shape is not random (int4_shape gives it)")
    k = xp.uint64(tensor_key(seed, name)) if keys is None else keys
    width = 1 if len(shape) == 1 else cols[1] - cols[0]
    step = max(1, chunk_for(xp) // max(1, width) // (1 if keys is None else int(keys.shape[0])))
    ranged = isinstance(rows, tuple)
    n = rows[1] - rows[0] if ranged else int(rows.shape[0])
    parts = []
    for a in range(0, n, step):
        b = min(n, a + step)
        z = hash64(k, _index(shape, (rows[0] + a, rows[0] + b) if ranged else rows[a:b], cols, xp), xp)
        parts.append(_value(kind, name, shape, n_layers, z, xp))
        del z
    out = parts[0] if len(parts) == 1 else xp.concatenate(parts, axis=0 if keys is None else 1)
    if kind == "int4_words" and ranged and rows[0] == 0 and cols[0] == 0:
        out[..., 0, 0] = np.int32(FIRST_WORD)
    return out


def _value(kind: str, name: str, shape: tuple, n_layers: int, z, xp):
    if kind == "bias":
        return uniform(z, -0.05, 0.05, xp)
    if kind == "norm":
        return to_bf16_bits(normal(z, 0.1, xp) + np.float32(1.0), xp)
    if kind == "int4_words":
        return (z & np.uint64(0xFFFFFFFF)).astype(xp.uint32).view(xp.int32)
    if kind == "int4_scale":  # uniform ints on [-8, 7] have std ~4.6: scale groups to the std, +-25%
        k_in = shape[1] * QUANT_GROUP
        std = linear_std(name, k_in, n_layers)
        return to_bf16_bits(uniform(z, 0.75, 1.25, xp) * np.float32(std / 4.6), xp)
    if kind == "embed":
        return to_bf16_bits(normal(z, 1.0, xp), xp)
    return to_bf16_bits(normal(z, linear_std(name, shape[1], n_layers), xp), xp)


def int4_shape(n: int, k: int, dtype=np.int32) -> np.ndarray:
    """weight_shape of an [n, k] INT4 matrix (compressed-tensors): host, int32 or int64."""
    return np.array([n, k], dtype=dtype)


def head_permutation(seed: int, vocab: int) -> np.ndarray:
    """The decisive lm_head's row permutation (host int64 [V]: small even at K2.6's vocabulary)."""
    return np.random.default_rng(tensor_key(seed, "lm_head.weight")).permutation(vocab)


def decisive_rows(embed_rows, hidden: int, xp):
    """lm_head rows of the decisive head from the embedding rows they copy (bf16 bits, [R, H]):
    e / sqrt(H), rounded to bf16. The residual stream of a random model stays close to its input
    token's embedding (every branch's output projection is scaled down), so the greedy next token is
    perm^-1(token) with a top-1/top-2 margin of most of the logit range (random dot products are
    ~sqrt(2 ln V / H) of it), far beyond bf16 noise. Benchmarks that set tau by an oracle need that:
    with the random head, any change of batch shape flips near-tied choices and the target leaves
    the oracle's precomputed path."""
    e = (embed_rows.astype(xp.uint32) << xp.uint32(16)).view(xp.float32)
    return to_bf16_bits(e * np.float32(hidden ** -0.5), xp)
