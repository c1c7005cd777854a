"""Serving throughput, as `cupool serve` delivers it: concurrent streams decoded together by
`cupool.Engine` with its defaults (the fused decode step where the model fits), through the pool,
on the Qwen3-30B-A3B shape (synthetic weights; `--model glm-4.5-air` GLM-4.5-Air's, whose dense
first layer, sigmoid routers, shared experts and partial rotary the fused step also runs;
`--model qwen3-next-80b-a3b` Qwen3-Next's, whose gated delta nets keep per-slot states), for
each bank size asked for (default: every expert resident, then half of each layer's experts).

For each number of concurrent streams (1, 8, 16 by default) as many requests are submitted at
once (16-token prompts, `--tokens` new tokens each, greedy), and the engine decodes them together
in its captured step (as many slots as `serve` decodes a step with its default `--max-batch`, 8,
or as many as the streams where they are more): aggregate tok/s (all generated tokens over the wall
time from submission to the last token) and per-request decode tok/s, beside the batch-1 run as
the baseline; then the same at 8 streams with sampling (temperature 0.8, top-p 0.95) against
greedy. The hit rate of each case comes from the pool's counters; with misses, a case also
reports their bytes a generated token and the decode tok/s the PCIe link allows for them (a
pinned copy's GB/s, measured at the start of the run), beside the decode rate as a ratio; with
prefetch on, the prefetched rows count as crossing the link too.
Routing (`--routing`):
`locality` (default) replays a trace with Qwen3-like locality in place of the router, one
independent stream a sequence (`cupool.trace.streams`: stream 0 is bench_decode's one-token
trace, so batch 1 replays the same routing), or `router`: the synthetic model's own router
(random weights: near-uniform routing, the hard case for a bank). A bank that holds every
expert always runs the model's own router (each bank's "routing" in the JSON says which): there
the routing decides no hit, and a replayed trace, being the pool's routing hook, would keep the
plan step that the fused step skips as a user's resident model does. `--prefetch router` turns the
pool's prefetch on with the model's own predictor (layer l + 1's router on layer l's MoE input),
`--prefetch trace` (with `--routing locality`) with the trace's predicted ids at
`--prefetch-accuracy`, at most `--prefetch-rows` rows a prefetch where given; each case then also
reports the rows prefetched and wasted (evicted before use), in bytes a generated token. Prefetch
runs are reduced runs (written only with --json).
Host experts, as serve's default has them: a bank without every expert hands some of each decode
call's misses to the host's CPU (`Pool.enable_host_experts`, the host's misses left out of the
bank) where `cupool.serve.loader.auto_host_experts` finds no reason against (it prints one where it
does: steps too narrow to hand anything over, too few CPUs, no C compiler) and prefetch is off;
`--host-experts` turns them on regardless, `--no-host-experts` off (a reduced run).
`--host-threads` threads, the hand-off's cost `--handoff-us`, a row's time on the link and on the
CPU measured at each case's start; each such case also reports those times, the split and the
experts the host computed a token. `--host-promote` promotes the host's misses into the bank and
copies their rows behind the call instead (a reduced run); `--host-min-misses N` hands nothing over
in calls of fewer than N misses; prompt prefill calls of up to `--host-prefill-tokens N` tokens
(default 0, as serve's) share their missing experts with the host as in serve (the decode rate,
which this measures, is not changed by it). `--host-baseline` first runs each such case without
them on the same model (`host_baseline` in the bank's results, and the ratio printed), so both come
from one process on one machine; each of the two starts from a bank rebuilt with the initial
placement and from the trace's first step, so they replay the same routing.
`--promote` sets the pool's promotion cap (`Pool.promote`; default auto, the pool's own default:
no cap while a step's lanes fit a layer's rows, a quarter of a layer's rows past that); each case
reports the cap its steps launched with and the misses staged. A run with another cap is a
reduced run.
`--slots N` gives every case's engine N slots, as `serve --max-batch N` does (default: serve's 8,
or the case's stream count where that is more): a case of fewer streams than slots leaves the
others free, as a `serve` with fewer requests than `--max-batch` does; where the active slots
fit one of the narrow steps' widths (the powers of two below the slot count), the engine's
narrow step decodes theirs alone (`Engine(narrow=)`). `--slots`
equal to each stream count (e.g. `--streams 1 --slots 1`) times engines of exactly the streams'
slots. Such a run is a reduced run.
`--late-prompt N` also times, in each case with a free slot (fewer streams than slots), the
first token of a request of N prompt tokens that arrives while the case's streams decode (three
such requests, one at a time, each after the streams' first 8 tokens; median): its prefill is
launched between their decode steps, as in serve, beside the host's threads where host experts
are on. Such a run is a reduced run.
`--held-context N`, in each case with free slots, first runs one request of N
prompt tokens (and one new token) in each slot the case's streams leave free, so those slots hold
an N-position context while the timed streams decode, as finished conversations do in a serve
whose prefix reuse keeps them. Such a run is a reduced run.
`--dense-nvfp4` keeps the attention projections in NVFP4 (`cupool.dense_nvfp4.quantize_linears`,
as a checkpoint with NVFP4 self_attn loads): the fused step's QKV and o-projection GEMVs then read
a quarter of the bf16 bytes. Such a run is written only with --json.
`--no-batch-prefill` builds the engines with `batch_prefill=False` (serve's `--no-batch-prefill`):
the prompts a case submits together are prefilled one request at a time instead of in one forward
of padded rows, which moves the first-token times and the aggregate rates, not decode. A reduced
run.

    python benchmarks/bench_serve.py
    python benchmarks/bench_serve.py --small          # 2 layers, for a quick check
    python benchmarks/bench_serve.py --streams 1 8 16 --banks 0.5              # the default cap
    python benchmarks/bench_serve.py --streams 1 8 16 --banks 0.5 --promote 0  # uncapped LRU

Writes benchmarks/results/bench_serve.json for a full run (--json PATH for any run).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import (add_dense_nvfp4, pcie_h2d_GBps, reduced_by, results_path,  # noqa: E402
                     save)

from cupool.cli import (CLIParser, add_host_experts, bounded_int, fraction,  # noqa: E402
                        host_flags_given, positive_int, promote, run)



# --model: (shape, dense-part builder, results name, name in the results)
MODELS = {
    "qwen3-30b-a3b": ("QWEN3_30B_A3B", "qwen3_moe_dense_on_gpu", "bench_serve", "Qwen3-30B-A3B"),
    # a dense first layer, sigmoid routers, shared experts, partial rotary, 12 query heads a KV
    # head (each fused by the step)
    "glm-4.5-air": ("GLM45_AIR", "glm4_moe_dense_on_gpu", "bench_serve_glm_4_5_air",
                    "GLM-4.5-Air"),
    # three gated delta nets to one gated full-attention layer, 512 experts top-10 and a gated
    # shared expert a layer (every layer fused: the delta nets on delta_decode)
    "qwen3-next-80b-a3b": ("QWEN3_NEXT_80B", "qwen3_next_dense_on_gpu",
                           "bench_serve_qwen3_next_80b_a3b", "Qwen3-Next-80B-A3B"),
}


def model_shape(name: str, layers: int | None) -> dict:
    """The --model's config dict (synthetic's), with `layers` decoder layers where given."""
    from cupool import synthetic
    shape = getattr(synthetic, MODELS[name][0])
    return dict(shape, num_hidden_layers=layers or shape["num_hidden_layers"])


def build(layers: int | None, max_batch: int, seed: int, bank: float, dense_nvfp4: bool = False,
          model_name: str = "qwen3-30b-a3b"):
    """(model, pool, shape): the --model's dense part on the GPU with random weights, its
    experts' random NVFP4 rows in a pool whose bank holds `bank` of each layer's experts."""
    import cupool
    from cupool import synthetic
    shape = model_shape(model_name, layers)
    make = getattr(synthetic, MODELS[model_name][1])
    model, specs = make("cuda", torch.bfloat16, seed=seed, dense_nvfp4=dense_nvfp4, **shape)
    E, K, H, I = synthetic.moe_dims(shape)
    layout = cupool.RowLayout(H, I)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = max(K, round(E * bank))
    pool = cupool.wrap(model, rows=rows, layers=specs, max_decode_tokens=max_batch,
                       expert_rows=lambda layer: synthetic.random_rows_fast(layout, E, gen, "cuda"),
                       progress=False)
    return model, pool, shape


def link_bound(rows: int, decoded: int, row_bytes: int, pcie_GBps: float) -> float | None:
    """The decode tok/s the PCIe link allows for `rows` rows crossing it once each (the misses,
    and the prefetched rows where prefetch is on): decoded tokens over the time the link takes
    for their bytes (None without any)."""
    if rows == 0 or decoded == 0:
        return None
    return decoded / (rows * row_bytes / (pcie_GBps * 1e9))


# late_ttft: the others' tokens before a late request, room for theirs after, and late requests
LATE_STEPS, LATE_MORE, LATE_REPEATS = 8, 256, 3


def late_ttft(eng, prompts, late_prompts, steps: int = LATE_STEPS) -> list[float]:
    """Times to first token (s) of requests of `late_prompts` (one at a time, each a prompt no
    slot holds: nothing reused), each arriving while `prompts` decode (once each has `steps`
    tokens): the engine driven on this thread as serve's engine thread drives it, the late
    prompt's prefill launched eagerly between the others' decode steps."""
    import cupool
    out = []
    for late_prompt in late_prompts:
        running = [eng.submit(p, cupool.SamplingParams(max_tokens=steps + LATE_MORE))
                   for p in prompts]
        while min(len(r.output_ids) for r in running) < steps:
            eng.iterate()
        late = eng.submit(late_prompt, cupool.SamplingParams(max_tokens=2))
        while late.first_token_at is None:
            eng.iterate()
        for r in running:
            r.cancel()
        eng.run_until_idle()
        out.append(late.first_token_at - late.submitted_at)
    return out


def run_case(model, pool, streams: int, tokens: int, prompt_len: int, sampled: bool,
             compile: bool, fused: bool, seed: int, pcie_GBps: float,
             host: dict | None = None, slots: int | None = None, late: int = 0,
             batch_prefill: bool = True, held: int = 0) -> dict:
    """`host`: HostDecode settings (threads, handoff_us) to enable for this case's width.
    `slots`: the engine's slots (None: `streams`). `late`: with a free slot, also the time to
    first token of a request of `late` prompt tokens arriving while the streams decode
    (`late_ttft`). `held`: with free slots, each of them first holds a finished request of
    `held` prompt tokens (--held-context)."""
    import cupool
    width = slots or streams
    host_info = {}
    if host is not None:
        hd = pool.enable_host_experts(width, **host)
        host_info = {"host_threads": hd.hx.threads, "host_link_us": hd.link_us,
                     "host_cpu_us": hd.cpu_us, "host_cpu_call_us": hd.cpu_call_us,
                     "host_handoff_us": hd.handoff_us, "host_min_misses": hd.min_misses,
                     "host_split": hd.split.tolist(), "host_prefill_tokens": hd.prefill_tokens}
    # with a late request, room for the others' longer runs beside it (late_ttft)
    max_len = max(prompt_len + max(tokens, LATE_STEPS + LATE_MORE), late + 2) + 8 if late \
        else prompt_len + tokens + 8
    held = held if streams < width else 0
    max_len = max(max_len, held + 10)
    eng = cupool.Engine(model, pool, max_batch=width, max_len=max_len,
                        eos_token_id=[], compile=compile, fused=None if fused else False,
                        batch_prefill=batch_prefill)
    g = torch.Generator().manual_seed(seed + streams)
    vocab = model.config.vocab_size
    prompts = [torch.randint(0, vocab, (prompt_len,), generator=g).tolist() for _ in range(streams)]
    params = [cupool.SamplingParams(temperature=0.8 if sampled else 0.0, top_p=0.95 if sampled else 1,
                                    seed=seed + i, max_tokens=tokens) for i in range(streams)]
    # the warm-up runs prompts of its own, of the same length: a slot then holds nothing of the
    # timed prompts, which are prefilled whole, as new requests are
    warm = [torch.randint(0, vocab, (prompt_len,), generator=g).tolist() for _ in range(streams)]
    eng.generate(warm, [cupool.SamplingParams(max_tokens=4, temperature=p.temperature,
                                              top_p=p.top_p, seed=p.seed) for p in params])
    if held:
        # the slots the warm-up left unused take these (a free slot that holds nothing goes
        # first); the timed prompts then take the warm-up's slots (least recently used)
        eng.generate([torch.randint(0, vocab, (held,), generator=g).tolist()
                      for _ in range(width - streams)],
                     [cupool.SamplingParams(max_tokens=1)] * (width - streams))
    torch.cuda.synchronize()
    pool.bank.reset_stats()
    served0 = pool.host.hx.serve_stats(reset_max=True) if host is not None else None
    t0 = time.perf_counter()
    reqs = eng.generate(prompts, params)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    n = sum(len(r.output_ids) for r in reqs)
    last_first = max(r.first_token_at for r in reqs)
    decode_wall = max(r.finished_at for r in reqs) - last_first
    stats = pool.stats()
    hits, misses = sum(s["hits"] for s in stats), sum(s["misses"] for s in stats)
    # the bank's counters follow decode steps alone (prompts are prefilled outside them): bytes
    # a token are over the decoded tokens, each request's first (its prefill's) left out
    decoded, row = streams * (tokens - 1), pool.layout.row_bytes
    prefetch, prefetched = {}, 0
    if pool.prefetcher is not None:
        prefetched = sum(s["prefetched"] for s in stats)
        prefetch = {"prefetched_bytes_per_token": prefetched * row / decoded,
                    "prefetch_wasted_bytes_per_token":
                        sum(s["prefetch_wasted"] for s in stats) * row / decoded}
    if host is not None:
        host_info["host_experts_per_token"] = sum(s.get("host", 0) for s in stats) / decoded
        # the host's own time a call in the timed run (hx_run's wall time in the serving
        # thread), beside what the split expected of a call of that many rows
        end = pool.host.hx.serve_stats()
        calls = end["calls"] - served0["calls"]
        hd = pool.host
        if calls:
            rows = (end["rows"] - served0["rows"]) / calls
            host_info.update({
                "host_calls": calls, "host_rows_per_call": rows,
                "host_call_us": (end["ns"] - served0["ns"]) / calls / 1e3,
                "host_call_max_us": end["max_ns"] / 1e3,
                "host_call_expected_us": hd.cpu_call_us + rows * hd.cpu_us})
    late_info = {}
    if late and streams < width:                   # after the host's counters above were read
        ttft = late_ttft(eng, prompts, [torch.randint(0, vocab, (late,), generator=g).tolist()
                                        for _ in range(LATE_REPEATS)])
        late_info = {"late_prompt_tokens": late, "late_ttft_ms": statistics.median(ttft) * 1e3,
                     "late_ttft_ms_all": [t * 1e3 for t in ttft]}
    if host is not None:
        pool.disable_host_experts()
    per = [r.decode_tokens_per_s for r in reqs]
    decode_tps = decoded / decode_wall
    ttft = [(r.first_token_at - r.submitted_at) * 1e3 for r in reqs]
    bound = link_bound(misses + prefetched, decoded, row, pcie_GBps)
    eng.close()
    K = pool.top_k
    diag = {"hits": hits, "misses": misses, "staged": sum(s["staged"] for s in stats),
            "promote_cap": pool.bank.promotion_cap(width * K),
            "promotions": sum(s["promotions"] for s in stats),
            "gate_open": int(pool.bank.gate.item()), "plan_skipped": pool.plan_skipped,
            "errors": pool.errors()}
    return {"diagnostics": diag, "step": eng.step_kind, "streams": streams, "slots": width,
            "sampled": sampled,
            "tokens_generated": n, "wall_s": wall,
            "aggregate_tok_per_s": n / wall,
            "ttft_ms_median": statistics.median(ttft), "ttft_ms_max": max(ttft),
            "cached_prompt_tokens_mean": sum(r.cached_tokens for r in reqs) / len(reqs),
            "aggregate_decode_tok_per_s": decode_tps,
            "miss_bytes_per_token": misses * row / decoded,
            "link_bound_decode_tok_per_s": bound,
            "decode_over_link_bound": None if bound is None else decode_tps / bound,
            "per_request_tok_per_s_median": statistics.median(per),
            "per_request_tok_per_s_min": min(per), "hit_rate": pool.hit_rate(stats),
            "steps": eng.steps_run, **({"held_context": held} if held else {}),
            **prefetch, **host_info, **late_info}


def late_text(r: dict) -> str:
    """The case's late request's time to first token, for its printed line ('' without)."""
    if "late_ttft_ms" not in r:
        return ""
    return (f"; a late {r['late_prompt_tokens']}-token prompt's first token after "
            f"{r['late_ttft_ms']:.1f} ms (median of {len(r['late_ttft_ms_all'])})")


def replays_trace(args, holds_every_expert: bool) -> bool:
    """Whether a bank's cases replay the locality trace: where --routing asks for it and the bank
    lacks rows for some experts (or --prefetch trace needs the trace's predictions). With every
    expert in the bank the routing decides no hit, and the trace's routing hook would keep the
    plan step that the fused step skips for the model's own router."""
    return args.routing == "locality" and (not holds_every_expert or args.prefetch == "trace")


def fresh_case(pool, replayer, host_build: bool) -> None:
    """A --host-baseline case starts as its pair does: a bank rebuilt with the initial placement
    (the planner's host build for the host case, the plain one for the baseline) and the trace
    (`replayer`, None for the model's router) at its first step, so the two replay the same
    routing from the same bank."""
    pool.resize_bank(pool.rows_per_layer, host=host_build)
    if replayer is not None:
        replayer.step.zero_()


def host_experts_on(args, pool, width: int, label: str) -> bool:
    """Whether this bank's cases run with host experts, as serve decides: --host-experts on
    wherever the bank misses experts, --no-host-experts off, and by default where
    `auto_host_experts` finds no reason against (printed where it finds one) and prefetch is
    off (a separate planner build)."""
    if args.no_host_experts or pool.bank.holds_every_expert():
        return False
    if args.host_experts:
        return True
    if args.prefetch != "off":
        return False
    from cupool.serve.loader import auto_host_experts
    why = auto_host_experts(pool, width, args.host_min_misses)
    if why is not None:
        print(f"{label}: host experts off, as serve's default leaves them: {why}", flush=True)
    return why is None


def case_slots(args, streams: int) -> int:
    """The slots of a case of `streams` streams: --slots, else serve's default --max-batch (or
    the streams, where they are more, as a serve started for them would take)."""
    from cupool.serve.cli import MAX_BATCH
    return args.slots or max(MAX_BATCH, streams)


def run_bank(args, layers: int, streams: list[int], bank: float, pcie: float) -> dict:
    width = case_slots(args, max(streams))
    model, pool, shape = build(layers, width, args.seed, bank, args.dense_nvfp4, args.model)
    pool.promote = args.promote
    every = pool.bank.holds_every_expert()
    # a bank holding every expert copies nothing (its fused step skips the plan step), and takes
    # the model's own router (below) unless prefetch needs the trace's predictions
    pool.overlap_copies = args.overlap_copies and not every
    routing = args.routing if replays_trace(args, every) else "router"
    replayer = None
    if routing == "locality":
        from cupool import trace as tr
        from cupool.replay import Replayer
        from cupool.synthetic import moe_dims
        E, K, _, _ = moe_dims(shape)
        # one trace layer a MoE layer (a model's dense layers have none)
        t = tr.streams(args.tokens + 192, len(pool.specs), E, K, max(streams), seed=args.seed,
                       **tr.QWEN3_LOCALITY)
        replayer = Replayer(pool, t)
        replayer.install()
    if args.prefetch == "router":
        pool.enable_prefetch(max_rows=args.prefetch_rows)
    elif args.prefetch == "trace":
        from cupool.prefetch import TracePredictor
        pool.enable_prefetch(TracePredictor(replayer, tr.with_predictions(
            t, args.prefetch_accuracy, seed=args.seed)), max_rows=args.prefetch_rows)
    label = f"bank {bank:.0%}" + (", the model's router" if routing != args.routing else "")
    host = dict(threads=args.host_threads, handoff_us=args.handoff_us,
                leave=not args.host_promote, min_misses=args.host_min_misses,
                prefill_tokens=args.host_prefill_tokens or 0) \
        if host_experts_on(args, pool, width, label) else None
    if host is not None:
        label += ", host experts"
    cases, baseline = [], []
    for b in streams:
        if host is not None and args.host_baseline:
            fresh_case(pool, replayer, False)
            r0 = run_case(model, pool, b, args.tokens, args.prompt, False, args.compile,
                          not args.no_fused, args.seed, pcie, None, case_slots(args, b),
                          args.late_prompt or 0, batch_prefill=not args.no_batch_prefill,
                          held=args.held_context or 0)
            baseline.append(r0)
            print(f"bank {bank:.0%}, without host experts: {b:3d} streams ({r0['slots']} slots) "
                  f"greedy : aggregate "
                  f"{r0['aggregate_tok_per_s']:7.1f} tok/s (decode "
                  f"{r0['aggregate_decode_tok_per_s']:7.1f}), hit rate {r0['hit_rate']:.3f}"
                  + late_text(r0), flush=True)
            fresh_case(pool, replayer, True)
        r = run_case(model, pool, b, args.tokens, args.prompt, False, args.compile,
                     not args.no_fused, args.seed, pcie, host, case_slots(args, b),
                     args.late_prompt or 0,
                     batch_prefill=not args.no_batch_prefill, held=args.held_context or 0)
        cases.append(r)
        if baseline:
            ratio = r["aggregate_decode_tok_per_s"] / baseline[-1]["aggregate_decode_tok_per_s"]
            print(f"{label}: {b:3d} streams: {ratio:.3f}x the decode rate without them",
                  flush=True)
        print(f"{label}: {b:3d} streams ({r['slots']} slots) greedy : aggregate "
              f"{r['aggregate_tok_per_s']:7.1f} tok/s "
              f"(decode {r['aggregate_decode_tok_per_s']:7.1f}), per request "
              f"{r['per_request_tok_per_s_median']:6.1f} tok/s, hit rate {r['hit_rate']:.3f} "
              f"(cap {r['diagnostics']['promote_cap'] or 'none'}) [{r['step']}], first token "
              f"{r['ttft_ms_median']:.1f} ms (median; {r['cached_prompt_tokens_mean']:.1f} of "
              f"{args.prompt} prompt tokens cached)"
              + (f", misses {r['miss_bytes_per_token'] / 1e6:.1f} MB a token"
                 if r["miss_bytes_per_token"] else "")
              + (f", prefetched {r['prefetched_bytes_per_token'] / 1e6:.1f} MB a token "
                 f"({r['prefetch_wasted_bytes_per_token'] / 1e6:.1f} MB wasted)"
                 if "prefetched_bytes_per_token" in r else "")
              + (f", host {r['host_experts_per_token']:.1f} experts a token (a row "
                 f"{r['host_cpu_us']:.0f} us on the CPU + {r['host_cpu_call_us']:.0f} a call, "
                 f"{r['host_link_us']:.0f} on the link)"
                 if "host_experts_per_token" in r else "")
              + (f", host calls {r['host_call_us']:.0f} us for {r['host_rows_per_call']:.1f} rows "
                 f"(expected {r['host_call_expected_us']:.0f}, longest {r['host_call_max_us']:.0f})"
                 if "host_call_us" in r else "")
              + (f": link bound {r['link_bound_decode_tok_per_s']:.1f} tok/s, decode at "
                 f"{r['decode_over_link_bound']:.2f} of it"
                 if r["link_bound_decode_tok_per_s"] is not None else "") + late_text(r),
              flush=True)
    b = 8 if 8 in streams else max(streams)
    sampled = run_case(model, pool, b, args.tokens, args.prompt, True, args.compile,
                       not args.no_fused, args.seed, pcie, host, case_slots(args, b),
                       batch_prefill=not args.no_batch_prefill, held=args.held_context or 0)
    greedy = next(c for c in cases if c["streams"] == b)
    print(f"{label}: {b:3d} streams sampled: aggregate {sampled['aggregate_tok_per_s']:7.1f} "
          f"tok/s, {sampled['aggregate_tok_per_s'] / greedy['aggregate_tok_per_s']:.3f} of "
          f"greedy (sampled decode {sampled['aggregate_decode_tok_per_s']:7.1f} tok/s, "
          f"{sampled['aggregate_decode_tok_per_s'] / greedy['aggregate_decode_tok_per_s']:.3f} of "
          f"greedy's), hit rate {sampled['hit_rate']:.3f}", flush=True)
    one = next((c for c in cases if c["streams"] == 1), None)
    summary = {}
    if one is not None:
        summary = {str(c["streams"]): c["aggregate_tok_per_s"] / one["aggregate_tok_per_s"]
                   for c in cases}
        print(f"{label}: aggregate / batch-1: " +
              ", ".join(f"{k} streams {v:.2f}x" for k, v in summary.items()))
    pool.unwrap(restore_weights=False)
    del model, pool
    gc.collect()
    torch.cuda.empty_cache()
    return {"bank": bank, "routing": routing, "host_experts": host is not None,
            "cases": cases, "sampled": sampled,
            **({"host_baseline": baseline} if baseline else {}),
            "sampled_over_greedy": sampled["aggregate_tok_per_s"] / greedy["aggregate_tok_per_s"],
            "sampled_decode_over_greedy": (sampled["aggregate_decode_tok_per_s"]
                                           / greedy["aggregate_decode_tok_per_s"]),
            "aggregate_over_batch1": summary}


def main(args) -> int:
    if args.prefetch == "trace" and args.routing != "locality":
        raise ValueError("--prefetch trace needs --routing locality (the trace's predictions)")
    if not 0 <= args.prefetch_accuracy <= 1:
        raise ValueError(f"--prefetch-accuracy must be in [0, 1], got {args.prefetch_accuracy:g}")
    if args.host_experts and args.prefetch != "off":
        raise ValueError("--host-experts and --prefetch are separate planner builds: pick one")
    given = ["--host-baseline"] * args.host_baseline + host_flags_given(args)
    if given and (args.no_host_experts or args.prefetch != "off"):
        off = "--no-host-experts" if args.no_host_experts else "--prefetch"
        raise ValueError(f"{given[0]} applies to host experts, which {off} turns off")
    if args.slots is not None and args.slots < max(args.streams):
        raise ValueError(f"--slots must be at least the largest --streams ({max(args.streams)}), "
                         f"got {args.slots}")
    if args.held_context and all(case_slots(args, b) <= b for b in args.streams):
        slots = f"--slots {args.slots}" if args.slots else "serve's default slots"
        raise ValueError(f"--held-context fills the slots the streams leave free, and no case "
                         f"has any (--streams {' '.join(map(str, args.streams))} in {slots})")
    title = MODELS[args.model][3]
    limit = model_shape(args.model, None)["max_position_embeddings"]   # a slot's positions
    for flag, n in (("--prompt + --tokens", args.prompt + args.tokens),
                    ("--late-prompt", args.late_prompt), ("--held-context", args.held_context)):
        if n and n + 10 > limit:
            raise ValueError(f"{flag} is {n}: a slot of the {title} shape holds {limit} "
                             f"positions, {limit - 10} for a request (the rest the runs' margin)")
    if not args.handoff_us >= 0:
        raise ValueError(f"--handoff-us must be >= 0, got {args.handoff_us:g}")
    from cupool import _cuda
    _cuda.require_gpu("bench_serve")
    layers = 2 if args.small else args.layers
    streams = sorted(set(args.streams))
    pcie = pcie_h2d_GBps()
    print(f"pinned host -> GPU copy: {pcie:.1f} GB/s", flush=True)
    banks = [run_bank(args, layers, streams, bank, pcie) for bank in args.banks]
    layers = model_shape(args.model, layers)["num_hidden_layers"]
    results = {"shape": f"{title}, {layers} layers", "routing": args.routing,
               "tokens_per_request": args.tokens, "prompt_tokens": args.prompt,
               "compile": args.compile, "fused": not args.no_fused, "prefetch": args.prefetch,
               "promote": args.promote, "overlap_copies": args.overlap_copies,
               "host_experts": ("on" if args.host_experts
                                else "off" if args.no_host_experts or args.prefetch != "off"
                                else "serve's default"),
               "host_leave": not args.host_promote,
               "dense": "nvfp4" if args.dense_nvfp4 else "bf16",
               **({"prefetch_rows": args.prefetch_rows} if args.prefetch != "off" else {}),
               **({"prefetch_accuracy": args.prefetch_accuracy} if args.prefetch == "trace"
                  else {}),
               "slots": args.slots or "serve's default", "late_prompt": args.late_prompt,
               "held_context": args.held_context,
               "batch_prefill": not args.no_batch_prefill,
               "pcie_h2d_GBps": pcie, "banks": banks,
               "gpu": torch.cuda.get_device_name()}
    name = MODELS[args.model][2]
    save(name, results, results_path(name, args.json, reduced(args)))
    return 0


def reduced(args) -> list[str]:
    """How this run differs from the canonical one (serve's defaults), as its flags read."""
    return reduced_by(args, build_parser(), "layers", "streams", "tokens", "banks", "no_fused",
                      "compile", "small") + \
        ([f"--routing {args.routing}"] if args.routing != "locality" else []) + \
        ([f"--prefetch {args.prefetch}"] if args.prefetch != "off" else []) + \
        ([f"--promote {args.promote}"] if args.promote != "auto" else []) + \
        (["--overlap-copies"] if args.overlap_copies else []) + \
        (["--no-host-experts"] if args.no_host_experts else []) + \
        (["--host-promote"] if args.host_promote else []) + \
        ([f"--host-threads {args.host_threads}"] if args.host_threads is not None else []) + \
        ([f"--host-min-misses {args.host_min_misses}"]
         if args.host_min_misses is not None else []) + \
        ([f"--host-prefill-tokens {args.host_prefill_tokens}"]
         if args.host_prefill_tokens is not None else []) + \
        ([f"--slots {args.slots}"] if args.slots else []) + \
        ([f"--late-prompt {args.late_prompt}"] if args.late_prompt else []) + \
        ([f"--held-context {args.held_context}"] if args.held_context else []) + \
        (["--dense-nvfp4"] if args.dense_nvfp4 else []) + \
        (["--no-batch-prefill"] if args.no_batch_prefill else [])


def build_parser() -> argparse.ArgumentParser:
    p = CLIParser(prog="bench_serve.py", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="qwen3-30b-a3b",
                   help="the shape (synthetic weights): qwen3-30b-a3b (default, writes "
                        "bench_serve.json) or glm-4.5-air (bench_serve_glm_4_5_air.json)")
    p.add_argument("--layers", type=positive_int, default=None,
                   help="decoder layers (default: the model's, 48 for qwen3-30b-a3b, 46 for "
                        "glm-4.5-air)")
    p.add_argument("--streams", type=positive_int, nargs="+", default=[1, 8, 16])
    p.add_argument("--tokens", type=positive_int, default=64, help="new tokens a request")
    p.add_argument("--prompt", type=positive_int, default=16, help="prompt tokens a request")
    p.add_argument("--banks", type=fraction, nargs="+", default=[1.0, 0.5],
                   help="bank sizes, as fractions of each layer's experts (default 1.0 0.5)")
    p.add_argument("--routing", choices=["router", "locality"], default="locality")
    p.add_argument("--no-fused", action="store_true",
                   help="the model's own forward instead of the fused decode step")
    p.add_argument("--compile", action="store_true",
                   help="the model's forward through torch.compile (where the fused step is "
                        "not used)")
    p.add_argument("--prefetch", choices=["off", "router", "trace"], default="off",
                   help="the pool's prefetch: off (default), the model's own predictor, or the "
                        "trace's predicted ids (--routing locality)")
    p.add_argument("--prefetch-accuracy", type=float, default=0.8,
                   help="--prefetch trace: accuracy of the predicted ids (default 0.8)")
    p.add_argument("--prefetch-rows", type=positive_int, metavar="N",
                   help="at most N rows a prefetch brings in (Pool.enable_prefetch's max_rows; "
                        "default: every predicted expert without a row)")
    p.add_argument("--promote", type=promote, default="auto", metavar="auto|N",
                   help="the pool's promotion cap (Pool.promote): auto (default, the pool's "
                        "own), or N misses a step (0: no cap)")
    p.add_argument("--overlap-copies", action="store_true",
                   help="banks without every expert: the pool's overlap_copies on (the misses' "
                        "row copies on the copy stream beside the decode GEMM of the rows in "
                        "place, the copied rows' GEMM after them)")
    add_host_experts(p, serving=True)
    p.add_argument("--handoff-us", type=float, default=10.0,
                   help="host experts: a call's fixed cost of the hand-off, us (default 10)")
    add_dense_nvfp4(p)
    p.add_argument("--host-baseline", action="store_true",
                   help="host experts: first run each such case without them, same model")
    p.add_argument("--slots", type=bounded_int(1, 256), metavar="N",
                   help="slots the engine decodes a step, as serve's --max-batch (default: "
                        "serve's 8, or the stream count where that is more)")
    p.add_argument("--late-prompt", type=bounded_int(1, 1 << 16), metavar="N",
                   help="also time the first token of a request of N prompt tokens arriving "
                        "while a case's streams decode (cases with a free slot: see --slots)")
    p.add_argument("--held-context", type=bounded_int(1, 1 << 17), metavar="N",
                   help="first fill each slot a case's streams leave free with a finished "
                        "request of N prompt tokens (cases with a free slot: see --slots)")
    p.add_argument("--no-batch-prefill", action="store_true",
                   help="prefill the prompts queued together one request at a time (the "
                        "Engine's batch_prefill=False; default: in one forward, as serve does)")
    p.add_argument("--seed", type=positive_int, default=1)
    p.add_argument("--small", action="store_true", help="2 layers (a quick check)")
    p.add_argument("--json", help="write the results here (default: results/bench_serve.json for a "
                                  "full run, nothing for --small)")
    return p


if __name__ == "__main__":
    sys.exit(run(main, build_parser()))
