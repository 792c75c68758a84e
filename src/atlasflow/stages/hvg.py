"""hvg stage: annotate highly variable genes (scanpy.pp.highly_variable_genes); X is linked, var gains columns."""

from __future__ import annotations

import anndata as ad
import numpy as np
import pandas as pd

from atlasflow import pp
from atlasflow.pp.hvg import COUNT_FLAVORS
from atlasflow.stages._common import (Number, check_order, excluded_genes, optional_positive_int, positive_float,
                                      positive_int, shape_summary)
from atlasflow.store import open_store, write_store

DESCRIPTION = ("Select highly variable genes (flavors seurat, cell_ranger, seurat_v3, seurat_v3_paper, "
               "poisson_gene_selection); count-based flavors read --counts.")


#: a finite float; the upper dispersion cut-off may also be inf (or none: infinity)
cutoff, max_disp_type = Number(), Number(nullable=True, allow_inf=True)


def add_arguments(p):
    p.add_argument("--counts", default=None,
                   help="raw-count store with the same cells and genes (e.g. the filter stage's), for seurat_v3, "
                        "seurat_v3_paper and poisson_gene_selection")
    p.add_argument("--flavor", default="seurat", help="seurat | cell_ranger | seurat_v3 | seurat_v3_paper | "
                                                      "poisson_gene_selection")
    p.add_argument("--n-top-genes", dest="n_top_genes", type=optional_positive_int.named("n_top_genes"),
                   default=None,
                   help="number of genes to select (none: use the mean/dispersion cut-offs; seurat_v3: 2000)")
    p.add_argument("--min-mean", dest="min_mean", type=cutoff.named("min_mean"), default=0.0125,
                   help="lower mean cut-off (<= max_mean)")
    p.add_argument("--max-mean", dest="max_mean", type=cutoff.named("max_mean"), default=3.0, help="upper mean cut-off")
    p.add_argument("--min-disp", dest="min_disp", type=cutoff.named("min_disp"), default=0.5,
                   help="lower normalised dispersion cut-off (<= max_disp)")
    p.add_argument("--max-disp", dest="max_disp", type=max_disp_type.named("max_disp"), default=None,
                   help="upper normalised dispersion cut-off (none: infinity)")
    p.add_argument("--span", type=positive_float.named("span"), default=0.3, help="loess span of seurat_v3")
    p.add_argument("--n-bins", dest="n_bins", type=positive_int.named("n_bins"), default=20,
                   help="mean-expression bins (seurat)")
    p.add_argument("--batch-key", dest="batch_key", default=None, help="obs column: select per batch and merge")
    p.add_argument("--layer", default=None, help="use this layer instead of X")
    p.add_argument("--exclude-var", dest="exclude_var", nargs="*", default=["ercc"],
                   help="boolean var columns (from qc) whose genes are never selected: HVGs are chosen among the "
                        "other genes, as scanpy on that subset; absent columns are skipped (default: ercc)")
    p.add_argument("--no-check-values", dest="check_values", action="store_false",
                   help="do not refuse non-count data for the count-based flavors")


def run(args, client) -> dict:
    check_order(vars(args), "min_mean", "max_mean")  # before reading anything: a pair no gene can pass
    check_order(vars(args), "min_disp", "max_disp")
    adata = open_store(args.input, chunk_rows=args.chunk_rows)
    counts = None
    if args.counts and args.flavor in COUNT_FLAVORS:
        counts = open_store(args.counts, chunk_rows=args.chunk_rows)
    excluded = excluded_genes(adata.var, args.exclude_var, "hvg: never selected, left out of the selection")
    target, target_counts = adata, counts
    if excluded.any():
        target = _genes(adata, ~excluded, args.layer)
        target_counts = None if counts is None else _genes(counts, ~excluded, None)
    pp.highly_variable_genes(
        target, flavor=args.flavor, n_top_genes=args.n_top_genes, min_mean=args.min_mean, max_mean=args.max_mean,
        min_disp=args.min_disp, max_disp=float("inf") if args.max_disp is None else args.max_disp,
        span=args.span, n_bins=args.n_bins, batch_key=args.batch_key, layer=args.layer,
        check_values=args.check_values, counts=target_counts,
    )
    if target is not adata:
        _annotate_back(adata, target, ~excluded)
    write_store(adata, args.output, chunk_rows=args.chunk_rows, provenance={"stage": "hvg", "flavor": args.flavor})
    return {**shape_summary(adata, adata), "flavor": args.flavor,
            "n_highly_variable": int(adata.var["highly_variable"].sum())}


def _genes(adata: ad.AnnData, keep: np.ndarray, layer: str | None) -> ad.AnnData:
    """The cells of ``adata`` on the kept genes only (X, or ``layer``, column-subset lazily)."""
    idx = np.flatnonzero(keep)
    layers = {layer: adata.layers[layer][:, idx]} if layer else {}
    return ad.AnnData(X=adata.X[:, idx], obs=adata.obs, var=adata.var.iloc[idx].copy(), layers=layers,
                      uns=dict(adata.uns))


def _annotate_back(adata: ad.AnnData, target: ad.AnnData, keep: np.ndarray) -> None:
    """The selection's var columns on every gene: excluded genes are not highly variable, their statistics NaN."""
    kept, types = np.flatnonzero(keep), pd.api.types
    for col in target.var.columns.difference(adata.var.columns, sort=False):
        values = target.var[col]
        # not highly variable, in no batch's selection (bool, int); statistics NaN (float, and anything else)
        fill = False if types.is_bool_dtype(values.dtype) else 0 if types.is_integer_dtype(values.dtype) else None
        full = pd.Series(values.to_numpy(), index=kept).reindex(range(len(keep)), fill_value=fill)
        adata.var[col] = full.to_numpy()
    adata.uns.update({k: v for k, v in target.uns.items() if k not in adata.uns})

