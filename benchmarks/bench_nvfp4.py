"""NVFP4 quantization speed on the GPU: one MoE layer of experts (default Qwen3-30B-A3B: E=128,
H=2048, I=768, bf16), as elements/s and GB/s of input read, against the HBM copy bandwidth
measured in the same run.

Two figures:
- quantize: gate, up (halves of gate_up [E, 2I, H], read where they lie) and down [E, H, I], three
  `cupool.ops.nvfp4_quant.quantize` calls. Each call reads its input twice (amax pass, then block pass) and
  writes 0.5625 B/element; "traffic" counts all of that, "input" counts one read.
- rows: `quantize_experts_to_rows`, the same quantization plus building the store rows on the GPU.
Each timed call includes the one host readback per quantize call (the NaN/Inf census), as in use.
The projected time for 30B parameters assumes the same elements/s.

Writes benchmarks/results/bench_nvfp4.json (a run with a smaller shape or fewer iterations than
the defaults writes nothing unless --json PATH is given).
"""

from __future__ import annotations

import argparse
import sys

import torch
from _common import hbm_copy_GBps, reduced_by, results_path, save, time_ms

from cupool import _cuda, nvfp4
from cupool.cli import CLIParser, bounded_int, output_file, positive_float, positive_int, run
from cupool.layout import RowLayout
from cupool.ops.nvfp4_quant import quantize, quantize_experts_to_rows

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def build_parser() -> CLIParser:
    p = CLIParser(prog="bench_nvfp4.py", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=positive_int, default=128, help="E (>= 1)")
    p.add_argument("--hidden", type=bounded_int(16, multiple_of=16), default=2048,
                   help="H (a multiple of 16: NVFP4 blocks)")
    p.add_argument("--inter", type=bounded_int(16, multiple_of=16), default=768,
                   help="I (a multiple of 16)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--iters", type=positive_int, default=20, help="timed calls (>= 1)")
    p.add_argument("--params", type=positive_float, default=30e9,
                   help="parameter count to project to (> 0)")
    p.add_argument("--json", type=output_file, metavar="PATH",
                   help="write the results here (default: benchmarks/results/bench_nvfp4.json, "
                        "for a full run only)")
    return p


def reduced(args) -> list[str]:
    """How this run is smaller than the default one (then it writes no canonical file)."""
    return reduced_by(args, build_parser(), "experts", "hidden", "inter", "iters")


def main(args) -> None:
    _cuda.require_gpu("the NVFP4 quantization benchmark")
    out = results_path("bench_nvfp4", args.json, reduced(args))
    E, H, I, dt = args.experts, args.hidden, args.inter, DTYPES[args.dtype]
    esize = torch.empty((), dtype=dt).element_size()

    hbm = hbm_copy_GBps()
    print(f"HBM device-to-device copy: {hbm:.0f} GB/s (read + write)")
    gate_up = (torch.randn(E, 2 * I, H, device="cuda") * 0.02).to(dt)
    down = (torch.randn(E, H, I, device="cuda") * 0.02).to(dt)
    layout = RowLayout(H, I)
    elems = gate_up.numel() + down.numel()
    in_bytes = elems * esize
    traffic = elems * (2 * esize + 0.5625)

    # correctness of what is timed: expert 0 against the CPU reference
    q = quantize(gate_up[:, :I])
    ref = nvfp4.quantize(gate_up[0, :I].cpu())
    if not (torch.equal(q.packed[0].cpu(), ref.packed)
            and torch.equal(q.block_scale[0].cpu().view(torch.uint8), ref.block_scale.view(torch.uint8))):
        raise AssertionError("kernel output differs from the reference: not timing a wrong kernel")

    outs = [None, None, None]

    def run_quantize():
        outs[0] = quantize(gate_up[:, :I], out=outs[0])
        outs[1] = quantize(gate_up[:, I:], out=outs[1])
        outs[2] = quantize(down, out=outs[2])

    rows = torch.empty(E, layout.row_bytes, dtype=torch.uint8, device="cuda")
    q_ms = time_ms(run_quantize, iters=args.iters)
    r_ms = time_ms(lambda: quantize_experts_to_rows(gate_up, down, layout, out=rows),
                   iters=max(3, args.iters // 2))

    res = {"experts": E, "hidden": H, "intermediate": I, "dtype": args.dtype, "elements": elems,
           "input_bytes": in_bytes, "hbm_copy_GBps": hbm}
    for name, ms in (("quantize", q_ms), ("rows", r_ms)):
        eps = elems / (ms * 1e-3)
        gbps = in_bytes / ms / 1e6
        res[name] = {"ms": ms, "elements_per_s": eps, "input_GBps": gbps,
                     "input_ratio_to_hbm_copy": gbps / hbm,
                     "projected_s_for_params": args.params / eps}
        line = (f"{name:>8}: {ms:7.3f} ms  {eps / 1e9:6.1f} G elem/s  input {gbps:6.0f} GB/s "
                f"({gbps / hbm:.2f} of HBM copy)")
        if name == "quantize":
            t_gbps = traffic / ms / 1e6
            res[name].update({"traffic_GBps": t_gbps, "traffic_ratio_to_hbm_copy": t_gbps / hbm})
            line += f"  traffic {t_gbps:6.0f} GB/s ({t_gbps / hbm:.2f})"
        print(line + f"  -> {args.params / 1e9:.0f}B params in {args.params / eps:.2f} s")
    save("bench_nvfp4", res, out)


if __name__ == "__main__":
    sys.exit(run(main, build_parser()))
