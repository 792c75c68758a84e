"""Import pynndescent and umap-learn with numba's on-disk cache on for their kernels.

Every stage runs in a new process, and these libraries compile their numba kernels again in each
process: ~25 s of the neighbors stage's ~38 s at 100k cells, ~10 s of UMAP's (measured here). Adding
``cache=True`` to their ``numba.njit``/``numba.jit`` decorators while they are imported makes numba keep
the machine code on disk (``NUMBA_CACHE_DIR``, else ``__pycache__`` beside the library or the user's cache
folder) and load it in later processes. The code is the same whether compiled or loaded, so results do
not change. Kernels numba cannot cache (pynndescent's ``nn_descent``, which takes its distance function
as an argument) still compile in each process. ``ATLASFLOW_NUMBA_CACHE=0`` switches this off.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import warnings

#: Modules imported with caching decorators (their submodules come with them).
LIBRARIES = ("pynndescent", "umap.umap_")


def import_with_cache() -> None:
    """Import ``LIBRARIES`` with ``cache=True`` as the default of numba's decorators (once per process).

    A library that is already imported (for example by scanpy, earlier in the same process) is left as it is.
    """
    if os.environ.get("ATLASFLOW_NUMBA_CACHE", "1") == "0" or all(m in sys.modules for m in LIBRARIES):
        return
    import numba

    originals = numba.njit, numba.jit
    numba.njit, numba.jit = (_caching(d) for d in originals)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Tensorflow not installed")
            for name in LIBRARIES:
                importlib.import_module(name)
    finally:
        numba.njit, numba.jit = originals
    # kernels that cannot be cached say so once per process when first compiled: expected, not actionable
    warnings.filterwarnings("ignore", message=r"Cannot cache compiled function", category=numba.NumbaWarning)


def _caching(decorator):
    @functools.wraps(decorator)
    def with_cache(*args, **kwargs):
        kwargs.setdefault("cache", True)
        return decorator(*args, **kwargs)

    return with_cache
