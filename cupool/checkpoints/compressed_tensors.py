"""compressed-tensors `nvfp4-pack-quantized` checkpoints (llm-compressor; e.g. RedHatAI/*-NVFP4).

Shape legend: L layers · E experts · H hidden · I expert intermediate; weights [N, K] (`F.linear`).

config.json:

    "quantization_config": {
        "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized" (or
        "mixed-precision" with a format per group), "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "format": "nvfp4-pack-quantized",
            "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                        "group_size": 16, "symmetric": true, "dynamic": false},
            "input_activations": {... "dynamic": "local"} | null}},
        "ignore": ["lm_head", "re:.*mlp.gate$", "re:model[.]layers[.]3[.].*"], ...}

`ignore` entries are module names, or `re:<regex>` matched with re.match; ignored modules stay
float (their `.weight` is bf16/fp16), so a layer's experts may be float while others are NVFP4.

Tensors of a quantized Linear `{m}` (per expert `{head}{l}.{mid}.{e}.{proj}`, or dense):

    {m}.weight_packed        uint8 [N, K/2]         E2M1 codes, element 2i in the low nibble
                                                     (compressed-tensors' pack_fp4_to_uint8)
    {m}.weight_scale         float8_e4m3fn [N, K/16]
    {m}.weight_global_scale  float32 [1]            the RECIPROCAL of ModelOpt's weight_scale_2:
                                                     llm-compressor stores 448·6 / amax and
                                                     dequantizes x · (weight_scale / weight_global_scale)
    {m}.input_global_scale   float32 [1]            activation scale (not needed: ignored)

The reader returns ModelOpt's convention: global_scale = 1 / weight_global_scale, one correctly
rounded float32 division. Where that reciprocal is exact (weight_global_scale a power of two),
e2m1 · s · (1/gs) equals compressed-tensors' e2m1 · (s / gs) bit for bit (both are the exact
product scaled by a power of two, rounded once). Otherwise 1/gs carries one rounding, so the two
dequantized values can differ in the last place (≤ 1 ulp of float32, ~6e-8 relative): codes and
block scales are passed through unchanged, and a row built from them is what ModelOpt would have
built from a global scale of fl(1/gs).

FP8 dense modules of a mixed-precision checkpoint ("float-quantized" groups: float8_e4m3fn weight
with a per-tensor [1], per-channel [N, 1] or block weight_scale) are dequantized.
"""

from __future__ import annotations

import dataclasses
import re

from cupool.checkpoints.base import Checkpoint, NVFP4Naming
from cupool.checkpoints.errors import CheckpointError
from cupool.nvfp4 import BLOCK

NVFP4_FORMAT = "nvfp4-pack-quantized"
MIXED_FORMAT = "mixed-precision"
SERVED = ("cupool serves compressed-tensors nvfp4-pack-quantized experts (FP8 "
          "float-quantized dense layers may come with them)")
_REFUSED = {
    "float-quantized": "FP8 experts are not supported",
    "pack-quantized": "int4 experts are not supported",
    "int-quantized": "int8 experts are not supported",
    "naive-quantized": "int8/naive quantized experts are not supported",
    "marlin-24": "2:4 sparse int4 experts are not supported",
    "mxfp4-pack-quantized": "MXFP4 experts are not yet supported",
    "mxfp8-quantized": "MXFP8 experts are not yet supported",
}

COMPRESSED = NVFP4Naming(
    weight="weight_packed", block_scale="weight_scale", global_scale="weight_global_scale",
    reciprocal=True,
    hint="is weight_global_scale stored as ModelOpt's weight_scale_2 (amax / 2688) rather than "
         "compressed-tensors' reciprocal (2688 / amax)?")


@dataclasses.dataclass(frozen=True)
class CompressedTensorsConfig:
    """A checked compressed-tensors quantization config (module docstring)."""
    source: str
    format: str
    groups: dict                 # group name -> its format
    ignore: tuple[str, ...]
    block: tuple[int, int] | None    # an FP8 block group's block_structure


