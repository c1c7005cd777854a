"""NVFP4 MoE GEMM speed against the limits measured in the same run.

- decode (T=1, 4; K=8; E=128): one layer call (the moe_decode launch; for --decode-kernels pair,
  route_decode + w13 + w2) timed inside a CUDA graph of `--layers` calls, each on a different
  layer's experts so nothing is served from L2; achieved = bytes of the distinct experts' rows /
  time, as a fraction of the HBM read bandwidth.
- prefill, all experts resident (T=512, 2048): time / torch bf16 on already-dequantized weights
  (best of a per-expert matmul loop and torch._grouped_mm) on the same routing. Timed on the
  resident path (no host store: one GEMM pair) and, beside it, on the partition path with the
  host store attached and nothing on the host (what a Pool call does: one GEMM pair a scratch
  chunk, each launched from Python), with the host time of each call.
- prefill, half the experts in pinned host memory: time / (their bytes ÷ PCIe H2D bandwidth).

Writes benchmarks/results/bench_gemm.json. A reduced run (fewer layers, dims, token counts or
kernels than the defaults, a skipped part, or a --scratch sweep) writes nothing unless --name NAME
(benchmarks/results/NAME.json) or --json PATH is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from _common import (
    ExpertRows,
    capture,
    hbm_copy_GBps,
    hbm_read_GBps,
    RESULTS,
    pcie_h2d_GBps,
    reduced_by,
    results_path,
    save,
    time_ms,
)

from cupool import _cuda
from cupool.activation import SILU, swiglu_clamp
from cupool.cli import CLIParser, bounded_int, fields, output_file, positive_int, run
from cupool.gemm import MoEGemm
from cupool.layout import RowLayout, unpack_row
from cupool.ops.moe_gemm import PREFILL
from cupool.synthetic import dequantize_exact, random_rows_fast


def routing(T, K, E, gen):
    scores = torch.rand(T, E, generator=gen, device="cuda")
    w, ids = scores.topk(K, dim=-1)
    return ids, torch.softmax(w, dim=-1)


def decode_call(gemm, x, lane_addr, w, out, override=None):
    """gemm.decode, or with `override` ({"minb": .., "w13_split": ..}) the build the per-call
    rules choose with those fields replaced, launched on the same workspaces."""
    if not override:
        return gemm.decode(x, lane_addr, w, out=out)
    w = w.reshape(-1).float().contiguous()
    build = dataclasses.replace(gemm.decoder.choose(lane_addr.numel(), x, w), **override)
    gemm.decoder.launch(build, x, lane_addr, None, w, gemm.topk, 2, gemm.decode_workspaces, out,
                        gemm.error)
    return out


def bench_decode(layout, E, T, K, layers, gen, hbm, kernel="fused", override=None, outputs=None,
                 activation=SILU):
    """Layer time of a graph of `layers` decode calls; `outputs` (a list), if given, gets the
    outputs of every layer after the timed replays. `override`: moe_decode build fields to force
    (profile_gemm --sweep)."""
    rows = torch.empty(layers * E, layout.row_stride, dtype=torch.uint8, device="cuda")
    for layer in range(layers):
        rows[layer * E:(layer + 1) * E, :layout.row_bytes] = random_rows_fast(layout, E, device="cuda")
    gemm = MoEGemm(layout, K, torch.bfloat16, max_decode_tokens=max(T, 1), decode_kernel=kernel,
                   activation=activation)
    x = torch.randn(T, layout.hidden, device="cuda", dtype=torch.bfloat16)
    outs, addrs, weights, distinct = [], [], [], []
    for layer in range(layers):
        ids, w = routing(T, K, E, gen)
        addrs.append((rows[layer * E:].data_ptr() + ids * rows.stride(0)).reshape(-1))
        weights.append(w)
        outs.append(torch.empty_like(x))
        distinct.append(len(set(ids.reshape(-1).tolist())))
    g = capture(lambda layer: decode_call(gemm, x, addrs[layer], weights[layer], outs[layer],
                                          override), layers)
    ms = time_ms(g.replay, warmup=3, iters=30) / layers
    bytes_per_layer = sum(distinct) / layers * layout.row_bytes
    gbps = bytes_per_layer / ms / 1e6
    if outputs is not None:
        outputs.append(torch.stack(outs).float().cpu())
    del rows
    return {"T": T, "K": K, "H": layout.hidden, "I": layout.intermediate, "E": E, "kernel": kernel,
            "us_per_layer": ms * 1e3, "distinct_experts": sum(distinct) / layers,
            "bytes_per_layer": bytes_per_layer, "GBps": gbps, "fraction_of_hbm_read": gbps / hbm}


def torch_baseline(x, ids, w, w13, w2):
    """Best of a per-expert loop and grouped mm, bf16 weights already dequantized."""
    T, K = ids.shape
    I = w2.shape[2]
    flat = ids.reshape(-1)
    order = flat.argsort()
    tok = order // K
    counts = torch.bincount(flat, minlength=w13.shape[0])
    offs = counts.cumsum(0).to(torch.int32)
    ws = w.reshape(-1)[order].to(x.dtype)

    def loop():
        out = torch.zeros_like(x)
        starts = [0] + offs.tolist()
        for e in range(w13.shape[0]):
            a, b = starts[e], starts[e + 1]
            if a == b:
                continue
            h = x[tok[a:b]] @ w13[e].T
            y = (F.silu(h[:, :I]) * h[:, I:]) @ w2[e].T
            out.index_add_(0, tok[a:b], y * ws[a:b, None])
        return out

    def grouped():
        xs = x[tok]
        h = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)
        a = F.silu(h[:, :I]) * h[:, I:]
        y = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)
        return torch.zeros_like(x).index_add_(0, tok, y * ws[:, None])

    results = {"loop_ms": time_ms(loop, warmup=2, iters=10)}
    try:
        a, b = grouped().float(), loop().float()
        err = (torch.linalg.norm(a - b) / torch.linalg.norm(b)).item()
        if not err < 1e-2:                     # both are bf16 matmuls; they differ by rounding only
            raise AssertionError(f"grouped mm differs from the loop: rel. Frobenius error {err:.2e}")
        results["grouped_mm_ms"] = time_ms(grouped, warmup=2, iters=10)
    except Exception as e:  # noqa: BLE001 (report why grouped mm is not in the comparison)
        results["grouped_mm_error"] = f"{type(e).__name__}: {e}"[:300]
    return results


def host_ms(fn, iters=20):
    """Median host (Python + launch) milliseconds of one call, the device idle before each."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def bench_prefill(layout, E, T, K, gen, pcie, host_fraction, scratch_rows=32, scratch_buffers=2,
                  baseline=True, config=PREFILL, activation=SILU):
    er = ExpertRows(layout, E, store=True)
    store, cpu_rows = er.store, er.cpu
    on_host, expert_addr = er.resident_addr(host_fraction)
    gemm = MoEGemm(layout, K, torch.bfloat16, max_prefill_tokens=T, num_experts=E,
                   scratch_rows=scratch_rows, scratch_buffers=scratch_buffers,
                   prefill_config=config, activation=activation)
    x = torch.randn(T, layout.hidden, device="cuda", dtype=torch.bfloat16)
    ids, w = routing(T, K, E, gen)
    out = torch.empty_like(x)
    run = lambda: gemm.prefill(x, ids, w, expert_addr, host_addr=store.address_table(), out=out)
    resident = lambda: gemm.prefill(x, ids, w, expert_addr, out=out)
    res = {"T": T, "K": K, "H": layout.hidden, "I": layout.intermediate, "E": E,
           "host_fraction": host_fraction, "scratch_rows": scratch_rows,
           "scratch_buffers": scratch_buffers}
    if host_fraction == 0:
        res.update(partition_path_ms=time_ms(run, warmup=2, iters=10),
                   partition_path_host_ms=host_ms(run))
        run = resident
    res.update(ms=time_ms(run, warmup=2, iters=10), host_ms=host_ms(run))
    ms = res["ms"]
    if host_fraction == 0 and baseline:
        w13 = torch.empty(E, 2 * layout.intermediate, layout.hidden, dtype=torch.bfloat16, device="cuda")
        w2 = torch.empty(E, layout.hidden, layout.intermediate, dtype=torch.bfloat16, device="cuda")
        for e in range(E):
            g, u, d = unpack_row(layout, cpu_rows[e])
            w13[e] = torch.cat([dequantize_exact(g), dequantize_exact(u)]).to(torch.bfloat16).cuda()
            w2[e] = dequantize_exact(d).to(torch.bfloat16).cuda()
        base = torch_baseline(x, ids, w, w13, w2)
        best = min(v for k, v in base.items() if k.endswith("_ms"))
        res.update(torch_bf16=base, torch_best_ms=best, ratio_to_torch=ms / best)
        del w13, w2
    elif host_fraction > 0:
        routed_host = set(ids.reshape(-1).tolist()) & set(on_host.nonzero().reshape(-1).tolist())
        bound_ms = len(routed_host) * layout.row_bytes / pcie / 1e6
        res.update(host_experts_routed=len(routed_host), pcie_bound_ms=bound_ms,
                   ratio_to_pcie_bound=ms / bound_ms)
    store.close()
    return res


