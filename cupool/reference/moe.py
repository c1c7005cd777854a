"""The MoE GEMM's float reference: dequantize, then matmul (of moe_decode.cu and moe_gemm.cu).

Shape legend (ARCHITECTURE.md): T tokens · K top-k · H hidden · I intermediate · E experts.
"""

from __future__ import annotations

import torch

from cupool.activation import SILU, Activation


def reference_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  experts, dtype=torch.float32, *, activation: Activation = SILU,
                  biases=None) -> torch.Tensor:
    """Dequantize-then-matmul reference in `dtype` (float32 or float64) on x's device.

    experts: callable e -> (w_gate [I, H], w_up [I, H], w_down [H, I]) float tensors (already
    dequantized; w_gate None for non-gated experts, whose activation is act(up)), or a sequence
    of such triples. activation: act(gate, up) (`cupool.activation`,
    SiLU by default). biases: None, or like experts e -> (b_gate [I], b_up [I], b_down [H]).
    Lane (t, k) adds w[t, k] · (w_down · act(w_gate x + b_gate, w_up x + b_up) + b_down); lanes
    with id -1 contribute nothing. Returns [T, H] in `dtype`.
    """
    get = experts if callable(experts) else (lambda e: experts[e])
    get_b = (None if biases is None else biases if callable(biases)
             else (lambda e: biases[e]))
    xf = x.to(dtype)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=dtype, device=x.device)
    ids = topk_ids.to(torch.int64)
    w = topk_weights.to(dtype)
    for e in sorted(set(ids.reshape(-1).tolist()) - {-1}):
        tok, kk = (ids == e).nonzero(as_tuple=True)
        wg, wu, wd = (None if m is None else m.to(dtype=dtype, device=x.device) for m in get(e))
        h = xf[tok]
        g, u = (None if wg is None else h @ wg.T), h @ wu.T
        if get_b is not None:
            bg, bu, bd = (b.to(dtype=dtype, device=x.device) for b in get_b(e))
            g, u = g + bg, u + bu
        y = activation(g, u) @ wd.T
        if get_b is not None:
            y = y + bd
        out.index_add_(0, tok, y * w[tok, kk][:, None])
    return out
