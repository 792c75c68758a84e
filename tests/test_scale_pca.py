"""regress_out, scale and pca (and their stages) against scanpy's tutorial pipeline on pbmc3k."""

from __future__ import annotations

import warnings

import anndata as ad
import dask
import dask.array as da
import numpy as np
import pytest
import scipy.sparse as sp
from _oocore import batches, count_x_passes, lazy, store_of

from atlasflow import pp
from atlasflow.errors import ConfigError, InputError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning",
                                        "ignore::scipy.sparse.SparseEfficiencyWarning")
KEYS = ["total_counts", "pct_counts_mt"]


@pytest.fixture(autouse=True)
def _one_blas_thread():
    """BLAS threads of this process only contend on a 2-core CI machine (workers already use one)."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1):
        yield


@pytest.fixture(scope="module")
def tutorial(scanpy_pbmc3k):
    """scanpy: seurat HVGs -> subset -> regress_out(total_counts, pct_counts_mt) -> scale(10) -> PCA."""
    import scanpy as sc
    from threadpoolctl import threadpool_limits

    a = scanpy_pbmc3k["log1p"].copy()
    sc.pp.highly_variable_genes(a, min_mean=0.0125, max_mean=3, min_disp=0.5)
    hvg = a[:, a.var["highly_variable"].to_numpy()].copy()
    regressed = hvg.copy()
    sc.pp.regress_out(regressed, KEYS)
    scaled = regressed.copy()
    sc.pp.scale(scaled, max_value=10)
    pcs = scaled.copy()
    with threadpool_limits(1), warnings.catch_warnings():  # BLAS threads only contend on small CI machines
        warnings.simplefilter("ignore")
        sc.pp.pca(pcs, svd_solver="covariance_eigh")
    return {"log1p": a, "hvg": hvg, "regressed": regressed, "scaled": scaled, "pca": pcs}


def _compute(x):
    with dask.config.set(scheduler="sync"):
        x = x.compute()
    return x.toarray() if sp.issparse(x) else x


def _assert_pca_matches(ours: ad.AnnData, ref: ad.AnnData, n_check: int = 30):
    vr, vr_ref = ours.uns["pca"]["variance_ratio"], ref.uns["pca"]["variance_ratio"]
    np.testing.assert_allclose(vr, vr_ref, rtol=1e-4)
    np.testing.assert_allclose(ours.uns["pca"]["variance"], ref.uns["pca"]["variance"], rtol=1e-4)
    P, R = ours.varm["PCs"], ref.varm["PCs"]
    cos = np.abs((P * R).sum(0)) / np.linalg.norm(P, axis=0) / np.linalg.norm(R, axis=0)
    assert cos[:n_check].min() >= 0.999, cos[:n_check]
    signs = np.sign((P * R).sum(0))
    assert ours.obsm["X_pca"].dtype == np.float32
    scale = np.abs(ref.obsm["X_pca"][:, :n_check]).max()
    np.testing.assert_allclose(ours.obsm["X_pca"][:, :n_check] * signs[:n_check], ref.obsm["X_pca"][:, :n_check],
                               atol=1e-4 * scale)


# --------------------------------------------------------------------------------------------- regress_out


def test_regress_out_matches_scanpy(tutorial):
    ours = lazy(tutorial["hvg"], 500)
    with dask.config.set(scheduler="sync"):
        pp.regress_out(ours, KEYS)
    assert isinstance(ours.X, dask.array.Array)
    x = _compute(ours.X)
    ref = tutorial["regressed"].X
    assert x.dtype == ref.dtype == np.float32
    # float32 rounding of the same float64 residuals (observed: bit-identical on pbmc3k)
    np.testing.assert_allclose(x, ref, rtol=1e-6, atol=1e-6)


def test_regress_out_categorical_matches_scanpy(tutorial):
    import scanpy as sc

    h = tutorial["hvg"][:, :120].copy()
    h.obs["batch"] = batches(h.n_obs)
    ref = h.copy()
    sc.pp.regress_out(ref, "batch")
    ours = lazy(h, 700)
    with dask.config.set(scheduler="sync"):
        pp.regress_out(ours, "batch")
    x = _compute(ours.X)
    # scanpy fits against float32 category means; ours are float64: equal to float32 rounding of the means
    np.testing.assert_allclose(x, ref.X, rtol=1e-6, atol=5e-6)


def test_regress_out_bad_keys(tutorial):
    h = lazy(tutorial["hvg"], 1000)
    with pytest.raises(InputError, match=r"keys \['nope'\]"):
        pp.regress_out(h, ["total_counts", "nope"])
    h.obs["const"] = 1.0
    with pytest.raises(InputError, match="obs\\['const'\\] is constant"):
        pp.regress_out(h, ["total_counts", "const"])
    h.obs["twice"] = h.obs["total_counts"] * 2
    with pytest.raises(InputError, match="collinear"):
        pp.regress_out(h, ["total_counts", "twice"])
    h.obs["batch"] = batches(h.n_obs)
    with pytest.raises(ConfigError, match="categorical key must be the only key"):
        pp.regress_out(h, ["batch", "total_counts"])
    h.obs["one"] = batches(h.n_obs, k=1)
    with pytest.raises(InputError, match="single category"):
        pp.regress_out(h, "one")


# ------------------------------------------------------------------------------------------------- scale


def test_scale_dense_matches_scanpy(tutorial):
    ours = lazy(tutorial["regressed"], 500, dense=True)
    with dask.config.set(scheduler="sync"):
        pp.scale(ours, max_value=10)
    ref = tutorial["scaled"]
    x = _compute(ours.X)
    assert x.dtype == np.float32
    np.testing.assert_allclose(x, ref.X, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ours.var["mean"], ref.var["mean"], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(ours.var["std"], ref.var["std"], rtol=1e-12)
    assert x.max() <= 10 and x.min() >= -10


def test_scale_sparse_variants_match_scanpy(tutorial):
    import scanpy as sc

    h = tutorial["hvg"]
    ref = h.copy()
    sc.pp.scale(ref, max_value=10)  # sparse input: scanpy densifies to float64
    ours = lazy(h, 600)
    with dask.config.set(scheduler="sync"):
        pp.scale(ours, max_value=10)
    np.testing.assert_allclose(_compute(ours.X), ref.X, rtol=1e-6, atol=2e-6)
    np.testing.assert_allclose(ours.var["std"], ref.var["std"], rtol=1e-12)

    ref = h.copy()
    sc.pp.scale(ref, zero_center=False, max_value=5)
    ours = lazy(h, 600)
    with dask.config.set(scheduler="sync"):
        pp.scale(ours, zero_center=False, max_value=5)
    assert sp.issparse(ours.X._meta)
    np.testing.assert_allclose(_compute(ours.X), ref.X.toarray(), rtol=1e-6, atol=1e-7)

    masked = h.copy()
    masked.obs["early"] = np.arange(h.n_obs) < 1500
    ref = masked.copy()
    sc.pp.scale(ref, mask_obs="early")
    ours = lazy(masked, 600, dense=True)
    with dask.config.set(scheduler="sync"):
        pp.scale(ours, mask_obs="early")
    ref_x = ref.X.toarray() if sp.issparse(ref.X) else ref.X
    np.testing.assert_allclose(_compute(ours.X), ref_x, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ours.var["std of early"], ref.var["std of early"], rtol=1e-12)


# --------------------------------------------------------------------------------------------------- pca


def test_pca_matches_scanpy_covariance_eigh(tutorial):
    ours = lazy(tutorial["scaled"], 500, dense=True)
    with dask.config.set(scheduler="sync"):
        pp.pca(ours)
    ref = tutorial["pca"]
    assert ours.obsm["X_pca"].shape == (ours.n_obs, 50) and ours.varm["PCs"].shape == (ours.n_vars, 50)
    _assert_pca_matches(ours, ref, n_check=50)
    assert ours.uns["pca"]["params"] == {k: v for k, v in ref.uns["pca"]["params"].items() if v is not None}


def test_pca_mask_var_and_no_centering(tutorial):
    cells = slice(0, 1200)  # a subset of cells keeps this quick; the oracle test above uses all
    full = lazy(tutorial["log1p"][cells], 500)
    sub = lazy(tutorial["hvg"][cells], 500)
    with dask.config.set(scheduler="sync"):
        pp.pca(full, n_comps=20)  # highly_variable is a var column: used as the mask by default
        pp.pca(sub, n_comps=20, mask_var=None)
    hv = tutorial["log1p"].var["highly_variable"].to_numpy()
    assert full.uns["pca"]["params"]["mask_var"] == "highly_variable"
    assert (full.varm["PCs"][~hv] == 0).all()
    np.testing.assert_allclose(full.varm["PCs"][hv], sub.varm["PCs"], atol=1e-10)
    np.testing.assert_allclose(full.obsm["X_pca"], sub.obsm["X_pca"], rtol=1e-5, atol=1e-5)

    x = tutorial["hvg"][cells].X.toarray().astype(np.float64)
    _, vecs = np.linalg.eigh(x.T @ x)
    vt = vecs[:, ::-1].T
    ours = lazy(tutorial["hvg"][cells], 500)
    with dask.config.set(scheduler="sync"):
        pp.pca(ours, n_comps=10, zero_center=False)
    cos = np.abs((ours.varm["PCs"] * vt[:10].T).sum(0))
    assert cos.min() >= 0.999
    proj = x @ ours.varm["PCs"]
    np.testing.assert_allclose(ours.obsm["X_pca"], proj, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ours.uns["pca"]["variance"], proj.var(axis=0), rtol=1e-6)
    np.testing.assert_allclose(ours.uns["pca"]["variance_ratio"], proj.var(axis=0) / x.var(axis=0).sum(), rtol=1e-6)


def test_pca_bad_inputs(tutorial):
    h = lazy(tutorial["scaled"], 1000, dense=True)
    with pytest.raises(ConfigError, match="n_comps=1838"):
        pp.pca(h, n_comps=1838)
    with pytest.raises(ConfigError, match="Gram matrix.*subset to highly variable genes"):
        pp.pca(h, max_gram_mib=1)
    with pytest.raises(InputError, match="mask_var='nope'"):
        pp.pca(h, mask_var="nope")


# ------------------------------------------------------------------------------- chunks, workers, passes


def test_same_results_for_chunk_sizes_and_workers(tutorial, client):
    genes = tutorial["hvg"][:, :600].copy()  # 600 of the HVGs: the property does not need all

    def chain(a):
        pp.regress_out(a, KEYS)
        pp.scale(a, max_value=10)
        pp.pca(a, n_comps=30)
        return a

    runs = []
    for chunk in (300, 1000, 2638):
        with dask.config.set(scheduler="sync"):
            runs.append(chain(lazy(genes, chunk)))
    for other in runs[1:]:
        _assert_pca_matches(other, runs[0])
        np.testing.assert_allclose(other.var["std"], runs[0].var["std"], rtol=1e-12)
    a = chain(lazy(genes, 300))  # on the 2-worker cluster: bit-identical to the same chunks in-process
    np.testing.assert_array_equal(a.obsm["X_pca"], runs[0].obsm["X_pca"])
    np.testing.assert_array_equal(a.uns["pca"]["variance"], runs[0].uns["pca"]["variance"])
    np.testing.assert_array_equal(a.var["std"], runs[0].var["std"])


def _run_stage(stage, argv):
    from atlasflow.cli import build_parser

    args = build_parser(stage, stage.__name__.rsplit(".", 1)[-1]).parse_args(argv)
    return stage.run(args, None)


def test_stage_passes_over_x(tutorial, tmp_path):
    """Passes over X: subset once (each block computed once, stashed, then copied into place), regress_out and
    scale twice (fit, then write), pca twice (Gram, then projection). The stage summary's count, taken from
    the task graphs (atlasflow.passes), agrees with the values actually read."""
    from atlasflow import passes as counted
    from atlasflow.stages import pca, regress_out, scale, subset

    log1p = tutorial["log1p"].copy()
    path = store_of(log1p, tmp_path / "hvg.zarr", 700)
    chain = [(subset, path, tmp_path / "subset.zarr", [], 1),
             (regress_out, tmp_path / "subset.zarr", tmp_path / "regress.zarr", ["--keys", *KEYS], 2),
             (scale, tmp_path / "regress.zarr", tmp_path / "scale.zarr", ["--max-value", "10"], 2),
             (pca, tmp_path / "scale.zarr", tmp_path / "pca.zarr", [], 2)]
    for stage, src, dst, extra, passes in chain:
        counted.PASSES.clear()
        with dask.config.set(scheduler="sync"), count_x_passes(src) as reads:
            _run_stage(stage, ["--input", str(src), "--output", str(dst), *extra])
        assert reads["X"] == passes, stage.__name__
        assert counted.summary()[f"{src.stem}/X"] == passes, stage.__name__
    out = ad.read_zarr(tmp_path / "pca.zarr")
    _assert_pca_matches(out, tutorial["pca"])
    np.testing.assert_allclose(ad.read_zarr(tmp_path / "scale.zarr").X, tutorial["scaled"].X, rtol=1e-6, atol=1e-6)
    assert isinstance(out.X, np.ndarray)  # dense after scale


@pytest.mark.parametrize("zero_center,max_value", [(True, 10.0), (True, None), (True, 0.5), (False, 2.0)])
def test_scaled_gram_from_sparse_equals_dense(zero_center, max_value):
    """The sparse route's Gram matrix, sums and projection equal those of the densely scaled block, including
    clipped implicit zeros (a gene in every cell with a small spread), stored zeros and unsorted indices."""
    from atlasflow import kernels

    rng = np.random.default_rng(3)
    x = sp.random(400, 60, density=0.1, random_state=4, format="csr", dtype=np.float32)
    x.data = rng.gamma(2, 1, x.nnz).astype(np.float32)
    x = x.tolil()
    x[:, 7] = 5 + rng.random((400, 1)) * 0.01  # -mean/std far below -max_value: its zeros would clip
    x = x.tocsr()
    x[:, 7] = x[:, 7].toarray()
    x[3, 7] = 0.0  # one cell without it
    x.data[:5] = 0  # stored zeros
    x.indices = x.indices.copy()
    lo, hi = x.indptr[10], x.indptr[11]
    x.indices[lo:hi], x.data[lo:hi] = x.indices[lo:hi][::-1].copy(), x.data[lo:hi][::-1].copy()
    x.has_sorted_indices = False
    dense = x.toarray()
    mean, std = dense.mean(0).astype(np.float64), dense.std(0, ddof=1).astype(np.float64)
    scaling = (mean, std, zero_center, max_value, np.dtype(np.float32))
    z = kernels.scale_block(x, *scaling)
    z = z.toarray() if sp.issparse(z) else z  # sparse when not centred
    if max_value is not None and zero_center:
        assert (z[:, 7] == -max_value).any()  # the clipped-zero case is exercised
    comps, offset = rng.normal(size=(60, 4)), rng.normal(size=4)
    for cols in (None, np.arange(0, 60, 2)):
        zc = z if cols is None else z[:, cols]
        m = zc.shape[1]
        z0 = kernels.scaled_zero(mean if cols is None else mean[cols], std if cols is None else std[cols],
                                 *scaling[2:])
        y = zc.astype(np.float64) - z0
        ref, got = kernels.gram_and_sums(y), kernels.scaled_gram_and_sums(x, *scaling, cols)
        ref[: m * m] = np.triu(ref[: m * m].reshape(m, m)).ravel()
        np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12 * np.abs(ref).max())
        np.testing.assert_allclose(kernels.scaled_gram_and_sums(x.toarray(), *scaling, cols), ref, rtol=1e-12,
                                   atol=1e-12 * np.abs(ref).max())  # the dense (and GPU) route
        c = comps[: zc.shape[1]]
        np.testing.assert_allclose(kernels.scaled_project_block(x, *scaling, c, offset, cols),
                                   kernels.project_block(zc, c, offset), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("zero_center,max_value", [(True, 10.0), (True, None), (True, 0.5), (False, 2.0)])
def test_scaled_entries_loop_gives_the_bits_of_the_numpy_scaling(dtype, zero_center, max_value):
    """The numba loop behind the sparse route rounds each stored value as ``scaled_values`` does."""
    from atlasflow import kernels

    rng = np.random.default_rng(5)
    x = sp.random(300, 40, density=0.2, random_state=6, format="csr", dtype=np.float64)
    x.data = rng.gamma(2, 1, x.nnz) * 3
    mean, std = rng.random(40) * 2, rng.random(40) * 0.5 + 0.01
    y, z0 = kernels.scaling._scaled_sparse(x, mean, std, zero_center, max_value, dtype)
    ref = kernels.scaled_values(x.data.astype(dtype), mean[x.indices], std[x.indices], zero_center, max_value,
                                dtype).astype(np.float64) - z0[x.indices]
    np.testing.assert_array_equal(y.data, ref)
    if max_value is not None:  # clipping is exercised
        assert (ref + z0[x.indices] == np.float64(np.dtype(dtype).type(max_value))).any()


def test_lanes_sum_the_blocks_in_a_fixed_order(monkeypatch, client):
    """``accumulate_blocks`` (PCA's Gram matrix): lanes of blocks each fill one buffer; the sum equals the
    per-block partials' sum, with the same bits in-process and on the 2-worker cluster, and at most
    MAX_LANES buffers whatever the number of blocks."""
    from atlasflow import kernels

    rng = np.random.default_rng(7)
    x = sp.random(1000, 30, density=0.2, random_state=8, format="csr", dtype=np.float32)
    x.data = rng.gamma(2, 1, x.nnz).astype(np.float32)
    dx = da.from_array(x, chunks=(50, 30), asarray=False)  # 20 blocks
    monkeypatch.setattr(kernels.reduce, "LANE_BLOCKS", 3)
    monkeypatch.setattr(kernels.reduce, "MAX_LANES", 4)  # 20 blocks in 4 lanes of 5
    lanes = kernels.accumulate_blocks(dx, kernels.gram_and_sums, 30 * 30 + 30)
    n_steps = sum(1 for k in lanes.__dask_graph__() if "lane_step" in str(k))
    assert n_steps == 20
    with dask.config.set(scheduler="sync"):
        local = lanes.compute()
        tree = kernels.over_blocks(dx, kernels.gram_and_sums, 30 * 30 + 30).compute()
    np.testing.assert_allclose(local, tree, rtol=1e-12)
    dense = x.toarray().astype(np.float64)
    np.testing.assert_allclose(local[:900].reshape(30, 30), dense.T @ dense, rtol=1e-12)
    np.testing.assert_array_equal(client.compute(lanes).result(), local)


def test_pca_keeps_a_small_x_in_memory_between_its_passes(tutorial, tmp_path, monkeypatch, caplog):
    """On a distributed cluster, PCA reads a stored X once when it fits in ``cache.SHARE`` of the workers'
    memory, twice (streaming) when it does not; the same PCA either way."""
    import logging

    from distributed import Client, LocalCluster

    from atlasflow import cache, passes
    from atlasflow.store import open_store

    path = store_of(tutorial["scaled"], tmp_path / "scaled.zarr", 700)
    runs = {}
    # The in-process worker measures the whole pytest process: late in the suite that alone passes 80% of its
    # 2 GB and the worker would pause for good (a hang). Its limit is what cache.SHARE is a share of; it must
    # not pause, spill or restart here.
    no_pausing = {f"distributed.worker.memory.{k}": False for k in ("target", "spill", "pause", "terminate")}
    with (dask.config.set(no_pausing),
          LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0",
                       memory_limit="2GB") as cluster, Client(cluster)):
        for share in (0.1, 0.0):
            monkeypatch.setattr(cache, "SHARE", share)
            a = open_store(path)
            caplog.clear()
            passes.PASSES.clear()
            with count_x_passes(path) as reads, caplog.at_level(logging.INFO):
                pp.pca(a)
            kept = "keeping X in the workers' memory" in caplog.text
            assert (kept, reads["X"]) == ((True, 1) if share else (False, 2)), share
            assert passes.summary() == {"scaled/X": reads["X"]}  # the count the stage summary reports
            runs[share] = a
    np.testing.assert_array_equal(runs[0.1].obsm["X_pca"], runs[0.0].obsm["X_pca"])
    _assert_pca_matches(runs[0.1], tutorial["pca"])


def test_pca_stage_from_the_sparse_matrix_scale_read(tutorial, tmp_path, caplog):
    """scanpy's current tutorial (no regress_out): pca reads subset's sparse X and scales it on the fly, never
    the dense scaled X, and matches scanpy and the dense route; without a usable sparse source it says so."""
    import logging

    import scanpy as sc
    from threadpoolctl import threadpool_limits

    from atlasflow.stages import pca, scale

    ref = tutorial["hvg"].copy()
    sc.pp.scale(ref, max_value=10)
    with threadpool_limits(1), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sc.pp.pca(ref, svd_solver="covariance_eigh")
    sub = store_of(tutorial["hvg"], tmp_path / "subset.zarr", 700)
    scaled = tmp_path / "scale.zarr"
    with dask.config.set(scheduler="sync"):
        _run_stage(scale, ["--input", str(sub), "--output", str(scaled), "--max-value", "10"])
    runs = {}
    for name, unscaled in [("sparse", str(sub)), ("dense", "none"), ("dense_mismatch", str(tutorial_store(
            tutorial, tmp_path)))]:
        out = tmp_path / f"pca_{name}.zarr"
        caplog.clear()
        with (dask.config.set(scheduler="sync"), count_x_passes(scaled) as reads, count_x_passes(sub) as sparse_reads,
              caplog.at_level(logging.INFO)):
            _run_stage(pca, ["--input", str(scaled), "--output", str(out), "--unscaled", unscaled])
        runs[name] = ad.read_zarr(out)
        from_sparse = "from the sparse matrix X was scaled from" in caplog.text
        assert from_sparse == (name == "sparse"), name
        # two passes (Gram matrix, projection) over the matrix it computes from, none over the other
        assert (reads["X"], sparse_reads["X"]) == ((0, 2) if name == "sparse" else (2, 0))
    assert "does not have the cells and genes" in caplog.text
    _assert_pca_matches(runs["sparse"], ref, n_check=50)
    dense, sparse = runs["dense"], runs["sparse"]
    np.testing.assert_array_equal(runs["dense_mismatch"].obsm["X_pca"], dense.obsm["X_pca"])
    np.testing.assert_allclose(sparse.uns["pca"]["variance"], dense.uns["pca"]["variance"], rtol=1e-10)
    np.testing.assert_allclose(sparse.varm["PCs"], dense.varm["PCs"], atol=1e-8)
    np.testing.assert_allclose(sparse.obsm["X_pca"], dense.obsm["X_pca"], atol=1e-5)


def tutorial_store(tutorial, tmp_path):
    """A sparse store with the HVG genes but not all the cells: not what scale read."""
    return store_of(tutorial["hvg"][:2000].copy(), tmp_path / "fewer_cells.zarr", 700)


def test_stages_on_the_cluster_and_bad_input(tutorial, client, tmp_path):
    from atlasflow.cli import stage_main
    from atlasflow.stages import pca, regress_out, scale

    attach = ["--address", client.scheduler.address]
    src = store_of(tutorial["hvg"], tmp_path / "subset.zarr", 500)
    assert stage_main(regress_out, argv=["--input", str(src), "--output", str(tmp_path / "r.zarr"), *attach]) == 0
    assert stage_main(scale, argv=["--input", str(tmp_path / "r.zarr"), "--output", str(tmp_path / "s.zarr"),
                                   "--max-value", "10", *attach]) == 0
    assert stage_main(pca, argv=["--input", str(tmp_path / "s.zarr"), "--output", str(tmp_path / "p.zarr"),
                                 *attach]) == 0
    _assert_pca_matches(ad.read_zarr(tmp_path / "p.zarr"), tutorial["pca"])

    for stage, extra in [(regress_out, ["--keys", "nope"]), (pca, ["--n-comps", "5000"])]:
        bad = tmp_path / "bad.zarr"
        rc = stage_main(stage, argv=["--input", str(tmp_path / "s.zarr"), "--output", str(bad), *extra, *attach])
        assert rc == 1 and not bad.exists() and not bad.with_suffix(".json").exists()
