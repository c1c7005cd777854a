"""Prefix reuse: the time to first token of a conversation's second turn, prefilled cold against
reusing the slot that holds the first turn, on one Qwen3-30B-A3B-shaped model.

Model: 48 layers, 128 experts, top-8, H=2048, I=768, random weights, the experts as NVFP4 rows in
pinned memory, a bank of `--bank` % of each layer's experts (default 50), as bench_long.py.

Conversation: turn 1 is a shared prefix of `--prefix` tokens (default 16K: a system prompt, tools
and earlier turns of an agent) and 64 tokens of a question, answered with `--answer` greedy
tokens (default 32); turn 2 is turn 1, its answer and `--new` new tokens (default 128). Turn 2's
time to first token (submission to the first token, `cupool.Engine.generate` of one token,
synchronized) is measured `--repeats` times (default 5, median) on two engines over the same
model and pool: `reuse_prefix=False` (the whole prompt prefilled) and `reuse_prefix=True` (turn
1 run before each measurement, untimed, so the slot holds it; only the new tokens are
prefilled). Both must give the same first token; the reused run reports how many prompt tokens
it took from the slot (`cached_tokens`). Target: reused >= 10x faster.

Writes benchmarks/results/bench_prefix.json. A reduced run (another prefix, --small, another
bank, fewer repeats) writes nothing unless --json PATH is given.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch
from _common import reduced_by, results_path, save

import cupool
from cupool import _cuda, synthetic
from cupool.cli import CLIParser, bounded_int, output_file, positive_int, run
from cupool.sampling import SamplingParams

TARGET = 10.0
QUESTION = 64


def ttft(engine, prompt) -> tuple[float, object]:
    """Seconds from submission to the first token of `prompt` (one token generated)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    r = engine.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))[0]
    torch.cuda.synchronize()
    return time.perf_counter() - t0, r


def second_turn(model, pool, turn1, new, answer: int, repeats: int, reuse: bool,
                max_len: int, chunk: int) -> dict:
    eng = cupool.Engine(model, pool, max_batch=1, max_len=max_len, prefill_chunk=chunk,
                        eos_token_id=[], reuse_prefix=reuse)
    eng.warmup()
    times, cached, first = [], [], []
    for _ in range(repeats):
        r1 = eng.generate([turn1], SamplingParams(max_tokens=answer, ignore_eos=True))[0]
        turn2 = turn1 + r1.output_ids + new
        before = eng.prefill_tokens
        s, r2 = ttft(eng, turn2)
        times.append(s)
        cached.append(r2.cached_tokens)
        first.append(r2.output_ids[0])
        prefilled = eng.prefill_tokens - before
    out = {"reuse_prefix": reuse, "ttft_s": statistics.median(times), "ttft_all_s": times,
           "turn2_tokens": len(turn2), "cached_tokens": cached, "prefilled_tokens": prefilled,
           "first_tokens": first, "answer": r1.output_ids, "errors": pool.errors()}
    eng.close()
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    return out


def build_parser() -> CLIParser:
    p = CLIParser(prog="bench_prefix.py", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefix", type=bounded_int(16), default=16384,
                   help="shared prefix tokens (>= 16)")
    p.add_argument("--new", type=positive_int, default=128, help="turn 2's new tokens (>= 1)")
    p.add_argument("--answer", type=positive_int, default=32, help="turn 1's answer tokens")
    p.add_argument("--repeats", type=positive_int, default=5, help="measurements a mode")
    p.add_argument("--chunk", type=bounded_int(16), default=4096,
                   help="prompt tokens a forward (the pool's max_prefill_tokens)")
    p.add_argument("--bank", type=bounded_int(7, 100), default=50,
                   help="bank rows a layer, %% of E (>= 7: top-8 of 128)")
    p.add_argument("--small", action="store_true", help="tiny shape, short prompts (smoke test)")
    p.add_argument("--json", type=output_file, metavar="PATH",
                   help="write the results here instead of benchmarks/results/bench_prefix.json")
    return p


def reduced(args) -> list[str]:
    why = reduced_by(args, build_parser(), "prefix", "new", "answer", "repeats", "small")
    if args.bank != 50:
        why.append(f"--bank {args.bank} (not 50)")
    return why


def main(args) -> None:
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
                       max_prefill_tokens=chunk,
                       expert_rows=lambda layer: synthetic.random_rows_fast(layout, E, gen, "cuda"))
    print(f"built in {time.perf_counter() - t0:.0f} s: {pool}", flush=True)
    cpu_gen = torch.Generator().manual_seed(1)
    V = shape["vocab_size"]
    turn1 = torch.randint(0, V, (prefix + QUESTION,), generator=cpu_gen).tolist()
    new = torch.randint(0, V, (args.new,), generator=cpu_gen).tolist()
    results = {"shape": shape, "bank_percent": args.bank, "rows_per_layer": rows, "chunk": chunk,
               "prefix_tokens": prefix, "question_tokens": QUESTION, "answer_tokens": args.answer,
               "new_tokens": args.new, "repeats": args.repeats, "target_speedup": TARGET}
    for reuse in (False, True):
        r = second_turn(model, pool, turn1, new, args.answer, args.repeats, reuse, max_len,
                        chunk)
        results["reused" if reuse else "cold"] = r
        print(f"{'reused' if reuse else 'cold':>6}: turn 2 of {r['turn2_tokens']} tokens, time to "
              f"first token {r['ttft_s'] * 1e3:.1f} ms (median of {args.repeats}), cached "
              f"{r['cached_tokens'][-1]}, prefilled {r['prefilled_tokens']} {r['errors'] or ''}",
              flush=True)
    cold, warm = results["cold"], results["reused"]
    results["speedup"] = cold["ttft_s"] / warm["ttft_s"]
    results["cold_prefill_tok_per_s"] = cold["turn2_tokens"] / cold["ttft_s"]
    results["same_first_tokens"] = cold["first_tokens"] == warm["first_tokens"]
    results["same_answers"] = cold["answer"] == warm["answer"]
    results["meets_target"] = results["speedup"] >= TARGET
    print(f"speedup {results['speedup']:.1f}x (target >= {TARGET:.0f}x), same first tokens: "
          f"{results['same_first_tokens']}, same turn-1 answers: {results['same_answers']}",
          flush=True)
    save("bench_prefix", results, out)


if __name__ == "__main__":
    sys.exit(run(main, build_parser()))
