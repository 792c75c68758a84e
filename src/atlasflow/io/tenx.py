"""10x Genomics readers: Cell Ranger ``.h5`` (v2 and v3 layouts) and ``matrix.mtx`` folders (v2 and v3).

Both store genes x cells column-compressed (the h5) or as coordinate entries (the mtx), i.e. cells are
the columns on disk. The h5 CSC is a CSR of cells x genes, so a block of cells is one contiguous slice
of ``data``/``indices``. The mtx is read in line chunks with pandas: entries sorted by cell (as Cell
Ranger writes them) stream straight into blocks; otherwise they are bucketed per block on disk first.
"""

from __future__ import annotations

import csv
import gzip
import logging
import zlib
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np
import pandas as pd
import scipy.sparse as sp

from atlasflow.errors import InputError
from atlasflow.io._blocks import (
    ENTRIES_PER_STEP,
    Reader,
    RestartStream,
    RowBuckets,
    bounds,
    check_csr_parts,
    coo_block,
    h5_open_error,
    make_var,
)

log = logging.getLogger(__name__)

MTX_NAMES = ("matrix.mtx.gz", "matrix.mtx")
FEATURE_NAMES = ("features.tsv.gz", "features.tsv", "genes.tsv.gz", "genes.tsv")
BARCODE_NAMES = ("barcodes.tsv.gz", "barcodes.tsv")
H5_MATRIX = ("barcodes", "data", "indices", "indptr", "shape")


# --------------------------------------------------------------------------------------------------
# 10x h5


def _strings(ds) -> np.ndarray:
    """A dataset of (byte) strings as a NumPy array of str."""
    return np.asarray(ds.asstr()[:], dtype=object).astype(str)


def _require(group, names, path: Path) -> None:
    missing = [f"{group.name.strip('/')}/{n}" for n in names if n not in group]
    if missing:
        raise InputError(f"{path}: 10x h5 file lacks {', '.join(repr(m) for m in missing)}")


def _h5_group(f: h5py.File, path: Path, genome: str | None) -> tuple[str, str]:
    """(group holding the matrix, layout) of a 10x h5: ``matrix`` (v3) or the one genome group (v2)."""
    if "matrix" in f:
        return "matrix", "v3"
    genomes = sorted(k for k in f if isinstance(f[k], h5py.Group))
    if not genomes:
        raise InputError(f"{path}: not a 10x h5 file (no 'matrix' group and no genome group)")
    if genome is not None:
        if genome not in genomes:
            raise InputError(f"{path}: genome {genome!r} not in the file (genomes: {', '.join(genomes)})")
        return genome, "v2"
    if len(genomes) > 1:
        raise InputError(f"{path}: 10x h5 file holds several genomes ({', '.join(genomes)}); choose one with --genome")
    return genomes[0], "v2"


def _h5_var(g, path: Path, layout: str) -> pd.DataFrame:
    if layout == "v3":
        _require(g, ("features",), path)
        feats = g["features"]
        _require(feats, ("id", "name"), path)
        types = _strings(feats["feature_type"]) if "feature_type" in feats else None
        genome = _strings(feats["genome"]) if "genome" in feats else None
        return make_var(_strings(feats["id"]), _strings(feats["name"]), types, genome)
    _require(g, ("genes", "gene_names"), path)
    return make_var(_strings(g["genes"]), _strings(g["gene_names"]))


class TenxH5Reader(Reader):
    """A Cell Ranger ``filtered/raw_feature_bc_matrix.h5`` (v3 ``/matrix``) or v2 ``/<genome>`` file."""

    kind = "10x_h5"

    def __init__(self, path: str | Path, *, genome: str | None = None):
        path = Path(path)
        try:
            f = h5py.File(path, "r")
        except OSError as exc:
            raise h5_open_error(path, exc) from None
        with f:
            self.group, self.layout = _h5_group(f, path, genome)
            g = f[self.group]
            _require(g, H5_MATRIX, path)
            var = _h5_var(g, path, self.layout)
            barcodes = _strings(g["barcodes"])
            self._check_shape(g, path, len(barcodes), len(var))
        obs = pd.DataFrame(index=pd.Index(barcodes, dtype=object))
        super().__init__(path, f"{path.name}:{self.group}", obs, var)
        self.kind = f"10x_h5_{self.layout}"

    @staticmethod
    def _check_shape(g, path: Path, n_cells: int, n_genes: int) -> None:
        shape = tuple(int(s) for s in g["shape"][:])
        if shape != (n_genes, n_cells):
            raise InputError(f"{path}: shape {shape} does not match {n_genes} features x {n_cells} barcodes")
        if g["indptr"].shape[0] != n_cells + 1:
            raise InputError(f"{path}: indptr has {g['indptr'].shape[0]} entries for {n_cells} barcodes")
        if g["data"].shape != g["indices"].shape:
            raise InputError(f"{path}: data and indices differ in length")

    def raw_blocks(self, chunk_rows: int) -> Iterator[sp.csr_matrix]:
        n, m = self.shape
        with h5py.File(self.path, "r") as f:
            g = f[self.group]
            for s, e in bounds(n, chunk_rows):
                ptr = np.asarray(g["indptr"][s : e + 1], dtype=np.int64)
                lo, hi = int(ptr[0]), int(ptr[-1])
                if hi > g["data"].shape[0]:
                    raise InputError(f"{self.label}: indptr points past the end of data (truncated file?)")
                idx = np.asarray(g["indices"][lo:hi])
                check_csr_parts(self.label, ptr - lo, idx, m)
                yield sp.csr_matrix((g["data"][lo:hi], idx, ptr - lo), shape=(e - s, m))


