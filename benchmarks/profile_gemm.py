"""Per-kernel device times of one decode layer call and one prefill call (torch.profiler/CUPTI),
to see where a GEMM benchmark's time goes. Prints one table per case."""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from _common import ROOT  # noqa: F401 (puts the checkout on sys.path)

from cupool.gemm import MoEGemm
from cupool.layout import RowLayout
from cupool.synthetic import random_rows_fast


def table(fn, label, reps=5):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    print(f"--- {label} (x{reps})")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))


def sweep(layers: int = 16):
    """Decode layer time (T=1 and 4, H=2048) for variants of moe_decode's compile-time shape."""
    from bench_gemm import bench_decode
    gen = torch.Generator(device="cuda").manual_seed(0)
    layout = RowLayout(2048, 768)
    for extra in ({}, {"W2_KSPLIT": 1}, {"W2_KSPLIT": 4}, {"MINB": 3}, {"MINB": 3, "W2_KSPLIT": 1}):
        for T in (1, 4):
            r = bench_decode(layout, 128, T, 8, layers, gen, 1.0, extra=extra)
            print(f"sweep T={T} {extra}: {r['us_per_layer']:6.1f} us/layer {r['GBps']:7.0f} GB/s",
                  flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--sweep", action="store_true", help="time moe_decode variants, then exit")
    args = p.parse_args(argv)
    if args.sweep:
        sweep()
        return
    E, K = args.experts, 8
    layout = RowLayout(2048, 768)
    rows = torch.zeros(E, -(-layout.row_bytes // 256) * 256, dtype=torch.uint8, device="cuda")
    rows[:, :layout.row_bytes] = random_rows_fast(layout, E, device="cuda")
    addr = rows.data_ptr() + torch.arange(E, device="cuda") * rows.stride(0)
    for T in (1, 4):
        gemm = MoEGemm(layout, K, torch.bfloat16, max_decode_tokens=T)
        x = torch.randn(T, 2048, device="cuda", dtype=torch.bfloat16)
        ids = torch.rand(T, E, device="cuda").topk(K, dim=-1).indices
        w = torch.rand(T, K, device="cuda")
        la = addr[ids].reshape(-1)
        table(lambda: gemm.decode(x, la, w), f"decode T={T}")
    for T in (512,):
        gemm = MoEGemm(layout, K, torch.bfloat16, max_prefill_tokens=T, num_experts=E)
        x = torch.randn(T, 2048, device="cuda", dtype=torch.bfloat16)
        ids = torch.rand(T, E, device="cuda").topk(K, dim=-1).indices
        w = torch.rand(T, K, device="cuda")
        table(lambda: gemm.prefill(x, ids, w, addr), f"prefill T={T} resident", reps=2)


if __name__ == "__main__":
    main()
