"""Benchmarks and examples as commands on a machine without a GPU: `--help` works; a run with
valid arguments ends in one line on stderr saying a CUDA GPU is needed, exit code 2; a user's
mistake in an argument ends in one line naming the argument, exit code 2, never a traceback. Also:
reduced runs write no canonical results file, bench_decode redraws its plot from a results JSON
(`--plot-only`, where matplotlib is installed), and ncu_source.py summarises an ncu CSV.

Every script runs as a subprocess at least once (GPUs hidden: CUDA_VISIBLE_DEVICES=""), all of
them in parallel, once for the module; each costs torch's import, so the full list of mistakes
runs in this process through `cupool.cli.run`, the same path as the scripts' `__main__`, and a
representative part of it as subprocesses too."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cupool import cli

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
EXAMPLES = ROOT / "examples"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if not p.name.startswith("_"))
EXAMPLE_SCRIPTS = ("budget_report.py", "decode_loop.py", "hf_generate.py")
MINE = ("bench_store.py", "bench_nvfp4.py", "bench_planner.py", "bench_gemm.py", "bench_decode.py",
        "bench_long.py", "bench_prefix.py", "bench_ngram.py",
        "profile_attention.py", "profile_chain.py", "profile_decode.py", "profile_gemm.py",
        "profile_host.py",
        "profile_read.py", "bench_host_experts.py", "probe_host_handoff.py",
        "bench_first_request.py", "ncu_source.py") + EXAMPLE_SCRIPTS


def where(script: str) -> Path:
    return (EXAMPLES if script in EXAMPLE_SCRIPTS else BENCH) / script


# every GPU benchmark and example with valid arguments: one line, "needs a CUDA GPU", exit 2
NEEDS_GPU = [
    ["bench_store.py"],
    ["bench_nvfp4.py", "--dtype", "fp16"],
    ["bench_planner.py", "--skip-copy", "--lanes", "16"],
    ["bench_gemm.py", "--layers", "8", "--scratch", "32x2", "48x3"],
    ["bench_decode.py", "--small", "--compile"],
    ["bench_decode.py", "--model", "gpt-oss-120b", "--small"],
    ["bench_decode.py", "--model", "qwen4_exp", "--small"],
    ["bench_ngram.py", "--table", "1GiB", "--batches", "1", "4"],
    ["bench_long.py", "--contexts", "4096", "--soak-steps", "96"],
    ["bench_prefix.py", "--small", "--profile"],
    ["bench_first_request.py", "--prompts", "16", "512", "--bank", "1", "--profile", "2"],
    ["profile_decode.py", "--layers", "2", "--context", "4096"],
    ["profile_decode.py", "--layers", "2", "--batch", "8", "--active", "1"],
    ["profile_decode.py", "--layers", "2", "--batch", "8", "--active", "3", "--narrow"],
    ["profile_decode.py", "--model", "gpt-oss-120b", "--layers", "2", "--ablate"],
    ["profile_attention.py", "--contexts", "80", "4096", "--min-chunk", "64", "256"],
    ["profile_chain.py", "--launches", "96", "--grids", "8", "396"],
    ["profile_gemm.py", "--sweep", "minb=4", "default"],
    ["profile_host.py", "--tokens", "64"],
    ["profile_read.py", "--skip-decode"],
    ["probe_host_handoff.py", "--experts-per-layer", "0", "1"],
    ["decode_loop.py", "--small", "--bank", "1"],
    ["hf_generate.py", "--family", "mixtral"],
]

# a user's mistake: (command, what the one line names); these run as subprocesses and in this
# process, the list after them in this process only; every script at least once
BAD_SUBPROCESS = [
    (["bench_store.py", "--rows", "0"], "--rows"),
    (["bench_gemm.py", "--layers", "-2"], "--layers"),
    (["bench_planner.py", "--lanes", "12"], "--lanes"),                  # not a multiple of top-8
    (["bench_decode.py", "--plot-only", "benchmarks/run_gpu.sh"], "--plot-only"),   # not JSON
    (["bench_long.py", "--contexts", "8"], "--contexts"),
    (["profile_chain.py", "--grids", "0"], "--grids"),
    (["bench_prefix.py", "--prefix", "8"], "--prefix"),
    (["bench_ngram.py", "--table", "lots"], "--table"),
    (["budget_report.py", "--budget", "lots"], "--budget"),
    (["decode_loop.py", "--tokens", "-3"], "--tokens"),
    (["decode_loop.py", "--bank", "1.5"], "--bank"),                     # a fraction, (0, 1]
    (["bench_host_experts.py", "--threads", "0"], "--threads"),
    (["bench_first_request.py", "--prompts", "0"], "--prompts"),
]
BAD = BAD_SUBPROCESS + [
    (["bench_store.py", "--sizes", "1MiB", "lots"], "--sizes"),
    (["bench_store.py", "--sizes", "17"], "--sizes"),                    # not whole 16 bytes
    (["bench_nvfp4.py", "--hidden", "100"], "--hidden"),
    (["bench_nvfp4.py", "--params", "-1"], "--params"),
    (["bench_planner.py", "--copy-sweep", "2,0,4"], "--copy-sweep"),
    (["bench_planner.py", "--experts", "4"], "--experts"),               # fewer than top-8
    (["bench_planner.py", "--skip-plan", "--skip-copy"], "--skip"),
    (["bench_gemm.py", "--scratch", "32"], "--scratch"),
    (["bench_gemm.py", "--dims", "2048x700"], "--dims"),
    (["bench_gemm.py", "--decode-tokens", "0"], "--decode-tokens"),
    (["bench_gemm.py", "--name", "../elsewhere"], "--name"),
    (["bench_decode.py", "--tokens", "1"], "--tokens"),
    (["bench_decode.py", "--repeats", "0"], "--repeats"),
    (["bench_decode.py", "--modes", "pool-75"], "--modes"),
    (["bench_decode.py", "--json", "no/such/dir/r.json"], "--json"),
    (["bench_decode.py", "--plot-only", "no-such.json"], "--plot-only"),
    (["bench_decode.py", "--model", "gpt-oss-20b"], "--model"),
    (["bench_decode.py", "--model", "gpt-oss-120b", "--modes", "hf-bf16"], "hf-bf16"),
    (["bench_decode.py", "--modes", "pool-prefetch", "--prefetch-accuracy", "1.5"],
     "--prefetch-accuracy"),
    (["bench_decode.py", "--prefetch-banks", "150"], "--prefetch-banks"),
    (["bench_serve.py", "--prefetch", "trace", "--routing", "router"], "--routing locality"),
    (["bench_serve.py", "--prefetch", "router", "--prefetch-accuracy", "2"], "--prefetch-accuracy"),
    (["bench_serve.py", "--promote", "often"], "--promote"),
    (["bench_serve.py", "--host-experts", "--prefetch", "router"], "--host-experts and --prefetch"),
    (["bench_serve.py", "--host-experts", "--host-threads", "0"], "--host-threads"),
    (["bench_serve.py", "--no-host-experts", "--host-baseline"],
     "--host-baseline applies to host experts, which --no-host-experts turns off"),
    (["bench_serve.py", "--prefetch", "router", "--host-baseline"],
     "--host-baseline applies to host experts, which --prefetch turns off"),
    (["bench_serve.py", "--host-experts", "--no-host-experts"],
     "not allowed with argument --host-experts"),
    (["bench_serve.py", "--host-leave"], "unrecognized arguments: --host-leave"),
    (["bench_serve.py", "--no-host-experts", "--host-promote"],
     "--host-promote applies to host experts, which --no-host-experts turns off"),
    (["bench_serve.py", "--no-host-experts", "--host-threads", "4"],
     "--host-threads applies to host experts, which --no-host-experts turns off"),
    (["bench_serve.py", "--host-experts", "--handoff-us", "-1"], "--handoff-us"),
    (["bench_serve.py", "--host-min-misses", "-2"], "--host-min-misses"),
    (["bench_serve.py", "--no-host-experts", "--host-min-misses", "9"],
     "--host-min-misses applies to host experts, which --no-host-experts turns off"),
    (["bench_serve.py", "--host-prefill-tokens", "-1"], "--host-prefill-tokens"),
    (["bench_serve.py", "--no-host-experts", "--host-prefill-tokens", "64"],
     "--host-prefill-tokens applies to host experts, which --no-host-experts turns off"),
    (["profile_decode.py", "--host-experts", "--host-prefill-tokens", "64"],
     "unrecognized arguments: --host-prefill-tokens"),
    (["bench_serve.py", "--slots", "4", "--streams", "1", "8"],
     "--slots must be at least the largest --streams (8), got 4"),
    (["bench_serve.py", "--slots", "0"], "--slots"),
    (["bench_serve.py", "--late-prompt", "0"], "--late-prompt"),
    (["bench_serve.py", "--held-context", "0"], "--held-context"),
    (["bench_serve.py", "--streams", "8", "16", "--held-context", "64"],
     "--held-context fills the slots the streams leave free, and no case has any (--streams 8 16 "
     "in serve's default slots)"),
    (["bench_serve.py", "--streams", "4", "--slots", "4", "--held-context", "64"],
     "no case has any (--streams 4 in --slots 4)"),
    (["bench_serve.py", "--slots", "8", "--streams", "1", "--held-context", "8192"],
     "--held-context is 8192: a slot of the Qwen3-30B-A3B shape holds 4096"),
    (["bench_serve.py", "--late-prompt", "4090"], "--late-prompt is 4090"),
    (["sim_policies.py", "--parts", "lru"], "--parts"),
    (["bench_host_experts.py", "--isa", "sse"], "--isa"),
    (["bench_host_experts.py", "--experts", "8", "--rows", "9"], "--rows"),
    (["bench_host_experts.py", "--hidden", "100"], "--hidden"),
    (["bench_host_experts.py", "--busy", "-1"], "--busy"),
    (["probe_host_handoff.py", "--layers", "0"], "--layers"),
    (["bench_long.py", "--bank", "5"], "--bank"),
    (["bench_ngram.py", "--batches", "0"], "--batches"),
    (["bench_long.py", "--soak-steps", "0"], "--soak-steps"),
    (["bench_prefix.py", "--new", "0"], "--new"),
    (["bench_first_request.py", "--bank", "1.5"], "--bank"),
    (["bench_first_request.py", "--max-batch", "0"], "--max-batch"),
    (["bench_prefix.py", "--bank", "3"], "--bank"),
    (["bench_prefix.py", "--scratch-buffers", "0"], "--scratch-buffers"),
    (["bench_prefix.py", "--host-threads", "2"], "--host-threads applies with --host-experts"),
    (["bench_prefix.py", "--host-prefill-tokens", "64"],
     "--host-prefill-tokens applies with --host-experts"),
    (["bench_prefix.py", "--host-experts", "--host-prefill-tokens", "0"],
     "--host-prefill-tokens"),
    (["bench_prefix.py", "--host-experts", "--host-threads", "0"], "--host-threads"),
    (["profile_decode.py", "--steps", "0"], "--steps"),
    (["profile_decode.py", "--active", "0"], "--active"),
    (["profile_decode.py", "--batch", "4", "--active", "5"],
     "--active 5 is more than the --batch 4 slots"),
    (["profile_decode.py", "--batch", "8", "--narrow"],
     "--narrow profiles the step of --active N of the --batch slots: give --active"),
    (["profile_decode.py", "--layers", "-2"], "--layers"),
    (["profile_decode.py", "--bank", "101"], "--bank"),
    (["profile_decode.py", "--context", "8"], "--context"),
    (["profile_decode.py", "--prefetch", "trace"], "--bank below 100"),
    (["profile_decode.py", "--bank", "50", "--prefetch-copiers", "bulk:4:32:4"],
     "--prefetch trace"),
    (["profile_decode.py", "--bank", "50", "--prefetch", "trace",
      "--prefetch-copiers", "bulk:4:32"], "--prefetch-copiers"),
    (["profile_decode.py", "--prefetch-rows", "0"], "--prefetch-rows"),
    (["profile_decode.py", "--overlap-copies"], "--overlap-copies needs --bank below 100"),
    (["profile_decode.py", "--model", "gpt-oss-120b", "--dense-nvfp4"],
     "--dense-nvfp4 builds the qwen3-30b-a3b shape only"),
    (["profile_decode.py", "--model", "gpt-oss-20b"], "--model"),
    (["bench_serve.py", "--prefetch", "trace", "--prefetch-rows", "0"], "--prefetch-rows"),
    (["profile_attention.py", "--min-chunk", "100"], "--min-chunk"),
    (["profile_attention.py", "--contexts", "0"], "--contexts"),
    (["profile_attention.py", "--layers", "0"], "--layers"),
    (["profile_chain.py", "--launches", "1"], "--launches"),
    (["profile_gemm.py", "--cases", "2048:17"], "--cases"),
    (["profile_gemm.py", "--sweep", "stage=2"], "--sweep"),
    (["profile_gemm.py", "--prefill-sweep", "NB=x"], "--prefill-sweep"),
    (["profile_gemm.py", "--trace", "1", "--sweep"], "--sweep"),         # one diagnostic a run
    (["profile_gemm.py", "--route-trace", "1", "--hidden", "2880"], "--route-trace"),  # a router bias
    (["profile_host.py", "--calls", "many"], "--calls"),
    (["profile_read.py", "--experts", "8"], "--experts"),
    (["ncu_source.py", "--top", "0", "x.csv"], "--top"),
    (["ncu_source.py", "no-such.csv"], "csv"),
    (["budget_report.py", "--budget", "1GiB", "--steps", "0"], "--steps"),
    (["budget_report.py", "--budget", "1GiB", "--trace", "no-such.npz"], "--trace"),
    (["decode_loop.py", "--bank", "0"], "--bank"),
    (["decode_loop.py", "--budget", "lots"], "--budget"),
    (["decode_loop.py", "--layers", "-2"], "--layers"),
    (["hf_generate.py", "--layers", "-2"], "--layers"),
    (["hf_generate.py", "--family", "deepseek_v3", "--layers", "1"], "--layers"),  # first is dense
    (["hf_generate.py", "--rows", "1"], "--rows"),                       # fewer than top-k
]

HELP = [[s, "--help"] for s in SCRIPTS]


def key(cmd) -> str:
    return " ".join(cmd)


def _run(cmd) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, str(where(cmd[0])), *cmd[1:]], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module")
def ran() -> dict[str, subprocess.CompletedProcess]:
    """Every subprocess command of this file, run once, in parallel."""
    cmds = HELP + NEEDS_GPU + [c for c, _ in BAD_SUBPROCESS]
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        return dict(zip(map(key, cmds), pool.map(_run, cmds)))


def one_line(stderr: str, rc: int, script: str) -> str:
    """The single stderr line of a command that ended on a user's mistake."""
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr[-3000:]
    assert rc == 2, (rc, stderr)
    assert lines[0].startswith(f"{script}: error: "), lines[0]
    return lines[0]


