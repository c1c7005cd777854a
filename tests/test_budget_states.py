"""The engine's memory beside the model, from a config alone, counted in the budget: one slot's
recurrent states (`cupool.kvcache.state_bytes_per_slot`) equal what `StateSlotCache` allocates for
every hybrid family; the reserve (`engine_reserve`: KV cache, the slots' states, the resume
points' copies of them) is what `cupool plan` counts and shows part by part, what a budget too
small for it names, and what `cupool serve`'s loader hands `from_pretrained`. All on the CPU."""

from __future__ import annotations

import argparse
import types

import pytest
import torch

from tiny_models import HYBRID_FAMILIES, hybrid_model

pytest.importorskip("transformers")

from cupool.budget import Reserve, rows_for_budget  # noqa: E402
from cupool.engine import Engine  # noqa: E402
from cupool.kvcache import engine_reserve, kv_bytes_per_token, state_bytes_per_slot  # noqa: E402
from cupool.sampling import SamplingParams  # noqa: E402
from cupool.store import fmt_bytes  # noqa: E402

B, L_MAX = 2, 16


def _built(family: str, dtype):
    """An engine of B slots over the tiny model, after one request (the states are allocated on
    the first prefill)."""
    model = hybrid_model(family, seed=3, dtype=dtype)
    eng = Engine(model, max_batch=B, max_len=L_MAX, eos_token_id=[])
    eng.generate([[5, 9, 4, 7]], SamplingParams(max_tokens=2))
    return model, eng


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", sorted(HYBRID_FAMILIES))
def test_config_sizes_equal_the_built_caches(family, dtype):
    """One slot's states from the config equal the cache's per-slot states (all its state
    tensors but the indexer keys, which are per position) and one resume point; the KV figure
    per token covers the cache's keys, values and indexer keys of one position of one slot."""
    model, eng = _built(family, dtype)
    cache = eng.cache
    index_keys = [layer.index_keys for layer in cache.layers if layer.index_keys is not None]
    per_position = sum(t.numel() * t.element_size() for t in index_keys)
    states = cache.state_bytes() - per_position
    assert states % B == 0
    got = state_bytes_per_slot(model.config, dtype.itemsize)
    assert got == states // B == eng.resume_point_bytes, (family, got, states // B)
    kv = sum(t.numel() * t.element_size() for t in cache.keys + cache.values if t is not None)
    assert kv_bytes_per_token(model.config, dtype.itemsize) >= (kv + per_position) // (B * L_MAX)
    eng.close()


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen4_exp"])
def test_an_image_text_config_counts_its_text_model(family):
    from transformers import AutoConfig
    kw, _ = HYBRID_FAMILIES[f"{family}_text"]
    text = AutoConfig.for_model(f"{family}_text", **kw)
    wrapped = AutoConfig.for_model(family, text_config=kw)
    assert state_bytes_per_slot(wrapped) == state_bytes_per_slot(text) > 0


def test_qwen3_next_80b_slot_is_74_mib():
    """The figure the docs give: 36 gated delta nets of 32 x 128 x 128 float32 recurrent state and
    a 8192 x 4 bf16 convolution state."""
    from transformers import AutoConfig
    cfg = AutoConfig.for_model("qwen3_next", num_hidden_layers=48, linear_num_key_heads=16,
                               linear_num_value_heads=32, linear_key_head_dim=128,
                               linear_value_head_dim=128, linear_conv_kernel_dim=4,
                               layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 12)
    assert state_bytes_per_slot(cfg) == 36 * (32 * 128 * 128 * 4 + 8192 * 4 * 2)
    assert state_bytes_per_slot(cfg) / 2**20 == pytest.approx(74.25)


def test_models_without_states_and_unknown_recurrent_layers():
    attention = types.SimpleNamespace(model_type="qwen3_moe", num_hidden_layers=2,
                                      num_attention_heads=2, hidden_size=32)
    assert state_bytes_per_slot(attention) == 0
    chunked = types.SimpleNamespace(model_type="some_moe", layer_types=[
        "chunked_attention", "deepseek_sparse_attention", "full_attention", "moe", "mlp"])
    assert state_bytes_per_slot(chunked) == 0          # attention of any name keeps no state
    for kinds in (["linear_attention", "full_attention"], ["hybrid"], ["conv", "full_attention"],
                  ["mamba"]):
        other = types.SimpleNamespace(model_type="some_hybrid", layer_types=kinds)
        with pytest.raises(ValueError, match=r"model_type='some_hybrid' has recurrent layers"):
            state_bytes_per_slot(other)


