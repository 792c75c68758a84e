"""Doublet detection per sample with scanpy's ``pp.scrublet`` semantics (Wolock et al. 2019), out of core.

For each batch (``obs[batch_key]``, one sample) scanpy's steps, in order: keep genes seen in >= 3 cells and
cells with >= 3 of those genes; normalise to the median total, log1p, select highly variable genes (seurat
flavour, default cut-offs); simulate ``sim_doublet_ratio * n`` doublets by adding the raw counts of random
pairs of observed cells (scanpy's draw: the same pairs for the same seed); scale observed and simulated cells
to 1e6 over those genes, z-score by the observed cells' gene means and deviations, project both on the top
``n_prin_comps`` principal axes of the observed cells; find each point's ``k_adj - 1`` nearest other points among
observed and simulated ones; turn the share of simulated neighbours into a doublet likelihood; call
doublets above the minimum between the two modes of the simulated scores' histogram.

Where this differs from scanpy, and why: the matrix is read in row blocks (three passes over the sample's
rows: genes expressed, per-cell totals with normalised gene moments, the highly variable columns); only the
sample's raw counts of its highly variable genes (~10% of columns) are held, as sparse rows; simulated
doublets are built, scaled and projected block by block, so no dense cells x genes matrix exists (scanpy
densifies both). The principal axes come from the genes' correlation matrix (eigh) instead of ARPACK: the
same subspace, so the same distances. The neighbour search is :func:`atlasflow.tl.neighbors.knn`'s (exact
below 8192 points, else pynndescent, as scanpy's rule; scanpy draws pynndescent's seed elsewhere, so large
samples agree closely rather than bit for bit).
"""

from __future__ import annotations

import logging
import math

import anndata as ad
import dask.array as da
import numpy as np
import scipy.sparse as sp

from atlasflow import kernels, progress
from atlasflow.backend import to_host
from atlasflow.errors import ConfigError, InputError
from atlasflow.pp._utils import take_rows
from atlasflow.pp.hvg import seurat_cutoff_selection

log = logging.getLogger(__name__)

#: scanpy's fixed pre-filter inside scrublet: genes in at least this many cells, cells with this many genes
MIN_CELLS_PER_GENE = 3
MIN_GENES_PER_CELL = 3
#: scanpy's highly_variable_genes defaults (seurat flavour), used by its scrublet as they are
HVG_CUTOFFS = dict(min_disp=0.5, max_disp=np.inf, min_mean=0.0125, max_mean=3)
#: Simulated doublets built, scaled and projected this many at a time
SIM_BLOCK = 20_000


def scrublet(
    adata: ad.AnnData,
    *,
    batch_key: str | None = "sample",
    sim_doublet_ratio: float = 2.0,
    expected_doublet_rate: float = 0.05,
    stdev_doublet_rate: float = 0.02,
    n_prin_comps: int = 30,
    n_neighbors: int | None = None,
    threshold: float | None = None,
    random_state: int = 0,
    knn_method: str = "auto",
    min_cells: int = 100,
) -> dict:
    """``obs['doublet_score']``, ``obs['predicted_doublet']`` and ``uns['scrublet']`` from raw counts in X.

    Each batch of ``obs[batch_key]`` (all cells when None) is scored on its own, with a fresh seed
    ``random_state``, as scanpy does. A batch with fewer than ``min_cells`` cells (after scrublet's own
    3-gene filter) is skipped with a warning: its cells get a NaN score and are not called. Returns a
    summary per batch (cells, genes used, threshold, doublets called).
    """
    if batch_key is not None and batch_key not in adata.obs:
        raise InputError(f"scrublet.batch_key: {batch_key} not in obs (has: {', '.join(map(str, adata.obs))})")
    if not sim_doublet_ratio > 0:
        raise ConfigError(f"scrublet.sim_doublet_ratio must be > 0, not {sim_doublet_ratio}")
    if not 0 < expected_doublet_rate < 1:
        raise ConfigError(f"scrublet.expected_doublet_rate must be in (0, 1), not {expected_doublet_rate}")
    n = adata.n_obs
    if batch_key is None:
        batches = {"all": np.ones(n, dtype=bool)}
    else:
        labels = adata.obs[batch_key]
        if labels.isna().any():
            raise InputError(f"scrublet.batch_key: obs[{batch_key!r}] has {int(labels.isna().sum())} missing values")
        values = labels.astype(str).to_numpy()
        batches = {b: values == b for b in np.unique(values)}
    x = adata.X if isinstance(adata.X, da.Array) else da.from_array(adata.X, chunks=(max(1, min(n, 10_000)), -1))
    scores = np.full(n, np.nan)
    called = np.zeros(n, dtype=bool)
    uns, summary = {}, {}
    for name, mask in batches.items():
        rows = np.flatnonzero(mask)
        result = _one_batch(
            take_rows(x, mask), name, sim_doublet_ratio=sim_doublet_ratio,
            expected_doublet_rate=expected_doublet_rate, stdev_doublet_rate=stdev_doublet_rate,
            n_prin_comps=n_prin_comps, n_neighbors=n_neighbors, threshold=threshold, random_state=random_state,
            knn_method=knn_method, min_cells=min_cells,
        )
        summary[name] = result.pop("summary")
        if result:
            kept = rows[result.pop("cells")]
            scores[kept] = result.pop("scores")
            called[kept] = result.pop("predicted")
            uns[name] = result
    adata.obs["doublet_score"] = scores
    adata.obs["predicted_doublet"] = called
    if batch_key is None:
        adata.uns["scrublet"] = uns.get("all", {})
    else:
        adata.uns["scrublet"] = {"batches": uns, "batched_by": batch_key}
    return summary


