"""`MoEGemm.decode_routed` (moe_decode's ROUTE build: the RMSNorm, router GEMV and softmax top-k
folded into the decode GEMM's launch) against the references and the router's own launch (GPU).

Every output is poisoned before a call. What must hold: x is the RMSNorm of h (the router
launch's bits: the same order of sums); the logits are within a bf16 unit in the last place of
the router launch's (the dot products' sums run in another order than its MMAs'); ids, weights
and lane addresses are exactly the softmax top-k of the kernel's own logits (`route_topk`, the
table); out is within the decode GEMM's tolerance of the reference MoE over them; the counters
(decode's and the route count) are back at zero, with no error bits; a captured graph replays
to the same bits.
"""

import pytest
import torch
from test_gpu_gemm import TOL, Placed, assert_counters_at_rest, rel_err

from cupool.ops.dense_gemv import ROUTE, DenseGemv, RouteOut
from cupool.reference import dense as ref

pytestmark = pytest.mark.gpu


def within_bf16_ulp(got, want):
    got, want = got.float(), want.float()
    return bool(((got - want).abs() <= want.abs() * 2.0 ** -7 + 1e-30).all())


class Routed:
    """Placed experts every one of which has a "bank" row (the table), a router and its inputs."""

    def __init__(self, H, I, E, seed):
        self.placed = Placed(H, I, E, seed)
        p = self.placed
        # every expert at a bank row of its own, in another order than expert order
        perm = torch.randperm(E, generator=torch.Generator().manual_seed(seed))
        stride = p.bank.stride(0)
        self.table = torch.tensor([p.bank.data_ptr() + int(perm[e]) * stride for e in range(E)],
                                  dtype=torch.int64, device="cuda")
        self.row_of = perm
        gen = torch.Generator().manual_seed(seed + 1)
        self.router = (torch.randn(E, H, generator=gen) / H ** 0.5).to(torch.bfloat16).cuda()
        self.nw = (1 + 0.1 * torch.randn(H, generator=gen)).to(torch.bfloat16).cuda()
        self.E, self.H = E, H

    def reference(self, x, ids, w):
        """The MoE of x over ids (experts) through the table's rows."""
        rows = torch.where(ids >= 0, self.row_of.cuda()[ids.clamp(min=0).long()],
                           torch.full_like(ids, -1).long())
        return self.placed.reference(x, rows, w.float())


def poisoned(T, E, K, H, w_dtype):
    route = RouteOut.allocate(T, E, K, w_dtype, "cuda")
    route.logits.fill_(float("nan"))
    route.ids.fill_(7777)
    route.weights.fill_(float("nan"))
    return (route, torch.full((T, H), float("nan"), dtype=torch.bfloat16, device="cuda"),
            torch.full((T * K,), -5, dtype=torch.int64, device="cuda"),
            torch.full((T, H), float("nan"), dtype=torch.bfloat16, device="cuda"))


def call(gemm, r: Routed, h, route, x, lane_addr, out, active, norm_topk):
    return gemm.decode_routed(h, r.router, r.nw, 1e-6, norm_topk, r.table, x_out=x,
                              logits=route.logits, ids=route.ids, weights=route.weights,
                              lane_addr=lane_addr, count=route.ticket, active=active, out=out)


@pytest.fixture(scope="module")
def qwen():
    return Routed(2048, 768, 13, seed=3)


@pytest.fixture(scope="module")
def many():
    return Routed(80, 48, 600, seed=4)      # more experts than blocks: two logits a block


@pytest.mark.parametrize("placed_name,T,K,w_dtype,norm_topk", [
    ("qwen", 1, 8, torch.float32, True), ("qwen", 3, 4, torch.bfloat16, False),
    ("qwen", 16, 8, torch.bfloat16, True), ("many", 1, 8, torch.bfloat16, True),
    ("many", 9, 6, torch.float32, True)])
