"""Benchmarks import and parse their arguments without a GPU (`--help`), and bench_decode redraws
its plot from a results JSON (`--plot-only`, where matplotlib is installed)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if not p.name.startswith("_"))


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script):
    r = subprocess.run([sys.executable, str(BENCH / script), "--help"], cwd=BENCH,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "usage:" in r.stdout


def test_bench_decode_plot_only(tmp_path):
    pytest.importorskip("matplotlib")
    src = BENCH / "results" / "bench_decode_compiled.json"
    res = json.loads(src.read_text())
    assert "pool-50" in res["modes"]                 # the file the README's table quotes
    dst = tmp_path / "r.json"
    shutil.copy(src, dst)
    r = subprocess.run([sys.executable, str(BENCH / "bench_decode.py"), "--plot-only", str(dst)],
                       cwd=BENCH, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "r.png").stat().st_size > 10_000


def test_ncu_source_summary(tmp_path):
    src = BENCH / "results" / "ncu_moe_decode_T1_source.csv.gz"
    r = subprocess.run([sys.executable, str(BENCH / "ncu_source.py"), str(src), "--top", "3"],
                       cwd=BENCH, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "2396 stall samples" in r.stdout and "barrier" in r.stdout
    assert len([line for line in r.stdout.splitlines() if "HMMA" in line or "BSSY" in line]) >= 1
    bad = tmp_path / "x.csv"
    bad.write_text("not,an,ncu,file\n")
    r = subprocess.run([sys.executable, str(BENCH / "ncu_source.py"), str(bad)],
                       cwd=BENCH, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "no \"Address\" header" in r.stderr


def test_profile_gemm_cases():
    sys.path.insert(0, str(BENCH))
    try:
        import profile_gemm
    finally:
        sys.path.remove(str(BENCH))
    assert profile_gemm.parse_case("2048:3") == ((2048, 768), 3)
    assert profile_gemm.parse_case("4096:16") == ((4096, 1536), 16)
    for bad in ("2048", "1024:1", "2048:0", "2048:17", "x:1"):
        with pytest.raises(SystemExit, match="--cases"):
            profile_gemm.parse_case(bad)
