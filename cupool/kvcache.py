"""A KV cache of B slots, each its own sequence at its own position, for batched decode.

Shape legend: B slots · L_max positions a slot holds · h KV heads · d head dim · S tokens of one
prefill chunk.

transformers' StaticCache keeps one write position for the whole batch; continuous batching needs
one per sequence. `SlotCache` is duck-typed to what a transformers ≥ 5 attention layer calls
(`update(key_states, value_states, layer_idx, ...)` returning the keys and values to attend to),
with two modes:
- decode: every slot takes one token, written at `pos[b]` by an indexed copy (a device tensor,
  so the step is captured in a CUDA graph once and replayed at any positions);
- prefill: one slot `b` takes the next chunk of its prompt at positions [start, start + S),
  with plain slices (eager).
The attention mask that goes with each mode is built here too (`decode_mask`, `prefill_mask`),
from the same positions, as a 4-D mask the model passes to attention as it is: per slot, key
position j is visible to a query at position q when j ≤ q (and q − j < window for sliding-window
layers). Layers' buffers are allocated on their first update (their head counts and dims come
from the model); call `allocate` through one prefill before capturing a decode step.
"""

from __future__ import annotations

import torch


class SlotCache:
    """B slots of up to `max_len` positions each, on `device`, in `dtype`."""

    def __init__(self, num_layers: int, slots: int, max_len: int, dtype: torch.dtype, device):
        if slots < 1 or max_len < 2 or num_layers < 1:
            raise ValueError(f"need slots >= 1, max_len >= 2 and num_layers >= 1, got "
                             f"slots={slots}, max_len={max_len}, num_layers={num_layers}")
        self.num_layers, self.slots, self.max_len = int(num_layers), int(slots), int(max_len)
        self.dtype, self.device = dtype, torch.device(device)
        self.keys: list[torch.Tensor | None] = [None] * self.num_layers
        self.values: list[torch.Tensor | None] = [None] * self.num_layers
        self.pos = torch.zeros(self.slots, dtype=torch.int64, device=self.device)   # tokens held
        self._rows = torch.arange(self.slots, device=self.device)
        self._mode = "decode"
        self._slot = 0
        self._start = 0
        self._stop = 0

    # --- modes (host state: the captured step records the decode mode's ops) -------------------
    def decode_mode(self) -> None:
        """Next forward: one token a slot, written at pos[b] (pos is not advanced here)."""
        self._mode = "decode"

    def prefill_mode(self, slot: int, start: int, length: int) -> None:
        """Next forward: tokens [start, start + length) of slot `slot`."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} out of range [0, {self.slots})")
        if start < 0 or length < 1 or start + length > self.max_len:
            raise ValueError(f"positions [{start}, {start + length}) do not fit the cache's "
                             f"{self.max_len} positions a slot")
        self._mode, self._slot, self._start, self._stop = "prefill", slot, start, start + length

    # --- what attention layers call --------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs):
        """Store [B or 1, h, S, d] keys and values of this forward, return what to attend to:
        decode: every slot's [B, h, L_max, d]; prefill: the slot's [1, h, start + S, d]."""
        k, v = self.keys[layer_idx], self.values[layer_idx]
        if k is None:
            k, v = self._allocate(layer_idx, key_states, value_states)
        if self._mode == "decode":
            k[self._rows, :, self.pos] = key_states[:, :, 0].to(k.dtype)
            v[self._rows, :, self.pos] = value_states[:, :, 0].to(v.dtype)
            return k, v
        b, a, e = self._slot, self._start, self._stop
        k[b, :, a:e] = key_states[0].to(k.dtype)
        v[b, :, a:e] = value_states[0].to(v.dtype)
        return k[b:b + 1, :, :e], v[b:b + 1, :, :e]

    def _allocate(self, layer_idx, key_states, value_states):
        if not 0 <= layer_idx < self.num_layers:
            raise IndexError(f"layer_idx {layer_idx} out of range [0, {self.num_layers})")
        hk, dk = key_states.shape[1], key_states.shape[3]
        hv, dv = value_states.shape[1], value_states.shape[3]
        k = torch.zeros(self.slots, hk, self.max_len, dk, dtype=self.dtype, device=self.device)
        v = torch.zeros(self.slots, hv, self.max_len, dv, dtype=self.dtype, device=self.device)
        self.keys[layer_idx], self.values[layer_idx] = k, v
        return k, v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """For callers that ask (position ids and masks are always passed explicitly)."""
        return self._stop if self._mode == "prefill" else self.max_len

    # --- masks -------------------------------------------------------------------------------------
    def _visible(self, q: torch.Tensor, j: torch.Tensor, window: int | None) -> torch.Tensor:
        ok = j <= q
        if window:
            ok &= (q - j) < window
        return ok

    def decode_mask(self, dtype: torch.dtype, window: int | None = None,
                    boolean: bool = False) -> torch.Tensor:
        """[B, 1, 1, L_max]: slot b's query at pos[b] sees keys 0 … pos[b] (its own included)."""
        j = torch.arange(self.max_len, device=self.device)
        ok = self._visible(self.pos[:, None], j[None, :], window)[:, None, None, :]
        return ok if boolean else _additive(ok, dtype)

    def prefill_mask(self, dtype: torch.dtype, window: int | None = None,
                     boolean: bool = False) -> torch.Tensor:
        """[1, 1, S, start + S] for the prefill chunk set by `prefill_mode`."""
        q = torch.arange(self._start, self._stop, device=self.device)
        j = torch.arange(self._stop, device=self.device)
        ok = self._visible(q[:, None], j[None, :], window)[None, None]
        return ok if boolean else _additive(ok, dtype)


