"""GPU checks of NVFP4 quantization: the kernel (cupool.ops.nvfp4_quant) equals the torch reference bit for
bit on fresh random inputs of odd shapes and every dtype, into poisoned outputs; strided views;
NaN/Inf census; the stacked-experts -> rows fast path equals pack_row."""

import numpy as np
import pytest
import torch
from nvfp4_cases import DTYPES, KINDS, SHAPES, make_weight

from cupool import nvfp4
from cupool.layout import RowLayout, pack_row
from cupool.nvfp4 import NVFP4Tensor
from cupool.ops.nvfp4_quant import quantize as gpu_quantize
from cupool.ops.nvfp4_quant import quantize_experts_to_rows

pytestmark = pytest.mark.gpu

GPU_SHAPES = SHAPES + ((128, 2048), (3, 7, 64, 96))


def _poisoned(shape, device="cuda") -> NVFP4Tensor:
    *lead, n, k = shape
    return NVFP4Tensor(
        torch.full((*lead, n, k // 2), 0xFF, dtype=torch.uint8, device=device),
        torch.full((*lead, n, k // 16), 0xFF, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn),
        torch.full(tuple(lead), -1, dtype=torch.int32, device=device).view(torch.float32))


def _assert_same(got: NVFP4Tensor, want: NVFP4Tensor, where: str) -> None:
    pairs = (("global_scale", got.global_scale.cpu().view(torch.int32), want.global_scale.view(torch.int32)),
             ("block_scale", got.block_scale.cpu().view(torch.uint8), want.block_scale.view(torch.uint8)),
             ("packed", got.packed.cpu(), want.packed))
    for field, a, b in pairs:
        assert a.shape == b.shape, f"{where}: {field} shape {list(a.shape)} vs {list(b.shape)}"
        if not torch.equal(a, b):
            bad = torch.nonzero((a != b).reshape(-1))
            i = int(bad[0])
            raise AssertionError(f"{where}: {field} differs in {bad.numel()} of {a.numel()} entries, "
                                 f"first at flat {i}: kernel {a.reshape(-1)[i].item():#x} vs "
                                 f"reference {b.reshape(-1)[i].item():#x}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_kernel_equals_reference_bit_for_bit(kind, dtype, rng):
    for shape in GPU_SHAPES:
        w = make_weight(kind, shape, dtype, rng)
        want = nvfp4.quantize(w)                                       # CPU reference
        out = _poisoned(shape)
        got = gpu_quantize(w.cuda(), out=out)
        assert got is out
        _assert_same(got, want, f"{kind} {dtype} {list(shape)}")
        fresh = gpu_quantize(w.cuda())                                 # allocating path
        _assert_same(fresh, want, f"{kind} {dtype} {list(shape)} (allocated out)")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_on_cuda_equals_reference_on_cpu(dtype, rng):
    for kind in KINDS:
        w = make_weight(kind, (5, 33, 80), dtype, rng)
        _assert_same(nvfp4.quantize(w.cuda()), nvfp4.quantize(w), f"torch reference on CUDA, {kind}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_views(dtype, rng):
    E, I, H = 3, 48, 80
    gate_up = make_weight("randn", (E, 2 * I, H), dtype, rng).cuda()
    for part in (gate_up[:, :I], gate_up[:, I:]):                     # halves of a fused weight
        assert not part.is_contiguous()
        _assert_same(gpu_quantize(part, out=_poisoned(part.shape)),
                     nvfp4.quantize(part.cpu().contiguous()), "gate_up half")
    wide = make_weight("zero_blocks", (4, 33, 96 + 32), dtype, rng).cuda()
    view = wide[..., :96]                                              # padded rows
    _assert_same(gpu_quantize(view), nvfp4.quantize(view.cpu().contiguous()), "row-padded view")
    many = make_weight("randn", (2, 5, 3, 16, 32), dtype, rng).cuda()  # several leading dims
    _assert_same(gpu_quantize(many), nvfp4.quantize(many.cpu()), "5-D stack")


def test_more_matrices_than_grid_y(rng):
    w = make_weight("randn", (70_000, 1, 16), torch.float32, rng)      # grid.y is capped at 65535
    _assert_same(gpu_quantize(w.cuda(), out=_poisoned(w.shape)), nvfp4.quantize(w), "70000 matrices")


def test_argument_guards_on_gpu():
    w = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"the last dim \(K\) must be contiguous"):
        gpu_quantize(torch.randn(64, 32, device="cuda").t())
    shifted = torch.randn(4 * 64 + 1, device="cuda", dtype=torch.bfloat16)[1:].view(4, 64)
    with pytest.raises(ValueError, match="data pointer must be a multiple of 16 bytes"):
        gpu_quantize(shifted)
    with pytest.raises(ValueError, match="row stride must be a multiple of 16 bytes"):
        rows_136b = torch.randn(4, 68, device="cuda", dtype=torch.bfloat16)[:, :64]
        gpu_quantize(rows_136b)
    with pytest.raises(ValueError, match=r"out.packed: expected a contiguous torch.uint8 tensor \[4, 32\]"):
        gpu_quantize(w, out=_poisoned((4, 48)))
    bad = _poisoned((4, 64))
    bad.block_scale = bad.block_scale.view(torch.uint8)
    with pytest.raises(ValueError, match="out.block_scale: expected a contiguous torch.float8_e4m3fn"):
        gpu_quantize(w, out=bad)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_finite_census_matches_reference(dtype, rng):
    w = make_weight("randn", (3, 17, 144), dtype, rng)
    w[2, 16, 143] = float("nan")
    w[1, 5, 7] = float("inf")
    w[1, 5, 8] = -float("inf")
    with pytest.raises(ValueError) as ref:
        nvfp4.quantize(w)
    out = _poisoned(w.shape)
    with pytest.raises(ValueError) as ker:
        gpu_quantize(w.cuda(), out=out)
    assert str(ker.value) == str(ref.value)
    assert "3 non-finite" in str(ker.value) and "(1, 5, 7)" in str(ker.value)
    assert (out.packed == 0xFF).all(), "nothing may be written when the input is rejected"


@pytest.mark.parametrize("H,I,E", [(80, 48, 3), (2048, 768, 4)])
def test_experts_to_rows_equals_pack_row(H, I, E, rng):
    layout = RowLayout(H, I)
    gate_up = make_weight("zero_blocks", (E, 2 * I, H), torch.bfloat16, rng)
    down = make_weight("heavy", (E, H, I), torch.bfloat16, rng)
    out = torch.full((E, layout.row_bytes), 0xFF, dtype=torch.uint8, device="cuda")
    rows = quantize_experts_to_rows(gate_up.cuda(), down.cuda(), layout, out=out)
    assert rows is out
    for e in range(E):
        want = pack_row(layout, nvfp4.quantize(gate_up[e, :I]), nvfp4.quantize(gate_up[e, I:]),
                        nvfp4.quantize(down[e]))
        got = rows[e].cpu()
        if not torch.equal(got, want):
            i = int(torch.nonzero(got != want)[0])
            raise AssertionError(f"expert {e}: row byte {i} is {got[i].item():#x}, pack_row has "
                                 f"{want[i].item():#x}")
    np.testing.assert_array_equal(
        quantize_experts_to_rows(gate_up.cuda(), down.cuda(), layout, chunk=1).cpu().numpy(),
        rows.cpu().numpy())
