"""The read ceiling of a decode layer: how fast one launch can read just the bytes moe_decode reads.

Each case reads n expert rows of a layer (n = the distinct experts of a T-token, top-8 step) in a
CUDA graph of `--layers` launches, each on a different layer's rows (as bench_gemm times the
decode GEMM), and reports µs a launch and the fraction of the HBM read bandwidth measured in the
same run. Kernels (rawkernels/read_probe.cu):
- `plain`: 16-byte loads, every block streaming its own contiguous span of the rows;
- `bulk`: moe_decode's pattern, 4 KiB a warp by two bulk copies, one wait, then the next piece.
Placements: `scattered` (n random rows of the layer's 128, as bench_gemm routes) and `adjacent`
(the layer's first n rows: the same bytes without the spread, which tells whether address
translation of scattered rows costs anything).
The same run times moe_decode on bench_gemm's set-up for the comparison.

Writes benchmarks/results/profile_read.json (a run with fewer layers than the default or
--skip-decode writes nothing unless --json PATH is given).
"""

from __future__ import annotations

import argparse
import sys

import torch
from _common import capture, hbm_read_GBps, reduced_by, results_path, save, time_ms

from cupool import _cuda, kernels
from cupool.cli import CLIParser, bounded_int, output_file, positive_int, run
from cupool.layout import RowLayout

PIECE = 4096


def layer_rows(layout, E, layers):
    stride = layout.row_stride
    rows = torch.empty(layers * E, stride, dtype=torch.uint8, device="cuda")
    rows.view(torch.int32).random_()                     # not zeros: nothing compressible
    return rows, stride


def probe(rows, stride, E, n, layers, placement, kernel, grid, gen, hbm):
    row_bytes = rows.shape[1] // PIECE * PIECE if kernel == "bulk" else rows.shape[1]
    addrs = []
    for layer in range(layers):
        pick = (torch.randperm(E, generator=gen)[:n] if placement == "scattered" else torch.arange(n))
        addrs.append((rows.data_ptr() + (layer * E + pick) * stride).to("cuda"))
    sink = torch.zeros(grid, dtype=torch.int32, device="cuda")
    if kernel == "plain":
        fn = kernels.function("read_probe", "read_rows")
        args = lambda a: (a, kernels.i32(n), kernels.i32(row_bytes // 16), sink)
    else:
        fn = kernels.function("read_probe", "read_rows_bulk")
        args = lambda a: (a, kernels.i32(n), kernels.i32(row_bytes // PIECE), sink)
    g = capture(lambda layer: kernels.launch(fn, grid, 256, args(addrs[layer])), layers)
    us = time_ms(g.replay, warmup=3, iters=30) / layers * 1e3
    gbps = n * row_bytes / us / 1e3
    return {"rows": n, "placement": placement, "kernel": kernel, "grid": grid,
            "bytes": n * row_bytes, "us": us, "GBps": gbps, "fraction_of_hbm_read": gbps / hbm}


def build_parser() -> CLIParser:
    p = CLIParser(prog="profile_read.py", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=positive_int, default=16,
                   help="distinct layers in the graph (>= 1)")
    p.add_argument("--experts", type=bounded_int(30, 1024), default=128,
                   help="experts a layer (in [30, 1024]: cases read up to 30 distinct rows)")
    p.add_argument("--skip-decode", action="store_true", help="do not time moe_decode alongside")
    p.add_argument("--json", type=output_file, metavar="PATH",
                   help="write the results here (default: benchmarks/results/profile_read.json, "
                        "for a full run only)")
    return p


def reduced(args) -> list[str]:
    """How this run is smaller than the default one (then it writes no canonical file)."""
    return reduced_by(args, build_parser(), "layers", "skip_decode")


def main(args) -> None:
    _cuda.require_gpu("the read-ceiling probe")
    out = results_path("profile_read", args.json, reduced(args))
    hbm = hbm_read_GBps()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"HBM read {hbm:.0f} GB/s, {sms} SMs")
    gen = torch.Generator().manual_seed(0)
    cases = []
    for (H, I), ns in (((2048, 768), (8, 30)), ((4096, 1536), (8, 30))):
        layout = RowLayout(H, I)
        rows, stride = layer_rows(layout, args.experts, args.layers)
        for n in ns:
            for placement in ("scattered", "adjacent"):
                for kernel, grid in (("plain", 3 * sms), ("plain", 8 * sms), ("bulk", 3 * sms)):
                    r = probe(rows, stride, args.experts, n, args.layers, placement, kernel, grid, gen, hbm)
                    r.update(H=H, I=I)
                    cases.append(r)
                    print(f"H={H} rows={n:2d} {placement:9s} {kernel:5s} grid {grid:4d}: "
                          f"{r['us']:6.1f} us {r['GBps']:6.0f} GB/s = {r['fraction_of_hbm_read']:.2f} of HBM read",
                          flush=True)
        del rows
        torch.cuda.empty_cache()
    decode = []
    if not args.skip_decode:
        from bench_gemm import bench_decode
        g = torch.Generator(device="cuda").manual_seed(0)
        for H, I, T in ((2048, 768, 1), (2048, 768, 4), (4096, 1536, 1), (4096, 1536, 4)):
            r = bench_decode(RowLayout(H, I), args.experts, T, 8, args.layers, g, hbm)
            decode.append(r)
            print(f"moe_decode H={H} T={T}: {r['us_per_layer']:.1f} us, {r['distinct_experts']:.1f} rows, "
                  f"{r['GBps']:.0f} GB/s = {r['fraction_of_hbm_read']:.2f} of HBM read", flush=True)
    save("profile_read", {"hbm_read_GBps": hbm, "layers": args.layers, "cases": cases,
                          "decode": decode}, out)


if __name__ == "__main__":
    sys.exit(run(main, build_parser()))
