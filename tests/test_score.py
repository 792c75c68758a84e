"""score_genes / score_genes_cell_cycle and the score_genes stage against scanpy on pbmc3k."""

from __future__ import annotations

import warnings

import anndata as ad
import dask
import numpy as np
import pandas as pd
import pytest
from _oocore import count_x_passes, lazy, store_of
from _scanpy_stack import assert_scores_equal

from atlasflow import pp
from atlasflow.errors import InputError
from atlasflow.pp._utils import read_gene_list

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
RESOURCES = __import__("pathlib").Path(__file__).resolve().parents[1] / "resources" / "gene_lists"
T_CELL = ["CD3D", "CD3E", "CD8A", "IL7R", "LEF1", "NOT_A_GENE"]


@pytest.fixture(scope="module")
def cell_cycle():
    s, g2m = RESOURCES / "cell_cycle_s.txt", RESOURCES / "cell_cycle_g2m.txt"
    if not (s.exists() and g2m.exists()):
        pytest.skip("resources/gene_lists/cell_cycle_*.txt not present")
    return read_gene_list(s), read_gene_list(g2m)


def _scanpy(snap, fn, *args, **kw):
    import scanpy as sc

    ref = snap.copy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        getattr(sc.tl, fn)(ref, *args, **kw)
    return ref


def test_score_genes_equals_scanpy(scanpy_pbmc3k):
    snap = scanpy_pbmc3k["log1p"]
    ref = _scanpy(snap, "score_genes", T_CELL, score_name="t_cell")
    ours = lazy(snap, 700)
    with dask.config.set(scheduler="sync"):
        pp.score_genes(ours, T_CELL, score_name="t_cell")
    assert_scores_equal(ours.obs["t_cell"], ref.obs["t_cell"])
    assert ours.obs["t_cell"].dtype == np.float64
    assert isinstance(ours.X, dask.array.Array)

    pool = sorted(set(snap.var_names[::2]) | set(T_CELL[:-1]))
    kw = {"ctrl_size": 20, "n_bins": 10, "random_state": 7, "ctrl_as_ref": False, "gene_pool": pool}
    ref = _scanpy(snap, "score_genes", T_CELL, **kw)
    ours = lazy(snap, 700)
    with dask.config.set(scheduler="sync"):
        pp.score_genes(ours, T_CELL, **kw)
    assert_scores_equal(ours.obs["score"], ref.obs["score"])


def test_cell_cycle_equals_scanpy(scanpy_pbmc3k, cell_cycle):
    s_genes, g2m_genes = cell_cycle
    snap = scanpy_pbmc3k["log1p"]
    ref = _scanpy(snap, "score_genes_cell_cycle", s_genes=s_genes, g2m_genes=g2m_genes)
    ours = lazy(snap, 500)
    with dask.config.set(scheduler="sync"):
        pp.score_genes_cell_cycle(ours, s_genes=s_genes, g2m_genes=g2m_genes)
    for col in ("S_score", "G2M_score"):
        assert_scores_equal(ours.obs[col], ref.obs[col], err_msg=col)
    assert (ours.obs["phase"].astype(str) == ref.obs["phase"].astype(str)).all()
    assert set(ours.obs["phase"]) == {"G1", "S", "G2M"}


def test_dense_input_equals_scanpy(scanpy_pbmc3k, cell_cycle):
    s_genes, g2m_genes = cell_cycle
    snap = scanpy_pbmc3k["log1p"][:, :5000].copy()
    snap.X = snap.X.toarray()
    ref = _scanpy(snap, "score_genes_cell_cycle", s_genes=s_genes, g2m_genes=g2m_genes)
    ours = lazy(snap, 600, dense=True)
    with dask.config.set(scheduler="sync"):
        pp.score_genes_cell_cycle(ours, s_genes=s_genes, g2m_genes=g2m_genes)
    for col in ("S_score", "G2M_score"):
        np.testing.assert_array_equal(ours.obs[col].to_numpy(), ref.obs[col].to_numpy())


