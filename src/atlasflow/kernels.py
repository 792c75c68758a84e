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
