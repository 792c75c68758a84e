"""rank_genes_groups out of core against scanpy on pbmc3k (Seurat cell types as groups), the gene-major
copy, chunk-size invariance, passes over X, Wilcoxon memory bounded by the gene block, and the stage CLI."""

from __future__ import annotations

import logging
import os
import tracemalloc
from pathlib import Path

import anndata as ad
import dask
import dask.array as da
import numpy as np
import pandas as pd
import pytest
import scanpy as sc
import scipy.sparse as sp
from _scanpy_stack import TTEST_RTOL
from threadpoolctl import threadpool_limits

from atlasflow import kernels, store, tl, transpose
from atlasflow.cli import stage_main
from atlasflow.stages import rank_genes_groups as rgg_stage
from atlasflow.store import open_store, write_store
from atlasflow.store import write as store_write

PBMC3K = Path(__file__).resolve().parents[2] / "shared" / "data" / "pbmc3k"
STATS = ("scores", "pvals", "pvals_adj", "logfoldchanges")


def annotations(obs_names) -> pd.Categorical:
    """Seurat's pbmc3k cell types for the given (QC'd) cells."""
    ann = pd.read_csv(PBMC3K / "seurat_annotations.tsv", sep="\t", index_col=0)["seurat_annotation"]
    return pd.Categorical(ann.reindex(obs_names))


@pytest.fixture(scope="module")
def labelled(scanpy_pbmc3k):
    """scanpy's log1p snapshot with obs['cell_type'] (9 groups, 14 to 697 cells)."""
    a = scanpy_pbmc3k["log1p"].copy()
    a.obs["cell_type"] = annotations(a.obs_names)
    a.var["gene_symbols"] = a.var_names.to_numpy()
    return a


def write_log1p(a, path, chunk_rows):
    x = da.from_array(sp.csr_matrix(a.X), chunks=(chunk_rows, a.n_vars), asarray=False)
    obs = a.obs[["cell_type"]] if "cell_type" in a.obs else a.obs[[]]
    with dask.config.set(scheduler="synchronous"):  # in-memory source: no need to ship it to the workers
        write_store(ad.AnnData(X=x, obs=obs, var=a.var[["gene_symbols"]], uns={"log1p": {"base": None}}), path,
                    chunk_rows=chunk_rows)
    return path


@pytest.fixture(scope="module")
def stores(labelled, tmp_path_factory):
    """The log1p store without labels, a 'leiden' store with labels only, and a labelled log1p store."""
    d = tmp_path_factory.mktemp("markers")
    unlabelled = labelled.copy()
    del unlabelled.obs["cell_type"]
    write_log1p(unlabelled, d / "log1p.zarr", 700)
    groups = ad.AnnData(obs=pd.DataFrame({"leiden": labelled.obs["cell_type"].values,
                                          "n_counts": np.arange(labelled.n_obs)}, index=labelled.obs_names))
    groups.write_zarr(d / "leiden.zarr")
    write_log1p(labelled, d / "labelled.zarr", 700)
    return d


def ours(stores, chunk_rows=None):
    return open_store(stores / "labelled.zarr", chunk_rows=chunk_rows)


def reference(labelled, **kw):
    a = labelled.copy()
    sc.tl.rank_genes_groups(a, "cell_type", **kw)
    return a.uns["rank_genes_groups"]


def assert_same_results(ref: dict, got: dict, rtol=1e-5, stats=STATS):
    """Same groups, same gene order (except among exactly tied scores), statistics within rtol."""
    assert got["names"].dtype.names == ref["names"].dtype.names
    for g in ref["names"].dtype.names:
        rn, gn = np.asarray(ref["names"][g]), np.asarray(got["names"][g])
        rs, gs = np.asarray(ref["scores"][g]), np.asarray(got["scores"][g])
        np.testing.assert_allclose(gs, rs, rtol=rtol, atol=1e-30, err_msg=f"{g}: sorted scores")
        values, counts = np.unique(rs, return_counts=True)
        tied = values[counts > 1]
        assert np.isin(rs[rn != gn], tied).all(), f"{g}: gene order differs beyond exact ties"
        for key in stats:
            r = pd.Series(np.asarray(ref[key][g], dtype=float), index=rn)
            o = pd.Series(np.asarray(got[key][g], dtype=float), index=gn).reindex(rn)
            np.testing.assert_allclose(o.to_numpy(), r.to_numpy(), rtol=rtol, atol=1e-300, err_msg=f"{g}: {key}")


