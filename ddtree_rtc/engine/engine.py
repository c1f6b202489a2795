"""The engine: continuous batching over a paged latent KV cache, decoding autoregressively or by
speculative rounds. It owns decoding: ``step`` reads schedule -> prefill -> decode -> retire, and
what decodes for it (``engine.decode``) is handed the runner, the sampler and the stage clock and
never calls back.

Each step admits what fits and prefills it (every new request's whole prompt in one forward, the
prompts grouped up to ``max_prefill_tokens`` per forward), then decodes every running request: one
token in one forward (``mode='autoregressive'``, ``decode.autoregressive``), or one DDTree / chain
round (``decode.round``) that emits 1 .. depth + 1 tokens per request. Prefill and decode rows never
share a forward.

With the model's ``batch_invariant`` and ``small_m_path`` on (the defaults; ``Engine.invariant``) a
forward's composition never depends on the load, so a request's tokens do not either
(docs/architecture.md, "The small-M path"): each prompt is prefilled alone, in one forward of its own
length, and the running requests decode in groups of at most 64 rows (``SMALL_M_MAX_TOKENS``: an AR
step takes 1 row per request, a fixed-budget round 1 + budget; ``decoder.min_rows``), one forward
(AR) or one round each, so every decode and verify forward stays on the row-invariant small-M path.
With ``decode.budget: auto`` a request takes 1 row at least, so a group holds up to 64 requests and
its policy shares the 64 verify rows among them (``AutoBudget.max_rows``; ``decode.auto_rows: any`` lifts
that cap, the general kernels then verifying past 64 rows where the costs say it pays). The only host sync per step is
reading the chosen tokens. Every forward goes through the model runner (``engine.runner``); with
``cuda_graphs`` (CUDA backend) the decode forward of each batch size and the verify forward of each
(batch, rows) the decoder can choose are captured once, when the engine starts (``capture_graphs``:
no step stalls on a capture), and replayed. Per-stage wall time is accumulated by name on the
engine's StageClock (``stats.stage_seconds``; with a device sync around each stage when ``profile``
is on).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field

import numpy as np

from ..model.target import SMALL_M_MAX_TOKENS, TargetModel
from .clock import StageClock
from .decode.autoregressive import AutoregressiveDecode, prefill_tokens
from .decode.round import SpeculativeRound
from .kv_cache import PageAllocator, PagedKVCache
from .request import Request, RequestError
from .runner import ModelRunner
from .sampler import Sampler
from .scheduler import Scheduler

MODES = ("autoregressive", "ddtree", "chain")
GRAPH_MEMORY_SHARE = 0.5  # of the device memory free after the KV cache, the most the start's graphs may hold


@dataclass
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    decode_rounds: int = 0  # request-rounds of decoding (tokens per round = decode_tokens / decode_rounds)
    stage_seconds: dict = field(default_factory=dict)  # the engine's StageClock.seconds


class Engine:
    def __init__(self, model: TargetModel, max_batch: int, page_size: int, max_context: int,
                 num_pages: int | None = None, max_prefill_tokens: int = 4096, seed: int = 0,
                 profile: bool = False, cuda_graphs: bool = False, mode: str = "autoregressive",
                 drafter=None, budget: int | str = 64, max_budget: int = 64, cost=None,
                 budget_choice: str = "lagged", auto_rows: str = "invariant"):
        """``mode``: 'autoregressive', 'ddtree' or 'chain' (the last two need a ``drafter`` from
        ddtree_rtc.speculative.drafters; ``budget``: tree nodes per round, the most any request
        may ask for, or 'auto': chosen per round and request up to ``max_budget`` by the cost
        model ``cost`` (engine.decode.budget.CostModel; None: measured at warm-up, CUDA only));
        ``budget_choice``: auto's counts from the past rounds ('lagged') or the round's own tree ('tree');
        ``auto_rows``: auto's verify within the 64 rows of the row-invariant path when the engine is
        ``invariant`` ('invariant'), or any row bucket, the general kernels' past 64 rows included,
        where the costs say it pays ('any': ids may part from AR at near-ties, as a fixed budget
        over 63's)."""
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
        self.clock = StageClock(self.backend, sync=profile)
        self.stats = EngineStats(stage_seconds=self.clock.seconds)
        self.sampler = Sampler(self.backend, seed, model.shard.world, model=model if model.shard.world > 1 else None)
        self.drafter = drafter
        if drafter is not None:
            drafter.check_target(model.cfg)
        graphs = cuda_graphs and ModelRunner.supports_graphs(self.backend)
        self.runner = ModelRunner(model, self.cache, max_context, graphs=graphs,
                                  hidden_layers=() if drafter is None else drafter.target_layer_ids)
        self.graphs = self.runner if graphs else None
        self.round = None
        auto = None
        if budget == "auto":
            auto = self._auto_budget(mode, drafter, max_budget, cost, graphs, budget_choice, auto_rows)
            budget = max_budget
        elif not isinstance(budget, (int, np.integer)):
            raise ValueError(f"decode.budget must be a node count or 'auto', got {budget!r}")
        if drafter is not None:
            drafter.attach(self.pages)
            self.round = SpeculativeRound(model, self.cache, self.pages, self.runner, drafter, mode, budget,
                                          self.sampler, self.clock, auto=auto)
        self.decoder = self.round or AutoregressiveDecode(self.runner, self.sampler, self.clock)
        if self.invariant and auto is not None and auto.max_rows is None:
            warnings.warn(f"decode.auto_rows 'any': a verify over the {SMALL_M_MAX_TOKENS} rows of the row-invariant "
                          f"path runs the general kernels, so on a GPU auto's ids may part from autoregressive "
                          f"decoding at near-ties (as a fixed budget over {SMALL_M_MAX_TOKENS - 1}'s do)", stacklevel=2)
        elif self.invariant and not self.verify_invariant:
            warnings.warn(f"decode.budget {self.decoder.min_rows - 1}: one request's verify ({self.decoder.min_rows} "
                          f"rows) is over the {SMALL_M_MAX_TOKENS} rows of the row-invariant path, so on a GPU its ids "
                          f"may part from autoregressive decoding at near-ties, and each request verifies in a round "
                          f"of its own; a budget of at most {SMALL_M_MAX_TOKENS - 1}, or 'auto', keeps both",
                          stacklevel=2)
        self.scheduler = Scheduler(max_batch, self.pages, tail=self.decoder.tail)
        self.warm_up = self.capture_graphs() if graphs else None

    def graph_shapes(self) -> list[tuple]:
        """The runner's shape keys that decoding can reach: every decode group size (1 up to
        ``max_batch``, invariant at most a group's ``SMALL_M_MAX_TOKENS // decoder.min_rows``) with
        each shape the decoder may verify (or decode) at that size (``decoder.shapes``)."""
        group = self.scheduler.max_batch
        if self.invariant:
            group = min(group, max(1, SMALL_M_MAX_TOKENS // self.decoder.min_rows))
        return [key for b in range(1, group + 1) for key in self.decoder.shapes(b)]

    def capture_graphs(self, max_bytes: int | None = None) -> dict:
        """Capture every graph decoding can reach (``graph_shapes``, each output kind the sampler
        asks for) now, at the engine's start, so no step stalls on a capture. The graphs' pools may
        take ``max_bytes`` (default: GRAPH_MEMORY_SHARE of the device memory free now); the shapes
        past that (a warning says how many) are captured at their first use. Prefill stays eager.
        Returns what it did: graphs captured, shapes left, their pools' bytes, seconds."""
        if self.pages.num_free_pages != self.pages.num_pages:
            raise RuntimeError("capture_graphs runs before any request holds a page (it writes page 0)")
        if max_bytes is None and self.backend.is_cuda:
            import cupy

            free = int(cupy.cuda.runtime.memGetInfo()[0])
            if self.model.shard.world > 1:
                # every rank must capture the same shapes (a capture runs the collectives, and the
                # ranks' shapes hold the same bytes): the least free memory of any rank bounds them all
                be = self.backend
                free = int(be.to_host(self.model.comm.all_gather(be.asarray(np.array([free], np.int64)))).min())
            max_bytes = int(GRAPH_MEMORY_SHARE * free)
        t0, before = time.perf_counter(), self.runner.captures
        left = self.runner.capture(self.graph_shapes(), self.sampler.outputs(), max_bytes)
        if left:
            warnings.warn(f"cuda_graphs: {len(left)} verify / decode shapes not captured at the start (their "
                          f"pools would pass {max_bytes} bytes); they are captured at their first use", stacklevel=2)
        return {"graphs": self.runner.captures - before, "left": len(left), "bytes": self.runner.graph_bytes(),
                "seconds": time.perf_counter() - t0}

    def _auto_budget(self, mode: str, drafter, max_budget: int, cost, graphs: bool, choice: str, rows: str):
        from .decode.budget import AutoBudget, BudgetError

        if mode != "ddtree":
            raise BudgetError(f"decode.budget auto needs mode 'ddtree' (chain is one of the trees it chooses "
                              f"from), got mode {mode!r}")
        if choice not in ("lagged", "tree"):
            raise BudgetError(f"decode.budget_choice must be 'lagged' or 'tree', got {choice!r}")
        if rows not in ("invariant", "any"):
            raise BudgetError(f"decode.auto_rows must be 'invariant' or 'any', got {rows!r}")
        capped = self.invariant and rows == "invariant"
        if cost is None and self.model.shard.world > 1 and self.model.comm.name != "simulated":
            raise BudgetError("decode.budget auto on several ranks needs decode.cost_table: timings measured on "
                              "each rank differ, and every rank must choose the same trees (a simulated rank, "
                              "alone, may measure)")
        if cost is None and not self.backend.is_cuda:
            raise BudgetError("decode.budget auto on the numpy backend needs decode.cost_table (a verify cost "
                              "table, engine/decode/budget.py): only the CUDA backend measures one at warm-up")
        # with CUDA graphs a verify shape is a captured graph: a few row buckets; eagerly any row count is one.
        # Invariant, a round's verify holds at most SMALL_M_MAX_TOKENS rows (the module doc), unless auto_rows lifts it
        return AutoBudget(max_budget, drafter.depth, cost, bucketed=graphs,
                          max_rows=SMALL_M_MAX_TOKENS if capped else None, lagged=choice == "lagged")

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

    def cancel(self, rid) -> bool:
        """Drop a waiting or running request and free its pages; False if it is not here."""
        req = self.scheduler.cancel(rid)
        if req is not None and self.drafter is not None:
            self.drafter.release(rid)
            self.round.release(rid)
        return req is not None

    # -- what a server loop reads ---------------------------------------------------------------
    def has_work(self) -> bool:
        """Requests waiting or running."""
        return self.scheduler.has_work()

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def pages_in_use(self) -> int:
        """KV pages held by requests now (the target's cache and any drafter cache share them)."""
        return self.pages.num_pages - self.pages.num_free_pages

    def running_requests(self) -> list[Request]:
        """The requests being decoded (a new list: cancelling one while iterating is safe)."""
        return list(self.scheduler.running)

    @property
    def budget_stats(self):
        """decode.budget auto's BudgetStats (engine.decode.budget), or None with a fixed budget."""
        return None if self.round is None or self.round.auto is None else self.round.auto.stats

    def take_finished(self) -> list[Request]:
        """The requests finished since the last call (or since the start), handed over once."""
        done, self.scheduler.finished = self.scheduler.finished, []
        return done

    def step(self) -> list[Request]:
        """One scheduling step; returns the requests that finished in it."""
        eos = self.model.cfg.eos_token_id
        work = self.scheduler.schedule()
        for r in work.prefill:
            self.pages.reserve(r.rid, len(r.prompt) + (r.max_new_tokens if self.round is None else 0))
        for chunk in self._prefill_chunks(work.prefill):
            self._prefill(chunk, eos)
        live = [r for r in work.decode if r.finish is None]
        if live:
            before = sum(len(r.output) for r in live)
            for group in self._decode_groups(live):
                self.decoder.run(group, eos)
            self.stats.decode_tokens += sum(len(r.output) for r in live) - before
        self.stats.decode_rounds += len(live)
        self.stats.steps += 1
        return self._retire()

    @property
    def invariant(self) -> bool:
        """Whether forwards are composed independently of the load (the module doc): the model's
        ``batch_invariant`` with its ``small_m_path`` (row invariance holds only on that path)."""
        return self.model.batch_invariant and self.model.small_m_path

    @property
    def verify_invariant(self) -> bool:
        """Whether a request's decode or verify forward stays on the row-invariant path (``invariant``
        and its ``decoder.min_rows`` within ``SMALL_M_MAX_TOKENS``, auto's rows capped there): its ids
        then equal autoregressive decoding's by construction on a GPU."""
        auto = None if self.round is None else self.round.auto
        return (self.invariant and self.decoder.min_rows <= SMALL_M_MAX_TOKENS
                and (auto is None or auto.max_rows is not None))

    def _prefill_chunks(self, reqs: list[Request]):
        """Whole prompts in order: one per forward when ``invariant`` (a prompt's rows, logits and KV
        rows then depend on that prompt only), else as many per forward as fit
        ``max_prefill_tokens`` (at least one)."""
        if self.invariant:
            yield from ([r] for r in reqs)
            return
        chunk: list[Request] = []
        for r in reqs:
            if chunk and sum(len(c.prompt) for c in chunk) + len(r.prompt) > self.max_prefill_tokens:
                yield chunk
                chunk = []
            chunk.append(r)
        if chunk:
            yield chunk

    def _decode_groups(self, reqs: list[Request]):
        """The running requests in order, as the decoder's forwards take them: all together, or when
        ``invariant`` in groups of at most SMALL_M_MAX_TOKENS rows (``decoder.min_rows`` rows per
        request; one request per group where a request alone takes more)."""
        if not self.invariant:
            yield reqs
            return
        size = max(1, SMALL_M_MAX_TOKENS // self.decoder.min_rows)
        for i in range(0, len(reqs), size):
            yield reqs[i:i + size]

    def _prefill(self, chunk: list[Request], eos) -> None:
        layers = self.drafter.target_layer_ids if self.drafter is not None else ()
        toks, hidden = prefill_tokens(self.runner, self.sampler, self.clock, chunk, layers)
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

    def _retire(self) -> list[Request]:
        done = self.scheduler.retire()
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
