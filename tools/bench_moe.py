#!/usr/bin/env python
"""Benchmark the INT4 MoE layer at K2.6 dims and TP8/EP8 shard shapes (same as `ddtree-rtc bench moe`)."""

from ddtree_rtc.bench.moe import main

if __name__ == "__main__":
    main()
