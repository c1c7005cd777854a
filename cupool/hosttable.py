"""Tables that stay in host memory and are read by the GPU where they are: `qwen4_exp`'s n-gram
per-layer embeddings (tens of GiB; transformers lists them in the model's
`_no_placement_params`), whose decode step reads a few rows per token; and, where the bank cannot
hold every expert, the model's input embedding (`input_embedding_name`: 0.6–1.9 GB in the
families cupool serves, of which a decode step reads one row a token), whose GPU bytes then go to
bank rows (`cupool.wrap.plan`'s `host_optional_bytes`).

Shape legend: R rows of a table · D its row width · B tokens of a step · h n-gram heads.

A table is copied once into pinned host memory allocated with the mapped flag (as the expert
store's rows are, `cupool.store`) and handed to the model as a CUDA tensor whose address is the
mapping's device address: the embedding lookup of a decode step is then an ordinary CUDA gather
kernel that reads its B·h rows of D values over PCIe, inside the captured graph (the token ids it
hashes are on the GPU), with no copy engine and no host work. A table that does not fit in host
memory is refused when it is placed, with its size and the machine's.
"""

from __future__ import annotations

import fnmatch
import re

import torch
from torch import nn

from cupool import _cuda


_SHARD = re.compile(r"\.shard_\d+(?=\.)")


def is_table_name(name: str, patterns) -> bool:
    """Whether a parameter (or checkpoint tensor: a `.shard_<k>` part of one) is a host table:
    its name ends with one of `patterns` (transformers' `_no_placement_params`)."""
    name = _SHARD.sub("", name)
    return any(name == p or name.endswith("." + p) or fnmatch.fnmatch(name, "*." + p)
               for p in patterns)


def table_patterns(model_or_config) -> list[str]:
    """The `_no_placement_params` of a model (any submodule), or of the causal-LM class
    transformers builds for a config (no model built)."""
    if isinstance(model_or_config, nn.Module):
        out = set()
        for m in model_or_config.modules():
            out.update(getattr(m, "_no_placement_params", None) or ())
        return sorted(out)
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(model_or_config)]
    except (ImportError, KeyError):
        return []
    return sorted(getattr(cls, "_no_placement_params", None) or ())


def host_table_names(model: nn.Module) -> list[str]:
    """Names of the model's parameters that transformers keeps off the accelerator."""
    patterns = table_patterns(model)
    if not patterns:
        return []
    return [n for n, _ in model.named_parameters() if is_table_name(n, patterns)]


def ties_embeddings(config) -> bool:
    """Whether a model of `config` ties its output head to its input embedding (the text
    config's `tie_word_embeddings`, else the top config's; False where neither says)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)))


def input_embedding_name(model: nn.Module) -> str | None:
    """The parameter name of the model's input embedding matrix where it may live in host memory:
    the weight of an nn.Embedding (`get_input_embeddings()`) that the output head does not share
    (a tied matrix is read whole by every step's head) and that is not a host table already.
    None otherwise."""
    get = getattr(model, "get_input_embeddings", None)
    try:
        emb = get() if get is not None else None
    except NotImplementedError:
        return None
    if not isinstance(emb, nn.Embedding) or is_host_table(emb.weight):
        return None
    if ties_embeddings(getattr(model, "config", None)):
        return None
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if out is not None and getattr(out, "weight", None) is emb.weight:
        return None
    return next((n for n, p in model.named_parameters() if p is emb.weight), None)


def host_table_bytes(model: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes of the host tables (in `dtype`, default each parameter's own)."""
    params = dict(model.named_parameters())
    total = 0
    for n in host_table_names(model):
        p = params[n]
        total += p.numel() * (torch.empty((), dtype=dtype).element_size() if dtype
                              else p.element_size())
    return total


class _Owner:
    """Keeps the pinned allocation alive as long as a tensor over it exists; frees it after."""

    def __init__(self, chunk):
        self.chunk = chunk

    def __del__(self):
        self.chunk.free()


def mapped_empty(shape, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(host, gpu): one pinned, mapped allocation of `shape` and `dtype` seen as a CPU tensor
    (to fill it) and as a CUDA tensor on `device` (what kernels read, over PCIe). The allocation
    lives as long as `gpu` does (it holds the owner): keep `gpu`, use `host` only meanwhile."""
    from cupool.store import _PinnedChunk
    cp = _cuda.cupy()
    dev = _cuda.device_index(device)
    numel = 1
    for s in shape:
        numel *= int(s)
    nbytes = max(1, numel * torch.empty((), dtype=dtype).element_size())
    owner = _Owner(_PinnedChunk(nbytes, dev))
    host = torch.from_numpy(owner.chunk.array[:nbytes]).view(dtype).view(*shape)
    mem = cp.cuda.UnownedMemory(owner.chunk.device_address, nbytes, owner, dev)
    with cp.cuda.Device(dev):
        arr = cp.ndarray((nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, 0))
    gpu = torch.from_dlpack(arr)[:numel * host.element_size()].view(dtype).view(*shape)
    if gpu.device.type != "cuda":
        raise RuntimeError(f"the mapped table came back on {gpu.device}, not a CUDA device")
    return host, gpu


def place_host_tables(model: nn.Module, device, also=()) -> int:
    """Move each host table of `model` (wherever it is), and the parameters named in `also` (the
    input embedding, `input_embedding_name`), into pinned mapped host memory and make the
    parameter the CUDA view of it (tables already placed stay). Returns the bytes placed."""
    names = [n for n in dict.fromkeys([*host_table_names(model), *also])
             if not is_host_table(model.get_parameter(n))]
    if not names:
        return 0
    _cuda.require_gpu("placing tables in mapped host memory")
    total = 0
    for name in names:
        owner_name, _, attr = name.rpartition(".")
        module = model.get_submodule(owner_name)
        old = getattr(module, attr)
        host, gpu = mapped_empty(old.shape, old.dtype, device)
        host.copy_(old.detach())
        setattr(module, attr, as_table_parameter(gpu))
        total += host.numel() * host.element_size()
    return total


def is_host_table(t: torch.Tensor) -> bool:
    """Whether `t` is a placed table (`as_table_parameter`): a CUDA tensor over pinned host
    memory, which holds no GPU memory."""
    return bool(getattr(t, "_cupool_host_table", False))


def as_table_parameter(gpu: torch.Tensor) -> nn.Parameter:
    """The parameter a model holds for a placed table (marked, so it is not placed twice)."""
    p = nn.Parameter(gpu, requires_grad=False)
    p._cupool_host_table = True
    return p