def _one_batch(x: da.Array, name, *, sim_doublet_ratio, expected_doublet_rate, stdev_doublet_rate, n_prin_comps,
               n_neighbors, threshold, random_state, knn_method, min_cells) -> dict:
    """Scrublet on the rows of one batch (a row-block Dask matrix of raw counts)."""
    from sklearn.utils.random import sample_without_replacement

    from atlasflow.tl.neighbors import knn

    x = x.rechunk({1: -1}) if x.numblocks[1] != 1 else x
    m = x.shape[1]
    label = f"scrublet {name}"
    # pass 1: genes seen in >= 3 cells
    nnz = progress.compute(kernels.over_blocks(x, kernels.col_sums_and_nnz, 2 * m), label=f"{label}: genes")[0][m:]
    genes = nnz >= MIN_CELLS_PER_GENE
    # pass 2: per cell, total and genes over those genes (cells with >= 3 of them are kept); per gene, sums of
    # x / total and (x / total)^2 over the kept cells: times the median total, the moments of normalize_total
    per_row = x.map_blocks(_row_stats, genes, dtype=np.float64, chunks=(x.chunks[0], (2,)), meta=np.empty((0, 0)))
    moments = kernels.over_blocks(x, _normalised_moments, 2 * m, genes)
    row_stats, moments = progress.compute(per_row, moments, label=f"{label}: totals")
    totals, n_genes = row_stats[:, 0], row_stats[:, 1]
    cells = n_genes >= MIN_GENES_PER_CELL
    n_cells = int(cells.sum())
    base = {"cells": int(x.shape[0]), "cells_scored": n_cells, "genes_expressed": int(genes.sum())}
    if n_cells < max(min_cells, n_prin_comps + 1, 3):
        log.warning("scrublet: sample %s has %d cells with >= %d genes, fewer than scrublet needs (%d): skipped, "
                    "its cells get no doublet score", name, n_cells, MIN_GENES_PER_CELL, max(min_cells, n_prin_comps + 1))
        return {"summary": {**base, "skipped": True}}
    # scanpy's seurat HVG selection on log1p of the normalised counts (its mean and variance are those of expm1)
    target = float(np.median(totals[cells]))
    sums, sumsq = moments[:m], moments[m:]
    gene_idx = np.flatnonzero(genes)
    hvg = gene_idx[seurat_cutoff_selection(sums[gene_idx] * target, sumsq[gene_idx] * target**2, n_cells,
                                           **HVG_CUTOFFS)]
    if hvg.size < n_prin_comps:
        log.warning("scrublet: sample %s has %d highly variable genes, fewer than n_prin_comps (%d): skipped",
                    name, hvg.size, n_prin_comps)
        return {"summary": {**base, "genes_hvg": int(hvg.size), "skipped": True}}
    # pass 3: raw counts of the kept cells in the highly variable genes, held as sparse rows
    kept = take_rows(x, cells)
    raw = progress.compute(kept.map_blocks(_columns_csr, hvg, dtype=np.float64, chunks=(kept.chunks[0], (hvg.size,)),
                                           meta=sp.csr_matrix((0, 0))), label=f"{label}: HVG counts")[0]
    raw = sp.csr_matrix(raw, dtype=np.float64)
    n_sim = int(n_cells * sim_doublet_ratio)
    pairs = sample_without_replacement(n_cells * n_cells, n_sim, random_state=np.random.RandomState(random_state))
    parents = np.column_stack(np.unravel_index(pairs, (n_cells, n_cells)))
    # z-score by the observed cells (scaled to 1e6), principal axes of their correlation matrix
    obs = _per_million(raw)
    g_mean = np.asarray(obs.mean(axis=0)).ravel()
    gram = (obs.T @ obs).toarray()
    cov = (gram - n_cells * np.outer(g_mean, g_mean)) / (n_cells - 1)
    g_std = np.sqrt(np.clip(np.diag(cov), 0, None))
    g_std[g_std == 0] = 1.0
    corr = cov / np.outer(g_std, g_std)
    from scipy.linalg import eigh

    k = min(n_prin_comps, hvg.size)
    _, axes = eigh(corr, subset_by_index=(hvg.size - k, hvg.size - 1))
    axes = axes[:, ::-1]
    weights = axes / g_std[:, None]
    offset = (g_mean / g_std) @ axes
    manifold = np.empty((n_cells + n_sim, k))
    manifold[:n_cells] = obs @ weights - offset
    for s in range(0, n_sim, SIM_BLOCK):
        p = parents[s : s + SIM_BLOCK]
        manifold[n_cells + s : n_cells + s + len(p)] = _per_million(raw[p[:, 0]] + raw[p[:, 1]]) @ weights - offset
    # each point's k_adj - 1 nearest other points, share of simulated ones -> doublet likelihood (Scrublet's
    # formula, with k_adj as the count). scanpy means to count the point itself too, but its check for the self
    # column (any row starting with itself) fails whenever two points coincide, a pair drawn as (i, j) and (j, i)
    # or two cells alike in the HVGs, and then only the others count: so on pbmc3k and on two of the three
    # mixology plates. Whether its round-off yields an exact zero distance there is luck; this count is not.
    k_obs = round(0.5 * math.sqrt(n_cells)) if n_neighbors is None else int(n_neighbors)
    k_adj = min(round(k_obs * (1 + n_sim / n_cells)), n_cells + n_sim)
    ind, _, method = knn(manifold, k_adj, knn_method=knn_method, random_state=random_state,
                         pynndescent_max_cells=None)  # scanpy's search at any size here
    ind = ind[:, 1:]
    n_sim_neigh = (ind >= n_cells).sum(axis=1)
    ld, se = _likelihood(n_sim_neigh, k_adj, n_sim / n_cells, expected_doublet_rate, stdev_doublet_rate)
    scores_obs, scores_sim = ld[:n_cells], ld[n_cells:]
    if threshold is None:
        try:
            threshold = threshold_minimum(scores_sim)
        except RuntimeError:
            threshold = None
            log.warning("scrublet: sample %s: no two modes in the simulated doublets' scores, so no threshold: "
                        "nothing called (set scrublet.threshold)", name)
    predicted = scores_obs > threshold if threshold is not None else np.zeros(n_cells, dtype=bool)
    detectable = float((scores_sim > threshold).mean()) if threshold is not None else float("nan")
    summary = {**base, "genes_hvg": int(hvg.size), "simulated": n_sim, "n_neighbors": k_obs, "k_adj": k_adj,
               "knn_method": method, "threshold": threshold, "doublets": int(predicted.sum()),
               "detected_rate": round(float(predicted.mean()), 4), "detectable_fraction": round(detectable, 4),
               "skipped": False}
    log.info("scrublet: sample %s: %d cells, %d HVGs, %d simulated doublets, threshold %s, %d called (%.1f%%), "
             "detectable %.1f%%", name, n_cells, hvg.size, n_sim,
             "none" if threshold is None else f"{threshold:.3f}", predicted.sum(), 100 * predicted.mean(),
             100 * detectable)
    result = {"cells": np.flatnonzero(cells), "scores": scores_obs, "predicted": predicted,
              "doublet_scores_sim": scores_sim, "doublet_parents": parents,
              "parameters": {"expected_doublet_rate": expected_doublet_rate, "sim_doublet_ratio": sim_doublet_ratio,
                             "n_neighbors": k_obs, "random_state": random_state},
              "summary": summary}
    if threshold is not None:
        result["threshold"] = float(threshold)
    return result


