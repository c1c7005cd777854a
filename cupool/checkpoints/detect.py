"""Which reader a checkpoint directory needs: `open_checkpoint`, and `read_experts` on top of it.

Shape legend: L layers · E experts · H hidden · I expert intermediate.

Detection, from the config files first and the tensors second:
- hf_quant_config.json, or config.json quantization_config.quant_method "modelopt": ModelOpt
  ("modelopt-nvfp4"; quant_algo checked: FP8, int4 AWQ, MXFP4 and unknown algorithms refused);
- quant_method "compressed-tensors": "compressed-tensors-nvfp4" (format checked: FP8
  float-quantized, int4 pack-quantized, MXFP4 refused);
- quant_method "fp8" (DeepSeek-V3/R1, Kimi-K2, Qwen's -FP8): "float" when the experts are float,
  "fp8" when they are block-scaled FP8 (`cupool.checkpoints.fp8`: read dequantized, converted to
  NVFP4 at load, the error of each matrix tallied);
- quant_method "mxfp4" (gpt-oss `*_blocks` / `*_scales` experts): "mxfp4", converted to NVFP4
  as they are read (`cupool.checkpoints.mxfp4`);
- quant_method awq / gptq (int4: qweight/qzeros/scales), bitsandbytes, and any other: refused,
  naming the file and value;
- no quantization config: ModelOpt, compressed-tensors or MXFP4 when the tensors are theirs
  (`*weight_scale_2`, `*weight_packed` + `*weight_global_scale`, `*_proj_blocks`), else "float".
The chosen reader then checks every routed-expert tensor's dtype and shape from the headers, so
an int4 expert (or an FP8 one without its scale) is refused whatever the config says, and MXFP4
experts are read only by the MXFP4 reader.
"""

from __future__ import annotations

from pathlib import Path

from cupool.checkpoints.base import Checkpoint
from cupool.checkpoints.compressed_tensors import CompressedTensorsCheckpoint
from cupool.checkpoints.compressed_tensors import read_quant_config as read_ct_config
from cupool.checkpoints.errors import CheckpointError, load_json
from cupool.checkpoints.float import FloatCheckpoint
from cupool.checkpoints.index import TensorIndex
from cupool.checkpoints.modelopt import HF_QUANT_CONFIG, ModelOptCheckpoint
from cupool.checkpoints.modelopt import read_quant_config as read_modelopt_config
from cupool.checkpoints.mxfp4 import Mxfp4Checkpoint
from cupool.checkpoints.mxfp4 import read_quant_config as read_mxfp4_config
from cupool.nvfp4 import NVFP4Tensor

CONFIG = "config.json"
_INT4 = {"awq": "int4 AWQ", "awq_marlin": "int4 AWQ", "gptq": "int4 GPTQ",
         "gptq_marlin": "int4 GPTQ", "auto-round": "int4 AutoRound", "autoround": "int4 AutoRound"}
FORMATS = ("float", "fp8", "modelopt-nvfp4", "compressed-tensors-nvfp4", "mxfp4")
MXFP4_NAMES = ("gate_up_proj_blocks", "down_proj_blocks")


def declared_format(directory: Path, config: dict):
    """(reader class or None, quantization config) from the config files; CheckpointError naming
    the file and value for a quantization cupool does not serve."""
    where = f"{directory / CONFIG} quantization_config"
    q = config.get("quantization_config")
    if (directory / HF_QUANT_CONFIG).is_file():
        other = q.get("quant_method") if isinstance(q, dict) else None
        if other is not None and str(other).lower() not in ("modelopt", "modelopt_fp4"):
            raise CheckpointError(f"{directory / HF_QUANT_CONFIG} is ModelOpt's, but {where} has "
                                  f"quant_method {other!r}")
        return ModelOptCheckpoint, read_modelopt_config(directory, config)
    if q is None:
        return None, None
    if not isinstance(q, dict):
        raise CheckpointError(f"{where}: expected an object, got {q!r}")
    method = q.get("quant_method")
    m = str(method).lower() if method is not None else None
    served = f"cupool reads {', '.join(FORMATS)} checkpoints"
    if m in ("modelopt", "modelopt_fp4"):
        return ModelOptCheckpoint, read_modelopt_config(directory, config)
    if m in ("compressed-tensors", "compressed_tensors"):
        return CompressedTensorsCheckpoint, read_ct_config(config, str(directory / CONFIG))
    if m == "fp8":
        return FloatCheckpoint, q
    if m in _INT4:
        raise CheckpointError(f"{where}: quant_method {method!r} ({_INT4[m]}, bits "
                              f"{q.get('bits')}, group_size {q.get('group_size')}): "
                              f"{_INT4[m]} experts (qweight/qzeros/scales) are not supported; "
                              f"{served}")
    if m == "mxfp4":
        return Mxfp4Checkpoint, read_mxfp4_config(q, where)
    if m is None:
        raise CheckpointError(f"{where}: no quant_method (keys: {sorted(q)}); {served}")
    raise CheckpointError(f"{where}: quant_method {method!r} is not one cupool serves; {served}")


