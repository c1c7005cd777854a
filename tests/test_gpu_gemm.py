"""The NVFP4 MoE GEMM against the dequantize-then-matmul float32 reference (GPU).

Weights of one call sit in three places at once: "bank" rows and "staging" rows (device memory)
and pinned host rows read through UVA. Outputs are poisoned (NaN) before every run. Tolerance:
relative Frobenius error ≤ 1e-2 for bf16 activations (the kernel's weights are exact, and so is
the pair's and prefill's power-of-two-scaled fp16 x for bf16 inputs; the error comes from SiLU·up
handed to w2 in bf16 and the bf16 output rounding, ~3e-3 in practice).
"""

import dataclasses
import math

import pytest
import torch

from cupool import HostStore
from cupool.activation import SILU, swiglu_clamp
from cupool.gemm import MoEGemm
from cupool.layout import RowLayout
from cupool.reference.moe import reference_moe
from cupool.synthetic import dequantize_exact, random_biases, random_experts

pytestmark = pytest.mark.gpu

TOL = 1e-2


def rel_err(out, ref):
    return (torch.linalg.norm(out.double() - ref.double()) / torch.linalg.norm(ref.double())).item()


class Placed:
    """E experts' rows spread over a device 'bank', device 'staging' rows and a pinned host store."""

    def __init__(self, H, I, E, seed, *, bias=False, activation=SILU, gated=True, gate_scale=None):
        """gated False: rows without gate strips (activation RELU2); gate_scale: a float written
        over every row's gate global scale (rows without a gate: one the kernels must not read)."""
        self.layout = RowLayout(H, I, bias=bias, gated=gated)
        self.activation = activation
        gen = torch.Generator().manual_seed(seed)
        b = random_biases(self.layout, E, gen) if bias else None
        rows, mats = random_experts(self.layout, E, gen, biases=b)
        if gate_scale is not None:
            rows[:, :4] = torch.tensor([gate_scale], dtype=torch.float32).view(torch.uint8)
        self.deq = [tuple(None if m is None else dequantize_exact(m).cuda() for m in trio)
                    for trio in mats]
        self.biases = None if b is None else [tuple(t[e].cuda() for t in b) for e in range(E)]
        self.store = HostStore(1, E, self.layout.row_bytes)
        self.store.fill(lambda _l: rows, progress=False)
        self.store.seal()
        stride = self.store.row_stride
        self.bank = torch.zeros(E, stride, dtype=torch.uint8, device="cuda")
        self.bank[:, :self.layout.row_bytes] = rows.cuda()
        # expert e lives in: bank (e % 3 == 0), staging (e % 3 == 1), host (e % 3 == 2)
        self.where = [("bank", "staging", "host")[e % 3] for e in range(E)]
        addr = []
        for e in range(E):
            if self.where[e] == "host":
                addr.append(self.store.address(0, e))
            else:
                addr.append(self.bank.data_ptr() + e * stride)
        self.addr = torch.tensor(addr, dtype=torch.int64, device="cuda")
        self.E = E

    def lane_addr(self, ids):
        a = self.addr[ids.clamp(min=0)]
        return torch.where(ids >= 0, a, torch.zeros_like(a)).reshape(-1)

    def prefill_error(self, gemm, x, ids, w):
        """Relative error of gemm.prefill (output poisoned first) against the reference, with
        the bank and staging experts resident and the host experts read through the scratch."""
        host = torch.tensor([wh == "host" for wh in self.where], device="cuda")
        expert_addr = torch.where(host, torch.zeros_like(self.addr), self.addr)
        out = torch.full_like(x, float("nan"))
        gemm.prefill(x, ids, w, expert_addr, host_addr=self.store.address_table(), out=out)
        return rel_err(out, self.reference(x, ids, w))

    def reference(self, x, ids, w):
        return reference_moe(x, ids, w, self.deq, activation=self.activation, biases=self.biases)

    def decode_twice(self, gemm, x, ids, w):
        """Two gemm.decode calls on poisoned outputs: both within TOL of the reference and the
        same bits; no error bits and counters at rest after. The output."""
        ref = self.reference(x, ids, w)
        first = None
        for _ in range(2):
            out = torch.full_like(x, float("nan"))
            gemm.decode(x, self.lane_addr(ids), w, out=out)
            assert not out.isnan().any()
            assert rel_err(out, ref) <= TOL, rel_err(out, ref)
            assert first is None or torch.equal(out, first), "a second call gave other bits"
            first = out
        assert gemm.read_error() == []
        assert_counters_at_rest(gemm)
        return out

    def gemm(self, K, **kw):
        """A MoEGemm for these experts (their layout and activation)."""
        return MoEGemm(self.layout, K, torch.bfloat16, activation=self.activation, **kw)


def routing(T, K, E, gen, dtype=torch.float32):
    if K <= E:                                          # distinct experts per token, as routers give
        ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).cuda()
    else:                                               # more lanes than experts: duplicates per token
        ids = torch.randint(0, E, (T, K), generator=gen).cuda()
    w = torch.softmax(torch.randn(T, K, generator=gen), dim=-1).to(dtype).cuda()
    return ids, w


@pytest.fixture(scope="module")
def qwen():
    return Placed(2048, 768, 13, seed=1)


