"""The engine loop: one thread owns the engine and runs rounds while any client has work.

HTTP handlers never touch the engine: they put submits and cancels on a thread-safe inbox, and
the loop applies them between rounds (continuous batching: requests join and leave between rounds).
After each round every live request's new tokens go to its client's asyncio queue as one event.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..engine.request import Request

log = logging.getLogger("ddtree_rtc.serve")

class Overloaded(Exception):
    pass


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("ddtree_requests", "requests finished, by reason", ["finish"], registry=r)
        self.prompt_tokens = Counter("ddtree_prompt_tokens", "prompt tokens admitted", registry=r)
        self.generated_tokens = Counter("ddtree_generated_tokens", "tokens generated", registry=r)
        self.rounds = Counter("ddtree_rounds", "engine rounds run", registry=r)
        self.step_failures = Counter("ddtree_step_failures", "engine steps that raised (their requests "
                                     "failed, the server served on)", registry=r)
        self.tau = Gauge("ddtree_tau", "mean tokens emitted per running request per round (last round)",
                         registry=r)
        self.queue_depth = Gauge("ddtree_queue_depth", "requests the server holds: queued, waiting or running "
                                 "(read when scraped)", registry=r)
        self.kv_pages_used = Gauge("ddtree_kv_pages_used", "KV-cache pages holding a request's rows (read when "
                                   "scraped)", registry=r)
        self.kv_pages_free = Gauge("ddtree_kv_pages_free", "KV-cache pages free (read when scraped)", registry=r)
        self.latency = Histogram("ddtree_request_latency_seconds", "arrival to last token", registry=r)
        self.ttft = Histogram("ddtree_time_to_first_token_seconds", "arrival to first token", registry=r)
        self.round_time = Histogram("ddtree_round_seconds", "one engine round", registry=r,
                                    buckets=(.001, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5))
        # decode.budget auto (engine/decode/budget.py)
        self._budget_rounds = 0
        self.budget_nodes = Histogram("ddtree_budget_nodes", "tree nodes verified per request-round (budget auto)",
                                      registry=r, buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
        self.tau_predicted = Gauge("ddtree_tau_predicted", "calibrated predicted tokens per drafted request-round, "
                                   "mean so far (budget auto)", registry=r)
        self.tau_measured = Gauge("ddtree_tau_measured", "measured tokens over the same request-rounds "
                                  "(budget auto)", registry=r)
        self.tokens_per_verify_second = Gauge("ddtree_tokens_per_verify_second", "tokens per second of "
                                              "modelled verify (budget auto's cost model)", registry=r)

    def observe_budget(self, stats) -> None:
        """After a step: the auto budget's last round's nodes per request (once per round) and its
        running figures."""
        rounds = stats.drafted_rounds + stats.skipped_drafts
        if rounds == self._budget_rounds:
            return
        self._budget_rounds = rounds
        for n in stats.last_counts:
            self.budget_nodes.observe(n)
        for gauge, value in ((self.tau_predicted, stats.tau_predicted), (self.tau_measured, stats.tau_measured),
                             (self.tokens_per_verify_second, stats.tokens_per_verify_s)):
            if value is not None:
                gauge.set(value)


class EngineLoop:
    def __init__(self, engine, max_queue: int):
        self.engine, self.max_queue = engine, max_queue
        self.metrics = Metrics()
        self._inbox: queue.Queue = queue.Queue()
        self._clients: dict[int, tuple[Request, asyncio.AbstractEventLoop, asyncio.Queue, list[int]]] = {}
        self._lock = threading.Lock()
        self._outstanding = 0
        self._next_rid = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ddtree-engine-loop", daemon=True)
        self.error: BaseException | None = None
        # read at scrape time from the HTTP thread: plain ints the engine thread updates, no lag
        self.metrics.queue_depth.set_function(lambda: self._outstanding)
        self.metrics.kv_pages_free.set_function(lambda: engine.pages.num_free_pages)
        self.metrics.kv_pages_used.set_function(lambda: engine.pages_in_use)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(("wake", None))
        self._thread.join(timeout=30)

    def new_rid(self) -> int:
        with self._lock:
            self._next_rid += 1
            return self._next_rid

    def submit(self, req: Request) -> asyncio.Queue:
        """Queue ``req`` (already validated); its events arrive on the returned queue."""
        with self._lock:
            if self._outstanding >= self.max_queue:
                raise Overloaded(f"the server holds {self._outstanding} requests, its limit (max_queue); "
                                 f"retry later")
            self._outstanding += 1
        events: asyncio.Queue = asyncio.Queue()
        self._inbox.put(("submit", (req, asyncio.get_running_loop(), events)))
        return events

    def cancel(self, rid: int) -> None:
        self._inbox.put(("cancel", rid))

    def _release(self, rid: int) -> None:
        self._clients.pop(rid, None)
        with self._lock:
            self._outstanding -= 1

    def _send(self, rid: int, event) -> None:
        _, aloop, events, _ = self._clients[rid]
        aloop.call_soon_threadsafe(events.put_nowait, event)

    def _apply(self, kind, arg) -> None:
        eng = self.engine
        if kind == "submit":
            req, aloop, events = arg
            self._clients[req.rid] = (req, aloop, events, [0])
            try:
                eng.submit(req)
            except ValueError as e:  # RequestError or a request larger than the whole cache
                self._send(req.rid, ("error", (400, str(e))))
                self._release(req.rid)
                return
            self.metrics.prompt_tokens.inc(len(req.prompt))
        elif kind == "cancel" and arg in self._clients:
            eng.cancel(arg)
            self.metrics.requests.labels("cancelled").inc()
            self._release(arg)

    def _fail_step(self, err: Exception) -> None:
        """A step raised: the requests it held (running or just admitted) are failed with the error
        and dropped from the engine (pages freed); requests still waiting are untouched, and the loop
        keeps serving. Which request of the step caused it cannot be known, so all of them end."""
        eng = self.engine
        log.exception("engine step failed; failing the requests it held and serving on")
        self.metrics.step_failures.inc()
        for req in eng.running_requests():
            eng.cancel(req.rid)
            if req.rid in self._clients:
                self._send(req.rid, ("error", (500, f"request failed inside the engine: {err!r}")))
                self.metrics.requests.labels("error").inc()
                self._release(req.rid)

    def _run(self) -> None:
        eng, m = self.engine, self.metrics
        try:
            while not self._stop.is_set():
                block = not eng.has_work()
                while True:
                    try:
                        kind, arg = self._inbox.get(block=block, timeout=0.5 if block else None)
                    except queue.Empty:
                        break
                    self._apply(kind, arg)
                    block = False
                if not eng.has_work():
                    continue
                running_before = eng.num_running
                t0 = time.perf_counter()
                try:
                    done = {r.rid for r in eng.step()}
                except Exception as e:  # noqa: BLE001 - one step's failure must not stop the server
                    self._fail_step(e)
                    continue
                m.round_time.observe(time.perf_counter() - t0)
                m.rounds.inc()
                if eng.budget_stats is not None:
                    m.observe_budget(eng.budget_stats)
                emitted = 0
                for rid in list(self._clients):
                    req, _, _, sent = self._clients[rid]
                    new = req.output[sent[0]:]
                    if new and sent[0] == 0 and req.t_first is not None:
                        m.ttft.observe(req.t_first - req.t_arrive)
                    sent[0] = len(req.output)
                    emitted += len(new)
                    if rid in done and req.finish.value == "stop":
                        new = new[:-1]  # OpenAI leaves the stop token out of the output
                    if new:
                        self._send(rid, ("tokens", list(new)))
                    if rid in done:
                        m.requests.labels(req.finish.value).inc()
                        m.latency.observe(req.t_done - req.t_arrive)
                        self._send(rid, ("done", req.finish.value))
                        self._release(rid)
                m.generated_tokens.inc(emitted)
                if running_before:
                    m.tau.set(emitted / max(running_before, 1))
                eng.take_finished()
        except BaseException as e:  # the loop is dead: every client hears why, new ones get 503
            self.error = e
            for rid in list(self._clients):
                self._send(rid, ("error", (500, f"engine loop failed: {e!r}")))
            raise
