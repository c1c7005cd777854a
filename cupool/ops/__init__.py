"""Launchers: one module per kernel source of `rawkernels/`, each validating what it is given and
launching on torch's current stream.

    rawkernels/planner.cu       cupool/ops/planner.py      reference: cupool/reference/planner.py
    rawkernels/rowcopy.cu       cupool/ops/rowcopy.py      reference: a tensor copy (tests)
    rawkernels/nvfp4_quant.cu   cupool/ops/nvfp4_quant.py  reference: cupool/nvfp4.py (quantize)
    rawkernels/moe_decode.cu    cupool/ops/moe_decode.py   reference: cupool/reference/moe.py
    rawkernels/moe_align.cu +   cupool/ops/moe_gemm.py     reference: cupool/reference/moe.py
    rawkernels/moe_gemm.cu
    rawkernels/host_handoff.cu  cupool/ops/host_handoff.py reference: HostExperts called directly
    rawkernels/sample.cu        cupool/ops/sampler.py      reference: cupool/sampling.py (sample)

The MoE kernels share two compile-time conventions and one rule on what they are built for,
defined here once.
"""

import torch

from cupool.activation import Activation

# OUT_BF16 / IN_BF16 of moe_decode.cu and moe_gemm.cu: the activations' dtype.
ACT_DTYPES = {torch.bfloat16: 1, torch.float16: 0}
# W_DTYPE of moe_lanes.cuh (moe_decode.cu, moe_align.cu): the router weights' dtype.
W_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def check_experts(layout, activation) -> None:
    """The row layout (`cupool.layout.RowLayout`) and the activation must describe the same experts:
    a gated layout (w13 = [gate; up] strip pairs) takes SiLU(gate)·up or the clamped SwiGLU, a
    layout without a gate (`RowLayout(gated=False)`) takes ReLU(up)² alone. moe_decode.cu and
    moe_gemm.cu have no build for any other pairing (moe_common.cuh's static_asserts)."""
    if not isinstance(activation, Activation):
        raise TypeError(f"activation must be a cupool.activation.Activation, got "
                        f"{type(activation).__name__}")
    if activation.gated != layout.gated:
        want = "SiLU or the clamped SwiGLU" if layout.gated else "ReLU(up)² (cupool.activation.RELU2)"
        raise ValueError(f"activation {activation.kind!r} ({activation.describe()}) is for experts "
                         f"{'with' if activation.gated else 'without'} a gate, but the row layout "
                         f"has gated={layout.gated} (H={layout.hidden}, I={layout.intermediate}); "
                         f"its experts take {want}")
