"""Writing stores block by block on the Dask workers: ``write_store`` and the CSR/dense writers it uses."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import threading
import uuid
from collections.abc import Iterable
from pathlib import Path

import anndata as ad
import dask
import dask.array as da
import numpy as np
import pandas as pd
import scipy.sparse as sp
import zarr
import zarr.core.array

from atlasflow import lazy, passes, progress
from atlasflow.backend import is_sparse_meta
from atlasflow.sources import source_of
from atlasflow.errors import AtlasflowError, StoreError
from atlasflow.store.commit import atomic_dir, link_tree
from atlasflow.store.format import FULL_CHUNKS, META_KEY, index_dtype
from atlasflow.store.read import read_partial, read_unchanged, unread_elements, writer_of
from atlasflow.compat import named_layers


#: Elements of a 1-D CSR array per Zarr chunk (4 MiB of float32).
FLAT_CHUNK = 1 << 20


def write_store(
    adata: ad.AnnData,
    path: str | os.PathLike,
    *,
    chunk_rows: int | None = None,
    row_nnz: dict[str, np.ndarray] | None = None,
    provenance: dict | None = None,
) -> Path:
    """Write ``adata`` atomically as an AnnData Zarr store at ``path``.

    Lazy elements read unchanged from another store are hard-linked, and so are obs, var and the
    obsm/varm/obsp/varp entries ``open_store`` read that are unchanged (``read_unchanged``) or did not read
    (``skip``, ``unread_elements``); other Dask
    elements are written block by block on the workers. ``row_nnz`` may give, per element key, the non-zeros of each row when
    the caller already knows them (saves one pass over a sparse element).
    """
    path = Path(path)
    row_nnz = row_nnz or {}
    big = {"X": adata.X} if adata.X is not None else {}
    big.update({f"layers/{k}": v for k, v in named_layers(adata).items()})
    if chunk_rows is None:
        chunk_rows = next((int(v.chunks[0][0]) for v in big.values() if isinstance(v, da.Array)), 10_000)
    with atomic_dir(path) as tmp:
        linked = {}  # element key -> the store element it is linked to
        small = {"obs": adata.obs, "var": adata.var}
        for axis in ("obsm", "varm", "obsp", "varp"):
            small.update((f"{axis}/{k}", v) for k, v in getattr(adata, axis).items())
        for key, value in small.items():
            if (src := read_unchanged(value)) is not None:
                linked[key] = src
            elif read_partial(value):
                raise StoreError(f"{key} was opened without its columns (obs_columns=False) and then changed: "
                                 "writing it would drop them; open the store with its obs columns")
        linked.update(unread_elements(adata))  # skipped by open_store and not replaced: linked as they are
        aligned = {axis: {k: v for k, v in getattr(adata, axis).items() if f"{axis}/{k}" not in linked}
                   for axis in ("obsm", "varm", "obsp", "varp")}
        # obs and var to be linked are not written first (for 100k cell names that is ~0.1 s): the skeleton has
        # none, and the aligned elements are written one by one into its groups
        no_rows = pd.DataFrame(index=pd.Index([], dtype=object))
        skeleton = ad.AnnData(obs=no_rows if "obs" in linked else adata.obs,
                              var=no_rows if "var" in linked else adata.var, uns=dict(adata.uns))
        skeleton.write_zarr(tmp)
        groups = zarr.open_group(str(tmp), mode="r+", use_consolidated=False)
        for axis, elems in aligned.items():
            for k, v in elems.items():
                ad.io.write_elem(groups[axis], k, v)
        for key, src in linked.items():
            shutil.rmtree(tmp / key, ignore_errors=True)
            link_tree(src, tmp / key)
        for key, value in big.items():
            write_matrix(tmp, key, value, chunk_rows=chunk_rows, row_nnz=row_nnz.get(key))
        root = zarr.open_group(str(tmp), mode="r+")
        root.attrs[META_KEY] = {
            "store_id": uuid.uuid4().hex,
            "chunk_rows": int(chunk_rows),
            "provenance": provenance or {},
        }
        zarr.consolidate_metadata(str(tmp))
    return path


def write_matrix(root_path: Path, key: str, value, *, chunk_rows: int, row_nnz: np.ndarray | None = None) -> None:
    """Write one matrix element (Dask or in-memory, sparse or dense) under ``root_path/key``."""
    src = source_of(value)
    if src is not None and Path(src[0], src[1]).exists():
        link_tree(Path(src[0]) / src[1], root_path / key)
        return
    chain = lazy.value_chain(value)
    if chain is not None:
        src = source_of(chain[0])
        if src is not None and (Path(src[0]) / src[1] / "indices").exists():
            write_mapped_values(root_path, key, Path(src[0]) / src[1], chain[1], np.dtype(value.dtype))
            passes.add(*src)  # the source's values, read chunk by chunk
            return
    if not isinstance(value, da.Array):
        if sp.issparse(value):
            value = sp.csr_matrix(value)
        value = da.from_array(value, chunks=(chunk_rows, value.shape[1]), asarray=False)
    if is_sparse_meta(value):
        write_csr_dask(root_path, key, value, row_nnz=row_nnz)
    else:
        write_dense_dask(root_path, key, value, chunk_rows=chunk_rows)


#: Zarr chunks of ``data`` rewritten per task by ``write_mapped_values`` (8 x 4 MiB of float32).
MAPPED_CHUNKS_PER_TASK = 8


def write_mapped_values(root_path: Path, key: str, src: Path, steps: list, dtype: np.dtype) -> None:
    """Write a CSR element whose stored values are ``src``'s mapped by ``steps`` (``lazy.value_chain``).

    The structure is the source's: ``indices`` and ``indptr`` are hard-linked, and ``data`` is rewritten
    with the source's chunking, each task reading, mapping and writing whole chunks of its own.
    """
    dst = root_path / key
    src_group = zarr.open_group(str(src), mode="r")
    group = zarr.open_group(str(root_path), mode="a").require_group(key)
    group.attrs.update(dict(src_group.attrs))
    link_tree(src / "indices", dst / "indices")
    link_tree(src / "indptr", dst / "indptr")
    src_data = src_group["data"]
    (nnz,), (chunk,) = src_data.shape, src_data.chunks
    group.create_array("data", shape=(nnz,), chunks=(chunk,), dtype=dtype, fill_value=0, config=FULL_CHUNKS)
    needs_rows = any(s.per_row is not None for s in steps)
    indptr = np.asarray(src_group["indptr"][:], dtype=np.int64) if needs_rows else None
    shared = dask.delayed((indptr, steps), pure=True)  # one key, sent once to each worker
    n_chunks = -(-nnz // chunk) if nnz else 0
    # up to MAPPED_CHUNKS_PER_TASK chunks per task, but at least ~16 tasks so every worker gets some
    step = chunk * max(1, min(MAPPED_CHUNKS_PER_TASK, n_chunks // 16))
    tasks = [dask.delayed(_write_mapped_range, pure=False)(str(src / "data"), str(dst / "data"), lo,
                                                           min(lo + step, nnz), shared, dtype)
             for lo in range(0, nnz, step)]
    if tasks:
        written = sum(progress.compute(*tasks, label=f"writing {key} (values only)"))
        if written != nnz:
            raise AtlasflowError(f"wrote {written} of {nnz} values of {key}")


def _write_mapped_range(src: str, dst: str, lo: int, hi: int, shared, dtype) -> int:
    indptr, steps = shared
    try:
        values = zarr.open_array(src, mode="r")[lo:hi]
    except Exception as exc:  # noqa: BLE001 - a damaged chunk (checksum, truncation)
        store = Path(src).parent.parent
        raise StoreError(f"cannot read values {lo}-{hi} of {src} ({type(exc).__name__}: {exc}); the store is "
                         f"damaged: delete it and re-run {writer_of(store)}") from exc
    rows = None
    if indptr is not None:  # row of each value: rows r0..r1 overlap [lo, hi)
        r0 = int(np.searchsorted(indptr, lo, side="right")) - 1
        r1 = int(np.searchsorted(indptr, hi, side="left"))
        counts = np.diff(np.clip(indptr[r0 : r1 + 1], lo, hi))
        rows = np.repeat(np.arange(r0, r1), counts)
    zarr.open_array(dst, mode="r+")[lo:hi] = lazy.apply_chain(values, rows, steps, dtype)
    return hi - lo


def write_csr_dask(root_path: Path, key: str, x: da.Array, *, row_nnz: np.ndarray | None = None) -> None:
    """Write a Dask array of CSR row blocks as an anndata ``csr_matrix`` element, one task per block.

    Blocks land at offsets known beforehand, so every worker writes its own slice of ``data``/``indices``.
    Zarr chunks straddling two blocks are written under a per-chunk lock: two workers never write one chunk
    unguarded. Without ``row_nnz`` the offsets come from the blocks themselves: each is computed once and
    stashed uncompressed in a scratch folder beside the element (``_stash_blocks``), then copied into place
    (computing every block twice, once to count, read the input twice).
    """
    n, m = x.shape
    stash = None
    if row_nnz is None:
        stash = root_path / f".{key.replace('/', '-')}.pieces-{uuid.uuid4().hex[:8]}"
        x, row_nnz = _stash_blocks(x, stash, key)
    row_nnz = np.asarray(row_nnz, dtype=np.int64)
    if row_nnz.shape[0] != n:
        raise AtlasflowError(f"row_nnz has {row_nnz.shape[0]} rows, matrix has {n}")
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(row_nnz, out=indptr[1:])
    nnz = int(indptr[-1])
    group = zarr.open_group(str(root_path), mode="a").require_group(key)
    group.attrs.update({"encoding-type": "csr_matrix", "encoding-version": "0.1.0", "shape": [int(n), int(m)]})
    dtype = np.dtype(x.dtype)
    chunk = min(FLAT_CHUNK, max(nnz, 1))
    idx = index_dtype(nnz, m)
    group.create_array("data", shape=(nnz,), chunks=(chunk,), dtype=dtype, fill_value=0, config=FULL_CHUNKS)
    group.create_array("indices", shape=(nnz,), chunks=(chunk,), dtype=idx, fill_value=0, config=FULL_CHUNKS)
    group.create_array("indptr", shape=(n + 1,), chunks=(min(FLAT_CHUNK, n + 1),), dtype=idx, fill_value=0, config=FULL_CHUNKS)
    group["indptr"][:] = indptr.astype(idx)
    starts = np.cumsum((0,) + x.chunks[0])[:-1]
    offsets = indptr[starts]
    lock_ns = uuid.uuid4().hex
    done = x.map_blocks(
        _write_csr_block, str(root_path / key), offsets, nnz, chunk, lock_ns,
        drop_axis=1, chunks=((1,) * x.numblocks[0],), dtype=np.int64, meta=np.array([], np.int64),
    )
    written = int(progress.compute(done.sum(), label=f"writing {key}")[0])
    if stash is not None:
        shutil.rmtree(stash)
    if written != nnz:
        raise AtlasflowError(f"wrote {written} of {nnz} non-zeros of {key}: the matrix changed between passes")


def _stash_blocks(x: da.Array, stash: Path, key: str) -> tuple[da.Array, np.ndarray]:
    """Compute every CSR block of ``x`` once into ``.npy`` files under ``stash``; returns the stashed blocks
    (as a Dask array reading them back) and the non-zeros of each row."""
    stash.mkdir()
    (row_nnz,) = progress.compute(x.map_blocks(
        _stash_block, str(stash), drop_axis=1, chunks=(x.chunks[0],), dtype=np.int64, meta=np.array([], np.int64)
    ), label=f"{key}: computing blocks")
    name = f"stashed-{uuid.uuid4().hex}"
    dsk = {(name, i, 0): (_load_stashed, str(stash), i, rows, x.shape[1]) for i, rows in enumerate(x.chunks[0])}
    return da.Array(dsk, name, chunks=(x.chunks[0], (x.shape[1],)), meta=sp.csr_matrix((0, 0), dtype=x.dtype)), row_nnz


def _stash_block(block, stash: str, block_info=None) -> np.ndarray:
    block = sp.csr_matrix(_to_host(block))
    i = block_info[0]["chunk-location"][0]
    for part in ("data", "indices", "indptr"):
        save_npy(Path(stash, f"{i}.{part}.npy"), getattr(block, part))
    return np.diff(block.indptr).astype(np.int64)


def save_npy(final: Path, arr: np.ndarray) -> None:
    """``np.save`` to a hidden sibling, then rename: a retried task replaces the file whole."""
    tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex[:6]}.npy")
    try:
        np.save(tmp, arr)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno is None:  # numpy's tofile reports a short write as "N requested and M written", no errno
            free = os.statvfs(final.parent)
            if free.f_bavail * free.f_frsize < arr.nbytes + 4096:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(final)) from exc
        raise
    os.replace(tmp, final)


def _load_stashed(stash: str, i: int, n_rows: int, n_cols: int) -> sp.csr_matrix:
    data, indices, indptr = (np.load(Path(stash, f"{i}.{part}.npy"), mmap_mode="r")
                             for part in ("data", "indices", "indptr"))
    return sp.csr_matrix((data, indices, indptr), shape=(n_rows, n_cols))


def _write_csr_block(block, path: str, offsets, nnz: int, chunk: int, lock_ns: str, block_info=None):
    block = _to_host(block)
    i = block_info[0]["chunk-location"][0]
    start = int(offsets[i])
    stop = start + block.nnz
    if stop > nnz:
        raise AtlasflowError(f"block {i} of {path} has more non-zeros than counted")
    group = zarr.open_group(path, mode="r+")
    data, indices = group["data"], group["indices"]
    values = np.asarray(block.data, dtype=data.dtype)
    cols = np.asarray(block.indices, dtype=indices.dtype)
    for lo, hi, guarded in _split_by_chunk(start, stop, chunk):
        with _chunk_lock(f"{lock_ns}-{lo // chunk}") if guarded else contextlib.nullcontext():
            data[lo:hi] = values[lo - start : hi - start]
            indices[lo:hi] = cols[lo - start : hi - start]
    return np.array([block.nnz], dtype=np.int64)


def _split_by_chunk(start: int, stop: int, chunk: int) -> list[tuple[int, int, bool]]:
    """Split [start, stop) into the part covering whole Zarr chunks and partial-chunk edges (locked)."""
    if start >= stop:
        return []
    first_full = -(-start // chunk) * chunk
    last_full = (stop // chunk) * chunk
    if first_full >= last_full:  # no whole chunk inside: one or two partial pieces
        pieces, lo = [], start
        while lo < stop:
            hi = min(stop, (lo // chunk + 1) * chunk)
            pieces.append((lo, hi, True))
            lo = hi
        return pieces
    out = []
    if start < first_full:
        out.append((start, first_full, True))
    out.append((first_full, last_full, False))
    if last_full < stop:
        out.append((last_full, stop, True))
    return out


_LOCAL_LOCKS: dict[str, threading.Lock] = {}
_LOCAL_LOCKS_GUARD = threading.Lock()


@contextlib.contextmanager
def _chunk_lock(name: str):
    """A lock shared by every worker of the cluster (or the process, without distributed)."""
    try:
        from distributed import Lock, get_worker

        get_worker()
    except (ImportError, ValueError):
        with _LOCAL_LOCKS_GUARD:
            lock = _LOCAL_LOCKS.setdefault(name, threading.Lock())
        with lock:
            yield
        return
    with Lock(name):
        yield


def write_dense_dask(root_path: Path, key: str, x: da.Array, *, chunk_rows: int) -> None:
    """Write a dense Dask array with Zarr chunks equal to its row blocks (each task owns its chunks)."""
    n, m = x.shape
    passes.count(x)  # older Dask's da.store optimises the graph: its read layers would be gone
    x = x.map_blocks(_to_host, dtype=x.dtype)
    if len(set(x.chunks[0][:-1])) > 1 or (len(x.chunks[0]) > 1 and x.chunks[0][-1] > x.chunks[0][0]):
        x = x.rechunk((chunk_rows, m))
    rows = int(x.chunks[0][0]) if n else 1
    parent = zarr.open_group(str(root_path), mode="a")
    arr = parent.create_array(key, shape=(n, m), chunks=(max(rows, 1), max(m, 1)), dtype=x.dtype, fill_value=0, config=FULL_CHUNKS)
    arr.attrs.update({"encoding-type": "array", "encoding-version": "0.2.0"})
    stored = da.store(x, zarr.open_array(str(root_path / key), mode="r+"), lock=False, compute=False)
    progress.compute(stored, label=f"writing {key}", count_passes=False)


def _to_host(block):
    """Bring a CuPy chunk back to host memory as NumPy/CSR (no copy for host CSR/ndarray chunks)."""
    if hasattr(block, "get") and not isinstance(block, np.ndarray) and not sp.issparse(block):
        block = block.get()
    if sp.issparse(block) and block.format != "csr":
        block = block.tocsr()
    return block


def write_csr_blocks(root_path: Path, key: str, blocks: Iterable[sp.csr_matrix], shape: tuple[int, int]) -> int:
    """Stream CSR row blocks from the client into a new ``csr_matrix`` element; returns non-zeros written.

    For readers of single files (10x h5, mtx, h5ad) where one sequential pass is the natural shape:
    arrays grow chunk by chunk, so memory is bounded by one block.
    """
    n, m = shape
    group = zarr.open_group(str(root_path), mode="a").require_group(key)
    group.attrs.update({"encoding-type": "csr_matrix", "encoding-version": "0.1.0", "shape": [int(n), int(m)]})
    data = indices = None
    indptr = [np.zeros(1, dtype=np.int64)]
    nnz = rows = 0
    for block in blocks:
        block = sp.csr_matrix(block)
        block.sort_indices()
        if data is None:
            data = group.create_array("data", shape=(0,), chunks=(FLAT_CHUNK,), dtype=block.dtype, fill_value=0, config=FULL_CHUNKS)
            indices = group.create_array("indices", shape=(0,), chunks=(FLAT_CHUNK,), dtype=np.int32, fill_value=0, config=FULL_CHUNKS)
        if block.nnz:
            data.resize((nnz + block.nnz,))
            indices.resize((nnz + block.nnz,))
            data[nnz:] = block.data
            indices[nnz:] = block.indices.astype(np.int32, copy=False)
        indptr.append(block.indptr[1:].astype(np.int64) + nnz)
        nnz += block.nnz
        rows += block.shape[0]
    if rows != n:
        raise AtlasflowError(f"{key}: streamed {rows} rows, expected {n}")
    if data is None:
        group.create_array("data", shape=(0,), chunks=(FLAT_CHUNK,), dtype=np.float32, fill_value=0, config=FULL_CHUNKS)
        group.create_array("indices", shape=(0,), chunks=(FLAT_CHUNK,), dtype=np.int32, fill_value=0, config=FULL_CHUNKS)
    idx = index_dtype(nnz, m)
    if idx != np.int32:  # more than 2**31 - 1 non-zeros: indices as wide as indptr (one more pass over them)
        _widen(root_path / key, "indices", idx)
    ptr = np.concatenate(indptr)
    arr = group.create_array("indptr", shape=ptr.shape, chunks=(min(FLAT_CHUNK, ptr.shape[0]),), dtype=idx,
                              config=FULL_CHUNKS)
    arr[:] = ptr.astype(idx)
    return nnz


def _widen(group_path: Path, name: str, dtype) -> None:
    """Rewrite the 1-d array ``name`` of a local Zarr group with a wider dtype, one chunk at a time."""
    group = zarr.open_group(str(group_path), mode="r+")
    old = group[name]
    wide = group.create_array(f".{name}.wide", shape=old.shape, chunks=old.chunks, dtype=dtype, fill_value=0,
                              config=FULL_CHUNKS)
    copy_by_chunk(old, wide)
    shutil.rmtree(group_path / name)
    os.rename(group_path / f".{name}.wide", group_path / name)


def copy_by_chunk(src, dst) -> None:
    """Copy a 1-d array (Zarr or h5py) into ``dst``, cast to its dtype, one chunk of ``src`` at a time."""
    step = src.chunks[0] if src.chunks else max(src.shape[0], 1)  # an unchunked h5py dataset: at once
    for lo in range(0, src.shape[0], step):
        dst[lo : lo + step] = src[lo : lo + step].astype(dst.dtype)
