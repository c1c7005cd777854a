"""Expert rows computed on the host's CPU cores, where the host store keeps them.

Shape legend (ARCHITECTURE.md): T tokens · K lanes a token · H hidden · I intermediate · L layers ·
E experts a layer.

A miss's row crosses PCIe before the GPU can use it (48 µs a 2.5 MB Qwen3-30B-A3B row on a 55 GB/s
link, about twice that on PCIe 4.0). The host's cores can compute the same expert from the same
bytes where they lie, as llama.cpp's `--n-cpu-moe` does; `HostExperts` is that computation:
`rawkernels/host_experts.c` (AVX-512 with VBMI and VNNI, or AVX2 + FMA, where the CPU has them,
else portable C), compiled at first use with the machine's C compiler (`$CC`, else cc, gcc or
clang; `-O3 -march=native`) into `$XDG_CACHE_HOME/cupool/host` (default ~/.cache/cupool/host),
keyed by the source, the compiler's version, the flags and the CPU's flags. A pool of threads
(spinning between calls, asleep after `spin_ms` idle) splits each call. `host_split` and
`split_table` say how many of a layer call's misses the host should take.

It reads the store's rows in the kernel layout (`cupool.layout`), so it needs no second copy of the
experts in host memory. The weights are the exact NVFP4 values; the vectors they multiply (x and
the act between w13 and w2) are quantized to int8 in blocks of 16 columns, the weights' own blocks,
as llama.cpp's CPU path quantizes its activations, so each block's dot product is exact integer
arithmetic and only the sums across blocks are float32. The result is
`cupool.reference.moe.reference_moe_q8`'s to float32 rounding, and every build (and any thread
count) gives the same bits.
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
from cupool.kernels import cache_root, kernel_dir
from cupool.layout import RowLayout

ERR_KEY, ERR_WEIGHT, ERR_ARGS, ERR_MEMORY = 1, 2, 4, 8      # host_experts.c's HX_ERR_*
ACT_CODES = {"silu": 0, "swiglu_clamp": 1, "relu2": 2}
SOURCE = "host_experts.c"
EMULATION = "hx_avx512_emulated.h"        # the AVX-512 intrinsics in plain C (isa="avx512-emulated")
FLAGS = ("-O3", "-march=native", "-std=c11", "-fPIC", "-shared", "-pthread")
# builds: the best the CPU has, at most AVX2, none (host_experts.c's HX_ISA 2 / 1 / 0), and the
# AVX-512 loop over plain C definitions of its intrinsics (slow: how a CPU without AVX-512 checks it)
ISA_BUILDS = {"native": (), "avx2": ("-DHX_NO_AVX512=1",), "portable": ("-DHX_PORTABLE=1",),
              "avx512-emulated": ("-DHX_EMULATE_AVX512=1",)}
ISA_NAMES = {0: "portable", 1: "avx2", 2: "avx512", 3: "avx512-emulated"}


class _Layout(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int64), ("inter", ctypes.c_int64), ("hp", ctypes.c_int64),
                ("ip", ctypes.c_int64), ("w2_offset", ctypes.c_int64),
                ("bias_offset", ctypes.c_int64), ("gated", ctypes.c_int32),
                ("act", ctypes.c_int32), ("alpha", ctypes.c_float), ("limit", ctypes.c_float)]


def cache_dir() -> Path:
    """Where compiled libraries are kept: $XDG_CACHE_HOME/cupool/host (default ~/.cache)."""
    return cache_root() / "host"


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
    isa: "native" (the best this CPU has), "avx2" (no AVX-512), "portable" (no SIMD) or
    "avx512-emulated" (the AVX-512 loop one lane at a time, on any CPU): the builds tests and
    benchmarks compare; all give the same bits."""
    if isa not in ISA_BUILDS:
        raise ValueError(f"isa must be one of {sorted(ISA_BUILDS)}, got {isa!r}")
    src = kernel_dir() / SOURCE
    text = src.read_bytes() + (kernel_dir() / EMULATION).read_bytes()
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
    lib.hx_isa.restype, lib.hx_isa.argtypes = i32, []
    run = [p, ctypes.POINTER(_Layout), p, i64, i32, i32, p, p, p, p]
    lib.hx_run.restype, lib.hx_run.argtypes = i32, run
    lib.hx_run_timed.restype, lib.hx_run_timed.argtypes = i32, run + [i32, p]
    lib.hx_read.restype, lib.hx_read.argtypes = i64, [p, p, i64, ctypes.POINTER(ctypes.c_uint64)]
    lib.hx_serve.restype, lib.hx_serve.argtypes = i32, [p, ctypes.POINTER(_Layout), p, i64, i32,
                                                        i32, p, p, p, p, p, p, p]
    lib.hx_serve_stop.restype = i32
    lib.hx_serve_stop.argtypes = [p, ctypes.POINTER(ctypes.c_uint)]
    lib.hx_serving.restype, lib.hx_serving.argtypes = i32, [p]
    u64 = ctypes.POINTER(ctypes.c_uint64)
    lib.hx_serve_stats.restype = None
    lib.hx_serve_stats.argtypes = [p, i32, ctypes.POINTER(ctypes.c_uint), u64, u64, u64]


