"""Where one decode token's time goes in the engine's decode step (what `cupool serve` runs):
per-kernel device times on the bench_decode model (Qwen3-30B-A3B shape, all experts in the bank,
gate open, no misses, batch 1 unless --batch), from torch.profiler over eager runs of the step,
next to the same step replayed as the engine's CUDA graph.

`--bank P` (percent, default 100) banks P% of each layer's experts; below 100 the locality trace
(`cupool.trace.QWEN3_LOCALITY`, one independent stream a slot, as bench_serve) is replayed
through the pool's routing hook, and the profiled steps' misses are reported beside the row
copies' kernel time: the bytes they moved over that time, against the pinned copy's GB/s
measured in the same run.

`--step fused` (the default where the model fits: cupool's fused kernels), `compiled` (the
model's forward through torch.compile) or `graph` (the model's forward, captured as it is).
Kernels are grouped: cupool MoE (plan, copies, MoE GEMM), cupool dense (the fused step's GEMVs
and attention), matmul (cuBLAS), attention (torch's), and elementwise/reduction (norms, rotary,
router softmax/top-k, residuals, casts, sampling). The difference between the graph's time and
the sum of kernel times is the gaps between kernels.
`--context N` sets the positions each slot's token attends to (default the 16-token prompt): a
chat or an agent's conversation runs its attention over thousands.
`--prefetch trace` (with `--bank` below 100) turns the pool's prefetch on with the locality
trace's predicted ids at `--prefetch-accuracy` (default 0.8), at most `--prefetch-rows` rows a
prefetch where given, as bench_serve's `--prefetch trace`; the bytes prefetched a step are then
reported beside the misses'. `--prefetch-copiers` also captures and times the step with other
grids of the prefetch's row-copy kernel (`Bank.prefetch_copier`), `--copiers` with other grids
of the step's own (`Bank.copier`).
`--overlap-copies` (with `--bank` below 100) turns the pool's overlap_copies on: each layer's
row copies run on the copy stream beside the decode GEMM of the rows already in place, and the
copied rows' GEMM is a second launch after them (`cupool.layer`); `--timeline` shows how much
of the copies' time then overlaps the other kernels.
`--host-experts` (with `--bank` below 100; `--host-threads`, `--host-leave`, `--host-min-misses`
as bench_serve takes them) hands some of each call's misses to the host's CPU
(`Pool.enable_host_experts`); the hand-off's kernels are their own group, and the profiled step
is the one the Engine runs with all `--batch` slots active (a plain step where their calls
cannot hand anything over).
Each slot prefills a prompt of its own (slot b's drawn from seed b), so with the model's router
(`--bank 100`) the slots' tokens route to different experts.
`--active N` leaves only the first N of the `--batch` slots active: the step of N requests in an
engine of `--batch` slots (serve's `--max-batch`, default 8), whose kernels still run every slot's
row; tok/s counts the active slots' tokens. With `--narrow` the profiled step is instead the
engine's narrow step that `serve` runs for them (`Engine(narrow=)`: the fewest of 1, 2, 4, ...
slots, widths below --batch, that hold N).
`--dense-nvfp4` keeps the attention projections in NVFP4 (`cupool.dense_nvfp4`): the fused
step's QKV and o-projection GEMVs read the packed form.
`--timeline` also profiles `--steps` replays of the captured step and reports, from their kernel
timeline, the row copies' time beside the other kernels' (both at once, and nothing running),
the GB/s the copied rows make over the copies' time, and how long each prefetch's copy started
after its prefetch step ended; the JSON keeps the events.
`--ablate` (fused step only) also captures the step once without each part of every layer
(`cupool.fused.ABLATE`: qkv, attention, o, router, plan — the plan step and row copies, the
GEMM reading the lane addresses the last plan left — and moe, all of the pool's launches) and
times it: the drop from the whole step is what that part costs inside the graph, where the
eager per-kernel times above count a dependent kernel's wait for the one before as its own.
The fused step's GEMVs run the launch shapes CUPOOL_DENSE_SHAPE names (e.g.
`CUPOOL_DENSE_SHAPE=qkv=w4,o=k2,router=k8`; `cupool/fused.py`), so shapes are compared by running
this script under each value; the step printed (and the JSON's "step") names the value.

`--model gpt-oss-120b` profiles gpt-oss-120b's shape instead (bench_decode's: attention sinks,
alternating sliding-window layers, a router with a bias, experts with biases and the clamped
SwiGLU; `--layers` defaults to the model's, 48 or 36); its attention projections stay bf16.

Prints its tables; writes the figures as JSON only to --json PATH.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time

import torch
from _common import add_dense_nvfp4, kernel_group, save, time_ms
from bench_decode import MODELS as DECODE_MODELS
from bench_decode import shape_keys
from torch.profiler import ProfilerActivity, profile

import cupool
from cupool import _cuda, synthetic
from cupool.cli import (CLIParser, add_host_experts, bounded_int, check_host_flags, fraction,
                        output_file, positive_int, run)
from cupool.engine import StepKind
from cupool.fused import ABLATE

S = 16                 # prompt tokens
# --model: the shapes of bench_decode's models whose layers the fused step runs (full shape,
# dense-part builder)
MODELS = {name: DECODE_MODELS[name][:2] for name in ("qwen3-30b-a3b", "gpt-oss-120b")}

GROUPS = (("cupool MoE", ("plan_step", "copy_rows", "moe_decode", "route_decode", "moe_w13",
                          "moe_w2")),
          ("cupool dense", ("dense_gemv", "dense_attention")),
          ("host hand-off", ("host_post", "host_wait")),
          ("matmul", ("gemm", "gemv", "nvjet", "cutlass", "sm90_xmma", "splitK")),
          ("attention", ("flash", "attention", "fmha", "sdpa", "efficient")))


def group_of(name: str) -> str:
    return kernel_group(name, GROUPS, "elementwise/reduce/other")


def copier_spec(text: str) -> tuple[str, dict]:
    """(text, RowCopier keyword arguments) of bulk:BLOCKS:CHUNK_KIB:STAGES or
    ld:BLOCKS:THREADS:UNROLL (an argument type)."""
    parts = text.split(":")
    try:
        nums = [int(v) for v in parts[1:]]
    except ValueError:
        nums = []
    if len(parts) != 4 or parts[0] not in ("bulk", "ld") or len(nums) != 3 or min(nums) < 1:
        raise argparse.ArgumentTypeError(f"want bulk:BLOCKS:CHUNK_KIB:STAGES or "
                                         f"ld:BLOCKS:THREADS:UNROLL (positive ints), got {text!r}")
    if parts[0] == "bulk":
        return text, {"mode": "bulk", "blocks": nums[0], "chunk": nums[1] * 1024,
                      "stages": nums[2]}
    return text, {"mode": "ld", "blocks": nums[0], "threads": nums[1], "unroll": nums[2]}


def copier_variants(eng, kind, pool, row_bytes: int, specs, steps: int, timeline: bool,
                    attr: str) -> dict:
    """`--copiers` (attr "copier": the step's row copies, `Bank.copier`) and `--prefetch-copiers`
    (attr "prefetch_copier": the prefetch's, `Bank.prefetch_copier`): {spec: {"graph_ms",
    "timeline"}} of the step captured again with each grid of that row-copy kernel, printed. The
    bank's own launcher is put back after."""
    from cupool.ops.rowcopy import RowCopier
    bank = pool.bank
    kept = getattr(bank, attr)
    out = {}
    for text, kw in specs:
        setattr(bank, attr, RowCopier(bank.src_of_key, bank.row_bytes, bank.rows,
                                      bank.max_lanes, **kw))
        with torch.inference_mode():
            graph = eng._capture(kind)
            ms = time_ms(graph.replay, warmup=5, iters=50)
            print(f"{attr.replace('_', ' ')} {text}: graph replay {ms:.3f} ms "
                  f"({1e3 / ms:.1f} tok/s a slot)")
            tl = replay_timeline(graph, pool, row_bytes, steps) if timeline else None
        out[text] = {"graph_ms": ms, "timeline": tl}
        del graph
    setattr(bank, attr, kept)
    return out


