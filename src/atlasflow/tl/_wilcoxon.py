"""Exact Wilcoxon rank-sum test out of core, over a gene-major view of X made once.

scanpy densifies blocks of genes over all cells and ranks them. We instead transpose X once
(``atlasflow.transpose``) and rank each gene block as it is assembled, ranking only each gene's stored
non-zeros: all zeros of a sparse column share one tied rank, placed analytically
(``kernels.gene_block_ranks``). Rank sums are sums of half-integers, exact in float64, so scores and
p-values equal scanpy's up to the last bits of the normal approximation. The same pass yields per-group
sums and non-zero counts (for log fold changes and pts), so X itself is read once, by the transposition.
A gene-major copy kept with ``gene_major=`` is written as a store and reused by later runs on the same X.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from pathlib import Path

import dask
import numpy as np
from scipy import stats

from atlasflow import kernels, progress
from atlasflow.errors import InputError
from atlasflow.sources import source_of
from atlasflow.tl._groups import Design, GroupStats
from atlasflow.transpose import gene_blocks, is_gene_major_of, open_gene_major, source_signature, write_gene_major

log = logging.getLogger("atlasflow.tl.markers")


@contextlib.contextmanager
def gene_major(x, *, keep=None, gene_block=None, work_dir=None, obs_names=None, var_names=None):
    """Yield the genes x cells matrix of ``x`` as a lazy Dask array of gene blocks.

    With ``keep`` (a path), a store copy there is reused if it is of this X, else written there and read.
    Without it the blocks are assembled on the fly from compressed scratch pieces, written next to the
    store X was read from (a shared file system for the workers) or into ``work_dir``, removed afterwards.
    """
    if keep is not None:
        path = Path(keep)
        if is_gene_major_of(path, source_signature(x)):
            log.info("wilcoxon: reusing the gene-major copy %s", path)
        else:
            write_gene_major(x, path, gene_block=gene_block, obs_names=obs_names, var_names=var_names)
        yield open_gene_major(path)
        return
    if work_dir is None:
        src = source_of(x)
        work_dir = Path(src[0]).parent if src else Path(tempfile.gettempdir())
    with gene_blocks(x, work_dir, gene_block=gene_block) as xg:
        yield xg


def rank_pass(xg, d: Design):
    """One pass over the gene blocks ``xg``: per-group stats and each tested group's rank sums and tie factors."""
    n_genes, n_cells = xg.shape
    if n_cells != d.codes.shape[0]:
        raise InputError(f"gene_major: the gene-major matrix has {n_cells} cells, the data have {d.codes.shape[0]}")
    k, tested = d.n_codes, d.tested
    ncols = 2 * k + 2 * len(tested) + 1
    res = kernels.per_row(xg, kernels.gene_block_ranks, ncols, dask.delayed(d.codes), k, d.sizes, tested,
                          d.reference)
    (res,) = progress.compute(res, label="wilcoxon: ranking genes")
    st = GroupStats(sums=res[:, :k].T.copy(), sq=None, nnz=res[:, k : 2 * k].T.copy(), sizes=d.sizes,
                    looks_like_counts=bool(res[:, -1].sum() == 0))
    t = len(tested)
    rank_sums = res[:, 2 * k : 2 * k + t].T
    ties = res[:, 2 * k + t : 2 * k + 2 * t].T
    return st, rank_sums, ties


def wilcoxon(rank_sums, ties, d: Design, *, tie_correct: bool):
    """Yield ``(code, z-scores, p-values)`` per tested group from rank sums, with scanpy's formulas."""
    n_cells = int(d.sizes.sum())
    for j, code in enumerate(d.tested):
        n_active = int(d.sizes[code])
        coef = ties[j] if tie_correct else 1
        if d.reference is None:
            std_dev = np.sqrt(coef * n_active * (n_cells - n_active) * (n_cells + 1) / 12.0)
            with np.errstate(invalid="ignore", divide="ignore"):
                scores = (rank_sums[j] - (n_active * (n_cells + 1) / 2.0)) / std_dev
        else:
            m_active = int(d.sizes[d.reference])
            std_dev = np.sqrt(coef * n_active * m_active * (n_active + m_active + 1) / 12.0)
            with np.errstate(invalid="ignore", divide="ignore"):
                scores = (rank_sums[j] - (n_active * ((n_active + m_active + 1) / 2.0))) / std_dev
            if n_active <= 25 or m_active <= 25:
                log.info("wilcoxon: few observations in a group for the normal approximation (<=25)")
        scores = np.asarray(scores, dtype=np.float64)
        scores[np.isnan(scores)] = 0
        pvals = 2 * stats.distributions.norm.sf(np.abs(scores))
        yield code, scores, pvals