def load(script: str):
    """A script as a module (its `__main__` block not run)."""
    path = where(script)
    sys.path.insert(0, str(path.parent))
    try:
        spec = importlib.util.spec_from_file_location(f"cli_{path.stem}", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod                   # dataclasses look their module up
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(path.parent))
    return mod


def in_process(cmd, monkeypatch) -> int:
    """`cmd` through cupool.cli.run, as the script's `__main__` does; its exit code."""
    monkeypatch.chdir(ROOT)
    mod = load(cmd[0])
    try:
        return cli.run(mod.main, mod.build_parser(), cmd[1:])
    except SystemExit as e:                       # argparse's own exit, as in the script
        return e.code


@pytest.mark.parametrize("cmd", HELP, ids=key)
def test_help(ran, cmd):
    r = ran[key(cmd)]
    assert r.returncode == 0, r.stderr[-2000:]
    assert "usage:" in r.stdout


@pytest.mark.parametrize("script", EXAMPLE_SCRIPTS)
def test_help_examples(script, capsys):
    with pytest.raises(SystemExit) as e:
        load(script).build_parser().parse_args(["--help"])
    assert e.value.code == 0 and "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("cmd", NEEDS_GPU, ids=key)
def test_needs_gpu_in_one_line(ran, cmd):
    r = ran[key(cmd)]
    assert "needs a CUDA GPU" in one_line(r.stderr, r.returncode, cmd[0])


