"""Launcher of `rawkernels/host_handoff.cu`: a step's request posted to a `Mailbox` and the host's
answer added in, both inside the stream's work (and a captured graph), no host call between.

    post(x, keys, weights, mailbox)      x [t, H], keys [t, K] int64, weights [t, K]
    wait(mailbox, y, error)              y [t, H] += the answer (in float32, rounded once)
for t up to the mailbox's T tokens (a decode step's, or fewer: a prefill call's); a wait's y has
the t of the post before it.
x, weights and y are float32, bf16 or fp16 CUDA tensors (host_handoff.cu's X_DTYPE, W_DTYPE and
Y_DTYPE builds); the mailbox holds float32.

The mailbox (pinned) numbers its requests with its own device counter (`Mailbox.counter`), so
each replay of a graph waits for its own answer; `error` is an int32 CUDA tensor [1] that gets
ERR_HOST_STALL when an answer takes more than about a second. A post whose keys are all -1 (the
planner handed nothing over) sends nothing, and its wait adds nothing: no round trip.
"""

from __future__ import annotations

import torch

from cupool import kernels
from cupool.kernels import i32, i64

ERR_HOST_STALL = 1        # host_handoff.cu's
THREADS = 256
MAX_BLOCKS = 32
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}   # host_handoff.cu's codes


def blocks_for(n: int) -> int:
    """The grid of a post or wait of n values: one block per THREADS · 4 (each thread moves 4
    values a pass, 16 bytes across PCIe), at most MAX_BLOCKS."""
    return max(1, min(MAX_BLOCKS, -(-int(n) // (4 * THREADS))))


def _check_cuda(name, t, dtype, shape=None):
    if not isinstance(t, torch.Tensor) or not t.is_cuda or t.dtype not in (
            dtype if isinstance(dtype, tuple) else (dtype,)) or not t.is_contiguous():
        got = (f"{t.dtype} {list(t.shape)} on {t.device}" if isinstance(t, torch.Tensor)
               else type(t).__name__)
        raise ValueError(f"{name}: expected a contiguous CUDA tensor of "
                         f"{dtype if not isinstance(dtype, tuple) else ' or '.join(map(str, dtype))}"
                         f"{'' if shape is None else f' {list(shape)}'}, got {got}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(t.shape)}")


def _device_addresses(mailbox):
    a = mailbox.device_addresses
    if a is None:
        raise ValueError("mailbox: not pinned (Mailbox(pinned=True) is what a GPU can reach)")
    return a


def _tokens(name, t, mailbox) -> int:
    """t's rows: 1 ..= the mailbox's tokens (ValueError naming `name` otherwise)."""
    T = t.shape[0] if isinstance(t, torch.Tensor) and t.dim() >= 1 else 0
    if not 1 <= T <= mailbox.tokens:
        got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name}: expected 1 to {mailbox.tokens} rows (the mailbox's tokens), "
                         f"got {got}")
    return T


def post(x: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, mailbox) -> None:
    """Writes the request (x as float32, keys, weights, its size) into `mailbox` and then its
    number."""
    T, H, K = _tokens("x", x, mailbox), mailbox.hidden, mailbox.lanes
    a = _device_addresses(mailbox)
    _check_cuda("x", x, tuple(DTYPES), (T, H))
    _check_cuda("keys", keys, torch.int64, (T, K))
    _check_cuda("weights", weights, tuple(DTYPES), (T, K))
    counter = mailbox.counter
    if x.device != counter.device:
        raise ValueError(f"x: on {x.device}, the mailbox is for {counter.device}")
    fn = kernels.function("host_handoff", "host_post",
                          {"X_DTYPE": DTYPES[x.dtype], "W_DTYPE": DTYPES[weights.dtype]}, x.device)
    kernels.launch(fn, blocks_for(T * H), THREADS,
                   (x, i32(T * H), keys, weights, i32(T * K), counter, i64(a["seq"]),
                    i64(a["size"]), i64(a["x"]), i64(a["keys"]), i64(a["weights"])),
                   device=x.device)


def wait(mailbox, y: torch.Tensor, error: torch.Tensor) -> None:
    """y += the answer to the request last posted to `mailbox` (y has that request's rows), once
    the host has written it."""
    T, H = _tokens("y", y, mailbox), mailbox.hidden
    a = _device_addresses(mailbox)
    _check_cuda("y", y, tuple(DTYPES), (T, H))
    _check_cuda("error", error, torch.int32, (1,))
    counter = mailbox.counter
    if y.device != counter.device:
        raise ValueError(f"y: on {y.device}, the mailbox is for {counter.device}")
    fn = kernels.function("host_handoff", "host_wait", {"Y_DTYPE": DTYPES[y.dtype]}, y.device)
    kernels.launch(fn, blocks_for(T * H), THREADS,
                   (counter, i64(a["done"]), i64(a["out"]), i32(T * H), y, error), device=y.device)
