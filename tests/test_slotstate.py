"""cupool.slotstate.StateSlotCache: per-slot convolution and recurrent states through both
transformers interfaces (5.17's has_previous_state / layers[i].conv_states, 5.24's
get_conv_state / get_recurrent_state), a first chunk with no previous state, continuation, the
decode mode's whole-batch tensors updated in place, slot reset, indexer keys; the saved copies of
slots' states (prefix reuse's resume points); and the engine's mask plan by layer type."""

from __future__ import annotations

import pytest
import torch

from cupool.slotstate import SavedStates, StateSlotCache

B, L, C, K = 3, 16, 5, 4


def _cache():
    return StateSlotCache(num_layers=2, slots=B, max_len=L, dtype=torch.float32, device="cpu")


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_first_chunk_has_no_state_and_pads_with_zeros():
    c = _cache()
    c.prefill_mode(1, 0, 2)
    assert c.get_conv_state(0) is None and c.get_recurrent_state(0) is None
    assert not c.has_previous_state(0, 0) and not c.has_previous_state()
    x = _rand(1, C, 2)
    full = c.update_conv_state(x, 0, conv_kernel_size=K)
    assert torch.equal(full, torch.cat([torch.zeros(1, C, K - 2), x], -1))
    assert c.layers[0].conv[0].shape == (B, C, K)
    assert torch.equal(c.layers[0].conv[0][1, :, -2:], x[0])
    assert not c.layers[0].conv[0][[0, 2]].any()            # other slots untouched


def test_a_later_chunk_continues_from_the_slot_state():
    c = _cache()
    c.prefill_mode(2, 0, 6)
    x1 = _rand(1, C, 6, seed=1)
    c.update_conv_state(x1, 0, conv_kernel_size=K)
    r1 = _rand(1, 2, 3, seed=2)
    c.update_recurrent_state(r1, 0)
    c.prefill_mode(2, 6, 3)
    assert c.has_previous_state(0, 0) and c.has_previous_state(0)
    # both interfaces hand out views of slot 2's rows
    assert torch.equal(c.get_conv_state(0), x1[..., -K:])
    assert torch.equal(c.layers[0].conv_states[0], x1[..., -K:])
    assert torch.equal(c.layers[0].recurrent_states[0], r1)
    x2 = _rand(1, C, 3, seed=3)
    full = c.update_conv_state(x2, 0, conv_kernel_size=K)
    assert torch.equal(full, torch.cat([x1[..., -K:], x2], -1))
    assert torch.equal(c.layers[0].conv[0][2], torch.cat([x1, x2], -1)[0, :, -K:])
    # an in-place update of the view lands in the slot's row (the decode kernels do this)
    c.get_recurrent_state(0).mul_(2)
    assert torch.equal(c.layers[0].recurrent[0][2], 2 * r1[0])


def test_decode_hands_out_every_slot_and_updates_in_place():
    c = _cache()
    for b in range(B):
        c.prefill_mode(b, 0, K)
        c.update_conv_state(_rand(1, C, K, seed=b), 0, conv_kernel_size=K)
        c.update_recurrent_state(_rand(1, 2, 3, seed=10 + b), 0)
    before = c.layers[0].conv[0].clone()
    addr = c.layers[0].conv[0].data_ptr()
    c.decode_mode()
    assert c.get_conv_state(0).shape == (B, C, K) and c.has_previous_state(0, 0)
    x = _rand(B, C, 1, seed=20)
    full = c.update_conv_state(x, 0)
    assert torch.equal(full, torch.cat([before, x], -1))
    assert c.layers[0].conv[0].data_ptr() == addr          # fixed address (captured graphs)
    assert torch.equal(c.layers[0].conv[0], torch.cat([before, x], -1)[..., -K:])
    r = _rand(B, 2, 3, seed=21)
    assert torch.equal(c.update_recurrent_state(r, 0), r)
    with pytest.raises(ValueError, match="batch 1, the cache's decode mode expects 3"):
        c.update_recurrent_state(r[:1], 0)
    with pytest.raises(ValueError, match="recurrent state 0: got"):
        c.update_recurrent_state(_rand(B, 2, 4), 0)


