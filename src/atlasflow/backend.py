"""NumPy/CuPy dispatch: kernels ask their chunk which array module to use, so CPU and GPU share code."""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp


def is_gpu(x) -> bool:
    """True for CuPy arrays and cupyx sparse matrices."""
    return type(x).__module__.startswith(("cupy", "cupyx"))


def xp_of(x):
    """The array module (numpy or cupy) of a dense or sparse chunk."""
    if is_gpu(x):
        import cupy

        return cupy
    return np


def sparse_of(x):
    """The sparse module (scipy.sparse or cupyx.scipy.sparse) matching a chunk."""
    if is_gpu(x):
        import cupyx.scipy.sparse as csp

        return csp
    return sp


def issparse(x) -> bool:
    """Sparse test that works for SciPy and CuPy chunks."""
    return sparse_of(x).issparse(x)


def to_host(x):
    """A NumPy/SciPy copy of a chunk (no copy for host chunks)."""
    if is_gpu(x):
        return x.get()
    return x


def is_sparse_meta(x) -> bool:
    """Whether a Dask array's blocks are sparse (SciPy or cupyx), from its meta: nothing is computed."""
    meta = x._meta
    return sp.issparse(meta) or type(meta).__module__.startswith("cupyx.scipy.sparse")
