"""moe_decode_ws.cu (warp-specialised decode) against moe_decode.cu and the float reference (GPU).

The two kernels split the work alike and sum in the same order, so their outputs must be equal
bit for bit; each is also checked against the float32 reference (tolerance as test_gpu_gemm).
"""

import pytest
import torch

from cupool.gemm import MoEGemm, reference_moe

from test_gpu_gemm import TOL, Placed, assert_counters_at_rest, rel_err, routing

pytestmark = pytest.mark.gpu


def pair_of_gemms(layout, K, dtype, max_tokens, **extra):
    base = MoEGemm(layout, K, dtype, max_decode_tokens=max_tokens, decode_kernel="fused")
    ws = MoEGemm(layout, K, dtype, max_decode_tokens=max_tokens, decode_kernel="fused")
    ws._fused_extra = {"WS": 1, **extra}
    return base, ws


def both(placed, base, ws, x, ids, w, **kw):
    outs = []
    for gemm in (base, ws):
        out = torch.full_like(x, float("nan"))
        gemm.decode(x, placed.lane_addr(ids), w, out=out, **kw)
        outs.append(out)
    torch.cuda.synchronize()
    return outs


@pytest.fixture(scope="module")
def qwen():
    return Placed(2048, 768, 13, seed=1)


@pytest.fixture(scope="module")
def small():
    return Placed(80, 48, 5, seed=2)        # padded: Hp=128, Ip=64


@pytest.mark.parametrize("T", [1, 2, 3, 7, 16])
@pytest.mark.parametrize("K", [1, 2, 8])
@pytest.mark.parametrize("extra", [{}, {"NBUF": 2, "QD": 2, "RD": 1}, {"STAGE": 2, "NBUF": 6}])
def test_ws_equals_fused_qwen_dims(qwen, T, K, extra):
    gen = torch.Generator().manual_seed(T * 100 + K)
    base, ws = pair_of_gemms(qwen.layout, K, torch.bfloat16, 16, **extra)
    x = torch.randn(T, 2048, generator=gen).to(torch.bfloat16).cuda()
    ids, w = routing(T, K, qwen.E, gen)
    ref = reference_moe(x, ids, w, qwen.deq)
    for _ in range(2):                  # a second call starts from the counters the first left
        a, b = both(qwen, base, ws, x, ids, w)
        assert not b.isnan().any()
        assert rel_err(b, ref) <= TOL
        assert torch.equal(a, b), f"max diff {float((a.float() - b.float()).abs().max())}"
    assert ws.read_error() == []
    assert_counters_at_rest(ws)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,K", [(1, 1), (3, 2), (16, 8), (33, 4)])
@pytest.mark.parametrize("w_dtype", ["same", torch.float32])
def test_ws_padded_dims_and_dtypes(small, T, K, dtype, w_dtype):
    gen = torch.Generator().manual_seed(T * 7 + K)
    base, ws = pair_of_gemms(small.layout, K, dtype, 64)
    x = torch.randn(T, 80, generator=gen).to(dtype).cuda()
    ids, w = routing(T, K, small.E, gen, dtype if w_dtype == "same" else w_dtype)
    a, b = both(small, base, ws, x, ids, w)
    assert rel_err(b, reference_moe(x, ids, w, small.deq)) <= TOL
    assert torch.equal(a, b)
    assert ws.read_error() == []
    assert_counters_at_rest(ws)


def test_ws_big_dims():
    placed = Placed(4096, 1536, 5, seed=3)
    gen = torch.Generator().manual_seed(9)
    for T, K in [(1, 2), (7, 4), (16, 8)]:
        base, ws = pair_of_gemms(placed.layout, K, torch.bfloat16, 16)
        x = torch.randn(T, 4096, generator=gen).to(torch.bfloat16).cuda()
        ids, w = routing(T, K, placed.E, gen)
        a, b = both(placed, base, ws, x, ids, w)
        assert rel_err(b, reference_moe(x, ids, w, placed.deq)) <= TOL
        assert torch.equal(a, b)
        assert ws.read_error() == []
    placed.store.close()


@pytest.mark.parametrize("T,K", [(1, 8), (4, 8), (9, 8)])
def test_ws_split_in_place_then_fresh(qwen, T, K):
    """Two launches (rows in place, then fresh rows) give the one-pass result bit for bit."""
    gen = torch.Generator().manual_seed(T * 31 + K)
    _, ws = pair_of_gemms(qwen.layout, K, torch.bfloat16, 16)
    x = torch.randn(T, 2048, generator=gen).to(torch.bfloat16).cuda()
    ids, w = routing(T, K, qwen.E, gen)
    ids[0, -1] = -1                                      # a padding lane
    la = qwen.lane_addr(ids)
    one = ws.decode(x, la, w).clone()
    fresh = torch.randint(0, 2, (qwen.E,), generator=gen).to(torch.int32).cuda()
    fresh = fresh[ids.clamp(min=0)].reshape(-1).contiguous()
    out = torch.full_like(x, float("nan"))
    ws.decode(x, la, w, out=out, lane_fresh=fresh, before_fresh=lambda: None)
    torch.cuda.synchronize()
    assert torch.equal(out, one)
    assert ws.read_error() == []
    assert_counters_at_rest(ws)


def test_ws_graph_replay(qwen):
    gen = torch.Generator().manual_seed(11)
    T, K = 4, 8
    base, ws = pair_of_gemms(qwen.layout, K, torch.bfloat16, 16)
    x = torch.randn(T, 2048, generator=gen).to(torch.bfloat16).cuda()
    ids, w = routing(T, K, qwen.E, gen)
    la = qwen.lane_addr(ids)
    out = torch.empty_like(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ws.decode(x, la, w, out=out)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ws.decode(x, la, w, out=out)
    for step in range(5):
        ids, w2 = routing(T, K, qwen.E, gen)
        x.copy_(torch.randn(T, 2048, generator=gen).to(torch.bfloat16))
        la.copy_(qwen.lane_addr(ids))
        w.copy_(w2)
        out.fill_(float("nan"))
        g.replay()
        eager = base.decode(x.clone(), la.clone(), w.clone())
        torch.cuda.synchronize()
        assert torch.equal(out, eager), f"replay {step} differs from moe_decode.cu"
