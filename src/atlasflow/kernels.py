"""Per-chunk math and the two shapes of reduction every stage is built from.

* ``per_row(x, fn, ncols)``: ``fn(block) -> (rows, ncols)`` float64, concatenated over blocks
  (cell-level results such as QC metrics).
* ``over_blocks(x, fn, size)``: ``fn(block) -> (size,)`` float64 partials, summed over blocks
  (gene-level sums, counts, Gram matrices: everything is a sum of per-chunk partials).
* ``accumulate_blocks(x, fn, size)``: the same sum for partials too large to make one per block (PCA's
  Gram matrix): ``fn(block, out=buffer)`` adds each block into a buffer shared by a lane of blocks.

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


#: Partials added per task of ``over_blocks``' reduction tree.
SUM_FAN_IN = 4


def over_blocks(x: da.Array, fn, size: int, *args) -> da.Array:
    """Sum over row blocks of ``fn(block) -> (size,)`` float64 partials, as a lazy (size,) array.

    The partials are added in a fixed tree (``SUM_FAN_IN`` per task, the same order whatever the scheduling),
    each task adding into one buffer. Dask's generic sum stacks its inputs first, a copy of every partial:
    with Gram-matrix partials (32 MB for 2,000 genes) that was a fifth of PCA's pass.
    """
    if x.numblocks[1] != 1:
        x = x.rechunk({1: -1})
    parts = x.map_blocks(
        lambda b, *a: np.asarray(to_host(fn(b, *a)), dtype=np.float64).reshape(1, size),
        *args,
        chunks=((1,) * x.numblocks[0], (size,)),
        dtype=np.float64,
        meta=np.empty((0, 0), np.float64),
    )
    return _summed(list(parts.to_delayed(optimize_graph=False).ravel()), size)  # keys shared with X's results


def _summed(level: list, size: int) -> da.Array:
    """The sum of delayed (size,) partials in a fixed tree (``SUM_FAN_IN`` per task), as a lazy array."""
    import dask

    while True:
        level = [dask.delayed(_add_partials, pure=True)(*level[i : i + SUM_FAN_IN])
                 for i in range(0, len(level), SUM_FAN_IN)]
        if len(level) == 1:
            return da.from_delayed(level[0], shape=(size,), dtype=np.float64, meta=np.empty((0,), np.float64))


#: Consecutive row blocks per lane of ``accumulate_blocks`` (fewer when that would leave more than MAX_LANES).
LANE_BLOCKS = 4
#: Most lanes (buffers alive at once) of ``accumulate_blocks``: bounds its memory whatever the number of cells.
MAX_LANES = 16


def accumulate_blocks(x: da.Array, fn, size: int, *args) -> da.Array:
    """Sum over row blocks of ``fn(block, *args, out=buffer)``, which adds a block's (size,) float64 partial
    into ``buffer`` in place, as a lazy (size,) array.

    The blocks are split into lanes of consecutive blocks; each lane is a chain of tasks filling one buffer,
    and the lanes' buffers are added at the end (``over_blocks``' fixed tree). With 32 MB partials (a Gram
    matrix of 2,000 genes), a partial per block meant allocating, moving between workers and adding one per
    block: a third of PCA's first pass. The lanes depend only on the number of blocks (``LANE_BLOCKS``,
    ``MAX_LANES``), so the bits of the result do not depend on the cluster. A chain's task may add into its
    input: only that task uses it, and a lost worker recomputes the lane from its start.
    """
    import dask

    if x.numblocks[1] != 1:
        x = x.rechunk({1: -1})
    blocks = list(x.to_delayed(optimize_graph=False).ravel())  # keys shared with other results of X
    n_lanes = max(1, min(MAX_LANES, -(-len(blocks) // LANE_BLOCKS)))
    lanes = []
    for lane in np.array_split(np.arange(len(blocks)), n_lanes):
        acc = None
        for i in lane:
            acc = dask.delayed(_lane_step, pure=True)(acc, blocks[i], fn, size, *args)
        lanes.append(acc)
    return _summed(lanes, size)


def _lane_step(out, block, fn, size: int, *args) -> np.ndarray:
    """One block of a lane: ``fn`` adds into the lane's buffer (a new zero buffer for the first block)."""
    if out is None:
        out = np.zeros(size, dtype=np.float64)
    fn(block, *args, out=out)
    return out


