"""Host → device read bandwidth of host-store rows: a UVA kernel vs cudaMemcpy, per row size.

For each row size, a store of about `--store-gib` GiB is filled and sealed; each timed call moves
`--rows` distinct random rows (a fresh set every call, so nothing is served from L2) either with one
launch of the row-copy kernel (UVA reads) or with one cudaMemcpyAsync per row. Both are reported as
GB/s and as a ratio to a 1 GiB cudaMemcpyAsync measured in the same run.

Writes benchmarks/results/bench_store.json (a run with fewer sizes, iterations or a smaller store
than the defaults writes nothing unless --json PATH is given).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch
from _common import pcie_h2d_GBps, reduced_by, results_path, save, time_ms

from cupool import HostStore, _cuda
from cupool.cli import CLIParser, output_file, positive_float, positive_int, run, size
from cupool.ops.rowcopy import RowCopier

SIZES = ["64KiB", "256KiB", "1MiB", "2MiB", "4MiB", "8MiB", "16MiB"]


def row_size(text: str) -> int:
    """A row size ('2MiB', '65536'): positive and a multiple of 16 bytes (the copy unit)."""
    n = size(text)
    if n % 16:
        raise argparse.ArgumentTypeError(f"{text}: a row must be a multiple of 16 bytes, got {n}")
    return n


def label(n: int) -> str:
    """65536 -> '64KiB', 2097152 -> '2MiB' (the sizes' names in the results)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return f"{n}B"


def build_parser() -> CLIParser:
    p = CLIParser(prog="bench_store.py", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", type=row_size, default=[row_size(s) for s in SIZES],
                   metavar="SIZE", help="row sizes, e.g. 64KiB 2MiB (multiples of 16 bytes; "
                   "default %s)" % " ".join(SIZES))
    p.add_argument("--rows", type=positive_int, default=32, help="rows moved per timed call (>= 1)")
    p.add_argument("--store-gib", type=positive_float, default=1.0,
                   help="host store size a row size, GiB (> 0)")
    p.add_argument("--iters", type=positive_int, default=30, help="timed calls (>= 1)")
    p.add_argument("--json", type=output_file, metavar="PATH",
                   help="write the results here (default: benchmarks/results/bench_store.json, "
                        "for a full run only)")
    return p


def reduced(args) -> list[str]:
    """How this run is smaller than the default one (then it writes no canonical file)."""
    return reduced_by(args, build_parser(), "sizes", "iters", "store_gib")


def main(args) -> None:
    _cuda.require_gpu("the host-store read benchmark")
    out = results_path("bench_store", args.json, reduced(args))
    cp = _cuda.cupy()
    ref = pcie_h2d_GBps(1 << 30)
    print(f"cudaMemcpy pinned H2D 1 GiB: {ref:.1f} GB/s")
    rng = np.random.default_rng(0)
    results = []
    for row in args.sizes:
        name = label(row)
        n_rows = max(args.rows * 4, int(args.store_gib * (1 << 30)) // row)
        store = HostStore(1, n_rows, row)
        store.fill(lambda _l: None, progress=False)
        for e in range(n_rows):                       # cheap non-zero content
            store.row(0, e)[::4096] = e & 255
        store.seal()
        dst = torch.empty(args.rows, store.row_stride, dtype=torch.uint8, device="cuda")
        copier = RowCopier(store.address_table(), row, dst, max_copies=args.rows)
        copies = torch.zeros(args.rows, 2, dtype=torch.int32, device="cuda")
        copies[:, 1] = torch.arange(args.rows, dtype=torch.int32)
        count = torch.tensor([args.rows], dtype=torch.int32, device="cuda")
        addrs = store.addresses()
        state = {}

        def pick():
            keys = rng.choice(n_rows, size=args.rows, replace=False).astype(np.int32)
            copies[:, 0].copy_(torch.from_numpy(keys))
            state["keys"] = keys

        def memcpy_rows():
            stream = _cuda.current_stream()
            for i, k in enumerate(state["keys"]):
                cp.cuda.runtime.memcpyAsync(dst[i].data_ptr(), int(addrs[k]), row,
                                            cp.cuda.runtime.memcpyHostToDevice, stream.ptr)

        uva_ms = time_ms(lambda: copier(copies, count), iters=args.iters, setup=pick)
        mc_ms = time_ms(memcpy_rows, iters=args.iters, setup=pick)
        moved = args.rows * row
        uva, mc = moved / uva_ms / 1e6, moved / mc_ms / 1e6
        results.append({"row_bytes": row, "row": name, "rows_per_call": args.rows,
                        "uva_kernel_GBps": uva, "uva_ratio": uva / ref,
                        "memcpy_per_row_GBps": mc, "memcpy_ratio": mc / ref})
        print(f"{name:>7}: UVA kernel {uva:6.1f} GB/s ({uva / ref:.2f} of 1 GiB memcpy)   "
              f"memcpy per row {mc:6.1f} GB/s ({mc / ref:.2f})")
        store.close()
    save("bench_store", {"memcpy_h2d_1GiB_GBps": ref, "copy_kernel_blocks": copier.blocks,
                         "results": results}, out)


if __name__ == "__main__":
    sys.exit(run(main, build_parser()))