def test_reset_slot_zeroes_only_that_slot():
    c = _cache()
    c.decode_mode()
    c.update_conv_state(_rand(B, C, K), 1, conv_kernel_size=K)
    c.update_recurrent_state(_rand(B, 2, 3), 1, state_idx=1)
    c.update_indexer(_rand(B, 1, 8), 1)
    keep = [t.clone() for t in c.layers[1].tensors()]
    c.reset_slot(1)
    for t, k in zip(c.layers[1].tensors(), keep):
        assert not t[1].any()
        assert torch.equal(t[[0, 2]], k[[0, 2]])
    with pytest.raises(ValueError, match="slot 3 out of range"):
        c.reset_slot(3)


def test_integer_states_and_indexer_keys():
    """qwen4_exp's n-gram context is a [b, S] int64 'conv' state; indexer keys are kept like keys."""
    c = _cache()
    c.prefill_mode(0, 0, 5)
    ids = torch.arange(5)[None]
    assert torch.equal(c.update_conv_state(ids, 0, state_idx=2, conv_kernel_size=2), ids)
    assert c.layers[0].conv[2].dtype == torch.int64
    assert c.layers[0].conv[2][0].tolist() == [3, 4]
    k = _rand(1, 5, 8)
    assert torch.equal(c.update_indexer(k, 0), k)
    c.prefill_mode(0, 5, 2)
    k2 = _rand(1, 2, 8, seed=1)
    assert torch.equal(c.update_indexer(k2, 0), torch.cat([k, k2], 1))
    c.decode_mode()
    c.pos[:] = torch.tensor([7, 0, 3])
    k3 = _rand(B, 1, 8, seed=2)
    out = c.update_indexer(k3, 0)
    assert out.shape == (B, L, 8)
    assert torch.equal(out[0, 7], k3[0, 0]) and torch.equal(out[2, 3], k3[2, 0])
    assert torch.equal(out[0, :5], k[0])


def test_position_history_is_not_kept():
    """Both transformers releases keep qwen4_exp's position history on the cache when it lets
    them; this cache does not (the engine passes each call's positions)."""
    c = _cache()
    c.position_ids = torch.arange(3)
    assert not hasattr(c, "position_ids")
    c.layers[1].indexer_position_ids = torch.arange(3)
    assert c.layers[1].indexer_position_ids is None


# --- the engine's masks by layer type --------------------------------------------------------------
def _plan(**cfg):
    from types import SimpleNamespace

    from cupool.engine import Engine
    return Engine._sliding_window(SimpleNamespace(**cfg))


def test_mask_plan_by_layer_type():
    from cupool.engine import NO_MASK
    assert _plan(layer_types=["linear_attention", "full_attention"]) == \
        {"full_attention": None, "linear_attention": NO_MASK}
    assert _plan(layer_types=["linear_attention", "indexed_attention"]) == \
        {"indexed_attention": None, "linear_attention": NO_MASK}
    assert _plan(layer_types=["sliding_attention", "full_attention"], sliding_window=8) == \
        {"full_attention": None, "sliding_attention": 8}
    assert _plan(layer_types=["full_attention"] * 2, sliding_window=8) is None
    with pytest.raises(ValueError, match=r"not \['chunked_attention'\]"):
        _plan(layer_types=["chunked_attention", "full_attention"])
    with pytest.raises(ValueError, match="full_attention layers would slide"):
        _plan(layer_types=["linear_attention", "full_attention"], sliding_window=16)
    with pytest.raises(ValueError, match="no sliding window"):
        _plan(layer_types=["sliding_attention", "full_attention"], sliding_window=None)
    with pytest.raises(ValueError, match="no attention layer"):
        _plan(layer_types=["linear_attention"])


def test_snapshot_and_restore_keep_addresses():
    """What the engine does around a capture: the dummy steps advance every slot's states."""
    c = _cache()
    c.decode_mode()
    c.update_conv_state(_rand(B, C, K), 0, conv_kernel_size=K)
    c.update_recurrent_state(_rand(B, 2, 3), 1)
    saved = c.snapshot()
    addrs = [t.data_ptr() for layer in c.layers for t in layer.tensors()]
    c.update_conv_state(_rand(B, C, 1, seed=5), 0)
    c.update_recurrent_state(_rand(B, 2, 3, seed=6), 1)
    c.restore(saved)
    now = [t for layer in c.layers for t in layer.tensors()]
    assert [t.data_ptr() for t in now] == addrs
    assert all(torch.equal(t, s) for t, s in zip(now, saved))


