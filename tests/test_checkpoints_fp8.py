"""Block-scaled FP8 experts (cupool.checkpoints.fp8) as DeepSeek-V3, Kimi-K2 and Qwen's -FP8
releases publish them: float8_e4m3fn weights with 128×128 weight_scale_inv (float32, or bf16 as
Qwen3.5 writes it; partial blocks at the edges) or per-row weight_scale. Read dequantized,
quantized to NVFP4 a window at a time into rows equal to the reference quantizer's rows of the
dequantized values, each matrix's error against them tallied and logged; refusals name the
tensors."""

import logging
import math

import numpy as np
import pytest
import torch
from checkpoint_fixtures import (
    deepseek_v3,
    float_experts,
    fp8_config_json,
    put_fp8_experts,
    qwen3_moe,
    reference_nvfp4,
    save,
)
from safetensors.torch import load_file, save_file

from cupool import nvfp4
from cupool.checkpoints import CheckpointError, fill_store, open_checkpoint, read_experts
from cupool.checkpoints.fp8 import WARN_RELATIVE_ERROR, Fp8Tally, matrix_errors
from cupool.layout import RowLayout, pack_row
from cupool.store import HostStore

H, I = 160, 96       # 2 × 1 blocks of 128 (one partial each way); rows carry padding


def _fp8_ckpt(tmp_path, rng, arch=deepseek_v3, model_type=None, **put):
    a = arch(rng, E=5, H=H, I=I, **({"mtp": 0} if arch is deepseek_v3 else {}))
    if model_type:
        a.config["model_type"] = model_type
    ex = float_experts(rng, a, include_mtp=False)
    t = dict(a.dense)
    deq = put_fp8_experts(t, a, ex, **put)
    d = save(tmp_path / (model_type or a.config["model_type"]), t, fp8_config_json(a.config),
             shards=2)
    return d, a, deq


@pytest.mark.parametrize("publisher", ["deepseek_v3", "kimi_k2", "qwen3_moe-bf16-scales",
                                       "per-row"])
def test_fp8_experts_read_dequantized_and_fill_reference_rows(tmp_path, rng, publisher, caplog):
    if publisher == "kimi_k2":             # Kimi-K2: DeepSeek-V3's layout under its own type
        d, a, deq = _fp8_ckpt(tmp_path, rng, deepseek_v3, "kimi_k2")
    elif publisher.startswith("qwen"):
        d, a, deq = _fp8_ckpt(tmp_path, rng, qwen3_moe, scale_dtype=torch.bfloat16)
    elif publisher == "per-row":
        d, a, deq = _fp8_ckpt(tmp_path, rng, qwen3_moe, how="channel", scale_name="weight_scale")
    else:
        d, a, deq = _fp8_ckpt(tmp_path, rng)
    layers = a.moe_layers
    with open_checkpoint(d) as ck:
        assert ck.format == "fp8" and ck.moe_layers == layers
        assert (ck.num_experts, ck.hidden, ck.intermediate) == (5, H, I)
        ex = ck.experts(layers[0], 1, 4)
        for got, want in zip((ex.gate, ex.up, ex.down), deq[layers[0]]):
            assert got.dtype == torch.float32
            assert torch.equal(got, want[1:4])
        layout = RowLayout(H, I)
        store = HostStore(len(layers), 5, layout.row_bytes, pinned=False)
        with caplog.at_level(logging.INFO, logger="cupool"):
            fill_store(store, ck, layout, window=2, progress=False)
        want = reference_nvfp4(deq)
        for li, layer in enumerate(layers):
            g, u, dn = want[layer]
            for e in range(5):
                np.testing.assert_array_equal(store.row(li, e),
                                              pack_row(layout, g[e], u[e], dn[e]).numpy())
        tally = ck.conversion
        assert isinstance(tally, Fp8Tally) and tally.matrices == len(layers) * 5 * 3
        rel = [matrix_errors(q, w)[0] for layer in layers
               for q, w in zip(want[layer], deq[layer])]
        rel = torch.cat(rel)
        assert math.isclose(tally.mean_relative, float(rel.mean()), rel_tol=1e-9)
        assert math.isclose(tally.worst.relative, float(rel.max()), rel_tol=1e-12)
        assert 0.02 < tally.mean_relative < WARN_RELATIVE_ERROR     # NVFP4 of Gaussian rows
        assert tally.worst.tensor.startswith(a.expert_prefix.format(l=tally.worst.tensor
                                                                    .split(".")[2]))
    line = [r for r in caplog.records if "FP8 → NVFP4" in r.getMessage()]
    assert len(line) == 1 and line[0].levelno == logging.INFO
    assert f"{len(layers) * 15} matrices requantized" in line[0].getMessage()
    # read_experts (CPU, any format) gives the same NVFP4 experts
    got = read_experts(d, layers[-1], window=3)
    for e in range(5):
        for q, w in zip(got[e], want[layers[-1]]):
            assert torch.equal(q.packed, w.packed[e]) and torch.equal(q.global_scale,
                                                                      w.global_scale[e])


