"""Marker genes out of core: ``rank_genes_groups`` with scanpy's parameters, numerics and output layout.

* ``t-test`` / ``t-test_overestim_var``: one pass over X for per-group sums, sums of squares and
  non-zero counts (``_ttest``).
* ``wilcoxon``: exact rank-sum test over a gene-major view of X, transposed once (``_wilcoxon``).
* ``logreg``: multinomial logistic regression by L-BFGS with per-block loss/gradient (``_logreg``).

``uns[key_added]`` holds ``names``, ``scores``, ``logfoldchanges``, ``pvals``, ``pvals_adj`` as
scanpy's structured arrays (one field per group, genes sorted by score), ``params`` and, when asked,
``pts`` / ``pts_rest`` data frames, so ``scanpy.pl.rank_genes_groups*`` and ``sc.get`` read it.
``marker_table`` turns a result into a tidy table; ``filter_rank_genes_groups`` mirrors scanpy's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import anndata as ad
import numpy as np
import pandas as pd

from atlasflow.errors import ConfigError, InputError
from atlasflow.tl import _logreg, _ttest, _wilcoxon
from atlasflow.tl._groups import COUNTS_WARNING, Design, GroupStats, design, group_moments, lazy_matrix

log = logging.getLogger("atlasflow.tl.markers")

METHODS = ("t-test", "t-test_overestim_var", "wilcoxon", "logreg")
CORR_METHODS = ("benjamini-hochberg", "bonferroni")
LOGREG_PARAMS = {"C", "max_iter", "tol"}  # sklearn LogisticRegression parameters the L-BFGS fit honours
SYMBOL_COLUMNS = ("gene_symbols", "gene_symbol", "symbol", "symbols", "feature_name", "gene_name", "gene_names")
_DTYPES = {"names": "O", "scores": "float32", "logfoldchanges": "float32", "pvals": "float64", "pvals_adj": "float64"}


@dataclass
class Markers:
    """Result of a marker test: per tested group, per gene (in var order) scores and statistics."""

    params: dict
    var_names: pd.Index
    groups: list[str]  # reported groups, in order
    order: list[str]  # scanpy's groups_order (reported groups + reference): the pts columns
    scores: np.ndarray  # (groups, genes) float64
    pvals: np.ndarray | None
    pvals_adj: np.ndarray | None
    logfoldchanges: np.ndarray | None  # None for logreg (as scanpy)
    lfc_from_means: np.ndarray  # always available, for tables and filters
    pts: pd.DataFrame  # genes x order
    pts_rest: pd.DataFrame | None  # genes x order, only against 'rest'
    n_genes: int
    rankby_abs: bool = False
    _order_cache: np.ndarray | None = field(default=None, repr=False)

    def ranking(self) -> np.ndarray:
        """(groups, n_genes) gene indices by decreasing score (|score| with rankby_abs).

        Partition then sort, as scanpy selects its top genes, so equal scores come out in scanpy's order.
        """
        if self._order_cache is None:
            key = np.abs(self.scores) if self.rankby_abs else self.scores
            rows = []
            for s in key:
                top = np.argpartition(s, -self.n_genes)[-self.n_genes :]
                rows.append(top[np.argsort(s[top])[::-1]])
            self._order_cache = np.array(rows, dtype=np.int64).reshape(len(key), self.n_genes)
        return self._order_cache

    def _records(self, values: np.ndarray, dtype: str) -> np.recarray:
        idx = self.ranking()
        cols = {g: values[i][idx[i]] for i, g in enumerate(self.groups)}
        return pd.DataFrame(cols).to_records(index=False, column_dtypes=dtype)

    def uns(self, *, pts: bool = False) -> dict:
        """The ``uns['rank_genes_groups']`` dictionary, laid out as scanpy's."""
        out: dict = {"params": dict(self.params)}
        if pts:
            out["pts"] = self.pts
            if self.pts_rest is not None:
                out["pts_rest"] = self.pts_rest
        names = np.asarray(self.var_names, dtype=object)
        out["names"] = self._records(np.broadcast_to(names, self.scores.shape), _DTYPES["names"])
        out["scores"] = self._records(self.scores, _DTYPES["scores"])
        if self.logfoldchanges is not None:
            out["logfoldchanges"] = self._records(self.logfoldchanges, _DTYPES["logfoldchanges"])
        if self.pvals is not None:
            out["pvals"] = self._records(self.pvals, _DTYPES["pvals"])
            out["pvals_adj"] = self._records(self.pvals_adj, _DTYPES["pvals_adj"])
        return out

    def pct_out(self, group: str) -> np.ndarray:
        """Fraction of expressing cells in the comparison: the rest, or the reference group."""
        if self.pts_rest is not None:
            return self.pts_rest[group].to_numpy()
        return self.pts[str(self.params["reference"])].to_numpy()

    def table(self, symbols=None) -> pd.DataFrame:
        """Tidy marker table: one row per (group, rank) with gene id, symbol, statistics, pct_in, pct_out."""
        idx = self.ranking()
        symbols = self.var_names if symbols is None else pd.Index(symbols)
        frames = []
        for i, g in enumerate(self.groups):
            j = idx[i]
            lfc = self.logfoldchanges if self.logfoldchanges is not None else self.lfc_from_means
            frames.append(pd.DataFrame({
                "group": g,
                "rank": np.arange(1, len(j) + 1),
                "gene_id": np.asarray(self.var_names)[j],
                "symbol": np.asarray(symbols)[j],
                "score": self.scores[i][j],
                "logfoldchange": lfc[i][j],
                "pval": self.pvals[i][j] if self.pvals is not None else np.nan,
                "pval_adj": self.pvals_adj[i][j] if self.pvals_adj is not None else np.nan,
                "pct_in": self.pts[g].to_numpy()[j],
                "pct_out": self.pct_out(g)[j],
            }))
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()

    def passes_filter(self, *, min_in_group_fraction: float = 0.25, max_out_group_fraction: float = 0.5,
                      min_fold_change: float = 1, compare_abs: bool = False) -> np.ndarray:
        """(groups, n_genes) mask in ranking order: scanpy's filter_rank_genes_groups criteria (strict)."""
        idx = self.ranking()
        lfc = self.logfoldchanges if self.logfoldchanges is not None else self.lfc_from_means
        out = np.zeros(idx.shape, dtype=bool)
        for i, g in enumerate(self.groups):
            j = idx[i]
            fc = np.abs(lfc[i][j]) if compare_abs else lfc[i][j]
            out[i] = (self.pts[g].to_numpy()[j] > min_in_group_fraction) \
                & (self.pct_out(g)[j] < max_out_group_fraction) & (fc > min_fold_change)
        return out


