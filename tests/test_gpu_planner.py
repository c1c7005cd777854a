"""GPU checks of the planner: the plan-step kernel equals the reference after every step, the
rows it routes to hold the right bytes, graph replay equals eager launches, verify() finds damage;
the PREFETCH build over plan and prefetch steps mixed equals the reference after every step; with
a promotion cap (a fixed one, one drawn for each launch, or the pool's "auto") the kernel equals
the reference's `Policy(promote=...)`."""

import numpy as np
import pytest
import torch
from _planner_emu import fresh_lanes, random_caps, random_mixed_trace, random_trace

from cupool import HostStore
from cupool.bank import Bank, BankVerifyError
from cupool.ops.planner import ring_order
from cupool.reference.planner import (
    COUNTERS,
    PREFETCH_COUNTERS,
    PROMOTIONS,
    STAGED,
    PlanError,
    Policy,
    ReferencePlanner,
)

pytestmark = pytest.mark.gpu

POISON32, POISON64 = 0x5A5A5A5A, 0x5A5A5A5A5A5A5A5A


def make_store(rng, L, E, row_bytes):
    """A sealed pinned store of random rows, and the same bytes as a CUDA tensor [L*E, row_bytes]."""
    store = HostStore(L, E, row_bytes)
    data = rng.integers(0, 256, size=(L, E, row_bytes), dtype=np.uint8)
    store.fill(lambda layer: data[layer], progress=False)
    store.seal()
    return store, torch.from_numpy(data.reshape(L * E, row_bytes)).cuda()


class Harness:
    """A Bank and a ReferencePlanner driven in lockstep, compared with one host read per step.
    Each step the reference takes the cap the bank launches with (`Bank.promotion_cap`);
    `capped` counts open steps the cap bound (it promoted exactly the cap and staged the rest)."""

    def __init__(self, rng, L, E, N, S, lanes, row_bytes, promote=0, **shape):
        self.L, self.E, self.lanes = L, E, lanes
        self.store, self.expect = make_store(rng, L, E, row_bytes)
        self.bank = Bank(self.store, N, S, lanes, promote=promote, **shape)
        self.ref = ReferencePlanner(L, E, N, S)
        self.R = self.bank.num_rows
        self.capped = 0

    def set_gate(self, gate: int, verify: bool = False):
        if gate:
            self.bank.open(verify=verify)
            self.ref.open()
        else:
            self.bank.close()
            self.ref.close()

    def step_and_compare(self, layer: int, ids: np.ndarray, dtype: torch.dtype, where: str):
        b, t = self.bank, self.bank.tables
        W = ids.size
        t.routes.fill_(POISON32)
        t.lane_addr.fill_(POISON64)
        t.lane_fresh.fill_(POISON32)
        t.copies.fill_(POISON32)
        t.n_copies.fill_(POISON32)
        ids_dev = torch.from_numpy(ids).to(device="cuda", dtype=dtype)
        routes, addr = b.step(layer, ids_dev)
        assert routes.shape == (W,) and addr.shape == (W,)
        # the bytes every routed lane will read: its expert's host row (bank or staging row)
        r = routes.long()
        keys = (layer * self.E + ids_dev.long()).clamp(0, self.L * self.E - 1)
        got = b.rows[r.clamp(min=0), :b.row_bytes]
        bad_rows = ((got != self.expect[keys]).any(dim=1) & (r >= 0)).sum()
        parts = [t.slot_of, t.key_of, t.last_use, t.ring, t.pos_of, t.ends, t.clock, t.gate,
                 t.error, t.counters, routes, addr, t.lane_fresh[:W], t.n_copies, t.copies,
                 bad_rows]
        flat = torch.cat([p.reshape(-1).to(torch.int64) for p in parts]).cpu().numpy()
        sizes = [p.numel() for p in parts]
        got = dict(zip(["slot_of", "key_of", "last_use", "ring", "pos_of", "ends", "clock", "gate",
                        "error", "counters", "routes", "lane_addr", "lane_fresh", "n_copies",
                        "copies", "bad_rows"], np.split(flat, np.cumsum(sizes)[:-1])))
        head, span = (int(v) for v in got["ends"])
        assert 0 <= head < got["ring"].size and self.R <= span <= got["ring"].size, \
            f"ring head {head}, span {span}, {where}"
        got["order"], problems = ring_order(got["ring"], got["pos_of"], head, span)
        assert problems == [], f"{problems}, {where}"

        cap = b.promotion_cap(W)
        self.ref.policy = Policy(promote=cap)
        before = self.ref.counters[layer].copy()
        want_routes, want_copies = self.ref.step(layer, ids)
        d = self.ref.counters[layer] - before
        self.capped += bool(cap and d[PROMOTIONS] == cap and d[STAGED] > 0)
        where = f"{where}, cap {cap}"
        st = self.ref.state()
        for name in ("slot_of", "key_of", "last_use", "order"):
            np.testing.assert_array_equal(got[name], st[name], err_msg=f"{name}, {where}")
        for name in ("clock", "gate", "error"):
            assert int(got[name][0]) == st[name], f"{name}: {got[name][0]} != {st[name]}, {where}"
        np.testing.assert_array_equal(got["counters"].reshape(self.L, len(COUNTERS)),
                                      st["counters"], err_msg=f"counters, {where}")
        np.testing.assert_array_equal(got["routes"], want_routes, err_msg=f"routes, {where}")
        base, stride = b.rows.data_ptr(), b.row_stride
        want_addr = np.where(want_routes >= 0, base + want_routes.astype(np.int64) * stride, 0)
        np.testing.assert_array_equal(got["lane_addr"], want_addr, err_msg=f"lane_addr, {where}")
        n = int(got["n_copies"][0])
        assert n == len(want_copies), f"n_copies {n} != {len(want_copies)}, {where}"
        copies = got["copies"].reshape(-1, 2)[:n]
        assert [tuple(c) for c in copies.tolist()] == want_copies, f"copies, {where}"
        np.testing.assert_array_equal(got["lane_fresh"], fresh_lanes(want_routes, want_copies),
                                      err_msg=f"lane_fresh, {where}")
        assert int(got["bad_rows"][0]) == 0, f"{got['bad_rows'][0]} lanes read wrong bytes, {where}"
        return want_routes, want_copies

    def close(self):
        self.store.close()


