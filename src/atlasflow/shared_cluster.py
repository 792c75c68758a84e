"""One Dask cluster for a whole workflow run: start it, describe it in a scheduler file, stop it.

``atlasflow cluster start --scheduler-file F`` launches ``dask scheduler`` and ``dask worker``
processes detached from the caller (the Snakefile's ``onstart`` does this for local runs, each run in a
folder of its own, ``.snakemake/atlasflow/run-<pid>-<start>/``), waits until the workers are connected, and
records the process ids (and their start times, against pid reuse) next to the scheduler file. Meanwhile a
short-lived process compiles the numba kernels (`jit_warm`), so the long-lived workers load them instead of
compiling. ``atlasflow cluster stop --scheduler-file F`` ends them (``onsuccess``/``onerror``). Every stage
then attaches through ``ATLASFLOW_SCHEDULER_FILE`` instead of paying for a cluster of its own.

With an owner (``--owner-pid``; the workflow passes Snakemake's own pid) a small watchdog process polls
that process every ``POLL_S`` seconds and stops the cluster once it is gone, whatever ended it (SIGKILL,
the OOM killer, a closed terminal): the cluster of a dead run is gone within ``ORPHAN_WITHIN_S`` seconds.
A cluster started without an owner lives until ``atlasflow cluster stop``.

This module imports only the standard library at the top: the watchdog runs it as a script (``python -I
shared_cluster.py watch ...``), a process of a few MiB that never imports Dask, NumPy or atlasflow.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

#: How often the watchdog looks at the owner (seconds).
POLL_S = 1.0
#: How long the processes of a cluster get to exit on SIGTERM before SIGKILL (seconds).
TERM_GRACE_S = 3.0
#: The stated bound: a cluster whose owner is gone has no process left this many seconds later
#: (one poll, the SIGTERM grace, and margin for a loaded machine).
ORPHAN_WITHIN_S = 15.0
#: Folders of the per-run clusters of a workflow run, under the working directory's .snakemake/atlasflow.
RUN_PREFIX = "run-"


def _pids_file(scheduler_file: Path) -> Path:
    return scheduler_file.with_suffix(".pids.json")


# ------------------------------------------------------------------------------------------ processes


def _stat(pid: int) -> tuple[str, str] | None:
    """(state, start) of a process, None when there is none. The start is the kernel's start time in clock
    ticks since boot (/proc/<pid>/stat): exact, and unchanged by clock adjustments; elsewhere psutil's."""
    try:
        raw = Path(f"/proc/{int(pid)}/stat").read_text()
    except (OSError, ValueError):
        if os.path.isdir("/proc/self"):
            return None
        try:  # pragma: no cover - not Linux
            import psutil

            p = psutil.Process(int(pid))
            return ("Z" if p.status() == psutil.STATUS_ZOMBIE else "R"), repr(p.create_time())
        except Exception:  # noqa: BLE001 - no such process (or no psutil)
            return None
    fields = raw.rsplit(")", 1)[1].split()  # the command name, in parentheses, may hold spaces
    return fields[0], fields[19]


def process_start(pid: int) -> str | None:
    """The start time of a live process (not a zombie), None when it is gone: with the pid, its identity."""
    st = _stat(pid)
    return st[1] if st and st[0] not in ("Z", "X") else None


def owner_alive(owner: dict | None) -> bool:
    """Whether the process recorded as {"pid", "start"} still runs (a new process with its pid does not count)."""
    return bool(owner) and process_start(owner["pid"]) == owner["start"]


def _entry(pid: int) -> dict:
    st = _stat(pid)
    return {"pid": int(pid), "start": st[1] if st else None}


def _as_entry(value) -> dict | None:
    if isinstance(value, dict) and isinstance(value.get("pid"), int):
        return value
    return {"pid": value, "start": None} if isinstance(value, int) else None  # the record of older versions


