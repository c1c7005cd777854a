"""The OpenAI-compatible wire format of `cupool serve`: request models (pydantic), the checks that
turn a request into `SamplingParams`, the error object, and the response and chunk objects.

Requests are parsed strictly: a field of the wrong type ("0.5" for a number, 1.0 for an integer)
and a field this server does not know are refused rather than coerced or ignored. Parameters
OpenAI defines whose only supported value is the neutral one (n, presence_penalty,
frequency_penalty, logit_bias, echo, best_of, suffix) are accepted at that value and refused
otherwise, each with a message that says so. logprobs are the model's own log-probabilities
(before temperature, top-k/top-p and grammar masks), at most MAX_LOGPROBS alternatives a token.

Defaults where a request leaves a field out: temperature 1 and top_p 1 (OpenAI's), no top-k,
a seed drawn from the OS, and max_tokens = what is left of the context after the prompt,
capped at DEFAULT_MAX_TOKENS.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict

from cupool.sampling import MAX_LOGPROBS, SamplingParams

DEFAULT_MAX_TOKENS = 256      # cap of the max_tokens a request that gives none gets
FINISH_REASONS = {"stop": "stop", "length": "length"}   # engine -> OpenAI


class APIError(Exception):
    """A request the server refuses or cannot serve, as OpenAI reports it: the HTTP status and
    the error object `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = \
            status, message, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# --- shapes checked before the type union, for one clear message instead of one per branch ------
def _prompt_shape(v: Any) -> Any:
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        if all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            return v
        if all(isinstance(x, str) for x in v):
            return v
        if all(isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                           for t in x) for x in v):
            return v
    raise ValueError("prompt must be a string, a list of token ids (ints), or a list of "
                     "prompts (strings, or lists of token ids)")


def _stop_shape(v: Any) -> Any:
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return v
    raise ValueError("stop must be a string or a list of strings")


def _content_shape(v: Any) -> Any:
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, list) and all(isinstance(p, dict) and isinstance(p.get("type"), str)
                                   and isinstance(p.get("text", ""), str) for p in v):
        return v
    raise ValueError("content must be a string or a list of content parts "
                     "({\"type\": \"text\", \"text\": ...})")


Prompt = Annotated[str | list[int] | list[str] | list[list[int]], BeforeValidator(_prompt_shape)]
Stop = Annotated[str | list[str] | None, BeforeValidator(_stop_shape)]

_STRICT = ConfigDict(extra="forbid", strict=True)


class StreamOptions(BaseModel):
    """`stream_options`: include_usage adds a last chunk (choices []) with the usage."""
    model_config = _STRICT
    include_usage: bool = False


class _Generation(BaseModel):
    """Fields both endpoints take. Extensions (as vLLM accepts them): top_k (-1 or 0: off),
    ignore_eos, stop_token_ids, return_token_ids (token ids in each choice and chunk)."""
    model_config = _STRICT
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: Stop = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None           # an end-user id for the caller's records; not used


class CompletionRequest(_Generation):
    """POST /v1/completions. Several prompts in one request are served as choices 0, 1, ...
    (one per prompt, in order), as OpenAI does."""
    prompt: Prompt
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(BaseModel):
    """One part of a message's content; only {"type": "text", "text": ...} is served."""
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = _STRICT
    name: str
    arguments: str


class ToolCallIn(BaseModel):
    """A tool call of an earlier assistant message."""
    model_config = _STRICT
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """A message of the conversation; which roles exist is up to the model's chat template.
    content may be null on an assistant message that carries tool_calls."""
    model_config = _STRICT
    role: str
    content: Annotated[str | list[ContentPart] | None, BeforeValidator(_content_shape)] = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDef(BaseModel):
    model_config = _STRICT
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = _STRICT
    type: str
    function: FunctionDef


class ChatCompletionRequest(_Generation):
    """POST /v1/chat/completions. max_completion_tokens is max_tokens under its newer name.
    Extension (as vLLM accepts it): chat_template_kwargs, arguments for the chat template
    (enable_thinking, ...)."""
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    response_format: dict[str, Any] | None = None


# --- checks ---------------------------------------------------------------------------------------
def check_common(req: _Generation) -> None:
    """Refuse what this server does not do, naming the parameter (APIError 400)."""
    if req.n not in (None, 1):
        raise bad_request(f"n={req.n} is not supported: this server returns one choice per "
                          f"prompt (n=1); send several requests instead", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(req, name)
        if v not in (None, 0):
            raise bad_request(f"{name}={v} is not supported (only 0)", name)
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")


def check_completion(req: CompletionRequest) -> None:
    check_common(req)
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise bad_request(f"logprobs must be in 0..{MAX_LOGPROBS}, got {req.logprobs}",
                          "logprobs")
    if req.echo:
        raise bad_request("echo is not supported", "echo")
    if req.best_of not in (None, 1):
        raise bad_request(f"best_of={req.best_of} is not supported (only 1)", "best_of")
    if req.suffix is not None:
        raise bad_request("suffix is not supported", "suffix")


def check_chat(req: ChatCompletionRequest) -> None:
    check_common(req)
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be in 0..{MAX_LOGPROBS}, got "
                              f"{req.top_logprobs}", "top_logprobs")
    if not req.messages:
        raise bad_request("messages is empty: give at least one message", "messages")
    for i, m in enumerate(req.messages):
        if not m.role:
            raise bad_request(f"messages[{i}].role is empty", f"messages[{i}].role")
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise bad_request(f"messages[{i}].content is required (null only on an assistant "
                              f"message with tool_calls)", f"messages[{i}].content")
        if m.tool_calls and m.role != "assistant":
            raise bad_request(f"messages[{i}]: tool_calls belong to assistant messages, not "
                              f"{m.role!r}", f"messages[{i}].tool_calls")
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise bad_request(f"messages[{i}].content[{j}]: only text parts "
                                      f"({{\"type\": \"text\", \"text\": ...}}) are supported, "
                                      f"got type {part.type!r}", f"messages[{i}].content")
    check_tools(req)
    if req.max_tokens is not None and req.max_completion_tokens is not None \
            and req.max_tokens != req.max_completion_tokens:
        raise bad_request(f"max_tokens={req.max_tokens} and max_completion_tokens="
                          f"{req.max_completion_tokens} disagree: give one of them",
                          "max_completion_tokens")


def check_tools(req: ChatCompletionRequest) -> None:
    for i, t in enumerate(req.tools or []):
        if t.type != "function":
            raise bad_request(f"tools[{i}].type must be 'function', got {t.type!r}",
                              f"tools[{i}].type")
    c = req.tool_choice
    if isinstance(c, str) and c not in ("auto", "none", "required"):
        raise bad_request(f"tool_choice must be 'auto', 'none', 'required' or "
                          f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got "
                          f"{c!r}", "tool_choice")
    if isinstance(c, dict) and not (c.get("type") == "function"
                                    and isinstance(c.get("function"), dict)
                                    and isinstance(c["function"].get("name"), str)):
        raise bad_request("tool_choice as an object must be {\"type\": \"function\", "
                          "\"function\": {\"name\": ...}}", "tool_choice")


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    """The conversation as chat templates take it (OpenAI's shape): text parts joined by
    newlines, tool calls with their arguments' JSON text, tool results with their call's id."""
    out = []
    for m in req.messages:
        if m.content is None:
            content = ""
        else:
            content = m.content if isinstance(m.content, str) else \
                "\n".join(p.text for p in m.content)
        d = {"role": m.role, "content": content}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id or f"call_{i}", "type": "function",
                                "function": {"name": c.function.name,
                                             "arguments": c.function.arguments}}
                               for i, c in enumerate(m.tool_calls)]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            d["reasoning_content"] = m.reasoning_content
        out.append(d)
    return out


def template_kwargs(req: ChatCompletionRequest) -> dict:
    """Arguments for the chat template: chat_template_kwargs, and reasoning_effort (gpt-oss)."""
    kw = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:
        kw.setdefault("reasoning_effort", req.reasoning_effort)
    return kw


def tool_call_out(index: int | None, call) -> dict:
    """A parsed ToolCall as OpenAI writes it (with its index in a stream's delta)."""
    d = {"id": call.id, "type": "function",
         "function": {"name": call.name, "arguments": call.arguments}}
    return d if index is None else {"index": index, **d}


def requested_max_tokens(req: _Generation) -> int | None:
    """max_tokens (or max_completion_tokens) as given, checked to be >= 1; None when absent."""
    n, name = req.max_tokens, "max_tokens"
    if n is None and isinstance(req, ChatCompletionRequest):
        n, name = req.max_completion_tokens, "max_completion_tokens"
    if n is not None and n < 1:
        raise bad_request(f"{name} must be >= 1, got {n}", name)
    return n


def default_max_tokens(prompt_len: int, max_len: int) -> int:
    """What is left of the context after the prompt, capped at DEFAULT_MAX_TOKENS; at least 1,
    so that a prompt that fills the context is refused by the engine with the numbers."""
    return max(1, min(DEFAULT_MAX_TOKENS, max_len - prompt_len))


def logprobs_asked(req: _Generation) -> int | None:
    """The alternatives a token reports (0: the chosen token's alone), or None (no logprobs)."""
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return getattr(req, "logprobs", None)


def sampling_params(req: _Generation, max_tokens: int) -> SamplingParams:
    """The engine's SamplingParams of a request (APIError 400 naming the field when one is out
    of range)."""
    t = 1.0 if req.temperature is None else req.temperature
    if not math.isfinite(t) or t < 0:
        raise bad_request(f"temperature must be a number >= 0, got {t}", "temperature")
    p = 1.0 if req.top_p is None else req.top_p
    if not 0 < p <= 1:
        raise bad_request(f"top_p must be in (0, 1], got {p}", "top_p")
    k = 0 if req.top_k is None else req.top_k
    if k < -1:
        raise bad_request(f"top_k must be >= 1, or -1 or 0 for no limit; got {k}", "top_k")
    if req.seed is not None and not 0 <= req.seed < 2**63:
        raise bad_request(f"seed must be in [0, 2^63), got {req.seed}", "seed")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(s == "" for s in stop):
        raise bad_request("stop strings must not be empty", "stop")
    ids = list(req.stop_token_ids or [])
    if any(i < 0 for i in ids):
        raise bad_request("stop_token_ids must be token ids (>= 0)", "stop_token_ids")
    try:
        return SamplingParams(temperature=float(t), top_k=max(k, 0), top_p=float(p), seed=req.seed,
                              max_tokens=max_tokens, stop=stop, stop_token_ids=ids,
                              ignore_eos=req.ignore_eos, logprobs=logprobs_asked(req))
    except ValueError as e:
        raise bad_request(str(e)) from None


# --- responses ------------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; cached_tokens: prompt tokens whose KV a slot already held."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_choice(index: int, text: str, finish_reason: str | None,
                      token_ids: list[int] | None = None,
                      prompt_token_ids: list[int] | None = None,
                      logprobs: dict | None = None) -> dict:
    c = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if token_ids is not None:
        c["token_ids"] = token_ids
    if prompt_token_ids is not None:
        c["prompt_token_ids"] = prompt_token_ids
    return c


def assistant_message(content: str, reasoning: str = "", calls=()) -> dict:
    """The assistant's message: content (null where it is empty beside tool calls), the
    reasoning as reasoning_content (where there is any), tool_calls (where there are any)."""
    m = {"role": "assistant", "content": content if content or not calls else None}
    if reasoning:
        m["reasoning_content"] = reasoning
    if calls:
        m["tool_calls"] = [tool_call_out(None, c) for c in calls]
    return m


def chat_choice(index: int, message: dict, finish_reason: str | None,
                token_ids: list[int] | None = None,
                prompt_token_ids: list[int] | None = None,
                logprobs: dict | None = None) -> dict:
    c = {"index": index, "message": message, "logprobs": logprobs,
         "finish_reason": finish_reason}
    if token_ids is not None:
        c["token_ids"] = token_ids
    if prompt_token_ids is not None:
        c["prompt_token_ids"] = prompt_token_ids
    return c


def completion_chunk_choice(index: int, text: str, finish_reason: str | None,
                            token_ids: list[int] | None = None,
                            logprobs: dict | None = None) -> dict:
    c = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if token_ids is not None:
        c["token_ids"] = token_ids
    return c


def chat_chunk_choice(index: int, delta: dict, finish_reason: str | None,
                      token_ids: list[int] | None = None, logprobs: dict | None = None) -> dict:
    c = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    if token_ids is not None:
        c["token_ids"] = token_ids
    return c


def envelope(obj: str, id: str, created: int, model: str, choices: list[dict],
             usage_: dict | None = None, *, with_usage_key: bool = True) -> dict:
    """A response or chunk object: `obj` is "text_completion", "chat.completion" or
    "chat.completion.chunk". `with_usage_key`: write "usage" (null when absent)."""
    out = {"id": id, "object": obj, "created": created, "model": model, "choices": choices}
    if with_usage_key:
        out["usage"] = usage_
    return out


# --- logprobs -------------------------------------------------------------------------------------
def _token_entry(text_of, token: int, logprob: float) -> dict:
    t = text_of(token)
    return {"token": t, "logprob": logprob, "bytes": list(t.encode("utf-8"))}


def chat_logprobs(entries, text_of) -> dict:
    """A chat choice's logprobs object from the engine's (token, logprob, [(id, logprob)])
    entries; `text_of(id)` is a token's text."""
    content = []
    for token, lp, top in entries:
        e = _token_entry(text_of, token, lp)
        e["top_logprobs"] = [_token_entry(text_of, i, v) for i, v in top]
        content.append(e)
    return {"content": content, "refusal": None}


def completion_logprobs(entries, text_of, offset: int = 0) -> dict:
    """A completion choice's (legacy) logprobs object; text offsets start at `offset`."""
    tokens, lps, tops, offsets = [], [], [], []
    for token, lp, top in entries:
        t = text_of(token)
        offsets.append(offset)
        offset += len(t)
        tokens.append(t)
        lps.append(lp)
        tops.append({text_of(i): v for i, v in top})
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
            "text_offset": offsets}
