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

from serve_fixtures import LiveServer, write_family_model, write_tiny_model  # noqa: E402

from cupool.engine import Engine, _common_prefix  # noqa: E402
from cupool.sampling import SamplingParams  # noqa: E402
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
        a = anthropic.Anthropic(base_url=s.base_url[:-3], api_key="unused", max_retries=0)
        m = a.messages.create(model="next", max_tokens=4, messages=msgs)
        a.close()
    assert m.usage.cache_read_input_tokens > 0
