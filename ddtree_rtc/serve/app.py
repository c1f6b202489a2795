"""The HTTP app: OpenAI's ``/v1/completions`` and ``/v1/chat/completions``, streamed or not, plus
``/v1/models``, ``/health`` and ``/metrics``. Errors use OpenAI's body:
``{"error": {"message", "type", "param", "code"}}``; bad input is 400, an unknown model 404, a full
queue 429 (with ``Retry-After``). Every limit is checked before a stream starts, so a streamed request
that starts (200) ends with tokens, not with an error of its own making.

Beyond OpenAI's fields each choice carries ``token_ids`` (the generated ids), and ``prompt`` may be
a list of token ids. ``stop`` strings must each be one token of the model's tokenizer (the engine
stops on token ids); ``stop_token_ids`` takes ids directly. As in OpenAI's API the stop token itself
is left out of ``text`` and ``token_ids`` (``usage.completion_tokens`` still counts it). Sampling
fields the engine has no use for are accepted at their neutral values (``frequency_penalty: 0``,
``presence_penalty: 0``, ``logit_bias: {}``, ``echo: false``, ``best_of: 1``, no logprobs) and
refused by name otherwise.

A client that hangs up is cancelled (its KV pages freed) whether it streams or not: a non-streamed
request polls for the disconnect while it waits.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import ClassVar, Literal

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from ..engine.request import Request, RequestError
from .loop import EngineLoop, Overloaded
from .text import Text, TextError


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


# seconds a 429's Retry-After asks a client to wait: a tiny model's request takes well under that
RETRY_AFTER_S = 1
# how often a non-streamed request checks that its client is still there
DISCONNECT_POLL_S = 0.1


def _error(status: int, message: str, type_: str, param: str | None = None, code=None) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 429 else None
    return JSONResponse({"error": {"message": message, "type": type_, "param": param,
                                   "code": status if code is None else code}},
                        status_code=status, headers=headers)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2, allow_inf_nan=False)  # OpenAI's range
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: Literal[1] = 1
    stream: bool = False
    stream_options: dict | None = None
    user: str | None = None
    # OpenAI fields that common clients send at their neutral value: accepted there, refused elsewhere
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict | None = None

    def unsupported(self) -> tuple[str, object] | None:
        """The first field set to a value the engine cannot honour, with that value."""
        for name, neutral in self._NEUTRAL:
            v = getattr(self, name)
            if v is not None and v != neutral:
                return name, v
        return None

    _NEUTRAL: ClassVar[tuple] = (("frequency_penalty", 0), ("presence_penalty", 0), ("logit_bias", {}))


class CompletionBody(_Body):
    prompt: str | list[int]
    echo: bool | None = None
    best_of: int | None = None
    logprobs: int | None = None
    suffix: str | None = None

    _NEUTRAL: ClassVar[tuple] = _Body._NEUTRAL + (("echo", False), ("best_of", 1), ("logprobs", None),
                                                  ("suffix", None))


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart]
    name: str | None = None

    def as_dict(self) -> dict:
        """The message for the chat template: an array of text parts is joined into one string."""
        d = self.model_dump(exclude_none=True)
        if not isinstance(self.content, str):
            d["content"] = "".join(p.text for p in self.content)
        return d


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None

    _NEUTRAL: ClassVar[tuple] = _Body._NEUTRAL + (("logprobs", False), ("top_logprobs", None))


_FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


def create_app(engine, text: Text, model_name: str, defaults, max_queue: int = 256,
               default_max_tokens: int = 16) -> FastAPI:
    """The app over ``engine``, whose loop thread starts and stops with the app's lifespan.
    ``defaults`` is the pipeline's ``decode`` section (temperature and top_p when a request omits them; a
    request without a seed samples from a stream keyed by its id)."""
    from contextlib import asynccontextmanager

    loop = EngineLoop(engine, max_queue)

    @asynccontextmanager
    async def lifespan(_app):
        loop.start()
        try:
            yield
        finally:
            loop.stop()

    app = FastAPI(title="ddtree-rtc", lifespan=lifespan)
    app.state.loop = loop
    cfg = engine.model.cfg
    context_limit = engine.context_limit

    @app.exception_handler(APIError)
    async def _api_error(_req, e: APIError):
        return _error(e.status, e.message, e.type, e.param,
                      code="model_not_found" if e.type == "model_not_found" else None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(http: HTTPRequest, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":  # its loc is a byte offset, not a field
            msg = f"malformed JSON in the request body: {first.get('ctx', {}).get('error', first.get('msg'))}"
            loc = []
        elif first.get("type") == "extra_forbidden":
            msg = f"unknown field {'.'.join(loc)!r}"
        elif not loc:  # the body as a whole: not a JSON object (a wrong content-type lands here too)
            ctype = http.headers.get("content-type", "none")
            msg = (f"the request body must be a JSON object sent as content-type application/json "
                   f"(got content-type {ctype}): {first.get('msg')}")
        else:
            parts = []
            for er in errs:
                where = ".".join(str(x) for x in er.get("loc", ()) if x != "body")
                parts.append(f"{where}: {er.get('msg')}" if where else er.get("msg"))
            msg = "; ".join(parts)
        return _error(400, msg, "invalid_request_error", ".".join(loc) or None)

    def _check_body(body: _Body) -> None:
        if body.model is not None and body.model != model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {model_name!r}",
                           "model_not_found", param="model")
        bad = body.unsupported()
        if bad is not None:
            name, value = bad
            raise APIError(400, f"{name}={value!r} is not supported by this server (it accepts only the "
                           f"neutral value, or the field left out)", param=name)

    def _stop_ids(body: _Body) -> tuple[int, ...]:
        ids = list(body.stop_token_ids or ())
        stops = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
        for s in stops:
            try:
                enc = text.encode(s)
            except TextError as e:
                raise APIError(400, f"stop {s!r}: {e}", param="stop") from None
            if len(enc) != 1:
                raise APIError(400, f"stop {s!r} is {len(enc)} tokens; the engine stops on single tokens "
                               f"(use stop_token_ids)", param="stop")
            ids += enc
        bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise APIError(400, f"stop_token_ids {bad[:5]} outside the vocabulary [0, {cfg.vocab_size})",
                           param="stop_token_ids")
        return tuple(ids)

    def _request(body: _Body, prompt: list[int], max_tokens: int | None) -> Request:
        if loop.error is not None:
            raise APIError(503, f"the engine loop has failed: {loop.error!r}", "server_error")
        req = Request(loop.new_rid(), prompt, max_tokens or default_max_tokens,
                      temperature=defaults.temperature if body.temperature is None else body.temperature,
                      top_p=defaults.top_p if body.top_p is None else body.top_p,
                      stop_ids=_stop_ids(body), seed=body.seed)
        if prompt and len(prompt) + req.max_new_tokens > context_limit:  # said in the API's words
            room = context_limit - len(prompt)
            raise APIError(400, f"this model's context is {context_limit} tokens, but the prompt ({len(prompt)} "
                           f"tokens) + max_tokens ({req.max_new_tokens}) = {len(prompt) + req.max_new_tokens}: "
                           + (f"ask for at most {room} tokens" if room > 0 else "shorten the prompt"),
                           param="max_tokens" if room > 0 else "prompt")
        try:
            req.validate(cfg.vocab_size, engine.max_context)
        except RequestError as e:
            msg = str(e).split(": ", 1)[1]
            param = ("prompt" if "vocabulary" in msg or msg == "empty prompt" else
                     "seed" if msg.startswith("seed") else "max_tokens")
            raise APIError(400, msg, param=param) from None
        pages = engine.pages
        if pages.pages_for(len(prompt) + req.max_new_tokens) > pages.num_pages:
            raise APIError(400, f"prompt + max_tokens needs more KV pages than the whole cache holds "
                           f"({pages.num_pages})", param="max_tokens")
        return req

    def _submit(req: Request):
        try:
            return loop.submit(req)
        except Overloaded as e:
            raise APIError(429, str(e), "rate_limit_exceeded") from None

    def _usage(req: Request, n_out: int) -> dict:
        return {"prompt_tokens": len(req.prompt), "completion_tokens": n_out,
                "total_tokens": len(req.prompt) + n_out}

    async def _serve(http: HTTPRequest, body: _Body, req: Request, chat: bool):
        events = _submit(req)
        created, cid = int(time.time()), f"{'chatcmpl' if chat else 'cmpl'}-{req.rid}"
        obj = "chat.completion" if chat else "text_completion"

        def choice(ids: list[int], finish: str | None, first: bool = False) -> dict:
            if not chat:
                return {"index": 0, "text": text.decode(ids), "token_ids": ids, "logprobs": None,
                        "finish_reason": finish}
            delta = {"content": text.decode(ids)}
            if first:
                delta["role"] = "assistant"
            return {"index": 0, "delta" if body.stream else "message":
                    delta if body.stream else {"role": "assistant", "content": text.decode(ids)},
                    "token_ids": ids, "logprobs": None, "finish_reason": finish}

        if not body.stream:
            out, finish = [], None
            next_poll = time.monotonic() + DISCONNECT_POLL_S
            try:
                while finish is None:
                    if time.monotonic() >= next_poll:  # tokens may arrive every round: poll by the clock
                        if await http.is_disconnected():
                            return Response(status_code=499)  # nobody reads it; finally cancels the request
                        next_poll = time.monotonic() + DISCONNECT_POLL_S
                    try:
                        kind, val = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
                    except asyncio.TimeoutError:
                        continue
                    if kind == "error":
                        status, msg = val
                        raise APIError(status, msg, "invalid_request_error" if status < 500 else "server_error")
                    if kind == "tokens":
                        out += val
                    else:
                        finish = _FINISH[val]
            finally:
                if finish is None:
                    loop.cancel(req.rid)
            return {"id": cid, "object": obj, "created": created, "model": model_name,
                    "choices": [choice(out, finish)], "usage": _usage(req, len(req.output))}

        async def sse():
            finish, first = None, True
            try:
                while finish is None:
                    kind, val = await events.get()
                    if kind == "error":
                        status, msg = val
                        err = {"message": msg, "type": "invalid_request_error" if status < 500 else "server_error",
                               "param": None, "code": status}
                        yield f"data: {json.dumps({'error': err})}\n\n"
                        finish = "error"
                        break
                    if kind == "tokens":
                        chunk = {"id": cid, "object": obj + ".chunk" if chat else obj, "created": created,
                                 "model": model_name, "choices": [choice(val, None, first)]}
                        first = False
                        yield f"data: {json.dumps(chunk)}\n\n"
                    else:
                        finish = _FINISH[val]
                        chunk = {"id": cid, "object": obj + ".chunk" if chat else obj, "created": created,
                                 "model": model_name, "choices": [choice([], finish)],
                                 "usage": _usage(req, len(req.output))}
                        yield f"data: {json.dumps(chunk)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                if finish is None:  # the client went away mid-stream
                    loop.cancel(req.rid)

        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest, body: CompletionBody):
        _check_body(body)
        try:
            prompt = text.encode(body.prompt) if isinstance(body.prompt, str) else body.prompt
        except TextError as e:
            raise APIError(400, str(e), param="prompt") from None
        return await _serve(http, body, _request(body, prompt, body.max_tokens), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest, body: ChatBody):
        _check_body(body)
        try:
            prompt = text.chat([m.as_dict() for m in body.messages])
        except TextError as e:
            raise APIError(400, str(e), param="messages") from None
        return await _serve(http, body, _request(body, prompt, body.max_completion_tokens or body.max_tokens),
                            chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "ddtree-rtc", "max_model_len": context_limit}]}

    @app.get("/health")
    async def health():
        if loop.error is not None:
            return _error(503, f"the engine loop has failed: {loop.error!r}", "server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(loop.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
