#!/usr/bin/env python
"""Benchmark the building-block kernels at K2.6 dims (same as `ddtree-rtc bench blocks`)."""

from ddtree_rtc.bench.blocks import main

if __name__ == "__main__":
    main()
