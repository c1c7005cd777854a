"""Small checkpoints written the way published ones are, for the cupool.checkpoints tests.

Shape legend: L layers · E experts · H hidden · I expert intermediate.

Each architecture builder returns an `Arch`: its config.json (the keys and nesting of the published
config, at toy sizes), its dense tensors (the published names and shapes: attention, norms,
routers, shared experts, dense MLP layers, embeddings, MTP heads) and where its routed experts go.
Expert writers then place float, ModelOpt NVFP4 or compressed-tensors NVFP4 experts under the
architecture's names; `save` writes the directory (model.safetensors or shards with
model.safetensors.index.json, config.json, generation_config.json, tokenizer files, and an
optional hf_quant_config.json).

Sources of the names and layouts: the configs and safetensors indexes of Qwen/Qwen3-30B-A3B,
Qwen/Qwen2-57B-A14B, allenai/OLMoE-1B-7B, deepseek-ai/DeepSeek-V3 (MTP layer 61, FP8
weight_scale_inv), zai-org/GLM-4.5-Air, mistralai/Mixtral-8x7B, meta-llama/Llama-4-Scout
(fused experts [E, H, 2I]), Qwen/Qwen3-Next (mtp.*), transformers 5's fused MoE experts, ModelOpt's
unified HF export (nvidia/*-NVFP4, hf_quant_config.json) and llm-compressor's
nvfp4-pack-quantized compressor (RedHatAI/*-NVFP4); openai/gpt-oss-20b (MXFP4 `*_blocks` /
`*_scales` experts with biases, attention sinks, a router with a bias) and its bf16 export
(unsloth/gpt-oss-20b-BF16: gate_up_proj [E, H, 2I], gate/up interleaved along 2I); NVIDIA's
Nemotron-H releases (nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 and -NVFP4, transformers'
nemotron_h, vLLM's nemotron_h.py): `backbone.*` names, non-gated experts
`backbone.layers.{l}.mixer.experts.{e}.{up_proj,down_proj}`, the sigmoid router's
`mixer.gate.weight` and float32 `e_score_correction_bias`, `mixer.shared_experts`, Mamba-2 mixers,
config.json's hybrid_override_pattern, and for the NVFP4 release ModelOpt's names for the routed
and shared experts and the Mamba projections it quantizes.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from cupool.nvfp4 import NVFP4Tensor, quantize

PROJ = ("gate_proj", "up_proj", "down_proj")
MIXTRAL = ("w1", "w3", "w2")
NONGATED = (None, "up_proj", "down_proj")      # Nemotron-H: no gate projection


@dataclasses.dataclass
class Arch:
    """A model family at toy size: config, dense tensors and its experts' naming."""
    config: dict
    dense: dict                       # name -> tensor (float32; cast on save)
    expert_prefix: str                # e.g. "model.layers.{l}.mlp.experts"
    spelling: tuple                   # PROJ, MIXTRAL or NONGATED (gate None)
    moe_layers: list                  # main layers with routed experts
    mtp: dict = dataclasses.field(default_factory=dict)   # cupool layer index -> expert prefix
    mtp_dense: set = dataclasses.field(default_factory=set)
    fused_style: str | None = None    # "fused" ([E, 2I, H]) or "llama4" ([E, H, 2I]) when fused

    @property
    def L(self) -> int:
        c = self.config.get("text_config", self.config)
        return c["num_hidden_layers"]

    def prefix(self, layer: int) -> str:
        if layer in self.mtp:
            return self.mtp[layer]
        return self.expert_prefix.format(l=layer)

    def all_moe_layers(self, include_mtp=False) -> list:
        return self.moe_layers + (sorted(self.mtp) if include_mtp else [])


def _w(rng, *shape, scale=0.05):
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)) * scale


def _norm(n):
    return torch.ones(n)


def _attn(rng, t, pre, H, heads, kv, hd, *, bias=False, qk_norm=None):
    t[f"{pre}.self_attn.q_proj.weight"] = _w(rng, heads * hd, H)
    t[f"{pre}.self_attn.k_proj.weight"] = _w(rng, kv * hd, H)
    t[f"{pre}.self_attn.v_proj.weight"] = _w(rng, kv * hd, H)
    t[f"{pre}.self_attn.o_proj.weight"] = _w(rng, H, heads * hd)
    if bias:
        for p, n in (("q", heads * hd), ("k", kv * hd), ("v", kv * hd)):
            t[f"{pre}.self_attn.{p}_proj.bias"] = _w(rng, n)
    if qk_norm == "head":
        t[f"{pre}.self_attn.q_norm.weight"] = _norm(hd)
        t[f"{pre}.self_attn.k_norm.weight"] = _norm(hd)
    elif qk_norm == "full":
        t[f"{pre}.self_attn.q_norm.weight"] = _norm(heads * hd)
        t[f"{pre}.self_attn.k_norm.weight"] = _norm(kv * hd)


def _mla(rng, t, pre, H, heads, q_lora=48, kv_lora=32, nope=16, rope=16, v=16):
    t[f"{pre}.self_attn.q_a_proj.weight"] = _w(rng, q_lora, H)
    t[f"{pre}.self_attn.q_a_layernorm.weight"] = _norm(q_lora)
    t[f"{pre}.self_attn.q_b_proj.weight"] = _w(rng, heads * (nope + rope), q_lora)
    t[f"{pre}.self_attn.kv_a_proj_with_mqa.weight"] = _w(rng, kv_lora + rope, H)
    t[f"{pre}.self_attn.kv_a_layernorm.weight"] = _norm(kv_lora)
    t[f"{pre}.self_attn.kv_b_proj.weight"] = _w(rng, heads * (nope + v), kv_lora)
    t[f"{pre}.self_attn.o_proj.weight"] = _w(rng, H, heads * v)


def _mlp(rng, t, pre, H, inter):
    t[f"{pre}.gate_proj.weight"] = _w(rng, inter, H)
    t[f"{pre}.up_proj.weight"] = _w(rng, inter, H)
    t[f"{pre}.down_proj.weight"] = _w(rng, H, inter)


def _layer_norms(t, pre, H):
    t[f"{pre}.input_layernorm.weight"] = _norm(H)
    t[f"{pre}.post_attention_layernorm.weight"] = _norm(H)


def _top(rng, t, V, H, *, tie=False, head="model"):
    t[f"{head}.embed_tokens.weight"] = _w(rng, V, H)
    t[f"{head}.norm.weight"] = _norm(H)
    if not tie:
        t["lm_head.weight"] = _w(rng, V, H)


# --- architectures -----------------------------------------------------------------------------
def qwen3_moe(rng, L=2, E=4, H=64, I=32, V=32) -> Arch:
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
           "hidden_size": H, "intermediate_size": 3 * I, "moe_intermediate_size": I,
           "num_experts": E, "num_experts_per_tok": 2, "num_hidden_layers": L,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
           "rms_norm_eps": 1e-6, "rope_theta": 1e6, "vocab_size": V, "tie_word_embeddings": False,
           "max_position_embeddings": 256, "hidden_act": "silu", "torch_dtype": "bfloat16"}
    t = {}
    _top(rng, t, V, H)
    for li in range(L):
        pre = f"model.layers.{li}"
        _layer_norms(t, pre, H)
        _attn(rng, t, pre, H, 4, 2, 16, qk_norm="head")
        t[f"{pre}.mlp.gate.weight"] = _w(rng, E, H)
    return Arch(cfg, t, "model.layers.{l}.mlp.experts", PROJ, list(range(L)))