def _additive(ok: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where visible, the dtype's lowest value elsewhere (added to attention scores)."""
    zero = torch.zeros((), dtype=dtype, device=ok.device)
    low = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=ok.device)
    return torch.where(ok, zero, low)


# Layer types (config.layer_types) whose layers keep keys and values for every position, and those
# that keep a per-slot state instead (cupool.slotstate) and take no mask. indexed_attention is
# transformers 5.24's name for qwen4_exp's QSA attention, qwen_sparse_attention 5.17's; moe and
# mlp are Nemotron-H's blocks without a token mixer; conv is LFM2's short-convolution layer.
ATTENTION_TYPES = frozenset({"full_attention", "sliding_attention", "indexed_attention",
                             "qwen_sparse_attention"})
STATE_TYPES = frozenset({"linear_attention", "mamba", "moe", "mlp", "conv"})
INDEXED_TYPES = frozenset({"indexed_attention", "qwen_sparse_attention"})


def kv_bytes_per_token(config, dtype_bytes: int = 2) -> int:
    """Bytes the KV cache holds for one token of one sequence, from a transformers config: every
    attention layer's keys and values (multi-head latent attention, as DeepSeek-V2/V3 run it in
    transformers, keeps full per-head keys of qk_nope + qk_rope dims and values of v_head_dim),
    plus an indexed attention layer's indexer key. Layers of the state types keep no keys (their
    per-slot states do not grow with the context)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = list(getattr(cfg, "layer_types", None) or [])
    layers = sum(t in ATTENTION_TYPES for t in types) if types else int(cfg.num_hidden_layers)
    indexed = sum(t in INDEXED_TYPES for t in types)
    heads = int(cfg.num_attention_heads)
    if getattr(cfg, "kv_lora_rank", None) and getattr(cfg, "qk_rope_head_dim", None):
        k = heads * (int(cfg.qk_nope_head_dim) + int(cfg.qk_rope_head_dim))
        v = heads * int(cfg.v_head_dim)
    else:
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        k = v = kv_heads * dim
    index = indexed * int(getattr(cfg, "indexer_head_dim", 0) or 0)
    return (layers * (k + v) + index) * dtype_bytes
