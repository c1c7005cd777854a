"""The Engine's sampling-step outputs and inputs on the CPU: logprobs against the model's own
log-softmax (alone and batched, greedy and sampled), and the token-mask hook (a constraint that
forces a token sequence, beside unconstrained requests that must not notice it); prefix reuse
of attention-only models (what a finished request leaves in its slot, LRU among the slots)."""

from __future__ import annotations

import pytest
import torch

from serve_fixtures import Forced
from tiny_models import hf_model

pytest.importorskip("transformers")

from cupool.engine import Engine  # noqa: E402
from cupool.sampling import SamplingParams, apply_token_mask, mask_words  # noqa: E402


def prompts(seed, lengths):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 64, (n,), generator=g).tolist() for n in lengths]


@torch.inference_mode()
def full_logprobs(model, prompt, output):
    logits = model(input_ids=torch.tensor([prompt + output]), use_cache=False).logits[0].float()
    return torch.log_softmax(logits, -1)[len(prompt) - 1:len(prompt) - 1 + len(output)]


def test_logprobs_equal_the_models_log_softmax():
    model = hf_model("qwen3_moe", seed=11)
    ps = prompts(5, [4, 9, 6])
    params = [SamplingParams(max_tokens=7, logprobs=5),
              SamplingParams(max_tokens=7, temperature=0.9, seed=3, logprobs=0),
              SamplingParams(max_tokens=7)]                  # none asked: none kept
    eng = Engine(model, max_batch=3, max_len=32, eos_token_id=[])
    got = eng.generate(ps, params)
    for p, sp, r in zip(ps, params, got):
        if sp.logprobs is None:
            assert r.logprobs == []
            continue
        want = full_logprobs(model, p, r.output_ids)
        assert [e[0] for e in r.logprobs] == r.output_ids
        for i, (tok, lp, top) in enumerate(r.logprobs):
            # tolerance: KV-cached logits against a forward without a cache
            assert abs(lp - want[i, tok].item()) < 1e-4
            assert len(top) == sp.logprobs
            vals, ids = want[i].topk(max(1, sp.logprobs))
            assert [t for t, _ in top] == ids[:sp.logprobs].tolist()
            assert all(abs(v - w) < 1e-4 for (_, v), w in zip(top, vals.tolist()))
        if sp.temperature == 0:
            assert all(lp == max(v for _, v in top) for _, lp, top in r.logprobs)


def test_apply_token_mask_bits():
    V = 70                                  # three words, the last one partly used
    logits = torch.randn(2, V)
    words = torch.zeros(2, mask_words(V), dtype=torch.int32)
    words[0] = -1                           # every id
    allowed = [0, 31, 32, 63, 69]
    for t in allowed:
        words[1, t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32) if t % 32 != 31 \
            else torch.tensor(-2**31, dtype=torch.int32)
    out = apply_token_mask(logits, words)
    assert torch.equal(out[0], logits[0])
    assert torch.isfinite(out[1]).nonzero()[:, 0].tolist() == allowed
    assert torch.equal(out[1, allowed], logits[1, allowed])


def test_a_forced_sequence_beside_free_requests():
    model = hf_model("qwen3_moe", seed=12)
    ps = prompts(6, [5, 8, 3])
    script = [7, 31, 32, 63, 5, 9]
    eng = Engine(model, max_batch=3, max_len=40, eos_token_id=[])
    free = Engine(model, max_batch=1, max_len=40, eos_token_id=[])
    params = [SamplingParams(max_tokens=12), SamplingParams(max_tokens=12, temperature=0.8, seed=1),
              SamplingParams(max_tokens=12)]
    reqs = [eng.submit(ps[0], params[0]),
            eng.submit(ps[1], params[1], constraint=Forced(script)),
            eng.submit(ps[2], params[2])]
    eng.run_until_idle()
    assert reqs[1].output_ids == script and reqs[1].finish_reason == "stop"
    for i in (0, 2):
        alone = free.generate([ps[i]], params[i])[0]
        assert reqs[i].output_ids == alone.output_ids       # unconstrained rows: untouched


