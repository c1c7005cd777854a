"""`cupool.from_pretrained(path)`: a checkpoint directory (or hub id) to a wrapped model, without
ever holding every expert in bf16.

Shape legend (ARCHITECTURE.md): L MoE layers · E experts · K top-k · H hidden · I intermediate.

Steps, each failing with a clear error before the next one takes memory:
1. `path` resolves to a directory: a local one, or a hub id fetched the way transformers does
   (its cache, then a download through huggingface_hub; config, safetensors and tokenizer files).
2. The checkpoint is opened from config.json and the safetensors headers (`cupool.checkpoints`:
   format detection, every routed expert's names, dtypes and shapes checked; nothing read).
3. The transformers model is built from config.json on the meta device (no memory; the
   quantization config dropped, so no transformers quantizer — ModelOpt, compressed-tensors,
   MXFP4 — takes part; the tensors transformers' from_pretrained keeps in float32, such as the
   sigmoid routers' e_score_correction_bias, float32 as it loads them), its MoE layers found
   (`cupool.adapters`) and compared with the checkpoint's (layer numbers, E, H, I, biases,
   whether the experts have a gate), and the checkpoint's dense tensors are matched
   to the model's parameters by name and shape (`dense_plan`; expert biases are expert tensors,
   attention sinks and router biases dense ones).
4. Rows per layer are decided from the budget (`cupool.wrap.plan`) with the dense part counted
   from the headers (the packed NVFP4 attention projections of step 6 included): a budget that
   cannot work fails here.
5. The pinned host store is filled from the checkpoint layer by layer, a window of experts at a
   time (bf16/fp16 experts quantized on the GPU; NVFP4 experts laid out as stored; MXFP4 experts
   converted to NVFP4, exactly where the format allows, `cupool.checkpoints.mxfp4`; biases into
   the rows), with a progress bar: host memory is the store plus one window.
6. The dense part (attention, norms, routers, embeddings, shared experts, dense MLP layers) is
   materialised on the GPU and loaded tensor by tensor from the checkpoint (NVFP4/FP8 dense
   weights dequantized to `dtype`; NVFP4 attention projections also kept packed beside their
   Linears, `cupool.dense_nvfp4`, for the fused decode step's GEMVs; with
   `quantize_attention=True` the other attention projections are quantized to NVFP4 here, on
   the GPU, and kept the same way); non-persistent buffers (rotary tables) are computed as
   transformers computes them; tied embeddings are tied; generation_config.json is read.
7. The bank is built and the layers are swapped (`cupool.wrap.assemble`).
"""

from __future__ import annotations

import fnmatch
import logging
import re
from pathlib import Path
from typing import NamedTuple

import torch

from cupool import dense_nvfp4, nvfp4
from cupool.adapters import MoELayerSpec, find_moe_layers
from cupool.checkpoints import Checkpoint, CheckpointError, fill_store, open_checkpoint
from cupool.hosttable import (as_table_parameter, host_table_bytes, host_table_names,
                              input_embedding_name, mapped_empty, ties_embeddings)
from cupool.layout import dense_strips_bytes
from cupool.store import fmt_bytes
from cupool.wrap import assemble, plan

log = logging.getLogger("cupool")

# files of a model directory worth fetching from a hub (weights, configs, tokenizers)
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "tokenizer*"]
# files that make a directory's tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# checkpoint tensors a model may lack without harm (older exports' per-layer rotary tables)
_IGNORED = (re.compile(r"(^|\.)rotary_emb\.inv_freq$"),)
_LAYER_NO = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class QuantizeError(ValueError):
    """An attention projection `quantize_attention` cannot quantize (the message names it)."""


class Loaded(NamedTuple):
    """What `from_pretrained` returns."""
    model: torch.nn.Module
    pool: object
    tokenizer: object | None


