"""qc -> filter -> normalize -> log1p against scanpy on pbmc3k, chunk-size invariance, laziness, passes over X."""

from __future__ import annotations

import os

import anndata as ad
import dask
import dask.array as da
import numpy as np
import pytest
import scipy.sparse as sp

import atlasflow as af
from atlasflow.cli import stage_main
from atlasflow.stages import filter as filter_stage
from atlasflow.stages import log1p as log1p_stage
from atlasflow.stages import normalize as normalize_stage
from atlasflow.stages import qc as qc_stage
from atlasflow import store
from atlasflow.store import open_store

TUTORIAL = ["--min-genes", "200", "--max-genes", "2500", "--max-pct-mt", "5", "--min-cells", "3"]


class ReadCounter:
    """Counts row-block reads of lazily opened CSR stores (one per block per pass over X).

    Wraps ``store.read._read_csr_block`` (the function each read task calls), so graph optimisations such as
    task fusion cannot hide a read. Open stores inside the ``with`` block.
    """

    def __init__(self):
        self.reads = 0
        self._orig = store.read._read_csr_block

    def __enter__(self):
        def counted(*args, **kwargs):
            self.reads += 1
            return self._orig(*args, **kwargs)

        store.read._read_csr_block = counted
        return self

    def __exit__(self, *exc):
        store.read._read_csr_block = self._orig

    def passes(self, n_blocks: int) -> float:
        return self.reads / n_blocks


def run_stage(module, *args):
    assert stage_main(module, argv=[*args, "--n-workers", "1"]) == 0


@pytest.fixture(scope="module")
def pipeline(pbmc3k_raw_store, tmp_path_factory):
    """The four stages run through their CLI on pbmc3k with the tutorial thresholds."""
    d = tmp_path_factory.mktemp("pre")
    run_stage(qc_stage, "--input", str(pbmc3k_raw_store), "--output", str(d / "qc.zarr"), "--chunk-rows", "700")
    run_stage(filter_stage, "--input", str(d / "qc.zarr"), "--output", str(d / "filter.zarr"), *TUTORIAL)
    run_stage(normalize_stage, "--input", str(d / "filter.zarr"), "--output", str(d / "normalize.zarr"),
              "--target-sum", "1e4")
    run_stage(log1p_stage, "--input", str(d / "normalize.zarr"), "--output", str(d / "log1p.zarr"))
    return d


def test_qc_metrics_equal_scanpy(pipeline, scanpy_pbmc3k):
    ref = scanpy_pbmc3k["qc"]
    ours = ad.read_zarr(pipeline / "qc.zarr")
    assert list(ours.obs_names) == list(ref.obs_names)
    for col in ref.obs.columns:
        np.testing.assert_allclose(ours.obs[col].to_numpy(float), ref.obs[col].to_numpy(float), rtol=1e-6,
                                   err_msg=col)
    for col in ("n_cells_by_counts", "mean_counts", "log1p_mean_counts", "pct_dropout_by_counts",
                "total_counts", "log1p_total_counts"):
        np.testing.assert_allclose(ours.var[col].to_numpy(float), ref.var[col].to_numpy(float), rtol=1e-6,
                                   err_msg=col)
    assert int(ours.var["mt"].sum()) == 13


def test_tutorial_filter_counts(pipeline):
    out = ad.read_zarr(pipeline / "filter.zarr")
    assert out.shape == (2638, 13714)
    assert out.X.nnz == 2_238_732


def _filter_with(qc_store, out, *argv):
    """filter run by hand on the synchronous scheduler, its X reads counted: (store, passes over X)."""
    from atlasflow.cli import build_parser

    ns = build_parser(filter_stage, "filter").parse_args(
        ["--input", str(qc_store), "--output", str(out), "--chunk-rows", "500", *argv])
    with dask.config.set(scheduler="synchronous"), ReadCounter() as rc:
        filter_stage.run(ns, None)
    return ad.read_zarr(out), rc.passes(open_store(qc_store, chunk_rows=500).X.numblocks[0])