# --- prefix reuse --------------------------------------------------------------------------------
def conversation(engine, turns, first, new, n_out):
    """Turns of a growing context: each prompt is the one before, its output and `new` tokens.
    Returns [(prompt, Request)]."""
    out, prompt = [], list(first)
    for k in range(turns):
        r = engine.generate([prompt], SamplingParams(max_tokens=n_out))[0]
        out.append((prompt, r))
        prompt = prompt + r.output_ids + new[k]
    return out


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])      # gpt-oss: sliding windows
def test_prefix_reuse_prefills_only_new_tokens_and_gives_the_cold_tokens(family):
    model = hf_model(family, seed=21)
    first, *new = prompts(9, [11, 5, 7, 3, 6, 4])
    warm = Engine(model, max_batch=2, max_len=64, eos_token_id=[])
    cold = Engine(model, max_batch=2, max_len=64, eos_token_id=[], reuse_prefix=False)
    turns = conversation(warm, 5, first, new, 4)
    for k, (prompt, r) in enumerate(turns):
        before = cold.prefill_tokens
        want = cold.generate([prompt], SamplingParams(max_tokens=4))[0]
        assert cold.prefill_tokens - before == len(prompt) and want.cached_tokens == 0
        assert r.output_ids == want.output_ids, k
        if k == 0:
            assert r.cached_tokens == 0
            continue
        prev_prompt, prev = turns[k - 1]
        # the pipelined step launched before the last token was read fed it: every token is held
        assert r.cached_tokens == len(prev_prompt) + len(prev.output_ids), k
    assert warm.prefill_tokens == sum(len(p) - r.cached_tokens for p, r in turns)
    assert warm.prefill_tokens < sum(len(p) for p, _ in turns) // 2


def test_prefix_slots_lru_and_divergence():
    model = hf_model("qwen3_moe", seed=22)
    a, b, c, d = prompts(10, [9, 8, 7, 10])
    eng = Engine(model, max_batch=2, max_len=48, eos_token_id=[])
    ra = eng.generate([a], SamplingParams(max_tokens=3))[0]
    eng.generate([b], SamplingParams(max_tokens=3))             # b takes the other slot
    # a continuation of a reuses a's slot; an unrelated prompt takes the LRU slot (b's)
    r = eng.generate([a + ra.output_ids + [5, 6]], SamplingParams(max_tokens=3))[0]
    assert r.cached_tokens == len(a) + 3
    eng.generate([c], SamplingParams(max_tokens=3))             # evicts b's prefix, not a's
    r = eng.generate([b + [7]], SamplingParams(max_tokens=3))[0]
    assert r.cached_tokens == 0                                 # b was evicted
    # a prompt that diverges inside the held tokens reuses the common part only
    r = eng.generate([c[:4] + d], SamplingParams(max_tokens=3))[0]
    assert r.cached_tokens == 4
    # the same prompt again: everything but its last token
    r2 = eng.generate([c[:4] + d], SamplingParams(max_tokens=3))[0]
    assert r2.cached_tokens == len(c[:4] + d) - 1 and r2.output_ids == r.output_ids


def test_held_tokens_follow_the_steps_that_fed_them():
    """A slot holds its prompt and the tokens its decode steps fed: all of them when the step
    after the last token was already launched (pipelined), all but the last for a request whose
    steps wait for each token (a token mask), none for one that ends at admission; a stop token
    a step fed is held too (a chat template puts it back in the next turn's prompt)."""
    model = hf_model("qwen3_moe", seed=24)
    p = prompts(12, [7])[0]
    eng = Engine(model, max_batch=1, max_len=40, eos_token_id=[])
    cold = Engine(model, max_batch=1, max_len=40, eos_token_id=[], reuse_prefix=False)
    r = eng.generate([p], SamplingParams(max_tokens=5))[0]
    assert eng.prefix.held[0] == p + r.output_ids
    r = eng.generate([p], SamplingParams(max_tokens=1))[0]
    assert eng.prefix.held[0] == p and r.cached_tokens == len(p) - 1
    script = [9, 8, 7, 6]
    eng.submit(p, SamplingParams(max_tokens=4), constraint=Forced(script))
    eng.run_until_idle()
    assert eng.prefix.held[0] == p + script[:-1]
    # a stop token ends the next request; the step that fed it ran
    out = cold.generate([p], SamplingParams(max_tokens=6))[0].output_ids
    stop = out[3]
    assert out.index(stop) > 0                   # a step ran after the first token
    r = eng.generate([p], SamplingParams(max_tokens=6, stop_token_ids=[stop]))[0]
    assert r.output_ids == out[:out.index(stop)] and r.finish_reason == "stop"
    assert eng.prefix.held[0] == p + out[:out.index(stop) + 1]
    nxt = p + out[:out.index(stop) + 1] + [5, 4]
    r = eng.generate([nxt], SamplingParams(max_tokens=4))[0]
    assert r.cached_tokens == len(nxt) - 2
    assert r.output_ids == cold.generate([nxt], SamplingParams(max_tokens=4))[0].output_ids
