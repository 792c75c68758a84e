"""What differs between the anndata versions we support (0.12 and 0.13), in one place."""

from __future__ import annotations


def named_layers(adata) -> dict:
    """``adata.layers`` without X: anndata 0.13 also lists X there, as ``layers[None]``."""
    return {k: v for k, v in adata.layers.items() if k is not None}
