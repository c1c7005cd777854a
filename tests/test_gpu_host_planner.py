"""GPU checks of the planner's HOST_SPLIT build through `Bank(host=True)`: host steps with random
split tables, the host's misses promoted behind or left out of the bank, and landings equal `ReferencePlanner.step_host` / `land` after every step (routes,
lane addresses, host keys, copy and behind lists, pending flags, tables, counters); the rows the
GEMM reads hold the right bytes, and a host miss's row does once its behind copy has landed; a
captured graph of step + behind copy + landing replays as the eager launches do."""

import numpy as np
import pytest
import torch
from _planner_emu import random_host_trace

from cupool.bank import Bank
from cupool.reference.planner import COUNTERS, ReferencePlanner

from test_gpu_planner import POISON32, POISON64, make_store

pytestmark = pytest.mark.gpu


class HostHarness:
    def __init__(self, rng, L, E, N, S, lanes, row_bytes, **shape):
        self.L, self.E, self.lanes = L, E, lanes
        self.store, self.expect = make_store(rng, L, E, row_bytes)
        self.bank = Bank(self.store, N, S, lanes, host=True, **shape)
        self.ref = ReferencePlanner(L, E, N, S)
        self.side = torch.cuda.Stream()
        self.behind_total = self.host_lanes = self.left = 0

    def set_gate(self, gate):
        if gate:
            self.bank.open(verify=False)
            self.ref.open()
        else:
            self.bank.close()
            self.ref.close()

    def land(self):
        torch.cuda.current_stream().wait_stream(self.side)   # the behind copies are in
        self.bank.land()
        self.ref.land()

    def step(self, layer, ids, split, where, leave=False):
        b, t = self.bank, self.bank.tables
        for buf, v in ((t.routes, POISON32), (t.lane_addr, POISON64), (t.copies, POISON32),
                       (t.n_copies, POISON32), (t.host_keys, POISON64), (t.behind, POISON32),
                       (t.n_behind, POISON32)):
            buf.fill_(v)
        full = np.zeros(self.lanes + 1, np.int64)
        full[:split.size] = split
        full[split.size:] = np.minimum(np.arange(split.size, self.lanes + 1), split[-1])
        b.set_split(full, leave)
        ids_dev = torch.from_numpy(ids).cuda()
        routes, addr, host_keys = b.step_host(layer, ids_dev)
        self.side.wait_stream(torch.cuda.current_stream())
        b.copy_behind(layer, self.side)
        want = self.ref.step_host(layer, ids, full, leave=leave)
        r = routes.long()
        keys = (layer * self.E + ids_dev.long()).clamp(0, self.L * self.E - 1)
        got_rows = b.rows[r.clamp(min=0), :b.row_bytes]
        bad = int(((got_rows != self.expect[keys]).any(dim=1) & (r >= 0)).sum())
        assert bad == 0, f"{bad} GPU lanes read wrong bytes, {where}"
        np.testing.assert_array_equal(routes.cpu().numpy(), want.routes, err_msg=f"routes, {where}")
        base, stride = b.rows.data_ptr(), b.row_stride
        want_addr = np.where(want.routes >= 0, base + want.routes.astype(np.int64) * stride, 0)
        np.testing.assert_array_equal(addr.cpu().numpy(), want_addr, err_msg=f"lane_addr, {where}")
        np.testing.assert_array_equal(host_keys.cpu().numpy(), want.host_keys,
                                      err_msg=f"host_keys, {where}")
        n, nb = int(t.n_copies.item()), int(t.n_behind[layer].item())
        assert [tuple(c) for c in t.copies[:n].cpu().tolist()] == want.copies, f"copies, {where}"
        assert [tuple(c) for c in t.behind[layer, :nb].cpu().tolist()] == want.behind, \
            f"behind, {where}"
        st, ref = b.state(), self.ref.state()
        assert st["ring_problems"] == [], f"{st['ring_problems']}, {where}"
        for name in ("slot_of", "key_of", "last_use", "order"):
            np.testing.assert_array_equal(st[name], ref[name], err_msg=f"{name}, {where}")
        for name in ("clock", "gate", "error"):
            assert st[name] == ref[name], f"{name}: {st[name]} != {ref[name]}, {where}"
        np.testing.assert_array_equal(st["counters"], ref["counters"].reshape(-1, len(COUNTERS)),
                                      err_msg=f"counters, {where}")
        np.testing.assert_array_equal(st["pending"], self.ref.pending.astype(np.int32),
                                      err_msg=f"pending, {where}")
        np.testing.assert_array_equal(st["host_counters"], self.ref.host_counters,
                                      err_msg=f"host counters, {where}")
        self.behind_total += nb
        self.host_lanes += int((want.host_keys >= 0).sum())
        self.left += int((want.host_keys >= 0).sum()) if leave else 0
        return want


