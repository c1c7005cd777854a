"""Eviction policies, prefetch (the reference planner's model of both) and traces with predicted
ids (CPU)."""

import math

import numpy as np
import pytest

from cupool import trace as tr
from cupool.reference.planner import LRU, PlanError, Policy, ReferencePlanner
from cupool.simulate import simulate, simulate_opt


# --- policies --------------------------------------------------------------------------------------
def test_lfru_weight_zero_is_lru():
    t = tr.synthetic(40, 6, 16, 2, seed=3, **tr.QWEN3_LOCALITY)
    a = simulate(t, 5, warmup_steps=4)
    b = simulate(t, 5, warmup_steps=4, policy=Policy("lfru", weight=0.0, half_life=10.0))
    assert (a["hits"], a["misses"]) == (b["hits"], b["misses"])
    assert simulate(t, 5, warmup_steps=4, policy=LRU)["hits"] == a["hits"]


def test_offline_optimum_on_a_known_sequence():
    # one layer, experts A B C = 0 1 2, two rows holding A and B: A B C A B. LRU evicts A for C,
    # then B for A, then C for B (2 hits); the optimum evicts B for C (A comes back first), then
    # keeps A, and B's miss evicts C, needed never again (3 hits).
    t = tr.Trace(np.array([0, 1, 2, 0, 1]).reshape(5, 1, 1, 1), 3)
    assert (simulate(t, 2)["hits"], simulate(t, 2)["misses"]) == (2, 3)
    assert simulate_opt(t, 2) == {"hit_rate": 0.6, "hits": 3, "misses": 2}
    assert simulate_opt(t, 2, warmup_steps=2) == {"hit_rate": 1 / 3, "hits": 1, "misses": 2}


@pytest.mark.parametrize("kind,rows", [("locality", 4), ("locality", 9), ("uniform", 6),
                                       ("skewed", 5)])
def test_offline_optimum_bounds_every_policy(kind, rows):
    """No policy beats the optimum (it knows the future); with every expert banked it misses
    nothing; the same distinct ids are counted."""
    E, K = 16, 3
    t = (tr.uniform(60, 5, E, K, seed=2) if kind == "uniform" else
         tr.synthetic(60, 5, E, K, seed=2, **(tr.QWEN3_LOCALITY if kind == "locality" else
                                               dict(reuse_next=0.2, reuse_window=0.4, skew=1.0))))
    opt = simulate_opt(t, rows, warmup_steps=6)
    for pol in (LRU, Policy("lfru", weight=20.0, half_life=40.0),
                Policy("lfru", weight=20.0, half_life=40.0, protect=5.0)):
        r = simulate(t, rows, warmup_steps=6, policy=pol)
        assert r["hits"] + r["misses"] == opt["hits"] + opt["misses"]
        assert opt["hits"] >= r["hits"], (pol.describe(), opt, r)
    assert simulate_opt(t, E)["misses"] == 0


def test_offline_optimum_stages_what_the_bank_cannot_hold():
    """A call of more distinct experts than the bank's rows: the ones past them are misses that
    take no row (staged), and the run goes on."""
    t = tr.Trace(np.array([[0, 1], [2, 3], [0, 1], [2, 3]]).reshape(2, 1, 2, 2), 4)
    r = simulate_opt(t, 2)
    assert r["hits"] + r["misses"] == 8 and r["hits"] >= 2
    with pytest.raises(ValueError, match="rows_per_layer must be an int in"):
        simulate_opt(t, 1)
    with pytest.raises(ValueError, match="warmup_steps must be"):
        simulate_opt(t, 2, warmup_steps=2)


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
    p.step(0, [0, 1])                                 # tick 1: rows 0, 1
    copies = p.prefetch(1, [5, 0])                    # tick 2: 0 is resident, 5 is not
    assert [k for k, _ in copies] == [8 + 5]
    row = copies[0][1]
    assert row == 3 and p.key_of[row] == 13 and p.prefetched[row]   # row 2 holds (1, 0): a hit
    assert p.clock == 2 and p.last_use.tolist() == [1, 1, 2, 2]     # stamped: the LRU tail
    assert p.counters.sum() == 2                      # a prefetch counts no hits or misses
    _, c2 = p.step(1, [5, 0])                         # 5: a hit now, no copy
    assert c2 == [] and p.counters[1].tolist() == [2, 0, 0, 0, 0]
    assert p.prefetch_counters[1].tolist() == [1, 1, 0]
    assert not p.prefetched.any()
    assert p.check() == []


