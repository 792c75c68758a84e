"""Per-cell and per-gene statistics of a row block (sums, non-zero counts, top-n fractions) and the
elementwise maps that keep the CSR structure (divide, log1p, row and column selection)."""

from __future__ import annotations

import numpy as np

from atlasflow.backend import issparse, to_host, xp_of


# ---------------------------------------------------------------------------------------------- rows


def row_sums(block):
    """Sum of each row, accumulated in float64."""
    xp = xp_of(block)
    if issparse(block):
        rows = row_ids(block)
        return xp.bincount(rows, weights=block.data.astype(xp.float64), minlength=block.shape[0])
    return block.sum(axis=1, dtype=xp.float64)


def row_nnz(block):
    """Number of stored non-zero values in each row."""
    xp = xp_of(block)
    if issparse(block):  # stored entries per row from indptr, less the explicit zeros (rare: counted only if any)
        counts = xp.diff(block.indptr).astype(xp.float64)
        zero = block.data == 0
        if bool(zero.any()):
            counts -= xp.bincount(row_ids(block)[zero], minlength=block.shape[0])
        return counts
    return (block != 0).sum(axis=1)


def row_sums_masked(block, col_mask):
    """Per-row sums over the columns selected by a boolean mask (float64)."""
    xp = xp_of(block)
    mask = xp.asarray(col_mask)
    if issparse(block):
        keep = mask[block.indices]  # only the selected entries go into the bincount (a QC set is a few genes)
        return xp.bincount(row_ids(block)[keep], weights=block.data[keep].astype(xp.float64),
                           minlength=block.shape[0])
    return block[:, mask].sum(axis=1, dtype=xp.float64)


def top_n_fractions(block, ns, max_nnz: int = 1 << 20):
    """Fraction of each row's total held by its ``n`` largest values, for each n in ``ns`` (sorted).

    Rows go in batches of at most ``max_nnz`` stored values (a row is never split): the sort's
    temporaries (~45 bytes per value) then stay ~45 MiB whatever the chunk size. Each row's result is
    the same as in one pass.
    """
    xp = xp_of(block)
    if not issparse(block):
        from scipy import sparse as _sp  # dense chunks are rare here (counts are sparse)

        block = _sp.csr_matrix(to_host(block))
        xp = np
    indptr = np.asarray(to_host(block.indptr), dtype=np.int64)
    if xp is np:  # CPU: a partial sort per row in numba (a global lexsort took 4x longer)
        out = np.empty((block.shape[0], len(ns)), dtype=np.float64)
        _top_n_kernel()(indptr, block.data, np.asarray(ns, dtype=np.int64), out)
        return out
    out = xp.empty((block.shape[0], len(ns)), dtype=xp.float64)
    r0 = 0
    while r0 < block.shape[0]:
        r1 = max(r0 + 1, int(np.searchsorted(indptr, indptr[r0] + max_nnz, side="right")) - 1)
        lo, hi = int(indptr[r0]), int(indptr[r1])
        out[r0:r1] = _top_n_rows(block.data[lo:hi], xp.asarray(indptr[r0 : r1 + 1] - lo), ns, xp)
        r0 = r1
    return out


def _top_n_rows(values, indptr, ns, xp):
    """``top_n_fractions`` of the rows whose stored values are ``values`` (CSR ``indptr`` from 0)."""
    n_rows = indptr.shape[0] - 1
    rows = row_ids_of(indptr, xp)
    data = values.astype(xp.float64)
    order = xp.lexsort(xp.stack([-data, rows]))
    ranked = data[order]
    rank = xp.arange(ranked.shape[0]) - indptr[rows]
    totals = xp.bincount(rows, weights=ranked, minlength=n_rows)
    out = xp.zeros((n_rows, len(ns)), dtype=xp.float64)
    for j, n in enumerate(ns):
        keep = rank < n
        out[:, j] = xp.bincount(rows[keep], weights=ranked[keep], minlength=n_rows)
    with np.errstate(invalid="ignore", divide="ignore"):
        return out / totals[:, None]


_TOP_N_KERNEL = None


