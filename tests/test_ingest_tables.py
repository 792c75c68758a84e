"""Dense count tables (plate-style inputs) and sample sheets whose samples have different gene sets.

Oracle: pandas reading the whole table (small here), and, on the real mixology plates, pandas' outer join of
the three plates on gene ids.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

from atlasflow.cli import stage_main
from atlasflow.errors import InputError
from atlasflow.io import DenseTableReader, detect_format, open_input
from atlasflow.stages import ingest

MIXOLOGY = Path(__file__).resolve().parents[2] / "shared" / "data" / "mixology_5cl"
pytestmark = pytest.mark.filterwarnings("ignore:Suffix used:UserWarning")


def counts(n_cells=37, n_genes=23, seed=0) -> pd.DataFrame:
    """Cells x genes integer counts, ~70% zeros, an empty cell, Ensembl-like gene ids."""
    rng = np.random.default_rng(seed)
    x = rng.integers(1, 40, (n_cells, n_genes)) * (rng.random((n_cells, n_genes)) < 0.3)
    x[4] = 0
    return pd.DataFrame(x, index=[f"p{seed}_W{i}" for i in range(n_cells)],
                        columns=[f"ENSG{seed:02d}{j:09d}" for j in range(n_genes)])


def write_table(path: Path, table: pd.DataFrame, *, corner: str | None = None) -> Path:
    """As R's write.csv (no corner cell: corner=None) or with a corner cell; gzipped when the name ends .gz."""
    sep = "," if ".csv" in path.name else "\t"
    lines = [sep.join(([] if corner is None else [corner]) + [f'"{c}"' for c in table.columns])]
    lines += [sep.join([f'"{name}"', *map(str, row)]) for name, row in zip(table.index, table.to_numpy(), strict=True)]
    text = "\n".join(lines) + "\n"
    if path.name.endswith(".gz"):
        with gzip.open(path, "wt") as fh:
            fh.write(text)
    else:
        path.write_text(text)
    return path


def run_ingest(*argv) -> int:
    return stage_main(ingest, argv=[str(a) for a in argv])


@pytest.mark.parametrize(("name", "transpose", "corner"), [
    ("plate.count.csv.gz", True, None),    # genes x cells, R's write.csv, gzipped (the mixology layout)
    ("plate.tsv", True, "gene"),           # genes x cells with a corner cell, plain TSV
    ("cells.csv", False, ""),              # cells x genes, empty corner cell
    ("cells.txt.gz", False, None),         # cells x genes, tab-separated .txt
])
def test_table_roundtrips_exactly(name, transpose, corner, tmp_path):
    table = counts()
    path = write_table(tmp_path / name, table.T if transpose else table, corner=corner)
    assert detect_format(path) == ("table", path)
    out = tmp_path / "o.zarr"
    # small blocks and steps: many blocks, several lines per step, spilled when transposed
    ingest.ingest(path, out, chunk_rows=5, entries_per_step=60)
    a = ad.read_zarr(out)
    assert list(a.obs_names) == list(table.index)
    assert list(a.var["gene_ids"]) == list(table.columns)
    assert a.X.dtype == np.float32
    assert (a.X != sp.csr_matrix(table.to_numpy(dtype=np.float32))).nnz == 0
    assert not list(tmp_path.glob("**/.atlasflow-spill-*"))


def test_blocks_hold_one_block_of_cells(tmp_path):
    table = counts(n_cells=41)
    reader = open_input(write_table(tmp_path / "t.csv", table.T), entries_per_step=50)
    assert isinstance(reader, DenseTableReader)
    assert reader.kind == "table_genes_x_cells" and reader.shape == table.shape
    reader.spill_dir = tmp_path / "spill"
    blocks = list(reader.raw_blocks(8))
    assert [b.shape[0] for b in blocks] == [8, 8, 8, 8, 8, 1]
    assert (sp.vstack(blocks) != sp.csr_matrix(table.to_numpy(dtype=float))).nnz == 0
    reader = open_input(write_table(tmp_path / "c.csv", table))
    assert reader.kind == "table_cells_x_genes"
    assert [b.shape[0] for b in reader.raw_blocks(8)] == [8, 8, 8, 8, 8, 1]