def _sniff(index: TensorIndex):
    """The reader the tensor names point to when no config declares a quantization."""
    for name in index.names():
        if name.endswith("weight_scale_2"):
            return ModelOptCheckpoint
        if name.endswith(".weight_global_scale"):
            return CompressedTensorsCheckpoint
        if name.endswith(MXFP4_NAMES):
            return Mxfp4Checkpoint
    return FloatCheckpoint


def open_checkpoint(path, *, include_mtp: bool = False) -> Checkpoint:
    """Open a Hugging Face-style checkpoint directory (config.json; model.safetensors, or shards +
    model.safetensors.index.json; optional hf_quant_config.json) from its config files and tensor
    headers. No tensor data is read.

    Returns the format's `Checkpoint` (`.format` one of "float", "fp8", "modelopt-nvfp4",
    "compressed-tensors-nvfp4", "mxfp4"), whose `moe_layers`, `num_experts` E, `hidden` H and
    `intermediate` I are checked against config.json where it states them. MTP layers are left
    out unless include_mtp. CheckpointError (a ValueError) naming the file or tensor and the values
    for anything it cannot serve (see the module docstring); nothing stays open after one.
    """
    d = Path(path)
    if not d.exists():
        raise CheckpointError(f"{d}: no such checkpoint directory")
    if not d.is_dir():
        raise CheckpointError(f"{d}: expected a checkpoint directory (config.json + "
                              f"*.safetensors), got a file")
    if not (d / CONFIG).is_file():
        raise CheckpointError(f"{d}: no {CONFIG} (a Hugging Face checkpoint directory has one)")
    config = load_json(d / CONFIG)
    cls, quant = declared_format(d, config)
    index = TensorIndex(d)
    try:
        if cls is None:
            cls = _sniff(index)
        return cls(d, index, config, quant, include_mtp=include_mtp)
    except BaseException:
        index.close()
        raise


def read_experts(path, layer: int, *, include_mtp: bool = False, window: int | None = None
                 ) -> list[tuple[NVFP4Tensor | None, NVFP4Tensor, NVFP4Tensor]]:
    """Checkpoint layer `layer`'s experts, one (gate [I, H], up [I, H], down [H, I]) tuple of 2-D
    NVFP4Tensors (ModelOpt convention, scalar global scales; gate None for experts without a gate
    projection) per expert, whatever the format: NVFP4
    checkpoints as stored (compressed-tensors' global scale inverted), MXFP4 ones converted,
    float ones quantized with the CPU reference `cupool.nvfp4.quantize`. CPU only. Expert biases
    are not part of it (`Checkpoint.experts(...).bias` has them).

    path: a checkpoint directory or an open `Checkpoint` (left open). window: experts read at a
    time (default: the `fill_store` default for this layout).
    """
    from cupool.checkpoints.fill import default_window
    from cupool.layout import RowLayout

    own = not isinstance(path, Checkpoint)
    ck = open_checkpoint(path, include_mtp=include_mtp) if own else path
    try:
        ck._layer(layer)
        w = window or default_window(RowLayout(ck.hidden, ck.intermediate, bias=ck.has_bias,
                                               gated=ck.gated))
        out = []
        for lo in range(0, ck.num_experts, w):
            hi = min(ck.num_experts, lo + w)
            g, u, dn = ck.experts(layer, lo, hi).nvfp4()
            out.extend((None if g is None else g[i], u[i], dn[i]) for i in range(hi - lo))
        return out
    finally:
        if own:
            ck.close()
