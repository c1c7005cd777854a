"""from_pretrained's CPU steps on checkpoints of the hybrid families written by transformers'
save_pretrained (per-expert experts, Granite's input_linear / output_linear, Kimi's three short
convolutions, qwen4_exp's n-gram tables in numbered shards) and with the published multimodal
prefix (`model.language_model.`): loaded on the CPU with the checkpoint's experts put back, the
logits equal the saved model's. The n-gram tables are host tables: counted off the GPU's dense
part."""

from __future__ import annotations

import pytest
import torch

from test_pretrained import _load_cpu
from tiny_models import HYBRID_FAMILIES, hybrid_model

pytest.importorskip("transformers")

from cupool import hosttable  # noqa: E402
from cupool import pretrained as P  # noqa: E402
from cupool.checkpoints import open_checkpoint  # noqa: E402

# Nemotron-H's experts have no gate projection: its checkpoints wait for non-gated rows.
LOADABLE = sorted(f for f in HYBRID_FAMILIES if f != "nemotron_h")


def _save(tmp_path, family, **kw):
    model = hybrid_model(family, seed=11, dtype=torch.bfloat16, **kw)
    d = tmp_path / family
    model.save_pretrained(d)
    return model, d


def _logits_equal(ref, d):
    ckpt, model, specs, layers = _load_cpu(d)
    try:
        for spec, layer in zip(specs, layers):
            ex = ckpt.experts(layer)
            spec.restore([(ex.gate[e], ex.up[e], ex.down[e]) for e in range(ex.n)], "cpu",
                         ex.bias)
    finally:
        ckpt.close()
    ids = torch.randint(3, 60, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits,
                                   rtol=0, atol=0)
    return model


@pytest.mark.parametrize("family", LOADABLE)
def test_saved_hybrid_checkpoints_load_to_the_same_logits(tmp_path, family):
    kw = {"split_ngram_parts": 3} if family == "qwen4_exp_text" else {}
    ref, d = _save(tmp_path, family, **kw)
    _logits_equal(ref, d)


def test_qwen4_exp_published_names_and_host_tables(tmp_path):
    """The release's names: every tensor under model.language_model., the n-gram tables in 5
    shards; the tables are what the model lists in _no_placement_params and are counted in host
    memory, not in the dense part the budget places on the GPU."""
    from safetensors.torch import load_file, save_file
    ref, d = _save(tmp_path, "qwen4_exp_text", split_ngram_parts=5)
    f = d / "model.safetensors"
    tensors = load_file(f)
    renamed = {("model.language_model." + n[len("model."):] if n.startswith("model.") else n): t
               for n, t in tensors.items()}
    assert sum(".ngram_embedding.shard_" in n for n in renamed) == 5 * 2
    f.unlink()
    save_file(renamed, d / "model.safetensors", metadata={"format": "pt"})
    model = _logits_equal(ref, d)
    names = hosttable.host_table_names(model)
    assert names == [n for n, _ in model.named_parameters() if n.endswith("ngram_embedding.weight")]
    assert len(names) == 2
    table = sum(dict(model.named_parameters())[n].numel() for n in names) * 2
    assert hosttable.host_table_bytes(model, torch.bfloat16) == table
    with open_checkpoint(d) as ck:
        _, skel = P.skeleton(d, torch.bfloat16)
        assert ck.dense_bytes(torch.bfloat16) - hosttable.host_table_bytes(skel, torch.bfloat16) \
            == ck.dense_bytes(torch.bfloat16) - table


def test_parts_that_do_not_join_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    from cupool.checkpoints import CheckpointError
    _, d = _save(tmp_path, "qwen4_exp_text", split_ngram_parts=3)
    f = d / "model.safetensors"
    tensors = load_file(f)
    name = "model.layers.0.ple.ple_embedding.ngram_embedding.shard_1.weight"
    tensors[name] = tensors[name][:-1].clone()
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="the 3 parts of .*ngram_embedding.weight.*joined"):
        _load_cpu(d)


def test_plan_counts_the_host_tables_in_host_memory(tmp_path, capsys):
    """`cupool plan` on a qwen4_exp checkpoint: the n-gram tables are host memory, not dense GPU
    bytes; the KV cache counts the one indexed attention layer (keys, values, indexer key)."""
    from test_cli import run
    ref, d = _save(tmp_path, "qwen4_exp_text", split_ngram_parts=3)
    rc, out, _ = run("plan", "--model", str(d), "--budget", "1GiB", "--context", "64",
                     capsys=capsys)
    assert rc == 0, out
    table = sum(p.numel() for n, p in ref.named_parameters() if "ngram_embedding" in n) * 2
    line = next(x for x in out.splitlines() if x.startswith("host tables"))
    assert f"{table / 1024:.2f} KiB" in line and "ngram_embedding" in line
    cfg = ref.config
    per_token = (2 * cfg.num_key_value_heads * cfg.head_dim + cfg.indexer_head_dim) * 2
    assert f"{per_token} B a token" in out
