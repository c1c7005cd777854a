"""Tool calls and reasoning through `cupool serve` for each chat-format family, with the real
`openai` client on 127.0.0.1: the tiny model's output is scripted (`Scripted`: a token-mask
constraint forces each answer's tokens through the engine's sampling step), so what is tested is
the served path from the template to the parsed message, streamed and not:
call -> tool result -> answer, reasoning apart from content, tool_choice, chat_template_kwargs,
malformed output returned as text."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from chat_templates import FAMILIES  # noqa: E402
from serve_fixtures import LiveServer, Scripted, write_family_model  # noqa: E402

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
ASK = [{"role": "system", "content": "You are brief."},
       {"role": "user", "content": "What is the weather in Paris?"}]
THOUGHT, THOUGHT2, ANSWER = "The user wants the weather.", "Got it.", "It is sunny in Paris."
RESULT = "sunny, 24 C"

# family -> (the model's output calling get_weather(city=Paris), its answer after the result)
# with reasoning where the family writes it
OUTPUTS = {
    "qwen3": (f"<think>\n{THOUGHT}\n</think>\n\n<tool_call>\n"
              '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
              f"<think>\n{THOUGHT2}\n</think>\n\n{ANSWER}"),
    "qwen3_next": (f"{THOUGHT}\n</think>\n\n<tool_call>\n"             # <think> ends the prompt
                   '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                   f"{THOUGHT2}\n</think>\n\n{ANSWER}"),
    "qwen3_8_flash_next": (f"{THOUGHT}\n</think>\n\n<tool_call>\n<function=get_weather>\n"
                           "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
                           f"{THOUGHT2}\n</think>\n\n{ANSWER}"),
    "gpt_oss": (f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant"
                "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                '{"city": "Paris"}',
                f"<|channel|>analysis<|message|>{THOUGHT2}<|end|><|start|>assistant"
                f"<|channel|>final<|message|>{ANSWER}"),
    "deepseek_v3": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
                    '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', ANSWER),
    "glm45": (f"<think>{THOUGHT}</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
              "<arg_value>Paris</arg_value>\n</tool_call>", f"<think>{THOUGHT2}</think>\n{ANSWER}"),
}
REASONS = {f: (THOUGHT, THOUGHT2) for f in OUTPUTS}
REASONS["deepseek_v3"] = ("", "")
EOS = {"gpt_oss": ("<|call|>", "<|return|>"), "glm45": ("<|observation|>", "<|user|>")}


class FamilyServer:
    def __init__(self, root, family):
        d = write_family_model(root / family, family)
        self.live = LiveServer(d, max_batch=2, max_len=1024, model_name=family)
        tok = self.live.tokenizer
        self.family, self.tok = family, tok
        self.script = Scripted(self.live.engine, tok, tok.convert_tokens_to_ids(
            FAMILIES[family][3][0]))
        self.client = openai.OpenAI(base_url=self.live.base_url, api_key="unused",
                                    max_retries=0, timeout=300)

    def push(self, text, eos_token=None):
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        assert self.tok.decode(ids) == text
        eos = self.tok.convert_tokens_to_ids(eos_token or FAMILIES[self.family][3][0])
        self.script.scripts.append(ids + [eos])

    def close(self):
        self.client.close()
        self.live.close()


@pytest.fixture(scope="module", params=list(FAMILIES))
def fam(request, tmp_path_factory):
    s = FamilyServer(tmp_path_factory.mktemp("families"), request.param)
    yield s
    s.close()


def chat(fam, messages, stream=False, **kw):
    """A chat request; the message (role, content, reasoning_content, tool_calls as dicts) and
    finish_reason, from the response or assembled from the stream's deltas."""
    kw.setdefault("max_tokens", 150)
    r = fam.client.chat.completions.create(model=fam.family, messages=messages, stream=stream,
                                           temperature=0, **kw)
    if not stream:
        c = r.choices[0]
        m = c.message
        calls = [{"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
                 for t in m.tool_calls or []]
        return {"content": m.content, "reasoning": (m.model_extra or {}).get(
            "reasoning_content") or "", "calls": calls}, c.finish_reason
    content, reasoning, calls, reasons, order = None, "", {}, [], []
    for ch in r:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        if d.content:
            content = (content or "") + d.content
            order.append("content")
        if (d.model_extra or {}).get("reasoning_content"):
            reasoning += d.model_extra["reasoning_content"]
            order.append("reasoning")
        for t in d.tool_calls or []:
            c = calls.setdefault(t.index, {"id": t.id, "name": "", "arguments": ""})
            c["name"] += t.function.name or ""
            c["arguments"] += t.function.arguments or ""
            order.append("tool")
        if ch.choices[0].finish_reason:
            reasons.append(ch.choices[0].finish_reason)
    assert len(reasons) == 1
    # reasoning streams before what follows it
    assert order == sorted(order, key=lambda k: k != "reasoning"), order
    return {"content": content, "reasoning": reasoning,
            "calls": [calls[k] for k in sorted(calls)]}, reasons[0]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_round_trip(fam, stream):
    """call -> tool result -> answer, for every family, streamed and not."""
    first, second = OUTPUTS[fam.family]
    eos = EOS.get(fam.family, (None, None))
    fam.push(first, eos[0])
    msg, reason = chat(fam, ASK, stream, tools=TOOLS)
    assert reason == "tool_calls"
    assert msg["reasoning"] == REASONS[fam.family][0]
    assert msg["content"] in (None, "")
    assert len(msg["calls"]) == 1
    call = msg["calls"][0]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert call["id"]
    prompt1 = fam.script.prompt_text()
    assert "get_weather" in prompt1 and "The weather of a city now" in prompt1   # tools rendered

    history = ASK + [{"role": "assistant", "content": msg["content"],
                      "tool_calls": [{"id": call["id"], "type": "function",
                                      "function": {"name": call["name"],
                                                   "arguments": call["arguments"]}}]},
                     {"role": "tool", "tool_call_id": call["id"], "content": RESULT}]
    fam.push(second, eos[1])
    msg, reason = chat(fam, history, stream, tools=TOOLS)
    assert reason == "stop"
    assert msg["content"] == ANSWER and msg["calls"] == []
    assert msg["reasoning"] == REASONS[fam.family][1]
    prompt2 = fam.script.prompt_text()
    assert RESULT in prompt2 and '"Paris"' in prompt2.replace("\nParis\n", '"Paris"') \
        .replace(">Paris<", '"Paris"')                                 # the call, rendered back


@pytest.mark.parametrize("fam", ["qwen3"], indirect=True)   # test_chat_formats: every format
def test_malformed_output_is_text(fam):
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {city: Paris}}\n</tool_call>'
    for stream in (False, True):
        fam.push(bad)
        msg, reason = chat(fam, ASK, stream, tools=TOOLS)
        assert (msg["content"], msg["calls"], reason) == (bad, [], "stop")
    fam.push('<tool_call>\n{"name": "get_wea', eos_token=None)
    fam.script.scripts[-1].pop()                                     # no EOS: cut by max_tokens
    msg, reason = chat(fam, ASK, tools=TOOLS, max_tokens=10)
    assert reason == "length" and msg["calls"] == []
    assert msg["content"] == '<tool_call>\n{"name":'        # the 10 tokens written, as text


