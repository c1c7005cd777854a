"""Decode speed at batch 1 from the bytes a token reads: an estimate, not a measurement.

Shape legend (ARCHITECTURE.md): L MoE layers · K top-k · E experts.

The model (`estimate`), per decoded token:

    time = (dense bytes + K·L rows) / (memory bandwidth · hbm_eff)   every weight the token reads
         + layers · layer_s                                         what does not scale with bytes
         + miss rows · row bytes / (PCIe bandwidth · pcie_eff)       bank misses, over PCIe

dense bytes: the dense part the token reads in bf16 (attention, norms, routers, shared experts,
the output head; the input embedding matrix only where it is tied to the head). Every routed
row is read from GPU memory once, hit or miss (a miss is copied into the bank first); a miss
also crosses PCIe (1 − hit rate of the K·L rows). layers: every decoder layer, dense ones too.
layer_s depends on the step (`mode`): "fused", the engine's default step with part of the
experts in the bank (its plan step and row-copy launch run every layer); "fused-resident", the
same step with every expert in the bank (plan step and row copies skipped, a launch or two
fewer a layer); "compiled", the model's own forward through torch.compile.

The constants are fitted to one GPU's measurements (`H200`, with their source) by `fit`:
pcie_eff and the compiled step's fixed part by a least-squares line through the pool rows of
bench_decode.json (time against bytes copied), hbm_eff from bench_gemm.json's measured HBM read,
and the fused step's two layer_s (the engine's default, what `cupool serve` runs) from
bench_serve.json's single-stream rows: "fused-resident" from the resident bank's (its plan step
skipped), "fused" from the 50% bank's, each fitted to its one row (so those two rows check the
fit, not the model; the compiled step's seven bench_decode rows, six of them fitted with two
constants, check the model). Other GPUs take their own bandwidths (`GPUS`, or the device's own
from NVML) with the same fractions and the same fixed time a layer, which is the estimate's
main assumption. After new H200 measurements, `python -m
cupool.estimate` prints the constants `fit` gets from benchmarks/results; put them into `H200`
(tests/test_estimate.py compares the two and checks the estimate against the measurements).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

# PCIe bandwidth of one lane, one direction, after line coding (GB/s): Gen3 8 GT/s 128b/130b,
# Gen4 16 GT/s, Gen5 32 GT/s.
PCIE_LANE_GBPS = {3: 0.985, 4: 1.969, 5: 3.938}


@dataclasses.dataclass(frozen=True)
class GPU:
    """A GPU's peak memory bandwidth and host link."""
    name: str
    mem_GBps: float          # peak memory bandwidth (HBM or GDDR), GB/s
    pcie_gen: int
    pcie_lanes: int = 16

    @property
    def pcie_GBps(self) -> float:
        return PCIE_LANE_GBPS[self.pcie_gen] * self.pcie_lanes

    def describe(self) -> str:
        return (f"{self.name} (memory {self.mem_GBps:,.0f} GB/s, PCIe Gen{self.pcie_gen} "
                f"x{self.pcie_lanes} {self.pcie_GBps:.1f} GB/s)")


# Vendors' data-sheet figures.
GPUS = {g.name: g for g in (
    GPU("RTX 3090", 936, 4),
    GPU("RTX 4090", 1008, 4),
    GPU("RTX 5090", 1792, 5),
    GPU("RTX PRO 6000", 1792, 5),            # Blackwell, 96 GB
    GPU("A100", 2039, 4),                    # 80 GB SXM
    GPU("H100", 3350, 5),                    # SXM
    GPU("H200", 4800, 5),
)}


def _key(name: str) -> str:
    n = name.lower().replace("nvidia", "").replace("geforce", "")
    return "".join(ch for ch in n if ch.isalnum())


def find_gpu(name: str) -> GPU:
    """A table GPU by name, ignoring case, spaces, dashes and "NVIDIA"/"GeForce"."""
    got = {_key(k): g for k, g in GPUS.items()}.get(_key(name))
    if got is None:
        raise ValueError(f"unknown GPU {name!r}: one of {', '.join(GPUS)}")
    return got