def test_min_cells_counts_over_the_cells_min_genes_keeps(pipeline, pbmc3k_dir, tmp_path):
    """scanpy's tutorial order (and Seurat's): filter_cells(min_genes), filter_genes(min_cells) over the cells
    left, then the max_genes/mitochondrial cuts. min_genes 500 leaves out cells that hold the only reads of
    some genes, so the order shows in the gene set; the other orders are scanpy's calls in their order."""
    import scanpy as sc

    a = sc.read_10x_mtx(pbmc3k_dir)
    a.var["mt"] = a.var_names.str.startswith("MT-")
    sc.pp.calculate_qc_metrics(a, qc_vars=["mt"], inplace=True)
    late = lambda b: (b.obs["n_genes_by_counts"] <= 2500).to_numpy() & (b.obs["pct_counts_mt"] < 5).to_numpy()
    tutorial = a.copy()
    sc.pp.filter_cells(tutorial, min_genes=500)
    sc.pp.filter_genes(tutorial, min_cells=3)
    tutorial = tutorial[late(tutorial)]
    every_cut = a[(a.obs["n_genes_by_counts"] >= 500).to_numpy() & late(a)].copy()
    sc.pp.filter_genes(every_cut, min_cells=3)
    genes_first = a.copy()
    sc.pp.filter_genes(genes_first, min_cells=3)

    argv = ["--min-genes", "500", "--max-genes", "2500", "--max-pct-mt", "5", "--min-cells", "3"]
    qc = pipeline / "qc.zarr"
    ours, passes = _filter_with(qc, tmp_path / "default.zarr", *argv)
    assert list(ours.obs_names) == list(tutorial.obs_names)
    assert list(ours.var_names) == list(tutorial.var_names)
    assert 1 < passes <= 2  # the write, and the row blocks holding the cells min_genes leaves out
    kept, _ = _filter_with(qc, tmp_path / "kept.zarr", *argv, "--min-cells-over", "kept")
    assert list(kept.var_names) == list(every_cut.var_names)
    old, passes = _filter_with(qc, tmp_path / "qc.zarr", *argv, "--min-cells-over", "qc")
    assert list(old.var_names) == list(genes_first.var_names) and passes == 1  # the write only
    # the three orders give three gene sets here, so each comparison above can fail
    assert len({ours.n_vars, kept.n_vars, old.n_vars}) == 3, (ours.n_vars, kept.n_vars, old.n_vars)
    np.testing.assert_array_equal(ours.X.toarray(), tutorial.X.toarray())


@pytest.mark.parametrize("stage,snap", [("normalize", "normalized"), ("log1p", "log1p")])
def test_values_equal_scanpy(pipeline, scanpy_pbmc3k, stage, snap):
    ref = scanpy_pbmc3k[snap]
    ours = ad.read_zarr(pipeline / f"{stage}.zarr")
    assert ours.X.dtype == np.float32
    assert list(ours.obs_names) == list(ref.obs_names)
    diff = abs(ours.X - sp.csr_matrix(ref.X))
    assert diff.nnz == 0 or diff.max() <= np.finfo(np.float32).eps * 4 * abs(ref.X).max()
    if stage == "log1p":
        assert ours.uns["log1p"] == {"base": None} or ours.uns["log1p"].get("base") is None


def test_unchanged_x_is_linked_not_copied(pipeline, pbmc3k_raw_store):
    src = next((pbmc3k_raw_store / "X" / "data").rglob("c/*"))
    dst = pipeline / "qc.zarr" / src.relative_to(pbmc3k_raw_store)
    assert dst.exists() and os.stat(dst).st_ino == os.stat(src).st_ino


