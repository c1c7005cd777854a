"""`cupool.ops.enginecopy` on the CPU: what it refuses before any GPU work (the copies
themselves are tests/test_gpu_enginecopy.py's)."""

import builtins

import pytest

from cupool.ops import enginecopy


@pytest.mark.parametrize("slots", [0, 9, -1, 2.0, True, "2", None])
def test_slots_are_checked(slots):
    with pytest.raises(ValueError, match=r"slots must be an int in \[1, 8\]"):
        enginecopy.check_slots(slots)


def test_slots_in_range():
    assert [enginecopy.check_slots(k) for k in (1, 2, 8)] == [1, 2, 8]


def test_slots_match_the_kernel():
    from kernel_builds import ROOT
    text = (ROOT / "rawkernels" / "graphcopy.cu").read_text()
    assert f"#define MAX_SLOTS {enginecopy.MAX_SLOTS}\n" in text
    assert f"#define ERR_KEY {enginecopy.ERR_KEY}\n" in text


def test_missing_bindings_name_the_install(monkeypatch):
    """Without cuda-bindings the switch says what to install, before anything is built."""
    real = builtins.__import__

    def no_bindings(name, *args, **kwargs):
        if name.startswith("cuda.bindings"):
            raise ImportError("No module named 'cuda.bindings'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_bindings)
    with pytest.raises(ImportError, match=r"CUPOOL_ENGINE_COPIES=1.*pip install "
                                          r"'cuda-bindings>=13,<14'"):
        enginecopy.driver()
    with pytest.raises(ImportError, match="cuda-bindings"):
        enginecopy.EngineCopies(bank=None, slots=2)


def test_other_bindings_versions_are_refused(monkeypatch):
    """cuda-bindings 12 has other signatures for the capture calls: refused by name."""
    import sys
    import types
    cuda = types.ModuleType("cuda")
    bindings = types.ModuleType("cuda.bindings")
    bindings.__version__ = "12.9.0"
    bindings.driver = types.ModuleType("cuda.bindings.driver")
    cuda.bindings = bindings
    monkeypatch.setitem(sys.modules, "cuda", cuda)
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", bindings.driver)
    with pytest.raises(ImportError, match=r"cuda-bindings 13, found 12\.9\.0"):
        enginecopy.driver()
    bindings.__version__ = "13.5.0"
    assert enginecopy.driver() is bindings.driver
