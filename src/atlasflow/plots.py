"""Figures of a run, drawn from small slots only (obs, var, obsm, uns, per-group means), never from X.

Every function takes in-memory tables/arrays and returns a matplotlib Figure of a fixed size
(``FIGSIZES[name]`` inches at ``dpi``), so a PNG's pixel size is known in advance. The Agg backend is
used; nothing is shown.

Scatter plots of many cells (``scatter_embedding``): up to ``RASTER_MAX_POINTS`` points are drawn with a
rasterized ``scatter``; above that the points are binned into an image of the panel's pixel size, in
slices of ``BIN_SLICE`` points, so memory beyond the coordinates and colour values themselves is
O(BIN_SLICE + pixels), independent of the number of cells: measured with tracemalloc, a two-panel
figure peaks at ~85 MiB for 2M and for 10M cells (10M: ~15 s on a loaded 2-core machine). Categorical
colours: the colour of the last point falling in a pixel (slices and the points within each drawn in a
fixed random order); continuous colours: the mean value per pixel.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import zarr  # noqa: E402
from matplotlib.colors import to_hex, to_rgba_array  # noqa: E402

from atlasflow import integrity, ownership  # noqa: E402
from atlasflow.store import temporary_sibling  # noqa: E402

#: Above this many points a scatter is binned into an image instead of drawn point by point.
RASTER_MAX_POINTS = 200_000
#: Points binned at a time (bounds the temporaries of the binning).
BIN_SLICE = 1_000_000
#: Inches (width, height) of each figure; pixels = inches x dpi.
FIGSIZES = {
    "qc_violin": (12, 4),
    "highest_expr_genes": (6, 6),
    "hvg": (10, 4),
    "pca_variance_ratio": (6, 4),
    "pca": (16, 7),
    "umap": (16, 7),
    "umap_batch": (14, 10),
    "cluster_sizes": (8, 5),
    "marker_dotplot": (12, 6),
    "marker_heatmap": (12, 6),
}
QC_METRICS = ("n_genes_by_counts", "total_counts", "pct_counts_mt")
#: filter parameters drawn as lines on each QC metric's panel.
QC_THRESHOLDS = {
    "n_genes_by_counts": ("min_genes", "max_genes"),
    "total_counts": ("min_counts", "max_counts"),
    "pct_counts_mt": (None, "max_pct_mt"),
}


def pixel_size(name: str, dpi: int = 100) -> tuple[int, int]:
    """(width, height) in pixels of a saved figure."""
    w, h = FIGSIZES[name]
    return int(round(w * dpi)), int(round(h * dpi))


def _figure(name: str, nrows: int = 1, ncols: int = 1, dpi: int = 100, **kw):
    fig, axes = plt.subplots(nrows, ncols, figsize=FIGSIZES[name], dpi=dpi, squeeze=False,
                             layout="constrained", **kw)
    return fig, axes


def save(fig, path, dpi: int = 100) -> None:
    """Save at the figure's own size (no tight bbox, so the pixel size stays as declared) and close.

    Written under a temporary name and renamed: a killed run never leaves a truncated PNG in place.
    """
    path = Path(path)
    try:
        ownership.check_replaceable(path, "file")
        tmp = temporary_sibling(path)
        try:
            fig.savefig(tmp, dpi=dpi, format="png")
            ownership.replace_file(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    finally:
        plt.close(fig)


# ------------------------------------------------------------------------------------------ reading


def read_slots(path, *keys):
    """Read small elements (``obs``, ``var``, ``uns``, ``obsm/X_umap``, ...) of a store; missing ones are None."""
    import anndata as ad

    integrity.verify_store(path, keys=keys)  # a missing chunk is an error, never zeros
    root = zarr.open_group(str(path), mode="r")
    out = []
    for key in keys:
        try:
            out.append(ad.io.read_elem(root[key]) if key in root else None)
        except KeyError:
            out.append(None)
    return out if len(out) > 1 else out[0]



def add_missing_columns(obs: pd.DataFrame, other: pd.DataFrame) -> pd.DataFrame:
    """``obs`` with the columns of ``other`` (same cells, same order) that it lacks, appended."""
    extra = [c for c in other.columns if c not in obs.columns]
    return pd.concat([obs, other[extra]], axis=1) if extra else obs


# ------------------------------------------------------------------------------------------ colours


def palette(n: int) -> list[str]:
    """n distinct colours (tab10/tab20 for up to 20 groups, then evenly spaced hues), as hex."""
    if n <= 10:
        cols = plt.get_cmap("tab10").colors[:n]
    elif n <= 20:
        cols = plt.get_cmap("tab20").colors[:n]
    else:
        cols = plt.get_cmap("gist_rainbow")(np.linspace(0, 1, n, endpoint=False))
    return [to_hex(c) for c in cols]


def category_colors(values: pd.Series, uns: dict | None = None, key: str | None = None) -> list[str]:
    """Colours of a categorical obs column: ``uns[key + '_colors']`` when it fits, else ``palette``."""
    cats = values.astype("category").cat.categories
    stored = (uns or {}).get(f"{key}_colors") if key else None
    if stored is not None and len(stored) >= len(cats):
        return [str(c) for c in list(stored)[: len(cats)]]
    return palette(len(cats))


# ------------------------------------------------------------------------------------------ QC


def _subsample(values: np.ndarray, n: int, seed: int = 0) -> np.ndarray:
    if values.shape[0] <= n:
        return values
    return np.random.default_rng(seed).choice(values, n, replace=False)


def qc_violin(obs: pd.DataFrame, thresholds: dict | None = None, groupby: str = "sample",
              max_points: int = 20_000, dpi: int = 100):
    """Violins of the QC metrics per sample with the filter thresholds (lower bounds dashed green, upper dotted red).

    The density of each violin is estimated on at most ``max_points`` cells per sample (random, fixed seed).
    """
    thresholds = thresholds or {}
    metrics = [m for m in QC_METRICS if m in obs]
    fig, axes = _figure("qc_violin", 1, max(len(metrics), 1), dpi=dpi)
    groups = obs[groupby].astype("category") if groupby in obs else pd.Series("all", index=obs.index, dtype="category")
    names = list(groups.cat.categories)
    for ax, metric in zip(axes[0], metrics, strict=False):
        values = obs[metric].to_numpy(dtype=np.float64)
        data = [_subsample(values[(groups == g).to_numpy()], max_points) for g in names]
        keep = [i for i, d in enumerate(data) if d.size > 1 and np.ptp(d) > 0]
        if keep:
            parts = ax.violinplot([data[i] for i in keep], positions=keep, showmedians=True, widths=0.8)
            for body in parts["bodies"]:
                body.set_alpha(0.6)
        for i, d in enumerate(data):
            if i not in keep and d.size:
                ax.plot([i], [d[0]], "o", color="C0")
        for side, key in zip(("min", "max"), QC_THRESHOLDS.get(metric, (None, None)), strict=True):
            value = thresholds.get(key) if key else None
            if value is not None:  # a lower bound dashed green, an upper bound dotted red: told apart at a glance
                style = {"color": "tab:green", "ls": "--"} if side == "min" else {"color": "tab:red", "ls": ":"}
                ax.axhline(float(value), lw=1.5, label=f"{key} = {value:g}", **style)
        ax.set_xticks(range(len(names)), [str(n) for n in names], rotation=45 if len(names) > 4 else 0, ha="right")
        ax.set_title(metric)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="upper right")
    for ax in axes[0][len(metrics):]:
        ax.set_axis_off()
    if not metrics:
        axes[0][0].text(0.5, 0.5, "no QC metrics in obs", ha="center")
    return fig


def highest_expr_genes(var: pd.DataFrame, n_top: int = 20, column: str = "mean_counts", dpi: int = 100):
    """Genes with the largest share of all counts, from the qc store's ``var[column]`` (no pass over X)."""
    fig, axes = _figure("highest_expr_genes", dpi=dpi)
    ax = axes[0][0]
    values = var[column].to_numpy(dtype=np.float64)
    share = 100 * values / max(values.sum(), np.finfo(float).tiny)
    order = np.argsort(-share, kind="stable")[:n_top]
    ax.barh(np.arange(order.size)[::-1], share[order], color="C0")
    ax.set_yticks(np.arange(order.size)[::-1], [str(var.index[i]) for i in order], fontsize=8)
    ax.set_xlabel("% of all counts")
    ax.set_title(f"top {order.size} genes by {column}")
    return fig


