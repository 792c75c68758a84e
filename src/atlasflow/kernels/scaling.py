"""Regression, scaling and PCA on row blocks: designᵀX, residuals, scaled values (on the fly from CSR),
the Gram matrix and projections onto components."""

from __future__ import annotations

import numpy as np

from atlasflow.backend import issparse, to_host, xp_of
from atlasflow.kernels.stats import as_float, row_ids


def design_t_x(block, design):
    """``designᵀ @ block`` in float64 for a row block and its rows of the design matrix (flattened k * n_cols)."""
    xp = xp_of(block)
    c = xp.asarray(design, dtype=xp.float64)
    if issparse(block):
        return xp.asarray((block.astype(xp.float64).T @ c).T).ravel()
    return (c.T @ as_float(block, xp)).ravel()


def regress_residuals(block, design, coef, dtype):
    """Dense residuals ``block - design @ coef``, computed in float64 and rounded once to ``dtype``."""
    xp = xp_of(block)
    b = block.toarray() if issparse(block) else block
    c = xp.asarray(design, dtype=xp.float64)
    return (as_float(b, xp) - c @ xp.asarray(coef)).astype(dtype)


def subtract_group_means(block, groups, means, keep, dtype):
    """Dense ``block - means[group of row]`` for the columns where ``keep`` is True; other columns unchanged."""
    xp = xp_of(block)
    b = block.toarray() if issparse(block) else block
    g = xp.asarray(groups).ravel().astype(xp.int64)
    keep = xp.asarray(keep)
    res = as_float(b, xp) - xp.asarray(means)[g] * keep[None, :]
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
            vals = xp.where(rows[row_ids(out)], vals, out.data)
        out.data = vals.astype(dtype)
        return out
    b = (block.toarray() if issparse(block) else block).astype(dtype, copy=False)
    x = scaled_values(b, mean, std, zero_center, max_value, dtype, xp)
    if rows is not None:
        x = xp.where(rows[:, None], x, b)
    return x


def scaled_values(values, mean, std, zero_center, max_value, dtype, xp=np):
    """``values`` (already ``dtype``) centred and scaled with scanpy's roundings, then clipped at ``max_value``.

    The one place the dense scaling arithmetic lives, so that PCA of scaled sparse data
    (``scaled_gram_and_sums``) sees exactly the values the scale stage writes.
    """
    dtype = np.dtype(dtype)
    x = (values - mean).astype(dtype) if zero_center else values
    x = (x / std).astype(dtype)
    if max_value is not None:
        hi = dtype.type(max_value)
        x = xp.where(x > hi, hi, x)
        if zero_center:
            x = xp.where(x < -hi, -hi, x)
    return x


def gram_and_sums(block, col_idx=None, slice_rows=2048, *, out=None):
    """``Xᵀ X`` (float64, flattened) followed by the column sums, for the selected columns of a row block
    (added into the host buffer ``out`` and returned when given).

    Sparse blocks are densified ``slice_rows`` rows at a time so the product runs as a BLAS matrix
    multiply (sparse-sparse products are far slower at the densities of HVG-subset data) with bounded
    memory.
    """
    xp = xp_of(block)
    if col_idx is not None:
        block = block[:, xp.asarray(col_idx)]
    m = block.shape[1]
    gram = xp.zeros((m, m), dtype=xp.float64)
    sums = xp.zeros(m, dtype=xp.float64)
    for s in range(0, block.shape[0], slice_rows):
        part = block[s : s + slice_rows]
        part = part.toarray() if issparse(part) else part
        part = as_float(part, xp)
        gram += part.T @ part
        sums += part.sum(axis=0)
    return _added(out, xp.concatenate([gram.ravel(), sums]))


def _added(out, parts):
    """``parts`` added into the host buffer ``out`` (returned), or ``parts`` itself when there is no buffer."""
    if out is None:
        return parts
    out += to_host(parts)
    return out


