"""Tiny MoE models for tests: transformers families from configs, and hand-written blocks.

Shapes are chosen so that 2I != H and I != H: a transposed or swapped weight then has the wrong
shape instead of silently passing. Importing this module does not import transformers; the
`hf_*` helpers do.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

_COMMON = dict(vocab_size=64, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
               max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)

# family -> (config kwargs, expected (MoE layer numbers, E, K, H, I))
FAMILIES = {
    "qwen3_moe": (dict(_COMMON, hidden_size=48, head_dim=16, intermediate_size=64,
                       moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2),
                  ([0, 1, 2], 8, 2, 48, 32)),
    # mlp_only_layers makes layer 1 dense; every MoE block also has a shared expert.
    "qwen2_moe": (dict(_COMMON, hidden_size=64, intermediate_size=64, moe_intermediate_size=16,
                       shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                       mlp_only_layers=[1]),
                  ([0, 2], 4, 2, 64, 16)),
    "mixtral": (dict(_COMMON, hidden_size=48, intermediate_size=32, num_local_experts=4,
                     num_experts_per_tok=2),
                ([0, 1, 2], 4, 2, 48, 32)),
    "olmoe": (dict(_COMMON, hidden_size=64, intermediate_size=16, num_experts=8,
                   num_experts_per_tok=3),
              ([0, 1, 2], 8, 3, 64, 16)),
    # Layer 0 dense (first_k_dense_replace=1); MoE layers carry shared experts; MLA dims tiny.
    "deepseek_v3": (dict(_COMMON, hidden_size=48, intermediate_size=64, moe_intermediate_size=16,
                         n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                         first_k_dense_replace=1, n_group=2, topk_group=1, kv_lora_rank=16,
                         q_lora_rank=16, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=8),
                    ([1, 2], 8, 2, 48, 16)),
    # Experts with biases, gate/up interleaved and transposed, clamped SwiGLU (alpha, limit from
    # the config); attention with sinks, alternating sliding-window layers. The published
    # max_position_embeddings (YaRN's factor 32 over 4,096 positions: transformers warns where
    # the two disagree).
    "gpt_oss": (dict(_COMMON, max_position_embeddings=131072, hidden_size=48,
                     intermediate_size=32, head_dim=16, num_local_experts=8,
                     num_experts_per_tok=4, sliding_window=8,
                     layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
                ([0, 1, 2], 8, 4, 48, 32)),
}


_LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
               linear_value_head_dim=8, linear_conv_kernel_dim=4)

# Hybrid families (layers that keep a state instead of keys, or need graph-safe forwards), for the
# engine: model_type -> (config kwargs, expected (MoE layer numbers, E, K, H, I, experts path with
# {i} for the layer)). Layer types mix full attention with the family's recurrent layer at two
# places, so a chunked prefill crosses both kinds.
HYBRID_FAMILIES = {
    "qwen3_next": (dict(_COMMON, num_hidden_layers=4, hidden_size=48, head_dim=16,
                        intermediate_size=64, moe_intermediate_size=32,
                        shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                        layer_types=["linear_attention", "linear_attention", "full_attention",
                                     "linear_attention"], **_LINEAR),
                   ([0, 1, 2, 3], 8, 2, 48, 32, "model.layers.{i}.mlp.experts")),
    "qwen3_5_moe_text": (dict(_COMMON, num_hidden_layers=4, hidden_size=48, head_dim=16,
                              moe_intermediate_size=32, shared_expert_intermediate_size=32,
                              num_experts=8, num_experts_per_tok=2,
                              layer_types=["linear_attention", "full_attention",
                                           "linear_attention", "full_attention"], **_LINEAR),
                         ([0, 1, 2, 3], 8, 2, 48, 32, "model.layers.{i}.mlp.experts")),
    # Qwen3.8-Flash-Next: gated delta nets, QSA (indexed) attention, 2 hyper-connection streams,
    # n-gram per-layer embeddings on layers 1 and 3 (one-indexed). 4 indexer heads make exact
    # score ties (all heads' dot products negative) rare; budget 8 of blocks of 4 keeps 2 blocks.
    "qwen4_exp_text": (dict(_COMMON, num_hidden_layers=4, hidden_size=48, head_dim=16,
                            moe_intermediate_size=32, shared_expert_intermediate_size=32,
                            num_experts=8, num_experts_per_tok=2, hc_count=2, hc_lowrank=8,
                            ple_layer_ids=[1, 3], ple_embed_dim=16, heads_per_ngram=4,
                            ngram_vocab_size_base=50, split_ngram_parts=1, indexer_n_heads=4,
                            indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                            indexer_compress_ratio=4, **_LINEAR),
                       ([0, 1, 2, 3], 8, 2, 48, 32, "model.layers.{i}.mlp.experts")),
    # Kimi delta attention + MLA full attention; layer 0 dense.
    "kimi_linear": (dict(_COMMON, num_hidden_layers=4, hidden_size=48, intermediate_size=64,
                         moe_intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                         n_shared_experts=1, kv_lora_rank=16, q_lora_rank=None,
                         qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=8,
                         linear_head_dim=8, linear_num_heads=4,
                         layer_types=["linear_attention", "full_attention", "linear_attention",
                                      "full_attention"],
                         mlp_layer_types=["dense", "sparse", "sparse", "sparse"]),
                    ([1, 2, 3], 8, 2, 48, 32, "model.layers.{i}.mlp.experts")),
    # Granite-4: Mamba-2 mixers and attention.
    "granitemoehybrid": (dict(_COMMON, num_hidden_layers=4, hidden_size=48, intermediate_size=32,
                              shared_intermediate_size=32, num_local_experts=8,
                              num_experts_per_tok=2, mamba_n_heads=4, mamba_d_head=12,
                              mamba_d_state=8, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=1,
                              layer_types=["mamba", "attention", "mamba", "mamba"]),
                         ([0, 1, 2, 3], 8, 2, 48, 32, "model.layers.{i}.block_sparse_moe.experts")),
    # MiniMax: lightning (linear) attention and full attention.
    "minimax": (dict(_COMMON, num_hidden_layers=4, hidden_size=48, head_dim=16,
                     intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                     block_size=8, layer_types=["linear_attention", "full_attention",
                                                "linear_attention", "full_attention"]),
                ([0, 1, 2, 3], 8, 2, 48, 32, "model.layers.{i}.mlp.experts")),
    "phimoe": (dict(_COMMON, hidden_size=48, intermediate_size=32, num_local_experts=4,
                    num_experts_per_tok=2),
               ([0, 1, 2], 4, 2, 48, 32, "model.layers.{i}.mlp.experts")),
    # MLA with num_key_value_heads != num_attention_heads; layer 0 dense.
    "deepseek_v2": (dict(_COMMON, hidden_size=48, intermediate_size=64, moe_intermediate_size=16,
                         n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                         first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16,
                         qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=8,
                         num_attention_heads=4, num_key_value_heads=1),
                    ([1, 2], 8, 2, 48, 16, "model.layers.{i}.mlp.experts")),
    # Nemotron-H: Mamba-2, attention, non-gated MoE (relu^2) and MLP blocks, one a layer.
    "nemotron_h": (dict(_COMMON, num_hidden_layers=4, hidden_size=48, intermediate_size=32,
                        moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                        moe_shared_expert_intermediate_size=32, mamba_num_heads=4,
                        mamba_head_dim=12, ssm_state_size=8, n_groups=1, conv_kernel=4,
                        expand=1, layer_types=["linear_attention", "moe", "full_attention",
                                               "mlp"]),
                   ([1], 8, 2, 48, 32, "model.layers.{i}.mixer.experts")),
}


@contextlib.contextmanager
def forward_shapes(model):
    """The input_ids shape (batch, tokens) of every forward of `model` inside the block, in
    order (a forward pre-hook, removed at the end)."""
    shapes: list[tuple[int, ...]] = []
    hook = model.register_forward_pre_hook(
        lambda mod, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)),
        with_kwargs=True)
    try:
        yield shapes
    finally:
        hook.remove()


def hybrid_model(family: str, seed: int = 0, dtype=torch.float32, **overrides):
    """A randomly initialised causal LM of a HYBRID_FAMILIES family on the CPU, experts spread
    as hf_model spreads them, every other weight large enough that each layer counts."""
    from transformers import AutoConfig, AutoModelForCausalLM
    kwargs, _ = HYBRID_FAMILIES[family]
    torch.manual_seed(seed)
    # initializer_range 0.15 (transformers' default 0.02) gives token mixers outputs of the
    # residual stream's size: at 0.02, qwen4_exp's last logits moved by 0.006 (std 0.07) when
    # the first 20 of 23 tokens were dropped, so a lost recurrent state went unnoticed.
    cfg = AutoConfig.for_model(family, **{"initializer_range": 0.15, **kwargs, **overrides})
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    _spread_experts(model)
    return model.eval()


def _spread_experts(model):
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "gate_up_proj") and isinstance(m.gate_up_proj, torch.Tensor):
                m.gate_up_proj.normal_(0, 0.2)
                m.down_proj.normal_(0, 0.2)
            elif hasattr(m, "up_proj") and isinstance(getattr(m, "up_proj"), torch.Tensor):
                m.up_proj.normal_(0, 0.2)          # non-gated experts (Nemotron-H)
                m.down_proj.normal_(0, 0.2)
            for name in ("gate_up_proj_bias", "down_proj_bias"):      # gpt-oss: biases matter
                if isinstance(getattr(m, name, None), torch.Tensor):
                    getattr(m, name).normal_(0, 0.1)


def hf_config(family: str, **overrides):
    from transformers import AutoConfig
    kwargs, _ = FAMILIES[family]
    return AutoConfig.for_model(family, **{**kwargs, **overrides})


def hf_model(family: str, seed: int = 0, dtype=torch.float32, **overrides):
    """A randomly initialised causal LM of `family` on the CPU."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family, **overrides), dtype=dtype)
    # from_config leaves fused expert parameters as initialised; make them clearly non-zero and
    # distinct per row so that a wrong slice cannot match by accident.
    _spread_experts(model)
    return model.eval()


