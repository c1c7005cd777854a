"""`cupool serve` operations on the CPU, over a live server on 127.0.0.1 with the real `openai`
client: API keys (401), /metrics parsed by prometheus_client's own parser, logprobs against the
model's log-softmax, a bounded queue (429), and shutdown that lets requests in flight finish up
to a deadline (in process, and SIGTERM to `cupool serve` in a process of its own)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
prom_parser = pytest.importorskip("prometheus_client.parser")

from serve_fixtures import LiveServer, write_tiny_model  # noqa: E402

from cupool.serve.loader import load  # noqa: E402

M = "tiny-moe"
ROOT = Path(__file__).resolve().parent.parent
KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("ops") / "tiny-moe")


def root(s) -> str:
    return s.base_url[: -len("/v1")]


def client(s, key="unused"):
    return openai.OpenAI(base_url=s.base_url, api_key=key, max_retries=0, timeout=60)


# --- API keys -----------------------------------------------------------------------------------
def test_api_key(model_dir):
    with LiveServer(model_dir, max_batch=2, max_len=64, api_key=KEY) as s:
        with pytest.raises(openai.AuthenticationError) as e:
            client(s, "wrong-key").models.list()
        assert e.value.status_code == 401 and "not valid" in str(e.value)
        with pytest.raises(openai.AuthenticationError):
            client(s, "wrong-key").chat.completions.create(
                model=M, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        for path in ("/v1/models", "/metrics", "/v1/nothing"):
            r = httpx.get(root(s) + path)
            assert r.status_code == 401, path
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["code"] == "invalid_api_key" and "Authorization: Bearer" in err["message"]
        r = httpx.post(s.base_url + "/completions", json={"model": M, "prompt": "hi"})
        assert r.status_code == 401
        assert httpx.get(root(s) + "/health").status_code == 200          # open
        got = client(s, KEY).completions.create(model=M, prompt="hi", max_tokens=3)
        assert got.usage.completion_tokens <= 3
        r = httpx.get(s.base_url + "/models", headers={"x-api-key": KEY})  # Anthropic's header
        assert r.status_code == 200


def test_api_key_from_the_environment(monkeypatch):
    from cupool.serve.auth import ENV, allowed, key_from_env
    monkeypatch.setenv(ENV, "from-env")
    assert key_from_env(None) == "from-env" and key_from_env("given") == "given"
    monkeypatch.delenv(ENV)
    assert key_from_env(None) is None
    assert allowed("/v1/models", {}, None)
    assert not allowed("/v1/models", {"authorization": "Bearer x"}, "y")
    assert allowed("/v1/models", {"authorization": "bearer y"}, "y")


# --- metrics and logprobs ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(model_dir):
    with LiveServer(model_dir, max_batch=4, max_len=128) as s:
        yield s


def metrics(s) -> dict:
    """{sample name (with labels): value} from /metrics, through prometheus_client's parser."""
    text = httpx.get(root(s) + "/metrics").text
    out = {}
    for fam in prom_parser.text_string_to_metric_families(text):
        for smp in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(smp.labels.items()))
            out[smp.name + (f"{{{labels}}}" if labels else "")] = smp.value
    return out


def test_metrics(server):
    c = client(server)
    before = metrics(server)
    got = c.completions.create(model=M, prompt="count me", max_tokens=6, temperature=0,
                               extra_body={"ignore_eos": True})
    chat = c.chat.completions.create(model=M, messages=[{"role": "user", "content": "hi"}],
                                     max_tokens=5, temperature=0, stream=True,
                                     extra_body={"ignore_eos": True})
    list(chat)
    after = metrics(server)

    def delta(name):
        return after.get(name, 0) - before.get(name, 0)
    assert delta("cupool_requests_total{endpoint=completions,finish_reason=length}") == 1
    assert delta("cupool_requests_total{endpoint=chat,finish_reason=length}") == 1
    assert delta("cupool_prompt_tokens_total") == got.usage.prompt_tokens + len(
        server.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                             add_generation_prompt=True, tokenize=True)["input_ids"])
    assert delta("cupool_generation_tokens_total") == 11
    assert delta("cupool_time_to_first_token_seconds_count") == 2
    assert delta("cupool_inter_token_latency_seconds_count") == 5 + 4
    assert after["cupool_time_to_first_token_seconds_bucket{le=+Inf}"] == \
        after["cupool_time_to_first_token_seconds_count"]
    assert after["cupool_requests_running"] == 0 and after["cupool_requests_waiting"] == 0
    assert after["cupool_slots"] == 4
    assert "cupool_bank_hit_rate" not in after              # no pool on the CPU


