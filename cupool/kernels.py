"""Loads `rawkernels/<name>.cu` into CuPy modules, once per (source, device, options).

The loader inlines every local header (`#include "x.cuh"`) itself, with `#line` markers, before
handing the text to NVRTC. That way:
- the text CuPy hashes for its disk cache contains every header, so an edited header can never
  keep an old binary;
- compile errors name the real file and line (`rawkernels/common.cuh(12): error ...`).
System headers (`<...>`) are left to NVRTC; cupool's kernels use none.

Options: `-std=c++17`, `-D` defines from the caller, and `-lineinfo` when CUPOOL_KERNEL_DEBUG=1.
Architecture (`cupool._cuda.target`): by default the device's own compute capability (CuPy picks
it and compiles to a cubin). With CUPOOL_ARCH=80|86|89|90|100|120 every kernel is compiled by
NVRTC (through CuPy) as PTX for compute_<arch>, written to the PTX cache
($XDG_CACHE_HOME/cupool/ptx, default ~/.cache/cupool/ptx; named by a hash of the text, options,
arch and NVRTC version) and loaded from that file, so the driver compiles it for the GPU in hand:
the code that runs is what that architecture runs (`__CUDA_ARCH__` = 10 · arch, its copy paths).
`launch` and `resident_grid` keep to the target's shared memory per block and per SM.

`launch` puts a kernel on torch's current stream with cuLaunchKernel and the arguments packed in
one array (`pack_args`); eager prefill calls make ~30 launches, and CuPy's own call spent ~45 µs
of Python on each. A launch `dependent=True` goes through cuLaunchKernelEx with programmatic
stream serialization (sm_90+; `rawkernels/common.cuh` says what such a kernel may do before it
waits), so a decode step's chain of short kernels overlaps each kernel's start, and its weight
loads, with the end of the one before; captured graphs keep these edges. CUPOOL_DEPENDENT_LAUNCH=0
turns it off (every launch then waits for the one before, as on pre-Hopper targets).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import math
import os
import re
import threading
from pathlib import Path

import numpy as np
import torch

from cupool import _cuda

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')


def kernel_dir() -> Path:
    """Where the `.cu` sources are: the checkout's `rawkernels/`, else the installed package data."""
    here = Path(__file__).resolve().parent
    for cand in (here.parent / "rawkernels", here / "rawkernels"):
        if cand.is_dir() and any(cand.glob("*.cu")):
            return cand
    try:
        import cupool.rawkernels as pkg
        cand = Path(pkg.__file__).resolve().parent
        if any(cand.glob("*.cu")):
            return cand
    except ImportError:
        pass
    raise FileNotFoundError(
        f"cupool's CUDA sources (rawkernels/*.cu) are missing: looked in {here.parent / 'rawkernels'} "
        f"and in the installed package cupool.rawkernels; reinstall cupool")


def sources() -> list[Path]:
    """Every kernel source file, sorted."""
    return sorted(kernel_dir().glob("*.cu"))


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel source; the message names the file and carries NVRTC's log."""


def expand(name: str) -> tuple[str, list[Path]]:
    """The text of `rawkernels/<name>.cu` with local headers inlined, and the headers it used.

    Each header is inlined once (the sources use `#pragma once`, which is dropped here).
    """
    root = kernel_dir()
    seen: list[Path] = []

    def visit(path: Path) -> list[str]:
        out = [f'#line 1 "{path.relative_to(root.parent)}"']
        for lineno, line in enumerate(path.read_text().splitlines(), start=1):
            m = _INCLUDE.match(line)
            if m:
                hdr = (path.parent / m.group(1)).resolve()
                if not hdr.is_file():
                    raise KernelCompileError(
                        f"{path}:{lineno}: included header {m.group(1)!r} not found in {root}")
                if hdr not in seen:
                    seen.append(hdr)
                    out.extend(visit(hdr))
                out.append(f'#line {lineno + 1} "{path.relative_to(root.parent)}"')
            elif line.strip() == "#pragma once":
                out.append("")
            else:
                out.append(line)
        return out

    src = root / f"{name}.cu"
    if not src.is_file():
        have = ", ".join(p.stem for p in sources())
        raise FileNotFoundError(f"no kernel source {src} (have: {have})")
    return "\n".join(visit(src)) + "\n", seen


def _options(defines: dict | None) -> tuple[str, ...]:
    opts = ["-std=c++17"]
    for k, v in sorted((defines or {}).items()):
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            raise ValueError(f"define name {k!r} is not a C identifier")
        opts.append(f"-D{k}={int(v) if isinstance(v, (bool, np.integer)) else v}")
    if os.environ.get("CUPOOL_KERNEL_DEBUG", "") not in ("", "0"):
        opts.append("-lineinfo")
    return tuple(opts)


