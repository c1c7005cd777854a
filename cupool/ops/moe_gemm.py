"""Launcher of `rawkernels/moe_align.cu` and `rawkernels/moe_gemm.cu`: the two-launch NVFP4 MoE
GEMM (w13, then w2) behind the prefill partition path and the "pair" decode.

Shape legend (ARCHITECTURE.md): T tokens · K top-k · W = T·K lanes · E experts · H hidden ·
I intermediate; Hp, Ip are H and I rounded up to 64. A *unit* is up to NT lanes of one expert
that share every dequantized weight fragment.

moe_align.cu groups lanes into units (route_decode for decode, align_experts for prefill) and
prepares x (prep_x); moe_gemm.cu's moe_w13 writes act(gate, up) per lane (SiLU(gate)·up or
the clamped SwiGLU, biases added where the rows have them; ReLU(up)² in rows without a gate),
moe_w2 multiplies it
by w2, and the top-k sum is moe_w2's (REDUCE 0, decode) or moe_finish's (REDUCE 1, prefill:
fp32 atomics into out32, then one cast).

This module is the one Python owner of a launch config's -D macros (`defines`) and of the shared
memory moe_gemm.cu carves from them (`shared_bytes`).
"""

from __future__ import annotations

import dataclasses

import torch

from cupool import _cuda, kernels
from cupool.activation import SILU, Activation
from cupool.layout import RowLayout
from cupool.ops import ACT_DTYPES, check_experts


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """One launch config of moe_w13 / moe_w2 (each field becomes a -D macro, `defines`)."""
    nt: int          # lane slots per unit
    ksplit: int      # warps splitting K of a strip
    warps_m: int     # warps on different strips of a unit
    kc: int          # activation columns staged at a time
    nb: int          # 64-column chunks in flight per warp
    reduce: int      # 0: deterministic last-block top-k sum, 1: fp32 atomics
    prefetch_w2: int
    minb: int = 1    # blocks per SM the kernels' register use must allow
    kc2: int = 0     # w2's staged columns; 0: all of I where that fits W2_WHOLE_BYTES, else kc
    w2_ns: int = 1   # output strips of w2 per warp (1 or 2)
    ntg: int = 4     # n-tiles whose B fragments a warp holds at once (ntg·strips other mma
                     # between an accumulator's two updates)


# Largest staging of all of w2's K for one block: w2 then stages a unit's act rows once for all
# its items (two such blocks still share an SM: 2 x 100 KiB of an H100/H200 SM's 228 KiB).
W2_WHOLE_BYTES = 100 * 1024

# The pair's decode (route_decode, moe_w13, moe_w2; decode_kernel="pair", or calls of more than
# 256 lanes): one token per unit is typical, so K is split over 8 warps, the
# whole K range staged at once (one barrier pair per item) and registers capped for 3 blocks per
# SM, so that every item of a Qwen3-30B-A3B layer (8 units x 48 strip pairs) has a block from
# the start; w13 pulls w2's rows into L2 for moe_w2. Chosen by a sweep of configs on an H200
# (29.9 µs a layer against 31.7 for KSPLIT 4 / NB 8 / KC 1024).
PAIR_SMALL = GemmConfig(nt=8, ksplit=8, warps_m=1, kc=2048, nb=2, reduce=0, prefetch_w2=1, minb=3)
PAIR_WIDE = GemmConfig(nt=16, ksplit=4, warps_m=1, kc=1024, nb=8, reduce=0, prefetch_w2=1)
# Prefill: 64 lanes a unit share each dequantized fragment over 8 mma n-tiles. One chunk in
# flight a warp keeps moe_w13 at 127 registers, so 2 blocks (16 warps) share an SM (10-14%
# faster than 4 chunks at 1 block per SM on an H200). Two output strips a w2 warp (moe_w2 then at
# 128 registers, like w13 two strips a warp) and the B fragments of 4 n-tiles held at once (ntg)
# measured fastest of the alternatives (docs/PERFORMANCE.md). tests/test_nvcc_compile.py checks
# that this config compiles without spills and that its staging fits two blocks an SM.
PREFILL = GemmConfig(nt=64, ksplit=1, warps_m=8, kc=256, nb=1, reduce=1, prefetch_w2=0, minb=2,
                     w2_ns=2)

