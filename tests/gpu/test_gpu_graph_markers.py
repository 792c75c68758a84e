"""The stages after PCA on the GPU against the CPU: neighbors, Leiden/Louvain, UMAP, rank_genes_groups, aggregate,
and score_genes.

Markers and pseudobulk read X on the GPU (every block a cupyx CSR matrix, checked by spying on the kernel
that receives the blocks: a GPU test must never pass by running on the CPU) and must give the CPU's
numbers. The graph stages hand their in-memory embedding to the GPU: the kNN search is exact on both
(the same graph up to float rounding); Leiden/Louvain and UMAP run on cuGraph / cuML where installed
(then compared for agreement, not bit for bit), else on the CPU, which the log line says.

Needs no scanpy and no ../shared data (simulated cells), so it runs on a bare GPU machine. Uses Dask's
threaded scheduler (the spies see the blocks in this process); tests/gpu/test_gpu_stages.py covers the
clusters.
"""

from __future__ import annotations

import logging

import dask
import numpy as np
import pandas as pd
import pytest

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")

from atlasflow import gpu, kernels, pp, store, tl  # noqa: E402
from atlasflow.store import open_store, write_store  # noqa: E402

N_CELLS, N_GENES, CHUNK_ROWS = 3000, 1500, 700


@pytest.fixture(scope="module")
def lognorm_store(tmp_path_factory):
    """Simulated counts, normalised and log-transformed on the CPU, with obs['cell_type'] (4 types)."""
    from atlasflow.simulate import SimParams, write_simulated

    tmp = tmp_path_factory.mktemp("gpu_markers")
    write_simulated(tmp / "raw.zarr", SimParams(n_cells=N_CELLS, n_genes=N_GENES, n_cell_types=4, seed=3,
                                                median_counts=2000, frac_damaged=0, frac_empty=0,
                                                frac_doublets=0), chunk_rows=CHUNK_ROWS)
    with dask.config.set(scheduler="threads"):
        a = open_store(tmp / "raw.zarr", backend="cpu")
        pp.normalize_total(a, target_sum=1e4)
        pp.log1p(a)
        write_store(a, tmp / "log1p.zarr", chunk_rows=CHUNK_ROWS)
    return tmp / "log1p.zarr"


@pytest.fixture
def threads():
    with dask.config.set(scheduler="threads"):
        yield


def open_on(path, backend):
    return open_store(path, backend=backend)


def spy_blocks(monkeypatch, name: str) -> list[str]:
    """Record the module of the first argument (a block of X) of every call of ``kernels.<name>``."""
    seen: list[str] = []
    real = getattr(kernels, name)

    def spy(block, *args, **kw):
        seen.append(type(block).__module__)
        return real(block, *args, **kw)

    monkeypatch.setattr(kernels, name, spy)
    return seen


def assert_gpu_blocks(seen: list[str], what: str) -> None:
    assert seen, f"{what}: the kernel saw no block"
    assert all(m.startswith("cupyx.scipy.sparse") for m in seen), f"{what}: blocks not on the GPU: {set(seen)}"


# ------------------------------------------------------------------------------------------ markers

KERNEL_OF = {"t-test": "group_moments", "t-test_overestim_var": "group_moments", "wilcoxon": "gene_block_ranks",
             "logreg": "logreg_loss_grad"}


@pytest.mark.parametrize("method", list(KERNEL_OF))
def test_rank_genes_groups_on_the_gpu(lognorm_store, threads, monkeypatch, tmp_path, method):
    kw = {"max_iter": 60} if method == "logreg" else {}
    ref = tl.compute_markers(open_on(lognorm_store, "cpu"), "cell_type", method=method, work_dir=tmp_path, **kw)
    monkeypatch.setattr(store.read, "DEFAULT_BACKEND", "gpu")  # the Wilcoxon gene-major copy is read on the GPU too
    seen = spy_blocks(monkeypatch, KERNEL_OF[method])
    got = tl.compute_markers(open_on(lognorm_store, "gpu"), "cell_type", method=method, work_dir=tmp_path, **kw)
    assert_gpu_blocks(seen, method)
    assert got.groups == ref.groups
    tol = {"rtol": 1e-3, "atol": 1e-4} if method == "logreg" else {"rtol": 1e-6, "atol": 1e-9}  # logreg: L-BFGS
    np.testing.assert_allclose(got.scores, ref.scores, **tol)
    if method != "logreg":
        np.testing.assert_allclose(got.pvals, ref.pvals, rtol=1e-5, atol=1e-300)
        np.testing.assert_allclose(got.logfoldchanges, ref.logfoldchanges, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got.pts.to_numpy(), ref.pts.to_numpy(), rtol=1e-12)


