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
from ddtree_rtc.serve.text import MINIMAL_CHAT_TEMPLATE, Text  # noqa: E402

MAX_CONTEXT, MAX_BATCH, MAX_QUEUE = 128, 8, 40


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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline, "server did not start in 30 s"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", engine
    srv.should_exit = True
    th.join(timeout=30)
    assert not th.is_alive()


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
    assert code == 400 and "max context" in e["message"] and e["param"] == "max_tokens"
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
            code, e = _err(url, {"prompt": [1], "max_tokens": 1})
            assert code == 429 and e["type"] == "rate_limit_exceeded" and "limit" in e["message"]
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
