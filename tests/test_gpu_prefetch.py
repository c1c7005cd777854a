"""Prefetch inside the decode step on the GPU: the Prefetcher's side stream in a captured graph
against the reference planner, and the pool's wiring (decode output unchanged by prefetch,
counters, predictor accuracy)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_gpu_engine import _generate, _prompts
from test_gpu_planner import make_store
from test_gpu_wrap import model_for
from tiny_models import FAMILIES

import cupool
from cupool.bank import Bank
from cupool.prefetch import Prefetcher
from cupool.reference.planner import ReferencePlanner
from cupool.sampling import SamplingParams

pytestmark = pytest.mark.gpu


def test_prefetcher_in_a_captured_graph_equals_the_reference(rng):
    """A decode step of L layers: join, plan step, lane rows checked, observe, prefetch of the
    next layer on the side stream; captured once (gate closed) and replayed with fresh actual and
    predicted ids (about 60% right) each time. After every replay the tables, flags and counters
    equal the reference's (step l, then prefetch l + 1, in that order), every lane read its
    expert's bytes, and the tracked accuracy is the host's count. Eager steps in between
    (Prefetcher outside a graph) follow the same reference."""
    L, E, N, S, K, row = 4, 19, 4, 64, 6, 2048 + 32
    store, expect = make_store(rng, L, E, row)
    bank = Bank(store, N, S, K, prefetch=True)
    ref = ReferencePlanner(L, E, N, S)
    ids_buf = torch.full((L, 1, K), -1, dtype=torch.int64, device="cuda")    # actual, [T=1, K]
    pred_buf = torch.full((L, 1, K), -1, dtype=torch.int64, device="cuda")   # predicted
    pre = Prefetcher(bank, lambda layer, hidden: pred_buf[layer], track_accuracy=True)
    hidden = torch.zeros(1, 16, device="cuda")
    routes_out = torch.full((L, K), -7, dtype=torch.int32, device="cuda")
    bad = torch.zeros(1, dtype=torch.int64, device="cuda")

    def step():
        for layer in range(L):
            pre.join()
            pre.observe(layer, ids_buf[layer])
            routes, _ = bank.step(layer, ids_buf[layer])
            r = routes.long()
            keys = (layer * E + ids_buf[layer].reshape(-1)).clamp(0, L * E - 1)
            got = bank.rows[r.clamp(min=0), :row]
            bad.add_(((got != expect[keys]).any(dim=1) & (r >= 0)).sum())
            routes_out[layer].copy_(routes)
            pre.issue(layer + 1, hidden)                  # layer L: nothing
        pre.join()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                         # warm-up: gate closed, all padding
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    torch.cuda.synchronize()
    assert bank.state()["clock"] == 0
    bank.open()
    ref.open()
    pre.reset()
    bad.zero_()
    right = total = 0
    for rep in range(60):
        ids = np.stack([rng.permutation(E)[:K] for _ in range(L)])
        ids[rng.random(ids.shape) < 0.05] = -1
        pred = np.stack([rng.permutation(E)[:K] for _ in range(L)])
        keep = rng.random(pred.shape) < 0.6
        pred[keep] = ids[keep]                               # may repeat an id: deduplicated
        ids_buf.copy_(torch.from_numpy(ids).view(L, 1, K))
        pred_buf.copy_(torch.from_numpy(pred).view(L, 1, K))
        if rep % 5 == 4:
            step()                                           # eager, outside the graph
        else:
            graph.replay()
        want = []
        for layer in range(L):
            want.append(ref.step(layer, ids[layer])[0])
            if layer + 1 < L:
                ref.prefetch(layer + 1, pred[layer + 1])
        for layer in range(1, L):                            # what observe counts
            act = [e for e in ids[layer] if e >= 0]
            right += sum(e in set(pred[layer]) for e in act)
            total += len(act)
        torch.cuda.synchronize()
        st, pst = bank.state(), ref.prefetch_state()
        where = f"replay {rep}"
        for name, want_v in {**ref.state(), **pst}.items():
            np.testing.assert_array_equal(st[name], want_v, err_msg=f"{name}, {where}")
        np.testing.assert_array_equal(routes_out.cpu().numpy(), np.stack(want), err_msg=where)
        assert int(bad.item()) == 0, f"lanes read wrong bytes, {where}"
    assert ref.prefetch_counters[:, 0].sum() > 0 and ref.prefetch_counters[:, 1].sum() > 0
    assert abs(pre.accuracy() - right / total) < 1e-12
    assert bank.verify() == int((ref.key_of >= 0).sum())
    assert bank.read_error() == 0
    store.close()


@pytest.mark.parametrize("overlap, max_rows", [(False, None), (True, None), (False, 1)])
def test_pool_prefetch_leaves_decode_unchanged(overlap, max_rows):
    """The Engine (captured step, 3 slots, token mask) through a half-size bank, with prefetch off
    and on (the model's own routers as predictors; all predicted rows, or at most one a
    prefetch): the same tokens bit for bit (prefetch moves rows, never what a lane reads), rows
    prefetched and used, no error flags, the bank verified."""
    family = "qwen3_moe"
    model = model_for(family, seed=31)
    _, (_, E, K, _, _) = FAMILIES[family]
    pool = cupool.wrap(model, rows=E // 2, max_decode_tokens=3, max_prefill_tokens=64,
                       progress=False)
    pool.overlap_copies = overlap
    # prompts of at most 3 tokens: their prefill takes the decode path too (T·K <= the bank's
    # lanes), which is deterministic; the partition path's fp32 atomics are not bit for bit
    ps = _prompts([3, 2, 3, 1], seed=6)
    params = [SamplingParams(max_tokens=n) for n in (20, 12, 18, 16)]

    def run():
        return _generate(model, pool, ps, params)

    plain = run()
    assert not pool.bank.prefetching
    pre = pool.enable_prefetch(track_accuracy=True, max_rows=max_rows)
    assert pool.bank.prefetching and pool.prefetcher is pre
    pool.bank.reset_stats()
    with_prefetch = run()
    assert with_prefetch == plain
    stats = pool.stats()
    assert sum(s["prefetched"] for s in stats) > 0, stats
    assert stats[0]["prefetched"] == 0                       # layer 0 is never predicted
    if max_rows is not None:                                 # a prefetch a layer and step
        steps = sum(p.max_tokens for p in params) + len(ps)
        assert all(s["prefetched"] <= max_rows * steps for s in stats), stats
    assert 0.0 <= pre.accuracy() <= 1.0 and int(pre.total.item()) > 0
    assert pool.errors() == []
    assert pool.verify() > 0
    pool.disable_prefetch()
    assert run() == plain                                    # the PREFETCH build, no prefetches
    pool.unwrap()


def test_pool_prefetch_api_for_a_step_of_its_own():
    """Pool.prefetch / join_prefetch as a decode step of its own would call them (here around the
    bank's plan steps directly), the guards, and resize_bank keeping the prefetch build."""
    model = model_for("mixtral", seed=32)
    _, (_, E, K, H, _) = FAMILIES["mixtral"]
    pool = cupool.wrap(model, rows=K, max_decode_tokens=1, progress=False)
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="enable_prefetch"):
        pool.prefetch(1, x)
    with pytest.raises(TypeError, match="predictor must be callable"):
        pool.enable_prefetch(predictor=3)
    pool.enable_prefetch()
    pool.open(verify=False)
    ids = torch.tensor([[0, 1]], device="cuda")
    pool.bank.step(0, ids)
    pool.prefetch(1, x)                                      # layer 1's router on x
    pool.join_prefetch()
    want = set(pool.prefetcher.predict(1, x).reshape(-1).tolist())
    slot = pool.bank.slot_of[E:2 * E].cpu().numpy()
    assert all(slot[e] >= 0 for e in want)                   # predicted experts now resident
    assert int(pool.bank.tables.pf_counters[1, 0]) == len(want - {0, 1})
    pool.resize_bank(E)
    assert pool.bank.prefetching and pool.prefetcher.bank is pool.bank
    pool.unwrap()
