"""`python -m cupool`: a user's mistake ends in one line on stderr and exit code 2 (never a
traceback); `simulate` and `plan` work without a GPU; trace files are validated when read."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cupool import __main__ as cli
from cupool import trace as tr

ROOT = Path(__file__).resolve().parent.parent


def run(*argv, capsys=None):
    """In-process: (exit code, stdout, stderr)."""
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def one_line_error(rc, err, *words):
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2, (rc, err)
    assert len(lines) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in lines[0], (w, lines[0])


def parse_error(capsys, *argv):
    with pytest.raises(SystemExit) as e:
        cli.main(list(argv))
    _, err = capsys.readouterr()
    one_line_error(e.value.code, err)
    return err


@pytest.mark.parametrize("argv,word", [
    (["simulate", "--rows", "0"], "--rows"),
    (["simulate", "--layers", "-2"], "--layers"),
    (["simulate", "--steps", "0"], "--steps"),
    (["simulate", "--top-k", "0"], "--top-k"),
    (["simulate", "--prefetch-accuracy", "1.5"], "--prefetch-accuracy"),
    (["simulate", "--prefetch-accuracy", "0.8", "--prefetch-rows", "0"], "--prefetch-rows"),
    (["simulate", "--steps", "x"], "--steps"),
    (["simulate", "--streams", "0"], "--streams"),
    (["simulate", "--promote", "-1"], "--promote"),
    (["simulate", "--promote", "some"], "'auto' or an integer >= 0"),
    (["plan", "--model", "/no/such/dir"], "no such directory"),
    (["plan"], "--model"),
    (["generate", "--model", "."], "--prompt"),
    (["generate", "--model", ".", "--prompt", "hi", "--host-experts", "--host-threads", "0"],
     "--host-threads"),
    (["generate", "--model", ".", "--prompt", "hi", "--host-experts", "--host-min-misses", "-1"],
     "--host-min-misses"),
    (["generate", "--model", ".", "--prompt", "hi", "--host-experts", "--host-prefill-tokens",
      "-1"], "--host-prefill-tokens"),
    (["serve", "--model", ".", "--host-experts", "--no-host-experts"],
     "argument --no-host-experts: not allowed with argument --host-experts"),
    (["serve", "--model", ".", "--host-leave"], "unrecognized arguments: --host-leave"),
    (["nonsense"], "invalid choice"),
])
def test_bad_arguments_are_one_line(capsys, argv, word):
    assert word in parse_error(capsys, *argv)


@pytest.mark.parametrize("extra,words", [
    (["--host-threads", "4"], "--host-threads applies with --host-experts"),
    (["--host-leave"], "--host-leave applies with --host-experts"),
    (["--host-min-misses", "9"], "--host-min-misses applies with --host-experts"),
    (["--host-prefill-tokens", "64"], "--host-prefill-tokens applies with --host-experts"),
    (["--host-experts", "--device", "cpu"], "--host-experts applies to a CUDA device"),
    (["--quantize-attention", "--device", "cpu"], "--quantize-attention applies to a CUDA device"),
    (["--quantize-attention", "--no-fused"], "--quantize-attention is for the fused decode step"),
])
def test_generate_host_experts_arguments(tmp_path, capsys, extra, words):
    """Checked before anything loads: one line, exit code 2."""
    rc, _, err = run("generate", "--model", str(tmp_path), "--prompt", "hi", *extra, capsys=capsys)
    one_line_error(rc, err, words)


def test_simulate_rows_and_warmup_checked_against_the_trace(capsys):
    rc, _, err = run("simulate", "--rows", "4", "--top-k", "8", "--steps", "20", capsys=capsys)
    one_line_error(rc, err, "--rows 4", "top_k=8")
    rc, _, err = run("simulate", "--steps", "10", "--warmup", "10", capsys=capsys)
    one_line_error(rc, err, "--warmup 10", "10 steps")
    rc, _, err = run("simulate", "--experts", "4", "--top-k", "8", capsys=capsys)
    one_line_error(rc, err, "--top-k 8", "--experts 4")
    rc, _, err = run("simulate", "--prefetch-rows", "2", capsys=capsys)
    one_line_error(rc, err, "--prefetch-rows 2", "--prefetch-accuracy")


def test_simulate_runs(capsys):
    rc, out, _ = run("simulate", "--steps", "40", "--layers", "3", "--experts", "16", "--top-k",
                     "2", "--rows", "4", "16", capsys=capsys)
    assert rc == 0
    assert "rows/layer     4" in out and "rows/layer    16" in out and "hit rate 1.000" in out
    lru = float(out.split("hit rate ")[1].split()[0])
    opt = float(out.split("knows the trace's future: ")[1].split(")")[0])
    assert lru < opt <= 1.0                      # 4 of 16 experts: LRU misses what the optimum keeps


def test_simulate_several_streams_with_the_pools_cap(capsys):
    """--streams B: B independent streams a step; --promote auto (default) is the pool's cap
    (here 32 lanes over 8 rows a layer: at most 2 promotions a step), --promote 0 none."""
    argv = ("simulate", "--steps", "40", "--layers", "3", "--experts", "32", "--top-k", "4",
            "--rows", "8", "--streams", "8")
    rc, out, _ = run(*argv, capsys=capsys)
    assert rc == 0 and "tokens/step=8" in out and "[LRU, at most 2 promotions a step]" in out
    capped = float(out.split("hit rate ")[1].split()[0])
    rc, out, _ = run(*argv, "--promote", "0", capsys=capsys)
    assert rc == 0 and "[LRU]" in out
    assert float(out.split("hit rate ")[1].split()[0]) < capped
    rc, out, _ = run(*argv[:-2], "--promote", "3", capsys=capsys)   # one stream: 4 lanes
    assert rc == 0 and "[LRU, at most 3 promotions a step]" in out


def test_simulate_streams_need_a_synthetic_trace(capsys, tmp_path):
    t = tr.synthetic(12, 2, 16, 2, seed=1)
    t.save(tmp_path / "t.npz")
    rc, _, err = run("simulate", "--trace", str(tmp_path / "t.npz"), "--streams", "2",
                     capsys=capsys)
    one_line_error(rc, err, "--streams 2", "trace file")


def test_simulate_with_prefetch(capsys):
    rc, out, _ = run("simulate", "--steps", "40", "--layers", "3", "--experts", "16", "--top-k",
                     "2", "--rows", "4", "--prefetch-accuracy", "0.8", capsys=capsys)
    assert rc == 0
    assert "with prefetch at 0.8 accuracy (reference model): hit rate" in out
    plain = float(out.split("hit rate ")[1].split()[0])
    prefetched = float(out.split("hit rate ")[2].split(";")[0])
    assert prefetched > plain
    rc, capped, _ = run("simulate", "--steps", "40", "--layers", "3", "--experts", "16",
                        "--top-k", "2", "--rows", "4", "--prefetch-accuracy", "0.8",
                        "--prefetch-rows", "1", capsys=capsys)
    assert rc == 0 and "at most 1 row(s) a prefetch (reference model)" in capped
    rows = lambda text: float(text.split("; a step: ")[1].split()[0])     # rows prefetched
    assert rows(capped) < rows(out)


def _npz(path, **arrays):
    np.savez(path, **arrays)
    return str(path)


@pytest.mark.parametrize("make,words", [
    (lambda p: str(p / "missing.npz"), ["no such trace file"]),
    (lambda p: (p / "t.npz").write_bytes(b"PK\x03\x04 truncated") and str(p / "t.npz"),
     ["not a readable .npz trace"]),
    (lambda p: _npz(p / "o.npz", weights=np.zeros(3)), ["not a cupool routing trace"]),
    (lambda p: _npz(p / "f.npz", ids=np.zeros((4, 2, 1, 2), np.float32), num_experts=8),
     ["must be integers"]),
    (lambda p: _npz(p / "b.npz", ids=np.full((4, 2, 1, 2), 2**33), num_experts=8),
     ["outside [-1, 8)"]),
    (lambda p: _npz(p / "s.npz", ids=np.zeros((4, 2), np.int32), num_experts=8),
     ["[steps, layers, tokens, top_k]"]),
])
def test_bad_trace_files_are_one_line(tmp_path, capsys, make, words):
    path = make(tmp_path)
    rc, _, err = run("simulate", "--trace", path, capsys=capsys)
    one_line_error(rc, err, *words)


def test_a_saved_trace_round_trips(tmp_path, capsys):
    t = tr.uniform(12, 2, 8, 2, seed=1)
    p = t.save(tmp_path / "u.npz")
    assert np.array_equal(tr.Trace.load(p).ids, t.ids)
    rc, out, _ = run("simulate", "--trace", str(p), "--rows", "8", "--warmup", "2", capsys=capsys)
    assert rc == 0 and "hit rate 1.000" in out


def test_info_without_a_gpu_is_a_clean_message():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: info succeeds")
    r = subprocess.run([sys.executable, "-m", "cupool", "info"], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "needs a CUDA GPU" in r.stdout


@pytest.fixture
def qwen_dir(tmp_path):
    pytest.importorskip("transformers")
    from tiny_models import hf_model
    d = tmp_path / "qwen"
    hf_model("qwen3_moe", seed=2, dtype=torch.bfloat16).save_pretrained(d)
    return d


def test_plan_from_headers(qwen_dir, capsys):
    rc, out, _ = run("plan", "--model", str(qwen_dir), "--budget", "1GiB", "--context", "64",
                     capsys=capsys)
    assert rc == 0, out
    assert "3 MoE layers of 8 experts (top-2)" in out
    assert "8 rows per layer (100% of the experts" in out and "fits" in out
    rc, out, _ = run("plan", "--model", str(qwen_dir), "--budget", "2MiB", capsys=capsys)
    assert rc == 1 and "does not fit" in out and "at least" in out
    rc, out, _ = run("plan", "--model", str(qwen_dir), "--context", "65", capsys=capsys)
    assert rc == 1 and "max_position_embeddings (64)" in out


def test_plan_budget_must_parse(qwen_dir, capsys):
    err = parse_error(capsys, "plan", "--model", str(qwen_dir), "--budget", "lots")
    assert "--budget" in err and "lots" in err


def test_plan_names_a_bad_checkpoint(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    rc, _, err = run("plan", "--model", str(tmp_path), capsys=capsys)
    one_line_error(rc, err)
