"""Lifetime of the Dask clusters atlasflow starts: each run owns its own, and none outlives its owner.

* ``dask.shared_cluster``: every run has its own folder ``.snakemake/atlasflow/run-<pid>-<start>/``; two
  runs on different targets in one folder (Snakemake's lock lets them run together) never touch each
  other's cluster.
* A cluster started for an owner (the Snakemake process, or ``atlasflow cluster start --owner-pid``) has no
  process left ``shared_cluster.ORPHAN_WITHIN_S`` (15) seconds after the owner is gone, however it ended
  (here: SIGKILL, of the owner alone or of the snakemake process group in the middle of a stage); a cluster
  whose owner lives is never stopped, nor one started without an owner.
* A stage's own LocalCluster (no scheduler given) leaves no worker behind when the stage is SIGKILLed.

Processes of a cluster are found with psutil: those whose command line holds its scheduler file, and
their descendants. Zombies (exited, not yet reaped by a parent) count as gone.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from test_workflow import DATASET, TINY_CONFIG, assert_same_store, snakemake, snakemake_cmd, write_config

from atlasflow import shared_cluster

ROOT = Path(__file__).resolve().parents[1]
#: The stated bound (shared_cluster.ORPHAN_WITHIN_S): no process of a cluster left this long after its owner.
WITHIN = 15.0


# ------------------------------------------------------------------------------------------ helpers


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def cluster_processes(scheduler_file: Path) -> list[psutil.Process]:
    """Processes whose command line names `scheduler_file` (scheduler, nannies, watchdog) and their children."""
    found = {}
    for p in psutil.process_iter(["cmdline"]):
        if str(scheduler_file) in " ".join(p.info["cmdline"] or []):
            found[p.pid] = p
    for p in list(found.values()):
        try:
            found.update((c.pid, c) for c in p.children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    return list(found.values())


def wait_gone(procs: list[psutil.Process], within: float) -> list[psutil.Process]:
    """Wait up to `within` seconds for every process to end; return those still alive."""
    deadline = time.time() + within
    while (left := [p for p in procs if alive(p)]) and time.time() < deadline:
        time.sleep(0.1)
    return left


def describe(procs) -> list[str]:
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid}: {' '.join(p.cmdline())[:160]}")
        except psutil.NoSuchProcess:
            pass
    return out


def scheduler_files(workdir: Path) -> list[Path]:
    return sorted((workdir / ".snakemake" / "atlasflow").glob("**/scheduler.json"))


def wait_for(cond, timeout: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.time() + timeout
    while not (value := cond()):
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read()[-4000:] if proc.stdout else ""
            pytest.fail(f"{what}: the process exited {proc.returncode} first:\n{out}")
        assert time.time() < deadline, what
        time.sleep(0.1)
    return value


def client_of(scheduler_file: Path, n_workers: int = 1):
    from distributed import Client

    # not the default client: two of them closed in the order they were made (a, then b) would leave dask's
    # config naming the distributed scheduler with no client alive, for the next test file in this process
    client = Client(scheduler_file=str(scheduler_file), timeout="30s", set_as_default=False)
    client.wait_for_workers(n_workers, timeout=60)
    return client


def start_run(workdir: Path, *targets: str) -> subprocess.Popen:
    return subprocess.Popen(snakemake_cmd(workdir, *targets), cwd=workdir, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out[-6000:]
    return out


SHARED = {**TINY_CONFIG, "dask": {"shared_cluster": True, "n_workers": 1, "memory_limit": "1GB"}}
QC = f"results/{DATASET}/qc.zarr"


# ------------------------------------------------------------------------------------------ without Snakemake


def test_owner_identity_is_pid_and_start_time():
    """A recorded owner counts as alive only while that very process runs: a pid now used by another
    process (another start time) or a zombie does not count."""
    me = {"pid": os.getpid(), "start": shared_cluster.process_start(os.getpid())}
    assert me["start"] and shared_cluster.owner_alive(me)
    assert not shared_cluster.owner_alive({**me, "start": str(int(me["start"]) - 1)})  # pid reused
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    start = None
    while child.poll() is None:
        start = shared_cluster.process_start(child.pid) or start
    assert shared_cluster.process_start(child.pid) is None  # a zombie until waited for
    child.wait()
    assert not shared_cluster.owner_alive({"pid": child.pid, "start": start})
    assert not shared_cluster.owner_alive(None)


def test_cluster_stops_by_itself_once_its_owner_is_killed(tmp_path):
    """`atlasflow cluster start --owner-pid P`: left alone while P lives (and not replaceable), gone within
    ORPHAN_WITHIN_S of P's SIGKILL."""
    assert shared_cluster.ORPHAN_WITHIN_S <= WITHIN
    owner = subprocess.Popen(["sleep", "600"])
    sfile = tmp_path / "run" / "scheduler.json"
    try:
        pids = shared_cluster.start(sfile, n_workers=1, memory_limit="1GB", owner_pid=owner.pid)
        assert pids["owner"] == owner.pid and pids["watchdog"]
        procs = cluster_processes(sfile)
        assert {pids["scheduler"], pids["watchdog"], *pids["workers"]} <= {p.pid for p in procs}
        assert len(procs) >= 4  # scheduler, watchdog, nanny, its worker
        # the owner lives: a few polls later everything still runs, and another start over it is refused
        assert shared_cluster.main(["start", "--scheduler-file", str(sfile), "--n-workers", "1"]) == 1
        time.sleep(3 * shared_cluster.POLL_S)
        assert all(alive(p) for p in procs), describe(procs)
        assert sfile.exists()
        owner.kill()
        owner.wait()
        t0 = time.time()
        left = wait_gone(procs, WITHIN)
        assert not left, describe(left)
        print(f"cluster gone {time.time() - t0:.1f} s after its owner")
        assert not sfile.exists() and not sfile.with_suffix(".pids.json").exists()
        assert "is gone: stopping the cluster" in (sfile.parent / "watchdog.log").read_text()
    finally:
        if owner.poll() is None:
            owner.kill()
        shared_cluster.stop(sfile, quiet=True)


