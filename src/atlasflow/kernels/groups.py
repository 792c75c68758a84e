"""Statistics of groups of rows: indicator products (per-group moments) and the logistic-regression loss
and gradient."""

from __future__ import annotations

import numpy as np

from atlasflow.backend import issparse, to_host, xp_of


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
