"""Launcher of `rawkernels/rowcopy.cu`: host-store rows → GPU rows through UVA reads.

The grid is fixed when the launcher is built; the number of rows copied is read by the kernel from
device memory, so one captured launch serves every step.
"""

from __future__ import annotations

import torch

from cupool import _cuda, kernels

MODES = ("auto", "ld", "bulk")
MAX_STAGES = 4           # "bulk": buffers a block keeps by default, where shared memory allows


def bulk_stages(chunk: int, smem_block: int, static: int = 64) -> int:
    """Default "bulk" buffers a block: MAX_STAGES where they fit the shared memory a block may use
    (`smem_block`, less the kernel's static bytes), else as many as fit (a 99 KiB sm_120 block
    takes 3 of 32 KiB), at least 2."""
    return max(2, min(MAX_STAGES, (smem_block - static) // chunk))


class RowCopier:
    """Copies listed (key, row) pairs from host-store addresses into rows at `dst_base`.

    Modes:
        "auto" (default): "bulk" where the kernels are built for sm_90 or newer, else "ld"
            (`cupool._cuda.target`: the GPU's own architecture, or CUPOOL_ARCH's); `mode` holds
            the choice.
        "ld": `copy_rows`; every thread keeps `unroll` 16-byte SM loads of the host row
            in flight, then stores them. Runs on any GPU.
        "bulk": `copy_rows_bulk`; one thread a block drives Hopper's bulk-copy engine
            (`cp.async.bulk`), host row → a ring of `stages` shared-memory buffers of `chunk`
            bytes → GPU row. Needs kernels built for sm_90 or newer (Hopper, Blackwell).

    Args:
        src_of_key: int64 CUDA tensor [L*E] of UVA row addresses (`HostStore.address_table`).
        row_bytes: bytes per row (multiple of 16).
        dst: uint8 CUDA tensor [rows, row_stride] receiving the rows.
        max_copies: capacity of the copy list.
        mode: "auto", "ld" or "bulk", as above.
        blocks: the fixed grid. Default "ld": 2 blocks per SM. Default "bulk": one block per 8
            SMs, which moves 0.92 of cudaMemcpy's bandwidth for 2–10 MiB rows on an H200 like any
            larger grid, and leaves the other SMs to the GEMM that runs beside the copies
            (`Bank.step_split`).
        threads, unroll: "ld" only: threads a block (default 512) and 16-byte loads in flight
            per thread. "bulk" blocks are one warp.
        chunk, stages: "bulk" only: bytes per bulk copy (a multiple of 16; a row's last chunk may
            be shorter) and buffers per block (default `bulk_stages`: 4, or as many as fit). A
            block takes chunk * stages bytes of shared memory, which must fit the per-block
            limit of the target (227 KiB on H100/H200, 99 KiB on sm_120); for 2 blocks per SM to
            run at once, keep it under about half the SM's shared memory.
    """

    def __init__(self, src_of_key: torch.Tensor, row_bytes: int, dst: torch.Tensor,
                 max_copies: int, *, mode: str = "auto", blocks: int | None = None,
                 threads: int = 512, unroll: int = 4, chunk: int = 32768,
                 stages: int | None = None):
        # Checks that need no device come first, so they hold (and are tested) anywhere.
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "bulk":
            if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 16 or chunk % 16:
                raise ValueError(f"chunk must be a positive multiple of 16 bytes, got {chunk!r}")
            if stages is not None and (isinstance(stages, bool) or not isinstance(stages, int)
                                       or stages < 2):
                raise ValueError(f"stages must be an int >= 2 (one buffer loads while another "
                                 f"stores), got {stages!r}")
        else:
            threads = int(threads)
            if not 0 < threads <= 1024 or threads % 32:
                raise ValueError(f"threads must be a multiple of 32 in [32, 1024], got {threads}")
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
        tgt = _cuda.target(dev)
        if mode == "auto":
            mode = tgt.copy_mode
        self.mode = mode
        sms = tgt.sms
        self.blocks = int(blocks or (2 * sms if mode == "ld" else -(-sms // 8)))
        if mode == "ld":
            self.threads, self.shared_mem = threads, 0
            self.kernel = kernels.function("rowcopy", "copy_rows", {"UNROLL": unroll}, dev)
            return
        if not tgt.bulk_copy:
            raise ValueError(f"mode='bulk' needs kernels built for sm_90 or newer (Hopper bulk "
                             f"copies); dst is on {dst.device}, built for {tgt.describe()}; use "
                             f"mode='ld' or 'auto'")
        if stages is None:
            stages = bulk_stages(chunk, tgt.smem_block)
        self.threads = 32
        self.chunk, self.stages = chunk, stages
        self.shared_mem = chunk * stages
        self.kernel = kernels.function("rowcopy", "copy_rows_bulk",
                                       {"CHUNK": chunk, "NSTAGES": stages}, dev)
        room = tgt.smem_block - self.kernel.shared_size_bytes   # less the mbarriers (static)
        if self.shared_mem > room:
            raise ValueError(f"chunk * stages = {chunk} * {stages} = {self.shared_mem} bytes of "
                             f"shared memory a block is more than sm_{tgt.sm} allows "
                             f"({room} bytes beside the kernel's {self.kernel.shared_size_bytes} "
                             f"static bytes); use a smaller chunk or fewer stages")
        # Set once here, not on a launch that a CUDA graph may be capturing.
        self.kernel.max_dynamic_shared_size_bytes = max(
            self.kernel.max_dynamic_shared_size_bytes, self.shared_mem)

    def __call__(self, copies: torch.Tensor, n_copies: torch.Tensor,
                 stream: torch.cuda.Stream | None = None) -> None:
        """Launch on `stream` (default: torch's current stream). copies: int32 [max_copies, 2]
        (key, row); n_copies: int32 [1] on the device (entries beyond it are ignored)."""
        kernels.launch(self.kernel, self.blocks, self.threads, (
            self.src_of_key, copies, n_copies, self.dst,
            kernels.i64(self.dst.stride(0)), kernels.i64(self.row_bytes),
            kernels.i32(self.max_copies)), shared_mem=self.shared_mem, device=self.dst.device,
            stream=stream)
