"""What sampling the next token costs a decode step, inside a CUDA graph.

B rows of V = 151,936 logits (Qwen3's vocabulary) in the dtype the fused step's output head
writes (bf16), fresh random values. Timed: greedy (temperature 0: `cupool.sampling.sample` with
`greedy_only`, one argmax, what the Engine's step runs when every request is greedy), and sampled
(temperature 0.8, top-p 0.95, what chat UIs send) by the reference's tensor ops
(`cupool.sampling.sample`) and by the kernel (`cupool.ops.sampler.Sampler`, what the Engine's step
runs on a GPU). Each is captured --calls times in one CUDA graph; the median of --replays replays,
timed with CUDA events after warm-up, divided by --calls. The limit beside each figure is the
greedy argmax over the same logits: one launch that reads them, which sampling cannot beat.

Writes benchmarks/results/bench_sampling.json (a run with fewer rows, calls or replays than the
defaults writes nothing unless --json PATH is given).
"""

from __future__ import annotations

import sys

import torch
from _common import capture, reduced_by, results_path, save, time_ms

from cupool import _cuda
from cupool.cli import CLIParser, output_file, positive_int, run
from cupool.ops.sampler import Sampler
from cupool.sampling import sample

VOCAB = 151936


def case(B: int, args) -> dict:
    g = torch.Generator(device="cuda").manual_seed(B)
    logits = (torch.randn(B, VOCAB, device="cuda", generator=g) * 3).to(torch.bfloat16)
    seeds = torch.arange(B, device="cuda", dtype=torch.int64) + 12345
    steps = torch.zeros(B, device="cuda", dtype=torch.int64)
    top_k = torch.zeros(B, device="cuda", dtype=torch.int64)
    out = torch.empty(B, device="cuda", dtype=torch.int64)
    row = {"rows": B}
    kernel = Sampler(B, VOCAB, logits.dtype, logits.device)
    for name, temp, top_p, fn in (
            ("greedy", 0.0, 1.0, lambda *a: sample(*a, greedy_only=True)),
            ("sampled_torch", 0.8, 0.95, sample),
            ("sampled_kernel", 0.8, 0.95, lambda *a: kernel(*a, out=out))):
        temperature = torch.full((B,), temp, device="cuda")
        p = torch.full((B,), top_p, device="cuda")

        def call(c, temperature=temperature, p=p, fn=fn):
            out.copy_(fn(logits, temperature, top_k, p, seeds, steps))
            steps.add_(1)

        graph = capture(call, args.calls)
        row[f"{name}_us"] = time_ms(graph.replay, warmup=3, iters=args.replays) * 1e3 / args.calls
        del graph
    for name in ("sampled_torch", "sampled_kernel"):
        row[f"{name}_over_greedy"] = row[f"{name}_us"] / row["greedy_us"]
    print(f"B={B:3d}: greedy argmax {row['greedy_us']:7.1f} µs · sampled (T 0.8, top-p 0.95): "
          f"tensor ops {row['sampled_torch_us']:7.1f} µs ({row['sampled_torch_over_greedy']:.1f}× "
          f"greedy), kernel {row['sampled_kernel_us']:7.1f} µs "
          f"({row['sampled_kernel_over_greedy']:.1f}×) a step", flush=True)
    return row


def build_parser() -> CLIParser:
    p = CLIParser(prog="bench_sampling.py", description=__doc__)
    p.add_argument("--rows", type=positive_int, nargs="+", default=[1, 8, 16],
                   help="B: sequences a step samples")
    p.add_argument("--calls", type=positive_int, default=20, help="calls captured in a graph")
    p.add_argument("--replays", type=positive_int, default=50, help="timed replays (median)")
    p.add_argument("--json", type=output_file, default=None, help="write the results here")
    return p


def main(args) -> None:
    _cuda.require_gpu("the sampling benchmark")
    out = results_path("bench_sampling",
                       args.json, reduced_by(args, build_parser(), "rows", "calls", "replays"))
    rows = [case(B, args) for B in args.rows]
    save("bench_sampling", {"vocab": VOCAB, "logits": "bf16",
                            "sampled_params": {"temperature": 0.8, "top_p": 0.95, "top_k": 0},
                            "calls": args.calls, "replays": args.replays, "cases": rows}, out)


if __name__ == "__main__":
    sys.exit(run(main, build_parser()))
