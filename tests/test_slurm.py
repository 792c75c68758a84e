"""HPC: the workflow under a real one-node SLURM (profiles/slurm), and stages sharing one Dask cluster.

* A local run of the tiny dataset with ``dask.shared_cluster: true`` (one cluster started at ``onstart``) is
  the reference: every stage names the same scheduler, and the cluster is gone afterwards.
* Under SLURM (``../shared/slurm/local_slurm.sh``, started here when not already running, stopped at the
  end) the whole workflow runs: every stage is a SLURM job, whose local cluster (for the stages that use
  one) is sized to its allocation; normalize's job is cancelled (``scancel``) twice - the retry asks for
  twice the memory - so the run fails cleanly; the rerun redoes only what had not finished, and every
  output (stores, tables, figures) equals the reference bit for bit: per-stage clusters (one in each SLURM
  job) and one shared cluster give the same results.
* ``hpc/dask_cluster.sbatch`` starts a Dask cluster as a SLURM job that a stage attaches to.

Without root or apt-get (SLURM cannot be installed) the SLURM tests are skipped; in CI (``CI=true``) they
fail instead.
"""

from __future__ import annotations

import getpass
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from test_workflow import (PROFILE, SNAKEFILE, TINY_CONFIG, assert_same_store, rules_run, same_bits, stage_outputs,
                           write_config)

ROOT = Path(__file__).resolve().parents[1]
LOCAL_SLURM = ROOT.parent / "shared" / "slurm" / "local_slurm.sh"
SLURM_PROFILE = ROOT / "profiles" / "slurm" / "config.v8+.yaml"
DATASET = "tiny"
#: The stages the tiny run has (the whole workflow: `all`)
STAGES = ["simulate", "qc", "filter", "normalize", "log1p", "hvg", "subset", "scale", "pca", "neighbors", "leiden",
          "umap", "rank_genes_groups", "aggregate", "plots", "final"]
#: Stages that compute on a Dask cluster (the others work in their own process on small, in-memory slots).
CLUSTER_STAGES = ["qc", "filter", "normalize", "log1p", "hvg", "subset", "scale", "pca", "rank_genes_groups",
                  "aggregate"]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

pytestmark = [pytest.mark.workflow, pytest.mark.slow]


# ------------------------------------------------------------------------------------------ helpers