def test_decode_routed_matches_router_launch_and_reference(request, placed_name, T, K, w_dtype,
                                                           norm_topk):
    r = request.getfixturevalue(placed_name)
    gemm = r.placed.gemm(K, max_decode_tokens=16)
    assert gemm.routes_decode(T, r.E) is None
    gen = torch.Generator().manual_seed(T * 7 + K)
    h = (torch.randn(T, r.H, generator=gen) * 3).to(torch.bfloat16).cuda()
    active = torch.ones(T, dtype=torch.bool, device="cuda")
    if T > 1:
        active[T // 2] = False
    route, x, lane_addr, out = poisoned(T, r.E, K, r.H, w_dtype)
    call(gemm, r, h, route, x, lane_addr, out, active, norm_topk)
    torch.cuda.synchronize()
    assert gemm.read_error() == []
    assert_counters_at_rest(gemm)
    assert int(route.ticket.item()) == 0
    # the router's own launch on the same h
    router = DenseGemv([r.router], tokens=T, norm=True, epilogue=ROUTE, lane_addr=True)
    route2, x2, lane2, _ = poisoned(T, r.E, K, r.H, w_dtype)
    router(h, norm_weight=r.nw, eps=1e-6, x_out=x2, route=route2, top_k=K, norm_topk=norm_topk,
           active=active, table=r.table, lane_addr=lane2)
    torch.cuda.synchronize()
    assert torch.equal(x, x2), "x differs from the router launch's"
    assert within_bf16_ulp(route.logits, route2.logits)
    ids, w = ref.route_topk(route.logits.to(torch.bfloat16), K, norm_topk, w_dtype, active)
    assert torch.equal(route.ids, ids)
    torch.testing.assert_close(route.weights, w, rtol=1e-6 if w_dtype == torch.float32 else 0,
                               atol=0)
    assert torch.equal(lane_addr, ref.lane_addresses(route.ids, r.table))
    assert (route.ids[~active] == -1).all() and (lane_addr.view(T, K)[~active] == 0).all()
    assert not out.isnan().any()
    want = r.reference(x, route.ids, route.weights)
    assert rel_err(out, want) <= TOL, rel_err(out, want)


def test_decode_routed_graph_replays_to_the_same_bits(qwen):
    """Captured once, replayed five times on new h each: each replay equals an eager call on the
    same h, and the counters are back at zero after every one."""
    T, K = 2, 8
    gemm = qwen.placed.gemm(K, max_decode_tokens=4)
    h = torch.empty(T, qwen.H, dtype=torch.bfloat16, device="cuda")
    route, x, lane_addr, out = poisoned(T, qwen.E, K, qwen.H, torch.float32)
    gen = torch.Generator().manual_seed(11)
    h.copy_((torch.randn(T, qwen.H, generator=gen) * 3).to(torch.bfloat16))
    call(gemm, qwen, h, route, x, lane_addr, out, None, True)      # compiled, warmed up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(gemm, qwen, h, route, x, lane_addr, out, None, True)
    for _ in range(5):
        h.copy_((torch.randn(T, qwen.H, generator=gen) * 3).to(torch.bfloat16))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        got = out.clone()
        assert_counters_at_rest(gemm)
        assert int(route.ticket.item()) == 0
        call(gemm, qwen, h, route, x, lane_addr, out, None, True)
        torch.cuda.synchronize()
        assert torch.equal(got, out)
    assert gemm.read_error() == []


def test_decode_routed_refuses_bad_arguments(qwen):
    T, K = 1, 8
    gemm = qwen.placed.gemm(K, max_decode_tokens=4)
    h = torch.randn(T, qwen.H, device="cuda").to(torch.bfloat16)
    route, x, lane_addr, out = poisoned(T, qwen.E, K, qwen.H, torch.float32)

    def go(**kw):
        args = dict(x_out=x, logits=route.logits, ids=route.ids, weights=route.weights,
                    lane_addr=lane_addr, count=route.ticket, out=out)
        table = kw.pop("table", qwen.table)
        router = kw.pop("router", qwen.router)
        args.update(kw)
        gemm.decode_routed(h, router, qwen.nw, 1e-6, True, table, **args)

    with pytest.raises(ValueError, match="table must be a contiguous torch.int64"):
        go(table=qwen.table.to(torch.int32))
    with pytest.raises(ValueError, match="lane_addr must be"):
        go(lane_addr=lane_addr[1:])
    with pytest.raises(ValueError, match="router must be"):
        go(router=qwen.router.float())
    with pytest.raises(ValueError, match="logits must be"):
        go(logits=route.logits[:, 1:])
    with pytest.raises(ValueError, match=r"at most 4 tokens"):
        gemm.decode_routed(torch.zeros(5, qwen.H, dtype=torch.bfloat16, device="cuda"),
                           qwen.router, qwen.nw, 1e-6, True, qwen.table, x_out=x,
                           logits=route.logits, ids=route.ids, weights=route.weights,
                           lane_addr=lane_addr, count=route.ticket)
    assert "logits of 4 tokens need" in gemm.routes_decode(4, 20000)
    torch.cuda.synchronize()
    assert int(route.ticket.item()) == 0 and gemm.read_error() == []
