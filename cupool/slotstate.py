"""Per-slot states of the layers that are not plain attention, beside `SlotCache`'s keys and values.

Shape legend: B slots · L_max positions a slot holds · C channels of a short convolution · K its
kernel (positions kept) · d indexer head dim.

Hybrid families mix attention with layers that carry a state from token to token instead of keys
for every position: gated delta nets (Qwen3-Next, Qwen3.5, Qwen3.8-Flash-Next's `qwen4_exp`) and
Kimi's delta attention keep a short-convolution state [B, C, K] and a recurrent state; Mamba-2
(Granite-4, Nemotron-H) a convolution state and an SSM state; MiniMax's lightning attention one
[B, h, d, d] state; `qwen4_exp`'s per-layer n-gram embedding two more convolution-like states (the
last tokens, the last gated values); its indexed attention layers keep one indexer key per
position [B, L_max, d] next to their keys and values. transformers keeps one cache layer class per
layer type behind one interface; `StateSlotCache` is duck-typed to that interface as both
transformers 5.17 (`has_previous_state`, `layers[i].conv_states[j]`), 5.24 (`get_conv_state`,
`get_recurrent_state`, `is_recording_past`) and 5.25 (`get_recurrent_states_to_keep`,
`increase_count`) call it, with `SlotCache`'s two modes:

- decode: every slot's row [B, ...] is handed out whole; the layers update it in place (the
  convolution and recurrent decode kernels write their state argument) or through
  `update_*_state`, which copies into the same tensor, so the step keeps fixed addresses and is
  captured once;
- prefill of slot b, positions [start, stop): the slot's row [1, ...] (a view: in-place updates land
  in the slot's row). The first chunk (start = 0) reports no previous state, exactly as a fresh
  transformers cache does, so each layer takes its no-state path (zero-padded convolution, no
  initial recurrent state, an EOS-filled n-gram context) and overwrites every state of the slot;
  later chunks continue from what the previous chunk left, so prompts of any length work.

`reset_slot(b)` also zeroes every state row of a slot that takes a new request, so nothing of the
previous request can be read even by a layer that skipped its first-chunk write. Tensors are
allocated on their first write (shapes and dtypes come from the model: Kimi's recurrent state is
float32 whatever the model's dtype); run one prefill before capturing a decode step.

`SavedStates` keeps copies of slots' convolution and recurrent states apart from the slots (prefix
reuse's resume points): a decode step through transformers' modules advances every slot's
states, a free slot's too (the fused step's delta nets leave an inactive slot's as they are), so a
state a later request may resume from must be copied out when it is exact.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from cupool.kvcache import SlotCache


class _SlotView(Mapping):
    """`layers[i].conv_states` / `.recurrent_states` as transformers 5.17 indexes them: state index
    -> the mode's view of that state (None while the slot has no previous state)."""

    def __init__(self, cache: StateSlotCache, states: dict):
        self._cache, self._states = cache, states

    def __getitem__(self, idx):
        t = self._states.get(idx)
        return None if t is None or self._cache._fresh() else self._cache._view(t)

    def __iter__(self):
        return iter(self._states)

    def __len__(self):
        return len(self._states)


class SlotLayer:
    """One layer's per-slot tensors, by state index: conv [B, ..., K], recurrent [B, ...]; the
    indexer keys [B, L_max, d] of an indexed attention layer. Reached as `cache.layers[i]`."""

    record_past = False          # transformers' rollback recording: never on here

    def __init__(self, cache: StateSlotCache, index: int):
        self._cache, self.index = cache, index
        self.conv: dict[int, torch.Tensor] = {}
        self.recurrent: dict[int, torch.Tensor] = {}
        self.kernel: dict[int, int] = {}
        self.index_keys: torch.Tensor | None = None

    @property
    def conv_states(self) -> _SlotView:
        return _SlotView(self._cache, self.conv)

    @property
    def recurrent_states(self) -> _SlotView:
        return _SlotView(self._cache, self.recurrent)

    # transformers 5.24's qwen4_exp keeps the 3-D positions of every token seen on its first
    # indexed layer's cache and prepends them to the next call's; the engine passes each call's
    # positions whole (its indexer reads the rotary table by position), so nothing is kept.
    @property
    def indexer_position_ids(self):
        return None

    @indexer_position_ids.setter
    def indexer_position_ids(self, value) -> None:
        pass

    def tensors(self) -> list[torch.Tensor]:
        out = list(self.conv.values()) + list(self.recurrent.values())
        return out + ([self.index_keys] if self.index_keys is not None else [])