@pytest.fixture(scope="module")
def small():
    return Placed(80, 48, 5, seed=2)        # padded: Hp=128, Ip=64


def assert_counters_at_rest(gemm):
    """moe_decode's ticket, finished and per-unit counters and the strip groups' arrival counters
    are back to zero after a call (the next call, or graph replay, starts from them)."""
    torch.cuda.synchronize()
    assert int(gemm._d["sync"].abs().sum()) == 0, gemm._d["sync"][:8].tolist()
    assert int(gemm._d["group_done"].abs().sum()) == 0


@pytest.mark.parametrize("T", [1, 2, 3, 7, 16])
@pytest.mark.parametrize("K", [1, 2, 8])
@pytest.mark.parametrize("kernel", ["fused", "pair"])
def test_decode_qwen_dims(qwen, T, K, kernel):
    gen = torch.Generator().manual_seed(T * 100 + K)
    gemm = MoEGemm(qwen.layout, K, torch.bfloat16, max_decode_tokens=16, decode_kernel=kernel)
    x = torch.randn(T, 2048, generator=gen).to(torch.bfloat16).cuda()
    ids, w = routing(T, K, qwen.E, gen)
    ref = reference_moe(x, ids, w, qwen.deq)
    first = None
    for _ in range(2):                  # a second call starts from the counters the first left
        out = torch.full_like(x, float("nan"))
        gemm.decode(x, qwen.lane_addr(ids), w, out=out)
        assert not out.isnan().any()
        assert rel_err(out, ref) <= TOL
        assert first is None or torch.equal(out, first), "a second call gave other bits"
        first = out
    assert gemm.read_error() == []
    assert_counters_at_rest(gemm)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,K", [(1, 1), (3, 2), (16, 8), (33, 4)])
@pytest.mark.parametrize("w_dtype", ["same", torch.float32])
@pytest.mark.parametrize("kernel", ["fused", "pair"])
def test_decode_padded_dims_and_dtypes(small, T, K, dtype, w_dtype, kernel):
    gen = torch.Generator().manual_seed(T * 7 + K)
    gemm = MoEGemm(small.layout, K, dtype, max_decode_tokens=64, decode_kernel=kernel)
    x = torch.randn(T, 80, generator=gen).to(dtype).cuda()
    ids, w = routing(T, K, small.E, gen, dtype if w_dtype == "same" else w_dtype)
    out = torch.full_like(x, float("nan"))
    gemm.decode(x, small.lane_addr(ids), w, out=out)
    assert rel_err(out, reference_moe(x, ids, w, small.deq)) <= TOL


@pytest.mark.parametrize("T", [1, 5])
def test_decode_and_prefill_misaligned_activations(small, T, prefill_config):
    """x whose base is not 16-byte aligned takes the scalar load path of the activation prep."""
    gen = torch.Generator().manual_seed(40 + T)
    K = 2
    gemm = MoEGemm(small.layout, K, torch.bfloat16, max_decode_tokens=8, max_prefill_tokens=16,
                   num_experts=small.E, prefill_config=prefill_config)
    buf = torch.randn(T * 80 + 1, generator=gen).to(torch.bfloat16).cuda()
    x = buf[1:].view(T, 80)
    assert x.data_ptr() % 16 != 0 and x.is_contiguous()
    ids, w = routing(T, K, small.E, gen, torch.bfloat16)
    ref = reference_moe(x, ids, w, small.deq)
    out = torch.full_like(x, float("nan"))
    gemm.decode(x, small.lane_addr(ids), w, out=out)
    assert rel_err(out, ref) <= TOL
    out = torch.full_like(x, float("nan"))
    gemm.prefill(x, ids, w, small.addr, out=out)
    assert rel_err(out, ref) <= TOL


def test_decode_padding_duplicates_nan_weight(small):
    gen = torch.Generator().manual_seed(5)
    T, K = 4, 3
    gemm = MoEGemm(small.layout, K, torch.bfloat16, max_decode_tokens=8)
    x = torch.randn(T, 80, generator=gen).to(torch.bfloat16).cuda()
    ids = torch.tensor([[0, 1, 2], [3, -1, 4], [0, 0, 1], [-1, -1, -1]], device="cuda")
    w = torch.rand(T, K, generator=gen).to(torch.bfloat16).cuda()   # the router's own dtype
    w[2, 2] = float("nan")                              # rejected lane: flag + padding
    out = torch.full_like(x, float("nan"))
    gemm.decode(x, small.lane_addr(ids), w, out=out)
    w_ref = w.clone()
    w_ref[2, 2] = 0
    ids_ref = ids.clone()
    ids_ref[2, 2] = -1
    ref = reference_moe(x, ids_ref, w_ref, small.deq)
    assert rel_err(out[:3], ref[:3]) <= TOL
    assert (out[3] == 0).all(), "a token whose lanes are all padding gets zeros"
    assert gemm.read_error() == ["non-finite router weight"]


