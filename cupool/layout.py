"""The kernel layout of one expert row: what the host store, the bank and the GEMM agree on.

Shape legend: H hidden size, I expert intermediate size; Hp = roundup(H, 64), Ip = roundup(I, 64)
(padding is zero weights with zero scales, so it contributes nothing).

A row holds one expert: w13 = [gate; up] ([2I, H]), w2 ([H, I]), both NVFP4, their global
scales and, for experts with biases (gpt-oss), the biases. It is laid out for the tensor-core
fragments of `mma.m16n8k16` (A operand = weights):

    row (row_bytes, 16-byte multiple)
    +---------+---------------------------------------------+----------------------+-------------+
    | header  | w13: Ip/16 strip pairs                       | w2: Hp/16 strips     | biases      |
    | 256 B   | [gate strip 0][up strip 0][gate strip 1]...  | [strip 0][strip 1].. | (bias only) |
    +---------+---------------------------------------------+----------------------+-------------+
    header: float32 gs_gate, gs_up, gs_down (global scales), zeros after.
    biases (RowLayout(bias=True) only, at bias_offset): float32 gate[Ip], up[Ip], down[Hp], zero
    past I and H. They travel with the row through the store, the bank and the prefill scratch.

    strip (16 matrix rows × Kp columns; Kp = Hp for w13, Ip for w2), 9·Kp bytes:
    +-------------------------+-------------------------+-----
    | chunk 0: 512 B + 64 B   | chunk 1: 512 B + 64 B   | ...     Kp/64 chunks of 576 B
    +-------------------------+-------------------------+-----
    chunk c (columns 64c … 64c+63), packed part: 32 lanes × 16 B; lane L = 4g + t (g = L // 4,
    t = L % 4) holds 4 words; word q is k-tile q of the mma, whose k-slots 2t, 2t+1, 2t+8, 2t+9
    are the columns k0 … k0+3, k0 = 64c + 16t + 4q. A word holds 8 E2M1 codes (s·e1·e0·m) in
    slots n = 0 … 7:
        slot 0: (row g,   k0)      slot 4: (row g,   k0+1)
        slot 1: (row g+8, k0)      slot 5: (row g+8, k0+1)
        slot 2: (row g,   k0+2)    slot 6: (row g,   k0+3)
        slot 3: (row g+8, k0+2)    slot 7: (row g+8, k0+3)
    Slots j and j+4 are the low and high half of the j-th A-fragment register of the mma, so a
    warp's one 16-byte load per lane is four k-tiles of A, coalesced into 512 contiguous bytes,
    and dequantisation needs no shuffles. Slot n = 4h + j sits in 16-bit half h of the word: its
    magnitude bits e1·e0·m at bits 16h + 3j … 16h + 3j + 2 (m lowest) and its sign at bit
    16h + 12 + (j xor 1). (Signs apart from magnitudes: moved into fp16 or bf16 positions, the
    magnitude and sign of registers 1 and 2 then need one shift or none, and the other shifts
    are shared, mma_fp4.cuh.)
    Lane t's columns of a chunk are the 16 consecutive columns 64c + 16t …: its B fragments are
    32 contiguous bytes of an activation row, and all its weights lie in one 16-column scale block
    per row.
    chunk c, scale part: byte 2L is the E4M3 block scale of (row g, columns 64c+16t …), byte
    2L+1 that of (row g+8, the same columns): lane L's two scales, one 16-bit load.

Row sizes: 256 + 27/16·Hp·Ip bytes (Qwen3-30B-A3B, H=2048, I=768: 2,654,464 B = 2.53 MiB), plus
4·(2·Ip + Hp) with biases (gpt-oss, H = I = 2880: 13,997,056 + 34,560 B = 13.4 MiB).

Experts without a gate projection (Nemotron-H: down(act(up·x)), `RowLayout(gated=False)`): w13 is
the up matrix alone, Ip/16 up strips one after another (no gate strips between them), so w2
starts at 256 + 9·Hp·Ip/16; the header's gate scale (first float) is 0. Row size 256 +
18/16·Hp·Ip. Such rows carry no biases. Kernels compile this layout with ROW_GATED=0 (gated
layouts define nothing new, so their builds are unchanged).

`pack_row` / `unpack_row` convert NVFP4Tensors ↔ a row exactly; nothing else knows the layout,
so a different GEMM layout changes only this file (and the kernels that read it).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from cupool.nvfp4 import NVFP4Tensor

HEADER_BYTES = 256
CHUNK_CODES = 512                # packed codes of a 64-column chunk of a strip (32 lanes x 16 B)
CHUNK_BYTES = CHUNK_CODES + 64   # ... then its 64 scale bytes (moe_common.cuh's CHUNK_BYTES)
CHUNK_COLS = 64                  # columns of a chunk


def _roundup(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """Offsets of one expert row for hidden size H and intermediate size I (and biases)."""
    hidden: int          # H
    intermediate: int    # I
    bias: bool = False   # the row ends with the experts' float32 biases (gate, up, down)
    gated: bool = True   # w13 = [gate; up] strip pairs; False: up strips alone (no gate)

    def __post_init__(self):
        for name, v in (("hidden", self.hidden), ("intermediate", self.intermediate)):
            if not isinstance(v, (int, np.integer)) or v <= 0 or v % 16:
                raise ValueError(f"{name} size must be a positive multiple of 16 (NVFP4 blocks "
                                 f"are 16 wide), got {v!r}")
        if not isinstance(self.bias, bool):
            raise ValueError(f"bias must be a bool, got {self.bias!r}")
        if not isinstance(self.gated, bool):
            raise ValueError(f"gated must be a bool, got {self.gated!r}")
        if self.bias and not self.gated:
            raise ValueError("rows of non-gated experts (gated=False) carry no biases")

    @property
    def hp(self) -> int:
        return _roundup(self.hidden, 64)

    @property
    def ip(self) -> int:
        return _roundup(self.intermediate, 64)

    @property
    def w13_strip_bytes(self) -> int:
        return 9 * self.hp

    @property
    def w2_strip_bytes(self) -> int:
        return 9 * self.ip

    @property
    def w13_offset(self) -> int:
        return HEADER_BYTES

    @property
    def w13_strips(self) -> int:
        """Strips of w13: a gate and an up strip per 16 rows of I, or the up strips alone."""
        return (2 if self.gated else 1) * (self.ip // 16)

    @property
    def w2_offset(self) -> int:
        return HEADER_BYTES + self.w13_strips * self.w13_strip_bytes

    @property
    def bias_offset(self) -> int:
        """Where the biases start: right after w2 (a 16-byte multiple: Hp, Ip are multiples of
        64)."""
        return self.w2_offset + (self.hp // 16) * self.w2_strip_bytes

    @property
    def bias_bytes(self) -> int:
        return 4 * (2 * self.ip + self.hp) if self.bias else 0

    @property
    def row_bytes(self) -> int:
        return self.bias_offset + self.bias_bytes

    @property
    def row_stride(self) -> int:
        """row_bytes rounded up to 256: where the host store (its default alignment), the bank
        and the prefill scratch place consecutive rows."""
        return _roundup(self.row_bytes, 256)

    def defines(self) -> dict:
        """The -D defines kernels compile with for this layout (ROW_BIAS only with biases, so a
        bias-free layout builds exactly the kernels it always has)."""
        d = {"HP": self.hp, "IP": self.ip, "ROW_W2_OFFSET": self.w2_offset}
        if self.bias:
            d["ROW_BIAS"] = 1
        if not self.gated:
            d["ROW_GATED"] = 0
        return d


# --- strip packing ------------------------------------------------------------------------------
def _lane_order(kp: int) -> np.ndarray:
    """Index map [Kp/64, 32 lanes, 4 words, 8 slots] -> (row in strip, column) as flat r*Kp+k."""
    c = np.arange(kp // 64)[:, None, None, None]
    lane = np.arange(32)[None, :, None, None]
    q = np.arange(4)[None, None, :, None]
    n = np.arange(8)[None, None, None, :]
    g, t = lane // 4, lane % 4
    row = g + 8 * (n % 2)                          # slots 1,3,5,7 are row g+8
    col = 64 * c + 16 * t + 4 * q + 2 * ((n // 2) % 2) + (n // 4)
    return (row * kp + col).reshape(-1)


_ORDER_CACHE: dict[int, torch.Tensor] = {}


def _order(kp: int) -> torch.Tensor:
    o = _ORDER_CACHE.get(kp)
    if o is None:
        o = torch.from_numpy(_lane_order(kp))
        _ORDER_CACHE[kp] = o
    return o


_ORDER_ON: dict[tuple[int, torch.device], torch.Tensor] = {}


def _order_on(kp: int, device) -> torch.Tensor:
    """`_order(kp)` on `device` (cached: the same index map, copied once per device)."""
    device = torch.device(device)
    o = _ORDER_ON.get((kp, device))
    if o is None:
        o = _order(kp).to(device)
        _ORDER_ON[(kp, device)] = o
    return o


def _codes(q: NVFP4Tensor) -> torch.Tensor:
    """uint8 [N, K] E2M1 codes of a packed matrix (even element in the low nibble)."""
    p = q.packed
    return torch.stack([p & 0xF, p >> 4], dim=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)


def _pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] codes -> [N, K/2] packed, even element in the low nibble."""
    c = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (c[..., 0] | (c[..., 1] << 4)).contiguous()


