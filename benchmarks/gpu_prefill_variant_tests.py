"""Run the prefill GPU tests (tests/test_gpu_gemm.py -k prefill) with gemm.PREFILL changed, in this
process, one pytest run per variant (the syntax of profile_gemm --prefill-sweep):

    python3 benchmarks/gpu_prefill_variant_tests.py NB=2,MINB=1 KC2=256

For checking a variant before it becomes the default; exits non-zero if any run fails."""

from __future__ import annotations

import argparse
import sys

import pytest
from profile_gemm import prefill_variant

import cupool.gemm as G


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variants", nargs="*", default=["default"], metavar="NAME=INT[,...]")
    args = p.parse_args(argv)
    configs = [(text, prefill_variant(text, "variant")) for text in args.variants]
    base, worst = G.PREFILL, 0
    try:
        for text, cfg in configs:
            G.PREFILL = cfg
            print(f"=== {text}: {cfg}", flush=True)
            rc = pytest.main(["-m", "gpu", "-q", "-p", "no:cacheprovider", "-k", "prefill",
                              "tests/test_gpu_gemm.py"])
            worst = max(worst, int(rc))
    finally:
        G.PREFILL = base
    return worst


if __name__ == "__main__":
    sys.exit(main())
