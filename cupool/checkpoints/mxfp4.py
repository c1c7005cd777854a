"""MXFP4 checkpoints (openai/gpt-oss-20b, gpt-oss-120b): the format, its conversion to NVFP4 at
load, and the reader.

Shape legend: L layers · E experts · H hidden · I expert intermediate; weights [N, K] (`F.linear`,
K the reduction dim); M matrices of a stack; G = K/32 blocks of a matrix row.

config.json:

    "quantization_config": {"quant_method": "mxfp4",
                            "modules_to_not_convert": ["model.layers.*.self_attn",
                                "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}

modules_to_not_convert are fnmatch patterns of modules kept in bf16 (in gpt-oss: every dense
tensor). A checkpoint without a quantization config whose experts are `*_proj_blocks` tensors is
read the same way.

Tensors of one layer's routed experts ({mid} = "mlp.experts"); the dense part is plain bf16
(attention q/k/v/o weights and biases, `self_attn.sinks`, `mlp.router.weight` [E, H] and
`mlp.router.bias` [E], norms, embeddings, lm_head):

    {mid}.gate_up_proj_blocks  uint8 [E, 2I, H/32, 16]   rows: the 2I outputs, gate and up
                                                         interleaved (row 2i gate i, 2i + 1 up i)
    {mid}.gate_up_proj_scales  uint8 [E, 2I, H/32]       E8M0, one per 32-element block
    {mid}.gate_up_proj_bias    bf16 [E, 2I]              interleaved like the rows
    {mid}.down_proj_blocks     uint8 [E, H, I/32, 16]
    {mid}.down_proj_scales     uint8 [E, H, I/32]
    {mid}.down_proj_bias       bf16 [E, H]

The interleaving is `cupool.checkpoints.base`'s one rule (config.json model_type "gpt_oss"); a
checkpoint of another model type with these tensors is read gate rows first.

The format. A block is 32 consecutive elements of a row along K; its 16 bytes hold two E2M1 codes
each, the even element in the low nibble, so a row's bytes [G, 16] read as [K/2] are NVFP4's
packing exactly; the codes are NVFP4's too (sign, e1 e0, m: 0, .5, 1, 1.5, 2, 3, 4, 6). The
block's scale is one E8M0 byte s, the value 2^(s − 127); 255 is NaN (refused, naming the tensor
and index). Dequantized value = e2m1(code) · 2^(s − 127).

Conversion to NVFP4, per matrix (one expert's gate, up or down), `to_nvfp4`:
- the codes stay as they are: a 32-block is two 16-blocks sharing its scale;
- top = the largest E8M0 exponent among the matrix's blocks with a code of nonzero magnitude;
- global scale = 2^(top − 127 − 8), float32 (2^-135 at the least: a subnormal, still exact);
- block scale of a block with exponent s = 2^(s − top + 8), on both of its 16-blocks. E4M3
  (float8_e4m3fn) represents exactly the powers of two 2^-9 … 2^8, so this is exact iff
  s ≥ top − 17; then e2m1 · 2^(s − top + 8) · 2^(top − 135) = e2m1 · 2^(s − 127), each product a
  value of at most two significant bits in float32's range: the NVFP4 value equals the MXFP4
  value bit for bit (`cupool.nvfp4.dequantize` computes exactly these two products);
- a block whose codes are all ±0 gets block scale 0 (its codes, signs of zero included, kept);
- a block with s < top − 17 cannot be exact: its values v = e2m1 · 2^(s − 127) are requantized
  with the smallest block scale, 2^-9 (E4M3 byte 0x01): code = the E2M1 value nearest to
  v / 2^(top − 144), ties to even, sign kept (`cupool.nvfp4.e2m1_encode`);
- an all-zero matrix gets global scale 0 and block scales 0, as `cupool.nvfp4.quantize` writes it.
`mxfp4_exactness` says which blocks convert exactly from the scales and codes alone. The reader
counts every converted block and every requantized one with its largest |error| in
`Mxfp4Checkpoint.conversion` (a `ConversionTally`); `fill_store` logs a summary line of each fill.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from typing import NamedTuple

import torch

from cupool.checkpoints.base import (
    EXPERT_KEYS,
    FUSED_PROJS,
    Checkpoint,
    ExpertKind,
    _Group,
    _Layer,
    check_nvfp4,
    config_value,
    gate_up_rows,
    split_gate_up,
)
from cupool.checkpoints.errors import CheckpointError
from cupool.nvfp4 import NVFP4Tensor, e2m1_decode, e2m1_encode, pack_codes, unpack_codes

MX_BLOCK = 32                 # elements a block (and an E8M0 scale) covers
E8M0_BIAS = 127
E8M0_NAN = 255
E4M3_MIN_EXP, E4M3_MAX_EXP = -9, 8       # the powers of two E4M3 holds exactly
SPAN = E4M3_MAX_EXP - E4M3_MIN_EXP       # 17: block exponents this far below top stay exact
GLOBAL_OFFSET = E8M0_BIAS + E4M3_MAX_EXP  # global scale 2^(top − 135)
# E4M3 bytes of 2^e for e = -9 … 8
_POW2_E4M3 = torch.tensor([math.ldexp(1.0, e) for e in range(E4M3_MIN_EXP, E4M3_MAX_EXP + 1)],
                          dtype=torch.float32).to(torch.float8_e4m3fn).view(torch.uint8)
_SMALLEST_E4M3 = 0x01                    # 2^-9, the scale of requantized blocks
SUMMARY_TENSORS = 4                      # matrices named in a summary line

HINT = ("an E8M0 exponent that large scales the codes beyond any trained weight; are the "
        "*_scales tensors E8M0 (2^(s - 127))?")


# --- the format ------------------------------------------------------------------------------
def codes_nonzero(blocks: torch.Tensor) -> torch.Tensor:
    """bool [..., N, G]: the blocks of uint8 blocks [..., N, G, 16] that hold a code of nonzero
    magnitude (codes 0 and 8, ±0, are zero)."""
    if blocks.dtype != torch.uint8 or blocks.dim() < 3 or blocks.shape[-1] != MX_BLOCK // 2:
        raise ValueError(f"blocks: expected uint8 [..., N, G, {MX_BLOCK // 2}], got "
                         f"{blocks.dtype} {list(blocks.shape)}")
    return ((blocks & 0x77) != 0).any(dim=-1)


def _check_scales(scales: torch.Tensor, codes_nz: torch.Tensor) -> None:
    if scales.dtype != torch.uint8 or scales.dim() < 2:
        raise ValueError(f"scales: expected uint8 E8M0 [..., N, G], got {scales.dtype} "
                         f"{list(scales.shape)}")
    if codes_nz.dtype != torch.bool or codes_nz.shape != scales.shape:
        raise ValueError(f"codes_nonzero: expected bool {list(scales.shape)} like scales, got "
                         f"{codes_nz.dtype} {list(codes_nz.shape)}")


def top_exponents(scales: torch.Tensor, codes_nz: torch.Tensor) -> torch.Tensor:
    """int32 [...]: per matrix (every index of the dims before the last two), the largest E8M0
    exponent among its blocks with a nonzero code; -1 for an all-zero matrix."""
    _check_scales(scales, codes_nz)
    s = scales.to(torch.int32)
    return torch.where(codes_nz, s, torch.full_like(s, -1)).flatten(-2).amax(dim=-1)


def mxfp4_exactness(scales: torch.Tensor, codes_nz: torch.Tensor) -> torch.Tensor:
    """bool [..., N, G]: True where an MXFP4 block converts to NVFP4 exactly (module docstring):
    its codes are all ±0, or its exponent s is at least top − 17, top being the largest exponent
    of its matrix's blocks with a nonzero code. scales: uint8 E8M0 [..., N, G] (every index of
    the leading dims one matrix); codes_nz: bool [..., N, G] (`codes_nonzero`)."""
    top = top_exponents(scales, codes_nz)
    return ~codes_nz | (scales.to(torch.int32) >= top[..., None, None] - SPAN)


def _pow2_f64(e: torch.Tensor) -> torch.Tensor:
    """float64 2^e, exactly, for int e in [-1022, 1023] (built from the exponent bits)."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


