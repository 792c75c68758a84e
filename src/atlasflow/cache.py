"""Keep a stored matrix that a stage reads twice in the workers' memory between its passes, when it is small.

PCA reads X twice (Gram matrix, then projection: the second pass needs the first one's eigenvectors). When
the blocks, as they are in memory, take at most ``SHARE`` of the workers' memory, they are read once and
kept on the workers until the stage is done with them; otherwise each pass streams them from the store
again, so memory stays bounded by the chunk whatever the number of cells. The results are the same either
way (the same tasks on the same blocks).

Only host (NumPy/SciPy) blocks read unchanged from a store, and only on a distributed cluster: a GPU's
memory is counted differently, and a computed matrix has no size known before it is computed.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import dask.array as da
import numpy as np

log = logging.getLogger(__name__)

#: most of the workers' summed memory limit that a kept matrix may take
SHARE = 0.1


@contextmanager
def kept(x: da.Array, label: str):
    """Yield ``x`` persisted on the workers if it is small enough (logged), else ``x``; released on exit."""
    from atlasflow import passes, progress

    client = progress.client_or_none()
    size = matrix_bytes(x)
    budget = None if client is None or size is None else SHARE * workers_memory(client)
    if budget is None or size > budget:
        yield x
        return
    log.info("%s: keeping X in the workers' memory between passes (%.0f MiB, at most %.0f%% of theirs)",
             label, size / 2**20, 100 * SHARE)
    passes.count(x)
    held = client.persist(x)
    try:
        with passes.held(held):  # same layer name, now results in memory: reading them is no pass
            yield held
    finally:
        from distributed import futures_of

        progress.release(futures_of(held))


def matrix_bytes(x: da.Array) -> int | None:
    """The in-memory size of a host matrix read unchanged from a store (CSR or dense), else None."""
    import zarr

    from atlasflow.backend import is_sparse_meta
    from atlasflow.sources import source_of

    src = source_of(x)
    if src is None or type(x._meta).__module__.split(".")[0] not in ("numpy", "scipy"):
        return None
    if not is_sparse_meta(x):
        return int(x.nbytes)
    path, key = src
    data = zarr.open_group(path, mode="r")[key]["data"]
    return int(data.shape[0]) * (data.dtype.itemsize + np.dtype(np.int32).itemsize) + 8 * (x.shape[0] + 1)


def workers_memory(client) -> int:
    """The summed memory limit of the cluster's workers (a worker without a limit counts the machine's RAM)."""
    import psutil

    workers = client.scheduler_info(n_workers=-1)["workers"].values()
    ram = psutil.virtual_memory().total
    return int(sum(w.get("memory_limit") or ram for w in workers))
