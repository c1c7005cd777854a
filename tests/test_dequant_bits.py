"""The bit tricks of rawkernels/mma_fp4.cuh, replayed on the CPU (no GPU needed).

The GEMM kernels dequantise NVFP4 without conversion instructions: E2M1 codes are shifted into
fp16 or bf16 bit positions, E4M3 block scales likewise, and one or two multiplies in the half
type put them on scale. These tests rebuild every step with the same shifts and masks and with
numpy / torch half arithmetic (round to nearest, subnormals kept, as mul.rn.f16x2 and
mul.rn.bf16x2 do), and check that each dequantised weight is exactly E2M1 · E4M3 times the
power of two the epilogue undoes (2^-7 for fp16, 2^-8 for bf16), for all 16 codes and all 127
non-negative, non-NaN scale bytes.
"""

import numpy as np
import pytest
import torch

from cupool.nvfp4 import E2M1_VALUES

MASK32 = 0xFFFFFFFF


def e2m1(code: int) -> float:
    v = E2M1_VALUES[code & 7]
    return -v if code & 8 else v


def e4m3(byte: int) -> float:
    e, m = (byte >> 3) & 0xF, byte & 7
    return 2.0 ** -6 * m / 8 if e == 0 else 2.0 ** (e - 7) * (1 + m / 8)


def shift_left(w: int, s: int) -> int:
    return (w << s) & MASK32 if s >= 0 else w >> -s


def slot_word(slots: list[int]) -> int:
    """A layout word from its 8 codes in slot order, straight from layout.py's docstring: slot
    4h + j's magnitude at bits 16h + 3j …, its sign at bit 16h + 12 + (j xor 1)."""
    w = 0
    for n, code in enumerate(slots):
        h, j = divmod(n, 4)
        w |= (code & 7) << (16 * h + 3 * j) | (code >> 3) << (16 * h + 12 + (j ^ 1))
    return w


def fp4x2_raw(w: int, bf: bool, j: int) -> int:
    """The kernel's fp4x2_raw<BF, J>: slot j -> low half, slot j + 4 -> high half."""
    mag = shift_left(w, (6 if bf else 9) - 3 * j) & (0x01C001C0 if bf else 0x0E000E00)
    sgn = shift_left(w, 3 - (j ^ 1)) & 0x80008000
    return mag | sgn


def raw_of_code(code: int, bf: bool) -> int:
    """The low half fp4x2_raw gives for `code` alone in slot 0."""
    return fp4x2_raw(slot_word([code] + [0] * 7), bf, 0) & 0xFFFF


def scale_raw(pair: int, bf: bool) -> int:
    """The integer part of scale_pair<BF>: byte 0 (row g) and byte 1 (row g+8) of a lane's 16-bit
    scale word spread to the low and high half (__byte_perm selector 0x4140), then shifted."""
    spread = (pair & 0xFF) | ((pair >> 8) & 0xFF) << 16
    if bf:
        return (spread << 4) & 0x07F007F0
    return (spread << 7) & 0x3F803F80


def halves(word: int) -> tuple[int, int]:
    return word & 0xFFFF, word >> 16


def f16(bits: int) -> np.float16:
    return np.array([bits], dtype=np.uint16).view(np.float16)[0]


