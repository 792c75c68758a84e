"""Attach to a running Dask scheduler or start a local cluster sized to the job.

Order of precedence: an explicit scheduler file or address (config ``dask.scheduler_file`` /
``dask.address``, ``--scheduler-file`` / ``--address`` on a script, or the ``ATLASFLOW_SCHEDULER_FILE``
environment variable that the workflow sets for a shared per-run cluster), else a ``LocalCluster`` with
one single-threaded worker process per core of the allocation (``SLURM_CPUS_PER_TASK`` under SLURM).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

from atlasflow.allocation import allocation_cores, allocation_memory
from atlasflow.errors import ClusterError, ConfigError

log = logging.getLogger(__name__)

#: How long to wait for an existing scheduler before failing (a dead one must not hang a stage).
#: Checked when used (`connect_timeout`): a value Dask cannot read is one line naming the variable.
CONNECT_TIMEOUT = os.environ.get("ATLASFLOW_CONNECT_TIMEOUT", "10s")
#: Environment of every worker process atlasflow starts: one BLAS/OpenMP thread per (single-threaded)
#: worker. Snakemake exports OMP/OPENBLAS/MKL_NUM_THREADS = the job's threads, which workers would
#: otherwise inherit: cores oversubscribed, and BLAS results whose last bits depend on the allocation.
WORKER_ENV = {var: "1" for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                                   "GOTO_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")}


def connect_timeout() -> float:
    """``CONNECT_TIMEOUT`` in seconds; a value Dask cannot read is a ConfigError naming the variable."""
    from dask.utils import parse_timedelta

    try:
        seconds = parse_timedelta(CONNECT_TIMEOUT, default="seconds")
    except (KeyError, ValueError, TypeError):
        seconds = None
    if seconds is None or not seconds > 0:
        raise ConfigError(f"ATLASFLOW_CONNECT_TIMEOUT={CONNECT_TIMEOUT!r} is not a duration: give one such as 10s, "
                          "30s or 2m")
    return float(seconds)


def check_memory_limit(value, name: str = "--memory-limit (dask.memory_limit)"):
    """A per-worker memory limit as Dask reads it (None, auto, a number of bytes or a fraction, a size such
    as 4GB), returned unchanged; anything else is a ConfigError naming ``name``, before any process starts.
    (Dask would let every worker fail and the cluster wait for them until its timeout.)"""
    if value is None or value == "auto":
        return value
    ok = False
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        ok = value >= 0
    elif isinstance(value, str) and value.strip():
        from dask.utils import parse_bytes

        try:
            ok = float(value) >= 0
        except ValueError:
            try:
                ok = parse_bytes(value) >= 0
            except (ValueError, TypeError):
                ok = False
    if not ok:
        raise ConfigError(f"{name}: {value!r} is not a memory size: give one such as 4GB or 4000MB, or auto")
    return value


def is_scheduler_file(path: str | os.PathLike) -> bool:
    """Whether `path` is a scheduler file as Dask writes it: JSON with "type": "Scheduler" and an "address"."""
    try:
        info = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and info.get("type") == "Scheduler" and isinstance(info.get("address"), str)


def read_scheduler_file(path: str | os.PathLike, wait: float = 1.0) -> dict:
    """The content of a Dask scheduler file; one line naming the file when it is not one.

    A scheduler writes its file without renaming it into place, so a file still empty or cut short is read
    again for up to `wait` seconds before it counts as something else.
    """
    path = Path(path)
    deadline = time.monotonic() + wait
    while True:
        try:
            info = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise ClusterError(f"scheduler file {path} does not exist: start the scheduler first") from exc
        except (OSError, ValueError):
            info = None
        if isinstance(info, dict) and info.get("type") == "Scheduler" and isinstance(info.get("address"), str):
            return info
        if time.monotonic() > deadline:
            raise ClusterError(f"{path} is not a Dask scheduler file (JSON with \"type\": \"Scheduler\" and its "
                               "\"address\", as `dask scheduler --scheduler-file` writes it)")
        time.sleep(0.05)


@contextlib.contextmanager
def worker_environment() -> Iterator[None]:
    """``WORKER_ENV`` in this process's environment while worker nannies are created, then as before.

    A nanny takes these variables from the environment in preference to Dask's own one-thread defaults
    and sets them before it spawns its worker, so they must be right in os.environ at that moment.
    """
    saved = {k: os.environ.get(k) for k in WORKER_ENV}
    os.environ.update(WORKER_ENV)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def connect(
    *,
    scheduler_file: str | None = None,
    address: str | None = None,
    n_workers: int | None = None,
    threads_per_worker: int = 1,
    memory_limit: str | int | None = None,
    backend: str = "cpu",
    gpu_preset: str | None = None,
) -> Iterator:
    """Yield a ``distributed.Client``: attached to an existing scheduler, or to a fresh local cluster."""
    from distributed import Client

    scheduler_file = scheduler_file or os.environ.get("ATLASFLOW_SCHEDULER_FILE") or None
    if scheduler_file or address:
        timeout = connect_timeout()
        if scheduler_file and not address:
            address = read_scheduler_file(scheduler_file)["address"]
            target = f"scheduler file {scheduler_file} ({address})"
        else:
            target = f"scheduler {address}"
        try:
            client = Client(address=address, timeout=timeout)
        except (OSError, TimeoutError) as exc:
            raise ClusterError(f"cannot reach the Dask {target} within {CONNECT_TIMEOUT}: {exc}") from exc
        log.info("attached to %s (%d workers)", client.scheduler.address, len(client.scheduler_info()["workers"]))
        try:
            yield client
        finally:
            client.close()
        return

    check_memory_limit(memory_limit)
    if backend == "gpu":
        from atlasflow.gpu_cluster import local_cuda_cluster  # dask-cuda when installed, else one worker per GPU

        cluster = local_cuda_cluster(preset=gpu_preset or "capacity", n_workers=n_workers, memory_limit=memory_limit)
    else:
        from distributed import LocalCluster

        n = int(n_workers or allocation_cores())
        if memory_limit in (None, "auto"):
            total = allocation_memory()
            memory_limit = int(total / n) if total else "auto"
        with worker_environment():  # the nannies read it once, when created
            cluster = LocalCluster(
                n_workers=n,
                threads_per_worker=int(threads_per_worker),
                processes=True,
                memory_limit=memory_limit,
                dashboard_address=":0",
                # CRITICAL: a failed task is raised in the stage (one line, traceback in its log); at ERROR
                # every worker would also print its own multi-line "Compute Failed" report on stderr
                silence_logs=logging.CRITICAL,
            )
    client = Client(cluster)
    log.info("started a local cluster: %d workers, dashboard %s", len(cluster.workers), client.dashboard_link)
    try:
        yield client
    finally:
        client.close()
        cluster.close()
