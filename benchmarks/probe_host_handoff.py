"""What handing a step's experts to the host's CPU costs inside a captured CUDA graph
(rawkernels/host_handoff.cu + HostExperts.serve), printed, with --json a file.

A graph of 48 hand-offs (one a layer of the Qwen3-30B-A3B shape, batch 1: post x and the layer's
keys, wait for the host's answer) replayed after warm-up; each layer asks for `n` experts that no
other layer in the graph uses (n = 0: keys all -1, which posts nothing: what a decode call that
hands nothing over pays, two small kernels and no round trip).
Beside it, the same calls made on the host directly (HostExperts.timed, no GPU), so the
difference is what the round trip through the mailbox adds; and what the n rows would take on
the PCIe link (one pinned copy measured in the same run).

    python benchmarks/probe_host_handoff.py [--experts-per-layer 0 1 2 4] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from _common import gpu_name, pcie_h2d_GBps

from cupool import _cuda
from cupool.cli import CLIParser, bounded_int, nonnegative_int, output_file, positive_int, run
from cupool.hostexperts import HostExperts, Mailbox, cpu_name, default_threads
from cupool.layout import RowLayout
from cupool.ops import host_handoff
from cupool.store import HostStore
from cupool.synthetic import random_experts


def build_parser() -> CLIParser:
    p = CLIParser(prog="probe_host_handoff.py", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts-per-layer", type=nonnegative_int, nargs="+", default=[0, 1, 2, 4])
    p.add_argument("--layers", type=positive_int, default=48)
    p.add_argument("--threads", type=bounded_int(1, 1024), default=None)
    p.add_argument("--replays", type=positive_int, default=30)
    p.add_argument("--json", type=output_file, metavar="PATH")
    return p


def main(args) -> int:
    _cuda.require_gpu("the hand-off probe")
    H, I, L = 2048, 768, args.layers
    nmax = max(args.experts_per_layer)
    E = max(8, L * nmax)
    layout = RowLayout(H, I)
    gen = torch.Generator().manual_seed(0)
    base, _ = random_experts(layout, 8, gen)
    store = HostStore(1, E, layout.row_bytes)
    store.fill(lambda _l: base.repeat((E + 7) // 8, 1)[:E], progress=False)
    store.seal()
    link = pcie_h2d_GBps()
    threads = args.threads or default_threads()
    K = max(1, nmax)
    mb = Mailbox(1, K, H)
    x = torch.randn(1, H, generator=gen).to(torch.bfloat16).cuda()
    y = torch.zeros(1, H, dtype=torch.float32, device="cuda")
    error = torch.zeros(1, dtype=torch.int32, device="cuda")
    results = []
    print(f"{gpu_name()}; {cpu_name()}, {threads} threads; pinned copy {link:.1f} GB/s")
    print(f"{'experts':>7} {'us a hand-off':>13} {'host alone us':>13} {'added us':>9} "
          f"{'link us':>8}")
    with HostExperts(store.host_addresses(), layout, threads=threads) as hx:
        for n in args.experts_per_layer:
            keys = torch.full((L, 1, K), -1, dtype=torch.int64)
            for layer in range(L):
                keys[layer, 0, :n] = torch.arange(layer * n, layer * n + n)
            w = torch.full((L, 1, K), 1.0 / max(n, 1))
            # the host alone: the same calls back to back, timed in C
            host = []
            for _ in range(3):
                for layer in range(L):
                    host.append(hx.timed(x.float().cpu(), keys[layer].contiguous(),
                                         w[layer].contiguous(), 1)[0])
            host_us = statistics.median(host[L:]) / 1e3
            kd, wd = keys.cuda(), w.cuda()
            hx.serve(mb)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                host_handoff.post(x, kd[0], wd[0], mb)
                host_handoff.wait(mb, y, error)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for layer in range(L):
                    host_handoff.post(x, kd[layer], wd[layer], mb)
                    host_handoff.wait(mb, y, error)
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
            times = []
            for _ in range(args.replays):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                graph.replay()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) * 1e3 / L)
            served = hx.stop_serving()
            if int(error):
                raise RuntimeError(f"a hand-off stalled (error word {int(error)})")
            us = statistics.median(times)
            link_us = n * layout.row_bytes / link / 1e3
            print(f"{n:>7} {us:>13.1f} {host_us:>13.1f} {us - host_us:>9.1f} {link_us:>8.1f}",
                  flush=True)
            results.append({"experts": n, "us_per_handoff": round(us, 2),
                            "host_alone_us": round(host_us, 2),
                            "added_us": round(us - host_us, 2), "link_us": round(link_us, 2),
                            "served": served})
            del graph
    mb.close()
    store.close()
    if args.json:
        payload = {"benchmark": "probe_host_handoff", "gpu": gpu_name(), "cpu": cpu_name(),
                   "threads": threads, "pcie_h2d_GBps": link, "layers": L, "results": results}
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(run(main, build_parser()))