def bf16(bits) -> torch.Tensor:
    return torch.tensor(np.asarray(bits, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)


CODES = range(16)
SCALES = [b for b in range(128) if b != 0x7F]          # 0x7F is E4M3 NaN


def test_slot_word_is_the_packers_word():
    """The docstring's word (slot_word) is byte for byte what layout.py's packer writes."""
    from cupool.layout import _unwords, _words
    rng = np.random.default_rng(7)
    slots = rng.integers(0, 16, size=(500, 8))
    packed = _words(torch.tensor(slots, dtype=torch.uint8)).numpy()
    for codes, b in zip(slots.tolist(), packed):
        assert int.from_bytes(bytes(b.tolist()), "little") == slot_word(codes), codes
    assert torch.equal(_unwords(torch.tensor(packed)), torch.tensor(slots, dtype=torch.uint8))


@pytest.mark.parametrize("j", range(4))
@pytest.mark.parametrize("bf", [False, True], ids=["fp16", "bf16"])
def test_slot_placement_routes_every_slot(bf, j):
    """fp4x2_raw<BF, J> of a word puts slot j's code in the low half and slot j + 4's in the high
    half, at the bits that code alone in slot 0 gets, whatever the other slots hold."""
    rng = np.random.default_rng(j)
    for slots in rng.integers(0, 16, size=(200, 8)).tolist():
        lo, hi = halves(fp4x2_raw(slot_word(slots), bf, j))
        assert lo == raw_of_code(slots[j], bf), (slots, j)
        assert hi == raw_of_code(slots[j + 4], bf), (slots, j)


@pytest.mark.parametrize("bf", [False, True], ids=["fp16", "bf16"])
def test_scale_bytes_route_to_their_halves(bf):
    rng = np.random.default_rng(1)
    for pair in rng.integers(0, 2 ** 16, size=500).tolist():
        lo, hi = halves(scale_raw(pair, bf))
        shift = 4 if bf else 7
        assert lo == (pair & 0x7F) << shift and hi == ((pair >> 8) & 0x7F) << shift, hex(pair)


def test_fp16_dequantised_weights_are_exact():
    codes = np.array([f16(raw_of_code(c, False)) for c in CODES], dtype=np.float16)
    for b in SCALES:
        s = f16(scale_raw(b, False) & 0xFFFF) * np.float16(2.0 ** 15)
        assert float(s) == e4m3(b) * 2 ** 7, b
        prod = codes * s                                           # mul.rn.f16x2
        want = np.array([e2m1(c) * e4m3(b) * 2.0 ** -7 for c in CODES])
        np.testing.assert_array_equal(prod.astype(np.float64), want, err_msg=f"scale byte {b}")


def test_bf16_dequantised_weights_are_exact():
    codes = bf16([raw_of_code(c, True) for c in CODES])
    assert torch.equal(codes.double(), torch.tensor([e2m1(c) * 2.0 ** -126 for c in CODES],
                                                    dtype=torch.float64))
    p120 = torch.tensor(2.0 ** 120, dtype=torch.bfloat16)
    p118 = torch.tensor(2.0 ** 118, dtype=torch.bfloat16)
    for b in SCALES:
        s = bf16([scale_raw(b, True) & 0xFFFF])[0] * p120 * p118   # two mul.rn.bf16x2
        assert float(s) == e4m3(b) * 2.0 ** 118, b
        prod = codes * s
        want = torch.tensor([e2m1(c) * e4m3(b) * 2.0 ** -8 for c in CODES], dtype=torch.float64)
        assert torch.equal(prod.double(), want), f"scale byte {b}"
        normal = prod.double().abs()
        assert bool(((normal == 0) | (normal >= 2.0 ** -126)).all()), "a product is subnormal"


def test_the_constants_are_the_powers_of_two():
    assert float(f16(0x7800)) == 2.0 ** 15
    assert float(bf16([0x7B80])[0]) == 2.0 ** 120
    assert float(bf16([0x7A80])[0]) == 2.0 ** 118


def test_the_mirror_matches_the_kernel_source():
    """The shifts, masks and constants above are the ones in mma_fp4.cuh (a change there must be
    mirrored here, or this fails)."""
    from cupool import kernels
    src = (kernels.kernel_dir() / "mma_fp4.cuh").read_text()
    for text in ("MAG_SHIFT = (BF ? 6 : 9) - 3 * J", "MAG = BF ? 0x01C001C0u : 0x0E000E00u",
                 "SIGN_SHIFT = 3 - (J ^ 1)", "shift_left<SIGN_SHIFT>(w) & 0x80008000u",
                 "shift_left<MAG_SHIFT>(w) & (MAG | 0x80008000u)",
                 "__byte_perm(pair, 0u, 0x4140)",
                 "(spread << 4) & 0x07F007F0u, BF16X2_2P120), BF16X2_2P118)",
                 "(spread << 7) & 0x3F803F80u, FP16X2_2P15)", "#define FP16X2_2P15 0x78007800u",
                 "#define BF16X2_2P120 0x7B807B80u", "#define BF16X2_2P118 0x7A807A80u",
                 "return BF ? 256.0f : 128.0f;"):
        assert text in src, text
