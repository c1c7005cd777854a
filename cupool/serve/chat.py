"""A chat request to a prompt, and the model's output back to a message: the part both the
OpenAI and the Anthropic endpoints share.

`plan(tokenizer, fmt, messages, tools, tool_choice, template_kwargs)` renders the conversation
with the tokenizer's chat template (tools and template arguments such as enable_thinking passed
to it), appends what tool_choice "required" or a named function needs (the format's call
opener, so the answer starts with a call), and says how to read the output: which format parses
it, whether tool calls are parsed, whether special tokens stay in the text (formats whose
markers are special tokens). `ChatOutput` collects the parsed pieces into reasoning, content and
tool calls.

The plan also says where the conversation part of the prompt ends (`ChatPlan.resume_at`): the
tokens the rendering with and without the generation prompt share. A next turn's prompt starts
with them even where it keeps neither this prompt's end nor the answer (a generation prompt that
opens `<think>`, a history that drops the reasoning), so the engine keeps a resume point there
for models with recurrent layers (`Engine.submit(..., resume_at=)`).

Messages come in OpenAI's shape (Anthropic requests are converted to it first): roles system /
user / assistant / tool, an assistant message's `tool_calls` and `reasoning_content`, a tool
message's `tool_call_id`.
"""

from __future__ import annotations

import dataclasses
import json

from cupool.prefix import common_prefix
from cupool.serve.formats import ChatFormat, Piece, ToolCall
from cupool.serve.protocol import bad_request

# apply_chat_template's own arguments: a request's template arguments may not replace them
RESERVED = frozenset({"messages", "conversation", "tools", "documents", "add_generation_prompt",
                      "tokenize", "return_dict", "return_tensors", "continue_final_message",
                      "chat_template", "tokenizer_kwargs", "padding", "truncation",
                      "max_length"})


def template_text(tokenizer) -> str:
    """The chat template's text (every named template, where the tokenizer has several)."""
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):
        return "\n".join(str(v) for v in t.values())
    return t or ""


@dataclasses.dataclass
class ChatPlan:
    ids: list[int]                 # the prompt, opener included
    prompt_text: str               # the rendered prompt, without the opener
    fmt: ChatFormat | None
    tools: list | None             # tools whose calls are parsed (None: calls are text)
    opener: str                    # text the answer was started with ("": none)
    skip_special_tokens: bool
    resume_at: int | None = None   # prompt tokens before the generation prompt (None: unknown)

    def output(self) -> ChatOutput:
        if self.fmt is None:
            return ChatOutput(None)
        parser = self.fmt.parser(self.prompt_text, self.tools)
        out = ChatOutput(parser)
        if self.opener:
            out.feed(self.opener)          # the opener is the start of a call: nothing to emit
        return out


class _Plain:
    def feed(self, text: str) -> list[Piece]:
        return [Piece("content", text)] if text else []

    def finish(self) -> list[Piece]:
        return []


class ChatOutput:
    """The parsed output of one generation: reasoning, content and tool calls so far."""

    def __init__(self, parser):
        self.parser = parser if parser is not None else _Plain()
        self.reasoning, self.content = "", ""
        self.calls: list[ToolCall] = []

    def _keep(self, pieces: list[Piece]) -> list[Piece]:
        for p in pieces:
            if p.kind == "reasoning":
                self.reasoning += p.text
            elif p.kind == "content":
                self.content += p.text
            else:
                self.calls.append(p.call)
        return pieces

    def feed(self, text: str) -> list[Piece]:
        return self._keep(self.parser.feed(text)) if text else []

    def finish(self) -> list[Piece]:
        return self._keep(self.parser.finish())


def _tool_names(tools) -> list[str]:
    return [t["function"]["name"] for t in tools or []]


def _message_for_template(m: dict, fmt: ChatFormat | None) -> dict:
    """An OpenAI message as chat templates take it: tool-call arguments as an object or as JSON
    text, as the format's template expects."""
    calls = m.get("tool_calls")
    if not calls:
        return m
    as_object = fmt.arguments_as_object if fmt is not None else True
    out = []
    for i, c in enumerate(calls):
        fn = c["function"]
        args = fn.get("arguments") or "{}"
        if as_object and isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                raise bad_request(f"messages: the arguments of tool call {i} ({fn['name']!r}) "
                                  f"are not JSON: {args[:80]!r}", "messages") from None
        elif not as_object and not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        out.append({**c, "function": {**fn, "arguments": args}})
    return {**m, "tool_calls": out}


