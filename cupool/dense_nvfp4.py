"""NVFP4 weights of a model's dense Linears, kept packed for the fused decode step's GEMVs.

Shape legend (ARCHITECTURE.md): N output rows · K inner dim · Kp = roundup(K, 64).

A checkpoint whose attention projections are NVFP4 (ModelOpt exports that quantize self_attn,
e.g. DeepSeek-R1-NVFP4's or MiniMax's o_proj) stores 4.5 bits a weight. transformers' forward
(prefill, and any layer the fused step does not run) needs the Linear's float weight, so that is
materialised as always (`dense_tensor`, dequantized); `attach` also keeps the packed form beside
it, on the same device, as the Linear's `cupool_nvfp4` attribute. `cupool.fused.FusedStep` then
runs that Linear's decode GEMV from the packed form (`DenseGemv` with `DenseNVFP4` weights): a
quarter of the bytes a token reads for it. Both compute the same weights: the float weight is the
dequantized NVFP4 one (E2M1 · block scale · global scale, rounded once to the Linear's dtype).

`quantize_linears` makes such a model from a float one (the synthetic models of the benchmarks and
tests), with the quantizer the experts use (`cupool.nvfp4.quantize`, on the weights' device).
`cupool.wrap` moves the packed forms with the model (`move`) and counts their bytes.
"""

from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn

from cupool import layout, nvfp4
from cupool.nvfp4 import NVFP4Tensor

ATTR = "cupool_nvfp4"
# the decode step's attention projections (the Linears `FusedStep` runs by name)
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def is_projection_weight(name: str) -> bool:
    """Whether `name` is the weight of an attention projection (`….{q,k,v,o}_proj.weight`): the
    Linears whose NVFP4 form is kept packed."""
    owner, _, leaf = name.rpartition(".")
    return leaf == "weight" and owner.rpartition(".")[2] in ATTENTION_PROJECTIONS


def step_projection_weights(names) -> list[str]:
    """The projection weights among `names` (`is_projection_weight`) whose attention module has
    all four of them among `names`: the GQA attention the fused step's GEMVs read. An MLA
    attention's lone o_proj (DeepSeek, Kimi: q_a/q_b/kv_a/kv_b, no k_proj or v_proj) is not
    one; its attention runs transformers' module, which no packed form makes faster. In the
    order of `names`."""
    names = [n for n in names if is_projection_weight(n)]
    have: dict[str, set[str]] = {}
    for n in names:
        attn, _, proj = n.removesuffix(".weight").rpartition(".")
        have.setdefault(attn, set()).add(proj)
    return [n for n in names
            if have[n.removesuffix(".weight").rpartition(".")[0]] == set(ATTENTION_PROJECTIONS)]


def quantize_shape_error(name: str, n: int, k: int) -> str | None:
    """Why the [n, k] projection `name` cannot be quantized to NVFP4 (its inner dim is not a
    whole number of NVFP4 blocks), or None where it can."""
    if k % nvfp4.BLOCK:
        return (f"{name} is [{n}, {k}]; NVFP4 needs its inner dim to be a multiple of "
                f"{nvfp4.BLOCK}")
    return None


@dataclasses.dataclass(frozen=True)
class DenseNVFP4:
    """One NVFP4 matrix [N, K] packed for `dense_gemv` (`cupool.layout.dense_strips`).

    strips: uint8 [ceil(N/16), 9·Kp] on the GPU (or any device for the reference).
    global_scale: the matrix's global scale (ModelOpt's weight_scale_2), a positive finite float.
    rows, cols: N, K.
    """
    strips: torch.Tensor
    global_scale: float
    rows: int
    cols: int

    @property
    def device(self) -> torch.device:
        return self.strips.device

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def nbytes(self) -> int:
        return self.strips.numel()

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        """The matrix [N, K] in `dtype` (E2M1 · block scale · global scale in float32, then cast),
        on the strips' device."""
        codes, scales = layout.dense_unstrips(self.strips, self.rows, self.cols)
        q = NVFP4Tensor(nvfp4.pack_codes(codes), scales,
                        torch.tensor(self.global_scale, dtype=torch.float32))
        return nvfp4.dequantize(q, torch.float32).to(device=self.device, dtype=dtype)


