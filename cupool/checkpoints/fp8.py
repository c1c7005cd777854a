"""Block-scaled FP8 experts (DeepSeek-V3/R1, Kimi-K2, Qwen's `-FP8` releases, Qwen3.8-Flash-Next's
own): the format, and the tally of their conversion to NVFP4 at load.

Shape legend: L layers · E experts · H hidden · I expert intermediate; weights [N, K] (`F.linear`,
K the reduction dim); bn × bk a scale block.

config.json (the three publishers write the same form):

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128],
                            "modules_to_not_convert": [...]}        (Qwen; optional)

Tensors of one expert's projection (per expert, `{mid}.{e}.{gate_proj,up_proj,down_proj}`, or
Mixtral's w1/w3/w2; Kimi-K2 and DeepSeek under `mlp.experts`, Qwen under
`model.language_model.layers.{l}.mlp.experts`):

    .weight            float8_e4m3fn [N, K]
    .weight_scale_inv  [ceil(N/bn), ceil(K/bk)], float32 (DeepSeek, Kimi) or bf16 (Qwen3.5 and
                       later): one scale per bn × bk block (weight_block_size, else 128 × 128;
                       the last blocks of a row or column may be partial)
    or .weight_scale   [N] / [N, 1]: one scale per output row (per-channel FP8), or [] / [1]
                       one for the matrix (per-tensor FP8 in a checkpoint without a
                       quantization config)

Dequantized value = float(w) · scale of its block, in float32 (`Checkpoint.dense_tensor` reads
FP8 dense weights by the same rule). Experts are read a window at a time, dequantized to float32
(the reader returns them as float experts), and quantized to NVFP4 like any float expert
(`cupool.nvfp4.quantize`, or the bit-identical GPU kernel), one global scale per matrix. An FP8
block's values have 4 significant bits and NVFP4's 2 (with a finer scale block, 16 along K), so the
conversion is never exact: every converted matrix's error against its dequantized FP8 values is
measured when it is quantized — the relative error ‖NVFP4 − FP8‖ / ‖FP8‖ (Frobenius) and the
largest absolute error — and `Fp8Tally` (the checkpoint's `conversion`) keeps the count, the
mean and largest relative error and the largest absolute error with the matrices they come
from; `fill_store` logs its summary line. NVFP4 of trained weights lands near 0.1 relative error
(Gaussian-like rows); a matrix above WARN_RELATIVE_ERROR = 0.15 is listed as an outlier and makes
the line a WARNING.

Fused 3-D FP8 stacks are refused (no published MoE checkpoint uses them), and so are experts that a
ModelOpt hf_quant_config.json declares FP8 (`cupool.checkpoints.modelopt` names it).
"""

from __future__ import annotations

import dataclasses

import torch

from cupool import nvfp4

WARN_RELATIVE_ERROR = 0.15
SUMMARY_TENSORS = 4                      # outlier matrices named in a summary line


@dataclasses.dataclass(frozen=True)
class MatrixError:
    """One converted matrix's error against its dequantized FP8 values."""
    tensor: str                          # e.g. "model.layers.3.mlp.experts.7.down_proj.weight"
    relative: float                      # ‖NVFP4 − FP8‖ / ‖FP8‖ (Frobenius); 0 for a zero matrix
    max_abs: float                       # largest |NVFP4 − FP8|


def matrix_errors(q: nvfp4.NVFP4Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(relative [M], max_abs [M]) float64 errors of NVFP4 matrices q [M, N, K] against the float
    values w [M, N, K] they were quantized from (any device; returned on the CPU)."""
    deq = nvfp4.dequantize(q, torch.float32)
    wf = w.float()
    diff = (deq - wf).flatten(1)
    ref = wf.flatten(1).double().norm(dim=1)
    err = diff.double().norm(dim=1)
    rel = torch.where(ref > 0, err / ref.clamp(min=1e-300), torch.zeros_like(err))
    return rel.cpu(), diff.abs().amax(dim=1).double().cpu()


@dataclasses.dataclass
class Fp8Tally:
    """A running account of FP8 matrices converted to NVFP4 (module docstring). Same interface as
    the MXFP4 tally: `snapshot`, `since`, `lossy` (the outliers) and `summary`."""
    matrices: int = 0
    relative_sum: float = 0.0
    worst: MatrixError | None = None      # largest relative error
    worst_abs: MatrixError | None = None  # largest absolute error
    lossy: list[MatrixError] = dataclasses.field(default_factory=list)   # above the threshold

    def record(self, names: list[str], relative: torch.Tensor, max_abs: torch.Tensor) -> None:
        for name, r, a in zip(names, relative.tolist(), max_abs.tolist()):
            m = MatrixError(name, r, a)
            self.matrices += 1
            self.relative_sum += r
            if self.worst is None or r > self.worst.relative:
                self.worst = m
            if self.worst_abs is None or a > self.worst_abs.max_abs:
                self.worst_abs = m
            if r > WARN_RELATIVE_ERROR:
                self.lossy.append(m)

    @property
    def mean_relative(self) -> float:
        return self.relative_sum / self.matrices if self.matrices else 0.0

    def snapshot(self) -> Fp8Tally:
        return dataclasses.replace(self, lossy=list(self.lossy))

    def since(self, earlier: Fp8Tally) -> Fp8Tally:
        """What was converted after `earlier` (the worst matrices of the whole run: a window's
        own worst is not kept apart)."""
        return Fp8Tally(self.matrices - earlier.matrices, self.relative_sum - earlier.relative_sum,
                        self.worst, self.worst_abs, self.lossy[len(earlier.lossy):])

    def summary(self) -> str:
        """"FP8 → NVFP4: N matrices requantized; relative error mean R, max R' (tensor); max abs
        error A (tensor)[; K above 0.15: ...]"."""
        if not self.matrices:
            return "FP8 → NVFP4: 0 matrices requantized"
        w, a = self.worst, self.worst_abs
        line = (f"FP8 → NVFP4: {self.matrices} matrices requantized; relative error (Frobenius) "
                f"mean {self.mean_relative:.4f}, max {w.relative:.4f} ({w.tensor}); max abs "
                f"error {a.max_abs:.4g} ({a.tensor})")
        if self.lossy:
            named = ", ".join(f"{m.tensor}: {m.relative:.3f}" for m in self.lossy[:SUMMARY_TENSORS])
            more = len(self.lossy) - SUMMARY_TENSORS
            named += f", and {more} more" if more > 0 else ""
            line += f"; {len(self.lossy)} above {WARN_RELATIVE_ERROR}: {named}"
        return line