def test_the_reserve_counts_states_for_every_slot_and_resume_point():
    model = hybrid_model("qwen3_next")
    slot = state_bytes_per_slot(model.config)
    r = engine_reserve(model.config, max_batch=3, max_len=100)
    assert (r.kv, r.states, r.resume_points) == (kv_bytes_per_token(model.config) * 300,
                                                 3 * slot, 9 * slot)
    assert r.total == r.kv + 12 * slot and (r.slots, r.points) == (3, 9)
    none = engine_reserve(model.config, max_batch=3, max_len=100, resume_points=0)
    assert none.resume_points == 0 and none.states == 3 * slot
    attention = engine_reserve(hybrid_model("phimoe").config, max_batch=3, max_len=100)
    assert attention.states == attention.resume_points == attention.points == 0
    for kw, word in ((dict(max_batch=0, max_len=8), "max_batch must be an int >= 1, got 0"),
                     (dict(max_batch=2, max_len=8, resume_points=-1),
                      "resume_points must be an int >= 0, got -1")):
        with pytest.raises(ValueError, match=word):
            engine_reserve(model.config, **kw)


def test_a_budget_too_small_for_the_reserve_names_its_parts():
    r = Reserve(kv=3 << 30, states=200 << 20, resume_points=600 << 20, slots=8, points=24)
    with pytest.raises(ValueError) as e:
        rows_for_budget(3 << 30, fixed=1 << 20, row_stride=1 << 20, num_layers=4, top_k=2,
                        num_experts=8, kv_reserve=r)
    msg = str(e.value)
    assert "\n" not in msg and "budget=3.00 GiB is too small" in msg
    for words in ("reserve 3.78 GiB", "KV cache 3.00 GiB", "recurrent states 200.00 MiB (8 slots)",
                  "resume points 600.00 MiB (24 copies)"):
        assert words in msg, (words, msg)
    # what fits is what is left once the whole reserve is paid
    rows = rows_for_budget(8 << 30, fixed=0, row_stride=1 << 30, num_layers=1, top_k=1,
                           num_experts=8, kv_reserve=r)
    assert rows == (8 << 30) // (1 << 30) - 4          # 3.78 GiB reserved: 4 rows of 1 GiB gone
    assert rows_for_budget(8 << 30, fixed=0, row_stride=1 << 30, num_layers=1, top_k=1,
                           num_experts=8, kv_reserve=3 << 30) == 5


# --- cupool plan ----------------------------------------------------------------------------------
@pytest.fixture
def next_dir(tmp_path):
    d = tmp_path / "qwen3_next"
    hybrid_model("qwen3_next", seed=2, dtype=torch.bfloat16).save_pretrained(d)
    return d


def _line(out: str, head: str) -> str:
    return next(x for x in out.splitlines() if x.startswith(head))


def test_plan_shows_and_counts_states_and_resume_points(next_dir, capsys):
    from test_cli import run
    from transformers import AutoConfig
    slot = state_bytes_per_slot(AutoConfig.from_pretrained(next_dir))
    rc, out, _ = run("plan", "--model", str(next_dir), "--budget", "1GiB", "--context", "64",
                     "--batch", "2", capsys=capsys)
    assert rc == 0, out
    assert fmt_bytes(2 * slot) in _line(out, "slot states") and "2 slots" in out
    assert fmt_bytes(6 * slot) in _line(out, "resume pts") and "6 copies" in out
    assert "fits" in _line(out, "budget")

    def on_gpu(points: int) -> float:           # MiB on the GPU in all, as plan prints it
        rc, out, _ = run("plan", "--model", str(next_dir), "--budget", "1GiB", "--context", "64",
                         "--batch", "2", "--resume-points", str(points), capsys=capsys)
        assert rc == 0 and f"{points} copies" in _line(out, "resume pts"), out
        size, unit = _line(out, "budget").split("fits: ")[1].split()[:2]
        assert unit == "MiB", out
        return float(size)

    assert on_gpu(1000) - on_gpu(0) == pytest.approx(1000 * slot / 2**20, abs=0.011)


def test_plan_of_a_budget_below_the_reserve_names_the_parts(next_dir, capsys):
    from test_cli import run
    rc, out, _ = run("plan", "--model", str(next_dir), "--budget", "2MiB", "--context", "64",
                     "--batch", "4", capsys=capsys)
    assert rc == 1
    line = _line(out, "budget")
    assert "does not fit" in line
    for words in ("KV cache", "recurrent states", "(4 slots)", "resume points", "(12 copies)"):
        assert words in line, (words, line)


