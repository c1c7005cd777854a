"""cupool.Engine on the CPU with tiny unwrapped models of the hybrid families (gated delta nets,
Kimi delta attention, Mamba-2, lightning attention, QSA indexed attention with hyper-connections
and n-gram embeddings) and of the families whose own forwards needed graph-safe replacements
(PhiMoE, DeepSeek-V2 with fewer KV heads): two prompts of different lengths decoded together, a
freed slot taken by a third prompt, and a prompt longer than the prefill chunk all give, greedy,
the tokens transformers' own `generate` gives for each prompt alone."""

from __future__ import annotations

import pytest
import torch

from tiny_models import HYBRID_FAMILIES, forward_shapes, hybrid_model

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


def _chunk_spy(eng) -> list[tuple[int, int]]:
    """Record the [a, e) of every prefill forward of `eng` (its cache's prefill_mode calls)."""
    seen, real = [], eng.cache.prefill_mode

    def prefill_mode(slot, start, n):
        seen.append((start, start + n))
        return real(slot, start, n)
    eng.cache.prefill_mode = prefill_mode
    return seen


def _saved_at(eng, slot: int, length: int) -> list[torch.Tensor]:
    """The states saved as slot's point at `length`."""
    (p,) = [p for p in eng.prefix.points[slot] if p.length == length]
    return eng.prefix.saved.read(p.entry)


@pytest.mark.parametrize("point, chunks", [
    (10, [(0, 4), (4, 8), (8, 10), (10, 13)]),       # inside a chunk: that chunk ends there
    (8, [(0, 4), (4, 8), (8, 12), (12, 13)]),        # at a chunk boundary: no extra chunk
])
def test_resume_at_keeps_a_point_inside_the_prompt(family_model, point, chunks):
    """A 13-token prompt submitted with resume_at (a chat's conversation end; the last 3 tokens
    stand for a generation prompt) is prefilled in chunks of 4 with a chunk ending at the point,
    and the states saved there are those of a cold prefill of the first `point` tokens. A next
    turn that keeps the conversation but neither the prompt's end nor the answer (a thinking
    template's) resumes there and gives a cold run's tokens. Attention alone: no states are kept
    and the common prefix is reused as before."""
    family, model = family_model
    p1, new = prompts(7, [13, 5])
    if new[0] == p1[point]:
        new[0] = 3 if p1[point] != 3 else 4                 # diverge right after the point
    eng = Engine(model, max_batch=1, max_len=48, prefill_chunk=4, eos_token_id=[])
    seen = _chunk_spy(eng)
    eng.submit(p1, SamplingParams(max_tokens=5), resume_at=point)
    eng.run_until_idle()
    assert seen == chunks, family                   # the first prefill splits, states unknown yet
    stateful = eng.prefix.stateful()
    lengths = sorted(p.length for p in eng.prefix.points[0])
    assert lengths == ([point, 13, 18] if stateful else []), family
    if stateful:
        cold = Engine(model, max_batch=1, max_len=48, prefill_chunk=4, eos_token_id=[])
        cold.generate([p1[:point]], SamplingParams(max_tokens=1))
        want = _saved_at(cold, 0, point)          # end of a prompt of exactly those tokens
        got = _saved_at(eng, 0, point)
        assert len(got) == len(want) > 0
        for g, w in zip(got, want):               # the same chunks, so the same arithmetic
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    p2 = p1[:point] + new
    del seen[:]
    before = eng.prefill_tokens
    r = eng.submit(p2, SamplingParams(max_tokens=N))
    eng.run_until_idle()
    assert r.cached_tokens == point, family        # the point, or the common prefix (attention)
    assert eng.prefill_tokens - before == len(p2) - point
    assert seen[0][0] == point
    assert r.output_ids == _cold(model, p2), family
    if not stateful:                                # attention alone: known now, no more splits
        other = [p1[0] + 1] + p1[1:]                # shares nothing with what the slot holds
        del seen[:]
        eng.submit(other, SamplingParams(max_tokens=2), resume_at=point)
        eng.run_until_idle()
        assert seen == [(0, 4), (4, 8), (8, 12), (12, 13)], family
        assert eng.prefix.points[0] == [], family


def test_resume_at_the_reused_start_keeps_the_point(family_model):
    """The same prompt again (a regenerated answer) can resume only at the conversation point
    (the last prompt token is always run); the request names the same point, so the loaded
    state is kept as its point again, and a third request with a new ending resumes there too."""
    family, model = family_model
    p1, new = prompts(8, [12, 4])
    point = 9
    eng = Engine(model, max_batch=1, max_len=48, prefill_chunk=4, eos_token_id=[])
    for k in range(2):
        r = eng.submit(p1, SamplingParams(max_tokens=3), resume_at=point)
        eng.run_until_idle()
        stateful = eng.prefix.stateful()
        assert r.cached_tokens == (0 if k == 0 else point if stateful else len(p1) - 1), family
        assert r.output_ids == _cold(model, p1, 3), family
    if not stateful:
        pytest.skip(f"{family}: attention layers alone, no points are kept")
    assert sorted(p.length for p in eng.prefix.points[0]) == [point, 12, 15]
    p3 = p1[:point] + new
    r = eng.generate([p3], SamplingParams(max_tokens=N))[0]
    assert r.cached_tokens == point and r.output_ids == _cold(model, p3), family


def test_warmup_then_requests_equal_generate_alone(family_model):
    """warmup() (its whole chunk and the continuation from the slot, which resumes the states
    the chunk left) runs on every hybrid family, and requests after it give generate's tokens."""
    from cupool.engine import WARMUP_MORE
    family, model = family_model
    eng = Engine(model, max_batch=2, max_len=40, prefill_chunk=8, eos_token_id=[])
    eng.warmup()
    assert eng.prefill_tokens == 2 + 8 + WARMUP_MORE, family       # the continuation reused 8
    ps = prompts(7, [5, 12])
    got = eng.generate(ps, SamplingParams(max_tokens=N))
    for p, r in zip(ps, got):
        assert r.output_ids == hf_greedy(model, p, N), (family, len(p))


def test_batch_prefill_leaves_models_with_states_one_prompt_at_a_time(family_model):
    """batch_prefill (the default): on a model whose slots hold recurrent states every prompt is still
    prefilled alone (a forward of several rows never runs outside decode steps); the families
    here without states (PhiMoE, DeepSeek-V2) prefill the two prompts together; the tokens
    equal generate's either way."""
    family, model = family_model
    eng = Engine(model, max_batch=2, max_len=40, eos_token_id=[], batch_prefill=True)
    eng.generate([[1]], SamplingParams(max_tokens=1))
    ps = prompts(3, [6, 9])
    with forward_shapes(model) as shapes:
        got = eng.generate(ps, SamplingParams(max_tokens=N))
    together = any(n > 1 and s > 1 for n, s in shapes)
    assert together != bool(eng.cache.state_tensors()), (family, shapes)
    assert eng.prefill_kind.startswith("prompts that arrive together" if together else
                                       "each prompt alone ("), (family, eng.prefill_kind)
    for p, r in zip(ps, got):
        assert r.output_ids == hf_greedy(model, p, N), (family, len(p))