def run_snakemake(workdir: Path, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    """snakemake on the tiny config in workdir (profiles/default as the workflow profile), output combined."""
    proc = subprocess.run(smk_cmd(workdir, *args), cwd=workdir, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=timeout, env=clean_env())
    if check and proc.returncode != 0:
        pytest.fail(f"snakemake {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-6000:]}")
    return proc


def smk_cmd(workdir: Path, *args: str) -> list[str]:
    """The CLI call for the whole workflow, with args (another profile, cores, ...)."""
    return [sys.executable, "-m", "snakemake", *args, "--snakefile", str(SNAKEFILE),
            "--directory", str(workdir), "--workflow-profile", str(PROFILE),
            "--configfile", str(workdir / "config.yaml")]


def clean_env() -> dict:
    """The environment without a scheduler file inherited from elsewhere."""
    return {k: v for k, v in os.environ.items() if k != "ATLASFLOW_SCHEDULER_FILE"}


def summary(workdir: Path, stage: str) -> dict:
    return json.loads((workdir / "results" / DATASET / f"{stage}.json").read_text())


def store(workdir: Path, stage: str) -> Path:
    return workdir / "results" / DATASET / f"{stage}.zarr"


def assert_same_as(workdir: Path, reference: Path) -> None:
    """Every output of every stage (but the JSON summaries, which hold timings) is identical to the reference's."""
    outputs = stage_outputs(reference)
    assert set(outputs) == set(STAGES), sorted(outputs)
    for paths in outputs.values():
        for path in paths:
            if path.suffix != ".json":
                same_bits(workdir / path.relative_to(reference), path)


def port_open(address: str) -> bool:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((host, int(port))) == 0


def sh(*cmd: str, timeout: float = 60, check: bool = True, env: dict | None = None) -> str:
    proc = subprocess.run(cmd, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stdout}")
    return proc.stdout


def slurm_jobs() -> dict[int, dict]:
    """Jobs squeue still knows (finished ones for MinJobAge s): id -> state, comment, memory, time limit."""
    out = sh("squeue", "-h", "--states=all", "-o", "%i|%T|%k|%m|%l")
    jobs = {}
    for line in out.splitlines():
        jid, state, comment, mem, limit = line.strip().split("|")
        if jid.isdigit():
            jobs[int(jid)] = {"state": state, "comment": comment, "mem": mem, "limit": limit}
    return jobs


class JobWatch(threading.Thread):
    """squeue's view of every job seen while a run goes on (polled every ``interval`` s), its last state each:
    squeue forgets a finished job MinJobAge (300 s) after it ended, and on a loaded machine a run outlasts
    that (CI: the resumed run's normalize job was gone when the run ended)."""

    def __init__(self, interval: float = 2.0):
        super().__init__(daemon=True)
        self.jobs: dict[int, dict] = {}
        self.interval = interval
        self.done = threading.Event()

    def poll(self) -> None:
        try:
            self.jobs.update(slurm_jobs())
        except (RuntimeError, subprocess.TimeoutExpired):  # squeue busy for a moment: the next poll
            pass

    def run(self) -> None:
        while not self.done.is_set():
            self.poll()
            self.done.wait(self.interval)

    def __enter__(self) -> JobWatch:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.join()
        self.poll()


def wait_for(cond, timeout: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None,
             interval: float = 0.2):
    deadline = time.time() + timeout
    while True:
        value = cond()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            out = log.read_text()[-6000:] if log else ""
            pytest.fail(f"snakemake ended (rc {proc.returncode}) while waiting for {what}:\n{out}")
        if time.time() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The tiny workflow run locally on one shared cluster (dask.shared_cluster). Under SLURM every stage starts
    a cluster of its own, so the SLURM run's stores equal to these also show that per-stage clusters and one
    shared cluster give the same results (one local run fewer: each is a whole run's worth of stages)."""
    workdir = tmp_path_factory.mktemp("shared")
    write_config(workdir, {**TINY_CONFIG, "dask": {"shared_cluster": True}})
    t0 = time.time()
    proc = run_snakemake(workdir, "--cores", "2")
    (workdir / "run.txt").write_text(proc.stdout)
    print(f"shared cluster: {time.time() - t0:.1f} s")
    return workdir


def _unavailable(reason: str):
    if IN_CI:
        pytest.fail(f"SLURM is required in CI: {reason}")
    pytest.skip(reason)


def _slurm_running() -> bool:
    return shutil.which("scontrol") is not None and subprocess.run(
        ["scontrol", "ping"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0


@pytest.fixture(scope="module")
def slurm():
    """A running one-node SLURM from local_slurm.sh: installed (apt) and started here when needed.

    An already running one is used only when it is local_slurm.sh's (ClusterName=localcluster): the tests
    never submit to a real site's cluster. Daemons started here are stopped at the end.
    """
    started = False
    if _slurm_running():
        config = sh("scontrol", "show", "config")
        if not re.search(r"^ClusterName\s*=\s*localcluster\s*$", config, re.M):
            _unavailable("a SLURM cluster other than local_slurm.sh's is configured here; not submitting to it")
    else:
        if not LOCAL_SLURM.exists():
            _unavailable(f"{LOCAL_SLURM} not found (it is beside the project in CI and on dev machines)")
        if shutil.which("sbatch") is None or shutil.which("slurmctld") is None:
            if os.geteuid() != 0 or shutil.which("apt-get") is None:
                _unavailable("SLURM is not installed and cannot be here (needs root and apt-get)")
            sh("bash", str(LOCAL_SLURM), "install", timeout=900)
        sh("bash", str(LOCAL_SLURM), "start", timeout=300)
        started = True
    partition = next(p.rstrip("*") for p in sh("sinfo", "-h", "-o", "%P").split() if p.endswith("*"))
    yield {"partition": partition}
    if started:  # our own daemons: nothing of the tests may keep running on them
        sh("scancel", f"--user={getpass.getuser()}", check=False)
        sh("bash", str(LOCAL_SLURM), "stop", timeout=300, check=False)


@pytest.fixture(scope="module")
def slurm_profile(slurm, tmp_path_factory) -> Path:
    """profiles/slurm with the site placeholders filled in for the local cluster (and quicker polling)."""
    profile = yaml.safe_load(SLURM_PROFILE.read_text())
    assert profile["executor"] == "slurm" and profile["slurm-status-command"] == "squeue"
    assert profile["default-resources"]["slurm_partition"].startswith("<")  # a placeholder in the repository
    profile["default-resources"]["slurm_partition"] = slurm["partition"]
    del profile["default-resources"]["slurm_account"]
    profile["slurm-no-account"] = True  # local_slurm.sh has no accounting
    profile["slurm-init-seconds-before-status-checks"] = 2  # checks after 2, 14, 36, 68 s
    profile["retries"] = 1
    folder = tmp_path_factory.mktemp("profile")
    (folder / "config.v8+.yaml").write_text(yaml.safe_dump(profile, sort_keys=False))
    return folder


# ------------------------------------------------------------------------------------------ shared cluster


def test_shared_cluster_run(reference):
    """dask.shared_cluster: one cluster for every stage, each stage a job of its own, stopped at the end."""
    out = (reference / "run.txt").read_text()
    assert "atlasflow: shared Dask cluster with 2 workers" in out, out
    ran_on = {stage: summary(reference, stage)["ran_on"] for stage in CLUSTER_STAGES}
    schedulers = {r["scheduler"] for r in ran_on.values()}
    assert len(schedulers) == 1, ran_on
    assert len({tuple(r["workers"]) for r in ran_on.values()}) == 1 and len(ran_on["qc"]["workers"]) == 2
    assert len({r["pid"] for r in ran_on.values()}) == len(CLUSTER_STAGES)  # separate jobs, one cluster
    (address,) = schedulers
    assert not port_open(address), "the shared scheduler still runs after the workflow ended"
    # the run's cluster folder (scheduler file, pids, logs) is removed after a success
    assert not list((reference / ".snakemake" / "atlasflow").glob("run-*")), \
        list((reference / ".snakemake" / "atlasflow").glob("run-*"))


# ------------------------------------------------------------------------------------------ SLURM


@pytest.fixture(scope="module")
def slurm_run(slurm, slurm_profile, reference, tmp_path_factory) -> Path:
    """The workflow under SLURM; normalize's job is cancelled in both attempts, then the run is resumed.

    Returns the working directory after the resumed run (and leaves the first run's facts in it).
    """
    workdir = tmp_path_factory.mktemp("slurm")
    # shared_cluster is on: under the SLURM executor it must be skipped, not started on the submit host
    write_config(workdir, {**TINY_CONFIG, "dask": {"shared_cluster": True}})
    args = ("--profile", str(slurm_profile))
    last_job = max(slurm_jobs(), default=0)
    normalize = f"rule_normalize_wildcards_{DATASET}"

    def running_normalize(exclude=()):
        return next((jid for jid, j in slurm_jobs().items() if jid > last_job and jid not in exclude
                     and j["comment"] == normalize and j["state"] == "RUNNING"), None)

    t0 = time.time()
    log = workdir / "first_run.txt"
    with open(log, "w") as fh, JobWatch() as watch:
        proc = subprocess.Popen(smk_cmd(workdir, *args), cwd=workdir, text=True, stdout=fh,
                                stderr=subprocess.STDOUT, env=clean_env())
        try:
            cancelled = []
            for attempt in (1, 2):  # retries: 1 -> the job is submitted a second time, then the run fails
                jid = wait_for(lambda: running_normalize(cancelled), 400, f"normalize's job, attempt {attempt}",
                               proc, log)
                sh("scancel", str(jid))
                cancelled.append(jid)
            proc.wait(timeout=300)
        finally:
            if proc.poll() is None:  # the test failed: stop snakemake and the jobs it submitted
                proc.kill()
                proc.wait()
                mine = [str(j) for j, job in slurm_jobs().items()
                        if j > last_job and job["state"] in ("PENDING", "RUNNING")]
                if mine:
                    sh("scancel", *mine, check=False)
    first = {"rc": proc.returncode, "out": log.read_text(), "cancelled": cancelled, "jobs": watch.jobs,
             "seconds": time.time() - t0}
    (workdir / "first_run.json").write_text(json.dumps(first))
    t0 = time.time()
    with JobWatch() as watch:
        proc = run_snakemake(workdir, *args)
    (workdir / "rerun.txt").write_text(proc.stdout)
    (workdir / "rerun_jobs.json").write_text(json.dumps(watch.jobs))
    print(f"SLURM: first run {first['seconds']:.1f} s, rerun {time.time() - t0:.1f} s")
    return workdir


@pytest.mark.slurm
def test_cancelled_job_fails_the_run_cleanly(slurm_run):
    first = json.loads((slurm_run / "first_run.json").read_text())
    out = first["out"]
    assert first["rc"] != 0, out
    assert "Error in rule normalize" in out and "CANCELLED" in out, out
    assert "dask.shared_cluster is ignored under a cluster executor" in out, out
    # the retry asked for twice the memory and time of the first attempt (rule_mem_mb, rule_runtime)
    a1, a2 = (first["jobs"][str(j)] for j in first["cancelled"])
    assert (a1["mem"], a2["mem"]) == ("2000M", "4000M"), (a1, a2)
    assert (a1["limit"], a2["limit"]) == ("10:00", "20:00"), (a1, a2)
    assert all(first["jobs"][str(j)]["state"] == "CANCELLED" for j in first["cancelled"])
    # the lock was released (no --unlock needed) and the rerun did not repeat finished stages
    rerun = rules_run((slurm_run / "rerun.txt").read_text())
    assert rerun[0] == "normalize" and {"log1p", "pca", "leiden", "plots", "final"} <= set(rerun), rerun
    assert not {"simulate", "qc", "filter"} & set(rerun), rerun


@pytest.mark.slurm
def test_every_stage_ran_as_a_slurm_job_sized_to_it(slurm_run):
    ids = {}
    for stage in STAGES:
        ran_on = summary(slurm_run, stage)["ran_on"]
        assert ran_on["slurm_job_id"], (stage, ran_on)
        ids[stage] = ran_on["slurm_job_id"]
        assert ran_on["host"] == socket.gethostname()
        # SLURM's own log of that job (kept: slurm-keep-successful-logs)
        assert (slurm_run / ".snakemake" / "slurm_logs" / f"rule_{stage}" / DATASET / f"{ids[stage]}.log").exists()
        if stage in CLUSTER_STAGES:
            # a local cluster of its own, sized to the allocation: 2 CPUs -> 2 one-thread workers,
            # the job's 2000 MB split between them (dask.memory_limit auto)
            assert ran_on["slurm_cpus_per_task"] == "2", ran_on
            assert len(ran_on["workers"]) == 2 and ran_on["threads"] == 2, ran_on
            assert ran_on["memory_limit"] == 2000 * 10**6, ran_on
    assert len(set(ids.values())) == len(STAGES)
    jobs = json.loads((slurm_run / "rerun_jobs.json").read_text())  # squeue's view during the resumed run
    for stage in ("normalize", "log1p", "final"):
        job = jobs[str(ids[stage])]
        assert job["state"] == "COMPLETED" and job["comment"] == f"rule_{stage}_wildcards_{DATASET}", job
        assert job["mem"] == "2000M"


@pytest.mark.slurm
def test_slurm_results_equal_the_local_run(slurm_run, reference):
    assert_same_as(slurm_run, reference)


@pytest.mark.slurm
def test_stage_attaches_to_the_sbatch_dask_cluster(slurm, slurm_run, reference, tmp_path):
    """hpc/dask_cluster.sbatch: a Dask cluster as a SLURM job; a stage attaches through its scheduler file."""
    sfile = tmp_path / "dask" / "scheduler.json"
    env = {**clean_env(), "ATLASFLOW_PYTHON": sys.executable}
    jid = sh("sbatch", "--parsable", "-p", slurm["partition"], "--nodes=1", "--cpus-per-task=2", "--mem=2000",
             "--time=10", f"--output={tmp_path}/dask-%j.log", "--chdir", str(tmp_path),
             str(ROOT / "hpc" / "dask_cluster.sbatch"), str(sfile), env=env).strip()  # sbatch passes env on
    try:
        wait_for(lambda: sfile.exists() and sfile.stat().st_size > 0, 120, "the scheduler file")
        address = json.loads(sfile.read_text())["address"]
        out = tmp_path / "log1p.zarr"
        proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "log1p.py"), "--input",
                               str(store(slurm_run, "normalize")), "--output", str(out), "--scheduler-file",
                               str(sfile)], text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=300, env=env)
        assert proc.returncode == 0, proc.stdout
        ran_on = json.loads(out.with_suffix(".json").read_text())["ran_on"]
        assert ran_on["scheduler"] == address
        assert len(ran_on["workers"]) == 2 and ran_on["memory_limit"] == 2 * 1000 * 2**20, ran_on  # 2000 MB / 2
        assert_same_store(out, store(reference, "log1p"))
    finally:
        sh("scancel", jid, check=False)
    # the job removes its scheduler file when cancelled, so nothing attaches to a dead scheduler later
    wait_for(lambda: not sfile.exists(), 60, "the scheduler file to be removed")
    wait_for(lambda: slurm_jobs().get(int(jid), {}).get("state") == "CANCELLED", 60, "the job to end")
