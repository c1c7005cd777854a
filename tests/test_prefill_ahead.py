"""Prefill ahead without a GPU: align_experts' ALL_HOST copy lists (the plain reference,
`cupool.reference.moe.align_experts`), the copy engine's runs worked out on the host from the
placement (`cupool.gemm.scratch_runs`) against them, the bookkeeping of copies issued ahead
(`AheadCopies`), CUPOOL_PREFILL_AHEAD and when a pooled layer asks for it
(`cupool.layer.prefill_plan`, `Pool.scratch_lists`, with a stand-in pool and GEMM). The kernel
itself against this reference: tests/test_gpu_gemm.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cupool.gemm import AheadCopies, ScratchLists, scratch_chunks, scratch_runs
from cupool.layer import PooledExperts, prefill_plan
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


@pytest.mark.parametrize("E, rows, buffers", [(128, 32, 2), (37, 5, 2), (9, 1, 1), (60, 48, 3),
                                             (1024, 32, 2)])
def test_scratch_runs_are_the_all_host_copy_lists(E, rows, buffers):
    """The copy engine's runs, worked out on the host from the placement, move exactly the
    rows align_experts' ALL_HOST lists name (source: the key's host row; destination: the
    listed scratch row), chunk by chunk; neighbouring rows are one run exactly where both the
    store rows and the scratch rows follow each other, and a run's bytes end at its last row's
    row_bytes. Too many host experts for the chunks is an error."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    L, layer, row_bytes = 4, 2, STRIDE - 48
    for share in (0.0, 0.3, 0.5, 0.9, 1.0):
        _, _, addr = random_case(gen, E, 1, share)
        ref, (nbuf, C, nchunks) = run([], [], E, addr, rows, buffers, 8, layer=layer)
        contiguous = (1 << 44) + np.arange(L * E, dtype=np.int64) * STRIDE
        scattered = contiguous[torch.randperm(L * E, generator=gen).numpy()]
        for host_rows in (contiguous, scattered):
            runs = scratch_runs(layer, addr.numpy() != 0, host_rows, BASE, STRIDE, row_bytes,
                                C, nbuf, nchunks)
            assert len(runs) == nchunks
            pairs, k = [], 0
            for c, chunk in enumerate(runs):
                want = ref["copies"][k:k + ref["n_copies"][c]]
                k += ref["n_copies"][c]
                got = []
                for dst, src, nbytes in chunk:
                    n = (nbytes - row_bytes) // STRIDE + 1
                    assert nbytes == (n - 1) * STRIDE + row_bytes
                    got += [(dst + i * STRIDE, src + i * STRIDE) for i in range(n)]
                assert got == [(BASE + STRIDE * r, int(host_rows[key])) for key, r in want]
                breaks = sum(1 for (d0, s0), (d1, s1) in zip(got, got[1:])
                             if d1 != d0 + STRIDE or s1 != s0 + STRIDE)
                assert len(chunk) == (breaks + 1 if got else 0)
                pairs += got
            assert k == len(ref["copies"]) == int((addr == 0).sum())
    with pytest.raises(ValueError, match="experts without a bank row"):
        scratch_runs(0, np.zeros(E, dtype=bool), contiguous, BASE, STRIDE, row_bytes, 1, 1,
                     E - 1)


