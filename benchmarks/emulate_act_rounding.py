"""How much the rounding of SiLU·up (the act rows w13 hands to w2) moves test_gpu_wrap's metrics,
emulated on the CPU (no GPU needed).

The tiny model of test_gpu_wrap (`model_for`) gets NVFP4 round-tripped expert weights; its
experts are then replaced by a forward that does what the GEMM kernels do: exact products of
the dequantised weights, fp32 sums, the act rows rounded as chosen, the top-k sum in fp32, the
output in the model's dtype. Calls of more than 2 tokens (the prompt: the partition path) always
round act to bf16 as moe_gemm does; decode calls (1-2 tokens) use --modes:

    fp32   no rounding
    fp16   fp16 after the row's power-of-two scale (moe_decode.cu until session 10)
    bf16   bf16 (moe_decode since session 10, the pair, moe_gemm's prefill)
    off5   fp32 times 1.05: a 5% error, to show what the metric sees

For each mode it prints test_gpu_wrap's two numbers: the prompt's logits against the reference
and the eager greedy run's step logits against the reference on the same context (teacher
forcing), both relative Frobenius errors (the test's tolerance is 3e-2).

    python benchmarks/emulate_act_rounding.py --family mixtral --modes fp32 fp16 bf16 off5
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

MODES = ("fp32", "fp16", "bf16", "off5")


def pow2_fp16(a: torch.Tensor) -> torch.Tensor:
    """fp16 rounding after the power-of-two scale that brings the row's largest magnitude to
    [2^13, 2^14) (mma_fp4.cuh's pow2_scale), scaled back."""
    amax = a.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    s = torch.exp2(torch.floor(torch.log2(amax)) - 13)
    return (a / s).to(torch.float16).float() * s


def round_act(act: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "bf16":
        return act.to(torch.bfloat16).float()
    if mode == "fp16":
        return pow2_fp16(act)
    if mode == "off5":
        return act * 1.05
    return act


def kernel_forward(decode_mode: str):
    """An experts forward with the kernels' arithmetic; `self.w13q` / `self.w2q` hold the
    dequantised fp32 weights [E, 2I, H] and [E, H, I]."""
    def forward(self, hidden_states, top_k_index, top_k_weights):
        mode = decode_mode if hidden_states.shape[0] <= 2 else "bf16"
        x = hidden_states.float()
        out = torch.zeros(hidden_states.shape, dtype=torch.float32)
        for t in range(x.shape[0]):
            for k in range(top_k_index.shape[1]):
                e = int(top_k_index[t, k])
                gate, up = (self.w13q[e] @ x[t]).chunk(2)
                act = round_act(torch.nn.functional.silu(gate) * up, mode)
                out[t] += float(top_k_weights[t, k]) * (self.w2q[e] @ act)
        return out.to(hidden_states.dtype)
    return forward


def measure(family: str, mode: str) -> tuple[float, float]:
    from cupool.nvfp4 import dequantize, quantize  # noqa: PLC0415
    from test_gpu_wrap import greedy_eager, model_for, rel, teacher_forced  # noqa: PLC0415

    torch.manual_seed(0)
    model = model_for(family, seed=1)
    experts = [m for m in model.modules()
               if hasattr(m, "gate_up_proj") and isinstance(m.gate_up_proj, torch.Tensor)]
    with torch.no_grad():
        for m in experts:
            m.w13q = torch.stack([dequantize(quantize(w.float())) for w in m.gate_up_proj])
            m.w2q = torch.stack([dequantize(quantize(w.float())) for w in m.down_proj])
            m.gate_up_proj.copy_(m.w13q.to(m.gate_up_proj.dtype))
            m.down_proj.copy_(m.w2q.to(m.down_proj.dtype))
    prompt = torch.randint(3, 64, (1, 8), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        for m in experts:
            m.forward = types.MethodType(kernel_forward(mode), m)
        full = model(prompt).logits
        tokens, logits = greedy_eager(model, prompt, 32)
        for m in experts:
            del m.forward                              # back to the class's (reference) forward
        model.config._experts_implementation_internal = "eager"
        full_ref = model(prompt).logits
        ref = teacher_forced(model, prompt, tokens)
    return rel(full, full_ref), rel(logits, ref)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="mixtral", help="a tests/tiny_models.py family")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    args = p.parse_args(argv)
    for mode in args.modes:
        prompt_err, step_err = measure(args.family, mode)
        print(f"{args.family} decode act {mode}: prompt logits {prompt_err:.4f}, "
              f"decode step logits {step_err:.4f}", flush=True)


if __name__ == "__main__":
    main()
