"""torch.compile around pooled layers (CPU): the cupool::experts op is opaque to dynamo, so a
compiled transformers model calls each pooled layer once per forward and gives the same logits.

A stand-in layer (the model's own eager experts computation, registered under a key like a
PooledExperts) replaces the GPU pool; the GPU path is covered by test_gpu_wrap.py.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import hf_model

pytest.importorskip("transformers")


class _StandIn:
    """Registered like a PooledExperts: key + __call__(x, ids, w). Counts its calls."""

    def __init__(self, module):
        from cupool import layer
        self.module, self.calls = module, 0
        self.key = next(layer._KEYS)
        layer._LAYERS[self.key] = self

    def __call__(self, x, ids, w):
        from cupool.reference.moe import reference_moe
        self.calls += 1
        m = self.module
        I = m.down_proj.shape[-1]
        return reference_moe(x, ids, w, lambda e: (m.gate_up_proj[e, :I], m.gate_up_proj[e, I:],
                                                   m.down_proj[e])).to(x.dtype)


def test_compiled_model_calls_the_opaque_op_and_matches_eager():
    from cupool import swap
    swap.register_hf()
    model = hf_model("qwen3_moe")
    ids = torch.randint(3, 64, (1, 7))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    stand_ins = []
    for m in model.modules():
        if hasattr(m, "gate_up_proj"):
            m._cupool = _StandIn(m)
            m.config._experts_implementation_internal = swap.IMPLEMENTATION
            stand_ins.append(m._cupool)
    assert len(stand_ins) == 3
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", dynamic=False, fullgraph=True)
    with torch.no_grad():
        out = compiled(input_ids=ids).logits
    # fullgraph=True: the op did not break the graph; each layer ran once in the compiled call.
    assert [s.calls for s in stand_ins] == [1, 1, 1]
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)   # same fp32 math, reordered
    torch._dynamo.reset()


def test_unknown_key_is_a_clear_error():
    from cupool import layer
    with pytest.raises(RuntimeError, match="no pooled layer with key"):
        layer.experts_op(torch.zeros(1, 4), torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2), -1)
