"""Sampling of the next token, per sequence, inside a captured decode step.

Shape legend: B sequences (slots) of a decode step · V vocabulary.

`SamplingParams` is what a request asks for; `sample` picks the next token of every slot from
its logits with the slot's temperature, top-k and top-p, using only tensor operations of fixed
shape (no host reads), so it is captured in the decode step's CUDA graph. Temperature 0 is
greedy (argmax).

Randomness is counter-based: the noise of vocabulary entry v at step s of a request with seed
`seed` is a hash of (seed, s, v), computed with integer tensor ops on the device. A seeded
request therefore samples the same tokens whether it runs alone or beside other requests, and no
generator state has to advance inside the graph. Sampling is the Gumbel-max trick over the kept
tokens: argmax(logits / T + Gumbel noise) draws from softmax(logits / T) restricted to them.

The order that top-k and top-p cut is by logit, larger first, and equal logits by id (a stable
sort), so the kept set is defined even where a cut falls among equal logits, as it often does
with bf16 logits. On a GPU the Engine draws with `cupool.ops.sampler.Sampler`, rawkernels/sample.cu
(no sort, a few launches), which picks the tokens this reference picks except where top_p times
the kept mass lies within float rounding of the mass ahead of a group of equal logits.
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch

_M32 = 0xFFFFFFFF
MAX_LOGPROBS = 20       # most alternatives a token reports (OpenAI's top_logprobs limit)


@dataclasses.dataclass
class SamplingParams:
    """How one request samples and when it stops.

    temperature: 0 is greedy; otherwise logits are divided by it (> 0).
    top_k: keep the k most likely tokens (0: all).
    top_p: keep the smallest set of most likely tokens whose probability reaches p (1: all).
    seed: of the request's noise (None: drawn from the OS). Same seed, same prompt and same
        parameters give the same tokens, alone or batched.
    max_tokens: most tokens to generate (≥ 1).
    stop: strings that end the generation when they appear in the text (not included in it).
    stop_token_ids: token ids that end the generation besides the model's EOS ids.
    ignore_eos: do not stop at the model's EOS ids.
    logprobs: None, or report the log-probability of each chosen token and the `logprobs` most
        likely ones (0 ≤ logprobs ≤ MAX_LOGPROBS), from the model's own distribution.
    skip_special_tokens: leave special tokens out of the text (True) or keep them (chat formats
        whose markers are special tokens parse them).
    """
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        """ValueError naming the field and its value where one is out of range."""
        def bad(name, want):
            return ValueError(f"{name} must be {want}, got {getattr(self, name)!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise bad("temperature", "a finite number >= 0")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "an int >= 0 (0: no limit)")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise bad("top_p", "a number in (0, 1]")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**63):
            raise bad("seed", "None or an int in [0, 2^63)")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or self.max_tokens < 1:
            raise bad("max_tokens", "an int >= 1")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0
                for i in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of token ids (ints >= 0)")
        lp = self.logprobs
        if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int)
                               or not 0 <= lp <= MAX_LOGPROBS):
            raise bad("logprobs", f"None or an int in [0, {MAX_LOGPROBS}]")

    def resolved_seed(self) -> int:
        """The seed, or one drawn from the OS where none was given (fixed per call of this)."""
        if self.seed is not None:
            return self.seed
        return int.from_bytes(os.urandom(8), "little") >> 1


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of int64 values in [0, 2^32): xor-shifts and multiplications by odd
    constants below 2^31, so every product stays below 2^63 (no signed overflow)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _M32
    x = x ^ (x >> 16)
    return x


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """u [B, V] float32 in (0, 1): entry (b, v) a hash of (seeds[b], steps[b], v), 23 bits of it
    plus a half, over 2^23 (exact in float32, so u never rounds to 1, where the noise would be
    infinite)."""
    dev = seeds.device
    s = _mix(_mix(seeds & _M32) ^ ((seeds >> 32) & _M32))                 # [B]
    s = _mix(s ^ (steps & _M32))                                           # [B]
    v = torch.arange(vocab, device=dev, dtype=torch.int64)
    h = _mix(s[:, None] ^ v[None, :])                                      # [B, V]
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
           greedy_only: bool = False) -> torch.Tensor:
    """Next tokens int64 [B] from logits [B, V].

    temperature float32 [B] (0: greedy), top_k int64 [B] (0: all), top_p float32 [B] (1: all),
    seeds int64 [B], steps int64 [B] (the index of the token being sampled in its request).
    `greedy_only`: every row is greedy (skips the sort; the caller knows it from the requests).
    """
    greedy = logits.argmax(dim=-1)
    if greedy_only:
        return greedy
    B, V = logits.shape
    scaled = logits.float() / temperature.clamp_min(1e-6)[:, None]
    vals, order = scaled.sort(dim=-1, descending=True, stable=True)       # [B, V]
    ranks = torch.arange(V, device=logits.device)
    k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V))
    keep = ranks[None, :] < k[:, None]
    probs = torch.softmax(vals.masked_fill(~keep, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs                                  # mass above each rank
    keep &= before < top_p[:, None]                                        # rank 0 always kept
    gumbel = -torch.log(-torch.log(uniform_noise(seeds, steps, V)))       # [B, V] by vocab id
    score = (vals + gumbel.gather(1, order)).masked_fill(~keep, float("-inf"))
    sampled = order.gather(1, score.argmax(dim=-1, keepdim=True))[:, 0]
    return torch.where(temperature > 0, sampled, greedy)


def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor, k: int = MAX_LOGPROBS):
    """Log-probabilities under softmax(logits) (the model's distribution, before temperature and
    masks): of `chosen` int64 [B] -> float32 [B], and the k most likely tokens -> values float32
    [B, k], ids int64 [B, k]. Fixed shapes, so a captured step can hold it."""
    lp = torch.log_softmax(logits.float(), dim=-1)                         # [B, V]
    top_vals, top_ids = lp.topk(min(k, lp.shape[-1]), dim=-1)              # [B, k]
    return lp.gather(1, chosen[:, None])[:, 0], top_vals, top_ids


def mask_words(vocab: int) -> int:
    """int32 words of a token mask over `vocab` ids (bit v % 32 of word v // 32: id v allowed)."""
    return (vocab + 31) // 32


def apply_token_mask(logits: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """logits [B, V] with the ids a bitmask words int32 [B, ceil(V / 32)] does not allow set to
    -inf (a row of all ones bits leaves its logits as they are). The bit layout is llguidance's
    and xgrammar's, so a grammar library fills the words directly."""
    V = logits.shape[-1]
    v = torch.arange(V, device=logits.device)
    bits = (words[:, v // 32] >> (v % 32).to(torch.int32)) & 1                 # [B, V]
    return logits.masked_fill(bits == 0, float("-inf"))
