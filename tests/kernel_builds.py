"""The one table of kernel builds: every `rawkernels/*.cu` is registered here.

- `BUILDS`: each source's default build (no -D) and the production -D sets the launchers pass.
  `tests/test_nvcc_compile.py` compiles every one of them with nvcc for every architecture in
  `ARCHS` (without warnings), and `tests/kernel_cubins.py` hashes their sm_90 cubins.
- `VARIANTS`: other -D sets the launchers can pass (other dims, dtypes, unit sizes); compiled for
  sm_90 only, to keep the CPU suite's compile time down (the code they select is architecture
  independent: the architecture-specific parts sit in the headers every build includes).

A new `.cu` adds its default build and its production builds to BUILDS (a test fails for a
source that has no default build here).

BUILDS holds the builds at the Qwen3-30B-A3B (H=2048, I=768), H=4096/I=1536, gpt-oss (H = I =
2880, biases, clamped SwiGLU) and Nemotron-3-Nano-30B-A3B (H=2688, I=1856, experts without a
gate: ROW_GATED=0, ReLU(up)²) dims: the moe_decode variants the per-call rules choose (at
Qwen3-30B-A3B's dims on every SM count of test_nvcc_compile.SM_COUNTS; VARIANTS holds those of the
other served families' dims, Qwen3-Next's, GLM-4.5-Air's and DeepSeek-V3's among them), the
moe_gemm configs (pair decode and prefill), moe_align, the planner, the row copy kernels, the
quantizer. The sets are written out here rather than taken from the launchers, so a change to a
launcher's rule shows up as a change of hashes only where it changes a kernel.
"""

from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "rawkernels"

# The architectures cupool builds for (cupool._cuda.ARCHS): A100; RTX 30xx; RTX 40xx; H100/H200;
# B200; RTX 50xx / RTX PRO 6000.
ARCHS = (80, 86, 89, 90, 100, 120)

_QWEN = "-DHP=2048 -DIP=768 -DROW_W2_OFFSET=1769728"
_BIG = "-DHP=4096 -DIP=1536 -DROW_W2_OFFSET=7078144"
# gpt-oss: H = I = 2880, rows with biases, the clamped SwiGLU (alpha 1.702, limit 7.0 in float32)
_GPTOSS = ("-DHP=2880 -DIP=2880 -DROW_W2_OFFSET=9331456 -DROW_BIAS=1 -DACT=1 "
           "-DACT_ALPHA=0x1.b3b6460000000p+0f -DACT_LIMIT=0x1.c000000000000p+2f")
# Nemotron-3-Nano-30B-A3B: H=2688, I=1856 (29 chunks a w2 strip), rows without gate strips,
# ReLU(up)² (RowLayout(2688, 1856, gated=False).defines() and RELU2.defines())
_NEMOTRON = "-DHP=2688 -DIP=1856 -DROW_W2_OFFSET=2806528 -DROW_GATED=0 -DACT=2"
# Qwen3-Next-80B-A3B (H=2048, I=512: a w2 strip's 8 chunks fit the stage ring), GLM-4.5-Air
# (H=4096, I=1408), DeepSeek-V3 / Kimi-K2 (H=7168, I=2048: wider than a ROUTE build takes)
_QWEN_NEXT = "-DHP=2048 -DIP=512 -DROW_W2_OFFSET=1179904"
_GLM_AIR = "-DHP=4096 -DIP=1408 -DROW_W2_OFFSET=6488320"
_DEEPSEEK = "-DHP=7168 -DIP=2048 -DROW_W2_OFFSET=16515328"


def _gemm(dims: str, nt, ksplit, warps_m, kc, w2_kc, nb, reduce, prefetch, minb, w2_ns) -> str:
    return (f"{dims} -DNT={nt} -DKSPLIT={ksplit} -DWARPS_M={warps_m} -DKC={kc} -DW2_KC={w2_kc} "
            f"-DNB={nb} -DOUT_BF16=1 -DREDUCE={reduce} -DPREFETCH_W2={prefetch} -DMINB={minb} "
            f"-DW2_NS={w2_ns} -DNTG=4")


