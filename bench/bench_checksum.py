#!/usr/bin/env python
"""Benchmark: the cost of zstd's content checksum on every chunk (atlasflow.store), side by side in one run.

What it does
    Simulates a raw store (``--n-cells`` x ``--n-genes``, once), then, alternating the two modes
    ``--repeats`` times on one two-worker cluster: the normalize stage (reads X's values, writes new values:
    ``write_mapped_values``) into a fresh store, and a full read of that store's X (every block decoded and
    summed). ``checksum``: zstd frames carry their checksum (atlasflow's default); ``plain``: zarr's own default
    (no checksum), set in the client and in every worker.

Output
    A Markdown table on stdout (and ``--results`` if given): median seconds per mode and the ratio.

Usage
    .venv/bin/python bench/bench_checksum.py --n-cells 100000 --workdir /tmp/bck --results bench/results/checksum.md
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path


def set_checksum(on: bool) -> None:
    """Make new arrays of this process carry zstd checksums (on) or not (zarr's default)."""
    import zarr
    import zarr.core.array

    from atlasflow import store

    zarr.core.array.default_compressors_v3 = (store.format._checksummed_zstd if on else
                                              (lambda dtype=None: (zarr.codecs.ZstdCodec(level=0, checksum=False),)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-cells", type=int, default=100_000)
    p.add_argument("--n-genes", type=int, default=20_000)
    p.add_argument("--chunk-rows", type=int, default=5_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workdir", default="/tmp/bench-checksum")
    p.add_argument("--results", default=None)
    args = p.parse_args()

    import numpy as np
    from distributed import Client, LocalCluster

    from atlasflow import pp, progress
    from atlasflow.simulate import SimParams, write_simulated
    from atlasflow.store import open_store, write_store

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    raw = work / "raw.zarr"
    if not raw.exists():
        t = time.time()
        write_simulated(raw, SimParams(n_cells=args.n_cells, n_genes=args.n_genes), chunk_rows=args.chunk_rows,
                        threads=2)
        print(f"simulated {args.n_cells} x {args.n_genes} in {time.time() - t:.0f} s")
    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0")
    client = Client(cluster)
    times: dict[str, dict[str, list[float]]] = {"checksum": {"write": [], "read": []},
                                                 "plain": {"write": [], "read": []}}
    sizes = {}
    for _ in range(args.repeats):
        for mode in ("checksum", "plain"):
            set_checksum(mode == "checksum")
            client.run(set_checksum, mode == "checksum")
            out = work / f"norm-{mode}.zarr"
            shutil.rmtree(out, ignore_errors=True)
            t = time.time()
            adata = open_store(raw, chunk_rows=args.chunk_rows)
            pp.normalize_total(adata, target_sum=1e4)
            write_store(adata, out, chunk_rows=args.chunk_rows)
            times[mode]["write"].append(time.time() - t)
            t = time.time()
            x = open_store(out, chunk_rows=args.chunk_rows).X
            total = progress.compute(x.map_blocks(lambda b: np.array([[float(b.sum())]]), chunks=(1, 1),
                                                  dtype=float).sum(), label="read")[0]
            times[mode]["read"].append(time.time() - t)
            sizes[mode] = sum(f.stat().st_size for f in (out / "X" / "data").rglob("*") if f.is_file())
            print(f"{mode}: write {times[mode]['write'][-1]:.2f} s, read {times[mode]['read'][-1]:.2f} s "
                  f"(sum {total:.6g})")
    client.close()
    cluster.close()
    med = {m: {k: statistics.median(v) for k, v in d.items()} for m, d in times.items()}
    lines = [f"# zstd checksum cost: normalize (values rewritten) and a full read of X, {args.n_cells:,} x "
             f"{args.n_genes:,}, 2 workers, median of {args.repeats}, modes alternated in one run", "",
             "| step | checksum s | plain s | ratio |", "|---|---:|---:|---:|"]
    for step in ("write", "read"):
        a, b = med["checksum"][step], med["plain"][step]
        lines.append(f"| {step} | {a:.2f} | {b:.2f} | {a / b:.3f} |")
    lines.append(f"| X/data bytes | {sizes['checksum']:,} | {sizes['plain']:,} | "
                 f"{sizes['checksum'] / sizes['plain']:.5f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.results:
        Path(args.results).write_text(text)


if __name__ == "__main__":
    main()