def run_random(rng, h: Harness, steps: int, verify_every: int = 1000, p_flip=(0.1, 0.01),
               caps: list[int] | None = None):
    """`caps`: the bank's promotion cap for each step (default: the bank's setting throughout)."""
    trace = random_trace(rng, h.L, h.E, steps, h.lanes, p_flip)
    for i, (gate, layer, ids) in enumerate(trace):
        if gate != h.ref.gate:
            h.set_gate(gate, verify=i % 7 == 0)
        if caps is not None:
            h.bank.promote = caps[i]
        wide = np.any(np.abs(ids) > 2**31 - 1) or rng.random() < 0.5
        h.step_and_compare(layer, ids, torch.int64 if wide else torch.int32,
                           f"step {i} (layer {layer}, W={ids.size}, gate {gate}, ids {ids.tolist()})")
        if verify_every and i % verify_every == verify_every - 1:
            assert h.bank.verify() == int((h.ref.key_of >= 0).sum())
    return trace


def test_kernel_equals_reference_on_10000_random_steps(rng):
    # R = 15 < E = 17: a wide step can use every row, so the open gate also stages
    h = Harness(rng, L=5, E=17, N=3, S=64, lanes=64, row_bytes=4096 + 48)
    trace = run_random(rng, h, 10_000)
    c = h.ref.counters
    # the trace must have exercised every path, or the comparison proves little
    assert c[:, COUNTERS.index("steals")].sum() > 0 and c[:, COUNTERS.index("staged")].sum() > 0
    assert h.ref.error & PlanError.BAD_ID
    assert sum(g for g, _, _ in trace) > 5000
    h.close()


@pytest.mark.parametrize("L,E,N,threads,items,ring,steps", [
    (7, 40, 30, 64, 1, None, 2000),    # R = 210 in tiles of 64: the kernel's multi-tile loop
    (7, 40, 30, 64, 2, 256, 2000),     # ... with a tight ring: compaction over several tiles
    (5, 17, 3, None, None, 16, 2000),  # R = 15 in a ring of 16: compaction nearly every step
    (48, 512, 256, None, None, None, 300),  # the benchmark's shape with the default block
])
def test_kernel_equals_reference_other_shapes(rng, L, E, N, threads, items, ring, steps):
    h = Harness(rng, L, E, N, S=64, lanes=64, row_bytes=256, threads=threads, items=items,
                ring=ring)
    run_random(rng, h, steps, verify_every=100, p_flip=(0.3, 0.01))
    h.close()


@pytest.mark.parametrize("L,E,N,S,lanes,threads,items,ring,steps", [
    (5, 17, 3, 64, 64, None, None, None, 4000),      # R = 15 < E: caps bind, and rows run out
    (7, 40, 30, 128, 128, 128, 1, 256, 1500),        # R = 210 in tiles of 128, a tight ring
    (4, 64, 8, 128, 128, None, None, None, 1500),    # 16 x top-8 lanes over 8 rows a layer
    (48, 512, 256, 128, 128, None, None, None, 300),  # the benchmark's shape, wide steps
])
def test_kernel_with_promotion_cap_equals_reference(rng, L, E, N, S, lanes, threads, items, ring,
                                                    steps):
    """A cap drawn for each launch (none, 1 … 4, or up to the lanes; `random_caps`): tables,
    routes, copy lists, counters and the routed rows' bytes equal the reference's with the same
    `Policy(promote=...)` after every step, and the cap bound on many steps."""
    h = Harness(rng, L, E, N, S, lanes, row_bytes=1024 + 16, threads=threads, items=items,
                ring=ring)
    run_random(rng, h, steps, verify_every=500, p_flip=(0.3, 0.01),
               caps=random_caps(rng, steps, lanes))
    assert h.capped > steps // 20, h.capped
    c = h.ref.counters
    assert c[:, PROMOTIONS].sum() > 0 and c[:, STAGED].sum() > 0
    h.close()


