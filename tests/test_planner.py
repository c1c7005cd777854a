"""The planner's reference model (the specification), its helpers, and Bank guards that need no GPU."""

import _planner_emu
import numpy as np
import pytest
import torch

from cupool import HostStore
from cupool.bank import Bank
from cupool.ops.planner import check_ids, launch_shape, ring_capacity, ring_order
from cupool.reference.planner import (
    COUNTERS,
    HITS,
    MISSES,
    PROMOTIONS,
    STAGED,
    STEALS,
    PlanError,
    Policy,
    ReferencePlanner,
    check_tables,
    default_promote,
    initial_placement,
    lru_order,
)


def fresh(L=2, E=4, N=2, S=8, initial=None, open_gate=True):
    p = ReferencePlanner(L, E, N, S, initial)
    if open_gate:
        p.open()
    return p


# --- initial placement ---------------------------------------------------------------------------

def test_initial_placement_default_and_given():
    p = ReferencePlanner(3, 5, 2, 4)
    np.testing.assert_array_equal(p.key_of, [0, 1, 5, 6, 10, 11])
    assert p.slot_of.tolist() == [0, 1, -1, -1, -1, 2, 3, -1, -1, -1, 4, 5, -1, -1, -1]
    assert p.clock == 0 and not p.gate and p.error == PlanError.NONE
    assert (p.last_use == 0).all() and (p.counters == 0).all()
    assert p.counters.shape == (3, len(COUNTERS))

    q = ReferencePlanner(2, 5, 2, 4, initial=[[4, 2], [-1, 0]])
    np.testing.assert_array_equal(q.key_of, [4, 2, -1, 5])
    assert q.slot_of[4] == 0 and q.slot_of[2] == 1 and q.slot_of[5] == 3
    assert (q.slot_of >= 0).sum() == 3 and q.check() == []


def test_initial_placement_more_rows_than_experts_leaves_rows_empty():
    key_of = initial_placement(2, 3, 5)
    np.testing.assert_array_equal(key_of, [0, 1, 2, -1, -1, 3, 4, 5, -1, -1])


@pytest.mark.parametrize("initial,err,match", [
    ([[0, 1]], ValueError, "shape"),
    ([[0, 5], [0, 1]], ValueError, r"initial\[0, 1\] = 5"),
    ([[0, -2], [0, 1]], ValueError, "-1"),
    ([[3, 3], [0, 1]], ValueError, "expert 3 in more than one row"),
    ([[0.0, 1.0], [0, 1]], TypeError, "integer"),
])
def test_initial_placement_rejects(initial, err, match):
    with pytest.raises(err, match=match):
        initial_placement(2, 5, 2, np.array(initial))


def test_constructor_rejects_bad_sizes():
    for bad in ({"num_layers": 0}, {"num_experts": -1}, {"rows_per_layer": 1.5},
                {"staging_rows": -1}):
        args = {"num_layers": 2, "num_experts": 4, "rows_per_layer": 2, "staging_rows": 4, **bad}
        with pytest.raises(ValueError, match=next(iter(bad))):
            ReferencePlanner(**args)


# --- the step ------------------------------------------------------------------------------------

def test_gate_closed_stages_misses_and_moves_nothing():
    p = fresh(open_gate=False)            # L=2 E=4 N=2 -> R=4; layer 0 holds experts 0,1
    before = p.state()
    routes, copies = p.step(0, [3, 0, 2, 3, -1])
    assert routes.dtype == np.int32
    assert routes.tolist() == [4, 0, 5, 4, -1]           # staging rows R+0, R+1 in miss order
    assert copies == [(3, 4), (2, 5)]
    after = p.state()
    for k in before:
        np.testing.assert_array_equal(before[k], after[k], err_msg=k)   # nothing moved


def test_hits_stamp_recency_and_clock():
    p = fresh()
    routes, copies = p.step(1, [1, 0, 1])
    assert routes.tolist() == [3, 2, 3] and copies == []
    assert p.clock == 1 and p.last_use.tolist() == [0, 0, 1, 1]
    assert p.counters[1].tolist() == [2, 0, 0, 0, 0]
    p.step(0, [-1])                                       # an all-padding step still ticks
    assert p.clock == 2 and p.last_use.tolist() == [0, 0, 1, 1]


def test_miss_takes_least_recently_used_row_of_any_layer():
    p = fresh()                                           # rows: 0:(0,0) 1:(0,1) 2:(1,0) 3:(1,1)
    p.step(0, [0, 1])                                     # clock 1: rows 0, 1
    p.step(1, [0])                                        # clock 2: row 2
    routes, copies = p.step(0, [2])                       # clock 3: LRU is row 3 (layer 1)
    assert routes.tolist() == [3] and copies == [(2, 3)]
    assert p.key_of.tolist() == [0, 1, 4, 2]
    assert p.slot_of[5] == -1 and p.slot_of[2] == 3       # (1,1) lost its row to (0,2)
    assert p.last_use.tolist() == [1, 1, 2, 3]
    assert p.counters[0].tolist() == [2, 1, 1, 1, 0]      # hits, misses, promotions, steals
    # layer 1's next miss takes the oldest row with ties broken by row index: rows 0, 1 (clock 1)
    routes, copies = p.step(1, [3, 1])
    assert routes.tolist() == [0, 1] and copies == [(7, 0), (5, 1)]
    assert p.counters[1].tolist() == [1, 2, 2, 2, 0]
    assert p.check() == []


def test_own_layer_victim_is_not_a_steal():
    p = fresh(L=1, E=6, N=2)
    p.step(0, [4])
    assert p.counters[0, STEALS] == 0 and p.counters[0, PROMOTIONS] == 1


def test_duplicates_and_padding():
    p = fresh(L=1, E=6, N=3)
    routes, copies = p.step(0, [5, -1, 5, 2, 2, 0, -1, 4, 5])
    # unique in first-occurrence order: 5 (miss), 2 (hit), 0 (hit), 4 (miss)
    # hits stamp rows 2, 0; 5 takes row 1, the only row left, and 4 is staged in row R + 0 = 3
    assert routes.tolist() == [1, -1, 1, 2, 2, 0, -1, 3, 1]
    assert copies == [(5, 1), (4, 3)]
    assert p.counters[0].tolist() == [2, 2, 1, 0, 1]


def test_invalid_ids_set_sticky_error_and_are_padding():
    p = fresh(L=1, E=4, N=2)
    routes, copies = p.step(0, np.array([4, 1, -2, 2**40, 0], dtype=np.int64))
    assert routes.tolist() == [-1, 1, -1, -1, 0] and copies == []
    assert p.error == PlanError.BAD_ID
    assert p.counters[0, HITS] == 2
    p.step(0, [0, 1])
    assert p.error == PlanError.BAD_ID                    # sticky


def test_rows_used_in_a_step_are_never_evicted():
    p = fresh(L=1, E=8, N=3)
    p.step(0, [2])                                        # row 2 newest; rows 0, 1 oldest
    routes, copies = p.step(0, [0, 7, 1, 6])
    # hits 0, 1 are stamped before the misses: 7 takes row 2, 6 finds no victim and is staged
    assert routes.tolist() == [0, 2, 1, 3]
    assert copies == [(7, 2), (6, 3)]
    assert p.slot_of[6] == -1 and p.key_of.tolist() == [0, 1, 7]


