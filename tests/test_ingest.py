"""ingest: every input format written here in its real on-disk layout, streamed into a store and compared.

A small random count matrix (with duplicated gene symbols, antibody features, an empty cell and explicit
zeros) is written as 10x h5 (v2, v3), 10x mtx folders (v2, v3, gzipped or not, sorted by cell or by
gene), h5ad (counts in X/layer/raw, CSR/CSC/dense) and AnnData zarr, then ingested and compared exactly.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import anndata as ad
import h5py
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

from atlasflow.cli import stage_main
from atlasflow.errors import InputError
from atlasflow.io import CountCheck, RestartStream, clean_block, open_input, read_sample_sheet
from atlasflow.io._blocks import RowBuckets
from atlasflow.stages import ingest
from atlasflow.store import open_store

N_CELLS, N_GENES, N_AB = 53, 19, 3  # N_AB trailing "Antibody Capture" features
pytestmark = [pytest.mark.filterwarnings("ignore:Suffix used:UserWarning"),
              pytest.mark.filterwarnings("ignore:Writing zarr v2 data:UserWarning")]


# --------------------------------------------------------------------------------------------------
# a source matrix and writers of each on-disk layout


class Source:
    """Counts (cells x features, CSR with some explicit zeros), barcodes and feature annotations."""

    def __init__(self, seed=0, n_cells=N_CELLS, n_genes=N_GENES, n_ab=N_AB):
        rng = np.random.default_rng(seed)
        m = n_genes + n_ab
        x = sp.random(n_cells, m, density=0.3, format="csr", random_state=rng,
                      data_rvs=lambda k: rng.integers(1, 30, k)).astype(np.float32)
        x = x.tolil()
        x[3, :] = 0  # an empty cell
        x = x.tocsr()
        x.data[::7] = 0  # explicit zeros that ingest must drop
        self.x = x
        self.barcodes = np.array([f"C{seed}{i:03d}-1" for i in range(n_cells)])
        self.ids = np.array([f"ENSG{seed}{j:05d}" for j in range(m)])
        symbols = [f"G{j}" for j in range(m)]
        if m > 9:
            symbols[5] = symbols[9] = "CRIP1"  # duplicated symbol -> CRIP1, CRIP1-2 (see below)
            symbols[2] = "CRIP1-1"  # a name colliding with the suffix rule
        self.symbols = np.array(symbols)
        self.types = np.array(["Gene Expression"] * n_genes + ["Antibody Capture"] * n_ab)

    @property
    def gex(self) -> np.ndarray:
        return self.types == "Gene Expression"

    def expected(self, gex_only=True) -> sp.csr_matrix:
        x = self.x[:, np.flatnonzero(self.gex)] if gex_only else self.x.copy()
        x.eliminate_zeros()
        return x

    def var(self, gex_only=True) -> pd.DataFrame:
        keep = self.gex if gex_only else np.ones(len(self.ids), bool)
        return pd.DataFrame({"gene_ids": self.ids[keep], "gene_symbols": self.symbols[keep],
                             "feature_types": self.types[keep]})


def _bytes(values) -> np.ndarray:
    return np.array([v.encode() for v in values], dtype="S")


def write_h5_v3(path: Path, src: Source) -> Path:
    """Cell Ranger v3 layout: /matrix with CSC genes x cells (= our CSR cells x genes) and features/."""
    with h5py.File(path, "w") as f:
        g = f.create_group("matrix")
        g["barcodes"] = _bytes(src.barcodes)
        g["data"] = src.x.data.astype(np.int32)
        g["indices"] = src.x.indices.astype(np.int64)
        g["indptr"] = src.x.indptr.astype(np.int64)
        g["shape"] = np.array([src.x.shape[1], src.x.shape[0]], dtype=np.int32)
        feats = g.create_group("features")
        feats["id"], feats["name"] = _bytes(src.ids), _bytes(src.symbols)
        feats["feature_type"] = _bytes(src.types)
        feats["genome"] = _bytes(["GRCh38"] * len(src.ids))
        feats["_all_tag_keys"] = _bytes(["genome"])
    return path


def write_h5_v2(path: Path, src: Source, genomes=("GRCh38",)) -> Path:
    """Cell Ranger v2 layout: one /<genome> group per genome with genes/gene_names (all genes)."""
    x = src.expected()
    with h5py.File(path, "w") as f:
        for genome in genomes:
            g = f.create_group(genome)
            g["barcodes"] = _bytes(src.barcodes)
            g["data"], g["indices"], g["indptr"] = x.data.astype(np.int32), x.indices, x.indptr
            g["shape"] = np.array([x.shape[1], x.shape[0]], dtype=np.int32)
            g["genes"], g["gene_names"] = _bytes(src.ids[src.gex]), _bytes(src.symbols[src.gex])
    return path


def write_mtx(folder: Path, src: Source, *, v3=True, gz=True, order="cell") -> Path:
    """A 10x mtx folder; entries sorted by cell (as Cell Ranger writes) or by gene (as mmwrite of CSR)."""
    folder.mkdir(parents=True, exist_ok=True)
    x = src.x if v3 else src.expected()
    ext = ".gz" if gz else ""
    opener = gzip.open if gz else open
    coo = x.tocoo()
    genes, cells, vals = coo.col + 1, coo.row + 1, coo.data.astype(np.int64)
    key = np.lexsort((genes, cells)) if order == "cell" else np.lexsort((cells, genes))
    with opener(folder / f"matrix.mtx{ext}", "wt") as fh:
        fh.write("%%MatrixMarket matrix coordinate integer general\n%metadata_json: {}\n")
        fh.write(f"{x.shape[1]} {x.shape[0]} {coo.nnz}\n")
        np.savetxt(fh, np.c_[genes[key], cells[key], vals[key]], fmt="%d")
    if v3:
        table = pd.DataFrame({0: src.ids, 1: src.symbols, 2: src.types})
        table.to_csv(folder / f"features.tsv{ext}", sep="\t", header=False, index=False)
    else:
        table = pd.DataFrame({0: src.ids[src.gex], 1: src.symbols[src.gex]})
        table.to_csv(folder / f"genes.tsv{ext}", sep="\t", header=False, index=False)
    pd.Series(src.barcodes).to_csv(folder / f"barcodes.tsv{ext}", header=False, index=False)
    return folder


def source_anndata(src: Source, where="X", fmt="csr") -> ad.AnnData:
    """AnnData of the GEX counts placed in X, a 'counts' layer or .raw (X then holds normalized values)."""
    counts = src.expected()
    counts = {"csr": counts, "csc": counts.tocsc(), "dense": counts.toarray()}[fmt]
    obs = pd.DataFrame({"batch": ["a", "b"] * (N_CELLS // 2) + ["a"] * (N_CELLS % 2)}, index=src.barcodes)
    var = pd.DataFrame({"gene_ids": src.ids[src.gex]}, index=ad.utils.make_index_unique(pd.Index(src.symbols[src.gex])))
    normalized = sp.csr_matrix(src.expected().multiply(0.37))
    if where == "X":
        return ad.AnnData(X=counts, obs=obs, var=var)
    a = ad.AnnData(X=normalized, obs=obs, var=var)
    if where == "layer":
        a.layers["counts"] = counts
    else:
        a.raw = ad.AnnData(X=counts, obs=obs, var=var)
    return a


def run_ingest(*argv) -> int:
    return stage_main(ingest, argv=[str(a) for a in argv])


def unique(names) -> list[str]:
    """scanpy's var_names_make_unique."""
    return list(ad.utils.make_index_unique(pd.Index(names)))


