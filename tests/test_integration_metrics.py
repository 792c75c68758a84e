"""Integration metrics of the leiden stage (#24 item 3): graph iLISI/cLISI by hand on small graphs, and the
stage's table (leiden.metrics.csv, summary) on three blobs with a batch column that mixes and one that does not,
against scikit-learn's ARI/NMI; bad input."""

from __future__ import annotations

import json
from pathlib import Path

import anndata as ad
import dask.array as da
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score

from atlasflow.cli import stage_main
from atlasflow.stages import leiden as leiden_stage
from atlasflow.stages import neighbors as neighbors_stage
from atlasflow.store import write_store
from atlasflow.tl.metrics import graph_lisi


def run(stage, *argv) -> int:
    return stage_main(stage, argv=[str(a) for a in argv])


def test_graph_lisi_by_hand():
    # 4 cells in a ring, each with its two ring neighbours: cell 0 sees itself (a), 1 (b), 3 (b)
    ring = sp.csr_matrix(np.array([[0, 1, 0, 1], [1, 0, 1, 0], [0, 1, 0, 1], [1, 0, 1, 0]], dtype=float))
    lisi = graph_lisi(ring, ["a", "b", "a", "b"])
    np.testing.assert_allclose(lisi, 1 / ((1 / 3) ** 2 + (2 / 3) ** 2))
    np.testing.assert_allclose(graph_lisi(ring, ["a"] * 4), 1.0)  # one label: 1
    # two cliques of one label each: 1 everywhere; fully mixed pairs: 2
    cliques = sp.block_diag([np.ones((3, 3)) - np.eye(3)] * 2).tocsr()
    np.testing.assert_allclose(graph_lisi(cliques, list("aaabbb")), 1.0)
    pairs = sp.csr_matrix(np.kron(np.eye(3), [[0, 1], [1, 0]]))
    np.testing.assert_allclose(graph_lisi(pairs, list("ababab")), 2.0)
    # a missing label counts as none; a cell whose neighbourhood has no label gets NaN
    lone = graph_lisi(sp.csr_matrix((2, 2)), [None, "a"])
    assert np.isnan(lone[0]) and lone[1] == 1.0


@pytest.fixture(scope="module")
def graph_store(tmp_path_factory) -> Path:
    """90 cells in 3 blobs; `plate` alternates within every blob (mixed), `line` is the blob (kept apart)."""
    rng = np.random.default_rng(0)
    n = 90
    emb = (rng.normal(size=(n, 8)) + np.repeat(np.eye(3, 8) * 10, n // 3, axis=0)).astype(np.float32)
    obs = pd.DataFrame({"line": pd.Categorical(np.repeat(["x", "y", "z"], n // 3)),
                        "plate": pd.Categorical(np.tile(["p1", "p2"], n // 2)), "one": "all"},
                       index=[f"c{i}" for i in range(n)])
    x = da.from_array(sp.random(n, 20, density=0.3, random_state=1, format="csr", dtype=np.float32),
                      chunks=(50, 20), asarray=False)
    d = tmp_path_factory.mktemp("metrics")
    write_store(ad.AnnData(X=x, obs=obs, var=pd.DataFrame(index=[f"g{j}" for j in range(20)]),
                           obsm={"X_pca": emb}), d / "pca.zarr")
    assert run(neighbors_stage, "--input", d / "pca.zarr", "--output", d / "neighbors.zarr", "--n-neighbors", 10) == 0
    return d / "neighbors.zarr"


def test_leiden_writes_the_metrics_table(graph_store, tmp_path):
    out = tmp_path / "leiden.zarr"
    assert run(leiden_stage, "--input", graph_store, "--output", out, "--batch-key", "plate", "one", "donor",
               "--label-key", "line", "--summary", tmp_path / "leiden.json") == 0
    table = pd.read_csv(tmp_path / "leiden.metrics.csv").set_index("metric")
    # `one` (a single batch) and `donor` (not in obs) are left out
    assert list(table.index) == ["iLISI (graph, median)", "cLISI (graph, median)", "ARI (leiden vs labels)",
                                 "NMI (leiden vs labels)"]
    assert table.loc["iLISI (graph, median)", "key"] == "plate" and table.loc["iLISI (graph, median)", "best"] == 2
    assert table.loc["iLISI (graph, median)", "value"] > 1.8  # the plates mix within every blob
    assert table.loc["cLISI (graph, median)", "value"] == 1.0  # the lines stay apart
    leiden = ad.read_zarr(out).obs["leiden"]
    line = ad.read_zarr(out).obs["line"]
    assert table.loc["ARI (leiden vs labels)", "value"] == round(adjusted_rand_score(line, leiden), 4)
    assert table.loc["NMI (leiden vs labels)", "value"] == round(normalized_mutual_info_score(line, leiden), 4)
    summary = json.loads((tmp_path / "leiden.json").read_text())
    assert [r["metric"] for r in summary["integration"]] == list(table.index)


def test_leiden_without_labels_or_batches_writes_an_empty_table(graph_store, tmp_path):
    out = tmp_path / "leiden.zarr"
    assert run(leiden_stage, "--input", graph_store, "--output", out, "--batch-key", "sample") == 0
    table = pd.read_csv(tmp_path / "leiden.metrics.csv")
    assert table.empty and list(table.columns) == ["metric", "key", "value", "best", "n_labels"]


def test_missing_label_key_is_one_line_and_writes_nothing(graph_store, tmp_path, capsys):
    out = tmp_path / "leiden.zarr"
    assert run(leiden_stage, "--input", graph_store, "--output", out, "--label-key", "celltype") == 1
    err = capsys.readouterr().err
    assert "leiden.label_key: celltype not in obs" in err
    assert not out.exists() and not (tmp_path / "leiden.metrics.csv").exists()
