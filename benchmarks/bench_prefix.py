"""Prefix reuse: the time to first token of a conversation's second turn, prefilled cold against
reusing the slot that holds the first turn, on one Qwen3-30B-A3B-shaped model, beside the limit
the PCIe link sets.

Model: 48 layers, 128 experts, top-8, H=2048, I=768, random weights, the experts as NVFP4 rows in
pinned memory, a bank of `--bank` % of each layer's experts (default 50), as bench_long.py.

Conversation: turn 1 is a shared prefix of `--prefix` tokens (default 16K: a system prompt, tools
and earlier turns of an agent) and 64 tokens of a question; its answer (`--answer` greedy tokens,
default 32) is generated once, so both engines measure the same turn 2: turn 1, that answer and
`--new` new tokens (default 128). Turn 2's time to first token (submission to the first token,
`cupool.Engine.generate` of one token, synchronized) is measured `--repeats` times (default 5,
median) on two engines over the same model and pool, both built and warmed up and the answer
generated before anything is measured (no decode step runs after that, so the bank's placement is
the same for every run):
- cold: `reuse_prefix=False`, the whole prompt prefilled;
- reused: before each measurement (untimed) a one-token request of turn 1 + the answer leaves
  exactly those tokens in the slot (the first one prefills them, the later ones reuse the
  slot's previous turn 2 up to there and prefill one token); turn 2 then prefills the new
  tokens only (`cached_tokens` says how many it took from the slot).

Same answer: the first token's logits (the last prefill chunk's, through a hook on the output
embedding) of every run: reused against the first cold run (max |difference|, argmax agreement),
beside the same for the other cold runs against the first (the prefill's fp32 atomics make two
runs of one prompt differ in their last bits: the variation a reused run is judged against).

Limit: the bytes of expert rows each prefill reads from pinned host memory (the partition path
copies every routed expert without a bank row once a chunk: misses x row bytes, counted by a
routing hook in one extra untimed run of each mode) over the host-to-device bandwidth measured in
this process (`_common.pcie_h2d_GBps`, a pinned copy): the best time to first token the link
allows, and the achieved one as a fraction of it. Target: reused >= 10x faster than cold.

`--profile`: one more cold and one more reused turn 2 (untimed) under torch.profiler, and where
their GPU time went: the span from the first kernel to the last, each stream's busy time, the
time no stream was busy, the summed time of each group of kernels (expert row copies, MoE
GEMM, attention, matmul, other) and the eight kernels that took the most, printed and kept in
the results under "profile".

Prefill ahead (the pool's `prefill_ahead`: on unless `CUPOOL_PREFILL_AHEAD=0`) is recorded as
"prefill_ahead" and printed with the speedup. `--scratch-rows` and `--scratch-buffers` size the
partition path's scratch (`cupool.wrap`'s defaults 32 and 2): more rows let the copies of the
next layer's host experts start before this layer's last chunk GEMM has freed a buffer.

`--host-experts` turns the host's CPU on before the engines are built (`Pool.enable_host_experts`
with `--host-threads` threads and prefill_tokens `--host-prefill-tokens`, default 512): prefill
calls of up to that many tokens hand their last experts without a bank row to the host, as many
as make the link and the host finish together (`HostDecode.prefill_share`, from the link's and
the host's measured costs, printed). Reused turn 2's new tokens are one such call a layer; the
cold turn's 4,096-token chunks are not. Each mode then also reports the rows the host computed
(`HostExperts.serve_stats`), which do not cross the link: the PCIe bound counts the others.

Writes benchmarks/results/bench_prefix.json. A reduced run (another prefix, --small, another
bank or scratch, fewer repeats, host experts) writes nothing unless --json PATH is given.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch
from _common import (gpu_events, kernel_group, pcie_h2d_GBps, reduced_by, results_path, save,
                     timeline_breakdown)

import cupool
from cupool import _cuda, synthetic
from cupool.cli import CLIParser, bounded_int, output_file, positive_int, run
from cupool.sampling import SamplingParams

TARGET = 10.0
QUESTION = 64
ONE = SamplingParams(max_tokens=1, ignore_eos=True)


class FirstLogits:
    """The logits the output embedding gave for the last position of its latest call (with
    logits_to_keep=1, the last prefill chunk's: what the first token is sampled from)."""

    def __init__(self, model):
        self.last: torch.Tensor | None = None
        self._hook = model.get_output_embeddings().register_forward_hook(self._keep)

    def _keep(self, module, args, out) -> None:
        self.last = out[0, -1].float().clone()          # [V], on the device: no host read

    def remove(self) -> None:
        self._hook.remove()


class HostRows:
    """A routing hook (`Pool.routing_hook`) that counts, for each prefill layer call, the routed
    experts without a bank row: the rows the partition path copies from the host (on the
    device; `rows()` reads the count)."""

    def __init__(self, pool):
        self.pool = pool
        self.count = torch.zeros((), dtype=torch.int64, device=pool.device)
        self.calls = 0

    def __call__(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        E = self.pool.num_experts
        used = torch.zeros(E, dtype=torch.bool, device=ids.device)
        used[ids.reshape(-1)] = True
        self.count += (used & (self.pool.expert_addresses(layer) == 0)).sum()
        self.calls += 1
        return ids

    def rows(self) -> int:
        return int(self.count)


# kernel groups of a prefill profile, by name (the first group whose key a name holds)
GROUPS = (("expert row copies", ("copy_rows", "Memcpy HtoD")),
          ("MoE GEMM", ("moe_w13", "moe_w2", "align_experts", "prep_x", "moe_decode")),
          ("attention", ("flash", "fmha", "attention", "sdpa", "efficient")),
          ("matmul", ("gemm", "gemv", "nvjet", "cutlass", "sm90_xmma", "splitK")))


def group_of(name: str) -> str:
    return kernel_group(name, GROUPS, "other")


def profiled(run_once) -> dict:
    """timeline_breakdown of the GPU work of `run_once()` (one untimed request)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_once()
        torch.cuda.synchronize()
    return timeline_breakdown(gpu_events(prof), group_of)


def ttft(engine, prompt, logits: FirstLogits) -> tuple[float, object, torch.Tensor]:
    """Seconds from submission to the first token of `prompt` (one token generated), its
    Request and its first token's logits."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    r = engine.generate([prompt], ONE)[0]
    torch.cuda.synchronize()
    return time.perf_counter() - t0, r, logits.last


def host_rows(pool, run_once) -> tuple[int, int]:
    """(expert rows without a bank row that `run_once()` (one untimed request) routed to, of
    them the rows the host's CPU computed: 0 without host experts)."""
    counter = HostRows(pool)
    served = pool.host.hx.serve_stats()["rows"] if pool.host is not None else 0
    pool.routing_hook = counter
    try:
        run_once()
    finally:
        pool.routing_hook = None
    on_host = pool.host.hx.serve_stats()["rows"] - served if pool.host is not None else 0
    return counter.rows(), on_host


def measure(engine, turn2, repeats: int, logits: FirstLogits, prime=None) -> dict:
    """`repeats` timed turn-2 requests (each after prime(), untimed, where given)."""
    times, cached, prefilled, first, all_logits = [], [], [], [], []
    for _ in range(repeats):
        if prime is not None:
            prime()
        before = engine.prefill_tokens
        s, r, lg = ttft(engine, turn2, logits)
        times.append(s)
        cached.append(r.cached_tokens)
        prefilled.append(engine.prefill_tokens - before)
        first.append(r.output_ids[0])
        all_logits.append(lg)
    return {"ttft_s": statistics.median(times), "ttft_all_s": times, "cached_tokens": cached,
            "prefilled_tokens": prefilled, "first_tokens": first, "logits": all_logits}


def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    return {"max_abs_diff": float((a - b).abs().max()), "same_argmax": int(a.argmax()) ==
            int(b.argmax())}


def build_parser() -> CLIParser:
    p = CLIParser(prog="bench_prefix.py", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefix", type=bounded_int(16), default=16384,
                   help="shared prefix tokens (>= 16)")
    p.add_argument("--new", type=positive_int, default=128, help="turn 2's new tokens (>= 1)")
    p.add_argument("--answer", type=positive_int, default=32, help="turn 1's answer tokens")
    p.add_argument("--repeats", type=bounded_int(2), default=5,
                   help="measurements a mode (>= 2: two cold runs give the run-to-run variation)")
    p.add_argument("--chunk", type=bounded_int(16), default=4096,
                   help="prompt tokens a forward (the pool's max_prefill_tokens)")
    p.add_argument("--bank", type=bounded_int(7, 100), default=50,
                   help="bank rows a layer, %% of E (>= 7: top-8 of 128)")
    p.add_argument("--scratch-rows", type=positive_int, default=32,
                   help="rows of the prefill scratch for experts without a bank row (cupool.wrap's "
                        "scratch_rows)")
    p.add_argument("--scratch-buffers", type=positive_int, default=2,
                   help="buffers the scratch is split into (cupool.wrap's scratch_buffers)")
    p.add_argument("--small", action="store_true", help="tiny shape, short prompts (smoke test)")
    p.add_argument("--profile", action="store_true",
                   help="also profile one cold and one reused turn 2: GPU time by stream and "
                        "kernel group")
    p.add_argument("--host-experts", action="store_true",
                   help="the host's CPU computes some experts without a bank row of prefill "
                        "calls of up to --host-prefill-tokens tokens")
    p.add_argument("--host-threads", type=bounded_int(1, 1024), metavar="N",
                   help="--host-experts: host threads (default: the CPUs this process may use, "
                        "less one)")
    p.add_argument("--host-prefill-tokens", type=positive_int, default=512, metavar="N",
                   help="--host-experts: the widest prefill call the host takes part in "
                        "(default 512, at most --chunk)")
    p.add_argument("--json", type=output_file, metavar="PATH",
                   help="write the results here instead of benchmarks/results/bench_prefix.json")
    return p


def reduced(args) -> list[str]:
    parser = build_parser()
    why = reduced_by(args, parser, "prefix", "new", "answer", "repeats", "small")
    if args.bank != 50:
        why.append(f"--bank {args.bank} (not 50)")
    for name in ("scratch_rows", "scratch_buffers"):
        if getattr(args, name) != parser.get_default(name):
            why.append(f"--{name.replace('_', '-')} {getattr(args, name)} (not the default)")
    if args.host_experts:
        why.append("--host-experts")
    return why


def check_host_flags(args) -> None:
    """ValueError for --host-threads or another --host-prefill-tokens without --host-experts."""
    if not args.host_experts:
        if args.host_threads is not None:
            raise ValueError("--host-threads applies with --host-experts")
        if args.host_prefill_tokens != build_parser().get_default("host_prefill_tokens"):
            raise ValueError("--host-prefill-tokens applies with --host-experts")


def main(args) -> None:
    check_host_flags(args)
    _cuda.require_gpu("the prefix-reuse benchmark")
    out = results_path("bench_prefix", args.json, reduced(args))
    prefix = 512 if args.small else args.prefix
    shape = dict(synthetic.TINY) if args.small else dict(synthetic.QWEN3_30B_A3B)
    max_len = prefix + QUESTION + args.answer + args.new + 8
    shape["max_position_embeddings"] = max(shape["max_position_embeddings"], max_len)
    E, K = shape["num_experts"], shape["num_experts_per_tok"]
    layout = cupool.RowLayout(shape["hidden_size"], shape["moe_intermediate_size"])
    rows = max(K, E * args.bank // 100)
    t0 = time.perf_counter()
    model, specs = synthetic.qwen3_moe_dense_on_gpu("cuda", torch.bfloat16, **shape)
    gen = torch.Generator(device="cuda").manual_seed(0)
    chunk = min(args.chunk, max_len)
    pool = cupool.wrap(model, rows=rows, layers=specs, max_decode_tokens=1,
                       max_prefill_tokens=chunk, scratch_rows=args.scratch_rows,
                       scratch_buffers=args.scratch_buffers,
                       expert_rows=lambda layer: synthetic.random_rows_fast(layout, E, gen, "cuda"))
    print(f"built in {time.perf_counter() - t0:.0f} s: {pool}", flush=True)
    host = {}
    if args.host_experts:                            # before the engines: it rebuilds the bank
        hd = pool.enable_host_experts(1, threads=args.host_threads,
                                      prefill_tokens=min(args.host_prefill_tokens, chunk))
        turn2_width = args.new                       # reused turn 2's one prefill call
        missing = E - rows
        host = {"threads": hd.hx.threads, "prefill_tokens": hd.prefill_tokens,
                "link_us": hd.link_us, "prefill_link_us": hd.prefill_link_us,
                "handoff_us": hd.handoff_us,
                "prefill_costs": hd.prefill_costs,
                "reused_share": hd.prefill_share(turn2_width, missing)}
        print(f"host experts: {hd.hx.threads} threads; a row {hd.prefill_link_us:.1f} us on "
              f"the link in a prefill call (the copy engine's; {hd.link_us:.1f} in a decode "
              f"call's row copies); "
              f"prefill calls on the host (tokens, us a row, us a call): "
              + ", ".join(f"({t}, {r:.1f}, {c:.1f})" for t, r, c in hd.prefill_costs)
              + f"; a {turn2_width}-token call hands the host {host['reused_share']} of its "
              f"{missing} experts a layer without a bank row", flush=True)
    cpu_gen = torch.Generator().manual_seed(1)
    V = shape["vocab_size"]
    turn1 = torch.randint(0, V, (prefix + QUESTION,), generator=cpu_gen).tolist()
    new = torch.randint(0, V, (args.new,), generator=cpu_gen).tolist()

    def engine(reuse: bool):
        eng = cupool.Engine(model, pool, max_batch=1, max_len=max_len, prefill_chunk=chunk,
                            eos_token_id=[], reuse_prefix=reuse)
        eng.warmup()
        return eng

    cold, warm = engine(False), engine(True)
    # the answer's decode steps are the last ones: the placement is fixed from here on
    answer = cold.generate([turn1], SamplingParams(max_tokens=args.answer,
                                                   ignore_eos=True))[0].output_ids
    turn2 = turn1 + answer + new
    held = turn1 + answer

    def prime():
        warm.generate([held], ONE)

    logits = FirstLogits(model)
    try:
        c = measure(cold, turn2, args.repeats, logits)
        w = measure(warm, turn2, args.repeats, logits, prime)
        cold_rows = host_rows(pool, lambda: cold.generate([turn2], ONE))
        prime()
        warm_rows = host_rows(pool, lambda: warm.generate([turn2], ONE))
        prof = {}
        if args.profile:
            prof["cold"] = profiled(lambda: cold.generate([turn2], ONE))
            prime()
            prof["reused"] = profiled(lambda: warm.generate([turn2], ONE))
    finally:
        logits.remove()
    errors = pool.errors()
    cold.close()                                     # their KV caches and graphs go
    warm.close()
    gc.collect()
    torch.cuda.empty_cache()
    pcie = pcie_h2d_GBps()
    row_bytes = layout.row_bytes
    results = {"shape": shape, "bank_percent": args.bank, "rows_per_layer": rows, "chunk": chunk,
               "scratch_rows": args.scratch_rows, "scratch_buffers": args.scratch_buffers,
               "prefix_tokens": prefix, "question_tokens": QUESTION, "answer_tokens": args.answer,
               "new_tokens": args.new, "turn2_tokens": len(turn2), "repeats": args.repeats,
               "target_speedup": TARGET, "pcie_h2d_GBps": pcie, "row_bytes": row_bytes,
               "prefill_ahead": bool(pool.prefill_ahead), "errors": errors,
               **({"host_experts": host} if host else {})}
    base = c["logits"][0]
    for name, m, (n_rows, cpu_rows) in (("cold", c, cold_rows), ("reused", w, warm_rows)):
        others = m["logits"][1:] if name == "cold" else m["logits"]
        host_bytes = (n_rows - cpu_rows) * row_bytes       # the rows that cross the link
        bound = host_bytes / (pcie * 1e9)
        results[name] = {
            **{k: v for k, v in m.items() if k != "logits"},
            "vs_first_cold_run": [compare(base, lg) for lg in others],
            "host_rows": n_rows, "host_cpu_rows": cpu_rows, "host_bytes": host_bytes,
            "pcie_bound_s": bound, "fraction_of_pcie_bound": bound / m["ttft_s"]}
    cr, wr = results["cold"], results["reused"]
    results["speedup"] = cr["ttft_s"] / wr["ttft_s"]
    results["cold_prefill_tok_per_s"] = len(turn2) / cr["ttft_s"]
    results["cold_run_to_run_max_abs_diff"] = max(x["max_abs_diff"]
                                                  for x in cr["vs_first_cold_run"])
    results["reused_vs_cold_max_abs_diff"] = max(x["max_abs_diff"]
                                                 for x in wr["vs_first_cold_run"])
    results["same_argmax"] = all(x["same_argmax"] for x in wr["vs_first_cold_run"])
    results["cold_same_argmax"] = all(x["same_argmax"] for x in cr["vs_first_cold_run"])
    results["meets_target"] = results["speedup"] >= TARGET
    if prof:
        results["profile"] = prof
    for name, r in (("cold", cr), ("reused", wr)):
        print(f"{name:>6}: turn 2 of {len(turn2)} tokens, time to first token "
              f"{r['ttft_s'] * 1e3:.1f} ms (median of {args.repeats}), cached "
              f"{r['cached_tokens'][-1]}, prefilled {r['prefilled_tokens'][-1]}; "
              f"{r['host_rows']} expert rows from the host"
              + (f" ({r['host_cpu_rows']} of them computed on its CPU)" if host else "")
              + f" ({r['host_bytes'] / 1e9:.2f} GB over the link): "
              f"PCIe bound {r['pcie_bound_s'] * 1e3:.1f} ms at {pcie:.1f} GB/s, achieved "
              f"{r['fraction_of_pcie_bound']:.0%} of it", flush=True)
    print(f"speedup {results['speedup']:.1f}x (target >= {TARGET:.0f}x, prefill ahead "
          f"{'on' if results['prefill_ahead'] else 'off'}); first-token logits: "
          f"reused vs cold max |diff| {results['reused_vs_cold_max_abs_diff']:.3g} (argmax "
          f"{'agrees' if results['same_argmax'] else 'differs'}), cold vs cold "
          f"{results['cold_run_to_run_max_abs_diff']:.3g} (argmax "
          f"{'agrees' if results['cold_same_argmax'] else 'differs'}) {errors or ''}", flush=True)
    for name, b in prof.items():
        print(f"{name:>6} profiled: {b['span_ms']:.1f} ms from first to last GPU event, "
              f"{b['idle_ms']:.1f} ms with no stream busy; streams busy "
              + ", ".join(f"{k}: {v:.1f}" for k, v in b["streams"].items()) + " ms; "
              + ", ".join(f"{g} {v['ms']:.1f} ms ({v['count']})" for g, v in b["groups"].items()),
              flush=True)
        for k in b["kernels"]:
            print(f"        {k['ms']:8.1f} ms {k['count']:6d}x  [{k['group']}] {k['name']}",
                  flush=True)
    save("bench_prefix", results, out)


if __name__ == "__main__":
    sys.exit(run(main, build_parser()))
