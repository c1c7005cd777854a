"""The first requests a fresh server answers: their time to first token after `Engine.warmup()`
(what `cupool serve` runs before it prints "ready"), beside the same request's time once the
process has answered one like it.

What a request runs for the first time in a process, it pays for there: kernels compiled or
loaded on first use (the pool's prefill builds, attention and the dense layers' GEMMs at a new
width), and whatever else a code path sets up once. `Engine.warmup()` runs its own requests so
that a user's first request does not wait for those; this measures what is left.

Model: the Qwen3-30B-A3B shape of bench_serve.py (48 layers, synthetic weights, the experts as
NVFP4 rows in pinned memory), a bank of `--bank` of each layer's experts (default 0.5), built as
`serve` builds its engine: `--max-batch` slots (serve's default 8), the fused decode step, host
experts where `cupool.serve.loader.auto_host_experts` turns them on (serve's default), then
`warmup()` (timed). Then, for each length of `--prompts` in turn (default 512, 16, 2048), a
request of that many fresh random tokens (one generated token; time from submission to that
token), then `--repeats` more requests of the same length (fresh tokens each: nothing reused),
whose median is the steady figure. The first request of the first length is what the first user
of a fresh server waits for; the first of a later length adds what that length runs first.

A fresh process matters: run it once per figure (kernels that a process has loaded stay
loaded). Kernels compiled into CuPy's disk cache (CUPY_CACHE_DIR) stay compiled across
processes: the first run after a source change (or on a fresh machine) also compiles them,
later ones load them.

`--profile N`: afterwards, N more requests of each length under cProfile, the host's Python time
by function (top 30 by own time, then by cumulative time), beside their mean time to first token:
where a prefill that the host's launches bound spends it. A reduced run.

Writes benchmarks/results/bench_first_request.json for a run with the defaults (--json PATH for
any run).
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import reduced_by, results_path, save  # noqa: E402

from cupool.cli import CLIParser, bounded_int, fraction, positive_int, run  # noqa: E402


def ttft_s(eng, prompt: list[int]) -> float:
    """Seconds from submitting `prompt` (one token asked for) to that token."""
    import cupool
    torch.cuda.synchronize()
    r = eng.generate([prompt], cupool.SamplingParams(max_tokens=1, ignore_eos=True))[0]
    return r.first_token_at - r.submitted_at


def profile_requests(eng, prompts: list[list[int]], top: int = 30) -> None:
    """The host's time in `prompts` (each one request, one token asked for) by function."""
    prof, spent = cProfile.Profile(), []
    for p in prompts:
        torch.cuda.synchronize()
        prof.enable()
        spent.append(ttft_s(eng, p))
        prof.disable()
    print(f"\n--- {len(prompts)} requests of {len(prompts[0])} prompt tokens under cProfile: "
          f"{statistics.mean(spent) * 1e3:.1f} ms to the first token (mean) ---")
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(top)
        print(buf.getvalue(), flush=True)


def main(args) -> int:
    import cupool
    from cupool import _cuda
    from cupool.serve.loader import auto_host_experts, enable_host_experts
    _cuda.require_gpu("bench_first_request")
    from bench_serve import build
    t0 = time.perf_counter()
    model, pool, _ = build(args.layers, args.max_batch, args.seed, args.bank)
    built_s = time.perf_counter() - t0
    why = auto_host_experts(pool, args.max_batch)
    if why is None:
        enable_host_experts(pool, args.max_batch, leave=True)
    eng = cupool.Engine(model, pool, max_batch=args.max_batch,
                        max_len=max(args.prompts) + 64, eos_token_id=[])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    eng.warmup()
    torch.cuda.synchronize()
    warmup_s = time.perf_counter() - t0
    print(f"built in {built_s:.1f} s; {eng.step_kind} step, host experts "
          f"{'on' if why is None else 'off: ' + why}; warmup() {warmup_s:.2f} s", flush=True)
    g = torch.Generator().manual_seed(args.seed)
    vocab = model.config.vocab_size
    fresh = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    lengths = []
    for n in args.prompts:
        first = ttft_s(eng, fresh(n))
        later = [ttft_s(eng, fresh(n)) for _ in range(args.repeats)]
        steady = statistics.median(later)
        lengths.append({"prompt_tokens": n, "first_ms": first * 1e3, "steady_ms": steady * 1e3,
                        "later_ms": [t * 1e3 for t in later], "first_over_steady": first / steady})
        print(f"{n:6d} prompt tokens: first request {first * 1e3:8.1f} ms to its first token, "
              f"then {steady * 1e3:8.1f} ms (median of {args.repeats}): "
              f"{first / steady:.2f}x", flush=True)
    if args.profile:
        for n in args.prompts:
            profile_requests(eng, [fresh(n) for _ in range(args.profile)])
    eng.close()
    results = {"shape": f"Qwen3-30B-A3B, {args.layers} layers", "bank": args.bank,
               "max_batch": args.max_batch, "step": eng.step_kind,
               "host_experts": why is None, "warmup_s": warmup_s, "lengths": lengths,
               "gpu": torch.cuda.get_device_name()}
    save("bench_first_request", results, results_path("bench_first_request", args.json,
                                                      reduced(args)))
    return 0


def reduced(args) -> list[str]:
    """How this run differs from the canonical one, as its flags read."""
    p = build_parser()
    shown = lambda v: " ".join(map(str, v)) if isinstance(v, list) else str(v)  # noqa: E731
    return reduced_by(args, p, "layers", "repeats") + \
        ([f"--profile {args.profile}"] if args.profile else []) + [
        f"--{name.replace('_', '-')} {shown(value)}" for name in ("bank", "max_batch", "prompts")
        if (value := getattr(args, name)) != p.get_default(name)]


def build_parser() -> CLIParser:
    import argparse
    p = CLIParser(prog="bench_first_request.py", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=positive_int, default=48)
    p.add_argument("--bank", type=fraction, default=0.5,
                   help="bank size, a fraction of each layer's experts (default 0.5)")
    p.add_argument("--max-batch", type=bounded_int(1, 256), default=8,
                   help="the engine's slots, as serve's --max-batch (default 8)")
    p.add_argument("--prompts", type=bounded_int(1, 1 << 15), nargs="+", default=[512, 16, 2048],
                   help="prompt lengths, in the order they are first asked for")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="requests of each length after its first (default 3)")
    p.add_argument("--profile", type=bounded_int(0, 100), default=0, metavar="N",
                   help="then N requests of each length under cProfile (default 0: none)")
    p.add_argument("--seed", type=positive_int, default=1)
    p.add_argument("--json", help="write the results here (default: "
                                  "results/bench_first_request.json for a run with the defaults)")
    return p


if __name__ == "__main__":
    sys.exit(run(main, build_parser()))