def test_kernel_with_the_pools_default_cap_equals_reference(rng):
    """promote="auto" (what a pool builds): no cap for a step of at most N lanes, N // 4 past
    that; the kernel equals the reference given the same cap each step."""
    h = Harness(rng, L=6, E=64, N=8, S=128, lanes=128, row_bytes=2048 + 16, promote="auto")
    assert h.bank.promote == "auto"
    assert [h.bank.promotion_cap(w) for w in (1, 8, 9, 128)] == [0, 0, 2, 2]
    run_random(rng, h, 2000, verify_every=500, p_flip=(0.3, 0.01))
    assert h.capped > 100, h.capped
    h.close()


def test_step_split_equals_step_and_lands_the_rows(rng):
    """step_split: the same plan as step (a second bank in lockstep), copies on the bank's copy
    stream, and after join() every lane's row holds its expert's host bytes. Also captured in a
    graph (fork and join inside the capture) and replayed."""
    L, E, N, S, W, row = 3, 11, 3, 64, 24, 8192 + 16
    store, expect = make_store(rng, L, E, row)
    a, b = Bank(store, N, S, W), Bank(store, N, S, W)
    a.open()
    b.open()
    trace = random_trace(rng, L, E, 300, W)
    for i, (_, layer, ids) in enumerate(trace):
        ids_dev = torch.from_numpy(ids).cuda()
        ra, la = a.step(layer, ids_dev)
        rb, lb, fresh, join = b.step_split(layer, ids_dev)
        join()
        assert torch.equal(ra, rb), f"step {i}: routes differ"
        keys = (layer * E + ids_dev.long()).clamp(0, L * E - 1)
        r = rb.long()
        bad = ((b.rows[r.clamp(min=0), :row] != expect[keys]).any(dim=1) & (r >= 0)).sum()
        assert int(bad) == 0, f"step {i}: lanes read wrong bytes after join"
        copied = set(b.copies[:int(b.n_copies)].cpu().numpy()[:, 1].tolist())
        assert fresh.cpu().tolist() == [int(x in copied) for x in rb.cpu().tolist()], f"step {i}"
    assert a.state()["order"].tolist() == b.state()["order"].tolist()
    # captured: plan on the capture stream, copies forked onto the copy stream and joined
    ids_buf = torch.full((W,), -1, dtype=torch.int64, device="cuda")
    b.close()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        b.step_split(0, ids_buf)[3]()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        routes, _, _, join = b.step_split(0, ids_buf)
        join()
    b.open()
    for rep in range(20):
        ids = rng.integers(-1, E, size=W)
        ids_buf.copy_(torch.from_numpy(ids))
        g.replay()
        torch.cuda.synchronize()
        r = routes.long()
        keys = (ids_buf.long()).clamp(0, E - 1)
        bad = ((b.rows[r.clamp(min=0), :row] != expect[keys]).any(dim=1) & (r >= 0)).sum()
        assert int(bad) == 0, f"replay {rep}"
    assert b.verify() > 0
    a = b = None
    store.close()


def test_staging_overflow_cannot_happen_and_closed_gate_stages(rng):
    h = Harness(rng, L=2, E=200, N=4, S=64, lanes=64, row_bytes=512)
    ids = rng.permutation(200)[:64].astype(np.int64)    # 64 distinct experts, at most 4 resident
    routes, copies = h.step_and_compare(1, ids, torch.int64, "closed, 64 misses")
    assert len(copies) >= 60 and (routes[routes >= 8] < 8 + 64).all()
    assert h.bank.read_error() == PlanError.NONE
    h.close()


@pytest.mark.parametrize("dtype,promote", [(torch.int32, 0), (torch.int64, 0), (torch.int64, 2),
                                           (torch.int32, "auto")])
