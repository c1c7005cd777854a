"""cupool.Engine on the CPU with tiny unwrapped models of the hybrid families (gated delta nets,
Kimi delta attention, Mamba-2, lightning attention, QSA indexed attention with hyper-connections
and n-gram embeddings) and of the families whose own forwards needed graph-safe replacements
(PhiMoE, DeepSeek-V2 with fewer KV heads): two prompts of different lengths decoded together, a
freed slot taken by a third prompt, and a prompt longer than the prefill chunk all give, greedy,
the tokens transformers' own `generate` gives for each prompt alone."""

from __future__ import annotations

import pytest
import torch

from tiny_models import HYBRID_FAMILIES, hybrid_model

pytest.importorskip("transformers")

from cupool.engine import Engine  # noqa: E402
from cupool.sampling import SamplingParams  # noqa: E402

N = 10          # tokens generated per prompt


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' generate for one prompt alone, greedy, no EOS: n tokens."""
    from transformers import GenerationConfig
    cfg = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=[],
                           pad_token_id=0, bos_token_id=1)
    ids = torch.tensor([prompt])
    with torch.inference_mode():       # every position attended (a prompt may hold pad id 0)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
    toks = out[0, len(prompt):].tolist()
    assert len(toks) == n
    return toks


def prompts(seed: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 60, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module", params=sorted(HYBRID_FAMILIES))
def family_model(request):
    return request.param, hybrid_model(request.param, seed=5)


def test_batched_and_reused_slots_equal_generate_alone(family_model):
    """Prompts of 6 and 15 tokens decode together in 2 slots; the first stops after 4 tokens and
    its slot takes a third prompt (9 tokens) while the second still runs."""
    family, model = family_model
    ps = prompts(1, [6, 15, 9])
    budgets = [4, N, N]
    eng = Engine(model, max_batch=2, max_len=40, eos_token_id=[])
    got = eng.generate(ps, [SamplingParams(max_tokens=n) for n in budgets])
    for p, n, r in zip(ps, budgets, got):
        assert r.output_ids == hf_greedy(model, p, n), (family, len(p))
    assert eng.steps_run < sum(budgets)                 # the two ran in shared steps


def test_chunked_prefill_equals_one_chunk(family_model):
    """A 23-token prompt in chunks of 4 (each chunk continues the states the one before left)
    gives the tokens of one chunk and of generate."""
    family, model = family_model
    p = prompts(2, [23])[0]
    one = Engine(model, max_batch=1, max_len=40, eos_token_id=[]).generate(
        [p], SamplingParams(max_tokens=N))[0]
    chunked = Engine(model, max_batch=1, max_len=40, prefill_chunk=4, eos_token_id=[]).generate(
        [p], SamplingParams(max_tokens=N))[0]
    assert chunked.output_ids == one.output_ids == hf_greedy(model, p, N), family


# --- prefix reuse ---------------------------------------------------------------------------------
def _cold(model, prompt, n=N):
    eng = Engine(model, max_batch=1, max_len=48, eos_token_id=[], reuse_prefix=False)
    r = eng.generate([prompt], SamplingParams(max_tokens=n))[0]
    assert r.cached_tokens == 0
    return r.output_ids


def test_next_turns_resume_where_the_slot_left_off(family_model):
    """Turn 1 (7 tokens, 4 out) ends while another request keeps decoding in the other slot for
    16 more steps (each step advances every slot's states, the free one's too); turn 2 (turn 1,
    its output, 6 new tokens, in chunks of 4 from an unaligned start) resumes from the saved
    end-of-request state; turn 3 adds one token (a one-token prefill continuing a state). Each
    reuses everything its slot processed and gives the tokens of a cold run."""
    family, model = family_model
    p1, other, new = prompts(3, [7, 5, 6])
    eng = Engine(model, max_batch=2, max_len=48, prefill_chunk=4, eos_token_id=[])
    r1, _ = eng.generate([p1, other], [SamplingParams(max_tokens=4), SamplingParams(max_tokens=20)])
    prompt, held = p1 + r1.output_ids + new, len(p1) + 4
    for k in range(2):
        before = eng.prefill_tokens
        r = eng.generate([prompt], SamplingParams(max_tokens=N))[0]
        assert r.cached_tokens == held, (family, k)
        assert eng.prefill_tokens - before == len(prompt) - held
        assert r.output_ids == _cold(model, prompt) == hf_greedy(model, prompt, N), (family, k)
        prompt, held = prompt + r.output_ids + [5], len(prompt) + N      # one new token
    assert eng.prefix.stateful() == (eng.resume_point_bytes > 0)


def test_resume_points_and_divergence(family_model):
    """A prompt that keeps turn 1's prompt but not its answer resumes at the end of the prompt;
    one that diverges inside it reuses nothing where the slots hold recurrent states (no point
    before the divergence; attention alone reuses the common part); the same prompt again can
    use neither point (the last prompt token is always run); all give the cold tokens."""
    family, model = family_model
    p1 = prompts(4, [9])[0]
    eng = Engine(model, max_batch=1, max_len=48, eos_token_id=[])
    r1 = eng.generate([p1], SamplingParams(max_tokens=5))[0]
    stateful = eng.prefix.stateful()
    assert sorted(p.length for p in eng.prefix.points[0]) == ([len(p1), len(p1) + 5] if stateful
                                                              else [])
    x = 3 if r1.output_ids[0] != 3 else 4
    a = p1 + [x, 9, 8]                                  # the prompt, not the answer
    b = a[:5] + [11, 12, 13]                            # diverges inside the prompt
    for prompt, want in ((a, len(p1)), (b, 0 if stateful else 5),
                         (b, 0 if stateful else len(b) - 1)):
        r = eng.generate([prompt], SamplingParams(max_tokens=N))[0]
        assert r.cached_tokens == want, (family, prompt)
        assert r.output_ids == _cold(model, prompt), (family, prompt)


def test_saved_states_are_bounded_lru(family_model):
    """resume_points=2 for 2 slots: conversation B's two points take the entries of A's, so B's
    next turn resumes and A's is prefilled from the start; the entries' memory is 2 points.
    resume_points=0: nothing is saved or reused."""
    family, model = family_model
    pa, pb, new = prompts(6, [6, 8, 3])
    eng = Engine(model, max_batch=2, max_len=48, eos_token_id=[], resume_points=2)
    ra = eng.generate([pa], SamplingParams(max_tokens=3))[0]
    rb = eng.generate([pb], SamplingParams(max_tokens=3))[0]
    if not eng.prefix.stateful():
        pytest.skip(f"{family}: attention layers alone, reuse is bounded by the slots")
    assert eng.prefix.memory_bytes() == 2 * eng.resume_point_bytes > 0
    assert eng.prefix.points[0] == [] and len(eng.prefix.points[1]) == 2
    for prompt, want in ((pb + rb.output_ids + new, len(pb) + 3), (pa + ra.output_ids + new, 0)):
        r = eng.generate([prompt], SamplingParams(max_tokens=4))[0]
        assert r.cached_tokens == want, family
        assert r.output_ids == _cold(model, prompt, 4), family
    none = Engine(model, max_batch=1, max_len=48, eos_token_id=[], resume_points=0)
    r = none.generate([pa], SamplingParams(max_tokens=3))[0]
    r = none.generate([pa + r.output_ids + new], SamplingParams(max_tokens=3))[0]
    assert r.cached_tokens == 0 and none.prefix.memory_bytes() == 0
