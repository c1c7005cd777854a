"""Batched row building (cupool.layout.pack_rows), CPU: byte for byte the rows of pack_row; and the
GPU quantizer's argument checks that need no GPU."""

import numpy as np
import pytest
import torch

from cupool.layout import RowLayout, pack_row, pack_rows
from cupool.nvfp4 import NVFP4Tensor, quantize
from cupool.ops.nvfp4_quant import quantize as gpu_quantize
from cupool.ops.nvfp4_quant import quantize_experts_to_rows


def _stack(E, I, H, rng, dtype=torch.float32):
    gate_up = torch.from_numpy(rng.standard_normal((E, 2 * I, H)).astype(np.float32)).to(dtype)
    down = torch.from_numpy(rng.standard_normal((E, H, I)).astype(np.float32)).to(dtype)
    return gate_up, down


@pytest.mark.parametrize("H,I,E", [(80, 48, 3), (64, 32, 1), (128, 16, 5), (2048, 768, 2)])
def test_pack_rows_equals_pack_row(H, I, E, rng):
    layout = RowLayout(H, I)
    gate_up, down = _stack(E, I, H, rng, torch.bfloat16)
    gate, up, dn = quantize(gate_up[:, :I]), quantize(gate_up[:, I:]), quantize(down)
    want = torch.stack([pack_row(layout, gate[e], up[e], dn[e]) for e in range(E)])
    for chunk in (None, 1, 2):
        assert torch.equal(pack_rows(layout, gate, up, dn, chunk=chunk), want)
    out = torch.full((E, layout.row_bytes + 32), 0xFF, dtype=torch.uint8)   # poisoned, wider
    pack_rows(layout, gate, up, dn, out=out)
    assert torch.equal(out[:, :layout.row_bytes], want)
    assert (out[:, layout.row_bytes:] == 0xFF).all()


def test_pack_rows_guards(rng):
    layout = RowLayout(64, 32)
    gate_up, down = _stack(2, 32, 64, rng)
    g, u, d = quantize(gate_up[:, :32]), quantize(gate_up[:, 32:]), quantize(down)
    with pytest.raises(ValueError, match=r"down: expected matrices \[64, 32\] for H=64, I=32, got \[32, 64\]"):
        pack_rows(layout, g, u, u)
    with pytest.raises(ValueError, match=r"up: expected a stack \[E, N, K/2\] with the E of gate"):
        pack_rows(layout, g, u[0], d)
    with pytest.raises(ValueError, match=r"gate: expected global scales \[2\]"):
        pack_rows(layout, NVFP4Tensor(g.packed, g.block_scale, torch.ones(3)), u, d)
    with pytest.raises(ValueError, match=r"out: expected uint8 \[2, >= "):
        pack_rows(layout, g, u, d, out=torch.empty(2, 10, dtype=torch.uint8))


def test_gpu_quantizer_checks_arguments_before_needing_a_gpu():
    with pytest.raises(ValueError, match="must be a CUDA tensor for the GPU quantizer"):
        gpu_quantize(torch.randn(4, 16))
    with pytest.raises(ValueError, match=r"K \(the last dim\) must be a positive multiple of 16"):
        gpu_quantize(torch.randn(4, 24))
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        gpu_quantize(torch.ones(4, 16, dtype=torch.int8))
    layout = RowLayout(80, 48)
    with pytest.raises(ValueError, match=r"down: expected \[E, 80, 48\] for H=80, I=48, got \[2, 80, 32\]"):
        quantize_experts_to_rows(torch.randn(2, 96, 80), torch.randn(2, 80, 32), layout)
    with pytest.raises(ValueError, match=r"gate_up: expected \[E, 96, 80\]"):
        quantize_experts_to_rows(torch.randn(2, 48, 80), torch.randn(2, 80, 48), layout)
    with pytest.raises(ValueError, match="gate_up has 2 experts, down has 3"):
        quantize_experts_to_rows(torch.randn(2, 96, 80), torch.randn(3, 80, 48), layout)