def _likelihood(n_sim_neigh, k_adj, r, rho, se_rho):
    """Doublet likelihood and its standard error from the share of simulated neighbours (Scrublet's model)."""
    q = (n_sim_neigh.astype(np.float64) + 1) / (k_adj + 2)
    denom = 1 - rho - q * (1 - rho - rho / r)
    ld = q * rho / r / denom
    se_q = np.sqrt(q * (1 - q) / (k_adj + 3))
    se = q * rho / r / denom**2 * np.sqrt((se_q / q * (1 - rho)) ** 2 + (se_rho / rho * (1 - q)) ** 2)
    return ld, se


def threshold_minimum(values: np.ndarray, nbins: int = 256, max_iter: int = 10_000) -> float:
    """The minimum between the two modes of the values' histogram (scikit-image's ``threshold_minimum``, which
    scanpy's scrublet calls): smooth the 256-bin histogram with a 3-wide mean until at most two maxima remain."""
    from scipy.ndimage import uniform_filter1d

    values = np.asarray(values, dtype=np.float64).ravel()
    counts, edges = np.histogram(values, bins=nbins, range=(values.min(), values.max()))
    centers = (edges[:-1] + edges[1:]) / 2
    smooth = counts.astype(np.float32)
    maxima = []
    for _ in range(max_iter):
        smooth = uniform_filter1d(smooth, 3)
        maxima = _local_maxima(smooth)
        if len(maxima) < 3:
            break
    if len(maxima) != 2:
        raise RuntimeError("the histogram does not have two maxima")
    return float(centers[maxima[0] + int(np.argmin(smooth[maxima[0] : maxima[1] + 1]))])