def test_decode_wide_call_then_fused_call(small):
    """More than 256 lanes take route_decode + the w13/w2 pair even on a fused MoEGemm; the next
    narrow call (moe_decode) still starts from zeroed counters."""
    gen = torch.Generator().manual_seed(77)
    K = 5
    gemm = MoEGemm(small.layout, K, torch.bfloat16, max_decode_tokens=64)
    for T in (60, 3, 60, 2):                            # 300 lanes, 15, 300, 10
        x = torch.randn(T, 80, generator=gen).to(torch.bfloat16).cuda()
        ids, w = routing(T, K, small.E, gen)
        out = torch.full_like(x, float("nan"))
        gemm.decode(x, small.lane_addr(ids), w, out=out)
        assert rel_err(out, reference_moe(x, ids, w, small.deq)) <= TOL, T
        assert_counters_at_rest(gemm)
    assert gemm.read_error() == []


def test_decode_all_padding_gives_zeros(small):
    gemm = MoEGemm(small.layout, 2, torch.bfloat16, max_decode_tokens=4)
    x = torch.randn(2, 80, dtype=torch.bfloat16, device="cuda")
    out = torch.full_like(x, float("nan"))
    gemm.decode(x, torch.zeros(4, dtype=torch.int64, device="cuda"),
                torch.ones(2, 2, device="cuda"), out=out)
    assert (out == 0).all()


@pytest.fixture(scope="module")
def big():
    placed = Placed(4096, 1536, 5, seed=3)
    yield placed
    placed.store.close()


def test_decode_big_dims(big):
    placed = big
    gen = torch.Generator().manual_seed(9)
    for T, K, kernel in [(1, 2, "fused"), (7, 4, "fused"), (16, 8, "fused"), (7, 4, "pair"),
                         (16, 8, "pair")]:
        gemm = MoEGemm(placed.layout, K, torch.bfloat16, max_decode_tokens=16, decode_kernel=kernel)
        x = torch.randn(T, 4096, generator=gen).to(torch.bfloat16).cuda()
        ids, w = routing(T, K, placed.E, gen)
        out = torch.full_like(x, float("nan"))
        gemm.decode(x, placed.lane_addr(ids), w, out=out)
        assert rel_err(out, reference_moe(x, ids, w, placed.deq)) <= TOL, (T, K, kernel)


@pytest.mark.parametrize("T,K", [(1, 2), (33, 4), (511, 2)])
def test_prefill_big_dims(big, T, K, prefill_config):
    """H=4096, I=1536: moe_w2 cannot stage all of I for 64 lanes in two blocks' shared memory,
    so it streams I in double-buffered stages (cupool.ops.moe_gemm.w2_cols), unlike at Qwen3-30B-A3B dims."""
    gen = torch.Generator().manual_seed(T * 10 + K)
    gemm = MoEGemm(big.layout, K, torch.bfloat16, max_prefill_tokens=511, num_experts=big.E,
                   scratch_rows=1, prefill_config=prefill_config)
    x = torch.randn(T, 4096, generator=gen).to(torch.bfloat16).cuda()
    ids, w = routing(T, K, big.E, gen)
    assert big.prefill_error(gemm, x, ids, w) <= TOL
    assert gemm.read_error() == []


def check_splits_match_one_pass(gemm, x, la, w, ids, E, one, gen):
    """gemm.decode split by lane_fresh (per expert, as the plan step gives it: fresh or not, the
    same for all its lanes; none, all, random) equals `one`, the one-pass decode, bit for bit,
    with before_fresh called once between the launches."""
    for case in ("none", "all", "random"):
        pick = {"none": torch.zeros(E), "all": torch.ones(E),
                "random": torch.randint(0, 2, (E,), generator=gen)}[case]
        fresh = pick.to(torch.int32).cuda()[ids.clamp(min=0)].reshape(-1).contiguous()
        calls = []
        out = torch.full_like(x, float("nan"))
        gemm.decode(x, la, w, out=out, lane_fresh=fresh, before_fresh=lambda: calls.append(1))
        torch.cuda.synchronize()
        assert calls == [1], case
        assert torch.equal(out, one), f"split '{case}' differs from the one-pass decode"
        assert_counters_at_rest(gemm)