@pytest.mark.parametrize("cmd,names", BAD, ids=[key(c) for c, _ in BAD])
def test_bad_argument_in_one_line(cmd, names, monkeypatch, capsys):
    rc = in_process(cmd, monkeypatch)
    line = one_line(capsys.readouterr().err, rc, cmd[0])
    assert names in line and "needs a CUDA GPU" not in line, line


@pytest.mark.parametrize("cmd,names", BAD_SUBPROCESS, ids=[key(c) for c, _ in BAD_SUBPROCESS])
def test_bad_argument_in_one_line_subprocess(ran, cmd, names):
    r = ran[key(cmd)]
    line = one_line(r.stderr, r.returncode, cmd[0])
    assert names in line and "needs a CUDA GPU" not in line, line


def test_every_script_covered():
    as_subprocess = {c[0] for c in NEEDS_GPU} | {c[0] for c, _ in BAD_SUBPROCESS}
    assert set(MINE) - {"ncu_source.py"} <= as_subprocess      # ncu_source: test_ncu_source_*
    assert set(MINE) <= {c[0] for c, _ in BAD}
    assert set(MINE) - set(EXAMPLE_SCRIPTS) <= set(SCRIPTS)


@pytest.mark.parametrize("script,argv,reduced", [
    ("bench_gemm", [], False),
    ("bench_gemm", ["--layers", "8"], True),
    ("bench_gemm", ["--decode-tokens", "1"], True),
    ("bench_gemm", ["--scratch", "32x2", "48x3"], True),                  # a sweep
    ("bench_gemm", ["--decode-tokens", "1", "4", "8", "--layers", "24"], False),
    ("bench_decode", ["--compile", "--modes", "pool-serial"], False),     # a part of a split run
    ("bench_decode", ["--small"], True),
    ("bench_decode", ["--tokens", "16"], True),
    ("bench_decode", ["--model", "gpt-oss-120b"], False),
    ("bench_decode", ["--model", "gpt-oss-120b", "--layers", "8"], True),
    ("bench_long", [], False),
    ("bench_long", ["--contexts", "4096", "32768"], True),
    ("bench_long", ["--soak-steps", "1000"], True),
    ("bench_prefix", [], False),
    ("bench_prefix", ["--prefix", "4096"], True),
    ("bench_prefix", ["--small"], True),
    ("bench_prefix", ["--scratch-rows", "64", "--scratch-buffers", "4"], True),
    ("bench_prefix", ["--host-experts"], True),
    ("bench_serve", [], False),
    ("bench_first_request", [], False),
    ("bench_first_request", ["--bank", "1"], True),
    ("bench_first_request", ["--prompts", "512"], True),
    ("bench_first_request", ["--repeats", "1"], True),
    ("bench_first_request", ["--profile", "2"], True),
    ("bench_serve", ["--host-experts", "--host-baseline"], False),   # serve's default, and more
    ("bench_serve", ["--no-host-experts"], True),
    ("bench_serve", ["--host-promote"], True),
    ("bench_serve", ["--host-threads", "12"], True),
    ("bench_serve", ["--no-batch-prefill"], True),
    ("bench_gemm", ["--skip-gpt-oss"], True),
    ("bench_planner", ["--copy-sweep", "2,512,4"], False),
    ("bench_planner", ["--skip-copy", "--experts", "128", "--lanes", "8", "--replays", "20"], True),
    ("bench_store", ["--rows", "16"], False),
    ("bench_store", ["--sizes", "2MiB"], True),
    ("bench_nvfp4", ["--experts", "16"], True),
    ("profile_read", ["--skip-decode"], True),
], ids=lambda v: " ".join(v) if isinstance(v, list) else str(v))
def test_reduced_runs_write_no_canonical_file(script, argv, reduced, tmp_path, capsys):
    """A full run writes benchmarks/results/<name>.json; a reduced one nothing unless --json."""
    common, mod = load("_common.py"), load(f"{script}.py")
    why = mod.reduced(mod.build_parser().parse_args(argv))
    assert bool(why) == reduced, why
    path = common.results_path(script, None, why)
    assert (path is None) == reduced
    assert path is None or path == common.RESULTS / f"{script}.json"
    assert common.results_path(script, tmp_path / "r.json", why) == tmp_path / "r.json"


