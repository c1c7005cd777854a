"""Stream a checkpoint's routed experts into a `HostStore`, a window of experts at a time.

Shape legend: L layers · E experts · H hidden · I expert intermediate; Hp, Ip = H, I rounded up to
64 (the row layout's padding).

Per window of n experts: read them (`Checkpoint.experts`, only their bytes), turn them into NVFP4
(float: `cupool.nvfp4.quantize` on the CPU, or `cupool.ops.nvfp4_quant.quantize` on a CUDA
device after copying the window there; NVFP4: as read, bit for bit; MXFP4: as the reader
converts them), lay them out as store rows with the experts' biases where they have them
(`cupool.layout.pack_rows`), and write the rows into the store before the next window is read.
Host memory is the store plus one window's temporaries, never a whole layer in float. A fill of
an MXFP4 checkpoint ends with one line on the `cupool` logger: how many blocks converted exactly
and which were requantized (WARNING when any was, INFO otherwise); a fill of block-scaled FP8
experts (read dequantized to float32, quantized like float ones) one line with the matrices'
errors against their FP8 values (`cupool.checkpoints.fp8`; WARNING for outliers).

The temporaries of a window of n experts on the CPU are bounded by n · expert_temp_bytes(layout,
itemsize), with

    expert_temp_bytes = 3 · Hp · Ip · (2 · itemsize + 20) + row_bytes [+ 12 · (2 · Ip + Hp)]

(itemsize: the checkpoint's float element size, 1 for NVFP4 and MXFP4 experts). The terms: the
float window and, for transposed or interleaved layouts, a copy of it (2 · itemsize per weight);
the reference quantizer's float32 work arrays for one matrix at a time, pack_rows' code and index
temporaries and glibc's retained free memory (20 bytes per weight: measured 14-16 bytes per
weight including the bf16 window at windows of 2-4 experts of H = I = 2048,
tests/test_checkpoints_rss.py; reading and converting MXFP4 peaks at 1.1-1.2 bytes per
weight at windows of 2-8 experts of H = I = 2880, its NVFP4 result included); the rows
themselves; and, for a layout with biases, the biases as read, in float32 and taken apart (12
bytes per bias element: 0.1 MB an expert at gpt-oss's H = I = 2880, beside 0.55 GB of weight
temporaries). The default window is the largest n that keeps this ≤ WINDOW_BYTES = 1 GiB, and at
least 1: 3 experts of H = I = 2048 in bf16, 9 of Qwen3-30B-A3B's H = 2048, I = 768; one expert
of DeepSeek-V3 (H = 7168, I = 2048) alone is 1.01 GiB by this bound. With a CUDA device the host
holds only the float window and the rows; the device holds the same bounded temporaries.
"""

from __future__ import annotations

import logging

import torch

from cupool import layout as _layout
from cupool.checkpoints.base import Checkpoint, ExpertKind
from cupool.checkpoints.detect import open_checkpoint
from cupool.checkpoints.errors import CheckpointError
from cupool.nvfp4 import NVFP4Tensor

WINDOW_BYTES = 1 << 30
PER_WEIGHT_TEMP = 20          # bytes of CPU temporaries per weight beyond the float window
PER_BIAS_TEMP = 12            # bytes per bias element: as read (<= 4), float32, taken apart

log = logging.getLogger("cupool")


def expert_temp_bytes(layout: _layout.RowLayout, itemsize: int = 2) -> int:
    """Bound of the host bytes one expert of a window needs while it becomes a row on the CPU
    (module docstring)."""
    bias = PER_BIAS_TEMP * (2 * layout.ip + layout.hp) if layout.bias else 0
    return 3 * layout.hp * layout.ip * (2 * itemsize + PER_WEIGHT_TEMP) + layout.row_bytes + bias