def qwen3_moe_fused(rng, **kw) -> Arch:
    """Qwen3-MoE as transformers >= 5 saves it: mlp.experts.gate_up_proj [E, 2I, H], down_proj."""
    a = qwen3_moe(rng, **kw)
    a.fused_style = "fused"
    return a


def olmoe(rng, L=2, E=4, H=64, I=32, V=32) -> Arch:
    cfg = {"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "hidden_size": H,
           "intermediate_size": I, "num_experts": E, "num_experts_per_tok": 2,
           "num_hidden_layers": L, "num_attention_heads": 4, "num_key_value_heads": 4,
           "norm_topk_prob": False, "vocab_size": V, "rms_norm_eps": 1e-5,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", "clip_qkv": None}
    t = {}
    _top(rng, t, V, H)
    for li in range(L):
        pre = f"model.layers.{li}"
        _layer_norms(t, pre, H)
        _attn(rng, t, pre, H, 4, 4, 16, qk_norm="full")
        t[f"{pre}.mlp.gate.weight"] = _w(rng, E, H)
    return Arch(cfg, t, "model.layers.{l}.mlp.experts", PROJ, list(range(L)))


def deepseek_v3(rng, L=3, E=4, H=64, I=32, V=32, first_k=1, mtp=1) -> Arch:
    """DeepSeek-V3 layout: MLA attention, dense MLP in layers < first_k_dense_replace, routed and
    shared experts, e_score_correction_bias, and MTP layers model.layers.{L..L+mtp-1}."""
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
           "hidden_size": H, "intermediate_size": 4 * I, "moe_intermediate_size": I,
           "n_routed_experts": E, "n_shared_experts": 1, "num_experts_per_tok": 2,
           "first_k_dense_replace": first_k, "moe_layer_freq": 1, "num_hidden_layers": L,
           "num_nextn_predict_layers": mtp, "num_attention_heads": 2, "num_key_value_heads": 2,
           "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16,
           "v_head_dim": 16, "n_group": 2, "topk_group": 1, "topk_method": "noaux_tc",
           "scoring_func": "sigmoid", "routed_scaling_factor": 2.5, "norm_topk_prob": True,
           "vocab_size": V, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
           "torch_dtype": "bfloat16"}
    t = {}
    _top(rng, t, V, H)
    mtp_dense: set = set()
    for li in range(L + mtp):
        pre = f"model.layers.{li}"
        before = set(t)
        _layer_norms(t, pre, H)
        _mla(rng, t, pre, H, 2)
        if li < first_k:
            _mlp(rng, t, f"{pre}.mlp", H, 4 * I)
        else:
            t[f"{pre}.mlp.gate.weight"] = _w(rng, E, H)
            t[f"{pre}.mlp.gate.e_score_correction_bias"] = torch.zeros(E)
            _mlp(rng, t, f"{pre}.mlp.shared_experts", H, I)
        if li >= L:                               # the MTP module's own tensors
            t[f"{pre}.enorm.weight"] = _norm(H)
            t[f"{pre}.hnorm.weight"] = _norm(H)
            t[f"{pre}.eh_proj.weight"] = _w(rng, H, 2 * H)
            t[f"{pre}.embed_tokens.weight"] = _w(rng, V, H)
            t[f"{pre}.shared_head.norm.weight"] = _norm(H)
            t[f"{pre}.shared_head.head.weight"] = _w(rng, V, H)
            mtp_dense |= set(t) - before
    return Arch(cfg, t, "model.layers.{l}.mlp.experts", PROJ, list(range(first_k, L)),
                mtp={L + k: f"model.layers.{L + k}.mlp.experts" for k in range(mtp)},
                mtp_dense=mtp_dense)


def glm4_moe(rng, L=3, E=4, H=64, I=32, V=32) -> Arch:
    """GLM-4.5(-Air): first_k_dense_replace, shared experts, q/k/v bias, one MTP layer at L."""
    cfg = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": H,
           "intermediate_size": 4 * I, "moe_intermediate_size": I, "n_routed_experts": E,
           "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
           "num_hidden_layers": L, "num_nextn_predict_layers": 1, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "attention_bias": True,
           "partial_rotary_factor": 0.5, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
           "routed_scaling_factor": 1.0, "use_qk_norm": False, "vocab_size": V,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    t = {}
    _top(rng, t, V, H)
    mtp_dense: set = set()
    for li in range(L + 1):
        pre = f"model.layers.{li}"
        before = set(t)
        _layer_norms(t, pre, H)
        _attn(rng, t, pre, H, 4, 2, 16, bias=True)
        if li == 0:
            _mlp(rng, t, f"{pre}.mlp", H, 4 * I)
        else:
            t[f"{pre}.mlp.gate.weight"] = _w(rng, E, H)
            t[f"{pre}.mlp.gate.e_score_correction_bias"] = torch.zeros(E)
            _mlp(rng, t, f"{pre}.mlp.shared_experts", H, I)
        if li == L:
            t[f"{pre}.eh_proj.weight"] = _w(rng, H, 2 * H)
            t[f"{pre}.enorm.weight"] = _norm(H)
            t[f"{pre}.hnorm.weight"] = _norm(H)
            t[f"{pre}.shared_head.norm.weight"] = _norm(H)
            mtp_dense |= set(t) - before
    return Arch(cfg, t, "model.layers.{l}.mlp.experts", PROJ, list(range(1, L)),
                mtp={L: f"model.layers.{L}.mlp.experts"}, mtp_dense=mtp_dense)


def qwen2_moe(rng, L=2, E=4, H=64, I=32, V=32) -> Arch:
    cfg = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": H,
           "intermediate_size": 4 * I, "moe_intermediate_size": I,
           "shared_expert_intermediate_size": 2 * I, "num_experts": E, "num_experts_per_tok": 2,
           "num_hidden_layers": L, "num_attention_heads": 4, "num_key_value_heads": 4,
           "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": False,
           "vocab_size": V, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    t = {}
    _top(rng, t, V, H)
    for li in range(L):
        pre = f"model.layers.{li}"
        _layer_norms(t, pre, H)
        _attn(rng, t, pre, H, 4, 4, 16, bias=True)
        t[f"{pre}.mlp.gate.weight"] = _w(rng, E, H)
        _mlp(rng, t, f"{pre}.mlp.shared_expert", H, 2 * I)
        t[f"{pre}.mlp.shared_expert_gate.weight"] = _w(rng, 1, H)
    return Arch(cfg, t, "model.layers.{l}.mlp.experts", PROJ, list(range(L)))


def mixtral(rng, L=2, E=4, H=64, I=32, V=32) -> Arch:
    cfg = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": H,
           "intermediate_size": I, "num_local_experts": E, "num_experts_per_tok": 2,
           "num_hidden_layers": L, "num_attention_heads": 4, "num_key_value_heads": 2,
           "vocab_size": V, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
           "torch_dtype": "bfloat16", "router_aux_loss_coef": 0.02}
    t = {}
    _top(rng, t, V, H)
    for li in range(L):
        pre = f"model.layers.{li}"
        _layer_norms(t, pre, H)
        _attn(rng, t, pre, H, 4, 2, 16)
        t[f"{pre}.block_sparse_moe.gate.weight"] = _w(rng, E, H)
    return Arch(cfg, t, "model.layers.{l}.block_sparse_moe.experts", MIXTRAL, list(range(L)))


