"""The HTTP app: OpenAI's ``/v1/completions`` and ``/v1/chat/completions``, streamed or not, plus
``/v1/models``, ``/health`` and ``/metrics``. Errors use OpenAI's body:
``{"error": {"message", "type", "param", "code"}}``; bad input is 400, a full queue is 429.

Beyond OpenAI's fields each choice carries ``token_ids`` (the generated ids), and ``prompt`` may be
a list of token ids. ``stop`` strings must each be one token of the model's tokenizer (the engine
stops on token ids); ``stop_token_ids`` takes ids directly.
"""

from __future__ import annotations

import json
import time
from typing import Literal

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


def _error(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": status}},
                        status_code=status)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: Literal[1] = 1
    stream: bool = False
    stream_options: dict | None = None
    user: str | None = None


class CompletionBody(_Body):
    prompt: str | list[int]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool"]
    content: str
    name: str | None = None


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


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

    @app.exception_handler(APIError)
    async def _api_error(_req, e: APIError):
        return _error(e.status, e.message, e.type, e.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            msg = f"malformed JSON in the request body: {first.get('ctx', {}).get('error', first.get('msg'))}"
        elif first.get("type") == "extra_forbidden":
            msg = f"unknown field {'.'.join(loc)!r}"
        else:
            msg = "; ".join(f"{'.'.join(str(x) for x in er.get('loc', ()) if x != 'body')}: {er.get('msg')}"
                            for er in errs)
        return _error(400, msg, "invalid_request_error", ".".join(loc) or None)

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
            try:
                while finish is None:
                    kind, val = await events.get()
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
                    "choices": [choice(out, finish)], "usage": _usage(req, len(out))}

        async def sse():
            n, finish, first = 0, None, True
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
                        n += len(val)
                        chunk = {"id": cid, "object": obj + ".chunk" if chat else obj, "created": created,
                                 "model": model_name, "choices": [choice(val, None, first)]}
                        first = False
                        yield f"data: {json.dumps(chunk)}\n\n"
                    else:
                        finish = _FINISH[val]
                        chunk = {"id": cid, "object": obj + ".chunk" if chat else obj, "created": created,
                                 "model": model_name, "choices": [choice([], finish)], "usage": _usage(req, n)}
                        yield f"data: {json.dumps(chunk)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                if finish is None:  # the client went away mid-stream
                    loop.cancel(req.rid)

        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest, body: CompletionBody):
        try:
            prompt = text.encode(body.prompt) if isinstance(body.prompt, str) else body.prompt
        except TextError as e:
            raise APIError(400, str(e), param="prompt") from None
        return await _serve(http, body, _request(body, prompt, body.max_tokens), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest, body: ChatBody):
        try:
            prompt = text.chat([m.model_dump(exclude_none=True) for m in body.messages])
        except TextError as e:
            raise APIError(400, str(e), param="messages") from None
        return await _serve(http, body, _request(body, prompt, body.max_completion_tokens or body.max_tokens),
                            chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "ddtree-rtc", "max_model_len": engine.max_context}]}

    @app.get("/health")
    async def health():
        if loop.error is not None:
            return _error(503, f"the engine loop has failed: {loop.error!r}", "server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(loop.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
