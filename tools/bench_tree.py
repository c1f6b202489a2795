#!/usr/bin/env python
"""Benchmark the DDTree tree step: top-k, tree build and accept vs the host heapq path (same as
`ddtree-rtc bench tree`)."""

from ddtree_rtc.bench.tree import main

if __name__ == "__main__":
    main()
