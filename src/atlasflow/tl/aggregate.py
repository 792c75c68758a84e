"""Pseudobulk out of core: ``scanpy.get.aggregate`` (sum, mean, var, count_nonzero) in one pass over X.

Each row block contributes indicator products ``G @ X``, ``G @ X**2`` and ``G @ (X != 0)`` (kernel
``group_moments``); the per-block partials are summed on the workers and only the small
groups x genes results reach the client. Group labels, the combination of several keys and every
formula (mean = sum / n, var = E[x^2] - E[x]^2 zeroed below scanpy's precision threshold, then scaled
by n / (n - dof); squares taken in the data's dtype) follow scanpy, so integer counts give bitwise the
same numbers.
"""

from __future__ import annotations

import logging
from itertools import product

import anndata as ad
import dask.array as da
import numpy as np
import pandas as pd

from atlasflow import kernels, progress
from atlasflow.errors import ConfigError, InputError
from atlasflow.tl._groups import lazy_matrix

log = logging.getLogger(__name__)

FUNCS = ("count_nonzero", "mean", "sum", "var")


def combine_categories(obs: pd.DataFrame, by) -> tuple[np.ndarray, pd.DataFrame]:
    """Codes of every cell's combination of ``by`` categories (-1: a label is missing) and the label frame.

    As scanpy: unused categories dropped per key, combinations named ``"a_b"`` in product order, only
    combinations that occur kept.
    """
    keys = [by] if isinstance(by, str) else list(by)
    if not keys:
        raise ConfigError("by: give at least one obs column to group by")
    missing = [k for k in keys if k not in obs.columns]
    if missing:
        raise InputError(f"by: obs has no column(s) {missing} (columns: {', '.join(map(str, obs.columns[:20]))})")
    cats = {k: pd.Categorical(obs[k]).remove_unused_categories() for k in keys}
    sizes = [len(cats[k].categories) for k in keys]
    combos = np.indices(sizes).reshape(len(keys), -1)
    names = pd.Index(["_".join(map(str, t)) for t in product(*[cats[k].categories for k in keys])])
    labels = pd.DataFrame(
        {k: pd.Categorical.from_codes(combos[i], cats[k].categories) for i, k in enumerate(keys)}, index=names
    )
    factors = np.ones(len(keys), dtype=np.int64)
    for i in range(len(keys) - 2, -1, -1):
        factors[i] = factors[i + 1] * sizes[i + 1]
    codes = np.zeros(len(obs), dtype=np.int64)
    unlabelled = np.zeros(len(obs), dtype=bool)
    for i, k in enumerate(keys):
        c = np.asarray(cats[k].codes, dtype=np.int64)
        unlabelled |= c < 0
        codes += c * factors[i]
    codes[unlabelled] = -1
    n_combos = int(np.prod(sizes)) if sizes else 0
    used = np.flatnonzero(np.bincount(codes[codes >= 0], minlength=n_combos))
    remap = np.full(n_combos, -1, dtype=np.int64)
    remap[used] = np.arange(used.shape[0])
    codes = np.where(codes >= 0, remap[np.maximum(codes, 0)], -1)
    return codes, labels.iloc[used]


def aggregate(adata: ad.AnnData, by, func, *, dof: int = 1, layer: str | None = None) -> ad.AnnData:
    """Aggregate X (or a layer) over groups of cells, as ``scanpy.get.aggregate(adata, by, func, axis=0)``.

    Returns an in-memory AnnData (groups x genes) with one float64 layer per function, the group
    labels and ``n_obs_aggregated`` (cells per group, as scanpy >= 1.12 adds) as obs columns and ``adata.var``. Cells with a missing label are left out (with a warning;
    scanpy fails on them). ``median`` is not available out of core.
    """
    funcs = [func] if isinstance(func, str) else list(func)
    if unknown := [f for f in funcs if f not in FUNCS]:
        raise ConfigError(f"func: {unknown} not supported (choose from {', '.join(FUNCS)})")
    if not funcs:
        raise ConfigError("func: give at least one of " + ", ".join(FUNCS))
    if dof < 0:
        raise ConfigError(f"dof: must be >= 0, got {dof}")
    x = lazy_matrix(adata, layer, "aggregate")
    codes, labels = combine_categories(adata.obs, by)
    if (n_out := int((codes < 0).sum())):
        log.warning("aggregate: %d cells have no label in %s and are left out", n_out, by)
    k, m = len(labels), x.shape[1]
    if k == 0:
        raise InputError(f"by: no cell has a label in {by}")
    squares = "var" in funcs
    codes_d = da.from_array(codes, chunks=(x.chunks[0],))[:, None]
    (flat,) = progress.compute(kernels.over_blocks(x, kernels.group_moments, 3 * k * m + 1, codes_d, k, squares),
                               label="aggregate")
    sums, sq, nnz = (flat[i * k * m : (i + 1) * k * m].reshape(k, m) for i in range(3))
    counts = np.bincount(codes[codes >= 0], minlength=k)
    layers = {}
    if "sum" in funcs:
        layers["sum"] = sums
    if "mean" in funcs and "var" not in funcs:
        layers["mean"] = sums / counts[:, None]
    if "count_nonzero" in funcs:
        layers["count_nonzero"] = nnz.astype(np.int64)  # exact integer sums; int64 as scanpy >= 1.12
    if "var" in funcs:
        mean_ = sums / counts[:, None]
        mean_sq = sq / counts[:, None]
        sq_mean = mean_**2
        var_ = mean_sq - sq_mean
        precision = 2 << (42 if np.dtype(x.dtype) == np.float64 else 20)
        var_[precision * var_ < sq_mean] = 0
        if dof != 0:
            with np.errstate(divide="ignore", invalid="ignore"):
                var_ *= (counts / (counts - dof))[:, np.newaxis]
        layers["var"] = var_
        if "mean" in funcs:
            layers["mean"] = mean_
    obs = labels.copy()
    obs["n_obs_aggregated"] = counts.astype(np.int64)  # as scanpy >= 1.12
    return ad.AnnData(layers=layers, obs=obs, var=adata.var.copy())
