"""atlasflow: out-of-core single-cell preprocessing and clustering on Dask, with scanpy's semantics."""

from atlasflow import pp
from atlasflow.store import open_store, write_store

__version__ = "0.1.0"
__all__ = ["open_store", "pp", "write_store"]
