"""neighbors, leiden, louvain and umap stages: scanpy oracle on pbmc3k, biology, determinism, bad inputs.

The PCA embedding comes from scanpy's tutorial pipeline (these stages never read X), written into an
atlasflow store together with the log-normalised X, which the stages only link.
"""

from __future__ import annotations

import os
from pathlib import Path

import anndata as ad
import dask.array as da
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
from sklearn.metrics import adjusted_rand_score

from atlasflow.cli import stage_main
from atlasflow.errors import ConfigError
from atlasflow.stages import leiden as leiden_stage
from atlasflow.stages import louvain as louvain_stage
from atlasflow.stages import neighbors as neighbors_stage
from atlasflow.stages import umap as umap_stage
from atlasflow.store import open_store, write_store
from atlasflow.tl import cluster
from atlasflow.tl.neighbors import choose_knn_method, knn, neighbors

N_NEIGHBORS, N_PCS, RESOLUTION = 10, 40, 1.0
MARKERS = {  # published pbmc3k markers -> Seurat labels their top cluster may carry
    "IL7R": {"Naive CD4 T", "Memory CD4 T"}, "CD14": {"CD14+ Mono"}, "LYZ": {"CD14+ Mono", "DC"},
    "MS4A1": {"B"}, "CD8A": {"CD8 T"}, "GNLY": {"NK"}, "NKG7": {"NK"}, "FCGR3A": {"FCGR3A+ Mono"},
    "MS4A7": {"FCGR3A+ Mono"}, "FCER1A": {"DC"}, "CST3": {"DC", "CD14+ Mono"}, "PPBP": {"Platelet"},
}


def _store(path: Path, x, obs, var, obsm=None) -> Path:
    """An atlasflow store whose X is a small Dask CSR array (as a stage would leave it) plus obsm."""
    x = sp.csr_matrix(x, dtype=np.float32)
    X = da.from_array(x, chunks=(1000, x.shape[1]), asarray=False)
    write_store(ad.AnnData(X=X, obs=obs, var=var, obsm=obsm or {}), path)
    return path


def _run(stage, *argv) -> int:
    return stage_main(stage, argv=[str(a) for a in argv])


@pytest.fixture(scope="module")
def pbmc_pca(scanpy_pbmc3k):
    """scanpy's tutorial from log1p to PCA: HVG (seurat), regress_out, scale to 10, PCA (50 comps)."""
    import scanpy as sc

    a = scanpy_pbmc3k["log1p"].copy()
    sc.pp.highly_variable_genes(a, flavor="seurat", min_mean=0.0125, max_mean=3, min_disp=0.5)
    h = a[:, a.var["highly_variable"]].copy()
    sc.pp.regress_out(h, ["total_counts", "pct_counts_mt"])
    sc.pp.scale(h, max_value=10)
    sc.pp.pca(h, svd_solver="covariance_eigh")
    return h


@pytest.fixture(scope="module")
def pca_store(pbmc_pca, scanpy_pbmc3k, tmp_path_factory) -> Path:
    """log-normalised pbmc3k (all genes) with obsm['X_pca'] from scanpy, as an atlasflow store."""
    lg = scanpy_pbmc3k["log1p"]
    out = tmp_path_factory.mktemp("graph") / "pca.zarr"
    return _store(out, lg.X, lg.obs, lg.var, {"X_pca": pbmc_pca.obsm["X_pca"]})


@pytest.fixture(scope="module")
def reference(pbmc_pca):
    """scanpy on the same embedding: neighbors (10 on 40 PCs), leiden (igraph, 2 iterations), umap."""
    import scanpy as sc

    ref = pbmc_pca.copy()
    sc.pp.neighbors(ref, n_neighbors=N_NEIGHBORS, n_pcs=N_PCS)
    sc.tl.leiden(ref, resolution=RESOLUTION, flavor="igraph", n_iterations=2, directed=False, random_state=0)
    return ref


