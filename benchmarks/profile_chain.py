"""What a kernel boundary costs in a decode step's graph: a CUDA graph of `--launches` launches
that do nothing but wait for the launch before (rawkernels/read_probe.cu, chain_step), timed
per launch, at several grid sizes, launched plainly and as dependents (programmatic dependent
launch, as the fused step launches its GEMVs and attention; sm_90 and newer).

The fused decode step is a chain of about five launches a layer, each waiting for the one
before; this is the floor that chain pays a launch before any work, and what merging two
kernels into one launch could save at most. The default grids are 1 block, 8 (a router GEMV),
one a streaming multiprocessor and three (moe_decode's resident grid); blocks of 256 threads.

Each graph is checked once before it is timed: its launches leave count = launches, so a launch
that ran before the one before it had written would show as a lost count (a RuntimeError).

Prints a table; writes the figures as JSON only to --json PATH.
"""

from __future__ import annotations

import argparse
import sys

import torch
from _common import capture, gpu_name, save, time_ms

from cupool import _cuda, kernels
from cupool.cli import CLIParser, bounded_int, output_file, run


def build_parser() -> CLIParser:
    p = CLIParser(prog="profile_chain.py", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--launches", type=bounded_int(2, 10000), default=480,
                   help="launches in the graph (in [2, 10000]; default 480: 48 layers x 10)")
    p.add_argument("--grids", type=bounded_int(1, 65535), nargs="+", metavar="BLOCKS",
                   help="grid sizes in blocks (default: 1, 8, the SMs and 3 x the SMs)")
    p.add_argument("--json", type=output_file, metavar="PATH", help="also write the figures here")
    return p


def chain_us(fn, grid: int, launches: int, dependent: bool) -> float:
    """Median µs a launch of a graph of `launches` chain_step launches of `grid` blocks."""
    count = torch.zeros(1, dtype=torch.int32, device="cuda")
    g = capture(lambda _: kernels.launch(fn, grid, 256, (count,), dependent=dependent), launches)
    count.zero_()
    g.replay()
    torch.cuda.synchronize()
    if int(count.item()) != launches:
        raise RuntimeError(f"a graph of {launches} chained launches of {grid} blocks "
                           f"(dependent={dependent}) counted {int(count.item())}: a launch ran "
                           f"before the one before it had finished")
    return time_ms(g.replay, warmup=3, iters=30) / launches * 1e3


def main(args) -> None:
    _cuda.require_gpu("the kernel-boundary probe")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grids = args.grids or [1, 8, sms, 3 * sms]
    dependent_ok = _cuda.target().dependent_launch
    fn = kernels.function("read_probe", "chain_step")
    print(f"{gpu_name()}, {sms} SMs; a graph of {args.launches} launches of 256-thread blocks; "
          f"µs a launch (median of 30 replays)")
    print(f"{'blocks':>7}  {'plain':>8}  {'dependent':>9}")
    rows = []
    for grid in grids:
        plain = chain_us(fn, grid, args.launches, False)
        dep = chain_us(fn, grid, args.launches, True) if dependent_ok else None
        rows.append({"blocks": grid, "plain_us": plain, "dependent_us": dep})
        dep_text = f"{dep:9.2f}" if dep is not None else f"{'n/a':>9}"
        print(f"{grid:7d}  {plain:8.2f}  {dep_text}", flush=True)
    if not dependent_ok:
        print("dependent launches: not on this GPU or turned off (CUPOOL_DEPENDENT_LAUNCH=0)")
    if args.json:
        save("profile_chain", {"launches": args.launches, "sms": sms, "rows": rows}, args.json)


if __name__ == "__main__":
    sys.exit(run(main, build_parser()))