def _decode(dims: str, nt: int, maxw: int, minb: int, split: int, **over) -> str:
    d = {**dict(OUT_BF16=1, IN_BF16=1, W_DTYPE=0, XALIGN=1, HFULL=1), **over}
    rest = " ".join(f"-D{k}={v}" for k, v in d.items())
    return f"{dims} -DNT={nt} -DMAXW={maxw} {rest} -DMINB={minb} -DW13_KSPLIT={split}"


BUILDS: list[tuple[str, str]] = [
    ("selftest", ""),
    ("read_probe", ""),
    ("host_handoff", ""),               # x bf16
    ("host_handoff", "-DX_DTYPE=0"),    # x float32
    ("host_handoff", "-DX_DTYPE=2 -DW_DTYPE=1 -DY_DTYPE=1"),   # fp16 x, bf16 weights and y
    ("host_handoff", "-DW_DTYPE=2 -DY_DTYPE=2"),               # fp16 weights and y
    ("nvfp4_quant", ""),
    ("nvfp4_quant", "-DTHREADS=256 -DUNROLL=4"),
    ("planner", ""),
    ("planner", "-DTHREADS=128 -DITEMS=4"),
    ("planner", "-DTHREADS=1024 -DITEMS=4"),
    ("planner", "-DTHREADS=128 -DITEMS=4 -DPREFETCH=1"),   # Bank(prefetch=True)
    ("planner", "-DTHREADS=128 -DITEMS=4 -DHOST_SPLIT=1"),  # misses handed to the host's CPU
    ("sample", ""),
    ("sample", "-DTHREADS=256 -DITEMS=8 -DIN_F16=0"),    # bf16 logits (cupool.ops.sampler)
    ("sample", "-DTHREADS=256 -DITEMS=8 -DIN_F16=1"),    # fp16 logits
    ("rowcopy", ""),
    ("rowcopy", "-DUNROLL=4"),
    ("rowcopy", "-DCHUNK=32768 -DNSTAGES=4"),
    ("moe_align", ""),
    ("moe_align", "-DNT=8 -DHP=2048 -DIN_BF16=1 -DIDS64=1 -DXVEC=1 -DW_DTYPE=0"),
    ("moe_align", "-DNT=64 -DHP=2048 -DIN_BF16=1 -DIDS64=1 -DXVEC=1 -DW_DTYPE=0"),
    ("moe_align", "-DNT=64 -DHP=4096 -DIN_BF16=0 -DIDS64=0 -DXVEC=0 -DW_DTYPE=1"),
    # prefill ahead (CUPOOL_PREFILL_AHEAD): every expert not on the GPU in the copy lists
    ("moe_align", "-DNT=64 -DHP=2048 -DIN_BF16=1 -DIDS64=1 -DXVEC=1 -DW_DTYPE=0 -DALL_HOST=1"),
    ("moe_gemm", ""),
    ("moe_gemm", _gemm(_QWEN, 8, 8, 1, 2048, 768, 2, 0, 1, 3, 1)),        # pair decode, small
    ("moe_gemm", _gemm(_QWEN, 16, 4, 1, 1024, 768, 8, 0, 1, 1, 1)),       # pair decode, wide
    ("moe_gemm", _gemm(_QWEN, 64, 1, 8, 256, 768, 1, 1, 0, 2, 2)),        # prefill
    ("moe_gemm", _gemm(_BIG, 64, 1, 8, 256, 256, 1, 1, 0, 2, 2)),         # prefill, H=4096
    ("moe_decode", ""),
    ("moe_decode", _decode(_QWEN, 8, 64, 3, 4)),                          # T=1, K=8
    ("moe_decode", _decode(_QWEN, 8, 64, 4, 2)),                          # T=4..8
    ("moe_decode", _decode(_QWEN, 16, 256, 3, 2)),                        # T=16
    ("moe_decode", _decode(_BIG, 8, 64, 4, 4)),
    ("moe_decode", _decode(_BIG, 16, 256, 3, 4)),
    ("moe_decode", _decode("-DHP=128 -DIP=64 -DROW_W2_OFFSET=9472", 16, 256, 3, 4, HFULL=0,
                           XALIGN=0, IN_BF16=0, OUT_BF16=0, W_DTYPE=1)),
    ("moe_decode", _decode(_QWEN, 8, 64, 3, 4, DECODE_TRACE=1)),      # the profiling build
    ("moe_decode", _decode(_GPTOSS, 8, 64, 3, 4)),                        # gpt-oss T=1, K=4
    ("moe_decode", _decode(_GPTOSS, 8, 64, 4, 4)),                        # gpt-oss T=4..16
    ("moe_gemm", _gemm(_GPTOSS, 64, 1, 8, 256, 256, 1, 1, 0, 2, 2)),      # gpt-oss prefill
    ("moe_decode", _decode(_NEMOTRON, 8, 64, 3, 4)),                      # Nemotron-H T=1, K=6
    ("moe_decode", _decode(_NEMOTRON, 8, 64, 4, 4)),                      # Nemotron-H T=2..10
    ("moe_decode", _decode(_NEMOTRON, 16, 256, 3, 4)),                    # Nemotron-H T=11..42
    ("moe_gemm", _gemm(_NEMOTRON, 64, 1, 8, 256, 256, 1, 1, 0, 2, 2)),    # Nemotron-H prefill
    # the fused decode step at batch 1 (Qwen3-30B-A3B): QKV (norm), o-projection (+ residual),
    # router (norm, routing), output head (norm, two row tiles a block); its attention
    ("dense_gemv", ""),
    ("dense_gemv", "-DNB=1 -DMODE=1 -DEPI=0 -DWARPS=8 -DRT=1"),
    ("dense_gemv", "-DNB=1 -DMODE=0 -DEPI=1 -DWARPS=8 -DRT=1"),
    ("dense_gemv", "-DNB=1 -DMODE=1 -DEPI=2 -DWARPS=8 -DRT=1"),
    ("dense_gemv", "-DNB=1 -DMODE=1 -DEPI=0 -DWARPS=8 -DRT=2"),
    # its launch shapes CUPOOL_DENSE_SHAPE selects: QKV in blocks of 4 warps (qkv=w4), the
    # o-projection and the router with K split over blocks (o=k2, o=w4k2, router=k8, router=w4k8)
    ("dense_gemv", "-DNB=1 -DMODE=1 -DEPI=0 -DWARPS=4 -DRT=1"),
    ("dense_gemv", "-DNB=1 -DMODE=0 -DEPI=1 -DWARPS=8 -DRT=1 -DKS=2"),
    ("dense_gemv", "-DNB=1 -DMODE=0 -DEPI=1 -DWARPS=4 -DRT=1 -DKS=2"),
    ("dense_gemv", "-DNB=1 -DMODE=1 -DEPI=2 -DWARPS=8 -DRT=1 -DKS=8"),
    ("dense_gemv", "-DNB=1 -DMODE=1 -DEPI=2 -DWARPS=4 -DRT=1 -DKS=8"),
    # the fused step's default shapes (cupool.fused.DEFAULT_DENSE_SHAPE: o=w4k4, attn=ahead) and
    # router=k16 (the default before the plain router measured faster)
    ("dense_gemv", "-DNB=1 -DMODE=0 -DEPI=1 -DWARPS=4 -DRT=1 -DKS=4"),
    ("dense_gemv", "-DNB=1 -DMODE=1 -DEPI=2 -DWARPS=8 -DRT=1 -DKS=16"),
    # the router writing the lanes' expert row addresses (the plan step skipped, every expert in
    # the bank): the plain shape (the default) and router=k16
    ("dense_gemv", "-DNB=1 -DMODE=1 -DEPI=2 -DWARPS=8 -DRT=1 -DLANE_ADDR=1"),
    ("dense_gemv", "-DNB=1 -DMODE=1 -DEPI=2 -DWARPS=8 -DRT=1 -DKS=16 -DLANE_ADDR=1"),
    # gpt-oss's router (a bias on the logits, RBIAS), without and with lane addresses
    ("dense_gemv", "-DNB=1 -DMODE=1 -DEPI=2 -DWARPS=8 -DRT=1 -DRBIAS=1"),
    ("dense_gemv", "-DNB=1 -DMODE=1 -DEPI=2 -DWARPS=8 -DRT=1 -DLANE_ADDR=1 -DRBIAS=1"),
    # a sigmoid router with a correction bias (GLM-4.5's, DeepSeek-V3's: SIG), without and with
    # lane addresses
    ("dense_gemv", "-DNB=1 -DMODE=1 -DEPI=2 -DWARPS=8 -DRT=1 -DSIG=1"),
    ("dense_gemv", "-DNB=1 -DMODE=1 -DEPI=2 -DWARPS=8 -DRT=1 -DLANE_ADDR=1 -DSIG=1"),
    # the (1 + w) RMSNorm (Qwen3-Next's, Gemma's: NORM1) at batch 1: a normed GEMV at the plain
    # shape and QKV at the default one (qkv=w4), the softmax router, the output head
    ("dense_gemv", "-DNB=1 -DMODE=1 -DEPI=0 -DWARPS=8 -DRT=1 -DNORM1=1"),
    ("dense_gemv", "-DNB=1 -DMODE=1 -DEPI=0 -DWARPS=4 -DRT=1 -DNORM1=1"),
    ("dense_gemv", "-DNB=1 -DMODE=1 -DEPI=2 -DWARPS=8 -DRT=1 -DNORM1=1"),
    ("dense_gemv", "-DNB=1 -DMODE=1 -DEPI=0 -DWARPS=8 -DRT=2 -DNORM1=1"),
    # a gated MLP's down projection on silu(gate) · up (the GLU prologue, MODE 2) at batch 1 and
    # the plain shape (mlp_down): a dense layer's MLP; a shared expert added to the routed
    # experts' sum (GLM-4.5's), and one with a sigmoid gate (GATE: Qwen2-MoE's, Qwen3-Next's),
    # also with NVFP4 weights
    ("dense_gemv", "-DNB=1 -DMODE=2 -DEPI=0 -DWARPS=8 -DRT=1"),
    ("dense_gemv", "-DNB=1 -DMODE=2 -DEPI=1 -DWARPS=8 -DRT=1"),
    ("dense_gemv", "-DNB=1 -DMODE=2 -DEPI=1 -DWARPS=8 -DRT=1 -DGATE=1"),
    ("dense_gemv", "-DNB=1 -DMODE=2 -DEPI=1 -DWARPS=8 -DRT=1 -DWFP4=1 -DGATE=1"),
    # NVFP4 attention projections (cupool.dense_nvfp4) at the default shapes: QKV (norm, 4 warps)
    # at batch 1 and 16, the o-projection (+ residual, 4 warps, K split over 4 blocks)
    ("dense_gemv", "-DNB=1 -DMODE=1 -DEPI=0 -DWARPS=4 -DRT=1 -DWFP4=1"),
    ("dense_gemv", "-DNB=16 -DMODE=1 -DEPI=0 -DWARPS=4 -DRT=1 -DWFP4=1"),
    ("dense_gemv", "-DNB=1 -DMODE=0 -DEPI=1 -DWARPS=4 -DRT=1 -DKS=4 -DWFP4=1"),
    # the same two at batch 1 as the launcher builds them, their chunks dequantised before the
    # wait (cupool.ops.dense_gemv.predequant_chunks: 8 and 4 a warp)
    ("dense_gemv", "-DNB=1 -DMODE=1 -DEPI=0 -DWARPS=4 -DRT=1 -DWFP4=1 -DPRE=8"),
    ("dense_gemv", "-DNB=1 -DMODE=0 -DEPI=1 -DWARPS=4 -DRT=1 -DKS=4 -DWFP4=1 -DPRE=4"),
    # the router folded into the decode GEMM's launch (the plan step skipped, CUPOOL_FUSED_ROUTE)
    # at Qwen3-30B-A3B's dims: T=1 (its w2 strips split over 4 warps, moe_decode.w2_split_for),
    # T=2, T=3..8, T=9..16
    ("moe_decode", _decode(_QWEN, 8, 64, 3, 4, ROUTE=1, W2_KSPLIT=4)),
    ("moe_decode", _decode(_QWEN, 8, 64, 4, 4, ROUTE=1)),
    ("moe_decode", _decode(_QWEN, 8, 64, 4, 2, ROUTE=1)),
    ("moe_decode", _decode(_QWEN, 16, 256, 3, 2, ROUTE=1)),
    # the rest of what the per-call rules choose (`moe_decode.choose`, plain and ROUTE) for 1 to
    # 16 tokens at Qwen3-30B-A3B's dims on the SM counts of the GPUs cupool builds for (other
    # families' in VARIANTS; tests/test_nvcc_compile.py: test_launcher_decode_builds_are_registered);
    # the plain T=1 launch splits its w2 strips over 4 warps as well (moe_decode.w2_split_for)
    ("moe_decode", _decode(_QWEN, 8, 64, 3, 4, W2_KSPLIT=4)),
    ("moe_decode", _decode(_QWEN, 8, 64, 4, 4, W2_KSPLIT=4)),
    ("moe_decode", _decode(_QWEN, 8, 64, 4, 4)),
    ("moe_decode", _decode(_QWEN, 8, 64, 4, 4, ROUTE=1, W2_KSPLIT=4)),
    ("moe_decode", _decode(_QWEN, 8, 64, 3, 2)),
    ("moe_decode", _decode(_QWEN, 8, 64, 3, 4, ROUTE=1)),
    ("moe_decode", _decode(_QWEN, 8, 64, 3, 2, ROUTE=1)),
    ("dense_attention", ""),
    ("dense_attention", "-DD=128 -DG=8 -DMINCHUNK=64"),
    ("dense_attention", "-DD=128 -DG=8 -DMINCHUNK=64 -DAHEAD=1"),
    # Qwen3-Next's full-attention layers at the default shape (attn=ahead): 16 query heads over
    # 2 KV heads of 256 dims, the first 64 turning, q_proj's rows with each head's gate (QGATE),
    # the (1 + w) q/k norms (NORM1)
    ("dense_attention", "-DD=256 -DG=8 -DMINCHUNK=64 -DAHEAD=1 -DROT=64 -DQGATE=1 -DNORM1=1"),
    # gated delta nets: Qwen3-Next's (in_proj_qkvz's grouped layout) and Qwen3.5's (flat), 128-dim
    # key and value heads, a 4-position convolution
    ("delta_decode", ""),
    ("delta_decode", "-DDK=128 -DDV=128 -DKC=4 -DGROUPED=1"),
    ("delta_decode", "-DDK=128 -DDV=128 -DKC=4 -DGROUPED=0"),
]


