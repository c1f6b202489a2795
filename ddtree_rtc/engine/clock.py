"""Per-stage wall time of the engine's decoding, by stage name.

The engine owns one ``StageClock`` and hands it to whatever decodes for it; a stage is timed where
it runs (``clock.time("verify", runner.verify, step)``), so nothing calls back into the engine to be
timed. With ``sync`` the device is synchronized before and after each stage, so a stage's time is
its own and not the queue's (the pipeline's profiled runs); without it a stage's time is what the
host spent enqueuing it, plus any sync it makes itself.
"""

from __future__ import annotations

import time
from collections import defaultdict


class StageClock:
    def __init__(self, backend, sync: bool = False):
        self.backend, self.sync = backend, sync
        self.seconds: dict[str, float] = defaultdict(float)

    def time(self, stage: str, fn, *args, **kw):
        """``fn(*args, **kw)``, its wall time added to ``seconds[stage]``; returns what it returns."""
        if self.sync:
            self.backend.synchronize()
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        if self.sync:
            self.backend.synchronize()
        self.seconds[stage] += time.perf_counter() - t0
        return out
