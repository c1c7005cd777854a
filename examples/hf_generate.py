"""A transformers MoE model built from a config, wrapped by cupool, and run through transformers'
own `generate` (eager), then through cupool's graph decoder; both give the same greedy tokens.

    python examples/hf_generate.py                       # a small Qwen3-MoE
    python examples/hf_generate.py --family mixtral      # or qwen2_moe, olmoe, deepseek_v3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import cupool
from cupool import _cuda
from cupool.cli import CLIParser, nonnegative_int, positive_int, run

FAMILIES = {
    "qwen3_moe": dict(hidden_size=256, head_dim=32, intermediate_size=512, moe_intermediate_size=128,
                      num_experts=32, num_experts_per_tok=4),
    "qwen2_moe": dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                      shared_expert_intermediate_size=256, num_experts=32, num_experts_per_tok=4),
    "mixtral": dict(hidden_size=256, intermediate_size=128, num_local_experts=8, num_experts_per_tok=2),
    "olmoe": dict(hidden_size=256, intermediate_size=128, num_experts=32, num_experts_per_tok=4),
    "deepseek_v3": dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                        n_routed_experts=32, num_experts_per_tok=4, n_shared_experts=1,
                        first_k_dense_replace=1, n_group=4, topk_group=2, kv_lora_rank=64,
                        q_lora_rank=64, qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32),
}


# families whose first layers are dense: MoE layers start at this index
FIRST_MOE = {"deepseek_v3": FAMILIES["deepseek_v3"]["first_k_dense_replace"]}


def build_parser() -> CLIParser:
    p = CLIParser(prog="hf_generate.py", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=sorted(FAMILIES), default="qwen3_moe")
    p.add_argument("--layers", type=positive_int, default=4,
                   help="decoder layers (>= 1; deepseek_v3: >= 2, its first is dense)")
    p.add_argument("--rows", type=positive_int, default=None,
                   help="bank rows per layer (top-k to the experts a layer; default: a quarter "
                        "of the experts, at least top-k)")
    p.add_argument("--tokens", type=positive_int, default=24, help="tokens to generate (>= 1)")
    p.add_argument("--seed", type=nonnegative_int, default=0)
    return p


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def check(args) -> None:
    """What the types cannot see: a family whose first layers are dense needs more layers than
    those, and --rows within [top-k, experts] of the family."""
    first = FIRST_MOE.get(args.family, 0)
    if args.layers <= first:
        raise ValueError(f"--layers {args.layers}: {args.family} keeps its first {first} "
                         f"decoder layers dense (first_k_dense_replace); give --layers >= "
                         f"{first + 1} for a MoE layer")
    cfg = FAMILIES[args.family]
    E = next(cfg[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if k in cfg)
    K = cfg["num_experts_per_tok"]
    if args.rows is not None and not K <= args.rows <= E:
        raise ValueError(f"--rows {args.rows}: {args.family} routes top-{K} of {E} experts; give "
                         f"--rows in [{K}, {E}]")


def build(family: str, layers: int, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(family, vocab_size=512, num_hidden_layers=layers,
                               num_attention_heads=4, num_key_value_heads=4,
                               max_position_embeddings=512, **FAMILIES[family])
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    with torch.no_grad():                     # from_config leaves fused experts small; spread them
        for m in model.modules():
            if hasattr(m, "gate_up_proj") and isinstance(m.gate_up_proj, torch.Tensor):
                m.gate_up_proj.normal_(0, 0.05)
                m.down_proj.normal_(0, 0.05)
    return model


def main(args) -> int:
    check(args)
    _cuda.require_gpu("the transformers generate example")
    model = build(args.family, args.layers, args.seed)
    specs = cupool.adapters.find_moe_layers(model)
    E, K = specs[0].num_experts, specs[0].top_k
    rows = args.rows or max(K, E // 4)
    pool = cupool.wrap(model, rows=rows, max_decode_tokens=4, progress=False)
    print(pool)
    prompt = torch.randint(3, 512, (1, 12), device="cuda",
                           generator=torch.Generator(device="cuda").manual_seed(args.seed))
    pool.open()
    with torch.inference_mode():
        eager = model.generate(prompt, max_new_tokens=args.tokens, do_sample=False,
                               min_new_tokens=args.tokens)[:, prompt.shape[1]:]
    engine = cupool.Engine(model, pool, max_batch=1, max_len=prompt.shape[1] + args.tokens,
                           eos_token_id=[])
    req = engine.generate([prompt[0].tolist()],
                          cupool.SamplingParams(max_tokens=args.tokens, ignore_eos=True))[0]
    same = eager[0].tolist() == req.output_ids
    print(f"transformers generate (eager): {eager[0].tolist()}")
    print(f"cupool engine ({engine.step_kind}): {req.output_ids}  "
          f"({req.decode_tokens_per_s:.1f} tok/s)")
    # Both run the same pooled MoE kernels; they can still part on a near-tie because
    # transformers' generate uses a dynamic KV cache and its own attention, the engine its slot
    # cache (and, where the model fits, its fused decode kernels).
    print(f"identical greedy tokens: {same}")
    print(pool.stats_table())
    return 0


if __name__ == "__main__":
    sys.exit(run(main, build_parser()))