def device_gpu(index: int = 0) -> GPU:
    """The GPU in this machine, from NVML: peak memory bandwidth = 2 · the memory clock's maximum
    · the bus width; the most PCIe generation and lanes the device and its slot allow."""
    import pynvml
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(index)
    name = pynvml.nvmlDeviceGetName(h)
    name = name.decode() if isinstance(name, bytes) else name
    mhz = pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM)
    bus = pynvml.nvmlDeviceGetMemoryBusWidth(h)
    gen = pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h)
    lanes = pynvml.nvmlDeviceGetMaxPcieLinkWidth(h)
    return GPU(name, 2 * mhz * 1e6 * bus / 8 / 1e9, min(max(int(gen), 3), 5), int(lanes))


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The model's constants (module docstring) and where they come from."""
    hbm_eff: float           # fraction of peak memory bandwidth the weight reads reach
    pcie_eff: float          # fraction of the PCIe link's bandwidth the bank's copies reach
    layer_s: dict            # fixed seconds a decoder layer of each mode (module docstring):
                             # "fused", "fused-resident", "compiled"
    source: str


H200 = Calibration(
    hbm_eff=0.905, pcie_eff=0.825,
    layer_s={"fused": 51.8e-6, "fused-resident": 34.1e-6, "compiled": 99.7e-6},
    source="NVIDIA H200, Qwen3-30B-A3B shape (48 layers, E=128, top-8): "
           "benchmarks/results/bench_decode.json (2026-11-29; pool-25/50/100 x uniform/locality, "
           "compiled), bench_serve.json (2026-12-06 10:05 UTC; 1 stream, fused step: resident with "
           "the model's router, 50% bank on the locality trace with serve's default, where a step "
           "of one sequence hands the host nothing), bench_gemm.json (2026-12-01; "
           "HBM read 4,342 GB/s)")


@dataclasses.dataclass(frozen=True)
class Estimate:
    tok_per_s: float
    mem_bytes: float         # read from GPU memory a token
    pcie_bytes: float        # copied over PCIe a token
    parts_s: dict            # seconds a token: "memory", "fixed", "pcie"


def dense_read_bytes(dense: dict[str, int], tied: bool) -> int:
    """Bytes of the dense part a decoded token reads, from {tensor name: bytes}: all of it but
    the input embedding matrix (one row of it is read), unless the output head is that matrix."""
    return sum(b for n, b in dense.items() if tied or not n.endswith("embed_tokens.weight"))


def estimate(gpu: GPU, *, dense_bytes: float, row_bytes: float, topk: int, moe_layers: int,
             layers: int, hit_rate: float, mode: str = "fused",
             cal: Calibration = H200) -> Estimate:
    """Batch-1 decode tokens a second on `gpu` (module docstring)."""
    if not 0.0 <= hit_rate <= 1.0:
        raise ValueError(f"hit_rate must be in [0, 1], got {hit_rate}")
    if mode not in cal.layer_s:
        raise ValueError(f"mode must be one of {sorted(cal.layer_s)}, got {mode!r}")
    rows = topk * moe_layers * row_bytes
    mem = dense_bytes + rows
    pcie = (1.0 - hit_rate) * rows
    parts = {"memory": mem / (gpu.mem_GBps * 1e9 * cal.hbm_eff),
             "fixed": layers * cal.layer_s[mode],
             "pcie": pcie / (gpu.pcie_GBps * 1e9 * cal.pcie_eff)}
    return Estimate(1.0 / sum(parts.values()), mem, pcie, parts)


