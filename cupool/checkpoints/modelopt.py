"""NVIDIA ModelOpt NVFP4 exports (`hf_quant_config.json` / quant_method "modelopt").

Shape legend: L layers · E experts · H hidden · I expert intermediate; weights [N, K] (`F.linear`).

The quantization config, in any of these forms (hf_quant_config.json is read first; when
config.json says something too, the quant_algo must agree):

    hf_quant_config.json   {"producer": {"name": "modelopt", ...},
                            "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                                             "kv_cache_quant_algo": "FP8" | null,
                                             "exclude_modules": ["lm_head", "*.mlp.gate", ...]}}
                      or   {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": [...]}  (flat)
    config.json            "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4",
                                                   "group_size": 16, "ignore" | "exclude_modules": [...]}
    MIXED_PRECISION        "quant_algo": "MIXED_PRECISION", "quantized_layers": {module or pattern:
                            {"quant_algo": "NVFP4", "group_size": 16} | {"quant_algo": "FP8"}, ...}

quant_algo NVFP4 and W4A16_NVFP4 store weights alike (they differ in the activations, which cupool
keeps in bf16/fp16); MIXED_PRECISION is read per module. exclude_modules/ignore are fnmatch
patterns of modules kept in float; a quantized_layers key is matched as the module name, an
fnmatch pattern, or a dotted part of the name (`experts.gate_proj` matches
`model.layers.3.mlp.experts.gate_proj`...). A module the config declares one way whose tensors
are another is refused.

Tensors of an NVFP4 Linear `{m}` (a routed expert `{head}{l}.{mid}.{e}.{proj}` or
`{head}{l}.{mid}.{proj}.{e}`, or a dense one):

    {m}.weight          uint8 [N, K/2]      two E2M1 codes a byte, element 2i in the low nibble
    {m}.weight_scale    float8_e4m3fn [N, K/16]
    {m}.weight_scale_2  float32 [] or [1]   global scale: value = e2m1 · weight_scale · weight_scale_2
    {m}.input_scale     float32 []          activation scale (not needed: ignored)

Fused expert exports keep one tensor per layer (`{mid}` = e.g. "mlp.experts"):

    {mid}.gate_up_proj                uint8 [E, 2I, H/2]   codes packed along the last dim = K
    {mid}.gate_up_proj_weight_scale   float8_e4m3fn [E, 2I, H/16]
    {mid}.gate_up_proj_weight_scale_2 float32 [E] (per expert), [E, 2] (per expert, gate and up),
                                      or [] / [1] (one for all)
    {mid}.down_proj (+ _weight_scale, _weight_scale_2)   [E, H, I/2], [E, H, I/16], likewise
    or, transposed as Llama-4's experts hold them (`x @ W`): gate_up_proj uint8 [E, H/2, 2I] with
    weight_scale [E, H/16, 2I] and down_proj [E, I/2, H] with [E, I/16, H]: the codes are packed
    along dim 1, which is K, two consecutive K elements a byte; the reader tells the two apart by
    the scale's shape and transposes the bytes, which gives the [E, N, K/2] packing above exactly.

An MTP head (`mtp.*`, or layers at or beyond num_hidden_layers) is ignored unless include_mtp.
Dense layers may be NVFP4 (dequantized) or FP8 (float8_e4m3fn weight with a per-tensor or
per-channel weight_scale, or DeepSeek-style 128×128 weight_scale_inv blocks; dequantized).
A checkpoint with no quantization config at all but ModelOpt's tensors is recognised from them.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from pathlib import Path

from cupool.checkpoints.base import Checkpoint, NVFP4Naming
from cupool.checkpoints.errors import CheckpointError, load_json
from cupool.nvfp4 import BLOCK

HF_QUANT_CONFIG = "hf_quant_config.json"
NVFP4_ALGOS = ("NVFP4", "W4A16_NVFP4")
MIXED = "MIXED_PRECISION"
SERVED = ("cupool serves ModelOpt quant_algo NVFP4 / W4A16_NVFP4 / MIXED_PRECISION with NVFP4 "
          "experts, or float experts it quantizes itself")

MODELOPT = NVFP4Naming(
    weight="weight", block_scale="weight_scale", global_scale="weight_scale_2", reciprocal=False,
    hint="is weight_scale_2 stored as its reciprocal (1/scale, compressed-tensors' "
         "weight_global_scale convention)? ModelOpt's weight_scale_2 is amax / (6 · 448)")


@dataclasses.dataclass(frozen=True)
class ModelOptConfig:
    """A checked ModelOpt quantization config (module docstring)."""
    source: str                       # file (and key) it came from
    quant_algo: str                   # upper case
    group_size: int
    exclude: tuple[str, ...]          # fnmatch patterns of float modules
    quantized_layers: dict            # MIXED_PRECISION: key -> {"quant_algo": ...}
    kv_cache_quant_algo: str | None


def _refuse_algo(algo: str, where: str) -> None:
    a = algo.upper()
    if a in NVFP4_ALGOS or a == MIXED:
        return
    if a.startswith("FP8"):
        what = f"quant_algo {algo!r} quantizes the experts to FP8, which cupool does not serve"
    elif "AWQ" in a or a.startswith(("INT4", "W4A")):
        what = (f"quant_algo {algo!r}: int4 AWQ-style experts (or NVFP4 with AWQ pre_quant_scale) "
                f"are not supported")
    elif "MXFP" in a:
        what = f"quant_algo {algo!r}: MXFP4/MXFP8 experts are not yet supported"
    elif a.startswith(("INT8", "W8A")):
        what = f"quant_algo {algo!r}: int8 experts are not supported"
    else:
        what = f"quant_algo {algo!r} is not a ModelOpt algorithm cupool knows"
    raise CheckpointError(f"{where}: {what}; {SERVED}")


def _group_size(gs, where: str) -> int:
    if gs is None:
        return BLOCK                   # NVFP4 fixes it; older exports leave it out
    if gs != BLOCK:
        raise CheckpointError(f"{where}: group_size is {gs!r}; NVFP4 block scales cover {BLOCK} "
                              f"elements")
    return BLOCK


def _from_dict(q: dict, where: str) -> ModelOptConfig:
    algo = q.get("quant_algo")
    if algo is None:
        raise CheckpointError(f"{where}: no quant_algo (keys: {sorted(q)}); expected one of "
                              f"{[*NVFP4_ALGOS, MIXED]}")
    _refuse_algo(str(algo), where)
    gs = q.get("group_size")
    if gs is None:
        gs = (q.get("weights") or {}).get("group_size")
    if gs is None:
        for grp in (q.get("config_groups") or {}).values():
            gs = ((grp or {}).get("weights") or {}).get("group_size", gs)
    layers = q.get("quantized_layers") or {}
    if str(algo).upper() == MIXED:
        if not isinstance(layers, dict) or not layers:
            raise CheckpointError(f"{where}: quant_algo MIXED_PRECISION without a "
                                  f"'quantized_layers' object")
        for key, v in layers.items():
            if not isinstance(v, dict) or "quant_algo" not in v:
                raise CheckpointError(f"{where}: quantized_layers[{key!r}] = {v!r}: expected "
                                      f"{{'quant_algo': ...}}")
            if str(v["quant_algo"]).upper() in NVFP4_ALGOS:
                _group_size(v.get("group_size"), f"{where} quantized_layers[{key!r}]")
    exclude = q.get("exclude_modules")
    if exclude is None:
        exclude = q.get("ignore") or []
    return ModelOptConfig(where, str(algo).upper(), _group_size(gs, where),
                          tuple(str(x) for x in exclude), dict(layers),
                          q.get("kv_cache_quant_algo"))


def read_quant_config(directory, config: dict | None = None) -> ModelOptConfig | None:
    """The ModelOpt quantization config of a checkpoint directory, checked; None when neither
    hf_quant_config.json nor config.json (`config`, read from the directory when None) declares
    a ModelOpt quantization. CheckpointError naming the file and value for an algorithm cupool
    does not serve, a group size other than 16, or two files that disagree."""
    d = Path(directory)
    if config is None:
        cj = d / "config.json"
        config = load_json(cj) if cj.is_file() else {}
    cq = config.get("quantization_config")
    from_cfg = None
    if isinstance(cq, dict) and str(cq.get("quant_method", "")).lower() in (
            "modelopt", "modelopt_fp4"):
        from_cfg = _from_dict(cq, f"{d / 'config.json'} quantization_config")
    hq = d / HF_QUANT_CONFIG
    if not hq.is_file():
        return from_cfg
    data = load_json(hq)
    q = data.get("quantization")
    if q is None and "quant_algo" in data:
        q = data                                  # the flat form
    if not isinstance(q, dict):
        raise CheckpointError(f"{hq}: no 'quantization' object and no top-level quant_algo "
                              f"(keys: {sorted(data)})")
    cfg = _from_dict(q, str(hq))
    if from_cfg is not None and from_cfg.quant_algo != cfg.quant_algo:
        raise CheckpointError(f"{hq} says quant_algo {cfg.quant_algo!r} but {from_cfg.source} "
                              f"says {from_cfg.quant_algo!r}")
    return cfg


def _matches(module: str, key: str) -> bool:
    """A quantized_layers key names `module`: the module itself, an fnmatch pattern of it, or a
    dotted part of its name."""
    return any(fnmatch.fnmatchcase(module, p) for p in (key, f"*.{key}", f"{key}.*", f"*.{key}.*"))


class ModelOptCheckpoint(Checkpoint):
    """A ModelOpt NVFP4 export (module docstring); format "modelopt-nvfp4"."""
    format = "modelopt-nvfp4"
    naming = MODELOPT

    def declared(self, modules):
        q: ModelOptConfig | None = self.quant
        if q is None:
            return None
        if q.quant_algo == MIXED:
            for key, v in q.quantized_layers.items():
                if any(_matches(m, key) for m in modules):
                    algo = str(v["quant_algo"]).upper()
                    kind = "nvfp4" if algo in NVFP4_ALGOS else algo
                    return kind, f"{q.source} quantized_layers[{key!r}] ({v['quant_algo']!r})"
            return None
        for pat in q.exclude:
            if any(fnmatch.fnmatchcase(m, pat) for m in modules):
                return "float", f"{q.source} exclude pattern {pat!r}"
        return None
