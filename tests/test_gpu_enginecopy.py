"""GPU checks of copy-engine copies in captured steps (`cupool.ops.enginecopy`): a captured
sequence of `Bank.step(..., engine=True)` calls replays like eager calls with the row-copy
kernel: the same routes, copy lists, tables and bank rows (staging rows included), with the
list's first `slots` entries copied by switch nodes and the rest by settle_rows; a pool with
`engine_copies` on gives the same decode outputs through a captured graph as one without."""

import numpy as np
import pytest
import torch
from test_gpu_planner import make_store

from cupool.bank import Bank
from cupool.ops.enginecopy import EngineCopies

pytestmark = pytest.mark.gpu

pytest.importorskip("cuda.bindings", reason="copy-engine copies need cuda-bindings")


@pytest.mark.parametrize("slots", [1, 2, 8])
def test_captured_engine_copies_equal_eager_kernel_copies(rng, slots):
    L, E, N, S, lanes = 4, 13, 3, 64, 24
    store, expect = make_store(rng, L, E, 2048 + 16)
    bank_g, bank_e = Bank(store, N, S, lanes), Bank(store, N, S, lanes)
    eng = EngineCopies(bank_g, slots=slots)
    bank_g.engine_copies = eng
    calls = [(0, 8), (3, 24), (3, 1), (1, 17), (2, 2), (0, 24)]
    C = len(calls)
    ids_buf = torch.full((C, lanes), -1, dtype=torch.int64, device="cuda")

    def body(bank, engine, out):
        for c, (layer, W) in enumerate(calls):
            routes, _ = bank.step(layer, ids_buf[c, :W], engine=engine)
            out["routes"][c, :W].copy_(routes)
            out["n_copies"][c:c + 1].copy_(bank.n_copies)

    def outputs():
        return {"routes": torch.full((C, lanes), -7, dtype=torch.int32, device="cuda"),
                "n_copies": torch.zeros(C, dtype=torch.int32, device="cuda")}

    out_g, out_e = outputs(), outputs()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                 # warm-up: all padding, gate closed
        body(bank_g, True, out_g)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body(bank_g, True, out_g)
    torch.cuda.synchronize()
    assert eng.switches == C * slots
    for b in (bank_g, bank_e):
        b.open()
    past_slots = 0
    for rep in range(30):
        ids = np.full((C, lanes), -1, dtype=np.int64)
        for c, (layer, W) in enumerate(calls):
            ids[c, :W] = rng.integers(-1, E, size=W)
        ids_buf.copy_(torch.from_numpy(ids))
        eng.slot_rows.fill_(0xA5)                  # what a replay's settle must overwrite
        bank_g.rows[bank_g.num_rows:].fill_(0xFF)  # staging rows poisoned in the graph's bank
        bank_e.rows[bank_e.num_rows:].fill_(0xFF)
        graph.replay()
        body(bank_e, False, out_e)
        torch.cuda.synchronize()
        where = f"slots {slots}, replay {rep}"
        for name in ("routes", "n_copies"):
            assert torch.equal(out_g[name], out_e[name]), f"{name}: graph != eager, {where}"
        st_g, st_e = bank_g.state(), bank_e.state()
        for name in st_e:
            np.testing.assert_array_equal(st_g[name], st_e[name], err_msg=f"{name}, {where}")
        assert torch.equal(bank_g.rows, bank_e.rows), f"bank rows: engine != kernel, {where}"
        past_slots += int((out_g["n_copies"] > slots).sum())
        # the last call's lanes read their experts' bytes
        layer, W = calls[-1]
        r = out_g["routes"][-1, :W].long()
        keys = (layer * E + ids_buf[-1, :W]).clamp(0, L * E - 1)
        bad = ((bank_g.rows[r.clamp(min=0), :store.row_bytes] != expect[keys]).any(dim=1)
               & (r >= 0)).sum()
        assert int(bad) == 0, where
    assert slots == 8 or past_slots > 0, "calls with more copies than slots (settle_rows copies those)"
    assert eng.read_error() == [] and bank_g.read_error() == bank_e.read_error()
    assert bank_g.verify() > 0


def test_a_key_outside_the_layer_is_flagged_and_copies_nothing(rng):
    """A copy list entry (among the slots) whose key is another layer's: the sticky error bit,
    its row untouched; the other entries, one by a switch and one past the slots, land."""
    L, E, N, S, lanes = 2, 5, 2, 16, 8
    store, expect = make_store(rng, L, E, 1024 + 16)
    bank = Bank(store, N, S, lanes)
    eng = EngineCopies(bank, slots=2)
    copies = torch.zeros(lanes, 2, dtype=torch.int32, device="cuda")
    n = torch.zeros(1, dtype=torch.int32, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        eng(1, copies, n)                                   # a call of layer 1
    st, rb = bank.num_rows, store.row_bytes               # staging rows start here
    copies[:3] = torch.tensor([[2, st], [E + 3, st + 1], [E + 4, st + 2]], dtype=torch.int32)
    n.fill_(3)
    bank.rows[st:].fill_(0xEE)
    graph.replay()
    torch.cuda.synchronize()
    assert eng.read_error() == ["a copy list key outside its call's layer (internal)"]
    assert bool((bank.rows[st] == 0xEE).all()), "the refused entry's row was written"
    assert torch.equal(bank.rows[st + 1, :rb], expect[E + 3]), "the switch's copy"
    assert torch.equal(bank.rows[st + 2, :rb], expect[E + 4]), "the copy past the slots"
    assert bool((bank.rows[st + 3:] == 0xEE).all())


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_a_pool_with_engine_copies_decodes_the_same_tokens(family):
    """Two pools of one tiny model at half a bank, `engine_copies` off and on, through the
    Engine's captured decode graph: the same greedy tokens, no errors, banks that match the
    store; the captured graph held switch nodes and their copies flagged nothing."""
    from test_gpu_engine import _prompts
    from test_gpu_wrap import model_for
    from tiny_models import FAMILIES

    import cupool
    from cupool.sampling import SamplingParams
    _, (_, E, K, _, _) = FAMILIES[family]
    tokens = []
    for on in (False, True):
        model = model_for(family, seed=21)
        pool = cupool.wrap(model, rows=max(K, E // 2), max_decode_tokens=4,
                           max_prefill_tokens=64, progress=False)
        pool.engine_copies = on
        eng = cupool.Engine(model, pool, max_batch=4, max_len=48, eos_token_id=[], graph=True)
        reqs = eng.generate(_prompts([3, 9, 14, 5], seed=2), SamplingParams(max_tokens=16))
        tokens.append([r.output_ids for r in reqs])
        assert pool.errors() == [] and pool.verify() > 0
        if on:
            copier = pool.bank.engine_copies
            assert copier.switches > 0 and copier.read_error() == []
        eng.close()
        pool.unwrap()
    assert tokens[0] == tokens[1], f"{family}: engine copies change the tokens"