def test_plan_of_an_attention_model_shows_no_states(tmp_path, capsys):
    from test_cli import run
    d = tmp_path / "phimoe"
    hybrid_model("phimoe", dtype=torch.bfloat16).save_pretrained(d)
    rc, out, _ = run("plan", "--model", str(d), "--budget", "1GiB", "--context", "32",
                     capsys=capsys)
    assert rc == 0 and "slot states" not in out and "resume pts" not in out


# --- cupool serve ---------------------------------------------------------------------------------
@pytest.fixture
def config_dir(tmp_path):
    """A directory holding the config.json of the tiny Kimi-Linear (all the loader reads before
    from_pretrained)."""
    from transformers import AutoConfig
    kw, _ = HYBRID_FAMILIES["kimi_linear"]
    d = tmp_path / "kimi"
    AutoConfig.for_model("kimi_linear", **kw).save_pretrained(d)
    return d


def test_serve_loader_reserves_states_and_resume_points(config_dir, monkeypatch):
    """On CUDA the loader hands from_pretrained the reserve of the engine it will build: KV cache,
    max_batch slots' states, resume_points copies (default 3 x max_batch). No GPU needed:
    from_pretrained is replaced by a recorder."""
    import cupool
    from cupool.serve import loader
    from transformers import AutoConfig
    seen = {}

    def record(path, **kwargs):
        seen.update(kwargs)
        return "loaded"

    monkeypatch.setattr(cupool, "from_pretrained", record)
    cfg = AutoConfig.from_pretrained(config_dir)
    slot, per_token = state_bytes_per_slot(cfg), kv_bytes_per_token(cfg)
    assert slot > 0
    assert loader.load(config_dir, "cuda", budget="20GiB", max_batch=3, max_len=48) == "loaded"
    r = seen["kv_reserve"]
    assert (r.kv, r.states, r.resume_points) == (per_token * 48 * 3, 3 * slot, 9 * slot)
    loader.load(config_dir, "cuda", max_batch=2, max_len=48, resume_points=5)
    r = seen["kv_reserve"]
    assert (r.states, r.resume_points, r.points) == (2 * slot, 5 * slot, 5)
    with pytest.raises(loader.LoadError, match="resume_points must be an int >= 0, got -1"):
        loader.load(config_dir, "cuda", max_batch=2, max_len=48, resume_points=-1)


def test_serve_passes_resume_points_to_the_loader(config_dir, monkeypatch, capsys):
    """`cupool serve --resume-points N` reaches the loader, which sizes the reserve by it."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from cupool.serve import cli, loader
    seen = {}

    def record(model_dir, device, **kwargs):
        seen.update(kwargs)
        raise loader.LoadError("recorded")

    monkeypatch.setattr(loader, "load", record)
    parser = argparse.ArgumentParser(prog="cupool serve")
    cli.add_arguments(parser)
    args = parser.parse_args(["--model", str(config_dir), "--device", "cpu", "--port", "0",
                              "--max-len", "48", "--max-batch", "2", "--resume-points", "7"])
    assert cli.run(args) == 2
    assert "recorded" in capsys.readouterr().err
    assert (seen["resume_points"], seen["max_batch"], seen["max_len"]) == (7, 2, 48)


def test_serve_logs_the_resume_points_and_checks_the_reserved_size(monkeypatch, caplog):
    """serve's start-up line gives the resume points' count and size; through a pool, one slot's
    states as allocated are checked against what the reserve counted for them."""
    import logging

    import cupool.kvcache
    from cupool.serve import cli
    model, eng = _built("qwen3_next", torch.float32)
    log = logging.getLogger("cupool.serve")
    each = eng.resume_point_bytes
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="cupool.serve"):
        cli._log_resume_points(log, eng, pool=object())
    assert f"{3 * B} resume points of {each / 2**20:.1f} MiB" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    caplog.clear()
    monkeypatch.setattr(cupool.kvcache, "state_bytes_per_slot", lambda cfg, dtype_bytes: each - 8)
    with caplog.at_level(logging.INFO, logger="cupool.serve"):
        cli._log_resume_points(log, eng, pool=object())
    assert f"take {each} bytes, the budget's reserve counted {each - 8}" in caplog.text
    eng.close()
