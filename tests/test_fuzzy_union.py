"""kernels.fuzzy_union against umap-learn's fuzzy_simplicial_set (scanpy's connectivities): the same matrix bit
for bit, computed row by row instead of with SciPy's sparse temporaries (issue #21)."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from atlasflow.tl.neighbors import fuzzy_simplicial_set


def _knn(n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.neighbors import NearestNeighbors

    x = np.random.default_rng(seed).normal(size=(n, 5)).astype(np.float32)
    dist, ind = NearestNeighbors(n_neighbors=k).fit(x).kneighbors(x)
    return ind, dist


@pytest.mark.parametrize(("n", "k", "seed"), [(600, 15, 0), (2500, 10, 1), (1500, 30, 2)])
def test_union_is_umap_learns_bit_for_bit(n, k, seed):
    from umap.umap_ import fuzzy_simplicial_set as umap_fss

    ind, dist = _knn(n, k, seed)
    ind[5, k - 1], dist[5, k - 1] = -1, np.inf  # a neighbour pynndescent did not find
    ref = umap_fss(sp.coo_matrix((n, 1)), k, None, None, knn_indices=ind, knn_dists=dist)[0].tocsr()
    ours = fuzzy_simplicial_set(ind, dist, n, k)
    assert ours.has_sorted_indices
    for part in ("data", "indices", "indptr"):
        expected, got = getattr(ref, part), getattr(ours, part)
        assert got.dtype == expected.dtype, part
        np.testing.assert_array_equal(got, expected, err_msg=part)


def test_other_mix_ratios_keep_umap_learns_path():
    from umap.umap_ import fuzzy_simplicial_set as umap_fss

    ind, dist = _knn(400, 15, 3)
    ref = umap_fss(sp.coo_matrix((400, 1)), 15, None, None, knn_indices=ind, knn_dists=dist,
                   set_op_mix_ratio=0.5)[0].tocsr()
    ours = fuzzy_simplicial_set(ind, dist, 400, 15, set_op_mix_ratio=0.5)
    assert (ours != ref).nnz == 0