@pytest.mark.parametrize("method", ["t-test", "t-test_overestim_var"])
def test_ttest_equals_scanpy(client, stores, labelled, method):
    ref = reference(labelled, method=method, pts=True)
    b = ours(stores)
    tl.rank_genes_groups(b, "cell_type", method=method, pts=True)
    got = b.uns["rank_genes_groups"]
    assert_same_results(ref, got, rtol=TTEST_RTOL)
    assert got["params"] == {**ref["params"], "use_raw": False}
    for key in ("pts", "pts_rest"):
        pd.testing.assert_frame_equal(got[key], ref[key], check_exact=True)


@pytest.mark.parametrize("tie_correct", [False, True])
def test_wilcoxon_equals_scanpy(client, stores, labelled, tie_correct):
    ref = reference(labelled, method="wilcoxon", tie_correct=tie_correct, pts=True)
    b = ours(stores)
    tl.rank_genes_groups(b, "cell_type", method="wilcoxon", tie_correct=tie_correct, pts=True, gene_block=4000)
    got = b.uns["rank_genes_groups"]
    assert_same_results(ref, got)
    for g in ref["names"].dtype.names:  # exact rank sums: even the tied genes come out in scanpy's order
        assert list(got["names"][g]) == list(ref["names"][g])
    pd.testing.assert_frame_equal(got["pts_rest"], ref["pts_rest"], check_exact=True)


@pytest.mark.parametrize(("method", "kw"), [
    ("t-test", {"reference": "B", "groups": ["NK", "DC", "CD8 T"]}),
    ("wilcoxon", {"reference": "B", "tie_correct": True, "groups": ["NK", "Platelet", "CD14+ Mono"]}),
    ("wilcoxon", {"groups": ["NK", "DC"], "n_genes": 50, "corr_method": "bonferroni"}),
])
def test_reference_groups_and_options_equal_scanpy(client, stores, labelled, method, kw):
    ref = reference(labelled, method=method, pts=True, **kw)
    b = ours(stores)
    tl.rank_genes_groups(b, "cell_type", method=method, pts=True, gene_block=5000, **kw)
    got = b.uns["rank_genes_groups"]
    assert_same_results(ref, got, rtol=TTEST_RTOL if method == "t-test" else 1e-5)
    assert ("pts_rest" in got) == ("pts_rest" in ref)
    pd.testing.assert_frame_equal(got["pts"], ref["pts"], check_exact=True)


def test_logreg_top_genes_overlap_scanpy(stores, labelled):
    # the 1500 most often detected genes keep both fits quick (same subset for both, via mask_var); the
    # synchronous scheduler avoids ~0.1 s of scheduler latency per L-BFGS evaluation on a busy machine
    detected = np.asarray((labelled.X > 0).sum(axis=0)).ravel()
    mask = np.zeros(labelled.n_vars, dtype=bool)
    mask[np.argsort(-detected, kind="stable")[:1500]] = True
    with threadpool_limits(1, user_api="blas"):
        ref = reference(labelled, method="logreg", mask_var=mask)
    b = ours(stores)
    with dask.config.set(scheduler="synchronous"):
        tl.rank_genes_groups(b, "cell_type", method="logreg", mask_var=mask, persist=True)
    got = b.uns["rank_genes_groups"]
    assert set(got) == set(ref) == {"params", "names", "scores"}
    for g in ref["names"].dtype.names:
        overlap = len(set(ref["names"][g][:25]) & set(got["names"][g][:25])) / 25
        assert overlap >= 0.8, (g, overlap)


