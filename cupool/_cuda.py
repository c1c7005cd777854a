"""CuPy and torch plumbing shared by every launcher.

CuPy is optional at import time: `import cupool` works on a machine without CuPy or a GPU, and
the first GPU feature asks for the right extra. Every launch goes to torch's current stream (the
one `torch.cuda.graph` captures), never to CuPy's default stream.
"""

from __future__ import annotations

import functools
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
