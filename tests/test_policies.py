"""Eviction policies, prefetch (the reference planner's model of both) and traces with predicted
ids (CPU)."""

import math

import numpy as np
import pytest

from cupool import trace as tr
from cupool.reference.planner import LRU, Policy, ReferencePlanner
from cupool.simulate import simulate


# --- policies --------------------------------------------------------------------------------------
def test_lfru_weight_zero_is_lru():
    t = tr.synthetic(40, 6, 16, 2, seed=3, **tr.QWEN3_LOCALITY)
    a = simulate(t, 5, warmup_steps=4)
    b = simulate(t, 5, warmup_steps=4, policy=Policy("lfru", weight=0.0, half_life=10.0))
    assert (a["hits"], a["misses"]) == (b["hits"], b["misses"])
    assert simulate(t, 5, warmup_steps=4, policy=LRU)["hits"] == a["hits"]


def test_lfru_keeps_the_frequent_row():
    # one layer, 3 experts, 2 rows: expert 0 is used three times, then 1, then 2 arrives.
    # LRU evicts the least recent (0); LFRU with a large weight evicts 1, used once.
    def run(policy):
        p = ReferencePlanner(1, 3, 2, 2, initial=[[0, 1]], policy=policy)
        p.open()
        for ids in ([0], [0], [0], [1], [2]):
            p.step(0, ids)
        return sorted(int(k) for k in p.key_of)
    assert run(LRU) == [1, 2]
    assert run(Policy("lfru", weight=10.0, half_life=100.0)) == [0, 2]


def test_protect_recent_keeps_a_new_row_from_frequency():
    # expert 0 used often long ago, expert 1 brought in one step ago: plain LFRU evicts 1 (once
    # used), the protect-recent variant (1 tick: rows used at the last step are kept) evicts 0
    def run(policy):
        p = ReferencePlanner(1, 4, 2, 2, initial=[[0, 3]], policy=policy)
        p.open()
        for ids in ([0], [0], [0], [0], [1], [2]):
            p.step(0, ids)
        return sorted(int(k) for k in p.key_of)
    assert run(Policy("lfru", weight=10.0, half_life=100.0)) == [0, 2]
    assert run(Policy("lfru", weight=10.0, half_life=100.0, protect=1)) == [1, 2]


@pytest.mark.parametrize("kw,match", [
    (dict(kind="lfu"), "kind must be one of"),
    (dict(kind="lru", weight=1.0), "takes no weight"),
    (dict(kind="lfru", weight=-1.0), "weight >= 0"),
    (dict(kind="lfru", half_life=0.0), "half_life > 0"),
])
def test_policy_guards(kw, match):
    with pytest.raises(ValueError, match=match):
        Policy(**kw)
    with pytest.raises(TypeError, match="policy must be a Policy"):
        ReferencePlanner(1, 2, 1, 1, policy="lru")


# --- prefetch ------------------------------------------------------------------------------------------
def test_prefetched_row_is_a_hit_and_counted():
    p = ReferencePlanner(2, 8, 2, 4)                  # layer 0 holds 0, 1; layer 1 holds 0, 1
    p.open()
    p.step(0, [0, 1])
    copies = p.prefetch(1, [5, 0])                    # 0 is resident, 5 is not
    assert [k for k, _ in copies] == [8 + 5]
    row = copies[0][1]
    assert p.key_of[row] == 13 and p.protected[row]
    assert p.protected[p.slot_of[8]]                  # the resident predicted row is kept too
    _, c2 = p.step(1, [5, 0])                         # 5: a hit now, no copy
    assert c2 == [] and p.counters[1, 0] == 2 and p.counters[1, 1] == 0
    assert p.prefetch_counters[1].tolist() == [1, 1, 0]
    assert not p.protected.any()
    assert p.check() == []


def test_wrong_prediction_costs_a_row_for_one_step_only():
    p = ReferencePlanner(1, 8, 3, 4)                  # rows hold 0, 1, 2
    p.open()
    p.step(0, [0, 1])
    copies = p.prefetch(0, [7])                       # wrong: 7 will not be used
    (k, row), = copies
    routes, c = p.step(0, [3, 4])                     # two misses: 7's row is protected
    assert row not in [r for _, r in c] and p.key_of[row] == k
    assert p.prefetch_counters[0].tolist() == [1, 0, 1]
    _, c = p.step(0, [5, 6])                          # protection ended: 7's row may go now
    assert row in [r for _, r in c]


