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


def to_backend(adata, backend: str):
    """Put a lazily opened AnnData's X and layers on the backend's device, in place; returns ``adata``.

    ``backend`` is ``cpu`` (nothing changes), ``gpu`` (row blocks become CuPy / cupyx CSR, see
    :func:`atlasflow.gpu.to_device`) or ``auto``. Stages call it right after ``open_store``; kernels then run
    unchanged and writes bring blocks back to host memory.
    """
    if backend == "auto":
        from atlasflow.cluster import validate_backend

        backend = validate_backend(backend)
    if backend != "gpu":
        return adata
    from atlasflow.gpu import to_device

    if adata.X is not None:
        adata.X = to_device(adata.X)
    for key in list(adata.layers.keys()):
        adata.layers[key] = to_device(adata.layers[key])
    return adata
