"""Launcher of `rawkernels/rowcopy.cu`: host-store rows → GPU rows through UVA reads.

The grid is fixed when the launcher is built; the number of rows copied is read by the kernel from
device memory, so one captured launch serves every step.
"""

from __future__ import annotations

import torch

from cupool import kernels


class RowCopier:
    """Copies listed (key, row) pairs from host-store addresses into rows at `dst_base`.

    Args:
        src_of_key: int64 CUDA tensor [L*E] of UVA row addresses (`HostStore.address_table`).
        row_bytes: bytes per row (multiple of 16).
        dst: uint8 CUDA tensor [rows, row_stride] receiving the rows.
        max_copies: capacity of the copy list.
        blocks, threads: the fixed grid (default: 2 blocks per SM, 512 threads).
        unroll: 16-byte loads in flight per thread.
    """

    def __init__(self, src_of_key: torch.Tensor, row_bytes: int, dst: torch.Tensor,
                 max_copies: int, *, blocks: int | None = None, threads: int = 512,
                 unroll: int = 4):
        if src_of_key.dtype != torch.int64 or not src_of_key.is_cuda or src_of_key.dim() != 1:
            raise TypeError(f"src_of_key must be a 1-D int64 CUDA tensor, got "
                            f"{src_of_key.dtype} {tuple(src_of_key.shape)} on {src_of_key.device}")
        if dst.dtype != torch.uint8 or not dst.is_cuda or dst.dim() != 2 or not dst.is_contiguous():
            raise TypeError(f"dst must be a contiguous 2-D uint8 CUDA tensor [rows, stride], got "
                            f"{dst.dtype} {tuple(dst.shape)} on {dst.device}")
        if row_bytes % 16 or row_bytes > dst.shape[1]:
            raise ValueError(f"row_bytes must be a multiple of 16 and <= the dst row stride "
                             f"{dst.shape[1]}, got {row_bytes}")
        if dst.shape[1] % 16 or dst.data_ptr() % 256:
            raise ValueError("dst rows must be 16-byte strided and the base 256-byte aligned")
        self.src_of_key, self.dst = src_of_key, dst
        self.row_bytes, self.max_copies = int(row_bytes), int(max_copies)
        dev = dst.device.index
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        self.blocks = int(blocks or 2 * sms)
        self.threads = int(threads)
        if not 0 < self.threads <= 1024 or self.threads % 32:
            raise ValueError(f"threads must be a multiple of 32 in [32, 1024], got {threads}")
        self.kernel = kernels.function("rowcopy", "copy_rows", {"UNROLL": unroll}, dev)

    def __call__(self, copies: torch.Tensor, n_copies: torch.Tensor) -> None:
        """Launch on torch's current stream. copies: int32 [max_copies, 2] (key, row);
        n_copies: int32 [1] on the device (entries beyond it are ignored)."""
        kernels.launch(self.kernel, self.blocks, self.threads, (
            self.src_of_key, copies, n_copies, self.dst,
            kernels.i64(self.dst.stride(0)), kernels.i64(self.row_bytes),
            kernels.i32(self.max_copies)), device=self.dst.device)
