"""Every preprocessing stage on the GPU against the same stage on the CPU, plus GPU kNN, limits and clusters.

The chain qc -> filter -> normalize -> log1p -> hvg -> (subset) -> scale -> pca (and regress_out, other HVG
flavors on the side) runs once on the CPU (the reference; the CPU oracle tests tie it to scanpy) and once
per GPU scheduler: in-process threads, the no-dask-cuda cluster, dask-cuda's capacity and performance
presets (where dask-cuda is installed) and two workers (where two GPUs exist). Each stage's test first
asserts that X's blocks ARE CuPy / cupyx blocks (a GPU test must never pass by running on the CPU), then
compares the numbers with the CPU oracle tests' tolerances (looser only where noted: CUDA adds float64
partial sums atomically, in another order).

Needs no scanpy and no ../shared data (data are simulated), so it runs on a bare GPU machine.
"""

from __future__ import annotations

import os
import traceback

import dask
import numpy as np
import pytest
import scipy.sparse as sp

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")

from atlasflow import gpu, gpu_cluster, pp  # noqa: E402
from atlasflow.backend import is_gpu  # noqa: E402
from atlasflow.gpu import to_backend  # noqa: E402
from atlasflow.store import open_store, write_store  # noqa: E402

N_CELLS, N_GENES, CHUNK_ROWS = 3000, 2000, 700  # five row blocks, the last one partial
N_TOP = 400
THRESHOLDS = {"min_genes": 100, "max_pct_mt": 20}
#: RMM pool of the performance preset in tests (the preset's 80 % would leave no room for a second cluster that
#: pytest may start while a module-scoped one is still up; the data here are small).
TEST_POOL = "20%"


def _n_gpus() -> int:
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001
        return 0


# ------------------------------------------------------------------------------------------------ data


@pytest.fixture(scope="module")
def raw_store(tmp_path_factory):
    """Simulated raw counts (atlasflow.simulate; a plain negative binomial matrix where it is missing)."""
    path = tmp_path_factory.mktemp("gpu") / "raw.zarr"
    try:
        from atlasflow.simulate import SimParams, write_simulated

        write_simulated(path, SimParams(n_cells=N_CELLS, n_genes=N_GENES, n_cell_types=6, seed=7,
                                        median_counts=2000), chunk_rows=CHUNK_ROWS)
    except ImportError:
        import anndata as ad
        import dask.array as da
        import pandas as pd

        rng = np.random.default_rng(7)
        mean = rng.lognormal(-1.0, 1.5, N_GENES)
        counts = rng.negative_binomial(2, 2 / (2 + mean[None, :] * rng.lognormal(0, 0.4, (N_CELLS, 1))))
        x = sp.csr_matrix(counts.astype(np.float32))
        names = [f"MT-{i}" if i < 13 else f"G{i}" for i in range(N_GENES)]
        a = ad.AnnData(X=da.from_array(x, chunks=(CHUNK_ROWS, N_GENES), asarray=False),
                       obs=pd.DataFrame(index=[f"c{i}" for i in range(N_CELLS)]), var=pd.DataFrame(index=names))
        write_store(a, path, chunk_rows=CHUNK_ROWS)
    return path


def block_kinds(x) -> set[str]:
    """``module.Class`` of every block of a lazy array, found where the blocks live (no transfer of X)."""
    def kind(b):
        return np.array([[f"{type(b).__module__}.{type(b).__qualname__}"]], dtype=object)

    kinds = x.map_blocks(kind, chunks=((1,) * x.numblocks[0], (1,) * x.numblocks[1]), dtype=object,
                         meta=np.empty((0, 0), dtype=object))
    return set(kinds.compute().ravel())


def assert_on_gpu(kinds: set[str], sparse: bool) -> None:
    """Every block is a CuPy array (dense) or a cupyx CSR matrix (sparse): never a host block."""
    assert kinds, "no blocks"
    assert all(k.startswith("cupy") for k in kinds), f"blocks are not on the GPU: {kinds}"
    if sparse:
        assert all(k.startswith("cupyx.scipy.sparse") and k.endswith("csr_matrix") for k in kinds), kinds
    else:
        assert all(k.split(".")[-1] == "ndarray" for k in kinds), kinds