def resolve(path) -> Path:
    """A local directory as it is; otherwise a hub id, from the hub cache or downloaded."""
    p = Path(path).expanduser()
    if p.is_dir():
        return p
    if p.exists():
        raise CheckpointError(f"{p} is a file; give the checkpoint's directory")
    text = str(path)
    if text.count("/") != 1 or text.startswith((".", "/", "~")):
        raise CheckpointError(f"{p}: no such directory (and not a hub id like 'org/name')")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise CheckpointError(f"{text!r} is not a local directory, and huggingface_hub (needed to "
                              f"fetch it from the hub) is not installed") from None
    try:
        return Path(snapshot_download(repo_id=text, allow_patterns=HUB_PATTERNS))
    except Exception as e:  # noqa: BLE001 (network, auth, missing repo: all end the same way)
        raise CheckpointError(f"{text!r} is not a local directory and could not be fetched from "
                              f"the hub: {type(e).__name__}: {e}") from None


def skeleton(directory: Path, dtype: torch.dtype):
    """(config, model on the meta device): the transformers model config.json describes, with
    the quantization config dropped (cupool reads the quantized tensors itself)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    try:
        config = AutoConfig.from_pretrained(directory)
    except Exception as e:  # noqa: BLE001 (unknown model type, malformed JSON, ...)
        raise CheckpointError(f"{directory / 'config.json'}: transformers cannot build a config "
                              f"from it ({type(e).__name__}: {e})") from None
    for attr in ("quantization_config",):
        if hasattr(config, attr):
            delattr(config, attr)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{directory}: transformers cannot build a causal LM from its "
                              f"config.json (model_type {getattr(config, 'model_type', '?')!r}: "
                              f"{type(e).__name__}: {e})") from None
    keep_fp32(model, dtype)
    return config, model


def _fp32_patterns(model, dtype: torch.dtype) -> list[str]:
    """The names transformers' from_pretrained keeps in float32 when it loads `model` in `dtype`:
    `_keep_in_fp32_modules_strict` for bf16 and fp16, `_keep_in_fp32_modules` for fp16 too."""
    out = []
    if dtype in (torch.bfloat16, torch.float16):
        out += list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    if dtype == torch.float16:
        out += list(getattr(model, "_keep_in_fp32_modules", None) or [])
    return out


def keep_fp32(model, dtype: torch.dtype) -> None:
    """Give the parameters and buffers transformers' from_pretrained keeps in float32 (e.g. the
    routers' e_score_correction_bias of DeepSeek-V3-style sigmoid routers, Nemotron-H's among
    them) float32 storage on the meta skeleton, as from_pretrained loads them: transformers >=
    5.24 builds them so, 5.17's from_config does not. A name is kept when a pattern (fnmatch
    where it has a wildcard) occurs in it."""
    pats = _fp32_patterns(model, dtype)
    if not pats:
        return

    def kept(name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, f"*{p}*") if "*" in p else p in name for p in pats)

    for mname, module in model.named_modules():
        for store in (module._parameters, module._buffers):
            for attr, t in store.items():
                full = f"{mname}.{attr}" if mname else attr
                if t is None or not t.is_floating_point() or t.dtype == torch.float32 \
                        or not kept(full):
                    continue
                new = torch.empty_like(t, dtype=torch.float32)
                store[attr] = (torch.nn.Parameter(new, requires_grad=t.requires_grad)
                               if isinstance(t, torch.nn.Parameter) else new)


def match_layers(specs: list[MoELayerSpec], ckpt: Checkpoint) -> list[int]:
    """The checkpoint layer of each MoE layer of the model; CheckpointError where they differ."""
    if len(specs) != len(ckpt.moe_layers):
        raise CheckpointError(f"the model built from config.json has {len(specs)} MoE layers, the "
                              f"checkpoint {ckpt.path} has routed experts in {len(ckpt.moe_layers)} "
                              f"layers ({ckpt.moe_layers[:12]})")
    layers = []
    for spec, got in zip(specs, ckpt.moe_layers):
        m = _LAYER_NO.search(spec.name)
        want = int(m.group(1)) if m else got
        if want != got:
            raise CheckpointError(f"MoE layer {spec.index} of the model is {spec.name} (layer "
                                  f"{want}) but the checkpoint's is layer {got}")
        have = (spec.num_experts, spec.hidden, spec.intermediate)
        ck = (ckpt.num_experts, ckpt.hidden, ckpt.intermediate)
        if have != ck:
            raise CheckpointError(f"{spec.name}: the model has E, H, I = {have}, the checkpoint "
                                  f"{ckpt.path} {ck}")
        if spec.bias != ckpt.has_bias:
            model_has = "have" if spec.bias else "have no"
            ckpt_has = "have them" if ckpt.has_bias else "have none"
            raise CheckpointError(f"{spec.name}: the model's experts {model_has} biases "
                                  f"(bias={spec.bias}), the checkpoint's ({ckpt.path}) {ckpt_has} "
                                  f"(has_bias={ckpt.has_bias})")
        if spec.gated != ckpt.gated:
            model_has = "have a" if spec.gated else "have no"
            ckpt_has = "have one" if ckpt.gated else "have none"
            raise CheckpointError(f"{spec.name}: the model's experts {model_has} gate projection "
                                  f"(gated={spec.gated}), the checkpoint's ({ckpt.path}) "
                                  f"{ckpt_has} (gated={ckpt.gated})")
        layers.append(got)
    return layers


def _conversion_rules(model) -> list:
    """transformers' checkpoint conversion rules for the model's family ([] where the installed
    release has none, or its API moved)."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        return list(get_checkpoint_conversion_mapping(model.config.model_type) or [])
    except Exception:  # noqa: BLE001 (an API that moved: the built-in rules still apply)
        return []


