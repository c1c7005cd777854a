"""cupool: serve Mixture-of-Experts models whose experts do not fit in GPU memory.

Expert weights live in pinned host memory in NVFP4; one GPU bank of expert rows, shared by all MoE
layers, holds the hot ones; a planner on the GPU decides hits, misses and evictions so that a whole
decode step stays inside one CUDA graph. See DESIGN.md for the architecture.

    pool = cupool.wrap(model, budget="40GiB")      # quantize experts, build store + bank
    out = cupool.GraphDecoder(model, pool, max_len=1024).generate(input_ids, 256)
    print(pool.stats_table()); print(pool.report())

`import cupool` needs neither a GPU nor CuPy; GPU features say which extra to install.
"""

from cupool.budget import parse_bytes, report
from cupool.decode import GraphDecoder
from cupool.layout import RowLayout
from cupool.pool import BudgetError, Pool, wrap
from cupool.store import HostStore

__version__ = "0.1.0"

__all__ = ["BudgetError", "GraphDecoder", "HostStore", "Pool", "RowLayout", "parse_bytes",
           "report", "wrap", "__version__"]
