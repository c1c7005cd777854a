"""Host (Python) time of MoEGemm calls, by function (cProfile), for the calls that run eagerly:
prefill on the resident path, prefill on the partition path (store attached), and one decode
call. The device is synchronised before each call, so what is timed is the host's own work
(argument checks, kernel lookups, launches, stream and event calls).

    python benchmarks/profile_host.py [--calls 50] [--top 25]

Prints the profiles; writes no file.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

import torch
from _common import ExpertRows

from cupool import _cuda
from cupool.cli import CLIParser, positive_int, run
from cupool.gemm import MoEGemm
from cupool.layout import RowLayout


def profile(fn, calls, top, label):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    prof, spent = cProfile.Profile(), 0.0
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        prof.enable()
        fn()
        prof.disable()
        spent += time.perf_counter() - t0
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    print(f"--- {label}: {spent / calls * 1e3:.3f} ms of host time a call (under cProfile)")
    print(out.getvalue())


def build_parser() -> CLIParser:
    p = CLIParser(prog="profile_host.py", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=positive_int, default=50, help="profiled calls a case (>= 1)")
    p.add_argument("--top", type=positive_int, default=25, help="functions listed (>= 1)")
    p.add_argument("--tokens", type=positive_int, default=512, help="prefill tokens (>= 1)")
    return p


def main(args) -> None:
    _cuda.require_gpu("the host-time profiler")
    E, K, T = 128, 8, args.tokens
    layout = RowLayout(2048, 768)
    er = ExpertRows(layout, E, store=True)
    store, addr = er.store, er.addr
    gemm = MoEGemm(layout, K, torch.bfloat16, max_prefill_tokens=T, num_experts=E, max_decode_tokens=1)
    x = torch.randn(T, 2048, device="cuda", dtype=torch.bfloat16)
    ids = torch.rand(T, E, device="cuda").topk(K, dim=-1).indices
    w = torch.rand(T, K, device="cuda")
    out = torch.empty_like(x)
    table = store.address_table()
    profile(lambda: gemm.prefill(x, ids, w, addr, out=out), args.calls, args.top,
            f"prefill T={T}, resident path")
    profile(lambda: gemm.prefill(x, ids, w, addr, host_addr=table, out=out), args.calls, args.top,
            f"prefill T={T}, partition path (nothing on the host)")
    x1, la, w1 = x[:1].clone(), addr[ids[0]].contiguous(), w[:1].clone()
    profile(lambda: gemm.decode(x1, la, w1), args.calls, args.top, "decode T=1")
    store.close()


if __name__ == "__main__":
    sys.exit(run(main, build_parser()))
