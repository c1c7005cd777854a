"""Row copies by the copy engine inside a captured decode step (`Pool.engine_copies`).

A decode step's misses are known only on the device (the plan step writes the copy list), so a
captured step copies them with a kernel (`cupool.ops.rowcopy`), which takes SMs and moves rows
below the copy engine's rate. A CUDA graph can aim the copy engine at a row chosen on the
device through a conditional SWITCH node whose bodies are memcpy nodes, one an expert: the body
a kernel picks runs. `EngineCopies` adds, at capture, to each layer call:

    set_switches (after the plan step): switch k ← the expert of the copy list's entry k
    K switch nodes: body e copies the host row of (layer, e) into slot k (a fixed GPU row)
    settle_rows: slot k → the row the plan step chose for entry k; the entries from K on
        copied from the host by the same kernel (SM loads)

(`rawkernels/graphcopy.cu`). Graph nodes come from the driver API through NVIDIA's
`cuda-bindings` (`cuda.bindings.driver`, 13.x), which cupool needs only for this.

Experimental, off by default (CUPOOL_ENGINE_COPIES=1): it is built on what
`benchmarks/probe_graph_copies.cu` is there to establish on a GPU — that memcpy nodes in switch
bodies run on the copy engine at the link's rate, beside kernels on every SM, at a small cost a
switch — and it is not yet timed against the row-copy kernel. Every captured layer call holds
K · E memcpy nodes (K = `slots`, at most 8): 48 layers, 2 slots and 128 experts are 12,288 nodes
a captured graph. Outside capture (eager steps) the row-copy kernel copies as before.
"""

from __future__ import annotations

import numpy as np
import torch

from cupool import _cuda, kernels

MAX_SLOTS = 8              # rawkernels/graphcopy.cu MAX_SLOTS: switch handles a launch takes
ERR_KEY = 1                # a listed key outside the call's layer (internal)
INSTALL_HINT = "pip install 'cuda-bindings>=13,<14'"


def driver():
    """`cuda.bindings.driver` (13.x: the capture and graph calls with edge data), or ImportError
    naming what to install."""
    what = ("copy-engine row copies in captured steps (CUPOOL_ENGINE_COPIES=1, "
            "Pool.engine_copies) need NVIDIA's cuda-bindings 13")
    try:
        import cuda.bindings
        from cuda.bindings import driver as cu
    except ImportError as e:
        raise ImportError(f"{what}: {INSTALL_HINT}") from e
    version = getattr(cuda.bindings, "__version__", "0")
    if int(version.split(".")[0]) != 13:
        raise ImportError(f"{what}, found {version}: {INSTALL_HINT}")
    return cu


def check_slots(slots) -> int:
    """Switches a layer call: an int in [1, MAX_SLOTS]."""
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= MAX_SLOTS:
        raise ValueError(f"slots must be an int in [1, {MAX_SLOTS}] (switch nodes a layer call, "
                         f"one copy each), got {slots!r}")
    return slots


def _ok(result, what: str):
    """The values of a cuda.bindings call after its CUresult; RuntimeError if it failed."""
    cu = driver()
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        _, msg = cu.cuGetErrorString(err)
        text = msg.decode() if isinstance(msg, bytes) else msg
        raise RuntimeError(f"{what} failed: {err.name if hasattr(err, 'name') else err}: {text}")
    return rest[0] if len(rest) == 1 else rest


