"""Eviction policies and prefetch on routing traces, simulated on the CPU with the reference
planner (no GPU): the hit rates that decide what the kernel should implement.

Traces (48 layers, 128 experts, top-8, the Qwen3-30B-A3B shape; `--steps` decoded tokens after
`--warmup` tokens of warm-up): "uniform" (a random router), "locality" (the published
Qwen3-30B-A3B reuse, `cupool.trace.QWEN3_LOCALITY`) and "skewed" (less reuse, a Zipf-1.0
popularity: where frequency should matter most). Banks of 25/50/75% of each layer's experts.

- policies: LRU (the kernel's), LFRU at a few weights and half-lives, LFRU with recent rows
  protected (`cupool.reference.planner.Policy`); parameters in tokens (L = 48 clock ticks); and
  the offline optimum (`cupool.simulate.simulate_opt`: Belady's rule, which knows the trace's
  future), the ceiling of any eviction policy without prefetch;
- prefetch: LRU with layer l + 1's predicted ids prefetched right after layer l's step, as the
  pool does (`ReferencePlanner.prefetch`: a plan step of its own in which rows used at that tick
  or the one before are not eligible; layer 0 is not predicted), on the trace with predictions at
  60/80/95% accuracy (`cupool.trace.with_predictions`), every predicted row or at most 1 or 2 a
  prefetch (the Prefetcher's max_rows); beside the hit rate, rows prefetched / used / wasted
  (evicted before any use) a token. Prefetched rows count as hits: the bytes still
  cross PCIe, but ahead of the step that needs them, under the previous layer's compute;
- promote: several sequences decoded together (`cupool.trace.streams`: 1, 2, 4, 8, 16
  independent locality streams, one token each a step), LRU uncapped against LRU with at most N
  promotions a step (the other misses staged) for caps of a half … a sixteenth of a layer's rows,
  and the pool's default (`default_promote`: no cap while a step's lanes fit a layer's rows, a
  quarter of them past that); beside the hit rate, bank misses a layer call (what crosses PCIe).
  The rows of the table in docs/PERFORMANCE.md that justify the default.
- host: one locality stream with each layer call's misses split between the link and the host's
  CPU (`cupool.simulate.simulate_host_split`: the split that finishes first, the CPU after a
  hand-off), the CPU's rows either left out of the bank or promoted behind the call (deferred);
  for a few CPU times a row, on an H200's link and on a PCIe 4.0 one. Beside the hit rate, the
  rows a token waited for on each side, the misses' waited time, the link's busy time, and the
  decode rate that gives with the rest of the step as measured (REST_MS; the link's busy time
  when that is longer), and the rate a token laid out in time gives ("timeline": the link one
  queue, so behind copies still crossing delay later calls' copies, and the step waits at its
  end for the last behind copies, as the decode step joins them): estimates from measured
  parts, not measurements. Then the same split for 8 streams at a 50% bank on the H200's link
  ("host_streams"): per step, the misses' waited time and the link's busy time, the larger of
  which bounds the step's miss part (the rest of an 8-stream step is not modelled).

    python benchmarks/sim_policies.py                     # all four parts
    python benchmarks/sim_policies.py --parts promote     # only the promotion caps

Writes benchmarks/results/sim_policies.json (a reduced run: nothing unless --json).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from _common import reduced_by, results_path, save

from cupool import trace as tr
from cupool.cli import CLIParser, output_file, positive_int, run
from cupool.reference.planner import LRU, Policy, default_promote
from cupool.simulate import simulate, simulate_host_split, simulate_opt

L, E, K = 48, 128, 8
BANKS = (25, 50, 75)
PARTS = ("policies", "prefetch", "promote", "host")
STREAMS = (1, 2, 4, 8, 16)
CAP_DIVISORS = (2, 4, 8, 16)          # caps tried: rows per layer / these
PREFETCH_ROWS = (0, 1, 2)             # rows a prefetch may bring in (0: every predicted one)
OPT = "offline optimum (Belady)"
# host part: a row is 2,654,464 B (H=2048, I=768); the row-copy kernel moved 47.3 GB/s on an H200
# whose pinned copy moved 55.0 (0.86, docs/PERFORMANCE.md "What the link allows"); a PCIe 4.0
# link at about 25 GB/s, the same 0.86 of it
ROW_BYTES = 2_654_464
LINKS = {"H200 (47.3 GB/s)": 47.3, "PCIe 4.0 (0.86 of 25 GB/s)": 0.86 * 25.0}
CPU_US = (20.0, 30.0, 45.0, 66.0, 100.0)    # the host's time for one row (not yet measured there)
HANDOFF_US = 10.0                           # a hand-off's round trip (assumed until probed)
HOST_STREAMS = (8,)                         # host_streams: streams a step, CPU µs a row (66:
HOST_STREAMS_CPU_US = (30.0, 66.0)          # about what a 16-core Xeon host measured)
# the rest of a batch-1 step at a 50% bank: bench_serve_dense_nvfp4.json's 183.6 tok/s
# (5.447 ms) less its misses' copies at the row-copy kernel's rate (51.2 rows, 2.875 ms)
REST_MS = 2.572
TRACES = {"uniform": {}, "locality": tr.QWEN3_LOCALITY,
          "skewed": dict(reuse_next=0.2, reuse_window=0.4, window=8, skew=1.0)}


def policies() -> list[Policy]:
    t = L                                              # clock ticks a token
    return [LRU] + [Policy("lfru", weight=w * t, half_life=h * t) for w, h in
                    ((2, 16), (8, 64), (32, 256))] + \
        [Policy("lfru", weight=8 * t, half_life=64 * t, protect=p * t) for p in (1, 4)]


def build_parser() -> CLIParser:
    p = CLIParser(prog="sim_policies.py", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=positive_int, default=512, help="decoded tokens measured")
    p.add_argument("--warmup", type=positive_int, default=64, help="tokens before measuring")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                   help="what to simulate (default: all of policies, prefetch, promote)")
    p.add_argument("--json", type=output_file, metavar="PATH",
                   help="write the results here instead of benchmarks/results/sim_policies.json")
    return p


def main(args) -> None:
    out = results_path("sim_policies", args.json,
                       reduced_by(args, build_parser(), "steps", "parts"))
    n = args.steps + args.warmup
    traces = {name: (tr.uniform(n, L, E, K, seed=1) if not kw else
                     tr.synthetic(n, L, E, K, seed=1, **kw)) for name, kw in TRACES.items()}
    res = {"shape": {"layers": L, "experts": E, "top_k": K}, "steps": args.steps,
           "warmup": args.warmup, "traces": {k: v.note for k, v in traces.items()},
           "policies": [], "prefetch": [], "promote": [], "host": [], "host_streams": []}
    t0 = time.perf_counter()
    if "promote" in args.parts:
        res["promote"] = promote(args)
    if "host" in args.parts:
        res["host"] = host(args, traces["locality"])
        res["host_streams"] = host_streams(args)
    for name, trace in traces.items():
        if "policies" not in args.parts and "prefetch" not in args.parts:
            break
        for bank in BANKS:
            rows = E * bank // 100
            for pol in policies() if "policies" in args.parts else []:
                r = simulate(trace, rows, warmup_steps=args.warmup, policy=pol)
                res["policies"].append({"trace": name, "bank_percent": bank, "policy": pol.describe(),
                                        "hit_rate": r["hit_rate"]})
                print(f"{name:>8} bank {bank}% {pol.describe():<42} hit rate {r['hit_rate']:.4f}",
                      flush=True)
            if "policies" in args.parts:               # the ceiling no policy can pass
                r = simulate_opt(trace, rows, warmup_steps=args.warmup)
                res["policies"].append({"trace": name, "bank_percent": bank, "policy": OPT,
                                        "hit_rate": r["hit_rate"]})
                print(f"{name:>8} bank {bank}% {OPT:<42} hit rate {r['hit_rate']:.4f}", flush=True)
            for acc in (0.6, 0.8, 0.95) if "prefetch" in args.parts else ():
                tp = tr.with_predictions(trace, acc, seed=2)
                for cap in PREFETCH_ROWS:
                    r = simulate(tp, rows, warmup_steps=args.warmup, prefetch=True,
                                 prefetch_rows=cap)
                    per = {k: r[k] / args.steps for k in ("prefetched", "prefetch_used",
                                                            "prefetch_wasted")}
                    res["prefetch"].append({"trace": name, "bank_percent": bank,
                                            "accuracy": acc, "prefetch_rows": cap,
                                            "hit_rate": r["hit_rate"],
                                            "misses_per_token": r["misses"] / args.steps,
                                            **{f"{k}_per_token": v for k, v in per.items()}})
                    print(f"{name:>8} bank {bank}% prefetch at {acc:.2f}, "
                          f"{f'at most {cap} rows' if cap else 'every row'}: hit rate "
                          f"{r['hit_rate']:.4f}, a token: {per['prefetched']:.1f} rows "
                          f"prefetched, {per['prefetch_used']:.1f} used, "
                          f"{per['prefetch_wasted']:.1f} wasted, "
                          f"{r['misses'] / args.steps:.1f} misses", flush=True)
    res["seconds"] = time.perf_counter() - t0
    save("sim_policies", res, out)


def host(args, trace) -> list[dict]:
    """Misses split between the link and the host's CPU (module docstring, part "host")."""
    out = []
    for link_name, gbps in LINKS.items():
        link_us = ROW_BYTES / gbps / 1e3
        for bank in BANKS:
            rows = E * bank // 100
            for defer in (False, True):
                for cpu_us in (math.inf, *CPU_US):
                    if defer and cpu_us == math.inf:
                        continue                      # the plain pool: the same either way
                    r = simulate_host_split(trace, rows, link_us=link_us,
                                            cpu_us=cpu_us if cpu_us != math.inf else 1e12,
                                            handoff_us=HANDOFF_US, warmup_steps=args.warmup,
                                            defer=defer, rest_us=REST_MS * 1e3 / L)
                    # the link's busy time bounds the step too: deferred copies that do not fit
                    # the step queue up (an optimistic estimate: they delay no urgent copy)
                    step = max(REST_MS + r["miss_ms_per_token"], r["link_busy_ms_per_token"])
                    row = {"link": link_name, "link_us_per_row": round(link_us, 2),
                           "bank_percent": bank, "cpu_us_per_row": None if cpu_us == math.inf
                           else cpu_us, "deferred": defer, "handoff_us": HANDOFF_US,
                           **{k: v for k, v in r.items() if k != "miss_histogram"},
                           "miss_histogram": {str(k): v for k, v in r["miss_histogram"].items()},
                           "estimated_tok_s": 1000.0 / step,
                           "timeline_tok_s": 1000.0 / r["timeline_ms_per_token"],
                           "link_bound": r["link_busy_ms_per_token"]
                           > REST_MS + r["miss_ms_per_token"]}
                    out.append(row)
                    what = ("link only" if cpu_us == math.inf else
                            f"CPU {cpu_us:g} us/row, {'deferred' if defer else 'not promoted'}")
                    print(f"{link_name:<26} bank {bank}% {what:<34} hit rate "
                          f"{r['hit_rate']:.3f}, a token {r['link_rows_per_token']:.1f} link + "
                          f"{r['cpu_rows_per_token']:.1f} CPU rows waited, misses "
                          f"{r['miss_ms_per_token']:.2f} ms, link busy "
                          f"{r['link_busy_ms_per_token']:.2f} ms: ~{1000 / step:.0f} tok/s"
                          f"{' (link-bound)' if row['link_bound'] else ''}, timeline "
                          f"~{row['timeline_tok_s']:.0f}",
                          flush=True)
    return out


