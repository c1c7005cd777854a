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
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), generation_config=cfg)
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