def check_store(out: Path, src: Source, gex_only=True, var_names="gene_symbols", anndata_source=False):
    """The store opens with both readers and equals the source exactly.

    An AnnData source has no symbol column, only its (already unique) var names, as scanpy writes it.
    """
    expected = src.expected(gex_only)
    a = ad.read_zarr(out)
    x = a.X
    assert sp.issparse(x) and x.format == "csr" and x.dtype == np.float32
    assert x.has_sorted_indices and not np.any(x.data == 0)
    assert x.nnz == expected.nnz
    assert (x != expected).nnz == 0
    assert list(a.obs_names) == list(src.barcodes)
    var = src.var(gex_only)
    assert list(a.var["gene_ids"]) == list(var["gene_ids"])
    symbols = unique(var["gene_symbols"]) if anndata_source else list(var["gene_symbols"])
    assert list(a.var["gene_symbols"]) == symbols
    assert list(a.var_names) == unique(var[var_names])
    lazy = open_store(out)
    assert lazy.shape == expected.shape
    assert (lazy.X.compute() != expected).nnz == 0
    return a


# --------------------------------------------------------------------------------------------------
# each format, through the stage CLI


@pytest.fixture(scope="module")
def src():
    return Source()


FORMATS = {
    "h5_v3": lambda d, s: write_h5_v3(d / "filtered_feature_bc_matrix.h5", s),
    "h5_v2": lambda d, s: write_h5_v2(d / "v2.h5", s),
    "mtx_v3_gz": lambda d, s: write_mtx(d / "mtx3", s, v3=True, gz=True),
    "mtx_v3_plain": lambda d, s: write_mtx(d / "mtx3p", s, v3=True, gz=False),
    "mtx_v2_plain": lambda d, s: write_mtx(d / "mtx2", s, v3=False, gz=False),
    "mtx_v2_gz_gene_sorted": lambda d, s: write_mtx(d / "mtx2g", s, v3=False, gz=True, order="gene"),
    "h5ad_csr": lambda d, s: _h5ad(d / "a.h5ad", s, "X", "csr"),
    "h5ad_csc": lambda d, s: _h5ad(d / "a.h5ad", s, "X", "csc"),
    "h5ad_dense": lambda d, s: _h5ad(d / "a.h5ad", s, "X", "dense"),
    "zarr_csr": lambda d, s: _zarr(d / "a.zarr", s, "csr"),
    "zarr_csc": lambda d, s: _zarr(d / "a.zarr", s, "csc"),
    "zarr_v2_dense": lambda d, s: _zarr(d / "a.zarr", s, "dense", zarr_format=2),
}