def test_graph_replay_equals_eager_and_reference(rng, dtype, promote):
    """A captured sequence of layer calls replays like eager launches and the reference. With a
    cap, each call keeps the cap of its capture: changing the bank's setting afterwards changes
    eager launches only (the eager bank keeps the setting, so graph == eager == reference)."""
    L, E, N, S, lanes = 5, 13, 3, 64, 64
    store, expect = make_store(rng, L, E, 2048 + 16)
    bank_g, bank_e = Bank(store, N, S, lanes, promote=promote), \
        Bank(store, N, S, lanes, promote=promote)
    ref = ReferencePlanner(L, E, N, S)
    calls = [(0, 8), (3, 64), (3, 1), (1, 17), (4, 64), (0, 33), (2, 5)]
    C = len(calls)
    ids_buf = torch.full((C, lanes), -1, dtype=dtype, device="cuda")

    def outputs():
        return {"routes": torch.full((C, lanes), -7, dtype=torch.int32, device="cuda"),
                "lane_addr": torch.zeros(C, lanes, dtype=torch.int64, device="cuda"),
                "copies": torch.zeros(C, lanes, 2, dtype=torch.int32, device="cuda"),
                "n_copies": torch.zeros(C, dtype=torch.int32, device="cuda")}

    def body(bank, out):
        for c, (layer, W) in enumerate(calls):
            routes, addr = bank.step(layer, ids_buf[c, :W])
            out["routes"][c, :W].copy_(routes)
            out["lane_addr"][c, :W].copy_(addr)
            out["copies"][c].copy_(bank.copies)
            out["n_copies"][c:c + 1].copy_(bank.n_copies)

    out_g, out_e = outputs(), outputs()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                     # warm-up: all padding, gate closed: no change
        body(bank_g, out_g)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body(bank_g, out_g)
    torch.cuda.synchronize()
    assert bank_g.state()["clock"] == 0                # capture ran nothing
    bank_g.promote = 0 if promote else 1               # not seen by the captured launches

    for rep in range(40):
        if rep == 10:                                 # opened after capture: replays must see it
            for x in (bank_g, bank_e, ref):
                x.open()
        if rep == 32:
            for x in (bank_g, bank_e, ref):
                x.close()
        ids = np.full((C, lanes), -1, dtype=np.int64)
        for c, (layer, W) in enumerate(calls):
            ids[c, :W] = rng.integers(-1, E, size=W)
            if rng.random() < 0.05:
                ids[c, rng.integers(W)] = E + 2
        ids_buf.copy_(torch.from_numpy(ids).to(dtype))
        for out in (out_g, out_e):
            out["routes"].fill_(-7)
        graph.replay()
        body(bank_e, out_e)
        want = []
        for c, (layer, W) in enumerate(calls):
            ref.policy = Policy(promote=bank_e.promotion_cap(W))
            want.append(ref.step(layer, ids[c, :W]))
        torch.cuda.synchronize()
        where = f"replay {rep}"
        for name in ("routes", "copies", "n_copies"):
            assert torch.equal(out_g[name], out_e[name]), f"{name} graph != eager, {where}"
        st_g, st_e, st_r = bank_g.state(), bank_e.state(), ref.state()
        for name in st_r:
            np.testing.assert_array_equal(st_g[name], st_r[name], err_msg=f"graph {name}, {where}")
            np.testing.assert_array_equal(st_e[name], st_r[name], err_msg=f"eager {name}, {where}")
        assert torch.equal(bank_g.rows, bank_e.rows), f"bank rows graph != eager, {where}"
        routes = out_g["routes"].cpu().numpy()
        n_copies = out_g["n_copies"].cpu().numpy()
        copies = out_g["copies"].cpu().numpy()
        for c, (layer, W) in enumerate(calls):
            np.testing.assert_array_equal(routes[c, :W], want[c][0], err_msg=f"call {c}, {where}")
            assert [tuple(x) for x in copies[c, :n_copies[c]].tolist()] == want[c][1]
            for bank, out in ((bank_g, out_g), (bank_e, out_e)):
                r = want[c][0].astype(np.int64)
                addr = np.where(r >= 0, bank.rows.data_ptr() + r * bank.row_stride, 0)
                np.testing.assert_array_equal(out["lane_addr"][c, :W].cpu().numpy(), addr)
        # rows of the last call's routes still hold that call's experts (staging rows are reused)
        layer, W = calls[-1]
        valid = (ids[-1, :W] >= 0) & (ids[-1, :W] < E)
        rows = torch.from_numpy(want[-1][0][valid].astype(np.int64)).cuda()
        keys = torch.from_numpy(layer * E + ids[-1, :W][valid]).cuda()
        assert torch.equal(bank_g.rows[rows, :store.row_bytes], expect[keys])
    assert ref.clock == 22 * C and st_g["clock"] == ref.clock     # the open gate ticked in replays
    assert st_g["counters"].sum() > 0
    assert bank_g.verify() == int((ref.key_of >= 0).sum())
    store.close()