def test_killed_stage_script_leaves_no_workers(tmp_path):
    """SIGKILL of a stage script alone (as the OOM killer would do): the worker processes of its own
    LocalCluster end by themselves (each watches a pipe from its parent and exits when it closes)."""
    from atlasflow.cli import stage_main
    from atlasflow.stages import simulate

    raw = tmp_path / "raw.zarr"
    assert stage_main(simulate, argv=["--output", str(raw), "--n-cells", "300", "--n-genes", "200",
                                      "--n-cell-types", "3", "--n-workers", "1"]) == 0
    stage = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "qc.py"), "--input", str(raw), "--output",
                              str(tmp_path / "qc.zarr"), "--n-workers", "1", "--memory-limit", "1GB",
                              "--log", str(tmp_path / "qc.log")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        me = psutil.Process(stage.pid)
        workers = wait_for(lambda: [c for c in me.children(recursive=True) if "spawn_main" in cmdline(c)], 120,
                           "the stage's LocalCluster did not start its workers", stage)
        children = me.children(recursive=True)
        os.kill(stage.pid, signal.SIGKILL)  # the stage alone, not its process group
        stage.wait()
        left = wait_gone(children, WITHIN)
        assert not left, describe(left)
        assert workers
    finally:
        try:
            os.killpg(stage.pid, signal.SIGKILL)  # whatever is left of the stage's process group
        except ProcessLookupError:
            pass
        stage.wait()


# ------------------------------------------------------------------------------------------ Snakemake runs


@pytest.mark.workflow
def test_two_runs_in_one_folder_keep_their_own_clusters(tmp_path):
    """Two snakemake runs on two datasets in one folder, both with dask.shared_cluster: each run's start and
    end leave the other's cluster alone; both finish with exit 0 and the same stores (same simulation)."""
    from distributed import Event

    spec = TINY_CONFIG["datasets"][DATASET]
    write_config(tmp_path, {**SHARED, "datasets": {"a": spec, "b": spec}})
    runs, clients, holds, held = {}, {}, {}, {}
    try:
        for name in ("a", "b"):
            known = set(scheduler_files(tmp_path))
            runs[name] = start_run(tmp_path, f"results/{name}/qc.zarr")
            sfile = wait_for(lambda: [f for f in scheduler_files(tmp_path) if f not in known], 120,
                             f"run {name} started no cluster of its own", runs[name])[0]
            clients[name] = client_of(sfile)
            # hold the run's worker: its qc stage cannot finish while the other run starts or ends
            holds[name] = Event(f"hold-{name}", client=clients[name])
            holds[name].clear()
            held[name] = [clients[name].submit(holds[name].wait, 180, workers=[w], allow_other_workers=False,
                                               pure=False) for w in clients[name].scheduler_info()["workers"]]
        assert len(set(scheduler_files(tmp_path))) == 2
        for name in ("a", "b"):  # b's start stopped nothing of a's
            assert runs[name].poll() is None
            assert len(clients[name].scheduler_info()["workers"]) == 1
        holds["a"].set()
        clients["a"].gather(held["a"])
        clients.pop("a").close()
        finish(runs["a"])
        assert len(scheduler_files(tmp_path)) == 1  # a's end removed a's cluster only
        assert len(clients["b"].scheduler_info()["workers"]) == 1
        holds["b"].set()
        clients["b"].gather(held["b"])
        clients.pop("b").close()
        finish(runs["b"])
    finally:
        for c in clients.values():
            c.close()
        for p in runs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert scheduler_files(tmp_path) == []
    assert not list((tmp_path / ".snakemake" / "atlasflow").glob("run-*"))  # both succeeded: folders removed
    import json

    ran_on = {n: json.loads((tmp_path / "results" / n / "qc.json").read_text())["ran_on"] for n in ("a", "b")}
    assert ran_on["a"]["scheduler"] != ran_on["b"]["scheduler"], ran_on
    assert_same_store(tmp_path / "results" / "a" / "qc.zarr", tmp_path / "results" / "b" / "qc.zarr")


