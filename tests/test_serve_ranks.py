"""``ddtree-rtc serve --nproc N`` on the tiny preset (numpy backend, local transport), driven by the
real ``openai`` client on 127.0.0.1: the same tokens as the 1-rank server (TP and EP, 2 and 4 ranks,
AR / DDTree / chain, T = 0 and 0.8, streamed or not); a client that leaves frees its pages on every
rank; a killed or hung rank gives in-flight requests a 503 naming it, and the whole job exits with no
process and no shared-memory segment left behind; a bounded soak of 500 mixed requests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from ddtree_rtc.parallel.launch import free_port  # noqa: E402
from ddtree_rtc.parallel.local import job_id, segment_name  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
AR, DDTREE = str(ROOT / "pipelines" / "tiny.yaml"), str(ROOT / "pipelines" / "tiny_ddtree.yaml")
PROMPTS = [[5, 6, 7, 8, 9], [100, 3, 77, 12, 500, 901, 4], [42] * 3]


def _pids_with(needle: str) -> list[int]:
    """Live processes whose command line or environment holds ``needle`` (not zombies)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if (d / "stat").read_text().split(") ", 1)[1].startswith("Z"):
                continue
            blob = (d / "cmdline").read_bytes() + b"\0" + (d / "environ").read_bytes()
        except OSError:
            continue
        if needle.encode() in blob:
            found.append(int(d.name))
    return found


def _environ(pid: int) -> dict:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(x.decode(errors="replace").split("=", 1) for x in raw if b"=" in x)


