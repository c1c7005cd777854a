"""Float checkpoints: bf16 / fp16 / fp32 experts, as the model authors publish them.

Shape legend: L layers · E experts · H hidden · I expert intermediate; weights [N, K] (`F.linear`).

Expert names (the checkpoint's own layer indices l and expert indices e):

    model.layers.{l}.mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight   [I, H], [I, H], [H, I]
        Qwen2-MoE / Qwen3-MoE, OLMoE, DeepSeek-V2/V3, GLM-4-MoE (with dense layers before
        first_k_dense_replace and `mlp.shared_experts.*` / Qwen2's `mlp.shared_expert.*`, dense)
    model.layers.{l}.block_sparse_moe.experts.{e}.{w1,w3,w2}.weight          Mixtral (w1 gate, w3 up)
    backbone.layers.{l}.mixer.experts.{e}.{up_proj,down_proj}.weight         Nemotron-H: no gate
        (`Experts.gate` None; MoE layers from hybrid_override_pattern / layers_block_type)
    model.layers.{l}.mlp.experts.gate_up_proj   [E, 2I, H], gate rows first   transformers >= 5
    model.layers.{l}.mlp.experts.down_proj      [E, H, I]                     (fused, F.linear)
    ...feed_forward.experts.gate_up_proj [E, H, 2I] / down_proj [E, I, H]     Llama-4 (x @ W)
    model.layers.{l}.mlp.experts.gate_up_proj [E, H, 2I], gate/up interleaved  gpt-oss in bf16
        along 2I (column 2i gate i, 2i + 1 up i), gate_up_proj_bias [E, 2I]    (e.g. unsloth/
        interleaved alike, down_proj [E, I, H], down_proj_bias [E, H]          gpt-oss-20b-BF16)

Interleaving is decided by config.json's model_type ("gpt_oss": interleaved, every other type:
gate first), never by the values: `cupool.checkpoints.base` states the rule. Biases come back as
float32 in `Experts.bias`.

`Checkpoint.experts` returns them as stored (gate, up [n, I, H]; down [n, H, I]); `fill_store` and
`read_experts` quantize them with `cupool.nvfp4.quantize` (or the bit-identical GPU kernel).

A config.json quantization_config with quant_method "fp8" (DeepSeek-V3's native FP8: float8_e4m3fn
weights with 128×128 float32 `weight_scale_inv` blocks, config "weight_block_size": [128, 128])
opens as this format when its experts are float; FP8 dense weights are dequantized by
`dense_tensor`. Block-scaled FP8 experts (DeepSeek-V3, Kimi-K2, Qwen's -FP8) open as format "fp8":
read dequantized to float32, quantized to NVFP4 like float experts, the error of each matrix
tallied (`cupool.checkpoints.fp8`).
"""

from __future__ import annotations

from cupool.checkpoints.base import Checkpoint


class FloatCheckpoint(Checkpoint):
    """A checkpoint whose routed experts are float (module docstring); format "float"."""
    format = "float"
    naming = None
    reads_fp8_experts = True       # format "fp8" then (`cupool.checkpoints.fp8`)

    def fp8_block(self):
        q = self.quant or {}
        bs = q.get("weight_block_size") if isinstance(q, dict) else None
        if isinstance(bs, list) and len(bs) == 2:
            return int(bs[0]), int(bs[1])
        return None
