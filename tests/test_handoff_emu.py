"""rawkernels/host_handoff.cu's host_post and host_wait run on the CPU (tests/emu, every block of
a grid one after another; `handoff_main.cpp` drives them) over a mailbox in ordinary memory:
x, keys and weights land in the mailbox as float32 / int64 whatever the grid (one block, the
launcher's `blocks_for`, and fewer blocks than values so each thread makes several passes), the
last block to finish bumps the number and puts the block count back to 0, the answer is added
into y rounded once to y's dtype, and a post with no routed lane touches nothing. The memory
order across PCIe (fences, the acquire and release of the sequence words) is the GPU test's part
(test_gpu_host_handoff.py)."""

from __future__ import annotations

import _emu_build as emu_build
import numpy as np
import pytest
import torch

from cupool.ops.host_handoff import DTYPES, blocks_for

BUILDS = {   # (x, weights, y) dtypes
    "bf16_f32_bf16": (torch.bfloat16, torch.float32, torch.bfloat16),
    "f32_f16_f32": (torch.float32, torch.float16, torch.float32),
    "f16_bf16_f16": (torch.float16, torch.bfloat16, torch.float16),
}
POISON = 0x7FBADBAD
# the inline PTX of host_handoff.cu, as the C++ atomics the emulation runs
PTX = {
    'asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");':
        "v = __atomic_load_n(p, __ATOMIC_ACQUIRE);",
    'asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");':
        "__atomic_store_n(p, v, __ATOMIC_RELEASE);",
}


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    emu_build.require()
    work = tmp_path_factory.mktemp("handoff_emu")
    emu_build.stage(work, "host_handoff", replace=PTX)
    return emu_build.compile_all(work, "handoff_main.cpp", {
        name: {"X_DTYPE": DTYPES[x], "W_DTYPE": DTYPES[w], "Y_DTYPE": DTYPES[y]}
        for name, (x, w, y) in BUILDS.items()})


def _bits(t: torch.Tensor) -> np.ndarray:
    """Each element's bits as an int64 word (16 or 32 bits)."""
    view = {2: torch.int16, 4: torch.int32}[t.element_size()]
    mask = (1 << (8 * t.element_size())) - 1
    return t.contiguous().view(view).numpy().astype(np.int64).reshape(-1) & mask