def _add_partials(*parts: np.ndarray) -> np.ndarray:
    """The sum of same-sized partials as a flat float64 array, added in order into one new buffer."""
    out = np.array(parts[0], dtype=np.float64).ravel()
    for part in parts[1:]:
        out += part.ravel()
    return out


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
    rows = _row_ids_of(indptr, xp)
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
    return _row_ids_of(block.indptr, xp_of(block))


def _row_ids_of(indptr, xp):
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


# ------------------------------------------------------------- feature selection, scaling, regression, PCA


def _as_float(values, xp):
    """Values of a block as float64 (integers cast first, so squares cannot overflow)."""
    return values.astype(xp.float64)


def _square_native(values, xp):
    """Squares in the block's own float dtype, as scanpy's mean/variance kernels compute them."""
    if np.issubdtype(values.dtype, np.integer):
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
        idx = g[row_ids(block)] * m + block.indices
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
        rows = g[row_ids(block)]
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
                s = xp.bincount(rows, weights=xp.where(nan, 0.0, _as_float(data, xp)), minlength=sub.shape[0])
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
        part = _as_float(part, xp)
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
        y = _as_float(z.toarray() if issparse(z) else z, xp) - z0[None, :]
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
        res = _as_float(block, xp) @ comps
    return to_host(xp.asarray(res) - xp.asarray(offset, dtype=xp.float64)[None, :])


# ------------------------------------------------------------------------------------ groups of rows
# (rank_genes_groups, aggregate: per-group moments are sums of per-block indicator products G @ X)


def group_indicator(block, codes, n_groups: int):
    """(n_groups, rows) float64 indicator matrix of a block's rows; rows with code < 0 belong to no group."""
    from atlasflow.backend import sparse_of

    return _indicator(xp_of(block), sparse_of(block), codes, n_groups)


def _indicator(xp, sparse, codes, n_groups: int):
    codes = xp.asarray(codes).ravel().astype(xp.int64)
    keep = xp.flatnonzero(codes >= 0)
    ones = xp.ones(keep.shape[0], dtype=xp.float64)
    return sparse.coo_matrix((ones, (codes[keep], keep)), shape=(n_groups, codes.shape[0])).tocsr()


#: Stored values per piece when ``group_moments`` walks a large sparse block (bounds its float64 copies).
MOMENT_PIECE_NNZ = 1 << 22