def test_bench_decode_merge_refusals(tmp_path):
    """--merge adds to a results file of the same shape, tokens and compile setting only."""
    bd = load("bench_decode.py")
    run = {"shape": {"num_hidden_layers": 48}, "tokens": 256, "compile": True}
    with pytest.raises(ValueError, match="--json PATH"):
        bd.merged_modes(None, run)                        # a reduced run writes no file
    with pytest.raises(FileNotFoundError, match="nothing to merge into"):
        bd.merged_modes(tmp_path / "none.json", run)
    path = tmp_path / "r.json"
    path.write_text(json.dumps({**run, "compile": False, "modes": {"resident": {}}}))
    with pytest.raises(ValueError, match="compile=False"):
        bd.merged_modes(path, run)
    path.write_text(json.dumps({**run, "tokens": 16, "modes": {"resident": {}}}))
    with pytest.raises(ValueError, match="tokens=16"):
        bd.merged_modes(path, run)
    path.write_text(json.dumps({**run, "modes": {"resident": {"locality": {}}}}))
    assert bd.merged_modes(path, run) == {"resident": {"locality": {}}}


def test_bench_decode_shape_keys():
    """Every --model's full and tiny shapes give (L, E, K, H, I, vocab): Qwen3-MoE and qwen4_exp
    name the expert width moe_intermediate_size, gpt-oss intermediate_size."""
    bd = load("bench_decode.py")
    for model, (full, *_rest) in bd.MODELS.items():
        for shape in (full, bd.TINY_SHAPES[model]):
            L, E, K, H, I, vocab = bd.shape_keys(shape)
            assert (L, E, K, H) == (shape["num_hidden_layers"],
                                    shape.get("num_experts", shape.get("num_local_experts")),
                                    shape["num_experts_per_tok"], shape["hidden_size"]), model
            assert I == shape.get("moe_intermediate_size") or I == shape["intermediate_size"]
    assert bd.shape_keys(bd.MODELS["qwen4_exp"][0])[4] == 512


