"""NVFP4 (NVIDIA ModelOpt's 4-bit format): values, packing, quantize / dequantize reference.

Shape legend: a weight is [..., N, K] (`F.linear` convention, K the reduction dim); every leading
index is one matrix with its own global scale.

The format (ARCHITECTURE.md, "NVFP4"):
- value codes: FP4 E2M1, nibble = sign<<3 | e1 e0 m, magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; two a byte,
  element 2i in the low nibble of byte i;
- block scale: FP8 E4M3 (float8_e4m3fn), one per 16 consecutive elements along K;
- global scale: FP32, one per matrix (ModelOpt's `weight_scale_2`).
Dequantized value = E2M1(code) · block_scale · global_scale.

`quantize` here is the reference that the GPU kernel (`rawkernels/nvfp4_quant.cu`) reproduces bit
for bit. It runs on CPU and CUDA tensors, in float32, and uses only operations whose float32
result IEEE 754 fixes exactly (max, abs, one correctly rounded division or multiplication per step,
comparisons, round-to-nearest-even casts), always tensor ∘ tensor: torch's CUDA backend turns
division by a Python scalar into a multiplication by its reciprocal, which rounds differently.

Quantization of one matrix W (all float32, each arrow one correctly rounded operation):
    g     = amax(|W|) / 2688                       (2688 = 6 · 448)
    s     = e4m3_rne(min((amax(|block|) / 6) / g, 448))
    d     = s · g
    code  = E2M1_rne(|w| / d), saturated at 6;    sign bit = sign bit of w
Rules that make every input well defined:
- g == 0 (an all-zero matrix) gives block scales 0 and codes 0;
- d == 0 (an all-zero block, or a block so small that its scale rounds to 0 in E4M3) gives codes 0
  (sign included), so such a block dequantizes to exact zeros (ModelOpt would store scale 1.0 for an all-zero block;
  we store 0, which dequantizes identically);
- ties go to the even code (0.25 → 0, 0.75 → 1.0, 1.25 → 1.0, 1.75 → 2.0, 2.5 → 2.0, 3.5 → 4.0,
  5 → 4.0), i.e. round-half-to-even in E2M1 itself, as `cvt.rn.satfinite.e2m1x2.f32` does;
- otherwise the sign bit is copied from w, so -0.0 and small negatives that round to 0 give code 8;
- the E4M3 cast is clamped at 448 first: torch versions differ on casting larger values (NaN or
  saturation), a clamp makes both the reference and the kernel agree everywhere.
"""

from __future__ import annotations

import dataclasses

import torch

# E2M1 magnitudes by 3-bit code (e1 e0 m); code | 8 is the negative value.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# Round-to-nearest boundaries between consecutive magnitudes, with the side a tie goes to: at an
# odd index the upper neighbour has the even code, so `>=` there and `>` at the even ones.
_BOUNDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True),
           (5.0, False))

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@dataclasses.dataclass
class NVFP4Tensor:
    """A weight [..., N, K] in NVFP4.

    packed:       uint8 [..., N, K/2], element 2i in the low nibble of byte i.
    block_scale:  float8_e4m3fn [..., N, K/16], one per 16 consecutive elements along K.
    global_scale: float32 [...], one per matrix (ModelOpt's weight_scale_2).
    Dequantized value = E2M1(code) · block_scale · global_scale.
    """
    packed: torch.Tensor
    block_scale: torch.Tensor
    global_scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape [..., N, K] of the unpacked matrix."""
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 2)

    def __getitem__(self, i) -> NVFP4Tensor:
        """Matrix i of a stack (index over the leading dims)."""
        return NVFP4Tensor(self.packed[i], self.block_scale[i], self.global_scale[i])


# --- codes -------------------------------------------------------------------------------------
def _table(device, dtype=torch.float32) -> torch.Tensor:
    """The 16 code values, code 8 being -0.0."""
    mags = torch.tensor(E2M1_VALUES, dtype=dtype, device=device)
    return torch.cat([mags, -mags])


def e2m1_decode(codes: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """uint8 codes (0..15) -> their E2M1 values (code 8 is -0.0)."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"codes must be in 0..15, got a maximum of {int(codes.max())}")
    return _table(codes.device, dtype)[codes.long()]


