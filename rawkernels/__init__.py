"""CUDA sources of cupool, shipped as package data (``cupool.rawkernels``).

Nothing is imported from here: :mod:`cupool.kernels` reads the ``.cu``/``.cuh`` files as text.
"""
