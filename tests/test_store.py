"""store.write_store links what a stage left unchanged (obs, var, obsm/varm/obsp entries) and writes the rest."""

from __future__ import annotations

import os
import shutil

import anndata as ad
import dask
import dask.array as da
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

from atlasflow.store import open_store, write_store


def _inode(path):
    return os.stat(next(p for p in sorted(path.rglob("*")) if p.is_file() and p.name != "zarr.json")).st_ino


@pytest.fixture
def source(tmp_path):
    rng = np.random.default_rng(0)
    n, m = 50, 8
    x = sp.random(n, m, density=0.3, format="csr", random_state=rng, dtype=np.float32)
    obs = pd.DataFrame({"total": rng.random(n), "group": pd.Categorical(rng.choice(["a", "b"], n))},
                       index=[f"c{i}" for i in range(n)])
    a = ad.AnnData(X=da.from_array(x, chunks=(20, m), asarray=False), obs=obs,
                   var=pd.DataFrame({"mean": rng.random(m)}, index=[f"g{j}" for j in range(m)]),
                   obsm={"X_pca": rng.random((n, 3)).astype(np.float32)},
                   obsp={"connectivities": sp.random(n, n, density=0.1, format="csr", random_state=rng)})
    write_store(a, tmp_path / "src.zarr")
    return tmp_path / "src.zarr"


def test_unchanged_small_elements_are_linked(source, tmp_path):
    a = open_store(source)
    a.obsm["X_umap"] = np.ones((a.n_obs, 2), np.float32)
    write_store(a, tmp_path / "out.zarr")
    for key in ("obs", "var", "obsm/X_pca", "obsp/connectivities"):
        assert _inode(tmp_path / "out.zarr" / key) == _inode(source / key), key
    out, ref = ad.read_zarr(tmp_path / "out.zarr"), ad.read_zarr(source)
    pd.testing.assert_frame_equal(out.obs, ref.obs)
    np.testing.assert_array_equal(out.obsm["X_pca"], ref.obsm["X_pca"])
    np.testing.assert_array_equal(out.obsm["X_umap"], 1)
    assert (out.obsp["connectivities"] != ref.obsp["connectivities"]).nnz == 0


def test_changed_elements_are_written(source, tmp_path):
    a = open_store(source)
    a.obs["new"] = 1.0  # in place: the fingerprint differs
    with pytest.raises(ValueError, match="read-only"):
        a.obsm["X_pca"][0, 0] = 5  # arrays read from a store are read-only
    a.obsm["X_pca"] = a.obsm["X_pca"] * 2  # a new array
    write_store(a, tmp_path / "out.zarr")
    assert _inode(tmp_path / "out.zarr" / "obs") != _inode(source / "obs")
    assert _inode(tmp_path / "out.zarr" / "obsm" / "X_pca") != _inode(source / "obsm" / "X_pca")
    assert _inode(tmp_path / "out.zarr" / "var") == _inode(source / "var")
    out, ref = ad.read_zarr(tmp_path / "out.zarr"), ad.read_zarr(source)
    assert (out.obs["new"] == 1).all()
    np.testing.assert_array_equal(out.obsm["X_pca"], ref.obsm["X_pca"] * 2)


