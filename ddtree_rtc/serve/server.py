"""Build the app from a pipeline (the engine exactly as ``ddtree-rtc run`` builds it) and run uvicorn
with limits a hostile or broken client cannot outlast:

- a request's headers and body must arrive within ``read_timeout_s`` of the connection opening (the
  first request) or of the request's first byte (later ones): a slow-loris client that trickles a
  request in, or opens connections and sends nothing, is dropped, its connection closed (uvicorn
  has no such timeout of its own, hence ``BoundedH11``);
- an idle keep-alive connection is closed after ``KEEP_ALIVE_S`` s (uvicorn's own timer);
- past ``limit_concurrency`` connections new requests get 503 at once.
"""

from __future__ import annotations

from contextlib import contextmanager

import click

from ..model.tokenizer import TokenizerError
from ..pipeline.runner import ORACLE_SERVE_CACHE, build_engine
from ..pipeline.schema import PipelineError
from .app import create_app
from .text import Text

READ_TIMEOUT_S = 10.0  # headers + body of one request
KEEP_ALIVE_S = 5
# connections beyond the request queue: streams that are finishing, /health and /metrics probes
EXTRA_CONNECTIONS = 64


def warn_oracle(pipe) -> None:
    d = pipe.decode
    if d.mode != "autoregressive" and d.drafter is not None and d.drafter.kind == "oracle":
        new = pipe.workload.synthetic.output_len if pipe.workload.synthetic else pipe.workload.max_new_tokens
        click.echo(f"warning: decode.drafter.kind oracle is a measuring tool, not a drafter to serve with: each "
                   f"new distinct prompt is first decoded greedily by the target inside the engine thread (every "
                   f"client waits meanwhile), only {new + d.drafter.depth} tokens are known ahead (past them tau "
                   f"falls to about 1), and only the {ORACLE_SERVE_CACHE} most recent prompts' continuations are "
                   f"kept (README, 'Serving')", err=True)


def app_for(pipe, engine, info: dict, max_queue: int = 256):
    """The app over ``engine``: one rank's, or rank 0's lockstep engine (serve/ranks.py)."""
    name = pipe.model.preset if pipe.model.path is None else str(info["dir"].name)
    try:
        text = Text(info["dir"], preset=pipe.model.path is None)
    except TokenizerError as e:
        raise PipelineError(f"{pipe.source}: {e}") from None
    return create_app(engine, text, name, pipe.decode, max_queue=max_queue)


def app_from_pipeline(pipe, max_queue: int = 256):
    """One rank's app (runtime.tensor_parallel 1; several ranks: ``serve``, serve/ranks.py)."""
    if pipe.runtime.tensor_parallel != 1:
        raise PipelineError(f"{pipe.source}: app_from_pipeline builds a one-rank server; runtime.tensor_parallel "
                            f"{pipe.runtime.tensor_parallel} is served by `ddtree-rtc serve --nproc N`")
    warn_oracle(pipe)
    engine, info = build_engine(pipe, max_batch=pipe.runtime.max_batch)
    return app_for(pipe, engine, info, max_queue)


def bounded_h11():
    """uvicorn's h11 protocol with a deadline on reading each request (headers and body)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class BoundedH11(H11Protocol):
        read_timeout_s = READ_TIMEOUT_S

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._read_deadline = None
            self._arm_read_deadline()

        def _arm_read_deadline(self) -> None:
            self._disarm_read_deadline()
            self._read_deadline = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

        def _disarm_read_deadline(self) -> None:
            if self._read_deadline is not None:
                self._read_deadline.cancel()
                self._read_deadline = None

        def _read_timed_out(self) -> None:
            self._read_deadline = None
            if self.conn.their_state is h11.DONE or self.transport.is_closing():
                return
            self.logger.warning("dropping %s: request not read within %.1f s", self.client, self.read_timeout_s)
            self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._read_deadline is None and self.conn.their_state is h11.IDLE:
                self._arm_read_deadline()  # the first bytes of the next request on this connection
            super().data_received(data)

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR):
                self._disarm_read_deadline()

        def connection_lost(self, exc) -> None:
            self._disarm_read_deadline()
            super().connection_lost(exc)

    return BoundedH11


def uvicorn_config(app, host: str, port: int, max_queue: int = 256, read_timeout_s: float = READ_TIMEOUT_S,
                   log_level: str = "info"):
    """uvicorn's config for ``app`` with the limits in this module's docstring."""
    import uvicorn

    http = bounded_h11()
    http.read_timeout_s = read_timeout_s
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=http,
                          timeout_keep_alive=KEEP_ALIVE_S, limit_concurrency=max_queue + EXTRA_CONNECTIONS,
                          h11_max_incomplete_event_size=64 * 1024)


def serve(pipe, host: str, port: int, max_queue: int = 256, read_timeout_s: float = READ_TIMEOUT_S) -> None:
    """One rank's server, until stopped (several ranks: serve/ranks.py, ``serve_ranks``)."""
    import uvicorn

    app = app_from_pipeline(pipe, max_queue)
    uvicorn.Server(uvicorn_config(app, host, port, max_queue, read_timeout_s)).run()


@contextmanager
def running(app, max_queue: int = 256, read_timeout_s: float = READ_TIMEOUT_S):
    """Serve ``app`` with the limits above on 127.0.0.1 (a free port) in a thread, for tests and
    benchmarks; yields its base URL and stops it on exit."""
    import socket
    import threading
    import time

    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, max_queue, read_timeout_s, log_level="warning"))
    th = threading.Thread(target=srv.run, name="ddtree-serve", daemon=True)
    th.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        if not th.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the server on 127.0.0.1:{port} did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        th.join(timeout=30)
