"""Loading a model directory for serving: `load(model_dir, device, ...) -> Loaded(model, pool,
tokenizer)`.

- On the CPU: `transformers.AutoModelForCausalLM.from_pretrained(dir)`, unwrapped (pool None).
  What the tests use; fine for tiny models, slow for real ones.
- On a CUDA device: `cupool.from_pretrained(dir, budget=..., max_decode_tokens=max_batch,
  kv_reserve=reserve(...))`: the experts in host memory, served through a pool, the bank sized to
  leave the engine's KV cache, recurrent states and resume points free.

The tokenizer is the directory's (`AutoTokenizer.from_pretrained`) where it has tokenizer files;
without them it is None, and the server then takes token-id prompts only (no chat). A directory
whose tokenizer files do not load is an error, not a model without a tokenizer.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from cupool.pretrained import TOKENIZER_FILES, Loaded, QuantizeError

log = logging.getLogger("cupool.serve")

DEFAULT_MAX_LEN_CAP = 4096


class LoadError(ValueError):
    """The model directory cannot be served as given (what is wrong, in one line)."""


def check_dir(model_dir) -> Path:
    """The directory as a Path, after checking it exists and holds a readable config.json."""
    path = Path(model_dir).expanduser()
    if not path.exists():
        raise LoadError(f"model directory {str(path)!r} does not exist")
    if not path.is_dir():
        raise LoadError(f"{str(path)!r} is not a directory (give the model's directory)")
    if not (path / "config.json").is_file():
        raise LoadError(f"{str(path)!r} has no config.json: it is not a transformers model "
                        f"directory")
    return path


def read_config(model_dir) -> dict:
    """config.json of the directory, as a dict (LoadError where it is missing or not JSON)."""
    path = check_dir(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoadError(f"{str(path)!r} cannot be read as JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise LoadError(f"{str(path)!r} is not a JSON object")
    return cfg


def _positions(cfg: dict) -> int | None:
    n = cfg.get("max_position_embeddings")
    if n is None and isinstance(cfg.get("text_config"), dict):       # multimodal wrappers
        n = cfg["text_config"].get("max_position_embeddings")
    return int(n) if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def resolve_max_len(cfg: dict, max_len: int | None) -> int:
    """The context a slot holds: `max_len` checked against the model's max_position_embeddings,
    or by default min(max_position_embeddings, 4096) (4096 where the config gives none)."""
    limit = _positions(cfg)
    if max_len is None:
        return min(limit, DEFAULT_MAX_LEN_CAP) if limit else DEFAULT_MAX_LEN_CAP
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 2:
        raise LoadError(f"max_len must be an int >= 2, got {max_len!r}")
    if limit and max_len > limit:
        raise LoadError(f"max_len={max_len} exceeds the model's max_position_embeddings={limit}")
    return max_len


def load_tokenizer(model_dir):
    """The directory's tokenizer, or None where it has no tokenizer files (LoadError where the
    files are there but do not load)."""
    path = Path(model_dir)
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        log.warning("%s has no tokenizer: prompts must be token ids, and chat is refused", path)
        return None
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:                  # any failure of the files, reported in one line
        raise LoadError(f"the tokenizer in {str(path)!r} does not load: "
                        f"{type(e).__name__}: {e}") from e


def load(model_dir, device, budget=None, max_batch: int = 8, max_len: int | None = None,
         dtype=None, resume_points: int | None = None, quantize_attention: bool = False) -> Loaded:
    """Load `model_dir` for serving on `device` ("cpu", "cuda", "cuda:N").

    budget: GPU memory for the whole model (bytes or "40GiB"; CUDA only, None: cupool's default).
    max_batch: sequences decoded together (the pool is built for that many decode tokens).
    max_len: checked against the model's positions (see `resolve_max_len`).
    resume_points: the engine's saved copies of a slot's recurrent states (None: its default,
        3 × max_batch).
    On CUDA the engine's memory beside the model is kept out of the bank's share of the budget
    (`reserve`): the KV cache of max_batch sequences of max_len tokens, the max_batch slots'
    recurrent states and resume_points copies of one slot's states.
    dtype: of the weights and activations; None: the checkpoint's own on the CPU, cupool's
        default on CUDA.
    quantize_attention: CUDA only: the attention projections quantized to NVFP4 at load
        (`cupool.from_pretrained`'s quantize_attention); LoadError naming a projection that
        cannot be.
    """
    import torch

    path = check_dir(model_dir)
    max_len = resolve_max_len(read_config(path), max_len)
    dev = torch.device(device)
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise LoadError(f"max_batch must be an int >= 1, got {max_batch!r}")
    if dev.type == "cpu":
        if budget is not None:
            raise LoadError("a memory budget applies to a CUDA device; the CPU serves the model "
                            "unwrapped (leave the budget out)")
        if quantize_attention:
            raise LoadError("quantizing the attention projections applies to a CUDA device "
                            "(the fused decode step's GEMVs read them); the CPU serves the "
                            "model's own weights")
        return _load_cpu(path, dtype)
    if resume_points is not None and (isinstance(resume_points, bool)
                                      or not isinstance(resume_points, int) or resume_points < 0):
        raise LoadError(f"resume_points must be an int >= 0, got {resume_points!r}")
    if dev.type == "cuda":
        return _load_cuda(path, dev, budget, max_batch, max_len, dtype, resume_points,
                          quantize_attention)
    raise LoadError(f"device {device!r} is not served: use cpu or cuda[:N]")


def _load_cpu(path: Path, dtype) -> Loaded:
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto" if dtype is None else dtype)
    return Loaded(model.eval(), None, tokenizer)


def reserve(path: Path, max_batch: int, max_len: int, resume_points: int | None = None):
    """What the engine allocates beside the model (`cupool.kvcache.engine_reserve`, bf16 keys,
    values and convolution states): the KV cache of max_batch sequences of max_len tokens, the
    slots' recurrent states and the resume points' copies of them: what the bank leaves free.
    LoadError where the model's recurrent states are of a kind not known."""
    from transformers import AutoConfig

    from cupool.kvcache import engine_reserve
    try:
        return engine_reserve(AutoConfig.from_pretrained(path), max_batch=max_batch,
                              max_len=max_len, resume_points=resume_points)
    except ValueError as e:
        raise LoadError(f"{str(path)!r}: {e}") from None


def _load_cuda(path: Path, device, budget, max_batch: int, max_len: int, dtype,
               resume_points: int | None, quantize_attention: bool = False) -> Loaded:
    import cupool

    kwargs = {} if dtype is None else {"dtype": dtype}
    if device.index is not None:
        kwargs["device"] = str(device)
    if quantize_attention:
        kwargs["quantize_attention"] = True
    kept = reserve(path, max_batch, max_len, resume_points)
    log.info("kept out of the bank: %s", kept.parts())
    try:
        return cupool.from_pretrained(path, budget=budget, max_decode_tokens=max_batch,
                                      kv_reserve=kept, **kwargs)
    except QuantizeError as e:
        raise LoadError(f"{str(path)!r}: {e}") from None


def unused_quantization(engine) -> str | None:
    """Where the model's attention projections were quantized to NVFP4 at load
    (`--quantize-attention`) but no GEMV of the engine's decode step reads them (its own forward
    runs, or no layer of the model fits the fused step's pattern): the line to warn with, for
    then they change the outputs and make nothing faster. None where some GEMV reads them."""
    step = engine.fused_step
    if step is not None and any(step.nvfp4_gemvs().values()):
        return None
    return (f"--quantize-attention: no GEMV of the decode step ({engine.step_kind}) reads the "
            f"quantized projections; they change the outputs and make nothing faster")


def auto_host_experts(pool, tokens: int, min_misses: int | None = None) -> str | None:
    """Why `serve`'s default (neither --host-experts nor --no-host-experts) leaves host experts
    off for this pool's decode steps of `tokens` sequences on a CUDA device, or None where it
    turns them on: not where the bank holds every expert (nothing misses), nor where no step
    can reach `min_misses` (`cupool.layer.resolve_min_misses`; a step has at most tokens ·
    top_k misses), nor where the process may use fewer than `cupool.cli.AUTO_HOST_CPUS` CPUs,
    nor without a C compiler to build the host's loop."""
    from cupool.cli import AUTO_HOST_CPUS
    from cupool.hostexperts import find_compiler, usable_cpus
    from cupool.layer import resolve_min_misses
    if pool.bank.holds_every_expert():
        return f"the bank holds every expert ({pool.num_experts} rows a layer)"
    fewest = resolve_min_misses(pool.top_k, min_misses)
    if tokens * pool.top_k < fewest:
        return (f"a step of {tokens} sequence{'s' if tokens != 1 else ''} has at most "
                f"{tokens * pool.top_k} misses, fewer than --host-min-misses {fewest}")
    cpus = usable_cpus()
    if cpus < AUTO_HOST_CPUS:
        return f"this process may use {cpus} CPUs, fewer than {AUTO_HOST_CPUS}"
    try:
        find_compiler()
    except RuntimeError as e:
        return str(e)
    return None


def enable_host_experts(pool, tokens: int, threads: int | None = None, leave: bool = False,
                        min_misses: int | None = None, prefill_tokens: int = 0):
    """`Pool.enable_host_experts` for decode steps of `tokens` tokens (`--host-experts` of
    `serve` and `generate`, `leave` generate's `--host-leave` and serve's default (not
    `--host-promote`), `min_misses` their
    `--host-min-misses`, `prefill_tokens` their `--host-prefill-tokens`, 0: decode steps only);
    LoadError where the bank holds every expert (a step misses none, so the host would have
    nothing to compute) or where prefill_tokens exceeds the widest prefill call the pool was
    built for. Returns the HostDecode."""
    if pool.bank.holds_every_expert():
        raise LoadError(f"--host-experts: the bank holds every expert ({pool.num_experts} rows a "
                        f"layer), so a step misses none; leave it out")
    widest = pool.gemm.max_prefill_tokens
    if prefill_tokens > widest:
        raise LoadError(f"--host-prefill-tokens {prefill_tokens} exceeds the widest prefill call "
                        f"the pool was built for, {widest} tokens: give at most {widest}")
    return pool.enable_host_experts(tokens, threads=threads, leave=leave, min_misses=min_misses,
                                    prefill_tokens=prefill_tokens)
