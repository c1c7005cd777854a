"""What one HTTP request's generation is, on the event loop: the server's state
(`ServerState`: engine, tokenizer, chat format, metrics, queue bound), the engine requests of
one HTTP request and their events (`Generation`), and the streaming helpers both APIs use.

Events are handed from the engine's thread to the event loop with `call_soon_threadsafe`;
nothing on the loop waits for the engine. A client that goes away cancels its engine requests.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time

from fastapi import Request
from fastapi.responses import StreamingResponse

from cupool.serve import chat, formats
from cupool.serve import protocol as P
from cupool.serve.grammar import Grammars
from cupool.serve.metrics import Metrics
from cupool.serve.protocol import APIError, bad_request

log = logging.getLogger("cupool.serve")


class ServerState:
    """What the app serves, and counts of finished engine requests by finish_reason."""

    def __init__(self, engine, tokenizer, model_name: str, api_key: str | None = None,
                 max_queue: int | None = None):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.api_key, self.max_queue = api_key, max_queue
        self.created = int(time.time())
        self.finished: collections.Counter = collections.Counter()
        self.running = 0              # engine requests submitted and not finished
        self.metrics = Metrics(engine)
        self.format = formats.detect(chat.template_text(tokenizer)) if tokenizer else None
        self.grammars = Grammars(tokenizer, engine.vocab, engine.eos_ids)

    def check_queue(self, n: int) -> None:
        """429 where admitting n more engine requests would leave more than max_queue of them
        waiting for a slot."""
        if self.max_queue is None:
            return
        waiting = self.running + n - self.engine.max_batch
        if waiting > self.max_queue:
            self.metrics.rejected.labels("queue_full").inc()
            raise APIError(429, f"the server is busy: {self.running} requests hold or wait for "
                           f"its {self.engine.max_batch} slots and at most {self.max_queue} may "
                           f"wait (--max-queue); retry later", type="rate_limit_error",
                           code="queue_full")

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "cupool", "max_model_len": self.engine.max_len}


class Generation:
    """The engine requests of one HTTP request (one per prompt), their events handed from the
    engine's thread to the event loop. `resume_at`: per prompt, where the engine keeps a resume
    point (a chat's conversation end, `chat.ChatPlan.resume_at`), or None.

    `events()` yields (choice index, Event) until every request has finished; `cancel()` cancels
    those that have not (idempotent)."""

    def __init__(self, state: ServerState, prompts: list[list[int]], params: list,
                 prompt_param: str = "prompt", endpoint: str = "completions",
                 constraints: list | None = None, resume_at: list | None = None):
        self.state = state
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.requests = []
        self.index: dict[int, int] = {}
        self.endpoint = endpoint
        self.constraints = constraints or [None] * len(prompts)
        self.resume_at = resume_at or [None] * len(prompts)
        self.started = time.perf_counter()
        self._last_token: dict[int, float] = {}
        state.check_queue(len(prompts))
        try:
            for i, (ids, sp) in enumerate(zip(prompts, params)):
                self._submit(i, len(prompts), ids, sp, prompt_param)
        except BaseException:
            self.cancel()
            raise

    def _submit(self, i: int, n: int, ids: list[int], sp, prompt_param: str) -> None:
        try:
            r = self.state.engine.submit(ids, sp, self._on_event, self.constraints[i],
                                         resume_at=self.resume_at[i])
        except ValueError as e:                  # the engine's checks: context, vocabulary
            where = f"prompt {i}: " if n > 1 else ""
            code = "context_length_exceeded" if "exceed the context" in str(e) else None
            raise bad_request(f"{where}{e}", prompt_param, code) from None
        except RuntimeError as e:                # the engine stopped after an error
            log.error("refusing a request: %s", e)
            raise APIError(503, "the server cannot generate: its engine stopped after an error "
                           "(see the server's log)", type="server_error") from None
        self.requests.append(r)
        self.index[r.id] = i
        self.state.running += 1

    def _on_event(self, ev) -> None:
        """On the engine's thread: hand the event to the loop (cancel when the loop is gone)."""
        try:
            self.loop.call_soon_threadsafe(self._deliver, ev)
        except RuntimeError:                     # the event loop is closed: no one listens
            ev.request.cancel()

    def _deliver(self, ev) -> None:
        """On the loop: time and count the event, queue it for `events()`."""
        r, now, m = ev.request, time.perf_counter(), self.state.metrics
        if ev.token_id is not None:
            last = self._last_token.get(r.id)
            if last is None:
                m.ttft.observe(now - self.started)
            else:
                m.itl.observe(now - last)
            self._last_token[r.id] = now
        if ev.finished:
            self.state.running -= 1
            self.state.finished[ev.finish_reason] += 1
            m.finished(self.endpoint, str(ev.finish_reason), len(r.prompt_ids), r.cached_tokens,
                       len(r.output_ids))
            if ev.finish_reason == "error":
                log.error("request %d failed in the engine: %s", r.id, r.error)
        self.queue.put_nowait(ev)

    async def events(self):
        """(choice index, Event) as they land, until every request has finished (once)."""
        remaining = len(self.requests)
        while remaining:
            ev = await self.queue.get()
            if ev.finished:
                remaining -= 1
            yield self.index[ev.request.id], ev

    async def wait(self) -> None:
        """Until every request has finished."""
        async for _ in self.events():
            pass

    def cancel(self) -> None:
        """Cancel the requests that have not finished (their slots free at the engine's next
        iteration)."""
        for r in self.requests:
            if not r.finished:
                r.cancel()

    def usage(self) -> dict:
        """OpenAI's usage object over every request (read once they have finished)."""
        return P.usage(sum(len(r.prompt_ids) for r in self.requests),
                       sum(len(r.output_ids) for r in self.requests),
                       sum(r.cached_tokens for r in self.requests))

    def log_done(self, what: str, rid: str) -> None:
        u = self.usage()
        reasons = ",".join(sorted({str(r.finish_reason) for r in self.requests}))
        log.info("%s %s: %d prompt + %d completion tokens, %s, %.3f s", what, rid,
                 u["prompt_tokens"], u["completion_tokens"], reasons,
                 time.perf_counter() - self.started)


def outcome_error(r) -> APIError | None:
    """The error a finished engine request reports to its client (None: it completed)."""
    if r.finish_reason == "error":
        return APIError(500, "generation failed in the engine (see the server's log)",
                        type="server_error")
    if r.finish_reason == "cancelled":
        return APIError(503, "the generation was cancelled: the server is shutting down",
                        type="server_error")
    return None


class EventStream(StreamingResponse):
    """A server-sent event stream that calls `on_close` however it ends: completed, the client
    gone (sending failed or uvicorn reported the disconnect), or the server stopping."""
    media_type = "text/event-stream"

    def __init__(self, content, on_close):
        super().__init__(content, headers={"Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def sse(obj) -> str:
    """One server-sent event carrying `obj` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def disconnected(request: Request) -> None:
    """Return when uvicorn reports that the client of `request` went away (its body is read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_done(gen: Generation, request: Request) -> bool:
    """Wait for every engine request of `gen`; False (and the requests cancelled) where the
    client disconnects first."""
    waiting = asyncio.ensure_future(gen.wait())
    gone = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({waiting, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        finished = waiting.done()
        if not finished:
            waiting.cancel()
            gen.cancel()
    if not finished:
        return False
    waiting.result()                         # raises what the wait raised
    return True
