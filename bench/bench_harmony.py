#!/usr/bin/env python
"""Time and memory of the harmony stage's integration at atlas size (issue #24: 1M cells x 50 PCs x 16 batches).

What it does
    For each ``--n-cells``, a seeded embedding: ``--n-types`` cell types (Gaussian blobs in ``--n-dims``
    dimensions) seen in ``--n-batches`` batches, each batch shifting every cell by its own offset (a batch
    effect as large as the distance between types) and holding the types in its own proportions. Then
    ``atlasflow.pp.harmony_integrate`` (harmonypy's C++ backend, all cores) in this process.

What it measures
    Wall seconds of the integration, the peak RSS it adds to the loaded embedding (sampled every 20 ms), and
    on a seeded sample of 20,000 cells the median iLISI of the batches (mixing, 1 to n-batches) and cLISI of
    the types (separation, 1 is best) before and after (harmonypy's compute_lisi, perplexity 30).

Usage
    python bench/bench_harmony.py --n-cells 100000 1000000
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))
from bench_umap import PeakRSS  # noqa: E402  (the same sampler: what the step adds to the process)


def embedding(n_cells: int, n_dims: int, n_batches: int, n_types: int, seed: int = 0):
    """(embedding float32, obs with batch and type) as described in the module docstring."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(scale=4.0, size=(n_types, n_dims))
    offsets = rng.normal(scale=4.0 / np.sqrt(n_dims) * 3, size=(n_batches, n_dims))
    batch = rng.integers(0, n_batches, n_cells)
    props = rng.dirichlet(np.full(n_types, 2.0), n_batches)
    cell_type = (props[batch].cumsum(axis=1) > rng.random(n_cells)[:, None]).argmax(axis=1)
    emb = (centres[cell_type] + offsets[batch] + rng.normal(size=(n_cells, n_dims))).astype(np.float32)
    obs = pd.DataFrame({"batch": pd.Categorical(batch.astype(str)), "type": pd.Categorical(cell_type.astype(str))},
                       index=pd.RangeIndex(n_cells).astype(str))
    return emb, obs


def lisi(emb, obs, sample):
    import harmonypy

    scores = harmonypy.compute_lisi(emb[sample], obs.iloc[sample], ["batch", "type"])
    return float(np.median(scores[:, 0])), float(np.median(scores[:, 1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-cells", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--n-dims", type=int, default=50)
    ap.add_argument("--n-batches", type=int, default=16)
    ap.add_argument("--n-types", type=int, default=20)
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    import anndata as ad

    from atlasflow import pp

    rows = []
    for n in args.n_cells:
        emb, obs = embedding(n, args.n_dims, args.n_batches, args.n_types)
        adata = ad.AnnData(obs=obs)
        adata.obsm["X_pca"] = emb
        sample = np.sort(np.random.default_rng(1).choice(n, min(n, 20_000), replace=False))
        before = lisi(emb, obs, sample)
        t0 = time.perf_counter()
        with PeakRSS() as mem:
            summary = pp.harmony_integrate(adata, "batch")
        seconds = time.perf_counter() - t0
        after = lisi(adata.obsm["X_pca_harmony"], obs, sample)
        rows.append((n, seconds, mem.mib, emb.nbytes / 2**20, before, after, summary.get("objective_rounds")))
        print(f"{n} cells: {seconds:.1f} s, +{mem.mib:.0f} MiB; iLISI {before[0]:.2f} -> {after[0]:.2f}, "
              f"cLISI {before[1]:.2f} -> {after[1]:.2f}", flush=True)
    args.results.mkdir(parents=True, exist_ok=True)
    name = "_".join(str(n) for n in args.n_cells)
    lines = [
        f"# Harmony (harmonypy {version('harmonypy')}) at {args.n_dims} dims x {args.n_batches} batches",
        "",
        f"`python bench/bench_harmony.py --n-cells {' '.join(map(str, args.n_cells))}`; Python "
        f"{platform.python_version()}, {len(os.sched_getaffinity(0))} cores. MiB: peak RSS the integration "
        "adds to the loaded embedding. LISI: medians on 20,000 sampled cells (iLISI of the batches, 1 to "
        f"{args.n_batches}, higher = mixed; cLISI of the {args.n_types} types, 1 = apart).",
        "",
        "| cells | s | MiB added | embedding MiB | iLISI before | iLISI after | cLISI before | cLISI after | rounds |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, s, mib, emb_mib, before, after, rounds in rows:
        lines.append(f"| {n:,} | {s:.1f} | {mib:.0f} | {emb_mib:.0f} | {before[0]:.2f} | {after[0]:.2f} | "
                     f"{before[1]:.2f} | {after[1]:.2f} | {rounds} |")
    (args.results / f"harmony_{name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
