"""Visible progress for passes over X: a log line at every 10 % of a Dask computation's tasks."""

from __future__ import annotations

import logging
import threading
import time
from contextlib import suppress

import dask
import numpy as np

from atlasflow import passes

log = logging.getLogger("atlasflow.progress")

#: how often the scheduler reports progress (it does not delay the result: see ``compute``)
INTERVAL = "500ms"
#: longest wait, after the results, for the scheduler to have set the progress feed up (seconds)
FEED_SETUP_TIMEOUT = 10


def client_or_none():
    # an explicitly chosen local scheduler (dask.config.set(scheduler="sync"), ...) wins over a default client
    if dask.config.get("scheduler", None) not in (None, "dask.distributed", "distributed"):
        return None
    try:
        from distributed import get_client

        return get_client()
    except (ImportError, ValueError):
        return None


def compute(*collections, label: str = "computing", count_passes: bool = True):
    """``dask.compute`` that logs percent complete when a distributed client is active.

    The results are gathered as soon as they exist. The progress feed runs beside them on the client's event
    loop: waiting for it (what distributed's progress bars do) would add up to one report interval to every
    computation, ~0.5 s per pass over X.

    The passes over stored matrices it takes are counted (``passes``) unless the caller counted them already.
    """
    if count_passes:
        passes.count(*collections)
    client = client_or_none()
    if client is None:
        return dask.compute(*collections)
    from distributed import futures_of

    persisted = client.persist(list(collections))  # one graph: tasks the collections share run once
    futures = futures_of(persisted)
    bar = _log_bar()(futures, scheduler=client.scheduler.address, interval=INTERVAL, label=label)
    client.loop.add_callback(bar.listen)
    ok = False
    try:
        results = tuple(_gathered(client, coll) for coll in persisted)
        ok = True
    except BaseException:
        release(futures)  # the traceback keeps them alive: no more of this computation's tasks may start
        raise
    finally:
        bar.finish(client, logged=ok)
    release(futures)  # the results are here: the workers free them now, not when the garbage collector says
    return results


def release(futures) -> None:
    """Drop this client's claim on ``futures``: the scheduler frees their results and forgets their tasks that
    have not started, unless another future still wants them.

    Not ``client.cancel``, which also cancels every task that depends on them and marks cancelled the state
    that a later future of the same key shares. Keys are tokens of the inputs, so a computation repeated in the
    same process (pca run twice on one store) asks for the same keys again, and it failed with
    FutureCancelledError while an earlier future of them was still alive (dask/distributed#8215). A release
    travels on the same ordered stream as the next graph.
    """
    for future in futures:
        future.release()


def wait_for_idle_workers(timeout: float = 30.0) -> None:
    """Wait until no worker of the active client runs a task (at most ``timeout`` seconds).

    A failed computation's tasks are cancelled, but one already running on a worker cannot be stopped: a
    stage that removes its temporary output after a failure waits for them first, or a late block write
    recreates the folder it just removed.
    """
    client = client_or_none()
    if client is None:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            busy = client.run(lambda dask_worker: dask_worker.state.executing_count, on_error="return")
        except Exception:  # noqa: BLE001 - a cluster that is going down runs nothing more either
            return
        if not any(isinstance(n, int) and n > 0 for n in busy.values()):
            return
        time.sleep(0.1)


def _gathered(client, coll):
    """The result of a persisted collection. A NumPy-backed array of several blocks is gathered block by block
    and joined here, on the client that receives it anyway: Dask would join it in one task on a worker, which
    then holds the whole result and all its parts at once (X_pca of 2M cells is 800 MB in float64: that task
    killed 1.5 GB workers four times)."""
    import dask.array as da
    from dask.array.core import concatenate3
    from distributed import futures_of

    if not (isinstance(coll, da.Array) and coll.npartitions > 1 and type(coll._meta) is np.ndarray):
        return client.gather(client.compute(coll))
    by_key = {f.key: f for f in futures_of(coll)}

    def futures(keys):  # the block futures, nested as the array's keys (client.gather keeps the nesting)
        return [futures(k) for k in keys] if isinstance(keys, list) else by_key[keys]

    return concatenate3(client.gather(futures(coll.__dask_keys__())))


def _log_bar():
    """A distributed ``ProgressBar`` that logs every 10 %, and stops logging (and listening) once finished."""
    from distributed.diagnostics.progressbar import ProgressBar

    class LogBar(ProgressBar):
        def __init__(self, keys, *, label: str, **kwargs):
            super().__init__(keys, **kwargs)
            self.label, self.last, self.n_tasks, self.finished = label, -1, None, False
            self.fed = threading.Event()

        def _draw_bar(self, remaining, all, **kwargs):
            self.n_tasks = all
            self.fed.set()
            if self.finished:
                return
            pct = int(100 * (1 - remaining / all)) if all else 100
            if pct // 10 > self.last:
                self.last = pct // 10
                log.info("%s: %d%% of %d tasks (%.1f s)", self.label, pct, all, self.elapsed)

        def finish(self, client, logged: bool):
            """Close the feed once the computation is over (logging its 100 % line if ``logged`` and the feed
            has not).

            The caller still holds the futures: the scheduler sets a feed up only for keys it knows, so closing
            it waits (briefly) until the set-up is done, or the feed would wait forever for released keys.
            """
            self.fed.wait(timeout=FEED_SETUP_TIMEOUT)
            if logged and self.last < 10:
                tasks = f" of {self.n_tasks} tasks" if self.n_tasks else ""
                log.info("%s: 100%%%s (%.1f s)", self.label, tasks, self.elapsed)
            self.finished = True
            client.loop.add_callback(self.close)

        def close(self):
            with suppress(AttributeError):
                self.comm.abort()

    return LogBar