def default_window(layout: _layout.RowLayout, itemsize: int = 2) -> int:
    """Experts per window: the most that keep the temporaries ≤ WINDOW_BYTES (at least 1)."""
    return max(1, WINDOW_BYTES // expert_temp_bytes(layout, itemsize))


def _device(device) -> torch.device:
    dev = torch.device("cpu" if device is None else device)
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be None, 'cpu' or a CUDA device, got {device!r}")
    return dev


def _rows(ck: Checkpoint, ex, layout: _layout.RowLayout, dev: torch.device) -> torch.Tensor:
    """uint8 [n, row_bytes] CPU rows of a window of experts (with their biases, if any); float
    experts converted from FP8 have each matrix's error tallied (`cupool.checkpoints.fp8`)."""
    measure = ex.kind is ExpertKind.FLOAT and ck._layer(ex.layer).source == "fp8"
    if dev.type == "cpu":
        mats = ex.nvfp4()
        floats = (ex.gate, ex.up, ex.down)
    elif ex.kind is ExpertKind.FLOAT:
        from cupool.ops.nvfp4_quant import quantize as gpu_quantize
        mats, floats = [], []
        for proj, w in zip(("gate", "up", "down"), (ex.gate, ex.up, ex.down)):
            if w is None:                                   # experts without a gate
                mats.append(None)
                floats.append(None)
                continue
            wd = w.to(dev)
            try:
                mats.append(gpu_quantize(wd, name=proj))
            except ValueError as e:
                raise CheckpointError(f"layer {ex.layer}, experts [{ex.start}, {ex.stop}): "
                                      f"{e}") from None
            floats.append(wd)
    else:
        mats = [None if q is None else
                NVFP4Tensor(q.packed.to(dev), q.block_scale.to(dev), q.global_scale.to(dev))
                for q in (ex.gate, ex.up, ex.down)]
    if measure:
        from cupool.checkpoints.fp8 import matrix_errors
        for names, q, w in zip(ck.matrix_names(ex.layer, ex.start, ex.stop), mats, floats):
            if q is not None:
                ck.conversion.record(names, *matrix_errors(q, w))
    bias = None if ex.bias is None else tuple(b.to(dev) for b in ex.bias)
    return _layout.pack_rows(layout, *mats, chunk=ex.n, bias=bias).cpu()


def fill_store(store, ckpt, layout: _layout.RowLayout, *, layers=None, device=None,
               window: int | None = None, progress: bool = True) -> None:
    """Fill every row of `store` (num_layers × num_experts) from a checkpoint, layer by layer,
    `window` experts at a time, with a tqdm progress bar counting experts.

    ckpt: an open `Checkpoint` (left open) or a checkpoint directory (opened and closed here).
    layout: the `RowLayout` of H, I, with biases exactly when the checkpoint's experts have them
    (`ckpt.has_bias`) and gated as they are (`ckpt.gated`: False for experts without a gate
    projection, whose rows hold up and down alone); store rows must be layout.row_bytes long
    and the store must have the checkpoint's E experts a layer. layers: the checkpoint layer of
    each store layer (default `ckpt.moe_layers`). device: None / "cpu" quantizes float experts with the CPU
    reference, a CUDA device with the bit-identical GPU kernel; NVFP4 experts are laid out
    unchanged either way. window: experts per window (default `default_window`: temporaries
    ≤ 1 GiB, module docstring). Rows go in through `store.write_row` as each window is done.
    A checkpoint read by conversion (MXFP4, FP8) logs what this fill converted at the end (module
    docstring).
    """
    own = not isinstance(ckpt, Checkpoint)
    ck = open_checkpoint(ckpt) if own else ckpt
    bar = None
    try:
        if (layout.hidden, layout.intermediate) != (ck.hidden, ck.intermediate):
            raise CheckpointError(f"layout is H={layout.hidden}, I={layout.intermediate} but the "
                                  f"experts of {ck.path} are H={ck.hidden}, I={ck.intermediate}")
        if layout.bias != ck.has_bias:
            raise CheckpointError(f"layout has bias={layout.bias} but the experts of {ck.path} "
                                  f"{'have' if ck.has_bias else 'have no'} biases "
                                  f"(has_bias={ck.has_bias}): their rows need RowLayout("
                                  f"{ck.hidden}, {ck.intermediate}, bias={ck.has_bias})")
        if layout.gated != ck.gated:
            raise CheckpointError(f"layout has gated={layout.gated} but the experts of {ck.path} "
                                  f"{'have' if ck.gated else 'have no'} gate projection "
                                  f"(gated={ck.gated}): their rows need RowLayout("
                                  f"{ck.hidden}, {ck.intermediate}, gated={ck.gated})")
        if store.row_bytes != layout.row_bytes:
            raise ValueError(f"store rows are {store.row_bytes} bytes but the layout's rows are "
                             f"{layout.row_bytes} (H={layout.hidden}, I={layout.intermediate})")
        if store.num_experts != ck.num_experts:
            raise ValueError(f"the store has {store.num_experts} experts a layer, the checkpoint "
                             f"{ck.num_experts}")
        if getattr(store, "sealed", False):
            raise RuntimeError("the host store is sealed: rows are never written after seal()")
        layers = list(ck.moe_layers if layers is None else layers)
        if len(layers) != store.num_layers:
            raise ValueError(f"layers: {len(layers)} checkpoint layers for a store of "
                             f"{store.num_layers} layers (checkpoint MoE layers: "
                             f"{ck.moe_layers})")
        kinds = [ck.expert_kind(layer) for layer in layers]
        if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                                   or window < 1):
            raise ValueError(f"window must be a positive int, got {window!r}")
        dev = _device(device)
        tally = ck.conversion
        before = tally.snapshot() if tally is not None else None
        from tqdm.auto import tqdm
        E = ck.num_experts
        bar = tqdm(total=len(layers) * E, desc=f"{ck.format} experts -> host store",
                   unit="expert", disable=not progress)
        for li, (layer, kind) in enumerate(zip(layers, kinds)):
            spec = ck._layer(layer)
            # FP8 experts are read dequantized to float32
            item = (4 if spec.source == "fp8" else spec.dtype.itemsize) \
                if kind is ExpertKind.FLOAT else 1
            w = window or default_window(layout, item)
            bar.set_postfix(layer=layer)
            for lo in range(0, E, w):
                hi = min(E, lo + w)
                ex = ck.experts(layer, lo, hi)
                rows = _rows(ck, ex, layout, dev)
                del ex
                for i in range(hi - lo):
                    store.write_row(li, lo + i, rows[i])
                del rows
                bar.update(hi - lo)
        if tally is not None:
            done = tally.since(before)
            log.log(logging.WARNING if done.lossy else logging.INFO, "cupool: %s", done.summary())
    finally:
        if bar is not None:
            bar.close()
        if own:
            ck.close()
