"""What an expert computes between w13 and w2: the activation of gate and up.

Shape legend: I expert intermediate size. `gate` and `up` are the two halves of w13·x (+ their
biases, where the experts have them), [..., I] each; the activation maps them to the [..., I]
rows that w2 multiplies.

    kind             act(gate, up)                                          families
    ---------------  -----------------------------------------------------  ------------------------
    "silu"           SiLU(gate) · up                                        Qwen, DeepSeek, GLM,
                                                                            Mixtral, OLMoE, ...
    "swiglu_clamp"   g = min(gate, limit), u = clamp(up, -limit, limit),    gpt-oss (alpha 1.702,
                     (u + 1) · g · σ(alpha · g)                             limit 7.0 from config)
    "relu2"          ReLU(up)² (no gate: `gated` False, the row holds no     Nemotron-H
                     gate half, `cupool.layout.RowLayout(gated=False)`)

One `Activation` serves a pool: the kernels compile it in (`defines`: ACT, ACT_ALPHA, ACT_LIMIT as
exact float32 hex literals; "silu" adds none, so its builds are the kernels cupool always had;
"relu2" is ACT 2, for rows without a gate half), and `__call__` is the float reference the tests
hold them to (a non-gated activation takes gate=None). alpha and limit are the model's
(read from its experts module or config), never defaults of this module.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
import torch.nn.functional as F

KINDS = ("silu", "swiglu_clamp", "relu2")


def _f32(v: float) -> float:
    """v rounded to float32 (what the kernel and a float32 reference compute with)."""
    return float(np.float32(v))


@dataclasses.dataclass(frozen=True)
class Activation:
    """act(gate, up) of a pool's experts (see the module docstring)."""
    kind: str = "silu"
    alpha: float | None = None      # swiglu_clamp: σ(alpha · gate)
    limit: float | None = None      # swiglu_clamp: gate ≤ limit, |up| ≤ limit

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"activation kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind in ("silu", "relu2"):
            if self.alpha is not None or self.limit is not None:
                raise ValueError(f"the {self.kind!r} activation takes no alpha or limit")
            return
        for name in ("alpha", "limit"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"swiglu_clamp: {name} must be a finite number, got {v!r}")
        if self.limit <= 0:
            raise ValueError(f"swiglu_clamp: limit must be > 0, got {self.limit!r}")
        object.__setattr__(self, "alpha", _f32(self.alpha))
        object.__setattr__(self, "limit", _f32(self.limit))

    @property
    def gated(self) -> bool:
        """Whether the experts have a gate projection (w13 = [gate; up]) or only up."""
        return self.kind != "relu2"

    def __call__(self, gate: torch.Tensor | None, up: torch.Tensor) -> torch.Tensor:
        """The float reference: act(gate, up) in up's dtype (gate None for a non-gated one)."""
        if self.gated != (gate is not None):
            raise ValueError(f"{self.kind}: gate must be {'a tensor' if self.gated else 'None'}")
        if self.kind == "relu2":
            return F.relu(up).square()
        if self.kind == "silu":
            return F.silu(gate) * up
        g = gate.clamp(max=self.limit)
        u = up.clamp(min=-self.limit, max=self.limit)
        return (u + 1) * (g * torch.sigmoid(g * self.alpha))

    def defines(self) -> dict:
        """The -D macros moe_common.cuh's epilogue compiles this activation with."""
        if self.kind == "silu":
            return {}
        if self.kind == "relu2":
            return {"ACT": 2}
        return {"ACT": 1, "ACT_ALPHA": float.hex(self.alpha) + "f",
                "ACT_LIMIT": float.hex(self.limit) + "f"}

    def describe(self) -> str:
        if self.kind == "silu":
            return "SiLU(gate)·up"
        if self.kind == "relu2":
            return "ReLU(up)² (no gate)"
        return (f"clamped SwiGLU (gate ≤ {self.limit:g}, |up| ≤ {self.limit:g}, "
                f"(up + 1)·gate·σ({self.alpha:g}·gate))")


SILU = Activation()


RELU2 = Activation("relu2")


def swiglu_clamp(alpha: float, limit: float) -> Activation:
    """gpt-oss's clamped SwiGLU with the model's alpha and limit."""
    return Activation("swiglu_clamp", alpha, limit)
