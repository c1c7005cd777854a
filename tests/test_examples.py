"""Examples are tests too: argument parsing on the CPU, each example in a small mode on the GPU."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_decode_loop_args():
    m = load("decode_loop")
    a = m.parse_args([])
    assert a.layers == 8 and a.bank == 0.5 and a.routing == "locality" and not a.compile
    assert m.parse_args(["--compile"]).compile
    assert m.shape_of(m.parse_args(["--full"]))["num_hidden_layers"] == 48
    assert m.shape_of(m.parse_args(["--small"]))["num_experts"] == 8
    for bad in (["--bank", "0"], ["--bank", "1.5"], ["--tokens", "1"], ["--full", "--small"],
                ["--routing", "magic"]):
        with pytest.raises(SystemExit):
            m.parse_args(bad)


def test_hf_generate_args():
    m = load("hf_generate")
    assert m.parse_args([]).family == "qwen3_moe"
    assert m.parse_args(["--family", "mixtral", "--rows", "3"]).rows == 3
    with pytest.raises(SystemExit):
        m.parse_args(["--family", "gpt2"])


def test_budget_report_runs_on_cpu():
    r = subprocess.run([sys.executable, str(EXAMPLES / "budget_report.py"), "--budget", "80MiB",
                        "--kv-reserve", "1MiB", "--small", "--steps", "16"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rows per layer" in r.stdout and "expected hit rate" in r.stdout


def test_budget_report_too_small():
    r = subprocess.run([sys.executable, str(EXAMPLES / "budget_report.py"), "--budget", "1MiB",
                        "--small", "--steps", "8"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "too small" in lines[0], r.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("cmd", [
    ["decode_loop.py", "--small", "--tokens", "16", "--bank", "0.5"],
    ["decode_loop.py", "--small", "--tokens", "8", "--routing", "router"],
    ["hf_generate.py", "--layers", "2", "--tokens", "8"],
    ["hf_generate.py", "--family", "mixtral", "--layers", "2", "--tokens", "8"],
], ids=lambda c: " ".join(c))
def test_examples_on_gpu(cmd):
    r = subprocess.run([sys.executable, str(EXAMPLES / cmd[0]), *cmd[1:]], capture_output=True,
                       text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "tok/s" in r.stdout