def test_skipped_elements_are_not_read_and_are_linked_unless_replaced(source, tmp_path):
    from atlasflow.errors import StoreError
    from atlasflow.store import load_element

    a = open_store(source, skip=("obsm", "obsp"))
    assert len(a.obsm) == 0 and len(a.obsp) == 0
    a.obs["new"] = 1.0
    write_store(a, tmp_path / "out.zarr")
    for key in ("obsm/X_pca", "obsp/connectivities"):
        assert _inode(tmp_path / "out.zarr" / key) == _inode(source / key), key
    out, ref = ad.read_zarr(tmp_path / "out.zarr"), ad.read_zarr(source)
    np.testing.assert_array_equal(out.obsm["X_pca"], ref.obsm["X_pca"])
    assert (out.obsp["connectivities"] != ref.obsp["connectivities"]).nnz == 0 and (out.obs["new"] == 1).all()

    b = open_store(source, skip=("obsm/X_pca", "obsp"))
    graph = load_element(b, "obsp/connectivities")  # read later: read-only, linked like an element read at first
    assert graph is b.obsp["connectivities"] and (graph != ref.obsp["connectivities"]).nnz == 0
    with pytest.raises(ValueError, match="read-only"):
        graph.data[0] = 5
    with pytest.raises(StoreError, match="obsp/distances"):
        load_element(b, "obsp/distances")
    b.obsm["X_pca"] = np.zeros((b.n_obs, 3), np.float32)  # a skipped element replaced: written, not linked
    write_store(b, tmp_path / "replaced.zarr")
    assert _inode(tmp_path / "replaced.zarr" / "obsp" / "connectivities") == _inode(source / "obsp" / "connectivities")
    assert _inode(tmp_path / "replaced.zarr" / "obsm" / "X_pca") != _inode(source / "obsm" / "X_pca")
    np.testing.assert_array_equal(ad.read_zarr(tmp_path / "replaced.zarr").obsm["X_pca"], 0)


def test_obs_opened_without_columns_is_linked_whole_or_refused_if_changed(source, tmp_path):
    from atlasflow.errors import StoreError

    a = open_store(source, obs_columns=False)
    assert list(a.obs.columns) == [] and list(a.obs_names) == list(ad.read_zarr(source).obs_names)
    a.obsm["X_umap"] = np.ones((a.n_obs, 2), np.float32)
    write_store(a, tmp_path / "out.zarr")
    assert _inode(tmp_path / "out.zarr" / "obs") == _inode(source / "obs")
    pd.testing.assert_frame_equal(ad.read_zarr(tmp_path / "out.zarr").obs, ad.read_zarr(source).obs)
    np.testing.assert_array_equal(ad.read_zarr(tmp_path / "out.zarr").obsm["X_umap"], 1)
    b = open_store(source, obs_columns=False)
    b.obs["new"] = 1.0
    with pytest.raises(StoreError, match="opened without its columns"):
        write_store(b, tmp_path / "bad.zarr")
    assert not (tmp_path / "bad.zarr").exists()