def _from_bits(words: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.float32:
        return torch.from_numpy(words.astype(np.uint32).view(np.float32).copy())
    return torch.from_numpy(words.astype(np.uint16).view(np.int16).copy()).view(dtype)


def _run(exe, x, keys, w, y, out, blocks, counter=(4, 1, 0), seq=4):
    n, lanes = x.numel(), keys.numel()
    words = emu_build.run(exe, [[n, lanes, blocks], _bits(x), keys.reshape(-1).numpy(), _bits(w),
                                list(counter), [seq, 1, 0], _bits(y), _bits(out)])
    at = np.cumsum([0, n, lanes, lanes, 3, 2, n, 1])
    parts = [words[a:b] for a, b in zip(at[:-1], at[1:])]
    assert len(words) == at[-1]
    mx, mkeys, mw, counters, seq_size, y_out, error = parts
    return (mx.astype(np.uint32).view(np.float32), mkeys, mw.astype(np.uint32).view(np.float32),
            counters.tolist(), int(seq_size[0]), _from_bits(y_out, y.dtype), int(error[0]),
            int(seq_size[1]))                       # the last: the mailbox's size word


@pytest.mark.parametrize("name", list(BUILDS))
@pytest.mark.parametrize("n,lanes,blocks", [
    (160, 6, None),          # one block
    (5003, 24, None),        # blocks_for: 5 blocks, a tail of 3 values past the last float4
    (5003, 24, 2),           # 2 blocks of 256 threads: several passes a thread
    (16384, 64, None)])      # Qwen3-30B-A3B at 8 tokens: 16 blocks
def test_post_and_wait_over_a_grid(builds, name, n, lanes, blocks):
    x_dtype, w_dtype, y_dtype = BUILDS[name]
    gen = torch.Generator().manual_seed(n + lanes + (blocks or 0))
    x = torch.randn(n, generator=gen).to(x_dtype)
    keys = torch.randint(-1, 1000, (lanes,), generator=gen)
    keys[lanes // 2] = 17                                      # at least one routed lane
    w = torch.rand(lanes, generator=gen).to(w_dtype)
    y = torch.randn(n, generator=gen).to(y_dtype)
    out = torch.randn(n, generator=gen)
    grid = blocks or blocks_for(n)
    assert (n, grid) != (16384, 16) or blocks_for(n) == 16
    mx, mkeys, mw, counters, seq, y_out, error, size = _run(builds[name], x, keys, w, y, out,
                                                            grid)
    assert np.array_equal(mx, x.float().numpy())
    assert mkeys.tolist() == keys.tolist()
    assert np.array_equal(mw, w.float().numpy())
    assert counters == [5, 1, 0] and seq == 5 and error == 0
    assert size == lanes                                       # the request's size word
    assert torch.equal(y_out, y.clone().add_(out))             # float32 sum, rounded once


@pytest.mark.parametrize("blocks", [1, 4])
def test_a_post_with_no_routed_lane_touches_nothing(builds, blocks):
    """Every key -1: the mailbox keeps its poison, the number and seq stay, counter[1] = 0, and
    the wait adds nothing (without waiting: the host was never asked)."""
    n, lanes = 4100, 16
    gen = torch.Generator().manual_seed(blocks)
    x = torch.randn(n, generator=gen).to(torch.bfloat16)
    keys = torch.full((lanes,), -1)
    w = torch.rand(lanes, generator=gen)
    y = torch.randn(n, generator=gen).to(torch.bfloat16)
    out = torch.randn(n, generator=gen)
    mx, mkeys, mw, counters, seq, y_out, error, size = _run(builds["bf16_f32_bf16"], x, keys, w,
                                                            y, out, blocks)
    assert (mx.view(np.uint32) == POISON).all() and (mw.view(np.uint32) == POISON).all()
    assert (mkeys == -7).all() and size == POISON
    assert counters == [4, 0, 0] and seq == 4 and error == 0
    assert torch.equal(y_out, y)


def test_post_and_wait_under_thread_sanitizer(tmp_path):
    """The same source with a block's threads as OS threads under ThreadSanitizer (EMU_THREADS):
    no access to shared or mailbox memory that two threads of a block make without a barrier
    between them (the vote, the skip word, the last block's words); its exit code says so."""
    import shutil
    import subprocess

    emu_build.require()
    gxx = shutil.which("g++") or "g++"
    probe = subprocess.run([gxx, "-fsanitize=thread", "-x", "c++", "-", "-o",
                            str(tmp_path / "probe")], input="int main(){}", capture_output=True,
                           text=True)
    if probe.returncode:
        pytest.skip(f"{gxx} cannot build with -fsanitize=thread: {probe.stderr.strip()[:200]}")
    emu_build.stage(tmp_path, "host_handoff", replace=PTX)
    exe = tmp_path / "handoff_tsan"
    cmd = emu_build.command(tmp_path, "handoff_main.cpp",
                            {"X_DTYPE": 1, "W_DTYPE": 0, "Y_DTYPE": 1, "EMU_THREADS": 1}, exe,
                            opt="-O1")
    cmd[1:1] = ["-fsanitize=thread", "-g"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    gen = torch.Generator().manual_seed(3)
    n, lanes = 3003, 16
    x = torch.randn(n, generator=gen).to(torch.bfloat16)
    w = torch.rand(lanes, generator=gen)
    y = torch.randn(n, generator=gen).to(torch.bfloat16)
    out = torch.randn(n, generator=gen)
    for keys in (torch.arange(lanes) - 1, torch.full((lanes,), -1)):
        mx, _, _, counters, _, y_out, error, _ = _run(exe, x, keys, w, y, out, blocks_for(n))
        routed = bool((keys >= 0).any())
        assert counters == ([5, 1, 0] if routed else [4, 0, 0]) and error == 0
        assert torch.equal(y_out, y.clone().add_(out) if routed else y)
