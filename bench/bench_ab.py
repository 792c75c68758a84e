"""Benchmark: one stage script at two git revisions, side by side in one run (alternating, A B A B ...).

    python bench/bench_ab.py --rev-a 81668bc --input /tmp/b100k/simulate.zarr --stage qc --repeats 3

Revision A runs from a temporary ``git worktree`` (its ``src`` first on PYTHONPATH, so the stage process and
its Dask workers import that revision); B is this checkout. Each run is the real script in its own process
with its own local cluster (``--n-workers``, ``--chunk-rows``), measured as ``bench_foundation.py`` measures a
stage (wall and CPU time, peak summed RSS of the process tree). The two outputs are compared element by
element (X, every obs/var column and every array under uns), so a refactor that should change nothing is
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


def same_store(a: Path, b: Path) -> str:
    """'identical' or what differs between two stage outputs (X and obs/var columns)."""
    import anndata as ad
    import numpy as np

    x, y = ad.read_zarr(a), ad.read_zarr(b)
    if x.shape != y.shape:
        return f"shapes {x.shape} vs {y.shape}"
    if (x.X != y.X).nnz if hasattr(x.X, "nnz") else not np.array_equal(x.X, y.X):
        return "X differs"
    for axis in ("obs", "var"):
        p, q = getattr(x, axis), getattr(y, axis)
        if list(p.columns) != list(q.columns):
            return f"{axis} columns differ"
        for c in p.columns:
            if not p[c].equals(q[c]):
                return f"{axis}[{c!r}] differs"
    return _same_uns(x.uns, y.uns, "uns")


def _same_uns(a, b, where: str) -> str:
    """'identical' or the first uns entry that differs (arrays bit for bit, NaN equal to NaN)."""
    import numpy as np

    if isinstance(a, dict) or isinstance(b, dict):
        if not (isinstance(a, dict) and isinstance(b, dict)) or sorted(a) != sorted(b):
            return f"{where} keys differ"
        for k in a:
            verdict = _same_uns(a[k], b[k], f"{where}[{k!r}]")
            if verdict != "identical":
                return verdict
        return "identical"
    if hasattr(a, "dtype") and a.dtype.names:  # scanpy's record arrays: field by field
        return "identical" if all(np.array_equal(a[f], b[f], equal_nan=a[f].dtype.kind == "f")
                                  for f in a.dtype.names) else f"{where} differs"
    a, b = np.asarray(a), np.asarray(b)
    return "identical" if np.array_equal(a, b, equal_nan=a.dtype.kind == "f") else f"{where} differs"


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
