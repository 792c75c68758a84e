"""The GPU backend's logic that needs no device: presets, devices, chunk limits, errors, backend choice, kNN.

Runs in CPU CI without CuPy; the device checks themselves are in tests/gpu (skipped without a GPU).
"""

from __future__ import annotations

import os
import subprocess
import sys
import types

import numpy as np
import pytest
import scipy.sparse as sp

from atlasflow import gpu, gpu_cluster
from atlasflow.gpu import validate_backend
from atlasflow.errors import AtlasflowError, ConfigError


@pytest.fixture
def no_cupy(monkeypatch):
    """Make ``import cupy`` fail, as on a machine without CuPy."""
    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_importing_the_gpu_modules_does_not_import_cupy():
    code = ("import sys, atlasflow.gpu, atlasflow.gpu_cluster, atlasflow.backend, atlasflow.cli, atlasflow.cluster; "
            "assert not any(m.split('.')[0] in ('cupy', 'cupyx', 'dask_cuda', 'rmm') for m in sys.modules), "
            "[m for m in sys.modules if m.startswith(('cupy', 'dask_cuda', 'rmm'))]")
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------------------------- presets


def test_presets_follow_the_out_of_core_guide():
    perf = gpu_cluster.preset_options("performance")
    assert perf == {"protocol": "ucx", "rmm_pool_size": "80%", "rmm_managed_memory": False,
                    "rmm_allocator_external_lib": "cupy", "threads_per_worker": 1}
    cap = gpu_cluster.preset_options("capacity")
    assert cap["protocol"] == "tcp" and cap["rmm_managed_memory"] is True and cap["rmm_pool_size"] is None
    assert cap["threads_per_worker"] == 1 and cap["rmm_allocator_external_lib"] == "cupy"
    assert gpu_cluster.preset_options("performance", protocol="tcp", threads_per_worker=None)["protocol"] == "tcp"


@pytest.mark.parametrize("preset, kw, words", [
    ("capacity", {"protocol": "ucx"}, "UCX cannot be combined with RMM managed memory"),
    ("performance", {"rmm_managed_memory": True}, "UCX cannot be combined"),
    ("fastest", {}, "not one of performance, capacity"),
    ("capacity", {"protocol": "ib"}, "protocol 'ib'"),
    ("capacity", {"rmm_pool": "1GB"}, "unknown option"),
    ("capacity", {"threads_per_worker": 0}, "threads_per_worker"),
])
def test_bad_preset_options_are_config_errors(preset, kw, words):
    with pytest.raises(ConfigError, match=words):
        gpu_cluster.preset_options(preset, **kw)


def test_dask_cuda_kwargs_follow_the_installed_parameter_names():
    opts = gpu_cluster.preset_options("performance")
    new = gpu_cluster.dask_cuda_kwargs(opts, {"rmm_allocator_external_lib_list": None})
    assert new == {"protocol": "ucx", "rmm_managed_memory": False, "threads_per_worker": 1,
                   "rmm_pool_size": 0.8, "rmm_allocator_external_lib_list": ["cupy"]}
    old = gpu_cluster.dask_cuda_kwargs(opts, {"rmm_allocator_external_lib": None})
    assert old["rmm_allocator_external_lib"] == "cupy" and "rmm_allocator_external_lib_list" not in old
    cap = gpu_cluster.dask_cuda_kwargs(gpu_cluster.preset_options("capacity"), {})
    assert "rmm_pool_size" not in cap and cap["rmm_managed_memory"] is True
    assert not any(k.startswith("rmm_allocator") for k in cap)


@pytest.mark.parametrize("devices, expected", [("0,2", ["0", "2"]), ([1, 3], ["1", "3"]), (2, ["2"]),
                                               ("GPU-abc", ["GPU-abc"])])
def test_devices_from_argument(devices, expected):
    assert gpu_cluster.parse_devices(devices) == expected