@pytest.mark.parametrize("fam", ["qwen3", "gpt_oss", "glm45"], indirect=True)
def test_tool_choice_and_template_kwargs(fam):
    named = {"type": "function", "function": {"name": "get_weather"}}
    rest = {"qwen3": '{"city": "Rome"}}\n</tool_call>',
            "gpt_oss": '{"city": "Rome"}',
            "glm45": "<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n</tool_call>"}
    fam.push(rest[fam.family], EOS.get(fam.family, (None,))[0])
    msg, reason = chat(fam, ASK, tools=TOOLS, tool_choice=named)
    assert reason == "tool_calls" and json.loads(msg["calls"][0]["arguments"]) == {"city": "Rome"}
    assert fam.script.prompt_text().endswith(fam.live.app.state.cupool.format.opener(
        "get_weather"))
    # none: the model's call is its text
    first = OUTPUTS[fam.family][0]
    fam.push(first, EOS.get(fam.family, (None,))[0])
    msg, reason = chat(fam, ASK, tools=TOOLS, tool_choice="none")
    assert msg["calls"] == [] and reason == "stop"
    # unknown function, required without tools
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        chat(fam, ASK, tools=TOOLS, tool_choice={"type": "function",
                                                 "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="needs tools"):
        chat(fam, ASK, tool_choice="required")
    with pytest.raises(openai.BadRequestError, match="may not set"):
        chat(fam, ASK, extra_body={"chat_template_kwargs": {"tools": []}})
    if fam.family == "qwen3":
        # enable_thinking=false closes an empty think block in the prompt: no reasoning parsed
        fam.push("Plain answer.")
        msg, reason = chat(fam, ASK, extra_body={"chat_template_kwargs":
                                                 {"enable_thinking": False}})
        assert fam.script.prompt_text().endswith("<think>\n\n</think>\n\n")
        assert msg == {"content": "Plain answer.", "reasoning": "", "calls": []}


@pytest.mark.parametrize("fam", ["qwen3_next", "gpt_oss"], indirect=True)
def test_reasoning_split_without_tools(fam):
    second = OUTPUTS[fam.family][1]
    for stream in (False, True):
        fam.push(second, EOS.get(fam.family, (None, None))[1])
        msg, reason = chat(fam, ASK, stream)
        assert msg == {"content": ANSWER, "reasoning": THOUGHT2, "calls": []} and reason == "stop"


# --- the same through Anthropic's Messages API and its client ------------------------------------
anthropic = pytest.importorskip("anthropic")


def anthropic_client(fam, key="unused"):
    return anthropic.Anthropic(base_url=fam.live.base_url[:-len("/v1")], api_key=key,
                               max_retries=0, timeout=300)


def message(fam, messages, stream=False, **kw):
    c = anthropic_client(fam)
    kw.setdefault("max_tokens", 150)
    try:
        if not stream:
            return c.messages.create(model=fam.family, messages=messages, **kw)
        with c.messages.stream(model=fam.family, messages=messages, **kw) as s:
            kinds = [ev.type for ev in s]
            final = s.get_final_message()
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
        return final
    finally:
        c.close()


ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "The weather of a city now",
                    "input_schema": TOOLS[0]["function"]["parameters"]}]


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_tool_round_trip(fam, stream):
    first, second = OUTPUTS[fam.family]
    eos = EOS.get(fam.family, (None, None))
    fam.push(first, eos[0])
    ask = [{"role": "user", "content": ASK[1]["content"]}]
    m = message(fam, ask, stream, system=ASK[0]["content"], tools=ANTHROPIC_TOOLS)
    assert m.stop_reason == "tool_use" and m.role == "assistant" and m.type == "message"
    kinds = [b.type for b in m.content]
    want_thinking = bool(REASONS[fam.family][0])
    assert kinds == (["thinking"] if want_thinking else []) + ["tool_use"]
    if want_thinking:
        assert m.content[0].thinking == THOUGHT
    use = m.content[-1]
    assert use.name == "get_weather" and use.input == {"city": "Paris"} and use.id
    # input_tokens: prefilled; cache_read_input_tokens: reused from a slot (prefix reuse)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(fam.script.prompts[-1])
    assert m.usage.output_tokens > 0
    assert "You are brief." in fam.script.prompt_text()

    history = ask + [{"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                         for b in m.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": RESULT}]}]
    fam.push(second, eos[1])
    m = message(fam, history, stream, system=ASK[0]["content"], tools=ANTHROPIC_TOOLS)
    assert m.stop_reason == "end_turn"
    texts = [b.text for b in m.content if b.type == "text"]
    assert texts == [ANSWER]
    assert [b.thinking for b in m.content if b.type == "thinking"] == \
        ([THOUGHT2] if want_thinking else [])
    assert RESULT in fam.script.prompt_text()


