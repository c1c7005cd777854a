"""from_pretrained's CPU steps on checkpoints the tests write with transformers' save_pretrained:
the meta skeleton, the MoE layers matched to the checkpoint's, the dense part's names mapped
(Mixtral's block_sparse_moe → mlp, tied embeddings), loaded on the CPU with fresh rotary tables,
and — with the checkpoint's experts put back — logits equal to the model that was saved. The
pool itself needs a GPU (test_gpu_pretrained.py)."""

from __future__ import annotations

import pytest
import torch

from tiny_models import FAMILIES, hf_model

pytest.importorskip("transformers")

from cupool import pretrained as P  # noqa: E402
from cupool.adapters import find_moe_layers  # noqa: E402
from cupool.checkpoints import CheckpointError, open_checkpoint  # noqa: E402


def _saved(tmp_path, family, dtype=torch.bfloat16, **kw):
    model = hf_model(family, seed=11, dtype=dtype, **kw)
    d = tmp_path / family
    model.save_pretrained(d)
    return model, d


def _load_cpu(d, dtype=torch.bfloat16, quantize_attention=False):
    ckpt = open_checkpoint(d)
    _, model = P.skeleton(d, dtype)
    specs = find_moe_layers(model)
    layers = P.match_layers(specs, ckpt)
    mapping = P.dense_plan(model, specs, ckpt)
    for s in specs:
        s.release()
    P.load_dense(model, mapping, ckpt, "cpu", quantize_attention)
    return ckpt, model, specs, layers


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_dense_part_and_experts_give_the_saved_models_logits(tmp_path, family):
    ref, d = _saved(tmp_path, family)
    ckpt, model, specs, layers = _load_cpu(d)
    try:
        want = dict(ref.state_dict())
        for name, t in model.state_dict().items():
            if t.numel() and name in want:
                assert torch.equal(t, want[name]), name
        for name, b in model.named_buffers():                  # rotary tables computed afresh
            assert torch.allclose(b.float(), dict(ref.named_buffers())[name].float()), name
        for spec, layer in zip(specs, layers):                 # experts back from the checkpoint
            ex = ckpt.experts(layer)
            spec.restore([(ex.gate[e], ex.up[e], ex.down[e]) for e in range(ex.n)], "cpu",
                         ex.bias)
    finally:
        ckpt.close()
    ids = torch.randint(3, 60, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits,
                                   rtol=0, atol=0)


def test_tied_embeddings_load_from_one_tensor(tmp_path):
    ref, d = _saved(tmp_path, "qwen3_moe", tie_word_embeddings=True)
    ckpt, model, _, _ = _load_cpu(d)
    ckpt.close()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, ref.lm_head.weight)


def test_missing_and_misshapen_dense_tensors_are_named(tmp_path):
    from safetensors.torch import load_file, save_file
    _, d = _saved(tmp_path, "qwen3_moe")
    f = d / "model.safetensors"
    tensors = load_file(f)
    norm = "model.layers.1.post_attention_layernorm.weight"
    saved = tensors.pop(norm)
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="lacks 1 tensor.*post_attention_layernorm"):
        _load_cpu(d)
    tensors[norm] = torch.cat([saved, saved])
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"post_attention_layernorm.weight' has shape \[96\]"):
        _load_cpu(d)


def test_layers_that_disagree_with_config_are_refused(tmp_path):
    _, d = _saved(tmp_path, "qwen3_moe")
    import json
    cfg = json.loads((d / "config.json").read_text())
    cfg["moe_intermediate_size"] = 48                      # the model would need other experts
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError):
        _load_cpu(d)


def test_resolve_refuses_what_is_neither_a_directory_nor_a_hub_id(tmp_path):
    with pytest.raises(CheckpointError, match="no such directory"):
        P.resolve(tmp_path / "nothing" / "here")
    (tmp_path / "f").write_text("x")
    with pytest.raises(CheckpointError, match="is a file"):
        P.resolve(tmp_path / "f")
    assert P.resolve(tmp_path) == tmp_path


def test_from_pretrained_checks_its_arguments_before_reading(tmp_path):
    with pytest.raises(TypeError, match="dtype must be"):
        P.from_pretrained(tmp_path, dtype=torch.float32)
    with pytest.raises(TypeError, match="unexpected keyword"):
        P.from_pretrained(tmp_path, budgte="1GiB")
