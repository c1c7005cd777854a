"""The prefetch predictors on the CPU: a layer's router, applied by `RouterPredictor`, names what
the router itself selects; `TracePredictor` reads a trace's predictions at the replayed step.
(The Prefetcher and the pool's wiring need a GPU: tests/test_gpu_prefetch.py.)"""

import types

import numpy as np
import pytest
import torch
from tiny_models import FAMILIES, ListMoEModel, hf_model

from cupool import trace as tr
from cupool.adapters import find_moe_layers
from cupool.prefetch import RouterPredictor, TracePredictor, check_max_rows

# DeepSeek-V3 routes within its best groups; with every group allowed its choice is the top-k of
# sigmoid(logits) + the correction bias, which the predictor computes.
OVERRIDES = {"deepseek_v3": dict(topk_group=2)}


def randomize_routers(specs, gen):
    with torch.no_grad():
        for spec in specs:
            r = spec.router()
            r.weight.copy_(torch.randn(r.weight.shape, generator=gen))
            for name in ("bias", "e_score_correction_bias"):
                t = getattr(r, name, None)
                if isinstance(t, torch.Tensor):
                    t.copy_(torch.randn(t.shape, generator=gen) * 0.3)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_router_predictor_names_what_the_router_selects(family):
    model = hf_model(family, **OVERRIDES.get(family, {}))
    specs = find_moe_layers(model)
    gen = torch.Generator().manual_seed(3)
    randomize_routers(specs, gen)
    pred = RouterPredictor(specs)
    for layer, spec in enumerate(specs):
        x = torch.randn(7, spec.hidden, generator=gen)                   # odd T
        got = pred(layer, x)
        assert got.shape == (7, spec.top_k) and got.dtype == torch.int64
        want = spec.router()(x)[-1]                                       # the router's top-k ids
        assert [set(r) for r in got.tolist()] == [set(r) for r in want.tolist()], \
            f"{family} layer {layer}"


def test_router_predictor_on_a_hand_written_block_and_its_top_k():
    model = ListMoEModel(L=3, H=48, I=32, E=6, K=2)
    specs = find_moe_layers(model)
    x = torch.randn(5, 48)
    block = specs[2].parent
    want = torch.topk(block.gate(x), 2, dim=-1).indices
    got = RouterPredictor(specs)(2, x)
    assert [set(r) for r in got.tolist()] == [set(r) for r in want.tolist()]
    wide = RouterPredictor(specs, top_k=4)(2, x)
    assert wide.shape == (5, 4)
    assert all(set(a) <= set(b) for a, b in zip(got.tolist(), wide.tolist()))
    with pytest.raises(ValueError, match="top_k must be an int in"):
        RouterPredictor(specs, top_k=7)


def test_router_predictor_refuses_a_layer_without_a_router_weight():
    model = ListMoEModel(L=2, H=48, I=32, E=6, K=2)
    specs = find_moe_layers(model)
    specs[1].parent.gate = torch.nn.Linear(48, 5, bias=False)     # scores 5 experts, not 6
    with pytest.raises(ValueError, match=r"no weight \[E=6, H=48\]"):
        RouterPredictor(specs)


def test_trace_predictor_reads_the_replayed_step():
    t = tr.with_predictions(tr.uniform(6, 3, 16, 2, seed=1), 0.8, seed=2)
    replayer = types.SimpleNamespace(ids=torch.from_numpy(t.ids.astype(np.int64)),
                                     step=torch.tensor([4]))
    pred = TracePredictor(replayer, t)
    got = pred(2, torch.zeros(3, 8))                                   # T = 3 > the trace's 1
    assert got.shape == (3, 2) and got.dtype == torch.int64
    assert (got == torch.from_numpy(t.predicted[4, 2].astype(np.int64))).all()
    replayer.step.fill_(5)
    assert pred(1, torch.zeros(1, 8)).tolist() == t.predicted[5, 1].tolist()
    with pytest.raises(ValueError, match="no predicted ids"):
        TracePredictor(replayer, tr.uniform(6, 3, 16, 2, seed=1))
    with pytest.raises(ValueError, match="not the replayed"):
        TracePredictor(replayer, tr.with_predictions(tr.uniform(5, 3, 16, 2), 0.5))


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_max_rows_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="max_rows must be an int >= 1 or None"):
        check_max_rows(bad)
    assert check_max_rows(None) is None and check_max_rows(3) == 3
