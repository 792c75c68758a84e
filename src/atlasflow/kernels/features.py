"""Per-gene statistics for feature selection and scaling: grouped means/variances, clipped sums (seurat_v3),
sequential NaN-aware sums, min/max, and the checks on what a matrix holds (counts or not)."""

from __future__ import annotations

import numpy as np

from atlasflow.backend import issparse, to_host, xp_of
from atlasflow.kernels.stats import as_float, row_ids, square_native


def col_stats_grouped(block, groups, n_groups):
    """Per (group, column) sum, sum of squares and count of values > 0, flattened as [group, stat, column].

    ``groups`` holds an integer group code per row (shape (rows, 1)). Sums accumulate in float64; squares
    are taken in the block's dtype first, exactly as scanpy's ``_get_mean_var`` does, so variances match
    scanpy to the last bits (and HVG rankings do not flip at ties).
    """
    xp = xp_of(block)
    m = block.shape[1]
    g = xp.asarray(groups).ravel().astype(xp.int64)
    out = xp.zeros((n_groups, 3, m), dtype=xp.float64)
    if issparse(block):
        data = block.data
        idx = g[row_ids(block)] * m + block.indices
        size = n_groups * m
        out[:, 0] = xp.bincount(idx, weights=as_float(data, xp), minlength=size).reshape(n_groups, m)
        out[:, 1] = xp.bincount(idx, weights=square_native(data, xp), minlength=size).reshape(n_groups, m)
        out[:, 2] = xp.bincount(idx, weights=(data > 0).astype(xp.float64), minlength=size).reshape(n_groups, m)
    else:
        for k in range(n_groups):
            b = block[g == k]
            out[k, 0] = b.sum(axis=0, dtype=xp.float64)
            out[k, 1] = square_native(b, xp).sum(axis=0)
            out[k, 2] = (b > 0).sum(axis=0)
    return out.ravel()


def col_clipped_sums_grouped(block, groups, clip):
    """Per (group, column) sum and sum of squares of ``min(x, clip[group, column])`` in float64.

    The second pass of Seurat v3 feature selection; only stored values are clipped (clip values are
    positive, so implicit zeros stay zero), flattened as [group, stat, column].
    """
    xp = xp_of(block)
    clip = xp.asarray(clip)
    n_groups, m = clip.shape
    g = xp.asarray(groups).ravel().astype(xp.int64)
    out = xp.zeros((n_groups, 2, m), dtype=xp.float64)
    if issparse(block):
        rows = g[row_ids(block)]
        vals = xp.minimum(as_float(block.data, xp), clip[rows, block.indices])
        idx = rows * m + block.indices
        size = n_groups * m
        out[:, 0] = xp.bincount(idx, weights=vals, minlength=size).reshape(n_groups, m)
        out[:, 1] = xp.bincount(idx, weights=vals * vals, minlength=size).reshape(n_groups, m)
    else:
        for k in range(n_groups):
            b = xp.minimum(as_float(block[g == k], xp), clip[k][None, :])
            out[k, 0] = b.sum(axis=0)
            out[k, 1] = (b * b).sum(axis=0)
    return out.ravel()


def count_non_counts(block):
    """How many values of a block are negative or not integers (raw counts have none)."""
    xp = xp_of(block)
    v = block.data if issparse(block) else block
    if np.issubdtype(v.dtype, np.integer):
        return xp.asarray([(v < 0).sum()], dtype=xp.float64)
    bad = (v < 0) | (v != xp.floor(v)) | ~xp.isfinite(v)
    return xp.asarray([bad.sum()], dtype=xp.float64)


def expm1_block(block, factor=None):
    """``expm1`` of the stored values, after ``x * factor`` rounded to the block's dtype (undoes a log base)."""
    xp = xp_of(block)
    if issparse(block):
        out = block.copy()
        if factor is not None:
            out.data = (out.data * np.float64(factor)).astype(out.data.dtype)
        out.data = xp.expm1(out.data)
        return out
    b = (block * np.float64(factor)).astype(block.dtype) if factor is not None else block
    return xp.expm1(b)


