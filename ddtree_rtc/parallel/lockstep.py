"""The control channel of a multi-rank server, and the supervisor behind ``ddtree-rtc serve --nproc N``.

Rank 0 (the leader) sends every other rank (the followers) the engine's inputs in order: admitted
requests, cancellations and "step"; the followers apply them to their own engines, so every rank runs
the same engine loop in lockstep and the collectives inside a step meet. The channel is one TCP
connection per follower to rank 0 (MASTER_ADDR, port DDTREE_RTC_CONTROL_PORT, else MASTER_PORT + 2),
newline-delimited JSON, so it works the same under ``--nproc``, torchrun, mpirun and srun, on the
numpy and the CUDA backend.

It is also how ranks notice each other failing: both sides send a heartbeat every ``deadline / 4``
seconds from a thread of their own; a closed connection (a dead process) is noticed at once, a
silent one (a hung process) after ``deadline`` seconds. A follower that fails sends its error text
first, so rank 0 can name the rank and its last error.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time

from .comm import DistError
from .launch import RankEnv, _tail, free_port, stop_ranks

DEFAULT_DEADLINE_S = 5.0
_FOLLOWERS_AFTER_MAIN_S = 3.0  # after rank 0 exits, before the supervisor kills the ranks left


def control_port(env: RankEnv) -> int:
    raw = os.environ.get("DDTREE_RTC_CONTROL_PORT")
    return int(raw) if raw else env.master_port + 2


def _send(sock: socket.socket, msg: dict) -> None:
    sock.sendall((json.dumps(msg) + "\n").encode())


class Leader:
    """Rank 0's side: ``broadcast(msg)`` to every follower; ``on_failure(rank, text)`` is called
    once, from a monitor thread, when a follower's connection closes or goes silent."""

    def __init__(self, env: RankEnv, deadline: float, setup_timeout: float, on_failure):
        self.world, self.deadline, self.on_failure = env.world_size, deadline, on_failure
        self._lock = threading.Lock()
        self._socks: dict[int, socket.socket] = {}
        self.last_error: dict[int, str] = {}
        self.pages_used: dict[int, int] = {}  # KV pages in use per follower, from its last heartbeat
        self._closing = threading.Event()
        self._failed = False
        end = time.monotonic() + setup_timeout
        files = {}
        with socket.create_server((env.master_addr, control_port(env))) as srv:
            while len(self._socks) < self.world - 1:
                left = end - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(1, self.world)) - set(self._socks))
                    raise DistError(f"rank 0: rank(s) {missing} never connected to the control channel at "
                                    f"{env.master_addr}:{control_port(env)} within {setup_timeout:g} s")
                srv.settimeout(left)
                try:
                    conn, _ = srv.accept()
                except TimeoutError:
                    continue
                conn.settimeout(setup_timeout)
                f = conn.makefile("rb")  # the monitor reads on from this buffer
                try:
                    rank = int(json.loads(f.readline())["rank"])
                except (ValueError, KeyError, OSError) as e:
                    conn.close()
                    raise DistError(f"rank 0: a peer opened the control channel without a valid hello ({e})") from None
                self._socks[rank], files[rank] = conn, f
        self._files = files
        for r, s in self._socks.items():
            s.settimeout(deadline)
            threading.Thread(target=self._monitor, args=(r, files[r]), name=f"ddtree-rank{r}-monitor",
                             daemon=True).start()
        threading.Thread(target=self._beat, name="ddtree-leader-beat", daemon=True).start()

    def _fail(self, rank: int, text: str) -> None:
        with self._lock:
            if self._failed or self._closing.is_set():
                return
            self._failed = True
        self.on_failure(rank, text)

    def _monitor(self, rank: int, f) -> None:
        while not self._closing.is_set():
            try:
                line = f.readline()
            except TimeoutError:
                self._fail(rank, f"no heartbeat for {self.deadline:g} s (hung?)"
                           + (f"; its last error: {self.last_error[rank]}" if rank in self.last_error else ""))
                return
            except (OSError, ValueError) as e:  # ValueError: close() closed the file under us
                line = b""
                self.last_error.setdefault(rank, f"connection error: {e}")
            if not line:
                if not self._closing.is_set():
                    self._fail(rank, f"exited ({self.last_error.get(rank, 'no error text: killed?')})")
                return
            try:
                msg = json.loads(line)
            except ValueError:
                self._fail(rank, f"sent a malformed control message {line[:80]!r}")
                return
            if msg.get("op") == "error":
                self.last_error[rank] = msg.get("text", "")
            elif msg.get("op") == "beat" and "pages_used" in msg:
                self.pages_used[rank] = int(msg["pages_used"])

    def _beat(self) -> None:
        while not self._closing.wait(self.deadline / 4):
            self.broadcast({"op": "tick"})

    def broadcast(self, msg: dict) -> None:
        with self._lock:
            socks = dict(self._socks)
            for r, s in socks.items():
                try:
                    _send(s, msg)
                except OSError as e:
                    self.last_error.setdefault(r, f"connection error: {e}")
                    del self._socks[r]
        if len(socks) != len(self._socks):  # noticed here first: the monitor names it too
            for r in set(socks) - set(self._socks):
                threading.Thread(target=self._fail, args=(r, f"exited ({self.last_error[r]})"), daemon=True).start()

    def close(self, failed: bool) -> None:
        """Tell the followers to stop (exiting non-zero if ``failed``) and close the channel."""
        self.broadcast({"op": "stop", "failed": failed})
        self._closing.set()
        with self._lock:
            for c in [*self._files.values(), *self._socks.values()]:  # a socket closes with its file
                try:
                    c.close()
                except OSError:
                    pass
            self._socks.clear()


