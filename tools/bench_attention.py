#!/usr/bin/env python
"""Benchmark MLA attention: decode and tree verify over the paged latent cache (same as
`ddtree-rtc bench attention`)."""

from ddtree_rtc.bench.attention import main

if __name__ == "__main__":
    main()