def scaled_gram_and_sums(block, mean, std, zero_center, max_value, dtype, col_idx=None, *, out=None):
    """Upper triangle of ``YᵀY`` (flattened, float64) then the column sums of ``Y``, where ``Y`` is
    ``scale_block(block, mean, std, ...)`` minus ``scaled_zero(...)``, the scaled value of a zero (added into
    the host buffer ``out`` and returned when given).

    ``Y`` is zero wherever ``block`` is, so on a sparse block ``YᵀY`` costs Σ nnz(row)² products instead of
    rows x genes² (about 100x fewer on HVG-subset data); ``pp.pca`` adds the ``z0`` terms once, after the sum
    over blocks. Dense and GPU blocks are scaled and multiplied densely (GEMM is what a GPU is fast at).
    """
    xp = xp_of(block)
    block, mean, std = _scaling_columns(block, mean, std, col_idx, xp)
    if not issparse(block) or xp is not np:
        z0 = xp.asarray(scaled_zero(to_host(mean), to_host(std), zero_center, max_value, dtype))
        z = scale_block(block, mean, std, zero_center, max_value, dtype)
        y = as_float(z.toarray() if issparse(z) else z, xp) - z0[None, :]
        parts = gram_and_sums(y)
        m = y.shape[1]
        return _added(out, xp.concatenate([xp.triu(parts[: m * m].reshape(m, m)).ravel(), parts[m * m :]]))
    y, _ = _scaled_sparse(block, mean, std, zero_center, max_value, dtype)
    m = y.shape[1]
    if out is None:
        out = np.zeros(m * m + m, dtype=np.float64)
    _sparse_gram_upper()(y.indptr.astype(np.int64), y.indices, y.data, out, m, GRAM_TILE)  # adds in place
    out[m * m :] += np.bincount(y.indices, weights=y.data, minlength=m)
    return out


def scaled_zero(mean, std, zero_center, max_value, dtype) -> np.ndarray:
    """What ``scale_block`` makes of a zero in each column (float64 host array)."""
    dtype = np.dtype(dtype)
    mean, std = np.asarray(mean, dtype=np.float64), np.asarray(std, dtype=np.float64)
    return scaled_values(np.zeros(mean.shape[0], dtype=dtype), mean, std, zero_center, max_value, dtype).astype(
        np.float64)


def scaled_project_block(block, mean, std, zero_center, max_value, dtype, components, offset, col_idx=None):
    """``project_block`` of ``scale_block(block, mean, std, ...)``: ``1 (z0ᵀV) + Y V - offset`` if sparse."""
    xp = xp_of(block)
    block, mean, std = _scaling_columns(block, mean, std, col_idx, xp)
    if not issparse(block) or xp is not np:
        return project_block(scale_block(block, mean, std, zero_center, max_value, dtype), components, offset)
    y, z0 = _scaled_sparse(block, mean, std, zero_center, max_value, dtype)
    comps = np.asarray(components, dtype=np.float64)
    return y @ comps + (z0 @ comps - np.asarray(offset, dtype=np.float64))[None, :]


def _scaling_columns(block, mean, std, col_idx, xp):
    """The block's selected columns with their means and standard deviations (float64, block's module)."""
    mean = xp.asarray(mean, dtype=xp.float64)
    std = xp.asarray(std, dtype=xp.float64)
    if col_idx is not None:
        cols = xp.asarray(col_idx)
        block, mean, std = block[:, cols], mean[cols], std[cols]
    return block, mean, std


def _scaled_sparse(block, mean, std, zero_center, max_value, dtype):
    """(Y, z0): the CSR of the scaled values minus the scaled zero ``z0`` on the stored entries (canonical,
    float64), and ``z0``. Values are rounded exactly as ``scale_block`` rounds them.
    """
    dtype = np.dtype(dtype)
    y = block.tocsr(copy=True)
    y.sum_duplicates()  # also sorts the column indices, which the tiled Gram loop needs
    z0 = scaled_zero(mean, std, zero_center, max_value, dtype)
    if dtype in (np.float32, np.float64):
        out = np.empty(y.data.shape[0], dtype=np.float64)
        hi = np.inf if max_value is None else float(dtype.type(max_value))
        _scaled_entries_kernel()(y.data, y.indices, mean, std, z0, bool(zero_center), hi, dtype == np.float32, out)
        y.data = out
        return y, z0
    z = scaled_values(y.data.astype(dtype, copy=False), mean[y.indices], std[y.indices], zero_center, max_value,
                      dtype)
    y.data = z.astype(np.float64) - z0[y.indices]
    return y, z0


