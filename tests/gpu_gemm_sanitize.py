"""A short run of moe_gemm.cu's kernels (the prefill partition path, and the w13/w2 pair of
decode calls over 256 lanes or with decode_kernel="pair") for compute-sanitizer (a script;
pytest does not collect it).

Calls at padded, Qwen3-30B-A3B and H=4096/I=1536 dimensions with weights in bank, staging and
host rows, each compared with the float reference: prefill at several T (multi-stage
double-buffered staging, w2's staged act rows reused across a unit's items, or streamed at
I=1536), and pair decode calls one pass and split in two launches. Exits non-zero on any
mismatch or error flag.

    compute-sanitizer --tool memcheck  python tests/gpu_gemm_sanitize.py
    compute-sanitizer --tool racecheck python tests/gpu_gemm_sanitize.py
    compute-sanitizer --tool synccheck python tests/gpu_gemm_sanitize.py
"""

from __future__ import annotations

import sys

import torch
from test_gpu_gemm import TOL, Placed, rel_err, routing

from cupool.gemm import MoEGemm
from cupool.reference.moe import reference_moe


def main() -> int:
    failures = []

    def check(label, err, gemm):
        ok = err <= TOL and gemm.read_error() == []
        print(f"{label}: rel err {err:.2e}{'' if ok else '  FAILED'}", flush=True)
        if not ok:
            failures.append(label)

    for name, (H, I, E), prefill, decode in (
            ("small", (80, 48, 5), [(37, 2), (9, 4)], [(40, 8)]),
            ("qwen", (2048, 768, 13), [(70, 8), (3, 2)], [(40, 8), (5, 8)]),
            ("big", (4096, 1536, 4), [(21, 2)], [(9, 4)])):
        placed = Placed(H, I, E, seed=11)
        for T, K in prefill:
            gen = torch.Generator().manual_seed(T * 10 + K)
            gemm = MoEGemm(placed.layout, K, torch.bfloat16, max_prefill_tokens=T, num_experts=E,
                           scratch_rows=2)
            x = torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda()
            ids, w = routing(T, K, E, gen)
            check(f"{name} prefill T={T} K={K}", placed.prefill_error(gemm, x, ids, w), gemm)
        for T, K in decode:
            gen = torch.Generator().manual_seed(T * 10 + K + 1)
            gemm = MoEGemm(placed.layout, K, torch.bfloat16, max_decode_tokens=T,
                           decode_kernel="pair")
            x = torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda()
            ids, w = routing(T, K, E, gen)
            ref = reference_moe(x, ids, w, placed.deq)
            fresh = torch.randint(0, 2, (E,), generator=gen).to(torch.int32).cuda()
            fresh = fresh[ids.clamp(min=0)].reshape(-1).contiguous()
            for split in (False, True):
                out = torch.full_like(x, float("nan"))
                gemm.decode(x, placed.lane_addr(ids), w, out=out,
                            lane_fresh=fresh if split else None)
                torch.cuda.synchronize()
                check(f"{name} pair decode T={T} K={K} split={split}", rel_err(out, ref), gemm)
        placed.store.close()
    print("gemm sanitize run:", "ok" if not failures else f"{len(failures)} failed {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
