"""Runs rawkernels/planner.cu on CPU threads (tests/emu) and compares it with ReferencePlanner.

The kernel source is compiled with g++ against tests/emu/common.cuh (the CUDA features it uses,
emulated with one std::thread per CUDA thread), optionally with ThreadSanitizer, and driven over a
random trace; after every step its routes, lane addresses, copy list and tables must equal the
reference's. With `prefetch`, the PREFETCH build runs a trace of plan and prefetch steps mixed
(`random_mixed_trace`), and the prefetch tables and lists are compared too. With `promote`, each
launch gets a promotion cap (`random_caps`) and the reference the same `Policy(promote=...)`.
With `host`, the HOST_SPLIT build runs plan steps with random split tables, each promoting the
host's misses behind the call or leaving them out of the bank, and landings between them
(`random_host_trace`), compared with `ReferencePlanner.step_host` and `land`.
Used by tests/test_planner.py; also runnable: `python tests/_planner_emu.py --tsan [--prefetch]
[--promote]`.
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
    MISSES,
    PREFETCH_COUNTERS,
    PROMOTIONS,
    Policy,
    ReferencePlanner,
    initial_placement,
)

EMU = Path(__file__).resolve().parent / "emu"
DYN_DECL = "extern __shared__ u32 dyn_smem[];"
ROWS_BASE, ROW_STRIDE = 0x7F0000000000, 4352
POISON32, POISON64 = 0x5A5A5A5A, 0x5A5A5A5A5A5A     # what planner_main fills outputs with


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
          source: str | None = None, prefetch: bool = False, host: bool = False) -> Path:
    """Compile the plan step (or `source`, a variant of it) for the CPU; returns the executable.
    `prefetch`: the PREFETCH build (plan and prefetch steps); `host`: the HOST_SPLIT build."""
    src = source if source is not None else (ROOT / "rawkernels" / "planner.cu").read_text()
    if DYN_DECL not in src:
        raise RuntimeError(f"planner.cu no longer declares `{DYN_DECL}`; update {__file__}")
    (workdir / "planner.cu").write_text(src.replace(DYN_DECL, "u32* dyn_smem = emu_dyn_smem;"))
    shutil.copy(EMU / "common.cuh", workdir / "common.cuh")
    exe = workdir / ("planner_tsan" if tsan else "planner_emu")
    cmd = [shutil.which("g++") or "g++", "-std=c++20", "-O1" if tsan else "-O2", "-g",
           "-Wall", "-Wno-unknown-pragmas", f"-DTHREADS={threads}", f"-DITEMS={items}",
           f"-DPREFETCH={int(prefetch)}", f"-DHOST_SPLIT={int(host)}", f"-I{workdir}", f"-I{EMU}",
           str(EMU / "planner_main.cpp"), "-o", str(exe), "-pthread"]
    if tsan:                      # OS threads: ThreadSanitizer sees what fibers would hide
        cmd[1:1] = ["-fsanitize=thread", "-DEMU_THREADS=1"]
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


def random_mixed_trace(rng, L, E, steps, max_lanes, p_flip=(0.1, 0.01), p_prefetch=0.5):
    """[(gate, layer, kind, ids int64)]: `random_trace`'s plan steps (kind 0), each followed with
    probability `p_prefetch` by a prefetch step (kind 1), of the next layer mostly, else of any
    layer (the same one too, so that predicted rows can be rows of the tick before), and now and
    then a second prefetch right after the first. A prefetch names the layer's ids of its last
    plan step, each kept with probability 0.7 (right) or replaced by a random id (wrong; −1
    padding and the odd invalid id too), or at times an entirely random wide prediction (which
    can run out of eligible rows)."""
    last = [np.zeros(0, np.int64) for _ in range(L)]
    out = []
    for gate, layer, ids in random_trace(rng, L, E, steps, max_lanes, p_flip):
        out.append((gate, layer, 0, ids))
        last[layer] = ids
        n = int(rng.random() < p_prefetch) + int(rng.random() < 0.1 * p_prefetch)
        for _ in range(n):
            nxt = (layer + 1) % L if rng.random() < 0.7 else int(rng.integers(L))
            if rng.random() < 0.8:
                pred = last[nxt].copy()
                wrong = rng.random(pred.size) >= 0.7
                pred[wrong] = rng.integers(-1, E, size=int(wrong.sum()))
            else:
                pred = rng.integers(-1, E, size=int(rng.integers(0, max_lanes + 1)))
            bad = rng.random(pred.size) < 0.005
            pred[bad] = rng.choice([E, -2, 2**40], size=int(bad.sum()))
            out.append((gate, nxt, 1, pred.astype(np.int64)))
    return out[:steps]


def random_host_trace(rng, L, E, steps, max_lanes, p_flip=(0.1, 0.01), p_land=0.2):
    """[(gate, layer, kind, ids int64, split, leave)]: `random_trace`'s plan steps (kind 0), each
    with a split table (zeros a fifth of the time; else split[m] drawn from [0, m], often all of
    m) and `leave` (the host's misses left out of the bank) two times in five, mixed with steps
    that promote them behind; and landings (kind 2, no ids) after a step with probability
    `p_land`, so rows stay pending over several steps (and are hit, and sit in the window when
    others are taken, by steps of either kind)."""
    out = []
    for gate, layer, ids in random_trace(rng, L, E, steps, max_lanes, p_flip):
        W = ids.size
        u = rng.random()
        m = np.arange(W + 1)
        split = np.zeros(W + 1, np.int64) if u < 0.2 else m.copy() if u < 0.4 else \
            np.array([int(rng.integers(0, k + 1)) for k in m], np.int64)
        out.append((gate, layer, 0, ids, split, bool(rng.random() < 0.4)))
        if rng.random() < p_land:
            out.append((gate, 0, 2, np.zeros(0, np.int64), None, False))
    return out[:steps]


def random_caps(rng, steps: int, max_lanes: int) -> list[int]:
    """A promotion cap for each launch: 0 (none) a quarter of the time, else mostly small caps
    (1 … 4, which bind whenever a step misses more) and now and then one up to `max_lanes`
    (which binds only on wide steps)."""
    small = rng.integers(1, 5, size=steps)
    wide = rng.integers(1, max_lanes + 1, size=steps)
    u = rng.random(steps)
    return np.where(u < 0.25, 0, np.where(u < 0.75, small, wide)).tolist()


def same(got, want, err_msg="") -> None:
    """np.testing.assert_array_equal, with a fast path for the equal case (runs every step)."""
    if not np.array_equal(got, want):
        np.testing.assert_array_equal(got, want, err_msg=err_msg)


def fresh_lanes(routes, copies) -> np.ndarray:
    """int [W]: 1 where the lane's row is one the step's copy list fills (the reference's view of
    the kernel's lane_fresh)."""
    filled = [r for _, r in copies]
    return np.isin(routes, filled).astype(np.int64) if filled else np.zeros(routes.size, np.int64)


def run(L, E, N, S, max_lanes, threads, items, steps, seed, tsan=False, initial=None,
        timeout=900, source=None, p_flip=(0.1, 0.01), ring=None, prefetch=False,
        promote: int | str = 0, report: dict | None = None, host: bool = False) -> int:
    """Build, run the trace, compare every step; returns the number of steps compared.
    `ring`: the LRU ring's capacity (default `ring_capacity(R)`; a small one compacts often).
    `prefetch`: the PREFETCH build over `random_mixed_trace` (plan and prefetch steps).
    `promote`: the promotion cap every launch gets (0: none), or "random": a cap drawn for each
    launch (`random_caps`; prefetch launches get one too, as their max_rows).
    `host`: the HOST_SPLIT build over `random_host_trace` (plan steps with split tables, and
    landings).
    `report`: receives the reference's final counters and prefetch counters, how many
    prefetch steps ran with the gate open and how many predicted ids they skipped, and how many
    open plan steps the cap bound (staged misses while rows were left to take)."""
    rng = np.random.default_rng(seed)
    ref = ReferencePlanner(L, E, N, S, initial)
    R = ref.num_rows
    if prefetch and host:
        raise ValueError("the PREFETCH and HOST_SPLIT builds are separate")
    if host:
        htrace = random_host_trace(rng, L, E, steps, max_lanes, p_flip)
        trace = [t[:4] for t in htrace]
        splits = [t[4] for t in htrace]
        leaves = [t[5] for t in htrace]
    else:
        trace = random_mixed_trace(rng, L, E, steps, max_lanes, p_flip) if prefetch else \
            [(g, layer, 0, ids)
             for g, layer, ids in random_trace(rng, L, E, steps, max_lanes, p_flip)]
        splits = leaves = [None] * len(trace)
    # int64 ids only where they fit int32, so the i32 entry point sees the same values
    is64 = [bool(rng.random() < 0.5) or np.any(np.abs(ids) > 2**31 - 1) for *_, ids in trace]
    if promote == "random":
        caps = random_caps(rng, len(trace), max_lanes)
    elif isinstance(promote, int) and not isinstance(promote, bool) and promote >= 0:
        caps = [promote] * len(trace)
    else:
        raise ValueError(f"promote must be an int >= 0 or 'random', got {promote!r}")
    C = ring_capacity(R) if ring is None else int(ring)
    words = [R, E, L, S, max_lanes, ROWS_BASE, ROW_STRIDE, len(trace), C]
    words += initial_placement(L, E, N, initial).tolist()
    for (gate, layer, kind, ids), cap, wide, split, leave in zip(trace, caps, is64, splits,
                                                                 leaves):
        if kind == 2:
            words += [gate, layer, kind, cap]
            continue
        words += [gate, layer, kind, cap, int(wide), ids.size] + ids.tolist()
        if host:
            words += split.tolist() + [int(leave)]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        exe = build(tmp, threads, items, tsan, source, prefetch, host)
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

    def copy_list(n):
        """The n (key, row) pairs the harness wrote (it writes min(n, max_lanes), 0 if n < 0)."""
        return [tuple(c) for c in take(2 * max(0, min(n, max_lanes))).reshape(-1, 2).tolist()]

    open_prefetches = skipped = capped = behind_total = landings = starved = pending_hits = 0
    left_total = 0
    for i, (gate, layer, kind, ids) in enumerate(trace):
        if gate:
            ref.open()
        else:
            ref.close()
        if kind == 2:
            ref.land()
            landings += 1
            continue
        ref.policy = Policy(promote=caps[i])
        W = ids.size
        where = (f"step {i} ({'prefetch' if kind else 'plan'}, layer {layer}, W={W}, gate {gate}, "
                 f"cap {caps[i]}, ids {ids.tolist()})")
        got_routes, got_addr, got_fresh = take(W), take(W), take(W)
        n = int(take(1)[0])
        got_copies = copy_list(n)
        if kind == 0:
            before = ref.counters[layer, [MISSES, PROMOTIONS]].copy()
            if host:
                was_pending = ref.pending.copy()
                held = [int(ref.slot_of[layer * E + e]) for e in set(ids.tolist()) if 0 <= e < E]
                pending_hits += sum(r >= 0 and was_pending[r] for r in held)
                counted = ref.host_counters[layer]
                hs = ref.step_host(layer, ids, splits[i], leave=leaves[i])
                routes, copies = hs.routes, hs.copies
                if leaves[i]:
                    left_total += int(ref.host_counters[layer] - counted)
            else:
                routes, copies = ref.step(layer, ids)
            misses, promoted = ref.counters[layer, [MISSES, PROMOTIONS]] - before
            if gate and caps[i] and misses > promoted and promoted == caps[i]:
                hits = int((ref.last_use == ref.clock).sum()) - promoted
                capped += R - hits > promoted         # rows were left: the cap staged the rest
            if host and gate and misses > promoted and (not caps[i] or promoted < caps[i]) \
                    and was_pending.any():
                starved += 1                          # pending rows left misses without a victim
            same(got_routes, routes, err_msg=f"routes, {where}")
            want_addr = np.where(routes >= 0, ROWS_BASE + routes.astype(np.int64) * ROW_STRIDE, 0)
            same(got_addr, want_addr, err_msg=f"lane_addr, {where}")
            same(got_fresh, fresh_lanes(routes, copies),
                                          err_msg=f"lane_fresh, {where}")
            assert n == len(copies) and got_copies == copies, \
                f"copies {n} {got_copies}, expected {copies}, {where}"
        else:                                   # a prefetch leaves the plan step's outputs alone
            pf_copies = ref.prefetch(layer, ids, caps[i])
            if gate:
                open_prefetches += 1
                misses = {int(e) for e in ids if 0 <= e < E and ref.slot_of[layer * E + e] < 0}
                skipped += len(misses)      # predicted ids left without a row
            assert (got_routes == POISON32).all() and (got_addr == POISON64).all() \
                and (got_fresh == POISON32).all(), f"a prefetch wrote routes, {where}"
            assert n == POISON32, f"a prefetch wrote the plan step's n_copies ({n}), {where}"
        st = ref.state()
        for name, size in (("slot_of", L * E), ("key_of", R), ("last_use", R)):
            same(take(size), st[name], err_msg=f"{name}, {where}")
        head, span = take(2)
        assert 0 <= head < C and R <= span <= C, f"ring head {head} span {span} (C={C}), {where}"
        order = take(int(take(1)[0]))
        same(order, st["order"], err_msg=f"ring order (-2: pos_of "
                                      f"disagrees), {where}")
        assert int(take(1)[0]) == st["clock"], f"clock, {where}"
        assert int(take(1)[0]) == st["error"], f"error, {where}"
        same(take(L * len(COUNTERS)).reshape(L, -1), st["counters"],
                                      err_msg=f"counters, {where}")
        if prefetch:
            pn = int(take(1)[0])
            got_pf = copy_list(pn)
            if kind == 1:
                assert pn == len(pf_copies) and got_pf == pf_copies, \
                    f"prefetch copies {pn} {got_pf}, expected {pf_copies}, {where}"
            else:
                assert pn == POISON32, f"a plan step wrote the prefetch's n_copies, {where}"
            touched = int(take(1)[0])
            want = int((st["last_use"] == st["clock"]).sum()) if st["clock"] else 0
            assert touched == want, f"touched {touched}, rows of the last tick {want}, {where}"
            pst = ref.prefetch_state()
            same(take(R), pst["prefetched"], err_msg=f"pf_flag, {where}")
            same(take(L * len(PREFETCH_COUNTERS)).reshape(L, -1),
                                          pst["prefetch_counters"],
                                          err_msg=f"prefetch counters, {where}")
        if host:
            hn = int(take(1)[0])
            got_behind = copy_list(hn)
            assert hn == len(hs.behind) and got_behind == hs.behind, \
                f"behind {hn} {got_behind}, expected {hs.behind}, {where}"
            behind_total += hn
            same(take(W), hs.host_keys, err_msg=f"host_keys, {where}")
            same(take(R), ref.pending.astype(np.int64), err_msg=f"pending, {where}")
            same(take(L), ref.host_counters, err_msg=f"host counters, {where}")
    assert p == out.size, "trailing output"
    if report is not None:
        report.update(counters=ref.counters.copy(), prefetch_counters=ref.prefetch_counters.copy(),
                      open_prefetches=open_prefetches, skipped=skipped, capped=capped,
                      behind=behind_total, landings=landings, starved=starved,
                      pending_hits=pending_hits, left=left_total,
                      host_counters=ref.host_counters.copy())
    return len(trace)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tsan", action="store_true")
    ap.add_argument("--prefetch", action="store_true", help="the PREFETCH build, plan and "
                    "prefetch steps mixed")
    ap.add_argument("--promote", action="store_true", help="a random promotion cap a launch")
    ap.add_argument("--host", action="store_true", help="the HOST_SPLIT build: plan steps with "
                    "split tables, and landings")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shape", nargs=7, type=int, metavar=("L", "E", "N", "S", "LANES", "THREADS",
                                                           "ITEMS"), default=[5, 13, 3, 64, 64, 64, 1])
    a = ap.parse_args(argv)
    L, E, N, S, lanes, threads, items = a.shape
    n = run(L, E, N, S, lanes, threads, items, a.steps, a.seed, tsan=a.tsan, prefetch=a.prefetch,
            promote="random" if a.promote else 0, host=a.host)
    print(f"{n} steps{' (plan and prefetch)' if a.prefetch else ''}"
          f"{' with promotion caps' if a.promote else ''}: emulated kernel == "
          f"reference{' (ThreadSanitizer clean)' if a.tsan else ''}")


if __name__ == "__main__":
    main()