def _h5ad(path, src, where, fmt):
    source_anndata(src, where, fmt).write_h5ad(path)
    return path


def _zarr(path, src, fmt, zarr_format=3):
    before = ad.settings.zarr_write_format
    ad.settings.zarr_write_format = zarr_format
    try:
        source_anndata(src, "X", fmt).write_zarr(path)
    finally:
        ad.settings.zarr_write_format = before
    if zarr_format == 2:
        assert (path / ".zgroup").exists()
    return path


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_format_roundtrips_exactly(fmt, src, tmp_path):
    data = FORMATS[fmt](tmp_path, src)
    out = tmp_path / "out" / "raw.zarr"
    assert run_ingest("--input", data, "--output", out, "--chunk-rows", 10) == 0
    a = check_store(out, src, anndata_source=fmt.startswith(("h5ad", "zarr")))
    assert list(a.obs["sample"].cat.categories) == [data.name.split(".")[0]]
    summary = json.loads(out.with_suffix(".json").read_text())
    assert summary["cells_out"] == N_CELLS and summary["genes_out"] == N_GENES
    assert summary["nnz"] == src.expected().nnz
    assert "CRIP1-2" in a.var_names  # the second CRIP1 (CRIP1-1 is taken)
    assert summary["renamed"]["var_names"] == (0 if fmt.startswith(("h5ad", "zarr")) else 1)
    if fmt.startswith(("h5ad", "zarr")):
        assert list(a.obs["batch"]) == list(source_anndata(src).obs["batch"])  # obs columns kept
    if fmt in ("h5_v3", "mtx_v3_gz", "mtx_v3_plain"):
        assert summary["features_dropped"] == {"Antibody Capture": N_AB}
        assert set(a.var["feature_types"]) == {"Gene Expression"}


@pytest.mark.parametrize("where", ["layer", "raw"])
@pytest.mark.parametrize("fmt", ["csr", "dense"])
def test_h5ad_counts_in_layer_or_raw(where, fmt, src, tmp_path):
    path = tmp_path / "n.h5ad"
    source_anndata(src, where, fmt).write_h5ad(path)
    out = tmp_path / "o.zarr"
    opt = ["--layer", "counts"] if where == "layer" else ["--use-raw"]
    assert run_ingest("--input", path, "--output", out, "--chunk-rows", 16, *opt) == 0
    check_store(out, src, anndata_source=True)
    # X holds normalized values: refused, with a hint where the counts are
    with pytest.raises(InputError, match=r"non-integer.*(--layer|--use-raw).*--allow-normalized"):
        ingest.ingest([ingest.Sample(None, path)], tmp_path / "x.zarr")
    assert not (tmp_path / "x.zarr").exists()


def test_all_features_and_gene_ids(src, tmp_path):
    data = write_h5_v3(tmp_path / "m.h5", src)
    out = tmp_path / "o.zarr"
    assert run_ingest("--input", data, "--output", out, "--all-features", "--var-names", "gene_ids") == 0
    a = check_store(out, src, gex_only=False, var_names="gene_ids")
    assert list(a.var["feature_types"]).count("Antibody Capture") == N_AB


def test_genome_choice_in_multi_genome_v2(src, tmp_path):
    data = write_h5_v2(tmp_path / "two.h5", src, genomes=("hg19", "mm10"))
    with pytest.raises(InputError, match="several genomes.*hg19, mm10.*--genome"):
        open_input(data)
    out = tmp_path / "o.zarr"
    assert run_ingest("--input", data, "--output", out, "--genome", "mm10", "--sample-name", "s1") == 0
    a = check_store(out, src)
    assert set(a.obs["sample"]) == {"s1"}


# --------------------------------------------------------------------------------------------------
# streaming: blocks of at most chunk_rows cells, disk buckets for unsorted entries


@pytest.mark.parametrize("fmt", ["h5_v3", "mtx_v3_gz", "mtx_v2_gz_gene_sorted", "h5ad_csr", "h5ad_csc",
                                 "h5ad_dense", "zarr_csr"])
