"""Leiden and Louvain clustering of the neighbourhood graph with scanpy's semantics.

``leiden`` follows ``scanpy.tl.leiden`` (flavor 'igraph' by default with n_iterations=2 and an
undirected graph, as scanpy recommends; 'leidenalg' optional); ``louvain`` follows ``scanpy.tl.louvain``
with igraph's multilevel algorithm ('vtraag' when the louvain package is installed). The graph is built
as scanpy builds it (one edge per stored entry of the connectivities, weights = entries) and igraph's
random numbers come from a NumPy RandomState seeded with ``random_state``, the way scanpy seeds them, so
the same graph, flavor and seed give scanpy's partition.

Cluster names are scanpy's: the ids of the partition the flavor returns (igraph keeps its membership ids;
leidenalg and louvain number by size themselves), so the same graph gives scanpy's labels, not only its
partition. ``sort_by_size=True`` renames them by decreasing size ('0' the largest, ties in the flavor's
order), the same for every flavor.

Differences from scanpy, on purpose:

* several resolutions share one graph: ``resolutions=[0.5, 1]`` adds ``{key_added}_r0.5``, ``..._r1.0``.
* louvain flavor 'igraph' honours ``resolution`` (scanpy ignores it for that flavor) and is seeded.
* leiden flavor 'igraph' on a symmetric graph of 300,000 cells or more gives igraph one edge per pair of
  cells, weighing as much as scanpy's two (``igraph_edges``): the same partition on half the edges.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any

import anndata as ad
import numpy as np
import pandas as pd
import scipy.sparse as sp

from atlasflow.errors import ConfigError, InputError
from atlasflow.tl.neighbors import graph_of

log = logging.getLogger(__name__)

LEIDEN_FLAVORS = ("igraph", "leidenalg")
LOUVAIN_FLAVORS = ("igraph", "vtraag")


# --------------------------------------------------------------------------------------------------
# graph and random numbers


def graph_key(adata: ad.AnnData, obsp: str | None = None, neighbors_key: str | None = None) -> str:
    """The obsp key of the adjacency ``choose_graph`` takes."""
    return obsp if obsp is not None else graph_of(adata, neighbors_key or "neighbors")[1]


def choose_graph(adata: ad.AnnData, obsp: str | None = None, neighbors_key: str | None = None) -> sp.csr_matrix:
    """The adjacency to cluster: ``obsp[obsp]`` or the connectivities named by ``uns[neighbors_key]``."""
    if obsp is not None and neighbors_key is not None:
        raise ConfigError("give either obsp or neighbors_key, not both")
    if obsp is not None:
        if obsp not in adata.obsp:
            raise InputError(f"obsp: the input has no obsp[{obsp!r}] (obsp holds {sorted(adata.obsp) or 'nothing'})")
        return sp.csr_matrix(adata.obsp[obsp])
    _, conns = graph_of(adata, "neighbors" if neighbors_key is None else neighbors_key)
    return sp.csr_matrix(adata.obsp[conns])


#: ``igraph_edges='auto'``: from this many cells (the clustered graph's) Leiden's igraph graph holds one edge
#: per pair of cells instead of scanpy's two (see :func:`igraph_from_adjacency`)
EDGES_ONCE_MIN_CELLS = 300_000
IGRAPH_EDGES = ("auto", "both", "once")


def igraph_from_adjacency(adjacency: sp.spmatrix, *, directed: bool = False, once: bool = False):
    """igraph Graph with one edge per stored non-zero (row-major order), and the edge weights (float64).

    Same edge list and order as scanpy's ``get_igraph_from_adjacency``; an undirected graph thus holds
    both i-j and j-i of a symmetric matrix, as in scanpy. The weights are the stored values in edge order,
    returned as an array to pass to the clustering call, not kept as a Python edge attribute (one float
    object per edge: 1.2 GB at 1M cells). Edges are streamed to igraph from the CSR arrays in blocks of
    rows, without a COO copy of the matrix: memory is the igraph graph plus one block.

    ``once=True`` (undirected graph of a symmetric matrix, :func:`is_symmetric`): one edge per pair, the
    entries with i <= j, weighing what scanpy's two edges weigh together (2 w; a diagonal entry is one
    edge in both). Every vertex then sums the same weights per neighbouring cluster and meets its
    neighbours in the same order, so igraph's Leiden makes the same moves (its sums can differ in the last
    bit; the partitions measured were identical, ``bench/results/ab_leiden_1000000_once.md``) on half the
    edges: half the graph's memory, less time to build and cluster.
    """
    import igraph as ig

    csr = sp.csr_matrix(adjacency)
    n = csr.shape[0]
    indptr, indices, data = csr.indptr, csr.indices, csr.data
    rows_per_block = max(1, (1 << 20) // max(1, csr.nnz // max(n, 1)))  # ~a million edges per block
    weights: list[np.ndarray] = []

    def edges():
        for s in range(0, n, rows_per_block):
            e = min(n, s + rows_per_block)
            lo, hi = indptr[s], indptr[e]
            rows = np.repeat(np.arange(s, e), np.diff(indptr[s : e + 1]))
            cols, w = indices[lo:hi], data[lo:hi].astype(np.float64)
            keep = w != 0
            if once:
                keep &= cols >= rows
                w = np.where(cols == rows, w, 2 * w)
            weights.append(w[keep])
            yield from zip(rows[keep].tolist(), cols[keep].tolist(), strict=True)

    g = ig.Graph(n=n, edges=edges(), directed=directed)
    return g, np.concatenate(weights) if weights else np.zeros(0)


def is_symmetric(adjacency: sp.spmatrix) -> bool:
    """Whether a square sparse matrix equals its transpose, stored entries included (explicit zeros too)."""
    a = sp.csr_matrix(adjacency)
    if a.shape[0] != a.shape[1]:
        return False
    if not a.has_canonical_format:
        a = a.copy()
        a.sum_duplicates()
    t = a.T.tocsr()
    t.sort_indices()  # compared array by array: both with sorted indices
    return (np.array_equal(a.indptr, t.indptr) and np.array_equal(a.indices, t.indices)
            and np.array_equal(a.data, t.data))


def edges_once(igraph_edges: str, adjacency: sp.spmatrix, algorithm: str) -> bool:
    """Whether the igraph graph of ``adjacency`` gets one edge per pair (:func:`igraph_from_adjacency`):
    ``igraph_edges`` 'once', or 'auto' from :data:`EDGES_ONCE_MIN_CELLS` cells; never for a matrix that is
    not symmetric (logged). Logs which graph is built. ``igraph_edges`` is one of :data:`IGRAPH_EDGES`
    (:func:`leiden` checks it before any work; louvain passes 'both')."""
    n = adjacency.shape[0]
    once = igraph_edges == "once" or (igraph_edges == "auto" and n >= EDGES_ONCE_MIN_CELLS)
    if once and not is_symmetric(adjacency):
        log.info("%s: the graph is not symmetric: igraph gets both edges of each pair, as scanpy", algorithm)
        return False
    if once:
        log.info("%s: igraph gets one edge per pair of cells, weight 2 w (%d cells; scanpy's graph holds both "
                 "directions: the same partition on half the edges)", algorithm, n)
    return once


class _IgraphRNG:
    """igraph's random number interface on a NumPy RandomState (scanpy's mapping of the calls)."""

    def __init__(self, random_state: int | np.random.RandomState | None):
        from sklearn.utils import check_random_state

        self._rng = check_random_state(random_state)

    def getrandbits(self, k: int) -> int:
        return self._rng.tomaxint() & ((1 << k) - 1)

    def randint(self, a: int, b: int) -> int:
        return self._rng.randint(a, b + 1)

    def random(self) -> float:
        return self._rng.random()

    def gauss(self, mu: float, sigma: float) -> float:
        return self._rng.normal(mu, sigma)


@contextmanager
def igraph_seeded(random_state) -> Iterator[None]:
    """Run igraph with random numbers from ``random_state``; restore Python's ``random`` afterwards."""
    import igraph as ig

    ig.set_random_number_generator(_IgraphRNG(random_state))
    try:
        yield
    finally:
        ig.set_random_number_generator(random)


