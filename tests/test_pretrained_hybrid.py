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

LOADABLE = sorted(HYBRID_FAMILIES)


def _save(tmp_path, family, **kw):
    model = hybrid_model(family, seed=11, dtype=torch.bfloat16, **kw)
    d = tmp_path / family
    model.save_pretrained(d)
    return model, d


def _trios(ex):
    """(gate, up, down) of each expert of an `Experts` window (gate None where it has none)."""
    return [(None if ex.gate is None else ex.gate[e], ex.up[e], ex.down[e]) for e in range(ex.n)]


def _logits_equal(ref, d):
    ckpt, model, specs, layers = _load_cpu(d)
    try:
        for spec, layer in zip(specs, layers):
            ex = ckpt.experts(layer)
            spec.restore(_trios(ex), "cpu", ex.bias)
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


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen4_exp"])
def test_multimodal_release_loads_as_the_text_model(tmp_path, family):
    """Qwen3.5 and Qwen3.8-Flash-Next are released as image-text models (config model_type
    qwen3_5_moe / qwen4_exp with a text_config; tensors under model.language_model.* beside
    model.visual.*): from_pretrained builds the causal LM of the text config, takes the language
    model's tensors through transformers' prefix change and leaves the vision tower out; the
    logits on text equal the saved model's."""
    from transformers import AutoConfig, AutoModelForImageTextToText
    kw, _ = HYBRID_FAMILIES[f"{family}_text"]
    text = {**kw, "initializer_range": 0.15}
    if family == "qwen4_exp":
        text["split_ngram_parts"] = 2
    cfg = AutoConfig.for_model(family, text_config=text, vision_config=dict(
        depth=1, hidden_size=32, num_heads=2, out_hidden_size=48, intermediate_size=32))
    torch.manual_seed(4)
    ref = AutoModelForImageTextToText.from_config(cfg, dtype=torch.bfloat16).eval()
    d = tmp_path / family
    ref.save_pretrained(d)
    from safetensors import safe_open
    names = []
    for f in d.glob("*.safetensors"):
        with safe_open(str(f), "pt") as s:
            names += list(s.keys())
    assert any(n.startswith("model.language_model.layers.") for n in names)
    assert any(n.startswith("model.visual.") for n in names)
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


