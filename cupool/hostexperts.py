"""Expert rows computed on the host's CPU cores, where the host store keeps them.

Shape legend (ARCHITECTURE.md): T tokens · K lanes a token · H hidden · I intermediate · L layers ·
E experts a layer.

A miss's row crosses PCIe before the GPU can use it (48 µs a 2.5 MB Qwen3-30B-A3B row on a 55 GB/s
link, about twice that on PCIe 4.0). The host's cores can compute the same expert from the same
bytes where they lie, as llama.cpp's `--n-cpu-moe` does; `HostExperts` is that computation:
`rawkernels/host_experts.c` (AVX-512 or AVX2 + FMA where the CPU has them, else portable C), compiled
at first use with the machine's C compiler (`$CC`, else cc, gcc or clang; `-O3 -march=native`) into
`$XDG_CACHE_HOME/cupool/host` (default ~/.cache/cupool/host), keyed by the source, the compiler's
version, the flags and the CPU's flags. A pool of threads (spinning between calls, asleep after
`spin_ms` idle) splits each call.

It reads the store's rows in the kernel layout (`cupool.layout`), so it needs no second copy of the
experts in host memory, and computes in float32 from the exact NVFP4 values: the result is the
float reference's (`cupool.reference.moe.reference_moe`) to float32 rounding.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import threading
from pathlib import Path

import numpy as np
import torch

from cupool.activation import SILU, Activation
from cupool.layout import RowLayout

ERR_KEY, ERR_WEIGHT, ERR_ARGS, ERR_MEMORY = 1, 2, 4, 8      # host_experts.c's HX_ERR_*
ACT_CODES = {"silu": 0, "swiglu_clamp": 1, "relu2": 2}
SOURCE = "host_experts.c"
FLAGS = ("-O3", "-march=native", "-std=c11", "-fPIC", "-shared", "-pthread")
# builds: the best the CPU has, at most AVX2, none (host_experts.c's HX_ISA 2 / 1 / 0)
ISA_BUILDS = {"native": (), "avx2": ("-DHX_NO_AVX512=1",), "portable": ("-DHX_PORTABLE=1",)}
ISA_NAMES = {0: "portable", 1: "avx2", 2: "avx512"}


class _Layout(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int64), ("inter", ctypes.c_int64), ("hp", ctypes.c_int64),
                ("ip", ctypes.c_int64), ("w2_offset", ctypes.c_int64),
                ("bias_offset", ctypes.c_int64), ("gated", ctypes.c_int32),
                ("act", ctypes.c_int32), ("alpha", ctypes.c_float), ("limit", ctypes.c_float)]


def cache_dir() -> Path:
    """Where compiled libraries are kept: $XDG_CACHE_HOME/cupool/host (default ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cupool" / "host"


def find_compiler() -> str:
    """The C compiler to build with: $CC if set (it must exist), else cc, gcc or clang on PATH."""
    cc = os.environ.get("CC")
    if cc:
        path = shutil.which(cc)
        if path is None:
            raise RuntimeError(f"CC={cc!r}: no such compiler on PATH (the host expert path "
                               f"compiles rawkernels/{SOURCE} with it)")
        return path
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    raise RuntimeError(
        f"the host expert path compiles rawkernels/{SOURCE} with a C compiler at first use, and "
        f"none was found (tried $CC, cc, gcc, clang): install one (e.g. `apt install gcc`) or "
        f"set CC")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_name() -> str:
    """The host CPU's model name (what benchmarks record)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


_LIBS: dict[tuple, ctypes.CDLL] = {}
_LIBS_LOCK = threading.Lock()


def load_library(isa: str = "native") -> ctypes.CDLL:
    """The compiled host_experts library (built on first use, then cached on disk and per process).
    isa: "native" (the best this CPU has), "avx2" (no AVX-512) or "portable" (no SIMD): the builds
    tests and benchmarks compare."""
    if isa not in ISA_BUILDS:
        raise ValueError(f"isa must be one of {sorted(ISA_BUILDS)}, got {isa!r}")
    from cupool.kernels import kernel_dir
    src = kernel_dir() / SOURCE
    text = src.read_bytes()
    cc = find_compiler()
    flags = FLAGS + ISA_BUILDS[isa]
    key = (str(src), text, cc, flags)
    with _LIBS_LOCK:
        lib = _LIBS.get(key)
        if lib is not None:
            return lib
        version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
        digest = hashlib.sha256(b"\0".join([text, version.encode(), " ".join(flags).encode(),
                                            _cpu_flags().encode()])).hexdigest()[:20]
        out = cache_dir() / f"host_experts-{digest}.so"
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_suffix(f".{os.getpid()}.tmp")
            r = subprocess.run([cc, *flags, "-o", str(tmp), str(src), "-lm"],
                               capture_output=True, text=True)
            if r.returncode:
                tmp.unlink(missing_ok=True)
                raise RuntimeError(f"compiling rawkernels/{SOURCE} with {cc} "
                                   f"{' '.join(flags)} failed:\n{r.stderr.strip()}")
            os.replace(tmp, out)
        lib = ctypes.CDLL(str(out))
        _declare(lib)
        _LIBS[key] = lib
        return lib


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.hx_create.restype, lib.hx_create.argtypes = p, [i32, i64]
    lib.hx_destroy.restype, lib.hx_destroy.argtypes = None, [p]
    lib.hx_threads.restype, lib.hx_threads.argtypes = i32, [p]
    lib.hx_isa.restype, lib.hx_isa.argtypes = i32, []
    run = [p, ctypes.POINTER(_Layout), p, i64, i32, i32, p, p, p, p]
    lib.hx_run.restype, lib.hx_run.argtypes = i32, run
    lib.hx_run_timed.restype, lib.hx_run_timed.argtypes = i32, run + [i32, p]
    lib.hx_read.restype, lib.hx_read.argtypes = i64, [p, p, i64, ctypes.POINTER(ctypes.c_uint64)]


def default_threads() -> int:
    """One thread per CPU this process may run on, less one for the serving thread (at least 1)."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:                   # not Linux
        n = os.cpu_count() or 1
    return max(1, n - 1)


class HostExperts:
    """A thread pool that computes the experts of a host store's rows on the CPU.

    Args:
        table: int64 host addresses of the rows by key (layer·E + expert): `HostStore.host_addresses()`.
            The rows must stay alive and unchanged while this object is used (a sealed store).
        layout: the rows' `RowLayout`.
        activation: the experts' activation (`cupool.activation`), one the layout takes.
        threads: threads a call uses, the calling one included (default `default_threads()`).
        spin_ms: how long an idle worker spins for the next call before it sleeps (a call after
            that pays the wake-up).
        isa: "native" (default), "avx2" or "portable": which build (`load_library`).
    """

    def __init__(self, table: np.ndarray, layout: RowLayout, activation: Activation = SILU, *,
                 threads: int | None = None, spin_ms: float = 50.0, isa: str = "native"):
        if not isinstance(layout, RowLayout):
            raise TypeError(f"layout: expected a RowLayout, got {type(layout).__name__}")
        if not isinstance(activation, Activation):
            raise TypeError(f"activation: expected a cupool.activation.Activation, got "
                            f"{type(activation).__name__}")
        if activation.gated != layout.gated:
            raise ValueError(f"activation {activation.kind!r} {'needs' if activation.gated else 'takes no'} "
                             f"gate rows, and the layout is {'gated' if layout.gated else 'not gated'}")
        table = np.asarray(table)
        if table.dtype != np.int64 or table.ndim != 1 or table.size == 0:
            raise ValueError(f"table: expected a non-empty 1-D int64 array of row addresses, got "
                             f"{table.dtype} {list(table.shape)}")
        if (table == 0).any():
            raise ValueError(f"table: {int((table == 0).sum())} null row addresses")
        threads = default_threads() if threads is None else threads
        if not isinstance(threads, int) or not 1 <= threads <= 1024:
            raise ValueError(f"threads must be an int in [1, 1024], got {threads!r}")
        if not spin_ms >= 0:
            raise ValueError(f"spin_ms must be >= 0, got {spin_ms!r}")
        self.layout, self.activation = layout, activation
        self._table = np.ascontiguousarray(table)
        self._lib = load_library(isa)
        self._c = _Layout(layout.hidden, layout.intermediate, layout.hp, layout.ip,
                          layout.w2_offset, layout.bias_offset if layout.bias else -1,
                          int(layout.gated), ACT_CODES[activation.kind],
                          activation.alpha or 0.0, activation.limit or 0.0)
        self._pool = self._lib.hx_create(threads, int(spin_ms * 1e6))
        if not self._pool:
            raise RuntimeError(f"starting {threads} host expert threads failed")
        self.threads = threads
        self.isa = ISA_NAMES[self._lib.hx_isa()]     # what the build's inner loop uses

    def _check(self, x, keys, weights, out):
        H = self.layout.hidden
        if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.dim() != 2 \
                or x.shape[1] != H or x.device.type != "cpu" or not x.is_contiguous():
            raise ValueError(f"x: expected a contiguous float32 CPU tensor [T, {H}], got "
                             f"{_describe(x)}")
        T = x.shape[0]
        if T < 1:
            raise ValueError("x: expected at least one token, got T = 0")
        if not isinstance(keys, torch.Tensor) or keys.dtype != torch.int64 or keys.dim() != 2 \
                or keys.shape[0] != T or keys.device.type != "cpu" or not keys.is_contiguous():
            raise ValueError(f"keys: expected a contiguous int64 CPU tensor [{T}, K], got "
                             f"{_describe(keys)}")
        K = keys.shape[1]
        if K < 1:
            raise ValueError("keys: expected K >= 1 lanes a token, got 0")
        if not isinstance(weights, torch.Tensor) or weights.dtype != torch.float32 \
                or tuple(weights.shape) != (T, K) or weights.device.type != "cpu" \
                or not weights.is_contiguous():
            raise ValueError(f"weights: expected a contiguous float32 CPU tensor [{T}, {K}], got "
                             f"{_describe(weights)}")
        n = self._table.size
        bad = (keys < -1) | (keys >= n)
        if bool(bad.any()):
            i = int(bad.reshape(-1).nonzero()[0])
            raise ValueError(f"keys: {int(bad.sum())} outside [-1, {n}) (layer·E + expert, -1 "
                             f"padding), e.g. keys[{i // K}, {i % K}] = {int(keys.reshape(-1)[i])}")
        routed = keys >= 0
        nonfinite = routed & ~torch.isfinite(weights)
        if bool(nonfinite.any()):
            i = int(nonfinite.reshape(-1).nonzero()[0])
            raise ValueError(f"weights: {int(nonfinite.sum())} NaN or Inf on routed lanes, e.g. "
                             f"weights[{i // K}, {i % K}] = {float(weights.reshape(-1)[i])}")
        if out is None:
            out = torch.empty(T, H, dtype=torch.float32)
        elif not isinstance(out, torch.Tensor) or out.dtype != torch.float32 \
                or tuple(out.shape) != (T, H) or out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError(f"out: expected a contiguous float32 CPU tensor [{T}, {H}], got "
                             f"{_describe(out)}")
        return T, K, out

    def _args(self, x, keys, weights, out, T, K):
        return (self._pool, ctypes.byref(self._c), self._table.ctypes.data, self._table.size, T, K,
                keys.data_ptr(), weights.data_ptr(), x.data_ptr(), out.data_ptr())

    def __call__(self, x: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """out [T, H] float32 = Σ over token t's lanes of weights[t, k] · expert keys[t, k] (x[t]).

        x: float32 [T, H]; keys: int64 [T, K], layer·E + expert (-1: padding); weights: float32
        [T, K]. All contiguous CPU tensors; out (optional) receives the result."""
        self._require_open()
        T, K, out = self._check(x, keys, weights, out)
        err = self._lib.hx_run(*self._args(x, keys, weights, out, T, K))
        _raise(err, T, K)
        return out

    def timed(self, x, keys, weights, reps: int, out=None) -> np.ndarray:
        """Runs the call `reps` times back to back in C; returns each call's wall time in ns."""
        self._require_open()
        T, K, out = self._check(x, keys, weights, out)
        ns = np.zeros(reps, dtype=np.int64)
        err = self._lib.hx_run_timed(*self._args(x, keys, weights, out, T, K), reps,
                                     ns.ctypes.data)
        _raise(err, T, K)
        return ns

    def read(self, buf: np.ndarray) -> int:
        """Reads `buf` (a contiguous uint8 array) with every thread of the pool; returns the wall
        time in ns (the host-memory read rate expert calls are held against)."""
        self._require_open()
        buf = np.asarray(buf)
        if buf.dtype != np.uint8 or buf.ndim != 1 or not buf.flags.c_contiguous:
            raise ValueError(f"buf: expected a contiguous 1-D uint8 array, got {buf.dtype} "
                             f"{list(buf.shape)}")
        s = ctypes.c_uint64()
        return int(self._lib.hx_read(self._pool, buf.ctypes.data, buf.size, ctypes.byref(s)))

    def _require_open(self):
        if not self._pool:
            raise RuntimeError("this HostExperts is closed")

    def close(self) -> None:
        """Stops the threads (idempotent)."""
        if getattr(self, "_pool", None):
            self._lib.hx_destroy(self._pool)
            self._pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return (f"{t.dtype} {list(t.shape)} on {t.device}"
            f"{'' if t.is_contiguous() else ' (not contiguous)'}")


def _raise(err: int, T: int, K: int) -> None:
    # The checks above leave only what the C side alone can see.
    if err & ERR_MEMORY:
        raise MemoryError(f"host experts: no memory for the scratch of {T} tokens x {K} lanes")
    if err & (ERR_KEY | ERR_ARGS):
        raise RuntimeError(f"host experts: the call was refused (error bits {err}) after the "
                           f"Python checks passed; this is a bug")
