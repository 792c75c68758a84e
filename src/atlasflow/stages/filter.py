"""filter stage: drop cells and genes by QC thresholds (global, per sample, or MAD-based) and write the subset."""

from __future__ import annotations

import logging

import pandas as pd

from atlasflow import pp
from atlasflow.errors import InputError
from atlasflow.stages._common import (Choice, check_order, json_arg, non_negative_int, optional_non_negative_float,
                                      optional_percent, shape_summary, stored_row_nnz)
from atlasflow.store import open_store, require, write_store

DESCRIPTION = "Filter cells (min/max genes and counts, max pct mito) and genes (min cells) of a qc store."
log = logging.getLogger(__name__)


#: The global cell thresholds: argparse type (which also checks a Snakemake param) and help.
THRESHOLDS = {
    "min_genes": (optional_non_negative_float, "keep cells with n_genes_by_counts >= this"),
    "max_genes": (optional_non_negative_float, "keep cells with n_genes_by_counts <= this"),
    "min_counts": (optional_non_negative_float, "keep cells with total_counts >= this"),
    "max_counts": (optional_non_negative_float, "keep cells with total_counts <= this"),
    "max_pct_mt": (optional_percent, "keep cells with pct_counts_mt < this (a percentage, 0 to 100)"),
}

#: Which cells min_cells counts over (argparse type; also checks a Snakemake param).
MIN_CELLS_OVER = Choice(pp.filter.MIN_CELLS_OVER)


def add_arguments(p):
    for key, (kind, text) in THRESHOLDS.items():
        p.add_argument(f"--{key.replace('_', '-')}", dest=key, type=kind.named(key), default=None, help=text)
    p.add_argument("--min-cells", dest="min_cells", type=non_negative_int.named("min_cells"), default=0,
                   help="keep genes detected in >= this many cells (counted over the cells of --min-cells-over)")
    p.add_argument("--min-cells-over", dest="min_cells_over", type=MIN_CELLS_OVER.named("min_cells_over"),
                   default="min_genes", metavar="{" + ",".join(pp.filter.MIN_CELLS_OVER) + "}",
                   help="the cells min_cells counts over: min_genes = those kept by min_genes/min_counts (scanpy's "
                        "tutorial and Seurat: filter_cells, then filter_genes), kept = those kept by every cell "
                        "filter, qc = every cell of the input (default: %(default)s)")
    p.add_argument("--per-sample", dest="per_sample", default=None,
                   help="TSV with a 'sample' column and threshold columns overriding the global ones per sample")
    p.add_argument("--drop-doublets", dest="drop_doublets", action="store_true",
                   help="also drop the cells the scrublet stage called doublets (obs predicted_doublet)")
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
    # checked here too: Snakemake params arrive unparsed
    thresholds = {k: THRESHOLDS[k][0](getattr(args, k), k) for k in pp.filter.CELL_THRESHOLDS}
    min_cells = non_negative_int(args.min_cells, "min_cells")
    min_cells_over = MIN_CELLS_OVER(args.min_cells_over, "min_cells_over")
    check_order(thresholds, "min_genes", "max_genes")
    check_order(thresholds, "min_counts", "max_counts")
    adata = open_store(args.input, chunk_rows=args.chunk_rows)
    require(adata, args.input, "filter",
            obs=sorted({pp.filter.CELL_THRESHOLDS[k][0] for k, v in thresholds.items() if v is not None}),
            var=["n_cells_by_counts"] if min_cells else [])
    cells, genes, report = pp.qc_filter_masks(
        adata, thresholds=thresholds, min_cells=min_cells, min_cells_over=min_cells_over,
        per_sample=_per_sample_table(args.per_sample), mad=args.mad, drop_doublets=bool(args.drop_doublets),
    )
    for rule, n in report.items():
        log.info("filter: %s removes %d %s", rule, n, "genes" if rule == "min_cells" else "cells")
    out = pp.filter_cells_genes(adata, cells, genes)
    shapes = shape_summary(adata, out)
    del adata  # the unfiltered obs (~200 MiB at 1M cells) is not needed while writing
    row_nnz = stored_row_nnz(args.input)[cells] if genes.all() else None
    write_store(out, args.output, chunk_rows=args.chunk_rows, row_nnz={"X": row_nnz}, provenance={"stage": "filter"})
    return {**shapes, "removed_by": report, "min_cells_over": min_cells_over,
            "thresholds": {k: v for k, v in thresholds.items() if v is not None}}
