"""The simulate stage: chunk-independent, seeded, realistic enough for QC to find what was planted."""

from __future__ import annotations

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import zarr

from atlasflow import simulate as sim
from atlasflow.cli import stage_main
from atlasflow.errors import ConfigError
from atlasflow.simulate import SimParams, simulate_anndata, simulate_rows, write_simulated

SMALL = SimParams(n_cells=2500, n_genes=800, n_cell_types=4, seed=3)


def _stored_x(path) -> sp.csr_matrix:
    g = zarr.open_group(str(path), mode="r")["X"]
    n, m = g.attrs["shape"]
    return sp.csr_matrix((g["data"][:], g["indices"][:], g["indptr"][:]), shape=(n, m))


@pytest.fixture(scope="module")
def realistic():
    """3000 cells x 2000 genes in memory, with the special populations a little enriched."""
    return simulate_anndata(SimParams(n_cells=3000, n_genes=2000, n_cell_types=5, seed=11,
                                      frac_damaged=0.05, frac_empty=0.03, frac_doublets=0.02))


def test_same_store_whatever_chunk_rows_or_threads(tmp_path):
    write_simulated(tmp_path / "a.zarr", SMALL, chunk_rows=300, threads=1)
    write_simulated(tmp_path / "b.zarr", SMALL, chunk_rows=1000, threads=2)
    xa, xb = _stored_x(tmp_path / "a.zarr"), _stored_x(tmp_path / "b.zarr")
    for attr in ("data", "indices", "indptr"):
        np.testing.assert_array_equal(getattr(xa, attr), getattr(xb, attr))
    a, b = ad.read_zarr(tmp_path / "a.zarr"), ad.read_zarr(tmp_path / "b.zarr")
    pd.testing.assert_frame_equal(a.obs, b.obs)
    pd.testing.assert_frame_equal(a.var, b.var)
    assert (a.X != xa).nnz == 0  # anndata reads the same matrix


def test_any_row_range_matches_the_whole():
    whole = simulate_rows(SMALL, 0, SMALL.n_cells)
    for start, stop in [(0, 1), (999, 1001), (1234, 2500), (2000, 2000)]:
        part = simulate_rows(SMALL, start, stop)
        assert (part != whole[start:stop]).nnz == 0
    obs = sim.cell_obs(SMALL)
    pd.testing.assert_frame_equal(sim.cell_obs(SMALL, 999, 1001), obs.iloc[999:1001])


def test_fewer_cells_give_a_prefix_of_the_same_cells():
    fewer = SimParams(**{**SMALL.__dict__, "n_cells": 1500})
    assert (simulate_rows(fewer, 0, 1500) != simulate_rows(SMALL, 0, 1500)).nnz == 0
    pd.testing.assert_frame_equal(sim.cell_obs(fewer), sim.cell_obs(SMALL).iloc[:1500])


def test_batch_size_does_not_change_the_draws(monkeypatch):
    ref = sim.simulate_subblock(SMALL, 1)
    monkeypatch.setattr(sim, "BATCH", 7)
    assert (sim.simulate_subblock(SMALL, 1) != ref).nnz == 0


def test_seeded():
    a, b = simulate_rows(SMALL, 0, 1200), simulate_rows(SMALL, 0, 1200)
    assert (a != b).nnz == 0
    other = SimParams(**{**SMALL.__dict__, "seed": 4})
    c = simulate_rows(other, 0, 1200)
    assert (a != c).nnz > 0
    assert not sim.cell_obs(SMALL).index.equals(sim.cell_obs(other).index)


def test_matrix_format_and_annotations(realistic):
    a = realistic
    X = a.X
    assert sp.isspmatrix_csr(X) and X.dtype == np.float32 and X.has_sorted_indices
    assert (X.data > 0).all() and np.array_equal(X.data, np.round(X.data))
    assert a.var_names.is_unique and a.obs_names.is_unique
    assert (a.var_names == a.var["gene_symbols"]).all()
    assert a.var["gene_ids"].str.fullmatch(r"ENSG\d{11}").all()
    assert a.var_names.str.startswith("MT-").sum() == 13 and "MT-CO1" in a.var_names
    assert a.var_names.str.match(r"^RP[SL]\d").sum() >= 4
    assert a.obs_names.str.fullmatch(r"[ACGT]{16}-1").all()
    assert set(a.obs.columns) >= {"cell_type", "is_damaged", "is_empty", "is_doublet"}
    for flag, frac in [("is_damaged", 0.05), ("is_empty", 0.03), ("is_doublet", 0.02)]:
        assert 0.5 * frac < a.obs[flag].mean() < 1.6 * frac
    assert not (a.obs[["is_damaged", "is_empty", "is_doublet"]].sum(axis=1) > 1).any()
    assert 500 < np.diff(X.indptr)[~a.obs["is_empty"].to_numpy()].mean() < 1500  # 2000 genes, 4000 UMIs


