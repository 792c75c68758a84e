"""The harmony stage against harmonypy itself, its effect on real plates (iLISI/cLISI), and bad input.

Data: the three mixology CEL-seq2 plates (five cell lines, genotype truth), log-normalised and reduced to 30
PCs in memory here (a store with X_pca and obs sample, as the pca stage leaves it).
"""

from __future__ import annotations

from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

from atlasflow.cli import stage_main
from atlasflow.stages import harmony as harmony_stage
from atlasflow.store import write_store

harmonypy = pytest.importorskip("harmonypy")
MIXOLOGY = Path(__file__).resolve().parents[2] / "shared" / "data" / "mixology_5cl"
PLATES = [f"sc_celseq2_5cl_p{i}" for i in (1, 2, 3)]


@pytest.fixture(scope="module")
def pca_store(tmp_path_factory) -> Path:
    if not MIXOLOGY.is_dir():
        pytest.skip("needs ../shared/data/mixology_5cl beside the repository")
    from sklearn.decomposition import PCA

    tables, lines = [], []
    for i, plate in enumerate(PLATES, 1):
        t = pd.read_csv(MIXOLOGY / f"{plate}.count.csv.gz", index_col=0).T
        t.index = f"p{i}_" + t.index
        tables.append(t)
        meta = pd.read_csv(MIXOLOGY / f"{plate}.metadata.csv.gz", index_col=0)
        lines.append(meta["cell_line_demuxlet"].to_numpy())
    counts = pd.concat(tables, join="inner")  # the genes all plates have
    x = counts.to_numpy(dtype=np.float64)
    x = np.log1p(x / x.sum(axis=1, keepdims=True) * 1e4)
    top = np.argsort(x.var(axis=0))[::-1][:2000]
    obs = pd.DataFrame({"sample": pd.Categorical([n.split("_")[0] for n in counts.index]),
                        "cell_line": np.concatenate(lines), "one": "all"}, index=counts.index)
    adata = ad.AnnData(X=sp.csr_matrix(x.astype(np.float32)), obs=obs)
    adata.obsm["X_pca"] = PCA(30, random_state=0).fit_transform(x[:, top] - x[:, top].mean(0)).astype(np.float32)
    path = tmp_path_factory.mktemp("harmony") / "pca.zarr"
    write_store(adata, path)
    return path


def run(*argv) -> int:
    return stage_main(harmony_stage, argv=[str(a) for a in argv])


def test_stage_equals_harmonypy_and_mixes_the_plates(pca_store, tmp_path):
    out = tmp_path / "harmony.zarr"
    assert run("--input", pca_store, "--output", out, "--key", "sample", "--label-key", "cell_line") == 0
    ours = ad.read_zarr(out)
    before = ad.read_zarr(pca_store)
    np.testing.assert_array_equal(ours.obsm["X_pca"], before.obsm["X_pca"])  # kept, not replaced
    ref = harmonypy.run_harmony(before.obsm["X_pca"].astype(np.float64), before.obs, ["sample"], random_state=0,
                                verbose=False)
    np.testing.assert_array_equal(ours.obsm["X_pca_harmony"], np.asarray(ref.Z_corr).astype(np.float32))
    # the effect on real plates: the plates mix (iLISI up), the five cell lines stay apart (cLISI near 1)
    lisi = {name: harmonypy.compute_lisi(emb, ours.obs, ["sample", "cell_line"])
            for name, emb in (("before", ours.obsm["X_pca"]), ("after", ours.obsm["X_pca_harmony"]))}
    ilisi = {k: float(np.median(v[:, 0])) for k, v in lisi.items()}
    clisi = {k: float(np.median(v[:, 1])) for k, v in lisi.items()}
    assert ilisi["after"] > ilisi["before"] + 0.2, ilisi
    assert clisi["after"] < 1.3, clisi
    # the stage's own report of the same medians (all cells here: fewer than its 20,000-cell sample)
    import json

    recorded = json.loads(out.with_suffix(".json").read_text())["lisi_median"]
    assert recorded["X_pca"]["sample"] == pytest.approx(ilisi["before"], abs=1e-4)
    assert recorded["X_pca_harmony"]["sample"] == pytest.approx(ilisi["after"], abs=1e-4)
    assert recorded["X_pca_harmony"]["cell_line"] == pytest.approx(clisi["after"], abs=1e-4)


def test_single_batch_is_a_logged_copy(pca_store, tmp_path, capsys):
    out = tmp_path / "one.zarr"
    assert run("--input", pca_store, "--output", out, "--key", "one") == 0
    assert "has a single batch: nothing to correct" in capsys.readouterr().err
    a = ad.read_zarr(out)
    np.testing.assert_array_equal(a.obsm["X_pca_harmony"], a.obsm["X_pca"])


@pytest.mark.parametrize(("argv", "message"), [
    (["--key", "plate"], r"harmony.key: plate not in obs"),
    (["--key", "sample", "--basis", "X_umap"], r"obsm\['X_umap'\] missing"),
    (["--key", "sample", "--max-iter-harmony", "0"], "max_iter_harmony"),
    (["--key", "sample", "--label-key", "celltype"], r"harmony.label_key: celltype not in obs"),
])
def test_bad_input_is_one_line_and_no_store(pca_store, tmp_path, capsys, argv, message):
    import re

    out = tmp_path / "bad.zarr"
    assert run("--input", pca_store, "--output", out, *argv) != 0
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert "Traceback" not in err and not out.exists()