def test_matrix_errors_and_the_summary():
    w = torch.randn(3, 32, 64, generator=torch.Generator().manual_seed(0))
    w[2] = 0                                                    # a zero matrix: error 0
    q = nvfp4.quantize(w)
    rel, mx = matrix_errors(q, w)
    deq = nvfp4.dequantize(q, torch.float32)
    for i in range(3):
        diff = (deq[i] - w[i]).double()
        want = 0.0 if i == 2 else float(diff.norm() / w[i].double().norm())
        assert math.isclose(float(rel[i]), want, rel_tol=1e-9, abs_tol=0)
        assert float(mx[i]) == float(diff.abs().max())
    t = Fp8Tally()
    before = t.snapshot()
    t.record(["a.weight", "b.weight", "c.weight"], rel, mx)
    t.record(["bad.weight"], torch.tensor([0.4], dtype=torch.float64),
             torch.tensor([1.5], dtype=torch.float64))
    s = t.since(before).summary()
    assert s.startswith("FP8 → NVFP4: 4 matrices requantized; relative error (Frobenius) mean ")
    assert "max 0.4000 (bad.weight); max abs error 1.5 (bad.weight)" in s
    assert f"1 above {WARN_RELATIVE_ERROR}: bad.weight: 0.400" in s
    assert [m.tensor for m in t.lossy] == ["bad.weight"]
    assert Fp8Tally().summary() == "FP8 → NVFP4: 0 matrices requantized"


def _edit(d, fn):
    files = sorted(d.glob("*.safetensors"))
    for f in files:
        t = load_file(str(f))
        if fn(t):
            save_file({k: v.contiguous() for k, v in t.items()}, str(f),
                      metadata={"format": "pt"})


def test_fp8_refusals_name_the_tensors(tmp_path, rng):
    d, a, _ = _fp8_ckpt(tmp_path, rng)
    pre = a.expert_prefix.format(l=a.moe_layers[0])
    name = f"{pre}.2.down_proj.weight_scale_inv"

    def misfit(t):
        if name in t:
            t[name] = torch.ones(3, 3)
            return True
    _edit(d, misfit)
    with pytest.raises(CheckpointError, match=rf"{name} \(float32 \[3, 3\].*does not fit "
                                              rf".*down_proj.weight \(float8_e4m3fn \[{H}, {I}\]"):
        open_checkpoint(d)

    def nan(t):
        if name in t:
            t[name] = torch.full((2, 1), float("nan"))
            return True
    _edit(d, nan)
    with open_checkpoint(d) as ck:
        with pytest.raises(CheckpointError, match=rf"{pre}.2.down_proj.weight: dequantized value "
                                                  rf"nan at \[0, 0\] \(with {name}\)"):
            ck.experts(a.moe_layers[0], 2, 3)


def test_fused_fp8_experts_are_refused(tmp_path, rng):
    a = qwen3_moe(rng, E=4, H=H, I=I)
    ex = float_experts(rng, a, include_mtp=False)
    t = dict(a.dense)
    for layer, (g, u, dn) in ex.items():
        pre = a.prefix(layer)
        t[f"{pre}.gate_up_proj"] = torch.cat([g, u], 1).float().to(torch.float8_e4m3fn)
        t[f"{pre}.gate_up_proj_scale_inv"] = torch.ones(4, 2, 2)
        t[f"{pre}.down_proj"] = dn.float().to(torch.float8_e4m3fn)
        t[f"{pre}.down_proj_scale_inv"] = torch.ones(4, 2, 1)
    d = save(tmp_path / "fused", t, fp8_config_json(a.config))
    with pytest.raises(CheckpointError, match="fused FP8 experts .* are not supported; FP8 "
                                              "experts are read per expert"):
        open_checkpoint(d)


@pytest.mark.gpu
def test_gpu_fill_equals_cpu_and_tallies_the_same(tmp_path, rng):
    """The GPU quantizer (bit-identical to the reference) gives the CPU fill's rows and errors."""
    d, a, _ = _fp8_ckpt(tmp_path, rng)
    layout = RowLayout(H, I)
    tallies = []
    stores = []
    for dev in (None, "cuda"):
        store = HostStore(len(a.moe_layers), 5, layout.row_bytes, pinned=False)
        with open_checkpoint(d) as ck:
            fill_store(store, ck, layout, window=2, device=dev, progress=False)
            tallies.append(ck.conversion)
        stores.append(store)
    for li in range(len(a.moe_layers)):
        for e in range(5):
            np.testing.assert_array_equal(stores[1].row(li, e), stores[0].row(li, e))
    cpu, gpu = tallies
    assert gpu.matrices == cpu.matrices
    # the same NVFP4 values against the same float32 inputs; sums on another device
    assert math.isclose(gpu.mean_relative, cpu.mean_relative, rel_tol=1e-6)
    assert gpu.worst.tensor == cpu.worst.tensor
