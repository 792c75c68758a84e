"""The Snakemake workflow, run through the ``snakemake`` CLI on a tiny simulated dataset.

Every run uses ``--snakefile workflow/Snakefile --directory <tmp>`` with a config file in the temporary
folder (the repository's config/config.yaml is not there, so only the tiny dataset exists), two cores,
and profiles/default as the workflow profile, exactly as a user's run from the repository root gets it.

To keep the file fast on a shared two-core machine, the stages attach to one Dask cluster started by
this module (``dask.address``) instead of starting one each (the default, exercised by the stage tests
and by `snakemake --cores 2` on the demo).
"""

from __future__ import annotations

import graphlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SNAKEFILE = ROOT / "workflow" / "Snakefile"
PROFILE = ROOT / "profiles" / "default"
STAGES = ["simulate", "qc", "filter", "normalize", "log1p"]
DATASET = "tiny"

pytestmark = pytest.mark.workflow

TINY_CONFIG = {
    "datasets": {
        DATASET: {
            "simulate": {"n_cells": 600, "n_genes": 300, "n_cell_types": 4, "seed": 7, "median_counts": 1500,
                         "frac_damaged": 0.05, "frac_empty": 0.05, "frac_doublets": 0.02},
            "chunk_rows": 200,
        }
    },
    "resources": {"default": {"threads": 2, "mem_mb": 2000, "runtime": 10}},
    # a gene list from resources/ (found in the repository although the run is elsewhere)
    "qc": {"gene_sets": {"mt": {"genes_file": "resources/gene_lists/human_mito.txt"}, "ribo": {"prefix": ["RPS", "RPL"]}},
           "percent_top": [20, 50]},
    # min_counts: the simulator's empty droplets have ~2 % of the median library, a few reach ~80 genes
    "filter": {"min_genes": 60, "max_genes": None, "min_counts": 250, "max_pct_mt": 15, "min_cells": 3},
}


# ------------------------------------------------------------------------------------------ helpers


def write_config(workdir: Path, config: dict, name: str = "config.yaml") -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / name
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def snakemake_cmd(workdir: Path, *args: str, configfiles=("config.yaml",)) -> list[str]:
    """The CLI call; targets may be among args (--configfile, which takes several values, comes last)."""
    return [
        sys.executable, "-m", "snakemake", "--snakefile", str(SNAKEFILE), "--directory", str(workdir),
        "--cores", "2", "--workflow-profile", str(PROFILE), *args,
        "--configfile", *[str(workdir / c) for c in configfiles],
    ]


def snakemake(workdir: Path, *args: str, configfiles=("config.yaml",), check: bool = True, timeout: float = 240):
    """Run snakemake; return its combined output (fail the test with that output when check and rc != 0)."""
    proc = subprocess.run(snakemake_cmd(workdir, *args, configfiles=configfiles), cwd=workdir, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"snakemake {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-6000:]}")
    return proc


@contextmanager
def workers_held(client, name: str, seconds: float):
    """Every Dask worker waits on the distributed Event `name` (at most `seconds`) until the block ends, so a
    stage that attaches meanwhile cannot finish its work."""
    from distributed import Event

    hold = Event(name, client=client)
    hold.clear()
    held = [client.submit(hold.wait, seconds, workers=[w], allow_other_workers=False, pure=False)
            for w in client.scheduler_info()["workers"]]
    try:
        yield
    finally:
        hold.set()
        client.gather(held)


def wait_attached(proc: subprocess.Popen, log: Path, timeout: float, what: str) -> None:
    """Wait until the stage that writes `log` has attached to the Dask cluster, `proc` (its snakemake) running."""
    deadline = time.time() + timeout
    while not (log.exists() and "attached to" in log.read_text()):
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline, f"{what} did not start"
        time.sleep(0.1)


def planned_jobs(workdir: Path, *args: str, configfiles=("config.yaml",)) -> dict[str, int]:
    """Jobs a dry run would execute, as {rule: count} (without the `all` target rule)."""
    out = snakemake(workdir, "--dry-run", *args, configfiles=configfiles).stdout
    if "Nothing to be done" in out:
        return {}
    table = re.search(r"Job stats:\n(.*?)\ntotal", out, re.S)
    assert table, out
    jobs = dict((m.group(1), int(m.group(2))) for m in re.finditer(r"^(\w+)\s+(\d+)\s*$", table.group(1), re.M))
    jobs.pop("all", None)
    return jobs


def results(workdir: Path, stage: str) -> Path:
    return workdir / "results" / DATASET / f"{stage}.zarr"


