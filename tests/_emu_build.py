"""Building and running a kernel's own source against tests/emu for the CPU emulation tests
(test_attention_emu.py, test_gemv_emu.py, test_decode_emu.py).

`stage` copies the kernel and the rawkernels headers it includes next to the emulated stand-ins
(tests/emu's common.cuh, async_copy.cuh), so that every quoted include, the headers' own among
them, finds a stand-in before a real one; `compile_all` builds one driver (tests/emu/*_main.cpp)
per set of defines, one g++ a core; `run` hands a driver its input words and returns its output
words (the drivers' file format, tests/emu/emu_io.h).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from _planner_emu import unavailable

ROOT = Path(__file__).resolve().parent.parent
EMU = Path(__file__).resolve().parent / "emu"
STAND_INS = ("common.cuh", "async_copy.cuh")


def require() -> None:
    """Skip the test (with the reason) where the emulation cannot be built here."""
    why = unavailable()
    if why:
        pytest.skip(why)


def stage(work: Path, kernel: str, headers=(), replace: dict | None = None) -> None:
    """rawkernels/<kernel>.cu (with each `replace` key swapped for its value) and `headers`
    (rawkernels/ names) into `work`, beside tests/emu's stand-ins."""
    src = (ROOT / "rawkernels" / f"{kernel}.cu").read_text()
    for old, new in (replace or {}).items():
        assert old in src, f"{kernel}.cu no longer has {old!r}"
        src = src.replace(old, new)
    (work / f"{kernel}.cu").write_text(src)
    for h in headers:
        shutil.copy(ROOT / "rawkernels" / h, work / h)
    for h in STAND_INS:
        shutil.copy(EMU / h, work / h)


def command(work: Path, driver: str, defines: dict, out: Path, opt: str = "-O2") -> list[str]:
    """g++ building tests/emu/<driver> with `defines` against the sources staged in `work`. The
    kernels read through reinterpret_cast as CUDA allows: no strict aliasing."""
    return [shutil.which("g++") or "g++", "-std=c++20", opt, "-Wall", "-Wno-unknown-pragmas",
            "-Wno-unused-variable", "-Wno-unused-but-set-variable", "-fno-strict-aliasing",
            *(f"-D{k}={v}" for k, v in defines.items()), f"-I{work}", f"-I{EMU}",
            str(EMU / driver), "-o", str(out), "-pthread"]


def compile_all(work: Path, driver: str, builds: dict) -> dict:
    """{name: executable} of `driver` built with each name's defines; an AssertionError with the
    command and g++'s message for a build that fails."""
    def build(name: str):
        cmd = command(work, driver, builds[name], work / name)
        return cmd, subprocess.run(cmd, capture_output=True, text=True, timeout=900)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        for cmd, r in pool.map(build, builds):
            assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stderr[-4000:]}"
    return {name: work / name for name in builds}


def bf16_words(t: torch.Tensor) -> np.ndarray:
    """A bf16 tensor as int64 words, one element a word (its 16 bits)."""
    return t.contiguous().view(torch.int16).numpy().astype(np.int64).reshape(-1) & 0xFFFF


def bf16(words: np.ndarray, shape) -> torch.Tensor:
    """`bf16_words` back to a bf16 tensor of `shape`."""
    return torch.from_numpy(words.astype(np.uint16).view(np.int16).copy()).view(
        torch.bfloat16).reshape(shape)


def f32_bits(v: float) -> int:
    """The bits of v as float32, for a driver's input word."""
    return int(np.asarray(v, dtype=np.float32).view(np.uint32))


def run(exe: Path, words) -> np.ndarray:
    """Run driver `exe` on `words` (int64 arrays, joined in order) and return its output words;
    an AssertionError with its message where it fails."""
    src, dst = exe.with_suffix(".in"), exe.with_suffix(".out")
    np.concatenate([np.asarray(w, dtype=np.int64).reshape(-1) for w in words]).tofile(src)
    r = subprocess.run([str(exe), str(src), str(dst)], capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    return np.fromfile(dst, dtype=np.int64)
