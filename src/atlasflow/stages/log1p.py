"""log1p stage: X <- log(1 + X) (scanpy.pp.log1p), elementwise on the stored values."""

from __future__ import annotations

from atlasflow import pp
from atlasflow.stages._common import log_base, shape_summary, stored_row_nnz
from atlasflow.store import open_store, write_store

DESCRIPTION = "Log-transform a normalized store: X = log1p(X) (natural log unless --base)."


def add_arguments(p):
    p.add_argument("--base", type=log_base.named("base"),
                   default=None, help="logarithm base, > 0 and not 1 (none: natural log)")


def run(args, client) -> dict:
    base = log_base(args.base, "base")  # Snakemake params arrive unparsed
    adata = open_store(args.input, chunk_rows=args.chunk_rows)
    pp.log1p(adata, base=base)
    write_store(adata, args.output, chunk_rows=args.chunk_rows, row_nnz={"X": stored_row_nnz(args.input)},
                provenance={"stage": "log1p"})
    return shape_summary(adata, adata)