def group_moments(block, codes, n_groups: int, squares: bool = True):
    """Per-group column sums, sums of squares and non-zero counts, plus one count of non-count values.

    Returns ``concat([sums, squares, nnz].ravel(), [n_not_counts])`` in float64 (``squares`` zero-filled
    when not asked), each the indicator product ``G @ f(X)``. Values are squared in the block's own dtype
    before the float64 accumulation, as scanpy's mean/variance and ``get.aggregate`` do, so integer counts
    give bitwise-equal results. ``n_not_counts`` counts negative or non-integer values (0: the data look
    like raw counts). Sparse blocks are walked in row pieces of at most ``MOMENT_PIECE_NNZ`` values.
    """
    from atlasflow.backend import sparse_of

    xp = xp_of(block)
    codes = xp.asarray(codes).ravel()
    m = block.shape[1]
    if not issparse(block):
        g = _indicator(xp, sparse_of(block), codes, n_groups)
        sums = g @ block.astype(xp.float64)
        sq = g @ (block * block).astype(xp.float64) if squares else xp.zeros((n_groups, m))
        nnz = g @ (block != 0).astype(xp.float64)
        return xp.concatenate([xp.asarray(sums).ravel(), xp.asarray(sq).ravel(), xp.asarray(nnz).ravel(),
                               xp.asarray([_not_counts(block)], dtype=xp.float64)])
    sparse = sparse_of(block)
    block = block.tocsr() if block.format != "csr" else block
    acc = xp.zeros((3, n_groups, m))
    not_counts = 0
    indptr = np.asarray(to_host(block.indptr), dtype=np.int64)
    for r0, r1 in _row_pieces(indptr, MOMENT_PIECE_NNZ):
        a, b = int(indptr[r0]), int(indptr[r1])
        ptr = block.indptr[r0 : r1 + 1] - block.indptr[r0]
        idx, vals = block.indices[a:b], block.data[a:b]
        g = _indicator(xp, sparse, codes[r0:r1], n_groups)

        def prod(d, ptr=ptr, idx=idx, g=g, n=r1 - r0):
            return (g @ sparse.csr_matrix((d, idx, ptr), shape=(n, m))).toarray()

        acc[0] += prod(vals.astype(xp.float64))
        if squares:
            acc[1] += prod((vals * vals).astype(xp.float64))
        acc[2] += prod((vals != 0).astype(xp.float64))
        not_counts += int(_not_counts(vals))
    return xp.concatenate([acc.ravel(), xp.asarray([not_counts], dtype=xp.float64)])


def _not_counts(vals):
    """How many values are negative or not integers."""
    xp = xp_of(vals)
    if vals.dtype.kind == "f":
        return xp.count_nonzero(xp.signbit(vals) | (vals % 1 != 0))
    return xp.count_nonzero(vals < 0)


def _row_pieces(indptr: np.ndarray, piece_nnz: int) -> list[tuple[int, int]]:
    """Consecutive row ranges holding about ``piece_nnz`` stored values each (at least one row each)."""
    n = indptr.shape[0] - 1
    if n <= 0:
        return [(0, 0)] if n == 0 else []
    cuts = np.searchsorted(indptr, np.arange(piece_nnz, int(indptr[-1]), piece_nnz), side="left")
    bounds = np.unique(np.concatenate([[0], np.clip(cuts, 1, n), [n]]))
    return [(int(lo), int(hi)) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True) if hi > lo] or [(0, n)]


def logreg_loss_grad(block, labels, coef, intercept, col_idx=None):
    """Summed (not averaged) logistic loss and its gradient over one block's labelled rows.

    ``labels``: class index per row (-1: row not in the fit). ``coef``: (n_classes, n_features) for the
    multinomial model, or (1, n_features) for the binary model (``labels`` 0/1, positive class 1).
    Returns ``concat([loss], grad_coef.ravel(), grad_intercept)`` in float64.
    """
    xp = xp_of(block)
    y = xp.asarray(labels).ravel().astype(xp.int64)
    keep = xp.flatnonzero(y >= 0)
    x = block[keep] if keep.shape[0] < block.shape[0] else block
    if col_idx is not None:
        x = x[:, xp.asarray(col_idx)]
    x = x.astype(xp.float64, copy=False)
    y = y[keep]
    w = xp.asarray(coef, dtype=xp.float64)
    b = xp.asarray(intercept, dtype=xp.float64)
    raw = xp.asarray(x @ w.T) + b[None, :]
    if w.shape[0] == 1:  # binary: log(1 + e^raw) - y * raw
        r = raw[:, 0]
        loss = xp.sum(xp.logaddexp(0.0, r) - y * r)
        resid = (1.0 / (1.0 + xp.exp(-r)) - y)[:, None]
    else:  # multinomial: logsumexp(raw) - raw[y]
        top = raw.max(axis=1, keepdims=True)
        lse = top[:, 0] + xp.log(xp.exp(raw - top).sum(axis=1))
        loss = xp.sum(lse - raw[xp.arange(y.shape[0]), y])
        resid = xp.exp(raw - lse[:, None])
        resid[xp.arange(y.shape[0]), y] -= 1.0
    grad_w = xp.asarray(x.T @ resid).T
    grad_b = resid.sum(axis=0)
    return xp.concatenate([xp.asarray([loss], dtype=xp.float64), grad_w.ravel(), grad_b])