def _is(rule, cls_name: str) -> bool:
    return any(c.__name__ == cls_name for c in type(rule).__mro__)


def _patterns(rule, attr: str) -> list:
    v = getattr(rule, attr, None)
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _renames(model) -> list[tuple[re.Pattern, str]]:
    """Checkpoint-name rewrites for the model's family: transformers' own renames (prefix changes
    included, e.g. Qwen3.5's `model.language_model.` → `model.`), applied in order."""
    out = []
    for rule in _conversion_rules(model):
        if not _is(rule, "WeightRenaming"):
            continue
        src, dst = _patterns(rule, "source_patterns"), _patterns(rule, "target_patterns")
        if len(dst) == 1 and all(isinstance(x, str) for x in src) and isinstance(dst[0], str):
            out += [(re.compile(x), dst[0]) for x in src]
    return out


# Mixtral-style names, tried when the family's own renames leave a name without a place.
_BUILTIN_RENAMES = ((re.compile(r"\.block_sparse_moe\."), ".mlp."),)


class _Concat(NamedTuple):
    """Checkpoint tensors concatenated along dim 0 into one model tensor (transformers'
    Concatenate(dim=0) converters): numbered shards (`shard_*`, qwen4_exp's n-gram tables) or
    named parts in a fixed order (Kimi's q/k/v short convolutions)."""
    sources: tuple[re.Pattern, ...]       # one numbered pattern (group "k"), or one per part
    target: str

    def match(self, name: str):
        """(target name, order key) for a source tensor name, or None."""
        for i, pat in enumerate(self.sources):
            m = pat.search(name)
            if m:
                k = int(m.group("k")) if "k" in pat.groupindex else i
                return name[:m.start()] + self.target + name[m.end():], k
        return None


def _concats(model) -> list[_Concat]:
    out = []
    for rule in _conversion_rules(model):
        ops = getattr(rule, "operations", None) or []
        if not _is(rule, "WeightConverter") or len(ops) != 1 or \
                type(ops[0]).__name__ != "Concatenate" or getattr(ops[0], "dim", None) != 0:
            continue
        src, dst = _patterns(rule, "source_patterns"), _patterns(rule, "target_patterns")
        if len(dst) != 1 or not all(isinstance(x, str) for x in src + dst):
            continue
        if len(src) == 1 and src[0].count("*") == 1:
            a, b = (re.escape(x) for x in src[0].split("*"))
            pats = (re.compile(rf"(?:^|(?<=\.)){a}(?P<k>\d+){b}$"),)
        elif "*" not in "".join(src):
            pats = tuple(re.compile(rf"(?:^|(?<=\.)){re.escape(x)}$") for x in src)
        else:
            continue
        out.append(_Concat(pats, dst[0]))
    return out