def host_split(misses: int, link_us: float, cpu_us: float, handoff_us: float) -> int:
    """How many of a layer call's `misses` to compute on the host's CPU rather than copy over the
    link: the m that makes max((misses − m) · link_us, m · cpu_us + handoff_us) smallest (the link
    and the CPU work at once, the CPU after a hand-off); the smallest such m on a tie, so a row
    goes to the CPU only where that is faster."""
    best, best_t = 0, misses * link_us
    for m in range(1, misses + 1):
        t = max((misses - m) * link_us, m * cpu_us + handoff_us)
        if t < best_t:
            best, best_t = m, t
    return best


def split_table(lanes: int, link_us: float, cpu_us: float, handoff_us: float,
                min_misses: int = 0) -> np.ndarray:
    """The planner's split table for steps of up to `lanes` lanes (`Bank.set_split`): int64
    [lanes + 1], entry M = `host_split(M, ...)`, from a row's time on the link, a row's time on
    the host's CPU (`HostExperts.timed`, µs a row at the call's size) and the hand-off's fixed
    cost (`benchmarks/probe_host_handoff.py`); 0 (nothing handed over) for M < `min_misses`,
    so calls with few misses (one stream's) keep the plain step."""
    if isinstance(lanes, bool) or not isinstance(lanes, (int, np.integer)) or lanes < 1:
        raise ValueError(f"lanes must be an int >= 1, got {lanes!r}")
    if isinstance(min_misses, bool) or not isinstance(min_misses, (int, np.integer)) \
            or min_misses < 0:
        raise ValueError(f"min_misses must be an int >= 0, got {min_misses!r}")
    for name, v in (("link_us", link_us), ("cpu_us", cpu_us), ("handoff_us", handoff_us)):
        if not (isinstance(v, (int, float, np.floating)) and np.isfinite(v) and v >= 0) \
                or isinstance(v, bool):
            raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
    if cpu_us == 0:
        raise ValueError("cpu_us must be > 0 (a row's time on the host's CPU)")
    return np.array([host_split(m, float(link_us), float(cpu_us), float(handoff_us))
                     if m >= min_misses else 0 for m in range(int(lanes) + 1)], dtype=np.int64)


def usable_cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                   # not Linux
        return os.cpu_count() or 1


