"""Tools on Dask-backed AnnData, mirroring ``scanpy.tl`` (names, parameters, output keys)."""

from atlasflow.pp.score import score_genes, score_genes_cell_cycle
from atlasflow.tl.pca import pca

__all__ = ["pca", "score_genes", "score_genes_cell_cycle"]

# marker genes and pseudobulk (rank_genes_groups, aggregate)
from atlasflow.tl.aggregate import aggregate
from atlasflow.tl.markers import compute_markers, filter_rank_genes_groups, marker_table, rank_genes_groups

__all__ += ["aggregate", "compute_markers", "filter_rank_genes_groups", "marker_table", "rank_genes_groups"]

# graph: kNN graph, Leiden/Louvain clustering, UMAP on the in-memory embedding (obsm['X_pca'])
from atlasflow.tl.cluster import leiden, louvain
from atlasflow.tl.neighbors import neighbors
from atlasflow.tl.umap import umap

__all__ += ["leiden", "louvain", "neighbors", "umap"]