def build_parser() -> CLIParser:
    p = CLIParser(prog="profile_decode.py", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="qwen3-30b-a3b",
                   help="the synthetic model's shape (default qwen3-30b-a3b)")
    p.add_argument("--layers", type=positive_int, default=None,
                   help="MoE layers (>= 1; default the model's: 48 for qwen3-30b-a3b, 36 for "
                        "gpt-oss-120b)")
    p.add_argument("--batch", type=bounded_int(1, 16), default=1, help="slots decoded together")
    p.add_argument("--active", type=bounded_int(1, 16), default=None, metavar="N",
                   help="only the first N of the --batch slots active (the step of N requests in "
                        "a --batch-slot engine, as serve's --max-batch runs; default: all)")
    p.add_argument("--narrow", action="store_true",
                   help="with --active N: profile the engine's narrow step for N active slots "
                        "(as serve runs it) instead of the step of every slot")
    p.add_argument("--steps", type=bounded_int(1, 64), default=4, help="profiled eager steps")
    p.add_argument("--step", choices=["fused", "compiled", "graph"], default="fused",
                   help="the engine's decode step (default: fused)")
    p.add_argument("--bank", type=bounded_int(7, 100), default=100,
                   help="percent of each layer's experts in the bank (default 100; below it the "
                        "locality trace is replayed)")
    p.add_argument("--context", type=bounded_int(S, 131072), default=S,
                   help=f"positions each slot's token attends to in the profiled steps (default "
                        f"{S}, the prompt; more: the cache's positions past the prompt filled "
                        f"with random keys and values, as a long conversation's)")
    p.add_argument("--prefetch", choices=["off", "trace"], default="off",
                   help="prefetch with the locality trace's predictions (needs --bank below 100)")
    p.add_argument("--prefetch-accuracy", type=fraction, default=0.8,
                   help="the trace predictions' accuracy (default 0.8)")
    p.add_argument("--prefetch-rows", type=positive_int, metavar="N",
                   help="at most N rows a prefetch brings in (default: all it predicts)")
    p.add_argument("--prefetch-copiers", nargs="+", type=copier_spec, metavar="SPEC",
                   help="with --prefetch: also capture and time the step with each of these grids "
                        "of the prefetch's row-copy kernel: bulk:BLOCKS:CHUNK_KIB:STAGES or "
                        "ld:BLOCKS:THREADS:UNROLL")
    p.add_argument("--copiers", nargs="+", type=copier_spec, metavar="SPEC",
                   help="with --bank below 100: also capture and time the step with each of "
                        "these grids of the step's row-copy kernel (specs as --prefetch-copiers)")
    p.add_argument("--overlap-copies", action="store_true",
                   help="with --bank below 100: the pool's overlap_copies on (the misses' row "
                        "copies on the copy stream beside the decode GEMM of the rows in place, "
                        "the copied rows' GEMM after them)")
    add_dense_nvfp4(p)
    p.add_argument("--timeline", action="store_true",
                   help="also profile replays of the captured step: row copies against the "
                        "other kernels")
    p.add_argument("--ablate", action="store_true",
                   help="also time the captured step without each part of a layer (fused step)")
    add_host_experts(p, prefill=False)
    p.add_argument("--json", type=output_file, metavar="PATH", help="also write the figures here")
    return p


