"""Host → device read bandwidth of host-store rows: a UVA kernel vs cudaMemcpy, per row size.

For each row size, a store of about `--store-gib` GiB is filled and sealed; each timed call moves
`--rows` distinct random rows (a fresh set every call, so nothing is served from L2) either with one
launch of the row-copy kernel (UVA reads) or with one cudaMemcpyAsync per row. Both are reported as
GB/s and as a ratio to a 1 GiB cudaMemcpyAsync measured in the same run.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from _common import pcie_h2d_GBps, save, time_ms

from cupool import HostStore, _cuda
from cupool.ops.rowcopy import RowCopier

SIZES = ["64KiB", "256KiB", "1MiB", "2MiB", "4MiB", "8MiB", "16MiB"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sizes", nargs="+", default=SIZES)
    p.add_argument("--rows", type=int, default=32, help="rows moved per timed call")
    p.add_argument("--store-gib", type=float, default=1.0)
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args(argv)
    from cupool import parse_bytes
    cp = _cuda.cupy()
    ref = pcie_h2d_GBps(1 << 30)
    print(f"cudaMemcpy pinned H2D 1 GiB: {ref:.1f} GB/s")
    rng = np.random.default_rng(0)
    results = []
    for size in args.sizes:
        row = parse_bytes(size)
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
        results.append({"row_bytes": row, "row": size, "rows_per_call": args.rows,
                        "uva_kernel_GBps": uva, "uva_ratio": uva / ref,
                        "memcpy_per_row_GBps": mc, "memcpy_ratio": mc / ref})
        print(f"{size:>7}: UVA kernel {uva:6.1f} GB/s ({uva / ref:.2f} of 1 GiB memcpy)   "
              f"memcpy per row {mc:6.1f} GB/s ({mc / ref:.2f})")
        store.close()
    save("bench_store", {"memcpy_h2d_1GiB_GBps": ref, "copy_kernel_blocks": copier.blocks,
                         "results": results})


if __name__ == "__main__":
    main()
