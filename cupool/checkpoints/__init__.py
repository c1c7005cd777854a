"""Load the checkpoints users have: one reader per format behind one interface.

Shape legend: L MoE layers · E routed experts per layer · H hidden size · I expert intermediate
size; projections in `F.linear` form: gate, up [I, H], down [H, I].

    ck = open_checkpoint("Qwen3-30B-A3B-NVFP4")        # config.json + safetensors headers only
    ck.format, ck.moe_layers, ck.num_experts, ck.hidden, ck.intermediate
    ex = ck.experts(layer, 0, 8)                       # experts [0, 8) of one layer, only their bytes
    ck.dense_names(); ck.dense_tensor(name, torch.bfloat16); ck.dense_bytes(); ck.expert_sizes()
    fill_store(store, ck, RowLayout(ck.hidden, ck.intermediate, bias=ck.has_bias, gated=ck.gated))
    read_experts(path, layer)                          # [(gate, up, down) NVFP4Tensors] per expert
                                                       # (gate None: Nemotron-H, no gate)

Modules:
    errors.py              CheckpointError (a ValueError), JSON loading
    index.py               TensorIndex: name -> (file, dtype, shape, bytes) from safetensors headers;
                           windowed reads without memory maps
    base.py                Checkpoint (the interface, expert/dense discovery and reading shared by
                           every format), Experts, ExpertKind, ExpertSizes, scale checks
    float.py               bf16/fp16/fp32 experts (per expert, Mixtral, fused [E, 2I, H], Llama-4,
                           gpt-oss with biases)
    modelopt.py            ModelOpt NVFP4 (hf_quant_config.json nested/flat, config.json,
                           MIXED_PRECISION, per-expert and fused 3-D exports)
    compressed_tensors.py  compressed-tensors nvfp4-pack-quantized (reciprocal global scale)
    mxfp4.py               gpt-oss MXFP4 (*_blocks / *_scales, E8M0), converted to NVFP4 at load
    detect.py              open_checkpoint (format detection and refusals), read_experts
    fill.py                fill_store: a checkpoint's experts into a HostStore, window by window
"""

from cupool.checkpoints.base import (
    MAX_IMPLIED_WEIGHT,
    Checkpoint,
    ExpertKind,
    Experts,
    ExpertSizes,
)
from cupool.checkpoints.compressed_tensors import CompressedTensorsCheckpoint
from cupool.checkpoints.detect import FORMATS, open_checkpoint, read_experts
from cupool.checkpoints.errors import CheckpointError
from cupool.checkpoints.fill import (
    WINDOW_BYTES,
    default_window,
    expert_temp_bytes,
    fill_store,
)
from cupool.checkpoints.float import FloatCheckpoint
from cupool.checkpoints.index import TensorIndex, TensorInfo
from cupool.checkpoints.modelopt import ModelOptCheckpoint
from cupool.checkpoints.mxfp4 import ConversionTally, Mxfp4Checkpoint, mxfp4_exactness

__all__ = [
    "FORMATS", "MAX_IMPLIED_WEIGHT", "WINDOW_BYTES", "Checkpoint", "CheckpointError",
    "CompressedTensorsCheckpoint", "ConversionTally", "ExpertKind", "ExpertSizes", "Experts",
    "FloatCheckpoint", "ModelOptCheckpoint", "Mxfp4Checkpoint", "TensorIndex", "TensorInfo",
    "default_window", "expert_temp_bytes", "fill_store", "mxfp4_exactness", "open_checkpoint",
    "read_experts",
]
