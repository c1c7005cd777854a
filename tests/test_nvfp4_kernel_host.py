"""The quantize kernel's arithmetic, built for the host with nvcc, equals the torch reference bit for
bit (CPU test: needs nvcc, no GPU). tests/nvfp4_host_harness.cu runs rawkernels/nvfp4_quant.cu's
own helpers (the same source lines the GPU executes, except the PTX div/mul, which are IEEE like
the host's) over whole tensors; the GPU test then only has indexing and atomics left to prove."""

import shutil
import subprocess

import numpy as np
import pytest
import torch
from nvfp4_cases import DTYPES, KINDS, SHAPES, make_weight

from cupool import kernels, nvfp4

DT_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    out = tmp_path_factory.mktemp("harness") / "nvfp4_harness"
    src = kernels.kernel_dir().parent / "tests" / "nvfp4_host_harness.cu"
    r = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", f"-I{kernels.kernel_dir()}", "-o",
                        str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "warning" not in r.stderr.lower(), r.stderr
    return out


def _run(harness, *args):
    r = subprocess.run([str(harness), *map(str, args)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def _map_f32(harness, tmp_path, mode, values: torch.Tensor) -> np.ndarray:
    src, dst = tmp_path / "in.bin", tmp_path / "out.bin"
    values.float().numpy().tofile(src)
    _run(harness, mode, src, dst)
    return np.fromfile(dst, dtype=np.uint8)


def test_f16_to_f32_every_bit_pattern(harness, tmp_path):
    _run(harness, "f16", tmp_path / "f16.bin")
    got = np.fromfile(tmp_path / "f16.bin", dtype=np.uint32)
    want = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    finite = torch.isfinite(want).numpy()
    np.testing.assert_array_equal(got[finite], want.numpy().view(np.uint32)[finite])


def _e4m3_probe_values(rng) -> torch.Tensor:
    """Every E4M3 value, the midpoints between neighbours and one float32 ulp either side of them,
    the underflow edge, values above 448, inf, and log-uniform random values."""
    grid = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (grid[:-1] + grid[1:]) / 2                      # exact in float32
    probes = [grid, mids, torch.nextafter(mids, torch.zeros_like(mids)),
              torch.nextafter(mids, torch.full_like(mids, 1e9)),
              torch.tensor([2.0 ** -10, 2.0 ** -11, 1e-45, 1e-38, 448.0, 449.0, 464.0, 480.0,
                            1e30, float("inf")]),
              torch.from_numpy((2.0 ** rng.uniform(-40, 12, size=200_000)).astype(np.float32))]
    return torch.cat(probes)


def test_e4m3_rne_matches_torch_cast(harness, tmp_path, rng):
    v = _e4m3_probe_values(rng)
    got = _map_f32(harness, tmp_path, "e4m3", v)
    want = torch.clamp(v, max=448.0).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, f"{bad.size} mismatches, e.g. {v[bad[:5]].tolist()} -> " \
                          f"{got[bad[:5]].tolist()} vs torch {want[bad[:5]].tolist()}"


def test_e2m1_magnitude_matches_reference(harness, tmp_path, rng):
    bounds = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0,
                           5.0, 6.0, 7.0, 1e30])
    v = torch.cat([bounds, torch.nextafter(bounds, torch.zeros_like(bounds)),
                   torch.nextafter(bounds, torch.full_like(bounds, 1e31)),
                   torch.tensor([float("inf"), 1e-45]),
                   torch.from_numpy(rng.uniform(0, 8, size=100_000).astype(np.float32))])
    got = _map_f32(harness, tmp_path, "e2m1", v)
    np.testing.assert_array_equal(got, nvfp4._magnitude_code(v).numpy())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_quantize_bit_identical(harness, tmp_path, rng, kind, dtype):
    for shape in SHAPES:
        w = make_weight(kind, shape, dtype, rng)
        *lead, n, k = shape
        m = int(np.prod(lead)) if lead else 1
        src, dst = tmp_path / "w.bin", tmp_path / "q.bin"
        w.contiguous().view(torch.uint8).numpy().tofile(src)
        _run(harness, "quant", DT_CODE[dtype], m, n, k, src, dst)
        out = np.fromfile(dst, dtype=np.uint8)
        npk, nsc = m * n * k // 2, m * n * k // 16
        ref = nvfp4.quantize(w)
        where = f"{kind} {dtype} {shape}"
        np.testing.assert_array_equal(out[npk + nsc:].view(np.float32).view(np.uint32),
                                      ref.global_scale.reshape(-1).numpy().view(np.uint32),
                                      err_msg=f"global scale, {where}")
        np.testing.assert_array_equal(out[npk:npk + nsc],
                                      ref.block_scale.view(torch.uint8).reshape(-1).numpy(),
                                      err_msg=f"block scale, {where}")
        np.testing.assert_array_equal(out[:npk], ref.packed.reshape(-1).numpy(),
                                      err_msg=f"packed, {where}")