def main(args) -> None:
    if args.prefetch != "off" and args.bank >= 100:
        raise ValueError("--prefetch trace needs --bank below 100 (the locality trace)")
    if args.prefetch_copiers and args.prefetch == "off":
        raise ValueError("--prefetch-copiers needs --prefetch trace")
    if args.copiers and args.bank >= 100:
        raise ValueError("--copiers needs --bank below 100 (a bank that holds every expert "
                         "copies nothing)")
    if args.overlap_copies and args.bank >= 100:
        raise ValueError("--overlap-copies needs --bank below 100 (a bank that holds every "
                         "expert copies nothing)")
    if args.host_experts and args.bank >= 100:
        raise ValueError("--host-experts needs --bank below 100 (a bank that holds every expert "
                         "misses none)")
    if args.host_experts and args.prefetch != "off":
        raise ValueError("--host-experts and --prefetch are separate planner builds: pick one")
    if args.narrow and args.active is None:
        raise ValueError("--narrow profiles the step of --active N of the --batch slots: give "
                         "--active")
    if args.active is not None and args.active > args.batch:
        raise ValueError(f"--active {args.active} is more than the --batch {args.batch} slots")
    if args.dense_nvfp4 and args.model != "qwen3-30b-a3b":
        raise ValueError(f"--dense-nvfp4 builds the qwen3-30b-a3b shape only, not {args.model}")
    check_host_flags(args)
    _cuda.require_gpu("the decode profiler")
    full, build = MODELS[args.model]
    shape = dict(full, num_hidden_layers=args.layers or full["num_hidden_layers"])
    shape["max_position_embeddings"] = max(shape.get("max_position_embeddings", 0),
                                           args.context + 512)
    layers, E, K, hidden, inter, _ = shape_keys(shape)
    B = args.batch
    extra = {"dense_nvfp4": True} if args.dense_nvfp4 else {}
    model, specs = build("cuda", torch.bfloat16, **extra, **shape)
    layout = cupool.RowLayout(hidden, inter, bias=specs[0].bias)
    gen = torch.Generator(device="cuda").manual_seed(0)
    pool = cupool.wrap(model, rows=max(K, E * args.bank // 100), layers=specs,
                       max_decode_tokens=B, max_prefill_tokens=64,
                       expert_rows=lambda layer: synthetic.random_rows_fast(layout, E, gen, "cuda"),
                       progress=False)
    pool.overlap_copies = args.overlap_copies
    hd = pool.enable_host_experts(B, threads=args.host_threads, leave=args.host_leave,
                                  min_misses=args.host_min_misses) if args.host_experts else None
    if args.bank < 100:
        from cupool import trace as tr
        from cupool.replay import Replayer
        t = tr.streams(4096, layers, E, K, B, seed=0, **tr.QWEN3_LOCALITY)
        replayer = Replayer(pool, t)
        replayer.install()
        if args.prefetch == "trace":
            from cupool.prefetch import TracePredictor
            pool.enable_prefetch(TracePredictor(replayer, tr.with_predictions(
                t, args.prefetch_accuracy, seed=0)), max_rows=args.prefetch_rows)
    eng = cupool.Engine(model, pool, max_batch=B, max_len=args.context + 512, eos_token_id=[],
                        fused=args.step == "fused", compile=args.step == "compiled")
    # a prompt of its own a slot (slot b's from seed b), so that with the model's router the
    # slots' tokens route to different experts, as a batch of requests does
    prompts = [torch.randint(0, shape["vocab_size"], (S,),
                             generator=torch.Generator().manual_seed(b)).tolist() for b in range(B)]
    t0 = time.perf_counter()
    # KV, and the greedy step's graph (the step the profile runs)
    eng.generate(prompts, cupool.SamplingParams(max_tokens=3, temperature=0.0))
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    # every slot (or the first --active) active at a real position, so the step reads what a
    # running batch reads
    A = B if args.active is None else args.active
    eng.active.fill_(False)
    eng.active[:A] = True
    if args.context > S:
        with torch.inference_mode():         # the cache's tensors were made under it
            for t in eng.cache.keys + eng.cache.values:
                if t is not None:
                    t[:, :, S:].normal_(0, 1, generator=gen)
    eng.cache.pos.fill_(args.context)
    pool.bank.reset_stats()

    host = hd is not None and hd.hands_over(A)
    width = 0
    if args.narrow:
        width = 0 if host else eng._narrow_width(A)
        if not width:
            why = eng.narrow_why or ("host experts take a share of this step" if host else
                                     f"its narrow steps are of {sorted(eng._narrow)} slots")
            raise SystemExit(f"--narrow: the engine runs {A} active of {B} slots in the step of "
                             f"every slot ({why})")
        eng._set_slot_map(width)                # no request holds a slot: slots 0, 1, ...
    kind = StepKind(greedy=True, logprobs=False, masked=False, host=host, width=width)

    def eager():
        with eng._masked(kind):
            eng._step(kind)

    with torch.inference_mode():
        eager_ms = time_ms(eager, warmup=2, iters=10)
        pool.bank.reset_stats()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                eager()
            torch.cuda.synchronize()
        stats = pool.stats()
        if kind not in eng._graphs:                 # a narrow step: not run by the warm-up
            eng._graphs[kind] = eng._capture(kind)
        graph = eng._graphs[kind]
        graph_ms = time_ms(graph.replay, warmup=5, iters=50)
        timeline = replay_timeline(graph, pool, layout.row_bytes, args.steps) \
            if args.timeline else None
    kern = collections.defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0:
            kern[ev.name][0] += ev.device_time / 1e3 / args.steps      # ms per token
            kern[ev.name][1] += 1 / args.steps
    groups = collections.defaultdict(lambda: [0.0, 0.0])
    for name, (ms, n) in kern.items():
        groups[group_of(name)][0] += ms
        groups[group_of(name)][1] += n
    kernel_ms = sum(v[0] for v in kern.values())
    launches = sum(v[1] for v in kern.values())
    top = sorted(kern.items(), key=lambda kv: -kv[1][0])[:30]
    L = layers
    print(f"layers {L}, batch {B}" + (f" ({A} active)" if A < B else "") +
          (f", the narrow step of {width} slots" if width else "") +
          f", context {args.context}, step {eng.step_kind} (warm-up incl. build and capture "
          f"{warm_s:.1f} s)")
    print(f"per step: graph replay {graph_ms:.3f} ms ({A * 1e3 / graph_ms:.1f} tok/s), eager "
          f"{eager_ms:.3f} ms, kernel time {kernel_ms:.3f} ms in {launches:.0f} kernels "
          f"({launches / L:.1f} a layer), gaps in graph {graph_ms - kernel_ms:.3f} ms")
    for gname, (ms, n) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        print(f"  {gname:>26}: {ms:7.3f} ms  {n:6.0f} kernels  ({ms / L * 1e3:6.1f} us/layer)")
    for name, (ms, n) in top:
        print(f"  {ms * 1e3 / n:7.2f} us x {n:5.0f} = {ms:6.3f} ms  {name[:110]}")
    misses = copies = None
    if args.bank < 100:
        from _common import pcie_h2d_GBps
        misses = sum(d["misses"] for d in stats) / args.steps
        copy_ms = sum(ms for name, (ms, _) in kern.items() if "copy_rows" in name)
        moved = misses * layout.row_bytes
        prefetched = sum(d.get("prefetched", 0) for d in stats) / args.steps
        copies = {"ms_per_step": copy_ms, "bytes_per_step": moved,
                  "GBps": moved / (copy_ms * 1e6) if copy_ms else None,
                  "pcie_h2d_GBps": pcie_h2d_GBps()}
        print(f"bank {args.bank}%: hit rate {pool.hit_rate(stats):.3f}, {misses:.1f} misses a "
              f"step ({moved / 1e6:.1f} MB); row-copy kernels {copy_ms:.3f} ms a step: "
              + (f"{copies['GBps']:.1f} GB/s against the pinned copy's "
                 f"{copies['pcie_h2d_GBps']:.1f} ({copies['GBps'] / copies['pcie_h2d_GBps']:.2f})"
                 if copy_ms else "none")
              + (f"; prefetched {prefetched:.1f} rows a step "
                 f"({prefetched * layout.row_bytes / 1e6:.1f} MB)"
                 if pool.prefetcher is not None else ""))
    host = None
    if hd is not None:
        host = {"step": "host" if kind.host else "plain", "threads": hd.hx.threads,
                "min_misses": hd.min_misses, "cpu_us": hd.cpu_us, "cpu_call_us": hd.cpu_call_us,
                "link_us": hd.link_us, "leave": hd.leave, "split": hd.split.tolist(),
                "rows_per_step": sum(d.get("host", 0) for d in stats) / args.steps}
        print(f"host experts ({host['step']} step): {host['rows_per_step']:.1f} rows a step on "
              f"the host ({hd.hx.threads} threads, a row {hd.cpu_us:.0f} us + {hd.cpu_call_us:.0f} "
              f"a call, {hd.link_us:.0f} on the link; nothing handed over below "
              f"{hd.min_misses} misses)")
    copiers = copier_variants(eng, kind, pool, layout.row_bytes, args.prefetch_copiers,
                              args.steps, args.timeline, "prefetch_copier") \
        if args.prefetch_copiers else None
    step_copiers = copier_variants(eng, kind, pool, layout.row_bytes, args.copiers, args.steps,
                                   args.timeline, "copier") if args.copiers else None
    ablate = ablation(eng, kind, graph_ms, L) if args.ablate else None
    eng.close()
    pool.disable_host_experts()
    save("profile_decode", {
        "model": args.model, "layers": L, "batch": B, "active": A, "narrow_width": width,
        "context": args.context,
        "bank_percent": args.bank, "misses_per_step": misses,
        "row_copies": copies, "step": eng.step_kind, "graph_ms_per_step": graph_ms,
        "tokens_per_s": A * 1e3 / graph_ms, "eager_ms_per_step": eager_ms,
        "kernel_ms_per_step": kernel_ms, "kernels_per_step": launches,
        "kernels_per_layer": launches / L, "warmup_s": warm_s,
        "ablate": ablate, "prefetch": args.prefetch,
        "prefetch_accuracy": args.prefetch_accuracy if args.prefetch != "off" else None,
        "prefetch_rows": args.prefetch_rows, "overlap_copies": args.overlap_copies,
        "dense": "nvfp4" if args.dense_nvfp4 else "bf16", "host_experts": host,
        "timeline": timeline, "prefetch_copiers": copiers, "copiers": step_copiers,
        "groups": {k: {"ms": v[0], "kernels": v[1]} for k, v in groups.items()},
        "top": [{"name": n, "ms": v[0], "count": v[1]} for n, v in top]}, args.json)


def replay_timeline(graph, pool, row_bytes: int, steps: int) -> dict:
    """`--timeline`: the kernel timeline of `steps` replays of the captured step, printed and
    returned (ms a step): the row copies' time (the union of the row-copy kernels' intervals) and
    the other kernels', the time both ran at once and the time nothing ran; the GB/s of the rows
    the bank counted (misses and prefetched rows) over the copies' time; and how long after each
    prefetch step (`prefetch_step`) ended the row copy that follows it started (µs, median and
    max). Streams are not used: a replayed graph's kernels are reported on the streams the
    driver picks for its branches, not those they were captured from. The events themselves are
    returned under "events" (name, start and end µs from the first)."""
    import statistics

    from _common import union_us, gpu_events
    torch.cuda.synchronize()
    pool.bank.reset_stats()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            graph.replay()
        torch.cuda.synchronize()
    stats = pool.stats()
    misses = sum(d["misses"] for d in stats) / steps
    prefetched = sum(d.get("prefetched", 0) for d in stats) / steps
    ev = [e for e in gpu_events(prof) if e["kind"] == "kernel"]
    t0 = min(e["start_us"] for e in ev)
    span = (max(e["end_us"] for e in ev) - t0) / 1e3 / steps
    copies = [(e["start_us"], e["end_us"]) for e in ev if "copy_rows" in e["name"]]
    other = [(e["start_us"], e["end_us"]) for e in ev if "copy_rows" not in e["name"]]
    c, k = union_us(copies) / 1e3 / steps, union_us(other) / 1e3 / steps
    either = union_us(copies + other) / 1e3 / steps
    both = c + k - either
    gbps = (misses + prefetched) * row_bytes / (c * 1e6) if c else None
    waits = []
    for i, e in enumerate(ev):
        if "prefetch_step" in e["name"]:
            nxt = next((f for f in ev[i + 1:] if "copy_rows" in f["name"]
                        and f["start_us"] >= e["end_us"]), None)
            if nxt is not None:
                waits.append(nxt["start_us"] - e["end_us"])
    out = {"span_ms": span, "copies_ms": c, "other_ms": k, "both_ms": both,
           "idle_ms": span - either, "copy_GBps": gbps, "misses_per_step": misses,
           "prefetched_per_step": prefetched,
           "copy_after_prefetch_step_us": ({"median": statistics.median(waits), "max": max(waits)}
                                           if waits else None),
           "events": [{"name": e["name"][:60], "start_us": round(e["start_us"] - t0, 2),
                       "end_us": round(e["end_us"] - t0, 2)} for e in ev]}
    print(f"timeline of {steps} graph replays, ms a step: {span:.3f} from the first kernel's "
          f"start to the last's end; row copies {c:.3f} ({misses:.1f} misses + {prefetched:.1f} "
          f"prefetched rows"
          + (f", {gbps:.1f} GB/s over their time" if gbps else "") + f"), other kernels "
          f"{k:.3f}, both at once {both:.3f}, nothing {span - either:.3f}"
          + (f"; a prefetch's copy started {statistics.median(waits):.1f} us (median; max "
             f"{max(waits):.1f}) after its prefetch step ended" if waits else ""))
    return out


def ablation(eng, kind, graph_ms: float, layers: int) -> dict:
    """{part: ms a step of the captured step without it} (`--ablate`), printed with the drop
    from the whole step a layer."""
    fused = eng._narrow[kind.width] if kind.width else eng._fused
    if fused is None:
        raise SystemExit("--ablate needs the fused step (--step fused on a model it runs)")
    out = {}
    print(f"without each part of every layer (graph replay; whole step {graph_ms:.3f} ms):")
    with torch.inference_mode():
        for part in ABLATE:
            with eng._masked(kind):
                eng._step(kind)       # a real step first: "plan" reuses its lane addresses
            fused.ablate = frozenset([part])
            try:
                graph = eng._capture(kind)
                ms = time_ms(graph.replay, warmup=5, iters=50)
            finally:
                fused.ablate = frozenset()
            del graph
            out[part] = ms
            print(f"  {part:>10}: {ms:7.3f} ms  (costs {(graph_ms - ms) / layers * 1e3:6.1f} "
                  f"us/layer)")
    return out


if __name__ == "__main__":
    sys.exit(run(main, build_parser()))