def _chunk_scales(scales: torch.Tensor, kp: int) -> torch.Tensor:
    """Scale bytes [..., 16·s, Kp/16] -> [..., s, Kp/64, 64] in chunk order: byte 2L + h of chunk c
    is (row g + 8h, block 4c + t), L = 4g + t."""
    lead = scales.shape[:-2]
    s = scales.shape[-2] // 16
    sc = scales.reshape(*lead, s, 2, 8, kp // 64, 4)                   # [.., s, h, g, c, t]
    n = len(lead)
    perm = list(range(n)) + [n + i for i in (0, 3, 2, 4, 1)]           # [.., s, c, g, t, h]
    return sc.permute(*perm).reshape(*lead, s, kp // 64, CHUNK_BYTES - CHUNK_CODES)


def _row_scales(chunked: torch.Tensor, kp: int) -> torch.Tensor:
    """Inverse of `_chunk_scales`: [s, Kp/64, 64] -> [16·s, Kp/16]."""
    s = chunked.shape[0]
    sc = chunked.reshape(s, kp // 64, 8, 4, 2)                         # [s, c, g, t, h]
    return sc.permute(0, 4, 2, 1, 3).reshape(16 * s, kp // 16)


def strip_scales(strips: torch.Tensor, kp: int) -> torch.Tensor:
    """The scale bytes of strips (uint8 [..., 9·Kp]) as a view [..., Kp/64, 64]: chunk c's 64 bytes
    in the order of `_chunk_scales`."""
    return strips.view(*strips.shape[:-1], kp // 64, CHUNK_BYTES)[..., CHUNK_CODES:]


def _sign_bit(j: int) -> int:
    """Bit of slot j's sign in its 16-bit half (the docstring's 12 + (j xor 1))."""
    return 12 + (j ^ 1)


def _words(slots: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., 8] in slot order -> the word's 4 bytes [..., 4] (little-endian)."""
    c = slots.to(torch.int32)
    out = []
    for h in range(2):
        half = torch.zeros_like(c[..., 0])
        for j in range(4):
            code = c[..., 4 * h + j]
            half |= ((code & 7) << (3 * j)) | ((code >> 3) << _sign_bit(j))
        out += [half & 0xFF, half >> 8]
    return torch.stack(out, dim=-1).to(torch.uint8)


def _unwords(words: torch.Tensor) -> torch.Tensor:
    """Inverse of `_words`: bytes [..., 4] -> uint8 codes [..., 8] in slot order."""
    b = words.to(torch.int32)
    out = []
    for h in range(2):
        half = b[..., 2 * h] | (b[..., 2 * h + 1] << 8)
        for j in range(4):
            out.append(((half >> (3 * j)) & 7) | (((half >> _sign_bit(j)) & 1) << 3))
    return torch.stack(out, dim=-1).to(torch.uint8)


def _strips(codes: torch.Tensor, scales: torch.Tensor, kp: int) -> torch.Tensor:
    """Strips of a [16·s, Kp] code matrix and its [16·s, Kp/16] scale bytes -> uint8 [s, 9·Kp]."""
    return _strips_stack(codes[None], scales[None], kp)[0]


def _unstrips(strips: torch.Tensor, kp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `_strips`: uint8 [s, 9·Kp] -> codes [16·s, Kp], scale bytes [16·s, Kp/16]."""
    s = strips.shape[0]
    packed = strips.reshape(s, kp // 64, CHUNK_BYTES)[:, :, :CHUNK_CODES].reshape(s, 2 * kp, 4)
    slots = _unwords(packed).reshape(s, 16 * kp)
    codes = torch.empty_like(slots)
    codes[:, _order(kp)] = slots
    return codes.reshape(16 * s, kp), _row_scales(strip_scales(strips, kp), kp)


def _padded(q: NVFP4Tensor, rows: int, cols: int, name: str):
    """Codes [rows, cols] and scale bytes [rows, cols/16] of a 2-D NVFP4Tensor, zero-padded."""
    if q.packed.dim() != 2:
        raise ValueError(f"{name}: expected one matrix (2-D packed), got shape {tuple(q.packed.shape)}")
    n, k = q.packed.shape[0], q.packed.shape[1] * 2
    if n > rows or k > cols:
        raise ValueError(f"{name}: shape [{n}, {k}] does not fit the layout's [{rows}, {cols}]")
    codes = torch.zeros(rows, cols, dtype=torch.uint8)
    codes[:n, :k] = _codes(q).cpu()
    sc = torch.zeros(rows, cols // 16, dtype=torch.uint8)
    sc[:n, :k // 16] = q.block_scale.cpu().view(torch.uint8)
    return codes, sc


def _bias_section(layout: RowLayout, bias, lead: tuple, device) -> torch.Tensor:
    """uint8 [*lead, bias_bytes] of biases (gate [*lead, I], up [*lead, I], down [*lead, H]):
    float32, zero-padded to Ip, Ip, Hp. Empty for a bias-free layout, which must get bias=None."""
    if not layout.bias:
        if bias is not None:
            raise ValueError("bias: given, but the layout has no biases (RowLayout(bias=True))")
        return torch.zeros(*lead, 0, dtype=torch.uint8, device=device)
    if bias is None or len(bias) != 3:
        raise ValueError("bias: the layout has biases; pass (gate [I], up [I], down [H]) float "
                         "tensors")
    H, I = layout.hidden, layout.intermediate
    out = torch.zeros(*lead, 2 * layout.ip + layout.hp, dtype=torch.float32, device=device)
    for name, b, n, at in (("gate", bias[0], I, 0), ("up", bias[1], I, layout.ip),
                           ("down", bias[2], H, 2 * layout.ip)):
        if not isinstance(b, torch.Tensor) or not b.is_floating_point():
            raise TypeError(f"bias {name}: expected a float tensor, got "
                            f"{getattr(b, 'dtype', type(b).__name__)}")
        if tuple(b.shape) != (*lead, n):
            raise ValueError(f"bias {name}: expected shape {[*lead, n]}, got {list(b.shape)}")
        bf = b.detach().to(device=device, dtype=torch.float32)
        if not bool(torch.isfinite(bf).all()):
            raise ValueError(f"bias {name}: holds NaN or Inf")
        out[..., at:at + n] = bf
    return out.view(torch.uint8)


def _row_tensor(layout: RowLayout, row) -> torch.Tensor:
    """A row (uint8, numpy or torch, any device) as a flat CPU uint8 tensor of row_bytes."""
    if isinstance(row, torch.Tensor):
        r = row.cpu()
    else:                                    # torch wants a writable array (a store's rows are not)
        arr = np.asarray(row)
        r = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
    r = r.reshape(-1)[:layout.row_bytes]
    if r.numel() != layout.row_bytes:
        raise ValueError(f"row: expected {layout.row_bytes} bytes, got {r.numel()}")
    return r


def unpack_bias(layout: RowLayout, row) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The biases of a row (uint8, numpy or torch) as float32 (gate [I], up [I], down [H])."""
    if not layout.bias:
        raise ValueError("unpack_bias: the layout has no biases")
    f = _row_tensor(layout, row)[layout.bias_offset:].clone().view(torch.float32)
    ip, I, H = layout.ip, layout.intermediate, layout.hidden
    return f[:I].clone(), f[ip:ip + I].clone(), f[2 * ip:2 * ip + H].clone()


def pack_row(layout: RowLayout, gate: NVFP4Tensor, up: NVFP4Tensor, down: NVFP4Tensor,
             out: np.ndarray | torch.Tensor | None = None, *, bias=None) -> torch.Tensor:
    """One expert's NVFP4 matrices -> its row (uint8 [row_bytes]); written into `out` if given.

    gate, up: [I, H] (w1, w3; gate None for a non-gated layout); down: [H, I] (w2); each with a
    scalar global scale. bias: (gate
    [I], up [I], down [H]) float tensors, required by (and only by) a layout with biases.
    """
    H, I, hp, ip = layout.hidden, layout.intermediate, layout.hp, layout.ip
    _check_gate(layout, gate)
    for name, q, shape in (("gate", gate, (I, H)), ("up", up, (I, H)), ("down", down, (H, I))):
        if q is None:
            continue
        got = (q.packed.shape[0], q.packed.shape[-1] * 2) if q.packed.dim() == 2 else tuple(q.packed.shape)
        if got != shape:
            raise ValueError(f"{name}: expected shape {list(shape)} for H={H}, I={I}, got {list(got)}")
        if q.global_scale.numel() != 1:
            raise ValueError(f"{name}: expected one global scale, got shape {tuple(q.global_scale.shape)}")
    u_codes, u_sc = _padded(up, ip, hp, "up")
    d_codes, d_sc = _padded(down, hp, ip, "down")
    us = _strips(u_codes, u_sc, hp)                        # [Ip/16, 9·Hp]
    if layout.gated:
        g_codes, g_sc = _padded(gate, ip, hp, "gate")
        gs = _strips(g_codes, g_sc, hp)
        w13 = torch.stack([gs, us], dim=1).reshape(-1)     # gate strip j, up strip j, ...
    else:
        w13 = us.reshape(-1)                               # up strip j, up strip j + 1, ...
    w2 = _strips(d_codes, d_sc, ip).reshape(-1)
    header = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    g_scale = float(gate.global_scale) if gate is not None else 0.0
    header[:12] = torch.tensor([g_scale, float(up.global_scale),
                                float(down.global_scale)], dtype=torch.float32).view(torch.uint8)
    row = torch.cat([header, w13, w2, _bias_section(layout, bias, (), "cpu")])
    assert row.numel() == layout.row_bytes
    if out is not None:
        dst = torch.from_numpy(out) if isinstance(out, np.ndarray) else out
        dst.view(torch.uint8).reshape(-1)[:layout.row_bytes].copy_(row)
    return row


def _check_gate(layout: RowLayout, gate) -> None:
    if layout.gated and gate is None:
        raise ValueError("gate: the layout is gated (w13 = [gate; up]); pass the gate matrices")
    if not layout.gated and gate is not None:
        raise ValueError("gate: the layout has no gate (RowLayout(gated=False)); pass gate=None")


def unpack_row(layout: RowLayout, row) -> tuple[NVFP4Tensor | None, NVFP4Tensor, NVFP4Tensor]:
    """Inverse of `pack_row`: a row (uint8, numpy or torch) -> (gate, up, down) NVFP4Tensors
    (gate None for a non-gated layout)."""
    r = _row_tensor(layout, row)
    H, I, hp, ip = layout.hidden, layout.intermediate, layout.hp, layout.ip
    scales = r[:12].clone().view(torch.float32)
    w13 = r[layout.w13_offset:layout.w2_offset].reshape(ip // 16, 2 if layout.gated else 1,
                                                         9 * hp)
    w2 = r[layout.w2_offset:layout.bias_offset].reshape(hp // 16, 9 * ip)

    def mk(strips, kp, n, k, gscale):
        codes, sc = _unstrips(strips.contiguous(), kp)
        return NVFP4Tensor(packed=_pack_codes(codes[:n, :k]),
                           block_scale=sc[:n, :k // 16].contiguous().view(torch.float8_e4m3fn),
                           global_scale=gscale.clone().reshape(()))
    if not layout.gated:
        return None, mk(w13[:, 0], hp, I, H, scales[1]), mk(w2, ip, H, I, scales[2])
    return (mk(w13[:, 0], hp, I, H, scales[0]), mk(w13[:, 1], hp, I, H, scales[1]),
            mk(w2, ip, H, I, scales[2]))


# --- many experts at once, on any device ------------------------------------------------------------
def _padded_stack(q: NVFP4Tensor, rows: int, cols: int, name: str, e: int):
    """Codes [E, rows, cols] and scale bytes [E, rows, cols/16] of a stacked NVFP4Tensor, zero-padded,
    on q's device."""
    if q.packed.dim() != 3 or q.packed.shape[0] != e:
        raise ValueError(f"{name}: expected a stack [E={e}, N, K/2] of packed matrices, got shape "
                         f"{list(q.packed.shape)}")
    n, k = q.packed.shape[1], q.packed.shape[2] * 2
    if tuple(q.block_scale.shape) != (e, n, k // 16):
        raise ValueError(f"{name}: block_scale must be [{e}, {n}, {k // 16}], got "
                         f"{list(q.block_scale.shape)}")
    dev = q.packed.device
    codes = torch.zeros(e, rows, cols, dtype=torch.uint8, device=dev)
    codes[:, :n, :k] = _codes(q)
    sc = torch.zeros(e, rows, cols // 16, dtype=torch.uint8, device=dev)
    sc[:, :n, :k // 16] = q.block_scale.view(torch.uint8)
    return codes, sc


def _strips_stack(codes: torch.Tensor, scales: torch.Tensor, kp: int) -> torch.Tensor:
    """`_strips` of each of E matrices: codes [E, 16·s, Kp], scales [E, 16·s, Kp/16] -> [E, s, 9·Kp]."""
    e, n = codes.shape[0], codes.shape[1]
    s = n // 16
    c = codes.reshape(e, s, 16 * kp).index_select(2, _order_on(kp, codes.device))
    packed = _words(c.reshape(e, s, 2 * kp, 8)).reshape(e, s, kp // 64, CHUNK_CODES)  # 8 slots a word
    return torch.cat([packed, _chunk_scales(scales, kp)], dim=3).reshape(e, s, 9 * kp)


def dense_strips_shape(n: int, k: int) -> tuple[int, int]:
    """The shape of `dense_strips` of an [n, k] matrix: (ceil(n/16), 9·Kp), Kp = roundup(k, 64)."""
    return -(-n // 16), 9 * _roundup(k, CHUNK_COLS)


def dense_strips_bytes(n: int, k: int) -> int:
    """Bytes of `dense_strips` of an [n, k] matrix (uint8, `dense_strips_shape`)."""
    strips, width = dense_strips_shape(n, k)
    return strips * width


def dense_strips(q: NVFP4Tensor) -> torch.Tensor:
    """One NVFP4 matrix [N, K] (a dense Linear's weight) as the strips `dense_gemv`'s NVFP4 build
    reads: uint8 [ceil(N/16), 9·Kp] on q's device, Kp = roundup(K, 64), strip s holding rows
    16s … 16s+15 in the strip layout above (rows past N and columns past K zero: zero codes with
    zero scales). The global scale is not in them (the launcher passes it)."""
    if q.packed.dim() != 2:
        raise ValueError(f"expected one matrix (2-D packed), got shape {list(q.packed.shape)}")
    n, k = q.packed.shape[0], q.packed.shape[1] * 2
    if k % 16:
        raise ValueError(f"K={k} is not a multiple of 16 (NVFP4 blocks are 16 wide)")
    if tuple(q.block_scale.shape) != (n, k // 16):
        raise ValueError(f"block_scale must be [{n}, {k // 16}], got {list(q.block_scale.shape)}")
    codes, sc = _padded_stack(NVFP4Tensor(q.packed[None], q.block_scale[None],
                                          q.global_scale.reshape(1)),
                              _roundup(n, 16), _roundup(k, CHUNK_COLS), "weight", 1)
    return _strips_stack(codes, sc, _roundup(k, CHUNK_COLS))[0]


def dense_unstrips(strips: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `dense_strips` (without the global scale): (codes uint8 [N, K], block scales
    float8_e4m3fn [N, K/16]), on the CPU."""
    codes, sc = _unstrips(strips.cpu().contiguous(), _roundup(k, 64))
    return codes[:n, :k].contiguous(), sc[:n, :k // 16].contiguous().view(torch.float8_e4m3fn)


def pack_rows(layout: RowLayout, gate: NVFP4Tensor, up: NVFP4Tensor, down: NVFP4Tensor,
              out: torch.Tensor | None = None, *, chunk: int | None = None,
              bias=None) -> torch.Tensor:
    """E experts' stacked NVFP4 matrices -> their rows, uint8 [E, row_bytes], on the tensors' device.

    gate, up: [E, I, H] (packed [E, I, H/2]; gate None for a non-gated layout); down: [E, H, I];
    global scales [E]. Row e is byte for
    byte `pack_row(layout, gate[e], up[e], down[e])`; this is the same index map applied with
    batched torch ops, so a GPU builds rows without a host round trip. `out` ([E, >= row_bytes]
    uint8, any device) receives them if given. `chunk` experts are converted at a time (default:
    about 1 GiB of temporaries). bias: (gate [E, I], up [E, I], down [E, H]) float tensors,
    required by (and only by) a layout with biases.
    """
    H, I, hp, ip = layout.hidden, layout.intermediate, layout.hp, layout.ip
    _check_gate(layout, gate)
    first = up if gate is None else gate
    e = first.packed.shape[0] if first.packed.dim() == 3 else -1
    for name, q, shape in (("gate", gate, (I, H)), ("up", up, (I, H)), ("down", down, (H, I))):
        if q is None:
            continue
        if q.packed.dim() != 3 or q.packed.shape[0] != e:
            raise ValueError(f"{name}: expected a stack [E, N, K/2] with the E of gate, got packed "
                             f"shape {list(q.packed.shape)} (gate: {list(first.packed.shape)})")
        got = (q.packed.shape[1], q.packed.shape[2] * 2)
        if got != shape:
            raise ValueError(f"{name}: expected matrices {list(shape)} for H={H}, I={I}, got "
                             f"{list(got)}")
        if tuple(q.global_scale.shape) != (e,):
            raise ValueError(f"{name}: expected global scales [{e}], got "
                             f"{list(q.global_scale.shape)}")
        if q.packed.device != first.packed.device:
            raise ValueError(f"{name} is on {q.packed.device}, gate on {first.packed.device}")
    dev = first.packed.device
    biases = _bias_section(layout, bias, (e,), dev)        # checked before any work
    if out is None:
        out = torch.empty(e, layout.row_bytes, dtype=torch.uint8, device=dev)
    elif out.dtype != torch.uint8 or out.dim() != 2 or out.shape[0] != e \
            or out.shape[1] < layout.row_bytes:
        raise ValueError(f"out: expected uint8 [{e}, >= {layout.row_bytes}], got {out.dtype} "
                         f"{list(out.shape)}")
    if chunk is None:
        chunk = max(1, (1 << 30) // (16 * 3 * hp * ip))    # ~16 bytes of temporaries per code
    for lo in range(0, e, chunk):
        hi = min(e, lo + chunk)
        part = [None if q is None else q[lo:hi] for q in (gate, up, down)]
        u_codes, u_sc = _padded_stack(part[1], ip, hp, "up", hi - lo)
        d_codes, d_sc = _padded_stack(part[2], hp, ip, "down", hi - lo)
        us = _strips_stack(u_codes, u_sc, hp)
        if layout.gated:
            g_codes, g_sc = _padded_stack(part[0], ip, hp, "gate", hi - lo)
            w13 = torch.stack([_strips_stack(g_codes, g_sc, hp), us],
                              dim=2).reshape(hi - lo, -1)    # gate strip j, up strip j, ...
        else:
            w13 = us.reshape(hi - lo, -1)                    # up strips alone
        w2 = _strips_stack(d_codes, d_sc, ip).reshape(hi - lo, -1)
        header = torch.zeros(hi - lo, HEADER_BYTES, dtype=torch.uint8, device=dev)
        scales = [torch.zeros(hi - lo) if q is None else q.global_scale for q in part]
        gs = torch.stack([g.to(device=dev, dtype=torch.float32) for g in scales], dim=1)
        header[:, :12] = gs.contiguous().view(torch.uint8)
        rows = torch.cat([header, w13, w2, biases[lo:hi]], dim=1)
        out[lo:hi, :layout.row_bytes].copy_(rows)
    return out
