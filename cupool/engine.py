"""`Engine`: generation for a (wrapped or plain) transformers causal LM — sampling, stop
conditions, streaming, and several sequences decoded together with continuous batching.

Shape legend: B slots (sequences decoded together) · S prompt tokens · V vocabulary · L_max
positions a slot holds.

How a request runs:
1. `submit(prompt_ids, params)` checks it (token ids, prompt + max_tokens ≤ max_len) and queues it.
2. When a slot is free, the request is *admitted*: its prompt is run eagerly into the slot's rows
   of the cache (`cupool.slotstate.StateSlotCache`: `SlotCache`'s keys and values, plus the
   per-slot states of hybrid layers, zeroed first, or loaded from the point a reused prefix
   resumes at: `cupool.prefix`) in chunks of `prefill_chunk` tokens (any prompt length works;
   through a pool, a chunk takes the partition path; a chunk also ends at the request's
   `resume_at`, where hybrid layers' states are copied out), and its first token is sampled from
   the last position's logits.
3. Every active slot then advances one token per *step*: the model's forward on [B, 1] tokens at
   each slot's own position, the sampling (`cupool.sampling.sample`'s draw; on a GPU its kernel,
   `cupool.ops.sampler`) and the position update, all on the device. On a GPU the step is
   captured in a CUDA graph once (two: greedy only, and sampled) and replayed for every token,
   whatever the slots hold; a finished sequence's slot takes the next request without recapture.
4. After each step one small copy brings the B new tokens to the host (the only read of a step),
   where EOS ids, stop token ids, stop strings and max_tokens are checked, text is detokenized
   incrementally, and events go to the request's callback. Steps are pipelined by one: step n+1
   is launched before step n's tokens are read, so the host's work overlaps the GPU's.

Through a pool, the step's T = B tokens make one plan step per layer, so an expert row several
sequences route to is planned and copied once; the lanes of inactive slots are padding
(`Pool.token_mask`), so they read no experts and move no rows. Once the step's B·K lanes
outnumber a layer's bank rows, the pool caps the misses of a step that take a bank row
(`Pool.promote`, "auto" by default; the rest are staged), so B sequences together cannot evict
every row before its next use.

Thread safety: `submit` and `Request.cancel` may be called from any thread; everything else runs
on the thread that drives the engine (`run_until_idle`, `generate`, or the background loop of
`start`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import inspect
import itertools
import logging
import queue
import threading
import time
from typing import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from cupool import graphsafe
from cupool.kvcache import ATTENTION_TYPES, INDEXED_TYPES, STATE_TYPES
from cupool.ops.sampler import LOGIT_DTYPES, Sampler
from cupool.prefix import PrefixCache
from cupool.sampling import (MAX_LOGPROBS, SamplingParams, apply_token_mask, mask_words, sample,
                             token_logprobs)
from cupool.slotstate import StateSlotCache

StepKind = collections.namedtuple("StepKind", "greedy logprobs masked host width",
                                  defaults=(False, 0))
"""A decode step's variant: greedy only (no sort), logprobs written, a token mask applied, the
pool's host experts handed their share (enough active slots for a call to hand anything over:
`HostDecode.hands_over`; otherwise the step is a plain one, without the hand-off's launches), and
`width`: 0 for a step of every slot, else a narrow step of that many slots, those of the engine's
slot map (`Engine(narrow=)`: the active ones first, free ones after)."""

FINISH_STOP, FINISH_LENGTH, FINISH_CANCELLED, FINISH_ERROR = "stop", "length", "cancelled", "error"
NO_MASK = "no mask"           # a layer type that takes no mask (kvcache.STATE_TYPES)
WARMUP_MORE = 8               # tokens warmup()'s continued prompt adds to its long one
WARMUP_LONGEST = 2048         # most tokens of warmup()'s long prompt (a model whose prompts
                              # are not chunked would otherwise prefill max_len of them)
log = logging.getLogger("cupool")
# SDPA backends of a prefill chunk whose lengths do not repeat (Engine._prefill_attention)
_NOT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _rows_prefill_unfit(model) -> str | None:
    """Why prompts of this model cannot be prefilled side by side in one forward (Engine's
    batch_prefill), or None where they can: indexed attention (its indexer keeps per-slot keys
    of its own), or a rotary embedding that changes with the forward's length (dynamic NTK,
    LongRoPE), which would give a short prompt the longest one's. Models whose slots hold
    recurrent states are found at admission (`Engine._rows_take`)."""
    if set(getattr(model.config, "layer_types", None) or []) & INDEXED_TYPES:
        return "indexed attention keeps per-slot keys of its own"
    if any(graphsafe.rope_changes_with_length(getattr(m, "rope_type", ""))
           for m in model.modules()):
        return "its rotary embedding changes with the forward's length"
    return None


def _takes(model, name: str) -> bool:
    """Whether the model's forward has a parameter `name`."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params


def cache_kwarg(model) -> str:
    """The keyword a model's forward takes its KV cache under: `cache` (transformers ≥ 5.24, where
    `past_key_values` is deprecated) or `past_key_values` (earlier 5.x releases)."""
    return "cache" if _takes(model, "cache") else "past_key_values"


@dataclasses.dataclass
class Event:
    """One step of a request's output: a token (and the text it adds), or the end."""
    request: "Request"
    token_id: int | None          # None on a final event that carries no new token
    text: str                     # text released by this event ("" while held back)
    finished: bool
    finish_reason: str | None     # "stop", "length", "cancelled", "error"
    logprobs: tuple | None = None  # (chosen logprob, [(id, logprob), ...]) where asked


