"""GPU engines of the graph stages: which library runs the kNN search, UMAP and Leiden/Louvain, and the glue.

The embedding (cells x n_pcs) and the graph fit in memory, so the graph stages need no Dask cluster: with
``backend: gpu`` they hand the in-memory arrays to

* kNN: cuML's brute-force ``NearestNeighbors`` when cuML is installed, else the exact CuPy search of
  :func:`atlasflow.gpu.knn_gpu` (both exact, so the graph is the CPU exact search's up to float rounding);
* UMAP: cuML's ``simplicial_set_embedding`` on the same fuzzy graph, else umap-learn on the CPU;
* Leiden / Louvain (flavor igraph): cuGraph, else igraph on the CPU.

The ``*_engine`` functions name the library that will run (the stages put it in their summary); the
``tl`` functions log it in one line. Nothing here imports CuPy, cuML or cuGraph before it is used, so
CPU installs import this module freely.
"""

from __future__ import annotations

import logging

import numpy as np
import scipy.sparse as sp

from atlasflow import gpu
from atlasflow.backend import to_host

log = logging.getLogger("atlasflow.tl.gpu")

#: Most levels / iterations cuGraph's Leiden and Louvain may take (cuGraph's own default). scanpy's
#: n_iterations counts igraph's whole passes, not cuGraph's levels, so it is not passed on.
CUGRAPH_MAX_LEVELS = 100


def resolve_backend(backend: str | None) -> str:
    """'gpu' or 'cpu': ``auto`` becomes gpu where CuPy sees a device; gpu without CuPy or a device fails in one line."""
    from atlasflow.gpu import validate_backend

    resolved = validate_backend(backend or "cpu")
    if resolved == "gpu":
        gpu.import_cupy()  # one-line GpuUnavailableError without CuPy
        if gpu.device_count() == 0:
            raise gpu.GpuUnavailableError("backend gpu: CuPy sees no CUDA device (check the driver / "
                                          "CUDA_VISIBLE_DEVICES) or use backend: cpu")
    return resolved


# --------------------------------------------------------------------------------------------------- kNN


def knn_supported(metric: str, metric_kwds=None) -> bool:
    """True when the GPU search handles this metric (without extra metric parameters)."""
    return metric in gpu.KNN_METRICS and not metric_kwds  # both engines; others run on the CPU


def knn_engine() -> str:
    """The library of the GPU kNN search: 'cuML' when installed, else 'CuPy'."""
    return "cuML" if gpu.cuml_available() else "CuPy"


def knn(x: np.ndarray, k: int, metric: str = "euclidean") -> tuple[np.ndarray, np.ndarray]:
    """Exact ``k`` nearest neighbours of every row of ``x`` on the GPU: host (indices int64, distances float64)."""
    x = np.ascontiguousarray(x)
    engine = knn_engine()
    if engine == "cuML":
        ind, dist = _knn_cuml(x, k, metric)
    else:
        ind, dist = gpu.knn_gpu(x, k, metric)
    log.info("neighbors: exact kNN of %d cells on the GPU (%s brute force%s)", x.shape[0], engine,
             "" if engine == "cuML" else "; cuML is not installed")
    return np.asarray(ind, dtype=np.int64), np.asarray(dist, dtype=np.float64)


def _knn_cuml(x: np.ndarray, k: int, metric: str) -> tuple[np.ndarray, np.ndarray]:
    """cuML's brute-force search on host arrays (NumPy in, NumPy out); the point itself is among its k.

    ``kneighbors(x)`` with the fitted ``x`` passed again keeps each point as its own first neighbour, as
    the CPU search does; distances are true euclidean (cuML's L2SqrtExpanded) for ``euclidean``.
    """
    from cuml.neighbors import NearestNeighbors

    nn = NearestNeighbors(n_neighbors=int(k), algorithm="brute", metric=metric, output_type="numpy")
    nn.fit(x)
    dist, ind = nn.kneighbors(x)
    dist, ind = np.asarray(dist, dtype=np.float64), np.asarray(ind, dtype=np.int64)
    order = gpu.lexsort_rows(dist, ind, np)  # ties in index order, as the CPU search
    return np.take_along_axis(ind, order, axis=1), np.take_along_axis(dist, order, axis=1)


# -------------------------------------------------------------------------------------------------- UMAP