class Converted(NamedTuple):
    """What `to_nvfp4` returns for a stack of M matrices."""
    q: NVFP4Tensor                 # packed [M, N, K/2], block_scale [M, N, K/16], global [M]
    lossy: torch.Tensor            # int64 [M]: blocks requantized
    max_abs_error: torch.Tensor    # float64 [M]: largest |NVFP4 value − MXFP4 value|


def to_nvfp4(blocks: torch.Tensor, scales: torch.Tensor) -> Converted:
    """MXFP4 matrices (blocks uint8 [M, N, G, 16], scales uint8 E8M0 [M, N, G]) as NVFP4, by the
    module docstring's conversion: exact wherever `mxfp4_exactness` says so, the other blocks
    requantized with the smallest block scale and counted. ValueError for a NaN scale (255)."""
    if blocks.dtype != torch.uint8 or blocks.dim() != 4 or blocks.shape[-1] != MX_BLOCK // 2:
        raise ValueError(f"blocks: expected uint8 [M, N, G, {MX_BLOCK // 2}], got {blocks.dtype} "
                         f"{list(blocks.shape)}")
    M, N, G, _ = blocks.shape
    if scales.dtype != torch.uint8 or tuple(scales.shape) != (M, N, G):
        raise ValueError(f"scales: expected uint8 [{M}, {N}, {G}] (one per block), got "
                         f"{scales.dtype} {list(scales.shape)}")
    nan = scales == E8M0_NAN
    if bool(nan.any()):
        at = [int(x) for x in torch.nonzero(nan)[0]]
        raise ValueError(f"scales: E8M0 {E8M0_NAN} (NaN) at {at}")
    nz = codes_nonzero(blocks)
    s = scales.to(torch.int32)
    top = top_exponents(scales, nz)                                       # [M]
    t = top[:, None, None]
    exact = nz & (s >= t - SPAN)
    lossy = nz & ~exact
    lut = _POW2_E4M3.to(scales.device)
    sb = lut[(s - t + E4M3_MAX_EXP - E4M3_MIN_EXP).clamp(0, SPAN)]       # 2^(s − top + 8)
    sb = torch.where(exact, sb, torch.zeros_like(sb))
    sb = torch.where(lossy, torch.full_like(sb, _SMALLEST_E4M3), sb)
    block_scale = sb.repeat_interleave(2, dim=-1).view(torch.float8_e4m3fn)   # [M, N, 2G]
    g = _pow2_f64(top.clamp(min=0) - GLOBAL_OFFSET).float()
    g = torch.where(top >= 0, g, torch.zeros_like(g))
    packed = blocks.reshape(M, N, G * MX_BLOCK // 2)
    n_lossy = lossy.flatten(1).sum(dim=1)
    err = torch.zeros(M, dtype=torch.float64, device=blocks.device)
    if bool(n_lossy.any()):
        packed = packed.clone()
        at = torch.nonzero(lossy, as_tuple=True)
        vals = e2m1_decode(unpack_codes(blocks[at])).double()             # [Q, 32]
        # v / 2^(top − 144) = e2m1 · 2^(s − top + 17), exact in float64 and (as the E2M1
        # rounding needs it) in float32 wherever it is not far below 0.25
        x = vals * _pow2_f64(s[at] - top[at[0]] + SPAN)[:, None]
        new = e2m1_encode(x.float())
        packed.view(M, N, G, MX_BLOCK // 2)[at] = pack_codes(new)
        block_err = (x - e2m1_decode(new).double()).abs().amax(dim=1)      # in units of 2^(top−144)
        err.scatter_reduce_(0, at[0], block_err, "amax")
        err = err * _pow2_f64(top.clamp(min=0) - GLOBAL_OFFSET + E4M3_MIN_EXP)
    return Converted(NVFP4Tensor(packed, block_scale, g), n_lossy, err)


def check_scales(scales: torch.Tensor, name: str, start: int) -> None:
    """CheckpointError naming tensor `name` and the index (expert start + i, row, block) of the
    first NaN (255) E8M0 scale of a window read from expert `start` on."""
    nan = scales == E8M0_NAN
    if bool(nan.any()):
        at = [int(x) for x in torch.nonzero(nan)[0]]
        raise CheckpointError(f"{name}: E8M0 scale {E8M0_NAN} (NaN) at {[start + at[0], *at[1:]]}"
                              f" ({int(nan.sum())} such block(s) in experts [{start}, "
                              f"{start + scales.shape[0]})); MXFP4 scales are 2^(s - 127) for s "
                              f"in 0..254")


# --- the tally -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LossyMatrix:
    """One converted matrix with blocks that could not be exact."""
    tensor: str              # e.g. "model.layers.3.mlp.experts.down_proj_blocks[7]"
    blocks: int              # requantized blocks
    max_abs_error: float     # largest |NVFP4 value − MXFP4 value| among them


@dataclasses.dataclass
class ConversionTally:
    """A running count of MXFP4 blocks converted to NVFP4 and of those requantized (module
    docstring). `since(earlier)` is what was converted after `earlier = snapshot()`."""
    blocks: int = 0
    lossy: list[LossyMatrix] = dataclasses.field(default_factory=list)

    @property
    def lossy_blocks(self) -> int:
        return sum(m.blocks for m in self.lossy)

    @property
    def exact_blocks(self) -> int:
        return self.blocks - self.lossy_blocks

    @property
    def max_abs_error(self) -> float:
        return max((m.max_abs_error for m in self.lossy), default=0.0)

    def snapshot(self) -> ConversionTally:
        return ConversionTally(self.blocks, list(self.lossy))

    def since(self, earlier: ConversionTally) -> ConversionTally:
        return ConversionTally(self.blocks - earlier.blocks, self.lossy[len(earlier.lossy):])

    def summary(self) -> str:
        """"MXFP4 → NVFP4: N of M blocks exact; K blocks (tensors) requantized, max abs error X"."""
        head = f"MXFP4 → NVFP4: {self.exact_blocks} of {self.blocks} blocks exact"
        if not self.lossy:
            return f"{head}; 0 blocks requantized"
        named = ", ".join(f"{m.tensor}: {m.blocks}" for m in self.lossy[:SUMMARY_TENSORS])
        more = len(self.lossy) - SUMMARY_TENSORS
        named += f", and {more} more matrices" if more > 0 else ""
        return (f"{head}; {self.lossy_blocks} blocks ({named}) requantized, max abs error "
                f"{self.max_abs_error:.3g}")


# --- the reader ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Mxfp4Config:
    """A checked MXFP4 quantization config (module docstring)."""
    source: str
    not_convert: tuple[str, ...]      # fnmatch patterns of modules kept in bf16


def read_quant_config(q: dict, where: str) -> Mxfp4Config:
    """The config.json quantization_config of quant_method "mxfp4", checked."""
    keep = q.get("modules_to_not_convert")
    if keep is None:
        keep = []
    if not isinstance(keep, list) or not all(isinstance(x, str) for x in keep):
        raise CheckpointError(f"{where}: modules_to_not_convert = {keep!r}: expected a list of "
                              f"module names or fnmatch patterns")
    return Mxfp4Config(where, tuple(keep))


class Mxfp4Checkpoint(Checkpoint):
    """A gpt-oss MXFP4 checkpoint (module docstring); format "mxfp4". Experts come as NVFP4,
    converted window by window; `conversion` tallies the conversions."""
    format = "mxfp4"
    naming = None

    def __init__(self, *args, **kwargs):
        self.conversion = ConversionTally()
        super().__init__(*args, **kwargs)

    def declared(self, modules):
        q: Mxfp4Config | None = self.quant
        if q is None:
            return None
        for pat in q.not_convert:
            if any(fnmatch.fnmatchcase(m, pat) for m in modules):
                return "float", f"{q.source} modules_to_not_convert pattern {pat!r}"
        return None

    def _fused_spec(self, idx: int, g: _Group) -> _Layer:
        comps = {p: g.fused.get(p) or {} for p in FUSED_PROJS}
        if not any("blocks" in c or "scales" in c for c in comps.values()):
            return super()._fused_spec(idx, g)
        roles = []
        for p in FUSED_PROJS:
            c = comps[p]
            for leaf in ("blocks", "scales"):
                if leaf not in c:
                    other = next(i for cc in comps.values() for i in cc.values())
                    raise CheckpointError(f"layer {idx}: tensor {g.base}.{p}_{leaf} is missing "
                                          f"(the layer has {other.describe()})")
            extra = sorted(set(c) - {"blocks", "scales", "bias"})
            if extra:
                raise CheckpointError(f"layer {idx}: {c[extra[0]].describe()} beside the MXFP4 "
                                      f"{g.base}.{p}_blocks / _scales; expected only _blocks, "
                                      f"_scales and _bias")
            b, s = c["blocks"], c["scales"]
            if b.dtype != torch.uint8 or len(b.shape) != 4 or b.shape[3] != MX_BLOCK // 2:
                raise CheckpointError(f"{b.describe()}: expected uint8 [E, N, K/{MX_BLOCK}, "
                                      f"{MX_BLOCK // 2}] (16 bytes: the {MX_BLOCK} E2M1 codes of "
                                      f"a block)")
            if s.dtype != torch.uint8 or tuple(s.shape) != tuple(b.shape[:3]):
                raise CheckpointError(f"{s.describe()}: expected uint8 E8M0 scales "
                                      f"{list(b.shape[:3])}, one per {MX_BLOCK}-element block of "
                                      f"{b.name}")
            dec = self.declared([f"{g.base}.{p}", g.base])
            if dec is not None:
                raise CheckpointError(f"{g.base}.{p}: {dec[1]} keeps it in bf16, but its tensors "
                                      f"are MXFP4 ({b.describe()})")
            r = {"blocks": b, "scales": s}
            if "bias" in c:
                r["b"] = c["bias"]
            roles.append(r)
        r0, r1 = roles
        gu, dn = r0["blocks"], r1["blocks"]
        n_exp = gu.shape[0]
        _, cfg_e = config_value(self.config, EXPERT_KEYS)
        if dn.shape[0] != n_exp or (cfg_e is not None and int(cfg_e) != n_exp):
            raise CheckpointError(f"layer {idx}: {gu.describe()} and {dn.describe()} hold "
                                  f"{n_exp} and {dn.shape[0]} experts; config.json gives {cfg_e}")
        (n0, k0), (n1, k1) = ((t.shape[1], t.shape[2] * MX_BLOCK) for t in (gu, dn))
        if n0 % 2 or (n0 // 2, k0) != (k1, n1):
            raise CheckpointError(f"layer {idx}: {gu.describe()} holds [E, {n0}, {k0}] weights and "
                                  f"{dn.describe()} [E, {n1}, {k1}]; expected [E, 2I, H] and "
                                  f"[E, H, I] (blocks [E, 2I, H/32, 16] and [E, H, I/32, 16])")
        h_, i_ = k0, k1
        return _Layer(idx, g, ExpertKind.NVFP4, None, n_exp, h_, i_, fused=(r0, r1),
                      bias=self._fused_biases(idx, g, r0, r1, n_exp, h_, i_),
                      interleaved=self._interleaved(), source="mxfp4")

    def _read_fused(self, spec: _Layer, start: int, stop: int):
        if spec.source != "mxfp4":
            return super()._read_fused(spec, start, stop)
        out = []
        for j, r in enumerate(spec.fused):
            bname, sname = r["blocks"].name, r["scales"].name
            blocks = self.index.read(bname, start, stop)
            scales = self.index.read(sname, start, stop)
            check_scales(scales, sname, start)
            if j == 0:
                labels = gate_up_rows(spec.interleaved, spec.intermediate)
                parts = zip((f" {x}" for x in labels), split_gate_up(blocks, spec.interleaved),
                            split_gate_up(scales, spec.interleaved))
            else:
                parts = [("", blocks, scales)]
            for rows, b, s in parts:
                conv = to_nvfp4(b, s)
                self._record(conv, bname, rows, start, s.shape[1] * s.shape[2])
                check_nvfp4(conv.q, lambda i, sn=sname, rw=rows: f"{sn}[{start + i}]{rw}",
                            lambda i, bn=bname, rw=rows: f"the global scale of {bn}"
                                                         f"[{start + i}]{rw} (2^(top - 135))",
                            HINT)
                out.append(conv.q)
        return out

    def _record(self, conv: Converted, name: str, rows: str, start: int, per: int) -> None:
        t = self.conversion
        t.blocks += per * conv.lossy.shape[0]
        for i in torch.nonzero(conv.lossy).reshape(-1).tolist():
            t.lossy.append(LossyMatrix(f"{name}[{start + i}]{rows}", int(conv.lossy[i]),
                                       float(conv.max_abs_error[i])))
