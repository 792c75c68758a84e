"""Highly variable genes out of core, as ``scanpy.pp.highly_variable_genes`` (plus scvi-tools' Poisson flavor).

Every flavor is a function of small per-gene (per batch) sums computed block by block from X:

* ``seurat`` / ``cell_ranger``: sums and sums of squares (of ``expm1(X)`` for seurat) and counts of
  expressed cells per batch, one pass; dispersions, bins and normalisation then run on the gene table.
* ``seurat_v3`` / ``seurat_v3_paper``: pass 1 gives per-batch means and variances, a loess fit gives the
  regularised standard deviation, and pass 2 sums the values clipped at ``mean + sqrt(n) * std``.
* ``poisson_gene_selection`` (scvi-tools): per-batch gene sums, expressed-cell counts and cell totals in one
  pass; the expected fraction of zeros under a Poisson model is computed from those totals.

Arithmetic follows scanpy's (float64 sums of values squared in the data's dtype, the same variance formula,
pandas for bins and bin statistics) so the same genes are selected, not merely similar ones.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping

import anndata as ad
import numpy as np
import pandas as pd

from atlasflow import kernels, progress
from atlasflow.errors import ConfigError, InputError
from atlasflow.pp._utils import get_matrix, row_aligned

log = logging.getLogger(__name__)

FLAVORS = ("seurat", "cell_ranger", "seurat_v3", "seurat_v3_paper", "poisson_gene_selection")
COUNT_FLAVORS = ("seurat_v3", "seurat_v3_paper", "poisson_gene_selection")
#: scale constant of a normal distribution's MAD (``scipy.stats.norm.ppf(0.75)``), as statsmodels uses
_MAD_C = 0.6744897501960817


def highly_variable_genes(
    adata: ad.AnnData,
    *,
    layer: str | None = None,
    n_top_genes: int | None = None,
    min_disp: float = 0.5,
    max_disp: float = np.inf,
    min_mean: float = 0.0125,
    max_mean: float = 3,
    span: float = 0.3,
    n_bins: int = 20,
    flavor: str = "seurat",
    subset: bool = False,
    inplace: bool = True,
    batch_key: str | None = None,
    check_values: bool = True,
    counts: ad.AnnData | None = None,
):
    """Annotate highly variable genes with scanpy's parameters, defaults and var columns.

    ``seurat`` and ``cell_ranger`` expect log data; ``seurat_v3``, ``seurat_v3_paper`` and
    ``poisson_gene_selection`` expect raw counts, taken from ``counts`` (an AnnData with the same cells and
    genes, e.g. the filter stage's store) when given, else from ``adata``. Non-count data is an error for
    those flavors unless ``check_values=False``. ``n_top_genes`` above the gene count is capped with a
    warning. Returns the table when ``inplace=False``; otherwise writes var columns and ``uns['hvg']``.
    """
    if flavor not in FLAVORS:
        raise ConfigError(f"highly_variable_genes: flavor={flavor!r} is not one of {', '.join(FLAVORS)}")
    if batch_key is not None and batch_key not in adata.obs:
        raise InputError(f"highly_variable_genes: batch_key={batch_key!r} is not a column of obs")
    source = adata
    if counts is not None:
        if flavor in COUNT_FLAVORS:
            _check_same_layout(adata, counts)
            source = counts
        else:
            log.warning("highly_variable_genes: flavor=%r works on log data; ignoring the counts input", flavor)
    X = get_matrix(source, layer, "highly_variable_genes")
    n, m = X.shape
    if n_top_genes is not None:
        n_top_genes = int(n_top_genes)
        if n_top_genes <= 0:
            raise ConfigError(f"highly_variable_genes: n_top_genes={n_top_genes} must be positive")
        if n_top_genes > m:
            log.warning("highly_variable_genes: n_top_genes=%d > %d genes, returning all genes", n_top_genes, m)
            n_top_genes = m
    codes, n_batches = _batch_codes(adata.obs, batch_key)

    if flavor in ("seurat_v3", "seurat_v3_paper"):
        df = _seurat_v3(X, codes, n_batches, flavor=flavor, n_top_genes=2000 if n_top_genes is None else n_top_genes,
                        span=span, check_values=check_values, batched=batch_key is not None)
    elif flavor == "poisson_gene_selection":
        df = _poisson(X, codes, n_batches, n_top_genes=min(4000, m) if n_top_genes is None else n_top_genes,
                      check_values=check_values)
    else:
        factor = None
        if flavor == "seurat":
            info = adata.uns.get("log1p")
            base = info.get("base") if isinstance(info, Mapping) else None
            factor = np.log(base) if base is not None else None  # seurat undoes the log1p: expm1(x * ln(base))
        cutoff = _Cutoffs(min_disp, max_disp, min_mean, max_mean) if n_top_genes is None else n_top_genes
        df = _dispersion_flavors(X, codes, n_batches, flavor=flavor, n_bins=n_bins, cutoff=cutoff, factor=factor,
                                 batched=batch_key is not None, var_names=adata.var_names)
    df.index = adata.var_names
    n_hvg = int(df["highly_variable"].sum())
    log.info("highly_variable_genes: flavor=%s selected %d of %d genes", flavor, n_hvg, m)
    if not inplace:
        return df.loc[df["highly_variable"].to_numpy()] if subset else df
    for col in df.columns:
        adata.var[col] = df[col].to_numpy()
    adata.uns["hvg"] = {"flavor": flavor}
    if subset:
        subset_genes(adata, df["highly_variable"].to_numpy())
    return None


def subset_genes(adata: ad.AnnData, mask) -> None:
    """Keep the genes of a boolean mask, in place and lazily (X and layers become column selections)."""
    adata._inplace_subset_var(np.flatnonzero(np.asarray(mask, dtype=bool)))


# ---------------------------------------------------------------------------------------------- helpers


class _Cutoffs:
    """Mean/normalised-dispersion bounds (exclusive), as scanpy's cut-off selection."""

    def __init__(self, min_disp, max_disp, min_mean, max_mean):
        self.min_disp, self.max_disp = float(min_disp), float(max_disp)
        self.min_mean, self.max_mean = float(min_mean), float(max_mean)

    def in_bounds(self, mean, disp_norm):
        return ((mean > self.min_mean) & (mean < self.max_mean)
                & (disp_norm > self.min_disp) & (disp_norm < self.max_disp))


def _check_same_layout(adata: ad.AnnData, counts: ad.AnnData) -> None:
    if counts.shape != adata.shape:
        raise InputError(f"highly_variable_genes: the counts input has shape {counts.shape}, the data {adata.shape}")
    if not counts.obs_names.equals(adata.obs_names) or not counts.var_names.equals(adata.var_names):
        raise InputError("highly_variable_genes: the counts input holds other cells or genes than the data")


def _batch_codes(obs: pd.DataFrame, batch_key: str | None) -> tuple[np.ndarray, int]:
    """Integer batch code per cell (batches sorted as scanpy orders them) and the number of batches."""
    if batch_key is None:
        return np.zeros(len(obs), dtype=np.int64), 1
    col = obs[batch_key]
    if col.isna().any():
        raise InputError(f"highly_variable_genes: batch_key={batch_key!r} has missing values")
    cat = col.astype(str).astype("category") if not isinstance(col.dtype, pd.CategoricalDtype) else col
    cat = cat.cat.remove_unused_categories()
    return cat.cat.codes.to_numpy().astype(np.int64), len(cat.cat.categories)


def _grouped_stats(X, codes, n_batches, extra=()):
    """One pass: per-batch (sum, sum of squares, expressed cells) per gene, plus any extra lazy reductions."""
    m = X.shape[1]
    stats = kernels.over_blocks(X, kernels.col_stats_grouped, n_batches * 3 * m, row_aligned(codes, X), n_batches)
    stats, *rest = progress.compute(stats, *extra, label="highly_variable_genes: gene statistics")
    return (stats.reshape(n_batches, 3, m), *rest)


def _mean_var(sums, sumsq, n):
    """scanpy's ``_get_mean_var`` from sums: ``E[x²] - E[x]²`` with the unbiased (n - 1) correction."""
    mean = sums / n
    var = sumsq / n - mean**2
    if n != 1:
        var *= n / (n - 1)
    return mean, var


def _require_counts(X, n_bad: float, flavor: str) -> None:
    if n_bad > 0:
        raise InputError(
            f"highly_variable_genes: flavor={flavor!r} expects raw counts but found {int(n_bad)} negative or "
            "non-integer values; pass the raw count store (--counts) or check_values=False"
        )


# ------------------------------------------------------------------------------- seurat / cell_ranger


def _dispersion_flavors(X, codes, n_batches, *, flavor, n_bins, cutoff, factor, batched, var_names):
    m = X.shape[1]
    Xs = X.map_blocks(kernels.expm1_block, factor, dtype=X.dtype, meta=X._meta) if flavor == "seurat" else X
    (stats,) = _grouped_stats(Xs, codes, n_batches)
    sizes = np.bincount(codes, minlength=n_batches)
    if not batched:
        means, disp, disp_norm = _dispersion_table(stats[0, 0], stats[0, 1], sizes[0], flavor, n_bins)
        hv = _select(means, disp_norm, cutoff)
        return pd.DataFrame({"highly_variable": hv, "means": means, "dispersions": disp,
                             "dispersions_norm": disp_norm.astype(np.float32)})

    frames = []
    for b in range(n_batches):
        expressed = stats[b, 2] > 0
        table = np.zeros((m, 4))
        means, disp, disp_norm = _dispersion_table(stats[b, 0][expressed], stats[b, 1][expressed], sizes[b],
                                                   flavor, n_bins)
        hv = _select(means, disp_norm, cutoff)
        table[expressed] = np.column_stack([means, disp, disp_norm, hv])
        frames.append(pd.DataFrame(table, columns=["means", "dispersions", "dispersions_norm", "highly_variable"],
                                   index=np.arange(m)))
    df = pd.concat(frames)
    df = df.groupby(df.index).agg({"means": "mean", "dispersions": "mean", "dispersions_norm": "mean",
                                   "highly_variable": "sum"})
    df["highly_variable_nbatches"] = df["highly_variable"].astype(np.int64)
    df["highly_variable_intersection"] = df["highly_variable_nbatches"] == n_batches
    if isinstance(cutoff, int):
        # rank by batches selected, ties by mean normalised dispersion, equal ties in gene-name order (as scanpy)
        by_name = df.iloc[np.argsort(np.asarray(var_names, dtype=str), kind="stable")]
        ranked = by_name.sort_values(["highly_variable_nbatches", "dispersions_norm"], ascending=False,
                                     na_position="last")
        hv = np.zeros(m, dtype=bool)
        hv[ranked.index.to_numpy()[:cutoff]] = True
        df["highly_variable"] = hv
    else:
        df["dispersions_norm"] = df["dispersions_norm"].fillna(0)
        df["highly_variable"] = cutoff.in_bounds(df["means"].to_numpy(), df["dispersions_norm"].to_numpy())
    out = df[["highly_variable", "means", "dispersions", "dispersions_norm",
              "highly_variable_nbatches", "highly_variable_intersection"]].copy()
    out["dispersions_norm"] = out["dispersions_norm"].astype(np.float32)
    return out.reset_index(drop=True)


def seurat_cutoff_selection(sums, sumsq, n: int, *, min_disp=0.5, max_disp=np.inf, min_mean=0.0125, max_mean=3,
                            n_bins: int = 20) -> np.ndarray:
    """scanpy's seurat-flavour selection by cut-offs (its defaults) from per-gene sums and sums of squares of the
    normalised, unlogged values of ``n`` cells: a boolean mask over the genes given."""
    mean, _, disp_norm = _dispersion_table(np.asarray(sums, dtype=np.float64), np.asarray(sumsq, dtype=np.float64),
                                           n, "seurat", n_bins)
    return _select(mean, disp_norm, _Cutoffs(min_disp, max_disp, min_mean, max_mean))


def _dispersion_table(sums, sumsq, n, flavor, n_bins):
    """Means, dispersions and bin-normalised dispersions of one batch (scanpy's seurat/cell_ranger maths)."""
    mean, var = _mean_var(sums, sumsq, n)
    mean[mean == 0] = 1e-12
    with np.errstate(divide="ignore", invalid="ignore"):
        disp = var / mean
        if flavor == "seurat":
            disp[disp == 0] = np.nan
            disp = np.log(disp)
            mean = np.log1p(mean)
    df = pd.DataFrame({"means": mean, "dispersions": disp})
    if flavor == "seurat":
        bins = n_bins
    else:
        bins = np.r_[-np.inf, np.percentile(mean, np.arange(10, 105, 5)), np.inf]
        if len(np.unique(bins)) != len(bins):
            raise InputError(
                "highly_variable_genes: flavor='cell_ranger' needs distinct mean-expression percentiles; "
                "too many genes share one mean (unexpressed genes?): filter genes (min_cells) first"
            )
    df["mean_bin"] = pd.cut(df["means"], bins=bins)
    grouped = df.groupby("mean_bin", observed=True)["dispersions"]
    if flavor == "seurat":
        stats = grouped.agg(avg="mean", dev="std")
        single = stats["dev"].isnull()
        if single.any():  # a bin with one gene: its normalised dispersion is set to 1, as Seurat does
            stats.loc[single, "dev"] = stats.loc[single, "avg"]
            stats.loc[single, "avg"] = 0
    else:
        stats = grouped.agg(avg="median", dev=_mad)
    per_gene = stats.loc[df["mean_bin"]]
    disp_norm = (df["dispersions"].to_numpy() - per_gene["avg"].to_numpy()) / per_gene["dev"].to_numpy()
    return mean, disp, disp_norm


def _mad(a):
    """Median absolute deviation scaled to a normal's standard deviation (statsmodels' ``robust.mad``)."""
    a = np.asarray(a, dtype=np.float64)
    if not a.size:
        return np.nan
    return np.median(np.abs(a - np.median(a)) / _MAD_C)


def _select(mean, disp_norm, cutoff):
    """scanpy's selection: bounds on mean and normalised dispersion, or the ``n`` highest dispersions."""
    if isinstance(cutoff, _Cutoffs):
        return np.asarray(cutoff.in_bounds(mean, np.nan_to_num(disp_norm)))
    values = disp_norm[~np.isnan(disp_norm)]
    n = cutoff
    if n > values.size:
        log.warning("highly_variable_genes: n_top_genes=%d > %d genes with a normalised dispersion; "
                    "returning all of those", n, values.size)
        n = values.size
    if n == 0:
        return np.zeros(disp_norm.shape, dtype=bool)
    threshold = np.sort(values)[::-1][n - 1]
    return np.nan_to_num(disp_norm, nan=-np.inf) >= threshold


# ------------------------------------------------------------------------------------------ seurat_v3


def _loess():
    try:
        from skmisc.loess import loess
    except ImportError as exc:  # pragma: no cover - scikit-misc is a dependency
        raise ConfigError("highly_variable_genes: flavor='seurat_v3' needs scikit-misc "
                          "(pip install scikit-misc)") from exc
    return loess


def _seurat_v3(X, codes, n_batches, *, flavor, n_top_genes, span, check_values, batched):
    loess = _loess()
    m = X.shape[1]
    extra = (kernels.over_blocks(X, kernels.count_non_counts, 1),) if check_values else ()
    stats, *rest = _grouped_stats(X, codes, n_batches, extra)
    if check_values:
        _require_counts(X, rest[0][0], flavor)
    sizes = np.bincount(codes, minlength=n_batches)

    means_b, reg_std_b, clip_b = [], [], []
    for b in range(n_batches):
        mean, var = _mean_var(stats[b, 0], stats[b, 1], sizes[b])
        not_const = var > 0
        fitted = np.zeros(m, dtype=np.float64)
        model = loess(np.log10(mean[not_const]), np.log10(var[not_const]), span=span, degree=2)
        model.fit()
        fitted[not_const] = model.outputs.fitted_values
        reg_std = np.sqrt(10**fitted)
        means_b.append(mean)
        reg_std_b.append(reg_std)
        clip_b.append(reg_std * np.sqrt(sizes[b]) + mean)
    clip = np.vstack(clip_b)
    clipped = kernels.over_blocks(X, kernels.col_clipped_sums_grouped, n_batches * 2 * m, row_aligned(codes, X), clip)
    (clipped,) = progress.compute(clipped, label="highly_variable_genes: clipped sums (seurat_v3)")
    clipped = clipped.reshape(n_batches, 2, m)

    norm_vars = np.empty((n_batches, m))
    for b in range(n_batches):
        n_obs, mean, reg_std = sizes[b], means_b[b], reg_std_b[b]
        norm_vars[b] = (1 / ((n_obs - 1) * np.square(reg_std))) * (
            (n_obs * np.square(mean)) + clipped[b, 1] - 2 * clipped[b, 0] * mean
        )

    ranks = np.argsort(np.argsort(-norm_vars, axis=1), axis=1).astype(np.float32)
    nbatches = np.sum((ranks < n_top_genes).astype(int), axis=0)
    ranks[ranks >= n_top_genes] = np.nan
    median_rank = np.ma.median(np.ma.masked_invalid(ranks), axis=0).filled(np.nan)

    means, variances = _mean_var(stats[:, 0].sum(axis=0), stats[:, 1].sum(axis=0), int(sizes.sum()))
    df = pd.DataFrame({"highly_variable_nbatches": nbatches, "highly_variable_rank": median_rank})
    if flavor == "seurat_v3":
        cols, asc = ["highly_variable_rank", "highly_variable_nbatches"], [True, False]
    else:
        cols, asc = ["highly_variable_nbatches", "highly_variable_rank"], [False, True]
    order = df[cols].sort_values(cols, ascending=asc, na_position="last").index.to_numpy()
    hv = np.zeros(m, dtype=bool)
    hv[order[:n_top_genes]] = True
    out = pd.DataFrame({
        "highly_variable": hv, "highly_variable_rank": median_rank, "means": means, "variances": variances,
        "variances_norm": np.mean(norm_vars, axis=0).astype(np.float64),
    })
    if batched:
        out["highly_variable_nbatches"] = nbatches
    return out


# ----------------------------------------------------------------------------- poisson_gene_selection


def _poisson(X, codes, n_batches, *, n_top_genes, check_values):
    """Zero-enrichment ranking of scvi-tools' ``poisson_gene_selection``.

    For each gene, the observed fraction of cells without counts is compared with the fraction a Poisson
    model predicts given each cell's library size, ``mean_c exp(-p_g * N_c)`` with ``p_g`` the gene's share
    of all counts. The enrichment is the probability that a Bernoulli draw with the observed fraction gives a
    zero where one with the expected fraction does not, ``p_obs * (1 - p_exp)``; scvi-tools estimates this by
    sampling (10,000 draws), here it is computed exactly, so no seed is needed. Genes are ranked within each
    batch and selected by the number of batches ranking them in the top ``n_top_genes``, ties by median rank.
    """
    n, m = X.shape
    extra = [kernels.per_row(X, kernels.row_sums, 1)]
    if check_values:
        extra.append(kernels.over_blocks(X, kernels.count_non_counts, 1))
    stats, totals, *rest = _grouped_stats(X, codes, n_batches, extra)
    if check_values:
        _require_counts(X, rest[0][0], "poisson_gene_selection")
    totals = totals[:, 0]
    probs, obs_zero, exp_zero = (np.empty((n_batches, m)) for _ in range(3))
    for b in range(n_batches):
        in_batch = codes == b
        n_b = int(in_batch.sum())
        gene_sums = stats[b, 0]
        scaled = gene_sums / gene_sums.sum()
        obs_zero[b] = 1.0 - stats[b, 2] / n_b
        exp_zero[b] = _expected_zero_fraction(scaled, totals[in_batch])
        probs[b] = obs_zero[b] * (1.0 - exp_zero[b])
    ranks = np.argsort(np.argsort(probs, axis=1, kind="stable"), axis=1, kind="stable")
    nbatches = np.sum(ranks >= (m - n_top_genes), axis=0)
    df = pd.DataFrame({
        "observed_fraction_zeros": np.median(obs_zero, axis=0),
        "expected_fraction_zeros": np.median(exp_zero, axis=0),
        "prob_zero_enriched_nbatches": nbatches,
        "prob_zero_enrichment": np.median(probs, axis=0),
        "prob_zero_enrichment_rank": np.median(ranks, axis=0),
    })
    top = df.nlargest(n_top_genes, ["prob_zero_enriched_nbatches", "prob_zero_enrichment_rank"]).index.to_numpy()
    hv = np.zeros(m, dtype=bool)
    hv[top] = True
    df.insert(0, "highly_variable", hv)
    return df


def _expected_zero_fraction(scaled: np.ndarray, totals: np.ndarray, budget: int = 1 << 23) -> np.ndarray:
    """``mean_c exp(-scaled_g * totals_c)`` over cells, grouping equal library sizes and genes in slices."""
    sizes, weights = np.unique(totals, return_counts=True)
    weights = weights.astype(np.float64)
    out = np.empty(scaled.shape[0])
    step = max(1, budget // max(1, sizes.shape[0]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for s in range(0, scaled.shape[0], step):
            block = np.exp(-np.outer(scaled[s : s + step], sizes))
            out[s : s + step] = block @ weights
    return out / totals.shape[0]
