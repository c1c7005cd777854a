"""The Engine's sampling-step outputs and inputs on the CPU: logprobs against the model's own
log-softmax (alone and batched, greedy and sampled), and the token-mask hook (a constraint that
forces a token sequence, beside unconstrained requests that must not notice it)."""

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
