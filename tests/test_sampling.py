"""cupool.sampling on the CPU: greedy at temperature 0, top-k / top-p keep exactly the tokens they
should, the draws follow softmax(logits / T) over the kept tokens, and the noise depends only on
(seed, step, token id)."""

from __future__ import annotations

import math

import pytest
import torch

from cupool.sampling import sample, uniform_noise


def _rows(B, V, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, V, generator=g) * 2


def _call(logits, t, k, p, seeds, steps, greedy_only=False):
    B = logits.shape[0]
    full = lambda v, dt: torch.full((B,), v, dtype=dt)  # noqa: E731
    return sample(logits, full(t, torch.float32), full(k, torch.int64), full(p, torch.float32),
                  seeds, steps if isinstance(steps, torch.Tensor) else full(steps, torch.int64),
                  greedy_only)


def test_temperature_zero_is_argmax():
    logits = _rows(5, 50)
    seeds = torch.arange(5)
    assert torch.equal(_call(logits, 0.0, 0, 1.0, seeds, 0), logits.argmax(-1))
    assert torch.equal(_call(logits, 0.7, 0, 1.0, seeds, 0, greedy_only=True), logits.argmax(-1))


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = _rows(6, 40, seed=1)
    seeds = torch.arange(6) * 7
    assert torch.equal(_call(logits, 1.5, 1, 1.0, seeds, 3), logits.argmax(-1))
    assert torch.equal(_call(logits, 1.5, 0, 1e-6, seeds, 3), logits.argmax(-1))


def test_draws_follow_the_restricted_softmax():
    """4,000 draws (seeds) of one row: with top-k 5 only the 5 most likely tokens appear, each as
    often as softmax over those 5 says (within 5 standard deviations)."""
    V, n, T = 30, 4000, 0.8
    row = _rows(1, V, seed=2)[0]
    logits = row.expand(n, V).contiguous()
    got = _call(logits, T, 5, 1.0, torch.arange(n), 0)
    top5 = row.topk(5).indices
    assert set(got.tolist()) <= set(top5.tolist())
    probs = torch.softmax(row[top5] / T, dim=0)
    for tok, pr in zip(top5.tolist(), probs.tolist()):
        count = int((got == tok).sum())
        sd = math.sqrt(n * pr * (1 - pr))
        assert abs(count - n * pr) <= 5 * sd + 1, (tok, count, n * pr)


def test_top_p_keeps_the_smallest_set_reaching_p():
    """Probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps the first two (0.5 < 0.7 ≤ 0.8), top_p
    0.5 the first one only, 0.81 the first three."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.log(probs).expand(3000, 4).contiguous()
    seeds = torch.arange(3000)
    assert set(_call(logits, 1.0, 0, 0.7, seeds, 1).tolist()) == {0, 1}
    assert set(_call(logits, 1.0, 0, 0.5, seeds, 1).tolist()) == {0}
    assert set(_call(logits, 1.0, 0, 0.81, seeds, 1).tolist()) == {0, 1, 2}
    assert set(_call(logits, 1.0, 0, 1.0, seeds, 1).tolist()) == {0, 1, 2, 3}


def test_noise_is_a_function_of_seed_step_and_token():
    seeds = torch.tensor([1, 2, 1, 1])
    steps = torch.tensor([0, 0, 1, 0])
    u = uniform_noise(seeds, steps, 1000)
    assert torch.equal(u[0], u[3])                      # same (seed, step): same noise
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert 0 < float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.02            # 4,000 uniform draws
    big = uniform_noise(torch.tensor([2**62 + 5, 5]), torch.tensor([0, 0]), 64)
    assert not torch.equal(big[0], big[1])              # the seed's high bits count


def test_cuts_among_equal_logits_keep_the_lower_ids():
    """The order puts equal logits by id, so top-k and top-p cutting through a group keep its
    lowest ids: four ids share the top logit, top-k 2 keeps ids 1 and 3 (the group's first two)."""
    row = torch.tensor([0.0, 5.0, 1.0, 5.0, 5.0, 2.0, 5.0])
    logits = row.expand(2000, 7).contiguous()
    seeds = torch.arange(2000)
    assert set(_call(logits, 1.0, 2, 1.0, seeds, 0).tolist()) == {1, 3}
    # each of the group has a quarter of the top mass and more: top_p 0.3 keeps two of them
    assert set(_call(logits, 1.0, 0, 0.3, seeds, 0).tolist()) == {1, 3}


def test_noise_stays_inside_the_unit_interval():
    """The largest hash gives u = (2^23 - 0.5) / 2^23 < 1 exactly in float32 (24 bits of hash
    rounded u to 1, and -log(-log(1)) is infinite)."""
    u = uniform_noise(torch.arange(64), torch.zeros(64, dtype=torch.int64), 20000)
    assert float(u.max()) < 1 and float(u.min()) > 0
    top = (torch.tensor(2**23 - 1, dtype=torch.int64).to(torch.float32) + 0.5) * (1.0 / (1 << 23))
    assert float(top) < 1


def test_sampler_refuses_arguments_before_touching_a_device():
    from cupool.ops.sampler import MAX_VOCAB, Sampler
    for kwargs, match in ((dict(rows=0), "rows must be"), (dict(vocab=0), "vocab must be"),
                          (dict(vocab=MAX_VOCAB + 1), "vocab must be"),
                          (dict(dtype=torch.float32), "bf16 or fp16 logits"),
                          (dict(device="cpu"), "CUDA device")):
        args = dict(rows=4, vocab=100, dtype=torch.bfloat16, device="cuda") | kwargs
        with pytest.raises(ValueError, match=match):
            Sampler(**args)


def test_sampler_constants_match_the_kernel():
    """ops/sampler.py mirrors sample.cu's constants (ARCHITECTURE.md, "Constants Python and CUDA
    share")."""
    import re
    from pathlib import Path

    from cupool.ops import sampler
    src = (Path(__file__).resolve().parent.parent / "rawkernels" / "sample.cu").read_text()
    defines = dict(re.findall(r"^#define (\w+) (.+?)\s*(?://.*)?$", src, re.M))
    assert int(defines["THREADS"]) == sampler.THREADS and int(defines["ITEMS"]) == sampler.ITEMS
    assert int(defines["KEYS"]) == sampler.KEYS and int(defines["CUT_WORDS"]) == sampler.CUT_WORDS
    assert defines["HIST_WORDS"] == "(KEYS + THREADS)"
    assert sampler.HIST_WORDS == sampler.KEYS + sampler.THREADS
    assert float(defines["FIXED_ONE"]) == 2.0 ** 40 and sampler.MAX_VOCAB * 2 ** 40 < 2 ** 63
