"""Dense count tables (``.csv``/``.tsv``/``.txt``, gzipped or not), streamed in row blocks.

Plate-based protocols (CEL-seq2, Smart-seq2) publish counts as one dense table: a header line of column
names, then one line per row with the row's name first (R's ``write.csv``: the header has no corner cell;
other tools write one). Most are genes x cells; some are cells x genes. Which way round is read from the
names (Ensembl ids, ERCC spike-ins or a few ubiquitous gene symbols on one axis) or set with
``orientation`` when the names do not tell.

Memory holds one step of lines, never the table: cells x genes tables give their cell blocks straight from
the lines; genes x cells tables are transposed through ``RowBuckets`` (each step of gene lines is spilled
to the files of its cell blocks, then every block is rebuilt from its file), as an unsorted mtx is. The row
names are read in a first pass over the first column only, since a reader knows its cells and genes up front.
"""

from __future__ import annotations

import csv
import gzip
import logging
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import scipy.sparse as sp

from atlasflow.errors import InputError
from atlasflow.gene_ids import id_fraction
from atlasflow.io._blocks import DENSE_BYTES, ENTRIES_PER_STEP, Reader, RowBuckets, make_var

TABLE_SUFFIXES = (".csv", ".tsv", ".txt")
ORIENTATIONS = ("auto", "genes_x_cells", "cells_x_genes")
log = logging.getLogger(__name__)

#: Gene symbols found in any human or mouse expression table (checked case-insensitively).
UBIQUITOUS = frozenset({"actb", "gapdh", "malat1", "b2m", "eef1a1", "tpt1", "mt-co1", "mt-nd1", "rplp0"})


