"""Helpers for the out-of-core oracle tests: Dask-backed AnnData from scanpy snapshots, read counting."""

from __future__ import annotations

import contextlib
from collections import Counter
from pathlib import Path

import anndata as ad
import dask.array as da
import numpy as np
import scipy.sparse as sp
import zarr


def lazy(snapshot: ad.AnnData, chunk_rows: int, *, dense: bool = False) -> ad.AnnData:
    """A copy of a scanpy snapshot whose X is a Dask array of row blocks (CSR, or ndarray when dense)."""
    x = snapshot.X
    x = (x.toarray() if sp.issparse(x) else np.asarray(x)) if dense else sp.csr_matrix(x)
    X = da.from_array(x, chunks=(chunk_rows, x.shape[1]), asarray=False)
    return ad.AnnData(X=X, obs=snapshot.obs.copy(), var=snapshot.var.copy(), uns=dict(snapshot.uns))


def store_of(snapshot: ad.AnnData, path: Path, chunk_rows: int, *, dense: bool = False) -> Path:
    """Write a snapshot as an atlasflow store with ``chunk_rows`` row blocks."""
    from atlasflow.store import write_store

    return write_store(lazy(snapshot, chunk_rows, dense=dense), path, chunk_rows=chunk_rows)


@contextlib.contextmanager
def count_x_passes(store: Path):
    """Count passes over X of ``store`` in this process (use with the synchronous scheduler).

    A pass reads every stored value of a CSR X (``X/data``) or every row of a dense X once, in whatever
    pieces the reader takes them; the yielded Counter's 'X' becomes the values (rows) read over those stored,
    once the block ends. Dask's empty metadata probes read nothing.
    """
    orig = zarr.Array.__getitem__
    counts: Counter = Counter()
    tag = Path(store).name
    read = Counter()

    def counting(self, selection):
        out = orig(self, selection)
        where = str(self.store_path).rstrip("/")
        if where.endswith(f"{tag}/X/data"):
            read["values"] += np.size(out)
        elif where.endswith(f"{tag}/X"):
            read["rows"] += np.shape(out)[0] if np.ndim(out) else 0
        return out

    zarr.Array.__getitem__ = counting
    try:
        yield counts
    finally:
        zarr.Array.__getitem__ = orig
        x = zarr.open_group(str(store), mode="r")["X"]
        if isinstance(x, zarr.Group):
            counts["X"] = read["values"] / max(x["data"].shape[0], 1)
        else:
            counts["X"] = read["rows"] / max(x.shape[0], 1)


def jaccard(a, b) -> float:
    a, b = np.asarray(a, dtype=bool), np.asarray(b, dtype=bool)
    return float((a & b).sum() / max((a | b).sum(), 1))


def batches(n: int, k: int = 3, seed: int = 0):
    """A deterministic categorical batch label per cell."""
    import pandas as pd

    rng = np.random.default_rng(seed)
    return pd.Categorical(np.array([f"b{i}" for i in range(k)])[rng.integers(0, k, n)])
