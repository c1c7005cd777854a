"""NVFP4 (NVIDIA ModelOpt's 4-bit format): values, packing, quantize / dequantize reference.

(Work in progress: the reference quantizer lands with the NVFP4 issue.)
"""

from __future__ import annotations

import dataclasses

import torch

# E2M1 magnitudes by 3-bit code (e1 e0 m); code | 8 is the negative value.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
BLOCK = 16


@dataclasses.dataclass
class NVFP4Tensor:
    """A weight [..., N, K] in NVFP4.

    packed:       uint8 [..., N, K/2], element 2i in the low nibble of byte i.
    block_scale:  float8_e4m3fn [..., N, K/16], one per 16 consecutive elements along K.
    global_scale: float32 [...], one per matrix (ModelOpt's weight_scale_2).
    Dequantized value = E2M1(code) · block_scale · global_scale.
    """
    packed: torch.Tensor
    block_scale: torch.Tensor
    global_scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape [..., N, K] of the unpacked matrix."""
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 2)
