"""Plots from tiny synthetic stores: every PNG exists, has its declared size and is not blank; bounded memory."""

from __future__ import annotations

import json
import time
import tracemalloc

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
from _report_stores import build  # noqa: E402

from atlasflow import plots as pl  # noqa: E402
from atlasflow.cli import stage_main  # noqa: E402
from atlasflow.stages import plots as stage  # noqa: E402


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    return build(tmp_path_factory.mktemp("stores"))


def _check_png(path, name, dpi):
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    img = plt.imread(path)
    w, h = pl.pixel_size(name, dpi)
    assert img.shape[:2] == (h, w), (name, img.shape)
    assert img[..., :3].var() > 0, f"{name} is blank"


def test_all_plots(stores, tmp_path):
    paths, _ = stores
    out = tmp_path / "plots"
    argv = ["--output", str(out), "--summary", str(tmp_path / "plots.json"), "--dpi", "60",
            "--qc-store", str(paths["qc"]), "--hvg-store", str(paths["hvg"]),
            "--embedding-store", str(paths["umap"]), "--clusters-store", str(paths["leiden"]),
            "--markers-store", str(paths["rank_genes_groups"]), "--uncorrected-store", str(paths["umap_uncorrected"]),
            "--thresholds", json.dumps({"min_genes": 20, "max_genes": 55, "max_pct_mt": 40})]
    assert stage_main(stage, argv=argv) == 0
    for name in stage.ALL_PLOTS:
        _check_png(out / f"{name}.png", name, 60)
    summary = json.loads((tmp_path / "plots.json").read_text())
    assert set(summary["plots"]) == set(stage.ALL_PLOTS)


def test_missing_store_is_an_error(stores, tmp_path):
    paths, _ = stores
    argv = ["--output", str(tmp_path / "p"), "--summary", str(tmp_path / "p.json"),
            "--qc-store", str(paths["qc"]), "--plots", "umap"]
    assert stage_main(stage, argv=argv) == 1


def test_umap_batch_draws_before_and_after_by_batch_and_cluster(stores, tmp_path):
    """umap_batch: one row per batch key and the clusters, the uncorrected UMAP left of the integrated one; each
    panel shows its own store's layout; without the uncorrected store one column; other cells are an error."""
    from atlasflow.cli import build_parser
    from atlasflow.store import open_store

    paths, _ = stores
    base = ["--summary", str(tmp_path / "p.json"), "--embedding-store", str(paths["umap"]),
            "--clusters-store", str(paths["leiden"]), "--plots", "umap_batch", "--dpi", "40"]
    args = build_parser(stage, "plots").parse_args(["--output", str(tmp_path / "a"), *base, "--uncorrected-store",
                                            str(paths["umap_uncorrected"]), "--batch-keys", "sample", "absent"])
    fig = stage._umap_batch(args)
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert titles == ["uncorrected: sample", "integrated: sample", "uncorrected: leiden", "integrated: leiden"]
    before = np.asarray(open_store(paths["umap_uncorrected"]).obsm["X_umap"])
    after = np.asarray(open_store(paths["umap"]).obsm["X_umap"])
    assert not np.allclose(before, after)
    for ax, xy in zip(fig.axes[:2], (before, after), strict=True):  # each panel spans its own embedding
        lo, hi = ax.get_xlim()
        assert lo <= xy[:, 0].min() and xy[:, 0].max() <= hi and hi - lo < 1.5 * np.ptp(xy[:, 0])
    plt.close(fig)
    args = build_parser(stage, "plots").parse_args(["--output", str(tmp_path / "b"), *base])
    fig = stage._umap_batch(args)
    assert [ax.get_title() for ax in fig.axes if ax.get_title()] == ["UMAP: sample", "UMAP: leiden"]
    plt.close(fig)
    wrong = ["--output", str(tmp_path / "c"), *base, "--uncorrected-store", str(paths["qc"])]
    assert stage_main(stage, argv=wrong) == 1  # the qc store has no X_umap: one line, no figure
    assert not (tmp_path / "c" / "umap_batch.png").exists()


def test_marker_means_one_pass(stores):
    paths, adata = stores
    genes = ["G10", "G15", "G3"]
    mean, frac, _ = stage.group_means(paths["rank_genes_groups"], "leiden", genes)
    for g in mean.index:
        sub = adata[adata.obs["leiden"] == g, genes].X.toarray()
        np.testing.assert_allclose(mean.loc[g].to_numpy(), sub.mean(axis=0), rtol=1e-5)
        np.testing.assert_allclose(frac.loc[g].to_numpy(), (sub > 0).mean(axis=0))


def test_binned_scatter_memory_bound():
    """2M points are binned into images, not drawn one by one, with < 128 MiB allocated beyond the inputs."""
    n = 2_000_000
    rng = np.random.default_rng(0)
    xy = rng.normal(size=(n, 2)).astype(np.float32)
    obs = pd.DataFrame({"leiden": pd.Categorical(rng.integers(0, 12, n).astype(str)),
                        "total_counts": rng.gamma(2.0, 1000.0, n)})
    tracemalloc.start()
    t0 = time.time()
    fig = pl.embedding("umap", xy, obs, ["leiden", "total_counts"], basis="UMAP", dpi=50)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    elapsed = time.time() - t0
    # the bound: temporaries of one slice of BIN_SLICE points + the images; nothing O(n) (measured ~85 MiB,
    # the same for 10M points)
    assert peak < 128 * 2**20, f"peak {peak / 2**20:.0f} MiB"
    assert elapsed < 60
    assert all(len(ax.collections) == 0 for ax in fig.axes[:2])  # images, not 2M-point scatters
    plt.close(fig)


def test_small_scatter_is_rasterized():
    fig, ax = plt.subplots()
    pl.scatter_embedding(ax, np.random.default_rng(0).normal(size=(500, 2)), pd.Series(np.arange(500.0)))
    assert ax.collections[0].get_rasterized()
    plt.close(fig)


def test_figures_read_at_a_glance():
    """UMAP legend readable (>= 8 pt), dot plot axes titled, a gene range's two thresholds in two styles."""
    rng = np.random.default_rng(0)
    obs = pd.DataFrame({"leiden": pd.Categorical(rng.integers(0, 8, 500).astype(str)),
                        "n_genes_by_counts": rng.normal(1000, 200, 500), "total_counts": rng.normal(3000, 500, 500),
                        "pct_counts_mt": rng.uniform(0, 10, 500), "sample": pd.Categorical(["s1"] * 500)})
    fig = pl.embedding("umap", rng.normal(size=(500, 2)), obs, ["leiden"])
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert legends and min(t.get_fontsize() for t in legends[0].get_texts()) >= 8
    plt.close(fig)
    mean = pd.DataFrame(rng.random((3, 4)), index=["0", "1", "2"], columns=list("ABCD"))
    fig = pl.marker_dotplot(mean, mean / 2)
    ax = fig.axes[0]
    assert ax.get_xlabel() and ax.get_ylabel()
    plt.close(fig)
    fig = pl.qc_violin(obs, {"min_genes": 500, "max_genes": 1500})
    lines = [ln for ax in fig.axes for ln in ax.get_lines() if ln.get_label().startswith(("min_genes", "max_genes"))]
    assert len(lines) == 2 and lines[0].get_linestyle() != lines[1].get_linestyle()
    assert lines[0].get_color() != lines[1].get_color()
    plt.close(fig)