def test_verify_catches_a_corrupt_row_and_broken_tables(rng):
    h = Harness(rng, L=4, E=9, N=3, S=64, lanes=64, row_bytes=1024 + 32)
    b = h.bank
    assert b.verify() == h.R                          # the initial fill
    b.open(verify=True)
    h.ref.open()
    run_random(rng, h, 300, verify_every=0, p_flip=(1.0, 0.0))
    assert b.verify() == h.R and b.verify(sample=5) == 5

    row = int(rng.integers(h.R))
    key = int(b.key_of[row])
    b.rows[row, 123:124].bitwise_xor_(0xFF)
    with pytest.raises(BankVerifyError) as ei:
        b.verify()
    assert ei.value.mismatches == [{"row": row, "key": key, "layer": key // h.E,
                                    "expert": key % h.E, "first_diff": 123}]
    assert f"row {row}" in str(ei.value)
    b.rows[row, 123:124].bitwise_xor_(0xFF)
    b.rows[row, b.row_bytes:].fill_(0xEE)             # the stride's padding is not part of a row
    b.rows[h.R:].fill_(0xEE)                          # nor is staging
    assert b.verify() == h.R

    other = (row + 1) % h.R
    b.slot_of[key] = other
    with pytest.raises(BankVerifyError, match=f"slot_of\\[{key}\\] = {other}") as ei:
        b.verify()
    assert ei.value.problems and not ei.value.mismatches
    b.close()
    with pytest.raises(BankVerifyError):
        b.open(verify=True)                           # opening verifies, and stays closed
    assert b.state()["gate"] == 0
    b.slot_of[key] = row
    head = int(b.ring_ends[0])
    p, q = head, (head + 1) % b.ring.numel()          # the window's first two entries (no holes
    r0, r1 = int(b.ring[p]), int(b.ring[q])           # before any open step)
    b.ring[p], b.ring[q] = r1, r0                     # swapped, pos_of still the old positions
    with pytest.raises(BankVerifyError, match=f"ring\\[{p}\\] = {r1} but pos_of"):
        b.verify()
    b.pos_of[r0], b.pos_of[r1] = q, p                 # consistent again, but out of LRU order
    with pytest.raises(BankVerifyError, match="LRU order"):
        b.verify()
    b.ring[p], b.ring[q] = r0, r1
    b.pos_of[r0], b.pos_of[r1] = p, q
    assert b.verify() == h.R
    h.close()