def _read_pids(pids_path: Path) -> dict | None:
    """atlasflow's record of a cluster; None when there is none (or the file is something else)."""
    try:
        record = json.loads(pids_path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or "scheduler" not in record or not isinstance(record.get("workers", []), list):
        return None
    return record


def _write_pids(pids_path: Path, record: dict) -> None:
    tmp = pids_path.with_name(f".{pids_path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, pids_path)


def _ours(entry: dict) -> bool:
    """Whether the process group of `entry` may be signalled: its leader is the recorded process, or is gone
    (Linux does not reuse a pid while a process group of that id has members, so only our remnants remain)."""
    st = _stat(entry["pid"])
    return st is None or entry.get("start") is None or st[1] == entry["start"]


def _leader_running(entry: dict) -> bool:
    st = _stat(entry["pid"])
    return st is not None and st[0] not in ("Z", "X") and entry.get("start") in (None, st[1])


def _signal_group(entry: dict, sig: int) -> None:
    if entry["pid"] in (os.getpid(), os.getpgrp()) or not _ours(entry):
        return
    try:
        os.killpg(entry["pid"], sig)
    except (ProcessLookupError, PermissionError):
        pass


# ------------------------------------------------------------------------------------------ start / stop


def _last_line(path: Path) -> str:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1].strip() if lines else ""


def _reachable(address: str) -> bool:
    """Whether something accepts TCP connections at a Dask address (tcp://host:port)."""
    m = re.fullmatch(r"(?:tcp|tls)://\[?([^\]]+?)\]?:(\d+)", address)
    if not m:
        return False
    try:
        with socket.create_connection((m.group(1), int(m.group(2))), timeout=1.0):
            return True
    except OSError:
        return False


def check_replaceable(scheduler_file: Path) -> None:
    """Refuse (ClusterError, one line) to start a cluster over what another one or a user still needs: a file
    that is not a Dask scheduler file, a record that is not ours, a cluster whose owner still runs, or a
    running scheduler atlasflow did not start."""
    from atlasflow.cluster import is_scheduler_file
    from atlasflow.errors import ClusterError

    pids_path = _pids_file(scheduler_file)
    if scheduler_file.exists() and not is_scheduler_file(scheduler_file):
        raise ClusterError(f"{scheduler_file} exists and is not a Dask scheduler file: not replaced (give "
                           "--scheduler-file a new path, or remove the file)")
    record = _read_pids(pids_path) if pids_path.exists() else None
    if pids_path.exists() and record is None:
        raise ClusterError(f"{pids_path} exists and is not atlasflow's record of a cluster: not replaced (give "
                           "--scheduler-file another path, or remove the file)")
    owner = record.get("owner") if record else None
    if owner_alive(owner):
        raise ClusterError(f"{scheduler_file} is the cluster of the running process {owner['pid']}: not replaced "
                           "(it stops when that process ends; use another --scheduler-file)")
    if record is None and scheduler_file.exists():
        address = json.loads(scheduler_file.read_text())["address"]
        if _reachable(address):
            raise ClusterError(f"{scheduler_file} names a running scheduler ({address}) that atlasflow did not "
                               "start: not replaced (stop it, or use another --scheduler-file)")


def start(scheduler_file: str | os.PathLike, *, n_workers: int | None = None, memory_limit: str = "auto",
          timeout: float = 60.0, owner_pid: int | None = None) -> dict:
    """Start a scheduler and ``n_workers`` single-threaded workers; return their pids once all are up.

    With `owner_pid`, a watchdog stops them once that process is gone (see the module's docstring). The
    memory limit is checked before anything starts; what a failed start launched is stopped again.
    Returns {"scheduler": pid, "workers": [pid, ...], "watchdog": pid or None, "owner": pid or None}.
    """
    from atlasflow.allocation import allocation_cores
    from atlasflow.cluster import WORKER_ENV, check_memory_limit
    from atlasflow.errors import ClusterError

    check_memory_limit(memory_limit, "--memory-limit (dask.memory_limit)")
    scheduler_file = Path(scheduler_file).resolve()
    owner = None
    if owner_pid is not None:
        owner = {"pid": int(owner_pid), "start": process_start(int(owner_pid))}
        if owner["start"] is None:
            raise ClusterError(f"--owner-pid {owner_pid}: there is no such process")
    check_replaceable(scheduler_file)
    scheduler_file.parent.mkdir(parents=True, exist_ok=True)
    stop(scheduler_file, quiet=True)  # a cluster recorded here whose owner is gone, or a user's own restart
    scheduler_file.unlink(missing_ok=True)
    n_workers = int(n_workers or allocation_cores())
    logdir = scheduler_file.parent
    pids_path = _pids_file(scheduler_file)
    record = {"owner": owner, "watchdog": None, "scheduler": None, "workers": []}
    _write_pids(pids_path, record)  # before any process: whatever starts is recorded at once

    def launch(cmd, logname, **kw):
        with open(logdir / logname, "ab") as err:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                    start_new_session=True, **kw)
        return proc, _entry(proc.pid)

    try:
        if owner:  # first: if the owner dies while this starts, the watchdog stops what was started
            _, record["watchdog"] = launch(
                [sys.executable, "-I", str(Path(__file__).resolve()), "watch", "--scheduler-file", str(scheduler_file),
                 "--owner-pid", str(owner["pid"]), "--owner-start", owner["start"]], "watchdog.log")
            _write_pids(pids_path, record)
        dask_cli = [sys.executable, "-m", "distributed.cli.dask_scheduler"]
        sched, record["scheduler"] = launch(
            [*dask_cli, "--scheduler-file", str(scheduler_file), "--host", "127.0.0.1", "--port", "0",
             "--dashboard-address", ":0"], "scheduler.log")
        _write_pids(pids_path, record)
        deadline = time.time() + timeout
        while not scheduler_file.exists():
            if sched.poll() is not None:
                raise ClusterError(f"the scheduler exited ({_last_line(logdir / 'scheduler.log')}); log: "
                                   f"{logdir / 'scheduler.log'}")
            if time.time() > deadline:
                raise ClusterError(f"the scheduler did not write its file within {timeout:.0f} s")
            time.sleep(0.1)
        for i in range(n_workers):
            _, entry = launch(
                [sys.executable, "-m", "distributed.cli.dask_worker", "--scheduler-file", str(scheduler_file),
                 "--nworkers", "1", "--nthreads", "1", "--name", f"atlasflow-{i}",
                 "--memory-limit", "auto" if memory_limit is None else str(memory_limit)],
                f"worker-{i}.log", env={**os.environ, **WORKER_ENV})
            record["workers"].append(entry)
            _write_pids(pids_path, record)
        from atlasflow import jit_warm

        jit_warm.in_subprocess()  # while the workers start: they then load compiled kernels instead of compiling

        from distributed import Client

        with Client(scheduler_file=str(scheduler_file), timeout="30s") as client:
            try:
                client.wait_for_workers(n_workers, timeout=timeout)
            except TimeoutError as exc:
                raise ClusterError(f"{n_workers} workers did not connect within {timeout:.0f} s (worker-0: "
                                   f"{_last_line(logdir / 'worker-0.log') or 'no message'}); logs in {logdir}") from exc
            log.info("shared cluster up: %s with %d workers", client.scheduler.address, n_workers)
    except ClusterError:
        stop(scheduler_file, quiet=True)  # nothing of a failed start keeps running
        raise
    except Exception as exc:
        stop(scheduler_file, quiet=True)
        raise ClusterError(f"the cluster did not start: {type(exc).__name__}: {exc} (logs in {logdir})") from exc
    except BaseException:  # KeyboardInterrupt, SystemExit
        stop(scheduler_file, quiet=True)
        raise
    return {"scheduler": record["scheduler"]["pid"], "workers": [w["pid"] for w in record["workers"]],
            "watchdog": record["watchdog"]["pid"] if record["watchdog"] else None,
            "owner": owner["pid"] if owner else None}


