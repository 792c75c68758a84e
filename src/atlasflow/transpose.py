"""Gene-major view of a cells x genes matrix: transposed once, block by block, memory bounded by a block.

Exact per-gene statistics such as the Wilcoxon rank-sum test need every value of one gene at once,
which row (cell) blocks do not give. As BPCells does, we transpose the matrix once and read it gene block
by gene block afterwards. Two passes, both on the workers:

1. one task per row block of X: convert the block to CSC and save it, compressed, into a scratch folder,
   cut into one piece per gene block (values: zstd; cells as per-gene steps and values per gene:
   byte-shuffled zstd).
   The tasks return each gene's non-zero count, which fixes the output layout.
2. one task per gene block: read and decompress that block's piece from every row block and place the
   values into a genes x cells CSR matrix by counting (no sort: cells arrive in order).

Pass 2 is a lazy Dask array of gene blocks (``gene_blocks``): the Wilcoxon test ranks each block as it is
assembled, so the only scratch is pass 1's compressed pieces (about 1.5x the compressed store on the
benchmark's log-normalised counts). ``write_gene_major`` instead writes the blocks as an ordinary
atlasflow store (obs = genes, var = cells), kept to be reused by later marker runs on the same matrix.

Memory per task: one row block (pass 1) or one gene block plus one of its pieces (pass 2).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import uuid
from pathlib import Path

import anndata as ad
import dask.array as da
import numpy as np
import pandas as pd
import scipy.sparse as sp
import zarr

from atlasflow import kernels, progress
from atlasflow.backend import issparse, to_host
from atlasflow.errors import InputError
from atlasflow.sources import source_of
from atlasflow.store import META_KEY, open_store, row_bounds, save_npy, write_store

log = logging.getLogger(__name__)

#: Non-zeros per gene block when ``gene_block`` is chosen automatically: ~16 MB in memory, and about
#: 100 bytes per non-zero (~200 MB) while the Wilcoxon kernel sorts and ranks the block.
TARGET_BLOCK_NNZ = 2_000_000


def auto_gene_block(total_nnz: int, n_genes: int, target_nnz: int = TARGET_BLOCK_NNZ) -> int:
    """Genes per block so that an average block holds about ``target_nnz`` non-zeros."""
    if n_genes == 0:
        return 1
    per_gene = max(total_nnz / n_genes, 1.0)
    return int(min(n_genes, max(1, target_nnz // per_gene)))


def stored_nnz(x: da.Array) -> int:
    """Non-zeros of ``x`` without reading its values: the stored CSR's length when ``x`` was read unchanged
    from a store, the cells x genes of a stored dense matrix, else estimated from the first row block."""
    src = source_of(x)
    if src is not None:
        try:
            node = zarr.open_group(src[0], mode="r")[src[1]]
            return int(node["data"].shape[0]) if isinstance(node, zarr.Group) else int(np.prod(node.shape))
        except (KeyError, OSError, ValueError):
            pass
    first = x.blocks[0].compute()
    nnz = first.nnz if issparse(first) else int(np.count_nonzero(to_host(first)))
    return int(nnz * x.shape[0] / max(first.shape[0], 1))


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


@contextlib.contextmanager
def gene_blocks(x: da.Array, work_dir: str | os.PathLike, *, gene_block: int | None = None):
    """Yield the genes x cells CSR matrix of ``x`` (cells x genes, Dask, CSR or dense row blocks) as a lazy
    Dask array of gene blocks, assembled on demand from compressed pieces in a scratch folder under
    ``work_dir`` (removed afterwards).

    ``gene_block`` genes per block (default: about ``TARGET_BLOCK_NNZ`` non-zeros per block). Explicit zeros
    are dropped. The blocks can be computed as often as needed while the context is open.
    """
    with _transposed(x, work_dir, gene_block) as (xt, _):
        yield xt


@contextlib.contextmanager
def _transposed(x: da.Array, work_dir, gene_block: int | None):
    """``gene_blocks``, also yielding each gene's non-zero count (known after pass 1)."""
    if not isinstance(x, da.Array) or x.ndim != 2:
        raise InputError("transpose: the matrix must be a 2-D Dask array (open the store with open_store)")
    n_cells, n_genes = (int(s) for s in x.shape)
    if x.numblocks[1] != 1:
        x = x.rechunk({1: -1})
    if gene_block is None:
        gene_block = auto_gene_block(stored_nnz(x), n_genes)
    gene_block = max(1, min(int(gene_block), max(n_genes, 1)))
    Path(work_dir).mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".atlasflow-genes-", dir=work_dir))
    try:
        gene_nnz, bounds = _save_row_blocks(x, scratch, gene_block)
        row_starts = np.concatenate([[0], np.cumsum(x.chunks[0])]).astype(np.int64)
        xt = _assembled(scratch, row_starts, gene_nnz, bounds, gene_block, x.dtype)
        yield xt, gene_nnz
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def write_gene_major(
    x: da.Array,
    path: str | os.PathLike,
    *,
    gene_block: int | None = None,
    obs_names=None,
    var_names=None,
) -> Path:
    """Write the genes x cells CSR copy of ``x`` (see ``gene_blocks``) to the store ``path``, to be reused.

    The store is written atomically and records where it came from (``source_signature``).
    """
    path = Path(path)
    with _transposed(x, path.parent, gene_block) as (xt, gene_nnz):
        n_genes, n_cells = xt.shape
        obs = pd.DataFrame(index=pd.Index(_names(var_names, n_genes), name=None))
        var = pd.DataFrame(index=pd.Index(_names(obs_names, n_cells), name=None))
        write_store(
            ad.AnnData(X=xt, obs=obs, var=var), path, chunk_rows=xt.chunks[0][0], row_nnz={"X": gene_nnz},
            provenance={"stage": "transpose", "transposed_from": source_signature(x),
                        "gene_block": xt.chunks[0][0]},
        )
        log.info("transpose: wrote %d genes x %d cells (%d non-zeros) in blocks of %d genes to %s",
                 n_genes, n_cells, int(gene_nnz.sum()), xt.chunks[0][0], path)
    return path