def check(q: NVFP4Tensor, name: str = "weight") -> tuple[int, int]:
    """(N, K) of a 2-D NVFP4Tensor whose scales a decode GEMV can take; ValueError naming `name`
    otherwise (K a multiple of 16, block scales finite and >= 0, one positive finite global
    scale)."""
    if not isinstance(q, NVFP4Tensor):
        raise TypeError(f"{name} must be an NVFP4Tensor, got {type(q).__name__}")
    if q.packed.dim() != 2 or q.packed.dtype != torch.uint8:
        raise ValueError(f"{name}: packed must be a uint8 [N, K/2] matrix, got {q.packed.dtype} "
                         f"{list(q.packed.shape)}")
    n, k = q.packed.shape[0], 2 * q.packed.shape[1]
    if n < 1 or k < 16 or k % 16:
        raise ValueError(f"{name}: shape [{n}, {k}]; K must be a positive multiple of 16")
    if q.block_scale.dtype != torch.float8_e4m3fn or tuple(q.block_scale.shape) != (n, k // 16):
        raise ValueError(f"{name}: block_scale must be float8_e4m3fn [{n}, {k // 16}], got "
                         f"{q.block_scale.dtype} {list(q.block_scale.shape)}")
    s = q.block_scale.float()
    bad = ~(torch.isfinite(s) & (s >= 0))
    if bool(bad.any()):
        at = [int(i) for i in torch.nonzero(bad)[0]]
        raise ValueError(f"{name}: block scale {float(s[tuple(at)])} at {at}; NVFP4 block "
                         f"scales are finite and >= 0")
    if q.global_scale.numel() != 1:
        raise ValueError(f"{name}: expected one global scale, got shape "
                         f"{list(q.global_scale.shape)}")
    g = float(q.global_scale.reshape(()))
    if not (g > 0 and g < float("inf")):
        raise ValueError(f"{name}: global scale {g}; it must be positive and finite")
    return n, k


def pack(q: NVFP4Tensor, device=None, name: str = "weight") -> DenseNVFP4:
    """`DenseNVFP4` of one NVFP4 matrix, its strips on `device` (default: q's)."""
    n, k = check(q, name)
    device = q.packed.device if device is None else torch.device(device)
    q = NVFP4Tensor(q.packed.to(device), q.block_scale.to(device), q.global_scale)
    return DenseNVFP4(layout.dense_strips(q).contiguous(), float(q.global_scale.reshape(())),
                      n, k)


def attach(linear: nn.Linear, q: NVFP4Tensor, name: str = "weight") -> DenseNVFP4:
    """Keep `q` packed beside `linear` (its `cupool_nvfp4`, on the weight's device) and set the
    Linear's weight to q dequantized in its dtype, so that transformers' forward and the fused
    step compute with the same weights. Returns the packed form."""
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"{name}: expected an nn.Linear, got {type(linear).__name__}")
    w = linear.weight
    n, k = check(q, name)
    if tuple(w.shape) != (n, k):
        raise ValueError(f"{name}: the NVFP4 matrix is [{n}, {k}], the Linear's weight "
                         f"{list(w.shape)}")
    q = NVFP4Tensor(q.packed.to(w.device), q.block_scale.to(w.device),
                    q.global_scale.to(w.device))
    packed = pack(q, name=name)
    with torch.no_grad():
        w.copy_(nvfp4.dequantize(q, torch.float32))
    setattr(linear, ATTR, packed)
    return packed


def of(linear) -> DenseNVFP4 | None:
    """The packed NVFP4 form kept beside `linear` (`attach`), or None."""
    p = getattr(linear, ATTR, None)
    return p if isinstance(p, DenseNVFP4) else None


def quantize_linears(model: nn.Module, names=ATTENTION_PROJECTIONS) -> int:
    """Quantize every nn.Linear of `model` whose attribute name is in `names` to NVFP4 (one global
    scale a matrix, `cupool.nvfp4.quantize` on the weight's device) and `attach` it. Returns how
    many. For models built in memory; a checkpoint's NVFP4 Linears are attached as loaded."""
    want = set(names)
    count = 0
    for full, m in model.named_modules():
        leaf = full.rsplit(".", 1)[-1]
        if leaf in want and isinstance(m, nn.Linear) and of(m) is None:
            attach(m, nvfp4.quantize(m.weight.detach()), full + ".weight")
            count += 1
    return count


def packed_bytes(model: nn.Module, elsewhere=None) -> int:
    """Bytes the packed forms attached to `model`'s Linears hold (with `elsewhere`, a device:
    only those not on it, i.e. what moving them there adds to it)."""
    dev = None if elsewhere is None else torch.device(elsewhere)
    return sum(p.nbytes for m in model.modules()
               if (p := of(m)) is not None and (dev is None or p.device != dev))


def move(model: nn.Module, device) -> None:
    """Each packed form attached to `model`'s Linears onto `device` (where `model.to(device)` put
    their weights: a plain attribute does not move with the module)."""
    device = torch.device(device)
    for m in model.modules():
        p = of(m)
        if p is not None and p.device != device:
            setattr(m, ATTR, dataclasses.replace(p, strips=p.strips.to(device)))


def describe(model: nn.Module) -> str:
    """One line: how many Linears carry a packed NVFP4 form, and which names."""
    names = sorted({re.sub(r"\.\d+\.", ".N.", n) for n, m in model.named_modules()
                    if of(m) is not None})
    count = sum(of(m) is not None for m in model.modules())
    return f"{count} NVFP4 dense Linears ({', '.join(names) or 'none'})"
