"""DeepSeek-V3 and V3.1: reasoning between <think> and </think> (V3.1); tool calls in one
block between <｜tool▁calls▁begin｜> and <｜tool▁calls▁end｜>, each call between
<｜tool▁call▁begin｜> and <｜tool▁call▁end｜>:

    V3:    function<｜tool▁sep｜>NAME\\n```json\\n{ARGUMENTS}\\n```
    V3.1:  NAME<｜tool▁sep｜>{ARGUMENTS}

(both are read whichever the template writes; `fenced` picks the one `opener` writes)."""

from __future__ import annotations

import json
import re

from cupool.serve.formats import ChatFormat, ToolCall
from cupool.serve.formats.tags import TagParser

THINK = ("<think>", "</think>")
CALLS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
CALL = ("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>")
SEP = "<｜tool▁sep｜>"
_ONE = re.compile(re.escape(CALL[0]) + r"(.*?)" + re.escape(CALL[1]), re.S)
_FENCED = re.compile(r"^\s*(\S+)\s*\n```(?:json)?\s*\n(.*?)\n?```\s*$", re.S)


def parse_one(text: str) -> ToolCall | None:
    kind, sep, rest = text.partition(SEP)
    if not sep:
        return None
    if kind.strip() == "function" and (m := _FENCED.match(rest)):
        name, args = m.group(1), m.group(2)            # V3
    else:
        name, args = kind.strip(), rest                 # V3.1
    obj = json.loads(args)
    if not name or not isinstance(obj, dict):
        return None
    return ToolCall(name, json.dumps(obj, ensure_ascii=False))


def parse_block(body: str) -> list[ToolCall] | None:
    calls = [parse_one(t) for t in _ONE.findall(body)]
    if not calls or any(c is None for c in calls) or _ONE.sub("", body).strip():
        return None
    return calls


class DeepSeek(ChatFormat):
    name = "deepseek"
    markers = THINK + CALLS + CALL + (SEP,)
    arguments_as_object = False        # its template concatenates the arguments' JSON text

    def __init__(self, fenced: bool = True):
        self.fenced = fenced

    def parser(self, prompt_text: str, tools):
        return TagParser(THINK, CALLS if tools else None, parse_block,
                         reasoning=self.opens_reasoning(prompt_text))

    def opens_reasoning(self, prompt_text: str) -> bool:
        return prompt_text.rstrip().endswith(THINK[0])

    def opener(self, name: str | None) -> str:
        if name is None:
            return CALLS[0] + CALL[0] + ("function" + SEP if self.fenced else "")
        if self.fenced:
            return CALLS[0] + CALL[0] + "function" + SEP + name + "\n```json\n"
        return CALLS[0] + CALL[0] + name + SEP