def test_logreg_binary_reports_first_group(client, stores, labelled):
    with threadpool_limits(1, user_api="blas"):
        ref = reference(labelled, method="logreg", groups=["NK", "B"])
    b = ours(stores)
    tl.rank_genes_groups(b, "cell_type", method="logreg", groups=["NK", "B"], persist=True)
    got = b.uns["rank_genes_groups"]
    assert got["names"].dtype.names == ref["names"].dtype.names == ("NK",)
    assert len(set(ref["names"]["NK"][:25]) & set(got["names"]["NK"][:25])) >= 20


def test_results_independent_of_chunk_size(stores, labelled, tmp_path):
    results = {}
    with dask.config.set(scheduler="synchronous"):
        for rows in (300, 1000, 2638):
            path = write_log1p(labelled, tmp_path / f"c{rows}.zarr", rows)
            b = open_store(path)
            res = {}
            for method in ("t-test", "wilcoxon"):
                tl.rank_genes_groups(b, "cell_type", method=method, tie_correct=True, gene_block=3000)
                res[method] = b.uns["rank_genes_groups"]
            results[rows] = res
    base = results[300]
    for rows in (1000, 2638):
        for g in base["wilcoxon"]["names"].dtype.names:
            for key in ("names", "scores", "pvals"):  # rank sums are exact: bitwise equal
                assert np.array_equal(results[rows]["wilcoxon"][key][g], base["wilcoxon"][key][g])
            np.testing.assert_allclose(results[rows]["t-test"]["scores"][g], base["t-test"]["scores"][g], rtol=1e-6)


def test_ttest_reads_x_once(stores, monkeypatch):
    reads = []
    orig = store.read._read_csr_block
    monkeypatch.setattr(store.read, "_read_csr_block", lambda *a, **k: (reads.append(a[0]), orig(*a, **k))[1])
    with dask.config.set(scheduler="synchronous"):
        b = ours(stores)
        n_blocks = b.X.numblocks[0]
        tl.rank_genes_groups(b, "cell_type", method="t-test", pts=True)
        assert reads.count(str(stores / "labelled.zarr")) == n_blocks
        reads.clear()
        tl.rank_genes_groups(b, "cell_type", method="wilcoxon")  # X read once, by the transposition
        assert reads.count(str(stores / "labelled.zarr")) == n_blocks


def test_gene_major_copy_is_the_transpose(tmp_path):
    rng = np.random.default_rng(0)
    x = sp.random(900, 130, density=0.1, format="csr", dtype=np.float32, random_state=rng)
    x.data[::9] = 0  # explicit zeros are dropped
    with dask.config.set(scheduler="synchronous"):
        for blocks in (da.from_array(x, chunks=(200, 130), asarray=False),
                       da.from_array(x.toarray(), chunks=(333, 130))):
            path = transpose.write_gene_major(blocks, tmp_path / "t.zarr", gene_block=17)
            xt = transpose.open_gene_major(path)
            assert xt.chunks[0][0] == 17 and xt.shape == (130, 900)
            got = sp.vstack([b.compute() for b in xt.to_delayed().ravel()])
            assert got.has_sorted_indices and got.nnz == x.count_nonzero()
            assert (got != x.T).nnz == 0


