"""aggregate stage: pseudobulk (scanpy.get.aggregate) of raw counts by one or more obs keys.

Input: the filtered raw-count store; group labels from its obs or from ``--groups-store`` (e.g. the
leiden store, aligned by obs_names). Output: a groups x genes AnnData store (one layer per function,
the group keys as obs columns) and one CSV per function, genes x groups.

Where the CSVs go: ``--csv`` lists their paths (the Snakemake rule passes its declared outputs, so the
files written are exactly the files Snakemake expects); else ``--csv-prefix PREFIX`` gives
``PREFIX.<func>.csv``; else they sit beside the store (``OUTPUT`` without ``.zarr``, ``.<func>.csv``).
A prefix ending in ``/`` or naming a folder is refused: it would give hidden files ``folder/.sum.csv``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pandas as pd

from atlasflow import ownership
from atlasflow.errors import ConfigError
from atlasflow.stages.rank_genes_groups import attach_obs, write_csv_atomic
from atlasflow.store import open_store, write_store
from atlasflow.tl.aggregate import aggregate

DESCRIPTION = "Pseudobulk: sum/mean/var/count_nonzero of X (or a layer) per group of cells, as scanpy.get.aggregate."
log = logging.getLogger(__name__)


def add_arguments(p):
    p.add_argument("--groups-store", dest="groups_store", default=None,
                   help="store whose obs holds the labels (e.g. the leiden store), aligned by obs_names")
    p.add_argument("--by", nargs="+", default=["leiden"],
                   help="obs key(s) to group by; several keys group by their combinations (sample leiden)")
    p.add_argument("--func", nargs="+", default=["sum"], help="sum, mean, var and/or count_nonzero")
    p.add_argument("--layer", default=None, help="aggregate this layer instead of X")
    p.add_argument("--dof", type=int, default=1, help="delta degrees of freedom of var")
    p.add_argument("--csv-prefix", dest="csv_prefix", default=None,
                   help="CSV files are PREFIX.<func>.csv, e.g. tables/pseudobulk (not a folder; "
                        "none: OUTPUT without .zarr)")
    p.add_argument("--csv", nargs="+", default=None,
                   help="the CSV paths themselves, one per --func, each ending in .<func>.csv (the Snakemake "
                        "rule passes its outputs here); replaces --csv-prefix")


def _funcs(args) -> list[str]:
    return [args.func] if isinstance(args.func, str) else list(args.func)


def check_prefix(prefix) -> str:
    """A CSV prefix, refused (one line) when it is a folder: ``PREFIX.<func>.csv`` must name files in it."""
    text = str(prefix)
    if text.endswith(("/", os.sep)) or Path(text).name in ("", ".", "..") or Path(text).is_dir():
        folder = text.rstrip("/" + os.sep) or text
        raise ConfigError(f"csv_prefix {text!r} is a folder; the CSVs are PREFIX.<func>.csv, so give a prefix "
                          f"of file names, e.g. {folder}/aggregate")
    return text


def csv_paths(output, funcs, prefix=None, csv=None) -> dict[str, Path]:
    """Where the per-function CSVs go: ``csv`` (matched to the functions by their ``.<func>.csv`` ending),
    else ``prefix.<func>.csv``, else beside the store."""
    if csv:
        paths = [Path(str(csv))] if isinstance(csv, str | os.PathLike) else [Path(str(c)) for c in csv]
        by_func = {}
        for f in funcs:
            match = [p for p in paths if p.name.endswith(f".{f}.csv")]
            if len(match) != 1:
                raise ConfigError(f"csv: {len(match)} of the paths {', '.join(map(str, paths))} end in .{f}.csv; "
                                  f"give one per function ({', '.join(funcs)})")
            by_func[f] = match[0]
        if extra := [str(p) for p in paths if p not in by_func.values()]:
            raise ConfigError(f"csv: {', '.join(extra)} match(es) no function of func ({', '.join(funcs)})")
        return by_func
    base = check_prefix(prefix) if prefix else str(Path(output).with_suffix(""))
    return {f: Path(f"{base}.{f}.csv") for f in funcs}


def extra_outputs(args) -> list[tuple[str, str, str]]:
    """The CSVs (checked by the CLI before any work, as the store and summary are)."""
    return [(f"csv_{f}", str(p), "file") for f, p in csv_paths(args.output, _funcs(args), args.csv_prefix,
                                                                args.csv).items()]


def run(args, client) -> dict:
    by = [args.by] if isinstance(args.by, str) else list(args.by)
    funcs = _funcs(args)
    paths = csv_paths(args.output, funcs, args.csv_prefix, args.csv)  # a bad prefix fails before any work
    adata = open_store(args.input, chunk_rows=args.chunk_rows)
    attach_obs(adata, args.groups_store, by, param="by")
    out = aggregate(adata, by, funcs, dof=args.dof, layer=args.layer)
    out.obs_names = out.obs_names.astype(str)
    tmps = {}
    try:
        for f, path in paths.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            values = out.layers[f]
            if f in ("sum", "count_nonzero") and np.all(np.mod(values, 1) == 0):
                values = values.astype(np.int64)
            table = pd.DataFrame(values.T, index=out.var_names, columns=out.obs_names)
            tmps[path] = write_csv_atomic(table.reset_index(names="gene_id"), path)
        write_store(out, args.output, chunk_rows=max(1, out.n_obs), provenance={"stage": "aggregate"})
        for path, tmp in tmps.items():
            ownership.replace_file(tmp, path)
    finally:
        for tmp in tmps.values():
            tmp.unlink(missing_ok=True)
    cells = {str(k): int(v) for k, v in zip(out.obs_names, _group_cells(adata.obs, by, out), strict=True)}
    return {
        "cells_in": int(adata.n_obs), "genes_in": int(adata.n_vars), "groups_out": int(out.n_obs),
        "by": by, "func": funcs, "cells_per_group": cells,
        "csv": {f: str(p) for f, p in paths.items()},
    }


def _group_cells(obs, by, out) -> list[int]:
    """Cells per output group (for the summary)."""
    labels = obs[by].astype(str).agg("_".join, axis=1) if len(by) > 1 else obs[by[0]].astype(str)
    counts = labels.value_counts()
    return [int(counts.get(name, 0)) for name in out.obs_names]
