"""`python -m cupool <command>` (also the `cupool` script):

    info       the GPU, versions, the kernels' architecture and paths, whether they compile and run
    simulate   the planner's hit rate on a routing trace, on the CPU, to size the bank
    plan       what a checkpoint needs and where it goes for a budget, and an estimate of its
               decode speed on a GPU (no GPU needed, no weights read)
    generate   load a checkpoint and generate from a prompt, printing the text as it comes
    serve      an OpenAI-compatible server (/v1/completions, /v1/chat/completions, /v1/models)

A mistake in the arguments or the input ends in one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import math
import shutil
import subprocess
import sys
import time

from cupool.cli import (CLIParser, add_host_experts, check_host_flags, existing_dir,
                        existing_file, fail, fraction, nonnegative_float, nonnegative_int,
                        positive_int, promote, quantize_attention_error, run, size)

PROG = "cupool"


def _version(mod: str) -> str:
    try:
        return getattr(importlib.import_module(mod), "__version__", "installed")
    except Exception as e:  # noqa: BLE001 (any import failure is reported, not raised)
        return f"not available ({type(e).__name__})"


def _nvcc() -> str:
    path = shutil.which("nvcc")
    if not path:
        return "not on PATH (only needed for the CI compile check)"
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
        rel = [ln for ln in out.splitlines() if "release" in ln]
        return f"{path}: {rel[-1].strip() if rel else 'unknown version'}"
    except (OSError, subprocess.SubprocessError) as e:
        return f"{path}: failed to run ({e})"


# --- info ------------------------------------------------------------------------------------------
def info(args) -> int:
    import torch

    import cupool
    from cupool import _cuda

    print(f"cupool        {cupool.__version__}")
    print(f"torch         {torch.__version__} (CUDA build {torch.version.cuda})")
    print(f"cupy          {_version('cupy')}")
    print(f"transformers  {_version('transformers')}")
    print(f"nvidia-ml-py  {_version('pynvml')}")
    print(f"nvcc          {_nvcc()}")
    try:
        _cuda.require_gpu("serving a model")
    except (_cuda.NoGPUError, _cuda.CupyMissingError) as e:
        print(f"\n{e}. CPU tools (tests, `simulate`, `plan`) still work.")
        return 1
    tgt = _cuda.target()          # UnsupportedGPUError / a bad CUPOOL_ARCH: one line, exit 2
    cp = _cuda.cupy()
    rt = cp.cuda.runtime

    def ver(v: int) -> str:
        return f"{v // 1000}.{(v % 1000) // 10}"
    print(f"CUDA runtime  {ver(rt.runtimeGetVersion())}   driver API {ver(rt.driverGetVersion())}")
    try:
        print(f"NVRTC         {'.'.join(map(str, cp.cuda.nvrtc.getVersion()))}")
    except Exception as e:  # noqa: BLE001
        print(f"NVRTC         not usable: {e}")
    try:
        import pynvml
        pynvml.nvmlInit()
        drv = pynvml.nvmlSystemGetDriverVersion()
        print(f"driver        {drv.decode() if isinstance(drv, bytes) else drv}")
    except Exception as e:  # noqa: BLE001
        print(f"driver        NVML not usable: {e}")
    print()
    print(cupool.report())
    print()
    print(path_lines(tgt))
    return 0 if _selftest(tgt) else 2


def path_lines(tgt) -> str:
    """What `info` says of the code path a Target gives: the architecture built for, the row
    copies, the decode GEMM, the shared-memory limits launches keep to."""
    from cupool.gemm import decode_form
    copies = {"bulk": "bulk (the bulk-copy engine, copy_rows_bulk)",
              "ld": "ld (SM loads, copy_rows)"}[tgt.copy_mode]
    stages = "bulk copies" if tgt.bulk_copy else "cp.async"
    return "\n".join([
        f"kernels for   {tgt.describe()}",
        f"row copies    {copies}",
        f"decode GEMM   {decode_form()}; weight stages by {stages}",
        f"shared memory {tgt.smem_block // 1024} KiB a block, {tgt.smem_sm // 1024} KiB an SM, "
        f"{tgt.sms} SMs"])


def _selftest(tgt) -> bool:
    """Compile and run the selftest kernels through the loader on torch's stream: axpb's result,
    and the __CUDA_ARCH__ the code reports against the target's."""
    import torch

    from cupool import kernels
    how = "NVRTC PTX, compiled by the driver" if tgt.forced else "NVRTC"
    try:
        k = kernels.function("selftest", "axpb")
        x = torch.randn(1000, device="cuda")
        b = torch.tensor([0.5], device="cuda")
        y = torch.full_like(x, float("nan"))
        kernels.launch(k, 4, 256, (x, b, y, kernels.f32(2.0), kernels.i32(x.numel())))
        arch = torch.full((1,), -1, dtype=torch.int32, device="cuda")
        kernels.launch(kernels.function("selftest", "cuda_arch"), 1, 32, (arch,))
        ran = int(arch.item())
        good = bool(torch.allclose(y, 2 * x + 0.5)) and ran == 10 * tgt.sm
        print(f"kernels       {how} compile + launch on torch's stream: "
              f"{'ok' if good else 'WRONG RESULT'} (__CUDA_ARCH__ {ran})")
        return good
    except Exception as e:  # noqa: BLE001
        print(f"kernels       compile/launch failed: {e}")
        return False


