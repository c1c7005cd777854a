"""cupool: serve Mixture-of-Experts models whose experts do not fit in GPU memory.

Expert weights live in pinned host memory in NVFP4; one GPU bank of expert rows, shared by all MoE
layers, holds the hot ones; a planner on the GPU decides hits, misses and evictions so that a whole
decode step stays inside one CUDA graph. ARCHITECTURE.md describes how.

    pool = cupool.wrap(model, budget="40GiB")      # quantize experts, build store + bank
    out = cupool.GraphDecoder(model, pool, max_len=1024).generate(input_ids, 256)
    print(pool.stats_table()); print(pool.report())

`import cupool` needs neither a GPU nor CuPy; GPU features say which extra to install.
"""

from cupool.budget import BudgetError, parse_bytes, report
from cupool.decode import GraphDecoder
from cupool.layout import RowLayout
from cupool.pool import Pool
from cupool.store import HostStore
from cupool.wrap import wrap

__version__ = "0.1.0"

__all__ = [
           "BudgetError",
           "GraphDecoder",
           "HostStore",
           "Pool",
           "RowLayout",
           "__version__",
           "parse_bytes",
           "report",
           "wrap",
]
