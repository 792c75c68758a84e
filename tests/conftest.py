"""Shared fixtures: paths, a small Dask cluster, the pbmc3k raw store, scanpy's reference pipeline."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
PBMC3K = SHARED / "data" / "pbmc3k"


# The longest files, longest first (minutes each on 2 cores). pytest-xdist (`-n 2 --dist loadfile
# --no-loadscope-reorder`, pyproject.toml) hands whole files to its workers in collection order: started first,
# they run beside the many short files instead of leaving one worker alone with a long file at the end.
LONGEST_FIRST = ("test_kill.py", "test_workflow.py", "test_slurm.py", "test_readme.py", "test_bench.py")


def pytest_collection_modifyitems(config, items):
    """The longest files first (LONGEST_FIRST); then skip ``gpu`` tests when CuPy sees no device (with the
    reason), never run them on the CPU."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its order
    try:
        import cupy

        has_gpu = cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="no CUDA device visible to CuPy")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker, not the tests/gpu package's name
            item.add_marker(skip)


@pytest.fixture(scope="session")
def pbmc3k_dir() -> Path:
    """The real 10x pbmc3k folder in ../shared (tests needing it skip in a fresh clone without it)."""
    mtx = PBMC3K / "filtered_feature_bc_matrix"
    if not mtx.exists():
        pytest.skip(f"{mtx} not found: ../shared/data is only beside the project in CI and dev machines")
    return mtx


@pytest.fixture(scope="session")
def client():
    """A real two-worker distributed cluster (processes, one thread each), shared by the session."""
    from distributed import Client, LocalCluster

    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                           memory_limit="4GB")
    c = Client(cluster)
    yield c
    c.close()
    cluster.close()


@pytest.fixture(scope="session")
def pbmc3k_raw_store(pbmc3k_dir, tmp_path_factory) -> Path:
    """pbmc3k raw counts as an atlasflow store (scanpy reads the mtx, atlasflow writes the store)."""
    import anndata as ad
    import dask.array as da
    import scanpy as sc
    import scipy.sparse as sp

    from atlasflow.store import write_store

    a = sc.read_10x_mtx(pbmc3k_dir)
    a.var["gene_symbols"] = a.var_names.to_numpy()
    out = tmp_path_factory.mktemp("pbmc3k") / "raw.zarr"
    x = da.from_array(sp.csr_matrix(a.X), chunks=(1000, a.n_vars), asarray=False)
    write_store(ad.AnnData(X=x, obs=a.obs, var=a.var), out)
    return out


@pytest.fixture(scope="session")
def scanpy_pbmc3k(pbmc3k_dir):
    """scanpy's tutorial QC on pbmc3k: dict of AnnData snapshots (qc, filtered, normalized, log1p)."""
    import scanpy as sc

    a = sc.read_10x_mtx(pbmc3k_dir)
    a.var["mt"] = a.var_names.str.startswith("MT-")
    sc.pp.calculate_qc_metrics(a, qc_vars=["mt"], inplace=True)
    snaps = {"qc": a.copy()}
    a = a[(a.obs.n_genes_by_counts >= 200) & (a.obs.n_genes_by_counts <= 2500) & (a.obs.pct_counts_mt < 5)].copy()
    a.X = a.X.tocsr()
    snaps["filtered"] = a.copy()
    sc.pp.normalize_total(a, target_sum=1e4)
    snaps["normalized"] = a.copy()
    sc.pp.log1p(a)
    snaps["log1p"] = a.copy()
    return snaps


def assert_sparse_equal(a, b, rtol=0.0, atol=0.0):
    """Two sparse/dense matrices hold the same values (within tolerances)."""
    import scipy.sparse as sp

    a = a.toarray() if sp.issparse(a) else np.asarray(a)
    b = b.toarray() if sp.issparse(b) else np.asarray(b)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
