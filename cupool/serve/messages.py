"""The Anthropic Messages API beside the OpenAI one: POST /v1/messages (and
/v1/messages/count_tokens), for clients and coding agents that speak Anthropic's protocol.

A request is converted to the OpenAI-shaped conversation `cupool.serve.chat` renders: `system`
(a string or text blocks) is the system message; a user turn's `tool_result` blocks become
`tool` messages (before the turn's text); an assistant turn's `thinking` blocks become its
reasoning_content and its `tool_use` blocks its tool_calls. `tools` (name, description,
input_schema) are the template's tools; tool_choice auto / any / tool / none map to auto /
required / a named function / none, and disable_parallel_tool_use keeps the first call;
`thinking` {"type": "enabled" | "disabled"} sets the template's enable_thinking. cache_control
marks are accepted and need nothing: prefix reuse is automatic.

The answer's content blocks are the parsed output: thinking, text, tool_use (input as an
object). stop_reason: end_turn (EOS), stop_sequence (with the sequence), max_tokens, tool_use.
usage: input_tokens (prompt tokens prefilled), cache_read_input_tokens (prompt tokens whose KV
was reused), output_tokens. Streams are Anthropic's events: message_start,
content_block_start / _delta (text_delta, thinking_delta, input_json_delta) / _stop,
message_delta (stop_reason, usage), message_stop; a failure mid-stream is an `error` event.

Errors are Anthropic's object {"type": "error", "error": {"type", "message"}} with the same
statuses as the OpenAI endpoints.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict

from cupool.sampling import SamplingParams
from cupool.serve.protocol import bad_request

PATH_PREFIX = "/v1/messages"
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 499: "invalid_request_error", 500: "api_error",
               503: "overloaded_error"}
STOP_REASONS = {"length": "max_tokens"}


def is_messages_path(path: str) -> bool:
    return path == PATH_PREFIX or path.startswith(PATH_PREFIX + "/")


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"),
                                       "message": message}}


# --- requests ---------------------------------------------------------------------------------------
_OPEN = ConfigDict(extra="allow")
_STRICT = ConfigDict(extra="forbid")


class MessageParam(BaseModel):
    model_config = _STRICT
    role: str
    content: str | list[dict[str, Any]]


class ToolParam(BaseModel):
    model_config = _OPEN                  # cache_control, and a type for client tools
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None


class MessagesRequest(BaseModel):
    """POST /v1/messages (the fields this server serves; others are refused by name)."""
    model_config = _STRICT
    model: str
    max_tokens: int
    messages: list[MessageParam]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[ToolParam] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None        # a caller's records: not used
    service_tier: str | None = None               # one tier here: not used
    cache_control: dict[str, Any] | None = None   # prefix reuse is automatic: not needed


class CountTokensRequest(BaseModel):
    model_config = _STRICT
    model: str
    messages: list[MessageParam]
    system: str | list[dict[str, Any]] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None


def _text_of(blocks, where: str) -> str:
    """The text of a string or of text blocks (APIError for other block types)."""
    if isinstance(blocks, str):
        return blocks
    parts = []
    for j, b in enumerate(blocks):
        if b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise bad_request(f"{where}[{j}]: only text blocks are served here, got type "
                              f"{b.get('type')!r}", where)
        parts.append(b["text"])
    return "\n".join(parts)


def conversation(req) -> list[dict]:
    """The request's system and messages as OpenAI-shaped messages for the chat template."""
    out = []
    if req.system:
        out.append({"role": "system", "content": _text_of(req.system, "system")})
    if not req.messages:
        raise bad_request("messages is empty: give at least one message", "messages")
    for i, m in enumerate(req.messages):
        where = f"messages[{i}].content"
        if m.role not in ("user", "assistant"):
            raise bad_request(f"messages[{i}].role must be 'user' or 'assistant', got "
                              f"{m.role!r}", f"messages[{i}].role")
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts, calls, thinking, results = [], [], [], []
        for j, b in enumerate(m.content):
            kind = b.get("type")
            if kind == "text" and isinstance(b.get("text"), str):
                texts.append(b["text"])
            elif kind == "tool_use" and m.role == "assistant":
                if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                    raise bad_request(f"{where}[{j}]: a tool_use block needs a name and an "
                                      f"input object", where)
                calls.append({"id": b.get("id") or f"toolu_{i}_{j}", "type": "function",
                              "function": {"name": b["name"],
                                           "arguments": json.dumps(b.get("input", {}),
                                                                   ensure_ascii=False)}})
            elif kind == "thinking" and m.role == "assistant":
                thinking.append(str(b.get("thinking", "")))
            elif kind == "redacted_thinking" and m.role == "assistant":
                continue                             # opaque: nothing to render
            elif kind == "tool_result" and m.role == "user":
                content = b.get("content", "")
                text = _text_of(content, f"{where}[{j}].content") if content else ""
                if b.get("is_error"):
                    text = f"Error: {text}"
                results.append({"role": "tool", "tool_call_id": b.get("tool_use_id", ""),
                                "content": text})
            else:
                raise bad_request(f"{where}[{j}]: a {kind!r} block is not served in a "
                                  f"{m.role} message (text, tool_use, thinking, tool_result)",
                                  where)
        out += results
        if m.role == "assistant":
            msg = {"role": "assistant", "content": "\n".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            if thinking:
                msg["reasoning_content"] = "\n".join(thinking)
            out.append(msg)
        elif texts or not results:
            out.append({"role": "user", "content": "\n".join(texts)})
    return out


def tools_and_choice(req) -> tuple[list | None, Any, bool]:
    """OpenAI-shaped tools, tool_choice, and whether only the first call is kept."""
    tools = None
    if req.tools:
        tools = []
        for i, t in enumerate(req.tools):
            if t.type not in (None, "custom"):
                raise bad_request(f"tools[{i}]: {t.type!r} is a server tool, which this server "
                                  f"does not run; give client tools (name, input_schema)",
                                  f"tools[{i}].type")
            tools.append({"type": "function", "function": {
                "name": t.name, "description": t.description or "",
                "parameters": t.input_schema or {"type": "object", "properties": {}}}})
    c = req.tool_choice or {}
    kind = c.get("type", "auto")
    one = bool(c.get("disable_parallel_tool_use"))
    if kind == "auto":
        return tools, ("auto" if tools else None), one
    if kind == "any":
        return tools, "required", one
    if kind == "none":
        return tools, "none", one
    if kind == "tool" and isinstance(c.get("name"), str):
        return tools, {"type": "function", "function": {"name": c["name"]}}, one
    raise bad_request(f"tool_choice must be {{\"type\": \"auto\" | \"any\" | \"none\"}} or "
                      f"{{\"type\": \"tool\", \"name\": ...}}, got {c!r}", "tool_choice")


def template_kwargs(req) -> dict:
    t = req.thinking
    if not t:
        return {}
    kind = t.get("type")
    if kind not in ("enabled", "disabled"):
        raise bad_request(f"thinking.type must be 'enabled' or 'disabled', got {kind!r}",
                          "thinking")
    return {"enable_thinking": kind == "enabled"}


def sampling_params(req: MessagesRequest) -> SamplingParams:
    if req.max_tokens < 1:
        raise bad_request(f"max_tokens must be >= 1, got {req.max_tokens}", "max_tokens")
    t = 1.0 if req.temperature is None else req.temperature
    if not 0 <= t:
        raise bad_request(f"temperature must be >= 0, got {t}", "temperature")
    p = 1.0 if req.top_p is None else req.top_p
    if not 0 < p <= 1:
        raise bad_request(f"top_p must be in (0, 1], got {p}", "top_p")
    k = req.top_k or 0
    if k < 0:
        raise bad_request(f"top_k must be >= 0, got {k}", "top_k")
    stops = list(req.stop_sequences or [])
    if any(not s for s in stops):
        raise bad_request("stop_sequences must not contain empty strings", "stop_sequences")
    return SamplingParams(temperature=float(t), top_p=float(p), top_k=k,
                          max_tokens=req.max_tokens, stop=stops)


# --- responses ----------------------------------------------------------------------------------------
def message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def tool_use_id(call) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def stop_reason(r, calls) -> tuple[str, str | None]:
    if calls:
        return "tool_use", None
    if r.finish_reason == "stop" and r.stop_string is not None:
        return "stop_sequence", r.stop_string
    return STOP_REASONS.get(r.finish_reason, "end_turn"), None


def usage(r) -> dict:
    return {"input_tokens": len(r.prompt_ids) - r.cached_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": r.cached_tokens,
            "output_tokens": len(r.output_ids)}


def content_blocks(out, calls) -> list[dict]:
    blocks = []
    if out.reasoning:
        blocks.append({"type": "thinking", "thinking": out.reasoning, "signature": ""})
    if out.content:
        blocks.append({"type": "text", "text": out.content})
    for c in calls:
        blocks.append({"type": "tool_use", "id": tool_use_id(c), "name": c.name,
                       "input": json.loads(c.arguments)})
    return blocks


def message(mid: str, model: str, r, out, calls) -> dict:
    reason, seq = stop_reason(r, calls)
    return {"id": mid, "type": "message", "role": "assistant", "model": model,
            "content": content_blocks(out, calls), "stop_reason": reason,
            "stop_sequence": seq, "usage": usage(r)}


def event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


class BlockStream:
    """Turns parsed pieces into content-block events: a block opens when the kind of output
    changes (thinking, text, one per tool call) and closes before the next opens."""

    def __init__(self):
        self.index, self.open = -1, None

    def _start(self, kind: str, block: dict) -> list[str]:
        out = self.close()
        self.index += 1
        self.open = kind
        return out + [event("content_block_start", {"index": self.index,
                                                     "content_block": block})]

    def close(self) -> list[str]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":
            out.append(event("content_block_delta", {"index": self.index, "delta": {
                "type": "signature_delta", "signature": ""}}))
        out.append(event("content_block_stop", {"index": self.index}))
        self.open = None
        return out

    def pieces(self, pieces, one_call: bool, calls_so_far: list) -> list[str]:
        out = []
        for p in pieces:
            if p.kind == "tool":
                if one_call and calls_so_far and calls_so_far[0] is not p.call:
                    continue
                out += self._start("tool", {"type": "tool_use", "id": tool_use_id(p.call),
                                            "name": p.call.name, "input": {}})
                out.append(event("content_block_delta", {"index": self.index, "delta": {
                    "type": "input_json_delta", "partial_json": p.call.arguments}}))
                out += self.close()
            elif p.text:
                kind = "thinking" if p.kind == "reasoning" else "text"
                if self.open != kind:
                    block = {"type": "thinking", "thinking": "", "signature": ""} \
                        if kind == "thinking" else {"type": "text", "text": ""}
                    out += self._start(kind, block)
                delta = {"type": "thinking_delta", "thinking": p.text} if kind == "thinking" \
                    else {"type": "text_delta", "text": p.text}
                out.append(event("content_block_delta", {"index": self.index, "delta": delta}))
        return out
