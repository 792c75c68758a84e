"""Multinomial logistic regression out of core for ``rank_genes_groups(method="logreg")``.

scanpy fits ``sklearn.linear_model.LogisticRegression()`` (defaults: L2 penalty, ``C=1.0``, lbfgs,
``max_iter=100``, ``tol=1e-4``, intercept not penalised) on the cells of the tested groups and reports
the coefficients as scores. We minimise the same objective,

    mean_i loss_i(W, b) + ||W||^2 / (2 C n),

with the same optimiser (scipy L-BFGS-B, ``maxiter=max_iter``, ``gtol=tol``, ``ftol=64 eps``,
``maxls=50``, zero start), but loss and gradient are sums of per-block partials computed on the
workers: one Dask compute (one read of X) per function evaluation. Numerical differences from
sklearn: sklearn evaluates in float32 when X is float32 and sums in a different order, we always use
float64; as both usually stop at ``max_iter`` before full convergence, coefficients agree closely but
not bitwise, and the gene ranking can differ among genes with nearly equal coefficients.
"""

from __future__ import annotations

import contextlib
import logging

import dask
import dask.array as da
import numpy as np
from scipy import optimize

from atlasflow import kernels, passes

log = logging.getLogger("atlasflow.tl.markers")


def _single_threaded_blas():
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - comes with scikit-learn
        return contextlib.nullcontext()
    return threadpool_limits(1, user_api="blas")


def _tree_sum(parts):
    while len(parts) > 1:
        parts = [dask.delayed(np.add)(parts[i], parts[i + 1]) if i + 1 < len(parts) else parts[i]
                 for i in range(0, len(parts), 2)]
    return parts[0]


def _prepare(block, labels, col_idx):
    """The block's rows that are in the fit and its selected genes, as float64."""
    keep = np.flatnonzero(np.asarray(labels) >= 0)
    block = block[keep] if keep.shape[0] < block.shape[0] else block
    if col_idx is not None:
        block = block[:, col_idx]
    return block.astype(np.float64)


def fit(x: da.Array, labels: np.ndarray, n_classes: int, *, C: float = 1.0, max_iter: int = 100,
        tol: float = 1e-4, col_idx=None, persist: bool = False):
    """Fit on the rows with ``labels >= 0`` (class indices); returns ``(coef, intercept, result)``.

    ``coef`` has one row per class (multinomial) or a single row for the positive class 1 (binary),
    as sklearn's ``coef_``. ``persist`` keeps the prepared blocks (rows of the fit, selected genes, float64)
    in worker memory between iterations instead of reading X again at every evaluation.
    """
    if x.numblocks[1] != 1:
        x = x.rechunk({1: -1})
    m = x.shape[1] if col_idx is None else len(col_idx)
    k = 1 if n_classes == 2 else n_classes
    n = int((labels >= 0).sum())
    l2 = 1.0 / (C * n)
    bounds = np.concatenate([[0], np.cumsum(x.chunks[0])])
    blocks, lab, used = [], [], []
    cols = None if col_idx is None else dask.delayed(np.asarray(col_idx))
    for i, blk in enumerate(x.to_delayed().ravel()):
        y = labels[bounds[i] : bounds[i + 1]]
        if (y >= 0).any():  # rows of the fit, selected genes, float64: prepared once per block
            blocks.append(dask.delayed(_prepare)(blk, y, cols))
            lab.append(y[y >= 0])
            used.append(x.blocks[i])

    def count_pass():  # to_delayed optimised the graph: its read layers are gone
        passes.count(*used)

    if persist:
        count_pass()
        blocks = list(dask.persist(*blocks))
    n_evals = 0

    def fun(w):
        nonlocal n_evals
        n_evals += 1
        coef, b = w[: k * m].reshape(k, m), w[k * m :]
        wd, bd = dask.delayed(coef), dask.delayed(b)
        parts = [dask.delayed(kernels.logreg_loss_grad)(blk, y, wd, bd) for blk, y in zip(blocks, lab, strict=True)]
        if not persist:
            count_pass()
        (tot,) = dask.compute(_tree_sum(parts))
        tot = np.asarray(tot, dtype=np.float64)
        loss = tot[0] / n + 0.5 * l2 * float(np.dot(coef.ravel(), coef.ravel()))
        grad = np.concatenate([tot[1 : 1 + k * m] / n + l2 * coef.ravel(), tot[1 + k * m :] / n])
        return loss, grad

    w0 = np.zeros(k * m + k)
    # L-BFGS's vector updates are tiny: threaded BLAS only spins (100x slower on a busy machine)
    with _single_threaded_blas():
        res = optimize.minimize(
            fun, w0, method="L-BFGS-B", jac=True,
            options={"maxiter": max_iter, "maxls": 50, "gtol": tol, "ftol": 64 * np.finfo(float).eps},
        )
    if not res.success or res.nit >= max_iter:
        log.warning("logreg: L-BFGS stopped after %d iterations without converging (%s); increase max_iter",
                    res.nit, res.message)
    log.info("logreg: %d iterations, %d passes over X, loss %.6g", res.nit, n_evals, res.fun)
    return res.x[: k * m].reshape(k, m), res.x[k * m :], res
