"""ingest stage: raw counts (10x h5/mtx, h5ad, AnnData zarr, dense tables, or a sample sheet of them) into one store.

Reading a file is sequential, so this stage runs without Dask: each input is streamed as CSR row blocks
(``atlasflow.io``), checked and cleaned block by block, and appended to X of the new store with
``write_csr_blocks`` (memory bounded by one block). Rules it applies:

* features: only ``Gene Expression`` when the input knows feature types (``--all-features`` keeps all);
  ``--genome`` keeps the features of one genome;
* var names: ``--var-names`` (gene symbols by default) made unique as scanpy's ``var_names_make_unique``
  does (``CRIP1``, ``CRIP1-1``); ``gene_ids``/``gene_symbols`` (and ``feature_types``/``genome`` when
  known) are kept as columns;
* several samples (a sample sheet, formats may be mixed): the genes of the store are the union of the
  samples' genes by gene id (the first sample's order, then each later sample's new genes); a gene a sample
  lacks is zero in its cells (logged per sample, with counts, and in the summary's ``genes_missing``); cell
  names are always prefixed ``<sample>_`` when there is more than one sample, and any names still
  duplicated are made unique; ``obs["sample"]`` is a categorical and the sheet's metadata columns are
  copied to obs;
* dense tables (``.csv``/``.tsv``/``.txt``, gzipped or not): genes x cells or cells x genes, read from the
  names or set by ``--table-orientation`` (``atlasflow.io.table``);
* gene names: an empty (or missing) gene id, or an empty name in the column that becomes the var index,
  is refused naming the feature row;
* X is float32 while every value fits it exactly (integers up to 2**24); a larger count makes the stage
  write X again from the start as float64 (one log line says which value, cell and gene), so no count is
  ever rounded. One streaming pass when the counts fit float32 (real data), at most one more otherwise.
"""

from __future__ import annotations

import logging
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import scipy.sparse as sp
import zarr

from atlasflow.errors import AtlasflowError, ConfigError, InputError
from atlasflow.io import (
    ENTRIES_PER_STEP,
    ORIENTATIONS,
    CountCheck,
    NeedsFloat64,
    Reader,
    RestartStream,
    Sample,
    clean_block,
    open_input,
    read_sample_sheet,
)
from atlasflow.store import META_KEY, atomic_dir, write_csr_blocks

DESCRIPTION = ("Read raw counts (10x .h5 or mtx folder, .h5ad, AnnData .zarr, dense .csv/.tsv table, or a sample "
               "sheet of them) into a Zarr store.")
TAKES_INPUT = False  # --input or --sample-sheet: checked in run()
NEEDS_CLUSTER = False
DEFAULT_CHUNK_ROWS = 10_000
GENE_EXPRESSION = "Gene Expression"
_SUFFIXES = (".gz", ".h5", ".h5ad", ".hdf5", ".zarr", ".mtx", ".csv", ".tsv", ".txt")
log = logging.getLogger(__name__)


def add_arguments(p):
    p.add_argument("--input", help="one input: 10x .h5, 10x matrix.mtx folder, .h5ad, AnnData .zarr, or a dense "
                   ".csv/.tsv/.txt table (gzipped or not)")
    p.add_argument("--sample-sheet", dest="sample_sheet", default=None,
                   help="TSV with columns sample, path (+ metadata for obs); replaces --input")
    p.add_argument("--sample-name", dest="sample_name", default=None,
                   help="obs['sample'] of a single input; unset: an existing obs['sample'], else the file name")
    p.add_argument("--layer", default=None, help="h5ad/zarr: read counts from this layer instead of X")
    p.add_argument("--use-raw", dest="use_raw", action="store_true", help="h5ad/zarr: read counts from .raw")
    p.add_argument("--var-names", dest="var_names", choices=["gene_symbols", "gene_ids"], default="gene_symbols",
                   help="what becomes the var index (made unique)")
    p.add_argument("--allow-normalized", dest="allow_normalized", action="store_true",
                   help="accept non-integer or negative values with a warning instead of an error")
    p.add_argument("--all-features", dest="all_features", action="store_true",
                   help="keep every feature type, not only 'Gene Expression' (when the input has feature types)")
    p.add_argument("--genome", default=None, help="keep the features of this genome (multi-genome 10x files)")
    p.add_argument("--table-orientation", dest="table_orientation", choices=list(ORIENTATIONS), default="auto",
                   help="dense tables: genes_x_cells or cells_x_genes (auto: from the names, e.g. Ensembl ids)")


