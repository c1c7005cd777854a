"""GPU checks of the foundation: loader + graph capture, UVA reads of the store, NVML report."""

import numpy as np
import pytest
import torch

from cupool import HostStore, kernels, report
from cupool.rowcopy import RowCopier

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