# Configurations the launchers (cupool/ops) compile besides each file's defaults: moe_decode's
# units of 8 and 16 lanes with each W13_KSPLIT the kernel takes (1, 2, 4; the launcher's rule
# picks 2 or 4), fp16 activations in and out, bf16/fp16 router weights, unaligned x, H < Hp and
# H=4096; moe_gemm's prefill config and other dims; then moe_decode's DECODE_TRACE profiling build.
VARIANTS = [
    ("moe_gemm", "-DNT=64 -DKSPLIT=1 -DWARPS_M=8 -DKC=256 -DNB=1 -DREDUCE=1 -DMINB=2 -DOUT_BF16=0"),
    ("moe_gemm", "-DNT=8 -DHP=4096 -DIP=1536"),
    ("moe_gemm", "-DNT=16 -DHP=128 -DIP=64 -DKC=128"),
    ("moe_decode", "-DNT=8 -DMAXW=64 -DMINB=4 -DW13_KSPLIT=1"),
    ("moe_decode", _decode(_QWEN, 8, 64, 3, 4, XSMEM=1)),       # x in shared memory (a variant)
    ("moe_decode", _decode(_QWEN, 8, 64, 4, 2, XSMEM=1)),
    ("moe_decode", "-DNT=8 -DMAXW=64 -DMINB=4 -DW13_KSPLIT=2"),
    ("moe_decode", "-DNT=8 -DMAXW=64 -DMINB=4 -DW13_KSPLIT=4 -DHP=4096 -DIP=1536"),
    ("moe_decode", "-DNT=16 -DMAXW=256 -DMINB=3 -DW13_KSPLIT=1 -DHP=4096 -DIP=1536"),
    ("moe_decode", "-DNT=16 -DMAXW=256 -DMINB=3 -DW13_KSPLIT=2"),
    ("moe_decode", "-DNT=16 -DMAXW=256 -DMINB=3 -DW13_KSPLIT=4 -DW_DTYPE=2"),
    ("moe_decode", "-DNT=16 -DMAXW=256 -DMINB=3 -DOUT_BF16=0 -DIN_BF16=0 -DW_DTYPE=1 -DXALIGN=0"),
    ("moe_decode", "-DNT=8 -DMAXW=64 -DOUT_BF16=0 -DIN_BF16=0 -DHP=128 -DIP=64 -DHFULL=0"),
    ("moe_align", "-DNT=64 -DIDS64=0 -DIN_BF16=0"),
    ("moe_align", "-DNT=8 -DXVEC=1 -DW_DTYPE=2"),
    ("planner", "-DPREFETCH=1"),
    ("planner", "-DPREFETCH=1 -DTHREADS=1024 -DITEMS=2"),
    ("planner", "-DHOST_SPLIT=1 -DTHREADS=1024 -DITEMS=2"),
    ("rowcopy", "-DCHUNK=1040 -DNSTAGES=5"),
    ("rowcopy", "-DCHUNK=65536 -DNSTAGES=3 -DUNROLL=8"),
    ("moe_decode", "-DDECODE_TRACE=1"),
    # the routing build with bf16 router weights, at H=4096 and its profiling build
    ("moe_decode", _decode(_BIG, 8, 64, 4, 4, ROUTE=1, W_DTYPE=1)),
    ("moe_decode", _decode(_QWEN, 8, 64, 3, 4, ROUTE=1, DECODE_TRACE=1)),
    # NVFP4 GEMVs dequantised before the wait at the fragments' widest: 8 chunks at 8 tokens,
    # 4 chunks at 16 tokens (two n tiles), 4 chunks of two row tiles
    ("dense_gemv", "-DNB=8 -DMODE=1 -DEPI=0 -DWARPS=4 -DRT=1 -DWFP4=1 -DPRE=8"),
    ("dense_gemv", "-DNB=16 -DMODE=0 -DEPI=1 -DWARPS=4 -DRT=1 -DKS=4 -DWFP4=1 -DPRE=4"),
    ("dense_gemv", "-DNB=2 -DMODE=1 -DEPI=0 -DWARPS=8 -DRT=2 -DWFP4=1 -DPRE=4"),
    # the fused decode step at 8 and 16 tokens (two MMA n tiles), other head shapes
    ("dense_gemv", "-DNB=8 -DMODE=1 -DEPI=2 -DWARPS=8 -DRT=1"),
    ("dense_gemv", "-DNB=16 -DMODE=1 -DEPI=0 -DWARPS=8 -DRT=2"),
    ("dense_gemv", "-DNB=13 -DMODE=0 -DEPI=1 -DWARPS=8 -DRT=1"),
    # launch shapes at several tokens: two n tiles and two row tiles split three ways, routing
    # of 8 tokens by 4 warps over 16 K slices, 13 tokens in blocks of 4 warps
    ("dense_gemv", "-DNB=16 -DMODE=1 -DEPI=0 -DWARPS=4 -DRT=2 -DKS=3"),
    ("dense_gemv", "-DNB=8 -DMODE=1 -DEPI=2 -DWARPS=4 -DRT=1 -DKS=16"),
    ("dense_gemv", "-DNB=13 -DMODE=0 -DEPI=1 -DWARPS=4 -DRT=1 -DKS=2"),
    # the router writing lane addresses at 8 and 16 tokens (two n tiles, 4 warps, K in 16 slices)
    ("dense_gemv", "-DNB=8 -DMODE=1 -DEPI=2 -DWARPS=8 -DRT=1 -DLANE_ADDR=1"),
    ("dense_gemv", "-DNB=16 -DMODE=1 -DEPI=2 -DWARPS=4 -DRT=1 -DKS=16 -DLANE_ADDR=1"),
    # gpt-oss's router (a bias on the logits) at 8 tokens, with lane addresses
    ("dense_gemv", "-DNB=8 -DMODE=1 -DEPI=2 -DWARPS=8 -DRT=1 -DLANE_ADDR=1 -DRBIAS=1"),
    # the GLU prologue at 8 and 16 tokens: a gated shared expert over two n tiles, K split in 3
    ("dense_gemv", "-DNB=8 -DMODE=2 -DEPI=1 -DWARPS=8 -DRT=1 -DGATE=1"),
    ("dense_gemv", "-DNB=16 -DMODE=2 -DEPI=1 -DWARPS=4 -DRT=2 -DKS=3 -DGATE=1"),
    ("dense_attention", "-DD=64 -DG=8 -DMINCHUNK=64"),
    ("dense_attention", "-DD=128 -DG=16 -DMINCHUNK=64"),
    ("dense_attention", "-DD=256 -DG=4 -DMINCHUNK=64"),
    ("dense_attention", "-DD=64 -DG=1 -DMINCHUNK=64"),
    # attention with a tile's loads issued ahead (AHEAD=1) at other head shapes
    ("dense_attention", "-DD=256 -DG=4 -DMINCHUNK=64 -DAHEAD=1"),
    ("dense_attention", "-DD=64 -DG=1 -DMINCHUNK=64 -DAHEAD=1"),
    # two MMA n tiles of heads (GLM-4.5-Air's 12 a KV head) and Qwen3-Next's 256 dims
    ("dense_attention", "-DD=128 -DG=12 -DMINCHUNK=64 -DAHEAD=1"),
    # GLM-4.5-Air's partial rotary: the first 64 of 128 dims turn (ROT)
    ("dense_attention", "-DD=128 -DG=12 -DMINCHUNK=64 -DAHEAD=1 -DROT=64"),
    ("dense_attention", "-DD=256 -DG=8 -DMINCHUNK=64 -DAHEAD=1"),
    # parts of at least 192 positions (CUPOOL_DENSE_SHAPE attn=aheadc192)
    ("dense_attention", "-DD=128 -DG=8 -DMINCHUNK=192 -DAHEAD=1"),
    # gated delta nets of other head dims and convolution kernels
    ("delta_decode", "-DDK=64 -DDV=32 -DKC=4 -DGROUPED=1"),
    ("delta_decode", "-DDK=32 -DDV=64 -DKC=3 -DGROUPED=0"),
    # its profiling build (benchmarks/profile_attention.py)
    ("dense_attention", "-DD=128 -DG=8 -DMINCHUNK=64 -DAHEAD=1 -DATTN_TRACE=1"),
    ("moe_decode", "-DDECODE_TRACE=1 -DNT=16 -DMAXW=256 -DW13_KSPLIT=2 -DHP=128 -DIP=64 -DHFULL=0"),
    # experts without a gate (ROW_GATED=0, ReLU(up)²): the Nemotron-H pair decode (calls of more
    # than 256 lanes), the other W13_KSPLITs, fp16 and padded dims (H=80, I=48), unit of 16 lanes
    ("moe_gemm", _gemm(_NEMOTRON, 8, 8, 1, 2048, 1856, 2, 0, 1, 3, 1)),
    ("moe_gemm", _gemm(_NEMOTRON, 16, 4, 1, 1024, 1856, 8, 0, 1, 1, 1)),
    ("moe_decode", f"{_NEMOTRON} -DNT=8 -DMAXW=64 -DMINB=4 -DW13_KSPLIT=2"),
    ("moe_decode", ("-DHP=128 -DIP=64 -DROW_W2_OFFSET=4864 -DROW_GATED=0 -DACT=2 -DNT=16 -DMAXW=256 "
                    "-DMINB=3 -DW13_KSPLIT=2 -DOUT_BF16=0 -DIN_BF16=0 -DHFULL=0 -DXALIGN=0")),
    ("moe_gemm", ("-DHP=128 -DIP=64 -DROW_W2_OFFSET=4864 -DROW_GATED=0 -DACT=2 -DNT=16 -DKC=128 "
                  "-DOUT_BF16=0")),
    # x rows in shared memory (XSMEM, profile_gemm's xsmem=1) with fp16 activations, unaligned x,
    # H < Hp; without a gate
    ("moe_decode", "-DNT=8 -DMAXW=64 -DOUT_BF16=0 -DIN_BF16=0 -DHP=128 -DIP=64 -DHFULL=0 -DXALIGN=0 "
                   "-DXSMEM=1"),
    ("moe_decode", ("-DHP=128 -DIP=64 -DROW_W2_OFFSET=4864 -DROW_GATED=0 -DACT=2 -DNT=8 -DMAXW=64 "
                    "-DMINB=3 -DW13_KSPLIT=4 -DHFULL=0 -DXSMEM=1")),
    ("moe_gemm", ("-DHP=128 -DIP=64 -DROW_GATED=0 -DACT=2 -DNT=64 -DKSPLIT=1 -DWARPS_M=8 -DKC=64 "
                  "-DW2_KC=64 -DNB=1 -DREDUCE=1 -DMINB=2 -DW2_NS=2")),
    # what the per-call rules choose at other served families' dims (BUILDS has Qwen3-30B-A3B's)
    # Qwen3-Next (top-10 of 512)
    ("moe_decode", _decode(_QWEN_NEXT, 8, 64, 4, 4)),
    ("moe_decode", _decode(_QWEN_NEXT, 8, 64, 4, 2)),
    ("moe_decode", _decode(_QWEN_NEXT, 16, 256, 3, 2)),
    ("moe_decode", _decode(_QWEN_NEXT, 8, 64, 4, 4, ROUTE=1)),
    ("moe_decode", _decode(_QWEN_NEXT, 8, 64, 4, 2, ROUTE=1)),
    ("moe_decode", _decode(_QWEN_NEXT, 16, 256, 3, 2, ROUTE=1)),
    ("moe_decode", _decode(_QWEN_NEXT, 8, 64, 3, 4)),
    ("moe_decode", _decode(_QWEN_NEXT, 8, 64, 3, 4, ROUTE=1)),
    # H=4096, I=1536 (Qwen3-235B-A22B)
    ("moe_decode", _decode(_BIG, 8, 64, 4, 4, ROUTE=1)),
    ("moe_decode", _decode(_BIG, 16, 256, 3, 4, ROUTE=1)),
    ("moe_decode", _decode(_BIG, 8, 64, 3, 4)),
    ("moe_decode", _decode(_BIG, 8, 64, 3, 4, ROUTE=1)),
    # GLM-4.5-Air
    ("moe_decode", _decode(_GLM_AIR, 8, 64, 4, 4)),
    ("moe_decode", _decode(_GLM_AIR, 16, 256, 3, 4)),
    ("moe_decode", _decode(_GLM_AIR, 8, 64, 4, 4, ROUTE=1)),
    ("moe_decode", _decode(_GLM_AIR, 16, 256, 3, 4, ROUTE=1)),
    ("moe_decode", _decode(_GLM_AIR, 8, 64, 3, 4)),
    ("moe_decode", _decode(_GLM_AIR, 8, 64, 3, 4, ROUTE=1)),
    # gpt-oss
    ("moe_decode", _decode(_GPTOSS, 8, 64, 4, 4, ROUTE=1)),
    ("moe_decode", _decode(_GPTOSS, 8, 64, 3, 4, ROUTE=1)),
    # Nemotron-H
    ("moe_decode", _decode(_NEMOTRON, 8, 64, 3, 4, ROUTE=1)),
    ("moe_decode", _decode(_NEMOTRON, 8, 64, 4, 4, ROUTE=1)),
    ("moe_decode", _decode(_NEMOTRON, 16, 256, 3, 4, ROUTE=1)),
    # DeepSeek-V3 / Kimi-K2 (plain builds only)
    ("moe_decode", _decode(_DEEPSEEK, 8, 64, 4, 4)),
    ("moe_decode", _decode(_DEEPSEEK, 16, 256, 3, 4)),
    ("moe_decode", _decode(_DEEPSEEK, 8, 64, 3, 4)),
]


def nvcc_command(nvcc: str, name: str, defines: str, arch: int, out: Path | str,
                 extra: tuple[str, ...] = ()) -> list[str]:
    """nvcc compiling rawkernels/<name>.cu with `defines` to a cubin for sm_<arch>."""
    return [nvcc, "-std=c++17", f"-arch=sm_{arch}", f"-I{KERNELS}", "-cubin", *extra,
            *defines.split(), "-o", str(out), str(KERNELS / f"{name}.cu")]


def compile_many(nvcc: str, jobs: list[tuple[str, str, int]], out_dir: Path,
                 workers: int | None = None) -> list[subprocess.CompletedProcess]:
    """Compile (name, defines, arch) jobs in parallel (one nvcc a core); results in job order,
    the cubin of job i at out_dir / f"{i}.cubin"."""
    def one(i_job):
        i, (name, defines, arch) = i_job
        return subprocess.run(nvcc_command(nvcc, name, defines, arch, out_dir / f"{i}.cubin"),
                              capture_output=True, text=True, timeout=600)
    with ThreadPoolExecutor(workers or max(2, os.cpu_count() or 2)) as ex:
        return list(ex.map(one, enumerate(jobs)))
