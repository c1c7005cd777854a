"""Prefix reuse through `cupool serve` on the CPU: an agent loop of 5 turns with a growing
context, with the real `openai` client (and the `anthropic` one for two turns). Turns 2-5 find
the previous turn's tokens in a slot and prefill only their new tokens (counted by the engine),
report them as usage.prompt_tokens_details.cached_tokens / cache_read_input_tokens, and answer
with the tokens of cold runs (an engine that never reuses)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

from chat_templates import FAMILIES  # noqa: E402
from serve_fixtures import (LiveServer, build_family_tokenizer, write_family_model,  # noqa: E402
                            write_tiny_model)

from cupool.engine import Engine  # noqa: E402
from cupool.prefix import common_prefix as _common_prefix  # noqa: E402
from cupool.sampling import SamplingParams  # noqa: E402
from cupool.serve import chat, formats  # noqa: E402
from cupool.serve.loader import load  # noqa: E402

M = "tiny-moe"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("prefix") / "tiny-moe")


def test_agent_loop_prefills_only_new_tokens(model_dir):
    model, _, tok = load(model_dir, "cpu")
    cold = Engine(model, tokenizer=tok, max_batch=1, max_len=256, reuse_prefix=False)
    with LiveServer(model_dir, max_batch=2, max_len=256) as s:
        c = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=60)
        msgs = [{"role": "system", "content": "you are an agent."},
                {"role": "user", "content": "list the files."}]
        held = None
        for turn in range(5):
            before = s.engine.prefill_tokens
            r = c.chat.completions.create(model=M, messages=msgs, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True,
                                                      "return_token_ids": True})
            choice = r.choices[0]
            prompt, output = choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
            cached = r.usage.prompt_tokens_details.cached_tokens
            prefilled = s.engine.prefill_tokens - before
            assert prefilled == len(prompt) - cached, turn            # only the new tokens
            if turn == 0:
                assert cached == 0
            else:
                want = min(_common_prefix(held, prompt), len(prompt) - 1)
                assert cached == want and cached > len(prompt) // 2, (turn, cached, len(prompt))
            # the tokens of a cold run of the same prompt
            ref = cold.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
            assert output == ref.output_ids, turn
            held = prompt + output                # ignore_eos: the pipelined steps fed all 12
            msgs += [{"role": "assistant", "content": choice.message.content},
                     {"role": "user", "content": f"now step {turn + 2}."}]
        c.close()


def test_anthropic_reports_cache_reads(tmp_path):
    d = write_family_model(tmp_path / "qwen3", "qwen3")
    with LiveServer(d, max_batch=1, max_len=1024, model_name="qwen3") as s:
        c = anthropic.Anthropic(base_url=s.base_url[:-3], api_key="unused", max_retries=0)
        msgs = [{"role": "user", "content": "Hello there."}]
        m1 = c.messages.create(model="qwen3", max_tokens=6, messages=msgs)
        assert m1.usage.cache_read_input_tokens == 0
        total1 = m1.usage.input_tokens
        # the random model may open a thinking block: the reply's text blocks (maybe none)
        reply = "".join(b.text for b in m1.content if b.type == "text")
        msgs += [{"role": "assistant", "content": reply},
                 {"role": "user", "content": "And again."}]
        before = s.engine.prefill_tokens
        m2 = c.messages.create(model="qwen3", max_tokens=6, messages=msgs)
        assert m2.usage.cache_read_input_tokens >= total1 - 1
        assert s.engine.prefill_tokens - before == m2.usage.input_tokens
        c.close()


def _anthropic_reply(server, model: str, msgs):
    """One 4-token Anthropic Messages reply to `msgs` from the live server."""
    a = anthropic.Anthropic(base_url=server.base_url[:-3], api_key="unused", max_retries=0)
    try:
        return a.messages.create(model=model, max_tokens=4, messages=msgs)
    finally:
        a.close()


def test_hybrid_model_resumes_each_turn(tmp_path):
    """A Qwen3-Next-shaped model (gated delta nets) behind a chat template whose generation
    prompt opens no reasoning (Qwen3's): each turn resumes at the longest saved point of the turn
    before that its prompt starts with (the end of the previous request, else of its prompt: the
    template renders the answer from its text), reports it as cached_tokens /
    cache_read_input_tokens, and answers with a cold run's tokens."""
    d = write_family_model(tmp_path / "next", "qwen3", model_type="qwen3_next")
    model, _, tok = load(d, "cpu")
    cold = Engine(model, tokenizer=tok, max_batch=1, max_len=1024, reuse_prefix=False)
    with LiveServer(d, max_batch=2, max_len=1024, model_name="next") as s:
        c = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=60)
        msgs = [{"role": "user", "content": "Hello there."}]
        prev = None
        for turn in range(3):
            r = c.chat.completions.create(model="next", messages=msgs, max_tokens=8,
                                          temperature=0, extra_body={"ignore_eos": True,
                                                                     "return_token_ids": True})
            choice = r.choices[0]
            prompt, output = choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
            cached = r.usage.prompt_tokens_details.cached_tokens
            if prev is None:
                assert cached == 0
            else:
                # the points of the previous turn: its prompt, and everything its steps fed
                last_prompt, held = prev
                n = min(_common_prefix(held, prompt), len(prompt) - 1)
                want = max(p for p in (0, len(last_prompt), len(held)) if p <= n)
                assert cached == want and cached >= len(last_prompt), (turn, cached, want)
            ref = cold.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
            assert output == ref.output_ids, turn
            prev = (prompt, prompt + output)          # ignore_eos: the pipelined steps fed all 8
            msgs += [{"role": "assistant", "content": choice.message.content or "ok"},
                     {"role": "user", "content": f"And step {turn + 2}?"}]
        c.close()
        m = _anthropic_reply(s, "next", msgs)
    assert m.usage.cache_read_input_tokens > 0