class Server:
    """``ddtree-rtc serve PIPELINE [--nproc N]`` in its own session; ``ranks`` maps rank -> pid."""

    def __init__(self, pipeline: str, nproc: int = 1, sets=(), rank_timeout: float = 20.0, max_queue: int = 64):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "ddtree_rtc.cli", "serve", pipeline, "--port", str(self.port),
               "--max-queue", str(max_queue), "--rank-timeout", str(rank_timeout),
               "--set", "runtime.backend=numpy", *[a for s in sets for a in ("--set", s)]]
        if nproc > 1:
            cmd += ["--nproc", str(nproc), "--set", f"runtime.tensor_parallel={nproc}"]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="ddtree_serve_", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 180
        while True:
            assert self.proc.poll() is None, f"the server exited ({self.proc.returncode}):\n{self.text()}"
            assert time.monotonic() < deadline, f"no /health in 180 s:\n{self.text()}"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.ranks = {}
        if nproc > 1:
            for pid in _pids_with(f"--port\0{self.port}\0"):
                env = _environ(pid)
                if "RANK" in env and pid != self.proc.pid:
                    self.ranks[int(env["RANK"])] = pid
            assert sorted(self.ranks) == list(range(nproc)), self.ranks
            env = _environ(self.ranks[0])
            self.job = env["DDTREE_RTC_JOB"]
            self.segment = Path("/dev/shm") / segment_name(job_id(env))
            assert self.segment.exists()

    def text(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def client(self, timeout: float = 60):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", timeout=timeout, max_retries=0)

    def metric(self, name: str) -> float:
        """One sample of /metrics by its full name, labels included (e.g. 'ddtree_rank_kv_pages_used{rank="1"}')."""
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            key, _, value = line.rpartition(" ")
            if key == name:
                return float(value)
        raise KeyError(name)

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def assert_nothing_left(self):
        """No process of the job (ranks, their resource trackers) and no /dev/shm segment remain."""
        deadline = time.monotonic() + 10
        while _pids_with(f"DDTREE_RTC_JOB={self.job}") and time.monotonic() < deadline:
            time.sleep(0.1)
        left = _pids_with(f"DDTREE_RTC_JOB={self.job}")
        assert not left, f"processes left behind: {left}"
        assert not self.segment.exists(), f"shared-memory segment left behind: {self.segment}"


def _ask(c, prompt, temperature, stream, chat=False, max_tokens=6):
    kw = dict(model="tiny", max_tokens=max_tokens, temperature=temperature, seed=1234, stream=stream)
    if chat:
        kw["messages"] = [{"role": "user", "content": "hi " + "".join(chr(65 + t % 26) for t in prompt)}]
        out = c.chat.completions.create(**kw)
    else:
        out = c.completions.create(prompt=prompt, **kw)
    if not stream:
        return out.choices[0].model_extra["token_ids"]
    return [t for chunk in out for t in chunk.choices[0].model_extra["token_ids"]]


# (prompt, temperature, streamed, chat): every pairing of T and streaming, completions and chat
CASES = [(PROMPTS[0], 0.0, False, False), (PROMPTS[0], 0.8, True, False), (PROMPTS[1], 0.0, True, False),
         (PROMPTS[1], 0.8, False, False), (PROMPTS[2], 0.8, True, True), (PROMPTS[2], 0.0, False, True)]


def _answers(server):
    c = server.client()
    return [_ask(c, p, t, s, chat) for p, t, s, chat in CASES]


# two layers (one dense, one MoE) keep every server quick; the oracle drafter decodes each prompt's
# greedy continuation once, as far as workload.synthetic.output_len (+ depth) reaches
FAST = ("model.layers=2", "runtime.max_batch=16", "workload.synthetic.output_len=6")
MODES = {"autoregressive": (AR, FAST), "ddtree": (DDTREE, FAST), "chain": (DDTREE, FAST + ("decode.mode=chain",))}
_ONE_RANK: dict = {}


def _one_rank(pipeline, sets):
    """The 1-rank server's answers to CASES (one server per pipeline and settings)."""
    if (pipeline, sets) not in _ONE_RANK:
        srv = Server(pipeline, 1, sets)
        try:
            _ONE_RANK[pipeline, sets] = _answers(srv)
        finally:
            code = srv.stop()
        assert code in (0, -signal.SIGTERM), srv.text()  # uvicorn ends by re-raising the SIGTERM
    return _ONE_RANK[pipeline, sets]


# the dense layer alone (the numpy MoE dominates a step): the soak's 500 requests stay quick
DENSE = ("model.layers=1", "runtime.max_batch=16")


@pytest.fixture(scope="module")
def ar2():
    """2 ranks (tensor parallel), autoregressive, dense layer only, a queue of 15: shared by the
    tests below."""
    srv = Server(AR, 2, DENSE, max_queue=15)
    yield srv
    code = srv.stop()
    assert code == 0, srv.text()
    srv.assert_nothing_left()


def _pages_used(srv) -> tuple[float, float]:
    return srv.metric('ddtree_kv_pages_used'), srv.metric('ddtree_rank_kv_pages_used{rank="1"}')


def _wait_pages_free(srv, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while _pages_used(srv) != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _pages_used(srv) == (0, 0)


def test_two_ranks_answer_as_one_rank_and_free_a_leavers_pages(ar2):
    assert _answers(ar2) == _one_rank(AR, DENSE)
    with httpx.stream("POST", ar2.url + "/v1/completions", timeout=60,
                      json={"prompt": PROMPTS[1], "max_tokens": 200, "stream": True}) as r:
        next(r.iter_lines())  # one event, then the client goes away mid-stream
    _wait_pages_free(ar2)  # on rank 0 and on rank 1


@pytest.mark.parametrize("world,ep,mode", [
    (2, False, "ddtree"), (2, True, "chain"), (4, False, "ddtree"), (4, True, "autoregressive")])
def test_ranks_answer_as_one_rank(world, ep, mode):
    pipeline, sets = MODES[mode]
    want = _one_rank(pipeline, sets)
    srv = Server(pipeline, world, sets + (("runtime.expert_parallel=true",) if ep else ()))
    try:
        assert _answers(srv) == want
    finally:
        code = srv.stop()
    assert code == 0, srv.text()
    srv.assert_nothing_left()


@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_a_failed_rank_takes_the_server_down_loudly(fault):
    deadline = 3.0
    srv = Server(AR, 2, FAST, rank_timeout=deadline)
    try:
        c = srv.client()
        stream = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=200, stream=True)
        first = next(iter(stream))
        assert first.choices[0].model_extra["token_ids"]
        os.kill(srv.ranks[1], signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(openai.APIError) as err:
            for _ in stream:
                pass
        waited = time.monotonic() - t0
        print(f"{fault}: the 503 naming rank 1 came {waited:.2f} s after it (deadline {deadline:g} s)")
        assert "rank 1" in str(err.value), err.value
        assert isinstance(err.value.body, dict) and err.value.body.get("code") == 503, err.value.body
        assert waited < deadline + 3, f"the 503 came {waited:.1f} s after the {fault}"
        try:  # a request after the failure: a 503 naming the rank, or no server any more
            c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=2)
            raise AssertionError("a request after a rank failed was served")
        except openai.APIStatusError as e:
            assert e.status_code == 503 and "rank 1" in e.message
        except openai.APIConnectionError:
            pass
        code = srv.proc.wait(60)
    finally:
        if fault == "hang" and srv.ranks[1] in _pids_with(f"DDTREE_RTC_JOB={srv.job}"):
            os.kill(srv.ranks[1], signal.SIGCONT)
        srv.stop()
    assert code != 0
    log = srv.text()
    assert "rank 1 failed" in log, log
    srv.assert_nothing_left()


def test_killing_rank_0_ends_the_job():
    """Rank 0 (the HTTP server) SIGKILLed mid-stream: the client loses the connection, the other
    rank exits, the supervisor exits non-zero and removes the segment rank 0 could not."""
    srv = Server(AR, 2, DENSE, rank_timeout=3.0)
    try:
        stream = srv.client().completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=200, stream=True)
        next(iter(stream))
        os.kill(srv.ranks[0], signal.SIGKILL)
        with pytest.raises(openai.APIError):
            for _ in stream:
                pass
        code = srv.proc.wait(60)
    finally:
        srv.stop()
    assert code != 0
    assert "rank 0 failed" in srv.text()
    srv.assert_nothing_left()