def test_devices_from_environment(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert gpu_cluster.parse_devices() == ["3", "1"]


def test_no_device_is_a_config_error(no_cupy):
    with pytest.raises(ConfigError, match="no CUDA device visible"):
        gpu_cluster.parse_devices()
    with pytest.raises(ConfigError, match="no CUDA device visible"):
        gpu_cluster.local_cuda_cluster("capacity")


def test_ucx_without_ucx_installed_says_what_to_do():
    if gpu_cluster.ucx_available():
        pytest.skip("UCX is installed here")
    with pytest.raises(ConfigError, match="use --gpu-preset capacity"):
        gpu_cluster.local_cuda_cluster("performance", devices="0", use_dask_cuda=True)


def test_fallback_workers_see_their_own_gpu_first():
    specs = gpu_cluster.fallback_worker_specs(["0", "1", "2"], threads_per_worker=1, memory_limit=10**9, managed=True)
    envs = {name: s["options"]["env"] for name, s in specs.items()}
    assert envs["gpu-0"]["CUDA_VISIBLE_DEVICES"] == "0,1,2"
    assert envs["gpu-1"]["CUDA_VISIBLE_DEVICES"] == "1,2,0"
    assert envs["gpu-2"]["CUDA_VISIBLE_DEVICES"] == "2,0,1"
    assert all(e[gpu_cluster.MANAGED_ENV] == "1" for e in envs.values())
    assert all(s["options"]["nthreads"] == 1 and s["options"]["preload"] == ["atlasflow.gpu_cluster"]
               for s in specs.values())
    plain = gpu_cluster.fallback_worker_specs(["0"], managed=False)
    assert gpu_cluster.MANAGED_ENV not in plain["gpu-0"]["options"]["env"]


def test_fallback_cluster_starts_one_worker_per_device(caplog):
    """The no-dask-cuda cluster itself (its workers start without a GPU; nothing runs CUDA)."""
    from distributed import Client

    with caplog.at_level("WARNING", logger="atlasflow.gpu_cluster"):
        cluster = gpu_cluster.local_cuda_cluster("performance", n_workers=5, devices="0,1", use_dask_cuda=False,
                                                 memory_limit="1GB")
    try:
        assert len(cluster.workers) == 2
        assert any("dask-cuda is not installed" in r.getMessage() for r in caplog.records)
        with Client(cluster) as client:
            client.wait_for_workers(2, timeout=60)
            seen = sorted(client.run(lambda: os.environ.get("CUDA_VISIBLE_DEVICES")).values())
            assert seen == ["0,1", "1,0"]
            assert set(client.nthreads().values()) == {1}
    finally:
        cluster.close()


# ---------------------------------------------------------------------------------------------- limits


def test_block_nnz_and_largest_fitting_chunk():
    row_nnz = np.array([5, 0, 7, 3, 9, 1, 0, 4], dtype=np.int64)
    indptr = np.concatenate([[0], np.cumsum(row_nnz)])
    np.testing.assert_array_equal(gpu.block_nnz(indptr, (3, 3, 2)), [12, 13, 4])
    r = gpu.max_chunk_rows(indptr, limit=12)
    starts = np.arange(0, 8, r)
    assert (indptr[np.minimum(starts + r, 8)] - indptr[starts]).max() <= 12
    assert r == 2  # chunks of 3 hold 12, 13, ...: too many
    assert gpu.max_chunk_rows(indptr, limit=10**6) == 8


def test_too_large_chunk_is_refused_with_the_chunk_rows_that_fit():
    rng = np.random.default_rng(0)
    indptr = np.concatenate([[0], np.cumsum(rng.integers(0, 1000, 10_000))])
    limit = 200_000
    with pytest.raises(gpu.GpuLimitError) as err:
        gpu.check_block_nnz(indptr, (5000, 5000), limit=limit)
    message = str(err.value)
    assert "\n" not in message and "row block 0" in message and "chunk_rows <=" in message
    fit = int(message.rsplit("--chunk-rows ", 1)[1].rstrip(")"))
    chunks = [fit] * (10_000 // fit) + ([10_000 % fit] if 10_000 % fit else [])
    gpu.check_block_nnz(indptr, tuple(chunks), limit=limit)  # the advice works
    assert isinstance(err.value, ConfigError)


def test_real_limit_is_cupys():
    assert gpu.NNZ_LIMIT == 2**31 - 1
    indptr = np.array([0, 2**30, 2**31 + 5], dtype=np.int64)
    with pytest.raises(gpu.GpuLimitError, match="use chunk_rows <= 1"):
        gpu.check_block_nnz(indptr, (2,))


# ----------------------------------------------------------------------------------- backend choice


def test_backend_resolution(no_cupy, monkeypatch):
    assert validate_backend("auto") == "cpu"
    assert validate_backend("gpu") == "gpu" and validate_backend("cpu") == "cpu"
    with pytest.raises(ConfigError, match="not one of auto, cpu, gpu"):
        validate_backend("tpu")
    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=lambda: 1))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    assert validate_backend("auto") == "gpu"
    fake.cuda.runtime.getDeviceCount = lambda: 0
    assert validate_backend("auto") == "cpu"


def test_to_backend_cpu_and_auto_leave_x_alone(no_cupy):
    import anndata as ad
    import dask.array as da

    from atlasflow.gpu import to_backend

    x = da.from_array(sp.random(20, 5, density=0.3, format="csr", random_state=0), chunks=(10, 5), asarray=False)
    a = ad.AnnData(X=x)
    assert to_backend(a, "cpu") is a and a.X is x
    assert to_backend(a, "auto") is a and a.X is x


def test_gpu_backend_without_cupy_says_how_to_install(no_cupy):
    import anndata as ad
    import dask.array as da

    from atlasflow.gpu import to_backend

    x = da.from_array(sp.random(20, 5, density=0.3, format="csr", random_state=0), chunks=(10, 5), asarray=False)
    with pytest.raises(gpu.GpuUnavailableError, match=r"gpu-cuda12 or gpu-cuda13 extra") as err:
        to_backend(ad.AnnData(X=x), "gpu")
    assert isinstance(err.value, AtlasflowError) and "\n" not in str(err.value)
    assert gpu.device_count() == 0


