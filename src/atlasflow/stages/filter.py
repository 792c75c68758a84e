"""filter stage: drop cells and genes by QC thresholds (global, per sample, or MAD-based) and write the subset."""

from __future__ import annotations

import logging

import pandas as pd

from atlasflow import pp
from atlasflow.errors import InputError
from atlasflow.stages._common import json_arg, optional_float, shape_summary, stored_row_nnz
from atlasflow.store import open_store, require, write_store

DESCRIPTION = "Filter cells (min/max genes and counts, max pct mito) and genes (min cells) of a qc store."
log = logging.getLogger(__name__)


def add_arguments(p):
    p.add_argument("--min-genes", dest="min_genes", type=optional_float, default=None, help="keep cells with n_genes_by_counts >= this")
    p.add_argument("--max-genes", dest="max_genes", type=optional_float, default=None, help="keep cells with n_genes_by_counts <= this")
    p.add_argument("--min-counts", dest="min_counts", type=optional_float, default=None, help="keep cells with total_counts >= this")
    p.add_argument("--max-counts", dest="max_counts", type=optional_float, default=None, help="keep cells with total_counts <= this")
    p.add_argument("--max-pct-mt", dest="max_pct_mt", type=optional_float, default=None, help="keep cells with pct_counts_mt < this")
    p.add_argument("--min-cells", dest="min_cells", type=int, default=0, help="keep genes detected in >= this many cells")
    p.add_argument("--per-sample", dest="per_sample", default=None,
                   help="TSV with a 'sample' column and threshold columns overriding the global ones per sample")
    p.add_argument("--mad", type=json_arg, default=None,
                   help='JSON {"enabled": true, "metrics": {"log1p_total_counts": 5, ...}}: drop MAD outliers')


def _per_sample_table(path) -> pd.DataFrame | None:
    if not path:
        return None
    table = pd.read_csv(path, sep="\t", dtype={"sample": str})
    if "sample" not in table:
        raise InputError(f"{path}: the sample sheet has no 'sample' column")
    cols = [c for c in table.columns if c in pp.filter.CELL_THRESHOLDS]
    return table.set_index("sample")[cols] if cols else None


def run(args, client) -> dict:
    adata = open_store(args.input, chunk_rows=args.chunk_rows)
    thresholds = {k: getattr(args, k) for k in pp.filter.CELL_THRESHOLDS}
    require(adata, args.input, "filter",
            obs=sorted({pp.filter.CELL_THRESHOLDS[k][0] for k, v in thresholds.items() if v is not None}),
            var=["n_cells_by_counts"] if args.min_cells else [])
    cells, genes, report = pp.qc_filter_masks(
        adata.obs, adata.var, thresholds=thresholds, min_cells=args.min_cells,
        per_sample=_per_sample_table(args.per_sample), mad=args.mad,
    )
    for rule, n in report.items():
        log.info("filter: %s removes %d %s", rule, n, "genes" if rule == "min_cells" else "cells")
    out = pp.filter_cells_genes(adata, cells, genes)
    shapes = shape_summary(adata, out)
    del adata  # the unfiltered obs (~200 MiB at 1M cells) is not needed while writing
    row_nnz = stored_row_nnz(args.input)[cells] if genes.all() else None
    write_store(out, args.output, chunk_rows=args.chunk_rows, row_nnz={"X": row_nnz}, provenance={"stage": "filter"})
    return {**shapes, "removed_by": report,
            "thresholds": {k: v for k, v in thresholds.items() if v is not None}}
