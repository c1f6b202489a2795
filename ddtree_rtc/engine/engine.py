"""The engine: continuous batching over a paged latent KV cache, decoding autoregressively or by
speculative rounds.

Each step admits what fits (prefill: every new request's whole prompt in one forward, chunked by
``max_prefill_tokens``), then decodes every running request: one token in one forward
(``mode='autoregressive'``), or one DDTree / chain round (``ddtree_rtc.speculative.round``) that
emits 1 .. depth + 1 tokens per request. The only host sync per step is reading the chosen tokens.
Every forward goes through the model runner (``engine.runner``); with ``cuda_graphs`` (CUDA
backend) the decode forward of each batch size and the verify forward of each (batch, budget) are
captured once and replayed. Per-stage wall
time is accumulated in ``stats`` (with a device sync around each stage when ``profile`` is on).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from ..model.target import ForwardBatch, TargetModel
from ..reference.sampling import position_keys
from .kv_cache import PageAllocator, PagedKVCache
from .request import Request, RequestError
from .runner import ModelRunner
from .scheduler import Scheduler

MODES = ("autoregressive", "ddtree", "chain")


@dataclass
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    decode_rounds: int = 0  # request-rounds of decoding (tokens per round = decode_tokens / decode_rounds)
    stage_seconds: dict = field(default_factory=lambda: defaultdict(float))


class Engine:
    def __init__(self, model: TargetModel, max_batch: int, page_size: int, max_context: int,
                 num_pages: int | None = None, max_prefill_tokens: int = 4096, seed: int = 0,
                 profile: bool = False, cuda_graphs: bool = False, mode: str = "autoregressive",
                 drafter=None, budget: int | str = 64, max_budget: int = 64, cost=None):
        """``mode``: 'autoregressive', 'ddtree' or 'chain' (the last two need a ``drafter`` from
        ddtree_rtc.speculative.drafters; ``budget``: tree nodes per round, the most any request
        may ask for, or 'auto': chosen per round and request up to ``max_budget`` by the cost
        model ``cost`` (engine.decode.budget.CostModel; None: measured at warm-up, CUDA only))."""
        if mode not in MODES:
            raise ValueError(f"decode mode must be one of {', '.join(MODES)}, got {mode!r}")
        if (mode == "autoregressive") != (drafter is None):
            raise ValueError(f"decode mode {mode!r} " + ("takes no drafter" if drafter is not None else
                                                          "needs a drafter (decode.drafter)"))
        self.model, self.backend, self.mode = model, model.backend, mode
        self.max_context, self.max_prefill_tokens, self.seed = max_context, max_prefill_tokens, seed
        pages_per_seq = -(-max_context // page_size)
        num_pages = num_pages or max_batch * pages_per_seq
        self.pages = PageAllocator(num_pages, page_size)
        self.cache = PagedKVCache(self.backend, model.num_layers, num_pages, page_size, model.dims.row, self.pages)
        self.profile = profile
        self.stats = EngineStats()
        self.drafter, self.round = drafter, None
        if drafter is not None:
            drafter.check_target(model.cfg)
        graphs = cuda_graphs and self.backend.is_cuda
        self.runner = ModelRunner(model, self.cache, max_context, graphs=graphs,
                                  hidden_layers=() if drafter is None else drafter.target_layer_ids)
        self.graphs = self.runner if graphs else None
        auto = None
        if budget == "auto":
            auto = self._auto_budget(mode, drafter, max_budget, cost, graphs)
            budget = max_budget
        elif not isinstance(budget, (int, np.integer)):
            raise ValueError(f"decode.budget must be a node count or 'auto', got {budget!r}")
        if drafter is not None:
            from ..speculative.round import SpeculativeRound

            drafter.attach(self.pages)
            self.round = SpeculativeRound(model, self.cache, self.runner, drafter, mode, budget, self._timed,
                                          self.choose, self.output_for, auto=auto)
        self.scheduler = Scheduler(max_batch, self.pages, tail=self.round.tail if self.round else lambda r: 0)

    def _auto_budget(self, mode: str, drafter, max_budget: int, cost, graphs: bool):
        from .decode.budget import AutoBudget, BudgetError, slot_buckets

        if mode != "ddtree":
            raise BudgetError(f"decode.budget auto needs mode 'ddtree' (chain is one of the trees it chooses "
                              f"from), got mode {mode!r}")
        if cost is None and self.model.shard.world > 1 and self.model.comm.name != "simulated":
            raise BudgetError("decode.budget auto on several ranks needs decode.cost_table: timings measured on "
                              "each rank differ, and every rank must choose the same trees (a simulated rank, "
                              "alone, may measure)")
        if cost is None and not self.backend.is_cuda:
            raise BudgetError("decode.budget auto on the numpy backend needs decode.cost_table (a verify cost "
                              "table, engine/decode/budget.py): only the CUDA backend measures one at warm-up")
        # with CUDA graphs a verify shape is a captured graph: a few buckets; eagerly any count is one
        return AutoBudget(max_budget, drafter.depth, cost,
                          buckets=slot_buckets(max_budget) if graphs else range(max_budget + 1))

    def _timed(self, stage: str, fn, *args, **kw):
        if self.profile:
            self.backend.synchronize()
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        if self.profile:
            self.backend.synchronize()
        self.stats.stage_seconds[stage] += time.perf_counter() - t0
        return out

    @property
    def context_limit(self) -> int:
        """The most prompt + generated tokens one request may hold: the max context less the rows a
        speculative round writes past the committed text (its verify tail)."""
        return self.max_context - (self.round.tail(None) if self.round is not None else 0)

    def submit(self, req: Request) -> None:
        cfg = self.model.cfg
        req.validate(cfg.vocab_size, self.max_context)
        if req.seed is None and not isinstance(req.rid, (int, np.integer)):
            raise RequestError(f"request {req.rid!r}: give a seed (sampling streams are keyed by an int id or seed)")
        if self.round is not None:
            self.round.budget_of(req)
            need = self.scheduler.need(req)
            if need > self.max_context:
                raise RequestError(f"request {req.rid}: prompt ({len(req.prompt)}) + max_new_tokens "
                                   f"({req.max_new_tokens}) + the verify tail ({self.round.tail(req)}) = {need} "
                                   f"exceeds the cache's max context {self.max_context}")
        req.t_arrive = time.perf_counter()
        self.scheduler.submit(req)

    def sample_keys(self, reqs: list[Request], positions) -> np.ndarray:
        """uint64 row keys of the draws that give request b its token at ``positions[b]`` (host
        keys, or device keys when ``positions`` is a device array): keyed by (engine seed, the
        request's stream, position), never by batch slot or step, so a request samples the same
        tokens whatever else is in the batch and however many tokens a round emits (a speculative
        round's tree node and the autoregressive step it stands for use one key). The stream is the
        request's own seed, or its id when it has none."""
        # Python ints taken modulo 2**64: any 64-bit seed gives a stream, and no seed overflows.
        streams = np.array([(2 * r.seed + 1 if r.seed is not None else 2 * int(r.rid)) % 2**64 for r in reqs],
                           np.uint64)
        if not hasattr(positions, "__cuda_array_interface__"):
            positions = np.asarray(positions, np.int64)
        return position_keys(self.seed, streams, positions)

    def output_for(self, reqs: list[Request]) -> str:
        """What a forward for ``reqs`` returns: on several ranks, when every request is greedy, the
        argmax merged across the vocabulary slices (no logits gathered); else the logits."""
        if self.model.shard.world > 1 and not any(r.temperature for r in reqs):
            return "argmax"
        return "logits"

    def choose(self, logits, reqs: list[Request], positions):
        """Backend int32 tokens for the rows of ``logits`` (row b: request ``reqs[b]``'s token at
        ``positions[b]``): argmax where the request's temperature is 0, else its seeded sample."""
        be = self.backend
        temps = np.array([r.temperature for r in reqs], dtype=np.float32)
        if not temps.any():
            return be.argmax(logits)
        top_p = np.array([r.top_p for r in reqs], dtype=np.float32)
        keys = self.sample_keys(reqs, positions)  # on the device when positions are
        return be.sample(logits, be.asarray(temps), be.asarray(top_p), self.seed,
                         keys=be.asarray(keys) if isinstance(keys, np.ndarray) else keys)

    def cancel(self, rid) -> bool:
        """Drop a waiting or running request and free its pages; False if it is not here."""
        req = self.scheduler.cancel(rid)
        if req is not None and self.drafter is not None:
            self.drafter.release(rid)
            self.round.release(rid)
        return req is not None

    def _forward(self, stage: str, reqs: list[Request], ctx: list[int], new: list[list[int]]):
        batch = ForwardBatch.causal([r.rid for r in reqs], ctx, new)
        hidden = {}
        output = self.output_for(reqs)
        if stage == "decode":
            logits = self._timed(stage, self.runner.decode, batch, output)
        else:
            layers = self.drafter.target_layer_ids if self.drafter is not None else ()
            out = self._timed(stage, self.runner.prefill, batch, hidden_layers=layers, output=output)
            logits, hidden = out.tokens if output == "argmax" else out.logits, out.hidden
        if output == "argmax":  # already the tokens
            return self._timed("sample", self.backend.to_host, logits), hidden
        positions = [c + len(n) for c, n in zip(ctx, new)]  # where each request's next token goes
        return self._timed("sample", lambda: self.backend.to_host(self.choose(logits, reqs, positions))), hidden

    def step(self) -> list[Request]:
        """One scheduling step; returns the requests that finished in it."""
        sched, eos = self.scheduler, self.model.cfg.eos_token_id
        work = sched.schedule()
        for r in work.prefill:
            self.cache.reserve(r.rid, len(r.prompt) + (r.max_new_tokens if self.round is None else 0))
        # prefill in chunks of whole prompts
        chunk: list[Request] = []
        for r in work.prefill + [None]:
            if r is not None and (not chunk or sum(len(c.prompt) for c in chunk) + len(r.prompt)
                                  <= self.max_prefill_tokens):
                chunk.append(r)
                continue
            if chunk:
                toks, hidden = self._forward("prefill", chunk, [0] * len(chunk), [c.prompt for c in chunk])
                now = time.perf_counter()
                start = 0
                for c, t in zip(chunk, toks):
                    c.t_first = now
                    c.append(int(t), eos)
                    if self.drafter is not None:
                        rows = slice(start, start + len(c.prompt))
                        self.drafter.admit(c.rid, c.prompt, {i: h[rows] for i, h in hidden.items()})
                    start += len(c.prompt)
                self.stats.prefill_tokens += sum(len(c.prompt) for c in chunk)
            chunk = [r] if r is not None else []
        live = [r for r in work.decode if r.finish is None]
        if live and self.round is not None:
            before = sum(len(r.output) for r in live)
            self.round.run(live, eos)
            self.stats.decode_tokens += sum(len(r.output) for r in live) - before
        elif live:
            toks, _ = self._forward("decode", live, [r.length - 1 for r in live], [[r.output[-1]] for r in live])
            for r, t in zip(live, toks):
                r.append(int(t), eos)
            self.stats.decode_tokens += len(live)
        self.stats.decode_rounds += len(live)
        self.stats.steps += 1
        done = sched.retire()
        now = time.perf_counter()
        for r in done:
            r.t_done = now
            if self.drafter is not None:
                self.drafter.release(r.rid)
                self.round.release(r.rid)
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
