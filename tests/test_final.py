"""Final store: scanpy opens it, sc.pl.umap plots it, X/counts are hard links, h5ad export round-trips."""

from __future__ import annotations

import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import anndata as ad  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import scanpy as sc  # noqa: E402
from _report_stores import N_CELLS, N_GENES, N_HVG, build  # noqa: E402

from atlasflow.cli import stage_main  # noqa: E402
from atlasflow.stages import final as stage  # noqa: E402


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    return build(tmp_path_factory.mktemp("stores"))


def _argv(paths, out, *extra):
    return ["--input", str(paths["log1p"]), "--output", str(out), "--counts", str(paths["filter"]),
            "--hvg-store", str(paths["hvg"]), "--embedding-store", str(paths["umap"]),
            "--clusters-store", str(paths["leiden"]), "--markers-store", str(paths["rank_genes_groups"]), *extra]


@pytest.fixture(scope="module")
def final_store(stores, tmp_path_factory):
    paths, _ = stores
    out = tmp_path_factory.mktemp("final") / "final.zarr"
    assert stage_main(stage, argv=_argv(paths, out)) == 0
    return out


def test_final_opens_in_scanpy(stores, final_store):
    paths, ref = stores
    a = ad.read_zarr(final_store)
    assert a.shape == (N_CELLS, N_GENES)
    np.testing.assert_allclose(a.X.toarray(), ref.X.toarray(), rtol=1e-6)
    np.testing.assert_array_equal(a.layers["counts"].toarray(), ad.read_zarr(paths["filter"]).X.toarray())
    assert {"leiden", "sample", "total_counts", "pct_counts_mt"} <= set(a.obs.columns)
    assert {"highly_variable", "means", "dispersions_norm", "mean_counts"} <= set(a.var.columns)
    assert a.obsm["X_umap"].shape == (N_CELLS, 2) and a.obsm["X_pca"].shape == (N_CELLS, 10)
    assert {"connectivities", "distances"} <= set(a.obsp)
    assert {"pca", "neighbors", "leiden", "umap", "rank_genes_groups", "leiden_colors"} <= set(a.uns)
    pcs = a.varm["PCs"]
    assert pcs.shape == (N_GENES, 10)
    hv = a.var["highly_variable"].to_numpy()
    assert hv.sum() == N_HVG and np.all(pcs[~hv] == 0) and np.any(pcs[hv] != 0)
    sc.pl.umap(a, color="leiden", show=False)
    sc.pl.rank_genes_groups_dotplot(a, n_genes=2, show=False)
    plt.close("all")


def test_matrices_are_linked(stores, final_store):
    paths, _ = stores
    for key, src in (("X", paths["log1p"] / "X"), ("layers/counts", paths["filter"] / "X")):
        for sub in ("data", "indices", "indptr"):
            chunk = src / sub / "c" / "0"
            assert os.stat(final_store / key / sub / "c" / "0").st_ino == os.stat(chunk).st_ino, (key, sub)


@pytest.fixture(scope="module")
def final_h5ad(stores, tmp_path_factory):
    paths, _ = stores
    tmp = tmp_path_factory.mktemp("h5ad")
    h5 = tmp / "final.h5ad"
    assert stage_main(stage, argv=_argv(paths, tmp / "final.zarr", "--h5ad", str(h5))) == 0
    return h5


def test_h5ad_export_round_trips(final_h5ad, final_store):
    a, b = sc.read_h5ad(final_h5ad), ad.read_zarr(final_store)
    np.testing.assert_array_equal(a.X.toarray(), b.X.toarray())
    np.testing.assert_array_equal(a.layers["counts"].toarray(), b.layers["counts"].toarray())
    assert a.obs.equals(b.obs) and a.var.equals(b.var)
    np.testing.assert_array_equal(a.obsm["X_umap"], b.obsm["X_umap"])
    assert set(a.uns) == set(b.uns)


@pytest.mark.parametrize("fmt", ["zarr", "h5ad"])
def test_scanpy_computes_on_the_loaded_matrices(final_store, final_h5ad, fmt):
    """scanpy's first calls run on X and the counts as loaded, with no copy first: scipy refuses a matrix
    whose indptr and indices differ in dtype ("Output dtype not compatible with inputs")."""
    a = ad.read_zarr(final_store) if fmt == "zarr" else sc.read_h5ad(final_h5ad)
    for m in (a.X, a.layers["counts"], *a.obsp.values()):
        assert m.indptr.dtype == m.indices.dtype, (m.indptr.dtype, m.indices.dtype)
    for method in ("t-test", "wilcoxon", "logreg"):
        sc.tl.rank_genes_groups(a, "leiden", method=method, key_added=f"rgg_{method}")
    sc.tl.rank_genes_groups(a, "leiden", method="wilcoxon", layer="counts", key_added="rgg_counts")
    sc.pp.calculate_qc_metrics(a, layer="counts", percent_top=None, inplace=True)  # the tiny store has < 50 genes
    a.X.eliminate_zeros()
    a.layers["counts"].eliminate_zeros()


def test_h5ad_export_skipped_above_limit(stores, tmp_path):
    paths, _ = stores
    h5 = tmp_path / "big.h5ad"
    argv = _argv(paths, tmp_path / "f.zarr", "--h5ad", str(h5), "--h5ad-max-gb", "1e-9",
                 "--summary", str(tmp_path / "f.json"))
    assert stage_main(stage, argv=argv) == 0
    assert not h5.exists()
    assert "h5ad_max_gb" in json.loads((tmp_path / "f.json").read_text())["h5ad_skipped"]


def test_h5ad_index_arrays_widen_together_past_int32(tmp_path, monkeypatch):
    """Past 2**31 - 1 non-zeros (in miniature) the h5ad's indices are widened to indptr's int64."""
    import dask.array as da
    import h5py
    import scipy.sparse as sp

    from atlasflow import final, store

    monkeypatch.setattr(store.format, "INT32_MAX", 10)
    x = sp.random(30, 8, density=0.4, format="csr", random_state=0, dtype=np.float32)
    a = ad.AnnData(X=da.from_array(x, chunks=(10, 8), asarray=False))
    final.write_h5ad(a, tmp_path / "wide.h5ad")
    with h5py.File(tmp_path / "wide.h5ad", "r") as f:
        assert f["X/indptr"].dtype == f["X/indices"].dtype == np.int64
    np.testing.assert_array_equal(sc.read_h5ad(tmp_path / "wide.h5ad").X.toarray(), x.toarray())
