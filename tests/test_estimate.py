"""`cupool.estimate`: its constants are what the H200's benchmark results give, it reproduces
those measurements within 15 %, and `cupool plan` prints it for a GPU (CPU tests)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cupool import estimate as est

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


@pytest.fixture(scope="module")
def results():
    pytest.importorskip("transformers")
    decode, serve, gemm = est.load_results(RESULTS)
    return decode, serve, gemm, est.bench_shape(decode["shape"])


def test_constants_are_the_fit_of_the_results(results):
    """H200 holds what `fit` gets from benchmarks/results (after a re-measurement: run
    `python -m cupool.estimate` and copy its constants into estimate.H200)."""
    got = est.fit(*results[:3], shape=results[3])
    assert got.hbm_eff == pytest.approx(est.H200.hbm_eff, abs=1e-3)
    assert got.pcie_eff == pytest.approx(est.H200.pcie_eff, abs=1e-3)
    assert set(got.layer_s) == set(est.H200.layer_s) == {"fused", "fused-resident", "compiled"}
    for mode, s in est.H200.layer_s.items():
        assert got.layer_s[mode] == pytest.approx(s, rel=2e-3), mode


def test_fit_needs_both_fused_steps(results):
    """Without a resident bank's run (the step that skips the plan step) there is nothing to fit
    "fused-resident" to: fit says so rather than leaving the constant out."""
    decode, serve, gemm, shape = results
    partial = dict(serve, banks=[b for b in serve["banks"] if b["bank"] < 1.0])
    with pytest.raises(ValueError, match="no single-stream case of the fused-resident step"):
        est.fit(decode, partial, gemm, shape=shape)


def test_estimate_reproduces_the_h200_measurements(results):
    """Resident, 25/50/100 % banks under uniform and locality routing (compiled), one stream of
    the Engine with its fused step (resident, its plan step skipped, and a 50% bank): every
    estimate within 15 % of the measured tok/s. The fused step's two constants are fitted to
    one row each, so the compiled rows are what test the model."""
    decode, serve, _, shape = results
    h200 = est.find_gpu("NVIDIA H200")
    points = est.measured_points(decode, serve)
    assert len(points) == 9
    assert [m for _, m, _, _ in points[-2:]] == ["fused-resident", "fused"]
    for what, mode, hit, measured in points:
        got = est.estimate(h200, hit_rate=hit, mode=mode, **shape).tok_per_s
        assert abs(got / measured - 1) < 0.15, (what, got, measured)


def test_qwen3_bench_shape_reads():
    """The benchmarks' Qwen3-30B-A3B shape: 2.46 GB of dense weights a token (the 0.62 GB input
    embedding is not read), 384 rows of 2.65 MB."""
    pytest.importorskip("transformers")
    from cupool.synthetic import QWEN3_30B_A3B
    s = est.bench_shape(QWEN3_30B_A3B)
    assert s["row_bytes"] == 2654464 and (s["topk"], s["moe_layers"], s["layers"]) == (8, 48, 48)
    assert s["dense_bytes"] == pytest.approx(2.46e9, rel=0.01)


def test_the_model_adds_bytes_fixed_time_and_misses():
    gpu = est.GPU("test", 1000, 4)
    cal = est.Calibration(0.5, 0.5, {"fused": 1e-4, "compiled": 2e-4}, "made up")
    e = est.estimate(gpu, dense_bytes=1e9, row_bytes=1e6, topk=4, moe_layers=10, layers=12,
                     hit_rate=0.75, cal=cal)
    assert e.mem_bytes == 1e9 + 40e6 and e.pcie_bytes == pytest.approx(10e6)
    assert e.parts_s["memory"] == pytest.approx(1.04e9 / 500e9)
    assert e.parts_s["fixed"] == pytest.approx(12e-4)
    assert e.parts_s["pcie"] == pytest.approx(10e6 / (0.5 * 16 * 1.969e9))
    assert e.tok_per_s == pytest.approx(1 / sum(e.parts_s.values()))
    with pytest.raises(ValueError, match="hit_rate must be in"):
        est.estimate(gpu, dense_bytes=1, row_bytes=1, topk=1, moe_layers=1, layers=1,
                     hit_rate=1.5)


def test_dense_read_bytes_skips_an_untied_input_embedding():
    dense = {"model.embed_tokens.weight": 100, "lm_head.weight": 100, "model.norm.weight": 1}
    assert est.dense_read_bytes(dense, tied=False) == 101
    assert est.dense_read_bytes({"model.embed_tokens.weight": 100}, tied=True) == 100


@pytest.mark.parametrize("name,want", [("RTX 3090", "RTX 3090"), ("rtx-4090", "RTX 4090"),
                                       ("NVIDIA GeForce RTX 5090", "RTX 5090"),
                                       ("rtx pro 6000", "RTX PRO 6000"), ("a100", "A100"),
                                       ("NVIDIA H200", "H200")])
def test_table_gpus_by_name(name, want):
    assert est.find_gpu(name).name == want


def test_unknown_gpu_lists_the_table():
    with pytest.raises(ValueError, match="unknown GPU 'TPU v5': one of RTX 3090, .*H200"):
        est.find_gpu("TPU v5")


def test_pcie_generations():
    assert est.find_gpu("RTX 3090").pcie_GBps == pytest.approx(31.5, abs=0.1)
    assert est.find_gpu("RTX 5090").pcie_GBps == pytest.approx(63.0, abs=0.1)


@pytest.fixture
def qwen_dir(tmp_path):
    pytest.importorskip("transformers")
    from tiny_models import hf_model
    d = tmp_path / "qwen"
    hf_model("qwen3_moe", seed=2, dtype=torch.bfloat16).save_pretrained(d)
    return d


def _plan(capsys, *argv):
    from cupool import __main__ as cli
    rc = cli.main(["plan", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_plan_prints_the_estimate_for_a_gpu(qwen_dir, capsys):
    rc, out, _ = _plan(capsys, "--model", str(qwen_dir), "--budget", "3.99MiB", "--context",
                       "64", "--gpu", "rtx-3090", "--hit-rate", "0.5")
    assert rc == 0, out
    speed = out[out.index("speed"):]
    assert "ESTIMATE for RTX 3090 (memory 936 GB/s, PCIe Gen4 x16 31.5 GB/s)" in speed
    assert "hit rate 0.50 (--hit-rate)" in speed and "not a measurement" in speed
    tok = [float(w[1:]) for w in speed.split() if w.startswith("~")]
    assert len(tok) == 2 and tok[0] > tok[1] > 0                   # fused, compiled


def test_plan_estimates_each_bank_with_its_step(qwen_dir, capsys, monkeypatch):
    """A bank that holds every expert is estimated with the fused step that skips the plan step
    ("fused-resident", fewer launches: a smaller fixed time a layer on the H200), a partial bank
    with the one that runs it; the compiled forward beside either."""
    assert est.H200.layer_s["fused-resident"] < est.H200.layer_s["fused"]
    calls = []
    real = est.estimate

    def spy(gpu, **kw):
        calls.append((kw["mode"], kw["hit_rate"]))
        return real(gpu, **kw)

    monkeypatch.setattr(est, "estimate", spy)
    for budget, extra in (("1GiB", ()), ("3.99MiB", ("--hit-rate", "0.5"))):
        rc, out, _ = _plan(capsys, "--model", str(qwen_dir), "--budget", budget, "--context",
                           "64", "--gpu", "rtx-4090", *extra)
        assert rc == 0, out
    assert calls == [("fused-resident", 1.0), ("compiled", 1.0), ("fused", 0.5),
                     ("compiled", 0.5)]


def test_plan_without_a_gpu_asks_for_one(qwen_dir, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: plan estimates for it")
    rc, out, _ = _plan(capsys, "--model", str(qwen_dir), "--budget", "1GiB", "--context", "64")
    assert rc == 0 and "give --gpu NAME (RTX 3090," in out


def test_plan_refuses_an_unknown_gpu_in_one_line(qwen_dir, capsys):
    with pytest.raises(SystemExit) as e:
        _plan(capsys, "--model", str(qwen_dir), "--budget", "1GiB", "--gpu", "TPU")
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and "unknown GPU 'TPU'" in err