def hvg_scatter(var: pd.DataFrame, dpi: int = 100):
    """Mean vs (normalised) dispersion or variance of each gene, highly variable genes highlighted."""
    fig, axes = _figure("hvg", 1, 2, dpi=dpi)
    hv = var["highly_variable"].to_numpy(dtype=bool) if "highly_variable" in var else np.zeros(len(var), bool)
    mean = var["means"] if "means" in var else var.get("mean_counts", pd.Series(np.zeros(len(var))))
    pairs = [("dispersions_norm", "dispersions"), ("variances_norm", "variances"), ("dispersions", "dispersions")]
    ys = next((p for p in pairs if p[0] in var), None) or (None, None)
    for ax, col in zip(axes[0], ys, strict=True):
        if col is None or col not in var:
            ax.text(0.5, 0.5, "no dispersion in var", ha="center", transform=ax.transAxes)
            continue
        y = var[col].to_numpy(dtype=np.float64)
        x = np.asarray(mean, dtype=np.float64)
        ax.scatter(x[~hv], y[~hv], s=2, c="lightgray", label="other genes", rasterized=True)
        ax.scatter(x[hv], y[hv], s=2, c="black", label=f"highly variable ({hv.sum()})", rasterized=True)
        ax.set_xlabel("mean expression")
        ax.set_ylabel(col)
        if col == "dispersions" and (y > 0).all():
            ax.set_yscale("log")
        ax.legend(fontsize=8, markerscale=4)
    return fig