def test_bench_serve_models():
    """bench_serve's --model shapes: each names its synthetic shape and builder, layers default
    to the model's, and the experts' dims read from either family's config keys (GLM-4.5-Air's
    n_routed_experts); an unknown model is refused by the parser."""
    from cupool import synthetic
    bs = load("bench_serve.py")
    for name, (shape, builder, results, title) in bs.MODELS.items():
        assert callable(getattr(synthetic, builder)) and results.startswith("bench_serve"), name
        assert bs.model_shape(name, None) == getattr(synthetic, shape)
        assert bs.model_shape(name, 2)["num_hidden_layers"] == 2
    assert bs.model_shape("glm-4.5-air", None)["num_hidden_layers"] == 46
    assert synthetic.moe_dims(synthetic.GLM45_AIR) == (128, 8, 4096, 1408)
    assert synthetic.moe_dims(synthetic.QWEN3_30B_A3B) == (128, 8, 2048, 768)
    assert synthetic.moe_dims(synthetic.GPT_OSS_120B) == (128, 4, 2880, 2880)
    assert synthetic.moe_dims(synthetic.QWEN3_NEXT_80B) == (512, 10, 2048, 512)
    with pytest.raises(SystemExit) as e:
        bs.build_parser().parse_args(["--model", "glm-4.5"])
    assert e.value.code == 2


