"""cupool.Engine on the GPU with the hybrid families (tests/tiny_models.HYBRID_FAMILIES).

- Unwrapped, float32: the captured decode step (graph=True: per-slot states at fixed addresses,
  put back after the capture's dummy steps) gives the tokens of the eager engine, with two slots
  of different lengths, a slot reused and chunked prefill.
- Through a pool (half the experts banked, graph captured, gate open): the tokens equal the
  unwrapped model's with the dequantized experts on the engine's own context (teacher forcing),
  up to test_gpu_engine.MAX_OFF near-ties (test_gpu_engine's docstring); no error bits, bank
  rows equal to the host store. qwen4_exp's n-gram tables are in mapped host memory there
  (cupool.wrap places them), so its decode step gathers their rows over PCIe.
- The mapped table itself: a CUDA tensor over pinned host memory, and the engine's tokens equal
  those with the table in GPU memory.
- Prefix reuse with the captured step: a turn resumes from the states saved when the turn before
  ended (saves and loads are ordered with the graph's replays on the stream; the free slot's own
  states moved on meanwhile) and gives the tokens of a cold run, with the same graph.
"""

from __future__ import annotations

import pytest
import torch
from test_gpu_engine import MAX_OFF, _check_against_reference, _prompts
from tiny_models import HYBRID_FAMILIES, hybrid_model

import cupool
from cupool.sampling import SamplingParams

pytestmark = pytest.mark.gpu

FAMILIES = sorted(HYBRID_FAMILIES)
POOLED = FAMILIES         # nemotron_h: experts without a gate (ROW_GATED=0 builds)


def _run(model, graph, pool=None, max_batch=2):
    eng = cupool.Engine(model, pool, max_batch=max_batch, max_len=48, graph=graph,
                        prefill_chunk=8, eos_token_id=[])
    ps = _prompts([3, 13, 6, 21], seed=3)
    budgets = [5, 12, 12, 8]
    reqs = eng.generate(ps, [SamplingParams(max_tokens=n) for n in budgets])
    assert [len(r.output_ids) for r in reqs] == budgets
    if graph:
        assert eng._graphs, "the engine did not capture its step"
    eng.close()
    return reqs


def _capturable_experts(model):
    """transformers' default experts implementation (grouped_mm) falls back, for float32 weights,
    to a loop over `offs.tolist()`, a host read a graph cannot capture; batched_mm has none. (A
    wrapped model's experts are the pool's.)"""
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_experts_implementation"):
            cfg._experts_implementation = "batched_mm"
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_captured_step_equals_the_eager_step(family):
    model = _capturable_experts(hybrid_model(family, seed=31).cuda())
    eager = _run(model, graph=False)
    captured = _run(model, graph=True)
    for a, b in zip(eager, captured):
        assert a.output_ids == b.output_ids, (family, a.prompt_ids)


def _bf16_model(family, seed):
    """A tiny hybrid model in bf16 with experts of real-model size (test_gpu_wrap.model_for)."""
    model = hybrid_model(family, seed=seed)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "gate_up_proj") and isinstance(m.gate_up_proj, torch.Tensor):
                m.gate_up_proj.normal_(0, 0.05)
                m.down_proj.normal_(0, 0.05)
            elif hasattr(m, "up_proj") and isinstance(m.up_proj, torch.Tensor):   # no gate
                m.up_proj.normal_(0, 0.05)
                m.down_proj.normal_(0, 0.05)
    return model.to(torch.bfloat16)


@pytest.mark.parametrize("family", POOLED)
def test_hybrid_engine_through_the_pool_matches_the_reference(family):
    model = _bf16_model(family, seed=21)
    _, (_, E, K, _, _, _) = HYBRID_FAMILIES[family]
    pool = cupool.wrap(model, rows=max(K, E // 2), max_decode_tokens=4, max_prefill_tokens=64,
                       progress=False)
    eng = cupool.Engine(model, pool, max_batch=4, max_len=48, prefill_chunk=8, eos_token_id=[])
    ps = _prompts([3, 9, 14, 5, 7, 2], seed=1)                # six requests, four slots
    reqs = eng.generate(ps, [SamplingParams(max_tokens=n) for n in (16, 12, 16, 6, 10, 16)])
    assert [len(r.output_ids) for r in reqs] == [16, 12, 16, 6, 10, 16]
    assert eng._graphs and int(pool.bank.gate.item()) == 1     # captured, then the gate opened
    assert pool.errors() == []
    assert pool.verify() > 0
    if family == "qwen4_exp_text":
        from cupool.hosttable import host_table_names
        names = host_table_names(model)
        assert names and all(getattr(model.get_parameter(n), "_cupool_host_table", False)
                             for n in names)
    eng.close()
    pool.unwrap()
    off = _check_against_reference(model, reqs)
    assert len(off) <= MAX_OFF, f"{family}: tokens off the reference's argmax at {off}"


def test_ngram_tables_in_mapped_host_memory_give_the_same_tokens():
    from cupool.hosttable import host_table_names, place_host_tables
    model = _capturable_experts(hybrid_model("qwen4_exp_text", seed=7).cuda())
    on_gpu = _run(model, graph=True)
    names = host_table_names(model)
    before = {n: model.get_parameter(n).detach().clone() for n in names}
    placed = place_host_tables(model, "cuda")
    assert placed == sum(t.numel() * t.element_size() for t in before.values())
    free, _ = torch.cuda.mem_get_info()
    for n in names:
        p = model.get_parameter(n)
        assert p.is_cuda and torch.equal(p, before[n])      # read by a kernel, same values
    assert place_host_tables(model, "cuda") == 0             # placed once
    on_host = _run(model, graph=True)
    for a, b in zip(on_gpu, on_host):
        assert a.output_ids == b.output_ids
    assert torch.cuda.mem_get_info()[0] >= free - (64 << 20)   # the tables took no GPU memory


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe_text", "qwen4_exp_text",
                                    "granitemoehybrid"])
