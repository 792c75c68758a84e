"""The scrublet stage against scanpy's ``pp.scrublet`` (same seed) on pbmc3k and on the three mixology plates,
its doublet AUROC against the genotype truth beside scanpy's, filter's drop_doublets, and bad input.

Oracle result: the doublet pairs are scanpy's draw, so the observed cells' scores are bit-equal on pbmc3k
and on every plate (the principal axes differ at round-off only, the neighbour search is exact at these
sizes), and so are the thresholds and the predicted sets.
"""

from __future__ import annotations

import json
from pathlib import Path

import anndata as ad
import dask.array as da
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

from atlasflow.cli import stage_main
from atlasflow.pp.scrublet import scrublet, threshold_minimum
from atlasflow.stages import filter as filter_stage
from atlasflow.stages import scrublet as scrublet_stage
from atlasflow.store import write_store

sc = pytest.importorskip("scanpy")
pytest.importorskip("skimage", reason="scanpy's scrublet threshold needs scikit-image (the test extra has it)")
MIXOLOGY = Path(__file__).resolve().parents[2] / "shared" / "data" / "mixology_5cl"
PLATES = [f"sc_celseq2_5cl_p{i}" for i in (1, 2, 3)]


def run(stage, *argv) -> int:
    return stage_main(stage, argv=[str(a) for a in argv])


def lazy(adata: ad.AnnData, rows: int) -> ad.AnnData:
    """The same cells with X as a Dask matrix of CSR row blocks (as a store opens)."""
    x = da.from_array(sp.csr_matrix(adata.X, dtype=np.float32), chunks=(rows, adata.n_vars), asarray=False)
    return ad.AnnData(X=x, obs=adata.obs.copy(), var=adata.var.copy())


def assert_same_calls(ours: ad.AnnData, theirs: ad.AnnData, batches, *, exact: bool):
    """Scores, calls, doublet pairs and thresholds as scanpy's: bit-equal with ``exact``, else scores equal
    for >= 99% of cells (Spearman >= 0.99) and predicted sets with Jaccard >= 0.9 (the issue's bar)."""
    from scipy.stats import spearmanr

    s1 = theirs.obs["doublet_score"].to_numpy(dtype=float)
    s2 = ours.obs["doublet_score"].to_numpy(dtype=float)
    np.testing.assert_array_equal(np.isnan(s1), np.isnan(s2))
    p1 = theirs.obs["predicted_doublet"].fillna(False).to_numpy(dtype=bool)
    p2 = ours.obs["predicted_doublet"].to_numpy(dtype=bool)
    if exact:
        np.testing.assert_allclose(s2, s1, rtol=0, atol=1e-12)
        np.testing.assert_array_equal(p2, p1)
    else:
        ok = ~np.isnan(s1)
        assert np.isclose(s2[ok], s1[ok], rtol=0, atol=1e-12).mean() >= 0.99
        assert spearmanr(s1[ok], s2[ok])[0] >= 0.99
        assert (p1 & p2).sum() >= 0.9 * (p1 | p2).sum()
    u1, u2 = theirs.uns["scrublet"], ours.uns["scrublet"]
    for b in batches:
        t, o = (u1["batches"][b], u2["batches"][b]) if "batches" in u1 else (u1, u2)
        np.testing.assert_array_equal(o["doublet_parents"], t["doublet_parents"])
        assert o["parameters"]["n_neighbors"] == t["parameters"]["n_neighbors"]
        if exact:  # simulated doublets' scores too, but for ties in distance among a point's farthest neighbours
            assert o["threshold"] == pytest.approx(t["threshold"], abs=1e-12)
            assert np.mean(np.isclose(o["doublet_scores_sim"], t["doublet_scores_sim"], atol=1e-12)) > 0.99


@pytest.fixture(scope="module")
def pbmc3k(pbmc3k_dir) -> ad.AnnData:
    return sc.read_10x_mtx(pbmc3k_dir)


def test_pbmc3k_equals_scanpy(pbmc3k):
    theirs = pbmc3k.copy()
    sc.pp.scrublet(theirs, random_state=0)
    ours = lazy(pbmc3k, 700)  # row blocks that do not divide the 2,700 cells
    summary = scrublet(ours, batch_key=None)
    assert_same_calls(ours, theirs, [None], exact=True)
    assert summary["all"]["knn_method"] == "exact" and summary["all"]["doublets"] == int(theirs.obs[
        "predicted_doublet"].sum()) > 0


@pytest.fixture(scope="module")
def plates() -> ad.AnnData:
    """The three plates' raw counts (genes all plates have), obs sample and the genotype truth."""
    if not MIXOLOGY.is_dir():
        pytest.skip("needs ../shared/data/mixology_5cl beside the repository")
    tables, metas = [], []
    for i, plate in enumerate(PLATES, 1):
        t = pd.read_csv(MIXOLOGY / f"{plate}.count.csv.gz", index_col=0).T
        t.index = f"p{i}_" + t.index
        tables.append(t)
        meta = pd.read_csv(MIXOLOGY / f"{plate}.metadata.csv.gz", index_col=0)
        meta.index = f"p{i}_" + meta.index
        metas.append(meta)
    counts = pd.concat(tables, join="inner")
    meta = pd.concat(metas).loc[counts.index]
    obs = pd.DataFrame({"sample": pd.Categorical([n.split("_")[0] for n in counts.index]),
                        "doublet_truth": (meta["demuxlet_cls"] == "DBL").to_numpy()}, index=counts.index)
    return ad.AnnData(X=sp.csr_matrix(counts.to_numpy(dtype=np.float32)), obs=obs,
                      var=pd.DataFrame(index=counts.columns))


