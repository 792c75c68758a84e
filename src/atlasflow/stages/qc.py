"""qc stage: per-cell and per-gene QC metrics (scanpy.pp.calculate_qc_metrics) in one pass over X."""

from __future__ import annotations

import logging

from atlasflow import pp
from atlasflow.errors import ConfigError
from atlasflow.stages._common import json_arg, positive_int, shape_summary
from atlasflow.store import open_store, write_store

DESCRIPTION = "Compute scanpy's QC metrics (obs and var) of a raw-count store; X is linked, not copied."
DEFAULT_GENE_SETS = {"mt": {"prefix": "MT-", "mouse": {"prefix": "mt-"}},
                     "ribo": {"prefix": ["RPS", "RPL"], "mouse": {"prefix": ["Rps", "Rpl"]}},
                     "hb": {"regex": "^HB[^(P)]", "mouse": {"regex": "^Hb(a-|b-|q)"}}}
log = logging.getLogger(__name__)


def add_arguments(p):
    p.add_argument("--gene-sets", dest="gene_sets", type=json_arg, default=DEFAULT_GENE_SETS,
                   help="JSON {name: {prefix|regex|genes_file|ids_file: ..., mouse: {...}}}: boolean var columns "
                        "and pct_counts_<name>; a set's mouse rules replace its own on mouse data")
    p.add_argument("--species", choices=["auto", "human", "mouse"], default="auto",
                   help="which rules of the gene sets apply; auto: mouse when var holds ENSMUSG ids or mostly "
                        "non-upper-case symbols (mt-Nd1), else human")
    p.add_argument("--percent-top", dest="percent_top", type=positive_int.named("percent_top"), nargs="*",
                   default=[50, 100, 200, 500],
                   help="n (1 to the number of genes) for pct_counts_in_top_<n>_genes")


def run(args, client) -> dict:
    percent_top = [positive_int(n, "percent_top") for n in args.percent_top or ()]
    adata = open_store(args.input, chunk_rows=args.chunk_rows)
    too_many = sorted({n for n in percent_top if n > adata.n_vars})
    if too_many:  # scanpy: IndexError "Positions outside range of features"
        raise ConfigError(f"qc.percent_top: {', '.join(map(str, too_many))} > the {adata.n_vars} genes of the input; "
                          f"give values up to {adata.n_vars} (or [] for none)")
    masks = pp.gene_set_masks(adata.var, args.gene_sets or {}, species=args.species)
    for name, mask in masks.items():
        adata.var[name] = mask
    log.info("qc: %d cells x %d genes; gene sets %s", adata.n_obs, adata.n_vars,
             {k: int(v.sum()) for k, v in masks.items()})
    pp.calculate_qc_metrics(adata, qc_vars=list(masks), percent_top=percent_top)
    write_store(adata, args.output, chunk_rows=args.chunk_rows, provenance={"stage": "qc"})
    obs = adata.obs
    return {
        **shape_summary(adata, adata),
        "gene_set_sizes": {k: int(v.sum()) for k, v in masks.items()},
        "median_total_counts": float(obs["total_counts"].median()),
        "median_n_genes_by_counts": float(obs["n_genes_by_counts"].median()),
        **({"median_pct_counts_mt": float(obs["pct_counts_mt"].median())} if "pct_counts_mt" in obs else {}),
    }
