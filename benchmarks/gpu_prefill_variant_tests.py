"""Run the prefill GPU tests (tests/test_gpu_gemm.py -k prefill) with gemm.PREFILL changed, in this
process: `python3 benchmarks/gpu_prefill_variant_tests.py PIPE13=1,PIPE2=1 ...` (one pytest run
per variant, same syntax as profile_gemm --prefill-sweep). For checking a variant before it
becomes the default; exits non-zero if any run fails."""

from __future__ import annotations

import sys

import pytest
from profile_gemm import prefill_variant

import cupool.gemm as G


def main(argv: list[str]) -> int:
    base, worst = G.PREFILL, 0
    for text in argv or ["default"]:
        G.PREFILL = prefill_variant(text, "variant")
        print(f"=== {text}: {G.PREFILL}", flush=True)
        rc = pytest.main(["-m", "gpu", "-q", "-p", "no:cacheprovider", "-k", "prefill",
                          "tests/test_gpu_gemm.py"])
        worst = max(worst, int(rc))
    G.PREFILL = base
    return worst


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
