"""``ddtree-rtc serve`` on the tiny preset (numpy backend): the real ``openai`` client against a
server on 127.0.0.1, 32 concurrent streams, a disconnect, and every malformed input's error."""

import socket
import threading
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from ddtree_rtc.backend import Backend  # noqa: E402
from ddtree_rtc.engine.engine import Engine  # noqa: E402
from ddtree_rtc.engine.request import Request  # noqa: E402
from ddtree_rtc.model.config import preset_config  # noqa: E402
from ddtree_rtc.model.make_model import make_model  # noqa: E402
from ddtree_rtc.model.target import TargetModel  # noqa: E402
from ddtree_rtc.pipeline.schema import DecodeSpec  # noqa: E402
from ddtree_rtc.serve.app import create_app  # noqa: E402
from ddtree_rtc.serve.server import running  # noqa: E402
from ddtree_rtc.serve.text import MINIMAL_CHAT_TEMPLATE, Text  # noqa: E402

MAX_CONTEXT, MAX_BATCH, MAX_QUEUE = 128, 8, 40
READ_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_serve")
    make_model(preset_config("tiny"), d, seed=3)
    return d, TargetModel.load(d, Backend("numpy"))


@pytest.fixture(scope="module")
def server(model):
    d, m = model
    engine = Engine(m, max_batch=MAX_BATCH, page_size=16, max_context=MAX_CONTEXT)
    app = create_app(engine, Text(d, preset=True), "tiny", DecodeSpec(), max_queue=MAX_QUEUE)
    with running(app, MAX_QUEUE, read_timeout_s=READ_TIMEOUT_S) as url:
        yield url, engine


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=60, max_retries=0)


def _direct(model, prompt, n):
    """The same prompt alone through a fresh engine: what ``ddtree-rtc run`` returns."""
    engine = Engine(model[1], max_batch=1, page_size=16, max_context=MAX_CONTEXT)
    return engine.run([Request(0, list(prompt), n)])[0].output


def _all_free(engine, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine.pages.num_free_pages == engine.pages.num_pages and engine.pages.num_promised_pages == 0 \
                and not engine.scheduler.has_work():
            return True
        time.sleep(0.02)
    return False


def test_completion_streamed_and_not_equal_the_direct_run(server, model):
    url, engine = server
    prompt = np.random.default_rng(1).integers(3, 1024, 9).tolist()
    want = _direct(model, prompt, 6)
    c = _client(url)
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, seed=0)
    assert r.choices[0].token_ids == want
    assert r.usage.prompt_tokens == 9 and r.usage.completion_tokens == len(want)
    assert r.choices[0].finish_reason in ("stop", "length")
    ids, sizes, usage, finish = [], [], None, None
    for ch in c.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, seed=0, stream=True):
        ids += ch.choices[0].token_ids
        sizes.append(len(ch.choices[0].token_ids))
        usage = getattr(ch, "usage", None) or usage
        finish = ch.choices[0].finish_reason or finish
    assert ids == want and finish == r.choices[0].finish_reason
    # one chunk per round's new tokens (>= 1 each), then the last one: finish_reason and usage, no tokens
    assert all(n >= 1 for n in sizes[:-1]) and sizes[-1] == 0 and len(sizes) >= 2
    assert usage.completion_tokens == len(want)
    assert _all_free(engine)


def test_text_and_chat(server, model):
    url, _ = server
    c = _client(url)
    r = c.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0)
    assert r.choices[0].token_ids == _direct(model, list(b"hello"), 4)
    chat_ids = list(Text(model[0], preset=True).chat([{"role": "user", "content": "hi"}]))
    assert bytes(chat_ids).decode() == "<|user|>hi\n<|assistant|>"
    assert "messages" in MINIMAL_CHAT_TEMPLATE
    want = _direct(model, chat_ids, 5)
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                  temperature=0)
    assert r.choices[0].token_ids == want and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(chat_ids)
    ids = []
    for ch in c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                        temperature=0, stream=True):
        ids += ch.choices[0].token_ids
    assert ids == want


