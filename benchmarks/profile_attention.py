"""Where the fused decode step's attention spends its time, by context length: one layer's
`dense_attention` launch (`cupool.ops.dense_attention.DecodeAttention`, the fused step's default
build) on the Qwen3-30B-A3B attention shape (32 query heads over 4 KV heads of 128 dims, q/k
norms, batch 1 unless --batch), its cache filled with random keys and values.

For each context (positions the token attends to):
- time: a CUDA graph of --layers launches, each on its own layer's cache (as a decode step's
  layers: nothing served from L2 by the launch before), median of the replays over the layers,
  beside the bytes of keys and values a launch reads at the HBM read bandwidth measured in the
  same run;
- phases: the ATTN_TRACE build of the same kernel (the same outputs; each block stamps
  %globaltimer at its phases), one launch after an L2 flush, as percentiles over the blocks of
  the used parts, in µs from the first block's start: producers waited for, queries normed and
  rotated (the new key and value written in the same phase), the tile loop done, the part
  written and its ticket taken (one part: the output written); then the final merge's block
  (part weights ready, merge done; above 16 parts the groups' merges come before it).

`--min-chunk N ...` repeats every context with those fewest positions a part (the fused step's
`CUPOOL_DENSE_SHAPE=attn=aheadc<N>`; default 64, the kernel's own).

Prints its tables; writes the figures as JSON only to --json PATH.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from _common import capture, hbm_read_GBps, save, time_ms

from cupool import _cuda
from cupool.cli import CLIParser, bounded_int, output_file, positive_int, run
from cupool.ops.dense_attention import (
    MINCHUNK,
    TRACE_STAMPS,
    AttentionWorkspace,
    DecodeAttention,
    check_min_chunk,
    parts,
    trace_buffer,
)

NH, HK, D = 32, 4, 128          # Qwen3-30B-A3B's attention
PHASES = ("waited", "q, k normed", "kv written", "tiles done", "ticket taken")


def min_chunk_arg(text: str) -> int:
    try:
        return check_min_chunk(int(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> CLIParser:
    p = CLIParser(prog="profile_attention.py", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=bounded_int(1, 131072), nargs="+",
                   default=[16, 1024, 4096, 32768], help="positions attended to (default 16 1024 "
                                                         "4096 32768)")
    p.add_argument("--batch", type=bounded_int(1, 16), default=1, help="tokens of the step")
    p.add_argument("--layers", type=positive_int, default=16,
                   help="launches in the timed graph, each on its own cache (default 16)")
    p.add_argument("--min-chunk", type=min_chunk_arg, nargs="+", default=[MINCHUNK],
                   metavar="N", help="fewest positions a part, a multiple of 64 (default 64)")
    p.add_argument("--json", type=output_file, metavar="PATH", help="also write the figures here")
    return p


def _inputs(B: int, L: int, layers: int, gen):
    bf = torch.bfloat16
    qkv = torch.randn(B, (NH + 2 * HK) * D, device="cuda", generator=gen).to(bf)
    caches = [(torch.randn(B, HK, L, D, device="cuda", generator=gen).to(bf),
               torch.randn(B, HK, L, D, device="cuda", generator=gen).to(bf))
              for _ in range(layers)]
    ang = torch.rand(L, D // 2, device="cuda", generator=gen) * 6.3
    cos = torch.cat([ang.cos()] * 2, -1).to(bf)
    sin = torch.cat([ang.sin()] * 2, -1).to(bf)
    qn = (torch.randn(D, device="cuda", generator=gen) * 0.3 + 1).to(bf)
    kn = (torch.randn(D, device="cuda", generator=gen) * 0.3 + 1).to(bf)
    return qkv, caches, cos, sin, qn, kn


def one_case(ctx: int, min_chunk: int, args, hbm: float) -> dict:
    B, sms = args.batch, _cuda.target().sms
    L = ctx + 1
    gen = torch.Generator(device="cuda").manual_seed(ctx)
    qkv, caches, cos, sin, qn, kn = _inputs(B, L, args.layers, gen)
    pos = torch.full((B,), ctx - 1, dtype=torch.int64, device="cuda")
    ws = AttentionWorkspace(B, NH, HK, D, parts(B, HK, L, sms, min_chunk), "cuda")
    kw = dict(q_norm=qn, k_norm=kn, eps=1e-6, scale=D ** -0.5, workspace=ws, ahead=True,
              min_chunk=min_chunk)
    op = DecodeAttention(NH, HK, D, **kw)
    out = torch.empty(B, NH * D, dtype=torch.bfloat16, device="cuda")
    graph = capture(lambda i: op(qkv, pos, *caches[i], cos, sin, out), args.layers)
    us = time_ms(graph.replay, warmup=3, iters=30) * 1e3 / args.layers
    kv_bytes = 2 * B * HK * ctx * D * 2
    traced = DecodeAttention(NH, HK, D, **kw, trace=True)
    stamps = trace_buffer(ws)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    k, v = caches[0]
    reps = []
    for rep in range(3):
        flush.fill_(rep)                          # keys and values out of L2, as in a step
        stamps.zero_()
        torch.cuda.synchronize()
        traced(qkv, pos, k, v, cos, sin, out, trace=stamps)
        torch.cuda.synchronize()
        reps.append(stamps.view(-1, TRACE_STAMPS).cpu())
    tr = reps[-1]
    used = tr[(tr[:, 1] > 0)]
    t0 = int(tr[tr[:, 0] > 0, 0].min())
    last = used[used[:, 7] > 0]
    rel = lambda col: [(int(v) - t0) / 1e3 for v in col]       # noqa: E731

    def pct(vals):
        vals = sorted(vals)
        return [vals[min(len(vals) - 1, int(q / 100 * len(vals)))] for q in (0, 50, 100)]

    phases = {name: pct(rel(used[:, i + 1])) for i, name in enumerate(PHASES)}
    merge = {"weights ready": rel(last[:, 6]), "merge done": rel(last[:, 7])}
    ends = [statistics.median(r[r[:, 7] > 0, 7].tolist()) - int(r[r[:, 0] > 0, 0].min())
            for r in reps]
    return {"context": ctx, "min_chunk": min_chunk, "parts": ws.num_parts,
            "parts_used": int(len(used)) // (B * HK), "us_per_launch": us,
            "kv_bytes": kv_bytes, "kv_at_hbm_us": kv_bytes / (hbm * 1e3),
            "traced_us_first_start_to_merge_done": [e / 1e3 for e in ends],
            "phases_us_p0_p50_p100": phases, "merge_us": merge}


def main(args) -> None:
    _cuda.require_gpu("the attention profiler")
    hbm = hbm_read_GBps()
    rows = []
    print(f"dense_attention, {NH} heads over {HK} KV heads of {D}, batch {args.batch}; "
          f"HBM read {hbm:.0f} GB/s; graph of {args.layers} launches")
    for ctx in args.contexts:
        for mc in args.min_chunk:
            r = one_case(ctx, mc, args, hbm)
            rows.append(r)
            print(f"--- context {ctx}, min_chunk {mc}: {r['parts_used']} of {r['parts']} parts; "
                  f"{r['us_per_launch']:.2f} us a launch (keys and values {r['kv_bytes'] / 1e6:.2f}"
                  f" MB: {r['kv_at_hbm_us']:.2f} us at HBM read); traced first start to merge "
                  f"done {', '.join(f'{v:.2f}' for v in r['traced_us_first_start_to_merge_done'])}"
                  f" us")
            print("    phase (us from the first block's start: min / median / max over the used "
                  "parts' blocks)")
            for name, (a, m, z) in r["phases_us_p0_p50_p100"].items():
                print(f"    {name:>14}: {a:7.2f} {m:7.2f} {z:7.2f}")
            for name, vals in r["merge_us"].items():
                print(f"    {'merge ' + name:>14}: " + " ".join(f"{v:7.2f}" for v in vals))
    save("profile_attention", {"batch": args.batch, "layers": args.layers,
                               "hbm_read_GBps": hbm, "cases": rows}, args.json)


if __name__ == "__main__":
    sys.exit(run(main, build_parser()))
