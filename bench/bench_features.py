#!/usr/bin/env python
"""Benchmark: hvg -> subset -> scale -> pca of atlasflow (stage scripts, out of core) against scanpy (in memory).

What it does
    Takes a log-normalised store (the ``log1p.zarr`` that ``bench/bench_foundation.py --workdir W`` leaves in
    W) and runs, one after the other on the same machine:

    * atlasflow: the four stage scripts, each in its own process with its own local cluster (as a Snakemake
      job runs them): ``hvg`` (flavor seurat, 2,000 genes), ``subset``, ``scale`` (max_value 10), ``pca``
      (50 components, the Gram-matrix solver, computing from subset's sparse matrix scaled on the fly as the
      workflow does), then ``pca_dense``: the same PCA reading scale's dense X (``--unscaled none``), for
      comparison only (not part of the chain's totals). ``--cluster``: each script with its own local
      cluster (per-stage), all attached to one shared cluster (shared, the workflow's local default), or
      both one after the other (default);
    * scanpy, in one child process: ``read_zarr`` of the same store into memory, then
      ``highly_variable_genes`` (same flavor and n_top_genes), the subset, ``scale(max_value=10)`` and
      ``pca(n_comps=50, svd_solver=...)`` (``--scanpy-solver``, default arpack as in the issue's reference),
      each step timed inside the child. Skipped (``--no-scanpy``) where the matrix does not fit in memory.

What it measures
    Wall and CPU time per step; peak RSS summed over each stage's process tree (client, scheduler, workers),
    sampled every 0.2 s, and of the scanpy child; the PCA agreement (variance ratios, |cosine| of the
    loadings) and the HVG set overlap (Jaccard) between the two.

Output
    ``bench/results/features_<n_cells>.md`` and ``.json`` (``--results``), also printed.

Usage
    .venv/bin/python bench/bench_foundation.py --n-cells 100000 --chunk-rows 5000 --workdir /tmp/b100k --no-ingest
    .venv/bin/python bench/bench_features.py --input /tmp/b100k/log1p.zarr
    .venv/bin/python bench/bench_features.py --input /tmp/b1m/log1p.zarr --no-scanpy      # 1M cells
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_foundation import MiB, TreeSampler, fresh_workdir, machine, run_stage  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
N_TOP = 2000
N_COMPS = 50


# --------------------------------------------------------------------------------------------------
# scanpy child


def scanpy_child(store: str, out: str, solver: str) -> None:
    """scanpy's in-memory chain on the store; timings and results to ``out`` (an .npz + .json pair)."""
    import anndata as ad
    import scanpy as sc

    t = {}
    t0 = time.time()
    a = ad.read_zarr(store)
    for key in list(a.layers):
        del a.layers[key]
    t["read"] = time.time() - t0
    t0 = time.time()
    sc.pp.highly_variable_genes(a, flavor="seurat", n_top_genes=N_TOP)
    t["hvg"] = time.time() - t0
    t0 = time.time()
    a = a[:, a.var["highly_variable"].to_numpy()].copy()
    t["subset"] = time.time() - t0
    t0 = time.time()
    sc.pp.scale(a, max_value=10)
    t["scale"] = time.time() - t0
    t0 = time.time()
    sc.pp.pca(a, n_comps=N_COMPS, svd_solver=solver)
    t["pca"] = time.time() - t0
    np.savez(out + ".npz", genes=a.var_names.to_numpy().astype(str), pcs=a.varm["PCs"],
             ratio=a.uns["pca"]["variance_ratio"])
    Path(out + ".json").write_text(json.dumps(t))


def run_scanpy(store: Path, work: Path, solver: str, timeout: float) -> dict:
    out = str(work / "scanpy")
    cmd = [sys.executable, __file__, "--scanpy-child", str(store), out, solver]
    log = work / "scanpy.log"
    t0 = time.time()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
        sampler = TreeSampler(proc.pid)
        sampler.start()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        sampler.stop()
    res = {"rc": rc, "wall_s": round(time.time() - t0, 1), "peak_rss": sampler.peak_sum}
    if rc == 0:
        res["steps"] = json.loads(Path(out + ".json").read_text())
    else:
        res["error_tail"] = log.read_text()[-2000:]
    print(f"  scanpy: rc={rc} wall {res['wall_s']} s, peak RSS {sampler.peak_sum / MiB:.0f} MiB", flush=True)
    return res


# --------------------------------------------------------------------------------------------------
# comparison