@dataclass
class Part:
    """One input of the store: its reader, the columns kept (in store order) and its obs."""

    sample: str
    reader: Reader
    cols: np.ndarray | None = None
    metadata: dict = field(default_factory=dict)
    dest: np.ndarray | None = None  # the store columns of ``cols`` (None: the first ones, in order)


def run(args, client) -> dict:
    if bool(args.input) == bool(args.sample_sheet):
        raise InputError("give exactly one of --input or --sample-sheet")
    if args.sample_sheet:
        samples = read_sample_sheet(args.sample_sheet)
    else:
        samples = [Sample(name=args.sample_name, path=Path(args.input))]
    chunk_rows = DEFAULT_CHUNK_ROWS if args.chunk_rows is None else args.chunk_rows
    return ingest(
        samples, args.output, chunk_rows=chunk_rows, layer=args.layer, use_raw=bool(args.use_raw),
        var_names=args.var_names, allow_normalized=bool(args.allow_normalized),
        all_features=bool(args.all_features), genome=args.genome, table_orientation=args.table_orientation,
    )


def ingest(samples: list[Sample] | str | Path, output, *, chunk_rows: int = DEFAULT_CHUNK_ROWS,
           layer: str | None = None, use_raw: bool = False, var_names: str = "gene_symbols",
           allow_normalized: bool = False, all_features: bool = False, genome: str | None = None,
           table_orientation: str = "auto", entries_per_step: int = ENTRIES_PER_STEP) -> dict:
    """Stream ``samples`` (or one input path) into a new AnnData Zarr store at ``output``; returns the summary.

    Every input is opened and checked (formats, pieces, gene sets) before anything is written.
    """
    if isinstance(samples, str | Path):
        samples = [Sample(name=None, path=Path(samples))]
    if var_names not in ("gene_symbols", "gene_ids"):
        raise ConfigError(f"--var-names must be gene_symbols or gene_ids, not {var_names!r}")
    if int(chunk_rows) < 1:
        raise ConfigError(f"--chunk-rows must be a positive number of cells, not {chunk_rows}")
    chunk_rows = int(chunk_rows)
    parts = [
        Part(s.name, open_input(s.path, layer=layer, use_raw=use_raw, genome=genome,
                                table_orientation=table_orientation, entries_per_step=entries_per_step),
             metadata=s.metadata)
        for s in samples
    ]
    single_unnamed = len(parts) == 1 and parts[0].sample is None
    if single_unnamed:
        parts[0].sample = _default_sample_name(parts[0].reader)
    var, dropped, missing = _align_features(parts, all_features, genome, var_names)
    var, renamed_vars = _name_vars(var, var_names)
    obs, renamed_cells = _build_obs(parts, keep_sample_column=single_unnamed)
    provenance = {
        "stage": "ingest", "var_names": var_names, "all_features": all_features, "genome": genome,
        "allow_normalized": allow_normalized, "table_orientation": table_orientation,
        "inputs": [{"sample": p.sample, "path": str(Path(p.reader.path).resolve()), "format": p.reader.kind,
                    "element": p.reader.label} for p in parts],
    }
    nnz, dtype = _write(output, obs, var, parts, chunk_rows, allow_normalized, provenance)
    return {
        "cells_in": int(sum(p.reader.shape[0] for p in parts)), "genes_in": int(parts[0].reader.shape[1]),
        "cells_out": int(obs.shape[0]), "genes_out": int(var.shape[0]), "nnz": int(nnz), "x_dtype": dtype,
        "samples": {p.sample: int(p.reader.shape[0]) for p in parts},
        "formats": {p.sample: p.reader.kind for p in parts},
        "features_dropped": dropped,
        "genes_missing": missing,
        "renamed": {"var_names": renamed_vars, "obs_names": renamed_cells},
        "chunk_rows": chunk_rows,
    }


