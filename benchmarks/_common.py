"""Shared benchmark plumbing: CUDA-event timing, the limits measured in the same run, JSON output
(each benchmark's canonical file in benchmarks/results/, written only by a full run, or --json).

Every benchmark reports what it achieved beside a limit measured in the same process:
- `pcie_h2d_GBps`: one large cudaMemcpyAsync from pinned host memory to the device;
- `hbm_copy_GBps`: a large device-to-device copy, counting bytes read plus bytes written;
- `hbm_read_GBps`: a read-only reduction over a large buffer (bytes read).
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
ARCH_ENV = "CUPOOL_ARCH"     # cupool._cuda.ARCH_ENV: runs of another architecture's code are
                             # labelled so and never overwrite the canonical results


def add_dense_nvfp4(parser) -> None:
    """The `--dense-nvfp4` flag of the decode benchmarks (`synthetic.qwen3_moe_dense_on_gpu`'s
    dense_nvfp4)."""
    parser.add_argument("--dense-nvfp4", action="store_true",
                        help="the attention projections in NVFP4, kept packed for the fused "
                             "step's GEMVs (as a checkpoint with NVFP4 self_attn loads)")


def time_ms(fn, *, warmup: int = 5, iters: int = 50, setup=None) -> float:
    """Median milliseconds of `fn()` over `iters` runs, timed with CUDA events on torch's stream.

    `setup()` (untimed) runs before each timed call, e.g. to rotate inputs out of the cache.
    """
    for _ in range(warmup):
        if setup:
            setup()
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if setup:
            setup()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def capture(fn, calls: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of fn(0), ..., fn(calls - 1), after one untimed pass of them on a side stream
    (compiles kernels, settles allocations: what capture needs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in range(calls):
            fn(c)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in range(calls):
            fn(c)
    torch.cuda.synchronize()
    return g


def pcie_h2d_GBps(nbytes: int = 1 << 30) -> float:
    """Pinned host → device cudaMemcpyAsync of `nbytes` (default 1 GiB), GB/s (1e9)."""
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    src.random_(0, 255)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    ms = time_ms(lambda: dst.copy_(src, non_blocking=True), warmup=2, iters=10)
    return nbytes / ms / 1e6


def hbm_copy_GBps(nbytes: int = 2 << 30) -> float:
    """Device → device copy, bytes read + written, GB/s."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    b = torch.empty_like(a)
    ms = time_ms(lambda: b.copy_(a), warmup=3, iters=20)
    return 2 * nbytes / ms / 1e6


def hbm_read_GBps(nbytes: int = 2 << 30) -> float:
    """Read-only pass (a sum of int64 words), bytes read, GB/s."""
    a = torch.empty(nbytes // 8, dtype=torch.int64, device="cuda").random_(0, 1 << 20)
    ms = time_ms(lambda: a.sum(), warmup=3, iters=20)
    return nbytes / ms / 1e6


class ExpertRows:
    """E random NVFP4 expert rows of one layer in GPU memory, each at a 256-byte-aligned stride:
    `bank` [E, stride] uint8, `addr` int64 [E] (each row's device address), `cpu` the rows on
    the host, and with store=True `store`, a sealed one-layer HostStore of the same rows (close
    it when done)."""

    def __init__(self, layout, E: int, store: bool = False):
        from cupool import HostStore
        from cupool.synthetic import random_rows_fast
        rows = random_rows_fast(layout, E, device="cuda")
        self.bank = torch.zeros(E, layout.row_stride, dtype=torch.uint8, device="cuda")
        self.bank[:, :layout.row_bytes] = rows
        self.addr = self.bank.data_ptr() + torch.arange(E, device="cuda") * self.bank.stride(0)
        self.cpu = rows.cpu()
        self.store = None
        if store:
            self.store = HostStore(1, E, layout.row_bytes)
            self.store.fill(lambda _l: self.cpu, progress=False)
            self.store.seal()

    def resident_addr(self, host_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(on_host bool [E] on the CPU, expert_addr int64 [E]): a fixed random `host_fraction`
        of the experts marked as on the host (address 0, read from the store), the rest at their
        bank address, as MoEGemm.prefill takes them."""
        E = self.addr.numel()
        on_host = torch.zeros(E, dtype=torch.bool)
        pick = torch.randperm(E, generator=torch.Generator().manual_seed(0))[:int(E * host_fraction)]
        on_host[pick] = True
        return on_host, torch.where(on_host.cuda(), torch.zeros_like(self.addr), self.addr)


def sm_clock_mhz() -> int | None:
    """The current SM clock of CUDA device 0 in MHz (NVML), None where NVML is absent."""
    try:
        import pynvml
    except ImportError:
        return None
    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetClockInfo(pynvml.nvmlDeviceGetHandleByIndex(0),
                                                 pynvml.NVML_CLOCK_SM))
    finally:
        pynvml.nvmlShutdown()


def keep_busy(ms: float = 50.0) -> None:
    """Run matrix products for about `ms` milliseconds and wait for them: an idle GPU runs at a
    low clock and takes milliseconds to raise it, so a trace of one short launch after idle
    time would time the low clock."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while (time.perf_counter() - t0) * 1e3 < ms:
        for _ in range(8):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM of /proc/self/status), in bytes."""
    status = Path("/proc/self/status").read_text()
    return int(next(ln for ln in status.splitlines() if ln.startswith("VmHWM")).split()[1]) * 1024


def gpu_name() -> str:
    """The GPU's name, or "none (CPU simulation)" for results computed without one; with
    CUPOOL_ARCH, which code it ran ("NVIDIA H200 running sm_86 code (CUPOOL_ARCH=86, ...)")."""
    if not torch.cuda.is_available():
        return "none (CPU simulation)"
    name = torch.cuda.get_device_name()
    if os.environ.get(ARCH_ENV, "").strip():
        from cupool import _cuda
        return f"{name} running {_cuda.target().describe()}"
    return name


def reduced_by(args, parser, *names: str) -> list[str]:
    """The options among `names` (dests) that make this run smaller than the default one: a
    number below its default, a list missing some of its default entries, a flag (a skip) set.
    Each as it reads on the command line, e.g. '--layers 8 < 16'."""
    out = []
    for name in names:
        value, default = getattr(args, name), parser.get_default(name)
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            if value and not default:
                out.append(flag)
        elif isinstance(default, (list, tuple)):
            missing = [d for d in default if d not in (value or [])]
            if missing:
                out.append(f"{flag} without {' '.join(_text(m) for m in missing)}")
        elif value is not None and default is not None and value < default:
            out.append(f"{flag} {_text(value)} < {_text(default)}")
    return out


def _text(v) -> str:
    if isinstance(v, tuple):
        return ",".join(map(str, v))
    return f"{v:g}" if isinstance(v, float) else str(v)


def results_path(name: str, json_path: Path | None, reduced: list[str]) -> Path | None:
    """Where this run's results go: `json_path` (--json) when given; else the canonical
    benchmarks/results/<name>.json, unless the run is reduced (`reduced` names how), which then
    writes no file (so a quick run never overwrites the canonical one)."""
    if json_path is not None:
        return Path(json_path)
    if os.environ.get(ARCH_ENV, "").strip():             # another architecture's code
        reduced = [*reduced, f"{ARCH_ENV}={os.environ[ARCH_ENV]}"]
    if reduced:
        print(f"a reduced run ({'; '.join(reduced)}): writing no results file "
              f"(--json PATH writes one)")
        return None
    return RESULTS / f"{name}.json"


def shown(path: Path) -> str:
    """`path` relative to the checkout when it lies inside it."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def save(name: str, payload: dict, path: Path | None) -> Path | None:
    """Write `payload` with the benchmark's name, the GPU, the date and torch's version added, to
    `path` (results_path's answer); nothing when `path` is None."""
    if path is None:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "gpu": gpu_name(),
               "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "torch": torch.__version__, **payload}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {shown(path)}")
    return path