class StateSlotCache(SlotCache):
    """`SlotCache` (attention keys and values, positions, masks) plus the per-slot states of every
    other layer type, in `layers[i]`."""

    def __init__(self, num_layers: int, slots: int, max_len: int, dtype: torch.dtype, device):
        super().__init__(num_layers, slots, max_len, dtype, device)
        self.layers = [SlotLayer(self, i) for i in range(self.num_layers)]

    # transformers 5.17's qwen4_exp keeps every token's positions on the cache object when it has
    # this attribute; reading it fails, so the model uses each call's positions alone.
    @property
    def position_ids(self):
        raise AttributeError("StateSlotCache keeps no position history")

    @position_ids.setter
    def position_ids(self, value) -> None:
        pass

    # --- modes -------------------------------------------------------------------------------------
    def _fresh(self) -> bool:
        """The slot being prefilled has no previous state (its first chunk)."""
        return self._mode == "prefill" and self._start == 0

    def _view(self, t: torch.Tensor) -> torch.Tensor:
        return t if self._mode == "decode" else t[self._slot:self._slot + 1]

    def _layer(self, layer_idx: int) -> SlotLayer:
        if not 0 <= layer_idx < self.num_layers:
            raise IndexError(f"layer_idx {layer_idx} out of range [0, {self.num_layers})")
        return self.layers[layer_idx]

    def _check_batch(self, t: torch.Tensor, what: str, layer_idx: int) -> int:
        """Check a forward's tensor has this mode's batch (B in decode, 1 in prefill)."""
        want = self.slots if self._mode == "decode" else 1
        if t.shape[0] != want:
            raise ValueError(f"layer {layer_idx} {what}: batch {t.shape[0]}, the cache's "
                             f"{self._mode} mode expects {want}")
        return want

    def _new_state(self, like: torch.Tensor, shape) -> torch.Tensor:
        return torch.zeros((self.slots, *shape), dtype=like.dtype, device=self.device)

    # --- states (what the layers call) ------------------------------------------------------------
    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        return self._layer(layer_idx).conv_states[state_idx]

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        return self._layer(layer_idx).recurrent_states[state_idx]

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        if self._fresh():
            return False
        if layer_idx is None:
            return True
        layer = self._layer(layer_idx)
        if state_idx is None:
            return bool(layer.conv or layer.recurrent)
        return state_idx in layer.conv or state_idx in layer.recurrent

    def is_recording_past(self, layer_idx: int | None = None) -> bool:
        return False

    # transformers 5.25's layers ask how many intermediate recurrent states a chunk must keep (for
    # the rollback recording, never on here) and count a token that a decode kernel wrote into a
    # convolution state in place (the slots keep no token count).
    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        return 0

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        pass

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:
        """Take this forward's inputs [b, ..., S] of a causal convolution; keep the last K per slot;
        return what the convolution must see: the slot's previous K then the S new ones (or, on a
        first chunk, the new ones, zero-padded on the left to K)."""
        layer = self._layer(layer_idx)
        self._check_batch(conv_states, "conv state", layer_idx)
        buf = layer.conv.get(state_idx)
        if buf is None:
            k = int(conv_kernel_size or conv_states.shape[-1])
            buf = layer.conv[state_idx] = self._new_state(conv_states, (*conv_states.shape[1:-1], k))
            layer.kernel[state_idx] = k
        k = layer.kernel[state_idx]
        if buf.shape[1:-1] != conv_states.shape[1:-1] or buf.dtype != conv_states.dtype:
            raise ValueError(f"layer {layer_idx} conv state {state_idx}: got "
                             f"{tuple(conv_states.shape)} {conv_states.dtype}, the slots hold "
                             f"{tuple(buf.shape)} {buf.dtype}")
        view = self._view(buf)
        if self._fresh():
            full = conv_states
            if full.shape[-1] < k:
                full = torch.nn.functional.pad(full, (k - full.shape[-1], 0))
        else:
            full = torch.cat([view, conv_states], dim=-1)
        view.copy_(full[..., -k:])
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int,
                               state_idx: int = 0, **kwargs) -> torch.Tensor:
        """Copy this forward's final recurrent state into the slots' rows; return those rows."""
        layer = self._layer(layer_idx)
        self._check_batch(recurrent_states, "recurrent state", layer_idx)
        buf = layer.recurrent.get(state_idx)
        if buf is None:
            buf = layer.recurrent[state_idx] = self._new_state(recurrent_states,
                                                              recurrent_states.shape[1:])
        if buf.shape[1:] != recurrent_states.shape[1:]:
            raise ValueError(f"layer {layer_idx} recurrent state {state_idx}: got "
                             f"{tuple(recurrent_states.shape)}, the slots hold {tuple(buf.shape)}")
        view = self._view(buf)
        view.copy_(recurrent_states)
        return view

    # MiniMax's lightning attention: one state a layer, read and replaced by these two.
    def get_linear_cache(self, layer_idx: int):
        return self.get_recurrent_state(layer_idx, 0)

    def set_linear_cache(self, layer_idx: int, linear_cache: torch.Tensor) -> None:
        self.update_recurrent_state(linear_cache, layer_idx, 0)

    def update_indexer(self, indexer_key_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Store [b, S, d] indexer keys like `update` stores keys; return what the indexer reads:
        decode: every slot's [B, L_max, d]; prefill: the slot's [1, start + S, d]."""
        layer = self._layer(layer_idx)
        self._check_batch(indexer_key_states, "indexer keys", layer_idx)
        buf = layer.index_keys
        if buf is None:
            buf = layer.index_keys = torch.zeros(self.slots, self.max_len,
                                                 indexer_key_states.shape[-1],
                                                 dtype=indexer_key_states.dtype, device=self.device)
        if self._mode == "decode":
            buf[self._rows, self.pos] = indexer_key_states[:, 0].to(buf.dtype)
            return buf
        b, a, e = self._slot, self._start, self._stop
        buf[b, a:e] = indexer_key_states[0].to(buf.dtype)
        return buf[b:b + 1, :e]

    # --- slots -------------------------------------------------------------------------------------
    def state_tensors(self) -> list[torch.Tensor]:
        """Every per-slot state tensor [B, ...] allocated so far, layer by layer."""
        return [t for layer in self.layers for t in layer.tensors()]

    def reset_slot(self, slot: int) -> None:
        """Zero every state row of `slot` (its attention rows need nothing: positions past the
        slot's own are never visible)."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} out of range [0, {self.slots})")
        for t in self.state_tensors():
            t[slot].zero_()

    def snapshot(self) -> list[torch.Tensor]:
        """Copies of every state tensor, for `restore`."""
        return [t.clone() for t in self.state_tensors()]

    def restore(self, saved: list[torch.Tensor]) -> None:
        """Copy a `snapshot` back in place (the addresses stay)."""
        tensors = self.state_tensors()
        if len(tensors) != len(saved):
            raise ValueError(f"a snapshot of {len(saved)} tensors for a cache of {len(tensors)}")
        for t, s in zip(tensors, saved):
            t.copy_(s)

    def state_bytes(self) -> int:
        """Bytes of every per-slot state allocated so far (all slots)."""
        return sum(t.numel() * t.element_size() for t in self.state_tensors())

    def release(self) -> None:
        """Drop every tensor (keys, values, states); the cache cannot be used afterwards."""
        self.keys = [None] * self.num_layers
        self.values = [None] * self.num_layers
        self.layers = [SlotLayer(self, i) for i in range(self.num_layers)]


class SavedStates:
    """`count` entries, each a copy of one slot's convolution and recurrent states (not the indexer
    keys: those are per position, like keys and values, and stay valid in the slot's rows), at
    fixed addresses apart from the slots' rows: the resume points of prefix reuse.

    The decode step never touches them (its captured graph is unchanged); `save` and `load` are
    eager copies on the current stream, ordered with the steps around them: a save issued after a
    step is launched copies the state that step leaves, and a load issued before a prefill is what
    that prefill continues from. Every entry is allocated on the first save, all at once:
    `count` × `entry_bytes()` bytes on the cache's device (a Qwen3-Next-80B slot, 36 gated delta
    nets of 32 × 128 × 128 float32 recurrent state and 8192 × 4 convolution state, is 74 MiB).
    """

    def __init__(self, cache: StateSlotCache, count: int):
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"count must be an int >= 0, got {count!r}")
        self.cache, self.count = cache, count
        self._entries: list[torch.Tensor] | None = None     # per state: [count, ...]

    def states(self) -> list[torch.Tensor]:
        """The cache's convolution and recurrent states [B, ...], in a fixed order (none for a
        model of attention layers alone, or before the first prefill)."""
        return [t for layer in self.cache.layers for d in (layer.conv, layer.recurrent)
                for t in d.values()]

    def entry_bytes(self) -> int:
        """Bytes of one entry: one slot's states (0 while no state is allocated)."""
        return sum(t[0].numel() * t.element_size() for t in self.states())

    def allocated_bytes(self) -> int:
        return 0 if self._entries is None else self.count * self.entry_bytes()

    def _check(self, slot: int, entry: int) -> list[torch.Tensor]:
        if not 0 <= slot < self.cache.slots:
            raise ValueError(f"slot {slot} out of range [0, {self.cache.slots})")
        if not 0 <= entry < self.count:
            raise ValueError(f"entry {entry} out of range [0, {self.count})")
        states = self.states()
        if not states:
            raise RuntimeError("the cache holds no state to save (attention layers alone, or no "
                               "prefill has run yet)")
        if self._entries is None:
            self._entries = [torch.empty((self.count, *t.shape[1:]), dtype=t.dtype,
                                         device=t.device) for t in states]
        elif len(self._entries) != len(states):
            raise RuntimeError(f"the cache holds {len(states)} states, the saved entries were "
                               f"made for {len(self._entries)}")
        return states

    def save(self, slot: int, entry: int) -> None:
        """Copy slot `slot`'s states into entry `entry`."""
        states = self._check(slot, entry)
        torch._foreach_copy_([e[entry] for e in self._entries], [t[slot] for t in states])

    def load(self, entry: int, slot: int) -> None:
        """Copy entry `entry` into slot `slot`'s states (in place: the addresses stay)."""
        states = self._check(slot, entry)
        torch._foreach_copy_([t[slot] for t in states], [e[entry] for e in self._entries])

    def read(self, entry: int) -> list[torch.Tensor]:
        """Copies of entry `entry`'s states, in `states()` order (for inspection)."""
        if self._entries is None:
            raise RuntimeError("nothing has been saved yet")
        if not 0 <= entry < self.count:
            raise ValueError(f"entry {entry} out of range [0, {self.count})")
        return [e[entry].clone() for e in self._entries]

    def release(self) -> None:
        self._entries = None
