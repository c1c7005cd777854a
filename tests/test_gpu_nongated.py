"""Experts without a gate (Nemotron-H: down(ReLU(up·x)²), rows of up strips alone, ROW_GATED=0,
ACT 2) on the GPU: moe_decode (one launch), the pair (route_decode + moe_w13 + moe_w2) and
prefill against the dequantize-then-matmul float32 reference, and a wrapped tiny Nemotron-H model
against itself unwrapped.

Kernel tests (test_gpu_gemm's `Placed`: each expert's row in the bank, in staging rows or in
pinned host memory read through UVA): fresh inputs from the `rng` fixture's seed (printed on
failure), outputs poisoned with NaN before every call, the rows' gate global scale (unused
without a gate) poisoned with NaN too, so a kernel that reads it fails. Sizes: Nemotron-3-Nano
dims (H=2688, I=1856: 42 chunks a w13 strip, 29 a w2 strip, 116 act strips), padded odd dims
(H=80, I=48 -> Hp=128, Ip=64), calls from 1 token to past the one-launch decode's 256 lanes.
Tolerance: test_gpu_gemm's TOL, relative Frobenius error ≤ 1e-2: the weights are exact, the
error is ReLU(up)² handed to w2 in bf16 (relative 2^-9 an element, as SiLU·up) and the output's
rounding. Counter-check: the reference with ReLU(up) unsquared is far from every output.

Model tests: test_gpu_wrap's and test_gpu_engine_hybrid's metrics and tolerances (their
docstrings): the prompt's logits within 3e-2, the engine's tokens (half the experts banked,
graph captured, gate open) on the reference's argmax up to MAX_OFF near-ties, each pooled layer
within 1e-2 of the float reference of its rows at decode and prefill widths.
"""

import pytest
import torch
from test_gpu_engine import MAX_OFF, _check_against_reference, _prompts
from test_gpu_gemm import (TOL, Placed, check_graph_replay_matches_eager,
                           check_prefill_int32_ids_bad_ids, check_splits_match_one_pass, rel_err,
                           routing)
from tiny_models import HYBRID_FAMILIES, hybrid_model

import cupool
from cupool.activation import RELU2, SILU
from cupool.gemm import MoEGemm
from cupool.layout import RowLayout
from cupool.reference.moe import reference_moe
from cupool.sampling import SamplingParams

pytestmark = pytest.mark.gpu

LOGIT_TOL = 3e-2          # test_gpu_wrap's


def _relu_unsquared(gate, up):
    return torch.relu(up)


def seed_of(rng) -> int:
    return int(rng.integers(1 << 31))


def nongated(H, I, E, seed):
    return Placed(H, I, E, seed, gated=False, activation=RELU2, gate_scale=float("nan"))


@pytest.fixture(scope="module")
def nemotron():
    placed = nongated(2688, 1856, 10, seed=41)
    yield placed
    placed.store.close()


@pytest.fixture(scope="module")
def small():
    placed = nongated(80, 48, 5, seed=42)
    yield placed
    placed.store.close()


def test_rows_and_fixtures_are_what_the_tests_claim(nemotron, small):
    for placed in (nemotron, small):
        assert not placed.layout.gated and placed.activation is RELU2
        assert all(d[0] is None for d in placed.deq)
        row = placed.store.row(0, 0)
        assert torch.from_numpy(row[:4].copy()).view(torch.float32).isnan().all()
        assert set(placed.where) == {"bank", "staging", "host"}
    assert (small.layout.hp, small.layout.ip) == (128, 64)


def _decode_twice(gemm, placed, x, ids, w):
    """Two decode calls on poisoned outputs: both within TOL of the reference, the same bits, far
    from the unsquared ReLU's reference; counters at rest and no error bits after."""
    out = placed.decode_twice(gemm, x, ids, w)
    assert rel_err(out, reference_moe(x, ids, w, placed.deq, activation=_relu_unsquared)) > 10 * TOL
    return out


