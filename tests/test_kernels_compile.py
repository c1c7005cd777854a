"""Every CUDA source compiles with nvcc for sm_90 (CPU test; skipped where nvcc is absent)."""

import subprocess

import pytest

from cupool import kernels

SOURCES = kernels.sources()


def test_sources_found():
    names = {p.stem for p in SOURCES}
    assert {"selftest", "rowcopy"} <= names


@pytest.mark.parametrize("src", SOURCES, ids=[p.name for p in SOURCES])
def test_nvcc_compiles(src, nvcc, tmp_path):
    r = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", f"-I{src.parent}", "-cubin",
                        "-o", str(tmp_path / "out.cubin"), str(src)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{src.name} failed to compile:\n{r.stderr}"
    assert "warning" not in r.stderr.lower(), f"{src.name} compiles with warnings:\n{r.stderr}"


def test_expand_inlines_headers_with_line_markers():
    text, headers = kernels.expand("rowcopy")
    assert any(h.name == "common.cuh" for h in headers)
    assert '#line 1 "rawkernels/common.cuh"' in text
    assert '#include "common.cuh"' not in text
    # the line after the include maps back to the source file
    assert '#line' in text and 'rawkernels/rowcopy.cu' in text


def test_expand_missing_source_names_the_file():
    with pytest.raises(FileNotFoundError, match="no_such_kernel"):
        kernels.expand("no_such_kernel")


def test_defines_are_validated():
    with pytest.raises(ValueError, match="not a C identifier"):
        kernels._options({"bad name": 1})
    assert "-DUNROLL=4" in kernels._options({"UNROLL": 4})


def test_debug_env_adds_lineinfo(monkeypatch):
    monkeypatch.setenv("CUPOOL_KERNEL_DEBUG", "1")
    assert "-lineinfo" in kernels._options(None)
    monkeypatch.setenv("CUPOOL_KERNEL_DEBUG", "0")
    assert "-lineinfo" not in kernels._options(None)