def test_prefetch_with_gate_closed_or_no_victim_does_nothing():
    p = ReferencePlanner(1, 8, 2, 4)
    assert p.prefetch(0, [5]) == []                   # gate closed
    p.open()
    p.step(0, [0, 1])                                 # every row used in the current step
    assert p.prefetch(0, [5]) == []                   # no victim: skipped, never staged
    assert p.prefetch_counters.sum() == 0
    with pytest.raises(IndexError):
        p.prefetch(3, [1])
    with pytest.raises(TypeError):
        p.prefetch(0, np.array([1.5]))


def test_prefetch_random_steps_keep_routes_right():
    """10,000 layer steps with random predictions (right and wrong, out-of-range ids too): every
    route is a row holding the lane's key (or a staging row this step), the tables stay a
    bijection, and a protected row is never a victim."""
    rng = np.random.default_rng(5)
    L, E, N, S, K = 4, 12, 4, 8, 3
    p = ReferencePlanner(L, E, N, S)
    p.open()
    for i in range(10_000):
        layer = i % L
        ids = rng.choice(E, size=K, replace=False)
        ids[rng.random(K) < 0.05] = -1
        protected_before = set(np.flatnonzero(p.protected).tolist())
        keys_before = {r: int(p.key_of[r]) for r in protected_before}
        routes, copies = p.step(layer, ids)
        for r in protected_before:                    # protected rows were not taken by misses
            assert r not in [row for _, row in copies] or keys_before[r] == p.key_of[r]
        for e, r in zip(ids, routes):
            if e < 0:
                assert r == -1
            elif r < p.num_rows:
                assert p.key_of[r] == layer * E + e
            else:
                assert (layer * E + e, r) in copies   # staged for this step
        pred = rng.choice(E + 2, size=K, replace=False) - 1       # some −1, some out of range
        p.prefetch((layer + 1) % L, pred)
        if i % 500 == 0:
            assert p.check() == []
    assert p.check() == [] and p.error == 0
    assert p.prefetch_counters[:, 0].sum() == p.prefetch_counters[:, 1:].sum() + p.prefetched.sum()


# --- traces with predictions -------------------------------------------------------------------------
@pytest.mark.parametrize("acc", [0.0, 0.6, 0.8, 0.95, 1.0])
def test_with_predictions_accuracy(acc):
    t = tr.synthetic(60, 4, 32, 4, seed=1, **tr.QWEN3_LOCALITY)
    p = tr.with_predictions(t, acc, seed=2)
    right = total = 0
    for s in range(t.steps):
        for layer in range(t.num_layers):
            actual = set(t.ids[s, layer, 0].tolist())
            pred = p.predicted[s, layer, 0].tolist()
            assert len(set(pred)) == len(pred) == 4 and -1 not in pred
            right += len(actual & set(pred))
            total += len(actual)
    assert abs(right / total - acc) <= 0.03
    assert f"accuracy {acc:g}" in p.note


def test_predictions_save_load_and_validation(tmp_path):
    t = tr.with_predictions(tr.uniform(5, 2, 16, 2, seed=1), 0.8, seed=3)
    back = tr.Trace.load(t.save(tmp_path / "p.npz"))
    assert np.array_equal(back.predicted, t.predicted) and np.array_equal(back.ids, t.ids)
    with pytest.raises(tr.TraceError, match="predicted ids must be"):
        tr.Trace(t.ids, 16, predicted=t.predicted[:, :1])
    bad = t.predicted.copy()
    bad[0, 0, 0, 0] = 16
    with pytest.raises(tr.TraceError, match="predicted ids outside"):
        tr.Trace(t.ids, 16, predicted=bad)
    with pytest.raises(ValueError, match="accuracy must be a number in"):
        tr.with_predictions(t, 1.5)
    with pytest.raises(ValueError, match="needs a trace with predicted ids"):
        simulate(tr.uniform(5, 2, 16, 2), 4, prefetch=True)


def test_prefetch_raises_the_simulated_hit_rate():
    t = tr.synthetic(80, 8, 32, 4, seed=4, **tr.QWEN3_LOCALITY)
    base = simulate(t, 12, warmup_steps=8)["hit_rate"]
    rates = [simulate(tr.with_predictions(t, a, seed=1), 12, warmup_steps=8, prefetch=True)
             for a in (0.6, 0.95)]
    assert base < rates[0]["hit_rate"] < rates[1]["hit_rate"]
    assert rates[1]["prefetch_wasted"] < rates[0]["prefetch_wasted"]
    assert math.isclose(rates[0]["hits"] / (rates[0]["hits"] + rates[0]["misses"]),
                        rates[0]["hit_rate"])