def test_glm45_air_synthetic_dense_part():
    """synthetic's GLM-4.5-Air builder (tiny shape, on the CPU): its MoE layers (all but the
    dense first) are the pool's, their experts released; the routers' correction biases, which
    `to_empty` leaves uninitialised, are drawn (finite, not all zero) and every dense weight is
    finite."""
    import torch

    from cupool import synthetic
    model, specs = synthetic.glm4_moe_dense_on_gpu("cpu", seed=3, **synthetic.GLM45_AIR_TINY)
    assert [s.index for s in specs] == [0, 1]
    assert [s.parent is model.model.layers[i].mlp for i, s in zip((1, 2), specs)] == [True, True]
    for i in (1, 2):
        b = model.model.layers[i].mlp.gate.e_score_correction_bias
        assert torch.isfinite(b).all() and b.abs().max() > 0
    for name, p in model.named_parameters():
        assert p.numel() == 0 or torch.isfinite(p).all(), name


def test_qwen3_next_synthetic_dense_part():
    """synthetic's Qwen3-Next builder (tiny shape, on the CPU): three gated delta nets to one
    full-attention layer, as transformers' defaults space them; every layer's MoE block is the
    pool's, its experts released, its shared expert and gate dense; every dense weight finite.
    The full shape's expert rows are 43.5 GB of NVFP4 (run_gpu.sh serve-next's note)."""
    import torch

    import cupool
    from cupool import synthetic
    model, specs = synthetic.qwen3_next_dense_on_gpu("cpu", seed=3, **synthetic.QWEN3_NEXT_TINY)
    assert model.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert [s.parent for s in specs] == [layer.mlp for layer in model.model.layers]
    for layer in model.model.layers:
        assert layer.mlp.shared_expert_gate.weight.shape == (1, 64)
    for name, p in model.named_parameters():
        assert p.numel() == 0 or torch.isfinite(p).all(), name
    E, K, H, I = synthetic.moe_dims(synthetic.QWEN3_NEXT_80B)
    rows = E * synthetic.QWEN3_NEXT_80B["num_hidden_layers"]
    assert round(rows * cupool.RowLayout(H, I).row_bytes / 1e9, 1) == 43.5


