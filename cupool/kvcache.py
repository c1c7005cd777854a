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

from cupool.budget import Reserve


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
        self._slot_rows = None

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

    def prefill_rows_mode(self, slots: list[int], length: int) -> None:
        """Next forward: positions [0, length) of each slot of `slots`, batch row i into slot
        slots[i] (prompts of up to `length` tokens, right-padded: a row's keys past its prompt
        are attended by none of its prompt's positions, and decode masks them until a step
        writes there)."""
        if not slots or len(set(slots)) != len(slots) or \
                not all(0 <= b < self.slots for b in slots):
            raise ValueError(f"slots must be distinct, in [0, {self.slots}), got {slots}")
        if not 1 <= length <= self.max_len:
            raise ValueError(f"length {length} does not fit the cache's {self.max_len} positions "
                             f"a slot")
        self._mode, self._start, self._stop = "rows", 0, int(length)
        self._slot_rows = torch.tensor(slots, dtype=torch.int64, device=self.device)

    # --- what attention layers call --------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs):
        """Store [B or 1, h, S, d] keys and values of this forward, return what to attend to:
        decode: every slot's [B, h, L_max, d]; prefill: the slot's [1, h, start + S, d]; rows:
        the rows' slots' [n, h, S, d]."""
        k, v = self.keys[layer_idx], self.values[layer_idx]
        if k is None:
            k, v = self._allocate(layer_idx, key_states, value_states)
        if self._mode == "decode":
            k[self._rows, :, self.pos] = key_states[:, :, 0].to(k.dtype)
            v[self._rows, :, self.pos] = value_states[:, :, 0].to(v.dtype)
            return k, v
        if self._mode == "rows":
            rows, e = self._slot_rows, self._stop
            k[rows, :, :e] = key_states.to(k.dtype)
            v[rows, :, :e] = value_states.to(v.dtype)
            return k[rows, :, :e], v[rows, :, :e]
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
        return self.max_len if self._mode == "decode" else self._stop

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
        """[1, 1, S, start + S] for the prefill chunk set by `prefill_mode` (or
        `prefill_rows_mode`, start 0: every row's causal mask)."""
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


# config.layer_types of the layers that carry a recurrent state (transformers 5.17's legacy Mamba
# name included); STATE_TYPES' moe and mlp blocks carry none.
RECURRENT_TYPES = frozenset({"linear_attention", "mamba"})
_FLOAT32 = 4        # recurrent states the layers hand over in float32 whatever the model's dtype
_INT64 = 8


def _gated_delta_net(cfg, dtype_bytes: int) -> int:
    """Qwen3-Next, Qwen3.5, qwen4_exp: the q, k, v short convolution [2·hk·dk + hv·dv, kernel] and
    the float32 recurrent state [hv, dk, dv]."""
    hk, hv = int(cfg.linear_num_key_heads), int(cfg.linear_num_value_heads)
    dk, dv = int(cfg.linear_key_head_dim), int(cfg.linear_value_head_dim)
    conv = (2 * hk * dk + hv * dv) * int(cfg.linear_conv_kernel_dim) * dtype_bytes
    return conv + hv * dk * dv * _FLOAT32


def _kimi_delta(cfg, dtype_bytes: int) -> int:
    """Kimi delta attention: the q, k, v short convolution [3·h·d, kernel] and the float32
    recurrent state [h, d, d]."""
    h, d = int(cfg.linear_num_heads), int(cfg.linear_head_dim)
    return 3 * h * d * int(cfg.linear_conv_kernel_dim) * dtype_bytes + h * d * d * _FLOAT32


def _mamba2(heads: int, head_dim: int, inner: int, groups: int, state: int, kernel: int,
            dtype_bytes: int) -> int:
    """Mamba-2: the x, B, C convolution [inner + 2·groups·state, kernel] and the float32 SSM
    state [heads, head_dim, state]."""
    return (inner + 2 * groups * state) * kernel * dtype_bytes + heads * head_dim * state * _FLOAT32


def _granite_mamba(cfg, dtype_bytes: int) -> int:
    return _mamba2(int(cfg.mamba_n_heads), int(cfg.mamba_d_head),
                   int(cfg.mamba_expand * cfg.hidden_size), int(cfg.mamba_n_groups),
                   int(cfg.mamba_d_state), int(cfg.mamba_d_conv), dtype_bytes)


def _nemotron_mamba(cfg, dtype_bytes: int) -> int:
    heads, head_dim = int(cfg.mamba_num_heads), int(cfg.mamba_head_dim)
    return _mamba2(heads, head_dim, heads * head_dim, int(cfg.n_groups), int(cfg.ssm_state_size),
                   int(cfg.conv_kernel), dtype_bytes)