class Follower:
    """A follower's side: ``messages()`` yields rank 0's messages (ticks filtered out) and raises
    DistError when rank 0 goes away or is silent for ``deadline`` seconds; ``report(text)`` sends
    this rank's error before it exits."""

    def __init__(self, env: RankEnv, deadline: float, setup_timeout: float):
        self.rank, self.deadline = env.rank, deadline
        end = time.monotonic() + setup_timeout
        addr = (env.master_addr, control_port(env))
        while True:
            try:
                self._sock = socket.create_connection(addr, timeout=max(0.1, end - time.monotonic()))
                break
            except OSError as e:
                if time.monotonic() > end:
                    raise DistError(f"rank {env.rank}: no control channel from rank 0 at {addr[0]}:{addr[1]} "
                                    f"within {setup_timeout:g} s ({e})") from None
                time.sleep(0.05)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.pages_used = 0  # sent with each heartbeat (the follower loop keeps it current)
        self._send({"op": "hello", "rank": env.rank})
        self._sock.settimeout(deadline)
        self._file = self._sock.makefile("rb")
        threading.Thread(target=self._beat, name="ddtree-follower-beat", daemon=True).start()

    def _send(self, msg: dict) -> None:
        with self._lock:
            _send(self._sock, msg)

    def _beat(self) -> None:
        while not self._closed.wait(self.deadline / 4):
            try:
                self._send({"op": "beat", "pages_used": self.pages_used})
            except OSError:
                return

    def messages(self):
        while True:
            try:
                line = self._file.readline()
            except TimeoutError:
                raise DistError(f"rank {self.rank}: rank 0 sent nothing for {self.deadline:g} s (hung?)") from None
            except OSError as e:
                raise DistError(f"rank {self.rank}: lost rank 0's control channel ({e})") from None
            if not line:
                raise DistError(f"rank {self.rank}: rank 0 closed the control channel (it exited)")
            msg = json.loads(line)
            if msg["op"] != "tick":
                yield msg

    def report(self, text: str) -> None:
        try:
            self._send({"op": "error", "text": text[-2000:]})
        except OSError:
            pass

    def close(self) -> None:
        self._closed.set()
        for c in (self._file, self._sock):  # the socket closes once its file is closed too
            try:
                c.close()
            except OSError:
                pass


