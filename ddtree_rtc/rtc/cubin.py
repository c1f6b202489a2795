"""Read per-kernel resource usage straight from a cubin's ELF sections.

NVRTC 13.0 returns an empty ``-Xptxas=-v`` log, so registers, stack frame and static shared
memory are also read here, where no tool or GPU is needed. ``.nv.info`` holds EIATTR records
(format byte, attribute byte, then a value); ``.nv.shared.<kernel>`` sizes the static shared memory.
"""

from __future__ import annotations

import struct

_EIATTR_FRAME_SIZE = 0x11
_EIATTR_REGCOUNT = 0x2F
_EIFMT_NVAL, _EIFMT_BVAL, _EIFMT_HVAL, _EIFMT_SVAL = 1, 2, 3, 4
_SYSTEM_RESERVE = 1024  # cudaDevAttrReservedSharedMemoryPerBlock on sm_80 and later


class CubinError(ValueError):
    pass


def _sections(data: bytes):
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise CubinError("not a 64-bit ELF cubin")
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    raw = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab_off = raw[shstrndx][4]

    def name(off):
        end = data.index(b"\0", strtab_off + off)
        return data[strtab_off + off:end].decode()

    return [(name(r[0]), r[1], r[4], r[5], r[6]) for r in raw]  # name, type, offset, size, link


def _symbols(data: bytes, sections) -> list[str]:
    for _name, typ, off, size, link in sections:
        if typ == 2:  # SHT_SYMTAB
            str_off = sections[link][2]
            names = []
            for i in range(size // 24):
                st_name = struct.unpack_from("<I", data, off + i * 24)[0]
                end = data.index(b"\0", str_off + st_name)
                names.append(data[str_off + st_name:end].decode())
            return names
    return []


def _eiattrs(data: bytes, off: int, size: int):
    p, end = off, off + size
    while p + 2 <= end:
        fmt, attr = data[p], data[p + 1]
        if fmt == _EIFMT_SVAL:
            n = struct.unpack_from("<H", data, p + 2)[0]
            yield attr, data[p + 4:p + 4 + n]
            p += 4 + n
        elif fmt == _EIFMT_HVAL:
            yield attr, data[p + 2:p + 4]
            p += 4
        elif fmt == _EIFMT_BVAL:
            p += 3
        elif fmt == _EIFMT_NVAL:
            p += 2
        else:
            return


def resource_usage(cubin: bytes) -> dict[str, dict[str, int]]:
    """{kernel: {registers, stack, shared}} for every kernel in ``cubin``."""
    secs = _sections(cubin)
    syms = _symbols(cubin, secs)
    reserved = any(n.startswith(".nv.shared.reserved.") for n, *_ in secs)
    out: dict[str, dict[str, int]] = {}
    for name, *_ in secs:
        if name.startswith(".text."):
            out.setdefault(name[len(".text."):], {"registers": 0, "stack": 0, "shared": 0})
    for name, _typ, off, size, _link in secs:
        if name == ".nv.info":
            for attr, val in _eiattrs(cubin, off, size):
                if attr in (_EIATTR_REGCOUNT, _EIATTR_FRAME_SIZE) and len(val) == 8:
                    sym, value = struct.unpack("<II", val)
                    fn = syms[sym] if sym < len(syms) else None
                    if fn in out:
                        out[fn]["registers" if attr == _EIATTR_REGCOUNT else "stack"] = value
        elif name.startswith(".nv.shared.") and name[len(".nv.shared."):] in out:
            # On sm_80+ a kernel that uses shared memory or barriers carries the 1 KB per-block system
            # reserve at the start of its section (module has .nv.shared.reserved.*): count user bytes.
            out[name[len(".nv.shared."):]]["shared"] = size - _SYSTEM_RESERVE if reserved and size >= _SYSTEM_RESERVE \
                else size
    return out
