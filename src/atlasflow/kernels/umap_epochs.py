"""UMAP's optimisation epochs for large graphs: reproducible, and parallel over cells (issue #21).

umap-learn's epochs (scanpy's) walk the edges one after another and move both ends of each sampled edge at
once; its numba-parallel variant races on those writes, so it is not reproducible. Here each cell moves
itself through its own row of the (symmetric) graph, with its own random stream:

* attraction: for each edge of the row sampled this epoch, the move umap-learn gives the head, twice (on a
  symmetric graph the edge's mirror moves this cell as its tail), each from the cell's position as it is;
* repulsion: ``negative_sample_rate`` cells drawn at random for each sampled edge, umap-learn's gradient.

The cells are taken in ``GROUPS`` fixed groups, one after another; within a group they move in parallel and
see the other cells where they stood when the group began (a block Gauss-Seidel step, where umap-learn's
is edge by edge). So the result is the same for any number of threads, and runs. The sampling schedule is
umap-learn's: an edge of weight ``w`` is sampled ``w / max(w)`` times per epoch on average, the first
sample falling due in epoch 1, and edges below ``max(w) / n_epochs`` are never sampled. The per-edge clocks
are computed from the weight, not stored, so memory is the graph, one float32 per edge and the layout twice.
"""

from __future__ import annotations

import numpy as np

_EPOCH = None

#: Cell groups moved one after another in an epoch (cells within a group in parallel).
GROUPS = 32


def _epoch_kernel():
    """The numba kernel, compiled on first use (cached on disk)."""
    global _EPOCH
    if _EPOCH is None:
        import numba

        @numba.njit(parallel=True, fastmath=True, cache=True)
        def epoch(emb, moved, indptr, indices, rate, epoch_n, a, b, gamma, n_neg, seed, alpha, lo, hi):
            n, dim = emb.shape
            zero, one, four = np.float32(0.0), np.float32(1.0), np.float32(4.0)
            eps = np.float32(0.001)
            attract = np.float32(-2.0) * a * b  # float32 arithmetic throughout, as umap-learn's float32 layout
            repel = np.float32(2.0) * gamma * b
            for j in numba.prange(lo, hi):
                # splitmix64 of (seed, epoch, cell): a stream per cell and epoch, whatever the thread
                state = np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(epoch_n) * np.uint64(
                    0xBF58476D1CE4E5B9) + np.uint64(j) * np.uint64(0x94D049BB133111EB)
                for d in range(dim):
                    moved[j, d] = emb[j, d]  # this cell's own position as it moves through its row
                for q in range(indptr[j], indptr[j + 1]):
                    r = rate[q]
                    if np.floor(epoch_n * r) <= np.floor((epoch_n - 1) * r):
                        continue
                    k = indices[q]
                    for _twice in range(2):
                        d2 = zero
                        for d in range(dim):
                            diff = moved[j, d] - emb[k, d]
                            d2 += diff * diff
                        if d2 > zero:
                            p = d2 ** b  # one power per sample: d2 ** (b - 1) is p / d2
                            coeff = attract * p / (d2 * (a * p + one))
                            for d in range(dim):
                                g = coeff * (moved[j, d] - emb[k, d])
                                moved[j, d] += min(max(g, -four), four) * alpha
                    for _ in range(n_neg):
                        state += np.uint64(0x9E3779B97F4A7C15)
                        z = state
                        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
                        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
                        z = z ^ (z >> np.uint64(31))
                        other = np.int64(((z >> np.uint64(32)) * np.uint64(n)) >> np.uint64(32))
                        if other == j:
                            continue
                        d2 = zero
                        for d in range(dim):
                            diff = moved[j, d] - emb[other, d]
                            d2 += diff * diff
                        if d2 > zero:
                            coeff = repel / ((eps + d2) * (a * d2 ** b + one))
                            for d in range(dim):
                                g = coeff * (moved[j, d] - emb[other, d])
                                moved[j, d] += min(max(g, -four), four) * alpha

        _EPOCH = epoch
    return _EPOCH


def optimize_layout(emb: np.ndarray, graph, n_epochs: int, *, a: float, b: float, gamma: float = 1.0,
                    initial_alpha: float = 1.0, negative_sample_rate: int = 5, seed: int = 0,
                    progress=None) -> np.ndarray:
    """The layout after ``n_epochs`` epochs from ``emb`` (cells x dims; a float32 ``emb`` is updated in place)
    over the symmetric weighted ``graph`` (scipy sparse). ``progress(epoch)`` is called after each epoch."""
    import scipy.sparse as sp

    g = sp.csr_matrix(graph)
    if not g.has_sorted_indices:
        g = g.sorted_indices()
    w = np.asarray(g.data, dtype=np.float64)
    rate = (w / w.max()).astype(np.float32) if w.size else w.astype(np.float32)
    rate[rate < 1.0 / max(int(n_epochs), 1)] = 0.0  # umap-learn drops these edges: never sampled
    del w
    emb = np.ascontiguousarray(emb, dtype=np.float32)
    moved = np.zeros_like(emb)
    kernel = _epoch_kernel()
    indptr = g.indptr.astype(np.int64, copy=False)
    n = emb.shape[0]
    bounds = np.linspace(0, n, min(GROUPS, max(n, 1)) + 1).astype(np.int64)
    for epoch in range(1, int(n_epochs)):  # umap-learn's epoch 0 samples no edge (the first falls due in epoch 1)
        alpha = np.float32(initial_alpha * (1.0 - epoch / float(n_epochs)))
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            kernel(emb, moved, indptr, g.indices, rate, epoch, np.float32(a), np.float32(b), np.float32(gamma),
                   int(negative_sample_rate), int(seed) & 0xFFFFFFFF, alpha, lo, hi)
            emb[lo:hi] = moved[lo:hi]
        if progress is not None:
            progress(epoch)
    return emb
