"""GLM-4.5: reasoning between <think> and </think>; a tool call is

    <tool_call>NAME
    <arg_key>KEY</arg_key>
    <arg_value>VALUE</arg_value>
    </tool_call>

where a VALUE is JSON where it parses as JSON other than a string, else raw text (the template
writes strings raw and other values as JSON)."""

from __future__ import annotations

import json
import re

from cupool.serve.formats import ChatFormat, ToolCall
from cupool.serve.formats.tags import TagParser

THINK = ("<think>", "</think>")
CALL = ("<tool_call>", "</tool_call>")
_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def parse_body(body: str, types) -> list[ToolCall] | None:
    head, sep, _ = body.partition("<arg_key>")
    name = head.strip()
    if not name or "\n" in name or "<" in name:
        return None
    rest = body[len(head):]
    kinds = types.get(name, {})
    args = {}
    for key, raw in _ARG.findall(rest):
        key = key.strip()
        if kinds.get(key) == "string":
            args[key] = raw
            continue
        try:
            value = json.loads(raw)
            args[key] = raw if isinstance(value, str) else value
        except ValueError:
            args[key] = raw
    if _ARG.sub("", rest).strip():
        return None
    return [ToolCall(name, json.dumps(args, ensure_ascii=False))]


class Glm(ChatFormat):
    name = "glm"
    markers = THINK + CALL

    def parser(self, prompt_text: str, tools):
        from cupool.serve.formats.qwen import param_types
        types = param_types(tools)
        return TagParser(THINK, CALL if tools else None, lambda b: parse_body(b, types),
                         reasoning=self.opens_reasoning(prompt_text))

    def opens_reasoning(self, prompt_text: str) -> bool:
        return prompt_text.rstrip().endswith(THINK[0])

    def opener(self, name: str | None) -> str:
        return "<tool_call>" + (f"{name}\n" if name else "")
