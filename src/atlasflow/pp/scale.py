"""``scale`` out of core: per-gene mean and standard deviation from one pass, scaling lazily per block.

As ``scanpy.pp.scale``: the variance is ``E[x²] - E[x]²`` with the n/(n-1) correction (ddof=1), genes with
zero standard deviation get std 1, ``max_value`` clips above (and below at ``-max_value`` when centering).
Centering makes the result dense; ``zero_center=False`` on sparse data keeps it sparse.
"""

from __future__ import annotations

import logging

import anndata as ad
import numpy as np
import pandas as pd

from atlasflow import kernels, progress
from atlasflow.errors import ConfigError, InputError
from atlasflow.pp._utils import get_matrix, row_aligned, set_matrix, shared
from atlasflow.backend import is_sparse_meta

log = logging.getLogger(__name__)


def scale(
    adata: ad.AnnData,
    *,
    zero_center: bool = True,
    max_value: float | None = None,
    copy: bool = False,
    layer: str | None = None,
    mask_obs: np.ndarray | str | None = None,
):
    """Scale genes to unit variance and zero mean; adds ``var['mean']`` and ``var['std']`` (scanpy's names).

    With ``mask_obs`` (a boolean obs column or array) statistics come from, and scaling applies to, those
    cells only; the var columns are then ``'mean of {mask}'``/``'std of {mask}'`` (or ``'... with mask'``).
    """
    adata = adata.copy() if copy else adata
    X = get_matrix(adata, layer, "scale")
    n, m = X.shape
    if max_value is not None and not np.isfinite(float(max_value)):
        raise ConfigError(f"scale: max_value={max_value!r} must be a finite number or None")
    names = ("mean", "std")
    rows = None
    if mask_obs is not None:
        if isinstance(mask_obs, str):
            if mask_obs not in adata.obs:
                raise InputError(f"scale: mask_obs={mask_obs!r} is not a column of obs")
            names = (f"mean of {mask_obs}", f"std of {mask_obs}")
            rows = adata.obs[mask_obs].to_numpy()
        else:
            names = ("mean with mask", "std with mask")
            rows = np.asarray(mask_obs)
        if rows.dtype != bool or rows.shape != (n,):
            raise InputError(f"scale: mask_obs must be a boolean mask of the {n} cells")
        if not rows.any():
            raise InputError("scale: mask_obs selects no cell")
    dtype = X.dtype if np.issubdtype(X.dtype, np.floating) else np.dtype(np.float64)
    codes = np.zeros(n, dtype=np.int64) if rows is None else (~rows).astype(np.int64)
    n_groups = 1 if rows is None else 2
    stats = kernels.over_blocks(X, kernels.col_stats_grouped, n_groups * 3 * m, row_aligned(codes, X), n_groups)
    (stats,) = progress.compute(stats, label="scale: gene means and variances")
    stats = stats.reshape(n_groups, 3, m)
    n_used = int(n if rows is None else rows.sum())
    mean = stats[0, 0] / n_used
    var = stats[0, 1] / n_used - mean**2
    if n_used != 1:
        var *= n_used / (n_used - 1)
    std = np.sqrt(var)
    std[std == 0] = 1
    sparse = is_sparse_meta(X)
    if sparse and zero_center:
        log.info("scale: zero-centering densifies the sparse matrix")
    if not zero_center and max_value is not None:
        log.info("scale: clipping at max_value without zero_center clips only from above")
    row_mask = None if rows is None else row_aligned(rows, X)
    args = (shared(mean), shared(std), bool(zero_center), None if max_value is None else float(max_value), dtype)
    if sparse and not zero_center:
        meta = X._meta.astype(dtype)
        new = X.map_blocks(kernels.scale_block, *args, *(() if row_mask is None else (row_mask,)),
                           dtype=dtype, meta=meta)
    else:
        new = X.map_blocks(kernels.scale_block, *args, *(() if row_mask is None else (row_mask,)),
                           dtype=dtype, meta=np.empty((0, 0), dtype=dtype))
    set_matrix(adata, layer, new)
    adata.var[names[0]] = pd.Series(mean, index=adata.var_names)
    adata.var[names[1]] = pd.Series(std, index=adata.var_names)
    return adata if copy else None