def test_bench_serve_link_bound():
    """bench_serve's link bound: decoded tokens over the seconds the rows crossing the link
    (misses, and prefetched rows with prefetch on) take on it; none without any."""
    bs = load("bench_serve.py")
    # 879 rows of 2.65 MB a step of 8 tokens at 54 GB/s: 43.1 ms a step, 185.5 tok/s
    assert bs.link_bound(879 * 63, 8 * 63, 2_650_000, 54.0) == pytest.approx(185.45, rel=1e-3)
    assert bs.link_bound(0, 64, 2_650_000, 54.0) is None
    assert bs.link_bound(10, 0, 2_650_000, 54.0) is None


def test_bench_serve_replays_the_trace_where_routing_decides_hits():
    """A bank holding every expert runs the model's router (a replayed trace is a routing hook,
    which keeps the plan step), unless prefetch needs the trace's predictions."""
    bs = load("bench_serve.py")
    args = bs.build_parser().parse_args([])
    assert args.routing == "locality"
    assert bs.replays_trace(args, holds_every_expert=False)
    assert not bs.replays_trace(args, holds_every_expert=True)
    args = bs.build_parser().parse_args(["--prefetch", "trace"])
    assert bs.replays_trace(args, holds_every_expert=True)
    args = bs.build_parser().parse_args(["--routing", "router"])
    assert not bs.replays_trace(args, holds_every_expert=False)


def test_bench_serve_late_ttft_times_a_request_arriving_mid_decode():
    """late_ttft submits each late prompt once the others have decoded their first tokens, and
    times its first token; the others are cancelled after it, and the engine ends idle."""
    pytest.importorskip("transformers")
    from tiny_models import hf_model

    from cupool.engine import Engine
    bs = load("bench_serve.py")
    bs.LATE_MORE = 8                                 # the tiny model's 64 positions
    eng = Engine(hf_model("qwen3_moe", seed=3), max_batch=3, max_len=32, eos_token_id=[])
    seen = []
    submit = eng.submit

    def spy(prompt, params=None, *a, **k):
        req = submit(prompt, params, *a, **k)
        seen.append((len(prompt), params.max_tokens, req))
        return req

    eng.submit = spy
    others = [[5, 6, 7, 8], [9, 10, 11]]
    out = bs.late_ttft(eng, others, [[12] * 6, [13] * 5], steps=2)
    assert len(out) == 2 and all(t > 0 for t in out)
    assert [(n, m) for n, m, _ in seen] == [(4, 2 + bs.LATE_MORE), (3, 2 + bs.LATE_MORE), (6, 2),
                                            (4, 2 + bs.LATE_MORE), (3, 2 + bs.LATE_MORE), (5, 2)]
    late = [r for n, m, r in seen if m == 2]
    assert all(r.finished and len(r.output_ids) == 2 for r in late)
    assert all(r.finish_reason == "cancelled" and len(r.output_ids) >= 2
               for n, m, r in seen if m != 2)
    assert not eng.iterate()


