"""Every MoE family of the installed transformers, and a trial of each through cupool.

`moe_families()` lists the model types of transformers' causal LMs whose modeling module defines
an experts module (a class decorated with `use_experts_implementation`, which gives it
`_apply_gate`, or one named `*Experts` / `*MoE` / `*SparseMoeBlock`). README.md's table of MoE
families has exactly one row per entry (tests/test_moe_families.py), so a new transformers release
with a new MoE family fails that test until the table says what cupool does with it.

`trial(model_type)` shrinks the family's default config (only the keys it has: 2-4 layers,
hidden 64, 8 experts top-2, small heads and vocabulary), builds the causal LM on the CPU, looks
for its MoE layers (`cupool.adapters.find_moe_layers`) and decodes one prompt with
`cupool.Engine` against transformers' own greedy generate. `python tests/moe_families.py` prints
the outcome of every family (what README's table was written from).
"""

from __future__ import annotations

import importlib
import inspect
import sys
import warnings

import torch

# Shrinking overrides, applied where the family's config has the key.
SHRINK = dict(
    num_hidden_layers=5, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, moe_shared_expert_intermediate_size=32,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=96,
    max_position_embeddings=128, num_experts=8, num_local_experts=8, n_routed_experts=8,
    num_experts_per_tok=2, moe_topk=2, n_shared_experts=1, first_k_dense_replace=1,
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    n_group=1, topk_group=1, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=8, linear_value_head_dim=8, linear_num_heads=4, linear_head_dim=8,
    mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_num_heads=4, mamba_head_dim=16,
    ssm_state_size=8, sliding_window=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    initializer_range=0.15, mlp_only_layers=[], decoder_sparse_step=1, moe_layer_freq=1,
)
# Per-layer lists the default config gives for its own depth: repeated or cut to the trial's.
PER_LAYER = ("layer_types", "mlp_layer_types", "layers_block_type")
# What a family's config needs beyond SHRINK to build small (its own validation says so).
FAMILY = {
    "granitemoehybrid": dict(mamba_expand=1, layer_types=["mamba", "attention", "mamba",
                                                          "mamba", "attention"]),
    "nemotron_h": dict(expand=1, n_groups=1, mamba_num_heads=4, mamba_head_dim=16,
                       layer_types=["linear_attention", "moe", "full_attention", "mlp", "moe"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention", "conv", "conv", "full_attention"]),
    "bailing_hybrid": dict(layer_types=["linear_attention", "full_attention", "linear_attention",
                                        "linear_attention", "full_attention"]),
    "zaya": dict(num_experts_per_tok=1),
    "kolibri1_1": dict(index_num_heads=2, index_num_local_tokens=8, index_num_sink_tokens=2),
    "qwen4_exp": dict(indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=16,
                      indexer_budget=8, indexer_compress_ratio=4),
}
FAMILY["qwen4_exp_text"] = FAMILY["qwen4_exp"]


def moe_families() -> list[str]:
    """Model types of the installed transformers' causal LMs with an experts module."""
    import transformers
    from transformers.models.auto.configuration_auto import model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    out = []
    for mt in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        name = model_type_to_module_name(mt)
        try:
            # some modeling files (gpt_bigcode's on transformers 5.17) call torch.jit.script at
            # import, which newer torch deprecates: transformers' own code, not a call of ours
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r"`torch\.jit\.script` is deprecated",
                                        category=DeprecationWarning)
                mod = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        except Exception:  # noqa: BLE001 (a family whose optional dependency is missing)
            continue
        for cname, c in vars(mod).items():
            if not inspect.isclass(c) or c.__module__ != mod.__name__:
                continue
            if hasattr(c, "_apply_gate") or cname.endswith(("Experts", "MoE", "SparseMoeBlock")):
                out.append(mt)
                break
    assert transformers is not None
    return out


def _config(model_type: str):
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    base = CONFIG_MAPPING[model_type]()
    kw = _shrink(model_type, base)
    text = base.get_text_config() if hasattr(base, "get_text_config") else base
    while True:
        try:
            if text is not base:
                return AutoConfig.for_model(model_type, text_config={**text.to_dict(), **kw})
            return AutoConfig.for_model(model_type, **kw)
        except AttributeError as e:          # a derived attribute without a setter: leave it
            bad = next((k for k in kw if f"'{k}'" in str(e)), None)
            if bad is None:
                raise
            kw.pop(bad)


def _shrink(model_type: str, base) -> dict:
    text = base.get_text_config() if hasattr(base, "get_text_config") else base
    kw = {k: v for k, v in SHRINK.items() if hasattr(text, k)}
    own = FAMILY.get(model_type, {})
    kw.update(own)
    n = kw.get("num_hidden_layers")
    for k in PER_LAYER:
        if k in own:
            continue
        v = getattr(text, k, None) if k in vars(text) or hasattr(type(text), k) else None
        if n and isinstance(v, (list, tuple)) and v and len(v) != n:
            kw[k] = (list(v) * (n // len(v) + 1))[:n]
    for k in ("q_lora_rank", "sliding_window"):       # features the default leaves off stay off
        if getattr(text, k, 1) is None:
            kw.pop(k, None)
    if "kv_lora_rank" in kw and "head_dim" in kw:      # MLA: the rotary dims are qk_rope's
        kw["head_dim"] = kw["qk_rope_head_dim"]
    return kw


def trial(model_type: str, tokens: int = 6) -> tuple[str, str]:
    """(outcome, detail): "engine" (Engine = generate), "engine-differs", "adapter-refused",
    "engine-refused", "no-tiny-model"."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from cupool.adapters import find_moe_layers
    from cupool.engine import Engine
    from cupool.sampling import SamplingParams
    try:
        cfg = _config(model_type)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg).eval()
    except Exception as e:  # noqa: BLE001
        return "no-tiny-model", f"{type(e).__name__}: {str(e)[:160]}"
    try:
        specs = find_moe_layers(model)
        found = f"{len(specs)} MoE layers ({specs[0].activation.describe()})"
    except Exception as e:  # noqa: BLE001
        return "adapter-refused", str(e)[:200]
    prompt = [5, 9, 13, 22, 7, 31, 11]
    gen = GenerationConfig(max_new_tokens=tokens, do_sample=False, eos_token_id=[],
                           pad_token_id=0)

    def hf():
        with torch.inference_mode():
            return model.generate(torch.tensor([prompt]), generation_config=gen)[
                0, len(prompt):].tolist()
    try:
        ref, note = hf(), ""
    except Exception as e:  # noqa: BLE001 (the Engine's graph-safe fixes may be what it lacks)
        ref, note = None, f"transformers' own generate fails ({type(e).__name__}: " \
                          f"{str(e)[:80]}) until the engine's fixes are in; "
    try:
        eng = Engine(model, max_batch=2, max_len=32, eos_token_id=[], prefill_chunk=4)
        got = eng.generate([prompt], SamplingParams(max_tokens=tokens))[0].output_ids
        ref = hf() if ref is None else ref
    except Exception as e:  # noqa: BLE001
        return "engine-refused", f"{found}; {note}{type(e).__name__}: {str(e)[:160]}"
    if got != ref:
        return "engine-differs", f"{found}; {note}{got} vs {ref}"
    return "engine", f"{found}; {note}".rstrip("; ")


if __name__ == "__main__":
    for mt in sys.argv[1:] or moe_families():
        outcome, detail = trial(mt)
        print(f"{mt:24s} {outcome:16s} {detail}", flush=True)
