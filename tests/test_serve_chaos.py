"""A bounded chaos run against one ``serve`` app (numpy backend, tiny preset, 127.0.0.1): 300 requests,
good ones mixed with every kind of bad input and with clients that hang up, from 8 threads at once.
Every good request gets its tokens (greedy ones exactly the direct run's), every bad one its named
4xx, ``/health`` answers 200 throughout, and the KV-page gauge reads 0 pages in use at the end."""

import json
import threading
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from ddtree_rtc.backend import Backend  # noqa: E402
from ddtree_rtc.engine.engine import Engine  # noqa: E402
from ddtree_rtc.engine.request import Request  # noqa: E402
from ddtree_rtc.model.target import TargetModel  # noqa: E402
from ddtree_rtc.pipeline.schema import DecodeSpec  # noqa: E402
from ddtree_rtc.serve.app import create_app  # noqa: E402
from ddtree_rtc.serve.server import running  # noqa: E402
from ddtree_rtc.serve.text import Text  # noqa: E402

MAX_CONTEXT, N_REQUESTS, N_THREADS = 64, 300, 8
PROMPTS = [[5, 6, 7], [100, 200, 300, 400], [9], [17, 18, 19, 20, 21, 22]]

# (what is wrong, the body or raw bytes, expected status, expected error param, a word of the message)
BAD = [
    ("malformed JSON", b'{"prompt": [1, 2,', 400, None, "malformed JSON"),
    ("unknown field", {"prompt": [1], "bogus": 1}, 400, "bogus", "unknown field"),
    ("token outside the vocabulary", {"prompt": [1, 10**6]}, 400, "prompt", "vocabulary"),
    ("empty prompt", {"prompt": []}, 400, "prompt", "empty"),
    ("past the context", {"prompt": [1, 2], "max_tokens": MAX_CONTEXT}, 400, "max_tokens", "context"),
    ("seed past 64 bits", {"prompt": [1], "seed": 2**63}, 400, "seed", "64-bit"),
    ("unknown model", {"prompt": [1], "model": "gpt-4"}, 404, "model", "does not exist"),
    ("a penalty", {"prompt": [1], "frequency_penalty": 1.5}, 400, "frequency_penalty", "not supported"),
    ("huge temperature", b'{"prompt": [1], "temperature": 1e300}', 400, "temperature", "temperature"),
    ("infinite temperature", b'{"prompt": [1], "temperature": Infinity}', 400, "temperature", "temperature"),
    ("n > 1", {"prompt": [1], "n": 2}, 400, "n", ""),
    ("multi-token stop", {"prompt": [1], "stop": "ab"}, 400, "stop", "2 tokens"),
    ("a streamed request past the context", {"prompt": [1, 2], "max_tokens": MAX_CONTEXT, "stream": True}, 400,
     "max_tokens", "context"),
]


@pytest.fixture(scope="module")
def served(tiny_dir):
    model = TargetModel.load(tiny_dir, Backend("numpy"))
    engine = Engine(model, max_batch=8, page_size=16, max_context=MAX_CONTEXT)
    want = {}
    for p in PROMPTS:
        e = Engine(model, max_batch=1, page_size=16, max_context=MAX_CONTEXT)
        want[tuple(p)] = e.run([Request(0, list(p), 4)])[0].output
    app = create_app(engine, Text(tiny_dir, preset=True), "tiny", DecodeSpec(), max_queue=256)
    with running(app, 256) as url:
        yield url, engine, want


def _gauge(h, url, name) -> float:
    for ln in h.get(url + "/metrics").text.splitlines():
        if ln.startswith(name + " "):
            return float(ln.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


def _good(h, url, rng, want):
    prompt = PROMPTS[int(rng.integers(len(PROMPTS)))]
    k = int(rng.integers(1, 5))
    stream = bool(rng.integers(2))
    body = {"model": "tiny", "prompt": prompt, "max_tokens": k, "temperature": 0, "stream": stream}
    if rng.integers(4) == 0:  # what common clients send by default
        body |= {"frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {}, "echo": False, "best_of": 1}
    if not stream:
        r = h.post(url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        ids = r.json()["choices"][0]["token_ids"]
    else:
        ids = []
        with h.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    ids += chunk["choices"][0]["token_ids"]
    assert ids == want[tuple(prompt)][:k], (prompt, k, ids)


def _bad(h, url, rng):
    what, body, status, param, word = BAD[int(rng.integers(len(BAD)))]
    if isinstance(body, bytes):
        r = h.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    else:
        r = h.post(url + "/v1/completions", json=body)
    assert r.status_code == status, (what, r.status_code, r.text)
    e = r.json()["error"]
    assert e["param"] == param and word in e["message"], (what, e)


def _hang_up(h, url, rng):
    body = {"prompt": PROMPTS[int(rng.integers(len(PROMPTS)))], "max_tokens": MAX_CONTEXT - 8,
            "stop_token_ids": []}
    if rng.integers(2):  # a stream read for one chunk, then closed
        with h.stream("POST", url + "/v1/completions", json=body | {"stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break
    else:  # a non-streamed client that gives up
        with httpx.Client(timeout=0.05) as quick:
            try:
                quick.post(url + "/v1/completions", json=body)
            except httpx.TimeoutException:
                pass


def test_300_mixed_requests_with_hang_ups(served, rng):
    url, engine, want = served
    kinds = np.array(["good"] * 150 + ["bad"] * 120 + ["hang_up"] * 30)
    rng.shuffle(kinds)
    seeds = rng.integers(0, 2**32, N_REQUESTS)
    errors, health = [], []
    stop = threading.Event()

    def worker(w):
        with httpx.Client(timeout=60) as h:
            for i in range(w, N_REQUESTS, N_THREADS):
                r = np.random.default_rng(seeds[i])
                try:
                    if kinds[i] == "good":
                        _good(h, url, r, want)
                    elif kinds[i] == "bad":
                        _bad(h, url, r)
                    else:
                        _hang_up(h, url, r)
                except Exception as e:  # noqa: BLE001 - collected and reported below
                    errors.append(f"request {i} ({kinds[i]}): {e!r}")

    def prober():
        with httpx.Client(timeout=10) as h:
            while not stop.is_set():
                health.append(h.get(url + "/health").status_code)
                time.sleep(0.05)

    probe = threading.Thread(target=prober)
    probe.start()
    t0 = time.monotonic()
    threads = [threading.Thread(target=worker, args=(w,)) for w in range(N_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    stop.set()
    probe.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a client hung"
    print(f"{N_REQUESTS} requests in {time.monotonic() - t0:.1f} s, {len(health)} health probes")
    assert not errors, "\n".join(errors[:10])
    assert health and set(health) == {200}, f"/health answered {sorted(set(health))}"
    with httpx.Client(timeout=10) as h:
        deadline = time.monotonic() + 20
        while _gauge(h, url, "ddtree_kv_pages_used") != 0 or _gauge(h, url, "ddtree_queue_depth") != 0:
            assert time.monotonic() < deadline, "pages or requests still held 20 s after the last client"
            time.sleep(0.05)
        assert _gauge(h, url, "ddtree_kv_pages_free") == engine.cache.num_pages
        assert h.get(url + "/health").json() == {"status": "ok"}
