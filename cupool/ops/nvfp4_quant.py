"""Launcher of `rawkernels/nvfp4_quant.cu`: NVFP4 quantization on the GPU, bit-identical to
`cupool.nvfp4.quantize`, and a fast path from transformers-style stacked experts to store rows.

Shape legend (ARCHITECTURE.md): E experts · H hidden size · I expert intermediate size; a weight is
[..., N, K]. This runs at build time, not in the decode step: it allocates through torch and reads
one device word back (the NaN/Inf census) before the second pass.
"""

from __future__ import annotations

import torch

from cupool import _cuda, kernels, nvfp4
from cupool import layout as _layout
from cupool.nvfp4 import BLOCK, NVFP4Tensor

_SUFFIX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
THREADS = 256       # must match the kernel's THREADS (passed as a define)
UNROLL = 4          # 16-byte loads in flight per thread in pass 1
_MAX_GRID_Y = 65535


def _as_matrices(w: torch.Tensor, name: str) -> tuple[torch.Tensor, int, int, int]:
    """A view [M, N, K] of w with K contiguous, and its (M, N, K). Never copies."""
    n, k = nvfp4.check_weight(w, name)
    if not w.is_cuda:
        raise ValueError(f"{name} must be a CUDA tensor for the GPU quantizer, got device "
                         f"{w.device} (cupool.nvfp4.quantize is the CPU reference)")
    if w.stride(-1) != 1:
        raise ValueError(f"{name}: the last dim (K) must be contiguous (stride 1), got strides "
                         f"{list(w.stride())}; pass w.contiguous()")
    try:
        w3 = w.view(-1, n, k) if w.dim() != 3 else w
    except RuntimeError:
        raise ValueError(f"{name}: the leading dims of shape {list(w.shape)} with strides "
                         f"{list(w.stride())} do not collapse to one matrix stride; pass "
                         f"w.contiguous()") from None
    esize = w.element_size()
    for what, v in (("data pointer", w3.data_ptr()), ("matrix stride", w3.stride(0) * esize),
                    ("row stride", w3.stride(1) * esize)):
        if v % 16:
            raise ValueError(f"{name}: the kernel reads 16-byte vectors, so the {what} must be a "
                             f"multiple of 16 bytes, got {v}; pass w.contiguous() (or a clone)")
    if n * (k // BLOCK) >= 2 ** 31 or n * k * esize // 16 >= 2 ** 31:
        raise ValueError(f"{name}: one matrix of shape [{n}, {k}] is too large for the kernel's "
                         f"32-bit in-matrix indices")
    return w3, w3.shape[0], n, k


def _check_out(out: NVFP4Tensor, lead, n: int, k: int, device) -> None:
    want = {"packed": (torch.uint8, (*lead, n, k // 2)),
            "block_scale": (torch.float8_e4m3fn, (*lead, n, k // BLOCK)),
            "global_scale": (torch.float32, tuple(lead))}
    for field, (dtype, shape) in want.items():
        t = getattr(out, field)
        if t.dtype != dtype or tuple(t.shape) != shape or t.device != device \
                or not t.is_contiguous():
            raise ValueError(f"out.{field}: expected a contiguous {dtype} tensor {list(shape)} on "
                             f"{device}, got {t.dtype} {list(t.shape)} on {t.device}"
                             f"{'' if t.is_contiguous() else ' (not contiguous)'}")
    if out.packed.data_ptr() % 8:
        raise ValueError("out.packed: the kernel writes 8-byte words, so its data pointer must be "
                         f"8-byte aligned, got {out.packed.data_ptr():#x}")


def quantize(w: torch.Tensor, *, out: NVFP4Tensor | None = None, name: str = "w") -> NVFP4Tensor:
    """NVFP4-quantize a CUDA bf16/fp16/fp32 weight [..., N, K] on the GPU (two kernel launches on
    torch's current stream); bit-identical to `cupool.nvfp4.quantize(w)`.

    w may be a strided view as long as K is contiguous and the row/matrix strides are multiples of
    16 bytes (e.g. `gate_up[:, :I]`). `out` (packed uint8 [..., N, K/2], block_scale e4m3
    [..., N, K/16], global_scale float32 [...], contiguous, on w's device) is written if given.
    NaN/Inf anywhere raises ValueError (count and first index) before anything is written to out.
    """
    w3, m, n, k = _as_matrices(w, name)
    _cuda.require_gpu("the NVFP4 GPU quantizer")
    lead = tuple(w.shape[:-2])
    dev = w.device
    if out is None:
        out = NVFP4Tensor(torch.empty(*lead, n, k // 2, dtype=torch.uint8, device=dev),
                          torch.empty(*lead, n, k // BLOCK, dtype=torch.float8_e4m3fn, device=dev),
                          torch.empty(lead, dtype=torch.float32, device=dev))
    else:
        _check_out(out, lead, n, k, dev)
    if m == 0:
        return out
    esize = w.element_size()
    sfx = _SUFFIX[w.dtype]
    defines = {"THREADS": THREADS, "UNROLL": UNROLL}
    k_amax = kernels.function("nvfp4_quant", f"nvfp4_amax_{sfx}", defines, dev)
    k_quant = kernels.function("nvfp4_quant", f"nvfp4_quant_{sfx}", defines, dev)
    amax = torch.zeros(m, dtype=torch.int32, device=dev)             # float32 bits, as u32
    bad = torch.tensor([0, -1], dtype=torch.int64, device=dev)       # count, first index (u64 max)
    args = (w3, kernels.i64(w3.stride(0) * esize), kernels.i64(w3.stride(1) * esize),
            kernels.i32(m), kernels.i32(n), kernels.i32(k))
    grid_y = min(m, _MAX_GRID_Y)

    vecs = n * k * esize // 16                                       # 16-byte vectors per matrix
    kernels.launch(k_amax, (-(-vecs // (THREADS * UNROLL)), grid_y), THREADS,
                   (*args, amax, bad), device=dev)
    count = int(bad[0])                                              # the one sync
    if count:
        first = int(bad[1])
        raise nvfp4.nonfinite_error(name, w.shape, count, first,
                                    float(w[nvfp4.unravel(first, w.shape)]))
    blocks = n * (k // BLOCK)
    kernels.launch(k_quant, (-(-blocks // THREADS), grid_y), THREADS,
                   (*args, amax, out.packed, out.block_scale, out.global_scale), device=dev)
    return out


def quantize_experts_to_rows(gate_up: torch.Tensor, down: torch.Tensor,
                             row_layout: _layout.RowLayout, *, out: torch.Tensor | None = None,
                             chunk: int | None = None) -> torch.Tensor:
    """transformers-style stacked experts -> store rows, all on the GPU.

    gate_up: [E, 2I, H] (gate rows first, as in transformers' fused `gate_up_proj`); down:
    [E, H, I]; CUDA, bf16/fp16/fp32. Gate, up and down are quantized as separate matrices, each
    expert's with its own global scale (ModelOpt's w1, w3, w2), then laid out by
    `cupool.layout.pack_rows`. Returns uint8 [E, row_bytes] on the GPU (written into `out` if
    given); row e equals `layout.pack_row(layout, *reference quantization of expert e)` byte for
    byte.
    """
    H, I = row_layout.hidden, row_layout.intermediate
    for name, t, shape in (("gate_up", gate_up, ("E", 2 * I, H)), ("down", down, ("E", H, I))):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or tuple(t.shape[1:]) != shape[1:]:
            got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: expected [E, {shape[1]}, {shape[2]}] for H={H}, I={I}, "
                             f"got {got}")
    if gate_up.shape[0] != down.shape[0]:
        raise ValueError(f"gate_up has {gate_up.shape[0]} experts, down has {down.shape[0]}")
    if gate_up.device != down.device:
        raise ValueError(f"gate_up is on {gate_up.device}, down on {down.device}")
    gate = quantize(gate_up[:, :I], name="gate_up[:, :I] (gate)")
    up = quantize(gate_up[:, I:], name="gate_up[:, I:] (up)")
    dn = quantize(down, name="down")
    return _layout.pack_rows(row_layout, gate, up, dn, out=out, chunk=chunk)
