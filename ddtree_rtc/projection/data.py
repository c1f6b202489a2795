"""Where the projection reads this repository's committed measurements.

Every benchmark file goes through `benchmark_path`, so moving the files (into the installed package,
for a wheel that works outside the checkout) changes this module only."""
from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from pathlib import Path

# In a checkout this is a link to the repository's benchmarks/; a wheel holds copies of its JSON
# (setup.cfg package_data), so the projection works outside the checkout too.
BENCH_DIR = Path(str(resources.files(__package__) / "benchmarks"))


class ProjectionError(ValueError):
    """Bad input to the projection: the message names the file, key or value."""


def benchmark_dir() -> Path:
    return BENCH_DIR


def benchmark_path(name: str) -> Path:
    """`name` is a file name in benchmarks/ ("moe_h200.json")."""
    return benchmark_dir() / name


def load_benchmark(name: str) -> dict:
    """The parsed file (shared between callers: read it, never change it)."""
    return _load(str(benchmark_path(name)))


@lru_cache(maxsize=64)
def _load(path: str) -> dict:
    p = Path(path)
    try:
        d = json.loads(p.read_text())
    except OSError as e:
        raise ProjectionError(f"{p}: cannot read benchmark file: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ProjectionError(f"{p}: not JSON: {e}") from None
    if not isinstance(d, dict) or not any(isinstance(d.get(k), (list, dict)) for k in ("rows", "runs", "metrics")):
        raise ProjectionError(f"{p}: expected a benchmark JSON with 'rows' (bench), 'runs' or 'metrics' (run)")
    return d


def node_files() -> list[str]:
    """Names of `bench node` outputs present (benchmarks/node_<device>.json)."""
    return sorted(p.name for p in benchmark_dir().glob("node_*.json"))