def test_readers_yield_bounded_blocks(fmt, src, tmp_path):
    reader = open_input(FORMATS[fmt](tmp_path, src), entries_per_step=17)
    reader.spill_dir = tmp_path / "spill"
    try:
        sizes = [b.shape[0] for b in reader.raw_blocks(7)]
    except RestartStream:  # gene-sorted mtx: found unsorted after a block was out; the stage reads again
        assert fmt == "mtx_v2_gz_gene_sorted"
        sizes = [b.shape[0] for b in reader.raw_blocks(7)]
    assert max(sizes) <= 7 and sum(sizes) == N_CELLS and sizes[:-1] == [7] * (len(sizes) - 1)
    assert not any((tmp_path / "spill").glob("*/*.bin"))  # spilled entries are removed


@pytest.mark.parametrize("fmt", ["h5_v3", "mtx_v2_gz_gene_sorted", "h5ad_csc"])
def test_reader_memory_is_bounded_by_a_block(fmt, tmp_path):
    """Peak traced memory while streaming a 20k-cell matrix stays far below the matrix itself."""
    import tracemalloc

    big = Source(seed=5, n_cells=20_000, n_genes=100, n_ab=0)
    big.x = sp.random(20_000, 100, density=0.1, format="csr", random_state=5,
                      data_rvs=lambda k: np.full(k, 3.0)).astype(np.float32)
    data = FORMATS[fmt](tmp_path, big) if not fmt.startswith("h5ad") else _h5ad_big(tmp_path / "b.h5ad", big)
    reader = open_input(data, entries_per_step=2_000)
    reader.spill_dir = tmp_path
    matrix_bytes = big.x.nnz * 24  # (row, col, value) as the readers hold entries
    check, cells = CountCheck(reader, False), 0
    tracemalloc.start()
    try:
        for attempt in range(2):
            try:
                for block in reader.raw_blocks(1000):
                    cells += clean_block(block, reader.shape[1], None, check, cells).shape[0]
                break
            except RestartStream:
                cells = 0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert cells == 20_000
    assert peak < matrix_bytes / 4, f"peak {peak / 2**20:.1f} MiB for a {matrix_bytes / 2**20:.1f} MiB matrix"


def _h5ad_big(path, src):
    obs = pd.DataFrame(index=src.barcodes)
    ad.AnnData(X=src.x.tocsc(), obs=obs, var=pd.DataFrame(index=src.ids)).write_h5ad(path)
    return path


def test_dense_blocks_are_read_in_slices(src, tmp_path, monkeypatch):
    import atlasflow.io._blocks as blocks

    monkeypatch.setattr(blocks, "DENSE_BYTES", 4 * N_GENES * 3)  # three rows at a time
    reader = open_input(_h5ad(tmp_path / "d.h5ad", src, "X", "dense"))
    got = sp.vstack(list(reader.raw_blocks(10)))
    assert (got != src.expected()).nnz == 0


def test_sorted_mtx_streams_without_disk(src, tmp_path, monkeypatch):
    reader = open_input(write_mtx(tmp_path / "m", src), entries_per_step=11)
    monkeypatch.setattr("atlasflow.io.tenx.RowBuckets", None)  # any use of buckets would fail
    got = sp.vstack(list(reader.raw_blocks(5)))
    assert reader.cell_sorted is True
    assert (got.tocsr()[:, np.flatnonzero(src.gex)] != src.expected()).nnz == 0


def test_mtx_found_unsorted_late_is_read_again(src, tmp_path):
    """Sorted by cell except one late entry of cell 1: blocks were already out, so the stage restarts."""
    folder = write_mtx(tmp_path / "m", src, gz=False)
    lines = (folder / "matrix.mtx").read_text().splitlines(keepends=True)
    head, entries = lines[:3], lines[3:]
    moved = next(i for i, line in enumerate(entries) if line.split()[1] == "2")
    entries.append(entries.pop(moved))
    (folder / "matrix.mtx").write_text("".join(head + entries))
    reader = open_input(folder, entries_per_step=10)
    with pytest.raises(RestartStream):
        list(reader.raw_blocks(5))
    out = tmp_path / "o.zarr"
    summary = ingest.ingest([ingest.Sample(None, folder)], out, chunk_rows=5, entries_per_step=10)
    check_store(out, src)
    assert summary["nnz"] == src.expected().nnz
    assert not list(tmp_path.glob(".o.zarr*"))


def test_row_buckets_rebuild_blocks(tmp_path):
    rng = np.random.default_rng(3)
    x = sp.random(40, 9, density=0.4, format="coo", random_state=rng)
    buckets = RowBuckets(40, 9, 6, spill_dir=tmp_path)
    order = rng.permutation(x.nnz)
    for part in np.array_split(order, 5):
        buckets.add(x.row[part].astype(np.int64), x.col[part], x.data[part])
    blocks = list(buckets.blocks())
    assert [b.shape[0] for b in blocks] == [6] * 6 + [4]
    np.testing.assert_array_equal(sp.vstack(blocks).toarray(), x.toarray())
    assert not list(tmp_path.iterdir())


# --------------------------------------------------------------------------------------------------
# counts beyond float32's exact integers (2**24): X is written as float64, never rounded