def llama4(rng, L=2, E=4, H=64, I=32, V=32) -> Arch:
    """Llama-4 (Scout/Maverick) as Meta's HF upload holds it: language_model.model.layers.{l}
    .feed_forward.experts.gate_up_proj [E, H, 2I] and down_proj [E, I, H] (x @ W), a router and
    a shared expert; the text model's values in config.json's text_config."""
    text = {"model_type": "llama4_text", "hidden_size": H, "intermediate_size": I,
            "intermediate_size_mlp": 4 * I, "num_local_experts": E, "num_experts_per_tok": 1,
            "num_hidden_layers": L, "interleave_moe_layer_step": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "vocab_size": V, "rms_norm_eps": 1e-5}
    cfg = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
           "text_config": text, "vision_config": {"model_type": "llama4_vision_model",
                                                  "hidden_size": 32},
           "torch_dtype": "bfloat16", "tie_word_embeddings": False}
    t = {}
    _top(rng, t, V, H, head="language_model.model", tie=True)
    t["language_model.lm_head.weight"] = _w(rng, V, H)
    t["vision_model.patch_embedding.linear.weight"] = _w(rng, 32, 48)
    t["multi_modal_projector.linear_1.weight"] = _w(rng, H, 32)
    for li in range(L):
        pre = f"language_model.model.layers.{li}"
        _layer_norms(t, pre, H)
        _attn(rng, t, pre, H, 4, 2, 16)
        t[f"{pre}.feed_forward.router.weight"] = _w(rng, E, H)
        _mlp(rng, t, f"{pre}.feed_forward.shared_expert", H, I)
    return Arch(cfg, t, "language_model.model.layers.{l}.feed_forward.experts", PROJ,
                list(range(L)), fused_style="llama4")


def qwen3_next(rng, L=2, E=4, H=64, I=32, V=32) -> Arch:
    """Qwen3-Next-style MTP: `mtp.fc`, `mtp.norm`, `mtp.layers.0.*` with routed experts (cupool
    numbers that layer L + 0)."""
    cfg = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
           "hidden_size": H, "intermediate_size": 4 * I, "moe_intermediate_size": I,
           "shared_expert_intermediate_size": I, "num_experts": E, "num_experts_per_tok": 2,
           "num_hidden_layers": L, "decoder_sparse_step": 1, "mlp_only_layers": [],
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "vocab_size": V, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    t = {}
    _top(rng, t, V, H)
    mtp_dense: set = set()
    for pre in [f"model.layers.{li}" for li in range(L)] + ["mtp.layers.0"]:
        before = set(t)
        _layer_norms(t, pre, H)
        _attn(rng, t, pre, H, 4, 2, 16, qk_norm="head")
        t[f"{pre}.mlp.gate.weight"] = _w(rng, E, H)
        _mlp(rng, t, f"{pre}.mlp.shared_expert", H, I)
        t[f"{pre}.mlp.shared_expert_gate.weight"] = _w(rng, 1, H)
        if pre.startswith("mtp"):
            mtp_dense |= set(t) - before
    for n, v in (("mtp.fc.weight", _w(rng, H, 2 * H)), ("mtp.norm.weight", _norm(H)),
                 ("mtp.pre_fc_norm_embedding.weight", _norm(H)),
                 ("mtp.pre_fc_norm_hidden.weight", _norm(H))):
        t[n] = v
        mtp_dense.add(n)
    return Arch(cfg, t, "model.layers.{l}.mlp.experts", PROJ, list(range(L)),
                mtp={L: "mtp.layers.0.mlp.experts"}, mtp_dense=mtp_dense)


# Nemotron-3-Nano-30B-A3B's pattern is "MEMEM*EMEMEM*E...": M Mamba-2, E MoE, * attention,
# - MLP. This one has every kind, two MoE layers (one right after the attention layer) and a
# Mamba layer that feeds the attention layer (the one the NVFP4 release keeps in bf16).
NEMOTRON_PATTERN = "MEM*E-"


def nemotron_h(rng, L=None, E=8, H=64, I=32, V=64, *, pattern=NEMOTRON_PATTERN,
               latent: int | None = None, shared=True) -> Arch:
    """Nemotron-H as NVIDIA publishes it (the Nano-30B-A3B config's keys at toy size, its
    auto_map to the release's own code included, which transformers >= 5 does not need):
    hybrid_override_pattern and num_hidden_layers, `backbone.embeddings`, `backbone.norm_f`,
    per layer `backbone.layers.{l}.norm` and one `mixer`: Mamba-2 (in_proj [2·Im + 2·G·N + h, H],
    conv1d over Im + 2·G·N channels with a bias, A_log, D, dt_bias [h], a gated norm [Im],
    out_proj [H, Im]; Im = h · head_dim), attention (q/k/v/o_proj, no rotary), an MLP (up_proj,
    down_proj, ReLU²) or MoE: the router `mixer.gate.weight` [E, H] with float32
    `e_score_correction_bias` [E], `mixer.shared_experts.{up,down}_proj` and the routed experts
    `mixer.experts.{e}.{up,down}_proj` (no gate). latent: Nemotron-3-Super's latent MoE
    (moe_latent_size; `mixer.fc1_latent_proj` [latent, H], `fc2_latent_proj` [H, latent]; the
    experts then work in [I, latent]). L defaults to len(pattern)."""
    L = len(pattern) if L is None else L
    assert L == len(pattern)
    heads, head_dim, groups, state, conv = 4, 16, 2, 8, 4
    im = heads * head_dim
    shared_i = 2 * I
    cfg = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
           "auto_map": {"AutoConfig": "configuration_nemotron_h.NemotronHConfig",
                        "AutoModel": "modeling_nemotron_h.NemotronHForCausalLM",
                        "AutoModelForCausalLM": "modeling_nemotron_h.NemotronHForCausalLM"},
           "attention_bias": False, "chunk_size": 128, "conv_kernel": conv, "expand": 2,
           "head_dim": 16, "hidden_size": H, "hybrid_override_pattern": pattern,
           "initializer_range": 0.02, "intermediate_size": 3 * I, "layer_norm_epsilon": 1e-5,
           "mamba_head_dim": head_dim, "mamba_hidden_act": "silu", "mamba_num_heads": heads,
           "mamba_proj_bias": False, "max_position_embeddings": 256, "mlp_bias": False,
           "mlp_hidden_act": "relu2", "moe_intermediate_size": I,
           "moe_shared_expert_intermediate_size": shared_i, "moe_latent_size": latent,
           "n_group": 1, "n_groups": groups, "n_routed_experts": E,
           "n_shared_experts": 1 if shared else 0, "norm_eps": 1e-5, "norm_topk_prob": True,
           "num_attention_heads": 4, "num_experts_per_tok": 2, "num_hidden_layers": L,
           "num_key_value_heads": 2, "num_logits_to_keep": 1, "pad_token_id": 0,
           "bos_token_id": 1, "eos_token_id": 2, "rescale_prenorm_residual": True,
           "residual_in_fp32": False, "routed_scaling_factor": 2.5, "ssm_state_size": state,
           "tie_word_embeddings": False, "topk_group": 1, "torch_dtype": "bfloat16",
           "use_bias": False, "use_cache": True, "use_conv_bias": True, "vocab_size": V}
    t = {"backbone.embeddings.weight": _w(rng, V, H), "backbone.norm_f.weight": _norm(H),
         "lm_head.weight": _w(rng, V, H)}
    moe = []
    for li, kind in enumerate(pattern):
        pre = f"backbone.layers.{li}"
        t[f"{pre}.norm.weight"] = _norm(H) + _w(rng, H)
        m = f"{pre}.mixer"
        if kind == "M":
            conv_dim = im + 2 * groups * state
            t[f"{m}.in_proj.weight"] = _w(rng, 2 * im + 2 * groups * state + heads, H)
            t[f"{m}.conv1d.weight"] = _w(rng, conv_dim, 1, conv, scale=0.3)
            t[f"{m}.conv1d.bias"] = _w(rng, conv_dim)
            t[f"{m}.A_log"] = torch.log(torch.arange(1, heads + 1, dtype=torch.float32))
            t[f"{m}.D"] = torch.ones(heads)
            t[f"{m}.dt_bias"] = _w(rng, heads, scale=0.5)
            t[f"{m}.norm.weight"] = _norm(im)
            t[f"{m}.out_proj.weight"] = _w(rng, H, im)
        elif kind == "*":
            t[f"{m}.q_proj.weight"] = _w(rng, 4 * 16, H)
            t[f"{m}.k_proj.weight"] = _w(rng, 2 * 16, H)
            t[f"{m}.v_proj.weight"] = _w(rng, 2 * 16, H)
            t[f"{m}.o_proj.weight"] = _w(rng, H, 4 * 16)
        elif kind == "-":
            t[f"{m}.up_proj.weight"] = _w(rng, 3 * I, H)
            t[f"{m}.down_proj.weight"] = _w(rng, H, 3 * I)
        elif kind == "E":
            moe.append(li)
            t[f"{m}.gate.weight"] = _w(rng, E, H, scale=0.5)
            t[f"{m}.gate.e_score_correction_bias"] = _w(rng, E, scale=0.1)
            if shared:
                t[f"{m}.shared_experts.up_proj.weight"] = _w(rng, shared_i, H)
                t[f"{m}.shared_experts.down_proj.weight"] = _w(rng, H, shared_i)
            if latent is not None:
                t[f"{m}.fc1_latent_proj.weight"] = _w(rng, latent, H)
                t[f"{m}.fc2_latent_proj.weight"] = _w(rng, H, latent)
        else:
            raise ValueError(f"pattern character {kind!r}")
    return Arch(cfg, t, "backbone.layers.{l}.mixer.experts", NONGATED, moe)