def _host(x):
    x = gpu.to_host(x).compute()
    return x.toarray() if sp.issparse(x) else np.asarray(x)


def _snapshot(a, x_kinds: bool = True, values: bool = True) -> dict:
    snap = {"obs": a.obs.copy(), "var": a.var.copy(), "obsm": {k: np.asarray(v) for k, v in a.obsm.items()},
            "varm": {k: np.asarray(v) for k, v in a.varm.items()}, "uns": dict(a.uns), "shape": a.shape}
    if x_kinds:
        snap["kinds"] = block_kinds(a.X)
    if values:
        snap["X"] = _host(a.X)
    return snap


def run_chain(store, backend: str) -> dict:
    """The stage chain on one backend; per stage a snapshot, or the exception it raised (later stages skip)."""
    out: dict = {}

    def step(name, fn, *needs):
        failed = [n for n in needs if isinstance(out.get(n), BaseException) or n not in out]
        if failed:
            out[name] = RuntimeError(f"not run: upstream stage(s) {failed} failed")
            return
        try:
            out[name] = fn()
        except Exception as exc:  # noqa: BLE001 - reported by the stage's own test
            exc.add_note(traceback.format_exc())
            out[name] = exc

    state = {}

    def qc():
        a = to_backend(open_store(store), backend)
        a.var["mt"] = pp.gene_set_masks(a.var, {"mt": {"prefix": "MT-"}})["mt"]
        pp.calculate_qc_metrics(a, qc_vars=["mt"], percent_top=[50, 100])
        state["a"] = a
        return _snapshot(a, values=False)

    def filt():
        a = state["a"]
        cells, genes, _ = pp.qc_filter_masks(a, thresholds=THRESHOLDS, min_cells=3)
        a = pp.filter_cells_genes(a, cells, genes)
        state["a"] = state["counts"] = a
        return _snapshot(a)

    def normalize():
        a = state["a"].copy()
        pp.normalize_total(a, target_sum=1e4)
        state["a"] = a
        return _snapshot(a)

    def log1p():
        a = state["a"]
        pp.log1p(a)
        return _snapshot(a)

    def hvg():
        a = state["a"]
        pp.highly_variable_genes(a, flavor="seurat", n_top_genes=N_TOP)
        return _snapshot(a, values=False)

    def hvg_other_flavors():
        a = state["a"]
        tables = {"cell_ranger": pp.highly_variable_genes(a, flavor="cell_ranger", n_top_genes=N_TOP, inplace=False),
                  "seurat_cutoffs": pp.highly_variable_genes(a, flavor="seurat", inplace=False)}
        return {"tables": tables, "kinds": block_kinds(a.X)}

    def subset():
        a = state["a"].copy()
        pp.subset_genes(a, a.var["highly_variable"].to_numpy())
        state["sub"] = a
        return _snapshot(a)

    def regress():
        a = state["sub"].copy()
        pp.regress_out(a, ["total_counts", "pct_counts_mt"])
        return _snapshot(a)

    def scale():
        a = state["sub"].copy()
        pp.scale(a, max_value=10)
        state["scaled"] = a
        return _snapshot(a)

    def pca():
        a = state["scaled"]
        pp.pca(a, n_comps=30)
        return _snapshot(a, values=False)

    def pca_sparse():
        """PCA from the sparse matrix scale read, scaled on the fly (the workflow's route)."""
        from atlasflow.pp._pca import ScaledFrom

        a, source = state["scaled"].copy(), state["sub"].X
        scaled_from = ScaledFrom(source, a.var["mean"].to_numpy(), a.var["std"].to_numpy(), True, 10.0, a.X.dtype)
        pp.pca(a, n_comps=30, scaled_from=scaled_from)
        return {**_snapshot(a, values=False), "kinds": block_kinds(source)}

    step("qc", qc)
    step("filter", filt, "qc")
    step("normalize", normalize, "filter")
    step("log1p", log1p, "normalize")
    step("hvg", hvg, "log1p")
    step("hvg_flavors", hvg_other_flavors, "log1p")
    step("subset", subset, "hvg")
    step("regress_out", regress, "subset")
    step("scale", scale, "subset")
    step("pca", pca, "scale")
    step("pca_sparse", pca_sparse, "scale")
    return out


