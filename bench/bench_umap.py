#!/usr/bin/env python
"""Where UMAP's time and memory go on a large connected graph, and what the alternatives cost (issue #21).

What it does
    Builds (once, cached under ``--workdir``) a connected kNN graph: a seeded 50-dim embedding of
    ``--clusters`` overlapping Gaussian blobs along a random walk of centres (one connected component, as
    the pipeline's PCA of simulated counts gives; separated blobs would give one small eigenproblem per
    blob and hide the cost), and atlasflow's ``tl.neighbors`` on it (15 neighbours, scanpy's umap
    connectivities). Then each ``--steps`` entry runs in its own child process on that graph:

    * ``spectral-arpack``: umap-learn's spectral start as scanpy runs it (ARPACK, sqrt(cells) Lanczos
      vectors below 2M cells);
    * ``spectral-lobpcg``: atlasflow's large-graph start (``tl._spectral.spectral_start``);
    * ``epochs``: umap-learn's optimisation from a fixed start, single-threaded (scanpy's default);
    * ``epochs-parallel``: the same with numba threads (umap-learn's ``parallel=True``);
    * ``layout-arpack`` / ``layout-lobpcg``: the whole ``tl.umap`` (start and 200 epochs) with the spectral
      start forced to umap-learn's ARPACK (scanpy's layout) or to LOBPCG, and umap-learn's epochs;
    * ``layout-large``: the whole large path, LOBPCG start and atlasflow's deterministic parallel epochs
      (``kernels.umap_epochs``).

What it measures
    Wall seconds inside the child and its peak RSS minus the RSS after loading the graph (what the step
    itself adds). The spectral starts are compared with ARPACK's where both ran: the largest principal angle
    between the two 2-D subspaces (degrees). The layouts are scored against the embedding: the mean fraction
    of each cell's 15 nearest neighbours in the 50-dim embedding kept among its 15 nearest in 2-D (on a
    seeded sample of 20,000 cells, neighbours searched among all), and the Spearman correlation of the blobs'
    centroid distances in 50-dim and in 2-D (global structure).

Usage
    python bench/bench_umap.py --n-cells 1000000
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("spectral-arpack", "spectral-lobpcg", "epochs", "epochs-parallel", "layout-arpack", "layout-lobpcg",
         "layout-large")


def make_graph(n: int, clusters: int, seed: int, path: Path) -> None:
    """Seeded overlapping blobs in 50 dims -> atlasflow neighbors -> connectivities saved to ``path``."""
    import anndata as ad
    import scipy.sparse as sp

    sys.path.insert(0, str(ROOT / "src"))
    from atlasflow.tl import neighbors

    rng = np.random.default_rng(seed)
    dims = 50
    steps = rng.normal(scale=0.3, size=(clusters, dims))
    centers = np.cumsum(steps, axis=0)  # a walk: neighbouring blobs overlap, the graph is connected
    labels = rng.integers(0, clusters, n)
    scale = 2.0 / np.sqrt(1.0 + np.arange(dims))
    x = np.empty((n, dims), dtype=np.float32)
    for s in range(0, n, 200_000):
        e = min(n, s + 200_000)
        x[s:e] = centers[labels[s:e]] + rng.normal(size=(e - s, dims)) * scale
    a = ad.AnnData(obs={"blob": labels.astype(str)}, obsm={"X_pca": x})
    t = time.perf_counter()
    neighbors(a, n_neighbors=15, use_rep="X_pca")
    g = a.obsp["connectivities"].tocsr()
    ncomp = sp.csgraph.connected_components(g)[0]
    sp.save_npz(path, g)
    np.save(path.with_suffix(".labels.npy"), labels)
    np.save(path.with_suffix(".x.npy"), x)
    print(f"graph: {n} cells, {g.nnz} edges, {ncomp} component(s), neighbors {time.perf_counter() - t:.1f} s",
          flush=True)


class PeakRSS:
    """Peak resident memory of this process while the block runs, sampled every 20 ms, minus its RSS at the
    start (MiB): what the step itself adds."""

    def __enter__(self):
        import psutil

        self.proc, self.stop = psutil.Process(), threading.Event()
        self.base = self.peak = self.proc.memory_info().rss
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.stop.wait(0.02):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)
        self.mib = (self.peak - self.base) / 2**20


def child(step: str, graph_path: Path, out: Path, epochs: int) -> None:
    """One step on the cached graph; writes seconds and MiB added (JSON) and the result (.npy) beside ``out``."""
    import anndata as ad
    import scipy.sparse as sp
    import umap.umap_ as umap_learn
    from umap.spectral import spectral_layout

    sys.path.insert(0, str(ROOT / "src"))
    from atlasflow.tl._spectral import spectral_start
    from atlasflow.tl.umap import umap

    g = sp.load_npz(graph_path).tocsr()
    rs = np.random.RandomState(0)
    if step.startswith("layout-"):
        x = np.load(graph_path.with_suffix(".x.npy"))
        a = ad.AnnData(obsm={"X_pca": x}, obsp={"connectivities": g},
                       uns={"neighbors": {"connectivities_key": "connectivities",
                                          "params": {"method": "umap", "use_rep": "X_pca", "metric": "euclidean"}}})
        gate = None if step == "layout-arpack" else 1
        epochs_gate = 1 if step == "layout-large" else None
        run = lambda: umap(a, exact_spectral_max_cells=gate,  # noqa: E731
                           exact_epochs_max_cells=epochs_gate) or a.obsm["X_umap"]
    elif step.startswith("epochs"):
        coo = g.tocoo()
        coo.data[coo.data < coo.data.max() / epochs] = 0
        coo.eliminate_zeros()
        emb = rs.uniform(0, 10, size=(g.shape[0], 2)).astype(np.float32)
        eps = umap_learn.make_epochs_per_sample(coo.data, epochs)
        state = rs.randint(-2**31 + 1, 2**31 - 1, 3).astype(np.int64)
        run = lambda: umap_learn.optimize_layout_euclidean(  # noqa: E731
            emb, emb, coo.row, coo.col, epochs, g.shape[0], eps, 1.577, 0.895, state, 1.0, 1.0, 5,
            parallel=step == "epochs-parallel", move_other=True)
    elif step == "spectral-arpack":
        run = lambda: spectral_layout(None, g, 2, rs)  # noqa: E731
    else:
        run = lambda: spectral_start(g, 2, seed=0)  # noqa: E731
    t = time.perf_counter()
    with PeakRSS() as mem:
        result = run()
    secs = time.perf_counter() - t
    np.save(out.with_suffix(".npy"), np.asarray(result))
    out.write_text(json.dumps({"step": step, "s": secs, "mib": mem.mib}))


def layout_quality(x: np.ndarray, labels: np.ndarray, emb: np.ndarray, k: int = 15, sample: int = 20_000) -> dict:
    """kNN kept (sampled cells, neighbours among all) and blob-distance correlation of a layout."""
    from scipy.spatial.distance import pdist
    from scipy.stats import spearmanr
    from sklearn.neighbors import NearestNeighbors

    cells = np.random.default_rng(0).choice(len(x), size=min(sample, len(x)), replace=False)
    hi = NearestNeighbors(n_neighbors=k + 1).fit(x).kneighbors(x[cells], return_distance=False)[:, 1:]
    lo = NearestNeighbors(n_neighbors=k + 1).fit(emb).kneighbors(emb[cells], return_distance=False)[:, 1:]
    kept = float(np.mean([len(np.intersect1d(h, lw)) / k for h, lw in zip(hi, lo, strict=True)]))
    blobs = np.unique(labels)
    chi = np.array([x[labels == b].mean(0) for b in blobs])
    clo = np.array([emb[labels == b].mean(0) for b in blobs])
    return {"knn_kept": kept, "blob_rho": float(spearmanr(pdist(chi), pdist(clo))[0])}


def principal_angle(a: np.ndarray, b: np.ndarray) -> float:
    """Largest principal angle (degrees) between the column spaces of a and b."""
    qa, _ = np.linalg.qr(a - a.mean(0))
    qb, _ = np.linalg.qr(b - b.mean(0))
    s = np.linalg.svd(qa.T @ qb, compute_uv=False)
    return float(np.degrees(np.arccos(np.clip(s.min(), -1, 1))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n-cells", type=int, default=100_000)
    p.add_argument("--clusters", type=int, default=30)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--steps", nargs="+", default=list(STEPS), choices=STEPS)
    p.add_argument("--workdir", type=Path, default=ROOT / "bench" / "work" / "umap")
    p.add_argument("--out", type=Path, default=None, help="markdown table (default bench/results/umap_N.md)")
    p.add_argument("--child", nargs=2, metavar=("STEP", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    graph = args.workdir / f"graph_{args.n_cells}.npz"
    if args.child:
        child(args.child[0], graph, Path(args.child[1]), args.epochs)
        return
    if not graph.exists():
        make_graph(args.n_cells, args.clusters, 0, graph)
    rows = {}
    for step in args.steps:
        out = args.workdir / f"{step}_{args.n_cells}.json"
        proc = subprocess.run([sys.executable, __file__, "--n-cells", str(args.n_cells), "--epochs",
                               str(args.epochs), "--workdir", str(args.workdir), "--child", step, str(out)],
                              text=True, capture_output=True)
        if proc.returncode != 0:
            rows[step] = {"step": step, "error": proc.stderr.strip().splitlines()[-1]}
        else:
            rows[step] = json.loads(out.read_text())
        print(rows[step], flush=True)
    if "spectral-arpack" in rows and "spectral-lobpcg" in rows and "error" not in rows["spectral-lobpcg"]:
        ref = np.load(args.workdir / f"spectral-arpack_{args.n_cells}.npy")
        new = np.load(args.workdir / f"spectral-lobpcg_{args.n_cells}.npy")
        rows["spectral-lobpcg"]["angle"] = principal_angle(ref, new)
    for step in ("layout-arpack", "layout-lobpcg", "layout-large"):
        if step in rows and "error" not in rows[step]:
            x = np.load(graph.with_suffix(".x.npy"))
            labels = np.load(graph.with_suffix(".labels.npy"))
            emb = np.load(args.workdir / f"{step}_{args.n_cells}.npy")
            rows[step].update(layout_quality(x, labels, emb))
    lines = [f"# UMAP's parts on a connected {args.n_cells:,}-cell graph",
             "",
             f"`python bench/bench_umap.py --n-cells {args.n_cells}`; Python {platform.python_version()}, "
             f"{len(__import__('os').sched_getaffinity(0))} cores. {args.epochs} epochs. MiB: peak RSS the step "
             "adds to the loaded graph. Angle: largest principal angle to ARPACK's 2-D spectral subspace.",
             "",
             "| step | s | MiB | angle (deg) | 15-NN kept | blob-distance rho |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows.values():
        if "error" in r:
            lines.append(f"| {r['step']} | failed: {r['error']} | | | | |")
        else:
            ang = f"{r['angle']:.3f}" if "angle" in r else ""
            q = (f"{r['knn_kept']:.3f} | {r['blob_rho']:.3f}" if "knn_kept" in r else " | ")
            lines.append(f"| {r['step']} | {r['s']:.1f} | {r['mib']:.0f} | {ang} | {q} |")
    text = "\n".join(lines) + "\n"
    dest = args.out or ROOT / "bench" / "results" / f"umap_{args.n_cells}.md"
    dest.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