# --- calibration ---------------------------------------------------------------------------------
def bench_shape_dense_bytes(shape: dict) -> int:
    """dense_read_bytes of the benchmarks' Qwen3-MoE model (`shape` as bench_decode.json records
    it, untied embeddings as cupool.synthetic builds it), counted on a meta-device model."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig
    cfg = Qwen3MoeConfig(**shape, tie_word_embeddings=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    dense = {n: p.numel() * 2 for n, p in model.named_parameters() if ".experts." not in n}
    return dense_read_bytes(dense, tied=False)


def bench_shape(shape: dict) -> dict:
    """What `estimate` needs of the benchmarks' shape, besides the hit rate."""
    H, I = shape["hidden_size"], shape["moe_intermediate_size"]
    hp, ip = -(-H // 64) * 64, -(-I // 64) * 64
    return dict(dense_bytes=bench_shape_dense_bytes(shape), row_bytes=256 + 27 * hp * ip // 16,
                topk=shape["num_experts_per_tok"], moe_layers=shape["num_hidden_layers"],
                layers=shape["num_hidden_layers"])


def measured_points(decode: dict, serve: dict) -> list[tuple[str, str, float, float]]:
    """(what, mode, hit rate, tok/s) of the H200 measurements the model is fitted to and
    checked against. A bench_serve case whose step skipped the plan step (every expert in the
    bank) is of mode "fused-resident", the others "fused"."""
    out = [("bench_decode resident", "compiled", 1.0,
            decode["modes"]["resident"]["uniform"]["tok_per_s"])]
    for m in ("pool-25", "pool-50", "pool-100"):
        for r in ("uniform", "locality"):
            x = decode["modes"][m][r]
            out.append((f"bench_decode {m} {r}", "compiled", x["hit_rate"], x["tok_per_s"]))
    if not serve.get("fused"):
        raise ValueError("bench_serve.json is not a run of the fused step (its \"fused\" is not "
                         "true): the fused calibration needs one")
    for bank in serve["banks"]:
        case = bank["cases"][0]
        if case["streams"] != 1:
            raise ValueError(f"bench_serve.json's first case of bank {bank['bank']} must be 1 "
                             f"stream, got {case['streams']}")
        skipped = case.get("diagnostics", {}).get("plan_skipped", False)
        out.append((f"bench_serve 1 stream, {bank['bank']:.0%} bank, "
                    f"{bank.get('routing', serve['routing'])}",
                    "fused-resident" if skipped else "fused", case["hit_rate"],
                    case["aggregate_decode_tok_per_s"]))
    return out


def fit(decode: dict, serve: dict, gemm: dict, shape: dict | None = None) -> Calibration:
    """The constants from the three benchmark results (module docstring). `shape`: bench_shape
    of decode["shape"] (computed when not given)."""
    import numpy as np
    s = shape or bench_shape(decode["shape"])
    gpu = find_gpu("H200")
    rows = s["topk"] * s["moe_layers"] * s["row_bytes"]
    hbm_eff = gemm["hbm_read_GBps"] / gpu.mem_GBps
    mem_s = (s["dense_bytes"] + rows) / (gpu.mem_GBps * 1e9 * hbm_eff)
    pts = [(hit, 1.0 / tps) for what, mode, hit, tps in measured_points(decode, serve)
           if mode == "compiled" and "pool" in what]
    a = np.array([[1.0, (1.0 - hit) * rows] for hit, _ in pts])
    fixed, per_byte = np.linalg.lstsq(a, np.array([t for _, t in pts]), rcond=None)[0]
    pcie_eff = 1.0 / (per_byte * gpu.pcie_GBps * 1e9)
    layer_s = {}
    for step in ("fused", "fused-resident"):
        fixed_s = [1.0 / tps - (1.0 - hit) * rows * per_byte - mem_s
                   for what, mode, hit, tps in measured_points(decode, serve) if mode == step]
        if not fixed_s:
            raise ValueError(f"bench_serve.json has no single-stream case of the {step} step "
                             f"(a resident bank and a partial one are both needed)")
        layer_s[step] = round(float(np.mean(fixed_s)) / s["layers"], 7)
    layer_s["compiled"] = round(float(fixed - mem_s) / s["layers"], 7)
    return Calibration(
        hbm_eff=round(float(hbm_eff), 3), pcie_eff=round(float(pcie_eff), 3), layer_s=layer_s,
        source=f"fitted to {decode['gpu']} results of {decode['date']} / {serve['date']} / "
               f"{gemm['date']}")


def load_results(folder: Path | str) -> tuple[dict, dict, dict]:
    """bench_decode.json, bench_serve.json, bench_gemm.json of a results folder."""
    f = Path(folder)
    return tuple(json.loads((f / f"{n}.json").read_text())
                 for n in ("bench_decode", "bench_serve", "bench_gemm"))


def main(argv=None) -> int:
    folder = (argv or sys.argv[1:] or [Path(__file__).resolve().parent.parent / "benchmarks"
                                       / "results"])[0]
    cal = fit(*load_results(folder))
    print(f"hbm_eff={cal.hbm_eff}, pcie_eff={cal.pcie_eff}, layer_s={cal.layer_s}")
    print(f"({cal.source})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
