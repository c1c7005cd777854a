"""Random experts made directly in NVFP4 (no bf16 weights first): for tests, benchmarks and the
example decode loop, where a 30B-parameter model must not be built by initialising bf16 weights.

Codes are uniform over all 16 E2M1 codes, block scales are E4M3 powers-of-two-ish values spread
over [2^-4, 2^4) (so blocks differ by up to 256x, as real checkpoints do), and the global scale
keeps a dot product over K of unit-variance activations near unit size.
"""

from __future__ import annotations

import math

import torch

from cupool.layout import RowLayout, pack_row, strip_scales
from cupool.nvfp4 import E2M1_VALUES, NVFP4Tensor


def random_nvfp4(n: int, k: int, generator: torch.Generator | None = None,
                 device="cpu") -> NVFP4Tensor:
    """A random NVFP4 matrix [n, k] (k a multiple of 16)."""
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=generator)
    # E4M3 byte = exponent (bias 7) << 3 | mantissa; exponents 3..10 give 2^-4 .. 2^3.875
    expo = torch.randint(3, 11, (n, k // 16), dtype=torch.uint8, generator=generator)
    mant = torch.randint(0, 8, (n, k // 16), dtype=torch.uint8, generator=generator)
    scale = ((expo << 3) | mant).view(torch.float8_e4m3fn)
    gs = torch.tensor(0.25 / math.sqrt(k), dtype=torch.float32)
    return NVFP4Tensor(packed.to(device), scale.to(device), gs.to(device))


_LUT = torch.tensor(list(E2M1_VALUES) + [-v for v in E2M1_VALUES], dtype=torch.float32)


def dequantize_exact(q: NVFP4Tensor, dtype=torch.float32) -> torch.Tensor:
    """Dequantize a 2-D NVFP4Tensor by table lookup (independent of cupool.nvfp4's code path)."""
    p = q.packed
    codes = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(p.shape[0], -1).long()
    vals = _LUT.to(p.device)[codes]
    s = q.block_scale.to(torch.float32).repeat_interleave(16, dim=-1)
    return (vals * s * q.global_scale.to(torch.float32)).to(dtype)


def random_biases(layout: RowLayout, num_experts: int, generator: torch.Generator | None = None,
                  device="cpu"):
    """Random expert biases (gate [E, I], up [E, I], down [E, H]), float32, bf16-representable
    (as checkpoints store them), of about the size of the matrices' outputs (std 0.5)."""
    H, I = layout.hidden, layout.intermediate
    return tuple((torch.randn(num_experts, n, generator=generator) * 0.5).to(torch.bfloat16)
                 .float().to(device) for n in (I, I, H))


def random_experts(layout: RowLayout, num_experts: int, generator: torch.Generator | None = None,
                   *, biases=None):
    """(rows uint8 [E, row_bytes], [(gate, up, down) NVFP4Tensor per expert]) on the CPU (gate
    None for a layout without a gate). A layout with biases needs `biases` (gate [E, I], up
    [E, I], down [E, H]; `random_biases`)."""
    H, I = layout.hidden, layout.intermediate
    rows = torch.empty(num_experts, layout.row_bytes, dtype=torch.uint8)
    mats = []
    for e in range(num_experts):
        g = random_nvfp4(I, H, generator) if layout.gated else None
        u, d = random_nvfp4(I, H, generator), random_nvfp4(H, I, generator)
        pack_row(layout, g, u, d, out=rows[e],
                 bias=None if biases is None else tuple(b[e] for b in biases))
        mats.append((g, u, d))
    return rows, mats


def random_rows_fast(layout: RowLayout, num_experts: int, generator: torch.Generator | None = None,
                     device="cpu") -> torch.Tensor:
    """Random rows without going through pack_row: random bytes with valid block scales and global
    scales written into their places, generated on `device` (the generator, if any, must live
    there). For large synthetic models (benchmarks, the example decode loop) where the data
    movement matters and no reference is computed. Assumes H and I are multiples of 64 (no
    padding); otherwise padded columns hold random codes. uint8 [E, row_bytes]."""
    rows = torch.randint(0, 256, (num_experts, layout.row_bytes), dtype=torch.uint8,
                         generator=generator, device=device)
    hp, ip = layout.hp, layout.ip

    def fix_scales(offset: int, strips: int, kp: int):
        strip_bytes = 9 * kp
        view = rows[:, offset:offset + strips * strip_bytes].view(num_experts, strips, strip_bytes)
        sc = strip_scales(view, kp)
        expo = torch.randint(3, 11, sc.shape, dtype=torch.uint8, generator=generator, device=device)
        sc.copy_((expo << 3) | (sc & 7))

    fix_scales(layout.w13_offset, layout.w13_strips, hp)
    fix_scales(layout.w2_offset, hp // 16, ip)
    gate_scale = 0.25 / math.sqrt(hp) if layout.gated else 0.0      # no gate: no gate scale
    hdr = torch.tensor([gate_scale, 0.25 / math.sqrt(hp), 0.25 / math.sqrt(ip)],
                       dtype=torch.float32)
    rows[:, :12] = hdr.view(torch.uint8).to(device)
    rows[:, 12:256] = 0
    if layout.bias:                                  # finite biases (random bytes are not)
        b = torch.randn(num_experts, 2 * ip + hp, generator=generator, device=device) * 0.5
        rows[:, layout.bias_offset:] = b.view(torch.uint8)
    return rows


# --- Qwen3-MoE-shaped models with random weights ---------------------------------------------
QWEN3_30B_A3B = dict(num_hidden_layers=48, num_experts=128, num_experts_per_tok=8,
                     hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     vocab_size=151936, max_position_embeddings=4096)

TINY = dict(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, hidden_size=64,
            moe_intermediate_size=32, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=256)


# gpt-oss-120b (transformers' GptOssConfig defaults: 36 layers, 128 experts, top-4, H = I = 2880,
# alternating sliding-window / full attention with sinks); gpt-oss-20b is 24 layers, 32 experts.
GPT_OSS_120B = dict(num_hidden_layers=36, num_local_experts=128, num_experts_per_tok=4,
                    hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
                    num_key_value_heads=8, head_dim=64, vocab_size=201088, sliding_window=128,
                    max_position_embeddings=131072)
GPT_OSS_20B = dict(GPT_OSS_120B, num_hidden_layers=24, num_local_experts=32)
GPT_OSS_TINY = dict(num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=4,
                    hidden_size=64, intermediate_size=64, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, vocab_size=128, sliding_window=16,
                    max_position_embeddings=256)


# Qwen3.8-Flash-Next (transformers' `qwen4_exp_text` defaults: 40 layers of gated delta nets with a
# QSA (indexed) attention layer every 4th, H = 2048, 512 experts top-10 of I = 512 plus a gated
# shared expert, 4 hyper-connection streams, vocabulary 248,320). transformers' defaults leave the
# QSA indexer unset (the model cannot be built without it): its sizes here are chosen (16 index
# heads of 256, the attention's head dim, which the rotary dims must fit; budget 2048 tokens in
# blocks of 16), not the release's. No n-gram embedding layers
# (the defaults have none; benchmarks/bench_ngram.py measures their gather).
QWEN4_EXP = dict(num_hidden_layers=40, num_experts=512, num_experts_per_tok=10, hidden_size=2048,
                 moe_intermediate_size=512, shared_expert_intermediate_size=512,
                 num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                 vocab_size=248320, max_position_embeddings=32768, indexer_n_heads=16,
                 indexer_kv_heads=1, indexer_head_dim=256, indexer_budget=2048,
                 indexer_compress_ratio=16)
QWEN4_EXP_TINY = dict(QWEN4_EXP, num_hidden_layers=4, num_experts=8, num_experts_per_tok=2,
                      hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                      max_position_embeddings=256, linear_num_key_heads=2,
                      linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                      hc_lowrank=16, indexer_n_heads=2, indexer_head_dim=16, indexer_budget=32,
                      indexer_compress_ratio=8)


# GLM-4.5-Air (transformers' `glm4_moe`): 46 layers, the first a dense MLP (I = 10,944), then 45
# MoE blocks of 128 experts top-8 (I = 1,408) with a sigmoid router (a correction bias, one
# expert group, weights renormalised) and one ungated shared expert of 1,408; H = 4,096, 96
# query heads over 8 KV heads of 128 dims with q/k/v biases, rotary over the first half of each
# head (rope theta 10^6); vocabulary 151,552.
GLM45_AIR = dict(num_hidden_layers=46, n_routed_experts=128, num_experts_per_tok=8,
                 hidden_size=4096, moe_intermediate_size=1408, intermediate_size=10944,
                 n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                 norm_topk_prob=True, routed_scaling_factor=1.0, num_attention_heads=96,
                 num_key_value_heads=8, head_dim=128, partial_rotary_factor=0.5,
                 attention_bias=True, use_qk_norm=False, vocab_size=151552,
                 max_position_embeddings=4096, rope_theta=1e6)
GLM45_AIR_TINY = dict(GLM45_AIR, num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2,
                      hidden_size=64, moe_intermediate_size=32, intermediate_size=96,
                      num_attention_heads=2, num_key_value_heads=1, vocab_size=128,
                      max_position_embeddings=256)


# Qwen3-Next-80B-A3B (transformers' `qwen3_next` defaults): 48 layers, three gated delta nets
# (16 key heads and 32 value heads of 128) to one gated full-attention layer (16 query heads
# over 2 KV heads of 256, rotary over the first 64 dims), every layer a MoE block of 512
# experts top-10 (I = 512) with a gated shared expert of 512; H = 2,048, (1 + w) RMSNorms,
# vocabulary 151,936. A slot's positions are capped here as in the other shapes.
QWEN3_NEXT_80B = dict(num_hidden_layers=48, num_experts=512, num_experts_per_tok=10,
                      hidden_size=2048, moe_intermediate_size=512,
                      shared_expert_intermediate_size=512, intermediate_size=5632,
                      num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                      linear_num_key_heads=16, linear_num_value_heads=32,
                      linear_key_head_dim=128, linear_value_head_dim=128,
                      linear_conv_kernel_dim=4, norm_topk_prob=True, vocab_size=151936,
                      max_position_embeddings=4096)
QWEN3_NEXT_TINY = dict(QWEN3_NEXT_80B, num_hidden_layers=4, num_experts=8, num_experts_per_tok=2,
                       hidden_size=64, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32, intermediate_size=96,
                       num_attention_heads=2, num_key_value_heads=1, linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_key_head_dim=16,
                       linear_value_head_dim=16, vocab_size=128, max_position_embeddings=256)


def moe_dims(shape: dict) -> tuple[int, int, int, int]:
    """(experts, top-k, hidden, expert intermediate) of a Qwen3-MoE, gpt-oss, qwen4_exp,
    glm4_moe or qwen3_next config dict."""
    E = next(shape[k] for k in ("num_experts", "num_local_experts", "n_routed_experts")
             if k in shape)
    I = shape.get("moe_intermediate_size", shape.get("intermediate_size"))
    return E, shape["num_experts_per_tok"], shape["hidden_size"], I


def qwen3_moe_dense_on_gpu(device="cuda", dtype=torch.bfloat16, seed: int = 0,
                           dense_nvfp4: bool = False, **shape):
    """A Qwen3-MoE causal LM whose dense part (attention, norms, router, embeddings) lives on
    `device` with random weights and whose experts hold no memory yet.

    The model is built on the meta device, the experts' parameters are released (0 elements),
    then only what is left is materialized on `device` and initialised (normal(0, 0.02) matrices,
    unit norms, zero biases and attention sinks, fresh rotary tables). Returns (model, specs):
    pass `specs` and NVFP4 rows to `cupool.wrap(model, layers=specs, expert_rows=...)`. A
    30B-parameter shape costs only its ~2 GB dense part here. dense_nvfp4: the attention
    projections quantized to NVFP4 and kept packed (`cupool.dense_nvfp4.quantize_linears`), as
    a checkpoint with NVFP4 self_attn loads.
    """
    from transformers import Qwen3MoeConfig

    from cupool import dense_nvfp4 as dn
    cfg = Qwen3MoeConfig(**{**QWEN3_30B_A3B, **shape}, dtype=dtype, tie_word_embeddings=False)
    model, specs = _dense_on_gpu(cfg, device, dtype, seed)
    if dense_nvfp4:
        dn.quantize_linears(model)
    return model, specs


def gpt_oss_dense_on_gpu(device="cuda", dtype=torch.bfloat16, seed: int = 0, **shape):
    """`qwen3_moe_dense_on_gpu` for a gpt-oss causal LM (GPT_OSS_120B unless `shape` says
    otherwise): its experts have biases and the clamped SwiGLU, so their rows are
    `RowLayout(H, I, bias=True)` rows (`random_rows_fast` fills the biases)."""
    from transformers import GptOssConfig
    shape = {**GPT_OSS_120B, **shape}
    layer_types = [("sliding_attention", "full_attention")[i % 2]
                   for i in range(shape["num_hidden_layers"])]
    cfg = GptOssConfig(**shape, layer_types=layer_types, dtype=dtype, tie_word_embeddings=False)
    return _dense_on_gpu(cfg, device, dtype, seed)


def qwen4_exp_dense_on_gpu(device="cuda", dtype=torch.bfloat16, seed: int = 0, **shape):
    """`qwen3_moe_dense_on_gpu` for a `qwen4_exp_text` causal LM (QWEN4_EXP unless `shape` says
    otherwise); it decodes through the Engine (per-slot states, QSA indexer)."""
    from transformers import AutoConfig
    cfg = AutoConfig.for_model("qwen4_exp_text", **{**QWEN4_EXP, **shape}, dtype=dtype,
                               tie_word_embeddings=False)
    return _dense_on_gpu(cfg, device, dtype, seed)


def glm4_moe_dense_on_gpu(device="cuda", dtype=torch.bfloat16, seed: int = 0,
                          dense_nvfp4: bool = False, **shape):
    """`qwen3_moe_dense_on_gpu` for a `glm4_moe` causal LM (GLM45_AIR unless `shape` says
    otherwise): its dense first layer's MLP, shared experts and q/k/v biases are dense weights
    here, its routers' correction biases random (normal(0, 0.1))."""
    return _family_dense_on_gpu("glm4_moe", {**GLM45_AIR, **shape}, device, dtype, seed,
                                dense_nvfp4)


def qwen3_next_dense_on_gpu(device="cuda", dtype=torch.bfloat16, seed: int = 0,
                            dense_nvfp4: bool = False, **shape):
    """`qwen3_moe_dense_on_gpu` for a `qwen3_next` causal LM (QWEN3_NEXT_80B unless `shape` says
    otherwise): its gated delta nets, shared experts and their gates are dense weights here; it
    decodes through the Engine (per-slot states)."""
    return _family_dense_on_gpu("qwen3_next", {**QWEN3_NEXT_80B, **shape}, device, dtype, seed,
                                dense_nvfp4)


def _family_dense_on_gpu(model_type: str, shape: dict, device, dtype, seed: int,
                         dense_nvfp4: bool):
    """`_dense_on_gpu` of transformers' `model_type` config with `shape`, its attention
    projections quantized to NVFP4 and kept packed where dense_nvfp4."""
    from transformers import AutoConfig

    from cupool import dense_nvfp4 as dn
    cfg = AutoConfig.for_model(model_type, **shape, dtype=dtype, tie_word_embeddings=False)
    model, specs = _dense_on_gpu(cfg, device, dtype, seed)
    if dense_nvfp4:
        dn.quantize_linears(model)
    return model, specs


def _dense_on_gpu(cfg, device, dtype, seed):
    from transformers import AutoModelForCausalLM

    from cupool.adapters import find_moe_layers
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    specs = find_moe_layers(model)
    for s in specs:
        s.release()
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.numel() == 0:
                continue
            if p.dim() == 1:                       # norms; biases and sinks start at zero
                p.fill_(0.0 if name.endswith(("bias", "sinks")) else 1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
        for name, b in model.named_buffers():    # sigmoid routers' correction biases
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1, generator=gen)
        for parent in model.modules():            # rotary tables were left uninitialised
            for child_name, child in list(parent.named_children()):
                if hasattr(child, "inv_freq") and hasattr(child, "config"):
                    setattr(parent, child_name, type(child)(config=child.config).to(device))
    model.eval()
    return model, specs