def test_aggregate_on_the_gpu(lognorm_store, threads, monkeypatch):
    funcs = ["sum", "mean", "var", "count_nonzero"]
    ref = tl.aggregate(open_on(lognorm_store, "cpu"), "cell_type", funcs)
    seen = spy_blocks(monkeypatch, "group_moments")
    got = tl.aggregate(open_on(lognorm_store, "gpu"), "cell_type", funcs)
    assert_gpu_blocks(seen, "aggregate")
    pd.testing.assert_frame_equal(got.obs, ref.obs)
    for f in funcs:
        np.testing.assert_allclose(got.layers[f], ref.layers[f], rtol=1e-9, atol=1e-12, err_msg=f)


def test_score_genes_on_the_gpu(lognorm_store, threads, monkeypatch):
    """score_genes (the workflow's optional stage): both passes over X read cupyx blocks, same scores."""
    ref = open_on(lognorm_store, "cpu")
    genes = list(ref.var_names[100:130])
    pp.score_genes(ref, genes, score_name="s")
    seen = spy_blocks(monkeypatch, "row_sums_nan_sets")
    got = open_on(lognorm_store, "gpu")
    pp.score_genes(got, genes, score_name="s")
    assert_gpu_blocks(seen, "score_genes")
    np.testing.assert_allclose(got.obs["s"].to_numpy(), ref.obs["s"].to_numpy(), rtol=1e-9, atol=1e-12)


# -------------------------------------------------------------------------------------------- graph


@pytest.fixture(scope="module")
def embedded(lognorm_store):
    """An AnnData with a PCA embedding of the simulated cells (computed on the CPU)."""
    with dask.config.set(scheduler="threads"):
        a = open_on(lognorm_store, "cpu")
        pp.highly_variable_genes(a, n_top_genes=500)
        pp.subset_genes(a, a.var["highly_variable"].to_numpy())
        pp.scale(a, max_value=10)
        pp.pca(a, n_comps=30)
    import anndata as ad

    b = ad.AnnData(obs=a.obs[["cell_type"]].copy())
    b.obsm["X_pca"] = np.asarray(a.obsm["X_pca"])
    return b


def _ari(a, b) -> float:
    from sklearn.metrics import adjusted_rand_score

    return float(adjusted_rand_score(np.asarray(a), np.asarray(b)))


@pytest.mark.parametrize("metric", ["euclidean", "cosine"])
def test_neighbors_search_on_the_gpu_is_the_exact_cpu_graph(embedded, monkeypatch, metric, caplog):
    cpu, on_gpu = embedded.copy(), embedded.copy()
    tl.neighbors(cpu, 15, knn_method="exact", metric=metric)
    calls = []
    real = gpu.knn_gpu

    def spy(x, k, m, **kw):  # the CuPy engine (cuML, where installed, takes its own path)
        calls.append((x.shape, k, m))
        return real(x, k, m, **kw)

    monkeypatch.setattr(gpu, "knn_gpu", spy)
    with caplog.at_level(logging.INFO, logger="atlasflow"):
        tl.neighbors(on_gpu, 15, metric=metric, backend="gpu")
    assert any("exact kNN of 3000 cells on the GPU" in r.getMessage() for r in caplog.records)
    if not gpu.cuml_available():
        assert calls == [((N_CELLS, 30), 16, metric)]
    d_cpu, d_gpu = cpu.obsp["distances"], on_gpu.obsp["distances"]
    assert d_gpu.dtype == d_cpu.dtype
    same = (d_gpu.indices == d_cpu.indices).mean()
    assert same > 0.999, same  # only near-ties may swap
    np.testing.assert_allclose(np.sort(d_gpu.data), np.sort(d_cpu.data), rtol=1e-4, atol=1e-5)


def test_clustering_and_umap_with_the_gpu_backend(embedded, caplog):
    cpu, on_gpu = embedded.copy(), embedded.copy()
    tl.neighbors(cpu, 15, knn_method="exact")
    tl.neighbors(on_gpu, 15, backend="gpu")
    with caplog.at_level(logging.INFO, logger="atlasflow"):
        for a, backend in ((cpu, "cpu"), (on_gpu, "gpu")):
            tl.leiden(a, 0.5, backend=backend)
            tl.louvain(a, backend=backend)
            tl.umap(a, maxiter=50, backend=backend)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert text.count("cuGraph on the GPU") == (2 if gpu.cugraph_available() else 0), text
    for algorithm in ("leiden", "louvain"):
        ari = _ari(on_gpu.obs[algorithm], cpu.obs[algorithm])
        assert ari > (0.8 if gpu.cugraph_available() else 0.99), (algorithm, ari)  # same graph up to rounding
    assert _ari(on_gpu.obs["leiden"], embedded.obs["cell_type"]) > 0.8  # the simulated cell types, found
    assert ("layout on the GPU (cuML)" in text) == gpu.cuml_available(), text
    emb = on_gpu.obsm["X_umap"]
    assert emb.shape == (N_CELLS, 2) and np.isfinite(emb).all()
