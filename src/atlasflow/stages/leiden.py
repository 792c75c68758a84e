"""leiden stage: Leiden clustering of the neighbourhood graph (scanpy.tl.leiden); needs no Dask cluster.

Reads the graph (obsp/uns) of the input store; X is linked. Adds ``obs[key_added]`` for ``resolution``
and ``obs[key_added + '_r<res>']`` for each of ``resolutions``, with ``uns[<key>]['params']``. With
``--backend gpu``, cuGraph clusters where it is installed (the CPU otherwise; the log says which).
"""

from __future__ import annotations

import argparse
import logging

from atlasflow.stages._common import (Number, json_arg, optional_bool, optional_int, optional_positive_float,
                                      positive_float, shape_summary)
from atlasflow.store import open_store, write_store
from atlasflow.tl._gpu import clustering_engine, resolve_backend
from atlasflow.tl.cluster import LEIDEN_FLAVORS, cluster_sizes, leiden, output_keys, parse_restrict_to

DESCRIPTION = ("Leiden clustering of the neighbors graph (scanpy.tl.leiden): obs['leiden'] (+ one column per "
               "extra resolution); X is linked, not copied.")
NEEDS_CLUSTER = False
log = logging.getLogger(__name__)


def to_floats(values, name: str) -> list[float]:
    """A list of resolutions (> 0) from the CLI list or a Snakemake param (number, list or comma-separated string)."""
    if values is None:
        return []
    if isinstance(values, str):
        values = [v for v in values.replace(",", " ").split() if v]
    elif not isinstance(values, list | tuple):
        values = [values]
    return [positive_float(v, name) for v in values]


def add_cluster_arguments(p, *, algorithm: str, resolution_default):
    """Arguments shared by the leiden and louvain stages (scanpy's names)."""
    resolution = optional_positive_float if resolution_default is None else positive_float
    p.add_argument("--resolution", type=resolution.named("resolution"), default=resolution_default,
                   help=f"resolution of obs['{algorithm}'] (higher: more clusters)")
    p.add_argument("--resolutions", type=positive_float.named("resolutions"), nargs="*", default=[],
                   help=f"more resolutions, one column each: obs['{algorithm}_r<res>']")
    p.add_argument("--random-state", dest="random_state", type=optional_int.named("random_state"),
                   default=0, help="seed")
    p.add_argument("--restrict-to", dest="restrict_to", type=json_arg, default=None,
                   help='JSON ["obs_key", ["category", ...]]: re-cluster only these cells')
    p.add_argument("--key-added", dest="key_added", default=algorithm, help="obs/uns key of the labels")
    p.add_argument("--neighbors-key", dest="neighbors_key", default=None,
                   help="cluster the graph of uns[KEY]; none: uns['neighbors']")
    p.add_argument("--obsp", default=None, help="cluster obsp[OBSP] instead of the neighbors connectivities")
    p.add_argument("--sort-by-size", dest="sort_by_size", action=argparse.BooleanOptionalAction, default=False,
                   help="rename clusters by decreasing size ('0' the largest); default: scanpy's names")


def run_clustering(args, algorithm: str, cluster, **options) -> dict:
    """What the leiden and louvain stages share: cluster the input's graph with ``cluster`` (tl.leiden or
    tl.louvain) and the shared arguments plus ``options``, write the store, summarise the clusters."""
    adata = open_store(args.input, chunk_rows=args.chunk_rows)
    resolutions = to_floats(args.resolutions, "resolutions")
    restrict_to = json_arg(args.restrict_to)
    backend = resolve_backend(getattr(args, "backend", "cpu"))
    cluster(
        adata, optional_positive_float(args.resolution, "resolution"), resolutions=resolutions, restrict_to=restrict_to,
        random_state=optional_int(args.random_state, "random_state"), key_added=args.key_added,
        neighbors_key=args.neighbors_key,
        obsp=args.obsp, backend=backend, sort_by_size=bool(args.sort_by_size), **options,
    )
    keys = output_keys(algorithm, args.key_added, restricted=parse_restrict_to(restrict_to) is not None,
                       resolutions=resolutions)
    write_store(adata, args.output, chunk_rows=args.chunk_rows,
                provenance={"stage": algorithm, "keys": keys, "flavor": options["flavor"]})
    engine, _ = clustering_engine(backend, options["flavor"])
    return {**shape_summary(adata, adata), "flavor": options["flavor"], "backend": backend, "engine": engine,
            **cluster_summary(adata, keys)}


def cluster_summary(adata, keys: list[str]) -> dict:
    """Clusters and sizes per added column, for the stage summary."""
    return {
        "clusters": {k: int(adata.obs[k].cat.categories.size) for k in keys},
        "cluster_sizes": {k: cluster_sizes(adata.obs[k]) for k in keys},
    }


#: Leiden iterations: -1 (any negative) = until stable; 0 would return every cell as its own cluster
n_iterations_type = Number(integer=True, ge=-1, ne=0)


def add_arguments(p):
    add_cluster_arguments(p, algorithm="leiden", resolution_default=1.0)
    p.add_argument("--flavor", choices=LEIDEN_FLAVORS, default="igraph",
                   help="igraph (community_leiden, modularity; scanpy's recommendation) or leidenalg")
    p.add_argument("--n-iterations", dest="n_iterations", type=n_iterations_type.named("n_iterations"), default=2,
                   help="Leiden iterations (-1: until the partition is stable)")
    p.add_argument("--directed", type=optional_bool, default=None,
                   help="treat the graph as directed; none: false for igraph, true for leidenalg, as scanpy")
    p.add_argument("--use-weights", dest="use_weights", action=argparse.BooleanOptionalAction, default=True,
                   help="use the connectivities as edge weights")


def run(args, client) -> dict:
    return run_clustering(
        args, "leiden", leiden, flavor=args.flavor, directed=optional_bool(args.directed),
        use_weights=bool(args.use_weights), n_iterations=n_iterations_type(args.n_iterations, "n_iterations"),
    )
