"""The input embedding in host memory where the bank cannot hold every expert: which matrix may go
(`cupool.hosttable.input_embedding_name`), when it goes (`cupool.budget.rows_and_host`), and what
`cupool plan` shows. The placement itself (pinned mapped memory read by the GPU) is tested on a
GPU (test_gpu_pretrained.py)."""

from __future__ import annotations

import pytest
import torch

from cupool.budget import rows_and_host
from cupool.hosttable import as_table_parameter, input_embedding_name


def test_rows_and_host_keeps_the_embedding_where_every_expert_fits():
    calls = []

    def rows_for(extra):
        calls.append(extra)
        return 8
    assert rows_and_host(rows_for, 1000, 100, 8) == (8, False)
    assert calls == [1000]                                   # asked once, with it on the GPU


def test_rows_and_host_gives_the_bank_its_room_where_experts_are_left_out():
    # 10 bytes a row beside `extra`: 5 rows with it on the GPU, 7 without
    def rows_for(extra):
        return (1050 - extra) // 10
    assert rows_and_host(rows_for, 1000, 20, 8) == (7, True)
    assert rows_and_host(rows_for, 1000, 0, 8) == (5, False)           # nothing to move


def test_rows_and_host_moves_it_where_only_that_fits():
    def rows_for(extra):
        if extra > 900:
            raise ValueError("budget too small")
        return 2
    assert rows_and_host(rows_for, 1000, 200, 8) == (2, True)
    with pytest.raises(ValueError, match="too small"):
        rows_and_host(rows_for, 1000, 50, 8)                 # still too small without it


@pytest.fixture
def qwen():
    pytest.importorskip("transformers")
    from tiny_models import hf_model
    return hf_model("qwen3_moe", seed=2, dtype=torch.bfloat16)


def test_an_untied_embedding_may_go_to_host_memory(qwen):
    assert not qwen.config.tie_word_embeddings
    assert input_embedding_name(qwen) == "model.embed_tokens.weight"


def test_a_tied_or_placed_embedding_stays(qwen):
    qwen.config.tie_word_embeddings = True                   # the head reads it whole each step
    assert input_embedding_name(qwen) is None
    qwen.config.tie_word_embeddings = False
    qwen.lm_head.weight = qwen.model.embed_tokens.weight     # shared without the config saying so
    assert input_embedding_name(qwen) is None


def test_a_host_table_already_is_not_named_again(qwen):
    emb = qwen.get_input_embeddings()
    emb.weight = as_table_parameter(emb.weight.detach())
    assert input_embedding_name(qwen) is None


def test_plan_shows_the_embedding_in_host_memory_only_for_a_partial_bank(tmp_path, capsys):
    pytest.importorskip("transformers")
    from test_cli import run
    from tiny_models import hf_model
    d = tmp_path / "qwen"
    hf_model("qwen3_moe", seed=2, dtype=torch.bfloat16).save_pretrained(d)
    rc, out, _ = run("plan", "--model", str(d), "--budget", "1GiB", "--context", "64",
                     capsys=capsys)
    assert rc == 0 and "8 rows per layer (100%" in out and "embedding" not in out, out
    rc, out, _ = run("plan", "--model", str(d), "--budget", "4MiB", "--context", "64",
                     capsys=capsys)
    assert rc == 0, out
    line = next(x for x in out.splitlines() if x.startswith("embedding"))
    assert "6.00 KiB  in pinned host memory (model.embed_tokens.weight" in line   # 64 x 48 bf16
    assert "4 rows per layer (50%" in out
    assert "168.00 KiB" in out and "174.00 KiB pinned in host memory" in out      # store + it
