"""A short run of the one-launch decode GEMM (moe_decode.cu) for compute-sanitizer (a script;
pytest does not collect it).

Decode calls at padded and Qwen3-30B-A3B dimensions, with weights in bank, staging and host rows,
one pass and split in two launches (rows in place, then fresh ones), each compared with the
float reference; the counters must be back at zero after every call. Exits non-zero on
any mismatch.

    compute-sanitizer --tool memcheck  python tests/gpu_decode_sanitize.py
    compute-sanitizer --tool racecheck python tests/gpu_decode_sanitize.py
    compute-sanitizer --tool synccheck python tests/gpu_decode_sanitize.py
"""

from __future__ import annotations

import sys

import torch
from test_gpu_gemm import TOL, Placed, rel_err, routing

from cupool.gemm import MoEGemm
from cupool.reference.moe import reference_moe


def at_rest(gemm: MoEGemm) -> bool:
    d = gemm._d
    return all(int(d[k].abs().sum()) == 0 for k in ("sync", "group_done"))


def main() -> int:
    failures = []
    for name, (H, I, E), cases in (("small", (80, 48, 5), [(1, 1), (3, 2), (9, 4)]),
                                   ("qwen", (2048, 768, 13), [(1, 8), (4, 8)])):
        placed = Placed(H, I, E, seed=7)
        for T, K in cases:
            gen = torch.Generator().manual_seed(T * 10 + K)
            gemm = MoEGemm(placed.layout, K, torch.bfloat16, max_decode_tokens=16,
                           decode_kernel="fused")
            x = torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda()
            ids, w = routing(T, K, E, gen)
            la = placed.lane_addr(ids)
            ref = reference_moe(x, ids, w, placed.deq)
            fresh = torch.randint(0, 2, (E,), generator=gen).to(torch.int32).cuda()
            fresh = fresh[ids.clamp(min=0)].reshape(-1).contiguous()
            for split in (False, True):
                out = torch.full_like(x, float("nan"))
                gemm.decode(x, la, w, out=out, lane_fresh=fresh if split else None)
                torch.cuda.synchronize()
                err = rel_err(out, ref)
                ok = err <= TOL and at_rest(gemm) and gemm.read_error() == []
                print(f"{name} T={T} K={K} split={split}: rel err {err:.2e}"
                      f"{'' if ok else '  FAILED'}", flush=True)
                if not ok:
                    failures.append((name, T, K, split))
        placed.store.close()
    print("decode sanitize run:", "ok" if not failures else f"{len(failures)} failed {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
