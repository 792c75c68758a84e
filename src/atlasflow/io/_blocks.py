"""What every reader shares: the reader interface, disk buckets for unsorted entries, block cleaning.

A reader knows its cells (obs) and features (var) up front and streams the matrix as CSR row blocks
(cells x all features, any dtype). ``clean_block`` turns each raw block into what the store holds
(selected columns, float32, sorted indices, no explicit zeros) and checks the values on the way.

Counts are stored as float32 (the scanpy convention) while they fit it exactly: float32 holds every
integer up to 2**24 (FLOAT32_EXACT). A block with a larger value raises ``NeedsFloat64`` (before anything
of it is written), and the stage writes X again from the start as float64, so a count is never rounded.
Real counts almost never come near 2**24, so the usual case stays one streaming pass; the rare input
that does costs the pass up to that block once more. (No input format records its largest value, and a
first pass just for the maximum would read every input twice.)
"""

from __future__ import annotations

import logging
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import scipy.sparse as sp

from atlasflow.errors import InputError

log = logging.getLogger(__name__)

#: Matrix entries read per step by readers that scan entries (mtx lines, CSC non-zeros).
ENTRIES_PER_STEP = 1 << 20
#: Bytes of dense values read at once from a dense matrix (a block is read in slices of this size).
DENSE_BYTES = 64 << 20
#: Var columns every reader fills (``feature_types``/``genome`` only when the input knows them).
VAR_COLUMNS = ("gene_ids", "gene_symbols", "feature_types", "genome")


#: Largest integer up to which float32 holds every integer exactly (a 24-bit significand).
FLOAT32_EXACT = 1 << 24


class RestartStream(Exception):  # noqa: N818 - a signal, not an error shown to users
    """Raised by a reader that found, too late, that it must read its input another way; retry the stream."""


class NeedsFloat64(Exception):  # noqa: N818 - a signal, not an error shown to users
    """A value above FLOAT32_EXACT met while X is written as float32: write X again, as float64."""


class Reader:
    """One input matrix: ``obs`` (index = cell names), ``var`` (VAR_COLUMNS), ``raw_blocks(chunk_rows)``."""

    kind = "?"

    def __init__(self, path: Path, label: str, obs: pd.DataFrame, var: pd.DataFrame, hint: str = ""):
        self.path = Path(path)
        self.label = label  # how messages name the matrix, e.g. "data.h5ad:layers/counts"
        self.obs = obs
        self.var = var.reset_index(drop=True)
        self.hint = hint  # appended to value errors (e.g. "this file also has .raw")
        if obs.shape[0] == 0 or var.shape[0] == 0:
            raise InputError(f"{label}: empty matrix ({obs.shape[0]} cells x {var.shape[0]} genes)")

    @property
    def shape(self) -> tuple[int, int]:
        return self.obs.shape[0], self.var.shape[0]

    def raw_blocks(self, chunk_rows: int) -> Iterator[sp.spmatrix]:
        """CSR (or CSR-convertible) blocks of ``chunk_rows`` cells x all features, in cell order."""
        raise NotImplementedError


def h5_open_error(path: Path, exc: OSError) -> InputError:
    """One line for an HDF5 file (10x .h5, .h5ad) that h5py cannot open: truncated, damaged or not HDF5."""
    msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if "truncated" in msg.lower():
        sizes = re.search(r"\beof = (\d+).*stored_eof = (\d+)", msg)
        size = f" ({sizes[1]} of its {sizes[2]} bytes)" if sizes else ""
        return InputError(f"{path}: truncated HDF5 file{size}; an interrupted copy or download? Copy it again")
    return InputError(f"{path}: not a readable HDF5 file (damaged, or not HDF5: {msg})")


