"""Per-chunk math and the two shapes of reduction every stage is built from.

* ``per_row(x, fn, ncols)``: ``fn(block) -> (rows, ncols)`` float64, concatenated over blocks
  (cell-level results such as QC metrics).
* ``over_blocks(x, fn, size)``: ``fn(block) -> (size,)`` float64 partials, summed over blocks
  (gene-level sums, counts, Gram matrices: everything is a sum of per-chunk partials).

Kernels take one row block (CSR or dense, NumPy or CuPy) and use the block's own array module, so one
implementation serves CPU and GPU. They return host (NumPy) arrays: results are small.
"""

from __future__ import annotations

import dask.array as da
import numpy as np

from atlasflow.backend import issparse, to_host, xp_of


def per_row(x: da.Array, fn, ncols: int, *args) -> da.Array:
    """Row-aligned results of ``fn`` on each block, as a lazy (n_rows, ncols) float64 array."""
    return x.map_blocks(
        lambda b, *a: np.asarray(to_host(fn(b, *a)), dtype=np.float64).reshape(b.shape[0], ncols),
        *args,
        chunks=(x.chunks[0], (ncols,)),
        dtype=np.float64,
        meta=np.empty((0, 0), np.float64),
    )


def over_blocks(x: da.Array, fn, size: int, *args) -> da.Array:
    """Sum over row blocks of ``fn(block) -> (size,)`` float64 partials, as a lazy (size,) array."""
    if x.numblocks[1] != 1:
        x = x.rechunk({1: -1})
    parts = x.map_blocks(
        lambda b, *a: np.asarray(to_host(fn(b, *a)), dtype=np.float64).reshape(1, size),
        *args,
        chunks=((1,) * x.numblocks[0], (size,)),
        dtype=np.float64,
        meta=np.empty((0, 0), np.float64),
    )
    return parts.sum(axis=0)


# ---------------------------------------------------------------------------------------------- rows


def row_sums(block):
    """Sum of each row, accumulated in float64."""
    xp = xp_of(block)
    if issparse(block):
        rows = _row_ids(block)
        return xp.bincount(rows, weights=block.data.astype(xp.float64), minlength=block.shape[0])
    return block.sum(axis=1, dtype=xp.float64)


def row_nnz(block):
    """Number of stored non-zero values in each row."""
    xp = xp_of(block)
    if issparse(block):
        return xp.bincount(_row_ids(block), weights=(block.data != 0).astype(xp.float64), minlength=block.shape[0])
    return (block != 0).sum(axis=1)


def row_sums_masked(block, col_mask):
    """Per-row sums over the columns selected by a boolean mask (float64)."""
    xp = xp_of(block)
    mask = xp.asarray(col_mask)
    if issparse(block):
        keep = mask[block.indices]
        w = xp.where(keep, block.data.astype(xp.float64), 0.0)
        return xp.bincount(_row_ids(block), weights=w, minlength=block.shape[0])
    return block[:, mask].sum(axis=1, dtype=xp.float64)


def top_n_fractions(block, ns):
    """Fraction of each row's total held by its ``n`` largest values, for each n in ``ns`` (sorted)."""
    xp = xp_of(block)
    if not issparse(block):
        from scipy import sparse as _sp  # dense chunks are rare here (counts are sparse)

        block = _sp.csr_matrix(to_host(block))
        xp = np
    rows = _row_ids(block)
    data = block.data.astype(xp.float64)
    order = xp.lexsort(xp.stack([-data, rows]))
    ranked = data[order]
    rank = xp.arange(ranked.shape[0]) - xp.asarray(block.indptr)[rows]
    totals = xp.bincount(rows, weights=ranked, minlength=block.shape[0])
    out = xp.zeros((block.shape[0], len(ns)), dtype=xp.float64)
    for j, n in enumerate(ns):
        keep = rank < n
        out[:, j] = xp.bincount(rows[keep], weights=ranked[keep], minlength=block.shape[0])
    with np.errstate(invalid="ignore", divide="ignore"):
        return out / totals[:, None]


