"""``normalize_total`` and ``log1p`` with scanpy's semantics on Dask-backed AnnData."""

from __future__ import annotations

import logging

import anndata as ad
import dask.array as da
import numpy as np

from atlasflow import kernels, lazy, progress, store
from atlasflow.errors import InputError

log = logging.getLogger(__name__)


def _cell_counts(X, gene_mask=None) -> da.Array:
    if gene_mask is None:  # a matrix as stored: its values alone give the totals
        stored = store.stored_row_sums(X)
        return kernels.per_row(X, kernels.row_sums, 1)[:, 0] if stored is None else stored
    return kernels.per_row(X, kernels.row_sums_masked, 1, gene_mask)[:, 0]


def normalize_total(
    adata: ad.AnnData,
    *,
    target_sum: float | None = None,
    exclude_highly_expressed: bool = False,
    max_fraction: float = 0.05,
    exclude_genes=None,
    key_added: str | None = None,
    inplace: bool = True,
):
    """Scale each cell to ``target_sum`` total counts (default: the median of the cells' totals).

    As scanpy for CSR input: per-cell totals are float64 sums stored as float32, the median runs over all
    cells, rows with zero total are left unchanged. With ``exclude_highly_expressed``, genes holding more
    than ``max_fraction`` of some cell's counts are left out of the totals (one extra pass over X).
    ``exclude_genes`` (a boolean mask over genes, e.g. ERCC spike-ins) are left out of the totals as well,
    and scaled with their cell like every other gene. X stays lazy; only the per-cell totals are computed.
    """
    X = adata.X
    if not isinstance(X, da.Array):
        raise InputError("normalize_total: X must be a Dask array (open the store with atlasflow.store.open_store)")
    keep = None if exclude_genes is None or not np.any(exclude_genes) else ~np.asarray(exclude_genes, dtype=bool)
    (counts,) = progress.compute(_cell_counts(X, keep), label="normalize_total: cell totals")
    counts = counts.astype(np.float32)
    gene_subset = keep
    if exclude_highly_expressed:
        thr = da.from_array(counts.astype(np.float64) * max_fraction, chunks=(X.chunks[0],))
        hits = X.map_blocks(
            lambda b, t: kernels.col_count_above(b, t).reshape(1, -1), thr[:, None],
            chunks=((1,) * X.numblocks[0], (X.shape[1],)), dtype=np.float64, meta=np.empty((0, 0)),
        ).sum(axis=0)
        (hits,) = progress.compute(hits, label="normalize_total: highly expressed genes")
        gene_subset = (hits == 0) if keep is None else (hits == 0) & keep
        log.info("normalize_total: excluding %d highly expressed genes", int((~gene_subset).sum()))
        (counts,) = progress.compute(_cell_counts(X, gene_subset), label="normalize_total: cell totals")
        counts = counts.astype(np.float32)
    if target_sum is None:
        target_sum = float(np.median(counts))
        log.info("normalize_total: target_sum = median of counts = %g", target_sum)
    factors = (counts / np.float32(target_sum)).astype(np.float32)
    divisor = np.where(factors == 0, np.float32(1), factors)  # cells without counts stay as they are
    new_x = lazy.map_values(X, kernels.divide_values, per_row=divisor, dtype=np.result_type(X.dtype, np.float32))
    if not inplace:
        return {"X": new_x, "norm_factor": factors, "target_sum": float(target_sum)}
    adata.X = new_x
    if key_added is not None:
        adata.obs[key_added] = counts
    return None


def log1p(adata: ad.AnnData, *, base: float | None = None) -> None:
    """Natural (or ``base``) logarithm of 1 + X, lazily; records ``uns["log1p"]`` as scanpy does."""
    if "log1p" in adata.uns:
        log.warning("adata.X seems to be already log-transformed.")
    X = adata.X
    adata.X = lazy.map_values(X, kernels.log1p_values, base, dtype=np.result_type(X.dtype, np.float32))
    adata.uns["log1p"] = {"base": base}
