"""The OpenAI-compatible HTTP API over one `cupool.Engine`: `create_app(engine, tokenizer,
model_name)` returns the FastAPI app.

Endpoints: GET /v1/models, GET /v1/models/{id}, POST /v1/completions, POST /v1/chat/completions,
POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API,
`cupool.serve.messages`), GET /health, GET /metrics (Prometheus text, `cupool.serve.metrics`).
The OpenAI request and response formats are in `cupool.serve.protocol`; chat requests of both
APIs are rendered and their outputs parsed (tool calls, reasoning) by `cupool.serve.chat` with
the model's chat format (`cupool.serve.formats`). Generations and their events:
`cupool.serve.generation`.

Operations: with an API key (`cupool.serve.auth`) every endpoint but /health answers 401 without
it. With `max_queue`, a request that would leave more than that many engine requests waiting for
a slot is refused with 429 at once (OpenAI's error object), rather than queued without bound.

How a generation runs: the handler checks and tokenizes the request (tokenizing on a worker
thread), submits one engine request per prompt (`Engine.submit` only queues), and waits for the
engine's events, which its callback hands from the engine's thread to the event loop with
`call_soon_threadsafe`. Nothing on the event loop waits for the engine, so every HTTP request
is submitted to the one engine at once and concurrent requests share its decode batch.

A client that goes away cancels its engine requests, which frees their slots: a stream when
sending to it fails or uvicorn reports the disconnect, a non-streaming request when uvicorn
reports the disconnect while it waits.

Errors are OpenAI's error object (Anthropic's on /v1/messages) with a fitting status: request
validation (FastAPI's 422) is turned into 400, an unknown model is 404 `model_not_found`,
anything unexpected is a 500 with a generic message while the traceback goes to the log
("cupool.serve").
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from cupool.serve import auth, chat, messages
from cupool.serve import protocol as P
from cupool.serve.generation import (SSE_DONE, EventStream, Generation, ServerState,
                                     outcome_error, sse, until_done)
from cupool.serve.grammar import Grammars
from cupool.serve.metrics import CONTENT_TYPE
from cupool.serve.protocol import APIError, bad_request

log = logging.getLogger("cupool.serve")


def _guarded(handler):
    """Turn an unexpected exception of an endpoint into a logged 500 (APIError passes)."""
    @functools.wraps(handler)
    async def run(*args, **kwargs):
        try:
            return await handler(*args, **kwargs)
        except APIError:
            raise
        except Exception as e:
            log.exception("internal error in %s", handler.__name__)
            raise APIError(500, f"internal server error ({type(e).__name__}); see the server's "
                           f"log", type="server_error") from None
    return run


_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\])$")   # in pydantic's locs


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One line for FastAPI's validation errors, and the parameter it concerns."""
    parts, param = [], None
    for err in exc.errors():
        loc = [x for x in err.get("loc", ()) if x != "body" and not _UNION_TAG.match(str(x))]
        kind = err.get("type", "")
        if kind == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            pos = f" at character {loc[0]}" if loc else ""
            return f"the request body is not valid JSON: {detail}{pos}", None
        name = ""
        for x in loc:
            name += f"[{x}]" if isinstance(x, int) else (f".{x}" if name else str(x))
        if param is None:
            param = name or None
        if kind == "missing" and not loc:
            parts.append("the request needs a JSON object as its body")
        elif kind == "model_attributes_type" and not loc:
            parts.append("the request body must be a JSON object (content-type: application/json)")
        elif kind == "missing":
            parts.append(f"{name} is required")
        elif kind == "extra_forbidden":
            parts.append(f"unknown or unsupported parameter {name!r}")
        elif kind == "value_error":
            parts.append(str((err.get("ctx") or {}).get("error", err.get("msg"))))
        else:
            parts.append(f"{name}: {err.get('msg')}" if name else str(err.get("msg")))
        if len(parts) == 3:
            break
    return "; ".join(parts) or "invalid request", param