def assert_same_store(a_path: Path, b_path: Path) -> None:
    """Two stores hold the same AnnData: X bit for bit, obs and var equal."""
    import anndata as ad

    a, b = ad.read_zarr(a_path), ad.read_zarr(b_path)
    assert a.shape == b.shape
    pd.testing.assert_frame_equal(a.obs, b.obs)
    pd.testing.assert_frame_equal(a.var, b.var)
    assert a.X.dtype == b.X.dtype
    xa, xb = a.X.tocsr(), b.X.tocsr()
    np.testing.assert_array_equal(xa.indptr, xb.indptr)
    np.testing.assert_array_equal(xa.indices, xb.indices)
    np.testing.assert_array_equal(xa.data, xb.data)


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """The working directory of the full runs (the `built` fixture and the tests that use it)."""
    return tmp_path_factory.mktemp("workflow")


@pytest.fixture(scope="module")
def dask_address(workdir):
    """One two-worker cluster that the stages of this module attach to (saves a cluster start per stage).

    Its workers run in `workdir`: the stage scripts hand the workers store paths relative to the
    working directory (see the note on relative paths in config/README.md).
    """
    from distributed import Client, LocalCluster

    here = os.getcwd()
    os.chdir(workdir)
    try:
        cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                               memory_limit="2GB")
    finally:
        os.chdir(here)
    client = Client(cluster)
    yield cluster.scheduler_address, client
    client.close()
    cluster.close()


@pytest.fixture(scope="module")
def built(workdir, dask_address):
    """The whole workflow run once on the tiny dataset; reference copies of its stores kept aside."""
    write_config(workdir, {**TINY_CONFIG, "dask": {"address": dask_address[0]}})
    (workdir / "first_run.out").write_text(snakemake(workdir).stdout)  # what the terminal showed
    reference = workdir / "reference"
    for stage in [*STAGES, "final"]:
        shutil.copytree(results(workdir, stage), reference / f"{stage}.zarr")
    return workdir


# ------------------------------------------------------------------------------------------ quick checks


def test_lint_is_clean():
    """`snakemake --lint` from the repository root (its config, its default profile) finds nothing."""
    proc = subprocess.run([sys.executable, "-m", "snakemake", "--lint"], cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    assert proc.returncode == 0, proc.stdout
    assert "Lints for" not in proc.stdout, proc.stdout
    assert "profiles/default" in proc.stdout  # found without being named


def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for k, v in update.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        # schema errors: all reported at once, each naming its key
        ({"filter": {"min_gene": 5, "min_cells": 2.5}, "fliter": {"min_genes": 5},
          "normalize": {"target_sum": "lots"}, "backend": "tpu"},
         ["config.filter.min_gene: unknown key", "did you mean 'min_genes'", "config.fliter: unknown key",
          "did you mean 'filter'", "config.normalize.target_sum: 'lots' is not of type",
          "config.filter.min_cells: 2.5 is not of type 'integer'", "config.backend: 'tpu' is not one of"]),
        # dataset checks: a misspelled override, two sources for one dataset
        ({"datasets": {DATASET: {"overrides": {"filter": {"max_gene": 1}}},
                       "other": {"path": "x.h5", "sample_sheet": "s.tsv"}}},
         ["config.datasets.tiny.overrides.filter.max_gene: unknown key",
          "config.datasets.other: give exactly one of simulate, path, sample_sheet"]),
        ({"resources": {"nromalize": {"threads": 1}}},
         ["config.resources.nromalize: unknown stage (did you mean 'normalize'?)"]),
    ],
    ids=["schema", "datasets", "resources"],
)
def test_bad_config_names_the_key(tmp_path, change, expected):
    write_config(tmp_path, _merge(TINY_CONFIG, change))
    proc = snakemake(tmp_path, "--dry-run", check=False)
    assert proc.returncode != 0, proc.stdout
    for text in expected:
        assert text in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stdout


NAN, INF = float("nan"), float("inf")


def _own_stderr(proc) -> list[str]:
    """stderr without the line Snakemake prints before reading the Snakefile when it applies a profile."""
    lines = proc.stderr.splitlines()
    return lines[1:] if lines and lines[0].startswith(("Using workflow specific profile", "Using profiles")) else lines


