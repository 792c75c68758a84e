"""Where the graph stages run with ``backend: gpu``, and the glue to cuML / cuGraph, without a GPU.

The engines themselves run in tests/gpu. Here, on the CPU: the choice of search (``choose_knn_method``),
the one log line that says where each step ran, the one-line error when no GPU is there, and our code
around cuML's and cuGraph's documented calls, driven through stand-ins with the same contract (cuML's
``NearestNeighbors`` returns (distances, indices) with each point first among its own neighbours;
cuGraph returns (vertex, partition) rows in its own order and leaves out vertices without edges).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import types

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

from atlasflow import gpu
from atlasflow.tl import _gpu, leiden, louvain, neighbors, umap
from atlasflow.tl.neighbors import choose_knn_method


def _embedding(n=400, d=8, seed=0):
    rng = np.random.default_rng(seed)
    centers = rng.normal(0, 5, (4, d))
    return (centers[rng.integers(0, 4, n)] + rng.normal(0, 1, (n, d))).astype(np.float32)


@pytest.fixture
def graph_adata():
    a = ad.AnnData(obs=pd.DataFrame(index=[f"c{i}" for i in range(400)]))
    a.obsm["X_pca"] = _embedding()
    neighbors(a, 15)
    return a


@pytest.fixture
def pretend_gpu(monkeypatch):
    """The graph functions believe ``backend='gpu'`` resolved to a GPU (nothing here can use one)."""
    monkeypatch.setattr(_gpu, "resolve_backend", lambda backend: "gpu" if backend == "gpu" else "cpu")


def test_importing_the_graph_stages_does_not_import_cuml_cugraph_or_cudf(tmp_path):
    """Stand-in packages named cuml, cugraph and cudf that leave a mark when imported: a CPU run of the graph
    stages (and their choice of engine) must not import them. (CuPy is left out: dask.array itself imports it
    wherever it is installed.)"""
    for name in ("cuml", "cugraph", "cudf"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"open({str(tmp_path / (name + '.imported'))!r}, 'w').close()\n")
    code = ("import atlasflow.tl, atlasflow.tl._gpu as g, atlasflow.stages.neighbors, atlasflow.stages.leiden, "
            "atlasflow.stages.louvain, atlasflow.stages.umap; g.knn_supported('euclidean'); g.resolve_backend('cpu')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=tmp_path)
    assert not list(tmp_path.glob("*.imported"))
    subprocess.run([sys.executable, "-c", "import cuml"], check=True, env=env, cwd=tmp_path)  # the marks work
    assert (tmp_path / "cuml.imported").exists()


# ------------------------------------------------------------------------------------- choice of search


@pytest.mark.parametrize("n, metric, method, kwds, expected", [
    (1000, "euclidean", "auto", None, "gpu"),
    (500_000, "euclidean", "auto", None, "gpu"),  # exact at any size: the GPU's GEMM is fast
    (1000, "cosine", "exact", None, "gpu"),
    (500_000, "euclidean", "pynndescent", None, "pynndescent"),  # asked for: stays on the CPU
    (1000, "manhattan", "auto", None, "exact"),  # not a GPU metric: scanpy's CPU rule
    (500_000, "manhattan", "auto", None, "pynndescent"),
    (1000, "euclidean", "auto", {"p": 3}, "exact"),
])
def test_gpu_search_choice(n, metric, method, kwds, expected):
    assert choose_knn_method(n, metric, method, backend="gpu", metric_kwds=kwds) == expected
    assert choose_knn_method(n, metric, method) != "gpu"  # the CPU never picks it


def test_cpu_search_with_the_gpu_backend_is_logged_once(graph_adata, pretend_gpu, caplog):
    with caplog.at_level(logging.INFO, logger="atlasflow"):
        neighbors(graph_adata, 10, metric="manhattan", backend="gpu")
        neighbors(graph_adata, 10, knn_method="pynndescent", backend="gpu", key_added="nnd")
    lines = [r.getMessage() for r in caplog.records if "search on the CPU" in r.getMessage()]
    assert lines == ["neighbors: exact search on the CPU (metric 'manhattan' is not one of the GPU's)",
                     "neighbors: pynndescent search on the CPU (asked for)"], lines


def test_gpu_backend_without_a_gpu_is_one_line(monkeypatch, graph_adata):
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(gpu.GpuUnavailableError, match="backend gpu needs CuPy") as err:
        neighbors(graph_adata, 10, backend="gpu")
    assert "\n" not in str(err.value)


def test_neighbors_stage_with_gpu_backend_fails_cleanly_without_a_gpu(tmp_path, graph_adata):
    """The stage script, as the workflow runs it: exit 1, one line on stderr, no output store."""
    from atlasflow.store import write_store

    src = tmp_path / "pca.zarr"
    write_store(graph_adata, src)
    out = tmp_path / "neighbors.zarr"
    code = "import sys; sys.modules['cupy'] = None; from atlasflow.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run([sys.executable, "-c", code, "neighbors", "--input", str(src), "--output", str(out),
                           "--backend", "gpu"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("atlasflow neighbors: error:") and "CuPy" in last, proc.stderr
    assert not out.exists()


# ---------------------------------------------------------------------------------------- cuML's kNN


class _FakeNearestNeighbors:
    """cuML's contract on host input: fit(X); kneighbors(X) -> (distances, indices), self included, ties in
    any order (reversed here, to check that the glue orders them)."""

    def __init__(self, *, n_neighbors, algorithm, metric, output_type):
        assert algorithm == "brute" and output_type == "numpy"
        self.k, self.metric = n_neighbors, metric

    def fit(self, x):
        self.x = np.asarray(x)
        return self

    def kneighbors(self, x):
        from sklearn.neighbors import NearestNeighbors

        d, i = NearestNeighbors(n_neighbors=self.k, algorithm="brute", metric=self.metric).fit(self.x).kneighbors(x)
        return d.astype(np.float32)[:, ::-1].copy(), i[:, ::-1].copy()


@pytest.fixture
def fake_cuml(monkeypatch):
    cuml = types.ModuleType("cuml")
    nbrs = types.ModuleType("cuml.neighbors")
    nbrs.NearestNeighbors = _FakeNearestNeighbors
    cuml.neighbors = nbrs
    monkeypatch.setitem(sys.modules, "cuml", cuml)
    monkeypatch.setitem(sys.modules, "cuml.neighbors", nbrs)
    monkeypatch.setattr(gpu, "cuml_available", lambda: True)


@pytest.mark.parametrize("metric", ["euclidean", "cosine"])
def test_cuml_knn_glue_gives_the_exact_cpu_graph(fake_cuml, pretend_gpu, metric, caplog):
    x = _embedding()
    cpu = ad.AnnData(obs=pd.DataFrame(index=[f"c{i}" for i in range(x.shape[0])]), obsm={"X_pca": x})
    on_gpu = cpu.copy()
    neighbors(cpu, 15, knn_method="exact", metric=metric)
    with caplog.at_level(logging.INFO, logger="atlasflow"):
        neighbors(on_gpu, 15, metric=metric, backend="gpu")
    assert any("on the GPU (cuML brute force)" in r.getMessage() for r in caplog.records)
    d_cpu, d_gpu = cpu.obsp["distances"], on_gpu.obsp["distances"]
    assert d_gpu.dtype == d_cpu.dtype  # scikit-learn's: float64 for euclidean, float32 for cosine
    np.testing.assert_array_equal(d_gpu.indices, d_cpu.indices)
    np.testing.assert_allclose(d_gpu.data, d_cpu.data, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(on_gpu.obsp["connectivities"].toarray(), cpu.obsp["connectivities"].toarray(),
                               rtol=1e-4, atol=1e-6)


# -------------------------------------------------------------------------------------- cuGraph's Leiden


class _FakeFrame:
    def __init__(self, columns: dict):
        self._df = pd.DataFrame(columns)

    def __getitem__(self, key):
        return self._df[key]

    def to_pandas(self):
        return self._df


class _FakeGraph:
    def __init__(self, directed=False):
        assert directed is False

    def from_cudf_edgelist(self, frame, *, source, destination, weight, renumber):
        df = frame.to_pandas()
        self.edges = (df[source].to_numpy(), df[destination].to_numpy(), df[weight].to_numpy())


def _fake_partition(algorithm):
    """igraph on the edges, answered as cuGraph does: only vertices with edges, in a shuffled order."""

    def run(g, *, resolution, **kw):
        import igraph as ig

        src, dst, w = g.edges
        present = np.unique(np.concatenate([src, dst]))
        remap = {v: i for i, v in enumerate(present)}
        h = ig.Graph(n=present.size, edges=[(remap[a], remap[b]) for a, b in zip(src, dst, strict=True) if a < b])
        h.es["weight"] = [float(x) for a, b, x in zip(src, dst, w, strict=True) if a < b]
        run.calls.append((algorithm, resolution, kw))
        member = h.community_multilevel(weights="weight", resolution=resolution).membership
        order = np.random.default_rng(1).permutation(present.size)
        return _FakeFrame({"vertex": present[order], "partition": np.asarray(member)[order]}), 0.5

    run.calls = []
    return run


@pytest.fixture
def fake_cugraph(monkeypatch):
    cudf = types.ModuleType("cudf")
    cudf.DataFrame = _FakeFrame
    cugraph = types.ModuleType("cugraph")
    cugraph.Graph = _FakeGraph
    cugraph.leiden = _fake_partition("leiden")
    cugraph.louvain = _fake_partition("louvain")
    monkeypatch.setitem(sys.modules, "cudf", cudf)
    monkeypatch.setitem(sys.modules, "cugraph", cugraph)
    monkeypatch.setattr(gpu, "cugraph_available", lambda: True)
    return cugraph


def test_cugraph_glue_puts_labels_in_vertex_order_and_keeps_lonely_cells(fake_cugraph):
    """Two cliques and one cell with no edge: labels follow the vertices, the lonely cell gets its own."""
    block = np.ones((4, 4)) - np.eye(4)
    adj = sp.csr_matrix(sp.block_diag([block, block, np.zeros((1, 1))]))
    member = _gpu.cugraph_partition(adj, "leiden", resolution=1.0, random_state=0, use_weights=True)
    assert member.shape == (9,)
    assert len(set(member[:4])) == 1 and len(set(member[4:8])) == 1 and member[0] != member[4]
    assert member[8] not in member[:8]
    assert fake_cugraph.leiden.calls == [("leiden", 1.0, {"max_iter": 100, "random_state": 0})]
    alone = _gpu.cugraph_partition(sp.csr_matrix((3, 3)), "leiden", resolution=1.0, random_state=0, use_weights=True)
    np.testing.assert_array_equal(alone, [0, 1, 2])  # no edge at all: cuGraph is not asked
    assert len(fake_cugraph.leiden.calls) == 1


def test_leiden_and_louvain_on_cugraph(graph_adata, fake_cugraph, pretend_gpu, caplog):
    with caplog.at_level(logging.INFO, logger="atlasflow"):
        leiden(graph_adata, 0.5, backend="gpu")
        leiden(graph_adata, 0.5, backend="gpu", n_iterations=-1, key_added="stable")
        louvain(graph_adata, backend="gpu")
        leiden(graph_adata, 0.5, backend="gpu", sort_by_size=True, key_added="by_size")
    assert sum("cuGraph on the GPU" in r.getMessage() for r in caplog.records) == 4
    # igraph's n_iterations (2 passes by default) is not cuGraph's max_iter (levels): cuGraph's own cap, always
    assert [c[2]["max_iter"] for c in fake_cugraph.leiden.calls] == [100, 100, 100]
    assert fake_cugraph.louvain.calls[0][2] == {"max_level": 100}
    for key in ("leiden", "louvain"):  # named by cuGraph's partition ids, as the CPU keeps igraph's
        labels = graph_adata.obs[key]
        assert list(labels.cat.categories) == [str(i) for i in range(labels.cat.categories.size)]
        assert graph_adata.uns[key]["params"]["resolution"] == (0.5 if key == "leiden" else None)
    by_size = graph_adata.obs["by_size"]
    pairs = pd.crosstab(graph_adata.obs["leiden"], by_size) > 0  # same partition, renamed: one-to-one
    assert (pairs.sum(axis=0) == 1).all() and (pairs.sum(axis=1) == 1).all()
    assert list(by_size.cat.categories) == [str(i) for i in range(by_size.cat.categories.size)]
    assert (np.diff(by_size.value_counts(sort=False).to_numpy()) <= 0).all()  # '0' the largest


def test_without_cugraph_clustering_runs_on_the_cpu_and_says_so(graph_adata, pretend_gpu, monkeypatch, caplog):
    monkeypatch.setattr(gpu, "cugraph_available", lambda: False)
    ref = graph_adata.copy()
    leiden(ref, 1.0)
    with caplog.at_level(logging.INFO, logger="atlasflow"):
        leiden(graph_adata, 1.0, backend="gpu")
        leiden(graph_adata, 1.0, backend="gpu", flavor="leidenalg", key_added="alg")
    messages = [r.getMessage() for r in caplog.records]
    assert any("leiden: on the CPU (igraph; cuGraph is not installed)" in m for m in messages), messages
    assert any("flavor 'leidenalg' runs on the CPU" in m for m in messages), messages
    pd.testing.assert_series_equal(graph_adata.obs["leiden"], ref.obs["leiden"])


@pytest.fixture
def fake_cuml_umap(monkeypatch):
    """cuML's ``simplicial_set_embedding`` contract (its layout follows the type of ``data``), recording its
    keyword arguments; the layout is umap-learn's on the same graph. CuPy stands in as NumPy."""
    calls = []

    def simplicial_set_embedding(data, graph, **kw):
        from sklearn.utils import check_random_state
        from umap.umap_ import simplicial_set_embedding as cpu

        calls.append({"data": data, "graph": graph.copy(), **kw})  # umap-learn below edits the graph in place
        emb, _ = cpu(data=data, graph=graph.tocoo(), random_state=check_random_state(kw.pop("random_state")),
                     densmap=False, densmap_kwds={}, output_dens=False, metric_kwds={}, **kw)
        return emb

    cupy = types.ModuleType("cupy")
    cupy.asarray, cupy.float32 = np.asarray, np.float32
    cupy.ndarray = type("ndarray", (), {})  # scipy >= 1.17 asks any loaded cupy for its array type
    mod = types.ModuleType("cuml.manifold.umap")
    mod.simplicial_set_embedding = simplicial_set_embedding
    for name, m in {"cupy": cupy, "cuml": types.ModuleType("cuml"), "cuml.manifold": types.ModuleType("x"),
                    "cuml.manifold.umap": mod}.items():
        monkeypatch.setitem(sys.modules, name, m)
    monkeypatch.setattr(gpu, "cuml_available", lambda: True)
    return calls


