"""Visible progress for passes over X: a log line at every 10 % of a Dask computation's tasks."""

from __future__ import annotations

import logging

import dask

log = logging.getLogger("atlasflow.progress")


def _client_or_none():
    # an explicitly chosen local scheduler (dask.config.set(scheduler="sync"), ...) wins over a default client
    if dask.config.get("scheduler", None) not in (None, "dask.distributed", "distributed"):
        return None
    try:
        from distributed import get_client

        return get_client()
    except (ImportError, ValueError):
        return None


def compute(*collections, label: str = "computing"):
    """``dask.compute`` that logs percent complete when a distributed client is active."""
    client = _client_or_none()
    if client is None:
        return dask.compute(*collections)
    from distributed.diagnostics.progressbar import TextProgressBar

    class _LogBar(TextProgressBar):
        last = -1

        def _draw_bar(self, remaining, all, **kwargs):
            pct = int(100 * (1 - remaining / all)) if all else 100
            if pct // 10 > self.last:
                self.last = pct // 10
                log.info("%s: %d%% of %d tasks (%.1f s)", label, pct, all, self.elapsed)

        def _draw_stop(self, **kwargs):
            pass

    futures = client.compute(list(collections))
    _LogBar(futures, scheduler=client.scheduler.address, interval="500ms")
    return tuple(client.gather(futures))