def _write(output, obs, var, parts: list[Part], chunk_rows: int, allow_normalized: bool,
           provenance: dict) -> tuple[int, str]:
    """The store, atomically: obs/var by anndata, X streamed, bookkeeping as ``write_store`` keeps it.

    Returns the non-zeros and the dtype of X."""
    with atomic_dir(output) as tmp:
        ad.AnnData(obs=obs, var=var).write_zarr(tmp)
        for p in parts:
            p.reader.spill_dir = tmp / ".spill"  # unsorted entries spill beside the store, removed on failure
        nnz, dtype = _write_x(tmp, parts, (obs.shape[0], var.shape[0]), chunk_rows, allow_normalized)
        shutil.rmtree(tmp / ".spill", ignore_errors=True)
        root = zarr.open_group(str(tmp), mode="r+")
        root.attrs[META_KEY] = {"store_id": uuid.uuid4().hex, "chunk_rows": chunk_rows, "provenance": provenance}
        zarr.consolidate_metadata(str(tmp))
    log.info("ingest: wrote %s: %d cells x %d genes, %d non-zeros (%s)", output, obs.shape[0], var.shape[0], nnz,
             dtype)
    return nnz, dtype


# --------------------------------------------------------------------------------------------------
# features


def _default_sample_name(reader: Reader) -> str:
    name = Path(reader.path).name
    while Path(name).suffix in _SUFFIXES:
        name = Path(name).stem
    return name or "sample"


def _feature_mask(reader: Reader, all_features: bool, genome: str | None) -> tuple[np.ndarray, dict]:
    """Features of one input to keep, and how many of each type were dropped."""
    var = reader.var
    keep = np.ones(len(var), dtype=bool)
    if genome is not None and "genome" in var:
        keep &= (var["genome"] == genome).to_numpy()
        if not keep.any():
            raise InputError(f"{reader.label}: no feature of genome {genome!r} "
                             f"(genomes: {', '.join(sorted(var['genome'].unique()))})")
    if not all_features and "feature_types" in var:
        keep &= (var["feature_types"] == GENE_EXPRESSION).to_numpy()
        if not keep.any():
            types = ", ".join(sorted(var["feature_types"].unique()))
            raise InputError(f"{reader.label}: no '{GENE_EXPRESSION}' features (types: {types}); "
                             "pass --all-features to keep them")
    dropped = var.loc[~keep, "feature_types"].value_counts().to_dict() if "feature_types" in var else {}
    if not keep.all():
        log.info("%s: keeping %d of %d features (dropped: %s)", reader.label, keep.sum(), len(keep),
                 dropped or f"{(~keep).sum()} of other genomes")
    return keep, {str(k): int(v) for k, v in dropped.items()}


def _check_names(reader: Reader, idx: np.ndarray, var_names: str) -> None:
    """Refuse a kept feature without a gene id or without the name that becomes its var name."""
    for col in dict.fromkeys(("gene_ids", var_names)):
        values = reader.var[col].iloc[idx].astype(str).str.strip()
        empty = np.flatnonzero((values == "").to_numpy())
        if empty.size:
            row = int(idx[empty[0]])
            other = "gene_symbols" if col == "gene_ids" else "gene_ids"
            more = f" ({empty.size} such rows in all)" if empty.size > 1 else ""
            hint = " or --var-names gene_ids" if col == "gene_symbols" else ""
            raise InputError(
                f"{reader.label}: feature row {row + 1} (of {reader.shape[1]}, counting from 1; "
                f"{other} {reader.var[other].iloc[row]!r}) has an empty {col}{more}; "
                f"give every gene a name in the input{hint}"
            )