def _bh(p: np.ndarray) -> np.ndarray:
    """Benjamini-Hochberg adjusted p-values (as statsmodels' ``fdr_bh``)."""
    n = p.shape[0]
    order = np.argsort(p)
    ranked = p[order] * n / np.arange(1, n + 1)
    adj = np.minimum.accumulate(ranked[::-1])[::-1]
    out = np.empty(n)
    out[order] = np.minimum(adj, 1.0)
    return out


def _adjust(pvals: np.ndarray, method: str) -> np.ndarray:
    pvals = pvals.copy()
    pvals[np.isnan(pvals)] = 1
    if method == "benjamini-hochberg":
        return _bh(pvals)
    return np.minimum(pvals * pvals.shape[0], 1.0)


def _mask_var(adata, mask_var):
    if mask_var is None:
        return None
    if isinstance(mask_var, str):
        if mask_var not in adata.var.columns:
            raise InputError(f"mask_var: var has no column {mask_var!r}")
        mask_var = adata.var[mask_var].to_numpy()
    mask = np.asarray(mask_var, dtype=bool)
    if mask.shape != (adata.n_vars,):
        raise ConfigError(f"mask_var: expected {adata.n_vars} booleans, got shape {mask.shape}")
    return np.flatnonzero(mask)


def compute_markers(
    adata: ad.AnnData,
    groupby: str,
    *,
    mask_var=None,
    groups="all",
    reference: str = "rest",
    n_genes: int | None = None,
    rankby_abs: bool = False,
    method: str | None = None,
    corr_method: str = "benjamini-hochberg",
    tie_correct: bool = False,
    layer: str | None = None,
    gene_block: int | None = None,
    gene_major=None,
    work_dir=None,
    persist: bool = False,
    **kwds,
) -> Markers:
    """Run the marker test and return a :class:`Markers` (see :func:`rank_genes_groups` for parameters)."""
    method = method or "t-test"
    if method not in METHODS:
        raise ConfigError(f"method: {method!r} is not one of {', '.join(METHODS)}")
    if corr_method not in CORR_METHODS:
        raise ConfigError(f"corr_method: {corr_method!r} is not one of {', '.join(CORR_METHODS)}")
    if kwds and method != "logreg":
        raise ConfigError(f"unknown parameters {sorted(kwds)} (extra keywords go to logreg only)")
    if unknown := set(kwds) - LOGREG_PARAMS:
        raise ConfigError(f"logreg: unsupported parameters {sorted(unknown)} (supported: {sorted(LOGREG_PARAMS)})")
    x = lazy_matrix(adata, layer, "rank_genes_groups")
    d = design(adata.obs, groupby, groups, reference)
    if method == "logreg" and len(d.order) < 2:
        raise InputError("groups: logreg needs at least two groups")
    cols = _mask_var(adata, mask_var)
    var_names = adata.var_names if cols is None else adata.var_names[cols]

    results: list[tuple[int, np.ndarray, np.ndarray | None]] = []
    if method in ("t-test", "t-test_overestim_var"):
        st = group_moments(x, d, squares=True)
        st = st if cols is None else st.subset(cols)
        results = list(_ttest.t_test(st, d, method))
    elif method == "wilcoxon":
        with _wilcoxon.gene_major(x, keep=gene_major, gene_block=gene_block, work_dir=work_dir,
                                  obs_names=adata.obs_names, var_names=adata.var_names) as xg:
            st, rank_sums, ties = _wilcoxon.rank_pass(xg, d)
        if cols is not None:
            st, rank_sums, ties = st.subset(cols), rank_sums[:, cols], ties[:, cols]
        results = list(_wilcoxon.wilcoxon(rank_sums, ties, d, tie_correct=tie_correct))
    else:
        st = group_moments(x, d, squares=False)
        st = st if cols is None else st.subset(cols)
        results = _logreg_results(x, d, cols, persist=persist, **kwds)
    if method != "logreg" and st.looks_like_counts:
        log.warning(COUNTS_WARNING)

    base = adata.uns.get("log1p", {}).get("base") if isinstance(adata.uns.get("log1p"), dict) else None
    expm1 = (lambda v: np.expm1(v * np.log(base))) if base is not None else np.expm1
    reported = [code for code, _, _ in results]
    lfc = np.vstack([_log_fold_change(st, d, code, expm1) for code in reported])
    scores = np.vstack([s for _, s, _ in results])
    has_p = results[0][2] is not None
    pvals = np.vstack([p for _, _, p in results]) if has_p else None
    pvals_adj = np.vstack([_adjust(p, corr_method) for p in pvals]) if has_p else None
    order_names = [d.name(c) for c in d.order]
    pts = pd.DataFrame({d.name(c): st.frac(c) for c in d.order}, index=var_names, columns=order_names)
    pts_rest = None
    if d.reference is None:
        pts_rest = pd.DataFrame({d.name(c): st.frac(rest_of=c) for c in d.order}, index=var_names,
                                columns=order_names)
    m = len(var_names)
    params = {"groupby": groupby, "reference": reference, "method": method, "use_raw": False,
              "layer": layer, "corr_method": corr_method}
    return Markers(
        params=params, var_names=pd.Index(var_names), groups=[d.name(c) for c in reported], order=order_names,
        scores=scores, pvals=pvals, pvals_adj=pvals_adj, logfoldchanges=None if method == "logreg" else lfc,
        lfc_from_means=lfc, pts=pts, pts_rest=pts_rest,
        n_genes=m if n_genes is None or n_genes > m else int(n_genes), rankby_abs=rankby_abs,
    )