def test_normalize_and_log1p_rewrite_only_values(pipeline):
    """Both keep every stored entry: indices/indptr are hard links of filter's, data is new."""
    for stage in ("normalize", "log1p"):
        for part, linked in (("indices", True), ("indptr", True), ("data", False)):
            src = next((pipeline / "filter.zarr" / "X" / part).rglob("c/*"))
            dst = pipeline / f"{stage}.zarr" / src.relative_to(pipeline / "filter.zarr")
            assert (os.stat(dst).st_ino == os.stat(src).st_ino) is linked, (stage, part)


def test_values_only_write_equals_block_write(tmp_path, monkeypatch):
    """The values-only writer (data chunks crossing rows, empty rows, a per-row factor, two chained maps,
    several tasks) writes exactly what the block-by-block path computes."""
    rng = np.random.default_rng(3)
    x = sp.random(300, 40, density=0.2, format="csr", random_state=rng, dtype=np.float32)
    x.data = np.ceil(x.data * 9)
    empty = np.ones(300, dtype=np.float32)
    empty[[5, 6, 150]] = 0
    x = sp.csr_matrix(sp.diags(empty) @ x)
    x.eliminate_zeros()
    monkeypatch.setattr(store.write, "FLAT_CHUNK", 97)
    monkeypatch.setattr(store.write, "MAPPED_CHUNKS_PER_TASK", 2)
    store.write_store(ad.AnnData(X=da.from_array(x, chunks=(64, 40), asarray=False)), tmp_path / "raw.zarr")
    with dask.config.set(scheduler="synchronous"):
        a = open_store(tmp_path / "raw.zarr", chunk_rows=64)
        af.pp.normalize_total(a, target_sum=100)
        af.pp.log1p(a, base=2)
        expected = a.X.compute()
        store.write_store(a, tmp_path / "log1p.zarr")
    assert (tmp_path / "raw.zarr" / "X" / "data" / "c" / "2").exists()  # the data really has several chunks
    linked = [os.stat(d / "X" / "indices" / "c" / "1").st_ino for d in (tmp_path / "raw.zarr", tmp_path / "log1p.zarr")]
    assert linked[0] == linked[1]  # the values-only path ran
    got = ad.read_zarr(tmp_path / "log1p.zarr").X
    np.testing.assert_array_equal(got.indptr, expected.indptr)
    np.testing.assert_array_equal(got.indices, expected.indices)
    np.testing.assert_array_equal(got.data, expected.data)
    dense = x.toarray()
    totals = dense.sum(1, keepdims=True)
    ref = np.log1p(dense / np.where(totals == 0, 1, totals / 100)) / np.log(2)
    np.testing.assert_allclose(got.toarray(), ref, rtol=1e-6)


def test_qc_kernels_with_explicit_zeros_ties_and_short_rows():
    """CPU qc kernels (numba top-n, nnz from indptr) against dense NumPy and the sort-based (GPU) top-n path:
    explicit zeros are not counted, rows shorter than n give 1, an empty row gives NaN."""
    from atlasflow import kernels

    x = sp.random(400, 1200, density=0.42, format="csr", random_state=np.random.default_rng(4), dtype=np.float32)
    x = sp.csr_matrix(sp.diags((np.arange(400) != 7).astype(np.float32)) @ x)  # row 7 empty
    x.data = np.floor(x.data * 6)  # small counts: many ties, and explicit zeros
    ns = [1, 50, 100, 200, 500]
    fast = kernels.top_n_fractions(x, ns)
    ref = kernels.stats._top_n_rows(x.data, x.indptr.astype(np.int64), ns, np)
    np.testing.assert_allclose(fast, ref, rtol=1e-12)
    stored = np.diff(x.indptr)
    assert np.isnan(fast[7]).all() and (stored > 500).any() and ((stored < 500) & (stored > 0)).any()
    dense = x.toarray()
    assert (x.data == 0).any()
    np.testing.assert_array_equal(kernels.row_nnz(x), (dense != 0).sum(1))
    np.testing.assert_array_equal(kernels.col_sums_and_nnz(x)[1200:], (dense != 0).sum(0))
    mask = np.arange(1200) % 9 == 0
    np.testing.assert_allclose(kernels.row_sums_masked(x, mask), dense[:, mask].sum(1))