@pytest.fixture(scope="module")
def cpu_ref(raw_store):
    with dask.config.set(scheduler="threads"):
        ref = run_chain(raw_store, "cpu")
    bad = {k: v for k, v in ref.items() if isinstance(v, BaseException)}
    assert not bad, f"the CPU reference chain failed: {bad}"
    return ref


# ------------------------------------------------------------------------------------------ schedulers


def _needs_dask_cuda():
    return pytest.mark.skipif(not gpu_cluster.dask_cuda_available(), reason="dask-cuda is not installed")


SCHEDULERS = [
    pytest.param("threads", id="threads"),
    pytest.param("fallback", id="no-dask-cuda-cluster"),
    pytest.param("capacity", id="dask-cuda-capacity", marks=_needs_dask_cuda()),
    pytest.param("performance", id="dask-cuda-performance", marks=_needs_dask_cuda()),
    pytest.param("two-gpus", id="two-gpus", marks=pytest.mark.skipif(_n_gpus() < 2, reason="fewer than 2 GPUs")),
]


def _free_gpu_memory():
    cupy.get_default_memory_pool().free_all_blocks()


@pytest.fixture(scope="module", params=SCHEDULERS)
def scheduler(request):
    """A GPU scheduler: threads in this process, or a local GPU cluster set as the default client."""
    from distributed import Client

    _free_gpu_memory()
    if request.param == "threads":
        with dask.config.set(scheduler="threads"):
            yield request.param
        return
    if request.param == "fallback":
        cluster = gpu_cluster.local_cuda_cluster("performance", n_workers=1, use_dask_cuda=False)
    elif request.param == "capacity":
        cluster = gpu_cluster.local_cuda_cluster("capacity", n_workers=1)
    elif request.param == "performance":
        proto = None if gpu_cluster.ucx_available() else "tcp"  # no UCX here: the preset's RMM pool over TCP
        cluster = gpu_cluster.local_cuda_cluster("performance", n_workers=1, protocol=proto, rmm_pool_size=TEST_POOL)
    else:
        cluster = gpu_cluster.local_cuda_cluster("capacity", n_workers=2, devices=list(range(min(2, _n_gpus()))))
    client = Client(cluster)
    try:
        client.wait_for_workers(len(cluster.workers), timeout=120)
        with dask.config.set(scheduler=None):
            yield request.param
    finally:
        client.close()
        cluster.close()
        _free_gpu_memory()


@pytest.fixture(scope="module")
def gpu_run(raw_store, scheduler):
    return scheduler, run_chain(raw_store, "gpu")


def _result(run, stage):
    value = run[1][stage]
    if isinstance(value, BaseException):
        raise value
    return value


# --------------------------------------------------------------------------------------- stage by stage


def test_qc(gpu_run, cpu_ref):
    got, ref = _result(gpu_run, "qc"), cpu_ref["qc"]
    assert_on_gpu(got["kinds"], sparse=True)
    assert list(got["obs"].columns) == list(ref["obs"].columns)
    for frame in ("obs", "var"):
        for col in ref[frame].columns:
            a, b = got[frame][col].to_numpy(), ref[frame][col].to_numpy()
            if b.dtype.kind not in "f":  # counts, flags, the simulation's ground-truth labels
                np.testing.assert_array_equal(a.astype(str), b.astype(str), err_msg=f"{frame}.{col}")
            else:
                np.testing.assert_allclose(a.astype(float), b.astype(float), rtol=1e-6, err_msg=f"{frame}.{col}")


def test_filter(gpu_run, cpu_ref):
    got, ref = _result(gpu_run, "filter"), cpu_ref["filter"]
    assert_on_gpu(got["kinds"], sparse=True)
    assert got["shape"] == ref["shape"] and got["shape"][0] < N_CELLS
    assert got["obs"].index.equals(ref["obs"].index) and got["var"].index.equals(ref["var"].index)
    np.testing.assert_array_equal(got["X"], ref["X"])


@pytest.mark.parametrize("stage", ["normalize", "log1p"])
def test_normalize_and_log1p(gpu_run, cpu_ref, stage):
    got, ref = _result(gpu_run, stage), cpu_ref[stage]
    assert_on_gpu(got["kinds"], sparse=True)
    assert got["X"].dtype == ref["X"].dtype == np.float32
    np.testing.assert_allclose(got["X"], ref["X"], rtol=2e-6)
    assert (got["X"] != 0).sum() == (ref["X"] != 0).sum()