def _lightning(cfg, dtype_bytes: int) -> int:
    """MiniMax's lightning attention: one [h, d, d] state in the model's dtype."""
    h = int(cfg.num_attention_heads)
    d = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // h)
    return h * d * d * dtype_bytes


# model_type of the text config -> bytes of one recurrent layer's states in one slot
_RECURRENT_LAYER = {
    "qwen3_next": _gated_delta_net, "qwen3_5_text": _gated_delta_net,
    "qwen3_5_moe_text": _gated_delta_net, "qwen4_exp_text": _gated_delta_net,
    "kimi_linear": _kimi_delta, "granitemoehybrid": _granite_mamba,
    "nemotron_h": _nemotron_mamba, "minimax": _lightning,
}


def _ngram_layers(cfg, dtype_bytes: int) -> int:
    """qwen4_exp's n-gram embedding layers (one-indexed `ple_layer_ids`): the last ngram_size − 1
    token ids (int64) and the last (kernel − 1)·ngram_size inputs of the dilated short
    convolution over hc_count·H channels."""
    ids = list(getattr(cfg, "ple_layer_ids", None) or [])
    if not ids:
        return 0
    n = int(cfg.ngram_size)
    conv = int(cfg.hc_count) * int(cfg.hidden_size) * (int(cfg.ple_conv_kernel_size) - 1) * n
    return len(ids) * ((n - 1) * _INT64 + conv * dtype_bytes)


def state_bytes_per_slot(config, dtype_bytes: int = 2) -> int:
    """Bytes of one slot's recurrent states, from a transformers config: what `StateSlotCache`
    holds per slot beside the keys and values, and what one resume point copies
    (`SavedStates.entry_bytes`). Per layer of the recurrent types, its short convolution's last
    `kernel` inputs in the model's dtype (`dtype_bytes`) and its recurrent state: float32 for
    gated delta nets, Kimi delta attention and Mamba-2 (their chunked scans hand it over in
    float32), the model's dtype for MiniMax's lightning attention; plus qwen4_exp's n-gram layers.
    Indexer keys are one per position and counted by `kv_bytes_per_token`. 0 for a model without
    recurrent layers; ValueError for a model of another family with layers that keep a state
    (their sizes are not known here)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = str(getattr(cfg, "model_type", ""))
    types = list(getattr(cfg, "layer_types", None) or [])
    recurrent = sum(t in RECURRENT_TYPES for t in types)
    known = _RECURRENT_LAYER.get(model_type)
    if known is None:
        # attention of any name (chunked, sparse, ...) and blocks without a token mixer keep no
        # state; linear attention, Mamba, short convolutions and "hybrid" layers keep one
        if any(t in RECURRENT_TYPES or not (t.endswith("attention") or t in ("moe", "mlp"))
               for t in types):
            raise ValueError(f"model_type={model_type!r} has recurrent layers (layer_types "
                             f"{sorted(set(types))}) whose per-slot state size is not known; "
                             f"known: {', '.join(sorted(_RECURRENT_LAYER))}")
        return 0
    return recurrent * known(cfg, dtype_bytes) + _ngram_layers(cfg, dtype_bytes)


def engine_reserve(config, *, max_batch: int, max_len: int, resume_points: int | None = None,
                   dtype_bytes: int = 2) -> Reserve:
    """What an `Engine(max_batch=, max_len=, resume_points=)` of a model of `config` allocates on
    the GPU beside the model, as a `cupool.budget.Reserve` (for `wrap` / `from_pretrained`'s
    `kv_reserve`): the KV cache (`kv_bytes_per_token` × max_len × max_batch), every slot's
    recurrent states (`state_bytes_per_slot` × max_batch) and the resume points, each a copy of
    one slot's states (× resume_points; default 3 × max_batch, as the engine's). A model
    without recurrent layers reserves the KV cache alone."""
    for name, v in (("max_batch", max_batch), ("max_len", max_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    points = 3 * max_batch if resume_points is None else resume_points
    if isinstance(points, bool) or not isinstance(points, int) or points < 0:
        raise ValueError(f"resume_points must be an int >= 0, got {resume_points!r}")
    slot = state_bytes_per_slot(config, dtype_bytes)
    return Reserve(kv=kv_bytes_per_token(config, dtype_bytes) * max_len * max_batch,
                   states=slot * max_batch, resume_points=slot * points if slot else 0,
                   slots=max_batch, points=points if slot else 0)
