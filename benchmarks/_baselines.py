"""What users run today instead of cupool, as expert backends of a wrapped model
(`pool.decode_backend = fn(layer, x, ids, w) -> out`), so every mode runs the same model and routing.

- UVABackend: no bank; the GEMM reads every routed expert from pinned host memory through UVA
  each step (what vLLM's `--cpu-offload-gb` zero-copy offload does). Graph-capturable.
- ResidentBackend: every expert row on the GPU in NVFP4, a fixed address table (the ceiling).
- HostLRUBackend: a per-layer LRU decided on the host: each layer reads its routing back,
  updates an OrderedDict, copies misses with cudaMemcpyAsync into that layer's slots, then runs
  the GEMM (what mixtral-offloading-style caches do). Not capturable (host sync per layer).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from cupool import _cuda


def _lane_addr(table: torch.Tensor, layer: int, E: int, ids: torch.Tensor) -> torch.Tensor:
    flat = ids.reshape(-1).to(torch.int64)
    addr = table[layer * E + flat.clamp(min=0)]
    return torch.where(flat >= 0, addr, torch.zeros_like(addr))


class UVABackend:
    def __init__(self, pool):
        self.pool = pool
        self.table = pool.store.address_table()

    def __call__(self, layer, x, ids, w):
        p = self.pool
        return p.gemm.decode(x, _lane_addr(self.table, layer, p.num_experts, ids), w)


class ResidentBackend:
    def __init__(self, pool):
        self.pool = pool
        L, E = pool.num_layers, pool.num_experts
        stride = pool.store.row_stride
        self.rows = torch.empty(L * E, stride, dtype=torch.uint8, device=pool.device)
        cp = _cuda.cupy()
        stream = torch.cuda.current_stream().cuda_stream
        for layer in range(L):       # from the pinned rows' device addresses (the store is sealed)
            for e in range(E):
                cp.cuda.runtime.memcpyAsync(self.rows[layer * E + e].data_ptr(),
                                            pool.store.address(layer, e), pool.store.row_bytes,
                                            cp.cuda.runtime.memcpyHostToDevice, stream)
        torch.cuda.synchronize()
        self.table = self.rows.data_ptr() + torch.arange(L * E, device=pool.device) * stride

    def __call__(self, layer, x, ids, w):
        p = self.pool
        return p.gemm.decode(x, _lane_addr(self.table, layer, p.num_experts, ids), w)

    def free(self):
        self.rows = None
        self.table = None


class HostLRUBackend:
    """Per-layer LRU with `rows` slots a layer, decided on the host."""

    def __init__(self, pool, rows: int):
        self.pool, self.rows = pool, rows
        L, E = pool.num_layers, pool.num_experts
        self.stride = pool.store.row_stride
        self.slots = torch.empty(L * rows, self.stride, dtype=torch.uint8, device=pool.device)
        self.lru = [OrderedDict() for _ in range(L)]                 # expert -> slot
        for layer in range(L):                                       # initial: experts 0..rows-1
            for e in range(rows):
                self._copy(layer, e, layer * rows + e)
                self.lru[layer][e] = layer * rows + e
        torch.cuda.synchronize()
        self.addr_host = torch.empty(8 * 1024, dtype=torch.int64).pin_memory()
        self.hits = self.misses = 0
        self.bytes_copied = 0
        self.E = E

    def _copy(self, layer, e, slot):
        cp = _cuda.cupy()
        cp.cuda.runtime.memcpyAsync(self.slots[slot].data_ptr(), self.pool.store.address(layer, e),
                                    self.pool.store.row_bytes, cp.cuda.runtime.memcpyHostToDevice,
                                    torch.cuda.current_stream().cuda_stream)

    def __call__(self, layer, x, ids, w):
        ids_host = ids.reshape(-1).cpu().numpy()                     # the host readback
        lru = self.lru[layer]
        addr = np.zeros(ids_host.size, dtype=np.int64)
        base = self.slots.data_ptr()
        used_now = set()
        for i, e in enumerate(ids_host.tolist()):
            if e < 0:
                continue
            slot = lru.get(e)
            if slot is not None:
                lru.move_to_end(e)
                self.hits += 1
            else:
                self.misses += 1
                victim = next(k for k in lru if k not in used_now)
                slot = lru.pop(victim)
                self._copy(layer, e, slot)
                self.bytes_copied += self.pool.store.row_bytes
                lru[e] = slot
            used_now.add(e)
            addr[i] = base + slot * self.stride
        n = ids_host.size
        self.addr_host[:n].copy_(torch.from_numpy(addr))
        lane_addr = self.addr_host[:n].to(x.device, non_blocking=True)
        return self.pool.gemm.decode(x, lane_addr, w)

    def free(self):
        self.slots = None