def plan(tokenizer, fmt: ChatFormat | None, messages: list[dict], *, tools: list | None = None,
         tool_choice=None, template_kwargs: dict | None = None,
         param: str = "messages", structured: bool = False) -> ChatPlan:
    """Render and tokenize the conversation; APIError 400 for what cannot be served.
    `structured`: the answer is constrained by a grammar (response_format), so it is content
    from its first token: not with tools, nor after a prompt that opens reasoning."""
    from jinja2 import TemplateError

    if tokenizer is None:
        raise bad_request("this model has no tokenizer, so no chat template: use "
                          "/v1/completions with token-id prompts", param)
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model's tokenizer has no chat template: use /v1/completions",
                          param)
    kwargs = dict(template_kwargs or {})
    bad = sorted(set(kwargs) & RESERVED)
    if bad:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(bad)}",
                          "chat_template_kwargs")
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    name = None
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if name not in _tool_names(tools):
            raise bad_request(f"tool_choice names the function {name!r}, which is not among "
                              f"the tools ({', '.join(_tool_names(tools)) or 'none given'})",
                              "tool_choice")
    elif choice in ("auto", "required") and not tools:
        if choice == "required":
            raise bad_request("tool_choice 'required' needs tools", "tool_choice")
    parse = bool(tools) and choice != "none"
    if structured and parse:
        raise bad_request("response_format and tools cannot be combined here: give one of "
                          "them (or tool_choice 'none')", "response_format")
    if parse and fmt is None:
        raise bad_request("this model's chat template writes tool calls in a format cupool does "
                          "not know (it knows Qwen3 / Qwen3-Next / Qwen3.8-Flash-Next, gpt-oss "
                          "harmony, DeepSeek-V3 and GLM-4.5): tools cannot be served for it",
                          "tools")
    msgs = [_message_for_template(m, fmt) for m in messages]
    try:
        text = tokenizer.apply_chat_template(msgs, tools=tools or None,
                                             add_generation_prompt=True, tokenize=False,
                                             **kwargs)
    except TemplateError as e:
        raise bad_request(f"the chat template refused the messages: {e}", param) from None
    opener = ""
    if parse and (name is not None or choice == "required"):
        opener = fmt.opener(name)
    if structured and fmt is not None and fmt.opens_reasoning(text):
        raise bad_request("response_format: this prompt opens the model's reasoning, which a "
                          "grammar-constrained answer cannot hold; turn thinking off "
                          "(chat_template_kwargs {\"enable_thinking\": false})",
                          "response_format")
    ids = [int(i) for i in tokenizer(text + opener, add_special_tokens=False)["input_ids"]]
    resume_at = _conversation_end(tokenizer, msgs, tools, kwargs, ids)
    skip = True
    if fmt is not None:
        special = set(getattr(tokenizer, "all_special_tokens", []) or [])
        special |= {str(t) for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
                    if getattr(t, "special", False)}
        skip = not any(m in special for m in fmt.markers)
    return ChatPlan(ids, text, None if structured else fmt, tools if parse else None, opener,
                    skip, resume_at)


def _conversation_end(tokenizer, msgs: list[dict], tools, kwargs: dict,
                      ids: list[int]) -> int | None:
    """How many tokens of the prompt `ids` come before the generation prompt: the common prefix of
    `ids` and the conversation rendered without it (None where the template refuses that
    rendering). Tokens, not characters: where the two renderings tokenize differently at the
    seam, the point stops before it, so it is always a prefix of this prompt."""
    from jinja2 import TemplateError
    try:
        text = tokenizer.apply_chat_template(msgs, tools=tools or None,
                                             add_generation_prompt=False, tokenize=False,
                                             **kwargs)
    except TemplateError:
        return None
    return common_prefix(tokenizer(text, add_special_tokens=False)["input_ids"], ids)