@pytest.mark.parametrize("E, rows, buffers", [(128, 32, 2), (37, 5, 2), (60, 48, 3)])
def test_host_prefill_experts_leave_the_all_host_lists(E, rows, buffers):
    """The host's share of a prefill call as `PooledExperts._prefill_host` gives it to the GEMM:
    its experts (the last without a bank row) at address 1 and their lanes as padding. Then
    align_experts' ALL_HOST build neither ranks nor copies them and no unit reads address 1;
    the other experts' units, lanes and copies are those of the call without them ranked
    (`scratch_runs` over the placement with the host's experts counted as resident lists the
    same rows); the host's lanes are exactly the ones taken out."""
    gen = torch.Generator().manual_seed(E + rows)
    for share_of_missing in (0.25, 0.5, 1.0):
        ids, w, addr = random_case(gen, E, 4 * E, 0.5)
        missing = np.flatnonzero(addr.numpy() == 0)
        k = max(1, int(len(missing) * share_of_missing))
        on_host = np.zeros(E, dtype=bool)
        on_host[missing[len(missing) - k:]] = True
        mask = torch.from_numpy(on_host)
        routed = (ids >= 0) & mask[ids.clamp(min=0)]
        gpu_ids = ids.masked_fill(routed, -1)
        gpu_addr = addr.masked_fill(mask, 1)
        ref, (nbuf, C, nchunks) = run(gpu_ids, w, E, gpu_addr, rows, buffers, 8)
        assert all(a != 1 for _, a, _ in ref["units"])
        assert not set(ref["expert_lanes"]) & set(np.flatnonzero(on_host).tolist())
        assert [key - 3 * E for key, _ in ref["copies"]] == \
            [e for e in missing.tolist() if not on_host[e]][:nchunks * C]
        taken = sorted(set(range(len(ids))) - set().union(*ref["expert_lanes"].values())
                       - set(np.flatnonzero(ids.numpy() == -1).tolist()))
        assert taken == np.flatnonzero(routed.numpy()).tolist()
        runs = scratch_runs(3, (addr.numpy() != 0) | on_host,
                            np.arange(4 * E, dtype=np.int64) * STRIDE, BASE, STRIDE,
                            STRIDE - 48, C, nbuf, nchunks)
        listed = [(dst - BASE) // STRIDE for chunk in runs for start, _, nbytes in chunk
                  for dst in range(start, start + nbytes, STRIDE)]
        assert listed == [row for _, row in ref["copies"]]


def test_ahead_copies_bookkeeping():
    """`take` gives a call its chunks issued ahead only when its lists are the very lists
    announced; anything else (other lists, none) drops them (counted), and a call finds
    nothing issued twice."""
    mine, other = ScratchLists(5, ((), ()), 0), ScratchLists(5, ((), ()), 0)
    a = AheadCopies()
    assert a.take(mine) == 0 and (a.used, a.dropped) == (0, 0)
    a.issued(mine, 2)
    assert a.take(mine) == 2 and (a.used, a.dropped) == (1, 0)
    assert a.take(mine) == 0 and (a.used, a.dropped) == (1, 0)
    for lists in (other, None):
        a.issued(mine, 2)
        assert a.take(lists) == 0
    assert (a.used, a.dropped) == (1, 2)
    a.issued(mine, 2)
    a.drop()
    a.drop()                                  # nothing left: not counted twice
    assert a.take(mine) == 0 and a.dropped == 3


@pytest.mark.parametrize("module,parser,env,default", [
    ("cupool.layer", "parse_prefill_ahead", "CUPOOL_PREFILL_AHEAD", True),
    ("cupool.fused", "parse_skip_plan", "CUPOOL_SKIP_PLAN", True),
    ("cupool.fused", "parse_fused_route", "CUPOOL_FUSED_ROUTE", False)])
def test_switch_parsers(module, parser, env, default):
    """Each on/off environment switch: unset gives its default, "1" on, "0" off, anything else
    a ValueError naming the variable."""
    import importlib
    parse = getattr(importlib.import_module(module), parser)
    assert parse(None) is default and parse("1") is True and parse("0") is False
    for bad in ("", "on", "yes", "true", "2", " 1"):
        with pytest.raises(ValueError, match=f"{env}="):
            parse(bad)


class CountedBank:
    """A bank whose slot_of counts its reads (the host reads of the placement)."""

    def __init__(self, slot_of):
        self._slot_of, self.reads = slot_of, 0

    @property
    def slot_of(self):
        self.reads += 1
        return self._slot_of