_SCALED_ENTRIES = None


def _scaled_entries_kernel():
    """numba loop of ``scaled_values(...) - z0`` on a CSR's stored entries: one pass instead of a dozen NumPy
    temporaries and gathers (~4x faster), with the same operations in the same order, so the same bits."""
    global _SCALED_ENTRIES
    if _SCALED_ENTRIES is None:
        import numba

        @numba.njit(cache=True, nogil=True)
        def entries(values, indices, mean, std, z0, zero_center, hi, to32, out):
            for a in range(values.shape[0]):
                ua = np.uint64(a)
                j = np.uint64(indices[ua])
                x = np.float64(np.float32(values[ua])) if to32 else np.float64(values[ua])
                if zero_center:
                    x = x - mean[j]
                    if to32:
                        x = np.float64(np.float32(x))
                x = x / std[j]
                if to32:
                    x = np.float64(np.float32(x))
                if x > hi:
                    x = hi
                if zero_center and x < -hi:
                    x = -hi
                out[ua] = x - z0[j]

        _SCALED_ENTRIES = entries
    return _SCALED_ENTRIES


#: Columns per tile of the sparse Gram loop: a tile pair of the Gram matrix stays in cache (2x faster than
#: scattering over the whole matrix, measured on 2,000 HVGs).
GRAM_TILE = 512
_GRAM_KERNEL = None


def _sparse_gram_upper():
    """The numba loop adding each CSR row's outer product to the upper triangle of a dense Gram matrix
    (the first ``m * m`` entries of a flat float64 buffer, row-major).

    Tile pair by tile pair of columns (rows' sorted indices split at tile boundaries once); compiled on first
    use and cached on disk. The hot loop indexes with unsigned casts of values known to be non-negative:
    numba then skips its negative-index wrap-around checks, ~40 % of the loop's time (same bits).
    """
    global _GRAM_KERNEL
    if _GRAM_KERNEL is None:
        import numba

        @numba.njit(cache=True, nogil=True)
        def upper(indptr, indices, data, gram, m, tile):
            n = indptr.shape[0] - 1
            nt = (m + tile - 1) // tile
            pos = np.empty((n, nt + 1), np.int64)  # pos[r, t]: first entry of row r in column tile t
            for r in range(n):
                a, stop = indptr[r], indptr[r + 1]
                for t in range(nt):
                    while a < stop and indices[a] < t * tile:
                        a += 1
                    pos[r, t] = a
                pos[r, nt] = stop
            for ti in range(nt):
                for tj in range(ti, nt):
                    for r in range(n):
                        a0, a1, b1 = pos[r, ti], pos[r, ti + 1], pos[r, tj + 1]
                        for a in range(a0, a1):
                            ua = np.uint64(a)
                            row, v = indices[ua] * m, data[ua]
                            for b in range(a if ti == tj else pos[r, tj], b1):
                                ub = np.uint64(b)
                                gram[np.uint64(row + indices[ub])] += v * data[ub]

        _GRAM_KERNEL = upper
    return _GRAM_KERNEL


def project_block(block, components, offset, col_idx=None):
    """PCA coordinates of a row block: ``X[:, cols] @ components - offset`` in float64 (host array: it is small)."""
    xp = xp_of(block)
    if col_idx is not None:
        block = block[:, xp.asarray(col_idx)]
    comps = xp.asarray(components, dtype=xp.float64)
    if issparse(block):
        res = block.astype(xp.float64) @ comps
    else:
        res = as_float(block, xp) @ comps
    return to_host(xp.asarray(res) - xp.asarray(offset, dtype=xp.float64)[None, :])
