"""GPU checks of the architecture kernels are built for: the code that runs reports the
__CUDA_ARCH__ of the target (`cupool._cuda.target`), CUPOOL_ARCH builds load from PTX for that
architecture and keep to its shared memory, and the launchers pick its paths.

Run the whole GPU suite under CUPOOL_ARCH=80, 86 and 89 on a newer GPU to test the code those
GPUs run (README, GPUs)."""

import os

import pytest
import torch

from cupool import _cuda, kernels
from cupool.gemm import MoEGemm
from cupool.layout import RowLayout

pytestmark = pytest.mark.gpu


def cuda_arch() -> int:
    """__CUDA_ARCH__ of the selftest module as loaded now (under the current CUPOOL_ARCH)."""
    out = torch.full((1,), -1, dtype=torch.int32, device="cuda")     # poisoned
    kernels.launch(kernels.function("selftest", "cuda_arch"), 1, 32, (out,))
    return int(out.item())


def test_the_code_that_runs_is_the_targets():
    """Under the process's own CUPOOL_ARCH (or none): 10 x the target's architecture."""
    tgt = _cuda.target()
    assert cuda_arch() == 10 * tgt.sm, tgt
    forced = _cuda.parse_arch(os.environ.get(_cuda.ARCH_ENV, ""))
    assert tgt.forced == (forced is not None) and tgt.sm == (forced or tgt.device_sm)


@pytest.mark.parametrize("arch", list(_cuda.ARCHS), ids=[f"sm_{a}" for a in _cuda.ARCHS])
def test_cupool_arch_loads_ptx_for_that_architecture(arch, monkeypatch, tmp_path):
    dev = _cuda.device_sm(torch.cuda.get_device_capability())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv(_cuda.ARCH_ENV, str(arch))
    # modules this process loaded before (under the same CUPOOL_ARCH) must not be reused here:
    # the PTX has to be built and written for this test
    monkeypatch.setattr(kernels, "_modules", {})
    monkeypatch.setattr(kernels, "_functions", {})
    if arch > dev:
        with pytest.raises(_cuda.UnsupportedGPUError, match=f"CUPOOL_ARCH={arch}"):
            kernels.function("selftest", "axpb")
        return
    assert cuda_arch() == 10 * arch                     # the driver compiled compute_<arch> PTX
    ptx = list((tmp_path / "cupool" / "ptx").glob(f"selftest-compute_{arch}-*.ptx"))
    assert len(ptx) == 1 and f".target sm_{arch}" in ptx[0].read_text()
    # the same module text without CUPOOL_ARCH is the GPU's own build again
    monkeypatch.delenv(_cuda.ARCH_ENV)
    assert cuda_arch() == 10 * dev


@pytest.mark.parametrize("arch", [80, 86, 89])
def test_cupool_arch_caps_shared_memory_and_picks_that_architectures_paths(arch, monkeypatch,
                                                                           tmp_path):
    if _cuda.device_sm(torch.cuda.get_device_capability()) < arch:
        pytest.skip(f"this GPU cannot run sm_{arch} code")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv(_cuda.ARCH_ENV, str(arch))
    tgt = _cuda.target()
    a = _cuda.ARCHS[arch]
    assert tgt.smem_block <= a.smem_block and tgt.smem_sm <= a.smem_sm and not tgt.bulk_copy
    # a launch asking for more shared memory than sm_<arch> gives a block is refused
    k = kernels.function("selftest", "axpb")
    x = torch.randn(64, device="cuda")
    args = (x, torch.zeros(1, device="cuda"), torch.empty_like(x), kernels.f32(1.0),
            kernels.i32(64))
    with pytest.raises(ValueError, match=f"more than a block may use on sm_{arch}"):
        kernels.launch(k, 1, 64, args, shared_mem=a.smem_block + 1024)
    # the row copies are SM loads; the decode GEMM is still one launch, and its grid keeps to an
    # SM's shared memory of sm_<arch>
    from cupool.ops.rowcopy import RowCopier
    src = torch.zeros(4, dtype=torch.int64, device="cuda")
    dst = torch.zeros(2, 4096, dtype=torch.uint8, device="cuda")
    assert RowCopier(src, 4096, dst, 2).mode == "ld"
    gemm = MoEGemm(RowLayout(256, 128), 2, torch.bfloat16, max_decode_tokens=2)
    assert gemm.decode_kernel == "fused"
    from cupool.ops.moe_decode import Build, shared_bytes
    b = Build(nt=8, maxw=64, minb=3, w13_split=4, xalign=1, w_dtype=0)
    fn, grid, smem = gemm.decoder._compile(b)
    assert smem == shared_bytes(b)
    per_sm = grid // tgt.sms
    assert grid % tgt.sms == 0 and per_sm * (smem + fn.shared_size_bytes + 1024) <= a.smem_sm
