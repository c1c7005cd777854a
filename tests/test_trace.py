"""Routing traces and the CPU simulator (no GPU)."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cupool import trace as tr
from cupool.simulate import simulate

ROOT = Path(__file__).resolve().parent.parent


def test_synthetic_locality_matches_the_published_figures():
    t = tr.synthetic(128, 6, 128, 8, seed=3, **tr.QWEN3_LOCALITY)
    assert t.ids.shape == (128, 6, 1, 8)
    for s in range(0, 128, 17):                       # distinct experts within a token
        assert len(set(t.ids[s, 2, 0].tolist())) == 8
    assert 0.40 <= t.reuse(1) <= 0.52, t.reuse(1)     # published: ~45% at the next token
    assert 0.74 <= t.reuse(8) <= 0.85, t.reuse(8)     # published: ~80% within 8 tokens


def test_uniform_has_little_reuse():
    t = tr.uniform(64, 2, 128, 8, seed=1)
    assert t.reuse(1) < 0.15


def test_save_load_round_trip(tmp_path):
    t = tr.synthetic(10, 3, 16, 2, seed=0)
    path = t.save(tmp_path / "t.npz")
    u = tr.Trace.load(path)
    np.testing.assert_array_equal(u.ids, t.ids)
    assert u.num_experts == 16 and u.note == t.note


def test_trace_guards():
    with pytest.raises(ValueError, match="outside"):
        tr.Trace(np.full((2, 1, 1, 2), 9), num_experts=4)
    with pytest.raises(ValueError, match=r"\[steps, layers, tokens, top_k\]"):
        tr.Trace(np.zeros((2, 2), dtype=np.int32), num_experts=4)
    with pytest.raises(ValueError, match="must be integers"):
        tr.Trace(np.zeros((2, 1, 1, 2)), num_experts=4)
    with pytest.raises(ValueError, match="top_k=5"):
        tr.synthetic(2, 1, 4, 5)


def test_simulate_hit_rates():
    t = tr.synthetic(64, 4, 32, 4, seed=2, **tr.QWEN3_LOCALITY)
    full = simulate(t, 32)
    assert full["hit_rate"] == 1.0 and full["misses"] == 0
    half = simulate(t, 16, warmup_steps=4)
    assert 0.5 < half["hit_rate"] < 1.0
    assert sum(half["rows_owned"]) == 4 * 16           # rows move between layers, none vanish
    uni = simulate(tr.uniform(64, 4, 32, 4), 16, warmup_steps=4)
    assert uni["hit_rate"] < half["hit_rate"]
    with pytest.raises(ValueError, match="rows_per_layer"):
        simulate(t, 2)


def test_simulate_cli():
    r = subprocess.run([sys.executable, "-m", "cupool", "simulate", "--steps", "24", "--layers", "3",
                        "--experts", "32", "--top-k", "4", "--rows", "8", "16"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "rows/layer     8" in r.stdout and "hit rate" in r.stdout


def test_streams_are_independent_single_stream_traces():
    """tr.streams: token 0 is the one-token synthetic trace of the same seed, every token keeps
    a single stream's locality; a several-token synthetic trace shares one history, so one of its
    tokens alone reuses less (why a batch-1 replay of it hit less than bench_decode's trace)."""
    from cupool.simulate import simulate
    L, E, K = 4, 64, 8
    st = tr.streams(96, L, E, K, 3, seed=5, **tr.QWEN3_LOCALITY)
    one = tr.synthetic(96, L, E, K, seed=5, **tr.QWEN3_LOCALITY)
    assert st.ids.shape == (96, L, 3, K)
    assert np.array_equal(st.ids[:, :, 0], one.ids[:, :, 0])
    shared = tr.synthetic(96, L, E, K, tokens=16, seed=5, **tr.QWEN3_LOCALITY)
    alone = simulate(tr.Trace(st.ids[:, :, 2:3], E), E // 2)["hit_rate"]
    diluted = simulate(tr.Trace(shared.ids[:, :, :1], E), E // 2)["hit_rate"]
    assert alone > diluted + 0.1, (alone, diluted)
    with pytest.raises(ValueError, match="count"):
        tr.streams(8, L, E, K, 0)