@torch.inference_mode()
def model_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log_softmax of the model over the whole sequence, at the positions that chose `output`."""
    ids = torch.tensor([prompt + output])
    logits = model(input_ids=ids, use_cache=False).logits[0].float()
    return torch.log_softmax(logits, -1)[len(prompt) - 1: len(prompt) - 1 + len(output)]


@pytest.fixture(scope="module")
def plain_model(model_dir):
    return load(model_dir, "cpu")[0]


def test_logprobs(server, plain_model):
    tok, c = server.tokenizer, client(server)
    msgs = [{"role": "user", "content": "tell me"}]
    prompt = list(tok.apply_chat_template(msgs, add_generation_prompt=True,
                                          tokenize=True)["input_ids"])
    got = c.chat.completions.create(model=M, messages=msgs, max_tokens=8, temperature=0.8,
                                    seed=3, logprobs=True, top_logprobs=3,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = got.choices[0].model_extra["token_ids"]
    content = got.choices[0].logprobs.content
    assert len(content) == len(ids) == 8
    want = model_logprobs(plain_model, prompt, ids)
    for i, (entry, t) in enumerate(zip(content, ids)):
        assert entry.token == tok.decode([t]) and entry.bytes == list(entry.token.encode())
        # tolerance: the served logits come through the KV cache, the reference without it
        assert abs(entry.logprob - want[i, t].item()) < 1e-4, i
        top = [x.logprob for x in entry.top_logprobs]
        assert len(top) == 3 and top == sorted(top, reverse=True)
        assert abs(top[0] - want[i].max().item()) < 1e-4
    # streamed: one entry a token, the same values; completions: the legacy object
    stream = c.chat.completions.create(model=M, messages=msgs, max_tokens=8, temperature=0.8,
                                       seed=3, logprobs=True, top_logprobs=3, stream=True,
                                       extra_body={"ignore_eos": True})
    streamed = [e for ch in stream if ch.choices and ch.choices[0].logprobs
                for e in ch.choices[0].logprobs.content]
    # tolerance: the second request reuses the first's prompt KV (prefix reuse), so its last
    # prompt token runs alone rather than in the prompt's chunk: last-bit differences
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(streamed, content))
    comp = c.completions.create(model=M, prompt="abc", max_tokens=4, temperature=0, logprobs=2,
                                extra_body={"ignore_eos": True})
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == 4 and "".join(lp.tokens) == comp.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert all(lp.token_logprobs[i] == max(lp.top_logprobs[i].values()) for i in range(4))
    # without logprobs: null, as before
    plain = c.chat.completions.create(model=M, messages=msgs, max_tokens=2)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("body,words", [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be in 0..20"),
    ({"top_logprobs": 2}, "needs logprobs"),
])
def test_logprobs_bad_requests(server, body, words):
    r = httpx.post(server.base_url + "/chat/completions",
                   json={"model": M, "messages": [{"role": "user", "content": "x"}], **body})
    assert r.status_code == 400 and words in r.json()["error"]["message"]


# --- a bounded queue -----------------------------------------------------------------------------------
def test_full_queue_answers_429(model_dir):
    with LiveServer(model_dir, max_batch=1, max_len=128, max_queue=1) as s:
        gate = threading.Event()
        hook = s.engine.model.register_forward_pre_hook(lambda *a: None if gate.wait(30) else None)
        body = {"model": M, "prompt": "slow", "max_tokens": 5, "ignore_eos": True}
        done = []
        threads = [threading.Thread(target=lambda: done.append(
            httpx.post(s.base_url + "/completions", json=body, timeout=60).status_code))
            for _ in range(2)]
        try:
            for t in threads:                         # one runs (stuck in its prefill), one waits
                t.start()
            deadline = time.monotonic() + 10
            while s.app.state.cupool.running < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            with pytest.raises(openai.RateLimitError) as e:
                client(s).completions.create(model=M, prompt="third", max_tokens=2)
            assert e.value.status_code == 429 and e.value.code == "queue_full"
            assert "--max-queue" in str(e.value)
            r = httpx.get(root(s) + "/metrics")
            assert 'cupool_rejected_requests_total{reason="queue_full"} 1.0' in r.text
        finally:
            gate.set()
            for t in threads:
                t.join(60)
            hook.remove()
        assert done == [200, 200]
        assert client(s).completions.create(model=M, prompt="x", max_tokens=1).choices


# --- shutdown ----------------------------------------------------------------------------------------------
def test_shutdown_finishes_requests_in_flight_then_cancels_at_the_deadline(model_dir):
    """Stopping the server (what SIGTERM does to uvicorn) lets a short request finish; one that
    outlives the deadline is cut and its engine request cancelled."""
    s = LiveServer(model_dir, max_batch=2, max_len=256, shutdown_timeout=4.0)
    hook = s.engine.model.register_forward_pre_hook(lambda *a: time.sleep(0.03))
    try:
        results = {}

        def run(name, n):
            text, reasons = "", []
            try:
                with httpx.Client(timeout=60) as c, c.stream(
                        "POST", s.base_url + "/completions",
                        json={"model": M, "prompt": name, "max_tokens": n, "stream": True,
                              "ignore_eos": True}) as resp:
                    for line in resp.iter_lines():
                        text += line + "\n"
            except httpx.HTTPError as e:
                reasons.append(type(e).__name__)
            results[name] = (text, reasons)
        short = threading.Thread(target=run, args=("short", 5))      # well within the deadline
        long = threading.Thread(target=run, args=("long", 200))      # >= 6 s
        short.start()
        long.start()
        deadline = time.monotonic() + 10
        while s.app.state.cupool.running < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        t0 = time.monotonic()
        s._server.should_exit = True                          # uvicorn's SIGTERM handler does this
        short.join(30)
        long.join(30)
        s._thread.join(30)
        took = time.monotonic() - t0
        assert not s._thread.is_alive() and took < 15, took
        assert results["short"][0].rstrip().endswith("data: [DONE]")
        assert '"finish_reason":"length"' in results["short"][0]
        assert "data: [DONE]" not in results["long"][0]        # cut at the deadline
        assert s.wait_idle(timeout=5) == 0                     # and cancelled in the engine
    finally:
        hook.remove()
        s.close()


def test_sigterm_lets_a_stream_finish(model_dir):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "cupool.serve.cli", "--model", str(model_dir),
                             "--port", "0", "--device", "cpu", "--max-len", "256",
                             "--log-level", "warning", "--shutdown-timeout", "120"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        url = line.split(" at ")[1].split()[0]
        lines = []
        with httpx.Client(timeout=60) as c, c.stream(
                "POST", url + "/completions",
                json={"model": "tiny-moe", "prompt": "go", "max_tokens": 40, "stream": True,
                      "ignore_eos": True, "stream_options": {"include_usage": True}}) as resp:
            for ln in resp.iter_lines():
                if ln.startswith("data: "):
                    lines.append(ln)
                    if len(lines) == 2:
                        proc.send_signal(signal.SIGTERM)
        assert lines[-1] == "data: [DONE]"
        assert '"finish_reason":"length"' in lines[-3]
        assert '"completion_tokens":40' in lines[-2]           # every token came
        rc = proc.wait(timeout=30)
        assert rc in (-signal.SIGTERM, 128 + signal.SIGTERM, 0), rc
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