def test_32_concurrent_streams_all_correct_and_pages_free(server, model):
    url, engine = server
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 1024, int(rng.integers(4, 20))).tolist() for _ in range(32)]
    lens = [int(rng.integers(2, 7)) for _ in range(32)]
    got = [None] * 32

    def one(i):
        ids = []
        for ch in _client(url).completions.create(model="tiny", prompt=prompts[i], max_tokens=lens[i],
                                                  temperature=0, stream=True):
            ids += ch.choices[0].token_ids
        got[i] = ids

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    for i in range(32):
        assert got[i] == _direct(model, prompts[i], lens[i]), i
    assert _all_free(engine)


def test_disconnect_mid_stream_frees_pages(server):
    url, engine = server
    # as many tokens as the context allows, so that a loaded machine's slow client cannot see the
    # request finish between its first chunk and the hang-up (100 tokens did, once, under the full suite)
    new = MAX_CONTEXT - 3
    with httpx.Client(timeout=60) as h, h.stream("POST", url + "/v1/completions",
                                                 json={"prompt": [5, 6, 7], "max_tokens": new, "stream": True,
                                                       "stop_token_ids": []}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one chunk in, then hang up
        running = list(engine.scheduler.running)
        assert len(running) == 1
    assert _all_free(engine), "the cancelled request kept its pages"
    req = running[0]
    assert req.finish is None and len(req.output) < new, "the request ran on after its client left"


def _err(url, body, path="/v1/completions", raw=None):
    r = httpx.post(url + path, content=raw, headers={"content-type": "application/json"}, timeout=30) \
        if raw is not None else httpx.post(url + path, json=body, timeout=30)
    return r.status_code, r.json()["error"]


def test_malformed_inputs_get_400_naming_the_problem(server):
    url, engine = server
    code, e = _err(url, None, raw=b'{"prompt": [1, 2,')
    assert code == 400 and "malformed JSON" in e["message"] and e["type"] == "invalid_request_error"
    code, e = _err(url, {"prompt": [1, 2], "bogus": 1})
    assert code == 400 and "unknown field 'bogus'" in e["message"]
    code, e = _err(url, {"prompt": [1, 5000]})
    assert code == 400 and "5000" in e["message"] and "vocabulary" in e["message"] and e["param"] == "prompt"
    code, e = _err(url, {"prompt": [1, 2], "max_tokens": MAX_CONTEXT})
    assert code == 400 and f"context is {MAX_CONTEXT} tokens" in e["message"] and e["param"] == "max_tokens"
    assert "at most 126 tokens" in e["message"]
    code, e = _err(url, {"prompt": list(range(1, MAX_CONTEXT + 2))})
    assert code == 400 and "shorten the prompt" in e["message"] and e["param"] == "prompt"
    code, e = _err(url, {"prompt": [1, 2], "n": 2})
    assert code == 400 and "n" == e["param"]
    code, e = _err(url, {"messages": [{"role": "user", "content": "x"}], "temperature": -1},
                   path="/v1/chat/completions")
    assert code == 400 and e["param"] == "temperature"
    code, e = _err(url, {"prompt": [1], "stop": "ab"})
    assert code == 400 and "2 tokens" in e["message"]
    # the server is still fine
    assert httpx.get(url + "/health", timeout=10).json() == {"status": "ok"}
    assert _all_free(engine)


def test_overload_is_429(server):
    url, engine = server
    body = {"prompt": [4, 5, 6], "max_tokens": 60, "stream": True}
    with httpx.Client(timeout=60, limits=httpx.Limits(max_connections=MAX_QUEUE + 2)) as h:
        streams = [h.stream("POST", url + "/v1/completions", json=body) for _ in range(MAX_QUEUE)]
        opened = [s.__enter__() for s in streams]
        try:
            assert all(r.status_code == 200 for r in opened)
            r = httpx.post(url + "/v1/completions", json={"prompt": [1], "max_tokens": 1}, timeout=30)
            e = r.json()["error"]
            assert r.status_code == 429 and e["type"] == "rate_limit_exceeded" and "limit" in e["message"]
            assert int(r.headers["retry-after"]) >= 1
        finally:
            for s in streams:
                s.__exit__(None, None, None)
    assert _all_free(engine, timeout=30)


def test_models_health_metrics(server):
    url, _ = server
    assert [m.id for m in _client(url).models.list().data] == ["tiny"]
    text = httpx.get(url + "/metrics", timeout=10).text
    for name in ("ddtree_requests_total", "ddtree_generated_tokens_total", "ddtree_tau", "ddtree_queue_depth",
                 "ddtree_request_latency_seconds_bucket", "ddtree_time_to_first_token_seconds_bucket"):
        assert name in text, name
    gen = [ln for ln in text.splitlines() if ln.startswith("ddtree_generated_tokens_total")]
    assert float(gen[0].split()[-1]) > 0


def test_engine_cancel_frees_pages_and_spares_the_others(model):
    engine = Engine(model[1], max_batch=2, page_size=16, max_context=MAX_CONTEXT)
    keep, drop, waiting = Request(1, [5, 6, 7], 5), Request(2, [8, 9], 50), Request(3, [4], 5)
    for r in (keep, drop, waiting):
        engine.submit(r)
    engine.step()
    assert engine.cancel(3) and engine.cancel(2) and not engine.cancel(2)
    while engine.scheduler.has_work():
        engine.step()
    assert keep.output == _direct(model, [5, 6, 7], 5)
    assert engine.pages.num_free_pages == engine.pages.num_pages and engine.pages.num_promised_pages == 0


def test_chat_template_sources_and_errors(tmp_path):
    from ddtree_rtc.serve.text import TextError

    with pytest.raises(TextError, match="no chat template"):
        Text(tmp_path, preset=False).chat([{"role": "user", "content": "x"}])
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{{ messages[0].content }}!"}')
    with pytest.raises(TextError, match="no tokenizer"):
        Text(tmp_path, preset=False).chat([{"role": "user", "content": "x"}])
    assert Text(tmp_path, preset=True).chat([{"role": "user", "content": "x"}]) == list(b"x!")
    (tmp_path / "chat_template.jinja").write_text("[{{ messages[0].content }}]")
    assert Text(tmp_path, preset=True).chat([{"role": "user", "content": "x"}]) == list(b"[x]")


def test_huge_seed_is_served_and_an_out_of_range_seed_is_a_400(server):
    """Hardening item 1: a seed >= 2**62 used to overflow int64 inside the engine thread and take the
    whole server down (every later request 503)."""
    url, engine = server
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0.7}
    for seed in (2**62, 2**63 - 1, -(2**63)):
        r = httpx.post(url + "/v1/completions", json=body | {"seed": seed}, timeout=30)
        assert r.status_code == 200, (seed, r.text)
        again = httpx.post(url + "/v1/completions", json=body | {"seed": seed}, timeout=30)
        assert again.json()["choices"][0]["token_ids"] == r.json()["choices"][0]["token_ids"]
    code, e = _err(url, body | {"seed": 2**63})
    assert code == 400 and e["param"] == "seed" and "64-bit" in e["message"]
    assert httpx.get(url + "/health", timeout=10).json() == {"status": "ok"}
    assert _all_free(engine)