def _assert_hvg_table(got, ref):
    cols = [c for c in ("means", "dispersions", "dispersions_norm", "variances", "variances_norm") if c in ref]
    for col in cols:  # float64 sums added in another order on the GPU: 1e-9, not the oracle's 1e-12
        rtol = 1e-6 if ref[col].dtype == np.float32 else 1e-9  # dispersions_norm is stored as float32
        a, b = got[col].to_numpy(float), ref[col].to_numpy(float)
        ok = np.isfinite(b)
        np.testing.assert_array_equal(np.isfinite(a), ok, err_msg=col)
        np.testing.assert_allclose(a[ok], b[ok], rtol=rtol, atol=1e-12, err_msg=col)
    differ = got["highly_variable"].to_numpy() != ref["highly_variable"].to_numpy()
    if differ.any():  # only genes tied (to float32 rounding) with the last selected one may swap
        key = ref["dispersions_norm"].to_numpy(float)
        cut = np.nanmin(key[ref["highly_variable"].to_numpy()])
        assert np.allclose(key[differ], cut, rtol=1e-6), f"{int(differ.sum())} HVG calls differ away from the cutoff"


def test_hvg(gpu_run, cpu_ref):
    got, ref = _result(gpu_run, "hvg"), cpu_ref["hvg"]
    assert_on_gpu(got["kinds"], sparse=True)
    assert int(got["var"]["highly_variable"].sum()) == N_TOP
    _assert_hvg_table(got["var"], ref["var"])


def test_hvg_cell_ranger_and_cutoffs(gpu_run, cpu_ref):
    got, ref = _result(gpu_run, "hvg_flavors"), cpu_ref["hvg_flavors"]
    assert_on_gpu(got["kinds"], sparse=True)
    for name, table in ref["tables"].items():
        _assert_hvg_table(got["tables"][name], table)


def test_subset(gpu_run, cpu_ref):
    got, ref = _result(gpu_run, "subset"), cpu_ref["subset"]
    assert_on_gpu(got["kinds"], sparse=True)
    assert got["shape"] == ref["shape"]
    np.testing.assert_allclose(got["X"], ref["X"], rtol=2e-6)


def test_regress_out(gpu_run, cpu_ref):
    got, ref = _result(gpu_run, "regress_out"), cpu_ref["regress_out"]
    assert_on_gpu(got["kinds"], sparse=False)
    np.testing.assert_allclose(got["X"], ref["X"], rtol=1e-6, atol=1e-6)