def _row_ids(block):
    """Row index of every stored value of a CSR block."""
    xp = xp_of(block)
    return xp.repeat(xp.arange(block.shape[0]), xp.diff(block.indptr))


# ------------------------------------------------------------------------------------------- columns


def col_sums_and_nnz(block):
    """Concatenated per-column float64 sums and non-zero counts of a block (length 2 * n_cols)."""
    xp = xp_of(block)
    m = block.shape[1]
    if issparse(block):
        data = block.data.astype(xp.float64)
        sums = xp.bincount(block.indices, weights=data, minlength=m)
        nnz = xp.bincount(block.indices, weights=(data != 0).astype(xp.float64), minlength=m)
    else:
        sums = block.sum(axis=0, dtype=xp.float64)
        nnz = (block != 0).sum(axis=0).astype(xp.float64)
    return xp.concatenate([sums, nnz])


def col_sums_sq(block):
    """Concatenated per-column float64 sums and sums of squares (length 2 * n_cols)."""
    xp = xp_of(block)
    m = block.shape[1]
    if issparse(block):
        data = block.data.astype(xp.float64)
        sums = xp.bincount(block.indices, weights=data, minlength=m)
        sq = xp.bincount(block.indices, weights=data * data, minlength=m)
    else:
        b = block.astype(xp.float64)
        sums, sq = b.sum(axis=0), (b * b).sum(axis=0)
    return xp.concatenate([sums, sq])


def col_count_above(block, row_threshold):
    """Per column, how many rows hold a value above that row's threshold (``row_threshold`` per row)."""
    xp = xp_of(block)
    thr = xp.asarray(row_threshold).ravel()
    if issparse(block):
        hit = block.data > thr[_row_ids(block)]
        return xp.bincount(block.indices[hit], minlength=block.shape[1]).astype(xp.float64)
    return (block > thr[:, None]).sum(axis=0).astype(xp.float64)


# -------------------------------------------------------------------------------------- elementwise


def scale_rows(block, factors):
    """Divide each row by its factor (rows with factor 0 are left as they are), keeping the dtype."""
    xp = xp_of(block)
    f = xp.asarray(factors).ravel().astype(block.dtype)
    f = xp.where(f == 0, xp.asarray(1, dtype=block.dtype), f)
    if issparse(block):
        out = block.copy()
        out.data = out.data / xp.repeat(f, xp.diff(out.indptr))
        return out
    return block / f[:, None]


def log1p_block(block, base=None):
    """``log1p`` of the stored values (zeros stay implicit), optionally in another base."""
    xp = xp_of(block)
    out = block.copy() if issparse(block) else block
    if issparse(block):
        out.data = xp.log1p(out.data)
        if base is not None:
            out.data /= xp.log(xp.asarray(base, dtype=out.data.dtype))
        return out
    res = xp.log1p(out)
    if base is not None:
        res = res / xp.log(base)
    return res


def select_columns(block, col_idx):
    """Keep the given columns (indices, in order) of a block."""
    xp = xp_of(block)
    return block[:, xp.asarray(col_idx)]


# ------------------------------------------------------------- feature selection, scaling, regression, PCA


def _as_float(values, xp):
    """Values of a block as float64 (integers cast first, so squares cannot overflow)."""
    return values.astype(xp.float64)


def _square_native(values, xp):
    """Squares in the block's own float dtype, as scanpy's mean/variance kernels compute them."""
    if xp.issubdtype(values.dtype, xp.integer):
        values = values.astype(xp.float64)
    return (values * values).astype(xp.float64)


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
        idx = g[_row_ids(block)] * m + block.indices
        size = n_groups * m
        out[:, 0] = xp.bincount(idx, weights=_as_float(data, xp), minlength=size).reshape(n_groups, m)
        out[:, 1] = xp.bincount(idx, weights=_square_native(data, xp), minlength=size).reshape(n_groups, m)
        out[:, 2] = xp.bincount(idx, weights=(data > 0).astype(xp.float64), minlength=size).reshape(n_groups, m)
    else:
        for k in range(n_groups):
            b = block[g == k]
            out[k, 0] = b.sum(axis=0, dtype=xp.float64)
            out[k, 1] = _square_native(b, xp).sum(axis=0)
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
        rows = g[_row_ids(block)]
        vals = xp.minimum(_as_float(block.data, xp), clip[rows, block.indices])
        idx = rows * m + block.indices
        size = n_groups * m
        out[:, 0] = xp.bincount(idx, weights=vals, minlength=size).reshape(n_groups, m)
        out[:, 1] = xp.bincount(idx, weights=vals * vals, minlength=size).reshape(n_groups, m)
    else:
        for k in range(n_groups):
            b = xp.minimum(_as_float(block[g == k], xp), clip[k][None, :])
            out[k, 0] = b.sum(axis=0)
            out[k, 1] = (b * b).sum(axis=0)
    return out.ravel()


