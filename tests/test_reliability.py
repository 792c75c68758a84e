"""Faults a long run meets: damaged input stores, missing keys, full or read-only disks, dead workers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time

import anndata as ad
import numpy as np
import pytest

from atlasflow.cli import stage_main
from atlasflow.stages import filter as filter_stage
from atlasflow.stages import log1p as log1p_stage
from atlasflow.stages import normalize as normalize_stage
from atlasflow.stages import qc as qc_stage


def _last_err(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.fixture
def store_copy(pbmc3k_raw_store, tmp_path):
    """A private copy of the raw store to damage."""
    dst = tmp_path / "in.zarr"
    shutil.copytree(pbmc3k_raw_store, dst)
    return dst


def test_missing_chunk_names_store_and_stage(store_copy, tmp_path, capsys):
    chunk = sorted((store_copy / "X" / "data" / "c").iterdir())[0]
    chunk.unlink()
    rc = stage_main(qc_stage, argv=["--input", str(store_copy), "--output", str(tmp_path / "o.zarr"),
                                    "--n-workers", "1"])
    err = _last_err(capsys)
    assert rc == 1
    assert str(store_copy) in err and "X/data" in err and "re-run" in err
    assert not (tmp_path / "o.zarr").exists()


def test_truncated_chunk_is_an_error_not_zeros(store_copy, tmp_path, capsys):
    chunk = sorted((store_copy / "X" / "indices" / "c").iterdir())[0]
    chunk.write_bytes(chunk.read_bytes()[:100])
    rc = stage_main(qc_stage, argv=["--input", str(store_copy), "--output", str(tmp_path / "o.zarr"),
                                    "--n-workers", "1"])
    err = _last_err(capsys)
    assert rc == 1
    assert "damaged" in err or "truncated" in err
    assert not (tmp_path / "o.zarr").exists()


def test_store_from_another_tool_lacking_qc_columns(pbmc3k_raw_store, tmp_path, capsys):
    rc = stage_main(filter_stage, argv=["--input", str(pbmc3k_raw_store), "--output", str(tmp_path / "o.zarr"),
                                        "--min-genes", "200", "--max-pct-mt", "5", "--min-cells", "3"])
    err = _last_err(capsys)
    assert rc == 1
    for key in ("obs['n_genes_by_counts']", "obs['pct_counts_mt']", "var['n_cells_by_counts']", "filter stage"):
        assert key in err


def test_not_a_store(tmp_path, capsys):
    (tmp_path / "junk.zarr").mkdir()
    rc = stage_main(qc_stage, argv=["--input", str(tmp_path / "junk.zarr"), "--output", str(tmp_path / "o.zarr")])
    assert rc == 1 and "junk.zarr" in _last_err(capsys)


@pytest.fixture
def tiny_fs(tmp_path):
    """A 3 MiB tmpfs: small enough to fill, and remountable read-only (needs root, as in CI)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_leaves_nothing_that_looks_complete(pbmc3k_raw_store, tiny_fs, capsys):
    out = tiny_fs / "results" / "log1p.zarr"
    rc = stage_main(log1p_stage, argv=["--input", str(pbmc3k_raw_store), "--output", str(out), "--n-workers", "1"])
    err = _last_err(capsys)
    assert rc == 1
    assert "No space left on device" in err
    assert not out.exists()
    assert list(out.parent.iterdir()) == []  # the temporary sibling is gone too


def test_read_only_output_folder(pbmc3k_raw_store, tiny_fs, capsys):
    (tiny_fs / "results").mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_fs)], check=True)
    out = tiny_fs / "results" / "log1p.zarr"
    rc = stage_main(log1p_stage, argv=["--input", str(pbmc3k_raw_store), "--output", str(out), "--n-workers", "1"])
    err = _last_err(capsys)
    assert rc == 1
    assert "Read-only file system" in err and str(out) in err
    assert not out.exists()