def is_table(path: Path) -> bool:
    """A file named like a dense table: ``.csv``, ``.tsv`` or ``.txt``, optionally ``.gz``."""
    suffixes = [s.lower() for s in Path(path).suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    return bool(suffixes) and suffixes[-1] in TABLE_SUFFIXES


def _open_text(path: Path):
    return gzip.open(path, "rt", newline="") if _compression(path) else open(path, newline="")


def _separator(path: Path) -> str:
    name = path.name.lower().removesuffix(".gz")
    return "," if name.endswith(".csv") else "\t"


def _gene_score(names) -> float:
    """Fraction of names that are gene ids, plus one if a ubiquitous gene symbol is among them."""
    names = pd.Index(names).astype(str)
    return id_fraction(names) + (1.0 if UBIQUITOUS & set(names.str.lower()) else 0.0)


class DenseTableReader(Reader):
    """A dense count table, genes x cells or cells x genes (``orientation``: auto, genes_x_cells, cells_x_genes)."""

    kind = "table"

    def __init__(self, path: str | Path, *, orientation: str = "auto", spill_dir=None,
                 entries_per_step: int = ENTRIES_PER_STEP):
        path = Path(path)
        if orientation not in ORIENTATIONS:
            raise InputError(f"table orientation must be one of {', '.join(ORIENTATIONS)}, not {orientation!r}")
        self.sep = _separator(path)
        self.step = int(entries_per_step)
        self.spill_dir = spill_dir
        columns, row_names = self._names(path)
        self.n_lines, self.n_columns = len(row_names), len(columns)
        genes_are_rows = self._orientation(path, orientation, row_names, columns)
        self.genes_are_rows = genes_are_rows
        cells, genes = (columns, row_names) if genes_are_rows else (row_names, columns)
        obs = pd.DataFrame(index=pd.Index(np.asarray(cells, dtype=object)))
        super().__init__(path, path.name, obs, make_var(genes))
        self.kind = "table_genes_x_cells" if genes_are_rows else "table_cells_x_genes"

    # -------------------------------------------------------------------------------- names

    def _names(self, path: Path) -> tuple[list[str], pd.Index]:
        """Column names (header, without a corner cell) and row names (first field of every line)."""
        try:
            with _open_text(path) as fh:
                reader = csv.reader(fh, delimiter=self.sep)
                header = next(reader, None)
                first = next(reader, None)
        except (OSError, EOFError, zlib.error, UnicodeDecodeError, csv.Error) as exc:
            raise InputError(f"{path}: unreadable table ({_first_line(exc)})") from exc
        if header is None or first is None:
            raise InputError(f"{path}: a table needs a header line and at least one row")
        if len(header) == len(first) - 1:
            columns = header  # R's write.csv: no corner cell
        elif len(header) == len(first):
            columns = header[1:]
        else:
            raise InputError(f"{path}: the header has {len(header)} names but the first row {len(first)} fields "
                             "(expected one name per value column, with or without a corner cell)")
        if not columns:
            raise InputError(f"{path}: the table has no value columns")
        names = []
        try:
            for chunk in pd.read_csv(path, sep=self.sep, header=None, skiprows=1, usecols=[0], dtype=str,
                                     keep_default_na=False, chunksize=1 << 16, compression=_compression(path)):
                names.append(chunk[0].to_numpy(dtype=object))
        except (ValueError, pd.errors.ParserError, OSError, EOFError, zlib.error) as exc:
            raise InputError(f"{path}: malformed or truncated table ({_first_line(exc)})") from exc
        rows = pd.Index(np.concatenate(names), dtype=object) if names else pd.Index([], dtype=object)
        return [str(c) for c in columns], rows

    def _orientation(self, path: Path, orientation: str, row_names, columns) -> bool:
        """True when rows are genes (genes x cells)."""
        if orientation != "auto":
            return orientation == "genes_x_cells"
        rows, cols = _gene_score(row_names), _gene_score(columns)
        if max(rows, cols) >= 0.5 and rows != cols:
            which = "genes x cells" if rows > cols else "cells x genes"
            log.info("%s: read as %s (gene ids or symbols among the %s names)", path.name, which,
                     "row" if rows > cols else "column")
            return rows > cols
        raise InputError(f"{path}: cannot tell whether its rows are genes or cells from the names; set "
                         "ingest.table_orientation (--table-orientation) to genes_x_cells or cells_x_genes")

    # -------------------------------------------------------------------------------- values

    def lines(self, rows_per_step: int) -> Iterator[tuple[int, np.ndarray]]:
        """(first line, dense float64 values) of ``rows_per_step`` lines at a time, checked for shape."""
        seen = 0
        try:
            for chunk in pd.read_csv(self.path, sep=self.sep, header=None, skiprows=1, chunksize=rows_per_step,
                                     dtype={0: str}, keep_default_na=False, na_values=[""],
                                     compression=_compression(self.path)):
                if chunk.shape[1] != self.n_columns + 1:
                    raise InputError(f"{self.label}: line {seen + 2} onwards has {chunk.shape[1]} fields, "
                                     f"expected {self.n_columns + 1}")
                values = chunk.iloc[:, 1:]
                try:
                    dense = values.to_numpy(dtype=np.float64)
                except (ValueError, TypeError):
                    bad = values.apply(pd.to_numeric, errors="coerce").isna() & values.notna()
                    r, c = np.argwhere(bad.to_numpy())[0]
                    raise InputError(f"{self.label}: non-numeric value {values.iat[r, c]!r} on line "
                                     f"{seen + int(r) + 2}, column {int(c) + 2}") from None
                yield seen, dense
                seen += dense.shape[0]
        except (pd.errors.ParserError, OSError, EOFError, zlib.error) as exc:
            raise InputError(f"{self.label}: malformed or truncated table ({_first_line(exc)})") from exc
        if seen != self.n_lines:
            raise InputError(f"{self.label}: read {seen} lines, the first pass found {self.n_lines}")

    def raw_blocks(self, chunk_rows: int) -> Iterator[sp.csr_matrix]:
        n_cells, n_genes = self.shape
        if not self.genes_are_rows:
            step = max(1, min(chunk_rows, DENSE_BYTES // (8 * n_genes)))
            pending, have = [], 0
            for _, dense in self.lines(step):
                pending.append(sp.csr_matrix(dense))
                have += dense.shape[0]
                while have >= chunk_rows:
                    stacked = sp.vstack(pending, format="csr")
                    yield stacked[:chunk_rows]
                    rest = stacked[chunk_rows:]
                    pending, have = ([rest] if rest.shape[0] else []), rest.shape[0]
            if have:
                yield sp.vstack(pending, format="csr")
            return
        buckets = RowBuckets(n_cells, n_genes, chunk_rows, self.spill_dir)
        try:
            for first, dense in self.lines(max(1, self.step // max(1, n_cells))):
                genes, cells = np.nonzero(dense)
                buckets.add(cells.astype(np.int64), genes.astype(np.int64) + first, dense[genes, cells])
            yield from buckets.blocks()
        finally:
            buckets.close()


def _compression(path: Path) -> str | None:
    with open(path, "rb") as fh:
        return "gzip" if fh.read(2) == b"\x1f\x8b" else None


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