# the gated families (Nemotron-H's releases: `nemotron_release`, test_checkpoints_nemotron)
ARCHS = {"qwen3_moe": qwen3_moe, "qwen3_moe_fused": qwen3_moe_fused, "olmoe": olmoe,
         "deepseek_v3": deepseek_v3, "glm4_moe": glm4_moe, "qwen2_moe": qwen2_moe,
         "mixtral": mixtral, "llama4": llama4, "qwen3_next": qwen3_next}


# --- experts -------------------------------------------------------------------------------------
def float_experts(rng, arch: Arch, dtype=torch.bfloat16, include_mtp=True) -> dict:
    """{layer: (gate [E, I, H], up [E, I, H], down [E, H, I])} in `dtype`, each matrix with its own
    magnitude, for every MoE (and MTP) layer of `arch` (gate None for an arch without a gate;
    H is moe_latent_size where the config sets it)."""
    c = arch.config.get("text_config", arch.config)
    E = next(c[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if k in c)
    H = c.get("moe_latent_size") or c["hidden_size"]
    I = c.get("moe_intermediate_size") or c["intermediate_size"]
    out = {}
    for layer in arch.all_moe_layers(include_mtp):
        mats = []
        for proj, shape in zip(arch.spelling, ((E, I, H), (E, I, H), (E, H, I))):
            if proj is None:
                mats.append(None)
                continue
            w = _w(rng, *shape, scale=1.0)
            w = w * torch.from_numpy(rng.uniform(0.01, 0.2, (E, 1, 1)).astype(np.float32))
            mats.append(w.to(dtype))
        out[layer] = tuple(mats)
    return out


def reference_nvfp4(experts: dict, scale2: str = "half") -> dict:
    """{layer: (gate, up, down) stacked NVFP4Tensors} by the CPU reference quantizer. scale2:
    "half" (every matrix its own global scale, as per-expert exports have it), "expert" (gate and
    up of an expert share one, quantized as one [2I, H] matrix, as ModelOpt's fused export does)
    or "shared" (one global scale for all experts of a tensor, as Llama-4's export has it)."""
    out = {}
    for layer, (g, u, d) in experts.items():
        if scale2 == "half" or g is None:          # experts without a gate: one matrix each
            out[layer] = tuple(None if w is None else quantize(w) for w in (g, u, d))
            continue
        E, I = g.shape[0], g.shape[1]
        gu = torch.cat([g, u], dim=1)
        if scale2 == "expert":
            qgu, qd = quantize(gu), quantize(d)
        else:
            qgu, qd = quantize(gu.reshape(1, -1, gu.shape[2])), quantize(d.reshape(1, -1, d.shape[2]))
            qgu = NVFP4Tensor(qgu.packed.reshape(E, 2 * I, -1), qgu.block_scale.reshape(E, 2 * I, -1),
                              qgu.global_scale.expand(E).contiguous())
            qd = NVFP4Tensor(qd.packed.reshape(E, d.shape[1], -1), qd.block_scale.reshape(E, d.shape[1], -1),
                             qd.global_scale.expand(E).contiguous())
        half = [NVFP4Tensor(qgu.packed[:, lo:hi].contiguous(), qgu.block_scale[:, lo:hi].contiguous(),
                            qgu.global_scale.clone()) for lo, hi in ((0, I), (I, 2 * I))]
        out[layer] = (*half, qd)
    return out


def put_float_experts(t: dict, arch: Arch, experts: dict, *, style: str | None = None) -> None:
    """Float experts under the arch's names: style "per" (per expert; default unless the arch is
    fused), "fused" ([E, 2I, H] + [E, H, I]) or "llama4" ([E, H, 2I] + [E, I, H])."""
    style = style or arch.fused_style or "per"
    for layer, (g, u, d) in experts.items():
        pre = arch.prefix(layer)
        if style == "per":
            for e in range(u.shape[0]):
                for proj, w in zip(arch.spelling, (g, u, d)):
                    if proj is not None and w is not None:      # None: left out
                        t[f"{pre}.{e}.{proj}.weight"] = w[e].clone()
        elif style == "fused":
            t[f"{pre}.gate_up_proj"] = torch.cat([g, u], dim=1).contiguous()
            t[f"{pre}.down_proj"] = d.contiguous()
        elif style == "llama4":
            t[f"{pre}.gate_up_proj"] = torch.cat([g, u], dim=1).transpose(1, 2).contiguous()
            t[f"{pre}.down_proj"] = d.transpose(1, 2).contiguous()
        else:
            raise ValueError(style)


def put_modelopt_experts(t: dict, arch: Arch, q: dict, *, style: str = "ep",
                         scale2: str = "expert", input_scale: bool = True) -> None:
    """ModelOpt NVFP4 experts: style "ep" (experts.{e}.{proj}.weight...), "pe"
    (experts.{proj}.{e}...), "fused" (gate_up_proj uint8 [E, 2I, H/2] ...), "fused_t" (Llama-4's
    transposed [E, H/2, 2I] ...). scale2 for fused: "expert" ([E]), "half" ([E, 2]: gate and up
    their own), "shared" ([]: one for all experts, needs equal global scales)."""
    for layer, (g, u, d) in q.items():
        pre = arch.prefix(layer)
        if style in ("ep", "pe"):
            for e in range(u.packed.shape[0]):
                for proj, m in zip(arch.spelling, (g, u, d)):
                    if proj is None:
                        continue
                    base = f"{pre}.{e}.{proj}" if style == "ep" else f"{pre}.{proj}.{e}"
                    t[f"{base}.weight"] = m.packed[e].clone()
                    t[f"{base}.weight_scale"] = m.block_scale[e].clone()
                    t[f"{base}.weight_scale_2"] = m.global_scale[e].clone().reshape(())
                    if input_scale:
                        t[f"{base}.input_scale"] = torch.tensor(0.01)
            continue
        gu_p = torch.cat([g.packed, u.packed], dim=1)
        gu_s = torch.cat([g.block_scale, u.block_scale], dim=1)
        dn_p, dn_s = d.packed, d.block_scale
        if style == "fused_t":
            gu_p, gu_s = _t_packed(torch.cat([_codes(g), _codes(u)], dim=1)), \
                gu_s.transpose(1, 2)
            dn_p, dn_s = _t_packed(_codes(d)), dn_s.transpose(1, 2)
        if scale2 == "expert":
            assert torch.equal(g.global_scale, u.global_scale), "quantize with scale2='expert'"
            gs_gu, gs_dn = g.global_scale.clone(), d.global_scale.clone()
        elif scale2 == "half":
            gs_gu, gs_dn = torch.stack([g.global_scale, u.global_scale], 1), d.global_scale.clone()
        else:
            assert (g.global_scale == g.global_scale[0]).all(), "quantize with scale2='shared'"
            gs_gu, gs_dn = g.global_scale[0].clone().reshape(()), \
                d.global_scale[0].clone().reshape(())
        for name, p, s, gs in (("gate_up_proj", gu_p, gu_s, gs_gu), ("down_proj", dn_p, dn_s, gs_dn)):
            t[f"{pre}.{name}"] = p.contiguous()
            t[f"{pre}.{name}_weight_scale"] = s.contiguous()
            t[f"{pre}.{name}_weight_scale_2"] = gs.contiguous()
            if input_scale:
                t[f"{pre}.{name}_input_scale"] = torch.tensor(0.01)


def _codes(q: NVFP4Tensor) -> torch.Tensor:
    p = q.packed
    return torch.stack([p & 0xF, p >> 4], dim=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)


def _t_packed(codes: torch.Tensor) -> torch.Tensor:
    """Codes [E, N, K] -> bytes [E, K/2, N] packed along K (dim 1): byte (e, j, n) holds element
    (n, 2j) in its low nibble and (n, 2j + 1) in its high nibble, as Llama-4 NVFP4 exports do."""
    c = codes.transpose(1, 2)                                   # [E, K, N]
    return (c[:, 0::2] | (c[:, 1::2] << 4)).to(torch.uint8)


def put_ct_experts(t: dict, arch: Arch, q: dict, *, layers=None) -> None:
    """compressed-tensors NVFP4 experts: weight_packed, weight_scale, weight_global_scale =
    1 / global (float32 division), input_global_scale."""
    for layer, (g, u, d) in q.items():
        if layers is not None and layer not in layers:
            continue
        pre = arch.prefix(layer)
        for e in range(u.packed.shape[0]):
            for proj, m in zip(arch.spelling, (g, u, d)):
                if proj is None:
                    continue
                base = f"{pre}.{e}.{proj}"
                t[f"{base}.weight_packed"] = m.packed[e].clone()
                t[f"{base}.weight_scale"] = m.block_scale[e].clone()
                t[f"{base}.weight_global_scale"] = (torch.ones(1) / m.global_scale[e].reshape(1))
                t[f"{base}.input_global_scale"] = torch.tensor([100.0])


# --- dense quantization helpers ------------------------------------------------------------------
def nvfp4_dense(t: dict, module: str, *, ct: bool = False) -> torch.Tensor:
    """Replace `module.weight` by its NVFP4 tensors (ModelOpt or compressed-tensors names); returns
    the dequantized float32 weight the reader must give back."""
    from cupool.nvfp4 import dequantize
    w = t.pop(f"{module}.weight").to(torch.bfloat16)
    q = quantize(w)
    if ct:
        t[f"{module}.weight_packed"] = q.packed
        t[f"{module}.weight_scale"] = q.block_scale
        gs = torch.ones(1) / q.global_scale.reshape(1)
        t[f"{module}.weight_global_scale"] = gs
        t[f"{module}.input_global_scale"] = torch.tensor([50.0])
        return dequantize(NVFP4Tensor(q.packed, q.block_scale, (torch.ones(1) / gs)[0]))
    t[f"{module}.weight"] = q.packed
    t[f"{module}.weight_scale"] = q.block_scale
    t[f"{module}.weight_scale_2"] = q.global_scale.reshape(())
    t[f"{module}.input_scale"] = torch.tensor(0.02)
    return dequantize(q)


def fp8_dense(t: dict, module: str, how: str = "tensor", block=(128, 128),
              scale_name: str = "weight_scale") -> torch.Tensor:
    """Replace `module.weight` by float8_e4m3fn + its scale: how "tensor" ([] scale, ModelOpt
    FP8), "channel" ([N, 1], compressed-tensors), "block" ([ceil(N/bn), ceil(K/bk)] float32, as
    DeepSeek's weight_scale_inv). Returns the dequantized float32 weight."""
    w = t.pop(f"{module}.weight").float()
    n, k = w.shape
    if how == "tensor":
        s = w.abs().amax() / 448
        full = s
    elif how == "channel":
        s = w.abs().amax(dim=1, keepdim=True) / 448
        full = s
    else:
        bn, bk = block
        pad = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk)
        pad[:n, :k] = w.abs()
        s = pad.reshape(pad.shape[0] // bn, bn, pad.shape[1] // bk, bk).amax(dim=(1, 3)) / 448
        s = torch.where(s > 0, s, torch.ones_like(s))
        full = s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    w8 = (w / full).to(torch.float8_e4m3fn)
    t[f"{module}.weight"] = w8
    t[f"{module}.{scale_name}"] = s.float().contiguous()
    if how != "block":
        t[f"{module}.input_scale"] = torch.tensor(0.05)
    return w8.float() * full


def fp8_quantize(w: torch.Tensor, how: str = "block", block=(128, 128),
                 scale_dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, scale, dequantized float32) of a float [N, K] matrix, as DeepSeek's
    and Qwen's FP8 exporters write it: how "block" (scale [ceil(N/bn), ceil(K/bk)] = amax / 448
    of each bn × bk block, partial blocks at the edges) or "channel" ([N, 1]); the scale in
    `scale_dtype` (float32: DeepSeek-V3, Kimi-K2; bf16: Qwen3.5's weight_scale_inv)."""
    w = w.float()
    n, k = w.shape
    if how == "channel":
        s = (w.abs().amax(dim=1, keepdim=True) / 448).to(scale_dtype)
        full = s.float()
    else:
        bn, bk = block
        pad = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk)
        pad[:n, :k] = w.abs()
        s = pad.reshape(pad.shape[0] // bn, bn, pad.shape[1] // bk, bk).amax(dim=(1, 3)) / 448
        s = torch.where(s > 0, s, torch.ones_like(s)).to(scale_dtype)
        full = s.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    w8 = (w / full).to(torch.float8_e4m3fn)
    return w8, s, w8.float() * full


def put_fp8_experts(t: dict, arch: Arch, experts: dict, *, how: str = "block", block=(128, 128),
                    scale_dtype=torch.float32, scale_name: str = "weight_scale_inv") -> dict:
    """FP8 experts under the arch's per-expert names (`{pre}.{e}.{proj}.weight` float8_e4m3fn +
    `{scale_name}`); returns {layer: (gate, up, down)} of their dequantized float32 values."""
    out = {}
    for layer, mats in experts.items():
        pre = arch.prefix(layer)
        deq = [torch.empty(m.shape) for m in mats]
        for e in range(mats[0].shape[0]):
            for p, (proj, w) in enumerate(zip(arch.spelling, mats)):
                w8, sc, dq = fp8_quantize(w[e], how, block, scale_dtype)
                t[f"{pre}.{e}.{proj}.weight"] = w8
                t[f"{pre}.{e}.{proj}.{scale_name}"] = sc
                deq[p][e] = dq
        out[layer] = tuple(deq)
    return out


def fp8_config_json(config: dict, block=(128, 128), **extra) -> dict:
    """config.json with the quantization_config DeepSeek-V3, Kimi-K2 and Qwen's -FP8 publish."""
    q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
         "weight_block_size": list(block), **extra}
    return dict(config, quantization_config=q)