def _experts_to_nvfp4(d, fmt):
    """Rewrite a saved checkpoint's per-expert float weights as the NVFP4 releases store them:
    ModelOpt (weight uint8, weight_scale e4m3, weight_scale_2, input_scale; hf_quant_config.json)
    or compressed-tensors (weight_packed, weight_scale, weight_global_scale = 1 / global,
    input_global_scale; quantization_config), the rest left in bf16 as those releases leave a
    hybrid's linear attention. Returns {expert weight name: dequantized float32 weight}."""
    import json
    import re

    from checkpoint_fixtures import ct_config_json, modelopt_hf_quant
    from safetensors.torch import load_file, save_file

    from cupool import nvfp4
    pat = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
    deq = {}
    for f in sorted(d.glob("*.safetensors")):
        t = load_file(str(f))
        out = {}
        for n, w in t.items():
            if not pat.search(n):
                out[n] = w
                continue
            q = nvfp4.quantize(w.float()[None])
            g = q.global_scale
            if fmt != "modelopt":        # stored 1 / global; a reader gives back 1 / (1 / global)
                q = nvfp4.NVFP4Tensor(q.packed, q.block_scale,
                                      torch.ones_like(g) / (torch.ones_like(g) / g))
            deq[n] = nvfp4.dequantize(q, torch.float32)[0]
            base = n[:-len(".weight")]
            if fmt == "modelopt":
                out[f"{base}.weight"] = q.packed[0]
                out[f"{base}.weight_scale"] = q.block_scale[0]
                out[f"{base}.weight_scale_2"] = q.global_scale[0].reshape(())
                out[f"{base}.input_scale"] = torch.tensor(0.01)
            else:
                out[f"{base}.weight_packed"] = q.packed[0]
                out[f"{base}.weight_scale"] = q.block_scale[0]
                out[f"{base}.weight_global_scale"] = torch.ones(1) / g[0].reshape(1)
                out[f"{base}.input_global_scale"] = torch.tensor([100.0])
        save_file(out, str(f), metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    if fmt == "modelopt":
        (d / "hf_quant_config.json").write_text(json.dumps(modelopt_hf_quant(
            exclude=["lm_head", "*linear_attn*", "*visual*", "*mlp.gate", "*shared_expert*"])))
    else:
        cfg = ct_config_json(cfg, ignore=["lm_head", "re:.*linear_attn.*", "re:.*visual.*",
                                          "re:.*mlp.gate$", "re:.*shared_expert.*",
                                          "re:.*self_attn.*"])
    (d / "config.json").write_text(json.dumps(cfg))
    return deq


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_nvfp4_releases_of_qwen3_5_load(tmp_path, fmt):
    """A Qwen3.5 image-text release with NVFP4 experts (ModelOpt or compressed-tensors names)
    and bf16 linear attention: the experts come back as stored (their dequantized values give
    the saved model's logits with the same dequantized experts)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from cupool import nvfp4
    kw, _ = HYBRID_FAMILIES["qwen3_5_moe_text"]
    cfg = AutoConfig.for_model("qwen3_5_moe", text_config={**kw, "initializer_range": 0.15},
                               vision_config=dict(depth=1, hidden_size=32, num_heads=2,
                                                  out_hidden_size=48, intermediate_size=32))
    torch.manual_seed(6)
    ref = AutoModelForImageTextToText.from_config(cfg, dtype=torch.bfloat16).eval()
    d = tmp_path / fmt
    ref.save_pretrained(d)
    deq = _experts_to_nvfp4(d, fmt)
    with torch.no_grad():                      # the reference with the same dequantized experts
        for m in ref.modules():
            if hasattr(m, "gate_up_proj") and isinstance(m.gate_up_proj, torch.Tensor):
                name = next(n for n, x in ref.named_modules() if x is m)
                layer = int(name.split(".layers.")[1].split(".")[0])
                pre = f"model.language_model.layers.{layer}.mlp.experts"
                for e in range(m.gate_up_proj.shape[0]):
                    g, u, dn = (deq[f"{pre}.{e}.{p}.weight"] for p in ("gate_proj", "up_proj",
                                                                        "down_proj"))
                    m.gate_up_proj[e].copy_(torch.cat([g, u]))
                    m.down_proj[e].copy_(dn)
    ckpt, model, specs, layers = _load_cpu(d)
    try:
        want_fmt = "modelopt-nvfp4" if fmt == "modelopt" else "compressed-tensors-nvfp4"
        assert ckpt.format == want_fmt
        for spec, layer in zip(specs, layers):
            ex = ckpt.experts(layer)
            mats = [nvfp4.dequantize(q, torch.float32) for q in (ex.gate, ex.up, ex.down)]
            spec.restore([(mats[0][e], mats[1][e], mats[2][e]) for e in range(ex.n)], "cpu",
                         None)
    finally:
        ckpt.close()
    ids = torch.randint(3, 60, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits,
                                   rtol=0, atol=0)


def test_placing_host_tables_needs_a_gpu_only_where_there_are_tables():
    from cupool.hosttable import place_host_tables
    assert place_host_tables(hybrid_model("qwen3_next"), "cuda") == 0      # nothing to place
    model = hybrid_model("qwen4_exp_text")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present (test_gpu_engine_hybrid.py places tables there)")
    with pytest.raises(RuntimeError, match="placing tables in mapped host memory"):
        place_host_tables(model, "cuda")


def test_memory_parts_count_host_tables_in_host_memory():
    """`Pool.memory_parts` lists host tables (CUDA tensors over pinned host memory on a GPU) as
    host memory, apart from the rest of the model: on the CPU, with stand-ins for the bank and
    the GEMM."""
    from types import SimpleNamespace

    from cupool.pool import Pool
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4))
    model[0].weight = hosttable.as_table_parameter(model[0].weight.detach())
    none = SimpleNamespace(memory_parts=lambda: [])
    parts = Pool.memory_parts(SimpleNamespace(bank=none, gemm=none, model=model))
    assert ("host tables", 10 * 4 * 4, "host") in parts
    assert ("rest of the model", 0, "gpu") in parts          # nothing of it is on a GPU here
    model[0].weight = torch.nn.Parameter(model[0].weight.detach())
    assert not [p for p in Pool.memory_parts(SimpleNamespace(bank=none, gemm=none, model=model))
                if p[0] == "host tables"]
