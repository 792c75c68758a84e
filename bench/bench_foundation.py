#!/usr/bin/env python
"""Benchmark the foundation stages on simulated data: wall time, CPU time and peak memory of every process.

    python bench/bench_foundation.py --n-cells 100000            # 100k cells x 20k genes, 2 workers
    python bench/bench_foundation.py --n-cells 1000000 --chunk-rows 5000 --cleanup

Runs each stage as the real script (``python scripts/<stage>.py ...``, one subprocess per stage, each
starting its own 2-worker local cluster): simulate -> qc -> filter -> normalize -> log1p, plus ingest
of the same counts written as a Cell Ranger v3 ``.h5`` when ``scripts/ingest.py`` exists. While a stage
runs, its whole process tree (client with scheduler and nannies, worker processes, helpers) is sampled
with psutil every 0.2 s; we record the peak of the summed RSS and the peak of each process. CPU time
comes from ``wait4`` (the stage and all its reaped descendants). Results go to
``bench/results/foundation_<N>.md`` (table + machine) and ``.json`` (everything).

Summed RSS counts pages shared between processes (libraries) once per process: it is an upper bound
of the memory the stage needed. The machine may be shared: the load average is recorded per stage.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from importlib.metadata import version
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20


# ------------------------------------------------------------------------------------------- sampling


class TreeSampler(threading.Thread):
    """Samples the RSS of a process and all its descendants every ``period`` seconds.

    ``extra`` maps more process ids to labels (a shared cluster's scheduler and workers, which are not the
    stage's children): they and their descendants are summed in too.
    """

    def __init__(self, pid: int, period: float = 0.2, extra: dict[int, str] | None = None):
        super().__init__(daemon=True)
        self.root, self.period, self.extra = pid, period, dict(extra or {})
        self.peak_sum, self.peak_sum_parts = 0, {}
        self.per_process: dict[int, dict] = {}
        self.io_chars = {}  # pid -> (read_chars, write_chars) at its last sample: bytes through system calls
        self.stop_event = threading.Event()

    def run(self):
        while not self.stop_event.is_set():
            self.sample()
            self.stop_event.wait(self.period)

    def sample(self):
        procs = []
        for pid in (self.root, *self.extra):
            try:
                root = psutil.Process(pid)
                procs += [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
        parts = {}
        for p in procs:
            try:
                rss = p.memory_info().rss
                io = p.io_counters()
                self.io_chars[p.pid] = (io.read_chars, io.write_chars)
                label = self.extra.get(p.pid) or _label(p, self.root)
                info = self.per_process.setdefault(p.pid, {"label": label, "peak_rss": 0})
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            info["peak_rss"] = max(info["peak_rss"], rss)
            parts[p.pid] = rss
        total = sum(parts.values())
        if total > self.peak_sum:
            self.peak_sum, self.peak_sum_parts = total, parts

    def stop(self):
        self.stop_event.set()
        self.join()

    def io_totals(self) -> tuple[int, int]:
        """Bytes read and written through system calls by every sampled process, up to its last sample
        (mmap'ed reads are not counted)."""
        return tuple(sum(v[k] for v in self.io_chars.values()) for k in (0, 1))


def _label(proc: psutil.Process, root: int) -> str:
    if proc.pid == root:
        return "client"  # the stage script; with a local cluster it also hosts the scheduler and nannies
    cmd = " ".join(proc.cmdline())
    if "resource_tracker" in cmd:
        return "resource tracker"
    if "spawn_main" in cmd or "forkserver" in cmd or "--multiprocessing-fork" in cmd:
        return "worker"
    return Path(proc.cmdline()[0]).name if proc.cmdline() else "?"


# ------------------------------------------------------------------------------------------- stages


def run_stage(name: str, argv: list[str], logdir: Path, script: list[str] | None = None,
              extra_pids: dict[int, str] | None = None) -> dict:
    """Run one stage script to completion; wall/CPU time, memory of its process tree (plus ``extra_pids``, a
    shared cluster's processes), its JSON summary. CPU time counts the stage's own process tree only."""
    cmd = script or [sys.executable, str(ROOT / "scripts" / f"{name}.py")]
    log = logdir / f"{name}.log"
    load0 = os.getloadavg()[0]
    t0 = time.time()
    with open(log, "w") as fh:
        proc = subprocess.Popen([*cmd, *argv], stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT)
        sampler = TreeSampler(proc.pid, extra=extra_pids)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        sampler.stop()
    wall = time.time() - t0
    out = {
        "stage": name, "rc": proc.returncode, "wall_s": round(wall, 2),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 2), "load_start": load0, "load_end": os.getloadavg()[0],
        "peak_rss_sum": sampler.peak_sum,
        "peak_rss_sum_parts": {f"{sampler.per_process.get(pid, {}).get('label', '?')} [{pid}]": rss
                               for pid, rss in sampler.peak_sum_parts.items()},
        "per_process": {str(pid): v for pid, v in sampler.per_process.items()},
        "io_read_chars": sampler.io_totals()[0], "io_write_chars": sampler.io_totals()[1],
        "log": str(log),
    }
    summary_path = _summary_path(argv)
    if summary_path and summary_path.exists() and proc.returncode == 0:
        out["summary"] = json.loads(summary_path.read_text())
    if proc.returncode != 0:
        out["error_tail"] = log.read_text()[-2000:]
    print(f"  {name}: rc={proc.returncode} wall {wall:.1f} s, cpu {out['cpu_s']:.1f} s, "
          f"peak RSS (sum) {sampler.peak_sum / MiB:.0f} MiB", flush=True)
    return out


def _summary_path(argv: list[str]) -> Path | None:
    if "--output" not in argv:
        return None
    return Path(argv[argv.index("--output") + 1]).with_suffix(".json")


#: the file that marks a folder as a benchmark's scratch, which a later run may delete whole
MARK = ".atlasflow-bench"


def fresh_workdir(path: Path) -> Path:
    """``path`` emptied and marked as benchmark scratch. A folder that holds anything and no mark (a user's
    folder given as ``--workdir`` by mistake) is refused with a one-line error, never deleted."""
    path = Path(path)
    if path.exists() and any(path.iterdir()) and not (path / MARK).exists():
        sys.exit(f"{Path(sys.argv[0]).name}: {path} holds files and is not a benchmark's scratch folder "
                 f"(no {MARK} in it): choose an empty or new --workdir")
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    (path / MARK).write_text("scratch of an atlasflow benchmark: the next run deletes this folder whole\n")
    return path


def du(path: Path) -> int:
    """Bytes on disk under ``path`` (hard-linked files counted once, as du does)."""
    if not path.exists():
        return 0
    seen, total = set(), 0
    for p in [path] if path.is_file() else path.rglob("*"):
        st = p.lstat()
        if p.is_file() and (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


# ------------------------------------------------------------------------------------------- machine


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout.strip())
    return {
        "cpu": cpu, "cores": len(os.sched_getaffinity(0)), "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "os": platform.platform(), "python": platform.python_version(),
        "versions": {m: version(m) for m in ("numpy", "scipy", "dask", "distributed", "zarr", "anndata", "h5py")},
        "git": commit + ("+dirty" if dirty else ""),
    }


# ------------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n-cells", type=int, default=20_000)
    p.add_argument("--n-genes", type=int, default=20_000)
    p.add_argument("--chunk-rows", type=int, default=10_000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help="where the stores go (default: a folder under /tmp)")
    p.add_argument("--cleanup", action="store_true", help="delete each store once no later stage needs it")
    p.add_argument("--no-ingest", action="store_true", help="skip writing the .h5 and the ingest stage")
    p.add_argument("--results", default=str(ROOT / "bench" / "results"))
    p.add_argument("--write-h5", default=None, help=argparse.SUPPRESS)  # internal: the .h5 writer subprocess
    args = p.parse_args(argv)
    if args.write_h5:
        return _write_h5(args)

    work = fresh_workdir(Path(args.workdir or f"/tmp/atlasflow-bench-{args.n_cells}"))
    logs = work / "logs"
    logs.mkdir()
    common = ["--chunk-rows", str(args.chunk_rows), "--n-workers", str(args.workers)]
    store = {k: str(work / f"{k}.zarr") for k in ("raw", "ingest", "qc", "filter", "normalize", "log1p")}
    print(f"bench: {args.n_cells} cells x {args.n_genes} genes, chunk_rows {args.chunk_rows}, "
          f"{args.workers} workers, in {work}", flush=True)
    runs, sizes, notes = [], {}, []

    def stage(name, argv, script=None, output=None):
        r = run_stage(name, argv, logs, script)
        runs.append(r)
        if output:
            sizes[name] = du(Path(output))
        return r["rc"] == 0

    ok = stage("simulate", ["--output", store["raw"], "--n-cells", str(args.n_cells), "--n-genes", str(args.n_genes),
                            "--seed", str(args.seed), *common], output=store["raw"])
    if not args.no_ingest:
        if (ROOT / "scripts" / "ingest.py").exists():
            h5 = work / "raw.h5"
            stage("write 10x h5 (setup)", [], script=[sys.executable, __file__, "--write-h5", str(h5), "--n-cells",
                                                     str(args.n_cells), "--n-genes", str(args.n_genes),
                                                     "--seed", str(args.seed), "--workers", str(args.workers)], output=h5)
            stage("ingest", ["--input", str(h5), "--output", store["ingest"], *common], output=store["ingest"])
            if args.cleanup:
                h5.unlink(missing_ok=True)
                shutil.rmtree(store["ingest"], ignore_errors=True)
        else:
            notes.append("scripts/ingest.py does not exist yet: ingest not measured.")
    chain = [
        ("qc", "raw", []),
        ("filter", "qc", ["--min-genes", "200", "--max-pct-mt", "20", "--min-cells", "3"]),
        ("normalize", "filter", ["--target-sum", "1e4"]),
        ("log1p", "normalize", []),
    ]
    for name, src, extra in chain:
        if not ok:
            notes.append(f"{name} not run: an earlier stage failed.")
            continue
        ok = stage(name, ["--input", store[src], "--output", store[name], *extra, *common], output=store[name])
        if args.cleanup and src != "raw":
            shutil.rmtree(store[src], ignore_errors=True)
    if args.cleanup:
        shutil.rmtree(work, ignore_errors=True)

    result = {"n_cells": args.n_cells, "n_genes": args.n_genes, "chunk_rows": args.chunk_rows,
              "workers": args.workers, "machine": machine(), "stages": runs, "store_bytes": sizes, "notes": notes,
              "date": time.strftime("%Y-%m-%d %H:%M")}
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"foundation_{args.n_cells}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"foundation_{args.n_cells}.md").write_text(report(result))
    print(report(result))
    return 0 if all(r["rc"] == 0 for r in runs) else 1


def _write_h5(args) -> int:
    from atlasflow.simulate import SimParams, write_tenx_h5

    params = SimParams(n_cells=args.n_cells, n_genes=args.n_genes, seed=args.seed)
    nnz = write_tenx_h5(args.write_h5, params, threads=args.workers)
    print(f"wrote {args.write_h5}: {nnz} non-zeros")
    return 0


# ------------------------------------------------------------------------------------------- report


def report(r: dict) -> str:
    m = r["machine"]
    lines = [
        f"# Foundation benchmark: {r['n_cells']:,} cells x {r['n_genes']:,} genes",
        "",
        f"{r['date']}, git {m['git']}. chunk_rows {r['chunk_rows']}, {r['workers']} workers (one local cluster per "
        "stage, started by the stage script: its start-up is in the wall time).",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM; {m['os']}; Python {m['python']}; "
        + ", ".join(f"{k} {v}" for k, v in m["versions"].items()) + ".",
        "",
        "| stage | wall s | CPU s | peak RSS, all processes (MiB) | largest process at that peak (MiB) "
        "| peak per process: client / workers (MiB) | stage summary peak_memory total (MiB) | cells in -> out "
        "| nnz | store on disk (MiB) | load avg start/end |",
        "|---|---:|---:|---:|---|---|---:|---|---:|---:|---|",
    ]
    for s in r["stages"]:
        parts = s["peak_rss_sum_parts"]
        big = max(parts.items(), key=lambda kv: kv[1]) if parts else ("-", 0)
        procs = sorted(s["per_process"].values(), key=lambda v: v["label"])
        client = [v["peak_rss"] for v in procs if v["label"].startswith("client")]
        workers = [v["peak_rss"] for v in procs if v["label"] == "worker"]
        per = " / ".join(f"{x / MiB:.0f}" for x in client) + (
            " / " + ", ".join(f"{x / MiB:.0f}" for x in workers) if workers else "")
        summ = s.get("summary", {})
        pm = summ.get("peak_memory", {}).get("total")
        cells = f"{summ.get('cells_in', '')} -> {summ.get('cells_out', '')}" if summ else ""
        nnz = summ.get("nnz", "")
        size = r["store_bytes"].get(s["stage"])
        lines.append(
            f"| {s['stage']}{'' if s['rc'] == 0 else ' (FAILED rc=%d)' % s['rc']} | {s['wall_s']:.1f} | {s['cpu_s']:.1f} "
            f"| {s['peak_rss_sum'] / MiB:.0f} | {big[0]} {big[1] / MiB:.0f} | {per} "
            f"| {'' if pm is None else f'{pm / MiB:.0f}'} | {cells} | {nnz} "
            f"| {'' if size is None else f'{size / MiB:.0f}'} | {s['load_start']:.1f} / {s['load_end']:.1f} |")
    total_wall = sum(s["wall_s"] for s in r["stages"] if not s["stage"].startswith("write"))
    worst = max(r["stages"], key=lambda s: s["peak_rss_sum"])
    lines += [
        "",
        f"Total wall time of the stages (without the .h5 setup): {total_wall:.0f} s. Highest peak (summed RSS of "
        f"all processes): {worst['stage']}, {worst['peak_rss_sum'] / MiB:.0f} MiB "
        f"({'under' if worst['peak_rss_sum'] < 2 * 2**30 else 'OVER'} the 2 GB target).",
        "",
        "'client' is the stage script's own process; when it starts a local cluster, the scheduler and the "
        "nannies live in it too, and 'worker' processes are its children. "
        "Peak RSS is sampled every 0.2 s over the stage's whole process tree and summed (shared library pages "
        "are counted once per process, so this is an upper bound). 'stage summary peak_memory' is what the "
        "stage itself reports (ru_maxrss of the client and of each worker, summed: peaks that may not have "
        "coincided). CPU s is user+sys of the stage and all its descendants.",
    ]
    if any(s["rc"] for s in r["stages"]):
        lines += ["", "Failures:"] + [f"- {s['stage']}: see {s['log']}\n\n```\n{s.get('error_tail', '')[-800:]}\n```"
                                      for s in r["stages"] if s["rc"]]
    if r["notes"]:
        lines += [""] + [f"- {n}" for n in r["notes"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
