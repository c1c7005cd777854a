"""Per-kernel device times of one decode layer call and one prefill call (torch.profiler/CUPTI),
to see where a GEMM benchmark's time goes. Prints one table per case; with one of --sweep,
--trace, --route-trace, --route-probe, --host-lanes, --prefill-sweep, --prefill-kernels or
--prefill-timeline, that diagnostic instead. Writes no file."""

from __future__ import annotations

import argparse
import sys

import torch
from _common import ExpertRows, gpu_events, keep_busy, sm_clock_mhz
from bench_gemm import GPT_OSS_SHAPE
from torch.profiler import ProfilerActivity, profile

from cupool import _cuda
from cupool.activation import RELU2, SILU
from cupool.cli import CLIParser, bounded_int, positive_int, run
from cupool.gemm import MoEGemm
from cupool.layout import RowLayout
from cupool.ops import moe_decode, moe_gemm


def table(fn, label, reps=5):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    print(f"--- {label} (x{reps})")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))


# moe_decode builds of the sweep: fields of cupool.ops.moe_decode.Build forced over what the
# per-call rules choose ("" is the rules' own choice).
SWEEP = ("", "minb=3", "minb=4", "w13_split=2", "w13_split=4", "xsmem=1")
_BUILD_FIELDS = ("minb", "w13_split", "xsmem", "blocks", "w2_split")


def parse_variant(text: str) -> dict:
    """"minb=4,w13_split=2" -> {"minb": 4, "w13_split": 2}; "" or "default" -> {} (the build the
    rules choose). An argument type (--sweep, --variant)."""
    out = {}
    for part in filter(None, text.replace("default", "").split(",")):
        name, sep, value = part.partition("=")
        if not sep or name.lower() not in _BUILD_FIELDS or not value.isdigit():
            raise argparse.ArgumentTypeError(
                f"variant {text!r}: expected NAME=INT[,NAME=INT...] with NAME in "
                f"{', '.join(_BUILD_FIELDS)}")
        out[name.lower()] = int(value)
    return out


def variant_text(variant: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in variant.items()) or "default"


# a case's hidden size -> its experts' (RowLayout, activation, top-k): Qwen3-30B-A3B's and
# H = 4096 / I = 1536 (SiLU, top-8), gpt-oss's (H = I = 2880, biases, clamped SwiGLU, top-4) and
# Nemotron-3-Nano-30B-A3B's (H = 2688, I = 1856, no gate, ReLU(up)², top-6)
SHAPES = {2048: (RowLayout(2048, 768), SILU, 8), 4096: (RowLayout(4096, 1536), SILU, 8),
          2880: GPT_OSS_SHAPE, 2688: (RowLayout(2688, 1856, gated=False), RELU2, 6)}
SWEEP_CASES = ("2048:1", "2048:4", "4096:1", "4096:4")


def parse_case(text: str) -> tuple[int, int]:
    """"H:T" -> (H, T), H one of SHAPES' hidden sizes. An argument type (--cases)."""
    h, sep, t = text.partition(":")
    if not sep or not h.isdigit() or not t.isdigit() or int(h) not in SHAPES or not 1 <= int(t) <= 16:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected H:T with H in {sorted(SHAPES)} and T in [1, 16]")
    return int(h), int(t)


