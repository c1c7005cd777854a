"""The GPU hands a step's experts to the host's CPU and takes the answer back inside a captured CUDA
graph (rawkernels/host_handoff.cu + HostExperts.serve), replayed with fresh inputs each time."""

from __future__ import annotations

import pytest
import torch

from cupool.hostexperts import HostExperts, Mailbox
from cupool.layout import RowLayout
from cupool.ops import host_handoff
from cupool.store import HostStore
from cupool.synthetic import random_experts

pytestmark = pytest.mark.gpu


def _store(layout, E, gen):
    """A sealed one-layer store of E random experts of `layout`."""
    rows, _ = random_experts(layout, E, gen)
    store = HostStore(1, E, layout.row_bytes)
    store.fill(lambda _l: rows, progress=False)
    store.seal()
    return store


@pytest.mark.parametrize("x_dtype,w_dtype,y_dtype,T,H", [
    (torch.bfloat16, torch.float32, torch.float32, 2, 80),
    (torch.float32, torch.float32, torch.float32, 2, 80),
    (torch.float16, torch.bfloat16, torch.bfloat16, 2, 80),
    (torch.bfloat16, torch.float16, torch.float16, 2, 80),
    (torch.bfloat16, torch.float32, torch.bfloat16, 7, 2064)])   # 15 blocks a post and a wait
def test_graph_replays_get_the_hosts_answer(x_dtype, w_dtype, y_dtype, T, H):
    """y (any start) += the host's answer, rounded once to y's dtype (as torch's y.add_ of a
    float32 tensor); the weights reach the host as float32; a grid of several blocks
    (host_handoff.blocks_for) counts its posts right."""
    K, E = 3, 5
    assert host_handoff.blocks_for(T * H) == (1 if T * H <= 1024 else 15)
    layout = RowLayout(H, 48)
    gen = torch.Generator().manual_seed(31)
    store = _store(layout, E, gen)
    mb = Mailbox(T, K, H)
    x = torch.empty(T, H, dtype=x_dtype, device="cuda")
    keys = torch.empty(T, K, dtype=torch.int64, device="cuda")
    w = torch.empty(T, K, dtype=w_dtype, device="cuda")
    y = torch.empty(T, H, dtype=y_dtype, device="cuda")
    error = torch.zeros(1, dtype=torch.int32, device="cuda")
    with HostExperts(store.host_addresses(), layout, threads=2) as hx:
        inputs = []
        for _ in range(5):
            xi = torch.randn(T, H, generator=gen).to(x_dtype)
            ki = torch.randint(-1, E, (T, K), generator=gen)
            ki[0, 0] = 1                            # a routed lane: a request is posted
            wi = torch.rand(T, K, generator=gen).to(w_dtype)
            inputs.append((xi, ki, wi, hx(xi.float(), ki, wi.float())))
        hx.serve(mb)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):            # warm-up (compiles) outside the capture
            host_handoff.post(x.copy_(inputs[0][0].cuda()), keys.copy_(inputs[0][1].cuda()),
                              w.copy_(inputs[0][2].cuda()), mb)
            host_handoff.wait(mb, y.zero_(), error)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            host_handoff.post(x, keys, w, mb)
            host_handoff.wait(mb, y, error)
        for xi, ki, wi, ref in inputs:
            x.copy_(xi.cuda())
            keys.copy_(ki.cuda())
            w.copy_(wi.cuda())
            start = torch.randn(T, H, generator=gen).to(y_dtype)
            y.copy_(start.cuda())
            graph.replay()
            torch.cuda.synchronize()
            assert int(error) == 0
            # the same C code on the same float32 x and weights, added as torch adds
            assert torch.equal(y.cpu(), start.clone().add_(ref))
        assert hx.stop_serving() == 1 + len(inputs)
    assert int(mb.counter[0]) == 1 + len(inputs) and int(mb.counter[1]) == 1
    assert int(mb.counter[2]) == 0                           # the blocks' count put back
    with pytest.raises(RuntimeError, match="the GPU posts to it"):
        mb.post(inputs[0][0].float().numpy(), inputs[0][1].numpy(), inputs[0][2].float().numpy())
    mb.close()
    store.close()