def compare(work: Path, pca_store: Path) -> dict:
    """HVG Jaccard, variance-ratio agreement and per-component |cosine| of the loadings."""
    import anndata as ad

    ref = np.load(work / "scanpy.npz", allow_pickle=False)
    ours = ad.read_zarr(pca_store)
    ours_genes = ours.var_names.to_numpy().astype(str)
    ref_genes = ref["genes"]
    a, b = set(ours_genes), set(ref_genes)
    jaccard = len(a & b) / len(a | b)
    common = sorted(a & b)
    pos_o = {g: i for i, g in enumerate(ours_genes)}
    pos_r = {g: i for i, g in enumerate(ref_genes)}
    po = np.asarray(ours.varm["PCs"])[[pos_o[g] for g in common]]
    pr = ref["pcs"][[pos_r[g] for g in common]]
    cos = np.abs(np.sum(po * pr, axis=0) / (np.linalg.norm(po, axis=0) * np.linalg.norm(pr, axis=0)))
    ratio_o = np.asarray(ours.uns["pca"]["variance_ratio"])
    rel = np.abs(ratio_o - ref["ratio"]) / ref["ratio"]
    return {"hvg_jaccard": jaccard, "min_abs_cosine_first30": float(cos[:30].min()),
            "max_rel_diff_variance_ratio": float(rel.max())}


