"""HostExperts (rawkernels/host_experts.c on the CPU) against its reference.

Rows are real NVFP4 experts packed in the kernel layout (`random_experts`) in a pageable host
store; each call's output is poisoned (NaN) first and compared with `reference_moe_q8` (x and the
act quantized to int8 blocks as the C does, then float64 on the exactly dequantized weights), and
with the float reference `reference_moe` within what the int8 rounding costs. Every build runs:
"native" (AVX-512 or AVX2 + FMA, as this CPU has them), "avx2" (AVX2 at most), "portable" (no
SIMD) and "avx512-emulated" (the AVX-512 loop over plain C intrinsics, so its indexing is checked
on any CPU); all must give the same bits.
"""

from __future__ import annotations

import ctypes
import shutil

import numpy as np
import pytest
import torch

from cupool.activation import RELU2, SILU, swiglu_clamp
from cupool.hostexperts import HostExperts, find_compiler
from cupool.layout import RowLayout
from cupool.reference.moe import quantize_q8, reference_moe, reference_moe_q8
from cupool.store import HostStore
from cupool.synthetic import dequantize_exact, random_biases, random_experts

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler to build rawkernels/host_experts.c")

# Against reference_moe_q8 only the float32 sums across 16-column blocks differ (each block's dot
# product is exact in both): measured 1-2e-7; 1e-5 leaves room (an act value whose rounding to int8
# the two orders tip differently moves the output by about one int8 step of that block) and still
# fails on any slot, sign or scale read wrong (those give errors of order 1).
TOL = 1e-5
# Against the float reference the int8 rounding of x and of the act shows, each about 7e-3 on
# Gaussian inputs (measured 6.7e-3 to 9.8e-3 together, where the GPU's bf16 rounding gives 2.9e-3).
TOL_FLOAT = 2e-2
SWIGLU = swiglu_clamp(1.702, 7.0)
ISAS = ("native", "avx2", "portable", "avx512-emulated")


def rel_err(out, ref):
    return float((out.double() - ref.double()).norm() / ref.double().norm())


class Rows:
    """E experts of a layout in a pageable store over L layers (the same E rows in each layer,
    so keys l·E + e of different l hold equal rows at different addresses)."""

    def __init__(self, H, I, E, seed, *, layers=1, bias=False, gated=True):
        self.layout = RowLayout(H, I, bias=bias, gated=gated)
        gen = torch.Generator().manual_seed(seed)
        b = random_biases(self.layout, E, gen) if bias else None
        rows, mats = random_experts(self.layout, E, gen, biases=b)
        self.E = E
        self.deq = [tuple(None if m is None else dequantize_exact(m) for m in trio)
                    for trio in mats]
        self.biases = None if b is None else [tuple(t[e] for t in b) for e in range(E)]
        self.store = HostStore(layers, E, self.layout.row_bytes, pinned=False)
        self.store.fill(lambda _l: rows, progress=False)
        self.store.seal()

    def reference(self, x, keys, w, activation):
        """reference_moe_q8: what the C computes, in float64."""
        ids = torch.where(keys >= 0, keys % self.E, keys)
        return reference_moe_q8(x, ids, w, self.deq, activation=activation, biases=self.biases)

    def float_reference(self, x, keys, w, activation):
        ids = torch.where(keys >= 0, keys % self.E, keys)
        return reference_moe(x, ids, w, self.deq, torch.float64, activation=activation,
                             biases=self.biases)


@pytest.fixture(scope="module")
def small():
    return Rows(80, 48, 5, seed=3, layers=2)


def _routing(T, K, keys_max, gen, distinct=True):
    if distinct:
        keys = torch.stack([torch.randperm(keys_max, generator=gen)[:K] for _ in range(T)])
    else:
        keys = torch.randint(0, keys_max, (T, K), generator=gen)
    w = torch.softmax(torch.randn(T, K, generator=gen), -1)
    return keys.contiguous(), w.contiguous()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("T,K,distinct", [(1, 1, True), (1, 4, True), (3, 2, True), (9, 4, False),
                                          (6, 10, False)])