def test_no_victim_stages_with_gate_open_and_overflow_is_flagged():
    p = fresh(L=1, E=8, N=2, S=1)
    routes, copies = p.step(0, [0, 1, 2, 3])
    assert routes.tolist() == [0, 1, 2, -1]
    assert copies == [(2, 2)]
    assert p.error == PlanError.STAGING_OVERFLOW
    assert p.counters[0].tolist() == [2, 2, 0, 0, 1]      # the overflowed miss is only a miss
    assert p.slot_of[2] == -1 and p.slot_of[3] == -1
    q = fresh(L=1, E=8, N=2, S=2, open_gate=False)
    routes, copies = q.step(0, [5, 6, 7])
    assert routes.tolist() == [2, 3, -1] and copies == [(5, 2), (6, 3)]
    assert q.error == PlanError.STAGING_OVERFLOW and (q.counters == 0).all()


def test_counters_only_count_with_gate_open():
    p = fresh(open_gate=False)
    p.step(0, [0, 3])
    assert (p.counters == 0).all()
    p.open()
    p.step(0, [0, 3])
    assert p.counters[0].tolist() == [1, 1, 1, 0, 0]


def test_empty_rows_are_victims_without_a_previous_owner():
    p = fresh(L=1, E=2, N=4)                              # rows 2, 3 empty
    routes, copies = p.step(0, [1, 0])
    assert routes.tolist() == [1, 0] and copies == []
    # an empty row is not preferred: it is a victim by its (last_use, row) like any other
    q = ReferencePlanner(2, 2, 3, 4, initial=[[0, -1, -1], [0, 1, -1]])
    q.open()
    routes, copies = q.step(0, [1])
    assert routes.tolist() == [0] and copies == [(1, 0)]   # row 0 (0, 0) beats empty row 1
    r = ReferencePlanner(2, 2, 3, 4, initial=[[0, -1, -1], [0, 1, -1]])
    r.open()
    r.step(0, [0])                                        # row 0 used: row 1 (empty) is the LRU
    routes, copies = r.step(0, [1])
    assert routes.tolist() == [1] and copies == [(1, 1)]
    assert r.counters[0].tolist() == [1, 1, 1, 0, 0]      # no previous owner: not a steal
    assert r.key_of.tolist() == [0, 1, -1, 2, 3, -1]


def test_step_argument_errors():
    p = fresh()
    with pytest.raises(IndexError, match="layer"):
        p.step(2, [0])
    with pytest.raises(TypeError, match="integers"):
        p.step(0, np.array([0.5]))


def test_state_and_load_round_trip(rng):
    p = fresh(L=3, E=5, N=2)
    for _ in range(20):
        p.step(int(rng.integers(3)), rng.integers(-1, 5, size=6))
    q = ReferencePlanner(3, 5, 2, 8)
    q.load(p.state())
    for _ in range(20):
        layer, ids = int(rng.integers(3)), rng.integers(-1, 5, size=6)
        a, b = p.step(layer, ids), q.step(layer, ids)
        np.testing.assert_array_equal(a[0], b[0])
        assert a[1] == b[1]


# --- long random traces ----------------------------------------------------------------------------

def random_ids(rng, E, W, hot):
    """Skewed routing with duplicates, padding and the odd invalid id."""
    ids = rng.choice(E, size=W, p=hot)
    ids[rng.random(W) < 0.1] = -1
    bad = rng.random(W) < 0.01
    ids[bad] = rng.choice([E, E + 3, -2, -7], size=int(bad.sum()))
    return ids


def hot_distribution(rng, E):
    w = 1.0 / (1.0 + np.arange(E)) ** 1.1
    return w[rng.permutation(E)] / w.sum()


@pytest.mark.parametrize("L,E,N,S", [(5, 13, 3, 64), (3, 7, 2, 3), (4, 20, 6, 8), (1, 4, 8, 2)])
def test_long_random_trace_keeps_tables_consistent(rng, L, E, N, S):
    p = ReferencePlanner(L, E, N, S)
    R = p.num_rows
    hot = [hot_distribution(rng, E) for _ in range(L)]
    for i in range(1500):
        if rng.random() < (0.02 if p.gate else 0.1):
            p.open() if not p.gate else p.close()
        layer = int(rng.integers(L))
        ids = random_ids(rng, E, int(rng.integers(1, 40)), hot[layer])
        before = p.state()
        routes, copies = p.step(layer, ids)
        assert p.check() == [], f"step {i}: {p.check()}"
        keys = layer * E + ids
        valid = (ids >= 0) & (ids < E)
        for k, r in zip(keys[valid], routes[valid]):
            if r >= R:
                assert r < R + S and (k, r) in copies
            elif r >= 0:
                assert p.key_of[r] == k and p.slot_of[k] == r
        assert (routes[~valid] == -1).all()
        rows = [r for _, r in copies]
        assert len(set(rows)) == len(rows) and len(copies) <= ids.size
        if not p.gate:
            for name in ("slot_of", "key_of", "last_use", "counters"):
                np.testing.assert_array_equal(before[name], p.state()[name], err_msg=name)
        else:
            touched = np.flatnonzero(p.last_use == p.clock)
            # touched rows are exactly the bank rows this step routed to
            assert set(touched.tolist()) == set(routes[(routes >= 0) & (routes < R)].tolist())
    c = p.counters
    assert (c[:, MISSES] >= c[:, PROMOTIONS] + c[:, STAGED]).all()
    assert (c[:, PROMOTIONS] >= c[:, STEALS]).all()


# --- host steps: misses handed to the host's CPU, their copies behind the call ---------------------

def test_host_step_hands_the_last_promoted_misses_over():
    p = fresh(L=2, E=6, N=3, S=4)                # layer 0 holds experts 0, 1, 2; layer 1 too
    split = [0, 0, 1, 2, 2, 2, 2, 2]             # of M misses the host takes split[M]
    r = p.step_host(0, np.array([3, 0, 4, 3, -1, 5]), split)
    # misses 3, 4, 5 (M = 3) take the three LRU rows; the host takes the last two (4 and 5)
    assert [k for k, _ in r.copies] == [3] and [k for k, _ in r.behind] == [4, 5]
    assert r.routes.tolist() == [r.copies[0][1], p.slot_of[0], -1, r.copies[0][1], -1, -1]
    assert r.host_keys.tolist() == [-1, -1, 4, -1, -1, 5]
    behind_rows = [row for _, row in r.behind]
    assert p.pending[behind_rows].all() and p.pending.sum() == 2
    assert [p.slot_of[k] for k in (4, 5)] == behind_rows          # promoted: the tables hold them
    assert p.host_counters.tolist() == [2, 0] and p.counters[0, PROMOTIONS] == 3
    assert p.check() == []
    # a pending row is not a victim even when it is the oldest left; a hit on it is the host's
    p.step(1, [0, 1, 2])                         # layer 1's rows stamped newer than every other
    r2 = p.step_host(1, np.array([3, 4, 5]), [0, 0, 0, 0])
    victims = {row for _, row in r2.copies}
    assert not victims & set(behind_rows) and r2.behind == []
    r3 = p.step_host(0, np.array([4, -1]), [0, 0, 0])
    assert r3.routes.tolist() == [-1, -1] and r3.host_keys.tolist() == [4, -1]
    assert r3.copies == [] and r3.behind == [] and p.last_use[p.slot_of[4]] == p.clock
    # landed: ordinary rows again
    p.land()
    assert not p.pending.any()
    r4 = p.step_host(0, np.array([4]), [0, 1])
    assert r4.routes.tolist() == [p.slot_of[4]] and r4.host_keys.tolist() == [-1]