def gene_block_ranks(block, codes, n_codes: int, group_sizes, tested, reference: int | None):
    """Exact Wilcoxon rank sums of a gene-major block (genes x cells CSR), zeros handled analytically.

    Every gene's values are ranked across the cells of the comparison (all cells, or a tested group
    plus the reference group) with average ranks for ties, as ``scipy.stats.rankdata``. Only the
    stored non-zeros are sorted: all zeros of a gene share one tied rank, ``n_negative + (z + 1) / 2``
    for ``z`` zeros, and the values above zero are shifted up by ``z``.

    Per gene (row of the result): per-code sums (``n_codes``), per-code non-zero counts (``n_codes``),
    the rank sum of each tested group (``len(tested)``), its tie-correction factor ``1 - sum(t^3 - t) /
    (N^3 - N)`` (``len(tested)``), and the count of negative or non-integer values (1).
    """
    xp = xp_of(block)
    codes = xp.asarray(codes).ravel()
    sizes = xp.asarray(group_sizes, dtype=xp.float64)
    if xp is np and reference is None:  # CPU, one group against the rest: a sort per gene, numba loops (~4x faster)
        return _gene_block_ranks_rest(block, codes, n_codes, sizes, tested)
    return _gene_block_ranks_sorted(block, codes, n_codes, sizes, tested, reference)


def _gene_block_ranks_sorted(block, codes, n_codes: int, sizes, tested, reference: int | None):
    """``gene_block_ranks`` vectorised for any array module: one sort of the whole block by (gene, value)."""
    xp = xp_of(block)
    g_rows = block.shape[0]
    data = block.data
    # row of each stored value (searchsorted rather than repeat: CuPy's repeat takes no array of counts)
    rows = (xp.searchsorted(block.indptr, xp.arange(block.data.shape[0]), side="right") - 1).astype(xp.int32)
    keep = data != 0
    data, rows, cols = data[keep], rows[keep], block.indices[keep]
    c = codes[cols].astype(xp.int32)
    del cols, keep
    key = rows.astype(xp.int64) * n_codes + c
    sums = xp.bincount(key, weights=data.astype(xp.float64), minlength=g_rows * n_codes).reshape(g_rows, n_codes)
    nnz = xp.bincount(key, minlength=g_rows * n_codes).reshape(g_rows, n_codes).astype(xp.float64)
    del key
    not_counts = xp.bincount(rows, weights=(xp.signbit(data) | (data % 1 != 0)).astype(xp.float64),
                             minlength=g_rows) if data.dtype.kind == "f" else xp.zeros(g_rows)
    if not data.shape[0]:
        order = xp.zeros(0, dtype=xp.int64)
    elif xp is np and data.dtype == np.float32:
        order = np.argsort(_row_value_key(rows, data), kind="stable")
    elif xp is np:
        order = np.lexsort((data, rows))  # keys of their own dtypes, no stacked copy
    else:
        order = xp.lexsort(xp.stack([data.astype(xp.float64), rows.astype(xp.float64)]))
    sv, sr, sc = data[order], rows[order], c[order]
    del data, rows, c, order
    tested = [int(t) for t in tested]
    if reference is None:
        n_all = float(sizes.sum())
        ranks, zero_rank, tsum = _ranks_sorted(sv, sr, g_rows, n_all)
        per_code = xp.bincount(sr.astype(xp.int64) * n_codes + sc, weights=ranks,
                               minlength=g_rows * n_codes).reshape(g_rows, n_codes)
        return _against_rest(sums, nnz, per_code, zero_rank, tsum, not_counts, sizes, tested, n_all)
    rank_sums = xp.zeros((g_rows, len(tested)))
    tie = xp.ones((g_rows, len(tested)))
    for j, t in enumerate(tested):
        sel = (sc == t) | (sc == reference)
        n_pair = float(sizes[t] + sizes[reference])
        ranks, zero_rank, tsum = _ranks_sorted(sv[sel], sr[sel], g_rows, n_pair)
        mine = sc[sel] == t
        rank_sums[:, j] = xp.bincount(sr[sel][mine], weights=ranks[mine], minlength=g_rows) \
            + (sizes[t] - nnz[:, t]) * zero_rank
        tie[:, j] = _tie_factor(tsum, n_pair)
    return xp.concatenate([sums, nnz, rank_sums, tie, not_counts[:, None]], axis=1)


