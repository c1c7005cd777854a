"""ModelOpt NVFP4 checkpoints (cupool.modelopt), CPU: write/read round trip in both spellings,
single file and shards, rows equal pack_row, and every guard."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from cupool import modelopt
from cupool.layout import RowLayout, pack_row
from cupool.modelopt import (
    CheckpointError,
    read_expert,
    read_quant_config,
    write_checkpoint,
)
from cupool.nvfp4 import NVFP4Tensor, quantize
from cupool.store import HostStore

H, I = 80, 48          # H not a multiple of 64: the rows carry padding


def _experts(rng, layers=(0, 1), n_exp=3, h=H, i=I):
    out = {}
    for layer in layers:
        for e in range(n_exp):
            w = [torch.from_numpy(rng.standard_normal(s).astype(np.float32)) * float(rng.uniform(0.01, 3))
                 for s in ((i, h), (i, h), (h, i))]
            out[(layer, e)] = tuple(quantize(x) for x in w)
    return out


def _same(a: NVFP4Tensor, b: NVFP4Tensor) -> bool:
    return (torch.equal(a.packed, b.packed)
            and torch.equal(a.block_scale.view(torch.uint8), b.block_scale.view(torch.uint8))
            and a.global_scale.shape == () and a.global_scale.item() == b.global_scale.item())


@pytest.mark.parametrize("spelling,prefix,shards,config", [
    ("proj", "model.layers.{layer}.mlp.experts", 1, "hf_quant"),
    ("w", "model.layers.{layer}.block_sparse_moe.experts", 3, "config_json"),
    ("proj", "model.language_model.layers.{layer}.mlp.experts", 2, "both"),
])
def test_write_read_round_trip(tmp_path, rng, spelling, prefix, shards, config):
    ex = _experts(rng, layers=(1, 3))
    d = write_checkpoint(tmp_path / "ckpt", ex, spelling=spelling, prefix=prefix, shards=shards,
                         config=config)
    assert (d / "model.safetensors.index.json").is_file() == (shards > 1)
    for (layer, e), mats in ex.items():
        got = read_expert(d, layer, e)                                  # prefix found from names
        assert all(_same(a, b) for a, b in zip(mats, got))
        got = read_expert(d, layer, e, prefix=prefix)
        assert all(_same(a, b) for a, b in zip(mats, got))
    names = set(load_file(str(next(d.glob("*.safetensors")))))
    proj = "w1" if spelling == "w" else "gate_proj"
    assert any(n.endswith(f".{proj}.weight_scale_2") for n in names) or shards > 1


def test_read_one_file_and_open_checkpoint(tmp_path, rng):
    ex = _experts(rng, layers=(0,), n_exp=2)
    d = write_checkpoint(tmp_path / "c", ex)
    got = read_expert(d / "model.safetensors", 0, 1)                   # a file, config beside it
    assert all(_same(a, b) for a, b in zip(ex[(0, 1)], got))
    with modelopt.Checkpoint(d) as ck:
        assert ck.config["quant_algo"] == "NVFP4" and ck.config["group_size"] == 16
        got = read_expert(ck, 0, 0)
        assert all(_same(a, b) for a, b in zip(ex[(0, 0)], got))


def test_dtypes_and_shapes_as_modelopt_stores_them(tmp_path, rng):
    ex = _experts(rng, layers=(0,), n_exp=1)
    d = write_checkpoint(tmp_path / "c", ex)
    t = load_file(str(d / "model.safetensors"))
    base = "model.layers.0.mlp.experts.0"
    assert t[f"{base}.gate_proj.weight"].dtype == torch.uint8
    assert tuple(t[f"{base}.gate_proj.weight"].shape) == (I, H // 2)
    assert t[f"{base}.gate_proj.weight_scale"].dtype == torch.float8_e4m3fn
    assert tuple(t[f"{base}.gate_proj.weight_scale"].shape) == (I, H // 16)
    assert t[f"{base}.down_proj.weight_scale_2"].dtype == torch.float32
    assert t[f"{base}.down_proj.weight_scale_2"].shape == ()
    assert f"{base}.up_proj.input_scale" in t


def test_fill_store_rows_equal_pack_row(tmp_path, rng):
    ex = _experts(rng, layers=(2, 5), n_exp=3)
    d = write_checkpoint(tmp_path / "c", ex, shards=2)
    layout = RowLayout(H, I)
    store = HostStore(2, 3, layout.row_bytes, pinned=False)
    modelopt.fill_store_from_checkpoint(store, d, layout, progress=False)
    for li, layer in enumerate((2, 5)):
        for e in range(3):
            np.testing.assert_array_equal(store.row(li, e), pack_row(layout, *ex[(layer, e)]).numpy())
    # an explicit layer map, in another order
    store2 = HostStore(1, 2, layout.row_bytes, pinned=False)
    modelopt.fill_store_from_checkpoint(store2, d, layout, layers=[5], progress=False)
    np.testing.assert_array_equal(store2.row(0, 1), pack_row(layout, *ex[(5, 1)]).numpy())


def test_fill_store_mixtral_spelling(tmp_path, rng):
    ex = _experts(rng, layers=(0,), n_exp=2)
    d = write_checkpoint(tmp_path / "c", ex, spelling="w",
                         prefix="model.layers.{layer}.block_sparse_moe.experts", config="config_json")
    layout = RowLayout(H, I)
    store = HostStore(1, 2, layout.row_bytes, pinned=False)
    modelopt.fill_store_from_checkpoint(store, d, layout, progress=False)
    np.testing.assert_array_equal(store.row(0, 1), pack_row(layout, *ex[(0, 1)]).numpy())


# --- guards ------------------------------------------------------------------------------------------
def _rewrite(d, fn):
    """Load the single-file checkpoint, let fn edit the dict, save it back."""
    f = d / "model.safetensors"
    t = load_file(str(f))
    fn(t)
    save_file({k: v.contiguous() for k, v in t.items()}, str(f))


BASE = "model.layers.0.mlp.experts.1"


def test_missing_tensor_is_named_with_similar_names(tmp_path, rng):
    d = write_checkpoint(tmp_path / "c", _experts(rng, layers=(0,), n_exp=2))
    _rewrite(d, lambda t: t.pop(f"{BASE}.up_proj.weight_scale"))
    with pytest.raises(CheckpointError, match=rf"tensor '{BASE}.up_proj.weight_scale' is not in "
                                              rf"the checkpoint.*similar names present: \[.*"
                                              rf"up_proj.weight_scale_2"):
        read_expert(d, 0, 1)
    with pytest.raises(CheckpointError, match=r"expert 'model.layers.0.mlp.experts.7': neither "
                                              r".*gate_proj.weight nor .*w1.weight"):
        read_expert(d, 0, 7)


@pytest.mark.parametrize("edit,match", [
    (lambda t: t.__setitem__(f"{BASE}.gate_proj.weight", t[f"{BASE}.gate_proj.weight"][:, :-8]),
     r"gate_proj.weight_scale: shape \[48, 5\], expected \[48, 4\]"),
    (lambda t: t.__setitem__(f"{BASE}.gate_proj.weight_scale", t[f"{BASE}.gate_proj.weight_scale"][:-1]),
     r"gate_proj.weight_scale: shape \[47, 5\], expected \[48, 5\]"),
    (lambda t: t.__setitem__(f"{BASE}.down_proj.weight", torch.zeros(80, 16, dtype=torch.uint8)),
     r"down_proj.weight_scale: shape \[80, 3\], expected \[80, 2\]"),
    (lambda t: (t.__setitem__(f"{BASE}.down_proj.weight", torch.zeros(64, 24, dtype=torch.uint8)),
                t.__setitem__(f"{BASE}.down_proj.weight_scale",
                              torch.zeros(64, 3, dtype=torch.uint8).view(torch.float8_e4m3fn))),
     r"down_proj.weight: weight is \[64, 48\].*expected \[80, 48\]"),
    (lambda t: t.__setitem__(f"{BASE}.up_proj.weight", torch.zeros(48, 40, dtype=torch.bfloat16)),
     r"up_proj.weight: dtype torch.bfloat16, expected torch.uint8.*excluded from quantization"),
    (lambda t: t.__setitem__(f"{BASE}.up_proj.weight_scale",
                             t[f"{BASE}.up_proj.weight_scale"].view(torch.uint8)),
     r"up_proj.weight_scale: dtype torch.uint8, expected torch.float8_e4m3fn"),
    (lambda t: t.__setitem__(f"{BASE}.up_proj.weight_scale_2", torch.ones(2)),
     r"up_proj.weight_scale_2: shape \[2\], expected a scalar"),
    (lambda t: t.__setitem__(f"{BASE}.up_proj.weight_scale_2", torch.ones((), dtype=torch.float16)),
     r"up_proj.weight_scale_2: dtype torch.float16, expected torch.float32"),
])
def test_wrong_shapes_and_dtypes_are_named(tmp_path, rng, edit, match):
    d = write_checkpoint(tmp_path / "c", _experts(rng, layers=(0,), n_exp=2))
    _rewrite(d, edit)
    with pytest.raises(CheckpointError, match=match):
        read_expert(d, 0, 1)
    read_expert(d, 0, 0)                                              # the other expert still reads


def test_scale_2_of_shape_one_and_extra_tensors_are_fine(tmp_path, rng):
    ex = _experts(rng, layers=(0,), n_exp=1)
    d = write_checkpoint(tmp_path / "c", ex, input_scale=False,
                         extra={"lm_head.weight": torch.zeros(4, 4),
                                "model.layers.0.mlp.gate.weight": torch.zeros(1, 80)})
    _rewrite(d, lambda t: t.__setitem__("model.layers.0.mlp.experts.0.up_proj.weight_scale_2",
                                        t["model.layers.0.mlp.experts.0.up_proj.weight_scale_2"].reshape(1)))
    assert all(_same(a, b) for a, b in zip(ex[(0, 0)], read_expert(d, 0, 0)))


@pytest.mark.parametrize("algo,config,match", [
    ("FP8", "hf_quant", r"hf_quant_config.json: quant_algo is 'FP8'; cupool reads ModelOpt NVFP4"),
    ("INT4_AWQ", "config_json", r"config.json quantization_config: quant_algo is 'INT4_AWQ'"),
])
def test_other_quant_algo_is_refused(tmp_path, rng, algo, config, match):
    d = write_checkpoint(tmp_path / "c", _experts(rng, layers=(0,), n_exp=1), quant_algo=algo,
                         config=config)
    with pytest.raises(CheckpointError, match=match):
        read_expert(d, 0, 0)
    got = read_expert(d, 0, 0, require_config=False)                   # tensors themselves are fine
    assert got[0].shape == (I, H)


def test_config_variants(tmp_path, rng):
    d = write_checkpoint(tmp_path / "c", _experts(rng, layers=(0,), n_exp=1), group_size=32)
    with pytest.raises(CheckpointError, match="group_size is 32; NVFP4 block scales cover 16"):
        read_quant_config(d)
    (d / "hf_quant_config.json").unlink()
    with pytest.raises(CheckpointError, match="no quantization config"):
        read_quant_config(d)
    (d / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}}))
    with pytest.raises(CheckpointError, match="quant_method is 'compressed-tensors', not a ModelOpt"):
        read_quant_config(d)
    (d / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "modelopt", "quant_algo": "nvfp4", "weights": {"group_size": 16}}}))
    assert read_quant_config(d)["quant_algo"] == "NVFP4"
    (d / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "modelopt", "quant_algo": "W4A16_NVFP4",
        "config_groups": {"group_0": {"weights": {"num_bits": 4, "group_size": 16}}}}}))
    assert read_quant_config(d)["quant_algo"] == "W4A16_NVFP4"
    (d / "hf_quant_config.json").write_text(json.dumps({"quantization": {
        "quant_algo": "MIXED_PRECISION", "quantized_layers": {
            "model.layers.0.mlp.experts.0.gate_proj": {"quant_algo": "NVFP4"},
            "model.layers.0.self_attn.q_proj": {"quant_algo": "FP8"}}}}))
    assert read_quant_config(d)["quant_algo"] == "MIXED_PRECISION"     # experts are all NVFP4
    (d / "hf_quant_config.json").write_text(json.dumps({"quantization": {
        "quant_algo": "MIXED_PRECISION", "quantized_layers": {
            "model.layers.0.mlp.experts.0.gate_proj": {"quant_algo": "FP8"}}}}))
    with pytest.raises(CheckpointError, match=r"MIXED_PRECISION with expert modules in \['FP8'\]"):
        read_quant_config(d)
    (d / "hf_quant_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not readable JSON"):
        read_quant_config(d)


def test_checkpoint_file_guards(tmp_path, rng):
    with pytest.raises(CheckpointError, match="no such file or directory"):
        read_expert(tmp_path / "nope", 0, 0)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "NVFP4"}}))
    with pytest.raises(CheckpointError, match=r"no \*.safetensors files"):
        read_expert(empty, 0, 0)
    d = write_checkpoint(tmp_path / "c", _experts(rng, layers=(0,), n_exp=1), shards=2)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"is in 'model-00002-of-00002.safetensors', which "
                                              r"does not exist"):
        read_expert(d, 0, 0)
    bad = write_checkpoint(tmp_path / "n", {}, extra={"model.embed_tokens.weight": torch.zeros(2, 2)})
    with pytest.raises(CheckpointError, match="no per-expert weights named like"):
        read_expert(bad, 0, 0)
    with pytest.raises(ValueError, match=r"prefix must contain '\{layer\}'"):
        read_expert(bad, 0, 0, prefix="model.layers.0.mlp.experts")


def test_ambiguous_prefix_and_store_mismatches(tmp_path, rng):
    ex = _experts(rng, layers=(0,), n_exp=1)
    d = write_checkpoint(tmp_path / "c", ex)
    extra = write_checkpoint(tmp_path / "x", ex, prefix="model.mtp.layers.{layer}.mlp.experts",
                             config="none")
    t = {**load_file(str(d / "model.safetensors")), **load_file(str(extra / "model.safetensors"))}
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="several name patterns"):
        read_expert(d, 0, 0)
    assert all(_same(a, b) for a, b in
               zip(ex[(0, 0)], read_expert(d, 0, 0, prefix="model.layers.{layer}.mlp.experts")))
    layout = RowLayout(H, I)
    with pytest.raises(ValueError, match="store rows are 112 bytes but the layout's rows are"):
        modelopt.fill_store_from_checkpoint(HostStore(1, 1, 112, pinned=False), d, layout)
    store = HostStore(2, 1, layout.row_bytes, pinned=False)
    with pytest.raises(CheckpointError, match=r"1 MoE layers under .* but the store has 2"):
        modelopt.fill_store_from_checkpoint(store, d, layout,
                                            prefix="model.layers.{layer}.mlp.experts", progress=False)
    with pytest.raises(CheckpointError, match=r"weight is \[48, 80\].*expected \[32, 64\]"):
        small = RowLayout(64, 32)
        modelopt.fill_store_from_checkpoint(HostStore(1, 1, small.row_bytes, pinned=False), d, small,
                                            prefix="model.layers.{layer}.mlp.experts",
                                            progress=False)
    with pytest.raises(CheckpointError, match="experts.1"):
        modelopt.fill_store_from_checkpoint(HostStore(1, 2, layout.row_bytes, pinned=False), d,
                                            layout, prefix="model.layers.{layer}.mlp.experts",
                                            progress=False)


def test_writer_argument_guards(tmp_path):
    with pytest.raises(ValueError, match="spelling must be one of"):
        write_checkpoint(tmp_path, {}, spelling="gate")
    with pytest.raises(ValueError, match="config must be"):
        write_checkpoint(tmp_path, {}, config="yaml")
    with pytest.raises(ValueError, match="shards must be >= 1"):
        write_checkpoint(tmp_path, {}, shards=0)