# --- writing -------------------------------------------------------------------------------------
# float32 tensors `save` keeps in float32 (scales, routers' score-correction biases)
KEEP_FP32 = ("scale", "scale_2", "global_scale", "scale_inv", "e_score_correction_bias")


def save(directory, tensors: dict, config: dict, *, shards: int = 1, dtype=torch.bfloat16,
         hf_quant_config: dict | None = None) -> Path:
    """Write a checkpoint directory. Float32 tensors are cast to `dtype` (scales that must stay
    float32: names ending in scale / scale_2 / global_scale / scale_inv /
    e_score_correction_bias); shards > 1 writes model-0000i-of-0000n.safetensors and the index."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    out = {}
    for k, v in tensors.items():
        v = v.detach().cpu()
        if v.dtype == torch.float32 and not k.endswith(KEEP_FP32):
            v = v.to(dtype)
        out[k] = v.contiguous()
    names = list(out)
    if shards == 1:
        save_file(out, str(d / "model.safetensors"), metadata={"format": "pt"})
    else:
        per = -(-len(names) // shards)
        wm = {}
        for i in range(shards):
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: out[n] for n in names[i * per:(i + 1) * per]}
            save_file(part, str(d / fname), metadata={"format": "pt"})
            wm.update(dict.fromkeys(part, fname))
        total = sum(v.numel() * v.element_size() for v in out.values())
        (d / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": wm}, indent=2))
    (d / "config.json").write_text(json.dumps(config, indent=2))
    (d / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.6}))
    (d / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256,
                                                         "tokenizer_class": "PreTrainedTokenizer"}))
    (d / "special_tokens_map.json").write_text(json.dumps({"eos_token": "</s>"}))
    if hf_quant_config is not None:
        (d / "hf_quant_config.json").write_text(json.dumps(hf_quant_config, indent=2))
    return d


def modelopt_hf_quant(algo="NVFP4", *, flat=False, exclude=("lm_head",), **extra) -> dict:
    q = {"quant_algo": algo, "kv_cache_quant_algo": None, "group_size": 16,
         "exclude_modules": list(exclude), **extra}
    if flat:
        return q
    return {"producer": {"name": "modelopt", "version": "0.37.0"}, "quantization": q}


def modelopt_config_json(config: dict, algo="NVFP4", *, ignore=("lm_head",), **extra) -> dict:
    c = dict(config)
    c["quantization_config"] = {"quant_method": "modelopt", "quant_algo": algo,
                                "kv_cache_quant_algo": None, "group_size": 16,
                                "ignore": list(ignore), "producer": {"name": "modelopt"}, **extra}
    return c


def ct_config_json(config: dict, *, ignore=("lm_head", "re:.*mlp.gate$"), fmt="nvfp4-pack-quantized",
                   groups=None) -> dict:
    c = dict(config)
    nvfp4_group = {
        "targets": ["Linear"], "format": fmt if fmt != "mixed-precision" else "nvfp4-pack-quantized",
        "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                    "symmetric": True, "dynamic": False, "observer": "minmax"},
        "input_activations": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                              "group_size": 16, "symmetric": True, "dynamic": "local"},
        "output_activations": None}
    c["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
        "config_groups": groups or {"group_0": nvfp4_group}, "ignore": list(ignore),
        "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {},
        "global_compression_ratio": None, "version": "0.12.2"}
    return c


def write_streaming(path: Path, specs, fill) -> None:
    """A safetensors file written without holding its tensors: specs [(name, code, shape)] with
    code a safetensors dtype ("BF16", ...); fill(name, nbytes) returns that tensor's bytes in
    chunks (an iterable of bytes-like objects)."""
    item = {"BF16": 2, "F16": 2, "F32": 4, "U8": 1}
    header, off = {}, 0
    for name, code, shape in specs:
        n = math.prod(shape) * item[code]
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, code, shape in specs:
            n = math.prod(shape) * item[code]
            done = 0
            for chunk in fill(name, n):
                f.write(chunk)
                done += len(memoryview(chunk).cast("B"))
            assert done == n, (name, done, n)


# --- comparisons ---------------------------------------------------------------------------------
def same_nvfp4(a: NVFP4Tensor, b: NVFP4Tensor) -> bool:
    """Bit-for-bit equal codes, block scales and global scales (shapes included)."""
    return (a.packed.shape == b.packed.shape and torch.equal(a.packed, b.packed)
            and torch.equal(a.block_scale.view(torch.uint8), b.block_scale.view(torch.uint8))
            and a.global_scale.shape == b.global_scale.shape
            and torch.equal(a.global_scale.view(torch.int32), b.global_scale.view(torch.int32)))


def open_files_under(directory) -> list[str]:
    """Paths under `directory` this process holds open (Linux /proc/self/fd)."""
    import os
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(directory)):
            out.append(target)
    return out


# --- gpt-oss: MXFP4 and bf16 experts with biases --------------------------------------------------
E2M1_TABLE = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GPT_OSS_NOT_CONVERT = ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                       "model.embed_tokens", "lm_head"]


def gpt_oss(rng, L=2, E=4, H=64, I=64, V=32) -> Arch:
    """openai/gpt-oss-20b's layout at toy size: every layer MoE with fused experts and biases,
    attention with q/k/v/o biases and sinks, sliding and full attention alternating, a router
    with a bias. config.json as published but without its quantization_config
    (`mxfp4_config_json` adds it); the experts come from `put_mxfp4_experts` or
    `put_gpt_oss_float_experts`."""
    heads, kv, hd = 4, 2, 16
    cfg = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
           "attention_dropout": 0.0, "experts_per_token": min(4, E), "head_dim": hd,
           "hidden_act": "silu", "hidden_size": H, "initial_context_length": 4096,
           "initializer_range": 0.02, "intermediate_size": I,
           "layer_types": ["sliding_attention" if li % 2 == 0 else "full_attention"
                           for li in range(L)],
           "max_position_embeddings": 4096, "num_attention_heads": heads,
           "num_experts_per_tok": min(4, E), "num_hidden_layers": L, "num_key_value_heads": kv,
           "num_local_experts": E, "output_router_logits": False, "rms_norm_eps": 1e-5,
           "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 1.0,
                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                            "truncate": False},
           "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
           "swiglu_limit": 7.0, "tie_word_embeddings": False, "use_cache": True,
           "vocab_size": V, "pad_token_id": 0, "eos_token_id": 2, "torch_dtype": "bfloat16"}
    t = {}
    _top(rng, t, V, H)
    for li in range(L):
        pre = f"model.layers.{li}"
        _layer_norms(t, pre, H)
        _attn(rng, t, pre, H, heads, kv, hd, bias=True)
        t[f"{pre}.self_attn.o_proj.bias"] = _w(rng, H)
        t[f"{pre}.self_attn.sinks"] = _w(rng, heads, scale=1.0)
        t[f"{pre}.mlp.router.weight"] = _w(rng, E, H)
        t[f"{pre}.mlp.router.bias"] = _w(rng, E)
    return Arch(cfg, t, "model.layers.{l}.mlp.experts", PROJ, list(range(L)),
                fused_style="gpt_oss")


def mxfp4_config_json(config: dict, not_convert=GPT_OSS_NOT_CONVERT) -> dict:
    """config.json with gpt-oss's published quantization_config."""
    c = dict(config)
    c["quantization_config"] = {"modules_to_not_convert": list(not_convert),
                                "quant_method": "mxfp4"}
    return c