def _sum_dtype(dtype):
    """The accumulator scipy/numpy use for a sum of this dtype: floats keep theirs, integers widen."""
    return np.dtype(dtype) if np.issubdtype(dtype, np.floating) else np.dtype(np.float64)


def col_sums_nan_sequential(block, carry=None):
    """Running per-column sums of the non-NaN values, and NaN counts, continued from ``carry``.

    Values are added row after row in the data's float dtype, continuing the previous blocks' sums: the
    order and precision of ``X.sum(axis=0)`` on the whole matrix in scipy (CSR) and numpy (dense), which
    scanpy's ``score_genes`` uses to bin genes, and independent of how rows are chunked. Host arrays only.
    """
    block = to_host(block)
    m = block.shape[1]
    dtype = _sum_dtype(block.dtype)
    sums, nans = (np.zeros(m, dtype=dtype), np.zeros(m)) if carry is None else (carry[0].copy(), carry[1].copy())
    if issparse(block):
        data = block.data.astype(dtype, copy=False)
        nan = np.isnan(data)
        np.add.at(sums, block.indices, np.where(nan, dtype.type(0), data))
        nans += np.bincount(block.indices, weights=nan.astype(np.float64), minlength=m)
    else:
        b = np.asarray(block, dtype=dtype)
        nan = np.isnan(b)
        sums = np.concatenate([sums[None, :], np.where(nan, dtype.type(0), b)]).sum(axis=0, dtype=dtype)
        nans += nan.sum(axis=0)
    return sums, nans


def row_sums_nan_sets(block, sets):
    """For each column-index set: per-row sum of the non-NaN values and count of non-NaN values.

    Returns (rows, 2 * len(sets)): [sum_0, count_0, sum_1, count_1, ...]. Sums follow scipy/numpy as
    scanpy calls them: sparse rows add their stored values in order in the data's dtype, dense rows are
    numpy float64 sums.
    """
    xp = xp_of(block)
    cols = []
    for idx in sets:
        sub = block[:, xp.asarray(idx)]
        if issparse(sub):
            sub = sub.tocsr()
            data = sub.data
            nan = xp.isnan(data)
            rows = row_ids(sub)
            nn = xp.bincount(rows, weights=nan.astype(xp.float64), minlength=sub.shape[0])
            if xp is np:
                clean = np.where(nan, data.dtype.type(0), data).astype(_sum_dtype(data.dtype), copy=False)
                s = np.zeros(sub.shape[0], dtype=clean.dtype)
                nonempty = np.flatnonzero(np.diff(sub.indptr))
                if nonempty.size:
                    s[nonempty] = np.add.reduceat(clean, sub.indptr[nonempty])
                s = s.astype(np.float64)
            else:
                s = xp.bincount(rows, weights=xp.where(nan, 0.0, as_float(data, xp)), minlength=sub.shape[0])
        else:
            b = xp.where(xp.isnan(sub), 0, sub)
            s = b.sum(axis=1, dtype=xp.float64)
            nn = xp.isnan(sub).sum(axis=1).astype(xp.float64)
        cols += [s, len(idx) - nn]
    return xp.stack(cols, axis=1)


def col_min_max(block):
    """Per-column minimum and maximum, implicit zeros included (length 2 * n_cols); host array."""
    xp = xp_of(block)
    if issparse(block):
        lo = block.min(axis=0)
        hi = block.max(axis=0)
        lo = lo.toarray() if hasattr(lo, "toarray") else lo
        hi = hi.toarray() if hasattr(hi, "toarray") else hi
        return to_host(xp.concatenate([xp.asarray(lo, dtype=xp.float64).ravel(),
                                       xp.asarray(hi, dtype=xp.float64).ravel()]))
    return to_host(xp.concatenate([block.min(axis=0).astype(xp.float64), block.max(axis=0).astype(xp.float64)]))
