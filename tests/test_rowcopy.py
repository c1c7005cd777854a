"""RowCopier's argument checks that need no GPU: they run before any tensor reaches the device."""

import pytest
import torch

from cupool.ops.rowcopy import MODES, RowCopier


def _cpu_args():
    return torch.zeros(4, dtype=torch.int64), 256, torch.zeros(2, 256, dtype=torch.uint8), 2


def test_modes():
    assert MODES == ("auto", "ld", "bulk")


@pytest.mark.parametrize("mode", ["tma", "", "LD", None])
def test_bad_mode_is_named(mode):
    with pytest.raises(ValueError, match="mode must be one of"):
        RowCopier(*_cpu_args(), mode=mode)


@pytest.mark.parametrize("chunk", [0, 8, 24, 16385, -16, 16.0, True, "16384"])
def test_bulk_chunk_must_be_a_multiple_of_16(chunk):
    with pytest.raises(ValueError, match="chunk must be a positive multiple of 16"):
        RowCopier(*_cpu_args(), mode="bulk", chunk=chunk)


@pytest.mark.parametrize("stages", [0, 1, -2, 2.0, True])
def test_bulk_needs_two_stages(stages):
    with pytest.raises(ValueError, match="stages must be an int >= 2"):
        RowCopier(*_cpu_args(), mode="bulk", stages=stages)


def test_ld_threads_are_checked():
    with pytest.raises(ValueError, match="threads must be a multiple of 32"):
        RowCopier(*_cpu_args(), threads=48)


@pytest.mark.parametrize("mode,kw", [("ld", {}), ("bulk", {"chunk": 4096, "stages": 3}),
                                     ("bulk", {"threads": 48})])   # threads: "ld" only
def test_good_arguments_reach_the_tensor_checks(mode, kw):
    # CPU tensors: past the argument checks, the first tensor check names src_of_key
    with pytest.raises(TypeError, match="src_of_key must be a 1-D int64 CUDA tensor"):
        RowCopier(*_cpu_args(), mode=mode, **kw)