def _log_fold_change(st: GroupStats, d: Design, code: int, expm1) -> np.ndarray:
    """log2 of the ratio of de-logged mean expressions (scanpy's approximation from mean log values)."""
    mean_g, _ = st.mean_var(code)
    mean_r, _ = st.mean_var(d.reference) if d.reference is not None else st.mean_var(rest_of=code)
    return np.log2((expm1(mean_g) + 1e-9) / (expm1(mean_r) + 1e-9))


def _logreg_results(x, d: Design, cols, *, persist: bool, **kwds):
    in_fit = np.isin(d.codes, d.order)
    present = np.flatnonzero(np.bincount(d.codes[in_fit], minlength=d.n_codes))  # sklearn's classes_, sorted
    labels = np.full(d.codes.shape[0], -1, dtype=np.int64)
    labels[in_fit] = np.searchsorted(present, d.codes[in_fit])
    coef, _, _ = _logreg.fit(x, labels, len(present), col_idx=cols, persist=persist, **kwds)
    if len(d.order) <= 2:  # binary: scanpy reports the first group only, with the single coefficient row
        return [(d.order[0], coef[0], None)]
    return [(code, coef[int(np.searchsorted(present, code))], None) for code in d.order]


def rank_genes_groups(
    adata: ad.AnnData,
    groupby: str,
    *,
    mask_var=None,
    groups="all",
    reference: str = "rest",
    n_genes: int | None = None,
    rankby_abs: bool = False,
    pts: bool = False,
    key_added: str | None = None,
    copy: bool = False,
    method: str | None = None,
    corr_method: str = "benjamini-hochberg",
    tie_correct: bool = False,
    layer: str | None = None,
    gene_block: int | None = None,
    gene_major=None,
    work_dir=None,
    persist: bool = False,
    **kwds,
):
    """Rank genes characterising groups, as ``scanpy.tl.rank_genes_groups``, on a Dask-backed AnnData.

    Expects log-normalised data (warns, as scanpy, when X looks like raw counts). Parameters are
    scanpy's (no ``use_raw``: stores have no ``.raw``; ``layer`` instead); groups with fewer than two
    cells are skipped with a warning instead of failing. Out-of-core extras: ``gene_block`` (genes per
    block of the Wilcoxon's transposed X; default ~2M non-zeros per block), ``gene_major`` (path where a
    gene-major copy is kept and reused; default none: compressed scratch pieces), ``work_dir`` (where those go),
    ``persist`` (logreg: keep X in worker memory between iterations). ``kwds`` go to logreg
    (``C``, ``max_iter``, ``tol``; fitted by L-BFGS over per-block partials, float64 throughout, so
    coefficients match sklearn's closely but not bitwise: see ``atlasflow.tl._logreg``).
    Sets ``adata.uns[key_added or 'rank_genes_groups']``.
    """
    adata = adata.copy() if copy else adata
    res = compute_markers(
        adata, groupby, mask_var=mask_var, groups=groups, reference=reference, n_genes=n_genes,
        rankby_abs=rankby_abs, method=method, corr_method=corr_method, tie_correct=tie_correct, layer=layer,
        gene_block=gene_block, gene_major=gene_major, work_dir=work_dir, persist=persist, **kwds,
    )
    adata.uns[key_added or "rank_genes_groups"] = res.uns(pts=pts)
    return adata if copy else None


