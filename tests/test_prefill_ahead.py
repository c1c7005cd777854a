"""Prefill ahead without a GPU: align_experts' ALL_HOST copy lists (the plain reference,
`cupool.reference.moe.align_experts`), the bookkeeping of copies issued ahead (`AheadCopies`),
CUPOOL_PREFILL_AHEAD and when a pooled layer asks for it (`cupool.layer.prefill_plan`, with a
stand-in pool and GEMM). The kernel itself against this reference: tests/test_gpu_gemm.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cupool.gemm import AheadCopies, scratch_chunks
from cupool.layer import PooledExperts, parse_prefill_ahead, prefill_plan
from cupool.pool import Pool
from cupool.reference.moe import align_experts

BASE, STRIDE = 1 << 40, 4096          # scratch rows of the reference's addresses


def random_case(gen, E, W, resident_share):
    ids = torch.randint(0, E, (W,), generator=gen)
    ids[torch.rand(W, generator=gen) < 0.1] = -1                      # padding lanes
    w = torch.rand(W, generator=gen)
    res = torch.rand(E, generator=gen) < resident_share
    addr = torch.where(res, (torch.arange(E) + 1) * (1 << 30), torch.zeros(E, dtype=torch.int64))
    return ids, w, addr


def run(ids, w, E, addr, rows, buffers, nt, layer=3, all_host=True):
    nbuf, C, nchunks = scratch_chunks(rows, buffers, E)
    return align_experts(ids, w, E, layer, addr, BASE, STRIDE, C, nbuf, nchunks, nt,
                         all_host=all_host), (nbuf, C, nchunks)


@pytest.mark.parametrize("E, rows, buffers, nt", [(128, 32, 2, 64), (37, 5, 2, 16), (9, 1, 1, 8),
                                                  (60, 48, 3, 64), (1024, 32, 2, 64)])
def test_all_host_copy_lists_follow_the_placement_alone(E, rows, buffers, nt):
    """ALL_HOST: the copy lists are those of W = 0 for any routing; every expert without a GPU
    address is copied exactly once, in expert order, chunk c into buffer c % nbuf; the units of
    routed experts (count, lanes, resident addresses) are those of the plain build; each host
    unit reads the scratch row its expert is copied to, inside its chunk's unit range."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    layer = 3
    for share in (0.0, 0.5, 0.9, 1.0):
        _, _, addr = random_case(gen, E, 1, share)
        empty, (nbuf, C, nchunks) = run([], [], E, addr, rows, buffers, nt)
        host = [e for e in range(E) if int(addr[e]) == 0]
        assert [k - layer * E for k, _ in empty["copies"]] == host
        assert [r for _, r in empty["copies"]] == [i % C + (i // C % nbuf) * C
                                                  for i in range(len(host))]
        assert empty["n_copies"] == [max(0, min(C, len(host) - c * C)) for c in range(nchunks)]
        assert empty["units"] == [] and empty["error"] == 0
        for W in (1, 7, E // 2 + 3, 4 * E + 5):
            ids, w, _ = random_case(gen, E, W, share)
            got, _ = run(ids, w, E, addr, rows, buffers, nt)
            plain, _ = run(ids, w, E, addr, rows, buffers, nt, all_host=False)
            assert got["copies"] == empty["copies"] and got["n_copies"] == empty["n_copies"]
            assert got["expert_lanes"] == plain["expert_lanes"]
            assert [(e, n) for e, _, n in got["units"]] == [(e, n) for e, _, n in plain["units"]]
            nres = got["phase_off"][1]
            assert got["phase_off"][:2] == plain["phase_off"][:2]
            assert got["units"][:nres] == plain["units"][:nres]          # resident: same rows
            assert got["lane_w"] == plain["lane_w"]
            row_of = {k - layer * E: r for k, r in got["copies"]}
            for c in range(nchunks):
                lo, hi = got["phase_off"][1 + c], got["phase_off"][2 + c]
                assert lo <= hi
                for e, a, _ in got["units"][lo:hi]:
                    assert host.index(e) // C == c                       # the chunk's experts
                    assert a == BASE + STRIDE * row_of[e]                 # read where copied
                    assert row_of[e] // C == c % nbuf                     # in buffer c % nbuf
            assert got["phase_off"][-1] == len(got["units"])
            # the plain build copies only the routed host experts
            routed = {e for e in host if e in plain["expert_lanes"]}
            assert {k - layer * E for k, _ in plain["copies"]} == routed


def test_all_host_reference_flags_bad_lanes():
    """Bad ids and non-finite weights set the same sticky bits and become padding with or
    without ALL_HOST; the copy lists do not change."""
    E = 12
    addr = torch.zeros(E, dtype=torch.int64)
    addr[::3] = 1 << 32
    ids = [0, 1, 12, -1, 5, -7]
    w = [0.5, float("nan"), 0.25, 0.5, 1.0, 1.0]
    got, _ = run(ids, w, E, addr, 4, 2, 8)
    empty, _ = run([], [], E, addr, 4, 2, 8)
    assert got["error"] == 3 and got["lane_w"] == [0.5, 0.0, 0.0, 0.0, 1.0, 0.0]
    assert got["copies"] == empty["copies"] and len(got["copies"]) == E - 4


def test_ahead_copies_bookkeeping():
    """`take` gives a call its chunks issued ahead only when it is the announced layer, with
    the same host table, in ALL_HOST mode and with the same number of first chunks; anything
    else drops them (counted), and a call finds nothing issued twice."""
    host, other = object(), object()
    a = AheadCopies()
    assert a.take(0, host, True, 2) == 0 and (a.used, a.dropped) == (0, 0)
    a.issued(5, host, 2)
    assert a.take(5, host, True, 2) == 2 and (a.used, a.dropped) == (1, 0)
    assert a.take(5, host, True, 2) == 0 and (a.used, a.dropped) == (1, 0)
    for layer, table, all_host, chunks in ((6, host, True, 2), (5, other, True, 2),
                                           (5, host, False, 2), (5, host, True, 1)):
        a.issued(5, host, 2)
        assert a.take(layer, table, all_host, chunks) == 0
    assert (a.used, a.dropped) == (1, 4)
    a.issued(7, host, 2)
    a.drop()
    a.drop()                                  # nothing left: not counted twice
    assert a.take(7, host, True, 2) == 0 and a.dropped == 5


def test_prefill_ahead_parser():
    assert parse_prefill_ahead(None) is False and parse_prefill_ahead("0") is False
    assert parse_prefill_ahead("1") is True
    for bad in ("", "on", "yes", "true", "2", " 1"):
        with pytest.raises(ValueError, match="CUPOOL_PREFILL_AHEAD="):
            parse_prefill_ahead(bad)


class StandInPool:
    """What `PooledExperts._prefill` and `Pool.prefilling` read of a pool, on the CPU: L layers
    of E experts, top-K, a GEMM that records its prefill calls' keyword arguments."""

    def __init__(self, L=4, E=16, K=4, max_prefill_tokens=64, ahead=True):
        self.num_layers, self.num_experts, self.top_k = L, E, K
        self.prefill_ahead, self.prefill_only = ahead, False
        self.prefetcher = None
        self.calls = []
        self.drops = 0
        table = torch.arange(L * E)
        self.store = SimpleNamespace(address_table=lambda: table)

        def prefill(x, ids, w, addr, *, host_addr, layer, out=None, all_host=False, ahead=None):
            self.calls.append(dict(T=x.shape[0], layer=layer, all_host=all_host,
                                   ahead=None if ahead is None else ahead[0],
                                   ahead_addr=None if ahead is None else ahead[1]))
            return torch.zeros_like(x) if out is None else out

        def drop_ahead():
            self.drops += 1
        self.gemm = SimpleNamespace(max_prefill_tokens=max_prefill_tokens, prefill=prefill,
                                    drop_ahead=drop_ahead)

    def expert_addresses(self, layer):
        return (layer + 1) * 1000 + torch.arange(self.num_experts)

    def forward(self, T):
        """Every pooled layer's prefill call for T tokens; the calls the GEMM saw."""
        self.calls.clear()
        x = torch.zeros(T, 8)
        ids = torch.zeros(T, self.top_k, dtype=torch.int64)
        for layer in range(self.num_layers):
            PooledExperts(self, layer)._prefill(x, ids, ids.float())
        return self.calls


def test_prefill_plan_gates_and_announces_the_next_layer():
    """Inside `prefilling()` with the switch on, a single GEMM call with T·K ≥ 4·E is ALL_HOST
    and announces layer + 1 (with that layer's expert addresses), none after the last; a call
    under the lane threshold, outside prefilling, with the switch off or split over several
    GEMM calls keeps the plain path; leaving prefilling drops what was issued ahead."""
    pool = StandInPool(L=4, E=16, K=4, max_prefill_tokens=64)
    assert all(not c["all_host"] and c["ahead"] is None for c in pool.forward(32))  # not prefilling
    with Pool.prefilling(pool):
        calls = pool.forward(16)                              # 16·4 = 4·16 lanes: the threshold
        assert [c["all_host"] for c in calls] == [True] * 4
        assert [c["ahead"] for c in calls] == [1, 2, 3, None]
        assert all(torch.equal(c["ahead_addr"], pool.expert_addresses(c["ahead"]))
                   for c in calls[:3])
        assert all(not c["all_host"] and c["ahead"] is None for c in pool.forward(15))
        split = pool.forward(100)                             # over max_prefill_tokens: split
        assert len(split) == 8 and all(not c["all_host"] and c["ahead"] is None for c in split)
        pool.prefill_ahead = False
        assert all(not c["all_host"] and c["ahead"] is None for c in pool.forward(32))
        assert pool.drops == 0
    assert pool.drops == 1 and not pool.prefill_only
    assert prefill_plan(pool, 0, 64) == (False, None)
    pool.prefill_ahead = True
    pool.prefill_only = True
    assert prefill_plan(pool, 2, 64) == (True, 3) and prefill_plan(pool, 3, 64) == (True, None)
    assert prefill_plan(pool, 0, 65) == (False, None)


def test_pool_switch_reads_the_environment(monkeypatch):
    """`Pool.prefill_ahead`'s default is CUPOOL_PREFILL_AHEAD (off when unset); a bad value is
    an error naming the variable."""
    from cupool.layer import prefill_ahead_default
    monkeypatch.delenv("CUPOOL_PREFILL_AHEAD", raising=False)
    assert prefill_ahead_default() is False
    monkeypatch.setenv("CUPOOL_PREFILL_AHEAD", "1")
    assert prefill_ahead_default() is True
    monkeypatch.setenv("CUPOOL_PREFILL_AHEAD", "on")
    with pytest.raises(ValueError, match="CUPOOL_PREFILL_AHEAD='on'"):
        prefill_ahead_default()
