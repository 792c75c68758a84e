"""``atlasflow.tl.pca``: the out-of-core PCA of :mod:`atlasflow.pp._pca` (scanpy has both pp.pca and tl.pca)."""

from atlasflow.pp._pca import MAX_GRAM_MIB, N_PCS, pca

__all__ = ["MAX_GRAM_MIB", "N_PCS", "pca"]
