"""What a GPU memory budget buys: bank rows per layer, the hit rate the planner gets with them on
a routing trace, and (on a GPU) the NVML report of the device.

    python examples/budget_report.py --budget 24GiB                # Qwen3-30B-A3B shape
    python examples/budget_report.py --budget 24GiB --trace run.npz

Runs without a GPU too (no NVML report then): the sizing is arithmetic and the hit rate comes
from the reference planner on the CPU. A budget too small for top-k rows a layer, or a trace of
another shape, ends in one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import cupool
from cupool import synthetic
from cupool import trace as tr
from cupool.budget import rows_for_budget
from cupool.cli import CLIParser, existing_file, positive_int, run, size
from cupool.simulate import simulate
from cupool.store import fmt_bytes


def dense_bytes(shape: dict, dtype_bytes: int = 2) -> int:
    """Bytes of everything but the routed experts of a Qwen3-MoE shape (from the meta model)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig
    cfg = Qwen3MoeConfig(**shape, tie_word_embeddings=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    experts = {id(p) for s in cupool.adapters.find_moe_layers(model) for p in s.module.parameters()}
    return sum(p.numel() for p in model.parameters() if id(p) not in experts) * dtype_bytes


def build_parser() -> CLIParser:
    p = CLIParser(prog="budget_report.py", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=size, required=True,
                   help="GPU memory the model may use, e.g. '24GiB' (> 0)")
    p.add_argument("--kv-reserve", type=size, default="2GiB",
                   help="kept free for the KV cache (> 0; default 2GiB)")
    p.add_argument("--layers", type=positive_int, default=48, help="MoE layers (>= 1)")
    p.add_argument("--small", action="store_true", help="a tiny shape (tests)")
    p.add_argument("--trace", type=existing_file,
                   help="a .npz routing trace (default: synthetic with Qwen3 locality)")
    p.add_argument("--steps", type=positive_int, default=128,
                   help="steps of the synthetic trace (>= 1)")
    return p


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def main(args) -> int:
    shape = dict(synthetic.TINY) if args.small else dict(synthetic.QWEN3_30B_A3B,
                                                          num_hidden_layers=args.layers)
    L, E, K = shape["num_hidden_layers"], shape["num_experts"], shape["num_experts_per_tok"]
    layout = cupool.RowLayout(shape["hidden_size"], shape["moe_intermediate_size"])
    stride = layout.row_stride
    budget, kv = args.budget, args.kv_reserve
    dense = dense_bytes(shape)
    staging = 8 * K * stride                                # decode of up to 8 tokens
    fixed = dense + staging + (64 << 20)                     # + GEMM workspaces and tables
    print(f"shape: {L} layers, E={E}, top-{K}; expert row {fmt_bytes(layout.row_bytes)} NVFP4; "
          f"all experts {fmt_bytes(L * E * layout.row_bytes)} (host store)")
    print(f"dense part {fmt_bytes(dense)}, staging + workspaces {fmt_bytes(fixed - dense)}, "
          f"KV reserve {fmt_bytes(kv)}")
    rows = rows_for_budget(budget, fixed=fixed, row_stride=stride, num_layers=L, top_k=K,
                           num_experts=E, kv_reserve=kv)          # ValueError: too small
    print(f"budget {fmt_bytes(budget)} buys {rows} rows per layer ({100 * rows / E:.0f}% of the "
          f"experts, bank {fmt_bytes(rows * L * stride)})")
    t = tr.Trace.load(args.trace) if args.trace else tr.synthetic(args.steps, L, E, K, seed=0,
                                                                   **tr.QWEN3_LOCALITY)
    if t.num_layers != L or t.num_experts != E:
        raise ValueError(f"--trace {args.trace}: a trace of {t.num_layers} layers x "
                         f"{t.num_experts} experts, the model has {L} x {E} (--layers, --small)")
    res = simulate(t, rows, warmup_steps=min(8, t.steps // 4))
    print(f"expected hit rate {res['hit_rate']:.3f} on {t.note or args.trace} "
          f"(rows owned per layer after the trace: min {min(res['rows_owned'])}, "
          f"max {max(res['rows_owned'])})")
    if torch.cuda.is_available():
        print(cupool.report())
    else:
        print("no GPU here: skipping the NVML report")
    return 0


if __name__ == "__main__":
    sys.exit(run(main, build_parser()))