# --------------------------------------------------------------------------------------------------
# 10x matrix.mtx folders


def is_mtx_dir(path: Path) -> bool:
    """A folder holding any piece of a 10x mtx export."""
    return path.is_dir() and any((path / n).exists() for n in MTX_NAMES + FEATURE_NAMES + BARCODE_NAMES)


def _piece(folder: Path, names: tuple[str, ...], what: str) -> Path:
    for name in names:
        if (folder / name).is_file():
            return folder / name
    raise InputError(f"{folder}: 10x mtx folder has no {what} (looked for {', '.join(names)})")


def _is_gzip(path: Path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(2) == b"\x1f\x8b"


def _read_tsv(path: Path) -> pd.DataFrame:
    """A headerless TSV as strings (an empty file gives an empty frame)."""
    try:
        return pd.read_csv(path, sep="\t", header=None, dtype=str, quoting=csv.QUOTE_NONE,
                           keep_default_na=False, compression="gzip" if _is_gzip(path) else None)
    except pd.errors.EmptyDataError:
        return pd.DataFrame({0: pd.Series(dtype=str)})
    except (ValueError, OSError, EOFError, zlib.error) as exc:
        raise InputError(f"{path}: unreadable ({exc})") from exc


def mtx_header(path: Path) -> tuple[int, int, int, str, int]:
    """(rows, cols, entries, field, header lines) of a coordinate Matrix Market file."""
    opener = gzip.open if _is_gzip(path) else open
    try:
        with opener(path, "rt") as fh:
            banner = fh.readline().lower().split()
            if len(banner) != 5 or banner[0] != "%%matrixmarket" or banner[1] != "matrix":
                raise InputError(f"{path}: not a Matrix Market file (no '%%MatrixMarket matrix' banner)")
            if banner[2] != "coordinate":
                raise InputError(f"{path}: Matrix Market format {banner[2]!r} is not supported (need coordinate)")
            if banner[3] not in ("integer", "real", "double", "pattern") or banner[4] != "general":
                raise InputError(f"{path}: Matrix Market '{banner[3]} {banner[4]}' is not supported "
                                 "(need integer/real/pattern general)")
            lines = 1
            for line in fh:
                lines += 1
                if line.strip() and not line.startswith("%"):
                    size = line.split()
                    break
            else:
                raise InputError(f"{path}: Matrix Market file has no size line")
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: unreadable ({exc})") from exc
    try:
        n_rows, n_cols, nnz = (int(v) for v in size)
    except ValueError:
        raise InputError(f"{path}: bad Matrix Market size line {' '.join(size)!r}") from None
    return n_rows, n_cols, nnz, banner[3], lines


class TenxMtxReader(Reader):
    """A 10x ``matrix.mtx`` folder: v2 (``genes.tsv``) or v3 (``features.tsv``), gzipped or not."""

    kind = "10x_mtx"

    def __init__(self, folder: str | Path, *, spill_dir=None, entries_per_step: int = ENTRIES_PER_STEP):
        folder = Path(folder)
        self.matrix = _piece(folder, MTX_NAMES, "matrix.mtx(.gz)")
        features_path = _piece(folder, FEATURE_NAMES, "features.tsv(.gz) or genes.tsv(.gz)")
        barcodes_path = _piece(folder, BARCODE_NAMES, "barcodes.tsv(.gz)")
        n_genes, n_cells, self.nnz, self.field, self.skip = mtx_header(self.matrix)
        feats, barcodes = _read_tsv(features_path), _read_tsv(barcodes_path)
        if feats.shape[0] != n_genes or barcodes.shape[0] != n_cells:
            raise InputError(
                f"{folder}: {self.matrix.name} is {n_genes} genes x {n_cells} cells but {features_path.name} "
                f"lists {feats.shape[0]} and {barcodes_path.name} {barcodes.shape[0]}"
            )
        symbols = feats[1] if feats.shape[1] > 1 else None
        types = feats[2] if feats.shape[1] > 2 else None
        var = make_var(feats[0], symbols, types)
        obs = pd.DataFrame(index=pd.Index(barcodes[0].to_numpy(dtype=object)))
        super().__init__(folder, f"{folder.name}/{self.matrix.name}", obs, var)
        self.kind = "10x_mtx_v3" if features_path.name.startswith("features") else "10x_mtx_v2"
        self.spill_dir = spill_dir
        self.step = int(entries_per_step)
        self.cell_sorted: bool | None = None  # unknown until read; False once seen unsorted

    def entries(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(cell, gene, value) arrays, 0-based, one line chunk at a time, with range checks."""
        names = ["gene", "cell"] if self.field == "pattern" else ["gene", "cell", "value"]
        dtypes = {"gene": np.int64, "cell": np.int64, "value": np.float64}
        n, m = self.shape
        try:
            chunks = pd.read_csv(
                self.matrix, sep=r"\s+", header=None, names=names, skiprows=self.skip, chunksize=self.step,
                dtype={k: dtypes[k] for k in names}, compression="gzip" if _is_gzip(self.matrix) else None,
            )
            for chunk in chunks:
                genes = chunk["gene"].to_numpy() - 1
                cells = chunk["cell"].to_numpy() - 1
                vals = chunk["value"].to_numpy() if "value" in chunk else np.ones(len(chunk))
                if cells.size and (cells.min() < 0 or cells.max() >= n or genes.min() < 0 or genes.max() >= m):
                    raise InputError(f"{self.label}: an entry lies outside the {m} x {n} matrix of the header")
                yield cells, genes, vals
        except (ValueError, pd.errors.ParserError, OSError, EOFError, zlib.error) as exc:
            msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise InputError(f"{self.label}: malformed or truncated Matrix Market entries ({msg})") from exc

    def raw_blocks(self, chunk_rows: int) -> Iterator[sp.csr_matrix]:
        """Blocks of cells: straight from the line chunks while entries come in cell order, else via disk."""
        n, m = self.shape
        spans = bounds(n, chunk_rows)
        emitted, seen, last = 0, 0, -1
        pend = (np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.float64))
        buckets = None
        if self.cell_sorted is False:
            buckets = RowBuckets(n, m, chunk_rows, self.spill_dir)
        try:
            for cells, genes, vals in self.entries():
                seen += cells.size
                if cells.size == 0:
                    continue
                if buckets is None and cells[0] >= last and np.all(cells[1:] >= cells[:-1]):
                    pend = tuple(np.concatenate(p) for p in zip(pend, (cells, genes, vals), strict=True))
                    last = int(cells[-1])
                    while emitted < last // chunk_rows:  # blocks before the one holding `last` are complete
                        block, pend = _take_block(pend, spans[emitted], m)
                        yield block
                        emitted += 1
                    continue
                if buckets is None:
                    log.info("%s: entries are not sorted by cell; bucketing them per block on disk", self.label)
                    self.cell_sorted = False
                    buckets = RowBuckets(n, m, chunk_rows, self.spill_dir, first_block=emitted)
                    buckets.add(*pend)
                if cells.min() < emitted * chunk_rows:  # belongs to a block already handed out
                    raise RestartStream(f"{self.label}: entries are not sorted by cell; reading it again")
                buckets.add(cells, genes, vals)
            if seen != self.nnz:
                raise InputError(f"{self.label}: header announces {self.nnz} entries, the file has {seen}")
            if buckets is None:
                self.cell_sorted = True
                for span in spans[emitted:]:
                    block, pend = _take_block(pend, span, m)
                    yield block
            else:
                yield from buckets.blocks()
        finally:
            if buckets is not None:
                buckets.close()


def _take_block(pend, span: tuple[int, int], n_genes: int):
    """Split the cell-sorted pending entries into the block ``span`` and the rest."""
    s, e = span
    cells, genes, vals = pend
    k = int(np.searchsorted(cells, e, side="left"))
    block = coo_block(cells[:k] - s, genes[:k], vals[:k], (e - s, n_genes))
    return block, (cells[k:], genes[k:], vals[k:])