def check_graph_replay_matches_eager(placed, T, K, gen, replays):
    """A decode call captured in a CUDA graph, replayed on new x, routing and weights (output
    poisoned before each replay), equals the same call run eagerly bit for bit (the decode GEMM
    is deterministic) and the reference within TOL; the kernel's counters end at rest."""
    gemm = placed.gemm(K, max_decode_tokens=16)
    H = placed.layout.hidden
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda()
    ids, w = routing(T, K, placed.E, gen)
    la = placed.lane_addr(ids)
    out = torch.empty_like(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        gemm.decode(x, la, w, out=out)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gemm.decode(x, la, w, out=out)
    for step in range(replays):
        ids, w2 = routing(T, K, placed.E, gen)
        x.copy_(torch.randn(T, H, generator=gen).to(torch.bfloat16))
        la.copy_(placed.lane_addr(ids))
        w.copy_(w2)
        out.fill_(float("nan"))
        g.replay()
        eager = gemm.decode(x.clone(), la.clone(), w.clone())
        torch.cuda.synchronize()
        assert torch.equal(out, eager), f"replay {step} differs from eager (must be deterministic)"
        assert rel_err(out, placed.reference(x, ids, w)) <= TOL
    assert_counters_at_rest(gemm)


def test_decode_graph_replay_matches_eager(qwen):
    check_graph_replay_matches_eager(qwen, 4, 8, torch.Generator().manual_seed(11), replays=5)


@pytest.mark.parametrize("placed_name,T,K", [("qwen", 1, 8), ("qwen", 4, 8), ("small", 3, 2),
                                               ("small", 33, 4)])
def test_decode_split_in_place_then_fresh_is_bitwise_one_pass(request, placed_name, T, K):
    """lane_fresh splits the units into two launches (in place, then fresh, with before_fresh
    between); every lane's output and the fixed-order sum are unchanged, so the result equals
    the one-pass decode bit for bit, for any split (none, all, random, duplicates, padding)."""
    placed = request.getfixturevalue(placed_name)
    gen = torch.Generator().manual_seed(T * 31 + K)
    H = placed.layout.hidden
    gemm = MoEGemm(placed.layout, K, torch.bfloat16, max_decode_tokens=64)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda()
    ids, w = routing(T, K, placed.E, gen)
    ids[0, -1] = -1                                      # a padding lane
    la = placed.lane_addr(ids)
    one = gemm.decode(x, la, w).clone()
    ref = reference_moe(x, ids, w, placed.deq)
    assert rel_err(one, ref) <= TOL
    check_splits_match_one_pass(gemm, x, la, w, ids, placed.E, one, gen)
    with pytest.raises(ValueError, match="lane_fresh must be a contiguous int32"):
        gemm.decode(x, la, w, lane_fresh=torch.zeros(T * K, dtype=torch.int64, device="cuda"))
    with pytest.raises(TypeError, match="before_fresh must be callable"):
        gemm.decode(x, la, w, lane_fresh=torch.zeros(T * K, dtype=torch.int32, device="cuda"),
                    before_fresh=3)
    assert gemm.read_error() == []


def _decode_variants(request, placed_name: str, T: int, K: int, seed: int):
    """A decode call's inputs on fixture `placed_name` (random x and routing from `seed`) and
    `run(build)`: that build's launch on a poisoned output, checked for counters at rest after.
    Returns (placed, gemm, x, ids, w, run)."""
    placed = request.getfixturevalue(placed_name)
    gen = torch.Generator().manual_seed(seed)
    gemm = placed.gemm(K, max_decode_tokens=64)
    x = torch.randn(T, placed.layout.hidden, generator=gen).to(torch.bfloat16).cuda()
    ids, w = routing(T, K, placed.E, gen)
    la, wf = placed.lane_addr(ids), w.reshape(-1).contiguous()

    def run(build):
        out = torch.full_like(x, float("nan"))
        gemm.decoder.launch(build, x, la, None, wf, K, 2, gemm.decode_workspaces, out, gemm.error)
        assert_counters_at_rest(gemm)
        return out
    return placed, gemm, x, ids, w, run


@pytest.mark.parametrize("placed_name,T,K,blocks", [("qwen", 1, 8, 3), ("qwen", 4, 8, 1),
                                                      ("small", 33, 4, 2), ("gptoss", 1, 4, 2)])
def test_decode_fewer_blocks_same_bits(request, placed_name, T, K, blocks):
    """A launch of at most `blocks` blocks an SM (Build.blocks, the profilers' grid variant) takes
    the same items from the ticket, so its output equals the rules' grid's bit for bit (poisoned
    first), with counters at rest after."""
    placed, gemm, x, ids, w, run = _decode_variants(request, placed_name, T, K, T * 13 + blocks)
    full = gemm.decoder.choose(T * K, x, w.reshape(-1))
    builds = (full, dataclasses.replace(full, blocks=blocks))
    outs = [run(b) for b in builds]
    grids = [gemm.decoder._compile(b)[1] for b in builds]
    assert grids[1] == min(grids[0], blocks * gemm.decoder.sms), grids
    assert rel_err(outs[0], placed.reference(x, ids, w)) <= TOL
    assert torch.equal(outs[0], outs[1])
    assert gemm.read_error() == []


@pytest.mark.parametrize("placed_name,T,K,split", [("qwen", 1, 8, 2), ("qwen", 3, 8, 8),
                                                     ("qwen", 2, 8, 1), ("gptoss", 1, 4, 2)])
def test_decode_forced_w2_split(request, placed_name, T, K, split):
    """A build whose w2 strips are split over `split` warps (Build.w2_split forced, a profilers'
    variant) against the reference on poisoned outputs, with counters at rest after: its
    partial sums add in another order, so it is held to the same tolerance, not the same bits."""
    placed, gemm, x, ids, w, run = _decode_variants(request, placed_name, T, K, T * 17 + split)
    out = run(dataclasses.replace(gemm.decoder.choose(T * K, x, w.reshape(-1)), w2_split=split))
    assert rel_err(out, placed.reference(x, ids, w)) <= TOL
    assert gemm.read_error() == []


@pytest.mark.parametrize("T", [1, 2, 3, 7, 16, 33, 511, 2048])
@pytest.mark.parametrize("K", [1, 8])
def test_prefill_partition(qwen, T, K, prefill_config):
    gen = torch.Generator().manual_seed(T + K)
    E = qwen.E
    gemm = MoEGemm(qwen.layout, K, torch.bfloat16, max_prefill_tokens=2048, num_experts=E,
                   scratch_rows=2, prefill_config=prefill_config)  # several chunks of host experts
    x = torch.randn(T, 2048, generator=gen).to(torch.bfloat16).cuda()
    ids, w = routing(T, K, E, gen)
    assert qwen.prefill_error(gemm, x, ids, w) <= TOL
    assert gemm.read_error() == []


@pytest.mark.parametrize("rows,buffers", [(5, 3), (7, 4), (3, 5)])
def test_prefill_scratch_buffers(qwen, rows, buffers, prefill_config):
    """Chunks of rows // buffers experts in `buffers` buffers (at most one a row): a chunk's copy
    waits for the GEMM of the chunk `buffers` before it, never overwrites a buffer being read."""
    gen = torch.Generator().manual_seed(rows * 10 + buffers)
    T, K, E = 511, 8, qwen.E
    gemm = MoEGemm(qwen.layout, K, torch.bfloat16, max_prefill_tokens=T, num_experts=E,
                   scratch_rows=rows, scratch_buffers=buffers, prefill_config=prefill_config)
    assert gemm._nbuf == min(rows, buffers) and gemm._chunk == rows // gemm._nbuf
    x = torch.randn(T, 2048, generator=gen).to(torch.bfloat16).cuda()
    ids, w = routing(T, K, E, gen)
    assert qwen.prefill_error(gemm, x, ids, w) <= TOL
    assert gemm.read_error() == []
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="scratch_buffers must be an int >= 1"):
            MoEGemm(qwen.layout, K, torch.bfloat16, max_prefill_tokens=T, num_experts=E,
                    scratch_buffers=bad)


