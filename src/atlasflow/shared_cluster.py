"""One Dask cluster for a whole workflow run: start it, describe it in a scheduler file, stop it.

``atlasflow cluster start --scheduler-file F`` launches ``dask scheduler`` and ``dask worker``
processes detached from the caller (the Snakefile's ``onstart`` does this for local runs), waits until
the workers are connected, and records the process ids next to the scheduler file. Meanwhile a short-lived
process compiles the numba kernels (`jit_warm`), so the long-lived workers load them instead of compiling.
``atlasflow cluster stop --scheduler-file F`` ends them (``onsuccess``/``onerror``). Every stage then
attaches through ``ATLASFLOW_SCHEDULER_FILE`` instead of paying for a cluster of its own.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from atlasflow import jit_warm
from atlasflow.cluster import WORKER_ENV, allocation_cores
from atlasflow.errors import ClusterError

log = logging.getLogger(__name__)


def _pids_file(scheduler_file: Path) -> Path:
    return scheduler_file.with_suffix(".pids.json")


def start(scheduler_file: str | os.PathLike, *, n_workers: int | None = None, memory_limit: str = "auto",
          timeout: float = 60.0) -> dict:
    """Start a scheduler and ``n_workers`` single-threaded workers; return their pids once all are up."""
    scheduler_file = Path(scheduler_file).resolve()
    scheduler_file.parent.mkdir(parents=True, exist_ok=True)
    stop(scheduler_file, quiet=True)
    scheduler_file.unlink(missing_ok=True)
    n_workers = int(n_workers or allocation_cores())
    logdir = scheduler_file.parent
    dask_cli = [sys.executable, "-m", "distributed.cli.dask_scheduler"]
    sched = subprocess.Popen(
        [*dask_cli, "--scheduler-file", str(scheduler_file), "--host", "127.0.0.1", "--port", "0", "--dashboard-address", ":0"],
        stdout=subprocess.DEVNULL, stderr=open(logdir / "scheduler.log", "ab"), start_new_session=True,
    )
    _wait_for(lambda: scheduler_file.exists(), timeout, "the scheduler did not write its file")
    workers = []
    for i in range(n_workers):
        workers.append(subprocess.Popen(
            [sys.executable, "-m", "distributed.cli.dask_worker", "--scheduler-file", str(scheduler_file),
             "--nworkers", "1", "--nthreads", "1", "--memory-limit", str(memory_limit), "--name", f"atlasflow-{i}"],
            stdout=subprocess.DEVNULL, stderr=open(logdir / f"worker-{i}.log", "ab"), start_new_session=True,
            env={**os.environ, **WORKER_ENV},
        ))
    pids = {"scheduler": sched.pid, "workers": [w.pid for w in workers]}
    _pids_file(scheduler_file).write_text(json.dumps(pids))
    jit_warm.in_subprocess()  # while the workers start: they then load compiled kernels instead of compiling

    from distributed import Client

    with Client(scheduler_file=str(scheduler_file), timeout="30s") as client:
        client.wait_for_workers(n_workers, timeout=timeout)
        log.info("shared cluster up: %s with %d workers", client.scheduler.address, n_workers)
    return pids


def stop(scheduler_file: str | os.PathLike, *, quiet: bool = False) -> None:
    """Terminate the processes recorded for this scheduler file and remove the file."""
    scheduler_file = Path(scheduler_file).resolve()
    pids_path = _pids_file(scheduler_file)
    if not pids_path.exists():
        if not quiet:
            log.info("no shared cluster recorded at %s", scheduler_file)
        return
    pids = json.loads(pids_path.read_text())
    for pid in [*pids.get("workers", []), pids.get("scheduler")]:
        if pid is None:
            continue
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    time.sleep(0.5)
    for pid in [*pids.get("workers", []), pids.get("scheduler")]:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, TypeError):
            pass
    pids_path.unlink(missing_ok=True)
    scheduler_file.unlink(missing_ok=True)


def _wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not cond():
        if time.time() > deadline:
            raise ClusterError(f"{what} within {timeout:.0f} s")
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    """``atlasflow cluster start|stop --scheduler-file F [--n-workers N] [--memory-limit M]``."""
    p = argparse.ArgumentParser(prog="atlasflow cluster", description=__doc__.splitlines()[0])
    p.add_argument("action", choices=["start", "stop"])
    p.add_argument("--scheduler-file", required=True)
    p.add_argument("--n-workers", type=int, default=None, help="default: cores of the allocation")
    p.add_argument("--memory-limit", default="auto", help="per worker, e.g. 4GB")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.action == "start":
            start(args.scheduler_file, n_workers=args.n_workers, memory_limit=args.memory_limit)
        else:
            stop(args.scheduler_file)
    except ClusterError as exc:
        print(f"atlasflow cluster: error: {exc}", file=sys.stderr)
        return 1
    return 0