def test_gene_blocks_assembled_from_compressed_pieces(tmp_path):
    """The on-the-fly gene blocks equal X.T: row blocks above 65,535 cells (32-bit cell offsets) and small
    ones (16-bit), a gene empty everywhere, one starting past cell 65,535, integer values; the scratch pieces are
    smaller than the raw CSC and gone afterwards."""
    rng = np.random.default_rng(5)
    x = sp.random(70_500, 40, density=0.02, format="csr", dtype=np.float64, random_state=rng)
    x.data = np.ceil(x.data * 7)
    x = x.tolil()
    x[:, 3] = 0  # empty everywhere
    x[:65_600, 9] = 0  # in the first row block only past cell 65,535 (and in the others)
    x = x.tocsr().astype(np.int32)
    x.eliminate_zeros()
    seen = []
    with dask.config.set(scheduler="synchronous"):
        for chunks in ((66_000, 4_500), (1_000,) * 70 + (500,)):
            xd = da.from_array(x, chunks=(chunks, 40), asarray=False)
            with transpose.gene_blocks(xd, tmp_path, gene_block=6) as xt:
                scratch = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())
                got = sp.vstack([b.compute() for b in xt.to_delayed().ravel()])
                seen.append(xt.chunks[0])
            assert got.dtype == np.int32 and got.has_sorted_indices and got.shape == (40, 70_500)
            assert (got != x.T).nnz == 0
            assert scratch < 0.8 * (x.data.nbytes + x.indices.nbytes), scratch
            assert not list(tmp_path.iterdir())
    assert seen[0] == (6,) * 6 + (4,)


def test_wilcoxon_memory_bounded_by_gene_block(tmp_path, monkeypatch):
    """A synthetic matrix 30 row blocks and 30 gene blocks large: no block of more than gene_block genes is
    ever built, and the traced peak stays within a small multiple of one plain streaming pass over X (the
    transposition holds a row block and its CSC copy where the pass holds the block), far below the size of
    the matrix. Values are stored in chunks of 2**16 (a row block holds ~120k values), so that, as in a real
    store (~20M values per 10k-cell block, 2**20 per chunk), a block spans chunks instead of several blocks
    sharing one chunk that is a third of X; warm-up runs keep imports and numba compilation out."""
    monkeypatch.setattr(store_write, "FLAT_CHUNK", 1 << 16)
    rng = np.random.default_rng(1)
    n, m, gene_block = 30_000, 3_000, 100
    x = sp.random(n, m, density=0.04, format="csr", dtype=np.float32, random_state=rng)
    x.data = np.log1p(np.ceil(x.data * 5)).astype(np.float32)
    obs = pd.DataFrame({"g": pd.Categorical(rng.integers(0, 6, n).astype(str))}, index=[f"c{i}" for i in range(n)])
    with dask.config.set(scheduler="synchronous"):
        path = write_store(ad.AnnData(X=da.from_array(x, chunks=(1_000, m), asarray=False), obs=obs,
                                      var=pd.DataFrame(index=[f"g{j}" for j in range(m)])), tmp_path / "syn.zarr")
    matrix_bytes = x.data.nbytes + x.indices.nbytes
    del x
    shapes = []
    orig_rank, orig_asm = kernels.gene_block_ranks, transpose.assemble_gene_block
    monkeypatch.setattr(kernels, "gene_block_ranks", lambda b, *a: (shapes.append(b.shape), orig_rank(b, *a))[1])
    monkeypatch.setattr(transpose, "assemble_gene_block",
                        lambda *a: (lambda out: (shapes.append(out.shape), out)[1])(orig_asm(*a)))

    def traced_peak(fn):
        fn()  # warm-up: imports and numba compilation on first use are traced Python allocations too
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        try:
            fn()
            return tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()

    with dask.config.set(scheduler="synchronous"):
        b = open_store(path)
        stream = traced_peak(lambda: kernels.over_blocks(b.X, lambda blk: np.array([blk.nnz]), 1).compute())
        peak = traced_peak(lambda: tl.rank_genes_groups(b, "g", method="wilcoxon", tie_correct=True,
                                                        gene_block=gene_block))
    assert shapes and max(s[0] for s in shapes) <= gene_block
    assert all(s[1] == n for s in shapes)
    print(f"peak {peak / 2**20:.1f} MiB, one streaming pass {stream / 2**20:.1f} MiB, "
          f"matrix {matrix_bytes / 2**20:.1f} MiB")
    assert peak < 2.5 * stream and peak < 0.35 * matrix_bytes, (peak, stream, matrix_bytes)


