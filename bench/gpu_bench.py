"""GPU vs CPU time of each stage (qc .. pca, markers by t-test) and of the kNN search, on the same simulated cells.

Run by bench/gpu_check.sh on a GPU machine; also runs without a GPU (``--skip-gpu``) to try it out.

What is measured: the stage functions (``atlasflow.pp``), one after the other as the workflow chains them,
on a matrix already in the workers' memory (host memory for the CPU cluster of one single-threaded worker
per core; GPU memory for the GPU cluster of one worker per GPU). Reading Zarr stores is left out: it costs
the same CPU work on both backends. Lazy steps (filter, log1p, subset) only build graphs; their cost lands
in the next stage that computes, as in the workflow.

The data: ``--base-cells`` cells (default 50,000) simulated by atlasflow.simulate, repeated to
``--cells`` (the cost of a stage depends on the number of cells and non-zeros, not on their being
distinct; kNN uses the first ``--knn-cells`` cells, all distinct). CPU and GPU are compared on the first
``--cpu-cells`` cells (default 200,000: the CPU chain on 1M cells would not fit a short device check);
the GPU alone also runs all ``--cells``.

Results go to OUTDIR/bench.md (a table) and OUTDIR/bench.json, rewritten after every stage so that a run
stopped by its time limit still leaves what it measured. CPU stages that would start after
``--budget-s`` seconds are skipped and marked so (GPU ones 30 s later).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

log = logging.getLogger("gpu_bench")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cells", type=int, default=1_000_000, help="cells of the GPU-only run")
    p.add_argument("--cpu-cells", type=int, default=200_000,
                   help="cells of the CPU vs GPU comparison (the first ones of the same data)")
    p.add_argument("--base-cells", type=int, default=50_000, help="distinct simulated cells, repeated to --cells")
    p.add_argument("--genes", type=int, default=5000)
    p.add_argument("--median-counts", type=float, default=2000)
    p.add_argument("--chunk-rows", type=int, default=20_000)
    p.add_argument("--n-top-genes", type=int, default=2000)
    p.add_argument("--n-comps", type=int, default=50)
    p.add_argument("--knn-cells", type=int, default=40_000,
                   help="cells of the kNN comparison (at most 0.9 x --base-cells: the first cells, all distinct)")
    p.add_argument("--n-neighbors", type=int, default=15)
    p.add_argument("--cpu-workers", type=int, default=os.cpu_count())
    p.add_argument("--gpu-preset", default="performance", choices=["performance", "capacity"])
    p.add_argument("--budget-s", type=float, default=200, help="start no CPU stage after this many seconds")
    p.add_argument("--skip-cpu", action="store_true")
    p.add_argument("--skip-gpu", action="store_true")
    p.add_argument("--outdir", default="bench/results/gpu")
    return p.parse_args(argv)


class Report:
    """Rows of the table, rewritten to OUTDIR after every change."""

    def __init__(self, outdir: Path, meta: dict):
        self.outdir, self.meta, self.rows, self.info = outdir, meta, [], {}
        outdir.mkdir(parents=True, exist_ok=True)

    def row(self, stage, times: dict, note=""):
        self.rows.append({"stage": stage, **{k: times.get(k) for k in RUNS}, "note": note})
        self.write()

    def write(self):
        (self.outdir / "bench.json").write_text(json.dumps({"meta": self.meta, "info": self.info, "rows": self.rows},
                                                           indent=1, default=str))
        m = self.meta
        small, full = f"{m['cpu_cells']:,}", f"{m['cells']:,}"
        lines = [f"# atlasflow GPU benchmark ({time.strftime('%Y-%m-%d %H:%M')})", "",
                 f"Simulated counts ({m['base_cells']:,} distinct cells repeated), {m['genes']:,} genes, "
                 f"~{m.get('nnz_per_cell', 0):.0f} non-zeros per cell, chunk_rows={m['chunk_rows']:,}; the matrix "
                 "is in worker memory (no Zarr I/O). Seconds per stage, wall clock.",
                 f"CPU: {m['cpu_workers']} single-threaded Dask workers ({m['cpu']}). GPU: {m.get('gpu', '-')} "
                 f"({m.get('gpu_cluster', '-')}).", "",
                 f"| stage | CPU s, {small} cells | GPU s, {small} cells | speedup | GPU s, {full} cells | note |",
                 "| --- | ---: | ---: | ---: | ---: | --- |"]
        for r in self.rows:
            c, g, f = r["cpu"], r["gpu"], r["gpu_full"]
            sp = f"{c / g:.1f}x" if isinstance(c, float) and isinstance(g, float) and g > 0 else ""
            lines.append(f"| {r['stage']} | {_fmt(c)} | {_fmt(g)} | {sp} | {_fmt(f)} | {r['note']} |")
        stage_rows = [r for r in self.rows if r["stage"] in STAGES]
        if len(stage_rows) == len(STAGES):
            tot = {k: sum(r[k] for r in stage_rows) if all(isinstance(r[k], float) for r in stage_rows) else None
                   for k in RUNS}
            sp = f"{tot['cpu'] / tot['gpu']:.1f}x" if tot["cpu"] and tot["gpu"] else ""
            lines.append(f"| **qc..markers** | {_fmt(tot['cpu'])} | {_fmt(tot['gpu'])} | {sp} "
                         f"| {_fmt(tot['gpu_full'])} | |")
        lines += ["", *(f"- {k}: {v}" for k, v in self.info.items())]
        (self.outdir / "bench.md").write_text("\n".join(lines) + "\n")


RUNS = ("cpu", "gpu", "gpu_full")


def _fmt(v):
    return f"{v:.2f}" if isinstance(v, float) else (v or "")


# ------------------------------------------------------------------------------------------------ data


def simulate_blocks(args):
    """The distinct simulated cells as CSR blocks of chunk_rows rows, var, and their cell types."""
    import scipy.sparse as sp

    from atlasflow.simulate import SimParams, cell_obs, iter_blocks, make_design

    params = SimParams(n_cells=args.base_cells, n_genes=args.genes, median_counts=args.median_counts, seed=0)
    subs = list(iter_blocks(params.validate(), threads=os.cpu_count() or 1))
    x = sp.vstack(subs, format="csr")
    x.data = x.data.astype(np.float32, copy=False)
    blocks = [x[s:s + args.chunk_rows] for s in range(0, x.shape[0], args.chunk_rows)]
    return blocks, make_design(params).var.copy(), cell_obs(params)["cell_type"].to_numpy()


def scattered_matrix(client, base_blocks, n_cells, chunk_rows, name):
    """A Dask array of n_cells rows whose blocks are copies of the base blocks, scattered over the workers."""
    import dask.array as da
    import scipy.sparse as sp

    sizes, parts, i = [], [], 0
    while sum(sizes) < n_cells:
        b = base_blocks[i % len(base_blocks)]
        rows = min(b.shape[0], n_cells - sum(sizes))
        parts.append(b if rows == b.shape[0] else b[:rows])
        sizes.append(rows)
        i += 1
    futures = client.scatter(parts, hash=False)
    dsk = {(name, j, 0): f for j, f in enumerate(futures)}
    meta = sp.csr_matrix((0, 0), dtype=np.float32)
    return da.Array(dsk, name, chunks=(tuple(sizes), (base_blocks[0].shape[1],)), dtype=np.float32, meta=meta), futures


def make_adata(x, var, cell_types):
    """The AnnData of a run: X, var, and obs['cell_type'] (the simulated types, repeated as the cells are)."""
    import anndata as ad
    import pandas as pd

    n = x.shape[0]
    obs = pd.DataFrame({"cell_type": pd.Categorical(np.resize(cell_types, n))},
                       index=pd.Index([f"c{i}" for i in range(n)]))
    return ad.AnnData(X=x, obs=obs, var=var.copy())


# ---------------------------------------------------------------------------------------------- stages

STAGES = ["qc", "filter", "normalize", "log1p", "hvg", "subset", "scale", "pca", "rank_genes_groups"]


def run_stage(stage, st, args):
    """One stage on state ``st`` (its ``a`` is the AnnData); computes what the stage computes."""
    from atlasflow import pp

    a = st["a"]
    if stage == "qc":
        a.var["mt"] = pp.gene_set_masks(a.var, {"mt": {"prefix": "MT-"}})["mt"]
        pp.calculate_qc_metrics(a, qc_vars=["mt"], percent_top=[50, 100, 200, 500])
    elif stage == "filter":
        cells, genes, _ = pp.qc_filter_masks(a, thresholds={"min_genes": 200, "max_pct_mt": 20},
                                             min_cells=3)
        st["a"] = pp.filter_cells_genes(a, cells, genes)
    elif stage == "normalize":
        pp.normalize_total(a, target_sum=1e4)
    elif stage == "log1p":
        pp.log1p(a)
        st["lognorm"] = a.copy()  # all genes, log-normalised: what the markers stage reads (lazy, no data copied)
    elif stage == "hvg":
        pp.highly_variable_genes(a, flavor="seurat", n_top_genes=min(args.n_top_genes, a.n_vars))
    elif stage == "subset":
        pp.subset_genes(a, a.var["highly_variable"].to_numpy())
    elif stage == "scale":
        pp.scale(a, max_value=10)
    elif stage == "pca":
        pp.pca(a, n_comps=args.n_comps)
    elif stage == "rank_genes_groups":  # t-test of each simulated cell type against the rest, all genes
        from atlasflow import tl

        tl.rank_genes_groups(st["lognorm"], "cell_type", method="t-test")
    return st


def warm_up(client, x, var, cell_types, args):
    """The whole chain on 2,000 cells: CUDA contexts, CuPy kernel compilation, imports on the workers."""
    st = {"a": make_adata(x[: min(2000, x.shape[0])], var, cell_types)}
    with client.as_current():
        for stage in STAGES:
            run_stage(stage, st, argparse.Namespace(**{**vars(args), "n_comps": 10, "n_top_genes": 500}))


def main(argv=None):
    args = parse_args(argv)
    args.base_cells = min(args.base_cells, args.cells)
    args.cpu_cells = max(args.chunk_rows, min(args.cpu_cells, args.cells) // args.chunk_rows * args.chunk_rows)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    t_start = time.monotonic()
    from distributed import Client, LocalCluster, wait

    from atlasflow import gpu, gpu_cluster

    for noisy in ("distributed", "atlasflow.progress", "numba", "tornado", "bokeh"):  # after importing distributed,
        logging.getLogger(noisy).setLevel(logging.WARNING)  # which sets its own loggers' levels

    use_gpu = not args.skip_gpu and gpu.device_count() > 0
    if not args.skip_gpu and not use_gpu:
        log.warning("no GPU visible: CPU only")
    meta = {"cells": args.cells, "cpu_cells": args.cpu_cells, "genes": args.genes, "base_cells": args.base_cells,
            "chunk_rows": args.chunk_rows, "cpu_workers": args.cpu_workers,
            "cpu": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "python": platform.python_version()}
    rep = Report(Path(args.outdir), meta)

    t = time.monotonic()
    base, var, cell_types = simulate_blocks(args)
    meta["nnz_per_cell"] = sum(b.nnz for b in base) / args.base_cells
    rep.info["simulate"] = f"{args.base_cells:,} cells in {time.monotonic() - t:.1f} s"

    clients, states, clusters = {}, {}, []
    if not args.skip_cpu:
        t = time.monotonic()
        cl = LocalCluster(n_workers=args.cpu_workers, threads_per_worker=1, processes=True, dashboard_address=":0",
                          memory_limit=int(0.8 * _host_memory() / max(1, args.cpu_workers)),
                          silence_logs=logging.ERROR)
        clusters.append(cl)
        clients["cpu"] = Client(cl, set_as_default=False)
        x, _ = scattered_matrix(clients["cpu"], base, args.cpu_cells, args.chunk_rows, "bench-x-cpu")  # in memory
        states["cpu"] = {"x": x}
        rep.info["cpu load"] = f"cluster start + scatter {time.monotonic() - t:.1f} s"
    if use_gpu:
        import cupy

        t = time.monotonic()
        overrides = {} if args.gpu_preset != "performance" or gpu_cluster.ucx_available() else {"protocol": "tcp"}
        try:
            cl = gpu_cluster.local_cuda_cluster(args.gpu_preset, **overrides)
        except Exception as exc:  # noqa: BLE001 - dask-cuda failing to start must not cost the whole measurement
            log.exception("the GPU cluster did not start; retrying without dask-cuda")
            rep.info["dask-cuda cluster"] = f"did not start ({type(exc).__name__}: {str(exc)[:120]}); plain cluster"
            overrides["use_dask_cuda"] = False
            cl = gpu_cluster.local_cuda_cluster(args.gpu_preset, **overrides)
        clusters.append(cl)
        clients["gpu"] = clients["gpu_full"] = Client(cl, set_as_default=False)
        clients["gpu"].wait_for_workers(len(cl.workers), timeout=180)
        name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
        meta["gpu"] = f"{len(cl.workers)} x {name.decode() if isinstance(name, bytes) else name}"
        with_dask_cuda = gpu_cluster.dask_cuda_available() and overrides.get("use_dask_cuda", True)
        meta["gpu_cluster"] = (f"{'dask-cuda' if with_dask_cuda else 'no dask-cuda'}, {args.gpu_preset} preset"
                               f"{', TCP (no UCX here)' if overrides.get('protocol') == 'tcp' else ''}")
        x_host, futures = scattered_matrix(clients["gpu"], base, args.cells, args.chunk_rows, "bench-x-gpu")
        with clients["gpu"].as_current():
            x = gpu.to_device(x_host).persist()
            wait(x)
        del x_host, futures
        states["gpu"] = {"x": x[: args.cpu_cells]}
        states["gpu_full"] = {"x": x}
        rep.info["gpu load"] = f"cluster start + scatter + copy to the GPU {time.monotonic() - t:.1f} s"

    for run in ("cpu", "gpu"):
        if run in states:
            t = time.monotonic()
            warm_up(clients[run], states[run]["x"], var, cell_types, args)
            label = f"{run} warm-up (the chain on 2,000 cells: imports; on the GPU CUDA contexts and CuPy kernels)"
            rep.info[label] = f"{time.monotonic() - t:.1f} s"
    for st in states.values():
        st["a"] = make_adata(st.pop("x"), var, cell_types)
    rep.write()

    for stage in STAGES:
        times = {}
        for run in ("gpu", "cpu", "gpu_full"):
            if run not in states:
                continue
            limit = args.budget_s if run == "cpu" else args.budget_s + 30
            if states[run].get("stopped") or time.monotonic() - t_start > limit:
                states[run]["stopped"] = True
                times[run] = "skipped (time)"
                continue
            t = time.monotonic()
            try:
                with clients[run].as_current():
                    run_stage(stage, states[run], args)
                times[run] = time.monotonic() - t
            except Exception as exc:  # noqa: BLE001 - record it, keep measuring the other runs
                log.exception("%s on %s failed", stage, run)
                times[run] = f"failed: {type(exc).__name__}: {str(exc)[:80]}"
                states[run]["stopped"] = True
        note = "lazy (graph only)" if stage in ("filter", "log1p", "subset") else ""
        if stage == "filter":
            kept = [f"{st['a'].n_obs:,}" for st in states.values() if not st.get("stopped")]
            note += f"; cells kept: {' / '.join(kept)}"
        rep.row(stage, times, note)
        log.info("%s: %s", stage, times)

    emb = next((st["a"].obsm["X_pca"] for st in states.values() if "X_pca" in st["a"].obsm), None)
    for closable in [*set(clients.values()), *clusters]:
        with contextlib.suppress(Exception):  # a worker dying on shutdown must not lose the results
            closable.close()
    if emb is not None:
        knn_row(rep, np.asarray(emb)[: min(args.knn_cells, int(0.9 * args.base_cells))], args, use_gpu,
                cpu_ok=not args.skip_cpu and time.monotonic() - t_start < args.budget_s + 20)
    rep.info["total wall time"] = f"{time.monotonic() - t_start:.1f} s"
    rep.write()
    print((Path(args.outdir) / "bench.md").read_text())
    return 0


def knn_row(rep, emb, args, use_gpu, cpu_ok):
    from atlasflow import gpu

    k = args.n_neighbors + 1
    times, note = {}, f"{emb.shape[0]:,} cells x {emb.shape[1]} PCs, k={k}, exact"
    if use_gpu:
        gpu.knn_gpu(emb[:3000], k)  # CUDA context and kernel compilation
        t = time.monotonic()
        ind_g, _ = gpu.knn_gpu(emb, k)
        times["gpu"] = time.monotonic() - t
    if cpu_ok:
        from sklearn.neighbors import NearestNeighbors

        t = time.monotonic()
        _, ind_c = NearestNeighbors(n_neighbors=k, algorithm="brute", n_jobs=-1).fit(emb).kneighbors(emb)
        times["cpu"] = time.monotonic() - t
        if use_gpu:
            note += f"; neighbours equal to sklearn's: {(np.sort(ind_g, 1) == np.sort(ind_c, 1)).mean():.4%}"
    else:
        times["cpu"] = "skipped (time)"
    rep.row("kNN (sklearn brute / atlasflow.gpu.knn_gpu)", times, note)


def _host_memory() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


if __name__ == "__main__":
    sys.exit(main())