@pytest.mark.parametrize("T", [1, 2, 3, 11, 42])
@pytest.mark.parametrize("kernel", ["fused", "pair"])
def test_decode_nemotron_dims(nemotron, rng, T, kernel):
    """Top-6 at Nemotron-3-Nano dims: units of 8 lanes at 3 and 4 blocks an SM (T=1, 2..10) and
    of 16 (T ≥ 11, up to the one-launch decode's 256 lanes at T=42)."""
    K = 6
    gen = torch.Generator().manual_seed(seed_of(rng))
    gemm = nemotron.gemm(K, max_decode_tokens=42, decode_kernel=kernel)
    x = torch.randn(T, 2688, generator=gen).to(torch.bfloat16).cuda()
    ids, w = routing(T, K, nemotron.E, gen)
    _decode_twice(gemm, nemotron, x, ids, w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,K", [(1, 1), (3, 2), (16, 8), (33, 4), (60, 5)])
@pytest.mark.parametrize("kernel", ["fused", "pair"])
def test_decode_padded_dims_and_dtypes(small, rng, T, K, dtype, kernel):
    """H=80, I=48 (Hp=128, Ip=64: padded columns and rows), bf16 and fp16, router weights in the
    activations' dtype; K=8 > E=5 repeats experts in a token; T=60, K=5 is 300 lanes, past the
    one-launch decode: the pair runs it on a "fused" MoEGemm too."""
    gen = torch.Generator().manual_seed(seed_of(rng))
    gemm = MoEGemm(small.layout, K, dtype, max_decode_tokens=64, decode_kernel=kernel,
                   activation=RELU2)
    x = torch.randn(T, 80, generator=gen).to(dtype).cuda()
    ids, w = routing(T, K, small.E, gen, dtype)
    _decode_twice(gemm, small, x, ids, w)


def test_decode_padding_duplicates_nan_weight(small, rng):
    gen = torch.Generator().manual_seed(seed_of(rng))
    T, K = 4, 3
    gemm = MoEGemm(small.layout, K, torch.bfloat16, max_decode_tokens=8, activation=RELU2)
    x = torch.randn(T, 80, generator=gen).to(torch.bfloat16).cuda()
    ids = torch.tensor([[0, 1, 2], [3, -1, 4], [0, 0, 1], [-1, -1, -1]], device="cuda")
    w = torch.rand(T, K, generator=gen).to(torch.bfloat16).cuda()
    w[2, 2] = float("nan")                              # rejected lane: flag + padding
    out = torch.full_like(x, float("nan"))
    gemm.decode(x, small.lane_addr(ids), w, out=out)
    w_ref, ids_ref = w.clone(), ids.clone()
    w_ref[2, 2], ids_ref[2, 2] = 0, -1
    assert rel_err(out[:3], small.reference(x, ids_ref, w_ref)[:3]) <= TOL
    assert (out[3] == 0).all(), "a token whose lanes are all padding gets zeros"
    assert gemm.read_error() == ["non-finite router weight"]


@pytest.mark.parametrize("placed_name,T,K", [("nemotron", 1, 6), ("nemotron", 5, 6),
                                               ("small", 33, 4)])
def test_decode_split_in_place_then_fresh_is_bitwise_one_pass(request, rng, placed_name, T, K):
    """lane_fresh splits the units into two launches; the result equals the one-pass decode bit
    for bit (test_gpu_gemm's test of the same name)."""
    placed = request.getfixturevalue(placed_name)
    gen = torch.Generator().manual_seed(seed_of(rng))
    gemm = placed.gemm(K, max_decode_tokens=64)
    x = torch.randn(T, placed.layout.hidden, generator=gen).to(torch.bfloat16).cuda()
    ids, w = routing(T, K, placed.E, gen)
    ids[0, -1] = -1                                      # a padding lane
    la = placed.lane_addr(ids)
    one = gemm.decode(x, la, w).clone()
    assert rel_err(one, placed.reference(x, ids, w)) <= TOL
    check_splits_match_one_pass(gemm, x, la, w, ids, placed.E, one, gen)
    assert gemm.read_error() == []


def test_decode_graph_replay_matches_eager(nemotron, rng):
    check_graph_replay_matches_eager(nemotron, 4, 6, torch.Generator().manual_seed(seed_of(rng)),
                                     replays=4)


@pytest.mark.parametrize("T", [1, 7, 33, 511])
def test_prefill_nemotron_dims(nemotron, rng, T, prefill_config):
    """The partition path at Nemotron-3-Nano dims: resident experts, then the host experts
    through a scratch of 2 rows (chunks of one expert, several chunks a call)."""
    K = 6
    gen = torch.Generator().manual_seed(seed_of(rng))
    gemm = nemotron.gemm(K, max_prefill_tokens=511, num_experts=nemotron.E, scratch_rows=2,
                         prefill_config=prefill_config)
    x = torch.randn(T, 2688, generator=gen).to(torch.bfloat16).cuda()
    ids, w = routing(T, K, nemotron.E, gen)
    assert nemotron.prefill_error(gemm, x, ids, w) <= TOL
    assert gemm.read_error() == []
    # the counter-check on the same call
    out = torch.full_like(x, float("nan"))
    gemm.prefill(x, ids, w, nemotron.addr, out=out)
    assert rel_err(out, reference_moe(x, ids, w, nemotron.deq, activation=_relu_unsquared)) > 10 * TOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_padded_dims_int32_ids_bad_ids(small, rng, dtype, prefill_config):
    check_prefill_int32_ids_bad_ids(small, dtype, torch.Generator().manual_seed(seed_of(rng)),
                                    prefill_config)


def test_decode_and_prefill_misaligned_activations(small, rng, prefill_config):
    gen = torch.Generator().manual_seed(seed_of(rng))
    T, K = 5, 2
    gemm = MoEGemm(small.layout, K, torch.bfloat16, max_decode_tokens=8, max_prefill_tokens=16,
                   num_experts=small.E, prefill_config=prefill_config, activation=RELU2)
    buf = torch.randn(T * 80 + 1, generator=gen).to(torch.bfloat16).cuda()
    x = buf[1:].view(T, 80)
    assert x.data_ptr() % 16 != 0 and x.is_contiguous()
    ids, w = routing(T, K, small.E, gen, torch.bfloat16)
    ref = small.reference(x, ids, w)
    out = torch.full_like(x, float("nan"))
    gemm.decode(x, small.lane_addr(ids), w, out=out)
    assert rel_err(out, ref) <= TOL
    out = torch.full_like(x, float("nan"))
    gemm.prefill(x, ids, w, small.addr, out=out)
    assert rel_err(out, ref) <= TOL


def test_layout_and_activation_must_pair():
    with pytest.raises(ValueError, match="is for experts with a gate, but the row layout has "
                                         "gated=False"):
        MoEGemm(RowLayout(80, 48, gated=False), 2, torch.bfloat16, activation=SILU)
    with pytest.raises(ValueError, match="is for experts without a gate, but the row layout has "
                                         "gated=True"):
        MoEGemm(RowLayout(80, 48), 2, torch.bfloat16, activation=RELU2)


# --- a wrapped tiny Nemotron-H model ---------------------------------------------------------
FAMILY = "nemotron_h"


def nemotron_model(seed):
    """The tiny Nemotron-H of tiny_models in bf16, experts of real-model size (std 0.05, as
    test_gpu_wrap.model_for gives the gated families)."""
    model = hybrid_model(FAMILY, seed=seed)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "up_proj") and isinstance(m.up_proj, torch.Tensor) and m.up_proj.dim() == 3:
                m.up_proj.normal_(0, 0.05)
                m.down_proj.normal_(0, 0.05)
    return model.to(torch.bfloat16)


