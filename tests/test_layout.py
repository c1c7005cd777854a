"""The kernel layout of an expert row (cupool.layout): exact round trip and placement by the spec."""

import numpy as np
import pytest
import torch

from cupool.layout import HEADER_BYTES, RowLayout, pack_row, unpack_row
from cupool.nvfp4 import NVFP4Tensor


def _random(n, k, gen):
    return NVFP4Tensor(
        packed=torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen),
        block_scale=torch.randint(0, 0x7F, (n, k // 16), dtype=torch.uint8,
                                  generator=gen).view(torch.float8_e4m3fn),
        global_scale=torch.rand((), generator=gen) + 0.1)


def _strip_base(layout, matrix, r):
    """Byte offset of the strip holding row r of `matrix`, from the docstring."""
    if matrix in ("gate", "up"):
        return layout.w13_offset + (2 * (r // 16) + (matrix == "up")) * layout.w13_strip_bytes
    return layout.w2_offset + (r // 16) * layout.w2_strip_bytes


def _spec_position(layout, matrix, r, k):
    """Byte offset of the word holding element (r, k) and its slot there, from the docstring."""
    base = _strip_base(layout, matrix, r)
    rr = r % 16
    g, lower = rr % 8, rr // 8
    c, kk = k // 64, k % 64
    t, q, j = kk // 16, (kk % 16) // 4, kk % 4          # column k0 + j, k0 = 64c + 16t + 4q
    n = lower + 2 * (j // 2) + 4 * (j % 2)
    lane = 4 * g + t
    return base + c * 576 + lane * 16 + q * 4, n


def _slot_code(word: int, n: int) -> int:
    """The code in slot n = 4h + j of a word, from the docstring: magnitude at bits 16h + 3j …,
    sign at bit 16h + 12 + (j xor 1)."""
    h, j = divmod(n, 4)
    return (word >> (16 * h + 3 * j)) & 7 | ((word >> (16 * h + 12 + (j ^ 1))) & 1) << 3


def _spec_scale_offset(layout, matrix, r, b):
    """Byte offset of the block scale of (row r, columns 16b … 16b+15), from the docstring."""
    rr = r % 16
    lane = 4 * (rr % 8) + b % 4
    return _strip_base(layout, matrix, r) + (b // 4) * 576 + 512 + 2 * lane + rr // 8


@pytest.mark.parametrize("H,I", [(2048, 768), (64, 32), (80, 48), (128, 16), (4096, 1536)])
def test_round_trip_exact(H, I):
    gen = torch.Generator().manual_seed(H * 7 + I)
    layout = RowLayout(H, I)
    g, u, d = _random(I, H, gen), _random(I, H, gen), _random(H, I, gen)
    row = pack_row(layout, g, u, d)
    assert row.numel() == layout.row_bytes and layout.row_bytes % 16 == 0
    for a, b in zip((g, u, d), unpack_row(layout, row)):
        assert torch.equal(a.packed, b.packed)
        assert torch.equal(a.block_scale.view(torch.uint8), b.block_scale.view(torch.uint8))
        assert a.global_scale.item() == b.global_scale.item()


@pytest.mark.parametrize("H,I", [(2048, 768), (80, 48)])
def test_placement_matches_docstring(H, I, rng):
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    layout = RowLayout(H, I)
    mats = {"gate": _random(I, H, gen), "up": _random(I, H, gen), "down": _random(H, I, gen)}
    row = pack_row(layout, mats["gate"], mats["up"], mats["down"]).numpy()
    for name, q in mats.items():
        n, k = q.shape
        packed = q.packed.numpy()
        for _ in range(200):
            r, c = int(rng.integers(n)), int(rng.integers(k))
            code = (packed[r, c // 2] >> (4 * (c % 2))) & 0xF
            off, slot = _spec_position(layout, name, r, c)
            word = int.from_bytes(bytes(row[off:off + 4].tolist()), "little")
            assert _slot_code(word, slot) == code, (name, r, c)
            b = c // 16
            sc = int(q.block_scale[r, b].view(torch.uint8))
            assert row[_spec_scale_offset(layout, name, r, b)] == sc, (name, r, b)
    hdr = row[:HEADER_BYTES].view(np.float32)
    assert hdr[0] == mats["gate"].global_scale.item() and hdr[2] == mats["down"].global_scale.item()
    assert (row[12:HEADER_BYTES] == 0).all()


def test_padding_is_zero():
    gen = torch.Generator().manual_seed(3)
    layout = RowLayout(80, 48)                 # Hp=128, Ip=64: padded rows and columns
    g, u, d = _random(48, 80, gen), _random(48, 80, gen), _random(80, 48, gen)
    row = pack_row(layout, g, u, d).numpy()
    zero = NVFP4Tensor(torch.zeros(48, 40, dtype=torch.uint8),
                       torch.zeros(48, 5, dtype=torch.uint8).view(torch.float8_e4m3fn),
                       torch.zeros(()))
    z = pack_row(layout, zero, zero, NVFP4Tensor(torch.zeros(80, 24, dtype=torch.uint8),
                 torch.zeros(80, 3, dtype=torch.uint8).view(torch.float8_e4m3fn), torch.zeros(())))
    assert (z.numpy() == 0).all()
    # every byte of the padded region of gate strip 3 (rows 48..63 do not exist) is zero
    assert (row[layout.w13_offset + 6 * layout.w13_strip_bytes:
                layout.w13_offset + 7 * layout.w13_strip_bytes] == 0).all()


def test_layout_guards():
    with pytest.raises(ValueError, match="hidden size must be a positive multiple of 16"):
        RowLayout(100, 64)
    layout = RowLayout(64, 32)
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="gate: expected shape"):
        pack_row(layout, _random(32, 48, gen), _random(32, 64, gen), _random(64, 32, gen))
    with pytest.raises(ValueError, match="row: expected"):
        unpack_row(layout, np.zeros(100, np.uint8))