DIM = bounded_int(16, multiple_of=16)        # NVFP4 blocks are 16 wide
DECODE_T = bounded_int(1, 32)                # T x top-8 <= moe_decode's 256 lanes
SCRATCH = fields("x", ROWS=positive_int, BUFFERS=positive_int)


def result_name(text: str) -> str:
    """--name: a file name in benchmarks/results/ (no folder, no .json)."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", text) or text.endswith(".json"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a plain name such as bench_gemm_h100 "
                                         f"(letters, digits, _ . -; no folder, no .json)")
    return text


def build_parser() -> CLIParser:
    p = CLIParser(prog="bench_gemm.py", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=bounded_int(8, 1024), default=128,
                   help="E (in [8, 1024]: top-8 routing, prefill's expert tables)")
    p.add_argument("--layers", type=positive_int, default=16,
                   help="distinct layers in the decode graph (>= 1)")
    p.add_argument("--dims", nargs="+", type=fields("x", H=DIM, I=DIM),
                   default=[(2048, 768), (4096, 1536)], metavar="HxI",
                   help="decode layer shapes, multiples of 16 (default 2048x768 4096x1536)")
    p.add_argument("--decode-tokens", nargs="+", type=DECODE_T, default=[1, 4],
                   help="decode T (in [1, 32])")
    p.add_argument("--decode-kernels", nargs="+", default=["fused", "pair"],
                   choices=["fused", "pair"], help="MoEGemm decode_kernel values to time")
    p.add_argument("--prefill-tokens", nargs="+", type=positive_int, default=[512, 2048],
                   help="prefill T (>= 1)")
    skip = p.add_mutually_exclusive_group()
    skip.add_argument("--skip-prefill", action="store_true")
    skip.add_argument("--skip-decode", action="store_true")
    p.add_argument("--skip-gpt-oss", action="store_true",
                   help="leave out the gpt-oss-20b / -120b shapes (H = I = 2880, top-4, E = 32 / "
                        "128, biased experts, clamped SwiGLU)")
    p.add_argument("--scratch", nargs="+", type=SCRATCH, default=[(32, 2)], metavar="ROWSxBUFFERS",
                   help="MoEGemm scratch_rows x scratch_buffers of the half-on-host prefill "
                        "runs (one run each) and of the partition-path timing (default 32x2)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--name", type=result_name,
                     help="write benchmarks/results/NAME.json (default: bench_gemm, for a full "
                          "run only)")
    out.add_argument("--json", type=output_file, metavar="PATH", help="write the results here")
    return p


def reduced(args) -> list[str]:
    """How this run is smaller than the default one, or a sweep (then it writes no canonical
    file)."""
    parser = build_parser()
    why = reduced_by(args, parser, "layers", "dims", "decode_tokens", "decode_kernels",
                     "prefill_tokens", "skip_prefill", "skip_decode", "skip_gpt_oss")
    if args.scratch != parser.get_default("scratch"):
        why.append("a --scratch sweep")
    return why


def main(args) -> None:
    _cuda.require_gpu("the MoE GEMM benchmark")
    out = results_path("bench_gemm", args.json or (args.name and RESULTS / f"{args.name}.json"),
                       reduced(args))
    scratch = args.scratch
    gen = torch.Generator(device="cuda").manual_seed(0)
    hbm_read, hbm_copy, pcie = hbm_read_GBps(), hbm_copy_GBps(), pcie_h2d_GBps()
    print(f"limits: HBM read {hbm_read:.0f} GB/s, HBM copy {hbm_copy:.0f} GB/s, PCIe H2D {pcie:.1f} GB/s")
    decode, prefill = [], []
    for H, I in [] if args.skip_decode else args.dims:
        layout = RowLayout(H, I)
        for T, kernel in [(T, k) for T in args.decode_tokens for k in args.decode_kernels]:
            r = bench_decode(layout, args.experts, T, 8, args.layers, gen, hbm_read, kernel)
            decode.append(r)
            print(f"decode {kernel} H={H} I={I} T={T}: {r['us_per_layer']:.1f} us/layer, "
                  f"{r['GBps']:.0f} GB/s = {r['fraction_of_hbm_read']:.2f} of HBM read")
    if not args.skip_prefill:
        layout = RowLayout(2048, 768)
        for T in args.prefill_tokens:
            for i, (frac, (rows, bufs)) in enumerate([(f, s) for f in (0.0, 0.5) for s in scratch]):
                r = bench_prefill(layout, args.experts, T, 8, gen, pcie, frac, rows, bufs,
                                  baseline=i == 0)
                prefill.append(r)
                if frac == 0 and i > 0:
                    print(f"prefill T={T} partition path, nothing on host, scratch {rows}x{bufs}: "
                          f"{r['partition_path_ms']:.3f} ms (host {r['partition_path_host_ms']:.3f})")
                elif frac == 0:
                    print(f"prefill T={T} resident: {r['ms']:.3f} ms (host {r['host_ms']:.3f}), "
                          f"torch bf16 best {r['torch_best_ms']:.3f} ms, ratio {r['ratio_to_torch']:.2f}; "
                          f"partition path, nothing on host: {r['partition_path_ms']:.3f} ms "
                          f"(host {r['partition_path_host_ms']:.3f})")
                else:
                    print(f"prefill T={T} half on host, scratch {rows}x{bufs}: {r['ms']:.3f} ms "
                          f"(host {r['host_ms']:.3f}), PCIe bound "
                          f"{r['pcie_bound_ms']:.3f} ms, ratio {r['ratio_to_pcie_bound']:.2f}")
    gpt_oss = [] if args.skip_gpt_oss else bench_gpt_oss(args, gen, hbm_read, pcie)
    save(args.name or "bench_gemm", {
        "hbm_read_GBps": hbm_read, "hbm_copy_GBps": hbm_copy, "pcie_h2d_GBps": pcie,
        "layers": args.layers, "decode": decode, "prefill": prefill, "gpt_oss": gpt_oss}, out)


# gpt-oss's experts: (model, E) of both sizes, and their (RowLayout, activation, top-k): H = I =
# 2880, rows with biases, the clamped SwiGLU, top-4
GPT_OSS = (("gpt-oss-20b", 32), ("gpt-oss-120b", 128))
GPT_OSS_SHAPE = (RowLayout(2880, 2880, bias=True), swiglu_clamp(1.702, 7.0), 4)


def bench_gpt_oss(args, gen, hbm_read, pcie) -> list[dict]:
    """Decode (each --decode-tokens, each kernel) and resident / half-on-host prefill at gpt-oss's
    dims; the prefill has no torch baseline (torch has no clamped-SwiGLU grouped GEMM to compare
    with), so its figures are times (and the PCIe bound with half on the host)."""
    layout, act, K = GPT_OSS_SHAPE
    out = []
    for model, E in GPT_OSS:
        for T, kernel in ([] if args.skip_decode else
                          [(T, k) for T in args.decode_tokens for k in args.decode_kernels]):
            r = bench_decode(layout, E, T, K, args.layers, gen, hbm_read, kernel, activation=act)
            out.append({"model": model, "part": "decode", **r})
            print(f"{model} decode {kernel} T={T}: {r['us_per_layer']:.1f} us/layer, "
                  f"{r['GBps']:.0f} GB/s = {r['fraction_of_hbm_read']:.2f} of HBM read")
        if args.skip_prefill or model != "gpt-oss-120b":
            continue
        for T in args.prefill_tokens[:1]:
            for frac in (0.0, 0.5):
                r = bench_prefill(layout, E, T, K, gen, pcie, frac, *args.scratch[0],
                                  baseline=False, activation=act)
                out.append({"model": model, "part": "prefill", **r})
                bound = (f", PCIe bound {r['pcie_bound_ms']:.3f} ms, ratio "
                         f"{r['ratio_to_pcie_bound']:.2f}" if frac else "")
                print(f"{model} prefill T={T} {'half on host' if frac else 'resident'}: "
                      f"{r['ms']:.3f} ms{bound}")
    return out


if __name__ == "__main__":
    sys.exit(run(main, build_parser()))