def test_matches_reference_odd_sizes(small, isa, T, K, distinct):
    gen = torch.Generator().manual_seed(100 * T + K)
    keys, w = _routing(T, K, 2 * small.E, gen, distinct)
    x = torch.randn(T, 80, generator=gen)
    with HostExperts(small.store.host_addresses(), small.layout, threads=3, isa=isa) as hx:
        out = torch.full((T, 80), float("nan"))
        hx(x, keys, w, out=out)
    assert rel_err(out, small.reference(x, keys, w, SILU)) <= TOL


@pytest.fixture(scope="module")
def qwen():
    return Rows(2048, 768, 4, seed=5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("T,K", [(5, 3), (8, 4), (11, 4)])   # up to 3; 8; 11 (8 + 3) lanes a row
def test_qwen_shape(qwen, isa, T, K):
    gen = torch.Generator().manual_seed(9 + T)
    keys, w = _routing(T, K, 4, gen)
    x = torch.randn(T, 2048, generator=gen)
    with HostExperts(qwen.store.host_addresses(), qwen.layout, threads=2, isa=isa) as hx:
        out = torch.full((T, 2048), float("nan"))
        hx(x, keys, w, out=out)
    assert rel_err(out, qwen.reference(x, keys, w, SILU)) <= TOL
    assert rel_err(out, qwen.float_reference(x, keys, w, SILU)) <= TOL_FLOAT


@pytest.mark.parametrize("kind", ["swiglu_bias", "relu2"])
def test_other_experts(kind):
    """gpt-oss's clamped SwiGLU with biases; Nemotron-H's rows without a gate (ReLU²)."""
    if kind == "swiglu_bias":
        rows, act = Rows(96, 160, 4, seed=11, bias=True), SWIGLU
    else:
        rows, act = Rows(112, 80, 4, seed=12, gated=False), RELU2
    H = rows.layout.hidden
    gen = torch.Generator().manual_seed(13)
    keys, w = _routing(4, 3, 4, gen)
    x = torch.randn(4, H, generator=gen) * 3        # past the clamp's limit on some columns
    for isa in ISAS:
        with HostExperts(rows.store.host_addresses(), rows.layout, act, threads=2,
                         isa=isa) as hx:
            out = torch.full((4, H), float("nan"))
            hx(x, keys, w, out=out)
        assert rel_err(out, rows.reference(x, keys, w, act)) <= TOL, isa
        assert rel_err(out, rows.float_reference(x, keys, w, act)) <= TOL_FLOAT, isa


def test_padding_and_same_bits_for_any_thread_count(small):
    """Padding lanes (-1) add nothing, a token with none gets zeros, and 1, 2 and 5 threads give
    the same bits (an item's result does not depend on the thread that runs it)."""
    gen = torch.Generator().manual_seed(21)
    keys, w = _routing(7, 3, 2 * small.E, gen, distinct=False)
    keys[2] = -1
    keys[4, 1] = -1
    x = torch.randn(7, 80, generator=gen)
    outs = []
    for th in (1, 2, 5):
        with HostExperts(small.store.host_addresses(), small.layout, threads=th) as hx:
            outs.append(hx(x, keys, w, out=torch.full((7, 80), float("nan"))))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert torch.equal(outs[0][2], torch.zeros(80))
    assert rel_err(outs[0], small.reference(x, keys, w, SILU)) <= TOL


@pytest.mark.parametrize("T,K", [(2, 3), (7, 4)])      # 1 to 3 tokens a row; 4 and more
def test_builds_give_the_same_bits_and_name_their_loop(qwen, T, K):
    """Every build does the same integer and float operations in the same order."""
    gen = torch.Generator().manual_seed(22 + T)
    keys, w = _routing(T, K, 4, gen, distinct=T > 4)
    x = torch.randn(T, 2048, generator=gen)
    outs = {}
    for isa in ISAS:
        with HostExperts(qwen.store.host_addresses(), qwen.layout, threads=2, isa=isa) as hx:
            outs[hx.isa] = hx(x, keys, w, out=torch.full((T, 2048), float("nan")))
            assert hx.isa in {"portable": ("portable",), "avx2": ("avx2", "portable"),
                              "native": ("avx512", "avx2", "portable"),
                              "avx512-emulated": ("avx512-emulated",)}[isa]
    assert {"portable", "avx512-emulated"} <= set(outs)
    for isa, y in outs.items():
        assert torch.equal(y, outs["portable"]), isa
    with pytest.raises(ValueError, match="isa must be one of"):
        HostExperts(qwen.store.host_addresses(), qwen.layout, isa="sse")


def test_builds_agree_on_ties_and_zero_blocks(qwen):
    """x's int8 blocks where rounding is a tie: blocks whose largest |value| is 127 (so the
    scale is 1 and each value is its own code) of values k + 0.5, which round to even; and
    all-zero blocks. Every build (the AVX-512 one converts 16 values at once in the default
    rounding mode, the others call nearbyintf) gives the same bits, equal to the reference of
    the quantized x."""
    gen = torch.Generator().manual_seed(27)
    x = torch.randint(-126, 126, (2, 2048), generator=gen).float() + 0.5
    x[:, ::16] = 127.0                                   # each block's amax: scale 1
    x[:, 1::32] = -127.0
    x[1, 512:1024] = 0.0                                 # zero blocks
    keys, w = _routing(2, 3, 4, gen, distinct=True)
    outs = {}
    for isa in ISAS:
        with HostExperts(qwen.store.host_addresses(), qwen.layout, threads=2, isa=isa) as hx:
            outs[isa] = hx(x, keys, w, out=torch.full((2, 2048), float("nan")))
    for isa, y in outs.items():
        assert torch.equal(y, outs["portable"]), isa
    assert torch.equal(quantize_q8(x[:, :16])[0, 2:4].float(), torch.round(x[0, 2:4]))
    assert rel_err(outs["native"], qwen.reference(x, keys, w, SILU)) <= TOL


def test_quantize_q8():
    """The reference's int8 blocks: ties to even, zero blocks, padding columns, NaN blocks."""
    v = torch.tensor([[127.0, 0.5, 1.5, -2.5, -127.0] + [0.0] * 11 + [0.0] * 16 + [3.0, float("nan")]])
    q = quantize_q8(v)
    assert q.dtype == torch.float64 and q.shape == v.shape
    assert q[0, :5].tolist() == [127.0, 0.0, 2.0, -2.0, -127.0]      # scale 1: rint, ties to even
    assert torch.equal(q[0, 16:32], torch.zeros(16, dtype=torch.float64))
    assert torch.isnan(q[0, 32:]).all()
    x = torch.randn(3, 100)
    err = (quantize_q8(x) - x.double()).abs()
    amax = torch.nn.functional.pad(x.abs(), (0, 12)).reshape(3, -1, 16).amax(-1)
    assert (err <= amax.repeat_interleave(16, -1)[:, :100].double() / 254 * (1 + 1e-6)).all()


def test_nan_block_scale_makes_its_lanes_nan():
    """A row with an E4M3 NaN block scale (0x7F; checkpoint readers refuse one) gives NaN for the
    tokens routed to it in every build, as the float computation would, and nothing else moves."""
    layout = RowLayout(80, 48)
    rows, _ = random_experts(layout, 3, torch.Generator().manual_seed(26))
    rows = rows.numpy().copy()
    rows[1, 256 + 512 + 2 * 5] = 0x7F      # gate strip 0, chunk 0: the scale of (row 1, t = 1)
    table = rows.ctypes.data + layout.row_bytes * np.arange(3, dtype=np.int64)
    gen = torch.Generator().manual_seed(27)
    x = torch.randn(3, 80, generator=gen)
    keys = torch.tensor([[0, 2], [1, 2], [2, 0]])
    w = torch.full((3, 2), 0.5)
    outs = []
    for isa in ISAS:
        with HostExperts(table, layout, threads=2, isa=isa) as hx:
            outs.append(hx(x, keys, w, out=torch.zeros(3, 80)))
        assert torch.isnan(outs[-1][1]).all(), isa
        assert torch.isfinite(outs[-1][0]).all() and torch.isfinite(outs[-1][2]).all(), isa
        assert torch.equal(outs[-1][[0, 2]], outs[0][[0, 2]]), isa


@pytest.mark.parametrize("isa", ISAS)
def test_nan_input_stays_in_its_token(small, isa):
    """A NaN in one token's x makes that token's output NaN (its block's scale is NaN) and leaves
    the other tokens' as they were."""
    gen = torch.Generator().manual_seed(25)
    keys, w = _routing(3, 2, 2 * small.E, gen)
    x = torch.randn(3, 80, generator=gen)
    with HostExperts(small.store.host_addresses(), small.layout, threads=2, isa=isa) as hx:
        clean = hx(x, keys, w).clone()
        x[1, 37] = float("nan")
        out = hx(x, keys, w, out=torch.zeros(3, 80))
    assert torch.isnan(out[1]).all()
    assert torch.equal(out[0], clean[0]) and torch.equal(out[2], clean[2])


def test_many_calls_and_sleeping_workers(small):
    """Calls back to back, and after the workers went to sleep (spin_ms 0), give the same result."""
    gen = torch.Generator().manual_seed(23)
    keys, w = _routing(3, 2, 2 * small.E, gen)
    x = torch.randn(3, 80, generator=gen)
    with HostExperts(small.store.host_addresses(), small.layout, threads=4, spin_ms=0) as hx:
        first = hx(x, keys, w)
        for _ in range(50):
            assert torch.equal(hx(x, keys, w), first)
        ns = hx.timed(x, keys, w, 5)
    assert ns.shape == (5,) and (ns > 0).all()


def test_read_probe(small):
    with HostExperts(small.store.host_addresses(), small.layout, threads=2) as hx:
        assert hx.read(np.ones(3 << 20, dtype=np.uint8)) > 0
        with pytest.raises(ValueError, match="buf"):
            hx.read(np.ones(8, dtype=np.float32))


def test_bad_input(small):
    table = small.store.host_addresses()
    H = 80
    x = torch.randn(2, H)
    keys = torch.tensor([[0, 1], [2, 3]])
    w = torch.full((2, 2), 0.5)
    with HostExperts(table, small.layout, threads=2) as hx:
        cases = [
            (dict(x=x.double()), "x: expected a contiguous float32"),
            (dict(x=torch.randn(2, H + 1)), r"x: expected .*\[T, 80\]"),
            (dict(x=torch.randn(H, 2).t()), "not contiguous"),
            (dict(keys=keys.int()), "keys: expected a contiguous int64"),
            (dict(keys=torch.tensor([[0, 1], [2, 10]])), r"keys: 1 outside \[-1, 10\).*keys\[1, 1\] = 10"),
            (dict(keys=torch.tensor([[0, -2], [2, 3]])), r"keys\[0, 1\] = -2"),
            (dict(weights=w[:, :1].contiguous()), r"weights: expected .*\[2, 2\]"),
            (dict(weights=torch.tensor([[0.5, float("nan")], [0.5, 0.5]])),
             r"weights: 1 NaN or Inf on routed lanes, e.g. weights\[0, 1\]"),
            (dict(out=torch.empty(2, H, dtype=torch.bfloat16)), "out: expected"),
        ]
        before = hx(x, keys, w).clone()
        for change, msg in cases:
            a = dict(x=x, keys=keys, weights=w)
            a.update(change)
            with pytest.raises(ValueError, match=msg):
                hx(**a)
        # a NaN weight on a padding lane is no error; the pool still gives the same answer after
        hx(x, torch.tensor([[0, -1], [2, 3]]), torch.tensor([[0.5, float("nan")], [0.5, 0.5]]))
        assert torch.equal(hx(x, keys, w), before)
    with pytest.raises(ValueError, match="threads"):
        HostExperts(table, small.layout, threads=0)
    with pytest.raises(ValueError, match="table"):
        HostExperts(table.astype(np.int32), small.layout)
    with pytest.raises(ValueError, match="null row"):
        HostExperts(np.zeros(4, dtype=np.int64), small.layout)
    with pytest.raises(ValueError, match="relu2"):
        HostExperts(table, small.layout, RELU2)
    hx = HostExperts(table, small.layout, threads=1)
    hx.close()
    with pytest.raises(RuntimeError, match="closed"):
        hx(x, keys, w)


def test_avx512_build_compiles(tmp_path):
    """The AVX-512 loop compiles on any x86 machine's compiler, whether or not its CPU runs it
    (where it does, the tests above run it as "native")."""
    import platform
    import subprocess

    from cupool.hostexperts import FLAGS, SOURCE
    from cupool.kernels import kernel_dir
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("AVX-512 is an x86 instruction set")
    flags = [f for f in FLAGS if f not in ("-march=native", "-shared")]
    r = subprocess.run([find_compiler(), *flags, "-mavx512f", "-mavx512bw", "-mavx512vbmi",
                        "-mavx512vnni", "-mavx2", "-mfma", "-mf16c", "-Wall", "-Werror", "-dM",
                        "-E", str(kernel_dir() / SOURCE)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "#define HX_ISA 2" in r.stdout               # the AVX-512 loop is the one compiled
    r = subprocess.run([find_compiler(), *flags, "-mavx512f", "-mavx512bw", "-mavx512vbmi",
                        "-mavx512vnni", "-mavx2", "-mfma", "-mf16c", "-Wall", "-Werror", "-c",
                        "-o", str(tmp_path / "hx.o"), str(kernel_dir() / SOURCE)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("spin_ns", [0, 1_000_000])    # workers asleep between jobs; spinning
def test_pool_threads_under_thread_sanitizer(tmp_path, spin_ns):
    """tests/host_pool_harness.c built with -fsanitize=thread: a pool of more threads than this
    machine has CPUs (workers late to jobs or asleep) against a one-thread pool, expert calls, read
    probes and a served mailbox; no race reported and every answer the same bits."""
    import os
    import subprocess
    from pathlib import Path

    from cupool.kernels import kernel_dir
    cc = find_compiler()
    probe = subprocess.run([cc, "-fsanitize=thread", "-x", "c", "-", "-o", str(tmp_path / "p")],
                           input="int main(void) { return 0; }", capture_output=True, text=True)
    if probe.returncode:
        pytest.skip(f"{cc} cannot build with -fsanitize=thread: {probe.stderr.strip()[:200]}")
    exe = tmp_path / "harness"
    r = subprocess.run([cc, "-O1", "-g", "-std=c11", "-pthread", "-fsanitize=thread", "-Wall",
                        "-Werror", f"-I{kernel_dir()}", "-o", str(exe),
                        str(Path(__file__).parent / "host_pool_harness.c"), "-lm"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    threads = max(4, 2 * (os.cpu_count() or 1) + 1)
    r = subprocess.run([str(exe), str(min(threads, 33)), "300", str(spin_ns)], capture_output=True,
                       text=True, timeout=300,
                       env={**os.environ, "TSAN_OPTIONS": "halt_on_error=1 exitcode=66"})
    assert "ThreadSanitizer" not in r.stderr, r.stderr[-4000:]
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    assert r.stdout.strip().endswith(": 0 mismatches")


def test_no_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("CC", "no-such-cc-xyz")
    with pytest.raises(RuntimeError, match="CC='no-such-cc-xyz': no such compiler"):
        find_compiler()
    monkeypatch.delenv("CC")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(RuntimeError, match="none was found"):
        find_compiler()


def test_serving_a_mailbox(small):
    """A mailbox in ordinary memory, the host playing the GPU's part: every request answered with
    the call's bits; the pool refuses direct calls while it serves; stop_serving and serve_stats
    count the calls (and the stats their distinct rows and times)."""
    from cupool.hostexperts import Mailbox
    gen = torch.Generator().manual_seed(24)
    mb = Mailbox(2, 3, 80, pinned=False)
    with HostExperts(small.store.host_addresses(), small.layout, threads=2) as hx:
        cases = []
        for _ in range(4):
            keys, w = _routing(2, 3, 2 * small.E, gen)
            keys[1, 2] = -1
            x = torch.randn(2, 80, generator=gen)
            cases.append((x, keys, w, hx(x, keys, w)))
        hx.serve(mb)
        assert hx.serving
        with pytest.raises(RuntimeError, match="serves a mailbox"):
            hx(*cases[0][:3])
        with pytest.raises(RuntimeError, match="already serves"):
            hx.serve(mb)
        with pytest.raises(RuntimeError, match="still served"):
            mb.close()
        assert hx.serve_stats() == {"calls": 0, "ns": 0, "max_ns": 0, "rows": 0}
        rows = 0
        for x, keys, w, ref in cases * 3:
            n = mb.post(x.numpy(), keys.numpy(), w.numpy())
            assert torch.equal(torch.from_numpy(mb.wait(n).copy()), ref)
            rows += len(set(keys[keys >= 0].tolist()))
        st = hx.serve_stats(reset_max=True)
        assert st["calls"] == 12 and st["rows"] == rows
        assert 0 < st["max_ns"] <= st["ns"] <= 12 * st["max_ns"]
        assert hx.serve_stats()["max_ns"] == 0                  # started again by the reset
        n = mb.post(*(t.numpy() for t in cases[0][:3]))
        mb.wait(n)
        again = hx.serve_stats()
        assert again["calls"] == 13 and 0 < again["max_ns"] <= again["ns"] - st["ns"]
        assert hx.stop_serving() == 13
        assert not hx.serving
        assert torch.equal(hx(*cases[0][:3]), cases[0][3])      # usable again
    with pytest.raises(ValueError, match="H = 64"):
        with HostExperts(small.store.host_addresses(), small.layout, threads=1) as hx:
            hx.serve(Mailbox(1, 1, 64, pinned=False))


def test_serving_requests_of_fewer_tokens(small):
    """A mailbox of 5 tokens answers requests of 1, 3 and 5 tokens (a prefill call's are fewer
    than a decode step's) with the call's bits in their first rows, reading only those rows:
    the rest of x, keys and weights hold NaN and out-of-range poison that would fail a call. A
    request whose size is not whole tokens, or more than the mailbox holds, is answered with
    nothing computed and refused when serving stops."""
    from cupool.hostexperts import ERR_ARGS, Mailbox
    gen = torch.Generator().manual_seed(26)
    K = 3
    mb = Mailbox(5, K, 80, pinned=False)
    with HostExperts(small.store.host_addresses(), small.layout, threads=2) as hx:
        cases = []
        for t in (3, 1, 5, 2):
            keys, w = _routing(t, K, 2 * small.E, gen)
            x = torch.randn(t, 80, generator=gen)
            cases.append((x, keys, w, hx(x, keys, w)))
        hx.serve(mb)
        for x, keys, w, ref in cases:
            mb.x[...] = np.nan                      # poison past the request's rows
            mb.keys[...] = 1 << 40
            mb.weights[...] = np.nan
            n = mb.post(x.numpy(), keys.numpy(), w.numpy())
            assert mb.size == x.shape[0] * K
            got = torch.from_numpy(mb.wait(n)[:x.shape[0]].copy())
            assert torch.equal(got, ref)
        with pytest.raises(ValueError, match=r"1 <= t <= 5"):
            mb.post(np.zeros((6, 80)), np.zeros((6, K)), np.zeros((6, K)))
        with pytest.raises(ValueError, match=r"keys: expected t·K = 2·3 = 6 values, got 9"):
            mb.post(np.zeros((2, 80)), np.zeros((3, K)), np.zeros((2, K)))
        with pytest.raises(ValueError, match=r"weights: expected t·K = 2·3 = 6 values, got 3"):
            mb.post(np.zeros((2, 80)), np.zeros((2, K)), np.zeros((1, K)))
        assert hx.serve_stats()["calls"] == 4
        for size in (4, 6 * K, 0):                  # not whole tokens, too many, none
            ctypes.c_uint32.from_address(mb.addresses["size"]).value = size
            n = mb.seq + 1
            ctypes.c_uint32.from_address(mb.addresses["seq"]).value = n
            mb.wait(n)
        with pytest.raises(RuntimeError, match=r"refused \(error bits 4\)"):
            hx.stop_serving()
    assert ERR_ARGS == 4


def test_idle_serving_sleeps(small):
    """A serving pool with nothing posted naps instead of spinning (its nap growing to 1 ms): a
    second of idle serving costs well under a tenth of a core of this process's CPU time more
    than a second with the pool not serving (it cost about a quarter while it polled every 20 µs
    between spins), and a request posted after it is answered with the call's bits."""
    import resource
    import time

    from cupool.hostexperts import Mailbox

    def cpu_s():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    gen = torch.Generator().manual_seed(25)
    keys, w = _routing(1, 3, 2 * small.E, gen)
    x = torch.randn(1, 80, generator=gen)
    mb = Mailbox(1, 3, 80, pinned=False)
    def share_over(seconds):                 # the process's CPU time over a wall interval
        c0, t0 = cpu_s(), time.monotonic()
        time.sleep(seconds)
        return (cpu_s() - c0) / (time.monotonic() - t0)

    with HostExperts(small.store.host_addresses(), small.layout, threads=2, spin_ms=0) as hx:
        ref = hx(x, keys, w)
        time.sleep(0.2)
        quiet = share_over(1.0)              # the rest of the process (other tests' threads)
        hx.serve(mb)
        time.sleep(0.2)
        serving = share_over(1.0)
        n = mb.post(x.numpy(), keys.numpy(), w.numpy())
        assert torch.equal(torch.from_numpy(mb.wait(n).copy()), ref)
        assert hx.stop_serving() == 1
    assert serving - quiet < 0.1, \
        f"an idle serving pool took {serving - quiet:.3f} of a core ({serving:.3f} - {quiet:.3f})"


def test_measure_cpu_us(small):
    """The host cost a pool's host share is split by, from calls of one token through 1 and 8
    rows in turn, in three rounds: on a stand-in timed at 30 µs a call plus 40 µs a row (each
    call's keys checked: one token, distinct keys in range), exactly (40, 30), also where the
    first round's 8-row calls were ten times slower; one with no cost of its own gives (row, 0);
    the real pool gives a positive row and a call's part not negative."""
    from cupool.layer import measure_cpu_us

    class Timed:
        def __init__(self, call_ns, row_ns):
            self.call_ns, self.row_ns, self.seen = call_ns, row_ns, []

        def timed(self, x, keys, w, reps):
            assert x.shape == (1, 80) and keys.shape == w.shape and keys.shape[0] == 1
            k = keys[0].tolist()
            assert len(set(k)) == len(k) and 0 <= min(k) and max(k) < 2 * small.E
            self.seen.append(len(k))
            return [self.call_ns + self.row_ns * len(k)] * reps

    fake = Timed(30_000, 40_000)
    assert measure_cpu_us(fake, 80, 2 * small.E, reps=5) == (40.0, 30.0)
    assert sorted(set(fake.seen)) == [1, 8]
    assert fake.seen == [1, 8] * 15                  # in turn, 5 of each in each of 3 rounds
    assert measure_cpu_us(Timed(0, 25_000), 80, 2 * small.E, reps=3) == (25.0, 0.0)

    class Disturbed(Timed):
        """8-row calls ten times slower through the first round (as a pool's calls run while
        other threads hold its CPUs), then as Timed."""
        def timed(self, x, keys, w, reps):
            ns = super().timed(x, keys, w, reps)
            slow = len(self.seen) <= 2 * 5 and keys.shape[1] == 8
            return [t * 10 for t in ns] if slow else ns

    assert measure_cpu_us(Disturbed(30_000, 40_000), 80, 2 * small.E, reps=5) == (40.0, 30.0)
    # with one round (the disturbed one) the row's time is what the slow calls gave
    assert measure_cpu_us(Disturbed(30_000, 40_000), 80, 2 * small.E, reps=5, rounds=1)[0] > 400
    with HostExperts(small.store.host_addresses(), small.layout, threads=1) as hx:
        row, call = measure_cpu_us(hx, 80, 2 * small.E, reps=3)
    assert np.isfinite(row) and np.isfinite(call)
    assert row > 0 and call >= 0


def test_measure_cpu_prefill_us(small):
    """A prefill call's host cost, from calls of T tokens whose routed lanes go to 2 and to 10
    rows of T·K / E tokens each: on a stand-in timed at 50 µs a call plus 12 µs a row-token
    (each call's lanes checked: T tokens, distinct rows in range, each with its tokens, the other
    lanes -1), exactly (12·m, 50) for m tokens a row; the real pool gives a positive row."""
    from cupool.layer import measure_cpu_prefill_us

    class Timed:
        def __init__(self):
            self.rows = []

        def timed(self, x, keys, w, reps):
            assert x.shape == (T, 80) and keys.shape == w.shape == (T, K)
            routed = keys[keys >= 0]
            counts = torch.bincount(routed - routed.min())
            counts = counts[counts > 0]
            assert 0 <= int(routed.min()) and int(routed.max()) < 2 * small.E
            assert (counts == m).all()               # each row its m tokens
            for t in range(T):                       # a token reaches a row once
                k = keys[t][keys[t] >= 0].tolist()
                assert len(set(k)) == len(k)
            self.rows.append(counts.numel())
            return [50_000 + 12_000 * int(counts.sum())] * reps

    T, K, E = 24, 3, 12
    m = round(T * K / E)                             # 6 tokens a row
    fake = Timed()
    assert measure_cpu_prefill_us(fake, 80, 2 * small.E, T, K, E, reps=3) == (12.0 * m, 50.0)
    assert sorted(set(fake.rows)) == [2, 10]
    with HostExperts(small.store.host_addresses(), small.layout, threads=1) as hx:
        row, call = measure_cpu_prefill_us(hx, 80, 2 * small.E, T, K, E, reps=3)
    assert np.isfinite(row) and np.isfinite(call) and row > 0 and call >= 0


def test_prefill_share_balances_the_link_and_the_host():
    """`HostDecode.prefill_us` interpolates the measured widths linearly (held past the widest,
    a row at least 5% of the narrowest's below it) and `prefill_share` takes the count that
    makes the later of the link (a row at prefill_link_us, the copy engine's, not the decode
    copies' link_us) and the host finish soonest (`host_split`): nothing for calls wider than
    prefill_tokens, with no expert missing, or with host prefill off."""
    from cupool.hostexperts import host_split
    from cupool.layer import HostDecode

    hd = object.__new__(HostDecode)                  # the figures alone: no pool, no GPU
    hd.prefill_tokens, hd.handoff_us, hd._shares = 128, 10.0, {}
    hd.link_us, hd.prefill_link_us = 500.0, 48.0
    hd.prefill_costs = [(32, 40.0, 20.0), (128, 100.0, 60.0)]
    assert hd.prefill_us(32) == (40.0, 20.0) and hd.prefill_us(128) == (100.0, 60.0)
    assert hd.prefill_us(80) == (70.0, 40.0)
    assert hd.prefill_us(8) == (25.0, 10.0)          # extrapolated below the narrowest
    assert hd.prefill_us(1) == (pytest.approx(40.0 - 31 * 60 / 96),
                                pytest.approx(20.0 - 31 * 40 / 96))
    hd.prefill_costs = [(32, 40.0, 5.0), (128, 400.0, 60.0)]
    assert hd.prefill_us(1) == (2.0, 0.0)            # a row's floor, a call's at 0
    hd.prefill_costs = [(32, 40.0, 20.0), (128, 100.0, 60.0)]
    assert hd.prefill_us(400) == (100.0, 60.0)
    k = hd.prefill_share(128, 64)
    assert k == host_split(64, 48.0, 100.0, 70.0) == 20
    assert max((64 - k) * 48.0, 70.0 + 100.0 * k) < 64 * 48.0
    assert hd.prefill_share(129, 64) == 0 and hd.prefill_share(128, 0) == 0
    assert hd.prefill_share(0, 64) == 0
    hd.prefill_costs = [(128, 5000.0, 0.0)]          # a CPU far slower than the link
    hd._shares = {}
    assert hd.prefill_share(128, 64) == 0
    hd.prefill_tokens = 0
    assert hd.prefill_share(16, 64) == 0 and hd.prefill_us(16) == (5000.0, 0.0)


@pytest.mark.parametrize("costs", [[], [(0, 1.0, 1.0)], [(2.5, 1.0, 1.0)], [(4, 0.0, 1.0)],
                                   [(4, 1.0, -1.0)], [(8, 1.0, 1.0), (4, 1.0, 1.0)],
                                   [(1, 1.0, 1.0)] * 3, "x", [(1, float("nan"), 0.0)]])
def test_prefill_costs_refused(costs):
    from cupool.layer import check_prefill_costs, check_prefill_settings
    with pytest.raises(ValueError, match="prefill_costs must be one or two"):
        check_prefill_costs(costs)
    with pytest.raises(ValueError, match="prefill_costs must be one or two"):
        check_prefill_settings(16, costs, 64)


def test_prefill_tokens_refused():
    from cupool.layer import check_prefill_costs, check_prefill_settings
    for bad in (-1, 65, 2.0, True, "8"):
        with pytest.raises(ValueError, match=r"prefill_tokens must be an int in \[0, 64\]"):
            check_prefill_settings(bad, None, 64)
    check_prefill_settings(0, None, 64)
    for bad in (0, -1.0, float("inf"), float("nan"), True, "48"):
        with pytest.raises(ValueError, match="prefill_link_us must be a finite number > 0"):
            check_prefill_settings(16, None, 64, bad)
    check_prefill_settings(16, None, 64, 48)
    assert check_prefill_costs([(32, 40, 20), (128, 100.0, 60)]) == [(32, 40.0, 20.0),
                                                                    (128, 100.0, 60.0)]