@pytest.mark.workflow
def test_killed_run_leaves_no_shared_cluster(tmp_path):
    """SIGKILL of the snakemake process group while qc runs on the shared cluster: within ORPHAN_WITHIN_S no
    scheduler, worker or watchdog of that run is left; the next run works and removes the dead run's folder."""
    write_config(tmp_path, SHARED)
    proc = start_run(tmp_path, QC)
    try:
        (sfile,) = wait_for(lambda: scheduler_files(tmp_path), 120, "no shared cluster started", proc)
        client = client_of(sfile)
        # a long task on the one worker keeps qc in the middle of its work
        client.submit(time.sleep, 120, pure=False)
        log = tmp_path / "logs" / DATASET / "qc.log"
        wait_for(lambda: log.exists() and "attached to" in log.read_text(), 120, "qc did not start", proc)
        client.close()
        procs = cluster_processes(sfile)
        assert len(procs) >= 4, describe(procs)  # scheduler, watchdog, nanny, its worker
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        t0 = time.time()
        left = wait_gone(procs, WITHIN)
        assert not left, describe(left)
        print(f"shared cluster gone {time.time() - t0:.1f} s after the kill")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    shutil.rmtree(tmp_path / ".snakemake" / "locks", ignore_errors=True)  # what `snakemake --unlock` does
    snakemake(tmp_path, QC)
    assert (tmp_path / "results" / DATASET / "qc.json").exists()
    assert not list((tmp_path / ".snakemake" / "atlasflow").glob("run-*"))


@pytest.mark.workflow
def test_killed_run_leaves_no_per_stage_cluster(tmp_path):
    """dask.shared_cluster false: SIGKILL of the snakemake process group once qc's own LocalCluster has
    started its workers; within ORPHAN_WITHIN_S none of the run's processes is left; the next run works."""
    write_config(tmp_path, {**TINY_CONFIG, "dask": {"shared_cluster": False, "n_workers": 1}})
    proc = start_run(tmp_path, QC)
    try:
        top = psutil.Process(proc.pid)

        def qc_workers():  # the spawned worker processes of the qc script's LocalCluster
            return [k for k in top.children(recursive=True) if "spawn_main" in cmdline(k)
                    and any("qc.py" in cmdline(a) for a in k.parents())]

        wait_for(qc_workers, 120, "qc's LocalCluster did not start its workers", proc)
        procs = top.children(recursive=True)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        left = wait_gone(procs, WITHIN)
        assert not left, describe(left)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    shutil.rmtree(tmp_path / ".snakemake" / "locks", ignore_errors=True)
    snakemake(tmp_path, QC)
    assert (tmp_path / "results" / DATASET / "qc.json").exists()


@pytest.mark.workflow
def test_bad_memory_limit_fails_at_once(tmp_path):
    """dask.memory_limit: lots with the shared cluster: one line naming dask.memory_limit, at once (before
    any process starts), exit 1; no scheduler left, no job run."""
    write_config(tmp_path, {**SHARED, "dask": {**SHARED["dask"], "memory_limit": "lots"}})
    t0 = time.time()
    proc = snakemake(tmp_path, QC, check=False, timeout=120)
    assert proc.returncode == 1, proc.stdout
    assert time.time() - t0 < 40
    lines = [line for line in proc.stdout.splitlines() if "'lots' is not a memory size" in line]
    assert len(lines) == 1 and "dask.memory_limit" in lines[0], proc.stdout
    assert "Traceback" not in proc.stdout
    assert scheduler_files(tmp_path) == []
    assert not (tmp_path / "results").exists()
