"""Where the GPU memory went (NVML), and memory budgets in bytes.

`report()` reads NVML for the device's totals and this process's usage, torch's allocator for what
torch holds, and asks the pool (when given) for its parts: bank, staging, workspaces, host store.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re

import torch

from cupool.store import fmt_bytes

log = logging.getLogger("cupool")


class BudgetError(ValueError):
    """The memory budget cannot hold top-k rows per layer next to the rest of the model."""

_UNITS = {"": 1, "b": 1,
          "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(value, name: str = "budget") -> int:
    """Bytes from an int or a string like '48GiB', '48 GB', '1.5TiB', '512MiB'.

    GB/MB are powers of 1000, GiB/MiB powers of 1024 (as the units say).
    """
    if isinstance(value, bool):
        raise TypeError(f"{name} must be bytes (int) or a string like '48GiB', got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
        return value
    if not isinstance(value, str):
        raise TypeError(f"{name} must be bytes (int) or a string like '48GiB', got "
                        f"{type(value).__name__} {value!r}")
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{name}={value!r} is not a size: write e.g. '48GiB', '40 GB' or "
                         f"'512MiB' (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"{name}={value!r} must be positive")
    return n


@dataclasses.dataclass
class GPUMemory:
    """NVML's view of one device."""
    index: int
    name: str
    capability: tuple[int, int]
    total: int
    used: int
    free: int
    process: int | None          # this process's usage as NVML lists it (None: not listed)
    torch_allocated: int
    torch_reserved: int


def _nvml():
    import pynvml
    pynvml.nvmlInit()
    return pynvml


def _nvml_handle(pynvml, index: int):
    """NVML handle of torch's device `index`, matched by PCI bus id (CUDA_VISIBLE_DEVICES-safe)."""
    props = torch.cuda.get_device_properties(index)
    bus = None
    if hasattr(props, "pci_bus_id"):
        bus = f"{getattr(props, 'pci_domain_id', 0):08x}:{props.pci_bus_id:02x}:" \
              f"{getattr(props, 'pci_device_id', 0):02x}.0"
    if bus is not None:
        try:
            return pynvml.nvmlDeviceGetHandleByPciBusId(bus.encode())
        except pynvml.NVMLError:
            pass
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def gpu_memory(device=None) -> GPUMemory:
    """Totals from NVML, this process's usage, and torch's allocator figures."""
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device is visible (torch.cuda.is_available() is False)")
    index = torch.cuda.current_device() if device is None else torch.device(device).index or 0
    pynvml = _nvml()
    h = _nvml_handle(pynvml, index)
    mem = pynvml.nvmlDeviceGetMemoryInfo(h)
    name = pynvml.nvmlDeviceGetName(h)
    name = name.decode() if isinstance(name, bytes) else name
    proc = None
    try:
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
            if p.pid == os.getpid() and p.usedGpuMemory is not None:
                proc = int(p.usedGpuMemory)
    except pynvml.NVMLError:
        pass
    return GPUMemory(index=index, name=name,
                     capability=torch.cuda.get_device_capability(index),
                     total=int(mem.total), used=int(mem.used), free=int(mem.free), process=proc,
                     torch_allocated=torch.cuda.memory_allocated(index),
                     torch_reserved=torch.cuda.memory_reserved(index))


@dataclasses.dataclass
class MemoryReport:
    """A printable account of the GPU memory, with the pool's parts when there is a pool."""
    gpu: GPUMemory
    parts: list[tuple[str, int, str]]   # (name, bytes, where: "gpu" or "host")

    def __str__(self) -> str:
        g = self.gpu
        lines = [f"GPU {g.index}: {g.name} (sm_{g.capability[0]}{g.capability[1]})",
                 f"  NVML total      {fmt_bytes(g.total):>12}",
                 f"  NVML used       {fmt_bytes(g.used):>12}",
                 f"  NVML free       {fmt_bytes(g.free):>12}",
                 "  this process    " + (f"{fmt_bytes(g.process):>12}" if g.process is not None
                                         else f"{'n/a':>12}  (NVML does not list this process)"),
                 f"  torch allocated {fmt_bytes(g.torch_allocated):>12}",
                 f"  torch reserved  {fmt_bytes(g.torch_reserved):>12}"]
        gpu_parts = [p for p in self.parts if p[2] == "gpu"]
        host_parts = [p for p in self.parts if p[2] == "host"]
        if gpu_parts:
            lines.append("  pool on the GPU:")
            lines += [f"    {n:<20}{fmt_bytes(b):>12}" for n, b, _ in gpu_parts]
        if host_parts:
            lines.append("  pool in host memory:")
            lines += [f"    {n:<20}{fmt_bytes(b):>12}" for n, b, _ in host_parts]
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"gpu": dataclasses.asdict(self.gpu),
                "parts": [{"name": n, "bytes": b, "where": w} for n, b, w in self.parts]}


def report(pool=None, device=None) -> MemoryReport:
    """NVML report of `device` (default: the pool's, else the current one) and the pool's parts.

    `pool` is anything with `memory_parts() -> [(name, bytes, "gpu"|"host"), ...]`.
    """
    if device is None and pool is not None and hasattr(pool, "device"):
        device = pool.device
    parts = list(pool.memory_parts()) if pool is not None else []
    return MemoryReport(gpu_memory(device), parts)


# Kept free beside the pool's parts when rows are sized from a budget.
MARGIN_BYTES = 1 << 20


