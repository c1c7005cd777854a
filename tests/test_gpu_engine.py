"""cupool.Engine on a wrapped tiny model (GPU): several sequences decoded together through the
pool in a captured graph give the tokens the dequantized reference gives on the same context,
inactive slots read no experts, seeded sampling repeats, and the bank stays consistent.

Tolerance: each generated token must be the reference's argmax on the engine's own context
(teacher forcing), except where the reference's top-2 logits are closer than test_gpu_wrap.TIE (a
tie within bf16 noise); a router near-tie inside the pooled run can move one step's logits beyond
that (test_gpu_wrap's docstring), so at most MAX_OFF such steps are allowed over all sequences.
"""

from __future__ import annotations

import pytest
import torch
from test_gpu_wrap import TIE, model_for, teacher_forced
from tiny_models import FAMILIES, forward_shapes

import cupool
from cupool.sampling import SamplingParams

pytestmark = pytest.mark.gpu

MAX_OFF = 2


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 60, (n,), generator=g).tolist() for n in lengths]


def _generate(model, pool, prompts, params, max_batch=3, max_len=40):
    """The output ids of an Engine (a fresh one, closed after) over `prompts` with `params`."""
    eng = cupool.Engine(model, pool, max_batch=max_batch, max_len=max_len, eos_token_id=[])
    out = [r.output_ids for r in eng.generate(prompts, params)]
    eng.close()
    return out


def _check_against_reference(model, reqs):
    """Unwrapped (dequantized) reference on each sequence; returns the steps off the argmax."""
    off = []
    for r in reqs:
        prompt = torch.tensor([r.prompt_ids], device="cuda")
        toks = torch.tensor([r.output_ids], device="cuda")
        with torch.inference_mode():
            ref = teacher_forced(model, prompt, toks)[0].float()
        for i, t in enumerate(r.output_ids):
            if t != int(ref[i].argmax()):
                top2 = ref[i].topk(2).values
                if float(top2[0] - top2[1]) >= TIE:
                    off.append((r.id, i))
    return off


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_batched_engine_through_the_pool_matches_the_reference(family):
    model = model_for(family, seed=21)
    _, (_, E, K, _, _) = FAMILIES[family]
    pool = cupool.wrap(model, rows=max(K, E // 2), max_decode_tokens=4, max_prefill_tokens=64,
                       progress=False)
    eng = cupool.Engine(model, pool, max_batch=4, max_len=48, eos_token_id=[])
    ps = _prompts([3, 9, 14, 5, 7, 2], seed=1)                # six requests, four slots
    reqs = eng.generate(ps, [SamplingParams(max_tokens=n) for n in (16, 12, 16, 6, 10, 16)])
    assert all(r.finish_reason == "length" for r in reqs)
    assert [len(r.output_ids) for r in reqs] == [16, 12, 16, 6, 10, 16]
    assert pool.errors() == []
    assert pool.verify() > 0
    pool.unwrap()
    off = _check_against_reference(model, reqs)
    assert len(off) <= MAX_OFF, f"{family}: tokens off the reference's argmax at {off}"


def test_inactive_slots_read_no_experts():
    """One request in a 4-slot engine: each decode step's plan sees that one token's K experts
    a layer, not the stale tokens of the three empty slots (Pool.token_mask)."""
    model = model_for("qwen3_moe", seed=22)
    _, (_, E, K, _, _) = FAMILIES["qwen3_moe"]
    pool = cupool.wrap(model, rows=E // 2, max_decode_tokens=4, max_prefill_tokens=64,
                       progress=False)
    eng = cupool.Engine(model, pool, max_batch=4, max_len=40, eos_token_id=[])
    pool.bank.reset_stats()
    (r,) = eng.generate(_prompts([9], seed=2), SamplingParams(max_tokens=12))
    stats = pool.stats()
    looked_up = sum(s["hits"] + s["misses"] for s in stats)
    steps = len(r.output_ids) + 1                          # pipelined: one step past the end
    assert 0 < looked_up <= pool.num_layers * K * steps, (looked_up, steps)
    assert pool.token_mask is None                          # only set around a step


def test_seeded_sampling_repeats_through_the_graph():
    model = model_for("mixtral", seed=23)
    _, (_, E, K, _, _) = FAMILIES["mixtral"]
    pool = cupool.wrap(model, rows=E, max_decode_tokens=3, progress=False)
    ps = _prompts([4, 6, 3], seed=3)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=40 + i, max_tokens=12)
              for i in range(3)]
    runs = [[r.output_ids for r in cupool.Engine(model, pool, max_batch=3, max_len=32,
                                                 eos_token_id=[]).generate(ps, params)]
            for _ in range(2)]
    assert runs[0] == runs[1]
    greedy = cupool.Engine(model, pool, max_batch=3, max_len=32, eos_token_id=[]).generate(
        ps, SamplingParams(max_tokens=12))
    assert [r.output_ids for r in greedy] != runs[0]


