"""What some transformers modules do that a batched decode step captured in a CUDA graph cannot,
and what the engine runs in their place. Each fix is found by the module's class (or, for MLA, by
what the module computes), is installed once per module (several engines may share a model), and
computes what the module computes for one sequence alone.

Shape legend: B sequences of a forward (engine slots) · S tokens each · L_k key positions · c
tokens an indexer block pools · n_b = L_k // c blocks · d indexer head dim · h indexer heads.

- Multi-head latent attention (DeepSeek-V2/V3, Kimi-Linear, ...): the module expands its latent keys
  and values to every query head, yet keeps `num_key_value_groups = heads / kv heads` from the
  config; with an explicit mask, transformers' SDPA and eager paths then repeat or pack the heads
  once more and fail on a config whose `num_key_value_heads` differs ("The size of tensor a (4) must
  match the size of tensor b (16)"). Its keys have one head per query head, so the group is 1.
- PhiMoE's rotary embedding recomputes its frequencies on the CPU every call (a host-to-device copy
  during capture) and picks LongRoPE's mscale from the batch's largest position on the host. Here:
  the frequencies are computed once, on the model's device, and the mscale is chosen per sequence
  on the device (each sequence's largest position, as transformers picks it for that sequence
  alone).
- `qwen4_exp`'s QSA indexer scores, for every query, the blocks of c keys complete before it and
  keeps the best `indexer_budget / c` blocks plus the incomplete tail; transformers loops over
  sequences and queries on the host (`nonzero`, sizes known only on the device) and ropes each
  block's pooled key by its position, from positions it keeps on the cache. Here every query's
  scores over every block come out of one batched matmul, blocks not complete before a query are
  -inf, and the top-k runs over a fixed-size row; the block positions' rotary table comes from the
  model's own rotary embedding. It runs when the cache is the engine's (`StateSlotCache`);
  any other cache gets transformers' own forward.
"""

from __future__ import annotations

import math
import types

import torch
from torch import nn

_MARK = "_cupool_graphsafe"


def _cls(module_path: str, name: str):
    """A transformers class, or None where the installed release has no such model."""
    try:
        mod = __import__(module_path, fromlist=[name])
    except ImportError:
        return None
    return getattr(mod, name, None)


def _qsa_indexer_cls():
    return _cls("transformers.models.qwen4_exp.modeling_qwen4_exp", "Qwen4ExpTextQSAIndexer")


def _phimoe_rotary_cls():
    return _cls("transformers.models.phimoe.modeling_phimoe", "PhimoeRotaryEmbedding")


def use_cache_flag(model: nn.Module) -> bool:
    """The `use_cache` the engine passes beside its cache. MiniMax's model refuses, with use_cache
    set, any cache but its own class, yet hands the cache to every layer either way, and its
    layers read and write the engine's cache through the same calls (`get_linear_cache`,
    `set_linear_cache`, `update`): for it the flag is False."""
    cls = _cls("transformers.models.minimax.modeling_minimax", "MiniMaxModel")
    return not (cls is not None and any(isinstance(m, cls) for m in model.modules()))


# Modules whose multi-token forward starts from a zero state whatever the cache holds (Jamba's
# Mamba mixer: its selective scan takes no initial state), so a prompt cannot be prefilled in
# several chunks: (module path, class name).
_NO_CONTINUATION = (("transformers.models.jamba.modeling_jamba", "JambaMambaMixer"),)


def rope_changes_with_length(rope_type) -> bool:
    """Whether a rotary embedding of this `rope_type` changes with the forward's length (dynamic
    NTK scaling, LongRoPE's short and long factors): a step or a forward of padded rows would
    then give a token another length's rotation."""
    kind = str(rope_type)
    return "dynamic" in kind or "longrope" in kind


def whole_prompt_prefill(model: nn.Module) -> str | None:
    """Why the model's prompts must be prefilled in one forward (a module that cannot continue a
    multi-token forward from a state), or None."""
    for path, name in _NO_CONTINUATION:
        cls = _cls(path, name)
        if cls is not None and any(isinstance(m, cls) for m in model.modules()):
            return (f"its {name} restarts a multi-token forward from a zero state (its scan takes "
                    f"no initial state)")
    return None


def prepare(model: nn.Module) -> list[str]:
    """Install every fix the model needs; returns what was fixed (module paths), for logs."""
    fixed = []
    fixed += _fix_mla_groups(model)
    fixed += _fix_phimoe_rotary(model)
    fixed += _fix_qsa_indexers(model)
    return fixed