def kernel_group(name: str, groups, other: str) -> str:
    """The first of `groups` ((group, (key, ...)), ...) with a key that `name` holds
    (case-insensitive), else `other`."""
    low = name.lower()
    for g, keys in groups:
        if any(k.lower() in low for k in keys):
            return g
    return other


def gpu_events(prof) -> list[dict]:
    """Kernels and memory copies of a finished `torch.profiler.profile` run (CUDA activity), in
    start order: {"name", "stream", "start_us", "end_us", "kind": "kernel" | "memcpy" | "memset"}.
    Read from the profiler's chrome trace, whose timestamps are µs."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    kinds = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}
    out = [{"name": e["name"], "stream": e.get("args", {}).get("stream", -1),
            "start_us": float(e["ts"]), "end_us": float(e["ts"]) + float(e.get("dur", 0)),
            "kind": kinds[e.get("cat")]}
           for e in events if e.get("cat") in kinds and "ts" in e]
    return sorted(out, key=lambda e: e["start_us"])


def union_us(spans) -> float:
    """Length of the union of [start, end) intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(spans):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (cur_e - cur_s if cur_e is not None else 0.0)


def timeline_breakdown(events: list[dict], group_of, top: int = 8) -> dict:
    """Where a stretch of GPU work went (`gpu_events`' list): its span from the first start to
    the last end, each stream's busy time (the union of its events' intervals), the time no
    stream was busy, each group's summed event time and count (`group_of(name)` names it), and
    the `top` kernel names by summed time ("kernels": name cut to 100 characters, its group, ms,
    count). All in ms."""
    if not events:
        return {"span_ms": 0.0, "idle_ms": 0.0, "streams": {}, "groups": {}, "kernels": []}
    t0 = min(e["start_us"] for e in events)
    t1 = max(e["end_us"] for e in events)
    streams: dict[str, list] = {}
    groups: dict[str, list] = {}
    names: dict[str, list] = {}
    for e in events:
        streams.setdefault(str(e["stream"]), []).append((e["start_us"], e["end_us"]))
        for table, key in ((groups, group_of(e["name"])), (names, e["name"][:100])):
            g = table.setdefault(key, [0.0, 0])
            g[0] += (e["end_us"] - e["start_us"]) / 1e3
            g[1] += 1
    busy = union_us([(e["start_us"], e["end_us"]) for e in events])
    return {"span_ms": (t1 - t0) / 1e3, "idle_ms": (t1 - t0 - busy) / 1e3,
            "streams": {k: union_us(v) / 1e3 for k, v in streams.items()},
            "groups": {k: {"ms": v[0], "count": v[1]} for k, v in
                       sorted(groups.items(), key=lambda kv: -kv[1][0])},
            "kernels": [{"name": k, "group": group_of(k), "ms": v[0], "count": v[1]} for k, v in
                        sorted(names.items(), key=lambda kv: -kv[1][0])[:top]]}
