"""On-disk cache of compiled modules: readable names plus a key that cannot go stale.

Key: sha256 over source, every header's name and bytes, sorted options, target arch, NVRTC
version and package version. Each entry is ``<name>-<target>-<hash16>.{cubin,ptx,json}``; the
JSON carries the cubin's sha256, so a torn or corrupt entry is detected and rebuilt. Writes are
atomic (temp file + rename) and a per-entry file lock stops two processes building one entry.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "DDTREE_RTC_CACHE_DIR"


def cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ddtree_rtc"
    base.mkdir(parents=True, exist_ok=True)
    return base


def cache_key(source: str, headers: dict[str, str], options: list[str], target: str,
              nvrtc_version: tuple[int, int], package_version: str) -> str:
    h = hashlib.sha256()
    for part in (source, target, ".".join(map(str, nvrtc_version)), package_version):
        h.update(part.encode())
        h.update(b"\0")
    for name in sorted(headers):
        h.update(name.encode() + b"\0" + headers[name].encode() + b"\0")
    for opt in sorted(options):
        h.update(opt.encode() + b"\0")
    return h.hexdigest()


@dataclass(frozen=True)
class CacheEntry:
    cubin: bytes
    ptx: str
    meta: dict


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


class ModuleCache:
    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root else cache_dir()
        self.root.mkdir(parents=True, exist_ok=True)

    def stem(self, name: str, target: str, key: str) -> Path:
        return self.root / f"{name}-{target}-{key[:16]}"

    @contextlib.contextmanager
    def lock(self, stem: Path):
        with open(stem.with_suffix(".lock"), "a+b") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def load(self, stem: Path, key: str) -> CacheEntry | None:
        """The entry, or None when missing, torn or corrupt (the caller rebuilds it)."""
        try:
            meta = json.loads(stem.with_suffix(".json").read_text())
            cubin = stem.with_suffix(".cubin").read_bytes()
            ptx = stem.with_suffix(".ptx").read_text()
        except (OSError, ValueError):
            return None
        if (meta.get("key") != key or hashlib.sha256(cubin).hexdigest() != meta.get("cubin_sha256")
                or hashlib.sha256(ptx.encode()).hexdigest() != meta.get("ptx_sha256")):
            return None
        return CacheEntry(cubin, ptx, meta)

    def store(self, stem: Path, key: str, cubin: bytes, ptx: str, meta: dict) -> CacheEntry:
        meta = dict(meta, key=key, cubin_sha256=hashlib.sha256(cubin).hexdigest(),
                    ptx_sha256=hashlib.sha256(ptx.encode()).hexdigest())
        _atomic_write(stem.with_suffix(".cubin"), cubin)
        _atomic_write(stem.with_suffix(".ptx"), ptx.encode())
        # The JSON goes last: an entry is valid only once its checksums are on disk.
        _atomic_write(stem.with_suffix(".json"), json.dumps(meta, indent=1, sort_keys=True).encode())
        return CacheEntry(cubin, ptx, meta)

    def clear(self) -> int:
        n = 0
        for p in self.root.glob("*"):
            if p.suffix in (".cubin", ".ptx", ".json", ".lock", ".tmp"):
                p.unlink(missing_ok=True)
                n += 1
        return n