@pytest.mark.parametrize(
    ("change", "first_line"),
    [
        ({"normalize": {"target_sum": -1}}, "config.normalize.target_sum: must be > 0, not -1"),
        ({"normalize": {"target_sum": 0}}, "config.normalize.target_sum: must be > 0, not 0"),
        ({"log1p": {"base": 1}}, "config.log1p.base: must not be 1"),
        ({"log1p": {"base": -2}}, "config.log1p.base: must be > 0, not -2"),
        ({"log1p": {"base": 0}}, "config.log1p.base: must be > 0, not 0"),
        ({"hvg": {"min_mean": 5, "max_mean": 3}},
         "config.hvg.min_mean (5) is above config.hvg.max_mean (3): no gene can pass both"),
        ({"hvg": {"min_disp": 2, "max_disp": 1}},
         "config.hvg.min_disp (2) is above config.hvg.max_disp (1): no gene can pass both"),
        ({"datasets": {DATASET: {"overrides": {"hvg": {"max_mean": 0.001}}}}},
         "config.hvg.min_mean (0.0125) is above config.datasets.tiny.overrides.hvg.max_mean (0.001)"),
        ({"leiden": {"resolution": NAN}}, "config.leiden.resolution: nan is not a finite number"),
        ({"leiden": {"resolutions": [0.5, INF]}}, "config.leiden.resolutions.1: inf is not a finite number"),
        ({"datasets": {DATASET: {"overrides": {"normalize": {"target_sum": NAN}}}}},
         "config.datasets.tiny.overrides.normalize.target_sum: nan is not a finite number"),
        ({"filter": {"min_genes": -5}}, "config.filter.min_genes: must be >= 0, not -5"),
        ({"filter": {"max_pct_mt": 200}}, "config.filter.max_pct_mt: must be <= 100, not 200"),
        ({"filter": {"min_genes": 500, "max_genes": 100}},
         "config.filter.min_genes (500) is above config.filter.max_genes (100): no cell can pass both"),
        ({"neighbors": {"n_neighbors": 1}}, "config.neighbors.n_neighbors: must be >= 2, not 1"),
        ({"neighbors": {"metric": "foo"}}, "config.neighbors.metric: 'foo' is not one of ['euclidean'"),
        ({"datasets": {"raw": {"path": "missing.h5"}}}, "config.datasets.raw.path: missing.h5 not found"),
    ],
    ids=["target_sum-1", "target_sum0", "base1", "base-2", "base0", "hvg_mean", "hvg_disp", "hvg_override",
         "resolution_nan", "resolutions_inf", "override_nan", "min_genes-5", "max_pct_mt200", "filter_genes",
         "n_neighbors1", "metric", "missing_path"],
)
def test_bad_value_is_one_line_first_on_stderr(tmp_path, change, first_line):
    """A bad number or name fails the dry run with one line naming the key, first on stderr (no Snakemake
    banner, no trace; Snakemake 9 writes a dry run's own log to stdout), non-zero, nothing written."""
    write_config(tmp_path, _merge(TINY_CONFIG, change))
    proc = subprocess.run(snakemake_cmd(tmp_path, "--dry-run"), cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = _own_stderr(proc)
    assert lines and lines[0].startswith(first_line), proc.stderr
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr and "Building DAG" not in proc.stdout, proc.stdout
    assert not (tmp_path / "results").exists()


def test_bad_sample_sheet_number_is_one_line(tmp_path):
    """A per-sample threshold out of bounds or infinite (NaN cells are empty cells) names its line and column."""
    (tmp_path / "a.h5").write_bytes(b"")
    (tmp_path / "samples.tsv").write_text("sample\tpath\tmin_genes\tmax_pct_mt\na\ta.h5\tinf\t150\n")
    write_config(tmp_path, _merge(TINY_CONFIG, {"datasets": {"sheet": {"sample_sheet": "samples.tsv"}}}))
    proc = subprocess.run(snakemake_cmd(tmp_path, "--dry-run"), cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert _own_stderr(proc) == [
        "config.datasets.sheet.sample_sheet: samples.tsv: line 2, column max_pct_mt: must be <= 100, not 150",
        "config.datasets.sheet.sample_sheet: samples.tsv: line 2, column min_genes: inf is not a finite number",
    ], proc.stderr


def test_null_target_sum_and_natural_log_stay_allowed(tmp_path):
    """normalize.target_sum null (the median) and log1p.base null (natural log) pass the new bounds."""
    write_config(tmp_path, _merge(TINY_CONFIG, {"normalize": {"target_sum": None}, "log1p": {"base": None}}))
    assert planned_jobs(tmp_path, f"results/{DATASET}/log1p.zarr") == {
        "simulate": 1, "qc": 1, "filter": 1, "normalize": 1, "log1p": 1}


def test_command_line_numbers_are_numbers(tmp_path):
    """`--config leiden='{resolution: 0.8}'` as Snakemake users write it (Snakemake keeps nested values as text)."""
    write_config(tmp_path, TINY_CONFIG)
    proc = snakemake(tmp_path, "--dry-run", "--config", "leiden={resolution: 0.8, resolutions: [0.5, 1]}",
                     "filter={max_pct_mt: 20, max_genes: null}")
    assert "leiden" in proc.stdout
    bad = subprocess.run(snakemake_cmd(tmp_path, "--dry-run", "--config", "leiden={resolution: lots}"), cwd=tmp_path,
                         text=True, capture_output=True)
    assert bad.returncode != 0 and "config.leiden.resolution" in bad.stderr, bad.stderr


def test_slurm_profile_placeholders_are_refused(tmp_path):
    """profiles/slurm as shipped (`<your-partition>`): one line first on stderr, before anything is submitted."""
    write_config(tmp_path, TINY_CONFIG)
    proc = subprocess.run(snakemake_cmd(tmp_path, "--dry-run", "--profile", str(ROOT / "profiles" / "slurm")),
                          cwd=tmp_path, text=True, capture_output=True, timeout=120)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    first = _own_stderr(proc)[0]
    assert first.startswith("default-resources: slurm_partition=") and "placeholder of profiles/slurm" in first, first
    assert not (tmp_path / "results").exists()


def test_slurm_executor_comes_with_a_plain_install():
    """Snakemake reads the profile's `executor: slurm` before our Snakefile, and without the plugin prints a
    100-line usage dump we cannot replace: so `pip install -e .` (README) installs the plugin."""
    from importlib.metadata import requires

    import snakemake_executor_plugin_slurm  # noqa: F401

    reqs = [r for r in requires("atlasflow") if r.startswith("snakemake-executor-plugin-slurm")]
    assert reqs and not any("extra ==" in r for r in reqs), reqs


def test_one_target_builds_only_what_it_needs(tmp_path):
    write_config(tmp_path, TINY_CONFIG)
    jobs = planned_jobs(tmp_path, f"results/{DATASET}/normalize.zarr")
    assert jobs == {"simulate": 1, "qc": 1, "filter": 1, "normalize": 1}


def planned_gpus(workdir: Path) -> dict[str, int]:
    """The `gpu` resource of every job of a dry run, by rule (0 where the job declares none)."""
    out = snakemake(workdir, "--dry-run").stdout
    jobs = re.findall(r"^rule (\w+):\n(?:    .*\n)*?    resources: (.*)$", out, re.M)
    assert jobs, out
    return {rule: int(dict(kv.split("=", 1) for kv in res.split(", ")).get("gpu", 0)) for rule, res in jobs}


def test_gpu_backend_gives_computing_stages_one_gpu_each(tmp_path):
    """backend gpu: every stage that computes asks for gpu=1 (SLURM --gpus=1; the local profile's budget);
    reading and plotting stages ask for none; backend cpu asks for no GPU at all."""
    write_config(tmp_path, {**TINY_CONFIG, "backend": "gpu"})
    gpus = planned_gpus(tmp_path)
    computing = {"qc", "filter", "normalize", "log1p", "hvg", "subset", "scale", "pca", "neighbors", "leiden",
                 "umap", "rank_genes_groups", "aggregate"}
    assert computing <= set(gpus), gpus
    assert {r for r, n in gpus.items() if n == 1} == computing, gpus
    assert all(n == 0 for r, n in gpus.items() if r not in computing), gpus
    write_config(tmp_path, TINY_CONFIG)
    assert not any(planned_gpus(tmp_path).values())
    local = yaml.safe_load((ROOT / "profiles" / "local" / "config.v8+.yaml").read_text())
    assert local["resources"]["gpu"] == 1  # one GPU job at a time on a workstation


def test_failing_stage_leaves_no_output(tmp_path, dask_address):
    """A stage that fails (here: the simulator rejects its parameters) leaves no store behind."""
    config = {**TINY_CONFIG, "datasets": {DATASET: {"simulate": {"n_genes": 100, "n_cell_types": 40}}},
              "dask": {"address": dask_address[0]}}
    write_config(tmp_path, config)
    proc = snakemake(tmp_path, check=False)
    assert proc.returncode != 0
    assert "Error in rule simulate" in proc.stdout
    assert "too few background genes" in proc.stdout  # the stage's one-line error, shown from its log
    assert not results(tmp_path, "simulate").exists()
    assert not (tmp_path / "results" / DATASET / "simulate.json").exists()


# ------------------------------------------------------------------------------------------ full runs


@pytest.mark.slow
def test_end_to_end_outputs(built):
    import anndata as ad

    stores = {stage: ad.read_zarr(results(built, stage)) for stage in STAGES}
    assert stores["simulate"].shape == (600, 300)
    assert stores["qc"].shape == (600, 300)
    assert {"total_counts", "n_genes_by_counts", "pct_counts_mt", "pct_counts_in_top_20_genes"} <= set(stores["qc"].obs)
    assert stores["qc"].var["mt"].sum() == 13  # the 13 MT- genes, matched through resources/gene_lists
    filtered = stores["filter"]
    assert 0 < filtered.n_obs < 600
    assert not filtered.obs["is_empty"].astype(bool).any()
    assert stores["normalize"].shape == filtered.shape == stores["log1p"].shape
    totals = np.asarray(stores["normalize"].X.sum(axis=1)).ravel()
    np.testing.assert_allclose(totals, 1e4, rtol=1e-4)
    np.testing.assert_allclose(stores["log1p"].X.toarray(), np.log1p(stores["normalize"].X.toarray()), rtol=1e-6)
    for stage in STAGES:
        summary = json.loads((built / "results" / DATASET / f"{stage}.json").read_text())
        assert summary["stage"] == stage
        assert "done in" in (built / "logs" / DATASET / f"{stage}.log").read_text()
        assert (built / "logs" / DATASET / f"{stage}.benchmark.tsv").exists()
    assert json.loads((built / "results" / DATASET / "filter.json").read_text())["cells_out"] == filtered.n_obs
    # the rest of the chain, to the final store, the figures and the marker table
    final = ad.read_zarr(results(built, "final"))
    assert final.shape == filtered.shape
    assert {"X_pca", "X_umap"} <= set(final.obsm) and "leiden" in final.obs and "counts" in final.layers
    assert "rank_genes_groups" in final.uns
    # pca computed from subset's sparse matrix, scaled on the fly, not from scale's dense X
    assert "from the sparse matrix X was scaled from" in (built / "logs" / DATASET / "pca.log").read_text()
    assert (built / "results" / DATASET / "rank_genes_groups.csv").stat().st_size > 0
    assert len(list((built / "results" / DATASET / "plots").glob("*.png"))) >= 5
    # the terminal shows the stages' own lines: no zarr warning blocks about uns arrays
    # (rank_genes_groups' structured arrays), no traceback
    shown = (built / "first_run.out").read_text()
    assert "Warning" not in shown and "Traceback" not in shown, shown


def test_summaries_count_passes_over_x(built):
    """Each stage's summary says how often it read each stored matrix: the streaming stages' known passes."""
    expected = {"qc": {"simulate/X": 1}, "filter": {"qc/X": 2}, "normalize": {"filter/X": 1},
                "log1p": {"normalize/X": 1}, "subset": {"hvg/X": 1}, "scale": {"subset/X": 2}}
    got = {stage: json.loads((built / "results" / DATASET / f"{stage}.json").read_text())["passes"]
           for stage in expected}
    assert got == expected


def busy_threads(out: str) -> int:
    """The most threads that a run's jobs held at once, from Snakemake's job start and finish lines."""
    running, most = {}, 0
    for m in re.finditer(r"^(?:local)?rule (\w+):\n((?:    .*\n)*)|^Finished jobid: (\d+)", out, re.M):
        if m.group(3):
            running.pop(m.group(3))
            continue
        jobid = re.search(r"^    jobid: (\d+)$", m.group(2), re.M).group(1)
        threads = re.search(r"^    threads: (\d+)$", m.group(2), re.M)
        running[jobid] = int(threads.group(1)) if threads else 1
        most = max(most, sum(running.values()))
    return most


def test_jobs_never_hold_more_threads_than_cores(built):
    """Two 2-thread stages never run side by side on --cores 2: each stage's memory budget assumes it runs
    alone. Snakemake 9.10 to 9.16 gave a lone job's threads back without having taken them, so after
    neighbors umap and leiden ran together (7 threads at once on the tiny run); 9.17 is the floor."""
    shown = (built / "first_run.out").read_text()
    assert re.search(r"^    threads: 2$", shown, re.M), shown  # the parser sees the stages' threads
    assert busy_threads(shown) == 2


@pytest.mark.slow
def test_rerun_does_nothing(built):
    proc = snakemake(built)
    assert "Nothing to be done" in proc.stdout


@pytest.mark.slow
def test_changed_parameter_reruns_its_stage_and_downstream(built):
    write_config(built, {"filter": {"min_genes": 70}}, "changed.yaml")
    jobs = planned_jobs(built, configfiles=("config.yaml", "changed.yaml"))
    assert {"filter", "normalize", "log1p", "pca", "final"} <= set(jobs)
    assert not {"simulate", "qc"} & set(jobs)
    # a dataset override of a later stage's key re-runs from that stage on
    write_config(built, {"datasets": {DATASET: {"overrides": {"normalize": {"target_sum": 5000}}}}}, "override.yaml")
    jobs = planned_jobs(built, configfiles=("config.yaml", "override.yaml"))
    assert {"normalize", "log1p", "final"} <= set(jobs)
    assert not {"simulate", "qc", "filter"} & set(jobs)
    # the DAG follows the data: umap reads the graph, not the labels, so a new resolution leaves it alone
    write_config(built, {"leiden": {"resolution": 0.7}}, "resolution.yaml")
    jobs = planned_jobs(built, configfiles=("config.yaml", "resolution.yaml"))
    assert {"leiden", "rank_genes_groups", "plots", "final"} <= set(jobs), jobs
    assert not {"neighbors", "umap"} & set(jobs), jobs
    write_config(built, {"neighbors": {"n_neighbors": 7}}, "graph.yaml")
    jobs = planned_jobs(built, configfiles=("config.yaml", "graph.yaml"))
    assert {"neighbors", "leiden", "umap", "final"} <= set(jobs), jobs


@pytest.mark.slow
def test_harmony_enabled_runs_between_pca_and_neighbors(built):
    """harmony.enabled adds the harmony stage after pca; neighbors then reads its store and embedding, so the
    graph and everything after it re-run, and nothing before."""
    write_config(built, {"harmony": {"enabled": True, "key": ["cell_type"]}}, "harmony.yaml")
    jobs = planned_jobs(built, configfiles=("config.yaml", "harmony.yaml"))
    assert {"harmony", "neighbors", "leiden", "umap", "final"} <= set(jobs), jobs
    assert not {"simulate", "qc", "filter", "pca"} & set(jobs), jobs
    dry = snakemake(built, "--dry-run", configfiles=("config.yaml", "harmony.yaml")).stdout
    assert re.search(r"rule neighbors:\n\s+input: results/tiny/harmony.zarr", dry), dry


@pytest.mark.slow
def test_scrublet_enabled_runs_between_qc_and_filter(built):
    """scrublet.enabled adds the scrublet stage after qc; filter then reads its store, so filter and every
    stage after it re-run, and nothing before."""
    write_config(built, {"scrublet": {"enabled": True, "batch_key": None}, "filter": {"drop_doublets": True}},
                 "scrublet.yaml")
    jobs = planned_jobs(built, configfiles=("config.yaml", "scrublet.yaml"))
    assert {"scrublet", "filter", "normalize", "final"} <= set(jobs), jobs
    assert not {"simulate", "qc"} & set(jobs), jobs
    dry = snakemake(built, "--dry-run", configfiles=("config.yaml", "scrublet.yaml")).stdout
    assert re.search(r"rule filter:\n\s+input: results/tiny/scrublet.zarr", dry), dry
    assert re.search(r"rule scrublet:\n\s+input: results/tiny/qc.zarr", dry), dry


@pytest.mark.slow
def test_execution_settings_do_not_rerun(built):
    """Where a stage computes (cluster, workers, memory, chunking, threads) does not re-run finished stages."""
    write_config(built, {"dask": {"address": None, "n_workers": 1, "memory_limit": "1GB"}, "chunk_rows": 50,
                         "resources": {"default": {"threads": 1, "mem_mb": 1000}}}, "execution.yaml")
    assert planned_jobs(built, configfiles=("config.yaml", "execution.yaml")) == {}


def rules_run(output: str) -> list[str]:
    """Rules of the jobs a snakemake run executed (from its output), in order."""
    return re.findall(r"^\s*(?:local)?rule (\w+):", output, re.M)


@pytest.mark.slow
def test_deleted_stage_reruns_alone(built):
    """Deleting the last store re-runs that stage only, with the same result."""
    shutil.rmtree(results(built, "final"))
    proc = snakemake(built)
    assert rules_run(proc.stdout) == ["final", "all"], proc.stdout
    assert_same_store(results(built, "final"), built / "reference" / "final.zarr")


def test_concurrent_run_is_refused(tmp_path, dask_address):
    """A second snakemake on the same results folder while one runs is refused by Snakemake's lock."""
    address, client = dask_address
    write_config(tmp_path, {**TINY_CONFIG, "dask": {"address": address}})
    target = f"results/{DATASET}/qc.zarr"
    log = tmp_path / "logs" / DATASET / "qc.log"
    first = None
    try:
        # both workers held: the first run's qc stage cannot finish while the second run starts
        with workers_held(client, "atlasflow-test-hold-lock", 180):
            first = subprocess.Popen(snakemake_cmd(tmp_path, target), cwd=tmp_path, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
            wait_attached(first, log, 150, "the first run's qc stage")
            second = snakemake(tmp_path, target, check=False)
            assert second.returncode != 0
            assert "cannot be locked" in second.stdout, second.stdout
        assert first.wait(timeout=180) == 0, first.stdout.read()
    finally:
        if first is not None and first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)


@pytest.mark.slow
def test_report_builds_with_every_figure(built):
    """`snakemake --report` on the finished run: an HTML report holding every figure and the marker table."""
    import zipfile

    report = built / "report.zip"
    snakemake(built, "--report", str(report))
    names = zipfile.ZipFile(report).namelist()
    pngs = {Path(n).name for n in names if n.endswith(".png")}
    expected = {"qc_violin.png", "highest_expr_genes.png", "hvg.png", "pca_variance_ratio.png", "pca.png",
                "umap.png", "cluster_sizes.png", "marker_dotplot.png", "marker_heatmap.png"}
    assert expected <= pngs, sorted(pngs)
    assert any(n.endswith("markers.csv") for n in names), names
    for png in sorted((built / "results" / DATASET / "plots").glob("*.png")):
        from matplotlib.image import imread

        img = imread(png)
        assert img.shape[0] > 100 and img.shape[1] > 100 and img.std() > 0, png


# ------------------------------------------------------------------------------------------ shared with test_kill, test_slurm


def stage_outputs(workdir: Path, *targets: str) -> dict[str, list[Path]]:
    """{rule: its output files and folders} of the stage rules (those writing a JSON summary), in build order."""
    out = snakemake(workdir, "--summary", *targets).stdout
    rows = [line.split("\t") for line in out.splitlines()[1:] if line.count("\t") >= 5]
    by_rule: dict[str, list[Path]] = {}
    for row in rows:
        by_rule.setdefault(row[2], []).append(workdir / row[0])
    stages = {rule: paths for rule, paths in by_rule.items() if any(p.suffix == ".json" for p in paths)}
    # build order from the stores each summary says its stage read (mtimes follow the earlier reruns instead)
    owner = {os.path.realpath(p): rule for rule, paths in stages.items() for p in paths if p.suffix == ".zarr"}
    needs = {}
    for rule, paths in stages.items():
        summary = next(p for p in paths if p.suffix == ".json")
        read = json.loads(summary.read_text()).get("input_stores") or {}
        paths_read = {os.path.realpath(workdir / e["path"]) for e in read.values()}  # relative to the workdir
        needs[rule] = {owner[p] for p in paths_read if p in owner} - {rule}
    return {rule: stages[rule] for rule in graphlib.TopologicalSorter(needs).static_order()}


def same_bits(a: Path, b: Path) -> None:
    """Two outputs are identical file by file; in Zarr metadata only atlasflow's random store_id may differ."""
    if a.is_file():
        assert a.read_bytes() == b.read_bytes(), f"{a} differs from {b}"
        return
    def listing(root: Path) -> list[Path]:  # without Snakemake's .snakemake_timestamp of directory() outputs
        return sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file() and p.name != ".snakemake_timestamp")

    files = listing(a)
    assert files == listing(b), f"{a}: other files than {b}"

    def strip(obj):
        if isinstance(obj, dict):
            return {k: strip(v) for k, v in obj.items() if k != "store_id"}
        return [strip(v) for v in obj] if isinstance(obj, list) else obj

    for rel in files:
        x, y = (a / rel).read_bytes(), (b / rel).read_bytes()
        if rel.name == "zarr.json":
            assert strip(json.loads(x)) == strip(json.loads(y)), f"{a / rel} differs"
        else:
            assert x == y, f"{a / rel} differs from {b / rel}"


MIXOLOGY = ROOT.parent / "shared" / "data" / "mixology_5cl"


@pytest.mark.slow
@pytest.mark.skipif(not MIXOLOGY.is_dir(), reason="needs ../shared/data/mixology_5cl beside the repository")
def test_three_real_plates_from_one_sample_sheet_to_the_final_store(tmp_path):
    """The mixology plates (gzipped genes x cells CSV, genes by Ensembl id, ERCC spike-ins, different gene
    sets) from one sample sheet through the whole workflow with the shipped defaults except plate-sized
    thresholds: mitochondrial genes found by id, spike-ins out of the totals and the HVGs, the union of
    genes, Scrublet per plate with its doublets dropped, Harmony over the plates before the graph, and Leiden
    recovering the five cell lines (genotype truth) on the singlets."""
    import anndata as ad
    from sklearn.metrics import adjusted_rand_score

    plates = [f"sc_celseq2_5cl_p{i}" for i in (1, 2, 3)]
    sheet = tmp_path / "plates.tsv"
    sheet.write_text("sample\tpath\tprotocol\n" + "".join(f"p{i}\t{MIXOLOGY / p}.count.csv.gz\tCEL-seq2\n"
                                                          for i, p in enumerate(plates, 1)))
    write_config(tmp_path, {
        "datasets": {"mix": {"sample_sheet": str(sheet)}},
        "resources": {"default": {"threads": 2, "mem_mb": 3000, "runtime": 20}},
        # deep plate data: no upper gene limit; every well has ~10% mitochondrial reads
        "leiden": {"resolution": 0.5},
        "harmony": {"enabled": True, "key": ["sample"]},  # the plates are batches
        "scrublet": {"enabled": True},  # per plate (obs sample), its doublets dropped by filter
        "filter": {"max_genes": None, "max_pct_mt": None, "drop_doublets": True},
    })
    out = snakemake(tmp_path, timeout=900).stdout
    assert "Traceback" not in out
    results = tmp_path / "results" / "mix"
    ingest = json.loads((results / "ingest.json").read_text())
    assert ingest["genes_out"] == 16074 and ingest["cells_out"] == 909
    assert sum(ingest["genes_missing"].values()) > 0
    qc = json.loads((results / "qc.json").read_text())
    assert qc["gene_set_sizes"]["mt"] == 13 and qc["gene_set_sizes"]["ercc"] > 30
    assert json.loads((results / "normalize.json").read_text())["genes_excluded_from_totals"] > 30
    hvg = ad.read_zarr(results / "hvg.zarr")
    assert not hvg.var.loc[hvg.var["ercc"].astype(bool), "highly_variable"].any()
    scrublet = json.loads((results / "scrublet.json").read_text())
    assert set(scrublet["per_sample"]) == {"p1", "p2", "p3"} and not scrublet["samples_skipped"]
    assert json.loads((results / "filter.json").read_text())["removed_by"]["predicted_doublet"] > 0
    assert json.loads((results / "harmony.json").read_text())["batches"] == {"sample": 3}
    mixing = pd.read_csv(results / "leiden.metrics.csv").set_index("key")
    assert mixing.loc["sample", "metric"] == "iLISI (graph, median)" and mixing.loc["sample", "best"] == 3
    print(f"graph iLISI of the plates after harmony: {mixing.loc['sample', 'value']}")
    assert mixing.loc["sample", "value"] > 1.5  # the plates mix on the corrected graph
    assert (tmp_path / "results" / "mix" / "report" / "integration_metrics.csv").exists()
    # the before/after figure: the uncorrected graph (X_pca) and its UMAP, beside the integrated ones
    from atlasflow.tl.metrics import graph_lisi

    before = ad.read_zarr(results / "neighbors_uncorrected.zarr")
    assert before.uns["neighbors"]["params"]["use_rep"] == "X_pca"
    ilisi_before = float(np.median(graph_lisi(before.obsp["distances"], before.obs["sample"])))
    print(f"graph iLISI of the plates before harmony: {ilisi_before}")
    assert ilisi_before < mixing.loc["sample", "value"]  # harmony mixes the plates
    assert "X_umap" in ad.read_zarr(results / "umap_uncorrected.zarr").obsm
    assert (results / "plots" / "umap_batch.png").stat().st_size > 10_000
    final = ad.read_zarr(results / "final.zarr")
    assert {"X_pca", "X_pca_harmony", "X_umap"} <= set(final.obsm)  # both embeddings kept
    assert final.uns["neighbors"]["params"]["use_rep"] == "X_pca_harmony"  # the graph is on the corrected one
    assert (final.obs["pct_counts_mt"] > 0).all()
    assert list(final.obs["sample"].cat.categories) == ["p1", "p2", "p3"]
    # every plate names its wells p1_A1 ...: the sample prefix ingest adds keeps them apart
    truth = pd.concat([pd.read_csv(MIXOLOGY / f"{p}.metadata.csv.gz", index_col=0).rename(index=f"p{i}_{{}}".format)
                       for i, p in enumerate(plates, 1)])
    truth = truth.loc[final.obs_names]
    singlets = (truth["demuxlet_cls"] == "SNG").to_numpy()
    ari = adjusted_rand_score(truth["cell_line_demuxlet"][singlets], final.obs["leiden"][singlets])
    assert ari >= 0.9, ari  # scanpy on the same plates (README of the data): 1.00 on singlets
