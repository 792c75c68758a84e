# Helpers for report.smk (settings, figure list, inputs); included first so report.smk holds rules only.

from pathlib import Path as _Path

REPORT_DEFAULTS = {
    "plots": {
        "cluster_key": "leiden",  # obs column of the clusters
        "sample_key": "sample",  # obs column of the samples
        "color_by": None,  # obs columns of the PCA/UMAP panels; null: cluster, sample, QC metrics
        "n_top_genes": 20,  # genes in highest_expr_genes
        "n_marker_genes": 5,  # top genes per cluster in the marker dot plot and heatmap
        "dpi": 100,
        "max_points": 200000,  # above: embeddings are binned into an image (bounded memory)
    },
    "final": {
        "h5ad": False,  # also write results/{dataset}/final.h5ad
        "h5ad_max_gb": 2.0,  # ... unless it would exceed this size (logged); null: no limit
    },
}
#: Filter parameters drawn as thresholds on the QC figure.
QC_THRESHOLD_KEYS = ("min_genes", "max_genes", "min_counts", "max_counts", "max_pct_mt")
#: Figure -> (caption file, report category, stages (rules) it needs).
FIGURES = {
    "qc_violin": ("qc_violin.rst", "1. Quality control", ["qc"]),
    "highest_expr_genes": ("highest_expr_genes.rst", "1. Quality control", ["qc"]),
    "hvg": ("hvg.rst", "2. Features and PCA", ["hvg"]),
    "pca_variance_ratio": ("pca_variance_ratio.rst", "2. Features and PCA", ["pca"]),
    "pca": ("pca.rst", "2. Features and PCA", ["pca"]),
    "umap": ("umap.rst", "3. Clusters", ["umap"]),
    "umap_batch": ("umap_batch.rst", "3. Clusters", ["umap"]),
    "cluster_sizes": ("cluster_sizes.rst", "3. Clusters", ["umap"]),
    "marker_dotplot": ("marker_dotplot.rst", "4. Markers", ["rank_genes_groups"]),
    "marker_heatmap": ("marker_heatmap.rst", "4. Markers", ["rank_genes_groups"]),
}
#: CSV tables of other rules shown in the report: rule -> (table name prefix, caption, category).
TABLES = {
    "rank_genes_groups": ("markers", "markers_table.rst", "4. Markers"),
    "aggregate": ("pseudobulk", "pseudobulk_table.rst", "5. Pseudobulk"),
    "leiden": ("integration", "integration_table.rst", "3. Clusters"),
}


def has_rule(name):
    """Whether a rule of this name has been defined (by an earlier rule file)."""
    try:
        workflow.get_rule(name)
        return True
    except Exception:  # noqa: BLE001 - Snakemake raises UnknownRuleException
        return False


def report_setting(section, key):
    own = config.get(section) or {}
    return own[key] if key in own else REPORT_DEFAULTS[section][key]


#: The embedding store: umap when there is a umap rule, else pca (obsm X_pca, uns pca, varm PCs).
EMBEDDING_STAGE = "umap" if has_rule("umap") else "pca"
FIGURES_MADE = [name for name, (_, _, needs) in FIGURES.items() if all(has_rule(s) for s in needs)]


def plot_file(name):
    return f"results/{{dataset}}/plots/{name}.png"


def cluster_inputs():
    """The clusters store (leiden labels), read beside the embedding: umap reads the graph, not the labels."""
    return {"clusters_store": store("leiden")} if has_rule("leiden") else {}


def plot_inputs(wildcards):
    """The stores the figures read, named as the plots stage's arguments."""
    inputs = {"qc_store": store("qc"), "hvg_store": store("hvg"), "embedding_store": store(EMBEDDING_STAGE),
              **cluster_inputs()}
    if has_rule("rank_genes_groups"):
        inputs["markers_store"] = store("rank_genes_groups")
    if uncorrected_umap_wanted(wildcards.dataset):
        inputs["uncorrected_store"] = store("umap_uncorrected")
    return {k: v.format(dataset=wildcards.dataset) for k, v in inputs.items()}


def uncorrected_umap_wanted(dataset):
    """Whether umap_batch draws the UMAP before batch correction (harmony on, with plot_uncorrected)."""
    return (has_rule("umap_uncorrected") and harmony_enabled(dataset)
            and bool(dataset_config(dataset, "harmony")["plot_uncorrected"]))


def batch_keys(wildcards):
    """The batches umap_batch is coloured by: harmony's keys when it is on, else the sample key."""
    if harmony_enabled(wildcards.dataset):
        key = dataset_config(wildcards.dataset, "harmony")["key"]
        return [key] if isinstance(key, str) else list(key)
    return [report_setting("plots", "sample_key")]


def qc_thresholds(wildcards):
    cfg = dataset_config(wildcards.dataset, "filter")
    return {k: cfg.get(k) for k in QC_THRESHOLD_KEYS if cfg.get(k) is not None}


def final_inputs(wildcards):
    """Stores the final stage assembles, named as its arguments."""
    inputs = {"input": store("log1p"), "counts": store("filter"), "hvg_store": store("hvg"),
              "embedding_store": store(EMBEDDING_STAGE), **cluster_inputs()}
    if has_rule("rank_genes_groups"):
        inputs["markers_store"] = store("rank_genes_groups")
    return {k: v.format(dataset=wildcards.dataset) for k, v in inputs.items()}


def final_h5ad(wildcards):
    """Path of the optional .h5ad export (None: off)."""
    return f"results/{wildcards.dataset}/final.h5ad" if report_setting("final", "h5ad") else None