@pytest.mark.parametrize(("dtype", "n_cells", "decimals"),
                         [(np.float32, 500, 1), (np.float32, 20_000, 6), (np.float64, 500, 1), (np.int32, 500, 1)])
def test_gene_ranks_numba_path_equals_the_vectorised_one(dtype, n_cells, decimals):
    """The CPU kernel for one group against the rest (float32: a radix sort per gene; else argsort) gives the
    vectorised path's numbers: ties, negative and non-integer values, explicit zeros, empty genes, cells
    outside every group; with 20,000 cells and 6 decimals every pass of the radix sort moves values."""
    rng = np.random.default_rng(7)
    n_genes, n_codes = 23, 5  # code 4: no group
    dense = np.round(rng.normal(0.5, 2, (n_genes, n_cells)), decimals) * (rng.random((n_genes, n_cells)) < 0.3)
    dense[3] = 0  # a gene with no value
    dense[5, :] = 2.0  # a gene with one tie group and no zero
    block = sp.csr_matrix(dense.astype(dtype))
    block.data[::17] = 0  # explicit zeros stay stored
    codes = rng.integers(0, n_codes, n_cells)
    sizes = np.bincount(codes, minlength=n_codes).astype(float)
    tested = [0, 1, 2, 3]
    got = kernels.gene_block_ranks(block, codes, n_codes, sizes, tested, None)
    want = kernels.ranks._gene_block_ranks_sorted(block, codes, n_codes, sizes, tested, None)
    np.testing.assert_array_equal(got, want)
    assert np.isfinite(got).all()


def test_wilcoxon_negative_values_ties_and_float64_equal_scanpy(tmp_path):
    """Ranking with values below zero (as in a scaled layer), many ties and zeros, dense float64 blocks."""
    rng = np.random.default_rng(3)
    dense = np.round(rng.normal(0, 1, (400, 60)), 1) * (rng.random((400, 60)) < 0.4)
    # scanpy ranks the float32 copy (its numba kernels are compiled for float32 already); the order of
    # these one-decimal values, and so every rank, is the same in float32 and float64
    groups = pd.Categorical(rng.integers(0, 4, 400).astype(str))
    a = ad.AnnData(X=dense.astype(np.float32), obs=pd.DataFrame({"g": groups}, index=[f"c{i}" for i in range(400)]))
    for kw in ({"tie_correct": True}, {"reference": "1", "tie_correct": True}, {}):
        ref = a.copy()
        sc.tl.rank_genes_groups(ref, "g", method="wilcoxon", **kw)
        got = ad.AnnData(X=da.from_array(dense, chunks=(90, 60)), obs=a.obs.copy())
        with dask.config.set(scheduler="synchronous"):
            tl.rank_genes_groups(got, "g", method="wilcoxon", gene_block=7, work_dir=tmp_path, **kw)
        assert_same_results(ref.uns["rank_genes_groups"], got.uns["rank_genes_groups"], rtol=1e-10,
                            stats=("scores", "pvals", "pvals_adj"))
    assert not list(tmp_path.iterdir())  # the temporary gene-major copy is gone


def test_small_groups_skipped_and_counts_warned(stores, labelled, caplog, tmp_path):
    b = ours(stores)
    col = b.obs["cell_type"].cat.add_categories(["lonely"])
    col.iloc[0] = "lonely"
    b.obs["cell_type"] = col
    with dask.config.set(scheduler="synchronous"), caplog.at_level(logging.WARNING):
        tl.rank_genes_groups(b, "cell_type", method="t-test")
    assert "lonely" in caplog.text and "lonely" not in b.uns["rank_genes_groups"]["names"].dtype.names
    caplog.clear()
    counts = labelled.copy()
    counts.X = sp.csr_matrix(np.round(np.expm1(counts.X.toarray())))
    path = write_log1p(counts, tmp_path / "counts.zarr", 1000)
    with dask.config.set(scheduler="synchronous"), caplog.at_level(logging.WARNING):
        tl.rank_genes_groups(open_store(path), "cell_type", method="wilcoxon", groups=["NK", "B"])
    assert "raw count data" in caplog.text


