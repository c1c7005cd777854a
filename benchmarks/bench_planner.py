"""Plan-step time per layer call inside a CUDA graph, and row-copy bandwidth against cudaMemcpy.

Plan step: L layers (48), N rows per layer (256, so R = 12288), K = 8, W = 8 and 64 lanes (W/K
tokens, each with K distinct uniformly random experts, so misses happen when N < E), for each E
of --experts. A CUDA graph holds --calls layer calls (layer c mod L); before each replay fresh ids
are written into the captured input buffer (untimed); the replay is timed with CUDA events, the
median of --replays replays is divided by --calls. Timed: the plan kernel alone with the gate open
(the target, <= 5 us), plan + copy with the gate open, the plan kernel with the gate closed, and an
empty kernel in the same graph shape (the floor a graph node costs). Rows are 256 bytes: the plan
step never reads rows, and the copy of so small a row costs its launch.

Copy bandwidth: rows of 2 ... 10 MiB, a small bank (N = --copy-rows per layer, 2 layers) and W =
--copy-misses distinct random experts per call, so nearly every lane misses. Each call (plan +
copy) is timed alone with CUDA events (eagerly: it includes the host's launch latency) and its
bytes are n_copies x row_bytes, read afterwards. The copy kernel alone (the Bank's, the target) is
timed as in decode, inside a CUDA graph: --copy-graph launches, each on its own list of
--copy-misses random rows. Both as GB/s and as a ratio to a 1 GiB pinned cudaMemcpyAsync measured
in the same run (target >= 0.9). --copy-sweep times more grids of the SM-load kernel (RowCopier
mode "ld") and --bulk-sweep grids and buffer rings of the bulk-copy kernel (mode "bulk", sm_90+)
the same way.

Writes benchmarks/results/bench_planner.json (a run that skips a part, or times fewer layers, E,
lanes, row sizes, calls or replays than the defaults, writes nothing unless --json PATH is given).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np
import torch
from _common import capture, pcie_h2d_GBps, reduced_by, results_path, save, time_ms

from cupool import HostStore, _cuda, kernels
from cupool.bank import Bank
from cupool.cli import (
    CLIParser,
    bounded_int,
    fields,
    nonnegative_int,
    output_file,
    positive_float,
    positive_int,
    run,
)
from cupool.ops.planner import MAX_LANES, launch_shape
from cupool.ops.rowcopy import RowCopier


def routing(rng, E: int, K: int, W: int, shape: tuple) -> np.ndarray:
    """int64 [*shape, W]: W/K tokens, each with K distinct experts (what a top-k router yields)."""
    T = W // K
    picks = np.argsort(rng.random((*shape, T, E)), axis=-1)[..., :K]
    return picks.reshape(*shape, T * K).astype(np.int64)


def bench_plan(args, rng) -> list[dict]:
    L, N, K = args.layers, args.rows_per_layer, args.top_k
    lanes = max(args.lanes)
    results = []
    empty = kernels.function("selftest", "axpb")
    x = torch.zeros(32, device="cuda")
    b0 = torch.zeros(1, device="cuda")
    y = torch.zeros(32, device="cuda")
    g_empty = capture(lambda c: kernels.launch(empty, 1, 32, (x, b0, y, kernels.f32(1.0),
                                                              kernels.i32(32))), args.calls)
    floor_us = time_ms(g_empty.replay, warmup=10, iters=args.replays) * 1e3 / args.calls
    print(f"graph floor: an empty kernel costs {floor_us:.2f} us per node")
    for E in args.experts:
        store = HostStore(L, E, 256)
        for threads in args.threads:
            R = L * N
            # an explicit block keeps the default's ring entries a thread per tile
            shape = {"threads": threads, "items": launch_shape(R, lanes)[1]} if threads else {}
            bank = Bank(store, N, staging_rows=lanes, max_lanes=lanes, **shape)
            t, i = bank.plan_block
            for W in args.lanes:
                pool = torch.from_numpy(routing(rng, E, K, W, (args.pools, args.calls))).cuda()
                ids_buf = torch.full((args.calls, W), -1, dtype=torch.int64, device="cuda")
                state = {"i": 0}

                def rotate():
                    ids_buf.copy_(pool[state["i"] % args.pools])
                    state["i"] += 1

                g_plan = capture(lambda c: bank.plan(c % L, ids_buf[c]), args.calls)
                g_step = capture(lambda c: bank.step(c % L, ids_buf[c]), args.calls)
                bank.open(verify=False)
                for _ in range(args.settle):           # reach the steady state of the LRU
                    rotate()
                    g_step.replay()
                row = {"E": E, "N": N, "L": L, "K": K, "W": W, "R": R, "threads": t, "items": i,
                       "calls_per_graph": args.calls, "graph_floor_us": floor_us}
                for name, g in (("plan_us", g_plan), ("plan_copy_us", g_step)):
                    bank.reset_stats()
                    ms = time_ms(g.replay, warmup=5, iters=args.replays, setup=rotate)
                    row[name] = ms * 1e3 / args.calls
                    rows, _ = bank.stats()
                    hits, misses = (sum(d[k] for d in rows) for k in ("hits", "misses"))
                    row[name.replace("_us", "_hit_rate")] = hits / max(1, hits + misses)
                    row[name.replace("_us", "_misses_per_call")] = misses / max(1, (
                        args.replays + 5) * args.calls)
                bank.close()
                row["plan_closed_us"] = time_ms(g_plan.replay, warmup=5, iters=args.replays,
                                                setup=rotate) * 1e3 / args.calls
                assert int(bank.error.item()) == 0, f"planner error flags {bank.read_error()}"
                bank.verify(sample=256)
                results.append(row)
                print(f"E={E:4d} W={W:3d} block {t}x{i}: plan {row['plan_us']:.2f} us/call "
                      f"(hit rate {row['plan_hit_rate']:.3f}, {row['plan_misses_per_call']:.1f} "
                      f"misses/call), plan+copy {row['plan_copy_us']:.2f} us, gate closed "
                      f"{row['plan_closed_us']:.2f} us")
                del g_plan, g_step
            bank = None
        store.close()
    return results


def verify_staging(bank, store, E: int, M: int, row: int) -> None:
    """The staging rows hold the host rows of the keys listed in bank.copies (byte for byte)."""
    keys = bank.copies[:M, 0].cpu().numpy()
    got = bank.rows[bank.num_rows:bank.num_rows + M, :row].cpu().numpy()
    for j, k in enumerate(keys):
        if not np.array_equal(got[j], store.row(int(k) // E, int(k) % E)):
            raise AssertionError(f"staging row {j} differs from the host row of key {k}")


def bench_copy(args, rng, ref_GBps: float) -> list[dict]:
    results = []
    M, L = args.copy_misses, 2
    for mib in args.row_mib:
        row = int(mib * (1 << 20))
        E = max(4 * M, int(args.store_gib * (1 << 30)) // row // L)
        store = HostStore(L, E, row)
        for layer in range(L):                         # cheap non-zero content
            for e in range(E):
                store.row(layer, e)[::4096] = (layer * E + e) & 255
        store.seal()
        bank = Bank(store, args.copy_rows, staging_rows=M, max_lanes=M)
        bank.open(verify=False)
        ids_buf = torch.empty(M, dtype=torch.int64, device="cuda")
        pool = torch.from_numpy(routing(rng, E, M, M, (args.copy_iters + 5,))).cuda()
        times, moved = [], []
        for it in range(args.copy_iters + 5):
            ids_buf.copy_(pool[it])
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            bank.step(it % L, ids_buf)
            b.record()
            b.synchronize()
            if it >= 5:                                # the first calls compile and warm up
                times.append(a.elapsed_time(b))
                moved.append(int(bank.n_copies.item()) * row)
        step_GBps = sum(moved) / sum(times) / 1e6
        per_call = [m / t / 1e6 for m, t in zip(moved, times) if m]

        # The copy kernels alone, inside a CUDA graph (as in decode): --copy-graph launches, each
        # on its own list of M random keys into the staging rows, so no row is read twice in a
        # replay (the L2 could serve a repeat). An eagerly timed launch would also count the
        # host's launch latency, tens of microseconds next to a 2 MiB row's 40.
        reps = args.copy_graph
        lists = torch.zeros(reps, M, 2, dtype=torch.int32, device="cuda")
        lists[:, :, 1] = torch.arange(bank.num_rows, bank.num_rows + M, dtype=torch.int32)
        counts = torch.full((reps, 1), M, dtype=torch.int32, device="cuda")

        def pick():
            k = rng.choice(L * E, size=reps * M, replace=False).astype(np.int32)
            lists[:, :, 0].copy_(torch.from_numpy(k.reshape(reps, M)))

        def graph_GBps(copier) -> float:
            pick()
            g = capture(lambda c: copier(lists[c], counts[c]), reps)
            ms = time_ms(g.replay, warmup=3, iters=args.copy_iters, setup=pick)
            return reps * M * row / ms / 1e6

        copy_GBps = graph_GBps(bank.copier)
        # the last replay's rows must be in the staging rows
        bank.copies.copy_(lists[-1])
        bank.n_copies.copy_(counts[-1])
        verify_staging(bank, store, E, M, row)
        # the same M rows moved by M cudaMemcpyAsync calls (the copy engine on this row size)
        host_rows = [store.row(k // E, k % E) for k in range(M)]
        dst_rows = [bank.rows[bank.num_rows + j, :row] for j in range(M)]
        memcpy_ms = time_ms(lambda: [d.copy_(torch.from_numpy(h), non_blocking=True)
                                     for d, h in zip(dst_rows, host_rows)],
                            warmup=3, iters=args.copy_iters)
        memcpy_rows_GBps = M * row / memcpy_ms / 1e6
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        sweep = []
        for blocks_per_sm, threads, unroll in (args.copy_sweep or []):
            copier = RowCopier(bank.src_of_key, row, bank.rows, M, unroll=int(unroll),
                               threads=int(threads), blocks=max(1, round(blocks_per_sm * sms)))
            g = graph_GBps(copier)
            sweep.append({"blocks_per_sm": blocks_per_sm, "threads": threads, "unroll": unroll,
                          "GBps": g, "ratio": g / ref_GBps})
            print(f"   ld sweep {blocks_per_sm:g} blocks/SM x {threads:g} threads, unroll "
                  f"{unroll:g}: {g:6.1f} GB/s ({g / ref_GBps:.2f})", flush=True)
        bulk = []
        for blocks_per_sm, chunk_kib, stages in (args.bulk_sweep or []):
            copier = RowCopier(bank.src_of_key, row, bank.rows, M, mode="bulk",
                               chunk=int(chunk_kib) << 10, stages=int(stages),
                               blocks=max(1, round(blocks_per_sm * sms)))
            g = graph_GBps(copier)
            bulk.append({"blocks_per_sm": blocks_per_sm, "chunk_KiB": chunk_kib, "stages": stages,
                         "GBps": g, "ratio": g / ref_GBps})
            print(f"   bulk sweep {blocks_per_sm:g} blocks/SM, {stages:g} x {chunk_kib:g} KiB "
                  f"buffers: {g:6.1f} GB/s ({g / ref_GBps:.2f})", flush=True)
        bank.copies.copy_(lists[-1])
        verify_staging(bank, store, E, M, row)
        r = {"row_MiB": mib, "row_bytes": row, "store_bytes": store.nbytes, "misses_per_call":
             sum(moved) / row / len(moved), "step_GBps": step_GBps, "step_ratio": step_GBps / ref_GBps,
             "step_GBps_median_call": statistics.median(per_call) if per_call else 0.0,
             "copy_kernel_GBps": copy_GBps, "copy_kernel_ratio": copy_GBps / ref_GBps,
             "copy_grid": bank.copy_grid, "copy_mode": bank.copy_mode,
             "copy_graph_launches": reps, "memcpy_same_rows_GBps": memcpy_rows_GBps,
             "copy_kernel_over_memcpy_same_rows": copy_GBps / memcpy_rows_GBps, "copy_sweep": sweep,
             "bulk_sweep": bulk}
        results.append(r)
        print(f"{mib:4.1f} MiB rows: plan+copy {step_GBps:6.1f} GB/s ({r['step_ratio']:.2f} of "
              f"memcpy, {r['misses_per_call']:.1f} copies/call, eager); {bank.copy_mode} copy "
              f"kernel alone, in a graph "
              f"{copy_GBps:6.1f} GB/s ({r['copy_kernel_ratio']:.2f}); {M} cudaMemcpyAsync of "
              f"these rows {memcpy_rows_GBps:6.1f} GB/s")
        bank.close()
        bank = None
        store.close()
        torch.cuda.empty_cache()
    return results


def build_parser() -> CLIParser:
    p = CLIParser(prog="bench_planner.py", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=positive_int, default=48, help="L (>= 1)")
    p.add_argument("--rows-per-layer", type=positive_int, default=256, help="N (>= 1)")
    p.add_argument("--experts", type=positive_int, nargs="+", default=[128, 512],
                   help="E (>= --top-k); with E <= N every expert is resident (hit rate 1)")
    p.add_argument("--top-k", type=positive_int, default=8, help="K (>= 1)")
    p.add_argument("--lanes", type=bounded_int(1, MAX_LANES), nargs="+", default=[8, 64],
                   help=f"W, lanes a call (multiples of --top-k, at most {MAX_LANES})")
    p.add_argument("--threads", type=nonnegative_int, nargs="+", default=[0],
                   help="plan-step block sizes to time (0: the default %s)" %
                        (launch_shape(48 * 256, 64),))
    p.add_argument("--calls", type=positive_int, default=48, help="layer calls per graph (>= 1)")
    p.add_argument("--replays", type=positive_int, default=200, help="timed replays (>= 1)")
    p.add_argument("--settle", type=nonnegative_int, default=50,
                   help="untimed replays before timing (>= 0)")
    p.add_argument("--pools", type=positive_int, default=16,
                   help="distinct id sets rotated through (>= 1)")
    p.add_argument("--row-mib", type=positive_float, nargs="+", default=[2, 4, 6, 8, 10],
                   help="row sizes of the copy part, MiB (> 0, whole multiples of 16 bytes)")
    p.add_argument("--copy-misses", type=bounded_int(1, MAX_LANES), default=8,
                   help=f"distinct experts a copy call (in [1, {MAX_LANES}])")
    p.add_argument("--copy-rows", type=positive_int, default=8,
                   help="bank rows per layer (copy part; >= 1)")
    p.add_argument("--copy-iters", type=positive_int, default=40, help="timed copy calls (>= 1)")
    p.add_argument("--store-gib", type=positive_float, default=1.0,
                   help="host store size (copy part), GiB (> 0)")
    p.add_argument("--copy-graph", type=positive_int, default=4,
                   help="copy launches (each on its own list) per timed graph replay (>= 1)")
    p.add_argument("--copy-sweep", nargs="+", metavar="BLOCKS_PER_SM,THREADS,UNROLL",
                   type=fields(BLOCKS_PER_SM=positive_float, THREADS=positive_int,
                               UNROLL=positive_int),
                   help="also time RowCopier(mode='ld') with these grids (BLOCKS_PER_SM may be a "
                        "fraction: 0.25 = a quarter of the SMs)")
    p.add_argument("--bulk-sweep", nargs="+", metavar="BLOCKS_PER_SM,CHUNK_KIB,STAGES",
                   type=fields(BLOCKS_PER_SM=positive_float, CHUNK_KIB=positive_int,
                               STAGES=positive_int),
                   help="also time RowCopier(mode='bulk') (sm_90+) with these grids and rings")
    skip = p.add_mutually_exclusive_group()
    skip.add_argument("--skip-plan", action="store_true")
    skip.add_argument("--skip-copy", action="store_true")
    p.add_argument("--json", type=output_file, metavar="PATH",
                   help="write the results here (default: benchmarks/results/bench_planner.json, "
                        "for a full run only)")
    return p


def check(args) -> None:
    """What the types cannot see: top-k routing needs E >= K and whole tokens of K lanes, and a
    copied row is a whole number of 16-byte units."""
    K = args.top_k
    if min(args.experts) < K:
        raise ValueError(f"--experts {min(args.experts)}: top-{K} routing needs E >= --top-k {K}")
    for W in args.lanes:
        if W % K:
            raise ValueError(f"--lanes {W}: must be a multiple of --top-k {K} (tokens of K lanes)")
    for mib in args.row_mib:
        if int(mib * (1 << 20)) % 16:
            raise ValueError(f"--row-mib {mib:g}: a row must be a multiple of 16 bytes, got "
                             f"{int(mib * (1 << 20))}")


def reduced(args) -> list[str]:
    """How this run is smaller than the default one (then it writes no canonical file)."""
    return reduced_by(args, build_parser(), "layers", "experts", "lanes", "calls", "replays",
                      "row_mib", "copy_iters", "store_gib", "skip_plan", "skip_copy")


def main(args) -> None:
    check(args)
    _cuda.require_gpu("the planner benchmark")
    out = results_path("bench_planner", args.json, reduced(args))
    rng = np.random.default_rng(0)
    payload = {"args": {k: v for k, v in vars(args).items() if k != "json"}}
    if not args.skip_plan:
        payload["plan"] = bench_plan(args, rng)
    if not args.skip_copy:
        ref = pcie_h2d_GBps(1 << 30)
        print(f"cudaMemcpy pinned H2D 1 GiB: {ref:.1f} GB/s")
        payload["memcpy_h2d_1GiB_GBps"] = ref
        payload["copy"] = bench_copy(args, rng, ref)
    save("bench_planner", payload, out)


if __name__ == "__main__":
    sys.exit(run(main, build_parser()))