def test_a_step_that_raises_fails_its_requests_and_the_server_serves_on(server, monkeypatch):
    """No exception in one request's step may stop the engine loop: that step's requests get a 500
    (streamed: an SSE error), pages are freed, /health stays ok and later requests succeed."""
    url, engine = server
    real_step = engine.step
    calls = {"n": 0}

    def failing_step():
        calls["n"] += 1
        if calls["n"] == 1:
            engine.scheduler.schedule()  # admit, as a real step would, then fail mid-step
            raise RuntimeError("boom in a kernel")
        return real_step()

    monkeypatch.setattr(engine, "step", failing_step)
    r = httpx.post(url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4}, timeout=30)
    assert r.status_code == 500 and "boom in a kernel" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "server_error"
    assert httpx.get(url + "/health", timeout=10).json() == {"status": "ok"}
    out = _client(url).completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4)
    assert out.choices[0].token_ids == _direct(model_of(engine), [5, 6, 7], 4)
    assert _all_free(engine)
    assert "ddtree_step_failures_total 1.0" in httpx.get(url + "/metrics", timeout=10).text


def model_of(engine):
    return None, engine.model


def _metric(url, name) -> float:
    """One sample of /metrics (name with its labels, as printed)."""
    for ln in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if ln.startswith(name + " "):
            return float(ln.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.fixture
def slow_steps(server, monkeypatch):
    """Each engine step takes 30 ms more, so that a long request is surely still running when a test
    looks at it (the tiny model otherwise finishes 125 tokens in about a second)."""
    engine = server[1]
    real_step = engine.step

    def slow_step():
        time.sleep(0.03)
        return real_step()

    monkeypatch.setattr(engine, "step", slow_step)


def test_a_non_streamed_client_that_gives_up_is_cancelled(server, slow_steps):
    """Hardening item 2: the server used to generate to max_tokens after a non-streamed client left."""
    url, engine = server
    cancelled = _metric(url, 'ddtree_requests_total{finish="cancelled"}') if "cancelled" in \
        httpx.get(url + "/metrics", timeout=10).text else 0.0
    length = _metric(url, 'ddtree_requests_total{finish="length"}')
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": MAX_CONTEXT - 3,
                                                  "stop_token_ids": []}, timeout=0.3)
    assert _all_free(engine), "the abandoned request kept its pages"
    assert _metric(url, 'ddtree_requests_total{finish="cancelled"}') == cancelled + 1
    assert _metric(url, 'ddtree_requests_total{finish="length"}') == length, "it ran to max_tokens"


