"""Benchmark: one stage script at two git revisions, side by side in one run (alternating, A B A B ...).

    python bench/bench_ab.py --rev-a 81668bc --input /tmp/b100k/simulate.zarr --stage qc --repeats 3

Revision A runs from a temporary ``git worktree`` (its ``src`` first on PYTHONPATH, so the stage process and
its Dask workers import that revision); B is this checkout. Each run is the real script in its own process
with its own local cluster (``--n-workers``, ``--chunk-rows``), measured as ``bench_foundation.py`` measures a
stage (wall and CPU time, peak summed RSS of the process tree). The two outputs are compared element by
element (every array of the two stores, in slices), so a refactor that should change nothing is
checked for that too. Besides time and memory each run records the bytes its processes read and wrote
through system calls and the peak disk space it took on the file system of ``--workdir`` (scratch files
included: sampled every 0.2 s as the file system's used space minus that at the start).
Result: ``bench/results/ab_<stage>.md`` (``--result`` to name another).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_foundation import MiB, machine, run_stage  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def same_store(a: Path, b: Path, step_bytes: int = 64 * MiB) -> str:
    """'identical' or the first stored element that differs between two stage outputs.

    Every array of the two Zarr stores (X, each obs/var column, everything under uns, obsm, obsp, ...) is
    compared value for value (NaN equal to NaN), in slices of ``step_bytes`` along its first axis: reading
    two 1M-cell outputs whole ran this machine out of memory. Group attributes are not compared.
    """
    import zarr

    return _same_group(zarr.open_group(a, mode="r"), zarr.open_group(b, mode="r"), "", step_bytes)


def _same_group(x, y, where: str, step_bytes: int) -> str:
    import zarr

    kx, ky = sorted(x.keys()), sorted(y.keys())
    if kx != ky:
        return f"{where or '/'}: members differ ({', '.join(sorted(set(kx) ^ set(ky)))})"
    for k in kx:
        p, q, name = x[k], y[k], f"{where}/{k}"
        if isinstance(p, zarr.Group) != isinstance(q, zarr.Group):
            return f"{name}: a group in one store, an array in the other"
        verdict = (_same_group(p, q, name, step_bytes) if isinstance(p, zarr.Group)
                   else _same_array(p, q, name, step_bytes))
        if verdict != "identical":
            return verdict
    return "identical"


def _same_array(p, q, name: str, step_bytes: int) -> str:
    import numpy as np

    if p.shape != q.shape or p.dtype != q.dtype:
        return f"{name}: {p.shape} {p.dtype} vs {q.shape} {q.dtype}"
    if not p.shape:
        u, v = np.asarray(p[()]), np.asarray(q[()])
        return "identical" if np.array_equal(u, v, equal_nan=u.dtype.kind in "fc") else f"{name} differs"
    row_bytes = max(1, int(np.prod(p.shape[1:], dtype=np.int64)) * max(1, p.dtype.itemsize))
    step = max(1, step_bytes // row_bytes)
    for start in range(0, p.shape[0], step):
        u, v = np.asarray(p[start:start + step]), np.asarray(q[start:start + step])
        if not np.array_equal(u, v, equal_nan=u.dtype.kind in "fc"):
            return f"{name} differs (in rows {start}..{start + len(u) - 1})"
    return "identical"


class DiskPeak(threading.Thread):
    """Peak of the used space of the file system holding ``path`` above its level at the start, in bytes."""

    def __init__(self, path: Path, period: float = 0.2):
        super().__init__(daemon=True)
        self.path, self.period, self.stop_event = path, period, threading.Event()
        self.start_used = shutil.disk_usage(path).used
        self.peak = 0

    def run(self):
        while not self.stop_event.is_set():
            self.peak = max(self.peak, shutil.disk_usage(self.path).used - self.start_used)
            self.stop_event.wait(self.period)

    def stop(self) -> int:
        self.stop_event.set()
        self.join()
        return self.peak


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev-a", required=True, help="git revision A (B is this checkout)")
    ap.add_argument("--input", required=True, type=Path, help="input store of the stage")
    ap.add_argument("--stage", default="qc")
    ap.add_argument("--stage-args", default="", help="extra arguments of the stage script, one string")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--n-workers", type=int, default=2)
    ap.add_argument("--chunk-rows", type=int, default=10_000)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/atlasflow-bench-ab"))
    ap.add_argument("--result", type=Path, default=None, help="markdown result (default bench/results/ab_<stage>.md)")
    args = ap.parse_args(argv)

    args.workdir.mkdir(parents=True, exist_ok=True)
    tree = Path(tempfile.mkdtemp(prefix="ab-", dir=args.workdir))
    subprocess.run(["git", "worktree", "add", "--detach", str(tree), args.rev_a], cwd=ROOT, check=True,
                   capture_output=True)
    runs = {"A": [], "B": []}
    try:
        for i in range(args.repeats):
            for label in ("A", "B"):
                out = args.workdir / f"{label}{i}.zarr"
                shutil.rmtree(out, ignore_errors=True)
                argv_ = ["--input", str(args.input), "--output", str(out), "--n-workers", str(args.n_workers),
                         "--chunk-rows", str(args.chunk_rows), *args.stage_args.split()]
                env_before = os.environ.get("PYTHONPATH")
                if label == "A":
                    os.environ["PYTHONPATH"] = str(tree / "src")
                try:
                    script = [sys.executable, str((tree if label == "A" else ROOT) / "scripts" / f"{args.stage}.py")]
                    disk = DiskPeak(args.workdir)
                    disk.start()
                    r = run_stage(args.stage, argv_, args.workdir, script=script)
                    r["disk_peak"] = disk.stop()
                finally:
                    os.environ.pop("PYTHONPATH", None)
                    if env_before is not None:
                        os.environ["PYTHONPATH"] = env_before
                if r["rc"] != 0:
                    print(r.get("error_tail", ""), file=sys.stderr)
                    return 1
                runs[label].append(r)
        verdict = same_store(args.workdir / "A0.zarr", args.workdir / "B0.zarr")
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    med = {k: statistics.median(r["wall_s"] for r in v) for k, v in runs.items()}
    lines = [f"# A/B: `{args.stage}` at {args.rev_a} (A) and {head.strip()} (B)", "",
             f"Input `{args.input}`, {args.n_workers} workers, chunk_rows {args.chunk_rows}, runs alternating "
             f"A B x {args.repeats}. Outputs A0 vs B0: **{verdict}**.", "",
             "| run | wall s | CPU s | peak RSS sum MiB | read MiB | written MiB | peak disk MiB |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for i in range(args.repeats):
        for k in ("A", "B"):
            r = runs[k][i]
            lines.append(f"| {k}{i} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {r['peak_rss_sum'] / MiB:.0f} | "
                         f"{r['io_read_chars'] / MiB:.0f} | {r['io_write_chars'] / MiB:.0f} | "
                         f"{r['disk_peak'] / MiB:.0f} |")
    lines += ["", f"Median wall: A {med['A']:.1f} s, B {med['B']:.1f} s, B/A = {med['B'] / med['A']:.3f}.", "",
              f"Machine: {machine()}"]
    out = args.result or ROOT / "bench" / "results" / f"ab_{args.stage}.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
