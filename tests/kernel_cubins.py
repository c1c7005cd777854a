"""sha256 of each kernel's cubin in the builds the launchers compile (nvcc -arch=sm_90, no GPU).

A refactor of `rawkernels/` that must leave the kernels as they are is checked by comparing these
hashes before and after: `python tests/kernel_cubins.py > before.txt`, edit, then
`python tests/kernel_cubins.py --compare before.txt` (exit code 1 on any difference).

BUILDS lists, for every source, its default build (no -D) and the -D sets the launchers pass at
the Qwen3-30B-A3B (H=2048, I=768), H=4096/I=1536 and gpt-oss (H = I = 2880, biases, clamped
SwiGLU) dims: the moe_decode variants the per-call
rules choose, the moe_gemm configs (pair decode and prefill), moe_align, the planner, the row copy
kernels, the quantizer. The sets are written out here rather than taken from the launchers, so a
change to a launcher's rule shows up as a change of hashes only where it changes a kernel.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "rawkernels"

_QWEN = "-DHP=2048 -DIP=768 -DROW_W2_OFFSET=1769728"
_BIG = "-DHP=4096 -DIP=1536 -DROW_W2_OFFSET=7078144"
# gpt-oss: H = I = 2880, rows with biases, the clamped SwiGLU (alpha 1.702, limit 7.0 in float32)
_GPTOSS = ("-DHP=2880 -DIP=2880 -DROW_W2_OFFSET=9331456 -DROW_BIAS=1 -DACT=1 "
           "-DACT_ALPHA=0x1.b3b6460000000p+0f -DACT_LIMIT=0x1.c000000000000p+2f")


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
    ("nvfp4_quant", ""),
    ("nvfp4_quant", "-DTHREADS=256 -DUNROLL=4"),
    ("planner", ""),
    ("planner", "-DTHREADS=128 -DITEMS=4"),
    ("planner", "-DTHREADS=1024 -DITEMS=4"),
    ("planner", "-DTHREADS=128 -DITEMS=4 -DPREFETCH=1"),   # Bank(prefetch=True)
    ("rowcopy", ""),
    ("rowcopy", "-DUNROLL=4"),
    ("rowcopy", "-DCHUNK=32768 -DNSTAGES=4"),
    ("moe_align", ""),
    ("moe_align", "-DNT=8 -DHP=2048 -DIN_BF16=1 -DIDS64=1 -DXVEC=1 -DW_DTYPE=0"),
    ("moe_align", "-DNT=64 -DHP=2048 -DIN_BF16=1 -DIDS64=1 -DXVEC=1 -DW_DTYPE=0"),
    ("moe_align", "-DNT=64 -DHP=4096 -DIN_BF16=0 -DIDS64=0 -DXVEC=0 -DW_DTYPE=1"),
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
    ("moe_decode", _decode("-DHP=128 -DIP=64 -DROW_W2_OFFSET=4864", 16, 256, 3, 4, HFULL=0,
                           XALIGN=0, IN_BF16=0, OUT_BF16=0, W_DTYPE=1)),
    ("moe_decode", _decode(_QWEN, 8, 64, 3, 4, DECODE_TRACE=1)),      # the profiling build
    ("moe_decode", _decode(_GPTOSS, 8, 64, 3, 4)),                        # gpt-oss T=1, K=4
    ("moe_decode", _decode(_GPTOSS, 8, 64, 4, 4)),                        # gpt-oss T=4..16
    ("moe_gemm", _gemm(_GPTOSS, 64, 1, 8, 256, 256, 1, 1, 0, 2, 2)),      # gpt-oss prefill
]


def cubin_hashes(nvcc: str) -> list[tuple[str, str, str]]:
    """[(source, defines, sha256 of the cubin)] for every build in BUILDS."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, defines) in enumerate(BUILDS):
            cubin = Path(tmp) / f"{i}.cubin"
            r = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", f"-I{KERNELS}", "-cubin",
                                *defines.split(), "-o", str(cubin), str(KERNELS / f"{name}.cu")],
                               capture_output=True, text=True, timeout=600)
            if r.returncode:
                digest = "compile-failed"
                print(f"{name} {defines}: {r.stderr.strip()}", file=sys.stderr)
            else:
                digest = hashlib.sha256(cubin.read_bytes()).hexdigest()
            out.append((name, defines, digest))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compare", metavar="FILE", help="an earlier output of this script")
    args = p.parse_args(argv)
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        print("kernel_cubins: nvcc is not on PATH", file=sys.stderr)
        return 2
    rows = cubin_hashes(nvcc)
    if not args.compare:
        for name, defines, digest in rows:
            print(f"{digest}  {name}  {defines}")
        return 0
    old = {}
    for line in Path(args.compare).read_text().splitlines():
        digest, name, *rest = line.split("  ")
        old[(name, rest[0] if rest else "")] = digest
    differ = 0
    for name, defines, digest in rows:
        before = old.get((name, defines), "absent")
        same = before == digest
        differ += not same
        print(f"{'same   ' if same else 'DIFFERS'}  {name:<12} {before[:16]}  {digest[:16]}  {defines}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