def test_zarr_v2_store_is_refused_with_the_way_to_convert_it(tmp_path, capsys):
    """A Zarr v2 store (anndata 0.12's default format) is refused in one line pointing to ingest, before any
    output: its elements, linked into a stage's v3 output, would be missing there."""
    from atlasflow.cli import stage_main
    from atlasflow.errors import StoreError
    from atlasflow.stages import log1p

    before = ad.settings.zarr_write_format
    ad.settings.zarr_write_format = 2
    try:
        ad.AnnData(X=sp.random(20, 5, density=0.5, format="csr", dtype=np.float32)).write_zarr(tmp_path / "v2.zarr")
    finally:
        ad.settings.zarr_write_format = before
    with pytest.raises(StoreError, match=r"v2.zarr is a Zarr v2 store; .* convert it with the ingest stage"):
        open_store(tmp_path / "v2.zarr")
    out = tmp_path / "log1p.zarr"
    assert stage_main(log1p, argv=["--input", str(tmp_path / "v2.zarr"), "--output", str(out)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert "is a Zarr v2 store" in err[-1] and "ingest" in err[-1], err
    assert not out.exists()


def test_open_matrix_gives_the_matrix_and_names_alone(source):
    from atlasflow.store import open_matrix

    x, obs_names, var_names = open_matrix(source, chunk_rows=20)
    a = open_store(source, chunk_rows=20)
    assert obs_names.equals(a.obs_names) and var_names.equals(a.var_names)
    assert x.chunks == a.X.chunks
    with dask.config.set(scheduler="sync"):
        assert (x.compute() != a.X.compute()).nnz == 0


def test_sharded_matrix_as_anndata_0_13_writes_it_opens_and_a_lost_shard_is_damage(source, tmp_path):
    """anndata 0.13 shards arrays by default (one file per shard, many chunks inside): a store of a user's
    such X opens with the same values, and a missing shard file is still a one-line error, never zeros."""
    import zarr

    from atlasflow.errors import StoreError

    store = tmp_path / "sharded.zarr"
    shutil.copytree(source, store)
    ref = ad.read_zarr(source).X
    for part in ("data", "indices"):
        values = zarr.open_array(str(source / "X" / part), mode="r")[:]
        shutil.rmtree(store / "X" / part)
        arr = zarr.create_array(str(store / "X" / part), shape=values.shape, dtype=values.dtype,
                                chunks=(16,), shards=(64,), zarr_format=3)
        arr[:] = values
        assert len(list((store / "X" / part / "c").iterdir())) < -(-values.shape[0] // 16)  # fewer files than chunks
    zarr.consolidate_metadata(str(store))  # as a writer would leave it
    with dask.config.set(scheduler="sync"):
        assert (open_store(store, chunk_rows=20).X.compute() != ref).nnz == 0
    next((store / "X" / "data" / "c").iterdir()).unlink()
    with pytest.raises(StoreError, match="damaged"):
        open_store(store, chunk_rows=20)


def test_reordered_categories_are_a_change(source, tmp_path):
    a = open_store(source)
    a.obs["group"] = a.obs["group"].cat.reorder_categories(["b", "a"])
    write_store(a, tmp_path / "out.zarr")
    assert list(ad.read_zarr(tmp_path / "out.zarr").obs["group"].cat.categories) == ["b", "a"]


def test_computed_sparse_matrix_is_computed_once_and_written_whole(source, tmp_path):
    """A CSR matrix of unknown structure (columns dropped, values changed) is computed block by block once,
    stashed, and copied into place: equal to the in-memory result, no scratch left in the store."""
    from atlasflow.pp._utils import take_columns

    calls = []

    def double(block):
        calls.append(block.shape[0])
        return block * 2

    a = open_store(source, chunk_rows=15)
    expected = ad.read_zarr(source).X[:, [0, 3, 5, 6]].toarray() * 2
    x = take_columns(a.X, np.array([0, 3, 5, 6])).map_blocks(double, dtype=a.X.dtype, meta=a.X._meta)
    a = ad.AnnData(X=x, obs=a.obs, var=a.var.iloc[[0, 3, 5, 6]])
    with dask.config.set(scheduler="synchronous"):  # in this process, whatever client another test started
        write_store(a, tmp_path / "out.zarr")
    assert sorted(calls) == sorted(a.X.chunks[0])  # every block once: no counting pass before the writes
    np.testing.assert_array_equal(ad.read_zarr(tmp_path / "out.zarr").X.toarray(), expected)
    assert not [p for p in (tmp_path / "out.zarr").rglob("*") if ".pieces" in p.name]


@pytest.mark.parametrize("int32_max", [None, 10], ids=["int32", "past-int32"])
def test_stored_csr_index_arrays_share_one_dtype(source, tmp_path, monkeypatch, int32_max):
    """indptr and indices of every written CSR have one dtype, as scipy makes them (int32 while the
    non-zeros fit, else both int64): scanpy's calls on a loaded matrix fail when they differ."""
    import zarr

    from atlasflow import store
    from atlasflow.pp._utils import take_columns

    if int32_max is not None:  # a matrix past 2**31 - 1 non-zeros, in miniature
        monkeypatch.setattr(store.format, "INT32_MAX", int32_max)
    want = np.int32 if int32_max is None else np.int64
    x = ad.read_zarr(source).X
    cols = np.array([0, 3, 5, 6])
    a = open_store(source, chunk_rows=15)
    with dask.config.set(scheduler="synchronous"):  # a computed matrix: write_csr
        write_store(ad.AnnData(X=take_columns(a.X, cols), obs=a.obs, var=a.var.iloc[cols]), tmp_path / "computed.zarr")
    store.write_csr_blocks(tmp_path / "streamed.zarr", "X", (x[i:i + 15] for i in range(0, x.shape[0], 15)), x.shape)
    for path, want_x in (("computed.zarr", x[:, cols]), ("streamed.zarr", x)):
        g = zarr.open_group(str(tmp_path / path), mode="r")["X"]
        assert g["indptr"].dtype == g["indices"].dtype == want, path
        m = sp.csr_matrix((g["data"][:], g["indices"][:], g["indptr"][:]), shape=want_x.shape)
        np.testing.assert_array_equal(m.toarray(), want_x.toarray())
