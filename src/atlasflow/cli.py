"""The one entry point every stage script goes through: arguments, logging, cluster, summary, errors.

A stage module (``atlasflow.stages.<name>``) provides

* ``DESCRIPTION`` (one line for ``--help``),
* ``add_arguments(parser)`` with its parameters, named and defaulted as scanpy names them,
* ``run(args, client) -> dict`` doing the work and returning the numbers for the JSON summary,
* optionally ``NEEDS_CLUSTER = False`` when it never touches Dask.

Arguments come from the command line (``python scripts/qc.py --input ... --output ...``) or, when the
script runs under Snakemake's ``script:`` directive, from the ``snakemake`` object: named ``input`` and
``output`` entries and ``params`` whose names are the argparse destinations. One parser, two ways in.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import resource
import socket
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType

from atlasflow.errors import AtlasflowError

log = logging.getLogger("atlasflow")


def build_parser(stage: ModuleType, name: str) -> argparse.ArgumentParser:
    """The stage's parser: common options (I/O, cluster, logging) plus the stage's own."""
    p = argparse.ArgumentParser(
        prog=f"scripts/{name}.py", description=stage.DESCRIPTION, formatter_class=DefaultsHelpFormatter,
    )
    io = p.add_argument_group("input/output")
    if getattr(stage, "TAKES_INPUT", True):
        io.add_argument("--input", help="input AnnData Zarr store (required)")
    io.add_argument("--output", help="output store to write (written atomically; required)")
    io.add_argument("--summary", help="JSON summary to write (default: OUTPUT with .json instead of .zarr)")
    io.add_argument("--log", help="also write the log to this file")
    io.add_argument("--chunk-rows", type=int, default=None,
                    help="cells per row block (default: as stored in the input, or 10000)")
    dk = p.add_argument_group("dask cluster")
    dk.add_argument("--scheduler-file", default=None, help="attach to the scheduler described by this file")
    dk.add_argument("--address", default=None, help="attach to the scheduler at this address (tcp://host:port)")
    dk.add_argument("--n-workers", type=int, default=None,
                    help="workers of a local cluster (default: cores of the allocation)")
    dk.add_argument("--memory-limit", default="auto", help="memory limit per local worker (e.g. 2GB)")
    dk.add_argument("--backend", default="cpu", choices=["auto", "cpu", "gpu"], help="compute backend")
    dk.add_argument("--gpu-preset", default="capacity", choices=["performance", "capacity"],
                    help="dask-cuda cluster preset when the backend is gpu")
    stage.add_arguments(p.add_argument_group(f"{name} parameters"))
    return p


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Help lines with ``(default: X)`` where a default says something (not for None, False or [])."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "%(default)" in text or action.default in (None, False, [], argparse.SUPPRESS) or \
                action.option_strings == [] or action.nargs == 0:
            return text
        return f"{text} (default: %(default)s)"


def args_from_snakemake(parser: argparse.ArgumentParser, smk) -> argparse.Namespace:
    """Fill the parser's namespace from a Snakemake ``script:`` object (input/output/log/params/threads)."""
    args = parser.parse_args([])
    known = vars(args)
    for source in (smk.input, smk.output):
        for key, value in source.items():
            if key in known:
                setattr(args, key, value)
    for key, value in smk.params.items():
        if key not in known and key.endswith("_") and key[:-1] in known:
            key = key[:-1]  # names Snakemake reserves (keys, items, ...) travel with a trailing underscore
        if key not in known:
            raise AtlasflowError(f"rule {smk.rule}: params.{key} is not a parameter of this stage")
        setattr(args, key, value)
    if smk.log:
        args.log = str(smk.log[0])
    if args.n_workers is None and getattr(smk, "threads", None):
        args.n_workers = int(smk.threads)
    return args


