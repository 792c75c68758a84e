#!/usr/bin/env python
"""Benchmark: neighbors + leiden + umap of atlasflow against scanpy on a simulated PCA embedding.

What it does
    For each size (default 100k cells; ``--sizes 100000 1000000`` for more) it simulates a seeded
    embedding of ``--dims`` (50) dimensions: ``--clusters`` Gaussian blobs whose spread decays over the
    dimensions like a PCA embedding. Each tool then runs, in its own child process, on that same
    embedding: ``neighbors`` (15 neighbours, automatic kNN method -> pynndescent at these sizes),
    ``leiden`` (igraph flavor, 2 iterations, resolution 1) and ``umap`` (scanpy defaults, 200 epochs).
    A warm-up on 2,000 cells first pays the numba JIT compilation, reported separately.

What it measures
    Wall time per step (inside the child), peak resident memory of the child (psutil RSS sampled every
    0.1 s by the parent, so it includes the embedding, the graph and the libraries), number of clusters,
    ARI of the clusters against the simulated blobs and against scanpy's clusters. scanpy runs with a
    timeout (``--scanpy-timeout``, default 1800 s); if it does not finish, the table says so.

Output
    A markdown table in ``bench/results/graph.md`` (``--out``), also printed.

Usage
    .venv/bin/python bench/bench_graph.py                     # 100k cells
    .venv/bin/python bench/bench_graph.py --sizes 100000 1000000 --scanpy-timeout 3600
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def simulate(n: int, dims: int, clusters: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded Gaussian blobs with PCA-like decaying spread: (embedding float32, true labels)."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(scale=4.0, size=(clusters, dims))
    labels = rng.integers(0, clusters, n)
    scale = 2.0 / np.sqrt(1.0 + np.arange(dims))
    x = np.empty((n, dims), dtype=np.float32)
    for s in range(0, n, 200_000):  # in blocks: bounded temporaries at 1M cells
        e = min(n, s + 200_000)
        x[s:e] = centers[labels[s:e]] + rng.normal(size=(e - s, dims)) * scale
    return x, labels


# --------------------------------------------------------------------------------------------------
# child: one tool on one embedding


def worker(tool: str, emb_path: str, out_path: str) -> None:
    import warnings

    import anndata as ad

    warnings.filterwarnings("ignore")
    x = np.load(emb_path)
    if tool == "atlasflow":
        from atlasflow.tl import leiden, neighbors, umap

        steps = {
            "neighbors": lambda a: neighbors(a, n_neighbors=15, use_rep="X_pca"),
            "leiden": lambda a: leiden(a, resolution=1.0, flavor="igraph", n_iterations=2),
            "umap": lambda a: umap(a),
        }
    else:
        import scanpy as sc

        steps = {
            "neighbors": lambda a: sc.pp.neighbors(a, n_neighbors=15, use_rep="X_pca"),
            "leiden": lambda a: sc.tl.leiden(a, resolution=1.0, flavor="igraph", n_iterations=2, directed=False),
            "umap": lambda a: sc.tl.umap(a),
        }

    def pipeline(emb, timings=None):
        a = ad.AnnData(obsm={"X_pca": emb}, shape=(emb.shape[0], 0))
        for name, step in steps.items():
            t0 = time.perf_counter()
            step(a)
            if timings is not None:
                timings[name] = time.perf_counter() - t0
                print(f"{tool}: {name} {timings[name]:.1f} s", file=sys.stderr, flush=True)
        return a

    t0 = time.perf_counter()
    # warm-up: pay the JIT compilation of numba code (pynndescent, umap) on 9,000 cells (above scanpy's
    # 8192-cell threshold, so the same pynndescent code path runs)
    warm = x[: min(len(x), 9000)]
    pipeline(warm)
    warmup = time.perf_counter() - t0
    timings: dict[str, float] = {}
    a = pipeline(x, timings)
    labels = a.obs["leiden"].astype(str).to_numpy()
    np.save(out_path + ".labels.npy", labels.astype("U8"))
    np.save(out_path + ".umap.npy", np.asarray(a.obsm["X_umap"]))
    conn = a.obsp["connectivities"].tocsr()
    conn.sort_indices()
    digest = hashlib.sha1()
    for part in (conn.indptr.astype(np.int64), conn.indices.astype(np.int64), conn.data.astype(np.float32)):
        digest.update(part.tobytes())
    Path(out_path).write_text(json.dumps({"warmup": warmup, "timings": timings, "graph_sha1": digest.hexdigest()}))


# --------------------------------------------------------------------------------------------------
# parent: run children, sample memory, tabulate


def run_child(tool: str, emb_path: str, out_path: str, timeout: float) -> dict:
    import psutil

    cmd = [sys.executable, __file__, "--worker", tool, "--emb", emb_path, "--result", out_path]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=str(ROOT))
    peak = [0]
    stop = threading.Event()

    def sample():
        try:
            p = psutil.Process(proc.pid)
            while not stop.is_set():
                try:
                    rss = p.memory_info().rss + sum(c.memory_info().rss for c in p.children(recursive=True))
                    peak[0] = max(peak[0], rss)
                except psutil.Error:
                    pass
                time.sleep(0.1)
        except psutil.Error:
            pass

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    try:
        rc = proc.wait(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc, timed_out = None, True
    stop.set()
    th.join()
    wall = time.perf_counter() - t0
    res = {"tool": tool, "wall": wall, "peak_rss": peak[0], "timed_out": timed_out, "rc": rc}
    if not timed_out and rc == 0:
        res.update(json.loads(Path(out_path).read_text()))
        res["labels"] = np.load(out_path + ".labels.npy")
        res["umap"] = np.load(out_path + ".umap.npy")
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[100_000])
    p.add_argument("--dims", type=int, default=50)
    p.add_argument("--clusters", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scanpy-timeout", type=float, default=1800.0)
    p.add_argument("--atlasflow-timeout", type=float, default=3600.0)
    p.add_argument("--tools", nargs="+", default=["atlasflow", "scanpy"])
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "graph.md"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--emb", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, args.emb, args.result)
        return 0

    from sklearn.metrics import adjusted_rand_score

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.sizes:
            x, truth = simulate(n, args.dims, args.clusters, args.seed)
            emb = os.path.join(tmp, f"emb_{n}.npy")
            np.save(emb, x)
            del x
            results = {}
            for tool in args.tools:
                timeout = args.scanpy_timeout if tool == "scanpy" else args.atlasflow_timeout
                print(f"== {n:,} cells: {tool} (timeout {timeout:.0f} s)", file=sys.stderr, flush=True)
                results[tool] = run_child(tool, emb, os.path.join(tmp, f"{tool}_{n}.json"), timeout)
            for tool, r in results.items():
                row = {"cells": n, **{k: v for k, v in r.items() if k not in ("labels", "umap")}}
                if "labels" in r:
                    row["clusters"] = len(np.unique(r["labels"]))
                    row["ari_truth"] = adjusted_rand_score(truth, r["labels"])
                    other = results.get("scanpy")
                    if tool != "scanpy" and other is not None and "labels" in other:
                        row["ari_scanpy"] = adjusted_rand_score(other["labels"], r["labels"])
                        row["same_graph"] = r["graph_sha1"] == other["graph_sha1"]
                        row["same_umap"] = bool(np.array_equal(r["umap"], other["umap"]))
                rows.append(row)
    table = render(rows, args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(table)
    print(table)
    return 0


def render(rows: list[dict], args) -> str:
    import psutil

    head = [
        "# Graph benchmark: neighbors + leiden + umap on a simulated embedding",
        "",
        f"`bench/bench_graph.py --sizes {' '.join(map(str, args.sizes))}`: {args.clusters} seeded Gaussian blobs "
        f"in {args.dims} dims (PCA-like decaying spread), 15 neighbours (pynndescent, chosen automatically at these "
        "sizes), Leiden igraph flavor (2 iterations, resolution 1), UMAP with scanpy's defaults (200 epochs). "
        "Times are per step after a 9,000-cell warm-up that pays numba's JIT (column *warm-up*); peak RSS is the "
        "child process's resident memory sampled every 0.1 s.",
        "",
        f"Machine: {platform.node()}, {psutil.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB, "
        f"Python {platform.python_version()}; load average at the end {os.getloadavg()[0]:.1f} (shared machine).",
        "",
        "*Same graph / UMAP as scanpy*: connectivities bit for bit (SHA-1) and X_umap coordinates exactly equal.",
        "",
        "| cells | tool | neighbors s | leiden s | umap s | total s | warm-up s | peak RSS GiB | clusters "
        "| ARI vs blobs | ARI vs scanpy | same graph / UMAP as scanpy |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    lines = []
    for r in rows:
        if r.get("timed_out") or r.get("rc") not in (0, None) or "timings" not in r:
            why = f"timed out after {r['wall']:.0f} s" if r.get("timed_out") else f"failed (exit {r.get('rc')})"
            lines.append(f"| {r['cells']:,} | {r['tool']} | {why} | | | | | {r['peak_rss'] / 2**30:.2f} | | | | |")
            continue
        t = r["timings"]
        ari_s = f"{r['ari_scanpy']:.3f}" if "ari_scanpy" in r else ""
        same = (f"{'yes' if r['same_graph'] else 'no'} / {'yes' if r['same_umap'] else 'no'}"
                if "same_graph" in r else "")
        lines.append(
            f"| {r['cells']:,} | {r['tool']} | {t['neighbors']:.1f} | {t['leiden']:.1f} | {t['umap']:.1f} "
            f"| {sum(t.values()):.1f} | {r['warmup']:.1f} | {r['peak_rss'] / 2**30:.2f} | {r['clusters']} "
            f"| {r['ari_truth']:.3f} | {ari_s} | {same} |"
        )
    return "\n".join(head + lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
