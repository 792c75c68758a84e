"""highly_variable_genes and the hvg/subset stages against scanpy on pbmc3k (tutorial QC)."""

from __future__ import annotations

import logging
import warnings

import anndata as ad
import dask
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
from _oocore import batches, count_x_passes, jaccard, lazy, store_of
from _scanpy_stack import SCANPY_1_12

from atlasflow import pp
from atlasflow.errors import ConfigError, InputError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture(scope="module")
def snaps(scanpy_pbmc3k):
    """log1p and raw-count snapshots with a deterministic 3-level batch column."""
    log1p, counts = scanpy_pbmc3k["log1p"].copy(), scanpy_pbmc3k["filtered"].copy()
    log1p.obs["batch"] = counts.obs["batch"] = batches(log1p.n_obs)
    return {"log1p": log1p, "counts": counts}


@pytest.fixture(scope="module")
def stores(snaps, tmp_path_factory):
    """The snapshots as atlasflow stores with 700-row blocks."""
    d = tmp_path_factory.mktemp("hvg")
    return {k: store_of(v, d / f"{k}.zarr", 700) for k, v in snaps.items()}


def _scanpy(snap, **kw):
    import scanpy as sc

    ref = snap.copy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sc.pp.highly_variable_genes(ref, **kw)
    return ref


HVG_COLUMNS = ("means", "dispersions", "dispersions_norm", "variances", "variances_norm", "highly_variable_rank",
               "highly_variable_nbatches", "highly_variable_intersection")


def _assert_var_equal(ours: pd.DataFrame, ref: pd.DataFrame, rtol=1e-12):
    cols = [c for c in HVG_COLUMNS if c in ref.columns]
    assert set(cols) <= set(ours.columns)
    assert cols
    for c in cols:
        x, y = ours[c].to_numpy(dtype=np.float64), ref[c].to_numpy(dtype=np.float64)
        np.testing.assert_array_equal(np.isnan(x), np.isnan(y), err_msg=c)
        ok = ~np.isnan(y)
        np.testing.assert_allclose(x[ok], y[ok], rtol=rtol, atol=1e-300, err_msg=c)
        assert ours[c].dtype == ref[c].dtype, c


def test_seurat_cutoffs_select_scanpys_1838_genes(snaps):
    ref = _scanpy(snaps["log1p"], min_mean=0.0125, max_mean=3, min_disp=0.5)
    ours = lazy(snaps["log1p"], 700)
    with dask.config.set(scheduler="sync"):
        pp.highly_variable_genes(ours, min_mean=0.0125, max_mean=3, min_disp=0.5)
    assert int(ref.var["highly_variable"].sum()) == 1838
    np.testing.assert_array_equal(ours.var["highly_variable"], ref.var["highly_variable"])
    _assert_var_equal(ours.var, ref.var)
    assert ours.uns["hvg"] == {"flavor": "seurat"}
    assert isinstance(ours.X, dask.array.Array)