@pytest.fixture(scope="module")
def stores(pca_store) -> dict[str, Path]:
    """Our stages chained through stores: neighbors -> leiden (+ resolutions) -> umap."""
    d = pca_store.parent
    out = {"pca": pca_store, "neighbors": d / "neighbors.zarr", "leiden": d / "leiden.zarr", "umap": d / "umap.zarr"}
    assert _run(neighbors_stage, "--input", pca_store, "--output", out["neighbors"],
                "--n-neighbors", N_NEIGHBORS, "--n-pcs", N_PCS) == 0
    assert _run(leiden_stage, "--input", out["neighbors"], "--output", out["leiden"],
                "--resolution", RESOLUTION, "--resolutions", 0.5, 1.0) == 0
    assert _run(umap_stage, "--input", out["neighbors"], "--output", out["umap"]) == 0
    return out


@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory) -> Path:
    """60 cells in 3 blobs, 8-dim 'X_pca', X random counts: for the error paths."""
    rng = np.random.default_rng(0)
    n = 60
    emb = (rng.normal(size=(n, 8)) + np.repeat(np.eye(3, 8) * 8, n // 3, axis=0)).astype(np.float32)
    x = sp.random(n, 30, density=0.3, random_state=1, format="csr") * 10
    obs = pd.DataFrame({"group": pd.Categorical(np.repeat(["a", "b", "c"], n // 3))},
                       index=[f"c{i}" for i in range(n)])
    var = pd.DataFrame(index=[f"g{j}" for j in range(30)])
    d = tmp_path_factory.mktemp("tiny")
    pca = _store(d / "pca.zarr", x, obs, var, {"X_pca": emb})
    assert _run(neighbors_stage, "--input", pca, "--output", d / "neighbors.zarr", "--n-neighbors", 5) == 0
    return pca


# --------------------------------------------------------------------------------------------------
# neighbors


def test_exact_knn_and_graph_match_scanpy(stores, reference):
    ours = open_store(stores["neighbors"])
    assert ours.uns["neighbors"]["connectivities_key"] == "connectivities"
    assert ours.uns["neighbors"]["distances_key"] == "distances"
    assert dict(ours.uns["neighbors"]["params"]) == reference.uns["neighbors"]["params"]
    d_ours, d_ref = ours.obsp["distances"].tocsr(), reference.obsp["distances"].tocsr()
    # same neighbours in the same (distance) order, per row
    np.testing.assert_array_equal(d_ours.indptr, d_ref.indptr)
    np.testing.assert_array_equal(d_ours.indices, d_ref.indices)
    np.testing.assert_allclose(d_ours.data, d_ref.data, rtol=0, atol=1e-6)
    c_ours, c_ref = ours.obsp["connectivities"].tocsr(), reference.obsp["connectivities"].tocsr()
    assert c_ours.dtype == c_ref.dtype == np.float32
    assert (c_ours != c_ref).nnz == 0  # umap-learn's fuzzy union on the same kNN: bit for bit
    assert abs(c_ours - c_ours.T).max() == 0  # symmetric


def test_neighbors_stage_links_x_and_writes_summary(stores):
    src = next(p for p in sorted((stores["pca"] / "X").rglob("*")) if p.is_file())
    dst = stores["neighbors"] / "X" / src.relative_to(stores["pca"] / "X")
    assert os.stat(src).st_ino == os.stat(dst).st_ino  # hard link, not a copy
    import json

    summary = json.loads(stores["neighbors"].with_suffix(".json").read_text())
    assert summary["knn_method"] == "exact" and summary["n_neighbors"] == N_NEIGHBORS
    assert summary["n_dims"] == N_PCS and summary["cells_out"] == 2638


def test_gauss_connectivities_match_scanpy(pbmc_pca):
    import scanpy as sc

    ref, ours = pbmc_pca.copy(), pbmc_pca.copy()
    sc.pp.neighbors(ref, n_neighbors=N_NEIGHBORS, n_pcs=N_PCS, method="gauss", key_added="g")
    neighbors(ours, N_NEIGHBORS, N_PCS, method="gauss", key_added="g")
    assert ours.uns["g"]["connectivities_key"] == "g_connectivities"
    assert ours.uns["g"]["params"] == ref.uns["g"]["params"]
    for key in ("g_distances", "g_connectivities"):
        assert abs(ours.obsp[key] - ref.obsp[key]).max() <= 1e-6


@pytest.mark.slow  # numba compiles pynndescent: ~1 min on a busy 2-core machine
def test_pynndescent_recall_and_determinism(pbmc_pca):
    x = pbmc_pca.obsm["X_pca"][:, :N_PCS]
    exact, _, m1 = knn(x, N_NEIGHBORS, knn_method="exact")
    approx, dist, m2 = knn(x, N_NEIGHBORS, knn_method="pynndescent", random_state=0)
    assert (m1, m2) == ("exact", "pynndescent")
    assert choose_knn_method(2638) == "exact"
    assert choose_knn_method(100_000) == "pynndescent"
    assert (approx[:, 0] == np.arange(len(x))).all() and (dist[:, 0] == 0).all()
    hits = [len(set(a[1:]) & set(e[1:])) for a, e in zip(approx, exact, strict=True)]
    recall = sum(hits) / (len(x) * (N_NEIGHBORS - 1))
    print(f"pynndescent recall@{N_NEIGHBORS - 1} on pbmc3k: {recall:.4f}")
    assert recall >= 0.95
    again, dist2, _ = knn(x, N_NEIGHBORS, knn_method="pynndescent", random_state=0)
    np.testing.assert_array_equal(again, approx)
    np.testing.assert_array_equal(dist2, dist)


@pytest.mark.slow  # numba compiles (or loads) pynndescent
def test_lean_rp_trees_give_pynndescent_graph_without_hyperplanes(pbmc_pca):
    """The trees kept while the graph is built lose their split hyperplanes; the graph stays pynndescent's."""
    from pynndescent import NNDescent

    from atlasflow.tl.neighbors import lean_rp_trees

    x = np.ascontiguousarray(pbmc_pca.obsm["X_pca"][:, :N_PCS], dtype=np.float32)

    def build():
        return NNDescent(x, n_neighbors=16, n_trees=8, n_iters=6, random_state=0, n_jobs=1, low_memory=True,
                         compressed=False)

    whole = build()
    with lean_rp_trees():
        lean = build()
    assert all(len(t.hyperplanes) > 0 for t in whole._rp_forest)
    assert all(len(t.hyperplanes) == 0 and len(t.offsets) == 0 for t in lean._rp_forest)
    for a, b in zip(whole.neighbor_graph, lean.neighbor_graph, strict=True):
        np.testing.assert_array_equal(a, b)
    from pynndescent import rp_trees

    assert rp_trees.make_dense_tree is not None and "lean" not in rp_trees.make_dense_tree.__name__  # restored


@pytest.mark.slow  # pynndescent and umap-learn compile (or load) their kernels
def test_stages_take_the_read_only_embedding_of_a_store(tmp_path):
    """Arrays read from a store are read-only; pynndescent's kernels (explicit writable signatures) and UMAP's
    multi-component spectral layout must still take them. Stores above 8192 cells always hit this path."""
    rng = np.random.default_rng(0)
    centres = np.repeat(np.arange(3)[:, None] * 50.0, 10, axis=1)  # three blobs: a graph of 3 components
    emb = (centres[np.arange(1500) % 3] + rng.normal(size=(1500, 10))).astype(np.float32)
    obs = pd.DataFrame(index=[f"c{i}" for i in range(1500)])
    var = pd.DataFrame(index=[f"g{i}" for i in range(4)])
    src = _store(tmp_path / "pca.zarr", np.ones((1500, 4)), obs, var, obsm={"X_pca": emb})
    assert not open_store(src).obsm["X_pca"].flags.writeable
    assert _run(neighbors_stage, "--input", src, "--output", tmp_path / "nb.zarr", "--knn-method", "pynndescent",
                "--n-neighbors", 10) == 0
    graph = open_store(tmp_path / "nb.zarr").obsp["connectivities"]
    assert sp.csgraph.connected_components(graph, directed=False)[0] == 3
    assert _run(umap_stage, "--input", tmp_path / "nb.zarr", "--output", tmp_path / "umap.zarr",
                "--maxiter", 20) == 0
    assert np.isfinite(open_store(tmp_path / "umap.zarr").obsm["X_umap"]).all()
    # as a plain command: scripts/umap.py must not shadow umap-learn
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "scripts" / "umap.py"
    subprocess.run([sys.executable, str(script), "--input", str(tmp_path / "nb.zarr"), "--output",
                    str(tmp_path / "tsw.zarr"), "--maxiter", "20", "--init-pos", "random", "--n-workers", "1"],
                   check=True, capture_output=True)
    assert np.isfinite(open_store(tmp_path / "tsw.zarr").obsm["X_umap"]).all()


KNN_IN_A_NEW_PROCESS = """
import hashlib, sys
import numpy as np
from numba.core.dispatcher import Dispatcher
from atlasflow.tl._jit_cache import import_with_cache
if sys.argv[1] == "search":
    from atlasflow.tl.neighbors import knn
    x = np.random.default_rng(0).normal(size=(3000, 20)).astype(np.float32)
    ind, dist, _ = knn(x, 15, knn_method="pynndescent", random_state=0)  # imports pynndescent
    digest = hashlib.sha1(ind.tobytes() + dist.tobytes()).hexdigest()
else:  # only import pynndescent as knn does: which kernels would be cached, without compiling them
    import_with_cache()
    digest = "-"
import pynndescent.pynndescent_ as p
kernels = [v for v in vars(p).values() if isinstance(v, Dispatcher) and v.py_func.__module__ == p.__name__]
cached = sum(type(k._cache).__name__ != "NullCache" for k in kernels)
print(digest, cached, len(kernels))
"""


@pytest.mark.slow  # two processes compile (or load) pynndescent's kernels: ~1 min
def test_numba_cache_loads_the_same_kernels(tmp_path):
    """pynndescent's kernels cached on disk (tl._jit_cache) give the graph of freshly compiled ones;
    ATLASFLOW_NUMBA_CACHE=0 leaves pynndescent's own few cached kernels only."""
    import subprocess
    import sys

    def run(cache: str, what: str = "search"):
        env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"), ATLASFLOW_NUMBA_CACHE=cache)
        out = subprocess.run([sys.executable, "-c", KNN_IN_A_NEW_PROCESS, what], env=env, capture_output=True,
                             text=True, check=True).stdout.split()
        return out[0], int(out[1]), int(out[2])

    _, n_plain, total = run("0", "import")
    assert n_plain <= 2  # pynndescent itself caches few of its kernels (1 of 16 in 0.5.13)
    _, n_cached, _ = run("1", "import")
    assert n_cached >= total / 2 and n_cached > n_plain
    imported = len(list((tmp_path / "numba").rglob("*.nbc")))  # eagerly compiled kernels, if any
    first, _, _ = run("1")  # compiles what the search calls and stores it
    assert len(list((tmp_path / "numba").rglob("*.nbc"))) > imported
    second, _, _ = run("1")  # loads
    assert first == second


# --------------------------------------------------------------------------------------------------
# clustering


def test_leiden_matches_scanpy(stores, reference):
    ours = open_store(stores["leiden"])
    labels, ref = ours.obs["leiden"], reference.obs["leiden"]
    # scanpy's labels, names included (not only the partition): the same cells get the same cluster name
    np.testing.assert_array_equal(labels.astype(str).to_numpy(), ref.astype(str).to_numpy())
    assert list(labels.cat.categories) == list(ref.cat.categories)
    assert ours.uns["leiden"]["params"] == {"resolution": RESOLUTION, "random_state": 0, "n_iterations": 2}
    # one column per listed resolution; the one equal to the default gives the same labels
    assert (ours.obs["leiden_r1.0"] == labels).all()
    assert 2 <= ours.obs["leiden_r0.5"].cat.categories.size <= labels.cat.categories.size
    assert ours.uns["leiden_r0.5"]["params"]["resolution"] == 0.5


@pytest.mark.filterwarnings("ignore:In the future, the default backend for leiden:FutureWarning")
def test_leidenalg_and_louvain_match_scanpy(stores):
    import scanpy as sc

    g = open_store(stores["neighbors"])
    g.X = None
    ref, ours = g.copy(), g.copy()
    sc.tl.leiden(ref, resolution=0.8, flavor="leidenalg", n_iterations=2, key_added="la", random_state=3)
    cluster.leiden(ours, 0.8, flavor="leidenalg", key_added="la", random_state=3)
    pd.testing.assert_series_equal(ours.obs["la"], ref.obs["la"])  # leidenalg numbers by size as we do
    with cluster.igraph_seeded(0):  # scanpy's igraph Louvain is unseeded: seed it as we do
        sc.tl.louvain(ref, flavor="igraph")
    cluster.louvain(ours)
    pd.testing.assert_series_equal(ours.obs["louvain"], ref.obs["louvain"])  # names too
    assert ours.uns["louvain"]["params"] == {"resolution": None, "random_state": 0}


def test_sort_by_size_renames_by_decreasing_size(stores, reference):
    ours = open_store(stores["neighbors"])
    ours.X = None
    cluster.leiden(ours, RESOLUTION, sort_by_size=True)
    labels = ours.obs["leiden"]
    assert adjusted_rand_score(reference.obs["leiden"], labels) == 1.0  # same partition
    sizes = labels.value_counts(sort=False)
    assert list(labels.cat.categories) == [str(i) for i in range(len(sizes))]
    assert (np.diff(sizes.to_numpy()) <= 0).all()


def test_restrict_to_matches_scanpy(stores):
    import scanpy as sc

    ours = open_store(stores["leiden"])
    ours.X = None
    ref = ours.copy()
    sc.tl.leiden(ref, 0.5, restrict_to=("leiden", ["0", "2"]), flavor="igraph", n_iterations=2, directed=False)
    cluster.leiden(ours, 0.5, restrict_to=("leiden", ["0", "2"]))
    pd.testing.assert_series_equal(ours.obs["leiden_R"], ref.obs["leiden_R"])  # names too
    untouched = ~ours.obs["leiden"].isin(["0", "2"])
    assert (ours.obs["leiden_R"][untouched].astype(str) == ours.obs["leiden"][untouched].astype(str)).all()
    assert ours.obs["leiden_R"][~untouched].astype(str).str.startswith("0-2,").all()


def test_leiden_stage_links_the_elements_it_skipped_or_dropped(stores):
    """The stage reads only the graph it clusters and drops it once igraph holds it: its output links the
    input's obsm and obsp (the same files), and the labels are scanpy's (test_leiden_matches_scanpy)."""
    import os

    def inode(path):
        return os.stat(next(p for p in sorted(path.rglob("*")) if p.is_file() and p.name != "zarr.json")).st_ino

    for key in ("obsm/X_pca", "obsp/connectivities", "obsp/distances"):
        assert inode(stores["leiden"] / key) == inode(stores["neighbors"] / key), key


def test_keep_graph_false_frees_the_graph_and_keeps_the_labels(stores):
    g = open_store(stores["neighbors"])
    g.X = None
    for method, extra in ((cluster.leiden, {"resolutions": [0.5]}), (cluster.louvain, {"resolutions": [0.5]})):
        kept, dropped = g.copy(), g.copy()
        method(kept, 1.0, **extra)
        method(dropped, 1.0, keep_graph=False, **extra)
        assert "connectivities" in kept.obsp and "connectivities" not in dropped.obsp
        pd.testing.assert_frame_equal(dropped.obs, kept.obs)


def test_one_edge_per_pair_gives_scanpys_leiden(stores, reference, tmp_path, caplog):
    """igraph_edges='once' (the default from 300k cells) clusters half the edges into scanpy's labels, names
    included, at two resolutions and restricted; the stage takes the option and records it."""
    g = open_store(stores["neighbors"])
    g.X = None
    conns = sp.csr_matrix(g.obsp["connectivities"])
    graph, weights = cluster.igraph_from_adjacency(conns, once=True)
    assert conns.diagonal().sum() == 0 and graph.ecount() * 2 == conns.nnz  # one edge per pair
    np.testing.assert_allclose(weights.sum(), conns.sum())  # 2 w per pair: the two edges' weight
    both, once = g.copy(), g.copy()
    with caplog.at_level("INFO", logger="atlasflow.tl.cluster"):
        cluster.leiden(once, RESOLUTION, resolutions=[0.5], igraph_edges="once")
    assert "one edge per pair of cells" in caplog.text
    cluster.leiden(both, RESOLUTION, resolutions=[0.5], igraph_edges="both")
    np.testing.assert_array_equal(once.obs["leiden"].astype(str), reference.obs["leiden"].astype(str))
    pd.testing.assert_frame_equal(once.obs, both.obs)
    for adata, edges in ((both, "both"), (once, "once")):
        cluster.leiden(adata, 0.5, restrict_to=("leiden", ["0", "2"]), igraph_edges=edges)
    pd.testing.assert_series_equal(once.obs["leiden_R"], both.obs["leiden_R"])
    out = tmp_path / "once.zarr"
    assert _run(leiden_stage, "--input", stores["neighbors"], "--output", out, "--igraph-edges", "once") == 0
    labels = open_store(out).obs["leiden"]
    pd.testing.assert_series_equal(labels, open_store(stores["leiden"]).obs["leiden"])
    import zarr

    assert zarr.open_group(out, mode="r").attrs["atlasflow"]["provenance"]["igraph_edges"] == "once"


def test_one_edge_per_pair_only_where_it_is_the_same_graph(stores, monkeypatch, caplog):
    """'auto' switches at EDGES_ONCE_MIN_CELLS; a graph that is not symmetric keeps both edges (logged); a
    diagonal entry stays one edge of weight w; leidenalg and unknown values are refused."""
    g = open_store(stores["neighbors"])
    g.X = None
    with caplog.at_level("INFO", logger="atlasflow.tl.cluster"):
        cluster.leiden(g.copy(), RESOLUTION)
        assert "one edge per pair" not in caplog.text  # 2,638 cells: scanpy's graph
        monkeypatch.setattr(cluster, "EDGES_ONCE_MIN_CELLS", g.n_obs)
        cluster.leiden(g.copy(), RESOLUTION)
        assert "one edge per pair" in caplog.text
        caplog.clear()
        skewed = g.copy()
        conns = sp.csr_matrix(skewed.obsp["connectivities"])
        skewed.obsp["connectivities"] = sp.csr_matrix(sp.triu(conns) + 0.5 * sp.tril(conns))
        labels = {e: cluster.leiden(skewed, RESOLUTION, igraph_edges=e, copy=True).obs["leiden"]
                  for e in ("both", "once")}
        assert "not symmetric: igraph gets both edges" in caplog.text
        pd.testing.assert_series_equal(labels["once"], labels["both"])
    loop = sp.csr_matrix(np.array([[0.5, 1, 0], [1, 0, 0.25], [0, 0.25, 0]]))
    graph, weights = cluster.igraph_from_adjacency(loop, once=True)
    assert graph.get_edgelist() == [(0, 0), (0, 1), (1, 2)]
    np.testing.assert_array_equal(weights, [0.5, 2, 0.5])
    assert not cluster.is_symmetric(sp.csr_matrix(np.array([[0, 1], [0, 0]])))
    with pytest.raises(ConfigError, match="igraph_edges='once' is for flavor='igraph'"):
        cluster.leiden(g.copy(), flavor="leidenalg", igraph_edges="once")
    with pytest.raises(ConfigError, match="igraph_edges must be one of auto, both, once"):
        cluster.leiden(g.copy(), igraph_edges="half")


def test_clustering_is_reproducible(stores):
    g = open_store(stores["neighbors"])
    g.X = None
    runs = [cluster.leiden(g, 1.0, copy=True).obs["leiden"] for _ in range(2)]
    runs += [cluster.louvain(g, 1.0, copy=True).obs["louvain"] for _ in range(2)]
    pd.testing.assert_series_equal(runs[0], runs[1])
    pd.testing.assert_series_equal(runs[2], runs[3])
    assert not cluster.leiden(g, 1.0, random_state=1, copy=True).obs["leiden"].isna().any()


def test_biology_agrees_with_seurat_and_markers(stores, scanpy_pbmc3k):
    ours = open_store(stores["leiden"])
    labels = ours.obs["leiden"]
    ann = pd.read_csv(Path(__file__).resolve().parents[1].parent / "shared/data/pbmc3k/seurat_annotations.tsv",
                      sep="\t", index_col=0).iloc[:, 0].reindex(ours.obs_names)
    assert ann.notna().all()
    ari = adjusted_rand_score(ann, labels)
    print(f"ARI(leiden r={RESOLUTION}, Seurat annotations) = {ari:.3f}, {labels.cat.categories.size} clusters")
    assert ari >= 0.6
    majority = pd.crosstab(labels.to_numpy(), ann.to_numpy()).idxmax(axis=1)
    lg = scanpy_pbmc3k["log1p"]
    assert (lg.obs_names == ours.obs_names).all()
    means = pd.DataFrame(lg[:, list(MARKERS)].X.toarray(), columns=list(MARKERS)).groupby(
        labels.to_numpy(), observed=True).mean()
    for gene, expected in MARKERS.items():
        col = means[gene].sort_values(ascending=False)
        assert col.iloc[0] > col.iloc[1] * 1.05, f"{gene}: no single top cluster ({col.head(2).to_dict()})"
        assert majority[col.index[0]] in expected, f"{gene}: top cluster {col.index[0]} is {majority[col.index[0]]}"


# --------------------------------------------------------------------------------------------------
# umap


def test_umap_matches_scanpy(stores, reference):
    import scanpy as sc

    ours = open_store(stores["umap"])
    emb = np.asarray(ours.obsm["X_umap"])
    assert emb.shape == (2638, 2) and emb.dtype == np.float32
    ref = reference.copy()
    sc.tl.umap(ref)  # scanpy end to end: its own graph (bit-identical to ours), same seed
    assert ours.uns["umap"]["params"] == ref.uns["umap"]["params"]
    np.testing.assert_array_equal(emb, ref.obsm["X_umap"])


def test_umap_is_deterministic(tiny_store):
    from atlasflow.tl.umap import umap

    g = open_store(tiny_store.parent / "neighbors.zarr")
    g.X = None
    a = umap(g, maxiter=50, copy=True).obsm["X_umap"]
    b = umap(g, maxiter=50, copy=True).obsm["X_umap"]
    c = umap(g, maxiter=50, random_state=7, copy=True)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c.obsm["X_umap"]) and c.uns["umap"]["params"]["random_state"] == 7


# --------------------------------------------------------------------------------------------------
# bad input: one line naming the parameter, exit 1, nothing written


def _fails(capsys, stage, store, out, *args, expect: str, code: int = 1):
    """code 2: refused while parsing the command line (a bad number), 1: by the stage."""
    rc = _run(stage, "--input", store, "--output", out, *args)
    err = capsys.readouterr().err.strip().splitlines()
    name = stage.__name__.rsplit(".", 1)[-1]
    assert rc == code
    assert err and err[-1].startswith(f"atlasflow {name}: error:"), err
    assert expect in err[-1], err[-1]
    assert not Path(out).exists() and not Path(out).with_suffix(".json").exists()
    return err[-1]


def test_bad_neighbors_inputs(tiny_store, tmp_path, capsys):
    out = tmp_path / "out.zarr"
    _fails(capsys, neighbors_stage, tiny_store, out, "--n-neighbors", 60, expect="n_neighbors")
    _fails(capsys, neighbors_stage, tiny_store, out, "--n-neighbors", 1, expect="n_neighbors", code=2)
    _fails(capsys, neighbors_stage, tiny_store, out, "--n-pcs", 9, expect="n_pcs")
    _fails(capsys, neighbors_stage, tiny_store, out, "--use-rep", "X_scvi", expect="use_rep")
    bare = tmp_path / "bare.zarr"
    g = open_store(tiny_store)
    _store(bare, g.X.compute(), g.obs, g.var)
    msg = _fails(capsys, neighbors_stage, bare, out, expect="X_pca")
    assert "pca stage" in msg


def test_bad_cluster_and_umap_inputs(tiny_store, tmp_path, capsys):
    graph, out = tiny_store.parent / "neighbors.zarr", tmp_path / "out.zarr"
    _fails(capsys, leiden_stage, graph, out, "--resolution", 0, expect="resolution", code=2)
    _fails(capsys, leiden_stage, graph, out, "--resolutions", 0.5, -1, expect="resolutions", code=2)
    _fails(capsys, louvain_stage, graph, out, "--resolution", -0.1, expect="resolution", code=2)
    _fails(capsys, leiden_stage, graph, out, "--restrict-to", '["nope", ["a"]]', expect="restrict_to")
    _fails(capsys, leiden_stage, graph, out, "--restrict-to", '["group", ["z"]]', expect="restrict_to")
    _fails(capsys, louvain_stage, graph, out, "--restrict-to", '["group", ["z"]]', expect="restrict_to")
    for stage in (leiden_stage, louvain_stage, umap_stage):  # a store without a graph
        msg = _fails(capsys, stage, tiny_store, out, expect="neighbors")
        assert "neighbors stage" in msg
    _fails(capsys, umap_stage, graph, out, "--init-pos", "paga", expect="init_pos")
    _fails(capsys, leiden_stage, graph, out, "--directed", "true", expect="directed")
    try:
        import louvain  # noqa: F401
    except ImportError:
        _fails(capsys, louvain_stage, graph, out, "--flavor", "vtraag", expect="louvain package")
    # restrict_to that exists works, and only re-labels those cells
    assert _run(leiden_stage, "--input", graph, "--output", out, "--restrict-to", '["group", ["a", "b"]]') == 0
    lab = open_store(out).obs["leiden_R"].astype(str)
    assert (lab[:40].str.startswith("a-b,")).all() and (lab[40:] == "c").all()


@pytest.mark.parametrize(("stage", "args", "expect"), [
    (neighbors_stage, ["--metric", "foo"], "metric: 'foo' is not one of euclidean, sqeuclidean, cosine"),
    (neighbors_stage, ["--n-jobs", "0"], "n_jobs: must be an integer >= -1 other than 0 (or none), not '0'"),
    (leiden_stage, ["--resolution", "nan"], "resolution: must be a finite number, not 'nan'"),
    (leiden_stage, ["--n-iterations", "0"], "n_iterations: must be an integer >= -1 other than 0, not '0'"),
    (umap_stage, ["--spread", "0"], "spread: must be a number > 0, not '0'"),
], ids=["metric", "n_jobs0", "resolution_nan", "n_iterations0", "spread0"])
def test_bad_value_by_hand_is_one_line(tiny_store, tmp_path, capsys, stage, args, expect):
    """Refused while parsing the command line with one line (not argparse's usage), before anything runs."""
    graph, out = tiny_store.parent / "neighbors.zarr", tmp_path / "out.zarr"
    rc = _run(stage, "--input", graph, "--output", out, *args)
    err = capsys.readouterr().err.strip().splitlines()
    name = stage.__name__.rsplit(".", 1)[-1]
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"atlasflow {name}: error: {expect}"), err
    assert not out.exists()


def test_unknown_metric_from_snakemake_is_one_line(tiny_store, tmp_path, capsys):
    """neighbors.metric: foo as a Snakemake param (not parsed) used to end in two tracebacks; now one line."""
    from test_preprocess import FakeSnakemake

    out = tmp_path / "out.zarr"
    rc = stage_main(neighbors_stage, snakemake=FakeSnakemake(neighbors_stage, tiny_store, out, metric="foo"))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and err[-1].startswith("atlasflow neighbors: error: metric: 'foo' is not one of euclidean"), err
    assert not any("Traceback" in line for line in err)
    assert not out.exists()
    with pytest.raises(ConfigError, match="metric: 'foo' is not one of"):
        knn(np.zeros((10, 2), np.float32), 3, metric="foo")


def test_louvain_stage_resolutions(tiny_store, tmp_path):
    import json

    graph, out = tiny_store.parent / "neighbors.zarr", tmp_path / "louvain.zarr"
    assert _run(louvain_stage, "--input", graph, "--output", out, "--resolutions", 0.5, 2) == 0
    got = ad.read_zarr(out)  # plain anndata opens it
    assert {"louvain", "louvain_r0.5", "louvain_r2.0"} <= set(got.obs.columns)
    assert got.uns["louvain_r2.0"]["params"]["resolution"] == 2.0
    summary = json.loads(out.with_suffix(".json").read_text())
    assert set(summary["clusters"]) == {"louvain", "louvain_r0.5", "louvain_r2.0"}
    assert sum(summary["cluster_sizes"]["louvain"].values()) == 60