def test_scale(gpu_run, cpu_ref):
    got, ref = _result(gpu_run, "scale"), cpu_ref["scale"]
    assert_on_gpu(got["kinds"], sparse=False)
    assert got["X"].dtype == ref["X"].dtype
    np.testing.assert_allclose(got["X"], ref["X"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got["var"]["mean"], ref["var"]["mean"], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got["var"]["std"], ref["var"]["std"], rtol=1e-10)  # oracle: 1e-12 (sum order)


@pytest.mark.parametrize("route", ["pca", "pca_sparse"])
def test_pca(gpu_run, cpu_ref, route):
    """Both routes on the GPU (dense scaled X; the sparse matrix scale read) against the CPU's dense route."""
    got, ref = _result(gpu_run, route), cpu_ref["pca"]
    assert_on_gpu(got["kinds"], sparse=route == "pca_sparse")
    np.testing.assert_allclose(got["uns"]["pca"]["variance_ratio"], ref["uns"]["pca"]["variance_ratio"], rtol=1e-4)
    np.testing.assert_allclose(got["uns"]["pca"]["variance"], ref["uns"]["pca"]["variance"], rtol=1e-4)
    P, R = got["varm"]["PCs"], ref["varm"]["PCs"]
    n_check = 20
    cos = np.abs((P * R).sum(0)) / np.linalg.norm(P, axis=0) / np.linalg.norm(R, axis=0)
    assert cos[:n_check].min() >= 0.999, cos[:n_check]
    signs = np.sign((P * R).sum(0))
    scale = np.abs(ref["obsm"]["X_pca"][:, :n_check]).max()
    assert got["obsm"]["X_pca"].dtype == np.float32
    np.testing.assert_allclose(got["obsm"]["X_pca"][:, :n_check] * signs[:n_check], ref["obsm"]["X_pca"][:, :n_check],
                               atol=1e-4 * scale)


def test_each_worker_sees_its_own_gpu(gpu_run):
    """On a cluster, the workers (which computed the block kinds above) each see a different GPU first."""
    from distributed import get_client

    if gpu_run[0] == "threads":
        pytest.skip("no workers: the threaded scheduler runs in this process")
    visible = get_client().run(lambda: os.environ.get("CUDA_VISIBLE_DEVICES", ""))
    firsts = [v.split(",")[0] for v in visible.values()]
    assert all(firsts) and len(set(firsts)) == len(firsts), visible


# ------------------------------------------------------------------------- stores, the CLI, presets


def test_write_brings_blocks_home_and_links_unchanged_x(raw_store, tmp_path):
    import anndata as ad

    from atlasflow.sources import source_of

    with dask.config.set(scheduler="threads"):
        a = to_backend(open_store(raw_store), "gpu")
        assert_on_gpu(block_kinds(a.X), sparse=True)
        assert source_of(a.X) == (str(raw_store), "X")  # still known as the stored X: linkable
        write_store(a, tmp_path / "same.zarr")  # X unchanged: linked, not rewritten
        src = next(p for p in sorted((raw_store / "X" / "data").rglob("*")) if p.is_file() and p.name != "zarr.json")
        dst = tmp_path / "same.zarr" / "X" / "data" / src.relative_to(raw_store / "X" / "data")
        try:
            os.link(src, tmp_path / "probe")
            can_link = True
        except OSError:
            can_link = False
        if can_link:
            assert os.stat(dst).st_ino == os.stat(src).st_ino, "X read unchanged and moved to the GPU was rewritten"
        pp.normalize_total(a, target_sum=1e4)
        assert_on_gpu(block_kinds(a.X), sparse=True)
        write_store(a, tmp_path / "norm.zarr")
        ref = open_store(raw_store)
        pp.normalize_total(ref, target_sum=1e4)
        ref_x = ref.X.compute()
    back = ad.read_zarr(tmp_path / "norm.zarr")
    assert sp.issparse(back.X)
    np.testing.assert_allclose(back.X.toarray(), ref_x.toarray(), rtol=2e-6)


def test_stage_script_runs_on_the_gpu(raw_store, tmp_path, monkeypatch):
    """``--backend gpu`` through the stage script: same numbers as ``--backend cpu``, X moved to the GPU."""
    import anndata as ad

    from atlasflow.cli import stage_main
    from atlasflow.stages import qc as qc_stage

    calls = []
    real = gpu.to_device

    def spy(x, **kw):
        y = real(x, **kw)
        calls.append(type(y._meta).__module__)
        return y

    monkeypatch.setattr(gpu, "to_device", spy)
    common = ["--input", str(raw_store), "--gene-sets", '{"mt": {"prefix": "MT-"}}']
    assert stage_main(qc_stage, argv=[*common, "--output", str(tmp_path / "gpu.zarr"), "--backend", "gpu",
                                      "--gpu-preset", "capacity"]) == 0
    assert calls and all(m.startswith("cupyx") for m in calls), (
        "the qc stage did not move X to the GPU: call atlasflow.gpu.to_backend(adata, args.backend) "
        "after open_store in the stages")
    assert stage_main(qc_stage, argv=[*common, "--output", str(tmp_path / "cpu.zarr"), "--backend", "cpu",
                                      "--n-workers", "2"]) == 0
    g, c = ad.read_zarr(tmp_path / "gpu.zarr"), ad.read_zarr(tmp_path / "cpu.zarr")
    for col in c.obs.columns:
        np.testing.assert_allclose(g.obs[col].to_numpy(float), c.obs[col].to_numpy(float), rtol=1e-6, err_msg=col)


def test_capacity_preset_allocates_managed_memory_and_performance_device_memory():
    """What each preset does to CuPy allocations on its workers (managed vs plain device memory)."""
    from distributed import Client

    def memory_type():
        import cupy as cp

        a = cp.ones(1024)
        return int(cp.cuda.runtime.pointerGetAttributes(a.data.ptr).type)

    managed, device = cupy.cuda.runtime.memoryTypeManaged, cupy.cuda.runtime.memoryTypeDevice
    cases = [("capacity", {"use_dask_cuda": False}, managed), ("performance", {"use_dask_cuda": False}, device)]
    if gpu_cluster.dask_cuda_available():
        cases += [("capacity", {}, managed)]
        cases += [("performance", {"rmm_pool_size": TEST_POOL, **({} if gpu_cluster.ucx_available() else
                                                                   {"protocol": "tcp"})}, device)]
    for preset, kw, expected in cases:
        cluster = gpu_cluster.local_cuda_cluster(preset, n_workers=1, **kw)
        try:
            with Client(cluster) as client:
                got = set(client.run(memory_type).values())
            assert got == {expected}, f"{preset} {kw}: memory type {got}, expected {expected}"
        finally:
            cluster.close()


# --------------------------------------------------------------------------------------- limits, errors


def test_chunk_over_cupys_sparse_limit_is_refused_before_reading(raw_store):
    a = open_store(raw_store)
    fake = np.array([0, 2**30, 2**31 + 10] + [2**31 + 10] * (a.n_obs - 2), dtype=np.int64)
    with pytest.raises(gpu.GpuLimitError, match=r"use chunk_rows <= 1\b"):
        gpu.to_device(a.X, indptr=fake)


def test_cuda_out_of_memory_is_one_line():
    with pytest.raises(gpu.GpuMemoryError) as err:
        with gpu.oom_guard(chunk_rows=10000, preset="performance"):
            cupy.empty(2**50, dtype=cupy.uint8)  # 1 PiB of plain device memory: refused at once
    msg = str(err.value)
    assert "\n" not in msg and "GPU out of memory" in msg and "--chunk-rows 5000" in msg and "capacity" in msg


def test_cuda_out_of_memory_on_a_worker_is_one_line():
    """The error raised in a task on a worker, re-raised on the client, still becomes one line."""
    from distributed import Client

    cluster = gpu_cluster.local_cuda_cluster("performance", n_workers=1, use_dask_cuda=False)  # no managed memory
    try:
        with Client(cluster) as client, pytest.raises(gpu.GpuMemoryError):
            with gpu.oom_guard(chunk_rows=1000):
                client.submit(lambda: __import__("cupy").empty(2**50, dtype="uint8").size, pure=False).result()
    finally:
        cluster.close()


# ------------------------------------------------------------------------------------------------- kNN


def _embedding(n=5000, d=30, seed=0):
    rng = np.random.default_rng(seed)
    centers = rng.normal(0, 4, (10, d))
    labels = np.sort(rng.integers(0, 10, n))
    return (centers[labels] + rng.normal(0, 1, (n, d))).astype(np.float32)


@pytest.mark.parametrize("metric", ["euclidean", "cosine"])
def test_knn_gpu_equals_sklearn_exact(metric):
    from sklearn.neighbors import NearestNeighbors

    x = _embedding()
    k = 31
    ind, dist = gpu.knn_gpu(x, k, metric)
    ref_dist, ref_ind = NearestNeighbors(n_neighbors=k, algorithm="brute", metric=metric).fit(x).kneighbors(x)
    assert ind.shape == dist.shape == (x.shape[0], k)
    np.testing.assert_allclose(dist, ref_dist, rtol=1e-5, atol=1e-5)
    assert (ind == ref_ind).mean() > 0.999
    np.testing.assert_array_equal(ind[:, 0], np.arange(x.shape[0]))


def test_knn_runs_on_the_gpu():
    x = cupy.asarray(_embedding(3000))
    ind, dist = gpu.knn_blocked(x, 10, "euclidean", block_bytes=2**24, probe=256)
    assert is_gpu(ind) and is_gpu(dist)
    ref_ind, _ = gpu.knn_blocked(cupy.asnumpy(x), 10, "euclidean", block_bytes=2**24, probe=256)
    assert (cupy.asnumpy(ind) == ref_ind).mean() > 0.999


def test_cuml_check_matches_import():
    """cuml_available() says True exactly where ``import cuml`` works (the GPU image may or may not have it)."""
    try:
        import cuml  # noqa: F401
    except Exception:  # noqa: BLE001 - installed but unusable counts as absent, as in gpu._importable
        importable = False
    else:
        importable = True
    assert gpu.cuml_available() is importable