def _local_maxima(hist: np.ndarray) -> list[int]:
    """Where a histogram turns from rising (or flat after rising) to falling; plateaus count once."""
    out, rising = [], True
    for i in range(hist.size - 1):
        if rising and hist[i + 1] < hist[i]:
            rising = False
            out.append(i)
        elif not rising and hist[i + 1] > hist[i]:
            rising = True
    return out


def _per_million(counts: sp.csr_matrix) -> sp.csr_matrix:
    """Rows scaled to sum 1e6 (normalize_total(target_sum=1e6)); empty rows stay zero."""
    totals = np.asarray(counts.sum(axis=1)).ravel()
    scale = np.divide(1e6, totals, out=np.zeros_like(totals), where=totals > 0)
    return sp.csr_matrix(sp.diags(scale) @ counts)


# ------------------------------------------------------------------------------------- block kernels


def _host_csr(block) -> sp.csr_matrix:
    block = to_host(block)
    return block.tocsr() if sp.issparse(block) else sp.csr_matrix(block)


def _in_genes(block, genes) -> sp.csr_matrix:
    """The block's columns in ``genes`` (a boolean mask), explicit zeros dropped."""
    b = _host_csr(block)[:, np.flatnonzero(genes)]
    b.eliminate_zeros()
    return b


def _row_stats(block, genes):
    """Per row: total count and number of genes with a count, over ``genes``: (rows, 2) float64."""
    b = _in_genes(block, genes)
    return np.column_stack([np.asarray(b.sum(axis=1), dtype=np.float64).ravel(), np.diff(b.indptr)]).astype(np.float64)


def _normalised_moments(block, genes):
    """Per gene (all m; zero outside ``genes``): sums of x / total and of (x / total)^2 over the rows with at
    least MIN_GENES_PER_CELL genes, the total taken over ``genes``."""
    b = _in_genes(block, genes).astype(np.float64)
    totals = np.asarray(b.sum(axis=1)).ravel()
    keep = np.diff(b.indptr) >= MIN_GENES_PER_CELL
    inv = np.divide(1.0, totals, out=np.zeros_like(totals), where=keep & (totals > 0))
    scaled = sp.csr_matrix(sp.diags(inv) @ b)
    idx = np.flatnonzero(genes)
    m = genes.size
    sums, sq = np.zeros(m), np.zeros(m)
    sums[idx] = np.bincount(scaled.indices, weights=scaled.data, minlength=idx.size)
    sq[idx] = np.bincount(scaled.indices, weights=scaled.data * scaled.data, minlength=idx.size)
    return np.concatenate([sums, sq])


def _columns_csr(block, cols):
    return _host_csr(block)[:, cols]


__all__ = ["scrublet", "threshold_minimum"]