def default_threads() -> int:
    """One thread per CPU this process may run on, less one for the serving thread (at least 1)."""
    return max(1, usable_cpus() - 1)


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
        isa: "native" (default), "avx2", "portable" or "avx512-emulated": which build
            (`load_library`).
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
        self._mailbox = None
        self.isa = ISA_NAMES[self._lib.hx_isa()]     # what the build's inner loop uses

    def _check(self, x, keys, weights, out):
        H = self.layout.hidden
        _cpu_tensor("x", x, torch.float32, (None, H), "T")
        T = x.shape[0]
        if T < 1:
            raise ValueError("x: expected at least one token, got T = 0")
        _cpu_tensor("keys", keys, torch.int64, (T, None), "K")
        K = keys.shape[1]
        if K < 1:
            raise ValueError("keys: expected K >= 1 lanes a token, got 0")
        _cpu_tensor("weights", weights, torch.float32, (T, K))
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
        else:
            _cpu_tensor("out", out, torch.float32, (T, H))
        return T, K, out

    def _args(self, x, keys, weights, out, T, K):
        return (self._pool, ctypes.byref(self._c), self._table.ctypes.data, self._table.size, T, K,
                keys.data_ptr(), weights.data_ptr(), x.data_ptr(), out.data_ptr())

    def __call__(self, x: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """out [T, H] float32 = Σ over token t's lanes of weights[t, k] · expert keys[t, k] (x[t]).

        x: float32 [T, H]; keys: int64 [T, K], layer·E + expert (-1: padding); weights: float32
        [T, K]. All contiguous CPU tensors; out (optional) receives the result."""
        self._require_idle()
        T, K, out = self._check(x, keys, weights, out)
        err = self._lib.hx_run(*self._args(x, keys, weights, out, T, K))
        _raise(err, T, K)
        return out

    def timed(self, x, keys, weights, reps: int, out=None) -> np.ndarray:
        """Runs the call `reps` times back to back in C; returns each call's wall time in ns."""
        self._require_idle()
        T, K, out = self._check(x, keys, weights, out)
        ns = np.zeros(reps, dtype=np.int64)
        err = self._lib.hx_run_timed(*self._args(x, keys, weights, out, T, K), reps,
                                     ns.ctypes.data)
        _raise(err, T, K)
        return ns

    def read(self, buf: np.ndarray) -> int:
        """Reads `buf` (a contiguous uint8 array) with every thread of the pool; returns the wall
        time in ns (the host-memory read rate expert calls are held against)."""
        self._require_idle()
        buf = np.asarray(buf)
        if buf.dtype != np.uint8 or buf.ndim != 1 or not buf.flags.c_contiguous:
            raise ValueError(f"buf: expected a contiguous 1-D uint8 array, got {buf.dtype} "
                             f"{list(buf.shape)}")
        s = ctypes.c_uint64()
        return int(self._lib.hx_read(self._pool, buf.ctypes.data, buf.size, ctypes.byref(s)))

    def serve(self, mailbox: Mailbox) -> None:
        """Answers every request posted to `mailbox` (by `cupool.ops.host_handoff.post` on the
        GPU, or `Mailbox.post` on the host) from a thread of the pool until `stop_serving`.
        While it serves, the pool is that thread's: calling this object otherwise raises."""
        self._require_open()
        if not isinstance(mailbox, Mailbox):
            raise TypeError(f"mailbox: expected a Mailbox, got {type(mailbox).__name__}")
        if mailbox.hidden != self.layout.hidden:
            raise ValueError(f"mailbox: holds rows of H = {mailbox.hidden}, the experts have "
                             f"H = {self.layout.hidden}")
        if self._lib.hx_serving(self._pool):
            raise RuntimeError("this HostExperts already serves a mailbox")
        a = mailbox.addresses
        if self._lib.hx_serve(self._pool, ctypes.byref(self._c), self._table.ctypes.data,
                              self._table.size, mailbox.tokens, mailbox.lanes, a["seq"],
                              a["done"], a["size"], a["keys"], a["weights"], a["x"], a["out"]):
            raise RuntimeError("starting the host experts' serving thread failed")
        self._mailbox = mailbox              # kept alive while served
        mailbox.served_by = self

    def stop_serving(self) -> int:
        """Stops serving (after the request in hand, if any); returns how many were answered.
        Raises if a served request had keys or sizes the C side refused."""
        self._require_open()
        n = ctypes.c_uint()
        err = self._lib.hx_serve_stop(self._pool, ctypes.byref(n))
        mb, self._mailbox = self._mailbox, None
        if mb is not None:
            mb.served_by = None
            _raise(err & ~ERR_WEIGHT, mb.tokens, mb.lanes)
        return int(n.value)

    def serve_stats(self, reset_max: bool = False) -> dict:
        """What the serving thread's calls took since `serve` (readable while it serves):
        `calls` answered, their wall time on the host summed (`ns`) and their distinct rows
        summed (`rows`); the longest call (`max_ns`) since `serve` or the last read with
        `reset_max`, which starts it again."""
        self._require_open()
        n = ctypes.c_uint()
        ns, mx, rows = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64()
        self._lib.hx_serve_stats(self._pool, int(bool(reset_max)), ctypes.byref(n),
                                 ctypes.byref(ns), ctypes.byref(mx), ctypes.byref(rows))
        return {"calls": int(n.value), "ns": int(ns.value), "max_ns": int(mx.value),
                "rows": int(rows.value)}

    @property
    def serving(self) -> bool:
        return bool(self._pool) and bool(self._lib.hx_serving(self._pool))

    def _require_open(self):
        if not self._pool:
            raise RuntimeError("this HostExperts is closed")

    def _require_idle(self):
        self._require_open()
        if self._lib.hx_serving(self._pool):
            raise RuntimeError("this HostExperts serves a mailbox: stop_serving() first")

    def close(self) -> None:
        """Stops serving and the threads (idempotent)."""
        if getattr(self, "_pool", None):
            self._lib.hx_destroy(self._pool)
            self._pool = None
            if self._mailbox is not None:
                self._mailbox.served_by = None
            self._mailbox = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()


def _cpu_tensor(name: str, t, dtype: torch.dtype, shape: tuple, free: str = "") -> None:
    """ValueError naming `name` unless t is a contiguous CPU tensor of `dtype` and `shape` (None:
    any size there, shown as `free`)."""
    ok = (isinstance(t, torch.Tensor) and t.dtype == dtype and t.dim() == len(shape)
          and all(n is None or m == n for m, n in zip(t.shape, shape))
          and t.device.type == "cpu" and t.is_contiguous())
    if not ok:
        want = ", ".join(free if n is None else str(n) for n in shape)
        kind = str(dtype).removeprefix("torch.")
        raise ValueError(f"{name}: expected a contiguous {kind} CPU tensor [{want}], got "
                         f"{_describe(t)}")


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


class Mailbox:
    """Where a GPU step and `HostExperts.serve` meet (rawkernels/host_handoff.cu): one request of
    at most T tokens × K lanes at a time, in pinned host memory the GPU reads and writes through
    UVA.

    Layout (byte offsets in `addresses`): seq (u32) at 0, done (u32) at 64, size (u32, the request's
    lanes t·K for its t ≤ T tokens) at 128, keys [T·K] int64, weights [T·K] float32, x [T, H]
    float32, out [T, H] float32, each 64-byte aligned; a request of t tokens uses the first t·K keys
    and weights and the first t rows of x and out. seq and done start at 0. A pinned mailbox (the
    default) is posted to by the GPU (`cupool.ops.host_handoff`), which numbers its requests with
    the mailbox's own device counter (`counter`, int32 [3]: the last request's number; 1 if the last
    post sent one, as a post with no routed lane sends nothing and its wait adds nothing; and the
    post's blocks counted done, 0 between posts), so every replay of a captured graph waits for its
    own answer.
    `pinned=False` gives ordinary memory, posted to from the host (`post` and `wait` play the
    GPU's part: CPU tests)."""

    def __init__(self, tokens: int, lanes: int, hidden: int, *, pinned: bool = True, device=None):
        self._chunk = None
        self.served_by = None                 # the HostExperts serving it (HostExperts.serve)
        self.counter = None
        for name, v in (("tokens", tokens), ("lanes", lanes), ("hidden", hidden)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self.tokens, self.lanes, self.hidden = tokens, lanes, hidden
        W, n = tokens * lanes, tokens * hidden
        offs, at = {}, 0
        for name, size in (("seq", 4), ("done", 4), ("size", 4), ("keys", 8 * W),
                           ("weights", 4 * W), ("x", 4 * n), ("out", 4 * n)):
            offs[name] = at
            at = -(-(at + size) // 64) * 64
        self.nbytes = at
        if pinned:
            from cupool import _cuda
            from cupool.store import _PinnedChunk
            _cuda.require_gpu("a pinned mailbox (pinned=False gives ordinary memory)")
            idx = _cuda.device_index(device)
            self._chunk = _PinnedChunk(at, idx)
            base, dev = self._chunk.host, self._chunk.device_address
            ctypes.memset(base, 0, at)
            self.counter = torch.zeros(3, dtype=torch.int32, device=f"cuda:{idx}")
        else:
            self._chunk = None
            self._buf = np.zeros(at + 64, dtype=np.uint8)
            base, dev = self._buf.ctypes.data + (-self._buf.ctypes.data) % 64, None
        self.addresses = {k: base + v for k, v in offs.items()}        # the host's
        # the GPU's (UVA: the same numbers on 64-bit Linux); None for ordinary memory
        self.device_addresses = None if dev is None else {k: dev + v for k, v in offs.items()}
        self.keys = self._view("keys", np.int64, W)
        self.weights = self._view("weights", np.float32, W)
        self.x = self._view("x", np.float32, n).reshape(tokens, hidden)
        self.out = self._view("out", np.float32, n).reshape(tokens, hidden)

    def _view(self, name, dtype, count):
        size = np.dtype(dtype).itemsize * count
        raw = (ctypes.c_uint8 * size).from_address(self.addresses[name])
        return np.frombuffer(raw, dtype=dtype, count=count)

    def _word(self, name) -> ctypes.c_uint32:
        return ctypes.c_uint32.from_address(self.addresses[name])

    @property
    def seq(self) -> int:
        return self._word("seq").value

    @property
    def done(self) -> int:
        return self._word("done").value

    @property
    def size(self) -> int:
        """The last request's lanes (t·K for its t tokens)."""
        return self._word("size").value

    def post(self, x, keys, weights) -> int:
        """A request from the host (tests, tools): x [t, H], keys [t, K], weights [t, K] for t ≤ T
        tokens; returns its number. Only for a mailbox in ordinary memory: a pinned one is the
        GPU's to post to (`cupool.ops.host_handoff.post`), and its requests are numbered on the
        device."""
        if self.counter is not None:
            raise RuntimeError("mailbox: pinned, so the GPU posts to it "
                               "(cupool.ops.host_handoff.post); Mailbox(pinned=False) is posted "
                               "to from the host")
        x = np.asarray(x, dtype=np.float32)
        t = x.shape[0] if x.ndim == 2 else 0
        if x.ndim != 2 or x.shape[1] != self.hidden or not 1 <= t <= self.tokens:
            raise ValueError(f"x: expected [t, {self.hidden}] with 1 <= t <= {self.tokens}, got "
                             f"{list(x.shape)}")
        W = t * self.lanes
        keys = np.asarray(keys, dtype=np.int64).reshape(-1)
        weights = np.asarray(weights, dtype=np.float32).reshape(-1)
        for name, v in (("keys", keys), ("weights", weights)):
            if v.size != W:
                raise ValueError(f"{name}: expected t·K = {t}·{self.lanes} = {W} values, got "
                                 f"{v.size}")
        self.x[:t] = x
        self.keys[:W] = keys
        self.weights[:W] = weights
        self._word("size").value = W
        s = (self.seq + 1) & 0xFFFFFFFF
        self._word("seq").value = s           # after the request (x86 and CPython keep the order)
        return s

    def wait(self, number: int, timeout_s: float = 10.0) -> np.ndarray:
        """Waits until request `number` is answered; returns out [T, H] (a view: a request of t
        tokens answers in its first t rows)."""
        import time
        end = time.monotonic() + timeout_s
        while self.done != number:
            if time.monotonic() > end:
                raise TimeoutError(f"mailbox: request {number} not answered in {timeout_s} s "
                                   f"(done = {self.done})")
            time.sleep(0)
        return self.out

    def close(self) -> None:
        """Frees the pinned memory (idempotent); refused while a HostExperts serves it."""
        if self.served_by is not None and self.served_by.serving:
            raise RuntimeError("mailbox: still served; HostExperts.stop_serving() first")
        if self._chunk is not None:
            self._chunk.free()
            self._chunk = None

    def __del__(self):
        if getattr(self, "_chunk", None) is not None and not (
                self.served_by is not None and self.served_by.serving):
            self.close()
