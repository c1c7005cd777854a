"""Loading real checkpoint directories: `cupool.from_pretrained` of a Qwen3-30B-A3B-shaped
checkpoint with random weights, written here first, against the same weights built in memory.

Two checkpoints are written (their experts regenerated from per-layer seeds, so no process ever
holds them all):
- ModelOpt NVFP4, all `--layers` layers (48: the full shape; ~16 GB of experts): per-expert
  names `model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.{weight, weight_scale,
  weight_scale_2, input_scale}`, `hf_quant_config.json`, the dense part in bf16;
- bf16, a `--bf16-layers` slice (16 by default, to fit the disk): the same names' `.weight` in bf16.
Each is then loaded in a child process that reports its load time, peak host RSS (VmHWM) and
peak GPU memory (torch's allocator and NVML), decodes greedily through the graph decoder, and
(for the NVFP4 one) prefills a `--context`-token prompt through the engine at a half-size bank.
A second child builds the same model in memory (the dense part from the same seed, the experts
as rows straight into `wrap`) and decodes the same prompt: the store rows (a CRC of every 7th),
the dense tensors and the tokens must be equal, the decode tok/s within a few percent. The
16-token prompt goes through the decode path (max_decode_tokens=16), which is deterministic; the
prefill path sums experts with fp32 atomics, whose order varies from run to run.

    python benchmarks/bench_load.py                      # full: 48 NVFP4 layers, 16 bf16 layers
    python benchmarks/bench_load.py --small              # a minute's check on a few layers

Writes benchmarks/results/bench_load.json for a full run (--json PATH for any run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import peak_rss_bytes, results_path, save  # noqa: E402

from cupool.cli import CLIParser, positive_int, run  # noqa: E402

E, K, H, I = 128, 8, 2048, 768


def shape(layers: int, context: int) -> dict:
    from cupool import synthetic
    return dict(synthetic.QWEN3_30B_A3B, num_hidden_layers=layers,
                max_position_embeddings=max(4096, context + 64))


def layer_experts(layer: int, seed: int, kind: str, device="cuda"):
    """The experts of one layer, regenerated from (seed, layer): NVFP4Tensor stacks (gate, up,
    down) for "nvfp4", bf16 tensors [E, I, H], [E, I, H], [E, H, I] for "bf16"."""
    from cupool.nvfp4 import NVFP4Tensor
    g = torch.Generator(device=device).manual_seed(seed * 1000 + layer)
    if kind == "bf16":
        return tuple(torch.randn(E, n, k, generator=g, device=device).mul_(k ** -0.5)
                     .to(torch.bfloat16) for n, k in ((I, H), (I, H), (H, I)))
    out = []
    for n, k in ((I, H), (I, H), (H, I)):
        packed = torch.randint(0, 256, (E, n, k // 2), dtype=torch.uint8, generator=g, device=device)
        expo = torch.randint(3, 11, (E, n, k // 16), dtype=torch.uint8, generator=g, device=device)
        mant = torch.randint(0, 8, (E, n, k // 16), dtype=torch.uint8, generator=g, device=device)
        scale = ((expo << 3) | mant).view(torch.float8_e4m3fn)
        gs = torch.full((E,), 0.25 / k ** 0.5, dtype=torch.float32, device=device)
        out.append(NVFP4Tensor(packed, scale, gs))
    return tuple(out)


def dense_model(layers: int, context: int, seed: int, device="cuda"):
    """The dense part on `device` (random, from `seed`) and its MoE layer specs (released)."""
    from cupool import synthetic
    s = shape(layers, context)
    return synthetic.qwen3_moe_dense_on_gpu(device, torch.bfloat16, seed=seed, **s)


def write_checkpoint(path: Path, kind: str, layers: int, context: int, seed: int,
                     device="cuda") -> float:
    """Write the checkpoint directory; returns the seconds it took."""
    from safetensors.torch import save_file
    from transformers import Qwen3MoeConfig
    t0 = time.perf_counter()
    path.mkdir(parents=True, exist_ok=True)
    model, _ = dense_model(layers, context, seed, device)
    cfg = Qwen3MoeConfig(**shape(layers, context), tie_word_embeddings=False)
    cfg.dtype = "bfloat16"
    cfg.save_pretrained(path)
    weight_map = {}
    dense = {n: t.detach().cpu().contiguous() for n, t in model.state_dict().items() if t.numel()}
    save_file(dense, str(path / "dense.safetensors"), metadata={"format": "pt"})
    weight_map.update({n: "dense.safetensors" for n in dense})
    del model, dense
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    for layer in range(layers):
        mats = layer_experts(layer, seed, kind, device)
        tensors = {}
        for proj, m in zip(("gate_proj", "up_proj", "down_proj"), mats):
            for e in range(E):
                base = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
                if kind == "bf16":
                    tensors[f"{base}.weight"] = m[e].cpu()
                else:
                    tensors[f"{base}.weight"] = m.packed[e].cpu()
                    tensors[f"{base}.weight_scale"] = m.block_scale[e].cpu()
                    tensors[f"{base}.weight_scale_2"] = m.global_scale[e].cpu().reshape(())
                    tensors[f"{base}.input_scale"] = torch.ones((), dtype=torch.float32)
        fname = f"experts-{layer:03d}.safetensors"
        save_file(tensors, str(path / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in tensors})
        del mats, tensors
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {},
                                                                   "weight_map": weight_map}))
    if kind == "nvfp4":
        (path / "hf_quant_config.json").write_text(json.dumps({
            "producer": {"name": "modelopt"},
            "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                             "exclude_modules": ["lm_head", "*.mlp.gate", "*self_attn*"]}}))
    return time.perf_counter() - t0


def _peaks() -> dict:
    hwm = peak_rss_bytes()
    from cupool.budget import gpu_memory
    g = gpu_memory()
    return {"peak_host_rss_bytes": hwm, "peak_torch_gpu_bytes": torch.cuda.max_memory_allocated(),
            "nvml_process_gpu_bytes": g.process}


def _fingerprint(store, every: int = 7) -> int:
    """CRC-32 over every `every`-th row of the store (all layers)."""
    import zlib
    crc = 0
    for k in range(0, store.num_layers * store.num_experts, every):
        crc = zlib.crc32(store.row(k // store.num_experts, k % store.num_experts), crc)
    return crc


def _dense_fingerprint(model) -> float:
    """A float64 sum of every dense parameter and buffer, weighted by position (order-sensitive)."""
    total = 0.0
    for i, (_, t) in enumerate(sorted(model.state_dict().items())):
        if t.numel() and t.is_floating_point():
            total += (i + 1) * float(t.double().sum())
    return total


def _decode(model, pool, prompt, tokens: int) -> dict:
    import cupool
    eng = cupool.Engine(model, pool, max_batch=1, max_len=prompt.shape[1] + tokens,
                        eos_token_id=[])
    eng.warmup()
    rates, out = [], None
    for _ in range(3):
        pool.bank.reset_stats()
        req = eng.generate([prompt[0].tolist()],
                           cupool.SamplingParams(max_tokens=tokens, ignore_eos=True))[0]
        rates.append(req.decode_tokens_per_s)
        out = req.output_ids
    eng.close()
    return {"tokens": out, "tok_per_s": sorted(rates)[1], "tok_per_s_runs": rates,
            "hit_rate": pool.hit_rate()}


def _prefill(model, pool, context: int) -> dict:
    import cupool
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, model.config.vocab_size, (context,), generator=g).tolist()
    eng = cupool.Engine(model, pool, max_batch=1, max_len=context + 8, eos_token_id=[])
    eng.generate([ids[:64]], cupool.SamplingParams(max_tokens=2))       # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    (r,) = eng.generate([ids], cupool.SamplingParams(max_tokens=1))
    torch.cuda.synchronize()
    dt = r.first_token_at - r.submitted_at
    return {"context": context, "prefill_s": dt, "prefill_tok_per_s": context / dt,
            "wall_s": time.perf_counter() - t0}


def child(args) -> int:
    """One measured process: --child load (from_pretrained) or --child memory (built here)."""
    import cupool
    from cupool.layout import RowLayout, pack_rows
    rows = E // 2
    t0 = time.perf_counter()
    if args.child == "load":
        model, pool, _ = cupool.from_pretrained(args.dir, rows=rows, max_decode_tokens=16,
                                                progress=False)
    else:
        model, specs = dense_model(args.layers, args.context, args.seed)
        layout = RowLayout(H, I)

        def experts(layer):
            mats = layer_experts(layer, args.seed, args.kind)
            if args.kind == "bf16":
                from cupool.ops.nvfp4_quant import quantize
                mats = tuple(quantize(m) for m in mats)
            return pack_rows(layout, *mats)
        pool = cupool.wrap(model, rows=rows, layers=specs, expert_rows=experts,
                           max_decode_tokens=16, progress=False)
    torch.cuda.synchronize()
    out = {"load_s": time.perf_counter() - t0, "store_bytes": pool.store.nbytes,
           "bank_rows_per_layer": rows, **_peaks(), "store_fingerprint": _fingerprint(pool.store),
           "dense_fingerprint": _dense_fingerprint(model)}
    prompt = torch.randint(0, model.config.vocab_size, (1, 16),
                           generator=torch.Generator().manual_seed(3)).cuda()
    out["decode"] = _decode(model, pool, prompt, args.tokens)
    if args.prefill and args.child == "load":
        out["prefill"] = _prefill(model, pool, args.context)
    out["peaks_after_all"] = _peaks()
    print("RESULT " + json.dumps(out))
    return 0


def _run_child(mode: str, kind: str, layers: int, directory: Path, args) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--kind", kind, "--layers", str(layers),
           "--dir", str(directory), "--tokens", str(args.tokens), "--seed", str(args.seed),
           "--context", str(args.context)] + (["--prefill"] if kind == "nvfp4" else [])
    print("$ " + " ".join(cmd[1:]), flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    if r.returncode:
        raise RuntimeError(f"the {mode} child failed:\n{r.stderr[-4000:]}")
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main(args) -> int:
    from cupool import _cuda
    from cupool.store import fmt_bytes
    _cuda.require_gpu("bench_load")
    if args.child:
        return child(args)
    small = args.small
    nv_layers = 2 if small else args.layers
    bf_layers = 2 if small else args.bf16_layers
    context = 2048 if small else args.context
    args.context = context
    results = {"shape": "Qwen3-30B-A3B" if not small else "Qwen3-30B-A3B dims, 2 layers",
               "E": E, "K": K, "H": H, "I": I, "bank": "50% of each layer's experts",
               "cases": {}}
    with tempfile.TemporaryDirectory(dir=args.dir_root) as root:
        for kind, layers in (("nvfp4", nv_layers), ("bf16", bf_layers)):
            d = Path(root) / kind
            write_s = write_checkpoint(d, kind, layers, context, args.seed)
            size = sum(f.stat().st_size for f in d.iterdir())
            print(f"{kind}: wrote {layers} layers, {fmt_bytes(size)} in {write_s:.1f} s", flush=True)
            loaded = _run_child("load", kind, layers, d, args)
            memory = _run_child("memory", kind, layers, d, args)
            same = loaded["decode"]["tokens"] == memory["decode"]["tokens"]
            same_store = loaded["store_fingerprint"] == memory["store_fingerprint"]
            same_dense = loaded["dense_fingerprint"] == memory["dense_fingerprint"]
            ratio = loaded["decode"]["tok_per_s"] / memory["decode"]["tok_per_s"]
            results["cases"][kind] = {
                "layers": layers, "checkpoint_bytes": size, "write_s": write_s,
                "from_pretrained": loaded, "in_memory": memory,
                "tokens_equal": same, "store_rows_equal": same_store,
                "dense_equal": same_dense, "decode_tok_per_s_ratio": ratio,
                "host_rss_minus_store_bytes": loaded["peak_host_rss_bytes"] - loaded["store_bytes"]}
            print(f"{kind}: load {loaded['load_s']:.1f} s, peak RSS "
                  f"{fmt_bytes(loaded['peak_host_rss_bytes'])} (store "
                  f"{fmt_bytes(loaded['store_bytes'])}), peak GPU (torch) "
                  f"{fmt_bytes(loaded['peak_torch_gpu_bytes'])}; store rows equal {same_store}, dense equal "
                  f"{same_dense}, tokens equal {same}; decode "
                  f"{loaded['decode']['tok_per_s']:.1f} vs {memory['decode']['tok_per_s']:.1f} "
                  f"tok/s ({ratio:.3f})", flush=True)
            if "prefill" in loaded:
                pf = loaded["prefill"]
                print(f"{kind}: {pf['context']}-token prompt prefilled in {pf['prefill_s']:.2f} s "
                      f"= {pf['prefill_tok_per_s']:.0f} tok/s", flush=True)
            for f in d.iterdir():
                f.unlink()
    reduced = (["--small"] if small else []) + ([f"--layers {nv_layers} < 48"] if nv_layers < 48 else [])
    save("bench_load", results, results_path("bench_load", args.json, reduced))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = CLIParser(prog="bench_load.py", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=positive_int, default=48, help="NVFP4 checkpoint layers")
    p.add_argument("--bf16-layers", type=positive_int, default=16, help="bf16 checkpoint layers")
    p.add_argument("--tokens", type=positive_int, default=64, help="greedy tokens decoded")
    p.add_argument("--context", type=positive_int, default=32768, help="prompt of the prefill run")
    p.add_argument("--seed", type=positive_int, default=1)
    p.add_argument("--small", action="store_true", help="2 layers each, a 2048-token prompt")
    p.add_argument("--dir-root", default=None, help="where checkpoints are written (default: TMP)")
    p.add_argument("--json", help="write the results here (default: results/bench_load.json "
                                  "for a full run, nothing otherwise)")
    p.add_argument("--child", choices=["load", "memory"], help=argparse.SUPPRESS)
    p.add_argument("--kind", choices=["nvfp4", "bf16"], default="nvfp4", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    p.add_argument("--prefill", action="store_true", help=argparse.SUPPRESS)
    return p


if __name__ == "__main__":
    sys.exit(run(main, build_parser()))
