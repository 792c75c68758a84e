"""louvain stage: Louvain clustering of the neighbourhood graph (scanpy.tl.louvain); needs no Dask cluster.

Reads the graph (obsp/uns) of the input store; X is linked. Adds ``obs[key_added]`` (and one column per
extra resolution) with ``uns[<key>]['params']``. Flavor 'igraph' (default) needs only igraph; 'vtraag'
needs the optional louvain package.
"""

from __future__ import annotations

import argparse
import logging

from atlasflow.stages.leiden import add_cluster_arguments, run_clustering
from atlasflow.tl.cluster import LOUVAIN_FLAVORS, louvain

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
    return run_clustering(args, "louvain", louvain, flavor=args.flavor, directed=bool(args.directed),
                          use_weights=bool(args.use_weights))
