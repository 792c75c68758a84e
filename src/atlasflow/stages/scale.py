"""scale stage: genes to zero mean and unit variance, clipped at max_value (scanpy.pp.scale); dense X out."""

from __future__ import annotations

import argparse

from atlasflow import pp
from atlasflow.stages._common import optional_positive_float, shape_summary, stored_row_nnz
from atlasflow.backend import is_sparse_meta
from atlasflow.store import open_store, write_store

DESCRIPTION = "Scale each gene to unit variance (and zero mean), clipping at max_value; var gains mean and std."


def add_arguments(p):
    p.add_argument("--zero-center", dest="zero_center", action=argparse.BooleanOptionalAction, default=True,
                   help="subtract the gene means (dense output); without it sparse data stays sparse")
    p.add_argument("--max-value", dest="max_value", type=optional_positive_float.named("max_value"), default=None,
                   help="clip scaled values at this magnitude, > 0 (none: no clipping)")
    p.add_argument("--mask-obs", dest="mask_obs", default=None,
                   help="boolean obs column: derive and apply the scaling on these cells only")
    p.add_argument("--layer", default=None, help="scale this layer instead of X")


def run(args, client) -> dict:
    adata = open_store(args.input, chunk_rows=args.chunk_rows)
    x_in = adata.X if args.layer is None else adata.layers[args.layer]
    keeps_structure = (not args.zero_center) and is_sparse_meta(x_in) if x_in is not None else False
    pp.scale(adata, zero_center=args.zero_center, max_value=args.max_value, mask_obs=args.mask_obs, layer=args.layer)
    key = "X" if args.layer is None else f"layers/{args.layer}"
    row_nnz = {key: stored_row_nnz(args.input, key)} if keeps_structure else None
    write_store(adata, args.output, chunk_rows=args.chunk_rows, row_nnz=row_nnz,
                provenance={"stage": "scale", "zero_center": args.zero_center, "max_value": args.max_value,
                            "mask_obs": args.mask_obs, "layer": args.layer})
    return {**shape_summary(adata, adata), "zero_center": args.zero_center, "max_value": args.max_value}