def open_gene_major(path: str | os.PathLike) -> da.Array:
    """The gene-major matrix of a copy as a Dask array of gene blocks (genes x cells CSR)."""
    return open_store(path).X


def _names(names, n: int) -> list[str]:
    if names is None:
        return [str(i) for i in range(n)]
    return [str(v) for v in names]


# ------------------------------------------------------------------------------------------ codecs


def _codecs():
    """(values, cell steps, counts) codecs of the scratch pieces. Values: zstd level 3, which finds the
    repeated float values of log-normalised counts (0.59 of their size on the 100k benchmark's pieces, level 1
    0.82); cell steps (small: per-gene deltas) and values per gene: byte-shuffled zstd level 1 (0.26)."""
    import numcodecs

    shuffled = numcodecs.Blosc("zstd", 1, numcodecs.Blosc.SHUFFLE)
    return numcodecs.Zstd(level=3), shuffled, shuffled


def _step_dtype(n_rows: int):
    return np.uint16 if n_rows <= np.iinfo(np.uint16).max else np.uint32


# ------------------------------------------------------------------------------------------ pass 1


def _save_row_blocks(x: da.Array, scratch: Path, gene_block: int) -> tuple[np.ndarray, np.ndarray]:
    """Pass 1: every row block saved as compressed pieces, one per gene block (``_save_pieces``). Returns
    the non-zeros of each gene and the (row blocks, 3 x gene blocks + 1) byte offsets of every buffer."""
    m = x.shape[1]
    parts = x.map_blocks(
        _save_pieces, str(scratch), gene_block,
        chunks=((1,) * x.numblocks[0], (m,)), dtype=np.int64, meta=np.empty((0, 0), np.int64),
    )
    (nnz,) = progress.compute(parts.sum(axis=0), label="transposing X (pass 1 of 2)")
    bounds = np.stack([np.load(Path(scratch, f"{i}.bounds.npy")) for i in range(x.numblocks[0])])
    return np.asarray(nnz, dtype=np.int64), bounds


