"""Every pooled decode call of a wrapped tiny model checked on its own (GPU).

test_gpu_wrap compares whole-model logits, where a small error in one layer call grows through
the later layers (and a router near-tie can flip a later layer's choice). This runs the same flow
as its `test_family_matches_dequantized_reference` (prompt, graph decode, gate closed, eager
greedy decode) and, during the eager decode, checks each layer's decode call against a float
reference computed from the very rows the call read (the bytes at its lane addresses, unpacked
and dequantised), and that those rows equal the host store's rows of the routed experts. On a
failure it prints the calls over the tolerance and each step's logit error with the routers'
choices against the reference's.
"""

from __future__ import annotations

import statistics

import pytest
import torch
from tiny_models import FAMILIES

pytest.importorskip("transformers")

TOL = 1e-2               # the GEMM's tolerance against the float reference (test_gpu_gemm)


def rows_at(addrs: list[int], nbytes: int, device) -> list[torch.Tensor | None]:
    """The bytes at each address (GPU or mapped host memory; 0: padding lane -> None)."""
    import cupy
    out = []
    for a in addrs:
        if a == 0:
            out.append(None)
            continue
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        cupy.cuda.runtime.memcpy(dst.data_ptr(), a, nbytes, cupy.cuda.runtime.memcpyDefault)
        out.append(dst.cpu())
    return out


class CallChecker:
    """Wraps pool.gemm.decode and the pooled layers: records each decode call's error."""

    def __init__(self, pool):
        self.pool, self.records, self.active = pool, [], False
        self._layer, self._ids = None, None
        gemm = pool.gemm
        self._decode = gemm.decode
        gemm.decode = self.decode
        for layer in pool.layers:
            layer.__class__ = type("Checked" + type(layer).__name__, (type(layer),),
                                   {"__call__": self._layer_call(type(layer).__call__)})

    def _layer_call(self, call):
        checker = self

        def wrapped(layer, hidden_states, top_k_index, top_k_weights):
            if checker.active:                   # (no host reads while a graph is captured)
                checker._layer, checker._ids = layer.layer, top_k_index.reshape(-1).tolist()
            return call(layer, hidden_states, top_k_index, top_k_weights)
        return wrapped

    def decode(self, x, lane_addr, w, out=None, **kw):
        y = self._decode(x, lane_addr, w, out, **kw)
        if not self.active:
            return y
        from test_gpu_wrap import rel

        from cupool.layout import unpack_bias, unpack_row
        from cupool.nvfp4 import dequantize
        from cupool.reference.moe import reference_moe
        torch.cuda.synchronize()
        pool, layout = self.pool, self.pool.layout
        addrs = lane_addr.reshape(-1).tolist()
        rows = rows_at(addrs, layout.row_bytes, x.device)
        bank = pool.bank.rows
        lo, hi = bank.data_ptr(), bank.data_ptr() + bank.numel()
        first_staging = pool.bank.num_rows
        where, deq, bias, stale = [], [], [], 0
        for a, r, e in zip(addrs, rows, self._ids):
            if a == 0:
                where.append("pad")
                deq.append(None)
                bias.append(None)
                continue
            if lo <= a < hi:
                idx = (a - lo) // pool.bank.row_stride
                where.append("stage" if idx >= first_staging else "bank")
            else:
                where.append("host")
            stale += int(not torch.equal(r, torch.from_numpy(pool.store.row(self._layer, e).copy())))
            deq.append(tuple(dequantize(q).to(x.device) for q in unpack_row(layout, r)))
            bias.append(tuple(b.to(x.device) for b in unpack_bias(layout, r)) if layout.bias
                        else None)
        T = x.shape[0]
        ids = torch.tensor([i if d is not None else -1 for i, d in enumerate(deq)],
                           device=x.device).reshape(T, -1)
        ref = reference_moe(x, ids, w, deq, activation=pool.gemm.activation,
                            biases=bias if layout.bias else None)
        err = rel(y, ref)
        self.records.append(dict(layer=self._layer, err=err, where=where, experts=self._ids,
                                 stale_rows=stale, w=w.reshape(-1).float().tolist()))
        return y


def routing_report(routes: dict, ref_routes: dict, logits, ref_logits, start: int) -> None:
    """Per decode step: its logit error and the layers whose chosen experts differ from the
    reference's at that position, with how far apart the swapped experts' reference router
    logits are (test_gpu_wrap.router_ties' measure)."""
    from test_gpu_wrap import rel
    from tiny_models import swap_gap
    for i in range(logits.shape[1]):
        pos = start + i
        err = rel(logits[:, i], ref_logits[:, i])
        swaps = []
        for layer, (lg, chosen) in sorted(ref_routes.items()):
            got, want = set(routes[layer][1][pos].tolist()), set(chosen[pos].tolist())
            if got != want:
                gap = swap_gap(lg[pos], got, want)
                swaps.append(f"layer {layer} {sorted(want)} -> {sorted(got)} gap {gap:.4f}")
        print(f"step {i:2d} err {err:.4f} routing {'; '.join(swaps) or 'same'}")


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_decode_call_matches_the_rows_it_read(family, steps=32, show=12):
    from test_gpu_wrap import greedy_eager, model_for, teacher_forced
    from tiny_models import RouterLog

    import cupool
    torch.manual_seed(0)
    model = model_for(family, seed=1)
    _, (_, E, K, H, I) = FAMILIES[family]
    pool = cupool.wrap(model, rows=max(K, E // 2), max_decode_tokens=2, max_prefill_tokens=64,
                       progress=False)
    checker = CallChecker(pool)
    prompt = torch.randint(3, 64, (1, 8), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(2))
    with torch.inference_mode():
        model(prompt)
        eng = cupool.Engine(model, pool, max_batch=1, max_len=8 + steps, eos_token_id=[])
        eng.generate([prompt[0].tolist()], cupool.SamplingParams(max_tokens=steps,
                                                                 ignore_eos=True))
        eng.close()
        pool.close()
        checker.active = True
        with RouterLog(model) as routes:
            tokens, logits = greedy_eager(model, prompt, steps)
        checker.active = False
    errors = pool.errors()
    pool.unwrap()
    recs = checker.records
    bad = [r for r in recs if r["err"] > TOL]
    stale = sum(r["stale_rows"] for r in recs)
    if bad or stale or errors:
        model.config._experts_implementation_internal = "eager"
        with torch.inference_mode(), RouterLog(model) as ref_routes:
            ref = teacher_forced(model, prompt, tokens)
        routing_report(routes.rows(), ref_routes.rows(), logits, ref, prompt.shape[1] - 1)
        for r in bad[:show]:
            print(f"layer {r['layer']} err {r['err']:.4f} rows {r['where']} experts "
                  f"{r['experts']} stale {r['stale_rows']} w {[round(v, 3) for v in r['w']]}")
    errs = [r["err"] for r in recs]
    print(f"{family}: {len(recs)} decode calls, {len(bad)} over {TOL}; error median "
          f"{statistics.median(errs):.4f} max {max(errs):.4f}; stale rows {stale}")
    assert recs, "no decode call was checked"
    assert not bad, f"{len(bad)} of {len(recs)} decode calls differ from their rows' reference"
    assert stale == 0, f"{stale} lanes read rows that differ from the host store"
    assert errors == [], errors