def test_same_result_for_chunk_sizes_and_workers(scanpy_pbmc3k, cell_cycle, client):
    s_genes, g2m_genes = cell_cycle
    runs = []
    for chunk in (250, 1000, 2638):
        a = lazy(scanpy_pbmc3k["log1p"], chunk)
        with dask.config.set(scheduler="sync"):
            pp.score_genes_cell_cycle(a, s_genes=s_genes, g2m_genes=g2m_genes)
        runs.append(a.obs[["S_score", "G2M_score", "phase"]])
    a = lazy(scanpy_pbmc3k["log1p"], 250)
    pp.score_genes_cell_cycle(a, s_genes=s_genes, g2m_genes=g2m_genes)  # 2-worker cluster
    runs.append(a.obs[["S_score", "G2M_score", "phase"]])
    for other in runs[1:]:
        pd.testing.assert_frame_equal(other, runs[0])  # bit-identical: sums follow row order, not chunks


def test_two_passes_for_both_scores(scanpy_pbmc3k, cell_cycle, tmp_path):
    s_genes, g2m_genes = cell_cycle
    path = store_of(scanpy_pbmc3k["log1p"], tmp_path / "log1p.zarr", 700)
    from atlasflow.store import open_store

    from atlasflow import passes

    a = open_store(path)
    passes.PASSES.clear()
    with dask.config.set(scheduler="sync"), count_x_passes(path) as reads:
        pp.score_genes_cell_cycle(a, s_genes=s_genes, g2m_genes=g2m_genes)
        pp.score_genes(a, T_CELL)
    assert reads["X"] == 2 + 2
    assert passes.summary() == {"log1p/X": 2 + 2}  # what the stage summary reports, from the task graphs


def test_bad_inputs(scanpy_pbmc3k):
    a = lazy(scanpy_pbmc3k["log1p"], 1000)
    with pytest.raises(InputError, match="none of the 2 genes for 'nothing'"):
        pp.score_genes(a, ["NOPE1", "NOPE2"], score_name="nothing")
    with pytest.raises(InputError, match="gene_pool"):
        pp.score_genes(a, ["CD3D"], gene_pool=["NOPE"])
    with pytest.raises(InputError, match="S_score"):
        pp.score_genes_cell_cycle(a, s_genes=["NOPE"], g2m_genes=["CD3D"])


def test_score_genes_stage(scanpy_pbmc3k, cell_cycle, client, tmp_path):
    from atlasflow.cli import stage_main
    from atlasflow.stages import score_genes
    from atlasflow.stages.score_genes import with_renamed

    s_genes, g2m_genes = cell_cycle
    snap = scanpy_pbmc3k["log1p"]
    src = store_of(snap, tmp_path / "log1p.zarr", 600)
    attach = ["--address", client.scheduler.address]
    out = tmp_path / "score.zarr"
    rc = stage_main(score_genes, argv=["--input", str(src), "--output", str(out), "--gene-list", ",".join(T_CELL),
                                       "--score-name", "t_cell", "--s-genes", str(RESOURCES / "cell_cycle_s.txt"),
                                       "--g2m-genes", str(RESOURCES / "cell_cycle_g2m.txt"), *attach])
    assert rc == 0
    got = ad.read_zarr(out)
    # the stage accepts old or new HGNC symbols (pbmc3k has CENPU, the list says MLF1IP)
    s_genes, g2m_genes = with_renamed(s_genes, snap.var_names), with_renamed(g2m_genes, snap.var_names)
    assert "CENPU" in s_genes
    ref = _scanpy(snap, "score_genes_cell_cycle", s_genes=s_genes, g2m_genes=g2m_genes)
    ref = _scanpy(ref, "score_genes", T_CELL, score_name="t_cell")
    for col in ("S_score", "G2M_score", "t_cell"):
        assert_scores_equal(got.obs[col], ref.obs[col], err_msg=col)
    assert (got.obs["phase"].astype(str) == ref.obs["phase"].astype(str)).all()
    assert (out / "X" / "data").exists()

    bad = tmp_path / "bad.zarr"
    rc = stage_main(score_genes, argv=["--input", str(src), "--output", str(bad), "--gene-list", "NOPE1,NOPE2",
                                       *attach])
    assert rc == 1 and not bad.exists() and not bad.with_suffix(".json").exists()
    rc = stage_main(score_genes, argv=["--input", str(src), "--output", str(bad), "--gene-list",
                                       str(tmp_path / "missing.txt"), *attach])
    assert rc == 1 and not bad.exists()
