#!/usr/bin/env python
"""How X is chunked and sharded on disk: write time, read time and files per store, side by side (issue #23).

    python bench/bench_store_layout.py --n-cells 100000          # under the anndata 0.13 stack

anndata 0.13 writes Zarr v3 arrays with automatic sharding by default (``ad.settings.auto_shard_zarr_v3``);
atlasflow writes X itself, unsharded, in chunks of ``FLAT_CHUNK`` values. This writes one simulated raw-count
X (``--n-cells`` x ``--n-genes``) in each layout from memory and reads it back the way every stage does (the
lazy row-block reader, all blocks, two threads), and counts the files each layout leaves. The writes
leave the files in the page cache: the read times are decode-and-assemble times, not disk times.

Layouts: ``atlasflow`` (our writer: 1-D chunks of 2^20 values, no shards), ``anndata-autoshard``
(``anndata.io.write_elem`` with anndata 0.13's defaults), ``anndata-noshard`` (the same with auto-sharding
off, as our format module sets it), and ``atlasflow-shard16`` (our chunks grouped 16 to a shard).
Results go to ``bench/results/store_layout.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import time
from importlib.metadata import version
from pathlib import Path

import anndata as ad
import dask
import numpy as np
import scipy.sparse as sp
import zarr

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from atlasflow.simulate import SimParams, write_simulated  # noqa: E402
from atlasflow.store import FLAT_CHUNK, lazy_elem, write_csr_blocks  # noqa: E402


def files_and_bytes(path: Path) -> tuple[int, int]:
    n = size = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            n += 1
            size += os.path.getsize(os.path.join(dirpath, f))
    return n, size


def write_layout(name: str, x: sp.csr_matrix, path: Path, chunk_rows: int) -> None:
    group = zarr.open_group(str(path), mode="w", zarr_format=3)
    if name == "atlasflow":
        write_csr_blocks(path, "X", (x[i : i + chunk_rows] for i in range(0, x.shape[0], chunk_rows)), x.shape)
    elif name == "atlasflow-shard16":
        sub = group.require_group("X")
        sub.attrs.update({"encoding-type": "csr_matrix", "encoding-version": "0.1.0", "shape": list(x.shape)})
        for part, values in (("data", x.data), ("indices", x.indices), ("indptr", x.indptr.astype(np.int32))):
            chunk = min(FLAT_CHUNK, values.shape[0])
            arr = sub.create_array(part, shape=values.shape, dtype=values.dtype, chunks=(chunk,),
                                   shards=(16 * chunk,))
            arr[:] = values
    else:
        with ad.settings.override(auto_shard_zarr_v3=(name == "anndata-autoshard")):
            ad.io.write_elem(group, "X", x)


def read_all(path: Path, chunk_rows: int) -> float:
    """Sum of every stored value, reading all row blocks as a stage does."""
    x = lazy_elem(path, "X", chunk_rows=chunk_rows, store_id=path.name)
    sums = x.map_blocks(lambda b: np.array([[b.data.sum(dtype=np.float64)]]), chunks=(1, 1), dtype=np.float64)
    with dask.config.set(scheduler="threads", num_workers=2):
        return float(sums.sum().compute())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-cells", type=int, default=100_000)
    p.add_argument("--n-genes", type=int, default=20_000)
    p.add_argument("--chunk-rows", type=int, default=10_000)
    p.add_argument("--repeats", type=int, default=3, help="write and read each layout this many times")
    p.add_argument("--workdir", type=Path, default=ROOT / "bench" / "work" / "store_layout")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "store_layout.md")
    args = p.parse_args()
    if not hasattr(ad.settings, "auto_shard_zarr_v3"):
        sys.exit("run this under anndata >= 0.13 (its auto-sharding is what is measured)")
    args.workdir.mkdir(parents=True, exist_ok=True)
    raw = args.workdir / f"raw_{args.n_cells}.zarr"
    if not raw.exists():
        write_simulated(raw, SimParams(n_cells=args.n_cells, n_genes=args.n_genes), chunk_rows=args.chunk_rows)
    x = ad.read_zarr(raw).X
    expected = float(x.data.sum(dtype=np.float64))
    print(f"X: {x.shape[0]} x {x.shape[1]}, {x.nnz} stored values", flush=True)
    layouts = ["atlasflow", "anndata-noshard", "anndata-autoshard", "atlasflow-shard16"]
    rows = {}
    for rep in range(args.repeats):
        for name in layouts:  # interleaved, so drift on a shared machine hits every layout alike
            path = args.workdir / f"{name}.zarr"
            shutil.rmtree(path, ignore_errors=True)
            t0 = time.perf_counter()
            write_layout(name, x, path, args.chunk_rows)
            t_write = time.perf_counter() - t0
            t0 = time.perf_counter()
            total = read_all(path, args.chunk_rows)
            t_read = time.perf_counter() - t0
            assert abs(total - expected) <= 1e-9 * abs(expected), (name, total, expected)
            n_files, n_bytes = files_and_bytes(path)
            meta = zarr.open_array(str(path / "X" / "data"), mode="r")
            r = rows.setdefault(name, {"write": [], "read": []})
            r["write"].append(t_write)
            r["read"].append(t_read)
            r.update(files=n_files, mib=n_bytes / 2**20, chunks=meta.chunks[0], shards=getattr(meta, "shards", None))
            print(f"[{rep}] {name}: write {t_write:.1f} s, read {t_read:.1f} s, {n_files} files", flush=True)
    base = rows["atlasflow"]
    lines = [
        f"# Layout of X on disk: {args.n_cells} x {args.n_genes} simulated counts, {x.nnz} stored values",
        "",
        f"`python bench/bench_store_layout.py --n-cells {args.n_cells}`; anndata {version('anndata')}, "
        f"zarr {version('zarr')}, Python {platform.python_version()}, {os.cpu_count()} cores. Median of "
        f"{args.repeats} interleaved runs; read = every row block of {args.chunk_rows} cells through atlasflow's "
        "lazy reader on 2 threads, files in the page cache.",
        "",
        "| layout | chunk (values) | shard (values) | files in X | MiB | write s | read s | write vs atlasflow | read vs atlasflow |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in layouts:
        r = rows[name]
        w, rd = float(np.median(r["write"])), float(np.median(r["read"]))
        bw, br = float(np.median(base["write"])), float(np.median(base["read"]))
        shard = r["shards"][0] if r["shards"] else "-"
        lines.append(f"| {name} | {r['chunks']} | {shard} | {r['files']} | {r['mib']:.0f} | {w:.1f} | {rd:.1f} | "
                     f"{w / bw:.2f}x | {rd / br:.2f}x |")
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
