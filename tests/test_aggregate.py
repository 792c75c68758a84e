"""Pseudobulk (aggregate) against scanpy.get.aggregate on pbmc3k filtered counts: bitwise equal, for one and
two keys and three chunk sizes; the stage writes a store and one CSV per function; bad input fails cleanly."""

from __future__ import annotations

from pathlib import Path

import anndata as ad
import dask
import dask.array as da
import numpy as np
import pandas as pd
import pytest
import scanpy as sc
import scipy.sparse as sp

from atlasflow import kernels, tl
from atlasflow.cli import stage_main
from atlasflow.stages import aggregate as aggregate_stage
from atlasflow.store import open_store, write_store

PBMC3K = Path(__file__).resolve().parents[2] / "shared" / "data" / "pbmc3k"
FUNCS = ["sum", "mean", "var", "count_nonzero"]


@pytest.fixture(scope="module")
def counts(scanpy_pbmc3k):
    """Filtered raw counts with Seurat cell types and a made-up two-sample split."""
    a = scanpy_pbmc3k["filtered"].copy()
    ann = pd.read_csv(PBMC3K / "seurat_annotations.tsv", sep="\t", index_col=0)["seurat_annotation"]
    a.obs = pd.DataFrame({"cell_type": pd.Categorical(ann.reindex(a.obs_names)),
                          "sample": pd.Categorical(np.where(np.arange(a.n_obs) % 3 == 0, "s1", "s2"))},
                         index=a.obs_names)
    return a


def write_counts(a, path, chunk_rows, obs_cols=("cell_type", "sample")):
    x = da.from_array(sp.csr_matrix(a.X), chunks=(chunk_rows, a.n_vars), asarray=False)
    with dask.config.set(scheduler="synchronous"):  # in-memory source: no need to ship it to the workers
        return write_store(ad.AnnData(X=x, obs=a.obs[list(obs_cols)], var=a.var[[]]), path, chunk_rows=chunk_rows)


def assert_equal_to_scanpy(ref: ad.AnnData, got: ad.AnnData):
    assert list(got.obs_names) == list(ref.obs_names)
    pd.testing.assert_frame_equal(got.obs, ref.obs)
    assert list(got.var_names) == list(ref.var_names)
    assert set(got.layers) == set(ref.layers)
    for k in ref.layers:
        assert got.layers[k].dtype == ref.layers[k].dtype, k
        assert np.array_equal(got.layers[k], ref.layers[k]), k  # bitwise


def test_aggregate_equals_scanpy_for_chunk_sizes(counts, tmp_path, monkeypatch):
    refs = {str(by): sc.get.aggregate(counts, by, FUNCS) for by in ("cell_type", ["sample", "cell_type"])}
    with dask.config.set(scheduler="synchronous"):
        for rows in (500, 1000, 2638):
            # the whole matrix in one block is also walked in small row pieces inside the kernel
            monkeypatch.setattr(kernels, "MOMENT_PIECE_NNZ", 100_000 if rows == 2638 else 1 << 22)
            b = open_store(write_counts(counts, tmp_path / f"c{rows}.zarr", rows))
            for by in ("cell_type", ["sample", "cell_type"]):
                assert_equal_to_scanpy(refs[str(by)], tl.aggregate(b, by, FUNCS))
            # single functions take scanpy's other code paths (mean without var)
            assert_equal_to_scanpy(sc.get.aggregate(counts, "cell_type", "mean"), tl.aggregate(b, "cell_type", "mean"))


def test_aggregate_dof_and_layer(counts, tmp_path):
    a = counts.copy()
    a.layers["counts"] = a.X.copy()
    x = da.from_array(sp.csr_matrix(a.X), chunks=(800, a.n_vars), asarray=False)
    b = ad.AnnData(X=x, obs=a.obs.copy(), var=a.var[[]], layers={"counts": x})
    with dask.config.set(scheduler="synchronous"):
        got = tl.aggregate(b, "cell_type", ["var", "mean"], dof=0, layer="counts")
    assert_equal_to_scanpy(sc.get.aggregate(a, "cell_type", ["var", "mean"], dof=0, layer="counts"), got)


def run_stage(client, *args) -> int:
    return stage_main(aggregate_stage, argv=[*map(str, args), "--address", client.scheduler.address])


def test_stage_writes_store_and_csvs(client, counts, tmp_path):
    raw = write_counts(counts, tmp_path / "filter.zarr", 700, obs_cols=("sample",))
    groups = ad.AnnData(obs=pd.DataFrame({"leiden": counts.obs["cell_type"].values}, index=counts.obs_names))
    groups.write_zarr(tmp_path / "leiden.zarr")
    out = tmp_path / "pseudobulk.zarr"
    rc = run_stage(client, "--input", raw, "--groups-store", tmp_path / "leiden.zarr", "--output", out,
                   "--by", "sample", "leiden", "--func", *FUNCS)
    assert rc == 0
    ref_in = counts.copy()
    ref_in.obs["leiden"] = ref_in.obs["cell_type"]
    ref = sc.get.aggregate(ref_in, ["sample", "leiden"], FUNCS)
    got = ad.read_zarr(out)
    assert_equal_to_scanpy(ref, got)
    for f in FUNCS:
        table = pd.read_csv(tmp_path / f"pseudobulk.{f}.csv", index_col="gene_id")
        assert list(table.columns) == list(ref.obs_names) and list(table.index) == list(ref.var_names)
        np.testing.assert_allclose(table.to_numpy(), ref.layers[f].T, rtol=1e-12)
    sums = pd.read_csv(tmp_path / "pseudobulk.sum.csv", index_col="gene_id")
    assert all(dt.kind == "i" for dt in sums.dtypes)  # integer counts stay integers for DESeq2 & co
    assert (tmp_path / "pseudobulk.json").exists()


@pytest.mark.parametrize(("args", "words"), [
    (["--by", "nope"], ["by", "nope"]),
    (["--func", "median"], ["func", "median"]),
    (["--layer", "spliced"], ["layer", "spliced"]),
])
def test_stage_bad_input_fails_cleanly(client, counts, tmp_path, capsys, args, words):
    raw = write_counts(counts, tmp_path / "filter.zarr", 1000)
    out = tmp_path / "bad.zarr"
    rc = run_stage(client, "--input", raw, "--output", out, "--by", "cell_type", *args)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 1
    assert err.startswith("atlasflow aggregate: error:") and all(w in err for w in words), err
    assert not out.exists() and not list(tmp_path.glob("bad*.csv"))
