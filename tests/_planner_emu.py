"""Runs rawkernels/planner.cu on CPU threads (tests/emu) and compares it with ReferencePlanner.

The kernel source is compiled with g++ against tests/emu/common.cuh (the CUDA features it uses,
emulated with one std::thread per CUDA thread), optionally with ThreadSanitizer, and driven over a
random trace; after every step its routes, lane addresses, copy list and tables must equal the
reference's. Used by tests/test_planner.py; also runnable: `python tests/_planner_emu.py --tsan`.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cupool.ops.planner import ring_capacity
from cupool.reference.planner import (
    COUNTERS,
    ReferencePlanner,
    initial_placement,
    lru_order,
)

EMU = Path(__file__).resolve().parent / "emu"
DYN_DECL = "extern __shared__ u32 dyn_smem[];"
ROWS_BASE, ROW_STRIDE = 0x7F0000000000, 4352


def unavailable() -> str | None:
    """Why the emulation cannot run here (no g++, or one without C++20 <barrier>), else None."""
    gxx = shutil.which("g++")
    if gxx is None:
        return "g++ is not on PATH"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.cpp"
        src.write_text("#include <barrier>\n#include <atomic>\nint main() { std::barrier<> b(1); "
                       "int x = 0; std::atomic_ref<int>(x).fetch_or(1); b.arrive_and_wait(); }\n")
        r = subprocess.run([gxx, "-std=c++20", str(src), "-o", str(Path(tmp) / "probe"),
                            "-pthread"], capture_output=True, text=True, timeout=120)
    return None if r.returncode == 0 else f"{gxx} cannot build C++20 <barrier>: {r.stderr[-300:]}"


def build(workdir: Path, threads: int, items: int, tsan: bool = False,
          source: str | None = None) -> Path:
    """Compile the plan step (or `source`, a variant of it) for the CPU; returns the executable."""
    src = source if source is not None else (ROOT / "rawkernels" / "planner.cu").read_text()
    if DYN_DECL not in src:
        raise RuntimeError(f"planner.cu no longer declares `{DYN_DECL}`; update {__file__}")
    (workdir / "planner.cu").write_text(src.replace(DYN_DECL, "u32* dyn_smem = emu_dyn_smem;"))
    shutil.copy(EMU / "common.cuh", workdir / "common.cuh")
    exe = workdir / ("planner_tsan" if tsan else "planner_emu")
    cmd = [shutil.which("g++") or "g++", "-std=c++20", "-O1" if tsan else "-O2", "-g",
           "-Wall", "-Wno-unknown-pragmas", f"-DTHREADS={threads}", f"-DITEMS={items}",
           f"-I{workdir}", f"-I{EMU}", str(EMU / "planner_main.cpp"), "-o", str(exe), "-pthread"]
    if tsan:
        cmd.insert(1, "-fsanitize=thread")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"emulation build failed:\n{' '.join(cmd)}\n{r.stderr}")
    return exe


def random_trace(rng, L, E, steps, max_lanes, p_flip=(0.1, 0.01)):
    """[(gate, layer, ids int64)]: skewed routing, duplicates, padding, invalid ids, gate flips."""
    hot = []
    for _ in range(L):
        w = 1.0 / (1.0 + np.arange(E)) ** 1.1
        hot.append(w[rng.permutation(E)] / w.sum())
    gate, trace = 0, []
    for _ in range(steps):
        if rng.random() < p_flip[gate]:
            gate ^= 1
        layer = int(rng.integers(L))
        W = int(rng.integers(0, max_lanes + 1)) if rng.random() < 0.05 else \
            int(rng.integers(1, max_lanes + 1))
        ids = rng.choice(E, size=W, p=hot[layer]).astype(np.int64)
        ids[rng.random(W) < 0.1] = -1
        bad = rng.random(W) < 0.005
        ids[bad] = rng.choice([E, E + 1, -2, -(2**40), 2**40], size=int(bad.sum()))
        trace.append((gate, layer, ids))
    return trace


def fresh_lanes(routes, copies) -> np.ndarray:
    """int [W]: 1 where the lane's row is one the step's copy list fills (the reference's view of
    the kernel's lane_fresh)."""
    filled = [r for _, r in copies]
    return np.isin(routes, filled).astype(np.int64) if filled else np.zeros(routes.size, np.int64)


def run(L, E, N, S, max_lanes, threads, items, steps, seed, tsan=False, initial=None,
        timeout=900, source=None, p_flip=(0.1, 0.01), ring=None) -> int:
    """Build, run the trace, compare every step; returns the number of steps compared.
    `ring`: the LRU ring's capacity (default `ring_capacity(R)`; a small one compacts often)."""
    rng = np.random.default_rng(seed)
    ref = ReferencePlanner(L, E, N, S, initial)
    R = ref.num_rows
    trace = random_trace(rng, L, E, steps, max_lanes, p_flip)
    # int64 ids only where they fit int32, so the i32 entry point sees the same values
    is64 = [bool(rng.random() < 0.5) or np.any(np.abs(ids) > 2**31 - 1) for _, _, ids in trace]
    C = ring_capacity(R) if ring is None else int(ring)
    words = [R, E, L, S, max_lanes, ROWS_BASE, ROW_STRIDE, steps, C]
    words += initial_placement(L, E, N, initial).tolist()
    for (gate, layer, ids), wide in zip(trace, is64):
        words += [gate, layer, int(wide), ids.size] + ids.tolist()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        exe = build(tmp, threads, items, tsan, source)
        np.array(words, dtype=np.int64).tofile(tmp / "in.bin")
        try:
            r = subprocess.run([str(exe), str(tmp / "in.bin"), str(tmp / "out.bin")],
                               capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"emulated kernel timed out after {timeout} s (a barrier or warp "
                                 f"intrinsic not reached by every thread deadlocks)") from None
        if r.returncode != 0 or "WARNING" in r.stderr or "ERROR" in r.stderr:
            raise AssertionError(f"emulated kernel failed (rc {r.returncode}):\n{r.stderr[-6000:]}")
        out = np.fromfile(tmp / "out.bin", dtype=np.int64)
    p = 0

    def take(n):
        nonlocal p
        p += n
        return out[p - n:p]

    for i, (gate, layer, ids) in enumerate(trace):
        if gate:
            ref.open()
        else:
            ref.close()
        routes, copies = ref.step(layer, ids)
        W = ids.size
        where = f"step {i} (layer {layer}, W={W}, gate {gate}, ids {ids.tolist()})"
        got_routes, got_addr, got_fresh = take(W), take(W), take(W)
        n = int(take(1)[0])
        got_copies = take(2 * n).reshape(-1, 2) if 0 <= n <= max_lanes else None
        st = ref.state()
        np.testing.assert_array_equal(got_routes, routes, err_msg=f"routes, {where}")
        want_addr = np.where(routes >= 0, ROWS_BASE + routes.astype(np.int64) * ROW_STRIDE, 0)
        np.testing.assert_array_equal(got_addr, want_addr, err_msg=f"lane_addr, {where}")
        np.testing.assert_array_equal(got_fresh, fresh_lanes(routes, copies),
                                      err_msg=f"lane_fresh, {where}")
        assert got_copies is not None and [tuple(c) for c in got_copies.tolist()] == copies, \
            f"copies {n} {got_copies}, expected {copies}, {where}"
        for name, size in (("slot_of", L * E), ("key_of", R), ("last_use", R)):
            np.testing.assert_array_equal(take(size), st[name], err_msg=f"{name}, {where}")
        head, span = take(2)
        assert 0 <= head < C and R <= span <= C, f"ring head {head} span {span} (C={C}), {where}"
        order = take(int(take(1)[0]))
        np.testing.assert_array_equal(order, st["order"], err_msg=f"ring order (-2: pos_of "
                                      f"disagrees), {where}")
        assert int(take(1)[0]) == st["clock"], f"clock, {where}"
        assert int(take(1)[0]) == st["error"], f"error, {where}"
        np.testing.assert_array_equal(take(L * len(COUNTERS)).reshape(L, -1), st["counters"],
                                      err_msg=f"counters, {where}")
        np.testing.assert_array_equal(st["order"], lru_order(st["last_use"]))
    assert p == out.size, "trailing output"
    return len(trace)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tsan", action="store_true")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shape", nargs=7, type=int, metavar=("L", "E", "N", "S", "LANES", "THREADS",
                                                           "ITEMS"), default=[5, 13, 3, 64, 64, 64, 1])
    a = ap.parse_args(argv)
    L, E, N, S, lanes, threads, items = a.shape
    n = run(L, E, N, S, lanes, threads, items, a.steps, a.seed, tsan=a.tsan)
    print(f"{n} steps: emulated kernel == reference{' (ThreadSanitizer clean)' if a.tsan else ''}")


if __name__ == "__main__":
    main()
