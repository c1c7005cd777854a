"""cupool.graphsafe: the engine's replacements compute what transformers' modules compute.

- qwen4_exp's QSA indexer: the batched selection equals transformers' per-query loop on a whole
  prompt, on a chunk continuing a slot's keys, and on a decode step of two slots at different
  positions; the selection really drops blocks (so equality says something).
- PhiMoE's rotary embedding: equal to transformers' for the default rope and for LongRoPE on
  either side of original_max_position_embeddings, per sequence of a batch.
- Multi-head latent attention: num_key_value_groups becomes 1 where keys have every query head."""

from __future__ import annotations

import pytest
import torch

from tiny_models import hybrid_model

pytest.importorskip("transformers")

from cupool import graphsafe  # noqa: E402
from cupool.slotstate import StateSlotCache  # noqa: E402

L = 40


def _causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()[None, None]        # [1, 1, n, n]


@pytest.fixture(scope="module")
def qwen4():
    model = hybrid_model("qwen4_exp_text", seed=3)
    layer = next(i for i, t in enumerate(model.config.layer_types) if t != "linear_attention")
    indexer = model.model.layers[layer].self_attn.indexer
    original = indexer.forward                       # transformers' own, before the fix
    assert graphsafe.prepare(model)                  # installs the fix (idempotent)
    assert graphsafe.prepare(model) == []
    return model, indexer, original


def _rope(model, h, positions):
    """(cos, sin) [b, S, r] for positions [b, S], from the model's rotary embedding."""
    return model.model.rotary_emb(h, positions[None])


def _hidden(n, H, seed):
    return torch.randn(1, n, H, generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def test_qsa_selection_equals_transformers_on_a_prompt_and_a_continued_chunk(qwen4):
    model, idx, original = qwen4
    n, a = 29, 17
    h = _hidden(n, model.config.hidden_size, seed=1)
    want = original(h, _rope(model, h, torch.arange(n)[None]), _causal(n), None)
    assert want.shape == (1, 1, n, n)
    assert (want != _causal(n)).any(), "the selection drops no block: the test would say nothing"
    cache = StateSlotCache(len(model.model.layers), 2, L, torch.float32, "cpu")
    cache.prefill_mode(1, 0, n)
    got = graphsafe.qsa_select(idx, h, _rope(model, h, torch.arange(n)[None]),
                               cache.prefill_mask(torch.float32, boolean=True), cache)
    assert torch.equal(got, want)
    # the same prompt as two chunks: the second chunk's queries read the first chunk's keys
    cache = StateSlotCache(len(model.model.layers), 2, L, torch.float32, "cpu")
    cache.prefill_mode(0, 0, a)
    graphsafe.qsa_select(idx, h[:, :a], _rope(model, h, torch.arange(a)[None]),
                         cache.prefill_mask(torch.float32, boolean=True), cache)
    cache.prefill_mode(0, a, n - a)
    got = graphsafe.qsa_select(idx, h[:, a:], _rope(model, h, torch.arange(a, n)[None]),
                               cache.prefill_mask(torch.float32, boolean=True), cache)
    assert torch.equal(got, want[:, :, a:])


@torch.inference_mode()
def test_qsa_selection_of_a_decode_step_of_two_slots(qwen4):
    model, idx, original = qwen4
    H = model.config.hidden_size
    lengths = (26, 13)
    seqs = [_hidden(n, H, seed=10 + i) for i, n in enumerate(lengths)]
    cache = StateSlotCache(len(model.model.layers), 2, L, torch.float32, "cpu")
    for b, (n, h) in enumerate(zip(lengths, seqs)):
        cache.prefill_mode(b, 0, n - 1)
        graphsafe.qsa_select(idx, h[:, :n - 1], _rope(model, h, torch.arange(n - 1)[None]),
                             cache.prefill_mask(torch.float32, boolean=True), cache)
    cache.decode_mode()
    cache.pos[:] = torch.tensor([n - 1 for n in lengths])
    last = torch.cat([h[:, -1:] for h in seqs])                          # [2, 1, H]
    got = graphsafe.qsa_select(idx, last, _rope(model, last, cache.pos[:, None]),
                               cache.decode_mask(torch.float32, boolean=True), cache)
    assert got.shape == (2, 1, 1, L)
    for b, (n, h) in enumerate(zip(lengths, seqs)):
        want = original(h, _rope(model, h, torch.arange(n)[None]), _causal(n), None)
        assert torch.equal(got[b, 0, 0, :n], want[0, 0, -1]), b
        assert not got[b, 0, 0, n:].any()


@torch.inference_mode()
def test_qsa_other_caches_get_transformers_forward(qwen4):
    model, idx, original = qwen4
    n = 9
    h = _hidden(n, model.config.hidden_size, seed=4)
    pe = _rope(model, h, torch.arange(n)[None])
    assert torch.equal(idx(h, pe, _causal(n), None), original(h, pe, _causal(n), None))


# --- PhiMoE's rotary embedding -----------------------------------------------------------------------
def _phimoe_rotary(**rope):
    from transformers import AutoConfig
    from transformers.models.phimoe.modeling_phimoe import PhimoeRotaryEmbedding
    cfg = AutoConfig.for_model("phimoe", hidden_size=64, num_attention_heads=4,
                               max_position_embeddings=64, **rope)
    return PhimoeRotaryEmbedding(cfg)


@pytest.mark.parametrize("rope", ["default", "longrope"])
@torch.inference_mode()
def test_phimoe_rotary_is_transformers_per_sequence(rope):
    kw = {}
    if rope == "longrope":
        half = 8
        kw = dict(rope_parameters=dict(
            rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=16,
            short_factor=[1.0 + 0.1 * i for i in range(half)],
            long_factor=[2.0 + 0.3 * i for i in range(half)], short_mscale=1.1,
            long_mscale=1.3))
    rot = _phimoe_rotary(**kw)
    x = torch.zeros(1, dtype=torch.float32)
    pos = torch.tensor([[3, 4, 5], [30, 31, 32]])            # one sequence each side of 16
    want = [rot(x, pos[b:b + 1]) for b in range(2)]
    batched = rot(x, pos)                       # transformers: the batch's largest position
    holder = torch.nn.Module()
    holder.rotary = rot
    assert graphsafe.prepare(holder) == ["rotary"]
    cos, sin = rot(x, pos)
    for b in range(2):
        torch.testing.assert_close(cos[b:b + 1], want[b][0], rtol=0, atol=0)
        torch.testing.assert_close(sin[b:b + 1], want[b][1], rtol=0, atol=0)
    if rope == "longrope":                     # the short sequence keeps the short mscale
        assert not torch.equal(cos[0], batched[0][0])


# --- multi-head latent attention -------------------------------------------------------------------
def test_mla_groups_become_one_where_keys_have_every_head():
    model = hybrid_model("deepseek_v2", seed=1)
    attn = [m for m in model.modules() if hasattr(m, "kv_b_proj")]
    assert attn and all(m.num_key_value_groups == 4 for m in attn)
    fixed = graphsafe.prepare(model)
    assert sorted(fixed) == sorted(n for n, m in model.named_modules() if hasattr(m, "kv_b_proj"))
    assert all(m.num_key_value_groups == 1 for m in attn)