def host_streams(args) -> list[dict]:
    """The host split with several streams a step (module docstring, part "host")."""
    n = args.steps + args.warmup
    link_us = ROW_BYTES / LINKS["H200 (47.3 GB/s)"] / 1e3
    rows = E // 2
    out = []
    for streams in HOST_STREAMS:
        trace = tr.streams(n, L, E, K, streams, seed=1, **tr.QWEN3_LOCALITY)
        for cpu_us in (math.inf, *HOST_STREAMS_CPU_US):
            for defer in ((False,) if cpu_us == math.inf else (False, True)):
                r = simulate_host_split(trace, rows, link_us=link_us,
                                        cpu_us=cpu_us if cpu_us != math.inf else 1e12,
                                        handoff_us=HANDOFF_US, warmup_steps=args.warmup,
                                        defer=defer)
                miss_part = max(r["miss_ms_per_token"], r["link_busy_ms_per_token"])
                out.append({"streams": streams, "bank_percent": 50,
                            "link_us_per_row": round(link_us, 2),
                            "cpu_us_per_row": None if cpu_us == math.inf else cpu_us,
                            "deferred": defer, "handoff_us": HANDOFF_US,
                            **{k: v for k, v in r.items() if k != "miss_histogram"},
                            "miss_part_ms_per_step": miss_part})
                what = ("link only" if cpu_us == math.inf else
                        f"CPU {cpu_us:g} us/row, {'deferred' if defer else 'left out'}")
                print(f"{streams} streams, bank 50%, {what:<30} hit rate {r['hit_rate']:.3f}, a "
                      f"step {r['link_rows_per_token']:.1f} link + {r['cpu_rows_per_token']:.1f} "
                      f"CPU rows waited, misses {r['miss_ms_per_token']:.2f} ms, link busy "
                      f"{r['link_busy_ms_per_token']:.2f} ms", flush=True)
    return out