# --------------------------------------------------------------------------------------------------
# main


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--scanpy-child":
        scanpy_child(*sys.argv[2:5])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="log-normalised store (e.g. the log1p.zarr of bench_foundation)")
    p.add_argument("--chunk-rows", type=int, default=5000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--workdir", default=None, help="where the stores go (default: beside the input)")
    p.add_argument("--cluster", choices=["per-stage", "shared", "both"], default="both",
                   help="each stage starts its own local cluster, or all attach to one shared cluster "
                        "(the workflow's default for local runs), or both, one after the other")
    p.add_argument("--memory-limit", default="auto",
                   help="memory limit per worker (e.g. 1.5GB; auto: the machine's RAM shared among the workers)")
    p.add_argument("--no-scanpy", action="store_true", help="atlasflow only (when the data do not fit in memory)")
    p.add_argument("--scanpy-solver", default="arpack")
    p.add_argument("--scanpy-timeout", type=float, default=3600)
    p.add_argument("--results", default=str(ROOT / "bench" / "results"))
    args = p.parse_args(argv)

    src = Path(args.input).resolve()
    work = fresh_workdir(Path(args.workdir or src.parent / "features").resolve())
    import zarr

    n_cells, n_genes = (int(s) for s in zarr.open_group(str(src), mode="r")["X"].attrs["shape"])
    print(f"bench features: {n_cells} cells x {n_genes} genes from {src}, chunk_rows {args.chunk_rows}, "
          f"{args.workers} workers", flush=True)
    modes = ["per-stage", "shared"] if args.cluster == "both" else [args.cluster]
    runs, ok = {}, True
    for mode in modes:
        print(f" {mode} cluster:", flush=True)
        runs[mode], mode_ok = run_chain(src, work / mode, args, shared=mode == "shared")
        ok = ok and mode_ok
    scanpy = None if args.no_scanpy else run_scanpy(src, work, args.scanpy_solver, args.scanpy_timeout)
    agreement = (compare(work, work / modes[0] / "pca.zarr")
                 if ok and scanpy and scanpy["rc"] == 0 else None)
    result = {"n_cells": n_cells, "n_genes": n_genes, "chunk_rows": args.chunk_rows, "workers": args.workers,
              "memory_limit": args.memory_limit,
              "scanpy_solver": args.scanpy_solver, "machine": machine(), "atlasflow": runs, "scanpy": scanpy,
              "agreement": agreement, "date": time.strftime("%Y-%m-%d %H:%M")}
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"features_{n_cells}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    text = report(result)
    (out / f"features_{n_cells}.md").write_text(text)
    print(text)
    return 0 if ok and (scanpy is None or scanpy["rc"] == 0) else 1


def run_chain(src: Path, work: Path, args, shared: bool) -> tuple[list[dict], bool]:
    """hvg -> subset -> scale -> pca (and pca_dense) as stage scripts; with ``shared`` all attach to one
    cluster started here (``atlasflow cluster start``), whose processes are sampled with each stage."""
    from atlasflow import shared_cluster

    work.mkdir(parents=True)
    common = ["--chunk-rows", str(args.chunk_rows), "--n-workers", str(args.workers),
              "--memory-limit", args.memory_limit]
    extra_pids = None
    if shared:
        sched_file = work / "scheduler.json"
        pids = shared_cluster.start(sched_file, n_workers=args.workers, memory_limit=args.memory_limit)
        extra_pids = {pids["scheduler"]: "shared scheduler", **{w: "shared worker" for w in pids["workers"]}}
        common += ["--scheduler-file", str(sched_file)]
    chain = [
        ("hvg", src, ["--flavor", "seurat", "--n-top-genes", str(N_TOP)]),
        ("subset", work / "hvg.zarr", []),
        ("scale", work / "subset.zarr", ["--max-value", "10"]),
        ("pca", work / "scale.zarr", ["--n-comps", str(N_COMPS), "--unscaled", str(work / "subset.zarr")]),
        ("pca_dense", work / "scale.zarr", ["--n-comps", str(N_COMPS), "--unscaled", "none"]),
    ]
    runs, ok = [], True
    try:
        for name, inp, extra in chain:
            script = [sys.executable, str(ROOT / "scripts" / f"{name.split('_')[0]}.py")]
            r = run_stage(name, ["--input", str(inp), "--output", str(work / f"{name}.zarr"), *extra, *common],
                          work, script=script, extra_pids=extra_pids)
            runs.append(r)
            ok = r["rc"] == 0
            if not ok:
                break
    finally:
        if shared:
            shared_cluster.stop(sched_file)
    return runs, ok


def report(r: dict) -> str:
    m = r["machine"]
    modes = list(r["atlasflow"])
    lines = [
        f"# Feature selection to PCA: {r['n_cells']:,} cells x {r['n_genes']:,} genes",
        "",
        f"{r['date']}. atlasflow: one stage script per step with {r['workers']} single-threaded workers, "
        f"memory limit {r.get('memory_limit', 'auto')} each, chunk_rows {r['chunk_rows']}; *per-stage*: each script starts and stops its own local cluster; "
        "*shared*: every script attaches to one cluster started before the chain (`atlasflow cluster start`, "
        "what the workflow does for local runs by default). Wall time is the script's, from process start to "
        f"exit. scanpy: one in-memory process (read_zarr, highly_variable_genes, subset, scale, pca "
        f"svd_solver={r['scanpy_solver']!r}), each step timed inside the process.",
        "",
        f"Machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores, {m.get('ram_gib', '?')} GiB RAM; "
        f"Python {m.get('python', '?')}.",
        "",
    ]
    sc = (r.get("scanpy") or {}).get("steps") or {}
    head = "| step | scanpy wall s |"
    rule = "|---|---:|"
    for mode in modes:
        head += f" {mode} wall s | {mode} peak MiB | scanpy / {mode} |"
        rule += "---:|---:|---:|"
    lines += [head, rule]
    by_mode = {mode: {run["stage"]: run for run in r["atlasflow"][mode]} for mode in modes}
    for name in by_mode[modes[0]]:
        ref = sc.get(name.split("_")[0])
        row = f"| {name} | {'' if ref is None else f'{ref:.1f}'} |"
        for mode in modes:
            run = by_mode[mode].get(name)
            if run is None:
                row += " | | |"
                continue
            ratio = f"{ref / run['wall_s']:.1f}" if ref and run["rc"] == 0 else ("failed" if run["rc"] else "")
            row += f" {run['wall_s']:.1f} | {run['peak_rss_sum'] / MiB:.0f} | {ratio} |"
        lines.append(row)
    lines.append("")
    lines.append("pca_dense: the pca stage reading scale's dense X instead of computing from subset's sparse X "
                 "(`--unscaled none`); for comparison, not part of the chain. Peak: summed RSS of every process "
                 "of the stage (with a shared cluster, its scheduler and workers too), sampled every 0.2 s.")
    for mode in modes:
        chain = [run for run in r["atlasflow"][mode] if run["stage"] != "pca_dense"]
        total = sum(run["wall_s"] for run in chain)
        peak = max(run["peak_rss_sum"] for run in chain)
        lines.append(f"atlasflow chain, {mode} cluster: {total:.0f} s wall, highest peak {peak / MiB:.0f} MiB.")
    if r.get("scanpy"):
        s = r["scanpy"]
        if s["rc"] == 0:
            steps = s["steps"]
            lines.append(f"scanpy: {s['wall_s']:.0f} s wall for the child (read {steps['read']:.0f} s + chain "
                         f"{sum(v for k, v in steps.items() if k != 'read'):.0f} s), peak {s['peak_rss'] / MiB:.0f} MiB.")
        else:
            lines.append(f"scanpy did not finish (rc {s['rc']}).")
    else:
        lines.append("scanpy not run (--no-scanpy: the matrix would not fit in this machine's memory).")
    if r.get("agreement"):
        a = r["agreement"]
        lines.append(f"Agreement: HVG Jaccard {a['hvg_jaccard']:.4f}; PCA variance ratios max relative difference "
                     f"{a['max_rel_diff_variance_ratio']:.2e}; min |cosine| of the first 30 loadings "
                     f"{a['min_abs_cosine_first30']:.5f}.")
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