def _magnitude_code(x: torch.Tensor) -> torch.Tensor:
    """float32 x >= 0 (or +inf) -> uint8 code of the nearest E2M1 magnitude, ties to even, 7 above 6."""
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for bound, tie_up in _BOUNDS:
        code += (x >= bound) if tie_up else (x > bound)
    return code


def e2m1_encode(values: torch.Tensor) -> torch.Tensor:
    """Floating values -> uint8 codes: nearest E2M1 value, ties to the even code, saturated at ±6;
    the sign bit is the value's sign bit (so -0.0 -> 8). Exactly representable values round-trip
    through `e2m1_decode`."""
    if not values.dtype.is_floating_point:
        raise TypeError(f"values must be a floating tensor, got {values.dtype}")
    if values.numel() and torch.isnan(values).any():
        raise ValueError("values: NaN has no E2M1 code")
    v = values.float()
    return _magnitude_code(v.abs()) | (torch.signbit(v).to(torch.uint8) << 3)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] (K even) -> packed [..., K/2], element 2i in the low nibble of byte i."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    if codes.dim() == 0 or codes.shape[-1] % 2:
        raise ValueError(f"codes: the last dim must be even, got shape {list(codes.shape)}")
    c = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (c[..., 0] & 0xF) | ((c[..., 1] & 0xF) << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 packed [..., K/2] -> codes [..., K] (inverse of `pack_codes`)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed must be uint8, got {packed.dtype}")
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(
        *packed.shape[:-1], packed.shape[-1] * 2)


# --- argument checks (shared with the GPU launcher) -------------------------------------------------
def check_weight(w, name: str = "w") -> tuple[int, int]:
    """Raise TypeError/ValueError unless `w` is a bf16/fp16/fp32 tensor [..., N, K], K % 16 == 0.

    Returns (N, K). Non-finite values are checked separately (`check_finite`).
    """
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(w).__name__}")
    if w.dtype not in _FLOATS:
        raise TypeError(f"{name} must be float32, float16 or bfloat16 (NVFP4 quantizes floating "
                        f"weights), got {w.dtype}")
    if w.dim() < 2:
        raise ValueError(f"{name} must be [..., N, K] (at least 2-D), got shape {list(w.shape)}")
    n, k = w.shape[-2], w.shape[-1]
    if k == 0 or k % BLOCK or n == 0:
        raise ValueError(f"{name}: K (the last dim) must be a positive multiple of {BLOCK} "
                         f"(NVFP4 blocks are 16 wide) and N positive, got shape {list(w.shape)}")
    return n, k


def unravel(flat_index: int, shape) -> tuple[int, ...]:
    """Row-major flat index -> multi-index of `shape`."""
    idx, rest = [], int(flat_index)
    for dim in reversed(tuple(shape)):
        idx.append(rest % dim)
        rest //= dim
    return tuple(reversed(idx))


def nonfinite_error(name: str, shape, count: int, flat_index: int, value: float) -> ValueError:
    """The error for NaN/Inf weights (same text from the reference and the GPU launcher)."""
    where = unravel(flat_index, shape)
    return ValueError(f"{name}: {count} non-finite value(s) (NaN/Inf) in a weight of shape "
                      f"{list(shape)}; the first is {value} at index {where}. NVFP4 cannot "
                      f"represent them: fix or mask the weights before quantizing")


def check_finite(w: torch.Tensor, name: str = "w") -> None:
    """ValueError naming how many values are NaN/Inf and where the first one is."""
    bad = ~torch.isfinite(w)
    count = int(bad.sum())
    if count:
        first = int(torch.nonzero(bad.reshape(-1))[0])
        raise nonfinite_error(name, w.shape, count, first, float(w[unravel(first, w.shape)]))


# --- the three steps of the reference (tests check each against float64) ----------------------------
def _global_scale(amax: torch.Tensor) -> torch.Tensor:
    """float32 amax [...] -> g = amax / (6·448), one correctly rounded division."""
    return amax / torch.full_like(amax, E2M1_MAX * E4M3_MAX)


