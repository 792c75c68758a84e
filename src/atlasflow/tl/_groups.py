"""Groups of cells for marker tests: which groups, their codes and sizes, and per-group moments.

Shared by the t-test, Wilcoxon and logreg paths of ``rank_genes_groups``: the checks (groupby present
and categorical, groups and reference known, groups of fewer than two cells skipped) and the one pass
over X that gives per-group sums, sums of squares and non-zero counts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import dask.array as da
import numpy as np
import pandas as pd

from atlasflow import kernels, progress
from atlasflow.errors import ConfigError, InputError
from atlasflow.compat import named_layers

log = logging.getLogger("atlasflow.tl.markers")


@dataclass
class Design:
    """Cells coded by group: ``codes[i]`` is the category index of cell i, ``n_codes - 1`` for no group."""

    groupby: str
    categories: list[str]
    codes: np.ndarray
    sizes: np.ndarray  # cells per code (categories, then the "no group" slot)
    order: list[int]  # scanpy's groups_order as category indices: tested groups (+ reference)
    reference: int | None

    @property
    def n_codes(self) -> int:
        return len(self.categories) + 1

    @property
    def tested(self) -> list[int]:
        return [c for c in self.order if c != self.reference]

    def name(self, code: int) -> str:
        return self.categories[code]


def lazy_matrix(adata, layer: str | None, what: str) -> da.Array:
    """X or ``layers[layer]`` as a Dask array of row blocks; ``what`` names the caller in the error."""
    if layer is not None and layer not in adata.layers:
        raise InputError(f"layer: no layer {layer!r} (layers: {list(named_layers(adata))})")
    x = adata.layers[layer] if layer is not None else adata.X
    if x is None:
        raise InputError(f"{what}: the store has no X")
    if not isinstance(x, da.Array):
        x = da.from_array(x, chunks=(10_000, x.shape[1]), asarray=False)
    return x


def as_categorical(obs: pd.DataFrame, key: str, *, param: str = "groupby") -> pd.Categorical:
    """``obs[key]`` as a categorical (strings are converted, as scanpy's sanitize_anndata does)."""
    if key not in obs.columns:
        cols = ", ".join(map(str, obs.columns[:20]))
        raise InputError(f"{param}: obs has no column {key!r} (columns: {cols})")
    col = obs[key]
    if isinstance(col.dtype, pd.CategoricalDtype):
        return col.values
    if pd.api.types.is_string_dtype(col) or col.dtype == object:
        return pd.Categorical(col)
    raise InputError(f"{param}: obs[{key!r}] is not categorical (dtype {col.dtype}); cluster labels must be "
                     "categories (e.g. the leiden column), convert numeric codes to strings first")


def design(obs: pd.DataFrame, groupby: str, groups="all", reference: str = "rest", *, min_size: int = 2) -> Design:
    """Resolve groups and reference as scanpy does; groups with fewer than ``min_size`` cells are skipped."""
    cat = as_categorical(obs, groupby)
    categories = [str(c) for c in cat.categories]
    codes = np.asarray(cat.codes, dtype=np.int64).copy()
    codes[codes < 0] = len(categories)
    sizes = np.bincount(codes, minlength=len(categories) + 1).astype(np.int64)
    if isinstance(groups, str) and groups != "all":
        raise ConfigError(f"groups: give a list of groups or 'all', not the string {groups!r}")
    if groups == "all" or groups is None:
        order = list(range(len(categories)))
    else:
        names = [str(g) for g in groups]
        unknown = [g for g in names if g not in categories]
        if unknown:
            raise ConfigError(f"groups: {unknown} not among the groups of {groupby!r}: {categories}")
        if reference != "rest" and str(reference) not in names:
            names.append(str(reference))
        order = [categories.index(g) for g in names]
    ref = None
    if reference != "rest":
        if str(reference) not in categories:
            raise ConfigError(f"reference: {reference!r} is not 'rest' or one of the groups of {groupby!r}: "
                              f"{categories}")
        ref = categories.index(str(reference))
        if sizes[ref] < min_size:
            raise InputError(f"reference: group {reference!r} has {sizes[ref]} cells, need at least {min_size}")
    small = [c for c in order if sizes[c] < min_size and c != ref]
    if small:
        log.warning("rank_genes_groups: skipping groups with fewer than %d cells: %s", min_size,
                    ", ".join(f"{categories[c]} ({sizes[c]})" for c in small))
        order = [c for c in order if c not in small]
    if not [c for c in order if c != ref]:
        raise InputError(f"groups: no group of {groupby!r} with at least {min_size} cells left to test")
    return Design(groupby, categories, codes, sizes, order, ref)


@dataclass
class GroupStats:
    """Per-code column sums, sums of squares (may be None) and non-zero counts; ``(n_codes, n_genes)``."""

    sums: np.ndarray
    sq: np.ndarray | None
    nnz: np.ndarray
    sizes: np.ndarray
    looks_like_counts: bool

    def subset(self, cols) -> GroupStats:
        sq = None if self.sq is None else self.sq[:, cols]
        return GroupStats(self.sums[:, cols], sq, self.nnz[:, cols], self.sizes, self.looks_like_counts)

    def _rest(self, arr: np.ndarray, code: int) -> np.ndarray:
        # sum over the other codes as prefix + suffix (never total - own: exact zeros stay zero)
        return arr[:code].sum(axis=0) + arr[code + 1 :].sum(axis=0)

    def mean_var(self, code: int | None = None, *, rest_of: int | None = None):
        """Mean and unbiased variance of a group, or of all cells outside ``rest_of``, as scanpy computes them."""
        if rest_of is None:
            n, s = int(self.sizes[code]), self.sums[code]
            q = None if self.sq is None else self.sq[code]
        else:
            n, s = int(self.sizes.sum() - self.sizes[rest_of]), self._rest(self.sums, rest_of)
            q = None if self.sq is None else self._rest(self.sq, rest_of)
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = s / n
            var = None
            if q is not None:
                var = q / n - mean**2
                if n != 1:
                    var *= n / (n - 1)
        return mean, var

    def frac(self, code: int | None = None, *, rest_of: int | None = None) -> np.ndarray:
        """Fraction of the group's (or the rest's) cells with a non-zero value."""
        if rest_of is None:
            return self.nnz[code] / self.sizes[code]
        return self._rest(self.nnz, rest_of) / (self.sizes.sum() - self.sizes[rest_of])


def group_moments(x: da.Array, d: Design, *, squares: bool = True) -> GroupStats:
    """One pass over X: per-group sums, sums of squares and non-zero counts (indicator products per block)."""
    k, m = d.n_codes, x.shape[1]
    codes = da.from_array(d.codes, chunks=(x.chunks[0],))[:, None]
    total = kernels.over_blocks(x, kernels.group_moments, 3 * k * m + 1, codes, k, squares)
    (flat,) = progress.compute(total, label="group moments")
    sums, sq, nnz = (flat[i * k * m : (i + 1) * k * m].reshape(k, m) for i in range(3))
    return GroupStats(sums, sq if squares else None, nnz, d.sizes, bool(flat[-1] == 0))


COUNTS_WARNING = ("It seems you use rank_genes_groups on the raw count data. "
                  "Please logarithmize your data before calling rank_genes_groups.")
