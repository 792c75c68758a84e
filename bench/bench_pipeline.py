#!/usr/bin/env python
"""Benchmark: the whole pipeline, staged through Snakemake, fused in one process, and scanpy in memory.

What it does, for each ``--sizes`` N (cells x ``--n-genes`` genes, the built-in simulator, ~2,000 non-zeros
per cell at 20,000 genes):

1. **staged**: ``snakemake`` runs the real workflow on a simulated dataset (its ``simulate`` stage makes the
   counts, timed but not compared), with the parameters below, then the ``rank_genes_groups`` script once
   more with ``--method wilcoxon`` (the workflow's default is the t-test). Stages attach to the shared
   cluster the workflow starts (its default for local runs).
2. **fused**: one Python process with one local cluster runs the same stages through the package's functions
   on the simulated raw store, lazily, writing only the final store (no intermediate stores, no process or
   cluster start per stage).
3. **scanpy**: one process reads the same raw store into memory and runs scanpy's functions with the same
   parameters; only up to ``--scanpy-max-cells`` (its copies of a 1M x 20k matrix do not fit in 24 GB).
4. **scanpy_dask**: scanpy's own Dask support: X opened lazily with ``anndata.experimental.read_elem_lazy``
   (CSR row chunks of ``--chunk-rows``) on a local cluster like the fused run's; qc, filter, normalize,
   log1p, hvg, subset, scale and pca (``svd_solver="covariance_eigh"``, scanpy's Dask-native solver; its
   default needs dask-ml) run on the Dask array, then neighbors, leiden and umap on the computed X_pca in
   memory. scanpy 1.11's rank_genes_groups does not take a Dask X: the markers steps are tried, and the
   table says why they did not run.

Parameters (all three): qc with the ``MT-`` gene set, percent_top 50/100/200/500; filter min_genes 200,
max_pct_mt 20, min_cells 3; normalize_total 1e4; log1p; hvg seurat 2,000 genes; subset; scale max_value 10;
pca 50 comps; neighbors 15; leiden (igraph, 2 iterations, resolution 1); umap; rank_genes_groups t-test and
wilcoxon by leiden.

What it measures
    Per step: wall time; peak memory summed over every process (the Snakemake tree plus the shared
    cluster's scheduler and workers; the fused or scanpy process and its children), sampled every 0.2 s;
    bytes read and written through system calls (``read_chars``/``write_chars`` of ``/proc/<pid>/io``: file
    reads served from the page cache count, socket traffic between Dask processes does not). A sample is
    charged to the stage scripts running at that moment (staged) or the step being timed (fused, scanpy).
    Staged, also each stage's passes over the stored matrices it read (``passes`` of its JSON summary:
    block reads over blocks, counted from the task graphs it computed).

Output
    ``bench/results/pipeline.md`` and ``pipeline.json`` (``--results``): one table per size with every
    mode and the ratios atlasflow / scanpy and staged / fused, the machine, and ``pipeline.png``: wall time
    and peak memory against the number of cells. ``--memory-limit`` caps each worker (staged and fused):
    with X's uncompressed size at least 4x the workers' total, a completed run shows that the data need not
    fit in memory.

Usage
    python bench/bench_pipeline.py --sizes 10000 100000
    python bench/bench_pipeline.py --sizes 1000000 --modes staged fused --memory-limit 1.5GB
    python bench/bench_pipeline.py --smoke --results /tmp/r    # seconds: checks that it runs (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_foundation import MiB, fresh_workdir, machine  # noqa: E402

MODES = ("staged", "fused", "scanpy", "scanpy_dask")
STEPS = ["qc", "filter", "normalize", "log1p", "hvg", "subset", "scale", "pca", "neighbors", "leiden", "umap",
         "markers_ttest", "markers_wilcoxon"]
#: Steps on the in-memory embedding and graph (scanpy's own libraries): their memory grows with the cells.
GRAPH_STEPS = ("neighbors", "leiden", "umap")
#: Stage scripts of the staged run that are not steps of the comparison (reported apart).
OTHER_STAGES = ["simulate", "aggregate", "plots", "final", "report_table_markers", "report_table_pseudobulk_sum"]
PARAMS = {
    "qc": {"gene_sets": {"mt": {"prefix": "MT-"}}, "percent_top": [50, 100, 200, 500]},
    "filter": {"min_genes": 200, "max_genes": None, "max_pct_mt": 20, "min_cells": 3},
    "normalize": {"target_sum": 10000},
    "hvg": {"flavor": "seurat", "n_top_genes": 2000},
    "scale": {"max_value": 10},
    "pca": {"n_comps": 50},
    "neighbors": {"n_neighbors": 15},
    "leiden": {"resolution": 1.0, "n_iterations": 2, "flavor": "igraph"},
}


# ---------------------------------------------------------------------------------------------- sampling


class Sampler(threading.Thread):
    """Summed RSS and syscall I/O of a process tree (plus a shared cluster's), charged to the running step.

    ``step_of()`` names the step(s) running now; for the staged run, ``None`` makes the sampler read them
    from the command lines of the Snakemake job scripts (``.snakemake/scripts/tmpXXXX.<rule>.py``).
    """

    def __init__(self, root: int, pids_file: Path | None = None, step_of=None, period: float = 0.2):
        super().__init__(daemon=True)
        self.root, self.pids_file, self.step_of, self.period = root, pids_file, step_of, period
        self.peak_total = 0
        self.peak = {}  # step -> peak summed RSS
        self.io = {}  # step -> [read, written]
        self._last_io: dict[int, tuple[int, int]] = {}
        self._halt = threading.Event()

    def run(self):
        while not self._halt.is_set():
            self.sample()
            self._halt.wait(self.period)

    def _processes(self) -> list[psutil.Process]:
        roots = [self.root]
        files = [] if self.pids_file is None else (sorted(self.pids_file.glob("run-*/scheduler.pids.json"))
                                                   if self.pids_file.is_dir() else [self.pids_file])
        for pids_file in files:  # a folder: the shared clusters' records, one per run (.snakemake/atlasflow)
            try:
                pids = json.loads(pids_file.read_text())
                entries = [pids.get("watchdog"), pids["scheduler"], *pids["workers"]]
            except (OSError, ValueError, KeyError):
                continue
            roots += [e["pid"] if isinstance(e, dict) else e for e in entries if e]
        procs = {}  # by pid: the workflow's shared cluster is also in Snakemake's tree, count it once
        for pid in roots:
            try:
                p = psutil.Process(pid)
                procs.update((q.pid, q) for q in [p, *p.children(recursive=True)])
            except psutil.NoSuchProcess:
                continue
        return list(procs.values())

    def sample(self):
        total, steps, io = 0, set(), [0, 0]
        for p in self._processes():
            try:
                with p.oneshot():
                    total += p.memory_info().rss
                    c = p.io_counters()
                    if self.step_of is None:
                        m = re.search(r"tmp\w+\.(\w+)\.py", " ".join(p.cmdline()))
                        if m:
                            steps.add(m.group(1))
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            before = self._last_io.get(p.pid, (0, 0))
            io[0] += max(0, c.read_chars - before[0])
            io[1] += max(0, c.write_chars - before[1])
            self._last_io[p.pid] = (c.read_chars, c.write_chars)
        if self.step_of is not None:
            steps = set(filter(None, [self.step_of()]))
        self.peak_total = max(self.peak_total, total)
        for step in steps or {"(between steps)"}:
            self.peak[step] = max(self.peak.get(step, 0), total)
            acc = self.io.setdefault(step, [0, 0])
            acc[0] += io[0] // max(1, len(steps))
            acc[1] += io[1] // max(1, len(steps))

    def stop(self):
        self._halt.set()
        self.join()
        self.sample()


def run_sampled(argv: list[str], log: Path, step_of=None, pids_file: Path | None = None) -> tuple[int, Sampler, float]:
    """Run a child process to completion with its output in ``log``, sampled; its exit code, sampler, wall time."""
    t0 = time.time()
    with open(log, "w") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT)
        sampler = Sampler(proc.pid, pids_file=pids_file, step_of=step_of)
        sampler.start()
        rc = proc.wait()
        sampler.stop()
    return rc, sampler, time.time() - t0


def step_record(seconds: float, sampler: Sampler, step: str) -> dict:
    """One step's entry of a mode's results: its time and what the sampler charged to it."""
    return {"seconds": seconds, "peak": sampler.peak.get(step, 0), "io": sampler.io.get(step, [0, 0])}


class StepClock:
    """In a child process: times each step and names the running one in ``<timings>.now`` for the parent's
    sampler (``current_step`` reads it); ``save`` writes the times to ``timings``."""

    def __init__(self, timings: str):
        self.timings, self.now, self.times = Path(timings), Path(timings + ".now"), {}

    def step(self, name, fn):
        self.now.write_text(name)
        t = time.time()
        result = fn()
        self.times[name] = time.time() - t
        return result

    def save(self):
        self.now.unlink(missing_ok=True)
        self.timings.write_text(json.dumps(self.times))


def current_step(timings: Path):
    """The parent's side of ``StepClock``: a function naming the child's running step (None between steps)."""
    now = Path(str(timings) + ".now")

    def current():
        try:
            return now.read_text() or None
        except OSError:
            return None

    return current


def child_results(timings: Path, sampler: Sampler, wall: float) -> dict:
    """A fused or scanpy run's results from its child's step times and the parent's sampler."""
    times = json.loads(timings.read_text())
    skipped = Path(str(timings) + ".skipped")
    return {"wall": wall, "peak": sampler.peak_total,
            "steps": {k: step_record(v, sampler, k) for k, v in times.items()},
            **({"skipped": json.loads(skipped.read_text())} if skipped.exists() else {})}


# ------------------------------------------------------------------------------------------------ staged


def stage_passes(summary: Path) -> dict:
    """Passes over each stored matrix a stage read, from its JSON summary (empty for in-memory stages)."""
    try:
        return json.loads(summary.read_text()).get("passes", {})
    except (OSError, ValueError):
        return {}


def staged(n: int, work: Path, args) -> dict:
    """The Snakemake run (plus the wilcoxon rank_genes_groups script); per-step time, memory and I/O."""
    import yaml

    work.mkdir(parents=True, exist_ok=True)
    config = {
        "datasets": {"bench": {"simulate": {"n_cells": n, "n_genes": args.n_genes, "seed": 0},
                               "chunk_rows": args.chunk_rows}},
        "resources": {"default": {"threads": args.workers, "mem_mb": 20000, "runtime": 600}},
        "dask": {"memory_limit": args.memory_limit or "auto"},
        **{stage: dict(values) for stage, values in PARAMS.items()},
    }
    (work / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(ROOT / "workflow" / "Snakefile"),
           "--directory", str(work), "--cores", str(args.workers), "--workflow-profile",
           str(ROOT / "profiles" / "default"), "--configfile", str(work / "config.yaml")]
    rc, sampler, wall = run_sampled(cmd, work / "snakemake.log",
                                    pids_file=work / ".snakemake" / "atlasflow")
    if rc != 0:
        raise RuntimeError(f"snakemake failed (exit {rc}); see {work / 'snakemake.log'}")
    steps = {}
    res = work / "results" / "bench"
    for bench_file in sorted((work / "logs" / "bench").glob("*.benchmark.tsv")):
        rule = bench_file.name.split(".")[0]
        seconds = float(bench_file.read_text().splitlines()[1].split("\t")[0])
        name = {"rank_genes_groups": "markers_ttest"}.get(rule, rule)
        steps[name] = {**step_record(seconds, sampler, rule), "passes": stage_passes(res / f"{rule}.json")}
    # the second marker method, as a user would run it: the stage script on the workflow's stores
    argv = [sys.executable, str(ROOT / "scripts" / "rank_genes_groups.py"), "--input", str(res / "log1p.zarr"),
            "--groups-store", str(res / "leiden.zarr"), "--output", str(work / "wilcoxon.zarr"),
            "--method", "wilcoxon", "--n-workers", str(args.workers), "--chunk-rows", str(args.chunk_rows)]
    if args.memory_limit:
        argv += ["--memory-limit", args.memory_limit]
    rc, sampler, seconds = run_sampled(argv, work / "wilcoxon.log", step_of=lambda: "markers_wilcoxon")
    if rc != 0:
        raise RuntimeError(f"rank_genes_groups --method wilcoxon failed (exit {rc}); see {work / 'wilcoxon.log'}")
    steps["markers_wilcoxon"] = step_record(seconds, sampler, "markers_wilcoxon")
    steps["markers_wilcoxon"]["passes"] = stage_passes(work / "wilcoxon.json")
    return {"wall": wall + steps["markers_wilcoxon"]["seconds"], "steps": steps, "peak": max(
        sampler.peak_total, max((s["peak"] for s in steps.values()), default=0))}


# ------------------------------------------------------------------------------------------------- fused


def fused_child(raw: str, out: str, timings: str, workers: int, memory_limit: str | None, chunk_rows: int) -> None:
    """Child process: every step through the package's functions on one local cluster, lazily; the current
    step's name is written to ``timings + '.now'`` for the parent's sampler."""
    from distributed import Client, LocalCluster

    from atlasflow import pp, tl
    from atlasflow.cluster import WORKER_ENV
    from atlasflow.pp._pca import ScaledFrom
    from atlasflow.stages.subset import subset_var
    from atlasflow.store import open_store, write_store

    clock = StepClock(timings)
    step = clock.step
    cluster = LocalCluster(n_workers=workers, threads_per_worker=1, memory_limit=memory_limit or "auto",
                           dashboard_address=":0", env=dict(WORKER_ENV))
    with cluster, Client(cluster):
        a = open_store(raw, chunk_rows=chunk_rows)
        p = PARAMS

        def qc():
            masks = pp.gene_set_masks(a.var, p["qc"]["gene_sets"])
            for k, v in masks.items():
                a.var[k] = v
            pp.calculate_qc_metrics(a, qc_vars=list(masks), percent_top=p["qc"]["percent_top"])

        step("qc", qc)
        f = p["filter"]
        thresholds = {k: v for k, v in f.items() if k != "min_cells"}
        cells, genes, _ = step("filter", lambda: pp.qc_filter_masks(a, thresholds=thresholds,
                                                                    min_cells=f["min_cells"]))
        a = pp.filter_cells_genes(a, cells, genes)
        step("normalize", lambda: pp.normalize_total(a, target_sum=p["normalize"]["target_sum"]))
        step("log1p", lambda: pp.log1p(a))
        step("hvg", lambda: pp.highly_variable_genes(a, **p["hvg"]))
        sub = step("subset", lambda: subset_var(a, a.var["highly_variable"].to_numpy()))
        unscaled = sub.X
        step("scale", lambda: pp.scale(sub, max_value=p["scale"]["max_value"]))
        scaled_from = ScaledFrom(unscaled, sub.var["mean"].to_numpy(), sub.var["std"].to_numpy(), True,
                                 float(p["scale"]["max_value"]), sub.X.dtype)
        step("pca", lambda: pp.pca(sub, p["pca"]["n_comps"], scaled_from=scaled_from))
        step("neighbors", lambda: tl.neighbors(sub, p["neighbors"]["n_neighbors"]))
        step("leiden", lambda: tl.leiden(sub, p["leiden"]["resolution"], n_iterations=p["leiden"]["n_iterations"],
                                         flavor=p["leiden"]["flavor"]))
        step("umap", lambda: tl.umap(sub))
        a.obs["leiden"] = sub.obs["leiden"].to_numpy()
        a.obs["leiden"] = a.obs["leiden"].astype("category")
        step("markers_ttest", lambda: tl.rank_genes_groups(a, "leiden", method="t-test", pts=True))
        ttest = a.uns.pop("rank_genes_groups")
        step("markers_wilcoxon", lambda: tl.rank_genes_groups(a, "leiden", method="wilcoxon", pts=True,
                                                              work_dir=str(Path(out).parent)))
        a.uns["rank_genes_groups_ttest"] = ttest
        for key in ("X_pca", "X_umap"):
            a.obsm[key] = sub.obsm[key]
        step("write final", lambda: write_store(a, out, chunk_rows=chunk_rows))
    clock.save()


def fused(raw: Path, work: Path, args) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    timings = work / "fused_times.json"
    argv = [sys.executable, __file__, "--fused-child", str(raw), str(work / "final.zarr"), str(timings),
            str(args.workers), args.memory_limit or "", str(args.chunk_rows)]
    rc, sampler, wall = run_sampled(argv, work / "fused.log", step_of=current_step(timings))
    if rc != 0:
        raise RuntimeError(f"the fused run failed (exit {rc}); see {work / 'fused.log'}")
    return child_results(timings, sampler, wall)


# ------------------------------------------------------------------------------------------------ scanpy


def scanpy_child(raw: str, timings: str) -> None:
    """Child process: scanpy in memory with the same parameters, each step timed."""
    import warnings

    import anndata as ad
    import numpy as np
    import scanpy as sc
    import scipy.sparse as sp

    warnings.filterwarnings("ignore")
    clock = StepClock(timings)
    step = clock.step
    a = step("read", lambda: ad.read_zarr(raw))
    x = a.X  # 64-bit indices: scipy's kernels refuse the store's mixed index dtypes
    a.X = sp.csr_matrix((x.data, x.indices.astype(np.int64), x.indptr.astype(np.int64)), shape=a.shape)

    def pca(sub):
        sc.pp.pca(sub, n_comps=PARAMS["pca"]["n_comps"])

    def rank(a, name, method):
        step(name, lambda: sc.tl.rank_genes_groups(a, "leiden", method=method, pts=True))

    scanpy_steps(a, step, pca, rank)
    clock.save()


def scanpy_steps(a, step, pca, rank) -> None:
    """scanpy's steps with ``PARAMS``, in memory or on a Dask X: ``pca(sub)`` and ``rank(a, step, method)``
    are the parts that differ between the two."""
    import scanpy as sc

    p = PARAMS

    def qc():
        a.var["mt"] = a.var_names.str.startswith("MT-")
        sc.pp.calculate_qc_metrics(a, qc_vars=["mt"], percent_top=p["qc"]["percent_top"], inplace=True)

    step("qc", qc)

    def filt():
        f = p["filter"]
        keep = ((a.obs["n_genes_by_counts"] >= f["min_genes"]).to_numpy()
                & (a.obs["pct_counts_mt"] < f["max_pct_mt"]).to_numpy())
        return a[keep][:, (a.var["n_cells_by_counts"] >= f["min_cells"]).to_numpy()].copy()

    a = step("filter", filt)
    step("normalize", lambda: sc.pp.normalize_total(a, target_sum=p["normalize"]["target_sum"]))
    step("log1p", lambda: sc.pp.log1p(a))
    step("hvg", lambda: sc.pp.highly_variable_genes(a, **p["hvg"]))
    sub = step("subset", lambda: a[:, a.var["highly_variable"].to_numpy()].copy())
    step("scale", lambda: sc.pp.scale(sub, max_value=p["scale"]["max_value"]))
    step("pca", lambda: pca(sub))
    step("neighbors", lambda: sc.pp.neighbors(sub, n_neighbors=p["neighbors"]["n_neighbors"]))
    step("leiden", lambda: sc.tl.leiden(sub, resolution=p["leiden"]["resolution"], flavor="igraph",
                                        n_iterations=p["leiden"]["n_iterations"], directed=False))
    step("umap", lambda: sc.tl.umap(sub))
    a.obs["leiden"] = sub.obs["leiden"].to_numpy()
    a.obs["leiden"] = a.obs["leiden"].astype("category")
    rank(a, "markers_ttest", "t-test")
    rank(a, "markers_wilcoxon", "wilcoxon")


def scanpy_run(raw: Path, work: Path, args) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    timings = work / "scanpy_times.json"
    rc, sampler, wall = run_sampled([sys.executable, __file__, "--scanpy-child", str(raw), str(timings)],
                                    work / "scanpy.log", step_of=current_step(timings))
    if rc != 0:
        return failed_child(rc, work / "scanpy.log", timings, sampler, wall)
    return child_results(timings, sampler, wall)


def scanpy_dask_child(raw: str, timings: str, workers: int, memory_limit: str | None, chunk_rows: int) -> None:
    """Child process: scanpy on a lazily read Dask X where scanpy supports it (see the module docstring)."""
    import warnings

    import anndata as ad
    import numpy as np
    import scanpy as sc
    import zarr
    from distributed import Client, LocalCluster

    warnings.filterwarnings("ignore")
    clock = StepClock(timings)
    step = clock.step
    skipped = {}
    cluster = LocalCluster(n_workers=workers, threads_per_worker=1, memory_limit=memory_limit or "auto",
                           dashboard_address=":0")
    with cluster, Client(cluster):
        g = zarr.open_group(raw, mode="r")
        a = ad.AnnData(X=ad.experimental.read_elem_lazy(g["X"], chunks=(chunk_rows, -1)),
                       obs=ad.io.read_elem(g["obs"]), var=ad.io.read_elem(g["var"]))

        def pca(sub):
            sc.pp.pca(sub, n_comps=PARAMS["pca"]["n_comps"], svd_solver="covariance_eigh")
            emb = sub.obsm["X_pca"]
            sub.obsm["X_pca"] = np.asarray(emb.compute() if hasattr(emb, "compute") else emb)

        def rank(a, name, method):
            try:
                step(name, lambda: sc.tl.rank_genes_groups(a, "leiden", method=method, pts=True))
            except Exception as exc:  # noqa: BLE001 - recorded: scanpy does not support this step on Dask
                clock.times.pop(name, None)
                skipped[name] = f"{type(exc).__name__}: {str(exc)[:120]}"

        scanpy_steps(a, step, pca, rank)
    Path(timings + ".skipped").write_text(json.dumps(skipped))
    clock.save()


def scanpy_dask_run(raw: Path, work: Path, args) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    timings = work / "scanpy_dask_times.json"
    limit = args.scanpy_dask_memory_limit or args.memory_limit
    argv = [sys.executable, __file__, "--scanpy-dask-child", str(raw), str(timings), str(args.workers),
            "" if limit in (None, "auto") else limit, str(args.chunk_rows)]
    rc, sampler, wall = run_sampled(argv, work / "scanpy_dask.log", step_of=current_step(timings))
    if rc != 0:
        return failed_child(rc, work / "scanpy_dask.log", timings, sampler, wall)
    return child_results(timings, sampler, wall)


def failed_child(rc: int, log_file: Path, timings: Path, sampler, wall: float) -> dict:
    """A child that died: its exit status, the step it was in and the last line of its log (the error)."""
    tail = [line for line in log_file.read_text(errors="replace").splitlines() if line.strip()][-1:]
    now = timings.with_name(timings.name + ".now")
    step = now.read_text().strip() if now.exists() else "?"
    why = f"exit {rc} in {step}: {tail[0][:300]}" if tail else f"exit {rc} in {step}"
    return {"failed": why, "peak": sampler.peak_total, "wall": wall, "steps": {}}


# ------------------------------------------------------------------------------------------------ report


def x_bytes(raw: Path) -> int:
    """Uncompressed bytes of the raw CSR matrix (values + indices + indptr)."""
    import zarr

    x = zarr.open_group(str(raw), mode="r")["X"]
    return int(x["data"].nbytes + x["indices"].nbytes + x["indptr"].nbytes)


def report(results: dict, args) -> str:
    m = results["machine"]
    lines = ["# Whole pipeline: atlasflow staged (Snakemake) and fused vs scanpy in memory", "",
             f"{results['date']}; `bench/bench_pipeline.py` (see its docstring). Machine: {m.get('cpu', '?')}, "
             f"{m.get('cores', '?')} cores, {m.get('ram_gib', '?')} GiB RAM, Python {m.get('python', '?')}; "
             f"atlasflow: {args.workers} single-threaded workers (chunk_rows and worker memory limit: see each "
             "size).", "",
             "Time: wall seconds. Peak: MiB summed over every process, sampled every 0.2 s. I/O: MiB read / "
             "written through system calls. Ratios: atlasflow / scanpy (time and peak), staged / fused (time).",
             ""]
    for n, r in sorted(results["sizes"].items(), key=lambda kv: int(kv[0])):
        lines += [f"## {int(n):,} cells x {args.n_genes:,} genes", ""]
        info = r.get("info", {})
        if info:
            lines.append(", ".join(f"{k}: {v}" for k, v in info.items()) + ".")
            lines.append("")
        modes = [mo for mo in MODES if mo in r]
        head, rule = "| step |", "|---|"
        for mo in modes:
            head += f" {mo} s | {mo} peak | {mo} I/O |"
            rule += "---:|---:|---:|"
        head += " staged / scanpy s | staged / scanpy peak | staged / fused s | staged / scanpy_dask s |"
        rule += "---:|---:|---:|---:|"
        if "staged" in r:
            head += " staged: passes over stored matrices |"
            rule += "---|"
        lines += [head, rule]
        for step_name in STEPS:
            row = f"| {step_name} |"
            cells = {}
            for mo in modes:
                s = r[mo].get("steps", {}).get(step_name)
                cells[mo] = s
                if s is None:
                    row += " | | |"
                else:
                    row += (f" {s['seconds']:.1f} | {s['peak'] / MiB:.0f} | "
                            f"{s['io'][0] / MiB:.0f} / {s['io'][1] / MiB:.0f} |")
            st, sc_, fu, sd = (cells.get(mo) for mo in ("staged", "scanpy", "fused", "scanpy_dask"))
            row += (f" {_ratio(st, sc_, 'seconds')} | {_ratio(st, sc_, 'peak')} | {_ratio(st, fu, 'seconds')} "
                    f"| {_ratio(st, sd, 'seconds')} |")
            if "staged" in r:
                row += f" {_passes(st)} |"
            lines.append(row)
        totals = {mo: _total(r[mo]) for mo in modes}
        row = "| **all steps** |"
        for mo in modes:
            row += f" {totals[mo]:.0f} | {r[mo]['peak'] / MiB:.0f} | |"
        sc_total = totals.get("scanpy")
        st_total, fu_total = totals.get("staged"), totals.get("fused")
        row += (f" {st_total / sc_total:.2f} |" if st_total and sc_total else " |")
        row += (f" {r['staged']['peak'] / r['scanpy']['peak']:.2f} |" if "staged" in r and sc_total else " |")
        row += (f" {st_total / fu_total:.2f} |" if st_total and fu_total else " |")
        row += " |"  # scanpy_dask runs fewer steps: its total is not comparable
        lines += [row, ""]
        for mo in ("scanpy", "scanpy_dask"):
            if mo in r and r[mo].get("failed"):
                lines += [f"{mo} failed ({r[mo]['failed']}).", ""]
            for step_name, why in r.get(mo, {}).get("skipped", {}).items():
                lines += [f"{mo}: {step_name} not supported on a Dask X ({why}).", ""]
        if "staged" in r:
            other = {k: v for k, v in r["staged"]["steps"].items() if k not in STEPS}
            lines += ["Other stages of the staged run (not compared): " + ", ".join(
                f"{k} {v['seconds']:.1f} s" for k, v in sorted(other.items())) + ".", ""]
    lines += scaling(results)
    return "\n".join(lines)


def _passes(step: dict | None) -> str:
    """A step's passes over stored matrices, e.g. 'subset/X 2' ('' for in-memory steps and older results)."""
    return ", ".join(f"{k} {v:g}" for k, v in ((step or {}).get("passes") or {}).items())


def scaling(results: dict) -> list[str]:
    """Lines comparing the staged runs of successive sizes: how time and peak memory grow with the cells."""
    staged = sorted((int(n), r["staged"]) for n, r in results["sizes"].items() if "staged" in r)
    if len(staged) < 2:
        return []
    lines = ["## Scaling of the staged run", "",
             "| from | to | cells | time, all steps | peak memory, all processes |", "|---:|---:|---:|---:|---:|"]
    for (n0, a), (n1, b) in zip(staged, staged[1:]):
        lines.append(f"| {n0:,} | {n1:,} | {n1 / n0:.1f}x | {_total(b) / _total(a):.2f}x | "
                     f"{b['peak'] / a['peak']:.2f}x |")
    return lines + [""]


def _ratio(a, b, key) -> str:
    return f"{a[key] / b[key]:.2f}" if a and b and b[key] else ""


def _total(run: dict) -> float:
    return sum(run.get("steps", {}).get(s, {}).get("seconds", 0) for s in STEPS)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, style in (("staged", "o-"), ("fused", "s--"), ("scanpy", "^:"), ("scanpy_dask", "v-.")):
        pts = [(int(n), _total(r[mode]), r[mode]["peak"] / 2**30) for n, r in results["sizes"].items()
               if mode in r and not r[mode].get("failed")]
        if not pts:
            continue
        ns, ts, ms = zip(*sorted(pts))
        ax_t.plot(ns, ts, style, label=mode)
        ax_m.plot(ns, ms, style, label=mode)
    ooc = [(int(n), max(s["peak"] for k, s in r["staged"]["steps"].items() if k in STEPS and k not in GRAPH_STEPS))
           for n, r in results["sizes"].items() if "staged" in r and r["staged"].get("steps")]
    if ooc:  # the stages that stream X, apart from the graph steps that hold the embedding and graph in memory
        ns, ms = zip(*sorted(ooc))
        ax_m.plot(ns, [v / 2**30 for v in ms], "o:", color="tab:blue", alpha=0.6, label="staged, out-of-core steps")
    for ax, label in ((ax_t, "wall time, all steps (s)"), (ax_m, "peak memory, all processes (GiB)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("cells")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


# -------------------------------------------------------------------------------------------------- main


def smoke_params() -> None:
    """The parameters of ``--smoke`` (children learn it from ATLASFLOW_BENCH_SMOKE)."""
    os.environ["ATLASFLOW_BENCH_SMOKE"] = "1"
    PARAMS["hvg"]["n_top_genes"] = 300
    PARAMS["pca"]["n_comps"] = 20


def mode_caps(items: list[str]) -> dict[str, int]:
    """``["fused=200000", ...]`` -> ``{"fused": 200000}``; only the optional modes other than scanpy."""
    caps = {}
    for item in items:
        mode, _, cells = item.partition("=")
        if mode not in ("fused", "scanpy_dask") or not cells.isdigit():
            raise SystemExit(f"--max-cells: {item!r} is not fused=N or scanpy_dask=N")
        caps[mode] = int(cells)
    return caps


def main(argv=None) -> int:
    if os.environ.get("ATLASFLOW_BENCH_SMOKE"):
        smoke_params()
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--fused-child":
        raw, out, timings, workers, limit, chunk = sys.argv[2:8]
        fused_child(raw, out, timings, int(workers), limit or None, int(chunk))
        return 0
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--scanpy-child":
        scanpy_child(*sys.argv[2:4])
        return 0
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--scanpy-dask-child":
        raw, timings, workers, limit, chunk = sys.argv[2:7]
        scanpy_dask_child(raw, timings, int(workers), limit or None, int(chunk))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[10000, 100000], help="cell counts")
    p.add_argument("--n-genes", dest="n_genes", type=int, default=20000)
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                   help="staged always runs (it simulates the data); the others are optional")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--chunk-rows", dest="chunk_rows", type=int, default=10000)
    p.add_argument("--memory-limit", dest="memory_limit", default=None,
                   help="per worker, staged and fused (e.g. 1.5GB); default: the workflow's auto")
    p.add_argument("--scanpy-dask-memory-limit", dest="scanpy_dask_memory_limit", default=None,
                   help="per worker of the scanpy_dask run (default: --memory-limit; auto: Dask's default)")
    p.add_argument("--scanpy-max-cells", dest="scanpy_max_cells", type=int, default=200_000,
                   help="run scanpy (in memory) only up to this many cells")
    p.add_argument("--max-cells", dest="max_cells", nargs="+", default=[], metavar="MODE=N",
                   help="run fused or scanpy_dask only up to N cells (e.g. fused=200000), to keep a 1M run short")
    p.add_argument("--workdir", default="/tmp/atlasflow-bench-pipeline")
    p.add_argument("--results", default=str(ROOT / "bench" / "results"))
    p.add_argument("--append", action="store_true",
                   help="add these sizes to the results already in --results (replacing the same sizes)")
    p.add_argument("--keep", action="store_true", help="keep the stores (default: delete each size's)")
    p.add_argument("--smoke", action="store_true", help="2,000 cells x 1,000 genes, chunk_rows 500: runs in seconds")
    args = p.parse_args(argv)
    if args.smoke:
        args.sizes, args.n_genes, args.chunk_rows = [2000], 1000, 500
        smoke_params()
    caps = mode_caps(args.max_cells)
    results = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M"), "sizes": {},
               "args": {k: v for k, v in vars(args).items()}}
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    previous = out / ("pipeline_smoke.json" if args.smoke else "pipeline.json")
    if args.append and previous.exists():  # keep the sizes of earlier runs (each records its own settings)
        results["sizes"] = {n: r for n, r in json.loads(previous.read_text())["sizes"].items()
                            if int(n) not in args.sizes}
    for n in args.sizes:
        work = fresh_workdir(Path(args.workdir) / str(n))
        r = results["sizes"][str(n)] = {"info": {
            "run": results["date"], "chunk_rows": args.chunk_rows,
            "worker memory limit": args.memory_limit or "auto"}}
        if "scanpy_dask" in args.modes and args.scanpy_dask_memory_limit:
            r["info"]["scanpy_dask worker memory limit"] = args.scanpy_dask_memory_limit
        print(f"pipeline bench: {n} cells x {args.n_genes} genes", flush=True)
        r["staged"] = staged(n, work / "staged", args)  # simulates the dataset too
        raw = work / "staged" / "results" / "bench" / "simulate.zarr"
        xb = x_bytes(raw)
        r["info"]["uncompressed X"] = f"{xb / 2**30:.2f} GiB"
        if args.memory_limit:
            from dask.utils import parse_bytes

            limit = parse_bytes(args.memory_limit) * args.workers
            r["info"]["X / workers' memory limit"] = f"{xb / limit:.1f}x"
        print(f"  staged: {_total(r['staged']):.0f} s, peak {r['staged']['peak'] / MiB:.0f} MiB", flush=True)
        for mode, cap in caps.items():
            if mode in args.modes and n > cap:
                r["info"][mode] = f"not run above {cap:,} cells (--max-cells)"
        if "fused" in args.modes and n <= caps.get("fused", n):
            r["fused"] = fused(raw, work / "fused", args)
            print(f"  fused: {_total(r['fused']):.0f} s, peak {r['fused']['peak'] / MiB:.0f} MiB", flush=True)
        if "scanpy" in args.modes and n <= args.scanpy_max_cells:
            r["scanpy"] = scanpy_run(raw, work / "scanpy", args)
            print(f"  scanpy: {_total(r['scanpy']):.0f} s, peak {r['scanpy']['peak'] / MiB:.0f} MiB", flush=True)
        elif "scanpy" in args.modes:
            r["info"]["scanpy"] = f"not run above {args.scanpy_max_cells:,} cells (--scanpy-max-cells)"
        if "scanpy_dask" in args.modes and n <= caps.get("scanpy_dask", n):
            r["scanpy_dask"] = scanpy_dask_run(raw, work / "scanpy_dask", args)
            print(f"  scanpy_dask: {_total(r['scanpy_dask']):.0f} s, peak {r['scanpy_dask']['peak'] / MiB:.0f} MiB",
                  flush=True)
        if "staged" not in args.modes:
            r.pop("staged")
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        text = write_results(results, args, out)  # after every size: a failure at 1M keeps the 100k results
    print(text)
    return 0


def write_results(results: dict, args, out: Path) -> str:
    """The JSON, the markdown table and the plot of the sizes done so far; returns the table."""
    name = "pipeline_smoke" if args.smoke else "pipeline"
    (out / f"{name}.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    text = report(results, args)
    (out / f"{name}.md").write_text(text)
    plot(results, out / f"{name}.png")
    return text


if __name__ == "__main__":
    sys.exit(main())
