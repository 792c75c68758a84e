"""AnnData Zarr stores out of core: lazy open, block-wise writes on the workers, linking, atomic commit.

A store is a plain AnnData Zarr group (``anndata.read_zarr`` opens it). We read and write the large
elements (``X`` and ``layers/*``) ourselves so that

* reading gives a Dask array of row chunks (CSR chunks for sparse, ndarray chunks for dense) and nothing
  is loaded until a task needs its rows;
* writing runs on the Dask workers, one task per row block, never gathering the matrix on the client;
* an element a stage did not change is hard-linked (file by file, copying where links are impossible)
  from the input store instead of being rewritten;
* the output appears under its final name only once complete (write to a temporary sibling, rename).

Small elements (obs, var, obsm, varm, obsp, uns) go through anndata's own reader and writer; obs, var and the
obsm/varm/obsp/varp entries a stage left unchanged are hard-linked like X.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import shutil
import threading
import uuid
import warnings
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path

import anndata as ad
import dask
import dask.array as da
import numpy as np
import pandas as pd
import scipy.sparse as sp
import zarr
import zarr.core.array
from dask.base import tokenize

from atlasflow import integrity, kernels, lazy, ownership, progress
from atlasflow.errors import AtlasflowError, StoreError

#: Elements of a 1-D CSR array per Zarr chunk (4 MiB of float32).
FLAT_CHUNK = 1 << 20
warnings.filterwarnings("ignore", message=".*autosharding.*")
warnings.filterwarnings("ignore", message="Consolidated metadata is currently not part")
# uns entries that anndata writes as NumPy structured arrays (rank_genes_groups' names/scores/pvals, one
# field per group) or fixed-length strings have no Zarr v3 data-type specification yet: zarr-python warns on
# every such array. They are what scanpy reads back (sc.get.rank_genes_groups_df, sc.pl.rank_genes_groups),
# anndata reads them on both stacks, and our tests read them back; see config/README.md, "Stored form".
warnings.filterwarnings("ignore", message=".*does not have a Zarr V3 specification.*")
# Zarr format 3 everywhere (anndata's coming default); anndata >= 0.11 and scanpy read it.
ad.settings.zarr_write_format = 3

#: Write every chunk, even all-zero ones, so a missing chunk file always means damage (see check_complete).
#: Set globally too: arrays reopened on the workers do not keep a per-array runtime config.
FULL_CHUNKS = {"write_empty_chunks": True}
zarr.config.set({"array.write_empty_chunks": True})
INT32_MAX = int(np.iinfo(np.int32).max)


def index_dtype(nnz: int, n_cols: int) -> np.dtype:
    """The one dtype of a stored CSR's ``indptr`` and ``indices``: int32 while every offset and column fits,
    else int64, as scipy builds them. A loaded matrix whose two differ (int64 indptr, int32 indices) makes
    scipy's sparse routines fail ("Output dtype not compatible with inputs"), e.g. in scanpy's
    rank_genes_groups or ``X.eliminate_zeros()``."""
    return np.dtype(np.int32 if max(int(nnz), int(n_cols)) <= INT32_MAX else np.int64)


#: Zarr chunks encoded or decoded at once per read/write call. Zarr's default (10) keeps ~10 chunks of
#: buffers alive per call (~67 MiB extra to write a 9.6M-element block, measured); 4 costs no speed
#: on local or parallel filesystems here and cuts that to ~30 MiB. Env ATLASFLOW_ZARR_CONCURRENCY.
zarr.config.set({"async.concurrency": int(os.environ.get("ATLASFLOW_ZARR_CONCURRENCY", "4"))})
#: Every chunk atlasflow writes carries zstd's content checksum (xxh64 of the chunk, checked when it is
#: decompressed), so a flipped bit is a read error, not a silently changed value. Zarr 3 hard-codes its
#: default compressor (zstd level 0, no checksum) in ``zarr.core.array.default_compressors_v3``: this replaces
#: that default for every array created in this process (ours and anndata's); tests/test_store.py checks
#: that the stored metadata of every array of a written store says ``checksum: true``.
def _checksummed_zstd(dtype=None):
    return (zarr.codecs.ZstdCodec(level=0, checksum=True),)


zarr.core.array.default_compressors_v3 = _checksummed_zstd
#: Key under the root attributes where atlasflow keeps its bookkeeping.
META_KEY = "atlasflow"

# dask array name -> (store path, element path): lets ``write_store`` link elements a stage left alone.
_SOURCES: dict[str, tuple[str, str]] = {}


# --------------------------------------------------------------------------------------------------
# reading


#: Backend a stage script asked for (atlasflow.cli sets it); "gpu" puts opened matrices on the device.
DEFAULT_BACKEND = "cpu"


def open_store(path: str | os.PathLike, *, chunk_rows: int | None = None, backend: str | None = None,
               obs_columns: bool = True) -> ad.AnnData:
    """Open an AnnData Zarr store lazily: X and layers as Dask arrays of row chunks, the rest in memory.

    With ``backend="gpu"`` (default: the stage's ``--backend``) the row blocks become CuPy chunks. With
    ``obs_columns=False`` obs holds only the cell names (for stages that never look at obs: reading and
    fingerprinting a QC'd obs costs ~0.2 s at 100k cells); written unchanged it is linked whole, and
    ``write_store`` refuses to write it changed (that would drop the columns it never read).
    """
    path = Path(path)
    if not path.exists():
        raise StoreError(f"store {path} does not exist")
    try:
        root = zarr.open_group(str(path), mode="r")
    except Exception as exc:  # noqa: BLE001 - zarr raises several types for a broken group
        raise StoreError(f"{path} is not a readable Zarr store ({exc})") from exc
    integrity.verify_store(path)  # every array's chunk files and shapes: Zarr would read zeros
    chunk_rows, store_id = _chunking_and_id(root, path, chunk_rows)

    def small(key):
        if key not in root:
            return None
        try:
            return ad.io.read_elem(root[key])
        except Exception as exc:  # noqa: BLE001
            raise StoreError(f"cannot read {key!r} of {path} ({type(exc).__name__}: {exc}); the store is damaged: "
                             f"delete it and re-run {writer_of(path)}") from exc

    obs = small("obs") if obs_columns else _names_only(root, "obs", path)
    var = small("var")
    if obs is None or var is None:
        raise StoreError(f"{path} has no obs/var: not an AnnData store")
    X = lazy_elem(path, "X", chunk_rows=chunk_rows, store_id=store_id) if "X" in root else None
    layers = {}
    if "layers" in root:
        for key in root["layers"]:
            layers[key] = lazy_elem(path, f"layers/{key}", chunk_rows=chunk_rows, store_id=store_id)
    adata = ad.AnnData(
        X=X,
        obs=obs,
        var=var,
        layers=layers or None,
        obsm=small("obsm"),
        varm=small("varm"),
        obsp=small("obsp"),
        varp=small("varp"),
        uns=small("uns"),
    )
    remember_read(adata, path, partial_obs=not obs_columns)
    from atlasflow.backend import to_backend

    return to_backend(adata, backend or DEFAULT_BACKEND)


# id of an in-memory element ``open_store`` read -> (weak reference, store path, element key, fingerprint):
# lets ``write_store`` link obs, var, obsm, varm, obsp and varp elements a stage left as they were.
_READ: dict[int, tuple] = {}


def _chunking_and_id(root, path: Path, chunk_rows: int | None) -> tuple[int, str]:
    """The row chunk to read a store with (``chunk_rows``, else the store's own, else 10,000) and its id."""
    meta = dict(root.attrs.get(META_KEY, {}))
    if chunk_rows is None:
        chunk_rows = int(meta.get("chunk_rows", 10_000))
    return chunk_rows, meta.get("store_id", str(path.resolve()))


def _names_only(root, axis: str, path: Path) -> pd.DataFrame | None:
    """obs (or var) as a frame of its index alone, read without its columns."""
    if axis not in root:
        return None
    try:
        group = root[axis]
        return pd.DataFrame(index=pd.Index(ad.io.read_elem(group[group.attrs["_index"]]), name=None))
    except Exception as exc:  # noqa: BLE001
        raise StoreError(f"cannot read {axis} names of {path}: {exc}") from exc


def remember_read(adata: ad.AnnData, path: Path, partial_obs: bool = False) -> None:
    """Record the in-memory elements just read from ``path``, so an unchanged one is linked when written.

    obs and var are fingerprinted (a stage often adds columns in place); obsm/varm/obsp/varp arrays and
    CSR/CSC matrices are made read-only instead (free; changing one in place raises), so the same object
    means the same values. ``partial_obs``: obs was read without its columns.
    """
    entries = [("obs", adata.obs, _frame_fingerprint(adata.obs), partial_obs),
               ("var", adata.var, _frame_fingerprint(adata.var), False)]
    for axis in ("obsm", "varm", "obsp", "varp"):
        entries += [(f"{axis}/{k}", v, None, False) for k, v in getattr(adata, axis).items() if _freeze(v)]
    for key, obj, fingerprint, partial in entries:
        ref = weakref.ref(obj, functools.partial(_forget, id(obj)))
        _READ[id(obj)] = (ref, str(path), key, fingerprint, partial)


def read_unchanged(obj) -> Path | None:
    """Where ``obj`` was read from, if it is an element ``open_store`` read and it has not changed since."""
    entry = _read_entry(obj)
    if entry is None:
        return None
    ref, path, key, fingerprint, _ = entry
    same = _frame_fingerprint(obj) == fingerprint if fingerprint is not None else _is_frozen(obj)
    src = Path(path) / key
    return src if same and src.exists() else None


def read_partial(obj) -> bool:
    """Whether ``obj`` is a frame ``open_store`` read without its columns (``obs_columns=False``)."""
    entry = _read_entry(obj)
    return entry is not None and entry[4]


def _read_entry(obj) -> tuple | None:
    entry = _READ.get(id(obj))
    return entry if entry is not None and entry[0]() is obj else None


def _forget(obj_id: int, ref) -> None:
    entry = _READ.get(obj_id)
    if entry is not None and entry[0] is ref:
        del _READ[obj_id]


def _frame_fingerprint(df: pd.DataFrame) -> bytes:
    """A digest of a DataFrame's values, index, column names and dtypes (categories included)."""
    import hashlib

    h = hashlib.blake2b(digest_size=20)
    h.update(pd.util.hash_pandas_object(df, index=True).to_numpy().tobytes())
    h.update(repr([(c, str(t), list(t.categories) if isinstance(t, pd.CategoricalDtype) else None)
                   for c, t in df.dtypes.items()]).encode())
    h.update(repr((df.index.name, str(df.index.dtype), df.shape)).encode())
    return h.digest()


def _sparse_parts(v) -> list[np.ndarray] | None:
    return [v.data, v.indices, v.indptr] if sp.issparse(v) and v.format in ("csr", "csc") else None


def _freeze(v) -> bool:
    """Make an ndarray or a CSR/CSC matrix read-only; False for other kinds (they are not tracked)."""
    parts = [v] if isinstance(v, np.ndarray) else _sparse_parts(v)
    if parts is None:
        return False
    for a in parts:
        a.flags.writeable = False
    return True


def _is_frozen(v) -> bool:
    parts = [v] if isinstance(v, np.ndarray) else _sparse_parts(v)
    return parts is not None and not any(a.flags.writeable for a in parts)


def open_matrix(path: str | os.PathLike, key: str = "X", *,
                chunk_rows: int | None = None) -> tuple[da.Array, pd.Index, pd.Index]:
    """One matrix of a store (lazy, as ``open_store`` gives it) with the obs and var names, without reading
    obs, var or anything else (each column read costs a few ms): for a stage that only borrows a matrix."""
    path = Path(path)
    try:
        root = zarr.open_group(str(path), mode="r")
        if key not in root:
            raise StoreError(f"{path} has no {key}")
        integrity.verify_store(path, keys=(key,))
        names = [_names_only(root, axis, path).index for axis in ("obs", "var")]
    except StoreError:
        raise
    except Exception as exc:  # noqa: BLE001 - zarr/anndata raise several types for a broken store
        raise StoreError(f"{path} is not a readable AnnData store ({exc})") from exc
    chunk_rows, store_id = _chunking_and_id(root, path, chunk_rows)
    return lazy_elem(path, key, chunk_rows=chunk_rows, store_id=store_id), names[0], names[1]


def lazy_elem(path: Path, key: str, *, chunk_rows: int, store_id: str) -> da.Array:
    """One matrix element of a store as a Dask array of ``chunk_rows`` row blocks."""
    root = zarr.open_group(str(path), mode="r")
    node = root[key]
    enc = node.attrs.get("encoding-type", "array")
    for sub in ("data", "indices", "indptr") if enc == "csr_matrix" else ("",):
        check_complete(path, f"{key}/{sub}".rstrip("/"))
    if enc == "csr_matrix":
        return _lazy_csr(path, key, node, chunk_rows, store_id)
    if enc == "array":
        arr = zarr.open_array(str(path / key), mode="r")
        name = f"read-{tokenize(store_id, key, chunk_rows)}"
        bounds = row_bounds(arr.shape[0], chunk_rows)
        dsk = {(name, i, 0): (_read_dense_block, str(path), key, s, e) for i, (s, e) in enumerate(bounds)}
        if not bounds:
            dsk = {(name, 0, 0): (np.zeros, (0, arr.shape[1]), arr.dtype)}
        chunks = (tuple(e - s for s, e in bounds) or (0,), (arr.shape[1],))
        x = da.Array(dsk, name, chunks=chunks, meta=np.empty((0, 0), dtype=arr.dtype))
        _SOURCES[x.name] = (str(path), key)
        return x
    raise StoreError(f"{path}/{key}: encoding {enc!r} is not supported (need csr_matrix or dense array)")


def check_complete(path: Path, key: str) -> None:
    """Fail if chunk files of an array are missing (Zarr would silently read them as zeros)."""
    arr = zarr.open_array(str(path / key), mode="r")
    expected = int(np.prod([-(-s // c) for s, c in zip(arr.shape, arr.chunks, strict=True)])) if arr.size else 0
    chunk_dir = path / key / "c"
    found = sum(len(files) for _, _, files in os.walk(chunk_dir)) if chunk_dir.exists() else 0
    if arr.metadata.zarr_format == 2:
        found = sum(1 for f in (path / key).iterdir() if not f.name.startswith("."))
    if found < expected:
        raise StoreError(
            f"{path} is damaged: {key} has {found} of {expected} chunk files; "
            f"delete it and re-run {writer_of(path)}"
        )


def provenance(path: str | os.PathLike) -> dict:
    """The provenance a stage recorded in its store (the stage and its parameters); {} when unreadable."""
    try:
        return dict(zarr.open_group(str(path), mode="r").attrs.get(META_KEY, {}).get("provenance", {}))
    except Exception:  # noqa: BLE001
        return {}


def writer_of(path: Path) -> str:
    """'the <stage> stage' that wrote a store, from its provenance (for error messages)."""
    stage = provenance(path).get("stage")
    return f"the {stage} stage" if stage else "the stage that wrote it"


def require(adata: ad.AnnData, store: str | os.PathLike, stage: str, **needed: list[str]) -> None:
    """Fail with one line listing every obs/var/obsm/obsp/uns key a stage needs but the store lacks."""
    missing = []
    for slot, keys in needed.items():
        have = getattr(adata, slot)
        have = have.columns if slot in ("obs", "var") else have.keys()
        missing += [f"{slot}[{k!r}]" for k in keys if k not in have]
    if missing:
        raise StoreError(f"{store} lacks {', '.join(missing)} needed by the {stage} stage")


def _lazy_csr(path: Path, key: str, node, chunk_rows: int, store_id: str) -> da.Array:
    n, m = (int(s) for s in node.attrs["shape"])
    try:
        indptr = np.asarray(node["indptr"][:], dtype=np.int64)
    except Exception as exc:  # noqa: BLE001
        raise StoreError(f"{path}/{key}/indptr is unreadable ({exc}); re-run {writer_of(path)}") from exc
    if indptr.shape[0] != n + 1:
        raise StoreError(f"{path}/{key}: indptr has {indptr.shape[0]} entries for {n} rows")
    nnz = int(node["data"].shape[0])
    if n and (int(indptr[-1]) != nnz or int(indptr[0]) != 0 or bool(np.any(np.diff(indptr) < 0))):
        raise StoreError(f"{path} is damaged: {key}/indptr does not describe its {nnz} stored values "
                         f"(ends at {int(indptr[-1])}); delete it and re-run {writer_of(path)}")
    dtype = node["data"].dtype
    bounds = row_bounds(n, chunk_rows)
    name = f"read-csr-{tokenize(store_id, key, chunk_rows)}"
    dsk = {
        (name, i, 0): (_read_csr_block, str(path), key, indptr[s : e + 1].copy(), m)
        for i, (s, e) in enumerate(bounds)
    }
    chunks = (tuple(e - s for s, e in bounds) or (0,), (m,))
    if not bounds:
        dsk = {(name, 0, 0): (sp.csr_matrix, (0, m), None, dtype)}
    x = da.Array(dsk, name, chunks=chunks, meta=sp.csr_matrix((0, 0), dtype=dtype))
    _SOURCES[x.name] = (str(path), key)
    return x


def _read_csr_block(path: str, key: str, indptr: np.ndarray, n_cols: int) -> sp.csr_matrix:
    start, stop = int(indptr[0]), int(indptr[-1])
    data, indices = _read_stored(path, key, ("data", "indices"), start, stop)
    return sp.csr_matrix((data, indices.astype(np.int32, copy=False), indptr - start), shape=(len(indptr) - 1, n_cols))


def _read_dense_block(path: str, key: str, start: int, stop: int) -> np.ndarray:
    """Rows ``start:stop`` of a stored dense matrix; a damaged chunk (checksum, truncation) is a StoreError."""
    try:
        return zarr.open_array(str(Path(path) / key), mode="r")[start:stop]
    except Exception as exc:  # noqa: BLE001 - zarr/numcodecs raise several types for a damaged chunk
        raise StoreError(
            f"cannot read rows {start}-{stop} of {path}/{key} ({type(exc).__name__}: {exc}); "
            f"the store is damaged: delete it and re-run {writer_of(Path(path))}"
        ) from exc


def stored_row_sums(x) -> da.Array | None:
    """Per-row float64 sums of a CSR matrix read unchanged from a store, from its stored values alone (the
    column indices, about half the bytes, are not read); None for any other array.

    The same numbers as ``kernels.row_sums`` on the blocks: each row's values added in stored order.
    """
    src = source_of(x)
    if src is None or not _is_sparse_meta(x):
        return None
    path, key = src
    indptr = np.asarray(zarr.open_group(path, mode="r")[key]["indptr"][:], dtype=np.int64)
    starts = np.cumsum((0,) + x.chunks[0])
    name = f"stored-row-sums-{tokenize(x.name)}"
    dsk = {(name, i): (_row_sums_of_values, path, key, indptr[s : e + 1].copy())
           for i, (s, e) in enumerate(zip(starts[:-1], starts[1:]))}
    return da.Array(dsk, name, chunks=(x.chunks[0],), dtype=np.float64, meta=np.empty((0,), np.float64))


def _row_sums_of_values(path: str, key: str, indptr: np.ndarray) -> np.ndarray:
    (data,) = _read_stored(path, key, ("data",), int(indptr[0]), int(indptr[-1]))
    rows = kernels._row_ids_of(indptr - indptr[0], np)
    return np.bincount(rows, weights=data.astype(np.float64), minlength=indptr.shape[0] - 1)


def _read_stored(path: str, key: str, parts: tuple[str, ...], start: int, stop: int) -> list[np.ndarray]:
    """Entries ``start:stop`` of the given arrays of a stored CSR element; a damaged or truncated store is a
    StoreError that says which stage to re-run."""
    try:
        group = zarr.open_group(path, mode="r")[key]
        arrays = [group[part][start:stop] for part in parts]
    except Exception as exc:  # noqa: BLE001
        raise StoreError(
            f"cannot read rows of {path}/{key} ({type(exc).__name__}: {exc}); "
            f"the store is damaged: delete it and re-run {writer_of(Path(path))}"
        ) from exc
    if any(a.shape[0] != stop - start for a in arrays):
        raise StoreError(f"{path}/{key} is truncated; delete it and re-run {writer_of(Path(path))}")
    return arrays


def row_bounds(n_rows: int, chunk_rows: int) -> list[tuple[int, int]]:
    """Half-open row ranges of consecutive blocks of ``chunk_rows`` rows."""
    return [(s, min(s + chunk_rows, n_rows)) for s in range(0, n_rows, max(1, int(chunk_rows)))]


def source_of(x) -> tuple[str, str] | None:
    """The (store, element) a lazy array was read from unchanged, or None if it was computed."""
    return _SOURCES.get(getattr(x, "name", None))


# --------------------------------------------------------------------------------------------------
# writing


def temporary_sibling(path: Path) -> Path:
    """A fresh hidden name beside ``path`` to write it under before renaming it into place.

    Temporaries of ``path`` that a killed earlier run left behind are removed first (Snakemake's lock
    ensures no other run is writing the same output).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
    return path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling of ``path``; on success replace ``path`` by it, on failure remove it.

    ``path`` may only be absent or a store atlasflow wrote (``ownership``); anything else is refused.
    """
    path = Path(path)
    ownership.check_replaceable(path, "store")  # a user's folder or file is never replaced
    tmp = None  # stays None when the output's folder cannot even be created
    try:
        tmp = temporary_sibling(path)
        tmp.mkdir()
        yield tmp
        ownership.check_replaceable(path, "store")  # again: something may have appeared there meanwhile
        if os.path.lexists(path):
            shutil.rmtree(path)
        os.rename(tmp, path)
    except BaseException as exc:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT,
                                                      errno.EPERM):
            raise StoreError(f"cannot write {path}: {exc.strerror or exc}") from exc
        raise


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
    obsm/varm/obsp/varp entries ``open_store`` read that are unchanged (``read_unchanged``); other Dask
    elements are written block by block on the workers. ``row_nnz`` may give, per element key, the non-zeros of each row when
    the caller already knows them (saves one pass over a sparse element).
    """
    path = Path(path)
    row_nnz = row_nnz or {}
    big = {"X": adata.X} if adata.X is not None else {}
    big.update({f"layers/{k}": v for k, v in adata.layers.items()})
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
            return
    if not isinstance(value, da.Array):
        if sp.issparse(value):
            value = sp.csr_matrix(value)
        value = da.from_array(value, chunks=(chunk_rows, value.shape[1]), asarray=False)
    if _is_sparse_meta(value):
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


def _is_sparse_meta(x: da.Array) -> bool:
    meta = x._meta
    return sp.issparse(meta) or type(meta).__module__.startswith("cupyx.scipy.sparse")


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
    x = x.map_blocks(_to_host, dtype=x.dtype)
    if len(set(x.chunks[0][:-1])) > 1 or (len(x.chunks[0]) > 1 and x.chunks[0][-1] > x.chunks[0][0]):
        x = x.rechunk((chunk_rows, m))
    rows = int(x.chunks[0][0]) if n else 1
    parent = zarr.open_group(str(root_path), mode="a")
    arr = parent.create_array(key, shape=(n, m), chunks=(max(rows, 1), max(m, 1)), dtype=x.dtype, fill_value=0, config=FULL_CHUNKS)
    arr.attrs.update({"encoding-type": "array", "encoding-version": "0.2.0"})
    stored = da.store(x, zarr.open_array(str(root_path / key), mode="r+"), lock=False, compute=False)
    progress.compute(stored, label=f"writing {key}")


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


def link_tree(src: Path, dst: Path) -> None:
    """Recreate ``src`` under ``dst`` with hard links to its files (copies where linking fails)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.is_file():
        _link_or_copy(src, dst)
        return
    for dirpath, _dirnames, filenames in os.walk(src):
        rel = Path(dirpath).relative_to(src)
        (dst / rel).mkdir(parents=True, exist_ok=True)
        for fname in filenames:
            _link_or_copy(Path(dirpath) / fname, dst / rel / fname)


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EROFS, errno.EACCES):
            raise
        shutil.copy2(src, dst)


# --------------------------------------------------------------------------------------------------
# summaries


def write_summary(path: str | os.PathLike, summary: dict) -> Path:
    """Write a stage's JSON summary atomically (temporary file, then rename); refused over a user's file."""
    path = Path(path)
    ownership.check_replaceable(path, "file")
    tmp = temporary_sibling(path)
    try:
        tmp.write_text(json.dumps(_jsonable(summary), indent=2, sort_keys=True) + "\n")
        ownership.replace_file(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, pd.Series):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    return obj


def compute(*arrays):
    """``dask.compute`` for several reductions at once, so X is read a single time."""
    return dask.compute(*arrays)
