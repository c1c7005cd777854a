"""`python -m cupool <command>`: `info` (the GPU, versions, whether kernels compile) and
`simulate` (the planner's hit rate on a routing trace, on the CPU, to size the bank)."""

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
    import torch

    import cupool
    from cupool import _cuda

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
        import pynvml
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
    import torch

    from cupool import kernels
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


def simulate(args) -> int:
    """Hit rate of the reference planner on a trace (CPU only)."""
    from cupool import trace as tr
    from cupool.simulate import simulate as run_simulation
    if args.trace:
        t = tr.Trace.load(args.trace)
    else:
        kind = tr.synthetic if args.synthetic == "locality" else tr.uniform
        kw = dict(tr.QWEN3_LOCALITY) if args.synthetic == "locality" else {}
        t = kind(args.steps, args.layers, args.experts, args.top_k, seed=args.seed, **kw)
    rows = args.rows if args.rows else [max(t.ids.shape[-1], t.num_experts * p // 100)
                                         for p in (25, 50, 100)]
    print(f"trace: {t.steps} steps, {t.num_layers} layers, E={t.num_experts}, "
          f"top_k={t.ids.shape[-1]}, tokens/step={t.ids.shape[2]}; {t.note}")
    print(f"reuse: next token {t.reuse(1):.3f}, within 8 tokens {t.reuse(8):.3f}")
    for r in rows:
        res = run_simulation(t, r, warmup_steps=args.warmup)
        owned = res["rows_owned"]
        print(f"rows/layer {r:5d} ({100 * r / t.num_experts:5.1f}% of experts): hit rate "
              f"{res['hit_rate']:.3f}   rows owned per layer min/max {min(owned)}/{max(owned)}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cupool", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="GPU, memory, versions, and a kernel compile check")
    s = sub.add_parser("simulate", help="hit rate of the planner on a routing trace (CPU only)")
    s.add_argument("--trace", help=".npz trace from cupool.trace (default: a synthetic one)")
    s.add_argument("--rows", type=int, nargs="+", help="bank rows per layer (default: 25/50/100%% of E)")
    s.add_argument("--synthetic", choices=["locality", "uniform"], default="locality")
    s.add_argument("--steps", type=int, default=256)
    s.add_argument("--layers", type=int, default=48)
    s.add_argument("--experts", type=int, default=128)
    s.add_argument("--top-k", type=int, default=8)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--warmup", type=int, default=8, help="steps not counted (cold bank)")
    args = p.parse_args(argv)
    return {"info": info, "simulate": simulate}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