def count_non_counts(block):
    """How many values of a block are negative or not integers (raw counts have none)."""
    xp = xp_of(block)
    v = block.data if issparse(block) else block
    if xp.issubdtype(v.dtype, xp.integer):
        return xp.asarray([(v < 0).sum()], dtype=xp.float64)
    bad = (v < 0) | (v != xp.floor(v)) | ~xp.isfinite(v)
    return xp.asarray([bad.sum()], dtype=xp.float64)


def expm1_block(block, factor=None):
    """``expm1`` of the stored values (after multiplying by ``factor``, to undo a log base)."""
    xp = xp_of(block)
    if issparse(block):
        out = block.copy()
        if factor is not None:
            out.data = out.data * out.data.dtype.type(factor)
        out.data = xp.expm1(out.data)
        return out
    b = block * block.dtype.type(factor) if factor is not None else block
    return xp.expm1(b)


def col_sums_nan(block):
    """Per column: float64 sum of the non-NaN values and count of NaN values (length 2 * n_cols)."""
    xp = xp_of(block)
    m = block.shape[1]
    if issparse(block):
        data = _as_float(block.data, xp)
        nan = xp.isnan(data)
        sums = xp.bincount(block.indices, weights=xp.where(nan, 0.0, data), minlength=m)
        nans = xp.bincount(block.indices, weights=nan.astype(xp.float64), minlength=m)
    else:
        b = _as_float(block, xp)
        nan = xp.isnan(b)
        sums = xp.where(nan, 0.0, b).sum(axis=0)
        nans = nan.sum(axis=0).astype(xp.float64)
    return xp.concatenate([sums, nans])


def row_sums_nan_sets(block, sets):
    """For each column-index set: per-row float64 sum of the non-NaN values and count of non-NaN values.

    Returns (rows, 2 * len(sets)): [sum_0, count_0, sum_1, count_1, ...]. Columns of a set may repeat.
    """
    xp = xp_of(block)
    cols = []
    for idx in sets:
        sub = block[:, xp.asarray(idx)]
        if issparse(sub):
            sub = sub.tocsr()
            data = _as_float(sub.data, xp)
            nan = xp.isnan(data)
            rows = _row_ids(sub)
            s = xp.bincount(rows, weights=xp.where(nan, 0.0, data), minlength=sub.shape[0])
            nn = xp.bincount(rows, weights=nan.astype(xp.float64), minlength=sub.shape[0])
        else:
            b = _as_float(sub, xp)
            nan = xp.isnan(b)
            s = xp.where(nan, 0.0, b).sum(axis=1)
            nn = nan.sum(axis=1).astype(xp.float64)
        cols += [s, len(idx) - nn]
    return xp.stack(cols, axis=1)


def col_min_max(block):
    """Per-column minimum and maximum, implicit zeros included (length 2 * n_cols)."""
    xp = xp_of(block)
    if issparse(block):
        lo = block.min(axis=0)
        hi = block.max(axis=0)
        lo = lo.toarray() if hasattr(lo, "toarray") else lo
        hi = hi.toarray() if hasattr(hi, "toarray") else hi
        return xp.concatenate([xp.asarray(lo, dtype=xp.float64).ravel(), xp.asarray(hi, dtype=xp.float64).ravel()])
    return xp.concatenate([block.min(axis=0).astype(xp.float64), block.max(axis=0).astype(xp.float64)])


