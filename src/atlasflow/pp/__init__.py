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