def _candidates(name: str, renames) -> list[str]:
    """The model names a checkpoint name may stand for, most specific first."""
    cand = name
    for pat, rep in renames:
        cand = pat.sub(rep, cand)
    out = [name, cand]
    for pat, rep in _BUILTIN_RENAMES:
        out.append(pat.sub(rep, cand))
    return out


def dense_plan(model, specs: list[MoELayerSpec], ckpt: Checkpoint) -> dict[str, str | list[str]]:
    """{model parameter/buffer name: checkpoint tensor name, or the names of the parts it is
    concatenated from along dim 0} for every dense tensor, checked by name and shape from the
    headers alone. CheckpointError lists what the model needs and the checkpoint lacks (tied
    output embeddings excepted), or a shape that differs; tensors the model has no place for
    are logged and skipped."""
    expert_ids = {id(p) for s in specs for p in s.module.parameters()}
    targets = {n: t for n, t in model.state_dict(keep_vars=True).items() if id(t) not in expert_ids}
    tied = set()                       # names of the one tensor tied input/output embeddings share
    if ties_embeddings(model.config) and model.get_output_embeddings() is not None:
        out_w = model.get_output_embeddings().weight
        tied = {n for n, t in targets.items() if t is out_w}
    renames, concats = _renames(model), _concats(model)
    mapping, unused = {}, []
    parts: dict[str, list[tuple[int, str]]] = {}
    for name in ckpt.dense_names():
        found = None
        for cand in _candidates(name, renames):
            if cand in targets:
                found = cand
                break
            hit = next((h for c in concats if (h := c.match(cand)) and h[0] in targets), None)
            if hit is not None:
                parts.setdefault(hit[0], []).append((hit[1], name))
                found = ""
                break
        if found is None:
            if not any(p.search(name) for p in _IGNORED):
                unused.append(name)
            continue
        if not found:
            continue
        shape = tuple(ckpt.dense_shape(name))
        want = tuple(targets[found].shape)
        if shape != want:
            raise CheckpointError(f"checkpoint tensor {name!r} has shape {list(shape)}, the model's "
                                  f"{found} is {list(want)}")
        mapping[found] = name
    for target, got in parts.items():
        names = [n for _, n in sorted(got)]
        shapes = [tuple(ckpt.dense_shape(n)) for n in names]
        want = tuple(targets[target].shape)
        joined = (sum(s[0] for s in shapes), *shapes[0][1:]) if shapes else ()
        if any(s[1:] != shapes[0][1:] for s in shapes) or joined != want:
            raise CheckpointError(f"the {len(names)} parts of {target} ({names[0]} ...) have "
                                  f"shapes {[list(s) for s in shapes[:4]]}: joined along dim 0 "
                                  f"they make {list(joined)}, the model's is {list(want)}")
        mapping[target] = names
    loaded_tied = any(n in mapping for n in tied)
    missing = [n for n in targets if n not in mapping and not (n in tied and loaded_tied)]
    if missing:
        raise CheckpointError(f"the checkpoint {ckpt.path} lacks {len(missing)} tensor(s) the model "
                              f"needs, e.g. {missing[:6]}; unmatched checkpoint tensors: "
                              f"{unused[:6] or 'none'}")
    if unused:
        log.warning("cupool: %d checkpoint tensors have no place in the model and are skipped, "
                    "e.g. %s", len(unused), unused[:4])
    return mapping


def _fresh_buffers(model, device) -> None:
    """Compute the non-persistent buffers (rotary tables, ...) as their modules do when built: a
    module holding one is built again from its config on the CPU (where transformers builds a
    model, so the tables are the same bits) and its buffers moved to `device`; a module without
    a config gets transformers' own initialisation of it."""
    for parent_name, parent in model.named_modules():
        names = [n for n in getattr(parent, "_non_persistent_buffers_set", ())
                 if parent._buffers.get(n) is not None]
        if not names:
            continue
        fresh = None
        if getattr(parent, "config", None) is not None:
            try:
                with torch.device("cpu"):
                    fresh = type(parent)(config=parent.config)
            except TypeError:
                fresh = None
        if fresh is not None:
            for n in names:
                parent._buffers[n] = fresh._buffers[n].to(device)
            continue
        try:
            model._init_weights(parent)
        except Exception as e:  # noqa: BLE001
            raise RuntimeError(f"cannot compute the non-persistent buffers {names} of "
                               f"{parent_name or type(model).__name__} "
                               f"({type(parent).__name__}): {e}") from None


