"""umap stage: UMAP layout of the neighbourhood graph (scanpy.tl.umap); needs no Dask cluster.

Reads the graph (its obsp connectivities and uns) and the embedding it was built on from the input store;
X and the other obsp elements are linked, not read. Adds ``obsm['X_umap']`` and ``uns['umap']['params']``.
With ``--backend gpu``, cuML lays it out where it is installed (umap-learn on the CPU otherwise; the log
says which).
"""

from __future__ import annotations

import argparse
import logging

import numpy as np

from atlasflow.stages._common import (load_graph, non_negative_float, non_negative_int, optional_int,
                                      optional_positive_float, optional_positive_int, positive_float, positive_int,
                                      shape_summary)
from atlasflow.store import open_store, write_store
from atlasflow.tl._gpu import resolve_backend, umap_engine
from atlasflow.tl.umap import umap

DESCRIPTION = "UMAP of the neighbors graph (scanpy.tl.umap): obsm['X_umap'], uns['umap']; X is linked, not copied."
NEEDS_CLUSTER = False
log = logging.getLogger(__name__)


def add_arguments(p):
    p.add_argument("--min-dist", dest="min_dist", type=non_negative_float.named("min_dist"),
                   default=0.5, help="minimum distance of embedded points")
    p.add_argument("--spread", type=positive_float.named("spread"), default=1.0, help="scale of the embedded points")
    p.add_argument("--n-components", dest="n_components", type=positive_int.named("n_components"),
                   default=2, help="dimensions of the layout")
    p.add_argument("--maxiter", type=optional_positive_int.named("maxiter"), default=None,
                   help="epochs; none: 500 up to 10,000 cells, 200 above")
    p.add_argument("--alpha", type=positive_float.named("alpha"), default=1.0, help="initial learning rate")
    p.add_argument("--gamma", type=non_negative_float.named("gamma"), default=1.0, help="weight of negative samples")
    p.add_argument("--negative-sample-rate", dest="negative_sample_rate", default=5,
                   type=non_negative_int.named("negative_sample_rate"), help="negative samples per positive edge")
    p.add_argument("--init-pos", dest="init_pos", default="spectral", help="spectral (scanpy's), random or an obsm key")
    p.add_argument("--exact-spectral-max-cells", dest="exact_spectral_max_cells", default=300_000,
                   type=optional_positive_int.named("exact_spectral_max_cells"),
                   help="spectral start by umap-learn's ARPACK (scanpy's layout; 7.5 GiB at 1M cells) up to this "
                        "many cells, by LOBPCG above (none: ARPACK always)")
    p.add_argument("--exact-epochs-max-cells", dest="exact_epochs_max_cells", default=300_000,
                   type=optional_positive_int.named("exact_epochs_max_cells"),
                   help="epochs by umap-learn (scanpy's layout; single-threaded) up to this many cells, by "
                        "atlasflow's deterministic parallel kernel above (none: umap-learn always)")
    p.add_argument("--random-state", dest="random_state", type=optional_int.named("random_state"),
                   default=0, help="seed")
    p.add_argument("--a", type=optional_positive_float.named("a"),
                   default=None, help="curve parameter a; none: fitted to min_dist/spread")
    p.add_argument("--b", type=optional_positive_float.named("b"),
                   default=None, help="curve parameter b; none: fitted to min_dist/spread")
    p.add_argument("--key-added", dest="key_added", default=None, help="store as obsm[KEY] and uns[KEY]")
    p.add_argument("--neighbors-key", dest="neighbors_key", default="neighbors", help="graph of uns[KEY]")
    p.add_argument("--parallel", action=argparse.BooleanOptionalAction, default=False,
                   help="numba-parallel optimisation: faster, not reproducible")


def run(args, client) -> dict:
    # the kNN distances and any other obsp graph are not read (~170 MB at 1M cells); the output links them
    adata = open_store(args.input, chunk_rows=args.chunk_rows, skip=("obsp",))
    load_graph(adata, None, args.neighbors_key)
    backend = resolve_backend(getattr(args, "backend", "cpu"))
    umap(
        adata, min_dist=non_negative_float(args.min_dist, "min_dist"), spread=positive_float(args.spread, "spread"),
        n_components=positive_int(args.n_components, "n_components"),
        maxiter=optional_positive_int(args.maxiter, "maxiter"),
        alpha=positive_float(args.alpha, "alpha"), gamma=non_negative_float(args.gamma, "gamma"),
        negative_sample_rate=non_negative_int(args.negative_sample_rate, "negative_sample_rate"),
        init_pos=args.init_pos, random_state=optional_int(args.random_state, "random_state"),
        a=optional_positive_float(args.a, "a"), b=optional_positive_float(args.b, "b"),
        key_added=args.key_added, neighbors_key=args.neighbors_key, parallel=bool(args.parallel),
        exact_spectral_max_cells=optional_positive_int(args.exact_spectral_max_cells, "exact_spectral_max_cells"),
        exact_epochs_max_cells=optional_positive_int(args.exact_epochs_max_cells, "exact_epochs_max_cells"),
        backend=backend,
    )
    key_obsm, key_uns = ("X_umap", "umap") if args.key_added is None else (args.key_added, args.key_added)
    write_store(adata, args.output, chunk_rows=args.chunk_rows, provenance={"stage": "umap"})
    emb = np.asarray(adata.obsm[key_obsm])
    params = adata.uns[key_uns]["params"]
    engine = umap_engine(backend, 1 if args.maxiter is None else optional_int(args.maxiter))
    gate = optional_positive_int(args.exact_spectral_max_cells, "exact_spectral_max_cells")
    start = args.init_pos
    if start == "spectral" and engine != "cuML":
        start = "spectral (LOBPCG)" if gate is not None and adata.n_obs > gate else "spectral (ARPACK, scanpy's)"
    epochs_gate = optional_positive_int(args.exact_epochs_max_cells, "exact_epochs_max_cells")
    epochs = "umap-learn (scanpy's)"
    if engine != "cuML" and epochs_gate is not None and adata.n_obs > epochs_gate:
        epochs = "atlasflow (deterministic, parallel)"
    return {
        **shape_summary(adata, adata),
        "backend": backend,
        "engine": engine,
        "start": start,
        "epochs": epochs,
        "a": float(params["a"]), "b": float(params["b"]),
        "extent": [[float(v) for v in emb.min(axis=0)], [float(v) for v in emb.max(axis=0)]],
    }