# --------------------------------------------------------------------------------------------------
# labels


def order_by_size(membership: Sequence[int]) -> np.ndarray:
    """Renumber clusters 0..k-1 by decreasing size (ties: smaller original id first)."""
    m = np.asarray(membership, dtype=np.int64)
    if m.size == 0:
        return m
    ids, inverse, counts = np.unique(m, return_inverse=True, return_counts=True)
    order = np.lexsort((ids, -counts))  # largest first
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    return rank[inverse]


def _natural_key(label: str):
    import re

    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", label)]


def _categorical(labels: np.ndarray) -> pd.Categorical:
    labels = [str(v) for v in np.asarray(labels).astype(str)]
    return pd.Categorical(labels, categories=sorted(set(labels), key=_natural_key))


def parse_restrict_to(restrict_to) -> tuple[str, list[str]] | None:
    """``(obs_key, [categories])`` from a tuple/list or JSON-decoded value; None when unset."""
    if restrict_to is None or restrict_to == [] or restrict_to == "":
        return None
    if (
        not isinstance(restrict_to, Sequence) or isinstance(restrict_to, str) or len(restrict_to) != 2
        or not isinstance(restrict_to[0], str)
    ):
        raise ConfigError(f"restrict_to must be [obs_key, [category, ...]], not {restrict_to!r}")
    cats = restrict_to[1]
    cats = [cats] if isinstance(cats, str | int) else list(cats)
    if not cats:
        raise ConfigError("restrict_to: give at least one category")
    return restrict_to[0], [str(c) for c in cats]


