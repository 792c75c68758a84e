"""Stages attached to a shared Dask cluster started as separate processes; dead schedulers fail fast."""

from __future__ import annotations

import json
import os
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
        import numpy  # noqa: F401  (loads BLAS as any task does: older workers have not imported it yet)
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


# ------------------------------------------------------------------------------------------ bad input, one line


def _stage_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err, "no error shown"
    return err[-1]


def test_garbage_scheduler_file_is_one_line(tmp_path, capsys):
    """A scheduler file that is not one (not JSON, or JSON without "type": "Scheduler" and "address") is one
    line naming the file, exit 1, no output (Dask itself raised a bare AssertionError)."""
    for content in ("this is not a scheduler file\n", json.dumps({"type": "Worker", "address": "tcp://x:1"})):
        sfile = tmp_path / "garbage.json"
        sfile.write_text(content)
        out = tmp_path / "o.zarr"
        t0 = time.time()
        rc = stage_main(qc_stage, argv=["--input", str(tmp_path / "in.zarr"), "--output", str(out),
                                        "--scheduler-file", str(sfile)])
        err = _stage_error(capsys)
        assert rc == 1 and time.time() - t0 < 10
        assert f"{sfile} is not a Dask scheduler file" in err, err
        assert "AssertionError" not in err and not out.exists()
        assert sfile.read_text() == content


def test_connect_timeout_that_is_not_a_duration(tmp_path):
    """ATLASFLOW_CONNECT_TIMEOUT=banana: one line naming the variable, exit 1 (was a KeyError)."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "qc.py"), "--input", str(tmp_path / "in.zarr"),
                           "--output", str(tmp_path / "o.zarr"), "--address", "tcp://127.0.0.1:9"],
                          env={**os.environ, "ATLASFLOW_CONNECT_TIMEOUT": "banana"}, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120)
    err = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stderr
    assert "ATLASFLOW_CONNECT_TIMEOUT='banana' is not a duration" in err, proc.stderr
    assert "KeyError" not in proc.stderr and not (tmp_path / "o.zarr").exists()


def test_bad_memory_limit_fails_before_starting(tmp_path, capsys):
    """--memory-limit lots: one line naming --memory-limit at once, nothing started (the shared cluster
    waited 60 s for workers that could not start, then left its scheduler running)."""
    sfile = tmp_path / "run" / "scheduler.json"
    t0 = time.time()
    rc = shared_cluster.main(["start", "--scheduler-file", str(sfile), "--n-workers", "1", "--memory-limit", "lots"])
    err = capsys.readouterr().err.strip().splitlines()
    try:
        assert rc == 1 and time.time() - t0 < 5
        assert len(err) == 1 and "--memory-limit" in err[0] and "'lots' is not a memory size" in err[0], err
        assert not sfile.exists() and not sfile.with_suffix(".pids.json").exists()
    finally:
        shared_cluster.stop(sfile, quiet=True)
    # a stage's own cluster likewise
    rc = stage_main(qc_stage, argv=["--input", str(tmp_path / "in.zarr"), "--output", str(tmp_path / "o.zarr"),
                                    "--n-workers", "1", "--memory-limit", "lots"])
    err = _stage_error(capsys)
    assert rc == 1 and "--memory-limit" in err and "'lots' is not a memory size" in err, err
    from atlasflow.cluster import check_memory_limit

    for ok in (None, "auto", "4GB", "4 GiB", "4000MB", 2_000_000_000, "0.5", 0):
        assert check_memory_limit(ok) == ok


def test_cluster_start_refuses_to_replace_a_foreign_file(tmp_path, capsys):
    """`atlasflow cluster start --scheduler-file F` over an F (or F's .pids.json record) that is not what
    Dask / atlasflow writes: one line, exit 1, the file untouched, nothing started."""
    cases = [("notes.txt", "my notes\n", None), ("sched.json", json.dumps({"type": "Worker", "address": "x"}), None),
             ("scheduler.json", None, "[1, 2, 3]\n")]
    for name, content, pids_content in cases:
        sfile = tmp_path / name
        pids = sfile.with_suffix(".pids.json")
        if content is not None:
            sfile.write_text(content)
        if pids_content is not None:
            pids.write_text(pids_content)
        t0 = time.time()
        try:
            rc = shared_cluster.main(["start", "--scheduler-file", str(sfile), "--n-workers", "1"])
        finally:
            if sfile.exists() and sfile.read_text() != content:
                shared_cluster.stop(sfile, quiet=True)  # replaced after all: stop what was started
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 1 and time.time() - t0 < 5, err
        assert len(err) == 1 and "not replaced" in err[0], err
        if content is not None:
            assert sfile.read_text() == content and "is not a Dask scheduler file" in err[0], err
            assert not pids.exists()
        else:
            assert pids.read_text() == pids_content and not sfile.exists()
            assert "is not atlasflow's record of a cluster" in err[0], err
