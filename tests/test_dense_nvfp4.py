"""`cupool.dense_nvfp4` (CPU): packing one NVFP4 matrix for dense_gemv's NVFP4 build, the checks
before it, attaching it to a Linear, and moving it with the model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cupool import dense_nvfp4, layout, nvfp4
from cupool.nvfp4 import NVFP4Tensor


def _q(n: int, k: int, seed: int = 0, scale: float = 0.05) -> NVFP4Tensor:
    g = torch.Generator().manual_seed(seed)
    return nvfp4.quantize(torch.randn(n, k, generator=g) * scale)


@pytest.mark.parametrize("n,k", [(64, 48), (40, 208), (16, 16), (33, 4160)])
def test_pack_keeps_every_code_and_scale(n, k):
    """Strips of ceil(N/16) × 9·Kp bytes that unpack to the codes and scales as quantized, and
    dequantize to what `nvfp4.dequantize` gives (zero padding past N and K)."""
    q = _q(n, k)
    p = dense_nvfp4.pack(q)
    kp = -(-k // 64) * 64
    assert p.strips.shape == (-(-n // 16), 9 * kp) and p.strips.dtype == torch.uint8
    assert (p.rows, p.cols, p.global_scale) == (n, k, float(q.global_scale))
    codes, scales = layout.dense_unstrips(p.strips, n, k)
    assert torch.equal(codes, nvfp4.unpack_codes(q.packed))
    assert torch.equal(scales.view(torch.uint8), q.block_scale.view(torch.uint8))
    assert torch.equal(p.dequantize(torch.float32), nvfp4.dequantize(q, torch.float32))
    full = layout._unstrips(p.strips, kp)
    assert not full[0][n:].any() and not full[0][:, k:].any()


def test_check_refuses_what_a_gemv_cannot_take():
    q = _q(32, 64)
    bad_scale = q.block_scale.view(torch.uint8).clone()
    bad_scale[3, 1] = 0x7F                                     # E4M3 NaN
    with pytest.raises(ValueError, match=r"w: block scale nan at \[3, 1\]"):
        dense_nvfp4.check(NVFP4Tensor(q.packed, bad_scale.view(torch.float8_e4m3fn),
                                      q.global_scale), "w")
    neg = q.block_scale.view(torch.uint8).clone()
    neg[0, 0] |= 0x80
    with pytest.raises(ValueError, match="block scale -"):
        dense_nvfp4.check(NVFP4Tensor(q.packed, neg.view(torch.float8_e4m3fn), q.global_scale))
    for g in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="global scale"):
            dense_nvfp4.check(NVFP4Tensor(q.packed, q.block_scale, torch.tensor(g)))
    with pytest.raises(ValueError, match="K must be a positive multiple of 16"):
        dense_nvfp4.check(NVFP4Tensor(q.packed[:, :4], q.block_scale[:, :0], q.global_scale))
    with pytest.raises(ValueError, match=r"block_scale must be float8_e4m3fn \[32, 4\]"):
        dense_nvfp4.check(NVFP4Tensor(q.packed, q.block_scale[:, :3], q.global_scale))
    with pytest.raises(TypeError, match="must be an NVFP4Tensor"):
        dense_nvfp4.check(torch.zeros(2, 2))


def test_attach_sets_the_weight_to_the_dequantized_matrix():
    lin = nn.Linear(48, 32, bias=False).to(torch.bfloat16)
    q = _q(32, 48, seed=3)
    p = dense_nvfp4.attach(lin, q, "q_proj.weight")
    assert dense_nvfp4.of(lin) is p
    assert torch.equal(lin.weight, nvfp4.dequantize(q, torch.float32).to(torch.bfloat16))
    assert torch.equal(p.dequantize(torch.bfloat16), lin.weight)
    with pytest.raises(ValueError, match=r"o_proj.weight: the NVFP4 matrix is \[32, 48\], the "
                                         r"Linear's weight \[16, 48\]"):
        dense_nvfp4.attach(nn.Linear(48, 16), q, "o_proj.weight")


class _Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(48, 64, bias=False), nn.Linear(48, 32, bias=False)
        self.v_proj, self.o_proj = nn.Linear(48, 32, bias=False), nn.Linear(64, 48, bias=False)
        self.gate = nn.Linear(48, 8, bias=False)


def test_quantize_linears_takes_the_projections_only_and_moves_with_the_model():
    model = nn.Sequential(_Attn(), _Attn())
    assert dense_nvfp4.quantize_linears(model) == 8
    assert dense_nvfp4.of(model[0].gate) is None
    assert dense_nvfp4.quantize_linears(model) == 0              # already packed
    total = dense_nvfp4.packed_bytes(model)
    assert total == 2 * (4 + 2 + 2 + 3) * 9 * 64
    assert dense_nvfp4.packed_bytes(model, elsewhere="cpu") == 0
    assert dense_nvfp4.packed_bytes(model, elsewhere="meta") == total
    dense_nvfp4.move(model, "meta")
    assert all(dense_nvfp4.of(m).device.type == "meta"
               for m in model.modules() if dense_nvfp4.of(m) is not None)
    assert "8 NVFP4 dense Linears" in dense_nvfp4.describe(model)


def test_predequant_rule_takes_one_x_tile_and_the_fragments_registers():
    """How many chunks a warp of the NVFP4 GEMV dequantises before its wait: all of its slice's,
    rounded up to a power of two, where the slice is one x tile (2,048 columns up to 8 tokens,
    1,024 up to 16) and the fragments (16 registers a chunk, row tile and n tile) stay within 8
    chunks' worth; else 0, the two-buffer loop."""
    from cupool.ops.dense_gemv import predequant_chunks
    # Qwen3-30B-A3B at the fused step's shapes: QKV (K 2048, 4 warps), o (K 4096, 4 warps, 4 slices)
    assert predequant_chunks(2048, 4, 1, 1, 1) == 8
    assert predequant_chunks(4096, 4, 4, 1, 1) == 4
    assert predequant_chunks(2048, 8, 1, 8, 1) == 4
    assert predequant_chunks(2000, 8, 3, 5, 1) == 2          # slices of 10, 11, 11 chunks
    assert predequant_chunks(80, 4, 1, 1, 1) == 1
    assert predequant_chunks(4096, 4, 1, 1, 1) == 0          # K past one x tile
    assert predequant_chunks(2048, 4, 1, 16, 1) == 0         # 16 tokens: tiles of 1,024
    assert predequant_chunks(4096, 4, 4, 16, 1) == 4         # ... a slice of 1,024 fits
    assert predequant_chunks(2048, 4, 1, 1, 2) == 0          # 8 chunks of two row tiles
    assert predequant_chunks(1024, 4, 1, 16, 1) == 4         # 4 chunks, two n tiles
    assert predequant_chunks(2048, 4, 1, 9, 1) == 0
