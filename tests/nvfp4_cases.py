"""Weights that stress NVFP4 quantization, shared by the CPU, host-harness and GPU tests.

Every generator takes a shape [..., N, K], a dtype and a numpy Generator and returns a CPU tensor
with only finite values. `ties` lands values exactly on E2M1 rounding midpoints, which random
data almost never does.
"""

from __future__ import annotations

import numpy as np
import torch

KINDS = ("randn", "heavy", "zero_blocks", "ties", "spread", "tiny")
SHAPES = ((1, 16), (3, 48), (17, 144), (5, 33, 80), (2, 3, 16, 32))
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FMAX = {torch.float32: 3e38, torch.bfloat16: 3e38, torch.float16: 6e4}


def _finite(a: np.ndarray, dtype) -> torch.Tensor:
    t = torch.from_numpy(np.clip(a, -_FMAX[dtype], _FMAX[dtype]).astype(np.float32)).to(dtype)
    assert torch.isfinite(t).all()
    return t


def make_weight(kind: str, shape, dtype, rng: np.random.Generator) -> torch.Tensor:
    shape = tuple(shape)
    *lead, n, k = shape
    if kind == "randn":
        # one magnitude per matrix, so global scales span a wide range too
        scale = 10.0 ** rng.uniform(-3, 3, size=(*lead, 1, 1))
        return _finite(rng.standard_normal(shape) * scale, dtype)
    if kind == "heavy":
        # Student t with 1.5 degrees of freedom: a few huge values set amax, most blocks are small
        return _finite(rng.standard_t(1.5, size=shape) * 0.02, dtype)
    if kind == "zero_blocks":
        a = rng.standard_normal(shape)
        blocks = a.reshape(*lead, n, k // 16, 16)
        blocks[rng.random(blocks.shape[:-1]) < 0.25] = 0.0          # ~1/4 of the blocks
        a.reshape(-1, n, k)[:, rng.integers(n)] = 0.0               # one whole row per matrix
        if lead:
            a.reshape(-1, n, k)[rng.integers(int(np.prod(lead)))] = 0.0    # one whole matrix
        return _finite(a, dtype)
    if kind == "ties":
        return _ties(shape, dtype, rng)
    if kind == "spread":
        # block magnitudes over 2^-30..2^0: many block scales are E4M3 subnormals or round to 0
        scale = 2.0 ** rng.uniform(-30, 0, size=(*lead, n, k // 16, 1))
        a = rng.standard_normal((*lead, n, k // 16, 16)) * scale
        return _finite(a.reshape(shape), dtype)
    if kind == "tiny":
        # near the bottom of the dtype: subnormal inputs, subnormal (or zero) global scales
        low = {torch.float32: 1e-38, torch.bfloat16: 1e-38, torch.float16: 1e-6}[dtype]
        return _finite(rng.standard_normal(shape) * low, dtype)
    raise ValueError(f"unknown kind {kind!r}")


# Exact midpoints and points of E2M1, as multiples of the block divisor d = s·g.
_TIE_POINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _ties(shape, dtype, rng) -> torch.Tensor:
    """Values t·s·g with g = 2^j and block scales s = 2^i, so every quotient w / (s·g) is exactly t.

    Per matrix, amax = 2688·g makes g = amax / 2688 exact; in each block one element is 6·s·g, so
    the block's scale (6·s·g / 6) / g = s is exact too. All values have at most 6 significant
    bits and stay in fp16 range, so every dtype holds them exactly.
    """
    *lead, n, k = shape
    m = int(np.prod(lead)) if lead else 1
    out = np.empty((m, n, k // 16, 16))
    for mi in range(m):
        g = 2.0 ** int(rng.integers(-8, 4))
        i = rng.integers(-9, 9, size=(n, k // 16, 1))                  # E4M3 scale 2^i, 2^-9..2^8
        t = rng.choice(_TIE_POINTS, size=(n, k // 16, 16))
        t[..., 0] = 6.0                                                 # sets the block amax
        sign = rng.choice([-1.0, 1.0], size=t.shape)
        out[mi] = sign * t * 2.0 ** i * g
        out[mi, 0, 0, 0] = 2688.0 * g                                   # sets the matrix amax
        out[mi, 0, 0, 1:] = rng.choice(_TIE_POINTS, size=15) * 448.0 * g
    a = out.reshape(shape)
    t = torch.from_numpy(a.astype(np.float32)).to(dtype)
    assert torch.equal(t.double(), torch.from_numpy(a)), "tie values must be exact in every dtype"
    return t
