"""UMAP's spectral start for large graphs, in memory proportional to the graph (issue #21).

umap-learn's start (``umap.spectral.spectral_layout``, scanpy's path) takes the eigenvectors of the normalised
graph Laplacian after the first from ARPACK with sqrt(cells) Lanczos vectors: 7.5 GiB of float64 vectors at 1M
cells on one connected graph. Here the same eigenvectors come from LOBPCG on the normalised adjacency
``D^-1/2 W D^-1/2`` (its largest eigenvalues are the Laplacian's smallest), with the trivial eigenvector
``sqrt(degree)`` held out as a constraint and a few extra block vectors to speed convergence: memory is the
graph plus cells x (dim + extra) x a few float64 vectors. Several connected components are placed as
umap-learn places them (``multi_component_layout``: components spread on a meta-layout, each scaled to half
the distance to its nearest neighbour component).

The eigenvectors are the same subspace as ARPACK's to the solver tolerance, not the same bits, and the
random stream differs, so a layout started here is umap-learn's algorithm from an equivalent start, not
scanpy's coordinates. ``tl.umap`` uses it only above a size gate (``LARGE_GRAPH``).
"""

from __future__ import annotations

import logging
import warnings

import numpy as np
import scipy.sparse as sp
from scipy.sparse.csgraph import connected_components
from scipy.sparse.linalg import lobpcg

log = logging.getLogger(__name__)

#: Block vectors beyond the ``dim`` asked for: they soak up the nearby eigenvalues and speed convergence.
EXTRA_VECTORS = 4


def spectral_start(graph: sp.spmatrix, dim: int, *, seed: int = 0, data: np.ndarray | None = None,
                   metric: str = "euclidean", tol: float = 1e-4, maxiter: int = 400) -> np.ndarray:
    """(cells, dim) float32 spectral start of a symmetric weighted graph, as umap-learn's but by LOBPCG.

    ``data`` (the embedding the graph was built on) places several components as umap-learn does; without
    it components go to the corners of a simplex, as umap-learn does for few components.
    """
    graph = sp.csr_matrix(graph)
    n = graph.shape[0]
    rng = np.random.default_rng(seed)
    n_comp, labels = connected_components(graph, directed=False)
    if n_comp == 1:
        return _component(graph, dim, rng, tol, maxiter).astype(np.float32)
    meta = _meta_layout(data, n_comp, labels, dim, seed, metric)
    out = np.empty((n, dim), dtype=np.float32)
    order = np.argsort(labels, kind="stable")
    bounds = np.searchsorted(labels[order], np.arange(n_comp + 1))
    for c in range(n_comp):
        idx = order[bounds[c]:bounds[c + 1]]
        d = np.linalg.norm(meta - meta[c], axis=1)
        half = d[d > 0].min() / 2.0
        if len(idx) < 2 * dim or len(idx) <= dim + 1:
            emb = rng.uniform(-half, half, size=(len(idx), dim))
        else:
            emb = _component(graph[idx][:, idx], dim, rng, tol, maxiter)
            emb *= half / np.max(np.abs(emb))
        out[idx] = emb + meta[c]
    return out


def _component(graph: sp.csr_matrix, dim: int, rng: np.random.Generator, tol: float, maxiter: int) -> np.ndarray:
    """Eigenvectors 2..dim+1 of one connected component's normalised Laplacian."""
    n = graph.shape[0]
    deg = np.asarray(graph.sum(axis=1), dtype=np.float64).ravel()
    inv_sqrt = 1.0 / np.sqrt(deg)
    m = graph.astype(np.float64)  # scaled in place: one float64 copy of the graph and one temporary
    m.data *= np.repeat(inv_sqrt, np.diff(m.indptr))
    m.data *= inv_sqrt[m.indices]
    trivial = np.sqrt(deg)[:, None] / np.linalg.norm(np.sqrt(deg))
    k = min(dim + EXTRA_VECTORS, n - 2)
    if k * 5 > n:  # LOBPCG wants a block much smaller than the matrix: small components go to a dense solver
        w, v = np.linalg.eigh(m.toarray())
        return v[:, np.argsort(-w)[1:dim + 1]]
    x = rng.standard_normal((n, k))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        w, v = lobpcg(m, x, Y=trivial, largest=True, tol=tol, maxiter=maxiter)
    if any("not reaching the requested tolerance" in str(c.message) for c in caught):
        log.warning("umap: the spectral start did not reach tolerance %g in %d iterations (kept as it is)",
                    tol, maxiter)
    return v[:, np.argsort(-w)[:dim]]


def _meta_layout(data, n_comp: int, labels: np.ndarray, dim: int, seed: int, metric: str) -> np.ndarray:
    """Where each component goes: umap-learn's ``component_layout`` of the component centroids when there
    are many, else the corners of a simplex (umap-learn's rule)."""
    if n_comp > 2 * dim and data is not None:
        from umap.spectral import component_layout

        return component_layout(np.asarray(data), n_comp, labels, dim, np.random.RandomState(seed),
                                metric=metric, metric_kwds={})
    k = int(np.ceil(n_comp / 2.0))
    base = np.hstack([np.eye(k), np.zeros((k, max(dim - k, 0)))])[:, :dim] if dim >= k else None
    if base is None:  # more components than a simplex in dim dimensions holds, and no data: a seeded scatter
        return np.random.default_rng(seed).uniform(-1, 1, size=(n_comp, dim))
    return np.vstack([base, -base])[:n_comp]