# --- multi-head latent attention ------------------------------------------------------------------
def _fix_mla_groups(model: nn.Module) -> list[str]:
    out = []
    for name, m in model.named_modules():
        kv_b = getattr(m, "kv_b_proj", None)
        groups = getattr(m, "num_key_value_groups", None)
        heads = getattr(m, "num_heads", None)
        nope, v = getattr(m, "qk_nope_head_dim", None), getattr(m, "v_head_dim", None)
        if not isinstance(kv_b, nn.Linear) or not groups or groups == 1 or not heads:
            continue
        if nope is None or v is None or kv_b.out_features != heads * (nope + v):
            continue                           # keys not expanded to every head: left alone
        m.num_key_value_groups = 1
        out.append(name)
    return out


# --- PhiMoE's rotary embedding --------------------------------------------------------------------
def _fix_phimoe_rotary(model: nn.Module) -> list[str]:
    cls = _phimoe_rotary_cls()
    if cls is None:
        return []
    out = []
    for name, m in model.named_modules():
        if isinstance(m, cls) and not getattr(m, _MARK, False):
            inv_freq, scaling = m.rope_init_fn(m.config)
            dev = m.inv_freq.device
            m._cupool_inv_freq = inv_freq.to(device=dev, dtype=torch.float32)
            rope = m.config.rope_parameters
            long_rope = rope["rope_type"] != "default"
            m._cupool_mscale = (float(rope["short_mscale"]), float(rope["long_mscale"]),
                                int(rope["original_max_position_embeddings"])) if long_rope \
                else (float(scaling), float(scaling), 0)
            m.forward = types.MethodType(_phimoe_rotary_forward, m)
            setattr(m, _MARK, True)
            out.append(name)
    return out


def _phimoe_rotary_forward(self, x: torch.Tensor, position_ids: torch.Tensor):
    """cos, sin [B, S, dim] for positions [B, S]: transformers' values, all on the device."""
    short, long, original = self._cupool_mscale
    pos = position_ids.float()                                         # [B, S]
    freqs = pos[..., None] * self._cupool_inv_freq.to(x.device)        # [B, S, dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    if short == long:
        mscale = torch.full_like(pos[:, :1, None], short)
    else:                                # LongRoPE: long mscale once a sequence passes original
        seq_len = position_ids.amax(dim=1, keepdim=True)[..., None] + 1  # [B, 1, 1]
        mscale = torch.where(seq_len > original, torch.full_like(emb[:, :1, :1], long),
                             torch.full_like(emb[:, :1, :1], short))
    return (emb.cos() * mscale).to(x.dtype), (emb.sin() * mscale).to(x.dtype)


# --- qwen4_exp's QSA indexer ----------------------------------------------------------------------
def _fix_qsa_indexers(model: nn.Module) -> list[str]:
    cls = _qsa_indexer_cls()
    if cls is None:
        return []
    owners = [m for m in model.modules() if hasattr(m, "rotary_emb") and hasattr(m, "layers")]
    out = []
    for name, m in model.named_modules():
        if not isinstance(m, cls) or getattr(m, _MARK, False):
            continue
        rotary = next((o.rotary_emb for o in owners
                       if any(x is m for x in o.layers.modules())), None)
        if rotary is None:
            raise ValueError(f"{name}: no rotary embedding found beside the layers holding this "
                             f"QSA indexer")
        m._cupool_rotary = [rotary]          # a list: not registered as a submodule
        m._cupool_original = m.forward
        m.forward = types.MethodType(_qsa_forward, m)
        setattr(m, _MARK, True)
        out.append(name)
    return out


def _qsa_forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
    from cupool.slotstate import StateSlotCache
    if cache is None:                            # transformers <= 5.23 names it past_key_values
        cache = kwargs.pop("past_key_values", None)
    if not isinstance(cache, StateSlotCache):
        return self._cupool_original(hidden_states, position_embeddings, attention_mask, cache)
    return qsa_select(self, hidden_states, position_embeddings, attention_mask, cache)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of the first cos.shape[-1] dims of x (the rest pass), as qwen4_exp's."""
    r = cos.shape[-1]
    xr, xp = x[..., :r], x[..., r:]
    half = xr.shape[-1] // 2
    rot = torch.cat((-xr[..., half:], xr[..., :half]), dim=-1)
    return torch.cat([xr * cos + rot * sin, xp], dim=-1)


