"""pca stage: principal components from the Gram matrix (scanpy.pp.pca, covariance_eigh); X is linked."""

from __future__ import annotations

import argparse

from atlasflow import pp
from atlasflow.pp._pca import _EMPTY, MAX_GRAM_MIB
from atlasflow.stages._common import shape_summary
from atlasflow.store import open_store, write_store

DESCRIPTION = "PCA of X (highly variable genes by default): obsm['X_pca'], varm['PCs'], uns['pca']."


def optional_int(text):
    """argparse type: an int, or none/null for 'not set'."""
    if text is None or (isinstance(text, str) and text.lower() in ("none", "null", "")):
        return None
    return int(text)


def add_arguments(p):
    p.add_argument("--n-comps", dest="n_comps", type=optional_int, default=None,
                   help="number of components (none: 50, or one less than the smaller dimension)")
    p.add_argument("--zero-center", dest="zero_center", action=argparse.BooleanOptionalAction, default=True,
                   help="PCA of centred data (without: truncated SVD)")
    p.add_argument("--mask-var", dest="mask_var", default="auto",
                   help="boolean var column of the genes to use (auto: highly_variable when present; none: all)")
    p.add_argument("--key-added", dest="key_added", default=None,
                   help="store under this key instead of X_pca/PCs/pca")
    p.add_argument("--dtype", default="float32", help="dtype of obsm['X_pca']")
    p.add_argument("--max-gram-mib", dest="max_gram_mib", type=float, default=MAX_GRAM_MIB,
                   help="refuse gene counts whose float64 Gram matrix exceeds this many MiB")
    p.add_argument("--layer", default=None, help="use this layer instead of X")


def run(args, client) -> dict:
    adata = open_store(args.input, chunk_rows=args.chunk_rows)
    mask = {"auto": _EMPTY, "none": None, None: None}.get(args.mask_var, args.mask_var)
    pp.pca(adata, args.n_comps, zero_center=args.zero_center, mask_var=mask, key_added=args.key_added,
           dtype=args.dtype, max_gram_mib=args.max_gram_mib, layer=args.layer)
    write_store(adata, args.output, chunk_rows=args.chunk_rows, provenance={"stage": "pca"})
    info = adata.uns[args.key_added or "pca"]
    return {**shape_summary(adata, adata), "n_comps": int(len(info["variance"])),
            "variance_ratio": [round(float(v), 6) for v in info["variance_ratio"]]}
