"""The main job: a Qwen3-MoE-shaped model whose experts live in the cupool bank, decoded by
`cupool.Engine` as `cupool serve` runs it (the fused decode step, one CUDA graph per token).

The dense part (attention, norms, router, embeddings) is built on the GPU with random weights and
the experts directly as random NVFP4 rows (a 30B-parameter model is never materialised in bf16).
The model is wrapped so that the bank holds `--bank` of each layer's experts at start, a short
prompt is prefilled, N tokens are decoded by graph replay, and the figures are printed: tok/s,
hit rate, and where the GPU memory went.

    python examples/decode_loop.py                 # default: 8 layers of the Qwen3-30B-A3B shape
    python examples/decode_loop.py --full          # all 48 layers (needs ~16 GiB pinned memory)
    python examples/decode_loop.py --small         # a tiny model (tests)
    python examples/decode_loop.py --full --compile  # torch.compile where the step is not fused
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import cupool
from cupool import _cuda, synthetic
from cupool.cli import (
    CLIParser,
    bounded_int,
    fraction,
    nonnegative_int,
    output_file,
    positive_int,
    run,
    size,
)


def build_parser() -> CLIParser:
    p = CLIParser(prog="decode_loop.py", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--full", action="store_true",
                       help="the full Qwen3-30B-A3B shape (48 layers)")
    shape.add_argument("--small", action="store_true", help="a tiny model (seconds; for tests)")
    p.add_argument("--layers", type=positive_int, default=8,
                   help="MoE layers (>= 1; default 8; --full: 48)")
    p.add_argument("--bank", type=fraction, default=0.5,
                   help="fraction of each layer's experts the bank holds at start (in (0, 1]; "
                        "default 0.5)")
    p.add_argument("--budget", type=size, help="GPU memory the whole model may use (e.g. "
                   "'20GiB'); overrides --bank")
    p.add_argument("--tokens", type=bounded_int(2), default=128, help="tokens to decode (>= 2)")
    p.add_argument("--prompt", type=positive_int, default=16, help="prompt length (>= 1)")
    p.add_argument("--routing", choices=["router", "locality", "uniform"], default="locality",
                   help="router: the model's own (random, near uniform); locality/uniform: replay "
                        "a synthetic trace (locality: ~45%% reuse at the next token)")
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--no-fused", action="store_true",
                   help="run the model's own forward instead of the fused decode step")
    p.add_argument("--compile", action="store_true",
                   help="with --no-fused: the model's forward through torch.compile before "
                        "capture (cupool's layers stay opaque ops; the first step compiles)")
    p.add_argument("--json", type=output_file, metavar="PATH",
                   help="also write the figures to this JSON file")
    return p


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def shape_of(args) -> dict:
    if args.small:
        return dict(synthetic.TINY)
    return dict(synthetic.QWEN3_30B_A3B, num_hidden_layers=48 if args.full else args.layers)


def main(args) -> int:
    _cuda.require_gpu("the decode-loop example")
    shape = shape_of(args)
    L, E, K = shape["num_hidden_layers"], shape["num_experts"], shape["num_experts_per_tok"]
    H, I = shape["hidden_size"], shape["moe_intermediate_size"]
    print(f"model: {L} MoE layers, E={E}, top-{K}, H={H}, I={I}, vocab {shape['vocab_size']}")
    t0 = time.perf_counter()
    model, specs = synthetic.qwen3_moe_dense_on_gpu("cuda", torch.bfloat16, seed=args.seed, **shape)
    layout = cupool.RowLayout(H, I)
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    rows = None if args.budget else max(K, round(args.bank * E))
    pool = cupool.wrap(model, rows=rows, budget=args.budget, layers=specs,
                       expert_rows=lambda layer: synthetic.random_rows_fast(layout, E, gen, "cuda"),
                       max_decode_tokens=1, max_prefill_tokens=max(args.prompt, 64))
    print(f"built + wrapped in {time.perf_counter() - t0:.1f} s: {pool}")
    if args.routing != "router":
        from cupool import trace as tr
        from cupool.replay import Replayer
        make = tr.synthetic if args.routing == "locality" else tr.uniform
        kw = dict(tr.QWEN3_LOCALITY) if args.routing == "locality" else {}
        trace = make(args.tokens + 8, L, E, K, seed=args.seed, **kw)
        Replayer(pool, trace).install()
        print(f"routing: {trace.note}")
    prompt = torch.randint(0, shape["vocab_size"], (1, args.prompt), device="cuda", generator=gen)
    t1 = time.perf_counter()
    engine = cupool.Engine(model, pool, max_batch=1, max_len=args.prompt + args.tokens,
                           fused=False if args.no_fused else None, compile=args.compile,
                           eos_token_id=[])
    engine.warmup()                               # the decode graphs, captured before timing
    capture_s = time.perf_counter() - t1
    req = engine.generate([prompt[0].tolist()],
                          cupool.SamplingParams(max_tokens=args.tokens, ignore_eos=True))[0]
    tok_per_s = req.decode_tokens_per_s
    prefill_s = req.first_token_at - req.submitted_at
    stats = pool.stats()
    hits = sum(s["hits"] for s in stats)
    misses = sum(s["misses"] for s in stats)
    copied = sum(s["bytes_copied"] for s in stats)
    figures = {
        "gpu": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "layers": L, "experts": E, "top_k": K, "rows_per_layer": pool.rows_per_layer,
        "tokens": args.tokens, "routing": args.routing, "compile": args.compile,
        "step": engine.step_kind, "tok_per_s": tok_per_s,
        "ms_per_token": 1e3 / tok_per_s, "prefill_s": prefill_s,
        "capture_s": capture_s, "hit_rate": hits / max(1, hits + misses),
        "pcie_bytes_per_token": copied / max(1, args.tokens - 1),
        "errors": pool.errors(),
    }
    print(f"decoded {args.tokens} tokens ({engine.step_kind}): {tok_per_s:.1f} tok/s "
          f"({figures['ms_per_token']:.2f} ms/token), prefill {prefill_s * 1e3:.0f} ms, "
          f"capture {capture_s:.2f} s")
    print(f"hit rate {figures['hit_rate']:.3f}, {figures['pcie_bytes_per_token'] / 2**20:.1f} MiB "
          f"over PCIe per token, errors: {figures['errors'] or 'none'}")
    print(pool.stats_table())
    print(pool.report())
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(run(main, build_parser()))
