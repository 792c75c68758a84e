"""``regress_out`` out of core: least squares from per-block ``CᵀX``, residuals written block by block.

scanpy's ``regress_out`` (1.11) does, for numeric keys, one ordinary least squares fit of every gene on
``[1, keys...]`` via the normal equations (``inv(CᵀC) @ CᵀX``) and stores ``X - C @ coef`` rounded to X's
float dtype; ``CᵀC`` is small and built from obs on the client, ``CᵀX`` is a sum of per-block partials.
For one categorical key it fits, per gene, a GLM on ``[1, mean of the gene in the cell's category]``, whose
least-squares solution is exactly the category mean: the residual is ``x - mean_category(x)``; genes that
are constant are left unchanged (scanpy skips them). scanpy keeps the category means in float32 (and
returns float64); here they are float64 sums and the result keeps X's float dtype, which agrees with
scanpy to about float32 rounding of the means.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import anndata as ad
import numpy as np
import pandas as pd

from atlasflow import kernels, progress
from atlasflow.errors import ConfigError, InputError
from atlasflow.pp._utils import get_matrix, row_aligned, set_matrix, shared

log = logging.getLogger(__name__)


def _out_dtype(dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    if np.issubdtype(dtype, np.floating):
        return dtype
    return np.dtype(np.float32 if dtype.itemsize <= 4 else np.float64)


def regress_out(
    adata: ad.AnnData,
    keys: str | Sequence[str],
    *,
    layer: str | None = None,
    n_jobs: int | None = None,
    copy: bool = False,
):
    """Regress out obs ``keys`` (numeric, or one categorical) from every gene, lazily: X becomes dense residuals.

    One pass over X computes the fit (``CᵀX`` or per-category sums); the residuals are a lazy Dask array
    (a second pass when written). ``n_jobs`` is accepted for scanpy compatibility (Dask decides parallelism).
    """
    adata = adata.copy() if copy else adata
    keys = [keys] if isinstance(keys, str) else list(keys or [])
    if not keys:
        raise ConfigError("regress_out: keys is empty; name one or more obs columns")
    missing = [k for k in keys if k not in adata.obs]
    if missing:
        raise InputError(f"regress_out: keys {missing} are not columns of obs")
    X = get_matrix(adata, layer, "regress_out")
    dtype = _out_dtype(X.dtype)
    first = adata.obs[keys[0]]
    if isinstance(first.dtype, pd.CategoricalDtype) or first.dtype == object or pd.api.types.is_string_dtype(first):
        if len(keys) > 1:
            raise ConfigError(f"regress_out: keys={keys}: a categorical key must be the only key "
                              "(each gene is regressed on its mean within the categories)")
        new = _regress_categorical(X, first, keys[0], dtype)
    else:
        new = _regress_numeric(X, adata.obs, keys, dtype)
    set_matrix(adata, layer, new)
    return adata if copy else None


def _regress_numeric(X, obs: pd.DataFrame, keys: list[str], dtype):
    cols = []
    for k in keys:
        col = obs[k]
        if not (pd.api.types.is_numeric_dtype(col) or pd.api.types.is_bool_dtype(col)):
            raise InputError(f"regress_out: obs[{k!r}] is neither numeric nor categorical ({col.dtype})")
        values = col.to_numpy(dtype=np.float64)
        if not np.all(np.isfinite(values)):
            raise InputError(f"regress_out: obs[{k!r}] has missing or infinite values")
        if values.size and np.all(values == values[0]):
            raise InputError(f"regress_out: obs[{k!r}] is constant; there is nothing to regress out")
        cols.append(values)
    design = np.column_stack([np.ones(X.shape[0])] + cols)
    gram = design.T @ design
    if np.linalg.det(gram) == 0 or np.linalg.matrix_rank(gram) < gram.shape[0]:
        raise InputError(f"regress_out: keys={keys} are collinear (the design matrix is singular)")
    k, m = design.shape[1], X.shape[1]
    design_da = row_aligned(design, X)
    (ctx,) = progress.compute(kernels.over_blocks(X, kernels.design_t_x, k * m, design_da), label="regress_out: CᵀX")
    ctx = ctx.reshape(k, m)
    coef = np.linalg.inv(gram) @ ctx
    log.info("regress_out: fitted %d genes on %s", m, keys)
    return X.map_blocks(kernels.regress_residuals, design_da, shared(coef), dtype, dtype=dtype,
                        chunks=X.chunks, meta=np.empty((0, 0), dtype=dtype))


def _regress_categorical(X, col: pd.Series, key: str, dtype):
    if col.isna().any():
        raise InputError(f"regress_out: obs[{key!r}] has missing values")
    cat = col.astype("category").cat.remove_unused_categories()
    n_cat = len(cat.cat.categories)
    if n_cat < 2:
        raise InputError(f"regress_out: obs[{key!r}] has a single category; there is nothing to regress out")
    codes = cat.cat.codes.to_numpy().astype(np.int64)
    m = X.shape[1]
    codes_da = row_aligned(codes, X)
    stats = kernels.over_blocks(X, kernels.col_stats_grouped, n_cat * 3 * m, codes_da, n_cat)
    lo = X.map_blocks(lambda b: np.asarray(kernels.col_min_max(b)).reshape(1, 2 * m),
                      chunks=((1,) * X.numblocks[0], (2 * m,)), dtype=np.float64, meta=np.empty((0, 0)))
    stats, bounds = progress.compute(stats, lo, label="regress_out: category means")
    sums = stats.reshape(n_cat, 3, m)[:, 0]
    means = sums / np.bincount(codes, minlength=n_cat)[:, None]
    keep = bounds[:, :m].min(axis=0) != bounds[:, m:].max(axis=0)
    log.info("regress_out: removing per-%s means (%d categories) from %d non-constant genes", key, n_cat, keep.sum())
    return X.map_blocks(kernels.subtract_group_means, codes_da, shared(means), shared(keep), dtype, dtype=dtype,
                        chunks=X.chunks, meta=np.empty((0, 0), dtype=dtype))
