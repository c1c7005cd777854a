"""cupool.Engine on the CPU with tiny unwrapped transformers models: batched decode equals each
sequence alone and a plain reference loop, seeded sampling does not depend on the batch,
continuous batching, stops, chunked prefill, cancellation, and no deprecated transformers call."""

from __future__ import annotations

import warnings

import pytest
import torch

from tiny_models import forward_shapes, hf_model

pytest.importorskip("transformers")

from cupool.engine import Engine, cache_kwarg  # noqa: E402
from cupool.sampling import SamplingParams  # noqa: E402

FAMILIES = ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"]


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], n: int, eos=()) -> list[int]:
    """Greedy tokens by recomputing the whole sequence every step (no cache at all)."""
    ids = list(prompt)
    out = []
    for _ in range(n):
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
        t = int(logits.argmax())
        if t in eos:
            break
        out.append(t)
        ids.append(t)
    return out


def prompts(seed: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 64, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_greedy_equals_reference(family):
    model = hf_model(family, seed=3)
    ps = prompts(1, [5, 11, 2, 17])
    eng = Engine(model, max_batch=4, max_len=48, eos_token_id=[])
    got = eng.generate(ps, SamplingParams(max_tokens=12))
    for p, r in zip(ps, got):
        assert r.output_ids == reference_greedy(model, p, 12), (family, p)
        assert r.finish_reason == "length"


def test_seeded_sampling_is_the_same_alone_and_batched():
    model = hf_model("qwen3_moe", seed=4)
    ps = prompts(2, [6, 9, 3])
    params = [SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=100 + i, max_tokens=10)
              for i in range(3)]
    batched = Engine(model, max_batch=3, max_len=32, eos_token_id=[]).generate(ps, params)
    for p, sp, r in zip(ps, params, batched):
        alone = Engine(model, max_batch=1, max_len=32, eos_token_id=[]).generate([p], sp)[0]
        assert alone.output_ids == r.output_ids
    greedy = Engine(model, max_batch=1, max_len=32, eos_token_id=[]).generate(
        [ps[0]], SamplingParams(max_tokens=10))[0]
    assert greedy.output_ids != batched[0].output_ids      # sampling did sample
    other = Engine(model, max_batch=1, max_len=32, eos_token_id=[]).generate(
        [ps[0]], SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=7, max_tokens=10))[0]
    assert other.output_ids != batched[0].output_ids       # another seed, other tokens


def test_continuous_batching_more_requests_than_slots():
    """Six requests of different lengths through two slots: each slot takes a new request when
    its sequence ends, and every output equals the sequence run alone."""
    model = hf_model("qwen3_moe", seed=5)
    ps = prompts(3, [4, 9, 2, 13, 7, 5])
    budgets = [3, 9, 1, 6, 11, 4]
    eng = Engine(model, max_batch=2, max_len=40, eos_token_id=[])
    got = eng.generate(ps, [SamplingParams(max_tokens=n) for n in budgets])
    for p, n, r in zip(ps, budgets, got):
        assert r.output_ids == reference_greedy(model, p, n)
    assert eng.steps_run < sum(budgets)                     # steps were shared


