"""plots stage: PNG figures of a run, from the small slots of the stores (obs, var, obsm, uns).

Each figure needs some stores; a figure asked for with ``--plots`` whose store is not given is an error
(the rule declares every PNG it asks for as an output). Figures, by store:

* ``--qc-store``: qc_violin (QC metrics per sample, filter thresholds drawn), highest_expr_genes (var mean_counts)
* ``--hvg-store``: hvg (mean vs dispersion)
* ``--pca-store`` or ``--embedding-store``: pca_variance_ratio (uns pca), pca (obsm X_pca)
* ``--embedding-store``: umap (obsm X_umap), cluster_sizes (obs cluster key by sample); the cluster labels
  come from ``--clusters-store`` (e.g. the leiden store) when given, else from the embedding store's obs;
  umap_batch (the UMAP coloured by each of ``--batch-keys`` and the clusters), beside the UMAP of
  ``--uncorrected-store`` (the graph before batch correction) when given
* ``--markers-store``: marker_dotplot, marker_heatmap of the top genes per group of uns rank_genes_groups;
  the per-group mean and fraction expressing come from ``--aggregate-store`` (layers mean and
  count_nonzero, grouped by the cluster key alone) when given, else from one pass over the marker
  genes' columns of ``--expression-store`` (default: the markers store, whose X is log-normalised).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import dask.array as da
import numpy as np
import pandas as pd

from atlasflow import kernels, progress
from atlasflow import plots as pl
from atlasflow.errors import InputError
from atlasflow.stages._common import json_arg

DESCRIPTION = ("PNG figures (QC, HVG, PCA, UMAP, UMAP by batch before/after correction, cluster sizes, marker dot "
               "plot and heatmap) from small store slots.")
TAKES_INPUT = False
NEEDS_CLUSTER = False
ALL_PLOTS = ("qc_violin", "highest_expr_genes", "hvg", "pca_variance_ratio", "pca", "umap", "umap_batch",
             "cluster_sizes", "marker_dotplot", "marker_heatmap")
#: Which store arguments each figure can be drawn from (any one of them).
NEEDS = {
    "qc_violin": ("qc_store",), "highest_expr_genes": ("qc_store",), "hvg": ("hvg_store",),
    "pca_variance_ratio": ("pca_store", "embedding_store"), "pca": ("embedding_store", "pca_store"),
    "umap": ("embedding_store",), "umap_batch": ("embedding_store",), "cluster_sizes": ("embedding_store",),
    "marker_dotplot": ("markers_store",), "marker_heatmap": ("markers_store",),
}
STORE_ARGS = ("qc_store", "hvg_store", "pca_store", "embedding_store", "clusters_store", "markers_store",
              "expression_store", "aggregate_store", "uncorrected_store")
log = logging.getLogger(__name__)
#: The output is a folder of PNGs (each checked as atlasflow's own before it is replaced), not a store.
OUTPUT_KIND = "folder"


def add_arguments(p):
    p.add_argument("--qc-store", dest="qc_store", default=None, help="qc store (obs QC metrics, var mean_counts)")
    p.add_argument("--hvg-store", dest="hvg_store", default=None, help="hvg store (var means/dispersions)")
    p.add_argument("--pca-store", dest="pca_store", default=None, help="pca store (obsm X_pca, uns pca)")
    p.add_argument("--embedding-store", dest="embedding_store", default=None,
                   help="store with obsm X_pca/X_umap (e.g. the umap store)")
    p.add_argument("--clusters-store", dest="clusters_store", default=None,
                   help="store whose obs columns (the clusters) and uns colours are added to the embedding's "
                        "(e.g. the leiden store)")
    p.add_argument("--uncorrected-store", dest="uncorrected_store", default=None,
                   help="umap store of the graph before batch correction (obsm X_umap of the same cells): "
                        "umap_batch draws it beside the embedding store's")
    p.add_argument("--batch-keys", dest="batch_keys", nargs="*", default=None,
                   help="obs columns of the batches in umap_batch (default: the sample key)")
    p.add_argument("--markers-store", dest="markers_store", default=None,
                   help="rank_genes_groups store (uns rank_genes_groups)")
    p.add_argument("--expression-store", dest="expression_store", default=None,
                   help="log-normalised store for the markers' group means (default: the markers store)")
    p.add_argument("--aggregate-store", dest="aggregate_store", default=None,
                   help="aggregate store with layers mean and count_nonzero by the cluster key (skips the pass)")
    p.add_argument("--plots", nargs="*", default=None, choices=ALL_PLOTS,
                   help="figures to draw (default: every figure the given stores allow)")
    p.add_argument("--cluster-key", dest="cluster_key", default="leiden", help="obs column of the clusters")
    p.add_argument("--sample-key", dest="sample_key", default="sample", help="obs column of the samples")
    p.add_argument("--color-by", dest="color_by", nargs="*", default=None,
                   help="obs columns of the PCA/UMAP panels (default: cluster, sample, QC metrics)")
    p.add_argument("--thresholds", type=json_arg, default={},
                   help="JSON filter thresholds drawn on the QC plot (min_genes, max_genes, min_counts, "
                        "max_counts, max_pct_mt)")
    p.add_argument("--n-top-genes", dest="n_top_genes", type=int, default=20, help="genes in highest_expr_genes")
    p.add_argument("--n-marker-genes", dest="n_marker_genes", type=int, default=5, help="marker genes per group")
    p.add_argument("--dpi", type=int, default=100, help="pixels per inch of the PNGs")
    p.add_argument("--max-points", dest="max_points", type=int, default=pl.RASTER_MAX_POINTS,
                   help="above this many cells an embedding is binned into an image instead of drawn point by point")


def available(args) -> list[str]:
    """The figures the given stores allow."""
    return [name for name in ALL_PLOTS if any(getattr(args, k, None) for k in NEEDS[name])]


def run(args, client) -> dict:
    for key in STORE_ARGS:
        if getattr(args, key, None):
            setattr(args, key, os.path.abspath(getattr(args, key)))
    wanted = list(args.plots) if args.plots else available(args)
    missing = [n for n in wanted if not any(getattr(args, k, None) for k in NEEDS[n])]
    if missing:
        raise InputError("cannot draw " + ", ".join(f"{n} (needs --{NEEDS[n][0].replace('_', '-')})" for n in missing))
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    for name in wanted:
        fig = _draw(name, args)
        path = out / f"{name}.png"
        pl.save(fig, path, dpi=args.dpi)  # atomically
        files[name] = str(path)
        log.info("plots: wrote %s", path)
    return {"plots": files, "dpi": args.dpi}


def _draw(name, args):
    dpi = args.dpi
    if name == "qc_violin":
        obs = pl.read_slots(args.qc_store, "obs")
        return pl.qc_violin(obs, args.thresholds or {}, groupby=args.sample_key, dpi=dpi)
    if name == "highest_expr_genes":
        var = pl.read_slots(args.qc_store, "var")
        return pl.highest_expr_genes(var, n_top=args.n_top_genes, dpi=dpi)
    if name == "hvg":
        return pl.hvg_scatter(pl.read_slots(args.hvg_store, "var"), dpi=dpi)
    if name == "pca_variance_ratio":
        uns = pl.read_slots(args.pca_store or args.embedding_store, "uns") or {}
        if "pca" not in uns:
            raise InputError(f"{args.pca_store or args.embedding_store} has no uns['pca']")
        return pl.pca_variance_ratio(uns["pca"]["variance_ratio"], dpi=dpi)
    if name in ("pca", "umap"):
        src = args.embedding_store if name == "umap" else (args.embedding_store or args.pca_store)
        key = f"X_{name}"
        obs, xy, uns = pl.read_slots(src, "obs", f"obsm/{key}", "uns")
        obs, uns = _with_clusters(obs, uns, args)
        if xy is None:
            raise InputError(f"{src} has no obsm[{key!r}]")
        keys = args.color_by or [args.cluster_key, args.sample_key, *pl.QC_METRICS]
        return pl.embedding(name, np.asarray(xy), obs, keys, uns or {}, basis=name.upper(), dpi=dpi,
                            max_points=args.max_points)
    if name == "umap_batch":
        return _umap_batch(args)
    if name == "cluster_sizes":
        obs, uns = _with_clusters(*pl.read_slots(args.embedding_store, "obs", "uns"), args)
        if args.cluster_key not in obs:
            raise InputError(f"{args.clusters_store or args.embedding_store} has no obs[{args.cluster_key!r}]")
        return pl.cluster_sizes(obs, args.cluster_key, args.sample_key, uns=uns or {}, dpi=dpi)
    mean, frac, label = marker_means(args)
    if name == "marker_dotplot":
        return pl.marker_dotplot(mean, frac, dpi=dpi, value_label=label)
    return pl.marker_heatmap(mean, dpi=dpi, value_label=label)


def _umap_batch(args):
    """UMAP coloured by the batches and the clusters: after correction (the embedding store) beside before it
    (the uncorrected store), or alone."""
    obs, xy, uns = pl.read_slots(args.embedding_store, "obs", "obsm/X_umap", "uns")
    if xy is None:
        raise InputError(f"{args.embedding_store} has no obsm['X_umap']")
    obs, uns = _with_clusters(obs, uns, args)
    panels = [("integrated" if args.uncorrected_store else "UMAP", np.asarray(xy))]
    if args.uncorrected_store:
        before_obs, before = pl.read_slots(args.uncorrected_store, "obs", "obsm/X_umap")
        if before is None or not before_obs.index.equals(obs.index):
            raise InputError(f"{args.uncorrected_store} has no obsm['X_umap'] of the cells of {args.embedding_store}")
        panels.insert(0, ("uncorrected", np.asarray(before)))
    batch_keys = list(args.batch_keys) if args.batch_keys else [args.sample_key]
    absent = [k for k in batch_keys if k not in obs]
    if absent:
        log.warning("plots: umap_batch: obs has no %s; drawn without them", ", ".join(map(repr, absent)))
    keys = [k for k in dict.fromkeys([*batch_keys, args.cluster_key]) if k in obs]
    return pl.embeddings_side_by_side("umap_batch", panels, obs, keys, uns or {}, dpi=args.dpi,
                                      max_points=args.max_points)


def _with_clusters(obs: pd.DataFrame, uns, args):
    """The embedding store's obs and uns plus the clusters store's columns and entries they lack."""
    uns = dict(uns or {})
    if not args.clusters_store:
        return obs, uns
    c_obs, c_uns = pl.read_slots(args.clusters_store, "obs", "uns")
    if not c_obs.index.equals(obs.index):
        raise InputError(f"{args.clusters_store} does not have the cells of {args.embedding_store}")
    obs = pl.add_missing_columns(obs, c_obs)
    for key, value in (c_uns or {}).items():
        uns.setdefault(key, value)
    return obs, uns


_MEANS_CACHE: dict = {}


def marker_means(args) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    """Per-group mean and fraction expressing of the top marker genes (groups x genes), and a value label."""
    key = (args.markers_store, args.aggregate_store, args.expression_store, args.n_marker_genes)
    if key in _MEANS_CACHE:
        return _MEANS_CACHE[key]
    uns = pl.read_slots(args.markers_store, "uns") or {}
    if "rank_genes_groups" not in uns:
        raise InputError(f"{args.markers_store} has no uns['rank_genes_groups']")
    rgg = uns["rank_genes_groups"]
    groupby = str(rgg.get("params", {}).get("groupby", args.cluster_key))
    genes = pl.marker_genes(pl.top_markers(rgg, args.n_marker_genes))
    result = None
    if args.aggregate_store:
        result = _from_aggregate(args.aggregate_store, groupby, genes)
    if result is None:
        result = group_means(args.expression_store or args.markers_store, groupby, genes,
                             labels_store=args.markers_store)
    _MEANS_CACHE[key] = result
    return result


def _from_aggregate(path, groupby, genes):
    """Means and fractions from an aggregate store grouped by ``groupby`` alone; None when it does not fit."""
    import anndata as ad
    import zarr

    from atlasflow.integrity import verify_store

    verify_store(path, keys=("layers/mean", "layers/count_nonzero"))
    root = zarr.open_group(str(path), mode="r")
    obs, var = ad.io.read_elem(root["obs"]), ad.io.read_elem(root["var"])
    layers = root["layers"] if "layers" in root else {}
    if groupby not in obs or "mean" not in layers or "count_nonzero" not in layers:
        log.info("plots: %s is not grouped by %s alone with mean and count_nonzero: one pass instead", path, groupby)
        return None
    extra = [c for c in obs.columns if c not in (groupby, "n_cells")]
    if any(obs[c].nunique() > 1 for c in extra if obs[c].dtype.name == "category"):
        return None
    idx = var.index.get_indexer(genes)
    mean = np.asarray(ad.io.read_elem(layers["mean"]))[:, idx]
    nnz = np.asarray(ad.io.read_elem(layers["count_nonzero"]))[:, idx]
    labels = pl.read_slots(path, "obs")[groupby].astype(str)
    sizes = _group_sizes_from_cells(path, groupby)
    if sizes is None:
        return None
    n = np.array([sizes.get(g, 0) for g in labels], dtype=np.float64)[:, None]
    index = pd.Index(labels, name=groupby)
    frac = pd.DataFrame(nnz / np.maximum(n, 1), index=index, columns=genes)
    return pd.DataFrame(mean, index=index, columns=genes), frac, "mean counts"


def _group_sizes_from_cells(path, groupby):
    obs = pl.read_slots(path, "obs")
    if "n_cells" in obs:
        return dict(zip(obs[groupby].astype(str), obs["n_cells"].astype(int), strict=True))
    return None


def group_means(path, groupby, genes, labels_store=None):
    """One pass over the genes' columns of a store's X: per-group mean and fraction of cells > 0."""
    from atlasflow.store import open_store

    adata = open_store(path)
    labels = adata.obs[groupby] if groupby in adata.obs else pl.read_slots(labels_store, "obs")[groupby]
    labels = labels.astype("category")
    if not labels.index.equals(adata.obs_names):
        labels = labels.reindex(adata.obs_names)
    codes = labels.cat.codes.to_numpy().astype(np.int64)
    groups = list(labels.cat.categories)
    col_idx = adata.var_names.get_indexer(genes)
    if (col_idx < 0).any():
        raise InputError(f"{path} lacks marker genes {[g for g, i in zip(genes, col_idx, strict=True) if i < 0]}")
    x = adata.X
    g = da.from_array(codes[:, None], chunks=(x.chunks[0], 1))
    k, m = len(groups), len(genes)
    stats = kernels.over_blocks(x, _grouped_stats, k * 3 * m, g, col_idx, k)
    (stats,) = progress.compute(stats, label="marker statistics")
    stats = stats.reshape(k, 3, m)
    sizes = np.bincount(codes[codes >= 0], minlength=k).astype(np.float64)[:, None]
    index = pd.Index([str(c) for c in groups], name=groupby)
    mean = pd.DataFrame(stats[:, 0] / np.maximum(sizes, 1), index=index, columns=genes)
    frac = pd.DataFrame(stats[:, 2] / np.maximum(sizes, 1), index=index, columns=genes)
    return mean, frac, "mean expression"


def _grouped_stats(block, groups, col_idx, n_groups):
    groups = np.asarray(groups).ravel()
    keep = groups >= 0
    sub = kernels.select_columns(block, col_idx)
    if not keep.all():
        sub, groups = sub[np.flatnonzero(keep)], groups[keep]
    return kernels.col_stats_grouped(sub, groups[:, None], n_groups)
