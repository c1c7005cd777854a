"""Greedy decoding of a wrapped transformers model with one captured CUDA graph per token.

Prefill runs eagerly. One decode step (static KV cache, fixed batch) is captured with
`torch.cuda.graph` after a few warm-up calls on a side stream, all with the pool's gate closed,
so the dummy steps cannot move the placement. The gate opens after capture; each token is one
replay. The graph also picks the next token (argmax on the device) and advances the position,
so the loop never reads the device.
"""

from __future__ import annotations

import dataclasses
import time
import weakref

import torch

from cupool.engine import cache_kwarg

# Per model, shared by every GraphDecoder on it: the compiled forward and the static cache (reset
# between runs). A new cache object per run would make torch.compile guard-fail and recompile.
# The compiled wrapper refers to its model, so it cannot be a value of a dict weakly keyed by the
# model (the key would never die): it is a plain attribute of the model (not a submodule, so no
# state_dict entry), a cycle the garbage collector frees with the model.
_COMPILED_ATTR = "_cupool_compiled"
_CACHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def compiled_forward(model):
    """`torch.compile(model, dynamic=False)`, made once per model."""
    compiled = model.__dict__.get(_COMPILED_ATTR)
    if compiled is None:
        compiled = model.__dict__[_COMPILED_ATTR] = torch.compile(model, dynamic=False)
    return compiled


@dataclasses.dataclass
class DecodeResult:
    tokens: torch.Tensor          # [B, new_tokens] generated ids (the prompt not included)
    prefill_s: float
    capture_s: float
    decode_s: float               # wall time of the replay loop, synchronised at the end
    new_tokens: int

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput per sequence: tokens after the first / decode time."""
        return (self.new_tokens - 1) / self.decode_s if self.decode_s > 0 else float("nan")


class GraphDecoder:
    """Greedy decode loop for a (wrapped) transformers causal LM.

    Args:
        model: a transformers causal LM on the GPU (`cupool.wrap` moves it there).
        pool: the Pool from `cupool.wrap`, or None for an unwrapped model (baselines).
        max_len: static cache length (prompt + new tokens).
        warmup: decode calls before capture.
        graph: False runs the same decode step eagerly, one launch at a time (for baselines that
            cannot be captured, e.g. host-side caches).
        compile: run the decode step through `torch.compile` (inductor, no cudagraphs of its own;
            the step is still captured by this class). The pooled experts stay one opaque op
            each (`cupool::experts`); what is fused is the model's dense part (norms, rotary,
            router, residuals). The first warm-up call compiles (19 s for 8 Qwen3-MoE layers
            on an H200 host).

    The compiled forward and the static KV cache are kept per model and reused by later decoders
    of the same model, max_len and batch (a new cache object would make torch.compile recompile);
    `release(model)` frees them.
    """

    def __init__(self, model, pool=None, *, max_len: int, warmup: int = 3, graph: bool = True,
                 compile: bool = False):
        self.model, self.pool, self.max_len, self.warmup = model, pool, int(max_len), int(warmup)
        self.graph = bool(graph)
        self.compiled = compiled_forward(model) if compile else None
        self.device = next(model.parameters()).device
        if self.device.type != "cuda":
            raise ValueError(f"the model must be on a CUDA device, it is on {self.device}")
        attn = getattr(model.config, "_attn_implementation", None)
        if self.graph and attn == "eager":
            raise ValueError("GraphDecoder cannot capture a model whose attention runs eagerly in "
                             "transformers (its mask code copies a host value each call; gpt-oss "
                             "has no other attention path): use cupool.Engine, which passes its "
                             "own masks, or graph=False")

    def _cache(self, batch: int):
        from transformers import StaticCache
        key, cache = _CACHES.get(self.model, (None, None))
        if key == (self.max_len, batch):
            cache.reset()
            return cache
        cache = StaticCache(config=self.model.config, max_cache_len=self.max_len)
        _CACHES[self.model] = ((self.max_len, batch), cache)
        return cache

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> DecodeResult:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, S], got {list(input_ids.shape)}")
        B, S = input_ids.shape
        if S + max_new_tokens > self.max_len:
            raise ValueError(f"prompt {S} + max_new_tokens {max_new_tokens} exceeds "
                             f"max_len={self.max_len}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        model, dev = self.model, self.device
        ids = input_ids.to(dev)
        if self.pool is not None:
            self.pool.close()
        cache = self._cache(B)
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        kw = {cache_kwarg(model): cache, "use_cache": True}
        logits = model(input_ids=ids, cache_position=torch.arange(S, device=dev), **kw).logits
        tok = logits[:, -1, :].argmax(-1, keepdim=True)                  # [B, 1]
        torch.cuda.synchronize(dev)
        t1 = time.perf_counter()
        out = torch.empty(B, max_new_tokens, dtype=torch.long, device=dev)
        out[:, 0:1] = tok
        pos = torch.tensor([S], dtype=torch.long, device=dev)

        forward = self.compiled if self.compiled is not None else model

        def step():
            lg = forward(input_ids=tok, cache_position=pos, **kw).logits
            tok.copy_(lg[:, -1, :].argmax(-1, keepdim=True))
            pos.add_(1)

        # transformers' static cache layers count written positions themselves (a device
        # `cumulative_length` per layer, used as the write index, whatever cache_position says):
        # warm-up calls advance it, so it is put back to the prompt length before the replays.
        counters = [(t, t.clone()) for layer in getattr(cache, "layers", [])
                    for name, t in vars(layer).items()
                    if name.endswith("cumulative_length") and isinstance(t, torch.Tensor)]

        def rewind():
            for t, saved in counters:
                t.copy_(saved)

        if max_new_tokens > 1 and not self.graph:
            if self.pool is not None:
                self.pool.open()
            torch.cuda.synchronize(dev)
            t2 = time.perf_counter()
            for i in range(1, max_new_tokens):
                step()
                out[:, i:i + 1].copy_(tok)
            torch.cuda.synchronize(dev)
            t3 = time.perf_counter()
        elif max_new_tokens > 1:
            # Warm-up writes the KV of position S with the first token, exactly what the first
            # replay writes again; pos is reset after it.
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            first = tok.clone()
            with torch.cuda.stream(side):
                for _ in range(self.warmup):
                    step()
                    tok.copy_(first)
                    pos.fill_(S)
                    rewind()
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            tok.copy_(first)
            pos.fill_(S)
            rewind()
            if self.pool is not None:
                self.pool.open()
            torch.cuda.synchronize(dev)
            t2 = time.perf_counter()
            for i in range(1, max_new_tokens):
                graph.replay()
                out[:, i:i + 1].copy_(tok)
            torch.cuda.synchronize(dev)
            t3 = time.perf_counter()
        else:
            t2 = t3 = time.perf_counter()
        return DecodeResult(tokens=out, prefill_s=t1 - t0, capture_s=t2 - t1, decode_s=t3 - t2,
                            new_tokens=max_new_tokens)


def release(model) -> None:
    """Drop the compiled forward and the static KV cache kept for `model` by GraphDecoder."""
    model.__dict__.pop(_COMPILED_ATTR, None)
    _CACHES.pop(model, None)
