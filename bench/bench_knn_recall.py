#!/usr/bin/env python
"""Recall of stored kNN graphs against the exact kNN of their embedding (issue #21).

What it does
    Reads ``obsm[--use-rep]`` of ``--embedding`` (a pca or neighbors store), draws ``--sample`` cells with a
    seeded generator, and finds each one's exact ``k`` nearest other cells among all cells by brute force in
    float64 (blocks of 100 queries). Then, for every ``--graph LABEL=STORE``, it reads that store's
    ``obsp['distances']`` (one row per cell: its neighbours after itself, as scanpy stores them) and reports the
    mean fraction of each sampled cell's exact neighbours present in its row, with the 1st, 5th and 50th
    percentiles. The stores' neighbours are compared as sets, so the order and the distances do not matter.

Usage
    python bench/bench_knn_recall.py --embedding results/bench/pca.zarr \\
        --graph pynndescent=nb_pynndescent.zarr --graph ivf=nb_ivf.zarr --out bench/results/knn_recall.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def _exact(x: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    """The exact ``k`` nearest other rows of each query (float64 brute force)."""
    xt = x.T.astype(np.float64)
    norms = (x.astype(np.float64) ** 2).sum(axis=1)
    out = []
    for start in range(0, queries.size, 100):
        q = queries[start:start + 100]
        d = norms[q][:, None] - 2 * (x[q].astype(np.float64) @ xt) + norms[None, :]
        d[np.arange(q.size), q] = np.inf
        part = np.argpartition(d, k, axis=1)[:, :k]
        out.append(part)
    return np.vstack(out)


def _rows(store: str, key: str) -> tuple[np.ndarray, np.ndarray]:
    import zarr

    g = zarr.open_group(store, mode="r")[f"obsp/{key}"]
    return g["indptr"][:], g["indices"][:]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--embedding", required=True, help="store holding the embedding")
    p.add_argument("--use-rep", default="X_pca", help="obsm key of the embedding (default X_pca)")
    p.add_argument("--graph", action="append", default=[], metavar="LABEL=STORE",
                   help="a store with obsp['distances'] to score (repeatable)")
    p.add_argument("--key", default="distances", help="obsp key of the kNN rows (default distances)")
    p.add_argument("--sample", type=int, default=2000, help="cells scored (default 2000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    import zarr

    x = np.asarray(zarr.open_group(args.embedding, mode="r")[f"obsm/{args.use_rep}"][:])
    rng = np.random.default_rng(args.seed)
    queries = np.sort(rng.choice(x.shape[0], min(args.sample, x.shape[0]), replace=False))
    graphs = dict(g.split("=", 1) for g in args.graph)
    rows = {label: _rows(store, args.key) for label, store in graphs.items()}
    ks = {label: int(np.diff(indptr[:2])[0]) for label, (indptr, _) in rows.items()}
    k = max(ks.values()) if ks else 14
    t0 = time.time()
    exact = _exact(x, queries, k)
    result = {"embedding": args.embedding, "cells": int(x.shape[0]), "dims": int(x.shape[1]),
              "sample": int(queries.size), "seed": args.seed, "k": k, "exact_seconds": round(time.time() - t0, 1),
              "graphs": {}}
    for label, (indptr, indices) in rows.items():
        rec = np.array([len(set(indices[indptr[i]:indptr[i + 1]]) & set(exact[j])) / k
                        for j, i in enumerate(queries)])
        result["graphs"][label] = {"store": graphs[label], "recall": round(float(rec.mean()), 4),
                                   "p1": round(float(np.percentile(rec, 1)), 4),
                                   "p5": round(float(np.percentile(rec, 5)), 4),
                                   "median": round(float(np.median(rec)), 4)}
        print(f"{label}: recall {rec.mean():.4f} (p1 {np.percentile(rec, 1):.3f}, p5 {np.percentile(rec, 5):.3f}, "
              f"median {np.median(rec):.3f}) of the exact {k} neighbours, {queries.size} cells")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