@pytest.mark.slow
def test_dead_worker_mid_stage_gives_the_same_result(pbmc3k_raw_store, tmp_path):
    """SIGKILL one of two workers while normalize runs: tasks are rescheduled and the output is exact."""
    sfile = tmp_path / "s.json"
    procs = [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--scheduler-file",
                               str(sfile), "--port", "0", "--dashboard-address", ":0"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    while not sfile.exists():
        time.sleep(0.1)
    workers = [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", "--scheduler-file",
                                 str(sfile), "--nthreads", "1", "--no-nanny"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(2)]
    procs += workers
    from distributed import Client

    try:
        with Client(scheduler_file=str(sfile), timeout="30s") as c:
            c.wait_for_workers(2, timeout=60)
            victim = workers[0]
            import os

            pids = c.run(os.getpid)
            victim_addr = next(a for a, pid in pids.items() if pid == victim.pid)

            def kill_when_busy():
                deadline = time.time() + 60
                while time.time() < deadline:
                    if c.run(lambda dask_worker: len(dask_worker.state.log), workers=[victim_addr]).get(
                            victim_addr, 0) > 20:
                        victim.kill()
                        return
                    time.sleep(0.05)

            killer = threading.Thread(target=kill_when_busy)
            killer.start()
            out = tmp_path / "n.zarr"
            rc = stage_main(normalize_stage, argv=["--input", str(pbmc3k_raw_store), "--output", str(out),
                                                   "--target-sum", "1e4", "--chunk-rows", "25",
                                                   "--scheduler-file", str(sfile)])
            killer.join()
        assert victim.poll() is not None, "the victim worker was not killed during the stage"
        assert rc == 0
        summary = json.loads(out.with_suffix(".json").read_text())
        assert len(summary["ran_on"]["workers"]) == 1
        ref = tmp_path / "ref.zarr"
        assert stage_main(normalize_stage, argv=["--input", str(pbmc3k_raw_store), "--output", str(ref),
                                                 "--target-sum", "1e4", "--n-workers", "1"]) == 0
        a, b = ad.read_zarr(out), ad.read_zarr(ref)
        assert (a.X != b.X).nnz == 0
        np.testing.assert_array_equal(a.obs_names, b.obs_names)
    finally:
        for p in procs:
            p.kill()


def test_output_folder_that_cannot_be_created(tmp_path):
    """An output below a file: the filesystem's own error, nothing written (not an error of the cleanup)."""
    from atlasflow.store import atomic_dir

    blocker = tmp_path / "not_a_folder"
    blocker.write_text("x")
    with pytest.raises(FileExistsError), atomic_dir(blocker / "out.zarr"):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["not_a_folder"]


def test_disk_full_while_a_matrix_is_stashed_says_so(pbmc3k_raw_store, tiny_fs, tmp_path, capfd):
    """subset computes its blocks into a scratch folder first (numpy's tofile reports a short write without
    an errno): still "No space left on device" in one line, nothing left behind."""
    import anndata as ad
    import pandas as pd

    from atlasflow.stages import subset as subset_stage
    from atlasflow.store import open_store, write_store

    hvg = tmp_path / "hvg.zarr"
    adata = open_store(pbmc3k_raw_store)
    adata.var = pd.DataFrame({"highly_variable": np.arange(adata.n_vars) % 2 == 0}, index=adata.var_names)
    write_store(ad.AnnData(X=adata.X, obs=adata.obs, var=adata.var), hvg, provenance={"stage": "hvg"})
    out = tiny_fs / "results" / "subset.zarr"
    capfd.readouterr()
    rc = stage_main(subset_stage, argv=["--input", str(hvg), "--output", str(out), "--n-workers", "1"])
    err = capfd.readouterr().err.strip().splitlines()  # the workers' stderr too (a file descriptor they share)
    assert rc == 1
    assert "No space left on device" in err[-1] and str(out) in err[-1]
    assert not any("Traceback" in line or "Compute Failed" in line for line in err), "\n".join(err)
    assert not out.exists() and list(out.parent.iterdir()) == []