BIG = 2**25 + 1  # 33554433: float32 would store 33554432


def _big_source(cell=41) -> tuple[Source, int, int]:
    """The source with one count of BIG at a Gene Expression entry of a late cell (blocks are out by then)."""
    s = Source()
    s.x = s.x.astype(np.float64)
    lo, hi = s.x.indptr[cell], s.x.indptr[cell + 1]
    pos = next(p for p in range(lo, hi) if s.gex[s.x.indices[p]] and s.x.data[p] != 0)
    s.x.data[pos] = BIG
    return s, cell, int(s.x.indices[pos])


@pytest.mark.parametrize("fmt", ["h5_v3", "mtx_v3_gz", "mtx_v2_gz_gene_sorted", "h5ad_csr", "h5ad_csc",
                                 "h5ad_dense", "zarr_csr", "sample_sheet"])
def test_counts_beyond_float32_are_stored_exactly(fmt, tmp_path, capsys):
    big, cell, gene = _big_source()
    if fmt == "sample_sheet":  # the large count in the second sample, after the first is written
        write_h5_v3(tmp_path / "a.h5", Source())
        write_mtx(tmp_path / "b", big)
        argv = ["--sample-sheet", _sheet(tmp_path, [["s1", "a.h5"], ["s2", "b"]], ("sample", "path"))]
        expected = sp.vstack([Source().expected(), big.expected()]).tocsr()
    else:
        argv = ["--input", FORMATS[fmt](tmp_path, big)]
        expected = big.expected()
    out = tmp_path / "o.zarr"
    assert run_ingest(*argv, "--output", out, "--chunk-rows", 10) == 0
    x = ad.read_zarr(out).X
    assert x.dtype == np.float64
    assert x.max() == BIG and (x != expected).nnz == 0  # every count as given
    why = [line for line in capsys.readouterr().err.splitlines() if "storing X as float64" in line]  # the log
    assert len(why) == 1 and f"value {BIG}" in why[0] and big.barcodes[cell] in why[0], why
    assert repr(str(big.symbols[gene])) in why[0]
    assert json.loads(out.with_suffix(".json").read_text())["x_dtype"] == "float64"
    assert not list(tmp_path.glob(".o.zarr*"))


def test_counts_within_float32_stay_float32(src, tmp_path):
    s = Source()
    s.x = s.x.astype(np.float64)
    s.x.data[s.x.data > 0] = 2**24  # the largest count float32 holds with all below it
    out = tmp_path / "o.zarr"
    summary = ingest.ingest([ingest.Sample(None, _h5ad(tmp_path / "a.h5ad", s, "X", "csr"))], out, chunk_rows=10)
    assert summary["x_dtype"] == "float32" and ad.read_zarr(out).X.dtype == np.float32


def test_float64_counts_go_through_qc_and_normalize(client, tmp_path):
    """The stages after ingest read float64 counts as they read float32 ones (qc, then normalize)."""
    from atlasflow.stages import normalize as normalize_stage
    from atlasflow.stages import qc as qc_stage

    big, _, _ = _big_source()
    raw = tmp_path / "raw.zarr"
    assert run_ingest("--input", write_h5_v3(tmp_path / "m.h5", big), "--output", raw, "--chunk-rows", 10) == 0
    address = ["--address", client.scheduler.address]
    assert stage_main(qc_stage, argv=["--input", str(raw), "--output", str(tmp_path / "qc.zarr"),
                                      "--percent-top", "5", *address]) == 0
    assert stage_main(normalize_stage, argv=["--input", str(tmp_path / "qc.zarr"), "--output",
                                             str(tmp_path / "norm.zarr"), "--target-sum", "10000", *address]) == 0
    counts = big.expected()
    totals = np.asarray(counts.sum(axis=1)).ravel()
    qc = ad.read_zarr(tmp_path / "qc.zarr")
    assert qc.X.dtype == np.float64 and (qc.X != counts).nnz == 0
    # qc keeps its metrics float32 (as scanpy does for float32 X), so a total beyond 2**24 is rounded there
    np.testing.assert_allclose(qc.obs["total_counts"].to_numpy(), totals, rtol=1e-7)
    norm = ad.read_zarr(tmp_path / "norm.zarr").X
    ref = sp.diags(np.divide(1e4, totals, out=np.zeros_like(totals), where=totals > 0)) @ counts
    np.testing.assert_allclose(norm.toarray(), ref.toarray(), rtol=1e-6)


# --------------------------------------------------------------------------------------------------
# sample sheets


def _sheet(tmp_path, rows, columns=("sample", "path", "donor", "min_genes")) -> Path:
    path = tmp_path / "samples.tsv"
    pd.DataFrame(rows, columns=list(columns)).to_csv(path, sep="\t", index=False)
    return path