def sweep(variants=tuple(map(parse_variant, SWEEP)), layers: int = 16, repeats: int = 1,
          cases=tuple(map(parse_case, SWEEP_CASES))):
    """Decode layer time (by default T=1 and 4 at H=2048, T=1 and 4 at H=4096) for moe_decode
    builds other than the rules' choice (blocks per SM, warps a w13 strip). The first round also
    checks each variant's outputs against the chosen build's on the same rows and routing (max
    |difference| relative to the output's largest value)."""
    from bench_gemm import bench_decode
    gen = torch.Generator(device="cuda")

    def run(case, extra, outputs=None):                # same rows and routing for each variant
        H, T = cases[case]
        layout, act, K = SHAPES[H]
        torch.manual_seed(case)
        gen.manual_seed(case)
        return bench_decode(layout, 128, T, K, layers, gen, 1.0, override=extra,
                            outputs=outputs, activation=act)

    ref = {}                                            # case -> the default build's outputs
    for rep in range(repeats):
        for extra in variants:
            for case, (H, T) in enumerate(cases):
                outs = [] if rep == 0 else None
                r = run(case, extra, outs)
                check = ""
                if outs:
                    if case not in ref:                 # a variant first: build the default
                        ref[case] = outs if not extra else []
                        if extra:
                            run(case, {}, ref[case])
                    base = ref[case][0]
                    check = f"  max diff vs default {float((outs[0] - base).abs().max() / base.abs().max()):.1e}"
                print(f"sweep rep {rep} H={H} T={T} {variant_text(extra)}: "
                      f"{r['us_per_layer']:6.1f} us/layer {r['GBps']:7.0f} GB/s{check}", flush=True)


