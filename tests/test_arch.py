"""The architecture kernels are built for (`cupool._cuda.resolve_target`), CUPOOL_ARCH, and what
`cupool info` says of it: CPU tests with made-up GPUs (tests/test_gpu_arch.py runs the real one)."""

from __future__ import annotations

import pytest

from cupool import __main__ as cli
from cupool import _cuda, kernels
from cupool.ops.rowcopy import bulk_stages

KIB = 1024
H200 = dict(capability=(9, 0), sms=132, smem_block=227 * KIB, smem_sm=228 * KIB)
RTX3090 = dict(capability=(8, 6), sms=82, smem_block=99 * KIB, smem_sm=100 * KIB)
RTX5090 = dict(capability=(12, 0), sms=170, smem_block=99 * KIB, smem_sm=100 * KIB)


def target(gpu: dict, env: str | None = None) -> _cuda.Target:
    return _cuda.resolve_target(env=env, **gpu)


@pytest.mark.parametrize("value,want", [("", None), ("  ", None), ("86", 86), ("sm_89", 89),
                                        ("compute_80", 80), ("SM_120", 120), ("100", 100)])
def test_parse_arch(value, want):
    assert _cuda.parse_arch(value) == want


@pytest.mark.parametrize("value", ["75", "87", "sm86", "8.6", "ampere", "-86", "860"])
def test_bad_arch_names_the_variable_and_the_choices(value):
    with pytest.raises(ValueError, match=r"CUPOOL_ARCH must be one of 80, 86, 89, 90, 100, 120"):
        _cuda.parse_arch(value)


def test_native_target_is_the_gpus_own():
    t = target(H200)
    assert (t.sm, t.forced, t.bulk_copy, t.copy_mode) == (90, False, True, "bulk")
    assert (t.smem_block, t.smem_sm, t.sms) == (227 * KIB, 228 * KIB, 132)
    t = target(RTX3090)
    assert (t.sm, t.bulk_copy, t.copy_mode, t.smem_block) == (86, False, "ld", 99 * KIB)
    t = target(RTX5090)          # Blackwell consumer: bulk copies, but a 99 KiB block
    assert (t.sm, t.bulk_copy, t.copy_mode, t.smem_block) == (120, True, "bulk", 99 * KIB)
    assert "the GPU's own" in t.describe()


@pytest.mark.parametrize("arch,block,sm,bulk", [("80", 163, 164, False), ("86", 99, 100, False),
                                                ("89", 99, 100, False), ("90", 227, 228, True)])
def test_forced_arch_on_an_h200_takes_that_architectures_limits(arch, block, sm, bulk):
    t = target(H200, arch)
    assert t.forced and t.sm == int(arch) and t.device_sm == 90
    assert (t.smem_block, t.smem_sm, t.bulk_copy) == (block * KIB, sm * KIB, bulk)
    assert t.sms == 132                        # the GPU's own SMs
    assert f"sm_{arch} code (CUPOOL_ARCH={arch}, PTX compiled by the driver) on an sm_90 GPU" \
        == t.describe()


def test_forced_arch_never_raises_the_gpus_limits():
    small = dict(H200, smem_block=100 * KIB)
    assert target(small, "80").smem_block == 100 * KIB


@pytest.mark.parametrize("arch", ["100", "120"])
def test_an_arch_the_gpu_cannot_run_is_refused(arch):
    with pytest.raises(_cuda.UnsupportedGPUError, match=rf"CUPOOL_ARCH={arch} .* 9.0 .* <= 90"):
        target(H200, arch)


@pytest.mark.parametrize("cap", [(7, 5), (7, 0), (6, 1)])
def test_gpus_before_sm_80_are_refused(cap):
    with pytest.raises(_cuda.UnsupportedGPUError, match=rf"8.0 or newer .* {cap[0]}.{cap[1]}"):
        target(dict(RTX3090, capability=cap))


def test_bulk_stages_fit_the_block():
    assert bulk_stages(32768, 227 * KIB) == 4                # H100/H200/B200: the full ring
    assert bulk_stages(32768, 99 * KIB) == 3                 # RTX 5090 / RTX PRO 6000
    assert bulk_stages(65536, 99 * KIB) == 2                 # never fewer than 2
    assert 3 * 32768 + 64 <= 99 * KIB


def test_ptx_cache_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert kernels.ptx_cache_dir() == tmp_path / "cupool" / "ptx"


def test_info_names_the_path_of_a_forced_architecture():
    text = cli.path_lines(target(H200, "86"))
    assert "kernels for   sm_86 code (CUPOOL_ARCH=86" in text
    assert "row copies    ld (SM loads" in text and "weight stages by cp.async" in text
    assert "decode GEMM   one launch (moe_decode)" in text
    assert "99 KiB a block, 100 KiB an SM, 132 SMs" in text
    native = cli.path_lines(target(H200))
    assert "bulk (the bulk-copy engine" in native and "by bulk copies" in native


def _fake_gpu(monkeypatch, gpu: dict):
    """`cupool info` on a made-up GPU: require_gpu passes, target resolves `gpu` under the
    process's CUPOOL_ARCH."""
    import os
    monkeypatch.setattr(_cuda, "require_gpu", lambda what="": None)
    monkeypatch.setattr(_cuda, "target", lambda device=None: _cuda.resolve_target(
        env=os.environ.get(_cuda.ARCH_ENV, ""), **gpu))


def _one_line_error(rc, err, *words):
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, (rc, err)
    for w in words:
        assert w in lines[0], (w, lines[0])


def test_info_refuses_a_gpu_before_sm_80_in_one_line(monkeypatch, capsys):
    monkeypatch.delenv(_cuda.ARCH_ENV, raising=False)
    _fake_gpu(monkeypatch, dict(RTX3090, capability=(7, 5)))
    rc = cli.main(["info"])
    _, err = capsys.readouterr()
    _one_line_error(rc, err, "cupool: error:", "compute capability 8.0 or newer", "7.5")


@pytest.mark.parametrize("env,words", [("87", ["CUPOOL_ARCH must be one of", "'87'"]),
                                       ("120", ["CUPOOL_ARCH=120", "<= 90"])])
def test_info_refuses_a_bad_cupool_arch_in_one_line(monkeypatch, capsys, env, words):
    monkeypatch.setenv(_cuda.ARCH_ENV, env)
    _fake_gpu(monkeypatch, H200)
    rc = cli.main(["info"])
    _, err = capsys.readouterr()
    _one_line_error(rc, err, *words)


def test_dependent_launches_only_with_sm_90_code(monkeypatch):
    monkeypatch.delenv(_cuda.DEPENDENT_ENV, raising=False)
    assert target(H200).dependent_launch and target(RTX5090).dependent_launch
    assert not target(RTX3090).dependent_launch
    assert not target(H200, "89").dependent_launch       # the PTX has no griddepcontrol
    monkeypatch.setenv(_cuda.DEPENDENT_ENV, "0")
    assert not target(H200).dependent_launch


def test_dependent_launch_structs_match_cuda_h():
    """CUlaunchAttribute and CUlaunchConfig as cuda.h lays them out (x86-64 and aarch64)."""
    import ctypes
    assert ctypes.sizeof(kernels._LaunchAttribute) == 72
    assert kernels._LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(kernels._LaunchConfig) == 56
    assert [getattr(kernels._LaunchConfig, f).offset
            for f in ("grid", "block", "shared_mem", "stream", "attrs", "num_attrs")] \
        == [0, 12, 24, 32, 40, 48]
