"""Chat formats: how a model family writes tool calls and reasoning into its output, one small
module per family, chosen from the tokenizer's chat template (`detect`).

| format | families | tool call in the output | reasoning |
| --- | --- | --- | --- |
| `qwen` | Qwen3, Qwen3-Next (JSON), Qwen3-Coder, Qwen3.8-Flash-Next (`<function=…>` XML) | `<tool_call>…</tool_call>` | `<think>…</think>` |
| `glm` | GLM-4.5 | `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>` | `<think>…</think>` |
| `deepseek` | DeepSeek-V3 (```json fenced), DeepSeek-V3.1 | `<｜tool▁calls▁begin｜>…<｜tool▁calls▁end｜>` | `<think>…</think>` |
| `harmony` | gpt-oss | a `commentary` message `to=functions.NAME` | the `analysis` channel |

A format gives an `OutputParser` for one generation: `feed(text)` takes the output as it is
detokenized and returns `Piece`s (content, reasoning, a complete tool call) that can no longer
change, holding back only text that may be the start of a marker; `finish()` returns the rest.
Output that does not parse (a tool call whose body is not what the format defines, a call left
open at the end) is returned as content, as the model wrote it: a model's mistake is never a
server error. A template no format recognises serves plain chat; asking it for tools is a 400.
"""

from __future__ import annotations

import dataclasses
import json
import uuid


@dataclasses.dataclass
class ToolCall:
    """One call: the function's name and its arguments as a JSON object text."""
    name: str
    arguments: str
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def arguments_object(self) -> dict:
        return json.loads(self.arguments)


@dataclasses.dataclass
class Piece:
    """Output that can no longer change: kind "content", "reasoning" (text) or "tool" (call)."""
    kind: str
    text: str = ""
    call: ToolCall | None = None


class ChatFormat:
    """A family's output format. Subclasses set `name`, `markers` (strings that delimit its
    regions: if any is a special token, the output must be detokenized with special tokens
    kept) and implement `parser` and `opener`."""
    name = "plain"
    markers: tuple[str, ...] = ()
    arguments_as_object = True     # tool-call arguments the template takes: dict, or JSON text

    def parser(self, prompt_text: str, tools: bool):
        """An OutputParser for a generation whose prompt renders as `prompt_text`; `tools`:
        parse tool calls (False: their text is content)."""
        raise NotImplementedError

    def opens_reasoning(self, prompt_text: str) -> bool:
        """Whether the prompt ends inside the reasoning region (the answer starts there)."""
        return False

    def opener(self, name: str | None) -> str:
        """Text that starts the assistant's answer with a tool call (of `name`, or of a
        function the model picks): what tool_choice "required" or a named function appends to
        the prompt."""
        raise NotImplementedError


def detect(template: str | None) -> ChatFormat | None:
    """The format a chat template writes, by the markers it renders; None where none fits."""
    from cupool.serve.formats import deepseek, glm, harmony, qwen
    if not template:
        return None
    if "<|channel|>" in template:
        return harmony.Harmony()
    if "tool▁calls▁begin" in template:
        return deepseek.DeepSeek(fenced="```json" in template)
    if "<arg_key>" in template:
        return glm.Glm()
    if "<tool_call>" in template:
        return qwen.Qwen(xml="<function=" in template)
    if "<think>" in template:
        return qwen.Qwen(xml=False)         # reasoning without a known tool dialect
    return None


def lcp_hold(text: str, markers) -> int:
    """How many characters at the end of `text` could be the start of one of `markers` (to be
    held back until the next text says)."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best
