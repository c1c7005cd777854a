"""CuPy and torch plumbing shared by every launcher, and the architecture kernels are built for.

CuPy is optional at import time: `import cupool` works on a machine without CuPy or a GPU, and
the first GPU feature asks for the right extra. Every launch goes to torch's current stream (the
one `torch.cuda.graph` captures), never to CuPy's default stream.

Architecture (`target`): kernels are built for the GPU's own compute capability, or, with the
environment variable CUPOOL_ARCH=80|86|89|90|100|120, as PTX for compute_<arch> that the driver
compiles for the GPU in hand (`cupool.kernels`), with that architecture's shared-memory limits
and features (`ARCHS`): an H200 then runs exactly the code an A100, RTX 3090 or RTX 4090 would.
GPUs older than compute capability 8.0 are refused (`UnsupportedGPUError`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings

import numpy as np
import torch

INSTALL_HINT = (
    "cupool needs CuPy for GPU work. Install the extra that matches your CUDA driver: "
    "pip install 'cupool[cuda13]' (cupy-cuda13x) or pip install 'cupool[cuda12]' (cupy-cuda12x)."
)


class CupyMissingError(ImportError):
    """CuPy is not installed but a GPU feature was used."""


class NoGPUError(RuntimeError):
    """No CUDA device is visible to this process."""


class UnsupportedGPUError(RuntimeError):
    """The GPU (or CUPOOL_ARCH) is one cupool's kernels cannot be built for."""


@dataclasses.dataclass(frozen=True)
class Arch:
    """What cupool's kernels may use on one GPU architecture (sm_XY: compute capability X.Y)."""
    sm: int                # 86 for sm_86
    smem_block: int        # shared memory one block may opt in to, bytes
    smem_sm: int           # shared memory of one SM, bytes
    bulk_copy: bool        # cp.async.bulk and mbarrier transaction counts (sm_90+): the bulk row
                           # copies; moe_decode's stages otherwise go through cp.async
    gpus: str              # examples, for messages and docs


KIB = 1024
# The CUDA programming guide's table of compute capabilities (shared memory per SM / per block).
ARCHS = {a.sm: a for a in (
    Arch(80, 163 * KIB, 164 * KIB, False, "A100, A30"),
    Arch(86, 99 * KIB, 100 * KIB, False, "RTX 3090, RTX A6000, A40, A10"),
    Arch(89, 99 * KIB, 100 * KIB, False, "RTX 4090, RTX 6000 Ada, L40S, L4"),
    Arch(90, 227 * KIB, 228 * KIB, True, "H100, H200, GH200"),
    Arch(100, 227 * KIB, 228 * KIB, True, "B200, GB200"),
    Arch(120, 99 * KIB, 100 * KIB, True, "RTX 5090, RTX PRO 6000 Blackwell"),
)}
MIN_SM = 80               # bf16 mma.sync, cp.async and mbarriers: Ampere and newer
ARCH_ENV = "CUPOOL_ARCH"
DEPENDENT_ENV = "CUPOOL_DEPENDENT_LAUNCH"   # 0: every launch waits for the one before


def parse_arch(value: str) -> int | None:
    """CUPOOL_ARCH's value as an architecture number (86), None when unset or empty. Accepts
    86, sm_86 and compute_86; anything else raises ValueError naming the variable."""
    v = (value or "").strip().lower()
    if not v:
        return None
    for prefix in ("sm_", "compute_"):
        v = v.removeprefix(prefix)
    if not v.isdigit() or int(v) not in ARCHS:
        raise ValueError(f"{ARCH_ENV} must be one of {', '.join(map(str, ARCHS))} (optionally "
                         f"as sm_XY), got {value!r}")
    return int(v)


@dataclasses.dataclass(frozen=True)
class Target:
    """The architecture one device's kernels are built for, and the limits launches keep to."""
    sm: int                # architecture of the code: __CUDA_ARCH__ / 10
    device_sm: int         # the GPU's own compute capability (90 for 9.0)
    forced: bool           # CUPOOL_ARCH: built as PTX for compute_<sm>, compiled by the driver
    smem_block: int        # shared memory a block may use, bytes (the GPU's, capped by CUPOOL_ARCH)
    smem_sm: int           # shared memory of an SM, bytes (the same)
    sms: int               # streaming multiprocessors of the GPU
    bulk_copy: bool        # the code has bulk copies (sm_90+)

    @property
    def dependent_launch(self) -> bool:
        """Whether kernels launched as dependents (`cupool.kernels.launch(..., dependent=True)`)
        overlap the kernel before them: the code has griddepcontrol (sm_90+) and
        CUPOOL_DEPENDENT_LAUNCH is not 0."""
        return self.sm >= 90 and os.environ.get(DEPENDENT_ENV, "1").strip() != "0"

    @property
    def copy_mode(self) -> str:
        """The row-copy kernel "auto" picks (`cupool.ops.rowcopy.RowCopier`)."""
        return "bulk" if self.bulk_copy else "ld"

    def describe(self) -> str:
        """One line: what the kernels are built for, e.g. "sm_86 code (CUPOOL_ARCH=86, PTX
        compiled by the driver) on an sm_90 GPU"."""
        if self.forced:
            return (f"sm_{self.sm} code ({ARCH_ENV}={self.sm}, PTX compiled by the driver) on an "
                    f"sm_{self.device_sm} GPU")
        return f"sm_{self.sm} (the GPU's own)"