def test_errors_stats_and_memory(rng):
    h = Harness(rng, L=3, E=6, N=2, S=16, lanes=16, row_bytes=512)
    b = h.bank
    h.set_gate(1)
    for layer, ids in ((0, [0, 5, 5, -1]), (2, [3, 4, 0, 1]), (1, [2]), (0, [6, 1])):
        h.step_and_compare(layer, np.array(ids, dtype=np.int64), torch.int32, f"{layer} {ids}")
    assert b.read_error() == PlanError.BAD_ID
    b.clear_error()
    assert b.read_error() == PlanError.NONE
    rows, text = b.stats()
    owned = np.bincount(h.ref.key_of[h.ref.key_of >= 0] // 6, minlength=3)
    for layer, d in enumerate(rows):
        assert [d[k] for k in COUNTERS] == h.ref.counters[layer].tolist()
        assert d["rows_owned"] == owned[layer]
        assert d["bytes_copied"] == (d["promotions"] + d["staged"]) * 512
    assert text.count("\n") == 4
    parts = {name: n for name, n, _ in b.memory_parts()}
    assert parts["bank"] + parts["staging"] == b.rows.nbytes
    assert parts["host store"] == h.store.nbytes
    h.close()


# the capture below records nothing on purpose: open, close and verify refuse to run inside it
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")
def test_step_guards(rng):
    h = Harness(rng, L=2, E=4, N=2, S=8, lanes=8, row_bytes=256)
    b = h.bank
    with pytest.raises(ValueError, match="device"):
        b.step(0, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(TypeError, match="int32 or int64"):
        b.step(0, torch.zeros(3, device="cuda"))
    with pytest.raises(ValueError, match="max_lanes=8"):
        b.step(0, torch.zeros(9, dtype=torch.int32, device="cuda"))
    with pytest.raises(ValueError, match="contiguous"):
        b.step(0, torch.zeros(4, 2, dtype=torch.int32, device="cuda").t())
    with pytest.raises(ValueError, match="layer"):
        b.step(2, torch.zeros(3, dtype=torch.int32, device="cuda"))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for call in (b.open, b.close, b.verify):
            with pytest.raises(RuntimeError, match="capture"):
                call()
    routes, addr = b.step(1, torch.tensor([[1, -1], [3, 1]], device="cuda"))
    assert routes.tolist() == [3, -1, 4, 3]            # R = 4: expert 3 is staged in row 4
    h.close()


# --- the PREFETCH build: plan and prefetch steps mixed -------------------------------------------------

class MixedRun:
    """A prefetching Bank driven over `random_mixed_trace` in batches: each step's outputs and
    tables are gathered on the device into one row of a snapshot buffer (no host sync between
    steps), the batch is read back at once and compared with the reference step by step.
    `promote="random"`: the bank's promotion cap is drawn for each step (`random_caps`), and the
    reference's plan step takes the cap the bank launched with."""

    NAMES = ("slot_of", "key_of", "last_use", "ring", "pos_of", "ends", "clock", "gate", "error",
             "counters", "touched", "pf_flag", "pf_counters", "routes", "lane_addr", "lane_fresh",
             "n_copies", "copies", "pf_n_copies", "pf_copies", "bad_lanes", "bad_prefetched")

    def __init__(self, rng, L, E, N, S, lanes, row_bytes, promote=0, **shape):
        self.rng, self.L, self.E, self.lanes = rng, L, E, lanes
        self.store, self.expect = make_store(rng, L, E, row_bytes)
        self.random_caps = promote == "random"
        self.bank = Bank(self.store, N, S, lanes, prefetch=True,
                         promote=0 if self.random_caps else promote, **shape)
        self.ref = ReferencePlanner(L, E, N, S)
        self.R = self.bank.num_rows
        self.open_prefetches = self.skipped = 0
        self.gate = 0                                 # the bank's gate, as last set

    def _parts(self, layer, ids_dev):
        b, t = self.bank, self.bank.tables
        W = ids_dev.numel()
        keys = (layer * self.E + ids_dev.long()).clamp(0, self.L * self.E - 1)
        r = t.routes[:W].long()
        got = b.rows[r.clamp(0, b.rows.shape[0] - 1), :b.row_bytes]
        bad_lanes = ((got != self.expect[keys]).any(dim=1) & (r >= 0) & (r < b.rows.shape[0])).sum()
        # the prefetch list's rows after its copies: their keys' host bytes
        n = t.pf_n_copies.long()
        j = torch.arange(self.lanes, device="cuda")
        pk = t.pf_copies[:, 0].long().clamp(0, self.L * self.E - 1)
        pr = t.pf_copies[:, 1].long().clamp(0, self.R - 1)
        bad_pf = ((b.rows[pr, :b.row_bytes] != self.expect[pk]).any(dim=1) & (j < n)).sum()
        return [t.slot_of, t.key_of, t.last_use, t.ring, t.pos_of, t.ends, t.clock, t.gate,
                t.error, t.counters, t.touched, t.pf_flag, t.pf_counters, t.routes, t.lane_addr,
                t.lane_fresh, t.n_copies, t.copies, t.pf_n_copies, t.pf_copies, bad_lanes, bad_pf]

    def run(self, steps, batch=256, p_flip=(0.1, 0.01)):
        b, t = self.bank, self.bank.tables
        trace = random_mixed_trace(self.rng, self.L, self.E, steps, self.lanes, p_flip)
        ids_all = np.full((len(trace), self.lanes), -1, dtype=np.int64)
        for i, (*_, ids) in enumerate(trace):
            ids_all[i, :ids.size] = ids
        ids64 = torch.from_numpy(ids_all).cuda()
        ids32 = torch.from_numpy(np.clip(ids_all, -2**31, 2**31 - 1).astype(np.int32)).cuda()
        wide = [bool(np.any(np.abs(ids) > 2**31 - 1)) or self.rng.random() < 0.5
                for *_, ids in trace]
        caps = random_caps(self.rng, len(trace), self.lanes) if self.random_caps else None
        used = [0] * len(trace)                       # the cap each plan step launched with
        sizes = None
        for start in range(0, len(trace), batch):
            chunk = trace[start:start + batch]
            snap = None
            for k, (gate, layer, kind, ids) in enumerate(chunk):
                i = start + k
                if gate != self.gate:
                    b.open(verify=False) if gate else b.close()
                    self.gate = gate
                for buf in (t.routes, t.lane_fresh, t.copies, t.n_copies, t.pf_copies,
                            t.pf_n_copies):
                    buf.fill_(POISON32)
                t.lane_addr.fill_(POISON64)
                ids_dev = (ids64 if wide[i] else ids32)[i, :ids.size]
                if caps is not None:
                    b.promote = caps[i]
                used[i] = b.promotion_cap(ids.size)
                if kind:
                    b.prefetch(layer, ids_dev, used[i])
                    b.copy_prefetched()
                else:
                    b.step(layer, ids_dev)
                parts = [x.reshape(-1).to(torch.int64) for x in self._parts(layer, ids_dev)]
                if snap is None:
                    sizes = [x.numel() for x in parts]
                    snap = torch.empty(len(chunk), sum(sizes), dtype=torch.int64, device="cuda")
                snap[k].copy_(torch.cat(parts))
            rows = snap.cpu().numpy()
            for k, (gate, layer, kind, ids) in enumerate(chunk):
                self._compare(start + k, gate, layer, kind, ids,
                              dict(zip(self.NAMES, np.split(rows[k], np.cumsum(sizes)[:-1]))),
                              used[start + k])
            assert b.verify() == int((self.ref.key_of >= 0).sum())
        return trace

    def _compare(self, i, gate, layer, kind, ids, got, cap):
        ref, W = self.ref, ids.size
        if gate:
            ref.open()
        else:
            ref.close()
        ref.policy = Policy(promote=cap)              # a plan step's cap; a prefetch's is max_rows
        where = (f"step {i} ({'prefetch' if kind else 'plan'}, layer {layer}, W={W}, gate {gate}, "
                 f"cap {cap}, ids {ids.tolist()})")
        head, span = (int(v) for v in got["ends"])
        assert 0 <= head < got["ring"].size and self.R <= span <= got["ring"].size, where
        got["order"], problems = ring_order(got["ring"], got["pos_of"], head, span)
        assert problems == [], f"{problems}, {where}"
        if kind:
            misses = {int(e) for e in ids if 0 <= e < self.E and ref.slot_of[layer * self.E + e] < 0}
            want_pf = ref.prefetch(layer, ids, cap)
            if gate:
                self.open_prefetches += 1
                self.skipped += len(misses) - len(want_pf)
            n = int(got["pf_n_copies"][0])
            assert n == len(want_pf), f"pf_n_copies {n} != {len(want_pf)}, {where}"
            pf = got["pf_copies"].reshape(-1, 2)[:n]
            assert [tuple(c) for c in pf.tolist()] == want_pf, f"prefetch copies, {where}"
            assert int(got["bad_prefetched"][0]) == 0, f"prefetched rows hold wrong bytes, {where}"
            for name, poison in (("routes", POISON32), ("lane_addr", POISON64),
                                 ("lane_fresh", POISON32), ("n_copies", POISON32),
                                 ("copies", POISON32)):
                assert (got[name] == poison).all(), f"a prefetch wrote {name}, {where}"
        else:
            want_routes, want_copies = ref.step(layer, ids)
            np.testing.assert_array_equal(got["routes"][:W], want_routes, err_msg=f"routes, {where}")
            base, stride = self.bank.rows.data_ptr(), self.bank.row_stride
            want_addr = np.where(want_routes >= 0, base + want_routes.astype(np.int64) * stride, 0)
            np.testing.assert_array_equal(got["lane_addr"][:W], want_addr,
                                          err_msg=f"lane_addr, {where}")
            np.testing.assert_array_equal(got["lane_fresh"][:W],
                                          fresh_lanes(want_routes, want_copies),
                                          err_msg=f"lane_fresh, {where}")
            n = int(got["n_copies"][0])
            assert n == len(want_copies), f"n_copies {n} != {len(want_copies)}, {where}"
            copies = got["copies"].reshape(-1, 2)[:n]
            assert [tuple(c) for c in copies.tolist()] == want_copies, f"copies, {where}"
            assert int(got["bad_lanes"][0]) == 0, f"lanes read wrong bytes, {where}"
            assert (got["pf_n_copies"] == POISON32).all(), f"a step wrote pf_n_copies, {where}"
        st = {**ref.state(), **ref.prefetch_state()}
        for name in ("slot_of", "key_of", "last_use", "order"):
            np.testing.assert_array_equal(got[name], st[name], err_msg=f"{name}, {where}")
        for name in ("clock", "gate", "error"):
            assert int(got[name][0]) == st[name], f"{name}: {got[name][0]} != {st[name]}, {where}"
        np.testing.assert_array_equal(got["counters"].reshape(self.L, len(COUNTERS)),
                                      st["counters"], err_msg=f"counters, {where}")
        np.testing.assert_array_equal(got["pf_flag"], st["prefetched"], err_msg=f"pf_flag, {where}")
        np.testing.assert_array_equal(got["pf_counters"].reshape(self.L, len(PREFETCH_COUNTERS)),
                                      st["prefetch_counters"], err_msg=f"prefetch counters, {where}")
        touched = int((st["last_use"] == st["clock"]).sum()) if st["clock"] else 0
        assert int(got["touched"][0]) == touched, f"touched, {where}"

    def close(self):
        self.store.close()


def test_prefetch_kernel_equals_reference_on_10000_mixed_steps(rng):
    """10,000 steps (plan steps, and prefetches of the next or any layer with predictions right
    and wrong) through the PREFETCH build: after every step the tables, touched, flags, counters,
    routes, both copy lists and the rows they filled equal the reference's; a prefetch writes
    none of the plan step's outputs. R = 15 < E = 17 and wide predictions: prefetches run out of
    eligible rows too."""
    h = MixedRun(rng, L=5, E=17, N=3, S=64, lanes=64, row_bytes=4096 + 48)
    trace = h.run(10_000)
    pc = h.ref.prefetch_counters.sum(axis=0)
    assert (pc > 0).all(), pc                         # prefetched, used and wasted rows
    assert h.open_prefetches > 2500 and h.skipped > 0
    assert sum(kind for _, _, kind, _ in trace) > 2500
    c = h.ref.counters
    assert c[:, COUNTERS.index("steals")].sum() > 0 and c[:, COUNTERS.index("staged")].sum() > 0
    assert h.ref.error & PlanError.BAD_ID
    h.close()


@pytest.mark.parametrize("L,E,N,threads,items,ring,steps", [
    (7, 40, 30, 64, 1, None, 2000),    # R = 210 in tiles of 64: the multi-tile loop
    (7, 40, 30, 64, 2, 256, 2000),     # ... with a tight ring: compaction over several tiles
    (5, 17, 3, None, None, 16, 2000),  # R = 15 in a ring of 16: compaction nearly every step
    (48, 512, 256, None, None, None, 400),  # the benchmark's shape with the default block
])
def test_prefetch_kernel_equals_reference_other_shapes(rng, L, E, N, threads, items, ring, steps):
    h = MixedRun(rng, L, E, N, S=64, lanes=64, row_bytes=256, threads=threads, items=items,
                 ring=ring)
    h.run(steps, batch=200, p_flip=(0.3, 0.01))
    assert h.ref.prefetch_counters[:, 0].sum() > 0
    h.close()


def test_prefetch_kernel_with_promotion_caps_equals_reference(rng):
    """The PREFETCH build with a cap drawn for each step: plan steps are capped as the
    reference's Policy, prefetches by the same number as its max_rows, and the tables, lists
    and counters stay equal."""
    h = MixedRun(rng, L=5, E=17, N=3, S=64, lanes=64, row_bytes=1024 + 48, promote="random")
    h.run(3000, batch=250)
    c = h.ref.counters
    assert c[:, PROMOTIONS].sum() > 0 and c[:, STAGED].sum() > 0
    assert h.ref.prefetch_counters[:, 0].sum() > 0
    h.close()


def test_plain_and_prefetch_builds_plan_alike(rng):
    """Without prefetch steps the PREFETCH build's plan step is the plain one: two banks in
    lockstep keep equal tables, and the prefetch tables stay zero."""
    L, E, N, S, W = 4, 21, 5, 64, 48
    store, _ = make_store(rng, L, E, 512)
    a, b = Bank(store, N, S, W), Bank(store, N, S, W, prefetch=True)
    assert not a.prefetching and b.prefetching and "prefetch" in repr(b)
    for x in (a, b):
        x.open()
    for _, layer, ids in random_trace(rng, L, E, 500, W):
        d = torch.from_numpy(ids).cuda()
        ra, la = a.step(layer, d)
        rb, lb = b.step(layer, d)
        assert torch.equal(ra, rb) and torch.equal(a.copies[:int(a.n_copies)],
                                                   b.copies[:int(b.n_copies)])
    sa, sb = a.state(), b.state()
    for name in ("slot_of", "key_of", "last_use", "order", "clock", "counters"):
        np.testing.assert_array_equal(sa[name], sb[name], err_msg=name)
    assert (sb["prefetched"] == 0).all() and (sb["prefetch_counters"] == 0).all()
    with pytest.raises(RuntimeError, match="without prefetch"):
        a.copy_prefetched()
    with pytest.raises(RuntimeError, match="prefetch tables"):
        a.prefetch(0, torch.zeros(2, dtype=torch.int32, device="cuda"))
    rows, text = b.stats()
    assert rows[0]["prefetched"] == 0 and "prefetch: 0 rows" in text
    a = b = None
    store.close()


# --- the pool's default cap, through the engine ---------------------------------------------------

def test_a_pool_caps_wide_decode_calls_by_default():
    """`cupool.wrap` builds its bank with promote="auto": with 4 sequences of top-2 (8 lanes) over
    2 rows a layer, each decode call promotes at most 1 miss (N // 4, at least 1) and stages the
    rest; a single-token call of 2 lanes is not capped. The tokens are those of the uncapped pool
    (a cap moves rows, never what a lane reads), `Pool.promote` changes the setting, and
    resize_bank keeps it."""
    from test_gpu_engine import _prompts
    from test_gpu_wrap import model_for
    from tiny_models import FAMILIES

    import cupool
    from cupool.sampling import SamplingParams
    model = model_for("qwen3_moe", seed=33)
    _, (moe_layers, E, K, _, _) = FAMILIES["qwen3_moe"]
    pool = cupool.wrap(model, rows=K, max_decode_tokens=4, progress=False)
    assert pool.promote == "auto" and "promote=auto" in repr(pool.bank)
    assert pool.bank.promotion_cap(4 * K) == 1 and pool.bank.promotion_cap(K) == 0
    ps = _prompts([2, 1, 3, 2], seed=9)
    params = [SamplingParams(max_tokens=n) for n in (14, 10, 12, 16)]

    def run():
        pool.bank.reset_stats()
        eng = cupool.Engine(model, pool, max_batch=4, max_len=32, eos_token_id=[])
        out = [r.output_ids for r in eng.generate(ps, params)]
        steps = eng.steps_run
        eng.close()
        return out, steps, pool.stats()

    capped, steps, stats = run()
    assert steps > 0 and pool.errors() == []
    for s in stats:                                   # one decode call a layer a step, cap 1
        assert s["promotions"] <= steps, (s, steps)
    assert sum(s["staged"] for s in stats) > 0, stats
    assert pool.verify() > 0
    pool.promote = 0
    plain, _, stats0 = run()
    assert plain == capped
    assert sum(s["promotions"] for s in stats0) > sum(s["promotions"] for s in stats)
    pool.promote = 3
    pool.resize_bank(K + 1)
    assert pool.promote == 3 and pool.bank.promotion_cap(K) == 3
    with pytest.raises(ValueError, match="promote must be 'auto' or an int"):
        pool.promote = -1
    assert len(stats) == len(moe_layers)
    pool.unwrap()