def design_t_x(block, design):
    """``designᵀ @ block`` in float64 for a row block and its rows of the design matrix (flattened k * n_cols)."""
    xp = xp_of(block)
    c = xp.asarray(design, dtype=xp.float64)
    if issparse(block):
        return xp.asarray((block.astype(xp.float64).T @ c).T).ravel()
    return (c.T @ _as_float(block, xp)).ravel()


def regress_residuals(block, design, coef, dtype):
    """Dense residuals ``block - design @ coef``, computed in float64 and rounded once to ``dtype``."""
    xp = xp_of(block)
    b = block.toarray() if issparse(block) else block
    c = xp.asarray(design, dtype=xp.float64)
    return (_as_float(b, xp) - c @ xp.asarray(coef)).astype(dtype)


def subtract_group_means(block, groups, means, keep, dtype):
    """Dense ``block - means[group of row]`` for the columns where ``keep`` is True; other columns unchanged."""
    xp = xp_of(block)
    b = block.toarray() if issparse(block) else block
    g = xp.asarray(groups).ravel().astype(xp.int64)
    keep = xp.asarray(keep)
    res = _as_float(b, xp) - xp.asarray(means)[g] * keep[None, :]
    return res.astype(dtype)


def scale_block(block, mean, std, zero_center, max_value, dtype, row_mask=None):
    """Scale columns to unit variance (and zero mean), clipping at ``max_value``, as scanpy.pp.scale.

    Dense output rounds as scanpy does (``x - mean`` to ``dtype``, then ``/ std`` to ``dtype``); sparse input
    without centering keeps its structure. Rows outside ``row_mask`` are returned unchanged.
    """
    xp = xp_of(block)
    dtype = np.dtype(dtype)
    mean = xp.asarray(mean, dtype=xp.float64)
    std = xp.asarray(std, dtype=xp.float64)
    rows = None if row_mask is None else xp.asarray(row_mask).ravel().astype(bool)
    if issparse(block) and not zero_center:
        out = block.astype(dtype, copy=True)
        vals = out.data / std[out.indices]
        if max_value is not None:
            vals = xp.minimum(vals, max_value)
        if rows is not None:
            vals = xp.where(rows[_row_ids(out)], vals, out.data)
        out.data = vals.astype(dtype)
        return out
    b = (block.toarray() if issparse(block) else block).astype(dtype, copy=False)
    x = (b - mean).astype(dtype) if zero_center else b
    x = (x / std).astype(dtype)
    if max_value is not None:
        hi = dtype.type(max_value)
        x = xp.where(x > hi, hi, x)
        if zero_center:
            x = xp.where(x < -hi, -hi, x)
    if rows is not None:
        x = xp.where(rows[:, None], x, b)
    return x


def gram_and_sums(block, col_idx=None):
    """``Xᵀ X`` (float64, flattened) followed by the column sums, for the selected columns of a row block."""
    xp = xp_of(block)
    if col_idx is not None:
        block = block[:, xp.asarray(col_idx)]
    if issparse(block):
        b = block.astype(xp.float64)
        gram = b.T @ b
        gram = gram.toarray() if hasattr(gram, "toarray") else xp.asarray(gram)
        sums = xp.asarray(b.sum(axis=0)).ravel()
    else:
        b = _as_float(block, xp)
        gram = b.T @ b
        sums = b.sum(axis=0)
    return xp.concatenate([gram.ravel(), sums])


def project_block(block, components, offset, col_idx=None):
    """PCA coordinates of a row block: ``X[:, cols] @ components - offset`` in float64."""
    xp = xp_of(block)
    if col_idx is not None:
        block = block[:, xp.asarray(col_idx)]
    comps = xp.asarray(components, dtype=xp.float64)
    if issparse(block):
        res = block.astype(xp.float64) @ comps
    else:
        res = _as_float(block, xp) @ comps
    return xp.asarray(res) - xp.asarray(offset, dtype=xp.float64)[None, :]