def test_orientation_from_names_or_setting(tmp_path, caplog):
    table = counts()
    table.columns = [f"gene{j}" for j in range(table.shape[1])]  # names that tell nothing
    path = write_table(tmp_path / "t.csv", table)
    with pytest.raises(InputError, match="cannot tell whether its rows are genes or cells.*table_orientation"):
        open_input(path)
    assert open_input(path, table_orientation="cells_x_genes").shape == table.shape
    assert open_input(path, table_orientation="genes_x_cells").shape == table.shape[::-1]
    # a ubiquitous symbol is enough
    table.columns = ["GAPDH", *table.columns[1:]]
    with caplog.at_level("INFO"):
        assert open_input(write_table(tmp_path / "s.csv", table)).kind == "table_cells_x_genes"
    assert "read as cells x genes" in caplog.text
    out = tmp_path / "o.zarr"
    assert run_ingest("--input", path, "--output", out, "--table-orientation", "cells_x_genes") == 0
    assert ad.read_zarr(out).shape == table.shape


@pytest.mark.parametrize(("text", "message"), [
    ('"a","b"\n"ENSG00000000001",1,2\n"ENSG00000000002",1,x\n', r"non-numeric value 'x' on line 3, column 3"),
    ('"a","b"\n"ENSG00000000001",1,2,3\n', "header has 2 names but the first row 4 fields"),
    ('"a","b"\n', "needs a header line and at least one row"),
    ('"a","b"\n"ENSG00000000001",1,2\n"ENSG00000000002",1\n', "NaN or infinite"),  # a short line
    ('"a","b"\n"ENSG00000000001",1,2\n"ENSG00000000002",1,2,3\n', "malformed"),  # a long one
    ('"a","b"\n"ENSG00000000001",1,\n', "NaN or infinite"),
    ('"a","b"\n"ENSG00000000001",1,2.5\n', "non-integer value 2.5"),
])
def test_bad_tables_are_one_line_and_leave_nothing(text, message, tmp_path, capsys):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    out = tmp_path / "o.zarr"
    assert run_ingest("--input", path, "--output", out) == 1
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert not out.exists()


def test_truncated_gzip_table_is_an_error(tmp_path, capsys):
    path = write_table(tmp_path / "t.csv.gz", counts(n_cells=400).T)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    out = tmp_path / "o.zarr"
    assert run_ingest("--input", path, "--output", out) == 1
    assert "truncated" in capsys.readouterr().err
    assert not out.exists()