def packed_projections(model, mapping: dict[str, str | list[str]],
                       ckpt: Checkpoint) -> dict[str, str]:
    """{model weight name: checkpoint tensor name} of the dense weights `load_dense` keeps packed
    as NVFP4 beside their Linears (`cupool.dense_nvfp4`): the `.weight` of an nn.Linear whose
    attribute name is one of `dense_nvfp4.ATTENTION_PROJECTIONS`, loaded from one checkpoint
    tensor (not from concatenated parts) of dense_kind "nvfp4". Other NVFP4 Linears are
    dequantized only. From the headers and the model's modules alone (meta ones too)."""
    out = {}
    for target, name in mapping.items():
        if not isinstance(name, str) or not dense_nvfp4.is_projection_weight(target):
            continue
        if ckpt.dense_kind(name) == "nvfp4" and \
                isinstance(model.get_submodule(target.rpartition(".")[0]), torch.nn.Linear):
            out[target] = name
    return out


def quantized_projections(model, mapping: dict[str, str | list[str]],
                          packed: dict[str, str]) -> dict[str, tuple[int, int]]:
    """{model weight name: (N, K)} of the attention projections `load_dense` quantizes to NVFP4
    where it is asked to (`quantize_attention`): the `.weight` of every nn.Linear whose attribute
    name is one of `dense_nvfp4.ATTENTION_PROJECTIONS`, in attention modules that have all four
    (`dense_nvfp4.step_projection_weights`: the ones the fused step reads), except `packed`
    (`packed_projections`: those the checkpoint already holds as NVFP4, kept as written).
    QuantizeError naming the first whose K is not a multiple of 16 (NVFP4's block). From the
    model's modules alone (meta ones too)."""
    out = {}
    for target in dense_nvfp4.step_projection_weights(mapping):
        if target in packed:
            continue
        linear = model.get_submodule(target.rpartition(".")[0])
        if not isinstance(linear, torch.nn.Linear):
            continue
        n, k = linear.weight.shape
        if (why := dense_nvfp4.quantize_shape_error(target, n, k)) is not None:
            raise QuantizeError(f"quantize_attention: {why}")
        out[target] = (n, k)
    return out


def dense_gpu_bytes(model, mapping: dict[str, str | list[str]], ckpt: Checkpoint,
                    dtype: torch.dtype, quantize_attention: bool = False) -> int:
    """GPU bytes `load_dense` will take on a CUDA device: every dense tensor in `dtype`
    (`Checkpoint.dense_bytes`), less the host tables kept in pinned host memory, plus the packed
    NVFP4 forms of `packed_projections` (`Checkpoint.dense_nvfp4_bytes`, about 0.28 of their
    bf16 weights' bytes, held beside them) and, with `quantize_attention`, those of
    `quantized_projections`. No data read."""
    packed = packed_projections(model, mapping, ckpt)
    quantized = quantized_projections(model, mapping, packed) if quantize_attention else {}
    return (ckpt.dense_bytes(dtype) - host_table_bytes(model, dtype)
            + ckpt.dense_nvfp4_bytes(packed.values())
            + sum(dense_strips_bytes(n, k) for n, k in quantized.values()))


def embedding_for_host(model, mapping: dict[str, str | list[str]], device) -> str | None:
    """The input embedding's weight name where `load_dense` may keep it in host memory (a CUDA
    device, read from the checkpoint, untied, not a host table already:
    `cupool.hosttable.input_embedding_name`), else None. Whether it does is the plan's
    (`cupool.budget.rows_and_host`: only where the bank cannot hold every expert)."""
    if torch.device(device).type != "cuda":
        return None
    name = input_embedding_name(model)
    if name is None or name not in mapping or name in host_table_names(model):
        return None
    return name