def restrict_mask(adata: ad.AnnData, restrict_to) -> tuple[str, list[str], np.ndarray]:
    """Cells of the given categories of ``obs[key]``, checking that key and categories exist."""
    key, cats = parse_restrict_to(restrict_to)
    if key not in adata.obs:
        raise InputError(f"restrict_to: obs has no column {key!r} (obs holds {', '.join(map(str, adata.obs))})")
    col = adata.obs[key]
    present = [str(c) for c in (col.cat.categories if isinstance(col.dtype, pd.CategoricalDtype) else col.unique())]
    missing = [c for c in cats if c not in present]
    if missing:
        raise InputError(f"restrict_to: {', '.join(map(repr, missing))} not among the categories of obs[{key!r}] "
                         f"({', '.join(present[:20])}{', ...' if len(present) > 20 else ''})")
    mask = col.astype(str).isin(cats).to_numpy()
    return key, cats, mask


def _full_labels(adata, key: str, cats: list[str], mask: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """scanpy's naming for restricted clustering: others keep their label, the rest become 'c1-c2,<id>'."""
    out = adata.obs[key].astype(str).to_numpy().astype(object)
    prefix = "-".join(cats) + ","
    out[mask] = [prefix + str(g) for g in groups]
    return out


def _check_resolution(value, name: str = "resolution") -> float:
    try:
        r = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a number, not {value!r}") from None
    if not np.isfinite(r) or r <= 0:
        raise ConfigError(f"{name} must be > 0, not {value!r}")
    return r


def resolution_key(key_added: str, resolution: float) -> str:
    """obs column of one resolution of a list: ``leiden_r0.5``, ``leiden_r1.0``."""
    return f"{key_added}_r{float(resolution)}"


def output_keys(algorithm: str, key_added: str, *, restricted: bool = False,
                resolutions: Sequence[float] = ()) -> list[str]:
    """obs/uns keys a clustering writes: ``key_added`` (``leiden_R`` when restricted, as scanpy) and
    one ``{key_added}_r<res>`` per extra resolution."""
    base = key_added + "_R" if restricted and key_added == algorithm else key_added
    return list(dict.fromkeys([base] + [resolution_key(key_added, r) for r in resolutions]))


# --------------------------------------------------------------------------------------------------
# clustering


def _use_cugraph(algorithm: str, backend: str, flavor: str, extra_args) -> bool:
    """Whether this clustering runs on cuGraph; on the GPU backend, logs one line saying where it runs."""
    from atlasflow.tl import _gpu

    backend = _gpu.resolve_backend(backend)
    engine, why = _gpu.clustering_engine(backend, flavor, extra_args)
    if why:
        log.info("%s: %s", algorithm, why)
    return engine == "cuGraph"


def _run(
    adata, *, algorithm: str, resolution, resolutions, restrict_to, key_added, adjacency, obsp, neighbors_key,
    partition, params_of, sort_by_size: bool = False, directed: bool | None = None, keep_graph: bool = True,
    igraph_edges: str = "both",
) -> dict[str, pd.Categorical]:
    """Shared driver: pick the graph, restrict it, partition it at each resolution, store the labels.

    The igraph graph the partitions share, ``directed`` or not, is built before the first one (none when
    ``directed`` is None: on the GPU, cuGraph takes the adjacency); with ``keep_graph=False`` the adjacency
    taken from ``adata.obsp`` is then dropped from it, so its memory is free while igraph clusters.
    ``igraph_edges``: one or two edges per pair of cells in an undirected graph (:func:`edges_once`)."""
    from_obsp = adjacency is None
    adjacency = choose_graph(adata, obsp, neighbors_key) if adjacency is None else sp.csr_matrix(adjacency)
    if adjacency.shape != (adata.n_obs, adata.n_obs):
        raise InputError(f"adjacency has shape {adjacency.shape}, expected ({adata.n_obs}, {adata.n_obs})")
    restricted = None
    if restrict_to is not None:
        rkey, rcats, mask = restrict_mask(adata, restrict_to)
        adjacency = adjacency[mask][:, mask]
        restricted = (rkey, rcats, mask)
    base = output_keys(algorithm, key_added, restricted=restricted is not None)[0]
    jobs: dict[str, float | None] = {base: resolution}
    for r in resolutions or ():
        jobs[resolution_key(key_added, r)] = r
    graph_cache: dict = {}
    if directed is not None:
        once = not directed and edges_once(igraph_edges, adjacency, algorithm)
        graph_cache["g"] = igraph_from_adjacency(adjacency, directed=directed, once=once)
        if not keep_graph:
            if from_obsp:
                adata.obsp.pop(graph_key(adata, obsp, neighbors_key), None)
            adjacency = None
    out = {}
    for key, res in jobs.items():
        groups = np.asarray(partition(adjacency, res, graph_cache), dtype=np.int64)
        if sort_by_size:  # else the flavor's own ids, as scanpy names them
            groups = order_by_size(groups)
        labels = groups.astype(str) if restricted is None else _full_labels(adata, *restricted, groups)
        adata.obs[key] = _categorical(labels)
        adata.uns[key] = {"params": params_of(res)}
        log.info("%s: %s -> %d clusters", algorithm, key, adata.obs[key].cat.categories.size)
        out[key] = adata.obs[key]
    return out


def leiden(
    adata: ad.AnnData,
    resolution: float = 1,
    *,
    resolutions: Sequence[float] | None = None,
    restrict_to: tuple[str, Sequence[str]] | None = None,
    random_state: int = 0,
    key_added: str = "leiden",
    adjacency: sp.spmatrix | None = None,
    directed: bool | None = None,
    use_weights: bool = True,
    n_iterations: int = 2,
    neighbors_key: str | None = None,
    obsp: str | None = None,
    flavor: str = "igraph",
    backend: str = "cpu",
    sort_by_size: bool = False,
    keep_graph: bool = True,
    igraph_edges: str = "auto",
    copy: bool = False,
    **clustering_args: Any,
) -> ad.AnnData | None:
    """Leiden clustering (scanpy.tl.leiden): ``obs[key_added]`` categorical '0', '1', ..., named as scanpy
    names them (``sort_by_size``: renamed by decreasing size).

    flavor 'igraph': ``Graph.community_leiden`` with the modularity objective on the undirected graph;
    'leidenalg': ``leidenalg.find_partition`` with RBConfigurationVertexPartition (directed unless
    ``directed=False``, as scanpy). ``resolutions`` adds one column per value (``{key_added}_r<res>``).
    ``uns[key]['params']`` holds resolution, random_state and n_iterations, as scanpy.
    ``backend='gpu'``: flavor 'igraph' runs as cuGraph's Leiden where cuGraph is installed (another
    implementation: partitions of the same quality, not the same labels; up to cuGraph's 100 levels, as
    ``n_iterations`` counts igraph's passes), else on the CPU (logged). ``keep_graph=False`` drops the
    clustered ``obsp`` matrix from ``adata`` once igraph holds the graph (for a caller that links it from
    its store instead: the leiden stage), so it takes no memory while igraph clusters.
    ``igraph_edges`` (flavor 'igraph'): 'both' builds scanpy's graph, both i-j and j-i of each pair; 'once'
    one edge per pair weighing as much as the two (:func:`igraph_from_adjacency`: the same partition, half
    the edges); 'auto' (default) 'once' from :data:`EDGES_ONCE_MIN_CELLS` cells. The log says which.
    """
    adata = adata.copy() if copy else adata
    if flavor not in LEIDEN_FLAVORS:
        raise ConfigError(f"flavor must be one of {', '.join(LEIDEN_FLAVORS)}, not {flavor!r}")
    on_gpu = _use_cugraph("leiden", backend, flavor, clustering_args)
    resolution = _check_resolution(resolution)
    resolutions = [_check_resolution(r, "resolutions") for r in (resolutions or ())]
    n_iterations = int(n_iterations)
    if n_iterations == 0 or n_iterations < -1:
        raise ConfigError(f"n_iterations must be positive or -1 (until stable), not {n_iterations}")
    if igraph_edges not in IGRAPH_EDGES:
        raise ConfigError(f"igraph_edges must be one of {', '.join(IGRAPH_EDGES)}, not {igraph_edges!r}")
    if flavor == "igraph":
        if directed:
            raise ConfigError("directed=True needs flavor='leidenalg' (igraph's Leiden is undirected only)")
        directed = False
    else:
        if igraph_edges == "once":
            raise ConfigError("igraph_edges='once' is for flavor='igraph'; leidenalg gets scanpy's graph")
        igraph_edges = "both"
        try:
            import leidenalg
        except ImportError:
            raise ConfigError("flavor='leidenalg' needs the leidenalg package; use flavor='igraph'") from None
        directed = True if directed is None else bool(directed)

    def partition(adj, res, cache):
        if on_gpu:
            from atlasflow.tl._gpu import cugraph_partition

            return cugraph_partition(adj, "leiden", resolution=res, random_state=random_state, use_weights=use_weights)
        g, weights = cache["g"]  # built by _run before the first partition
        args = dict(clustering_args, n_iterations=n_iterations)
        if flavor == "igraph":
            if use_weights:
                args["weights"] = weights
            args["resolution"] = res
            args.setdefault("objective_function", "modularity")
            with igraph_seeded(random_state):
                return g.community_leiden(**args).membership
        args["resolution_parameter"] = res
        if use_weights:
            args["weights"] = weights
        part = leidenalg.find_partition(g, leidenalg.RBConfigurationVertexPartition, seed=random_state, **args)
        return part.membership

    _run(adata, algorithm="leiden", resolution=resolution, resolutions=resolutions, restrict_to=restrict_to,
         key_added=key_added, adjacency=adjacency, obsp=obsp, neighbors_key=neighbors_key, partition=partition,
         params_of=lambda r: {"resolution": r, "random_state": random_state, "n_iterations": n_iterations},
         sort_by_size=sort_by_size, keep_graph=keep_graph, igraph_edges=igraph_edges,
         directed=None if on_gpu else directed)
    return adata if copy else None


def louvain(
    adata: ad.AnnData,
    resolution: float | None = None,
    *,
    resolutions: Sequence[float] | None = None,
    random_state: int = 0,
    restrict_to: tuple[str, Sequence[str]] | None = None,
    key_added: str = "louvain",
    adjacency: sp.spmatrix | None = None,
    flavor: str = "igraph",
    directed: bool = True,
    use_weights: bool = False,
    partition_kwargs: Mapping[str, Any] = MappingProxyType({}),
    neighbors_key: str | None = None,
    obsp: str | None = None,
    backend: str = "cpu",
    sort_by_size: bool = False,
    keep_graph: bool = True,
    copy: bool = False,
) -> ad.AnnData | None:
    """Louvain clustering (scanpy.tl.louvain): ``obs[key_added]`` categorical '0', '1', ..., named as scanpy
    names them (``sort_by_size``: renamed by decreasing size).

    flavor 'igraph' (default here: the louvain package is optional): ``Graph.community_multilevel`` on
    the undirected graph, seeded and with ``resolution`` (default 1); 'vtraag': the louvain package with
    RBConfigurationVertexPartition on the directed graph, as scanpy's default. ``use_weights`` defaults to
    False, as in scanpy. ``uns[key]['params']`` holds resolution and random_state. ``backend='gpu'``: flavor
    'igraph' runs as cuGraph's Louvain where cuGraph is installed (which takes no seed), else on the CPU
    (logged). ``keep_graph``: as in :func:`leiden`.
    """
    adata = adata.copy() if copy else adata
    if flavor not in LOUVAIN_FLAVORS:
        raise ConfigError(f"flavor must be one of {', '.join(LOUVAIN_FLAVORS)}, not {flavor!r}")
    on_gpu = _use_cugraph("louvain", backend, flavor, partition_kwargs)
    if resolution is not None:
        resolution = _check_resolution(resolution)
    resolutions = [_check_resolution(r, "resolutions") for r in (resolutions or ())]
    if flavor == "vtraag":
        try:
            import louvain as louvain_pkg
        except ImportError:
            raise ConfigError("flavor='vtraag' needs the louvain package (pip install louvain); "
                              "use flavor='igraph'") from None
    else:
        directed = False

    def partition(adj, res, cache):
        if on_gpu:
            from atlasflow.tl._gpu import cugraph_partition

            return cugraph_partition(adj, "louvain", resolution=1.0 if res is None else res,
                                     random_state=random_state, use_weights=use_weights)
        g, weights = cache["g"]  # built by _run before the first partition
        weights = weights if use_weights else None
        if flavor == "igraph":
            with igraph_seeded(random_state):
                return g.community_multilevel(weights=weights, resolution=1.0 if res is None else res).membership
        kwargs = dict(partition_kwargs)
        if res is not None:
            kwargs["resolution_parameter"] = res
        if use_weights:
            kwargs["weights"] = weights
        part = louvain_pkg.find_partition(g, louvain_pkg.RBConfigurationVertexPartition, seed=random_state, **kwargs)
        return part.membership

    _run(adata, algorithm="louvain", resolution=resolution, resolutions=resolutions, restrict_to=restrict_to,
         key_added=key_added, adjacency=adjacency, obsp=obsp, neighbors_key=neighbors_key, partition=partition,
         params_of=lambda r: {"resolution": r, "random_state": random_state}, sort_by_size=sort_by_size,
         keep_graph=keep_graph,
         directed=None if on_gpu else directed)
    return adata if copy else None


def cluster_sizes(labels: pd.Series) -> dict[str, int]:
    """{cluster: number of cells} in category order, for summaries."""
    return {str(k): int(v) for k, v in labels.value_counts(sort=False).items()}
