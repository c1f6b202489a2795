"""Hardware projection of K2.6 AR and DDTree decoding, built on this repository's measurements (docs/hardware.md)."""
from .data import ProjectionError, benchmark_path
from .platforms import load_platforms

__all__ = ["ProjectionError", "benchmark_path", "load_platforms"]
