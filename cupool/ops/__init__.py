"""Launchers: one module per kernel source of `rawkernels/`, each validating what it is given and
launching on torch's current stream.

    rawkernels/planner.cu       cupool/ops/planner.py      reference: cupool/reference/planner.py
    rawkernels/rowcopy.cu       cupool/ops/rowcopy.py      reference: a tensor copy (tests)
    rawkernels/nvfp4_quant.cu   cupool/ops/nvfp4_quant.py  reference: cupool/nvfp4.py (quantize)
    rawkernels/moe_decode.cu    cupool/ops/moe_decode.py   reference: cupool/reference/moe.py
    rawkernels/moe_align.cu +   cupool/ops/moe_gemm.py     reference: cupool/reference/moe.py
    rawkernels/moe_gemm.cu

The MoE kernels share two compile-time conventions, defined here once.
"""

import torch

# OUT_BF16 / IN_BF16 of moe_decode.cu and moe_gemm.cu: the activations' dtype.
ACT_DTYPES = {torch.bfloat16: 1, torch.float16: 0}
# W_DTYPE of moe_lanes.cuh (moe_decode.cu, moe_align.cu): the router weights' dtype.
W_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