def _dims(arch: Arch):
    c = arch.config.get("text_config", arch.config)
    return c["num_local_experts"], c["hidden_size"], c["intermediate_size"]


def mxfp4_matrices(rng, E: int, N: int, K: int, exponents=(118, 127), zeros: float = 0.05):
    """(blocks uint8 [E, N, K/32, 16], scales uint8 [E, N, K/32]) of random MXFP4 matrices: random
    code bytes, E8M0 exponents uniform in `exponents` (inclusive); a fraction `zeros` of the
    blocks holds only ±0 codes with an exponent above the range (it must not set the matrix's
    top)."""
    lo, hi = exponents
    blocks = torch.from_numpy(rng.integers(0, 256, (E, N, K // 32, 16), dtype=np.uint8))
    scales = torch.from_numpy(rng.integers(lo, hi + 1, (E, N, K // 32)).astype(np.uint8))
    z = torch.from_numpy(rng.random((E, N, K // 32)) < zeros)
    signs = torch.from_numpy(rng.integers(0, 2, (E, N, K // 32, 16, 2)).astype(np.uint8)) * 8
    zero_bytes = signs[..., 0] | (signs[..., 1] << 4)
    blocks = torch.where(z[..., None], zero_bytes, blocks)
    scales = torch.where(z, torch.full_like(scales, min(254, hi + 3)), scales)
    return blocks, scales


def mxfp4_experts(rng, arch: Arch, exponents=(118, 127)) -> dict:
    """{layer: (gate_up_blocks [E, 2I, H/32, 16], gate_up_scales [E, 2I, H/32], down_blocks
    [E, H, I/32, 16], down_scales [E, H, I/32])}, rows as gpt-oss stores them (gate_up's 2I rows
    interleaved: row 2i gate i, 2i + 1 up i)."""
    E, H, I = _dims(arch)
    out = {}
    for layer in arch.moe_layers:
        out[layer] = (*mxfp4_matrices(rng, E, 2 * I, H, exponents),
                      *mxfp4_matrices(rng, E, H, I, exponents))
    return out


def gpt_oss_biases(rng, arch: Arch) -> dict:
    """{layer: (gate_up_bias [E, 2I] interleaved, down_bias [E, H])}, float32 values that bf16
    holds exactly (what a reader returns after the bf16 round trip)."""
    E, H, I = _dims(arch)
    return {layer: (_w(rng, E, 2 * I, scale=0.1).to(torch.bfloat16).float(),
                    _w(rng, E, H, scale=0.1).to(torch.bfloat16).float())
            for layer in arch.moe_layers}


def put_mxfp4_experts(t: dict, arch: Arch, mx: dict, biases: dict | None = None) -> None:
    """MXFP4 experts under gpt-oss's names ({mid}.gate_up_proj_blocks / _scales / _bias,
    {mid}.down_proj_blocks / _scales / _bias)."""
    for layer, (gb, gs, db, ds) in mx.items():
        pre = arch.prefix(layer)
        t[f"{pre}.gate_up_proj_blocks"] = gb.contiguous()
        t[f"{pre}.gate_up_proj_scales"] = gs.contiguous()
        t[f"{pre}.down_proj_blocks"] = db.contiguous()
        t[f"{pre}.down_proj_scales"] = ds.contiguous()
        if biases is not None:
            t[f"{pre}.gate_up_proj_bias"] = biases[layer][0].clone()
            t[f"{pre}.down_proj_bias"] = biases[layer][1].clone()


def interleave(gate: torch.Tensor, up: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """gate and up [..., I, ...] -> [..., 2I, ...]: gate i at 2i, up i at 2i + 1 along dim."""
    return torch.stack([gate, up], dim=dim + 1).flatten(dim, dim + 1)


def put_gpt_oss_float_experts(t: dict, arch: Arch, experts: dict, biases: dict | None = None, *,
                              transposed: bool = True) -> None:
    """Float experts as gpt-oss's bf16 exports hold them: gate_up_proj [E, H, 2I] with gate and
    up interleaved along 2I and down_proj [E, I, H] (transposed=False: [E, 2I, H] rows
    interleaved and [E, H, I]); biases in their stored form."""
    for layer, (g, u, d) in experts.items():
        pre = arch.prefix(layer)
        gu = interleave(g, u, 1)                                       # [E, 2I, H]
        t[f"{pre}.gate_up_proj"] = (gu.transpose(1, 2) if transposed else gu).contiguous()
        t[f"{pre}.down_proj"] = (d.transpose(1, 2) if transposed else d).contiguous()
        if biases is not None:
            t[f"{pre}.gate_up_proj_bias"] = biases[layer][0].clone()
            t[f"{pre}.down_proj_bias"] = biases[layer][1].clone()


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 [..., N, K] of MXFP4 blocks [..., N, K/32, 16] and E8M0 scales [..., N, K/32], by
    the format's definition: e2m1(code) · 2^(s − 127), the even element in the low nibble."""
    table = np.array(E2M1_TABLE, dtype=np.float64)
    b = blocks.numpy()
    vals = np.stack([table[b & 0xF], table[b >> 4]], axis=-1).reshape(*b.shape[:-1], 32)
    vals = np.ldexp(vals, scales.numpy().astype(np.int64)[..., None] - 127)
    return torch.from_numpy(vals.reshape(*b.shape[:-2], b.shape[-2] * 32))


def set_gpt_oss_experts(model, mx: dict) -> None:
    """Put MXFP4 experts, dequantized (exact in bf16 for exponents in bf16's normal range), into a
    transformers gpt-oss model: gate_up_proj [E, H, 2I] = the blocks' 2I interleaved rows,
    transposed, as transformers' own MXFP4 dequantization lays them out."""
    for layer, (gb, gs, db, ds) in mx.items():
        ex = model.model.layers[layer].mlp.experts
        with torch.no_grad():
            gu = dequantize_mxfp4(gb, gs).transpose(1, 2)
            dn = dequantize_mxfp4(db, ds).transpose(1, 2)
            ex.gate_up_proj.copy_(gu.to(ex.gate_up_proj.dtype))
            ex.down_proj.copy_(dn.to(ex.down_proj.dtype))
            assert torch.equal(ex.gate_up_proj.double(), gu), "exponents outside bf16's range"


def mxfp4_copy(src, dst, mx: dict) -> Path:
    """A copy of the bf16 gpt-oss checkpoint `src` (transformers' save_pretrained) whose routed
    experts are the MXFP4 tensors `mx` (biases kept as saved) and whose config.json has the
    published quantization_config."""
    from safetensors.torch import load_file
    dst = Path(dst)
    dst.mkdir(parents=True)
    out = {}
    for name, v in load_file(Path(src) / "model.safetensors").items():
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            continue
        out[name] = v
    for layer, (gb, gs, db, ds) in mx.items():
        pre = f"model.layers.{layer}.mlp.experts"
        out.update({f"{pre}.gate_up_proj_blocks": gb.contiguous(),
                    f"{pre}.gate_up_proj_scales": gs.contiguous(),
                    f"{pre}.down_proj_blocks": db.contiguous(),
                    f"{pre}.down_proj_scales": ds.contiguous()})
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((Path(src) / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(mxfp4_config_json(cfg), indent=2))
    gen = Path(src) / "generation_config.json"
    if gen.is_file():
        (dst / "generation_config.json").write_text(gen.read_text())
    return dst


def hf_gpt_oss(seed: int = 0, *, L: int = 2, E: int = 8, K: int = 4, H: int = 64, I: int = 96,
               V: int = 64, dtype=torch.bfloat16):
    """A randomly initialised transformers gpt-oss causal LM on the CPU (eval), sizes MXFP4 can
    hold (H, I multiples of 32; I = 96 not a power of two), sliding and full attention
    alternating, the experts' biases non-zero."""
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model(
        "gpt_oss", num_hidden_layers=L, num_local_experts=E, num_experts_per_tok=K,
        hidden_size=H, intermediate_size=I, head_dim=16, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=V, max_position_embeddings=64, sliding_window=8,
        layer_types=["sliding_attention" if li % 2 == 0 else "full_attention" for li in range(L)],
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    with torch.no_grad():
        for m in model.modules():
            for name in ("gate_up_proj_bias", "down_proj_bias"):
                if isinstance(getattr(m, name, None), torch.Tensor):
                    getattr(m, name).normal_(0, 0.05)
    return model.eval()


def gpt_oss_model_mxfp4(rng, model, exponents=(118, 123)) -> dict:
    """MXFP4 experts sized for a transformers gpt-oss `model` (every layer), as `mxfp4_experts`."""
    c = model.config
    E, H, I = c.num_local_experts, c.hidden_size, c.intermediate_size
    return {layer: (*mxfp4_matrices(rng, E, 2 * I, H, exponents),
                    *mxfp4_matrices(rng, E, H, I, exponents))
            for layer in range(c.num_hidden_layers)}


# --- Nemotron-H releases: bf16, ModelOpt NVFP4 (Nano), ModelOpt MIXED_PRECISION (Super-style) ----
NEMOTRON_FORMATS = ("bf16", "nvfp4", "mixed")


def nemotron_release(directory, rng, fmt: str, *, latent: int | None = None,
                     pattern: str = NEMOTRON_PATTERN, layer_list: bool = False):
    """A Nemotron-H checkpoint as NVIDIA publishes it, and its float32 twin.

    fmt "bf16" (nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16): every tensor bf16, routers' score
    correction biases float32. "nvfp4" (the -NVFP4 release, ModelOpt quant_algo NVFP4 in
    hf_quant_config.json, kv_cache_quant_algo FP8): routed and shared experts NVFP4 (weight,
    weight_scale, weight_scale_2, input_scale), the Mamba mixers' in_proj / out_proj NVFP4 except
    in the Mamba layer that feeds an attention layer, attention in bf16 with its KV-cache scales
    (k_proj.k_scale, v_proj.v_scale), routers, conv1d, norms, embeddings and lm_head excluded.
    "mixed" (ModelOpt MIXED_PRECISION in config.json's quantization_config, as the Super and
    Lightning releases have it): routed experts W4A16_NVFP4, every Mamba in_proj / out_proj FP8
    (float8_e4m3fn weight, float32 per-tensor weight_scale, input_scale), the rest bf16.
    latent: moe_latent_size (Nemotron-3-Super's latent MoE). layer_list: config.json gives
    layers_block_type (transformers >= 5's list) instead of hybrid_override_pattern and
    num_hidden_layers.

    Returns (directory, twin, arch, experts): twin a float32 checkpoint of the same model whose
    every tensor is what the release's dequantizes to (the directory itself for bf16), for
    transformers' own from_pretrained; experts {layer: (None, up, down)} NVFP4Tensors of the
    routed experts (the stored ones; for bf16 the reference quantizer's of the stored bf16).
    """
    from cupool.nvfp4 import dequantize
    directory = Path(directory)
    a = nemotron_h(rng, pattern=pattern, latent=latent)
    if layer_list:
        names = {"M": "mamba", "E": "moe", "*": "attention", "-": "mlp"}
        a.config.pop("hybrid_override_pattern")
        a.config.pop("num_hidden_layers")
        a.config["layers_block_type"] = [names[c] for c in pattern]
    t = dict(a.dense)
    if fmt == "bf16":
        ex = float_experts(rng, a, torch.bfloat16)
        put_float_experts(t, a, ex)
        d = save(directory / "bf16", t, a.config)
        return d, d, a, reference_nvfp4({k: tuple(None if w is None else w.float() for w in v)
                                         for k, v in ex.items()})
    if fmt not in NEMOTRON_FORMATS:
        raise ValueError(fmt)
    q = reference_nvfp4(float_experts(rng, a, torch.float32))
    # the twin holds what the release holds: its bf16 tensors' values (then the dequantized ones)
    twin = {k: v if k.endswith(KEEP_FP32) else v.to(torch.bfloat16).float() for k, v in t.items()}
    put_modelopt_experts(t, a, q, style="ep")
    for layer, mats in q.items():
        put_float_experts(twin, a, {layer: tuple(None if m is None else dequantize(m)
                                                 for m in mats)})
    feeds_attention = {i for i in range(len(pattern) - 1) if pattern[i:i + 2] == "M*"}
    for li, kind in enumerate(pattern):
        m = f"backbone.layers.{li}.mixer"
        if kind == "M" and (fmt == "mixed" or li not in feeds_attention):
            for proj in ("in_proj", "out_proj"):
                twin[f"{m}.{proj}.weight"] = (nvfp4_dense(t, f"{m}.{proj}") if fmt == "nvfp4"
                                              else fp8_dense(t, f"{m}.{proj}", "tensor"))
        elif kind == "E" and fmt == "nvfp4" and f"{m}.shared_experts.up_proj.weight" in t:
            for proj in ("up_proj", "down_proj"):
                twin[f"{m}.shared_experts.{proj}.weight"] = \
                    nvfp4_dense(t, f"{m}.shared_experts.{proj}")
        elif kind == "*" and fmt == "nvfp4":
            t[f"{m}.k_proj.k_scale"] = torch.tensor(0.02)
            t[f"{m}.v_proj.v_scale"] = torch.tensor(0.03)
    cfg, hq = dict(a.config), None
    if fmt == "nvfp4":
        exclude = ["lm_head", "*.mixer.gate", "*conv1d*"]
        exclude += [f"backbone.layers.{li}.mixer*" for li, k in enumerate(pattern)
                    if k == "*" or li in feeds_attention]
        hq = modelopt_hf_quant("NVFP4", exclude=exclude, kv_cache_quant_algo="FP8")
    else:
        layers = {f"{a.prefix(layer)}.{e}.{proj}": {"quant_algo": "W4A16_NVFP4", "group_size": 16}
                  for layer in a.moe_layers for e in range(cfg["n_routed_experts"])
                  for proj in ("up_proj", "down_proj")}
        layers.update({f"backbone.layers.{li}.mixer.{proj}": {"quant_algo": "FP8"}
                       for li, k in enumerate(pattern) if k == "M"
                       for proj in ("in_proj", "out_proj")})
        cfg = modelopt_config_json(cfg, "MIXED_PRECISION", ignore=["lm_head", "*.mixer.gate",
                                                                   "*conv1d*"],
                                   quantized_layers=layers)
        cfg["quantization_config"]["kv_cache_quant_algo"] = "FP8"
    d = save(directory / fmt, t, cfg, hf_quant_config=hq)
    tw = save(directory / f"{fmt}-twin", twin, a.config, dtype=torch.float32)
    return d, tw, a, q