class StandInPool:
    """What `PooledExperts._prefill`, `Pool.prefilling` and `Pool.scratch_lists` read of a pool,
    on the CPU: L layers of E experts, top-K, a bank whose even experts own a row, a GEMM that
    records its prefill calls' keyword arguments and makes stand-in lists."""

    def __init__(self, L=4, E=16, K=4, max_prefill_tokens=64, ahead=True):
        self.num_layers, self.num_experts, self.top_k = L, E, K
        self.prefill_ahead, self.prefill_only = ahead, False
        self._prefill_resident, self._prefill_lists = None, {}
        self.prefetcher = None
        self.calls = []
        self.drops = 0
        table = torch.arange(L * E)
        rows = np.arange(L * E, dtype=np.int64) * 4096
        self.store = SimpleNamespace(address_table=lambda: table, host_addresses=lambda: rows)
        slot = torch.where(torch.arange(L * E) % 2 == 0, torch.arange(L * E), -1)
        self.bank = CountedBank(slot.to(torch.int32))

        def prefill(x, ids, w, addr, *, host_addr, layer, out=None, lists=None, ahead=None,
                    accumulate=None, host_experts=None):
            self.calls.append(dict(T=x.shape[0], layer=layer, lists=lists, ahead=ahead,
                                   ids=ids, addr=addr, accumulate=accumulate,
                                   host_experts=host_experts))
            return torch.zeros_like(x) if out is None else out

        def lists_of(layer, resident, host_rows):
            assert host_rows is rows
            return ScratchLists(layer, (tuple(np.flatnonzero(~resident)),), int((~resident).sum()))

        def drop_ahead():
            self.drops += 1
        self.gemm = SimpleNamespace(max_prefill_tokens=max_prefill_tokens, prefill=prefill,
                                    drop_ahead=drop_ahead, scratch_lists=lists_of)

    host = None
    scratch_lists = Pool.scratch_lists
    prefill_resident = Pool.prefill_resident
    host_prefill_experts = Pool.host_prefill_experts
    host_prefill_share = Pool.host_prefill_share

    def host_prefill_mask(self, tokens):            # Pool's, without pinned memory
        mask = torch.zeros(self.num_layers, self.num_experts, dtype=torch.bool)
        for layer in range(self.num_layers):
            k = self.host_prefill_share(layer, tokens)
            if k:
                mask[layer, torch.from_numpy(self.host_prefill_experts(layer, k))] = True
        return mask

    def expert_addresses(self, layer):
        return (layer + 1) * 1000 + torch.arange(self.num_experts)

    def forward(self, T, ids=None):
        """Every pooled layer's prefill call for T tokens (routed to expert 0, or `ids`); the
        calls the GEMM saw."""
        self.calls.clear()
        x = torch.zeros(T, 8)
        ids = torch.zeros(T, self.top_k, dtype=torch.int64) if ids is None else ids
        for layer in range(self.num_layers):
            PooledExperts(self, layer)._prefill(x, ids, ids.float())
        return self.calls


def test_prefill_plan_gates_and_announces_the_next_layer():
    """Inside `prefilling()` with the switch on, a single GEMM call with T·K ≥ 4·E gets its
    layer's host lists and announces layer + 1's (the very lists that call gets), none after
    the last; the placement is read from the device once a prefill. A call under the lane
    threshold, outside prefilling, with the switch off or split over several GEMM calls keeps
    the plain path, told how many experts lack a bank row while prefilling (so it runs only the
    scratch chunks they can fill) and nothing outside; leaving prefilling drops what was issued
    ahead and forgets the lists, and lists outside prefilling are an error."""
    pool = StandInPool(L=4, E=16, K=4, max_prefill_tokens=64)
    plain = lambda calls: all(c["lists"] is None and c["ahead"] is None for c in calls)  # noqa: E731
    assert plain(pool.forward(32))                            # not prefilling
    assert all(c["host_experts"] is None for c in pool.calls)
    with Pool.prefilling(pool):
        calls = pool.forward(16)                              # 16·4 = 4·16 lanes: the threshold
        assert [c["lists"].layer for c in calls] == [0, 1, 2, 3]
        assert [c["ahead"] and c["ahead"].layer for c in calls] == [1, 2, 3, None]
        assert all(calls[i]["ahead"] is calls[i + 1]["lists"] for i in range(3))
        assert all(c["lists"].chunks == (tuple(range(1, 16, 2)),) for c in calls)  # odd: host
        again = pool.forward(64)
        assert all(a["lists"] is b["lists"] for a, b in zip(calls, again))
        assert pool.bank.reads == 1
        assert plain(pool.forward(15))
        assert [c["host_experts"] for c in pool.calls] == [8] * 4   # the odd experts
        split = pool.forward(100)                             # over max_prefill_tokens: split
        assert len(split) == 8 and plain(split)
        assert all(c["host_experts"] == 8 for c in split)
        pool.prefill_ahead = False
        assert plain(pool.forward(32))
        assert pool.drops == 0
    assert pool.drops == 1 and not pool.prefill_only
    assert pool._prefill_resident is None and pool._prefill_lists == {}
    with pytest.raises(RuntimeError, match="only while the pool is prefilling"):
        pool.scratch_lists(0)
    assert prefill_plan(pool, 0, 64) == (False, None)
    pool.prefill_ahead = True
    with Pool.prefilling(pool):
        pool.forward(16)
        assert pool.bank.reads == 2                           # read again: a new prefill
    pool.prefill_only = True
    assert prefill_plan(pool, 2, 64) == (True, 3) and prefill_plan(pool, 3, 64) == (True, None)
    assert prefill_plan(pool, 0, 65) == (False, None)


