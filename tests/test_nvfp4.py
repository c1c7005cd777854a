"""NVFP4 torch reference (cupool.nvfp4), CPU: codes, packing, exactness of each step, error bound,
zeros, guards."""

import numpy as np
import pytest
import torch
from nvfp4_cases import DTYPES, KINDS, SHAPES, make_weight

from cupool import nvfp4
from cupool.nvfp4 import (
    NVFP4Tensor,
    dequantize,
    e2m1_decode,
    e2m1_encode,
    pack_codes,
    quantize,
    unpack_codes,
)

U = 2.0 ** -24          # float32 unit roundoff


# --- codes and packing ---------------------------------------------------------------------------
def test_sixteen_codes_decode_and_encode_exactly():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = e2m1_decode(codes)
    want = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert vals[:8].tolist() == want and vals[8:].tolist() == [-v for v in want]
    assert torch.signbit(vals).tolist() == [False] * 8 + [True] * 8     # code 8 is -0.0
    assert torch.equal(e2m1_encode(vals), codes)
    assert torch.equal(e2m1_encode(vals.double()), codes)
    assert torch.equal(e2m1_encode(vals.to(torch.bfloat16)), codes)


@pytest.mark.parametrize("x,code", [
    (0.25, 0), (0.2500001, 1), (0.75, 2), (0.7499999, 1), (1.25, 2), (1.2500001, 3), (1.75, 4),
    (2.5, 4), (2.5000002, 5), (3.5, 6), (3.4999998, 5), (5.0, 6), (5.0000005, 7), (6.0, 7),
    (7.0, 7), (1e30, 7), (float("inf"), 7)])
def test_encode_rounds_to_nearest_ties_to_even(x, code):
    assert e2m1_encode(torch.tensor([x])).item() == code
    assert e2m1_encode(torch.tensor([-x])).item() == code | 8


def test_packing_order_even_element_in_low_nibble():
    codes = torch.arange(16, dtype=torch.uint8).repeat(3, 1)          # [3, 16]
    packed = pack_codes(codes)
    assert packed.shape == (3, 8)
    assert packed[0].tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]
    assert torch.equal(unpack_codes(packed), codes)
    w = torch.zeros(1, 16)
    w[0, 0], w[0, 3] = 6.0, -3.0                                      # codes 7 (element 0), 13 (3)
    q = quantize(w)
    assert q.packed[0, 0].item() == 0x07 and q.packed[0, 1].item() == 0xD0


# --- each step is the correctly rounded float32 operation ------------------------------------------
def _f32(a):
    return np.asarray(a, dtype=np.float64).astype(np.float32)


def _e4m3_rne(v: np.ndarray) -> np.ndarray:
    """float64 values (exact float32s) >= 0 -> the nearest E4M3 value, ties to even, clamped to 448."""
    v = np.minimum(v, 448.0)
    e = np.floor(np.log2(np.maximum(v, 2.0 ** -6)))                   # subnormals share 2^-6's step
    step = 2.0 ** (e - 3)
    return np.round(v / step) * step                                  # np.round: half to even