def _gene_block_ranks_rest(block, codes, n_codes: int, sizes, tested):
    """``gene_block_ranks`` with ``reference=None`` on a NumPy block, each gene's non-zeros ranked on their own.

    Two numba loops around NumPy's argsort of each gene's values (SIMD, ~2x numba's sort): the same numbers
    as the vectorised path (rank sums are sums of half-integers, exact in any order; group sums and tie
    terms are added in the same order).
    """
    g_rows = block.shape[0]
    n_all = float(sizes.sum())
    compact, ranks = _rest_ranks_kernels()
    sums, nnz, per_code = (np.zeros((g_rows, n_codes)) for _ in range(3))
    n_neg, tsum, not_counts = (np.zeros(g_rows) for _ in range(3))
    vals = np.empty(block.data.shape[0], dtype=block.data.dtype)
    cods = np.empty(block.data.shape[0], dtype=np.int64)
    ptr = np.zeros(g_rows + 1, dtype=np.int64)
    compact(np.asarray(block.indptr, dtype=np.int64), block.indices, block.data, np.asarray(codes, dtype=np.int64),
            block.data.dtype.kind == "f", vals, cods, ptr, sums, nnz, n_neg, not_counts)
    order = np.empty(int(ptr[-1]), dtype=np.int64)
    for r in range(g_rows):
        lo, hi = ptr[r], ptr[r + 1]
        order[lo:hi] = np.argsort(vals[lo:hi])
    ranks(vals, cods, ptr, order, n_all, per_code, tsum)
    zero_rank = n_neg + (n_all - np.diff(ptr) + 1.0) / 2.0
    return _against_rest(sums, nnz, per_code, zero_rank, tsum, not_counts, sizes, tested, n_all)


def _against_rest(sums, nnz, per_code, zero_rank, tsum, not_counts, sizes, tested, n_all: float):
    """The columns of ``gene_block_ranks`` from per-code rank sums of the non-zeros and each gene's zero rank."""
    xp = xp_of(sums)
    rank_sums = xp.zeros((sums.shape[0], len(tested)))
    tie = xp.ones((sums.shape[0], len(tested)))
    for j, t in enumerate(int(t) for t in tested):
        rank_sums[:, j] = per_code[:, t] + (sizes[t] - nnz[:, t]) * zero_rank
        tie[:, j] = _tie_factor(tsum, n_all)
    return xp.concatenate([sums, nnz, rank_sums, tie, not_counts[:, None]], axis=1)


_REST_RANKS_KERNELS = None


