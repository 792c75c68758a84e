"""Helpers shared by the Dask-backed preprocessing functions: getting X lazily and row-aligned side arrays."""

from __future__ import annotations

import anndata as ad
import dask.array as da
import numpy as np
import scipy.sparse as sp

from atlasflow import kernels
from atlasflow.errors import InputError
from atlasflow.compat import named_layers

#: Row block size used when an in-memory matrix is wrapped as a Dask array.
DEFAULT_CHUNK_ROWS = 10_000


def get_matrix(adata: ad.AnnData, layer: str | None, who: str) -> da.Array:
    """``adata.X`` (or a layer) as a Dask array of row blocks covering all columns.

    In-memory matrices are wrapped (CSR blocks for sparse input) so notebook users get the same code path.
    """
    if layer is not None:
        if layer not in adata.layers:
            raise InputError(f"{who}: layer={layer!r} is not a layer of the data (layers: {list(named_layers(adata))})")
        x = adata.layers[layer]
    else:
        x = adata.X
    if x is None:
        raise InputError(f"{who}: the data has no X")
    if not isinstance(x, da.Array):
        if sp.issparse(x):
            x = sp.csr_matrix(x)
        else:
            x = np.asarray(x)
        x = da.from_array(x, chunks=(DEFAULT_CHUNK_ROWS, x.shape[1]), asarray=False)
    if x.numblocks[1] != 1:
        x = x.rechunk({1: -1})
    return x


def set_matrix(adata: ad.AnnData, layer: str | None, x: da.Array) -> None:
    """Put a new matrix back where it was read from."""
    if layer is None:
        adata.X = x
    else:
        adata.layers[layer] = x


def row_aligned(values: np.ndarray, x: da.Array) -> da.Array:
    """A per-row numpy array as a 2-D Dask array whose row blocks line up with ``x``'s."""
    values = np.asarray(values)
    values = values.reshape(values.shape[0], -1)
    return da.from_array(values, chunks=(x.chunks[0], (values.shape[1],)))


def take_rows(x: da.Array, mask: np.ndarray) -> da.Array:
    """The rows of ``x`` where ``mask`` is true, block by block: output block i is what input block i keeps.

    Dask's own boolean indexing re-balances the result into equal chunks with a shuffle, so each output
    block needs two input blocks in memory and rows travel between workers; here nothing moves, and
    blocks may shrink (or become empty) instead.
    """
    mask = np.asarray(mask, dtype=bool)
    if mask.shape != (x.shape[0],):
        raise ValueError(f"row mask of length {mask.shape} for {x.shape[0]} rows")
    bounds = np.cumsum((0,) + x.chunks[0])
    kept = tuple(int(mask[s:e].sum()) for s, e in zip(bounds[:-1], bounds[1:]))
    masks = da.from_array(mask, chunks=(x.chunks[0],))
    index = "ij"[: x.ndim]
    return da.blockwise(kernels.select_rows, index, x, index, masks, "i", dtype=x.dtype,
                        adjust_chunks={"i": kept}, meta=x._meta)


def take_columns(x: da.Array, col_idx: np.ndarray) -> da.Array:
    """The given columns (indices, in order) of every row block of ``x``; the index is stored once in the graph."""
    col_idx = np.asarray(col_idx)
    return x.map_blocks(kernels.select_columns, shared(col_idx), chunks=(x.chunks[0], (len(col_idx),)),
                        dtype=x.dtype, meta=x._meta)


def read_gene_list(path) -> list[str]:
    """Gene names from a text file: whitespace/newline separated, ``#`` starts a comment line."""
    from pathlib import Path

    p = Path(path)
    if not p.exists():
        raise InputError(f"gene list {p} does not exist")
    genes = []
    for line in p.read_text().splitlines():
        line = line.split("#", 1)[0]
        genes += [g.strip() for g in line.replace(",", " ").split() if g.strip()]
    return genes


def shared(value):
    """A constant (array) for block tasks, stored once in the graph instead of once per task."""
    import dask

    return dask.delayed(value, pure=True)