def test_umap_glue_hands_cuml_the_graph_and_parameters(graph_adata, pretend_gpu, fake_cuml_umap, caplog):
    ref = graph_adata.copy()
    umap(ref, maxiter=30, random_state=3)
    with caplog.at_level(logging.INFO, logger="atlasflow"):
        umap(graph_adata, maxiter=30, random_state=3, backend="gpu")
        umap(graph_adata, maxiter=30, random_state=None, init_pos="random", key_added="unseeded", backend="gpu")
        umap(graph_adata, maxiter=0, backend="gpu", key_added="no_epochs")  # cuML reads 0 as 'choose'
    assert sum("layout on the GPU (cuML)" in r.getMessage() for r in caplog.records) == 2
    assert any("umap-learn; no epochs asked" in r.getMessage() for r in caplog.records)
    first, second = fake_cuml_umap
    assert first["n_epochs"] == 30 and first["random_state"] == 3 and first["init"] == "spectral"
    assert second["random_state"] is None and second["init"] == "random"
    assert (first["a"], first["b"]) == (ref.uns["umap"]["params"]["a"], ref.uns["umap"]["params"]["b"])
    assert (first["graph"] != graph_adata.obsp["connectivities"]).nnz == 0  # the neighbors graph, untouched
    emb = graph_adata.obsm["X_umap"]
    assert emb.dtype == np.float32 and emb.shape == (graph_adata.n_obs, 2)
    np.testing.assert_allclose(emb, ref.obsm["X_umap"], rtol=1e-5, atol=1e-4)


def test_umap_without_cuml_runs_umap_learn_and_says_so(graph_adata, pretend_gpu, monkeypatch, caplog):
    monkeypatch.setattr(gpu, "cuml_available", lambda: False)
    ref = graph_adata.copy()
    umap(ref, maxiter=20)
    with caplog.at_level(logging.INFO, logger="atlasflow"):
        umap(graph_adata, maxiter=20, backend="gpu")
    assert any("umap: layout on the CPU (umap-learn; cuML is not installed)" in r.getMessage() for r in caplog.records)
    np.testing.assert_array_equal(graph_adata.obsm["X_umap"], ref.obsm["X_umap"])
