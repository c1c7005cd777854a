"""The multi-GPU memory plan (cupool.placement): layers split over devices, a bank on each (CPU;
models on the meta device)."""

import itertools

import numpy as np
import pytest
import torch

from cupool.budget import BudgetError
from cupool.placement import plan_model, split


def _rows(budget, fixed, m, stride, E):
    return min(E, (budget - fixed) // (m * stride)) if m else E


def brute_force(layer_bytes, moe, budgets, head, tail, kv, stride, E, K, pool):
    """The best min over devices of rows a MoE layer, over every contiguous split."""
    L, D = len(layer_bytes), len(budgets)
    best = None
    for cuts in itertools.combinations_with_replacement(range(L + 1), D - 1):
        bounds = (0,) + cuts + (L,)
        worst = E
        for d in range(D):
            a, b = bounds[d], bounds[d + 1]
            m = sum(moe[i] is not None for i in range(a, b))
            fixed = sum(layer_bytes[a:b]) + (b - a) * kv + (pool(m) if m else 0) + \
                (head if d == 0 else 0) + (tail if b == L else 0)
            if fixed > budgets[d]:
                worst = -1
                break
            r = _rows(budgets[d], fixed, m, stride, E)
            if m and r < K:
                worst = -1
                break
            worst = min(worst, r)
        if worst >= 0 and (best is None or worst > best):
            best = worst
    return best


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("D", [2, 3])
def test_split_is_the_best_contiguous_split(seed, D):
    rng = np.random.default_rng(seed)
    L, E, K, stride = int(rng.integers(3, 9)), 32, 4, 1000
    layer_bytes = [int(x) for x in rng.integers(500, 3000, L)]
    moe = [None if rng.random() < 0.25 else i for i in range(L)]
    if all(m is None for m in moe):
        moe[-1] = L - 1
    budgets = [int(x) for x in rng.integers(20_000, 60_000, D)]
    head, tail, kv = 1500, 2500, 300
    pool = lambda m: 700 + 100 * m  # noqa: E731
    best = brute_force(layer_bytes, moe, budgets, head, tail, kv, stride, E, K, pool)
    kw = dict(devices=list(range(D)), budgets=budgets, head_bytes=head, tail_bytes=tail,
              kv_bytes_per_layer=kv, row_stride=stride, num_experts=E, top_k=K, pool_bytes=pool)
    if best is None:
        with pytest.raises(BudgetError, match="cannot hold the model"):
            split(layer_bytes, moe, **kw)
        return
    plan = split(layer_bytes, moe, **kw)
    segs = plan.segments
    assert [i for s in segs for i in s.layers] == list(range(L))            # contiguous, all
    assert [m for s in segs for m in s.moe_layers] == [m for m in moe if m is not None]
    for s in segs:
        assert s.total_bytes <= s.budget_bytes
        assert not s.moe_layers or K <= s.rows_per_layer <= E
    assert min(s.rows_per_layer for s in segs if s.moe_layers) == best
    assert segs[0].dense_bytes >= head and segs[-1].dense_bytes >= tail


def test_bigger_budget_takes_more_layers_and_budget_errors():
    kw = dict(devices=["cuda:0", "cuda:1"], head_bytes=0, tail_bytes=0, kv_bytes_per_layer=0,
              row_stride=100, num_experts=16, top_k=2, pool_bytes=lambda m: 0)
    plan = split([1000] * 8, list(range(8)), budgets=[4000, 12000], **kw)
    a, b = plan.segments
    assert len(a.layers) < len(b.layers) and a.device == "cuda:0"
    with pytest.raises(BudgetError, match=r"cannot hold the model with top-k=2"):
        split([1000] * 8, list(range(8)), budgets=[3000, 3000], **kw)
    with pytest.raises(ValueError, match="budgets\\[1\\] must be an int >= 1"):
        split([1000] * 8, list(range(8)), budgets=[3000, 0], **kw)
    with pytest.raises(ValueError, match="devices must be distinct"):
        split([1000] * 8, list(range(8)), budgets=[3000, 3000],
              **{**kw, "devices": [0, 0]})


def _meta(family, **over):
    from tiny_models import hf_config
    from transformers import AutoModelForCausalLM

    from cupool.adapters import find_moe_layers
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(family, **over), dtype=torch.bfloat16)
    return model, find_moe_layers(model)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss", "mixtral"])
def test_plan_model_on_the_meta_device_over_two_devices(family):
    pytest.importorskip("transformers")
    from cupool.layout import RowLayout
    model, specs = _meta(family)
    layout = RowLayout(specs[0].hidden, specs[0].intermediate, bias=specs[0].bias)
    expert = {id(p) for s in specs for p in s.module.parameters()}
    dense = sum(p.numel() * 2 for p in model.parameters() if id(p) not in expert) + \
        sum(b.numel() * 2 for b in model.buffers())                 # rotary tables
    E, L = specs[0].num_experts, len(specs)
    # two devices, each short of the whole model with every expert: it must split
    budget = dense // 2 + (L * E * layout.row_stride) * 3 // 5 + L * (10_000 + 4096)
    plan = plan_model(model, specs, devices=[0, 1], budgets=[budget, budget],
                      kv_bytes_per_layer=4096, row_stride=layout.row_stride,
                      pool_bytes=lambda m: 10_000 * m)
    a, b = plan.segments
    assert a.layers and b.layers, plan.table()
    assert all(s.total_bytes <= budget for s in plan.segments)
    assert sum(s.dense_bytes for s in plan.segments) == dense
    dm = plan.device_map()
    # every parameter and buffer's module is placed, the embeddings first, the head last
    for name, _ in list(model.named_parameters()) + list(model.named_buffers()):
        assert any(name == k or name.startswith(k + ".") for k in dm), name
    assert dm[plan.layer_names[0]] == 0 and dm[plan.layer_names[-1]] == 1
    assert dm["lm_head"] == 1
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert dm["model.embed_tokens"] == (1 if tied else 0)
    # a model whose first layer is dense (DeepSeek-V3) keeps the pool's layer numbers in order
    assert [m for s in plan.segments for m in s.moe_layers] == list(range(L))


def test_plan_model_tied_embeddings_go_last():
    pytest.importorskip("transformers")
    from cupool.layout import RowLayout
    model, specs = _meta("qwen3_moe", tie_word_embeddings=True)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    layout = RowLayout(48, 32)
    plan = plan_model(model, specs, devices=[0, 1], budgets=[60_000, 10**7],
                      kv_bytes_per_layer=0, row_stride=layout.row_stride, pool_bytes=lambda m: 0)
    dm = plan.device_map()
    assert dm["model.embed_tokens"] == dm["lm_head"] == 1