def test_host_step_with_the_gate_closed_or_capped_hands_over_only_promoted_misses():
    p = fresh(L=1, E=8, N=2, S=4, open_gate=False)
    r = p.step_host(0, np.array([5, 6]), [0, 1, 2])
    assert r.behind == [] and (r.host_keys == -1).all()             # no promotion: all staged
    assert [row for _, row in r.copies] == [2, 3] and not p.pending.any()
    p.open()
    p.policy = Policy(promote=1)
    r = p.step_host(0, np.array([5, 6, 7]), [0, 1, 2, 3])            # split 3, one promoted
    assert [k for k, _ in r.behind] == [5] and [k for k, _ in r.copies] == [6, 7]
    assert [row for _, row in r.copies] == [2, 3]                    # staging rows R + 0, R + 1


def test_host_step_leaving_the_host_misses_out_of_the_bank():
    p = fresh(L=2, E=6, N=3, S=4)                # layer 0 holds experts 0, 1, 2
    before = p.state()
    r = p.step_host(0, np.array([3, 0, 4, 3, -1, 5]), [0, 0, 1, 2, 2, 2, 2, 2], leave=True)
    # misses 3, 4, 5 (M = 3): the host takes the last two before any row is given; 3 takes one
    assert [k for k, _ in r.copies] == [3] and r.behind == []
    row3 = r.copies[0][1]
    assert r.routes.tolist() == [row3, p.slot_of[0], -1, row3, -1, -1]
    assert r.host_keys.tolist() == [-1, -1, 4, -1, -1, 5]
    assert p.slot_of[4] < 0 and p.slot_of[5] < 0 and not p.pending.any()
    # one row changed hands (to 3), the others are as they were; every miss counted
    changed = np.flatnonzero(p.key_of != before["key_of"])
    assert changed.tolist() == [row3]
    assert p.counters[0, MISSES] == 3 and p.counters[0, PROMOTIONS] == 1
    assert p.host_counters.tolist() == [2, 0] and p.check() == []
    # the cap counts the step's own misses alone: of misses 9, 10, 11 (experts 3, 4, 5 of layer
    # 1; expert 1 a hit) the host takes 11, the cap of 1 promotes 9 and stages 10
    p.policy = Policy(promote=1)
    r = p.step_host(1, np.array([3, 4, 5, 1]), [0, 0, 0, 1, 1], leave=True)
    assert [k for k, _ in r.copies] == [9, 10] and r.copies[1][1] == p.num_rows   # staging row
    assert r.host_keys.tolist() == [-1, -1, 11, -1] and p.counters[1, MISSES] == 3
    # gate closed: nothing is the host's, as a behind step
    p.close()
    r = p.step_host(0, np.array([4, 5]), [0, 1, 2], leave=True)
    assert (r.host_keys == -1).all() and len(r.copies) == 2


def test_host_step_leaving_out_equals_a_plain_step_without_those_lanes(rng):
    """A leave step moves the tables as a plain step of the same ids with the host's experts
    routed to padding (what `simulate_host_split(defer=False)` replays)."""
    L, E, N, S = 4, 20, 6, 64
    a, b = ReferencePlanner(L, E, N, S), ReferencePlanner(L, E, N, S)
    a.open()
    b.open()
    hot = [hot_distribution(rng, E) for _ in range(L)]
    for _ in range(600):
        layer = int(rng.integers(L))
        ids = random_ids(rng, E, int(rng.integers(1, 30)), hot[layer])
        split = np.array([int(rng.integers(0, m + 1)) for m in range(ids.size + 1)])
        r = b.step_host(layer, ids, split, leave=True)
        left = {int(k) - layer * E for k in r.host_keys if k >= 0}
        masked = np.where(np.isin(ids, list(left)), -1, ids)
        routes, copies = a.step(layer, masked)
        assert copies == r.copies and r.behind == []
        np.testing.assert_array_equal(np.where(r.host_keys >= 0, -1, routes), r.routes)
        for name in ("slot_of", "key_of", "last_use"):
            np.testing.assert_array_equal(a.state()[name], b.state()[name], err_msg=name)


@pytest.mark.parametrize("split,err,match", [
    ([0, 1], ValueError, "needs one for every miss count 0 ... 2"),
    ([0, 2, 1], ValueError, r"split\[1\] = 2 is not in \[0, 1\]"),
    ([0, -1, 0], ValueError, r"split\[1\] = -1"),
    (np.zeros(3), TypeError, "1-D integer array"),
])
def test_host_step_checks_split(split, err, match):
    with pytest.raises(err, match=match):
        fresh().step_host(0, np.array([0, 1]), split)


@pytest.mark.parametrize("L,E,N,S", [(5, 13, 3, 64), (3, 7, 2, 3), (4, 20, 6, 8)])
def test_host_steps_landed_each_time_evolve_as_plain_steps(rng, L, E, N, S):
    """Landed after every step, a host step moves the tables exactly as a plain step: its copies
    and behind lists together are the plain step's copy list (host rows taken out), and its
    routes are the plain routes with the host's lanes at −1."""
    a, b = ReferencePlanner(L, E, N, S), ReferencePlanner(L, E, N, S)
    hot = [hot_distribution(rng, E) for _ in range(L)]
    for i in range(800):
        if rng.random() < (0.02 if a.gate else 0.1):
            for p in (a, b):
                p.open() if not p.gate else p.close()
        layer = int(rng.integers(L))
        ids = random_ids(rng, E, int(rng.integers(1, 30)), hot[layer])
        split = np.array([int(rng.integers(0, m + 1)) for m in range(ids.size + 1)])
        if i % 7 == 0:
            a.policy = b.policy = Policy(promote=int(rng.integers(0, 4)))
        uniq = {layer * E + int(e) for e in ids if 0 <= e < E}
        M = sum(a.slot_of[k] < 0 for k in uniq)
        routes, copies = a.step(layer, ids)
        r = b.step_host(layer, ids, split)
        b.land()
        for name in ("slot_of", "key_of", "last_use", "counters"):
            np.testing.assert_array_equal(a.state()[name], b.state()[name], err_msg=name)
        host = set(k for k, _ in r.behind)
        assert [c for c in copies if c[0] not in host] == r.copies
        assert [c for c in copies if c[0] in host] == r.behind
        keys = layer * E + ids
        lane_host = np.isin(keys, list(host)) & (ids >= 0) & (ids < E)
        np.testing.assert_array_equal(r.routes, np.where(lane_host, -1, routes))
        np.testing.assert_array_equal(r.host_keys, np.where(lane_host, keys, -1))
        assert len(host) <= split[M]
    assert b.host_counters.sum() > 0 and a.counters[:, PROMOTIONS].sum() > 0