def trace(T: int = 1, E: int = 128, override: dict | None = None, hidden: int = 2048):
    """Timeline of one moe_decode call (the DECODE_TRACE build) at SHAPES[hidden]: when blocks
    start, when each item's waits end, its K loop ends and it ends, as percentiles in µs from the
    first block's start. `override`: build fields forced over the rules' choice."""
    import dataclasses

    import numpy as np
    layout, act, K = SHAPES[hidden]
    rows = ExpertRows(layout, E)                      # kept alive: addr points into rows.bank
    addr = rows.addr
    gemm = MoEGemm(layout, K, torch.bfloat16, max_decode_tokens=T, activation=act)
    blocks = 4096
    stamps = moe_decode.trace_buffer("cuda", blocks)
    x = torch.randn(T, layout.hidden, device="cuda", dtype=torch.bfloat16)
    ids = torch.rand(T, E, device="cuda").topk(K, dim=-1).indices
    w = torch.rand(T, K, device="cuda").reshape(-1)
    la = addr[ids].reshape(-1)
    out = torch.empty_like(x)
    build = dataclasses.replace(gemm.decoder.choose(T * K, x, w), trace=True, **(override or {}))

    def call():
        gemm.decoder.launch(build, x, la, None, w, K, 2, gemm.decode_workspaces, out, gemm.error,
                            trace=stamps)

    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    items = moe_decode.TRACE_ITEMS
    for _ in range(3):
        call()
    for rep in range(3):
        keep_busy()                                       # the trace at a busy GPU's clock
        flush.fill_(rep)                                  # rows out of L2, as in a decode step
        stamps.zero_()
        torch.cuda.synchronize()
        call()
        torch.cuda.synchronize()
        mhz = sm_clock_mhz()
        tr = stamps.cpu().numpy()
        it = tr[:items * 4].reshape(items, 4)
        bl = tr[items * 4:items * 4 + blocks * 2].reshape(blocks, 2)
        bl = bl[bl[:, 0] > 0]
        t0 = bl[:, 0].min()
        units = len(set(ids.reshape(-1).tolist()))
        ppi = moe_decode.act_strips_per_item(layout, build.w13_split)
        n13 = units * (layout.ip // 16) // ppi
        n2 = units * moe_decode.w2_items(layout, build.w2_split)
        us = lambda v: (v - t0) / 1e3
        pct = lambda v: " ".join(f"{np.percentile(v, q):6.2f}" for q in (0, 10, 50, 90, 100))
        print(f"--- trace H={layout.hidden} T={T} {override or ''} rep {rep}: {len(bl)} blocks, "
              f"{n13} w13 items, {n2} w2 items (percentiles 0/10/50/90/100, us from the first "
              f"block's start; SM clock after it {mhz} MHz)")
        print(f"blocks start        {pct(us(bl[:, 0]))}")
        print(f"blocks grouped      {pct(us(bl[:, 1]))}")
        for name, sl in (("w13", it[:n13]), ("w2", it[n13:n13 + n2])):
            sl = sl[sl[:, 0] > 0]
            for k, what in enumerate(("start", "waits done", "K loop done", "end")):
                print(f"{name:4s} {what:14s} {pct(us(sl[:, k]))}")
            print(f"{name:4s} {'K loop (dur)':14s} {pct((sl[:, 2] - sl[:, 1]) / 1e3)}")


def route_trace(T: int = 1, E: int = 128, layout: RowLayout = SHAPES[2048][0]):
    """Timeline of one call of the router folded into the decode GEMM's launch (moe_decode's ROUTE
    build, DECODE_TRACE): when its blocks waited, wrote their logits, saw every expert's, read
    them, routed and grouped their lanes, and when the items' K loops and the items end, as
    percentiles in µs from the first block's start, after an L2 flush. (The step with and without
    it: profile_decode.py with CUPOOL_FUSED_ROUTE=1 and unset.)"""
    import dataclasses

    import numpy as np

    from cupool.ops.dense_gemv import RouteOut
    H, K = layout.hidden, 8
    rows = ExpertRows(layout, E)                      # kept alive: table points into rows.bank
    gemm = MoEGemm(layout, K, torch.bfloat16, max_decode_tokens=T)
    router = (torch.randn(E, H, device="cuda") / H ** 0.5).to(torch.bfloat16)
    nw = torch.ones(H, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    x, out = torch.empty_like(h), torch.empty_like(h)
    route = RouteOut.allocate(T, E, K, torch.float32, "cuda")
    lanes = torch.zeros(T * K, dtype=torch.int64, device="cuda")
    table = rows.addr.clone()

    build = dataclasses.replace(gemm.decoder.choose(T * K, x, route.weights, route=True),
                                trace=True)
    stamps = moe_decode.trace_buffer("cuda")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    items, blocks = moe_decode.TRACE_ITEMS, moe_decode.TRACE_BLOCKS

    def traced():
        gemm.decoder.launch_routed(build, h, router, nw, 1e-6, True, None, table, x, route.logits,
                                   route.ids, route.weights, lanes, route.ticket,
                                   gemm.decode_workspaces, out, gemm.error, trace=stamps)

    for _ in range(3):
        traced()
    for rep in range(3):
        keep_busy()                                  # the trace at the clock a busy GPU runs
        flush.fill_(rep)
        stamps.zero_()
        torch.cuda.synchronize()
        traced()
        torch.cuda.synchronize()
        mhz = sm_clock_mhz()
        tr = stamps.cpu().numpy()
        bl = tr[items * 4:items * 4 + blocks * 2].reshape(blocks, 2)
        rt = tr[items * 4 + blocks * 2:].reshape(blocks, 5)
        live = bl[:, 0] > 0
        bl, rt = bl[live], rt[live]
        it = tr[:items * 4].reshape(items, 4)
        it = it[it[:, 0] > 0]
        t0 = bl[:, 0].min()
        pct = lambda v: " ".join(f"{np.percentile((v - t0) / 1e3, q):6.2f}"
                                 for q in (0, 10, 50, 90, 100))
        print(f"--- route trace T={T} rep {rep}: {len(bl)} blocks (percentiles 0/10/50/90/100, us "
              f"from the first block's start; SM clock after it {mhz} MHz)")
        for name, col in (("blocks start", bl[:, 0]), ("waited", rt[:, 0]),
                          ("logits out", rt[:, 1]), ("all logits seen", rt[:, 2]),
                          ("logits read", rt[:, 3]), ("routed", rt[:, 4]),
                          ("lanes grouped", bl[:, 1]), ("items' K loops done", it[:, 2]),
                          ("items end", it[:, 3])):
            print(f"{name:26s} {pct(col)}")
    assert gemm.read_error() == [], gemm.read_error()


def host_lanes(counts=(0, 1, 2), layers: int = 16, E: int = 128, dims=(2048, 768)):
    """A miss computed where it lies: decode GEMM calls (T=1, top-8, a graph of `layers` calls
    over distinct random ids, L2 flushed before each replay) with n of each call's 8 lanes
    reading their rows straight from pinned host memory (the rows' UVA addresses), against what
    n misses cost now: the row-copy kernel bringing those n rows into GPU rows, then the GEMM
    reading every row from GPU memory. Prints µs a layer for both and for n = 0, and checks the
    two outputs equal (the same bytes are read)."""
    from _common import capture, time_ms

    from cupool.ops.rowcopy import RowCopier
    layout = RowLayout(*dims)
    H, K = layout.hidden, 8
    rows = ExpertRows(layout, E, store=True)
    host = rows.store.address_table(0)                              # int64 [E] UVA addresses
    gemm = MoEGemm(layout, K, torch.bfloat16, max_decode_tokens=1)
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randperm(E, generator=gen)[:K].cuda() for _ in range(layers)]
    xs = [torch.randn(1, H, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
    w = torch.rand(1, K, device="cuda").softmax(-1)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    n_max = max(counts)
    scratch = torch.zeros(max(1, layers * n_max), layout.row_stride, dtype=torch.uint8,
                          device="cuda")
    copier = RowCopier(host, layout.row_bytes, scratch, max(1, n_max))
    print(f"decode T=1 top-{K}, H={H}, {layers} calls a graph, L2 flushed before each replay:")
    try:
        for n in counts:
            outs = [torch.empty(1, H, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
            ref = [torch.empty_like(o) for o in outs]
            direct, copied, lists, counts_dev = [], [], [], []
            for layer in range(layers):
                la = rows.addr[ids[layer]].clone()
                la[:n] = host[ids[layer][:n]]                         # n lanes read host rows
                direct.append(la)
                s = scratch.data_ptr() + scratch.stride(0) * (layer * n_max
                                                              + torch.arange(n, device="cuda"))
                lc = rows.addr[ids[layer]].clone()
                lc[:n] = s                                            # ... or their copies
                copied.append(lc)
                lst = torch.zeros(max(1, n_max), 2, dtype=torch.int32, device="cuda")
                lst[:n, 0] = ids[layer][:n].int()
                lst[:n, 1] = (layer * n_max + torch.arange(n, device="cuda")).int()
                lists.append(lst)
                counts_dev.append(torch.tensor([n], dtype=torch.int32, device="cuda"))

            def run_direct(c):
                gemm.decode(xs[c], direct[c], w, outs[c])

            def run_copied(c):
                if n:
                    copier(lists[c], counts_dev[c])
                gemm.decode(xs[c], copied[c], w, ref[c])

            us = {}
            for name, fn in (("host lanes", run_direct), ("copy, then GPU rows", run_copied)):
                g = capture(fn, layers)
                us[name] = time_ms(g.replay, warmup=3, iters=30,
                                   setup=lambda: flush.fill_(1)) * 1e3 / layers
            same = all(torch.equal(a, b) for a, b in zip(outs, ref))
            print(f"  {n} of {K} lanes on the host: " + ", ".join(
                f"{k} {v:6.1f} us a layer" for k, v in us.items())
                + f"; outputs {'equal' if same else 'DIFFER'}", flush=True)
            assert same, "a host lane read other bytes than its copy"
            assert gemm.read_error() == [], gemm.read_error()
    finally:
        rows.store.close()


def prefill_variant(text: str):
    """(text, the prefill launch config with the changes of "NAME=INT,...") (fields of
    cupool.ops.moe_gemm.GemmConfig in any case: NB, MINB, KC2, W2_NS, ...). An argument type
    (--prefill-sweep)."""
    try:
        return text, moe_gemm.config_from_text(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def prefill_sweep(configs, repeats: int = 1, tokens=(512, 2048), E: int = 128):
    """Resident prefill time (all experts in GPU rows) for variants of the prefill launch config
    ((text, config) pairs from prefill_variant), beside torch bf16 on dequantized weights (timed
    once per T, with the first variant)."""
    from bench_gemm import bench_prefill
    layout = RowLayout(2048, 768)
    torch_ms = {}
    for rep in range(repeats):
        for text, cfg in configs:
            for T in tokens:
                gen = torch.Generator(device="cuda").manual_seed(T)
                r = bench_prefill(layout, E, T, 8, gen, 1.0, 0.0, baseline=T not in torch_ms,
                                  config=cfg)
                torch_ms.setdefault(T, r.get("torch_best_ms"))
                print(f"prefill sweep rep {rep} T={T} {text or 'default'}: {r['ms']:.3f} ms "
                      f"(host {r['host_ms']:.3f}), torch {torch_ms[T]:.3f} ms, "
                      f"ratio {r['ms'] / torch_ms[T]:.2f}", flush=True)


def prefill_kernels(T: int, E: int = 128, reps: int = 3):
    """Per-kernel device times of resident prefill calls of T tokens (bench_gemm's routing). Its
    launches come in a fixed order (2 warm-up calls, then `reps`), so ncu can pick one by
    --launch-skip."""
    from bench_gemm import routing
    layout = RowLayout(2048, 768)
    rows = ExpertRows(layout, E)
    gemm = MoEGemm(layout, 8, torch.bfloat16, max_prefill_tokens=T, num_experts=E)
    x = torch.randn(T, 2048, device="cuda", dtype=torch.bfloat16)
    ids, w = routing(T, 8, E, torch.Generator(device="cuda").manual_seed(T))
    run = lambda: gemm.prefill(x, ids, w, rows.addr)
    run()
    table(run, f"prefill T={T} resident", reps=reps)


def prefill_timeline(T: int, host_fraction: float = 0.5, scratch_rows: int = 32, E: int = 128):
    """Kernels of one partition-path prefill call with a fraction of the experts on the host, in
    the order they start: stream, start and end in µs from the first kernel, name. Shows where
    the chunk pipeline (copy c on the side stream, GEMM c on the main stream) waits."""
    layout = RowLayout(2048, 768)
    er = ExpertRows(layout, E, store=True)
    _, expert_addr = er.resident_addr(host_fraction)
    gemm = MoEGemm(layout, 8, torch.bfloat16, max_prefill_tokens=T, num_experts=E,
                   scratch_rows=scratch_rows)
    x = torch.randn(T, 2048, device="cuda", dtype=torch.bfloat16)
    ids = torch.rand(T, E, device="cuda").topk(8, dim=-1).indices
    w = torch.rand(T, 8, device="cuda")
    run = lambda: gemm.prefill(x, ids, w, expert_addr, host_addr=er.store.address_table())
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    ks = [e for e in gpu_events(prof) if e["kind"] == "kernel"]
    t0 = ks[0]["start_us"]
    print(f"--- prefill T={T}, {host_fraction:.0%} of {E} experts on the host, scratch_rows "
          f"{scratch_rows}: {len(ks)} kernels, {max(e['end_us'] for e in ks) - t0:.0f} us")
    for e in ks:
        print(f"stream {e['stream']:>3} {e['start_us'] - t0:8.1f} {e['end_us'] - t0:8.1f}"
              f"  {e['name'][:60]}")
    er.store.close()


_ROUTE_PROBE = r"""
extern "C" __global__ void route_probe(const float* logits, int N, int topk, int reps,
                                       long long* cycles, int* ids, float* wts) {
    extern __shared__ float lg[];
    for (int r = 0; r < reps; ++r) {
        for (int e = threadIdx.x; e < N; e += 32) lg[e] = logits[e];
        __syncwarp();
        const long long t0 = clock64();
        route_token<false>(lg, N, topk, 1, true, ids, wts, 1, nullptr, nullptr);
        __syncwarp();
        const long long t1 = clock64();
        if (threadIdx.x == 0) cycles[r] = t1 - t0;
    }
}
"""


def route_probe(experts=(128, 512), topks=(0, 1, 8), reps: int = 16):
    """SM cycles (clock64) of route.cuh's route_token alone: one warp of one block routes one
    token's random logits in shared memory `reps` times in a row (the first call cold, the rest
    warm), for each E and top-k. topk 0 is the softmax and the segments' first scan with no round;
    the slope over topk is a round's cost."""
    import cupy

    from cupool import kernels
    text = kernels.expand("dense_gemv")[0] + _ROUTE_PROBE     # route.cuh as dense_gemv includes it
    dev = torch.cuda.current_device()
    cc = torch.cuda.get_device_capability(dev)
    module = cupy.RawModule(code=text, options=("-std=c++17", f"-arch=sm_{cc[0]}{cc[1]}"))
    kern = module.get_function("route_probe")
    keep_busy()
    for E in experts:
        for k in topks:
            logits = torch.randn(E, device="cuda")
            cycles = torch.zeros(reps, dtype=torch.int64, device="cuda")
            ids = torch.full((32,), -7, dtype=torch.int32, device="cuda")
            wts = torch.zeros(32, device="cuda")
            kern((1,), (32,), (logits.data_ptr(), cupy.int32(E), cupy.int32(k),
                              cupy.int32(reps), cycles.data_ptr(), ids.data_ptr(),
                              wts.data_ptr()), shared_mem=4 * E)
            torch.cuda.synchronize()
            cold, *warm = cycles.cpu().tolist()
            want = torch.sort(torch.softmax(logits, 0), descending=True, stable=True).indices[:k]
            ok = ids[:k].cpu().tolist() == want.cpu().tolist()
            print(f"route_token E={E:4d} topk={k}: cold {cold:6d} cycles, warm median "
                  f"{sorted(warm)[len(warm) // 2]:6d} (ids {'match' if ok else 'DIFFER'})")
    print(f"SM clock {sm_clock_mhz()} MHz")


def build_parser() -> CLIParser:
    p = CLIParser(prog="profile_gemm.py", description=__doc__)
    p.add_argument("--experts", type=bounded_int(8, 1024), default=128,
                   help="E of the default tables, --trace, --prefill-kernels and "
                        "--prefill-timeline (in [8, 1024]: top-8 routing; --sweep uses 128)")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--sweep", nargs="*", type=parse_variant, metavar="NAME=INT[,...]",
                      help="time moe_decode builds with minb / w13_split / xsmem / blocks (blocks "
                           "an SM of the launch) / w2_split (warps a w2 strip) forced ('' is the "
                           "rules' choice; none given: a split/occupancy sweep), then exit")
    p.add_argument("--repeats", type=positive_int, default=1,
                   help="--sweep, --prefill-sweep: rounds over the variants (>= 1)")
    p.add_argument("--cases", nargs="+", type=parse_case, metavar="H:T",
                   default=[parse_case(c) for c in SWEEP_CASES],
                   help="--sweep: decode cases, hidden size (SHAPES: 2048, 4096, gpt-oss's 2880 "
                        "or Nemotron-H's 2688) and tokens (1 to 16; default %s)"
                        % " ".join(SWEEP_CASES))
    p.add_argument("--variant", type=parse_variant, default={}, metavar="NAME=INT[,...]",
                   help="--trace: minb / w13_split / xsmem / blocks of the traced build")
    p.add_argument("--hidden", type=int, choices=sorted(SHAPES), default=2048,
                   help="--trace, --route-trace: hidden size of the traced layer (SHAPES: I "
                        "follows; --route-trace takes 2048 or 4096)")
    what.add_argument("--trace", type=bounded_int(1, 32), nargs="*", metavar="T",
                      help="timeline of moe_decode calls of T tokens (1 to 32; default 1), then "
                           "exit")
    what.add_argument("--route-trace", type=bounded_int(1, 16), nargs="*", metavar="T",
                      help="timeline of the router folded into the decode launch (the ROUTE "
                           "build) for calls of T tokens (1 to 16; default 1), then exit")
    what.add_argument("--prefill-sweep", nargs="*", type=prefill_variant, metavar="NAME=INT[,...]",
                      help="resident prefill time for variants of the prefill launch config "
                           "(GemmConfig fields: NB, MINB, KC, KC2, W2_NS, ...; '' or default is "
                           "the default)")
    what.add_argument("--prefill-kernels", type=positive_int, nargs="*", metavar="T",
                      help="per-kernel times of resident prefill calls of T tokens (default "
                           "2048), then exit")
    what.add_argument("--prefill-timeline", type=positive_int, nargs="*", metavar="T",
                      help="kernel timeline of half-on-host prefill calls of T tokens (default "
                           "2048), then exit")
    what.add_argument("--host-lanes", type=bounded_int(0, 8), nargs="*", metavar="N",
                      help="decode calls with N of 8 lanes reading host rows in place, against "
                           "copying them first (default N = 0 1 2), then exit")
    what.add_argument("--route-probe", action="store_true",
                      help="SM cycles of route.cuh's top-k routine alone (one warp, E 128 and "
                           "512, top-k 0, 1 and 8), then exit")
    p.add_argument("--scratch-rows", type=positive_int, nargs="+", default=[32],
                   help="--prefill-timeline: MoEGemm scratch_rows values (>= 1)")
    return p


def main(args) -> None:
    if args.route_trace is not None and args.hidden not in (2048, 4096):
        raise ValueError(f"--route-trace: the routing build routes SiLU experts of top-8 without "
                         f"a router bias, so not --hidden {args.hidden}; use 2048 or 4096")
    _cuda.require_gpu("the MoE GEMM profiler")
    if args.prefill_sweep is not None:
        prefill_sweep(args.prefill_sweep or [prefill_variant("default")], repeats=args.repeats)
        return
    if args.prefill_kernels is not None:
        for T in args.prefill_kernels or [2048]:
            prefill_kernels(T, E=args.experts)
        return
    if args.prefill_timeline is not None:
        for T in args.prefill_timeline or [2048]:
            for rows in args.scratch_rows:
                prefill_timeline(T, scratch_rows=rows, E=args.experts)
        return
    if args.sweep is not None:
        sweep(args.sweep or [parse_variant(v) for v in SWEEP], repeats=args.repeats,
              cases=args.cases)
        return
    if args.host_lanes is not None:
        host_lanes(tuple(args.host_lanes) or (0, 1, 2), E=args.experts)
        return
    if args.route_probe:
        route_probe()
        return
    if args.route_trace is not None:
        for T in args.route_trace or [1]:
            route_trace(T, E=args.experts, layout=SHAPES[args.hidden][0])  # SiLU, top-8
        return
    if args.trace is not None:
        for T in args.trace or [1]:
            trace(T, E=args.experts, override=args.variant, hidden=args.hidden)
        return
    E, K = args.experts, 8
    layout = RowLayout(2048, 768)
    rows = ExpertRows(layout, E)                      # kept alive: addr points into rows.bank
    addr = rows.addr
    for T in (1, 4):
        gemm = MoEGemm(layout, K, torch.bfloat16, max_decode_tokens=T)
        x = torch.randn(T, 2048, device="cuda", dtype=torch.bfloat16)
        ids = torch.rand(T, E, device="cuda").topk(K, dim=-1).indices
        w = torch.rand(T, K, device="cuda")
        la = addr[ids].reshape(-1)
        table(lambda: gemm.decode(x, la, w), f"decode T={T}")
    prefill_kernels(512, E, reps=2)


if __name__ == "__main__":
    sys.exit(run(main, build_parser()))
