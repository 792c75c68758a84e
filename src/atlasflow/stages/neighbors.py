"""neighbors stage: kNN graph of the PCA embedding (scanpy.pp.neighbors); needs no Dask cluster.

Reads only ``obsm[use_rep]`` (X_pca by default) of the input store; X and layers are linked into the
output, which gains ``obsp['distances']``, ``obsp['connectivities']`` and ``uns['neighbors']``. With
``--backend gpu`` the search runs on the GPU (:mod:`atlasflow.tl._gpu`), the rest as on the CPU.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from atlasflow.errors import ConfigError
from atlasflow.stages._common import Choice, Number, json_arg, optional_int, optional_positive_int, shape_summary
from atlasflow.store import open_store, write_store
from atlasflow.tl._gpu import knn_engine, resolve_backend
from atlasflow.tl.neighbors import (
    KNN_METHODS, METHODS, METRICS, PYNNDESCENT_MAX_CELLS, choose_knn_method, neighbors,
)

DESCRIPTION = ("kNN graph on obsm['X_pca'] (scanpy.pp.neighbors): obsp['distances'/'connectivities'], "
               "uns['neighbors']; X is linked, not copied.")
NEEDS_CLUSTER = False
log = logging.getLogger(__name__)


#: neighbours per cell, the cell itself included: at least 2
n_neighbors_type = Number(integer=True, ge=2)
#: threads of the search: -1 = all cores (scikit-learn's convention), 0 is none
n_jobs_type = Number(integer=True, ge=-1, ne=0, nullable=True)
metric_type = Choice(METRICS)


def add_arguments(p):
    p.add_argument("--n-neighbors", dest="n_neighbors", type=n_neighbors_type.named("n_neighbors"), default=15,
                   help="neighbours per cell, the cell itself included (as scanpy)")
    p.add_argument("--n-pcs", dest="n_pcs", type=optional_positive_int.named("n_pcs"), default=None,
                   help="use the first n_pcs columns of the embedding; none: all")
    p.add_argument("--use-rep", dest="use_rep", default=None, help="obsm key of the embedding; none: X_pca")
    p.add_argument("--knn-method", dest="knn_method", choices=KNN_METHODS, default="auto",
                   help="exact (brute force), pynndescent or ivf (atlasflow's inverted file, euclidean only); auto: "
                        "exact below 8192 cells (euclidean) and pynndescent above, as scanpy, ivf above "
                        "--pynndescent-max-cells (euclidean); with --backend gpu, auto and exact search exactly on "
                        "the GPU (cuML, else CuPy)")
    p.add_argument("--pynndescent-max-cells", dest="pynndescent_max_cells", default=PYNNDESCENT_MAX_CELLS,
                   type=optional_positive_int.named("pynndescent_max_cells"),
                   help="with --knn-method auto, a euclidean search of more cells than this is atlasflow's inverted "
                        "file (same graph on any thread count, a quarter of pynndescent's memory) instead of "
                        "pynndescent (scanpy's); none: pynndescent at any size")
    p.add_argument("--method", choices=METHODS, default="umap",
                   help="connectivities: UMAP fuzzy simplicial set or Gaussian kernel")
    p.add_argument("--metric", default="euclidean", type=metric_type.named("metric"),
                   help=f"distance metric: {', '.join(METRICS)}")
    p.add_argument("--metric-kwds", dest="metric_kwds", type=json_arg, default={}, help="JSON options of the metric")
    p.add_argument("--random-state", dest="random_state", type=optional_int.named("random_state"), default=0,
                   help="seed of the approximate search")
    p.add_argument("--key-added", dest="key_added", default=None,
                   help="store as uns[KEY], obsp[KEY_distances], obsp[KEY_connectivities]")
    p.add_argument("--n-jobs", dest="n_jobs", type=n_jobs_type.named("n_jobs"), default=1,
                   help="threads of the exact and pynndescent searches; pynndescent's graph depends on it (1: "
                        "reproducible anywhere, as scanpy; more: faster); the ivf search uses all cores (numba's "
                        "threads) and its graph does not depend on them")


def run(args, client) -> dict:
    n_neighbors = n_neighbors_type(args.n_neighbors, "n_neighbors")  # Snakemake params arrive unparsed
    n_pcs = optional_positive_int(args.n_pcs, "n_pcs")
    n_jobs = n_jobs_type(args.n_jobs, "n_jobs")
    metric = metric_type(args.metric, "metric")
    adata = open_store(args.input, chunk_rows=args.chunk_rows)
    metric_kwds = json_arg(args.metric_kwds) or {}
    if not isinstance(metric_kwds, dict):
        raise ConfigError(f"metric_kwds must be a JSON object, not {metric_kwds!r}")
    backend = resolve_backend(getattr(args, "backend", "cpu"))
    gate = optional_positive_int(args.pynndescent_max_cells, "pynndescent_max_cells")
    used = choose_knn_method(adata.n_obs, metric, args.knn_method, backend=backend, metric_kwds=metric_kwds,
                             pynndescent_max_cells=gate)
    t0 = time.time()
    neighbors(
        adata, n_neighbors, n_pcs, use_rep=args.use_rep, knn_method=args.knn_method, method=args.method,
        metric=metric, metric_kwds=metric_kwds, random_state=optional_int(args.random_state, "random_state"),
        key_added=args.key_added, n_jobs=n_jobs, backend=backend, pynndescent_max_cells=gate,
    )
    graph_seconds = time.time() - t0
    key = args.key_added or "neighbors"
    info = adata.uns[key]
    conn = adata.obsp[info["connectivities_key"]]
    from scipy.sparse.csgraph import connected_components

    n_comp = int(connected_components(conn, directed=False)[0])
    log.info("neighbors: %d connected components, %.1f edges per cell", n_comp, conn.nnz / max(adata.n_obs, 1))
    write_store(adata, args.output, chunk_rows=args.chunk_rows,
                provenance={"stage": "neighbors", "params": info["params"], "knn_method": used})
    emb = adata.obsm[args.use_rep or "X_pca"]
    return {
        **shape_summary(adata, adata),
        "knn_method": used,
        **({"knn_engine": knn_engine()} if used == "gpu" else {}),
        "backend": backend,
        "n_neighbors": n_neighbors,
        "n_dims": int(n_pcs if n_pcs is not None else np.shape(emb)[1]),
        "method": args.method,
        "metric": args.metric,
        "connected_components": n_comp,
        "edges_per_cell": round(conn.nnz / max(adata.n_obs, 1), 3),
        "graph_seconds": round(graph_seconds, 3),
    }