def pca_variance_ratio(variance_ratio, n_pcs: int = 50, dpi: int = 100):
    """Explained variance ratio per component (log scale), as scanpy.pl.pca_variance_ratio."""
    fig, axes = _figure("pca_variance_ratio", dpi=dpi)
    ax = axes[0][0]
    vr = np.asarray(variance_ratio, dtype=np.float64)[:n_pcs]
    ax.plot(np.arange(1, vr.size + 1), vr, "o", ms=4)
    if (vr > 0).all():
        ax.set_yscale("log")
    ax.set_xlabel("principal component")
    ax.set_ylabel("variance ratio")
    return fig


# ------------------------------------------------------------------------------------------ embeddings


def _bin_image(xy: np.ndarray, extent, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Pixel (row, col) of each point for an image of ``shape`` covering ``extent`` (x0, x1, y0, y1)."""
    x0, x1, y0, y1 = extent
    h, w = shape
    col = np.clip(((xy[:, 0] - x0) / max(x1 - x0, 1e-12) * w).astype(np.int64), 0, w - 1)
    row = np.clip(((y1 - xy[:, 1]) / max(y1 - y0, 1e-12) * h).astype(np.int64), 0, h - 1)
    return row, col


def _slices(n: int, seed: int | None):
    """Index arrays of consecutive slices of ``BIN_SLICE`` points; with a seed, slices and points within
    each slice in random order (a random drawing order without an O(n) permutation)."""
    starts = np.arange(0, n, BIN_SLICE)
    rng = np.random.default_rng(seed) if seed is not None else None
    if rng is not None:
        starts = rng.permutation(starts)
    for s in starts:
        idx = np.arange(s, min(s + BIN_SLICE, n))
        yield rng.permutation(idx) if rng is not None else idx


def data_extent(xy: np.ndarray, pad: float = 0.03) -> tuple[float, float, float, float]:
    """(x0, x1, y0, y1) of the finite points plus a margin, computed slice by slice."""
    lo, hi = np.full(2, np.inf), np.full(2, -np.inf)
    for s in range(0, xy.shape[0], BIN_SLICE):
        part = np.asarray(xy[s: s + BIN_SLICE, :2], dtype=np.float64)
        part = part[np.isfinite(part).all(axis=1)]
        if part.size:
            lo, hi = np.minimum(lo, part.min(axis=0)), np.maximum(hi, part.max(axis=0))
    if not np.isfinite(lo).all():
        lo, hi = np.zeros(2), np.ones(2)
    margin = (hi - lo) * pad + 1e-6
    return lo[0] - margin[0], hi[0] + margin[0], lo[1] - margin[1], hi[1] + margin[1]


def binned_image(xy: np.ndarray, values, extent, shape, *, categorical: bool, colors=None, cmap="viridis",
                 vmin=None, vmax=None, seed: int | None = 0) -> np.ndarray:
    """RGBA image (h, w, 4) of many points, binned in slices of ``BIN_SLICE`` points (bounded memory)."""
    h, w = shape
    n = xy.shape[0]
    img = np.ones((h, w, 4), dtype=np.float32)
    img[..., 3] = 0
    if categorical:
        rgba = to_rgba_array(colors).astype(np.float32)
        last = np.full(h * w, -1, dtype=np.int32)
        for idx in _slices(n, seed):
            r, c = _bin_image(xy[idx], extent, shape)
            last[r * w + c] = np.asarray(values[idx], dtype=np.int32)  # later points win, as drawn on top
        hit = last >= 0
        img.reshape(-1, 4)[hit] = rgba[last[hit]]
        return img
    sums = np.zeros(h * w, dtype=np.float64)
    counts = np.zeros(h * w, dtype=np.float64)
    for idx in _slices(n, None):
        r, c = _bin_image(xy[idx], extent, shape)
        pix = r * w + c
        sums += np.bincount(pix, weights=np.asarray(values[idx], dtype=np.float64), minlength=h * w)
        counts += np.bincount(pix, minlength=h * w)
    hit = counts > 0
    mean = np.zeros(h * w)
    mean[hit] = sums[hit] / counts[hit]
    norm = plt.Normalize(vmin=vmin, vmax=vmax)
    img.reshape(-1, 4)[hit] = plt.get_cmap(cmap)(norm(mean[hit])).astype(np.float32)
    return img


def scatter_embedding(ax, xy: np.ndarray, values: pd.Series | np.ndarray | None, *, title: str = "",
                      colors=None, max_points: int = RASTER_MAX_POINTS, seed: int = 0) -> None:
    """One embedding panel coloured by a categorical or numeric column (binned above ``max_points``)."""
    xy = np.asarray(xy)[:, :2]
    n = xy.shape[0]
    values = pd.Series(values) if values is not None and not isinstance(values, pd.Series) else values
    categorical = values is not None and (isinstance(values.dtype, pd.CategoricalDtype) or values.dtype == object
                                          or values.dtype == bool)
    binned = n > max_points
    order = np.random.default_rng(seed).permutation(n) if categorical and not binned else None
    if categorical:
        cat = values.astype(str).astype("category") if values.dtype != "category" else values
        codes = cat.cat.codes.to_numpy()
        colors = list(colors) if colors is not None else palette(len(cat.cat.categories))
        colors = colors[: len(cat.cat.categories)]
    extent = data_extent(xy)
    size = max(0.5, min(20.0, 12000.0 / max(n, 1)))
    if binned:
        bbox = ax.get_window_extent()
        shape = (max(int(bbox.height), 10), max(int(bbox.width), 10))
        if values is None:
            img = binned_image(xy, np.zeros(n, np.int32), extent, shape, categorical=True, colors=["gray"])
        elif categorical:
            img = binned_image(xy, codes, extent, shape, categorical=True, colors=colors, seed=seed)
        else:
            v = values.to_numpy()
            img = binned_image(xy, v, extent, shape, categorical=False, vmin=np.nanmin(v), vmax=np.nanmax(v))
        ax.imshow(img, extent=extent, aspect="auto", interpolation="nearest", origin="upper")
        ax.set_xlim(extent[:2])
        ax.set_ylim(extent[2:])
        if values is not None and not categorical:
            sm = plt.cm.ScalarMappable(cmap="viridis", norm=plt.Normalize(np.nanmin(v), np.nanmax(v)))
            ax.figure.colorbar(sm, ax=ax, shrink=0.7)
    elif values is None:
        ax.scatter(xy[:, 0], xy[:, 1], s=size, c="gray", linewidths=0, rasterized=True)
    elif categorical:
        ax.scatter(xy[order, 0], xy[order, 1], s=size, c=np.asarray(colors, dtype=object)[codes[order]],
                   linewidths=0, rasterized=True)
    else:
        sc = ax.scatter(xy[:, 0], xy[:, 1], s=size, c=values.to_numpy(dtype=np.float64), cmap="viridis",
                        linewidths=0, rasterized=True)
        ax.figure.colorbar(sc, ax=ax, shrink=0.7)
    if categorical:
        cats = list(cat.cat.categories)
        if len(cats) <= 40:
            handles = [plt.Line2D([], [], marker="o", ls="", color=colors[i], label=str(c)) for i, c in enumerate(cats)]
            ax.legend(handles=handles, fontsize=9 if len(cats) <= 20 else 8, loc="center left",
                      bbox_to_anchor=(1, 0.5), frameon=False, ncol=1 if len(cats) <= 20 else 2, markerscale=1.2)
    ax.set_title(title)
    ax.set_xticks([])
    ax.set_yticks([])


def embedding(name: str, xy: np.ndarray, obs: pd.DataFrame, keys: list[str], uns: dict | None = None,
              basis: str = "", dpi: int = 100, max_points: int = RASTER_MAX_POINTS):
    """A grid of embedding panels (``name`` = pca or umap), one per obs key present."""
    keys = [k for k in keys if k in obs] or [None]
    ncols = min(3, len(keys))
    nrows = -(-len(keys) // ncols)
    fig, axes = _figure(name, nrows, ncols, dpi=dpi)
    fig.canvas.draw()  # panel sizes are known from here on (for the binned images)
    flat = axes.ravel()
    for ax, key in zip(flat, keys, strict=False):
        values = obs[key] if key else None
        colors = category_colors(values, uns, key) if key and isinstance(values.dtype, pd.CategoricalDtype) else None
        scatter_embedding(ax, xy, values, title=key or basis, colors=colors, max_points=max_points)
        ax.set_xlabel(f"{basis}1")
        ax.set_ylabel(f"{basis}2")
    for ax in flat[len(keys):]:
        ax.set_axis_off()
    return fig


def embeddings_side_by_side(name: str, panels: list[tuple[str, np.ndarray]], obs: pd.DataFrame, keys: list[str],
                            uns: dict | None = None, basis: str = "UMAP", dpi: int = 100,
                            max_points: int = RASTER_MAX_POINTS):
    """A grid with one row per obs key (present in ``obs``) and one column per (title, embedding) panel: the
    same cells, coloured alike, laid out by each embedding (e.g. before and after batch correction)."""
    keys = [k for k in keys if k in obs] or [None]
    fig, axes = _figure(name, len(keys), len(panels), dpi=dpi)
    fig.canvas.draw()  # panel sizes are known from here on (for the binned images)
    for row, key in zip(axes, keys, strict=True):
        values = obs[key] if key else None
        colors = category_colors(values, uns, key) if key and isinstance(values.dtype, pd.CategoricalDtype) else None
        for ax, (title, xy) in zip(row, panels, strict=True):
            scatter_embedding(ax, xy, values, title=f"{title}: {key}" if key else title, colors=colors,
                              max_points=max_points)
            ax.set_xlabel(f"{basis}1")
            ax.set_ylabel(f"{basis}2")
    return fig


def cluster_sizes(obs: pd.DataFrame, cluster_key: str, sample_key: str = "sample", uns=None, dpi: int = 100):
    """Cells per cluster, stacked by sample."""
    fig, axes = _figure("cluster_sizes", dpi=dpi)
    ax = axes[0][0]
    clusters = obs[cluster_key].astype("category")
    samples = obs[sample_key].astype("category") if sample_key in obs else pd.Series(
        pd.Categorical(["all"] * len(obs)), index=obs.index)
    table = pd.crosstab(clusters, samples)
    bottom = np.zeros(len(table))
    colors = category_colors(samples, uns, sample_key)
    for i, s in enumerate(table.columns):
        ax.bar(np.arange(len(table)), table[s].to_numpy(), bottom=bottom, color=colors[i], label=str(s))
        bottom += table[s].to_numpy()
    ax.set_xticks(np.arange(len(table)), [str(c) for c in table.index], rotation=90 if len(table) > 20 else 0)
    ax.set_xlabel(cluster_key)
    ax.set_ylabel("cells")
    if len(table.columns) <= 30:
        ax.legend(fontsize=7, title=sample_key, loc="upper right")
    return fig


# ------------------------------------------------------------------------------------------ markers


def top_markers(rgg: dict, n_genes: int = 5) -> list[tuple[str, str]]:
    """(group, gene) of the first ``n_genes`` names per group of ``uns['rank_genes_groups']``, in group order."""
    names = rgg["names"]
    groups = list(names.dtype.names) if getattr(names, "dtype", None) is not None and names.dtype.names else \
        list(pd.DataFrame(names).columns)
    table = pd.DataFrame({g: np.asarray(names[g]) for g in groups})
    return [(str(g), str(gene)) for g in groups for gene in table[g].iloc[:n_genes]]


def marker_genes(pairs: list[tuple[str, str]]) -> list[str]:
    """Unique genes of the (group, gene) pairs, first occurrence order."""
    return list(dict.fromkeys(g for _, g in pairs))


def marker_dotplot(mean: pd.DataFrame, fraction: pd.DataFrame, pairs=None, dpi: int = 100,
                   value_label: str = "mean expression"):
    """Dot plot: colour = mean expression in the group, size = fraction of the group's cells expressing."""
    fig, axes = _figure("marker_dotplot", dpi=dpi)
    ax = axes[0][0]
    groups, genes = list(mean.index), list(mean.columns)
    gx, gy = np.meshgrid(np.arange(len(genes)), np.arange(len(groups)))
    scaled = mean.to_numpy(dtype=np.float64)
    rng = scaled.max(axis=0) - scaled.min(axis=0)
    scaled = (scaled - scaled.min(axis=0)) / np.where(rng > 0, rng, 1)  # per gene, as standard_scale="var"
    frac = fraction.to_numpy(dtype=np.float64)
    sc = ax.scatter(gx.ravel(), gy.ravel(), s=frac.ravel() * 120 + 0.5, c=scaled.ravel(), cmap="Reds",
                    vmin=0, vmax=1, edgecolors="gray", linewidths=0.3)
    ax.set_xticks(range(len(genes)), genes, rotation=90, fontsize=7)
    ax.set_yticks(range(len(groups)), [str(g) for g in groups], fontsize=8)
    ax.set_xlim(-0.7, len(genes) - 0.3)
    ax.set_ylim(len(groups) - 0.5, -0.5)
    ax.set_xlabel("marker genes")
    ax.set_ylabel(mean.index.name or "group")
    fig.colorbar(sc, ax=ax, shrink=0.5, label=f"{value_label} (scaled per gene)")
    for f in (0.2, 0.6, 1.0):
        ax.scatter([], [], s=f * 120 + 0.5, c="gray", label=f"{int(f * 100)} %")
    ax.legend(title="fraction expressing", fontsize=7, loc="center left", bbox_to_anchor=(1.15, 0.5), frameon=False)
    return fig


def marker_heatmap(mean: pd.DataFrame, dpi: int = 100, value_label: str = "mean expression"):
    """Heatmap of the groups' mean expression of the marker genes, z-scored per gene."""
    fig, axes = _figure("marker_heatmap", dpi=dpi)
    ax = axes[0][0]
    m = mean.to_numpy(dtype=np.float64)
    sd = m.std(axis=0)
    z = (m - m.mean(axis=0)) / np.where(sd > 0, sd, 1)
    im = ax.imshow(z, aspect="auto", cmap="RdBu_r", vmin=-3, vmax=3, interpolation="nearest")
    ax.set_xticks(range(mean.shape[1]), list(mean.columns), rotation=90, fontsize=7)
    ax.set_yticks(range(mean.shape[0]), [str(g) for g in mean.index], fontsize=8)
    fig.colorbar(im, ax=ax, shrink=0.6, label=f"{value_label} (z-score per gene)")
    return fig
