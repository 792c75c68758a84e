"""Preprocessing on Dask-backed AnnData, mirroring ``scanpy.pp`` (names, parameters, output keys).

Elementwise steps stay lazy; reductions compute only their small results.
"""

from atlasflow.pp.filter import filter_cells_genes, qc_filter_masks
from atlasflow.pp.normalize import log1p, normalize_total
from atlasflow.pp.qc import calculate_qc_metrics, gene_set_masks

__all__ = [
    "calculate_qc_metrics",
    "filter_cells_genes",
    "gene_set_masks",
    "log1p",
    "normalize_total",
    "qc_filter_masks",
]

# feature selection, regression, scaling, scoring and PCA (out of core, scanpy's names)
from atlasflow.pp._pca import pca  # noqa: E402
from atlasflow.pp.harmony import harmony_integrate, lisi_medians  # noqa: E402
from atlasflow.pp.hvg import highly_variable_genes, subset_genes  # noqa: E402
from atlasflow.pp.regress import regress_out  # noqa: E402
from atlasflow.pp.scale import scale  # noqa: E402
from atlasflow.pp.scrublet import scrublet  # noqa: E402
from atlasflow.pp.score import score_genes, score_genes_cell_cycle  # noqa: E402

__all__ += [
    "harmony_integrate",
    "highly_variable_genes",
    "lisi_medians",
    "pca",
    "regress_out",
    "scale",
    "scrublet",
    "score_genes",
    "score_genes_cell_cycle",
    "subset_genes",
]