def test_sample_sheet_concatenates(tmp_path):
    s1, s2, s3 = Source(seed=1), Source(seed=1), Source(seed=1)
    s2.barcodes = s1.barcodes.copy()  # same barcodes in two samples: prefixes make them unique
    s3.barcodes = np.array([f"X{i}" for i in range(N_CELLS)])
    rng = np.random.default_rng(9)
    s2.x = sp.random(N_CELLS, N_GENES + N_AB, density=0.2, format="csr", random_state=rng,
                     data_rvs=lambda k: rng.integers(1, 9, k)).astype(np.float32)
    write_h5_v3(tmp_path / "a.h5", s1)
    write_mtx(tmp_path / "b", s2)
    perm = np.r_[np.arange(N_GENES)[::-1], np.arange(N_GENES, N_GENES + N_AB)]  # genes in another order
    s3p = Source(seed=1)
    s3p.x, s3p.ids, s3p.symbols, s3p.types, s3p.barcodes = s3.x[:, perm], s3.ids[perm], s3.symbols[perm], \
        s3.types[perm], s3.barcodes
    source_anndata(s3p).write_h5ad(tmp_path / "c.h5ad")
    sheet = _sheet(tmp_path, [["s1", "a.h5", "d1", 100], ["s2", str(tmp_path / "b"), "d2", 200],
                              ["s3", "c.h5ad", "d1", None]])
    out = tmp_path / "all.zarr"
    assert run_ingest("--sample-sheet", sheet, "--output", out, "--chunk-rows", 20) == 0
    a = ad.read_zarr(out)
    expected = sp.vstack([s1.expected(), s2.expected(), s3.expected()])
    assert a.shape == expected.shape and (a.X != expected).nnz == 0
    assert list(a.obs_names[:2]) == [f"s1_{b}" for b in s1.barcodes[:2]]
    assert a.obs_names.is_unique
    assert list(a.obs["sample"].cat.categories) == ["s1", "s2", "s3"]
    assert a.obs["sample"].value_counts().to_dict() == {"s1": N_CELLS, "s2": N_CELLS, "s3": N_CELLS}
    assert list(a.obs["donor"].iloc[[0, N_CELLS, 2 * N_CELLS]]) == ["d1", "d2", "d1"]
    assert "min_genes" not in a.obs  # QC thresholds are for the filter stage
    assert list(a.var["gene_ids"]) == list(s1.ids[s1.gex])
    summary = json.loads(out.with_suffix(".json").read_text())
    assert summary["samples"] == {"s1": N_CELLS, "s2": N_CELLS, "s3": N_CELLS}


def test_sample_sheet_with_other_genes_takes_the_union(tmp_path):
    """Disjoint gene sets (an error before the union): each sample is zero in the other's genes."""
    s1, s2 = Source(seed=1), Source(seed=2)
    write_h5_v3(tmp_path / "a.h5", s1)
    write_h5_v3(tmp_path / "b.h5", s2)
    sheet = _sheet(tmp_path, [["one", "a.h5", "x", 1], ["two", "b.h5", "y", 1]])
    out = tmp_path / "o.zarr"
    ingest.ingest(read_sample_sheet(sheet), out)
    a = ad.read_zarr(out)
    assert list(a.var["gene_ids"]) == list(s1.ids[s1.gex]) + list(s2.ids[s2.gex])
    assert (a.X != sp.block_diag([s1.expected(), s2.expected()], format="csr")).nnz == 0


@pytest.mark.parametrize(("rows", "columns", "message"), [
    ([["a", "x.h5"]], ("sample", "file"), "lacks column.*path"),
    ([["a", "in.h5"], ["a", "in.h5"]], ("sample", "path"), "duplicate sample name.*a"),
    ([["a", "in.h5"], ["b", "nope.h5"]], ("sample", "path"), r"input not found for sample.*b \(nope.h5\)"),
    ([["", "in.h5"]], ("sample", "path"), "lack a sample name"),
    ([], ("sample", "path"), "lists no samples"),
])
def test_bad_sample_sheets(rows, columns, message, src, tmp_path, capsys):
    write_h5_v3(tmp_path / "in.h5", src)
    sheet = _sheet(tmp_path, rows, columns)
    with pytest.raises(InputError, match=message):
        read_sample_sheet(sheet)
    out = tmp_path / "o.zarr"
    assert run_ingest("--sample-sheet", sheet, "--output", out) == 1
    assert not out.exists()
    assert "error:" in capsys.readouterr().err


def _same_input_twice(tmp_path, how):
    """A sheet listing one input under samples a and b, the second time as ``how`` spells it."""
    import os
    import shutil

    write_h5_v3(tmp_path / "in.h5", Source())
    write_mtx(tmp_path / "m", Source())
    first, second = "in.h5", {
        "same_path": "in.h5",
        "absolute_path": str(tmp_path / "sub" / ".." / "in.h5"),
        "symlink": "link.h5",
        "hard_link": "hard.h5",
        "copy": "copy.h5",
        "mtx_file_and_folder": "m/matrix.mtx.gz",
    }[how]
    (tmp_path / "sub").mkdir()
    if how == "mtx_file_and_folder":
        first = "m"
    (tmp_path / "link.h5").symlink_to(tmp_path / "in.h5")
    os.link(tmp_path / "in.h5", tmp_path / "hard.h5")
    shutil.copy2(tmp_path / "in.h5", tmp_path / "copy.h5")  # same size, content and modification time
    return _sheet(tmp_path, [["a", first], ["b", second]], ("sample", "path"))