def _save_pieces(block, scratch: str, gene_block: int, block_info=None) -> np.ndarray:
    """Row block ``i`` as ``i.pieces``: per gene block its values, cell steps and values per gene (CSC order,
    each compressed) one after the other, and ``i.bounds.npy``, the byte offsets of those buffers."""
    i = block_info[0]["chunk-location"][0]
    block = to_host(block)
    csc = sp.csc_matrix(block) if issparse(block) else sp.csc_matrix(np.asarray(block))
    csc.eliminate_zeros()
    csc.sort_indices()
    indptr = csc.indptr.astype(np.int64, copy=False)
    counts = np.diff(indptr)
    cells = csc.indices.astype(np.int64, copy=False)
    steps = cells.copy()  # a gene's first cell as it is, then the step from the previous one
    steps[1:] -= cells[:-1]
    starts = indptr[:-1][counts > 0]
    steps[starts] = cells[starts]
    steps = steps.astype(_step_dtype(block.shape[0]))
    counts32 = counts.astype(np.uint32)
    values_codec, steps_codec, counts_codec = _codecs()
    bufs = []
    for lo, hi in row_bounds(csc.shape[1], gene_block):
        a, b = indptr[lo], indptr[hi]
        bufs += [values_codec.encode(np.ascontiguousarray(csc.data[a:b])), steps_codec.encode(steps[a:b]),
                 counts_codec.encode(counts32[lo:hi])]
    tmp = Path(scratch, f".{i}.pieces.{uuid.uuid4().hex[:6]}")
    with open(tmp, "wb") as fh:
        for buf in bufs:
            fh.write(buf)
    os.replace(tmp, Path(scratch, f"{i}.pieces"))
    save_npy(Path(scratch, f"{i}.bounds.npy"), np.concatenate([[0], np.cumsum([len(b) for b in bufs])]))
    return counts.reshape(1, -1)


# ------------------------------------------------------------------------------------------ pass 2


def _assembled(scratch: Path, row_starts, gene_nnz: np.ndarray, bounds: np.ndarray, gene_block: int,
               dtype) -> da.Array:
    """Pass 2 as a lazy Dask array: one task per gene block builds its genes x cells CSR matrix."""
    name = f"gene-major-{uuid.uuid4().hex}"
    n_genes, n_cells = gene_nnz.shape[0], int(row_starts[-1])
    blocks = row_bounds(n_genes, gene_block)
    dsk = {
        (name, j, 0): (assemble_gene_block, str(scratch), np.ascontiguousarray(bounds[:, 3 * j : 3 * j + 4]),
                       gene_nnz[lo:hi].copy(), row_starts, np.dtype(dtype))
        for j, (lo, hi) in enumerate(blocks)
    }
    chunks = (tuple(hi - lo for lo, hi in blocks), (n_cells,))
    return da.Array(dsk, name, chunks=chunks, meta=sp.csr_matrix((0, 0), dtype=dtype))


def assemble_gene_block(scratch: str, bounds: np.ndarray, gene_nnz: np.ndarray, row_starts,
                        dtype) -> sp.csr_matrix:
    """One gene block x all cells as CSR, from its piece in every row block (``bounds``: each row block's
    byte offsets of the piece's three buffers and its end); cells arrive in order, so nothing is sorted."""
    g = gene_nnz.shape[0]
    indptr = np.zeros(g + 1, dtype=np.int64)
    np.cumsum(gene_nnz, out=indptr[1:])
    data = np.empty(int(indptr[-1]), dtype=dtype)
    indices = np.empty(int(indptr[-1]), dtype=np.int32)
    fill = indptr[:-1].copy()  # next free slot of each gene
    codecs = _codecs()
    for i, (start, *cuts) in enumerate(bounds):
        with open(Path(scratch, f"{i}.pieces"), "rb") as fh:
            fh.seek(int(start))
            raw = fh.read(int(cuts[-1] - start))
        edges = [0, *(int(c - start) for c in cuts)]
        values, steps, counts = (codec.decode(raw[a:b]) for codec, a, b in zip(codecs, edges[:-1], edges[1:]))
        values = np.frombuffer(values, dtype=dtype)
        if values.shape[0] == 0:
            continue
        steps = np.frombuffer(steps, dtype=_step_dtype(int(row_starts[i + 1] - row_starts[i])))
        kernels.place_gene_runs(values, steps, np.frombuffer(counts, dtype=np.uint32), fill, int(row_starts[i]),
                                data, indices)
    return sp.csr_matrix((data, indices, indptr), shape=(g, int(row_starts[-1])))
