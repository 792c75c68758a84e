"""progress.compute: results as soon as they exist, a log line per 10 % of tasks, no feed left on the scheduler."""

from __future__ import annotations

import logging

import dask.array as da
import numpy as np
import pytest

from atlasflow import progress


def _feeds(dask_scheduler):
    """Progress plugins a scheduler still runs (one per progress feed not yet closed)."""
    return sum(type(p).__name__ == "Progress" for p in dask_scheduler.plugins.values())


def test_compute_logs_progress_and_leaves_no_feed(client, caplog):
    x = da.arange(10_000, chunks=500)
    before = client.run_on_scheduler(_feeds)
    with caplog.at_level(logging.INFO, logger="atlasflow.progress"):
        for i in range(20):  # short computations: the results can be in before the feed is set up
            (total,) = progress.compute((x + i).sum(), label=f"sum {i}")
            assert total == np.arange(10_000).sum() + 10_000 * i
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("sum 0:")]
    assert lines and lines[-1].startswith("sum 0: 100%"), lines
    assert all(any(r.getMessage().startswith(f"sum {i}: 100%") for r in caplog.records) for i in range(20))
    import time

    time.sleep(1.5)  # closed feeds leave at the scheduler's next report
    assert client.run_on_scheduler(_feeds) == before


def test_compute_raises_the_task_error_without_a_100_percent_line(client, caplog):
    def boom(block):
        raise ValueError("bad block")

    x = da.ones(100, chunks=10).map_blocks(boom, dtype=float)
    with caplog.at_level(logging.INFO, logger="atlasflow.progress"), pytest.raises(ValueError, match="bad block"):
        progress.compute(x.sum(), label="failing")
    assert not any("failing: 100%" in r.getMessage() for r in caplog.records)


def test_compute_joins_array_blocks_on_the_client(client):
    """A NumPy-backed array of several blocks comes back whole and equal to dask.compute's, gathered block by
    block: no task on a worker joins it (it would hold the whole result and its parts: X_pca at 2M cells
    killed 1.5 GB workers); other collections and one-block arrays come back as before."""
    from dask.core import flatten

    x = da.random.default_rng(0).random((1_000, 7), chunks=(90, 4))
    gathered = []
    orig = client.gather
    client.gather = lambda futures, **kw: (gathered.append(futures), orig(futures, **kw))[1]
    try:
        got, total, one, col = progress.compute(x * 2, x.sum(), da.ones(5, chunks=5), x[:, 0], label="join")
    finally:
        del client.gather
    want = da.compute(x * 2, x.sum(), da.ones(5, chunks=5), x[:, 0], scheduler="sync")
    np.testing.assert_array_equal(got, want[0])
    assert total == want[1] and np.array_equal(one, want[2]) and np.array_equal(col, want[3])
    assert got.shape == (1_000, 7) and col.shape == (1_000,)
    assert [len(list(flatten(f))) if isinstance(f, list) else 1 for f in gathered] == [24, 1, 1, 12]  # blocks, whole, whole, blocks


def test_compute_reads_shared_blocks_once_when_it_splits(client, tmp_path):
    """Blocks an array to split and another collection share are computed once (the collections are persisted
    together before the split), and the results come back in the order asked."""
    log = tmp_path / "calls"

    def source(block, block_info=None):
        with open(log, "a") as fh:
            fh.write(f"{block_info[0]['chunk-location']}\n")
        return block

    x = da.arange(400, chunks=50).reshape(100, 4).rechunk((25, 4)).map_blocks(source, dtype=np.int64)
    total, doubled, col = progress.compute(x.sum(), x * 2, x[:, 1], label="shared")
    assert total == np.arange(400).sum()
    np.testing.assert_array_equal(doubled, np.arange(400).reshape(100, 4) * 2)
    np.testing.assert_array_equal(col, np.arange(400).reshape(100, 4)[:, 1])
    calls = log.read_text().splitlines()
    assert len(calls) == 4 and len(set(calls)) == 4, calls


def test_wait_for_idle_workers_waits_for_a_running_task(client, tmp_path):
    """A task already running when its computation failed cannot be stopped: the wait lasts until it is done
    (atomic_dir waits so before it removes a failed stage's temporary output)."""
    import time

    done = tmp_path / "done"

    def slow():
        time.sleep(1.5)
        done.write_text("x")

    future = client.submit(slow, pure=False)
    deadline = time.monotonic() + 10
    while not any(client.processing().values()) and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)  # on the worker's thread by now
    progress.wait_for_idle_workers(timeout=20)
    assert done.exists()
    del future


def test_a_kept_matrix_is_released_without_cancelling_a_rerun(client, tmp_path):
    """A matrix kept in the workers' memory between passes (``cache.kept``) is released on exit, and nothing
    else goes with it. Keys are tokens of the inputs, so a computation repeated on the same store (pca run
    twice in one process) asks for the same keys again. With ``client.cancel`` the release cancelled the
    tasks that depend on the matrix too, and a rerun's results came back cancelled while a future of the
    first run was still alive (dask/distributed#8215; CI once: FutureCancelledError in pca's projection)."""
    import anndata as ad

    from _oocore import store_of
    from atlasflow import cache
    from atlasflow.store import open_store

    x = np.random.default_rng(0).random((200, 30)).astype(np.float32)
    path = store_of(ad.AnnData(x), tmp_path / "small.zarr", 50, dense=True)
    alive = []  # futures of the first run, as a traceback or a reference cycle may hold them
    for _ in range(3):
        X = open_store(path).X
        with cache.kept(X, label="test") as held:
            assert held is not X, "the 24 kB test matrix is kept in memory"
            (doubled,) = progress.compute(held * 2, label="doubled")
            alive = alive or [client.persist(held * 2)]
        np.testing.assert_array_equal(doubled, x * 2)
    from distributed import wait

    wait(alive[0])  # still computed and wanted: the releases took nothing from it
    np.testing.assert_array_equal(alive[0].compute(), x * 2)
