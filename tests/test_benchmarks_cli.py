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
    src = BENCH / "results" / "bench_decode.json"
    res = json.loads(src.read_text())
    assert "pool-50" in res["modes"]                 # the file the README's table quotes
    dst = tmp_path / "r.json"
    shutil.copy(src, dst)
    r = subprocess.run([sys.executable, str(BENCH / "bench_decode.py"), "--plot-only", str(dst)],
                       cwd=BENCH, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "r.png").stat().st_size > 10_000


def _ncu_csv(path: Path, rows) -> None:
    """An ncu --page source --csv file: a log line, the header, then (address, SASS, samples,
    executed, {reason: samples}) rows and a log line between them (as the profiled program
    prints), gzip-compressed."""
    import csv
    import gzip
    import io
    reasons = ("barrier", "long_sb", "math", "wait")
    cols = (["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed"]
            + [f"stall_{r}" for r in reasons] + [f"stall_{r} (Not Issued)" for r in reasons])
    buf = io.StringIO()
    buf.write("==PROF== Connected to process 1\n")
    w = csv.writer(buf, quoting=csv.QUOTE_ALL)
    w.writerow(cols)
    for i, (addr, sass, samples, executed, why) in enumerate(rows):
        w.writerow([addr, sass, samples, executed] + [why.get(r, 0) for r in reasons]
                   + [0] * len(reasons))
        if i == 0:
            buf.write("a line the program printed\n")
    path.write_bytes(gzip.compress(buf.getvalue().encode()))


def test_ncu_source_summary(tmp_path):
    src = tmp_path / "source.csv.gz"
    _ncu_csv(src, [("0x7f00", "      HMMA.16816.F32 R4, R8, R12, R4", 30, 100,
                    {"long_sb": 20, "math": 10}),
                   ("0x7f10", "      BAR.SYNC.DEFER_BLOCKING 0x0", 50, 10, {"barrier": 50}),
                   ("0x7f20", "      IADD3 R1, R1, 0x1, RZ", 0, 1000, {})])
    r = subprocess.run([sys.executable, str(BENCH / "ncu_source.py"), str(src), "--top", "2"],
                       cwd=BENCH, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    assert "3 SASS instructions, 1110 warp instructions executed, 80 stall samples" in out
    assert "barrier" in out and "62.5%" in out                  # 50 of 80 samples
    top = out.split("top 2 instructions")[1].splitlines()[1:]
    assert "BAR.SYNC" in top[0] and "HMMA" in top[1] and len(top) == 2
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