def test_eos_stop_ids_and_events():
    model = hf_model("qwen3_moe", seed=6)
    p = prompts(4, [6])[0]
    ref = reference_greedy(model, p, 10)
    stop_at = ref[4]
    events = []
    eng = Engine(model, max_batch=2, max_len=32, eos_token_id=[])
    r = eng.generate([p], SamplingParams(max_tokens=10, stop_token_ids=[stop_at]),
                     on_event=events.append)[0]
    first = ref.index(stop_at)
    assert r.output_ids == ref[:first] and r.finish_reason == "stop"
    assert [e.token_id for e in events if e.token_id is not None] == ref[:first]
    assert events[-1].finished and events[-1].finish_reason == "stop"
    assert sum(e.finished for e in events) == 1
    eos = Engine(model, max_batch=1, max_len=32, eos_token_id=stop_at).generate(
        [p], SamplingParams(max_tokens=10))[0]
    assert eos.output_ids == ref[:first]
    ignored = Engine(model, max_batch=1, max_len=32, eos_token_id=stop_at).generate(
        [p], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert ignored.output_ids == ref


def test_chunked_prefill_equals_one_chunk():
    model = hf_model("mixtral", seed=7)
    p = prompts(5, [23])[0]
    one = Engine(model, max_batch=1, max_len=40, eos_token_id=[]).generate(
        [p], SamplingParams(max_tokens=6))[0]
    chunked = Engine(model, max_batch=1, max_len=40, prefill_chunk=4, eos_token_id=[]).generate(
        [p], SamplingParams(max_tokens=6))[0]
    assert chunked.output_ids == one.output_ids == reference_greedy(model, p, 6)


def test_stream_and_cancel():
    model = hf_model("qwen3_moe", seed=8)
    eng = Engine(model, max_batch=2, max_len=32, eos_token_id=[])
    p = prompts(6, [5])[0]
    toks = [e.token_id for e in eng.stream(p, SamplingParams(max_tokens=5)) if e.token_id is not None]
    assert toks == reference_greedy(model, p, 5)
    got = []
    r = eng.submit(p, SamplingParams(max_tokens=20), got.append)
    while len(r.output_ids) < 3:
        eng.iterate()
    r.cancel()
    eng.run_until_idle()
    assert r.finish_reason == "cancelled" and 3 <= len(r.output_ids) < 20
    assert got[-1].finished and got[-1].finish_reason == "cancelled"


def test_bad_requests_are_refused_at_submit():
    model = hf_model("qwen3_moe", seed=9)
    eng = Engine(model, max_batch=1, max_len=16)
    with pytest.raises(ValueError, match="exceed the context of 16 tokens"):
        eng.submit(list(range(3, 13)), SamplingParams(max_tokens=7))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.submit([3, 64], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="empty"):
        eng.submit([], SamplingParams())
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        eng.submit([3], SamplingParams(stop=["x"], max_tokens=2))
    for bad in (-1, 4, True, 2.0, "2"):                   # a prompt of 3 tokens: [0, 3]
        with pytest.raises(ValueError, match=r"resume_at must be an int in \[0, 3\].*got "):
            eng.submit([3, 4, 5], SamplingParams(max_tokens=2), resume_at=bad)
    assert eng._incoming.empty()                         # nothing refused was queued
    for kw, match in ((dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
                      (dict(top_k=-2), "top_k"), (dict(max_tokens=0), "max_tokens")):
        with pytest.raises(ValueError, match=match):
            SamplingParams(**kw)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        Engine(model, max_batch=1, max_len=65)
    with pytest.raises(ValueError, match="max_batch"):
        Engine(model, max_batch=0, max_len=16)


def test_no_deprecated_transformers_call():
    """The cache goes in under the keyword the installed transformers takes (`cache` where
    `past_key_values` is deprecated), so no FutureWarning/DeprecationWarning is raised."""
    model = hf_model("qwen3_moe", seed=10)
    assert cache_kwarg(model) in ("cache", "past_key_values")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        Engine(model, max_batch=2, max_len=24).generate(prompts(7, [4, 6]),
                                                        SamplingParams(max_tokens=4))


def test_done_is_set_for_every_finish_and_callbacks_cannot_stop_others():
    model = hf_model("qwen3_moe", seed=11)
    eng = Engine(model, max_batch=2, max_len=32, eos_token_id=[])
    (r,) = eng.generate(prompts(8, [3]), SamplingParams(max_tokens=4))
    assert r.finish_reason == "length" and r.done.is_set()
    calls = [0]

    def bad(ev):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("a bug in the caller")
    broken = eng.submit(prompts(9, [5])[0], SamplingParams(max_tokens=20), bad)
    fine = eng.submit(prompts(10, [4])[0], SamplingParams(max_tokens=20))
    eng.run_until_idle()
    assert broken.finish_reason == "cancelled" and "callback raised" in broken.error
    assert fine.finish_reason == "length" and len(fine.output_ids) == 20
    assert eng.stats()["running"] == 0 and eng.broken is None


def test_incremental_text_equals_a_full_decode_and_stops_cut_it():
    from serve_fixtures import build_tokenizer
    tok = build_tokenizer()
    model = hf_model("qwen3_moe", seed=12)
    eng = Engine(model, tokenizer=tok, max_batch=2, max_len=48, eos_token_id=[])
    ps = prompts(11, [5, 8])
    pieces = {0: [], 1: []}
    reqs = eng.generate(ps, SamplingParams(max_tokens=30),
                        on_event=lambda ev: pieces[ev.request.id % 2].append(ev.text))
    for r in reqs:
        full = tok.decode(r.output_ids, skip_special_tokens=True)
        assert r.text == full
        assert "".join(pieces[r.id % 2]) == full
    text = reqs[0].text
    stop = text[10:12] if len(text) >= 12 else None
    if stop:
        cut = eng.generate([ps[0]], SamplingParams(max_tokens=30, stop=[stop]))[0]
        assert cut.finish_reason == "stop" and cut.text == text[:text.find(stop)]


@pytest.mark.parametrize("reuse", [True, False])
def test_warmup_prefills_a_whole_chunk_and_its_continuation(reuse):
    """warmup() runs, besides its one-token prompts, a prompt of one prefill chunk and (prefix
    reuse on) that prompt with WARMUP_MORE tokens more, of which only those are prefilled (the
    slot holds the rest); requests after it give the tokens of an engine that never warmed up."""
    from cupool.engine import WARMUP_MORE
    model = hf_model("qwen3_moe", seed=5)
    eng = Engine(model, max_batch=2, max_len=40, prefill_chunk=16, eos_token_id=[],
                 reuse_prefix=reuse)
    assert eng.warmup_prompt_tokens() == 16
    eng.warmup()
    long_prompts = 16 + WARMUP_MORE if reuse else 16      # the continuation prefilled alone
    assert eng.prefill_tokens == 2 + long_prompts
    ps = prompts(6, [5, 23])
    cold = Engine(model, max_batch=2, max_len=40, prefill_chunk=16, eos_token_id=[],
                  reuse_prefix=reuse)
    params = SamplingParams(max_tokens=6)
    assert [r.output_ids for r in eng.generate(ps, params)] == \
        [r.output_ids for r in cold.generate(ps, params)]
    with pytest.raises(RuntimeError, match="before start"):
        eng.start()
        eng.warmup()
    eng.shutdown()


def test_warmup_prompt_fits_the_slot():
    """The long prompt leaves room for its continuation and one token in a short slot."""
    from cupool.engine import WARMUP_MORE
    model = hf_model("qwen3_moe", seed=5)
    eng = Engine(model, max_batch=1, max_len=20, eos_token_id=[])
    assert eng.warmup_prompt_tokens() == 20 - WARMUP_MORE - 2
    eng.warmup()
    assert eng.prefill_tokens == 2 + eng.warmup_prompt_tokens() + WARMUP_MORE


def test_prefill_attention_keeps_cudnn_for_aligned_whole_chunks_only():
    """On a GPU a prefill chunk runs SDPA without cuDNN unless it is a whole chunk starting at a
    multiple of prefill_chunk (lengths that repeat across requests); on the CPU nothing is set."""
    import contextlib
    model = hf_model("qwen3_moe", seed=5)
    eng = Engine(model, max_batch=1, max_len=64, prefill_chunk=16, eos_token_id=[])
    plain = lambda ctx: isinstance(ctx, contextlib.nullcontext)  # noqa: E731
    assert plain(eng._prefill_attention(0, 5))                 # the CPU: torch's own choice
    eng.device = torch.device("cuda")                          # the rule alone (nothing runs)
    assert plain(eng._prefill_attention(0, 16)) and plain(eng._prefill_attention(32, 48))
    for a, e in ((0, 5), (16, 21), (3, 19), (5, 21)):          # a tail; a whole chunk off the grid
        assert not plain(eng._prefill_attention(a, e)), (a, e)


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_prefill_gives_the_tokens_of_one_at_a_time(family):
    """batch_prefill=True: prompts queued together (nothing reused) are prefilled in one forward
    of padded rows, and every request's tokens, greedy and seeded-sampled, equal an engine's that
    admits them one at a time."""
    model = hf_model(family, seed=3)
    ps = prompts(8, [5, 11, 2, 8])
    params = [SamplingParams(max_tokens=6), SamplingParams(max_tokens=6),
              SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=6),
              SamplingParams(max_tokens=1)]
    alone = Engine(model, max_batch=4, max_len=40, eos_token_id=[], batch_prefill=False)
    want = [r.output_ids for r in alone.generate(ps, params)]
    eng = Engine(model, max_batch=4, max_len=40, eos_token_id=[])
    assert eng.batch_prefill and not alone.batch_prefill
    eng.generate([[1]], SamplingParams(max_tokens=1))      # the first prefill runs alone
    with forward_shapes(model) as shapes:
        got = eng.generate(ps, params)
    seen = [n for n, _ in shapes]                              # each forward's batch
    assert [r.output_ids for r in got] == want, family
    assert seen[0] == 4 and all(n == 4 for n in seen), seen   # one prefill of 4 rows, then steps
    assert all(r.cached_tokens == 0 for r in got)


def test_batch_prefill_groups_fit_a_chunk_and_reuse_goes_alone():
    """Rows of the longest prompt's length fit one prefill chunk: prompts of 5, 7 and 9 tokens at
    a 16-token chunk make a row pair (2 x 7) and one prompt alone; a prompt that starts with a
    free slot's tokens reuses them, prefilled alone; the tokens equal one-at-a-time admission."""
    model = hf_model("qwen3_moe", seed=4)
    ps = prompts(9, [5, 7, 9])
    params = SamplingParams(max_tokens=4)
    kw = dict(max_batch=3, max_len=40, prefill_chunk=16, eos_token_id=[])
    alone = Engine(model, **kw, batch_prefill=False)
    want = [r.output_ids for r in alone.generate(ps, params)]
    eng = Engine(model, **kw)
    eng.generate([[1]], SamplingParams(max_tokens=1))     # (no prompt starts with token 1)
    with forward_shapes(model) as shapes:
        got = eng.generate(ps, params)
    seen = [n for n, _ in shapes]
    assert [r.output_ids for r in got] == want
    assert seen[:2] == [2, 1], seen
    longer = ps[2] + got[2].output_ids + [4, 5]
    with forward_shapes(model) as shapes:
        again = eng.generate([longer, ps[0]], params)
    seen = [n for n, _ in shapes]
    assert again[0].cached_tokens > 0 and again[1].cached_tokens == len(ps[0]) - 1
    assert again[0].output_ids == alone.generate([longer], params)[0].output_ids
    assert seen[:2] == [1, 1], seen                # both prefilled alone, then the steps


def test_narrow_steps_need_the_fused_step():
    """`narrow` asks for narrow steps; without the fused step (here: the CPU) the engine says
    why it runs every step over every slot; a value that is not a bool is refused."""
    model = hf_model("qwen3_moe", seed=4)
    eng = Engine(model, max_batch=2, max_len=32, eos_token_id=[])
    assert eng.narrow_why == "the decode step runs the model's own forward"
    assert "alone" not in eng.step_kind
    assert Engine(model, max_batch=2, max_len=32, narrow=False).narrow_why == "narrow=False"
    with pytest.raises(ValueError, match="narrow must be True or False, got 'yes'"):
        Engine(model, max_batch=2, max_len=32, narrow="yes")


def test_batch_prefill_on_by_default_and_off_for_length_dependent_rope():
    """batch_prefill is on unless turned off, and a model whose rotary embedding changes with
    the forward's length does not take it; `prefill_kind` says which, and why."""
    model = hf_model("qwen3_moe", seed=4)
    eng = Engine(model, max_batch=2, max_len=32, eos_token_id=[], prefill_chunk=16)
    assert eng.batch_prefill
    assert eng.prefill_kind.endswith("where the slots hold no recurrent states (known after a "
                                      "prompt)")
    eng.generate([[1, 2, 3]], SamplingParams(max_tokens=1))
    assert eng.prefill_kind == ("prompts that arrive together in one forward, up to 16 tokens "
                                "(those that reuse a prefix alone)")
    off = Engine(model, max_batch=2, max_len=32, batch_prefill=False)
    assert not off.batch_prefill and off.prefill_kind == "each prompt alone (batch_prefill=False)"
    model.model.rotary_emb.rope_type = "dynamic"
    try:
        eng = Engine(model, max_batch=2, max_len=32, batch_prefill=True)
        assert not eng.batch_prefill
        assert eng.prefill_kind == ("each prompt alone (its rotary embedding changes with the "
                                    "forward's length)")
    finally:
        model.model.rotary_emb.rope_type = "default"