def test_a_post_with_no_routed_lane_sends_nothing():
    """Keys all -1 (a call the planner handed nothing over): no request (the host serves none,
    the number stays), and the wait adds nothing and does not wait; a routed call after it is
    answered as usual."""
    T, K, E, H = 2, 3, 4, 64
    layout = RowLayout(H, 64)
    gen = torch.Generator().manual_seed(32)
    store = _store(layout, E, gen)
    mb = Mailbox(T, K, H)
    x = torch.randn(T, H, generator=gen).cuda()
    w = torch.rand(T, K, generator=gen).cuda()
    error = torch.zeros(1, dtype=torch.int32, device="cuda")
    y = torch.full((T, H), 7.0, device="cuda")
    with HostExperts(store.host_addresses(), layout, threads=2) as hx:
        hx.serve(mb)
        host_handoff.post(x, torch.full((T, K), -1, dtype=torch.int64, device="cuda"), w, mb)
        host_handoff.wait(mb, y, error)
        torch.cuda.synchronize()
        assert int(mb.counter[0]) == 0 and int(mb.counter[1]) == 0
        assert torch.equal(y, torch.full((T, H), 7.0, device="cuda")) and int(error) == 0
        keys = torch.tensor([[0, -1, -1], [-1, -1, 2]])
        y.zero_()
        host_handoff.post(x, keys.cuda(), w, mb)
        host_handoff.wait(mb, y, error)
        torch.cuda.synchronize()
        assert int(mb.counter[0]) == 1 and int(mb.counter[1]) == 1 and int(error) == 0
        assert hx.stop_serving() == 1
        assert torch.equal(y.cpu(), hx(x.cpu(), keys, w.cpu()))
    mb.close()
    store.close()


def test_requests_of_fewer_tokens_than_the_mailbox_holds():
    """A mailbox of 7 tokens (2 blocks a full post) takes posts of 3, 7 and 1 tokens (a prefill
    call's are fewer than a decode step's): each answered over its own rows with the C code's
    bits (the pool's own call, made before it serves), the size word the post's lanes; a post of
    more rows than the mailbox holds is refused."""
    T, K, E, H = 7, 3, 6, 144
    layout = RowLayout(H, 64)
    gen = torch.Generator().manual_seed(33)
    store = _store(layout, E, gen)
    mb = Mailbox(T, K, H)
    error = torch.zeros(1, dtype=torch.int32, device="cuda")
    with HostExperts(store.host_addresses(), layout, threads=2) as hx:
        cases = []
        for t in (3, 7, 1):
            x = torch.randn(t, H, generator=gen).to(torch.bfloat16)
            keys = torch.randint(-1, E, (t, K), generator=gen)
            keys[0, 0] = 2                          # a routed lane: a request is posted
            w = torch.rand(t, K, generator=gen)
            cases.append((x, keys, w, hx(x.float(), keys, w)))
        hx.serve(mb)
        for x, keys, w, ref in cases:
            t = x.shape[0]
            start = torch.randn(t, H, generator=gen)
            y = start.cuda()
            host_handoff.post(x.cuda(), keys.cuda(), w.cuda(), mb)
            host_handoff.wait(mb, y, error)
            torch.cuda.synchronize()
            assert int(error) == 0 and mb.size == t * K
            assert torch.equal(y.cpu(), start.clone().add_(ref))
        assert hx.stop_serving() == len(cases)
    with pytest.raises(ValueError, match=r"x: expected 1 to 7 rows"):
        host_handoff.post(torch.zeros(8, H, device="cuda"),
                          torch.zeros(8, K, dtype=torch.int64, device="cuda"),
                          torch.zeros(8, K, device="cuda"), mb)
    mb.close()
    store.close()


def test_bad_arguments():
    mb = Mailbox(1, 2, 64)
    cpu_mb = Mailbox(1, 2, 64, pinned=False)
    x = torch.zeros(1, 64, dtype=torch.bfloat16, device="cuda")
    keys = torch.zeros(1, 2, dtype=torch.int64, device="cuda")
    w = torch.zeros(1, 2, dtype=torch.float32, device="cuda")
    with pytest.raises(ValueError, match=r"x: expected .*\[1, 64\]"):
        host_handoff.post(x[:, :32], keys, w, mb)
    with pytest.raises(ValueError, match="keys: expected a contiguous CUDA tensor of torch.int64"):
        host_handoff.post(x, keys.int(), w, mb)
    with pytest.raises(ValueError, match="weights"):
        host_handoff.post(x, keys, w.cpu(), mb)
    with pytest.raises(ValueError, match="not pinned"):
        host_handoff.post(x, keys, w, cpu_mb)
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="y: expected"):
        host_handoff.wait(mb, torch.zeros(1, 64, dtype=torch.int32, device="cuda"), err)
    with pytest.raises(ValueError, match="y: expected"):
        host_handoff.wait(mb, x[:, :32].contiguous(), err)
    with pytest.raises(ValueError, match="weights"):
        host_handoff.post(x, keys, w.to(torch.float64), mb)
    mb.close()