def _quantize_f64(w: torch.Tensor):
    """An independent NumPy quantizer: every step in float64 then rounded to float32, which gives
    the correctly rounded float32 result of one division or product (53 >= 2·24 + 2 bits)."""
    *lead, n, k = w.shape
    a = np.abs(w.double().numpy().reshape(-1, n, k))
    g = _f32(a.max(axis=(1, 2)) / 2688.0).astype(np.float64)                       # [M]
    bmax = a.reshape(-1, n, k // 16, 16).max(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        v = _f32(_f32(bmax / 6.0).astype(np.float64) / g[:, None, None]).astype(np.float64)
        v = np.where(g[:, None, None] > 0, v, 0.0)
        s = _e4m3_rne(v)
        d = _f32(s * g[:, None, None]).astype(np.float64)
        dk = np.repeat(d, 16, axis=-1)
        x = _f32(a / np.where(dk > 0, dk, 1.0)).astype(np.float64)
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    code = np.searchsorted(mids, x, side="left")                      # x == mid -> lower code
    code += np.isin(x, mids[1::2])                                    # ...except where upper is even
    code = code | (np.signbit(w.float().numpy().reshape(-1, n, k)) << 3)
    code = np.where(dk > 0, code, 0).astype(np.uint8)
    return g.astype(np.float32), s, code


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_reference_equals_independent_float64_derivation(kind, dtype, rng):
    for shape in SHAPES:
        w = make_weight(kind, shape, dtype, rng)
        q = quantize(w)
        g, s, code = _quantize_f64(w)
        np.testing.assert_array_equal(q.global_scale.reshape(-1).numpy().view(np.uint32),
                                      g.view(np.uint32))
        np.testing.assert_array_equal(q.block_scale.float().double().numpy().reshape(s.shape), s)
        np.testing.assert_array_equal(unpack_codes(q.packed).numpy().reshape(code.shape), code)


# --- round trip within the format's bound -----------------------------------------------------------
def _half_step(x):
    """Half the distance between the E2M1 magnitudes around x (spacing 0.5 below 2, 1 below 4, 2)."""
    return np.where(x < 2, 0.25, np.where(x < 4, 0.5, 1.0))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_error_within_bound(kind, dtype, rng):
    # Bound, per element w of a block with stored scale s and global g, d = fl(s·g) > 0,
    # x = |w| / d (all in float64 against the float64 value of w):
    #   |w - deq| <= d · max(half_step(x), x - 6) + 4u·(|w| + |deq|)
    # The first term is E2M1 rounding at that magnitude (saturation when x > 6); the second covers
    # the float32 roundings of d, x and deq = (code·s)·g, u = 2^-24. x > 6 only through the E4M3
    # rounding of the scale: with s within 2^-4 of its ideal bamax / (6g) (E4M3 normal range),
    # x <= 6·(1 + 2^-4)/(1 - 2^-4) < 7, so there the error is <= d·1 = the top E2M1 half step.
    # Blocks whose scale rounds to 0 (d == 0) dequantize to 0: |w| <= bamax < 6·2^-10·g·(1 + u).
    # Against the ideal scale, for E4M3-normal blocks: |w - deq| <= (1 + 2^-4)·bamax/6 + O(u).
    for shape in SHAPES + ((128, 2048),):
        w = make_weight(kind, shape, dtype, rng)
        q = quantize(w)
        deq = dequantize(q, torch.float64).numpy()
        assert np.isfinite(deq).all()
        *lead, n, k = shape
        w64 = w.double().numpy()
        s = np.repeat(q.block_scale.float().double().numpy(), 16, axis=-1)
        g = q.global_scale.double().numpy().reshape(*lead, 1, 1)
        d = _f32(s * g).astype(np.float64)
        err = np.abs(w64 - deq)
        nz = d > 0
        x = np.abs(w64) / np.where(nz, d, 1.0)
        bound = d * np.maximum(_half_step(x), x - 6) + 4 * U * (np.abs(w64) + np.abs(deq))
        assert (err[nz] <= bound[nz]).all(), f"{kind} {dtype} {shape}: worst excess " \
            f"{(err - bound)[nz].max()}"
        assert (deq[~nz] == 0).all()
        assert (np.abs(w64[~nz]) <= 6 * 2.0 ** -10 * np.broadcast_to(g, w64.shape)[~nz] * (1 + U)
                ).all()
        bmax = np.repeat(np.abs(w64).reshape(*lead, n, k // 16, 16).max(-1), 16, axis=-1)
        with np.errstate(divide="ignore", invalid="ignore"):
            normal = (bmax / (6 * g) >= 2.0 ** -6) & nz
        assert (err[normal] <= ((1 + 2.0 ** -4) * bmax[normal] / 6) * (1 + 8 * U)).all()


def test_ties_go_to_even_codes(rng):
    w = make_weight("ties", (4, 64), torch.float32, rng)
    q = quantize(w)
    s = np.repeat(q.block_scale.float().double().numpy(), 16, axis=-1)
    x = np.abs(w.double().numpy()) / (s * q.global_scale.item())      # exact by construction
    code = unpack_codes(q.packed).numpy() & 7
    for t, c in ((0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6)):
        if (x == t).any():
            assert (code[x == t] == c).all(), t


# --- stacked, dtypes, zeros -----------------------------------------------------------------------------
def test_stacked_matrices_each_get_their_own_global_scale(rng):
    w = make_weight("randn", (3, 2, 16, 32), torch.bfloat16, rng)
    q = quantize(w)
    assert q.packed.shape == (3, 2, 16, 16) and q.block_scale.shape == (3, 2, 16, 2)
    assert q.global_scale.shape == (3, 2) and q.global_scale.dtype == torch.float32
    for i in range(3):
        for j in range(2):
            one = quantize(w[i, j])
            assert one.global_scale.shape == ()
            assert torch.equal(one.packed, q.packed[i, j])
            assert torch.equal(one.block_scale.view(torch.uint8), q.block_scale[i, j].view(torch.uint8))
            assert one.global_scale.item() == q.global_scale[i, j].item()


def test_dtype_only_matters_through_the_values(rng):
    w = make_weight("randn", (17, 144), torch.bfloat16, rng)
    a, b = quantize(w), quantize(w.float())
    assert torch.equal(a.packed, b.packed) and a.global_scale.item() == b.global_scale.item()
    assert dequantize(a, torch.bfloat16).dtype == torch.bfloat16


def test_all_zero_tensor_gives_zeros_not_nan():
    for w in (torch.zeros(4, 32), torch.zeros(2, 3, 16, dtype=torch.float16), -torch.zeros(1, 16)):
        q = quantize(w)
        assert (q.packed == 0).all() and (q.block_scale.view(torch.uint8) == 0).all()
        assert (q.global_scale == 0).all()
        d = dequantize(q)
        assert not torch.isnan(d).any() and (d == 0).all()


def test_all_zero_block_inside_a_tensor(rng):
    w = torch.from_numpy(rng.standard_normal((3, 64)).astype(np.float32))
    w[1, 16:32] = 0.0
    w[2, :16] = -0.0
    q = quantize(w)
    assert q.block_scale[1, 1].float().item() == 0.0 and q.block_scale[2, 0].float().item() == 0.0
    assert (q.packed[1, 8:16] == 0).all() and (q.packed[2, :8] == 0).all()
    d = dequantize(q)
    assert torch.isfinite(d).all() and (d[1, 16:32] == 0).all() and (d[2, :16] == 0).all()
    assert (q.block_scale.float() > 0).sum() == 12 - 2


def test_reference_on_views_and_non_contiguous(rng):
    w = make_weight("randn", (2, 32, 64), torch.float32, rng)
    t = w.transpose(-1, -2).contiguous().transpose(-1, -2)        # same values, K not contiguous
    assert torch.equal(quantize(t).packed, quantize(w).packed)


# --- guards -----------------------------------------------------------------------------------------------
def test_guards():
    with pytest.raises(ValueError, match=r"K \(the last dim\) must be a positive multiple of 16.*\[4, 24\]"):
        quantize(torch.randn(4, 24))
    with pytest.raises(TypeError, match="float32, float16 or bfloat16.*torch.int32"):
        quantize(torch.ones(4, 16, dtype=torch.int32))
    with pytest.raises(TypeError, match="float32, float16 or bfloat16.*float64"):
        quantize(torch.ones(4, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="at least 2-D"):
        quantize(torch.ones(16))
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        quantize(np.ones((4, 16), np.float32))
    with pytest.raises(TypeError, match="codes must be uint8"):
        e2m1_decode(torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="codes must be in 0..15.*16"):
        e2m1_decode(torch.tensor([1, 16], dtype=torch.uint8))
    with pytest.raises(ValueError, match="last dim must be even"):
        pack_codes(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="NaN"):
        e2m1_encode(torch.tensor([float("nan")]))
    q = quantize(torch.randn(2, 32))
    with pytest.raises(ValueError, match="global_scale: expected shape"):
        dequantize(NVFP4Tensor(q.packed, q.block_scale, torch.ones(2)))
    with pytest.raises(ValueError, match="block_scale: expected shape"):
        dequantize(NVFP4Tensor(q.packed, q.block_scale[:, :1], q.global_scale))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_finite_weights_are_named_with_count_and_first_index(dtype):
    w = torch.randn(2, 4, 32).to(dtype)
    w[1, 2, 5] = float("nan")
    w[1, 3, 0] = float("inf")
    w[0, 3, 31] = -float("inf")
    with pytest.raises(ValueError, match=r"w: 3 non-finite value\(s\).*first is -inf at index "
                                         r"\(0, 3, 31\)"):
        quantize(w)


def test_module_constants():
    assert nvfp4.BLOCK == 16 and nvfp4.E2M1_VALUES == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