def test_sample_sheet_mixes_formats_and_takes_the_union_of_genes(tmp_path, capsys):
    """A CSV plate, a TSV plate and a 10x mtx folder with overlapping gene sets: the store's genes are the
    union by id (first sample's order, then new ones), a sample's missing genes are zeros, logged."""
    a, b, c = counts(seed=1), counts(seed=1, n_cells=29), counts(seed=1, n_cells=11)
    b = b.rename(columns=dict(zip(b.columns[:5], [f"ENSGNEW{j:08d}" for j in range(5)], strict=True)))  # 5 new
    b.index = [f"B{i}" for i in range(len(b))]
    c = c.iloc[:, ::-1].iloc[:, :20]  # another order, 3 genes fewer
    c.index = [f"C{i}" for i in range(len(c))]
    write_table(tmp_path / "a.csv.gz", a.T)
    write_table(tmp_path / "b.tsv", b, corner="cell")
    mtx = tmp_path / "c"
    mtx.mkdir()
    sp_c = sp.coo_matrix(c.to_numpy().T)
    with open(mtx / "matrix.mtx", "w") as fh:
        fh.write("%%MatrixMarket matrix coordinate integer general\n")
        fh.write(f"{c.shape[1]} {c.shape[0]} {sp_c.nnz}\n")
        for g, k, v in zip(sp_c.row, sp_c.col, sp_c.data, strict=True):
            fh.write(f"{g + 1} {k + 1} {v}\n")
    pd.DataFrame({0: c.columns, 1: c.columns, 2: "Gene Expression"}).to_csv(mtx / "features.tsv", sep="\t",
                                                                            header=False, index=False)
    pd.Series(c.index).to_csv(mtx / "barcodes.tsv", header=False, index=False)
    sheet = tmp_path / "sheet.tsv"
    sheet.write_text("sample\tpath\tplate\none\ta.csv.gz\tp1\ntwo\tb.tsv\tp2\nthree\tc\tp3\n")
    out = tmp_path / "all.zarr"
    assert run_ingest("--sample-sheet", sheet, "--output", out, "--var-names", "gene_ids", "--chunk-rows", 7) == 0
    log = capsys.readouterr().err
    got = ad.read_zarr(out)
    oracle = pd.concat([a, b, c], axis=0, join="outer").fillna(0)  # pandas' outer join on gene ids
    union = list(a.columns) + [g for g in b.columns if g not in set(a.columns)]
    assert list(got.var_names) == union and set(union) == set(oracle.columns)
    expected = oracle[union].to_numpy(dtype=np.float32)
    assert got.shape == expected.shape
    assert (got.X != sp.csr_matrix(expected)).nnz == 0
    assert list(got.obs["plate"].iloc[[0, len(a), len(a) + len(b)]]) == ["p1", "p2", "p3"]
    summary = json.loads(out.with_suffix(".json").read_text())
    assert summary["genes_missing"] == {"one": 5, "two": 5, "three": 8}
    assert summary["formats"] == {"one": "table_genes_x_cells", "two": "table_cells_x_genes", "three": "10x_mtx_v3"}
    assert "sample two: 5 of its 23 genes are new" in log
    assert "sample three lacks 8" in log


def test_repeated_gene_ids_cannot_be_matched(tmp_path):
    a, b = counts(seed=1), counts(seed=2)
    b.columns = [b.columns[0], *b.columns[:-1]]  # an id twice
    write_table(tmp_path / "a.csv", a.T)
    write_table(tmp_path / "b.csv", b.T)
    sheet = tmp_path / "sheet.tsv"
    sheet.write_text("sample\tpath\none\ta.csv\ntwo\tb.csv\n")
    from atlasflow.io import read_sample_sheet

    with pytest.raises(InputError, match=r"sample two .*gene ids repeat"):
        ingest.ingest(read_sample_sheet(sheet), tmp_path / "o.zarr")
    assert not (tmp_path / "o.zarr").exists()


@pytest.mark.skipif(not MIXOLOGY.is_dir(), reason="needs ../shared/data/mixology_5cl beside the repository")
def test_mixology_plates_from_one_sample_sheet(tmp_path):
    """The three real CEL-seq2 plates (genes x cells, gzipped CSV, different gene sets) against pandas'
    outer join of the three tables on gene ids."""
    plates = [f"sc_celseq2_5cl_p{i}" for i in (1, 2, 3)]
    sheet = tmp_path / "sheet.tsv"
    sheet.write_text("sample\tpath\n" + "".join(f"p{i}\t{MIXOLOGY / p}.count.csv.gz\n"
                                                 for i, p in zip((1, 2, 3), plates, strict=True)))
    out = tmp_path / "mix.zarr"
    assert run_ingest("--sample-sheet", sheet, "--output", out, "--var-names", "gene_ids") == 0
    got = ad.read_zarr(out)
    tables = [pd.read_csv(MIXOLOGY / f"{p}.count.csv.gz", index_col=0).T for p in plates]
    oracle = pd.concat(tables, axis=0, join="outer").fillna(0)
    assert got.shape == oracle.shape == (909, 16074)
    expected = sp.csr_matrix(oracle[list(got.var_names)].to_numpy(dtype=np.float32))
    assert (got.X != expected).nnz == 0
    assert got.X.nnz == 5_010_785  # the dataset README's count for this join
    assert list(got.obs_names[:2]) == [f"p1_{c}" for c in tables[0].index[:2]]
    assert got.obs["sample"].value_counts().to_dict() == {"p1": 297, "p2": 307, "p3": 305}