def make_var(ids, symbols=None, feature_types=None, genome=None) -> pd.DataFrame:
    """The reader-side var table: strings for ids/symbols (symbols default to ids), optional columns.

    A missing id or symbol (NaN/None, e.g. from an h5ad column) becomes "" (ingest refuses empty names)."""
    ids = _names(ids)
    cols = {"gene_ids": ids, "gene_symbols": ids if symbols is None else _names(symbols)}
    if feature_types is not None:
        cols["feature_types"] = pd.Series(feature_types).astype(str).to_numpy()
    if genome is not None:
        cols["genome"] = pd.Series(genome).astype(str).to_numpy()
    return pd.DataFrame(cols)


def _names(values) -> np.ndarray:
    series = pd.Series(np.asarray(values, dtype=object), dtype=object)
    return series.where(series.notna(), "").astype(str).to_numpy()


def bounds(n_rows: int, chunk_rows: int) -> list[tuple[int, int]]:
    """Half-open row ranges of consecutive blocks of ``chunk_rows`` rows."""
    return [(s, min(s + chunk_rows, n_rows)) for s in range(0, n_rows, chunk_rows)]


def coo_block(rows, cols, vals, shape) -> sp.csr_matrix:
    """CSR from (local row, col, value) entries; duplicate entries are summed (as scipy.io.mmread does)."""
    return sp.coo_matrix((vals, (rows, cols)), shape=shape).tocsr()


def dense_rows(array, start: int, stop: int) -> sp.csr_matrix:
    """Rows [start, stop) of a dense on-disk array as CSR, read in slices of at most DENSE_BYTES."""
    n_cols = int(array.shape[1])
    step = max(1, DENSE_BYTES // max(1, n_cols * np.dtype(array.dtype).itemsize))
    parts = [sp.csr_matrix(np.asarray(array[s : min(s + step, stop)])) for s in range(start, stop, step)]
    return sp.vstack(parts, format="csr") if len(parts) > 1 else parts[0]


def check_csr_parts(label: str, indptr: np.ndarray, indices: np.ndarray, n_cols: int) -> None:
    """Cheap structural checks of one block's CSR arrays (corrupt files fail here, not in scipy)."""
    if indptr.size and (np.any(np.diff(indptr) < 0) or indptr[0] < 0):
        raise InputError(f"{label}: corrupt sparse matrix (indptr is not non-decreasing)")
    if indices.size and (indices.min() < 0 or indices.max() >= n_cols):
        raise InputError(f"{label}: corrupt sparse matrix (a column index is outside 0..{n_cols - 1})")


class RowBuckets:
    """Entries spilled to one temporary file per block of rows, then rebuilt block by block.

    For inputs whose entries do not come in cell order (a gene-sorted mtx, a CSC matrix): one pass
    appends every entry to its block's file, a second reads one file at a time, so memory holds one
    block (plus one step of entries), never the matrix.
    """

    REC = np.dtype([("r", "<i4"), ("c", "<i4"), ("v", "<f8")])

    def __init__(self, n_rows: int, n_cols: int, chunk_rows: int, spill_dir=None, first_block: int = 0):
        self.n_rows, self.n_cols, self.chunk_rows = n_rows, n_cols, chunk_rows
        self.first_block = first_block
        if spill_dir is not None:
            Path(spill_dir).mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix=".atlasflow-spill-", dir=spill_dir))

    def _file(self, block: int) -> Path:
        return self.dir / f"{block}.bin"

    def add(self, rows: np.ndarray, cols: np.ndarray, vals: np.ndarray) -> None:
        """Append entries (global row index) to the files of their blocks."""
        if rows.size == 0:
            return
        blk = rows // self.chunk_rows
        order = np.argsort(blk, kind="stable")
        blk, rows, cols, vals = blk[order], rows[order], cols[order], vals[order]
        starts = np.flatnonzero(np.r_[True, blk[1:] != blk[:-1]])
        for lo, hi in zip(starts, np.r_[starts[1:], blk.size], strict=True):
            b = int(blk[lo])
            rec = np.empty(hi - lo, dtype=self.REC)
            rec["r"], rec["c"], rec["v"] = rows[lo:hi] - b * self.chunk_rows, cols[lo:hi], vals[lo:hi]
            with open(self._file(b), "ab") as fh:
                rec.tofile(fh)

    def blocks(self) -> Iterator[sp.csr_matrix]:
        """Yield the blocks from ``first_block`` on, in order, deleting each file once read."""
        try:
            for b, (s, e) in enumerate(bounds(self.n_rows, self.chunk_rows)):
                if b < self.first_block:
                    continue
                path = self._file(b)
                rec = np.fromfile(path, dtype=self.REC) if path.exists() else np.empty(0, dtype=self.REC)
                path.unlink(missing_ok=True)
                yield coo_block(rec["r"], rec["c"], rec["v"], (e - s, self.n_cols))
        finally:
            self.close()

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class CountCheck:
    """Per-block value checks of one input: finite always; integer and >= 0 unless normalized data is allowed."""

    def __init__(self, reader: Reader, allow_normalized: bool):
        self.reader = reader
        self.allow_normalized = allow_normalized
        self.warned = False

    def __call__(self, block: sp.csr_matrix, row0: int) -> None:
        data = block.data
        if data.size == 0:
            return
        if not np.all(np.isfinite(data)):
            self._fail(block, row0, ~np.isfinite(data), "NaN or infinite", fatal=True)
        if data.dtype.kind == "f":
            bad = data != np.floor(data)
            if bad.any():
                self._fail(block, row0, bad, "non-integer")
        bad = data < 0
        if bad.any():
            self._fail(block, row0, bad, "negative")

    def _fail(self, block, row0: int, bad: np.ndarray, what: str, fatal: bool = False) -> None:
        pos = int(np.flatnonzero(bad)[0])
        row = int(np.searchsorted(block.indptr, pos, side="right") - 1)
        cell = self.reader.obs.index[row0 + row]
        where = f"{what} value {float(block.data[pos])!r} (cell {cell!r})"
        if fatal:
            raise InputError(f"{self.reader.label}: {where}; counts must be finite")
        if not self.allow_normalized:
            raise InputError(
                f"{self.reader.label}: {where} where raw counts are expected{self.reader.hint}; "
                "pass --allow-normalized to ingest it anyway"
            )
        if not self.warned:
            log.warning("%s: %s: not raw counts, ingesting anyway (--allow-normalized)", self.reader.label, where)
            self.warned = True