def test_prefetch_never_takes_a_row_of_the_step_before_it():
    p = ReferencePlanner(2, 8, 2, 4)                  # rows 0, 1: layer 0; rows 2, 3: layer 1
    p.open()
    p.step(0, [0, 1])                                 # tick 1: rows 0, 1 (their GEMM may run)
    copies = p.prefetch(1, [2, 3, 4])                 # tick 2: eligible rows: last_use < 1
    assert copies == [(10, 2), (11, 3)]               # 4 is skipped: rows 0, 1 are not eligible
    assert p.slot_of[12] == -1 and p.error == 0
    _, c = p.step(0, [5])                             # a step may take them (tick 3: LRU row 0)
    assert c == [(5, 0)]


def test_every_row_is_eligible_at_the_first_tick():
    p = ReferencePlanner(1, 8, 2, 4)
    p.open()
    assert p.prefetch(0, [5, 6, 7]) == [(5, 0), (6, 1)]   # clock 0 -> 1: nothing was used
    assert p.prefetch_counters[0].tolist() == [2, 0, 0]


def test_wrong_prediction_is_evicted_last_and_counted_wasted():
    p = ReferencePlanner(1, 8, 4, 4)                  # rows hold 0, 1, 2, 3
    p.open()
    p.step(0, [0])                                    # tick 1: row 0
    (k, row), = p.prefetch(0, [7])                    # tick 2: wrong; takes row 1 (LRU)
    assert (k, row) == (7, 1)
    _, c = p.step(0, [4, 5])                          # tick 3: rows 2, 3 go first (older)
    assert [r for _, r in c] == [2, 3] and p.key_of[row] == 7
    _, c = p.step(0, [6])                             # tick 4: row 0 (tick 1) before row 1 (2)
    assert c == [(6, 0)]
    _, c = p.step(0, [2])                             # tick 5: now the prefetched row goes
    assert c == [(2, 1)]
    assert p.prefetch_counters[0].tolist() == [1, 0, 1]


def test_predicted_resident_row_is_restamped_and_keeps_its_mark():
    p = ReferencePlanner(1, 8, 3, 4)
    p.open()
    (_, row), = p.prefetch(0, [5])                    # tick 1: row 0
    p.step(0, [1])                                    # tick 2
    assert p.prefetch(0, [5, 5, -1]) == []            # tick 3: a hit: stamped, still marked
    assert p.last_use[row] == 3 and p.prefetched[row]
    p.step(0, [5])
    assert p.prefetch_counters[0].tolist() == [1, 1, 0]


def test_prefetch_with_gate_closed_or_no_victim_does_nothing():
    p = ReferencePlanner(1, 8, 2, 4)
    before = p.state()
    assert p.prefetch(0, [5, 9]) == []                # gate closed: no copies, no tick ...
    assert p.error == PlanError.BAD_ID                # ... but a bad id is flagged, as a step does
    for name in ("slot_of", "key_of", "last_use", "clock", "counters"):
        np.testing.assert_array_equal(p.state()[name], before[name], err_msg=name)
    p.error = PlanError.NONE
    p.open()
    p.step(0, [0, 1])                                 # tick 1: every row
    assert p.prefetch(0, [5]) == []                   # tick 2: no eligible row: skipped, not staged
    assert p.prefetch_counters.sum() == 0 and p.error == 0 and p.clock == 2
    with pytest.raises(IndexError):
        p.prefetch(3, [1])
    with pytest.raises(TypeError):
        p.prefetch(0, np.array([1.5]))


