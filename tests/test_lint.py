"""Pyflakes-level checks (undefined names, unused imports) over everything, with ruff.

Much of the code only runs on a GPU; this catches its typos on a machine without one."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_no_undefined_names():
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (pip install ruff)")
    r = subprocess.run([ruff, "check", "--select", "F,E9", "--output-format", "concise",
                        "cupool", "benchmarks", "examples", "tests"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