KERNELS = ("moe_w13", "moe_w2")


def w2_cols(cfg: GemmConfig, layout: RowLayout) -> int:
    """Columns of act that moe_w2 stages at a time (W2_KC)."""
    if cfg.kc2:
        return min(cfg.kc2, layout.ip)
    return layout.ip if cfg.nt * (layout.ip + 8) * 2 <= W2_WHOLE_BYTES else min(cfg.kc, layout.ip)


def defines(cfg: GemmConfig, layout: RowLayout, dtype=torch.bfloat16,
            activation: Activation = SILU) -> dict:
    """The -D macros moe_gemm.cu is compiled with for a config, layout, output dtype and expert
    activation (one the layout's experts take: `cupool.ops.check_experts`)."""
    check_experts(layout, activation)
    return {**layout.defines(), **activation.defines(), "NT": cfg.nt, "KSPLIT": cfg.ksplit, "WARPS_M": cfg.warps_m,
            "KC": min(cfg.kc, layout.hp), "W2_KC": w2_cols(cfg, layout), "NB": cfg.nb,
            "OUT_BF16": ACT_DTYPES[dtype], "REDUCE": cfg.reduce, "PREFETCH_W2": cfg.prefetch_w2,
            "MINB": cfg.minb, "W2_NS": cfg.w2_ns, "NTG": cfg.ntg}