def test_planted_structure(realistic):
    a = realistic
    X, obs = a.X, a.obs
    total = np.asarray(X.sum(axis=1)).ravel()
    n_genes = np.diff(X.indptr)
    mt = a.var_names.str.startswith("MT-")
    pct_mt = 100 * np.asarray(X[:, mt].sum(axis=1)).ravel() / total
    damaged, empty, doublet = (obs[k].to_numpy() for k in ("is_damaged", "is_empty", "is_doublet"))
    normal = ~(damaged | empty | doublet)
    assert np.median(pct_mt[damaged]) > 20 > 3 * np.median(pct_mt[normal])
    assert np.percentile(pct_mt[normal], 99) < 10 < np.percentile(pct_mt[damaged], 5)
    assert np.percentile(n_genes[empty], 95) < 200 < np.percentile(n_genes[normal], 1)
    assert np.median(total[doublet]) > 1.5 * np.median(total[normal])
    # each type's marker genes are most expressed in that type
    types = obs["cell_type"].cat.categories
    means = np.vstack([np.asarray(X[normal & (obs["cell_type"] == t).to_numpy()].mean(axis=0)).ravel() for t in types])
    for i, t in enumerate(types):
        markers = (a.var["marker_of"] == t).to_numpy()
        assert markers.sum() >= 3
        assert (means[:, markers].argmax(axis=0) == i).all()
    # overdispersed: within one type, variance exceeds the mean for expressed genes
    cells = normal & (obs["cell_type"] == types[0]).to_numpy()
    Y = X[cells].toarray()
    mu, var = Y.mean(axis=0), Y.var(axis=0)
    expressed = mu > 1
    assert expressed.sum() > 20
    assert (var[expressed] > mu[expressed]).mean() > 0.95


def test_qc_and_filter_remove_the_planted_bad_cells(tmp_path, client):
    from atlasflow.stages import filter as filter_stage
    from atlasflow.stages import qc, simulate

    attach = ["--address", client.scheduler.address]
    raw, qcd, kept = tmp_path / "raw.zarr", tmp_path / "qc.zarr", tmp_path / "filtered.zarr"
    assert stage_main(simulate, argv=["--output", str(raw), "--n-cells", "2000", "--n-genes", "1000",
                                      "--chunk-rows", "700", "--seed", "5", "--n-workers", "1"]) == 0
    assert stage_main(qc, argv=["--input", str(raw), "--output", str(qcd), *attach]) == 0
    assert stage_main(filter_stage, argv=["--input", str(qcd), "--output", str(kept), "--min-genes", "200",
                                          "--max-pct-mt", "20", *attach]) == 0
    before = ad.read_zarr(qcd).obs
    after = ad.read_zarr(kept).obs
    bad = before["is_damaged"] | before["is_empty"]
    removed = ~before.index.isin(after.index)
    assert removed[bad.to_numpy()].mean() > 0.9  # nearly all damaged/empty cells go
    assert removed[~bad.to_numpy()].mean() < 0.02  # nearly all good cells stay
    assert bad[removed].mean() > 0.9  # and what goes is mostly damaged/empty


def test_size_parameters_are_validated(tmp_path, capsys):
    from atlasflow.stages import simulate

    rc = stage_main(simulate, argv=["--output", str(tmp_path / "x.zarr"), "--n-cells", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1
    assert "n_cells" in err[-1] and "Traceback" not in "\n".join(err)
    assert not (tmp_path / "x.zarr").exists()
    for bad in ({"n_genes": 10}, {"n_cell_types": 0}, {"frac_damaged": 1.5}, {"median_counts": 0},
                {"frac_empty": 0.5, "frac_damaged": 0.5}, {"n_genes": 120, "n_cell_types": 30}):
        with pytest.raises(ConfigError):
            SimParams(**bad).validate()


def test_tenx_h5_holds_the_same_counts(tmp_path):
    sc = pytest.importorskip("scanpy")
    params = SimParams(n_cells=1500, n_genes=500, n_cell_types=3, seed=2)
    nnz = sim.write_tenx_h5(tmp_path / "sim.h5", params, threads=2)
    a, b = sc.read_10x_h5(tmp_path / "sim.h5"), simulate_anndata(params)
    assert nnz == b.X.nnz and (a.X != b.X).nnz == 0
    assert (a.obs_names == b.obs_names).all() and (a.var["gene_ids"] == b.var["gene_ids"]).all()
    assert (a.var_names == b.var_names).all()