def check_prefill_int32_ids_bad_ids(placed, dtype, gen, prefill_config):
    """A prefill of 37 tokens (int32 ids, one out of range) with every expert on the host: the
    bad lane is padding and flagged; the rest equals the reference."""
    T, K, E = 37, 2, placed.E
    gemm = MoEGemm(placed.layout, K, dtype, max_prefill_tokens=64, num_experts=E, scratch_rows=1,
                   prefill_config=prefill_config, activation=placed.activation)
    x = torch.randn(T, placed.layout.hidden, generator=gen).to(dtype).cuda()
    ids, w = routing(T, K, E, gen)
    ids = ids.to(torch.int32)
    ids[3, 1] = E + 4                                    # out of range: flag + padding
    out = torch.full_like(x, float("nan"))
    gemm.prefill(x, ids, w, torch.zeros(E, dtype=torch.int64, device="cuda"),
                 host_addr=placed.store.address_table(), out=out)
    ids_ref = ids.clone()
    ids_ref[3, 1] = -1
    assert rel_err(out, placed.reference(x, ids_ref, w)) <= TOL
    assert gemm.read_error() == ["expert id outside [0, E)"]


def test_prefill_int32_ids_bad_ids_and_odd_experts(small, prefill_config):
    check_prefill_int32_ids_bad_ids(small, torch.float16, torch.Generator().manual_seed(21),
                                    prefill_config)


def test_guards(small):
    gemm = MoEGemm(small.layout, 2, torch.bfloat16, max_decode_tokens=4)
    x = torch.randn(2, 80, dtype=torch.bfloat16, device="cuda")
    la = torch.zeros(4, dtype=torch.int64, device="cuda")
    w = torch.ones(2, 2, device="cuda")
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        gemm.decode(x.float(), la, w)
    with pytest.raises(ValueError, match=r"shape \[T, 80\]"):
        gemm.decode(x[:, :64].contiguous(), la, w)
    with pytest.raises(ValueError, match="CUDA"):
        gemm.decode(x.cpu(), la, w)
    with pytest.raises(ValueError, match="K=3"):
        gemm.decode(x, torch.zeros(6, dtype=torch.int64, device="cuda"), torch.ones(2, 3, device="cuda"))
    with pytest.raises(ValueError, match="at most 4 tokens"):
        gemm.decode(torch.zeros(5, 80, dtype=torch.bfloat16, device="cuda"), la, torch.ones(5, 2, device="cuda"))
    with pytest.raises(ValueError, match="decode_kernel must be one of"):
        MoEGemm(small.layout, 2, torch.bfloat16, decode_kernel="tiles")
    with pytest.raises(RuntimeError, match="without prefill"):
        gemm.prefill(x, torch.zeros(2, 2, dtype=torch.int64, device="cuda"), w,
                     torch.zeros(5, dtype=torch.int64, device="cuda"))
    assert math.isfinite(TOL)


# --- gpt-oss experts: biases in the rows, clamped SwiGLU, H = I = 2880 ---------------------------
@pytest.fixture(scope="module")
def gptoss():
    placed = Placed(2880, 2880, 6, seed=12, bias=True, activation=swiglu_clamp(1.702, 7.0))
    yield placed
    placed.store.close()


@pytest.mark.parametrize("T", [1, 3, 16, 33])
@pytest.mark.parametrize("kernel", ["fused", "pair"])
def test_decode_gptoss(gptoss, T, kernel):
    """Decode at gpt-oss dims, top-4, rows in the bank, staging and host memory: within the
    reference's tolerance, the same bits on a second call, counters at rest."""
    K = 4
    gen = torch.Generator().manual_seed(T * 7 + len(kernel))
    gemm = gptoss.gemm(K, max_decode_tokens=33, decode_kernel=kernel)
    x = (torch.randn(T, 2880, generator=gen) * 2).to(torch.bfloat16).cuda()
    ids, w = routing(T, K, gptoss.E, gen)
    out = gptoss.decode_twice(gemm, x, ids, w)
    # counter-check: the bias-free SiLU reference of the same weights is far from the output
    assert rel_err(out, reference_moe(x, ids, w, gptoss.deq)) > 10 * TOL