def _align_features(parts: list[Part], all_features: bool, genome: str | None,
                    var_names: str = "gene_symbols") -> tuple[pd.DataFrame, dict, dict]:
    """Var of the store, the union of the samples' kept genes by gene id (the first sample's order, then each
    later sample's new genes in its own order); every part's ``cols`` and ``dest``. Also returns the features
    dropped by type and, per sample, how many of the store's genes it lacks (zeros in its cells)."""
    ref_var, dropped = None, {}
    for part in parts:
        keep, part_dropped = _feature_mask(part.reader, all_features, genome)
        idx = np.flatnonzero(keep)
        _check_names(part.reader, idx, var_names)
        var = part.reader.var.iloc[idx].reset_index(drop=True)
        if ref_var is None:
            ref_var, dropped = var, part_dropped
        else:
            order, ref_var, part.dest = _place(ref_var, var, part, parts[0])
            idx = idx[order]
        part.cols = None if idx.size == part.reader.shape[1] and np.array_equal(idx, np.arange(idx.size)) else idx
    missing = {}
    for part in parts:
        kept = part.reader.shape[1] if part.cols is None else part.cols.size
        missing[part.sample] = int(len(ref_var) - kept)
    if any(missing.values()):
        ref_var = ref_var.fillna("")
        log.info("genes: the union of the %d samples' genes, %d; missing genes are zeros (%s)", len(parts),
                 len(ref_var), ", ".join(f"sample {s} lacks {n}" for s, n in missing.items()))
    return ref_var, dropped, missing


def _place(ref: pd.DataFrame, var: pd.DataFrame, part: Part, first: Part):
    """How a later sample's kept genes go into the store: (order of its kept genes, the store's var grown by
    its new genes, their store columns or None when they are the store's columns in order)."""
    ids, ref_ids = pd.Index(var["gene_ids"]), pd.Index(ref["gene_ids"])
    if ids.equals(ref_ids):
        return np.arange(len(ids)), ref, None
    if not (ids.is_unique and ref_ids.is_unique):
        dup = ids[ids.duplicated()] if not ids.is_unique else ref_ids[ref_ids.duplicated()]
        raise InputError(
            f"sample {part.sample} ({part.reader.path}): its genes differ from those of sample {first.sample} "
            f"and gene ids repeat ({dup[0]!r}), so they cannot be matched by id; give every gene a unique id"
        )
    if len(ids) == len(ref_ids) and not len(ref_ids.difference(ids)):
        log.info("sample %s: same genes as sample %s in another order; aligning", part.sample, first.sample)
        return ids.get_indexer(ref_ids), ref, None
    new = ~ids.isin(ref_ids)
    grown = pd.concat([ref, var[new]], ignore_index=True)
    log.info("sample %s: %d of its %d genes are new to the store (zeros in the samples before it), %d of the "
             "store's %d genes it lacks%s", part.sample, int(new.sum()), len(ids),
             int((~ref_ids.isin(ids)).sum()), len(ref_ids), _eg(ref_ids[~ref_ids.isin(ids)]))
    return np.arange(len(ids)), grown, pd.Index(grown["gene_ids"]).get_indexer(ids)


def _eg(index: pd.Index) -> str:
    return f", e.g. {', '.join(map(str, index[:3]))}" if len(index) else ""


def _name_vars(var: pd.DataFrame, var_names: str) -> tuple[pd.DataFrame, int]:
    """Var index = the chosen column made unique (scanpy's rule); returns how many names changed."""
    names = pd.Index(var[var_names].astype(str).to_numpy(), dtype=object)
    unique, renamed = _make_unique(names)
    if renamed:
        changed = [f"{a} -> {b}" for a, b in zip(names, unique, strict=True) if a != b]
        log.info("var names: %d duplicated %s renamed (e.g. %s)", renamed, var_names, ", ".join(changed[:3]))
    var = var.copy()
    var.index = unique
    return var, renamed


def _make_unique(names: pd.Index) -> tuple[pd.Index, int]:
    if names.is_unique:
        return names, 0
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        unique = ad.utils.make_index_unique(names)
    return pd.Index(unique.to_numpy(dtype=object), dtype=object), int((unique != names).sum())


# --------------------------------------------------------------------------------------------------
# cells