def clean_block(block, n_cols: int, cols: np.ndarray | None, check: CountCheck, row0: int,
                dtype=np.float32) -> sp.csr_matrix:
    """Canonical CSR (``dtype``) of the selected columns, explicit zeros removed, values checked.

    With ``dtype`` float32, a value beyond FLOAT32_EXACT in magnitude raises ``NeedsFloat64`` naming it.
    """
    block = sp.csr_matrix(block)
    if block.shape[1] != n_cols:
        raise InputError(f"{check.reader.label}: a block has {block.shape[1]} columns, expected {n_cols}")
    if cols is not None:
        block = block[:, cols]
    check(block, row0)
    block.sum_duplicates()
    block.eliminate_zeros()
    if np.dtype(dtype) == np.float32 and block.nnz and block.dtype != np.float32:
        big = np.abs(block.data) > FLOAT32_EXACT
        if big.any():
            raise NeedsFloat64(_too_big(block, big, cols, check, row0))
    return block.astype(dtype, copy=False)


def _too_big(block: sp.csr_matrix, big: np.ndarray, cols, check: CountCheck, row0: int) -> str:
    """Names the largest value beyond float32's exact range and where it is."""
    data = np.abs(block.data)
    pos = int(np.flatnonzero(big)[np.argmax(data[big])])
    row = int(np.searchsorted(block.indptr, pos, side="right") - 1)
    col = int(block.indices[pos])
    gene = check.reader.var["gene_symbols"].iloc[int(cols[col]) if cols is not None else col]
    value = block.data[pos]
    value = int(value) if float(value).is_integer() else float(value)
    return (f"{check.reader.label}: value {value} (cell {check.reader.obs.index[row0 + row]!r}, gene {gene!r}) "
            f"exceeds 2**24 = {FLOAT32_EXACT}, the largest integer float32 holds exactly; storing X as float64")
