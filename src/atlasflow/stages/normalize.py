"""normalize stage: scale every cell to the same total count (scanpy.pp.normalize_total)."""

from __future__ import annotations

from atlasflow import pp
from atlasflow.stages._common import (excluded_genes, fraction, optional_positive_float, shape_summary,
                                      stored_row_nnz)
from atlasflow.store import open_store, write_store

DESCRIPTION = "Normalize each cell to target_sum total counts (default: median of the totals)."


def add_arguments(p):
    p.add_argument("--target-sum", dest="target_sum", type=optional_positive_float.named("target_sum"), default=None,
                   help="total counts per cell after normalization, > 0 (none: median of the totals)")
    p.add_argument("--exclude-highly-expressed", dest="exclude_highly_expressed", action="store_true",
                   help="leave genes with > max_fraction of a cell's counts out of the totals")
    p.add_argument("--max-fraction", dest="max_fraction", type=fraction.named("max_fraction"), default=0.05,
                   help="fraction of a cell's counts that makes a gene highly expressed")
    p.add_argument("--exclude-var", dest="exclude_var", nargs="*", default=["ercc"],
                   help="boolean var columns (from qc) whose genes are left out of the totals; absent ones are "
                        "skipped (default: ercc, the spike-ins)")


def run(args, client) -> dict:
    target_sum = optional_positive_float(args.target_sum, "target_sum")  # Snakemake params arrive unparsed
    max_fraction = fraction(args.max_fraction, "max_fraction")
    adata = open_store(args.input, chunk_rows=args.chunk_rows)
    excluded = excluded_genes(adata.var, args.exclude_var, "normalize: left out of the cell totals")
    result = pp.normalize_total(adata, target_sum=target_sum, inplace=False, exclude_genes=excluded,
                                exclude_highly_expressed=args.exclude_highly_expressed, max_fraction=max_fraction)
    adata.X = result["X"]
    # normalization keeps every stored entry, so the row structure of the input is the output's
    write_store(adata, args.output, chunk_rows=args.chunk_rows, row_nnz={"X": stored_row_nnz(args.input)},
                provenance={"stage": "normalize"})
    return {**shape_summary(adata, adata), "target_sum": result["target_sum"],
            "genes_excluded_from_totals": int(excluded.sum())}

