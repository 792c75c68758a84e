"""louvain stage: Louvain clustering of the neighbourhood graph (scanpy.tl.louvain); needs no Dask cluster.

Reads the graph (obsp/uns) of the input store; X is linked. Adds ``obs[key_added]`` (and one column per
extra resolution) with ``uns[<key>]['params']``. Flavor 'igraph' (default) needs only igraph; 'vtraag'
needs the optional louvain package.
"""

from __future__ import annotations

import argparse
import logging

from atlasflow.stages._common import json_arg, shape_summary
from atlasflow.stages.leiden import add_cluster_arguments, cluster_summary, to_floats
from atlasflow.stages.neighbors import optional_int
from atlasflow.store import open_store, write_store
from atlasflow.tl.cluster import LOUVAIN_FLAVORS, louvain, output_keys, parse_restrict_to

DESCRIPTION = ("Louvain clustering of the neighbors graph (scanpy.tl.louvain): obs['louvain'] (+ one column per "
               "extra resolution); X is linked, not copied.")
NEEDS_CLUSTER = False
log = logging.getLogger(__name__)


def add_arguments(p):
    add_cluster_arguments(p, algorithm="louvain", resolution_default=None)
    p.add_argument("--flavor", choices=LOUVAIN_FLAVORS, default="igraph",
                   help="igraph (community_multilevel) or vtraag (the louvain package, if installed)")
    p.add_argument("--directed", action=argparse.BooleanOptionalAction, default=True,
                   help="directed graph (vtraag only; igraph always clusters the undirected graph)")
    p.add_argument("--use-weights", dest="use_weights", action=argparse.BooleanOptionalAction, default=False,
                   help="use the connectivities as edge weights (scanpy's default: no)")


def run(args, client) -> dict:
    adata = open_store(args.input, chunk_rows=args.chunk_rows)
    resolutions = to_floats(args.resolutions, "resolutions")
    restrict_to = json_arg(args.restrict_to)
    louvain(
        adata, args.resolution, resolutions=resolutions, restrict_to=restrict_to,
        random_state=optional_int(args.random_state), key_added=args.key_added, flavor=args.flavor,
        directed=bool(args.directed), use_weights=bool(args.use_weights), neighbors_key=args.neighbors_key,
        obsp=args.obsp,
    )
    keys = output_keys("louvain", args.key_added, restricted=parse_restrict_to(restrict_to) is not None,
                       resolutions=resolutions)
    write_store(adata, args.output, chunk_rows=args.chunk_rows,
                provenance={"stage": "louvain", "keys": keys, "flavor": args.flavor})
    return {**shape_summary(adata, adata), "flavor": args.flavor, **cluster_summary(adata, keys)}