_lock = threading.Lock()
_modules: dict[tuple, object] = {}


def cache_root() -> Path:
    """cupool's files that can be rebuilt: $XDG_CACHE_HOME/cupool (default ~/.cache/cupool)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cupool"


def ptx_cache_dir() -> Path:
    """Where CUPOOL_ARCH builds keep their PTX files."""
    return cache_root() / "ptx"


def _ptx_file(name: str, text: str, opts: tuple[str, ...], sm: int) -> Path:
    """PTX of a source for compute_<sm>, compiled by NVRTC once and kept in `ptx_cache_dir()`
    under a name that hashes everything the PTX depends on."""
    nvrtc = _cuda.cupy().cuda.nvrtc
    version = ".".join(map(str, nvrtc.getVersion()))
    arch_opts = (*opts, "--device-as-default-execution-space", f"-arch=compute_{sm}")
    digest = hashlib.sha256("\0".join((text, *arch_opts, version)).encode()).hexdigest()[:32]
    path = ptx_cache_dir() / f"{name}-compute_{sm}-{digest}.ptx"
    if path.is_file():
        return path
    prog = nvrtc.createProgram(text, f"rawkernels/{name}.cu", (), ())
    try:
        try:
            nvrtc.compileProgram(prog, list(arch_opts))
        except nvrtc.NVRTCError:
            raise KernelCompileError(
                f"compiling rawkernels/{name}.cu for compute_{sm} failed (options "
                f"{' '.join(arch_opts)}):\n{nvrtc.getProgramLog(prog)}") from None
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(ptx)
    os.replace(tmp, path)                  # another process may be writing the same file
    return path


def load(name: str, defines: dict | None = None, device=None):
    """The compiled `cupy.RawModule` of `rawkernels/<name>.cu` on `device` (default: current).

    Cached per (name, device, architecture, options, text of source and headers). Under
    CUPOOL_ARCH the module is loaded from PTX for that architecture (see the module docstring).
    """
    cp = _cuda.cupy()
    idx = _cuda.device_index(device)
    tgt = _cuda.target(idx)
    text, _ = expand(name)
    opts = _options(defines)
    key = (name, idx, tgt.sm, tgt.forced, opts, hashlib.sha256(text.encode()).hexdigest())
    with _lock:
        mod = _modules.get(key)
        if mod is not None:
            return mod
        with cp.cuda.Device(idx):
            if tgt.forced:
                path = _ptx_file(name, text, opts, tgt.sm)
                mod = cp.RawModule(path=str(path))
                try:
                    mod.compile()                  # the driver compiles the PTX for this GPU
                except cp.cuda.driver.CUDADriverError as e:
                    raise KernelCompileError(
                        f"the driver could not load {path} (rawkernels/{name}.cu built for "
                        f"compute_{tgt.sm}, options {' '.join(opts)}): {e}") from None
            else:
                mod = cp.RawModule(code=text, options=opts)
                try:
                    mod.compile()
                except cp.cuda.compiler.CompileException as e:
                    raise KernelCompileError(
                        f"compiling rawkernels/{name}.cu failed (options {' '.join(opts)}):\n"
                        f"{e.get_message()}") from None
        _modules[key] = mod
        return mod


_functions: dict[tuple, object] = {}


def function(name: str, kernel: str, defines: dict | None = None, device=None):
    """One `extern "C"` kernel of `rawkernels/<name>.cu`.

    Memoized per (source, kernel, defines, device) for the life of the process, so launchers can
    call this on every launch: the source text is read and hashed only on the first call (sources
    do not change under a running process; CuPy's disk cache is keyed on the full text).
    """
    idx = _cuda.device_index(device)
    key = (name, kernel, tuple(sorted((defines or {}).items())), idx,
           os.environ.get("CUPOOL_KERNEL_DEBUG", ""), os.environ.get(_cuda.ARCH_ENV, ""))
    fn = _functions.get(key)
    if fn is None:
        fn = load(name, defines, idx).get_function(kernel)
        _functions[key] = fn
    return fn


class _Facts:
    """What launch needs of one kernel object, looked up once: its CUfunction handle (None:
    CuPy's call), its largest block (read at its first launch) and the dynamic shared memory it
    was allowed. The record holds the kernel itself, so an id is never reused by another object
    while the record exists (kernels from `function` live for the process)."""

    __slots__ = ("handle", "kernel", "max_threads", "smem")

    def __init__(self, kernel):
        ptr = getattr(getattr(kernel, "kernel", None), "ptr", None)
        self.kernel = kernel
        self.handle = int(ptr) if isinstance(ptr, (int, np.integer)) and ptr else None
        self.max_threads: int | None = None
        self.smem = 48 * 1024                  # allowed without asking


_facts: dict[int, _Facts] = {}               # id(kernel) -> its record


def _kernel_facts(kernel) -> _Facts:
    got = _facts.get(id(kernel))
    if got is None:
        got = _facts[id(kernel)] = _Facts(kernel)
    return got


_SLOT_MASK = {4: 0xFFFFFFFF, 8: 0xFFFFFFFFFFFFFFFF}
_SLOT_OFFSETS = np.arange(64, dtype=np.uint64) * np.uint64(8)


def pack_args(args) -> np.ndarray | None:
    """Kernel arguments as cuLaunchKernel reads them: one 8-byte slot each, holding a tensor's
    device address or a 4- or 8-byte numpy scalar's bits (a 4-byte parameter reads the slot's
    low half: little-endian). None if an argument is anything else (the caller then lets CuPy
    convert them)."""
    vals = []
    for a in args:
        if isinstance(a, torch.Tensor):
            vals.append(a.data_ptr())
        elif isinstance(a, np.generic) and a.dtype.itemsize in _SLOT_MASK and a.dtype.kind in "iuf":
            size = a.dtype.itemsize
            if a.dtype.kind == "f":
                a = a.view(np.uint32 if size == 4 else np.uint64)
            vals.append(int(a) & _SLOT_MASK[size])
        else:
            return None
    return np.array(vals, dtype=np.uint64) if len(vals) <= len(_SLOT_OFFSETS) else None


def _function_handle(kernel):
    """The CUfunction of a CuPy RawKernel (None for anything else: stand-ins, other objects)."""
    return _kernel_facts(kernel).handle


_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _raw_stream(idx: int) -> int:
    """Handle of torch's current stream on device idx (the handle straight from torch's C API
    where it has one: no Stream object made a launch)."""
    if _current_raw_stream is not None:
        return int(_current_raw_stream(idx))
    return torch.cuda.current_stream(idx).cuda_stream


class _LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id, 4 bytes of padding, a 64-byte union (8-byte aligned)."""
    _fields_ = [("id", ctypes.c_uint32), ("pad", ctypes.c_uint32),
                ("value", ctypes.c_uint64 * 8)]


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (cuda.h)."""
    _fields_ = [("grid", ctypes.c_uint32 * 3), ("block", ctypes.c_uint32 * 3),
                ("shared_mem", ctypes.c_uint32), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint32)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6         # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class _DriverLaunch:
    """cuLaunchKernelEx from the driver library, with the one attribute a dependent launch sets
    (kept here: the config points at it)."""

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        self.launch_ex = lib.cuLaunchKernelEx
        self.launch_ex.restype = ctypes.c_int
        self.launch_ex.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p,
                                   ctypes.c_void_p, ctypes.c_void_p]
        self.error_string = lib.cuGetErrorString
        self.error_string.restype = ctypes.c_int
        self.error_string.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        self.attr = _LaunchAttribute()
        self.attr.id = _PROGRAMMATIC_STREAM_SERIALIZATION
        self.attr.value[0] = 1                     # programmaticStreamSerializationAllowed
        self.config = _LaunchConfig()
        self.config.attrs = ctypes.pointer(self.attr)
        self.config.num_attrs = 1

    def __call__(self, fptr: int, grid, block, shared_mem: int, stream: int, params: int) -> None:
        c = self.config
        c.grid[:] = grid
        c.block[:] = block
        c.shared_mem = shared_mem
        c.stream = stream
        rc = self.launch_ex(ctypes.byref(c), fptr, params, None)
        if rc:
            msg = ctypes.c_char_p()
            self.error_string(rc, ctypes.byref(msg))
            raise RuntimeError(f"cuLaunchKernelEx (a dependent launch) failed: error {rc} "
                               f"({(msg.value or b'?').decode()}); CUPOOL_DEPENDENT_LAUNCH=0 turns "
                               f"dependent launches off")


_driver_launch: _DriverLaunch | None = None
_launch_lock = threading.Lock()


def _dependent_launch() -> _DriverLaunch:
    global _driver_launch
    if _driver_launch is None:
        with _launch_lock:
            if _driver_launch is None:
                _driver_launch = _DriverLaunch()
    return _driver_launch


def launch(kernel, grid, block, args, shared_mem: int = 0, device=None,
           stream: torch.cuda.Stream | None = None, dependent: bool = False) -> None:
    """Launch on `stream` (a torch stream of `device`), by default torch's current stream of
    `device`. Grid and block are ints or tuples.

    torch tensors in `args` pass as their device address (a 64-bit pointer argument); every
    other argument must already be a numpy scalar of the kernel parameter's width (`i32`, ...).

    Launches straight through cuLaunchKernel with the arguments packed in one array (CuPy's own
    call converted each argument in Python: ~45 µs a launch, which bounded eager prefill calls
    of ~30 launches); CuPy's call remains for arguments of other kinds and other devices.

    dependent: the kernel follows `rawkernels/common.cuh`'s rule for dependent launches (it waits
    for its producers before reading their output and lets its consumers launch only after
    that); on targets with `dependent_launch` it then starts while the kernel before it runs.
    Elsewhere, and through CuPy's call, it is an ordinary launch.
    """
    grid = grid if isinstance(grid, tuple) else (int(grid),)
    block = block if isinstance(block, tuple) else (int(block),)
    threads = math.prod(block)
    facts = _kernel_facts(kernel)
    if facts.max_threads is None:
        facts.max_threads = int(kernel.max_threads_per_block)
    if threads > facts.max_threads:
        raise ValueError(f"block of {threads} threads is more than this kernel can launch "
                         f"({facts.max_threads}: {kernel.num_regs} registers a thread); use "
                         f"fewer threads")
    idx = _cuda.device_index(device)
    if shared_mem > facts.smem:
        room = _cuda.target(idx).smem_block - kernel.shared_size_bytes
        if shared_mem > room:
            tgt = _cuda.target(idx)
            raise ValueError(f"shared_mem={shared_mem} bytes is more than a block may use on "
                             f"sm_{tgt.sm} ({room} bytes beside the kernel's "
                             f"{kernel.shared_size_bytes} static bytes)")
        kernel.max_dynamic_shared_size_bytes = max(kernel.max_dynamic_shared_size_bytes, shared_mem)
        facts.smem = shared_mem
    fptr = facts.handle
    packed = pack_args(args) if fptr is not None and idx == torch.cuda.current_device() else None
    if packed is not None:
        g = grid + (1,) * (3 - len(grid))
        b = block + (1,) * (3 - len(block))
        base = packed.ctypes.data
        params = _SLOT_OFFSETS[:len(packed)] + np.uint64(base)
        handle = _raw_stream(idx) if stream is None else stream.cuda_stream
        if dependent and _cuda.target(idx).dependent_launch:
            _dependent_launch()(fptr, g, b, shared_mem, handle, params.ctypes.data)
            return
        _cuda.cupy().cuda.driver.launchKernel(fptr, g[0], g[1], g[2], b[0], b[1], b[2], shared_mem,
                                              handle, params.ctypes.data, 0)
        return
    args = tuple(_cuda.ptr(a) if isinstance(a, torch.Tensor) else a for a in args)
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        with _cuda.current_stream(device):
            kernel(grid, block, args, shared_mem=shared_mem)


_grids: dict[tuple, int] = {}


def resident_grid(kernel, threads: int, shared_mem: int, device=None) -> int:
    """Blocks of a persistent launch: as many as fit on the GPU at once (registers, shared memory
    and threads of an SM, at most 32 blocks an SM), so every block starts at once and loops over
    the work items. Shared memory of an SM is the target's (`cupool._cuda.target`: the GPU's own,
    capped by CUPOOL_ARCH). Cached per (kernel, block, shared memory, device, target)."""
    idx = _cuda.device_index(device)
    tgt = _cuda.target(idx)
    key = (id(kernel), threads, shared_mem, idx, tgt)
    got = _grids.get(key)
    if got is None:
        _kernel_facts(kernel)                    # keeps the kernel alive, so its id stays its own
        props = torch.cuda.get_device_properties(idx)
        regs_sm = getattr(props, "regs_per_multiprocessor", 65536)
        smem_sm = tgt.smem_sm
        threads_sm = getattr(props, "max_threads_per_multi_processor", 2048)
        regs = -(-max(kernel.num_regs, 1) // 8) * 8          # allocated 8 registers at a time
        by_regs = regs_sm // (regs * threads)
        by_smem = smem_sm // (shared_mem + kernel.shared_size_bytes + 1024)   # 1 KiB reserved
        per_sm = max(1, min(by_regs, by_smem, threads_sm // threads, 32))
        got = _grids[key] = tgt.sms * per_sm
    return got


NULL = np.uint64(0)  # a null pointer argument (kernels that take an optional array test for it)


def i32(x) -> np.int32:
    return np.int32(x)


def i64(x) -> np.int64:
    return np.int64(x)


def f32(x) -> np.float32:
    return np.float32(x)
