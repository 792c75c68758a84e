"""Gene set scores (``scanpy.tl.score_genes``) and cell cycle phases (``score_genes_cell_cycle``) out of core.

Pass 1: per-gene means over all cells (NaN-aware float64 sums), from which control genes are drawn as scanpy
does: genes of the pool are cut into expression bins by rank, and for every bin holding a scored gene,
``ctrl_size`` genes of that bin are sampled with NumPy's legacy ``RandomState(random_state)`` (the global
stream scanpy seeds with ``np.random.seed``, used through ``pandas.Series.sample``), so the same seed gives
scanpy's control genes. Pass 2: per-cell mean of the scored genes minus mean of the control genes, for all
requested gene sets at once. Exact agreement with scanpy holds for sparse (log-normalised) data; on dense
float32 data scanpy averages genes in float32 and near-equal means may bin differently.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import anndata as ad
import numpy as np
import pandas as pd

from atlasflow import kernels, passes, progress
from atlasflow.errors import ConfigError, InputError
from atlasflow.pp._utils import get_matrix

log = logging.getLogger(__name__)


def score_genes(
    adata: ad.AnnData,
    gene_list: Sequence[str],
    *,
    ctrl_as_ref: bool = True,
    ctrl_size: int = 50,
    gene_pool: Sequence[str] | None = None,
    n_bins: int = 25,
    score_name: str = "score",
    random_state: int | None = 0,
    copy: bool = False,
    use_raw: bool | None = None,
    layer: str | None = None,
):
    """Score each cell by a gene set's mean expression minus that of expression-matched control genes.

    Adds ``obs[score_name]`` (float64). Genes not in ``var_names`` are ignored with a warning; a set with no
    gene in the data is an error. Two passes over X.
    """
    adata = adata.copy() if copy else adata
    _check_raw(adata, use_raw)
    _score_sets(adata, [(gene_list, score_name, ctrl_size)], ctrl_as_ref=ctrl_as_ref, gene_pool=gene_pool,
                n_bins=n_bins, random_state=random_state, layer=layer)
    return adata if copy else None


def score_genes_cell_cycle(
    adata: ad.AnnData,
    *,
    s_genes: Sequence[str],
    g2m_genes: Sequence[str],
    copy: bool = False,
    **kwargs,
):
    """S and G2M scores (``obs['S_score']``, ``obs['G2M_score']``) and ``obs['phase']`` (G1, S or G2M).

    ``ctrl_size`` is ``min(len(s_genes), len(g2m_genes))`` as in scanpy; other keyword arguments go to
    :func:`score_genes`. Both sets share the two passes over X.
    """
    adata = adata.copy() if copy else adata
    if "ctrl_size" in kwargs:
        raise ConfigError("score_genes_cell_cycle: ctrl_size is set to min(len(s_genes), len(g2m_genes))")
    _check_raw(adata, kwargs.pop("use_raw", None))
    kwargs.pop("score_name", None)
    ctrl_size = min(len(s_genes), len(g2m_genes))
    _score_sets(adata, [(s_genes, "S_score", ctrl_size), (g2m_genes, "G2M_score", ctrl_size)], **kwargs)
    scores = adata.obs[["S_score", "G2M_score"]]
    phase = pd.Series("S", index=scores.index)
    phase[scores["G2M_score"] > scores["S_score"]] = "G2M"
    phase[np.all(scores < 0, axis=1)] = "G1"
    adata.obs["phase"] = phase
    return adata if copy else None


def _check_raw(adata, use_raw):
    if use_raw:
        raise ConfigError("score_genes: use_raw=True is not supported out of core; score X or a layer")


def _score_sets(adata, sets, *, ctrl_as_ref=True, gene_pool=None, n_bins=25, random_state=0, layer=None):
    X = get_matrix(adata, layer, "score_genes")
    n, m = X.shape
    names = adata.var_names
    wanted = []
    for genes, score_name, _ctrl in sets:
        genes = pd.Index([genes] if isinstance(genes, str) else list(genes))
        absent = genes.difference(names, sort=False)
        present = genes.intersection(names)
        if len(absent):
            log.warning("score_genes: %d genes of %s are not in var_names and ignored: %s", len(absent), score_name,
                        list(absent[:10]))
        if len(present) == 0:
            raise InputError(f"score_genes: none of the {len(genes)} genes for {score_name!r} is in the data")
        wanted.append(present)
    if gene_pool is None:
        pool = names.astype("string")
    else:
        pool = pd.Index(list(gene_pool), dtype="string").intersection(names)
    if len(pool) == 0:
        raise InputError("score_genes: gene_pool has no gene of the data")
    if int(n_bins) < 2:
        raise ConfigError(f"score_genes: n_bins={n_bins} must be at least 2")

    # pass 1: gene means (NaN values ignored), accumulated in scanpy's order and precision
    sums, nans = _sequential_col_sums(X)
    with np.errstate(invalid="ignore", divide="ignore"):
        if _is_sparse(X):
            means = sums.astype(np.float64) / (n - nans)
        else:  # numpy's nanmean keeps a float32 mean for float32 data
            means = np.true_divide(sums, n - nans, out=sums, casting="unsafe")
    avg = pd.Series(means[names.get_indexer(pool)], index=pool)
    avg = avg[np.isfinite(avg)]
    n_items = int(np.round(len(avg) / (int(n_bins) - 1)))
    if n_items == 0:
        raise ConfigError(f"score_genes: n_bins={n_bins} is too large for a pool of {len(avg)} genes")
    cut = avg.rank(method="min") // n_items

    index_sets, plan = [], []
    for (genes, score_name, ctrl_size), present in zip(sets, wanted, strict=True):
        control = _control_genes(cut, present, ctrl_as_ref=ctrl_as_ref, ctrl_size=int(ctrl_size),
                                 random_state=random_state)
        if len(control) == 0:
            hint = " Try ctrl_as_ref=False." if ctrl_as_ref else ""
            raise InputError(f"score_genes: no control genes found for {score_name!r}.{hint}")
        index_sets += [names.get_indexer(present), names.get_indexer(control)]
        plan.append(score_name)
        log.info("score_genes: %s from %d genes and %d control genes", score_name, len(present), len(control))

    # pass 2: per-cell means of every gene set and control set
    sums = kernels.per_row(X, kernels.row_sums_nan_sets, 2 * len(index_sets), [np.asarray(i) for i in index_sets])
    (sums,) = progress.compute(sums, label="score_genes: cell scores")
    for j, score_name in enumerate(plan):
        s_set, c_set, s_ctl, c_ctl = sums[:, 4 * j], sums[:, 4 * j + 1], sums[:, 4 * j + 2], sums[:, 4 * j + 3]
        with np.errstate(invalid="ignore", divide="ignore"):
            score = s_set / c_set - s_ctl / c_ctl
        adata.obs[score_name] = pd.Series(score, index=adata.obs_names, dtype="float64")


def _control_genes(cut: pd.Series, genes: pd.Index, *, ctrl_as_ref: bool, ctrl_size: int, random_state) -> pd.Index:
    """Control genes: ``ctrl_size`` random pool genes from each expression bin that holds a scored gene."""
    rng = np.random.RandomState(random_state)
    exclude = np.zeros(len(cut), dtype=bool) if ctrl_as_ref else cut.index.isin(genes)
    control = pd.Index([], dtype="string")
    for c in np.unique(cut.loc[cut.index.intersection(genes)]):  # scored genes outside the pool: no bin
        candidates = cut[(cut == c) & ~exclude].index
        if len(candidates) == 0:
            log.warning("score_genes: no control genes for expression bin %s", c)
        if ctrl_size < len(candidates):
            candidates = candidates[rng.choice(len(candidates), size=ctrl_size, replace=False)]
        if ctrl_as_ref:
            candidates = candidates.difference(genes)
        control = control.union(candidates)
    return control


def _sequential_col_sums(X):
    """Column sums folded over the row blocks in order (see ``kernels.col_sums_nan_sequential``): one pass."""
    import dask

    passes.count(X)  # to_delayed optimises the graph: its read layers would be gone
    carry = None
    for block in X.to_delayed().ravel():
        carry = dask.delayed(kernels.col_sums_nan_sequential, pure=True)(block, carry)
    return progress.compute(carry, label="score_genes: gene means")[0]


def _is_sparse(X) -> bool:
    from atlasflow.backend import is_sparse_meta

    return is_sparse_meta(X)
