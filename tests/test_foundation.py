"""Packaging, import without CuPy/GPU, budgets, and the host store's CPU behaviour."""

import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

import cupool
from cupool import HostStore, parse_bytes

ROOT = Path(__file__).resolve().parent.parent


def test_import_without_cupy_and_hint_names_the_extra():
    # A child interpreter where `import cupy` fails, as on a machine without the extra.
    code = (
        "import sys; sys.modules['cupy'] = None\n"
        "import cupool\n"
        "from cupool import _cuda\n"
        "try:\n"
        "    _cuda.cupy()\n"
        "except _cuda.CupyMissingError as e:\n"
        "    print('HINT', e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "cupool[cuda13]" in r.stdout and "cupool[cuda12]" in r.stdout


@pytest.mark.parametrize("text,expected", [
    ("48GiB", 48 << 30), ("48 GB", 48 * 10**9), ("1.5TiB", int(1.5 * (1 << 40))),
    ("512MiB", 512 << 20), (" 7 b ", 7), (12345, 12345)])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["48 parsecs", "", "GiB", "-3GiB", "1e3GB", "0GiB"])
def test_parse_bytes_rejects(bad):
    with pytest.raises(ValueError, match="budget"):
        parse_bytes(bad)


@pytest.mark.parametrize("bad", [None, 3.5, True, [1]])
def test_parse_bytes_rejects_types(bad):
    with pytest.raises(TypeError, match="budget"):
        parse_bytes(bad)


def test_pageable_store_addressing_and_seal(rng):
    L, E, row = 3, 5, 1000 * 16
    s = HostStore(L, E, row, pinned=False, chunk_bytes=4 * 16384)  # 4 rows a chunk
    assert s.row_stride == 16128 and s.row_stride % 256 == 0
    assert len(s._chunks) == 4
    data = {}
    def make(layer):
        rows = rng.integers(0, 256, size=(E, row), dtype=np.uint8)
        data[layer] = rows
        return rows
    s.fill(make, progress=False)
    for layer in range(L):
        for e in range(E):
            assert s.row(layer, e).ctypes.data % 256 == 0
            np.testing.assert_array_equal(s.row(layer, e), data[layer][e])
    before = s.checksums()
    s.seal()
    with pytest.raises(RuntimeError, match="sealed"):
        s.write_row(0, 0, data[0][0])
    with pytest.raises(ValueError):
        s.row(1, 2)[0] = 1          # the view is read-only after seal
    np.testing.assert_array_equal(before, s.checksums())
    with pytest.raises(RuntimeError, match="no device address"):
        s.address(0, 0)


def test_store_guards():
    with pytest.raises(ValueError, match="row_bytes"):
        HostStore(1, 1, 100, pinned=False)
    with pytest.raises(ValueError, match="align"):
        HostStore(1, 1, 256, align=100, pinned=False)
    with pytest.raises(ValueError, match="num_layers"):
        HostStore(0, 1, 256, pinned=False)
    s = HostStore(2, 3, 256, pinned=False)
    with pytest.raises(IndexError, match="layer 2"):
        s.row(2, 0)
    with pytest.raises(IndexError, match="expert 3"):
        s.row(0, 3)
    with pytest.raises(ValueError, match="expected 256 bytes"):
        s.write_row(0, 0, np.zeros(255, np.uint8))


def test_wheel_ships_kernel_sources(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = tmp_path.glob("cupool-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for src in (ROOT / "rawkernels").glob("*.cu*"):
        assert f"cupool/rawkernels/{src.name}" in names, f"{src.name} missing from the wheel"
    for src in (ROOT / "cupool").rglob("*.py"):                 # every module, subpackages too
        rel = src.relative_to(ROOT).as_posix()
        assert rel in names, f"{rel} missing from the wheel (pyproject's packages list)"
    assert any(n.endswith("/LICENSE") or n.endswith("licenses/LICENSE") for n in names)


def test_version():
    assert cupool.__version__


def test_launch_refuses_a_block_larger_than_the_kernel_allows():
    """A block the kernel's registers cannot hold is a clear error before the driver's
    CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES (checked with a stand-in kernel; no GPU needed)."""
    from cupool import kernels

    class Stub:
        max_threads_per_block, num_regs = 640, 96

        def __call__(self, *a, **k):
            raise AssertionError("must not launch")

    with pytest.raises(ValueError, match=r"1024 threads .*\(640: 96 registers"):
        kernels.launch(Stub(), 1, 1024, ())


def test_pack_args_gives_each_argument_its_bits_in_an_8_byte_slot():
    """The argument array cuLaunchKernel reads: tensors as their address, numpy scalars as their
    bits (4-byte ones in the low half, negatives two's complement, floats by bit pattern); any
    other argument leaves the launch to CuPy (None)."""
    import torch

    from cupool import kernels

    t = torch.zeros(3)
    got = kernels.pack_args((t, np.int32(-1), np.float32(2.0), np.uint64(5), np.int64(-2),
                             kernels.NULL, np.uint32(7)))
    assert got.dtype == np.uint64
    assert [int(v) for v in got] == [t.data_ptr(), 0xFFFFFFFF, 0x40000000, 5,
                                     0xFFFFFFFFFFFFFFFE, 0, 7]
    assert kernels.pack_args((1,)) is None                  # width unknown: CuPy converts it
    assert kernels.pack_args((np.int16(1),)) is None
    assert kernels.pack_args((np.bool_(True),)) is None
    assert kernels.pack_args(tuple(np.int32(i) for i in range(65))) is None
    assert kernels.pack_args(()).size == 0


def test_function_handle_is_found_and_cached_per_kernel_object():
    """launch takes the packed path only for objects with a CUfunction handle (CuPy kernels:
    .kernel.ptr); anything else keeps CuPy's call. The cache keeps each object alive, so a
    later object never inherits a freed one's handle through a reused id."""
    from types import SimpleNamespace

    from cupool import kernels

    with_handle = SimpleNamespace(kernel=SimpleNamespace(ptr=0x1234))
    assert kernels._function_handle(with_handle) == 0x1234
    assert kernels._function_handle(SimpleNamespace()) is None
    assert kernels._function_handle(SimpleNamespace(kernel=SimpleNamespace(ptr=0))) is None
    for i in range(50):                                    # make, look up, drop, repeat:
        k = SimpleNamespace(kernel=SimpleNamespace(ptr=1000 + i))
        assert kernels._function_handle(k) == 1000 + i     # never an earlier object's handle
        del k
