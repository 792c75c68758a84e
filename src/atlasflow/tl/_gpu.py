"""GPU engines of the graph stages: which library runs the kNN search, UMAP and Leiden/Louvain, and the glue.

The embedding (cells x n_pcs) and the graph fit in memory, so the graph stages need no Dask cluster: with
``backend: gpu`` they hand the in-memory arrays to

* kNN: cuML's brute-force ``NearestNeighbors`` when cuML is installed, else the exact CuPy search of
  :func:`atlasflow.gpu.knn_gpu` (both exact, so the graph is the CPU exact search's up to float rounding);
* UMAP: cuML's ``simplicial_set_embedding`` on the same fuzzy graph, else umap-learn on the CPU;
* Leiden / Louvain: cuGraph, else igraph / leidenalg on the CPU.

Every choice is logged in one line saying what ran where. Nothing here imports CuPy, cuML or cuGraph
before it is used, so CPU installs import this module freely.
"""

from __future__ import annotations

import logging

import numpy as np
import scipy.sparse as sp

from atlasflow import gpu
from atlasflow.errors import ConfigError

log = logging.getLogger("atlasflow.tl.gpu")

#: Metrics of the GPU kNN search (both engines); others run on the CPU, with a log line.
KNN_METRICS = gpu.KNN_METRICS


def resolve_backend(backend: str | None) -> str:
    """'gpu' or 'cpu' for a graph stage: ``auto`` becomes gpu where CuPy sees a device; gpu without one fails."""
    from atlasflow.cluster import validate_backend

    resolved = validate_backend(backend or "cpu")
    if resolved == "gpu":
        gpu._cupy()  # one-line GpuUnavailableError without CuPy
        if gpu.device_count() == 0:
            raise gpu.GpuUnavailableError("backend gpu: CuPy sees no CUDA device (check the driver / "
                                          "CUDA_VISIBLE_DEVICES) or use backend: cpu")
    return resolved


def check_backend(backend: str) -> str:
    """A backend name as given to a ``tl`` function (``cpu`` or ``gpu``; ``auto`` is resolved)."""
    if backend not in ("cpu", "gpu", "auto"):
        raise ConfigError(f"backend must be cpu, gpu or auto, not {backend!r}")
    return resolve_backend(backend)


# --------------------------------------------------------------------------------------------------- kNN


def knn_supported(metric: str, metric_kwds=None) -> bool:
    """True when the GPU search handles this metric (without extra metric parameters)."""
    return metric in KNN_METRICS and not metric_kwds


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
    order = np.lexsort((ind, dist), axis=1)  # ties in index order, as the CPU search
    return np.take_along_axis(ind, order, axis=1), np.take_along_axis(dist, order, axis=1)


# -------------------------------------------------------------------------------------------------- UMAP


def umap_available() -> bool:
    """True when cuML (and so its UMAP layout) is installed."""
    return gpu.cuml_available()


def umap_embedding(x: np.ndarray, graph: sp.coo_matrix, *, n_components: int, initial_alpha: float, a: float,
                   b: float, gamma: float, negative_sample_rate: int, n_epochs: int, init, random_state: int,
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
        random_state=int(random_state), metric=metric,
    )
    return np.asarray(gpu_to_host(emb), dtype=np.float32)


# ------------------------------------------------------------------------------------ Leiden / Louvain


def cugraph_available() -> bool:
    return gpu.cugraph_available()


def cugraph_partition(adjacency: sp.csr_matrix, algorithm: str, *, resolution: float, random_state: int | None,
                      max_iter: int, use_weights: bool) -> np.ndarray:
    """Leiden or Louvain membership (one int per vertex, in vertex order) of the undirected graph, by cuGraph.

    Every stored edge goes into a cuGraph ``Graph`` (undirected) with float32 weights (1 without
    ``use_weights``). cuGraph returns (vertex, partition) rows in its own order, and leaves out vertices
    without edges: each of those becomes a cluster of its own, as on the CPU.
    """
    import cudf
    import cugraph

    coo = adjacency.tocoo()
    weights = coo.data if use_weights else np.ones_like(coo.data)
    frame = cudf.DataFrame({"src": coo.row.astype(np.int32), "dst": coo.col.astype(np.int32),
                            "weight": weights.astype(np.float32)})
    g = cugraph.Graph(directed=False)
    g.from_cudf_edgelist(frame, source="src", destination="dst", weight="weight", renumber=True)
    if algorithm == "leiden":
        parts, _ = cugraph.leiden(g, max_iter=int(max_iter), resolution=float(resolution), random_state=random_state)
    else:
        parts, _ = cugraph.louvain(g, max_level=int(max_iter), resolution=float(resolution))
    parts = parts.to_pandas()
    membership = np.full(adjacency.shape[0], -1, dtype=np.int64)
    membership[parts["vertex"].to_numpy(np.int64)] = parts["partition"].to_numpy(np.int64)
    lonely = membership < 0
    if lonely.any():
        membership[lonely] = membership.max() + 1 + np.arange(int(lonely.sum()))
    return membership


def gpu_to_host(x):
    """A host NumPy array of a CuPy array (or of anything array-like)."""
    from atlasflow.backend import to_host

    return np.asarray(to_host(x))
