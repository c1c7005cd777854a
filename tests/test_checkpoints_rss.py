"""Peak host memory of fill_store: a pageable store filled from a bf16 checkpoint with 2.01 GB of
experts (4 layers × 20 experts × H = I = 2048, Qwen3-MoE names, two shards) stays within
baseline + store bytes + the stated window bound + ALLOWANCE.

The CPU reference quantizer needs about 0.5 s an expert of this size on a 2-core machine (44 s for
all 80), so by default the child reads every window of all 2.01 GB through `Checkpoint.experts`
(what fill_store reads) and fills a store of one of the four layers (20 experts quantized and
laid out, about 11 s); CUPOOL_RSS_FULL=1 fills all four layers instead (a one-layer store is the
bound's worst case relative to the store: the same window bound on a quarter of the rows).

The fill runs in a child process so this test's own allocations (the fixture writer's) do not
count; the child reads its peak resident set from /proc/self/status (VmHWM, reset to the current
RSS through /proc/self/clear_refs after the baseline where the kernel allows it). The checkpoint
is read with plain reads into fresh window tensors (cupool.checkpoints.index), never memory-mapped,
so no file pages stay mapped and resident: the child also reports RssFile (file-backed resident
pages) before and after, which must not grow by more than a few MiB although 2 GB went through.

ALLOWANCE (64 MiB) covers what is neither the store nor a window: glibc arenas and torch's
intra-op thread pool growing on the first large operation, and the row being copied in.
"""

import json
import math
import os
import subprocess
import sys
import zlib

import pytest
import torch
from checkpoint_fixtures import write_streaming

L, E, H, I = 4, 20, 2048, 2048
ALLOWANCE = 64 << 20
POOL = 1 << 23                       # bf16 values the expert data is cut from

CHILD = r"""
import json, sys, time, zlib
import torch
from cupool.checkpoints import default_window, expert_temp_bytes, fill_store, open_checkpoint
from cupool.layout import RowLayout, pack_rows
from cupool.nvfp4 import quantize
from cupool.store import HostStore

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return None

ck = open_checkpoint(sys.argv[1])
lay = RowLayout(ck.hidden, ck.intermediate)
w = torch.randn(2, 64, 64)                      # warm the quantizer and pack_rows on a toy
small = RowLayout(64, 64)
pack_rows(small, quantize(w), quantize(w), quantize(w))
base, file_before = status("VmRSS"), status("RssFile")
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                            # VmHWM := VmRSS
    reset = True
except OSError:
    reset = False
full = sys.argv[2] == "full"
layers = ck.moe_layers if full else ck.moe_layers[-1:]
store = HostStore(len(layers), ck.num_experts, lay.row_bytes, pinned=False)
t0 = time.time()
read = 0
if not full:                                    # every byte of every window, as fill_store reads
    n = default_window(lay, 2)
    for layer in ck.moe_layers:
        for lo in range(0, ck.num_experts, n):
            ex = ck.experts(layer, lo, min(ck.num_experts, lo + n))
            read += sum(t.numel() * t.element_size() for t in (ex.gate, ex.up, ex.down))
            del ex
fill_store(store, ck, lay, layers=layers, progress=False)
seconds = time.time() - t0
peak, file_after = status("VmHWM"), status("RssFile")
rows = {f"{layers[l]},{e}": zlib.crc32(store.row(l, e))
        for l, e in ((0, 0), (len(layers) - 1, 19), (len(layers) - 1, 7))}
print(json.dumps({"base": base, "peak": peak, "reset": reset, "store": store.nbytes,
                  "window": default_window(lay, 2), "per_expert": expert_temp_bytes(lay, 2),
                  "file_before": file_before, "file_after": file_after, "seconds": seconds,
                  "expert_bytes": ck.expert_sizes().checkpoint_bytes, "read": read,
                  "layers": len(layers), "crc": rows}))
"""


def _pool():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(POOL, generator=g) * 0.05).to(torch.bfloat16).view(torch.uint8).numpy()


def _data(pool, name, n):
    """The bytes of tensor `name`: the pool, cyclically, from an offset its name gives."""
    start = 2 * (zlib.crc32(name.encode()) % POOL)
    done = 0
    while done < n:
        m = min(len(pool) - start, n - done)
        yield pool[start:start + m]
        done += m
        start = 0


def _tensor(pool, name, shape):
    n = math.prod(shape) * 2
    return torch.frombuffer(bytearray(b"".join(_data(pool, name, n))),
                            dtype=torch.bfloat16).reshape(shape)


@pytest.mark.slow
def test_fill_peak_rss(tmp_path):
    d = tmp_path / "big"
    d.mkdir()
    pool = _pool().tobytes()
    specs = [(f"model.layers.{li}.mlp.experts.{e}.{p}.weight", "BF16",
              (H, I) if p == "down_proj" else (I, H))
             for li in range(L) for e in range(E) for p in ("gate_proj", "up_proj", "down_proj")]
    half = len(specs) // 2
    wm = {}
    for k, part in enumerate((specs[:half], specs[half:])):
        fname = f"model-{k + 1:05d}-of-00002.safetensors"
        write_streaming(d / fname, part, lambda name, n: _data(pool, name, n))
        wm.update({s[0]: fname for s in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    (d / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": H,
        "moe_intermediate_size": I, "num_experts": E, "num_hidden_layers": L,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "torch_dtype": "bfloat16"}))
    mode = "full" if os.environ.get("CUPOOL_RSS_FULL") == "1" else "part"
    r = subprocess.run([sys.executable, "-c", CHILD, str(d), mode], check=False, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    assert m["expert_bytes"] >= 2_000_000_000
    assert mode == "full" or m["read"] == m["expert_bytes"]
    bound = m["base"] + m["store"] + m["window"] * m["per_expert"] + ALLOWANCE
    mib = {k: round(m[k] / 2**20, 1) for k in ("base", "peak", "store", "per_expert",
                                               "file_before", "file_after", "expert_bytes")}
    print(f"{mode}: {m['expert_bytes'] / 1e9:.2f} GB of bf16 experts, {m['layers']} layers "
          f"filled, in {m['seconds']:.1f} s: "
          f"{mib} (MiB), window {m['window']}, peak - base - store = "
          f"{(m['peak'] - m['base'] - m['store']) / 2**20:.1f} MiB, bound "
          f"{(bound - m['base'] - m['store']) / 2**20:.1f} MiB, VmHWM reset: {m['reset']}")
    assert m["peak"] <= bound, mib
    assert m["file_after"] - m["file_before"] <= 16 << 20, mib     # no mapped pages pile up
    # the rows are those of the reference quantizer (three experts checked)
    from cupool.layout import RowLayout, pack_row
    from cupool.nvfp4 import quantize
    lay = RowLayout(H, I)
    for key, crc in m["crc"].items():
        li, e = (int(x) for x in key.split(","))
        mats = [quantize(_tensor(pool, f"model.layers.{li}.mlp.experts.{e}.{p}.weight", shape))
                for p, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I)))]
        assert zlib.crc32(pack_row(lay, *mats).numpy()) == crc, key
