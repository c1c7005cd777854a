"""The host store: every expert row of every MoE layer, in pinned host memory.

Shape legend (ARCHITECTURE.md): L layers · E experts per layer. A row is one expert's weights in the
kernel layout (`cupool.layout`), `row_bytes` long, placed at a `row_stride` that is a multiple of
`align` (256 bytes by default). Rows live in a few large pinned allocations ("chunks") made
through CuPy with the mapped flag, so each row has a UVA device address that kernels read through
PCIe without a copy engine.

Life cycle: allocate → fill (layer by layer, with a progress bar) → `seal()`. After sealing,
nothing writes the store again: the numpy views turn read-only, `write_row` refuses, and kernels
only read it. `checksums()` lets tests prove that.
"""

from __future__ import annotations

import ctypes
import zlib
from collections.abc import Callable

import numpy as np
import torch

from cupool import _cuda


def _meminfo() -> str:
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        total = int(info["MemTotal"].split()[0]) * 1024
        avail = int(info["MemAvailable"].split()[0]) * 1024
        return f"this machine reports {fmt_bytes(total)} total, {fmt_bytes(avail)} available"
    except (OSError, KeyError, ValueError):
        return "the machine's memory size could not be read"


def fmt_bytes(n: float) -> str:
    """1536 -> '1.50 KiB'."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


class _PinnedChunk:
    """One pinned, mapped host allocation; freed when the store is closed."""

    def __init__(self, nbytes: int, device: int):
        cp = _cuda.cupy()
        rt = cp.cuda.runtime
        with cp.cuda.Device(device):
            try:
                self.host = rt.hostAlloc(nbytes, rt.hostAllocPortable | rt.hostAllocMapped)
            except rt.CUDARuntimeError as e:
                raise MemoryError(
                    f"pinning {fmt_bytes(nbytes)} of host memory for the expert store failed "
                    f"({e}); {_meminfo()}. Use fewer layers/experts, or free host memory") from None
        self.nbytes = nbytes
        # With unified addressing the device address of mapped pinned memory equals its host
        # address; ask the runtime anyway rather than assume it.
        self.device_address = self.host
        attrs = rt.pointerGetAttributes(self.host)
        if getattr(attrs, "devicePointer", 0):
            self.device_address = int(attrs.devicePointer)
        buf = (ctypes.c_uint8 * nbytes).from_address(self.host)
        self.array = np.frombuffer(buf, dtype=np.uint8)

    def free(self) -> None:
        if self.host:
            self.array = None
            _cuda.cupy().cuda.runtime.freeHost(self.host)
            self.host = 0


class _PageableChunk:
    """Ordinary host memory, for tests and tools that need no GPU (no device address)."""

    def __init__(self, nbytes: int, align: int):
        raw = np.empty(nbytes + align, dtype=np.uint8)
        off = (-raw.ctypes.data) % align
        self.array = raw[off:off + nbytes]
        self.nbytes = nbytes
        self.host = self.array.ctypes.data
        self.device_address = None

    def free(self) -> None:
        self.array = None


class HostStore:
    """Rows addressed by (layer, expert), each `row_bytes` long at a stride of `align` bytes.

    Args:
        num_layers, num_experts: L and E.
        row_bytes: bytes of one row (the kernel layout's row size).
        align: row alignment in bytes, a power of two ≥ 16 (default 256).
        pinned: pinned + mapped host memory through CuPy (needs a GPU). False gives ordinary memory
            with no device addresses, for CPU tools and tests.
        chunk_bytes: largest single allocation; rows never straddle two.
        device: CUDA device the addresses are for.
    """

    def __init__(self, num_layers: int, num_experts: int, row_bytes: int, *, align: int = 256,
                 pinned: bool = True, chunk_bytes: int = 4 << 30, device=None):
        for name, v in (("num_layers", num_layers), ("num_experts", num_experts),
                        ("row_bytes", row_bytes)):
            if not isinstance(v, (int, np.integer)) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if align < 16 or align & (align - 1):
            raise ValueError(f"align must be a power of two >= 16, got {align}")
        if row_bytes % 16:
            raise ValueError(f"row_bytes must be a multiple of 16 (kernels copy 16-byte units), "
                             f"got {row_bytes}")
        self.num_layers, self.num_experts = int(num_layers), int(num_experts)
        self.row_bytes = int(row_bytes)
        self.row_stride = -(-self.row_bytes // align) * align
        self.pinned = bool(pinned)
        self.rows_per_chunk = max(1, int(chunk_bytes) // self.row_stride)
        n_rows = self.num_layers * self.num_experts
        if pinned:
            _cuda.require_gpu("a pinned host store (pinned=False gives pageable memory without "
                              "device addresses)")
        self.device = _cuda.device_index(device) if pinned else None
        self._chunks = []
        try:
            for first in range(0, n_rows, self.rows_per_chunk):
                count = min(self.rows_per_chunk, n_rows - first)
                nbytes = count * self.row_stride
                self._chunks.append(_PinnedChunk(nbytes, self.device) if pinned
                                    else _PageableChunk(nbytes, align))
        except BaseException:
            self.close()
            raise
        self.sealed = False
        self._table = {}
        self._host_rows: np.ndarray | None = None

    # --- addressing -------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes of host memory held (all chunks)."""
        return sum(c.nbytes for c in self._chunks)

    def _locate(self, layer: int, expert: int) -> tuple[object, int]:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")
        if not 0 <= expert < self.num_experts:
            raise IndexError(f"expert {expert} out of range [0, {self.num_experts})")
        idx = layer * self.num_experts + expert
        chunk = self._chunks[idx // self.rows_per_chunk]
        return chunk, (idx % self.rows_per_chunk) * self.row_stride

    def row(self, layer: int, expert: int) -> np.ndarray:
        """uint8 view [row_bytes] of one row (read-only once sealed)."""
        chunk, off = self._locate(layer, expert)
        return chunk.array[off:off + self.row_bytes]

    def address(self, layer: int, expert: int) -> int:
        """UVA device address of a row (pinned stores only)."""
        chunk, off = self._locate(layer, expert)
        if chunk.device_address is None:
            raise RuntimeError("this store is not pinned: its rows have no device address")
        return chunk.device_address + off

    def addresses(self) -> np.ndarray:
        """int64 [L*E]: the UVA address of key l*E+e."""
        return np.array([self.address(k // self.num_experts, k % self.num_experts)
                         for k in range(self.num_layers * self.num_experts)], dtype=np.int64)

    def host_addresses(self) -> np.ndarray:
        """int64 [L*E]: the host address of key l*E+e (what the copy engine copies from; made
        once, read-only)."""
        if self._host_rows is None:
            rows = np.empty(self.num_layers * self.num_experts, dtype=np.int64)
            for k in range(rows.size):
                chunk = self._chunks[k // self.rows_per_chunk]
                rows[k] = chunk.host + (k % self.rows_per_chunk) * self.row_stride
            rows.flags.writeable = False
            self._host_rows = rows
        return self._host_rows

    def address_table(self, device=None) -> torch.Tensor:
        """int64 CUDA tensor [L*E] of row addresses, allocated once per device (graph-safe)."""
        idx = _cuda.device_index(device if device is not None else self.device)
        t = self._table.get(idx)
        if t is None:
            t = torch.from_numpy(self.addresses()).to(f"cuda:{idx}")
            self._table[idx] = t
        return t

    # --- filling ----------------------------------------------------------------------------
    def write_row(self, layer: int, expert: int, data) -> None:
        """Copy one row's bytes in (uint8 numpy array, torch tensor or bytes of row_bytes)."""
        if self.sealed:
            raise RuntimeError("the host store is sealed: rows are never written after seal()")
        if isinstance(data, torch.Tensor):
            data = data.detach().cpu().contiguous().view(torch.uint8).numpy()
        arr = np.frombuffer(data, dtype=np.uint8) if isinstance(data, (bytes, bytearray)) \
            else np.asarray(data).view(np.uint8).reshape(-1)
        if arr.size != self.row_bytes:
            raise ValueError(f"row ({layer}, {expert}): expected {self.row_bytes} bytes, "
                             f"got {arr.size}")
        self.row(layer, expert)[:] = arr

    def fill(self, make_layer: Callable[[int], object], *, progress: bool = True,
             desc: str = "host store") -> None:
        """Fill every layer: `make_layer(l)` returns [E, row_bytes] uint8 (numpy or torch) or
        writes the rows itself through `write_row` and returns None. Shows a progress bar."""
        from tqdm.auto import tqdm
        for layer in tqdm(range(self.num_layers), desc=desc, unit="layer", disable=not progress):
            rows = make_layer(layer)
            if rows is None:
                continue
            for e in range(self.num_experts):
                self.write_row(layer, e, rows[e])

    def seal(self) -> None:
        """Freeze the store: views turn read-only and `write_row` refuses from now on."""
        for c in self._chunks:
            c.array.flags.writeable = False
        self.sealed = True

    def checksums(self) -> np.ndarray:
        """uint32 [L, E]: CRC-32 of each row (host side; proves rows never change)."""
        out = np.empty((self.num_layers, self.num_experts), dtype=np.uint32)
        for layer in range(self.num_layers):
            for e in range(self.num_experts):
                out[layer, e] = zlib.crc32(self.row(layer, e))
        return out

    def close(self) -> None:
        """Free the host memory. The store is unusable afterwards."""
        for c in getattr(self, "_chunks", []):
            c.free()
        self._chunks = []
        self._table = {}
        self._host_rows = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass

    def __repr__(self) -> str:
        kind = "pinned" if self.pinned else "pageable"
        return (f"HostStore(L={self.num_layers}, E={self.num_experts}, row={fmt_bytes(self.row_bytes)}, "
                f"{kind}, {fmt_bytes(self.nbytes)}, {'sealed' if self.sealed else 'open'})")
