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
