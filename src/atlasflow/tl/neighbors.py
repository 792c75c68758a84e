"""kNN graph of an in-memory embedding with scanpy's semantics (``scanpy.pp.neighbors``).

The embedding (cells x n_pcs, ``obsm['X_pca']`` by default) fits in memory even at 10M cells, so this
never touches X. Search is exact (brute force, as scanpy does for small data) or approximate
(pynndescent, scanpy's choice for large data; above ``pynndescent_max_cells`` an inverted-file search,
:mod:`atlasflow.kernels.ivf_knn`, in a third of the memory and time); connectivities follow UMAP's fuzzy
simplicial set (``method='umap'``) or the adaptive Gaussian kernel (``method='gauss'``). Output keys, layouts and
dtypes are scanpy's: ``obsp['distances']`` holds the ``n_neighbors - 1`` nearest other cells of each
row in order of distance, ``obsp['connectivities']`` the symmetric weights, ``uns['neighbors']`` the
keys and parameters.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any

import anndata as ad
import numpy as np
import scipy.sparse as sp

from atlasflow.errors import ConfigError, InputError
from atlasflow.tl._jit_cache import import_with_cache

log = logging.getLogger(__name__)

#: Below this many cells (euclidean metric) the search is exact, as in scanpy ...
EXACT_MAX_CELLS_EUCLIDEAN = 8192
#: ... and below this many for any metric.
EXACT_MAX_CELLS = 4096
KNN_METHODS = ("auto", "exact", "pynndescent", "ivf")
#: Default of ``pynndescent_max_cells``: above it ``auto`` searches a euclidean embedding with atlasflow's
#: inverted file instead of pynndescent (1M cells: 1.7 instead of 4.8 GiB, higher recall; #21)
PYNNDESCENT_MAX_CELLS = 300_000
#: Lists each cell searches in the inverted file: recall 0.90 at 1M cells (bench/results/neighbors_ivf.md)
IVF_PROBES = 32
#: Metrics the inverted-file search runs
IVF_METRICS = ("euclidean", "l2")
#: NN-descent builds its graph with at least this many neighbours (then keeps n_neighbors): its recall drops
#: for small k (pbmc3k, 10 neighbours: 0.93 when building with 11, 0.98 with 16). Equal to scanpy's
#: n_neighbors + 1 for the default 15, so results match scanpy's approximate graph there.
MIN_SEARCH_NEIGHBORS = 16
METHODS = ("umap", "gauss")
#: Distance metrics both CPU searches run (scikit-learn's brute force and pynndescent; scanpy lists the same
#: names): the continuous ones. Boolean metrics (jaccard, dice, hamming, ...) would treat every non-zero
#: coordinate of a PCA embedding as True; cityblock is unknown to pynndescent (use manhattan or l1).
METRICS = ("euclidean", "sqeuclidean", "cosine", "correlation", "manhattan", "l1", "l2", "chebyshev", "minkowski",
           "canberra", "braycurtis", "mahalanobis", "seuclidean")


def choose_knn_method(n_obs: int, metric: str = "euclidean", knn_method: str = "auto", *, backend: str = "cpu",
                      metric_kwds: Mapping[str, Any] | None = None,
                      pynndescent_max_cells: int | None = PYNNDESCENT_MAX_CELLS) -> str:
    """'exact', 'pynndescent', 'ivf' or 'gpu' (exact search on the GPU).

    On the CPU, scanpy's rule for ``auto``: exact below 8192 cells for euclidean (4096 for other metrics),
    pynndescent above, up to ``pynndescent_max_cells`` cells (None: any number); above it a euclidean
    embedding is searched by the inverted file (:mod:`atlasflow.kernels.ivf_knn`), other metrics stay
    with pynndescent. With ``backend='gpu'``, ``auto`` and ``exact`` search exactly on the GPU for any
    number of cells (a brute-force GEMM is fast there) when the metric allows (:mod:`atlasflow.tl._gpu`);
    ``pynndescent`` stays on the CPU, as asked.
    """
    if knn_method not in KNN_METHODS:
        raise ConfigError(f"knn_method must be one of {', '.join(KNN_METHODS)}, not {knn_method!r}")
    if metric not in METRICS:
        raise ConfigError(f"metric: {metric!r} is not one of {', '.join(METRICS)}")
    if knn_method == "ivf" and metric not in IVF_METRICS:
        raise ConfigError(f"knn_method 'ivf' searches euclidean distances only, not metric {metric!r}")
    if backend == "gpu" and knn_method != "pynndescent":
        from atlasflow.tl import _gpu

        if _gpu.knn_supported(metric, metric_kwds):
            return "gpu"
    if knn_method != "auto":
        return knn_method
    small = (metric == "euclidean" and n_obs < EXACT_MAX_CELLS_EUCLIDEAN) or n_obs < EXACT_MAX_CELLS
    if small:
        return "exact"
    large = pynndescent_max_cells is not None and n_obs > int(pynndescent_max_cells)
    return "ivf" if large and metric in IVF_METRICS else "pynndescent"


def graph_of(adata: ad.AnnData, neighbors_key: str = "neighbors") -> tuple[Mapping, str]:
    """``uns[neighbors_key]`` and the obsp key of its connectivities; a one-line error when there is none."""
    info = adata.uns.get(neighbors_key)
    conns = info.get("connectivities_key", "connectivities") if isinstance(info, Mapping) else None
    if conns is None or conns not in adata.obsp:
        raise InputError(
            f"neighbors_key: the input has no neighbourhood graph uns[{neighbors_key!r}] / obsp['connectivities'] "
            f"(uns holds {sorted(adata.uns) or 'nothing'}); run the neighbors stage first (scripts/neighbors.py)"
        )
    return info, conns


def representation(adata: ad.AnnData, use_rep: str | None = None, n_pcs: int | None = None) -> np.ndarray:
    """The embedding the graph is built on: ``obsm[use_rep or 'X_pca']``, first ``n_pcs`` columns.

    Unlike scanpy, never falls back to X (it is out of core here): a missing embedding is an error that
    says which stage produces it.
    """
    key = "X_pca" if use_rep is None else str(use_rep)
    if key == "X":
        raise ConfigError("use_rep='X' is not supported: neighbors run on an embedding in obsm (e.g. X_pca)")
    if key not in adata.obsm:
        have = ", ".join(sorted(adata.obsm)) or "nothing"
        hint = "run the pca stage first (scripts/pca.py)" if key == "X_pca" else f"compute obsm[{key!r}] first"
        raise InputError(f"use_rep: the input has no obsm[{key!r}] (obsm holds {have}); {hint}")
    x = np.asarray(adata.obsm[key])
    if x.ndim != 2:
        raise InputError(f"use_rep: obsm[{key!r}] must be 2-dimensional, has shape {x.shape}")
    if n_pcs is not None:
        n_pcs = int(n_pcs)
        if n_pcs < 1:
            raise ConfigError(f"n_pcs must be at least 1 (or unset to use all columns), not {n_pcs}")
        if n_pcs > x.shape[1]:
            raise InputError(
                f"n_pcs={n_pcs} exceeds the {x.shape[1]} components of obsm[{key!r}]; "
                f"lower n_pcs or re-run pca with more components"
            )
        x = x[:, :n_pcs]
    if not np.isfinite(x).all():
        raise InputError(f"use_rep: obsm[{key!r}] contains NaN or infinite values")
    return x


# --------------------------------------------------------------------------------------------------
# search


def knn(
    x: np.ndarray,
    n_neighbors: int,
    *,
    knn_method: str = "auto",
    metric: str = "euclidean",
    metric_kwds: Mapping[str, Any] = MappingProxyType({}),
    random_state: int = 0,
    n_jobs: int | None = 1,
    backend: str = "cpu",
    pynndescent_max_cells: int | None = PYNNDESCENT_MAX_CELLS,
) -> tuple[np.ndarray, np.ndarray, str]:
    """``n_neighbors`` nearest points of every row of ``x``, the point itself first.

    Returns (indices, distances, method used). Like scanpy, the search asks for one neighbour more than
    it keeps (the point itself counts; pynndescent builds at least ``MIN_SEARCH_NEIGHBORS``), so exact
    results are scanpy's; the distance of a point to itself is set to 0, as scanpy does (it enters UMAP's
    rho, and brute force gives ~1e-7). pynndescent's result depends on its thread count: ``n_jobs=1``
    (scanpy's default too) makes it independent of the machine and equal to scanpy's; more threads are
    faster but give another (equally good) approximate graph per thread count. ``backend='gpu'``: the
    exact search runs on the GPU where the metric allows (method 'gpu'; see :func:`choose_knn_method`).
    The inverted file ('ivf') gives the same graph for any thread count and uses numba's threads (all cores
    unless ``NUMBA_NUM_THREADS`` says otherwise), whatever ``n_jobs``.
    """
    n = x.shape[0]
    method = choose_knn_method(n, metric, knn_method, backend=backend, metric_kwds=metric_kwds,
                               pynndescent_max_cells=pynndescent_max_cells)
    k_search = min(n_neighbors + 1, n)
    if method == "pynndescent":
        k_search = min(max(k_search, MIN_SEARCH_NEIGHBORS), n)
    if backend == "gpu" and method != "gpu":
        log.info("neighbors: %s search on the CPU (%s)", method, "asked for" if knn_method == "pynndescent" else
                 f"metric {metric!r}{' with metric_kwds' if metric_kwds else ''} is not one of the GPU's")
    if method == "gpu":
        from atlasflow.tl import _gpu

        ind, dist = _gpu.knn(x, k_search, metric)
        dist = dist.astype(_exact_dtype(x, metric), copy=False)
    elif method == "ivf":
        ind, dist = _ivf(x, k_search, random_state)
    elif method == "exact":
        from sklearn.neighbors import NearestNeighbors

        nn = NearestNeighbors(
            n_neighbors=k_search, algorithm="brute", metric=metric, metric_params=dict(metric_kwds) or None,
            n_jobs=n_jobs,
        )
        dist, ind = nn.fit(x).kneighbors(x)
    else:
        import_with_cache()
        from pynndescent import NNDescent

        # a writable copy of a read-only embedding (arrays read from a store are): pynndescent's kernels are
        # compiled for writable arrays only and fail to type a read-only one
        with lean_rp_trees():
            index = NNDescent(
                np.require(x, requirements=["C", "W"]), n_neighbors=k_search, metric=metric,
                metric_kwds=dict(metric_kwds), n_trees=min(64, 5 + round(n**0.5 / 20.0)),
                n_iters=max(5, round(np.log2(n))), random_state=random_state, n_jobs=n_jobs, low_memory=True,
                compressed=False,
            )
        ind, dist = index.neighbor_graph
        del index
    ind, dist = _self_first(np.asarray(ind), np.asarray(dist))
    ind, dist = ind[:, :n_neighbors].copy(), dist[:, :n_neighbors].copy()
    dist[:, 0] = 0  # a point is at distance 0 from itself (brute force may give ~1e-7): scanpy zeroes it too
    return ind, dist, method


def _ivf(x: np.ndarray, k: int, seed: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The inverted-file search, logging its steps and every 10% of the lists."""
    import numba

    from atlasflow.kernels.ivf_knn import default_lists, ivf_knn

    n_lists = default_lists(x.shape[0])
    log.info("neighbors: inverted-file search of %d cells (%d k-means lists, %d probed per cell, %d threads)",
             x.shape[0], n_lists, min(IVF_PROBES, n_lists), numba.get_num_threads())

    def progress(step: str, fraction: float) -> None:
        if step != "k-means" or fraction == 1.0:
            log.info("neighbors: %s %.0f%%", step, 100 * fraction)

    return ivf_knn(x, k, n_probes=IVF_PROBES, n_lists=n_lists, seed=seed, progress=progress)