def promote(args) -> list[dict]:
    """Hit rates of several streams decoded together, uncapped LRU against promotion caps."""
    n = args.steps + args.warmup
    out = []
    for streams in STREAMS:
        trace = tr.streams(n, L, E, K, streams, seed=1, **tr.QWEN3_LOCALITY)
        for bank in BANKS:
            rows = E * bank // 100
            auto = default_promote(rows, streams * K)
            caps = {"uncapped": 0, **{f"N/{d}": rows // d for d in CAP_DIVISORS}}
            results = {}
            for label, cap in caps.items():
                results[label] = simulate(trace, rows, warmup_steps=args.warmup,
                                          policy=Policy(promote=cap))
            # the pool's default is one of the caps above (or none)
            same = next(label for label, cap in caps.items() if cap == auto)
            for label, r in results.items():
                out.append({"streams": streams, "bank_percent": bank, "cap": label,
                            "promote": caps[label], "default": label == same,
                            "hit_rate": r["hit_rate"],
                            "misses_per_layer_call": r["misses"] / (args.steps * L)})
            print(f"{streams:2d} streams, bank {bank}%: " + ", ".join(
                f"{label} {r['hit_rate']:.3f}" + ("*" if label == same else "")
                for label, r in results.items()) + f"  (* the default, promote {auto})",
                flush=True)
    return out


if __name__ == "__main__":
    sys.exit(run(main, build_parser()))
