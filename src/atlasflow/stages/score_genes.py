"""score_genes stage: gene set scores and cell cycle phases (scanpy.tl.score_genes[_cell_cycle]); X is linked."""

from __future__ import annotations

import argparse
from pathlib import Path

from atlasflow import pp
from atlasflow.errors import ConfigError, InputError
from atlasflow.pp._utils import read_gene_list
from atlasflow.stages._common import shape_summary
from atlasflow.store import open_store, write_store

DESCRIPTION = ("Score gene sets per cell (obs[score_name]) and/or the cell cycle (obs S_score, G2M_score, "
               "phase) against expression-matched control genes.")


def add_arguments(p):
    p.add_argument("--gene-list", dest="gene_list", default=None,
                   help="genes to score: a file (one per line) or a comma-separated list")
    p.add_argument("--score-name", dest="score_name", default="score", help="obs column of the gene-list score")
    p.add_argument("--s-genes", dest="s_genes", default=None,
                   help="S-phase genes (file or comma-separated); with --g2m-genes scores the cell cycle")
    p.add_argument("--g2m-genes", dest="g2m_genes", default=None, help="G2/M-phase genes (file or comma-separated)")
    p.add_argument("--ctrl-size", dest="ctrl_size", type=int, default=50, help="control genes per expression bin")
    p.add_argument("--n-bins", dest="n_bins", type=int, default=25, help="expression bins for control genes")
    p.add_argument("--random-state", dest="random_state", type=int, default=0, help="seed of the control sampling")
    p.add_argument("--ctrl-as-ref", dest="ctrl_as_ref", action=argparse.BooleanOptionalAction, default=True,
                   help="allow scored genes in the control bins (scanpy's default)")
    p.add_argument("--gene-pool", dest="gene_pool", default=None, help="genes to draw controls from (default: all)")
    p.add_argument("--gene-symbols", dest="gene_symbols", default=None,
                   help="var column holding the names used in the lists (default: var_names)")
    p.add_argument("--layer", default=None, help="score this layer instead of X")


def genes_arg(value, what: str) -> list[str] | None:
    """A gene list given as a list, a file path or a comma-separated string."""
    if value is None:
        return None
    if isinstance(value, list | tuple):
        return [str(v) for v in value]
    text = str(value)
    if Path(text).exists():
        return read_gene_list(text)
    if "," in text or (text and "/" not in text and not text.endswith(".txt")):
        return [g.strip() for g in text.split(",") if g.strip()]
    raise InputError(f"score_genes: {what} file {text} does not exist")


#: HGNC renames of Tirosh et al.'s cell-cycle symbols (old -> new); lists and data may use either name
RENAMED = {"MLF1IP": "CENPU", "FAM64A": "PIMREG", "HN1": "JPT1"}


def with_renamed(genes, names) -> list[str] | None:
    """Swap a listed symbol for its old/new HGNC name when only that one is in the data."""
    if genes is None:
        return None
    both = {**RENAMED, **{v: k for k, v in RENAMED.items()}}
    present = set(names)
    return [both[g] if g not in present and both.get(g) in present else g for g in genes]


def _to_var_names(adata, genes, column):
    if genes is None or column is None:
        return genes
    if column not in adata.var:
        raise InputError(f"score_genes: gene_symbols={column!r} is not a column of var")
    lookup = {}
    for name, sym in zip(adata.var_names, adata.var[column].astype(str), strict=True):
        lookup.setdefault(sym, name)
    return [lookup.get(g, g) for g in genes]


def run(args, client) -> dict:
    gene_list = genes_arg(args.gene_list, "gene_list")
    s_genes, g2m_genes = genes_arg(args.s_genes, "s_genes"), genes_arg(args.g2m_genes, "g2m_genes")
    gene_pool = genes_arg(args.gene_pool, "gene_pool")
    if (s_genes is None) != (g2m_genes is None):
        raise ConfigError("score_genes: give both s_genes and g2m_genes to score the cell cycle")
    if gene_list is None and s_genes is None:
        raise ConfigError("score_genes: nothing to score; give gene_list or s_genes and g2m_genes")
    adata = open_store(args.input, chunk_rows=args.chunk_rows)
    gene_list, s_genes, g2m_genes, gene_pool = (_to_var_names(adata, g, args.gene_symbols)
                                                for g in (gene_list, s_genes, g2m_genes, gene_pool))
    s_genes, g2m_genes = with_renamed(s_genes, adata.var_names), with_renamed(g2m_genes, adata.var_names)
    common = {"n_bins": args.n_bins, "random_state": args.random_state, "ctrl_as_ref": args.ctrl_as_ref,
              "gene_pool": gene_pool, "layer": args.layer}
    summary = {}
    if gene_list is not None:
        pp.score_genes(adata, gene_list, score_name=args.score_name, ctrl_size=args.ctrl_size, **common)
        summary[f"mean_{args.score_name}"] = float(adata.obs[args.score_name].mean())
    if s_genes is not None:
        pp.score_genes_cell_cycle(adata, s_genes=s_genes, g2m_genes=g2m_genes, **common)
        summary["phase_counts"] = {str(k): int(v) for k, v in adata.obs["phase"].value_counts().items()}
    write_store(adata, args.output, chunk_rows=args.chunk_rows, provenance={"stage": "score_genes"})
    return {**shape_summary(adata, adata), **summary}