def qsa_select(module, hidden_states, position_embeddings, attention_mask, cache) -> torch.Tensor:
    """The QSA selection mask [B, 1, S, L_k] (bool, or the float form the installed attention adds
    where the mask is float) of `module` (a Qwen4ExpTextQSAIndexer) for queries hidden_states
    [B, S, H] at the positions of `position_embeddings` (cos, sin [B, S, r]); the attention mask
    [B, 1, S, L_k] says which keys each query sees (causal, per slot)."""
    B, S, _ = hidden_states.shape
    d, nh, c = module.index_head_dim, module.index_n_heads, module.compress_ratio
    cos, sin = position_embeddings
    cos, sin = cos[:, -S:], sin[:, -S:]
    qk = module.index_qk_proj(hidden_states)
    q, raw = torch.split(qk, [nh * d, module.index_kv_heads * d], dim=-1)
    q = module.q_layernorm(q.reshape(B, S, nh, d))
    q = _rope(q, cos.unsqueeze(2), sin.unsqueeze(2))                        # [B, S, h, d]
    keys = cache.update_indexer(raw.reshape(B, S, d), module.layer_idx)     # [B, L_k, d]
    Lk = keys.shape[1]
    visible = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    visible = visible[:, 0, :, :Lk]                                         # [B, S, L_k]
    nb = Lk // c
    seen = visible.sum(-1)                                                  # [B, S]
    complete = seen // c                                                    # blocks before q
    select = visible.clone()
    if nb > 0:
        blocks = keys[:, :nb * c].reshape(B, nb, c, d)
        pooled = module.k_layernorm(blocks.float().mean(dim=2).to(keys.dtype))   # [B, nb, d]
        starts = torch.arange(0, nb * c, c, device=keys.device)
        rotary = module._cupool_rotary[0]
        kcos, ksin = rotary(pooled, starts.view(1, 1, nb).expand(1, 1, nb))     # [1, nb, r]
        kblock = _rope(pooled, kcos.to(pooled.dtype), ksin.to(pooled.dtype))    # [B, nb, d]
        scores = torch.einsum("bshd,bnd->bshn", q.float(), kblock.float())
        scores = torch.relu(scores).sum(dim=2) / math.sqrt(d)                   # [B, S, nb]
        j = torch.arange(nb, device=keys.device)
        valid = j.view(1, 1, nb) < complete[..., None]                          # [B, S, nb]
        scores = scores.masked_fill(~valid, float("-inf"))
        k = min(module.block_topk, nb)
        top = scores.topk(k, dim=-1).indices                                    # [B, S, k]
        chosen = torch.zeros(B, S, nb, dtype=torch.bool, device=keys.device)
        chosen.scatter_(-1, top, True)
        chosen &= valid
        # tokens of complete blocks are visible only where their block was chosen; the tail
        # (positions at or past complete·c) stays as the causal mask has it
        in_block = (torch.arange(Lk, device=keys.device) < (complete * c)[..., None])
        token_chosen = torch.zeros(B, S, Lk, dtype=torch.bool, device=keys.device)
        token_chosen[..., :nb * c] = chosen.repeat_interleave(c, dim=-1)
        select = visible & (~in_block | token_chosen)
    mask = select.unsqueeze(1)
    if attention_mask.dtype == torch.bool:
        return mask
    return _float_form(module, mask, attention_mask)


def _float_form(module, mask: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """transformers 5.17's attention adds the indexer's mask to a float mask (0 / lowest); 5.24's
    masks with it as bool. Which one the installed release takes is measured once, on the
    original forward with a one-token float mask."""
    kind = getattr(module, "_cupool_float_kind", None)
    if kind is None:
        w = module.index_qk_proj.weight
        h = torch.zeros(1, 1, w.shape[1], dtype=w.dtype, device=w.device)
        r = module._cupool_rotary[0]
        cs = r(h, torch.zeros(1, 1, 1, dtype=torch.long, device=w.device))
        probe = module._cupool_original(h, cs, torch.zeros(1, 1, 1, 1, dtype=w.dtype,
                                                           device=w.device), None)
        kind = module._cupool_float_kind = "bool" if probe.dtype == torch.bool else "float"
    if kind == "bool":
        return mask
    low = torch.finfo(attention_mask.dtype).min
    return torch.where(mask, torch.zeros((), dtype=attention_mask.dtype, device=mask.device),
                       torch.full((), low, dtype=attention_mask.dtype, device=mask.device))
