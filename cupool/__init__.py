"""cupool: serve Mixture-of-Experts models whose experts do not fit in GPU memory.

Expert weights live in pinned host memory in NVFP4; one GPU bank of expert rows, shared by all MoE
layers, holds the hot ones; a planner on the GPU decides hits, misses and evictions so that a whole
decode step stays inside one CUDA graph. See DESIGN.md for the architecture.

`import cupool` needs neither a GPU nor CuPy; GPU features say which extra to install.
"""

from cupool.budget import parse_bytes, report
from cupool.store import HostStore

__version__ = "0.1.0"

__all__ = ["HostStore", "parse_bytes", "report", "__version__"]
