"""Serving on several ranks (``ddtree-rtc serve PIPELINE --nproc N``, or N ranks from torchrun /
mpirun / srun): rank 0 holds the HTTP server, every rank runs the same engine loop in lockstep.

Rank 0's serve loop (serve/loop.py, unchanged) drives a ``LockstepEngine``: each admitted request
(with its sampling parameters), each cancellation and each step goes to the followers over the
control channel (ddtree_rtc.parallel.lockstep) before rank 0 applies it, and every follower applies the
same sequence to its own engine (``follow``), so the collectives inside a step meet and every rank
holds the same requests and pages. Continuous batching, streaming, /metrics, 429 and 400 are rank
0's loop as on one rank; a client that goes away is cancelled on every rank.

A rank that dies or hangs takes the server down loudly: rank 0 notices within ``deadline`` seconds
(a closed or silent control connection, or a collective that times out), every in-flight request
gets a 503 whose OpenAI error body names the rank and its last error, new requests get the same 503,
and the server exits non-zero with that line in its log. Followers exit when rank 0 goes away.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
import time
import traceback

from ..engine.request import Request
from ..parallel.comm import DistError

log = logging.getLogger("ddtree_rtc.serve")

_REQUEST_FIELDS = ("rid", "prompt", "max_new_tokens", "temperature", "top_p", "stop_ids", "seed", "budget")


class RankDown(BaseException):
    """A peer rank failed: the server goes down. A BaseException so the serve loop's per-step error
    handling (which fails one step's requests and serves on) does not swallow it."""

    def __init__(self, rank: int | None, text: str):
        self.rank, self.text = rank, text
        super().__init__(f"rank {rank} failed: {text}" if rank is not None else text)


def encode(req: Request) -> dict:
    d = {k: getattr(req, k) for k in _REQUEST_FIELDS}
    d["stop_ids"] = list(d["stop_ids"])
    return d


def decode(d: dict) -> Request:
    return Request(**{**d, "stop_ids": tuple(d["stop_ids"])})


class RankState:
    """The first failure of a peer (recorded once; listeners hear of it once)."""

    def __init__(self):
        self.failure: RankDown | None = None
        self._lock = threading.Lock()
        self._listeners: list = []

    def on_failure(self, fn) -> None:
        self._listeners.append(fn)

    def fail(self, rank: int | None, text: str) -> RankDown:
        with self._lock:
            first = self.failure is None
            if first:
                self.failure = RankDown(rank, text)
        if first:
            log.error("%s; the server goes down", self.failure)
            for fn in self._listeners:
                fn(self.failure)
        return self.failure


class LockstepEngine:
    """Rank 0's engine as the serve loop sees it: ``submit``, ``cancel`` and ``step`` are sent to
    every follower first (in order), then run here; the rest are rank 0's reads."""

    def __init__(self, engine, leader, state: RankState):
        self.engine, self.leader, self.state = engine, leader, state
        self.loop = None  # the EngineLoop, to fail its clients from its own thread (attach_loop)
        self.steps = 0

    def attach_loop(self, loop) -> None:
        self.loop = loop

    # What the serve loop and the app read of rank 0's engine, named one by one (no dispatch by
    # name): reads, and take_finished, which hands over rank 0's own bookkeeping. A method that changed
    # this rank's engine alone would put the ranks out of step, so such a method is added below only
    # with its broadcast (submit, cancel, step) and its replay in ``follow``.
    @property
    def model(self):
        return self.engine.model

    @property
    def pages(self):
        return self.engine.pages

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    @property
    def context_limit(self) -> int:
        return self.engine.context_limit

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    @property
    def pages_in_use(self) -> int:
        return self.engine.pages_in_use

    @property
    def budget_stats(self):
        return self.engine.budget_stats

    def has_work(self) -> bool:
        return self.engine.has_work()

    def running_requests(self):
        return self.engine.running_requests()

    def take_finished(self):
        return self.engine.take_finished()

    def _check(self) -> None:
        if self.state.failure is not None:
            self._fail_clients(self.state.failure)
            raise self.state.failure

    def submit(self, req: Request) -> None:
        self._check()
        self.engine.submit(req)  # raises (a 400) before any follower hears of it
        self.leader.broadcast({"op": "submit", "req": encode(req)})

    def cancel(self, rid) -> bool:
        found = self.engine.cancel(rid)
        if found:
            self.leader.broadcast({"op": "cancel", "rid": rid})
        return found

    def step(self):
        self._check()
        self.steps += 1
        self.leader.broadcast({"op": "step", "n": self.steps})
        try:
            return self.engine.step()
        except DistError as e:
            deadline = time.monotonic() + 1.0  # a dead peer's closed connection names it at once
            while self.state.failure is None and time.monotonic() < deadline:
                time.sleep(0.02)
            if self.state.failure is None:
                found = re.search(r"rank\(s\) \[(\d+)", str(e))
                self.state.fail(int(found.group(1)) if found else None, f"a collective failed: {e}")
            self._check()
            raise

    def _fail_clients(self, down: RankDown) -> None:
        """Every client of the loop gets a 503 naming the rank (called from the loop's thread)."""
        loop = self.loop
        if loop is None:
            return
        loop.error = down
        for rid in list(loop._clients):  # noqa: SLF001 - the loop's thread, between its own steps
            loop._send(rid, ("error", (503, str(down))))  # noqa: SLF001
            loop._release(rid)  # noqa: SLF001


def follow(engine, follower, rank: int) -> int:
    """A follower's engine loop: apply rank 0's messages in order until it says stop; returns the
    exit code (non-zero when rank 0 went down after a failure). Raises DistError when rank 0 goes
    away, after reporting this rank's error to it."""
    try:
        for msg in follower.messages():
            op = msg["op"]
            if op == "submit":
                engine.submit(decode(msg["req"]))
            elif op == "cancel":
                engine.cancel(msg["rid"])
            elif op == "step":
                try:
                    engine.step()
                except DistError:
                    raise
                except Exception:  # noqa: BLE001 - rank 0's step raised too: it cancels the step's requests
                    log.exception("rank %d: engine step %d failed", rank, msg["n"])
                engine.take_finished()
            elif op == "stop":
                return 1 if msg.get("failed") else 0
            follower.pages_used = int(engine.pages_in_use)
        return 0
    except BaseException as e:
        follower.report(f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}")
        raise


def _exit_later(seconds: float, code: int) -> None:
    t = threading.Timer(seconds, os._exit, (code,))
    t.daemon = True  # a clean exit before it fires is not held up
    t.start()


def serve_ranks(pipe, host: str, port: int, max_queue: int, deadline: float,
                read_timeout_s: float | None = None) -> int:
    """This rank's part of a multi-rank server: rank 0 serves HTTP on ``host:port`` until stopped or
    until a peer fails (then it returns 1); the others follow rank 0. Returns the exit code."""
    import sys

    import uvicorn
    from prometheus_client import Gauge

    from ..parallel.comm import timeout_s
    from ..parallel.lockstep import Follower, Leader
    from ..pipeline.runner import build_engine, ranks_for
    from .server import READ_TIMEOUT_S, app_for, uvicorn_config, warn_oracle

    ranks = ranks_for(pipe)
    env, comm = ranks.env, ranks.comm
    try:
        engine, info = build_engine(pipe, max_batch=pipe.runtime.max_batch, ranks=ranks)
        if hasattr(comm, "timeout"):  # the local transport: a collective waits at most the deadline
            comm.timeout = deadline
        if not env.is_main:
            # a SIGTERM that stops the whole job reaches rank 0 too, which then sends "stop": wait for
            # it a moment so a clean shutdown is not taken for this rank's failure
            signal.signal(signal.SIGTERM, lambda signum, frame: _exit_later(min(deadline / 2, 2.0), 128 + signum))
            follower = Follower(env, deadline, timeout_s())
            try:
                return follow(engine, follower, env.rank)
            finally:
                follower.close()
        state = RankState()
        if hasattr(comm, "abort"):  # a collective waiting on a peer known dead ends at once
            comm.abort = lambda: None if state.failure is None else str(state.failure)
        leader = Leader(env, deadline, timeout_s(), state.fail)
        lockstep = LockstepEngine(engine, leader, state)
        warn_oracle(pipe)
        app = app_for(pipe, lockstep, info, max_queue)
        loop = app.state.loop
        lockstep.attach_loop(loop)
        pages = Gauge("ddtree_rank_kv_pages_used", "KV pages in use on each follower rank (its last heartbeat)",
                      ["rank"], registry=loop.metrics.registry)
        for r in range(1, env.world_size):
            pages.labels(str(r)).set_function(lambda r=r: leader.pages_used.get(r, 0))
        sent = Gauge("ddtree_collective_bytes", "bytes rank 0 handed to collectives, by kind (no logits: "
                     "sampling and the drafter's top-k exchange (value, id) pairs)", ["kind"],
                     registry=loop.metrics.registry)
        for kind in ("all_reduce", "all_gather", "broadcast"):
            sent.labels(kind).set_function(lambda kind=kind: engine.model.comm.stats.bytes.get(kind, 0))
        read_s = READ_TIMEOUT_S if read_timeout_s is None else read_timeout_s
        config = uvicorn_config(app, host, port, max_queue, read_s)
        config.timeout_graceful_shutdown = int(deadline) + 5  # in-flight requests hear of a failed rank
        server = uvicorn.Server(config)

        def down(err: RankDown) -> None:
            loop.error = err  # new requests: 503 naming the rank
            loop._inbox.put(("wake", None))  # noqa: SLF001 - the loop meets the failure at its next step
            server.should_exit = True

        state.on_failure(down)
        # uvicorn re-raises the SIGTERM that stopped it once it has shut down; handled here, the
        # followers still get their stop message and the transport is freed below
        signal.signal(signal.SIGTERM, lambda signum, frame: None)
        try:
            server.run()
        finally:
            leader.close(failed=state.failure is not None)
        if state.failure is not None:
            print(f"ddtree-rtc serve: {state.failure}", file=sys.stderr)
            return 1
        return 0
    finally:
        comm.close()
