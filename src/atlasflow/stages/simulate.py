"""simulate stage: the workflow's built-in dataset, raw counts with ground truth written chunk by chunk."""

from __future__ import annotations

import logging
from dataclasses import asdict

import numpy as np

from atlasflow.allocation import allocation_cores
from atlasflow.errors import ConfigError
from atlasflow.simulate import SimParams, write_simulated

DESCRIPTION = ("Simulate a raw-count AnnData Zarr store (cell types, markers, damaged/empty cells, doublets). "
               "Runs in --n-workers threads of this process; no Dask cluster is used.")
TAKES_INPUT = False
#: Generation runs in threads of this process and streams into the store (cheaper than shipping blocks
#: from Dask workers, see atlasflow.simulate.write_simulated), so no cluster is started or attached.
NEEDS_CLUSTER = False
DEFAULT_CHUNK_ROWS = 10_000
log = logging.getLogger(__name__)

_DEFAULTS = SimParams()


def add_arguments(p):
    p.add_argument("--n-cells", dest="n_cells", type=int, default=_DEFAULTS.n_cells, help="cells to simulate")
    p.add_argument("--n-genes", dest="n_genes", type=int, default=_DEFAULTS.n_genes, help="genes to simulate")
    p.add_argument("--n-cell-types", dest="n_cell_types", type=int, default=_DEFAULTS.n_cell_types,
                   help="cell types, each with its own marker genes")
    p.add_argument("--seed", type=int, default=_DEFAULTS.seed, help="random seed (same seed, same data)")
    p.add_argument("--median-counts", dest="median_counts", type=float, default=_DEFAULTS.median_counts,
                   help="median UMIs per ordinary cell (library sizes are log-normal around it)")
    p.add_argument("--frac-damaged", dest="frac_damaged", type=float, default=_DEFAULTS.frac_damaged,
                   help="fraction of damaged cells (high mitochondrial share)")
    p.add_argument("--frac-empty", dest="frac_empty", type=float, default=_DEFAULTS.frac_empty,
                   help="fraction of near-empty droplets (ambient RNA, few genes)")
    p.add_argument("--frac-doublets", dest="frac_doublets", type=float, default=_DEFAULTS.frac_doublets,
                   help="fraction of doublets (two cell types, larger libraries)")


def params_from_args(args) -> SimParams:
    """The simulation parameters of a parsed command line (validated: ConfigError on bad values)."""
    return SimParams(
        n_cells=int(args.n_cells), n_genes=int(args.n_genes), n_cell_types=int(args.n_cell_types),
        seed=int(args.seed), median_counts=float(args.median_counts), frac_damaged=float(args.frac_damaged),
        frac_empty=float(args.frac_empty), frac_doublets=float(args.frac_doublets),
    ).validate()


def run(args, client) -> dict:
    params = params_from_args(args)
    chunk_rows = int(args.chunk_rows or DEFAULT_CHUNK_ROWS)
    if chunk_rows < 1:
        raise ConfigError(f"simulate: chunk_rows must be >= 1, got {chunk_rows}")
    threads = int(getattr(args, "n_workers", None) or allocation_cores())
    log.info("simulate: %d cells x %d genes, %d cell types, seed %d (%d threads)", params.n_cells,
             params.n_genes, params.n_cell_types, params.seed, threads)
    out = write_simulated(args.output, params, chunk_rows=chunk_rows, threads=threads)
    obs = out["obs"]
    return {
        "cells_in": 0, "genes_in": 0, "cells_out": params.n_cells, "genes_out": params.n_genes,
        "nnz": out["nnz"], "mean_nnz_per_cell": round(out["nnz"] / params.n_cells, 1),
        "chunk_rows": chunk_rows,
        "cell_type_counts": {str(k): int(v) for k, v in obs["cell_type"].value_counts(sort=False).items()},
        "n_damaged": int(np.sum(obs["is_damaged"])), "n_empty": int(np.sum(obs["is_empty"])),
        "n_doublets": int(np.sum(obs["is_doublet"])),
        "params": asdict(params),
    }