def supervise(command: list[str], nproc: int, grace_s: float, env: dict | None = None, poll_s: float = 0.05) -> int:
    """``serve --nproc N``: run ``command`` as ranks 0..N-1 and wait for rank 0 (the server) to exit.
    Unlike ``launch.spawn`` a failing follower does not end the job at once: rank 0 notices it (its
    in-flight requests get a 503 naming the rank) and exits on its own; ``grace_s`` after the first
    failure, or after rank 0 exits, any rank still running is killed. Then the job's shared-memory
    segment is unlinked by name (a SIGKILLed rank 0 cannot) and rank 0's exit code returned (1 if rank
    0 exited 0 after a follower failed). Followers' stderr is kept and the failing one's printed."""
    from .local import job_id, segment_name

    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    import sys
    import uuid

    base = dict(os.environ if env is None else env)
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), DDTREE_RTC_STORE_PORT=str(free_port()),
                DDTREE_RTC_CONTROL_PORT=str(free_port()), WORLD_SIZE=str(nproc),
                DDTREE_RTC_JOB=uuid.uuid4().hex[:12])
    procs, logs, stopping = [], [], []

    def on_signal(signum, _frame):  # stop the server the graceful way: rank 0 tells the followers
        stopping.append(signum)
        if procs and procs[0].poll() is None:
            procs[0].send_signal(signal.SIGTERM)

    handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    with tempfile.TemporaryDirectory(prefix="ddtree_serve_") as tmp:
        try:
            for r in range(nproc):
                e = dict(base, RANK=str(r), LOCAL_RANK=str(r))
                if r == 0:
                    logs.append(None)
                    procs.append(subprocess.Popen(command, env=e))
                    continue
                log = os.path.join(tmp, f"rank{r}.err")
                logs.append(log)
                with open(log, "w") as f:
                    procs.append(subprocess.Popen(command, env=e, stdout=subprocess.DEVNULL, stderr=f))
            first_failed, kill_at = None, None
            while True:
                codes = [p.poll() for p in procs]
                for r, c in enumerate(codes):
                    if c not in (None, 0) and first_failed is None:
                        first_failed = r
                if codes[0] is not None or first_failed is not None or stopping:
                    kill_at = kill_at or time.monotonic() + grace_s
                if codes[0] is not None:  # the server is gone: followers hear it at once and exit
                    kill_at = min(kill_at, time.monotonic() + _FOLLOWERS_AFTER_MAIN_S)
                if all(c is not None for c in codes):
                    break
                if kill_at is not None and time.monotonic() > kill_at:
                    if codes[0] is None:
                        why = "being stopped" if first_failed is None else f"rank {first_failed}'s failure"
                        print(f"ddtree-rtc serve: rank 0 did not exit within {grace_s:g} s of {why}; "
                              f"killing every rank", file=sys.stderr)
                    break
                time.sleep(poll_s)
        finally:
            stop_ranks(procs, wait_s=3.0)
            _unlink(segment_name(job_id(base)))
            for s, h in handlers.items():
                signal.signal(s, h)
        if first_failed == 0 and procs[0].returncode < 0:  # rank 0 could not say so itself
            print(f"ddtree-rtc serve: rank 0 failed (killed by signal {-procs[0].returncode})", file=sys.stderr)
        elif first_failed is not None and first_failed != 0:
            print(f"ddtree-rtc serve: rank {first_failed} failed (exit code {procs[first_failed].returncode}): "
                  f"{_tail(logs[first_failed]).strip() or '(no error text)'}", file=sys.stderr)
    code = procs[0].returncode
    return code if code else (1 if first_failed is not None else 0)


def _unlink(name: str) -> None:
    """Remove the POSIX shared-memory segment ``name`` if it is there (Linux keeps them in /dev/shm)."""
    try:
        os.unlink(os.path.join("/dev/shm", name))
    except FileNotFoundError:
        pass