@pytest.mark.parametrize("how", ["same_path", "absolute_path", "symlink", "hard_link", "copy", "mtx_file_and_folder"])
def test_same_input_under_two_names_is_refused(how, tmp_path, capsys):
    sheet = _same_input_twice(tmp_path, how)
    with pytest.raises(InputError, match=r"samples a and b (are the same|look like copies).*list each input once"):
        read_sample_sheet(sheet)
    out = tmp_path / "o.zarr"
    assert run_ingest("--sample-sheet", sheet, "--output", out) == 1
    assert not out.exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("atlasflow ingest: error: sample sheet") and "samples a and b" in err[-1]


def test_files_alike_in_size_and_time_are_not_copies(tmp_path):
    """Two samples whose files have the same size and modification time but other content are accepted."""
    import os

    s1, s2 = Source(seed=1), Source(seed=1)
    s2.x = s2.x.copy()
    s2.x.data = np.where(s2.x.data > 0, s2.x.data % 7 + 1, 0).astype(np.float32)  # other counts, same layout
    write_h5_v3(tmp_path / "a.h5", s1)
    write_h5_v3(tmp_path / "b.h5", s2)
    assert (tmp_path / "a.h5").stat().st_size == (tmp_path / "b.h5").stat().st_size
    stamp = (tmp_path / "a.h5").stat().st_mtime_ns
    os.utime(tmp_path / "b.h5", ns=(stamp, stamp))
    samples = read_sample_sheet(_sheet(tmp_path, [["a", "a.h5"], ["b", "b.h5"]], ("sample", "path")))
    assert [s.name for s in samples] == ["a", "b"]


# --------------------------------------------------------------------------------------------------
# bad inputs: one-line InputError, exit code 1, no output


def _values(tmp_path, src, value, name="bad.h5ad"):
    a = source_anndata(src)
    a.X = a.X.copy()
    a.X.data[4] = value
    path = tmp_path / name
    a.write_h5ad(path)
    return path


def _bad_h5_no_barcodes(tmp_path, src):
    path = write_h5_v3(tmp_path / "nb.h5", src)
    with h5py.File(path, "a") as f:
        del f["matrix/barcodes"]
    return path


def _mtx_without(tmp_path, src, name):
    folder = write_mtx(tmp_path / "m", src)
    (folder / name).unlink()
    return folder


def _truncated_mtx(tmp_path, src):
    folder = write_mtx(tmp_path / "m", src, gz=False)
    lines = (folder / "matrix.mtx").read_text().splitlines(keepends=True)
    (folder / "matrix.mtx").write_text("".join(lines[:-5]))
    return folder


def _empty_h5ad(tmp_path, src):
    path = tmp_path / "e.h5ad"
    source_anndata(src)[:0].copy().write_h5ad(path)
    return path


def _no_gex(tmp_path, src):
    s = Source(n_genes=0, n_ab=4)
    return write_h5_v3(tmp_path / "ab.h5", s)


def _unknown_file(tmp_path, src):
    (tmp_path / "data.xlsx").write_text("a,b\n1,2\n")  # a spreadsheet, not a table we read
    return tmp_path / "data.xlsx"


def _unknown_dir(tmp_path, src):
    (tmp_path / "stuff").mkdir()
    (tmp_path / "stuff" / "readme.txt").write_text("hi")
    return tmp_path / "stuff"


def _truncated(path: Path) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # an interrupted copy
    return path


def _mtx_empty_symbol(tmp_path, src):
    s = Source()
    s.symbols = s.symbols.copy()
    s.symbols[4] = ""
    return write_mtx(tmp_path / "m", s)


def _h5_missing_id(tmp_path, src):
    s = Source()
    s.ids = s.ids.copy()
    s.ids[6] = " "
    return write_h5_v3(tmp_path / "m.h5", s)


