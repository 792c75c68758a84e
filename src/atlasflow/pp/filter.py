"""Cell and gene filtering from the QC metrics in obs/var.

Thresholds follow ``scanpy.pp.filter_cells`` / ``filter_genes``: ``min_*`` keep values >= the bound,
``max_*`` keep values <= the bound. ``max_pct_mt`` keeps cells with ``pct_counts_mt`` strictly below it,
as the scanpy/Seurat tutorials do (``pct_counts_mt < 5``). Optional MAD-based limits flag cells more than
``nmads`` median absolute deviations from the median (per sample when a ``sample`` column exists).

``min_cells`` counts, per gene, the cells it is detected in among the cells named by ``min_cells_over``:
``"min_genes"`` (default) the cells kept by ``min_genes``/``min_counts``, the order of scanpy's tutorial
(``filter_cells`` then ``filter_genes``, then the ``max_*``/mitochondrial cuts) and of Seurat's
``CreateSeuratObject``; ``"kept"`` the cells kept by every cell filter; ``"qc"`` every cell of the QC store
(QC's ``n_cells_by_counts`` as it is: the gene set then does not depend on the cell thresholds). The count
is QC's ``n_cells_by_counts`` minus the cells left out, so X is read only when cells are left out, and only
the row blocks that hold them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import anndata as ad
import dask.array as da
import numpy as np
import pandas as pd

from atlasflow import kernels, progress
from atlasflow.errors import ConfigError, InputError
from atlasflow.pp._utils import take_columns, take_rows
from atlasflow.compat import named_layers

log = logging.getLogger(__name__)

CELL_THRESHOLDS = {
    "min_genes": ("n_genes_by_counts", np.greater_equal),
    "max_genes": ("n_genes_by_counts", np.less_equal),
    "min_counts": ("total_counts", np.greater_equal),
    "max_counts": ("total_counts", np.less_equal),
    "max_pct_mt": ("pct_counts_mt", np.less),
}
#: The thresholds scanpy's ``filter_cells`` applies, before ``filter_genes`` in its tutorial.
BEFORE_GENES = ("min_genes", "min_counts")
#: Which cells ``min_cells`` counts over (see the module docstring).
MIN_CELLS_OVER = ("min_genes", "kept", "qc")


def _mad_outliers(values: np.ndarray, nmads: float) -> np.ndarray:
    med = np.median(values)
    mad = np.median(np.abs(values - med))
    return (values < med - nmads * mad) | (values > med + nmads * mad)


def qc_filter_masks(
    adata: ad.AnnData,
    *,
    thresholds: Mapping[str, float | None] | None = None,
    min_cells: int | None = None,
    min_cells_over: str = "min_genes",
    per_sample: pd.DataFrame | None = None,
    mad: Mapping | None = None,
    sample_key: str = "sample",
    drop_doublets: bool = False,
) -> tuple[np.ndarray, np.ndarray, dict]:
    """Boolean masks of the cells and genes to keep, and a report of what each rule removed.

    ``drop_doublets`` also drops the cells the scrublet stage called doublets (``obs['predicted_doublet']``).

    ``per_sample`` (index: sample names, columns: threshold names) overrides the global thresholds
    for the cells of each listed sample. ``min_cells_over`` says which cells ``min_cells`` counts over.
    """
    if min_cells_over not in MIN_CELLS_OVER:
        raise ConfigError(f"filter: min_cells_over must be one of {', '.join(MIN_CELLS_OVER)}, not {min_cells_over!r}")
    obs, var = adata.obs, adata.var
    keep, before_genes, report = cell_filter_masks(obs, thresholds=thresholds, per_sample=per_sample, mad=mad,
                                                   sample_key=sample_key)
    if drop_doublets:
        if "predicted_doublet" not in obs:
            raise InputError("filter.drop_doublets needs obs['predicted_doublet']: enable the scrublet stage "
                             "(scrublet.enabled: true)")
        doublets = obs["predicted_doublet"].to_numpy(dtype=bool)
        report["predicted_doublet"] = int((keep & doublets).sum())
        keep = keep & ~doublets
    gene_keep = np.ones(len(var), dtype=bool)
    if min_cells:
        if "n_cells_by_counts" not in var:
            raise InputError("filter: min_cells needs var['n_cells_by_counts']; run the qc stage first")
        counted = {"min_genes": before_genes, "kept": keep, "qc": None}[min_cells_over]
        n_cells = var["n_cells_by_counts"].to_numpy(dtype=np.int64)
        if counted is not None and not counted.all():
            n_cells = n_cells - cells_per_gene(adata.X, ~counted)
        gene_keep = n_cells >= min_cells
        report["min_cells"] = int((~gene_keep).sum())
    if not gene_keep.any():
        raise InputError(f"filter: min_cells={min_cells} removes all {len(var)} genes")
    return keep, gene_keep, report


def cell_filter_masks(
    obs: pd.DataFrame,
    *,
    thresholds: Mapping[str, float | None] | None = None,
    per_sample: pd.DataFrame | None = None,
    mad: Mapping | None = None,
    sample_key: str = "sample",
) -> tuple[np.ndarray, np.ndarray, dict]:
    """The cells kept by every cell filter, the cells kept by ``BEFORE_GENES`` alone, and the cells each
    rule removed (a rule's count is over all cells, so one cell can count under several rules)."""
    thresholds = {k: v for k, v in (thresholds or {}).items() if v is not None}
    unknown = set(thresholds) - set(CELL_THRESHOLDS)
    if unknown:
        raise ConfigError(f"filter: unknown threshold(s) {sorted(unknown)}; known: {sorted(CELL_THRESHOLDS)}")
    keep = np.ones(len(obs), dtype=bool)
    before_genes = np.ones(len(obs), dtype=bool)
    report: dict[str, int] = {}
    samples = obs[sample_key].astype(str).to_numpy() if sample_key in obs else None
    for name, (column, op) in CELL_THRESHOLDS.items():
        bound = np.full(len(obs), thresholds.get(name, np.nan), dtype=np.float64)
        if per_sample is not None and name in per_sample and samples is not None:
            for sample, value in per_sample[name].dropna().items():
                bound[samples == str(sample)] = float(value)
        active = ~np.isnan(bound)
        if not active.any():
            continue
        if column not in obs:
            raise InputError(f"filter: {name} needs obs[{column!r}]; run the qc stage first")
        values = obs[column].to_numpy(dtype=np.float64)
        fails = active & ~op(values, np.where(active, bound, 0))
        report[name] = int(fails.sum())
        keep &= ~fails
        if name in BEFORE_GENES:
            before_genes &= ~fails
    if mad and mad.get("enabled"):
        groups = samples if samples is not None else np.zeros(len(obs), dtype=int).astype(str)
        for column, nmads in dict(mad.get("metrics", {})).items():
            if column not in obs:
                raise InputError(f"filter.mad: obs has no column {column!r}")
            values = obs[column].to_numpy(dtype=np.float64)
            out = np.zeros(len(obs), dtype=bool)
            for g in np.unique(groups):
                sel = groups == g
                out[sel] = _mad_outliers(values[sel], float(nmads))
            report[f"mad_{column}"] = int(out.sum())
            keep &= ~out
    if not keep.any():
        active = {**thresholds, **({"mad": dict(mad)} if mad and mad.get("enabled") else {})}
        raise InputError(f"filter: the thresholds {active} remove all {len(obs)} cells")
    return keep, before_genes, report


def cells_per_gene(x, rows: np.ndarray) -> np.ndarray:
    """Per gene, how many of the rows where ``rows`` is true hold a non-zero value (int64).

    A Dask matrix is read only in the row blocks that hold such rows.
    """
    rows = np.asarray(rows, dtype=bool)
    m = x.shape[1]
    if not rows.any():
        return np.zeros(m, dtype=np.int64)
    if not isinstance(x, da.Array):
        return np.asarray(kernels.col_sums_and_nnz(x[np.flatnonzero(rows)])[m:]).astype(np.int64)
    bounds = np.cumsum((0,) + x.chunks[0])
    holding = [i for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])) if rows[s:e].any()]
    picked = take_rows(x, rows)
    picked = da.concatenate([picked.blocks[i] for i in holding])
    counts = progress.compute(kernels.over_blocks(picked, kernels.col_sums_and_nnz, 2 * m),
                              label="filter: genes in the cells left out")[0]
    return np.asarray(counts[m:]).astype(np.int64)