def create_app(engine, tokenizer, model_name: str, *, api_key: str | None = None,
               max_queue: int | None = None) -> FastAPI:
    """The FastAPI app serving `engine` (started by the caller: `engine.start()`) as
    `model_name`; `tokenizer` (None: token-id prompts only, no chat) tokenizes prompts and
    applies the chat template. `api_key`: required on every endpoint but /health (None: open).
    `max_queue`: most engine requests waiting for a slot (None: no bound)."""
    if max_queue is not None and (isinstance(max_queue, bool) or not isinstance(max_queue, int)
                                  or max_queue < 0):
        raise ValueError(f"max_queue must be None or an int >= 0, got {max_queue!r}")
    state = ServerState(engine, tokenizer, model_name, api_key, max_queue)
    app = FastAPI(title="cupool", summary="OpenAI-compatible API of a cupool Engine",
                  version=_version())
    app.state.cupool = state

    def error(request: Request, status: int, body: dict, headers=None) -> JSONResponse:
        """An error response: OpenAI's object `body`, or Anthropic's on /v1/messages."""
        if messages.is_messages_path(request.url.path):
            body = messages.error_body(status, body["error"]["message"])
        return JSONResponse(body, status_code=status, headers=headers)

    @app.middleware("http")
    async def require_key(request: Request, call_next):
        if auth.allowed(request.url.path, request.headers, state.api_key):
            return await call_next(request)
        state.metrics.rejected.labels("unauthorized").inc()
        message = auth.refusal(request.headers)
        return error(request, 401, P.error_body(message, "invalid_request_error",
                                                code="invalid_api_key"),
                     headers={"WWW-Authenticate": "Bearer"})

    # --- errors -------------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return error(request, exc.status, exc.body())

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error(request, 400, P.error_body(message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "unknown_url", 405: "method_not_allowed"}.get(exc.status_code)
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error(request, exc.status_code, P.error_body(message, kind, code=code),
                     headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        log.error("unhandled error on %s %s", request.method, request.url.path,
                  exc_info=(type(exc), exc, exc.__traceback__))
        return error(request, 500, P.error_body("internal server error; see the server's log",
                                                "server_error"))

    # --- helpers --------------------------------------------------------------------------------------
    def check_model(name: str) -> None:
        if name != state.model_name:
            raise APIError(404, f"the model {name!r} does not exist: this server serves "
                           f"{state.model_name!r}", param="model", code="model_not_found")

    def params_for(req, prompts: list[list[int]]) -> list:
        if req.stop and state.tokenizer is None:
            raise bad_request("stop strings need a tokenizer and this model has none: use "
                              "stop_token_ids", "stop")
        asked = P.requested_max_tokens(req)
        out = []
        for ids in prompts:
            n = asked if asked is not None else P.default_max_tokens(len(ids), engine.max_len)
            out.append(P.sampling_params(req, n))
        return out

    def tokenize_prompts(prompt) -> list[list[int]]:
        items = [prompt] if isinstance(prompt, str) or (
            prompt and all(isinstance(x, int) for x in prompt)) else list(prompt)
        if not items:
            raise bad_request("prompt is empty: give a string or token ids", "prompt")
        out = []
        for p in items:
            if isinstance(p, str):
                if state.tokenizer is None:
                    raise bad_request("this model has no tokenizer: give the prompt as token "
                                      "ids (a list of ints)", "prompt")
                out.append(list(state.tokenizer(p)["input_ids"]))
            else:
                out.append(list(p))
        return out

    def token_ids(req, r) -> list[int] | None:
        return list(r.output_ids) if req.return_token_ids else None

    @functools.lru_cache(maxsize=65536)
    def text_of(token: int) -> str:
        tok = state.tokenizer
        return tok.decode([token]) if tok is not None else f"<{token}>"

    def completion_lp(body, entries, offset=0):
        if body.logprobs is None:
            return None
        return P.completion_logprobs(entries, text_of, offset)

    def finished_output(gen, plan, one_call: bool, what: str, rid: str):
        """A finished one-request generation's (request, parsed output, tool calls): its error
        raised, its end logged, its text through the chat format's parser."""
        r = gen.requests[0]
        if (err := outcome_error(r)) is not None:
            raise err
        gen.log_done(what, rid)
        out = plan.output()
        out.feed(r.text)
        out.finish()
        return r, out, (out.calls[:1] if one_call else out.calls)

    def chat_lp(body, entries):
        return P.chat_logprobs(entries, text_of) if body.logprobs else None

    # --- endpoints ------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if engine.broken:
            return JSONResponse(P.error_body(f"the engine stopped after an error: "
                                             f"{engine.broken}", "server_error"), status_code=503)
        return {"status": "ok", "running": state.running, "finished": dict(state.finished)}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [state.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        check_model(model_id)
        return state.model_card()

    @app.post("/v1/completions")
    @_guarded
    async def completions(body: P.CompletionRequest, request: Request):
        check_model(body.model)
        P.check_completion(body)
        prompts = await run_in_threadpool(tokenize_prompts, body.prompt)
        params = params_for(body, prompts)
        gen = Generation(state, prompts, params, endpoint="completions")
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            return EventStream(_stream_completion(gen, body, rid, created), gen.cancel)
        if not await until_done(gen, request):      # no one reads this: the client is gone
            return JSONResponse(P.error_body("the client disconnected"), status_code=499)
        for r in gen.requests:
            if (err := outcome_error(r)) is not None:
                raise err
        gen.log_done("completion", rid)
        choices = [P.completion_choice(i, r.text, P.FINISH_REASONS[r.finish_reason],
                                       token_ids(body, r),
                                       r.prompt_ids if body.return_token_ids else None,
                                       completion_lp(body, r.logprobs))
                   for i, r in enumerate(gen.requests)]
        return P.envelope("text_completion", rid, created, state.model_name, choices,
                          gen.usage())

    @app.post("/v1/chat/completions")
    @_guarded
    async def chat_completions(body: P.ChatCompletionRequest, request: Request):
        check_model(body.model)
        P.check_chat(body)
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        schema = Grammars.schema_of(body.response_format)
        plan = await run_in_threadpool(
            chat.plan, state.tokenizer, state.format, P.chat_messages(body), tools=tools,
            tool_choice=body.tool_choice, template_kwargs=P.template_kwargs(body),
            structured=schema is not None)
        params = params_for(body, [plan.ids])
        params[0].skip_special_tokens = plan.skip_special_tokens
        constraint = None
        if schema is not None:
            constraint = await run_in_threadpool(state.grammars.constraint, schema)
        gen = Generation(state, [plan.ids], params, prompt_param="messages", endpoint="chat",
                         constraints=[constraint], resume_at=[plan.resume_at])
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        one_call = body.parallel_tool_calls is False
        if body.stream:
            return EventStream(_stream_chat(gen, body, rid, created, plan, one_call), gen.cancel)
        if not await until_done(gen, request):
            return JSONResponse(P.error_body("the client disconnected"), status_code=499)
        r, out, calls = finished_output(gen, plan, one_call, "chat completion", rid)
        reason = "tool_calls" if calls else P.FINISH_REASONS[r.finish_reason]
        choice = P.chat_choice(0, P.assistant_message(out.content, out.reasoning, calls), reason,
                               token_ids(body, r),
                               r.prompt_ids if body.return_token_ids else None,
                               chat_lp(body, r.logprobs))
        return P.envelope("chat.completion", rid, created, state.model_name, [choice],
                          gen.usage())

    # --- the Anthropic Messages API ---------------------------------------------------------------
    def messages_plan(body):
        tools, choice, one = messages.tools_and_choice(body)
        return chat.plan(state.tokenizer, state.format, messages.conversation(body), tools=tools,
                         tool_choice=choice, template_kwargs=messages.template_kwargs(body)), one

    @app.post("/v1/messages")
    @_guarded
    async def create_message(body: messages.MessagesRequest, request: Request):
        check_model(body.model)
        plan, one_call = await run_in_threadpool(messages_plan, body)
        sp = messages.sampling_params(body)
        sp.skip_special_tokens = plan.skip_special_tokens
        gen = Generation(state, [plan.ids], [sp], prompt_param="messages", endpoint="messages",
                         resume_at=[plan.resume_at])
        mid = messages.message_id()
        if body.stream:
            return EventStream(_stream_message(gen, body, mid, plan, one_call), gen.cancel)
        if not await until_done(gen, request):
            return JSONResponse(messages.error_body(499, "the client disconnected"),
                                status_code=499)
        r, out, calls = finished_output(gen, plan, one_call, "message", mid)
        return messages.message(mid, state.model_name, r, out, calls)

    @app.post("/v1/messages/count_tokens")
    @_guarded
    async def count_message_tokens(body: messages.CountTokensRequest):
        check_model(body.model)
        plan, _ = await run_in_threadpool(messages_plan, body)
        return {"input_tokens": len(plan.ids)}

    async def _stream_message(gen: Generation, body, mid: str, plan, one_call: bool):
        out, blocks = plan.output(), messages.BlockStream()
        r = gen.requests[0]
        try:
            start = {"id": mid, "type": "message", "role": "assistant",
                     "model": state.model_name, "content": [], "stop_reason": None,
                     "stop_sequence": None, "usage": {"input_tokens": len(r.prompt_ids),
                                                      "output_tokens": 0}}
            yield messages.event("message_start", {"message": start})
            async for _, ev in gen.events():
                for line in blocks.pieces(out.feed(ev.text), one_call, out.calls):
                    yield line
                if not ev.finished:
                    continue
                if (err := outcome_error(ev.request)) is not None:
                    gen.cancel()
                    yield messages.event("error", messages.error_body(err.status, err.message))
                    return
                for line in blocks.pieces(out.finish(), one_call, out.calls) + blocks.close():
                    yield line
                reason, seq = messages.stop_reason(r, out.calls)
                yield messages.event("message_delta", {
                    "delta": {"stop_reason": reason, "stop_sequence": seq},
                    "usage": messages.usage(r)})
                yield messages.event("message_stop", {})
            gen.log_done("message", mid)
        except asyncio.CancelledError:
            gen.cancel()
            raise
        except Exception as e:
            gen.cancel()
            log.exception("internal error in the stream of %s", mid)
            yield messages.event("error", messages.error_body(
                500, f"internal server error ({type(e).__name__}); see the server's log"))
        finally:
            gen.cancel()

    # --- streams --------------------------------------------------------------------------------------
    def include_usage(body) -> bool:
        return bool(body.stream_options and body.stream_options.include_usage)

    async def _stream(gen: Generation, body, rid: str, created: int, obj: str, what: str,
                      first, pieces, last):
        """The chunks of a stream: `first()` (or None), then the choices `pieces(index, event)`
        gives for each event, those of `last(index, event)` for each finished request, the
        usage chunk where asked, and [DONE]. A request that fails ends the stream with an error
        object."""
        with_usage = include_usage(body)

        def chunk(choices, usage_=None):
            return sse(P.envelope(obj, rid, created, state.model_name, choices, usage_,
                                  with_usage_key=with_usage))
        try:
            if first is not None:
                yield chunk([first()])
            async for i, ev in gen.events():
                for c in pieces(i, ev):
                    yield chunk([c])
                if ev.finished:
                    if (err := outcome_error(ev.request)) is not None:
                        gen.cancel()
                        yield sse(err.body())
                        yield SSE_DONE
                        return
                    for c in last(i, ev):
                        yield chunk([c])
            if with_usage:
                yield chunk([], gen.usage())
            yield SSE_DONE
            gen.log_done(what, rid)
        except asyncio.CancelledError:
            gen.cancel()
            raise
        except Exception as e:
            gen.cancel()
            log.exception("internal error in the stream of %s", rid)
            yield sse(P.error_body(f"internal server error ({type(e).__name__}); see the "
                                   f"server's log", "server_error"))
            yield SSE_DONE
        finally:
            gen.cancel()

    def _event_extras(body, ev):
        ids = [ev.token_id] if body.return_token_ids and ev.token_id is not None else None
        lps = [ev.logprobs] if ev.logprobs is not None else None
        return ids, lps

    def _stream_completion(gen, body, rid, created):
        def pieces(i, ev):
            ids, lps = _event_extras(body, ev)
            if not (ev.text or ids or lps):
                return []
            return [P.completion_chunk_choice(i, ev.text, None, ids,
                                              completion_lp(body, lps or []))]
        return _stream(
            gen, body, rid, created, "text_completion", "completion", None, pieces,
            lambda i, ev: [P.completion_chunk_choice(i, "", P.FINISH_REASONS[ev.finish_reason])])

    def _stream_chat(gen, body, rid, created, plan, one_call: bool):
        out = plan.output()

        def deltas(i, ev, parsed):
            ids, lps = _event_extras(body, ev)
            found = []
            for piece in parsed:
                if piece.kind == "tool":
                    k = out.calls.index(piece.call)
                    if one_call and k > 0:
                        continue
                    found.append({"tool_calls": [P.tool_call_out(k, piece.call)]})
                elif piece.text:
                    key = "reasoning_content" if piece.kind == "reasoning" else "content"
                    found.append({key: piece.text})
            if not found and (ids or lps):
                found.append({})
            choices = [P.chat_chunk_choice(i, d, None) for d in found]
            if choices:                   # token ids and logprobs ride on the event's first delta
                choices[0]["logprobs"] = chat_lp(body, lps or [])
                if ids is not None:
                    choices[0]["token_ids"] = ids
            return choices

        def last(i, ev):
            choices = deltas(i, _NoExtras, out.finish())      # what the parser held back
            reason = "tool_calls" if out.calls else P.FINISH_REASONS[ev.finish_reason]
            return choices + [P.chat_chunk_choice(i, {}, reason)]

        return _stream(
            gen, body, rid, created, "chat.completion.chunk", "chat completion",
            lambda: P.chat_chunk_choice(0, {"role": "assistant", "content": ""}, None),
            lambda i, ev: deltas(i, ev, out.feed(ev.text)), last)

    return app


class _NoExtras:
    """An event without token ids or logprobs (for the pieces a parser releases at the end)."""
    token_id = None
    logprobs = None


def _version() -> str:
    from cupool import __version__
    return __version__
