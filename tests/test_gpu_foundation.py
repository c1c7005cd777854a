"""GPU checks of the foundation: loader + graph capture, UVA reads of the store, NVML report."""

import numpy as np
import pytest
import torch

from cupool import HostStore, _cuda, kernels, report
from cupool.ops.rowcopy import RowCopier

pytestmark = pytest.mark.gpu


def test_selftest_kernel_in_cuda_graph():
    k = kernels.function("selftest", "axpb")
    n = 100_003                                        # odd size: the grid-stride tail is used
    x = torch.randn(n, device="cuda")
    b = torch.tensor([0.25], device="cuda")
    y = torch.full_like(x, float("nan"))
    args = (x, b, y, kernels.f32(3.0), kernels.i32(n))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):                          # warm-up (compile) outside capture
        kernels.launch(k, 64, 256, args)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        kernels.launch(k, 64, 256, args)
    for _ in range(3):                                  # new inputs in the captured buffers
        x.copy_(torch.randn(n, device="cuda"))
        b.fill_(float(torch.randn(())))
        y.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(y, 3.0 * x + b, rtol=0, atol=1e-6)


def test_compile_error_names_file_and_line(tmp_path, monkeypatch):
    (tmp_path / "common.cuh").write_text("#pragma once\n")
    (tmp_path / "broken.cu").write_text(
        '#include "common.cuh"\nextern "C" __global__ void f() {\n  int x = ;\n}\n')
    monkeypatch.setattr(kernels, "kernel_dir", lambda: tmp_path)
    with pytest.raises(kernels.KernelCompileError) as ei:
        kernels.load("broken")
    msg = str(ei.value)
    assert "broken.cu" in msg and "(3)" in msg, msg


