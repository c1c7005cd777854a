"""CPU checks of the GEMM's Python side: the float reference and the argument guards."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from cupool.gemm import check_activations, check_routing
from cupool.layout import RowLayout, unpack_row
from cupool.reference.moe import reference_moe
from cupool.synthetic import dequantize_exact, random_experts, random_rows_fast


def test_reference_matches_naive_loop():
    gen = torch.Generator().manual_seed(0)
    T, K, E, H, I = 5, 2, 4, 32, 16
    experts = [tuple(torch.randn(*s, generator=gen) for s in ((I, H), (I, H), (H, I)))
               for _ in range(E)]
    x = torch.randn(T, H, generator=gen)
    ids = torch.tensor([[0, 1], [2, -1], [3, 3], [1, 0], [-1, -1]])
    w = torch.rand(T, K, generator=gen)
    out = reference_moe(x, ids, w, experts, dtype=torch.float64)
    want = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            if e < 0:
                continue
            g, u, d = (m.double() for m in experts[e])
            h = x[t].double()
            want[t] += w[t, k].double() * (d @ (F.silu(g @ h) * (u @ h)))
    torch.testing.assert_close(out, want)


def test_synthetic_rows_round_trip():
    gen = torch.Generator().manual_seed(1)
    layout = RowLayout(64, 32)
    rows, mats = random_experts(layout, 3, gen)
    for e in range(3):
        for a, b in zip(mats[e], unpack_row(layout, rows[e])):
            assert torch.equal(dequantize_exact(a), dequantize_exact(b))
    ro = rows[0].numpy().copy()
    ro.flags.writeable = False                           # as a host store hands its rows out
    with warnings.catch_warnings():
        warnings.simplefilter("error")                   # torch warns on a read-only array
        for a, b in zip(mats[0], unpack_row(layout, ro)):
            assert torch.equal(dequantize_exact(a), dequantize_exact(b))
    fast = random_rows_fast(RowLayout(128, 64), 2, gen)
    g, u, d = unpack_row(RowLayout(128, 64), fast[0])
    for m in (g, u, d):                                  # valid, finite, non-zero weights
        v = dequantize_exact(m)
        assert torch.isfinite(v).all() and v.abs().sum() > 0


def test_guards_without_gpu():
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA"):
        check_activations(x, 8)
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        check_activations(x.float(), 8)
    with pytest.raises(TypeError, match="torch.Tensor"):
        check_activations([1, 2], 8)
    w = torch.ones(2, 3)
    assert check_routing(w, 2, w.device) == 3
    with pytest.raises(ValueError, match=r"\[T=4, K\]"):
        check_routing(w, 4, w.device)
    with pytest.raises(TypeError, match="floating-point"):
        check_routing(torch.ones(2, 3, dtype=torch.int64), 2, w.device)
    with pytest.raises(TypeError, match="int32 or int64"):
        check_routing(w, 2, w.device, topk_ids=torch.ones(2, 3))
    with pytest.raises(ValueError, match="differs"):
        check_routing(w, 2, w.device, topk_ids=torch.ones(2, 2, dtype=torch.int64))


@pytest.mark.parametrize("kind,want", [("auto", "fused"), ("pair", "pair"), ("fused", "fused")])
def test_decode_kernel_choice(kind, want):
    """moe_decode builds for every architecture (sm_80+), so "auto" is the one-launch kernel."""
    from cupool.gemm import decode_form, resolve_decode_kernel
    assert resolve_decode_kernel(kind) == want
    assert decode_form(kind).startswith("one launch" if want == "fused" else "two launches")


def test_decode_kernel_choice_errors_name_the_argument():
    from cupool.gemm import resolve_decode_kernel
    with pytest.raises(ValueError, match="decode_kernel must be one of"):
        resolve_decode_kernel("tiles")
