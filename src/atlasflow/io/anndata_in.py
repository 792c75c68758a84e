"""AnnData inputs (``.h5ad`` and AnnData ``.zarr``): counts in X, in a named layer, or in ``.raw``.

h5py groups and zarr groups answer the same questions (``attrs``, ``group["data"][a:b]``) and anndata's
``read_elem`` reads obs/var from either, so one reader serves both. The matrix element may be CSR
(row blocks are contiguous slices), CSC (entries bucketed per block on disk in one pass) or dense
(row slices, read a few MiB at a time).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import anndata as ad
import h5py
import numpy as np
import pandas as pd
import scipy.sparse as sp
import zarr

from atlasflow.errors import InputError
from atlasflow.io._blocks import (
    ENTRIES_PER_STEP,
    Reader,
    RowBuckets,
    bounds,
    check_csr_parts,
    dense_rows,
    h5_open_error,
    make_var,
)

ID_COLUMNS = ("gene_ids", "gene_id", "feature_id")
SYMBOL_COLUMNS = ("gene_symbols", "feature_name", "gene_name", "gene_names", "symbol")
SUPPORTED = ("csr_matrix", "csc_matrix", "array")


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def encoding(elem) -> str:
    """anndata encoding of a matrix element (old h5sparse files and bare arrays included)."""
    attrs = elem.attrs
    if "encoding-type" in attrs:
        return _text(attrs["encoding-type"])
    if "h5sparse_format" in attrs:
        return f"{_text(attrs['h5sparse_format'])}_matrix"
    return "array" if hasattr(elem, "dtype") else "unknown"


def elem_shape(elem) -> tuple[int, ...]:
    if hasattr(elem, "dtype"):
        return tuple(int(s) for s in elem.shape)
    shape = elem.attrs.get("shape", elem.attrs.get("h5sparse_shape"))
    return tuple(int(s) for s in shape) if shape is not None else ()


def var_from_anndata(df: pd.DataFrame) -> pd.DataFrame:
    """Reader var from an AnnData var table: ids/symbols from the usual columns, else from the index."""
    index = df.index.astype(str)
    ids = next((df[c] for c in ID_COLUMNS if c in df), index)
    symbols = next((df[c] for c in SYMBOL_COLUMNS if c in df), index)
    types = df["feature_types"] if "feature_types" in df else None
    genome = df["genome"] if "genome" in df else None
    return make_var(np.asarray(ids), np.asarray(symbols), types, genome)


class AnnDataReader(Reader):
    """Counts of an ``.h5ad`` file or AnnData ``.zarr`` store, streamed by row blocks."""

    def __init__(self, path: str | Path, *, layer: str | None = None, use_raw: bool = False, spill_dir=None,
                 entries_per_step: int = ENTRIES_PER_STEP):
        path = Path(path)
        if layer and use_raw:
            raise InputError("--layer and --use-raw exclude each other: the counts are in one place")
        self.fmt = "zarr" if path.is_dir() else "h5ad"
        self.kind = self.fmt
        self.spill_dir, self.step = spill_dir, int(entries_per_step)
        with self.open(path) as root:
            for key in ("obs", "var"):
                if key not in root:
                    raise InputError(f"{path}: not an AnnData file (no {key!r})")
            self.key = self._element_key(root, path, layer, use_raw)
            elem = root[self.key]
            self.encoding, shape = encoding(elem), elem_shape(elem)
            if self.encoding not in SUPPORTED:
                raise InputError(f"{path}:{self.key} has encoding {self.encoding!r}; supported: {', '.join(SUPPORTED)}")
            obs = _read_df(root, "obs", path)
            var = _read_df(root, "raw/var" if use_raw else "var", path)
            hint = _hint(root) if self.key == "X" else ""
        if len(shape) != 2 or shape != (obs.shape[0], var.shape[0]):
            raise InputError(f"{path}:{self.key} has shape {shape}, obs/var say ({obs.shape[0]}, {var.shape[0]})")
        super().__init__(path, f"{path.name}:{self.key}", obs, var_from_anndata(var), hint)

    def open(self, path: Path | None = None):
        """The root group (h5py file or zarr group) as a context manager."""
        path = path or self.path
        if self.fmt == "h5ad":
            try:
                return h5py.File(path, "r")
            except OSError as exc:
                raise h5_open_error(path, exc) from None
        try:
            return contextlib.nullcontext(zarr.open_group(str(path), mode="r"))
        except Exception as exc:  # noqa: BLE001 - h5py/zarr raise several types for unreadable files
            raise InputError(f"{path}: not a readable {self.fmt} file ({exc})") from exc

    @staticmethod
    def _element_key(root, path: Path, layer: str | None, use_raw: bool) -> str:
        if use_raw:
            if "raw" not in root or "X" not in root["raw"]:
                raise InputError(f"{path}: --use-raw given but the file has no .raw")
            return "raw/X"
        if layer:
            layers = sorted(root["layers"]) if "layers" in root else []
            if layer not in layers:
                raise InputError(f"{path}: no layer {layer!r} (layers: {', '.join(layers) or 'none'})")
            return f"layers/{layer}"
        if "X" not in root:
            raise InputError(f"{path}: has no X{_hint(root)}")
        return "X"

    def raw_blocks(self, chunk_rows: int) -> Iterator[sp.spmatrix]:
        with self.open() as root:
            elem = root[self.key]
            if self.encoding == "array":
                for s, e in bounds(self.shape[0], chunk_rows):
                    yield dense_rows(elem, s, e)
            elif self.encoding == "csr_matrix":
                yield from self._csr_blocks(elem, chunk_rows)
            else:
                yield from self._csc_blocks(elem, chunk_rows)

    def _csr_blocks(self, elem, chunk_rows: int) -> Iterator[sp.csr_matrix]:
        n, m = self.shape
        indptr, data, indices = elem["indptr"], elem["data"], elem["indices"]
        if indptr.shape[0] != n + 1:
            raise InputError(f"{self.label}: indptr has {indptr.shape[0]} entries for {n} rows")
        for s, e in bounds(n, chunk_rows):
            ptr = np.asarray(indptr[s : e + 1], dtype=np.int64)
            lo, hi = int(ptr[0]), int(ptr[-1])
            idx = np.asarray(indices[lo:hi])
            if idx.shape[0] != hi - lo:
                raise InputError(f"{self.label}: indptr points past the end of indices (truncated file?)")
            check_csr_parts(self.label, ptr - lo, idx, m)
            yield sp.csr_matrix((np.asarray(data[lo:hi]), idx, ptr - lo), shape=(e - s, m))

    def _csc_blocks(self, elem, chunk_rows: int) -> Iterator[sp.csr_matrix]:
        """One pass over the CSC entries into per-block disk buckets, then the blocks in order."""
        n, m = self.shape
        indptr = np.asarray(elem["indptr"][:], dtype=np.int64)
        if indptr.shape[0] != m + 1:
            raise InputError(f"{self.label}: CSC indptr has {indptr.shape[0]} entries for {m} columns")
        buckets = RowBuckets(n, m, chunk_rows, self.spill_dir)
        try:
            for lo in range(0, int(indptr[-1]), self.step):
                hi = min(lo + self.step, int(indptr[-1]))
                cells = np.asarray(elem["indices"][lo:hi], dtype=np.int64)
                genes = np.searchsorted(indptr, np.arange(lo, hi), side="right") - 1
                if cells.size != hi - lo or cells.min() < 0 or cells.max() >= n:
                    raise InputError(f"{self.label}: corrupt CSC matrix (row index out of range or truncated)")
                buckets.add(cells, genes, np.asarray(elem["data"][lo:hi], dtype=np.float64))
            yield from buckets.blocks()
        finally:
            buckets.close()


def _read_df(root, key: str, path: Path) -> pd.DataFrame:
    try:
        df = ad.io.read_elem(root[key])
    except Exception as exc:  # noqa: BLE001
        raise InputError(f"{path}: cannot read {key} ({type(exc).__name__}: {exc})") from exc
    if not isinstance(df, pd.DataFrame):
        raise InputError(f"{path}: {key} is not a data frame")
    return df


def _hint(root) -> str:
    """Where else counts may be, for messages about X (e.g. '; the file also has layers: counts and .raw')."""
    where = []
    if "layers" in root and len(root["layers"]):
        where.append(f"layers: {', '.join(sorted(root['layers']))} (--layer)")
    if "raw" in root:
        where.append(".raw (--use-raw)")
    return f"; the file also has {' and '.join(where)}" if where else ""