@torch.no_grad()
def load_dense(model, mapping: dict[str, str | list[str]], ckpt: Checkpoint, device,
               quantize_attention: bool = False, host_also=()) -> None:
    """Materialise the model's dense part on `device` (the released experts hold no memory) and
    fill it from the checkpoint, one tensor (or one part) at a time. The weights of
    `packed_projections` are read once as NVFP4 and attached (`dense_nvfp4.attach`: the Linear's
    weight dequantized to its dtype, the same values `Checkpoint.dense_tensor` gives, and the
    packed form beside it on `device`). With `quantize_attention`, each weight of
    `quantized_projections` is then quantized on `device` (`cupool.nvfp4.quantize`, one global
    scale a matrix) and attached the same way, so that prefill (transformers' forward) and the
    fused step's GEMVs compute with the same quantized weights; QuantizeError naming a weight
    that is not finite. On a CUDA device the host tables (`cupool.hosttable`: qwen4_exp's n-gram
    embeddings) and the weights named in `host_also` (the input embedding where the plan put it
    in host memory) go to pinned, mapped host memory instead, filled part by part."""
    device = torch.device(device)
    host = list(dict.fromkeys([*host_table_names(model), *host_also])) \
        if device.type == "cuda" else []
    held = {n: _hold_off(model, n) for n in host}
    packed = packed_projections(model, mapping, ckpt)
    quantized = quantized_projections(model, mapping, packed) if quantize_attention else {}
    model.to_empty(device=device)
    targets = model.state_dict(keep_vars=True)
    for target, name in mapping.items():
        if target in held:
            continue
        if target in packed:
            linear = model.get_submodule(target.rpartition(".")[0])
            dense_nvfp4.attach(linear, ckpt.dense_nvfp4(name), name)
            continue
        t = targets[target]
        _fill(t, ckpt, name)
    for target in quantized:
        linear = model.get_submodule(target.rpartition(".")[0])
        try:
            q = nvfp4.quantize(linear.weight.detach())
        except ValueError as e:
            raise QuantizeError(f"quantize_attention: {target}: {e}") from None
        dense_nvfp4.attach(linear, q, target)
    if packed or quantized:
        log.info("cupool: %s kept packed beside their weights (%s on %s%s)",
                 dense_nvfp4.describe(model), fmt_bytes(dense_nvfp4.packed_bytes(model)), device,
                 f"; {len(quantized)} of them quantized at load" if quantized else "")
    for target, (shape, dtype) in held.items():
        cpu, gpu = mapped_empty(shape, dtype, device)
        _fill(cpu, ckpt, mapping[target])
        owner, _, attr = target.rpartition(".")
        setattr(model.get_submodule(owner), attr, as_table_parameter(gpu))
    if ties_embeddings(model.config):
        out, inp = model.get_output_embeddings(), model.get_input_embeddings()
        if out is not None and inp is not None:
            out.weight = inp.weight
    _fresh_buffers(model, device)
    model.eval()


def _hold_off(model, name: str) -> tuple[tuple, torch.dtype]:
    """Swap parameter `name` for an empty one (so `to_empty` allocates nothing for it); returns
    its shape and dtype."""
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    p = getattr(module, attr)
    setattr(module, attr, torch.nn.Parameter(torch.empty(0, dtype=p.dtype, device="meta"),
                                             requires_grad=False))
    return tuple(p.shape), p.dtype


def _fill(t: torch.Tensor, ckpt: Checkpoint, name: str | list[str]) -> None:
    """Copy a checkpoint tensor, or its parts one after another along dim 0, into t."""
    dtype = t.dtype if t.is_floating_point() else torch.float32
    if isinstance(name, str):
        t.copy_(ckpt.dense_tensor(name, dtype))
        return
    row = 0
    for part in name:
        x = ckpt.dense_tensor(part, dtype)
        t[row:row + x.shape[0]].copy_(x)
        row += x.shape[0]


