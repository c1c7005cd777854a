"""Qwen3, Qwen3-Next, Qwen3-Coder and Qwen3.8-Flash-Next: reasoning between <think> and
</think>; each tool call between <tool_call> and </tool_call>, whose body is either JSON
{"name": ..., "arguments": {...}} (Qwen3, Qwen3-Next) or the XML dialect (Qwen3-Coder,
Qwen3.8-Flash-Next):

    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>

where a VALUE is raw text for a string parameter of the tool's schema and JSON otherwise."""

from __future__ import annotations

import json
import re

from cupool.serve.formats import ChatFormat, ToolCall
from cupool.serve.formats.tags import TagParser

THINK = ("<think>", "</think>")
CALL = ("<tool_call>", "</tool_call>")
_FUNCTION = re.compile(r"^\s*<function=([^>\n]+)>(.*?)</function>\s*$", re.S)
_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def param_types(tools) -> dict[str, dict[str, str]]:
    """{function name: {parameter: JSON-schema type}} of the request's tools."""
    out = {}
    for t in tools or []:
        fn = t.get("function", t)
        props = (fn.get("parameters") or {}).get("properties") or {}
        out[fn.get("name")] = {k: (v or {}).get("type", "") for k, v in props.items()}
    return out


def parse_json_body(body: str) -> list[ToolCall] | None:
    obj = json.loads(body)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = json.loads(args)
    if not isinstance(args, dict):
        return None
    return [ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))]


def parse_xml_body(body: str, types) -> list[ToolCall] | None:
    m = _FUNCTION.match(body)
    if m is None:
        return None
    name, inner = m.group(1).strip(), m.group(2)
    kinds = types.get(name, {})
    args = {}
    for key, raw in _PARAM.findall(inner):
        key = key.strip()
        if kinds.get(key) == "string":
            args[key] = raw
            continue
        try:
            args[key] = json.loads(raw)
        except ValueError:
            args[key] = raw              # a value the schema does not type as JSON: its text
    if _PARAM.sub("", inner).strip():
        return None                      # something besides parameters: not this dialect
    return [ToolCall(name, json.dumps(args, ensure_ascii=False))]


class Qwen(ChatFormat):
    name = "qwen"
    markers = THINK + CALL

    def __init__(self, xml: bool = False):
        self.xml = xml

    def parser(self, prompt_text: str, tools):
        types = param_types(tools)

        def body(text: str):
            if text.strip().startswith("<function="):
                return parse_xml_body(text, types)
            return parse_json_body(text)
        return TagParser(THINK, CALL if tools else None, body,
                         reasoning=self.opens_reasoning(prompt_text))

    def opens_reasoning(self, prompt_text: str) -> bool:
        return prompt_text.rstrip().endswith(THINK[0])

    def opener(self, name: str | None) -> str:
        if self.xml:
            return "<tool_call>\n<function=" + (f"{name}>\n" if name else "")
        if name:
            return '<tool_call>\n{"name": ' + json.dumps(name) + ', "arguments": '
        return "<tool_call>\n"