def test_row_ids_without_array_repeats():
    """The GPU branch of kernels.row_ids (searchsorted on indptr) equals NumPy's repeat, empty rows included."""
    keep = np.ones(50)
    keep[[0, 3, 17, 49]] = 0
    m = sp.csr_matrix(sp.diags(keep) @ sp.random(50, 30, density=0.1, format="csr", random_state=1))
    m.eliminate_zeros()
    assert (np.diff(m.indptr)[[0, 3, 17, 49]] == 0).all()
    expected = np.repeat(np.arange(50), np.diff(m.indptr))
    got = np.searchsorted(m.indptr[1:], np.arange(m.indptr[-1]), side="right")
    np.testing.assert_array_equal(got, expected)


# --------------------------------------------------------------------------------------- out of memory


class OutOfMemoryError(Exception):
    """Stands in for cupy.cuda.memory.OutOfMemoryError (matched by name, CuPy need not be importable)."""


def test_oom_is_recognised_through_wrappers():
    assert gpu.is_oom(OutOfMemoryError("Out of memory allocating 8,589,934,592 bytes"))
    assert gpu.is_oom(MemoryError("std::bad_alloc: out_of_memory: RMM failure at: arena.hpp"))
    try:
        try:
            raise OutOfMemoryError("x")
        except OutOfMemoryError as inner:
            raise RuntimeError("task failed") from inner
    except RuntimeError as outer:
        assert gpu.is_oom(outer)
    assert not gpu.is_oom(MemoryError("Unable to allocate 8 GiB for an array"))
    assert not gpu.is_oom(ValueError("shapes do not match"))


def test_oom_guard_gives_one_line_with_the_ways_out():
    with pytest.raises(gpu.GpuMemoryError) as err:
        with gpu.oom_guard(chunk_rows=20000, preset="performance"):
            raise OutOfMemoryError("Out of memory allocating 8,589,934,592 bytes\n(allocated so far: 1 bytes).")
    msg = str(err.value)
    assert "\n" not in msg and "GPU out of memory" in msg and "--chunk-rows 10000" in msg and "capacity" in msg
    with pytest.raises(gpu.GpuMemoryError) as err:
        with gpu.oom_guard(chunk_rows=None, preset="capacity"):
            raise OutOfMemoryError("boom")
    assert "--gpu-preset capacity" not in str(err.value) and "smaller chunk_rows" in str(err.value)
    with pytest.raises(ValueError):
        with gpu.oom_guard(chunk_rows=10):
            raise ValueError("not memory")


def test_oom_in_a_graph_stage_names_its_own_ways_out(tmp_path, monkeypatch, capsys):
    """neighbors/leiden/umap hold their arrays in one process: no chunk_rows or preset advice for them."""
    from atlasflow.cli import stage_main
    from atlasflow.stages import neighbors as stage

    def run(args, client):
        raise OutOfMemoryError("Out of memory allocating 80,000,000,000 bytes (allocated so far: 0 bytes).")

    monkeypatch.setattr(stage, "run", run)
    rc = stage_main(stage, argv=["--input", str(tmp_path / "in.zarr"), "--output", str(tmp_path / "out.zarr"),
                                 "--backend", "gpu", "--chunk-rows", "5000"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 1 and "GPU out of memory" in err and gpu.IN_MEMORY_ADVICE in err, err
    assert "chunk" not in err and "preset" not in err, err


# ------------------------------------------------------------------------------------------------- kNN


def _sklearn_knn(x, k, metric):
    from sklearn.neighbors import NearestNeighbors

    dist, ind = NearestNeighbors(n_neighbors=k, algorithm="brute", metric=metric).fit(x).kneighbors(x)
    return ind, dist


@pytest.mark.parametrize("metric", ["euclidean", "sqeuclidean", "cosine"])
@pytest.mark.parametrize("n, probe, block_bytes", [(300, None, 2**20), (3000, 64, 2**21)])
def test_blocked_knn_equals_sklearn_exact(metric, n, probe, block_bytes):
    """The kNN the GPU runs, here on NumPy: both the small (full sort) and the thresholded candidate path."""
    rng = np.random.default_rng(3)
    centers = rng.normal(0, 5, (8, 20))
    x = np.sort(rng.integers(0, 8, n))  # cells ordered by cluster, as stores often are
    x = (centers[x] + rng.normal(0, 1, (n, 20))).astype(np.float32)
    k = 16
    ind, dist = gpu.knn_blocked(x, k, metric, block_bytes=block_bytes, probe=probe)
    ref_ind, ref_dist = _sklearn_knn(x, k, metric)
    np.testing.assert_allclose(dist, ref_dist, rtol=1e-5, atol=1e-5)
    same = (ind == ref_ind).mean()
    assert same > 0.999, same
    np.testing.assert_array_equal(ind[:, 0], np.arange(n))


def test_knn_bad_arguments():
    x = np.zeros((10, 3))
    with pytest.raises(ConfigError, match="not supported on the GPU"):
        gpu.knn_blocked(x, 3, "manhattan")
    with pytest.raises(ConfigError, match="k=11"):
        gpu.knn_blocked(x, 11)


def test_cuml_check_is_false_without_cuml():
    if gpu._importable("cuml"):
        pytest.skip("cuML is installed here")
    assert gpu.cuml_available() is False