BAD = {
    "h5_truncated": (lambda t, s: _truncated(write_h5_v3(t / "m.h5", s)), [], r"truncated HDF5 file \(\d+ of its \d+ bytes"),
    "h5ad_truncated": (lambda t, s: _truncated(_h5ad(t / "a.h5ad", s, "X", "csr")), [], "truncated HDF5 file"),
    "empty_gene_symbol": (_mtx_empty_symbol, [], r"feature row 5 .*'ENSG000004'.* empty gene_symbols.*--var-names"),
    "empty_gene_id": (_h5_missing_id, [], r"feature row 7 .* empty gene_ids"),
    "non_integer": (lambda t, s: _values(t, s, 2.5), [], "non-integer value 2.5.*--allow-normalized"),
    "negative": (lambda t, s: _values(t, s, -3.0), [], "negative value -3.0"),
    "nan": (lambda t, s: _values(t, s, np.nan), ["--allow-normalized"], "NaN or infinite"),
    "inf": (lambda t, s: _values(t, s, np.inf), [], "NaN or infinite"),
    "missing_path": (lambda t, s: t / "nothing.h5", [], "input .*nothing.h5 not found"),
    "unknown_file": (_unknown_file, [], "unknown input format"),
    "unknown_dir": (_unknown_dir, [], "unknown input format"),
    "not_hdf5": (lambda t, s: (t / "x.h5").write_text("nope") and t / "x.h5", [], "not an HDF5 file"),
    "h5_no_barcodes": (_bad_h5_no_barcodes, [], "lacks 'matrix/barcodes'"),
    "mtx_no_barcodes": (lambda t, s: _mtx_without(t, s, "barcodes.tsv.gz"), [], r"no barcodes\.tsv\(\.gz\)"),
    "mtx_no_features": (lambda t, s: _mtx_without(t, s, "features.tsv.gz"), [], r"no features\.tsv"),
    "mtx_no_matrix": (lambda t, s: _mtx_without(t, s, "matrix.mtx.gz"), [], r"no matrix\.mtx"),
    "mtx_truncated": (_truncated_mtx, [], "header announces .* entries"),
    "empty": (_empty_h5ad, [], r"empty matrix \(0 cells"),
    "no_gene_expression": (_no_gex, [], "no 'Gene Expression' features.*--all-features"),
    "missing_layer": (lambda t, s: _h5ad(t / "a.h5ad", s, "X", "csr"), ["--layer", "spliced"], "no layer 'spliced'"),
    "no_raw": (lambda t, s: _h5ad(t / "a.h5ad", s, "X", "csr"), ["--use-raw"], "has no .raw"),
    "layer_on_10x": (lambda t, s: write_h5_v3(t / "m.h5", s), ["--layer", "x"], "apply to .h5ad/.zarr"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_inputs_fail_cleanly(case, src, tmp_path, capsys):
    make, extra, message = BAD[case]
    data = make(tmp_path, src)
    out = tmp_path / "out" / "raw.zarr"
    assert run_ingest("--input", data, "--output", out, *extra) == 1
    assert not out.exists() and not list(out.parent.glob(".raw.zarr*"))
    stderr = capsys.readouterr().err
    err = [line for line in stderr.splitlines() if line.startswith("atlasflow ingest: error:")]
    assert len(err) == 1
    assert "Traceback" not in stderr
    with pytest.raises(InputError, match=message):
        opts = {"layer": "spliced" if "spliced" in extra else ("x" if "--layer" in extra else None),
                "use_raw": "--use-raw" in extra, "allow_normalized": "--allow-normalized" in extra}
        ingest.ingest([ingest.Sample(None, data)], out, **opts)


def test_allow_normalized_warns(src, tmp_path, caplog):
    data = _values(tmp_path, src, 2.5)
    out = tmp_path / "o.zarr"
    ingest.ingest([ingest.Sample(None, data)], out, allow_normalized=True)
    assert "not raw counts" in caplog.text
    x = ad.read_zarr(out).X
    assert x.dtype == np.float32 and 2.5 in x.data


def test_needs_input_or_sample_sheet(src, tmp_path):
    assert run_ingest("--output", tmp_path / "o.zarr") == 1
    data = write_h5_v3(tmp_path / "m.h5", src)
    assert run_ingest("--input", data, "--output", tmp_path / "o.zarr", "--chunk-rows", 0) == 1
    assert not (tmp_path / "o.zarr").exists()


# --------------------------------------------------------------------------------------------------
# oracle: scanpy.read_10x_mtx on the real pbmc3k folder


def test_pbmc3k_matches_scanpy(pbmc3k_dir, tmp_path):
    import scanpy as sc

    out = tmp_path / "pbmc3k.zarr"
    assert run_ingest("--input", pbmc3k_dir, "--output", out, "--chunk-rows", 1000) == 0
    ref = sc.read_10x_mtx(pbmc3k_dir)
    got = ad.read_zarr(out)
    assert got.shape == ref.shape == (2700, 13714)
    assert got.X.nnz == ref.X.nnz == 2_282_976
    assert (got.X != ref.X).nnz == 0
    assert list(got.obs_names) == list(ref.obs_names)
    assert list(got.var_names) == list(ref.var_names)
    np.testing.assert_array_equal(got.var["gene_ids"].to_numpy(dtype=str), ref.var["gene_ids"].to_numpy(dtype=str))
    assert open_store(out).X.chunks[0] == (1000, 1000, 700)