def _pipeline_in_memory(store, chunk_rows):
    adata = open_store(store, chunk_rows=chunk_rows)
    adata.var["mt"] = af.pp.gene_set_masks(adata.var, {"mt": {"prefix": "MT-"}})["mt"]
    af.pp.calculate_qc_metrics(adata, qc_vars=["mt"])
    cells, genes, _ = af.pp.qc_filter_masks(
        adata, thresholds={"min_genes": 200, "max_genes": 2500, "max_pct_mt": 5}, min_cells=3)
    adata = af.pp.filter_cells_genes(adata, cells, genes)
    af.pp.normalize_total(adata, target_sum=1e4)
    af.pp.log1p(adata)
    return adata


def test_results_independent_of_chunk_size(pbmc3k_raw_store):
    with dask.config.set(scheduler="synchronous"):
        results = [_pipeline_in_memory(pbmc3k_raw_store, c) for c in (256, 1000, 5000)]
        mats = [r.X.compute() for r in results]
    for r, m in zip(results[1:], mats[1:], strict=True):
        assert (abs(m - mats[0]) > 0).nnz == 0
        np.testing.assert_array_equal(r.obs["total_counts"], results[0].obs["total_counts"])
        np.testing.assert_array_equal(r.obs["pct_counts_in_top_50_genes"],
                                      results[0].obs["pct_counts_in_top_50_genes"])


def test_elementwise_steps_stay_lazy(pbmc3k_raw_store):
    with dask.config.set(scheduler="synchronous"), ReadCounter() as rc:
        adata = open_store(pbmc3k_raw_store, chunk_rows=500)
        af.pp.log1p(adata)
        assert isinstance(adata.X, da.Array)
        assert rc.reads == 0
        af.pp.normalize_total(adata, target_sum=1e4)
        assert isinstance(adata.X, da.Array)
        assert rc.passes(adata.X.numblocks[0]) == 1  # the per-cell totals only


def test_passes_over_x_per_stage(pbmc3k_raw_store, tmp_path):
    """Whole-CSR passes: qc once (all metrics in one compute, X linked); normalize none (its totals and its
    write read the stored values alone, not the column indices); log1p none (values alone)."""
    from atlasflow.cli import build_parser

    passes = {}
    src = pbmc3k_raw_store
    with dask.config.set(scheduler="synchronous"):
        for name, module, extra in [
            ("qc", qc_stage, []),
            ("filter", filter_stage, TUTORIAL),
            ("normalize", normalize_stage, ["--target-sum", "1e4"]),
            ("log1p", log1p_stage, []),
        ]:
            out = tmp_path / f"{name}.zarr"
            ns = build_parser(module, name).parse_args(
                ["--input", str(src), "--output", str(out), "--chunk-rows", "500", *extra])
            with ReadCounter() as rc:
                module.run(ns, None)
            passes[name] = rc.passes(open_store(src, chunk_rows=500).X.numblocks[0])
            src = out
    assert passes == {"qc": 1, "filter": 1, "normalize": 0, "log1p": 0}


def test_exclude_highly_expressed_matches_scanpy(scanpy_pbmc3k, tmp_path):
    import scanpy as sc

    from atlasflow.store import write_store

    ref = scanpy_pbmc3k["filtered"].copy()
    x = da.from_array(sp.csr_matrix(ref.X), chunks=(600, ref.n_vars), asarray=False)
    write_store(ad.AnnData(X=x, obs=ref.obs[[]], var=ref.var[[]]), tmp_path / "f.zarr")
    ours = open_store(tmp_path / "f.zarr")
    with dask.config.set(scheduler="synchronous"):
        af.pp.normalize_total(ours, exclude_highly_expressed=True, max_fraction=0.05)
        mat = ours.X.compute()
    sc.pp.normalize_total(ref, exclude_highly_expressed=True, max_fraction=0.05)
    np.testing.assert_allclose(mat.toarray(), ref.X.toarray(), rtol=2e-6)