def filter_cells_genes(adata: ad.AnnData, cell_mask: np.ndarray, gene_mask: np.ndarray) -> ad.AnnData:
    """Lazy subset of a Dask-backed AnnData: nothing of X is computed, and no row moves between blocks.

    Each row block keeps its own surviving rows (``take_rows``), then the kept genes are selected per
    block; obs/var are subset once (no view, no second copy).
    """
    cells = np.asarray(cell_mask, dtype=bool)
    genes = np.asarray(gene_mask, dtype=bool)
    gene_idx = None if genes.all() else np.flatnonzero(genes)

    def matrix(x):
        if isinstance(x, da.Array):
            x = take_rows(x, cells)
            return x if gene_idx is None else take_columns(x, gene_idx)
        x = x[cells]
        return x if gene_idx is None else x[:, gene_idx]

    def rows(v):
        if isinstance(v, pd.DataFrame):
            return v.loc[cells]
        return take_rows(v, cells) if isinstance(v, da.Array) else v[cells]

    return ad.AnnData(
        X=None if adata.X is None else matrix(adata.X),
        obs=adata.obs.loc[cells],
        var=adata.var if gene_idx is None else adata.var.iloc[gene_idx],
        layers={k: matrix(v) for k, v in named_layers(adata).items()},
        obsm={k: rows(v) for k, v in adata.obsm.items()},
        varm={k: (v if gene_idx is None else v[gene_idx]) for k, v in adata.varm.items()},
        uns=dict(adata.uns),
    )