def test_prefix_reuse_with_the_captured_step(family):
    model = _capturable_experts(hybrid_model(family, seed=33).cuda())
    first, other, *new = _prompts([9, 4, 5, 1], seed=5)
    warm = cupool.Engine(model, max_batch=2, max_len=64, prefill_chunk=8, eos_token_id=[])
    cold = cupool.Engine(model, max_batch=2, max_len=64, prefill_chunk=8, eos_token_id=[],
                         reuse_prefix=False)
    # turn 1 ends after 5 tokens while the other slot decodes 20 more steps
    r1, _ = warm.generate([first, other], [SamplingParams(max_tokens=5),
                                           SamplingParams(max_tokens=25)])
    graphs = dict(warm._graphs)
    assert graphs and warm.resume_point_bytes > 0
    prompt, prev = first + r1.output_ids + new[0], len(first) + 5
    for k in range(2):
        r = warm.generate([prompt], SamplingParams(max_tokens=12))[0]
        assert r.cached_tokens == prev, (family, k)
        want = cold.generate([prompt], SamplingParams(max_tokens=12))[0]
        assert r.output_ids == want.output_ids, (family, k)
        prompt, prev = prompt + r.output_ids + new[1], len(prompt) + 12
    assert warm._graphs == graphs                  # the same captured step throughout
    warm.close()
    cold.close()



@pytest.mark.parametrize("family", ["qwen3_next", "qwen4_exp_text", "granitemoehybrid"])
def test_resume_at_with_the_captured_step(family):
    """A 13-token prompt with resume_at=10 (inside the second chunk of 8) keeps the states after
    its first 10 tokens, those of a prefill of exactly those 10 tokens; turn 2 keeps those 10 and
    diverges right after (a thinking template's next turn), after the other slot's steps have
    advanced every slot's states, resumes at 10 and gives a cold run's tokens; the captured step
    is the same throughout."""
    model = _capturable_experts(hybrid_model(family, seed=34).cuda())
    first, other, new = _prompts([13, 4, 6], seed=6)
    if new[0] == first[10]:
        new[0] = 3 if first[10] != 3 else 4
    warm = cupool.Engine(model, max_batch=2, max_len=64, prefill_chunk=8, eos_token_id=[])
    r1 = warm.submit(first, SamplingParams(max_tokens=5), resume_at=10)
    warm.submit(other, SamplingParams(max_tokens=25))
    warm.run_until_idle()
    assert r1.finished and sorted(p.length for p in warm.prefix.points[0]) == [10, 13, 18]
    graphs = dict(warm._graphs)
    (point,) = [p for p in warm.prefix.points[0] if p.length == 10]
    got = warm.prefix.saved.read(point.entry)
    short = cupool.Engine(model, max_batch=1, max_len=64, prefill_chunk=8, eos_token_id=[])
    short.generate([first[:10]], SamplingParams(max_tokens=1))
    (end,) = short.prefix.points[0]                 # the end of that 10-token prompt
    want = short.prefix.saved.read(end.entry)
    short.close()
    assert end.length == 10 and len(got) == len(want) > 0
    for g, w in zip(got, want):
        # the same chunks ([0, 8), [8, 10)) through the same kernels; a tolerance in case a
        # kernel's reduction order depends on more than the shapes
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    cold = cupool.Engine(model, max_batch=2, max_len=64, prefill_chunk=8, eos_token_id=[],
                         reuse_prefix=False)
    prompt = first[:10] + new
    r = warm.generate([prompt], SamplingParams(max_tokens=12))[0]
    assert r.cached_tokens == 10, family
    want_ids = cold.generate([prompt], SamplingParams(max_tokens=12))[0].output_ids
    assert r.output_ids == want_ids, family
    assert warm._graphs == graphs
    warm.close()
    cold.close()
