"""Continuous batching: admit waiting requests while there is room (batch slots and KV pages for
the request's whole budget, reserved up front so nothing is ever preempted), prefill them, decode
all running ones together, retire finished ones and free their pages."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .request import Request


class PageBudget:
    """Counts KV pages: a request holds ceil((prompt + max_new_tokens) / page_size) pages."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages}, {page_size}")
        self.num_pages, self.page_size, self.used = num_pages, page_size, 0

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def fits(self, tokens: int) -> bool:
        return self.used + self.pages_for(tokens) <= self.num_pages


@dataclass
class Step:
    prefill: list[Request]
    decode: list[Request]


class Scheduler:
    def __init__(self, max_batch: int, pages: PageBudget):
        if max_batch < 1:
            raise ValueError(f"max_batch (concurrency) must be >= 1, got {max_batch}")
        self.max_batch, self.pages = max_batch, pages
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self._held: dict[int, int] = {}

    def submit(self, req: Request) -> None:
        if self.pages.pages_for(len(req.prompt) + req.max_new_tokens) > self.pages.num_pages:
            raise ValueError(f"request {req.rid} needs more KV pages than the whole cache holds")
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Step:
        """Admit what fits (first come, first served), then return this step's work."""
        admitted = []
        while self.waiting and len(self.running) + len(admitted) < self.max_batch:
            req = self.waiting[0]
            need = len(req.prompt) + req.max_new_tokens
            if not self.pages.fits(need):
                break
            self.waiting.popleft()
            n = self.pages.pages_for(need)
            self.pages.used += n
            self._held[req.rid] = n
            admitted.append(req)
        decode = list(self.running)
        self.running.extend(admitted)
        return Step(prefill=admitted, decode=decode)

    def retire(self) -> list[Request]:
        """Move finished requests out and free their pages."""
        done = [r for r in self.running if r.finish is not None]
        for r in done:
            self.pages.used -= self._held.pop(r.rid)
        self.running = [r for r in self.running if r.finish is None]
        self.finished.extend(done)
        return done