class EngineCopies:
    """The copy-engine copies of one bank's decode steps while a CUDA graph captures them.

    Args:
        bank: the `cupool.bank.Bank` whose plan step writes the copy list.
        slots: switch nodes a layer call (K, 1 to 8): copies a layer step makes by the copy
            engine; a step's entries past K are copied from the host by settle_rows.
    """

    def __init__(self, bank, slots: int = 2):
        self.slots = check_slots(slots)
        self.bank = bank
        driver()                                    # fail early, before any capture
        dev = bank.device
        store = bank.store
        self.num_experts = bank.num_experts
        self.row_bytes, self.row_stride = bank.row_bytes, bank.row_stride
        self.host_rows = store.host_addresses()     # int64 [L·E], read-only
        self.slot_rows = torch.empty((self.slots, self.row_stride), dtype=torch.uint8, device=dev)
        self.error = torch.zeros(1, dtype=torch.int32, device=dev)
        self._set = kernels.function("graphcopy", "set_switches", None, dev.index)
        self._settle = kernels.function("graphcopy", "settle_rows", None, dev.index)
        self._settle_blocks = 4 * _cuda.target(dev.index).sms
        self.switches = 0                           # switch nodes added so far (all captures)

    def read_error(self) -> list[str]:
        """Sticky errors of the set_switches launches (a host read; outside the hot path)."""
        bits = int(self.error.item())
        return ["a copy list key outside its call's layer (internal)"] if bits & ERR_KEY else []

    def __call__(self, layer: int, copies: torch.Tensor, n_copies: torch.Tensor) -> None:
        """Copy the plan step's list (`copies` [W, 2] (key, row), `n_copies` [1], both the
        bank's) for a call of `layer`, on torch's current stream, which must be capturing."""
        cu = driver()
        dev = self.bank.device
        stream = cu.CUstream(kernels._raw_stream(dev.index))
        status, _, graph, _, _, _ = _ok(cu.cuStreamGetCaptureInfo(stream),
                                         "cuStreamGetCaptureInfo")
        if status != cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE:
            raise RuntimeError("EngineCopies runs only while torch's current stream captures a "
                               "CUDA graph (eager steps take the bank's row-copy kernel)")
        ctx = _ok(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
        E, K = self.num_experts, self.slots
        handles = [_ok(cu.cuGraphConditionalHandleCreate(
            graph, ctx, E, cu.CU_GRAPH_COND_ASSIGN_DEFAULT), "cuGraphConditionalHandleCreate")
            for _ in range(K)]
        values = [np.uint64(int(h)) for h in handles] + [np.uint64(0)] * (MAX_SLOTS - K)
        kernels.launch(self._set, 1, 32, (copies, n_copies, kernels.i32(layer * E),
                                          kernels.i32(E), kernels.i32(K), self.error, *values),
                       device=dev)
        _, _, graph, deps, _, ndeps = _ok(cu.cuStreamGetCaptureInfo(stream),
                                          "cuStreamGetCaptureInfo")
        after_set = list(deps)[:ndeps]
        nodes = [self._switch(cu, graph, after_set, h, ctx, layer, k)
                 for k, h in enumerate(handles)]
        _ok(cu.cuStreamUpdateCaptureDependencies(
            stream, nodes, None, len(nodes),
            cu.CUstreamUpdateCaptureDependencies_flags.CU_STREAM_SET_CAPTURE_DEPENDENCIES),
            "cuStreamUpdateCaptureDependencies")
        bank = self.bank
        kernels.launch(self._settle, self._settle_blocks, 256, (
            self.slot_rows, kernels.i64(self.row_stride), bank.src_of_key, copies, n_copies,
            bank.rows, kernels.i64(bank.row_stride), kernels.i64(self.row_bytes),
            kernels.i32(layer * E), kernels.i32(E), kernels.i32(K),
            kernels.i32(copies.shape[0])), device=dev)

    def _switch(self, cu, graph, deps, handle, ctx, layer: int, k: int):
        """A SWITCH node after `deps` whose body e copies (layer, e)'s host row into slot k."""
        E = self.num_experts
        p = cu.CUgraphNodeParams()
        p.type = cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
        p.conditional.handle = handle
        p.conditional.type = cu.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_SWITCH
        p.conditional.size = E
        p.conditional.ctx = ctx
        node = _ok(cu.cuGraphAddNode(graph, deps, None, len(deps), p), "cuGraphAddNode (switch)")
        bodies = p.conditional.phGraph_out
        dst = self.slot_rows[k].data_ptr()
        base = layer * E
        for e in range(E):
            m = cu.CUDA_MEMCPY3D()
            m.srcMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_HOST
            m.srcHost = int(self.host_rows[base + e])
            m.dstMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
            m.dstDevice = dst
            m.WidthInBytes = m.srcPitch = m.dstPitch = self.row_bytes   # one row: a 1-D copy
            m.Height = m.srcHeight = m.dstHeight = 1
            m.Depth = 1
            _ok(cu.cuGraphAddMemcpyNode(bodies[e], None, 0, m, ctx), "cuGraphAddMemcpyNode")
        self.switches += 1
        return node
