"""cupool.checkpoints.index: the tensor index from safetensors headers, windowed reads, and every
file-level error (missing shard, tensor absent from its shard, truncated or garbage files), with
nothing left open after one."""

import json

import numpy as np
import pytest
import torch
from checkpoint_fixtures import (
    float_experts,
    open_files_under,
    put_float_experts,
    qwen3_moe,
    save,
)
from safetensors.torch import load_file, save_file

from cupool.checkpoints import CheckpointError, TensorIndex, open_checkpoint


def _tensors(rng):
    return {"a.weight": torch.from_numpy(rng.standard_normal((6, 32)).astype(np.float32)),
            "b.bf16": torch.from_numpy(rng.standard_normal((5, 4, 8)).astype(np.float32)).to(
                torch.bfloat16),
            "c.scale": torch.tensor(0.25),
            "d.codes": torch.arange(48, dtype=torch.uint8).reshape(3, 16),
            "e.fp8": torch.linspace(-2, 2, 32).reshape(2, 16).to(torch.float8_e4m3fn),
            "f.empty": torch.zeros(0, 7)}


@pytest.mark.parametrize("shards", [1, 3])
def test_index_lists_every_tensor_from_headers(tmp_path, rng, shards):
    t = _tensors(rng)
    d = save(tmp_path / "c", t, {"model_type": "x"}, shards=shards, dtype=torch.float32)
    with TensorIndex(d) as ix:
        assert sorted(ix.names()) == sorted(t) and len(ix) == len(t)
        for name, v in t.items():
            info = ix[name]
            assert info.dtype == v.dtype and info.shape == tuple(v.shape)
            assert info.nbytes == v.numel() * v.element_size()
            got = ix.read(name)
            assert got.dtype == v.dtype and got.reshape(-1).view(torch.uint8).equal(
                v.reshape(-1).view(torch.uint8))
        assert (ix["a.weight"].file.name == "model.safetensors") == (shards == 1)
        # dim-0 windows, into fresh tensors and into a given one
        b = t["b.bf16"]
        assert torch.equal(ix.read("b.bf16", 1, 4), b[1:4])
        assert torch.equal(ix.read("b.bf16", 4), b[4:])
        out = torch.empty(2, 4, 8, dtype=torch.bfloat16)
        assert ix.read("b.bf16", 2, 4, out=out) is out and torch.equal(out, b[2:4])
        big = torch.empty(5, 4, 8, dtype=torch.bfloat16)
        ix.read("b.bf16", 0, 2, out=big[3:5])                  # a contiguous view is fine
        assert torch.equal(big[3:5], b[0:2])
        assert ix.read("f.empty").shape == (0, 7)
        assert ix.read("c.scale").shape == ()


def test_read_guards(tmp_path, rng):
    d = save(tmp_path / "c", _tensors(rng), {}, dtype=torch.float32)
    with TensorIndex(d) as ix:
        with pytest.raises(CheckpointError, match=r"b.bf16 \(bfloat16 \[5, 4, 8\].*slice \[3, 6\) "
                                                  r"is outside dim 0 of size 5"):
            ix.read("b.bf16", 3, 6)
        with pytest.raises(CheckpointError, match=r"c.scale .*a scalar has no dim 0"):
            ix.read("c.scale", 0, 1)
        with pytest.raises(CheckpointError, match=r"out must be a contiguous CPU torch.bfloat16 tensor "
                                                  r"\[2, 4, 8\], got torch.float32"):
            ix.read("b.bf16", 0, 2, out=torch.empty(2, 4, 8))
        with pytest.raises(CheckpointError, match=r"out must be a contiguous"):
            ix.read("b.bf16", 0, 2, out=torch.empty(2, 8, 4, dtype=torch.bfloat16).transpose(1, 2))
        with pytest.raises(CheckpointError, match=r"tensor 'a.weigth' is not in the checkpoint .*"
                                                  r"similar names present: \['a.weight'\]"):
            ix["a.weigth"]


def test_index_file_errors(tmp_path, rng):
    t = _tensors(rng)
    with pytest.raises(CheckpointError, match=r"no model.safetensors, no "
                                              r"model.safetensors.index.json"):
        (tmp_path / "empty").mkdir()
        TensorIndex(tmp_path / "empty")
    # a shard named by the index is missing
    d = save(tmp_path / "s", t, {}, shards=3, dtype=torch.float32)
    (d / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"shard 'model-00002-of-00003.safetensors' \(holding "
                                              r"2 tensors, e.g. 'c.scale'\) does not exist"):
        TensorIndex(d)
    # a tensor the index lists is not in its file
    d = save(tmp_path / "m", t, {}, shards=2, dtype=torch.float32)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    idx["weight_map"]["ghost.weight"] = "model-00001-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match=r"puts tensor 'ghost.weight' in "
                                              r"'model-00001-of-00002.safetensors', but that file "
                                              r"has no such tensor \(3 tensors in it\)"):
        TensorIndex(d)
    # an index that is not JSON / has no weight_map
    (d / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"index.json: not readable JSON"):
        TensorIndex(d)
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match=r"no 'weight_map' object"):
        TensorIndex(d)