def test_pool_switch_reads_the_environment(monkeypatch):
    """`Pool.prefill_ahead`'s default is CUPOOL_PREFILL_AHEAD (on when unset); a bad value is
    an error naming the variable."""
    from cupool.layer import prefill_ahead_default
    monkeypatch.delenv("CUPOOL_PREFILL_AHEAD", raising=False)
    assert prefill_ahead_default() is True
    monkeypatch.setenv("CUPOOL_PREFILL_AHEAD", "0")
    assert prefill_ahead_default() is False
    monkeypatch.setenv("CUPOOL_PREFILL_AHEAD", "on")
    with pytest.raises(ValueError, match="CUPOOL_PREFILL_AHEAD='on'"):
        prefill_ahead_default()


def test_prefill_with_host_experts_on_a_stand_in_pool(monkeypatch):
    """With a host share (a stand-in HostDecode's `prefill_share`), each listed call posts the
    host's lanes (keys layer·E + expert for the layer's last experts without a bank row, −1
    elsewhere) before the GEMM, hands the GEMM the other lanes with the host's as padding and
    its experts at address 1, lists (and announces to the layer before) the scratch copies
    without them, and adds the host's answer through `accumulate`; a call wider than the
    share's width, or under the lists' threshold, takes the path without the host."""
    import cupool.layer as layer_mod

    posted, waited = [], []
    monkeypatch.setattr(layer_mod, "post", lambda x, keys, w, mb: posted.append((keys, mb)))
    monkeypatch.setattr(layer_mod, "wait", lambda mb, y, err: waited.append((mb, y)))
    pool = StandInPool(L=3, E=16, K=4, max_prefill_tokens=64)
    mailbox = object()
    shares = {}

    def prefill_share(tokens, missing):
        shares[tokens] = missing
        return 3 if tokens <= 32 else 0
    pool.host = SimpleNamespace(prefill_share=prefill_share, mailbox=mailbox, error=None)
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(-1, 16, (24, 4), generator=gen)
    with Pool.prefilling(pool):
        calls = pool.forward(24, ids)
        assert shares == {24: 8}                          # 8 odd experts a layer without a row
        on_host = [11, 13, 15]                            # the last 3 of them
        assert len(calls) == len(posted) == 3 and waited == []    # the GEMM's to call
        for layer, (c, (keys, mb)) in enumerate(zip(calls, posted)):
            mine = (ids >= 0) & torch.isin(ids, torch.tensor(on_host))
            assert mb is mailbox
            assert torch.equal(keys, torch.where(mine, ids + layer * 16, -1))
            assert torch.equal(c["ids"], ids.masked_fill(mine, -1))
            addr = pool.expert_addresses(layer)
            assert c["addr"][on_host].tolist() == [1, 1, 1]
            others = [e for e in range(16) if e not in on_host]
            assert torch.equal(c["addr"][others], addr[others])
            assert c["lists"].chunks == ((1, 3, 5, 7, 9),) and c["lists"].experts == 5
            c["accumulate"]("sum")
            assert waited[-1] == (mailbox, "sum")
        assert all(calls[i]["ahead"] is calls[i + 1]["lists"] for i in range(2))
        posted.clear()
        wide = pool.forward(48, torch.zeros(48, 4, dtype=torch.int64))   # share 0 at 48
        assert posted == [] and all(c["accumulate"] is None for c in wide)
        assert all(c["lists"].experts == 8 for c in wide)
        assert pool.forward(3) and posted == []           # under the lists' threshold