def test_timeline_breakdown():
    """Busy time is the union of a stream's intervals (overlaps counted once), idle the span no
    stream covers; groups sum their events' own times."""
    common = load("_common.py")
    ev = [{"name": "copy_rows", "stream": 7, "start_us": 0.0, "end_us": 400.0},
          {"name": "copy_rows", "stream": 7, "start_us": 300.0, "end_us": 500.0},
          {"name": "moe_w13", "stream": 3, "start_us": 450.0, "end_us": 700.0},
          {"name": "elementwise", "stream": 3, "start_us": 1200.0, "end_us": 1300.0}]
    b = common.timeline_breakdown(ev, lambda n: "copies" if "copy" in n else "compute")
    assert b["span_ms"] == pytest.approx(1.3)
    assert b["streams"] == {"7": pytest.approx(0.5), "3": pytest.approx(0.35)}
    assert b["idle_ms"] == pytest.approx(1.3 - 0.8)           # 0..700 and 1200..1300 busy
    assert b["groups"]["copies"] == {"ms": pytest.approx(0.6), "count": 2}
    assert list(b["groups"]) == ["copies", "compute"]          # largest first
    assert b["kernels"] == [                                    # by name, largest first
        {"name": "copy_rows", "group": "copies", "ms": pytest.approx(0.6), "count": 2},
        {"name": "moe_w13", "group": "compute", "ms": pytest.approx(0.25), "count": 1},
        {"name": "elementwise", "group": "compute", "ms": pytest.approx(0.1), "count": 1}]
    assert [k["name"] for k in common.timeline_breakdown(ev, str, top=1)["kernels"]] == ["copy_rows"]
    assert common.timeline_breakdown([], str)["span_ms"] == 0.0
    bp = load("bench_prefix.py")
    assert [bp.group_of(n) for n in ("copy_rows_bulk", "Memcpy HtoD (Pinned -> Device)",
                                     "moe_w2", "fmha_cutlassF_bf16", "nvjet_tst_128x64",
                                     "vectorized_elementwise_kernel")] == [
        "expert row copies", "expert row copies", "MoE GEMM", "attention", "matmul", "other"]


def test_argument_types():
    from cupool.cli import bounded_int, fields, output_file, positive_float, positive_int
    assert bounded_int(2)("2") == 2 and bounded_int(16, multiple_of=16)("48") == 48
    assert fields("x", ROWS=positive_int, BUFFERS=positive_int)("32x2") == (32, 2)
    assert fields(A=positive_float, B=positive_int)("0.25,8") == (0.25, 8)
    assert positive_float("1e9") == 1e9
    for parse, text, says in ((bounded_int(2), "1", ">= 2"), (bounded_int(1, 32), "33", "[1, 32]"),
                              (bounded_int(16, multiple_of=16), "24", "multiple of 16"),
                              (fields(A=positive_int, B=positive_int), "1", "expected A,B"),
                              (fields(A=positive_int, B=positive_int), "1,0", "B: must be"),
                              (positive_float, "0", "> 0"), (positive_float, "nan", "> 0"),
                              (output_file, "/no/such/dir/x.json", "no such directory")):
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(says)):
            parse(text)


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
    assert "no \"Address\" header" in one_line(r.stderr, r.returncode, "ncu_source.py")


def test_profile_gemm_cases():
    profile_gemm = load("profile_gemm.py")
    assert profile_gemm.parse_case("2048:3") == (2048, 3)
    assert profile_gemm.parse_case("4096:16") == (4096, 16)
    assert profile_gemm.parse_case("2880:1") == (2880, 1)            # gpt-oss's experts
    layout, _, topk = profile_gemm.SHAPES[2880]
    assert (layout.hidden, layout.intermediate, layout.bias, topk) == (2880, 2880, True, 4)
    for bad in ("2048", "1024:1", "2048:0", "2048:17", "x:1"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected H:T"):
            profile_gemm.parse_case(bad)
    assert profile_gemm.parse_variant("minb=4,w13_split=2") == {"minb": 4, "w13_split": 2}
    assert profile_gemm.parse_variant("default") == {}
    assert profile_gemm.parse_variant("xsmem=1") == {"xsmem": 1}     # x rows in shared memory
    assert profile_gemm.parse_variant("minb=3,blocks=3") == {"minb": 3, "blocks": 3}  # the grid
    assert profile_gemm.parse_variant("w2_split=4") == {"w2_split": 4}   # warps a w2 strip
    with pytest.raises(argparse.ArgumentTypeError, match="NAME=INT"):
        profile_gemm.parse_variant("stage=2")
