"""`cupool serve` on the CPU: the OpenAI-compatible server over a live uvicorn on 127.0.0.1, with
the real `openai` client (and httpx for raw HTTP), a tiny Qwen3-MoE and a tokenizer built here.

Greedy outputs are checked against the same prompts run alone through a separate Engine on the
same weights (`Reference`); bad requests against OpenAI's error object; a client that goes away
against the engine's slots; many clients at once against their own prompts' outputs.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from serve_fixtures import LiveServer, build_tokenizer, sse_data, write_tiny_model

from cupool.engine import Engine
from cupool.sampling import SamplingParams
from cupool.serve import cli
from cupool.serve.loader import load

MAX_LEN = 128
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("serve") / "tiny-moe")


@pytest.fixture(scope="module")
def server(model_dir):
    with LiveServer(model_dir, max_batch=8, max_len=MAX_LEN) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    yield c
    c.close()


class Reference:
    """The same prompts run alone (one slot) through an Engine on a second copy of the weights."""

    def __init__(self, model_dir):
        model, _, self.tok = load(model_dir, "cpu")
        self.engine = Engine(model, tokenizer=self.tok, max_batch=1, max_len=MAX_LEN)
        self.lock = threading.Lock()

    def ids(self, ids, **params):
        with self.lock:
            return self.engine.generate([list(ids)], SamplingParams(**params))[0]

    def text(self, prompt: str, **params):
        return self.ids(self.tok(prompt)["input_ids"], **params)

    def chat_ids(self, messages) -> list[int]:
        return list(self.tok.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=True)["input_ids"])

    def chat(self, messages, **params):
        return self.ids(self.chat_ids(messages), **params)


@pytest.fixture(scope="module")
def ref(model_dir):
    return Reference(model_dir)


def root(server) -> str:
    return server.base_url[: -len("/v1")]


def post(server, path, body=None, *, raw: bytes | None = None, timeout=30):
    headers = {"content-type": "application/json"}
    if raw is not None:
        return httpx.post(root(server) + path, content=raw, headers=headers, timeout=timeout)
    return httpx.post(root(server) + path, json=body, timeout=timeout)


def assert_error(resp, status: int, *, param="-", code="-", contains: str = ""):
    """The response is OpenAI's error object with this status (and param/code/text where given)."""
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in resp.text
    if param != "-":
        assert err["param"] == param, err
    if code != "-":
        assert err["code"] == code, err
    assert contains.lower() in err["message"].lower(), err
    return err


