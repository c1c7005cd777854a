"""Launcher of `rawkernels/sample.cu`: the next token of each row of bf16 or fp16 logits, as
`cupool.sampling.sample` (the reference) draws it, in three launches and no sort.

Shape legend: B rows (a decode step's slots) · V vocabulary.

`Sampler` owns the kernels' workspace (a 65,536-key histogram a row and its coarse counts, the
row's cut, block counts, tickets), allocated zeroed once at fixed addresses, so a captured decode
step can hold its launches; every call leaves the workspace zeroed again. Rows never exchange
anything, so a row's token is the same alone or beside others. The kernel and the reference agree
on every token except where top_p times the kept mass lies within their rounding of the mass
ahead of a group of equal logits (sample.cu's header): the reference adds float32 probabilities
in sorted order, the kernel integers.
"""

from __future__ import annotations

import torch

from cupool import _cuda, kernels

THREADS = 256           # sample.cu's THREADS: a block's threads
ITEMS = 8               # sample.cu's ITEMS: consecutive ids a thread
KEYS = 65536            # a 16-bit logit's values: the histogram's bins a row
HIST_WORDS = KEYS + THREADS   # sample.cu's HIST_WORDS: the keys' counts, then coarse bins'

CUT_WORDS = 4           # sample.cu's CUT_WORDS
MAX_VOCAB = (1 << 23) - 1    # the scan's fixed-point sum of a row stays below 2^63
LOGIT_DTYPES = {torch.bfloat16: 0, torch.float16: 1}     # IN_F16


def blocks_for(vocab: int) -> int:
    """Blocks a row takes (THREADS · ITEMS ids each)."""
    return -(-vocab // (THREADS * ITEMS))


class Sampler:
    """Samples rows of `vocab` logits of `dtype` (bf16 or fp16) on `device`, up to `rows` a call.

    `__call__(logits, temperature, top_k, top_p, seeds, steps, out=None)` takes the arguments of
    `cupool.sampling.sample` (logits [B, V] with B <= rows, each row's last dim contiguous) and
    writes the tokens to `out` (int64 [B], allocated when absent), on torch's current stream, with
    no host read: temperature <= 0 is greedy (the first of the largest logits), top_k 0 and top_p
    1 keep every id.
    """

    def __init__(self, rows: int, vocab: int, dtype: torch.dtype, device):
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ValueError(f"rows must be an int >= 1, got {rows!r}")
        if isinstance(vocab, bool) or not isinstance(vocab, int) or not 1 <= vocab <= MAX_VOCAB:
            raise ValueError(f"vocab must be an int in [1, {MAX_VOCAB}], got {vocab!r}")
        if dtype not in LOGIT_DTYPES:
            raise ValueError(f"the sampling kernel takes bf16 or fp16 logits, got {dtype} "
                             f"(cupool.sampling.sample takes any float dtype)")
        if torch.device(device).type != "cuda":
            raise ValueError(f"the sampling kernel runs on a CUDA device, got {device}")
        _cuda.require_gpu("the sampling kernel")
        self.device = torch.device("cuda", _cuda.device_index(device))     # "cuda" -> cuda:N
        self.rows, self.vocab, self.dtype = rows, vocab, dtype
        self.blocks = blocks_for(vocab)
        dev = self.device
        z32 = dict(dtype=torch.int32, device=dev)
        self.hist = torch.zeros(rows, HIST_WORDS, **z32)
        self.cut = torch.zeros(rows, CUT_WORDS, **z32)
        self.counts = torch.zeros(rows, self.blocks, **z32)
        self.tickets = torch.zeros(rows, 2, **z32)
        self.best = torch.zeros(rows, dtype=torch.int64, device=dev)     # u64 words
        defines = {"THREADS": THREADS, "ITEMS": ITEMS, "IN_F16": LOGIT_DTYPES[dtype]}
        self._kernels = [kernels.function("sample", k, defines, dev)
                         for k in ("sample_histogram", "sample_rank", "sample_draw")]

    def check(self, logits, temperature, top_k, top_p, seeds, steps, out) -> int:
        """B of a call, or ValueError naming the argument that does not fit."""
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
            raise ValueError(f"logits must be a 2-D tensor [B, {self.vocab}], got "
                             f"{getattr(logits, 'shape', type(logits).__name__)}")
        B, V = logits.shape
        if logits.dtype != self.dtype or logits.device != self.device or V != self.vocab \
                or not 1 <= B <= self.rows or (B > 1 and logits.stride(0) < V) \
                or logits.stride(1) != 1:
            raise ValueError(f"logits must be {self.dtype} [B <= {self.rows}, {self.vocab}] on "
                             f"{self.device} with contiguous rows, got {logits.dtype} "
                             f"{list(logits.shape)} (strides {list(logits.stride())}) on "
                             f"{logits.device}")
        for name, t, dtype in (("temperature", temperature, torch.float32),
                               ("top_k", top_k, torch.int64), ("top_p", top_p, torch.float32),
                               ("seeds", seeds, torch.int64), ("steps", steps, torch.int64),
                               ("out", out, torch.int64)):
            if name == "out" and t is None:
                continue
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.device != self.device \
                    or tuple(t.shape) != (B,) or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous {dtype} tensor [{B}] on "
                                 f"{self.device}, got "
                                 + (f"{t.dtype} {list(t.shape)} on {t.device}"
                                    if isinstance(t, torch.Tensor) else type(t).__name__))
        return B

    def __call__(self, logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        B = self.check(logits, temperature, top_k, top_p, seeds, steps, out)
        if out is None:
            out = torch.empty(B, dtype=torch.int64, device=self.device)
        hist_k, rank_k, draw_k = self._kernels
        grid, V = (self.blocks, B), kernels.i32(self.vocab)
        stride = kernels.i64(logits.stride(0))
        dev = self.device
        kernels.launch(hist_k, grid, THREADS, (logits, stride, V, self.hist, self.tickets,
                                               temperature, top_k, top_p, self.cut), device=dev)
        kernels.launch(rank_k, grid, THREADS, (logits, stride, V, self.cut, self.counts),
                       device=dev)
        kernels.launch(draw_k, grid, THREADS, (logits, stride, V, self.cut, self.counts,
                                               temperature, seeds, steps, self.best,
                                               self.tickets, out), device=dev)
        return out
