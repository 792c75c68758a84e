"""Readers of raw-count inputs that stream CSR row blocks: 10x h5/mtx, h5ad, AnnData zarr, dense CSV/TSV
tables, sample sheets.

``open_input(path)`` recognises the format and returns a reader with ``obs``, ``var`` and
``raw_blocks(chunk_rows)``; ``atlasflow.stages.ingest`` turns readers into a store.
"""

from __future__ import annotations

from pathlib import Path

import h5py

from atlasflow.errors import InputError
from atlasflow.io._blocks import (
    ENTRIES_PER_STEP,
    FLOAT32_EXACT,
    CountCheck,
    NeedsFloat64,
    Reader,
    RestartStream,
    clean_block,
    h5_open_error,
)
from atlasflow.io.anndata_in import AnnDataReader
from atlasflow.io.samplesheet import Sample, read_sample_sheet
from atlasflow.io.table import ORIENTATIONS, DenseTableReader, is_table
from atlasflow.io.tenx import MTX_NAMES, TenxH5Reader, TenxMtxReader, is_mtx_dir

__all__ = [
    "FLOAT32_EXACT", "ORIENTATIONS", "AnnDataReader", "CountCheck", "DenseTableReader", "NeedsFloat64", "Reader",
    "RestartStream", "Sample", "TenxH5Reader", "TenxMtxReader", "clean_block", "detect_format", "h5_open_error", "open_input",
    "read_sample_sheet",
]

FORMATS = ("a 10x .h5, a 10x matrix.mtx folder, an .h5ad file, an AnnData .zarr store or a dense .csv/.tsv "
           "table (.gz or not)")


def detect_format(path: str | Path) -> tuple[str, Path]:
    """(format, path to read) of an input: ``10x_h5``, ``10x_mtx``, ``h5ad``, ``zarr`` or ``table``."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"input {path} not found")
    if path.is_dir():
        if (path / "zarr.json").exists() or (path / ".zgroup").exists():
            return "zarr", path
        if is_mtx_dir(path):
            return "10x_mtx", path
        if path.suffix == ".zarr":
            raise InputError(f"{path}: not a Zarr store (no zarr.json or .zgroup)")
        raise InputError(f"{path}: unknown input format (expected {FORMATS})")
    if path.name in MTX_NAMES:
        return "10x_mtx", path.parent
    if h5py.is_hdf5(path):
        try:
            f = h5py.File(path, "r")
        except OSError as exc:
            raise h5_open_error(path, exc) from None
        with f:
            return ("h5ad" if "obs" in f and "var" in f else "10x_h5"), path
    if is_table(path):
        return "table", path
    if path.suffix in (".h5", ".h5ad", ".hdf5"):
        raise InputError(f"{path}: not an HDF5 file")
    raise InputError(f"{path}: unknown input format (expected {FORMATS})")


def open_input(path: str | Path, *, layer: str | None = None, use_raw: bool = False, genome: str | None = None,
               table_orientation: str = "auto", spill_dir=None, entries_per_step: int = ENTRIES_PER_STEP) -> Reader:
    """A streaming reader for one input (format recognised from the path and the file's content)."""
    fmt, where = detect_format(path)
    if fmt in ("10x_h5", "10x_mtx", "table") and (layer or use_raw):
        raise InputError(f"{path}: --layer/--use-raw apply to .h5ad/.zarr inputs, not to 10x files or tables")
    if fmt == "table":
        return DenseTableReader(where, orientation=table_orientation, spill_dir=spill_dir,
                                entries_per_step=entries_per_step)
    if fmt == "10x_h5":
        return TenxH5Reader(where, genome=genome)
    if fmt == "10x_mtx":
        return TenxMtxReader(where, spill_dir=spill_dir, entries_per_step=entries_per_step)
    return AnnDataReader(where, layer=layer, use_raw=use_raw, spill_dir=spill_dir,
                         entries_per_step=entries_per_step)