def good_request_works(client, ref):
    got = client.completions.create(model="tiny-moe", prompt="still here", max_tokens=4,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert got.choices[0].text == ref.text("still here", max_tokens=4, ignore_eos=True).text


CHAT = [{"role": "system", "content": "be brief."}, {"role": "user", "content": "hello there"}]


# --- models -----------------------------------------------------------------------------------------
def test_models(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-moe"]
    assert models.data[0].object == "model" and models.data[0].owned_by == "cupool"
    assert client.models.retrieve("tiny-moe").id == "tiny-moe"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    assert_error(httpx.get(server.base_url + "/models/other"), 404, code="model_not_found")
    health = httpx.get(root(server) + "/health").json()
    assert health["status"] == "ok"


# --- completions ------------------------------------------------------------------------------------
def test_completion(client, ref):
    prompt = "Once upon a time"
    want = ref.text(prompt, max_tokens=20, ignore_eos=True)
    got = client.completions.create(model="tiny-moe", prompt=prompt, max_tokens=20,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert got.object == "text_completion" and got.model == "tiny-moe"
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == "length"
    assert got.usage.prompt_tokens == len(ref.tok(prompt)["input_ids"]) == len(prompt)
    assert got.usage.completion_tokens == 20
    assert got.usage.total_tokens == got.usage.prompt_tokens + 20


def test_completion_stream(server, client, ref):
    prompt = "the quick brown fox"
    want = ref.text(prompt, max_tokens=16, ignore_eos=True)
    chunks = list(client.completions.create(
        model="tiny-moe", prompt=prompt, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert all(c.object == "text_completion" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    body, last = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in body) == want.text
    assert [c.choices[0].finish_reason for c in body][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    assert last.choices == [] and last.usage.completion_tokens == 16
    assert last.usage.prompt_tokens == len(prompt)
    # the wire format: data lines, [DONE] at the end, no usage key without include_usage
    resp = post(server, "/v1/completions", {"model": "tiny-moe", "prompt": prompt,
                                             "max_tokens": 3, "stream": True, "temperature": 0})
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    data = sse_data(resp.text.splitlines())
    assert data[-1] == "[DONE]" and len(data) >= 2
    assert '"usage"' not in resp.text


def test_token_prompts_several_prompts_and_token_ids(client, ref):
    ids = ref.tok("abc def")["input_ids"]
    want = ref.ids(ids, max_tokens=6, ignore_eos=True)
    got = client.completions.create(model="tiny-moe", prompt=ids, max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    assert got.choices[0].text == want.text
    assert got.choices[0].model_extra["token_ids"] == want.output_ids
    assert got.choices[0].model_extra["prompt_token_ids"] == ids
    prompts = ["first prompt", "second one"]
    got = client.completions.create(model="tiny-moe", prompt=prompts, max_tokens=5,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in got.choices] == [0, 1]
    assert [c.text for c in got.choices] == [ref.text(p, max_tokens=5, ignore_eos=True).text
                                             for p in prompts]
    assert got.usage.prompt_tokens == sum(map(len, prompts))
    assert got.usage.completion_tokens == 10
    stream = client.completions.create(model="tiny-moe", prompt=prompts, max_tokens=5,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    texts = ["", ""]
    for c in stream:
        texts[c.choices[0].index] += c.choices[0].text
    assert texts == [c.text for c in got.choices]


# --- chat -------------------------------------------------------------------------------------------
def test_chat(client, ref):
    want = ref.chat(CHAT, max_tokens=12, ignore_eos=True)
    got = client.chat.completions.create(model="tiny-moe", messages=CHAT, max_tokens=12,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert got.object == "chat.completion"
    msg = got.choices[0].message
    assert msg.role == "assistant" and msg.content == want.text
    assert got.choices[0].finish_reason == "length"
    assert got.usage.prompt_tokens == len(ref.chat_ids(CHAT))
    assert got.usage.completion_tokens == 12
    # max_completion_tokens is max_tokens's newer name; text content parts are joined
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}]
    got = client.chat.completions.create(model="tiny-moe", messages=parts,
                                         max_completion_tokens=5, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert got.usage.completion_tokens == 5
    assert got.choices[0].message.content == ref.chat(
        [{"role": "user", "content": "hello there"}], max_tokens=5, ignore_eos=True).text


def test_chat_stream(client, ref):
    want = ref.chat(CHAT, max_tokens=12, ignore_eos=True)
    chunks = list(client.chat.completions.create(
        model="tiny-moe", messages=CHAT, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "length" and all(f is None for f in finals[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


# --- stops, lengths, seeds --------------------------------------------------------------------------
def test_stop_strings_and_max_tokens(client, ref):
    prompt = "stop me if you can"
    full = ref.text(prompt, max_tokens=30, ignore_eos=True).text
    stop = full[6:8]
    cut = full[:full.find(stop)]
    got = client.completions.create(model="tiny-moe", prompt=prompt, max_tokens=30,
                                    temperature=0, stop=stop, extra_body={"ignore_eos": True})
    assert got.choices[0].text == cut and got.choices[0].finish_reason == "stop"
    stream = client.completions.create(model="tiny-moe", prompt=prompt, max_tokens=30,
                                       temperature=0, stop=[stop, "#never#"], stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    short = client.completions.create(model="tiny-moe", prompt=prompt, max_tokens=3,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3
    # EOS ends a generation with "stop": stop_token_ids (an extension) makes one a stop token
    want = ref.text(prompt, max_tokens=30, ignore_eos=True)
    tid = want.output_ids[4]
    got = client.completions.create(model="tiny-moe", prompt=prompt, max_tokens=30,
                                    temperature=0,
                                    extra_body={"ignore_eos": True, "stop_token_ids": [tid]})
    assert got.choices[0].finish_reason == "stop"
    assert got.usage.completion_tokens == want.output_ids.index(tid)
    # default max_tokens: what is left of the context, capped
    left = MAX_LEN - len(prompt)
    got = client.completions.create(model="tiny-moe", prompt=prompt, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].finish_reason == "length" and got.usage.completion_tokens == left


def test_seeded_sampling_is_reproducible(client, ref):
    def sample(seed):
        return client.chat.completions.create(
            model="tiny-moe", messages=CHAT, max_tokens=24, temperature=0.9, top_p=0.95,
            seed=seed, extra_body={"top_k": 40, "ignore_eos": True}).choices[0].message.content
    a, b, c = sample(11), sample(11), sample(12)
    assert a == b != c
    want = ref.chat(CHAT, max_tokens=24, temperature=0.9, top_p=0.95, top_k=40, seed=11,
                    ignore_eos=True)
    assert a == want.text
    greedy = ref.chat(CHAT, max_tokens=24, ignore_eos=True).text
    assert a != greedy


# --- bad requests -----------------------------------------------------------------------------------
M = "tiny-moe"
P = {"model": M, "prompt": "hi", "max_tokens": 4}
C = {"model": M, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BAD = [
    # (id, path, body or raw bytes, status, param, code, words in the message)
    ("malformed-json", "/v1/completions", b'{"model": "tiny-moe", "prompt": ', 400, None, "-",
     "not valid JSON"),
    ("not-an-object", "/v1/chat/completions", b"[1, 2]", 400, "-", "-", "JSON object"),
    ("empty-body", "/v1/completions", b"", 400, "-", "-", "JSON object"),
    ("temperature-type", "/v1/completions", {**P, "temperature": "hot"}, 400, "temperature", "-",
     "valid number"),
    ("max-tokens-type", "/v1/completions", {**P, "max_tokens": 2.5}, 400, "max_tokens", "-",
     "integer"),
    ("messages-type", "/v1/chat/completions", {**C, "messages": "hi"}, 400, "messages", "-",
     "list"),
    ("prompt-type", "/v1/completions", {**P, "prompt": [1, "a"]}, 400, "prompt", "-",
     "token ids"),
    ("model-missing", "/v1/completions", {"prompt": "hi"}, 400, "model", "-", "required"),
    ("unknown-field", "/v1/chat/completions", {**C, "functions": []}, 400, "functions", "-",
     "functions"),
    ("tools-unknown-format", "/v1/chat/completions",
     {**C, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools", "-",
     "format cupool does not know"),
    ("unknown-model", "/v1/completions", {**P, "model": "gpt-9"}, 404, "model",
     "model_not_found", "gpt-9"),
    ("unknown-model-chat", "/v1/chat/completions", {**C, "model": "gpt-9"}, 404, "model",
     "model_not_found", "does not exist"),
    ("prompt-over-context", "/v1/completions", {**P, "prompt": "x" * 120, "max_tokens": 20},
     400, "prompt", "context_length_exceeded",
     "120 tokens + max_tokens 20 = 140 exceed the context of 128"),
    ("prompt-fills-context", "/v1/completions", {"model": M, "prompt": "y" * 128}, 400, "prompt",
     "context_length_exceeded", "128 tokens"),
    ("chat-over-context", "/v1/chat/completions",
     {**C, "messages": [{"role": "user", "content": "z" * 200}]}, 400, "messages",
     "context_length_exceeded", "exceed the context of 128"),
    ("max-tokens-zero", "/v1/completions", {**P, "max_tokens": 0}, 400, "max_tokens", "-",
     ">= 1"),
    ("max-tokens-negative", "/v1/chat/completions", {**C, "max_tokens": -3}, 400, "max_tokens",
     "-", ">= 1"),
    ("max-completion-tokens-zero", "/v1/chat/completions",
     {**C, "max_tokens": None, "max_completion_tokens": 0}, 400, "max_completion_tokens", "-",
     ">= 1"),
    ("temperature-negative", "/v1/completions", {**P, "temperature": -0.5}, 400, "temperature",
     "-", ">= 0"),
    ("top-p-zero", "/v1/completions", {**P, "top_p": 0}, 400, "top_p", "-", "(0, 1]"),
    ("top-p-above-one", "/v1/chat/completions", {**C, "top_p": 1.5}, 400, "top_p", "-", "(0, 1]"),
    ("top-k-negative", "/v1/completions", {**P, "top_k": -2}, 400, "top_k", "-", "top_k"),
    ("seed-negative", "/v1/completions", {**P, "seed": -1}, 400, "seed", "-", "seed"),
    ("n-two", "/v1/completions", {**P, "n": 2}, 400, "n", "-", "n=2"),
    ("n-two-stream", "/v1/chat/completions", {**C, "n": 3, "stream": True}, 400, "n", "-",
     "n=3"),
    ("presence-penalty", "/v1/chat/completions", {**C, "presence_penalty": 0.5}, 400,
     "presence_penalty", "-", "not supported"),
    ("frequency-penalty", "/v1/completions", {**P, "frequency_penalty": 1}, 400,
     "frequency_penalty", "-", "not supported"),
    ("logprobs-completion", "/v1/completions", {**P, "logprobs": 21}, 400, "logprobs", "-",
     "in 0..20"),
    ("logprobs-chat", "/v1/chat/completions", {**C, "logprobs": True, "top_logprobs": -1}, 400,
     "top_logprobs", "-", "in 0..20"),
    ("empty-messages", "/v1/chat/completions", {**C, "messages": []}, 400, "messages", "-",
     "empty"),
    ("unknown-role", "/v1/chat/completions",
     {**C, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages", "-",
     "not 'wizard'"),
    ("image-part", "/v1/chat/completions",
     {**C, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages[0].content", "-", "only text parts"),
    ("empty-prompt", "/v1/completions", {**P, "prompt": ""}, 400, "prompt", "-", "empty"),
    ("token-outside-vocab", "/v1/completions", {**P, "prompt": [5, 64]}, 400, "prompt", "-",
     "outside the vocabulary"),
    ("empty-stop", "/v1/completions", {**P, "stop": [""]}, 400, "stop", "-", "empty"),
    ("stream-options-alone", "/v1/completions", {**P, "stream_options": {"include_usage": True}},
     400, "stream_options", "-", "stream: true"),
]


@pytest.mark.parametrize("path,body,status,param,code,words",
                         [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_request(server, client, ref, path, body, status, param, code, words):
    resp = post(server, path, raw=body) if isinstance(body, bytes) else post(server, path, body)
    assert_error(resp, status, param=param, code=code, contains=words)
    good_request_works(client, ref)


def test_bad_requests_through_the_client_and_unknown_urls(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=M, messages=[], max_tokens=3)
    assert e.value.status_code == 400 and "empty" in str(e.value)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="x", max_tokens=3)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=M, prompt="x", max_tokens=3, temperature=-1, stream=True)
    assert_error(httpx.get(root(server) + "/v1/nothing"), 404, code="unknown_url")
    assert_error(httpx.get(root(server) + "/v1/completions"), 405, code="method_not_allowed")


# --- clients that go away, many clients ---------------------------------------------------------------
@pytest.fixture(scope="module")
def slow_server(model_dir):
    """A server whose every forward takes >= 20 ms more, so a generation of 100 tokens lasts
    seconds: long enough to walk away from it."""
    with LiveServer(model_dir, max_batch=4, max_len=MAX_LEN) as s:
        hook = s.engine.model.register_forward_pre_hook(lambda *a: time.sleep(0.02))
        yield s
        hook.remove()


def test_client_disconnect_mid_stream_cancels(slow_server):
    s = slow_server
    before = dict(s.app.state.cupool.finished)
    body = {**C, "max_tokens": 100, "stream": True, "ignore_eos": True, "temperature": 0}
    t0 = time.monotonic()
    with httpx.Client(timeout=30) as c, c.stream("POST", s.base_url + "/chat/completions",
                                                 json=body) as resp:
        assert resp.status_code == 200
        got = 0
        for line in resp.iter_lines():
            got += line.startswith("data: ")
            if got == 2:                # mid-generation the event loop still answers at once
                t1 = time.monotonic()
                health = httpx.get(root(s) + "/health", timeout=5).json()
                assert health["running"] == 1 and time.monotonic() - t1 < 1.0
            if got == 4:
                break                   # leave after the role chunk and three tokens
    assert s.wait_idle(timeout=5) == 0
    assert time.monotonic() - t0 < 100 * 0.02        # cancelled, not run to the end
    after = s.app.state.cupool.finished
    deadline = time.monotonic() + 5                    # the final event reaches the app's loop
    while after.get("cancelled", 0) == before.get("cancelled", 0) and time.monotonic() < deadline:
        time.sleep(0.01)                               # a moment after the slot is freed
    assert after["cancelled"] == before.get("cancelled", 0) + 1
    assert after.get("length", 0) == before.get("length", 0)
    # a non-streaming client that times out (and closes its connection) is cancelled too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(s.base_url + "/completions", json={**P, "max_tokens": 100, "ignore_eos": True},
                   timeout=httpx.Timeout(30, read=0.3))
    assert s.wait_idle(timeout=5) == 0
    want = before.get("cancelled", 0) + 2
    deadline = time.monotonic() + 5                    # as above: the final event comes a moment
    while after.get("cancelled", 0) < want and time.monotonic() < deadline:   # after the slot
        time.sleep(0.01)
    assert s.app.state.cupool.finished["cancelled"] == want
    assert s.app.state.cupool.running == 0
    ok = httpx.post(s.base_url + "/completions", json={**P, "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 2


def test_concurrent_clients_share_the_batch(server, ref):
    prompts = [f"concurrent client number {i}" for i in range(8)]
    steps0 = server.engine.steps_run
    barrier = threading.Barrier(len(prompts))
    out: dict[int, str] = {}

    def one(i):
        c = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
        barrier.wait()
        text = ""
        for ch in c.completions.create(model=M, prompt=prompts[i], max_tokens=20, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True}):
            text += ch.choices[0].text
        out[i] = text
        c.close()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(out) == list(range(8))
    for i, p in enumerate(prompts):
        assert out[i] == ref.text(p, max_tokens=20, ignore_eos=True).text, i
    steps = server.engine.steps_run - steps0
    assert steps < 8 * 20, steps              # several sequences advanced in one step


def test_load_16_clients_x_8_requests(server, ref):
    """16 threads x 8 requests each (completions and chat, streaming and not), all at once on
    8 slots: every request completes, and each output is its own prompt's, run alone."""
    clients, per_client, n_tok = 16, 8, 8
    results: dict[tuple[int, int], tuple[str, str, str, int]] = {}
    errors: list[BaseException] = []

    def work(ci):
        c = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
        try:
            for k in range(per_client):
                prompt = f"client {ci} asks {k}"
                kind = ("completion", "chat")[(ci + k) % 2]
                stream = (ci // 2 + k) % 2 == 1
                extra = {"ignore_eos": True}
                if kind == "completion":
                    r = c.completions.create(model=M, prompt=prompt, max_tokens=n_tok,
                                             temperature=0, stream=stream, extra_body=extra)
                    text = "".join(x.choices[0].text for x in r) if stream else r.choices[0].text
                else:
                    r = c.chat.completions.create(
                        model=M, messages=[{"role": "user", "content": prompt}],
                        max_tokens=n_tok, temperature=0, stream=stream, extra_body=extra)
                    text = "".join(x.choices[0].delta.content or "" for x in r) if stream \
                        else r.choices[0].message.content
                results[(ci, k)] = (kind, prompt, text, stream)
        except BaseException as e:  # noqa: BLE001 (reported by the test below)
            errors.append(e)
        finally:
            c.close()

    t0 = time.monotonic()
    threads = [threading.Thread(target=work, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]
    assert len(results) == clients * per_client
    assert time.monotonic() - t0 < 60
    for (ci, k), (kind, prompt, text, _stream) in results.items():
        if kind == "completion":
            want = ref.text(prompt, max_tokens=n_tok, ignore_eos=True)
        else:
            want = ref.chat([{"role": "user", "content": prompt}], max_tokens=n_tok,
                            ignore_eos=True)
        assert text == want.text, (ci, k, kind)
    assert server.wait_idle() == 0
    assert server.app.state.cupool.running == 0


# --- failures on the server's side ------------------------------------------------------------------
def test_server_side_failures_are_logged_not_sent(model_dir, caplog):
    """A bug while handling a request is a 500 error object (traceback in the log only); a model
    that fails mid-stream ends the stream with an error object; the engine then refuses new work
    with 503 and /health says why."""
    caplog.set_level("ERROR", logger="cupool.serve")
    with LiveServer(model_dir, max_batch=2, max_len=MAX_LEN, model_name=M) as s:
        state = s.app.state.cupool

        class BrokenTokenizer:
            def __call__(self, text):
                raise KeyError("tokenizer bug")
        state.tokenizer, real = BrokenTokenizer(), state.tokenizer
        resp = post(s, "/v1/completions", P)
        state.tokenizer = real
        err = assert_error(resp, 500)
        assert err["type"] == "server_error" and "tokenizer bug" not in resp.text
        assert any("internal error" in r.getMessage() and r.exc_info for r in caplog.records)
        assert post(s, "/v1/completions", P).status_code == 200

        fail = threading.Event()

        def forward(*args):
            if fail.is_set():
                raise RuntimeError("the device fell over")
        s.engine.model.register_forward_pre_hook(forward)
        body = {**C, "max_tokens": 60, "stream": True, "ignore_eos": True}
        with httpx.Client(timeout=30) as c, c.stream("POST", s.base_url + "/chat/completions",
                                                     json=body) as resp:
            data = []
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    data.append(line[6:])
                    fail.set()
        assert data[-1] == "[DONE]" and '"error"' in data[-2] and "Traceback" not in data[-2]
        assert "device fell over" not in data[-2]
        assert any("device fell over" in r.getMessage() for r in caplog.records)
        assert_error(post(s, "/v1/completions", P), 503, contains="stopped after an error")
        assert_error(httpx.get(root(s) + "/health"), 503)


# --- a model directory without a tokenizer --------------------------------------------------------------
def test_without_a_tokenizer(tmp_path, ref):
    d = write_tiny_model(tmp_path / "no-tok", tokenizer=False)
    with LiveServer(d, max_batch=2, max_len=MAX_LEN, model_name="bare") as s:
        assert s.tokenizer is None
        ids = ref.tok("token ids only")["input_ids"]
        resp = post(s, "/v1/completions", {"model": "bare", "prompt": ids, "max_tokens": 5,
                                           "temperature": 0, "ignore_eos": True,
                                           "return_token_ids": True})
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert choice["token_ids"] == ref.ids(ids, max_tokens=5, ignore_eos=True).output_ids
        assert choice["text"] == ""
        assert_error(post(s, "/v1/completions", {"model": "bare", "prompt": "text"}), 400,
                     param="prompt", contains="no tokenizer")
        assert_error(post(s, "/v1/chat/completions", {**C, "model": "bare"}), 400,
                     param="messages", contains="no tokenizer")
        assert_error(post(s, "/v1/completions", {"model": "bare", "prompt": ids, "stop": "x"}),
                     400, param="stop", contains="stop strings need a tokenizer")


def test_loader(tmp_path, model_dir):
    from cupool.serve.loader import LoadError, read_config, resolve_max_len
    model, pool, tok = load(model_dir, "cpu")
    assert pool is None and tok is not None and not model.training
    assert resolve_max_len(read_config(model_dir), None) == 256          # min(positions, 4096)
    assert resolve_max_len({}, None) == 4096
    with pytest.raises(LoadError, match="does not exist"):
        load(tmp_path / "nothing", "cpu")
    with pytest.raises(LoadError, match="no config.json"):
        load(tmp_path, "cpu")
    with pytest.raises(LoadError, match="max_position_embeddings=256"):
        load(model_dir, "cpu", max_len=257)
    with pytest.raises(LoadError, match="CUDA device"):
        load(model_dir, "cpu", budget="1GiB")
    with pytest.raises(LoadError, match="quantizing the attention projections applies to a "
                                        "CUDA device"):
        load(model_dir, "cpu", quantize_attention=True)
    broken = tmp_path / "broken-tokenizer"
    write_tiny_model(broken)
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(LoadError, match="tokenizer .* does not load"):
        load(broken, "cpu")



def test_the_bank_leaves_room_for_the_kv_cache(model_dir, monkeypatch):
    """On CUDA the loader asks from_pretrained to keep the KV cache of max_batch sequences of
    max_len tokens out of the bank's share of the budget (no GPU needed: from_pretrained is
    replaced by a recorder)."""
    import cupool
    from cupool.kvcache import kv_bytes_per_token
    from cupool.serve import loader
    from transformers import AutoConfig
    seen = {}

    def record(path, **kwargs):
        seen.update(kwargs)
        return "loaded"

    monkeypatch.setattr(cupool, "from_pretrained", record)
    per_token = kv_bytes_per_token(AutoConfig.from_pretrained(model_dir))
    assert per_token > 0
    assert loader.load(model_dir, "cuda", budget="20GiB", max_batch=3, max_len=200) == "loaded"
    reserve = seen["kv_reserve"]                   # attention alone: no states, no resume points
    assert (reserve.kv, reserve.states, reserve.resume_points) == (per_token * 200 * 3, 0, 0)
    assert reserve.total == per_token * 200 * 3
    assert (seen["budget"], seen["max_decode_tokens"]) == ("20GiB", 3)
    loader.load(model_dir, "cuda", max_batch=2)                       # default max_len: 256
    assert seen["kv_reserve"].total == per_token * 256 * 2

# --- the serve command ------------------------------------------------------------------------------
def _parse(argv):
    parser = argparse.ArgumentParser(prog="cupool serve")
    cli.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("argv,words", [
    (["--model", "{missing}"], "does not exist"),
    (["--model", "{empty}"], "no config.json"),
    (["--model", "{model}", "--port", "70000"], "--port must be in 0..65535"),
    (["--model", "{model}", "--port", "http"], "--port must be an integer"),
    (["--model", "{model}", "--max-batch", "0"], "--max-batch must be >= 1"),
    (["--model", "{model}", "--budget", "lots"], "is not a size"),
    (["--model", "{model}", "--device", "cpu", "--budget", "40GiB"], "applies to a CUDA device"),
    (["--model", "{model}", "--max-len", "1000"], "max_position_embeddings=256"),
    (["--model", "{model}", "--device", "abacus"], "--device 'abacus'"),
    (["--model", "{model}", "--log-level", "loud"], "--log-level"),
    (["--model", "{model}", "--max-queue", "-1"], "--max-queue must be >= 0"),
    (["--model", "{model}", "--resume-points", "-2"], "--resume-points must be >= 0"),
    (["--model", "{model}", "--shutdown-timeout", "soon"], "--shutdown-timeout"),
    (["--model", "{model}", "--api-key", " "], "--api-key is empty"),
    (["--model", "{model}", "--device", "cpu", "--host-experts"], "--host-experts applies to a CUDA"),
    (["--model", "{model}", "--no-host-experts", "--host-threads", "4"],
     "--host-threads applies to host experts, which --no-host-experts turns off"),
    (["--model", "{model}", "--device", "cpu", "--host-threads", "4"],
     "--host-threads applies to host experts, which --device cpu turns off"),
    (["--model", "{model}", "--no-host-experts", "--host-promote"],
     "--host-promote applies to host experts, which --no-host-experts turns off"),
    (["--model", "{model}", "--host-threads", "0"], "--host-threads must be in 1..1024, got 0"),
    (["--model", "{model}", "--host-experts", "--host-threads", "many"],
     "--host-threads must be an integer"),
    (["--model", "{model}", "--no-host-experts", "--host-min-misses", "9"],
     "--host-min-misses applies to host experts, which --no-host-experts turns off"),
    (["--model", "{model}", "--host-min-misses", "-1"],
     "--host-min-misses must be in 0..1048576, got -1"),
    (["--model", "{model}", "--host-experts", "--host-min-misses", "some"],
     "--host-min-misses must be an integer"),
    (["--model", "{model}", "--no-host-experts", "--host-prefill-tokens", "64"],
     "--host-prefill-tokens applies to host experts, which --no-host-experts turns off"),
    (["--model", "{model}", "--host-prefill-tokens", "-1"],
     "--host-prefill-tokens must be in 0..1048576, got -1"),
    (["--model", "{model}", "--host-experts", "--host-prefill-tokens", "wide"],
     "--host-prefill-tokens must be an integer"),
    (["--model", "{model}", "--device", "cpu", "--quantize-attention"],
     "--quantize-attention applies to a CUDA device"),
], ids=["missing-dir", "no-config", "port-range", "port-type", "max-batch", "budget",
        "budget-on-cpu", "max-len", "device", "log-level", "max-queue", "resume-points",
        "shutdown-timeout", "api-key", "host-experts-on-cpu", "host-threads-when-off",
        "host-threads-on-cpu", "host-promote-when-off",
        "host-threads-range", "host-threads-type", "host-min-misses-when-off",
        "host-min-misses-range", "host-min-misses-type", "host-prefill-tokens-when-off",
        "host-prefill-tokens-range", "host-prefill-tokens-type", "quantize-attention-on-cpu"])
def test_cli_argument_errors(tmp_path, model_dir, capsys, argv, words):
    (tmp_path / "empty").mkdir()
    subst = {"{missing}": str(tmp_path / "missing"), "{empty}": str(tmp_path / "empty"),
             "{model}": str(model_dir)}
    args = _parse([subst.get(a, a) for a in argv])
    assert cli.run(args) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cupool serve: error: "), err
    assert words in lines[0], lines[0]


def test_host_experts_options(model_dir, monkeypatch):
    """Host experts: None (serve's default, decided once the bank is built), True with
    --host-experts, False with --no-host-experts or on the CPU; the host's misses left out of the
    bank unless --host-promote; --host-prefill-tokens 0 (decode steps only) unless given (a CUDA
    device stood in where they need one)."""
    def opts(*argv):
        return cli.check_options(_parse(["--model", str(model_dir), *argv]))

    assert opts("--device", "cpu").host_experts is False
    monkeypatch.setattr(cli, "_device", lambda value: "cuda")
    o = opts()
    assert o.host_experts is None and o.host_leave and o.host_prefill_tokens == 0
    o = opts("--host-experts", "--host-prefill-tokens", " 512 ", "--host-promote")
    assert o.host_experts is True and o.host_prefill_tokens == 512 and not o.host_leave
    o = opts("--host-threads", "6", "--host-min-misses", "12")
    assert o.host_experts is None and (o.host_threads, o.host_min_misses) == (6, 12)
    assert opts("--no-host-experts").host_experts is False


def test_narrow_step_option(model_dir):
    """serve runs a narrow step where few requests are active by default; --no-narrow-step runs
    every step over all --max-batch slots (the Engine's narrow)."""
    def opts(*argv):
        return cli.check_options(_parse(["--model", str(model_dir), "--device", "cpu", *argv]))

    assert opts().narrow is True
    assert opts("--no-narrow-step").narrow is False


def test_quantize_attention_option(model_dir, monkeypatch):
    """--quantize-attention reaches cupool.from_pretrained; a projection it cannot quantize is a
    LoadError (one line, exit code 2), not a traceback (a CUDA device stood in)."""
    import torch

    import cupool
    from cupool.pretrained import QuantizeError
    from cupool.serve import loader

    def opts(*argv):
        return cli.check_options(_parse(["--model", str(model_dir), *argv]))

    monkeypatch.setattr(cli, "_device", lambda value: "cuda")
    assert not opts().quantize_attention and opts("--quantize-attention").quantize_attention
    with pytest.raises(cli.UsageError, match="--quantize-attention is for the fused decode "
                                             "step, which --no-fused turns off"):
        opts("--quantize-attention", "--no-fused")
    seen = {}

    def from_pretrained(path, **kw):
        seen.update(kw)
        if kw.get("quantize_attention"):
            raise QuantizeError("quantize_attention: model.layers.0.self_attn.q_proj.weight is "
                                "[64, 40]; NVFP4 needs its inner dim to be a multiple of 16")
        return "loaded"

    monkeypatch.setattr(cupool, "from_pretrained", from_pretrained)
    dev = torch.device("cuda")
    assert loader._load_cuda(model_dir, dev, None, 2, 64, None, None) == "loaded"
    assert "quantize_attention" not in seen
    with pytest.raises(loader.LoadError, match=r"q_proj\.weight is \[64, 40\]; NVFP4 needs"):
        loader._load_cuda(model_dir, dev, None, 2, 64, None, None, True)
    assert seen["quantize_attention"] is True


def test_unused_quantization_is_named():
    """--quantize-attention where no GEMV of the decode step reads the projections (the model's
    own forward, or fused layers without NVFP4 GEMVs): the warning names the step; none where
    some GEMV reads them."""
    from types import SimpleNamespace

    from cupool.serve.loader import unused_quantization

    def engine(counts, kind="fused decode step: 3 of 3 layers"):
        step = None if counts is None else SimpleNamespace(nvfp4_gemvs=lambda: counts)
        return SimpleNamespace(fused_step=step, step_kind=kind)

    assert unused_quantization(engine({"qkv": 3, "o": 0})) is None
    why = unused_quantization(engine(None, "compiled graph"))
    assert why == ("--quantize-attention: no GEMV of the decode step (compiled graph) reads the "
                   "quantized projections; they change the outputs and make nothing faster")
    assert "(fused decode step: 3 of 3 layers)" in unused_quantization(engine({"qkv": 0, "o": 0}))


def test_batch_prefill_option(model_dir):
    """Prompts that arrive together are prefilled in one forward unless --no-batch-prefill."""
    def opts(*argv):
        return cli.check_options(_parse(["--model", str(model_dir), "--device", "cpu", *argv]))

    assert opts().batch_prefill and not opts("--no-batch-prefill").batch_prefill


@pytest.mark.parametrize("every,tokens,min_misses,cpus,compiler,why", [
    (False, 8, None, 16, True, None),
    (False, 2, None, 8, True, None),
    (True, 8, None, 16, True, "the bank holds every expert (8 rows a layer)"),
    (False, 1, None, 16, True, "a step of 1 sequence has at most 2 misses, fewer than "
                               "--host-min-misses 3"),
    (False, 4, 9, 16, True, "a step of 4 sequences has at most 8 misses, fewer than "
                            "--host-min-misses 9"),
    (False, 1, 2, 16, True, None),
    (False, 8, None, 7, True, "this process may use 7 CPUs, fewer than 8"),
    (False, 8, None, 8, False, "none was found"),
], ids=["on", "on-at-8-cpus", "every-expert", "one-sequence", "min-misses", "one-sequence-low-min",
        "few-cpus", "no-compiler"])
def test_auto_host_experts(monkeypatch, every, tokens, min_misses, cpus, compiler, why):
    """serve's default turns host experts on where the bank misses experts, a step of --max-batch
    sequences can reach --host-min-misses (top-k + 1 by default), the process may use at least
    AUTO_HOST_CPUS CPUs and a C compiler builds the host's loop; else it gives the reason."""
    from types import SimpleNamespace

    from cupool import hostexperts
    from cupool.serve.loader import auto_host_experts

    monkeypatch.setattr(hostexperts, "usable_cpus", lambda: cpus)
    monkeypatch.delenv("CC", raising=False)
    if not compiler:
        monkeypatch.setattr(hostexperts.shutil, "which", lambda name: None)
    pool = SimpleNamespace(num_experts=8, top_k=2,
                           bank=SimpleNamespace(holds_every_expert=lambda: every))
    got = auto_host_experts(pool, tokens, min_misses)
    if why is None or not why.startswith("none"):
        assert got == why
    else:
        assert why in got


def test_serve_decides_host_experts_and_says_why(caplog, monkeypatch):
    """`_host_experts_wanted`: the flags decide where given; by default `auto_host_experts`
    does, and the log says why they are off (a warning where host settings were given)."""
    import logging
    from types import SimpleNamespace

    from cupool.serve import loader

    log = logging.getLogger("cupool.test_host_auto")
    base = dict(device="cuda", max_batch=8, host_threads=None, host_leave=True,
                host_min_misses=None, host_prefill_tokens=0)
    reason = {"now": None}
    monkeypatch.setattr(loader, "auto_host_experts", lambda pool, tokens, m: reason["now"])
    for host_experts, why, extra, want, level, words in (
            (True, "ignored", {}, True, None, None),
            (False, None, {}, False, logging.INFO, "host experts: off (--no-host-experts)"),
            (None, None, {}, True, None, None),
            (None, "the bank holds every expert (8 rows a layer)", {}, False, logging.INFO,
             "host experts: off: the bank holds every expert (8 rows a layer)"),
            (None, "this process may use 4 CPUs, fewer than 8",
             {"host_threads": 3, "host_leave": False}, False, logging.WARNING,
             "host experts: off, so --host-threads and --host-promote are unused: this process "
             "may use 4 CPUs, fewer than 8")):
        reason["now"] = why
        opts = SimpleNamespace(**{**base, **extra}, host_experts=host_experts)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=log.name):
            assert cli._host_experts_wanted(log, None, opts) is want
        if words is None:
            assert not caplog.records
        else:
            rec = caplog.records[-1]
            assert rec.levelno == level and words in rec.getMessage(), rec.getMessage()


def test_host_experts_refused_for_a_bank_holding_every_expert():
    """`serve` / `generate --host-experts` on a bank that misses nothing: a LoadError (one line,
    exit code 2 from either command) before the host's threads start."""
    from types import SimpleNamespace

    from cupool.serve.loader import LoadError, enable_host_experts

    def refuse(*a, **k):
        raise AssertionError("enable_host_experts reached the pool")

    pool = SimpleNamespace(num_experts=8, bank=SimpleNamespace(holds_every_expert=lambda: True),
                           enable_host_experts=refuse)
    with pytest.raises(LoadError, match=r"--host-experts: the bank holds every expert \(8 rows"):
        enable_host_experts(pool, 1)
    calls = []
    pool = SimpleNamespace(num_experts=8, bank=SimpleNamespace(holds_every_expert=lambda: False),
                           gemm=SimpleNamespace(max_prefill_tokens=2048),
                           enable_host_experts=lambda *a, **k: calls.append((a, k)))
    enable_host_experts(pool, 2, 3, True)                    # --host-threads 3 --host-leave
    enable_host_experts(pool, 2, None, True, 9)              # and --host-min-misses 9
    enable_host_experts(pool, 2, None, False, None, 512)     # --host-prefill-tokens 512
    enable_host_experts(pool, 2, None, False, None, 2048)    # the widest the pool allows
    assert calls == [((2,), {"threads": 3, "leave": True, "min_misses": None,
                             "prefill_tokens": 0}),
                     ((2,), {"threads": None, "leave": True, "min_misses": 9,
                             "prefill_tokens": 0}),
                     ((2,), {"threads": None, "leave": False, "min_misses": None,
                             "prefill_tokens": 512}),
                     ((2,), {"threads": None, "leave": False, "min_misses": None,
                             "prefill_tokens": 2048})]
    calls.clear()
    pool.gemm.max_prefill_tokens = 256
    with pytest.raises(LoadError, match=r"--host-prefill-tokens 257 exceeds the widest prefill "
                                        r"call the pool was built for, 256 tokens"):
        enable_host_experts(pool, 1, prefill_tokens=257)
    assert calls == []


def test_cli_serves_until_interrupted(model_dir):
    """`run` in a process of its own on a free port: it prints the URL once ready, serves, and
    exits 0 on Ctrl-C (SIGINT)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "cupool.serve.cli", "--model", str(model_dir),
                             "--port", "0", "--device", "cpu", "--max-len", "64",
                             "--served-model-name", "cli-moe", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "http://127.0.0.1:" in line, (line, proc.poll())
        url = line.split(" at ")[1].split()[0]
        models = httpx.get(url + "/models", timeout=10).json()
        assert models["data"][0]["id"] == "cli-moe" and models["data"][0]["max_model_len"] == 64
        got = httpx.post(url + "/completions", json={"model": "cli-moe", "prompt": "hi",
                                                     "max_tokens": 3}, timeout=30)
        assert got.status_code == 200 and got.json()["usage"]["prompt_tokens"] == 2
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_fixture_tokenizer_round_trips():
    tok = build_tokenizer()
    assert tok.decode(tok("Hello, World!")["input_ids"]) == "hello, world!"
    assert len(tok) == 64


def test_host_experts_log_which_steps_hand_over(caplog):
    """serve's log says from how many active sequences a step hands the host its share
    (`HostDecode.hands_over`), and warns where no step of --max-batch sequences can."""
    import logging
    from types import SimpleNamespace

    import numpy as np

    from cupool.layer import HostDecode
    from cupool.serve import cli, loader

    hd = object.__new__(HostDecode)            # hands_over alone: a pool of top-8, split from 9
    hd.pool, hd.first_handed = SimpleNamespace(top_k=8), 9
    assert [hd.hands_over(n) for n in (0, 1, 2, 8)] == [False, False, True, True]
    hd.first_handed = None
    assert not hd.hands_over(16)

    def fake(min_misses, prefill_tokens):
        return SimpleNamespace(hx=SimpleNamespace(threads=3), cpu_us=40.0, cpu_call_us=20.0,
                               link_us=55.0, split=np.zeros(65, dtype=np.int64), leave=True,
                               min_misses=min_misses, hands_over=lambda n: n * 8 >= min_misses,
                               prefill_tokens=prefill_tokens,
                               prefill_costs=[(128, 30.25, 180.0), (512, 61.5, 410.0)]
                               if prefill_tokens else [],
                               prefill_link_us=48.75 if prefill_tokens else 0.0)

    log = logging.getLogger("cupool.test_host_log")
    pool = SimpleNamespace(top_k=8)
    for min_misses, prefill, level, words, last in (
            (9, 512, logging.INFO, "steps of fewer than 2 active sequences run without the "
                                    "hand-off (--host-min-misses 9)",
             "prompt prefill calls of up to 512 tokens share their missing experts with the host "
             "(128 tokens: 30.2 us a row + 180 a call; 512 tokens: 61.5 us a row + 410 a call; "
             "a row 48.8 us on the link)"),
            (65, 0, logging.WARNING, "no step hands the host anything (--host-min-misses 65; a "
                                     "step of 8 sequences has at most 64 misses)",
             "decode steps only (--host-prefill-tokens N: prompt prefill calls of up to N tokens "
             "too)")):
        opts = SimpleNamespace(max_batch=8, host_threads=None, host_leave=True,
                               host_min_misses=min_misses, host_prefill_tokens=prefill)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=log.name), \
                pytest.MonkeyPatch.context() as mp:
            mp.setattr(loader, "enable_host_experts",
                       lambda pool, tokens, threads, leave, m, p: fake(m, p))
            cli._enable_host_experts(log, pool, opts)
        rec = caplog.records[-2]
        assert rec.levelno == level and words in rec.getMessage(), rec.getMessage()
        rec = caplog.records[-1]
        assert rec.levelno == logging.INFO and last in rec.getMessage(), rec.getMessage()
