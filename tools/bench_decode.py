#!/usr/bin/env python
"""Benchmark AR decode on a K2.6-dims slice: stage times vs byte floors, eager vs CUDA graph (same as
`ddtree-rtc bench decode`)."""

from ddtree_rtc.bench.decode import main

if __name__ == "__main__":
    main()
