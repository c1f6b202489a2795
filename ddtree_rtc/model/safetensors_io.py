"""Minimal safetensors reading (memory-mapped, bf16 as ml_dtypes.bfloat16) and writing.

The format: 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}},
then the raw tensor bytes. The ``safetensors`` package's numpy API has no bf16, hence this module.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
from ml_dtypes import bfloat16

DTYPES = {"BF16": np.dtype(bfloat16), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
          "F64": np.dtype(np.float64), "I32": np.dtype(np.int32), "I64": np.dtype(np.int64),
          "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "I16": np.dtype(np.int16),
          "BOOL": np.dtype(np.bool_)}
NAMES = {v: k for k, v in DTYPES.items()}


class SafetensorsError(ValueError):
    pass


def read_header(path: str | Path) -> tuple[dict, int]:
    """(tensor table without __metadata__, byte offset where data starts)."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise SafetensorsError(f"{p}: too short to be a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > 100 << 20:
                raise SafetensorsError(f"{p}: implausible header length {n}")
            table = json.loads(f.read(n))
    except OSError as e:
        raise SafetensorsError(f"{p}: cannot read: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise SafetensorsError(f"{p}: corrupt safetensors header: {e}") from None
    table.pop("__metadata__", None)
    _check_extent(p, table, 8 + n)
    return table, 8 + n


def _check_extent(p: Path, table: dict, data_start: int) -> None:
    """A file cut short (an interrupted copy or download) names its first tensor past the end."""
    size = p.stat().st_size
    try:
        ends = sorted((int(e["data_offsets"][1]), name) for name, e in table.items())
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise SafetensorsError(f"{p}: corrupt safetensors header: a tensor without valid data_offsets ({e})") \
            from None
    past = [(end, name) for end, name in ends if data_start + end > size]
    if past:
        end, name = past[0]
        raise SafetensorsError(f"{p}: truncated: {size} bytes, but tensor {name!r} ends at byte {data_start + end} "
                               f"(and {len(past) - 1} more tensors lie past the end); copy or make the file again")


def open_tensor(path: str | Path, name: str, entry: dict, data_start: int) -> np.ndarray:
    """A read-only memory map of one tensor."""
    dtype = DTYPES.get(entry["dtype"])
    if dtype is None:
        raise SafetensorsError(f"{path}: tensor {name!r} has unsupported dtype {entry['dtype']}")
    begin, end = entry["data_offsets"]
    shape = tuple(entry["shape"])
    count = int(np.prod(shape)) if shape else 1
    if end - begin != count * dtype.itemsize:
        raise SafetensorsError(f"{path}: tensor {name!r} byte range {end - begin} != shape {shape} x "
                               f"{dtype.itemsize} B")
    if count == 0:
        return np.empty(shape, dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=data_start + begin, shape=shape)


def write_file(path: str | Path, tensors: dict[str, np.ndarray], metadata: dict | None = None) -> None:
    """Write atomically (temp file + rename)."""
    p = Path(path)
    header: dict = {"__metadata__": {k: str(v) for k, v in (metadata or {}).items()}}
    offset = 0
    arrays = []
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        if a.dtype not in NAMES:
            raise SafetensorsError(f"tensor {name!r}: dtype {a.dtype} cannot be written")
        header[name] = {"dtype": NAMES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        arrays.append(a)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = p.with_name(p.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for a in arrays:
            f.write(a.tobytes() if a.ndim == 0 else memoryview(a.reshape(-1).view(np.uint8)))
    os.replace(tmp, p)
