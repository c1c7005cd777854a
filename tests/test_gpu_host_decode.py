"""The host's CPU in the pool's decode calls (`Pool.enable_host_experts`, `cupool.layer.HostDecode`)
on the GPU: a decode call with lanes on the host equals the float reference within the int8
rounding of the host's lanes, the Engine's captured step runs with it (the host's counters move,
no error flags, the bank verified, pending rows landed), and turning it off restores the plain
step's tokens."""

from __future__ import annotations

import pytest
import torch
from test_gpu_engine import _generate, _prompts
from test_gpu_wrap import model_for
from tiny_models import FAMILIES

import cupool
from cupool.hostexperts import host_split, split_table
from cupool.layer import prefill_plan
from cupool.layout import unpack_row
from cupool.reference.moe import reference_moe
from cupool.sampling import SamplingParams
from cupool.synthetic import dequantize_exact

pytestmark = pytest.mark.gpu


def _pool(rows_div=2, tokens=3):
    family = "qwen3_moe"
    model = model_for(family, seed=41)
    _, (_, E, K, _, _) = FAMILIES[family]
    pool = cupool.wrap(model, rows=E // rows_div, max_decode_tokens=tokens,
                       max_prefill_tokens=64, progress=False)
    return model, pool, E, K


@pytest.mark.parametrize("leave", [False, True])
def test_decode_call_with_host_lanes_matches_the_reference(leave):
    model, pool, E, K = _pool()
    # a CPU far faster than the link: the host takes nearly every promoted miss (every miss but
    # one when they are left out of the bank)
    hd = pool.enable_host_experts(3, link_us=100.0, cpu_us=1.0, handoff_us=0.0, leave=leave)
    assert pool.bank.hosting and hd.split[4] == 4
    pool.open()
    H = pool.layout.hidden
    gen = torch.Generator(device="cpu").manual_seed(5)
    layer = 1
    experts = [tuple(None if m is None else dequantize_exact(m) for m in
                     unpack_row(pool.layout, pool.store.row(layer, e))) for e in range(E)]
    for call in range(6):
        x = torch.randn(3, H, generator=gen).to(torch.bfloat16).cuda()
        ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(3)]).cuda()
        w = torch.softmax(torch.randn(3, K, generator=gen), -1).cuda()
        y = pool.layers[layer].decode(x, ids, w)
        torch.cuda.synchronize()
        ref = reference_moe(x.float().cpu(), ids.cpu(), w.cpu(), experts, torch.float64)
        err = float((y.double().cpu() - ref).norm() / ref.norm())
        # the host's lanes carry int8 rounding of x and the act (about 1e-2, test_host_experts),
        # the GPU's bf16 (about 3e-3)
        assert err <= 3e-2, (call, err)
        if leave:
            assert not pool.bank.state()["pending"].any()
    assert int(pool.bank.tables.host_counters.sum()) > 0
    assert pool.errors() == []
    pool.disable_host_experts()
    pool.unwrap()


@pytest.mark.parametrize("leave", [False, True])
def test_engine_with_host_experts(leave):
    """leave: the host's misses left out of the bank (nothing copied behind, no row pending)."""
    model, pool, E, K = _pool()
    ps = _prompts([3, 2, 3, 1], seed=8)
    params = [SamplingParams(max_tokens=n) for n in (12, 8, 10, 9)]

    def run():
        return _generate(model, pool, ps, params)

    plain = run()
    hd = pool.enable_host_experts(3, link_us=100.0, cpu_us=20.0, handoff_us=5.0, leave=leave)
    assert hd.split.max() > 0 and hd.leave is leave
    with_host = run()
    assert [len(o) for o in with_host] == [len(o) for o in plain]
    stats = pool.stats()
    assert sum(s.get("host", 0) for s in stats) > 0, stats
    assert pool.errors() == []
    assert not pool.bank.state()["pending"].any()            # the step landed its copies
    assert pool.verify() > 0
    pool.disable_host_experts()
    assert run() == plain                                    # the host build with a zero split
    pool.unwrap()


