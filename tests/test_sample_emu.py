"""rawkernels/sample.cu run on the CPU against `cupool.sampling.sample`'s definition.

The kernel's own source is compiled with g++ against tests/emu (every block of a grid run one
after another; `sample_main.cpp` drives the three launches), so the histogram, the last block's
scan (top-k and top-p cuts, inside groups of equal logits too), the group ranks and the draw are
checked without a GPU: each row's kept prefix against float64's (sampling_cases.kept_range) and
its token against the Gumbel-max draw over that prefix. Two calls a case, the step advanced
between them, so the second also checks that the first left the workspace as it found it. What
concurrent blocks do to each other is the GPU tests' part (test_gpu_sampling.py).
"""

from __future__ import annotations

import _emu_build as emu_build
import numpy as np
import pytest
import sampling_cases as cases
import torch

from cupool.ops import sampler

BUILDS = {
    "bf16": {"THREADS": sampler.THREADS, "ITEMS": sampler.ITEMS, "IN_F16": 0},   # the launcher's
    "f16_odd": {"THREADS": 64, "ITEMS": 3, "IN_F16": 1},
}


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    emu_build.require()
    work = tmp_path_factory.mktemp("sample_emu")
    emu_build.stage(work, "sample", headers=("block_scan.cuh",))
    return emu_build.compile_all(work, "sample_main.cpp", BUILDS)


def run_kernel(exe, r: cases.Rows, calls: int = 2):
    B, V = r.logits.shape
    head = [B, V, calls]
    for b in range(B):
        head += [emu_build.f32_bits(float(r.temperature[b])), int(r.top_k[b]),
                 emu_build.f32_bits(float(r.top_p[b])), int(r.seeds[b]), int(r.steps[b])]
    got = emu_build.run(exe, [np.array(head, dtype=np.int64), emu_build.bf16_words(r.logits)])
    tokens = got[:calls * B].reshape(calls, B)
    rest = got[calls * B:]
    hist_sum, best, tickets = int(rest[0]), rest[1:1 + B], rest[1 + B:1 + 3 * B]
    cut = rest[1 + 3 * B:].reshape(B, sampler.CUT_WORDS)
    return tokens, hist_sum, best, tickets, cut


def check(r: cases.Rows, tokens, cut, call: int) -> list[str]:
    """Problems of each row of the call's tokens; the cut is checked for the last call."""
    bad = []
    for b in range(r.logits.shape[0]):
        args = (r.logits[b], float(r.temperature[b]), int(r.top_k[b]), float(r.top_p[b]),
                int(r.seeds[b]), int(r.steps[b]) + call)
        if call == tokens.shape[0] - 1:
            why = cases.check_row(*args, int(tokens[call, b]), int(cut[b, 0]), int(cut[b, 1]))
        else:
            row, temperature, _, _, seed, step = args
            allowed = {cases.draw(row, temperature, seed, step, n)
                       for n in cases.kept_range(*args[:4])}
            why = None if int(tokens[call, b]) in allowed else \
                f"drew {int(tokens[call, b])}, want one of {sorted(allowed)}"
        if why:
            bad.append(f"row {b} call {call}: {why}")
    return bad


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("B,V,ties,masked", [
    (9, 1, False, False), (9, 37, True, False), (9, 2053, False, True), (12, 5000, True, False),
    (3, 4099, True, True),
])
def test_sample_kernel_source_matches_reference_on_cpu(builds, build, B, V, ties, masked):
    dtype = torch.float16 if BUILDS[build]["IN_F16"] else torch.bfloat16
    r = cases.rows(B, V, seed=V + B, dtype=dtype, ties=ties, masked=masked)
    tokens, hist_sum, best, tickets, cut = run_kernel(builds[build], r)
    assert hist_sum == 0 and not best.any() and not tickets.any(), \
        f"workspace left dirty: histogram sum {hist_sum}, best {best}, tickets {tickets}"
    bad = check(r, tokens, cut, 0) + check(r, tokens, cut, 1)
    assert not bad, "\n".join(bad)


def test_sample_kernel_source_at_qwens_vocabulary(builds):
    """151,936 ids (Qwen3's vocabulary, 75 blocks a row), tie-heavy and plain rows."""
    r = cases.rows(2, 151936, seed=3, ties=True)
    r.temperature[:] = 0.8
    r.top_p[:] = 0.95
    tokens, hist_sum, best, tickets, cut = run_kernel(builds["bf16"], r, calls=1)
    assert hist_sum == 0
    bad = check(r, tokens, cut, 0)
    assert not bad, "\n".join(bad)


def test_sample_emulation_sees_a_wrong_cut(builds):
    """The check can fail: the same tokens judged against another top_p are wrong."""
    r = cases.rows(6, 3001, seed=5, ties=True)
    r.temperature[:] = 1.0
    r.top_k[:] = 0
    r.top_p[:] = 0.5
    tokens, _, _, _, cut = run_kernel(builds["bf16"], r, calls=1)
    assert not check(r, tokens, cut, 0)
    r.top_p[:] = 0.9
    assert len(check(r, tokens, cut, 0)) == 6


def test_emulated_block_is_the_launchers():
    assert BUILDS["bf16"]["THREADS"] == 256 and BUILDS["bf16"]["ITEMS"] == 8