@pytest.mark.parametrize("family, model_type", [
    ("qwen3_next", "qwen3_next"),                  # gated delta nets
    ("qwen3_8_flash_next", "qwen4_exp_text"),      # gated delta nets, n-gram states, QSA
    ("qwen3_next", "qwen3_moe"),                   # attention alone: the point changes nothing
])
def test_thinking_template_resumes_at_the_conversation_end(tmp_path, family, model_type):
    """A chat template whose generation prompt opens `<think>` and whose history drops the
    reasoning: the next turn keeps neither the previous prompt's end nor its answer, only the
    conversation before the generation prompt. The server names that point (the tokens the
    renderings with and without the generation prompt share), the engine keeps the recurrent
    states there, and turn 2 resumes from them: cached_tokens is the point, only the rest is
    prefilled, and the answer is a cold run's. Turn 3 through the Anthropic API reports its
    cache read. A model of attention alone reuses the whole common prefix, as before."""
    d = write_family_model(tmp_path / family, family, model_type=model_type)
    model, _, tok = load(d, "cpu")
    cold = Engine(model, tokenizer=tok, max_batch=1, max_len=1024, reuse_prefix=False)
    stateful = model_type != "qwen3_moe"

    def conversation_end(msgs) -> int:
        text = tok.apply_chat_template(msgs, add_generation_prompt=False, tokenize=False)
        return len(tok(text, add_special_tokens=False)["input_ids"])

    with LiveServer(d, max_batch=2, max_len=1024, model_name="m",
                    engine_kwargs={"prefill_chunk": 16}) as s:
        c = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=60)
        msgs = [{"role": "user", "content": "Hello there."}]
        last_prompt = held = prev_point = None
        for turn in range(2):
            point = conversation_end(msgs)
            before = s.engine.prefill_tokens
            r = c.chat.completions.create(model="m", messages=msgs, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True,
                                                      "return_token_ids": True})
            choice = r.choices[0]
            prompt, output = choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
            assert tok.decode(prompt).endswith("<|im_start|>assistant\n<think>\n")
            assert 0 < point < len(prompt)
            cached = r.usage.prompt_tokens_details.cached_tokens
            if turn == 0:
                assert cached == 0
            else:
                # neither the last prompt nor its answer is a prefix of this prompt
                assert _common_prefix(held, prompt) < len(last_prompt)
                want = prev_point if stateful else min(_common_prefix(held, prompt),
                                                       len(prompt) - 1)
                assert cached == want > 0, (cached, want)
            assert s.engine.prefill_tokens - before == len(prompt) - cached
            ref = cold.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
            assert output == ref.output_ids, turn
            last_prompt, held, prev_point = prompt, prompt + output, point
            msgs += [{"role": "assistant", "content": choice.message.content or "ok"},
                     {"role": "user", "content": f"And step {turn + 2}?"}]
        c.close()
        m = _anthropic_reply(s, "m", msgs)
    if stateful:
        assert m.usage.cache_read_input_tokens == prev_point
    assert m.usage.cache_read_input_tokens >= prev_point


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now.",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}}}}]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("tool_choice", [None, "required"])
def test_plan_names_the_conversation_end(family, tool_choice):
    """For every chat template the tests ship: the plan's resume_at is the conversation without
    the generation prompt (ids[:resume_at] is that rendering's tokens), inside the prompt (the
    generation prompt, and a tool-call opener, come after it), and the next turn's prompt starts
    with those tokens."""
    tok = build_family_tokenizer(family)
    fmt = formats.detect(chat.template_text(tok))
    tools = TOOLS if tool_choice else None
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Weather?"}]
    p = chat.plan(tok, fmt, msgs, tools=tools, tool_choice=tool_choice)
    conv = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=False, tokenize=False)
    assert 0 < p.resume_at < len(p.ids), (family, p.resume_at, len(p.ids))
    assert p.ids[:p.resume_at] == tok(conv, add_special_tokens=False)["input_ids"], family
    nxt = chat.plan(tok, fmt, msgs + [{"role": "assistant", "content": "Sunny."},
                                      {"role": "user", "content": "Thanks."}],
                    tools=tools, tool_choice=tool_choice)
    assert nxt.ids[:p.resume_at] == p.ids[:p.resume_at], family
    assert nxt.resume_at > p.resume_at


def test_plan_without_a_conversation_end():
    """A template that refuses to render without the generation prompt: no point (None), and the
    prompt is the one it renders with it."""
    tok = build_family_tokenizer("qwen3")
    tok.chat_template = ("{% if not add_generation_prompt %}{{ raise_exception('no') }}{% endif %}"
                         "{% for m in messages %}{{ m.content }}{% endfor %}<|im_start|>")
    p = chat.plan(tok, None, [{"role": "user", "content": "Hi."}])
    assert p.resume_at is None and tok.decode(p.ids) == "Hi.<|im_start|>"
