"""Long prompts and a long decode soak through the pool, on one Qwen3-30B-A3B-shaped model.

Model: 48 layers, 128 experts, top-8, H=2048, I=768, random weights, the experts as NVFP4 rows in
pinned memory, a bank of `--bank` % of each layer's experts (default 50).

- prefill: one prompt of each `--contexts` length (default 4K, 32K, 64K, 128K tokens) through
  `cupool.Engine` (one slot; the prompt runs in chunks of `--chunk` tokens, each through the
  pooled layers' partition path: experts in the bank read there, the others copied through the
  scratch). Time: the engine's `generate` of that prompt with one new token, after a warm-up
  request (graphs captured, cache allocated) and, once before all of them, an untimed prompt of
  one chunk (the prefill kernels compiled); tok/s = prompt tokens / time. With it, the peak GPU
  memory of torch's allocator and the process's peak RSS.
- soak: `--soak-steps` layer steps (default 100,000: ⌈100,000 / 48⌉ decoded tokens) of graph
  decode with the locality trace replayed through the routing hook (`cupool.trace.QWEN3_LOCALITY`),
  then `pool.verify()` over every bank row (tables a bijection, each row byte-equal to its store
  row) and the sticky error flags.

Writes benchmarks/results/bench_long.json. A reduced run (fewer or shorter contexts, fewer soak
steps, --small, another bank size) writes nothing unless --json PATH is given.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import torch
from _common import peak_rss_bytes, reduced_by, results_path, save

import cupool
from cupool import _cuda, synthetic
from cupool import trace as tr
from cupool.cli import CLIParser, bounded_int, output_file, positive_int, run
from cupool.replay import Replayer
from cupool.sampling import SamplingParams


def prefill(model, pool, vocab: int, context: int, chunk: int, gen) -> dict:
    eng = cupool.Engine(model, pool, max_batch=1, max_len=context + 2, prefill_chunk=chunk,
                        eos_token_id=[])
    eng.warmup()
    prompt = torch.randint(0, vocab, (context,), generator=gen).tolist()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    req = eng.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))[0]
    torch.cuda.synchronize()
    s = time.perf_counter() - t0
    out = {"context": context, "seconds": s, "tok_per_s": context / s,
           "peak_gpu_GiB": torch.cuda.max_memory_allocated() / 2**30,
           "peak_rss_GiB": peak_rss_bytes() / 2**30, "finish": req.finish_reason, "errors": pool.errors()}
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    return out


def soak(model, pool, layers: int, experts: int, top_k: int, vocab: int, steps: int) -> dict:
    tokens = -(-steps // layers) + 1                  # + the prefill's token
    trace = tr.synthetic(tokens + 64, layers, experts, top_k, seed=3, **tr.QWEN3_LOCALITY)
    replay = Replayer(pool, trace)
    replay.install()
    pool.bank.reset_stats()
    prompt = torch.randint(0, vocab, (1, 16), device="cuda")
    eng = cupool.Engine(model, pool, max_batch=1, max_len=16 + tokens, eos_token_id=[])
    req = eng.generate([prompt[0].tolist()], SamplingParams(max_tokens=tokens, ignore_eos=True))[0]
    eng.close()
    replay.uninstall()
    st = pool.stats()
    hits, misses = sum(s["hits"] for s in st), sum(s["misses"] for s in st)
    out = {"layer_steps": (tokens - 1) * layers, "tokens": tokens,
           "tok_per_s": req.decode_tokens_per_s,
           "hit_rate": hits / max(1, hits + misses), "errors": pool.errors()}
    try:
        out["verify_rows"] = pool.verify()
        out["verify_mismatches"] = 0
    except Exception as e:  # noqa: BLE001 (BankVerifyError: the result says what differed)
        out["verify_error"] = f"{type(e).__name__}: {e}"[:1000]
    return out


def build_parser() -> CLIParser:
    p = CLIParser(prog="bench_long.py", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", nargs="+", type=bounded_int(16), default=[4096, 32768, 65536, 131072],
                   help="prompt lengths of the prefill runs (>= 16)")
    p.add_argument("--chunk", type=bounded_int(16), default=4096,
                   help="prompt tokens a forward (the pool's max_prefill_tokens)")
    p.add_argument("--bank", type=bounded_int(7, 100), default=50,
                   help="bank rows a layer, %% of E (>= 7: top-8 of 128)")
    p.add_argument("--soak-steps", type=positive_int, default=100_000,
                   help="layer steps of the decode soak (>= 1)")
    p.add_argument("--small", action="store_true", help="tiny shape, short prompts (smoke test)")
    p.add_argument("--json", type=output_file, metavar="PATH",
                   help="write the results here instead of benchmarks/results/bench_long.json")
    return p


def reduced(args) -> list[str]:
    why = reduced_by(args, build_parser(), "contexts", "soak_steps", "small")
    if args.bank != 50:
        why.append(f"--bank {args.bank} (not 50)")
    return why


def main(args) -> None:
    _cuda.require_gpu("the long-prompt benchmark")
    out = results_path("bench_long", args.json, reduced(args))
    contexts = [c for c in args.contexts] if not args.small else [256, 1024]
    longest = max(contexts) + 2
    shape = dict(synthetic.TINY) if args.small else dict(synthetic.QWEN3_30B_A3B)
    shape["max_position_embeddings"] = max(shape["max_position_embeddings"], longest)
    L, E, K = shape["num_hidden_layers"], shape["num_experts"], shape["num_experts_per_tok"]
    layout = cupool.RowLayout(shape["hidden_size"], shape["moe_intermediate_size"])
    rows = max(K, E * args.bank // 100)
    t0 = time.perf_counter()
    model, specs = synthetic.qwen3_moe_dense_on_gpu("cuda", torch.bfloat16, **shape)
    gen = torch.Generator(device="cuda").manual_seed(0)
    chunk = min(args.chunk, max(contexts))
    pool = cupool.wrap(model, rows=rows, layers=specs, max_decode_tokens=1,
                       max_prefill_tokens=chunk,
                       expert_rows=lambda layer: synthetic.random_rows_fast(layout, E, gen, "cuda"))
    print(f"built in {time.perf_counter() - t0:.0f} s: {pool}", flush=True)
    results = {"shape": shape, "bank_percent": args.bank, "rows_per_layer": rows, "chunk": chunk,
               "prefill": [], "soak": None}
    cpu_gen = torch.Generator().manual_seed(1)
    prefill(model, pool, shape["vocab_size"], chunk, chunk, cpu_gen)   # compiles the prefill kernels
    for c in contexts:
        r = prefill(model, pool, shape["vocab_size"], c, chunk, cpu_gen)
        results["prefill"].append(r)
        print(f"prefill {c:>7} tokens: {r['seconds']:.2f} s, {r['tok_per_s']:,.0f} tok/s, peak GPU "
              f"{r['peak_gpu_GiB']:.1f} GiB, RSS {r['peak_rss_GiB']:.1f} GiB {r['errors'] or ''}",
              flush=True)
        save("bench_long", {**results, "partial": True}, out)
    steps = args.soak_steps if not args.small else 2 * L
    results["soak"] = soak(model, pool, L, E, K, shape["vocab_size"], steps)
    print(f"soak: {results['soak']}", flush=True)
    save("bench_long", results, out)


if __name__ == "__main__":
    sys.exit(run(main, build_parser()))