@pytest.mark.parametrize("T", [1, 3, 16, 33, 511])
def test_prefill_gptoss(gptoss, T, prefill_config):
    K = 4
    gen = torch.Generator().manual_seed(T + 100)
    gemm = gptoss.gemm(K, max_prefill_tokens=511, num_experts=gptoss.E, scratch_rows=2,
                       prefill_config=prefill_config)
    x = (torch.randn(T, 2880, generator=gen) * 2).to(torch.bfloat16).cuda()
    ids, w = routing(T, K, gptoss.E, gen)
    assert gptoss.prefill_error(gemm, x, ids, w) <= TOL
    assert gemm.read_error() == []


def test_biased_padded_dims_fp16():
    """Biases and the clamp at padded dims (H=80 -> Hp=128, I=48 -> Ip=64) with fp16
    activations: bias padding and the H < Hp tail."""
    placed = Placed(80, 48, 5, seed=13, bias=True, activation=swiglu_clamp(1.702, 7.0))
    gen = torch.Generator().manual_seed(14)
    for T, K, kernel in [(1, 4, "fused"), (3, 2, "fused"), (16, 4, "pair"), (33, 4, "fused")]:
        gemm = MoEGemm(placed.layout, K, torch.float16, max_decode_tokens=33,
                       decode_kernel=kernel, activation=placed.activation)
        x = torch.randn(T, 80, generator=gen).to(torch.float16).cuda()
        ids, w = routing(T, K, placed.E, gen)
        out = torch.full_like(x, float("nan"))
        gemm.decode(x, placed.lane_addr(ids), w, out=out)
        assert rel_err(out, placed.reference(x, ids, w)) <= TOL, (T, K, kernel)
    gemm = MoEGemm(placed.layout, 4, torch.bfloat16, max_prefill_tokens=64, num_experts=5,
                   scratch_rows=1, activation=placed.activation)
    x = torch.randn(37, 80, generator=gen).to(torch.bfloat16).cuda()
    ids, w = routing(37, 4, 5, gen)
    assert placed.prefill_error(gemm, x, ids, w) <= TOL
    placed.store.close()


# --- prefill ahead: align_experts' ALL_HOST build, host lists, copies issued for the next call --
@pytest.mark.parametrize("E, rows, buffers, T, K", [(37, 5, 2, 29, 4), (128, 32, 2, 129, 8),
                                                    (9, 1, 1, 3, 2), (1024, 32, 2, 77, 8)])