@pytest.mark.parametrize("L,E,N,S,lanes,steps", [
    (5, 17, 3, 64, 32, 3000),       # R = 15 < E: rows run out, pending rows starve misses
    (8, 64, 16, 64, 64, 2000),      # several tiles of the ring
])
def test_host_steps_equal_the_reference(rng, L, E, N, S, lanes, steps):
    h = HostHarness(rng, L, E, N, S, lanes, 4352)
    trace = random_host_trace(rng, L, E, steps, lanes)
    try:
        for i, (gate, layer, kind, ids, split, leave) in enumerate(trace):
            if gate != h.ref.gate:
                h.set_gate(gate)
            where = f"step {i} (layer {layer}, kind {kind}, gate {gate})"
            if kind == 2:
                h.land()
                # every row that was pending now holds its key's bytes
                h.bank.verify()
                continue
            h.step(layer, ids, split, where, leave)
        h.land()
        h.bank.verify()
        assert h.behind_total > steps // 10 and h.host_lanes > 0 and h.left > steps // 10
    finally:
        h.store.close()


def test_captured_host_step_replays_like_eager_launches(rng):
    """A graph of step_host + copy_behind (side stream) + land, replayed with new ids in a static
    buffer: each replay equals the reference's step_host and land, and the rows are right."""
    L, E, N, S, lanes = 4, 24, 6, 32, 16
    h = HostHarness(rng, L, E, N, S, lanes, 4352)
    try:
        split = np.minimum(np.arange(lanes + 1), 2)
        h.bank.set_split(split)
        ids_buf = torch.full((lanes,), -1, dtype=torch.int64, device="cuda")
        layer = 2
        # warm-up (gate closed: nothing moves), then capture
        h.bank.step_host(layer, ids_buf)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            routes, addr, keys = h.bank.step_host(layer, ids_buf)
            h.side.wait_stream(torch.cuda.current_stream())
            h.bank.copy_behind(layer, h.side)
            torch.cuda.current_stream().wait_stream(h.side)
            h.bank.land()
        h.set_gate(1)
        for i in range(40):
            ids = rng.choice(E, size=lanes, replace=False).astype(np.int64)
            ids[rng.random(lanes) < 0.2] = -1
            ids_buf.copy_(torch.from_numpy(ids))
            g.replay()
            want = h.ref.step_host(layer, ids, split)
            h.ref.land()
            np.testing.assert_array_equal(routes.cpu().numpy(), want.routes, err_msg=f"replay {i}")
            np.testing.assert_array_equal(keys.cpu().numpy(), want.host_keys,
                                          err_msg=f"replay {i}")
            st = h.bank.state()
            np.testing.assert_array_equal(st["slot_of"], h.ref.slot_of, err_msg=f"replay {i}")
            assert not st["pending"].any()
        h.bank.verify()
    finally:
        h.store.close()


def test_behind_copies_of_a_layer_may_run_after_later_layers_steps(rng):
    """As in a decode step, where layer l's behind copies on the side stream can still be
    running while layers l + 1, ... plan: every layer's steps first, then each layer's copies.
    Each layer keeps its own behind list, so every promoted row ends up with its key's bytes."""
    L, E, N, S, lanes = 4, 24, 8, 32, 16
    h = HostHarness(rng, L, E, N, S, lanes, 4352)
    try:
        h.bank.set_split(np.minimum(np.arange(lanes + 1), 3))
        h.set_gate(1)
        for token in range(6):
            counts = []
            for layer in range(L):
                ids = rng.choice(E, size=lanes, replace=False).astype(np.int64)
                h.bank.step_host(layer, torch.from_numpy(ids).cuda())
                counts.append(int(h.bank.tables.n_behind[layer].item()))
            h.side.wait_stream(torch.cuda.current_stream())
            for layer in range(L):
                h.bank.copy_behind(layer, h.side)
            torch.cuda.current_stream().wait_stream(h.side)
            h.bank.land()
            assert sum(counts) > 0, f"token {token}: no host rows, the test checks nothing"
            assert h.bank.verify() > 0, f"token {token}"
        with pytest.raises(ValueError, match="layer must be an int"):
            h.bank.copy_behind(L, h.side)
    finally:
        h.store.close()


def test_host_bank_guards():
    from cupool import HostStore
    store = HostStore(2, 4, 4352)
    store.fill(lambda _l: np.zeros((4, 4352), np.uint8), progress=False)
    store.seal()
    try:
        with pytest.raises(ValueError, match="separate planner builds"):
            Bank(store, 2, 8, 8, prefetch=True, host=True)
        plain = Bank(store, 2, 8, 8)
        with pytest.raises(RuntimeError, match="without host steps"):
            plain.step_host(0, torch.zeros(2, dtype=torch.int64, device="cuda"))
        with pytest.raises(RuntimeError, match="without the host tables"):
            plain.set_split(np.zeros(9, np.int64))
        b = Bank(store, 2, 8, 8, host=True)
        with pytest.raises(ValueError, match="split must be 9 integers"):
            b.set_split(np.zeros(8, np.int64))
        with pytest.raises(ValueError, match=r"split\[3\] = 4 is not in \[0, 3\]"):
            b.set_split(np.array([0, 0, 0, 4, 0, 0, 0, 0, 0]))
        with pytest.raises(ValueError, match="leave must be a bool"):
            b.set_split(np.zeros(9, np.int64), leave=1)
        assert "host" in repr(b) and b.hosting and not plain.hosting
    finally:
        store.close()