def _tokenizer(directory: Path):
    if not any((directory / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(directory)
    except Exception as e:  # noqa: BLE001 (a broken tokenizer should not stop the model loading)
        log.warning("cupool: the tokenizer in %s could not be loaded (%s: %s); continuing "
                    "without one", directory, type(e).__name__, e)
        return None


def _generation_config(model, directory: Path) -> None:
    if (directory / "generation_config.json").is_file():
        from transformers import GenerationConfig
        model.generation_config = GenerationConfig.from_pretrained(directory)


def from_pretrained(path, budget=None, rows=None, dtype=torch.bfloat16, device="cuda", *,
                    include_mtp: bool = False, window: int | None = None, progress: bool = True,
                    load_tokenizer: bool = True, quantize_attention: bool = False,
                    **wrap_kwargs) -> Loaded:
    """Load a checkpoint directory (or hub id) into a model whose experts are served by a pool.

    Args:
        path: a local checkpoint directory, or a hub id ("org/name").
        budget, rows: the GPU memory for the whole model, or bank rows per layer (see `wrap`;
            with fewer rows than experts the input embedding goes to host memory there too).
        dtype: of the dense part and the activations (torch.bfloat16 or torch.float16).
        device: the CUDA device.
        include_mtp: also read multi-token-prediction layers (their experts join the store).
        window: experts quantized or laid out at a time (default: ≤ 1 GiB of temporaries).
        load_tokenizer: load the directory's tokenizer when it has one.
        quantize_attention: quantize the attention projections (q/k/v/o_proj) the checkpoint
            holds in bf16/fp16/FP8 to NVFP4 at load, for the fused decode step's GEMVs (a
            quarter of the bytes a token reads for them: docs/PERFORMANCE.md, "Serving with
            NVFP4 attention projections"). It changes the model's outputs, as any quantization
            does: prefill and decode both compute with the quantized weights. Projections the
            checkpoint holds as NVFP4 are kept as written either way.
        **wrap_kwargs: kv_reserve, max_decode_tokens, max_prefill_tokens, scratch_rows,
            scratch_buffers, route_fn (as `cupool.wrap`). kv_reserve: bytes, or what an engine
            of B slots of max_len positions allocates beside the model,
            `cupool.kvcache.engine_reserve(config, max_batch=B, max_len=..., resume_points=...)`
            (its KV cache, the slots' recurrent states and the resume points; `cupool serve`
            passes that).
    Returns `Loaded(model, pool, tokenizer)` (tokenizer None where the directory has none).
    """
    if dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"dtype must be torch.bfloat16 or torch.float16, got {dtype}")
    if not isinstance(quantize_attention, bool):
        raise TypeError(f"quantize_attention must be a bool, got {quantize_attention!r}")
    unknown = set(wrap_kwargs) - {"kv_reserve", "max_decode_tokens", "max_prefill_tokens",
                                  "scratch_rows", "scratch_buffers", "route_fn"}
    if unknown:
        raise TypeError(f"from_pretrained got unexpected keyword arguments {sorted(unknown)}")
    route_fn = wrap_kwargs.pop("route_fn", None)
    directory = resolve(path)
    ckpt = open_checkpoint(directory, include_mtp=include_mtp)
    try:
        config, model = skeleton(directory, dtype)
        specs = find_moe_layers(model)
        layers = match_layers(specs, ckpt)
        mapping = dense_plan(model, specs, ckpt)
        for spec in specs:
            spec.release()
        on_gpu = dense_gpu_bytes(model, mapping, ckpt, dtype, quantize_attention)
        embedding = embedding_for_host(model, mapping, device)
        optional = 0 if embedding is None else \
            model.get_parameter(embedding).numel() * dtype.itemsize
        p = plan(specs, pending_bytes=on_gpu, rows=rows, budget=budget,
                 device=device, host_optional_bytes=optional, **wrap_kwargs)

        def fill(store):
            fill_store(store, ckpt, p.layout, layers=layers, device=p.device, window=window,
                       progress=progress)

        def dense():
            load_dense(model, mapping, ckpt, p.device, quantize_attention,
                       host_also=[embedding] if p.embedding_on_host else [])
            for spec in specs:
                spec.device = p.device

        pool = assemble(model, specs, p, fill, route_fn=route_fn, before_bank=dense)
    except BaseException:
        ckpt.close()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
        raise
    ckpt.close()
    _generation_config(model, directory)
    tokenizer = _tokenizer(directory) if load_tokenizer else None
    return Loaded(model, pool, tokenizer)