class RouterLog:
    """The routers' outputs while inside `with`: every MoE block of `model` (a module with `.gate`
    or `.router` (gpt-oss) and `.experts` whose router returns (router_logits, weights, chosen
    experts), as in the transformers 5 families above), per MoE layer in model order. `rows()`
    gives each layer's (logits [positions, E] float32, chosen [positions, K]) over all calls, in
    call order."""

    def __init__(self, model: nn.Module):
        self.blocks = [m for m in model.modules()
                       if (hasattr(m, "gate") or hasattr(m, "router")) and hasattr(m, "experts")]
        self.calls: dict[int, list] = {}
        self._handles: list = []

    def __enter__(self) -> RouterLog:
        for i, b in enumerate(self.blocks):
            router = b.gate if hasattr(b, "gate") else b.router
            self._handles.append(router.register_forward_hook(self._hook(i)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, layer: int):
        def hook(module, args, out):
            logits, chosen = out[0].float(), out[-1]
            self.calls.setdefault(layer, []).append(
                (logits.reshape(-1, logits.shape[-1]), chosen.reshape(logits.shape[0], -1)))
        return hook

    def rows(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        return {k: (torch.cat([c[0] for c in v]), torch.cat([c[1] for c in v]))
                for k, v in self.calls.items()}


def swap_gap(logits: torch.Tensor, got: set, want: set) -> float:
    """How far apart, in one position's reference router logits, the experts two runs swapped
    are: the smallest logit of the reference's choices the other run left out against the largest
    of those it took instead (got, want: the chosen expert sets, different)."""
    return (logits[sorted(want - got)].min() - logits[sorted(got - want)].max()).abs().item()


# --- hand-written blocks (per-expert nn.Linear lists) ---------------------------------------------
class GateUpDownExpert(nn.Module):
    """One SwiGLU expert, Llama naming."""

    def __init__(self, H, I, bias=False, act=None):
        super().__init__()
        self.gate_proj = nn.Linear(H, I, bias=bias)
        self.up_proj = nn.Linear(H, I, bias=bias)
        self.down_proj = nn.Linear(I, H, bias=bias)
        self.act_fn = act if act is not None else nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class W123Expert(nn.Module):
    """One SwiGLU expert, Mixtral naming: w1 = gate, w3 = up, w2 = down."""

    def __init__(self, H, I, bias=False):
        super().__init__()
        self.w1 = nn.Linear(H, I, bias=bias)
        self.w2 = nn.Linear(I, H, bias=bias)
        self.w3 = nn.Linear(H, I, bias=bias)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ReluExpert(W123Expert):
    """Same parameters as W123Expert, different maths: must be refused, not served as SwiGLU."""

    def forward(self, x):
        return self.w2(F.relu(self.w1(x)) * self.w3(x))


class ListMoEBlock(nn.Module):
    """softmax → top-k → renormalise → sum of weighted experts (Mixtral's routing)."""

    def __init__(self, H, I, E, K, expert_cls=GateUpDownExpert, **expert_kw):
        super().__init__()
        self.top_k = K
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(expert_cls(H, I, **expert_kw) for _ in range(E))

    def route(self, x):
        probs = F.softmax(self.gate(x), dim=-1)
        w, ids = torch.topk(probs, self.top_k, dim=-1)
        return ids, w / w.sum(-1, keepdim=True)

    def forward(self, x):
        ids, w = self.route(x)
        out = torch.zeros_like(x)
        for k in range(self.top_k):
            for e, expert in enumerate(self.experts):
                sel = ids[:, k] == e
                if sel.any():
                    out[sel] += w[sel, k, None] * expert(x[sel])
        return out


class ListMoEModel(nn.Module):
    """Embedding, L residual layers of attention-free MoE blocks, head: enough to have names."""

    def __init__(self, L=2, H=48, I=32, E=6, K=2, vocab=64, seed=0, **block_kw):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, H)
        self.layers = nn.ModuleList(nn.ModuleDict({"norm": nn.LayerNorm(H),
                                                   "mlp": ListMoEBlock(H, I, E, K, **block_kw)})
                                    for _ in range(L))
        self.head = nn.Linear(H, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = x + layer["mlp"](layer["norm"](x))
        return self.head(x)


def moe_reference(spec, x, ids, weights):
    """out [T, H] = Σ_k weights[:, k] · (down(act(gate·x + b_g, up·x + b_u)) + b_d) of expert
    ids[:, k] (act(up·x) for non-gated experts), from spec.expert(e), spec.biases() and
    spec.activation: what the pooled layer must compute from what the adapter hands out."""
    out = torch.zeros_like(x)
    biases = spec.biases()
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate, up, down = spec.expert(e)
            bg, bu, bd = (None, None, None) if biases is None else (b[e] for b in biases)
            g = None if gate is None else F.linear(x[t], gate, bg)      # None: non-gated
            h = spec.activation(g, F.linear(x[t], up, bu))
            out[t] += weights[t, k] * F.linear(h, down, bd)
    return out
