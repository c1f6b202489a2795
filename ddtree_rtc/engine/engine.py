"""The autoregressive engine: continuous batching over a paged latent KV cache.

Each step admits what fits (prefill: every new request's whole prompt in one forward, chunked by
``max_prefill_tokens``), then decodes one token for every running request in one forward. The
only host sync per step is reading the chosen tokens. With ``cuda_graphs`` (CUDA backend) the decode
forward of each batch size is captured once and replayed (``engine.cuda_graph``). Per-stage wall
time is accumulated in ``stats`` (with a device sync around each stage when ``profile`` is on).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from ..model.target import ForwardBatch, TargetModel
from .cuda_graph import DecodeGraphs
from .kv_cache import PagedKVCache
from .request import Request
from .scheduler import PageBudget, Scheduler


@dataclass
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    stage_seconds: dict = field(default_factory=lambda: defaultdict(float))


class Engine:
    def __init__(self, model: TargetModel, max_batch: int, page_size: int, max_context: int,
                 num_pages: int | None = None, max_prefill_tokens: int = 4096, seed: int = 0,
                 profile: bool = False, cuda_graphs: bool = False):
        self.model, self.backend = model, model.backend
        self.max_context, self.max_prefill_tokens, self.seed = max_context, max_prefill_tokens, seed
        pages_per_seq = -(-max_context // page_size)
        num_pages = num_pages or max_batch * pages_per_seq
        self.cache = PagedKVCache(self.backend, model.num_layers, num_pages, page_size, model.dims.row)
        self.scheduler = Scheduler(max_batch, PageBudget(num_pages, page_size))
        self.profile = profile
        self.stats = EngineStats()
        self.graphs = DecodeGraphs(model, self.cache, max_context) if cuda_graphs and self.backend.is_cuda else None

    def _timed(self, stage: str, fn, *args, **kw):
        if self.profile:
            self.backend.synchronize()
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        if self.profile:
            self.backend.synchronize()
        self.stats.stage_seconds[stage] += time.perf_counter() - t0
        return out

    def submit(self, req: Request) -> None:
        cfg = self.model.cfg
        req.validate(cfg.vocab_size, self.max_context)
        req.t_arrive = time.perf_counter()
        self.scheduler.submit(req)

    def _choose(self, logits, reqs: list[Request]) -> np.ndarray:
        be = self.backend
        temps = np.array([r.temperature for r in reqs], dtype=np.float32)
        if not temps.any():
            return be.to_host(be.argmax(logits))
        top_p = np.array([r.top_p for r in reqs], dtype=np.float32)
        return be.to_host(be.sample(logits, temps, top_p, self.seed, offset=self.stats.steps))

    def _forward(self, stage: str, reqs: list[Request], ctx: list[int], new: list[list[int]]):
        batch = ForwardBatch.causal([r.rid for r in reqs], ctx, new)
        if stage == "decode" and self.graphs is not None:
            logits = self._timed(stage, self.graphs.forward, batch)
        else:
            logits = self._timed(stage, self.model.forward, batch, self.cache, output="logits").logits
        return self._timed("sample", self._choose, logits, reqs)

    def step(self) -> list[Request]:
        """One scheduling step; returns the requests that finished in it."""
        sched, eos = self.scheduler, self.model.cfg.eos_token_id
        work = sched.schedule()
        for r in work.prefill:
            self.cache.reserve(r.rid, len(r.prompt) + r.max_new_tokens)
        # prefill in chunks of whole prompts
        chunk: list[Request] = []
        for r in work.prefill + [None]:
            if r is not None and (not chunk or sum(len(c.prompt) for c in chunk) + len(r.prompt)
                                  <= self.max_prefill_tokens):
                chunk.append(r)
                continue
            if chunk:
                toks = self._forward("prefill", chunk, [0] * len(chunk), [c.prompt for c in chunk])
                now = time.perf_counter()
                for c, t in zip(chunk, toks):
                    c.t_first = now
                    c.append(int(t), eos)
                self.stats.prefill_tokens += sum(len(c.prompt) for c in chunk)
            chunk = [r] if r is not None else []
        live = [r for r in work.decode if r.finish is None]
        if live:
            toks = self._forward("decode", live, [r.length - 1 for r in live], [[r.output[-1]] for r in live])
            for r, t in zip(live, toks):
                r.append(int(t), eos)
            self.stats.decode_tokens += len(live)
        self.stats.steps += 1
        done = sched.retire()
        now = time.perf_counter()
        for r in done:
            r.t_done = now
            self.cache.free(r.rid)
        return done

    def run(self, requests: list[Request], progress=None) -> list[Request]:
        """Submit ``requests`` and step until all are finished; ``progress(n_done)`` per finish."""
        for r in requests:
            self.submit(r)
        while self.scheduler.has_work():
            done = self.step()
            if progress is not None and done:
                progress(len(done))
        return sorted(self.scheduler.finished, key=lambda r: r.rid)
