"""End-to-end decode: cupool against what users run today, on one Qwen3-30B-A3B-shaped model.

Model: 48 layers, 128 experts, top-8, H=2048, I=768, GQA attention, random weights; the experts
as NVFP4 rows in pinned host memory (built directly, never as bf16). Batch 1, a 16-token prompt,
`--tokens` decoded tokens, tok/s the median of `--repeats` runs, each mode on the same model and
(except hf-bf16) the same routing:

- pool-25/50/100: cupool, graph decode, bank of 25/50/100% of each layer's experts, with
  `overlap_copies` on (row copies on a second stream beside the GEMM of the experts already in
  the bank, the copied ones in a second launch);
- pool-serial: pool-50 and pool-100 with `overlap_copies` off (copies, then one GEMM launch: the
  library's default);
- uva-eager, uva-graph: every expert read from pinned host memory by the GEMM each step;
- host-lru: per-layer LRU on the host (routing read back each layer, cudaMemcpyAsync), eager;
- resident: all experts on the GPU in NVFP4, graph (the ceiling);
- hf-bf16-<impl>: the unwrapped transformers model with bf16 experts resident, its experts
  implementation batched_mm / grouped_mm, one decode step captured (its own random router);
- pool-prefetch: pool-<bank> (`--prefetch-banks`, default 50) with prefetch on
  (`Pool.enable_prefetch`: after layer l's plan step layer l + 1's predicted experts are copied
  on a side stream inside the graph), the predictor either a trace's predicted ids at each of
  `--prefetch-accuracy` (`cupool.trace.with_predictions`, on every routing; result keys
  "<routing>@<accuracy>") or, on the model's own routing ("own-router"), the model's own
  predictor (layer l + 1's router on layer l's MoE input), beside pool-<bank> without prefetch
  on that routing; copies beside the GEMM (`overlap_copies`) as in pool-<bank>. Reported:
  tok/s, hit rate, prefetched / wasted / missed bytes a token, and the predictor's accuracy (on
  this synthetic model, whose random routers say nothing of a trained model's).

Routing: "uniform" (independent uniform draws, what a random router gives) and "locality" (a
synthetic trace with the published Qwen3-30B-A3B reuse, cupool.trace.QWEN3_LOCALITY), replayed in
place of the router. For each pool run: hit rate, PCIe bytes per token, and the bound (time per
token if the misses moved at the PCIe bandwidth measured here and everything else ran at the
resident run's speed); achieved/bound = bound / measured time.

Every mode decodes through `cupool.Engine` with its defaults (what `cupool serve` runs: the fused
decode step where the model fits, one slot, its step captured in a CUDA graph; the eager modes
with graph=False). `--compile` runs the model's own decode step through torch.compile where the
fused step is not used (the baselines that swap the experts' computation, hf-bf16) and adds
hf-bf16 compiled; the JSON's "compile" says which. `--merge` keeps the modes already in the
results file that this run does not measure, so a long run can be split over calls (`--modes`);
it refuses a file of another shape, token count or compile setting.

Writes benchmarks/results/bench_decode.json and .png, with or without --compile. A reduced run
(`--small`, or fewer layers, tokens, repeats or routings than the defaults) writes nothing unless
--json PATH is given (then PATH and PATH with .png).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from _baselines import HostLRUBackend, ResidentBackend, UVABackend
from _common import pcie_h2d_GBps, reduced_by, results_path, save, shown

import cupool
from cupool import _cuda, synthetic
from cupool import trace as tr
from cupool.cli import CLIParser, bounded_int, existing_file, output_file, positive_int, run
from cupool.prefetch import TracePredictor
from cupool.replay import Replayer
from cupool.sampling import SamplingParams


@dataclasses.dataclass
class Run:
    tok_per_s: float            # median over the repeats
    rates: list                 # tok/s of each repeat
    stats: list | None          # pool counters of the last repeat (pool modes)
    capture_s: list             # capture seconds of each repeat (with compile, the first compiles)
    step: str = ""              # the engine's step_kind (fused, or the model's forward and why)


def run_mode(model, pool, prompt, tokens, repeats, *, graph=True, backend=None, replay=None,
             rows=None, compile=False) -> Run:
    """`repeats` decode runs of one mode through the Engine with serve's defaults (one slot,
    greedy; its decode graphs captured by a warm-up before the timed request)."""
    rates, captures, stats, step = [], [], None, ""
    for _ in range(repeats):
        if pool is not None:
            pool.decode_backend = backend
            if rows is not None and backend is None:
                pool.resize_bank(rows)                   # fresh bank: same start every run
            if replay is not None:
                replay.step.zero_()
                replay.install()
        t0 = time.perf_counter()
        eng = cupool.Engine(model, pool, max_batch=1, max_len=prompt.shape[1] + tokens,
                            graph=graph, compile=compile, eos_token_id=[])
        eng.warmup()
        captures.append(round(time.perf_counter() - t0, 2))
        req = eng.generate([prompt[0].tolist()],
                           SamplingParams(max_tokens=tokens, ignore_eos=True))[0]
        rates.append(req.decode_tokens_per_s)
        step = eng.step_kind
        eng.close()
        del eng
        if pool is not None and backend is None:
            stats = pool.stats()
    if pool is not None:
        pool.decode_backend = None
    return Run(statistics.median(rates), rates, stats, captures, step)


def pool_figures(stats, tokens, row_bytes):
    hits = sum(s["hits"] for s in stats)
    misses = sum(s["misses"] for s in stats)
    copied = sum(s["bytes_copied"] for s in stats)
    return {"hit_rate": hits / max(1, hits + misses), "pcie_bytes_per_token": copied / (tokens - 1),
            "per_layer_hit_rate": [s["hit_rate"] for s in stats],
            "rows_owned": [s["rows_owned"] for s in stats]}


def prefetch_figures(stats, tokens, row_bytes) -> dict:
    """Prefetch counters of a run (a prefetching pool's stats) a token: rows and bytes
    prefetched, used, wasted (evicted before use)."""
    n = {k: sum(s[k] for s in stats) for k in ("prefetched", "prefetch_used", "prefetch_wasted")}
    return {"prefetched_rows_per_token": n["prefetched"] / (tokens - 1),
            "prefetch_used_rows_per_token": n["prefetch_used"] / (tokens - 1),
            "prefetch_wasted_rows_per_token": n["prefetch_wasted"] / (tokens - 1),
            "prefetched_bytes_per_token": n["prefetched"] * row_bytes / (tokens - 1),
            "prefetch_wasted_bytes_per_token": n["prefetch_wasted"] * row_bytes / (tokens - 1)}


def trace_accuracy(trace) -> float:
    """Fraction of the selections of layers 1 … L−1 that the trace's predictions name for the
    same step and token (layer 0 is never predicted)."""
    act, pred = trace.ids[:, 1:], trace.predicted[:, 1:]
    named = (act[..., :, None] == pred[..., None, :]).any(-1) & (act >= 0)
    return float(named.sum() / max(1, (act >= 0).sum()))


def hf_bf16(shape, prompt, tokens, repeats, impl, compile=False):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig
    cfg = Qwen3MoeConfig(**shape, dtype=torch.bfloat16, tie_word_embeddings=False)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    model.set_experts_implementation(impl)
    try:
        return run_mode(model, None, prompt, tokens, repeats, compile=compile)
    finally:
        del model
        gc.collect()
        torch.cuda.empty_cache()


def plot(results, pool_layers, path):
    """Tok/s of every mode; beside it, with `pool_layers` (a pool-50 run), its per-layer hit rate
    and rows owned."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    if pool_layers is None:
        fig, a = plt.subplots(1, 1, figsize=(8, 5))
    else:
        fig, (a, b) = plt.subplots(1, 2, figsize=(14, 5))
    modes = [m for m in results["modes"] if "error" not in results["modes"][m]]
    for i, routing in enumerate(("uniform", "locality", "own-router")):
        vals = [results["modes"][m].get(routing, {}).get("tok_per_s", 0) for m in modes]
        if any(vals):
            a.bar([j + 0.27 * i for j in range(len(modes))], vals, width=0.27, label=routing)
    a.set_xticks([j + 0.27 for j in range(len(modes))], modes, rotation=45, ha="right")
    a.set_ylabel("tokens / s (batch 1)")
    a.set_title(f"decode, {results.get('gpu', 'GPU not recorded')}")
    a.legend()
    if pool_layers is None:
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        return
    layers = range(len(pool_layers["per_layer_hit_rate"]))
    b.plot(layers, pool_layers["per_layer_hit_rate"], label="hit rate")
    b.set_ylabel("hit rate")
    b.set_xlabel("layer")
    b2 = b.twinx()
    b2.bar(layers, pool_layers["rows_owned"], alpha=0.3, color="gray", label="rows owned")
    b2.set_ylabel("bank rows owned after the run")
    b.set_title("pool-50, locality trace: per-layer hit rate and rows owned")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


MODES = ["pool", "pool-serial", "uva-eager", "uva-graph", "host-lru", "resident", "hf-bf16",
         "pool-prefetch"]
ROUTINGS = ["uniform", "locality"]
# --model: (shape, dense-part builder, results name, default modes, bank sizes of "pool" in % of
# E). gpt-oss (biased experts, the clamped SwiGLU, H = I = 2880) is measured against its own
# resident ceiling; its 64.6 GB of rows fit an H200 once (resident), not twice (no pool-100).
MODELS = {
    "qwen3-30b-a3b": (synthetic.QWEN3_30B_A3B, synthetic.qwen3_moe_dense_on_gpu, "bench_decode",
                      ["pool", "uva-eager", "uva-graph", "host-lru", "resident", "hf-bf16"],
                      (25, 50, 100)),
    "gpt-oss-120b": (synthetic.GPT_OSS_120B, synthetic.gpt_oss_dense_on_gpu,
                     "bench_decode_gpt_oss_120b", ["pool", "resident"], (25, 50)),
    # Qwen3.8-Flash-Next's shape (synthetic.QWEN4_EXP): gated delta nets and QSA attention keep
    # per-slot states (its layers run transformers' modules inside the engine's step).
    "qwen4_exp": (synthetic.QWEN4_EXP, synthetic.qwen4_exp_dense_on_gpu, "bench_decode_qwen4_exp",
                  ["pool", "resident"], (25, 50)),
}
TINY_SHAPES = {"qwen3-30b-a3b": synthetic.TINY, "gpt-oss-120b": synthetic.GPT_OSS_TINY,
               "qwen4_exp": synthetic.QWEN4_EXP_TINY}


def shape_keys(shape: dict) -> tuple[int, int, int, int, int, int]:
    """(L, E, K, H, I, vocab) of a Qwen3-MoE, gpt-oss or qwen4_exp config dict."""
    E, K, H, I = synthetic.moe_dims(shape)
    return shape["num_hidden_layers"], E, K, H, I, shape["vocab_size"]


def build_parser() -> CLIParser:
    p = CLIParser(prog="bench_decode.py", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=positive_int, default=None,
                   help="MoE layers (>= 1; default: the model's, 48 for qwen3-30b-a3b, 36 for "
                        "gpt-oss-120b)")
    p.add_argument("--tokens", type=bounded_int(2), default=256,
                   help="decoded tokens a run (>= 2: rates count the steps after the first)")
    p.add_argument("--prompt", type=positive_int, default=16, help="prompt length (>= 1)")
    p.add_argument("--repeats", type=positive_int, default=3, help="runs a mode (>= 1)")
    p.add_argument("--model", choices=sorted(MODELS), default="qwen3-30b-a3b",
                   help="the synthetic model's shape (default qwen3-30b-a3b; gpt-oss-120b and "
                        "qwen4_exp write bench_decode_<model>.json and measure pool and resident "
                        "modes)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=None,
                   help="modes to run (default: the model's own list, see --model)")
    p.add_argument("--routings", nargs="+", choices=ROUTINGS, default=ROUTINGS)
    p.add_argument("--prefetch-accuracy", nargs="+", type=float, default=[0.6, 0.8, 0.95],
                   metavar="A", help="pool-prefetch: accuracies of the traces' predicted ids "
                                     "(each in [0, 1])")
    p.add_argument("--prefetch-banks", nargs="+", type=bounded_int(1), default=[50],
                   metavar="PERCENT", help="pool-prefetch: bank sizes in %% of E (default 50)")
    p.add_argument("--small", action="store_true", help="tiny shape (smoke test; no results "
                   "file unless --json)")
    p.add_argument("--plot-only", metavar="JSON", type=existing_file,
                   help="redraw the PNG (beside the JSON) from a results JSON; needs no GPU")
    p.add_argument("--compile", action="store_true",
                   help="run each mode's decode step through torch.compile (the dense part fused; "
                        "cupool's layers stay opaque ops); hf-bf16 is measured both ways")
    p.add_argument("--merge", action="store_true",
                   help="keep the modes already in the results file that this run does not "
                        "measure")
    p.add_argument("--json", type=output_file, metavar="PATH",
                   help="write the results here (and the plot beside, .png) instead of "
                        "benchmarks/results/bench_decode.json; a reduced run writes only here")
    return p


def plot_only(path: Path) -> None:
    try:
        res = json.loads(path.read_text())
    except UnicodeDecodeError:
        raise ValueError(f"--plot-only {path}: not a text (JSON) file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--plot-only {path}: not JSON ({e})") from None
    if not isinstance(res, dict) or not isinstance(res.get("modes"), dict):
        raise ValueError(f"--plot-only {path}: no \"modes\": not a bench_decode results file")
    pool50 = res["modes"].get("pool-50", {})
    layers = pool50.get("locality") or pool50.get("uniform")
    out = path.with_suffix(".png")
    try:
        plot(res, layers, out)
    except ImportError as e:
        raise ValueError(f"--plot-only needs matplotlib (pip install matplotlib): {e}") from None
    print(f"wrote {out}")


def merged_modes(path: Path | None, results: dict) -> dict:
    """The modes of the results file a --merge run adds to, refusing one of another shape,
    token count or compile setting."""
    if path is None:
        raise ValueError("--merge: this reduced run writes no results file to merge into; give "
                         "--json PATH")
    if not path.is_file():
        raise FileNotFoundError(f"--merge: {shown(path)} does not exist: nothing to merge into "
                                f"(run without --merge first)")
    try:
        old = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--merge: {shown(path)} is not JSON ({e})") from None
    if not isinstance(old, dict) or not isinstance(old.get("modes"), dict):
        raise ValueError(f"--merge: {shown(path)} has no \"modes\": not a bench_decode file")
    for key, flag in (("compile", "--compile"), ("tokens", "--tokens"),
                      ("shape", "--layers/--small")):
        if key in old and old[key] != json.loads(json.dumps(results[key])):
            raise ValueError(f"--merge: {shown(path)} holds a run with {key}={old[key]!r} "
                             f"({flag}), this run has {results[key]!r}")
    print(f"merging into {shown(path)}: kept {sorted(old['modes'])}", flush=True)
    return old["modes"]


def reduced(args) -> list[str]:
    """How this run is smaller than the default one (then it writes no canonical file); fewer
    --modes is not: a long run is split by modes."""
    why = reduced_by(args, build_parser(), "small", "tokens", "repeats", "routings")
    full = MODELS[args.model][0]["num_hidden_layers"]
    if args.layers is not None and args.layers < full:
        why.append(f"--layers {args.layers} < {full}")
    return why


def main(args) -> None:
    if args.plot_only:
        return plot_only(args.plot_only)
    full_shape, dense_on_gpu, result_name, default_modes, fractions = MODELS[args.model]
    if args.modes is None:
        args.modes = default_modes
    if "hf-bf16" in args.modes and args.model != "qwen3-30b-a3b":
        raise ValueError(f"--modes hf-bf16 is measured for qwen3-30b-a3b only, not {args.model}")
    bad = [a for a in args.prefetch_accuracy if not 0 <= a <= 1]
    if bad:
        raise ValueError(f"--prefetch-accuracy must be in [0, 1], got {bad[0]:g}")
    bad = [b for b in args.prefetch_banks if b > 100]
    if bad:
        raise ValueError(f"--prefetch-banks are percentages of E in [1, 100], got {bad[0]}")
    _cuda.require_gpu("the end-to-end decode benchmark")
    out = results_path(result_name, args.json, reduced(args))
    tiny = TINY_SHAPES[args.model]
    shape = dict(tiny) if args.small else dict(full_shape,
                                               num_hidden_layers=args.layers or
                                               full_shape["num_hidden_layers"])
    results = {"model": args.model, "driver": "engine", "shape": shape, "tokens": args.tokens,
               "repeats": args.repeats, "compile": args.compile}
    old_modes = merged_modes(out, results) if args.merge else {}
    L, E, K, H, I, vocab = shape_keys(shape)
    model, specs = dense_on_gpu("cuda", torch.bfloat16, **shape)
    layout = cupool.RowLayout(H, I, bias=specs[0].bias)
    pcie = pcie_h2d_GBps()
    print(f"PCIe H2D {pcie:.1f} GB/s; model {L} layers E={E} top-{K}", flush=True)
    t0 = time.perf_counter()
    gen = torch.Generator(device="cuda").manual_seed(0)
    pool = cupool.wrap(model, rows=max(K, E // 2), layers=specs, max_decode_tokens=1,
                       max_prefill_tokens=max(64, args.prompt),
                       expert_rows=lambda layer: synthetic.random_rows_fast(layout, E, gen, "cuda"))
    print(f"built in {time.perf_counter() - t0:.0f} s: {pool}", flush=True)
    prompt = torch.randint(0, vocab, (1, args.prompt), device="cuda", generator=gen)
    traces = {"uniform": tr.uniform(args.tokens + 64, L, E, K, seed=1),
              "locality": tr.synthetic(args.tokens + 64, L, E, K, seed=1, **tr.QWEN3_LOCALITY)}
    results.update({"pcie_h2d_GBps": pcie, "traces": {k: v.note for k, v in traces.items()},
                    "modes": dict(old_modes)})
    modes = results["modes"]
    shown_step = None

    def record(name, routing, run, extra=None):
        modes.setdefault(name, {})[routing] = {"tok_per_s": run.tok_per_s, "runs": run.rates,
                                               "capture_s": run.capture_s, "step": run.step,
                                               **(extra or {})}
        print(f"{name:>14} {routing:>9}: {run.tok_per_s:8.1f} tok/s  {extra or ''}"[:300],
              flush=True)
        nonlocal shown_step
        if run.step and run.step != shown_step:          # once, and again where it changes
            print(f"{'':>14} step: {run.step}", flush=True)
            shown_step = run.step
        save(result_name, {**results, "partial": True}, out)   # keep what is done if cut short
        return run

    def measure(**kw) -> Run:
        return run_mode(model, pool, prompt, args.tokens, args.repeats, compile=args.compile,
                        **kw)

    resident = ResidentBackend(pool) if {"resident", "pool", "pool-prefetch"} & set(args.modes) \
        else None

    def prefetch_run(name, routing, rows, predictor, base_tps, res_ms, extra):
        """One pool-prefetch measurement: tok/s, hit rate, bytes a token, against `base_tps` (the
        same bank without prefetch) and the resident run (`res_ms` a token). Copies beside the
        GEMM (`overlap_copies`) as in the pool-<bank> runs it is compared with."""
        pool.enable_prefetch(predictor)
        pool.overlap_copies = True
        run = measure(replay=replay_now, rows=rows)
        pool.overlap_copies = False
        fig = pool_figures(run.stats, args.tokens, layout.row_bytes)
        fig.update(prefetch_figures(run.stats, args.tokens, layout.row_bytes), **extra,
                   rows_per_layer=rows, errors=pool.errors(),
                   over_pool_without_prefetch=run.tok_per_s / base_tps if base_tps else None,
                   over_resident=run.tok_per_s * res_ms / 1e3 if res_ms else None)
        pool.disable_prefetch()
        record(name, routing, run, fig)
    replay_now = None
    for routing in args.routings:
        replay = replay_now = Replayer(pool, traces[routing])
        if resident is not None:
            run = measure(backend=resident, replay=replay)
            record("resident", routing, run)
            resident_ms = 1e3 / run.tok_per_s
        if "pool" in args.modes:
            for frac in fractions:
                rows = max(K, E * frac // 100)
                pool.overlap_copies = True
                run = measure(replay=replay, rows=rows)
                pool.overlap_copies = False
                fig = pool_figures(run.stats, args.tokens, layout.row_bytes)
                bound_ms = resident_ms + fig["pcie_bytes_per_token"] / pcie / 1e6
                fig.update(rows_per_layer=rows, bound_tok_per_s=1e3 / bound_ms,
                           achieved_over_bound=run.tok_per_s * bound_ms / 1e3,
                           errors=pool.errors())
                record(f"pool-{frac}", routing, run, fig)
        if "pool-prefetch" in args.modes:     # a trace's predictions at stated accuracies
            for frac in args.prefetch_banks:
                rows = max(K, E * frac // 100)
                base = modes.get(f"pool-{frac}", {}).get(routing, {}).get("tok_per_s")
                for acc in args.prefetch_accuracy:
                    tp = tr.with_predictions(traces[routing], acc, seed=2)
                    prefetch_run(f"pool-prefetch-{frac}", f"{routing}@{acc:g}", rows,
                                 TracePredictor(replay, tp), base, resident_ms,
                                 {"predictor": f"trace predictions, accuracy {acc:g}",
                                  "predictor_accuracy": trace_accuracy(tp)})
            pool.resize_bank(pool.rows_per_layer, prefetch=False)   # the plain planner again
        if "pool-serial" in args.modes:       # pool-50 and -100 with copies, then one GEMM pass
            for frac in (50, 100):
                pool.overlap_copies = False
                rows = max(K, E * frac // 100)
                run = measure(replay=replay, rows=rows)
                fig = pool_figures(run.stats, args.tokens, layout.row_bytes)
                record(f"pool-{frac}-serial", routing, run, dict(fig, rows_per_layer=rows))
        if "uva-graph" in args.modes:
            record("uva-graph", routing, measure(backend=UVABackend(pool), replay=replay))
        if "uva-eager" in args.modes:
            record("uva-eager", routing,
                   measure(graph=False, backend=UVABackend(pool), replay=replay))
        if "host-lru" in args.modes:
            lru = HostLRUBackend(pool, max(K, E // 2))
            record("host-lru", routing, measure(graph=False, backend=lru, replay=replay),
                   {"rows_per_layer": lru.rows,
                    "hit_rate": lru.hits / max(1, lru.hits + lru.misses),
                    "pcie_bytes_per_token": lru.bytes_copied / (args.repeats * (args.tokens - 1))})
            lru.free()
        replay.uninstall()
    replay_now = None
    if "pool-prefetch" in args.modes:         # the model's own routing and its own predictor
        res_ms = 1e3 / record("resident", "own-router", measure(backend=resident)).tok_per_s
        for frac in args.prefetch_banks:
            rows = max(K, E * frac // 100)
            pool.overlap_copies = True                   # as pool-<bank> on the traces
            run = measure(rows=rows)
            pool.overlap_copies = False
            record(f"pool-{frac}", "own-router", run,
                   dict(pool_figures(run.stats, args.tokens, layout.row_bytes), rows_per_layer=rows))
            pre = pool.enable_prefetch(track_accuracy=True)          # accuracy: a run of its own
            run_mode(model, pool, prompt, args.tokens, 1, compile=args.compile,
                     rows=rows)
            acc = pre.accuracy()
            prefetch_run(f"pool-prefetch-{frac}", "own-router", rows, None, run.tok_per_s, res_ms,
                         {"predictor": "layer l+1's router on layer l's MoE input",
                          "predictor_accuracy_synthetic_model": acc,
                          "note": "synthetic model: random router weights; a trained model's "
                                  "accuracy is not this"})
        pool.resize_bank(pool.rows_per_layer, prefetch=False)
    if resident is not None:
        resident.free()
    pool.resize_bank(K)                       # give the bank's memory back before hf-bf16
    torch.cuda.empty_cache()
    if "hf-bf16" in args.modes:
        variants = [(impl, False) for impl in ("batched_mm", "grouped_mm")]
        if args.compile:
            variants.append(("batched_mm", True))
        for impl, comp in variants:
            name = f"hf-bf16-{impl}" + ("-compiled" if comp else "")
            try:
                record(name, "own-router",
                       hf_bf16(shape, prompt, args.tokens, args.repeats, impl, comp))
            except Exception as e:  # noqa: BLE001 (report the failure, keep the other results)
                print(f"{name} failed: {type(e).__name__}: {e}", file=sys.stderr)
                modes[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
    # headline ratios: null where either side was not measured in the results
    def tps(mode, routing="locality"):
        return modes.get(mode, {}).get(routing, {}).get("tok_per_s")

    def ratio(a, b):
        return a / b if a and b else None
    hf = max([v for v in (tps("hf-bf16-batched_mm", "own-router"),
                          tps("hf-bf16-grouped_mm", "own-router")) if v], default=None)
    results["ratios"] = {
        "pool50_over_uva_eager_locality": ratio(tps("pool-50"), tps("uva-eager")),
        "pool50_over_uva_graph_locality": ratio(tps("pool-50"), tps("uva-graph")),
        "pool50_over_host_lru_locality": ratio(tps("pool-50"), tps("host-lru")),
        "pool50_over_hf_bf16_locality": ratio(tps("pool-50"), hf),
        "pool50_over_hf_bf16_compiled_locality":
            ratio(tps("pool-50"), tps("hf-bf16-batched_mm-compiled", "own-router")),
        "pool100_over_resident_uniform": ratio(tps("pool-100", "uniform"),
                                               tps("resident", "uniform")),
        "pool100_over_resident_locality": ratio(tps("pool-100"), tps("resident")),
        "pool50_over_resident_uniform": ratio(tps("pool-50", "uniform"), tps("resident", "uniform")),
        "pool50_over_resident_locality": ratio(tps("pool-50"), tps("resident")),
    }
    print("ratios:", {k: round(v, 3) for k, v in results["ratios"].items() if v is not None})
    save(result_name, results, out)
    layers = modes.get("pool-50", {}).get("locality") or modes.get("pool-50", {}).get("uniform")
    if out is not None and layers:
        try:
            plot({**results, "gpu": torch.cuda.get_device_name()}, layers, out.with_suffix(".png"))
            print(f"wrote {shown(out.with_suffix('.png'))}")
        except ImportError as e:
            print(f"no plot: matplotlib is not installed ({e})")


if __name__ == "__main__":
    sys.exit(run(main, build_parser()))
