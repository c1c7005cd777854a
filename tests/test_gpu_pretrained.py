"""cupool.from_pretrained on tiny checkpoints the test writes (GPU): bf16 as save_pretrained
writes it, and the same experts as ModelOpt NVFP4 and compressed-tensors NVFP4; gpt-oss as
openai publishes it (MXFP4 experts with biases). The loaded pool must equal the same weights
built in memory and wrapped: the same store rows byte for byte, the same logits bit for bit, the
same greedy tokens through the engine."""

from __future__ import annotations

import json
import logging
import re
import shutil

import pytest
import torch
from test_gpu_wrap import model_for
from tiny_models import FAMILIES

import cupool
from cupool.layout import pack_rows
from cupool.nvfp4 import NVFP4Tensor, quantize

pytestmark = pytest.mark.gpu

_EXPERT = re.compile(r"^(.*\.experts\.\d+\.(?:gate_proj|up_proj|down_proj|w1|w2|w3))\.weight$")


def convert(src, dst, fmt: str):
    """A copy of the bf16 checkpoint `src` whose routed experts are NVFP4 in `fmt`'s names
    ("modelopt": weight / weight_scale / weight_scale_2 / input_scale and hf_quant_config.json;
    "compressed-tensors": weight_packed / weight_scale / weight_global_scale (1 / ModelOpt's) /
    input_global_scale and config.json's quantization_config)."""
    from safetensors.torch import load_file, save_file
    dst.mkdir()
    out = {}
    for name, t in load_file(src / "model.safetensors").items():
        m = _EXPERT.match(name)
        if m is None:
            out[name] = t
            continue
        q, base = quantize(t.float()), m.group(1)
        if fmt == "modelopt":
            out.update({f"{base}.weight": q.packed, f"{base}.weight_scale": q.block_scale,
                        f"{base}.weight_scale_2": q.global_scale.reshape(()),
                        f"{base}.input_scale": torch.ones(())})
        else:
            out.update({f"{base}.weight_packed": q.packed, f"{base}.weight_scale": q.block_scale,
                        f"{base}.weight_global_scale": (1.0 / q.global_scale).reshape(1),
                        f"{base}.input_global_scale": torch.ones(1)})
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    for f in ("config.json", "generation_config.json"):
        shutil.copy(src / f, dst / f)
    if fmt == "modelopt":
        (dst / "hf_quant_config.json").write_text(json.dumps({
            "producer": {"name": "modelopt"},
            "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                             "exclude_modules": ["lm_head"]}}))
    else:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "format": "nvfp4-pack-quantized",
                                          "weights": {"num_bits": 4, "type": "float",
                                                      "strategy": "tensor_group",
                                                      "group_size": 16}}},
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*mlp.gate$"]}
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def assert_same_buffers(twin, model):
    """Every buffer of `twin` (as transformers loads the directory) equals the loaded model's."""
    mine = dict(model.named_buffers())
    for name, buf in twin.named_buffers():
        want = mine[name]
        assert buf.dtype == want.dtype and torch.equal(buf.cuda(), want), name


def assert_same_pool(loaded, twin, pool) -> torch.Tensor:
    """The loaded pool's store rows equal the twin pool's, and so do the logits of one prompt
    (returned)."""
    a, b = loaded.pool.store, pool.store
    assert (a.num_layers, a.num_experts, a.row_bytes) == (b.num_layers, b.num_experts, b.row_bytes)
    for layer in range(a.num_layers):
        for e in range(a.num_experts):
            assert (a.row(layer, e) == b.row(layer, e)).all(), (layer, e)
    ids = torch.randint(3, 60, (1, 11), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    with torch.inference_mode():
        got = loaded.model(input_ids=ids).logits
        assert torch.equal(got, twin(input_ids=ids).logits)
    return got


def assert_same_tokens(loaded, twin, pool) -> None:
    """The engine generates the same tokens through both pools; the loaded one is clean."""
    prompts = [[5, 9, 13], [7, 3, 21, 30, 2]]
    params = cupool.SamplingParams(max_tokens=10)
    got = cupool.Engine(loaded.model, loaded.pool, max_batch=2, max_len=32,
                        eos_token_id=[]).generate(prompts, params)
    want = cupool.Engine(twin, pool, max_batch=2, max_len=32, eos_token_id=[]).generate(prompts, params)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert loaded.pool.errors() == [] and loaded.pool.verify() > 0


@pytest.mark.parametrize("fmt", ["bf16", "modelopt", "compressed-tensors"])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_from_pretrained_equals_the_model_built_in_memory(tmp_path, family, fmt):
    model = model_for(family, seed=31)
    _, (_, E, K, _, _) = FAMILIES[family]
    src = tmp_path / "bf16"
    model.save_pretrained(src)
    d = src if fmt == "bf16" else convert(src, tmp_path / fmt, fmt)
    loaded = cupool.from_pretrained(d, rows=max(K, E // 2), max_decode_tokens=2, progress=False)
    assert loaded.tokenizer is None and loaded.model.generation_config is not None
    # the twin as transformers loads the same directory (model.to(bf16) above also cast the
    # float32 rotary table to bf16; transformers' loading keeps it float32, as from_pretrained)
    from transformers import AutoModelForCausalLM
    twin = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    assert_same_buffers(twin, loaded.model)
    if fmt == "bf16":
        pool = cupool.wrap(twin, rows=max(K, E // 2), max_decode_tokens=2, progress=False)
    else:
        ckpt_layers = cupool.open_checkpoint(d).moe_layers
        layout = loaded.pool.layout

        def rows(layer):
            trios = cupool.read_experts(d, ckpt_layers[layer])
            stack = [NVFP4Tensor(torch.stack([t[j].packed for t in trios]),
                                 torch.stack([t[j].block_scale for t in trios]),
                                 torch.stack([t[j].global_scale for t in trios]))
                     for j in range(3)]
            return pack_rows(layout, *stack)
        pool = cupool.wrap(twin, rows=max(K, E // 2), max_decode_tokens=2, expert_rows=rows,
                           progress=False)
    assert_same_pool(loaded, twin, pool)
    assert_same_tokens(loaded, twin, pool)


def test_from_pretrained_quantize_attention(tmp_path, caplog):
    """quantize_attention=True: the bf16 checkpoint's attention projections quantized to NVFP4
    on the GPU, the same bits `dense_nvfp4.quantize_linears` gives the model transformers loads
    (so the same logits, bit for bit), and the engine's fused step reading them packed (the same
    greedy tokens as that twin's)."""
    from test_fused_step import SHAPES

    from cupool import dense_nvfp4
    model = model_for("qwen3_moe", seed=33, **SHAPES["qwen3_moe"])     # attention it fuses
    _, (_, E, K, _, _) = FAMILIES["qwen3_moe"]
    model.save_pretrained(tmp_path / "m")
    loaded = cupool.from_pretrained(tmp_path / "m", rows=max(K, E // 2), max_decode_tokens=2,
                                    progress=False, quantize_attention=True)
    from transformers import AutoModelForCausalLM
    twin = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.bfloat16).eval().cuda()
    count = dense_nvfp4.quantize_linears(twin)
    assert count == 4 * twin.config.num_hidden_layers
    mine = {n: m for n, m in loaded.model.named_modules() if dense_nvfp4.of(m) is not None}
    theirs = {n: m for n, m in twin.named_modules() if dense_nvfp4.of(m) is not None}
    assert sorted(mine) == sorted(theirs) and len(mine) == count
    for name, lin in mine.items():
        a, b = dense_nvfp4.of(lin), dense_nvfp4.of(theirs[name])
        assert a.device.type == "cuda" and torch.equal(a.strips, b.strips), name
        assert a.global_scale == b.global_scale and torch.equal(lin.weight, theirs[name].weight)
    pool = cupool.wrap(twin, rows=max(K, E // 2), max_decode_tokens=2, progress=False)
    assert_same_pool(loaded, twin, pool)
    prompts, params = [[5, 9, 13], [7, 3, 21, 30, 2]], cupool.SamplingParams(max_tokens=10)
    with caplog.at_level(logging.INFO, logger="cupool"):      # says why a step is not fused
        engines = [cupool.Engine(m, p, max_batch=2, max_len=32, eos_token_id=[])
                   for m, p in ((loaded.model, loaded.pool), (twin, pool))]
    L = twin.config.num_hidden_layers
    for e in engines:
        assert f"NVFP4 weights for qkv in {L} layers, o in {L} layers" in e.step_kind, \
            (e.step_kind, caplog.text)
    got, want = (e.generate(prompts, params) for e in engines)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert loaded.pool.errors() == [] and loaded.pool.verify() > 0


def test_the_input_embedding_goes_to_host_memory_where_the_bank_is_partial(tmp_path):
    """A bank that holds every expert keeps the embedding on the GPU; one that cannot puts it in
    pinned mapped host memory (a CUDA tensor over the mapping), from_pretrained and wrap alike,
    with the checkpoint's values. The engine's greedy tokens (its step reads the rows over PCIe,
    inside the graph) equal those of the same pool with the embedding put back on the GPU."""
    from transformers import AutoModelForCausalLM
    model = model_for("qwen3_moe", seed=34)
    _, (_, E, K, _, _) = FAMILIES["qwen3_moe"]
    model.save_pretrained(tmp_path / "m")
    want = model.get_input_embeddings().weight.detach().to(torch.bfloat16)
    for rows in (E, max(K, E // 2)):
        loaded = cupool.from_pretrained(tmp_path / "m", rows=rows, max_decode_tokens=2,
                                        progress=False)
        twin = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.bfloat16).eval()
        pool = cupool.wrap(twin, rows=rows, max_decode_tokens=2, progress=False)
        for m in (loaded.model, twin):
            w = m.get_input_embeddings().weight
            assert w.is_cuda and torch.equal(w.cpu(), want)
            assert getattr(w, "_cupool_host_table", False) == (rows < E), rows
        host = [(n, b) for n, b, where in loaded.pool.memory_parts() if where == "host"
                and n == "host tables"]
        assert host == ([("host tables", want.numel() * 2)] if rows < E else []), host
    # the last pair (a partial bank): the twin's embedding back in GPU memory
    emb = twin.get_input_embeddings()
    emb.weight = torch.nn.Parameter(want.cuda(), requires_grad=False)
    prompts, params = [[5, 9, 13], [7, 3, 21, 30, 2]], cupool.SamplingParams(max_tokens=8)
    got, ref = (cupool.Engine(m, p, max_batch=2, max_len=32, eos_token_id=[]).generate(
        prompts, params) for m, p in ((loaded.model, loaded.pool), (twin, pool)))
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]
    assert loaded.pool.errors() == [] and pool.errors() == []


def test_a_budget_too_small_fails_before_the_store_is_filled(tmp_path):
    model = model_for("qwen3_moe", seed=32)
    model.save_pretrained(tmp_path / "m")
    import gc
    free_before = torch.cuda.mem_get_info()[0]
    with pytest.raises(cupool.BudgetError, match="too small"):
        cupool.from_pretrained(tmp_path / "m", budget="64KiB", progress=False)
    gc.collect()
    torch.cuda.empty_cache()
    assert torch.cuda.mem_get_info()[0] >= free_before - (64 << 20)


def test_from_pretrained_gpt_oss_mxfp4(tmp_path):
    """gpt-oss MXFP4 (experts converted to NVFP4 at load, exactly for these exponents; biases in
    the rows; the clamped SwiGLU): the loaded pool equals the model built in memory and wrapped
    with rows made from the checkpoint's experts, bit for bit; and transformers' own forward of
    the same model (its experts the dequantized MXFP4 values, exact in bf16) within
    test_gpu_wrap's NVFP4 tolerance."""
    import numpy as np
    from checkpoint_fixtures import (
        gpt_oss_model_mxfp4,
        hf_gpt_oss,
        mxfp4_copy,
        set_gpt_oss_experts,
    )
    from test_gpu_wrap import LOGIT_TOL, rel
    from transformers import AutoModelForCausalLM

    model = hf_gpt_oss(seed=33)                    # H = 64, I = 96, E = 8, K = 4, 2 layers
    mx = gpt_oss_model_mxfp4(np.random.default_rng(33), model, exponents=(118, 123))
    set_gpt_oss_experts(model, mx)
    src = tmp_path / "bf16"
    model.save_pretrained(src)
    d = mxfp4_copy(src, tmp_path / "mxfp4", mx)
    E, K = model.config.num_local_experts, model.config.num_experts_per_tok
    rows = max(K, E // 2)
    loaded = cupool.from_pretrained(d, rows=rows, max_decode_tokens=2, progress=False)
    layout = loaded.pool.layout
    assert layout.bias and loaded.pool.gemm.activation.kind == "swiglu_clamp"
    twin = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    assert_same_buffers(twin, loaded.model)
    ckpt = cupool.open_checkpoint(d)

    def expert_rows(layer):
        ex = ckpt.experts(ckpt.moe_layers[layer])
        return pack_rows(layout, *ex.nvfp4(), bias=ex.bias)
    try:
        pool = cupool.wrap(twin, rows=rows, max_decode_tokens=2, expert_rows=expert_rows,
                           progress=False)
        assert ckpt.conversion.lossy == [] and ckpt.conversion.blocks > 0
    finally:
        ckpt.close()
    got = assert_same_pool(loaded, twin, pool)
    ids = torch.randint(3, 60, (1, 11), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    # transformers' own experts on the dequantized weights: NVFP4 holds them exactly, so what
    # differs is the GEMM's rounding (test_gpu_wrap's tolerance)
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).cuda().eval()
    ref.config._experts_implementation_internal = "eager"
    with torch.inference_mode():
        want = ref(input_ids=ids).logits
    assert rel(got, want) <= LOGIT_TOL, rel(got, want)
    assert_same_tokens(loaded, twin, pool)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4", "mixed"])
def test_from_pretrained_nemotron_h(tmp_path, fmt):
    """Nemotron-H as NVIDIA publishes it (checkpoint_fixtures.nemotron_release: `backbone.*`
    names, experts without a gate, the sigmoid router with its score-correction bias, shared
    experts, Mamba-2 and attention layers; bf16, ModelOpt NVFP4 and MIXED_PRECISION with a latent
    MoE): the loaded pool equals the twin (transformers' from_pretrained of the same weights)
    wrapped with rows made from the checkpoint's experts, row for row and logit for logit; the
    engine gives both the same tokens; and transformers' own forward with the dequantized experts
    agrees within test_gpu_wrap's NVFP4 tolerance."""
    import numpy as np
    from checkpoint_fixtures import nemotron_release
    from test_gpu_wrap import LOGIT_TOL, rel
    from transformers import AutoModelForCausalLM

    from cupool.nvfp4 import dequantize
    d, twin_dir, _, q = nemotron_release(tmp_path, np.random.default_rng(41), fmt,
                                         latent=32 if fmt == "mixed" else None,
                                         layer_list=fmt == "mixed")
    rows = 4                                            # E = 8, top-2
    loaded = cupool.from_pretrained(d, rows=rows, max_decode_tokens=2, progress=False)
    layout = loaded.pool.layout
    assert not layout.gated and loaded.pool.gemm.activation.kind == "relu2"
    twin = AutoModelForCausalLM.from_pretrained(twin_dir, dtype=torch.bfloat16).eval()
    assert_same_buffers(twin, loaded.model)
    ckpt = cupool.open_checkpoint(d)

    def expert_rows(layer):
        return pack_rows(layout, *ckpt.experts(ckpt.moe_layers[layer]).nvfp4())
    try:
        pool = cupool.wrap(twin, rows=rows, max_decode_tokens=2, expert_rows=expert_rows,
                           progress=False)
        moe_layers = ckpt.moe_layers
    finally:
        ckpt.close()
    got = assert_same_pool(loaded, twin, pool)
    # transformers' experts on the rows' dequantized weights (rounded to bf16, the model's dtype)
    ref = AutoModelForCausalLM.from_pretrained(twin_dir, dtype=torch.bfloat16).eval()
    ref.config._experts_implementation_internal = "eager"
    with torch.no_grad():
        for layer in moe_layers:
            ex = ref.model.layers[layer].mixer.experts
            ex.up_proj.copy_(dequantize(q[layer][1], torch.float32))
            ex.down_proj.copy_(dequantize(q[layer][2], torch.float32))
    ref = ref.cuda()
    ids = torch.randint(3, 60, (1, 11), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(1))   # assert_same_pool's
    with torch.inference_mode():
        want = ref(input_ids=ids).logits
    assert rel(got, want) <= LOGIT_TOL, rel(got, want)
    assert_same_tokens(loaded, twin, pool)