def stop(scheduler_file: str | os.PathLike, *, quiet: bool = False) -> None:
    """Terminate the processes recorded for this scheduler file and remove the file and the record.

    Only processes that are still the recorded ones are signalled (pid and start time), each by its process
    group (a worker's nanny and the worker it spawned); SIGTERM first, SIGKILL for what is left.
    """
    scheduler_file = Path(scheduler_file).resolve()
    pids_path = _pids_file(scheduler_file)
    record = _read_pids(pids_path)
    if record is None:
        if not quiet:
            log.info("no shared cluster recorded at %s", scheduler_file)
        return
    entries = [e for e in (_as_entry(v) for v in [record.get("watchdog"), *record.get("workers", []),
                                                    record.get("scheduler")]) if e]
    for e in entries:
        _signal_group(e, signal.SIGTERM)
    deadline = time.time() + TERM_GRACE_S
    while time.time() < deadline and any(_leader_running(e) for e in entries if e["pid"] != os.getpid()):
        time.sleep(0.1)
    for e in entries:
        _signal_group(e, signal.SIGKILL)  # what ignored SIGTERM, and a nanny's worker left behind
    pids_path.unlink(missing_ok=True)
    try:
        info = json.loads(scheduler_file.read_text())
        if isinstance(info, dict) and info.get("type") == "Scheduler":
            scheduler_file.unlink()
    except (OSError, ValueError):
        pass


