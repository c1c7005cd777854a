"""Structured output through `cupool serve` on the CPU: response_format json_schema and
json_object compiled by llguidance, applied as the engine's token mask in the sampling step; the
tiny random model's answers validate against the schema (jsonschema), greedy and sampled, beside
an unconstrained request in the same batch."""

from __future__ import annotations

import json
import threading

import pytest

pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from serve_fixtures import LiveServer, write_family_model  # noqa: E402

from cupool.engine import Engine  # noqa: E402
from cupool.sampling import SamplingParams  # noqa: E402
from cupool.serve.grammar import Grammars  # noqa: E402
from cupool.serve.loader import load  # noqa: E402

SCHEMA = {"type": "object",
          "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                         "days": {"type": "integer", "minimum": 1, "maximum": 14},
                         "rain": {"type": "boolean"},
                         "note": {"type": "string", "maxLength": 12}},
          "required": ["city", "days", "rain", "note"], "additionalProperties": False}
MSGS = [{"role": "user", "content": "Plan a trip. Answer in JSON."}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_family_model(tmp_path_factory.mktemp("structured") / "qwen3", "qwen3")


@pytest.fixture(scope="module")
def server(model_dir):
    with LiveServer(model_dir, max_batch=3, max_len=512, model_name="qwen3") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()


def fmt(schema):
    return {"type": "json_schema", "json_schema": {"name": "trip", "schema": schema,
                                                   "strict": True}}


def test_json_schema_output_validates(client):
    outs = {}

    def one(key, **kw):
        r = client.chat.completions.create(model="qwen3", messages=MSGS, max_tokens=120,
                                           response_format=fmt(SCHEMA), extra_body=NO_THINK,
                                           **kw)
        outs[key] = r.choices[0]
    threads = [threading.Thread(target=one, args=("greedy",), kwargs={"temperature": 0}),
               threading.Thread(target=one, args=("sampled",),
                                kwargs={"temperature": 1.0, "seed": 5}),
               threading.Thread(target=one, args=("sampled2",),
                                kwargs={"temperature": 1.0, "seed": 6})]
    for t in threads:
        t.start()
    free = client.chat.completions.create(model="qwen3", messages=MSGS, max_tokens=30,
                                          temperature=0, extra_body=NO_THINK)
    for t in threads:
        t.join(120)
    for key, choice in outs.items():
        assert choice.finish_reason == "stop", (key, choice.message.content)
        obj = json.loads(choice.message.content)
        jsonschema.validate(obj, SCHEMA)
    assert len(outs) == 3
    # an unconstrained answer of the same model is not JSON: the mask did the work
    with pytest.raises(ValueError):
        json.loads(free.choices[0].message.content)
    # streamed
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="qwen3", messages=MSGS, max_tokens=120, response_format=fmt(SCHEMA), stream=True,
        temperature=0, extra_body=NO_THINK) if c.choices)
    assert json.loads(text) == json.loads(outs["greedy"].message.content)


def test_bad_response_formats(client):
    def bad(match, **kw):
        with pytest.raises(openai.BadRequestError, match=match):
            client.chat.completions.create(model="qwen3", messages=MSGS, max_tokens=5, **kw)
    bad("response_format.type", response_format={"type": "yaml"})
    bad("does not compile", response_format=fmt({"type": "object", "properties": {
        "a": {"type": "no-such-type"}}}), extra_body=NO_THINK)
    bad("tools cannot be combined", response_format={"type": "json_object"},
        tools=[{"type": "function", "function": {"name": "f"}}])


def test_reasoning_prompt_is_refused(tmp_path):
    d = write_family_model(tmp_path / "next", "qwen3_next")       # its prompt opens <think>
    with LiveServer(d, max_batch=1, max_len=512, model_name="next") as s:
        c = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="enable_thinking"):
            c.chat.completions.create(model="next", messages=MSGS, max_tokens=5,
                                      response_format={"type": "json_object"})


def test_json_object_constraint_on_the_engine(model_dir):
    """json_object on the engine directly: greedy answers of random weights are objects; the
    first token the mask allows is the object's opening brace."""
    model, _, tok = load(model_dir, "cpu")
    eng = Engine(model, tokenizer=tok, max_batch=2, max_len=256)
    g = Grammars(tok, eng.vocab, eng.eos_ids)
    import torch
    words = torch.zeros((eng.vocab + 31) // 32, dtype=torch.int32)
    c = g.constraint({"type": "object", "properties": {"k": {"enum": [1, 2]}},
                      "required": ["k"], "additionalProperties": False})
    c.fill(words)
    allowed = [t for t in range(eng.vocab) if (int(words[t // 32]) >> (t % 32)) & 1]
    assert allowed == [tok.convert_tokens_to_ids("{")]
    prompt = tok("say something", add_special_tokens=False)["input_ids"]
    r = eng.submit(prompt, SamplingParams(max_tokens=40), constraint=c)
    eng.run_until_idle()
    assert r.finish_reason == "stop" and json.loads(r.text) in ({"k": 1}, {"k": 2})
