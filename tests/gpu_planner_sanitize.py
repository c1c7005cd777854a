"""A short planner run for compute-sanitizer (a script; pytest does not collect it).

Random plan + copy steps compared with the reference after each one, a captured graph of several
layer calls replayed with new ids (gate opened after capture), verify(), a few steps of the
benchmark's shape (its default block), and plan and prefetch steps mixed through the PREFETCH
build. Exits non-zero on any mismatch.

    compute-sanitizer --tool memcheck  python tests/gpu_planner_sanitize.py
    compute-sanitizer --tool racecheck python tests/gpu_planner_sanitize.py --steps 100 --big-steps 4
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from test_gpu_planner import Harness, MixedRun, run_random


def graph_replays(rng, h: Harness, replays: int) -> None:
    calls = [(0, 8), (2, 64), (4, 1), (1, 33)]
    ids_buf = torch.full((len(calls), h.lanes), -1, dtype=torch.int64, device="cuda")
    h.set_gate(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                     # warm-up: gate closed, all padding: no change
        for c, (layer, W) in enumerate(calls):
            h.bank.step(layer, ids_buf[c, :W])
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c, (layer, W) in enumerate(calls):
            h.bank.step(layer, ids_buf[c, :W])
    h.set_gate(1, verify=True)
    for rep in range(replays):
        ids = np.full((len(calls), h.lanes), -1, dtype=np.int64)
        for c, (_, W) in enumerate(calls):
            ids[c, :W] = rng.integers(-1, h.E, size=W)
        ids_buf.copy_(torch.from_numpy(ids))
        graph.replay()
        for c, (layer, W) in enumerate(calls):
            routes, _ = h.ref.step(layer, ids[c, :W])
        torch.cuda.synchronize()
        got, want = h.bank.state(), h.ref.state()
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{name}, replay {rep}")
        np.testing.assert_array_equal(h.bank.routes[:calls[-1][1]].cpu().numpy(), routes)
    h.bank.verify()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--replays", type=int, default=5)
    ap.add_argument("--big-steps", type=int, default=10, help="steps of the L=48, N=256 shape")
    ap.add_argument("--prefetch-steps", type=int, default=200,
                    help="plan and prefetch steps through the PREFETCH build")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    rng = np.random.default_rng(a.seed)
    h = Harness(rng, L=5, E=17, N=3, S=64, lanes=64, row_bytes=4096 + 48)
    run_random(rng, h, a.steps, verify_every=100)
    graph_replays(rng, h, a.replays)
    h.close()
    print(f"small bank: {a.steps} steps and {a.replays} graph replays == reference")
    if a.big_steps:
        big = Harness(rng, L=48, E=512, N=256, S=64, lanes=64, row_bytes=256)
        run_random(rng, big, a.big_steps, verify_every=0, p_flip=(0.7, 0.1))
        big.bank.verify()
        big.close()
        print(f"L=48 N=256 bank: {a.big_steps} steps == reference")
    if a.prefetch_steps:
        m = MixedRun(rng, L=5, E=17, N=3, S=64, lanes=64, row_bytes=1024 + 48)
        m.run(a.prefetch_steps, batch=50)
        m.close()
        print(f"PREFETCH build: {a.prefetch_steps} plan and prefetch steps == reference")
    print("OK")


if __name__ == "__main__":
    main()
