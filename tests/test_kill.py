"""Killed stages: SIGKILL or Ctrl-C at any moment of a stage leaves nothing half-written, and the next run makes
the results one consistent run again, bit-identical to an uninterrupted one (README, "Re-running and resuming").

The same tiny workflow and shared Dask cluster as test_workflow.py (its fixtures, imported: this module builds
its own run). A file of its own so that pytest-xdist runs it beside test_workflow.py: each is ~10 minutes.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from test_workflow import (  # noqa: F401  (built, dask_address, workdir: fixtures of this module too)
    DATASET,
    TINY_CONFIG,
    assert_same_store,
    built,
    dask_address,
    planned_jobs,
    results,
    rules_run,
    same_bits,
    snakemake,
    snakemake_cmd,
    stage_outputs,
    wait_attached,
    workdir,
    workers_held,
    write_config,
)

pytestmark = pytest.mark.workflow


KILL_SEED = int(os.environ.get("ATLASFLOW_KILL_SEED", "20261201"))


def kill_normalize(built: Path, client, sig: signal.Signals, *, later_stores_stay: bool) -> str:
    """`snakemake --forcerun normalize`, the whole snakemake process group killed by `sig` (SIGKILL, or SIGINT as
    Ctrl-C sends it) while normalize runs: nothing of normalize is accepted. `later_stores_stay`: the stores
    after it, from the earlier run, are still in place (until the next run moves them aside as stale).
    Returns what `snakemake --unlock` printed (SIGKILL: the lock stays) or ""."""
    log = built / "logs" / DATASET / "normalize.log"
    log.unlink(missing_ok=True)
    # both workers held: the stage, once attached, cannot finish before it is killed
    with workers_held(client, "atlasflow-test-hold", 120):
        # Ctrl-C's default action, as a terminal starts snakemake: a runner that started pytest in the background
        # (`cmd &` in a script) passes SIGINT on as ignored, and snakemake and the stage would never see it
        proc = subprocess.Popen(snakemake_cmd(built, "--forcerun", "normalize"), cwd=built, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            wait_attached(proc, log, 120, "the normalize stage")
            time.sleep(1.0)  # the stage has submitted its work by now
            assert proc.poll() is None
            os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:  # say where it hung
                tree = subprocess.run(["ps", "-o", "pid,ppid,stat,etime,args", "-g", str(proc.pid)],
                                      capture_output=True, text=True).stdout
                os.killpg(proc.pid, signal.SIGKILL)
                pytest.fail(f"snakemake still ran 60 s after {sig.name}\nits processes:\n{tree}\n"
                            f"its output:\n{proc.stdout.read()[-3000:]}\nnormalize.log:\n{log.read_text()[-3000:]}")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    store = results(built, "normalize")
    assert not (store / "zarr.json").exists() and not (store / "X").exists(), sig  # nothing that looks complete
    assert not (built / "results" / DATASET / "normalize.json").exists(), sig
    assert results(built, "log1p").exists() == later_stores_stay, sig
    if sig == signal.SIGKILL:  # a SIGKILLed snakemake cannot remove its lock
        return snakemake(built, "--unlock").stdout
    return ""


@pytest.mark.slow
def test_killed_or_missing_stage_is_rebuilt_with_what_follows(built, dask_address):
    """normalize killed while it runs (SIGKILL) leaves no store of its own, as if it were deleted, and the later
    stores of the earlier run stay. The next plain run rebuilds normalize and every store computed from it
    (computed from a store that is gone), identical to the uninterrupted run, and nothing before it; asked for
    alone, normalize is rebuilt alone. Killed once more while it is rebuilt, by SIGINT (Ctrl-C), the same holds.
    (One rebuild for the three cases: each rebuild is a whole run's worth of stages.)"""
    _, client = dask_address
    unlocked = kill_normalize(built, client, signal.SIGKILL, later_stores_stay=True)
    # the next snakemake command (here the --unlock a user runs) says what it moves aside and why
    assert "log1p.json was computed from results/tiny/normalize.zarr, which is missing" in unlocked, unlocked
    shutil.rmtree(results(built, "normalize"), ignore_errors=True)  # deleted: the same state
    assert planned_jobs(built, f"results/{DATASET}/normalize.zarr") == {"normalize": 1}
    jobs = planned_jobs(built)
    assert {"normalize", "log1p", "hvg", "pca", "neighbors", "leiden", "final"} <= set(jobs), jobs
    assert not {"simulate", "qc", "filter"} & set(jobs), jobs
    kill_normalize(built, client, signal.SIGINT, later_stores_stay=False)  # its run moved the stale ones aside
    assert planned_jobs(built) == jobs
    proc = snakemake(built)
    ran = rules_run(proc.stdout)
    assert ran[0] == "normalize" and {"log1p", "pca", "leiden", "final"} <= set(ran), proc.stdout
    assert not {"simulate", "qc", "filter"} & set(ran), proc.stdout
    for stage in ("normalize", "log1p", "final"):
        assert_same_store(results(built, stage), built / "reference" / f"{stage}.zarr")
    assert planned_jobs(built) == {}  # one consistent run again


def _targets(workdir: Path, outputs: list[Path]) -> list[str]:
    return [str(o.relative_to(workdir)) for o in outputs]


def _temporaries(outputs: list[Path]) -> list[Path]:
    return [t for o in outputs for t in o.parent.glob(f".{o.name}.tmp-*")]


def _wait_idle(client, timeout: float = 60) -> None:
    """Until the shared cluster has no task left (a killed stage's running tasks finish or are released)."""
    deadline = time.time() + timeout
    while client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.tasks)) > 0:
        assert time.time() < deadline, "tasks of the killed stage are still on the cluster"
        time.sleep(0.2)


