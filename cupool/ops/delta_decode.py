"""Launcher of `rawkernels/delta_decode.cu`: a decode step of a gated delta net (Qwen3-Next's and
Qwen3.5's linear-attention layers) between its in-projection and its out-projection — the short
convolution with its state, SiLU, q/k L2 norms, the gates, the delta rule's state update and
read-out, and the gated RMSNorm — in one launch.

Shape legend (ARCHITECTURE.md): B tokens of the step (one a slot) · hk / hv key / value heads · dk
/ dv their dims · C = 2·hk·dk + hv·dv convolution channels · KC the convolution's kernel · S slots.

The reference is `cupool.reference.dense.delta_decode`.

The launch is a dependent one (`cupool.kernels.launch`): the kernel reads pos, the slot map, the
states, the convolution weights and the gates' vectors before it waits for the kernel before it
(in the fused step the in-projection GEMV), so none of those may be that kernel's output.
"""

from __future__ import annotations

import torch

from cupool import kernels

THREADS = 256                   # the kernel's block
HEAD_DIMS = (32, 64, 128)       # dk and dv the kernel is built for
KERNELS = range(2, 9)           # convolution kernels it takes


def _check(name: str, t, shape, dtype, device) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != tuple(shape) \
            or t.device != device or not t.is_contiguous():
        got = f"{t.dtype} {list(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) \
            else type(t).__name__
        raise ValueError(f"{name} must be a contiguous {dtype} {list(shape)} tensor on {device}, "
                         f"got {got}")


class DeltaDecode:
    """One gated delta net layer's decode step (see the module docstring).

    Args:
        key_heads, value_heads, key_dim, value_dim: hk, hv (a multiple of hk), dk, dv (each in
            HEAD_DIMS).
        grouped: the in-projection's output in Qwen3-Next's layout (in_proj_qkvz's rows then
            in_proj_ba's, each by key head), else Qwen3.5's (in_proj_qkv, in_proj_z, in_proj_b,
            in_proj_a one after another); `cupool.reference.dense.delta_projection` spells both.
        conv_w: the convolution's weights, bf16 [C, KC] (the module's conv1d.weight [C, 1, KC]
            without its middle dim; no bias).
        neg_a: −exp(A_log), float32 [hv]; dt_bias: float32 [hv].
        norm_w: the gated RMSNorm's weight, bf16 [dv]; eps its epsilon.
        tokens: B, the step's tokens (the kernel's tickets are per token and key head).
    """

    def __init__(self, key_heads: int, value_heads: int, key_dim: int, value_dim: int, *,
                 grouped: bool, conv_w: torch.Tensor, neg_a: torch.Tensor,
                 dt_bias: torch.Tensor, norm_w: torch.Tensor, eps: float, tokens: int):
        for name, v in (("key_heads", key_heads), ("value_heads", value_heads),
                        ("key_dim", key_dim), ("value_dim", value_dim), ("tokens", tokens)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if value_heads % key_heads:
            raise ValueError(f"value_heads={value_heads} must be a multiple of "
                             f"key_heads={key_heads}")
        for name, v in (("key_dim", key_dim), ("value_dim", value_dim)):
            if v not in HEAD_DIMS:
                raise ValueError(f"{name}={v} is not one the kernel is built for {HEAD_DIMS}")
        if not isinstance(grouped, bool):
            raise ValueError(f"grouped must be True or False, got {grouped!r}")
        if not isinstance(conv_w, torch.Tensor) or conv_w.dim() != 2:
            raise ValueError(f"conv_w must be a [C, KC] tensor, got "
                             f"{getattr(conv_w, 'shape', type(conv_w).__name__)}")
        dev = conv_w.device
        C = 2 * key_heads * key_dim + value_heads * value_dim
        KC = conv_w.shape[1]
        if KC not in KERNELS:
            raise ValueError(f"the convolution's kernel is {KC}; the kernel takes "
                             f"{KERNELS.start} to {KERNELS.stop - 1}")
        _check("conv_w", conv_w, (C, KC), torch.bfloat16, dev)
        _check("neg_a", neg_a, (value_heads,), torch.float32, dev)
        _check("dt_bias", dt_bias, (value_heads,), torch.float32, dev)
        _check("norm_w", norm_w, (value_dim,), torch.bfloat16, dev)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
            raise ValueError(f"eps must be a float > 0, got {eps!r}")
        self.hk, self.hv, self.dk, self.dv = key_heads, value_heads, key_dim, value_dim
        self.grouped, self.channels, self.conv_kernel = grouped, C, KC
        self.conv_w, self.neg_a, self.dt_bias, self.norm_w = conv_w, neg_a, dt_bias, norm_w
        self.eps, self.tokens, self.device = float(eps), tokens, dev
        # 2·hk·dk + 2·hv·dv + 2·hv: q, k, v, z, b, a
        self.width = C + value_heads * value_dim + 2 * value_heads
        # the convolution windows' tickets, zero at rest (the kernel puts them back)
        self.count = torch.zeros(tokens, key_heads, dtype=torch.int32, device=dev)
        self.kernel = kernels.function(
            "delta_decode", "delta_decode",
            {"DK": key_dim, "DV": value_dim, "KC": KC, "GROUPED": int(grouped)}, dev.index)

    def __call__(self, proj: torch.Tensor, pos: torch.Tensor, conv_state: torch.Tensor,
                 state: torch.Tensor, out: torch.Tensor,
                 slots: torch.Tensor | None = None) -> None:
        """proj bf16 [B, width] (the in-projection's output); pos int64 [B] (-1: token b is
        inactive, its out row zeros and its slot's states untouched); conv_state bf16 [S, C, KC]
        and state float32 [S, hv, dk, dv], updated in place at each active token's slot; slots:
        int64 [B], token b's slot, distinct values in [0, S) (not checked on the device), or None
        for slot b (S = B); out bf16 [B, hv·dv]. One launch."""
        B, dev = self.tokens, self.device
        _check("proj", proj, (B, self.width), torch.bfloat16, dev)
        _check("pos", pos, (B,), torch.int64, dev)
        if not isinstance(conv_state, torch.Tensor) or conv_state.dim() != 3:
            raise ValueError(f"conv_state must be [S, C, KC], got "
                             f"{getattr(conv_state, 'shape', type(conv_state).__name__)}")
        S = conv_state.shape[0]
        if slots is None and S != B:
            raise ValueError(f"conv_state has {S} slots for a step of {B} tokens: pass slots, "
                             f"each token's slot")
        _check("conv_state", conv_state, (S, self.channels, self.conv_kernel), torch.bfloat16,
               dev)
        _check("state", state, (S, self.hv, self.dk, self.dv), torch.float32, dev)
        if slots is not None:
            _check("slots", slots, (B,), torch.int64, dev)
        _check("out", out, (B, self.hv * self.dv), torch.bfloat16, dev)
        kernels.launch(self.kernel, (self.hv, B), THREADS, (
            proj, kernels.i32(self.width), kernels.i32(self.hk), pos,
            kernels.NULL if slots is None else slots, conv_state, self.conv_w, state,
            self.neg_a, self.dt_bias, self.norm_w, kernels.f32(self.eps), self.count, out),
            device=dev, dependent=True)