# --- simulate --------------------------------------------------------------------------------------
def simulate(args) -> int:
    """Hit rate of the reference planner on a trace (CPU only)."""
    from cupool import trace as tr
    from cupool.reference.planner import Policy
    from cupool.simulate import simulate as run_simulation
    from cupool.simulate import simulate_opt
    if args.prefetch_rows and args.prefetch_accuracy is None:
        raise ValueError(f"--prefetch-rows {args.prefetch_rows} needs --prefetch-accuracy (the "
                         f"prefetch it caps)")
    if args.trace:
        if args.streams != 1:
            raise ValueError(f"--streams {args.streams} is for a synthetic trace; a trace file "
                             f"has its own tokens a step")
        t = tr.Trace.load(args.trace)
    else:
        if args.top_k > args.experts:
            raise ValueError(f"--top-k {args.top_k} exceeds --experts {args.experts}")
        shape = (args.steps, args.layers, args.experts, args.top_k)
        if args.synthetic == "uniform":
            t = tr.uniform(*shape, tokens=args.streams, seed=args.seed)
        elif args.streams == 1:
            t = tr.synthetic(*shape, seed=args.seed, **tr.QWEN3_LOCALITY)
        else:
            t = tr.streams(*shape, args.streams, seed=args.seed, **tr.QWEN3_LOCALITY)
    policy = None if args.promote == "auto" else Policy(promote=args.promote)
    K, E = t.ids.shape[-1], t.num_experts
    if args.warmup >= t.steps:
        raise ValueError(f"--warmup {args.warmup} must be less than the trace's {t.steps} steps")
    rows = args.rows if args.rows else sorted({max(K, E * p // 100) for p in (25, 50, 100)})
    for r in rows:
        if not K <= r <= E:
            raise ValueError(f"--rows {r}: bank rows per layer must be in [top_k={K}, E={E}]")
    print(f"trace: {t.steps} steps, {t.num_layers} layers, E={E}, top_k={K}, "
          f"tokens/step={t.ids.shape[2]}; {t.note}")
    print(f"reuse: next token {t.reuse(1):.3f}, within 8 tokens {t.reuse(8):.3f}")
    tp = tr.with_predictions(t, args.prefetch_accuracy, seed=args.seed) \
        if args.prefetch_accuracy is not None else None
    for r in rows:
        res = run_simulation(t, r, warmup_steps=args.warmup, policy=policy)
        owned = res["rows_owned"]
        opt = simulate_opt(t, r, warmup_steps=args.warmup)["hit_rate"]
        print(f"rows/layer {r:5d} ({100 * r / E:5.1f}% of experts): hit rate "
              f"{res['hit_rate']:.3f}   rows owned per layer min/max {min(owned)}/{max(owned)}"
              f"   [{res['policy']}]   (the offline optimum, which knows the trace's future: "
              f"{opt:.3f})")
        if tp is not None:
            pre = run_simulation(tp, r, warmup_steps=args.warmup, prefetch=True, policy=policy,
                                 prefetch_rows=args.prefetch_rows or 0)
            n = t.steps - args.warmup
            cap = f", at most {args.prefetch_rows} row(s) a prefetch" if args.prefetch_rows else ""
            print(f"    with prefetch at {args.prefetch_accuracy:g} accuracy{cap} (reference "
                  f"model): hit rate {pre['hit_rate']:.3f}; a step: {pre['prefetched'] / n:.1f} "
                  f"rows prefetched, {pre['prefetch_wasted'] / n:.1f} of them wasted, "
                  f"{pre['misses'] / n:.1f} misses")
    return 0


# --- plan ------------------------------------------------------------------------------------------
def plan(args) -> int:
    """What goes where for a budget, from config.json and the safetensors headers alone."""
    import torch
    from transformers import AutoConfig

    from cupool.budget import (MARGIN_BYTES, rows_and_host, rows_for_budget,
                               staging_and_tables_bytes)
    from cupool.checkpoints import open_checkpoint
    from cupool.dense_nvfp4 import (is_projection_weight, quantize_shape_error,
                                    step_projection_weights)
    from cupool.gemm import workspace_bytes
    from cupool.hosttable import is_table_name, table_patterns, ties_embeddings
    from cupool.kvcache import engine_reserve, kv_bytes_per_token, state_bytes_per_slot
    from cupool.layout import RowLayout, dense_strips_bytes
    from cupool.store import fmt_bytes

    dtype = torch.bfloat16
    with open_checkpoint(args.model, include_mtp=args.mtp) as ck:
        config = AutoConfig.from_pretrained(args.model)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        K = int(getattr(text, "num_experts_per_tok", 0) or 0)
        if K < 1:
            raise ValueError(f"{args.model}/config.json gives no num_experts_per_tok (top-k)")
        L, E, H, I = len(ck.moe_layers), ck.num_experts, ck.hidden, ck.intermediate
        dense = ck.dense_bytes(dtype)
        patterns = table_patterns(config)
        item = torch.empty((), dtype=dtype).element_size()
        tables = sum(math.prod(ck.dense_shape(n)) * item for n in ck.dense_names()
                     if is_table_name(n, patterns))
        dense -= tables
        dense_read = {n: math.prod(ck.dense_shape(n)) * item for n in ck.dense_names()
                      if not is_table_name(n, patterns)}
        # NVFP4 attention projections: kept packed beside their weights (from_pretrained), and
        # what the fused step's GEMVs read instead of them
        packed = {n: ck.dense_nvfp4_bytes([n]) for n in ck.dense_names()
                  if is_projection_weight(n) and ck.dense_kind(n) == "nvfp4"}
        # --quantize-attention: the other projections quantized at load, packed the same way
        # (those of attention modules the fused step reads: not an MLA attention's o_proj)
        quantized = {n: dense_strips_bytes(*ck.dense_shape(n))
                     for n in step_projection_weights(ck.dense_names()) if n not in packed
                     and len(ck.dense_shape(n)) == 2} if args.quantize_attention else {}
        for n in quantized:
            if (why := quantize_shape_error(n, *ck.dense_shape(n))) is not None:
                raise ValueError(f"--quantize-attention: {why}")
        packed.update(quantized)
        dense += sum(packed.values())
        fused_read = {**dense_read, **packed}
        sizes = ck.expert_sizes()
        fmt = ck.format
        bias = ck.has_bias
        gated = ck.gated
    layout = RowLayout(H, I, bias=bias, gated=gated)
    stride = layout.row_stride
    limit = getattr(text, "max_position_embeddings", None)
    context = args.context or min(4096, limit or 4096)
    reserve = engine_reserve(config, max_batch=args.batch, max_len=context,
                             resume_points=args.resume_points)
    per_token, per_slot = kv_bytes_per_token(config), state_bytes_per_slot(config)
    work = workspace_bytes(layout, K, args.batch, args.prefill_tokens, E) + \
        staging_and_tables_bytes(L, E, args.batch * K, stride)
    fixed = dense + work + MARGIN_BYTES
    print(f"model        {getattr(config, 'model_type', '?')}, checkpoint {fmt}: {L} MoE layers of "
          f"{E} experts (top-{K}), H={H}, I={I}")
    print(f"dense part   {fmt_bytes(dense):>12}  on the GPU (bf16"
          + (f"; {len(packed)} NVFP4 attention projections also kept packed, "
             f"{fmt_bytes(sum(packed.values()))}" if packed else "")
          + (f", {len(quantized)} of them quantized at load" if quantized else "")
          + ")")
    what = "NVFP4 + biases" if bias else "NVFP4"
    print(f"experts      {fmt_bytes(sizes.store_bytes):>12}  in pinned host memory "
          f"({L} x {E} rows of {fmt_bytes(layout.row_bytes)}, {what})")
    if tables:
        print(f"host tables  {fmt_bytes(tables):>12}  in pinned host memory (read by the GPU in "
              f"place: {', '.join(patterns)})")
    print(f"KV cache     {fmt_bytes(reserve.kv):>12}  on the GPU ({args.batch} x {context} "
          f"tokens, {fmt_bytes(per_token)} a token)")
    if per_slot:
        print(f"slot states  {fmt_bytes(reserve.states):>12}  on the GPU (recurrent states of "
              f"{args.batch} slots, {fmt_bytes(per_slot)} a slot)")
        print(f"resume pts   {fmt_bytes(reserve.resume_points):>12}  on the GPU ({reserve.points} "
              f"copies of a slot's states for prefix reuse, --resume-points)")
    print(f"workspaces   {fmt_bytes(work):>12}  on the GPU "
          f"(GEMM, staging rows, planner tables)")
    if limit and context > limit:
        print(f"context      {context} tokens: more than the model's max_position_embeddings "
              f"({limit}); it cannot be served")
        return 1
    if args.budget is None:
        print(f"budget       none given: the bank takes what the GPU has free at load time "
              f"(every expert resident needs {fmt_bytes(fixed + reserve.total + L * E * stride)})")
        return 0
    # the input embedding goes to host memory where the bank cannot hold every expert with it on
    # the GPU (cupool.budget.rows_and_host); from the checkpoint's names: an untied embed_tokens
    embedding = [n for n in dense_read if n.endswith("embed_tokens.weight")]
    tied = ties_embeddings(config)
    optional = dense_read[embedding[0]] if len(embedding) == 1 and not tied else 0

    def rows_for(extra):
        return rows_for_budget(args.budget, fixed=extra, row_stride=stride, num_layers=L,
                               top_k=K, num_experts=E, kv_reserve=reserve)
    try:
        rows, on_host = rows_and_host(rows_for, fixed, optional, E)
    except ValueError as e:
        print(f"budget       {fmt_bytes(args.budget):>12}  does not fit: {e}")
        return 1
    moved = optional if on_host else 0
    if on_host:
        print(f"embedding    {fmt_bytes(moved):>12}  in pinned host memory ({embedding[0]}: the "
              f"bank cannot hold every expert, so it takes the embedding's room; a decode step "
              f"reads a row a token over PCIe)")
    bank = rows * L * stride
    print(f"bank         {fmt_bytes(bank):>12}  {rows} rows per layer ({100 * rows / E:.0f}% of "
          f"the experts on the GPU at once)")
    on_gpu = fixed - moved + reserve.total + bank
    print(f"budget       {fmt_bytes(args.budget):>12}  fits: {fmt_bytes(on_gpu)} on the GPU, "
          f"{fmt_bytes(sizes.store_bytes + tables + moved)} pinned in host memory")
    print(speed_lines(args, rows=rows, topk=K, num_experts=E, moe_layers=L, layout=layout,
                      config=config, text=text, dense=dense_read, fused_dense=fused_read))
    return 0


def speed_lines(args, *, rows, topk, num_experts, moe_layers, layout, config, text,
                dense, fused_dense=None) -> str:
    """`plan`'s estimate of batch-1 decode speed for the bank of `rows` rows per layer. dense:
    {tensor name: bytes} the model's forward reads; fused_dense: what the fused step reads where
    it differs (NVFP4 attention projections read packed; default dense)."""
    import torch

    from cupool import estimate as est
    from cupool.store import fmt_bytes
    if args.gpu:
        gpu = args.gpu
    elif torch.cuda.is_available():
        gpu = est.device_gpu(torch.cuda.current_device())
    else:
        return (f"speed        give --gpu NAME ({', '.join(est.GPUS)}) for an estimate of "
                f"decode tokens a second")
    resident = rows >= num_experts         # its fused step skips the plan step
    if resident:
        hit, why = 1.0, "every expert in the bank"
    elif args.hit_rate is not None:
        hit, why = args.hit_rate, "--hit-rate"
    elif args.trace:
        hit, why = _trace_hit_rate(args.trace, rows, moe_layers, num_experts), f"{args.trace}"
    else:
        hit, why = rows / num_experts, "rows/E as uniform routing gives; real routing hits more " \
                                       "(--trace or --hit-rate)"
    tied = bool(getattr(config, "tie_word_embeddings", False))
    kw = dict(row_bytes=layout.row_bytes, topk=topk, moe_layers=moe_layers,
              layers=int(getattr(text, "num_hidden_layers", moe_layers) or moe_layers),
              hit_rate=hit)
    step = "fused-resident" if resident else "fused"
    fused = est.estimate(gpu, mode=step, **kw,
                         dense_bytes=est.dense_read_bytes(fused_dense or dense, tied))
    compiled = est.estimate(gpu, mode="compiled", **kw,
                            dense_bytes=est.dense_read_bytes(dense, tied))
    return "\n".join([
        f"speed        ESTIMATE for {gpu.describe()}, batch 1, hit rate {hit:.2f} ({why}):",
        f"             ~{fused.tok_per_s:.0f} tok/s decode with the fused step (serve's default), "
        f"~{compiled.tok_per_s:.0f} tok/s with the model's compiled forward; a token reads "
        f"{fmt_bytes(fused.mem_bytes)} of GPU memory and copies {fmt_bytes(fused.pcie_bytes)} "
        f"over PCIe",
        "             (cupool.estimate: bytes and a fixed time a layer, fitted to H200 "
        "measurements; not a measurement)"])


def _trace_hit_rate(path, rows: int, moe_layers: int, num_experts: int) -> float:
    """The bank's hit rate on a routing trace (reference planner, CPU), the trace checked to be
    the model's (layers, experts)."""
    from cupool import trace as tr
    from cupool.simulate import simulate as run_simulation
    t = tr.Trace.load(path)
    if (t.num_layers, t.num_experts) != (moe_layers, num_experts):
        raise ValueError(f"--trace {path}: {t.num_layers} layers of {t.num_experts} experts, the "
                         f"model has {moe_layers} MoE layers of {num_experts}")
    return float(run_simulation(t, rows, warmup_steps=min(8, t.steps - 1))["hit_rate"])


# --- generate --------------------------------------------------------------------------------------
def generate(args) -> int:
    import torch

    from cupool.engine import Engine
    from cupool.sampling import SamplingParams
    from cupool.serve.loader import enable_host_experts, load, unused_quantization

    check_host_flags(args)
    if args.host_experts and args.device == "cpu":
        raise ValueError("--host-experts applies to a CUDA device (the CPU runs the whole model "
                         "itself)")
    if (why := quantize_attention_error(args, args.device)) is not None:
        raise ValueError(why)
    t0 = time.perf_counter()
    model, pool, tok = load(args.model, args.device, budget=args.budget, max_batch=1,
                            dtype=torch.bfloat16 if args.device != "cpu" else torch.float32,
                            quantize_attention=args.quantize_attention)
    load_s = time.perf_counter() - t0
    if args.host_experts:
        hd = enable_host_experts(pool, 1, args.host_threads, args.host_leave,
                                 args.host_min_misses, args.host_prefill_tokens or 0)
        print(f"host experts: {hd.hx.threads} threads, a row {hd.cpu_us:.1f} us on the CPU "
              f"(+ {hd.cpu_call_us:.1f} a call) and {hd.link_us:.1f} us on the link"
              + ("" if hd.hands_over(1) else f"; a step of one sequence hands the host nothing "
                 f"(--host-min-misses {hd.min_misses}: its calls have at most "
                 f"{pool.top_k} misses)")
              + (f"; prompt prefill calls of up to {hd.prefill_tokens} tokens share their "
                 f"missing experts with the host" if hd.prefill_tokens else ""), file=sys.stderr)
    if args.prompt_ids is not None:
        ids = [int(x) for x in args.prompt_ids.replace(",", " ").split()]
    elif tok is None:
        raise ValueError(f"{args.model} has no tokenizer: give --prompt-ids (token ids) instead "
                         f"of --prompt")
    else:
        ids = tok(args.prompt).input_ids
    limit = getattr(model.config, "max_position_embeddings", None) or len(ids) + args.max_new_tokens
    # the fastest step by default: the fused decode step where the model fits, else the model's
    # forward through torch.compile (on a GPU)
    engine = Engine(model, pool, tokenizer=tok, max_batch=1,
                    max_len=min(limit, len(ids) + args.max_new_tokens + 1),
                    fused=False if args.no_fused else None,
                    compile=args.device != "cpu" and not args.no_compile)
    print(f"decode step: {engine.step_kind}", file=sys.stderr)
    if args.quantize_attention and (why := unused_quantization(engine)) is not None:
        print(f"warning: {why}", file=sys.stderr)
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            seed=args.seed, max_tokens=args.max_new_tokens)
    print(f"loaded in {load_s:.1f} s; prompt of {len(ids)} tokens", file=sys.stderr)
    if pool is not None:
        pool.bank.reset_stats()
    req = None
    for ev in engine.stream(ids, params):
        req = ev.request
        piece = ev.text if tok is not None else ("" if ev.token_id is None else f"{ev.token_id} ")
        print(piece, end="", flush=True)
    print()
    first = req.first_token_at - req.submitted_at if req.first_token_at else float("nan")
    print(f"{len(req.output_ids)} tokens ({req.finish_reason}); first token after {first:.2f} s; "
          f"decode {req.decode_tokens_per_s:.1f} tok/s", file=sys.stderr)
    if pool is not None:
        stats = pool.stats()
        hits, misses = sum(s["hits"] for s in stats), sum(s["misses"] for s in stats)
        print(f"bank hit rate {hits / max(1, hits + misses):.3f} ({hits} hits, {misses} misses)"
              + (f"; {sum(s.get('host', 0) for s in stats)} experts computed on the host"
                 if args.host_experts else ""), file=sys.stderr)
        print(pool.report(), file=sys.stderr)
    return 0


# --- the parser --------------------------------------------------------------------------------------
def build_parser() -> CLIParser:
    p = CLIParser(prog=PROG, description=__doc__, formatter_class=_Raw)
    sub = p.add_subparsers(dest="command", required=True, parser_class=CLIParser)
    sub.add_parser("info", help="GPU, memory, versions, and a kernel compile check")

    s = sub.add_parser("simulate", help="hit rate of the planner on a routing trace (CPU only)")
    s.add_argument("--trace", help=".npz trace from cupool.trace (default: a synthetic one)")
    s.add_argument("--rows", type=positive_int, nargs="+",
                   help="bank rows per layer (default: 25/50/100%% of E)")
    s.add_argument("--synthetic", choices=["locality", "uniform"], default="locality")
    s.add_argument("--steps", type=positive_int, default=256)
    s.add_argument("--layers", type=positive_int, default=48)
    s.add_argument("--experts", type=positive_int, default=128)
    s.add_argument("--top-k", type=positive_int, default=8)
    s.add_argument("--seed", type=nonnegative_int, default=0)
    s.add_argument("--warmup", type=nonnegative_int, default=8, help="steps not counted (cold bank)")
    s.add_argument("--streams", type=positive_int, default=1,
                   help="sequences decoded together (a synthetic trace of that many independent "
                        "streams, cupool.trace.streams; default 1)")
    s.add_argument("--promote", type=promote, default="auto", metavar="auto|N",
                   help="the cap on a step's promotions, as Pool.promote: auto (default, what a "
                        "pool does), or N (0: no cap)")
    s.add_argument("--prefetch-accuracy", type=fraction, metavar="P",
                   help="also simulate prefetching each layer's predicted experts, a fraction P "
                        "of them right (the planner's reference model; predictions drawn by "
                        "cupool.trace.with_predictions)")
    s.add_argument("--prefetch-rows", type=positive_int, metavar="N",
                   help="with --prefetch-accuracy: at most N rows a prefetch brings in "
                        "(Pool.enable_prefetch's max_rows; default: every predicted one)")

    pl = sub.add_parser("plan", help="what a checkpoint needs for a budget (no GPU, no weights)")
    pl.add_argument("--model", required=True, type=existing_dir, help="checkpoint directory")
    pl.add_argument("--budget", type=size, help="GPU memory the model may use, e.g. 24GiB")
    pl.add_argument("--context", type=positive_int,
                    help="tokens a sequence holds (default: 4096 or the model's limit if lower)")
    pl.add_argument("--batch", type=positive_int, default=1, help="sequences decoded together")
    pl.add_argument("--resume-points", type=nonnegative_int, metavar="N",
                    help="models with recurrent layers: copies of a slot's states kept for "
                         "prefix reuse, as serve's (default: 3 x --batch)")
    pl.add_argument("--prefill-tokens", type=positive_int, default=4096,
                    help="tokens of one prefill GEMM call (longer prompts run in chunks)")
    pl.add_argument("--mtp", action="store_true", help="count the MTP layers' experts too")
    pl.add_argument("--quantize-attention", action="store_true",
                    help="the attention projections quantized to NVFP4 at load, as serve's "
                         "--quantize-attention: their packed bytes on the GPU and in a token's "
                         "reads")
    pl.add_argument("--gpu", type=_table_gpu, help="estimate decode speed on this GPU (RTX 3090, RTX 4090, "
                                  "RTX 5090, RTX PRO 6000, A100, H100, H200; default: this "
                                  "machine's GPU, if any)")
    hit = pl.add_mutually_exclusive_group()
    hit.add_argument("--hit-rate", type=fraction, help="the bank's hit rate for the estimate")
    hit.add_argument("--trace", type=existing_file,
                     help="routing trace (.npz, cupool.trace) whose hit rate the estimate uses")

    g = sub.add_parser("generate", help="load a checkpoint and generate from a prompt")
    g.add_argument("--model", required=True, type=existing_dir, help="checkpoint directory")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text (needs the checkpoint's tokenizer)")
    src.add_argument("--prompt-ids", help="the prompt as token ids, e.g. '1 15 27'")
    g.add_argument("--budget", type=size, help="GPU memory the model may use, e.g. 24GiB")
    g.add_argument("--max-new-tokens", type=positive_int, default=64)
    g.add_argument("--temperature", type=nonnegative_float, default=0.0, help="0: greedy")
    g.add_argument("--top-k", type=nonnegative_int, default=0)
    g.add_argument("--top-p", type=fraction, default=1.0)
    g.add_argument("--seed", type=nonnegative_int)
    g.add_argument("--no-fused", action="store_true",
                   help="run the model's own forward instead of cupool's fused decode step")
    g.add_argument("--quantize-attention", action="store_true",
                   help="quantize the attention projections to NVFP4 at load, as serve's "
                        "--quantize-attention (CUDA)")
    g.add_argument("--no-compile", action="store_true",
                   help="where the fused step is not used, do not put the model's forward "
                        "through torch.compile (which takes tens of seconds at the start)")
    add_host_experts(g)
    g.add_argument("--device", default="cuda", help="cuda (a pool) or cpu (unwrapped, for tests)")

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    try:
        from cupool.serve.cli import add_arguments
        add_arguments(sv)
        sv.set_defaults(serve_available=True)
    except ImportError as e:
        sv.set_defaults(serve_available=False, serve_error=str(e))
    return p


def _table_gpu(text: str):
    from cupool.estimate import find_gpu
    try:
        return find_gpu(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class _Raw(argparse.RawDescriptionHelpFormatter):
    pass


def _dispatch(args) -> int:
    if args.command == "serve":
        if not args.serve_available:
            return fail(f"{PROG} serve", f"the server needs the 'serve' extra: pip install "
                                         f"'cupool[serve]' ({args.serve_error})")
        from cupool.serve.cli import run as serve
        return serve(args)
    return {"info": info, "simulate": simulate, "plan": plan, "generate": generate}[args.command](args)


def main(argv=None) -> int:
    return run(_dispatch, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