def filter_rank_genes_groups(
    adata: ad.AnnData,
    markers: Markers,
    *,
    key: str = "rank_genes_groups",
    key_added: str = "rank_genes_groups_filtered",
    min_in_group_fraction: float = 0.25,
    min_fold_change: float = 1,
    max_out_group_fraction: float = 0.5,
    compare_abs: bool = False,
) -> None:
    """scanpy's ``filter_rank_genes_groups`` for a result: ``uns[key]`` copied to ``uns[key_added]`` with the
    names of failing genes set to NaN.

    Fractions and fold changes are taken against the comparison of the test (the rest, or the
    reference group; scanpy recomputes them against the rest when a reference was used).
    """
    keep = markers.passes_filter(min_in_group_fraction=min_in_group_fraction,
                                 max_out_group_fraction=max_out_group_fraction,
                                 min_fold_change=min_fold_change, compare_abs=compare_abs)
    uns = dict(adata.uns[key]) if key in adata.uns else markers.uns()
    names = pd.DataFrame(markers.uns()["names"])
    uns["names"] = names.where(pd.DataFrame(keep.T, columns=names.columns)).to_records(index=False)
    adata.uns[key_added] = uns


def marker_table(markers: Markers, var: pd.DataFrame, *, gene_symbols: str | None = None,
                 filter_kw=None) -> pd.DataFrame:
    """Tidy table of a result (``group, rank, gene_id, symbol, score, logfoldchange, pval, pval_adj,
    pct_in, pct_out``); symbols from ``var[gene_symbols]`` (default: the first known symbol column, else
    the var names). With ``filter_kw`` (scanpy filter parameters) only passing rows are kept."""
    if gene_symbols is not None and gene_symbols not in var.columns:
        raise InputError(f"gene_symbols: var has no column {gene_symbols!r}")
    col = gene_symbols or next((c for c in SYMBOL_COLUMNS if c in var.columns), None)
    symbols = var[col].reindex(markers.var_names).astype(str).to_numpy() if col else None
    table = markers.table(symbols)
    if filter_kw is not None and len(table):
        table = table[markers.passes_filter(**filter_kw).ravel()].reset_index(drop=True)
    return table