# ------------------------------------------------------------------------------------------- stage


def run_stage(client, *args) -> int:
    return stage_main(rgg_stage, argv=[*map(str, args), "--address", client.scheduler.address])


def test_stage_writes_store_and_marker_csv(client, stores, labelled, tmp_path):
    out = tmp_path / "markers.zarr"
    rc = run_stage(client, "--input", stores / "log1p.zarr", "--groups-store", stores / "leiden.zarr",
                   "--output", out, "--method", "wilcoxon", "--pts", "--n-genes", "100", "--gene-major",
                   tmp_path / "genes.zarr", "--gene-block", "5000")
    assert rc == 0
    a = ad.read_zarr(out)
    assert isinstance(a.obs["leiden"].dtype, pd.CategoricalDtype)
    ref = reference(labelled, method="wilcoxon", n_genes=100)
    assert_same_results(ref, a.uns["rank_genes_groups"])
    df = sc.get.rank_genes_groups_df(a, group="NK")  # scanpy reads what we wrote
    assert df["names"].iloc[0] == ref["names"]["NK"][0]
    x_data = next(p for p in (out / "X" / "data").rglob("*") if p.is_file())
    src = stores / "log1p.zarr" / x_data.relative_to(out)
    assert os.stat(x_data).st_ino == os.stat(src).st_ino  # X linked, not copied
    table = pd.read_csv(tmp_path / "markers.csv")
    assert list(table.columns) == ["group", "rank", "gene_id", "symbol", "score", "logfoldchange", "pval",
                                   "pval_adj", "pct_in", "pct_out"]
    assert len(table) == 9 * 100
    nk = table[table.group == "NK"]
    assert list(nk.gene_id) == list(ref["names"]["NK"])
    assert np.allclose(nk.pct_in, a.uns["rank_genes_groups"]["pts"]["NK"].loc[nk.gene_id])
    assert (tmp_path / "genes.zarr").exists() and (tmp_path / "markers.json").exists()
    # filtered table: scanpy's criteria; reuses the kept gene-major copy
    rc = run_stage(client, "--input", stores / "log1p.zarr", "--groups-store", stores / "leiden.zarr",
                   "--output", tmp_path / "filtered.zarr", "--method", "wilcoxon", "--n-genes", "100",
                   "--gene-major", tmp_path / "genes.zarr", "--filter-markers")
    assert rc == 0
    f = pd.read_csv(tmp_path / "filtered.csv")
    assert 0 < len(f) < len(table)
    assert (f.pct_in > 0.25).all() and (f.pct_out < 0.5).all() and (f.logfoldchange > 1).all()


@pytest.mark.parametrize(("args", "words"), [
    (["--groupby", "nope"], ["groupby", "nope"]),
    (["--groupby", "n_counts"], ["groupby", "categorical"]),
    (["--method", "magic"], ["method", "magic"]),
    (["--reference", "Martians"], ["reference", "Martians"]),
    (["--groups", "B", "Martians"], ["groups", "Martians"]),
    (["--corr-method", "holm"], ["corr_method", "holm"]),
])
def test_stage_bad_input_fails_cleanly(client, stores, tmp_path, capsys, args, words):
    out = tmp_path / "bad.zarr"
    rc = run_stage(client, "--input", stores / "log1p.zarr", "--groups-store", stores / "leiden.zarr",
                   "--output", out, *args)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 1
    assert err.startswith("atlasflow rank_genes_groups: error:") and all(w in err for w in words), err
    assert not out.exists() and not (tmp_path / "bad.csv").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