def test_pending_rows_survive_a_token_of_steps(rng):
    """Between landings no pending row is taken, however many later steps miss; the tables stay
    consistent and a pending row's key keeps its row."""
    p = ReferencePlanner(6, 16, 3, 64)
    p.open()
    for token in range(40):
        held = {}
        for layer in range(6):
            ids = rng.choice(16, size=8, replace=False)
            r = p.step_host(layer, ids, np.minimum(np.arange(9), 3))
            for k, row in r.behind:
                held[k] = row
            for k, row in held.items():
                assert p.slot_of[k] == row and p.pending[row]
            assert p.check() == []
        assert p.pending.sum() == len(held)
        p.land()


# --- the kernel's algorithm, modelled in NumPy -------------------------------------------------------

class KernelModel:
    """rawkernels/planner.cu's algorithm on the host: the LRU order is a ring of C entries whose
    window [head, head + span) holds every row once (and holes, −1). Victims are the first V
    window entries that are neither holes nor hit rows; the head moves to eligible entry V (or the
    whole window is compacted when the appends would not fit); touched rows are appended in row
    order and hits leave holes. It never reads last_use; the test proves it equals the reference
    (whose victim search is the definition).

    Prefetch mode (the PREFETCH build): `touched` = rows stamped by the last open tick, which are
    the window's last `touched` entries. A prefetch's eligible rows are the other non-hit
    entries, all of which come before them, so V = min(M, R − H − Y), Y = those tail entries
    that are not hits now, and the walk is the plan step's.

    Promotion cap `promote` (> 0, plan steps only): V = min(M, promote, R − H); the misses after
    the first V are staged as when no victim is left."""

    def __init__(self, ref: ReferencePlanner, C: int):
        self.L, self.E, self.R, self.S = (ref.num_layers, ref.num_experts, ref.num_rows,
                                          ref.staging_rows)
        st = ref.state()
        self.slot_of, self.key_of, self.last_use = st["slot_of"], st["key_of"], st["last_use"]
        self.C, self.head, self.span = C, 0, self.R
        self.ring = np.full(C, -1, dtype=np.int32)
        self.ring[:self.R] = st["order"]
        self.pos_of = np.empty(self.R, dtype=np.int32)
        self.pos_of[st["order"]] = np.arange(self.R)
        self.clock, self.gate, self.compactions = 0, False, 0
        self.touched = 0
        self.prefetched = np.zeros(self.R, dtype=bool)
        self.pf_counters = np.zeros((self.L, 3), dtype=np.int64)

    def order(self):
        order, problems = ring_order(self.ring, self.pos_of, self.head, self.span)
        assert problems == []
        return order

    def step(self, layer, ids, prefetch=False, promote=0):
        E, R, S, C = self.E, self.R, self.S, self.C
        ids = np.asarray(ids, dtype=np.int64)
        W = ids.size
        e = np.where((ids >= 0) & (ids < E), ids, -1)
        first_lane = {}
        for t in range(W):
            if e[t] >= 0:
                first_lane.setdefault(int(e[t]), t)
        now = self.clock + 1 if self.gate else self.clock
        route_of_lane = {}
        touched = np.zeros(R, dtype=bool)
        hit_pos, misses = [], []
        young_hits = 0
        for t in range(W):
            if e[t] >= 0 and first_lane[int(e[t])] == t:
                key = layer * E + int(e[t])
                slot = int(self.slot_of[key])
                if slot >= 0:
                    route_of_lane[t] = slot
                    if self.gate:
                        self.last_use[slot] = now
                        touched[slot] = True
                        hit_pos.append(int(self.pos_of[slot]))
                        young_hits += (hit_pos[-1] - self.head) % C >= self.span - self.touched
                        if self.prefetched[slot] and not prefetch:
                            self.prefetched[slot] = False
                            self.pf_counters[layer, 1] += 1
                else:
                    misses.append((key, t))
        H, M = int(touched.sum()), len(misses)
        young = self.touched - young_hits if prefetch else 0
        P = min(M, promote) if promote else M
        V = min(P, R - H - young) if self.gate else 0
        T = H + V
        compact = self.gate and T > 0 and self.span + T > C
        window = self.ring[(self.head + np.arange(self.span)) % C]
        eligible = np.flatnonzero((window >= 0) & ~touched[np.maximum(window, 0)])
        victims = window[eligible[:V]].tolist()
        if compact:                                   # eligible non-victims, back to back
            kept = window[eligible[V:]]
            p = (self.head + np.arange(kept.size)) % C
            self.ring[p], self.pos_of[kept] = kept, p
            self.compactions += 1
            new_head, n_kept = self.head, kept.size
        elif self.gate and T > 0:
            # with V = 0 the kernel skips the walk and cuts nothing
            cut = 0 if V == 0 else int(eligible[V]) if eligible.size > V else self.span
            new_head, n_kept = (self.head + cut) % C, self.span - cut
        copies = []
        for j, (key, t) in enumerate(misses):
            if j < V:
                row = victims[j]
                old = int(self.key_of[row])
                if old >= 0:
                    self.slot_of[old] = -1
                    if self.prefetched[row]:
                        self.pf_counters[old // E, 2] += 1
                self.prefetched[row] = prefetch
                self.slot_of[key], self.key_of[row], self.last_use[row] = row, key, now
                touched[row] = True
            else:
                row = R + (j - V) if j - V < S and not prefetch else -1
            route_of_lane[t] = row
            if row >= 0:
                copies.append((key, row))
        if self.gate and T > 0:
            if not compact:
                self.ring[hit_pos] = -1
            rows = np.flatnonzero(touched)
            p = (new_head + n_kept + np.arange(T)) % C
            self.ring[p], self.pos_of[rows] = rows, p
            self.head, self.span = new_head, n_kept + T
        if self.gate:
            self.touched = T
            if prefetch:
                self.pf_counters[layer, 0] += V
        routes = np.array([route_of_lane[first_lane[int(x)]] if x >= 0 else -1 for x in e],
                          dtype=np.int32)
        self.clock = now
        return routes, copies


def toggle_gate(rng, ref, model, p_close):
    """With probability p_close (gate open) or 0.1 (closed), the gate flips in the reference and
    the ring model alike."""
    if rng.random() < (p_close if ref.gate else 0.1):
        if ref.gate:
            ref.close()
        else:
            ref.open()
        model.gate = ref.gate


@pytest.mark.parametrize("L,E,N,S,C", [(5, 13, 3, 64, 16), (5, 13, 3, 64, 64), (2, 9, 4, 2, 8),
                                       (6, 30, 10, 16, 64), (6, 30, 10, 16, 128)])
def test_kernel_algorithm_equals_reference(rng, L, E, N, S, C):
    ref = ReferencePlanner(L, E, N, S)
    model = KernelModel(ref, C)
    hot = [hot_distribution(rng, E) for _ in range(L)]
    for i in range(1500):
        toggle_gate(rng, ref, model, 0.02)
        layer = int(rng.integers(L))
        ids = random_ids(rng, E, int(rng.integers(1, 50)), hot[layer])
        r1, c1 = ref.step(layer, ids)
        r2, c2 = model.step(layer, ids)
        np.testing.assert_array_equal(r1, r2, err_msg=f"routes, step {i}")
        assert c1 == c2, f"copies, step {i}"
        st = ref.state()
        for name, mine in (("slot_of", model.slot_of), ("key_of", model.key_of),
                           ("last_use", model.last_use), ("order", model.order())):
            np.testing.assert_array_equal(st[name], mine, err_msg=f"{name}, step {i}")
    if C < 2 * ref.num_rows:              # a tight ring: the trace must reach the rare path
        assert model.compactions > 0


@pytest.mark.parametrize("L,E,N,S,C", [(5, 13, 3, 64, 16), (5, 13, 3, 64, 64), (2, 9, 4, 2, 8),
                                       (6, 30, 10, 16, 128), (3, 40, 4, 16, 16)])
def test_kernel_algorithm_with_prefetch_equals_reference(rng, L, E, N, S, C):
    """Plan and prefetch steps mixed (predictions right and wrong, wide ones that run out of
    eligible rows): the ring with `touched` equals the reference's last_use rule."""
    ref = ReferencePlanner(L, E, N, S)
    model = KernelModel(ref, C)
    hot = [hot_distribution(rng, E) for _ in range(L)]
    prev = [np.zeros(0, np.int64)] * L
    kinds = [0, 0]
    for i in range(3000):
        toggle_gate(rng, ref, model, 0.01)
        layer = int(rng.integers(L))
        prefetch = bool(rng.random() < 0.5)
        if prefetch and rng.random() < 0.5:       # a prediction: the layer's last ids, mangled
            ids = prev[layer].copy()
            wrong = rng.random(ids.size) < 0.3
            ids[wrong] = rng.integers(-1, E, size=int(wrong.sum()))
        else:
            ids = random_ids(rng, E, int(rng.integers(1, 50)), hot[layer])
        if not prefetch:
            prev[layer] = ids
        kinds[prefetch] += ref.gate
        if prefetch:
            c1, (_, c2) = ref.prefetch(layer, ids), model.step(layer, ids, prefetch=True)
        else:
            (r1, c1), (r2, c2) = ref.step(layer, ids), model.step(layer, ids)
            np.testing.assert_array_equal(r1, r2, err_msg=f"routes, step {i}")
        assert c1 == c2, f"copies, step {i} (prefetch {prefetch})"
        st = {**ref.state(), **ref.prefetch_state()}
        for name, mine in (("slot_of", model.slot_of), ("key_of", model.key_of),
                           ("last_use", model.last_use), ("order", model.order()),
                           ("prefetched", model.prefetched),
                           ("prefetch_counters", model.pf_counters)):
            np.testing.assert_array_equal(st[name], mine, err_msg=f"{name}, step {i}")
    assert min(kinds) > 500 and ref.prefetch_counters[:, 0].sum() > 0
    assert ref.prefetch_counters[:, 1].sum() > 0 and ref.prefetch_counters[:, 2].sum() > 0
    if C < 2 * ref.num_rows:
        assert model.compactions > 0


@pytest.mark.parametrize("L,E,N,S,C", [(5, 13, 3, 64, 16), (6, 30, 10, 64, 128),
                                       (3, 40, 4, 64, 16), (4, 64, 32, 128, 256)])
def test_kernel_algorithm_with_promotion_cap_equals_reference(rng, L, E, N, S, C):
    """A cap drawn for each step (none, small, up to the step's width), prefetch steps mixed in
    (capped alike by their own max_rows): the ring model equals the reference's
    Policy(promote=...) and prefetch(..., max_rows)."""
    ref = ReferencePlanner(L, E, N, S)
    model = KernelModel(ref, C)
    hot = [hot_distribution(rng, E) for _ in range(L)]
    capped = 0
    for i in range(1500):
        toggle_gate(rng, ref, model, 0.01)
        layer = int(rng.integers(L))
        W = int(rng.integers(1, 64))
        ids = random_ids(rng, E, W, hot[layer])
        cap = int(rng.choice([0, 1, 2, 3, int(rng.integers(1, W + 1))]))
        ref.policy = Policy(promote=cap)
        if rng.random() < 0.2:
            c1, (_, c2) = ref.prefetch(layer, ids, cap), model.step(layer, ids, prefetch=True,
                                                                     promote=cap)
            assert not cap or len(c1) <= cap
        else:
            before = ref.counters[layer].copy()
            (r1, c1), (r2, c2) = ref.step(layer, ids), model.step(layer, ids, promote=cap)
            np.testing.assert_array_equal(r1, r2, err_msg=f"routes, step {i} (cap {cap})")
            d = ref.counters[layer] - before
            assert not cap or d[PROMOTIONS] <= cap
            capped += bool(cap and d[PROMOTIONS] == cap and d[STAGED] > 0)
        assert c1 == c2, f"copies, step {i} (cap {cap})"
        st = ref.state()
        for name, mine in (("slot_of", model.slot_of), ("key_of", model.key_of),
                           ("last_use", model.last_use), ("order", model.order())):
            np.testing.assert_array_equal(st[name], mine, err_msg=f"{name}, step {i}")
    assert capped > 100


# --- the promotion cap's settings ------------------------------------------------------------------

def test_default_promote():
    """No cap while a step's lanes fit a layer's rows (one stream never changes), a quarter of
    the rows (at least 1) past that."""
    assert default_promote(64, 8) == 0 and default_promote(64, 64) == 0
    assert default_promote(64, 65) == 16 and default_promote(64, 128) == 16
    assert default_promote(32, 128) == 8 and default_promote(3, 64) == 1
    assert default_promote(8, 0) == 0
    for args, match in (((0, 8), "rows_per_layer"), ((64, -1), "lanes"), ((1.5, 8), "rows_per"),
                        ((64, True), "lanes")):
        with pytest.raises(ValueError, match=match):
            default_promote(*args)


def test_promote_settings_are_checked():
    from cupool.bank import check_promote
    from cupool.ops.planner import PlanStep
    assert check_promote("auto") == "auto" and check_promote(0) == 0
    assert check_promote(np.int64(7)) == 7 and type(check_promote(np.int64(7))) is int
    for bad in (-1, 1.5, True, "8", "Auto", None, 2**31):
        with pytest.raises(ValueError, match=r"promote must be 'auto' or an int >= 0 .*got"):
            check_promote(bad)
    for bad in (-1, True, 2.0, "auto"):
        with pytest.raises(ValueError, match=r"promote must be an int >= 0 \(0: no cap\), got"):
            Policy(promote=bad)
    step = PlanStep.__new__(PlanStep)            # the launcher checks the cap before launching
    for bad in (-1, True, 2.0, "auto", 2**31):
        with pytest.raises(ValueError, match=r"promote must be an int >= 0 \(0: no cap\), got"):
            step(0, None, bad)


def test_bank_promotion_cap_on_cpu_tables(pageable_store):
    """The cap a Bank launches with: its setting, or "auto" from its rows and the step's lanes;
    a bad setting fails before anything is built or set."""
    with pytest.raises(ValueError, match="promote must be 'auto' or an int >= 0"):
        Bank(pageable_store, 2, 8, 8, promote=-3)
    b = Bank.__new__(Bank)
    b.rows_per_layer, b._promote = 8, 0
    assert b.promote == 0 and b.promotion_cap(64) == 0
    b.promote = "auto"
    assert [b.promotion_cap(w) for w in (1, 8, 9, 64)] == [0, 0, 2, 2]
    assert b._cap(torch.zeros(3, 4, dtype=torch.int64)) == 2     # W = numel: 12 lanes
    b.promote = 5
    assert b.promotion_cap(1) == 5
    with pytest.raises(ValueError, match="promote"):
        b.promote = "often"
    assert b.promote == 5


# --- helpers ---------------------------------------------------------------------------------------

def test_lru_order_ties_by_row():
    np.testing.assert_array_equal(lru_order(np.array([3, 1, 1, 0, 3])), [3, 1, 2, 0, 4])


def test_check_tables_reports_broken_states():
    p = fresh(L=2, E=4, N=2)
    st = p.state()
    assert check_tables(8, st["slot_of"], st["key_of"], st["last_use"], 0, st["order"]) == []
    slot_of = st["slot_of"].copy()
    slot_of[0] = 1
    probs = check_tables(8, slot_of, st["key_of"], st["last_use"], 0)
    assert any("slot_of[0] = 1" in s for s in probs)
    key_of = st["key_of"].copy()
    key_of[3] = 8
    assert any("key_of[3] = 8" in s for s in check_tables(8, st["slot_of"], key_of,
                                                          st["last_use"], 0))
    assert any("after clock" in s for s in check_tables(8, st["slot_of"], st["key_of"],
                                                        np.array([0, 5, 0, 0]), 1))
    assert any("LRU order" in s for s in check_tables(8, st["slot_of"], st["key_of"],
                                                      st["last_use"], 0, [1, 0, 2, 3]))


def test_launch_shape():
    assert launch_shape(12288, 64) == (128, 4)
    assert launch_shape(12288, 200) == (224, 4)
    assert launch_shape(15, 64) == (128, 1)
    assert launch_shape(300, 1024) == (1024, 1)


def test_ring_capacity_and_order():
    assert ring_capacity(12288) == 32768 and ring_capacity(15) == 32 and ring_capacity(16) == 32
    ring = np.array([-1, 3, 0, -1, 2, 1, -1, -1], dtype=np.int32)
    pos_of = np.array([2, 5, 4, 1], dtype=np.int32)
    order, problems = ring_order(ring, pos_of, 1, 5)      # window 1..5
    assert order.tolist() == [3, 0, 2, 1] and problems == []
    order, problems = ring_order(np.roll(ring, 3), (pos_of + 3) % 8, 4, 5)  # wraps past the end
    assert order.tolist() == [3, 0, 2, 1] and problems == []
    pos_of[2] = 7
    assert ring_order(ring, pos_of, 1, 5)[1] == ["ring[4] = 2 but pos_of[2] = 7"]
    assert "malformed" in ring_order(ring, pos_of, 1, 9)[1][0]
    assert "malformed" in ring_order(ring[:6], pos_of, 1, 3)[1][0]   # not a power of two


def test_check_ids_guards():
    dev = torch.device("cpu")
    assert check_ids(torch.zeros(2, 3, dtype=torch.int64), 8, dev) == 6
    assert check_ids(torch.zeros(0, dtype=torch.int32), 8, dev) == 0
    with pytest.raises(TypeError, match="torch tensor"):
        check_ids(np.zeros(3, dtype=np.int64), 8, dev)
    with pytest.raises(TypeError, match="int32 or int64"):
        check_ids(torch.zeros(3), 8, dev)
    with pytest.raises(ValueError, match="contiguous"):
        check_ids(torch.zeros(4, 4, dtype=torch.int32).t(), 64, dev)
    with pytest.raises(ValueError, match="max_lanes=8"):
        check_ids(torch.zeros(9, dtype=torch.int32), 8, dev)
    with pytest.raises(ValueError, match="device"):
        check_ids(torch.zeros(3, dtype=torch.int32), 8, torch.device("cuda", 0))


def test_plan_error_decodes():
    e = PlanError(3)
    assert PlanError.BAD_ID in e and PlanError.STAGING_OVERFLOW in e
    assert PlanError(0) == PlanError.NONE
    assert e.names() == ["BAD_ID", "STAGING_OVERFLOW"] and PlanError(0).names() == []


# --- Bank guards that fire before any GPU work ------------------------------------------------------

def test_device_tables_host_build():
    """The host tables' shapes and initial values (the kernel's HOST_SPLIT arguments), on the CPU;
    the PREFETCH and HOST_SPLIT tables are one or the other."""
    from cupool.ops.planner import DeviceTables
    t = DeviceTables.build(initial_placement(3, 5, 2), 3, 5, 8, "cpu", host=True)
    assert t.host and not t.prefetch
    assert t.split.shape == (9,) and t.split.dtype == torch.int32 and not t.split.any()
    assert t.pending.shape == (6,) and not t.pending.any()
    assert t.host_keys.shape == (8,) and t.host_keys.dtype == torch.int64
    assert t.behind.shape == (3, 8, 2) and t.n_behind.shape == (3,)    # a list a layer
    assert t.host_counters.shape == (3,)
    st = t.to_numpy()
    assert st["pending"].tolist() == [0] * 6 and st["host_counters"].tolist() == [0, 0, 0]
    plain = DeviceTables.build(initial_placement(3, 5, 2), 3, 5, 8, "cpu")
    assert not plain.host and "pending" not in plain.to_numpy()
    assert t.host_leave.shape == (1,) and not t.host_leave.any()
    assert t.nbytes() - plain.nbytes() == 9 * 4 + 4 + 6 * 4 + 3 * 8 + 8 * 8 + 3 * 16 * 4 + 3 * 4
    with pytest.raises(ValueError, match="separate planner builds"):
        DeviceTables.build(initial_placement(3, 5, 2), 3, 5, 8, "cpu", host=True, prefetch=True)


@pytest.fixture
def pageable_store():
    s = HostStore(2, 4, 256, pinned=False)
    yield s
    s.close()


def test_bank_guards_without_gpu(pageable_store):
    s = pageable_store
    with pytest.raises(TypeError, match="HostStore"):
        Bank(object(), 2, 8, 8)
    with pytest.raises(ValueError, match="copy_mode must be one of"):
        Bank(s, 2, 8, 8, copy_mode="dma")
    with pytest.raises(ValueError, match="rows_per_layer"):
        Bank(s, 0, 8, 8)
    with pytest.raises(ValueError, match=r"staging_rows \(S=4\) must be >= max_lanes \(8\)"):
        Bank(s, 2, 4, 8)
    with pytest.raises(ValueError, match="max_lanes must be <= 1024"):
        Bank(s, 2, 2048, 2048)
    with pytest.raises(ValueError, match="max_lanes"):
        Bank(s, 2, 8, 0)
    with pytest.raises(ValueError, match="shape"):
        Bank(s, 2, 8, 8, initial=[[0, 1]])
    with pytest.raises(ValueError, match="pinned"):
        Bank(s, 2, 8, 8)


# --- the real kernel source, run on CPU threads (tests/emu) ------------------------------------------

@pytest.fixture
def gxx():
    reason = _planner_emu.unavailable()
    if reason:
        pytest.skip(f"kernel source on CPU threads: {reason}")


@pytest.mark.parametrize("L,E,N,S,lanes,threads,items,steps,ring", [
    (5, 13, 3, 64, 64, 64, 1, 400, None),     # the GPU test's bank: one tile
    (5, 13, 3, 64, 64, 64, 1, 400, 16),       # a ring of 16 for 15 rows: compaction most steps
    (7, 40, 30, 64, 64, 64, 1, 300, None),    # R = 210: up to eight tiles of 64
    (7, 40, 30, 64, 64, 64, 2, 300, 256),     # ... and compaction over several tiles
    (3, 9, 2, 4, 64, 64, 2, 300, None),       # S < lanes: staging overflows
    (3, 5, 9, 64, 64, 64, 1, 200, 32),        # N > E: empty rows
    (48, 512, 256, 64, 64, 128, 4, 12, None), # the benchmark's shape and default block
])
def test_kernel_source_matches_reference_on_cpu_threads(gxx, rng, L, E, N, S, lanes, threads,
                                                         items, steps, ring):
    seed = int(rng.integers(2**31))
    flips = (0.7, 0.1) if steps < 50 else (0.1, 0.01)     # short runs: open the gate early
    assert _planner_emu.run(L, E, N, S, lanes, threads, items, steps, seed, p_flip=flips,
                            ring=ring) == steps


@pytest.mark.parametrize("L,E,N,S,lanes,threads,items,steps,ring", [
    (5, 17, 3, 64, 32, 32, 1, 10_000, None),  # 10,000 plan and prefetch steps; R = 15 < E = 17
    (7, 40, 30, 64, 64, 64, 1, 1500, 256),    # R = 210: several tiles, and compaction
    (3, 9, 2, 4, 64, 64, 2, 800, None),       # S < lanes, a tiny bank: predictions run out of rows
    (3, 5, 9, 64, 64, 64, 1, 600, 32),        # N > E: empty rows
    (48, 512, 256, 64, 64, 128, 4, 40, None), # the benchmark's shape and default block
])
def test_prefetch_build_matches_reference_on_cpu_threads(gxx, rng, L, E, N, S, lanes, threads,
                                                         items, steps, ring):
    """The PREFETCH build over plan steps each followed, half the time, by a prefetch of the next
    layer whose predictions are mostly right (its ids of the last step, 30% replaced) or
    random: routes, copy lists, tables, `touched`, flags and counters equal the reference's after
    every step, and a prefetch leaves the plan step's outputs alone."""
    seed = int(rng.integers(2**31))
    flips = (0.7, 0.1) if steps < 50 else (0.1, 0.01)
    rep = {}
    assert _planner_emu.run(L, E, N, S, lanes, threads, items, steps, seed, p_flip=flips,
                            ring=ring, prefetch=True, report=rep) == steps
    if steps >= 800:                      # the trace reached every path, or it proves little
        pc = rep["prefetch_counters"].sum(axis=0)
        assert rep["open_prefetches"] > steps // 5 and (pc > 0).all(), rep
        if E > N and L * N < 2 * lanes:   # a small bank: some predictions find no eligible row
            assert rep["skipped"] > 0, rep


@pytest.mark.parametrize("L,E,N,S,lanes,threads,items,steps,ring,prefetch", [
    (5, 17, 3, 64, 32, 32, 1, 10_000, None, False),  # 10,000 steps, a cap drawn for each
    (7, 40, 30, 64, 64, 64, 1, 1500, 256, False),     # R = 210: several tiles, and compaction
    (4, 64, 8, 128, 128, 128, 1, 1500, None, False),  # 16 x top-8 lanes over 8 rows a layer
    (3, 9, 2, 4, 64, 64, 2, 800, None, False),        # S < lanes: staging overflows
    (5, 17, 3, 64, 32, 32, 1, 2000, None, True),      # PREFETCH build: prefetches capped too
    (48, 512, 256, 64, 64, 128, 4, 40, None, False),  # the benchmark's shape and default block
])
def test_promotion_cap_matches_reference_on_cpu_threads(gxx, rng, L, E, N, S, lanes, threads,
                                                        items, steps, ring, prefetch):
    """Every launch gets a promotion cap (none, small, or up to the lanes; `random_caps`) and the
    reference the same `Policy(promote=...)`: routes, copy lists, tables and counters equal after
    every step, and the cap bound (misses staged while rows were left) on many of them."""
    seed = int(rng.integers(2**31))
    flips = (0.7, 0.1) if steps < 50 else (0.1, 0.01)
    rep = {}
    assert _planner_emu.run(L, E, N, S, lanes, threads, items, steps, seed, p_flip=flips,
                            ring=ring, prefetch=prefetch, promote="random", report=rep) == steps
    if steps >= 800:
        assert rep["capped"] > steps // 20, rep
        assert rep["counters"][:, PROMOTIONS].sum() > 0 and rep["counters"][:, STAGED].sum() > 0


@pytest.mark.parametrize("L,E,N,S,lanes,threads,items,steps,ring,promote", [
    (5, 17, 3, 64, 32, 32, 1, 10_000, None, 0),       # 10,000 steps; R = 15 < E = 17
    (5, 17, 3, 64, 32, 32, 1, 2000, 16, "random"),    # a ring of 16: compaction; caps drawn
    (7, 40, 30, 64, 64, 64, 1, 1500, 256, 0),         # R = 210: several tiles, and compaction
    (7, 40, 30, 64, 64, 64, 2, 1500, None, "random"), # ... and the promotion cap
    (3, 9, 2, 4, 64, 64, 2, 800, None, 0),            # S < lanes, a tiny bank: pending rows
                                                      # leave misses without a victim
    (48, 512, 256, 64, 64, 128, 4, 40, None, 0),      # the benchmark's shape and default block
])
def test_host_build_matches_reference_on_cpu_threads(gxx, rng, L, E, N, S, lanes, threads, items,
                                                     steps, ring, promote):
    """The HOST_SPLIT build over plan steps with random split tables, the host's misses promoted
    behind or left out of the bank, and landings between them: routes, copy lists, behind lists,
    host keys, pending flags, tables and counters equal `ReferencePlanner.step_host`'s after
    every step."""
    seed = int(rng.integers(2**31))
    flips = (0.7, 0.1) if steps < 50 else (0.1, 0.01)
    rep = {}
    assert _planner_emu.run(L, E, N, S, lanes, threads, items, steps, seed, p_flip=flips,
                            ring=ring, promote=promote, host=True, report=rep) == steps
    if steps >= 800:                      # the trace reached every path, or it proves little
        assert rep["behind"] > steps // 10 and rep["landings"] > steps // 10, rep
        assert rep["left"] > steps // 10 and rep["pending_hits"] > 0, rep
        if L * N < 2 * lanes:             # a small bank: pending rows starve some misses
            assert rep["starved"] > 0, rep


def test_emulation_rejects_a_bad_cap(gxx):
    with pytest.raises(ValueError, match="promote must be an int >= 0 or 'random'"):
        _planner_emu.run(5, 13, 3, 64, 64, 64, 1, 10, 1, promote=-1)


@pytest.mark.slow
def test_kernel_source_is_race_free_under_thread_sanitizer(gxx, rng):
    seed = int(rng.integers(2**31))
    assert _planner_emu.run(7, 40, 30, 64, 64, 64, 1, 150, seed, tsan=True) == 150


@pytest.mark.slow
def test_promotion_cap_is_race_free_under_thread_sanitizer(gxx, rng):
    seed = int(rng.integers(2**31))
    assert _planner_emu.run(7, 40, 30, 64, 64, 64, 1, 150, seed, tsan=True,
                            promote="random") == 150


@pytest.mark.slow
def test_host_build_is_race_free_under_thread_sanitizer(gxx, rng):
    seed = int(rng.integers(2**31))
    assert _planner_emu.run(7, 40, 30, 64, 64, 64, 1, 150, seed, tsan=True, host=True,
                            promote="random", p_flip=(0.7, 0.01)) == 150


@pytest.mark.slow
def test_prefetch_build_is_race_free_under_thread_sanitizer(gxx, rng):
    seed = int(rng.integers(2**31))
    assert _planner_emu.run(7, 40, 30, 64, 64, 64, 1, 150, seed, tsan=True, prefetch=True,
                            p_flip=(0.7, 0.01)) == 150


def test_emulation_reports_a_barrier_some_threads_skip(gxx):
    """The fiber emulation aborts on a __syncthreads that only part of the block reaches
    (on a GPU: a hang or undefined behaviour) instead of running on."""
    src = (_planner_emu.ROOT / "rawkernels" / "planner.cu").read_text()
    tag = "    __syncthreads();  // s_victim*"
    assert tag in src
    with pytest.raises(AssertionError, match="deadlock"):
        _planner_emu.run(5, 13, 3, 64, 64, 64, 1, 50, 1, p_flip=(1.0, 0.0),
                         source=src.replace(tag, "    if (threadIdx.x < 32) __syncthreads(); //", 1))


@pytest.mark.slow
def test_thread_sanitizer_catches_a_missing_barrier(gxx):
    src = (_planner_emu.ROOT / "rawkernels" / "planner.cu").read_text()
    tag = "__syncthreads();  // s_victim*"
    assert tag in src
    with pytest.raises(AssertionError, match="ThreadSanitizer|differ|Mismatch|timed out"):
        _planner_emu.run(5, 13, 3, 64, 64, 64, 1, 100, 1, tsan=True,
                         source=src.replace(tag, "// barrier removed:", 1))


def test_bank_host_side_methods_on_cpu_tables(pageable_store):
    """stats / memory_parts / state / gate / errors are plain torch ops: run them on CPU tables."""
    from cupool.ops.planner import DeviceTables
    L, E, N, S, W = 2, 4, 2, 8, 8
    key_of = initial_placement(L, E, N)
    b = Bank.__new__(Bank)
    b.store, b.num_layers, b.num_experts, b.rows_per_layer = pageable_store, L, E, N
    b.num_rows, b.staging_rows, b.max_lanes = L * N, S, W
    b.row_bytes, b.row_stride = pageable_store.row_bytes, pageable_store.row_stride
    b.tables = t = DeviceTables.build(key_of, L, E, W, "cpu")
    b.slot_of, b.key_of, b.counters, b.error, b.gate = t.slot_of, t.key_of, t.counters, t.error, t.gate
    b.src_of_key = torch.zeros(L * E, dtype=torch.int64)
    ref = ReferencePlanner(L, E, N, S)
    st = b.state()
    for k, v in ref.state().items():
        np.testing.assert_array_equal(st[k], v, err_msg=k)
    assert t.routes.shape == (W,) and t.copies.shape == (W, 2) and t.lane_addr.dtype == torch.int64
    b.open(verify=False)
    assert b.state()["gate"] == 1
    b.close()
    assert b.state()["gate"] == 0
    t.counters[1] = torch.tensor([6, 2, 1, 1, 1])
    t.key_of[0] = 5                                       # layer 1 now owns 3 rows
    rows, text = b.stats()
    assert rows[1] == {"layer": 1, "hits": 6, "misses": 2, "promotions": 1, "steals": 1,
                       "staged": 1, "hit_rate": 0.75, "rows_owned": 3, "bytes_copied": 2 * 256}
    assert rows[0]["rows_owned"] == 1 and np.isnan(rows[0]["hit_rate"])
    assert "hit rate" in text and text.splitlines()[-1].split()[0] == "all"
    t.error.fill_(3)
    assert b.read_error() == PlanError.BAD_ID | PlanError.STAGING_OVERFLOW
    b.clear_error()
    assert b.read_error() == PlanError.NONE
    b.reset_stats()
    assert (t.counters == 0).all()
    parts = dict((name, (n, where)) for name, n, where in b.memory_parts())
    assert parts["bank"] == (L * N * 256, "gpu") and parts["staging"] == (S * 256, "gpu")
    assert parts["planner tables"][0] == t.nbytes() + L * E * 8
    assert parts["host store"] == (pageable_store.nbytes, "host")


def test_prefetch_tables_and_bank_stats_on_cpu_tables(pageable_store):
    """The prefetch tables (DeviceTables.build(prefetch=True)): their state under the reference's
    names, their bytes, and a prefetching bank's stats and reset."""
    from cupool.ops.planner import DeviceTables
    L, E, N, S, W = 2, 4, 2, 8, 8
    key_of = initial_placement(L, E, N)
    plain = DeviceTables.build(key_of, L, E, W, "cpu")
    t = DeviceTables.build(key_of, L, E, W, "cpu", prefetch=True)
    assert not plain.prefetch and plain.pf_flag is None and t.prefetch
    assert t.nbytes() == plain.nbytes() + 4 + 4 * L * N + 8 * L * 3 + 8 * W + 4
    ref = ReferencePlanner(L, E, N, S)
    st = t.to_numpy()
    for k, v in {**ref.state(), **ref.prefetch_state()}.items():
        np.testing.assert_array_equal(st[k], v, err_msg=k)
    assert st["touched"] == 0 and "touched" not in plain.to_numpy()
    b = Bank.__new__(Bank)
    b.store, b.num_layers, b.num_experts, b.rows_per_layer = pageable_store, L, E, N
    b.num_rows, b.staging_rows, b.max_lanes = L * N, S, W
    b.row_bytes, b.row_stride = pageable_store.row_bytes, pageable_store.row_stride
    b.tables = t
    b.slot_of, b.key_of, b.counters, b.error, b.gate = t.slot_of, t.key_of, t.counters, t.error, t.gate
    assert b.prefetching
    t.pf_counters[1] = torch.tensor([5, 3, 1])
    rows, text = b.stats()
    assert {k: rows[1][k] for k in ("prefetched", "prefetch_used", "prefetch_wasted",
                                    "bytes_prefetched")} == \
        {"prefetched": 5, "prefetch_used": 3, "prefetch_wasted": 1, "bytes_prefetched": 5 * 256}
    assert text.splitlines()[-1].startswith("prefetch: 5 rows") and "1 waiting" in text
    b.reset_stats()
    assert (t.pf_counters == 0).all()