def test_engine_runs_plain_steps_where_no_call_can_hand_over():
    """With the default min_misses (top_k + 1) a step of one active slot is a plain step (its own
    captured graph, nothing handed over), a step of three a host step; warm-up captures both
    kinds; the tokens are those of the pool without host experts."""
    model, pool, E, K = _pool()
    ps, params = _prompts([3], seed=9), [SamplingParams(max_tokens=6)]
    alone = _generate(model, pool, ps, params)
    hd = pool.enable_host_experts(3, link_us=100.0, cpu_us=20.0, handoff_us=5.0)
    assert not hd.hands_over(1) and hd.hands_over(3)
    eng = cupool.Engine(model, pool, max_batch=3, max_len=40, eos_token_id=[])
    eng.warmup()
    assert {k.host for k in eng._graphs} == {False, True}
    assert {k.greedy for k in eng._graphs if k.host} == {False, True}
    before = int(pool.bank.tables.host_counters.sum())
    assert [r.output_ids for r in eng.generate(ps, params)] == alone
    assert int(pool.bank.tables.host_counters.sum()) == before       # plain steps only
    three = _prompts([3, 2, 3], seed=10)
    eng.generate(three, [SamplingParams(max_tokens=8)] * 3)
    assert int(pool.bank.tables.host_counters.sum()) > before
    assert pool.errors() == [] and not pool.bank.state()["pending"].any()
    eng.close()
    pool.disable_host_experts()
    pool.unwrap()


@pytest.mark.parametrize("T", [40, 64])
def test_prefill_call_with_host_experts_matches_the_reference(T):
    """A prompt prefill call wide enough for the copy lists (T·K >= 4·E, inside
    `Pool.prefilling`) whose last experts without a bank row the host computes: the output
    equals the float reference within the host lanes' int8 rounding, the host answered one
    request of the call's lanes, the lists leave its experts out, and the next call (prefill
    ahead issued for it) and a call with the host's share off agree with the reference too."""
    model, pool, E, K = _pool()
    assert T * K >= 4 * E
    # a row on the link 100 µs (the copy engine's: a decode row's 1 µs does not count), on the
    # host 50 µs and nothing a call: the host takes 3 of the 4 experts a layer without a bank row
    hd = pool.enable_host_experts(3, link_us=1.0, cpu_us=20.0, handoff_us=0.0,
                                  prefill_tokens=64, prefill_costs=[(64, 50.0, 0.0)],
                                  prefill_link_us=100.0)
    pool.open()
    H = pool.layout.hidden
    gen = torch.Generator(device="cpu").manual_seed(6)
    experts = {layer: [tuple(None if m is None else dequantize_exact(m) for m in
                             unpack_row(pool.layout, pool.store.row(layer, e)))
                       for e in range(E)] for layer in (0, 1)}
    with pool.prefilling():
        for layer in (0, 1):
            missing = int((~pool.prefill_resident(layer)).sum())
            share = pool.host_prefill_share(layer, T)
            assert share == host_split(missing, 100.0, 50.0, 0.0) == 3 and missing == 4
            on_host = pool.host_prefill_experts(layer, share)
            assert pool.scratch_lists(layer, share).experts == missing - share
            assert not pool.prefill_resident(layer)[on_host].any()
            x = torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda()
            ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
            assert torch.isin(ids, torch.from_numpy(on_host)).any()     # lanes for the host
            w = torch.softmax(torch.randn(T, K, generator=gen), -1)
            calls = hd.hx.serve_stats()["calls"]
            y = pool.layers[layer](x, ids.cuda(), w.cuda())
            torch.cuda.synchronize()
            assert hd.hx.serve_stats()["calls"] == calls + 1
            assert hd.mailbox.size == T * K
            ref = reference_moe(x.float().cpu(), ids, w, experts[layer], torch.float64)
            err = float((y.double().cpu() - ref).norm() / ref.norm())
            assert err <= 3e-2, (layer, err)      # int8 x on the host's lanes, bf16 on the GPU's
    assert pool.errors() == []
    pool.disable_host_experts()
    with pool.prefilling():
        assert pool.host_prefill_share(1, T) == 0
        y = pool.layers[1](x, ids.cuda(), w.cuda())
        ref = reference_moe(x.float().cpu(), ids, w, experts[1], torch.float64)
        assert float((y.double().cpu() - ref).norm() / ref.norm()) <= 1e-2
    pool.unwrap()