def test_seeded_request_samples_the_same_alone_and_batched():
    """A seeded request's tokens through the sampling kernel do not depend on the requests beside
    it: alone in an engine of one slot, and in the middle slot of three, with others' seeds,
    temperatures and top-k beside it (each row's draw reads only its own logits and noise)."""
    from cupool.ops.sampler import Sampler
    model = model_for("mixtral", seed=25)
    _, (_, E, K, _, _) = FAMILIES["mixtral"]
    pool = cupool.wrap(model, rows=E, max_decode_tokens=3, progress=False)
    ps = _prompts([5, 4, 7], seed=5)
    params = [SamplingParams(temperature=1.1, top_k=20, seed=7, max_tokens=12),
              SamplingParams(temperature=0.8, top_p=0.9, seed=41, max_tokens=12),
              SamplingParams(temperature=0.6, seed=3, max_tokens=12)]
    eng = cupool.Engine(model, pool, max_batch=3, max_len=32, eos_token_id=[])
    batched = [r.output_ids for r in eng.generate(ps, params)]
    assert isinstance(eng._sampler, Sampler)              # the kernel drew them
    alone = cupool.Engine(model, pool, max_batch=1, max_len=32, eos_token_id=[]).generate(
        [ps[1]], params[1])[0].output_ids
    assert alone == batched[1]


def test_long_prompts_run_in_chunks():
    """A forward of more tokens than the pool's max_prefill_tokens runs the partition path in
    chunks inside each pooled layer (its logits match the reference as test_gpu_wrap's prompts
    do), and the engine prefills a long prompt in chunks of its own."""
    from test_gpu_wrap import LOGIT_TOL, rel
    model = model_for("qwen3_moe", seed=24)
    _, (_, E, K, _, _) = FAMILIES["qwen3_moe"]
    pool = cupool.wrap(model, rows=E // 2, max_decode_tokens=1, max_prefill_tokens=16,
                       progress=False)
    p = _prompts([50], seed=4)
    ids = torch.tensor(p, device="cuda")
    with torch.inference_mode():
        chunked = model(input_ids=ids).logits
    a = cupool.Engine(model, pool, max_batch=1, max_len=60, prefill_chunk=13,
                      eos_token_id=[]).generate(p, SamplingParams(max_tokens=6))[0]
    assert pool.errors() == []
    pool.unwrap()
    with torch.inference_mode():
        ref = model(input_ids=ids).logits
    assert rel(chunked, ref) <= LOGIT_TOL, rel(chunked, ref)
    off = _check_against_reference(model, [a])
    assert len(off) <= 1, off


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_prefix_reuse_with_prefill_ahead(monkeypatch, family):
    """CUPOOL_PREFILL_AHEAD=1 against 0 on pools alike: a conversation of three turns with
    prefix reuse, each prefilling ≥ 16 tokens (T·K ≥ 4·E: ALL_HOST, the next pooled layer's
    copies issued ahead; deepseek_v3's first layer is dense), gives the same greedy tokens, and
    the pool with it on used its copies issued ahead and dropped none. The prefill's fp32 atomics
    may move a near-tie between runs: at most one turn may differ."""
    _, (_, E, K, _, _) = FAMILIES[family]
    g = torch.Generator().manual_seed(5)
    first, *new = [torch.randint(3, 60, (n,), generator=g).tolist() for n in (18, 17, 16)]
    runs = {}
    for env in ("0", "1"):
        monkeypatch.setenv("CUPOOL_PREFILL_AHEAD", env)
        model = model_for(family, seed=25)
        pool = cupool.wrap(model, rows=max(K, E // 2), max_decode_tokens=1,
                           max_prefill_tokens=64, progress=False)
        assert pool.prefill_ahead == (env == "1")
        eng = cupool.Engine(model, pool, max_batch=1, max_len=64, eos_token_id=[])
        prompt, outs = first, []
        for k in range(3):
            r = eng.generate([prompt], SamplingParams(max_tokens=4))[0]
            assert k == 0 or r.cached_tokens > 0
            outs.append(r.output_ids)
            if k < 2:
                prompt = prompt + r.output_ids + new[k]
        assert pool.errors() == []
        used, dropped = pool.gemm.ahead_used, pool.gemm.ahead_dropped
        if env == "1":
            assert used >= pool.num_layers - 1 and dropped == 0, (used, dropped)
        else:
            assert (used, dropped) == (0, 0)
        runs[env] = outs
        eng.close()
        pool.unwrap()
    same = sum(a == b for a, b in zip(runs["0"], runs["1"]))
    assert same >= 2, runs


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_batch_prefill_through_the_pool_matches_the_reference(family):
    """batch_prefill (the default): four prompts queued together are prefilled in one forward of padded
    rows through the pool's partition path (4 x 14 tokens within the 64 a prefill call takes),
    and every sequence's tokens match the dequantized reference as the one-at-a-time engine's
    do (same tolerance)."""
    model = model_for(family, seed=23)
    _, (_, E, K, _, _) = FAMILIES[family]
    pool = cupool.wrap(model, rows=max(K, E // 2), max_decode_tokens=4, max_prefill_tokens=64,
                       progress=False)
    eng = cupool.Engine(model, pool, max_batch=4, max_len=48, eos_token_id=[])
    assert eng.batch_prefill
    eng.generate([[1]], SamplingParams(max_tokens=1))         # an engine's first prefill: alone
    with forward_shapes(model) as shapes:
        reqs = eng.generate(_prompts([3, 9, 14, 5], seed=2), SamplingParams(max_tokens=12))
    assert shapes[0] == (4, 14), shapes[:3]
    assert all(len(r.output_ids) == 12 and r.cached_tokens == 0 for r in reqs)
    assert pool.errors() == []
    eng.close()
    pool.unwrap()
    off = _check_against_reference(model, reqs)
    assert len(off) <= MAX_OFF, f"{family}: tokens off the reference's argmax at {off}"