def kill_while_writing(workdir: Path, outputs: list[Path], rng, client) -> float:
    """Run the stage building `outputs`; SIGKILL snakemake and the stage at a random moment of its writing.

    Writing starts when a temporary sibling of an output appears; the kill comes a random 0-`window` s
    later. If the stage finished first, try again with a shorter window (the last try kills at once).
    Returns the delay used.
    """
    for window in (0.3, 0.05, 0.0):
        delay = float(rng.uniform(0, window))
        proc = subprocess.Popen(snakemake_cmd(workdir, *_targets(workdir, outputs)), cwd=workdir, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.time() + 180
            while not _temporaries(outputs) and proc.poll() is None:
                assert time.time() < deadline, "the stage never started writing"
                time.sleep(0.005)
            time.sleep(delay)
            finished = proc.poll() is not None
            if not finished:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        _wait_idle(client)
        # what `snakemake --unlock` does (tested above), without its few seconds of workflow parsing
        shutil.rmtree(workdir / ".snakemake" / "locks", ignore_errors=True)
        if not finished:
            return delay
        assert all(o.exists() for o in outputs), proc.stdout.read()[-4000:]
        for o in outputs:  # finished before the kill: start again from nothing
            shutil.rmtree(o) if o.is_dir() else o.unlink()
    pytest.fail("the stage always finished before it could be killed")


def check_kill_anywhere(workdir: Path, rule: str, outputs: list[Path], rng, client) -> None:
    """SIGKILL one stage while it writes; its rerun alone rebuilds outputs equal to the uninterrupted run's."""
    reference = workdir / "kill-reference" / rule
    kept = [o for o in outputs if o.suffix != ".json"]  # the JSON summary holds timings
    for o in [o for o in outputs if o.exists()]:  # the uninterrupted run's outputs become the reference
        dest = reference / o.relative_to(workdir)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.rename(o, dest)
    started = time.time()
    delay = kill_while_writing(workdir, outputs, rng, client)
    print(f"{rule}: killed {delay:.3f} s into writing ({time.time() - started:.0f} s)")
    for o in kept:  # what the killed run left in place is complete and right, or absent
        if o.exists():
            same_bits(o, reference / o.relative_to(workdir))
    assert not all(o.exists() for o in outputs), f"{rule} was killed {delay:.3f} s into writing yet finished"
    # a plain run would rebuild it, although what follows it exists from the earlier run
    assert rule in planned_jobs(workdir), f"a plain run would not rebuild the killed {rule}"
    proc = snakemake(workdir, *_targets(workdir, outputs))
    assert rules_run(proc.stdout) == [rule], proc.stdout
    for o in kept:
        same_bits(o, reference / o.relative_to(workdir))
    assert not _temporaries(outputs), _temporaries(outputs)
    shutil.rmtree(reference)


# The stages killed while they write: one per way of writing an output. Every other stage writes its store
# through the same store.write_store -> store.commit.atomic_dir as one of these (qc .. scale as normalize,
# leiden and umap as pca); killing each of ~17 stages took 14 minutes of CI's 90.
KILLED_STAGES = {
    "simulate": "the simulated counts (simulate.write_simulated)",
    "normalize": "a store streamed from dask row blocks (X written block by block)",
    "pca": "a store whose new parts are in memory (obsm, varm, uns) beside the input's X",
    "neighbors": "sparse obsp graphs",
    "rank_genes_groups": "a store and the marker CSV beside it (write_csv_atomic)",
    "aggregate": "CSV tables only",
    "plots": "PNG figures",
    "final": "the assembled final store",
}


@pytest.mark.slow
def test_kill_any_stage_while_it_writes(built, dask_address):
    """Each way a stage writes (KILLED_STAGES), SIGKILLed at a random moment of its writing, is redone alone
    and bit-identical.

    The stages go from the last to the first: a rebuilt store has a new store_id, so what was computed from
    it is stale (rules/consistency.smk) and is moved aside by the next run; going backwards, each stage is
    killed while its inputs are still the uninterrupted run's. At the end one plain run rebuilds every stale
    stage (all but simulate), final.zarr equals the reference, and then nothing is left to do.
    """
    _, client = dask_address
    rng = np.random.default_rng(KILL_SEED)
    stages = stage_outputs(built)
    assert {"simulate", "qc", "filter", "normalize", "log1p", "hvg", "subset", "scale", "pca", "neighbors",
            "leiden", "umap", "rank_genes_groups", "aggregate", "plots", "final"} <= set(stages), stages
    assert list(stages)[0] == "simulate" and list(stages).index("final") > list(stages).index("umap"), list(stages)
    for rule, outputs in reversed(stages.items()):
        if rule in KILLED_STAGES:
            check_kill_anywhere(built, rule, outputs, rng, client)
    jobs = planned_jobs(built)
    assert set(stages) - {"simulate"} <= set(jobs) and "simulate" not in jobs, jobs
    snakemake(built)
    assert_same_store(results(built, "final"), built / "reference" / "final.zarr")
    assert planned_jobs(built) == {}


@pytest.mark.slow
def test_kill_ingest_while_it_writes(built, dask_address, tmp_path):
    """The ingest stage (a dataset read from an .h5ad file), killed while it writes, likewise."""
    import anndata as ad

    _, client = dask_address
    ad.read_zarr(results(built, "simulate")).write_h5ad(tmp_path / "counts.h5ad")
    write_config(tmp_path, {**TINY_CONFIG, "datasets": {"file": {"path": str(tmp_path / "counts.h5ad"), "chunk_rows": 200}},
                            "dask": {"address": dask_address[0]}})
    snakemake(tmp_path, "results/file/ingest.zarr")
    stages = {r: o for r, o in stage_outputs(tmp_path, "results/file/ingest.zarr").items() if r == "ingest"}
    assert list(stages) == ["ingest"], stages
    check_kill_anywhere(tmp_path, "ingest", stages["ingest"], np.random.default_rng(KILL_SEED), client)
