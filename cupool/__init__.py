"""cupool: serve Mixture-of-Experts models whose experts do not fit in GPU memory.

Expert weights live in pinned host memory in NVFP4; one GPU bank of expert rows, shared by all MoE
layers, holds the hot ones; a planner on the GPU decides hits, misses and evictions so that a whole
decode step stays inside one CUDA graph. ARCHITECTURE.md describes how.

    model, pool, tok = cupool.from_pretrained("Qwen/Qwen3-30B-A3B", budget="24GiB")
    engine = cupool.Engine(model, pool, tokenizer=tok, max_batch=8)
    [r] = engine.generate([tok("Hello").input_ids], cupool.SamplingParams(max_tokens=64))
    print(r.text); print(pool.stats_table()); print(pool.report())

`import cupool` needs neither a GPU nor CuPy; GPU features say which extra to install.
"""

from cupool.budget import BudgetError, parse_bytes, report
from cupool.checkpoints import CheckpointError, open_checkpoint, read_experts
from cupool.engine import Engine, Request
from cupool.layout import RowLayout
from cupool.pool import Pool
from cupool.pretrained import Loaded, from_pretrained
from cupool.sampling import SamplingParams
from cupool.store import HostStore
from cupool.wrap import wrap

__version__ = "0.1.0"

__all__ = [
    "BudgetError",
    "CheckpointError",
    "Engine",
    "HostStore",
    "Loaded",
    "Pool",
    "Request",
    "RowLayout",
    "SamplingParams",
    "__version__",
    "from_pretrained",
    "open_checkpoint",
    "parse_bytes",
    "read_experts",
    "report",
    "wrap",
]