def watch(scheduler_file: str | os.PathLike, owner: dict, poll: float = POLL_S) -> None:
    """The watchdog: stop the cluster of `scheduler_file` once `owner` ({"pid", "start"}) is gone.

    Ends by itself, stopping nothing, when the cluster was stopped (its record removed) or replaced by one
    with another owner.
    """
    scheduler_file = Path(scheduler_file).resolve()
    pids_path = _pids_file(scheduler_file)
    while True:
        record = _read_pids(pids_path)
        if record is None or record.get("owner") != owner:
            return
        if not owner_alive(owner):
            print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} atlasflow watchdog: process {owner['pid']} is gone: "
                  f"stopping the cluster of {scheduler_file}", file=sys.stderr, flush=True)
            stop(scheduler_file, quiet=True)
            return
        time.sleep(poll)


# ------------------------------------------------------------------------------------------ per-run folders


def run_dir(base: str | os.PathLike, owner_pid: int) -> Path:
    """The folder of the cluster of the run of process `owner_pid`: base/run-<pid>-<start>."""
    start_ = process_start(owner_pid)
    return Path(base) / f"{RUN_PREFIX}{int(owner_pid)}-{start_}"


def prune_runs(base: str | os.PathLike) -> list[Path]:
    """Remove the folders (logs, and any cluster still recorded) of runs under `base` that are gone; a folder
    whose run is alive is left alone. Returns the folders removed."""
    removed = []
    for folder in sorted(Path(base).glob(f"{RUN_PREFIX}*")):
        m = re.fullmatch(rf"{RUN_PREFIX}(\d+)-(.+)", folder.name)
        if not m or not folder.is_dir() or owner_alive({"pid": int(m.group(1)), "start": m.group(2)}):
            continue
        stop(folder / "scheduler.json", quiet=True)
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


# ------------------------------------------------------------------------------------------ CLI


def main(argv: list[str] | None = None) -> int:
    """``atlasflow cluster start|stop --scheduler-file F [--n-workers N] [--memory-limit M] [--owner-pid P]``."""
    p = argparse.ArgumentParser(prog="atlasflow cluster", description=__doc__.splitlines()[0])
    p.add_argument("action", choices=["start", "stop", "watch"], help="watch: the watchdog itself (internal)")
    p.add_argument("--scheduler-file", required=True)
    p.add_argument("--n-workers", type=int, default=None, help="default: cores of the allocation")
    p.add_argument("--memory-limit", default="auto", help="per worker, e.g. 4GB")
    p.add_argument("--owner-pid", type=int, default=None,
                   help=f"stop the cluster within {ORPHAN_WITHIN_S:.0f} s once this process is gone "
                        "(default: none, the cluster runs until `atlasflow cluster stop`)")
    p.add_argument("--owner-start", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.action == "watch":
        if args.owner_pid is None or args.owner_start is None:
            p.error("watch needs --owner-pid and --owner-start")
        watch(args.scheduler_file, {"pid": args.owner_pid, "start": args.owner_start})
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from atlasflow.errors import AtlasflowError

    try:
        if args.action == "start":
            start(args.scheduler_file, n_workers=args.n_workers, memory_limit=args.memory_limit,
                  owner_pid=args.owner_pid)
        else:
            stop(args.scheduler_file)
    except AtlasflowError as exc:
        print(f"atlasflow cluster: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # the watchdog: `python -I shared_cluster.py watch ...` (standard library only)
    sys.exit(main())