def _group_format(name: str, grp: dict, default: str | None, where: str) -> str:
    fmt = grp.get("format") or default
    w = grp.get("weights") or {}
    if fmt is None or fmt == MIXED_FORMAT:
        if w.get("type") == "float" and w.get("num_bits") == 4 and w.get("group_size") == BLOCK:
            fmt = NVFP4_FORMAT
        elif w.get("type") == "float" and w.get("num_bits") == 8:
            fmt = "float-quantized"
        else:
            raise CheckpointError(f"{where} config_groups[{name!r}]: no format and weights "
                                  f"{w!r} that say which")
    if fmt == NVFP4_FORMAT:
        bad = {k: w.get(k) for k, want in (("num_bits", 4), ("type", "float"),
                                           ("group_size", BLOCK)) if w.get(k) != want}
        if bad:
            raise CheckpointError(f"{where} config_groups[{name!r}].weights: {bad} but "
                                  f"nvfp4-pack-quantized is num_bits 4, type float, group_size "
                                  f"{BLOCK}")
    return fmt


def read_quant_config(config: dict, source: str) -> CompressedTensorsConfig:
    """config.json's compressed-tensors quantization_config, checked: CheckpointError naming the
    key and value for formats cupool does not serve (FP8 float-quantized, int4 pack-quantized,
    MXFP4, ...) or an NVFP4 group that is not 4-bit float in blocks of 16."""
    q = config.get("quantization_config") or {}
    where = f"{source} quantization_config"
    fmt = q.get("format")
    groups = q.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError(f"{where}: no config_groups (format {fmt!r})")
    if fmt in _REFUSED:
        raise CheckpointError(f"{where}: format {fmt!r}: {_REFUSED[fmt]}; {SERVED}")
    if fmt not in (NVFP4_FORMAT, MIXED_FORMAT, None):
        raise CheckpointError(f"{where}: format {fmt!r} is not one cupool reads; {SERVED}")
    formats = {name: _group_format(name, g or {}, fmt, where) for name, g in groups.items()}
    if NVFP4_FORMAT not in formats.values():
        raise CheckpointError(f"{where}: no nvfp4-pack-quantized group (groups: {formats}); "
                              f"{SERVED}")
    for name, f in formats.items():
        if f not in (NVFP4_FORMAT, "float-quantized"):
            why = _REFUSED.get(f, f"format {f!r} is not one cupool reads")
            raise CheckpointError(f"{where} config_groups[{name!r}]: {f!r}: {why}; {SERVED}")
    block = None
    for g in groups.values():
        bs = ((g or {}).get("weights") or {}).get("block_structure")
        if isinstance(bs, list) and len(bs) == 2:
            block = (int(bs[0]), int(bs[1]))
    ignore = tuple(str(x) for x in q.get("ignore") or [])
    return CompressedTensorsConfig(where, fmt or MIXED_FORMAT, formats, ignore, block)


def is_ignored(module: str, ignore) -> str | None:
    """The ignore entry that matches `module` (an exact name, or `re:` + a regex matched at the
    start, as compressed-tensors matches them), or None."""
    for entry in ignore:
        if entry.startswith("re:"):
            if re.match(entry[3:], module):
                return entry
        elif entry == module:
            return entry
    return None


class CompressedTensorsCheckpoint(Checkpoint):
    """A compressed-tensors nvfp4-pack-quantized checkpoint (module docstring); format
    "compressed-tensors-nvfp4"."""
    format = "compressed-tensors-nvfp4"
    naming = COMPRESSED

    def declared(self, modules):
        q: CompressedTensorsConfig | None = self.quant
        if q is None:
            return None
        for m in modules:
            hit = is_ignored(m, q.ignore)
            if hit is not None:
                return "float", f"{q.source} ignore entry {hit!r}"
        return None

    def fp8_block(self):
        return self.quant.block if self.quant is not None else None
