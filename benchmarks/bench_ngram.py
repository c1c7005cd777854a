"""What gathering qwen4_exp's n-gram embedding rows costs a decode step, with the table in mapped
host memory (`cupool.hosttable`, read by the GPU over PCIe) against the same table in GPU memory.

Shape legend: B tokens of a step (decode slots) · h n-gram heads a PLE layer hashes a token into
((ngram_size − 1) · heads_per_ngram: 16 at transformers' defaults) · D row width (ple_embed_dim / h:
128 bf16 values, 256 bytes, at hidden size 2048) · R table rows.

Per step and PLE layer, the model looks up B·h rows at hashed (effectively random) indices with
`F.embedding`, the kernel this benchmark runs, inside a CUDA graph, with fresh random indices
each call (a graph of `--calls` lookups, each its own index set). Reported per batch size: µs a
lookup (one step of one PLE layer), µs a token, the bytes it moves as GB/s, and the same lookup on
the table in GPU memory; the PCIe H2D copy limit is measured in the same run. The table's size
does not change a random gather's cost once it is far beyond the L2 cache (the default 8 GiB is).

Writes benchmarks/results/bench_ngram.json (a run with a smaller table, other batch sizes or fewer
iterations writes nothing unless --json PATH is given).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from _common import capture, pcie_h2d_GBps, reduced_by, results_path, save, time_ms

from cupool import _cuda
from cupool.cli import CLIParser, output_file, positive_int, run, size

BATCHES = [1, 4, 16]


def build_parser() -> CLIParser:
    p = CLIParser(prog="bench_ngram.py", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--table", type=size, default=8 << 30, help="table size (default 8GiB)")
    p.add_argument("--dim", type=positive_int, default=128, help="row width D in bf16 values")
    p.add_argument("--heads", type=positive_int, default=16, help="rows a token looks up (h)")
    p.add_argument("--batches", nargs="+", type=positive_int, default=BATCHES,
                   help="tokens a step (B), one measurement each")
    p.add_argument("--calls", type=positive_int, default=64,
                   help="lookups a captured graph runs (each with its own indices)")
    p.add_argument("--iters", type=positive_int, default=20, help="timed graph replays")
    p.add_argument("--no-gpu-table", action="store_true",
                   help="skip the GPU-memory table (when it does not fit)")
    p.add_argument("--json", type=output_file, metavar="PATH")
    return p


def lookup_us(table: torch.Tensor, B: int, heads: int, calls: int, iters: int) -> float:
    """µs of one lookup of B·h random rows of `table` (median over graph replays)."""
    rows = table.shape[0]
    ids = torch.randint(0, rows, (calls, B, heads), device="cuda")
    out = torch.empty(calls, B, heads, table.shape[1], dtype=table.dtype, device="cuda")

    def one(c):
        out[c] = F.embedding(ids[c], table)
    g = capture(one, calls)
    ms = time_ms(g.replay, warmup=3, iters=iters,
                 setup=lambda: ids.random_(0, rows))          # fresh rows every replay
    return ms * 1e3 / calls


def main(args) -> None:
    _cuda.require_gpu("the n-gram gather benchmark")
    from cupool.hosttable import mapped_empty
    D, h = args.dim, args.heads
    row_bytes = 2 * D
    rows = args.table // row_bytes
    out = results_path("bench_ngram", args.json,
                       reduced_by(args, build_parser(), "table", "dim", "heads", "batches",
                                  "calls", "iters", "no_gpu_table"))
    pcie = pcie_h2d_GBps()
    print(f"PCIe H2D {pcie:.1f} GB/s; table {rows:,} rows of {D} bf16 ({args.table / 2**30:.1f} "
          f"GiB), {h} rows a token", flush=True)
    host, mapped = mapped_empty((rows, D), torch.bfloat16, "cuda")
    step = 1 << 22
    for a in range(0, rows, step):                 # random values, a slice at a time
        host[a:a + step].normal_()
    on_gpu = None if args.no_gpu_table else mapped.clone()
    results = {"table_bytes": rows * row_bytes, "rows": rows, "dim": D, "heads": h,
               "pcie_h2d_GBps": pcie, "batches": {}}
    for B in args.batches:
        us = lookup_us(mapped, B, h, args.calls, args.iters)
        moved = B * h * row_bytes
        r = {"host_us_per_lookup": us, "host_us_per_token": us / B,
             "host_GBps": moved / us / 1e3, "host_over_pcie": moved / us / 1e3 / pcie}
        if on_gpu is not None:
            r["gpu_us_per_lookup"] = lookup_us(on_gpu, B, h, args.calls, args.iters)
        results["batches"][str(B)] = r
        print(f"B={B:>3}: mapped host {us:7.2f} µs a lookup ({us / B:6.2f} µs a token, "
              f"{r['host_GBps']:.2f} GB/s)" + (f"; GPU memory {r['gpu_us_per_lookup']:.2f} µs"
                                               if on_gpu is not None else ""), flush=True)
    save("bench_ngram", results, out)


if __name__ == "__main__":
    sys.exit(run(main, build_parser()))