def test_wrapped_model_matches_the_unwrapped_dequantized_model():
    """Half the experts banked; the prompt's logits (partition path) and the engine's tokens
    (graph captured with the gate closed, then open: misses and promotions happen) against the
    same model unwrapped, its experts the dequantized NVFP4 weights."""
    _, (_, E, K, _, _, _) = HYBRID_FAMILIES[FAMILY]
    model = nemotron_model(seed=21)
    pool = cupool.wrap(model, rows=max(K, E // 2), max_decode_tokens=4, max_prefill_tokens=64,
                       progress=False)
    assert not pool.layout.gated and pool.gemm.activation == RELU2
    prompt = torch.randint(3, 64, (1, 8), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(2))
    with torch.inference_mode():
        full_wrapped = model(prompt).logits
    eng = cupool.Engine(model, pool, max_batch=4, max_len=48, prefill_chunk=8, eos_token_id=[])
    ps = _prompts([3, 9, 14, 5, 7, 2], seed=1)                # six requests, four slots
    budgets = [16, 12, 16, 6, 10, 16]
    reqs = eng.generate(ps, [SamplingParams(max_tokens=n) for n in budgets])
    assert [len(r.output_ids) for r in reqs] == budgets
    assert eng._graphs and int(pool.bank.gate.item()) == 1     # captured, then the gate opened
    eng.close()
    st = pool.stats()
    assert sum(s["misses"] for s in st) > 0 and sum(s["promotions"] for s in st) > 0, st
    assert pool.errors() == []
    assert pool.verify() > 0
    pool.unwrap()
    with torch.inference_mode():
        full_ref = model(prompt).logits
    err = (torch.linalg.norm((full_wrapped - full_ref).float())
           / torch.linalg.norm(full_ref.float())).item()
    assert err <= LOGIT_TOL, err
    off = _check_against_reference(model, reqs)
    assert len(off) <= MAX_OFF, f"{FAMILY}: tokens off the reference's argmax at {off}"


def test_wrapped_layer_outputs():
    """Each pooled layer against the float reference of its rows (no model around it): decode
    widths (one launch) and a prefill width (partition path), gate closed, copies beside the
    GEMM and not: the same bits."""
    from cupool.layout import unpack_row
    from cupool.nvfp4 import dequantize
    _, (_, E, K, H, _, _) = HYBRID_FAMILIES[FAMILY]
    model = nemotron_model(seed=4)
    pool = cupool.wrap(model, rows=K, max_decode_tokens=2, progress=False)
    gen = torch.Generator().manual_seed(5)
    for layer in range(pool.num_layers):
        deq = []
        for e in range(E):
            g, u, d = unpack_row(pool.layout, pool.store.row(layer, e))
            assert g is None
            deq.append((None, dequantize(u).cuda(), dequantize(d).cuda()))
        for T in (1, 2, 9):
            x = torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda()
            ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).cuda()
            w = torch.rand(T, K, generator=gen).to(torch.bfloat16).cuda()
            pool.overlap_copies = True
            out = pool.layers[layer](x, ids, w)
            pool.overlap_copies = False
            ref = reference_moe(x, ids, w, deq, activation=RELU2)
            assert rel_err(out, ref) <= TOL, (layer, T)
            if T * K <= pool.bank.max_lanes:
                assert torch.equal(out, pool.layers[layer](x, ids, w)), (layer, T)
    assert pool.errors() == []
    pool.unwrap(restore_weights=False)                   # frees the store and the bank