def test_each_plate_equals_scanpy_and_finds_the_genotyped_doublets(plates):
    from sklearn.metrics import roc_auc_score

    theirs = plates.copy()
    sc.pp.scrublet(theirs, batch_key="sample", random_state=0)
    ours = lazy(plates, 128)
    summary = scrublet(ours, batch_key="sample")
    assert_same_calls(ours, theirs, ["p1", "p2", "p3"], exact=False)
    assert set(summary) == {"p1", "p2", "p3"} and not any(s["skipped"] for s in summary.values())
    truth = plates.obs["doublet_truth"].to_numpy()
    auroc = roc_auc_score(truth, ours.obs["doublet_score"])
    assert auroc == pytest.approx(roc_auc_score(truth, theirs.obs["doublet_score"]), abs=0.005)
    assert auroc > 0.6, auroc  # the genotyped doublets (338 of 909) score above the singlets: 0.677, scanpy 0.677


def test_threshold_minimum_is_scikit_images():
    from skimage.filters import threshold_minimum as skimage_threshold

    rng = np.random.default_rng(0)
    for n in (500, 5_000, 50_000):
        values = np.concatenate([rng.gamma(2, 0.05, n), rng.normal(0.6, 0.1, n // 5)])
        assert threshold_minimum(values) == skimage_threshold(values)
    with pytest.raises(RuntimeError):
        threshold_minimum(np.full(100, 0.3))  # one value: one mode


@pytest.fixture(scope="module")
def qc_store(plates, tmp_path_factory) -> Path:
    """The plates as a qc store would leave them, plus a 40-cell sample too small to score."""
    small = plates[plates.obs["sample"] == "p1"][:40].copy()
    small.obs_names = "tiny_" + small.obs_names
    small.obs["sample"] = "tiny"
    both = ad.concat([plates, small])
    both.obs["sample"] = pd.Categorical(both.obs["sample"].astype(str))
    both.obs["n_genes_by_counts"] = np.diff(sp.csr_matrix(both.X).indptr)
    both.var["n_cells_by_counts"] = np.asarray((both.X > 0).sum(axis=0)).ravel()
    path = tmp_path_factory.mktemp("scrublet") / "qc.zarr"
    write_store(lazy(both, 200), path)
    return path


def test_stage_scores_each_sample_and_skips_one_too_small(qc_store, tmp_path, capsys):
    out = tmp_path / "scrublet.zarr"
    assert run(scrublet_stage, "--input", qc_store, "--output", out, "--summary", tmp_path / "s.json") == 0
    assert "sample tiny has 40 cells with >= 3 genes, fewer than scrublet needs (100): skipped" in capsys.readouterr().err
    result = ad.read_zarr(out)
    tiny = (result.obs["sample"] == "tiny").to_numpy()
    assert np.isnan(result.obs["doublet_score"][tiny]).all() and not result.obs["predicted_doublet"][tiny].any()
    assert not np.isnan(result.obs["doublet_score"][~tiny]).any()
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["samples_skipped"] == ["tiny"] and summary["doublets"] == int(result.obs["predicted_doublet"].sum())
    assert set(result.uns["scrublet"]["batches"]) == {"p1", "p2", "p3"}
    assert result.uns["scrublet"]["batched_by"] == "sample"
    # filter drops exactly the cells called doublets, beside its other rules
    filtered = tmp_path / "filter.zarr"
    assert run(filter_stage, "--input", out, "--output", filtered, "--drop-doublets", "--summary",
               tmp_path / "f.json") == 0
    kept = ad.read_zarr(filtered)
    assert list(kept.obs_names) == list(result.obs_names[~result.obs["predicted_doublet"].to_numpy(dtype=bool)])
    assert json.loads((tmp_path / "f.json").read_text())["removed_by"]["predicted_doublet"] == summary["doublets"]


def test_bad_input_is_one_line_and_writes_nothing(qc_store, tmp_path, capsys):
    out = tmp_path / "scrublet.zarr"
    assert run(scrublet_stage, "--input", qc_store, "--output", out, "--batch-key", "donor") != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert any("scrublet.batch_key: donor not in obs" in line for line in err), err
    assert not out.exists()
    # filter asked to drop doublets of a store scrublet never saw
    assert run(filter_stage, "--input", qc_store, "--output", tmp_path / "f.zarr", "--drop-doublets") != 0
    assert "enable the scrublet stage" in capsys.readouterr().err
    assert not (tmp_path / "f.zarr").exists()