def staging_and_tables_bytes(num_layers: int, num_experts: int, max_lanes: int,
                             row_stride: int) -> int:
    """GPU bytes of a pool beside its bank and GEMM workspaces: one staging row per decode lane
    and the planner's tables (at most 64 bytes a (layer, expert) key, the store's address table
    included)."""
    return max_lanes * row_stride + 64 * num_layers * num_experts


@dataclasses.dataclass(frozen=True)
class Reserve:
    """GPU bytes kept out of the bank's share of a budget for what an engine allocates beside the
    model: the KV cache of its slots, the slots' recurrent states and the resume points' copies of
    one slot's states (`cupool.kvcache.engine_reserve` computes them from a config)."""
    kv: int = 0                  # keys and values: bytes a token × max_len × slots
    states: int = 0              # one slot's recurrent states × slots
    resume_points: int = 0       # one slot's recurrent states × resume points
    slots: int = 0
    points: int = 0

    @property
    def total(self) -> int:
        return self.kv + self.states + self.resume_points

    def parts(self) -> str:
        """The parts in words, e.g. 'KV cache 1.00 GiB, recurrent states 2.00 MiB (8 slots),
        resume points 6.00 MiB (24 copies)' (the states only where there are any)."""
        words = f"KV cache {fmt_bytes(self.kv)}"
        if self.states or self.resume_points:
            words += (f", recurrent states {fmt_bytes(self.states)} ({self.slots} slots), resume "
                      f"points {fmt_bytes(self.resume_points)} ({self.points} copies)")
        return words


def reserve_bytes(reserve) -> int:
    """Bytes of a reserve given as a `Reserve` or as bytes (an int, or a string like '2GiB')."""
    if isinstance(reserve, Reserve):
        return reserve.total
    return parse_bytes(reserve, "kv_reserve") if reserve else 0


def _reserve_words(reserve) -> str:
    if isinstance(reserve, Reserve):
        return f"reserve {fmt_bytes(reserve.total)} ({reserve.parts()})"
    return f"KV reserve {fmt_bytes(reserve_bytes(reserve))}"


def rows_for_budget(budget: int, *, fixed: int, row_stride: int, num_layers: int, top_k: int,
                    num_experts: int, kv_reserve: int | Reserve = 0) -> int:
    """Bank rows per layer that `budget` bytes buy once `fixed` bytes (the rest of the model,
    workspaces, staging, tables) and the reserve (bytes, or a `Reserve` of KV cache, recurrent
    states and resume points) are paid: (budget − fixed − reserve) // (L · row), at most E.
    Raises ValueError (naming what is needed, the reserve's parts included) when fewer than top_k
    rows fit."""
    kv = reserve_bytes(kv_reserve)
    need = fixed + kv + num_layers * top_k * row_stride
    if budget < need:
        raise ValueError(
            f"budget={fmt_bytes(budget)} is too small: at least {fmt_bytes(need)} is needed "
            f"(rest of the model, workspaces, staging and tables {fmt_bytes(fixed)}, "
            f"{_reserve_words(kv_reserve)}, and top-k={top_k} rows of {fmt_bytes(row_stride)} "
            f"for each of {num_layers} layers)")
    return int(min(num_experts, (budget - fixed - kv) // (num_layers * row_stride)))


def rows_for_device(budget: int | None, row_stride: int, L: int, K: int, E: int,
                    extra: int, device, kv_reserve: int | Reserve) -> int:
    """Rows per layer: what `budget` leaves after what torch already holds on the device (the
    rest of the model, the GEMM workspaces) and `extra` (staging, tables), capped by what NVML
    says is free. budget None: NVML alone."""
    used = torch.cuda.memory_allocated(device)
    free = gpu_memory(device).free
    by_budget = E
    if budget is not None:
        try:
            by_budget = rows_for_budget(budget, fixed=used + extra, row_stride=row_stride,
                                        num_layers=L, top_k=K, num_experts=E, kv_reserve=kv_reserve)
        except ValueError as e:
            raise BudgetError(str(e)) from None
    try:
        by_nvml = rows_for_budget(free, fixed=extra + (256 << 20), row_stride=row_stride,
                                  num_layers=L, top_k=K, num_experts=E, kv_reserve=kv_reserve)
    except ValueError as e:
        raise BudgetError(f"NVML reports {fmt_bytes(free)} free on {device}, not enough: "
                          f"{str(e).replace('budget=', 'free memory ')}") from None
    return min(by_budget, by_nvml)


def rows_and_host(rows_for, extra: int, optional: int, num_experts: int) -> tuple[int, bool]:
    """Rows per layer, and whether `optional` bytes of the model (its input embedding) go to host
    memory: they stay on the GPU where the bank holds every expert with them there; else they go
    to host memory and the bank takes their room. `rows_for(extra)`: the rows a layer gets beside
    `extra` bytes of everything else (`rows_for_device`, `rows_for_budget`; ValueError
    where none fit)."""
    if optional <= 0:
        return rows_for(extra), False
    try:
        rows = rows_for(extra)
    except ValueError:
        rows = 0
    if rows >= num_experts:
        return rows, False
    more = rows_for(extra - optional)
    log.info("cupool: the input embedding (%s) goes to pinned host memory, where a decode step "
             "reads its rows: the bank holds %d of %d experts a layer with it on the GPU, %d "
             "without", fmt_bytes(optional), rows, num_experts, more)
    return more, True
