"""pca stage: principal components from the Gram matrix (scanpy.pp.pca, covariance_eigh); X is linked.

When the scale stage's input (``--unscaled``) is sparse, PCA reads it and scales on the fly instead of reading
the dense scaled X: the same values, far fewer bytes and multiplications.
"""

from __future__ import annotations

import argparse
import logging

import numpy as np

from atlasflow import pp
from atlasflow.pp._pca import MASK_DEFAULT, MAX_GRAM_MIB, ScaledFrom
from atlasflow.stages._common import optional_positive_int, positive_float, shape_summary
from atlasflow.backend import is_sparse_meta
from atlasflow.store import open_matrix, open_store, provenance, write_store

log = logging.getLogger(__name__)

DESCRIPTION = "PCA of X (highly variable genes by default): obsm['X_pca'], varm['PCs'], uns['pca']."


def add_arguments(p):
    p.add_argument("--n-comps", dest="n_comps", type=optional_positive_int.named("n_comps"), default=None,
                   help="number of components (none: 50, or one less than the smaller dimension)")
    p.add_argument("--zero-center", dest="zero_center", action=argparse.BooleanOptionalAction, default=True,
                   help="PCA of centred data (without: truncated SVD)")
    p.add_argument("--mask-var", dest="mask_var", default="auto",
                   help="boolean var column of the genes to use (auto: highly_variable when present; none: all)")
    p.add_argument("--key-added", dest="key_added", default=None,
                   help="store under this key instead of X_pca/PCs/pca")
    p.add_argument("--dtype", default="float32", help="dtype of obsm['X_pca']")
    p.add_argument("--max-gram-mib", dest="max_gram_mib", type=positive_float.named("max_gram_mib"),
                   default=MAX_GRAM_MIB, help="refuse gene counts whose float64 Gram matrix exceeds this many MiB")
    p.add_argument("--layer", default=None, help="use this layer instead of X")
    p.add_argument("--unscaled", default=None,
                   help="the store the scale stage read; when its X is sparse PCA computes from it, scaling on "
                        "the fly with the scale stage's var mean/std and max_value (none: read the dense X)")


def run(args, client) -> dict:
    adata = open_store(args.input, chunk_rows=args.chunk_rows, obs_columns=False)  # pca never reads obs
    mask = {"auto": MASK_DEFAULT, "none": None, None: None}.get(args.mask_var, args.mask_var)
    scaled_from = None if args.layer else scaled_source(adata, args.input, args.unscaled, args.chunk_rows)
    pp.pca(adata, args.n_comps, zero_center=args.zero_center, mask_var=mask, key_added=args.key_added,
           dtype=args.dtype, max_gram_mib=args.max_gram_mib, layer=args.layer, scaled_from=scaled_from)
    write_store(adata, args.output, chunk_rows=args.chunk_rows, provenance={"stage": "pca"})
    info = adata.uns[args.key_added or "pca"]
    return {**shape_summary(adata, adata), "n_comps": int(len(info["variance"])),
            "variance_ratio": [round(float(v), 6) for v in info["variance_ratio"]]}


def scaled_source(adata, scaled: str, unscaled: str | None, chunk_rows: int) -> ScaledFrom | None:
    """The sparse matrix the scale stage turned into ``adata.X``, with its scaling; None (logged why) if unusable."""
    if not unscaled or str(unscaled).lower() == "none":
        return None
    prov = provenance(scaled)
    why = None
    if prov.get("stage") != "scale" or "layer" not in prov:
        why = f"{scaled} has no scale-stage provenance"
    elif prov["layer"] is not None or prov.get("mask_obs") is not None:
        why = "the scale stage used a layer or mask_obs"
    elif not {"mean", "std"} <= set(adata.var.columns):
        why = "var lacks the scale stage's mean and std"
    else:
        source, obs_names, var_names = open_matrix(unscaled, chunk_rows=chunk_rows)
        if not is_sparse_meta(source):
            why = f"X of {unscaled} is not sparse"
        elif (source.shape != adata.shape or not var_names.equals(adata.var_names)
              or not obs_names.equals(adata.obs_names)):
            why = f"{unscaled} does not have the cells and genes of {scaled}"
    if why:
        log.info("pca: reading the dense scaled X (%s)", why)
        return None
    return ScaledFrom(source=source, mean=adata.var["mean"].to_numpy(np.float64),
                      std=adata.var["std"].to_numpy(np.float64), zero_center=bool(prov["zero_center"]),
                      max_value=prov["max_value"], dtype=np.dtype(adata.X.dtype))