def test_align_all_host_matches_the_reference(small, E, rows, buffers, T, K):
    """The ALL_HOST build against `cupool.reference.moe.align_experts` on poisoned outputs:
    phase offsets, unit addresses and counts, each expert's lanes, copy lists; and the copy
    engine's runs the GEMM works out on the host (`scratch_lists`) move exactly the rows of
    the kernel's copy lists, chunk by chunk."""
    from cupool.reference.moe import align_experts
    gen = torch.Generator().manual_seed(E + T)
    gemm = MoEGemm(small.layout, K, torch.bfloat16, max_prefill_tokens=T, num_experts=E,
                   scratch_rows=rows, scratch_buffers=buffers)
    p, nt, layer = gemm._p, gemm.prefill_config.nt, 5
    host_rows = torch.randint(1, 1 << 40, (6 * E,), generator=gen).numpy() * 16
    for share in (0.0, 0.5, 1.0):
        ids = torch.randint(-1, E, (T, K), generator=gen).cuda()
        w = torch.rand(T, K, generator=gen).cuda()
        res = torch.rand(E, generator=gen) < share
        addr = torch.where(res, torch.randint(1, 1 << 40, (E,), generator=gen),
                           torch.zeros(E, dtype=torch.int64)).cuda()
        x = torch.zeros(T, small.layout.hidden, dtype=torch.bfloat16, device="cuda")
        for name in ("phase_off", "unit_addr", "unit_lanes", "unit_count", "copies", "n_copies"):
            p[name].fill_(-7)
        gemm.clear_error()
        gemm._align(x, ids.reshape(-1), w.reshape(-1), T * K, layer, addr, p["nchunks"], True)
        ref = align_experts(ids.reshape(-1).tolist(), w.reshape(-1).tolist(), E, layer,
                            addr.tolist(), p["scratch"].data_ptr(), p["scratch"].stride(0),
                            gemm._chunk, gemm._nbuf, p["nchunks"], nt, all_host=True)
        torch.cuda.synchronize()
        assert p["phase_off"].tolist() == ref["phase_off"]
        assert p["n_copies"].tolist() == ref["n_copies"]
        n = len(ref["copies"])
        copies = [tuple(c) for c in p["copies"][:n].tolist()]
        assert copies == ref["copies"]
        U = len(ref["units"])
        assert p["unit_addr"][:U].tolist() == [a for _, a, _ in ref["units"]]
        assert p["unit_count"][:U].tolist() == [c for _, _, c in ref["units"]]
        lanes = p["unit_lanes"].reshape(-1, nt)[:U].tolist()
        got: dict[int, set] = {}
        for (e, _, c), row in zip(ref["units"], lanes):
            got.setdefault(e, set()).update(row[:c])
        assert got == ref["expert_lanes"]
        assert gemm.read_error() == []
        lists = gemm.scratch_lists(layer, res.numpy(), host_rows)
        stride, nbytes = p["scratch"].stride(0), small.layout.row_bytes
        moved = [(dst + i * stride, src + i * stride) for chunk in lists.chunks
                 for dst, src, size in chunk for i in range((size - nbytes) // stride + 1)]
        base = p["scratch"].data_ptr()
        assert moved == [(base + stride * r, int(host_rows[k])) for k, r in copies]
        assert lists.layer == layer and lists.experts == n
    with pytest.raises(ValueError, match=rf"resident must be bool \[{E}\]"):
        gemm.scratch_lists(layer, res.numpy()[:-1], host_rows)
    with pytest.raises(ValueError, match="host_rows must be int64"):
        gemm.scratch_lists(layer, res.numpy(), host_rows[:5 * E])


class Layers:
    """L layers of E experts in a pinned host store, some of each layer's rows also in a device
    'bank' (expert_addr ≠ 0), the rest read through the prefill scratch."""

    def __init__(self, H, I, L, E, seed, resident_share=0.5):
        self.layout = RowLayout(H, I)
        gen = torch.Generator().manual_seed(seed)
        per = [random_experts(self.layout, E, gen) for _ in range(L)]
        self.deq = [[tuple(dequantize_exact(m).cuda() for m in trio) for trio in mats]
                    for _, mats in per]
        self.store = HostStore(L, E, self.layout.row_bytes)
        self.store.fill(lambda l: per[l][0], progress=False)
        self.store.seal()
        stride = self.store.row_stride
        self.bank = torch.zeros(L * E, stride, dtype=torch.uint8, device="cuda")
        self.bank[:, :self.layout.row_bytes] = torch.cat([rows for rows, _ in per]).cuda()
        res = torch.rand(L, E, generator=gen) < resident_share
        base = self.bank.data_ptr() + torch.arange(L * E).reshape(L, E) * stride
        self.addr = torch.where(res, base, torch.zeros_like(base)).cuda()
        self.L, self.E = L, E

    def lists(self, gemm, layer):
        """The copy engine's lists of `layer` for this placement."""
        return gemm.scratch_lists(layer, (self.addr[layer] != 0).cpu().numpy(),
                                  self.store.host_addresses())

    def run(self, gemm, calls, gen):
        """gemm.prefill over calls [(layer, T, ahead layer or None, host lists)], each on fresh
        activations and routing, outputs poisoned; each within TOL of the reference. Outputs.
        The lists of one layer are made once, so an announced call gets the lists announced."""
        outs, made = [], {}
        lists_of = lambda l: made.setdefault(l, self.lists(gemm, l))   # noqa: E731
        for layer, T, nxt, listed in calls:
            x = torch.randn(T, self.layout.hidden, generator=gen).to(torch.bfloat16).cuda()
            ids, w = routing(T, gemm.topk, self.E, gen)
            out = torch.full_like(x, float("nan"))
            gemm.prefill(x, ids, w, self.addr[layer], host_addr=self.store.address_table(),
                         layer=layer, out=out, lists=lists_of(layer) if listed else None,
                         ahead=None if nxt is None else lists_of(nxt))
            err = rel_err(out, reference_moe(x, ids, w, self.deq[layer]))
            assert err <= TOL, (layer, err)
            outs.append(out)
        assert gemm.read_error() == []
        return outs


@pytest.mark.parametrize("E, rows, buffers", [(13, 2, 2), (37, 5, 3), (37, 32, 2), (13, 1, 1)])
def test_prefill_ahead_over_layers(E, rows, buffers):
    """Calls over several layers with host lists (every expert without a bank row copied by the
    copy engine), each announcing the next (first chunk copies issued at the end of the call
    before), equal the reference within TOL, as the same calls on the plain path do (lane
    order inside an expert is not fixed: not bitwise); every announced call uses its chunks.
    Then announcements the next call does not honour (another layer, a call without lists, a
    call after drop_ahead) are dropped, counted, and every output stays right. Lists of
    another layer and ahead without lists are errors."""
    L, K = 5, 4
    placed = Layers(2048, 768, L, E, seed=E + rows)
    gen = torch.Generator().manual_seed(rows * 7 + buffers)
    mk = lambda: MoEGemm(placed.layout, K, torch.bfloat16, max_prefill_tokens=160,  # noqa: E731
                         num_experts=E, scratch_rows=rows, scratch_buffers=buffers)
    ahead, plain = mk(), mk()
    sizes = [129, 160, 33, 129, 7]
    calls = [(l, sizes[l], l + 1 if l + 1 < L else None, True) for l in range(L)]
    a = placed.run(ahead, calls, torch.Generator().manual_seed(3))
    b = placed.run(plain, [(l, T, None, False) for l, T, _, _ in calls],
                   torch.Generator().manual_seed(3))
    for x, y in zip(a, b):
        assert rel_err(x, y) <= TOL
    assert (ahead.ahead_used, ahead.ahead_dropped) == (L - 1, 0)
    assert (plain.ahead_used, plain.ahead_dropped) == (0, 0)
    wrong = [(0, 129, 2, True), (1, 129, 2, True),        # announced 2, layer 1 comes: dropped
             (2, 64, 3, True), (3, 64, None, False),      # layer 3 without lists: dropped
             (4, 50, 0, True), (0, 50, 1, True)]          # 0 used; 1 announced, then dropped
    placed.run(ahead, wrong, gen)
    ahead.drop_ahead()
    placed.run(ahead, [(1, 77, None, True)], gen)
    assert (ahead.ahead_used, ahead.ahead_dropped) == (L - 1 + 2, 3)
    args = (torch.zeros(2, 2048, dtype=torch.bfloat16, device="cuda"),
            torch.zeros(2, K, dtype=torch.int64, device="cuda"), torch.ones(2, K, device="cuda"),
            placed.addr[0])
    with pytest.raises(ValueError, match="ahead needs lists"):
        ahead.prefill(*args, host_addr=placed.store.address_table(),
                      ahead=placed.lists(ahead, 1))
    with pytest.raises(ValueError, match="lists are layer 1's, the call is layer 0's"):
        ahead.prefill(*args, lists=placed.lists(ahead, 1))
    with pytest.raises(TypeError, match="lists must be None or a cupool.gemm.ScratchLists"):
        ahead.prefill(*args, lists=(1, placed.addr[1]))


@pytest.mark.parametrize("E, rows, buffers", [(37, 5, 2), (13, 2, 2), (128, 32, 2)])
def test_prefill_runs_only_the_chunks_its_rows_fill(E, rows, buffers):
    """host_experts (how many of the layer's experts lack a bank row) and host lists bound the
    scratch chunks a call runs: calls over layers with every expert, most, half and none of them
    resident, narrow ones (T·K below E) with host_experts and wide ones with lists announcing
    the next (a layer with nothing to copy announcing one with rows, and the reverse), equal the
    same calls over every chunk within TOL, and every announced call uses what was issued. A
    count below the layer's own is flagged, never read past the scratch; a bad value is an
    error naming it."""
    L, K = 4, 4
    placed = Layers(2048, 768, L, E, seed=E + 3 * rows)
    res = torch.ones(L, E, dtype=torch.bool)
    res[1, ::5] = False                                    # most resident
    res[2, ::2] = False                                    # half
    res[3] = False                                         # none
    base = placed.bank.data_ptr() + torch.arange(L * E).reshape(L, E) * placed.store.row_stride
    placed.addr = torch.where(res, base, torch.zeros_like(base)).cuda()
    missing = [int((~res[l]).sum()) for l in range(L)]
    mk = lambda: MoEGemm(placed.layout, K, torch.bfloat16, max_prefill_tokens=160,  # noqa: E731
                         num_experts=E, scratch_rows=rows, scratch_buffers=buffers)
    bounded, full = mk(), mk()
    host = placed.store.address_table()
    gen = torch.Generator().manual_seed(E)
    narrow = max(1, E // (2 * K))
    for layer in range(L):
        x = torch.randn(narrow, 2048, generator=gen).to(torch.bfloat16).cuda()
        ids, w = routing(narrow, K, E, gen)
        outs = []
        for gemm, count in ((bounded, missing[layer]), (full, None)):
            out = torch.full_like(x, float("nan"))
            gemm.prefill(x, ids, w, placed.addr[layer], host_addr=host, layer=layer, out=out,
                         host_experts=count)
            outs.append(out)
        assert rel_err(outs[0], reference_moe(x, ids, w, placed.deq[layer])) <= TOL, layer
        assert rel_err(outs[0], outs[1]) <= TOL, layer
    order = [0, 3, 0, 2, 1, 0]                             # none -> all -> none -> half -> ...
    calls = [(l, 129, order[i + 1] if i + 1 < len(order) else None, True)
             for i, l in enumerate(order)]
    a = placed.run(bounded, calls, torch.Generator().manual_seed(5))
    b = placed.run(full, [(l, T, None, False) for l, T, _, _ in calls],
                   torch.Generator().manual_seed(5))
    for x, y in zip(a, b):
        assert rel_err(x, y) <= TOL
    assert (bounded.ahead_used, bounded.ahead_dropped) == (len(order) - 1, 0)
    assert bounded.read_error() == [] and full.read_error() == []
    if narrow * K > bounded._chunk:                        # too few chunks for layer 3's rows
        x = torch.randn(narrow, 2048, generator=gen).to(torch.bfloat16).cuda()
        ids = torch.arange(narrow * K, device="cuda").remainder(E).reshape(narrow, K)
        bounded.prefill(x, ids, torch.ones(narrow, K, device="cuda"), placed.addr[3],
                        host_addr=host, layer=3, host_experts=1)
        assert bounded.read_error() == ["more host experts than scratch chunks (internal)"]
        bounded.clear_error()
    for bad in (-1, E + 1, True, 2.0):
        with pytest.raises(ValueError, match=rf"host_experts must be None or an int in \[0, {E}\]"):
            bounded.prefill(x, ids, w, placed.addr[0], host_addr=host, host_experts=bad)
