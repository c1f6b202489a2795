"""Thin CUDA wrappers, one module per ``cuda_src/<family>.cu``: argument checks, launch config,
plan/run. Each public function has a numpy twin of the same signature in ``ddtree_rtc.reference``."""
