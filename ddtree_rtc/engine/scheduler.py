"""Continuous batching: admit waiting requests while there is room (a batch slot, and KV pages for
the request's whole worst case promised up front by the run's one PageAllocator, so nothing is ever
preempted), prefill them, decode all running ones together, retire finished ones and free their
pages. The worst case is prompt + max_new_tokens plus the verify tail a speculative round writes
past the committed prefix (``tail`` = 1 + budget rows; 0 for autoregressive decoding)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .kv_cache import PageAllocator
from .request import Request


@dataclass
class Step:
    prefill: list[Request]
    decode: list[Request]


class Scheduler:
    def __init__(self, max_batch: int, pages: PageAllocator, tail=lambda req: 0):
        if max_batch < 1:
            raise ValueError(f"max_batch (concurrency) must be >= 1, got {max_batch}")
        self.max_batch, self.pages, self.tail = max_batch, pages, tail
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []

    def need(self, req: Request) -> int:
        """Positions the request may ever hold in the cache."""
        return len(req.prompt) + req.max_new_tokens + self.tail(req)

    def submit(self, req: Request) -> None:
        if self.pages.pages_for(self.need(req)) > self.pages.num_pages:
            raise ValueError(f"request {req.rid} needs more KV pages than the whole cache holds")
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Step:
        """Admit what fits (first come, first served), then return this step's work."""
        admitted = []
        while self.waiting and len(self.running) + len(admitted) < self.max_batch:
            req = self.waiting[0]
            if not self.pages.can_promise(self.need(req)):
                break
            self.waiting.popleft()
            self.pages.promise(req.rid, self.need(req))
            admitted.append(req)
        decode = list(self.running)
        self.running.extend(admitted)
        return Step(prefill=admitted, decode=decode)

    def cancel(self, rid) -> Request | None:
        """Take a waiting or running request out (its pages are freed); None if unknown."""
        for queue in (self.waiting, self.running):
            for r in queue:
                if r.rid == rid:
                    queue.remove(r)
                    self.pages.free(rid)
                    return r
        return None

    def retire(self) -> list[Request]:
        """Move finished requests out and free their pages."""
        done = [r for r in self.running if r.finish is not None]
        for r in done:
            self.pages.free(r.rid)
        self.running = [r for r in self.running if r.finish is None]
        self.finished.extend(done)
        return done