@contextmanager
def lean_rp_trees() -> Iterator[None]:
    """While building an NNDescent graph, keep only what the graph needs of each random projection tree.

    pynndescent builds ``5 + sqrt(cells) / 20`` trees (55 at 1M cells) and keeps them all for later queries,
    each with one split hyperplane (n_dims floats) per node: ~1.4 GB of the neighbors step at 1M cells. The
    graph uses only each tree's leaves (its ``children`` and ``indices``); queries, which we never run, use
    the hyperplanes. So each dense tree is returned without its hyperplanes and offsets as soon as it is
    built. pynndescent draws, builds and walks the trees as before: the same graph, bit for bit. Where
    pynndescent's trees are not laid out as expected (another version), nothing is changed (logged).
    """
    from pynndescent import rp_trees

    original = getattr(rp_trees, "make_dense_tree", None)
    fields = getattr(getattr(rp_trees, "FlatTree", None), "_fields", ())
    hyperplane_type = getattr(rp_trees, "dense_hyperplane_type", None)
    offset_type = getattr(rp_trees, "offset_type", None)
    expected = fields[:4] == ("hyperplanes", "offsets", "children", "indices")
    if None in (original, hyperplane_type, offset_type) or not expected:
        log.info("neighbors: pynndescent's trees are not laid out as expected; its index is kept whole")
        yield
        return
    from numba import typed

    def lean_tree(*args, **kwargs):
        tree = original(*args, **kwargs)
        return tree._replace(hyperplanes=typed.List.empty_list(hyperplane_type),
                             offsets=typed.List.empty_list(offset_type))

    rp_trees.make_dense_tree = lean_tree
    try:
        yield
    finally:
        rp_trees.make_dense_tree = original


