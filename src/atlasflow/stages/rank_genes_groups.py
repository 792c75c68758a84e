"""rank_genes_groups stage: marker genes per cluster (scanpy.tl.rank_genes_groups) and a tidy marker table.

Input: a log-normalised full-gene store (X); cluster labels from ``--groups-store`` (e.g. the leiden
store: ``obs[groupby]`` aligned by obs_names) or from the input's own obs. Output: the input store
with ``obs[groupby]`` and ``uns[key_added]`` added (X and layers hard-linked, not copied) and a CSV
of markers next to it (``--markers-csv``, default: the output path with ``.csv``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import anndata as ad
import pandas as pd
import zarr

from atlasflow import ownership
from atlasflow.errors import InputError, StoreError
from atlasflow.integrity import verify_store
from atlasflow.stages._common import optional_float, shape_summary
from atlasflow.store import open_store, temporary_sibling, write_store
from atlasflow.tl import markers as mk

DESCRIPTION = ("Rank marker genes per group (t-test, t-test_overestim_var, exact out-of-core wilcoxon, logreg) "
               "and write uns['rank_genes_groups'] plus a tidy marker CSV.")
log = logging.getLogger(__name__)


def add_arguments(p):
    p.add_argument("--groups-store", dest="groups_store", default=None,
                   help="store whose obs holds the labels (e.g. the leiden store), aligned by obs_names "
                        "(none: the input's obs)")
    p.add_argument("--groupby", default="leiden", help="obs column with the groups (categorical)")
    p.add_argument("--groups", nargs="*", default=None, help="groups to test (none: all)")
    p.add_argument("--reference", default="rest", help="'rest' or the group every group is compared with")
    p.add_argument("--method", default="t-test", help="t-test, t-test_overestim_var, wilcoxon or logreg")
    p.add_argument("--n-genes", dest="n_genes", type=int, default=None,
                   help="genes per group in the results and the CSV (none: all)")
    p.add_argument("--corr-method", dest="corr_method", default="benjamini-hochberg",
                   help="p-value correction: benjamini-hochberg or bonferroni")
    p.add_argument("--tie-correct", dest="tie_correct", action="store_true", help="wilcoxon: tie correction")
    p.add_argument("--rankby-abs", dest="rankby_abs", action="store_true", help="rank by |score|")
    p.add_argument("--pts", action="store_true", help="also store pts / pts_rest in uns (the CSV always has them)")
    p.add_argument("--key-added", dest="key_added", default=None, help="uns key (none: rank_genes_groups)")
    p.add_argument("--layer", default=None, help="test this layer instead of X")
    p.add_argument("--mask-var", dest="mask_var", default=None, help="boolean var column: test only these genes")
    p.add_argument("--gene-block", dest="gene_block", type=int, default=None,
                   help="wilcoxon: genes per block of the transposed X (none: ~2M non-zeros per block)")
    p.add_argument("--gene-major", dest="gene_major", default=None,
                   help="wilcoxon: keep the gene-major copy of X here and reuse it when it matches the input "
                        "(none: no copy; X is transposed into compressed scratch pieces next to the output, removed "
                        "afterwards)")
    p.add_argument("--max-iter", dest="max_iter", type=int, default=100, help="logreg: L-BFGS iterations")
    p.add_argument("--C", dest="C", type=float, default=1.0, help="logreg: inverse L2 regularisation strength")
    p.add_argument("--tol", dest="tol", type=float, default=1e-4, help="logreg: gradient tolerance")
    p.add_argument("--markers-csv", dest="markers_csv", default=None,
                   help="tidy marker table (none: OUTPUT with .csv instead of .zarr)")
    p.add_argument("--gene-symbols", dest="gene_symbols", default=None,
                   help="var column with gene symbols for the CSV (none: gene_symbols/symbol/... if present)")
    p.add_argument("--filter-markers", dest="filter_markers", action="store_true",
                   help="keep only markers passing scanpy's filter_rank_genes_groups criteria in the CSV")
    p.add_argument("--min-in-group-fraction", dest="min_in_group_fraction", type=float, default=0.25,
                   help="filter: pct_in must exceed this")
    p.add_argument("--max-out-group-fraction", dest="max_out_group_fraction", type=float, default=0.5,
                   help="filter: pct_out must stay below this")
    p.add_argument("--min-fold-change", dest="min_fold_change", type=optional_float, default=1.0,
                   help="filter: log2 fold change must exceed this")
    p.add_argument("--compare-abs", dest="compare_abs", action="store_true",
                   help="filter: compare |log2 fold change|")


def read_obs(path) -> pd.DataFrame:
    """Only the obs table of a store."""
    if not Path(path).exists():
        raise StoreError(f"groups store {path} does not exist")
    verify_store(path, keys=("obs",))
    try:
        return ad.io.read_elem(zarr.open_group(str(path), mode="r")["obs"])
    except Exception as exc:  # noqa: BLE001
        raise StoreError(f"cannot read obs of {path}: {exc}") from exc


def attach_obs(adata: ad.AnnData, groups_store, keys, *, param: str) -> list[str]:
    """Copy ``obs[key]`` for each key found in ``groups_store`` onto ``adata``, aligned by obs_names."""
    if not groups_store:
        return []
    other = read_obs(groups_store)
    if not other.index.is_unique:
        raise InputError(f"groups_store: {groups_store} has duplicate obs_names")
    found = [k for k in keys if k in other.columns]
    missing = [k for k in keys if k not in other.columns and k not in adata.obs.columns]
    if missing:
        raise InputError(f"{param}: {missing} neither in the obs of {groups_store} nor in the input's obs")
    if not found:
        return []
    common = adata.obs_names.isin(other.index)
    if not common.any():
        raise InputError(f"groups_store: no cell of the input is in {groups_store} (obs_names differ)")
    if not common.all():
        log.warning("%d of %d cells have no label in %s", int((~common).sum()), adata.n_obs, groups_store)
    for k in found:
        adata.obs[k] = other[k].reindex(adata.obs_names).values  # categories kept; missing cells NaN
    return found


def extra_outputs(args) -> list[tuple[str, str, str]]:
    """The marker CSV and the kept gene-major copy (checked by the CLI before any work)."""
    outs = [("markers_csv", str(_csv_path(args)), "file")]
    return outs + ([("gene_major", args.gene_major, "store")] if args.gene_major else [])


def _csv_path(args) -> Path:
    return Path(args.markers_csv) if args.markers_csv else Path(args.output).with_suffix(".csv")


def write_csv_atomic(table: pd.DataFrame, path: Path) -> Path:
    """Write a CSV under a temporary name; the caller moves it into place with ``ownership.replace_file``."""
    tmp = temporary_sibling(path)
    table.to_csv(tmp, index=False)
    return tmp


def run(args, client) -> dict:
    adata = open_store(args.input, chunk_rows=args.chunk_rows)
    attach_obs(adata, args.groups_store, [args.groupby], param="groupby")
    logreg = {"C": args.C, "max_iter": args.max_iter, "tol": args.tol} if args.method == "logreg" else {}
    res = mk.compute_markers(
        adata, args.groupby, mask_var=args.mask_var, groups=args.groups or "all", reference=args.reference,
        n_genes=args.n_genes, rankby_abs=args.rankby_abs, method=args.method, corr_method=args.corr_method,
        tie_correct=args.tie_correct, layer=args.layer, gene_block=args.gene_block, gene_major=args.gene_major,
        work_dir=Path(args.output).resolve().parent, **logreg,
    )
    key = args.key_added or "rank_genes_groups"
    adata.uns[key] = res.uns(pts=args.pts)
    filter_kw = None
    if args.filter_markers:
        filter_kw = {"min_in_group_fraction": args.min_in_group_fraction, "compare_abs": args.compare_abs,
                     "max_out_group_fraction": args.max_out_group_fraction,
                     "min_fold_change": args.min_fold_change if args.min_fold_change is not None else float("-inf")}
    table = mk.marker_table(res, adata.var, gene_symbols=args.gene_symbols, filter_kw=filter_kw)
    csv = _csv_path(args)
    tmp = write_csv_atomic(table, csv)
    try:
        write_store(adata, args.output, chunk_rows=args.chunk_rows,
                    provenance={"stage": "rank_genes_groups", "method": res.params["method"]})
        ownership.replace_file(tmp, csv)
    finally:
        tmp.unlink(missing_ok=True)
    top = table.groupby("group", sort=False).head(5).groupby("group", sort=False)["symbol"].apply(list)
    return {
        **shape_summary(adata, adata),
        "method": res.params["method"], "groupby": args.groupby, "reference": args.reference,
        "groups_tested": res.groups, "group_sizes": {g: int((adata.obs[args.groupby] == g).sum()) for g in res.order},
        "markers_csv": str(csv), "csv_rows": int(len(table)), "top_markers": top.to_dict(),
    }
