"""The kernels' rounding of SiLU·up (the act rows w13 hands to w2 in bf16) keeps test_gpu_wrap's
metrics within its tolerance, emulated on the CPU (no GPU needed).

The tiny model of test_gpu_wrap (`model_for`) gets NVFP4 round-tripped expert weights; its
experts are then replaced by a forward that does what the GEMM kernels do: exact products of
the dequantised weights, fp32 sums, the act rows rounded as chosen, the top-k sum in fp32, the
output in the model's dtype. Calls of more than 2 tokens (the prompt: the partition path) always
round act to bf16 as moe_gemm does; decode calls (1-2 tokens) use the mode under test:

    fp32   no rounding
    bf16   bf16 (moe_decode, the pair and moe_gemm's prefill all hand act over in bf16)
    off10  fp32 times 1.10: a 10% error, which the metric must see

Each mode gives test_gpu_wrap's two numbers: the prompt's logits against the reference and the
eager greedy run's step logits against the reference on the same context (teacher forcing),
both relative Frobenius errors (test_gpu_wrap's tolerance is 3e-2).
"""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("transformers")

WRAP_TOL = 3e-2          # test_gpu_wrap's tolerance on both metrics


def round_act(act: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "bf16":
        return act.to(torch.bfloat16).float()
    if mode == "off10":
        return act * 1.10
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
    from test_gpu_wrap import greedy_eager, model_for, rel, teacher_forced

    from cupool.nvfp4 import dequantize, quantize

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


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_bf16_act_rounding_stays_within_the_wrap_tolerance(family):
    prompt_ref, step_ref = measure(family, "fp32")
    prompt_bf16, step_bf16 = measure(family, "bf16")
    assert prompt_bf16 == prompt_ref               # the prompt's calls round to bf16 either way
    assert step_bf16 <= WRAP_TOL / 2, (step_ref, step_bf16)
    assert abs(step_bf16 - step_ref) <= 5e-3, (step_ref, step_bf16)


def test_a_ten_percent_act_error_fails_the_wrap_metric():
    """The counter-check: the metric sees an error of this kind."""
    _, step = measure("mixtral", "off10")
    assert step > WRAP_TOL, step