def setup_logging(logfile: str | None) -> None:
    """Log to stderr and, when given, to the rule's log file.

    distributed is imported first: importing it applies its own logging config, which sets its loggers
    back to INFO (~40 lines of scheduler and worker chatter before a hand-run stage's own lines).
    """
    import distributed  # noqa: F401 - for its logging side effect, before the levels below

    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if logfile:
        Path(logfile).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(logfile, mode="a"))
    logging.basicConfig(level=logging.INFO, handlers=handlers, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("distributed", "numba", "fsspec", "asyncio", "bokeh", "tornado"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    sched = logging.getLogger("distributed.scheduler")
    if _cancelled_feed not in sched.filters:
        sched.addFilter(_cancelled_feed)


def _cancelled_feed(record: logging.LogRecord) -> bool:
    """Drop the in-process scheduler's traceback of a progress feed cancelled when a stage ends or fails
    (``asyncio.CancelledError`` in ``Scheduler.feed``): noise under the stage's own one-line result."""
    exc = record.exc_info[1] if record.exc_info else None
    return not isinstance(exc, asyncio.CancelledError)


def peak_memory(client=None) -> dict:
    """Peak resident memory (bytes) of this process and, with a client, of each worker process."""
    self_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = {"client": self_peak, "workers": {}}
    if client is not None:
        try:
            out["workers"] = client.run(lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        except Exception:  # noqa: BLE001 - best effort: never fail a stage over a statistic
            pass
    out["total"] = out["client"] + sum(out["workers"].values())
    return out


def where_it_ran(client=None) -> dict:
    """Host, SLURM job and Dask scheduler/workers, for the summary."""
    info = {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "slurm_cpus_per_task": os.environ.get("SLURM_CPUS_PER_TASK")}
    if client is not None:
        sched = client.scheduler_info()
        workers = sched.get("workers", {})
        info["scheduler"] = sched.get("address")
        info["workers"] = sorted(workers)
        # what the cluster had in all: threads and memory limit (bytes) summed over the workers
        info["threads"] = sum(int(w.get("nthreads") or 0) for w in workers.values())
        info["memory_limit"] = sum(int(w.get("memory_limit") or 0) for w in workers.values())
    return info


def _drop_script_folder() -> None:
    """Take ``scripts/`` off ``sys.path`` when a stage runs as ``python scripts/<stage>.py``: Python puts the
    script's folder first, where ``umap.py`` and ``louvain.py`` would shadow the umap-learn and louvain packages."""
    here = Path(sys.argv[0]).resolve().parent if sys.argv and sys.argv[0] else None
    if here is not None and (here / "umap.py").exists() and (here / "qc.py").exists():
        sys.path[:] = [p for p in sys.path if not p or Path(p).resolve() != here]


def stage_main(stage: ModuleType, snakemake=None, argv: list[str] | None = None) -> int:
    """Run one stage from a script: parse, log, attach to the cluster, run, summarise; exit code."""
    _drop_script_folder()
    name = stage.__name__.rsplit(".", 1)[-1]
    parser = build_parser(stage, name)
    try:
        args = args_from_snakemake(parser, snakemake) if snakemake is not None else parser.parse_args(argv)
    except AtlasflowError as exc:
        print(f"atlasflow {name}: error: {exc}", file=sys.stderr)
        return 2
    if getattr(stage, "TAKES_INPUT", True) and not args.input:
        parser.error("--input is required")
    if not args.output:
        parser.error("--output is required")
    if args.summary is None:
        args.summary = str(Path(args.output).with_suffix(".json"))
    _absolute_paths(args)
    setup_logging(args.log)
    t0 = time.time()
    try:
        check_outputs(stage, args)  # before any work: never replace what atlasflow did not write
        inputs = input_stores(stage, args)  # which stores (by id) this output is computed from
        summary = _run_with_cluster(stage, args)
    except AtlasflowError as exc:
        log.error("%s", exc)
        print(f"atlasflow {name}: error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - log the trace, show one line
        log.error("unexpected failure:\n%s", traceback.format_exc())
        print(f"atlasflow {name}: error: {type(exc).__name__}: {exc} (traceback in the log)", file=sys.stderr)
        return 1
    summary = {"stage": name, "seconds": round(time.time() - t0, 3), **summary, "input_stores": inputs}
    from atlasflow.store import write_summary

    try:
        write_summary(args.summary, summary)
        _drop_stale(stage, args)
    except AtlasflowError as exc:  # a summary path taken meanwhile by something atlasflow did not write
        print(f"atlasflow {name}: error: {exc}", file=sys.stderr)
        return 1
    log.info("%s done in %.1f s: %s", name, summary["seconds"], _one_line(summary))
    return 0


#: Arguments holding paths: made absolute so that workers started in another directory find them.
PATH_ARGS = ("input", "output", "summary", "log", "per_sample", "sample_sheet", "counts", "groups_store",
             "clusters_store", "scheduler_file", "unscaled")


def output_paths(stage: ModuleType, args) -> list[tuple[str, str, str]]:
    """(argument, path, kind) of every path the stage writes: its store (or plots folder), its summary and
    the stage's own extras (``stage.extra_outputs(args)``: CSVs, an h5ad, a gene-major copy)."""
    outs = [("output", args.output, getattr(stage, "OUTPUT_KIND", "store")), ("summary", args.summary, "file")]
    extra = getattr(stage, "extra_outputs", None)
    return outs + (list(extra(args)) if extra else [])


def check_outputs(stage: ModuleType, args) -> None:
    """Refuse, before the stage runs, an output that holds a user's data or overlaps an input (one line)."""
    from atlasflow import ownership

    ownership.check_outputs(output_paths(stage, args), list(_input_paths(stage, args).values()))


def _drop_stale(stage: ModuleType, args) -> None:
    """Remove what the workflow moved aside from a stale earlier run of these outputs (``.<name>.stale``,
    workflow/rules/consistency.smk), now that they are rebuilt."""
    import shutil

    for _, path, _ in output_paths(stage, args):
        if path:
            stale = Path(path).with_name(f".{Path(path).name}.stale")
            shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)


def _input_paths(stage: ModuleType, args) -> dict[str, str]:
    """{argument: path} of what the stage reads that exists (its input and every ``*_store``)."""
    outs = {name for name, _, _ in output_paths(stage, args)}
    return {k: v for k, v in vars(args).items() if k not in outs and (k in INPUT_ARGS or k.endswith("_store"))
            and isinstance(v, str) and v and os.path.exists(v)}


def input_stores(stage: ModuleType, args) -> dict[str, dict]:
    """{argument: {path, store_id}} of the atlasflow stores the stage reads, for its summary.

    The workflow compares these ids with the stores on disk (workflow/rules/consistency.smk): an
    output whose input store is gone or was rewritten since is rebuilt by the next run. Paths are relative
    to the working directory when inside it, so a moved project folder stays consistent.
    """
    from atlasflow import ownership

    out = {}
    for arg, path in _input_paths(stage, args).items():
        own = (ownership.store_attrs(Path(path)) or {}).get(ownership.STORE_KEY)
        if isinstance(own, dict) and "store_id" in own:
            rel = os.path.relpath(path)
            out[arg] = {"path": path if rel.startswith("..") else rel, "store_id": own["store_id"]}
    return out


#: Arguments naming what a stage reads (besides every ``*_store`` argument).
INPUT_ARGS = ("input", "per_sample", "sample_sheet", "counts", "unscaled")


def _absolute_paths(args) -> None:
    for key in PATH_ARGS:
        value = getattr(args, key, None)
        if isinstance(value, str) and value and value.lower() not in ("none", "null"):
            setattr(args, key, os.path.abspath(value))


def _run_with_cluster(stage: ModuleType, args) -> dict:
    from atlasflow.cluster import connect
    from atlasflow.gpu import validate_backend

    backend = validate_backend(args.backend)
    args.backend = backend
    if not getattr(stage, "NEEDS_CLUSTER", True):  # the graph stages: in-memory arrays, on the GPU or not
        with _gpu_errors(args, in_memory=True):
            result = stage.run(args, None)
        return {**result, "peak_memory": peak_memory(None), "ran_on": where_it_ran(None)}
    with connect(
        scheduler_file=args.scheduler_file, address=args.address, n_workers=args.n_workers,
        memory_limit=args.memory_limit, backend=backend, gpu_preset=args.gpu_preset,
    ) as client:
        from atlasflow.store import read

        read.DEFAULT_BACKEND = backend  # every store the stage opens lands on this backend
        log.info("Dask dashboard: %s", client.dashboard_link)
        with _gpu_errors(args):
            result = stage.run(args, client)
        from atlasflow import passes

        return {**result, "passes": passes.summary(), "peak_memory": peak_memory(client),
                "ran_on": where_it_ran(client)}


def _gpu_errors(args, *, in_memory: bool = False):
    """On the GPU backend, a CUDA out-of-memory error becomes one line with what to change."""
    if args.backend != "gpu":
        return contextlib.nullcontext()
    from atlasflow.gpu import IN_MEMORY_ADVICE, oom_guard

    if in_memory:  # chunk_rows and the cluster presets do not apply to in-memory embeddings and graphs
        return oom_guard(advice=IN_MEMORY_ADVICE)
    return oom_guard(chunk_rows=args.chunk_rows, preset=args.gpu_preset)


def _one_line(summary: dict) -> str:
    keys = ("cells_in", "genes_in", "cells_out", "genes_out")
    parts = [f"{k}={summary[k]}" for k in keys if k in summary]
    pm = summary.get("peak_memory", {}).get("total")
    if pm:
        parts.append(f"peak_memory={pm / 2**20:.0f}MiB")
    return ", ".join(parts) or json.dumps(summary)[:200]


def main(argv: list[str] | None = None) -> int:
    """``atlasflow STAGE [options]``: run a stage by name (same as ``python scripts/STAGE.py``)."""
    import importlib

    argv = list(sys.argv[1:] if argv is None else argv)
    stages = stage_names()
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: atlasflow STAGE [options]   (atlasflow STAGE --help: the stage's options)\n"
              "       atlasflow cluster start|stop --scheduler-file FILE   (one Dask cluster for a run)\n\n"
              "stages:\n" + "\n".join(f"  {n:<18} {importlib.import_module(f'atlasflow.stages.{n}').DESCRIPTION}"
                                     for n in stages))
        return 0
    if argv[0] == "cluster":
        from atlasflow import shared_cluster

        return shared_cluster.main(argv[1:])
    if argv[0] not in stages:
        import difflib

        hint = difflib.get_close_matches(argv[0], stages, n=1)
        print(f"atlasflow: error: no stage {argv[0]!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
              + f"; stages: {', '.join(stages)}", file=sys.stderr)
        return 2
    stage = importlib.import_module(f"atlasflow.stages.{argv[0]}")
    return stage_main(stage, argv=argv[1:])


def stage_names() -> list[str]:
    """The stages ``atlasflow STAGE`` runs: the modules of atlasflow.stages (not the private ones)."""
    import pkgutil

    from atlasflow import stages

    return sorted(m.name for m in pkgutil.iter_modules(stages.__path__) if not m.name.startswith("_"))