def _block_scale(block_amax: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """float32 block amax [M, N, K/16] and g [M] -> e4m3 block scales (0 where g == 0)."""
    gg = g[:, None, None].expand_as(block_amax)
    ok = gg > 0
    v = (block_amax / torch.full_like(block_amax, E2M1_MAX)) / torch.where(ok, gg, torch.ones_like(gg))
    v = torch.where(ok, v, torch.zeros_like(v))
    # inf (g subnormal and tiny) clamps to 448 too; the clamp precedes the cast on purpose (module doc)
    return torch.clamp(v, max=E4M3_MAX).to(torch.float8_e4m3fn)


def _codes(w32: torch.Tensor, s: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """float32 w [M, N, K], e4m3 s [M, N, K/16], g [M] -> uint8 codes [M, N, K]."""
    d = s.float() * g[:, None, None]                                  # [M, N, K/16]
    d = d.repeat_interleave(BLOCK, dim=-1)                            # [M, N, K]
    ok = d > 0
    x = w32.abs() / torch.where(ok, d, torch.ones_like(d))
    code = _magnitude_code(x) | (torch.signbit(w32).to(torch.uint8) << 3)
    return torch.where(ok, code, torch.zeros_like(code))


def quantize(w: torch.Tensor) -> NVFP4Tensor:
    """Reference NVFP4 quantization of a bf16/fp16/fp32 weight [..., N, K] (K a multiple of 16).

    Follows ModelOpt: per matrix g = amax(|W|)/(6·448); per 16-element block s = e4m3((block
    amax / 6) / g), computed in float32 and cast round-to-nearest-even after clamping to 448; each
    value becomes the nearest E2M1 magnitude of |w| / (s·g), **ties to the even code**, saturated at
    6, with w's sign bit. All-zero matrices and blocks give scale 0 and code 0 (never NaN). See the
    module docstring for the exact operation order the GPU kernel reproduces.

    Returns NVFP4Tensor(packed [..., N, K/2], block_scale [..., N, K/16], global_scale [...]).
    """
    n, k = check_weight(w, "w")
    check_finite(w, "w")
    lead = tuple(w.shape[:-2])
    w32 = w.detach().reshape(-1, n, k).float()                      # [M, N, K], exact widening
    amax = w32.abs().amax(dim=(1, 2))                               # [M]
    g = _global_scale(amax)
    block_amax = w32.abs().reshape(-1, n, k // BLOCK, BLOCK).amax(dim=-1)   # [M, N, K/16]
    s = _block_scale(block_amax, g)
    codes = _codes(w32, s, g)
    return NVFP4Tensor(packed=pack_codes(codes).reshape(*lead, n, k // 2),
                       block_scale=s.reshape(*lead, n, k // BLOCK),
                       global_scale=g.reshape(lead))


def dequantize(q: NVFP4Tensor, dtype=torch.float32) -> torch.Tensor:
    """NVFP4Tensor [..., N, K] -> values (E2M1 · block_scale) · global_scale, computed in float32
    (the first product is exact) and cast to `dtype`."""
    if q.packed.dtype != torch.uint8:
        raise TypeError(f"packed must be uint8, got {q.packed.dtype}")
    if q.block_scale.dtype != torch.float8_e4m3fn:
        raise TypeError(f"block_scale must be float8_e4m3fn, got {q.block_scale.dtype}")
    *lead, n, half = q.packed.shape
    k = 2 * half
    if tuple(q.block_scale.shape) != (*lead, n, k // BLOCK):
        raise ValueError(f"block_scale: expected shape {[*lead, n, k // BLOCK]} for packed "
                         f"{list(q.packed.shape)}, got {list(q.block_scale.shape)}")
    if tuple(q.global_scale.shape) != tuple(lead):
        raise ValueError(f"global_scale: expected shape {list(lead)} (one per matrix), got "
                         f"{list(q.global_scale.shape)}")
    vals = e2m1_decode(unpack_codes(q.packed))                                   # [..., N, K]
    s = q.block_scale.float().repeat_interleave(BLOCK, dim=-1)
    g = q.global_scale.float().to(vals.device)[..., None, None]
    return ((vals * s) * g).to(dtype)