def test_saved_states_copy_one_slot_at_fixed_addresses():
    """An entry holds one slot's convolution and recurrent states (integer states too), not its
    indexer keys; saving and loading copy in place, and the entries are allocated once."""
    c = _cache()
    saved = SavedStates(c, 2)
    with pytest.raises(RuntimeError, match="no state to save"):
        saved.save(0, 0)
    with pytest.raises(RuntimeError, match="nothing has been saved"):
        saved.read(0)
    c.decode_mode()
    c.update_conv_state(_rand(B, C, K), 0, conv_kernel_size=K)
    c.update_conv_state(torch.randint(0, 9, (B, 3), dtype=torch.int64), 1, state_idx=2,
                        conv_kernel_size=3)
    c.update_recurrent_state(_rand(B, 2, 3, seed=1), 1)
    c.update_indexer(_rand(B, 1, 8, seed=2), 1)
    states = saved.states()
    assert len(states) == 3 and all(t is not c.layers[1].index_keys for t in states)
    assert saved.entry_bytes() == (C * K + 2 * 3) * 4 + 3 * 8       # float32 conv, recurrent; int64
    assert saved.allocated_bytes() == 0                     # nothing saved yet
    addrs = [t.data_ptr() for layer in c.layers for t in layer.tensors()]
    want = [t[2].clone() for t in states]
    saved.save(2, 1)
    assert saved.allocated_bytes() == 2 * saved.entry_bytes()
    entry_addrs = [e.data_ptr() for e in saved._entries]
    for t in states:                                        # the slot moves on (a decode step)
        t.copy_(torch.randint_like(t, 1, 50) if not t.is_floating_point() else torch.randn_like(t))
    other = [t[0].clone() for t in states]
    keys = c.layers[1].index_keys.clone()
    assert all(torch.equal(r, w) for r, w in zip(saved.read(1), want))
    saved.load(1, 2)
    assert all(torch.equal(t[2], w) for t, w in zip(states, want))
    assert all(torch.equal(t[0], o) for t, o in zip(states, other))      # other slots untouched
    assert torch.equal(c.layers[1].index_keys, keys)
    saved.save(0, 0)
    assert [t.data_ptr() for layer in c.layers for t in layer.tensors()] == addrs
    assert [e.data_ptr() for e in saved._entries] == entry_addrs
    with pytest.raises(ValueError, match="entry 2 out of range"):
        saved.save(0, 2)
    with pytest.raises(ValueError, match="slot 3 out of range"):
        saved.load(0, 3)
    with pytest.raises(ValueError, match="entry -1 out of range"):
        saved.read(-1)
    with pytest.raises(ValueError, match="count must be an int >= 0"):
        SavedStates(c, -1)


def test_rows_mode_writes_each_row_into_its_slot_and_refuses_states():
    """prefill_rows_mode: row i's keys and values land in slot slots[i] at positions [0, S), the
    forward reads the rows' slots back, the mask is the causal one, other slots are untouched;
    bad slot lists and lengths are refused, and a state layer in that mode is an error (the
    engine prefills such models one prompt at a time)."""
    c = _cache()
    c.prefill_rows_mode([2, 0], 5)
    k, v = _rand(2, 2, 5, 4, seed=1), _rand(2, 2, 5, 4, seed=2)
    got_k, got_v = c.update(k, v, 0)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    assert torch.equal(c.keys[0][2, :, :5], k[0]) and torch.equal(c.keys[0][0, :, :5], k[1])
    assert not c.keys[0][1].any() and not c.keys[0][:, :, 5:].any()
    assert c.get_seq_length() == 5
    mask = c.prefill_mask(torch.float32, boolean=True)
    assert mask.shape == (1, 1, 5, 5) and torch.equal(mask[0, 0], torch.ones(5, 5).tril().bool())
    with pytest.raises(ValueError, match="batch 2"):
        c.update_conv_state(_rand(2, C, 5), 1, conv_kernel_size=K)
    for slots, n, what in (([1, 1], 3, "distinct"), ([3], 3, "distinct"), ([], 3, "distinct"),
                           ([0], 0, "does not fit"), ([0], L + 1, "does not fit")):
        with pytest.raises(ValueError, match=what):
            c.prefill_rows_mode(slots, n)
    c.decode_mode()
    assert c.get_seq_length() == L
