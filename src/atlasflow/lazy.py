"""Elementwise maps of the stored values of a sparse Dask matrix, recorded for the writer.

``normalize_total`` and ``log1p`` change the values of X but never which entries are stored. Built with
``map_values``, such a step stays an ordinary lazy Dask array (one ``map_blocks``), and is also recorded
as *(base array, function, per-row argument)*. When the base was read unchanged from a store,
``store.write_store`` then hard-links the base's ``indices`` and ``indptr`` and rewrites only ``data``,
chunk by chunk, without reading or compressing the column indices (2/3 of a count matrix's bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

import dask.array as da
import numpy as np

from atlasflow.backend import issparse, xp_of
from atlasflow.kernels import row_ids


@dataclass(frozen=True)
class ValueMap:
    """``fn(values, per_value, *args)`` applied to the stored values; ``per_row`` (host, one entry per row of
    the whole matrix, or None) is handed to ``fn`` gathered to one entry per stored value."""

    fn: object
    per_row: np.ndarray | None
    args: tuple


# dask array name -> (the array it maps, its ValueMap)
_MAPS: dict[str, tuple[da.Array, ValueMap]] = {}


def map_values(x: da.Array, fn, *args, per_row: np.ndarray | None = None, dtype=None) -> da.Array:
    """``x`` with ``fn`` applied to every stored value (CSR blocks) or every value (dense blocks), lazily.

    ``fn(values, per_value, *args)`` must be elementwise and keep zeros at zero on sparse input (the
    structure is kept as is); ``per_value`` is ``per_row`` taken at each value's row, or None.
    """
    dtype = np.dtype(dtype or x.dtype)
    if per_row is not None:
        per_row = np.asarray(per_row)
        pieces = da.from_array(per_row, chunks=(x.chunks[0],))[:, None]
        out = x.map_blocks(_apply, fn, args, pieces, dtype=dtype, meta=x._meta)
    else:
        out = x.map_blocks(_apply, fn, args, None, dtype=dtype, meta=x._meta)
    _MAPS[out.name] = (x, ValueMap(fn, per_row, tuple(args)))
    return out


def value_chain(x) -> tuple[da.Array, list[ValueMap]] | None:
    """The array ``x`` was mapped from (through one or more ``map_values``) and the maps in order, or None."""
    steps = []
    while getattr(x, "name", None) in _MAPS:
        x, step = _MAPS[x.name]
        steps.append(step)
    return (x, steps[::-1]) if steps else None


def apply_chain(values: np.ndarray, rows: np.ndarray | None, steps: list[ValueMap], dtype) -> np.ndarray:
    """The stored values after every map of ``steps``; ``rows`` gives each value's row (needed if any map
    has a per-row argument)."""
    for s in steps:
        values = s.fn(values, None if s.per_row is None else s.per_row[rows], *s.args)
    return np.asarray(values, dtype=dtype)


def _apply(block, fn, args, per_row_block):
    xp = xp_of(block)
    per = None if per_row_block is None else xp.asarray(per_row_block).ravel()
    if issparse(block):
        out = block.copy()
        if per is not None:
            per = per[row_ids(out)]
        out.data = fn(out.data, per, *args)
        return out
    return fn(block, None if per is None else per[:, None], *args)
