"""subset stage: keep the highly variable genes (or another boolean var column); X is rewritten block-wise."""

from __future__ import annotations

import numpy as np

from atlasflow.errors import InputError
from atlasflow.pp._utils import take_columns
from atlasflow.stages._common import shape_summary
from atlasflow.store import open_store, write_store
from atlasflow.compat import named_layers

DESCRIPTION = "Keep only the genes flagged in a boolean var column (default: highly_variable)."


def add_arguments(p):
    p.add_argument("--mask-var", dest="mask_var", default="highly_variable",
                   help="boolean var column marking the genes to keep")


def subset_var(adata, mask):
    """A lazy AnnData with only the masked genes: X/layers become per-block column selections."""
    import anndata as ad

    idx = np.flatnonzero(mask)
    return ad.AnnData(
        X=None if adata.X is None else take_columns(adata.X, idx), obs=adata.obs, var=adata.var.iloc[idx].copy(),
        layers={k: take_columns(v, idx) for k, v in named_layers(adata).items()}, obsm=dict(adata.obsm),
        varm={k: np.asarray(v)[idx] for k, v in adata.varm.items()}, obsp=dict(adata.obsp), uns=dict(adata.uns),
    )


def run(args, client) -> dict:
    adata = open_store(args.input, chunk_rows=args.chunk_rows)
    if args.mask_var not in adata.var:
        raise InputError(f"subset: mask_var={args.mask_var!r} is not a column of var; run the hvg stage first")
    mask = adata.var[args.mask_var].to_numpy()
    if mask.dtype != bool:
        raise InputError(f"subset: var[{args.mask_var!r}] is not boolean ({mask.dtype})")
    if not mask.any():
        raise InputError(f"subset: var[{args.mask_var!r}] selects no gene")
    out = subset_var(adata, mask)
    write_store(out, args.output, chunk_rows=args.chunk_rows, provenance={"stage": "subset", "mask_var": args.mask_var})
    return shape_summary(adata, out)