def shared_bytes(cfg: GemmConfig, layout: RowLayout, kernel: str) -> int:
    """Dynamic shared memory of moe_w13 or moe_w2 (moe_gemm.cu's Staging, red_buffer and
    slot_info): the staging buffers (two where K takes more than one stage), the K-split
    partials (of 2 strips a w13 warp, gate and up, or 1 in rows without a gate), the per-slot
    data."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    sps = 2 if layout.gated else 1
    kp, cols, ns = ((layout.hp, min(cfg.kc, layout.hp), sps) if kernel == "moe_w13"
                    else (layout.ip, w2_cols(cfg, layout), cfg.w2_ns))
    nbuf = 2 if kp > cols else 1
    red = (cfg.ksplit - 1) * cfg.warps_m * ns * (cfg.nt // 8) * 4 * 32 * 4
    return nbuf * cfg.nt * (cols + 8) * 2 + red + cfg.nt * 8


class GemmKernels:
    """moe_align and moe_gemm for one row layout, top-k, activation dtype and device: compiled
    kernels, their grids and shared memory, resolved once per config (prefill launches a pair per
    scratch chunk, and the host's time per launch bounds how fast small chunks go)."""

    def __init__(self, layout: RowLayout, topk: int, dtype: torch.dtype, device: torch.device,
                 activation: Activation = SILU):
        if dtype not in ACT_DTYPES:
            raise TypeError(f"dtype must be torch.bfloat16 or torch.float16, got {dtype}")
        check_experts(layout, activation)
        self.layout, self.topk, self.dtype = layout, int(topk), dtype
        self.activation = activation
        self.device = torch.device(device)
        self.sms = _cuda.target(self.device).sms
        self._pairs: dict[GemmConfig, tuple] = {}

    def gemm(self, cfg: GemmConfig, name: str):
        """A moe_gemm.cu kernel compiled for `cfg`."""
        return kernels.function("moe_gemm", name,
                                defines(cfg, self.layout, self.dtype, self.activation),
                                self.device)

    def align(self, nt: int, name: str, x: torch.Tensor, ids64: int = 1, w_dtype: int = 0,
              all_host: bool = False):
        """A moe_align.cu kernel for units of `nt` lanes; 16-byte loads of x where its rows allow
        them (H % 8 == 0 and a 16-byte aligned base). `all_host`: align_experts' ALL_HOST build
        (every expert not on the GPU copied, routed or not: copy lists from expert_addr alone)."""
        xvec = int(self.layout.hidden % 8 == 0 and x.data_ptr() % 16 == 0)
        d = {"NT": nt, "HP": self.layout.hp, "IN_BF16": ACT_DTYPES[self.dtype], "IDS64": ids64,
             "XVEC": xvec, "W_DTYPE": w_dtype}
        if all_host:
            d["ALL_HOST"] = 1
        return kernels.function("moe_align", name, d, self.device)

    def _pair(self, cfg: GemmConfig) -> tuple:
        """(threads, w13, grid, smem, w2, grid, smem) of a config."""
        got = self._pairs.get(cfg)
        if got is None:
            threads = 32 * cfg.ksplit * cfg.warps_m
            w13, w2 = self.gemm(cfg, "moe_w13"), self.gemm(cfg, "moe_w2")
            s13 = shared_bytes(cfg, self.layout, "moe_w13")
            s2 = shared_bytes(cfg, self.layout, "moe_w2")
            got = self._pairs[cfg] = (
                threads, w13, kernels.resident_grid(w13, threads, s13, self.device), s13,
                w2, kernels.resident_grid(w2, threads, s2, self.device), s2)
        return got

    def run(self, cfg: GemmConfig, rng: torch.Tensor, unit_addr, unit_lanes, unit_count, xh,
            xscale, act, lane_w, tokens: int, dummy: torch.Tensor, *, out=None, yw=None,
            group_done=None, out32=None, all_rng=None) -> None:
        """moe_w13 then moe_w2 over the units [rng[0], rng[1]) (int32 device range). Decode
        (REDUCE 0) passes out, yw, group_done and all_rng (the units of every launch of the call,
        which the last-block sum counts); prefill (REDUCE 1) passes out32. `dummy` is any int32
        device tensor standing for the buffers a config does not use."""
        threads, w13, g13, s13, w2, g2, s2 = self._pair(cfg)
        kernels.launch(w13, g13, threads, (
            rng, unit_addr, unit_lanes, unit_count, xh, xscale, kernels.i32(self.topk), act),
            shared_mem=s13, device=self.device)
        kernels.launch(w2, g2, threads, (
            rng, rng if all_rng is None else all_rng, unit_addr, unit_lanes, unit_count, act,
            lane_w, kernels.i32(self.topk), kernels.i32(tokens), kernels.i32(self.layout.hidden),
            dummy if yw is None else yw, dummy if group_done is None else group_done,
            dummy if out is None else out, dummy if out32 is None else out32),
            shared_mem=s2, device=self.device)

    def finish(self, cfg: GemmConfig, out32: torch.Tensor, tokens: int, out: torch.Tensor) -> None:
        """out [T, H] = out32 [T, Hp] cast to the activations' dtype (prefill's last launch)."""
        kernels.launch(self.gemm(cfg, "moe_finish"), self.sms * 4, 256, (
            out32, kernels.i32(tokens), kernels.i32(self.layout.hidden), out), device=self.device)


def config_from_text(text: str, base: GemmConfig = PREFILL) -> GemmConfig:
    """`base` with the fields named in "NAME=INT[,NAME=INT...]" changed (names in any case, e.g.
    "NB=2,MINB=1"); "" or "default" is `base`. For tuning sweeps and their GPU tests."""
    names = {f.name for f in dataclasses.fields(base)}
    change = {}
    for part in filter(None, text.replace("default", "").split(",")):
        name, sep, value = part.partition("=")
        if not sep or name.lower() not in names or not value.strip().lstrip("-").isdigit():
            raise ValueError(f"config {text!r}: {part!r} is not NAME=INT with NAME one of "
                             f"{sorted(n.upper() for n in names)}")
        change[name.lower()] = int(value)
    return dataclasses.replace(base, **change)
