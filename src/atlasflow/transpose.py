"""Gene-major copy of a cells x genes matrix: written once, block by block, memory bounded by a block.

Exact per-gene statistics such as the Wilcoxon rank-sum test need every value of one gene at once,
which row (cell) blocks do not give. As BPCells does, we write the transposed matrix once and read it
gene block by gene block afterwards. The copy is an ordinary atlasflow store whose X is the
genes x cells CSR matrix (obs = genes, var = cells), row-chunked in blocks of ``gene_block`` genes.

Two passes, both on the workers:

1. one task per row block of X: convert the block to CSC and save its ``data``/``indices``/``indptr``
   as ``.npy`` files in a scratch folder. The piece of (row block i, gene block j) is a contiguous
   slice of row block i's files, so nothing is split or sorted here. The tasks return each gene's
   non-zero count, which fixes the output layout before anything is assembled.
2. one task per gene block: memory-map the slices holding its genes from every row block, place them
   into a genes x cells CSR matrix by counting (no sort: cells arrive in order), and write it to the
   store at offsets known from pass 1 (``store.write_csr_dask``).

Memory per task: one row block (pass 1) or one gene block plus one of its pieces (pass 2).
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path

import anndata as ad
import dask.array as da
import numpy as np
import pandas as pd
import scipy.sparse as sp
import zarr

from atlasflow.backend import issparse, to_host
from atlasflow.errors import InputError
from atlasflow.sources import source_of
from atlasflow.store import META_KEY, open_store, row_bounds, save_npy, write_store

log = logging.getLogger(__name__)

#: Non-zeros per gene block when ``gene_block`` is chosen automatically: ~16 MB stored, and about
#: 100 bytes per non-zero (~200 MB) while the Wilcoxon kernel sorts and ranks the block.
TARGET_BLOCK_NNZ = 2_000_000


def auto_gene_block(total_nnz: int, n_genes: int, target_nnz: int = TARGET_BLOCK_NNZ) -> int:
    """Genes per block so that an average block holds about ``target_nnz`` non-zeros."""
    if n_genes == 0:
        return 1
    per_gene = max(total_nnz / n_genes, 1.0)
    return int(min(n_genes, max(1, target_nnz // per_gene)))


def source_signature(x: da.Array) -> dict | None:
    """Identity of a lazily read matrix (store id, element, shape), to reuse a gene-major copy of it."""
    src = source_of(x)
    if src is None:
        return None
    try:
        meta = dict(zarr.open_group(src[0], mode="r").attrs.get(META_KEY, {}))
    except Exception:  # noqa: BLE001 - an unreadable store simply has no reusable copy
        return None
    if "store_id" not in meta:
        return None
    return {"store_id": meta["store_id"], "element": src[1], "shape": [int(s) for s in x.shape]}


def is_gene_major_of(path: str | os.PathLike, signature: dict | None) -> bool:
    """True when ``path`` is a complete gene-major copy of the matrix with this signature."""
    if signature is None or not Path(path).exists():
        return False
    try:
        meta = dict(zarr.open_group(str(path), mode="r").attrs.get(META_KEY, {}))
    except Exception:  # noqa: BLE001
        return False
    return meta.get("provenance", {}).get("transposed_from") == signature


def write_gene_major(
    x: da.Array,
    path: str | os.PathLike,
    *,
    gene_block: int | None = None,
    obs_names=None,
    var_names=None,
) -> Path:
    """Write the genes x cells CSR copy of ``x`` (cells x genes, Dask, CSR or dense row blocks) to ``path``.

    ``gene_block`` genes per output block (default: about ``TARGET_BLOCK_NNZ`` non-zeros per block).
    Explicit zeros are dropped. The store is written atomically and records where it came from.
    """
    if not isinstance(x, da.Array) or x.ndim != 2:
        raise InputError("transpose: the matrix must be a 2-D Dask array (open the store with open_store)")
    path = Path(path)
    n_cells, n_genes = (int(s) for s in x.shape)
    if x.numblocks[1] != 1:
        x = x.rechunk({1: -1})
    scratch = path.with_name(f".{path.name}.pieces-{uuid.uuid4().hex[:8]}")
    scratch.mkdir(parents=True)
    try:
        gene_nnz = _save_row_blocks(x, scratch)
        if gene_block is None:
            gene_block = auto_gene_block(int(gene_nnz.sum()), n_genes)
        gene_block = max(1, min(int(gene_block), max(n_genes, 1)))
        row_starts = np.concatenate([[0], np.cumsum(x.chunks[0])]).astype(np.int64)
        xt = _assembled(scratch, len(x.chunks[0]), row_starts, n_cells, n_genes, gene_block, x.dtype)
        obs = pd.DataFrame(index=pd.Index(_names(var_names, n_genes), name=None))
        var = pd.DataFrame(index=pd.Index(_names(obs_names, n_cells), name=None))
        sig = source_signature(x)
        write_store(
            ad.AnnData(X=xt, obs=obs, var=var), path, chunk_rows=gene_block, row_nnz={"X": gene_nnz},
            provenance={"stage": "transpose", "transposed_from": sig, "gene_block": gene_block},
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    log.info("transpose: wrote %d genes x %d cells (%d non-zeros) in blocks of %d genes to %s",
             n_genes, n_cells, int(gene_nnz.sum()), gene_block, path)
    return path


def open_gene_major(path: str | os.PathLike) -> da.Array:
    """The gene-major matrix of a copy as a Dask array of gene blocks (genes x cells CSR)."""
    return open_store(path).X


def _names(names, n: int) -> list[str]:
    if names is None:
        return [str(i) for i in range(n)]
    return [str(v) for v in names]


# ------------------------------------------------------------------------------------------ pass 1


def _save_row_blocks(x: da.Array, scratch: Path) -> np.ndarray:
    """Pass 1: every row block saved as CSC ``.npy`` files; returns the non-zeros of each gene."""
    m = x.shape[1]
    parts = x.map_blocks(
        _save_csc, str(scratch),
        chunks=((1,) * x.numblocks[0], (m,)), dtype=np.int64, meta=np.empty((0, 0), np.int64),
    )
    return np.asarray(parts.sum(axis=0).compute(), dtype=np.int64)


def _save_csc(block, scratch: str, block_info=None) -> np.ndarray:
    i = block_info[0]["chunk-location"][0]
    block = to_host(block)
    csc = sp.csc_matrix(block) if issparse(block) else sp.csc_matrix(np.asarray(block))
    csc.eliminate_zeros()
    csc.sort_indices()
    for name, arr in (("data", csc.data), ("indices", csc.indices.astype(np.int32, copy=False)),
                      ("indptr", csc.indptr.astype(np.int64, copy=False))):
        save_npy(Path(scratch, f"{i}.{name}.npy"), arr)
    return np.diff(csc.indptr).astype(np.int64).reshape(1, -1)


# ------------------------------------------------------------------------------------------ pass 2


def _assembled(scratch: Path, n_row_blocks: int, row_starts, n_cells: int, n_genes: int, gene_block: int,
               dtype) -> da.Array:
    """Pass 2 as a lazy Dask array: one task per gene block builds its genes x cells CSR matrix."""
    name = f"gene-major-{uuid.uuid4().hex}"
    bounds = row_bounds(n_genes, gene_block)
    dsk = {
        (name, j, 0): (assemble_gene_block, str(scratch), n_row_blocks, lo, hi, row_starts, n_cells, np.dtype(dtype))
        for j, (lo, hi) in enumerate(bounds)
    }
    chunks = (tuple(hi - lo for lo, hi in bounds), (n_cells,))
    return da.Array(dsk, name, chunks=chunks, meta=sp.csr_matrix((0, 0), dtype=dtype))


def assemble_gene_block(scratch: str, n_row_blocks: int, lo: int, hi: int, row_starts, n_cells: int,
                        dtype) -> sp.csr_matrix:
    """Genes ``lo:hi`` x all cells as CSR, gathered from the row blocks' CSC files (cells stay sorted)."""
    g = hi - lo
    ptrs = [np.load(Path(scratch, f"{i}.indptr.npy"), mmap_mode="r")[lo : hi + 1].astype(np.int64)
            for i in range(n_row_blocks)]
    counts = np.array([np.diff(p) for p in ptrs]).reshape(n_row_blocks, g)
    indptr = np.zeros(g + 1, dtype=np.int64)
    np.cumsum(counts.sum(axis=0), out=indptr[1:])
    data = np.empty(int(indptr[-1]), dtype=dtype)
    indices = np.empty(int(indptr[-1]), dtype=np.int32)
    fill = indptr[:-1].copy()  # next free slot of each gene
    for i, p in enumerate(ptrs):
        a, b = int(p[0]), int(p[-1])
        if b == a:
            continue
        vals = np.load(Path(scratch, f"{i}.data.npy"), mmap_mode="r")[a:b]
        cells = np.load(Path(scratch, f"{i}.indices.npy"), mmap_mode="r")[a:b]
        gene = np.repeat(np.arange(g), counts[i])
        dest = fill[gene] + (np.arange(b - a, dtype=np.int64) - (p[gene] - a))
        data[dest] = vals
        indices[dest] = cells + np.int32(row_starts[i])
        fill += counts[i]
    return sp.csr_matrix((data, indices, indptr), shape=(g, n_cells))
