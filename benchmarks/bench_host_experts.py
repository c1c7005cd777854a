"""Experts computed on the host's CPU (`cupool.hostexperts.HostExperts`) against what the machine's
memory and, where there is a GPU, its PCIe link allow.

A store of `--experts` Qwen3-30B-A3B-shaped rows (8 random experts tiled, so the rows are real
NVFP4 and the store is larger than the CPU's caches) in pinned memory when a GPU is present (as
the pool keeps them), else ordinary memory. Each case calls the pool with T tokens routed to the
same `rows` distinct rows (different rows every call, round robin through the store) and reports
the median wall time of a call (timed in C), the rows' bytes over that time, and:
- the host memory read rate of the same threads over a 1 GiB buffer (`HostExperts.read`), as a
  ratio of which the call reaches;
- with a GPU: one pinned host-to-device copy (1 GiB) and what a row takes on that link, the time
  the CPU path must beat for a miss to be worth computing on the host.

    python benchmarks/bench_host_experts.py                  # writes results/bench_host_experts.json
    python benchmarks/bench_host_experts.py --threads 1 4 --tokens 1 --rows 1
    python benchmarks/bench_host_experts.py --busy 2   # beside 2 processes that keep a CPU busy

`--busy N` times the cases while N other processes spin on the CPU (as a serving process's other
threads may: the Python thread launching GPU work, the mailbox's server): a call then waits on any
thread of its pool the OS does not run. `--link-busy` (with a GPU) times them while pinned host
memory is copied to the GPU without a pause (16 MiB copies on a stream of their own, as a decode
step's row copies read the host's memory beside the host's threads); each case then also
reports the rate those copies kept (`link_GBps_during`, 16 MiB copies counted as they complete),
beside the pinned copy's rate measured alone before.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import subprocess
import sys
import threading
import time

import numpy as np
import torch

from _common import pcie_h2d_GBps, reduced_by, results_path, save

from cupool.cli import CLIParser, bounded_int, output_file, positive_int, run
from cupool.hostexperts import ISA_BUILDS, HostExperts, cpu_name, default_threads
from cupool.layout import RowLayout
from cupool.store import HostStore
from cupool.synthetic import random_experts


def build_parser() -> CLIParser:
    p = CLIParser(prog="bench_host_experts.py", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=bounded_int(16, multiple_of=16), default=2048)
    p.add_argument("--intermediate", type=bounded_int(16, multiple_of=16), default=768)
    p.add_argument("--experts", type=bounded_int(8), default=192, help="rows in the store "
                   "(default 192: about 490 MB at the default shape, past any CPU's last-level "
                   "cache)")
    p.add_argument("--threads", type=bounded_int(1, 1024), nargs="+", default=None,
                   help="thread counts (default: 1, 2, 4, 8 up to the default and the default, "
                        "default_threads())")
    p.add_argument("--tokens", type=positive_int, nargs="+", default=[1, 8])
    p.add_argument("--rows", type=positive_int, nargs="+", default=[1, 2, 4])
    p.add_argument("--calls", type=positive_int, default=200, help="timed calls a case")
    p.add_argument("--isa", nargs="+", choices=sorted(ISA_BUILDS), default=["native", "avx2"],
                   help="builds (HostExperts' isa); one whose loop another already used is "
                        "skipped (avx2 where the CPU has no AVX-512)")
    p.add_argument("--busy", type=bounded_int(0, 1024), default=0, metavar="N",
                   help="processes that spin on the CPU while the cases are timed (default 0)")
    p.add_argument("--link-busy", action="store_true",
                   help="with a GPU: pinned host -> GPU copies running while the cases are timed")
    p.add_argument("--json", type=output_file, metavar="PATH")
    return p


class LinkLoad:
    """Pinned host -> GPU copies, 16 MiB at a time over a 1 GiB buffer, two in flight on a stream
    of their own, from a thread, while `running()` is entered; `GBps()` is the rate they kept
    since the last call (counted as each copy completes: at 55 GB/s a copy is ~0.3 ms, so a case
    of a few ms sees its window's rate within a few percent). The thread waits on blocking
    events, so it keeps no CPU busy."""

    def __init__(self, nbytes: int = 1 << 30, chunk: int = 16 << 20):
        self.src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        self.dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.chunk, self.chunks = chunk, nbytes // chunk
        self.stream = torch.cuda.Stream()
        self.copied = 0                  # bytes, only ever added to (by the thread)
        self._mark = (0, time.perf_counter())
        self._stop = threading.Event()

    def _loop(self):
        c, i, flight = self.chunk, 0, collections.deque()
        with torch.cuda.stream(self.stream):
            while not self._stop.is_set():
                self.dst[i * c:(i + 1) * c].copy_(self.src[i * c:(i + 1) * c], non_blocking=True)
                done = torch.cuda.Event(blocking=True)
                done.record(self.stream)
                flight.append(done)
                i = (i + 1) % self.chunks
                if len(flight) > 2:
                    flight.popleft().synchronize()
                    self.copied += c
            while flight:
                flight.popleft().synchronize()
                self.copied += c

    def GBps(self) -> float:
        copied, now = self.copied, time.perf_counter()
        rate = (copied - self._mark[0]) / (now - self._mark[1]) / 1e9
        self._mark = (copied, now)
        return rate

    @contextlib.contextmanager
    def running(self):
        t = threading.Thread(target=self._loop, name="link-load", daemon=True)
        self._stop.clear()
        t.start()
        try:
            yield self
        finally:
            self._stop.set()
            t.join()


@contextlib.contextmanager
def busy_processes(n: int):
    """`n` processes that keep a CPU each busy until the block ends."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for q in procs:
            q.kill()
        for q in procs:
            q.wait()


def time_cases(args, table, layout, threads, probe, x_all, link,
               load: LinkLoad | None = None) -> list[dict]:
    """Every (build, threads, tokens, rows) case timed and printed, a dict each (with `load`,
    the copies' rate during each case too)."""
    cases = []
    busy = f", {args.busy} busy processes beside it" if args.busy else ""
    print(f"{cpu_name()}{busy}; rows of {layout.row_bytes / 2**20:.2f} MiB (H={args.hidden}, "
          f"I={args.intermediate})")
    print(f"{'loop':>8} {'threads':>7} {'tokens':>6} {'rows':>4} {'us/call':>9} {'us/row':>8} {'GB/s':>7} "
          f"{'read GB/s':>9} {'ratio':>6}" + (f" {'vs link':>8}" if link else ""))
    runs = []
    for isa in args.isa:
        for th in threads:
            runs.append((isa, th))
    seen = set()
    for isa, th in runs:
        with HostExperts(table, layout, threads=th, isa=isa) as hx:
            if (hx.isa, th) in seen:
                continue
            seen.add((hx.isa, th))
            read_ns = min(hx.read(probe) for _ in range(3))
            read_GBps = probe.size / read_ns
            for T in args.tokens:
                x = x_all[:T].contiguous()
                for n in args.rows:
                    times = []
                    first = 0
                    if load is not None:
                        load.GBps()                     # the rate from here
                    for c in range(args.calls + 10):
                        keys = ((first + torch.arange(n)) % args.experts).repeat(T, 1).contiguous()
                        first = (first + n) % args.experts
                        w = torch.full((T, n), 1.0 / n)
                        ns = hx.timed(x, keys, w, 1)[0]
                        if c >= 10:
                            times.append(ns)
                    us = statistics.median(times) / 1e3
                    gbps = n * layout.row_bytes / us / 1e3
                    row = {"threads": th, "tokens": T, "rows": n, "us_per_call": round(us, 2),
                           "us_per_row": round(us / n, 2), "rows_GBps": round(gbps, 2),
                           "read_GBps": round(read_GBps, 2),
                           "of_read": round(gbps / read_GBps, 3), "isa": hx.isa}
                    line = (f"{hx.isa:>8} {th:>7} {T:>6} {n:>4} {us:>9.1f} {us / n:>8.1f} {gbps:>7.2f} "
                            f"{read_GBps:>9.1f} {gbps / read_GBps:>6.2f}")
                    if link:
                        link_us = n * layout.row_bytes / link / 1e3
                        row["link_us"] = round(link_us, 2)
                        row["of_link_time"] = round(us / link_us, 3)
                        line += f" {us / link_us:>7.2f}x"
                    if load is not None:
                        row["link_GBps_during"] = round(load.GBps(), 2)
                        line += f"  (copies at {row['link_GBps_during']:.1f} GB/s meanwhile)"
                    print(line, flush=True)
                    cases.append(row)
    return cases


def main(args) -> int:
    p = build_parser()
    if max(args.rows) > args.experts:
        raise ValueError(f"--rows {max(args.rows)} is more than the store's --experts "
                         f"{args.experts}")
    if args.link_busy and not torch.cuda.is_available():
        raise ValueError("--link-busy needs a GPU (the copies go to it)")

    dflt = default_threads()
    threads = args.threads or sorted({t for t in (1, 2, 4, 8) if t < dflt} | {dflt})
    layout = RowLayout(args.hidden, args.intermediate)
    gpu = torch.cuda.is_available()
    gen = torch.Generator().manual_seed(0)
    base, _ = random_experts(layout, 8, gen)
    store = HostStore(1, args.experts, layout.row_bytes, pinned=gpu)
    store.fill(lambda _l: base.repeat((args.experts + 7) // 8, 1)[:args.experts], progress=False)
    store.seal()
    table = store.host_addresses()
    link = None
    if gpu:
        link = pcie_h2d_GBps()
        print(f"pinned host -> device copy {link:.1f} GB/s: {layout.row_bytes / link / 1e3:.1f} "
              f"us a row of {layout.row_bytes / 2**20:.2f} MiB")
    probe = np.ones(1 << 30, dtype=np.uint8)
    x_all = torch.randn(max(args.tokens), args.hidden, generator=gen)

    load = LinkLoad() if args.link_busy else None
    alone = None
    with busy_processes(args.busy), (load.running() if load else contextlib.nullcontext()):
        if load is not None:             # the copies' own rate, the host's threads idle
            time.sleep(0.2)
            load.GBps()
            time.sleep(0.5)
            alone = load.GBps()
            print(f"link load alone: {alone:.1f} GB/s")
        cases = time_cases(args, table, layout, threads, probe, x_all, link, load)
    store.close()
    reduced = reduced_by(args, p, "experts", "tokens", "rows", "calls", "isa")
    if args.threads is not None:
        reduced.append("--threads")
    if args.busy:
        reduced.append(f"--busy {args.busy}")
    if args.link_busy:
        reduced.append("--link-busy")
    save("bench_host_experts", {
        **({} if gpu else {"gpu": "none (a run on a machine without a GPU: no link figures)"}),
        "cpu": cpu_name(), "default_threads": dflt, "hidden": args.hidden,
        "intermediate": args.intermediate, "row_bytes": layout.row_bytes,
        "store_rows": args.experts, "busy_processes": args.busy,
        "link_busy": args.link_busy, "link_GBps_alone": alone, "pinned_store": gpu,
        "pcie_h2d_GBps": link, "cases": cases,
    }, results_path("bench_host_experts", args.json, reduced))
    return 0


if __name__ == "__main__":
    sys.exit(run(main, build_parser()))