def _exact_dtype(x: np.ndarray, metric: str) -> np.dtype:
    """dtype of the distances of the CPU's exact search (scikit-learn's: float64 for euclidean on float32
    input, float32 for cosine), so that the GPU search stores the same ``obsp['distances']`` dtype."""
    from sklearn.neighbors import NearestNeighbors

    probe = np.asarray(x[: min(3, x.shape[0])])
    return NearestNeighbors(n_neighbors=1, algorithm="brute", metric=metric).fit(probe).kneighbors(probe)[0].dtype


def _self_first(ind: np.ndarray, dist: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Make column 0 the point itself (duplicates of a point may outrank it in the search)."""
    rows = np.arange(ind.shape[0])
    bad = np.flatnonzero(ind[:, 0] != rows)
    if bad.size == 0:
        return ind, dist
    ind, dist = ind.copy(), dist.copy()
    for i in bad:
        hit = np.flatnonzero(ind[i] == i)
        if hit.size:  # move self to the front, keep the others in order
            p = hit[0]
            ind[i, 1 : p + 1], dist[i, 1 : p + 1] = ind[i, :p].copy(), dist[i, :p].copy()
        else:  # self not found (approximate search): insert it, drop the farthest
            ind[i, 1:], dist[i, 1:] = ind[i, :-1].copy(), dist[i, :-1].copy()
        ind[i, 0], dist[i, 0] = i, 0
    return ind, dist


def distance_matrix(indices: np.ndarray, distances: np.ndarray) -> sp.csr_matrix:
    """scanpy's ``obsp['distances']``: per row the neighbours after the point itself, in order of distance."""
    n, k = indices.shape
    ind, dist = indices[:, 1:], distances[:, 1:]
    found = ind >= 0  # pynndescent marks neighbours it could not find with -1
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(found.sum(axis=1), out=indptr[1:])
    return sp.csr_matrix((dist[found].copy(), ind[found].copy(), indptr), shape=(n, n))


# --------------------------------------------------------------------------------------------------
# connectivities


def fuzzy_simplicial_set(
    indices: np.ndarray,
    distances: np.ndarray,
    n_obs: int,
    n_neighbors: int,
    *,
    set_op_mix_ratio: float = 1.0,
    local_connectivity: float = 1.0,
) -> sp.csr_matrix:
    """UMAP connectivities from a kNN (indices/distances, the point itself first): umap-learn's fuzzy union.

    umap-learn's own strengths (``smooth_knn_dist``, ``compute_membership_strengths``) on the precomputed
    kNN, as scanpy computes them, so the weights are bit for bit scanpy's and a UMAP of this graph reproduces
    scanpy's layout. (A NumPy port agrees to ~2e-7 only: float32 exp rounding differs, and UMAP's
    optimisation amplifies such differences.) The union (``set_op_mix_ratio=1``, scanpy's) is
    ``kernels.fuzzy_union``: umap-learn's float32 sums row by row, without its sparse temporaries; other
    ratios go through umap-learn's ``fuzzy_simplicial_set`` whole.
    """
    import warnings

    import_with_cache()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Tensorflow not installed")
        from umap.umap_ import compute_membership_strengths, smooth_knn_dist
        from umap.umap_ import fuzzy_simplicial_set as umap_fss

    if set_op_mix_ratio == 1.0:  # the union (scanpy's): umap-learn's strengths, its union row by row
        from atlasflow.kernels.fuzzy_union import fuzzy_union

        d = distances.astype(np.float32)
        sigmas, rhos = smooth_knn_dist(d, float(n_neighbors), local_connectivity=float(local_connectivity))
        _, cols, vals, _ = compute_membership_strengths(indices, d, sigmas, rhos, False)
        del d, sigmas, rhos, _
        return fuzzy_union(cols, vals, n_obs, indices.shape[1])
    conn, _sigmas, _rhos = umap_fss(
        sp.coo_matrix((n_obs, 1)), n_neighbors, None, None, knn_indices=indices, knn_dists=distances,
        set_op_mix_ratio=set_op_mix_ratio, local_connectivity=local_connectivity,
    )
    return conn.tocsr()


def gauss_connectivities(dist: sp.csr_matrix, n_neighbors: int) -> sp.csr_matrix:
    """scanpy's ``method='gauss'`` (knn=True): Gaussian kernel with per-cell width, symmetrised.

    sigma_i^2 is the median squared distance of cell i to its neighbours; w_ij =
    sqrt(2 s_i s_j / (s_i^2 + s_j^2)) exp(-d_ij^2 / (s_i^2 + s_j^2)); an edge present in one direction
    only is copied to the other.
    """
    d_sq = dist.power(2).tocsr()
    n = d_sq.shape[0]
    counts = np.diff(d_sq.indptr)
    if counts.size and (counts != counts[0]).any():
        raise InputError("method='gauss' needs the same number of neighbours for every cell")
    k = int(counts[0]) if counts.size else 0
    dsq_rows = d_sq.data.reshape(n, k)
    sigmas_sq = np.median(dsq_rows, axis=1)
    sigmas = np.sqrt(sigmas_sq)
    rows = np.repeat(np.arange(n), k)
    cols = d_sq.indices
    num = 2 * sigmas[rows] * sigmas[cols]
    den = sigmas_sq[rows] + sigmas_sq[cols]
    w = d_sq.copy()
    w.data = (np.sqrt(num / den) * np.exp(-d_sq.data / den)).astype(d_sq.dtype)
    # edges i->j whose reverse j->i is missing get w[j, i] = w[i, j]
    key = rows.astype(np.int64) * n + cols
    rev = cols.astype(np.int64) * n + rows
    missing = ~np.isin(rev, key)
    extra = sp.csr_matrix((w.data[missing], (cols[missing], rows[missing])), shape=(n, n))
    out = (w + extra).tocsr()
    out.sort_indices()
    return out


# --------------------------------------------------------------------------------------------------
# public entry point


def neighbors(
    adata: ad.AnnData,
    n_neighbors: int = 15,
    n_pcs: int | None = None,
    *,
    use_rep: str | None = None,
    knn_method: str = "auto",
    method: str = "umap",
    metric: str = "euclidean",
    metric_kwds: Mapping[str, Any] = MappingProxyType({}),
    random_state: int = 0,
    key_added: str | None = None,
    n_jobs: int | None = 1,
    backend: str = "cpu",
    pynndescent_max_cells: int | None = PYNNDESCENT_MAX_CELLS,
    copy: bool = False,
) -> ad.AnnData | None:
    """Neighbourhood graph of the cells on ``obsm[use_rep]`` (scanpy.pp.neighbors, knn=True).

    Sets ``obsp['distances']``, ``obsp['connectivities']`` and ``uns['neighbors']`` (or
    ``obsp[key_added + '_distances']``, ... and ``uns[key_added]``), laid out as scanpy does.
    ``knn_method``: 'auto' (exact below 8192 cells for euclidean, pynndescent above, as scanpy, and the
    inverted file above ``pynndescent_max_cells`` for euclidean), 'exact', 'pynndescent' or 'ivf'.
    ``n_jobs``: threads of the search; with pynndescent the approximate graph
    depends on it, so the default 1 keeps results independent of the machine (and equal to scanpy's).
    ``backend``: 'gpu' searches exactly on the GPU (cuML, else CuPy; ``auto`` where one is seen); the
    connectivities are computed on the CPU either way (umap-learn's, bit for bit scanpy's).
    """
    from atlasflow.tl import _gpu

    adata = adata.copy() if copy else adata
    backend = _gpu.resolve_backend(backend)
    if method not in METHODS:
        raise ConfigError(f"method must be one of {', '.join(METHODS)}, not {method!r}")
    n_neighbors = int(n_neighbors)
    n_obs = adata.n_obs
    if n_neighbors < 2:
        raise ConfigError(f"n_neighbors must be at least 2 (the cell itself counts as one), not {n_neighbors}")
    if n_neighbors >= n_obs:
        raise InputError(f"n_neighbors={n_neighbors} must be smaller than the number of cells ({n_obs})")
    x = representation(adata, use_rep, n_pcs)
    ind, dist, used = knn(
        x, n_neighbors, knn_method=knn_method, metric=metric, metric_kwds=metric_kwds,
        random_state=random_state, n_jobs=n_jobs, backend=backend, pynndescent_max_cells=pynndescent_max_cells,
    )
    log.info("neighbors: %d cells, %d neighbours on %d dims (%s search)", n_obs, n_neighbors, x.shape[1], used)
    distances = distance_matrix(ind, dist)
    if method == "umap":
        conn = fuzzy_simplicial_set(ind, dist, n_obs, n_neighbors)
    else:
        conn = gauss_connectivities(distances, n_neighbors)

    if key_added is None:
        key_added, conns_key, dists_key = "neighbors", "connectivities", "distances"
    else:
        conns_key, dists_key = f"{key_added}_connectivities", f"{key_added}_distances"
    params: dict[str, Any] = {
        "n_neighbors": n_neighbors, "method": method, "random_state": random_state, "metric": metric,
    }
    if metric_kwds:
        params["metric_kwds"] = dict(metric_kwds)
    if use_rep is not None:
        params["use_rep"] = use_rep
    if n_pcs is not None:
        params["n_pcs"] = int(n_pcs)
    adata.uns[key_added] = {"connectivities_key": conns_key, "distances_key": dists_key, "params": params}
    adata.obsp[dists_key] = distances
    adata.obsp[conns_key] = conn
    return adata if copy else None
