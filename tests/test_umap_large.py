"""UMAP's large path (issue #21) against umap-learn's: the spectral start (tl._spectral) and the epochs
(kernels.umap_epochs), and their size gates.

Below ``umap.exact_spectral_max_cells`` the layout is scanpy's bit for bit (tests/test_graph.py); above it the
start comes from LOBPCG: the same eigenvectors to the solver tolerance, placed as umap-learn places
components; the layout's quality at scale is measured by bench/bench_umap.py.
"""

from __future__ import annotations

import logging

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

from atlasflow.tl import neighbors
from atlasflow.tl._spectral import spectral_start
from atlasflow.tl.umap import umap


def _walk_of_blobs(n: int, clusters: int, step: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian blobs whose centres follow a random walk (overlapping: one component for small steps):
    (embedding, blob of each cell)."""
    rng = np.random.default_rng(seed)
    centers = np.cumsum(rng.normal(scale=step, size=(clusters, 10)), axis=0)
    labels = rng.integers(0, clusters, n)
    return (centers[labels] + rng.normal(size=(n, 10))).astype(np.float32), labels


def _graph(x: np.ndarray, k: int = 15) -> sp.csr_matrix:
    a = ad.AnnData(obs=pd.DataFrame(index=[f"c{i}" for i in range(len(x))]), obsm={"X_pca": x})
    neighbors(a, n_neighbors=k, use_rep="X_pca")
    return a.obsp["connectivities"].tocsr()


def _largest_angle(a: np.ndarray, b: np.ndarray) -> float:
    """Largest principal angle (degrees) between the column spaces of a and b."""
    qa, _ = np.linalg.qr(a - a.mean(0))
    qb, _ = np.linalg.qr(b - b.mean(0))
    s = np.linalg.svd(qa.T @ qb, compute_uv=False)
    return float(np.degrees(np.arccos(np.clip(s.min(), -1, 1))))


def test_lobpcg_start_spans_umap_learns_eigenvectors():
    from umap.spectral import spectral_layout

    g = _graph(_walk_of_blobs(3000, 12, 0.8)[0])
    assert sp.csgraph.connected_components(g)[0] == 1
    ref = spectral_layout(None, g, 2, np.random.RandomState(0))
    ours = spectral_start(g, 2, seed=0)
    assert ours.shape == (3000, 2) and ours.dtype == np.float32
    assert _largest_angle(ref, ours) < 0.5
    assert _largest_angle(ours, spectral_start(g, 2, seed=1)) < 0.5  # the seed only starts the solver


def test_components_are_placed_as_umap_learn_places_them():
    from umap.spectral import multi_component_layout

    rng = np.random.default_rng(1)
    x = np.concatenate([rng.normal(size=(400, 10)) + 40 * i for i in range(3)]).astype(np.float32)
    g = _graph(x)
    n_comp, labels = sp.csgraph.connected_components(g)
    assert n_comp == 3
    ref = multi_component_layout(x, g, n_comp, labels, 2, np.random.RandomState(0))
    ours = spectral_start(g, 2, seed=0, data=x)
    for c in range(3):
        own = labels == c
        # each component at umap-learn's place (a corner of the simplex), scaled to the same extent
        np.testing.assert_allclose(ours[own].mean(0), ref[own].mean(0), atol=0.05)
        np.testing.assert_allclose(np.abs(ours[own] - ours[own].mean(0)).max(),
                                   np.abs(ref[own] - ref[own].mean(0)).max(), rtol=0.1)
        assert _largest_angle(ref[own], ours[own]) < 1.0


@pytest.fixture(scope="module")
def blobs():
    x, labels = _walk_of_blobs(4000, 15, 0.7, seed=2)
    a = ad.AnnData(obs=pd.DataFrame({"blob": labels}, index=[f"c{i}" for i in range(len(x))]), obsm={"X_pca": x})
    neighbors(a, n_neighbors=15, use_rep="X_pca")
    return a


def _blob_distances_kept(a: ad.AnnData, emb: np.ndarray) -> float:
    """Spearman correlation of the blobs' centroid distances in X_pca and in the layout (global structure)."""
    from scipy.spatial.distance import pdist
    from scipy.stats import spearmanr

    blobs = np.unique(a.obs["blob"])
    hi = np.array([a.obsm["X_pca"][a.obs["blob"] == b].mean(0) for b in blobs])
    lo = np.array([emb[a.obs["blob"] == b].mean(0) for b in blobs])
    return float(spearmanr(pdist(hi), pdist(lo))[0])


def test_above_the_gate_the_start_is_lobpcgs_and_the_layout_keeps_structure(blobs, caplog, monkeypatch):
    import umap.umap_ as umap_learn

    exact = umap(blobs, maxiter=100, copy=True)
    with caplog.at_level(logging.INFO, logger="atlasflow"):
        same = umap(blobs, maxiter=100, exact_spectral_max_cells=4000, copy=True)
    assert "LOBPCG" not in caplog.text
    np.testing.assert_array_equal(same.obsm["X_umap"], exact.obsm["X_umap"])  # at the gate: scanpy's path

    starts = []
    real = umap_learn.simplicial_set_embedding

    def spy(*args, **kw):
        starts.append((kw["init"], kw["graph"].copy()))
        return real(*args, **kw)

    monkeypatch.setattr(umap_learn, "simplicial_set_embedding", spy)
    with caplog.at_level(logging.INFO, logger="atlasflow"):
        large = umap(blobs, maxiter=100, exact_spectral_max_cells=3999, copy=True)
        again = umap(blobs, maxiter=100, exact_spectral_max_cells=3999, copy=True)
    assert "spectral start by LOBPCG" in caplog.text
    # the start handed to umap-learn spans umap-learn's own spectral start of the graph it optimises
    init, graph = starts[0]
    pruned = graph.tocsr()
    pruned.data[pruned.data < pruned.data.max() / 100] = 0
    pruned.eliminate_zeros()
    assert _largest_angle(umap_learn.spectral_layout(None, pruned, 2, np.random.RandomState(0)), init) < 0.5
    emb = large.obsm["X_umap"]
    assert emb.shape == (4000, 2) and np.isfinite(emb).all()
    assert not np.array_equal(emb, exact.obsm["X_umap"])
    np.testing.assert_array_equal(emb, again.obsm["X_umap"])  # reproducible for a seed
    assert large.uns["umap"] == exact.uns["umap"]
    # a sanity check of the layout (its quality at scale is measured in bench/bench_umap.py)
    assert _blob_distances_kept(blobs, emb) >= _blob_distances_kept(blobs, exact.obsm["X_umap"]) - 0.02


def test_gate_off_keeps_umap_learns_start(blobs, caplog):
    with caplog.at_level(logging.INFO, logger="atlasflow"):
        off = umap(blobs, maxiter=20, exact_spectral_max_cells=None, copy=True)
    assert "LOBPCG" not in caplog.text
    np.testing.assert_array_equal(off.obsm["X_umap"], umap(blobs, maxiter=20, copy=True).obsm["X_umap"])


def test_stage_takes_the_gate_and_says_which_start_ran(blobs, tmp_path):
    import json

    import dask.array as da

    from atlasflow.cli import stage_main
    from atlasflow.stages import umap as umap_stage
    from atlasflow.store import open_store, write_store

    x = da.from_array(sp.random(blobs.n_obs, 5, density=0.5, format="csr", dtype=np.float32, random_state=0),
                      chunks=(2000, 5), asarray=False)
    a = ad.AnnData(X=x, obs=blobs.obs, var=pd.DataFrame(index=[f"g{j}" for j in range(5)]), obsm=dict(blobs.obsm),
                   obsp=dict(blobs.obsp), uns=dict(blobs.uns))
    write_store(a, tmp_path / "neighbors.zarr")
    for gate, start in (("3999", "spectral (LOBPCG)"), ("none", "spectral (ARPACK, scanpy's)")):
        out = tmp_path / f"umap_{gate}.zarr"
        assert stage_main(umap_stage, argv=["--input", str(tmp_path / "neighbors.zarr"), "--output", str(out),
                                            "--maxiter", "20", "--exact-spectral-max-cells", gate]) == 0
        summary = json.loads(out.with_suffix(".json").read_text())
        assert summary["start"] == start and summary["epochs"] == "umap-learn (scanpy's)"
        assert open_store(out).obsm["X_umap"].shape == (4000, 2)
    out = tmp_path / "umap_epochs.zarr"
    assert stage_main(umap_stage, argv=["--input", str(tmp_path / "neighbors.zarr"), "--output", str(out),
                                        "--maxiter", "20", "--exact-epochs-max-cells", "3999"]) == 0
    assert json.loads(out.with_suffix(".json").read_text())["epochs"] == "atlasflow (deterministic, parallel)"
    assert stage_main(umap_stage, argv=["--input", str(tmp_path / "neighbors.zarr"), "--output",
                                        str(tmp_path / "bad.zarr"), "--exact-spectral-max-cells", "0"]) != 0
    assert not (tmp_path / "bad.zarr").exists()


def _graph_neighbours_kept(graph: sp.csr_matrix, emb: np.ndarray, k: int = 15) -> float:
    """Mean fraction of each cell's graph neighbours found among its k nearest cells in the layout."""
    from sklearn.neighbors import NearestNeighbors

    near = NearestNeighbors(n_neighbors=k + 1).fit(emb).kneighbors(emb, return_distance=False)[:, 1:]
    kept = [np.isin(graph.indices[graph.indptr[i]:graph.indptr[i + 1]], near[i]).mean()
            for i in range(graph.shape[0]) if graph.indptr[i + 1] > graph.indptr[i]]
    return float(np.mean(kept))


def test_large_epochs_are_the_same_for_any_thread_count():
    import numba
    from umap.umap_ import find_ab_params

    from atlasflow.kernels.umap_epochs import optimize_layout

    g = _graph(_walk_of_blobs(2000, 8, 0.8, seed=3)[0])
    a, b = find_ab_params(1.0, 0.5)
    start = np.random.default_rng(0).uniform(0, 10, size=(2000, 2)).astype(np.float32)
    before = numba.get_num_threads()
    runs = []
    try:
        for threads in (1, min(2, numba.config.NUMBA_NUM_THREADS)):
            numba.set_num_threads(threads)
            runs.append(optimize_layout(start.copy(), g, 50, a=a, b=b, seed=7))
    finally:
        numba.set_num_threads(before)
    np.testing.assert_array_equal(runs[0], runs[1])
    assert not np.array_equal(runs[0], optimize_layout(start.copy(), g, 50, a=a, b=b, seed=8))  # the seed counts
    assert np.isfinite(runs[0]).all() and not np.array_equal(runs[0], start)


def test_above_the_epochs_gate_the_layout_keeps_umap_learns_structure(blobs, caplog):
    exact = umap(blobs, maxiter=200, copy=True)
    with caplog.at_level(logging.INFO, logger="atlasflow"):
        large = umap(blobs, maxiter=200, exact_epochs_max_cells=3999, copy=True)
    assert "atlasflow's deterministic parallel kernel" in caplog.text
    emb = large.obsm["X_umap"]
    assert emb.shape == (4000, 2) and emb.dtype == np.float32 and np.isfinite(emb).all()
    np.testing.assert_array_equal(emb, umap(blobs, maxiter=200, exact_epochs_max_cells=3999, copy=True).obsm["X_umap"])
    g = blobs.obsp["connectivities"].tocsr()
    # local structure: the graph's neighbours stay near in 2-D about as often as in umap-learn's layout
    assert _graph_neighbours_kept(g, emb) >= 0.9 * _graph_neighbours_kept(g, exact.obsm["X_umap"])
    # global structure: the blobs keep their order of distances
    assert _blob_distances_kept(blobs, emb) >= _blob_distances_kept(blobs, exact.obsm["X_umap"]) - 0.05
