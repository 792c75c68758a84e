"""final stage: one AnnData store with everything a user opens (see atlasflow.final); nothing is copied.

X (log1p store) and layer ``counts`` (filter store's X) are hard-linked; obs/var/obsm/obsp/varm/uns come
from the hvg, embedding (e.g. umap), clusters (leiden) and markers (rank_genes_groups) stores. Optionally also an .h5ad
export, written block by block, skipped with a log line when larger than ``--h5ad-max-gb``.
"""

from __future__ import annotations

import logging
import os

from atlasflow import final
from atlasflow.stages._common import optional_float
from atlasflow.store import write_store
from atlasflow.compat import named_layers

DESCRIPTION = "Final AnnData store: log-normalised X + counts layer (linked), all obs/var, embeddings, graph, markers."
NEEDS_CLUSTER = False
log = logging.getLogger(__name__)


def extra_outputs(args) -> list[tuple[str, str, str]]:
    """The h5ad export, when asked for (checked by the CLI before any work)."""
    return [("h5ad", args.h5ad, "file")] if args.h5ad else []


def add_arguments(p):
    p.add_argument("--counts", default=None, help="store whose X becomes layer counts (the filter store)")
    p.add_argument("--hvg-store", dest="hvg_store", default=None, help="store whose var is used (the hvg store)")
    p.add_argument("--embedding-store", dest="embedding_store", default=None,
                   help="store with obsm, obsp, uns, varm (e.g. the umap store)")
    p.add_argument("--clusters-store", dest="clusters_store", default=None,
                   help="store whose obs columns (cluster labels) and uns entries are added (e.g. the leiden store)")
    p.add_argument("--markers-store", dest="markers_store", default=None,
                   help="store with uns rank_genes_groups (the rank_genes_groups store)")
    p.add_argument("--h5ad", default=None, help="also export to this .h5ad file (none: no export)")
    p.add_argument("--h5ad-max-gb", dest="h5ad_max_gb", type=optional_float, default=2.0,
                   help="skip the export (logged) when its estimated size exceeds this many GB; none: no limit")


def run(args, client) -> dict:
    paths = {k: (os.path.abspath(v) if v else None)
             for k, v in (("hvg", args.hvg_store), ("embedding", args.embedding_store),
                          ("clusters", args.clusters_store), ("markers", args.markers_store))}
    adata = final.assemble(args.input, counts=args.counts, chunk_rows=args.chunk_rows, **paths)
    write_store(adata, args.output, chunk_rows=args.chunk_rows, provenance={"stage": "final"})
    summary = {
        "cells_out": int(adata.n_obs), "genes_out": int(adata.n_vars),
        "obs": list(map(str, adata.obs.columns)), "layers": list(named_layers(adata)),
        "obsm": list(adata.obsm), "obsp": list(adata.obsp), "varm": list(adata.varm),
        "uns": sorted(map(str, adata.uns)), "h5ad": None,
    }
    if args.h5ad:
        size = final.estimate_h5ad_bytes(adata, args.output)
        summary["h5ad_estimated_bytes"] = size
        if args.h5ad_max_gb is not None and size > args.h5ad_max_gb * 1e9:
            reason = (f"h5ad export skipped: about {size / 1e9:.1f} GB > h5ad_max_gb = {args.h5ad_max_gb:g} "
                      "(an .h5ad is read whole into memory by most tools; use the Zarr store)")
            log.warning("final: %s", reason)
            summary["h5ad_skipped"] = reason
        else:
            final.write_h5ad(adata, args.h5ad)
            summary["h5ad"] = str(args.h5ad)
            log.info("final: wrote %s", args.h5ad)
    return summary