def _build_obs(parts: list[Part], keep_sample_column: bool) -> tuple[pd.DataFrame, int]:
    """obs of all parts: their own columns, ``sample`` and metadata; names prefixed/made unique."""
    frames = []
    for part in parts:
        obs = part.reader.obs.copy()
        obs.index = obs.index.astype(str)
        if len(parts) > 1:
            obs.index = f"{part.sample}_" + obs.index
        if not (keep_sample_column and "sample" in obs):
            obs["sample"] = part.sample
        for key, value in part.metadata.items():
            obs[key] = value
        frames.append(obs)
    obs = pd.concat(frames, axis=0) if len(frames) > 1 else frames[0]
    if len(parts) > 1:
        log.info("cell names prefixed with '<sample>_' (%d samples)", len(parts))
    index, renamed = _make_unique(pd.Index(obs.index.to_numpy(dtype=object), dtype=object))
    if renamed:
        log.warning("%d duplicated cell names made unique (suffixes -1, -2, ...)", renamed)
    obs.index = index
    order = [p.sample for p in parts]
    if not isinstance(obs["sample"].dtype, pd.CategoricalDtype):
        cats = order if set(obs["sample"].astype(str)) <= set(order) else None
        obs["sample"] = pd.Categorical(obs["sample"].astype(str), categories=cats)
    return _tidy_obs(obs), renamed


def _tidy_obs(obs: pd.DataFrame) -> pd.DataFrame:
    """Object columns (strings, possibly with gaps from concatenation) as categoricals anndata can write."""
    for col in obs.columns:
        if obs[col].dtype == object:
            values = obs[col]
            obs[col] = pd.Categorical(values.where(values.isna(), values.astype(str)))
    return obs


# --------------------------------------------------------------------------------------------------
# matrix


def _blocks(parts: list[Part], chunk_rows: int, allow_normalized: bool, n_genes: int, dtype=np.float32):
    """Clean, checked CSR blocks (``dtype``, ``n_genes`` store columns) of every part in turn."""
    for part in parts:
        reader, check, row0 = part.reader, CountCheck(part.reader, allow_normalized), 0
        for raw in _reading(reader, reader.raw_blocks(chunk_rows)):
            block = _store_columns(clean_block(raw, reader.shape[1], part.cols, check, row0, dtype), part.dest,
                                   n_genes)
            row0 += block.shape[0]
            yield block
        if row0 != reader.shape[0]:
            raise InputError(f"{reader.label}: read {row0} cells, expected {reader.shape[0]}")
        log.info("ingest: read %s (%s, sample %s): %d cells", reader.label, reader.kind, part.sample, row0)


def _store_columns(block: sp.csr_matrix, dest: np.ndarray | None, n_genes: int) -> sp.csr_matrix:
    """A sample's block with its genes at their store columns (the store's other genes are zeros)."""
    if dest is None and block.shape[1] == n_genes:
        return block
    indices = block.indices if dest is None else dest[block.indices].astype(block.indices.dtype)
    out = sp.csr_matrix((block.data, indices, block.indptr), shape=(block.shape[0], n_genes))
    if dest is not None:
        out.has_sorted_indices = False
        out.sort_indices()
    return out


def _reading(reader: Reader, blocks):
    """The reader's blocks; a library error while reading the file (h5py/zarr: no errno) as one line."""
    it = iter(blocks)
    try:
        while True:
            try:
                raw = next(it)
            except StopIteration:
                return
            except OSError as exc:
                if exc.errno is not None:  # the system's own errors (disk full while spilling ...) stay as they are
                    raise
                msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise InputError(f"{reader.label}: unreadable, the file is damaged or truncated ({msg})") from None
            yield raw
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()  # the reader's files and spill folders, now, not when garbage collected


def _write_x(tmp: Path, parts: list[Part], shape, chunk_rows: int, allow_normalized: bool) -> tuple[int, str]:
    """Stream X into the store, as float32 unless a value needs float64; returns (non-zeros, dtype).

    The stream starts again from the first block when a reader had to switch how it reads (once), or
    when a value beyond float32's exact integers appeared (once: X is then float64).
    """
    dtype, restarted = np.dtype(np.float32), False
    while True:
        try:
            nnz = write_csr_blocks(tmp, "X", _blocks(parts, chunk_rows, allow_normalized, shape[1], dtype), shape)
            return nnz, dtype.name
        except RestartStream as exc:
            if restarted:
                raise AtlasflowError(f"could not stream X: {exc}") from exc
            restarted = True
            log.info("%s", exc)
        except NeedsFloat64 as exc:
            log.warning("%s", exc)
            dtype = np.dtype(np.float64)
        shutil.rmtree(tmp / "X", ignore_errors=True)