def test_truncated_and_garbage_files(tmp_path, rng):
    t = _tensors(rng)
    d = save(tmp_path / "t", t, {}, dtype=torch.float32)
    f = d / "model.safetensors"
    raw = f.read_bytes()
    f.write_bytes(raw[:-10])                                   # an interrupted download
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor '\w+.\w+' ends at byte "
                                              rf"{len(raw)} but the file has {len(raw) - 10} "
                                              r"bytes: the file is truncated"):
        TensorIndex(d)
    f.write_bytes(raw[:5])
    with pytest.raises(CheckpointError, match=r"5 bytes, too short for a safetensors file"):
        TensorIndex(d)
    f.write_bytes((10**6).to_bytes(8, "little") + b"{}")
    with pytest.raises(CheckpointError, match=r"header length 1000000 bytes but the file has 10 "
                                              r"bytes"):
        TensorIndex(d)
    f.write_bytes((4).to_bytes(8, "little") + b"\xff\xfe{]")
    with pytest.raises(CheckpointError, match=r"the safetensors header is not JSON"):
        TensorIndex(d)
    hdr = json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}).encode()
    f.write_bytes(len(hdr).to_bytes(8, "little") + hdr + bytes(16))
    with pytest.raises(CheckpointError, match=r"tensor 'x' is F32 \[4\] \(16 bytes\) but its "
                                              r"data_offsets span 12 bytes"):
        TensorIndex(d)
    # truncated after indexing: the read names the tensor
    save_file(t, str(f))
    with TensorIndex(d) as ix:
        f.write_bytes(f.read_bytes()[:-4])
        last = max((n for n in ix.names() if ix[n].nbytes),
                   key=lambda n: ix[n].offset + ix[n].nbytes)
        with pytest.raises(CheckpointError, match=rf"{last} .*the file ended after"):
            ix.read(last)


def test_no_index_several_files(tmp_path, rng):
    d = tmp_path / "multi"
    d.mkdir()
    save_file({"a": torch.zeros(2)}, str(d / "one.safetensors"))
    save_file({"b": torch.ones(3)}, str(d / "two.safetensors"))
    with TensorIndex(d) as ix:
        assert sorted(ix.names()) == ["a", "b"] and torch.equal(ix.read("b"), torch.ones(3))
    save_file({"a": torch.ones(2)}, str(d / "three.safetensors"))
    with pytest.raises(CheckpointError, match=r"tensor 'a' is in both one.safetensors and "
                                              r"three.safetensors"):
        TensorIndex(d)
    save_file({"c": torch.ones(1)}, str(d / "model.safetensors"))      # model.safetensors wins
    with TensorIndex(d) as ix:
        assert ix.names() == ["c"]


def test_unlisted_tensors_of_a_shard_are_not_part_of_the_checkpoint(tmp_path, rng):
    t = _tensors(rng)
    d = save(tmp_path / "u", t, {}, shards=2, dtype=torch.float32)
    f = d / "model-00001-of-00002.safetensors"
    extra = load_file(str(f))
    extra["stray"] = torch.zeros(3)
    save_file(extra, str(f))
    with TensorIndex(d) as ix:
        assert "stray" not in ix and set(ix.names()) == set(t)


def _experts_ckpt(tmp_path, rng, **kw):
    a = qwen3_moe(rng)
    t = dict(a.dense)
    put_float_experts(t, a, float_experts(rng, a))
    return save(tmp_path / "ck", t, a.config, **kw), a


def test_open_reads_headers_only(tmp_path, rng, monkeypatch):
    d, _ = _experts_ckpt(tmp_path, rng, shards=2)

    def no_reads(*a, **k):
        raise AssertionError("open/plan read tensor data")
    monkeypatch.setattr(TensorIndex, "read", no_reads)
    with open_checkpoint(d) as ck:
        ck.dense_names()
        ck.dense_bytes()
        ck.expert_sizes()
        assert ck.moe_layers == [0, 1]


def test_nothing_stays_open_after_errors(tmp_path, rng):
    d, _a = _experts_ckpt(tmp_path, rng, shards=2)
    with open_checkpoint(d) as ck:
        ck.experts(0, 0, 2)
        ck.dense_tensor("model.embed_tokens.weight")
        assert open_files_under(d)                       # files stay open while in use
    assert open_files_under(d) == []                     # ... and close with the checkpoint
    # an error raised after the index was built (a config that disagrees) closes the files
    cfg = json.loads((d / "config.json").read_text())
    cfg["moe_intermediate_size"] = 48
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"moe_intermediate_size = 48, but the experts of "
                                              r"layer 0 .* have I = 32"):
        open_checkpoint(d)
    assert open_files_under(d) == []
    # an error in the middle of a read leaves the checkpoint usable and closable
    cfg["moe_intermediate_size"] = 32
    (d / "config.json").write_text(json.dumps(cfg))
    ck = open_checkpoint(d)
    with pytest.raises(CheckpointError):
        ck.experts(0, 3, 9)
    ck.close()
    assert open_files_under(d) == []
