"""The order of a decode call's launches with the host's CPU on (`PooledExperts._decode_host`),
checked on the CPU with stand-ins that record each call: the host's request is posted after the
plan and before the link's row copies, so the host computes its rows while the link brings the
others (what `cupool.hostexperts.split_table` assumes). Posted after the copies, the two would
take turns and a call would wait for their sum."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import cupool.layer as layer_mod
from cupool.layer import PooledExperts


class _Stream:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait_stream(self, other):
        self.log.append(f"{self.name} waits")


def _call(monkeypatch, *, leave: bool, layer: int, layers: int = 3, T: int = 2, K: int = 4):
    log: list[str] = []

    class Bank:
        def plan_host(self, layer, ids):
            log.append("plan")
            W = ids.numel()
            return (torch.zeros(W, dtype=torch.int32), torch.zeros(W, dtype=torch.int64),
                    torch.full((W,), -1, dtype=torch.int64))

        def copy_rows(self):
            log.append("link copies")

        def step_host(self, layer, ids):
            raise AssertionError("step_host copies before the request could be posted")

        def copy_behind(self, layer, stream):
            log.append("behind copies")

        def land(self):
            log.append("land")

    class Gemm:
        def decode(self, x, lane_addr, w, out):
            log.append("gemm")
            return torch.zeros_like(x)

    pool = SimpleNamespace(device="cpu", bank=Bank(), gemm=Gemm(), num_layers=layers)
    hd = SimpleNamespace(tokens=T, leave=leave, mailbox=object(), error=None,
                         side=_Stream(log, "side"))
    monkeypatch.setattr(layer_mod, "post", lambda *a: log.append("post"))
    monkeypatch.setattr(layer_mod, "wait", lambda *a: log.append("wait"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream(log, "current"))
    x = torch.randn(T, 16)
    ids = torch.randint(0, 8, (T, K))
    w = torch.rand(T, K)
    PooledExperts(pool, layer)._decode_host(hd, x, ids, w, None)
    return log


@pytest.mark.parametrize("leave", [True, False])
def test_request_posted_before_the_link_copies(monkeypatch, leave):
    log = _call(monkeypatch, leave=leave, layer=0)
    assert log.index("plan") < log.index("post") < log.index("link copies") < log.index("gemm")
    assert log[-1] == "wait"
    if leave:
        assert log == ["plan", "post", "link copies", "gemm", "wait"]
    else:
        assert log.index("link copies") < log.index("behind copies") < log.index("gemm")
        assert "land" not in log


def test_last_layer_lands_after_the_wait(monkeypatch):
    log = _call(monkeypatch, leave=False, layer=2, layers=3)
    assert log[:3] == ["plan", "post", "link copies"]
    assert log[-2:] == ["current waits", "land"]
    assert log.index("wait") < log.index("land")
