"""regress_out stage: remove the linear effect of obs keys from every gene (scanpy.pp.regress_out); dense X out."""

from __future__ import annotations

from atlasflow import pp
from atlasflow.stages._common import shape_summary
from atlasflow.store import open_store, write_store

DESCRIPTION = "Regress out obs keys (numeric, or one categorical) from X; writes dense residuals."


def add_arguments(p):
    p.add_argument("--keys", nargs="+", default=["total_counts", "pct_counts_mt"],
                   help="obs columns to regress out")
    p.add_argument("--layer", default=None, help="regress this layer instead of X")


def run(args, client) -> dict:
    keys = [args.keys] if isinstance(args.keys, str) else list(args.keys)
    adata = open_store(args.input, chunk_rows=args.chunk_rows)
    pp.regress_out(adata, keys, layer=args.layer)
    write_store(adata, args.output, chunk_rows=args.chunk_rows, provenance={"stage": "regress_out", "keys": keys})
    return {**shape_summary(adata, adata), "keys": keys}