def test_store_rows_read_back_through_uva(rng):
    L, E, row = 3, 7, 48 * 1024 + 16 * 3              # odd row size (multiple of 16)
    store = HostStore(L, E, row, chunk_bytes=5 * 49408)
    rows = rng.integers(0, 256, size=(L, E, row), dtype=np.uint8)
    store.fill(lambda layer: rows[layer], progress=False)
    store.seal()
    before = store.checksums()
    n = 9
    dst = torch.full((n, store.row_stride), 0xA5, dtype=torch.uint8, device="cuda")   # poison
    copier = RowCopier(store.address_table(), row, dst, max_copies=16)
    keys = rng.choice(L * E, size=n, replace=False)
    copies = torch.zeros(16, 2, dtype=torch.int32, device="cuda")
    copies[:n, 0] = torch.from_numpy(keys.astype(np.int32))
    copies[:n, 1] = torch.arange(n, dtype=torch.int32)
    copier(copies, torch.tensor([n], dtype=torch.int32, device="cuda"))
    got = dst.cpu().numpy()
    for i, key in enumerate(keys):
        np.testing.assert_array_equal(got[i, :row], rows[key // E, key % E], err_msg=f"key {key}")
        assert (got[i, row:] == 0xA5).all(), "copy wrote past row_bytes"
    # an empty list copies nothing
    dst.fill_(0x5A)
    copier(copies, torch.tensor([0], dtype=torch.int32, device="cuda"))
    assert (dst.cpu() == 0x5A).all()
    np.testing.assert_array_equal(before, store.checksums())
    store.close()


# (chunk, stages, blocks): the default ring on the default grid; rings on a few blocks, so each
# block loads many chunks and every buffer's mbarrier goes through many phases; an odd chunk
# (65 x 16 bytes) and a stage count that is not a power of two.
BULK_SETTINGS = [(16384, 4, None), (4096, 2, 7), (65536, 3, 2), (1040, 5, 3)]
# One 16-byte unit; a page and three units; three 16 KiB chunks and five units (no multiple of
# any chunk above); 2 MiB and one unit.
BULK_ROWS = [16, 4096 + 48, 3 * 16384 + 80, (2 << 20) + 16]


def _need_bulk(shared_mem: int = 0) -> None:
    """Skip where the kernels are built without bulk copies (before sm_90, e.g. CUPOOL_ARCH=86)
    or a block cannot hold `shared_mem` bytes (sm_120's 99 KiB)."""
    tgt = _cuda.target()
    if not tgt.bulk_copy:
        pytest.skip(f"bulk copies need sm_90+ code; the kernels are built for {tgt.describe()}")
    if shared_mem > tgt.smem_block - 1024:
        pytest.skip(f"{shared_mem} bytes of shared memory a block: more than sm_{tgt.sm} allows")


def _check_copied(dst, host, E, keys, targets, listed, row, why):
    """The first `listed` pairs (keys[i] -> row targets[i]) hold their host row's bytes and
    keep the poison past row_bytes; every other dst row is all poison."""
    got = dst.cpu().numpy()
    for key, r in zip(keys[:listed], targets[:listed]):
        np.testing.assert_array_equal(got[r, :row], host[key // E, key % E],
                                      err_msg=f"{why}: row {r} <- key {key}, {row} B")
        assert (got[r, row:] == 0xA5).all(), f"{why}: wrote past row_bytes={row}"
    untouched = np.setdiff1d(np.arange(dst.shape[0]), targets[:listed])
    assert (got[untouched] == 0xA5).all(), f"{why}: wrote a row not in the list"


@pytest.mark.parametrize("row", BULK_ROWS)
@pytest.mark.parametrize("chunk,stages,blocks", BULK_SETTINGS,
                         ids=[f"chunk{c}-stages{s}-blocks{b}" for c, s, b in BULK_SETTINGS])
def test_bulk_rowcopy_copies_exactly_the_listed_rows(rng, chunk, stages, blocks, row):
    _need_bulk(chunk * stages)
    L, E, n_dst, max_copies, n = 2, 3, 8, 5, 3
    store = HostStore(L, E, row)
    host = rng.integers(0, 256, size=(L, E, row), dtype=np.uint8)
    store.fill(lambda layer: host[layer], progress=False)
    store.seal()
    before = store.checksums()
    # dst rows wider than the store's, so every row has bytes past row_bytes to keep
    dst = torch.full((n_dst, store.row_stride + 256), 0xA5, dtype=torch.uint8,
                     device="cuda")                                          # poison
    copier = RowCopier(store.address_table(), row, dst, max_copies, mode="bulk",
                       chunk=chunk, stages=stages, blocks=blocks)
    keys = rng.choice(L * E, size=max_copies, replace=False)
    targets = rng.choice(n_dst, size=max_copies, replace=False)
    # every entry is a valid pair: those past n_copies must still be left alone
    copies = torch.from_numpy(np.stack([keys, targets], 1).astype(np.int32)).cuda()
    args = (dst, host, E, keys, targets)

    copier(copies, torch.tensor([n], dtype=torch.int32, device="cuda"))
    _check_copied(*args, n, row, f"n_copies={n}")
    dst.fill_(0xA5)
    copier(copies, torch.tensor([0], dtype=torch.int32, device="cuda"))
    _check_copied(*args, 0, row, "n_copies=0")
    # a length beyond the list's capacity is clamped to max_copies
    copier(copies, torch.tensor([1000], dtype=torch.int32, device="cuda"))
    _check_copied(*args, max_copies, row, "n_copies=1000 > max_copies")
    torch.cuda.synchronize()
    np.testing.assert_array_equal(before, store.checksums())       # the host store is read only
    store.close()


def test_bulk_rowcopy_in_cuda_graph(rng):
    # one capture serves every list length: 72 KiB of shared memory a block (over the 48 KiB
    # default) is set up when the copier is built, not inside the capture
    _need_bulk(24576 * 3)
    row, E, max_copies = 3 * 16384 + 80, 4, 4
    store = HostStore(1, E, row)
    host = rng.integers(0, 256, size=(1, E, row), dtype=np.uint8)
    store.fill(lambda layer: host[layer], progress=False)
    store.seal()
    dst = torch.full((E, store.row_stride), 0xA5, dtype=torch.uint8, device="cuda")
    copier = RowCopier(store.address_table(), row, dst, max_copies, mode="bulk",
                       chunk=24576, stages=3)
    keys, targets = rng.permutation(E), rng.permutation(E)
    copies = torch.from_numpy(np.stack([keys, targets], 1).astype(np.int32)).cuda()
    n_copies = torch.zeros(1, dtype=torch.int32, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):                          # warm-up (compile) outside capture
        copier(copies, n_copies)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        copier(copies, n_copies)
    for n in (2, 0, 4):
        dst.fill_(0xA5)
        n_copies.fill_(n)
        g.replay()
        torch.cuda.synchronize()
        _check_copied(dst, host, E, keys, targets, n, row, f"graph replay, n_copies={n}")
    store.close()


def test_bulk_rowcopy_rejects_what_the_device_cannot_hold():
    store = HostStore(1, 2, 4096)
    dst = torch.zeros(2, store.row_stride, dtype=torch.uint8, device="cuda")
    tgt = _cuda.target()
    if not tgt.bulk_copy:
        with pytest.raises(ValueError, match="needs kernels built for sm_90"):
            RowCopier(store.address_table(), 4096, dst, 2, mode="bulk")
        assert RowCopier(store.address_table(), 4096, dst, 2).mode == "ld"
    else:
        with pytest.raises(ValueError, match="chunk \\* stages"):
            RowCopier(store.address_table(), 4096, dst, 2, mode="bulk", chunk=128 << 10, stages=2)
        # the default ring fits the target's block: 4 buffers of 32 KiB, 3 where a block has 99 KiB
        auto = RowCopier(store.address_table(), 4096, dst, 2)
        assert auto.mode == "bulk" and auto.shared_mem <= tgt.smem_block - 1024
    store.close()


def test_report_agrees_with_nvml():
    import pynvml
    pynvml.nvmlInit()
    keep = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")    # something to account for
    r = report()
    h = pynvml.nvmlDeviceGetHandleByIndex(r.gpu.index) if torch.cuda.device_count() == 1 else None
    if h is not None:
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        assert r.gpu.total == mem.total
        # used/free move with other processes; 64 MiB is slack for the driver's own allocations
        assert abs(r.gpu.used - mem.used) < (64 << 20)
        assert abs(r.gpu.free - mem.free) < (64 << 20)
    assert r.gpu.torch_allocated == torch.cuda.memory_allocated()
    assert r.gpu.torch_allocated >= keep.numel()
    assert r.gpu.name == torch.cuda.get_device_name()
    text = str(r)
    assert "NVML total" in text and "torch allocated" in text
    del keep


def test_launch_takes_the_packed_argument_path():
    """cupool's kernels launch through cuLaunchKernel with packed arguments (kernels.launch), not
    CuPy's per-argument conversion: the CUfunction handle is found, and a launch with every
    argument kind (tensor, f32, i32) computes the reference."""
    k = kernels.function("selftest", "axpb")
    assert kernels._function_handle(k) is not None
    n = 4099
    x = torch.randn(n, device="cuda")
    b = torch.tensor([-1.5], device="cuda")
    y = torch.full_like(x, float("nan"))
    kernels.launch(k, 3, 128, (x, b, y, kernels.f32(-0.75), kernels.i32(n)))
    torch.cuda.synchronize()
    torch.testing.assert_close(y, x * -0.75 + b, rtol=1e-6, atol=1e-6)   # FMA vs mul + add


@pytest.mark.parametrize("packed", [True, False])
def test_launch_on_a_given_stream(packed, monkeypatch):
    """kernels.launch(stream=s) runs on s, not on the current stream: with the current stream
    held by a 50 ms sleep, s finishes the kernel first; the current stream stays current."""
    k = kernels.function("selftest", "axpb")
    if not packed:                                   # CuPy's call (no CUfunction handle)
        monkeypatch.setattr(kernels._kernel_facts(k), "handle", None)
    n = 1000
    x = torch.randn(n, device="cuda")
    b = torch.tensor([0.25], device="cuda")
    y = torch.full_like(x, float("nan"))
    side = torch.cuda.Stream()
    main = torch.cuda.current_stream()
    side.wait_stream(main)                           # x, b, y are ready before the sleep
    torch.cuda._sleep(100_000_000)                   # ~50 ms on the current stream
    kernels.launch(k, 8, 128, (x, b, y, kernels.f32(2.0), kernels.i32(n)), stream=side)
    assert torch.cuda.current_stream() == main
    side.synchronize()
    assert not main.query(), "the current stream's sleep ended first: the check proves nothing"
    torch.testing.assert_close(y, x * 2.0 + b, rtol=1e-6, atol=1e-6)
    torch.cuda.synchronize()