@pytest.mark.soak
def test_soak_500_mixed_requests_over_16_clients(ar2):
    """Bounded (2-5 token prompts, 1-2 new tokens): 500 requests served, completions and chat,
    streamed or not, greedy and sampled, from 16 threads against 2 ranks with a queue of 15 (so one
    at a time gets 429 and retries). Only 429s may fail; greedy answers repeat exactly; every page is free at the
    end on both ranks."""
    errors, too_many, greedy = [], [0], {}
    lock = threading.Lock()
    todo = iter(range(500))

    def client():
        c = ar2.client()
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            prompt, temp, chat, n = PROMPTS[i % 3][: 2 + i % 4], (0.0 if i % 2 else 0.8), i % 7 == 0, 1 + i % 2
            while True:
                try:
                    got = _ask(c, prompt, temp, stream=i % 3 == 0, chat=chat, max_tokens=n)
                    break
                except openai.RateLimitError:  # the queue is full: retry this request
                    with lock:
                        too_many[0] += 1
                    time.sleep(0.25)
                except Exception as e:  # noqa: BLE001 - any other error fails the soak
                    with lock:
                        errors.append(repr(e))
                    got = None
                    break
            if got is None:
                continue
            if temp == 0.0:
                with lock:
                    if greedy.setdefault((tuple(prompt), chat, n), got) != got:
                        errors.append(f"greedy answer changed for {prompt}: {greedy[(tuple(prompt), chat, n)]} "
                                      f"then {got}")

    threads = [threading.Thread(target=client) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors[:5]
    assert len(greedy) >= 5
    _wait_pages_free(ar2)
    print(f"500 requests served: {too_many[0]} 429s retried, {len(greedy)} distinct greedy requests")


def test_ranks_started_by_a_launcher():
    """Two ``ddtree-rtc serve`` processes with torchrun's variables (no --nproc, no supervisor):
    rank 0 serves the 1-rank answers; a SIGTERM to rank 0 stops both cleanly."""
    port, master = free_port(), free_port()
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master),
               TORCHELASTIC_RUN_ID=f"t{master}")
    cmd = [sys.executable, "-m", "ddtree_rtc.cli", "serve", AR, "--port", str(port), "--rank-timeout", "5",
           *[a for s in DENSE + ("runtime.backend=numpy", "runtime.tensor_parallel=2") for a in ("--set", s)]]
    logs = [tempfile.TemporaryFile("w+") for _ in range(2)]
    procs = [subprocess.Popen(cmd, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=logs[r],
                              stderr=subprocess.STDOUT) for r in range(2)]
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 180
        while True:
            assert all(p.poll() is None for p in procs), "a rank exited before serving"
            assert time.monotonic() < deadline
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=60, max_retries=0)
        assert _ask(c, PROMPTS[0], 0.8, True) == _one_rank(AR, DENSE)[1]
        procs[0].send_signal(signal.SIGTERM)
        codes = [p.wait(30) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for log in logs:
        log.seek(0)
    assert codes == [0, 0], [log.read()[-2000:] for log in logs]
    assert not (Path("/dev/shm") / segment_name(job_id(env))).exists()