def test_thresholds_removing_every_cell_fail_cleanly(pipeline, tmp_path, capsys):
    out = tmp_path / "none.zarr"
    rc = stage_main(filter_stage, argv=["--input", str(pipeline / "qc.zarr"), "--output", str(out),
                                        "--min-genes", "100000", "--n-workers", "1"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 1
    assert "min_genes" in err and "remove all 2700 cells" in err
    assert not out.exists() and not list(tmp_path.glob(".none.zarr.tmp-*"))


def test_missing_mito_prefix_warns_and_gives_zero(pbmc3k_raw_store, caplog):
    adata = open_store(pbmc3k_raw_store)
    masks = af.pp.gene_set_masks(adata.var, {"mito": {"prefix": "mt-"}})
    assert "matches no gene" in caplog.text
    adata.var["mito"] = masks["mito"]
    with dask.config.set(scheduler="synchronous"):
        af.pp.calculate_qc_metrics(adata, qc_vars=["mito"], percent_top=None)
    assert (adata.obs["pct_counts_mito"] == 0).all()


# --------------------------------------------------------------------------------------------------
# bad numbers: one line naming the key, exit non-zero, nothing written


class FakeSnakemake:
    """What atlasflow.cli.args_from_snakemake reads of Snakemake's `snakemake` object; params arrive unparsed."""

    def __init__(self, stage, input, output, **params):
        self.rule = stage.__name__.rsplit(".", 1)[-1]
        self.input, self.output = {"input": str(input)}, {"output": str(output)}
        self.params, self.log, self.threads = params, [], 1


def test_shared_number_types():
    from atlasflow.errors import ConfigError
    from atlasflow.stages import _common, hvg, neighbors, pca

    assert _common.optional_int("3") == 3 and _common.optional_int(3.0) == 3 and _common.optional_int("none") is None
    assert _common.log_base(None) is None and _common.log_base("2") == 2.0
    for kind, value in [(_common.optional_int, "3.5"), (_common.positive_int, True), (_common.optional_float, "nan"),
                        (_common.optional_float, "inf"), (_common.log_base, 1), (_common.optional_percent, 100.5)]:
        with pytest.raises(ConfigError, match="^key: must be"):
            kind(value, "key")
    assert _common.Number(allow_inf=True)("inf") == float("inf")
    # one definition of optional_int, in _common (hvg, pca and neighbors had their own)
    assert not any("optional_int" in vars(m) and m.optional_int is not _common.optional_int
                   for m in (hvg, pca, neighbors))


BY_HAND = [
    (normalize_stage, ["--target-sum", "-1"], "target_sum: must be a number > 0 (or none), not '-1'"),
    (normalize_stage, ["--target-sum", "0"], "target_sum: must be a number > 0 (or none), not '0'"),
    (log1p_stage, ["--base", "1"], "base: must be a number > 0 other than 1 (or none), not '1'"),
    (log1p_stage, ["--base", "-2"], "base: must be a number > 0 other than 1 (or none), not '-2'"),
    (log1p_stage, ["--base", "0"], "base: must be a number > 0 other than 1 (or none), not '0'"),
    (filter_stage, ["--min-genes", "-5"], "min_genes: must be a number >= 0 (or none), not '-5'"),
    (filter_stage, ["--max-pct-mt", "200"], "max_pct_mt: must be a number in [0, 100] (or none), not '200'"),
    (filter_stage, ["--max-pct-mt", "nan"], "max_pct_mt: must be a finite number, not 'nan'"),
    (qc_stage, ["--percent-top", "50", "0"], "percent_top: must be an integer >= 1, not '0'"),
]


@pytest.mark.parametrize(("stage", "argv", "expect"), BY_HAND,
                         ids=["target_sum-1", "target_sum0", "base1", "base-2", "base0", "min_genes-5",
                              "max_pct_mt200", "max_pct_mt_nan", "percent_top0"])
def test_bad_number_by_hand_is_one_line(pbmc3k_raw_store, tmp_path, capsys, stage, argv, expect):
    """Refused while parsing the command line: nothing starts, nothing is written."""
    out = tmp_path / "out.zarr"
    rc = stage_main(stage, argv=["--input", str(pbmc3k_raw_store), "--output", str(out), "--n-workers", "1", *argv])
    name = stage.__name__.rsplit(".", 1)[-1]
    assert (rc, capsys.readouterr().err.strip().splitlines()) == (2, [f"atlasflow {name}: error: {expect}"])
    assert not out.exists() and not out.with_suffix(".json").exists()


@pytest.mark.parametrize(("stage", "params", "expect"), [
    (normalize_stage, {"target_sum": -1}, "target_sum: must be a number > 0 (or none), not -1"),
    (normalize_stage, {"target_sum": 0}, "target_sum: must be a number > 0 (or none), not 0"),
    (log1p_stage, {"base": 1}, "base: must be a number > 0 other than 1 (or none), not 1"),
    (log1p_stage, {"base": -2}, "base: must be a number > 0 other than 1 (or none), not -2"),
    (log1p_stage, {"base": 0}, "base: must be a number > 0 other than 1 (or none), not 0"),
    (filter_stage, {"min_genes": -5}, "min_genes: must be a number >= 0 (or none), not -5"),
    (filter_stage, {"max_pct_mt": 200}, "max_pct_mt: must be a number in [0, 100] (or none), not 200"),
    (filter_stage, {"min_genes": 500, "max_genes": 100},
     "min_genes (500.0) is above max_genes (100.0): no value can pass both cut-offs"),
], ids=["target_sum-1", "target_sum0", "base1", "base-2", "base0", "min_genes-5", "max_pct_mt200", "min_above_max"])
def test_bad_number_from_snakemake_is_one_line(pbmc3k_raw_store, tmp_path, capsys, client, stage, params, expect):
    """The same values as Snakemake params (not parsed by argparse) are refused by the stage before it reads."""
    out = tmp_path / "out.zarr"
    smk = FakeSnakemake(stage, pbmc3k_raw_store, out, address=client.scheduler.address, **params)
    rc = stage_main(stage, snakemake=smk)
    name = stage.__name__.rsplit(".", 1)[-1]
    assert rc == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"atlasflow {name}: error: {expect}"
    assert not out.exists() and not out.with_suffix(".json").exists()


def test_percent_top_above_the_gene_count_is_refused(pbmc3k_raw_store, tmp_path, capsys, client):
    """scanpy raises IndexError('Positions outside range of features.'); the column used to be dropped silently."""
    out = tmp_path / "qc.zarr"
    n_genes = open_store(pbmc3k_raw_store).n_vars
    rc = stage_main(qc_stage, argv=["--input", str(pbmc3k_raw_store), "--output", str(out), "--address",
                                    client.scheduler.address, "--percent-top", "50", str(n_genes + 1)])
    assert rc == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"atlasflow qc: error: qc.percent_top: {n_genes + 1} > the {n_genes} genes of the input; "
        f"give values up to {n_genes} (or [] for none)")
    assert not out.exists()
    from atlasflow.errors import ConfigError

    with pytest.raises(ConfigError, match=f"percent_top: every n must be between 1 and the {n_genes} genes"):
        af.pp.calculate_qc_metrics(open_store(pbmc3k_raw_store), percent_top=[50, n_genes + 1])