def test_prefetch_random_steps_keep_routes_right():
    """10,000 layer steps, each followed by a prefetch of the next layer with random predictions
    (right and wrong, out-of-range ids too): every route is a row holding the lane's key (or a
    staging row this step), the tables stay a bijection, a prefetch's victims are eligible, and
    the counters add up."""
    rng = np.random.default_rng(5)
    L, E, N, S, K = 4, 12, 4, 8, 3
    p = ReferencePlanner(L, E, N, S)
    p.open()
    for i in range(10_000):
        layer = i % L
        ids = rng.choice(E, size=K, replace=False)
        ids[rng.random(K) < 0.05] = -1
        routes, copies = p.step(layer, ids)
        for e, r in zip(ids, routes):
            if e < 0:
                assert r == -1
            elif r < p.num_rows:
                assert p.key_of[r] == layer * E + e
            else:
                assert (layer * E + e, r) in copies   # staged for this step
        nxt = (layer + 1) % L
        right = rng.random(K) < 0.7                   # about 70% of the predictions right
        pred = np.where(right, ids, rng.integers(-1, E + 2, size=K))
        last_before, clock_before = p.last_use.copy(), p.clock
        pf = p.prefetch(nxt, pred if rng.random() < 0.5 else ids[::-1].copy())
        for k, r in pf:
            assert k // E == nxt and p.key_of[r] == k and p.prefetched[r]
            assert last_before[r] < max(clock_before, 1)
        if i % 500 == 0:
            assert p.check() == []
    assert p.check() == [] and p.error == PlanError.BAD_ID
    c = p.prefetch_counters
    assert (c[:, 0] > 0).all() and (c[:, 1] > 0).all() and (c[:, 2] > 0).all()
    assert c[:, 0].sum() == c[:, 1:].sum() + p.prefetched.sum()
    for layer in range(L):
        marked = p.prefetched & (p.key_of // E == layer) & (p.key_of >= 0)
        assert c[layer, 0] == c[layer, 1] + c[layer, 2] + marked.sum()


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


def test_a_prefetch_cap_bounds_the_rows_a_prefetch_brings_in():
    """prefetch_rows=1: at most one row a prefetch (L − 1 prefetches a step), fewer rows
    prefetched and more misses left than uncapped; a bad cap is refused."""
    L, S, W = 8, 60, 8
    t = tr.with_predictions(tr.streams(S, L, 32, 4, 1, seed=4, **tr.QWEN3_LOCALITY), 0.8, seed=1)
    full = simulate(t, 12, warmup_steps=W, prefetch=True)
    one = simulate(t, 12, warmup_steps=W, prefetch=True, prefetch_rows=1)
    assert one["prefetched"] <= (S - W) * (L - 1) < full["prefetched"]
    assert one["misses"] > full["misses"]
    with pytest.raises(ValueError, match="max_rows must be an int >= 0"):
        simulate(t, 12, prefetch=True, prefetch_rows=-1)


def test_a_promotion_cap_keeps_a_batch_from_evicting_the_whole_bank():
    """16 independent streams decoded together ask for more experts a step than a half bank
    holds: uncapped LRU evicts every row before its next use (hit rate ~0); capping a step's
    promotions (the rest staged) keeps a working set and hits again. A step never promotes more
    than the cap, and misses = promotions + staged."""
    from cupool import trace as tr
    from cupool.reference.planner import (MISSES, PROMOTIONS, STAGED, Policy, ReferencePlanner,
                                          default_promote)
    from cupool.simulate import simulate
    L, E, K, T = 4, 64, 8, 16
    t = tr.streams(40, L, E, K, T, seed=2, **tr.QWEN3_LOCALITY)
    plain = simulate(t, E // 2, policy=LRU)["hit_rate"]
    capped = simulate(t, E // 2, policy=Policy(promote=8))["hit_rate"]
    assert plain < 0.05 and capped > plain + 0.2, (plain, capped)
    # a pool's default (simulate's, policy=None) caps such a step: E // 2 rows, T·K lanes
    assert default_promote(E // 2, T * K) == 8
    assert simulate(t, E // 2)["hit_rate"] == capped
    ref = ReferencePlanner(L, E, E // 2, T * K, policy=Policy(promote=8))
    ref.open()
    for s in range(5):
        before = ref.counters.copy()
        ref.step(0, t.ids[s, 0].reshape(-1))
        d = ref.counters - before
        assert d[0, PROMOTIONS] <= 8
        assert d[0, MISSES] == d[0, PROMOTIONS] + d[0, STAGED]
    with pytest.raises(ValueError, match="promote"):
        Policy(promote=-1)


def test_host_split_picks_the_faster_share():
    from cupool.hostexperts import host_split
    # link 50 µs a row, CPU 40 + 10 of hand-off: one miss stays on the link (tie: 50 vs 50)
    assert host_split(0, 50, 40, 10) == 0
    assert host_split(1, 50, 40, 10) == 0
    assert host_split(2, 50, 40, 10) == 1          # max(50, 50) against 100
    assert host_split(3, 50, 40, 10) == 2          # max(50, 90) against max(100, 50)
    assert host_split(4, 50, 40, 10) == 2          # max(100, 90)
    assert host_split(3, 50, 1e9, 10) == 0         # a CPU slower than anything: the link alone
    assert host_split(2, 100, 10, 5) == 2          # a CPU much faster than the link takes all


def test_split_table():
    """The planner's table: host_split of every miss count (0 below min_misses), checked
    arguments."""
    from cupool.hostexperts import host_split, split_table
    t = split_table(8, 50, 40, 10)
    assert t.dtype == np.int64 and t.tolist() == [host_split(m, 50, 40, 10) for m in range(9)]
    assert t.tolist() == [0, 0, 1, 2, 2, 3, 3, 4, 4]
    assert (t >= 0).all() and (t <= np.arange(9)).all()
    assert split_table(3, 50, 1e9, 10).tolist() == [0, 0, 0, 0]
    assert split_table(8, 50, 40, 10, min_misses=5).tolist() == [0, 0, 0, 0, 0, 3, 3, 4, 4]
    assert split_table(8, 50, 40, 10, min_misses=0).tolist() == t.tolist()
    assert not split_table(8, 50, 40, 10, min_misses=9).any()
    for kw, match in ((dict(lanes=0), "lanes"), (dict(lanes=True), "lanes"),
                      (dict(cpu_us=0), "cpu_us must be > 0"), (dict(link_us=-1), "link_us"),
                      (dict(handoff_us=float("nan")), "handoff_us"),
                      (dict(min_misses=-1), "min_misses"), (dict(min_misses=2.0), "min_misses"),
                      (dict(min_misses=True), "min_misses")):
        a = dict(lanes=4, link_us=50.0, cpu_us=40.0, handoff_us=10.0)
        a.update(kw)
        with pytest.raises(ValueError, match=match):
            split_table(**a)


def test_simulate_host_split_counts_and_promotion():
    """Every counted distinct expert is a hit, a link row or a CPU row; with no CPU share the
    replay is the plain pool's (the same hit rate as `simulate`); deferred promotion keeps the
    bank as the plain pool's, and rows left out of it lower the hit rate; waited time is the sum
    of the calls' maxima."""
    from cupool.simulate import simulate_host_split
    t = tr.synthetic(96, 6, 32, 4, seed=3, **tr.QWEN3_LOCALITY)
    rows, warm = 12, 16
    plain = simulate(t, rows, warmup_steps=warm)
    none = simulate_host_split(t, rows, link_us=50, cpu_us=1e9, handoff_us=10, warmup_steps=warm)
    assert none["hit_rate"] == plain["hit_rate"]
    assert none["cpu_rows_per_token"] == 0
    assert none["link_rows_per_token"] * (96 - warm) == plain["misses"]
    assert abs(none["miss_ms_per_token"] - none["link_rows_per_token"] * 50 / 1e3) < 1e-9
    kept = simulate_host_split(t, rows, link_us=50, cpu_us=20, handoff_us=10, warmup_steps=warm)
    deferred = simulate_host_split(t, rows, link_us=50, cpu_us=20, handoff_us=10,
                                   warmup_steps=warm, defer=True)
    assert deferred["hit_rate"] == plain["hit_rate"]
    assert kept["hit_rate"] < plain["hit_rate"]
    for r in (kept, deferred):
        assert r["cpu_rows_per_token"] > 0
        assert r["miss_ms_per_token"] < none["miss_ms_per_token"]
        assert abs(sum(r["miss_histogram"].values()) - 1) < 1e-9
    # deferred: the link still carries every miss
    assert abs(deferred["link_busy_ms_per_token"] - none["link_busy_ms_per_token"]) < 1e-9
    # the timeline: without behind copies the link is free at every call's start, so a token is
    # the layers' rest plus the calls' waits; with them it is no shorter than either bound (the
    # rest plus the waits, the link's traffic) and the link's queue delays some calls
    L, rest = 6, 40.0
    for r0, defer in ((none, False), (kept, False), (deferred, True)):
        r = simulate_host_split(t, rows, link_us=50, cpu_us=20 if r0 is not none else 1e9,
                                handoff_us=10, warmup_steps=warm, defer=defer, rest_us=rest)
        assert {k: v for k, v in r.items() if k != "timeline_ms_per_token"} == r0
        floor = L * rest / 1e3 + r0["miss_ms_per_token"]
        if not defer:
            assert abs(r["timeline_ms_per_token"] - floor) < 1e-9
        else:
            assert r["timeline_ms_per_token"] >= max(floor, r0["link_busy_ms_per_token"]) - 1e-9
            assert r["timeline_ms_per_token"] > floor
    with pytest.raises(ValueError, match="rest_us"):
        simulate_host_split(t, rows, link_us=50, cpu_us=20, handoff_us=0, rest_us=-1)
    with pytest.raises(ValueError, match="cpu_us"):
        simulate_host_split(t, rows, link_us=50, cpu_us=-1, handoff_us=0)



def test_simulate_host_split_with_several_streams():
    """Several tokens a step: with no CPU share the replay is the plain pool's; rows left out of
    the bank spend less of the link than rows promoted behind, which carry every miss."""
    from cupool.simulate import simulate_host_split
    t = tr.streams(80, 6, 32, 4, 4, seed=1, **tr.QWEN3_LOCALITY)
    rows, warm = 16, 16          # a step's 16 lanes fit the rows: the pool's default is uncapped
    plain = simulate(t, rows, warmup_steps=warm)
    none = simulate_host_split(t, rows, link_us=50, cpu_us=1e9, handoff_us=10, warmup_steps=warm)
    assert none["hit_rate"] == plain["hit_rate"]
    assert none["link_rows_per_token"] * (80 - warm) == plain["misses"]
    left = simulate_host_split(t, rows, link_us=50, cpu_us=60, handoff_us=10, warmup_steps=warm)
    behind = simulate_host_split(t, rows, link_us=50, cpu_us=60, handoff_us=10,
                                 warmup_steps=warm, defer=True)
    assert left["cpu_rows_per_token"] > 0 and behind["cpu_rows_per_token"] > 0
    assert behind["hit_rate"] == plain["hit_rate"]
    assert abs(behind["link_busy_ms_per_token"] - none["link_busy_ms_per_token"]) < 1e-9
    assert left["link_busy_ms_per_token"] < none["link_busy_ms_per_token"]
