"""GPU check of the read probes (rawkernels/read_probe.cu, used by benchmarks/profile_read.py):
every 32-bit word of the rows is read exactly once, so the XOR of the blocks' sinks equals the XOR
of the rows' words computed by torch. A word read twice or skipped changes the XOR (the rows are
random), so the test fails on either."""

import pytest
import torch

from cupool import kernels

pytestmark = pytest.mark.gpu


def xor_all(t: torch.Tensor) -> int:
    v = t.contiguous().view(torch.int32).reshape(-1).cpu()
    while v.numel() > 1:
        if v.numel() % 2:
            v = torch.cat([v, torch.zeros(1, dtype=torch.int32)])
        v = v[0::2] ^ v[1::2]
    return int(v[0])


@pytest.mark.parametrize("kernel, n, row_bytes, grid", [
    ("read_rows", 1, 16, 3),             # one vector, most blocks idle
    ("read_rows", 5, 48 * 16 + 16, 7),   # rows not a multiple of the block's span
    ("read_rows", 8, 4096 * 3, 396),     # more blocks than a row's vectors per block
    ("read_rows_bulk", 1, 4096, 2),
    ("read_rows_bulk", 7, 4096 * 5, 13), # pieces not a multiple of the warps
    ("read_rows_bulk", 3, 4096 * 2, 396),
])
def test_probe_reads_every_word_once(kernel, n, row_bytes, grid):
    gen = torch.Generator(device="cuda").manual_seed(n * 1000 + grid)
    E, stride = 2 * n + 3, row_bytes + 256
    rows = torch.randint(-2**31, 2**31 - 1, (E, stride // 4), generator=gen, device="cuda",
                         dtype=torch.int32)
    pick = torch.randperm(E, generator=gen, device="cuda")[:n]          # scattered, odd order
    addr = rows.data_ptr() + pick.to(torch.int64) * stride
    sink = torch.randint(-2**31, 2**31 - 1, (grid,), generator=gen, device="cuda",
                         dtype=torch.int32)                              # poisoned
    per_row = row_bytes // 16 if kernel == "read_rows" else row_bytes // 4096
    fn = kernels.function("read_probe", kernel)
    kernels.launch(fn, grid, 256, (addr, kernels.i32(n), kernels.i32(per_row), sink))
    torch.cuda.synchronize()
    expect = xor_all(rows[pick, :row_bytes // 4])
    assert xor_all(sink) == expect


@pytest.mark.parametrize("dependent", [False, True], ids=["plain", "dependent"])
@pytest.mark.parametrize("grid", [1, 8, 396])
def test_chain_of_launches_counts_every_launch(grid, dependent):
    """chain_step (benchmarks/profile_chain.py): each launch reads the count the launch before
    wrote and adds one, so a graph of N launches leaves N only if every launch waited for the one
    before; as dependents (sm_90+) that wait is griddepcontrol's. Replayed twice from a poisoned
    start (the count is set, not zeroed, so a graph that skipped launches would show it)."""
    fn = kernels.function("read_probe", "chain_step")
    count = torch.full((1,), 1000, dtype=torch.int32, device="cuda")
    n = 97

    def chain():
        for _ in range(n):
            kernels.launch(fn, grid, 256, (count,), dependent=dependent)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                 # eager first (compiles the kernel)
        chain()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert int(count.item()) == 1000 + n
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        chain()
    for start in (-5, 12345):
        count.fill_(start)
        g.replay()
        torch.cuda.synchronize()
        assert int(count.item()) == start + n
