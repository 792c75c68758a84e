"""Compile the package's numba kernels once, in a short-lived process, before a shared cluster's workers start.

With a cold on-disk cache (a fresh install, or a changed kernel module) numba compiles a kernel in every
process that first calls it, and the compiler's memory stays with that process: after qc on a cold cache
each worker held ~220 MiB more than on a warm one (482 against 261 MiB, 20k cells, measured). A shared
cluster's workers live for the whole workflow, so that memory counted in every later stage's peak.
Compiled here first, the workers load the machine code from the cache instead. The code is the same
whether compiled or loaded, so results do not change.

The kernels are called through the functions the stages call, on tiny inputs of the stored dtypes
(float32 values, int32 indices); a call with other dtypes still compiles where it runs, as before.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import numpy as np
from scipy import sparse

log = logging.getLogger(__name__)


def warm() -> None:
    """Call every numba kernel of ``kernels`` once, so that numba compiles and caches it."""
    from . import kernels

    x = sparse.random(6, 4, density=0.6, format="csr", dtype=np.float32, random_state=0)
    x.indices = x.indices.astype(np.int32)
    x.indptr = x.indptr.astype(np.int32)
    kernels.top_n_fractions(x, [1, 2])
    mean, std = np.full(4, 0.5), np.ones(4)
    kernels.scaled_gram_and_sums(x, mean, std, True, 10.0, np.float32)
    codes = np.array([0, 0, 0, 1, 1, 1])
    kernels.gene_block_ranks(x.T.tocsr(), codes, 2, np.array([3.0, 3.0]), [0, 1], None)
    kernels.place_gene_runs(x.data, np.ones(x.nnz, np.uint16), np.array([x.nnz], np.uint32),
                            np.zeros(1, np.int64), 0, np.empty_like(x.data), np.empty(x.nnz, np.int32))


def in_subprocess(timeout: float = 600) -> None:
    """``warm()`` in a child process, so that the compiler's memory goes when it exits; failures only warn."""
    t0 = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", __name__], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        log.warning("compiling the numba kernels took over %.0f s; workers will compile what they need", timeout)
        return
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        log.warning("could not compile the numba kernels ahead of the workers (%s); they will compile them", last)
        return
    log.info("numba kernels compiled or loaded from the cache in %.1f s", time.perf_counter() - t0)


if __name__ == "__main__":
    warm()
