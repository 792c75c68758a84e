"""leiden stage: Leiden clustering of the neighbourhood graph (scanpy.tl.leiden); needs no Dask cluster.

Reads the graph it clusters (one obsp element) and uns of the input store; X, obsm and the other obsp
elements are linked, not read. Adds ``obs[key_added]`` for ``resolution`` and ``obs[key_added + '_r<res>']``
for each of ``resolutions``, with ``uns[<key>]['params']``. With ``--backend gpu``, cuGraph clusters where it
is installed (the CPU otherwise; the log says which).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping
from pathlib import Path

from atlasflow import ownership
from atlasflow.errors import InputError
from atlasflow.stages._common import (Number, json_arg, load_graph, optional_bool, optional_int,
                                      optional_positive_float, positive_float, shape_summary)
from atlasflow.store import load_element, open_store, temporary_sibling, write_store
from atlasflow.tl._gpu import clustering_engine, resolve_backend
from atlasflow.tl.cluster import (EDGES_ONCE_MIN_CELLS, IGRAPH_EDGES, LEIDEN_FLAVORS, cluster_sizes, leiden,
                                  output_keys, parse_restrict_to)
from atlasflow.tl.metrics import integration_table

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


def run_clustering(args, algorithm: str, cluster, *, before=None, after=None, **options) -> dict:
    """What the leiden and louvain stages share: cluster the input's graph with ``cluster`` (tl.leiden or
    tl.louvain) and the shared arguments plus ``options``, write the store, summarise the clusters.

    ``before(adata)`` checks the input first; ``after(adata, keys)`` returns more summary and a CSV table (or
    None) written beside the store, moved into place once the store is complete."""
    # the embeddings and the other graphs are not read (X_pca and the distances: ~360 MB at 1M cells);
    # the output links them from the input as they are
    adata = open_store(args.input, chunk_rows=args.chunk_rows, skip=("obsm", "obsp"))
    load_graph(adata, args.obsp, args.neighbors_key)
    if before is not None:
        before(adata)
    resolutions = to_floats(args.resolutions, "resolutions")
    restrict_to = json_arg(args.restrict_to)
    backend = resolve_backend(getattr(args, "backend", "cpu"))
    cluster(
        adata, optional_positive_float(args.resolution, "resolution"), resolutions=resolutions, restrict_to=restrict_to,
        random_state=optional_int(args.random_state, "random_state"), key_added=args.key_added,
        neighbors_key=args.neighbors_key,
        obsp=args.obsp, backend=backend, sort_by_size=bool(args.sort_by_size), keep_graph=False, **options,
    )  # keep_graph=False: the graph leaves adata once igraph holds it; the output links it from the input
    keys = output_keys(algorithm, args.key_added, restricted=parse_restrict_to(restrict_to) is not None,
                       resolutions=resolutions)
    extra, table = after(adata, keys) if after is not None else ({}, None)
    tmp = None
    if table is not None:
        tmp = temporary_sibling(Path(args.metrics_csv))
        table.to_csv(tmp, index=False)
    try:
        write_store(adata, args.output, chunk_rows=args.chunk_rows,
                    provenance={"stage": algorithm, "keys": keys,
                                **{k: options[k] for k in ("flavor", "igraph_edges") if k in options}})
        if tmp is not None:
            ownership.replace_file(tmp, Path(args.metrics_csv))
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
    engine, _ = clustering_engine(backend, options["flavor"])
    return {**shape_summary(adata, adata), "flavor": options["flavor"], "backend": backend, "engine": engine,
            **cluster_summary(adata, keys), **extra}


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
    p.add_argument("--igraph-edges", dest="igraph_edges", choices=IGRAPH_EDGES, default="auto",
                   help="flavor igraph: both (scanpy's graph: i-j and j-i of each pair), once (one edge per pair, "
                        "weight 2 w: the same partition on half the edges) or auto (once from "
                        f"{EDGES_ONCE_MIN_CELLS:,} cells)")
    p.add_argument("--batch-key", dest="batch_key", nargs="*", default=["sample"],
                   help="obs column(s) of the batches whose mixing is measured on the graph (median graph iLISI); "
                        "a column missing or with one batch is left out (logged)")
    p.add_argument("--label-key", dest="label_key", default=None,
                   help="obs column of known labels (cell types, lines): median graph cLISI, and ARI/NMI of the "
                        "clusters against them")
    p.add_argument("--metrics-csv", dest="metrics_csv", default=None,
                   help="the integration metrics table (default: beside the output, <output>.metrics.csv)")


def extra_outputs(args) -> list[tuple[str, str, str]]:
    """The integration metrics table (checked by the CLI before any work)."""
    return [("metrics_csv", _metrics_path(args), "file")]


def _metrics_path(args) -> str:
    return args.metrics_csv or str(Path(args.output).with_suffix(".metrics.csv"))


def _batch_keys(args) -> list[str]:
    keys = args.batch_key
    if keys is None:
        return []
    return [keys] if isinstance(keys, str) else [str(k) for k in keys]


def _check_label_key(args):
    def check(adata):
        if args.label_key is not None and args.label_key not in adata.obs:
            raise InputError(f"leiden.label_key: {args.label_key} not in obs (has: {', '.join(map(str, adata.obs))})")
    return check


def _metrics(args):
    def after(adata, keys):
        used = []
        for key in _batch_keys(args):
            if key not in adata.obs:
                log.info("leiden: no obs[%r]: its mixing is not measured", key)
            elif adata.obs[key].nunique() < 2:
                log.info("leiden: obs[%r] holds one batch: its mixing is not measured", key)
            else:
                used.append(key)
        graph = None
        if used or args.label_key is not None:  # the distances are read only for a metric that needs them
            info = adata.uns.get(args.neighbors_key or "neighbors")
            key = info.get("distances_key", "distances") if isinstance(info, Mapping) else "distances"
            graph = load_element(adata, f"obsp/{key}")
        table = integration_table(adata.obs, graph, batch_keys=used, label_key=args.label_key,
                                  cluster_key=keys[0] if args.label_key else None)
        for row in table.itertuples():
            log.info("leiden: %s of %s: %.3f (best %g)", row.metric, row.key, row.value, row.best)
        return {"integration": table.to_dict(orient="records")}, table
    return after


def run(args, client) -> dict:
    args.metrics_csv = _metrics_path(args)
    return run_clustering(
        args, "leiden", leiden, before=_check_label_key(args), after=_metrics(args), flavor=args.flavor,
        directed=optional_bool(args.directed), use_weights=bool(args.use_weights),
        n_iterations=n_iterations_type(args.n_iterations, "n_iterations"),
        igraph_edges=args.igraph_edges,
    )