@pytest.mark.parametrize("fam", ["qwen3"], indirect=True)
def test_anthropic_requests(fam):
    """Stop sequences, max_tokens, thinking disabled, count_tokens, and Anthropic's errors."""
    fam.push("Plain answer. The end")
    m = message(fam, [{"role": "user", "content": "hi"}], stop_sequences=["The end"],
                thinking={"type": "disabled"})
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "The end")
    assert m.content[0].text == "Plain answer. "
    assert fam.script.prompt_text().endswith("<think>\n\n</think>\n\n")
    fam.push("abcdefghij")
    m = message(fam, [{"role": "user", "content": "hi"}], max_tokens=4)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 4
    c = anthropic_client(fam)
    n = c.messages.count_tokens(model="qwen3", messages=[{"role": "user", "content": "hi"}])
    assert n.input_tokens == len(fam.tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True)["input_ids"])
    with pytest.raises(anthropic.NotFoundError) as e:
        c.messages.create(model="nope", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model="qwen3", max_tokens=5, messages=[
            {"role": "user", "content": [{"type": "image", "source": {}}]}])
    assert e.value.body["type"] == "error" and "image" in e.value.body["error"]["message"]
    r = httpx.post(fam.live.base_url + "/messages", json={"model": "qwen3", "messages": []})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    c.close()


def test_anthropic_api_key(tmp_path):
    d = write_family_model(tmp_path / "qwen3", "qwen3")
    with LiveServer(d, max_batch=1, max_len=1024, model_name="qwen3", api_key="k-1") as s:
        c = anthropic.Anthropic(base_url=s.base_url[:-3], api_key="wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as e:
            c.messages.create(model="qwen3", max_tokens=2,
                              messages=[{"role": "user", "content": "hi"}])
        assert e.value.body["error"]["type"] == "authentication_error"
        ok = anthropic.Anthropic(base_url=s.base_url[:-3], api_key="k-1", max_retries=0)
        m = ok.messages.create(model="qwen3", max_tokens=2,
                               messages=[{"role": "user", "content": "hi"}])
        assert m.usage.output_tokens <= 2
