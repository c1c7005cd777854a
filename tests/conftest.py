"""Test configuration: `gpu` tests skip with a reason where no CUDA device (or CuPy) exists."""

import os
import shutil

import pytest
import torch


def _gpu_reason():
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "CuPy is not installed (pip install 'cupool[cuda13]' or '[cuda12]')"
    return None


GPU_SKIP_REASON = _gpu_reason()


def pytest_addoption(parser):
    parser.addoption("--prefill-config", default="", metavar="NAME=INT[,...]",
                     help="run the prefill GPU tests with the prefill launch config changed, e.g. "
                          "NB=2,MINB=1 (fields of cupool.ops.moe_gemm.GemmConfig), to check a "
                          "variant before it becomes the default")


@pytest.fixture
def prefill_config(request):
    """The prefill launch config the GPU tests build MoEGemm with (--prefill-config)."""
    from cupool.ops.moe_gemm import config_from_text
    try:
        return config_from_text(request.config.getoption("--prefill-config"))
    except ValueError as e:
        raise pytest.UsageError(f"--prefill-config: {e}") from None


def pytest_collection_modifyitems(config, items):
    if GPU_SKIP_REASON is None:
        return
    skip = pytest.mark.skip(reason=f"gpu test: {GPU_SKIP_REASON}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def nvcc():
    path = shutil.which("nvcc")
    if path is None:
        pytest.skip("nvcc is not on PATH")
    return path


@pytest.fixture
def rng():
    """A fresh generator per test, seeded from the OS; the seed is printed on failure."""
    import numpy as np
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"rng seed {seed}")
    return np.random.default_rng(seed)