def _top_n_kernel():
    """The numba loop behind ``top_n_fractions`` on CPU: per row, the largest ``ns[-1]`` values by a partial
    sort, summed largest first; each fraction is over the row's total (summed in stored order)."""
    global _TOP_N_KERNEL
    if _TOP_N_KERNEL is None:
        import numba

        @numba.njit(cache=True, nogil=True, error_model="numpy")  # 0 / 0 -> nan, as with NumPy
        def top(indptr, data, ns, out):
            n_max = ns[-1]
            for r in range(indptr.shape[0] - 1):
                v = data[indptr[r] : indptr[r + 1]].astype(np.float64)
                total = 0.0
                for x in v:
                    total += x
                if v.shape[0] > n_max:
                    v = np.partition(v, v.shape[0] - n_max)[v.shape[0] - n_max :]
                v = np.sort(v)[::-1]
                acc, j = 0.0, 0
                for i in range(v.shape[0]):
                    while j < ns.shape[0] and ns[j] == i:
                        out[r, j] = acc / total
                        j += 1
                    acc += v[i]
                while j < ns.shape[0]:
                    out[r, j] = acc / total
                    j += 1

        _TOP_N_KERNEL = top
    return _TOP_N_KERNEL


def row_ids(block):
    """Row index of every stored value of a CSR block."""
    return row_ids_of(block.indptr, xp_of(block))


def row_ids_of(indptr, xp):
    """Row index of every stored value, from a CSR ``indptr`` starting at 0."""
    if xp is not np:  # CuPy < 14 refuses array-valued repeats: locate each value in indptr instead
        return xp.searchsorted(indptr[1:], xp.arange(int(indptr[-1])), side="right")
    return xp.repeat(xp.arange(indptr.shape[0] - 1), xp.diff(indptr))


# ------------------------------------------------------------------------------------------- columns


def col_sums_and_nnz(block):
    """Concatenated per-column float64 sums and non-zero counts of a block (length 2 * n_cols)."""
    xp = xp_of(block)
    m = block.shape[1]
    if issparse(block):
        sums = xp.bincount(block.indices, weights=block.data.astype(xp.float64), minlength=m)
        nnz = xp.bincount(block.indices, minlength=m).astype(xp.float64)
        zero = block.data == 0
        if bool(zero.any()):  # explicit zeros are stored but not counted
            nnz -= xp.bincount(block.indices[zero], minlength=m)
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
    """Per column, how many rows hold a value above that row's threshold (``row_threshold`` per row); host array."""
    xp = xp_of(block)
    thr = xp.asarray(row_threshold).ravel()
    if issparse(block):
        hit = block.data > thr[row_ids(block)]
        return to_host(xp.bincount(block.indices[hit], minlength=block.shape[1]).astype(xp.float64))
    return to_host((block > thr[:, None]).sum(axis=0).astype(xp.float64))


# -------------------------------------------------------------------------------------- elementwise


def divide_values(values, divisor):
    """``values / divisor`` in the values' float dtype (at least float32); ``divisor`` is one entry per value
    (or broadcastable), already free of zeros."""
    xp = xp_of(values)
    dtype = np.result_type(values.dtype, np.float32)
    return values.astype(dtype, copy=False) / xp.asarray(divisor, dtype=dtype)


def log1p_values(values, _per_value=None, base=None):
    """``log1p`` of values in their float dtype (at least float32), divided by ``log(base)`` if given
    (computed in that dtype). Zeros stay zero, so CSR structure is kept."""
    xp = xp_of(values)
    dtype = np.result_type(values.dtype, np.float32)
    out = xp.log1p(values.astype(dtype, copy=False))
    if base is not None:
        out /= xp.log(xp.asarray(base, dtype=dtype))
    return out


def select_rows(block, row_mask):
    """Keep the rows of a block where ``row_mask`` (a host boolean array, one entry per row) is true."""
    xp = xp_of(block)
    return block[xp.asarray(np.flatnonzero(row_mask))]


def select_columns(block, col_idx):
    """Keep the given columns (indices, in order) of a block."""
    xp = xp_of(block)
    return block[:, xp.asarray(col_idx)]


# ------------------------------------------------------------------------------------- dtypes


def as_float(values, xp):
    """Values of a block as float64 (integers cast first, so squares cannot overflow)."""
    return values.astype(xp.float64)


def square_native(values, xp):
    """Squares in the block's own float dtype, as scanpy's mean/variance kernels compute them."""
    if np.issubdtype(values.dtype, np.integer):
        values = values.astype(xp.float64)
    return (values * values).astype(xp.float64)
