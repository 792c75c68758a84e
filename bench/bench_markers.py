#!/usr/bin/env python
"""Benchmark: out-of-core marker genes (t-test, exact Wilcoxon) against scanpy in memory.

What it does, in one run:

1. Simulates a log-normalised matrix of ``--cells`` cells x ``--genes`` genes with about
   ``--nnz-per-cell`` non-zeros per cell (gene popularity log-normal; ``--groups`` clusters with 50
   marker genes each, 4x more likely to be detected in their cluster; values
   ``log1p(count / total * 1e4)`` of geometric counts) and writes it as an atlasflow store, block by
   block on the Dask workers (reused on the next run with the same parameters).
2. atlasflow: ``tl.rank_genes_groups`` t-test (one pass over X) and wilcoxon (gene-major copy written
   once, then one ranking pass), on a local cluster of ``--workers`` single-threaded workers.
3. scanpy: loads the whole matrix into memory (``anndata.read_zarr``) and runs
   ``sc.tl.rank_genes_groups`` with the same methods, in a child process (skip with ``--no-scanpy``).
4. Wall time and peak memory of each step: the summed RSS of every process involved (this one, the
   scheduler and the workers; or the scanpy child), sampled every 0.2 s with psutil; then the
   agreement of the two top-100 gene lists per group. Appends a markdown table to
   ``bench/results/markers.md``.

   With ``--input STORE`` step 1 is skipped: the markers of an existing log-normalised store are ranked
   instead, grouped by ``--groupby`` (e.g. the ``log1p.zarr`` of ``bench_foundation.py`` by ``cell_type``).

Usage::

    python bench/bench_markers.py                       # 100k cells x 20k genes, ~2000 nnz/cell
    python bench/bench_markers.py --cells 20000 --genes 5000 --workdir /tmp/b   # quick look
    python bench/bench_markers.py --input /tmp/b1m/log1p.zarr --groupby cell_type --no-scanpy   # 1M cells
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


class PeakRSS:
    """Sample the summed RSS of a process and all its descendants (plus extra pids) in a thread."""

    def __init__(self, pid: int | None = None, extra=(), interval: float = 0.2):
        import psutil

        self.proc = psutil.Process(pid or os.getpid())
        self.extra = [psutil.Process(p) for p in extra]
        self.interval, self.peak, self._stop = interval, 0, threading.Event()

    def _sample(self) -> int:
        import psutil

        total = 0
        procs = [self.proc, *self.extra]
        for p in list(procs):
            try:
                procs.extend(p.children(recursive=True))
            except psutil.Error:
                pass
        for p in {q.pid: q for q in procs}.values():
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return total

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._sample())
            self._stop.wait(self.interval)

    def __enter__(self):
        self.t0 = time.perf_counter()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self.thread.join()
        self.peak = max(self.peak, self._sample())
        self.seconds = time.perf_counter() - self.t0


# ------------------------------------------------------------------------------------------ data


def simulate_block(start: int, stop: int, n_genes: int, nnz_per_cell: int, n_groups: int, seed: int):
    """Rows ``start:stop`` as float32 CSR (log-normalised values), deterministic per block."""
    import scipy.sparse as sp

    rng_g = np.random.default_rng([seed, 0])
    weight = rng_g.lognormal(0, 1.5, n_genes)
    weight /= weight.sum()
    markers = rng_g.permutation(n_genes)[: 50 * n_groups].reshape(n_groups, 50)
    rng = np.random.default_rng([seed, 1, start])
    labels = group_labels(start, stop, n_groups, seed)
    n = stop - start
    # draws per cell so that the expected number of distinct genes is nnz_per_cell (popular genes repeat)
    lo, hi = float(nnz_per_cell), 50.0 * nnz_per_cell
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if (-np.expm1(-mid * weight)).sum() < nnz_per_cell else (lo, mid)
    draws = rng.poisson(lo, n)
    rows = np.repeat(np.arange(n, dtype=np.int64), draws)
    cdf = np.cumsum(weight)
    genes = np.minimum(np.searchsorted(cdf, rng.random(rows.shape[0]) * cdf[-1]), n_genes - 1)
    boost = rng.random(rows.shape[0]) < 0.03  # some draws land on the cell's own markers
    genes[boost] = markers[labels[rows[boost]], rng.integers(0, 50, int(boost.sum()))]
    key = np.sort(rows * n_genes + genes)  # np.unique is much slower than sort + diff here
    key = key[np.concatenate([[True], key[1:] != key[:-1]])]
    r, c = key // n_genes, (key % n_genes).astype(np.int32)
    counts = rng.geometric(0.5, key.shape[0]).astype(np.float64)
    totals = np.bincount(r, weights=counts, minlength=n)
    data = np.log1p(counts / totals[r] * 1e4).astype(np.float32)
    indptr = np.concatenate([[0], np.cumsum(np.bincount(r, minlength=n))])
    return sp.csr_matrix((data, c, indptr), shape=(n, n_genes))


def group_labels(start: int, stop: int, n_groups: int, seed: int) -> np.ndarray:
    """Cluster of each cell (uniform, deterministic by cell index)."""
    idx = np.arange(start, stop, dtype=np.uint64)
    return ((idx * np.uint64(2654435761) + np.uint64(seed)) % np.uint64(2**32) % np.uint64(n_groups)).astype(np.int64)


def make_store(path: Path, a) -> Path:
    """Write the simulated store (workers generate and write their own blocks); reuse a matching one.

    The generated blocks are persisted in worker memory first, so they are made once although
    ``write_store`` passes over them twice (row counts, then the write).
    """
    import anndata as ad
    import dask
    import dask.array as da
    import pandas as pd
    import scipy.sparse as sp
    import zarr

    from atlasflow.store import META_KEY, write_store

    params = {k: getattr(a, k) for k in ("cells", "genes", "nnz_per_cell", "groups", "seed", "chunk_rows")}
    if path.exists():
        meta = dict(zarr.open_group(str(path), mode="r").attrs.get(META_KEY, {}))
        if meta.get("provenance", {}).get("bench") == params:
            return path
    bounds = [(s, min(s + a.chunk_rows, a.cells)) for s in range(0, a.cells, a.chunk_rows)]
    blocks = [da.from_delayed(dask.delayed(simulate_block)(s, e, a.genes, a.nnz_per_cell, a.groups, a.seed),
                              shape=(e - s, a.genes), dtype=np.float32, meta=sp.csr_matrix((0, 0), dtype=np.float32))
              for s, e in bounds]
    x = da.concatenate(blocks, axis=0).persist()
    labels = np.concatenate([group_labels(s, e, a.groups, a.seed) for s, e in bounds])
    obs = pd.DataFrame({"leiden": pd.Categorical(labels.astype(str), categories=[str(i) for i in range(a.groups)])},
                       index=[f"cell{i}" for i in range(a.cells)])
    var = pd.DataFrame(index=[f"gene{j}" for j in range(a.genes)])
    write_store(ad.AnnData(X=x, obs=obs, var=var, uns={"log1p": {"base": None}}), path, chunk_rows=a.chunk_rows,
                provenance={"bench": params})
    return path


# ------------------------------------------------------------------------------------------ runs


def run_atlasflow(store: Path, a, client) -> tuple[list[dict], dict]:
    from atlasflow import tl
    from atlasflow.store import open_store

    rows, results = [], {}
    pids = [p for p in client.run(os.getpid).values()]
    for method in ("t-test", "wilcoxon"):
        adata = open_store(store)
        with PeakRSS(extra=pids) as pr:
            tl.rank_genes_groups(adata, a.groupby, method=method, n_genes=100,
                                 work_dir=a.workdir, gene_block=a.gene_block)
        results[method] = {g: list(adata.uns["rank_genes_groups"]["names"][g]) for g in
                           adata.uns["rank_genes_groups"]["names"].dtype.names}
        rows.append({"tool": f"atlasflow ({a.workers} workers)", "method": method, "seconds": pr.seconds,
                     "peak_gib": pr.peak / 2**30})
        print(rows[-1], flush=True)
    return rows, results


SCANPY_CHILD = r"""
import json, sys, time, warnings
import anndata as ad, numpy as np, scanpy as sc, scipy.sparse as sp
warnings.filterwarnings("ignore")
store, method, out, groupby = sys.argv[1:5]
t0 = time.perf_counter()
a = ad.read_zarr(store)
a.X = sp.csr_matrix((a.X.data, a.X.indices.astype(np.int64), a.X.indptr.astype(np.int64)), shape=a.shape)
t1 = time.perf_counter()
sc.tl.rank_genes_groups(a, groupby, method=method, n_genes=100)
t2 = time.perf_counter()
names = a.uns["rank_genes_groups"]["names"]
result = {"load": t1 - t0, "seconds": t2 - t1, "names": {g: list(names[g]) for g in names.dtype.names}}
json.dump(result, open(out, "w"))
"""


def run_scanpy(store: Path, method: str, workdir: Path, groupby: str) -> tuple[dict, dict]:
    out = workdir / f"scanpy-{method}.json"
    proc = subprocess.Popen([sys.executable, "-c", SCANPY_CHILD, str(store), method, str(out), groupby])
    with PeakRSS(pid=proc.pid) as pr:
        proc.wait()
    if proc.returncode != 0:
        return {"tool": "scanpy (in memory)", "method": method, "seconds": float("nan"), "peak_gib": pr.peak / 2**30,
                "note": f"failed (exit {proc.returncode})"}, {}
    res = json.loads(out.read_text())
    row = {"tool": "scanpy (in memory)", "method": method, "seconds": res["seconds"], "peak_gib": pr.peak / 2**30,
           "note": f"+ {res['load']:.0f} s to load X"}
    print(row, flush=True)
    return row, res["names"]


def agreement(ours: dict, theirs: dict) -> float:
    """Mean fraction of identical genes in the top-100 lists of the groups."""
    return float(np.mean([len(set(ours[g]) & set(theirs[g])) / len(ours[g]) for g in ours]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cells", type=int, default=100_000)
    p.add_argument("--genes", type=int, default=20_000)
    p.add_argument("--nnz-per-cell", dest="nnz_per_cell", type=int, default=2000)
    p.add_argument("--groups", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk-rows", dest="chunk_rows", type=int, default=10_000)
    p.add_argument("--gene-block", dest="gene_block", type=int, default=None)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--memory-limit", dest="memory_limit", default="6GB")
    p.add_argument("--workdir", default=str(HERE / "work"))
    p.add_argument("--no-scanpy", dest="scanpy", action="store_false")
    p.add_argument("--results", default=str(HERE / "results" / "markers.md"))
    p.add_argument("--input", default=None, help="rank this log-normalised store instead of simulating one")
    p.add_argument("--groupby", default="leiden", help="obs column of the groups (the simulated store's: leiden)")
    a = p.parse_args(argv)

    from distributed import Client, LocalCluster

    workdir = Path(a.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    store = Path(a.input) if a.input else workdir / f"sim_{a.cells}x{a.genes}_{a.nnz_per_cell}.zarr"
    with LocalCluster(n_workers=a.workers, threads_per_worker=1, memory_limit=a.memory_limit,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        if a.input:
            described_by_input(store, a)
        else:
            t0 = time.perf_counter()
            make_store(store, a)
            print(f"store ready in {time.perf_counter() - t0:.0f} s: {store}", flush=True)
        rows, ours = run_atlasflow(store, a, client)
    import zarr

    nnz = int(zarr.open_group(str(store), mode="r")["X"]["data"].shape[0])
    if a.scanpy:
        for method in ("t-test", "wilcoxon"):
            row, names = run_scanpy(store, method, workdir, a.groupby)
            if names:
                share = agreement(ours[method], names)
                row["note"] = row.get("note", "") + f"; top-100 agreement with atlasflow {share:.3f}"
            rows.append(row)
    write_table(Path(a.results), a, nnz, rows)
    return 0


def described_by_input(store: Path, a) -> None:
    """Set the size arguments (cells, genes, groups) from an existing store, for the table."""
    from atlasflow.store import open_store

    adata = open_store(store)
    a.cells, a.genes = adata.shape
    a.groups = adata.obs[a.groupby].astype("category").cat.categories.size


def write_table(path: Path, a, nnz: int, rows: list[dict]) -> None:
    import psutil

    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        f"\n## {a.cells:,} cells x {a.genes:,} genes, {nnz:,} non-zeros ({nnz / a.cells:.0f} per cell), "
        f"{a.groups} groups ({a.groupby}{f' of {a.input}' if a.input else ', simulated'}) — "
        f"{time.strftime('%Y-%m-%d %H:%M')}",
        "",
        f"Machine: {platform.node()}, {psutil.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB RAM, "
        f"load average {os.getloadavg()[0]:.1f} at the end (shared machine: times are indicative). "
        f"atlasflow: {a.workers} single-threaded workers, chunk_rows {a.chunk_rows}, gene_block "
        f"{a.gene_block or 'auto'}; peak = summed RSS of all processes (client, scheduler, workers).",
        "",
        "| tool | method | wall time (s) | peak memory (GiB) | note |",
        "|---|---|---:|---:|---|",
    ]
    for r in rows:
        lines.append(f"| {r['tool']} | {r['method']} | {r['seconds']:.1f} | {r['peak_gib']:.2f} "
                     f"| {r.get('note', '')} |")
    if not path.exists():
        path.write_text("# Marker genes: atlasflow out of core vs scanpy in memory\n\n"
                        "Written by `bench/bench_markers.py` (see its docstring for what is measured).\n")
    with path.open("a") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