def test_copy_engine_us_times_the_copies_a_prefill_call_makes():
    """`MoEGemm.copy_engine_us` makes a layer's scratch copies as a prefill call with lists
    does (every other expert of layer 1 lands in the poisoned scratch in rank order, byte for
    byte) and gives a finite µs a row; lists that copy nothing are refused. A pool's host
    prefill measures its link row this way (`prefill_link_us`)."""
    import numpy as np
    model, pool, E, K = _pool()
    gemm, R = pool.gemm, pool.layout.row_bytes
    resident = np.ones(E, dtype=bool)
    resident[1::2] = False
    lists = gemm.scratch_lists(1, resident, pool.store.host_addresses())
    scratch = gemm._p["scratch"]
    scratch.fill_(0xA5)
    us = gemm.copy_engine_us(lists, reps=2)
    assert np.isfinite(us) and us > 0
    got = scratch[:E // 2, :R].cpu().numpy()
    for r, e in enumerate(range(1, E, 2)):
        assert np.array_equal(got[r], pool.store.row(1, e)), (r, e)
    assert (scratch[E // 2:].cpu().numpy() == 0xA5).all()     # nothing past the listed rows
    # a prefill call with lists after the timing (which made the copy stream first) still
    # equals the reference
    H, T = pool.layout.hidden, 40
    gen = torch.Generator(device="cpu").manual_seed(8)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda()
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    w = torch.softmax(torch.randn(T, K, generator=gen), -1)
    experts = [tuple(None if m is None else dequantize_exact(m) for m in
                     unpack_row(pool.layout, pool.store.row(1, e))) for e in range(E)]
    pool.open()
    with pool.prefilling():
        assert prefill_plan(pool, 1, T)[0]                      # the lists' path
        y = pool.layers[1](x, ids.cuda(), w.cuda())
    ref = reference_moe(x.float().cpu(), ids, w, experts, torch.float64)
    assert float((y.double().cpu() - ref).norm() / ref.norm()) <= 1e-2
    with pytest.raises(ValueError, match="reps must be an int >= 1, got 0"):
        gemm.copy_engine_us(lists, reps=0)
    with pytest.raises(ValueError, match="lists copy no rows"):
        gemm.copy_engine_us(gemm.scratch_lists(1, np.ones(E, dtype=bool),
                                               pool.store.host_addresses()))
    hd = pool.enable_host_experts(3, link_us=100.0, cpu_us=20.0, prefill_tokens=64,
                                  prefill_costs=[(64, 50.0, 0.0)])
    assert np.isfinite(hd.prefill_link_us) and hd.prefill_link_us > 0
    pool.disable_host_experts()
    pool.unwrap()


def test_engine_prefill_with_host_experts():
    """The Engine's prompt prefill with the host's share on: the host answers prefill calls
    (more requests than the decode steps' alone), no error, and every request decodes its
    tokens."""
    model, pool, E, K = _pool()
    ps = _prompts([40, 33, 48], seed=11)            # 40·K, 33·K, 48·K lanes: the lists' path
    params = [SamplingParams(max_tokens=n) for n in (6, 5, 7)]
    plain = _generate(model, pool, ps, params, max_len=64)
    hd = pool.enable_host_experts(3, link_us=100.0, cpu_us=20.0, handoff_us=5.0,
                                  prefill_tokens=64, prefill_costs=[(16, 20.0, 2.0),
                                                                    (64, 50.0, 5.0)],
                                  prefill_link_us=100.0)
    assert hd.prefill_share(40, E // 2) > 0
    with_host = _generate(model, pool, ps, params, max_len=64)
    assert [len(o) for o in with_host] == [len(o) for o in plain]
    assert hd.hx.serve_stats()["calls"] > 0
    assert pool.errors() == []
    pool.disable_host_experts()
    pool.unwrap()


def test_host_experts_refuse_prefetch_and_plain_steps_for_other_widths():
    model, pool, E, K = _pool()
    pool.enable_prefetch()
    with pytest.raises(RuntimeError, match="separate planner builds"):
        pool.enable_host_experts(3)
    pool.disable_prefetch()
    pool.resize_bank(E // 2, prefetch=False)
    with pytest.raises(ValueError, match="tokens must be an int"):
        pool.enable_host_experts(0, link_us=50.0, cpu_us=50.0)
    with pytest.raises(ValueError, match="leave must be a bool, got 'yes'"):
        pool.enable_host_experts(3, link_us=50.0, cpu_us=50.0, leave="yes")
    with pytest.raises(ValueError, match="min_misses must be None or an int >= 0, got -1"):
        pool.enable_host_experts(3, link_us=50.0, cpu_us=50.0, min_misses=-1)
    with pytest.raises(ValueError, match="cpu_call_us must be a finite number >= 0, got nan"):
        pool.enable_host_experts(3, link_us=50.0, cpu_us=50.0, cpu_call_us=float("nan"))
    hd = pool.enable_host_experts(3, link_us=50.0, cpu_us=10.0, cpu_call_us=5.0, min_misses=5)
    assert not hd.split[:5].any() and hd.split[5:].all()
    assert hd.split.tolist() == split_table(pool.bank.max_lanes, 50.0, 10.0, 15.0, 5).tolist()
    hd = pool.enable_host_experts(3, link_us=50.0, cpu_us=50.0)
    assert hd.min_misses == K + 1 and not hd.split[:K + 1].any()      # the default
    assert hd.first_handed is not None and hd.first_handed >= K + 1
    assert not hd.hands_over(1) and hd.hands_over(3) == (3 * K >= hd.first_handed)
    pool.open()
    # a call of another width takes the plain step: nothing handed over, the right answer
    before = int(pool.bank.tables.host_counters.sum())
    x = torch.randn(2, pool.layout.hidden, dtype=torch.bfloat16, device="cuda")
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(2)]).cuda()
    w = torch.full((2, K), 1.0 / K, device="cuda")
    y = pool.layers[0].decode(x, ids, w)
    assert torch.isfinite(y).all() and int(pool.bank.tables.host_counters.sum()) == before
    pool.unwrap()


def test_serve_default_turns_host_experts_on_where_the_bank_misses(caplog, monkeypatch):
    """serve's default on a real pool: a bank of half the experts gets host experts (left out of
    the bank; the log gives the measured figures), one holding every expert does not (the log
    says why), on a machine with enough CPUs (stood in where it has fewer)."""
    import logging
    from types import SimpleNamespace

    from cupool import hostexperts
    from cupool.cli import AUTO_HOST_CPUS
    from cupool.serve import cli
    from cupool.serve.loader import auto_host_experts

    monkeypatch.setattr(hostexperts, "usable_cpus",
                        lambda real=hostexperts.usable_cpus: max(real(), AUTO_HOST_CPUS))
    log = logging.getLogger("cupool.test_gpu_serve_host")
    opts = SimpleNamespace(device="cuda", host_experts=None, max_batch=3, host_threads=2,
                           host_leave=True, host_min_misses=None, host_prefill_tokens=0)
    for rows_div, on in ((2, True), (1, False)):
        model, pool, E, K = _pool(rows_div=rows_div)
        assert (auto_host_experts(pool, 3) is None) is on
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=log.name):
            assert cli._host_experts_wanted(log, pool, opts) is on
            if on:
                cli._enable_host_experts(log, pool, opts)
        text = "\n".join(r.getMessage() for r in caplog.records)
        if on:
            assert pool.host is not None and pool.host.leave and pool.host.hx.threads == 2
            assert "host experts: 2 threads" in text and "left out of the bank" in text, text
            assert pool.host.link_us > 0 and pool.host.cpu_us > 0
            pool.disable_host_experts()
        else:
            assert pool.host is None
            assert f"the bank holds every expert ({E} rows a layer)" in text, text
            assert "--host-threads is unused" in text, text
        pool.unwrap()