def _rest_ranks_kernels():
    """The numba loops of ``_gene_block_ranks_rest``.

    ``compact``: per gene (row), its stored non-zeros in stored order into ``vals``/``cods`` (segments
    ``ptr``), with per-code sums and counts, negatives and the non-count tally. ``ranks``: given each
    segment's sort order, average ranks among ``n_all`` cells (the zeros tied in one block between the
    negative and the positive values) summed per code, and ``sum(t^3 - t)`` over the tie groups plus the
    zeros' (``** 3.0`` calls libm's pow, as NumPy's power does).
    """
    global _REST_RANKS_KERNELS
    if _REST_RANKS_KERNELS is None:
        import numba

        @numba.njit(cache=True, nogil=True)
        def compact(indptr, indices, data, codes, is_float, vals, cods, ptr, sums, nnz, n_neg, not_counts):
            k = 0
            for r in range(indptr.shape[0] - 1):
                for a in range(indptr[r], indptr[r + 1]):
                    v = data[a]
                    if v != 0:
                        c = codes[indices[a]]
                        vals[k] = v
                        cods[k] = c
                        k += 1
                        sums[r, c] += np.float64(v)
                        nnz[r, c] += 1.0
                        if v < 0:
                            n_neg[r] += 1.0
                        if is_float and (v < 0 or v % 1 != 0):
                            not_counts[r] += 1.0
                ptr[r + 1] = k

        @numba.njit(cache=True, nogil=True)
        def ranks(vals, cods, ptr, order, n_all, per_code, tsum):
            for r in range(ptr.shape[0] - 1):
                lo, hi = ptr[r], ptr[r + 1]
                z = n_all - (hi - lo)
                acc = 0.0
                g0 = 0
                while g0 < hi - lo:
                    v0 = vals[lo + order[lo + g0]]
                    g1 = g0 + 1
                    while g1 < hi - lo and vals[lo + order[lo + g1]] == v0:
                        g1 += 1
                    cnt = float(g1 - g0)
                    rank = float(g0) + (cnt + 1.0) / 2.0 + (z if v0 > 0 else 0.0)
                    for q in range(g0, g1):
                        per_code[r, cods[lo + order[lo + q]]] += rank
                    acc += cnt**3.0 - cnt
                    g0 = g1
                tsum[r] = acc + (z**3.0 - z)

        _REST_RANKS_KERNELS = compact, ranks
    return _REST_RANKS_KERNELS


def _ranks_sorted(values, rows, n_rows: int, n_cells: float):
    """Average ranks (1-based, among ``n_cells`` cells) of non-zeros sorted by (row, value).

    Returns the ranks of the given entries, each row's rank of its zeros and each row's
    ``sum(t^3 - t)`` over tie groups (zeros included).
    """
    xp = xp_of(values)
    n = values.shape[0]
    k = xp.bincount(rows, minlength=n_rows).astype(xp.float64)
    starts = xp.zeros(n_rows + 1, dtype=xp.int64)
    starts[1:] = xp.cumsum(k.astype(xp.int64))
    pos = xp.arange(n, dtype=xp.int64) - starts[rows]
    new = xp.ones(n, dtype=bool)
    if n > 1:
        new[1:] = (rows[1:] != rows[:-1]) | (values[1:] != values[:-1])
    gid = xp.cumsum(new) - 1
    gstart = pos[new].astype(xp.float64)
    gcount = xp.bincount(gid).astype(xp.float64) if n else xp.zeros(0)
    grow = rows[new]
    z = n_cells - k
    n_neg = xp.bincount(rows, weights=(values < 0).astype(xp.float64), minlength=n_rows)
    shift = xp.where(values > 0, z[rows], 0.0)
    ranks = gstart[gid] + (gcount[gid] + 1.0) / 2.0 + shift
    zero_rank = n_neg + (z + 1.0) / 2.0
    tsum = xp.bincount(grow, weights=gcount**3 - gcount, minlength=n_rows) + (z**3 - z)
    return ranks, zero_rank, tsum


def _tie_factor(tsum, n_cells: float):
    """scipy's ``tiecorrect`` from the summed ``t^3 - t`` of the tie groups (1 for fewer than 2 cells)."""
    if n_cells < 2:
        return tsum * 0 + 1.0
    return 1.0 - tsum / (n_cells**3 - n_cells)


def _row_value_key(rows, values):
    """uint64 keys ordering entries by (row, float32 value): row in the high word, the value's bits made
    order-preserving (sign bit flipped for positives, all bits for negatives) in the low word."""
    u = values.view(np.uint32)
    u = np.where(u >> np.uint32(31), ~u, u | np.uint32(0x80000000))
    return (rows.astype(np.uint64) << np.uint64(32)) | u.astype(np.uint64)
