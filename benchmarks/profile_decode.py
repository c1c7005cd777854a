"""Where one decode token's time goes: per-kernel device times of the bench_decode model
(Qwen3-30B-A3B shape, all experts in the bank, gate open, no misses), from torch.profiler over
eager decode steps, next to the time of the same step replayed as one CUDA graph.

Kernels are grouped: cupool (plan, copies, routing, MoE GEMM), matmul (cuBLAS), attention,
and elementwise/reduction (the norms, rotary, router softmax/top-k, residuals, casts). The
difference between the graph's time and the sum of kernel times is the gaps between kernels.
`--compile` runs the step through torch.compile (GraphDecoder(compile=True)'s path).

Prints its tables; writes the figures as JSON only to --json PATH.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time

import torch
from _common import capture, save, time_ms
from torch.profiler import ProfilerActivity, profile

import cupool
from cupool import _cuda, synthetic
from cupool.cli import CLIParser, bounded_int, output_file, positive_int, run

S = 16                 # prompt tokens
STEPS_MAX = 256        # the cache holds S + 512 positions; warm-up, timing and replays take 71

GROUPS = (("cupool", ("plan_step", "copy_rows", "moe_decode", "route_decode", "moe_w13",
                      "moe_w2")),
          ("matmul", ("gemm", "gemv", "nvjet", "cutlass", "sm90_xmma", "splitK")),
          ("attention", ("flash", "attention", "fmha", "sdpa", "efficient")))


def group_of(name: str) -> str:
    low = name.lower()
    for g, keys in GROUPS:
        if any(k.lower() in low for k in keys):
            return g
    return "elementwise/reduce/other"


def build_parser() -> CLIParser:
    p = CLIParser(prog="profile_decode.py", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=positive_int, default=48, help="MoE layers (>= 1)")
    p.add_argument("--steps", type=bounded_int(1, STEPS_MAX), default=4,
                   help=f"profiled eager steps (in [1, {STEPS_MAX}])")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--json", type=output_file, metavar="PATH", help="also write the figures here")
    return p


def main(args) -> None:
    _cuda.require_gpu("the decode profiler")
    shape = dict(synthetic.QWEN3_30B_A3B, num_hidden_layers=args.layers)
    E = shape["num_experts"]
    layout = cupool.RowLayout(shape["hidden_size"], shape["moe_intermediate_size"])
    model, specs = synthetic.qwen3_moe_dense_on_gpu("cuda", torch.bfloat16, **shape)
    gen = torch.Generator(device="cuda").manual_seed(0)
    pool = cupool.wrap(model, rows=E, layers=specs, max_decode_tokens=1, max_prefill_tokens=64,
                       expert_rows=lambda layer: synthetic.random_rows_fast(layout, E, gen, "cuda"))
    from transformers import StaticCache
    prompt = torch.randint(0, shape["vocab_size"], (1, S), device="cuda", generator=gen)
    cache = StaticCache(config=model.config, max_cache_len=S + 512)
    fwd = torch.compile(model, dynamic=False) if args.compile else model
    with torch.inference_mode():
        tok = model(input_ids=prompt, past_key_values=cache, use_cache=True,
                    cache_position=torch.arange(S, device="cuda")).logits[:, -1].argmax(-1, keepdim=True)
        pos = torch.tensor([S], device="cuda")
        pool.open()

        def step():
            lg = fwd(input_ids=tok, past_key_values=cache, use_cache=True, cache_position=pos).logits
            tok.copy_(lg[:, -1].argmax(-1, keepdim=True))
            pos.add_(1)
        t0 = time.perf_counter()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        warm_s = time.perf_counter() - t0
        eager_ms = time_ms(step, warmup=2, iters=10)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
        g = capture(lambda _: step())
        graph_ms = time_ms(g.replay, warmup=5, iters=50)
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
    print(f"layers {args.layers}, compile={args.compile} (warm-up incl. compile {warm_s:.1f} s)")
    print(f"per token: graph replay {graph_ms:.3f} ms, eager {eager_ms:.3f} ms, "
          f"kernel time {kernel_ms:.3f} ms in {launches:.0f} kernels, gaps in graph "
          f"{graph_ms - kernel_ms:.3f} ms")
    for gname, (ms, n) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        print(f"  {gname:>26}: {ms:7.3f} ms  {n:6.0f} kernels  ({ms / args.layers * 1e3:6.1f} us/layer)")
    for name, (ms, n) in top:
        print(f"  {ms * 1e3 / n:7.2f} us x {n:5.0f} = {ms:6.3f} ms  {name[:110]}")
    save("profile_decode", {
        "layers": args.layers, "compile": args.compile, "graph_ms_per_token": graph_ms,
        "eager_ms_per_token": eager_ms, "kernel_ms_per_token": kernel_ms,
        "kernels_per_token": launches, "warmup_s": warm_s,
        "groups": {k: {"ms": v[0], "kernels": v[1]} for k, v in groups.items()},
        "top": [{"name": n, "ms": v[0], "count": v[1]} for n, v in top]}, args.json)


if __name__ == "__main__":
    sys.exit(run(main, build_parser()))