CASES = {
    "seurat-top": ("log1p", {"flavor": "seurat", "n_top_genes": 2000}),
    "cell_ranger-top": ("log1p", {"flavor": "cell_ranger", "n_top_genes": 2000}),
    "cell_ranger-cutoffs": ("log1p", {"flavor": "cell_ranger"}),
    "seurat_v3": ("counts", {"flavor": "seurat_v3", "n_top_genes": 2000}),
    "seurat_v3_paper": ("counts", {"flavor": "seurat_v3_paper", "n_top_genes": 2000}),
    "seurat-batch": ("log1p", {"flavor": "seurat", "batch_key": "batch"}),
    "seurat-batch-top": ("log1p", {"flavor": "seurat", "batch_key": "batch", "n_top_genes": 2000}),
    "cell_ranger-batch-top": ("log1p", {"flavor": "cell_ranger", "batch_key": "batch", "n_top_genes": 1500}),
    "seurat_v3-batch": ("counts", {"flavor": "seurat_v3", "batch_key": "batch", "n_top_genes": 2000}),
    "seurat_v3_paper-batch": ("counts", {"flavor": "seurat_v3_paper", "batch_key": "batch", "n_top_genes": 2000}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_flavors_select_scanpys_genes(snaps, case):
    which, kw = CASES[case]
    ref = _scanpy(snaps[which], **kw)
    ours = lazy(snaps[which], 500)
    with dask.config.set(scheduler="sync"):
        pp.highly_variable_genes(ours, **kw)
    assert ours.uns["hvg"] == ref.uns["hvg"]
    if SCANPY_1_12 and kw["flavor"].startswith("seurat_v3") and "batch_key" in kw:
        # scanpy 1.12 takes each batch's mean/variance from get.aggregate (Welford): the loess inputs move by
        # 1e-12 and its fit turns that into 1e-3 in variances_norm, then into rank flips at the cut. Measured
        # the same between scanpy 1.11.5 and 1.12.4 themselves; we are bitwise equal to 1.11 (the case above)
        assert jaccard(ours.var["highly_variable"], ref.var["highly_variable"]) >= 0.99
        _assert_var_equal(ours.var[["means", "variances"]], ref.var[["means", "variances"]])
        np.testing.assert_allclose(ours.var["variances_norm"], ref.var["variances_norm"], rtol=2e-3)
        return
    assert jaccard(ours.var["highly_variable"], ref.var["highly_variable"]) == 1.0
    _assert_var_equal(ours.var, ref.var)


def _poisson_reference(x: np.ndarray, n_top: int):
    """Poisson zero-enrichment computed directly on the dense matrix (single batch)."""
    totals = x.sum(axis=1)
    share = x.sum(axis=0) / x.sum()
    observed = 1 - (x > 0).mean(axis=0)
    expected = np.exp(-np.outer(totals, share)).mean(axis=0)
    prob = observed * (1 - expected)
    order = np.argsort(-prob, kind="stable")
    return observed, expected, prob, order[:n_top]


def test_poisson_gene_selection_matches_direct_computation(snaps):
    counts = snaps["counts"]
    ours = lazy(counts, 600)
    with dask.config.set(scheduler="sync"):
        pp.highly_variable_genes(ours, flavor="poisson_gene_selection", n_top_genes=1000)
    observed, expected, prob, top = _poisson_reference(counts.X.toarray().astype(np.float64), 1000)
    var = ours.var
    np.testing.assert_allclose(var["observed_fraction_zeros"], observed, rtol=1e-12)
    np.testing.assert_allclose(var["expected_fraction_zeros"], expected, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(var["prob_zero_enrichment"], prob, rtol=1e-9, atol=1e-12)
    assert int(var["highly_variable"].sum()) == 1000
    # the selection is the 1000 highest enrichments (ties at the boundary may swap equal values)
    threshold = np.sort(prob)[::-1][999]
    assert (prob[var["highly_variable"].to_numpy()] >= threshold).all()
    assert jaccard(var["highly_variable"], np.isin(np.arange(len(prob)), top)) == 1.0
    assert ours.uns["hvg"] == {"flavor": "poisson_gene_selection"}


def test_poisson_batches_agree_with_per_batch_runs(snaps):
    counts = snaps["counts"]
    ours = lazy(counts, 600)
    with dask.config.set(scheduler="sync"):
        pp.highly_variable_genes(ours, flavor="poisson_gene_selection", n_top_genes=800, batch_key="batch")
    per_batch = []
    for b in counts.obs["batch"].cat.categories:
        x = counts[counts.obs["batch"] == b].X.toarray().astype(np.float64)
        per_batch.append(_poisson_reference(x, 800))
    np.testing.assert_allclose(ours.var["observed_fraction_zeros"], np.median([p[0] for p in per_batch], axis=0))
    np.testing.assert_allclose(ours.var["prob_zero_enrichment"], np.median([p[2] for p in per_batch], axis=0),
                               rtol=1e-9, atol=1e-12)
    assert ours.var["prob_zero_enriched_nbatches"].max() == 3
    assert int(ours.var["highly_variable"].sum()) == 800


@pytest.mark.parametrize("flavor", ["seurat", "seurat_v3"])
def test_same_result_for_chunk_sizes_and_workers(snaps, client, flavor):
    which = "counts" if flavor == "seurat_v3" else "log1p"
    kw = {"flavor": flavor, "n_top_genes": 2000}
    results = []
    for chunk in (300, 1000, 2638):
        a = lazy(snaps[which], chunk)
        with dask.config.set(scheduler="sync"):
            pp.highly_variable_genes(a, **kw)
        results.append(a.var)
    a = lazy(snaps[which], 300)
    pp.highly_variable_genes(a, **kw)  # on the 2-worker cluster
    first = results[0]
    for other in results[1:]:
        np.testing.assert_array_equal(other["highly_variable"], first["highly_variable"])
        _assert_var_equal(other, first, rtol=1e-13)
    pd.testing.assert_frame_equal(a.var, first)  # same chunks, 1 vs 2 workers: identical


@pytest.mark.parametrize(("flavor", "passes"), [("seurat", 1), ("cell_ranger", 1), ("seurat_v3", 2),
                                                 ("poisson_gene_selection", 1)])
def test_passes_over_x(stores, flavor, passes):
    which = "log1p" if flavor in ("seurat", "cell_ranger") else "counts"
    path = stores[which]
    from atlasflow.store import open_store

    a = open_store(path)
    with dask.config.set(scheduler="sync"), count_x_passes(path) as reads:
        pp.highly_variable_genes(a, flavor=flavor, n_top_genes=1000)
    assert reads["X"] == passes
    assert isinstance(a.X, dask.array.Array)


def test_bad_inputs(snaps, caplog):
    log1p = lazy(snaps["log1p"], 1000)
    with pytest.raises(ConfigError, match="flavor='seurat_v4'"):
        pp.highly_variable_genes(log1p, flavor="seurat_v4")
    with pytest.raises(InputError, match="batch_key='nope'"):
        pp.highly_variable_genes(log1p, batch_key="nope")
    with dask.config.set(scheduler="sync"):
        with pytest.raises(InputError, match="expects raw counts"):
            pp.highly_variable_genes(lazy(snaps["log1p"], 1000), flavor="seurat_v3")
        with pytest.raises(InputError, match="expects raw counts"):
            pp.highly_variable_genes(lazy(snaps["log1p"], 1000), flavor="poisson_gene_selection")
        small = lazy(snaps["counts"][:, :500].copy(), 1000)
        with caplog.at_level(logging.WARNING, logger="atlasflow"):
            pp.highly_variable_genes(small, flavor="seurat_v3", n_top_genes=5000)
        assert "n_top_genes=5000 > 500 genes" in caplog.text
        assert small.var["highly_variable"].all()
    other = lazy(snaps["counts"][:, :100].copy(), 1000)
    with pytest.raises(InputError, match="counts input"):
        pp.highly_variable_genes(log1p, flavor="seurat_v3", counts=other)
    with pytest.raises(ConfigError, match="n_top_genes=0"):
        pp.highly_variable_genes(log1p, n_top_genes=0)


def test_counts_input_and_subset_inplace(snaps):
    ref = _scanpy(snaps["counts"], flavor="seurat_v3", n_top_genes=1500)
    ours = lazy(snaps["log1p"], 800)
    with dask.config.set(scheduler="sync"):
        pp.highly_variable_genes(ours, flavor="seurat_v3", n_top_genes=1500, counts=lazy(snaps["counts"], 500),
                                 subset=True)
    assert ours.n_vars == 1500
    assert list(ours.var_names) == list(ref.var_names[ref.var["highly_variable"]])
    with dask.config.set(scheduler="sync"):
        x = ours.X.compute()
    expected = snaps["log1p"][:, ref.var["highly_variable"].to_numpy()].X
    assert (abs(sp.csr_matrix(x) - expected)).max() == 0


# ----------------------------------------------------------------------------------------------- stages


def test_hvg_and_subset_stages(snaps, stores, client, tmp_path):
    from atlasflow.cli import stage_main
    from atlasflow.stages import hvg, subset

    log1p, counts = stores["log1p"], stores["counts"]
    attach = ["--address", client.scheduler.address]
    out = tmp_path / "hvg.zarr"
    rc = stage_main(hvg, argv=["--input", str(log1p), "--counts", str(counts), "--flavor", "seurat_v3",
                               "--n-top-genes", "2000", "--output", str(out), *attach])
    assert rc == 0
    ref = _scanpy(snaps["counts"], flavor="seurat_v3", n_top_genes=2000)
    got = ad.read_zarr(out)
    np.testing.assert_array_equal(got.var["highly_variable"], ref.var["highly_variable"])
    _assert_var_equal(got.var, ref.var)
    assert (got.X != snaps["log1p"].X).nnz == 0
    assert (out / "X" / "data").exists()

    rc = stage_main(subset, argv=["--input", str(out), "--output", str(tmp_path / "subset.zarr"), *attach])
    assert rc == 0
    sub = ad.read_zarr(tmp_path / "subset.zarr")
    assert sub.n_vars == 2000 and sub.var["highly_variable"].all()
    expected = snaps["log1p"][:, ref.var["highly_variable"].to_numpy()].X
    assert (sp.csr_matrix(sub.X) != expected).nnz == 0

    bad = tmp_path / "bad.zarr"
    rc = stage_main(hvg, argv=["--input", str(log1p), "--flavor", "bogus", "--output", str(bad), *attach])
    assert rc != 0 and not bad.exists() and not bad.with_suffix(".json").exists()
    rc = stage_main(hvg, argv=["--input", str(log1p), "--flavor", "seurat_v3", "--output", str(bad), *attach])
    assert rc != 0 and not bad.exists()


@pytest.mark.parametrize(("args", "code", "expect"), [
    (["--min-mean", "5", "--max-mean", "3"], 1, "min_mean (5.0) is above max_mean (3.0): no value can pass both"),
    (["--min-disp", "2", "--max-disp", "1"], 1, "min_disp (2.0) is above max_disp (1.0): no value can pass both"),
    (["--span", "0"], 2, "span: must be a number > 0, not '0'"),
    (["--n-top-genes", "0"], 2, "n_top_genes: must be an integer >= 1 (or none), not '0'"),
    (["--min-mean", "nan"], 2, "min_mean: must be a finite number, not 'nan'"),
], ids=["mean", "disp", "span0", "n_top_genes0", "min_mean_nan"])
def test_bad_cutoffs_are_one_line(tmp_path, capsys, client, args, code, expect):
    """A cut-off pair no gene can pass, or a bad number, is refused before the input is read (it need not exist)."""
    from atlasflow.cli import stage_main
    from atlasflow.stages import hvg

    out = tmp_path / "hvg.zarr"
    rc = stage_main(hvg, argv=["--input", str(tmp_path / "log1p.zarr"), "--output", str(out),
                               "--address", client.scheduler.address, *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == code and err[-1].startswith(f"atlasflow hvg: error: {expect}"), err
    assert not out.exists()