class Request:
    """A submitted generation. Its fields fill in as the engine runs it."""

    _ids = itertools.count()

    def __init__(self, prompt_ids: list[int], params: SamplingParams,
                 on_event: Callable[[Event], None] | None, constraint=None,
                 resume_at: int | None = None):
        self.id = next(Request._ids)
        self.prompt_ids = prompt_ids
        self.params = params
        self.constraint = constraint  # fill(words) / accept(token) / done(): a token-mask hook
        self.resume_at = resume_at    # prompt position to keep a resume point at (submit)
        self.logprobs: list[tuple] = []   # per output token, where params.logprobs is set
        self.cached_tokens = 0            # prompt tokens whose KV a slot already held
        self._fed = 0                     # decode steps launched that fed this request's tokens
        self._stop_token: int | None = None   # the EOS / stop token that ended it, if one did
        self.stop_string: str | None = None   # the stop string that ended it, if one did
        self.seed = params.resolved_seed()
        self.on_event = on_event
        self.output_ids: list[int] = []
        self.text = ""                # detokenized output (stop string excluded)
        self._sent = 0                # characters of `text` already released in events
        self._context = prompt_ids[-5:]   # prompt tokens that give the first tokens' spacing
        self._prefix_at = 0           # detokenizing offsets into _context + output_ids
        self._read_at = len(self._context)
        self.finished = False
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.cancelled = threading.Event()
        self.done = threading.Event()
        self.submitted_at = time.perf_counter()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None

    def cancel(self) -> None:
        """Stop generating (the slot is freed at the engine's next iteration)."""
        self.cancelled.set()

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first / time after the first (NaN for fewer than 2 tokens)."""
        n = len(self.output_ids)
        if n < 2 or self.first_token_at is None or self.finished_at is None:
            return float("nan")
        dt = self.finished_at - self.first_token_at
        return (n - 1) / dt if dt > 0 else float("nan")

    def __repr__(self) -> str:
        state = self.finish_reason if self.finished else "running"
        return (f"Request(id={self.id}, prompt={len(self.prompt_ids)} tokens, "
                f"output={len(self.output_ids)} tokens, {state})")


class Engine:
    """Generation for `model` (a transformers ≥ 5 causal LM), wrapped by cupool (`pool`) or not.

    Args:
        model: the model, on its device (CUDA for a pool; the CPU works unwrapped).
        pool: the Pool of `cupool.wrap` / `cupool.from_pretrained`, or None.
        tokenizer: for text (detokenized events, stop strings) and the default EOS ids; None works
            with token ids alone.
        max_batch: B, slots decoded together (through a pool at most its max_decode_tokens).
        max_len: positions a slot holds (prompt + generated tokens), at most the model's
            max_position_embeddings.
        prefill_chunk: prompt tokens run in one forward (default: 2048, at most the pool's
            max_prefill_tokens): bounds the activations and the mask of a long prompt. Models
            whose layers cannot continue a chunk from a state (Jamba) take a prompt whole.
        graph: capture the decode step in a CUDA graph (default: on a CUDA device).
        fused: run the decode step with cupool's fused kernels (`cupool.fused.FusedStep`: a few
            launches a layer; layers that do not fit its pattern run transformers' modules).
            None (default): where the model fits, on a CUDA device with a pool; True: required
            (ValueError naming why not); False: the model's own forward.
        compile: run the model's own decode step through torch.compile before capturing it (when
            the fused step is not used).
        eos_token_id: ids that end a generation (default: generation_config's and the
            tokenizer's).
        reuse_prefix: a request whose prompt starts with tokens a free slot still holds (the
            previous turn of a conversation) takes that slot and prefills only the rest (see
            "Prefix reuse" below); other requests take the least recently used free slot.
        resume_points: for models with recurrent layers, at most this many saved copies of a
            slot's recurrent states (the points a later request can resume from), each
            `resume_point_bytes` on the model's device, allocated on the first save (default:
            3 × max_batch, a request's `resume_at`, end-of-prompt and end-of-request points a
            slot; 0: such models are always prefilled from the start). `cupool serve` sizes the
            bank to leave room for them: its reserve (`cupool.kvcache.engine_reserve`, passed to
            `from_pretrained` as kv_reserve) holds the KV cache, the max_batch slots' recurrent
            states and `resume_points` copies of one slot's states. An engine given more slots,
            positions or points than its pool's reserve was planned for takes the rest from
            whatever memory the bank left free.
        batch_prefill: prefill requests queued together in one forward of padded rows (each
            row the longest prompt's length, the rows together at most `prefill_chunk` tokens)
            instead of one request at a time, the same tokens either way. Only requests that
            reuse nothing, on models whose slots hold keys and values alone (no recurrent
            states, no indexed attention, no rotary embedding that changes with the length);
            the first prefill of an engine runs alone. On by default; False prefills each
            request alone.
        narrow: where the active slots fit a power of two below max_batch, run a narrow step of
            them alone (a fused step of 1, 2, 4, ... tokens, the fewest that hold them, over those
            slots' cache rows: `FusedStep(slots=)`) instead of the step of every slot, whose
            kernels run `max_batch` rows however few are active. Each width is its own captured
            graph, whichever slots it runs. Only with the fused step, every layer fused, and not
            in steps that hand host experts a share; the same tokens either way. On by default;
            False runs every step over every slot.

    Prefix reuse (`cupool.prefix`): a finished request leaves its prompt and the output tokens
    its steps fed in its slot's rows; the slot remembers those tokens until another request
    takes it. A request whose prompt starts with some of them takes that slot and prefills the
    rest; one without a match takes the free slot least worth keeping (nothing to resume, then
    least recently used), so the most recently used prefixes stay longest. The last prompt token
    is always run (its logits give the first token); `Request.cached_tokens` says how many
    positions were reused. Attention alone: any common prefix is reused, bounded by the slots
    (no memory beyond the KV cache). Recurrent layers (gated delta nets, Mamba-2, ...): a slot's
    state is exact only at the points where it was copied out (`resume_points` of them, the
    least recently saved dropped first): the end of a request's prompt, the end of the
    request, and the position inside the prompt a request names with `submit(..., resume_at=)`
    (the server's end of the conversation before the chat template's generation prompt, which a
    next turn keeps where a thinking template drops the rest); a request resumes from the longest
    of those that is a prefix of its prompt.
    """

    def __init__(self, model, pool=None, *, tokenizer=None, max_batch: int = 8,
                 max_len: int = 4096, prefill_chunk: int | None = None, graph: bool | None = None,
                 fused: bool | None = None, compile: bool = False, eos_token_id=None,
                 reuse_prefix: bool = True, resume_points: int | None = None,
                 batch_prefill: bool = True, narrow: bool = True):
        self.model, self.pool, self.tokenizer = model, pool, tokenizer
        try:
            param = next(model.parameters())
        except StopIteration:
            raise ValueError("model has no parameters") from None
        self.device = param.device
        cfg = model.config
        self.vocab = int(getattr(cfg, "vocab_size", 0) or model.get_output_embeddings().weight.shape[0])
        limit = getattr(cfg, "max_position_embeddings", None)
        for name, v in (("max_batch", max_batch), ("max_len", max_len)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if max_len < 2:
            raise ValueError(f"max_len must be >= 2, got {max_len}")
        if limit and max_len > limit:
            raise ValueError(f"max_len={max_len} exceeds the model's max_position_embeddings="
                             f"{limit}; use max_len <= {limit}")
        if pool is not None:
            if pool.device != self.device:
                raise ValueError(f"the pool is on {pool.device}, the model on {self.device}")
            cap = pool.gemm.max_decode_tokens
            if max_batch > cap:
                raise ValueError(f"max_batch={max_batch} exceeds the pool's max_decode_tokens={cap} "
                                 f"(wrap or load with max_decode_tokens >= {max_batch})")
        chunk = 2048 if prefill_chunk is None else prefill_chunk
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"prefill_chunk must be an int >= 1, got {prefill_chunk!r}")
        if pool is not None:
            chunk = min(chunk, pool.gemm.max_prefill_tokens or chunk)
        points = 3 * max_batch if resume_points is None else resume_points
        if isinstance(points, bool) or not isinstance(points, int) or points < 0:
            raise ValueError(f"resume_points must be an int >= 0, got {resume_points!r}")
        whole = graphsafe.whole_prompt_prefill(model)
        if whole is not None:               # one forward a prompt: chunks could not continue
            log.info("cupool: prompts are prefilled in one forward: %s", whole)
            chunk = max_len
        self.prefill_chunk = chunk
        self.max_batch, self.max_len = max_batch, max_len
        # why prompts are never prefilled side by side (None: they may be, `_rows_why`)
        self._rows_unfit = "batch_prefill=False" if not batch_prefill else \
            whole if whole is not None else _rows_prefill_unfit(model)
        self.graph = (self.device.type == "cuda") if graph is None else bool(graph)
        if self.graph and self.device.type != "cuda":
            raise ValueError(f"graph=True needs a CUDA device, the model is on {self.device}")
        self.eos_ids = self._eos_ids(eos_token_id)
        self.dtype = param.dtype                   # of the activations, keys and values
        self._cache_kw = cache_kwarg(model)
        self._use_cache = graphsafe.use_cache_flag(model)
        self._logits_kw = {"logits_to_keep": 1} if _takes(model, "logits_to_keep") else {}
        self._window = self._sliding_window(cfg)
        self._mask_bool = getattr(cfg, "_attn_implementation", "sdpa") == "sdpa"
        n_layers = int(getattr(cfg, "num_hidden_layers"))
        B, dev = max_batch, self.device
        # SlotCache's keys and values for attention layers, plus per-slot states for the layers
        # that keep them (allocated on first use: an attention-only model holds SlotCache's alone)
        self.cache = StateSlotCache(n_layers, B, max_len, self.dtype, dev)
        self.tok = torch.zeros(B, 1, dtype=torch.int64, device=dev)
        self.active = torch.zeros(B, dtype=torch.bool, device=dev)
        self.temperature = torch.zeros(B, dtype=torch.float32, device=dev)
        self.top_k = torch.zeros(B, dtype=torch.int64, device=dev)
        self.top_p = torch.ones(B, dtype=torch.float32, device=dev)
        self.seeds = torch.zeros(B, dtype=torch.int64, device=dev)
        self.steps = torch.zeros(B, dtype=torch.int64, device=dev)
        self._sampler: Sampler | None = None      # made at the first sampled step (`_sample`)
        self._sampler_warned = False
        # logprobs of the step's tokens (chosen, top MAX_LOGPROBS) and the grammar token mask
        self.lp_chosen = torch.zeros(B, dtype=torch.float32, device=dev)
        self.lp_top = torch.zeros(B, MAX_LOGPROBS, dtype=torch.float32, device=dev)
        self.lp_ids = torch.zeros(B, MAX_LOGPROBS, dtype=torch.int64, device=dev)
        self.mask = torch.full((B, mask_words(self.vocab)), -1, dtype=torch.int32, device=dev)
        self._host_mask = torch.full_like(self.mask, -1, device="cpu")
        fixed = graphsafe.prepare(model)
        if fixed:
            log.info("cupool: graph-safe forwards installed in %s", ", ".join(fixed))
        self._fused = self._fused_step(fused)
        if not isinstance(narrow, bool):
            raise ValueError(f"narrow must be True or False, got {narrow!r}")
        self._narrow, self.narrow_why = self._narrow_steps(narrow)
        self._forward = torch.compile(model, dynamic=False) if compile and self._fused is None \
            else model
        self.step_kind = (self._fused.describe() if self._fused is not None else
                          ("compiled " if compile else "") + ("graph" if self.graph else "eager"))
        if self._narrow:
            self.step_kind += (f"; at most {max(self._narrow)} active requests: a narrow step "
                               f"of theirs ({', '.join(map(str, self._narrow))} slots)")
        self._graphs: dict[StepKind, torch.cuda.CUDAGraph] = {}
        self._graph_pool = None
        self._slots: list[Request | None] = [None] * B
        self.reuse_prefix = bool(reuse_prefix)
        self.prefix = PrefixCache(self.cache, B, enabled=self.reuse_prefix, points=points,
                                  resumable=whole is None)
        self.prefill_tokens = 0                            # prompt tokens run through prefill
        self._incoming: queue.Queue = queue.Queue()
        self._pending: list[Request] = []
        self._inflight = None            # (host tokens, event, owners) of the step not read yet
        self._host_tok = [torch.zeros(B, dtype=torch.int64, pin_memory=dev.type == "cuda")
                          for _ in range(2)]
        self._host_ready = [torch.cuda.Event() if dev.type == "cuda" else None for _ in range(2)]
        self._host_lp = [tuple(torch.zeros(t.shape, dtype=t.dtype, pin_memory=dev.type == "cuda")
                               for t in (self.lp_chosen, self.lp_top, self.lp_ids))
                         for _ in range(2)]
        self._flip = 0
        # the narrow steps' slot map (`_set_slot_map`): always B distinct slots, so a step
        # captured or run before any request reads valid rows
        self._slot_map = torch.arange(B, dtype=torch.int64, device=dev)
        self._map_host = torch.arange(B, dtype=torch.int64).pin_memory() \
            if dev.type == "cuda" else torch.arange(B, dtype=torch.int64)
        self._map_ready = torch.cuda.Event() if dev.type == "cuda" else None
        self._map_order = tuple(range(B))
        self._narrow_active = torch.zeros(B, dtype=torch.bool, device=dev)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.broken: str | None = None
        self.broken_error: BaseException | None = None
        self.steps_run = 0

    # --- configuration helpers ----------------------------------------------------------------------
    def _eos_ids(self, given) -> set[int]:
        if given is not None:
            ids = [given] if isinstance(given, int) else list(given)
        else:
            ids = []
            gen = getattr(self.model, "generation_config", None)
            for src in (getattr(gen, "eos_token_id", None),
                        getattr(self.model.config, "eos_token_id", None),
                        getattr(self.tokenizer, "eos_token_id", None)):
                if src is None:
                    continue
                ids += [src] if isinstance(src, int) else list(src)
        return {int(i) for i in ids}

    @staticmethod
    def _sliding_window(cfg) -> int | None | dict:
        """The attention window of every layer: None (full attention), one window, or for models
        whose layers are of several types {layer type: window, None, or NO_MASK}; the masks are
        then a dict by layer type, which transformers' models of such families take in place of
        one mask. Attention types (`ATTENTION_TYPES`) get a causal mask (indexed attention: the
        full causal mask its indexer narrows); layers that carry a state instead of keys
        (`STATE_TYPES`) get none (a slot's tokens are never padding). Other types are refused."""
        types = set(getattr(cfg, "layer_types", None) or [])
        window = getattr(cfg, "sliding_window", None)
        use = bool(window) and getattr(cfg, "use_sliding_window", True) is not False
        if len(types) > 1:
            unknown = types - ATTENTION_TYPES - STATE_TYPES
            if unknown:
                raise ValueError(f"the model's layers mix attention types {sorted(types)}; "
                                 f"cupool's Engine runs {sorted(ATTENTION_TYPES)} (masks) and "
                                 f"{sorted(STATE_TYPES)} (per-slot states), not {sorted(unknown)}")
            if "sliding_attention" in types and not use:
                raise ValueError("the model has sliding_attention layers but no sliding window "
                                 f"(config.sliding_window={window!r})")
            if "sliding_attention" not in types and use:
                raise ValueError(f"the model's layers are of types {sorted(types)} with "
                                 f"config.sliding_window={window}: its full_attention layers "
                                 f"would slide, which the engine does not build for such models")
            return {kind: (int(window) if kind == "sliding_attention" else
                           NO_MASK if kind in STATE_TYPES else None) for kind in sorted(types)}
        if types and types <= STATE_TYPES:
            raise ValueError(f"the model has no attention layer (layer types {sorted(types)}); "
                             f"cupool's Engine serves models with attention")
        if types == {"full_attention"}:
            return None
        return int(window) if use else None

    def _fused_step(self, want: bool | None):
        """The FusedStep of this engine, or None (want None: where the model fits)."""
        if want is False:
            return None
        from cupool.fused import FusedStep, Unsupported
        why = None
        if not self.graph or self.pool is None:
            why = ("the fused step runs inside the captured graph (graph=True, a CUDA device)"
                   if not self.graph else "the fused step runs pooled models")
        else:
            try:
                return FusedStep(self.model, self.pool, self.cache, self.max_batch,
                                 self._layer_windows())
            except Unsupported as e:
                why = str(e)
        if want:
            raise ValueError(f"fused=True, but {why}")
        log.info("cupool: the decode step runs the model's forward: %s", why)
        return None

    def _layer_windows(self) -> list[int | None]:
        """Each layer's attention window, as the fused steps take them (None: full attention)."""
        types = getattr(self.model.config, "layer_types", None)
        return [self._window.get(types[i]) if isinstance(self._window, dict) else self._window
                for i in range(len(self.cache.keys))]

    def _narrow_width(self, active: int) -> int:
        """The width of the narrow step that runs `active` requests (0: the step of every
        slot): the narrowest that holds them."""
        return next((w for w in self._narrow if w >= active), 0)

    def _narrow_steps(self, want: bool):
        """({width: the FusedStep of that many of the cache's slots} for the widths 1, 2, 4, ...
        below max_batch, or {}; why none, or None)."""
        if not want:
            return {}, "narrow=False"
        if self._fused is None:
            return {}, "the decode step runs the model's own forward"
        if self.max_batch == 1:
            return {}, "max_batch is 1: every step is a step of one slot"
        if (why := self._fused.narrow_why()) is not None:
            return {}, why
        from cupool.fused import FusedStep, Unsupported
        windows = self._layer_windows()
        steps, w = {}, 1
        try:
            while w < self.max_batch:
                steps[w] = FusedStep(self.model, self.pool, self.cache, w, windows)
                w *= 2
        except Unsupported as e:          # what fits B tokens fits fewer; said, not hidden
            log.info("cupool: no narrow step of %d slots: %s", w, e)
            return {}, str(e)
        return steps, None

    def _masks(self, make):
        """make(window) for the model's one window, or a dict of them by layer type (None for
        the layers that take no mask)."""
        if isinstance(self._window, dict):
            return {kind: (None if w is NO_MASK else make(w)) for kind, w in self._window.items()}
        return make(self._window)

    # --- requests -----------------------------------------------------------------------------------
    def submit(self, prompt_ids, params: SamplingParams | None = None,
               on_event: Callable[[Event], None] | None = None, constraint=None, *,
               resume_at: int | None = None) -> Request:
        """Queue a request; ValueError for token ids outside the vocabulary, a prompt that
        cannot fit, or a bad `resume_at`. `on_event` is called (on the engine's thread) for every
        event.

        `resume_at` (0 ≤ resume_at ≤ the prompt's length, or None): a position a later request is
        expected to resume from, e.g. the end of a chat's conversation before the generation
        prompt (`cupool serve` gives it). For a model with recurrent layers the prefill ends a
        chunk there and keeps the states as a resume point, beside the end of the prompt and of
        the request; for attention alone it changes nothing (any common prefix is reused).

        `constraint` (a grammar's matcher, or None) masks the tokens the request may sample:
        `fill(words)` writes the allowed ids of its next token into an int32 [ceil(V / 32)] row
        (`cupool.sampling.apply_token_mask`'s layout), `accept(token)` takes the sampled token,
        `done()` says the constraint is complete (the request then ends with "stop"). Steps of
        a constrained request are not pipelined: each mask needs the token before it."""
        if self.broken:
            raise RuntimeError(f"the engine stopped after an error: {self.broken}")
        params = params if params is not None else SamplingParams()
        params.validate()
        if isinstance(prompt_ids, torch.Tensor):
            prompt_ids = prompt_ids.reshape(-1).tolist()
        ids = list(prompt_ids)
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        # builtins over the list (no Python loop a token: a long prompt's next turn repeats it)
        if not set(map(type, ids)) <= {int} and \
                not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError("prompt token ids must be ints")
        if min(ids) < 0 or max(ids) >= self.vocab:
            bad = next(i for i in ids if not 0 <= i < self.vocab)
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {self.vocab})")
        if resume_at is not None and (isinstance(resume_at, bool) or
                                      not isinstance(resume_at, int) or
                                      not 0 <= resume_at <= len(ids)):
            raise ValueError(f"resume_at must be an int in [0, {len(ids)}] (the prompt's "
                             f"length), got {resume_at!r}")
        need = len(ids) + params.max_tokens
        if need > self.max_len:
            raise ValueError(f"the prompt's {len(ids)} tokens + max_tokens {params.max_tokens} = "
                             f"{need} exceed the context of {self.max_len} tokens (max_len)")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (the engine has none); use "
                             "stop_token_ids")
        req = Request(ids, params, on_event, constraint, resume_at)
        self._incoming.put(req)
        return req

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 on_event: Callable[[Event], None] | None = None) -> list[Request]:
        """Run `prompts` (a list of token-id lists) to completion on this thread; returns their
        Requests in order (output_ids, text, finish_reason)."""
        if self._thread is not None:
            raise RuntimeError("the engine runs a background loop (start()); use submit()")
        if isinstance(params, list):
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        else:
            params = [params] * len(prompts)
        reqs = [self.submit(p, sp, on_event) for p, sp in zip(prompts, params)]
        while not all(r.finished for r in reqs):
            self.iterate()
        return reqs

    def stream(self, prompt_ids, params: SamplingParams | None = None):
        """Yield the Events of one request as they land (runs the engine on this thread)."""
        got: list[Event] = []
        self.submit(prompt_ids, params, got.append)
        while True:
            while got:
                ev = got.pop(0)
                yield ev
                if ev.finished:
                    return
            self.iterate()

    def run_until_idle(self) -> None:
        """Iterate until every submitted request has finished."""
        while self.iterate():
            pass

    # --- the background loop (servers) --------------------------------------------------------------
    def start(self) -> None:
        """Run the engine on a background thread until `shutdown()`."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="cupool-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the background loop; unfinished requests end with finish_reason "cancelled"."""
        self._stop.set()
        self._incoming.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise RuntimeError(f"the engine's loop did not stop within {timeout} s")
            self._thread = None
        for r in self._pending + [r for r in self._slots if r is not None]:
            self._finish(r, FINISH_CANCELLED)
        self._pending.clear()
        self._slots = [None] * self.max_batch

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                busy = self.iterate(block=True)
            except Exception as e:  # noqa: BLE001 (the engine reports, then refuses new work)
                log.exception("cupool: the engine stopped")
                self.broken = f"{type(e).__name__}: {e}"
                self.broken_error = e
                for r in self._pending + [r for r in self._slots if r is not None]:
                    r.error = self.broken
                    self._finish(r, FINISH_ERROR)
                self._pending.clear()
                self._slots = [None] * self.max_batch
                return
            if not busy and self._stop.is_set():
                return

    # --- one iteration ------------------------------------------------------------------------------
    def iterate(self, block: bool = False) -> bool:
        """Admit queued requests into free slots, run one decode step, read the one before.
        Returns whether anything is still running or queued. `block`: wait for a request when
        there is nothing to do."""
        self._take_incoming(block and not self._busy())
        for b, r in enumerate(self._slots):
            if r is not None and r.cancelled.is_set():
                self._finish(r, FINISH_CANCELLED)
                self._free(b)
        self._admit_pending()
        launched = None
        if self._inflight is not None and self._kind().masked:
            self._read_step(*self._inflight)          # a token mask needs the token before it
            self._inflight = None
        if any(r is not None for r in self._slots):
            launched = self._launch_step()
        if self._inflight is not None:
            self._read_step(*self._inflight)
        self._inflight = launched
        if launched is None and self._inflight is None and not self._pending:
            return not self._incoming.empty()
        return True

    def _busy(self) -> bool:
        return bool(self._pending) or self._inflight is not None or \
            any(r is not None for r in self._slots)

    def _take_incoming(self, block: bool) -> None:
        try:
            item = self._incoming.get(timeout=0.05) if block else self._incoming.get_nowait()
        except queue.Empty:
            return
        while True:
            if item is not None:
                self._pending.append(item)
            try:
                item = self._incoming.get_nowait()
            except queue.Empty:
                return

    # --- prefill --------------------------------------------------------------------------------------
    def _fwd_kwargs(self, mask) -> dict:
        return {self._cache_kw: self.cache, "use_cache": self._use_cache, "attention_mask": mask,
                **self._logits_kw}

    def _admit_pending(self) -> None:
        """Admit queued requests into free slots, in order. With `batch_prefill`, consecutive
        requests that reuse nothing are prefilled together in one forward while their rows (the
        longest prompt's length each) fit one prefill chunk; the others one at a time."""
        rows: list[tuple[int, Request]] = []
        longest = 0                                # the rows' longest prompt
        while self._pending and None in self._slots:
            r = self._pending.pop(0)
            if r.cancelled.is_set():
                self._finish(r, FINISH_CANCELLED)
                continue
            b, start, entry = self._take_slot(r)
            if self._rows_take(r, start):
                if (len(rows) + 1) * max(longest, len(r.prompt_ids)) > self.prefill_chunk:
                    self._admit_rows(rows)
                    rows, longest = [], 0
                self._slots[b] = r                 # held for it: the next take skips the slot
                rows.append((b, r))
                longest = max(longest, len(r.prompt_ids))
                continue
            self._admit_rows(rows)
            rows, longest = [], 0
            self._admit(b, r, start, entry)
        self._admit_rows(rows)

    def _rows_take(self, r: Request, start: int) -> bool:
        """Whether r may be prefilled beside other requests (`_admit_rows`): batch_prefill on, a
        model whose slots hold keys and values alone (known once a prefill has run), nothing
        reused and no resume point inside the prompt."""
        return (start == 0 and self.prefill_tokens > 0 and self._rows_why() is None
                and len(r.prompt_ids) <= self.prefill_chunk
                and self.prefix.point_in_prompt(r.resume_at, 0, len(r.prompt_ids)) is None)

    def _claim(self, b: int, r: Request, start: int) -> None:
        """Slot b is r's: its sampling settings, and the prompt tokens it prefills from `start`."""
        self._slots[b] = r
        r.cached_tokens = start
        self.prefill_tokens += len(r.prompt_ids) - start
        p = r.params
        self.temperature[b] = float(p.temperature)
        self.top_k[b] = int(p.top_k)
        self.top_p[b] = float(p.top_p)
        self.seeds[b] = r.seed
        self.steps[b] = 0

    @torch.inference_mode()
    def _admit(self, b: int, r: Request, start: int = 0, entry: int | None = None) -> None:
        """Run r's prompt from position `start` (the slot holds the KV of the tokens before it,
        and saved entry `entry` the recurrent states after them) into slot b, keeping a resume
        point at r.resume_at on the way, and sample its first token (one host read)."""
        dev, S = self.device, len(r.prompt_ids)
        ids = torch.tensor(r.prompt_ids[start:], dtype=torch.int64, device=dev)   # [S - start]
        self._claim(b, r, start)
        if start == 0:
            self.cache.reset_slot(b)     # clean per-slot states (attention rows need nothing)
        elif entry is not None:
            self.prefix.saved.load(entry, b)
        point = self.prefix.point_in_prompt(r.resume_at, start, S)
        if point == start:                   # the loaded state is the point's
            self.prefix.keep_point(b, point)
        try:
            logits = None
            with self._prefilling():
                for a, e in self._chunks(start, S, point):
                    self.cache.prefill_mode(b, a, e - a)
                    mask = self._masks(lambda w: self.cache.prefill_mask(self.dtype, w,
                                                                          self._mask_bool))
                    with self._prefill_attention(a, e):
                        out = self.model(input_ids=ids[None, a - start:e - start],
                                         position_ids=torch.arange(a, e, device=dev)[None],
                                         **self._fwd_kwargs(mask))
                    logits = out.logits[:, -1, :]
                    if e == point:
                        self.prefix.keep_point(b, point)
            self.prefix.prompt_done(b, S)
        finally:
            self.cache.decode_mode()
        self._first_token(b, r, logits)

    @torch.inference_mode()
    def _admit_rows(self, rows: list[tuple[int, Request]]) -> None:
        """Prefill the prompts of `rows` (slot, request; slots held for them, nothing reused)
        together: one forward of [n, S] tokens, S the longest prompt, the shorter ones padded
        with their last token at the end (positions their prompt's tokens never attend), then
        each request's first token from its own last position."""
        if len(rows) <= 1:
            for b, r in rows:
                self._admit(b, r)
            return
        dev = self.device
        lens = [len(r.prompt_ids) for _, r in rows]
        S = max(lens)
        ids = torch.tensor([r.prompt_ids + r.prompt_ids[-1:] * (S - len(r.prompt_ids))
                            for _, r in rows], dtype=torch.int64, device=dev)
        for b, r in rows:
            self._claim(b, r, 0)
            self.cache.reset_slot(b)
        kwargs = {}
        keep = sorted(set(n - 1 for n in lens))          # the rows' last positions
        if self._logits_kw:
            kwargs["logits_to_keep"] = torch.tensor(keep, device=dev)
        try:
            with self._prefilling():
                self.cache.prefill_rows_mode([b for b, _ in rows], S)
                mask = self._masks(lambda w: self.cache.prefill_mask(self.dtype, w,
                                                                      self._mask_bool))
                with self._prefill_attention(0, S):
                    out = self.model(input_ids=ids,
                                     position_ids=torch.arange(S, device=dev).repeat(len(rows), 1),
                                     **{**self._fwd_kwargs(mask), **kwargs})
            for (b, r), n in zip(rows, lens):
                self.prefix.prompt_done(b, n)
        finally:
            self.cache.decode_mode()
        for i, ((b, r), n) in enumerate(zip(rows, lens)):
            at = keep.index(n - 1) if self._logits_kw else n - 1
            self._first_token(b, r, out.logits[i:i + 1, at, :])

    def _first_token(self, b: int, r: Request, logits: torch.Tensor) -> None:
        """Sample r's first token from its prompt's last logits [1, V] (one host read), and make
        slot b a decoding one."""
        p = r.params
        scores = logits
        if r.constraint is not None:
            self._fill_masks([b])
            scores = apply_token_mask(logits, self.mask[b:b + 1])
        first = self._sample(scores, slice(b, b + 1), greedy=p.temperature == 0)
        lp = token_logprobs(logits, first) if p.logprobs is not None else None
        self.cache.pos[b] = len(r.prompt_ids)
        self.tok[b, 0] = first[0]
        self.steps[b] = 1
        self.active[b] = True
        token = int(first[0])                                 # the admission's one host read
        r.first_token_at = time.perf_counter()
        if lp is not None:
            self._note_logprobs(r, token, *(t[0].tolist() for t in lp))
        self._accept(b, r, token)

    def _prefilling(self):
        """The context a prompt's prefill forward runs in: the pool's `prefilling()` (every pooled
        layer on the partition path, the placement untouched), nothing without a pool."""
        return self.pool.prefilling() if self.pool is not None else contextlib.nullcontext()

    def _prefill_attention(self, a: int, e: int):
        """Where the prefill forward of positions [a, e) runs torch's SDPA: on a GPU, cuDNN's
        attention only for a whole chunk that starts at a multiple of `prefill_chunk`. cuDNN
        builds a plan for each new pair of query and key lengths, which took 40 ms to over 1 s
        a request on an H100 and an H200 (docs/PERFORMANCE.md); such chunks repeat a few pairs
        of lengths, where cuDNN's plans are built once and it is the fastest, while a prompt's
        last chunk, and every chunk after a reused prefix, almost always has lengths no request
        before it had."""
        n = self.prefill_chunk
        if self.device.type != "cuda" or (e - a == n and a % n == 0):
            return contextlib.nullcontext()
        return sdpa_kernel(_NOT_CUDNN)

    def _chunks(self, start: int, stop: int, point: int | None):
        """[a, e) of each prefill forward of positions [start, stop): `prefill_chunk` tokens each,
        one ending at `point` (where one is given inside), the chunks after it counted from it."""
        cuts = [start, point, stop] if point is not None and start < point < stop else \
            [start, stop]
        for lo, hi in zip(cuts, cuts[1:]):
            for a in range(lo, hi, self.prefill_chunk):
                yield a, min(hi, a + self.prefill_chunk)

    # --- logprobs and token masks (the sampling step's extra outputs and input) -----------------
    def _note_logprobs(self, r: Request, token: int, chosen: float, top_vals, top_ids) -> None:
        """Keep the logprobs of r's sampled `token` (its top r.params.logprobs alternatives)."""
        k = r.params.logprobs
        r.logprobs.append((token, float(chosen), list(zip(top_ids[:k], top_vals[:k]))))

    def _fill_masks(self, slots) -> None:
        """Copy the constraints' next-token masks of `slots` into the device mask (other rows: all
        ids allowed). Runs on the host between steps."""
        host = self._host_mask
        host.fill_(-1)
        for b in slots:
            r = self._slots[b]
            if r is not None and r.constraint is not None:
                r.constraint.fill(host[b])
        self.mask.copy_(host)       # pageable memory: the host row is free again on return

    def _kind(self) -> "StepKind":
        """The step variant the active slots need (each variant is its own captured graph)."""
        live = [r for r in self._slots if r is not None]
        hd = self.pool.host if self.pool is not None else None
        host = hd is not None and hd.hands_over(len(live))
        return StepKind(greedy=all(r.params.temperature == 0 for r in live),
                        logprobs=any(r.params.logprobs is not None for r in live),
                        masked=any(r.constraint is not None for r in live), host=host,
                        width=0 if host else self._narrow_width(len(live)))

    def _set_slot_map(self, width: int) -> None:
        """The slot map's first `width` entries: the active slots, then free ones (distinct, as
        the narrow step needs), written to the device where they changed (a pinned row and its
        stream-ordered copy; a change waits only for the copy before it)."""
        live = [b for b, r in enumerate(self._slots) if r is not None]
        order = live + [b for b in range(self.max_batch) if self._slots[b] is None]
        order = tuple(order[:width])
        if order == self._map_order[:width]:
            return
        if self._map_ready is not None:
            self._map_ready.synchronize()      # the last copy has read the pinned row
        self._map_host[:width] = torch.tensor(order, dtype=torch.int64)
        self._slot_map[:width].copy_(self._map_host[:width], non_blocking=True)
        if self._map_ready is not None:
            self._map_ready.record()
        self._map_order = order + self._map_order[width:]

    # --- decode steps ---------------------------------------------------------------------------------
    def _step(self, kind: "StepKind") -> None:
        """One decode step of every slot (or of the slot map's first `kind.width`), device-only
        (what the graph captures)."""
        plain = self.pool is not None and self.pool.host is not None and not kind.host
        with self.pool.plain_decode() if plain else contextlib.nullcontext():
            self._decode(kind)

    def _decode(self, kind: "StepKind") -> None:
        self.cache.decode_mode()
        if kind.width:
            self._decode_narrow(kind)
            return
        fused = self._fused
        if fused is None or fused.needs_mask:
            mask = self._masks(lambda w: self.cache.decode_mask(self.dtype, w, self._mask_bool))
        else:
            mask = None
        if fused is not None:
            logits = fused(self.tok, self.cache.pos, self.active, mask)
        else:
            out = self._forward(input_ids=self.tok, position_ids=self.cache.pos[:, None],
                                **self._fwd_kwargs(mask))
            logits = out.logits[:, -1, :]
        scores = apply_token_mask(logits, self.mask) if kind.masked else logits
        nxt = self._sample(scores, slice(None), kind.greedy)
        if kind.logprobs:
            for buf, val in zip((self.lp_chosen, self.lp_top, self.lp_ids),
                                token_logprobs(logits, nxt)):
                buf.copy_(val)
        act = self.active
        self.tok[:, 0] = torch.where(act, nxt, self.tok[:, 0])
        self.cache.pos.add_(act.to(torch.int64)).clamp_(max=self.max_len - 1)
        self.steps.add_(act.to(torch.int64))

    def _decode_narrow(self, kind: "StepKind") -> None:
        """`_decode` for the slot map's first `kind.width` slots alone: the narrow fused step
        over their cache rows, then their rows of the sampling, logprobs, token and position
        updates, gathered from and put back into the slots' rows."""
        w = kind.width
        rows = self._slot_map[:w]
        act = self._narrow_active[:w]
        torch.index_select(self.active, 0, rows, out=act)
        tok = self.tok.index_select(0, rows)
        pos = self.cache.pos.index_select(0, rows)
        logits = self._narrow[w](tok, pos, act, None, slots=rows)
        scores = apply_token_mask(logits, self.mask.index_select(0, rows)) if kind.masked \
            else logits
        nxt = self._sample(scores, rows, kind.greedy)
        if kind.logprobs:
            for buf, val in zip((self.lp_chosen, self.lp_top, self.lp_ids),
                                token_logprobs(logits, nxt)):
                buf.index_copy_(0, rows, val)
        step = act.to(torch.int64)
        self.tok.index_copy_(0, rows, torch.where(act, nxt, tok[:, 0])[:, None])
        self.cache.pos.index_copy_(0, rows, (pos + step).clamp_(max=self.max_len - 1))
        self.steps.index_add_(0, rows, step)

    def _sample(self, scores: torch.Tensor, rows: slice, greedy: bool) -> torch.Tensor:
        """Next tokens int64 [B] of `rows` (a slice or int64 index of the slots) from their
        scores [B, V]: the argmax where every row is greedy; else on a GPU the sampling kernel
        (`cupool.ops.sampler.Sampler`, for bf16 and fp16 logits), elsewhere `sample`'s tensor ops
        (its reference). Same tokens for a request whichever rows it shares a call with."""
        args = (self.temperature[rows], self.top_k[rows], self.top_p[rows], self.seeds[rows],
                self.steps[rows])
        if greedy:
            return sample(scores, *args, greedy_only=True)
        if scores.is_cuda and scores.dtype in LOGIT_DTYPES:
            s = self._sampler
            if s is None or s.vocab != scores.shape[-1] or s.dtype != scores.dtype:
                if torch.cuda.is_current_stream_capturing():
                    raise RuntimeError("the sampling kernel's workspace must exist before a step "
                                       "is captured (the step's warm-up makes it)")
                s = self._sampler = Sampler(self.max_batch, scores.shape[-1], scores.dtype,
                                            self.device)
                log.info("cupool: sampling with rawkernels/sample.cu (%s logits, %d ids)",
                         str(scores.dtype).removeprefix("torch."), s.vocab)
            return s(scores, *args)
        if scores.is_cuda and not self._sampler_warned:
            self._sampler_warned = True
            log.warning("cupool: the model's logits are %s; sampling runs as tensor ops with a "
                        "sort of the vocabulary each step (rawkernels/sample.cu takes bf16 or "
                        "fp16 logits)", scores.dtype)
        return sample(scores, *args)

    @contextlib.contextmanager
    def _masked(self, kind: "StepKind"):
        """The pool's token mask set to the step's active slots for the duration of a step."""
        if self.pool is not None:
            self.pool.token_mask = self._narrow_active[:kind.width] if kind.width else \
                self.active
        try:
            yield
        finally:
            if self.pool is not None:
                self.pool.token_mask = None

    def _capture(self, kind: "StepKind") -> torch.cuda.CUDAGraph:
        """Warm up and capture the step (gate closed, every slot inactive meanwhile: the dummy
        steps write only positions no slot has filled yet and move no rows; per-slot states,
        which every step advances, are put back afterwards)."""
        dev = self.device
        saved = self.active.clone()
        states = self.cache.snapshot()   # the dummy steps advance every slot's states
        if self.pool is not None:
            self.pool.close()
        self.active.zero_()
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side), self._masked(kind):
            for _ in range(3):
                self._step(kind)
        torch.cuda.current_stream(dev).wait_stream(side)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        # A collection during capture could free another engine's graph, whose teardown is not
        # allowed while a stream captures (it invalidates this capture): collect first, then hold.
        gc.collect()
        gc.disable()
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self._graph_pool), self._masked(kind):
                self._step(kind)
        finally:
            gc.enable()
        self.active.copy_(saved)
        self.cache.restore(states)
        if self.pool is not None:
            self.pool.open()
        return g

    @torch.inference_mode()
    def _launch_step(self):
        kind = self._kind()
        if kind.masked:
            self._fill_masks(range(self.max_batch))
        if kind.width:
            self._set_slot_map(kind.width)
        if self.graph:
            g = self._graphs.get(kind)
            if g is None:
                g = self._graphs[kind] = self._capture(kind)
            g.replay()
        else:
            with self._masked(kind):
                self._step(kind)
        self.steps_run += 1
        buf, ev = self._host_tok[self._flip], self._host_ready[self._flip]
        lp = self._host_lp[self._flip] if kind.logprobs else None
        self._flip ^= 1
        buf.copy_(self.tok[:, 0], non_blocking=True)
        if lp is not None:
            for host, dev in zip(lp, (self.lp_chosen, self.lp_top, self.lp_ids)):
                host.copy_(dev, non_blocking=True)
        if ev is not None:
            ev.record()
        owners = list(self._slots)
        for r in owners:
            if r is not None:
                r._fed += 1                 # this step fed r's newest token (prefix reuse)
        return buf, ev, owners, lp

    def _read_step(self, buf, ev, owners, lp=None) -> None:
        if ev is not None:
            ev.synchronize()
        tokens = buf.tolist()
        lists = [t.tolist() for t in lp] if lp is not None else None
        for b, r in enumerate(owners):
            if r is None or r.finished or self._slots[b] is not r:
                continue                      # finished after the step was launched
            if lists is not None and r.params.logprobs is not None:
                self._note_logprobs(r, tokens[b], lists[0][b], lists[1][b], lists[2][b])
            self._accept(b, r, tokens[b])

    # --- output -----------------------------------------------------------------------------------
    def _accept(self, b: int, r: Request, token: int) -> None:
        """Take one sampled token of r (in slot b): check stops, emit, free the slot when done."""
        p = r.params
        if r.constraint is not None:
            r.constraint.accept(token)
        if (not p.ignore_eos and token in self.eos_ids) or token in p.stop_token_ids:
            del r.logprobs[len(r.output_ids):]       # a stop token is not part of the output
            r._stop_token = token
            self._finish(r, FINISH_STOP)
            self._free(b)
            return
        r.output_ids.append(token)
        reason = None
        if self.tokenizer is not None:
            before = len(r.text)
            self._detokenize(r)
            if p.stop:                               # only where a stop string can newly end
                tail = max(0, before - max(len(x) for x in p.stop) + 1)
                hits = [(i, x) for x in p.stop if (i := r.text.find(x, tail)) >= 0]
                if hits:
                    r.text = r.text[:min(hits)[0]]
                    r.stop_string = min(hits)[1]
                    reason = FINISH_STOP
        if reason is None and r.constraint is not None and r.constraint.done():
            reason = FINISH_STOP
        if reason is None and (len(r.output_ids) >= p.max_tokens
                               or len(r.prompt_ids) + len(r.output_ids) >= self.max_len):
            reason = FINISH_LENGTH
        if reason is None:
            self._emit(r, token, final=False)
            return
        self._finish(r, reason, token)
        self._free(b)

    def _detokenize(self, r: Request) -> None:
        """Append the text of r's newest token: the decode of the tokens after a lagging offset
        minus the decode of those before the newest (a few tokens of context, so tokenizers that
        space by context agree with a full decode); held while it ends in an incomplete
        character."""
        ids = r._context + r.output_ids
        skip = r.params.skip_special_tokens
        prefix = self.tokenizer.decode(ids[r._prefix_at:r._read_at], skip_special_tokens=skip)
        full = self.tokenizer.decode(ids[r._prefix_at:], skip_special_tokens=skip)
        if full.endswith("\ufffd") or not full.startswith(prefix):
            return                                   # more bytes of a character to come
        r.text += full[len(prefix):]
        r._prefix_at, r._read_at = r._read_at, len(ids)

    def _emit(self, r: Request, token: int | None, final: bool) -> None:
        """Release the text that can no longer change (while running, a possible start of a stop
        string is held back) and call the request's callback; a callback that raises cancels its
        own request only."""
        end = len(r.text)
        if not final and r.params.stop:
            keep = max(len(x) for x in r.params.stop) - 1
            end = max(r._sent, len(r.text) - keep)
        delta = r.text[r._sent:end]
        r._sent = max(r._sent, end)
        if r.on_event is None:
            return
        lp = r.logprobs[-1] if token is not None and r.logprobs else None
        try:
            r.on_event(Event(r, token, delta, final, r.finish_reason if final else None, lp))
        except Exception as e:  # noqa: BLE001 (a caller's bug must not stop the other requests)
            log.exception("cupool: the event callback of request %d raised; it is cancelled", r.id)
            r.error = f"its event callback raised {type(e).__name__}: {e}"
            r.cancelled.set()

    def _finish(self, r: Request, reason: str, token: int | None = None) -> None:
        """End r with `reason`: the final event (with its last token, if any), then `done`."""
        if r.done.is_set():
            return
        r.finish_reason = reason
        r.finished = True
        r.finished_at = time.perf_counter()
        self._emit(r, token, final=True)
        r.done.set()

    @torch.inference_mode()
    def _free(self, b: int) -> None:
        r = self._slots[b]
        if r is not None:
            ok = r.finish_reason != FINISH_ERROR
            self.prefix.release(b, self._processed(r) if ok else None)
        self._slots[b] = None
        self.active[b] = False

    # --- prefix reuse (cupool.prefix keeps what free slots hold) ---------------------------------
    @staticmethod
    def _processed(r: Request) -> list[int]:
        """The tokens a finished request's slot has processed, in order: its prompt and the
        sampled tokens its decode steps fed (the stop token included where a step fed it). The
        slot's keys and values hold exactly these positions and its recurrent states cover
        exactly these tokens: every step launched after this point has the slot inactive."""
        sampled = r.output_ids + ([r._stop_token] if r._stop_token is not None else [])
        return r.prompt_ids + sampled[:r._fed]

    def _take_slot(self, r: Request) -> tuple[int, int, int | None]:
        """(slot, positions to reuse, saved states to load) for r (`PrefixCache.take`)."""
        free = [b for b, x in enumerate(self._slots) if x is None]
        return self.prefix.take(r.prompt_ids, free)

    def close(self) -> None:
        """Release the captured graphs and the KV cache (the engine cannot run afterwards).
        Engines hold GPU memory until closed or collected; close one before building another."""
        if self._thread is not None:
            self.shutdown()
        self._graphs.clear()
        self._graph_pool = None
        self.prefix.close()
        self.cache.release()
        self.broken = self.broken or "closed"

    # --- facts ----------------------------------------------------------------------------------------
    @property
    def fused_step(self):
        """The fused decode step (`cupool.fused.FusedStep`) this engine runs, or None where it
        runs the model's own forward (`step_kind` says which)."""
        return self._fused

    @property
    def resume_point_bytes(self) -> int:
        """Device bytes of one resume point: one slot's recurrent states (0 for a model of
        attention layers alone, and before the first prefill allocates the states). The saved
        points take `resume_points` times this, allocated on the first save."""
        return self.prefix.saved.entry_bytes()

    @property
    def batch_prefill(self) -> bool:
        """Whether prompts that arrive together may be prefilled in one forward (the argument,
        where the model allows it; recurrent states, found at the first prefill, still keep
        each prompt alone: `prefill_kind`)."""
        return self._rows_unfit is None

    def _rows_why(self) -> str | None:
        """Why prompts are prefilled each alone, as far as is known: `_rows_unfit`, or the
        recurrent states the model's slots hold (known once a prefill has run); None if not."""
        if self._rows_unfit is None and self.prefill_tokens and self.cache.state_tensors():
            return "the model's slots hold recurrent states"
        return self._rows_unfit

    @property
    def prefill_kind(self) -> str:
        """How prompts that arrive together are prefilled, in words (`serve` logs it): together
        in one forward (`batch_prefill`), or each alone and why. Whether the model's slots hold
        recurrent states is known once a prefill has run (`warmup`)."""
        why = self._rows_why()
        if why is not None:
            return f"each prompt alone ({why})"
        together = (f"prompts that arrive together in one forward, up to {self.prefill_chunk} "
                    f"tokens (those that reuse a prefix alone)")
        if not self.prefill_tokens:
            return together + " where the slots hold no recurrent states (known after a prompt)"
        return together

    def stats(self) -> dict:
        """Occupancy: running sequences, requests waiting for a slot, decode steps run so far.
        Read from any thread (a snapshot; it may be one iteration old)."""
        return {"running": sum(r is not None for r in self._slots),
                "waiting": len(self._pending) + self._incoming.qsize(),
                "slots": self.max_batch, "steps": self.steps_run}

    def warmup(self) -> None:
        """Run the requests whose first run would otherwise fall on a user's first request, so
        that `serve` says "ready" only once they are done:
        - two one-token prompts (greedy, then sampled): the KV cache allocated and both decode
          graphs captured (with host experts, also the two of steps with enough active slots to
          hand the host a share; with narrow steps, each width's two);
        - a prompt of `warmup_prompt_tokens()` tokens, then (prefix reuse on) the same prompt
          with a few more tokens, prefilled from the slot that holds it: a whole prefill chunk
          runs the wide calls a one-token prompt does not (the pool's prefill builds for calls
          whose lanes cover every expert, attention and the dense layers' GEMMs at that width),
          and the second a prefill continued from a slot's cache.
        The pool's counters are reset after. Call it before `start()`."""
        if self._thread is not None:
            raise RuntimeError("warmup() must run before start()")
        for t in (0.0, 1.0):
            self.generate([[0]], SamplingParams(temperature=t, max_tokens=2, seed=0,
                                                ignore_eos=True))
        n = self.warmup_prompt_tokens()
        if n > 1:
            prompt = [(7919 * i + 1) % self.vocab for i in range(n + WARMUP_MORE)]
            once = SamplingParams(max_tokens=1, ignore_eos=True)
            self.generate([prompt[:n]], once)
            if self.reuse_prefix:
                self.generate([prompt], once)
        hd = self.pool.host if self.pool is not None else None
        if self.graph and hd is not None and hd.hands_over(self.max_batch):
            with torch.inference_mode():     # the steps of enough slots to hand the host a share
                for greedy in (True, False):
                    kind = StepKind(greedy=greedy, logprobs=False, masked=False, host=True)
                    if kind not in self._graphs:
                        self._graphs[kind] = self._capture(kind)
        if self.graph and self._narrow:
            with torch.inference_mode():     # the narrow steps (a graph a width)
                for w in self._narrow:
                    for greedy in (True, False):
                        kind = StepKind(greedy=greedy, logprobs=False, masked=False, width=w)
                        if kind not in self._graphs:
                            self._graphs[kind] = self._capture(kind)
        if self.pool is not None:
            self.pool.bank.reset_stats()

    def warmup_prompt_tokens(self) -> int:
        """The long prompt of `warmup()`: one prefill chunk (at most WARMUP_LONGEST tokens),
        leaving room in a slot for the few tokens its continuation adds and the one token each
        asks for."""
        return max(1, min(self.prefill_chunk, WARMUP_LONGEST, self.max_len - WARMUP_MORE - 2))

    def __repr__(self) -> str:
        return (f"Engine(B={self.max_batch}, max_len={self.max_len}, step={self.step_kind}, "
                f"{'pool' if self.pool is not None else 'no pool'}, {self.device})")