def umap_engine(backend: str, n_epochs: int) -> str:
    """'cuML' or 'umap-learn'. cuML reads 0 epochs as 'choose for me', so ``maxiter=0`` (the initial
    layout, unoptimised) stays with umap-learn."""
    return "cuML" if backend == "gpu" and gpu.cuml_available() and n_epochs > 0 else "umap-learn"


def umap_embedding(x: np.ndarray, graph: sp.coo_matrix, *, n_components: int, initial_alpha: float, a: float,
                   b: float, gamma: float, negative_sample_rate: int, n_epochs: int, init, random_state: int | None,
                   metric: str) -> np.ndarray:
    """cuML's layout of the fuzzy graph ``graph`` (the one umap-learn would embed), as a host float32 array.

    ``cuml.manifold.umap.simplicial_set_embedding`` takes the same arguments as umap-learn's; given a CuPy
    embedding it returns a CuPy layout. A seed makes cuML's layout reproducible, not equal to umap-learn's.
    """
    import cupy
    from cuml.manifold.umap import simplicial_set_embedding

    if hasattr(init, "dtype"):
        init = cupy.asarray(init, dtype=cupy.float32)
    emb = simplicial_set_embedding(
        cupy.asarray(x, dtype=cupy.float32), graph=graph.tocoo(), n_components=int(n_components),
        initial_alpha=float(initial_alpha), a=float(a), b=float(b), gamma=float(gamma),
        negative_sample_rate=int(negative_sample_rate), n_epochs=int(n_epochs), init=init,
        random_state=None if random_state is None else int(random_state), metric=metric,
    )
    return np.asarray(to_host(emb), dtype=np.float32)


# ------------------------------------------------------------------------------------ Leiden / Louvain


def clustering_engine(backend: str, flavor: str, extra_args=None) -> tuple[str, str]:
    """(library, why) of a Leiden/Louvain run: cuGraph for flavor igraph on the GPU backend where installed."""
    if backend != "gpu":
        return flavor, ""
    if flavor != "igraph":
        return flavor, f"flavor {flavor!r} runs on the CPU (cuGraph stands in for flavor 'igraph' only)"
    if extra_args:
        return flavor, f"options {sorted(extra_args)} are igraph's: clustering on the CPU"
    if not gpu.cugraph_available():
        return flavor, "on the CPU (igraph; cuGraph is not installed)"
    return "cuGraph", "cuGraph on the GPU"


def cugraph_partition(adjacency: sp.csr_matrix, algorithm: str, *, resolution: float, random_state: int | None,
                      use_weights: bool) -> np.ndarray:
    """Leiden or Louvain membership (one int per vertex, in vertex order) of the undirected graph, by cuGraph.

    Every stored edge goes into a cuGraph ``Graph`` (undirected) with float32 weights (1 without
    ``use_weights``). cuGraph returns (vertex, partition) rows in its own order, and leaves out vertices
    without edges: each of those becomes a cluster of its own, as on the CPU. cuGraph's Louvain takes no seed.
    """
    n = adjacency.shape[0]
    coo = adjacency.tocoo()
    if coo.nnz == 0:  # no edge at all: every cell on its own (cuGraph needs an edge list)
        return np.arange(n, dtype=np.int64)
    import cudf
    import cugraph

    weights = coo.data if use_weights else np.ones_like(coo.data)
    frame = cudf.DataFrame({"src": coo.row.astype(np.int32), "dst": coo.col.astype(np.int32),
                            "weight": weights.astype(np.float32)})
    g = cugraph.Graph(directed=False)
    g.from_cudf_edgelist(frame, source="src", destination="dst", weight="weight", renumber=True)
    if algorithm == "leiden":
        parts, _ = cugraph.leiden(g, max_iter=CUGRAPH_MAX_LEVELS, resolution=float(resolution),
                                  random_state=random_state)
    else:
        parts, _ = cugraph.louvain(g, max_level=CUGRAPH_MAX_LEVELS, resolution=float(resolution))
    parts = parts.to_pandas()
    membership = np.full(n, -1, dtype=np.int64)
    membership[parts["vertex"].to_numpy(np.int64)] = parts["partition"].to_numpy(np.int64)
    lonely = membership < 0
    if lonely.any():
        membership[lonely] = membership.max() + 1 + np.arange(int(lonely.sum()))
    return membership
