"""The chat formats' output parsers on their own (no server): each family's tool calls and
reasoning, fed whole and one character at a time (the same pieces either way), malformed
output returned as text, and the template detection."""

from __future__ import annotations

import json

import pytest

from cupool.serve import formats
from cupool.serve.formats import deepseek, glm, harmony, qwen

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}}}}]


def run(fmt, text, prompt="", tools=TOOLS, step=None):
    """(reasoning, content, [(name, arguments dict)]) of `text`, fed whole or `step` chars at a
    time."""
    p = fmt.parser(prompt, tools)
    pieces = []
    if step is None:
        pieces += p.feed(text)
    else:
        for i in range(0, len(text), step):
            pieces += p.feed(text[i:i + step])
    pieces += p.finish()
    r = "".join(x.text for x in pieces if x.kind == "reasoning")
    c = "".join(x.text for x in pieces if x.kind == "content")
    calls = [(x.call.name, json.loads(x.call.arguments)) for x in pieces if x.kind == "tool"]
    return r, c, calls


CASES = [
    # (format, prompt, output, reasoning, content, calls)
    (qwen.Qwen(), "", "<think>\nplan it\n</think>\n\nHi <b>there</b>", "plan it",
     "Hi <b>there</b>", []),
    (qwen.Qwen(), "<|im_start|>assistant\n<think>\n", "still thinking\n</think>\n\nok", "still thinking",
     "ok", []),
    (qwen.Qwen(), "", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Paris", "days": 2}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", '
     '"arguments": {"city": "Rome"}}\n</tool_call>', "", "Let me look.\n",
     [("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Rome"})]),
    (qwen.Qwen(xml=True), "<think>\n", "hmm\n</think>\n\n<tool_call>\n<function=get_weather>\n"
     "<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n"
     "</tool_call>", "hmm", "", [("get_weather", {"city": "New York", "days": 3})]),
    (glm.Glm(), "", "<think>why</think>\nSure.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
     "<arg_value>Oslo</arg_value>\n<arg_key>days</arg_key>\n<arg_value>4</arg_value>\n"
     "</tool_call>", "why", "Sure.\n", [("get_weather", {"city": "Oslo", "days": 4})]),
    (deepseek.DeepSeek(fenced=True), "", "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
     "function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Lima\"}\n```<｜tool▁call▁end｜>"
     "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Quito\"}\n```"
     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "", "Checking.",
     [("get_weather", {"city": "Lima"}), ("get_weather", {"city": "Quito"})]),
    (deepseek.DeepSeek(fenced=False), "<think>", "a</think>b<｜tool▁calls▁begin｜>"
     "<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Rio\"}<｜tool▁call▁end｜>"
     "<｜tool▁calls▁end｜>", "a", "b", [("get_weather", {"city": "Rio"})]),
    (harmony.Harmony(), "", "<|channel|>analysis<|message|>need weather<|end|><|start|>assistant"
     "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
     "{\"city\": \"Cairo\"}", "need weather", "", [("get_weather", {"city": "Cairo"})]),
    (harmony.Harmony(), "", "<|channel|>analysis<|message|>easy<|end|><|start|>assistant"
     "<|channel|>final<|message|>It is 4.", "easy", "It is 4.", []),
    (harmony.Harmony(), "", "<|start|>assistant to=functions.get_weather<|channel|>commentary json"
     "<|message|>{\"city\": \"Bern\"}", "", "", [("get_weather", {"city": "Bern"})]),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: None)
@pytest.mark.parametrize("step", [None, 1, 3])
def test_parsers(case, step):
    fmt, prompt, text, reasoning, content, calls = case
    assert run(fmt, text, prompt, step=step) == (reasoning, content, calls)


MALFORMED = [
    (qwen.Qwen(), '<tool_call>\n{"name": "get_weather", "arguments": {city: 1}}\n</tool_call>'),
    (qwen.Qwen(), '<tool_call>\n{"name": "get_weather", "argu'),              # cut off
    (qwen.Qwen(xml=True), "<tool_call>\n<function=get_weather>\nloose text\n</function>\n"
     "</tool_call>"),
    (glm.Glm(), "<tool_call>two words\n<arg_key>a</arg_key></tool_call>"),
    (deepseek.DeepSeek(), "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n"
     "```json\n[1, 2]\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    (harmony.Harmony(), "<|channel|>commentary to=functions.get_weather <|constrain|>json"
     "<|message|>{\"city\": "),
]


@pytest.mark.parametrize("fmt,text", MALFORMED)
def test_malformed_calls_are_text(fmt, text):
    r, c, calls = run(fmt, text)
    assert calls == [] and r == ""
    if isinstance(fmt, harmony.Harmony):
        assert c == '{"city": '                 # the body of the message, as written
    else:
        assert c == text


def test_without_tools_calls_are_text():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    assert run(qwen.Qwen(), text, tools=None) == ("", text, [])


def test_detect():
    from chat_templates import FAMILIES
    want = {"qwen3": ("qwen", False), "qwen3_next": ("qwen", False),
            "qwen3_8_flash_next": ("qwen", True), "gpt_oss": ("harmony", None),
            "deepseek_v3": ("deepseek", None), "glm45": ("glm", None)}
    for family, (template, *_rest) in FAMILIES.items():
        fmt = formats.detect(template)
        assert fmt.name == want[family][0], family
        if want[family][1] is not None:
            assert fmt.xml == want[family][1]
    assert formats.detect(FAMILIES["deepseek_v3"][0]).fenced
    assert formats.detect("{{ messages }}") is None and formats.detect(None) is None


def test_openers_parse_as_calls():
    """What tool_choice appends to the prompt and the model's continuation make one call."""
    cases = [(qwen.Qwen(), '{"city": "Rome"}}\n</tool_call>'),
             (qwen.Qwen(xml=True), "<parameter=city>\nRome\n</parameter>\n</function>\n"
              "</tool_call>"),
             (glm.Glm(), "<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n</tool_call>"),
             (deepseek.DeepSeek(), '{"city": "Rome"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
             (deepseek.DeepSeek(fenced=False), '{"city": "Rome"}<｜tool▁call▁end｜>'
              '<｜tool▁calls▁end｜>'),
             (harmony.Harmony(), '{"city": "Rome"}')]
    for fmt, rest in cases:
        assert run(fmt, fmt.opener("get_weather") + rest)[2] == [("get_weather", {"city": "Rome"})]
