"""Stages attached to a shared Dask cluster started as separate processes; dead schedulers fail fast."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import anndata as ad
import numpy as np
import pytest

from atlasflow import shared_cluster
from atlasflow.cli import stage_main
from atlasflow.stages import log1p as log1p_stage
from atlasflow.stages import qc as qc_stage

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def external_cluster(tmp_path):
    """``dask scheduler`` + two ``dask worker`` processes, exactly as a user would start them by hand."""
    sfile = tmp_path / "scheduler.json"
    procs = [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--scheduler-file",
                               str(sfile), "--port", "0", "--dashboard-address", ":0"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    deadline = time.time() + 30
    while not sfile.exists() and time.time() < deadline:
        time.sleep(0.1)
    for i in range(2):
        procs.append(subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", "--scheduler-file",
                                       str(sfile), "--nthreads", "1", "--name", f"ext-{i}"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    from distributed import Client

    with Client(scheduler_file=str(sfile), timeout="30s") as c:
        c.wait_for_workers(2, timeout=60)
        workers = sorted(c.scheduler_info()["workers"])
    yield sfile, workers
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(timeout=30)


def test_stage_runs_on_the_shared_workers(external_cluster, pbmc3k_raw_store, tmp_path):
    sfile, workers = external_cluster
    shared = tmp_path / "shared_qc.zarr"
    local = tmp_path / "local_qc.zarr"
    assert stage_main(qc_stage, argv=["--input", str(pbmc3k_raw_store), "--output", str(shared),
                                      "--scheduler-file", str(sfile), "--chunk-rows", "500"]) == 0
    summary = json.loads(shared.with_suffix(".json").read_text())
    assert summary["ran_on"]["workers"] == workers
    assert stage_main(qc_stage, argv=["--input", str(pbmc3k_raw_store), "--output", str(local),
                                      "--n-workers", "1", "--chunk-rows", "700"]) == 0
    a, b = ad.read_zarr(shared), ad.read_zarr(local)
    for col in a.obs:
        np.testing.assert_array_equal(a.obs[col].to_numpy(), b.obs[col].to_numpy(), err_msg=col)


def test_processing_tasks_ran_on_those_workers(external_cluster, pbmc3k_raw_store, tmp_path):
    """The shared workers, not the client, executed the stage's tasks (their task logs grew).

    log1p rewrites only the stored values: a few small tasks, which the scheduler may give to one worker.
    """
    sfile, workers = external_cluster
    from distributed import Client

    def task_log_sizes():
        with Client(scheduler_file=str(sfile)) as c:
            return c.run(lambda dask_worker: len(dask_worker.state.log))

    before = task_log_sizes()
    out = tmp_path / "l.zarr"
    assert stage_main(log1p_stage, argv=["--input", str(pbmc3k_raw_store), "--output", str(out),
                                         "--scheduler-file", str(sfile)]) == 0
    after = task_log_sizes()
    assert set(after) == set(before) and sum(after.values()) > sum(before.values())


def test_dead_scheduler_fails_fast(tmp_path, pbmc3k_raw_store, capsys, monkeypatch):
    sfile = tmp_path / "dead.json"
    sfile.write_text(json.dumps({"type": "Scheduler", "address": "tcp://127.0.0.1:9", "id": "x", "workers": {}}))
    monkeypatch.setattr("atlasflow.cluster.CONNECT_TIMEOUT", "3s")
    t0 = time.time()
    rc = stage_main(qc_stage, argv=["--input", str(pbmc3k_raw_store), "--output", str(tmp_path / "o.zarr"),
                                    "--scheduler-file", str(sfile)])
    elapsed = time.time() - t0
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 1 and elapsed < 20
    assert "cannot reach the Dask scheduler file" in err
    assert not (tmp_path / "o.zarr").exists()


def test_missing_scheduler_file(tmp_path, pbmc3k_raw_store, capsys):
    rc = stage_main(qc_stage, argv=["--input", str(pbmc3k_raw_store), "--output", str(tmp_path / "o.zarr"),
                                    "--scheduler-file", str(tmp_path / "nope.json")])
    assert rc == 1
    assert "does not exist" in capsys.readouterr().err


def test_shared_cluster_start_stop(tmp_path):
    sfile = tmp_path / "run" / "scheduler.json"
    pids = shared_cluster.start(sfile, n_workers=1)
    assert sfile.exists() and len(pids["workers"]) == 1
    shared_cluster.stop(sfile)
    assert not sfile.exists()
    import psutil

    deadline = time.time() + 10
    alive = [pids["scheduler"], *pids["workers"]]
    while alive and time.time() < deadline:
        alive = [p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.2)
    assert alive == []


def test_workers_get_one_blas_thread_whatever_the_job_exports(monkeypatch, tmp_path):
    """Snakemake exports OPENBLAS_NUM_THREADS=<threads> to a job; the workers atlasflow starts ignore it."""
    from atlasflow.cluster import connect

    def _blas_threads() -> list[int]:  # local: pickled by value for the workers
        import threadpoolctl

        return [lib["num_threads"] for lib in threadpoolctl.threadpool_info() if lib["user_api"] == "blas"]

    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.setenv(var, "2")
    with connect(n_workers=1, memory_limit="1GB") as client:
        per_worker = client.run(_blas_threads)
    assert per_worker and all(threads and set(threads) == {1} for threads in per_worker.values()), per_worker
    sfile = tmp_path / "scheduler.json"
    shared_cluster.start(sfile, n_workers=1, memory_limit="1GB")
    try:
        from distributed import Client

        with Client(scheduler_file=str(sfile)) as client:
            per_worker = client.run(_blas_threads)
    finally:
        shared_cluster.stop(sfile)
    assert per_worker and all(threads and set(threads) == {1} for threads in per_worker.values()), per_worker
