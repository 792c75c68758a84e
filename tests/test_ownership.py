"""An output replaces only what atlasflow wrote: a user's folder or file at an output path is refused and kept."""

from __future__ import annotations

import json

import matplotlib.pyplot as plt
import pytest

from atlasflow import ownership, plots
from atlasflow.cli import stage_main
from atlasflow.errors import OutputError
from atlasflow.simulate import SimParams, write_simulated
from atlasflow.stages import final as final_stage
from atlasflow.stages import normalize as normalize_stage
from atlasflow.stages import rank_genes_groups as rgg_stage
from atlasflow.store import open_store, write_store


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    path = tmp_path_factory.mktemp("own") / "raw.zarr"
    write_simulated(path, SimParams(n_cells=300, n_genes=200, n_cell_types=3, seed=1), chunk_rows=100)
    return path


def _normalize(raw, output, capsys, *extra):
    rc = stage_main(normalize_stage, argv=["--input", str(raw), "--output", str(output), "--n-workers", "1",
                                           *map(str, extra)])
    err = capsys.readouterr().err.strip().splitlines()
    return rc, err[-1] if err else ""


def _tree(path):
    return sorted((str(p.relative_to(path)), p.read_bytes() if p.is_file() else None) for p in path.rglob("*"))


def test_user_folder_at_the_output_is_refused_and_kept(raw, tmp_path, capsys):
    home = tmp_path / "home"
    (home / "docs").mkdir(parents=True)
    (home / "docs" / "a.txt").write_text("data")
    (home / "b.txt").write_text("data")
    before = _tree(home)
    rc, err = _normalize(raw, home, capsys)
    assert rc == 1
    assert str(home) in err and "atlasflow replaces only its own outputs" in err
    assert _tree(home) == before
    assert not list(tmp_path.glob(".home.tmp-*"))


def test_folder_named_like_a_store_is_refused(raw, tmp_path, capsys):
    precious = tmp_path / "precious.zarr"
    precious.mkdir()
    (precious / "notes.txt").write_text("mine")
    rc, err = _normalize(raw, precious, capsys)
    assert rc == 1 and "precious.zarr" in err
    assert (precious / "notes.txt").read_text() == "mine"


def test_user_file_dropped_into_an_atlasflow_store_keeps_it(raw, tmp_path, capsys):
    out = tmp_path / "norm.zarr"
    assert _normalize(raw, out, capsys)[0] == 0
    assert ownership.is_atlasflow_store(out)
    (out / "my_notes.txt").write_text("mine")
    rc, err = _normalize(raw, out, capsys)
    assert rc == 1 and str(out) in err
    assert (out / "my_notes.txt").read_text() == "mine"


def test_own_store_and_summary_are_replaced(raw, tmp_path, capsys):
    out = tmp_path / "norm.zarr"
    assert _normalize(raw, out, capsys)[0] == 0
    first = open_store(out).uns  # noqa: F841 - the store opens
    sid = json.loads((out / "zarr.json").read_text())["attributes"]["atlasflow"]["store_id"]
    assert _normalize(raw, out, capsys, "--target-sum", "1000")[0] == 0
    assert json.loads((out / "zarr.json").read_text())["attributes"]["atlasflow"]["store_id"] != sid
    assert ownership.is_atlasflow_file(tmp_path / "norm.json")


def test_output_that_is_a_file_fails_before_any_work(raw, tmp_path, capsys):
    out = tmp_path / "results.zarr"
    out.write_text("a user's file")
    rc, err = _normalize(raw, out, capsys)
    assert rc == 1 and "is a file" in err
    assert out.read_text() == "a user's file"
    assert not (tmp_path / "results.json").exists()  # refused before the stage ran


def test_user_summary_file_is_refused_before_any_work(raw, tmp_path, capsys):
    summary = tmp_path / "norm.json"
    summary.write_text('{"mine": true}')
    rc, err = _normalize(raw, tmp_path / "norm.zarr", capsys)
    assert rc == 1 and "norm.json" in err
    assert summary.read_text() == '{"mine": true}'
    assert not (tmp_path / "norm.zarr").exists()


def test_edited_summary_is_no_longer_atlasflows(raw, tmp_path, capsys):
    assert _normalize(raw, tmp_path / "norm.zarr", capsys)[0] == 0
    (tmp_path / "norm.json").write_text("{}\n")  # the user reused the name for their own notes
    rc, err = _normalize(raw, tmp_path / "norm.zarr", capsys)
    assert rc == 1 and "norm.json" in err and (tmp_path / "norm.json").read_text() == "{}\n"


@pytest.mark.parametrize("where", ["folder holding the input", "the input itself", "inside the input"])
def test_output_overlapping_the_input_is_refused(raw, tmp_path, capsys, where):
    import shutil

    data = tmp_path / "data"
    data.mkdir()
    src = data / "in.zarr"
    shutil.copytree(raw, src)
    (data / "unrelated.txt").write_text("keep")
    out = {"folder holding the input": data, "the input itself": src, "inside the input": src / "X"}[where]
    before = _tree(data)
    rc, err = _normalize(src, out, capsys)
    assert rc == 1 and "input" in err
    assert _tree(data) == before


def test_marker_csv_and_gene_major_folder_of_a_user_are_refused(raw, tmp_path, capsys):
    csv = tmp_path / "markers.csv"
    csv.write_text("gene,score\n")
    rc = stage_main(rgg_stage, argv=["--input", str(raw), "--output", str(tmp_path / "m.zarr"), "--groupby",
                                     "cell_type", "--markers-csv", str(csv), "--n-workers", "1"])
    assert rc == 1 and "markers.csv" in capsys.readouterr().err
    assert csv.read_text() == "gene,score\n"
    folder = tmp_path / "genes"
    folder.mkdir()
    (folder / "keep.txt").write_text("keep")
    rc = stage_main(rgg_stage, argv=["--input", str(raw), "--output", str(tmp_path / "m.zarr"), "--groupby",
                                     "cell_type", "--method", "wilcoxon", "--gene-major", str(folder),
                                     "--n-workers", "1"])
    assert rc == 1 and "genes" in capsys.readouterr().err
    assert (folder / "keep.txt").read_text() == "keep"
    assert not (tmp_path / "m.zarr").exists()


def test_user_h5ad_is_refused(raw, tmp_path, capsys):
    h5ad = tmp_path / "mine.h5ad"
    h5ad.write_bytes(b"not ours")
    rc = stage_main(final_stage, argv=["--input", str(raw), "--output", str(tmp_path / "final.zarr"),
                                       "--h5ad", str(h5ad)])
    assert rc == 1 and "mine.h5ad" in capsys.readouterr().err
    assert h5ad.read_bytes() == b"not ours"


def test_plot_over_a_user_png_is_refused_and_own_png_replaced(tmp_path):
    png = tmp_path / "umap.png"
    png.write_bytes(b"\x89PNG user picture")
    fig = plt.figure()
    with pytest.raises(OutputError, match="umap.png"):
        plots.save(fig, png)
    assert png.read_bytes() == b"\x89PNG user picture"
    own = tmp_path / "qc.png"
    plots.save(plt.figure(), own)
    plots.save(plt.figure(), own)  # its own file: replaced
    assert ownership.is_atlasflow_file(own)


def test_write_store_from_a_notebook_keeps_a_user_folder(raw, tmp_path):
    folder = tmp_path / "analysis"
    folder.mkdir()
    (folder / "x.txt").write_text("keep")
    with pytest.raises(OutputError, match="analysis"):
        write_store(open_store(raw), folder)
    assert (folder / "x.txt").read_text() == "keep"