def device_sm(capability: tuple[int, int]) -> int:
    return 10 * int(capability[0]) + int(capability[1])


def resolve_target(capability: tuple[int, int], sms: int, smem_block: int, smem_sm: int,
                   env: str | None) -> Target:
    """The Target of a GPU of `capability` with these properties under CUPOOL_ARCH=`env` (no
    GPU needed: `target` passes the device's own). Refuses GPUs before sm_80 and an arch the GPU
    cannot run (PTX runs on its own architecture and newer ones only)."""
    dev = device_sm(capability)
    if dev < MIN_SM:
        raise UnsupportedGPUError(
            f"cupool needs an NVIDIA GPU of compute capability 8.0 or newer (Ampere: bf16 tensor "
            f"cores, cp.async); this one has {capability[0]}.{capability[1]}")
    forced = parse_arch(env or "")
    if forced is None:
        return Target(dev, dev, False, smem_block, smem_sm, sms, dev >= 90)
    if forced > dev:
        raise UnsupportedGPUError(
            f"{ARCH_ENV}={forced} builds PTX for compute_{forced}, which a GPU of compute "
            f"capability {capability[0]}.{capability[1]} cannot run; use a value <= {dev}")
    a = ARCHS[forced]
    return Target(forced, dev, True, min(smem_block, a.smem_block), min(smem_sm, a.smem_sm), sms,
                  a.bulk_copy)


_targets: dict[tuple[int, str], Target] = {}


def target(device=None) -> Target:
    """The Target of a CUDA device (default: current) under the current CUPOOL_ARCH. The limits
    are the device's own properties (shared memory per block and per SM, SM count), capped by
    CUPOOL_ARCH's architecture."""
    idx = device_index(device)
    env = os.environ.get(ARCH_ENV, "")
    got = _targets.get((idx, env))
    if got is None:
        props = torch.cuda.get_device_properties(idx)
        block = getattr(props, "shared_memory_per_block_optin", None)
        sm = getattr(props, "shared_memory_per_multiprocessor", None)
        if block is None or sm is None:            # older torch: the driver's attributes
            attrs = cupy().cuda.Device(idx).attributes
            block, sm = attrs["MaxSharedMemoryPerBlockOptin"], attrs["MaxSharedMemoryPerMultiprocessor"]
        got = _targets[(idx, env)] = resolve_target(
            (props.major, props.minor), props.multi_processor_count, int(block), int(sm), env)
    return got


@functools.lru_cache(maxsize=1)
def cupy():
    """The `cupy` module, or CupyMissingError saying which extra to install."""
    try:
        import cupy as cp
    except ImportError as e:
        raise CupyMissingError(f"{INSTALL_HINT} (import failed: {e})") from e
    return cp



def require_gpu(what: str = "this operation") -> None:
    """Raise a clear error when no CUDA device (NoGPUError) or no CuPy (CupyMissingError) is
    there: the same message from every entry point."""
    if not torch.cuda.is_available():
        raise NoGPUError(f"{what} needs a CUDA GPU, and torch sees none "
                         f"(torch {torch.__version__}, CUDA build: {torch.version.cuda})")
    cupy()


def device_index(device=None) -> int:
    """Index of a CUDA device given as None (current), int, str or torch.device."""
    if device is None:
        return torch.cuda.current_device()
    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if dev.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {device!r}")
    return dev.index if dev.index is not None else torch.cuda.current_device()


_streams: dict[tuple[int, int], object] = {}


def current_stream(device=None):
    """torch's current stream on `device`, wrapped as a CuPy ExternalStream (cached per handle)."""
    idx = device_index(device)
    handle = torch.cuda.current_stream(idx).cuda_stream
    key = (idx, handle)
    stream = _streams.get(key)
    if stream is None:
        with warnings.catch_warnings():
            # CuPy 14 prefers Stream.from_external(obj with __cuda_stream__); the handle is all
            # torch gives us on every version we support, so keep the handle-based wrapper.
            warnings.simplefilter("ignore", DeprecationWarning)
            stream = cupy().cuda.ExternalStream(handle, idx)
        _streams[key] = stream
    return stream


def ptr(t) -> np.uint64:
    """A kernel argument holding the device address of a torch tensor or CuPy array."""
    if isinstance(t, torch.Tensor):
        return np.uint64(t.data_ptr())
    return np.uint64(t.data.ptr)
