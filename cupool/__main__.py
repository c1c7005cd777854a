"""`python -m cupool <command>`: `info` (the GPU, versions, whether kernels compile)."""

from __future__ import annotations

import argparse
import importlib
import shutil
import subprocess
import sys


def _version(mod: str) -> str:
    try:
        return getattr(importlib.import_module(mod), "__version__", "installed")
    except Exception as e:  # noqa: BLE001 (any import failure is reported, not raised)
        return f"not available ({type(e).__name__})"


def _nvcc() -> str:
    path = shutil.which("nvcc")
    if not path:
        return "not on PATH (only needed for the CI compile check)"
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
        rel = [ln for ln in out.splitlines() if "release" in ln]
        return f"{path}: {rel[-1].strip() if rel else 'unknown version'}"
    except (OSError, subprocess.SubprocessError) as e:
        return f"{path}: failed to run ({e})"


def info(args) -> int:
    import torch  # noqa: PLC0415

    import cupool  # noqa: PLC0415
    from cupool import _cuda  # noqa: PLC0415

    print(f"cupool        {cupool.__version__}")
    print(f"torch         {torch.__version__} (CUDA build {torch.version.cuda})")
    print(f"cupy          {_version('cupy')}")
    print(f"transformers  {_version('transformers')}")
    print(f"nvidia-ml-py  {_version('pynvml')}")
    print(f"nvcc          {_nvcc()}")
    if not torch.cuda.is_available():
        print("\nNo CUDA GPU is visible to this process (torch.cuda.is_available() is False); "
              "cupool needs one to serve models. CPU tools (tests, `simulate`) still work.")
        return 1
    try:
        cp = _cuda.cupy()
    except _cuda.CupyMissingError as e:
        print(f"\n{e}")
        return 1
    rt = cp.cuda.runtime

    def ver(v: int) -> str:
        return f"{v // 1000}.{(v % 1000) // 10}"
    print(f"CUDA runtime  {ver(rt.runtimeGetVersion())}   driver API {ver(rt.driverGetVersion())}")
    try:
        print(f"NVRTC         {'.'.join(map(str, cp.cuda.nvrtc.getVersion()))}")
    except Exception as e:  # noqa: BLE001
        print(f"NVRTC         not usable: {e}")
    try:
        import pynvml  # noqa: PLC0415
        pynvml.nvmlInit()
        drv = pynvml.nvmlSystemGetDriverVersion()
        print(f"driver        {drv.decode() if isinstance(drv, bytes) else drv}")
    except Exception as e:  # noqa: BLE001
        print(f"driver        NVML not usable: {e}")
    print()
    print(cupool.report())
    print()
    ok = _selftest()
    return 0 if ok else 2


def _selftest() -> bool:
    """Compile and run the selftest kernel through the loader on torch's stream."""
    import torch  # noqa: PLC0415

    from cupool import kernels  # noqa: PLC0415
    try:
        k = kernels.function("selftest", "axpb")
        x = torch.randn(1000, device="cuda")
        b = torch.tensor([0.5], device="cuda")
        y = torch.full_like(x, float("nan"))
        kernels.launch(k, 4, 256, (x, b, y, kernels.f32(2.0), kernels.i32(x.numel())))
        good = torch.allclose(y, 2 * x + 0.5)
        print(f"kernels       NVRTC compile + launch on torch's stream: {'ok' if good else 'WRONG RESULT'}")
        return bool(good)
    except Exception as e:  # noqa: BLE001
        print(f"kernels       compile/launch failed: {e}")
        return False


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cupool", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="GPU, memory, versions, and a kernel compile check")
    args = p.parse_args(argv)
    return {"info": info}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