def test_kv_page_and_queue_gauges_follow_a_request_at_once(server, slow_steps):
    """Hardening item 8: pages in use / free are on /metrics, and the queue depth is read when scraped."""
    url, engine = server
    assert _metric(url, "ddtree_kv_pages_used") == 0
    assert _metric(url, "ddtree_kv_pages_free") == engine.cache.num_pages
    with httpx.Client(timeout=60) as h, h.stream("POST", url + "/v1/completions",
                                                 json={"prompt": [5, 6, 7], "max_tokens": MAX_CONTEXT - 3,
                                                       "stream": True, "stop_token_ids": []}) as r:
        assert r.status_code == 200
        assert _metric(url, "ddtree_queue_depth") == 1  # counted on admission, before any round
        lines = r.iter_lines()  # read on without leaving the loop: leaving it closes the stream
        while not next(lines).startswith("data: "):
            pass
        assert _metric(url, "ddtree_kv_pages_used") > 0 and _metric(url, "ddtree_queue_depth") == 1
    assert _all_free(engine)
    assert _metric(url, "ddtree_queue_depth") == 0 and _metric(url, "ddtree_kv_pages_used") == 0


def test_openai_compatibility(server, model):
    """Hardening item 7: unknown model 404, neutral defaults accepted and others refused by name,
    the stop token left out, chat content as text parts, temperature bounded."""
    url, _ = server
    c = _client(url)
    with pytest.raises(openai.NotFoundError) as ei:
        c.completions.create(model="gpt-4", prompt=[5, 6], max_tokens=2)
    assert ei.value.body["code"] == "model_not_found" and ei.value.body["param"] == "model"
    prompt = [11, 12, 13, 14]
    want = _direct(model, prompt, 6)
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, frequency_penalty=0,
                             presence_penalty=0, echo=False, best_of=1, logit_bias={})
    assert r.choices[0].token_ids == want
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                  frequency_penalty=0, presence_penalty=0, logit_bias={}, logprobs=False)
    assert r.choices[0].finish_reason in ("stop", "length")
    for field, value in (("frequency_penalty", 0.5), ("presence_penalty", -1), ("logit_bias", {"5": 10}),
                         ("echo", True), ("best_of", 2), ("logprobs", 1)):
        code, e = _err(url, {"model": "tiny", "prompt": prompt, "max_tokens": 2, field: value})
        assert code == 400 and e["param"] == field and "not supported" in e["message"], (field, e)
    # the stop token ends the output and is not part of it (OpenAI's rule); usage still counts it
    k = next(i for i in range(1, len(want)) if want[i] not in want[:i])
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                             extra_body={"stop_token_ids": [want[k]]})
    assert r.choices[0].token_ids == want[:k] and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == k + 1
    ids, finish = [], None
    for ch in c.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, stream=True,
                                   extra_body={"stop_token_ids": [want[k]]}):
        ids += ch.choices[0].token_ids
        finish = ch.choices[0].finish_reason or finish
    assert ids == want[:k] and finish == "stop"
    # chat content as an array of text parts is the same as the joined string
    parts = [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]
    a = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}], max_tokens=3)
    b = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert a.choices[0].token_ids == b.choices[0].token_ids and a.usage.prompt_tokens == b.usage.prompt_tokens
    code, e = _err(url, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
                   path="/v1/chat/completions")
    assert code == 400 and e["param"].startswith("messages.0.content")
    for raw in (b'{"prompt": [1], "temperature": Infinity}', b'{"prompt": [1], "temperature": 1e300}',
                b'{"prompt": [1], "temperature": NaN}', b'{"prompt": [1], "top_p": NaN}'):
        code, e = _err(url, None, raw=raw)
        assert code == 400 and e["param"] in ("temperature", "top_p"), raw


