"""kernels.ivf_knn, the inverted-file kNN that replaces pynndescent above ``pynndescent_max_cells`` (issue #21):
exact when every list is probed, recall against the exact kNN at least pynndescent's on the same data, the same
graph for any thread count, and the gate and errors of ``knn_method``."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from atlasflow.errors import ConfigError
from atlasflow.kernels.ivf_knn import ivf_knn
from atlasflow.tl.neighbors import PYNNDESCENT_MAX_CELLS, choose_knn_method, knn, neighbors


def _blobs(n: int, d: int, seed: int) -> np.ndarray:
    """Clusters of different spread in ``d`` dimensions, like a PCA embedding of cell types."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(scale=6.0, size=(12, d))
    labels = rng.integers(0, 12, n)
    return (centres[labels] + rng.normal(size=(n, d)) * rng.uniform(0.5, 2.0, 12)[labels, None]).astype(np.float32)


def _exact(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.neighbors import NearestNeighbors

    dist, ind = NearestNeighbors(n_neighbors=k, algorithm="brute").fit(x).kneighbors(x)
    return ind, dist


def _recall(ind: np.ndarray, ref: np.ndarray) -> float:
    """Fraction of each row's exact neighbours (the point itself left out) that the search found."""
    return float(np.mean([len(set(a[1:]) & set(b[1:])) / (len(b) - 1) for a, b in zip(ind, ref, strict=True)]))


def test_probing_every_list_is_the_exact_knn():
    x = _blobs(3000, 10, 0)
    ind, dist = ivf_knn(x, 16, n_lists=40, n_probes=40)
    ref_ind, ref_dist = _exact(x, 16)
    assert ind.dtype == np.int64 and dist.dtype == np.float32
    np.testing.assert_array_equal(ind[:, 0], np.arange(len(x)))
    np.testing.assert_allclose(dist, ref_dist, rtol=1e-5, atol=1e-4)
    # the same neighbours wherever the 16th and 17th are not tied
    assert _recall(ind, ref_ind) > 0.999
    assert np.all(np.diff(dist, axis=1) >= 0)


def test_recall_is_at_least_pynndescents_and_grows_with_probes():
    x = _blobs(20_000, 30, 1)
    ref, _ = _exact(x, 16)
    pynn, _, _ = knn(x, 16, knn_method="pynndescent", random_state=0)
    ivf, _, used = knn(x, 16, knn_method="ivf", random_state=0)
    few, _ = ivf_knn(x, 16, n_probes=2, seed=0)
    assert used == "ivf"
    r_pynn, r_ivf, r_few = _recall(pynn, ref), _recall(ivf, ref), _recall(few, ref)
    assert r_ivf >= r_pynn, (r_ivf, r_pynn)
    assert r_few < r_ivf - 0.05, (r_few, r_ivf)


def test_same_graph_for_any_thread_count_and_seed_matters():
    x = _blobs(8000, 12, 2)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = ivf_knn(x, 11, n_probes=4, seed=3)
        numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
        two = ivf_knn(x, 11, n_probes=4, seed=3)
    finally:
        numba.set_num_threads(before)
    np.testing.assert_array_equal(one[0], two[0])
    np.testing.assert_array_equal(one[1], two[1])
    other = ivf_knn(x, 11, n_probes=4, seed=4)
    assert not np.array_equal(one[0], other[0])


def test_rows_short_of_candidates_are_padded():
    x = _blobs(200, 4, 3)
    ind, dist = ivf_knn(x, 30, n_lists=50, n_probes=1)
    short = ind[:, -1] < 0
    assert short.any()
    assert np.isinf(dist[short, -1]).all()
    np.testing.assert_array_equal(ind[:, 0], np.arange(len(x)))


def test_gate_and_errors():
    assert PYNNDESCENT_MAX_CELLS == 300_000
    assert choose_knn_method(300_000) == "pynndescent"
    assert choose_knn_method(300_001) == "ivf"
    assert choose_knn_method(300_001, pynndescent_max_cells=None) == "pynndescent"
    assert choose_knn_method(50_000, pynndescent_max_cells=10_000) == "ivf"
    assert choose_knn_method(5_000, pynndescent_max_cells=10) == "exact"
    assert choose_knn_method(500_000, "cosine") == "pynndescent"
    with pytest.raises(ConfigError, match="euclidean"):
        choose_knn_method(100, "cosine", "ivf")


def test_neighbors_on_ivf_keep_scanpys_layout():
    import anndata as ad

    x = _blobs(9000, 20, 4)
    a = ad.AnnData(np.zeros((len(x), 1), np.float32), obsm={"X_pca": x})
    b = a.copy()
    neighbors(a, 15, knn_method="ivf")
    neighbors(b, 15, knn_method="exact")
    da, db = a.obsp["distances"], b.obsp["distances"]
    assert da.shape == db.shape and (np.diff(da.indptr) == 14).all()
    same = np.mean([len(set(da[i].indices) & set(db[i].indices)) / 14 for i in range(0, len(x), 7)])
    assert same > 0.97
    assert a.obsp["connectivities"].shape == (len(x), len(x))
    assert abs(a.obsp["connectivities"] - a.obsp["connectivities"].T).max() < 1e-6