def test_error_wording(server):
    """Hardening item 11 (server side): malformed JSON names no field, a wrong content-type says so."""
    url, _ = server
    code, e = _err(url, None, raw=b'{"prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,')
    assert code == 400 and e["param"] is None and e["message"].startswith("malformed JSON")
    r = httpx.post(url + "/v1/completions", content=b"prompt=1", headers={"content-type": "text/plain"},
                   timeout=30)
    e = r.json()["error"]
    assert r.status_code == 400 and not e["message"].startswith(":") and "content-type" in e["message"]
    assert "text/plain" in e["message"] and e["param"] is None


def _wait_closed(sock, within: float) -> float:
    """Seconds until the server closes ``sock`` (reads EOF); fails past ``within``."""
    t0 = time.monotonic()
    sock.settimeout(within)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        raise AssertionError(f"the server held the connection over {within} s") from None
    except ConnectionResetError:
        pass
    return time.monotonic() - t0


def test_slow_loris_partial_requests_are_dropped_in_bounded_time(server):
    """Hardening item 9: a connection that trickles its headers or body in is closed after the read
    timeout; the server answers others meanwhile."""
    url, _ = server
    host, port = url.removeprefix("http://").split(":")
    partial = [b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty",  # headers cut short
               b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: 200\r\n\r\n{\"prompt\": [1, 2",  # body cut short
               b""]  # nothing at all
    socks = []
    for i in range(30):
        s = socket.create_connection((host, int(port)))
        s.sendall(partial[i % len(partial)])
        socks.append(s)
    try:
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        t0 = time.monotonic()
        for s in socks:
            _wait_closed(s, within=READ_TIMEOUT_S + 5)
        assert time.monotonic() - t0 < READ_TIMEOUT_S + 5
    finally:
        for s in socks:
            s.close()
    assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_the_verify_tail_is_refused_up_front(model):
    """Hardening item 6: with a speculative round the advertised max_model_len is the real limit, and
    a request past it is a 400 naming max_tokens before any stream starts (not a 200 then an error)."""
    from ddtree_rtc.speculative.drafters import RandomDrafter

    d, m = model
    budget = 16
    engine = Engine(m, max_batch=2, page_size=16, max_context=MAX_CONTEXT, mode="ddtree", budget=budget,
                    drafter=RandomDrafter(m.backend, m.cfg.vocab_size, 3, seed=1))
    limit = MAX_CONTEXT - (1 + budget)
    app = create_app(engine, Text(d, preset=True), "tiny", DecodeSpec(), max_queue=4)
    with running(app, 4, read_timeout_s=READ_TIMEOUT_S) as url:
        assert _client(url).models.list().data[0].model_extra["max_model_len"] == limit
        prompt = list(range(3, 3 + limit - 3))
        for stream in (False, True):
            r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 6, "stream": stream},
                           timeout=30)
            e = r.json()["error"]
            assert r.status_code == 400 and e["param"] == "max_tokens", r.text
            assert f"context is {limit} tokens" in e["message"] and "at most 3" in e["message"]
            assert "verify tail" not in e["message"]
        ids = []
        for ch in _client(url).completions.create(model="tiny", prompt=prompt, max_tokens=3, stream=True,
                                                  extra_body={"stop_token_ids": []}):
            ids += ch.choices[0].token_ids
        assert 1 <= len(ids) <= 3
